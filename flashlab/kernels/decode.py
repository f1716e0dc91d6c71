"""The Pallas TPU decode kernel: a few new tokens against a paged KV cache.

Grid ``(batch, splits, blocks_per_split)``. Step ``(b, s, i)`` reads the ``n =
pages_per_block`` logical pages ``j = s * pages_per_split + i * n + t`` (``t < n``) of
sequence ``b``: each of them is its own K and V operand whose blocks are whole pages
``[page_size, kv_heads * d]`` of the pool, and their **index maps walk the page table**, which
is scalar-prefetched into SMEM with the lengths, so the pipeline DMAs the pages straight from
the pool: no gather is materialised in HBM. A page outside the range the sequence can see
(past its length, or before its window) is clamped to the page that operand holds in a visible
block: the block index does not change, so the pipeline copies nothing, the positions mask it
out, and ``pl.when`` skips a block with no visible page. Several pages per step (``n x
page_size`` ~ :data:`BLOCK_POSITIONS` positions) because one step's softmax chain costs the
same latency for 16 positions as for 128 (the static schedule of ``bench decode-static``).

**Head folding.** The ``G`` query heads of a kv head, times the ``new_tokens``, are the rows
of one query tile ``[T*G, d]`` (:func:`flashlab.ladder.decode.fold_heads`), so one K/V page serves
all of them: every byte of the visible cache is read once per step, not once per query head.

**Split-K (flash-decoding).** A long cache with a small batch leaves most of a chip idle if
one grid row walks it alone, so the kv axis is cut into ``splits`` ("parallel") ranges; each
emits its partial state ``(m, l, acc)``, and :func:`flashlab.ladder.online_softmax.merge` (the one
merge of every rung) combines them, together with the sinks' state, outside the kernel.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flashlab.contract import masks
from flashlab.ladder import online_softmax
from flashlab.contract.decode_validate import DecodeSpec
from flashlab.compat import pallas as compat
from flashlab.ladder.decode import fold_heads, paged_view, sink_state, unfold_heads
from flashlab.kernels import blocks as blk
from flashlab.compat.pallas import pl
from flashlab.kernels.forward_grid import ForwardGridSpec

__all__ = ["DecodeConfig", "DecodeGridSpec", "page_schedule", "make_decode_config", "decode_grid_spec",
           "pallas_decode", "decode_call", "choose_num_splits", "SPLIT_MIN_POSITIONS",
           "decode_vmem_bytes",
           "choose_pages_per_block", "BLOCK_POSITIONS"]

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
                          ("m", "l", "acc"), out_specs, out_shapes, scratch)


def _decode_kernel(lengths_ref, pages_ref, q_ref, *refs, cfg: DecodeConfig):
    """Step ``(b, s, i)``: fold logical pages ``j0 .. j0 + n - 1`` into every kv head's
    (m, l, acc). ``refs``: n K pages, n V pages, the (m, l, acc) outputs, their scratch."""
    n = cfg.pages_per_block
    k_refs, v_refs = refs[:n], refs[n:2 * n]
    m_out, l_out, acc_out, m_ref, l_ref, acc_ref = refs[2 * n:]
    b, s, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    R, ps = cfg.rows, cfg.page_size
    length = lengths_ref[b]
    j0 = s * cfg.pages_per_split + i * n

    @pl.when(i == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, online_softmax.NEG_INF, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    first, last = visible_pages(cfg, length)
    run = (j0 + n - 1 >= first) & (j0 <= last) & (length > 0)

    @pl.when(run)
    def _compute():
        # row r is new token r // G (rows past T*G are padding: they see what token T-1 sees)
        t = jnp.minimum(_div(jax.lax.broadcasted_iota(jnp.int32, (R, n * ps), 0),
                             cfg.group_size), cfg.new_tokens - 1)
        q_pos = length - cfg.new_tokens + t
        # logical positions: a clamped operand holds another page, and these mask it out
        k_pos = j0 * ps + jax.lax.broadcasted_iota(jnp.int32, (R, n * ps), 1)
        window = None if cfg.window is None else (cfg.window, None)
        visible = masks.structural_visible(q_pos, k_pos, is_causal=True, window=window,
                                           kv_len=length)
        D, Dv = cfg.head_dim, cfg.head_dim_v
        stack = lambda refs, h, d: (refs[0][:, h * d:(h + 1) * d] if n == 1  # noqa: E731
                                    else jnp.concatenate([r[:, h * d:(h + 1) * d]
                                                          for r in refs], axis=0))
        for h in range(cfg.num_kv_heads):          # static: one page serves all G heads
            k = stack(k_refs, h, D)                                   # [n*ps, d]
            sc = jax.lax.dot_general(q_ref[h], k, (((1,), (1,)), ((), ())),
                                     preferred_element_type=jnp.float32) * cfg.scale
            if cfg.soft_cap is not None:
                sc = cfg.soft_cap * jnp.tanh(sc / cfg.soft_cap)
            state = online_softmax.State(jnp.max(m_ref[h], axis=-1),
                                         jnp.max(l_ref[h], axis=-1), acc_ref[h])
            m, l, acc = online_softmax.update(state, sc, stack(v_refs, h, Dv),
                                              visible=visible)
            m_ref[h] = jnp.broadcast_to(m[:, None], (R, blk.LANES))
            l_ref[h] = jnp.broadcast_to(l[:, None], (R, blk.LANES))
            acc_ref[h] = acc

    @pl.when(i == cfg.blocks_per_split - 1)
    def _emit():                                   # this split's partial state
        m_out[...] = m_ref[...]
        l_out[...] = l_ref[...]
        acc_out[...] = acc_ref[...]


def _cost_estimate(cfg: DecodeConfig) -> Any:
    """Upper bounds (full capacity): FLOPs, exps and bytes of one call."""
    K, R, ps = cfg.num_kv_heads, cfg.rows, cfg.page_size
    pages = cfg.batch * cfg.pages_per_sequence
    it = cfg.dtype.itemsize
    flops = 2 * pages * K * R * ps * (cfg.head_dim + cfg.head_dim_v)
    read = pages * ps * K * (cfg.head_dim + cfg.head_dim_v) * it + cfg.batch * K * R * cfg.head_dim * it
    written = cfg.batch * cfg.num_splits * K * R * (2 * blk.LANES + cfg.head_dim_v) * 4
    return compat.CostEstimate(flops=int(flops), transcendentals=int(pages * K * R * ps),
                               bytes_accessed=int(read + written))


def decode_call(cfg: DecodeConfig, interpret=False):
    """The ``pallas_call`` of the decode kernel for ``cfg``:
    ``f(lengths [B], pages (:func:`page_schedule`), q [B, K, R, d], *k_pages, *v_pages) ->
    (m, l, acc)``: the pool ``[P, ps, K*d]`` (kv heads and d merged: a free reshape) ``n =
    pages_per_block`` times each for K and V.

    What ``bench tpu-static`` and the compile matrix lower for given shapes.
    """
    gs = decode_grid_spec(cfg)
    return pl.pallas_call(
        functools.partial(_decode_kernel, cfg=cfg),
        grid_spec=gs.pallas_grid_spec(),
        out_shape=list(gs.out_shapes),
        compiler_params=compat.CompilerParams(dimension_semantics=gs.dimension_semantics,
                                              **({"vmem_limit_bytes": blk.vmem_limit_bytes()}
                                                 if interpret is False else {})),
        cost_estimate=_cost_estimate(cfg),
        interpret=interpret,
        name="flashlab_decode",
    )


def prepare(cfg: DecodeConfig, query, table, spec: DecodeSpec):
    """Public operands -> the kernel's: folded, row-padded q and the page schedule."""
    q = fold_heads(query, spec)
    q = jnp.pad(q, ((0, 0), (0, 0), (0, cfg.rows - q.shape[2]), (0, 0)))
    return q, page_schedule(cfg, spec.lengths, table)


