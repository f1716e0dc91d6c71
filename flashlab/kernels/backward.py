"""The Pallas TPU backward kernels of FlashAttention (Dao 2023, FlashAttention-2 Algorithm 2).

With ``P = exp(S - lse)`` recomputed from Q, K and the forward's ``lse`` (never stored):

    dV = Pᵀ dO      dP = dO Vᵀ      D_i = rowsum(dO ∘ O)      dS = P ∘ (dP − D)
    dQ = scale · dS' K              dK = scale · dS'ᵀ Q

with ``dS' = dS ∘ (1 − tanh²)`` under a soft cap (``dS' = dS`` without).

Two kernels, split as in FlashAttention-2 (the choice is argued in chapter 07):

* **dK/dV kernel**, grid ``(batch, kv_heads, T_c, G, T_r)``: kv block ``j`` of kv head ``hk``
  stays in VMEM while the ``G`` query heads sharing it (GQA) and their q blocks ``i`` stream
  past; dK_j, dV_j accumulate in float32 VMEM scratch and are written once. The last two axes
  are "arbitrary" (they carry the accumulators), the first three "parallel". K/V are never
  repeated in HBM: the G query heads are a grid axis.
* **dQ kernel**, grid ``(batch, heads, T_r, T_c)``, the forward's: dQ_i accumulates over the
  kv axis ("arbitrary"). With a bias it also writes dS ``[B, N, T, S]`` float32 blocks, which
  the wrapper sums over the bias's broadcast dims: that is dBias.

``D_i`` is an O(N·d) elementwise product and row sum: plain XLA, fused, before the kernels.

Block skipping as in the forward, with neither compute nor DMA: the dQ kernel clamps ``j``
into :func:`blocks.kv_block_range`, the dK/dV kernel clamps ``i`` into
:func:`blocks.q_block_range`; each kernel's ``pl.when`` tests the same range, so the index
maps and the compute agree by construction.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flashlab.contract.masks import AttentionSpec
from flashlab.compat import pallas as compat
from flashlab.kernels import blocks as blk
from flashlab.kernels import forward as fwd
from flashlab.kernels import forward_grid
from flashlab.compat.pallas import pl

__all__ = ["BackwardGridSpec", "make_backward_config", "dkdv_grid_spec", "dq_grid_spec",
           "backward_grid_specs", "flash_attention_backward"]

ForwardConfig = forward_grid.ForwardConfig
STATS_D_LANE = blk.LANES // 2      # the stats operand: lse in lanes [0, 64), D_i in [64, 128)


def make_backward_config(spec: AttentionSpec, *, block_q=None, block_k=None,
                         chip=None) -> ForwardConfig:
    """The backward kernels' configuration: the forward's, with the backward's block sizes.

    Explicit ``block_q``/``block_k`` (the ones given to ``flash_attention``) are used when they
    fit :func:`blocks.backward_vmem_bytes`; missing or too large ones come from
    :func:`blocks.choose_backward_block_sizes` for ``chip`` (``None``: the compile target,
    :func:`blocks.resolve_chip`).
    """
    chip = blk.resolve_chip(chip)
    dt = jnp.dtype(spec.dtype)
    bias_dtype = None
    if spec.bias is not None:
        bias_dtype = jnp.dtype(spec.bias.dtype)
        if bias_dtype not in forward_grid.SUPPORTED_DTYPES:
            bias_dtype = jnp.dtype(jnp.float32)
    kw = dict(head_dim_v=spec.head_dim_v, bias_dtype=bias_dtype, has_mask=spec.mask is not None,
              has_segments=spec.q_segment_ids is not None)
    auto_q, auto_k = blk.choose_backward_block_sizes(spec.q_len, spec.kv_len, spec.head_dim, dt,
                                                     chip, **kw)
    bq = auto_q if block_q is None else block_q
    bk = auto_k if block_k is None else block_k
    if not blk._backward_fits(bq, bk, spec.head_dim, dt, chip, **kw):
        bq, bk = auto_q, auto_k
    return forward_grid.make_config(spec, block_q=bq, block_k=bk, chip=chip)


# ----------------------------------------------------------------------------- grids as data

@dataclasses.dataclass(frozen=True)
class BackwardGridSpec(forward_grid.ForwardGridSpec):
    """One backward kernel's grid and BlockSpecs (see :class:`forward.ForwardGridSpec`).

    Index maps take ``(*grid indices, q_lengths, kv_lengths)`` and run on ints and NumPy
    arrays too, so :mod:`flashlab.instruments.traffic` replays them.
    """

    name: str = ""


def _q_side_operands(cfg, q_map, kv_map, scores_map_for, qseg_map, kvseg_map):
    """Inputs both kernels read: names, BlockSpecs, padded HBM shapes."""
    B, N = cfg.batch, cfg.num_heads
    bq, bk = cfg.block_q, cfg.block_k
    Tp, Sp, Dp, Dvp = cfg.q_len_p, cfg.kv_len_p, cfg.head_dim_p, cfg.head_dim_v_p
    sds = jax.ShapeDtypeStruct
    names = ["q", "k", "v", "do", "stats"]
    specs = [pl.BlockSpec((None, None, bq, Dp), q_map),
             pl.BlockSpec((None, None, bk, Dp), kv_map),
             pl.BlockSpec((None, None, bk, Dvp), kv_map),
             pl.BlockSpec((None, None, bq, Dvp), q_map),
             pl.BlockSpec((None, None, bq, blk.LANES), q_map)]      # lse | D_i lanes
    shapes = [sds((B, N, Tp, Dp), cfg.dtype), sds((B, cfg.num_kv_heads, Sp, Dp), cfg.dtype),
              sds((B, cfg.num_kv_heads, Sp, Dvp), cfg.dtype), sds((B, N, Tp, Dvp), cfg.dtype),
              sds((B, N, Tp, blk.LANES), jnp.float32)]
    n2, s2, sh2 = forward_grid.mask_operands(cfg, scores_map_for, qseg_map, kvseg_map)
    return names + n2, specs + s2, shapes + sh2


def _q_range(cfg, b, j, q_lengths, kv_lengths, offsets=None):
    return blk.q_block_range(j, q_lengths[b], kv_lengths[b], block_q=cfg.block_q,
                             block_k=cfg.block_k,
                             is_causal=cfg.is_causal, window=cfg.window,
                             shift=forward_grid.offset_shift(offsets))


def dkdv_grid_spec(cfg: ForwardConfig) -> BackwardGridSpec:
    """The dK/dV kernel: grid ``(b, hk, j, g, i)``; query head ``h = hk·G + g``."""
    G = cfg.group_size
    bk = cfg.block_k
    Sp, Dp, Dvp = cfg.kv_len_p, cfg.head_dim_p, cfg.head_dim_v_p

    def q_block(b, j, i, q_lengths, kv_lengths, offsets=None):
        lo, hi = _q_range(cfg, b, j, q_lengths, kv_lengths, offsets)
        return blk.clamp_block(i, lo, hi, cfg.num_q_blocks)   # same clamp, on the q axis

    def q_map(b, hk, j, g, i, q_lengths, kv_lengths, offsets=None):  # Q_i, dO_i, lse_i, D_i
        return (b, hk * G + g, q_block(b, j, i, q_lengths, kv_lengths, offsets), 0)

    def kv_map(b, hk, j, g, i, q_lengths, kv_lengths, offsets=None):  # K_j, V_j, dK_j, dV_j
        return (b, hk, j, 0)

    def scores_map_for(bcast):
        def scores_map(b, hk, j, g, i, q_lengths, kv_lengths, offsets=None):
            return (0 if bcast[0] else b, 0 if bcast[1] else hk * G + g,
                    q_block(b, j, i, q_lengths, kv_lengths, offsets), j)
        return scores_map

    def qseg_map(b, hk, j, g, i, q_lengths, kv_lengths, offsets=None):
        return (b, q_block(b, j, i, q_lengths, kv_lengths, offsets), 0)

    def kvseg_map(b, hk, j, g, i, q_lengths, kv_lengths, offsets=None):
        return (b, 0, j)

    names, specs, shapes = _q_side_operands(cfg, q_map, kv_map, scores_map_for, qseg_map,
                                            kvseg_map)
    sds = jax.ShapeDtypeStruct
    B, K = cfg.batch, cfg.num_kv_heads
    out_specs = (pl.BlockSpec((None, None, bk, Dp), kv_map),
                 pl.BlockSpec((None, None, bk, Dvp), kv_map))
    out_shapes = (sds((B, K, Sp, Dp), cfg.dtype), sds((B, K, Sp, Dvp), cfg.dtype))
    scratch = (compat.VMEM((bk, Dp), jnp.float32), compat.VMEM((bk, Dvp), jnp.float32))
    return BackwardGridSpec(
        config=cfg, grid=(B, K, cfg.num_kv_blocks, G, cfg.num_q_blocks),
        in_names=tuple(names), in_specs=tuple(specs), in_shapes=tuple(shapes),
        out_names=("dk", "dv"), out_specs=out_specs, out_shapes=out_shapes,
        scratch_shapes=scratch,
        dimension_semantics=("parallel", "parallel", "parallel", "arbitrary", "arbitrary"),
        name="flashlab_flash_backward_dkdv")


def dq_grid_spec(cfg: ForwardConfig, with_dbias: bool = True) -> BackwardGridSpec:
    """The dQ kernel: the forward's grid ``(b, h, i, j)``, plus a dS output for dBias.

    The dS output ``[B, N, T, S]`` float32 exists only with a bias that is differentiated
    (``with_dbias``; a constant bias, e.g. ALiBi, gets none).
    """
    bq, bk = cfg.block_q, cfg.block_k
    B, N, Tp, Sp, Dp = cfg.batch, cfg.num_heads, cfg.q_len_p, cfg.kv_len_p, cfg.head_dim_p
    maps = forward_grid.index_maps(cfg)                         # the forward's grid and maps

    def ds_map(b, h, i, j, q_lengths, kv_lengths, offsets=None):  # every block written
        return (b, h, i, j)

    names, specs, shapes = _q_side_operands(cfg, maps.q, maps.kv, maps.scores_for, maps.q_seg,
                                            maps.kv_seg)
    sds = jax.ShapeDtypeStruct
    out_names, out_specs = ["dq"], [pl.BlockSpec((None, None, bq, Dp), maps.q)]
    out_shapes = [sds((B, N, Tp, Dp), cfg.dtype)]
    if cfg.bias_bcast is not None and with_dbias:
        out_names.append("ds")
        out_specs.append(pl.BlockSpec((None, None, bq, bk), ds_map))
        out_shapes.append(sds((B, N, Tp, Sp), jnp.float32))
    return BackwardGridSpec(
        config=cfg, grid=cfg.grid, in_names=tuple(names), in_specs=tuple(specs),
        in_shapes=tuple(shapes), out_names=tuple(out_names), out_specs=tuple(out_specs),
        out_shapes=tuple(out_shapes), scratch_shapes=(compat.VMEM((bq, Dp), jnp.float32),),
        name="flashlab_flash_backward_dq")


def backward_grid_specs(cfg: ForwardConfig, with_dbias: bool = True
                        ) -> dict[str, BackwardGridSpec]:
    """``{"dkdv": ..., "dq": ...}``: both backward kernels' grids, in the order they run."""
    return {"dkdv": dkdv_grid_spec(cfg), "dq": dq_grid_spec(cfg, with_dbias)}


