"""Take the TPU compiler's schedule dumps of a function, in a child process, and read them.

libtpu reads its flags (``LIBTPU_INIT_ARGS``) once, when it initializes, so a process that has
already compiled for a TPU cannot start dumping. :func:`schedules` therefore runs a child
Python (``python -m flashlab.instruments.tpu_dump SPEC``) with :data:`flashlab.instruments.tpu_schedule.DUMP_FLAGS`
set, which builds the function, compiles it with :func:`flashlab.instruments.tpu_compile.compile` for the
chip and records each Pallas kernel's grid; the parent then reads every Mosaic kernel's dump
with :func:`flashlab.instruments.tpu_schedule.analyze`.

The function comes from a *builder*: ``"module:function"``, called in the child as
``builder(chip=chip, **kwargs) -> (fn, args)`` or ``(fn, args, info)``, with ``args`` a tuple
of ``jax.ShapeDtypeStruct`` and ``info`` any JSON data handed back in :attr:`Dump.info`
(``flashlab.benchmarks.tpu_static.build`` is one).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from flashlab.instruments import tpu_schedule

__all__ = ["KernelDump", "Dump", "schedules", "role_of", "ROLES"]

ROLES = ("forward", "dq", "dkdv")


def role_of(name: str) -> str:
    """``"dq"``, ``"dkdv"`` or ``"forward"`` from a kernel's name (ours, splash's, jax's)."""
    n = name.lower()
    if "dq" in n:
        return "dq"
    if "dkv" in n or "dkdv" in n:
        return "dkdv"
    return "forward"


@dataclasses.dataclass
class KernelDump:
    """One Pallas kernel: its name, grid, and its schedule (a TileSchedule)."""
    name: str
    role: str
    grid: tuple
    schedule: tpu_schedule.TileSchedule


@dataclasses.dataclass
class Dump:
    """What one compile's dumps say: ``kernels`` by role, and the compiler's versions."""
    chip: str
    kernels: dict
    jax_version: str
    libtpu_version: str | None
    info: dict | None = None


def _grids(fn, args) -> list[dict]:
    """Every ``pallas_call`` in ``fn``'s jaxpr: ``{"name", "role", "grid"}``."""
    import jax
    found: list[dict] = []

    def walk(jaxpr):
        for e in jaxpr.eqns:
            if e.primitive.name == "pallas_call":
                p = e.params
                name = (getattr(p.get("name_and_src_info"), "name", None) or p.get("name")
                        or getattr(getattr(p.get("jaxpr"), "debug_info", None), "func_name",
                                   None) or "pallas_call")
                found.append(dict(name=str(name), role=role_of(str(name)),
                                  grid=[int(g) for g in p["grid_mapping"].grid]))
            for v in e.params.values():
                for sub in (v if isinstance(v, (list, tuple)) else (v,)):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


def _child(spec: dict) -> int:
    """Child side: build, trace the grids, compile (libtpu dumps as it compiles)."""
    import importlib
    from flashlab.contract import device
    from flashlab.instruments import tpu_compile
    mod, fun = spec["builder"].split(":")
    built = getattr(importlib.import_module(mod), fun)(chip=spec["chip"], **spec["kwargs"])
    fn, args, info = built if len(built) == 3 else (*built, None)
    with device.compile_target(spec["chip"]):
        grids = _grids(fn, args)
    report = tpu_compile.compile(fn, *args, chip=spec["chip"])
    out = dict(ok=report.ok, error=report.error, grids=grids, jax_version=report.jax_version,
               libtpu_version=report.libtpu_version, info=info)
    Path(spec["dir"], "manifest.json").write_text(json.dumps(out))
    return 0


def _mosaic_dumps(d: Path) -> dict[str, Path]:
    """``{kernel name: packed-bundles file}`` for the Mosaic (Pallas) kernels in dump dir ``d``."""
    out = {}
    for sa in sorted(d.glob("*-00-schedule-analysis_packed-bundles-post-ra.txt")):
        stem = sa.name[: -len("-00-schedule-analysis_packed-bundles-post-ra.txt")]
        name = stem.split("-", 1)[1] if "-" in stem else stem
        # The dump of the kernel itself (not of a program that calls it) is named after it.
        own = re.compile(r"%" + re.escape(name)
                         + r" = [^\n]*custom_call_target=\"tpu_custom_call\"")
        if own.search(sa.read_text(errors="replace")):
            out[name] = sa.with_name(stem + "-01-packed-bundles-post-ra.txt")
    return out


