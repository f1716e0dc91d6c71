"""The Pallas TPU decode kernel: a few new tokens against a paged KV cache.

Grid ``(batch, splits, pages_per_split)``. Step ``(b, s, i)`` reads logical page
``j = s * pages_per_split + i`` of sequence ``b``: its K and V blocks are whole pages
``[page_size, kv_heads, d]`` of the pool, and their **index maps walk the page table**, which
is scalar-prefetched into SMEM with the lengths, so the pipeline DMAs the pages straight from
the pool: no gather is materialised in HBM. A page outside the range the sequence can see
(past its length, or before its window) is clamped to the nearest visible one: the block index
does not change, so the pipeline copies nothing, and ``pl.when`` skips the compute.

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
from flashlab.kernels.forward import ForwardGridSpec

__all__ = ["DecodeConfig", "DecodeGridSpec", "make_decode_config", "decode_grid_spec",
           "pallas_decode", "decode_call", "choose_num_splits", "SPLIT_MIN_POSITIONS",
           "decode_vmem_bytes"]

# Flash-decoding: split the kv axis only when each split still walks at least this many
# positions, and only until batch * splits reaches PARALLEL_TARGET independent grid rows
# (2 TensorCores per chip on v4/v5p/7x, x2 so each core has two to overlap).
SPLIT_MIN_POSITIONS = 1024
PARALLEL_TARGET = 4


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

    @property
    def grid(self) -> tuple[int, int, int]:
        return (self.batch, self.num_splits, self.pages_per_split)

    @property
    def table_width(self) -> int:
        """Columns of the padded page table (``splits * pages_per_split``)."""
        return self.num_splits * self.pages_per_split


def choose_num_splits(batch: int, capacity: int) -> int:
    """Flash-decoding splits: enough to give ``PARALLEL_TARGET`` grid rows, each split at
    least ``SPLIT_MIN_POSITIONS`` long (1 for a big batch or a short cache)."""
    want = -(-PARALLEL_TARGET // batch)
    return int(max(1, min(want, capacity // SPLIT_MIN_POSITIONS)))


def make_decode_config(spec: DecodeSpec, page_size: int, pages_per_sequence: int,
                       num_pages: int, *, num_splits: int | None = None) -> DecodeConfig:
    """The kernel's static configuration for a validated request over pages of ``page_size``."""
    if num_splits is None:
        num_splits = choose_num_splits(spec.batch, page_size * pages_per_sequence)
    if isinstance(num_splits, bool) or not isinstance(num_splits, (int, np.integer)) \
            or num_splits < 1:
        raise ValueError(f"num_splits: expected an int >= 1, got {num_splits!r}")
    num_splits = int(min(num_splits, pages_per_sequence))
    rows = blk.round_up(spec.new_tokens * spec.group_size, blk.SUBLANES)
    cfg = DecodeConfig(
        batch=spec.batch, num_kv_heads=spec.num_kv_heads, group_size=spec.group_size,
        new_tokens=spec.new_tokens, rows=rows, head_dim=spec.head_dim,
        head_dim_v=spec.head_dim_v, page_size=page_size, num_pages=num_pages,
        pages_per_sequence=pages_per_sequence, num_splits=num_splits,
        pages_per_split=-(-pages_per_sequence // num_splits), dtype=jnp.dtype(spec.dtype),
        scale=spec.scale, window=spec.window, soft_cap=spec.soft_cap)
    need, budget = decode_vmem_bytes(cfg), blk.vmem_budget_bytes()
    if need > budget:
        raise ValueError(
            f"new_tokens: {spec.new_tokens} new tokens x {spec.group_size} query heads per kv "
            f"head x {spec.num_kv_heads} kv heads need ~{need / 2**20:.1f} MiB of VMEM in the "
            f"decode kernel (all rows stay resident), over the {budget / 2**20:.0f} MiB budget "
            f"of {blk.resolve_chip()}; feed the prefill in smaller chunks")
    return cfg


def decode_vmem_bytes(cfg: DecodeConfig) -> int:
    """VMEM the kernel plans: double-buffered q, K/V pages and state blocks, plus the scratch
    state (``(K, D)`` tiles padded to whole sublanes and lanes)."""
    it = cfg.dtype.itemsize
    sub = blk.SUBLANES * max(1, 4 // it)
    lanes = lambda d: blk.round_up(d, blk.LANES)  # noqa: E731
    K, R, ps = cfg.num_kv_heads, cfg.rows, cfg.page_size
    q = K * R * lanes(cfg.head_dim) * it
    pages = ps * blk.round_up(K, sub) * (lanes(cfg.head_dim) + lanes(cfg.head_dim_v)) * it
    state = K * R * (2 * blk.LANES + lanes(cfg.head_dim_v)) * 4
    return 2 * (q + pages + state) + state


def _div(a, b: int):
    """``a // b`` for ``a >= 0``: Python/NumPy ints as they are, traced values with ``lax.div``
    (truncating; ``//`` on a traced int lowers through ``sign``, which Mosaic lowers only
    with a TPU attached)."""
    if isinstance(a, (int, np.integer)):
        return a // b
    return jax.lax.div(a, jnp.asarray(b, a.dtype))


def visible_pages(cfg: DecodeConfig, length):
    """``(first, last)`` logical pages sequence of ``length`` can see (ints or traced).

    ``last = ceil(length / page_size) - 1`` (0 for an empty slot); ``first`` starts at the
    oldest key the first new token's window reaches.
    """
    mx = max if isinstance(length, (int, np.integer)) else jnp.maximum
    mn = min if isinstance(length, (int, np.integer)) else jnp.minimum
    last = mx(_div(length + cfg.page_size - 1, cfg.page_size) - 1, 0)
    if cfg.window is None:
        return 0, last
    first = _div(mx(length - cfg.new_tokens - cfg.window, 0), cfg.page_size)
    return mn(first, last), last


@dataclasses.dataclass(frozen=True)
class DecodeGridSpec(ForwardGridSpec):
    """The decode kernel's grid and BlockSpecs, exactly the objects ``pallas_call`` gets.

    The forward kernel's container (:class:`flashlab.kernels.forward.ForwardGridSpec`) with
    ``config`` a :class:`DecodeConfig` and grid ``(batch, splits, pages_per_split)``. Every
    ``index_map`` is ``(b, s, i, lengths, page_table) -> block index`` and also runs on ints and
    NumPy arrays, so :mod:`flashlab.instruments.traffic` replays it to count the bytes moved.
    ``page_table`` is flattened to ``[batch * table_width]`` (SMEM pads 2-D arrays).
    """

    dimension_semantics: tuple[str, ...] = ("parallel", "parallel", "arbitrary")


def decode_grid_spec(cfg: DecodeConfig) -> DecodeGridSpec:
    """Build the grid, BlockSpecs (with the page-walking index maps) and scratch."""
    K, R, D, Dv, ps = cfg.num_kv_heads, cfg.rows, cfg.head_dim, cfg.head_dim_v, cfg.page_size
    W, pps = cfg.table_width, cfg.pages_per_split

    def q_map(b, s, i, lengths, table):
        return (b, 0, 0, 0)

    def page_map(b, s, i, lengths, table):      # the page walk: logical page -> pool page
        first, last = visible_pages(cfg, lengths[b])
        j = s * pps + i
        j = min(max(j, first), last) if isinstance(j, int) else jnp.clip(j, first, last)
        return (table[b * W + j], 0, 0, 0)

    def state_map(b, s, i, lengths, table):
        return (b, s, 0, 0, 0)

    f32 = jnp.float32
    in_specs = (pl.BlockSpec((None, K, R, D), q_map),
                pl.BlockSpec((None, ps, K, D), page_map),
                pl.BlockSpec((None, ps, K, Dv), page_map))
    in_shapes = (jax.ShapeDtypeStruct((cfg.batch, K, R, D), cfg.dtype),
                 jax.ShapeDtypeStruct((cfg.num_pages, ps, K, D), cfg.dtype),
                 jax.ShapeDtypeStruct((cfg.num_pages, ps, K, Dv), cfg.dtype))
    S = cfg.num_splits
    out_specs = (pl.BlockSpec((None, None, K, R, blk.LANES), state_map),
                 pl.BlockSpec((None, None, K, R, blk.LANES), state_map),
                 pl.BlockSpec((None, None, K, R, Dv), state_map))
    out_shapes = (jax.ShapeDtypeStruct((cfg.batch, S, K, R, blk.LANES), f32),
                  jax.ShapeDtypeStruct((cfg.batch, S, K, R, blk.LANES), f32),
                  jax.ShapeDtypeStruct((cfg.batch, S, K, R, Dv), f32))
    scratch = (compat.VMEM((K, R, blk.LANES), f32), compat.VMEM((K, R, blk.LANES), f32),
               compat.VMEM((K, R, Dv), f32))
    return DecodeGridSpec(cfg, cfg.grid, ("q", "k", "v"), in_specs, in_shapes,
                          ("m", "l", "acc"), out_specs, out_shapes, scratch)


def _decode_kernel(lengths_ref, table_ref, q_ref, k_ref, v_ref, m_out, l_out, acc_out,
                   m_ref, l_ref, acc_ref, *, cfg: DecodeConfig):
    """Step ``(b, s, i)``: fold logical page ``j`` into every kv head's (m, l, acc)."""
    b, s, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    R, ps = cfg.rows, cfg.page_size
    length = lengths_ref[b]
    j = s * cfg.pages_per_split + i

    @pl.when(i == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, online_softmax.NEG_INF, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    first, last = visible_pages(cfg, length)
    run = (j >= first) & (j <= last) & (length > 0)

    @pl.when(run)
    def _compute():
        # row r is new token r // G (rows past T*G are padding: they see what token T-1 sees)
        t = jnp.minimum(_div(jax.lax.broadcasted_iota(jnp.int32, (R, ps), 0), cfg.group_size),
                        cfg.new_tokens - 1)
        q_pos = length - cfg.new_tokens + t
        k_pos = j * ps + jax.lax.broadcasted_iota(jnp.int32, (R, ps), 1)
        window = None if cfg.window is None else (cfg.window, None)
        visible = masks.structural_visible(q_pos, k_pos, is_causal=True, window=window,
                                           kv_len=length)
        for h in range(cfg.num_kv_heads):          # static: one page serves all G heads
            k = k_ref[:, h, :]                                        # [ps, d]
            sc = jax.lax.dot_general(q_ref[h], k, (((1,), (1,)), ((), ())),
                                     preferred_element_type=jnp.float32) * cfg.scale
            if cfg.soft_cap is not None:
                sc = cfg.soft_cap * jnp.tanh(sc / cfg.soft_cap)
            state = online_softmax.State(jnp.max(m_ref[h], axis=-1),
                                         jnp.max(l_ref[h], axis=-1), acc_ref[h])
            m, l, acc = online_softmax.update(state, sc, v_ref[:, h, :], visible=visible)
            m_ref[h] = jnp.broadcast_to(m[:, None], (R, blk.LANES))
            l_ref[h] = jnp.broadcast_to(l[:, None], (R, blk.LANES))
            acc_ref[h] = acc

    @pl.when(i == cfg.pages_per_split - 1)
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
    ``f(lengths [B], table [B*W], q [B, K, R, d], k_pages, v_pages) -> (m, l, acc)``.

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
    """Public operands -> the kernel's: folded, row-padded q and the flat padded table."""
    q = fold_heads(query, spec)
    q = jnp.pad(q, ((0, 0), (0, 0), (0, cfg.rows - q.shape[2]), (0, 0)))
    table = jnp.pad(table, ((0, 0), (0, cfg.table_width - table.shape[1])))
    return q, table.reshape(-1)


@functools.partial(jax.jit, static_argnames=("cfg", "interpret"))
def _decode(query, k_pages, v_pages, table, spec, *, cfg: DecodeConfig, interpret):
    q, flat = prepare(cfg, query, table, spec)
    m, l, acc = decode_call(cfg, interpret)(spec.lengths, flat, q, k_pages, v_pages)
    TG = cfg.new_tokens * cfg.group_size
    parts = [online_softmax.State(m[:, s, :, :TG, 0], l[:, s, :, :TG, 0], acc[:, s, :, :TG])
             for s in range(cfg.num_splits)]                         # [B, K, T*G(, dv)]
    if spec.sinks is not None:
        parts.append(sink_state(spec, cfg.head_dim_v))
    out, _ = online_softmax.finalize(functools.reduce(online_softmax.merge, parts))
    return unfold_heads(out, spec).astype(query.dtype)


def pallas_decode(query, k_cache, v_cache, spec: DecodeSpec, *, interpret=None,
                  num_splits: int | None = None, block_k: int = 512):
    """The decode kernel on validated inputs (what the decode registry calls).

    A contiguous cache runs as pages of up to ``block_k`` positions (a free reshape).
    ``num_splits``: flash-decoding splits of the kv axis (default :func:`choose_num_splits`).
    """
    from flashlab.kernels.forward import _resolve_interpret
    if jnp.dtype(spec.dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise TypeError(f"query: the pallas_tpu decode kernel takes float32 or bfloat16, got "
                        f"{jnp.dtype(spec.dtype)}")
    kp, vp, table, ps = paged_view(k_cache, v_cache, spec, block_k)
    cfg = make_decode_config(spec, ps, table.shape[1], kp.shape[0], num_splits=num_splits)
    return _decode(query, kp, vp, table, spec, cfg=cfg, interpret=_resolve_interpret(interpret))