# ----------------------------------------------------------------------------- the kernels

def _recompute(ins, cfg: ForwardConfig, q_start, k_start, q_len, kv_len):
    """Recompute one ``[B_r, B_c]`` tile: returns ``(q, k, do, P, dS, dS')`` (float32 P, dS).

    ``dS = P ∘ (dP − D)`` is the gradient w.r.t. the logits after the soft cap and bias (so
    it is dBias); ``dS'`` is w.r.t. ``scale·q·k`` (through the soft cap's ``1 − tanh²``).
    """
    q, k, v, do = ins["q"][...], ins["k"][...], ins["v"][...], ins["do"][...]
    nt = (((1,), (1,)), ((), ()))                                 # A Bᵀ
    s, t, visible = fwd.score_tile(ins, cfg, q_start, k_start, q_len, kv_len)  # [B_r, B_c]
    stats = ins["stats"][...]                                     # [B_r, 128]
    lse, di = stats[:, :1], stats[:, STATS_D_LANE:STATS_D_LANE + 1]  # [B_r, 1] each
    lse = jnp.where(lse == -jnp.inf, 0.0, lse)                    # rows with no key: P = 0
    p = jnp.where(visible, jnp.exp(s - lse), 0.0)                 # [B_r, B_c]
    dp = jax.lax.dot_general(do, v, nt, preferred_element_type=jnp.float32)
    ds = p * (dp - di)
    ds_raw = ds if t is None else ds * (1.0 - t * t)
    return q, k, do, p, ds, ds_raw


