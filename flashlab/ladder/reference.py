"""Rung 0: naive attention, and the float64 oracle every rung is tested against.

``naive_attention`` materializes the ``[batch, heads, q_seq, kv_seq]`` score matrix on
purpose: it is the algorithm as written in the paper, and the memory problem the rest of
the book solves. Traffic, per (batch, head): read Q, K (2·N·d), write S (N²), read S and
write P (2·N²), read P and V (N² + N·d), write O (N·d).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from flashlab.contract.masks import AttentionSpec, validate

__all__ = ["naive_attention", "attention_from_spec", "oracle_attention"]


def naive_attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
                    query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
                    segment_ids=None, logits_soft_cap=None, sinks=None, q_offset=None,
                    kv_offset=None):
    """Softmax attention the textbook way.

    Args:
      query: ``[batch, q_seq, heads, head_dim]`` float array.
      key, value: ``[batch, kv_seq, kv_heads, head_dim]``; ``heads`` a multiple of ``kv_heads``
        (GQA/MQA: query head ``h`` reads kv head ``h // (heads // kv_heads)``).
      bias: optional float ``[batch or 1, heads or 1, q_seq, kv_seq]`` added to the logits.
      mask: optional bool, same shape rule; True = visible.
      scale: logit scale, default ``1/sqrt(head_dim)``.
      is_causal: key ``j`` visible from query ``i`` only if ``j <= i``.
      query_seq_lengths, key_value_seq_lengths: optional int ``[batch]`` valid lengths.
      local_window_size: int ``w`` or pair ``(left, right)``: keys ``i-left .. i+right``.
      segment_ids: int ``[batch, seq]`` (self-attention) or a pair ``(q_ids, kv_ids)``;
        tokens see only keys of their own segment.
      logits_soft_cap: ``c > 0``: logits become ``c * tanh(logits / c)`` after scaling.
      sinks: optional float ``[heads]``: a per-head logit in every row's softmax
        denominator that takes no value (``l = exp(sink) + sum_j exp(s_ij)``).
      q_offset, kv_offset: global positions of query 0 / key 0 (see
        :mod:`flashlab.contract.masks`).

    Returns:
      ``[batch, q_seq, heads, head_dim]`` in the query's dtype. A query row with no visible
      key is all zeros, and its gradients are zeros.
    """
    query, key, value, spec = validate(
        query, key, value, bias, mask, scale=scale, is_causal=is_causal,
        query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
        local_window_size=local_window_size, segment_ids=segment_ids,
        logits_soft_cap=logits_soft_cap, sinks=sinks, q_offset=q_offset, kv_offset=kv_offset)
    return attention_from_spec(query, key, value, spec)


def attention_from_spec(query, key, value, spec: AttentionSpec):
    """Naive attention on already validated inputs (what backends call)."""
    B, T, N, H = query.shape
    S, K = key.shape[1], key.shape[2]
    G = N // K
    q = query.reshape(B, T, K, G, H)
    acc = jnp.promote_types(query.dtype, jnp.float32)   # float32, or float64 under x64
    precision = None if jnp.dtype(query.dtype).itemsize < 4 else jax.lax.Precision.HIGHEST
    # s: [B, K, G, T, S] -- the full score matrix, accumulated in float32.
    s = jnp.einsum("btkgh,bskh->bkgts", q, key, preferred_element_type=acc,
                   precision=precision) * spec.scale
    s = s.reshape(B, N, T, S)
    if spec.soft_cap is not None:
        s = spec.soft_cap * jnp.tanh(s / spec.soft_cap)
    if spec.bias is not None:
        s = s + spec.bias.astype(acc)
    vis = spec.visible(jnp.arange(T)[:, None], jnp.arange(S)[None, :])  # [B|1, 1, T, S]
    if spec.mask is not None:
        vis = vis & spec.mask
    s = jnp.where(vis, s, -jnp.inf)
    m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    sink = None
    if spec.sinks is not None:                           # [N] -> [1, N, 1, 1]
        sink = spec.sinks.astype(acc)[None, :, None, None]
        m = jnp.maximum(m, jax.lax.stop_gradient(sink))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m)                                   # [B, N, T, S]; masked -> 0
    l = jnp.sum(p, axis=-1, keepdims=True)
    if sink is not None:
        l = l + jnp.exp(sink - m)                        # the sink: in l, with no value
    p = p / jnp.where(l > 0, l, 1.0)                     # fully masked rows stay 0
    # P in the value dtype for the second matmul (bf16 x bf16 -> f32 on the MXU).
    p = p.reshape(B, K, G, T, S).astype(jnp.promote_types(value.dtype, jnp.float32)
                                        if jnp.dtype(value.dtype).itemsize >= 4 else value.dtype)
    o = jnp.einsum("bkgts,bskh->btkgh", p, value, preferred_element_type=acc,
                   precision=precision)
    return o.reshape(B, T, N, value.shape[3]).astype(query.dtype)


def oracle_attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
                     query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
                     segment_ids=None, logits_soft_cap=None, return_lse=False, sinks=None,
                     q_offset=None, kv_offset=None):
    """Float64 NumPy attention, written independently of the JAX code paths: the truth.

    Same arguments and layout as :func:`naive_attention` (inputs are converted to float64
    NumPy; offsets shift the positions that causal, window and lengths see). Returns ``[batch,
    q_seq, heads, head_dim]`` float64 (and ``lse [batch, heads, q_seq]`` with ``return_lse``). Rows
    with no visible key are zeros (lse ``-inf``).
    ``sinks`` ``[heads]`` joins every row's denominator; then ``lse`` includes the sink
    (finite on rows with no visible key, whose output is still zero).
    """
    q, k, v = (np.asarray(x, np.float64) for x in (query, key, value))
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    scale = 1.0 / np.sqrt(H) if scale is None else float(scale)
    k = np.repeat(k, G, axis=2)                                 # [B, S, N, H]
    v = np.repeat(v, G, axis=2)
    s = np.einsum("bthd,bshd->bhts", q, k) * scale
    if logits_soft_cap is not None:
        s = logits_soft_cap * np.tanh(s / logits_soft_cap)
    if bias is not None:
        s = s + np.asarray(bias, np.float64)
    vis = np.ones((B, N, T, S), bool)
    i = np.arange(T)[:, None] + int(q_offset or 0)
    j = np.arange(S)[None, :] + int(kv_offset or 0)
    if mask is not None:
        vis &= np.asarray(mask, bool)
    if is_causal:
        vis &= j <= i
    if local_window_size is not None:
        w = local_window_size
        left, right = (w, w) if np.isscalar(w) else w
        if left is not None:
            vis &= j >= i - left
        if right is not None:
            vis &= j <= i + right
    if query_seq_lengths is not None:
        vis &= (i[None] < np.asarray(query_seq_lengths)[:, None, None])[:, None]
    if key_value_seq_lengths is not None:
        vis &= (j[None] < np.asarray(key_value_seq_lengths)[:, None, None])[:, None]
    if segment_ids is not None:
        qs, ks = segment_ids if isinstance(segment_ids, (tuple, list)) else (segment_ids,) * 2
        qs, ks = np.asarray(qs), np.asarray(ks)
        vis &= (qs[:, :, None] == ks[:, None, :])[:, None]
    s = np.where(vis, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    if sinks is not None:
        sink = np.asarray(sinks, np.float64)[None, :, None, None]     # [1, N, 1, 1]
        m = np.maximum(m, sink)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.where(vis, np.exp(s - m), 0.0)
    l = p.sum(axis=-1, keepdims=True)
    if sinks is not None:
        l = l + np.exp(sink - m)
    p = p / np.where(l > 0, l, 1.0)
    out = np.einsum("bhts,bshd->bthd", p, v)
    if return_lse:
        with np.errstate(divide="ignore"):
            lse = np.where(l[..., 0] > 0, m[..., 0] + np.log(np.where(l[..., 0] > 0, l[..., 0], 1)), -np.inf)
        return out, lse
    return out


def naive_hbm_bytes(*, batch: int, heads: int, q_len: int, kv_len: int, head_dim: int,
                    bytes_per_element: int, score_bytes: int = 4) -> dict[str, int]:
    """Memory traffic of :func:`naive_attention` when every step goes through HBM.

    The textbook algorithm makes these passes per (batch, head), with ``N = q_len``,
    ``M = kv_len``, ``d = head_dim``:

    ========  ======================================  ==========================
    step      reads                                   writes
    ========  ======================================  ==========================
    S = QKᵀ   Q (N·d), K (M·d)                        S (N·M, ``score_bytes``)
    P = sm(S) S (N·M)                                 P (N·M)
    O = PV    P (N·M), V (M·d)                        O (N·d)
    ========  ======================================  ==========================

    Masking and scaling are assumed fused into the softmax pass (a real unfused
    implementation makes more passes). Returns bytes per term and the ``"total"``.
    """
    bh = batch * heads
    e, s = bytes_per_element, score_bytes
    qkvo = bh * (2 * q_len * head_dim + 2 * kv_len * head_dim) * e
    scores = bh * 4 * q_len * kv_len * s
    return {"q_k_v_o": qkvo, "scores": scores, "total": qkvo + scores}
