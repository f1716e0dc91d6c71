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
  repeated in HBM: the G query heads are a grid axis. It computes the transposed tile
  ``Sᵀ = K Qᵀ`` ``[B_c, B_r]``, so dV and dK are plain matmuls (no XLU transposes).
* **dQ kernel**, grid ``(batch, heads, T_r, T_c)``, the forward's: dQ_i accumulates over the
  kv axis ("arbitrary"). With a full-shape bias ``[B, N, T, S]`` it also writes dS: that is
  dBias.
* **dBias kernel**, only for a bias broadcast over batch and/or heads: grid (bias axes,
  ``T_r``, ``T_c``, broadcast axes), dBias accumulated in its float32 output block over the
  innermost broadcast axes (:mod:`flashlab.kernels.backward_dbias`): no ``[B, N, T, S]``
  array.

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

from .. import masks
from ..masks import AttentionSpec
from . import _pallas_compat as compat
from . import blocks as blk
from . import forward as fwd
from ._pallas_compat import pl

__all__ = ["BackwardGridSpec", "make_backward_config", "dkdv_grid_spec", "dq_grid_spec",
           "backward_grid_specs", "flash_attention_backward"]

ForwardConfig = fwd.ForwardConfig
# The dQ kernel's statistics ``stats [B, N, T, 256]`` float32: lse in lanes [0, 128), D_i in
# [128, 256), each lane-replicated, so a [B_r, B_c] broadcast is whole vregs reused (no lane
# broadcast). The dK/dV kernel's ``stats_t [B, N, 8, T]``: lse in sublane row 0, D_i in row 1,
# positions on lanes, as its transposed tile [B_c, B_r] wants them.
STATS_LANES = 2 * blk.LANES
LSE_ROW, D_ROW = 0, 1
LOG2E = float(np.log2(np.e))       # lse is stored (and P computed) in log2 units


def make_backward_config(spec: AttentionSpec, *, block_q=None, block_k=None,
                         chip=None) -> ForwardConfig:
    """The backward kernels' configuration: the forward's, with the backward's block sizes.

    Explicit ``block_q``/``block_k`` (the ones given to ``flash_attention``) are used when they
    fit :func:`blocks.backward_vmem_bytes`; missing or too large ones come from
    :func:`blocks.choose_backward_block_sizes` for ``chip`` (``None``: the compile target,
    :func:`blocks.resolve_chip`). ``block_q`` is rounded up to a multiple of 128: the dK/dV
    kernel computes the transposed tile ``Sᵀ [B_c, B_r]``, where B_r is the lane dim.
    """
    chip = blk.resolve_chip(chip)
    dt = jnp.dtype(spec.dtype)
    bias_dtype = None
    if spec.bias is not None:
        bias_dtype = jnp.dtype(spec.bias.dtype)
        if bias_dtype not in fwd.SUPPORTED_DTYPES:
            bias_dtype = jnp.dtype(jnp.float32)
    kw = dict(head_dim_v=spec.head_dim_v, bias_dtype=bias_dtype, has_mask=spec.mask is not None,
              has_segments=spec.q_segment_ids is not None)
    auto_q, auto_k = blk.choose_backward_block_sizes(spec.q_len, spec.kv_len, spec.head_dim, dt,
                                                     chip, **kw)
    auto_q = blk.round_up(auto_q, blk.LANES)
    bq = auto_q if block_q is None else blk.round_up(block_q, blk.LANES)
    bk = auto_k if block_k is None else block_k
    if not blk._backward_fits(bq, bk, spec.head_dim, dt, chip, **kw):
        bq, bk = auto_q, auto_k
    return fwd.make_config(spec, block_q=bq, block_k=bk, chip=chip)


# ----------------------------------------------------------------------------- grids as data

@dataclasses.dataclass(frozen=True)
class BackwardGridSpec(fwd.ForwardGridSpec):
    """One backward kernel's grid and BlockSpecs (see :class:`forward.ForwardGridSpec`).

    Index maps take ``(*grid indices, q_lengths, kv_lengths)`` and run on ints and NumPy
    arrays too, so :mod:`flashlab.traffic` replays them.
    """

    name: str = ""