def _dkdv_kernel(q_lengths_ref, kv_lengths_ref, *refs, cfg: ForwardConfig, names):
    """Step ``(b, hk, j, g, i)``: dV_j += P_ijᵀ dO_i, dK_j += scale·dS'_ijᵀ Q_i."""
    offsets_ref, refs = (refs[0], refs[1:]) if cfg.has_offsets else (None, refs)
    n_in = len(names)
    ins = dict(zip(names, refs[:n_in]))
    dk_ref, dv_ref, dk_acc, dv_acc = refs[n_in:]
    b, j, g, i = pl.program_id(0), pl.program_id(2), pl.program_id(3), pl.program_id(4)
    q_len, kv_len = q_lengths_ref[b], kv_lengths_ref[b]

    @pl.when(jnp.logical_and(g == 0, i == 0))
    def _init():
        dk_acc[...] = jnp.zeros(dk_acc.shape, jnp.float32)
        dv_acc[...] = jnp.zeros(dv_acc.shape, jnp.float32)

    lo, hi = _q_range(cfg, 0, j, (q_len,), (kv_len,), offsets_ref)
    run = jnp.logical_and(lo <= i, i <= hi)        # exactly the index map's unclamped steps

    @pl.when(run)
    def _compute():
        q, _, do, p, _, ds_raw = _recompute(ins, cfg, *forward_grid.global_starts(
            offsets_ref, i * cfg.block_q, j * cfg.block_k, q_len, kv_len))
        tn = (((0,), (0,)), ((), ()))                              # Aᵀ B
        dv_acc[...] += jax.lax.dot_general(p.astype(do.dtype), do, tn,
                                           preferred_element_type=jnp.float32)
        dk_acc[...] += jax.lax.dot_general(ds_raw.astype(q.dtype), q, tn,
                                           preferred_element_type=jnp.float32) * cfg.scale

    @pl.when(jnp.logical_and(g == cfg.group_size - 1, i == cfg.num_q_blocks - 1))
    def _write():
        dk_ref[...] = dk_acc[...].astype(dk_ref.dtype)
        dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)


