"""Decode steps as ``(fn, args)`` for the TPU compiler: flashlab's decode kernel and the official
``paged_attention`` at the same shapes (what ``tpu_compile.compile`` and the static bench lower).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from flashlab.compat import pallas as compat
from flashlab.serving.decode import decode_attention

__all__ = ["decode_step_case", "official_paged_step_case"]


def decode_step_case(*, batch: int = 8, q_heads: int = 32, kv_heads: int = 4,
                     head_dim: int = 128, page_size: int = 16, pages_per_sequence: int = 256,
                     new_tokens: int = 1, dtype="bfloat16", window: int | None = None,
                     soft_cap: float | None = None, sinks: bool = False):
    """``(fn, args)``: one decode step through the compiled kernel, for the TPU compiler.

    ``fn(query, k_pages, v_pages, cache_lengths, page_table[, sinks])`` is
    :func:`flashlab.decode_attention` with ``backend="pallas_tpu", interpret=False`` (the
    kernel plus the split-K merge); ``args`` are ``jax.ShapeDtypeStruct`` s of a paged cache
    holding ``batch * pages_per_sequence`` pages. What ``tpu_compile.compile(fn, *args,
    chip=...)`` and ``bench tpu-static`` lower.
    """
    dt = jnp.dtype(dtype)
    sds = jax.ShapeDtypeStruct
    pages = batch * pages_per_sequence
    args = [sds((batch, new_tokens, q_heads, head_dim), dt),
            sds((pages, page_size, kv_heads, head_dim), dt),
            sds((pages, page_size, kv_heads, head_dim), dt),
            sds((batch,), jnp.int32), sds((batch, pages_per_sequence), jnp.int32)]
    if sinks:
        args.append(sds((q_heads,), jnp.float32))

    def fn(query, k_pages, v_pages, cache_lengths, page_table, sinks=None):
        return decode_attention(query, k_pages, v_pages, cache_lengths=cache_lengths,
                                page_table=page_table, local_window_size=window,
                                logits_soft_cap=soft_cap, sinks=sinks, backend="pallas_tpu",
                                interpret=False)
    return fn, tuple(args)


def official_paged_step_case(*, batch: int = 8, q_heads: int = 32, kv_heads: int = 4,
                             head_dim: int = 128, page_size: int = 16,
                             pages_per_sequence: int = 256, dtype="bfloat16",
                             pages_per_compute_block: int = 8):
    """``(fn, args)``: the same decode step through the official ``paged_attention`` kernel
    (its layout: ``q [batch, q_heads, d]``, pages ``[kv_heads, num_pages, page_size, d]``), for
    side-by-side compiles and static schedules with :func:`decode_step_case`."""
    pa = compat.official_paged_attention()
    dt = jnp.dtype(dtype)
    sds = jax.ShapeDtypeStruct
    pages = batch * pages_per_sequence
    args = (sds((batch, q_heads, head_dim), dt),
            sds((kv_heads, pages, page_size, head_dim), dt),
            sds((kv_heads, pages, page_size, head_dim), dt),
            sds((batch,), jnp.int32), sds((batch, pages_per_sequence), jnp.int32))

    def fn(q, k_pages, v_pages, lengths, page_indices):
        return pa.paged_attention(q, k_pages, v_pages, lengths, page_indices,
                                  pages_per_compute_block=pages_per_compute_block)
    return fn, args
