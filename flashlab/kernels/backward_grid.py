"""The backward kernels' configuration and grids, as data (chapter 07).

:func:`make_backward_config` picks the backward's blocks and :func:`resolve_backward` the
backward that runs (:mod:`flashlab.kernels.backward_config`); :func:`dkdv_grid_spec`,
:func:`dq_grid_spec` and :func:`dbias_grid_spec` build the exact grids, BlockSpecs and scratch
of the three ``pallas_call`` s of :mod:`flashlab.kernels.backward`, reusing the forward's index
maps and mask operands (:mod:`flashlab.kernels.forward_grid`);
:mod:`flashlab.instruments.traffic` replays the same objects.

The dBias grid (a bias broadcast over batch and/or heads) is the bias's own axes, then
``(T_r, T_c)``, then the broadcast axes innermost ("arbitrary"), so the float32 output block
``dBias_ij`` stays resident while every broadcast (b, h) adds its dS_ij: no ``[B, N, T, S]``
array is made (the full float32 dS is 2 GiB at B=2, N=16, T=S=4096).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from flashlab.compat import pallas as compat
from flashlab.kernels import blocks as blk
from flashlab.kernels import band, diagonal
from flashlab.kernels import forward_grid
from flashlab.kernels import forward_config
from flashlab.kernels import visit
from flashlab.compat.pallas import pl
from flashlab.kernels.block_ranges import _max, _min, div_nonneg
from flashlab.kernels.backward_config import (  # noqa: F401  (re-exported: one import site)
    BACKWARDS, MAX_DQ_CHUNKS, dq_chunks, make_backward_config, grads_on_lanes,
    resolve_backward)
from flashlab.ladder import online_softmax


__all__ = ["BACKWARDS", "MAX_DQ_CHUNKS", "dq_chunks", "resolve_backward", "ForwardConfig", "LSE_ROW", "D_ROW", "LOG2E", "BackwardGridSpec", "STATS_LANES", "backward_grid_specs", "dbias_config", "dbias_grid_spec", "dkdv_grid_spec", "dq_grid_spec", "make_backward_config", "prefetch_names", "chunk_of_block", "grads_on_lanes"]

ForwardConfig = forward_config.ForwardConfig
# The dQ kernel's statistics ``stats [B, N, T, 256]`` float32: lse in lanes [0, 128), D_i in
# [128, 256), each lane-replicated, so a [B_r, B_c] broadcast is whole vregs reused (no lane
# broadcast). The dK/dV kernel's ``stats_t [B, N, 8, T]``: lse in sublane row 0, D_i in row 1,
# positions on lanes, as its transposed tile [B_c, B_r] wants them.
STATS_LANES = 2 * blk.LANES
LSE_ROW, D_ROW = 0, 1
LOG2E = online_softmax.LOG2E       # lse is stored (and P computed) in log2 units


# ----------------------------------------------------------------------------- grids as data

@dataclasses.dataclass(frozen=True)
class BackwardGridSpec(forward_grid.ForwardGridSpec):
    """One backward kernel's grid and BlockSpecs (see :class:`forward.ForwardGridSpec`).

    Index maps take ``(*grid indices, q_lengths, kv_lengths[, offsets | visits])`` and run on
    ints and NumPy arrays too, so :mod:`flashlab.instruments.traffic` replays them.
    ``visit_rows``: on a visit grid, ``"q"`` (rows are q blocks, the dQ kernel) or ``"kv"``
    (the dK/dV kernel's transposed list); ``None`` on the dense grid. ``q_chunks``: the fused
    backward's query chunks (:func:`dkdv_grid_spec`).
    """

    name: str = ""
    visit_rows: str | None = None
    q_chunks: int = 1

    def vmem_need(self) -> None:
        """``None``: the backward kernels still ask for the chip's ceiling. Asked for their
        need (:func:`blocks.backward_vmem_bytes`, as the forward asks for its own), the fused
        kernel's step moved both ways (T=8192, 512²: v5e non-causal 89 -> 82 cycles, causal
        197 -> 205; v6e causal 189 -> 179, at its 2048² default 189 -> 198)."""
        return None

    def visits(self) -> list:
        """The visit-list operand ``[visits [3n] int32]`` (:func:`visit.planes`) of a visit
        grid, else ``[]``."""
        if self.visit_rows is None:
            return []
        return [jnp.asarray(visit.planes(self.config.visits(
            transposed=self.visit_rows == "kv", q_chunks=self.q_chunks)))]


def prefetch_names(cfg: ForwardConfig, visits: bool = False) -> tuple[str, ...]:
    """The backward kernels' scalar-prefetch operands: q/kv lengths [and offsets | visits]."""
    return (("q_lengths", "kv_lengths") + (("offsets",) if cfg.has_offsets else ())
            + (("visits",) if visits else ()))


