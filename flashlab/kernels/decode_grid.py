"""The decode kernel's configuration and grid, as data (chapter 12).

:func:`make_decode_config` turns a validated :class:`~flashlab.contract.decode_validate.DecodeSpec`
into a static :class:`DecodeConfig` (G query heads x new tokens folded into one tile's rows,
pages per grid step, flash-decoding splits); :func:`page_schedule` precomputes the page walk
(each index map is then one load); :func:`decode_grid_spec` builds the exact grid and
BlockSpecs the ``pallas_call`` of :mod:`flashlab.kernels.decode` gets, which
:mod:`flashlab.instruments.decode_traffic` replays to count bytes.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flashlab.contract.decode_validate import DecodeSpec
from flashlab.compat import pallas as compat
from flashlab.kernels import blocks as blk
from flashlab.compat.pallas import pl
from flashlab.kernels.forward_grid import ForwardGridSpec


__all__ = ["BLOCK_POSITIONS", "DecodeConfig", "DecodeGridSpec", "PARALLEL_TARGET", "SPLIT_MIN_POSITIONS", "choose_num_splits", "choose_pages_per_block", "decode_grid_spec", "decode_vmem_bytes", "make_decode_config", "page_schedule", "visible_pages"]

# Flash-decoding: split the kv axis only when each split still walks at least this many
# positions, and only until batch * splits reaches PARALLEL_TARGET independent grid rows
# (2 TensorCores per chip on v4/v5p/7x, x2 so each core has two to overlap).
SPLIT_MIN_POSITIONS = 1024
PARALLEL_TARGET = 4
# Positions one grid step walks (pages_per_block x page_size): a step's chain (QK^T, max,
# exp, sum, PV) has a fixed latency, so small pages are grouped; capped by the VMEM budget.
BLOCK_POSITIONS = 512


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Every static fact the decode kernel is built from (hashable: a jit static argument)."""

    batch: int
    num_kv_heads: int
    group_size: int
    new_tokens: int
    rows: int                 # T*G rounded up to the sublane tile (8)
    head_dim: int
    head_dim_v: int
    page_size: int
    num_pages: int
    pages_per_sequence: int   # columns of the page table the caller gave
    num_splits: int
    pages_per_split: int
    dtype: Any
    scale: float
    window: int | None = None
    soft_cap: float | None = None
    pages_per_block: int = 1  # n: pages one grid step reads (n K and n V operands)

    @property
    def blocks_per_split(self) -> int:
        return self.pages_per_split // self.pages_per_block

    @property
    def grid(self) -> tuple[int, int, int]:
        return (self.batch, self.num_splits, self.blocks_per_split)

    @property
    def table_width(self) -> int:
        """Columns of the padded page table (``splits * pages_per_split``)."""
        return self.num_splits * self.pages_per_split