def schedules(builder: str, chip: str, *, timeout: float = 900, keep_dir: str | None = None,
              reader=None, **kwargs) -> Dump:
    """Compile ``builder(chip=chip, **kwargs)`` for ``chip`` in a child and read its schedule.

    Returns a :class:`Dump` with one :class:`KernelDump` per role (forward / dq / dkdv) found.
    Raises ``TimeoutError`` after ``timeout`` seconds, ``RuntimeError`` with the child's
    stderr when it fails, :class:`flashlab.instruments.tpu_compile.CompileError` with the compiler's own
    message when the compile is rejected, and :class:`tpu_schedule.ScheduleFormatError` when
    the dumps are not what the parser expects. The dump (~10 MB) is deleted unless
    ``keep_dir`` names where to keep it. ``reader(packed_path, kernel=name)`` reads each
    kernel's dump (default :func:`flashlab.instruments.tpu_schedule.analyze`, which expects one grid loop
    and one tile region; a kernel built otherwise, such as the official paged attention,
    needs its own reader).
    """
    from flashlab.instruments import tpu_compile
    if chip not in tpu_compile.CHIPS:
        raise ValueError(f"chip: expected one of {list(tpu_compile.CHIPS)}, got {chip!r}")
    tpu_compile.require()
    tmp = None if keep_dir else tempfile.TemporaryDirectory(prefix="flashlab-dump-")
    d = Path(keep_dir or tmp.name)
    d.mkdir(parents=True, exist_ok=True)
    try:
        spec = dict(builder=builder, chip=chip, kwargs=kwargs, dir=str(d))
        env = dict(os.environ, JAX_PLATFORMS="cpu", TPU_SKIP_MDS_QUERY="1",
                   LIBTPU_INIT_ARGS=tpu_schedule.DUMP_FLAGS.format(dir=d))
        cmd = [sys.executable, "-m", "flashlab.instruments.tpu_dump", json.dumps(spec)]
        try:
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            raise TimeoutError(f"compiling {builder}({kwargs}) for {chip} with schedule dumps "
                               f"took over {timeout:.0f} s; raise timeout=") from e
        manifest = d / "manifest.json"
        if r.returncode != 0 or not manifest.exists():
            raise RuntimeError(f"the dump child for {builder} on {chip} failed (exit "
                               f"{r.returncode}):\n{r.stderr[-3000:]}")
        m = json.loads(manifest.read_text())
        if not m["ok"]:
            raise tpu_compile.CompileError(f"TPU compile of {builder}({kwargs}) for {chip} "
                                           f"failed:\n{m['error']}")
        files = _mosaic_dumps(d)
        if not files:
            raise tpu_schedule.ScheduleFormatError(
                f"{d}: the compile succeeded but no Mosaic kernel dump was written (libtpu "
                f"{m['libtpu_version']} ignored LIBTPU_INIT_ARGS, or renamed its dump files)")
        kernels = {}
        for name, path in files.items():
            role = role_of(name)
            grids = [g for g in m["grids"] if g["role"] == role]
            if role in kernels or len(grids) != 1:
                raise tpu_schedule.ScheduleFormatError(
                    f"{d}: kernel {name!r} ({role}): expected one kernel per role, found dumps "
                    f"{list(files)} and pallas_calls {m['grids']}")
            kernels[role] = KernelDump(name, role, tuple(grids[0]["grid"]),
                                       (reader or tpu_schedule.analyze)(path, kernel=name))
        return Dump(chip, kernels, m["jax_version"], m["libtpu_version"], m.get("info"))
    finally:
        if tmp is not None:
            tmp.cleanup()


if __name__ == "__main__":
    sys.exit(_child(json.loads(sys.argv[1])))
