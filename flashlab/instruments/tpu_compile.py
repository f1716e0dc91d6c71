"""Compile any function for a TPU you don't have: the real TPU compiler, run on this CPU.

``pip install "jax[tpu]"`` installs libtpu, the library that holds the TPU compiler (XLA's
TPU backend and Mosaic, the compiler of Pallas TPU kernels). libtpu compiles without a TPU:
``jax.experimental.topologies.get_topology_desc`` describes a slice of a named generation as
*compile-only* devices, and ``jax.jit(f).lower(args on those devices).compile()`` runs the
whole TPU compile. Nothing runs: the result is the compiler's verdict (accepted, or its own
error message such as a VMEM allocation report), its memory analysis and its cost analysis.

>>> import jax, jax.numpy as jnp, flashlab
>>> from flashlab import tpu_compile
>>> q = jax.ShapeDtypeStruct((1, 2048, 8, 128), jnp.bfloat16)
>>> tpu_compile.compile(flashlab.flash_attention, q, q, q, chip="v5p", is_causal=True,
...                     interpret=False).ok
True

While it compiles, :func:`flashlab.contract.device.target_chip` returns ``chip``, so flashlab's
kernels size their blocks and ``vmem_limit_bytes`` for the target, not for this host.

libtpu at start-up on a machine without a TPU (traced with strace, libtpu 0.0.42): it
finds no chip and asks no metadata server when ``TPU_SKIP_MDS_QUERY=1`` (JAX sets it itself
when it sees no TPU chip; we set it too, before libtpu loads), prints warnings about the
unknown accelerator type and worker hostnames to stderr (we capture them and show them only
if the start fails), and takes ``/tmp/libtpu_lockfile``, which makes every *other* process's
start fail while it lives ("Internal error when accessing libtpu multi-process lockfile").
Compiling touches no chip, so we set ``ALLOW_MULTIPLE_LIBTPU_LOAD=1``: parallel test workers
and notebooks can each hold a compiler. None of this runs unless a compile is asked for;
plain ``import flashlab`` and every CPU computation never load libtpu through this module.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.metadata
import importlib.util
import os
import re
import tempfile
from typing import Any, Callable

import jax
import numpy as np

from flashlab.contract import device

__all__ = ["CHIPS", "CompileReport", "CompileError", "LibtpuMissingError", "available",
           "require", "devices", "mesh", "compile", "versions", "pallas_calls", "vmem_placement"]

#: Generation name -> the topology libtpu describes (a one-host slice of four chips).
CHIPS = {"v4": "v4:2x2x1", "v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2",
         "7x": "tpu7x:2x2x1"}
INSTALL = 'pip install "jax[tpu]"'


class LibtpuMissingError(ImportError):
    """libtpu (the TPU compiler) is not installed."""


class CompileError(RuntimeError):
    """The TPU compiler rejected a function (the message is the compiler's own)."""


def available() -> bool:
    """Whether libtpu can be loaded (no TPU needed): the compiler is installed."""
    path = os.environ.get("TPU_LIBRARY_PATH")
    return bool(path and os.path.isfile(path)) or importlib.util.find_spec("libtpu") is not None


def require() -> None:
    """Raise :class:`LibtpuMissingError` (naming the install command) unless libtpu is there."""
    if not available():
        raise LibtpuMissingError(
            f"flashlab.instruments.tpu_compile needs libtpu, the TPU compiler (no TPU needed): run "
            f"`{INSTALL}` (it installs the libtpu that matches jax {jax.__version__}) and "
            f"restart Python")


def versions() -> dict:
    """``{"jax": ..., "jaxlib": ..., "libtpu": ...}`` of this environment (libtpu ``None`` if absent)."""
    def ver(name):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None
    return {"jax": jax.__version__, "jaxlib": ver("jaxlib"), "libtpu": ver("libtpu")}


def _check_chip(chip) -> str:
    if chip not in CHIPS:
        raise ValueError(f"chip: expected one of {list(CHIPS)}, got {chip!r}")
    return chip


@contextlib.contextmanager
def _stderr_captured():
    """Capture what native code writes to file descriptor 2; yields a callable returning it."""
    try:
        fd = os.dup(2)
    except OSError:  # pragma: no cover - no stderr at all
        yield lambda: ""
        return
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield lambda: (tmp.seek(0), tmp.read().decode(errors="replace"))[1]
        finally:
            os.dup2(fd, 2)
            os.close(fd)


@functools.lru_cache(maxsize=None)
def _topology(chip: str):
    require()
    from jax._src import hardware_utils
    try:
        no_chips = hardware_utils.num_available_tpu_chips_and_device_id()[0] == 0
    except Exception:  # pragma: no cover - the probe moved
        no_chips = True
    if no_chips:                       # no TPU here: never ask a GCE metadata server
        os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies
    with _stderr_captured() as said:
        try:
            return topologies.get_topology_desc(
                platform="tpu", topology_name=CHIPS[chip], chip_config_name="default",
                chips_per_host_bounds=(2, 2, 1), num_slices=1, wrap=(False, False, False))
        except Exception as e:
            raise RuntimeError(f"libtpu {versions()['libtpu']} could not describe a {chip} "
                               f"slice ({CHIPS[chip]}): {e}\nlibtpu said:\n{said()}") from None


def devices(chip: str, n: int = 1) -> list:
    """``n`` compile-only TPU devices of generation ``chip`` (``n`` <= the slice's devices)."""
    _check_chip(chip)
    devs = list(_topology(chip).devices)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= len(devs):
        raise ValueError(f"n: expected an int in 1..{len(devs)} (the devices of a {chip} "
                         f"{CHIPS[chip]} slice), got {n!r}")
    return devs[:n]


def mesh(chip: str, shape: tuple[int, ...] = (1,), axis_names: tuple[str, ...] = ("x",)):
    """A ``jax.sharding.Mesh`` of compile-only ``chip`` devices (``prod(shape)`` of them)."""
    shape = tuple(shape)
    if len(shape) != len(axis_names):
        raise ValueError(f"axis_names: expected {len(shape)} names for shape {shape}, got "
                         f"{axis_names!r}")
    devs = devices(chip, int(np.prod(shape)))
    return jax.sharding.Mesh(np.array(devs).reshape(shape), tuple(axis_names))


@dataclasses.dataclass
class CompileReport:
    """What the TPU compiler said about one function for one chip.

    ``ok``: compiled. ``error``: the compiler's own message (``None`` when ok); ``stage``:
    ``"lower"`` (Pallas -> Mosaic, JAX -> HLO) or ``"compile"`` (XLA TPU + Mosaic, in libtpu).
    ``memory``: compiled memory analysis in bytes (``argument``, ``output``, ``alias``,
    ``temp``, ``generated_code``); ``cost``: XLA's cost analysis (``flops``,
    ``bytes accessed``...). ``compiled``: the ``jax.stages.Compiled`` (not shown).
    """

    chip: str
    ok: bool
    error: str | None = None
    stage: str | None = None
    memory: dict | None = None
    cost: dict | None = None
    jax_version: str = jax.__version__
    libtpu_version: str | None = None
    compiled: Any = dataclasses.field(default=None, repr=False)

    def raise_if_failed(self) -> "CompileReport":
        """Raise :class:`CompileError` with the compiler's message unless ``ok``; else ``self``."""
        if not self.ok:
            raise CompileError(f"TPU compile for {self.chip} failed at {self.stage} (jax "
                               f"{self.jax_version}, libtpu {self.libtpu_version}):\n{self.error}")
        return self

    def __str__(self) -> str:
        head = (f"{self.chip}: {'compiled' if self.ok else 'FAILED at ' + str(self.stage)} "
                f"(jax {self.jax_version}, libtpu {self.libtpu_version})")
        if not self.ok:
            return f"{head}\n{self.error}"
        mem = ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in (self.memory or {}).items())
        return f"{head}\n  memory: {mem}"