def _q_side_operands(cfg, q_map, kv_map, scores_map_for, qseg_map, kvseg_map,
                     transposed=False):
    """Inputs both kernels read: names, BlockSpecs, padded HBM shapes.

    ``transposed`` (the dK/dV kernel): the statistics are ``stats_t`` rows ``[8, B_r]`` and
    the segment ids swap orientation (q ids on lanes ``[8, B_r]``, kv ids on sublanes
    ``[B_c, 128]``), as the tile ``Sᵀ [B_c, B_r]`` wants them.
    """
    B, N = cfg.batch, cfg.num_heads
    bq, bk = cfg.block_q, cfg.block_k
    Tp, Sp, Dp, Dvp = cfg.q_len_p, cfg.kv_len_p, cfg.head_dim_p, cfg.head_dim_v_p
    L, SL = blk.LANES, blk.SUBLANES
    sds = jax.ShapeDtypeStruct
    names = ["q", "k", "v", "do"]
    specs = [pl.BlockSpec((None, None, bq, Dp), q_map),
             pl.BlockSpec((None, None, bk, Dp), kv_map),
             pl.BlockSpec((None, None, bk, Dvp), kv_map),
             pl.BlockSpec((None, None, bq, Dvp), q_map)]
    shapes = [sds((B, N, Tp, Dp), cfg.dtype), sds((B, cfg.num_kv_heads, Sp, Dp), cfg.dtype),
              sds((B, cfg.num_kv_heads, Sp, Dvp), cfg.dtype), sds((B, N, Tp, Dvp), cfg.dtype)]
    if transposed:
        def rows_map(*idx):
            b, h, i, _ = q_map(*idx)
            return (b, h, 0, i)
        names.append("stats_t")
        specs.append(pl.BlockSpec((None, None, SL, bq), rows_map))
        shapes.append(sds((B, N, SL, Tp), jnp.float32))
    else:
        names.append("stats")
        specs.append(pl.BlockSpec((None, None, bq, STATS_LANES), q_map))
        shapes.append(sds((B, N, Tp, STATS_LANES), jnp.float32))
    n2, s2, sh2 = fwd.mask_operands(cfg, scores_map_for, qseg_map, kvseg_map)
    if transposed and cfg.has_segments:      # same ids, the other orientation
        def qseg_t(*idx):
            b, i, _ = qseg_map(*idx)
            return (b, 0, i)

        def kvseg_t(*idx):
            b, _, j = kvseg_map(*idx)
            return (b, j, 0)
        n2, s2, sh2 = n2[:-2], s2[:-2], sh2[:-2]
        n2 += ["q_segment_ids_t", "kv_segment_ids_t"]
        s2 += [pl.BlockSpec((None, SL, bq), qseg_t), pl.BlockSpec((None, bk, L), kvseg_t)]
        sh2 += [sds((B, SL, Tp), jnp.int32), sds((B, Sp, L), jnp.int32)]
    return names + n2, specs + s2, shapes + sh2


class _Const:
    """``lengths[b] -> n`` for every ``b``: a length known when the kernel is built."""

    def __init__(self, n: int):
        self.n = n

    def __getitem__(self, b) -> int:
        return self.n


def _lengths(cfg, q_lengths, kv_lengths):
    """The lengths index maps and kernels read: Python ints when they are static (none
    given, no kv padding, no offsets), so every block range folds to a few scalar ops per
    grid step instead of SMEM loads, divisions and clamps (~110 cycles per step on v6e)."""
    if cfg.mask_q_len or cfg.mask_kv_len or cfg.has_offsets:
        return q_lengths, kv_lengths
    return _Const(cfg.q_len), _Const(cfg.kv_len)


