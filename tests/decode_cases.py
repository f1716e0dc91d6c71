"""Random decode requests shared by the decode tests (contiguous or paged, ragged lengths)."""
from __future__ import annotations

import numpy as np
import jax.numpy as jnp

__all__ = ["decode_case", "CASES"]


def decode_case(seed=0, *, batch=3, new_tokens=1, q_heads=4, kv_heads=2, head_dim=16,
                head_dim_v=None, page_size=8, pages_per_seq=4, paged=True, lengths=None,
                dtype=jnp.float32, extra_pages=3, sinks=False):
    """``(query, k_cache, v_cache, kwargs)`` for ``decode_attention(query, k, v, **kwargs)``.

    Paged: ``batch * pages_per_seq + extra_pages`` pages in a shuffled pool, unused table
    entries -1. Contiguous: ``max_len = page_size * pages_per_seq``.
    """
    rng = np.random.default_rng(seed)
    cap = page_size * pages_per_seq
    if lengths is None:
        lengths = rng.integers(new_tokens, cap + 1, batch)
    lengths = np.asarray(lengths, np.int32)
    dv = head_dim if head_dim_v is None else head_dim_v
    q = rng.standard_normal((batch, new_tokens, q_heads, head_dim))
    kw = dict(cache_lengths=jnp.asarray(lengths))
    if paged:
        num_pages = batch * pages_per_seq + extra_pages
        k = rng.standard_normal((num_pages, page_size, kv_heads, head_dim))
        v = rng.standard_normal((num_pages, page_size, kv_heads, dv))
        table = rng.permutation(num_pages)[:batch * pages_per_seq].reshape(batch, pages_per_seq)
        used = np.arange(pages_per_seq)[None] * page_size < lengths[:, None]
        kw["page_table"] = jnp.asarray(np.where(used, table, -1), jnp.int32)
    else:
        k = rng.standard_normal((batch, cap, kv_heads, head_dim))
        v = rng.standard_normal((batch, cap, kv_heads, dv))
    if sinks:
        kw["sinks"] = jnp.asarray(rng.standard_normal(q_heads) + 1.0, jnp.float32)
    return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype), kw)


# (name, decode_case kwargs, decode_attention extra kwargs): the feature grid every backend runs.
CASES = [
    ("gqa_paged_ragged_empty", dict(lengths=[0, 5, 32]), {}),
    ("mha_contig_value_dim", dict(q_heads=2, kv_heads=2, paged=False, head_dim_v=8), {}),
    ("mqa_paged_chunked", dict(q_heads=4, kv_heads=1, new_tokens=4, lengths=[4, 17, 30]), {}),
    ("chunked_window_contig", dict(new_tokens=3, lengths=[3, 20, 32], paged=False),
     dict(local_window_size=5)),
    ("window_pair_soft_cap", dict(lengths=[1, 9, 31]),
     dict(local_window_size=(7, 0), logits_soft_cap=2.0)),
    ("sinks_with_empty", dict(sinks=True, lengths=[0, 3, 30]), {}),
    ("sinks_chunked_window_cap", dict(sinks=True, new_tokens=2, q_heads=6, kv_heads=3),
     dict(local_window_size=4, logits_soft_cap=3.0)),
]
