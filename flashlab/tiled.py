"""Rung 2: tiled (FlashAttention) attention in plain JAX, forward and backward.

The score matrix is never built. Queries are cut into blocks of ``block_q`` rows (the
paper's B_r), keys/values into blocks of ``block_k`` (B_c). For each query block ``Q_i`` we
loop over the key blocks ``K_j, V_j`` that :func:`flashlab.masks.block_maybe_visible` allows
and fold each score tile ``S_ij = scale · Q_i K_jᵀ`` into the running state ``(m, l, O)`` of
:mod:`flashlab.online_softmax`; at the end ``O_i = acc / l`` and ``lse_i = m + log l``.

The backward pass is FlashAttention-2's: only ``O`` and ``lse`` are kept from the forward
(O(N) memory); each tile's probabilities are recomputed as ``P_ij = exp(S_ij - lse_i)``, and
with ``D_i = rowsum(dO_i ∘ O_i)``::

    dV_j += P_ijᵀ dO_i        dP_ij = dO_i V_jᵀ        dS_ij = P_ij ∘ (dP_ij − D_i)
    dQ_i += scale · dS_ij K_j                           dK_j += scale · dS_ijᵀ Q_i

Inside a tile every (batch, kv head, query head of the group) is computed at once:
queries are laid out ``[B, K, G, T, d]`` so GQA reads each K/V block once and never repeats
it in memory. One tile is ``[B, K, G, block_q, block_k]`` float32.

Speed on CPU comes from big tiles and from doing no per-element mask work in tiles that are
fully visible: a ``lax.cond`` picks between a masked and an unmasked tile update, and tiles
that are entirely invisible are not visited at all (the kv loop has per-q-block bounds).
"""
from __future__ import annotations

import dataclasses
import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from . import online_softmax as osm
from .masks import AttentionSpec, block_maybe_visible, structural_visible, validate

__all__ = ["tiled_attention", "tiled_attention_from_spec", "tiled_attention_with_lse_from_spec",
           "tiled_hbm_bytes", "DEFAULT_BLOCK_Q", "DEFAULT_BLOCK_K", "block_tables"]

# Tuned on a 2-core x86 CPU (fp32, B=1, 8 heads, d=64; see flashlab.bench_tiled): large tiles
# amortize the per-iteration loop overhead and keep the two matmuls per tile efficient.
DEFAULT_BLOCK_Q = 512
DEFAULT_BLOCK_K = 512


# ----------------------------------------------------------------------------- public API

def tiled_attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
                    query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
                    segment_ids=None, logits_soft_cap=None, block_q=None, block_k=None):
    """Blockwise (FlashAttention) attention: same arguments and results as ``naive_attention``.

    Args:
      query ``[batch, q_seq, heads, d]``; key, value ``[batch, kv_seq, kv_heads, d]``; bias,
      mask and the mask keywords as :func:`flashlab.reference.naive_attention`.
      block_q, block_k: query/key block sizes (B_r, B_c), positive ints; default
        ``DEFAULT_BLOCK_Q``/``DEFAULT_BLOCK_K`` (clipped to the sequence lengths). Any
        sequence length works: the last block is padded internally and the padding masked.

    Returns:
      ``[batch, q_seq, heads, d_v]`` in the query's dtype (accumulation in float32).
      Differentiable (custom VJP, O(N) residuals) w.r.t. query, key, value and bias.
    """
    query, key, value, spec = validate(
        query, key, value, bias, mask, scale=scale, is_causal=is_causal,
        query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
        local_window_size=local_window_size, segment_ids=segment_ids,
        logits_soft_cap=logits_soft_cap)
    return tiled_attention_from_spec(query, key, value, spec, block_q=block_q, block_k=block_k)


def tiled_attention_from_spec(query, key, value, spec: AttentionSpec, *, block_q=None,
                              block_k=None):
    """Tiled attention on already validated inputs (what backends call). Returns ``out``."""
    return tiled_attention_with_lse_from_spec(query, key, value, spec, block_q=block_q,
                                              block_k=block_k)[0]


def tiled_attention_with_lse_from_spec(query, key, value, spec: AttentionSpec, *, block_q=None,
                                       block_k=None):
    """Tiled attention returning ``(out [B, T, N, d_v] query dtype, lse [B, N, T] float32)``.

    ``lse`` is ``-inf`` for rows with no visible key. Both outputs are differentiable (the
    lse cotangent adds ``P ∘ dlse`` to dS), so states of disjoint key sets can be merged
    outside (ring attention) and still be trained through.
    """
    bq, bk = _block_sizes(block_q, block_k, query.shape[1], key.shape[1])
    return _with_lse(query, key, value, spec, bq, bk)