def _static_maps(cfg, f):
    """Index map ``f`` reading :func:`_lengths` instead of the scalar-prefetched ones."""
    def m(*idx):
        *grid, q_lengths, kv_lengths = idx[:len(idx) - cfg.has_offsets]
        return f(*grid, *_lengths(cfg, q_lengths, kv_lengths), *idx[len(idx) - cfg.has_offsets:])
    return m


def _q_range(cfg, b, j, q_lengths, kv_lengths, offsets=None):
    q_lengths, kv_lengths = _lengths(cfg, q_lengths, kv_lengths)
    return blk.q_block_range(j, q_lengths[b], kv_lengths[b], block_q=cfg.block_q,
                             block_k=cfg.block_k, num_q_blocks=cfg.num_q_blocks,
                             is_causal=cfg.is_causal, window=cfg.window,
                             shift=fwd.offset_shift(offsets))


def dkdv_grid_spec(cfg: ForwardConfig, fused: bool = False) -> BackwardGridSpec:
    """The dK/dV kernel: grid ``(b, hk, j, g, i)``; query head ``h = hk·G + g``.

    ``fused``: the fused backward option, one kernel for dQ, dK and dV. Each step also writes
    its partial ``dQ_i^(j) = dS'_ij K_j`` (unscaled) as a float32 block of ``dq_part
    [B, N, T_c, T, d]`` (zeros for a skipped step), summed over ``T_c`` in XLA after: no
    atomics, no revisited output, at the price of ``T_c`` float32 copies of dQ in HBM.
    """
    G = cfg.group_size
    bk = cfg.block_k
    Sp, Dp, Dvp = cfg.kv_len_p, cfg.head_dim_p, cfg.head_dim_v_p

    def q_block(b, j, i, q_lengths, kv_lengths, offsets=None):
        lo, hi = _q_range(cfg, b, j, q_lengths, kv_lengths, offsets)
        return blk.clamp_kv_block(i, lo, hi, cfg.num_q_blocks)   # same clamp, on the q axis

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
                                            kvseg_map, transposed=True)
    sds = jax.ShapeDtypeStruct
    B, K = cfg.batch, cfg.num_kv_heads
    out_specs = (pl.BlockSpec((None, None, bk, Dp), kv_map),
                 pl.BlockSpec((None, None, bk, Dvp), kv_map))
    out_shapes = (sds((B, K, Sp, Dp), cfg.dtype), sds((B, K, Sp, Dvp), cfg.dtype))
    out_names = ("dk", "dv")
    if fused:                        # every (b, h, j, i) block written once: unclamped i
        def dq_part_map(b, hk, j, g, i, *_):
            return (b, hk * G + g, j, i, 0)
        out_names += ("dq_part",)
        out_specs += (pl.BlockSpec((None, None, None, cfg.block_q, Dp), dq_part_map),)
        out_shapes += (sds((B, cfg.num_heads, cfg.num_kv_blocks, cfg.q_len_p, Dp),
                           jnp.float32),)
    scratch = (compat.VMEM((bk, Dp), jnp.float32), compat.VMEM((bk, Dvp), jnp.float32))
    return BackwardGridSpec(
        config=cfg, grid=(B, K, cfg.num_kv_blocks, G, cfg.num_q_blocks),
        in_names=tuple(names), in_specs=tuple(specs), in_shapes=tuple(shapes),
        out_names=out_names, out_specs=out_specs, out_shapes=out_shapes,
        scratch_shapes=scratch,
        dimension_semantics=("parallel", "parallel", "parallel", "arbitrary", "arbitrary"),
        name="flashlab_flash_backward_dkdv" + ("_fused" if fused else ""))


