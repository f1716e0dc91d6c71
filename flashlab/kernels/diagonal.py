"""The causal diagonal of the fused backward, cut into kv strips (chapter 07).

A causal tile ``Sᵀ [B_c, B_r]`` (kv rows, query columns) that the diagonal crosses hides every
score with ``q < k``. Computing the whole tile wastes the hidden part: nearly half of a square
tile on the diagonal. The fused backward instead cuts such a tile into **pieces** along its kv
axis, strips of :func:`strip_rows` rows. Strip ``[a, a + w)`` sees queries from
``max(0, a + d)`` on (tile-local), with ``d = k_start − q_start``. So each strip is a piece
``K[a : a + w] × Q[q_lo : B_r]``: a staircase that computes ``(n + 1) / 2n`` of a square
diagonal tile at ``n`` strips (5/8 at 4, 9/16 at 8) instead of all of it. Strips that see
every query merge into one unmasked piece; strips that see none are dropped.

``d`` is one of a few values fixed by the blocks (one, 0, at ``B_r = B_c``; two at
``B_c = 2 B_r``): :func:`cases` lists the pieces of each, and the kernel runs the list of the
tile's ``d`` straight, with no branch between its pieces, so the compiler overlaps one
piece's matmuls with the next's. Every piece reads windows of the blocks already in VMEM
(:class:`backward_tile.Window`): no extra DMA. Kv strips, not query strips, so that dK and
dV (two accumulators) are each read and written once per tile, and only dQ once per piece.

:func:`visits` counts, per case, the tiles that take it: the static schedule's estimate
(``bench tpu-static``) prices each case by its own region.

The forward (chapter 05) cuts its crossed tiles the other way, along the **query** axis
(:func:`forward_cases`): its tile is ``S [B_r, B_c]`` and its running state ``(m, l, acc)``
is per query row, so a strip of query rows ``[a, a + h)`` is an independent chain that sees
kv columns ``[0, a + h − d)`` only: ``S = Q[a : a + h] K[0 : a + h − d]ᵀ`` and
``P V[0 : a + h − d]``, the same staircase from the other side.
"""
from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from flashlab.contract import masks
from flashlab.kernels.block_ranges import div_nonneg
from flashlab.kernels.forward_config import ForwardConfig

__all__ = ["Piece", "STRIP_ROWS", "MIN_BLOCK_K", "MIN_BLOCK_Q", "FORWARD_STRIP_ROWS",
           "FORWARD_MIN_BLOCK", "FORWARD_MIN_BLOCK_BY_CHIP", "FORWARD_STRIPS", "writes_first",
           "first_visit", "uncovered", "folds", "fold_length", "fold_step",
           "applies", "strip_rows", "cases", "crossing", "visits", "picture",
           "forward_strip_rows", "forward_applies", "forward_cases", "forward_visits"]

#: Kv rows per strip, per chip: the MXU's width (128 on v4/v5e/v5p, 256 on v6e/7x), the
#: narrowest strip whose matmuls still fill it. On the static schedule (B=2 T=8192 H=16
#: d=128 bf16 causal, jax 0.12.0.1 / libtpu 0.0.50.1) the whole fused backward is 7.74 ms
#: on v5e at 1024² with 128-row strips against 7.80 with 256, and 1.83 ms on v6e at
#: 1024 x 2048 with 256-row strips against 1.86 with 128.
STRIP_ROWS = {"v4": 128, "v5e": 128, "v5p": 128, "v6e": 256, "7x": 256}
#: The smallest blocks cut into strips: at 512² on v5e four strips cost 2286 cycles against
#: 2764 for the whole tile (2 x 2 sub-tiles of 256², each behind its own branch, had cost 3918).
MIN_BLOCK_K, MIN_BLOCK_Q = 512, 512


@dataclasses.dataclass(frozen=True)
class Piece:
    """Kv positions ``[k_lo, k_hi)`` by queries ``[q_lo, q_hi)`` of a tile (tile-local);
    ``masked``: some score in it is hidden (it builds the mask), else every one is seen."""
    k_lo: int
    k_hi: int
    q_lo: int
    q_hi: int
    masked: bool


def writes_first(cfg: ForwardConfig, fused: int) -> bool:
    """Whether the fused backward's first visit of each kv block *writes* dK, dV (``=``)
    instead of adding to accumulators zeroed at an init step (:func:`first_visit`).

    Under :func:`applies`, the first q block that sees kv block ``j`` is the crossed tile at
    ``d = k_start − q_start ≥ 0``: the q block before it ends before ``k_start``. So every kv
    row is written there (or zeroed there, if that tile's pieces do not reach it) before any
    later tile adds to it, and the per-row zeroing (2·B_c·d float32 stores) goes. It holds
    for the whole dQ only (chunks restart dK, dV per chunk at full tiles), one query head per
    kv head (G heads would each visit it first), no run-time or padding lengths (the crossed
    tile could then skip) and ``kv_len ≤ q_len`` (every kv block is seen by some query)."""
    return (int(fused) == 1 and applies(cfg) and cfg.group_size == 1 and not cfg.mask_q_len
            and not cfg.mask_kv_len and cfg.kv_len <= cfg.q_len)


