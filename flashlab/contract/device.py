"""Where am I running? Platform detection, Pallas interpret-mode choice, problem sizes.

On a TPU the Pallas kernels compile with Mosaic. Everywhere else they run in interpret
mode: the generic interpreter (``interpret=True``, compiled by XLA, fast) by default, or
TPU interpret mode (``pltpu.InterpretParams``: simulates VMEM, DMAs and semaphores, detects
races, ~30x slower) when a test asks for it.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
import platform as _platform

import jax

__all__ = ["platform", "interpret_mode", "tpu_interpret_params", "ProblemSizes",
           "problem_sizes", "describe", "in_colab", "target_chip", "compile_target"]


def platform() -> str:
    """``"tpu"``, ``"gpu"`` or ``"cpu"``: the platform of the default backend.

    ``"tpu"`` inside a :func:`compile_target` block
    (:func:`flashlab.instruments.tpu_compile.compile`): the code is being built for a TPU, so
    backends choose and compile as on one.
    """
    if _TARGET.get() is not None:
        return "tpu"
    p = jax.default_backend()
    return {"cuda": "gpu", "rocm": "gpu"}.get(p, p)


def interpret_mode(interpret=None):
    """Resolve a kernel's ``interpret`` argument.

    ``None``: compiled on TPU (returns ``False``), the generic interpreter elsewhere (``True``).
    ``True``/``False`` and a ``pltpu.InterpretParams`` are returned as given.
    """
    if interpret is None:
        return platform() != "tpu"
    return interpret


def tpu_interpret_params(*, detect_races: bool = True, uninitialized_memory: str = "nan", **kw):
    """TPU interpret mode with the race detector on and NaN-poisoned uninitialized memory."""
    from flashlab.compat.pallas import InterpretParams
    return InterpretParams(detect_races=detect_races,
                                 uninitialized_memory=uninitialized_memory, **kw)


def chip_from_device_kind(kind: str) -> str | None:
    """The generation name of a ``device_kind`` ("TPU v5 lite" -> ``"v5e"``), ``None`` if unknown."""
    kind = kind.lower()
    for name, pat in (("v5e", "v5 lite"), ("v5e", "v5e"), ("v6e", "v6"), ("v5p", "v5"),
                      ("v4i", "v4 lite"), ("v4", "v4"), ("v3", "v3"), ("v2", "v2"), ("7x", "7")):
        if pat in kind:
            return name
    return None


def detect_chip() -> str | None:
    """The TPU generation name (``"v5e"``...) of the default device, or ``None`` off-TPU."""
    dev = jax.devices()[0]
    if dev.platform != "tpu":
        return None
    return chip_from_device_kind(dev.device_kind)


_TARGET = contextvars.ContextVar("flashlab_compile_target", default=None)


@contextlib.contextmanager
def compile_target(chip: str | None):
    """Inside this block the kernels size their blocks and VMEM limit for ``chip``.

    :func:`flashlab.instruments.tpu_compile.compile` enters it with the generation of the devices
    it compiles for; ``None`` leaves the current target unchanged.
    """
    token = _TARGET.set(chip) if chip is not None else None
    try:
        yield chip
    finally:
        if token is not None:
            _TARGET.reset(token)


def _mesh_chip() -> str | None:
    """The TPU generation of the (abstract) mesh being traced under, if it carries one."""
    try:
        dev = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    except Exception:  # pragma: no cover - JAX without abstract meshes
        return None
    kind = getattr(dev, "device_kind", None)
    return chip_from_device_kind(kind) if kind and getattr(dev, "platform", "tpu") == "tpu" else None


def target_chip() -> str | None:
    """The TPU generation the kernels are being built for, or ``None`` (then: ``v5e``).

    First wins: a :func:`compile_target` block (what
    :func:`flashlab.instruments.tpu_compile.compile` sets from the devices it compiles for); the
    TPU devices of the mesh being traced under (``jax.sharding.use_mesh`` / ``jax.set_mesh``); this
    host's TPU. An explicit ``chip=`` given to a kernel wins over all of them
    (:func:`flashlab.kernels.blocks.resolve_chip`).
    """
    return _TARGET.get() or _mesh_chip() or detect_chip()


@dataclasses.dataclass(frozen=True)
class ProblemSizes:
    """Sizes a notebook uses so it runs in seconds on CPU and at real size on a TPU."""

    batch: int
    heads: int
    head_dim: int
    seq_lens: tuple[int, ...]      # sweep for time/memory plots
    seq_len: int                   # a single "typical" length for demos


_SIZES = {
    "cpu": ProblemSizes(batch=1, heads=4, head_dim=64, seq_lens=(256, 512, 1024, 2048), seq_len=512),
    "gpu": ProblemSizes(batch=4, heads=16, head_dim=128, seq_lens=(1024, 2048, 4096, 8192, 16384),
                        seq_len=4096),
    "tpu": ProblemSizes(batch=4, heads=16, head_dim=128, seq_lens=(1024, 2048, 4096, 8192, 16384),
                        seq_len=4096),
}


def problem_sizes(which: str | None = None) -> ProblemSizes:
    """Problem sizes for ``which`` platform (default: the current one)."""
    which = platform() if which is None else which
    if which not in _SIZES:
        raise ValueError(f"which: expected one of {sorted(_SIZES)}, got {which!r}")
    return _SIZES[which]


def in_colab() -> bool:
    """True inside a Google Colab runtime."""
    return "COLAB_RELEASE_TAG" in os.environ or "COLAB_GPU" in os.environ


def describe() -> dict:
    """A small, stable summary of this runtime (what chapter 00 prints)."""
    dev = jax.devices()[0]
    mode = interpret_mode()
    return {
        "platform": platform(),
        "device_kind": dev.device_kind if platform() != "cpu" else "cpu",
        "device_count": jax.device_count(),
        "pallas": "compiled (Mosaic)" if mode is False else "interpret mode (generic interpreter)",
        "machine": _platform.machine(),
    }