_LAST_TARGET: list = [None]


@contextlib.contextmanager
def _target(chip: str):
    """``device.compile_target(chip)`` with JAX's trace caches cleared when the target changes.

    The chip is read at trace time (block sizes, ``vmem_limit_bytes``) but is not part of
    JAX's cache keys, so a function traced for one chip would be reused for the next.
    """
    if _LAST_TARGET[0] != chip:
        jax.clear_caches()
        _LAST_TARGET[0] = chip
    with device.compile_target(chip):
        yield


def _memory(compiled) -> dict | None:
    try:
        m = compiled.memory_analysis()
    except Exception:  # pragma: no cover - not every backend reports it
        return None
    if m is None:
        return None
    keys = ("argument", "output", "alias", "temp", "generated_code")
    return {k: int(getattr(m, f"{k}_size_in_bytes")) for k in keys
            if hasattr(m, f"{k}_size_in_bytes")}


def _cost(compiled) -> dict | None:
    try:
        c = compiled.cost_analysis()
    except Exception:  # pragma: no cover
        return None
    if isinstance(c, (list, tuple)):         # older JAX: one dict per program
        c = c[0] if c else None
    return None if c is None else {k: float(v) for k, v in c.items()}


def _message(e: BaseException) -> str:
    """The compiler's own words: the exception's message, without JAX's traceback filter note."""
    text = str(e).strip()
    cut = text.find("\n--------------------\nFor simplicity, JAX has removed")
    return text[:cut] if cut >= 0 else text


