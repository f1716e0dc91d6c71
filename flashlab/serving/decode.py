"""Serving: attention of a few new tokens over a KV cache (decode and chunked prefill).

``decode_attention`` is the serving contract (validated once by
:func:`flashlab.contract.decode_validate.validate_decode`, then served by a backend from the decode
registry below, declared with :class:`flashlab.dispatch.registry.Backend` in the decode vocabulary
``paged, local_window, soft_cap, sinks, gqa, chunked_prefill``):

* ``reference``: gathers the pages into one contiguous cache and runs naive attention;
* ``tiled``: plain JAX, walks the cache a block of pages at a time with
  :func:`flashlab.ladder.online_softmax.update`, all ``G`` query heads of a kv head (times the new
  tokens) folded into the rows of one tile, so each K/V block is read once per kv head;
* ``pallas_tpu``: the Pallas TPU decode kernel (:mod:`flashlab.kernels.decode`).

Sinks (a per-head logit ``s_h`` that joins the softmax denominator and takes no value, as in
gpt-oss) are one more online-softmax state: ``m = s_h, l = 1, acc = 0``. Merging it with
:func:`flashlab.ladder.online_softmax.merge` adds ``exp(s_h - m)`` to the denominator and nothing to
the numerator: :func:`sink_state`.
"""
from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp

from flashlab.contract import device
from flashlab.ladder import online_softmax
from flashlab.dispatch import registry
from flashlab.contract.decode_validate import DECODE_FEATURES, DecodeSpec, validate_decode
from flashlab.dispatch.registry import Backend, Choice

__all__ = ["decode_attention", "decode_backends", "choose_decode", "register_decode",
           "oracle_decode_attention", "reference_decode", "tiled_decode", "fold_heads",
           "unfold_heads", "sink_state", "gather_pages", "paged_view", "DecodeSpec",
           "validate_decode"]