def _dq_kernel(q_lengths_ref, kv_lengths_ref, *refs, cfg: ForwardConfig, names, has_ds):
    """Step ``(b, h, i, j)``: dQ_i += scale·dS'_ij K_j (and dS_ij out, for dBias)."""
    offsets_ref, refs = (refs[0], refs[1:]) if cfg.has_offsets else (None, refs)
    n_in = len(names)
    ins = dict(zip(names, refs[:n_in]))
    dq_ref = refs[n_in]
    ds_ref = refs[n_in + 1] if has_ds else None
    dq_acc = refs[n_in + 1 + has_ds]
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    q_len, kv_len = q_lengths_ref[b], kv_lengths_ref[b]

    @pl.when(j == 0)
    def _init():
        dq_acc[...] = jnp.zeros(dq_acc.shape, jnp.float32)

    lo, hi = forward_grid._kv_range(cfg, 0, i, (q_len,), (kv_len,), offsets_ref)
    run = jnp.logical_and(lo <= j, j <= hi)

    @pl.when(run)
    def _compute():
        _, k, _, _, ds, ds_raw = _recompute(ins, cfg, *forward_grid.global_starts(
            offsets_ref, i * cfg.block_q, j * cfg.block_k, q_len, kv_len))
        dq_acc[...] += jax.lax.dot_general(ds_raw.astype(k.dtype), k, (((1,), (0,)), ((), ())),
                                           preferred_element_type=jnp.float32) * cfg.scale
        if has_ds:
            ds_ref[...] = ds

    if has_ds:
        @pl.when(jnp.logical_not(run))
        def _zero_ds():                     # dS of a skipped tile is zero (written, not DMA'd in)
            ds_ref[...] = jnp.zeros(ds_ref.shape, ds_ref.dtype)

    @pl.when(j == cfg.num_kv_blocks - 1)
    def _write():
        dq_ref[...] = dq_acc[...].astype(dq_ref.dtype)


