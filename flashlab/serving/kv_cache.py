"""A KV cache as a pytree: contiguous or paged, appended per sequence at its own length.

:class:`KVCache` holds what :func:`flashlab.decode_attention` reads, so a model never
hand-rolls the bookkeeping::

    cache = KVCache.paged(batch=2, num_pages=64, page_size=16, kv_heads=2, head_dim=32)
    cache = cache.append(k_new, v_new)        # [B, n, K, d] each, at lengths[b] .. + n - 1
    out = cache.attend(q_new)                 # decode_attention(q_new, cache.k, cache.v, ...)

Layouts (those of ``decode_attention``)::

    contiguous  k, v        [batch, max_len, kv_heads, head_dim(_v)]
    paged       k, v        [num_pages, page_size, kv_heads, head_dim(_v)]
                page_table  int32 [batch, pages_per_sequence]  (-1: no page yet)
                free_pages  int32 [num_pages]  a stack: free_pages[:num_free] are free
    both        lengths     int32 [batch]      valid positions per sequence

Pages are allocated on :meth:`KVCache.append` from the free pool, for the whole batch at once
(sequence ``b`` takes the pages its new positions need, in batch order), and given back by
:meth:`KVCache.release`. Capacity is checked where values are concrete (outside ``jit``):
a sequence past its capacity or an exhausted pool raises ``ValueError`` naming the sequence,
the numbers and the limit. Under ``jit`` the same overflow cannot raise without a host sync:
writes past the capacity are dropped (nothing else is overwritten), the length still grows
and an exhausted pool hands out the out-of-range page ``num_pages``, so
:func:`flashlab.decode_attention` flags that sequence and returns NaN rows for it: loud,
never a silently wrong answer.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["KVCache"]


def _concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _positive(name, x):
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < 1:
        raise ValueError(f"{name}: expected a positive int, got {x!r}")
    return int(x)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Keys and values of every sequence of a batch, and how far each has been written.

    Build one with :meth:`contiguous` or :meth:`paged`; every method returns a new cache
    (a pytree: pass it through ``jit``, ``lax.scan`` and ``nnx`` functions).
    """

    k: jax.Array
    v: jax.Array
    lengths: jax.Array                      # int32 [B]
    page_table: jax.Array | None = None     # int32 [B, P] (paged)
    free_pages: jax.Array | None = None     # int32 [num_pages] (paged): a stack of free ids
    num_free: jax.Array | None = None       # int32 [] (paged): free_pages[:num_free] are free
    page_size: int = dataclasses.field(default=0, metadata=dict(static=True))

    # ------------------------------------------------------------------ construction
    @classmethod
    def contiguous(cls, batch: int, max_len: int, kv_heads: int, head_dim: int,
                   dtype=jnp.float32, head_dim_v: int | None = None) -> "KVCache":
        """An empty cache of ``max_len`` positions per sequence (``[B, max_len, K, d]``)."""
        B, L = _positive("batch", batch), _positive("max_len", max_len)
        K, D = _positive("kv_heads", kv_heads), _positive("head_dim", head_dim)
        Dv = D if head_dim_v is None else _positive("head_dim_v", head_dim_v)
        return cls(jnp.zeros((B, L, K, D), dtype), jnp.zeros((B, L, K, Dv), dtype),
                   jnp.zeros((B,), jnp.int32), page_size=L)

    @classmethod
    def paged(cls, batch: int, num_pages: int, page_size: int, kv_heads: int, head_dim: int,
              pages_per_sequence: int | None = None, dtype=jnp.float32,
              head_dim_v: int | None = None) -> "KVCache":
        """An empty pool of ``num_pages`` pages of ``page_size`` positions, all free.

        ``pages_per_sequence`` (default: the whole pool) bounds one sequence's capacity at
        ``pages_per_sequence * page_size`` positions.
        """
        B, NP = _positive("batch", batch), _positive("num_pages", num_pages)
        ps, K = _positive("page_size", page_size), _positive("kv_heads", kv_heads)
        D = _positive("head_dim", head_dim)
        Dv = D if head_dim_v is None else _positive("head_dim_v", head_dim_v)
        P = NP if pages_per_sequence is None else _positive("pages_per_sequence",
                                                              pages_per_sequence)
        return cls(jnp.zeros((NP, ps, K, D), dtype), jnp.zeros((NP, ps, K, Dv), dtype),
                   jnp.zeros((B,), jnp.int32), page_table=jnp.full((B, P), -1, jnp.int32),
                   free_pages=jnp.arange(NP, dtype=jnp.int32)[::-1],   # page 0 on top
                   num_free=jnp.asarray(NP, jnp.int32), page_size=ps)

    # ------------------------------------------------------------------ facts
    @property
    def is_paged(self) -> bool:
        return self.page_table is not None

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    @property
    def capacity(self) -> int:
        """Positions one sequence can hold."""
        if self.is_paged:
            return self.page_table.shape[1] * self.page_size
        return self.k.shape[1]

    def _pages_for(self, lengths):
        return (lengths + self.page_size - 1) // self.page_size

    # ------------------------------------------------------------------ writing
    def append(self, k_new, v_new, active=None) -> "KVCache":
        """Write ``n`` new positions per sequence at its own length; returns the new cache.

        ``k_new`` ``[B, n, K, d]``, ``v_new`` ``[B, n, K, d_v]`` in the cache's dtype;
        ``active`` optional bool ``[B]`` (``False``: that sequence is left untouched).
        Sequence ``b`` gets positions ``lengths[b] .. lengths[b] + n - 1``; a paged cache
        first takes the pages those positions need from the free pool.
        """
        B, K, D, Dv = self.batch, self.k.shape[2], self.k.shape[3], self.v.shape[3]
        for name, x, d in (("k_new", k_new, D), ("v_new", v_new, Dv)):
            if not hasattr(x, "shape") or x.ndim != 4 or x.shape[0] != B or x.shape[2:] != (K, d):
                raise ValueError(f"{name}: expected shape [{B}, new_tokens, {K}, {d}], got "
                                 f"{getattr(x, 'shape', type(x).__name__)}")
            if jnp.dtype(x.dtype) != jnp.dtype(self.k.dtype):
                raise TypeError(f"{name}: expected dtype {jnp.dtype(self.k.dtype)} (the cache's),"
                                f" got {jnp.dtype(x.dtype)}")
        n = k_new.shape[1]
        if v_new.shape[1] != n:
            raise ValueError(f"v_new: expected {n} new tokens (k_new's), got shape {v_new.shape}")
        act = jnp.ones((B,), bool) if active is None else jnp.asarray(active, bool)
        if act.shape != (B,):
            raise ValueError(f"active: expected shape [{B}], got {act.shape}")
        step = jnp.where(act, n, 0).astype(jnp.int32)
        new_len = self.lengths + step
        if _concrete(new_len):
            over = np.flatnonzero(np.asarray(new_len) > self.capacity)
            if len(over):
                b = int(over[0])
                raise ValueError(
                    f"k_new: sequence {b} holds {int(self.lengths[b])} positions; {n} more "
                    f"exceed the cache capacity {self.capacity}")
        cache = self._allocate(new_len) if self.is_paged else self
        pos = self.lengths[:, None] + jnp.arange(n, dtype=jnp.int32)[None, :]     # [B, n]
        pos = jnp.where(act[:, None] & (pos < self.capacity), pos, self.capacity)  # drop
        if self.is_paged:
            P = self.page_table.shape[1]
            page = jnp.take_along_axis(cache.page_table, jnp.minimum(pos // self.page_size, P - 1),
                                       axis=1)
            NP = self.k.shape[0]
            page = jnp.where((pos < self.capacity) & (page >= 0), page, NP)       # drop
            slot = pos % self.page_size
            k = cache.k.at[page, slot].set(k_new, mode="drop")
            v = cache.v.at[page, slot].set(v_new, mode="drop")
        else:
            b = jnp.broadcast_to(jnp.arange(B)[:, None], pos.shape)
            k = self.k.at[b, pos].set(k_new, mode="drop")
            v = self.v.at[b, pos].set(v_new, mode="drop")
        return dataclasses.replace(cache, k=k, v=v, lengths=new_len)

    def _allocate(self, new_len) -> "KVCache":
        """Give every sequence the pages its positions ``< new_len`` need, from the pool."""
        have, need = self._pages_for(self.lengths), self._pages_for(new_len)
        P, NP = self.page_table.shape[1], self.k.shape[0]
        need = jnp.minimum(need, P)
        count = need - have                                           # [B] new pages each
        total = jnp.sum(count)
        if _concrete(total) and int(total) > int(self.num_free):
            raise ValueError(
                f"k_new: the batch needs {int(total)} new pages of {self.page_size} positions "
                f"but the pool has {int(self.num_free)} free of {NP}; release finished "
                f"sequences or build the cache with more num_pages")
        first = jnp.cumsum(count) - count                             # [B] exclusive offsets
        j = jnp.arange(P, dtype=jnp.int32)[None, :]                   # [1, P] table column
        take = (j >= have[:, None]) & (j < need[:, None])             # columns to fill
        k_th = first[:, None] + (j - have[:, None])                   # k-th page taken
        idx = self.num_free - 1 - k_th                                # pop from the top
        ids = jnp.where(idx >= 0, self.free_pages[jnp.clip(idx, 0, NP - 1)], NP)
        table = jnp.where(take, ids, self.page_table)
        return dataclasses.replace(self, page_table=table, num_free=self.num_free - total)

    def release(self, done) -> "KVCache":
        """Empty the sequences flagged in bool ``done [B]``; a paged cache frees their pages."""
        done = jnp.asarray(done, bool)
        if done.shape != (self.batch,):
            raise ValueError(f"done: expected shape [{self.batch}], got {done.shape}")
        lengths = jnp.where(done, 0, self.lengths)
        if not self.is_paged:
            return dataclasses.replace(self, lengths=lengths)
        P, NP = self.page_table.shape[1], self.k.shape[0]
        held = jnp.where(done, jnp.minimum(self._pages_for(self.lengths), P), 0)   # [B]
        j = jnp.arange(P, dtype=jnp.int32)[None, :]
        give = (j < held[:, None]).reshape(-1)                        # [B*P]
        at = self.num_free + jnp.cumsum(give) - 1                     # push onto the stack
        at = jnp.where(give, at, NP)                                  # others: dropped
        free = self.free_pages.at[at].set(self.page_table.reshape(-1), mode="drop")
        table = jnp.where(done[:, None], -1, self.page_table)
        return dataclasses.replace(self, lengths=lengths, page_table=table, free_pages=free,
                                   num_free=self.num_free + jnp.sum(held))

    # ------------------------------------------------------------------ reading
    def attend(self, query, **kwargs):
        """:func:`flashlab.decode_attention` of ``query [B, n, Hq, d]`` over this cache.

        The ``n`` new tokens must already be appended. ``kwargs``: ``scale``,
        ``local_window_size``, ``logits_soft_cap``, ``sinks``, ``backend``, ``interpret``.
        """
        from flashlab.serving.decode import decode_attention
        return decode_attention(query, self.k, self.v, cache_lengths=self.lengths,
                                page_table=self.page_table, **kwargs)