# ----------------------------------------------------------------------------- shared pieces

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
    """Float64 NumPy truth for :func:`flashlab.serving.decode.decode_attention` (a loop over sequences, no JAX).

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


# ----------------------------------------------------------------------------- the registry

_DECODE_REGISTRY: dict[str, Backend] = {}


def register_decode(backend: Backend, *, replace: bool = False) -> Backend:
    """Add a decode backend (a :class:`flashlab.dispatch.registry.Backend` whose ``fn`` is
    ``fn(query, k_cache, v_cache, spec: DecodeSpec, *, interpret)``)."""
    if backend.name in _DECODE_REGISTRY and not replace:
        raise ValueError(f"backend: decode backend {backend.name!r} is already registered")
    _DECODE_REGISTRY[backend.name] = backend
    return backend


def decode_backends() -> list[Backend]:
    """Registered decode backends in registration order."""
    return list(_DECODE_REGISTRY.values())


_DECODE_PREFERENCE = {"tpu": ("pallas_tpu", "tiled", "reference"),
                      "gpu": ("tiled", "reference"), "cpu": ("tiled", "reference")}


def choose_decode(spec: DecodeSpec, backend: str = "auto", *, interpret=None,
                  platform: str | None = None) -> Choice:
    """Pick the decode backend for ``spec`` (``"auto"`` or a name) and say why.

    The platform is the compile target's while :func:`flashlab.instruments.tpu_compile.compile` builds
    for a TPU (:func:`flashlab.contract.device.target_chip`), else this host's.
    """
    if platform is None:
        platform = "tpu" if device.target_chip() is not None else device.platform()
    if backend != "auto":
        if not isinstance(backend, str) or backend not in _DECODE_REGISTRY:
            raise ValueError(f"backend: expected 'auto' or one of {list(_DECODE_REGISTRY)}, "
                             f"got {backend!r}")
        b = _DECODE_REGISTRY[backend]
        why = b.unsupported(spec, platform, interpret)
        if why:
            others = [o.name for o in decode_backends() if o.name != b.name
                      and not o.unsupported(spec, platform, interpret)]
            raise NotImplementedError(
                f"decode backend {b.name!r} does not support {', '.join(why)} (its "
                f"declaration: {b.declaration()}); decode backends that support this "
                f"request here: {others or 'none'}")
        return Choice(b.name, b.mode(platform, interpret), "requested by name", platform)
    considered = []
    for name in _DECODE_PREFERENCE.get(platform, _DECODE_PREFERENCE["cpu"]):
        b = _DECODE_REGISTRY.get(name)
        if b is None:
            continue
        why = b.unsupported(spec, platform, interpret)
        if why:
            considered.append((name, "does not support " + ", ".join(why)))
            continue
        return Choice(name, b.mode(platform, interpret), b.description, platform,
                      tuple(considered))
    raise NotImplementedError(f"no decode backend supports this request on {platform}: "
                              + "; ".join(f"{n}: {v}" for n, v in considered))


register_decode(Backend(
    "reference", "gathers the pages, then naive attention over the whole cache",
    reference_decode, platforms=frozenset(registry.PLATFORMS), features=DECODE_FEATURES,
    gradients=False))
register_decode(Backend(
    "tiled", "plain JAX: a block of pages at a time, G heads folded, online softmax",
    tiled_decode, platforms=frozenset(registry.PLATFORMS), features=DECODE_FEATURES,
    gradients=False))


def _pallas_tpu_decode(query, k_cache, v_cache, spec: DecodeSpec, *, interpret=None):
    from flashlab.kernels.decode import pallas_decode
    return pallas_decode(query, k_cache, v_cache, spec, interpret=interpret)


register_decode(Backend(
    "pallas_tpu", "flashlab.kernels.decode: page walk in the index maps, G heads folded, "
    "split-K merged with online_softmax.merge", _pallas_tpu_decode,
    platforms=frozenset({"tpu"}), interpret_platforms=frozenset({"cpu", "gpu"}),
    interpret_by_default=True, dtypes=frozenset({"bfloat16", "float32"}),
    features=DECODE_FEATURES, gradients=False, interpret_kind="Pallas interpreter"))


# ----------------------------------------------------------------------------- the contract

def decode_attention(query, k_cache, v_cache, *, cache_lengths, page_table=None, scale=None,
                     local_window_size=None, logits_soft_cap=None, sinks=None,
                     backend: str = "auto", interpret=None):
    """Attention of ``new_tokens`` queries per sequence over a (paged) KV cache.

    Args:
      query: ``[batch, new_tokens, q_heads, head_dim]``; ``new_tokens = 1`` is decode, more is
        a chunked prefill. Token ``t`` of sequence ``b`` sits at absolute position
        ``cache_lengths[b] - new_tokens + t``; its own key/value is already in the cache.
      k_cache, v_cache: contiguous ``[batch, max_len, kv_heads, head_dim(_v)]`` or paged
        ``[num_pages, page_size, kv_heads, head_dim(_v)]``, the query's dtype; ``q_heads`` a
        multiple of ``kv_heads`` (query head ``h`` reads kv head ``h // (q_heads // kv_heads)``).
      cache_lengths: int ``[batch]``: valid positions per sequence (0 = empty slot: zeros).
      page_table: int32 ``[batch, pages_per_sequence]`` for a paged cache: page
        ``page_table[b, i]`` holds positions ``i*page_size .. (i+1)*page_size - 1``.
      scale: logit scale, default ``1/sqrt(head_dim)``.
      local_window_size: int ``w`` (or a pair whose left side is used): a query at position
        ``p`` sees keys ``p - w .. p``.
      logits_soft_cap: ``c > 0``: logits become ``c * tanh(logits / c)`` after scaling.
      sinks: float ``[q_heads]``: a per-head logit that joins the softmax denominator and
        takes no value.
      backend: ``"auto"`` or a name from :func:`flashlab.serving.decode.decode_backends`.
      interpret: for ``pallas_tpu`` off a TPU: ``None``/``True`` generic interpreter, or a
        ``pltpu.InterpretParams`` (TPU interpret mode).

    Returns:
      ``[batch, new_tokens, q_heads, head_dim_v]`` in the query's dtype. Sequences whose
      traced lengths or page-table entries are out of range come back as NaN rows (see
      :mod:`flashlab.contract.decode_validate`); concrete bad values raise ``ValueError``.
    """
    q, k, v, spec = validate_decode(
        query, k_cache, v_cache, cache_lengths=cache_lengths, page_table=page_table,
        scale=scale, local_window_size=local_window_size, logits_soft_cap=logits_soft_cap,
        sinks=sinks)
    choice = choose_decode(spec, backend, interpret=interpret)
    out = _DECODE_REGISTRY[choice.backend].fn(q, k, v, spec, interpret=interpret)
    if spec.invalid is not None:
        out = jnp.where(spec.invalid[:, None, None, None], jnp.nan, out).astype(out.dtype)
    return out