def _on_visit_grid(cfg: ForwardConfig, transposed: bool, q_chunks: int = 1) -> bool:
    """Run this backward kernel over the visible blocks only (``cfg.visit_grid``, the forward's
    choice: no offsets, steps to skip); the transposed list obeys the same size limit."""
    return cfg.visit_grid and (not transposed or len(
        cfg.visits(transposed=True, q_chunks=q_chunks)) <= visit.MAX_VISITS)


def _q_side_operands(cfg, q_map, kv_map, scores_map_for, qseg_map, kvseg_map,
                     transposed=False, lanes=False):
    """Inputs both kernels read: names, BlockSpecs, padded HBM shapes.

    ``transposed`` (the dK/dV kernel): the statistics are ``stats_t`` rows ``[8, B_r]`` and
    the segment ids swap orientation (q ids on lanes ``[8, B_r]``, kv ids on sublanes
    ``[B_c, 128]``), as the tile ``Sᵀ [B_c, B_r]`` wants them. ``lanes``
    (:func:`grads_on_lanes`): dO too, ``[B, N, d_v, T]`` in blocks ``[d_v, B_r]``.
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
        if lanes:                                                        # dO: [d_v, B_r]
            specs[3] = pl.BlockSpec((None, None, Dvp, bq), rows_map)
            shapes[3] = sds((B, N, Dvp, Tp), cfg.dtype)
        names.append("stats_t")
        specs.append(pl.BlockSpec((None, None, SL, bq), rows_map))
        shapes.append(sds((B, N, SL, Tp), jnp.float32))
    else:
        names.append("stats")
        specs.append(pl.BlockSpec((None, None, bq, STATS_LANES), q_map))
        shapes.append(sds((B, N, Tp, STATS_LANES), jnp.float32))
    n2, s2, sh2 = forward_grid.mask_operands(cfg, scores_map_for, qseg_map, kvseg_map)
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


def chunk_of_block(i, per: int):
    """The query chunk of q block ``i >= 0``, ``i // per`` (a shift when ``per``, the q blocks
    per chunk, is a power of two: one scalar op per grid step instead of a division)."""
    if per & (per - 1) == 0:
        return i >> (per.bit_length() - 1)
    return div_nonneg(i, per)


def _q_range(cfg, b, j, q_lengths, kv_lengths, offsets=None):
    if blk.every_block_visible(cfg):           # every q block, for every kv block (static)
        return 0, cfg.num_q_blocks - 1
    q_lengths, kv_lengths = forward_grid.static_lengths(cfg, q_lengths, kv_lengths)
    return blk.q_block_range(j, q_lengths[b], kv_lengths[b], block_q=cfg.block_q,
                             block_k=cfg.block_k,
                             is_causal=cfg.is_causal, window=cfg.window,
                             shift=forward_grid.offset_shift(offsets))


def dkdv_grid_spec(cfg: ForwardConfig, fused: int = 0) -> BackwardGridSpec:
    """The dK/dV kernel: grid ``(b, hk, j, g, i)``; query head ``h = hk·G + g``.

    On the visit grid (:func:`_on_visit_grid`) it is ``(b, hk, t, g)``: step ``t`` reads
    ``(j, i)`` from the transposed visit list (rows are kv blocks), and the ``G`` query heads
    sharing kv head ``hk`` run innermost, so dK_j, dV_j still accumulate over every (g, i)
    before the row's last visit writes them. Only ``b`` and ``hk`` are parallel. A plain
    causal MHA's fused kernel runs on the folded grid ``(b, hk, p, s)`` (:func:`diagonal.folds`),
    and a window's on the band grid ``(b, hk, j, g, t)``: q block ``lo + t``, ``lo`` the first
    of :func:`blocks.q_block_range` (:func:`band.grid_applies`: no list to read).

    ``fused`` (an int ``n ≥ 1``, or True for 1): the fused backward, one kernel for dQ, dK and
    dV. Its float32 output ``dq [B, N, T, d]`` (unscaled) is read in blocks ``[G, T / n, d]``,
    all of a kv head's query heads over one of ``n`` query chunks, whose index does not change
    while ``j``, ``g`` and ``i`` run: the block stays resident in VMEM and each step adds its
    ``dS'_ij K_j`` into rows ``i`` of head ``g``; it is written to HBM once, when the chunk
    moves on. No atomics, no dQ partials in HBM; the price is ``G·T·d·4 / n`` bytes of VMEM
    (one buffer, ``pl.Buffered(1)``: its write-back is rare, not worth a second copy), and the
    kv-block axis is "arbitrary" (only ``b`` and ``hk`` split across TensorCores).
    With ``n > 1`` the grid is ``(b, hk, c, j, g, i)`` with ``i`` local to chunk ``c`` (the
    visit grid lists chunk after chunk, :func:`visit.visit_table`), and dK, dV are float32
    partials ``[n, B, K, S, d]`` (scaled), one per chunk, summed after the kernel. Where
    :func:`grads_on_lanes`, dO is read in ``[d_v, B_r]`` blocks and dQ is ``[B, N, d, T]``
    in blocks ``[G, d, T / n]``.
    """
    n = int(fused)
    G = cfg.group_size
    bk = cfg.block_k
    Sp, Dp, Dvp = cfg.kv_len_p, cfg.head_dim_p, cfg.head_dim_v_p
    folded = diagonal.folds(cfg, n)         # (b, hk, p, s): no empty step, no visit list
    banded = not folded and band.grid_applies(cfg, max(n, 1))    # (b, hk, j, g, t)
    on_visits = not (folded or banded) and _on_visit_grid(cfg, transposed=True,
                                                          q_chunks=max(n, 1))
    clamp = cfg.length_masked
    per = cfg.num_q_blocks // max(n, 1)                  # q blocks per chunk

    def q_block(b, j, i, q_lengths, kv_lengths, offsets=None, chunk=None):
        lo, hi = _q_range(cfg, b, j, q_lengths, kv_lengths, offsets)
        if chunk is not None and not blk.every_block_visible(cfg):   # the chunk's q blocks
            lo, hi = _max(lo, chunk * per), _min(hi, chunk * per + per - 1)
        return blk.clamp_block(i, lo, hi, cfg.num_q_blocks)   # same clamp, on the q axis

    nv = len(cfg.visits(transposed=True, q_chunks=max(n, 1))) if on_visits else 0
    if on_visits:                       # (b, hk, t, g): (j, i) from the visit list's planes
        def idx(b, hk, t, g, q_lengths, kv_lengths, visits):      # -> (b, h, j, i)
            j, i = visit.at(visits, t)
            if clamp:                   # run-time lengths: a step past them copies nothing
                i = q_block(b, j, i, q_lengths, kv_lengths,
                            chunk=chunk_of_block(i, per) if n > 1 else None)
            return b, hk * G + g, j, i

        def chunk_of(b, hk, t, *a):
            return chunk_of_block(visit.at(a[-1], t)[1], per)
    elif folded:                        # (b, hk, p, s): (j, i) by arithmetic, all visible
        def idx(b, hk, p, s, *_):
            j, i, _, _ = diagonal.fold_step(cfg, p, s)
            return b, hk, j, i
    elif n > 1:                         # (b, hk, c, j, g, i): i local to chunk c
        def idx(b, hk, c, j, g, i, q_lengths, kv_lengths, offsets=None):
            return b, hk * G + g, j, q_block(b, j, c * per + i, q_lengths, kv_lengths,
                                             offsets, chunk=c)

        def chunk_of(b, hk, c, *a):
            return c
    elif banded:                        # (b, hk, j, g, t): q block lo + t, lo the range's first
        def idx(b, hk, j, g, t, q_lengths, kv_lengths):
            lo, hi = _q_range(cfg, b, j, q_lengths, kv_lengths)
            return b, hk * G + g, j, blk.clamp_block(lo + t, lo, hi, cfg.num_q_blocks)
    else:
        def idx(b, hk, j, g, i, q_lengths, kv_lengths, offsets=None):
            return b, hk * G + g, j, q_block(b, j, i, q_lengths, kv_lengths, offsets)

    def q_map(*a):                                           # Q_i, dO_i, lse_i, D_i
        b, h, _, i = idx(*a)
        return (b, h, i, 0)

    def kv_block(*a):                   # j: the grid's, or the row of visits[t] (no clamp)
        return idx(*a)[2] if folded else a[-1][a[2]] if on_visits else a[3 if n > 1 else 2]

    def kv_map(*a):                                          # K_j, V_j, dK_j, dV_j
        return (a[0], a[1], kv_block(*a), 0)

    def scores_map_for(bcast):
        def scores_map(*a):
            b, h, j, i = idx(*a)
            return (0 if bcast[0] else b, 0 if bcast[1] else h, 0 if bcast[2] else i,
                    0 if bcast[3] else j)
        return scores_map

    def qseg_map(*a):
        b, _, _, i = idx(*a)
        return (b, i, 0)

    def kvseg_map(*a):
        return (a[0], 0, kv_block(*a))

    lanes = grads_on_lanes(cfg, n)                    # only where the dense grid runs
    names, specs, shapes = _q_side_operands(cfg, q_map, kv_map, scores_map_for, qseg_map,
                                            kvseg_map, transposed=True, lanes=lanes)
    sds = jax.ShapeDtypeStruct
    B, K = cfg.batch, cfg.num_kv_heads
    if n > 1:                           # float32 partials [n, B, K, S, d], one per chunk
        def part_map(*a):
            return (chunk_of(*a),) + kv_map(*a)
        out_specs = (pl.BlockSpec((None, None, None, bk, Dp), part_map),
                     pl.BlockSpec((None, None, None, bk, Dvp), part_map))
        out_shapes = (sds((n, B, K, Sp, Dp), jnp.float32), sds((n, B, K, Sp, Dvp), jnp.float32))
    else:
        out_specs = (pl.BlockSpec((None, None, bk, Dp), kv_map),
                     pl.BlockSpec((None, None, bk, Dvp), kv_map))
        out_shapes = (sds((B, K, Sp, Dp), cfg.dtype), sds((B, K, Sp, Dvp), cfg.dtype))
    out_names = ("dk", "dv")
    if n:                  # the G heads of kv head hk, one chunk of rows: resident
        def dq_dims(T):                                  # lanes: [d, T], else [T, d]
            return (Dp, T) if lanes else (T, Dp)

        def dq_map(b, hk, *a):                           # block (chunk, 0), lanes (0, chunk)
            c = chunk_of(b, hk, *a) if n > 1 else 0
            return (b, hk, 0, c) if lanes else (b, hk, c, 0)
        out_names += ("dq",)
        out_specs += (pl.BlockSpec((None, G, *dq_dims(cfg.q_len_p // n)), dq_map,
                                   pipeline_mode=pl.Buffered(1)),)
        out_shapes += (sds((B, cfg.num_heads, *dq_dims(cfg.q_len_p)), jnp.float32),)
    scratch = (compat.VMEM((bk, Dp), jnp.float32), compat.VMEM((bk, Dvp), jnp.float32))
    if on_visits:
        grid = (B, K, nv, G)
        dims = ("parallel", "parallel", "arbitrary", "arbitrary")
    elif folded:
        grid = (B, K, cfg.num_kv_blocks // 2, diagonal.fold_length(cfg))
        dims = ("parallel", "parallel", "arbitrary", "arbitrary")
    elif n > 1:
        grid = (B, K, n, cfg.num_kv_blocks, G, per)
        dims = ("parallel", "parallel") + ("arbitrary",) * 4
    else:
        grid = (B, K, cfg.num_kv_blocks, G, band.q_steps(cfg) if banded else cfg.num_q_blocks)
        dims = ("parallel", "parallel", "arbitrary" if n else "parallel", "arbitrary",
                "arbitrary")
    return BackwardGridSpec(
        config=cfg, grid=grid,
        in_names=tuple(names), in_specs=tuple(specs), in_shapes=tuple(shapes),
        out_names=out_names, out_specs=out_specs, out_shapes=out_shapes,
        scratch_shapes=scratch, dimension_semantics=dims,
        name="flashlab_flash_backward_dkdv" + ("_fused" if n else ""),
        prefetch_names=prefetch_names(cfg, on_visits), scratch_names=("dk_acc", "dv_acc"),
        visit_rows="kv" if on_visits else None, q_chunks=max(n, 1))


def dq_grid_spec(cfg: ForwardConfig, with_dbias: bool = True) -> BackwardGridSpec:
    """The dQ kernel: the forward's grid ``(b, h, i, j)`` (or its visit grid ``(b, h, t)``,
    :func:`_on_visit_grid`), plus a dS output for dBias.

    The dS output ``[B, N, T, S]`` float32 exists only with a full-shape bias that is
    differentiated (``with_dbias``; a constant bias, e.g. ALiBi, gets none; a bias broadcast
    over batch or heads gets :func:`dbias_grid_spec` instead). It is written at every step,
    zeros where a tile is skipped, so it keeps the dense grid.
    """
    bq, bk = cfg.block_q, cfg.block_k
    B, N, Tp, Sp, Dp = cfg.batch, cfg.num_heads, cfg.q_len_p, cfg.kv_len_p, cfg.head_dim_p
    with_ds = _full_bias(cfg) and with_dbias
    on_visits = _on_visit_grid(cfg, transposed=False) and not with_ds
    # the forward's grid and maps (static lengths too)
    maps = forward_grid.visit_index_maps(cfg) if on_visits else forward_grid.index_maps(cfg)

    def ds_map(b, h, i, j, q_lengths, kv_lengths, offsets=None):  # every block written
        return (b, h, i, j)

    names, specs, shapes = _q_side_operands(cfg, maps.q, maps.kv, maps.scores_for, maps.q_seg,
                                            maps.kv_seg)
    sds = jax.ShapeDtypeStruct
    out_names, out_specs = ["dq"], [pl.BlockSpec((None, None, bq, Dp), maps.q)]
    out_shapes = [sds((B, N, Tp, Dp), cfg.dtype)]
    if with_ds:
        out_names.append("ds")
        out_specs.append(pl.BlockSpec((None, None, bq, bk), ds_map))
        out_shapes.append(sds((B, N, Tp, Sp), jnp.float32))
    return BackwardGridSpec(
        config=cfg, grid=(B, N, len(cfg.visits())) if on_visits else cfg.grid,
        in_names=tuple(names), in_specs=tuple(specs),
        in_shapes=tuple(shapes), out_names=tuple(out_names), out_specs=tuple(out_specs),
        out_shapes=tuple(out_shapes), scratch_shapes=(compat.VMEM((bq, Dp), jnp.float32),),
        name="flashlab_flash_backward_dq", prefetch_names=prefetch_names(cfg, on_visits),
        scratch_names=("dq_acc",), visit_rows="q" if on_visits else None)


def _full_bias(cfg: ForwardConfig) -> bool:
    """A bias of the scores' full shape ``[B, N, T, S]``: its gradient is dS itself."""
    return cfg.bias_bcast is not None and not any(cfg.bias_bcast)


