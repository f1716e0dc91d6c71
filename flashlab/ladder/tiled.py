"""Rung 2: tiled (FlashAttention) attention in plain JAX, forward and backward.

The score matrix is never built. Queries are cut into blocks of ``block_q`` rows (the
paper's B_r), keys/values into blocks of ``block_k`` (B_c). For each query block ``Q_i`` we
loop over the key blocks ``K_j, V_j`` that :func:`flashlab.contract.masks.block_maybe_visible`
allows and fold each score tile ``S_ij = scale · Q_i K_jᵀ`` into the running state ``(m, l, O)`` of
:mod:`flashlab.ladder.online_softmax`; at the end ``O_i = acc / l`` and ``lse_i = m + log l``.

The backward pass is FlashAttention-2's: only ``O`` and ``lse`` are kept from the forward
(O(N) memory); each tile's probabilities are recomputed as ``P_ij = exp(S_ij - lse_i)``, and
with ``D_i = rowsum(dO_i ∘ O_i)``::

    dV_j += P_ijᵀ dO_i        dP_ij = dO_i V_jᵀ        dS_ij = P_ij ∘ (dP_ij − D_i)
    dQ_i += scale · dS_ij K_j                           dK_j += scale · dS_ijᵀ Q_i

The loops run one (batch, kv head) at a time, so a score tile stays in a core's L2 cache
between its matmul and the softmax passes over it. A query block is laid out
``[G·block_q, d]``: the G query heads of a GQA group are extra rows reading the same K/V
block, so K/V are read once and never repeated in memory, and each product is one matmul.

Speed on CPU comes from big tiles and from doing no per-element mask work in tiles that are
fully visible: each query block (each key block, in the backward) walks three static ranges,
masked / unmasked / masked, so for causal attention only the diagonal tiles pay for a mask,
and tiles that are entirely invisible are not visited at all.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from flashlab.contract import autodiff
from flashlab.ladder import online_softmax as osm
from flashlab.contract.masks import AttentionSpec, validate
from flashlab.compat.shard_map import pvary, vma_of
from flashlab.ladder.tiled_loops import backward_loops, forward_loops
from flashlab.ladder.tiled_schedule import (
    DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q, TileAux, TileConfig, acc_dtype, block_sizes, block_tables,
    heads5, pad_axis, round_up, visit_ranges)

__all__ = ["tiled_attention", "tiled_attention_from_spec", "tiled_attention_with_lse_from_spec",
           "tiled_attention_backward_from_spec",
           "tiled_hbm_bytes", "DEFAULT_BLOCK_Q", "DEFAULT_BLOCK_K", "block_tables",
           "visit_ranges"]

# ----------------------------------------------------------------------------- public API

def tiled_attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
                    query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
                    segment_ids=None, logits_soft_cap=None, block_q=None, block_k=None,
                    sinks=None):
    """Blockwise (FlashAttention) attention: same arguments and results as ``naive_attention``.

    Args:
      query: ``[batch, q_seq, heads, d]``.
      key, value: ``[batch, kv_seq, kv_heads, d]``.
      bias, mask: as in :func:`flashlab.ladder.reference.naive_attention`, like the mask keywords
        and ``sinks`` (merged into each row's state as one more block: a key with logit
        ``sink`` and no value).
      block_q, block_k: query/key block sizes (B_r, B_c), positive ints; default
        ``DEFAULT_BLOCK_Q``/``DEFAULT_BLOCK_K`` (clipped to the sequence lengths). Any
        sequence length works: the last block is padded internally and the padding masked.

    Returns:
      ``[batch, q_seq, heads, d_v]`` in the query's dtype (accumulation in float32, float64
      for float64 inputs).
      Differentiable (custom VJP, O(N) residuals) w.r.t. query, key, value and bias.
    """
    query, key, value, spec = validate(
        query, key, value, bias, mask, scale=scale, is_causal=is_causal,
        query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
        local_window_size=local_window_size, segment_ids=segment_ids,
        logits_soft_cap=logits_soft_cap, sinks=sinks)
    return tiled_attention_from_spec(query, key, value, spec, block_q=block_q, block_k=block_k)


def tiled_attention_from_spec(query, key, value, spec: AttentionSpec, *, block_q=None,
                              block_k=None):
    """Tiled attention on already validated inputs (what backends call). Returns ``out``."""
    return tiled_attention_with_lse_from_spec(query, key, value, spec, block_q=block_q,
                                              block_k=block_k)[0]


def tiled_attention_with_lse_from_spec(query, key, value, spec: AttentionSpec, *, block_q=None,
                                       block_k=None):
    """Tiled attention returning ``(out [B, T, N, d_v] query dtype, lse [B, N, T] float32)``
    (lse float64 for float64 inputs).

    ``lse`` is ``-inf`` for rows with no visible key (with ``spec.sinks`` it includes the
    sink: ``lse = sink`` on such rows, whose output is still 0). Both outputs are differentiable
    (the lse cotangent adds ``P ∘ dlse`` to dS), so states of disjoint key sets can be merged
    outside (ring attention) and still be trained through.
    """
    bq, bk = block_sizes(block_q, block_k, query.shape[1], key.shape[1])
    # Forward mode (jax.jvp, jacfwd) cannot enter the custom_vjp: push the tangent through the
    # forward loops themselves instead (still O(N) memory). Seen on the inputs at dispatch.
    plain = autodiff.requested(query, key, value, spec.bias) == {"forward_mode"}
    return _with_lse(query, key, value, spec, bq, bk, plain)


@functools.partial(jax.jit, static_argnums=(4, 5, 6))
def _with_lse(query, key, value, spec: AttentionSpec, bq: int, bk: int, plain: bool = False):
    # Jitted as a whole: one compilation per shape/spec instead of eager op-by-op dispatch.
    B, T, N, _ = query.shape
    Hv = value.shape[3]
    cfg, q4, k3, v3, bias5, aux = _prepare(query, key, value, spec, bq, bk)
    K, G = cfg.K, cfg.G
    sinks2 = None                       # [N] -> [B·K, G], the rows layout of the heads
    if spec.sinks is not None:
        sinks2 = jnp.tile(spec.sinks.astype(jnp.float32).reshape(1, K, G), (B, 1, 1))
        sinks2 = sinks2.reshape(B * K, G)
    # Inside shard_map: every operand varies over the same mesh axes, so each cotangent has
    # its primal's type (JAX sums a replicated input's cotangent outside, as for any op).
    q4, k3, v3, bias5, aux = pvary((q4, k3, v3, bias5, aux), vma_of(q4, k3, v3, bias5, aux))
    out4, lse3 = (_forward_by_head if plain else _flash)(cfg, q4, k3, v3, bias5, aux, sinks2)
    out = out4[:, :, :T].reshape(B, K, G, T, Hv).transpose(0, 3, 1, 2, 4).reshape(B, T, N, Hv)
    lse = lse3[:, :, :T].reshape(B, N, T)
    return out.astype(query.dtype), lse


def _prepare(query, key, value, spec: AttentionSpec, bq: int, bk: int):
    """Public layout -> ``(cfg, q4, k3, v3, bias5, aux)``, the loops' padded operands."""
    B, T, N, H = query.shape
    S, K = key.shape[1], key.shape[2]
    G = N // K
    cfg = TileConfig(B=B, K=K, G=G, T=T, S=S, bq=bq, bk=bk, scale=spec.scale,
                  soft_cap=spec.soft_cap, is_causal=spec.is_causal, window=spec.window,
                  offsets=spec.has_offsets)
    Tp, Sp = round_up(T, bq), round_up(S, bk)
    # [B, T, N, d] -> [B·K, G, T, d]: query head h = k*G + g reads kv head k.
    q4 = query.reshape(B, T, K, G, H).transpose(0, 2, 3, 1, 4).reshape(B * K, G, T, H)
    q4 = pad_axis(q4, 2, Tp)
    kv3 = lambda x: pad_axis(x.transpose(0, 2, 1, 3).reshape(B * K, S, x.shape[3]), 1, Sp)
    k3, v3 = kv3(key), kv3(value)                               # [B·K, Sp, d], [B·K, Sp, d_v]
    # [B|1, K|1, G|1, Tp|1, Sp|1]: a T or S dim of 1 stays 1 (broadcast tile by tile).
    pad5 = lambda x: pad_axis(pad_axis(heads5(x, K, G), 3, Tp if x.shape[2] > 1 else 1),
                              4, Sp if x.shape[3] > 1 else 1)
    bias5 = None if spec.bias is None else pad5(spec.bias)
    q_lengths, kv_lengths = spec.local_lengths()                # lengths of this block
    q_off, kv_off = spec.offsets() if spec.has_offsets else (None, None)
    aux = TileAux(mask=None if spec.mask is None else pad5(spec.mask),
               q_lengths=q_lengths, kv_lengths=kv_lengths,
               q_seg=None if spec.q_segment_ids is None else pad_axis(spec.q_segment_ids, 1, Tp),
               kv_seg=None if spec.kv_segment_ids is None else pad_axis(spec.kv_segment_ids, 1, Sp),
               q_offset=q_off, kv_offset=kv_off)
    return cfg, q4, k3, v3, bias5, aux