def dq_grid_spec(cfg: ForwardConfig, with_dbias: bool = True) -> BackwardGridSpec:
    """The dQ kernel: the forward's grid ``(b, h, i, j)``, plus a dS output for dBias.

    The dS output ``[B, N, T, S]`` float32 exists only with a full-shape bias that is
    differentiated (``with_dbias``; a constant bias, e.g. ALiBi, gets none; a bias broadcast
    over batch or heads gets :func:`flashlab.kernels.backward_dbias.dbias_grid_spec` instead).
    """
    bq, bk = cfg.block_q, cfg.block_k
    B, N, Tp, Sp, Dp = cfg.batch, cfg.num_heads, cfg.q_len_p, cfg.kv_len_p, cfg.head_dim_p
    base = fwd.index_maps(cfg)                         # the forward's grid and maps
    maps = fwd.IndexMaps(_static_maps(cfg, base.q), _static_maps(cfg, base.kv),
                         lambda bc: _static_maps(cfg, base.scores_for(bc)),
                         _static_maps(cfg, base.q_seg), _static_maps(cfg, base.kv_seg))

    def ds_map(b, h, i, j, q_lengths, kv_lengths, offsets=None):  # every block written
        return (b, h, i, j)

    names, specs, shapes = _q_side_operands(cfg, maps.q, maps.kv, maps.scores_for, maps.q_seg,
                                            maps.kv_seg)
    sds = jax.ShapeDtypeStruct
    out_names, out_specs = ["dq"], [pl.BlockSpec((None, None, bq, Dp), maps.q)]
    out_shapes = [sds((B, N, Tp, Dp), cfg.dtype)]
    if _full_bias(cfg) and with_dbias:
        out_names.append("ds")
        out_specs.append(pl.BlockSpec((None, None, bq, bk), ds_map))
        out_shapes.append(sds((B, N, Tp, Sp), jnp.float32))
    return BackwardGridSpec(
        config=cfg, grid=cfg.grid, in_names=tuple(names), in_specs=tuple(specs),
        in_shapes=tuple(shapes), out_names=tuple(out_names), out_specs=tuple(out_specs),
        out_shapes=tuple(out_shapes), scratch_shapes=(compat.VMEM((bq, Dp), jnp.float32),),
        name="flashlab_flash_backward_dq")


def _full_bias(cfg: ForwardConfig) -> bool:
    """A bias of the scores' full shape ``[B, N, T, S]``: its gradient is dS itself."""
    return cfg.bias_bcast is not None and not any(cfg.bias_bcast)


def backward_grid_specs(cfg: ForwardConfig, with_dbias: bool = True
                        ) -> dict[str, BackwardGridSpec]:
    """``{"dkdv": ..., "dq": ...[, "dbias": ...]}``: the backward kernels' grids, in the order
    they run (``dbias`` only for a differentiated bias broadcast over batch or heads)."""
    from .backward_dbias import dbias_grid_spec
    out = {"dkdv": dkdv_grid_spec(cfg), "dq": dq_grid_spec(cfg, with_dbias)}
    if with_dbias and cfg.bias_bcast is not None and any(cfg.bias_bcast):
        out["dbias"] = dbias_grid_spec(cfg)
    return out


# ----------------------------------------------------------------------------- the kernels

