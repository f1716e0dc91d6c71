"""``python -m flashlab bench tpu-blocks``: the default-blocks table from the stored static runs.

``bench tpu-static --blocks-table`` ranks only the rows of the run it just made. The stored
runs (:data:`flashlab.dispatch.static_table.STORED` at the main shape,
:data:`~flashlab.dispatch.static_table.STORED_SHAPES` at the others, one run each) hold every
block pair the sweep measured; this command ranks all of flashlab's rows there, per (kernel,
chip, shape class), and writes the winners to the table
:func:`flashlab.kernels.blocks.choose_block_sizes` reads (:mod:`flashlab.kernels.tuned_blocks`).
It compiles nothing and needs no libtpu.
Static estimates: no DMA stalls, no HBM bandwidth.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from flashlab.dispatch import static_table
from flashlab.kernels import tuned_blocks

STORED = (static_table.STORED, *static_table.STORED_SHAPES)    # the main shape, the others

__all__ = ["main", "parser", "STORED"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m flashlab bench tpu-blocks",
        description="rank flashlab's block pairs in the stored static runs and write the "
                    "fastest per (kernel, chip, shape class) to the default-blocks table "
                    "(static schedule, not wall time)")
    p.add_argument("--runs", nargs="+", metavar="PATH", default=[str(s) for s in STORED],
                   help="stored runs of 'bench tpu-static --json' (default: %(default)s)")
    p.add_argument("--table", metavar="PATH", default=str(tuned_blocks.TABLE),
                   help="the table to update (default: %(default)s)")
    p.add_argument("--dry-run", action="store_true", help="print the winners, write nothing")
    return p


def main(argv=None) -> int:
    from flashlab.benchmarks.tpu_static import _commit
    p = parser()
    a = p.parse_args(argv)
    for path in a.runs:
        if not Path(path).is_file():
            p.error(f"--runs: no stored run at {path!r}")
    command = "python -m flashlab bench tpu-blocks " + " ".join(
        sys.argv[1:] if argv is None else argv)
    entries = tuned_blocks.entries_from_stored(a.runs, command=command.strip(),
                                               commit=_commit())
    key = tuned_blocks.class_key
    old = {key(e): e for e in tuned_blocks.table(a.table)} if Path(a.table).exists() else {}
    for e in sorted(entries, key=key):
        was = old.get(key(e))
        change = "" if was is None else (
            "  (unchanged)" if (was["block_q"], was["block_k"]) == (e["block_q"], e["block_k"])
            else f"  (was {was['block_q']}x{was['block_k']})")
        print(f"{e['kernel']:8} {e['chip']:4} {e['dtype']:8} causal={e['causal']!s:5} "
              f"d={e['head_dim']:<3} T in [{e['seq_min']}, {e['seq_max']}]: "
              f"{e['block_q']}x{e['block_k']} ({len(e['tried'])} pairs){change}")
    if not a.dry_run:
        tuned_blocks.write(a.table, entries)
        print(f"wrote {len(entries)} entries to {a.table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
