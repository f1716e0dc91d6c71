"""One tile of the backward, recomputed (chapter 07): :func:`tile` gives ``(P, dS, dS')``
of a ``[B_r, B_c]`` tile (the dQ and dBias kernels) or of its transpose ``[B_c, B_r]`` (the
dK/dV and fused kernels, :mod:`flashlab.kernels.backward`), and :func:`dkdv_tile` is one
step of the dK/dV (and fused) kernel around it: the matmuls into dK, dV (and dQ). A diagonal
piece reads its slice of each block through :class:`flashlab.kernels.refs.Window` as if it
were the whole block.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from flashlab.compat.pallas import pl
from flashlab.kernels import blocks as blk
from flashlab.kernels import forward as fwd
from flashlab.kernels.backward_grid import D_ROW, LOG2E, LSE_ROW, ForwardConfig
from flashlab.kernels.refs import Window

__all__ = ["EARLY_DV", "dkdv_tile", "tile"]

#: Where the dK/dV kernel issues ``dV += Pᵀ dO`` as soon as P exists, before ``dP`` and ``dS``
#: (as splash orders it), instead of after both: (chip, masked tile). The static schedule
#: decides (B=2 T=8192 H=16 d=128 bf16, 1024x1024, jax 0.12.0.1 / libtpu 0.0.50.1): the causal
#: tile falls 8493 -> 8395 cycles on v5e and 8490 -> 8396 on v5p, but rises 4516 -> 4678 on
#: v6e, 4609 -> 4743 on 7x and 8956 -> 9778 on v4; an unmasked tile moves 4 cycles on v5e.
EARLY_DV = frozenset({("v5e", True), ("v5p", True)})



def tile(ins, cfg: ForwardConfig, q_start, k_start, q_len, kv_len, *, transposed=False,
         lanes=False, use_p=None):
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
    :data:`EARLY_DV`). ``lanes`` (transposed only, :func:`backward_grid.grads_on_lanes`): dO
    is a ``[d_v, B_r]`` block, and ``dPᵀ = V (dOᵀ)`` a plain matmul.
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
    dp = jax.lax.dot_general(*((v, do) if transposed else (do, v)),    # lanes: V (dOᵀ)
                             (((1,), (0,)), ((), ())) if lanes else nt,
                             preferred_element_type=jnp.float32)
    ds = p * (dp - di)
    return p, ds, (ds if t is None else ds * (1.0 - t * t))


def dkdv_tile(ins, cfg: ForwardConfig, starts, dq_row, g, piece=None, write=False,
              inside=False, dq_write=False, lanes=False):
    """One dK/dV step's tile: ``dV_j += P_ijᵀ dO_i``, ``dK_j += dS'_ijᵀ Q_i`` into the
    accumulators, and with ``dq_row`` (the fused kernel: q block i's first row in its dQ
    block) ``dQ_i += dS'_ij K_j`` into head ``g``'s rows. ``piece``
    (:class:`diagonal.Piece`): only kv rows ``[k_lo, k_hi)`` by queries ``[q_lo, q_hi)`` of
    it, ``[k_hi − k_lo, q_hi − q_lo]``, masked only where ``piece.masked``. ``inside``: a
    whole tile below the causal diagonal (under :func:`diagonal.applies`, causal the only
    mask) or wholly inside a window's band (:func:`band.applies`), masked only by run-time
    lengths. ``write``: the kv block's first visit (:func:`diagonal.writes_first`): ``dV_j
    =``, ``dK_j =``; a traced bool (the dense grid's first step of a row) selects it.
    ``dq_write``: likewise ``dQ_i =`` (the dense grid's first kv row). ``lanes``
    (:func:`backward_grid.grads_on_lanes`): dO is a ``[d_v, B_r]`` block and dQ ``[G, d,
    T]``: ``dV += Pᵀ (dOᵀ)ᵀ`` and ``dQᵀ += Kᵀ dS'ᵀ`` (no transpose of dS')."""
    dk_acc, dv_acc = ins["dk_acc"], ins["dv_acc"]
    acc, view, tcfg, k0, q0 = (...), ins, cfg, 0, 0
    if piece is not None:               # the piece's rows of K, V and of Q, dO, stats_t
        k0, q0 = piece.k_lo, piece.q_lo
        nk, nq = piece.k_hi - k0, piece.q_hi - q0
        acc, qs = (pl.ds(k0, nk), slice(None)), pl.ds(q0, nq)
        do = Window(ins["do"], cols=qs) if lanes else Window(ins["do"], qs)   # lanes: [d_v, B_r]
        view = dict(ins, q=Window(ins["q"], qs), do=do,
                    k=Window(ins["k"], acc[0]), v=Window(ins["v"], acc[0]),
                    stats_t=Window(ins["stats_t"], cols=qs))
        unmasked = not (piece.masked or cfg.length_masked)
        tcfg = dataclasses.replace(cfg, block_q=nq, block_k=nk,
                                   is_causal=cfg.is_causal and not unmasked)

    if inside and not cfg.length_masked:
        tcfg = dataclasses.replace(cfg, is_causal=False, window=None)

    def into(ref, value, at=acc, first=write):                     # ref[at] (+)= value
        if isinstance(first, bool):
            ref[at] = value if first else ref[at] + value
        else:           # traced (the dense grid's row start): a select, never 0 · garbage
            ref[at] = jnp.where(first, value, ref[at] + value)

    nn, nt = (((1,), (0,)), ((), ())), (((1,), (1,)), ((), ()))      # A B, A Bᵀ

    def add_dv(p_t):                                               # dV_j += P_ijᵀ dO_i
        do = view["do"][...]
        into(dv_acc, jax.lax.dot_general(p_t.astype(do.dtype), do, nt if lanes else nn,
                                         preferred_element_type=jnp.float32))
    early = (cfg.chip, cfg.masks_tile) in EARLY_DV
    if piece is not None:
        starts = (starts[0] + q0, starts[1] + k0, *starts[2:])
    p_t, _, ds_t = tile(view, tcfg, *starts, transposed=True, lanes=lanes,
                        use_p=add_dv if early else None)
    q = view["q"][...]
    if not early:
        add_dv(p_t)
    ds_t = ds_t.astype(q.dtype)
    into(dk_acc, jnp.dot(ds_t, q, preferred_element_type=jnp.float32))
    if dq_row is not None:         # dQ_i += dS'ᵀᵀ K_j: [B_r, d]; lanes: dQ_iᵀ += K_jᵀ dS'ᵀ
        rows = pl.ds(pl.multiple_of(dq_row + q0, math.gcd(cfg.block_q, q0)), tcfg.block_q)
        tn = (((0,), (0,)), ((), ()))                                  # Aᵀ B
        into(ins["dq"], jax.lax.dot_general(
            *((view["k"][...], ds_t) if lanes else (ds_t, view["k"][...])), tn,
            preferred_element_type=jnp.float32),
            (g, slice(None), rows) if lanes else (g, rows, slice(None)), dq_write)