def choose_num_splits(batch: int, capacity: int) -> int:
    """Flash-decoding splits: enough to give ``PARALLEL_TARGET`` grid rows, each split at
    least ``SPLIT_MIN_POSITIONS`` long (1 for a big batch or a short cache)."""
    want = -(-PARALLEL_TARGET // batch)
    return int(max(1, min(want, capacity // SPLIT_MIN_POSITIONS)))


def choose_pages_per_block(page_size: int, pages_per_sequence: int, dtype) -> int:
    """Pages per grid step: ``BLOCK_POSITIONS // page_size`` (at least 1, at most the table);
    1 when a page is not a whole number of sublane tiles (8 rows, 16 in bf16), where stacking
    pages along sublanes would need a relayout."""
    if page_size % (blk.SUBLANES * max(1, 4 // jnp.dtype(dtype).itemsize)):
        return 1
    return int(max(1, min(BLOCK_POSITIONS // page_size, pages_per_sequence)))


def make_decode_config(spec: DecodeSpec, page_size: int, pages_per_sequence: int,
                       num_pages: int, *, num_splits: int | None = None,
                       pages_per_block: int | None = None) -> DecodeConfig:
    """The kernel's static configuration for a validated request over pages of ``page_size``.

    ``pages_per_block``: pages per grid step (default :func:`choose_pages_per_block`)."""
    if num_splits is None:
        num_splits = choose_num_splits(spec.batch, page_size * pages_per_sequence)
    if isinstance(num_splits, bool) or not isinstance(num_splits, (int, np.integer)) \
            or num_splits < 1:
        raise ValueError(f"num_splits: expected an int >= 1, got {num_splits!r}")
    num_splits = int(min(num_splits, pages_per_sequence))
    n = (choose_pages_per_block(page_size, pages_per_sequence, spec.dtype)
         if pages_per_block is None else pages_per_block)
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"pages_per_block: expected an int >= 1, got {n!r}")
    n = int(min(n, -(-pages_per_sequence // num_splits)))
    rows = blk.round_up(spec.new_tokens * spec.group_size, blk.SUBLANES)
    cfg = DecodeConfig(
        batch=spec.batch, num_kv_heads=spec.num_kv_heads, group_size=spec.group_size,
        new_tokens=spec.new_tokens, rows=rows, head_dim=spec.head_dim,
        head_dim_v=spec.head_dim_v, page_size=page_size, num_pages=num_pages,
        pages_per_sequence=pages_per_sequence, num_splits=num_splits,
        pages_per_split=blk.round_up(-(-pages_per_sequence // num_splits), n),
        dtype=jnp.dtype(spec.dtype), scale=spec.scale, window=spec.window,
        soft_cap=spec.soft_cap, pages_per_block=n)
    need, budget = decode_vmem_bytes(cfg), blk.vmem_budget_bytes()
    while need > budget and pages_per_block is None and cfg.pages_per_block > 1:
        n = cfg.pages_per_block // 2                  # fewer pages per step fit the budget
        cfg = dataclasses.replace(cfg, pages_per_block=n, pages_per_split=blk.round_up(
            -(-pages_per_sequence // num_splits), n))
        need = decode_vmem_bytes(cfg)
    if need > budget:
        raise ValueError(
            f"new_tokens: {spec.new_tokens} new tokens x {spec.group_size} query heads per kv "
            f"head x {spec.num_kv_heads} kv heads need ~{need / 2**20:.1f} MiB of VMEM in the "
            f"decode kernel (all rows stay resident), over the {budget / 2**20:.0f} MiB budget "
            f"of {blk.resolve_chip()}; feed the prefill in smaller chunks")
    return cfg


def decode_vmem_bytes(cfg: DecodeConfig) -> int:
    """VMEM the kernel plans: double-buffered q, K/V pages and state blocks, plus the scratch
    state (``(rows, lanes)`` tiles padded to whole sublanes and lanes)."""
    it = cfg.dtype.itemsize
    sub = blk.SUBLANES * max(1, 4 // it)
    lanes = lambda d: blk.round_up(d, blk.LANES)  # noqa: E731
    K, R, ps = cfg.num_kv_heads, cfg.rows, cfg.page_size
    q = K * R * lanes(cfg.head_dim) * it
    pages = (cfg.pages_per_block * blk.round_up(ps, sub)
             * (lanes(K * cfg.head_dim) + lanes(K * cfg.head_dim_v)) * it)
    state = K * R * (2 * blk.LANES + lanes(cfg.head_dim_v)) * 4
    return 2 * (q + pages + state) + state


def _div(a, b: int):
    """``a // b`` for ``a >= 0``: Python/NumPy ints as they are, traced values with ``lax.div``
    (truncating; ``//`` on a traced int lowers through ``sign``, which Mosaic lowers only
    with a TPU attached)."""
    if isinstance(a, (int, np.integer, np.ndarray)):
        return a // b
    return jax.lax.div(a, jnp.asarray(b, a.dtype))


def visible_pages(cfg: DecodeConfig, length):
    """``(first, last)`` logical pages sequence of ``length`` can see (ints, NumPy or traced).

    ``last = ceil(length / page_size) - 1`` (0 for an empty slot); ``first`` starts at the
    oldest key the first new token's window reaches.
    """
    host = isinstance(length, (int, np.integer, np.ndarray))
    mx, mn = (np.maximum, np.minimum) if host else (jnp.maximum, jnp.minimum)
    last = mx(_div(length + cfg.page_size - 1, cfg.page_size) - 1, 0)
    if cfg.window is None:
        return 0, last
    first = _div(mx(length - cfg.new_tokens - cfg.window, 0), cfg.page_size)
    return mn(first, last), last


def page_schedule(cfg: DecodeConfig, lengths, page_table):
    """The pool page every K/V operand reads at every grid step, flat ``[batch * splits *
    blocks_per_split * n]`` int32 (NumPy in, NumPy out; else ``jnp``): the index maps' data.

    Step ``(b, s, i)``, operand ``t < n`` reads logical page ``j = s * pages_per_split + i * n
    + t`` of sequence ``b``, ``page_table[b, j]``. A ``j`` outside the visible ``[first,
    last]`` is clamped to the nearest visible page of the same operand (``j`` plus a multiple
    of ``n``): the block index does not change, so nothing is copied. An operand with no
    visible page in a row ``(b, s)`` keeps the page it held at the end of the last row that
    had one (before any, it loads the page it will read in the next row that has one).
    Scalar-prefetched, so each index map is one SMEM load (computing the clamps in the index
    maps cost ~100 scalar cycles per operand and step on v6e: ``bench decode-static``).
    """
    xp = np if isinstance(lengths, np.ndarray) else jnp
    n, S, bps, pps = cfg.pages_per_block, cfg.num_splits, cfg.blocks_per_split, \
        cfg.pages_per_split
    B = cfg.batch
    table = xp.pad(xp.asarray(page_table, xp.int32),
                   ((0, 0), (0, cfg.table_width - page_table.shape[1])))
    first, last = visible_pages(cfg, lengths.astype(xp.int32)[:, None, None, None])
    s = xp.arange(S)[None, :, None, None]
    i = xp.arange(bps)[None, None, :, None]
    base = s * pps + xp.arange(n)[None, None, None, :]                  # [1, S, 1, n]
    i_max = xp.minimum(xp.maximum(last - base, 0) // n, bps - 1)        # [B, S, 1, n]
    i_min = (xp.maximum(first - base, 0) + n - 1) // n
    ok = (last >= base) & (i_min <= i_max)                              # operand has a page
    j = base + xp.clip(i, i_min, i_max) * n                             # [B, S, bps, n]
    row = xp.arange(B)[:, None, None, None]
    pages = table[xp.broadcast_to(row, j.shape), xp.where(ok, j, last)]
    # rows (b, s) in grid order; an operand without a page holds the last row's with one
    ok_r = ok[:, :, 0, :].reshape(B * S, n)
    held = pages[:, :, -1, :].reshape(B * S, n)
    r = xp.arange(B * S)[:, None]
    src = xp.where(ok_r, r, -1)
    src = np.maximum.accumulate(src, axis=0) if xp is np else jax.lax.cummax(src, axis=0)
    prev = xp.concatenate([xp.full((1, n), -1, src.dtype), src[:-1]], axis=0)
    # ... and before the first such row, already the page it will read there (a prefetch)
    nxt = xp.where(ok_r, r, B * S)[::-1]
    nxt = (np.minimum.accumulate(nxt, axis=0) if xp is np else jax.lax.cummin(nxt, axis=0))[::-1]
    cols = xp.arange(n)[None, :]
    fill = xp.where(prev >= 0, held[xp.maximum(prev, 0), cols],
                    pages[:, :, 0, :].reshape(B * S, n)[xp.minimum(nxt, B * S - 1), cols])
    keep = ~ok_r & ((prev >= 0) | (nxt < B * S))
    pages = xp.where(keep.reshape(B, S, 1, n), fill.reshape(B, S, 1, n), pages)
    return pages.astype(xp.int32).reshape(-1)


@dataclasses.dataclass(frozen=True)
class DecodeGridSpec(ForwardGridSpec):
    """The decode kernel's grid and BlockSpecs, exactly the objects ``pallas_call`` gets.

    The forward kernel's container (:class:`flashlab.kernels.forward_grid.ForwardGridSpec`) with
    ``config`` a :class:`DecodeConfig` and grid ``(batch, splits, blocks_per_split)``; inputs
    ``q``, then ``n`` K pages (``k``, ``k1``, ...) and ``n`` V pages (``v``, ``v1``, ...). Every
    ``index_map`` is ``(b, s, i, lengths, pages) -> block index`` and also runs on ints and
    NumPy arrays, so :mod:`flashlab.instruments.traffic` replays it to count the bytes moved.
    ``pages`` is :func:`page_schedule`, flat (SMEM pads 2-D arrays).
    """

    dimension_semantics: tuple[str, ...] = ("parallel", "parallel", "arbitrary")
    bounds_checks: bool = True     # the page table is the caller's: keep Mosaic's DMA checks

    def vmem_need(self) -> None:
        """``None``: the chip's ceiling, since :func:`decode_vmem_bytes` counts no spill slots
        (it is held to half the VMEM instead, :func:`blocks.vmem_budget_bytes`)."""
        return None


def decode_grid_spec(cfg: DecodeConfig) -> DecodeGridSpec:
    """Build the grid, BlockSpecs (with the page-walking index maps) and scratch."""
    K, R, D, Dv, ps = cfg.num_kv_heads, cfg.rows, cfg.head_dim, cfg.head_dim_v, cfg.page_size

    def q_map(b, s, i, lengths, table):
        return (b, 0, 0, 0)

    n = cfg.pages_per_block

    S, bps = cfg.num_splits, cfg.blocks_per_split

    def page_map(t):
        def index_map(b, s, i, lengths, pages):  # the page walk, as data (page_schedule)
            return (pages[((b * S + s) * bps + i) * n + t], 0, 0)
        return index_map

    def state_map(b, s, i, lengths, table):
        return (b, s, 0, 0, 0)

    f32 = jnp.float32
    # Pages as [page, position, kv_head * d] (a free reshape of the pool): kv head h is the
    # lane slice h*d:(h+1)*d, so a page block is dense in VMEM. As [page, position, kv_head,
    # d] the K kv heads would sit on sublanes, padded to a whole sublane tile (8 rows, 16 in
    # bf16) per position, and each head's [ps, d] slice a strided gather.
    in_specs = (pl.BlockSpec((None, K, R, D), q_map),
                *[pl.BlockSpec((None, ps, K * D), page_map(t)) for t in range(n)],
                *[pl.BlockSpec((None, ps, K * Dv), page_map(t)) for t in range(n)])
    in_shapes = (jax.ShapeDtypeStruct((cfg.batch, K, R, D), cfg.dtype),
                 *[jax.ShapeDtypeStruct((cfg.num_pages, ps, K * D), cfg.dtype)] * n,
                 *[jax.ShapeDtypeStruct((cfg.num_pages, ps, K * Dv), cfg.dtype)] * n)
    in_names = ("q", *(f"k{t or ''}" for t in range(n)), *(f"v{t or ''}" for t in range(n)))
    S = cfg.num_splits
    out_specs = (pl.BlockSpec((None, None, K, R, blk.LANES), state_map),
                 pl.BlockSpec((None, None, K, R, blk.LANES), state_map),
                 pl.BlockSpec((None, None, K, R, Dv), state_map))
    out_shapes = (jax.ShapeDtypeStruct((cfg.batch, S, K, R, blk.LANES), f32),
                  jax.ShapeDtypeStruct((cfg.batch, S, K, R, blk.LANES), f32),
                  jax.ShapeDtypeStruct((cfg.batch, S, K, R, Dv), f32))
    scratch = (compat.VMEM((K, R, blk.LANES), f32), compat.VMEM((K, R, blk.LANES), f32),
               compat.VMEM((K, R, Dv), f32))
    return DecodeGridSpec(cfg, cfg.grid, in_names, in_specs, in_shapes,
                          ("m", "l", "acc"), out_specs, out_shapes, scratch,
                          prefetch_names=("lengths", "pages"),
                          scratch_names=("m_scratch", "l_scratch", "acc_scratch"))
