#!/usr/bin/env python3
"""The README's two commands.

    python3 .ci/dev.py book   # set up .venv, build the rendered book, print index.html's path
    python3 .ci/dev.py test   # set up .venv, run unit tests, the JAX-range legs, nbval over
                              # every notebook, book build

Needs only Python >= 3.11 and git. The environment lives in .venv and is rebuilt when
requirements.txt or pyproject.toml change.

The JAX-range legs check both ends of the supported range in pyproject.toml
(``jax>=LOW,<HIGH``): ``.venv-jax-oldest`` (this Python, ``jax==LOW``) and
``.venv-jax-newest`` (the newest Python >= 3.12 found, the newest jax[tpu] release below
HIGH that installs from the index, with its libtpu) each run the ``compat`` tests
(tests/test_compat.py); the newest leg also compiles the base row of the TPU compile matrix
with the newest TPU compiler. A missing Python >= 3.12 skips the newest leg with a printed
message; set FLASHLAB_NEWEST_PYTHON to choose the interpreter.

Wall time on a 2-core machine is what CI pays, so two stages run in the background: the legs'
venvs are built (downloads, mostly) while the unit tests hold the CPUs, and the book (stored
outputs, no execution) builds while nbval re-executes the notebooks. Their output is printed
when they are collected, and a failure there fails the run like any other stage.
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


def sh(*cmd, ok=(0,), env=None, log=None) -> int:
    """Run ``cmd`` in the repository; ``log``: an open file for its output (a background
    stage writes there, so its lines do not interleave with the foreground's)."""
    print("+", " ".join(str(c) for c in cmd), flush=True, file=log or sys.stdout)
    rc = subprocess.call([str(c) for c in cmd], cwd=ROOT, env=env, stdout=log,
                         stderr=subprocess.STDOUT if log else None)
    if rc not in ok:
        if log is not None:
            raise RuntimeError(f"command failed with exit code {rc}: {' '.join(map(str, cmd))}")
        sys.exit(f"dev.py: command failed with exit code {rc}: {' '.join(map(str, cmd))}")
    return rc


class Background:
    """A stage run in a thread while the foreground uses the CPUs (pip downloads, the book
    build): its output goes to ``log_path`` and is printed when :meth:`join` collects it."""

    def __init__(self, name: str, fn, *args):
        import threading
        self.name, self.log_path = name, ROOT / f".ci-{name}.log"
        self.result, self.error = None, None

        def run():
            with open(self.log_path, "w") as log:
                try:
                    self.result = fn(*args, log=log)
                except BaseException as e:  # noqa: BLE001 (SystemExit too): join() re-raises
                    self.error = e
        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def join(self):
        self.thread.join()
        print(f"----- {self.name} (ran in the background; log {self.log_path.name}) -----")
        print(self.log_path.read_text(), end="", flush=True)
        if self.error is not None:
            sys.exit(f"dev.py: {self.name} failed: {self.error}")
        return self.result


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
    sh(PY, "-m", "pip", "install", "-q", "-r", "requirements.txt", "-e", ".",
       installable_jax_tpu(PY))
    stamp_file.write_text(stamp)


def _version(v: str) -> tuple[int, ...] | None:
    """``"0.12.0.1"`` -> ``(0, 12, 0, 1)``; None for a pre-release or anything not all digits."""
    parts = v.strip().split(".")
    return tuple(map(int, parts)) if all(p.isdigit() for p in parts) else None


def installable_jax_tpu(py, log=None) -> str:
    """``jax[tpu]==V``: the newest jax in pyproject.toml's range that ``py``'s pip can install.

    Each jax[tpu] release pins the libtpu built with it, and a package index can hold a jax
    release before its libtpu (a mirror had jax 0.12.1 and not libtpu 0.0.53). Asked for
    ``jax[tpu]<HIGH``, pip then backtracks through every older jax for over a minute and fails
    on a 2021 release's URL dependency. So each release in the range is asked for by name,
    newest first (a failing dry run takes about 2 s), and the first that resolves is pinned.
    Falls back to the plain range when pip cannot list the releases.
    """
    low, high = jax_range()
    say = log or sys.stdout
    out = subprocess.run([str(py), "-m", "pip", "index", "versions", "jax"],
                         capture_output=True, text=True, cwd=ROOT)
    m = re.search(r"Available versions: (.*)", out.stdout)
    releases = [v.strip() for v in m.group(1).split(",")] if m else []
    in_range = [v for v in releases
                if (t := _version(v)) is not None and _version(low) <= t < _version(high)]
    if not in_range:
        print(f"dev.py: pip lists no jax release in [{low}, {high}); asking for the range",
              file=say, flush=True)
        return f"jax[tpu]>={low},<{high}"
    for v in in_range[:6]:
        dry = subprocess.run([str(py), "-m", "pip", "install", "--dry-run", "-q", f"jax[tpu]=={v}"],
                             capture_output=True, text=True, cwd=ROOT)
        if dry.returncode == 0:
            if v != in_range[0]:
                print(f"dev.py: jax[tpu] {in_range[0]} does not install from this index (its "
                      f"libtpu is missing, most likely); using jax[tpu]=={v}, the newest that "
                      "does", file=say, flush=True)
            return f"jax[tpu]=={v}"
        why = (dry.stderr.strip().splitlines() or ["?"])[-1]
        print(f"dev.py: jax[tpu]=={v} does not resolve: {why}", file=say, flush=True)
    raise SystemExit(f"dev.py: none of jax[tpu] {', '.join(in_range[:6])} installs from this "
                     "index")


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


def build_book(log=None) -> Path:
    # Renders the notebooks from their stored outputs (no execution); warnings are errors.
    sh(BIN / "jupyter-book", "build", "book", "--warningiserror", "--nitpick", "--keep-going",
       env=env(), log=log)
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
NEWEST_TPU_TESTS = ("tests/test_tpu_compile_matrix.py", "-k", "base", "-m", "tpu_compile",
                    "-n", "2")                  # 10 compiles of ~40 s each: one per core
LEG_TEST_DEPS = ("pytest>=8", "pytest-xdist>=3", "hypothesis>=6.100")


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


def compat_venv(venv: Path, python: str, jax_spec: list[str] | None, log=None) -> Path:
    """A venv with flashlab (editable), ``jax_spec``, pytest and hypothesis; reused if unchanged.
    ``jax_spec=None``: the newest jax[tpu] in the range that installs (installable_jax_tpu)."""
    py = venv / "bin" / "python"
    stamp = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + " ".join(
        [python, *(jax_spec or ["newest jax[tpu]"]), *LEG_TEST_DEPS]).encode()).hexdigest()
    stamp_file = venv / ".flashlab-stamp"
    if py.exists() and stamp_file.exists() and stamp_file.read_text() == stamp:
        return py
    if venv.exists():
        shutil.rmtree(venv)
    sh(python, "-m", "venv", venv, log=log)
    sh(py, "-m", "pip", "install", "-q", "--upgrade", "pip", log=log)
    if jax_spec is None:                # the newest jax[tpu] release pip can install here
        jax_spec = [installable_jax_tpu(py, log=log)]
    sh(py, "-m", "pip", "install", "-q", "-e", ".", *jax_spec, *LEG_TEST_DEPS, log=log)
    stamp_file.write_text(stamp)
    return py


