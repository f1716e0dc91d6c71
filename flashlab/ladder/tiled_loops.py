"""The tiled rung's loops over one head's tiles: the forward (online softmax) and the
FlashAttention-2 backward, on the layout and schedule of :mod:`flashlab.ladder.tiled_schedule`.
"""
from __future__ import annotations


import jax
import jax.numpy as jnp

from flashlab.ladder import online_softmax as osm
from flashlab.compat.shard_map import pvary, vma_of

from flashlab.ladder.tiled_schedule import (
    TileAux, TileConfig, acc_dtype, prescale, q_rows, row_bounds, scores, three_loops,
    visible_tile, visit_tables)


def forward_loops(cfg: TileConfig, q4, k3, v3, bias5, aux: TileAux, sinks2=None):
    """``(out [BK, G, Tp, d_v], lse [BK, G, Tp])`` in the accumulation dtype; ``sinks2 [BK, G]``."""
    BK, G, Tp, _ = q4.shape
    Hv = v3.shape[-1]
    ranges, used = visit_tables(cfg, aux, transposed=False)              # [4, Tr]
    qs = prescale(cfg, q4)
    axes = vma_of(q4, k3, v3, bias5, aux)

    def q_block(i):
        q_blk = q_rows(qs, cfg, i)                                 # [BK, G·bq, d]

        def kv_step(masked):
            def body(j, state):
                k_blk = jax.lax.dynamic_slice_in_dim(k3, j * cfg.bk, cfg.bk, 1)  # [BK, bk, d]
                v_blk = jax.lax.dynamic_slice_in_dim(v3, j * cfg.bk, cfg.bk, 1)  # [BK, bk, d_v]
                s, _ = scores(cfg, q_blk, k_blk, bias5, i, j)     # [BK, G·bq, bk]
                vis = visible_tile(cfg, aux, i, j, False) if masked else None
                return osm.update(state, s, v_blk, vis)
            return body

        bounds = row_bounds(ranges, i, row_len=aux.q_lengths, row_block=cfg.bq,
                         col_len=aux.kv_lengths, col_block=cfg.bk)
        # Inside shard_map the initial state varies over the mesh axes its data does.
        state = three_loops(bounds, used, kv_step(True), kv_step(False),
                             pvary(osm.init((BK, G * cfg.bq), Hv, acc_dtype(q4.dtype)), axes))
        if sinks2 is not None:
            state = osm.merge(state, osm.sink_state(jnp.repeat(sinks2, cfg.bq, axis=-1), Hv))
        out, lse = osm.finalize(state)
        return out.reshape(BK, G, cfg.bq, Hv), lse.reshape(BK, G, cfg.bq)

    out, lse = jax.lax.map(q_block, jnp.arange(Tp // cfg.bq))       # [Tr, BK, G, bq, .]
    return (jnp.moveaxis(out, 0, 2).reshape(BK, G, Tp, Hv),
            jnp.moveaxis(lse, 0, 2).reshape(BK, G, Tp))


def backward_loops(cfg: TileConfig, q4, k3, v3, bias5, aux: TileAux, out4, lse3, dout4, dlse3):
    """FlashAttention-2 backward: kv blocks outer, the q blocks that see them inner."""
    BK, G, Tp, H = q4.shape
    Sp, Hv = k3.shape[1], v3.shape[-1]
    f32 = acc_dtype(q4.dtype)                          # float32 (float64 for float64 inputs)
    ranges, used = visit_tables(cfg, aux, transposed=True)               # [4, Tc]
    axes = vma_of(q4, k3, v3, bias5, aux, dout4, dlse3)   # loop carries vary as the data do
    lowp = jnp.dtype(q4.dtype).itemsize < 4
    mm_dtype = q4.dtype if lowp else f32          # dtype of P, dS fed to the matmuls
    qs = prescale(cfg, q4)
    # D_i = rowsum(dO ∘ O) - dlse  (the lse cotangent enters as dS += P ∘ dlse).
    # Rows with no visible key have lse = -inf (P = 0 there anyway); a NaN lse (NaN logits)
    # is kept, so the gradients of a diverged row are NaN, as the forward is.
    empty = lse3 == -jnp.inf
    D = jnp.sum(dout4.astype(f32) * out4.astype(f32), axis=-1)      # [BK, G, Tp]
    D = D - jnp.where(empty, 0.0, dlse3)
    lse_use = jnp.where(empty, 0.0, lse3)
    do4 = dout4.astype(q4.dtype)
    row_vec = lambda x, i: jax.lax.dynamic_slice_in_dim(x, i * cfg.bq, cfg.bq, 2).reshape(BK, 1, -1)

    def kv_block(carry, j):
        dq, dbias = carry
        k_blk = jax.lax.dynamic_slice_in_dim(k3, j * cfg.bk, cfg.bk, 1)   # [BK, bk, d]
        v_blk = jax.lax.dynamic_slice_in_dim(v3, j * cfg.bk, cfg.bk, 1)   # [BK, bk, d_v]

        def q_step(masked):
            def body(i, c):
                dq, dbias, dk, dv = c
                q_blk = q_rows(qs, cfg, i)                        # [BK, G·bq, d]
                do_blk = q_rows(do4, cfg, i)                      # [BK, G·bq, d_v]
                s, raw = scores(cfg, q_blk, k_blk, bias5, i, j, transposed=True)  # [BK, bk, G·bq]
                if masked:
                    s = jnp.where(visible_tile(cfg, aux, i, j, True), s, -jnp.inf)
                p = jnp.exp(s - row_vec(lse_use, i))
                dp = jnp.einsum("bsd,brd->bsr", v_blk, do_blk, preferred_element_type=f32)
                ds = p * (dp - row_vec(D, i))                       # dL/d(logits + bias)
                dsr = ds
                if cfg.soft_cap is not None:
                    t = jnp.tanh(raw / cfg.soft_cap)
                    dsr = ds * (1.0 - t * t)                        # through c·tanh(s/c)
                pm, dsm = p.astype(mm_dtype), dsr.astype(mm_dtype)
                dv = dv + jnp.einsum("bsr,brd->bsd", pm, do_blk.astype(mm_dtype),
                                     preferred_element_type=f32)
                dk = dk + jnp.einsum("bsr,brd->bsd", dsm, q_blk.astype(mm_dtype),
                                     preferred_element_type=f32)
                dq_t = jnp.einsum("bsr,bsd->brd", dsm, k_blk.astype(mm_dtype),
                                  preferred_element_type=f32)       # [BK, G·bq, d]
                q0 = i * cfg.bq
                old = jax.lax.dynamic_slice_in_dim(dq, q0, cfg.bq, 2)
                dq = jax.lax.dynamic_update_slice_in_dim(dq, old + dq_t.reshape(old.shape), q0, 2)
                if bias5 is not None:     # add: a T or S dim of 1 collects many tiles
                    dbias = add_tile(dbias, bias_grad(ds, cfg, bias5.shape), cfg, i, j)
                return dq, dbias, dk, dv
            return body

        bounds = row_bounds(ranges, j, row_len=aux.kv_lengths, row_block=cfg.bk,
                         col_len=aux.q_lengths, col_block=cfg.bq)
        zeros = pvary((jnp.zeros((BK, cfg.bk, H), f32), jnp.zeros((BK, cfg.bk, Hv), f32)), axes)
        dq, dbias, dk, dv = three_loops(bounds, used, q_step(True), q_step(False),
                                         (dq, dbias, *zeros))
        return (dq, dbias), (dk, dv)

    dq0 = jnp.zeros((BK, G, Tp, H), f32)
    db0 = jnp.zeros(()) if bias5 is None else jnp.zeros(bias5.shape, f32)
    (dq, dbias), (dk, dv) = jax.lax.scan(kv_block, pvary((dq0, db0), axes),
                                         jnp.arange(Sp // cfg.bk))
    # dQ = scale · dS K, applied once per element rather than per tile; dK = scale · dSᵀ Q
    # already holds the scale when q was pre-scaled (>= 32-bit dtypes).
    dq = dq * cfg.scale
    if lowp:
        dk = dk * cfg.scale
    dk = jnp.moveaxis(dk, 0, 1).reshape(BK, Sp, H)       # [Tc, BK, bk, d] -> [BK, Sp, d]
    dv = jnp.moveaxis(dv, 0, 1).reshape(BK, Sp, Hv)
    return dq, dk, dv, (None if bias5 is None else dbias)


def bias_grad(ds, cfg, bias_shape):
    """``dS [BK, bk, G·bq]`` (backward rows layout) -> the bias tile ``[b, k, g, bq|1, bk|1]``,
    summed over the dimensions the bias broadcasts over (batch, heads, T, S)."""
    ds = ds.reshape(cfg.B, cfg.K, cfg.bk, cfg.G, cfg.bq)
    ds = jnp.moveaxis(ds, 2, 4)                                      # [B, K, G, bq, bk]
    axes = tuple(a for a in range(5) if bias_shape[a] == 1 and ds.shape[a] > 1)
    return ds.sum(axis=axes, keepdims=True) if axes else ds


def add_tile(dbias, tile, cfg, i, j):
    """``dbias [.., Tp|1, Sp|1] += tile`` at blocks (i, j); a broadcast dim of 1 sums there."""
    at = [0, 0, 0, i * cfg.bq if dbias.shape[3] > 1 else 0, j * cfg.bk if dbias.shape[4] > 1 else 0]
    at = [jnp.asarray(a, jnp.int32) for a in at]     # one index dtype, also under x64
    old = jax.lax.dynamic_slice(dbias, at, tile.shape)
    return jax.lax.dynamic_update_slice(dbias, old + tile, at)

