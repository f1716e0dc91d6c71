#!/usr/bin/env python3
"""The README's two commands.

    python3 .ci/dev.py book   # set up .venv, build the rendered book, print index.html's path
    python3 .ci/dev.py test   # set up .venv, run unit tests, nbval over every notebook, book build

Needs only Python >= 3.11 and git. The environment lives in .venv and is rebuilt when
requirements.txt or pyproject.toml change.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv"
BIN = VENV / "bin"
PY = BIN / "python"


def sh(*cmd, ok=(0,), env=None) -> int:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    rc = subprocess.call([str(c) for c in cmd], cwd=ROOT, env=env)
    if rc not in ok:
        sys.exit(f"dev.py: command failed with exit code {rc}: {' '.join(map(str, cmd))}")
    return rc


def ensure_venv() -> None:
    if sys.version_info < (3, 11):
        sys.exit(f"dev.py: needs Python >= 3.11, this is {sys.version.split()[0]}")
    stamp_src = b"".join((ROOT / f).read_bytes() for f in ("requirements.txt", "pyproject.toml"))
    stamp = hashlib.sha256(stamp_src + sys.version.encode()).hexdigest()
    stamp_file = VENV / ".flashlab-stamp"
    if PY.exists() and stamp_file.exists() and stamp_file.read_text() == stamp:
        return
    if not PY.exists():
        sh(sys.executable, "-m", "venv", VENV)
    sh(PY, "-m", "pip", "install", "-q", "--upgrade", "pip")
    sh(PY, "-m", "pip", "install", "-q", "-r", "requirements.txt", "-e", ".")
    stamp_file.write_text(stamp)


def env() -> dict:
    e = dict(os.environ)
    e["PATH"] = f"{BIN}{os.pathsep}{e.get('PATH', '')}"
    e.setdefault("PYTHONHASHSEED", "0")
    e.pop("XLA_FLAGS", None)        # tests that need simulated devices set it themselves
    return e


def build_book() -> Path:
    # Renders the notebooks from their stored outputs (no execution); warnings are errors.
    sh(BIN / "jupyter-book", "build", "book", "--warningiserror", "--nitpick", "--keep-going",
       env=env())
    html = ROOT / "book" / "_build" / "html"
    check_launch_links(html)
    return html / "index.html"


def check_launch_links(html: Path) -> None:
    """Every chapter page must open notebooks/NN_x.ipynb (not a copy's path) in Colab."""
    import re
    import tomllib
    repo = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]["Repository"]
    owner_repo = repo.removeprefix("https://github.com/")
    for nb in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        page = html / "notebooks" / f"{nb.stem}.html"
        want = f"https://colab.research.google.com/github/{owner_repo}/blob/main/notebooks/{nb.name}"
        if not page.exists() or want not in page.read_text():
            sys.exit(f"dev.py: {page} lacks the Colab launch link {want}")


def pytest(*args) -> None:
    # Exit code 5 means "no tests collected": for us that is a broken suite, not a pass.
    rc = sh(PY, "-m", "pytest", *args, ok=(0, 5), env=env())
    if rc == 5:
        sys.exit(f"dev.py: pytest collected no tests for {' '.join(args)}")


def main(argv: list[str]) -> None:
    if len(argv) != 1 or argv[0] not in ("book", "test"):
        sys.exit(__doc__)
    t0 = time.time()
    ensure_venv()
    if argv[0] == "test":
        pytest("tests", "-n", "2", "-q")
        # one notebook per worker (--dist loadfile): a notebook's cells share one kernel
        pytest("--nbval", "--nbval-current-env", "--nbval-sanitize-with",
               "notebooks/sanitize.cfg", "notebooks", "-p", "no:cacheprovider", "-q",
               "-n", "2", "--dist", "loadfile")
    index = build_book()
    print(f"dev.py: {argv[0]} finished in {time.time() - t0:.0f} s")
    print(f"book: {index}")


if __name__ == "__main__":
    main(sys.argv[1:])
