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
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from flashlab.contract.masks import AttentionSpec
from flashlab.compat import pallas as compat
from flashlab.kernels import blocks as blk
from flashlab.kernels import visit
from flashlab.kernels.refs import RefNames
from flashlab.compat.pallas import pl


__all__ = ["block_kwargs", "ForwardConfig", "ForwardGridSpec", "IndexMaps", "SUPPORTED_DTYPES", "forward_grid_spec", "global_starts", "index_maps", "make_config", "mask_operands", "offset_shift", "sinks_operand", "visit_index_maps"]

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


@dataclasses.dataclass(frozen=True)
class ForwardConfig:
    """Every static fact the forward kernel is built from (hashable: a jit static argument).

    Sizes are the *padded* ones the kernel sees (``q_len_p = T_r * block_q`` and so on);
    ``q_len``/``kv_len`` are the caller's. ``bias_bcast``/``mask_bcast`` say whether the
    batch and head dims of bias/mask are full (False) or 1 (True).
    """

    batch: int
    num_heads: int
    num_kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    head_dim_v: int
    block_q: int
    block_k: int
    dtype: Any
    scale: float
    is_causal: bool = False
    window: tuple[int | None, int | None] | None = None
    soft_cap: float | None = None
    bias_dtype: Any = None
    bias_bcast: tuple[bool, bool] | None = None
    mask_bcast: tuple[bool, bool] | None = None
    has_segments: bool = False
    mask_q_len: bool = False        # query_seq_lengths given: rows past it are masked
    mask_kv_len: bool = False       # kv lengths given or kv padding: keys past it are masked
    return_lse: bool = False
    has_offsets: bool = False       # q/kv offsets: a third scalar-prefetch operand [2] int32
    chip: str | None = None         # the TPU generation the blocks and VMEM limit are for
    has_sinks: bool = False         # sinks [Hq]: merged into each row's state at finalize
    visit_grid: bool = False        # grid (B, H, n) over the visible blocks (kernels/visit.py)

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def q_len_p(self) -> int:
        return blk.round_up(self.q_len, self.block_q)

    @property
    def kv_len_p(self) -> int:
        return blk.round_up(self.kv_len, self.block_k)

    @property
    def head_dim_p(self) -> int:
        return blk.lane_pad(self.head_dim)

    @property
    def head_dim_v_p(self) -> int:
        return blk.lane_pad(self.head_dim_v)

    @property
    def num_q_blocks(self) -> int:
        return self.q_len_p // self.block_q

    @property
    def num_kv_blocks(self) -> int:
        return self.kv_len_p // self.block_k

    @property
    def grid(self) -> tuple[int, int, int, int]:
        """The dense grid ``(B, H, T_r, T_c)`` (the backward's dQ kernel runs it too)."""
        return (self.batch, self.num_heads, self.num_q_blocks, self.num_kv_blocks)

    def visits(self) -> np.ndarray:
        """The packed visit list ``int32 [n]`` of the visit grid (:mod:`.visit`)."""
        return visit.visit_table(num_q_blocks=self.num_q_blocks,
                                 num_kv_blocks=self.num_kv_blocks, q_len=self.q_len,
                                 kv_len=self.kv_len, block_q=self.block_q,
                                 block_k=self.block_k, is_causal=self.is_causal,
                                 window=self.window)


def block_kwargs(spec: AttentionSpec) -> dict:
    """What block-size choice and the VMEM check need to know of ``spec``, forward and backward:
    ``head_dim_v``, ``bias_dtype`` (the bias as the kernels read it: its own dtype if the
    kernels support it, else float32, converted in the wrapper), ``has_mask``, ``has_segments``."""
    bias_dtype = None
    if spec.bias is not None:
        bias_dtype = jnp.dtype(spec.bias.dtype)
        if bias_dtype not in SUPPORTED_DTYPES:
            bias_dtype = jnp.dtype(jnp.float32)
    return dict(head_dim_v=spec.head_dim_v, bias_dtype=bias_dtype,
                has_mask=spec.mask is not None, has_segments=spec.q_segment_ids is not None)


