"""The forward kernel's static configuration: what one call needs decided before tracing.

:func:`make_config` turns a validated :class:`~flashlab.contract.masks.AttentionSpec` into a
hashable :class:`ForwardConfig`: blocks (:func:`flashlab.kernels.blocks.choose_block_sizes`,
the per-chip table first), padded sizes, which masks and scalar-prefetch operands the kernel
needs, and the dense or visit grid. The backward (:func:`flashlab.kernels.backward_grid.make_backward_config`)
reuses it with its own blocks.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax.numpy as jnp
import numpy as np

from flashlab.contract import masks
from flashlab.contract.masks import AttentionSpec
from flashlab.kernels import blocks as blk
from flashlab.kernels import band, visit
from flashlab.kernels.tiling import kernel_head_dim


__all__ = ["ForwardConfig", "KEEP_NATURAL_SCORES", "SUPPORTED_DTYPES", "block_kwargs", "make_config"]

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


@dataclasses.dataclass(frozen=True)
class ForwardConfig:
    """Every static fact the forward kernel is built from (hashable: a jit static argument).

    Sizes are the *padded* ones the kernel sees (``q_len_p = T_r * block_q`` and so on);
    ``q_len``/``kv_len`` are the caller's. ``bias_bcast``/``mask_bcast`` say, per dim
    ``(batch, heads, T, S)``, whether bias/mask is full there (False) or 1, broadcast (True).
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
    bias_bcast: tuple[bool, bool, bool, bool] | None = None
    mask_bcast: tuple[bool, bool, bool, bool] | None = None
    has_segments: bool = False
    mask_q_len: bool = False        # query_seq_lengths given: rows past it are masked
    mask_kv_len: bool = False       # kv lengths given or kv padding: keys past it are masked
    return_lse: bool = False
    has_offsets: bool = False       # q/kv offsets: a third scalar-prefetch operand [2] int32
    chip: str | None = None         # the TPU generation the blocks and VMEM limit are for
    has_sinks: bool = False         # sinks [Hq]: merged into each row's state at finalize
    visit_grid: bool = False        # grid (B, H, n) over the visible blocks (kernels/visit.py)
    log2_scores: bool = False       # scale·log2(e) folded into Q_i, softmax in base 2 (below)
    chunk_rows: int | None = None   # the forward's tile folded in row chunks of this many
    chunk_cols: int | None = None   # ... and each row chunk in column chunks of this many

    @property
    def masks_tile(self) -> bool:
        """Whether a score tile can hide anything: causal, window, lengths, kv padding,
        segments or a mask. ``False``: every score is visible and the kernels build no mask."""
        return (self.is_causal or self.window is not None or self.length_masked
                or self.has_segments or self.mask_bcast is not None)

    @property
    def length_masked(self) -> bool:
        """q lengths, kv lengths or kv padding: rows or keys past a run-time length masked."""
        return self.mask_q_len or self.mask_kv_len

    @property
    def positions_only(self) -> bool:
        """No offsets, bias, mask or segment ids: a tile's scores follow from its positions."""
        return (not (self.has_offsets or self.has_segments) and self.bias_bcast is None
                and self.mask_bcast is None)

    @property
    def causal_only(self) -> bool:
        """Causal and :attr:`positions_only`, no window: the diagonal's strips are cut from
        positions (:mod:`.diagonal`); a visible tile the diagonal does not cross sees all."""
        return self.is_causal and self.window is None and self.positions_only

    @property
    def cap_in_query(self) -> bool:
        """Under a soft cap, whether ``scale/cap`` rides on the query block (one multiply and
        one ``tanh`` per score, base-2 softmax); :data:`SOFT_CAP_UNFOLDED` says where the
        unfolded form, ``cap·tanh(scale·s / cap)`` on natural logits, packs better."""
        return self.soft_cap is not None and not (
            self.chunk_rows and (self.chip, self.block_k) in SOFT_CAP_UNFOLDED)

    @property
    def row_chunks(self) -> int:
        """How many row chunks the forward folds one tile in (:data:`FORWARD_ROW_CHUNKS`)."""
        return 1 if self.chunk_rows is None else self.block_q // self.chunk_rows

    @property
    def col_chunks(self) -> int:
        """How many column chunks each row chunk is folded in (:data:`FORWARD_COL_CHUNK`)."""
        return 1 if self.chunk_cols is None else self.block_k // self.chunk_cols

    @property
    def partial_tiles(self) -> bool:
        """Whether a visible tile can hold a row chunk that sees none of its keys (causal with
        ``block_q > block_k``, or a window, in row chunks): the kernel then runs such a tile
        by a second path, its visible chunks only (:meth:`chunk_visits` counts them), unless it
        cuts crossed tiles into query strips
        (:func:`~flashlab.kernels.diagonal.forward_cases`), which run only what they see. Only
        where some visible tile does hold such a chunk (:func:`_partial_visits`, from
        positions; with q/kv offsets they are known at run time only, and the path stays)."""
        return self.row_chunks > 1 and (self.window is not None or (
            self.is_causal and self.block_q > self.block_k)) and (
            self.has_offsets or _partial_visits(self)[0] > 0)

    def chunks_seen(self, q_start, k_start) -> list:
        """Per row chunk of the tile at ``(q_start, k_start)``: whether it may see any of the
        tile's keys (:func:`masks.block_maybe_visible`: Python bools for ints, traced for
        traced positions). The kernel's partial path and :meth:`chunk_visits` both ask this."""
        rows = self.block_q // self.row_chunks
        return [masks.block_maybe_visible(q_start + c * rows, q_start + (c + 1) * rows,
                                          k_start, k_start + self.block_k,
                                          is_causal=self.is_causal, window=self.window)
                for c in range(self.row_chunks)]

    def chunk_visits(self) -> tuple[int, int]:
        """``(partial, chunks)`` per (batch, head): tiles taking the partial path
        (:attr:`partial_tiles`), the row chunks they run; from positions (the static estimate)."""
        return _partial_visits(self) if self.partial_tiles else (0, 0)

    def computed_pairs(self) -> int:
        """The (q block, kv block) pairs the kernels compute per (batch, head), from positions
        alone (causal and window skipping; data-dependent lengths count as full): what their
        ``pl.CostEstimate`` s count."""
        return blk.num_visible_blocks(self.num_q_blocks, self.num_kv_blocks, q_len=self.q_len_p,
                                      kv_len=self.kv_len, block_q=self.block_q,
                                      block_k=self.block_k,
                                      is_causal=self.is_causal and not self.has_offsets,
                                      window=None if self.has_offsets else self.window)

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
        """head_dim as the kernels carry it (:func:`.tiling.kernel_head_dim`: unpadded < 128)."""
        return kernel_head_dim(self.head_dim)

    @property
    def head_dim_v_p(self) -> int:
        return kernel_head_dim(self.head_dim_v)

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

    def visits(self, transposed: bool = False, q_chunks: int = 1) -> np.ndarray:
        """The packed visit list ``int32 [n]`` of the visit grid (:mod:`.visit`); rows are kv
        blocks with ``transposed`` (the dK/dV kernel's), once per q chunk with ``q_chunks``
        (the fused backward's)."""
        return visit.visit_table(num_q_blocks=self.num_q_blocks,
                                 num_kv_blocks=self.num_kv_blocks, q_len=self.q_len,
                                 kv_len=self.kv_len, block_q=self.block_q,
                                 block_k=self.block_k, is_causal=self.is_causal,
                                 window=self.window, transposed=transposed,
                                 q_chunks=q_chunks)


