"""``python -m flashlab <command>``: command-line entry points (``bench``, ``ring``)."""
from __future__ import annotations

import sys

COMMANDS = {"bench": "flashlab.benchmarks.backends", "ring": "flashlab.scale.ring_cli"}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        print("usage: python -m flashlab {" + ",".join(COMMANDS) + "} [options]\n"
              "  bench    benchmark the attention backends on this device "
              "(python -m flashlab bench --help)\n"
              "  ring     ring attention across processes on 127.0.0.1 "
              "(python -m flashlab ring --help)", file=sys.stderr)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    import importlib
    return importlib.import_module(COMMANDS[argv[0]]).main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
