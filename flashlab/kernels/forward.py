"""The Pallas TPU forward kernel of FlashAttention (Dao et al. 2022, Algorithm 1).

Grid ``(batch, heads, T_r, T_c)``: step ``(b, h, i, j)`` loads the query block ``Q_i``
``[B_r, d]`` and the key/value blocks ``K_j, V_j`` ``[B_c, d]`` into VMEM and folds
``S_ij = Q_i K_jᵀ`` into the running state ``(m, l, acc)`` kept in VMEM scratch with
:func:`flashlab.online_softmax.update`. The kv axis ``j`` is innermost and "arbitrary" (it
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

Inside, the layout is ``[batch, heads, seq, head_dim]`` padded to whole blocks (seq) and to
128 lanes (head_dim); padding keys are masked through the kv length, which is
scalar-prefetched into SMEM together with the q length.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .. import device, masks, online_softmax
from ..masks import AttentionSpec
from ..shard_map_compat import in_manual_mesh, pvary, shape_dtype, vma_of
from . import _pallas_compat as compat
from . import blocks as blk
from . import visit
from ._pallas_compat import pl

__all__ = ["ForwardConfig", "ForwardGridSpec", "make_config", "forward_grid_spec", "index_maps",
           "flash_attention", "flash_attention_from_spec", "flash_attention_forward",
           "SUPPORTED_DTYPES"]

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
    bias_dtype = None
    if spec.bias is not None:
        bias_dtype = jnp.dtype(spec.bias.dtype)
        if bias_dtype not in SUPPORTED_DTYPES:
            bias_dtype = jnp.dtype(jnp.float32)       # converted in the wrapper
    kw = dict(head_dim_v=spec.head_dim_v, bias_dtype=bias_dtype, has_mask=spec.mask is not None,
              has_segments=spec.q_segment_ids is not None, return_lse=return_lse)
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
    block index`` that also runs on ints and NumPy arrays, so ``flashlab.traffic`` and the
    figures can replay it to count which blocks move at which step. The two scalar-prefetch
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

    def __post_init__(self):
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

    def spec(self, name: str):
        """The BlockSpec of operand ``name`` (an input or an output)."""
        names = self.in_names + self.out_names
        return (self.in_specs + self.out_specs)[names.index(name)]

    def shape(self, name: str) -> jax.ShapeDtypeStruct:
        names = self.in_names + self.out_names
        return (self.in_shapes + self.out_shapes)[names.index(name)]


def _kv_range(cfg: ForwardConfig, b, i, q_lengths, kv_lengths, offsets=None):
    return blk.kv_block_range(i, q_lengths[b], kv_lengths[b], block_q=cfg.block_q,
                              block_k=cfg.block_k, num_kv_blocks=cfg.num_kv_blocks,
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
        return blk.clamp_kv_block(j, lo, hi, cfg.num_kv_blocks)

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
            j = blk.clamp_kv_block(j, lo, hi, cfg.num_kv_blocks)
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
    return ForwardGridSpec(config=cfg, grid=grid, in_names=tuple(names),
                           in_specs=tuple(specs), in_shapes=tuple(shapes),
                           out_names=tuple(out_names), out_specs=tuple(out_specs),
                           out_shapes=tuple(out_shapes), scratch_shapes=scratch)


def _sinks_index_map(b, h, *_):
    return (h, 0, 0)


def sinks_operand(sinks):
    """``sinks [N]`` -> the kernel operand ``[N, 8, 128]`` float32 (one tile per head)."""
    return jnp.broadcast_to(sinks.astype(jnp.float32)[:, None, None],
                            (sinks.shape[0], blk.SUBLANES, blk.LANES))


# ----------------------------------------------------------------------------- the kernel

def score_tile(ins, cfg: ForwardConfig, q_start, k_start, q_len, kv_len):
    """One ``[B_r, B_c]`` tile of logits and its visibility, from the operand refs ``ins``.

    ``s = cap·tanh(scale·Q_i K_jᵀ / cap) + bias`` in float32, and the one mask definition
    (:func:`masks.structural_visible` on iota positions, and the dense mask). Shared by the
    forward and both backward kernels; also returns ``tanh(·)`` (``None`` without a soft cap)
    for the soft cap's gradient.
    """
    bq, bk = cfg.block_q, cfg.block_k
    s = jax.lax.dot_general(ins["q"][...], ins["k"][...], (((1,), (1,)), ((), ())),  # Q Kᵀ
                            preferred_element_type=jnp.float32) * cfg.scale
    t = None
    if cfg.soft_cap is not None:
        t = jnp.tanh(s / cfg.soft_cap)
        s = cfg.soft_cap * t
    if "bias" in ins:
        s = s + ins["bias"][...].astype(jnp.float32)
    q_pos = q_start + jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
    k_pos = k_start + jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
    q_seg = kv_seg = None
    if cfg.has_segments:
        q_seg = jnp.tile(ins["q_segment_ids"][...], (1, bk // blk.LANES))   # [B_r, B_c]
        kv_seg = ins["kv_segment_ids"][...][:1, :]                          # [1, B_c]
    visible = masks.structural_visible(
        q_pos, k_pos, is_causal=cfg.is_causal, window=cfg.window,
        q_len=q_len if cfg.mask_q_len else None,
        kv_len=kv_len if cfg.mask_kv_len else None, q_seg=q_seg, kv_seg=kv_seg)
    if "mask" in ins:
        mask = ins["mask"][...]                                             # [B_r, B_c] int8
        if blk.resolve_chip(cfg.chip) in blk.NO_INT8_VPU:   # Mosaic: no int8 compare on v4
            mask = mask.astype(jnp.int32)
        visible = jnp.logical_and(visible, mask != 0)
    return s, t, visible


def _forward_kernel(q_lengths_ref, kv_lengths_ref, *refs, cfg: ForwardConfig, names):
    """One grid step ``(b, h, i, j)`` (or ``(b, h, t)`` of the visit grid): fold S_ij into
    (m, l, acc); init at the row's first step, finalize at its last."""
    offsets_ref, refs = (refs[0], refs[1:]) if cfg.has_offsets else (None, refs)
    visits_ref, refs = (refs[0], refs[1:]) if cfg.visit_grid else (None, refs)
    n_in = len(names)
    ins = dict(zip(names, refs[:n_in]))
    outs = refs[n_in:n_in + 1 + cfg.return_lse]
    m_ref, l_ref, acc_ref = refs[n_in + 1 + cfg.return_lse:]
    b = pl.program_id(0)
    bq, bk = cfg.block_q, cfg.block_k
    q_len, kv_len = q_lengths_ref[b], kv_lengths_ref[b]          # int32 scalars from SMEM
    if cfg.visit_grid:
        i, j, flags = visit.unpack(visits_ref[pl.program_id(2)])
        first, last = (flags & visit.FIRST) != 0, (flags & visit.LAST) != 0
    else:
        i, j = pl.program_id(2), pl.program_id(3)
        first, last = j == 0, j == cfg.num_kv_blocks - 1

    @pl.when(first)
    def _init():                                                  # m = -inf, l = 0, acc = 0
        m_ref[...] = jnp.full(m_ref.shape, online_softmax.NEG_INF, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    # Global positions (= local ones without offsets): the one mask definition sees those.
    q_start, k_start, q_len, kv_len = global_starts(offsets_ref, i * bq, j * bk, q_len, kv_len)
    if cfg.visit_grid:   # listed = positionally visible; only run-time lengths left to test
        run = (flags & visit.EMPTY) == 0
        if cfg.mask_kv_len:
            run = jnp.logical_and(run, k_start < kv_len)
        if cfg.mask_q_len:
            run = jnp.logical_and(run, q_start < q_len)
    else:
        run = jnp.logical_and(
            masks.block_maybe_visible(q_start, q_start + bq, k_start, k_start + bk,
                                      is_causal=cfg.is_causal, window=cfg.window),
            jnp.logical_and(k_start < kv_len, q_start < q_len))

    @pl.when(run)
    def _compute():
        s, _, visible = score_tile(ins, cfg, q_start, k_start, q_len, kv_len)  # [B_r, B_c]
        # m and l stay lane-replicated [B_r, 128] and are updated elementwise: the tile's row
        # max and row sum are the only cross-lane reductions of a step.
        state = online_softmax.State(m_ref[...], l_ref[...], acc_ref[...])
        m, l, acc = online_softmax.update(state, s, ins["v"][...], visible=visible, lanes=True)
        m_ref[...] = m
        l_ref[...] = l
        acc_ref[...] = acc

    @pl.when(last)
    def _finalize():                                              # O_i = acc * (1 / l)
        state = online_softmax.State(m_ref[...], l_ref[...], acc_ref[...])
        if cfg.has_sinks:                                         # + exp(sink - m) in l
            sink = jnp.broadcast_to(ins["sinks"][0:1, :], m_ref.shape)   # [B_r, 128]
            state = online_softmax.merge(
                state, online_softmax.sink_state(sink, acc_ref.shape[-1], lanes=True), lanes=True)
        o, lse = online_softmax.finalize(state, lanes=True)      # lse [B_r, 128] replicated
        outs[0][...] = o.astype(outs[0].dtype)
        if cfg.return_lse:
            outs[1][...] = lse


def _cost_estimate(cfg: ForwardConfig, gs: ForwardGridSpec) -> Any:
    """FLOPs, exps and HBM bytes, counting only the (q block, kv block) pairs computed.

    Positional skipping (causal, window, padding) is known statically; data-dependent
    lengths are not, so they are assumed full here.
    """
    visible = blk.num_visible_blocks(cfg.num_q_blocks, cfg.num_kv_blocks, q_len=cfg.q_len_p,
                                     kv_len=cfg.kv_len, block_q=cfg.block_q, block_k=cfg.block_k,
                                     is_causal=cfg.is_causal and not cfg.has_offsets,
                                     window=None if cfg.has_offsets else cfg.window)
    bh = cfg.batch * cfg.num_heads
    pairs = bh * visible
    tile = cfg.block_q * cfg.block_k

    def block_bytes(name):   # bytes of one block of operand ``name``
        spec, shape = gs.spec(name), gs.shape(name)
        return int(np.prod([d for d in spec.block_shape if d is not None])) * \
            jnp.dtype(shape.dtype).itemsize

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
    kernel = functools.partial(_forward_kernel, cfg=cfg, names=gs.in_names)
    kwargs = {}
    if interpret is False:   # compiled: ask Mosaic for the VMEM the blocks were sized for
        kwargs["vmem_limit_bytes"] = blk.vmem_limit_bytes(cfg.chip)
    out = pl.pallas_call(
        kernel,
        grid_spec=gs.pallas_grid_spec(),
        out_shape=varying_out_shapes(gs, q_lengths, kv_lengths, *operands),
        compiler_params=compat.CompilerParams(dimension_semantics=gs.dimension_semantics,
                                              **kwargs),
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
    pad_scores = lambda a: jnp.pad(a, ((0, 0), (0, 0), (0, Tp - cfg.q_len),  # noqa: E731
                                       (0, Sp - cfg.kv_len)))
    if spec.bias is not None:
        ops.append(pad_scores(spec.bias.astype(cfg.bias_dtype)))
    if spec.mask is not None:
        ops.append(pad_scores(spec.mask.astype(jnp.int8)))
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
    visits = [jnp.asarray(cfg.visits())] if cfg.visit_grid else []
    outs = _pallas_forward(cfg, interpret, q_lengths, kv_lengths,
                           *offset_operands(cfg, spec), *visits, *ops)
    o = jnp.swapaxes(outs[0][:, :, :cfg.q_len, :cfg.head_dim_v], 1, 2)   # [B, T, N, d_v]
    lse = outs[1][:, :, :cfg.q_len, 0] if cfg.return_lse else None      # [B, N, T]
    return o, lse


def _attention_impl(query, key, value, spec, cfg, bwd_cfg, interpret):
    return _forward(query, key, value, spec, cfg=cfg, interpret=interpret)[0]


# Two registrations of one rule. ``_attention`` asks for symbolic zeros, so the backward knows
# whether the bias is differentiated (a constant bias, e.g. ALiBi, gets no [B, N, T, S] dS
# written). JAX does not implement symbolic zeros inside shard_map, so there
# ``_attention_manual`` is used: it treats a bias as differentiated (its cotangent is dropped
# by the caller when it is not).
_attention = jax.custom_vjp(_attention_impl, nondiff_argnums=(4, 5, 6))
_attention_manual = jax.custom_vjp(_attention_impl, nondiff_argnums=(4, 5, 6))


def _attention_fwd(query, key, value, spec, cfg, bwd_cfg, interpret):
    # symbolic_zeros=True: every array leaf arrives as CustomVJPPrimal(value, perturbed), so
    # the backward knows whether the bias is differentiated (a constant bias gets no dS).
    is_primal = lambda x: isinstance(x, jax.custom_derivatives.CustomVJPPrimal)  # noqa: E731
    if is_primal(query):
        with_dbias = spec.bias is not None and bool(spec.bias.perturbed)
        query, key, value, spec = jax.tree_util.tree_map(
            lambda x: x.value, (query, key, value, spec), is_leaf=is_primal)
    else:                                                 # _attention_manual
        with_dbias = spec.bias is not None
    # Differentiated: also emit lse [B, N, T] (O(N)), the only residual besides the inputs/O.
    out, lse = _forward(query, key, value, spec, cfg=dataclasses.replace(cfg, return_lse=True),
                        interpret=interpret)
    flag = jnp.zeros((0,), jnp.float32) if with_dbias else None     # static, in the structure
    return out, (query, key, value, spec, out, lse, flag)


def _attention_bwd(cfg, bwd_cfg, interpret, residuals, d_out):
    from . import backward        # the backward kernels (chapter 07) import this module
    query, key, value, spec, out, lse, flag = residuals
    if isinstance(d_out, jax.custom_derivatives.SymbolicZero):
        d_out = jnp.zeros(d_out.shape, d_out.dtype)
    dq, dk, dv, dbias = backward._backward(query, key, value, spec, out, lse, d_out,
                                           cfg=bwd_cfg, interpret=interpret,
                                           with_dbias=flag is not None)
    # The spec's cotangent: dBias for the bias, symbolic zeros (None) for masks and lengths.
    d_spec = jax.tree_util.tree_map(lambda _: None, spec)
    if dbias is not None:
        d_spec = dataclasses.replace(d_spec, bias=dbias)
    if spec.sinks is not None:   # O and lse include the sink, so the kernels' dQ/dK/dV hold
        d_spec = dataclasses.replace(d_spec, sinks=_sink_grad(spec.sinks, out, lse, d_out))
    return dq, dk, dv, d_spec


_attention.defvjp(_attention_fwd, _attention_bwd, symbolic_zeros=True)
_attention_manual.defvjp(_attention_fwd, _attention_bwd)


def _sink_grad(sinks, out, lse, d_out):
    """``dsinks [N]``: ``-sum_{b,i} exp(sink - lse) D_i`` (an O(N·d) XLA fusion, no kernel)."""
    di = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)   # [B, T, N]
    d = online_softmax.sink_grad(sinks[None, :, None], lse, jnp.swapaxes(di, 1, 2))  # [B, N]
    return jnp.sum(d, axis=0).astype(sinks.dtype)


def _resolve_interpret(interpret):
    mode = device.interpret_mode(interpret)
    if not (isinstance(mode, bool) or compat.is_interpret_params(mode)):
        raise TypeError(f"interpret: expected None, a bool or a pltpu.InterpretParams, got "
                        f"{interpret!r}")
    return mode


def flash_attention_from_spec(query, key, value, spec: AttentionSpec, *, block_q=None,
                              block_k=None, interpret=None, chip=None):
    """The forward kernel on already validated inputs (what the backend registry calls)."""
    from .backward import make_backward_config
    cfg = make_config(spec, block_q=block_q, block_k=block_k, chip=chip)
    bwd_cfg = make_backward_config(spec, block_q=block_q, block_k=block_k, chip=chip)
    f = _attention_manual if in_manual_mesh() else _attention
    # Inside shard_map: every operand varies over the same mesh axes, so each cotangent has
    # its primal's type (JAX sums a replicated input's cotangent outside, as for any op).
    query, key, value, spec = pvary((query, key, value, spec), vma_of(query, key, value, spec))
    return f(query, key, value, spec, cfg, bwd_cfg, _resolve_interpret(interpret))


def flash_attention_forward(query, key, value, spec: AttentionSpec, *, block_q=None,
                            block_k=None, interpret=None, chip=None):
    """Forward with residuals for a backward kernel: ``(out [B, T, N, d_v], lse [B, N, T])``.

    ``lse`` is float32, ``-inf`` on rows with no visible key. Not differentiable.
    """
    cfg = make_config(spec, block_q=block_q, block_k=block_k, return_lse=True, chip=chip)
    return _forward(query, key, value, spec, cfg=cfg, interpret=_resolve_interpret(interpret))


def flash_attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
                    query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
                    segment_ids=None, logits_soft_cap=None, block_q=None, block_k=None,
                    interpret=None, chip=None, sinks=None):
    """FlashAttention forward as a Pallas TPU kernel.

    Same arguments, semantics and validation as :func:`flashlab.reference.naive_attention`
    (layout ``[batch, seq, heads, head_dim]``; float32 or bfloat16; any lengths; GQA/MQA),
    plus:

      block_q, block_k: B_r and B_c. Default: :func:`flashlab.kernels.choose_block_sizes` for
        this TPU generation. block_q must be a multiple of the sublane tile (8 fp32, 16 bf16,
        32 with a mask), block_k of 128, and the blocks must fit the VMEM budget; otherwise
        ``ValueError`` naming the argument.
      interpret: ``None`` (compiled with Mosaic on a TPU, the generic interpreter elsewhere),
        ``True``/``False``, or a ``pltpu.InterpretParams`` (TPU interpret mode).
      chip: the TPU generation ("v4", "v5e", "v5p", "v6e", "7x") whose VMEM sizes the default
        blocks, the VMEM check and the compiled kernel's ``vmem_limit_bytes``, forward and
        backward. ``None`` (default) reads the compile target: the chip
        :func:`flashlab.tpu_compile.compile` compiles for, or the TPU devices of the mesh being
        traced under, else this host's TPU, else ``v5e``. An explicit ``chip`` wins.
      sinks: optional float ``[heads]`` sink logits, merged into each row's state at the
        last kv step (``online_softmax.sink_state``); differentiable.

    Returns ``[batch, q_seq, heads, head_dim_v]`` in the query's dtype (fp32 accumulation).
    Rows with no visible key are zeros, with zero gradients. Differentiable (``jax.grad``
    w.r.t. query, key, value and bias) through the backward kernels of
    :mod:`flashlab.kernels.backward` (chapter 07); the backward's block sizes are
    ``block_q``/``block_k`` when they fit its VMEM estimate, else
    :func:`flashlab.kernels.blocks.choose_backward_block_sizes`.
    """
    query, key, value, spec = masks.validate(
        query, key, value, bias, mask, scale=scale, is_causal=is_causal,
        query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
        local_window_size=local_window_size, segment_ids=segment_ids,
        logits_soft_cap=logits_soft_cap, sinks=sinks)
    return flash_attention_from_spec(query, key, value, spec, block_q=block_q, block_k=block_k,
                                     interpret=interpret, chip=chip)