@functools.lru_cache(maxsize=64)
def _partial_visits(cfg: ForwardConfig) -> tuple[int, int]:
    """``(tiles, chunks)`` per (batch, head): the visible tiles holding a row chunk that sees
    none of their keys (causal and window, from positions alone) and the chunks that do see
    one. A window whose left side is a multiple of ``B_c`` leaves no such tile at
    ``B_r = B_c``, and there the partial path's per-step test was pure cost (v5e, 512², causal
    T=32768 with a 4096 window: grid step 193 -> 173 cycles)."""
    pairs = ([visit.unpack(int(v))[:2] for v in cfg.visits()] if cfg.visit_grid else
             [(i, j) for i in range(cfg.num_q_blocks) for j in range(cfg.num_kv_blocks)])
    partial = chunks = 0
    for i, j in pairs:
        seen = sum(map(bool, cfg.chunks_seen(i * cfg.block_q, j * cfg.block_k)))
        if 0 < seen < cfg.row_chunks:              # seen == 0: an invisible tile, skipped
            partial, chunks = partial + 1, chunks + seen
    return partial, chunks


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
                chip=None, visit_grid: bool | None = None,
                backward_blocks: bool = False) -> ForwardConfig:
    """Build (and check) the kernel configuration for a validated request.

    ``chip``: the TPU generation to size blocks and the VMEM limit for; ``None`` reads the
    compile target (:func:`flashlab.kernels.blocks.resolve_chip`: explicit ``chip`` wins).
    ``visit_grid``: run the forward, and the backward's dQ and dK/dV kernels, over the visible
    blocks only (:mod:`.visit`); ``None`` (default) does so when that removes enough grid
    steps to pay for the dearer visit step (:data:`VISIT_MAX_SHARE`: any for the forward, a
    third for the backward, 40% on v5e) and the request has no offsets (traced offsets move
    the visible set at run time), ``False`` keeps the dense grid; ``True`` where it is
    impossible raises ``ValueError``.
    ``backward_blocks``: the blocks are the backward kernels', already held to their own VMEM
    estimate (:func:`flashlab.kernels.backward_grid.make_backward_config`); only the tiling
    rule is checked here, not the forward's VMEM estimate.
    """
    chip = blk.resolve_chip(chip)
    dt = jnp.dtype(spec.dtype)
    if dt not in SUPPORTED_DTYPES:
        raise TypeError(f"query: the Pallas TPU kernel supports float32 and bfloat16, got {dt}")
    kw = dict(block_kwargs(spec), return_lse=return_lse)
    bias_dtype = kw["bias_dtype"]
    auto_q, auto_k = blk.choose_block_sizes(spec.q_len, spec.kv_len, spec.head_dim, dt, chip,
                                            is_causal=spec.is_causal, window=spec.window,
                                            **dict(kw, return_lse=True))  # as grad runs it
    block_q = auto_q if block_q is None else block_q
    block_k = auto_k if block_k is None else block_k
    blk.check_block_sizes(block_q, block_k, head_dim=spec.head_dim, dtype=dt, chip=chip,
                          vmem=not backward_blocks, **kw)
    full = (spec.batch, spec.num_heads, spec.q_len, spec.kv_len)
    bcast = lambda a: None if a is None else tuple(  # noqa: E731
        bool(a.shape[d] == 1 and full[d] > 1) for d in range(4))
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
    kernel = "backward" if backward_blocks else "forward"
    cfg = dataclasses.replace(cfg, visit_grid=_use_visit_grid(cfg, visit_grid, kernel),
                              chunk_rows=None if backward_blocks else _chunk_rows(cfg))
    if not backward_blocks:
        cfg = dataclasses.replace(cfg, chunk_cols=_chunk_cols(cfg))
    return dataclasses.replace(cfg, log2_scores=_log2_scores(cfg))


