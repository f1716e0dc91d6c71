"""Every Pallas API flashlab uses, imported in ONE place.

Pallas is young and its names move between JAX releases (``TPUCompilerParams`` became
``CompilerParams``, ``TPUInterpretParams`` became ``InterpretParams``, the race detector moved
modules, ``get_tpu_info_for_chip`` appeared). The kernels import from here only, so a JAX
upgrade touches this file and nothing else. Supported range: the one in ``pyproject.toml``,
tested at both ends by ``python3 .ci/dev.py test`` (the ``compat`` tests in tests/test_compat.py
run in a venv with the oldest supported JAX and in one with the newest that installs).

The official kernels (``jax.experimental.pallas.ops.tpu``) are loaded through
:func:`official_flash_attention` and :func:`official_splash_attention` too, so that
tests/test_compat.py can check that no other flashlab module imports Pallas directly.
"""
from __future__ import annotations

import contextlib
import importlib

from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

__all__ = ["pl", "pltpu", "BlockSpec", "CompilerParams", "InterpretParams",
           "PrefetchScalarGridSpec", "CostEstimate", "VMEM", "SMEM", "ChipVersion",
           "get_tpu_info", "get_tpu_info_for_chip", "force_tpu_interpret_mode",
           "reset_tpu_interpret_mode_state", "races_found", "is_interpret_params",
           "OFFICIAL_FLASH_MODULE", "OFFICIAL_SPLASH_MODULE", "official_flash_attention",
           "official_splash_attention", "versions", "direct_pallas_imports",
           "RECIPROCAL_FULL_RANGE", "reciprocal_normal"]

BlockSpec = pl.BlockSpec
CostEstimate = pl.CostEstimate
PrefetchScalarGridSpec = pltpu.PrefetchScalarGridSpec
CompilerParams = getattr(pltpu, "CompilerParams", None) or getattr(pltpu, "TPUCompilerParams")
InterpretParams = getattr(pltpu, "InterpretParams", None) or getattr(pltpu, "TPUInterpretParams")
VMEM = pltpu.VMEM          # scratch in vector memory: pltpu.VMEM(shape, dtype)
SMEM = pltpu.SMEM          # scalar memory (scalar-prefetch operands live here)
ChipVersion = getattr(pltpu, "ChipVersion", None)
get_tpu_info = getattr(pltpu, "get_tpu_info", None)
# get_tpu_info_for_chip(chip_version: ChipVersion, num_tensor_cores_per_logical_device: int)
# -> TpuInfo (per-TensorCore numbers, e.g. .vmem_capacity_bytes). Absent in older JAX.
get_tpu_info_for_chip = getattr(pltpu, "get_tpu_info_for_chip", None)


def force_tpu_interpret_mode(params=None):
    """Context manager: every ``pallas_call`` traced inside runs in TPU interpret mode.

    This is how kernels that take no ``interpret`` argument (the official
    ``jax.experimental.pallas.ops.tpu.flash_attention``) are run on a CPU.
    """
    params = InterpretParams() if params is None else params
    fn = getattr(pltpu, "force_tpu_interpret_mode", None)
    if fn is None:  # pragma: no cover - very old JAX
        return contextlib.nullcontext()
    return fn(params)


def reset_tpu_interpret_mode_state():
    """Reset TPU interpret mode's global state (needed after a kernel raised)."""
    fn = getattr(pltpu, "reset_tpu_interpret_mode_state", None)
    if fn is not None:
        fn()


def _race_state():
    # The race detector's state is a module global of the TPU interpreter; it is created
    # when a kernel starts and survives until the next one, so read it right after a call.
    try:
        from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
        return ipc.races
    except ImportError:  # pragma: no cover - older JAX kept it elsewhere
        from jax._src.pallas.mosaic import interpret as ipc
        return getattr(ipc, "races", None)


def races_found() -> bool | None:
    """Whether the last kernel run in TPU interpret mode (``detect_races=True``) had a race.

    ``None`` when no TPU-interpret kernel has run in this process yet.
    """
    state = _race_state()
    return None if state is None else bool(state.races_found)


def is_interpret_params(x) -> bool:
    """True for a ``pltpu.InterpretParams`` (TPU interpret mode) object."""
    return isinstance(x, InterpretParams)


# ----------------------------------------------------------------------------- official kernels

OFFICIAL_FLASH_MODULE = "jax.experimental.pallas.ops.tpu.flash_attention"
OFFICIAL_SPLASH_MODULE = "jax.experimental.pallas.ops.tpu.splash_attention"


def official_flash_attention():
    """The official Pallas TPU flash-attention module (``flash_attention``, ``BlockSizes``...)."""
    return importlib.import_module(OFFICIAL_FLASH_MODULE)


def official_splash_attention():
    """The official splash-attention module (``make_splash_mha``, ``CausalMask``...)."""
    return importlib.import_module(OFFICIAL_SPLASH_MODULE)


OFFICIAL_PAGED_MODULE = "jax.experimental.pallas.ops.tpu.paged_attention"
OFFICIAL_RAGGED_PAGED_MODULE = "jax.experimental.pallas.ops.tpu.ragged_paged_attention"


def official_paged_attention():
    """The official paged-attention decode kernel module (``paged_attention``)."""
    return importlib.import_module(OFFICIAL_PAGED_MODULE)


def official_ragged_paged_attention():
    """The official ragged paged attention module (``ragged_paged_attention``, mixed
    prefill and decode, K and V interleaved on the heads axis of one page pool)."""
    return importlib.import_module(OFFICIAL_RAGGED_PAGED_MODULE)


def versions() -> dict:
    """The installed ``jax``/``jaxlib`` versions and which moved names this module resolved."""
    import jax
    import jaxlib
    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "CompilerParams": f"pltpu.{CompilerParams.__name__}",
            "InterpretParams": f"pltpu.{InterpretParams.__name__}",
            "get_tpu_info_for_chip": get_tpu_info_for_chip is not None}


def direct_pallas_imports(package_dir=None) -> dict[str, list[str]]:
    """Modules of flashlab (other than this one) that import ``jax...pallas`` themselves.

    ``{relative path: [imported module, ...]}``; empty when every Pallas import goes through
    this module (tests/test_compat.py asserts that).
    """
    import ast
    import pathlib
    root = pathlib.Path(package_dir or pathlib.Path(__file__).resolve().parent.parent)
    found = {}
    for path in sorted(root.rglob("*.py")):
        if path.resolve() == pathlib.Path(__file__).resolve():
            continue
        mods = []
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                mods.append(node.module)
            elif isinstance(node, ast.Import):
                mods += [a.name for a in node.names]
        mods = [m for m in mods if m.startswith("jax") and "pallas" in m]
        if mods:
            found[str(path.relative_to(root.parent))] = mods
    return found


#: Whether ``pl.reciprocal`` takes ``full_range`` (newer JAX; absent in 0.7.0).
RECIPROCAL_FULL_RANGE = "full_range" in pl.reciprocal.__code__.co_varnames


def reciprocal_normal(x):
    """``1 / x`` for a float32 ``x`` that is never zero, infinite or subnormal (NaN passes):
    ``pl.reciprocal(x, full_range=False)``, Mosaic's own reciprocal without its fix-ups for
    those values; plain ``1 / x`` on a JAX without ``full_range``."""
    if RECIPROCAL_FULL_RANGE:
        return pl.reciprocal(x, approx=False, full_range=False)
    return 1.0 / x
