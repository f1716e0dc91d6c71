"""The plain-JAX decode rungs: one step of attention of a few new tokens over a KV cache.

Shared by every decode backend (:mod:`flashlab.serving.decode` dispatches among them; the
Pallas kernel :mod:`flashlab.kernels.decode` imports the layout helpers):

* :func:`fold_heads` / :func:`unfold_heads`: the ``G`` query heads of one kv head (times the new
  tokens) folded into the rows of one tile, so each K/V block is read once per kv head;
* :func:`paged_view` / :func:`gather_pages`: a contiguous cache seen as pages, and back;
* :func:`sink_state`: a per-head sink logit ``s_h`` as one more online-softmax state
  (``m = s_h, l = 1, acc = 0``);
* :func:`reference_decode` (gathers the pages, naive attention), :func:`tiled_decode` (a block of
  pages at a time with :func:`flashlab.ladder.online_softmax.update`) and
  :func:`oracle_decode_attention` (float64).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from flashlab.contract.decode_validate import DecodeSpec
from flashlab.ladder import online_softmax

__all__ = ["fold_heads", "unfold_heads", "row_positions", "sink_state", "gather_pages",
           "paged_view", "reference_decode", "tiled_decode", "oracle_decode_attention"]


def fold_heads(query, spec: DecodeSpec):
    """``[B, T, Hq, d]`` -> ``[B, K, T*G, d]``: the G query heads of a kv head (times the T new
    tokens) become the rows of one tile; row ``r`` is token ``r // G``, head ``k*G + r % G``."""
    B, T, N, D = query.shape
    K, G = spec.num_kv_heads, spec.group_size
    return query.reshape(B, T, K, G, D).transpose(0, 2, 1, 3, 4).reshape(B, K, T * G, D)


def unfold_heads(out, spec: DecodeSpec):
    """Inverse of :func:`fold_heads`: ``[B, K, T*G, dv]`` -> ``[B, T, Hq, dv]``."""
    B, K, R, Dv = out.shape
    T, G = spec.new_tokens, spec.group_size
    return out.reshape(B, K, T, G, Dv).transpose(0, 2, 1, 3, 4).reshape(B, T, K * G, Dv)


def row_positions(spec: DecodeSpec):
    """Absolute position ``[B, T*G]`` of every folded row (``lengths - T + r // G``)."""
    return jnp.repeat(spec.query_positions(spec.lengths), spec.group_size, axis=1)


def sink_state(spec: DecodeSpec, head_dim_v: int) -> online_softmax.State:
    """The sinks over folded rows ``[B, K, T*G]`` as one more state
    (:func:`flashlab.ladder.online_softmax.sink_state`: ``m = s_h, l = 1, acc = 0``)."""
    B, K, G, T = spec.batch, spec.num_kv_heads, spec.group_size, spec.new_tokens
    s = jnp.tile(spec.sinks.reshape(K, 1, G), (1, T, 1)).reshape(K, T * G)
    return online_softmax.sink_state(jnp.broadcast_to(s, (B, K, T * G)), head_dim_v)


def gather_pages(cache, spec: DecodeSpec):
    """The cache as ``[B, capacity, K, d]`` (paged: gathered through the page table)."""
    if not spec.paged:
        return cache
    B, P = spec.page_table.shape
    return cache[spec.page_table].reshape(B, P * spec.page_size, *cache.shape[2:])


def _divisor_at_most(n: int, cap: int) -> int:
    for b in range(min(n, cap), 0, -1):
        if n % b == 0:
            return b
    return 1


def paged_view(k_cache, v_cache, spec: DecodeSpec, block: int = 256):
    """Any cache as pages: ``(k_pages, v_pages, page_table, page_size)``.

    A paged cache is returned as it is. A contiguous ``[B, L, K, d]`` cache is the paged cache
    with pages of the largest divisor of ``L`` up to ``block`` and table ``b * (L/ps) + i``
    (a free reshape: no copy).
    """
    if spec.paged:
        return k_cache, v_cache, spec.page_table, spec.page_size
    B, L = k_cache.shape[:2]
    ps = _divisor_at_most(L, block)
    n = L // ps
    table = jnp.arange(B * n, dtype=jnp.int32).reshape(B, n)
    reshape = lambda c: c.reshape(B * n, ps, *c.shape[2:])
    return reshape(k_cache), reshape(v_cache), table, ps


def _scores(q, k, spec: DecodeSpec, eq: str):
    acc = jnp.promote_types(q.dtype, jnp.float32)
    precision = None if jnp.dtype(q.dtype).itemsize < 4 else jax.lax.Precision.HIGHEST
    s = jnp.einsum(eq, q, k, preferred_element_type=acc, precision=precision) * spec.scale
    if spec.soft_cap is not None:
        s = spec.soft_cap * jnp.tanh(s / spec.soft_cap)
    return s


# ----------------------------------------------------------------------------- reference

