"""One tile of the backward, recomputed (chapter 07): :func:`tile` gives ``(P, dS, dS')``
of a ``[B_r, B_c]`` tile (the dQ and dBias kernels) or of its transpose ``[B_c, B_r]`` (the
dK/dV and fused kernels, :mod:`flashlab.kernels.backward`). A diagonal piece reads its slice
of each block through :class:`flashlab.kernels.refs.Window` as if it were the whole block.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from flashlab.kernels import blocks as blk
from flashlab.kernels import forward as fwd
from flashlab.kernels.backward_grid import D_ROW, LOG2E, LSE_ROW, ForwardConfig

__all__ = ["tile"]


def tile(ins, cfg: ForwardConfig, q_start, k_start, q_len, kv_len, *, transposed=False,
          use_p=None):
    """Recompute one tile: ``(P, dS, dS')`` float32, ``[B_r, B_c]`` or ``[B_c, B_r]``.

    ``dS = P ∘ (dP − D)`` is the gradient w.r.t. the logits after the soft cap and bias (so
    it is dBias); ``dS'`` is w.r.t. ``scale·q·k`` (through the soft cap's ``1 − tanh²``).

    ``transposed`` (the dK/dV kernel): ``Sᵀ = K Qᵀ`` directly, as splash does, so
    ``dV = Pᵀ dO`` and ``dK = dS'ᵀ Q`` are plain matmuls with no transpose of P or dS on the
    XLU; a bias or dense-mask block ``[B_r, B_c]`` is transposed once in VMEM, and lse, D_i
    are rows ``[1, B_r]`` of ``stats_t`` (a sublane broadcast). Otherwise (dQ, dBias) they
    are lane-replicated ``stats`` tiled to ``[B_r, B_c]``: whole vregs reused, no lane
    broadcast. The logits are kept in log2 units (``log2(e)`` folded into the scale, the
    bias and the wrapper's lse), so ``P = exp2(S₂ − lse₂)`` costs no multiply per score.
    One mask definition: :func:`masks.structural_visible` on (transposed) positions.
    ``use_p(P)``: called as soon as P exists, before ``dP`` (the dK/dV kernel's early dV,
    :data:`EARLY_DV`).
    """
    q, k, v, do = ins["q"][...], ins["k"][...], ins["v"][...], ins["do"][...]
    bk, L = cfg.block_k, blk.LANES
    nt = (((1,), (1,)), ((), ()))                                 # A Bᵀ
    orient = (lambda x: x.T) if transposed else (lambda x: x)     # noqa: E731
    s = jax.lax.dot_general(*((k, q) if transposed else (q, k)), nt,
                            preferred_element_type=jnp.float32)
    t = None
    if cfg.soft_cap is None:
        s = s * (cfg.scale * LOG2E)
    else:
        t = jnp.tanh(s * (cfg.scale / cfg.soft_cap))
        s = (cfg.soft_cap * LOG2E) * t
    if "bias" in ins:
        s = s + orient(fwd.scores_block(ins, "bias", cfg)) * LOG2E
    visible = fwd.tile_visible(ins, cfg, q_start, k_start, q_len, kv_len,
                               transposed=transposed)
    if transposed:
        lse, di = ins["stats_t"][LSE_ROW:LSE_ROW + 1, :], ins["stats_t"][D_ROW:D_ROW + 1, :]
    else:
        lse = jnp.tile(ins["stats"][:, :L], (1, bk // L))
        di = jnp.tile(ins["stats"][:, L:], (1, bk // L))
    if visible is not None:                                       # None: nothing masked
        s = jnp.where(visible, s, -jnp.inf)
    p = jnp.exp2(s - lse)                                         # masked: exp2(-inf) = 0
    if use_p is not None:
        use_p(p)
    dp = jax.lax.dot_general(*((v, do) if transposed else (do, v)), nt,
                             preferred_element_type=jnp.float32)
    ds = p * (dp - di)
    return p, ds, (ds if t is None else ds * (1.0 - t * t))
