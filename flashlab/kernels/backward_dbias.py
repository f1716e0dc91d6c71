"""The dBias kernel: the gradient of a bias broadcast over batch and/or heads, in-kernel.

A bias ``[1|B, 1|N, T, S]`` gets ``dBias = Σ_(broadcast b, h) dS`` with ``dS = P ∘ (dP − D)``
(:func:`flashlab.kernels.backward._tile`). Writing the full float32 dS ``[B, N, T, S]``
and summing it in XLA (2 GiB at B=2, N=16, T=S=4096) is what this kernel avoids: its grid is
the bias's own axes, then ``(T_r, T_c)``, then the broadcast axes innermost ("arbitrary"), so
the float32 output block ``dBias_ij`` stays resident in VMEM while every broadcast (b, h)
adds its dS_ij to it, and is written once. Each step recomputes S and dP (two matmuls), which
costs less than writing and re-reading 4 bytes of dS per score on every TPU generation.
A full-shape bias keeps the dQ kernel's dS output (that *is* dBias).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from . import forward as fwd
from ._pallas_compat import pl
from .backward import BackwardGridSpec, ForwardConfig, _q_side_operands, _tile

__all__ = ["dbias_grid_spec", "dbias_kernel"]


def _dbias_order(cfg: ForwardConfig) -> tuple[str, ...]:
    """Grid axes of the dBias kernel: the bias's own axes, then its broadcast ones innermost."""
    bcast = dict(zip("bh", cfg.bias_bcast))
    return tuple(a for a in "bh" if not bcast[a]) + ("i", "j") + tuple(
        a for a in "bh" if bcast[a])


def dbias_grid_spec(cfg: ForwardConfig) -> BackwardGridSpec:
    """The dBias kernel, for a bias broadcast over batch and/or heads (``[1|B, 1|N, T, S]``;
    also a full-shape one under the fused backward, which has no dQ kernel to write dS).

    dBias_ij = Σ over the broadcast (b, h) of dS_ij, accumulated in the float32 output block
    itself: the grid is the bias's own axes, then ``(i, j)``, then the broadcast axes, which
    are innermost and "arbitrary", so the block stays resident while they run and no
    ``[B, N, T, S]`` array is ever made. Each step recomputes S and dP (two matmuls).
    """
    order = _dbias_order(cfg)
    sizes = dict(b=cfg.batch, h=cfg.num_heads, i=cfg.num_q_blocks, j=cfg.num_kv_blocks)
    maps = fwd.index_maps(cfg)

    def bhij(f):                            # a (b, h, i, j) map on this grid's order
        def m(*idx):
            ax = dict(zip(order, idx[:4]))
            return f(ax["b"], ax["h"], ax["i"], ax["j"], *idx[4:])
        return m

    def dbias_map(b, h, i, j, *_):
        return (0 if cfg.bias_bcast[0] else b, 0 if cfg.bias_bcast[1] else h, i, j)

    names, specs, shapes = _q_side_operands(
        cfg, bhij(maps.q), bhij(maps.kv), lambda bc: bhij(maps.scores_for(bc)),
        bhij(maps.q_seg), bhij(maps.kv_seg))
    bias_shape = fwd.mask_operands(cfg, maps.scores_for, maps.q_seg, maps.kv_seg)[2][0].shape
    n_bc = sum(cfg.bias_bcast)     # 0: a full-shape bias (fused backward), all parallel
    return BackwardGridSpec(
        config=cfg, grid=tuple(sizes[a] for a in order), in_names=tuple(names),
        in_specs=tuple(specs), in_shapes=tuple(shapes), out_names=("dbias",),
        out_specs=(pl.BlockSpec((None, None, cfg.block_q, cfg.block_k), bhij(dbias_map)),),
        out_shapes=(jax.ShapeDtypeStruct(bias_shape, jnp.float32),), scratch_shapes=(),
        dimension_semantics=("parallel",) * (4 - n_bc) + ("arbitrary",) * n_bc,
        name="flashlab_flash_backward_dbias")


def dbias_kernel(q_lengths_ref, kv_lengths_ref, *refs, cfg: ForwardConfig, names):
    """Step over :func:`_dbias_order`: dBias_ij += dS_ij of one broadcast (b, h)."""
    offsets_ref, refs = (refs[0], refs[1:]) if cfg.has_offsets else (None, refs)
    n_in = len(names)
    ins = dict(zip(names, refs[:n_in]))
    dbias_ref = refs[n_in]
    order = _dbias_order(cfg)
    ax = {a: pl.program_id(n) for n, a in enumerate(order)}
    b, i, j = ax["b"], ax["i"], ax["j"]
    q_len, kv_len = q_lengths_ref[b], kv_lengths_ref[b]

    bc = order[4 - sum(cfg.bias_bcast):]                # the broadcast axes, innermost

    def _init():
        dbias_ref[...] = jnp.zeros(dbias_ref.shape, jnp.float32)
    if bc:
        pl.when(functools.reduce(jnp.logical_and, [ax[a] == 0 for a in bc]))(_init)
    else:                                               # a full-shape bias: dBias = dS
        _init()

    lo, hi = fwd._kv_range(cfg, 0, i, (q_len,), (kv_len,), offsets_ref)

    @pl.when(jnp.logical_and(lo <= j, j <= hi))
    def _compute():
        ds = _tile(ins, cfg, *fwd.global_starts(
            offsets_ref, i * cfg.block_q, j * cfg.block_k, q_len, kv_len))[1]
        dbias_ref[...] += ds
