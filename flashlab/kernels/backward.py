"""The Pallas TPU backward kernels of FlashAttention (Dao 2023, FlashAttention-2 Algorithm 2).

With ``P = exp(S - lse)`` recomputed from Q, K and the forward's ``lse`` (never stored):

    dV = Pᵀ dO      dP = dO Vᵀ      D_i = rowsum(dO ∘ O)      dS = P ∘ (dP − D)
    dQ = scale · dS' K              dK = scale · dS'ᵀ Q

with ``dS' = dS ∘ (1 − tanh²)`` under a soft cap (``dS' = dS`` without).

One kernel where dQ fits VMEM, else two, split as in FlashAttention-2 (chapter 07 argues
both; :func:`backward_grid.resolve_backward` picks):

* **fused kernel** (the dK/dV kernel with ``fused``): the dK/dV kernel below, whose steps also
  add ``dS'_ij K_j`` into a float32 dQ ``[G, T, d]`` that stays resident in VMEM for the whole
  (batch, kv head) and is written once: five matmuls per tile instead of seven. Where that
  does not fit, dQ is resident per query chunk and dK, dV are summed over the chunks. On v6e
  and 7x, where every block is visible, dO and dQ hold the query positions on lanes (``[d,
  T]``, :func:`backward_config.grads_on_lanes`): ``dQᵀ += Kᵀ dS'ᵀ`` takes the tile as it is.
* **dK/dV kernel**, grid ``(batch, kv_heads, T_c, G, T_r)`` (dense): kv block ``j`` of kv head ``hk``
  stays in VMEM while the ``G`` query heads sharing it (GQA) and their q blocks ``i`` stream
  past; dK_j, dV_j accumulate in float32 VMEM scratch and are written once. The last two axes
  are "arbitrary" (they carry the accumulators), the first three "parallel". K/V are never
  repeated in HBM: the G query heads are a grid axis. It computes the transposed tile
  ``Sᵀ = K Qᵀ`` ``[B_c, B_r]``, so dV and dK are plain matmuls (no XLU transposes).
* **dQ kernel**, grid ``(batch, heads, T_r, T_c)``, the forward's: dQ_i accumulates over the
  kv axis ("arbitrary"). With a full-shape bias ``[B, N, T, S]`` it also writes dS: that is
  dBias.
* **dBias kernel**, for a bias broadcast over batch and/or heads (and any differentiated bias
  under the fused kernel, which has no dQ kernel to write dS): grid (bias axes, ``T_r``,
  ``T_c``, broadcast axes), dBias accumulated in its float32 output block over the innermost
  broadcast axes (:func:`dbias_grid_spec`, :mod:`flashlab.kernels.dbias`): no ``[B, N, T, S]``
  array.

A bias or mask with a T or S dim of 1 (``[.., 1, S]``, ``[.., T, 1]``) is read by every kernel
as blocks of 1 on that dim, broadcast in VMEM (:func:`forward.scores_block`). Only when the
bias gradient is requested does the backward read such a bias at full length
(:func:`dbias_config`: broadcast to ``[B|1, N|1, T, S]`` in the wrapper), and dBias is then
summed over that dim in XLA, back to the bias's shape.

``D_i`` is an O(N·d) elementwise product and row sum: plain XLA, fused, before the kernels.

Block skipping as in the forward. Where the visible set is known when the kernel is built (no
offsets; ``cfg.visit_grid``), the dQ and dK/dV kernels run over the visible pairs only
(:mod:`flashlab.kernels.visit`): the dQ kernel on the forward's visit list ``(b, h, t)``, the
dK/dV kernel on the transposed one ``(b, hk, t, g)`` (rows are kv blocks). A skipped pair then
costs no grid step at all: at causal T=8192 with 1024-blocks that is 896 of 2048 steps.
The fused kernel of a plain causal MHA folds instead (:func:`diagonal.folds`): kv blocks ``p``
and ``T_c − 1 − p`` share grid row ``p``, so its grid holds the visible tiles exactly with
``(j, i)`` found by arithmetic, and each kv block's first (crossed) tile writes dK, dV rather
than adding to zeroed accumulators (:func:`diagonal.writes_first`).
Under a window the dK/dV kernel walks the band by arithmetic instead, ``(b, hk, j, g, t)``
(:func:`band.grid_applies`). Where every block is visible (:func:`blocks.every_block_visible`)
the dense grids clamp and test nothing: the dK/dV tile runs at every step with no branch
around it, a kv row's first step writes its accumulators, and the fused kernel's first kv row
writes dQ (no zeroing first).
Otherwise, on the dense grids, skipped steps run with neither compute nor DMA: the dQ kernel
clamps ``j`` into :func:`blocks.kv_block_range`, the dK/dV kernel clamps ``i`` into
:func:`blocks.q_block_range`; each kernel's ``pl.when`` tests the same range, so the index
maps and the compute agree by construction.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from flashlab.contract.masks import AttentionSpec
from flashlab.kernels import blocks as blk
from flashlab.kernels import band, diagonal
from flashlab.kernels import forward as fwd
from flashlab.kernels import forward_grid, visit
from flashlab.compat.pallas import pl
from flashlab.kernels.backward_cost import cost_estimate
from flashlab.kernels.backward_tile import dkdv_tile, tile as _tile
from flashlab.kernels.dbias import dbias_kernel
from flashlab.kernels.refs import RefNames, name_refs
from flashlab.kernels.backward_grid import (
    BackwardGridSpec, _full_bias, dbias_config, grads_on_lanes, _q_range, dbias_grid_spec, dkdv_grid_spec, dq_grid_spec, resolve_backward, chunk_of_block, D_ROW, LOG2E, LSE_ROW, ForwardConfig)

__all__ = ["flash_attention_backward"]

# ----------------------------------------------------------------------------- the kernels

def _dkdv_kernel(*refs, cfg: ForwardConfig, names: RefNames, fused: int = 0):
    """Step ``(b, hk, j, g, i)`` (or ``(b, hk, t, g)`` of the visit grid): dV_j += P_ijᵀ dO_i,
    dK_j += scale·dS'_ijᵀ Q_i.

    ``refs`` by name (:meth:`BackwardGridSpec.ref_names`). ``fused`` (``n ≥ 1``): also
    ``dQ_i += dS'_ij K_j`` into the float32 output block ``dq [G, T / n, d]`` (``[G, d, T /
    n]`` where :func:`backward_config.grads_on_lanes`), resident in VMEM for the whole (b, hk)
    and query chunk; with ``n > 1`` the dense grid is
    ``(b, hk, c, j, g, i)`` and dK, dV are the chunk's float32 partials (see
    :func:`dkdv_grid_spec`)."""
    ins = name_refs(refs, names)
    offsets_ref = ins.get("offsets")
    dk_ref, dv_ref, dq_ref = ins["dk"], ins["dv"], ins.get("dq")
    dk_acc, dv_acc = ins["dk_acc"], ins["dv_acc"]
    b = pl.program_id(0)
    q_lengths, kv_lengths = forward_grid.static_lengths(cfg, ins["q_lengths"], ins["kv_lengths"])
    q_len, kv_len = q_lengths[b], kv_lengths[b]
    chunked = fused > 1
    lanes = grads_on_lanes(cfg, fused)        # dO [d_v, B_r] blocks, dQ [G, d, T / n]
    per = cfg.num_q_blocks // max(fused, 1)          # q blocks per chunk
    on_visits = "visits" in ins
    folded = not on_visits and diagonal.folds(cfg, fused)    # (b, hk, p, s): no g axis
    g = 0 if folded else pl.program_id(4 if chunked and not on_visits else 3)
    last_g = cfg.group_size - 1
    chunk = 0
    if on_visits:               # (j, i) from the transposed visit list; the G heads innermost
        j, i, first_i, last_i, run = visit.step_at(ins["visits"], pl.program_id(2))
        ranged = cfg.length_masked      # listed = positionally visible
        if chunked:             # chunk after chunk, each listing every kv row from j = 0
            chunk = chunk_of_block(i, per)
    elif chunked:               # (b, hk, c, j, g, i): i local to chunk c
        chunk, j, i_local = pl.program_id(2), pl.program_id(3), pl.program_id(5)
        i = chunk * per + i_local
        first_i, last_i, run, ranged = i_local == 0, i_local == per - 1, None, True
    elif folded:                # kv blocks p and T_c - 1 - p on one row: every step visible
        j, i, first_i, last_i = diagonal.fold_step(cfg, pl.program_id(2), pl.program_id(3))
        # always true, kept as a branch: the tile and the diagonal's cases then sit in one
        # region beside init and finalize, as on the other grids, where the static schedule's
        # reader (tpu_schedule.analyze) tells them apart; it costs the step a compare
        run, ranged = pl.program_id(3) < diagonal.fold_length(cfg), False
    elif band.grid_applies(cfg, max(fused, 1)):  # (b, hk, j, g, t): q block lo + t of the band
        j, t = pl.program_id(2), pl.program_id(4)
        lo, hi = _q_range(cfg, 0, j, (q_len,), (kv_len,))     # the index map's range, once
        i = lo + t
        first_i, last_i, run, ranged = t == 0, t == band.q_steps(cfg) - 1, i <= hi, False
    else:
        j, i = pl.program_id(2), pl.program_id(4)
        first_i, last_i, run, ranged = i == 0, i == cfg.num_q_blocks - 1, None, True
    # Dense grid, every step visible: no branch around the tile, and no init region: the
    # row's first step writes the accumulators (v6e, T=2048, fused at 512²: tile + step 1718 ->
    # 1705 cycles, dK/dV zeroing 60 -> 0 and finalize 63 -> 37 a kv row); tpu_schedule.analyze
    # reads such a tile as unpredicated
    dense = ranged and blk.every_block_visible(cfg)
    ranged = ranged and not dense
    # Dense grid: the first kv row (j = 0) writes each (g, i)'s dQ rows, later rows add (v5e,
    # T=8192 non-causal, 512²: tile 2820 -> 2805, a 1029-cycle zeroing gone). Elsewhere the
    # chunk's first step, `opens`, zeroes its dQ [G, T / n, d]: built before the step's other
    # conditions (after them the window's fused step is 8-12 cycles longer: v5e 215 -> 227)
    # (a chunk's visit list starts again at kv row 0; otherwise every axis after (b, hk) is 0)
    opens = None if not fused or dense else (
        jnp.logical_and(jnp.logical_and(first_i, g == 0), j == 0) if on_visits and chunked
        else functools.reduce(jnp.logical_and, [pl.program_id(a) == 0 for a in (
            (3, 4, 5) if chunked else range(2, 4 if on_visits or folded else 5))]))
    first = jnp.logical_and(first_i, g == 0)
    last = jnp.logical_and(last_i, g == last_g)
    if ranged:          # exactly the index map's unclamped steps (visit grid: run-time lengths)
        lo, hi = _q_range(cfg, 0, j, (q_len,), (kv_len,), offsets_ref)
        in_range = jnp.logical_and(lo <= i, i <= hi)
        run = in_range if run is None else jnp.logical_and(run, in_range)

    writes = diagonal.writes_first(cfg, fused)   # the first (crossed) visit writes dK, dV
    if not (writes or dense):
        @pl.when(first)
        def _init():
            dk_acc[...] = jnp.zeros(dk_acc.shape, jnp.float32)
            dv_acc[...] = jnp.zeros(dv_acc.shape, jnp.float32)

    if opens is not None:
        @pl.when(opens)
        def _zero_dq():
            dq_ref[...] = jnp.zeros(dq_ref.shape, jnp.float32)

    def step(piece=None, write=False, inside=False, dq_write=False):
        starts = forward_grid.global_starts(offsets_ref, i * cfg.block_q, j * cfg.block_k,
                                            q_len, kv_len)
        dq_row = ((i - chunk * per) if chunked else i) * cfg.block_q  # q block i's dq rows
        dkdv_tile(ins, cfg, starts, dq_row if fused else None, g, piece, write, inside,
                  dq_write, lanes=lanes)

    if fused and diagonal.applies(cfg):
        # A tile the causal diagonal crosses runs as its kv strips, each from the first query
        # it sees (diagonal.cases): straight-line, one list per crossing offset d.
        d = j * cfg.block_k - i * cfg.block_q                           # no offsets here

        @pl.when(run)
        def _visible():
            for dc, pieces in diagonal.cases(cfg):
                write = writes and diagonal.first_visit(dc)

                @pl.when(d == dc)
                def _staircase(pieces=pieces, write=write):
                    for lo, hi in diagonal.uncovered(pieces, cfg.block_k) if write else ():
                        dk_acc[lo:hi, :] = jnp.zeros((hi - lo, dk_acc.shape[1]), jnp.float32)
                        dv_acc[lo:hi, :] = jnp.zeros((hi - lo, dv_acc.shape[1]), jnp.float32)
                    for piece in pieces:
                        step(piece, write)
            # a tile the diagonal does not cross is seen whole: no mask (v6e 2048²: 22742
            # -> 20890 cycles)
            pl.when(jnp.logical_not(diagonal.crossing(cfg, d)))(
                functools.partial(step, inside=True))
    elif fused and band.applies(cfg):
        # A window's tile wholly inside the band is seen whole: no mask (kernels/band.py)
        @pl.when(run)
        def _visible():
            inner = band.inside(cfg, i * cfg.block_q, j * cfg.block_k)     # no offsets here
            pl.when(inner)(functools.partial(step, inside=True))
            pl.when(jnp.logical_not(inner))(step)
    elif dense:
        step(write=first, dq_write=bool(fused) and j == 0)
    else:
        pl.when(run)(step)

    @pl.when(last)
    def _write():       # scale once per row; chunked: the chunk's float32 partial
        dk_ref[...] = (dk_acc[...] * cfg.scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)


def _dq_kernel(*refs, cfg: ForwardConfig, names: RefNames, has_ds):
    """Step ``(b, h, i, j)`` (or ``(b, h, t)`` of the visit grid): dQ_i += scale·dS'_ij K_j
    (and dS_ij out, for dBias); ``refs`` by name (:meth:`BackwardGridSpec.ref_names`)."""
    ins = name_refs(refs, names)
    offsets_ref = ins.get("offsets")
    dq_ref, ds_ref, dq_acc = ins["dq"], ins.get("ds"), ins["dq_acc"]
    b = pl.program_id(0)
    q_lengths, kv_lengths = forward_grid.static_lengths(cfg, ins["q_lengths"], ins["kv_lengths"])
    q_len, kv_len = q_lengths[b], kv_lengths[b]
    if "visits" in ins:                          # (i, j) from the forward's visit list
        i, j, first, last, run = visit.step_at(ins["visits"], pl.program_id(2))
        ranged = cfg.length_masked      # listed = positionally visible
    else:
        i, j = pl.program_id(2), pl.program_id(3)
        first, last, run, ranged = j == 0, j == cfg.num_kv_blocks - 1, None, True
    if ranged and blk.every_block_visible(cfg):   # dense grid, every step visible: kept as
        run, ranged = j < cfg.num_kv_blocks, False  # a branch (tpu_schedule.analyze), 1 compare
    if ranged:          # exactly the index map's unclamped steps (visit grid: run-time lengths)
        lo, hi = forward_grid._kv_range(cfg, 0, i, (q_len,), (kv_len,), offsets_ref)
        in_range = jnp.logical_and(lo <= j, j <= hi)
        run = in_range if run is None else jnp.logical_and(run, in_range)

    @pl.when(first)
    def _init():
        dq_acc[...] = jnp.zeros(dq_acc.shape, jnp.float32)

    @pl.when(run)
    def _compute():
        _, ds, ds_raw = _tile(ins, cfg, *forward_grid.global_starts(
            offsets_ref, i * cfg.block_q, j * cfg.block_k, q_len, kv_len))
        k = ins["k"][...]
        dq_acc[...] += jax.lax.dot_general(ds_raw.astype(k.dtype), k, (((1,), (0,)), ((), ())),
                                           preferred_element_type=jnp.float32)
        if has_ds:
            ds_ref[...] = ds

    if has_ds:
        @pl.when(jnp.logical_not(run))
        def _zero_ds():                     # dS of a skipped tile is zero (written, not DMA'd in)
            ds_ref[...] = jnp.zeros(ds_ref.shape, ds_ref.dtype)

    @pl.when(last)
    def _write():
        dq_ref[...] = (dq_acc[...] * cfg.scale).astype(dq_ref.dtype)   # scale once per row


def _call(gs: BackwardGridSpec, kernel_fn, kernel: str, interpret, q_lengths, kv_lengths, ops):
    kw = ({"has_ds": "ds" in gs.out_names} if kernel == "dq" else
          {"fused": gs.q_chunks if "dq" in gs.out_names else 0} if kernel == "dkdv" else {})
    return pl.pallas_call(
        functools.partial(kernel_fn, cfg=gs.config, names=gs.ref_names(), **kw),
        grid_spec=gs.pallas_grid_spec(),
        out_shape=fwd.varying_out_shapes(gs, q_lengths, kv_lengths, *ops),
        compiler_params=gs.compiler_params(interpret),
        cost_estimate=cost_estimate(gs, kernel),
        interpret=interpret,
        name=gs.name,
    )(q_lengths, kv_lengths, *ops)


@functools.partial(jax.jit, static_argnames=("cfg", "interpret", "with_dbias", "fused"))
def _backward(query, key, value, spec, out, lse, d_out, *, cfg: ForwardConfig, interpret,
              with_dbias=True, fused=False):
    """Gradients ``(dq, dk, dv, dbias | None)`` in the public layout (``fused``: 0 for the
    split kernels, else one kernel for dQ, dK, dV with its dQ in that many query chunks, see
    :func:`dkdv_grid_spec`)."""
    with_dbias = with_dbias and spec.bias is not None
    bias_shape = None if spec.bias is None else spec.bias.shape
    if with_dbias and dbias_config(cfg) != cfg:   # a bias [.., 1, S] / [.., T, 1]: read full
        cfg = dbias_config(cfg)
        b, n = spec.bias.shape[:2]
        spec = dataclasses.replace(spec, bias=jnp.broadcast_to(
            spec.bias, (b, n, cfg.q_len, cfg.kv_len)))
    Tp, Dvp = cfg.q_len_p, cfg.head_dim_v_p
    q_lengths, kv_lengths, ops = fwd._prepare(cfg, query, key, value, spec)
    # D_i = rowsum(dO ∘ O): [B, T, N] -> [B, N, T], an O(N·d) XLA fusion.
    di = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    di = jnp.swapaxes(di, 1, 2)
    lse = jnp.where(lse == -jnp.inf, 0.0, lse) * LOG2E   # log2 units; no key: P = 0 (mask)

    def pad(x):                                     # [B, N, T] -> [B, N, T_pad], pad rows 0
        return jnp.pad(x.astype(jnp.float32), ((0, 0), (0, 0), (0, Tp - cfg.q_len)))

    lse, di = pad(lse), pad(di)
    L = blk.LANES
    arrays = dict(zip(["q", "k", "v"] + [n for n in ("bias", "mask") if getattr(spec, n)
                                          is not None], ops))
    if spec.q_segment_ids is not None:
        arrays["q_segment_ids"], arrays["kv_segment_ids"] = ops[-2:]
        arrays["q_segment_ids_t"] = jnp.broadcast_to(
            ops[-2][:, None, :, 0], (cfg.batch, blk.SUBLANES, Tp))
        arrays["kv_segment_ids_t"] = jnp.broadcast_to(ops[-1][:, 0, :, None],
                                                      (cfg.batch, cfg.kv_len_p, L))
    # stats [B, N, T_pad, 256]: lse | D_i, each lane-replicated (the dQ kernel's rows);
    # stats_t [B, N, 8, T_pad]: lse and D_i as sublane rows 0 and 1 (the dK/dV kernel's).
    arrays["stats"] = jnp.concatenate([jnp.broadcast_to(x[..., None], (*x.shape, L))
                                       for x in (lse, di)], axis=-1)
    rows = jnp.zeros((*lse.shape[:2], blk.SUBLANES, Tp), jnp.float32)
    arrays["stats_t"] = rows.at[:, :, LSE_ROW].set(lse).at[:, :, D_ROW].set(di)
    do = jnp.swapaxes(d_out.astype(cfg.dtype), 1, 2)
    arrays["do"] = jnp.pad(do, ((0, 0), (0, 0), (0, Tp - cfg.q_len),
                                (0, Dvp - cfg.head_dim_v)))
    pre = fwd.offset_operands(cfg, spec)

    def run(gs, kernel_fn, kernel, given=arrays):
        return _call(gs, kernel_fn, kernel, interpret, q_lengths, kv_lengths,
                     pre + gs.visits() + [given[n] for n in gs.in_names])

    if fused:
        # dO [B, N, d_v, T] on lanes chips: one transpose from the caller's layout either way
        lanes = grads_on_lanes(cfg, fused)
        dk, dv, dq = run(dkdv_grid_spec(cfg, fused=fused), _dkdv_kernel, "dkdv", dict(
            arrays, do=jnp.swapaxes(arrays["do"], 2, 3)) if lanes else arrays)
        dq = jnp.swapaxes(dq, 2, 3) if lanes else dq            # float32 [B, N, T_pad, d]
        dq_outs = [(dq * cfg.scale).astype(cfg.dtype)]
        if fused > 1:                  # the chunks' float32 partials [n, B, K, S, d]
            dk, dv = (x.sum(axis=0).astype(cfg.dtype) for x in (dk, dv))
    else:
        dk, dv = run(dkdv_grid_spec(cfg), _dkdv_kernel, "dkdv")
        dq_outs = run(dq_grid_spec(cfg, with_dbias), _dq_kernel, "dq")
    unpad = lambda x, T, D: jnp.swapaxes(x[:, :, :T, :D], 1, 2)  # noqa: E731
    dq = unpad(dq_outs[0], cfg.q_len, cfg.head_dim)
    dk = unpad(dk, cfg.kv_len, cfg.head_dim)
    dv = unpad(dv, cfg.kv_len, cfg.head_dim_v)
    dbias = None
    if with_dbias:                  # dS itself, or summed in-kernel over the broadcast dims
        ds = (dq_outs[1] if _full_bias(cfg) and not fused else
              run(dbias_grid_spec(cfg), dbias_kernel, "dbias")[0])
        ds = ds[:, :, :cfg.q_len, :cfg.kv_len]
        summed = tuple(d for d in (2, 3) if bias_shape[d] == 1 and ds.shape[d] > 1)
        dbias = (ds.sum(axis=summed, keepdims=True) if summed else ds).astype(spec.bias.dtype)
    return dq, dk, dv, dbias


def flash_attention_backward(query, key, value, spec: AttentionSpec, out, lse, d_out, *,
                             block_q=None, block_k=None, interpret=None, chip=None,
                             fused=False):
    """The backward kernels on validated inputs: ``(dq, dk, dv, dbias | None)``.

    ``out [B, T, N, d_v]`` and ``lse [B, N, T]`` float32 come from
    :func:`forward.flash_attention_forward`; ``d_out`` is the cotangent of ``out``. Returns
    gradients in the public layout and the inputs' dtypes; ``dbias`` has the bias's shape
    (summed over its broadcast dims) or is ``None`` without a bias. ``fused``: one kernel for
    dQ, dK and dV instead of two (:func:`dkdv_grid_spec`, its resident dQ in query chunks
    where the whole does not fit VMEM; ``ValueError`` where even those do not).
    ``flash_attention(..., backward="auto")`` picks for you
    (:func:`backward_config.resolve_backward`; chapter 07).
    """
    if not isinstance(fused, bool):
        raise TypeError(f"fused: expected a bool, got {fused!r}")
    cfg, chunks = resolve_backward(spec, "fused" if fused else "split", block_q=block_q,
                                   block_k=block_k, chip=chip)
    return _backward(query, key, value, spec, out, lse, d_out, cfg=cfg,
                     interpret=fwd._resolve_interpret(interpret), fused=chunks)
