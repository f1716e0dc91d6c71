"""One decode request, validated once: the :class:`DecodeSpec` every decode backend consumes.

The sibling of :func:`flashlab.contract.masks.validate` for serving. A decode step reads a KV
cache:

* ``query`` ``[batch, new_tokens, q_heads, head_dim]``; ``new_tokens = 1`` is decode, more is
  a chunked prefill. The new tokens' keys and values are already in the cache.
* contiguous cache: ``k_cache``/``v_cache`` ``[batch, max_len, kv_heads, head_dim]``;
  paged cache: ``[num_pages, page_size, kv_heads, head_dim]`` plus ``page_table``
  ``[batch, pages_per_sequence]`` int32 (page ``page_table[b, i]`` holds positions
  ``i*page_size ... (i+1)*page_size - 1`` of sequence ``b``).
* ``cache_lengths`` ``[batch]`` int: query token ``t`` of sequence ``b`` sits at position
  ``cache_lengths[b] - new_tokens + t`` and sees keys ``0 ..`` that position (bottom-right
  aligned causal), minus those more than ``left`` behind it for ``local_window_size``.
  A length of 0 is an empty slot: its rows are zeros. Otherwise a length must be at least
  ``new_tokens`` and at most the capacity.

Concrete (non-traced) values are checked here and rejected with a ``ValueError`` naming the
argument, the value and what was expected. Values traced under ``jit`` cannot be read
without a host sync, so they are checked *in the graph*: ``spec.invalid`` ``[batch]`` flags
each sequence whose length or used page-table entries are out of range, the indices are
clamped so no read leaves the arrays, and :func:`flashlab.serving.decode.decode_attention` returns
NaN rows for every flagged sequence: loud, never a silent wrong answer. Unused page-table
entries (pages past a sequence's length) are never read and may hold anything (e.g. -1).
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flashlab.contract import checks, masks

__all__ = ["DecodeSpec", "validate_decode", "DECODE_FEATURES"]

# The decode vocabulary of capabilities (a backend declares the subset it serves).
DECODE_FEATURES = frozenset({"paged", "local_window", "soft_cap", "sinks", "gqa",
                             "chunked_prefill"})


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeSpec:
    """A validated decode request: static facts plus the small int/float arrays.

    Array fields (pytree leaves)::

      lengths     int32   [B]      cache lengths, clamped into [0, capacity]
      page_table  int32   [B, P]   paged caches only; clamped into [0, num_pages)
      sinks       float32 [Hq]     optional per-head sink logit (joins the denominator only)
      invalid     bool    [B]      traced inputs only: sequences whose inputs were out of range

    Static: shapes, dtype, ``scale``, ``window`` (left: keys ``pos-left .. pos``, or ``None``),
    ``soft_cap``, ``page_size`` (a contiguous cache reports ``max_len``) and ``capacity``.
    """

    batch: int = dataclasses.field(metadata=dict(static=True))
    new_tokens: int = dataclasses.field(metadata=dict(static=True))
    num_heads: int = dataclasses.field(metadata=dict(static=True))
    num_kv_heads: int = dataclasses.field(metadata=dict(static=True))
    head_dim: int = dataclasses.field(metadata=dict(static=True))
    head_dim_v: int = dataclasses.field(metadata=dict(static=True))
    dtype: Any = dataclasses.field(metadata=dict(static=True))
    scale: float = dataclasses.field(metadata=dict(static=True))
    window: int | None = dataclasses.field(metadata=dict(static=True))
    soft_cap: float | None = dataclasses.field(metadata=dict(static=True))
    paged: bool = dataclasses.field(metadata=dict(static=True))
    page_size: int = dataclasses.field(metadata=dict(static=True))
    pages_per_sequence: int = dataclasses.field(metadata=dict(static=True))
    num_pages: int = dataclasses.field(metadata=dict(static=True))
    lengths: jax.Array = None
    page_table: jax.Array | None = None
    sinks: jax.Array | None = None
    invalid: jax.Array | None = None

    @property
    def group_size(self) -> int:
        """Query heads per kv head ``G`` (1 for MHA, ``Hq`` for MQA)."""
        return self.num_heads // self.num_kv_heads

    @property
    def capacity(self) -> int:
        """Most positions one sequence can hold."""
        return self.pages_per_sequence * self.page_size

    def features(self) -> set[str]:
        """Names of the optional features this request uses (registry vocabulary)."""
        f = set()
        if self.paged:
            f.add("paged")
        if self.window is not None:
            f.add("local_window")
        if self.soft_cap is not None:
            f.add("soft_cap")
        if self.sinks is not None:
            f.add("sinks")
        if self.num_kv_heads != self.num_heads:
            f.add("gqa")
        if self.new_tokens > 1:
            f.add("chunked_prefill")
        return f

    def visible(self, q_pos, k_pos, lengths):
        """Which keys each query sees: bool, ``q_pos``/``k_pos``/``lengths`` broadcastable.

        ``q_pos`` are absolute query positions (``lengths - new_tokens + t``), ``k_pos`` key
        positions. The one definition (:func:`flashlab.contract.masks.structural_visible`): causal,
        the left window, and keys below the length.
        """
        window = None if self.window is None else (self.window, None)
        return masks.structural_visible(q_pos, k_pos, is_causal=True, window=window,
                                        kv_len=lengths)

    def query_positions(self, lengths):
        """Absolute positions ``[..., new_tokens]`` of the query tokens for ``lengths`` ``[...]``."""
        return lengths[..., None] - self.new_tokens + jnp.arange(self.new_tokens, dtype=jnp.int32)


def _is_traced(x) -> bool:
    return isinstance(x, jax.core.Tracer)


def _check_array(name, x, rank, what):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name}: expected a jax or numpy array {what}, got {type(x).__name__}")
    if len(x.shape) != rank:
        raise ValueError(f"{name}: expected rank {rank} {what}, got shape {tuple(x.shape)}")


def _float_scalar(name, x, positive=False):
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name}: expected a Python float, got {x!r}")
    if not math.isfinite(float(x)) or (positive and not float(x) > 0):
        raise ValueError(f"{name}: expected a finite float{' > 0' if positive else ''}, got {x!r}")
    return float(x)


def validate_decode(query, k_cache, v_cache, *, cache_lengths, page_table=None, scale=None,
                    local_window_size=None, logits_soft_cap=None, sinks=None):
    """Check every decode argument once; return ``(query, k_cache, v_cache, spec)``.

    Raises ``TypeError``/``ValueError`` naming the argument, the value given and what was
    expected; see the module docstring for what is checked on traced values.
    """
    _check_array("query", query, 4, "[batch, new_tokens, q_heads, head_dim]")
    cache_layout = ("[num_pages, page_size, kv_heads, head_dim]" if page_table is not None
                    else "[batch, max_len, kv_heads, head_dim]")
    _check_array("k_cache", k_cache, 4, cache_layout)
    _check_array("v_cache", v_cache, 4, cache_layout)
    dt = jnp.dtype(query.dtype)
    if not jnp.issubdtype(dt, jnp.floating):
        raise TypeError(f"query: expected a floating dtype (bfloat16, float16, float32, "
                        f"float64), got {dt}")
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if jnp.dtype(x.dtype) != dt:
            raise TypeError(f"{name}: expected dtype {dt} (the query's), got {x.dtype}")
    B, T, N, D = query.shape
    P0, S0, K, Dk = k_cache.shape
    if min(B, T, N, D) < 1 or min(P0, S0, K) < 1 or v_cache.shape[3] < 1:
        raise ValueError(f"query/k_cache/v_cache: every dimension must be >= 1, got query "
                         f"{tuple(query.shape)}, k_cache {tuple(k_cache.shape)}, v_cache "
                         f"{tuple(v_cache.shape)}")
    if Dk != D:
        raise ValueError(f"k_cache: expected head_dim {D} (the query's), got shape "
                         f"{tuple(k_cache.shape)}")
    if tuple(v_cache.shape[:3]) != (P0, S0, K):
        raise ValueError(f"v_cache: expected shape [{P0}, {S0}, {K}, head_dim_v] (k_cache's "
                         f"first three dims), got {tuple(v_cache.shape)}")
    if N % K:
        raise ValueError(f"k_cache: query heads ({N}) must be a multiple of kv heads, got "
                         f"k_cache shape {tuple(k_cache.shape)} with {K} kv heads")

    # --- the cache layout
    if page_table is None:
        if P0 != B:
            raise ValueError(f"k_cache: a contiguous cache needs batch {B} (the query's) "
                             f"first, got shape {tuple(k_cache.shape)}; pass page_table= for "
                             f"a paged cache")
        paged, page_size, pages_per_seq, num_pages = False, S0, 1, B
    else:
        _check_array("page_table", page_table, 2, "[batch, pages_per_sequence]")
        if not jnp.issubdtype(page_table.dtype, jnp.integer):
            raise TypeError(f"page_table: expected an integer dtype (int32), got "
                            f"{page_table.dtype}")
        if page_table.shape[0] != B or page_table.shape[1] < 1:
            raise ValueError(f"page_table: expected shape [batch={B}, pages_per_sequence>=1],"
                             f" got {tuple(page_table.shape)}")
        paged, page_size, pages_per_seq, num_pages = True, S0, page_table.shape[1], P0
    capacity = page_size * pages_per_seq

    # --- lengths
    _check_array("cache_lengths", cache_lengths, 1, f"[batch] = [{B}]")
    if tuple(cache_lengths.shape) != (B,):
        raise ValueError(f"cache_lengths: expected shape [batch] = [{B}], got "
                         f"{tuple(cache_lengths.shape)}")
    if not jnp.issubdtype(cache_lengths.dtype, jnp.integer):
        raise TypeError(f"cache_lengths: expected an integer dtype (int32), got "
                        f"{cache_lengths.dtype}")
    traced = _is_traced(cache_lengths) or (paged and _is_traced(page_table))
    if not _is_traced(cache_lengths):
        ls = np.asarray(cache_lengths)
        bad = (ls < 0) | (ls > capacity) | ((ls > 0) & (ls < T))
        if bad.any():
            raise ValueError(
                f"cache_lengths: expected 0 (an empty slot) or a length in [new_tokens={T}, "
                f"capacity={capacity}] per sequence, got {ls.tolist()} (bad at batch rows "
                f"{np.flatnonzero(bad).tolist()})")
    if paged and not traced:
        pt, ls = np.asarray(page_table), np.asarray(cache_lengths)
        used = np.arange(pages_per_seq)[None, :] * page_size < ls[:, None]
        out = used & ((pt < 0) | (pt >= num_pages))
        if out.any():
            b, i = map(int, np.argwhere(out)[0])
            raise ValueError(
                f"page_table: entries of used pages must be in [0, num_pages={num_pages}), "
                f"got page_table[{b}, {i}] = {int(pt[b, i])} (sequence {b} has length "
                f"{int(ls[b])}, so pages 0..{int(-(-ls[b] // page_size)) - 1} are used)")

    lengths = jnp.asarray(cache_lengths, jnp.int32)
    invalid = None
    if traced:
        # Checked in the graph: flag the sequence (NaN rows) and clamp so nothing reads out.
        invalid = (lengths < 0) | (lengths > capacity) | ((lengths > 0) & (lengths < T))
        lengths = jnp.clip(lengths, 0, capacity)
    table = None
    if paged:
        table = jnp.asarray(page_table, jnp.int32)
        if traced:
            used = jnp.arange(pages_per_seq)[None, :] * page_size < lengths[:, None]
            invalid = invalid | (used & ((table < 0) | (table >= num_pages))).any(axis=1)
        table = jnp.clip(table, 0, num_pages - 1)

    # --- scalars
    scale = 1.0 / math.sqrt(D) if scale is None else _float_scalar("scale", scale)
    if logits_soft_cap is not None:
        logits_soft_cap = _float_scalar("logits_soft_cap", logits_soft_cap, positive=True)
    window = checks.window(local_window_size)
    window = None if window is None else window[0]   # right side: moot under causality
    if sinks is not None:
        _check_array("sinks", sinks, 1, f"[q_heads] = [{N}]")
        if tuple(sinks.shape) != (N,):
            raise ValueError(f"sinks: expected shape [q_heads] = [{N}], got {tuple(sinks.shape)}")
        if not jnp.issubdtype(sinks.dtype, jnp.floating):
            raise TypeError(f"sinks: expected a floating dtype, got {sinks.dtype}")
        sinks = jnp.asarray(sinks, jnp.float32)

    spec = DecodeSpec(
        batch=B, new_tokens=T, num_heads=N, num_kv_heads=K, head_dim=D,
        head_dim_v=int(v_cache.shape[3]), dtype=dt, scale=scale, window=window,
        soft_cap=logits_soft_cap, paged=paged, page_size=page_size,
        pages_per_sequence=pages_per_seq, num_pages=num_pages, lengths=lengths,
        page_table=table, sinks=sinks, invalid=invalid)
    return jnp.asarray(query), jnp.asarray(k_cache), jnp.asarray(v_cache), spec