def make_config(spec: AttentionSpec, *, block_q=None, block_k=None, return_lse=False,
                chip=None, visit_grid: bool | None = None) -> ForwardConfig:
    """Build (and check) the kernel configuration for a validated request.

    ``chip``: the TPU generation to size blocks and the VMEM limit for; ``None`` reads the
    compile target (:func:`flashlab.kernels.blocks.resolve_chip`: explicit ``chip`` wins).
    ``visit_grid``: run the forward over the visible blocks only (:mod:`.visit`); ``None``
    (default) does so when that removes grid steps (causal, window, padding) and the request
    has no offsets (traced offsets move the visible set at run time), ``False`` keeps the
    dense grid; ``True`` where it is impossible raises ``ValueError``.
    """
    chip = blk.resolve_chip(chip)
    dt = jnp.dtype(spec.dtype)
    if dt not in SUPPORTED_DTYPES:
        raise TypeError(f"query: the Pallas TPU kernel supports float32 and bfloat16, got {dt}")
    kw = dict(block_kwargs(spec), return_lse=return_lse)
    bias_dtype = kw["bias_dtype"]
    auto_q, auto_k = blk.choose_block_sizes(spec.q_len, spec.kv_len, spec.head_dim, dt, chip,
                                            is_causal=spec.is_causal, **kw)
    block_q = auto_q if block_q is None else block_q
    block_k = auto_k if block_k is None else block_k
    blk.check_block_sizes(block_q, block_k, head_dim=spec.head_dim, dtype=dt, chip=chip, **kw)
    bcast = lambda a: None if a is None else (a.shape[0] == 1 and spec.batch > 1,  # noqa: E731
                                              a.shape[1] == 1 and spec.num_heads > 1)
    cfg = ForwardConfig(
        batch=spec.batch, num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads,
        q_len=spec.q_len, kv_len=spec.kv_len, head_dim=spec.head_dim,
        head_dim_v=spec.head_dim_v, block_q=int(block_q), block_k=int(block_k), dtype=dt,
        scale=spec.scale, is_causal=spec.is_causal, window=spec.window,
        soft_cap=spec.soft_cap, bias_dtype=bias_dtype, bias_bcast=bcast(spec.bias),
        mask_bcast=bcast(spec.mask), has_segments=spec.q_segment_ids is not None,
        mask_q_len=spec.q_lengths is not None,
        mask_kv_len=spec.kv_lengths is not None or blk.round_up(spec.kv_len, int(block_k)) != spec.kv_len,
        return_lse=return_lse, has_offsets=spec.has_offsets, chip=chip,
        has_sinks=spec.sinks is not None)
    return dataclasses.replace(cfg, visit_grid=_use_visit_grid(cfg, visit_grid))


def _use_visit_grid(cfg: ForwardConfig, want: bool | None) -> bool:
    if want is not None and not isinstance(want, bool):
        raise TypeError(f"visit_grid: expected None, True or False, got {want!r}")
    if want is False:
        return False
    why = None
    if cfg.has_offsets:
        why = "the request has q/kv offsets (traced: the visible set is known only at run time)"
    else:
        n = len(cfg.visits())
        if n > visit.MAX_VISITS:
            why = f"{n} visits per (batch, head) exceed visit.MAX_VISITS={visit.MAX_VISITS}"
        elif want is None and n >= cfg.num_q_blocks * cfg.num_kv_blocks:
            return False                     # nothing skipped: the dense grid is as short
    if why is not None:
        if want:
            raise ValueError(f"visit_grid=True: not possible here: {why}")
        return False
    return True


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

    def compiler_params(self, interpret):
        """``CompilerParams`` for this grid: its dimension semantics and, compiled
        (``interpret is False``), the scoped VMEM limit the blocks were sized for
        (:func:`blocks.vmem_limit_bytes` of the config's chip, else the compile target)."""
        kw = {}
        if interpret is False:
            kw["vmem_limit_bytes"] = blk.vmem_limit_bytes(getattr(self.config, "chip", None))
        return compat.CompilerParams(dimension_semantics=self.dimension_semantics, **kw)

    def spec(self, name: str):
        """The BlockSpec of operand ``name`` (an input or an output)."""
        names = self.in_names + self.out_names
        return (self.in_specs + self.out_specs)[names.index(name)]

    def shape(self, name: str) -> jax.ShapeDtypeStruct:
        names = self.in_names + self.out_names
        return (self.in_shapes + self.out_shapes)[names.index(name)]


