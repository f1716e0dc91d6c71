#!/usr/bin/env python3
"""The README's two commands.

    python3 .ci/dev.py book   # set up .venv, build the rendered book, print index.html's path
    python3 .ci/dev.py test   # set up .venv, run unit tests, the JAX-range legs, nbval over
                              # every notebook, book build

Needs only Python >= 3.11 and git. The environment lives in .venv and is rebuilt when
requirements.txt or pyproject.toml change.

The JAX-range legs check both ends of the supported range in pyproject.toml
(``jax>=LOW,<HIGH``): ``.venv-jax-oldest`` (this Python, ``jax==LOW``) and
``.venv-jax-newest`` (the newest Python >= 3.12 found, the newest jax pip resolves below
HIGH, with libtpu) each run the ``compat`` tests (tests/test_compat.py); the newest leg also
compiles the base row of the TPU compile matrix with the newest TPU compiler. A missing Python >= 3.12 skips
the newest leg with a printed message; set FLASHLAB_NEWEST_PYTHON to choose the interpreter.
"""
from __future__ import annotations

import glob
import hashlib
import os
import re
import shutil
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
    # libtpu (the TPU compiler, from jax[tpu] in requirements.txt) is installed: the tests run
    # on CPU and load it only to compile (flashlab.instruments.tpu_compile), and they must not skip.
    e.setdefault("JAX_PLATFORMS", "cpu")
    e["FLASHLAB_REQUIRE_LIBTPU"] = "1"
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


def pytest(*args, py=PY, environ=None) -> None:
    # Exit code 5 means "no tests collected": for us that is a broken suite, not a pass.
    rc = sh(py, "-m", "pytest", *args, ok=(0, 5), env=environ or env())
    if rc == 5:
        sys.exit(f"dev.py: pytest collected no tests for {' '.join(args)}")


# ----------------------------------------------------------------------------- JAX-range legs

COMPAT_TESTS = ("tests/test_compat.py", "-m", "compat")
# The newest leg also installs libtpu (jax[tpu]) and compiles the base row of the TPU compile
# matrix (forward + both backward kernels, 5 chips x default/largest blocks) with the newest
# compiler: the one TPU users get today. The full matrix runs in .venv (tests/).
NEWEST_TPU_TESTS = ("tests/test_tpu_compile_matrix.py", "-k", "base", "-m", "tpu_compile")


def jax_range() -> tuple[str, str]:
    """``(low, high)`` of ``jax>=low,<high`` in pyproject.toml's dependencies."""
    import tomllib
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for d in deps:
        m = re.fullmatch(r"jax\s*>=\s*([\w.]+)\s*,\s*<\s*([\w.]+)", d.strip())
        if m:
            return m.group(1), m.group(2)
    sys.exit("dev.py: pyproject.toml must state the JAX range as 'jax>=LOW,<HIGH'")


def _python_version(exe: str) -> tuple[int, int] | None:
    try:
        out = subprocess.run([exe, "-c", "import sys; print(*sys.version_info[:2])"],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:      # e.g. a pyenv shim for a version that is not selected
        return None
    major, minor = map(int, out.stdout.split())
    return major, minor


def newest_python() -> str | None:
    """A Python >= 3.12 (newer JAX releases need it): $FLASHLAB_NEWEST_PYTHON, PATH, pyenv."""
    cands = [os.environ.get("FLASHLAB_NEWEST_PYTHON")]
    cands += [shutil.which(f"python3.{m}") for m in (12, 13, 14)]
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    cands += sorted(glob.glob(str(pyenv / "versions" / "3.1[2-9]*" / "bin" / "python3")))
    for exe in cands:
        if exe and (_python_version(exe) or (0, 0)) >= (3, 12):
            return exe
    return None


def compat_venv(venv: Path, python: str, jax_spec: list[str]) -> Path:
    """A venv with flashlab (editable), ``jax_spec``, pytest and hypothesis; reused if unchanged."""
    py = venv / "bin" / "python"
    stamp = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + " ".join(
        [python, *jax_spec]).encode()).hexdigest()
    stamp_file = venv / ".flashlab-stamp"
    if py.exists() and stamp_file.exists() and stamp_file.read_text() == stamp:
        return py
    if venv.exists():
        shutil.rmtree(venv)
    sh(python, "-m", "venv", venv)
    sh(py, "-m", "pip", "install", "-q", "--upgrade", "pip")
    sh(py, "-m", "pip", "install", "-q", "-e", ".", *jax_spec, "pytest>=8", "hypothesis>=6.100")
    stamp_file.write_text(stamp)
    return py


def compat_legs() -> list[str]:
    """Run the compat tests at both ends of the supported JAX range; returns a summary."""
    low, high = jax_range()
    legs = [("oldest", ROOT / ".venv-jax-oldest", sys.executable,
             [f"jax=={low}", f"jaxlib=={low}"])]
    newest = newest_python()
    if newest is None:
        print("dev.py: SKIPPING the newest-JAX leg: no Python >= 3.12 found (looked at "
              "$FLASHLAB_NEWEST_PYTHON, python3.12..3.14 on PATH, ~/.pyenv/versions). JAX "
              f"releases after 0.10 need Python >= 3.12; only jax=={low} is checked.", flush=True)
    else:
        legs.append(("newest", ROOT / ".venv-jax-newest", newest, [f"jax[tpu]<{high}"]))
    summary = []
    for name, venv, python, spec in legs:
        t0 = time.time()
        py = compat_venv(venv, python, spec)
        ver = subprocess.run([str(py), "-c", "import jax, sys; print(jax.__version__, "
                              "'python', sys.version.split()[0])"],
                             capture_output=True, text=True, cwd=ROOT).stdout.strip()
        print(f"dev.py: {name} leg: jax {ver}", flush=True)
        e = env()
        e["PATH"] = f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"
        pytest(*COMPAT_TESTS, "-q", "-p", "no:cacheprovider", py=py, environ=e)
        what = "compat tests"
        if name == "newest":
            pytest(*NEWEST_TPU_TESTS, "-q", "-p", "no:cacheprovider", py=py, environ=e)
            what += " and the TPU compile matrix's base row"
        summary.append(f"{name} leg: jax {ver}: {what} passed in {time.time() - t0:.0f} s")
    if newest is None:
        summary.append("newest leg: SKIPPED (no Python >= 3.12)")
    return summary


def main(argv: list[str]) -> None:
    if len(argv) != 1 or argv[0] not in ("book", "test"):
        sys.exit(__doc__)
    t0 = time.time()
    ensure_venv()
    legs = []
    if argv[0] == "test":
        # worksteal: idle workers take queued tests from busy ones (the suite ends with a few
        # long interpreted-kernel tests); the 30 slowest are listed so CI time stays visible.
        pytest("tests", "-n", "2", "--dist", "worksteal", "-q", "--durations=30")
        legs = compat_legs()
        # one notebook per worker (--dist loadfile): a notebook's cells share one kernel
        pytest("--nbval", "--nbval-current-env", "--nbval-sanitize-with",
               "notebooks/sanitize.cfg", "notebooks", "-p", "no:cacheprovider", "-q",
               "-n", "2", "--dist", "loadfile")
    index = build_book()
    for line in legs:
        print(f"dev.py: {line}")
    print(f"dev.py: {argv[0]} finished in {time.time() - t0:.0f} s")
    print(f"book: {index}")


if __name__ == "__main__":
    main(sys.argv[1:])