@functools.partial(jax.jit, static_argnames=("cfg", "interpret"))
def _decode(query, k_pages, v_pages, table, spec, *, cfg: DecodeConfig, interpret):
    q, flat = prepare(cfg, query, table, spec)
    lane_dense = lambda p: p.reshape(p.shape[0], p.shape[1], -1)  # noqa: E731 - [P, ps, K*d]
    n = cfg.pages_per_block                 # the same pool is each of the n page operands
    m, l, acc = decode_call(cfg, interpret)(spec.lengths, flat, q, *[lane_dense(k_pages)] * n,
                                            *[lane_dense(v_pages)] * n)
    TG = cfg.new_tokens * cfg.group_size
    parts = [online_softmax.State(m[:, s, :, :TG, 0], l[:, s, :, :TG, 0], acc[:, s, :, :TG])
             for s in range(cfg.num_splits)]                         # [B, K, T*G(, dv)]
    if spec.sinks is not None:
        parts.append(sink_state(spec, cfg.head_dim_v))
    out, _ = online_softmax.finalize(functools.reduce(online_softmax.merge, parts))
    return unfold_heads(out, spec).astype(query.dtype)


def pallas_decode(query, k_cache, v_cache, spec: DecodeSpec, *, interpret=None,
                  num_splits: int | None = None, block_k: int = 512,
                  pages_per_block: int | None = None):
    """The decode kernel on validated inputs (what the decode registry calls).

    A contiguous cache runs as pages of up to ``block_k`` positions (a free reshape).
    ``num_splits``: flash-decoding splits of the kv axis (default :func:`choose_num_splits`);
    ``pages_per_block``: pages per grid step (default :func:`choose_pages_per_block`).
    """
    from flashlab.kernels.forward import _resolve_interpret
    if jnp.dtype(spec.dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise TypeError(f"query: the pallas_tpu decode kernel takes float32 or bfloat16, got "
                        f"{jnp.dtype(spec.dtype)}")
    kp, vp, table, ps = paged_view(k_cache, v_cache, spec, block_k)
    cfg = make_decode_config(spec, ps, table.shape[1], kp.shape[0], num_splits=num_splits,
                             pages_per_block=pages_per_block)
    return _decode(query, kp, vp, table, spec, cfg=cfg, interpret=_resolve_interpret(interpret))
