"""Block sizes, the (8, 128) tiling rule, the VMEM estimates, padding (and, re-exported from
:mod:`flashlab.kernels.block_ranges`, the visible kv range).

A TPU's vector registers and VMEM are tiled in ``(sublanes, lanes) = (8, 128)`` 32-bit tiles.
A BlockSpec's last two dims must therefore be multiples of the tile (or equal the whole
array dim). Narrower dtypes pack several rows into one 32-bit sublane, so their native
sublane tile is taller: 8 rows for float32/int32, 16 for bfloat16, 32 for int8/bool.

In the forward kernel (layout ``[batch, heads, seq, head_dim]`` inside):

* ``block_q`` (B_r) is the sublane dim of the Q, O, bias and mask blocks: a multiple of the
  tallest sublane tile among them (8 fp32, 16 bf16, 32 when an int8 mask block is present);
* ``block_k`` (B_c) is the lane dim of the score, bias and mask blocks: a multiple of 128;
* head_dim is the lane dim of Q, K, V, O: padded to a multiple of 128 (zero lanes do not
  change ``q·k``, and zero value lanes are sliced off the output).

VMEM capacity per TensorCore comes from ``pltpu.get_tpu_info_for_chip`` when the installed JAX
has it, else from :data:`VMEM_BYTES` (copied from ``jax/_src/pallas/mosaic/tpu_info.py`` in
JAX 0.10.2; the v5e/v6e figures match Google's TPU system-architecture pages).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from flashlab.compat import pallas as compat
from flashlab.contract import device
from flashlab.kernels import tuned_blocks
# Block skipping (the visible ranges and the clamp) lives in block_ranges; re-exported here.
from flashlab.kernels.block_ranges import (  # noqa: F401
    _block_span, clamp_block, div_nonneg, every_block_visible, kv_block_range, num_edge_blocks,
    num_visible_blocks, q_block_range)
from flashlab.kernels.tiling import (LANES, SUBLANES, kernel_head_dim, lane_pad, round_up,
                                     sublane_tile)

__all__ = ["LANES", "SUBLANES", "VMEM_BYTES", "sublane_tile", "round_up", "lane_pad",
           "kernel_head_dim",
           "vmem_capacity_bytes", "vmem_budget_bytes", "vmem_bytes", "choose_block_sizes",
           "check_block_sizes", "kv_block_range", "resolve_chip", "vmem_limit_bytes",
           "clamp_block", "num_visible_blocks", "div_nonneg", "q_block_range",
           "every_block_visible",
           "backward_vmem_bytes", "choose_backward_block_sizes", "padding_fit"]

#: VMEM per TensorCore, bytes (JAX 0.10.2 ``tpu_info._get_tpu_info_impl``).
VMEM_BYTES = {
    "v2": 16 << 20, "v3": 16 << 20, "v4": 16 << 20, "v4i": 16 << 20,
    "v5e": 128 << 20, "v5p": 64 << 20, "v6e": 128 << 20, "7x": 64 << 20,
}
#: Chips whose vector unit has no 8-bit integer ops: Mosaic cannot compare an int8 vector there
#: ("failed to legalize operation 'arith.cmpi' ... vector<...xi8>", libtpu 0.0.42 for v4), so
#: the kernels widen the int8 mask block to int32 before comparing.
NO_INT8_VPU = frozenset({"v2", "v3", "v4", "v4i"})
DEFAULT_CHIP = "v5e"      # what Colab's TPU runtime gives today; used off-TPU
#: The smallest default scoped-VMEM limit of Mosaic (libtpu 0.0.42-0.0.50): what a kernel that
#: sets no ``vmem_limit_bytes`` may use on v4, v5e and v5p (on v4, the whole VMEM); v6e allows
#: 32 MiB, 7x 44 (measured per chip in :mod:`flashlab.instruments.roofline`).
DEFAULT_SCOPED_VMEM_BYTES = 16 << 20
#: Mosaic's register-allocator spill slots of the backward kernels, in float32 ``[B_r, B_c]``
#: tiles: the VMEM a kernel needs beyond its pipelined blocks and scratch. Measured with
#: libtpu 0.0.50.1 by compiling at a falling ``vmem_limit_bytes`` until it fails (v4 and v5e,
#: blocks 512x512 to 1024x1024, with and without bias, segment ids, causal): dQ 1.0-1.2 tiles,
#: dK/dV 1.9-2.0; a soft cap adds 0.7-0.9 (its tanh tile). The fused kernel (dK/dV and dQ in
#: one), measured the same way with libtpu 0.0.50.1 on all five chips (non-causal, its largest
#: need; 1024x1024, 2048x1024, 2048x2048; B=2 T=8192 N=16 d=128 bf16): 1.5-1.72 tiles in all,
#: less than the split's dK/dV (38.06 MiB on 7x at 2048², 39.55 on v5p). Its old charge, the
#: dK/dV's plus a tile for the third matmul (3.25), kept 2048² off v5p and 7x (64 MiB against
#: their 48 MiB limit). Rounded up here, so the estimate stays an upper bound:
#: tests/test_tpu_compile.py compiles the backward with its limit set to the estimate (v4
#: 1024x1024 plain and with segment ids, soft cap + bias, a mask; fused on v4, v5e and 7x).
BACKWARD_SPILL_TILES = {"dq": 1.5, "dkdv": 2.25, "fused": 2.0}
#: The forward kernel's spill slots, in float32 ``[B_r, B_c]`` tiles, measured the same way
#: (v4 and v5e, blocks 512x512 to 2048x2048, bf16 and float32, head_dim 128 and 256, each
#: option alone and together): 1.1-1.2 tiles on v4 (0.2-0.6 on v5e) plus a float32
#: ``[B_r, d_v]`` P·V product. A mask adds 1.05 on v4 (no 8-bit vector ops there: the int8
#: block is widened to int32 before the compare), a mask with segment ids 1.8 (two compares
#: joined); a bias or segment ids alone add nothing measurable, but every measured
#: combination stays under the estimate only if they are charged too (bias + mask + segment
#: ids + soft cap + lse: 2.97 tiles). Rounded up so the estimate stays an upper bound:
#: tests/test_tpu_compile.py compiles the forward with its limit set to the estimate.
FORWARD_SPILL_TILES = {"base": 1.25, "mask": 1.25, "segments": 0.75, "bias": 0.25}


def resolve_chip(chip: str | None = None) -> str:
    """The TPU generation the kernels are built for: ``chip`` if given, else the compile target.

    Order (first wins): an explicit ``chip`` ("v4", "v5e", "v5p", "v6e", "7x"...); the chip
    being compiled for (:func:`flashlab.contract.device.target_chip`: a
    :func:`flashlab.instruments.tpu_compile` target, or the TPU devices of the mesh being traced
    under); this host's TPU; ``v5e``.
    """
    if chip is None:
        chip = device.target_chip() or DEFAULT_CHIP
    name = str(chip).lower().removeprefix("tpu").removeprefix("_").strip() or DEFAULT_CHIP
    if name not in VMEM_BYTES:
        raise ValueError(f"chip: expected one of {sorted(VMEM_BYTES)}, got {chip!r}")
    return name


def vmem_capacity_bytes(chip: str | None = None) -> int:
    """VMEM bytes of one TensorCore of ``chip`` (default: :func:`resolve_chip`)."""
    chip = resolve_chip(chip)
    if compat.get_tpu_info_for_chip is not None and compat.ChipVersion is not None:
        try:
            info = compat.get_tpu_info_for_chip(compat.ChipVersion(chip), 1)
            return int(info.vmem_capacity_bytes)
        except (ValueError, TypeError):
            pass
    return VMEM_BYTES[chip]


def vmem_budget_bytes(chip: str | None = None) -> int:
    """Half the VMEM, at most 48 MiB: the planning budget of an estimate that does not count
    Mosaic's spill slots (the decode kernel's, :mod:`flashlab.kernels.decode_grid`).

    Half leaves room for Mosaic's own internal scratch and for the spills of the temporaries.
    The forward and backward estimates (:func:`vmem_bytes`, :func:`backward_vmem_bytes`)
    count the spill slots as measured, so they are held to :func:`vmem_limit_bytes` instead.
    """
    return min(vmem_capacity_bytes(chip) // 2, 48 << 20)


def vmem_limit_bytes(chip: str | None = None) -> int:
    """The most scoped VMEM a kernel asks Mosaic for (``vmem_limit_bytes``; the forward asks
    for its need, up to this: :func:`flashlab.kernels.forward_grid.scoped_vmem_bytes`).

    Mosaic's *default scoped limit* is the VMEM a kernel may use unless it asks for more: at
    least 16 MiB (:data:`DEFAULT_SCOPED_VMEM_BYTES`), on the 16 MiB chips (v2-v4) the whole
    VMEM. This ceiling is twice the planning budget, capped at 3/4 of the physical VMEM, never
    less than that default: 16 MiB on v4, 96 MiB on v5e/v6e, 48 MiB on v5p/7x.
    XLA still checks the program against the physical VMEM at compile time ("Used X of 16.00M
    vmem"), so a block that does not fit fails to compile, it never runs out at run time.
    """
    cap = vmem_capacity_bytes(chip)
    return int(max(min(cap * 3 // 4, 2 * vmem_budget_bytes(chip)),
                   min(cap, DEFAULT_SCOPED_VMEM_BYTES)))


def vmem_bytes(block_q: int, block_k: int, head_dim: int, dtype, *, head_dim_v: int | None = None,
               bias_dtype=None, has_mask: bool = False, has_segments: bool = False,
               return_lse: bool = False, buffers: int = 2) -> int:
    """Estimated VMEM footprint (bytes) of one forward-kernel instance: an upper bound of what
    Mosaic allocates, held to :func:`vmem_limit_bytes` (the limit the kernel asks for).

    Pipelined blocks count ``buffers`` times (2 = double buffering: the block in use and the
    next one in flight), as the BlockSpecs declare them: Q ``[block_q, d]``, K ``[block_k, d]``,
    V ``[block_k, d_v]``, O ``[block_q, d_v]``, and optionally bias/mask ``[block_q, block_k]``,
    segment ids (``[block_q, 128]`` and ``[8, block_k]`` int32) and lse ``[block_q, 128]``
    float32. Scratch counts once: m and l ``[block_q, 128]`` float32 (lane-replicated), acc
    ``[block_q, d_v]`` float32. On top: Mosaic's spill slots, :data:`FORWARD_SPILL_TILES`
    float32 ``[B_r, B_c]`` tiles (more with a bias, a mask or segment ids) and one float32
    ``[B_r, d_v]`` (the P·V product before it joins acc). head dims are lane-padded.
    """
    e = jnp.dtype(dtype).itemsize
    d, dv = lane_pad(head_dim), lane_pad(head_dim_v or head_dim)
    blocks = (block_q * d + block_k * d + block_k * dv + block_q * dv) * e
    spill_tiles = FORWARD_SPILL_TILES["base"]
    if bias_dtype is not None:
        blocks += block_q * block_k * jnp.dtype(bias_dtype).itemsize
        spill_tiles += FORWARD_SPILL_TILES["bias"]
    if has_mask:
        blocks += block_q * block_k
        spill_tiles += FORWARD_SPILL_TILES["mask"]
    if has_segments:
        blocks += (block_q * LANES + SUBLANES * block_k) * 4
        spill_tiles += FORWARD_SPILL_TILES["segments"]
    if return_lse:
        blocks += block_q * LANES * 4
    scratch = (2 * block_q * LANES + block_q * dv) * 4
    temps = int(spill_tiles * block_q * block_k * 4) + block_q * dv * 4
    return buffers * blocks + scratch + temps


def _sublane_rule(dtype, bias_dtype=None, has_mask=False) -> int:
    rule = sublane_tile(dtype)
    if bias_dtype is not None:
        rule = max(rule, sublane_tile(bias_dtype))
    if has_mask:
        rule = max(rule, sublane_tile(jnp.int8))
    return rule


def check_block_sizes(block_q, block_k, *, head_dim, dtype, head_dim_v=None, bias_dtype=None,
                      has_mask=False, has_segments=False, return_lse=False, chip=None,
                      vmem: bool = True) -> None:
    """Raise ``ValueError`` naming the argument if a block size breaks tiling or (``vmem``) the
    forward kernel's VMEM estimate exceeds the limit it asks Mosaic for
    (:func:`vmem_limit_bytes`)."""
    for name, b in (("block_q", block_q), ("block_k", block_k)):
        if isinstance(b, bool) or not isinstance(b, (int, np.integer)):
            raise TypeError(f"{name}: expected a positive int, got {b!r}")
        if b < 1:
            raise ValueError(f"{name}: expected a positive int, got {b}")
    rule = _sublane_rule(dtype, bias_dtype, has_mask)
    if block_q % rule:
        why = (f"{jnp.dtype(dtype).name} rows" if rule == sublane_tile(dtype) else
               "int8 mask rows" if has_mask and rule == 32 else "bias rows")
        raise ValueError(f"block_q: expected a multiple of {rule} (the sublane tile of the "
                         f"{why}: the (8, 128) tiling rule), got {block_q}")
    if block_k % LANES:
        raise ValueError(f"block_k: expected a multiple of {LANES} (block_k is the lane dim of "
                         f"the score/bias/mask blocks: the (8, 128) tiling rule), got {block_k}")
    if not vmem:
        return
    need = vmem_bytes(block_q, block_k, head_dim, dtype, head_dim_v=head_dim_v,
                      bias_dtype=bias_dtype, has_mask=has_mask, has_segments=has_segments,
                      return_lse=return_lse)
    limit = vmem_limit_bytes(chip)
    if need > limit:
        raise ValueError(f"block_q, block_k: ({block_q}, {block_k}) need about {need / 2**20:.1f}"
                         f" MiB of VMEM (double-buffered blocks, scratch, spill slots), over the "
                         f"{limit / 2**20:.0f} MiB limit of {resolve_chip(chip)}; use smaller "
                         f"blocks")


def choose_block_sizes(q_len: int, kv_len: int, head_dim: int, dtype, chip: str | None = None,
                       *, head_dim_v: int | None = None, bias_dtype=None, has_mask=False,
                       has_segments=False, return_lse=False,
                       is_causal: bool | None = None, window=None) -> tuple[int, int]:
    """Default ``(block_q, block_k)`` for a problem on a TPU generation.

    With ``is_causal`` given (the forward kernel gives it), first the measured table
    (:mod:`flashlab.kernels.tuned_blocks`: the static bench's sweep winner per chip and shape
    class; a length no class holds takes the nearest class, :func:`tuned_blocks.lookup`), if
    the pair fits; under a ``window``
    ``(left, right)``, the stored window run's pairs ranked for the request's band
    (:func:`band_estimate`), the first that fits. Else the heuristic:
    start from large blocks (B_r = 512, B_c = 1024: few grid steps, long DMAs, a full MXU;
    fixed 128-blocks leave a v5e/v6e MXU waiting on per-step overhead), never larger than the
    (padded) sequence, then halve B_c, then B_r, until :func:`vmem_bytes` fits
    :func:`vmem_limit_bytes` of ``chip``. Both respect the tiling rule.
    """
    rule = _sublane_rule(dtype, bias_dtype, has_mask)
    limit = vmem_limit_bytes(chip)

    def fits(bq, bk):
        return vmem_bytes(bq, bk, head_dim, dtype, head_dim_v=head_dim_v, bias_dtype=bias_dtype,
                          has_mask=has_mask, has_segments=has_segments,
                          return_lse=return_lse) <= limit

    if is_causal is not None:
        for cand in _candidates("forward", q_len, kv_len, head_dim, dtype, chip, is_causal,
                                window):
            got = _measured(cand, q_len, kv_len, rule, fits)
            if got is not None:
                return got
    bq = min(512, round_up(q_len, rule))
    bk = min(1024 if lane_pad(head_dim) <= 128 else 512, round_up(kv_len, LANES))
    return _shrink_to_fit(fits, bq, bk, rule)


def padding_fit(length: int, block: int, unit: int) -> int:
    """A measured block (:mod:`flashlab.kernels.tuned_blocks`) for a ``length`` its class
    holds but its sweep did not: halved while half of it pads ``length`` less. A class is
    measured at one length (T = 2048 for [1024, 4095]); at T = 3000 its 2048-block would pad
    to 4096, a third of the grid's work on padding, where 1024 pads to 3072. Whole multiples
    of ``unit`` throughout; a block that tiles ``length`` as well as its half is kept."""
    while (block % (2 * unit) == 0
           and round_up(length, block // 2) < round_up(length, block)):
        block //= 2
    return block


def _candidates(kernel, q_len, kv_len, head_dim, dtype, chip, is_causal, window) -> list:
    """The measured candidates for a request, best first: its class's entry, or the nearest
    class's (:func:`tuned_blocks.lookup`; ``[]`` where the chip has none). Under a
    ``window``, every pair of the stored window run (:func:`tuned_blocks.band_rows`) ranked by
    :func:`band_estimate` at the request's lengths and window, where that run has rows for the
    chip. The table is
    measured without a window, and a band favours smaller blocks than a sweep's winner: a
    tile a band edge crosses is computed whole and masked, so the larger the blocks, the
    more of each band row is computed for nothing (under a 4096 window, 2048² blocks compute
    a band 1.5 times as wide as the window, 512² ones 1.125 times)."""
    chip = resolve_chip(chip)
    if window is not None:
        rows = tuned_blocks.band_rows(head_dim, dtype, chip, kernel=kernel)
        if rows:
            return sorted(rows, key=lambda r: band_estimate(r, q_len, kv_len,
                                                            is_causal=is_causal, window=window))
    e = tuned_blocks.lookup(q_len, kv_len, head_dim, dtype, chip, is_causal=is_causal,
                            kernel=kernel)
    return [] if e is None else [e]


def band_estimate(row, q_len: int, kv_len: int, *, is_causal: bool, window) -> float:
    """A stored window run's row (:func:`tuned_blocks.band_rows`) priced at ``q_len x kv_len``
    under ``window``: its whole-kernel estimate times the ratio of the work its blocks do
    here to the work they did in the run, where a computed tile costs a grid step and the
    inside tile, and a tile an edge crosses the edge tile's extra on top (its
    ``case_cycles``; a row without, e.g. one whose row chunks run one by one, prices every
    tile as its ``tile_cycles``). Ranks block pairs, not a time."""
    bq, bk = row["block_q"], row["block_k"]
    edge_extra = (row["case_cycles"][0] - row["tile_cycles"]) if row.get("case_cycles") else 0

    def work(tq, tk, causal, w):
        n = (-(-tq // bq), -(-tk // bk))
        kw = dict(q_len=tq, kv_len=tk, block_q=bq, block_k=bk, is_causal=causal, window=w)
        return (num_visible_blocks(*n, **kw) * (row["tile_cycles"] + row["step_cycles"])
                + num_edge_blocks(*n, **kw) * edge_extra)
    T = row["seq_len"]
    return row["est_cycles"] * work(q_len, kv_len, is_causal, window) / work(
        T, T, row["causal"], tuple(row["window"]))


def _measured(e, q_len: int, kv_len: int, q_unit: int, fits):
    """The measured table's entry ``e`` as blocks for this request (:func:`padding_fit` on
    each axis), or ``None`` where there is none, it breaks the tiling rule (``q_unit`` rows,
    128 lanes), exceeds the padded lengths or does not ``fits``."""
    if e is None:
        return None
    bq, bk = padding_fit(q_len, e["block_q"], q_unit), padding_fit(kv_len, e["block_k"], LANES)
    ok = (bq % q_unit == 0 and bk % LANES == 0 and bq <= round_up(q_len, q_unit)
          and bk <= round_up(kv_len, LANES) and fits(bq, bk))
    return (bq, bk) if ok else None


def _shrink_to_fit(fits, bq, bk, rule):
    """Halve ``block_k`` (down to 256, or to 128 once ``block_q`` is small), then ``block_q``,
    keeping the tiling rule, until ``fits(bq, bk)``: the one shrink order of every kernel."""
    while not fits(bq, bk):
        if bk > 256 or (bk > LANES and bq <= 128):
            bk = max(LANES, round_up(bk // 2, LANES))
        elif bq > rule:
            bq = max(rule, round_up(bq // 2, rule))
        else:  # pragma: no cover - the smallest blocks fit every chip
            break
    return int(bq), int(bk)


# ----------------------------------------------------------------------------- the backward

def backward_vmem_bytes(block_q: int, block_k: int, head_dim: int, dtype, *,
                        head_dim_v: int | None = None, bias_dtype=None, has_mask: bool = False,
                        has_segments: bool = False, soft_cap: bool = False, fused: bool = False,
                        q_len: int | None = None, group: int = 1, q_chunks: int = 1,
                        buffers: int = 2) -> int:
    """Estimated VMEM footprint (bytes) of the larger of the two backward kernels.

    Each kernel's pipelined blocks count ``buffers`` times, as its BlockSpecs declare them
    (:mod:`flashlab.kernels.backward_grid`): Q, dO ``[block_q, d]``, K, V ``[block_k, d]``,
    optionally bias/mask ``[block_q, block_k]``; the dQ kernel reads ``stats [block_q, 256]``
    float32 and q/kv segment ids ``[block_q, 128]``, ``[8, block_k]`` int32 and writes dQ
    ``[block_q, d]`` (and, with a bias, a float32 dS/dBias ``[block_q, block_k]``); the dK/dV
    kernel reads ``stats_t [8, block_q]`` float32 and segment ids ``[8, block_q]``,
    ``[block_k, 128]`` int32 and writes dK, dV ``[block_k, d]`` (``fused``: also the resident
    float32 dQ of the kv head's ``group`` query heads over the whole padded ``q_len``,
    ``[group, T, d]``, in one buffer, :func:`backward_grid.dkdv_grid_spec`; in ``q_chunks``
    chunks, ``[group, T / q_chunks, d]``, and dK, dV are then float32 partials). Scratch counts
    once: the float32 accumulators (dQ; dK and dV). On top: Mosaic's spill slots, :data:`BACKWARD_SPILL_TILES`
    float32 ``[B_r, B_c]`` tiles (the fused kernel's own count), one more with a soft cap (its
    tanh) or a mask (widened, compared). head dims are lane-padded.
    """
    e = jnp.dtype(dtype).itemsize
    d, dv = lane_pad(head_dim), lane_pad(head_dim_v or head_dim)
    tile = block_q * block_k * 4
    common = (block_q * d + block_q * dv + block_k * d + block_k * dv) * e
    if bias_dtype is not None:
        common += block_q * block_k * jnp.dtype(bias_dtype).itemsize
    if has_mask:
        common += block_q * block_k
    extra_tiles = int(bool(soft_cap)) + int(bool(has_mask))
    dq_blocks = common + block_q * 2 * LANES * 4 + block_q * d * e
    if bias_dtype is not None:
        dq_blocks += tile                                   # dS (full bias) or dBias out
    e_out = 4 if q_chunks > 1 else e                   # chunked: float32 dK, dV partials
    dkdv_blocks = common + SUBLANES * block_q * 4 + block_k * (d + dv) * e_out
    if has_segments:
        dq_blocks += (block_q * LANES + SUBLANES * block_k) * 4
        dkdv_blocks += (SUBLANES * block_q + block_k * LANES) * 4
    resident = 0
    if fused:      # dQ [G, T_pad, d] float32, resident per (b, kv head), one buffer
        resident = group * round_up(q_len or block_q, block_q) // q_chunks * d * 4
    dq = (buffers * dq_blocks + block_q * d * 4
          + int((BACKWARD_SPILL_TILES["dq"] + extra_tiles) * tile))
    spill = BACKWARD_SPILL_TILES["fused" if fused else "dkdv"]
    dkdv = (buffers * dkdv_blocks + resident + block_k * (d + dv) * 4
            + int((spill + extra_tiles) * tile))
    return max(dkdv, dq)


def _backward_fits(bq, bk, head_dim, dtype, chip, **kw) -> bool:
    """The estimate counts Mosaic's own spill slots, so it is held to the limit the kernels
    ask for (:func:`vmem_limit_bytes`), as the forward's is."""
    return backward_vmem_bytes(bq, bk, head_dim, dtype, **kw) <= vmem_limit_bytes(chip)