def leg_specs() -> list[tuple[str, Path, str, list[str] | None]]:
    """``(name, venv, python, pip spec)`` of the JAX-range legs this machine can run; the
    newest leg's spec is None: resolved when its venv is built (installable_jax_tpu)."""
    low, _ = jax_range()
    legs = [("oldest", ROOT / ".venv-jax-oldest", sys.executable,
             [f"jax=={low}", f"jaxlib=={low}"])]
    newest = newest_python()
    if newest is None:
        print("dev.py: SKIPPING the newest-JAX leg: no Python >= 3.12 found (looked at "
              "$FLASHLAB_NEWEST_PYTHON, python3.12..3.14 on PATH, ~/.pyenv/versions). JAX "
              f"releases after 0.10 need Python >= 3.12; only jax=={low} is checked.", flush=True)
    else:
        legs.append(("newest", ROOT / ".venv-jax-newest", newest, None))
    return legs


def build_leg_venvs(legs, log=None) -> None:
    # Mostly downloads and unpacking: run while the unit tests hold the CPUs.
    for name, venv, python, spec in legs:
        t0 = time.time()
        compat_venv(venv, python, spec, log=log)
        print(f"dev.py: {name} leg venv ready in {time.time() - t0:.0f} s", file=log, flush=True)


def compat_legs(legs) -> list[str]:
    """Run the compat tests at both ends of the supported JAX range; returns a summary."""
    summary = []
    for name, venv, python, spec in legs:
        t0 = time.time()
        py = compat_venv(venv, python, spec)          # built already: only checks its stamp
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
    if not any(name == "newest" for name, *_ in legs):
        summary.append("newest leg: SKIPPED (no Python >= 3.12)")
    return summary


def main(argv: list[str]) -> None:
    if len(argv) != 1 or argv[0] not in ("book", "test"):
        sys.exit(__doc__)
    t0 = time.time()
    ensure_venv()
    summary = []
    if argv[0] == "test":
        legs = leg_specs()
        venvs = Background("leg-venvs", build_leg_venvs, legs)
        # worksteal: idle workers take queued tests from busy ones (the suite ends with a few
        # long interpreted-kernel tests); the 30 slowest are listed so CI time stays visible.
        pytest("tests", "-n", "2", "--dist", "worksteal", "-q", "--durations=30")
        print(f"dev.py: unit tests finished at {time.time() - t0:.0f} s", flush=True)
        venvs.join()
        summary = compat_legs(legs)
        # The book renders stored outputs (no execution), so it builds while nbval re-executes
        # the notebooks, on the core nbval's last long notebook leaves idle.
        book = Background("book", build_book)
        # one notebook per worker (--dist loadfile): a notebook's cells share one kernel
        pytest("--nbval", "--nbval-current-env", "--nbval-sanitize-with",
               "notebooks/sanitize.cfg", "notebooks", "-p", "no:cacheprovider", "-q",
               "-n", "2", "--dist", "loadfile")
        index = book.join()
    else:
        index = build_book()
    for line in summary:
        print(f"dev.py: {line}")
    print(f"dev.py: {argv[0]} finished in {time.time() - t0:.0f} s")
    print(f"book: {index}")


if __name__ == "__main__":
    main(sys.argv[1:])
