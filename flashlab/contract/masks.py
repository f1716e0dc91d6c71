"""One attention request, validated once: shapes, dtypes and one mask description.

Every rung (reference, tiled, the Pallas kernels, ring attention) consumes the
:class:`AttentionSpec` built here, so there is exactly one place that decides
what "visible" means and exactly one place that rejects bad input.

Semantics (those of ``jax.nn.dot_product_attention`` plus flashlab's extras):

* layout ``[batch, seq, heads, head_dim]`` for query, key and value;
* ``logits = scale * q·k`` (default ``scale = 1/sqrt(head_dim)``), then the soft cap
  ``c * tanh(logits / c)``, then ``+ bias``, then the masks;
* query ``i`` may see key ``j`` only if every mask agrees:
  ``mask[b, h, i, j]`` (True = visible), ``j <= i`` when causal (top-left aligned, as
  ``jnp.tril``), ``i - left <= j <= i + right`` for ``local_window_size=(left, right)``,
  ``i < query_seq_lengths[b]`` and ``j < key_value_seq_lengths[b]``, and equal segment ids;
* GQA/MQA: query head ``h`` reads kv head ``h // (Hq // Hk)``;
* a query row with no visible key returns zeros, and its gradients are zeros;
* ``sinks`` ``[Hq]`` (optional, as in gpt-oss): a per-head logit that joins every row's
  softmax denominator and takes no value, ``O_i = sum_j exp(s_ij) v_j / (exp(sink_h) +
  sum_j exp(s_ij))``. A row with no visible key still returns zeros (the sink takes all the
  weight and carries no value), with zero gradients for its q, k, v.
* a row whose visible logits hold a NaN (NaN inputs, a ``+inf`` key) is NaN, as in jax.nn.

Broadcasting and value rules (:func:`validate`; the same for every backend):

* ``bias``/``mask`` of rank <= 4 get leading 1s (as ``jax.nn.dot_product_attention``) and
  each dim must be 1 or full: ``[B|1, N|1, T|1, S|1]``. Every dim of 1 stays 1 in the spec:
  the padding mask ``[B, 1, 1, S]`` is kept as it is, never ``[B, N, T, S]``. Every backend
  reads that broadcast form (reference/xla by array broadcasting, ``tiled`` by tiles of 1
  on that dim, the Pallas kernels by a block of 1 whose index map stays at 0). An integer or
  bool bias becomes float. The bias gradient has the bias's own shape (summed over its
  broadcast dims); the Pallas backward, only when that gradient is requested, broadcasts a
  bias's T or S dim of 1 to full length for its backward kernels (``[B|1, N|1, T, S]``).
* lengths: concrete values outside ``[0, dim]`` raise; *traced* values (under ``jit``) are
  clamped to ``[0, dim]``, which is what every backend's masks do with them anyway.
* ``local_window_size`` sides larger than ``WINDOW_CAP`` (2**30) are clamped to it: the same
  visibility for any position below 2**30, and no int32 overflow inside ``jit``.
* segment ids: only equality matters; int64/uint64 ids are mapped to int32 ranks exactly
  (ids 0 and 2**32 stay distinct), uint32 ids are reinterpreted bit-for-bit.
* an explicit ``scale`` (Python number, NumPy/JAX scalar, traced) is applied to the query
  (``query * scale``) and the spec keeps ``scale = 1``: ``scale·(q·k) = (scale·q)·k``, it
  is data (no recompile per value, a learnable temperature gets its gradient through the
  multiply). Exception: a Python-number scale with float16/bfloat16 inputs stays static,
  as the rounding of ``scale·q`` in 16 bits would cost precision.
* offsets (``q_offset``, ``kv_offset``): the query and key blocks sit at global positions
  ``q_offset + i`` and ``kv_offset + j`` of a longer sequence (a block of ring attention);
  causal, window and lengths are evaluated at those global positions (lengths are then
  *global* valid lengths), segment ids are those of the local tokens. ``None`` means 0.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from flashlab.contract import checks
from flashlab.contract.checks import WINDOW_CAP

__all__ = ["AttentionSpec", "validate", "structural_visible", "block_maybe_visible",
           "block_fully_visible", "WINDOW_CAP"]



@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """A validated attention request: static facts plus the mask/bias arrays.

    Array fields (pytree leaves, may be ``None``)::

      bias            float  [B or 1, Hq or 1, Tq or 1, Tk or 1]
      mask            bool   [B or 1, Hq or 1, Tq or 1, Tk or 1]   True = visible
      q_lengths       int32  [B]      valid query tokens per batch row
      kv_lengths      int32  [B]      valid key tokens per batch row
      q_segment_ids   int32  [B, Tq]
      kv_segment_ids  int32  [B, Tk]
      sinks           float32 [Hq]    per-head sink logit (joins the denominator, no value)
      q_offset        int32  []       global position of query 0 (static int or traced)
      kv_offset       int32  []       global position of key 0

    Static fields: shapes, dtype, ``scale``, ``is_causal``, ``window`` (left, right) and
    ``soft_cap``. ``window`` sides may be ``None`` meaning unbounded on that side.
    """

    batch: int = dataclasses.field(metadata=dict(static=True))
    q_len: int = dataclasses.field(metadata=dict(static=True))
    kv_len: int = dataclasses.field(metadata=dict(static=True))
    num_heads: int = dataclasses.field(metadata=dict(static=True))
    num_kv_heads: int = dataclasses.field(metadata=dict(static=True))
    head_dim: int = dataclasses.field(metadata=dict(static=True))
    head_dim_v: int = dataclasses.field(metadata=dict(static=True))
    dtype: Any = dataclasses.field(metadata=dict(static=True))
    scale: float = dataclasses.field(metadata=dict(static=True))
    is_causal: bool = dataclasses.field(metadata=dict(static=True))
    window: tuple[int | None, int | None] | None = dataclasses.field(metadata=dict(static=True))
    soft_cap: float | None = dataclasses.field(metadata=dict(static=True))
    bias: jax.Array | None = None
    mask: jax.Array | None = None
    q_lengths: jax.Array | None = None
    kv_lengths: jax.Array | None = None
    q_segment_ids: jax.Array | None = None
    kv_segment_ids: jax.Array | None = None
    sinks: jax.Array | None = None
    q_offset: jax.Array | None = None
    kv_offset: jax.Array | None = None

    @property
    def group_size(self) -> int:
        """Query heads per kv head (1 for MHA, Hq for MQA)."""
        return self.num_heads // self.num_kv_heads

    @property
    def has_structural_mask(self) -> bool:
        """True when causal/window/lengths/segments restrict visibility."""
        return (self.is_causal or self.window is not None or self.q_lengths is not None
                or self.kv_lengths is not None or self.q_segment_ids is not None)

    def features(self) -> set[str]:
        """Names of the optional features this request uses (for backend capability checks)."""
        f = set()
        if self.bias is not None:
            f.add("bias")
        if self.mask is not None:
            f.add("mask")
        if self.is_causal:
            f.add("causal")
        if self.window is not None:
            f.add("local_window")
        if self.q_lengths is not None or self.kv_lengths is not None:
            f.add("seq_lengths")
        if self.q_segment_ids is not None:
            f.add("segment_ids")
        if self.soft_cap is not None:
            f.add("soft_cap")
        if self.num_kv_heads != self.num_heads:
            f.add("gqa")
        if self.q_len != self.kv_len:
            f.add("cross_attention")
        if self.sinks is not None:
            f.add("sinks")
        if self.has_offsets:
            f.add("offsets")
        return f

    @property
    def has_offsets(self) -> bool:
        """True when the blocks sit at global positions (``q_offset``/``kv_offset`` given)."""
        return self.q_offset is not None or self.kv_offset is not None

    def offsets(self):
        """``(q_offset, kv_offset)`` as int32 scalars (0 where not given); may be traced."""
        zero = jnp.zeros((), jnp.int32)
        return (zero if self.q_offset is None else jnp.asarray(self.q_offset, jnp.int32),
                zero if self.kv_offset is None else jnp.asarray(self.kv_offset, jnp.int32))

    def local_lengths(self):
        """Valid query/key lengths *of this block* ``([B], [B])`` int32, or ``None`` each.

        With offsets the spec's lengths are global; here they become counts of valid local
        tokens, ``clip(length - offset, 0, local length)``, which is what a backend that
        works in local coordinates needs (kernels, tiled). Without offsets: the lengths.
        """
        if not self.has_offsets:
            return self.q_lengths, self.kv_lengths
        qo, ko = self.offsets()
        loc = lambda n, o, L: None if n is None else jnp.clip(n - o, 0, L).astype(jnp.int32)  # noqa: E731
        return loc(self.q_lengths, qo, self.q_len), loc(self.kv_lengths, ko, self.kv_len)

    def dense_visible(self):
        """Everything that restricts visibility, as one dense bool array ``[B|1, H|1, Tq, Tk]``.

        Combines the structural masks (:meth:`visible` at every position) with the dense
        ``mask``. The batch dimension is 1 when nothing depends on the batch row, the head
        dimension is 1 unless the dense mask is per head. For adapters of backends that take
        a dense mask (and to find the rows with no visible key: ``dense_visible().any(-1)``).
        """
        vis = self.visible(jnp.arange(self.q_len)[:, None], jnp.arange(self.kv_len)[None, :])
        vis = jnp.broadcast_to(vis, (*(1,) * (4 - vis.ndim), *vis.shape))  # [B|1, 1, Tq, Tk]
        if self.mask is not None:
            vis = vis & self.mask
        return vis

    def visible(self, q_pos, k_pos, batch_index=None):
        """Structural visibility (everything except the dense ``mask``) at given positions.

        ``q_pos``: int array broadcastable to ``[..., Tq', 1]``; ``k_pos`` to ``[..., 1, Tk']``:
        *local* positions (indices into this block), shifted by the offsets here.
        ``batch_index`` selects rows of the length/segment arrays (``None`` = all batch rows,
        which then lead the result: ``[B, 1, Tq', Tk']``).
        """
        q_len = kv_len = q_seg = kv_seg = None
        take = (lambda a: a) if batch_index is None else (lambda a: a[batch_index])
        if self.q_lengths is not None:
            q_len = take(self.q_lengths)
        if self.kv_lengths is not None:
            kv_len = take(self.kv_lengths)
        if self.q_segment_ids is not None:
            q_seg = take(self.q_segment_ids)
            kv_seg = take(self.kv_segment_ids)
        if batch_index is None:
            # Give lengths shape [B, 1, 1, 1] and segment ids [B, 1, T, 1] / [B, 1, 1, S].
            q_len = None if q_len is None else q_len[:, None, None, None]
            kv_len = None if kv_len is None else kv_len[:, None, None, None]
            if q_seg is not None:
                q_seg = jnp.take(q_seg, q_pos[..., :, 0], axis=1)[:, None, :, None]
                kv_seg = jnp.take(kv_seg, k_pos[..., 0, :], axis=1)[:, None, None, :]
        elif q_seg is not None:
            q_seg = jnp.take(q_seg, q_pos[..., :, 0], axis=-1)[..., :, None]
            kv_seg = jnp.take(kv_seg, k_pos[..., 0, :], axis=-1)[..., None, :]
        if self.has_offsets:   # local positions -> global (segment ids were read locally)
            q_off, kv_off = self.offsets()
            q_pos, k_pos = q_pos + q_off, k_pos + kv_off
        return structural_visible(q_pos, k_pos, is_causal=self.is_causal, window=self.window,
                                  q_len=q_len, kv_len=kv_len, q_seg=q_seg, kv_seg=kv_seg)


def structural_visible(q_pos, k_pos, *, is_causal=False, window=None, q_len=None, kv_len=None,
                       q_seg=None, kv_seg=None):
    """The one definition of visibility, elementwise over broadcastable position arrays.

    ``q_pos`` ``[..., Tq, 1]`` and ``k_pos`` ``[..., 1, Tk]`` are absolute token positions;
    ``q_len``/``kv_len`` broadcast against them; ``q_seg`` ``[..., Tq, 1]`` and ``kv_seg``
    ``[..., 1, Tk]`` are the segment ids at those positions. Returns bool ``[..., Tq, Tk]``.
    Works on jnp arrays, inside jit, and inside Pallas kernels.
    """
    vis = jnp.ones(jnp.broadcast_shapes(jnp.shape(q_pos), jnp.shape(k_pos)), dtype=bool)
    if is_causal:
        vis = vis & (k_pos <= q_pos)
    if window is not None:
        left, right = window
        if left is not None:
            vis = vis & (k_pos >= q_pos - left)
        if right is not None:
            vis = vis & (k_pos <= q_pos + right)
    if q_len is not None:
        vis = vis & (q_pos < q_len)
    if kv_len is not None:
        vis = vis & (k_pos < kv_len)
    if q_seg is not None:
        vis = vis & (q_seg == kv_seg)
    return vis


def block_maybe_visible(q_start, q_stop, k_start, k_stop, *, is_causal=False, window=None):
    """Whether any key in ``[k_start, k_stop)`` may be visible from a query in ``[q_start,
    q_stop)``.

    Conservative: uses only the causal and window masks (the ones known from positions
    alone), so a ``False`` here is a block that can be skipped with neither compute nor DMA.
    Works on Python ints and on traced int32 scalars (grid indices inside index maps).
    """
    ok = True
    if is_causal:
        ok = _and(ok, k_start <= q_stop - 1)
    if window is not None:
        left, right = window
        if left is not None:
            ok = _and(ok, k_stop - 1 >= q_start - left)
        if right is not None:
            ok = _and(ok, k_start <= q_stop - 1 + right)
    return ok


def block_fully_visible(q_start, q_stop, k_start, k_stop, *, is_causal=False, window=None):
    """Whether every key in ``[k_start, k_stop)`` is visible from every query in ``[q_start,
    q_stop)`` by the causal and window masks: the block's corners pass
    :func:`structural_visible` (its last key from its first query, the window's left edge from
    its last query). Lengths, segment ids and masks are the caller's to add. Python ints or
    traced int32 scalars, as :func:`block_maybe_visible`.
    """
    ok = True
    if is_causal:
        ok = _and(ok, k_stop - 1 <= q_start)
    if window is not None:
        left, right = window
        if left is not None:
            ok = _and(ok, k_start >= q_stop - 1 - left)
        if right is not None:
            ok = _and(ok, k_stop - 1 <= q_start + right)
    return ok


def _and(a, b):
    if isinstance(a, bool) and isinstance(b, bool):
        return a and b
    if isinstance(a, bool):
        return b if a else False
    return jnp.logical_and(a, b)


# ----------------------------------------------------------------------------- validation

def validate(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
             query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
             segment_ids=None, logits_soft_cap=None, sinks=None, allow_empty=False,
             q_offset=None, kv_offset=None):
    """Check every argument once and return ``(query, key, value, spec)``.

    ``q_offset``/``kv_offset`` (int >= 0 or a traced int32 scalar; default none): the global
    position of the first query/key of this block; lengths are then global valid lengths
    (checked to be >= 0 only: the sequence may go on past this block).

    Raises ``TypeError``/``ValueError`` naming the argument, the value given and what was
    expected. Mask and bias broadcast exactly as in ``jax.nn.dot_product_attention`` (see
    the module docstring) and nothing else is broadcast. ``allow_empty``: batch, q_seq and
    kv_seq may be 0 (:func:`flashlab.attention` then returns an empty/zero result).
    """
    query, key, value = (checks.as_array(n, x) for n, x in
                         (("query", query), ("key", key), ("value", value)))
    checks.qkv(query, key, value, allow_empty)
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    B, T, N, H = query.shape
    _, S, K, _ = key.shape
    acc = jnp.promote_types(query.dtype, jnp.float32)
    if bias is not None:
        bias = checks.bias_or_mask("bias", bias, B, N, T, S, "bias", acc)
    if mask is not None:
        mask = checks.bias_or_mask("mask", mask, B, N, T, S, "mask")
    is_causal = checks.is_causal(is_causal)
    query, scale = checks.scale(scale, query)
    logits_soft_cap = checks.soft_cap(logits_soft_cap)
    window = checks.window(local_window_size)
    q_off = checks.offset("q_offset", q_offset)
    kv_off = checks.offset("kv_offset", kv_offset)
    # With an offset the lengths are global: the sequence may go on past this block.
    q_limit = T if q_off is None else None
    kv_limit = S if kv_off is None else None
    q_lengths = checks.lengths("query_seq_lengths", query_seq_lengths, B, q_limit)
    kv_lengths = checks.lengths("key_value_seq_lengths", key_value_seq_lengths, B, kv_limit)
    q_seg, kv_seg = checks.segments(segment_ids, B, T, S)
    sinks = checks.sinks(sinks, N)
    spec = AttentionSpec(
        batch=B, q_len=T, kv_len=S, num_heads=N, num_kv_heads=K, head_dim=H,
        head_dim_v=value.shape[3], dtype=jnp.dtype(query.dtype), scale=float(scale),
        is_causal=bool(is_causal), window=window, soft_cap=logits_soft_cap, bias=bias,
        mask=mask, q_lengths=q_lengths, kv_lengths=kv_lengths, q_segment_ids=q_seg,
        kv_segment_ids=kv_seg, sinks=sinks, q_offset=q_off, kv_offset=kv_off)
    return query, key, value, spec