def _cost_estimate(gs: BackwardGridSpec, kernel: str) -> Any:
    """FLOPs, exps and HBM bytes counting only the computed tiles (static skipping)."""
    cfg = gs.config
    visible = blk.num_visible_blocks(cfg.num_q_blocks, cfg.num_kv_blocks, q_len=cfg.q_len_p,
                                     kv_len=cfg.kv_len, block_q=cfg.block_q, block_k=cfg.block_k,
                                     is_causal=cfg.is_causal and not cfg.has_offsets,
                                     window=None if cfg.has_offsets else cfg.window)
    bh = cfg.batch * cfg.num_heads
    pairs = bh * visible
    tile = cfg.block_q * cfg.block_k
    d, dv = cfg.head_dim_p, cfg.head_dim_v_p
    # dK/dV: S, dP, dV, dK (4 matmuls); dQ: S, dP, dQ (3)
    flops = 2 * pairs * tile * ((2 * d + 2 * dv) if kernel == "dkdv" else (2 * d + dv))
    exps = pairs * tile * (2 if cfg.soft_cap is not None else 1)

    def block_bytes(name):
        spec, shape = gs.spec(name), gs.shape(name)
        return int(np.prod([x for x in spec.block_shape if x is not None])) * \
            jnp.dtype(shape.dtype).itemsize

    fixed = ("k", "v", "dk", "dv") if kernel == "dkdv" else ("q", "do", "stats",
                                                              "q_segment_ids", "dq")
    outer = (cfg.batch * cfg.num_kv_heads * cfg.num_kv_blocks if kernel == "dkdv"
             else bh * cfg.num_q_blocks)
    nbytes = 0
    for name in gs.in_names + gs.out_names:
        if name in fixed:
            nbytes += outer * block_bytes(name)
        elif name == "ds":
            nbytes += bh * cfg.num_q_blocks * cfg.num_kv_blocks * block_bytes(name)
        else:
            nbytes += pairs * block_bytes(name)
    return compat.CostEstimate(flops=int(flops), transcendentals=int(exps),
                               bytes_accessed=int(nbytes))


def _call(gs: BackwardGridSpec, kernel_fn, kernel: str, interpret, q_lengths, kv_lengths, ops):
    kwargs = {}
    if interpret is False:
        kwargs["vmem_limit_bytes"] = blk.vmem_limit_bytes(gs.config.chip)
    kw = {"has_ds": "ds" in gs.out_names} if kernel == "dq" else {}
    return pl.pallas_call(
        functools.partial(kernel_fn, cfg=gs.config, names=gs.in_names, **kw),
        grid_spec=gs.pallas_grid_spec(),
        out_shape=fwd.varying_out_shapes(gs, q_lengths, kv_lengths, *ops),
        compiler_params=compat.CompilerParams(dimension_semantics=gs.dimension_semantics,
                                              **kwargs),
        cost_estimate=_cost_estimate(gs, kernel),
        interpret=interpret,
        name=gs.name,
    )(q_lengths, kv_lengths, *ops)