def _kv_range(cfg: ForwardConfig, b, i, q_lengths, kv_lengths, offsets=None):
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
    sds = jax.ShapeDtypeStruct
    names, specs, shapes = [], [], []
    for name, bcast, dtype in (("bias", cfg.bias_bcast, cfg.bias_dtype),
                               ("mask", cfg.mask_bcast, jnp.int8)):
        if bcast is not None:
            names.append(name)
            specs.append(pl.BlockSpec((None, None, bq, bk), scores_map_for(bcast)))
            shapes.append(sds((1 if bcast[0] else B, 1 if bcast[1] else N, Tp, Sp), dtype))
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
            return (0 if bcast[0] else b, 0 if bcast[1] else h, i,
                    kv_block(b, i, j, q_lengths, kv_lengths, offsets))
        return scores_index_map

    def q_seg_index_map(b, h, i, j, q_lengths, kv_lengths, offsets=None):
        return (b, i, 0)

    def kv_seg_index_map(b, h, i, j, q_lengths, kv_lengths, offsets=None):
        return (b, 0, kv_block(b, i, j, q_lengths, kv_lengths, offsets))

    return IndexMaps(q_index_map, kv_index_map, scores_index_map_for, q_seg_index_map,
                     kv_seg_index_map)


def visit_index_maps(cfg: ForwardConfig) -> IndexMaps:
    """Index maps of the visit grid ``(b, h, t)``: ``(i, j)`` decoded from ``visits[t]``.

    Every map is ``(b, h, t, q_lengths, kv_lengths, visits) -> block index``. The list holds
    only positionally visible pairs; data-dependent lengths (``mask_q_len``/``mask_kv_len``)
    still clamp ``j`` so that a step past them copies nothing.
    """
    G = cfg.group_size
    clamp = cfg.mask_q_len or cfg.mask_kv_len

    def ij(b, t, q_lengths, kv_lengths, visits):
        i, j, _ = visit.unpack(visits[t])
        if clamp:
            lo, hi = _kv_range(cfg, b, i, q_lengths, kv_lengths)
            j = blk.clamp_block(j, lo, hi, cfg.num_kv_blocks)
        return i, j

    def q_map(b, h, t, q_lengths, kv_lengths, visits):
        return (b, h, visit.unpack(visits[t])[0], 0)

    def kv_map(b, h, t, *pref):
        return (b, blk.div_nonneg(h, G), ij(b, t, *pref)[1], 0)

    def scores_for(bcast):
        def scores_map(b, h, t, *pref):
            i, j = ij(b, t, *pref)
            return (0 if bcast[0] else b, 0 if bcast[1] else h, i, j)
        return scores_map

    def q_seg_map(b, h, t, q_lengths, kv_lengths, visits):
        return (b, visit.unpack(visits[t])[0], 0)

    def kv_seg_map(b, h, t, *pref):
        return (b, 0, ij(b, t, *pref)[1])

    return IndexMaps(q_map, kv_map, scores_for, q_seg_map, kv_seg_map)


def forward_grid_spec(cfg: ForwardConfig) -> ForwardGridSpec:
    """Build the grid, BlockSpecs (with their index maps) and scratch of the forward kernel.

    The dense grid ``(B, H, T_r, T_c)``, or with ``cfg.visit_grid`` ``(B, H, n)`` over the
    visit list (a third scalar-prefetch operand, ``visits [n]`` int32).
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
