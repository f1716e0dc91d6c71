"""Where am I running? Platform detection, Pallas interpret-mode choice, problem sizes.

On a TPU the Pallas kernels compile with Mosaic. Everywhere else they run in interpret
mode: the generic interpreter (``interpret=True``, compiled by XLA, fast) by default, or
TPU interpret mode (``pltpu.InterpretParams``: simulates VMEM, DMAs and semaphores, detects
races, ~30x slower) when a test asks for it.
"""
from __future__ import annotations

import dataclasses
import os
import platform as _platform

import jax

__all__ = ["platform", "interpret_mode", "tpu_interpret_params", "ProblemSizes",
           "problem_sizes", "describe", "in_colab"]


def platform() -> str:
    """``"tpu"``, ``"gpu"`` or ``"cpu"``: the platform of the default backend."""
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
    from .kernels._pallas_compat import InterpretParams
    return InterpretParams(detect_races=detect_races,
                                 uninitialized_memory=uninitialized_memory, **kw)


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