@functools.partial(jax.jit, static_argnames=("cfg", "interpret", "with_dbias"))
def _backward(query, key, value, spec, out, lse, d_out, *, cfg: ForwardConfig, interpret,
              with_dbias=True):
    """Gradients ``(dq, dk, dv, dbias | None)`` in the public layout."""
    with_dbias = with_dbias and spec.bias is not None
    Tp, Dvp = cfg.q_len_p, cfg.head_dim_v_p
    q_lengths, kv_lengths, ops = fwd._prepare(cfg, query, key, value, spec)
    # D_i = rowsum(dO ∘ O): [B, T, N] -> [B, N, T], an O(N·d) XLA fusion.
    di = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    di = jnp.swapaxes(di, 1, 2)

    # stats [B, N, T_pad, 128] float32: lse in lanes 0..63, D_i in lanes 64..127 (one
    # lane-replicated block instead of two: a [B_r] vector is not a tile; pad rows are 0).
    def pad(x):
        return jnp.pad(x.astype(jnp.float32), ((0, 0), (0, 0), (0, Tp - cfg.q_len)))

    half = (*lse.shape[:2], Tp, STATS_D_LANE)
    stats = jnp.concatenate([jnp.broadcast_to(pad(lse)[..., None], half),
                             jnp.broadcast_to(pad(di)[..., None], half)], axis=-1)

    do = jnp.swapaxes(d_out.astype(cfg.dtype), 1, 2)
    do = jnp.pad(do, ((0, 0), (0, 0), (0, Tp - cfg.q_len), (0, Dvp - cfg.head_dim_v)))
    ops = fwd.offset_operands(cfg, spec) + ops[:3] + [do, stats] + ops[3:]
    dk, dv = _call(dkdv_grid_spec(cfg), _dkdv_kernel, "dkdv", interpret, q_lengths,
                   kv_lengths, ops)
    dq_outs = _call(dq_grid_spec(cfg, with_dbias), _dq_kernel, "dq", interpret, q_lengths,
                    kv_lengths, ops)
    unpad = lambda x, T, D: jnp.swapaxes(x[:, :, :T, :D], 1, 2)  # noqa: E731
    dq = unpad(dq_outs[0], cfg.q_len, cfg.head_dim)
    dk = unpad(dk, cfg.kv_len, cfg.head_dim)
    dv = unpad(dv, cfg.kv_len, cfg.head_dim_v)
    dbias = None
    if with_dbias:
        ds = dq_outs[1][:, :, :cfg.q_len, :cfg.kv_len]                  # [B, N, T, S] float32
        axes = tuple(a for a in (0, 1) if spec.bias.shape[a] == 1 and ds.shape[a] > 1)
        dbias = jnp.sum(ds, axis=axes, keepdims=True).astype(spec.bias.dtype)
    return dq, dk, dv, dbias


def flash_attention_backward(query, key, value, spec: AttentionSpec, out, lse, d_out, *,
                             block_q=None, block_k=None, interpret=None, chip=None):
    """The backward kernels on validated inputs: ``(dq, dk, dv, dbias | None)``.

    ``out [B, T, N, d_v]`` and ``lse [B, N, T]`` float32 come from
    :func:`forward.flash_attention_forward`; ``d_out`` is the cotangent of ``out``. Returns
    gradients in the public layout and the inputs' dtypes; ``dbias`` has the bias's shape
    (summed over its broadcast dims) or is ``None`` without a bias.
    """
    cfg = make_backward_config(spec, block_q=block_q, block_k=block_k, chip=chip)
    return _backward(query, key, value, spec, out, lse, d_out, cfg=cfg,
                     interpret=fwd._resolve_interpret(interpret))
