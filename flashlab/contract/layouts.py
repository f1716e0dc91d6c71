"""Array layouts: jax.nn's ``[batch, seq, heads, head_dim]`` and the heads-major one.

The contract is written in jax.nn's layout, ``"BTNH"`` (``[B, T, N, H]``). Models that keep
activations heads-major, ``"BNTH"`` (``[B, N, T, H]``, the layout of splash and of
``jax.experimental.pallas.ops.tpu.flash_attention``), pass ``layout="BNTH"``: the call swaps
the seq and heads axes on the way in and back on the way out. The Pallas kernels read
``[B, N, T, H]`` themselves, so under ``jit`` XLA cancels each pair of swaps and the kernel
reads the caller's arrays as they are: no transposed copy of q, k, v or the output in HBM.
With ``"BTNH"`` those four copies are real (each one a read and a write of the whole array:
512 MiB at B=2, T=8192, N=16, H=128 in bf16); ``tests/test_tpu_compile.py`` reads both
compiled programs. Masks, biases, lengths and segment ids do not depend on the layout
(``[B, N, T, S]``, ``[B]``, ``[B, T]``).
"""
from __future__ import annotations

import jax.numpy as jnp

__all__ = ["LAYOUTS", "check_layout", "to_contract", "from_contract"]

LAYOUTS = ("BTNH", "BNTH")


def check_layout(layout) -> str:
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS} ('BTNH' = [batch, seq, heads, "
                         f"head_dim] as jax.nn, 'BNTH' = [batch, heads, seq, head_dim]), got "
                         f"{layout!r}")
    return layout


def to_contract(layout: str, *arrays):
    """``arrays`` in ``layout`` -> jax.nn's layout (rank 4, or rank 3 without the batch)."""
    if check_layout(layout) == "BTNH":
        return arrays
    out = []
    for x in arrays:
        x = jnp.asarray(x)
        if x.ndim not in (3, 4):
            raise ValueError(f"layout='BNTH': expected [batch, heads, seq, head_dim] (or "
                             f"[heads, seq, head_dim]) arrays, got shape {x.shape}")
        out.append(jnp.swapaxes(x, -3, -2))
    return tuple(out)


def from_contract(layout: str, out):
    """The result ``[..., T, N, H]`` (or an lse ``[..., N, T]`` left as the kernels make it)
    back in ``layout``."""
    return out if layout == "BTNH" else jnp.swapaxes(out, -3, -2)