def compile(fn: Callable, *args, chip: str = "v5e", num_devices: int = 1, in_shardings=None,
            **static_kwargs) -> CompileReport:
    """Compile ``fn(*args, **static_kwargs)`` with the real TPU compiler for ``chip``.

    Args:
      fn: any JAX function (a kernel, ``jax.grad`` of one, a model step).
      *args: arrays or ``jax.ShapeDtypeStruct`` s (pytrees of them are fine); arrays become
        ShapeDtypeStructs (their values are never used). Without ``in_shardings`` each is
        replicated on ``num_devices`` compile-only devices of ``chip``.
      chip: one of :data:`CHIPS` ("v4", "v5e", "v5p", "v6e", "7x").
      num_devices: how many of the slice's devices the program spans.
      in_shardings: shardings for ``args`` (as ``jax.jit`` takes them), built on
        :func:`mesh` / :func:`devices` of the same ``chip``; they replace the replication.
      **static_kwargs: keyword arguments bound to ``fn`` as Python values (``is_causal=True``,
        ``interpret=False``...).

    Returns a :class:`CompileReport`. A function the compiler rejects gives ``ok=False`` and
    the compiler's message in ``error`` (call ``.raise_if_failed()`` to raise it); a mistake
    in the call itself (bad arguments, a shape error while tracing) raises as it would under
    ``jax.jit``. Raises ``ValueError`` for an unknown ``chip`` and
    :class:`LibtpuMissingError` when libtpu is not installed.
    """
    _check_chip(chip)
    require()
    devs = devices(chip, num_devices)
    if in_shardings is None:
        repl = jax.sharding.NamedSharding(jax.sharding.Mesh(np.array(devs), ("x",)),
                                          jax.sharding.PartitionSpec())
        in_shardings = jax.tree_util.tree_map(lambda _: repl, args)

    def abstract(x, s):
        if x is None:
            return None
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s)

    avals = jax.tree_util.tree_map(abstract, args, in_shardings)
    target = device.chip_from_device_kind(devs[0].device_kind) or chip
    jitted = jax.jit(functools.partial(fn, **static_kwargs) if static_kwargs else fn)
    report = CompileReport(chip=chip, ok=False, libtpu_version=versions()["libtpu"])
    with _target(target):
        traced = jitted.trace(*avals)             # the caller's errors raise here, unchanged
        try:
            report.stage = "lower"
            lowered = traced.lower()
            report.stage = "compile"
            compiled = lowered.compile()
        except Exception as e:   # noqa: BLE001 - every compiler failure becomes the report
            report.error = _message(e)
            return report
    report.ok, report.stage, report.compiled = True, None, compiled
    report.memory, report.cost = _memory(compiled), _cost(compiled)
    return report


def _sub_jaxprs(value):
    for x in value if isinstance(value, (tuple, list)) else (value,):
        if hasattr(x, "eqns"):
            yield x
        elif hasattr(getattr(x, "jaxpr", None), "eqns"):
            yield x.jaxpr