def tiled_attention_backward_from_spec(query, key, value, spec: AttentionSpec, out, lse, d_out,
                                       *, block_q=None, block_k=None):
    """The tiled backward on its own, given the forward's ``out`` and ``lse``.

    ``out [B, T, N, d_v]`` and ``lse [B, N, T]`` float32 may come from a *larger* softmax than
    this call's keys (ring attention passes the global ones): ``P = exp(S - lse)`` is then this
    block's share of the global P, and the gradients returned are this block's contribution.
    Returns ``(dq [B, T, N, d], dk [B, S, K, d], dv [B, S, K, d_v], dbias | None)`` float32.
    """
    bq, bk = block_sizes(block_q, block_k, query.shape[1], key.shape[1])
    return _backward_public(query, key, value, spec, out, lse, d_out, bq, bk)


@functools.partial(jax.jit, static_argnums=(7, 8))
def _backward_public(query, key, value, spec, out, lse, d_out, bq, bk):
    B, T, N, H = query.shape
    S, K, Hv = key.shape[1], key.shape[2], value.shape[3]
    cfg, q4, k3, v3, bias5, aux = _prepare(query, key, value, spec, bq, bk)
    G, Tp = cfg.G, q4.shape[2]
    rows = lambda x: pad_axis(x.reshape(B, T, K, G, -1).transpose(0, 2, 3, 1, 4)    # noqa: E731
                          .reshape(B * K, G, T, x.shape[-1]), 2, Tp)
    lse3 = pad_axis(lse.astype(jnp.float32).reshape(B * K, G, T), 2, Tp)
    dq, dk, dv, dbias = _backward_by_head(cfg, q4, k3, v3, bias5, aux, rows(out), lse3,
                                          rows(d_out), jnp.zeros_like(lse3))
    dq = dq[:, :, :T].reshape(B, K, G, T, H).transpose(0, 3, 1, 2, 4).reshape(B, T, N, H)
    unkv = lambda x: x[:, :S].reshape(B, K, S, x.shape[-1]).transpose(0, 2, 1, 3)  # noqa: E731
    if dbias is not None:
        dbias = dbias[..., :T, :S].reshape(spec.bias.shape)
    return dq, unkv(dk), unkv(dv), dbias