#: The most row chunks the forward folds its ``[B_r, B_c]`` tile in, per chip (absent: one).
#: Folded as one chain (``Q_i K_jᵀ`` on the MXU, then the softmax on the VPU, EUP and XLU, then
#: ``P V_j`` on the MXU) the tile leaves the MXU idle while the softmax runs: each stage needs
#: the whole of the one before (a row's max needs every column of ``Q_i K_jᵀ``). Rows are
#: independent, so cut into chunks of rows the tile is several chains, and the compiler's
#: scheduler runs one chunk's softmax under the next chunk's matmuls. Measured with
#: ``bench tpu-static`` (jax 0.12.0.1, libtpu 0.0.50.1; B=2 H=16 d=128 bf16; cycles of one
#: tile for 1 / 2 / 4 / 8 chunks): causal T=8192 1024²: v5e 5421 / 5040 / 4808 / 5568, v5p
#: 5387 / 5053 / 4818, v4 7002 / 6588 / 6588, v6e 3368 / 3288 / 3746 / 5114, 7x 3420 / 3487 /
#: 4016 (7x keeps one chain); non-causal 1024 × 2048: v5e 10191 / 9383 / 8723, v5p 10215 /
#: 9348 / 8791; 2048 × 1024: v6e 5745 / 5386 / 5614. Narrower tiles lose on v4 and v6e: at
#: 512² two chunks cost v6e 1001 -> 1309 cycles and v4 1721 -> 1770, v4's 2048 × 512 5548 ->
#: 5868; on v5e and v5p two chunks of a 512² tile win with base-2 scores (v5e 1328 -> 1276;
#: 1341 with natural ones, as first measured), hence :data:`CHUNK_MIN_BLOCK_K` and
#: :data:`CHUNK_MIN_ROWS`. v5e and v5p keep 256 rows a chunk in taller tiles (4 / 8 chunks:
#: 2048² v5e 17547 / 17137, v5p 17577 / 17125; d=256 34159 / 33615; 2048 × 1024 9112 / 8988).
FORWARD_ROW_CHUNKS = {"v5e": 16, "v5p": 16, "v4": 2, "v6e": 2}
#: The narrowest tile folded in chunks, per chip (absent: 1024): narrower, a tile has too
#: little softmax to hide, except on v5e and v5p, whose 512-column tiles gain from two
#: chunks of 256 rows (causal, 512²: v5e 1328 -> 1276 cycles, v5p 1313 -> 1289; non-causal
#: 1309 -> 1275 and 1309 -> 1290; v5e 1024 × 512 in four: 2698 -> 2367).
CHUNK_MIN_BLOCK_K = {"v5e": 512, "v5p": 512}
CHUNK_MIN_ROWS = 256         # a chunk of fewer rows has too little matmul to hide it under


