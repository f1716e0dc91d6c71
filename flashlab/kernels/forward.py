"""The Pallas TPU forward kernel of FlashAttention (Dao et al. 2022, Algorithm 1).

Grid ``(batch, heads, T_r, T_c)``: step ``(b, h, i, j)`` loads the query block ``Q_i``
``[B_r, d]`` and the key/value blocks ``K_j, V_j`` ``[B_c, d]`` into VMEM and folds
``S_ij = Q_i K_jᵀ`` into the running state ``(m, l, acc)`` kept in VMEM scratch with
:func:`flashlab.ladder.online_softmax.update`. The kv axis ``j`` is innermost and "arbitrary" (it
carries the state); the other three are "parallel". At the last ``j`` the state is
finalized into ``O_i`` (and optionally ``lse_i``).

Block skipping, with neither compute nor DMA: the kv index maps clamp ``j`` into the range of
blocks q block ``i`` can see (causal, window, valid lengths; :func:`blocks.kv_block_range`), so
a skipped step asks for the block already resident and the pipeline copies nothing; the
kernel's ``pl.when(masks.block_maybe_visible(...))`` skips its compute. Where causal, window
or padding skip blocks (and there are no offsets) the grid is ``(batch, heads, n)`` over the
visible pairs only (:mod:`flashlab.kernels.visit`): skipped steps then cost nothing at all.

``m`` and ``l`` live lane-replicated in ``[B_r, 128]`` VMEM scratch and are updated
elementwise (``online_softmax.update(..., lanes=True)``); the lse output is that layout too.
A wide tile is folded in ``cfg.row_chunks`` chunks of rows, each its own rows of ``m``, ``l``
and ``acc`` (:data:`~flashlab.kernels.forward_config.FORWARD_ROW_CHUNKS`): independent chains
the compiler's scheduler interleaves, one chunk's softmax under the next chunk's matmuls.
On v6e and 7x a plain tile's rows fold their keys in column chunks too
(:data:`~flashlab.kernels.forward_config.FORWARD_COL_CHUNK`).

Inside, the layout is ``[batch, heads, seq, head_dim]`` padded to whole blocks (seq) and to
128 lanes (head_dim); padding keys are masked through the kv length, which is
scalar-prefetched into SMEM together with the q length.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from flashlab.contract import device, masks
from flashlab.ladder import online_softmax
from flashlab.contract.masks import AttentionSpec
from flashlab.compat.shard_map import shape_dtype, vma_of
from flashlab.compat import pallas as compat
from flashlab.kernels import blocks as blk
from flashlab.kernels import band, diagonal, visit
from flashlab.kernels.refs import RefNames, Window, name_refs
from flashlab.compat.pallas import pl
from flashlab.kernels.forward_grid import (ForwardGridSpec, forward_grid_spec, global_starts,
                                           sinks_operand, static_lengths)
from flashlab.kernels.forward_config import ForwardConfig, make_config

__all__ = ["flash_attention_forward", "INIT_REGION"]

LOG2E = online_softmax.LOG2E        # natural-log logits -> log2 units
# Chips whose forward keeps its init region where every block is visible (elsewhere a row's
# first step selects its state instead): T=8192 non-causal 512², v4 12.88 -> 12.89 ms folded
INIT_REGION = frozenset({"v4"})

# ----------------------------------------------------------------------------- the kernel

def score_tile(ins, cfg: ForwardConfig, q_start, k_start, q_len, kv_len):
    """One ``[B_r, B_c]`` tile of logits and its visibility, from the operand refs ``ins``.

    ``s = cap·tanh(scale·Q_i K_jᵀ / cap) + bias`` in float32, and the one mask definition
    (:func:`tile_visible`). A factor of the scores is folded into the ``[B_r, d]`` query block
    (rounded to its dtype before the matmul) rather than applied to the ``[B_r, B_c]`` scores:
    ``scale/cap`` under a soft cap (``tanh``'s argument; ``cfg.cap_in_query``), else
    ``scale·log2(e)`` with ``cfg.log2_scores``, whose logits are in log2 units
    (``s₂ = cap·log2(e)·tanh(·)``, or ``(scale·log2(e)·Q_i) K_jᵀ``, plus ``log2(e)·bias``).
    """
    nt = (((1,), (1,)), ((), ()))                                               # Q Kᵀ
    unit = LOG2E if cfg.log2_scores else 1.0
    fold = (cfg.scale / cfg.soft_cap if cfg.cap_in_query
            else cfg.scale * unit if cfg.log2_scores and cfg.soft_cap is None else None)
    q = ins["q"][...]
    if fold is not None:
        q = (q.astype(jnp.float32) * fold).astype(q.dtype)
    s = jax.lax.dot_general(q, ins["k"][...], nt, preferred_element_type=jnp.float32)
    if fold is None:
        s = s * cfg.scale
    if cfg.soft_cap is not None:    # unfolded (SOFT_CAP_UNFOLDED): tanh(scale·s / cap)
        s = (cfg.soft_cap * unit) * jnp.tanh(s if fold is not None else s / cfg.soft_cap)
    if "bias" in ins:
        b = scores_block(ins, "bias", cfg)
        s = s + (b * LOG2E if cfg.log2_scores else b)
    return s, tile_visible(ins, cfg, q_start, k_start, q_len, kv_len)


def scores_block(ins, name: str, cfg: ForwardConfig):
    """The ``[B_r, B_c]`` block of the bias (float32) or mask (int32) read from ``ins[name]``.

    A bias/mask with a broadcast T or S dim arrives as a ``[1, B_c]``, ``[B_r, 1]`` or
    ``[1, 1]`` block (its BlockSpec keeps that dim at 1): it is broadcast here, in VMEM,
    after the cast (Mosaic broadcasts 32-bit values along sublanes and lanes).
    """
    x = ins[name][...]
    x = x.astype(jnp.float32 if name == "bias" else jnp.int32)
    shape = (cfg.block_q, cfg.block_k)
    return x if x.shape == shape else jnp.broadcast_to(x, shape)


def tile_visible(ins, cfg: ForwardConfig, q_start, k_start, q_len, kv_len, *,
                 transposed: bool = False):
    """Which scores of one tile are visible: bool ``[B_r, B_c]`` (``[B_c, B_r]`` when
    ``transposed``, the dK/dV kernel's ``Sᵀ``), from the operand refs ``ins``; ``None`` when
    the request masks nothing (no causal, window, lengths, padding, segments or mask: every
    score is visible, and an all-true select would still cost a VPU op per score).

    The one mask definition (:func:`masks.structural_visible` on iota positions, at global
    positions ``q_start``/``k_start``), the segment ids and the dense mask. Shared by the
    forward and the three backward kernels.
    """
    if not cfg.masks_tile:
        return None
    bq, bk, L = cfg.block_q, cfg.block_k, blk.LANES
    shape, q_axis = ((bk, bq), 1) if transposed else ((bq, bk), 0)
    q_pos = q_start + jax.lax.broadcasted_iota(jnp.int32, shape, q_axis)
    k_pos = k_start + jax.lax.broadcasted_iota(jnp.int32, shape, 1 - q_axis)
    q_seg = kv_seg = None
    if cfg.has_segments and transposed:
        q_seg = ins["q_segment_ids_t"][...][:1, :]                          # [1, B_r]
        kv_seg = jnp.tile(ins["kv_segment_ids_t"][...], (1, bq // L))       # [B_c, B_r]
    elif cfg.has_segments:
        q_seg = jnp.tile(ins["q_segment_ids"][...], (1, bk // L))           # [B_r, B_c]
        kv_seg = ins["kv_segment_ids"][...][:1, :]                          # [1, B_c]
    visible = masks.structural_visible(
        q_pos, k_pos, is_causal=cfg.is_causal, window=cfg.window,
        q_len=q_len if cfg.mask_q_len else None,
        kv_len=kv_len if cfg.mask_kv_len else None, q_seg=q_seg, kv_seg=kv_seg)
    if "mask" in ins:
        mask = ins["mask"][...]                                             # [B_r, B_c] int8
        if (transposed or blk.resolve_chip(cfg.chip) in blk.NO_INT8_VPU
                or mask.shape != (bq, bk)):
            # Mosaic: no int8 compare (v4), transpose or broadcast ([1, B_c], [B_r, 1])
            mask = scores_block(ins, "mask", cfg)
        visible = jnp.logical_and(visible, (mask.T if transposed else mask) != 0)
    return visible


#: The inputs whose blocks have the query block's rows as their first axis.
ROW_INPUTS = ("q", "bias", "mask", "q_segment_ids")


def rows_of(ins, rows, block_q: int):
    """``ins`` with each of :data:`ROW_INPUTS` cut to the row chunk ``rows`` (a ``pl.ds``); a
    block broadcast over the rows (a bias or mask block of one row) is kept whole. The whole
    block (``rows`` spanning ``block_q``) is ``ins`` itself."""
    if rows.size == block_q:
        return ins
    return {name: Window(ref, rows) if name in ROW_INPUTS and ref.shape[0] == block_q else ref
            for name, ref in ins.items()}


def _forward_kernel(*refs, cfg: ForwardConfig, names: RefNames):
    """One grid step ``(b, h, i, j)`` (or ``(b, h, t)`` of the visit grid): fold S_ij into
    (m, l, acc); init at the row's first step, finalize at its last. ``refs`` are named by
    the grid spec (:meth:`ForwardGridSpec.ref_names`): q/kv lengths, [offsets], [visits], the
    inputs, ``o`` [and ``lse``], scratch ``m``, ``l``, ``acc``."""
    ins = name_refs(refs, names)
    offsets_ref = ins.get("offsets")
    m_ref, l_ref, acc_ref = ins["m"], ins["l"], ins["acc"]
    b = pl.program_id(0)
    bq, bk = cfg.block_q, cfg.block_k
    # int32 scalars from SMEM, or Python ints when no lengths, padding or offsets are given
    q_lens, kv_lens = static_lengths(cfg, ins["q_lengths"], ins["kv_lengths"])
    q_len, kv_len = q_lens[b], kv_lens[b]
    if cfg.visit_grid:   # listed = positionally visible; only run-time lengths left to test
        i, j, first, last, listed = visit.step_at(ins["visits"], pl.program_id(2))
    else:
        i, j = pl.program_id(2), pl.program_id(3)
        first, last = j == 0, j == cfg.num_kv_blocks - 1

    dense = not cfg.visit_grid and blk.every_block_visible(cfg)  # every grid step computes
    # There a row's first step takes its state (online_softmax.EMPTY) through a select instead
    # of an init region storing it (v5e, T=8192, 512²: 7.70 -> 7.57 ms; init 197 -> 0 cycles
    # a q row), except on INIT_REGION's chips
    fresh = dense and blk.resolve_chip(cfg.chip) not in INIT_REGION
    if not fresh:
        @pl.when(first)
        def _init():                                              # m = -inf, l = 0, acc = 0
            for ref, empty in zip((m_ref, l_ref, acc_ref), online_softmax.EMPTY):
                ref[...] = jnp.full(ref.shape, empty, jnp.float32)

    # Global positions (= local ones without offsets): the one mask definition sees those.
    q_start, k_start, q_len, kv_len = global_starts(offsets_ref, i * bq, j * bk, q_len, kv_len)
    if cfg.visit_grid:
        run = listed
        if cfg.mask_kv_len:
            run = jnp.logical_and(run, k_start < kv_len)
        if cfg.mask_q_len:
            run = jnp.logical_and(run, q_start < q_len)
    elif dense:
        # every step computes: no branch around the tile, which the scheduler then overlaps
        # with the step's own work (v5e d=64 512²: tile + step 1413 -> 1392 cycles);
        # tpu_schedule.analyze reads such a tile as unpredicated
        run = None
    else:
        run = jnp.logical_and(
            masks.block_maybe_visible(q_start, q_start + bq, k_start, k_start + bk,
                                      is_causal=cfg.is_causal, window=cfg.window),
            jnp.logical_and(k_start < kv_len, q_start < q_len))

    def fold(p: diagonal.Piece):
        """Fold queries ``[q_lo, q_hi)`` by keys ``[k_lo, k_hi)`` of the tile into those rows'
        state: a row chunk (every key) or a piece of a crossed tile (the keys it sees)."""
        r, nq, nk = pl.ds(p.q_lo, p.q_hi - p.q_lo), p.q_hi - p.q_lo, p.k_hi - p.k_lo
        view = rows_of(ins, r, bq)
        if nk != bk:                                            # the keys the piece sees
            kk = pl.ds(p.k_lo, nk)
            view = dict(view, k=Window(ins["k"], kk), v=Window(ins["v"], kk))
        unmasked = not (p.masked or cfg.length_masked)
        pcfg = dataclasses.replace(cfg, block_q=nq, block_k=nk,
                                   is_causal=cfg.is_causal and not unmasked,
                                   window=None if unmasked else cfg.window)
        s, visible = score_tile(view, pcfg, q_start + p.q_lo, k_start + p.k_lo,
                                q_len, kv_len)                   # [nq, nk]
        # m and l stay lane-replicated [rows, 128] and are updated elementwise: the tile's
        # row max and row sum are the only cross-lane reductions of a step.
        state = online_softmax.State(m_ref[r, :], l_ref[r, :], acc_ref[r, :])
        if fresh and p.k_lo == 0:     # a row's first keys open it at EMPTY, not the scratch
            state = online_softmax.State(*(jnp.where(first, e, x)
                                           for e, x in zip(online_softmax.EMPTY, state)))
        m, l, acc = online_softmax.update(state, s, view["v"][...], visible=visible,
                                          lanes=True, base2=cfg.log2_scores)
        m_ref[r, :] = m
        l_ref[r, :] = l
        acc_ref[r, :] = acc

    # The tile as cfg.row_chunks independent chains of rows (FORWARD_ROW_CHUNKS): the
    # scheduler overlaps one chunk's softmax with the next chunk's matmuls. A plain tile's
    # rows may fold their keys in cfg.col_chunks updates too (FORWARD_COL_CHUNK), row-major.
    strips = diagonal.forward_cases(cfg)
    banded = band.forward_applies(cfg)
    rows, cols = bq // cfg.row_chunks, bk // cfg.col_chunks
    # Under the strips (causal is the only mask) a tile the diagonal does not cross is seen
    # whole once it runs: its chunks build no mask (v6e causal 2048²: 11785 -> 10318 cycles;
    # 10070 in the column chunks that a tile without a mask takes).
    chunks = [diagonal.Piece(k * cols, (k + 1) * cols, c * rows, (c + 1) * rows,
                             masked=not strips)
              for c in range(cfg.row_chunks) for k in range(cfg.col_chunks)]

    def whole(pieces=chunks):
        for chunk in pieces:                                    # unrolled: static slices
            fold(chunk)

    if strips:
        # A tile the causal diagonal crosses runs as its query strips, each against the keys
        # it sees (diagonal.forward_cases): straight-line, one list per crossing offset d.
        d = k_start - q_start                                   # no offsets here

        @pl.when(run)
        def _visible():
            for dc, pieces in strips:
                @pl.when(d == dc)
                def _staircase(pieces=pieces):
                    for piece in pieces:
                        fold(piece)
            pl.when(jnp.logical_not(diagonal.crossing(cfg, d)))(whole)
    elif cfg.partial_tiles:
        # Where a chunk can see nothing of a visible tile (causal with B_r > B_c, a window),
        # such a tile takes a second path that runs only its chunks that see something, each
        # behind its own pl.when (no overlap between them, but no wasted chunk either).
        seen = cfg.chunks_seen(q_start, k_start)        # one per row chunk (col_chunks == 1)
        every = functools.reduce(jnp.logical_and, seen)

        @pl.when(jnp.logical_and(run, jnp.logical_not(every)))
        def _partial():
            for chunk, sees in zip(chunks, seen):
                pl.when(sees)(functools.partial(fold, chunk))

        run = jnp.logical_and(run, every)

    if banded:
        # A window's tile wholly inside the band sees every score: its chunks build no mask
        # (kernels/band.py); a tile an edge crosses keeps it, in whole rows (no column chunks).
        @pl.when(run)
        def _visible():
            inner = band.inside(cfg, q_start, k_start)
            pl.when(inner)(functools.partial(whole, [dataclasses.replace(c, masked=False)
                                                     for c in chunks]))
            pl.when(jnp.logical_not(inner))(functools.partial(whole, [
                diagonal.Piece(0, bk, c * rows, (c + 1) * rows, masked=True)
                for c in range(cfg.row_chunks)]))
    elif run is None:          # every block visible: neither strips, partial tiles nor band
        whole()
    elif not strips:
        pl.when(run)(whole)

    @pl.when(last)
    def _finalize():                                              # O_i = acc * (1 / l)
        state = online_softmax.State(m_ref[...], l_ref[...], acc_ref[...])
        base2 = cfg.log2_scores
        if cfg.has_sinks:                                         # + exp(sink - m) in l
            sink = jnp.broadcast_to(ins["sinks"][0:1, :], m_ref.shape)   # [B_r, 128]
            if base2:
                sink = sink * LOG2E
            state = online_softmax.merge(
                state, online_softmax.sink_state(sink, acc_ref.shape[-1], lanes=True),
                lanes=True, base2=base2)
        # 1 / l as Mosaic's reciprocal without its fix-ups for zero, infinite and subnormal
        # l, which max(l, 1) rules out (online_softmax.finalize): with that max in place of
        # an empty-row test, a 512-row finalize on v5e falls from 297 cycles to 137.
        o, lse = online_softmax.finalize(state, lanes=True, base2=base2,  # lse [B_r, 128]
                                         inverse=compat.reciprocal_normal)
        ins["o"][...] = o.astype(ins["o"].dtype)
        if cfg.return_lse:
            ins["lse"][...] = lse


def _cost_estimate(cfg: ForwardConfig, gs: ForwardGridSpec) -> Any:
    """FLOPs, exps and HBM bytes, counting only the (q block, kv block) pairs computed.

    Positional skipping (causal, window, padding) is known statically; data-dependent
    lengths are not, so they are assumed full here.
    """
    bh = cfg.batch * cfg.num_heads
    pairs = bh * cfg.computed_pairs()
    tile = cfg.block_q * cfg.block_k

    block_bytes = gs.block_bytes
    read = 0
    for name in gs.in_names:
        if name in ("q", "q_segment_ids", "sinks"):      # once per (b, h, i)
            read += bh * cfg.num_q_blocks * block_bytes(name)
        else:                                   # once per computed (b, h, i, j)
            read += pairs * block_bytes(name)
    written = sum(bh * cfg.num_q_blocks * block_bytes(n) for n in gs.out_names)
    return compat.CostEstimate(flops=int(2 * pairs * tile * (cfg.head_dim_p + cfg.head_dim_v_p)),
                               transcendentals=int(pairs * tile),
                               bytes_accessed=int(read + written))


def varying_out_shapes(gs, *operands) -> list:
    """``gs.out_shapes`` varying over the mesh axes the operands vary over.

    Inside ``shard_map(check_vma=True)`` a ``pallas_call`` must be told how its outputs vary;
    outside it (no manual axes) these are ``gs.out_shapes`` unchanged.
    """
    axes = vma_of(operands)
    return [shape_dtype(s.shape, s.dtype, axes) for s in gs.out_shapes]


def _pallas_forward(cfg: ForwardConfig, interpret, q_lengths, kv_lengths, *operands):
    """``operands``: [offsets] or [visits] (scalar prefetch), then the arrays of ``in_names``."""
    gs = forward_grid_spec(cfg)
    kernel = functools.partial(_forward_kernel, cfg=cfg, names=gs.ref_names())
    out = pl.pallas_call(
        kernel,
        grid_spec=gs.pallas_grid_spec(),
        out_shape=varying_out_shapes(gs, q_lengths, kv_lengths, *operands),
        compiler_params=gs.compiler_params(interpret),
        cost_estimate=_cost_estimate(cfg, gs),
        interpret=interpret,
        name="flashlab_flash_forward",
    )(q_lengths, kv_lengths, *operands)
    return out


def _prepare(cfg: ForwardConfig, query, key, value, spec: AttentionSpec):
    """Public layout -> the kernel's padded operands and scalar-prefetch lengths."""
    Tp, Sp, Dp, Dvp = cfg.q_len_p, cfg.kv_len_p, cfg.head_dim_p, cfg.head_dim_v_p

    def to_kernel(x, T, D):   # [B, T, H, d] -> [B, H, T_pad, d_pad], zeros in the padding
        x = jnp.swapaxes(x, 1, 2)
        return jnp.pad(x, ((0, 0), (0, 0), (0, T - x.shape[2]), (0, D - x.shape[3])))

    ops = [to_kernel(query, Tp, Dp), to_kernel(key, Sp, Dp), to_kernel(value, Sp, Dvp)]
    def pad_scores(a, bcast):  # a broadcast T or S dim of 1 stays 1 (blocks of 1 read it)
        return jnp.pad(a, ((0, 0), (0, 0), (0, 0 if bcast[2] else Tp - a.shape[2]),
                           (0, 0 if bcast[3] else Sp - a.shape[3])))
    if spec.bias is not None:
        ops.append(pad_scores(spec.bias.astype(cfg.bias_dtype), cfg.bias_bcast))
    if spec.mask is not None:
        ops.append(pad_scores(spec.mask.astype(jnp.int8), cfg.mask_bcast))
    if spec.q_segment_ids is not None:
        qs = jnp.pad(spec.q_segment_ids, ((0, 0), (0, Tp - cfg.q_len)))
        ks = jnp.pad(spec.kv_segment_ids, ((0, 0), (0, Sp - cfg.kv_len)))
        ops.append(jnp.broadcast_to(qs[:, :, None], (cfg.batch, Tp, blk.LANES)))
        ops.append(jnp.broadcast_to(ks[:, None, :], (cfg.batch, blk.SUBLANES, Sp)))
    full = lambda n: jnp.full((cfg.batch,), n, jnp.int32)  # noqa: E731
    q_lengths, kv_lengths = spec.local_lengths()        # with offsets: global -> this block's
    q_lengths = full(cfg.q_len) if q_lengths is None else q_lengths.astype(jnp.int32)
    kv_lengths = full(cfg.kv_len) if kv_lengths is None else kv_lengths.astype(jnp.int32)
    return q_lengths, kv_lengths, ops


def offset_operands(cfg: ForwardConfig, spec: AttentionSpec) -> list:
    """``[offsets [2] int32]`` (the third scalar-prefetch operand) with offsets, else ``[]``."""
    return [jnp.stack(spec.offsets()).astype(jnp.int32)] if cfg.has_offsets else []


@functools.partial(jax.jit, static_argnames=("cfg", "interpret"))
def _forward(query, key, value, spec, *, cfg: ForwardConfig, interpret):
    q_lengths, kv_lengths, ops = _prepare(cfg, query, key, value, spec)
    if cfg.has_sinks:            # forward only: the backward kernels never read the sink
        ops.append(sinks_operand(spec.sinks))
    visits = [jnp.asarray(visit.planes(cfg.visits()))] if cfg.visit_grid else []
    outs = _pallas_forward(cfg, interpret, q_lengths, kv_lengths,
                           *offset_operands(cfg, spec), *visits, *ops)
    o = jnp.swapaxes(outs[0][:, :, :cfg.q_len, :cfg.head_dim_v], 1, 2)   # [B, T, N, d_v]
    lse = outs[1][:, :, :cfg.q_len, 0] if cfg.return_lse else None      # [B, N, T]
    return o, lse


def _resolve_interpret(interpret):
    mode = device.interpret_mode(interpret)
    if not (isinstance(mode, bool) or compat.is_interpret_params(mode)):
        raise TypeError(f"interpret: expected None, a bool or a pltpu.InterpretParams, got "
                        f"{interpret!r}")
    return mode


def flash_attention_forward(query, key, value, spec: AttentionSpec, *, block_q=None,
                            block_k=None, interpret=None, chip=None):
    """Forward with residuals for a backward kernel: ``(out [B, T, N, d_v], lse [B, N, T])``.

    ``lse`` is float32, ``-inf`` on rows with no visible key. Not differentiable.
    """
    cfg = make_config(spec, block_q=block_q, block_k=block_k, return_lse=True, chip=chip)
    return _forward(query, key, value, spec, cfg=cfg, interpret=_resolve_interpret(interpret))
