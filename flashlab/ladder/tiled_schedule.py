"""The tiled rung's schedule: which tiles each block row visits, and the tile helpers.

Used by the loops of :mod:`flashlab.ladder.tiled_loops`; :mod:`flashlab.ladder.tiled` is the
public face. ``block_tables``, ``visit_ranges`` and the default blocks are public (chapter 03
prints them); the rest is internal to the tiled rung.
"""
from __future__ import annotations

import dataclasses
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from flashlab.contract.masks import block_maybe_visible, structural_visible


# Tuned on 2-core x86 CPUs (fp32, B=1, 8 heads, d=64; `python -m flashlab bench tiled --sweep`):
# large tiles amortize the per-iteration loop overhead and keep the two matmuls per tile
# efficient, and larger still feed them better (1024 x 1024: +27% forward rate on an AVX-512
# Xeon), but causal skipping works a whole tile at a time and computes about
# (N + block_q) / 2N of the non-causal work: 512 keeps the causal forward near half the time.
DEFAULT_BLOCK_Q = 512
DEFAULT_BLOCK_K = 512


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
class TileConfig:
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
class TileAux:
    """Non-differentiable arrays: padded dense mask [B|1,K|1,G|1,Tp,Sp], lengths (of this
    block), segments, and the global offsets of query 0 and key 0 (int32 scalars)."""
    mask: jax.Array | None = None
    q_lengths: jax.Array | None = None
    kv_lengths: jax.Array | None = None
    q_seg: jax.Array | None = None
    kv_seg: jax.Array | None = None
    q_offset: jax.Array | None = None
    kv_offset: jax.Array | None = None


def check_block(name, b, default, length):
    if b is None:
        b = default
    elif isinstance(b, bool) or not isinstance(b, numbers.Integral):
        raise TypeError(f"{name}: expected a positive int (or None for the default), got {b!r}")
    elif b < 1:
        raise ValueError(f"{name}: expected a positive int, got {b}")
    return int(min(int(b), length))


def block_sizes(block_q, block_k, T, S):
    return (check_block("block_q", block_q, DEFAULT_BLOCK_Q, T),
            check_block("block_k", block_k, DEFAULT_BLOCK_K, S))


def round_up(n, m):
    return -(-n // m) * m


def pad_axis(x, axis, size):
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


def heads5(x, K, G):
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


def row_bounds(ranges, r, *, row_len, row_block, col_len, col_block):
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


def offset_ranges(ranges, cfg: TileConfig, aux: TileAux, *, transposed: bool):
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


def three_loops(bounds, used, masked_body, unmasked_body, carry):
    # A loop whose range is empty for every row is not emitted at all (less to compile).
    lo, flo, fhi, hi = bounds
    if used[0]:
        carry = jax.lax.fori_loop(lo, flo, masked_body, carry)
    if used[1]:
        carry = jax.lax.fori_loop(flo, fhi, unmasked_body, carry)
    if used[2]:
        carry = jax.lax.fori_loop(fhi, hi, masked_body, carry)
    return carry


def visit_tables(cfg: TileConfig, aux: TileAux, *, transposed: bool):
    """``(ranges [4, R] int32 array, used)``: which of the three loops any row needs."""
    # With offsets the causal/window range is known only at run time (offset_ranges): the
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
        return offset_ranges(jnp.asarray(r), cfg, aux, transposed=transposed), used
    return jnp.asarray(r), used


def block_rows(x5, cfg: TileConfig, transposed: bool):
    """A ``[B|1, K|1, G|1, bq|1, bk|1]`` tile -> ``[BK, G·bq, bk]`` (or ``[BK, bk, G·bq]``)."""
    B, K, G, bq, bk = cfg.B, cfg.K, cfg.G, cfg.bq, cfg.bk
    if transposed:
        x5 = jnp.moveaxis(x5, 4, 2)                                 # [B, K, bk, G, bq]
        return jnp.broadcast_to(x5, (B, K, bk, G, bq)).reshape(B * K, bk, G * bq)
    return jnp.broadcast_to(x5, (B, K, G, bq, bk)).reshape(B * K, G * bq, bk)


def block_tile(x5, cfg, i, j):
    """``[.., .., .., Tp|1, Sp|1]`` -> the ``[.., .., .., bq|1, bk|1]`` tile of blocks (i, j)
    (a broadcast dim of 1 is the same for every block; :func:`block_rows` broadcasts it)."""
    x = x5 if x5.shape[3] == 1 else jax.lax.dynamic_slice_in_dim(x5, i * cfg.bq, cfg.bq, 3)
    return x if x.shape[4] == 1 else jax.lax.dynamic_slice_in_dim(x, j * cfg.bk, cfg.bk, 4)


def visible_tile(cfg: TileConfig, aux: TileAux, i, j, transposed: bool):
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
        m = block_tile(aux.mask, cfg, i, j)
        vis = vis & (jnp.moveaxis(m, 4, 2) if transposed else m)
    B, K, G, bq, bk = cfg.B, cfg.K, cfg.G, cfg.bq, cfg.bk
    shape = (B, K, bk, G, bq) if transposed else (B, K, G, bq, bk)
    return jnp.broadcast_to(vis, shape).reshape(B * K, *((bk, G * bq) if transposed
                                                        else (G * bq, bk)))


def scores(cfg, q_blk, k_blk, bias5, i, j, *, transposed=False):
    """Logits tile in the rows layout and the raw scaled logits (for the soft cap), in the
    accumulation dtype (float32; float64 for float64 inputs, see ``acc_dtype``).

    ``q_blk`` ``[BK, G·bq, d]`` (pre-scaled when its dtype is >= 32 bit: one multiply per
    row instead of per score), ``k_blk`` ``[BK, bk, d]``.
    """
    spec = "bsd,brd->bsr" if transposed else "brd,bsd->brs"
    a, b = (k_blk, q_blk) if transposed else (q_blk, k_blk)
    s = jnp.einsum(spec, a, b, preferred_element_type=acc_dtype(q_blk.dtype))
    if jnp.dtype(q_blk.dtype).itemsize < 4:
        s = s * cfg.scale
    raw = s
    if cfg.soft_cap is not None:
        s = cfg.soft_cap * jnp.tanh(s / cfg.soft_cap)
    if bias5 is not None:
        s = s + block_rows(block_tile(bias5, cfg, i, j), cfg, transposed).astype(s.dtype)
    return s, raw


def acc_dtype(dtype):
    """Accumulation dtype for inputs of ``dtype``: float64 for float64, else float32."""
    return jnp.promote_types(dtype, jnp.float32)


def prescale(cfg, q):
    if jnp.dtype(q.dtype).itemsize >= 4:
        return q * jnp.asarray(cfg.scale, q.dtype)
    return q


def q_rows(x4, cfg, i):
    """``[BK, G, Tp, d]`` -> block i's rows ``[BK, G·bq, d]``."""
    blk = jax.lax.dynamic_slice_in_dim(x4, i * cfg.bq, cfg.bq, 2)
    return blk.reshape(blk.shape[0], -1, blk.shape[-1])