def _tile(ins, cfg: ForwardConfig, q_start, k_start, q_len, kv_len, *, transposed=False):
    """Recompute one tile: ``(P, dS, dS')`` float32, ``[B_r, B_c]`` or ``[B_c, B_r]``.

    ``dS = P ∘ (dP − D)`` is the gradient w.r.t. the logits after the soft cap and bias (so
    it is dBias); ``dS'`` is w.r.t. ``scale·q·k`` (through the soft cap's ``1 − tanh²``).

    ``transposed`` (the dK/dV kernel): ``Sᵀ = K Qᵀ`` directly, as splash does, so
    ``dV = Pᵀ dO`` and ``dK = dS'ᵀ Q`` are plain matmuls with no transpose of P or dS on the
    XLU; a bias or dense-mask block ``[B_r, B_c]`` is transposed once in VMEM, and lse, D_i
    are rows ``[1, B_r]`` of ``stats_t`` (a sublane broadcast). Otherwise (dQ, dBias) they
    are lane-replicated ``stats`` tiled to ``[B_r, B_c]``: whole vregs reused, no lane
    broadcast. The logits are kept in log2 units (``log2(e)`` folded into the scale, the
    bias and the wrapper's lse), so ``P = exp2(S₂ − lse₂)`` costs no multiply per score.
    One mask definition: :func:`masks.structural_visible` on (transposed) positions.
    """
    q, k, v, do = ins["q"][...], ins["k"][...], ins["v"][...], ins["do"][...]
    bq, bk, L = cfg.block_q, cfg.block_k, blk.LANES
    nt = (((1,), (1,)), ((), ()))                                 # A Bᵀ
    orient = (lambda x: x.T) if transposed else (lambda x: x)     # noqa: E731
    shape, q_axis = ((bk, bq), 1) if transposed else ((bq, bk), 0)
    s = jax.lax.dot_general(*((k, q) if transposed else (q, k)), nt,
                            preferred_element_type=jnp.float32)
    t = None
    if cfg.soft_cap is None:
        s = s * (cfg.scale * LOG2E)
    else:
        t = jnp.tanh(s * (cfg.scale / cfg.soft_cap))
        s = (cfg.soft_cap * LOG2E) * t
    if "bias" in ins:
        s = s + orient(ins["bias"][...].astype(jnp.float32)) * LOG2E
    q_pos = q_start + jax.lax.broadcasted_iota(jnp.int32, shape, q_axis)
    k_pos = k_start + jax.lax.broadcasted_iota(jnp.int32, shape, 1 - q_axis)
    q_seg = kv_seg = None
    if cfg.has_segments and transposed:
        q_seg = ins["q_segment_ids_t"][...][:1, :]                            # [1, B_r]
        kv_seg = jnp.tile(ins["kv_segment_ids_t"][...], (1, bq // L))         # [B_c, B_r]
    elif cfg.has_segments:
        q_seg = jnp.tile(ins["q_segment_ids"][...], (1, bk // L))             # [B_r, B_c]
        kv_seg = ins["kv_segment_ids"][...][:1, :]                            # [1, B_c]
    visible = masks.structural_visible(
        q_pos, k_pos, is_causal=cfg.is_causal, window=cfg.window,
        q_len=q_len if cfg.mask_q_len else None,
        kv_len=kv_len if cfg.mask_kv_len else None, q_seg=q_seg, kv_seg=kv_seg)
    if "mask" in ins:
        mask = ins["mask"][...]                                   # [B_r, B_c] int8
        if transposed or blk.resolve_chip(cfg.chip) in blk.NO_INT8_VPU:
            mask = mask.astype(jnp.int32)                         # Mosaic: no int8 compare on v4
        visible = jnp.logical_and(visible, orient(mask) != 0)
    if transposed:
        lse, di = ins["stats_t"][LSE_ROW:LSE_ROW + 1, :], ins["stats_t"][D_ROW:D_ROW + 1, :]
    else:
        lse = jnp.tile(ins["stats"][:, :L], (1, bk // L))
        di = jnp.tile(ins["stats"][:, L:], (1, bk // L))
    p = jnp.exp2(jnp.where(visible, s, -jnp.inf) - lse)          # masked: exp2(-inf) = 0
    dp = jax.lax.dot_general(*((v, do) if transposed else (do, v)), nt,
                             preferred_element_type=jnp.float32)
    ds = p * (dp - di)
    return p, ds, (ds if t is None else ds * (1.0 - t * t))


def _dkdv_kernel(q_lengths_ref, kv_lengths_ref, *refs, cfg: ForwardConfig, names,
                 fused=False):
    """Step ``(b, hk, j, g, i)``: dV_j += P_ijᵀ dO_i, dK_j += scale·dS'_ijᵀ Q_i.

    ``fused``: also ``dq_part[j, i] = dS'_ij K_j`` (see :func:`dkdv_grid_spec`)."""
    offsets_ref, refs = (refs[0], refs[1:]) if cfg.has_offsets else (None, refs)
    n_in = len(names)
    ins = dict(zip(names, refs[:n_in]))
    dk_ref, dv_ref = refs[n_in:n_in + 2]
    dq_part = refs[n_in + 2] if fused else None
    dk_acc, dv_acc = refs[n_in + 2 + fused:]
    b, j, g, i = pl.program_id(0), pl.program_id(2), pl.program_id(3), pl.program_id(4)
    q_lengths, kv_lengths = _lengths(cfg, q_lengths_ref, kv_lengths_ref)
    q_len, kv_len = q_lengths[b], kv_lengths[b]

    @pl.when(jnp.logical_and(g == 0, i == 0))
    def _init():
        dk_acc[...] = jnp.zeros(dk_acc.shape, jnp.float32)
        dv_acc[...] = jnp.zeros(dv_acc.shape, jnp.float32)

    lo, hi = _q_range(cfg, 0, j, (q_len,), (kv_len,), offsets_ref)
    run = jnp.logical_and(lo <= i, i <= hi)        # exactly the index map's unclamped steps

    @pl.when(run)
    def _compute():
        p_t, _, ds_t = _tile(ins, cfg, *fwd.global_starts(
            offsets_ref, i * cfg.block_q, j * cfg.block_k, q_len, kv_len), transposed=True)
        q, do = ins["q"][...], ins["do"][...]
        dv_acc[...] += jnp.dot(p_t.astype(do.dtype), do, preferred_element_type=jnp.float32)
        dk_acc[...] += jnp.dot(ds_t.astype(q.dtype), q, preferred_element_type=jnp.float32)
        if fused:                                                  # dS'ᵀᵀ K_j: [B_r, d]
            dq_part[...] = jax.lax.dot_general(ds_t.astype(q.dtype), ins["k"][...],
                                               (((0,), (0,)), ((), ())),
                                               preferred_element_type=jnp.float32)

    if fused:
        @pl.when(jnp.logical_not(run))
        def _zero_dq_part():
            dq_part[...] = jnp.zeros(dq_part.shape, jnp.float32)

    @pl.when(jnp.logical_and(g == cfg.group_size - 1, i == cfg.num_q_blocks - 1))
    def _write():
        dk_ref[...] = (dk_acc[...] * cfg.scale).astype(dk_ref.dtype)   # scale once per row
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
    q_lengths, kv_lengths = _lengths(cfg, q_lengths_ref, kv_lengths_ref)
    q_len, kv_len = q_lengths[b], kv_lengths[b]

    @pl.when(j == 0)
    def _init():
        dq_acc[...] = jnp.zeros(dq_acc.shape, jnp.float32)

    lo, hi = fwd._kv_range(cfg, 0, i, (q_len,), (kv_len,), offsets_ref)
    run = jnp.logical_and(lo <= j, j <= hi)

    @pl.when(run)
    def _compute():
        _, ds, ds_raw = _tile(ins, cfg, *fwd.global_starts(
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

    @pl.when(j == cfg.num_kv_blocks - 1)
    def _write():
        dq_ref[...] = (dq_acc[...] * cfg.scale).astype(dq_ref.dtype)   # scale once per row


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
    # dK/dV: S, dP, dV, dK (4 matmuls); dQ: S, dP, dQ (3); dBias: S, dP (2)
    flops = 2 * pairs * tile * {"dkdv": 2 * d + 2 * dv, "dq": 2 * d + dv, "dbias": d + dv}[kernel]
    if "dq_part" in gs.out_names:                 # the fused option's fifth matmul
        flops += 2 * pairs * tile * d
    exps = pairs * tile * (2 if cfg.soft_cap is not None else 1)

    def block_bytes(name):
        spec, shape = gs.spec(name), gs.shape(name)
        return int(np.prod([x for x in spec.block_shape if x is not None])) * \
            jnp.dtype(shape.dtype).itemsize

    fixed = {"dkdv": ("k", "v", "dk", "dv"), "dbias": (),
             "dq": ("q", "do", "stats", "q_segment_ids", "dq")}[kernel]
    outer = (cfg.batch * cfg.num_kv_heads * cfg.num_kv_blocks if kernel == "dkdv"
             else bh * cfg.num_q_blocks)
    nbytes = 0
    for name in gs.in_names + gs.out_names:
        if name in fixed:
            nbytes += outer * block_bytes(name)
        elif name in ("ds", "dbias"):
            nbytes += int(np.prod(gs.shape(name).shape)) * 4
        else:
            nbytes += pairs * block_bytes(name)
    return compat.CostEstimate(flops=int(flops), transcendentals=int(exps),
                               bytes_accessed=int(nbytes))


def _call(gs: BackwardGridSpec, kernel_fn, kernel: str, interpret, q_lengths, kv_lengths, ops):
    kwargs = {}
    if interpret is False:
        kwargs["vmem_limit_bytes"] = blk.vmem_limit_bytes(gs.config.chip)
    kw = ({"has_ds": "ds" in gs.out_names} if kernel == "dq" else
          {"fused": "dq_part" in gs.out_names} if kernel == "dkdv" else {})
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


@functools.partial(jax.jit, static_argnames=("cfg", "interpret", "with_dbias", "fused"))
def _backward(query, key, value, spec, out, lse, d_out, *, cfg: ForwardConfig, interpret,
              with_dbias=True, fused=False):
    """Gradients ``(dq, dk, dv, dbias | None)`` in the public layout (``fused``: one kernel
    for dQ, dK, dV, see :func:`dkdv_grid_spec`)."""
    with_dbias = with_dbias and spec.bias is not None
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

    def run(gs, kernel_fn, kernel):
        return _call(gs, kernel_fn, kernel, interpret, q_lengths, kv_lengths,
                     pre + [arrays[n] for n in gs.in_names])

    if fused:
        dk, dv, dq_part = run(dkdv_grid_spec(cfg, fused=True), _dkdv_kernel, "dkdv")
        dq_outs = [(jnp.sum(dq_part, axis=2) * cfg.scale).astype(cfg.dtype)]
    else:
        dk, dv = run(dkdv_grid_spec(cfg), _dkdv_kernel, "dkdv")
        dq_outs = run(dq_grid_spec(cfg, with_dbias), _dq_kernel, "dq")
    unpad = lambda x, T, D: jnp.swapaxes(x[:, :, :T, :D], 1, 2)  # noqa: E731
    dq = unpad(dq_outs[0], cfg.q_len, cfg.head_dim)
    dk = unpad(dk, cfg.kv_len, cfg.head_dim)
    dv = unpad(dv, cfg.kv_len, cfg.head_dim_v)
    dbias = None
    if with_dbias:                  # dS itself, or summed in-kernel over the broadcast dims
        from . import backward_dbias as dbias_k
        ds = (dq_outs[1] if _full_bias(cfg) and not fused else
              run(dbias_k.dbias_grid_spec(cfg), dbias_k.dbias_kernel, "dbias")[0])
        dbias = ds[:, :, :cfg.q_len, :cfg.kv_len].astype(spec.bias.dtype)
    return dq, dk, dv, dbias


def flash_attention_backward(query, key, value, spec: AttentionSpec, out, lse, d_out, *,
                             block_q=None, block_k=None, interpret=None, chip=None,
                             fused=False):
    """The backward kernels on validated inputs: ``(dq, dk, dv, dbias | None)``.

    ``out [B, T, N, d_v]`` and ``lse [B, N, T]`` float32 come from
    :func:`forward.flash_attention_forward`; ``d_out`` is the cotangent of ``out``. Returns
    gradients in the public layout and the inputs' dtypes; ``dbias`` has the bias's shape
    (summed over its broadcast dims) or is ``None`` without a bias. ``fused``: one kernel for
    dQ, dK and dV instead of two (:func:`dkdv_grid_spec`; not the default, see chapter 07).
    """
    if not isinstance(fused, bool):
        raise TypeError(f"fused: expected a bool, got {fused!r}")
    cfg = make_backward_config(spec, block_q=block_q, block_k=block_k, chip=chip)
    return _backward(query, key, value, spec, out, lse, d_out, cfg=cfg,
                     interpret=fwd._resolve_interpret(interpret), fused=fused)