def reference_decode(query, k_cache, v_cache, spec: DecodeSpec, *, interpret=None):
    """Gather the pages, then naive attention over the whole ``[B, capacity]`` cache."""
    del interpret
    k, v = gather_pages(k_cache, spec), gather_pages(v_cache, spec)     # [B, C, K, d]
    B, T, N, D = query.shape
    K, G, C = spec.num_kv_heads, spec.group_size, k.shape[1]
    q = query.reshape(B, T, K, G, D)
    s = _scores(q, k, spec, "btkgd,bckd->bkgtc")                          # [B, K, G, T, C]
    qpos = spec.query_positions(spec.lengths)[:, None, None, :, None]    # [B, 1, 1, T, 1]
    vis = spec.visible(qpos, jnp.arange(C), spec.lengths[:, None, None, None, None])
    s = jnp.where(vis, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    if spec.sinks is not None:
        sink = spec.sinks.reshape(1, K, G, 1, 1).astype(s.dtype)
        m = jnp.maximum(m, sink)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m)
    l = jnp.sum(p, axis=-1, keepdims=True)
    if spec.sinks is not None:
        l = l + jnp.exp(sink - m)
    p = p / jnp.where(l > 0, l, 1.0)
    pv_dtype = v.dtype if jnp.dtype(v.dtype).itemsize < 4 else p.dtype
    o = jnp.einsum("bkgtc,bckd->btkgd", p.astype(pv_dtype), v, preferred_element_type=p.dtype,
                   precision=None if jnp.dtype(v.dtype).itemsize < 4 else jax.lax.Precision.HIGHEST)
    return o.reshape(B, T, N, v.shape[3]).astype(query.dtype)


# ----------------------------------------------------------------------------- tiled

def tiled_decode(query, k_cache, v_cache, spec: DecodeSpec, *, interpret=None,
                 block_k: int = 256):
    """Walk the cache ``block_k`` positions (whole pages) at a time, online softmax.

    Rows are the folded ``[B, K, T*G]`` queries, so each K/V block is read once per kv head.
    The loop runs only over the blocks that some sequence can see (``lax.fori_loop`` with
    bounds from the lengths and the window).
    """
    del interpret
    kp, vp, table, ps = paged_view(k_cache, v_cache, spec, block_k)
    pps = max(1, block_k // ps)                        # pages per step
    B, P = table.shape
    n_steps = -(-P // pps)
    table = jnp.pad(table, ((0, 0), (0, n_steps * pps - P)))   # padding pages: never visible
    bk = pps * ps
    q = fold_heads(query, spec)                        # [B, K, R, d]
    qpos = row_positions(spec)[:, None, :, None]       # [B, 1, R, 1]
    lengths = spec.lengths[:, None, None, None]
    Dv = spec.head_dim_v
    if spec.sinks is not None:
        state = sink_state(spec, Dv)
    else:
        state = online_softmax.init(q.shape[:3], Dv)

    def body(i, state):
        pages = jax.lax.dynamic_slice_in_dim(table, i * pps, pps, axis=1)   # [B, pps]
        kb = kp[pages].reshape(B, bk, *kp.shape[2:])                         # [B, bk, K, d]
        vb = vp[pages].reshape(B, bk, *vp.shape[2:])
        s = _scores(q, kb, spec, "bkrd,bckd->bkrc")                          # [B, K, R, bk]
        vis = spec.visible(qpos, i * bk + jnp.arange(bk), lengths)           # [B, 1, R, bk]
        return online_softmax.update(state, s, vb.transpose(0, 2, 1, 3), visible=vis)

    hi = (jnp.max(spec.lengths) + bk - 1) // bk
    lo = jnp.int32(0)
    if spec.window is not None:      # keys before min(first visible position) are never seen
        first = jnp.min(jnp.where(spec.lengths > 0, spec.lengths - spec.new_tokens
                                  - spec.window, spec.capacity))
        lo = jnp.clip(first, 0, None) // bk
    state = jax.lax.fori_loop(lo, hi, body, state)
    out, _ = online_softmax.finalize(state)
    return unfold_heads(out, spec).astype(query.dtype)


# ----------------------------------------------------------------------------- the oracle

def oracle_decode_attention(query, k_cache, v_cache, *, cache_lengths, page_table=None,
                            scale=None, local_window_size=None, logits_soft_cap=None,
                            sinks=None) -> np.ndarray:
    """Float64 NumPy truth for :func:`flashlab.serving.decode.decode_attention` (a loop over
    sequences, no JAX).

    Returns ``[B, T, Hq, dv]`` float64.
    """
    q, k, v = (np.asarray(x, np.float64) for x in (query, k_cache, v_cache))
    lengths = np.asarray(cache_lengths)
    B, T, N, D = q.shape
    K = k.shape[2]
    G = N // K
    scale = 1.0 / np.sqrt(D) if scale is None else scale
    if local_window_size is None:
        left = None
    elif isinstance(local_window_size, (tuple, list)):
        left = local_window_size[0]
    else:
        left = int(local_window_size)
    out = np.zeros((B, T, N, v.shape[3]))
    for b in range(B):
        L = int(lengths[b])
        if L == 0:
            continue
        if page_table is None:
            kb, vb = k[b, :L], v[b, :L]
        else:
            pages = np.asarray(page_table)[b]
            kb = np.concatenate([k[p] for p in pages])[:L]
            vb = np.concatenate([v[p] for p in pages])[:L]
        for t in range(T):
            pos = L - T + t
            keys = np.arange(L)
            vis = keys <= pos
            if left is not None:
                vis &= keys >= pos - left
            for h in range(N):
                s = kb[:, h // G] @ q[b, t, h] * scale
                if logits_soft_cap is not None:
                    s = logits_soft_cap * np.tanh(s / logits_soft_cap)
                s = s[vis]
                logits = s if sinks is None else np.append(s, float(sinks[h]))
                if logits.size == 0:
                    continue
                w = np.exp(logits - logits.max())
                w /= w.sum()
                out[b, t, h] = w[:s.size] @ vb[vis, h // G]
    return out