def dbias_config(cfg: ForwardConfig) -> ForwardConfig:
    """The backward's config when dBias is requested: a bias's broadcast T or S dim (``[.., 1,
    S]``, ``[.., T, 1]``) is read at full length, so dBias is dS summed over batch/heads only
    (the wrapper broadcasts the bias to ``[B|1, N|1, T, S]`` and sums dBias back to its shape).
    Without a bias gradient the kernels read such a bias in its broadcast form."""
    bc = cfg.bias_bcast
    if bc is None or not (bc[2] or bc[3]):
        return cfg
    return dataclasses.replace(cfg, bias_bcast=(bc[0], bc[1], False, False))


def backward_grid_specs(cfg: ForwardConfig, with_dbias: bool = True, fused: bool = False
                        ) -> dict[str, BackwardGridSpec]:
    """``{"dkdv": ..., "dq": ...[, "dbias": ...]}``: the backward kernels' grids, in the order
    they run (``dbias`` only for a differentiated bias broadcast over batch or heads).
    ``fused``: ``{"fused": ...[, "dbias": ...]}``, the fused backward's one kernel (and the
    dBias kernel for any differentiated bias: there is no dQ kernel to write dS)."""
    cfg = dbias_config(cfg) if with_dbias else cfg
    if fused:
        out = {"fused": dkdv_grid_spec(cfg, fused=True)}
    else:
        out = {"dkdv": dkdv_grid_spec(cfg), "dq": dq_grid_spec(cfg, with_dbias)}
    if with_dbias and cfg.bias_bcast is not None and (fused or any(cfg.bias_bcast)):
        out["dbias"] = dbias_grid_spec(cfg)
    return out


