"""The dBias kernel (chapter 07): the gradient of a bias broadcast over batch and/or heads,
accumulated in its float32 output block over the broadcast axes, innermost, so no
``[B, N, T, S]`` array of dS is ever written (and, under the fused backward, which has no dQ
kernel to write dS, the gradient of any differentiated bias). Grid and BlockSpecs:
:func:`flashlab.kernels.backward_grid.dbias_grid_spec`; the tile: the backward's
(:func:`flashlab.kernels.backward_tile.tile`)."""
from __future__ import annotations

import functools

import jax.numpy as jnp

from flashlab.compat.pallas import pl
from flashlab.kernels import forward_grid
from flashlab.kernels.backward_grid import ForwardConfig, _dbias_order
from flashlab.kernels.backward_tile import tile as _tile
from flashlab.kernels.refs import RefNames, name_refs

__all__ = ["dbias_kernel"]


def dbias_kernel(*refs, cfg: ForwardConfig, names: RefNames):
    """Step over :func:`_dbias_order`: dBias_ij += dS_ij of one broadcast (b, h); ``refs`` by
    name."""
    ins = name_refs(refs, names)
    offsets_ref, dbias_ref = ins.get("offsets"), ins["dbias"]
    q_lengths_ref, kv_lengths_ref = ins["q_lengths"], ins["kv_lengths"]
    order = _dbias_order(cfg)
    ax = {a: pl.program_id(n) for n, a in enumerate(order)}
    b, i, j = ax["b"], ax["i"], ax["j"]
    q_len, kv_len = q_lengths_ref[b], kv_lengths_ref[b]

    bc = order[4 - sum(cfg.bias_bcast[:2]):]            # the broadcast axes, innermost

    def _init():
        dbias_ref[...] = jnp.zeros(dbias_ref.shape, jnp.float32)
    if bc:
        pl.when(functools.reduce(jnp.logical_and, [ax[a] == 0 for a in bc]))(_init)
    else:                                               # a full-shape bias: dBias = dS
        _init()

    lo, hi = forward_grid._kv_range(cfg, 0, i, (q_len,), (kv_len,), offsets_ref)

    @pl.when(jnp.logical_and(lo <= j, j <= hi))
    def _compute():
        ds = _tile(ins, cfg, *forward_grid.global_starts(
            offsets_ref, i * cfg.block_q, j * cfg.block_k, q_len, kv_len))[1]
        dbias_ref[...] += ds