@functools.partial(jax.jit, static_argnums=(4, 5))
def _with_lse(query, key, value, spec: AttentionSpec, bq: int, bk: int):
    # Jitted as a whole: one compilation per shape/spec instead of eager op-by-op dispatch.
    B, T, N, H = query.shape
    S, K, Hv = key.shape[1], key.shape[2], value.shape[3]
    G = N // K
    cfg = _Config(T=T, S=S, bq=bq, bk=bk, scale=spec.scale, soft_cap=spec.soft_cap,
                  is_causal=spec.is_causal, window=spec.window,
                  bias_shape=None if spec.bias is None else tuple(spec.bias.shape))
    Tp, Sp = _round_up(T, bq), _round_up(S, bk)
    # [B, T, N, d] -> [B, K, G, T, d]: query head h = k*G + g reads kv head k.
    q5 = _pad(query.reshape(B, T, K, G, H).transpose(0, 2, 3, 1, 4), 3, Tp)
    k4 = _pad(key.transpose(0, 2, 1, 3), 2, Sp)                 # [B, K, Sp, d]
    v4 = _pad(value.transpose(0, 2, 1, 3), 2, Sp)               # [B, K, Sp, d_v]
    bias5 = None if spec.bias is None else _pad(_pad(_heads5(spec.bias, K, G), 3, Tp), 4, Sp)
    aux = _Aux(mask=None if spec.mask is None else _pad(_pad(_heads5(spec.mask, K, G), 3, Tp), 4, Sp),
               q_lengths=spec.q_lengths, kv_lengths=spec.kv_lengths,
               q_seg=None if spec.q_segment_ids is None else _pad(spec.q_segment_ids, 1, Tp),
               kv_seg=None if spec.kv_segment_ids is None else _pad(spec.kv_segment_ids, 1, Sp))
    out5, lse4 = _flash(cfg, q5, k4, v4, bias5, aux)
    out = out5[:, :, :, :T].transpose(0, 3, 1, 2, 4).reshape(B, T, N, Hv).astype(query.dtype)
    lse = lse4[:, :, :, :T].reshape(B, N, T)
    return out, lse