def choose_backward_block_sizes(q_len: int, kv_len: int, head_dim: int, dtype,
                                chip: str | None = None, *, head_dim_v: int | None = None,
                                bias_dtype=None, has_mask=False, has_segments=False,
                                soft_cap: bool = False, fused: bool = False, group: int = 1,
                                is_causal: bool | None = None, window=None
                                ) -> tuple[int, int]:
    """Default ``(block_q, block_k)`` of the backward kernels for a problem on a chip.

    With ``is_causal`` given, first the measured table (:mod:`flashlab.kernels.tuned_blocks`,
    ``kernel="backward"``: the pair with the lowest dQ + dK/dV static estimate per chip and
    shape class, or the nearest class's, :func:`tuned_blocks.lookup`) if the pair fits (under
    a ``window``, as in :func:`choose_block_sizes`). Else the heuristic: the backward holds
    more ``[B_r, B_c]`` float32 temporaries than the forward and twice its pipelined blocks,
    so it starts smaller: ``B_r = B_c = 512`` (never larger than the padded sequence), then
    halves B_c, then B_r, until :func:`backward_vmem_bytes` fits
    :func:`vmem_limit_bytes` of ``chip``. Same tiling rule as the forward. ``soft_cap``,
    ``fused``, ``group``: as in :func:`backward_vmem_bytes`.
    """
    rule = _sublane_rule(dtype, bias_dtype, has_mask)
    kw = dict(head_dim_v=head_dim_v, bias_dtype=bias_dtype, has_mask=has_mask,
              has_segments=has_segments, soft_cap=soft_cap, fused=fused,
              **(dict(q_len=q_len, group=group) if fused else {}))
    if is_causal is not None:
        for cand in _candidates("backward", q_len, kv_len, head_dim, dtype, chip, is_causal,
                                window):
            got = _measured(cand, q_len, kv_len, max(rule, LANES),
                            lambda bq, bk: _backward_fits(bq, bk, head_dim, dtype, chip, **kw))
            if got is not None:
                return got
    bq = min(512, round_up(q_len, rule))
    bk = min(512, round_up(kv_len, LANES))
    return _shrink_to_fit(lambda bq, bk: _backward_fits(bq, bk, head_dim, dtype, chip, **kw),
                          bq, bk, rule)


