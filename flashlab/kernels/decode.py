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

import functools
from typing import Any

import jax
import jax.numpy as jnp

from flashlab.contract import masks
from flashlab.ladder import online_softmax
from flashlab.contract.decode_validate import DecodeSpec
from flashlab.compat import pallas as compat
from flashlab.ladder.decode import fold_heads, paged_view, sink_state, unfold_heads
from flashlab.kernels import blocks as blk
from flashlab.compat.pallas import pl
from flashlab.kernels.refs import RefNames, name_refs
from flashlab.kernels.decode_grid import (
    DecodeConfig, _div, decode_grid_spec, make_decode_config, page_schedule, visible_pages)

__all__ = ["pallas_decode", "decode_call"]


def _decode_kernel(*refs, cfg: DecodeConfig, names: RefNames):
    """Step ``(b, s, i)``: fold logical pages ``j0 .. j0 + n - 1`` into every kv head's
    (m, l, acc). ``refs`` are named by the grid spec: ``lengths``, ``pages`` (prefetch), ``q``,
    n K pages ``k, k1, ...``, n V pages ``v, v1, ...``, the (m, l, acc) outputs, scratch."""
    r = name_refs(refs, names)
    n = cfg.pages_per_block
    k_refs = [r[f"k{t or ''}"] for t in range(n)]
    v_refs = [r[f"v{t or ''}"] for t in range(n)]
    lengths_ref, q_ref = r["lengths"], r["q"]
    m_out, l_out, acc_out = r["m"], r["l"], r["acc"]
    m_ref, l_ref, acc_ref = r["m_scratch"], r["l_scratch"], r["acc_scratch"]
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
                                     preferred_element_type=jnp.float32)
            if cfg.soft_cap is None:
                sc = sc * cfg.scale
            else:                                 # one multiply per score, no divide
                sc = cfg.soft_cap * jnp.tanh(sc * (cfg.scale / cfg.soft_cap))
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
        functools.partial(_decode_kernel, cfg=cfg, names=gs.ref_names()),
        grid_spec=gs.pallas_grid_spec(),
        out_shape=list(gs.out_shapes),
        compiler_params=gs.compiler_params(interpret),
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