def _dbias_order(cfg: ForwardConfig) -> tuple[str, ...]:
    """Grid axes of the dBias kernel: the bias's own axes, then its broadcast ones innermost."""
    bcast = dict(zip("bh", cfg.bias_bcast))
    return tuple(a for a in "bh" if not bcast[a]) + ("i", "j") + tuple(
        a for a in "bh" if bcast[a])


def dbias_grid_spec(cfg: ForwardConfig) -> BackwardGridSpec:
    """The dBias kernel, for a bias broadcast over batch and/or heads (``[1|B, 1|N, T, S]``;
    also a full-shape one under the fused backward, which has no dQ kernel to write dS).

    dBias_ij = Σ over the broadcast (b, h) of dS_ij, accumulated in the float32 output block
    itself: the grid is the bias's own axes, then ``(i, j)``, then the broadcast axes, which
    are innermost and "arbitrary", so the block stays resident while they run and no
    ``[B, N, T, S]`` array is ever made. Each step recomputes S and dP (two matmuls).
    """
    cfg = dbias_config(cfg)
    order = _dbias_order(cfg)
    sizes = dict(b=cfg.batch, h=cfg.num_heads, i=cfg.num_q_blocks, j=cfg.num_kv_blocks)
    maps = forward_grid.index_maps(cfg)

    def bhij(f):                            # a (b, h, i, j) map on this grid's order
        def m(*idx):
            ax = dict(zip(order, idx[:4]))
            return f(ax["b"], ax["h"], ax["i"], ax["j"], *idx[4:])
        return m

    def dbias_map(b, h, i, j, *_):
        return (0 if cfg.bias_bcast[0] else b, 0 if cfg.bias_bcast[1] else h, i, j)

    names, specs, shapes = _q_side_operands(
        cfg, bhij(maps.q), bhij(maps.kv), lambda bc: bhij(maps.scores_for(bc)),
        bhij(maps.q_seg), bhij(maps.kv_seg))
    bias_shape = forward_grid.mask_operands(cfg, maps.scores_for, maps.q_seg, maps.kv_seg)[2][0].shape
    n_bc = sum(cfg.bias_bcast[:2])     # 0: a full-shape bias (fused backward), all parallel
    return BackwardGridSpec(
        config=cfg, grid=tuple(sizes[a] for a in order), in_names=tuple(names),
        in_specs=tuple(specs), in_shapes=tuple(shapes), out_names=("dbias",),
        out_specs=(pl.BlockSpec((None, None, cfg.block_q, cfg.block_k), bhij(dbias_map)),),
        out_shapes=(jax.ShapeDtypeStruct(bias_shape, jnp.float32),), scratch_shapes=(),
        dimension_semantics=("parallel",) * (4 - n_bc) + ("arbitrary",) * n_bc,
        name="flashlab_flash_backward_dbias", prefetch_names=prefetch_names(cfg))
