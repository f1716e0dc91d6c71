"""The forward kernel's configuration, grid, BlockSpecs and index maps, as data.

:func:`make_config` turns a validated :class:`~flashlab.contract.masks.AttentionSpec` into a
static :class:`ForwardConfig` (blocks, padding, which masks and scalar-prefetch operands the
kernel needs, dense or visit grid); :func:`forward_grid_spec` builds the exact grid, BlockSpecs
and scratch the ``pallas_call`` gets (:mod:`flashlab.kernels.forward`). The backward and decode
kernels reuse the index maps and mask operands, and :mod:`flashlab.instruments.traffic` replays
the same objects to count HBM bytes.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from flashlab.compat import pallas as compat
from flashlab.kernels import blocks as blk
from flashlab.kernels import visit
from flashlab.kernels.refs import RefNames
from flashlab.compat.pallas import pl
from flashlab.kernels.forward_config import (
    ForwardConfig)

__all__ = ["ForwardGridSpec", "BOUNDS_CHECKS", "scoped_vmem_bytes", "IndexMaps", "forward_grid_spec", "global_starts", "index_maps", "mask_operands", "offset_shift", "sinks_operand", "static_lengths", "visit_index_maps"]

# ----------------------------------------------------------------------------- grid as data

@dataclasses.dataclass(frozen=True)
class ForwardGridSpec:
    """The forward kernel's grid and BlockSpecs, exactly the objects ``pallas_call`` gets.

    ``in_specs[k]`` / ``out_specs[k]`` describe operand ``in_names[k]`` / ``out_names[k]``;
    every ``index_map`` is a plain Python function ``(b, h, i, j, q_lengths, kv_lengths) ->
    block index`` that also runs on ints and NumPy arrays, so ``flashlab.instruments.traffic`` and
    the figures can replay it to count which blocks move at which step. The two scalar-prefetch
    operands (int32 ``[batch]`` q and kv lengths) come first in the call and in every index map.
    """

    config: ForwardConfig
    grid: tuple[int, ...]
    in_names: tuple[str, ...]
    in_specs: tuple[Any, ...]
    in_shapes: tuple[jax.ShapeDtypeStruct, ...]
    out_names: tuple[str, ...]
    out_specs: tuple[Any, ...]
    out_shapes: tuple[jax.ShapeDtypeStruct, ...]
    scratch_shapes: tuple[Any, ...]
    num_scalar_prefetch: int = 2
    dimension_semantics: tuple[str, ...] = ("parallel", "parallel", "parallel", "arbitrary")
    prefetch_names: tuple[str, ...] | None = None    # None: the kernel takes positional refs
    scratch_names: tuple[str, ...] = ()
    # Mosaic guards every DMA with a run-time bounds check (address arithmetic, a chain of
    # predicate ops and an ``shalt.err`` per copy, on the grid step's scalar critical path).
    # These index maps cannot leave the arrays: visit lists are built from static shapes, and
    # every run-time length goes through ``blocks.clamp_block``, whose result is in
    # ``[0, num_blocks)`` for any lengths (tests/test_kernel_visit.py replays them). So the
    # check is off here (on with :data:`BOUNDS_CHECKS`): v5e, 512², causal T=8192, the
    # forward's step fell from 266 to 199 cycles and the fused backward's from 430 to 310.
    # The decode kernel keeps it: its page table is the caller's data.
    bounds_checks: bool = False

    def ref_names(self) -> RefNames:
        """The names of the kernel's refs in ``pallas_call`` order (:func:`name_refs`)."""
        return RefNames(self.prefetch_names, self.in_names, self.out_names, self.scratch_names)

    def __post_init__(self):
        if self.prefetch_names is not None:
            object.__setattr__(self, "num_scalar_prefetch", len(self.prefetch_names))
            if len(self.grid) == 3:
                object.__setattr__(self, "dimension_semantics",
                                   ("parallel", "parallel", "arbitrary"))
            return
        # With offsets the kernels take a third scalar-prefetch operand ([2] int32 offsets);
        # the forward's visit grid (B, H, n) takes the visit list [n] int32 instead.
        if getattr(self.config, "has_offsets", False) and self.num_scalar_prefetch == 2:
            object.__setattr__(self, "num_scalar_prefetch", 3)
        if len(self.grid) == 3 and self.num_scalar_prefetch == 2:
            object.__setattr__(self, "num_scalar_prefetch", 3)
            object.__setattr__(self, "dimension_semantics", ("parallel", "parallel", "arbitrary"))

    def pallas_grid_spec(self):
        """The ``pltpu.PrefetchScalarGridSpec`` handed to ``pallas_call``."""
        return compat.PrefetchScalarGridSpec(
            num_scalar_prefetch=self.num_scalar_prefetch, grid=self.grid,
            in_specs=list(self.in_specs), out_specs=list(self.out_specs),
            scratch_shapes=list(self.scratch_shapes))

    def block_bytes(self, name: str) -> int:
        """Bytes of one block of operand ``name`` (what one DMA of it moves)."""
        shape = self.shape(name)
        return int(np.prod([d for d in self.spec(name).block_shape if d is not None])) * \
            jnp.dtype(shape.dtype).itemsize

    def vmem_need(self) -> int | None:
        """The VMEM this kernel's blocks were checked against (:func:`blocks.vmem_bytes`: the
        double-buffered blocks, scratch and spill slots), or ``None`` for the chip's ceiling."""
        c = self.config
        return blk.vmem_bytes(c.block_q, c.block_k, c.head_dim, c.dtype, head_dim_v=c.head_dim_v,
                              bias_dtype=c.bias_dtype, has_mask=c.mask_bcast is not None,
                              has_segments=c.has_segments, return_lse=c.return_lse)

    def compiler_params(self, interpret):
        """``CompilerParams`` for this grid: its dimension semantics and, compiled
        (``interpret is False``), the scoped VMEM it needs (:func:`scoped_vmem_bytes` of
        :meth:`vmem_need`, for the config's chip, else the compile target) and Mosaic's DMA
        bounds checks off unless :attr:`bounds_checks`."""
        kw = {}
        if interpret is False:
            kw["vmem_limit_bytes"] = scoped_vmem_bytes(self.vmem_need(),
                                                       getattr(self.config, "chip", None))
            kw["disable_bounds_checks"] = not (self.bounds_checks or BOUNDS_CHECKS)
        return compat.CompilerParams(dimension_semantics=self.dimension_semantics, **kw)

    def spec(self, name: str):
        """The BlockSpec of operand ``name`` (an input or an output)."""
        names = self.in_names + self.out_names
        return (self.in_specs + self.out_specs)[names.index(name)]

    def shape(self, name: str) -> jax.ShapeDtypeStruct:
        names = self.in_names + self.out_names
        return (self.in_shapes + self.out_shapes)[names.index(name)]