def tiled_hbm_bytes(*, batch: int, heads: int, q_len: int, kv_len: int, head_dim: int,
                    bytes_per_element: int, block_q: int = DEFAULT_BLOCK_Q,
                    kv_heads: int | None = None) -> dict[str, int]:
    """Memory traffic of the tiled forward when only tiles fit in fast memory.

    Each query block ``Q_i`` (and its output ``O_i``) is read/written once; every key/value
    block is re-read once per query block: ``T_r = ceil(N / B_r)`` passes over K and V, so the
    K/V term is ``2·N·M·d/B_r`` elements per head: still quadratic, but ``B_r/d`` times smaller
    than writing and reading the ``N×M`` score matrix once (``2·N·M``), which standard
    attention does several times.
    (The full model with backward and kernels lives in ``flashlab.instruments.traffic``.)
    Returns bytes per term and ``"total"``.
    """
    kvh = heads if kv_heads is None else kv_heads
    e = bytes_per_element
    passes = -(-q_len // block_q)
    q_o = batch * heads * 2 * q_len * head_dim * e
    # K/V re-read per q block; with heads batched in a tile GQA reads each kv head once.
    k_v = batch * kvh * 2 * kv_len * head_dim * e * passes
    return {"q_o": q_o, "k_v": k_v, "total": q_o + k_v}


# ------------------------------------------------------------- one (batch, kv head) at a time
# The loops above are written for any B·K, but they run on one (batch, kv head) at a time:
# a fp32 tile [G·bq, bk] is 1 MiB at the default 512×512, so it stays in a core's L2 between
# the matmul that writes it and the softmax passes that read it. Batching all heads into one
# [B·K, G·bq, bk] tile (8 MiB at 8 heads) sends every pass to L3; on a quiet 2-core EPYC the
# per-head loops ran 4-6% faster at N=4096 and 8192 (fp32, 8 heads, d=64, same process).

def _head_slice(cfg: TileConfig, h, bias5, aux: TileAux):
    """``(cfg, bias5, aux)`` of head ``h`` of ``B·K``: batch ``h // K``, kv head ``h % K``."""
    b, k = h // cfg.K, h % cfg.K

    def five(x):                     # [B|1, K|1, G|1, Tp, Sp] -> [1, 1, G|1, Tp, Sp]
        if x is None:
            return None
        if x.shape[0] > 1:
            x = jax.lax.dynamic_slice_in_dim(x, b, 1, 0)
        return jax.lax.dynamic_slice_in_dim(x, k, 1, 1) if x.shape[1] > 1 else x

    batch = lambda x: None if x is None else jax.lax.dynamic_slice_in_dim(x, b, 1, 0)
    aux1 = TileAux(mask=five(aux.mask), q_lengths=batch(aux.q_lengths),
                kv_lengths=batch(aux.kv_lengths), q_seg=batch(aux.q_seg),
                kv_seg=batch(aux.kv_seg), q_offset=aux.q_offset, kv_offset=aux.kv_offset)
    return dataclasses.replace(cfg, B=1, K=1), five(bias5), aux1


def _forward_by_head(cfg: TileConfig, q4, k3, v3, bias5, aux: TileAux, sinks2=None):
    """:func:`forward_loops`, one (batch, kv head) per step: ``out [BK, G, Tp, d_v]``, ``lse``."""
    def one(xs):
        h, q1, k1, v1, s1 = xs
        cfg1, bias1, aux1 = _head_slice(cfg, h, bias5, aux)
        out, lse = forward_loops(cfg1, q1[None], k1[None], v1[None], bias1, aux1,
                            None if sinks2 is None else s1[None])
        return out[0], lse[0]
    s = jnp.zeros((q4.shape[0], 0)) if sinks2 is None else sinks2
    return jax.lax.map(one, (jnp.arange(q4.shape[0]), q4, k3, v3, s))


def _sink_grad(sinks2, out4, lse3, dout4, dlse3):
    """``dsink [BK, G]`` from the residuals (:func:`flashlab.ladder.online_softmax.sink_grad`)."""
    D = jnp.sum(dout4.astype(jnp.float32) * out4.astype(jnp.float32), axis=-1)  # [BK, G, Tp]
    D = D - jnp.where(jnp.isfinite(lse3), dlse3, 0.0)
    return osm.sink_grad(sinks2[..., None], lse3, D)


def _backward_by_head(cfg: TileConfig, q4, k3, v3, bias5, aux: TileAux, out4, lse3, dout4, dlse3):
    """:func:`backward_loops`, one (batch, kv head) per step; a broadcast bias's gradient is summed
    over the heads (and batch) that share it."""
    def one(dbias, xs):
        h, *rows = xs
        cfg1, bias1, aux1 = _head_slice(cfg, h, bias5, aux)
        q1, k1, v1, o1, lse1, do1, dlse1 = (x[None] for x in rows)
        dq, dk, dv, db = backward_loops(cfg1, q1, k1, v1, bias1, aux1, o1, lse1, do1, dlse1)
        if bias5 is not None:
            at = (h // cfg.K if bias5.shape[0] > 1 else 0, h % cfg.K if bias5.shape[1] > 1 else 0,
                  0, 0, 0)
            dbias = jax.lax.dynamic_update_slice(
                dbias, jax.lax.dynamic_slice(dbias, at, db.shape) + db, at)
        return dbias, (dq[0], dk[0], dv[0])

    db0 = jnp.zeros(()) if bias5 is None else jnp.zeros(bias5.shape, acc_dtype(q4.dtype))
    xs = (jnp.arange(q4.shape[0]), q4, k3, v3, out4, lse3, dout4, dlse3)
    dbias, (dq, dk, dv) = jax.lax.scan(one, pvary(db0, vma_of(xs, bias5, aux)), xs)
    return dq, dk, dv, (None if bias5 is None else dbias)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(cfg, q4, k3, v3, bias5, aux, sinks2=None):
    return _forward_by_head(cfg, q4, k3, v3, bias5, aux, sinks2)


def _flash_fwd(cfg, q4, k3, v3, bias5, aux, sinks2=None):
    out, lse = _forward_by_head(cfg, q4, k3, v3, bias5, aux, sinks2)
    # Residuals are O(N): inputs, O (in the input dtype) and lse. No N×M array survives.
    # With sinks, O and lse already include the sink, so the backward below is unchanged:
    # P = exp(S - lse) is the sink-normalised softmax and D = rowsum(dO ∘ O) is exact.
    return (out, lse), (q4, k3, v3, bias5, aux, out.astype(q4.dtype), lse, sinks2)


def _flash_bwd(cfg, res, cts):
    q4, k3, v3, bias5, aux, out, lse, sinks2 = res
    dout, dlse = cts
    dq, dk, dv, dbias = _backward_by_head(cfg, q4, k3, v3, bias5, aux, out, lse, dout, dlse)
    daux = jax.tree_util.tree_map(lambda a: np.zeros(a.shape, jax.dtypes.float0), aux)
    dsinks = None if sinks2 is None else _sink_grad(sinks2, out, lse, dout, dlse)
    return (dq.astype(q4.dtype), dk.astype(k3.dtype), dv.astype(v3.dtype),
            None if bias5 is None else dbias.astype(bias5.dtype), daux, dsinks)


_flash.defvjp(_flash_fwd, _flash_bwd)