def _chunk_rows(cfg: ForwardConfig) -> int | None:
    """The rows of one chunk of the forward's tile (:data:`FORWARD_ROW_CHUNKS`, as many chunks
    as leave :data:`CHUNK_MIN_ROWS` rows each), ``None`` for one chain: on a chip without an
    entry, for ``block_k < CHUNK_MIN_BLOCK_K``, or where two chunks do not fit the block.
    Chunks are whole multiples of 32 rows, so that each starts on a whole (sublane) tile of
    every block it cuts (float32 8 rows, bfloat16 16, the int8 mask 32)."""
    chunks = min(FORWARD_ROW_CHUNKS.get(cfg.chip, 1), cfg.block_q // CHUNK_MIN_ROWS)
    if (chunks < 2 or cfg.block_k < CHUNK_MIN_BLOCK_K.get(cfg.chip, 1024)
            or cfg.block_q % (32 * chunks)):
        return None
    return cfg.block_q // chunks


#: The widest column chunk of the forward's tile, per chip (absent: none). A row chunk of at
#: least :data:`COL_CHUNK_MIN_ROWS` rows and a wider ``block_k`` is folded in column chunks
#: of this many keys, one online-softmax update each, in row-major order: the scheduler then
#: runs one chunk's exp under the next chunk's ``Q_i K_jᵀ`` within a row chunk too. That adds
#: vector work (a row max and sum per chunk, one more rescale of ``acc``; v6e 2048²: VALU 5665
#: -> 6210 cycles, stores 5579 -> 6064) and still ends the tile sooner. Measured with
#: ``bench tpu-static`` (jax 0.12.0.1, libtpu 0.0.50.1; B=2 T=8192 H=16 d=128 bf16
#: non-causal; cycles of one tile, one column chunk -> chunks of 1024): v6e 2048² (2 row
#: chunks of 1024) 10318 -> 10070, 7x 2048² 11729 -> 10629, 7x 1024 × 2048 6126 -> 5696;
#: at d=64 v6e 10328 -> 10091, 7x 11732 -> 10624 and 6123 -> 5671.
#: Narrower pieces lose: v6e 1024 × 2048 (row chunks of 512) 5468 -> 5578, 2048 × 1024 in
#: chunks of 512 5386 -> 5724; v5e and v5p lose at 2048² (17563 -> 17698) and 1024 × 2048
#: (8723 -> 8970). Only for a tile that masks nothing and adds no bias (:func:`_chunk_cols`):
#: the plain tile, and the causal interior tile the query strips leave whole (causal 2048²,
#: unmasked and chunked: v6e 11785 -> 10070, 7x 13379 -> 10629).
FORWARD_COL_CHUNK = {"v6e": 1024, "7x": 1024}
COL_CHUNK_MIN_ROWS = 1024    # fewer rows: a column chunk has too little matmul to hide its exp


def _chunk_cols(cfg: ForwardConfig) -> int | None:
    """The keys of one column chunk of the forward's tile (:data:`FORWARD_COL_CHUNK`),
    ``None`` for whole rows: on a chip without an entry, for a tile no wider than the chunk or
    with row chunks of fewer than :data:`COL_CHUNK_MIN_ROWS` rows, for a tile that adds a bias
    (whose block the pieces would have to cut by columns too) or may run its row chunks one
    by one (:attr:`ForwardConfig.partial_tiles`), and for a tile that masks anything (window,
    lengths, padding, segments, mask) but causal alone (:attr:`ForwardConfig.causal_only`) or
    a window alone (:func:`band.applies`), whose interior tiles run unmasked."""
    cols = FORWARD_COL_CHUNK.get(cfg.chip)
    rows = cfg.block_q // cfg.row_chunks                    # the rows of one row chunk
    if (cols is None or cfg.block_k <= cols or cfg.block_k % cols or rows < COL_CHUNK_MIN_ROWS
            or cfg.bias_dtype is not None or cfg.partial_tiles):
        return None
    return cols if cfg.causal_only or band.applies(cfg) or not cfg.masks_tile else None


#: Where the forward keeps its scores unscaled-and-natural: (chip, masked tile). Elsewhere it
#: multiplies the query block by ``scale·log2(e)`` (``[B_r, d]`` once per tile instead of
#: ``[B_r, B_c]`` scores) and runs the online softmax in base 2 (``exp2``: no ``log2(e)``
#: multiply per score). The static schedule (B=2 T=8192 H=16 d=128 bf16, jax 0.12.0.1 / libtpu
#: 0.0.50.1) decides: the tile falls 6-15% on v4, v6e and 7x and, non-causal, 4-6% on v5e and
#: v5p, but a causal tile on v5e and v5p gets 3% slower (their MXU-bound schedule packs worse).
#: A tile folded in row chunks (:data:`FORWARD_ROW_CHUNKS`) packs the other way: base 2 wins
#: there on v5e and v5p too (causal 1024²: 4808 -> 4701 cycles on v5e, 4818 -> 4716 on v5p;
#: 512 × 1024: 2599 -> 2560 on both), so these chips keep natural logits only in one chain.
KEEP_NATURAL_SCORES = frozenset({("v5e", True), ("v5p", True)})


#: Where the forward's soft cap keeps its unfolded form (:attr:`ForwardConfig.cap_in_query`):
#: (chip, ``B_c`` of a tile in row chunks). Folding ``scale/cap`` into the query block takes a
#: divide and a multiply off every score and keeps the softmax in base 2 (causal T=8192, cap 50,
#: one tile: 512² v4 2012 -> 1782 cycles, v5e 1433 -> 1345, v5p 1439 -> 1359, v6e 1321 -> 1117,
#: 7x 1355 -> 1144; 2048² v6e 12606 -> 11316, 7x 14285 -> 12491; v4 2048 × 512 7901 -> 6909),
#: but v5e and v5p pack row chunks of 2048 keys worse with it (256 rows each; whole forward,
#: folded -> unfolded: 2048² v5e 3.83 -> 3.55 ms, v5p 3.29 -> 3.06; 1024 × 2048 3.93 -> 3.68,
#: 3.38 -> 3.18) and of 1024 or 512 keys better (2048 × 1024 v5e 3.65 -> 3.70; 1024² 3.72 ->
#: 3.75, v5p 3.20 -> 3.23; 2048 × 512 3.69 -> 3.84).
SOFT_CAP_UNFOLDED = frozenset({("v5e", 2048), ("v5p", 2048)})


def _log2_scores(cfg: ForwardConfig) -> bool:
    """Softmax in base 2: fold ``scale·log2(e)`` into the query block (``log2(e)`` into the
    soft cap's ``cap``), except where :data:`KEEP_NATURAL_SCORES` says not (a tile in one
    chain there) and where a soft cap stays unfolded (:data:`SOFT_CAP_UNFOLDED`)."""
    if cfg.soft_cap is not None and not cfg.cap_in_query:
        return False
    return cfg.chunk_rows is not None or (cfg.chip, cfg.masks_tile) not in KEEP_NATURAL_SCORES


#: The largest share of the dense grid's steps a visit list may keep and still be chosen by
#: default (``visit_grid=None``), per kernel and chip. A visit step reads its block indices
#: from SMEM and costs more than a dense one in the backward kernels, so skipping a quarter of
#: the steps does not pay there. Measured with ``bench tpu-static`` (jax 0.12.0.1, libtpu
#: 0.0.50.1; causal, bf16, d=128; the forward and the fused backward on both grids, with the
#: DMA bounds checks off and the visit list read as planes; visit / dense estimate):
#:
#: * T=2048, 1024² (the list keeps 3 of 4 steps): the forward's list wins on all five chips
#:   (0.978-0.996), the fused backward's loses on four (v5e 1.008: a visit step of 320 cycles
#:   against a dense one of 195; v6e wins by 0.2%);
#: * T=2048, 512² (10 of 16): the backward's wins on v5p, v6e and 7x (0.968-0.989) and loses
#:   on v4 (1.0025) and v5e (1.0046);
#: * T=8192, 512² and 1024² (17 and 18 of 32): the backward's wins everywhere (0.949-0.995).
VISIT_MAX_SHARE = {("forward", None): 1.0, ("backward", None): 2 / 3, ("backward", "v5e"): 0.6,
                   ("backward", "v4"): 0.6}


def _use_visit_grid(cfg: ForwardConfig, want: bool | None, kernel: str = "forward") -> bool:
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
        elif want is None:
            dense = cfg.num_q_blocks * cfg.num_kv_blocks
            share = VISIT_MAX_SHARE.get((kernel, cfg.chip), VISIT_MAX_SHARE[(kernel, None)])
            if n >= dense or n > share * dense:
                return False     # nothing skipped, or too little to pay for the dearer steps
    if why is not None:
        if want:
            raise ValueError(f"visit_grid=True: not possible here: {why}")
        return False
    return True