def tiled_hbm_bytes(*, batch: int, heads: int, q_len: int, kv_len: int, head_dim: int,
                    bytes_per_element: int, block_q: int = DEFAULT_BLOCK_Q,
                    kv_heads: int | None = None) -> dict[str, int]:
    """Memory traffic of the tiled forward when only tiles fit in fast memory.

    Each query block ``Q_i`` (and its output ``O_i``) is read/written once; every key/value
    block is re-read once per query block: ``T_r = ceil(N / B_r)`` passes over K and V. No
    N×M term. (The full model with backward and kernels lives in ``flashlab.traffic``.)
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

@dataclasses.dataclass(frozen=True)
class _Config:
    """Static facts of one call (hashable: the custom_vjp's non-differentiable argument)."""
    T: int
    S: int
    bq: int
    bk: int
    scale: float
    soft_cap: float | None
    is_causal: bool
    window: tuple | None
    bias_shape: tuple | None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Aux:
    """Non-differentiable arrays: padded dense mask [B|1,K|1,G|1,Tp,Sp], lengths, segments."""
    mask: jax.Array | None = None
    q_lengths: jax.Array | None = None
    kv_lengths: jax.Array | None = None
    q_seg: jax.Array | None = None
    kv_seg: jax.Array | None = None


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


def _tables(cfg: _Config):
    return block_tables(cfg.T, cfg.S, cfg.bq, cfg.bk, is_causal=cfg.is_causal, window=cfg.window)


def _needs_mask_mode(cfg: _Config, aux: _Aux, full):
    """'always', 'never' or 'cond': whether tiles need per-element masking."""
    if aux.mask is not None or aux.q_seg is not None:
        return "always"
    if full.all() and aux.q_lengths is None and aux.kv_lengths is None:
        return "never"
    return "cond"


def _tile_is_full(full_tbl, i, j, cfg, aux):
    """Traced bool: tile (i, j) needs no mask (structural table + length bounds)."""
    ok = full_tbl[i, j]
    if aux.kv_lengths is not None:
        ok = ok & ((j + 1) * cfg.bk <= jnp.min(aux.kv_lengths))
    if aux.q_lengths is not None:
        ok = ok & ((i + 1) * cfg.bq <= jnp.min(aux.q_lengths))
    return ok


def _visible(cfg: _Config, aux: _Aux, i, j):
    """Bool ``[B|1, K|1, G|1, bq, bk]``: the one visibility rule for tile (i, j)."""
    q0, k0 = i * cfg.bq, j * cfg.bk
    q_pos = (q0 + jnp.arange(cfg.bq))[:, None]                 # [bq, 1]
    k_pos = (k0 + jnp.arange(cfg.bk))[None, :]                 # [1, bk]
    col = lambda a: a[:, None, None, None, None]                # [B] -> [B,1,1,1,1]
    kv_len = cfg.S if aux.kv_lengths is None else col(aux.kv_lengths)   # padding is masked
    q_len = None if aux.q_lengths is None else col(aux.q_lengths)
    q_seg = kv_seg = None
    if aux.q_seg is not None:
        q_seg = jax.lax.dynamic_slice_in_dim(aux.q_seg, q0, cfg.bq, 1)[:, None, None, :, None]
        kv_seg = jax.lax.dynamic_slice_in_dim(aux.kv_seg, k0, cfg.bk, 1)[:, None, None, None, :]
    vis = structural_visible(q_pos, k_pos, is_causal=cfg.is_causal, window=cfg.window,
                             q_len=q_len, kv_len=kv_len, q_seg=q_seg, kv_seg=kv_seg)
    if aux.mask is not None:
        vis = vis & _tile(aux.mask, q0, k0, cfg)
    return vis


def _tile(x5, q0, k0, cfg):
    """``[.., .., .., Tp, Sp]`` -> the ``[.., .., .., bq, bk]`` tile at (q0, k0)."""
    x = jax.lax.dynamic_slice_in_dim(x5, q0, cfg.bq, 3)
    return jax.lax.dynamic_slice_in_dim(x, k0, cfg.bk, 4)


def _scores(cfg, q_blk, k_blk, bias5, q0, k0):
    """Logits tile ``[B, K, G, bq, bk]`` float32 and the raw scaled logits (for the soft cap)."""
    # q_blk is pre-scaled when the dtype is >= 32 bit (one multiply per row, not per score).
    s = jnp.einsum("bkgqd,bksd->bkgqs", q_blk, k_blk, preferred_element_type=jnp.float32)
    if jnp.dtype(q_blk.dtype).itemsize < 4:
        s = s * cfg.scale
    raw = s
    if cfg.soft_cap is not None:
        s = cfg.soft_cap * jnp.tanh(s / cfg.soft_cap)
    if bias5 is not None:
        s = s + _tile(bias5, q0, k0, cfg).astype(jnp.float32)
    return s, raw


def _prescale(cfg, q5):
    if jnp.dtype(q5.dtype).itemsize >= 4:
        return q5 * jnp.asarray(cfg.scale, q5.dtype)
    return q5


def _forward(cfg: _Config, q5, k4, v4, bias5, aux: _Aux):
    """``(out [B,K,G,Tp,d_v] float32, lse [B,K,G,Tp] float32)``."""
    B, K, G, Tp, H = q5.shape
    Hv = v4.shape[-1]
    _, full, lo, hi = _tables(cfg)
    mode = _needs_mask_mode(cfg, aux, full)
    full_tbl, lo_tbl, hi_tbl = jnp.asarray(full), jnp.asarray(lo), jnp.asarray(hi)
    qs = _prescale(cfg, q5)

    def q_block(i):
        q0 = i * cfg.bq
        q_blk = jax.lax.dynamic_slice_in_dim(qs, q0, cfg.bq, 3)      # [B, K, G, bq, d]

        def kv_step(j, state):
            k0 = j * cfg.bk
            k_blk = jax.lax.dynamic_slice_in_dim(k4, k0, cfg.bk, 2)   # [B, K, bk, d]
            v_blk = jax.lax.dynamic_slice_in_dim(v4, k0, cfg.bk, 2)   # [B, K, bk, d_v]
            v_blk = v_blk[:, :, None]                                  # [B, K, 1, bk, d_v]

            def unmasked(state):
                s, _ = _scores(cfg, q_blk, k_blk, bias5, q0, k0)
                return osm.update(state, s, v_blk)

            def masked(state):
                s, _ = _scores(cfg, q_blk, k_blk, bias5, q0, k0)
                return osm.update(state, s, v_blk, _visible(cfg, aux, i, j))

            if mode == "never":
                return unmasked(state)
            if mode == "always":
                return masked(state)
            return jax.lax.cond(_tile_is_full(full_tbl, i, j, cfg, aux), unmasked, masked, state)

        state = osm.init((B, K, G, cfg.bq), Hv)
        state = jax.lax.fori_loop(lo_tbl[i], hi_tbl[i], kv_step, state)
        return osm.finalize(state)                 # [B,K,G,bq,d_v], [B,K,G,bq]

    n_q = Tp // cfg.bq
    out, lse = jax.lax.map(q_block, jnp.arange(n_q))   # [Tr, B, K, G, bq, .]
    out = jnp.moveaxis(out, 0, 3).reshape(B, K, G, Tp, Hv)
    lse = jnp.moveaxis(lse, 0, 3).reshape(B, K, G, Tp)
    return out, lse


def _backward(cfg: _Config, q5, k4, v4, bias5, aux: _Aux, out5, lse4, dout5, dlse4):
    """FlashAttention-2 backward: kv blocks outer, visible q blocks inner; dQ accumulated."""
    B, K, G, Tp, H = q5.shape
    Sp, Hv = k4.shape[2], v4.shape[-1]
    maybe, full, _, _ = _tables(cfg)
    mode = _needs_mask_mode(cfg, aux, full)
    # Per kv block j: the q-block range [qlo, qhi) that may see it.
    Tr, Tc = maybe.shape
    qlo = np.array([int(np.argmax(c)) if c.any() else 0 for c in maybe.T], np.int32)
    qhi = np.array([Tr - int(np.argmax(c[::-1])) if c.any() else 0 for c in maybe.T], np.int32)
    full_tbl, qlo_tbl, qhi_tbl = jnp.asarray(full), jnp.asarray(qlo), jnp.asarray(qhi)
    f32 = jnp.float32
    lowp = jnp.dtype(q5.dtype).itemsize < 4
    mm_dtype = q5.dtype if lowp else f32          # dtype of P, dS fed to the matmuls
    qs = _prescale(cfg, q5)
    # D_i = rowsum(dO ∘ O) - dlse  (the lse cotangent enters as dS += P ∘ dlse).
    finite = jnp.isfinite(lse4)
    D = jnp.sum(dout5.astype(f32) * out5.astype(f32), axis=-1)        # [B, K, G, Tp]
    D = D - jnp.where(finite, dlse4, 0.0)
    lse_use = jnp.where(finite, lse4, 0.0)       # masked s = -inf -> P = 0 anyway
    do5 = dout5.astype(q5.dtype)

    def kv_block(carry, j):
        dq, dbias = carry
        k0 = j * cfg.bk
        k_blk = jax.lax.dynamic_slice_in_dim(k4, k0, cfg.bk, 2)       # [B, K, bk, d]
        v_blk = jax.lax.dynamic_slice_in_dim(v4, k0, cfg.bk, 2)       # [B, K, bk, d_v]

        def q_step(i, c):
            dq, dbias, dk, dv = c
            q0 = i * cfg.bq
            q_blk = jax.lax.dynamic_slice_in_dim(qs, q0, cfg.bq, 3)   # [B, K, G, bq, d]
            do_blk = jax.lax.dynamic_slice_in_dim(do5, q0, cfg.bq, 3)
            lse_blk = jax.lax.dynamic_slice_in_dim(lse_use, q0, cfg.bq, 3)
            D_blk = jax.lax.dynamic_slice_in_dim(D, q0, cfg.bq, 3)

            def tile(use_mask):
                s, raw = _scores(cfg, q_blk, k_blk, bias5, q0, k0)
                if use_mask:
                    s = jnp.where(_visible(cfg, aux, i, j), s, -jnp.inf)
                p = jnp.exp(s - lse_blk[..., None])                    # [B,K,G,bq,bk]
                dp = jnp.einsum("bkgqd,bksd->bkgqs", do_blk, v_blk, preferred_element_type=f32)
                ds = p * (dp - D_blk[..., None])                        # dL/d(logits + bias)
                dsr = ds
                if cfg.soft_cap is not None:
                    t = jnp.tanh(raw / cfg.soft_cap)
                    dsr = ds * (1.0 - t * t)                            # through c·tanh(s/c)
                pm, dsm = p.astype(mm_dtype), dsr.astype(mm_dtype)
                dv_t = jnp.einsum("bkgqs,bkgqd->bksd", pm, do_blk.astype(mm_dtype),
                                  preferred_element_type=f32)
                dk_t = jnp.einsum("bkgqs,bkgqd->bksd", dsm, q_blk.astype(mm_dtype),
                                  preferred_element_type=f32)
                dq_t = jnp.einsum("bkgqs,bksd->bkgqd", dsm, k_blk.astype(mm_dtype),
                                  preferred_element_type=f32)
                db_t = None
                if bias5 is not None:
                    db_t = _reduce_to(ds, cfg.bias_shape, K, G)
                return dq_t, dk_t, dv_t, db_t

            if mode == "never":
                dq_t, dk_t, dv_t, db_t = tile(False)
            elif mode == "always":
                dq_t, dk_t, dv_t, db_t = tile(True)
            else:
                dq_t, dk_t, dv_t, db_t = jax.lax.cond(
                    _tile_is_full(full_tbl, i, j, cfg, aux),
                    lambda: tile(False), lambda: tile(True))
            old = jax.lax.dynamic_slice_in_dim(dq, q0, cfg.bq, 3)
            dq = jax.lax.dynamic_update_slice_in_dim(dq, old + dq_t, q0, 3)
            if db_t is not None:
                blk = jax.lax.dynamic_slice_in_dim(dbias, q0, cfg.bq, 3)
                blk = jax.lax.dynamic_update_slice_in_dim(blk, db_t, k0, 4)
                dbias = jax.lax.dynamic_update_slice_in_dim(dbias, blk, q0, 3)
            return dq, dbias, dk + dk_t, dv + dv_t

        dk = jnp.zeros((B, K, cfg.bk, H), f32)
        dv = jnp.zeros((B, K, cfg.bk, Hv), f32)
        dq, dbias, dk, dv = jax.lax.fori_loop(qlo_tbl[j], qhi_tbl[j], q_step, (dq, dbias, dk, dv))
        return (dq, dbias), (dk, dv)

    dq0 = jnp.zeros((B, K, G, Tp, H), f32)
    db0 = jnp.zeros(()) if bias5 is None else jnp.zeros(bias5.shape, f32)
    (dq, dbias), (dk, dv) = jax.lax.scan(kv_block, (dq0, db0), jnp.arange(Sp // cfg.bk))
    # dQ = scale · dS K, applied once per element rather than per tile; dK = scale · dSᵀ Q
    # already holds the scale when q was pre-scaled (>= 32-bit dtypes).
    dq = dq * cfg.scale
    if lowp:
        dk = dk * cfg.scale
    dk = jnp.moveaxis(dk, 0, 2).reshape(B, K, Sp, H)     # [Tc, B, K, bk, d] -> [B, K, Sp, d]
    dv = jnp.moveaxis(dv, 0, 2).reshape(B, K, Sp, Hv)
    return dq, dk, dv, (None if bias5 is None else dbias)


def _reduce_to(ds, bias_shape, K, G):
    """Sum ``dS [B, K, G, bq, bk]`` over the bias's broadcast dimensions."""
    b, n = bias_shape[:2]
    if n == 1:
        ds = ds.sum(axis=(1, 2), keepdims=True)
    if b == 1:
        ds = ds.sum(axis=0, keepdims=True)
    return ds


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(cfg, q5, k4, v4, bias5, aux):
    return _forward(cfg, q5, k4, v4, bias5, aux)


def _flash_fwd(cfg, q5, k4, v4, bias5, aux):
    out, lse = _forward(cfg, q5, k4, v4, bias5, aux)
    # Residuals are O(N): inputs, O (in the input dtype) and lse. No N×M array survives.
    return (out, lse), (q5, k4, v4, bias5, aux, out.astype(q5.dtype), lse)


def _flash_bwd(cfg, res, cts):
    q5, k4, v4, bias5, aux, out, lse = res
    dout, dlse = cts
    dq, dk, dv, dbias = _backward(cfg, q5, k4, v4, bias5, aux, out, lse, dout, dlse)
    daux = jax.tree_util.tree_map(lambda a: np.zeros(a.shape, jax.dtypes.float0), aux)
    return (dq.astype(q5.dtype), dk.astype(k4.dtype), dv.astype(v4.dtype),
            None if bias5 is None else dbias.astype(bias5.dtype), daux)


_flash.defvjp(_flash_fwd, _flash_bwd)