def scoped_vmem_bytes(need: int | None, chip: str | None = None) -> int:
    """The scoped VMEM a kernel asks Mosaic for (``vmem_limit_bytes``): its estimated ``need``
    with a quarter of headroom, in whole MiB, between Mosaic's default scoped limit (what a
    kernel that asks nothing gets, :data:`blocks.DEFAULT_SCOPED_VMEM_BYTES`) and the chip's
    ceiling (:func:`blocks.vmem_limit_bytes`, which the blocks were checked against); ``None``:
    the ceiling. Asking for no more than it needs leaves the rest of VMEM to XLA, which may keep
    an operand there, the kernel's own included, where a kernel holding 96 MiB gives it none
    (v5e, T=8192 d=64 non-causal, 512²: the forward's query copy then stays in VMEM and a
    step falls from 1381 to 1350 cycles; jax's kernel, which asks nothing, had its output
    there)."""
    ceiling = blk.vmem_limit_bytes(chip)
    if need is None:
        return ceiling
    floor = min(blk.vmem_capacity_bytes(chip), blk.DEFAULT_SCOPED_VMEM_BYTES)
    return int(min(ceiling, max(floor, blk.round_up(need * 5 // 4, 1 << 20))))


#: Compile every forward and backward kernel with Mosaic's DMA bounds checks on: a debugging
#: aid when an index map changes (an out-of-range copy then halts with an error instead of
#: moving another array's bytes), at the price of a check per copy on the grid step's scalar
#: path. Read once, at import, from ``FLASHLAB_BOUNDS_CHECKS=1``, so a traced kernel never
#: disagrees with a cached one.
BOUNDS_CHECKS = os.environ.get("FLASHLAB_BOUNDS_CHECKS", "") == "1"


class _Const:
    """``lengths[b] -> n`` for every ``b``: a length known when the kernel is built."""

    def __init__(self, n: int):
        self.n = n

    def __getitem__(self, b) -> int:
        return self.n


def static_lengths(cfg, q_lengths, kv_lengths):
    """The lengths index maps and kernels read: Python ints when they are static (none
    given, no kv padding, no offsets), so every block range folds to a few scalar ops per
    grid step instead of SMEM loads, divisions and clamps (~110 cycles per step on v6e)."""
    if cfg.length_masked or cfg.has_offsets:
        return q_lengths, kv_lengths
    return _Const(cfg.q_len), _Const(cfg.kv_len)


def _kv_range(cfg: ForwardConfig, b, i, q_lengths, kv_lengths, offsets=None):
    if blk.every_block_visible(cfg):           # every kv block, for every q block (static)
        return 0, cfg.num_kv_blocks - 1
    q_lengths, kv_lengths = static_lengths(cfg, q_lengths, kv_lengths)
    return blk.kv_block_range(i, q_lengths[b], kv_lengths[b], block_q=cfg.block_q,
                              block_k=cfg.block_k,
                              is_causal=cfg.is_causal, window=cfg.window,
                              shift=offset_shift(offsets))


def offset_shift(offsets):
    """``q_offset - kv_offset`` from the scalar-prefetched ``offsets`` ``[2]`` (0 without)."""
    return 0 if offsets is None else offsets[0] - offsets[1]


def global_starts(offsets_ref, q_start, k_start, q_len, kv_len):
    """Local block starts and (local) lengths -> global ones, for the one mask definition."""
    if offsets_ref is None:
        return q_start, k_start, q_len, kv_len
    qo, ko = offsets_ref[0], offsets_ref[1]
    return q_start + qo, k_start + ko, q_len + qo, kv_len + ko


def mask_operands(cfg, scores_map_for, q_seg_map, kv_seg_map):
    """The optional inputs blocked like the scores: bias, mask, segment ids.

    Shared by the forward and both backward kernels, which differ only in their index maps.
    Returns ``(names, BlockSpecs, padded HBM shapes)``.
    """
    B, N, bq, bk = cfg.batch, cfg.num_heads, cfg.block_q, cfg.block_k
    Tp, Sp = cfg.q_len_p, cfg.kv_len_p
    full = (B, N, Tp, Sp)
    sds = jax.ShapeDtypeStruct
    names, specs, shapes = [], [], []
    for name, bcast, dtype in (("bias", cfg.bias_bcast, cfg.bias_dtype),
                               ("mask", cfg.mask_bcast, jnp.int8)):
        if bcast is not None:
            # A broadcast T or S dim stays 1 in HBM and in the block (legal: a block dim
            # equal to the array dim); the index map keeps it at 0, the kernel broadcasts.
            names.append(name)
            specs.append(pl.BlockSpec((None, None, 1 if bcast[2] else bq, 1 if bcast[3] else bk),
                                      scores_map_for(bcast)))
            shapes.append(sds(tuple(1 if bc else n for bc, n in zip(bcast, full)), dtype))
    if cfg.has_segments:
        # Segment ids lane-/sublane-replicated so their blocks obey the (8, 128) rule:
        # q ids [B, T, 128] (block [B_r, 128]), kv ids [B, 8, S] (block [8, B_c]).
        names += ["q_segment_ids", "kv_segment_ids"]
        specs += [pl.BlockSpec((None, bq, blk.LANES), q_seg_map),
                  pl.BlockSpec((None, blk.SUBLANES, bk), kv_seg_map)]
        shapes += [sds((B, Tp, blk.LANES), jnp.int32), sds((B, blk.SUBLANES, Sp), jnp.int32)]
    return names, specs, shapes


class IndexMaps(NamedTuple):
    """The index maps of the grid ``(b, h, i, j)`` (the forward's, and the dQ kernel's)."""
    q: Callable            # Q_i, O_i (and dO_i, dQ_i): fixed over j
    kv: Callable           # K_j, V_j of kv head h // G, clamped to the visible range
    scores_for: Callable   # bcast -> the map of a bias/mask blocked like S_ij
    q_seg: Callable
    kv_seg: Callable


def index_maps(cfg: ForwardConfig) -> IndexMaps:
    """Index maps for the grid ``(b, h, i, j)``; a skipped step re-maps to a fetched block."""
    G = cfg.group_size

    # ``offsets`` ([2] int32: q_offset, kv_offset) is the third scalar-prefetch operand when
    # the spec has offsets; the clamp then follows the global causal/window range.
    def kv_block(b, i, j, q_lengths, kv_lengths, offsets=None):
        lo, hi = _kv_range(cfg, b, i, q_lengths, kv_lengths, offsets)
        return blk.clamp_block(j, lo, hi, cfg.num_kv_blocks)

    def q_index_map(b, h, i, j, q_lengths, kv_lengths, offsets=None):
        return (b, h, i, 0)

    def kv_index_map(b, h, i, j, q_lengths, kv_lengths, offsets=None):
        return (b, blk.div_nonneg(h, G), kv_block(b, i, j, q_lengths, kv_lengths, offsets), 0)

    def scores_index_map_for(bcast):
        def scores_index_map(b, h, i, j, q_lengths, kv_lengths, offsets=None):
            return (0 if bcast[0] else b, 0 if bcast[1] else h, 0 if bcast[2] else i,
                    0 if bcast[3] else kv_block(b, i, j, q_lengths, kv_lengths, offsets))
        return scores_index_map

    def q_seg_index_map(b, h, i, j, q_lengths, kv_lengths, offsets=None):
        return (b, i, 0)

    def kv_seg_index_map(b, h, i, j, q_lengths, kv_lengths, offsets=None):
        return (b, 0, kv_block(b, i, j, q_lengths, kv_lengths, offsets))

    return IndexMaps(q_index_map, kv_index_map, scores_index_map_for, q_seg_index_map,
                     kv_seg_index_map)


def visit_index_maps(cfg: ForwardConfig) -> IndexMaps:
    """Index maps of the visit grid ``(b, h, t)``: ``(i, j)`` of visit ``t``.

    Every map is ``(b, h, t, q_lengths, kv_lengths, visits) -> block index``, ``visits`` the
    list's :func:`visit.planes`. The list holds only positionally visible pairs; data-dependent
    lengths (``mask_q_len``/``mask_kv_len``) still clamp ``j`` so that a step past them copies
    nothing.
    """
    G = cfg.group_size
    clamp = cfg.length_masked

    def ij(b, t, q_lengths, kv_lengths, visits):
        i, j = visit.at(visits, t)
        if clamp:
            lo, hi = _kv_range(cfg, b, i, q_lengths, kv_lengths)
            j = blk.clamp_block(j, lo, hi, cfg.num_kv_blocks)
        return i, j

    def q_map(b, h, t, q_lengths, kv_lengths, visits):
        return (b, h, visits[t], 0)                     # the rows plane: i

    def kv_map(b, h, t, *pref):
        return (b, blk.div_nonneg(h, G), ij(b, t, *pref)[1], 0)

    def scores_for(bcast):
        def scores_map(b, h, t, *pref):
            i, j = ij(b, t, *pref)
            return (0 if bcast[0] else b, 0 if bcast[1] else h, 0 if bcast[2] else i,
                    0 if bcast[3] else j)
        return scores_map

    def q_seg_map(b, h, t, q_lengths, kv_lengths, visits):
        return (b, visits[t], 0)

    def kv_seg_map(b, h, t, *pref):
        return (b, 0, ij(b, t, *pref)[1])

    return IndexMaps(q_map, kv_map, scores_for, q_seg_map, kv_seg_map)


def forward_grid_spec(cfg: ForwardConfig) -> ForwardGridSpec:
    """Build the grid, BlockSpecs (with their index maps) and scratch of the forward kernel.

    The dense grid ``(B, H, T_r, T_c)``, or with ``cfg.visit_grid`` ``(B, H, n)`` over the
    visit list (a third scalar-prefetch operand, ``visits [3n]`` int32: :func:`visit.planes`).
    """
    B, N = cfg.batch, cfg.num_heads
    bq, bk = cfg.block_q, cfg.block_k
    Tp, Sp, Dp, Dvp = cfg.q_len_p, cfg.kv_len_p, cfg.head_dim_p, cfg.head_dim_v_p
    maps = visit_index_maps(cfg) if cfg.visit_grid else index_maps(cfg)
    q_index_map, kv_index_map = maps.q, maps.kv

    sds = jax.ShapeDtypeStruct
    names = ["q", "k", "v"]
    specs = [pl.BlockSpec((None, None, bq, Dp), q_index_map),
             pl.BlockSpec((None, None, bk, Dp), kv_index_map),
             pl.BlockSpec((None, None, bk, Dvp), kv_index_map)]
    shapes = [sds((B, N, Tp, Dp), cfg.dtype), sds((B, cfg.num_kv_heads, Sp, Dp), cfg.dtype),
              sds((B, cfg.num_kv_heads, Sp, Dvp), cfg.dtype)]
    n2, s2, sh2 = mask_operands(cfg, maps.scores_for, maps.q_seg, maps.kv_seg)
    names, specs, shapes = names + n2, specs + s2, shapes + sh2
    if cfg.has_sinks:    # one (8, 128) tile per head holding its sink logit
        names.append("sinks")
        specs.append(pl.BlockSpec((None, blk.SUBLANES, blk.LANES), _sinks_index_map))
        shapes.append(sds((N, blk.SUBLANES, blk.LANES), jnp.float32))
    out_names = ["o"]
    out_specs = [pl.BlockSpec((None, None, bq, Dvp), q_index_map)]
    out_shapes = [sds((B, N, Tp, Dvp), cfg.dtype)]
    if cfg.return_lse:   # lse lane-replicated [B, N, T, 128] (a [B_r] vector is not a tile)
        out_names.append("lse")
        out_specs.append(pl.BlockSpec((None, None, bq, blk.LANES), q_index_map))
        out_shapes.append(sds((B, N, Tp, blk.LANES), jnp.float32))
    scratch = (compat.VMEM((bq, blk.LANES), jnp.float32),   # m, lane-replicated
               compat.VMEM((bq, blk.LANES), jnp.float32),   # l, lane-replicated
               compat.VMEM((bq, Dvp), jnp.float32))         # acc (unnormalised O)
    grid = (B, N, len(cfg.visits())) if cfg.visit_grid else cfg.grid
    prefetch = (("q_lengths", "kv_lengths") + (("offsets",) if cfg.has_offsets else ())
                + (("visits",) if cfg.visit_grid else ()))
    return ForwardGridSpec(config=cfg, grid=grid, in_names=tuple(names),
                           in_specs=tuple(specs), in_shapes=tuple(shapes),
                           out_names=tuple(out_names), out_specs=tuple(out_specs),
                           out_shapes=tuple(out_shapes), scratch_shapes=scratch,
                           prefetch_names=prefetch, scratch_names=("m", "l", "acc"))


def _sinks_index_map(b, h, *_):
    return (h, 0, 0)


def sinks_operand(sinks):
    """``sinks [N]`` -> the kernel operand ``[N, 8, 128]`` float32 (one tile per head)."""
    return jnp.broadcast_to(sinks.astype(jnp.float32)[:, None, None],
                            (sinks.shape[0], blk.SUBLANES, blk.LANES))