def _row_tiles(cfg: ForwardConfig) -> list[int]:
    """Per kv block ``j``, the q blocks that see it under :func:`writes_first`'s conditions:
    from the crossed one (:func:`_crossed_q_block`) to the last."""
    return [cfg.num_q_blocks - _crossed_q_block(cfg, j) for j in range(cfg.num_kv_blocks)]


def folds(cfg: ForwardConfig, fused: int) -> bool:
    """Whether the fused backward runs on the **folded grid** ``(b, hk, p, s)``: kv blocks
    ``p`` and ``T_c − 1 − p`` share grid row ``p``, one after the other, so that a causal
    grid has no empty step and needs no visit list (:func:`fold_step`).

    Kv block ``j`` is seen by ``n_j = T_r − ⌊j·B_c / B_r⌋`` q blocks, linear in ``j``: so
    ``n_p + n_{T_c−1−p}`` is one length ``R`` for every pair and the ``T_c / 2`` rows of ``R``
    steps hold exactly the visible tiles (at T = 2048, 512²: 320 steps where the dense grid
    has 512). The step finds its ``(j, i)`` by a compare and a few adds, where the visit grid
    loads them from SMEM (and spills its scalars: 323 cycles a step on v5e against the dense
    grid's 194). Under :func:`writes_first`'s conditions (one query head per kv head: the
    grid has no ``g`` axis) and an even ``T_c``."""
    if not writes_first(cfg, fused) or cfg.num_kv_blocks % 2:
        return False
    n, nk = _row_tiles(cfg), cfg.num_kv_blocks
    return len({n[p] + n[nk - 1 - p] for p in range(nk // 2)}) == 1


def fold_length(cfg: ForwardConfig) -> int:
    """``R``: the steps of one folded grid row (:func:`folds`)."""
    n = _row_tiles(cfg)
    return n[0] + n[-1]


def fold_step(cfg: ForwardConfig, p, s):
    """``(j, i, first, last)`` of folded step ``(p, s)`` (traced or ints): the kv block and
    q block, and whether it is that kv block's first or last visit. Steps ``s < n_p`` run kv
    block ``p`` from its crossed q block on; the rest run kv block ``T_c − 1 − p``."""
    nq, nk, R = cfg.num_q_blocks, cfg.num_kv_blocks, fold_length(cfg)
    first_a = _crossed_q_block(cfg, p)                         # kv block p's crossed tile
    first_b = _crossed_q_block(cfg, nk - 1 - p)                # and its partner's
    n_a = nq - first_a
    second = _where(s >= n_a, 1, 0)
    j = p + second * (nk - 1 - 2 * p)
    i = first_a + s + second * (first_b - n_a - first_a)
    return j, i, (s == 0) | (s == n_a), (s == n_a - 1) | (s == R - 1)


def _crossed_q_block(cfg: ForwardConfig, j):
    """``⌊j·B_c / B_r⌋`` by a multiply or a shift where the blocks allow: a scalar divide is
    a sequence on the TPU's scalar unit (two of them cost the folded step 20 cycles on v5e at
    512²)."""
    bq, bk = cfg.block_q, cfg.block_k
    if bk % bq == 0:
        return j * (bk // bq)
    m = bq // bk
    if bq % bk == 0 and m & (m - 1) == 0 and not isinstance(j, (int, np.integer)):
        return jax.lax.shift_right_logical(j, m.bit_length() - 1)
    return div_nonneg(j * bk, bq)


def _where(c, a, b):
    """``a if c else b`` on ints or NumPy arrays (the traffic replay) or traced scalars."""
    if isinstance(c, jax.Array):
        return jnp.where(c, a, b)
    r = np.where(c, a, b)
    return r.item() if r.ndim == 0 else r


def first_visit(d: int) -> bool:
    """Whether the crossed tile at offset ``d`` is its kv block's first visible tile."""
    return d >= 0


def uncovered(pieces: tuple[Piece, ...], block_k: int) -> tuple[tuple[int, int], ...]:
    """The kv rows ``[lo, hi)`` of a tile that none of ``pieces`` computes (they see no query
    of the tile), in order."""
    out, at = [], 0
    for p in sorted(pieces, key=lambda p: p.k_lo):
        if p.k_lo > at:
            out.append((at, p.k_lo))
        at = max(at, p.k_hi)
    return tuple(out + ([(at, block_k)] if at < block_k else []))


def strip_rows(cfg: ForwardConfig) -> int:
    """The kv strip of ``cfg.chip`` (:data:`STRIP_ROWS`)."""
    return STRIP_ROWS.get(cfg.chip, 128)


def applies(cfg: ForwardConfig) -> bool:
    """Whether the fused backward cuts diagonal tiles into strips:
    :attr:`ForwardConfig.causal_only` (the pieces are cut from positions alone), blocks of at
    least :data:`MIN_BLOCK_K` x :data:`MIN_BLOCK_Q` and at least two strips."""
    return (cfg.causal_only and cfg.block_k >= MIN_BLOCK_K and cfg.block_q >= MIN_BLOCK_Q
            and cfg.block_k % strip_rows(cfg) == 0 and cfg.block_k >= 2 * strip_rows(cfg))


def crossing(cfg: ForwardConfig, d) -> bool:
    """Whether the tile at ``d = k_start − q_start`` hides some score (its last kv row comes
    after its first query): ``d > 1 − B_c``. Ints or traced."""
    return d > 1 - cfg.block_k


def _pieces(cfg: ForwardConfig, d: int) -> tuple[Piece, ...]:
    w, bq = strip_rows(cfg), cfg.block_q
    out: list[Piece] = []
    for a in range(0, cfg.block_k, w):
        q_lo = max(0, a + d)               # the strip's first row sees queries >= a + d
        if q_lo >= bq:
            continue                        # sees no query of this tile
        masked = a + w - 1 + d > q_lo       # its last row hides the columns before a + w - 1 + d
        if out and not masked and not out[-1].masked and out[-1].q_lo == q_lo == 0:
            out[-1] = dataclasses.replace(out[-1], k_hi=a + w)    # merge the unmasked strips
        else:
            out.append(Piece(a, a + w, q_lo, bq, masked))
    return tuple(out)


@functools.lru_cache(maxsize=256)
def _crossed(cfg: ForwardConfig) -> dict[int, int]:
    """Offset ``d`` -> the visible tiles per (batch, head) the diagonal crosses there,
    ascending in ``d``: one pass over the grid, from positions alone."""
    count: dict[int, int] = {}
    for i in range(cfg.num_q_blocks):
        for j in range(cfg.num_kv_blocks):
            q0, k0 = i * cfg.block_q, j * cfg.block_k
            if (k0 < cfg.kv_len and q0 < cfg.q_len and crossing(cfg, k0 - q0)
                    and masks.block_maybe_visible(q0, q0 + cfg.block_q, k0, k0 + cfg.block_k,
                                                  is_causal=True)):
                count[k0 - q0] = count.get(k0 - q0, 0) + 1
    return dict(sorted(count.items()))


def cases(cfg: ForwardConfig) -> tuple[tuple[int, tuple[Piece, ...]], ...]:
    """``((d, pieces), ...)``: each offset ``d = k_start − q_start`` at which a visible tile
    of ``cfg``'s grid is crossed by the diagonal, ascending, with its pieces; ``()`` where
    :func:`applies` is false."""
    return tuple((d, _pieces(cfg, d)) for d in _crossed(cfg)) if applies(cfg) else ()


def visits(cfg: ForwardConfig) -> tuple[int, ...]:
    """Per case of :func:`cases` (same order), the visible tiles per (batch, head) that take
    it, from positions alone."""
    return tuple(_crossed(cfg).values()) if applies(cfg) else ()


def picture(cfg: ForwardConfig, d: int, cell: int = 128, *, forward: bool = False) -> str:
    """The tile at offset ``d`` as text, one character per ``cell x cell`` scores, kv rows
    down and queries across (``Sᵀ``, both kernels drawn the same way): ``#`` computed, every
    score seen; ``\\`` computed, the diagonal crosses it; ``x`` computed, every score hidden;
    ``.`` not computed (hidden). ``forward``: the forward's pieces (:func:`forward_cases`),
    else the fused backward's (:func:`cases`)."""
    known = forward_cases(cfg) if forward else cases(cfg)
    pieces = dict(known).get(d)
    if pieces is None:
        raise ValueError(f"d: expected one of the crossing offsets {[c for c, _ in known]}"
                         f" of this config, got {d!r}")
    lines = []
    for r in range(0, cfg.block_k, cell):
        row = ""
        for c in range(0, cfg.block_q, cell):
            done = any(p.k_lo <= r < p.k_hi and p.q_lo <= c < p.q_hi for p in pieces)
            seen_all, seen_any = c >= r + cell - 1 + d, c + cell - 1 >= r + d
            row += ("." if not done else "#" if seen_all else "\\" if seen_any else "x")
        lines.append(row)
    return "\n".join(lines)


#: Query rows per strip of the forward's crossed tile, per chip (:func:`forward_cases`). Tall
#: strips: the MXU holds a block of keys and streams the strip's query rows past it, so a
#: strip of few rows pays the keys' load for little work. Measured with ``bench tpu-static``
#: (jax 0.12.0.1 / libtpu 0.0.50.1, B=2 H=16 d=128 bf16 causal; cycles of a crossed 1024²
#: tile, whole / 128 / 256 / 512-row strips): T=2048 v5e 4701 / 4045 / 3581 / 3705, v6e 3288 /
#: - / - / 2500 (256-row strips: 3093); v4 6588 / - / 4560 / 4789, v5p 4716 / - / 3582 /
#: 3690, 7x 3420 / - / 3204 / 2576.
FORWARD_STRIP_ROWS = {"v4": 256, "v5e": 256, "v5p": 256, "v6e": 512, "7x": 512}
#: The forward cuts tiles into strips only where a block is at least this long: at 512² the
#: strips save too little (v5e 1328 -> 1291 cycles a crossed tile, v5p 1313 -> 1301) to pay
#: for the step's extra case test (v5e 173 -> 181 cycles), 1.002x the whole kernel (4.309 ->
#: 4.33 ms, v5p 3.726 -> 3.75 once the interior tiles build no mask). v4 gains at 512²
#: (whole forward 7.97 -> 7.19 ms: its masked tile cost 1721 cycles, its interior tile now
#: 1530); v6e and 7x cut strips of 512 rows, so a 512-row block has one and is never cut.
FORWARD_MIN_BLOCK = 1024
FORWARD_MIN_BLOCK_BY_CHIP = {"v4": 512}
#: ``FLASHLAB_FORWARD_STRIPS=0`` (read once, at import, like ``FLASHLAB_BOUNDS_CHECKS``)
#: compiles the forward's crossed tiles whole again: the before of chapter 05's schedule, and
#: the row chunks' partial path (:attr:`ForwardConfig.partial_tiles`) for causal tiles.
FORWARD_STRIPS = os.environ.get("FLASHLAB_FORWARD_STRIPS", "1") != "0"


def forward_strip_rows(cfg: ForwardConfig) -> int:
    """The forward's query strip on ``cfg.chip`` (:data:`FORWARD_STRIP_ROWS`)."""
    return FORWARD_STRIP_ROWS.get(cfg.chip, 256)


def forward_applies(cfg: ForwardConfig) -> bool:
    """Whether the forward cuts diagonal tiles into query strips: :data:`FORWARD_STRIPS`,
    :attr:`ForwardConfig.causal_only`, a block of at least :data:`FORWARD_MIN_BLOCK` (per chip:
    :data:`FORWARD_MIN_BLOCK_BY_CHIP`), whole 128-lane kv widths and two strips."""
    h = forward_strip_rows(cfg)
    return (FORWARD_STRIPS and cfg.causal_only
            and max(cfg.block_q, cfg.block_k) >= FORWARD_MIN_BLOCK_BY_CHIP.get(
                cfg.chip, FORWARD_MIN_BLOCK)
            and cfg.block_q % h == 0 and cfg.block_q >= 2 * h and cfg.block_k % 128 == 0)


def _forward_pieces(cfg: ForwardConfig, d: int) -> tuple[Piece, ...]:
    h, bk = forward_strip_rows(cfg), cfg.block_k
    out = []
    for a in range(0, cfg.block_q, h):
        k_hi = min(bk, a + h - d)            # the strip's last query sees kv columns < a + h - d
        if k_hi <= 0:
            continue                         # sees no key of this tile
        out.append(Piece(0, k_hi, a, a + h, masked=a - d < k_hi - 1))   # first query: <= a - d
    return tuple(out)


def forward_cases(cfg: ForwardConfig) -> tuple[tuple[int, tuple[Piece, ...]], ...]:
    """The forward's :func:`cases`: ``((d, pieces), ...)`` per crossing offset ``d``, each
    piece a strip of :func:`forward_strip_rows` query rows by the kv columns it sees;
    ``()`` where :func:`forward_applies` is false."""
    return (tuple((d, _forward_pieces(cfg, d)) for d in _crossed(cfg))
            if forward_applies(cfg) else ())


def forward_visits(cfg: ForwardConfig) -> tuple[int, ...]:
    """Per case of :func:`forward_cases`, the visible tiles per (batch, head) that take it."""
    return tuple(_crossed(cfg).values()) if forward_applies(cfg) else ()
