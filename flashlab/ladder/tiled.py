"""Rung 2: tiled (FlashAttention) attention in plain JAX, forward and backward.

The score matrix is never built. Queries are cut into blocks of ``block_q`` rows (the
paper's B_r), keys/values into blocks of ``block_k`` (B_c). For each query block ``Q_i`` we
loop over the key blocks ``K_j, V_j`` that :func:`flashlab.contract.masks.block_maybe_visible` allows
and fold each score tile ``S_ij = scale · Q_i K_jᵀ`` into the running state ``(m, l, O)`` of
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
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from flashlab.contract import autodiff
from flashlab.ladder import online_softmax as osm
from flashlab.contract.masks import (
    AttentionSpec, block_maybe_visible, structural_visible, validate)
from flashlab.compat.shard_map import pvary, vma_of

__all__ = ["tiled_attention", "tiled_attention_from_spec", "tiled_attention_with_lse_from_spec",
           "tiled_attention_backward_from_spec",
           "tiled_hbm_bytes", "DEFAULT_BLOCK_Q", "DEFAULT_BLOCK_K", "block_tables",
           "visit_ranges"]

# Tuned on 2-core x86 CPUs (fp32, B=1, 8 heads, d=64; `python -m flashlab bench tiled --sweep`):
# large tiles amortize the per-iteration loop overhead and keep the two matmuls per tile
# efficient, and larger still feed them better (1024 x 1024: +27% forward rate on an AVX-512
# Xeon), but causal skipping works a whole tile at a time and computes about
# (N + block_q) / 2N of the non-causal work: 512 keeps the causal forward near half the time.
DEFAULT_BLOCK_Q = 512
DEFAULT_BLOCK_K = 512


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
    sink: ``lse = sink`` on such rows, whose output is still 0). Both outputs are differentiable (the
    lse cotangent adds ``P ∘ dlse`` to dS), so states of disjoint key sets can be merged
    outside (ring attention) and still be trained through.
    """
    bq, bk = _block_sizes(block_q, block_k, query.shape[1], key.shape[1])
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
    cfg = _Config(B=B, K=K, G=G, T=T, S=S, bq=bq, bk=bk, scale=spec.scale,
                  soft_cap=spec.soft_cap, is_causal=spec.is_causal, window=spec.window,
                  offsets=spec.has_offsets)
    Tp, Sp = _round_up(T, bq), _round_up(S, bk)
    # [B, T, N, d] -> [B·K, G, T, d]: query head h = k*G + g reads kv head k.
    q4 = query.reshape(B, T, K, G, H).transpose(0, 2, 3, 1, 4).reshape(B * K, G, T, H)
    q4 = _pad(q4, 2, Tp)
    kv3 = lambda x: _pad(x.transpose(0, 2, 1, 3).reshape(B * K, S, x.shape[3]), 1, Sp)
    k3, v3 = kv3(key), kv3(value)                               # [B·K, Sp, d], [B·K, Sp, d_v]
    pad5 = lambda x: _pad(_pad(_heads5(x, K, G), 3, Tp), 4, Sp)  # [B|1, K|1, G|1, Tp, Sp]
    bias5 = None if spec.bias is None else pad5(spec.bias)
    q_lengths, kv_lengths = spec.local_lengths()                # lengths of this block
    q_off, kv_off = spec.offsets() if spec.has_offsets else (None, None)
    aux = _Aux(mask=None if spec.mask is None else pad5(spec.mask),
               q_lengths=q_lengths, kv_lengths=kv_lengths,
               q_seg=None if spec.q_segment_ids is None else _pad(spec.q_segment_ids, 1, Tp),
               kv_seg=None if spec.kv_segment_ids is None else _pad(spec.kv_segment_ids, 1, Sp),
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
    bq, bk = _block_sizes(block_q, block_k, query.shape[1], key.shape[1])
    return _backward_public(query, key, value, spec, out, lse, d_out, bq, bk)


@functools.partial(jax.jit, static_argnums=(7, 8))
def _backward_public(query, key, value, spec, out, lse, d_out, bq, bk):
    B, T, N, H = query.shape
    S, K, Hv = key.shape[1], key.shape[2], value.shape[3]
    cfg, q4, k3, v3, bias5, aux = _prepare(query, key, value, spec, bq, bk)
    G, Tp = cfg.G, q4.shape[2]
    rows = lambda x: _pad(x.reshape(B, T, K, G, -1).transpose(0, 2, 3, 1, 4)    # noqa: E731
                          .reshape(B * K, G, T, x.shape[-1]), 2, Tp)
    lse3 = _pad(lse.astype(jnp.float32).reshape(B * K, G, T), 2, Tp)
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


def block_tables(q_len: int, kv_len: int, block_q: int, block_k: int, *, is_causal=False,
                 window=None):
    """Static per-block facts: ``(maybe [Tr, Tc] bool, full [Tr, Tc] bool, lo [Tr], hi [Tr])``.

    ``maybe``: the block may hold a visible entry (``masks.block_maybe_visible`` and inside
    ``kv_len``); ``full``: every entry of the block is visible by causal/window/padding (so
    the tile needs no mask); ``lo``/``hi``: the kv-block range ``[lo, hi)`` each query block
    visits (``lo == hi`` when none).
    """
    Tr, Tc = -(-q_len // block_q), -(-kv_len // block_k)
    maybe = np.zeros((Tr, Tc), bool)
    full = np.zeros((Tr, Tc), bool)
    for i in range(Tr):
        q0, q1 = i * block_q, (i + 1) * block_q
        for j in range(Tc):
            k0, k1 = j * block_k, (j + 1) * block_k
            maybe[i, j] = bool(block_maybe_visible(q0, q1, k0, min(k1, kv_len),
                                                   is_causal=is_causal, window=window))
            f = k1 <= kv_len
            if is_causal:
                f = f and k1 - 1 <= q0
            if window is not None:
                left, right = window
                if left is not None:
                    f = f and k0 >= q1 - 1 - left
                if right is not None:
                    f = f and k1 - 1 <= q0 + right
            full[i, j] = f and maybe[i, j]
    lo = np.array([int(np.argmax(r)) if r.any() else 0 for r in maybe], np.int32)
    hi = np.array([Tc - int(np.argmax(r[::-1])) if r.any() else 0 for r in maybe], np.int32)
    return maybe, full, lo, hi


# ----------------------------------------------------------------------------- internals
#
# Layout inside the loops. Queries are stored ``[BK, G, Tp, d]`` (BK = batch · kv_heads, G =
# query heads per kv head) and one query block is viewed as ``[BK, G·bq, d]``: its G·bq rows
# all read the same K/V block, so each product is one batched matmul with a single
# contraction dimension (XLA:CPU hands it straight to its GEMM, no transposes), and GQA never
# repeats K/V.
#
#   forward tile   S  [BK, G·bq, bk]   rows are queries: the online-softmax state is per row
#   backward tile  Sᵀ [BK, bk, G·bq]   rows are keys: dV = Pᵀ dO and dK = dSᵀ Q are plain
#                                      matmuls; only dQ = dS K contracts over the tile's rows
#
# Every row of the block table (a q block in the forward, a kv block in the backward) is
# visited in three loops over static ranges: ``[lo, flo)`` masked, ``[flo, fhi)`` fully
# visible (no per-element mask work at all), ``[fhi, hi)`` masked. Blocks outside
# ``[lo, hi)`` are never touched. For causal attention only the diagonal tiles are masked.

@dataclasses.dataclass(frozen=True)
class _Config:
    """Static facts of one call (hashable: the custom_vjp's non-differentiable argument)."""
    B: int
    K: int
    G: int
    T: int
    S: int
    bq: int
    bk: int
    scale: float
    soft_cap: float | None
    is_causal: bool
    window: tuple | None
    offsets: bool = False        # q/kv offsets given (traced): causal/window ranges at run time


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Aux:
    """Non-differentiable arrays: padded dense mask [B|1,K|1,G|1,Tp,Sp], lengths (of this
    block), segments, and the global offsets of query 0 and key 0 (int32 scalars)."""
    mask: jax.Array | None = None
    q_lengths: jax.Array | None = None
    kv_lengths: jax.Array | None = None
    q_seg: jax.Array | None = None
    kv_seg: jax.Array | None = None
    q_offset: jax.Array | None = None
    kv_offset: jax.Array | None = None


def _check_block(name, b, default, length):
    if b is None:
        b = default
    elif isinstance(b, bool) or not isinstance(b, numbers.Integral):
        raise TypeError(f"{name}: expected a positive int (or None for the default), got {b!r}")
    elif b < 1:
        raise ValueError(f"{name}: expected a positive int, got {b}")
    return int(min(int(b), length))


def _block_sizes(block_q, block_k, T, S):
    return (_check_block("block_q", block_q, DEFAULT_BLOCK_Q, T),
            _check_block("block_k", block_k, DEFAULT_BLOCK_K, S))


def _round_up(n, m):
    return -(-n // m) * m


def _pad(x, axis, size):
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


def _heads5(x, K, G):
    """``[B|1, N|1, T, S]`` -> ``[B|1, K|1, G|1, T, S]`` matching the query layout."""
    b, n, t, s = x.shape
    return x.reshape(b, K, G, t, s) if n > 1 else x.reshape(b, 1, 1, t, s)


def visit_ranges(maybe, full, *, all_masked=False):
    """``[4, R]`` int32: per row of a block table, ``lo, flo, fhi, hi``.

    Row ``r`` visits ``[lo, flo)`` with masking, ``[flo, fhi)`` without, ``[fhi, hi)`` with.
    ``maybe``/``full`` are :func:`block_tables`' tables (or their transposes, for the
    backward's kv-block rows). ``all_masked`` (a dense mask or segment ids, known only at run
    time) makes every visited tile masked.
    """
    R = maybe.shape[0]
    out = np.zeros((4, R), np.int32)
    for r in range(R):
        vis = np.flatnonzero(maybe[r])
        if not len(vis):
            continue
        lo, hi = int(vis[0]), int(vis[-1]) + 1
        f = np.flatnonzero(full[r])
        if all_masked or not len(f) or not full[r, f[0]:f[-1] + 1].all():
            flo = fhi = lo          # all in the last loop: causal needs no first loop at all
        else:
            flo, fhi = int(f[0]), int(f[-1]) + 1
        out[:, r] = lo, flo, fhi, hi
    return out


def _bounds(ranges, r, *, row_len, row_block, col_len, col_block):
    """Traced ``lo, flo, fhi, hi`` for row ``r``, tightened by the run-time lengths.

    ``row_len``/``col_len``: ``None`` or the ``[B]`` lengths along the table's rows/columns.
    A tile is free of padding only if it lies inside *every* sequence of the batch (min
    length); blocks past *every* sequence (max length) are skipped.
    """
    lo, flo, fhi, hi = (ranges[n, r] for n in range(4))
    if row_len is not None:
        fhi = jnp.where((r + 1) * row_block > jnp.min(row_len), flo, fhi)
        hi = jnp.where(r * row_block >= jnp.max(row_len), lo, hi)
    if col_len is not None:
        fhi = jnp.minimum(fhi, jnp.min(col_len) // col_block)
        hi = jnp.minimum(hi, -(-jnp.max(col_len) // col_block))
    hi = jnp.maximum(hi, lo)
    flo = jnp.minimum(flo, hi)
    fhi = jnp.clip(fhi, flo, hi)
    return lo, flo, fhi, hi


def _offset_ranges(ranges, cfg: _Config, aux: _Aux, *, transposed: bool):
    """Tighten every row's ``lo .. hi`` by causal/window at the (traced) global offsets.

    Local key ``k`` can be visible from local query ``q`` only if ``k <= q + δ`` (causal),
    ``q + δ - left <= k <= q + δ + right`` (window), ``δ = q_offset - kv_offset``: the same
    rule as :func:`flashlab.contract.masks.block_maybe_visible`, solved for block indices. Every
    visited tile is masked (the table marks all of them masked when offsets are given).
    ``ranges``: the static ``[4, R]`` table; returns a traced ``[4, R]`` one.
    """
    lo, hi = ranges[0], ranges[3]
    if not (cfg.is_causal or cfg.window is not None):
        return ranges
    r = jnp.arange(ranges.shape[1])
    delta = aux.q_offset - aux.kv_offset
    left, right = cfg.window if cfg.window is not None else (None, None)
    first, last = [], []
    if not transposed:            # row = q block r; columns = kv blocks
        q0, ql = r * cfg.bq + delta, r * cfg.bq + cfg.bq - 1 + delta
        col = cfg.bk
        if cfg.is_causal:
            last.append(ql)
        if right is not None:
            last.append(ql + right)
        if left is not None:
            first.append(q0 - left)
    else:                         # row = kv block r; columns = q blocks
        k0, kl = r * cfg.bk - delta, r * cfg.bk + cfg.bk - 1 - delta
        col = cfg.bq
        if cfg.is_causal:
            first.append(k0)
        if right is not None:
            first.append(k0 - right)
        if left is not None:
            last.append(kl + left)
    for f in first:
        lo = jnp.maximum(lo, jnp.floor_divide(f, col))
    for x in last:
        hi = jnp.minimum(hi, jnp.floor_divide(x, col) + 1)
    lo = jnp.clip(lo, 0, hi)
    hi = jnp.maximum(hi, lo)
    return jnp.stack([lo, lo, lo, hi]).astype(jnp.int32)


def _three_loops(bounds, used, masked_body, unmasked_body, carry):
    # A loop whose range is empty for every row is not emitted at all (less to compile).
    lo, flo, fhi, hi = bounds
    if used[0]:
        carry = jax.lax.fori_loop(lo, flo, masked_body, carry)
    if used[1]:
        carry = jax.lax.fori_loop(flo, fhi, unmasked_body, carry)
    if used[2]:
        carry = jax.lax.fori_loop(fhi, hi, masked_body, carry)
    return carry


def _tables(cfg: _Config, aux: _Aux, *, transposed: bool):
    """``(ranges [4, R] int32 array, used)``: which of the three loops any row needs."""
    # With offsets the causal/window range is known only at run time (_offset_ranges): the
    # static table then holds every block, all masked.
    static = not cfg.offsets
    maybe, full, _, _ = block_tables(cfg.T, cfg.S, cfg.bq, cfg.bk,
                                     is_causal=cfg.is_causal and static,
                                     window=cfg.window if static else None)
    if transposed:
        maybe, full = maybe.T, full.T
    dense = aux.mask is not None or aux.q_seg is not None or cfg.offsets
    lo, flo, fhi, hi = r = visit_ranges(maybe, full, all_masked=dense)
    lengths = aux.q_lengths is not None or aux.kv_lengths is not None   # may move fhi down
    used = (bool((flo > lo).any()), bool((fhi > flo).any()), bool((hi > fhi).any()) or lengths)
    if cfg.offsets:
        return _offset_ranges(jnp.asarray(r), cfg, aux, transposed=transposed), used
    return jnp.asarray(r), used


def _rows(x5, cfg: _Config, transposed: bool):
    """A ``[B|1, K|1, G|1, bq, bk]`` tile -> ``[BK, G·bq, bk]`` (or ``[BK, bk, G·bq]``)."""
    B, K, G, bq, bk = cfg.B, cfg.K, cfg.G, cfg.bq, cfg.bk
    if transposed:
        x5 = jnp.moveaxis(x5, 4, 2)                                 # [B, K, bk, G, bq]
        return jnp.broadcast_to(x5, (B, K, bk, G, bq)).reshape(B * K, bk, G * bq)
    return jnp.broadcast_to(x5, (B, K, G, bq, bk)).reshape(B * K, G * bq, bk)


def _tile(x5, cfg, i, j):
    """``[.., .., .., Tp, Sp]`` -> the ``[.., .., .., bq, bk]`` tile of blocks (i, j)."""
    x = jax.lax.dynamic_slice_in_dim(x5, i * cfg.bq, cfg.bq, 3)
    return jax.lax.dynamic_slice_in_dim(x, j * cfg.bk, cfg.bk, 4)


def _visible(cfg: _Config, aux: _Aux, i, j, transposed: bool):
    """Bool tile in the rows layout: the one visibility rule for blocks (i, j)."""
    q0, k0 = i * cfg.bq, j * cfg.bk
    q_idx, k_idx = q0 + jnp.arange(cfg.bq), k0 + jnp.arange(cfg.bk)
    col = lambda a: a[:, None, None, None, None]                    # [B] -> [B,1,1,1,1]
    # Positions shaped for the 5-d tile [B, K, G, bq, bk] (or [B, K, bk, G, bq]).
    if transposed:
        q_pos, k_pos = q_idx[None, None, None, None, :], k_idx[None, None, :, None, None]
    else:
        q_pos, k_pos = q_idx[None, None, None, :, None], k_idx[None, None, None, None, :]
    q_seg = kv_seg = None
    if aux.q_seg is not None:
        qs = jax.lax.dynamic_slice_in_dim(aux.q_seg, q0, cfg.bq, 1)  # [B, bq]
        ks = jax.lax.dynamic_slice_in_dim(aux.kv_seg, k0, cfg.bk, 1)  # [B, bk]
        if transposed:
            q_seg, kv_seg = qs[:, None, None, None, :], ks[:, None, :, None, None]
        else:
            q_seg, kv_seg = qs[:, None, None, :, None], ks[:, None, None, None, :]
    q_len = None if aux.q_lengths is None else col(aux.q_lengths)
    kv_len = cfg.S if aux.kv_lengths is None else col(aux.kv_lengths)   # padding is masked
    if aux.q_offset is not None:     # global positions; the local lengths shift with them
        q_pos, k_pos = q_pos + aux.q_offset, k_pos + aux.kv_offset
        q_len = None if q_len is None else q_len + aux.q_offset
        kv_len = kv_len + aux.kv_offset
    vis = structural_visible(
        q_pos, k_pos, is_causal=cfg.is_causal, window=cfg.window, q_len=q_len, kv_len=kv_len,
        q_seg=q_seg, kv_seg=kv_seg)
    if aux.mask is not None:
        m = _tile(aux.mask, cfg, i, j)
        vis = vis & (jnp.moveaxis(m, 4, 2) if transposed else m)
    B, K, G, bq, bk = cfg.B, cfg.K, cfg.G, cfg.bq, cfg.bk
    shape = (B, K, bk, G, bq) if transposed else (B, K, G, bq, bk)
    return jnp.broadcast_to(vis, shape).reshape(B * K, *((bk, G * bq) if transposed
                                                        else (G * bq, bk)))


def _scores(cfg, q_blk, k_blk, bias5, i, j, *, transposed=False):
    """Logits tile in the rows layout and the raw scaled logits (for the soft cap), in the
    accumulation dtype (float32; float64 for float64 inputs, see ``_acc``).

    ``q_blk`` ``[BK, G·bq, d]`` (pre-scaled when its dtype is >= 32 bit: one multiply per
    row instead of per score), ``k_blk`` ``[BK, bk, d]``.
    """
    spec = "bsd,brd->bsr" if transposed else "brd,bsd->brs"
    a, b = (k_blk, q_blk) if transposed else (q_blk, k_blk)
    s = jnp.einsum(spec, a, b, preferred_element_type=_acc(q_blk.dtype))
    if jnp.dtype(q_blk.dtype).itemsize < 4:
        s = s * cfg.scale
    raw = s
    if cfg.soft_cap is not None:
        s = cfg.soft_cap * jnp.tanh(s / cfg.soft_cap)
    if bias5 is not None:
        s = s + _rows(_tile(bias5, cfg, i, j), cfg, transposed).astype(s.dtype)
    return s, raw


def _acc(dtype):
    """Accumulation dtype for inputs of ``dtype``: float64 for float64, else float32."""
    return jnp.promote_types(dtype, jnp.float32)


def _prescale(cfg, q):
    if jnp.dtype(q.dtype).itemsize >= 4:
        return q * jnp.asarray(cfg.scale, q.dtype)
    return q


def _q_rows(x4, cfg, i):
    """``[BK, G, Tp, d]`` -> block i's rows ``[BK, G·bq, d]``."""
    blk = jax.lax.dynamic_slice_in_dim(x4, i * cfg.bq, cfg.bq, 2)
    return blk.reshape(blk.shape[0], -1, blk.shape[-1])


def _forward(cfg: _Config, q4, k3, v3, bias5, aux: _Aux, sinks2=None):
    """``(out [BK, G, Tp, d_v], lse [BK, G, Tp])`` in the accumulation dtype; ``sinks2 [BK, G]``."""
    BK, G, Tp, _ = q4.shape
    Hv = v3.shape[-1]
    ranges, used = _tables(cfg, aux, transposed=False)              # [4, Tr]
    qs = _prescale(cfg, q4)
    axes = vma_of(q4, k3, v3, bias5, aux)

    def q_block(i):
        q_blk = _q_rows(qs, cfg, i)                                 # [BK, G·bq, d]

        def kv_step(masked):
            def body(j, state):
                k_blk = jax.lax.dynamic_slice_in_dim(k3, j * cfg.bk, cfg.bk, 1)  # [BK, bk, d]
                v_blk = jax.lax.dynamic_slice_in_dim(v3, j * cfg.bk, cfg.bk, 1)  # [BK, bk, d_v]
                s, _ = _scores(cfg, q_blk, k_blk, bias5, i, j)     # [BK, G·bq, bk]
                vis = _visible(cfg, aux, i, j, False) if masked else None
                return osm.update(state, s, v_blk, vis)
            return body

        bounds = _bounds(ranges, i, row_len=aux.q_lengths, row_block=cfg.bq,
                         col_len=aux.kv_lengths, col_block=cfg.bk)
        # Inside shard_map the initial state varies over the mesh axes its data does.
        state = _three_loops(bounds, used, kv_step(True), kv_step(False),
                             pvary(osm.init((BK, G * cfg.bq), Hv, _acc(q4.dtype)), axes))
        if sinks2 is not None:
            state = osm.merge(state, osm.sink_state(jnp.repeat(sinks2, cfg.bq, axis=-1), Hv))
        out, lse = osm.finalize(state)
        return out.reshape(BK, G, cfg.bq, Hv), lse.reshape(BK, G, cfg.bq)

    out, lse = jax.lax.map(q_block, jnp.arange(Tp // cfg.bq))       # [Tr, BK, G, bq, .]
    return (jnp.moveaxis(out, 0, 2).reshape(BK, G, Tp, Hv),
            jnp.moveaxis(lse, 0, 2).reshape(BK, G, Tp))


def _backward(cfg: _Config, q4, k3, v3, bias5, aux: _Aux, out4, lse3, dout4, dlse3):
    """FlashAttention-2 backward: kv blocks outer, the q blocks that see them inner."""
    BK, G, Tp, H = q4.shape
    Sp, Hv = k3.shape[1], v3.shape[-1]
    f32 = _acc(q4.dtype)                          # float32 (float64 for float64 inputs)
    ranges, used = _tables(cfg, aux, transposed=True)               # [4, Tc]
    axes = vma_of(q4, k3, v3, bias5, aux, dout4, dlse3)   # loop carries vary as the data do
    lowp = jnp.dtype(q4.dtype).itemsize < 4
    mm_dtype = q4.dtype if lowp else f32          # dtype of P, dS fed to the matmuls
    qs = _prescale(cfg, q4)
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
                q_blk = _q_rows(qs, cfg, i)                        # [BK, G·bq, d]
                do_blk = _q_rows(do4, cfg, i)                      # [BK, G·bq, d_v]
                s, raw = _scores(cfg, q_blk, k_blk, bias5, i, j, transposed=True)  # [BK, bk, G·bq]
                if masked:
                    s = jnp.where(_visible(cfg, aux, i, j, True), s, -jnp.inf)
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
                if bias5 is not None:     # each tile is visited once: write, don't add
                    blk = jax.lax.dynamic_slice_in_dim(dbias, q0, cfg.bq, 3)
                    blk = jax.lax.dynamic_update_slice_in_dim(
                        blk, _bias_grad(ds, cfg, bias5.shape), j * cfg.bk, 4)
                    dbias = jax.lax.dynamic_update_slice_in_dim(dbias, blk, q0, 3)
                return dq, dbias, dk, dv
            return body

        bounds = _bounds(ranges, j, row_len=aux.kv_lengths, row_block=cfg.bk,
                         col_len=aux.q_lengths, col_block=cfg.bq)
        zeros = pvary((jnp.zeros((BK, cfg.bk, H), f32), jnp.zeros((BK, cfg.bk, Hv), f32)), axes)
        dq, dbias, dk, dv = _three_loops(bounds, used, q_step(True), q_step(False),
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


def _bias_grad(ds, cfg, bias_shape):
    """``dS [BK, bk, G·bq]`` (backward rows layout) -> the bias tile ``[b, k, g, bq, bk]``,
    summed over the dimensions the bias broadcasts over."""
    ds = ds.reshape(cfg.B, cfg.K, cfg.bk, cfg.G, cfg.bq)
    ds = jnp.moveaxis(ds, 2, 4)                                      # [B, K, G, bq, bk]
    axes = tuple(a for a in range(3) if bias_shape[a] == 1 and ds.shape[a] > 1)
    return ds.sum(axis=axes, keepdims=True) if axes else ds


# ------------------------------------------------------------- one (batch, kv head) at a time
# The loops above are written for any B·K, but they run on one (batch, kv head) at a time:
# a fp32 tile [G·bq, bk] is 1 MiB at the default 512×512, so it stays in a core's L2 between
# the matmul that writes it and the softmax passes that read it. Batching all heads into one
# [B·K, G·bq, bk] tile (8 MiB at 8 heads) sends every pass to L3; on a quiet 2-core EPYC the
# per-head loops ran 4-6% faster at N=4096 and 8192 (fp32, 8 heads, d=64, same process).

def _head_slice(cfg: _Config, h, bias5, aux: _Aux):
    """``(cfg, bias5, aux)`` of head ``h`` of ``B·K``: batch ``h // K``, kv head ``h % K``."""
    b, k = h // cfg.K, h % cfg.K

    def five(x):                     # [B|1, K|1, G|1, Tp, Sp] -> [1, 1, G|1, Tp, Sp]
        if x is None:
            return None
        if x.shape[0] > 1:
            x = jax.lax.dynamic_slice_in_dim(x, b, 1, 0)
        return jax.lax.dynamic_slice_in_dim(x, k, 1, 1) if x.shape[1] > 1 else x

    batch = lambda x: None if x is None else jax.lax.dynamic_slice_in_dim(x, b, 1, 0)
    aux1 = _Aux(mask=five(aux.mask), q_lengths=batch(aux.q_lengths),
                kv_lengths=batch(aux.kv_lengths), q_seg=batch(aux.q_seg),
                kv_seg=batch(aux.kv_seg), q_offset=aux.q_offset, kv_offset=aux.kv_offset)
    return dataclasses.replace(cfg, B=1, K=1), five(bias5), aux1


def _forward_by_head(cfg: _Config, q4, k3, v3, bias5, aux: _Aux, sinks2=None):
    """:func:`_forward`, one (batch, kv head) per step: ``out [BK, G, Tp, d_v]``, ``lse``."""
    def one(xs):
        h, q1, k1, v1, s1 = xs
        cfg1, bias1, aux1 = _head_slice(cfg, h, bias5, aux)
        out, lse = _forward(cfg1, q1[None], k1[None], v1[None], bias1, aux1,
                            None if sinks2 is None else s1[None])
        return out[0], lse[0]
    s = jnp.zeros((q4.shape[0], 0)) if sinks2 is None else sinks2
    return jax.lax.map(one, (jnp.arange(q4.shape[0]), q4, k3, v3, s))


def _sink_grad(sinks2, out4, lse3, dout4, dlse3):
    """``dsink [BK, G]`` from the residuals (:func:`flashlab.ladder.online_softmax.sink_grad`)."""
    D = jnp.sum(dout4.astype(jnp.float32) * out4.astype(jnp.float32), axis=-1)  # [BK, G, Tp]
    D = D - jnp.where(jnp.isfinite(lse3), dlse3, 0.0)
    return osm.sink_grad(sinks2[..., None], lse3, D)


def _backward_by_head(cfg: _Config, q4, k3, v3, bias5, aux: _Aux, out4, lse3, dout4, dlse3):
    """:func:`_backward`, one (batch, kv head) per step; a broadcast bias's gradient is summed
    over the heads (and batch) that share it."""
    def one(dbias, xs):
        h, *rows = xs
        cfg1, bias1, aux1 = _head_slice(cfg, h, bias5, aux)
        q1, k1, v1, o1, lse1, do1, dlse1 = (x[None] for x in rows)
        dq, dk, dv, db = _backward(cfg1, q1, k1, v1, bias1, aux1, o1, lse1, do1, dlse1)
        if bias5 is not None:
            at = (h // cfg.K if bias5.shape[0] > 1 else 0, h % cfg.K if bias5.shape[1] > 1 else 0,
                  0, 0, 0)
            dbias = jax.lax.dynamic_update_slice(
                dbias, jax.lax.dynamic_slice(dbias, at, db.shape) + db, at)
        return dbias, (dq[0], dk[0], dv[0])

    db0 = jnp.zeros(()) if bias5 is None else jnp.zeros(bias5.shape, _acc(q4.dtype))
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