def _block_dims(bm) -> tuple:
    dims = []
    for b in bm.block_shape:
        size = getattr(b, "block_size", b)
        dims.append(size if isinstance(size, int) else None)    # None: a squeezed dim
    return tuple(dims)


def pallas_calls(fn: Callable, *args, chip: str = "v5e", **static_kwargs) -> list[dict]:
    """The Pallas kernels ``fn`` builds when traced for ``chip`` (no compile, no libtpu needed).

    One dict per ``pallas_call``, in trace order: ``name``, ``grid``, ``blocks`` (each
    operand's block shape, ``None`` for a squeezed dim), ``vmem_limit_bytes`` (what the
    kernel asks Mosaic for; ``None``: Mosaic's default scoped limit) and ``bounds_checks``
    (whether Mosaic guards its DMAs at run time). ``args``: arrays or
    ShapeDtypeStructs; ``static_kwargs`` are bound to ``fn``.
    """
    _check_chip(chip)
    avals = jax.tree_util.tree_map(
        lambda x: None if x is None else jax.ShapeDtypeStruct(np.shape(x), x.dtype), args)
    f = functools.partial(fn, **static_kwargs) if static_kwargs else fn
    with _target(chip):
        closed = jax.make_jaxpr(f)(*avals)
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                p = eqn.params
                cp = p.get("compiler_params")
                cp = cp.get("mosaic", cp) if isinstance(cp, dict) else cp
                limit = cp.get("vmem_limit_bytes") if isinstance(cp, dict) else \
                    getattr(cp, "vmem_limit_bytes", None)
                unchecked = cp.get("disable_bounds_checks") if isinstance(cp, dict) else \
                    getattr(cp, "disable_bounds_checks", False)
                gm = p["grid_mapping"]
                name = p.get("name") or getattr(p.get("name_and_src_info"), "name", None)
                found.append({"name": str(name), "grid": tuple(gm.grid),
                              "blocks": [_block_dims(bm) for bm in gm.block_mappings],
                              "vmem_limit_bytes": limit, "bounds_checks": not unchecked})
            for v in eqn.params.values():
                for sub in _sub_jaxprs(v):
                    walk(sub)

    walk(closed.jaxpr)
    return found


_DEF = re.compile(r"^\s*(?:ROOT\s+)?%(\S+) = (.*?) ([\w-]+)\((.*)$")
_SCOPED = re.compile(r'scoped_memory_configs":\[\{[^}]*"offset":"(\d+)","size":"(\d+)"')


def vmem_placement(report: CompileReport) -> list[dict]:
    """Which of each Pallas kernel's operands and results the compiled program keeps in VMEM,
    from its optimized HLO (memory space 1: ``S(1)`` in a layout). One dict per kernel, in
    program order: ``name``; ``operands`` and ``result``, each ``(hlo name, shape, in_vmem)``
    (a tuple result: one entry); ``scoped``, the VMEM Mosaic was given for the kernel's own
    blocks and scratch (``(offset, size)`` in bytes: its ``vmem_limit_bytes``). What XLA keeps
    in VMEM the kernel reads or writes with no DMA to HBM; XLA can place nothing in a
    kernel's scoped VMEM, so a kernel that asks for more than it needs leaves it less room."""
    defs, kernels = {}, []
    for line in report.raise_if_failed().compiled.as_text().splitlines():
        m = _DEF.match(line)
        if not m:
            continue
        name, shape, opcode, rest = m.groups()
        defs[name] = shape
        if opcode == "custom-call" and "tpu_custom_call" in rest:
            sc = _SCOPED.search(rest)
            args = re.findall(r"%([\w.-]+)", rest.split(")", 1)[0])
            kernels.append((name, shape, args, (int(sc.group(1)), int(sc.group(2)))
                            if sc else None))
    vmem = lambda shape: "S(1)" in shape  # noqa: E731
    return [dict(name=name, operands=[(a, defs.get(a, "?"), vmem(defs.get(a, "")))
                                      for a in args],
                 result=(name, shape, vmem(shape)), scoped=scoped)
            for name, shape, args, scoped in kernels]
