"""The TPU compiler's own schedule of a Pallas kernel, read tile by tile.

libtpu can write the VLIW bundles it scheduled for every kernel (see :data:`DUMP_FLAGS` and
:mod:`flashlab.instruments.tpu_dump`, which takes the dumps in a child process). In the
``*packed-bundles-post-ra*`` dump each bundle is one cycle: the empty latency bundles are still
there (the later ``final_bundles`` drops them and so undercounts). This module reads that
file, and its companion ``*pre-delay_hlo-static-per-bundle-utilization*`` table (the
compiler's per-bundle busy count of each unit, aligned bundle for bundle), into:

- the **grid loop**: the one loop of the kernel (the bundle labelled ``LB:`` and the backward
  ``sbr.rel`` that returns to it); one trip is one grid step;
- the **tile**: the predicated region (``sbr.rel`` forward over it, a ``pl.when``) that holds
  every MXU instruction of the loop: the compute of one (B_r, B_c) tile (or, where that
  region holds several paths, the whole tile's path: :mod:`flashlab.instruments.tpu_paths`;
  with no branch of its own, that region less init and finalize:
  :attr:`TileSchedule.unpredicated`);
- **init** and **finalize**: the MXU-free, DMA-free regions beside the tile (the
  ``pl.when(j == 0)`` and ``pl.when(j == last)`` of the online softmax), run once per row;
- **per-step cycles**: the rest of the loop body, paid by every grid step, skipped or not
  (index maps, the block-visibility test, DMA issue and waits, pipeline bookkeeping);
- **MXU-busy cycles**: each ``vmatmul`` keeps its MXU busy for the rows it streams through
  (8 sublanes times the dtype's packing: 16 for bf16, 8 for f32), from the bundle after it
  issues. On the 256-deep MXUs of v6e and 7x one row of operands takes two vregs
  (``vmatprep.mubr`` then ``vmatmul.mubr``), so a ``vmatmul.mubr`` streams half as many.
  This model is checked bundle for bundle against the compiler's own MXU column, and the VPOP
  column against the pops we count: any disagreement raises
  :class:`ScheduleFormatError` naming the file, the bundle and both figures.

Region cycles are the bundles strictly between a branch and its target. Static figures: no
DMA waits, no HBM bandwidth, no pipeline bubbles of a real run. They rank kernels and block
sizes; they are not wall time.
"""
from __future__ import annotations

import collections
import dataclasses
import re
from pathlib import Path

from flashlab.instruments import tpu_paths

__all__ = ["DUMP_FLAGS", "ScheduleFormatError", "Bundle", "Region", "TileSchedule",
           "parse_bundles", "parse_utilization", "mxu_busy", "analyze", "unit_of",
           "kernel_cycles", "UNITS"]

# libtpu flags (LIBTPU_INIT_ARGS, read once when libtpu initializes) that write the schedule;
# "{dir}" is the dump directory. The regex keeps the dump to ~10 MB instead of ~150 MB.
DUMP_FLAGS = ("--xla_jf_dump_to={dir} --xla_jf_dump_llo_text=true "
              "--xla_jf_dump_llo_pass_label_regex="
              "(packed-bundles-post-ra|final_bundles|static-per-bundle)")

# Rows one vmatmul streams through the MXU: a vreg is 8 sublanes, times the packing of the
# LHS dtype (two bf16 per 32-bit sublane). One row per cycle.
MXU_ROWS = {"f32": 8, "bf16": 16, "s8": 32, "u8": 32, "f8e4m3": 32, "f8e5m2": 32}

UNITS = ("MXU", "XLU", "VPU", "EUP", "load", "store", "DMA", "scalar", "sync")
_EUP = {"vexp2", "vexp", "vlog2", "vlog", "vrcp", "vrsqrt", "vsqrt", "vtanh", "vpow2",
        "vsigmoid", "verf", "vsin", "vcos"}

_BUNDLE = re.compile(r"^\s*(0x[0-9a-f]+|\d+)\s+(LB|LH|LE|PB|PF|CT)?:\s*(>*)\s*\{")  # > per loop depth
_BRANCH = re.compile(r"sbr\.rel\s*\(([^)]*)\)\s*target bundleno = (\d+) \(0x[0-9a-f]+\), "
                     r"region = (\d+)")
# msk: a masked operand. lmr (the fused backward's diagonal strips; its LHS from a latched
# matrix register, loaded by vllmr): busy half the rows, as mubr (the table agrees, bf16: 8).
_MATMUL = re.compile(r"^vmatmul\.(mubr\.|lmr\.)?(?:msk\.)?(\w+)\..*mxu(\d+)$")
_OPCODE = re.compile(r"^(?:%\S+\s*=\s*)?([A-Za-z_][\w.\[\]]*)")


class ScheduleFormatError(RuntimeError):
    """The dump is not what this parser was written for (libtpu's format moved), or our MXU
    model disagrees with the compiler's own utilization table."""


@dataclasses.dataclass
class Bundle:
    """One VLIW bundle (one cycle): its index, loop label (``LB`` ...) and instructions."""
    index: int
    label: str
    ops: list[str]
    text: str

    @property
    def opcodes(self) -> list[str]:
        return [m.group(1) for o in self.ops if (m := _OPCODE.match(o))]


@dataclasses.dataclass(frozen=True)
class Region:
    """A forward ``sbr.rel`` at ``branch`` over bundles ``branch+1 .. target-1``."""
    branch: int
    target: int
    region: int

    @property
    def cycles(self) -> int:
        return self.target - self.branch - 1

    def contains(self, other: "Region") -> bool:
        return self.branch < other.branch and other.target <= self.target


@dataclasses.dataclass
class TileSchedule:
    """What one kernel's schedule says, per tile and per grid step (cycles = bundles)."""
    kernel: str
    path: str
    total_cycles: int          # every bundle of the kernel
    loop_cycles: int           # one trip of the grid loop, every region executed
    tile_cycles: int           # the compute region of one grid step
    init_cycles: int           # regions beside the tile before it (once per row)
    finalize_cycles: int       # regions beside the tile after it (once per row)
    step_cycles: int           # loop body outside tile/init/finalize: paid by every step
    outside_loop_cycles: int   # prologue + epilogue, once per kernel
    num_mxu: int               # MXUs of this chip (the table's MXU capacity)
    mxu_busy_cycles: int       # sum over MXUs of busy cycles in the tile (model == table)
    unit_busy: dict            # the compiler's table summed over the tile: column -> slot-cycles
    unit_capacity: dict        # column -> slots per bundle
    op_mix: dict               # our count of tile instructions by unit (UNITS)
    matmuls: dict              # vmatmul count in the tile by dtype
    # The forward's partial path (row chunks, a tile where some chunk sees nothing): its
    # cycles outside its chunks, and the mean cycles of one chunk there; 0 without one.
    partial_overhead_cycles: int = 0
    chunk_cycles: float = 0.0
    # (cycles, vector stores) of each region in init_cycles: a kernel whose init holds a
    # region that runs less often than per row (the fused backward's dQ zeroing, once per
    # (batch, kv head)) is priced with kernel_cycles(..., once=, once_cycles=)
    init_regions: list = dataclasses.field(default_factory=list)
    # The fused backward's diagonal cases (a tile the causal diagonal crosses, run as its kv
    # strips, :mod:`flashlab.kernels.diagonal`): the cycles of each case's straight-line
    # region, in program order (the order of :func:`diagonal.cases`); empty without them.
    case_cycles: list = dataclasses.field(default_factory=list)
    # No branch of the tile's own (a dense grid whose every step computes: flashlab's kernels
    # where every block is visible, jax's non-causal one): the tile is the pipeline's stage
    # region less init and finalize, the step's work inside that region included
    unpredicated: bool = False
    tile_util: list = dataclasses.field(default_factory=list, repr=False)  # table rows of the tile
    tile_index: list = dataclasses.field(default_factory=list, repr=False)  # its bundles' indices

    @property
    def mxu_cycles(self) -> float:
        """Tile cycles if every MXU were busy all the time: the tile's MXU floor."""
        return self.mxu_busy_cycles / self.num_mxu

    @property
    def occupancy(self) -> float:
        """Static MXU occupancy of the tile: busy MXU-cycles / (MXUs x tile cycles)."""
        return self.mxu_busy_cycles / (self.num_mxu * self.tile_cycles)

    def as_dict(self) -> dict:
        skip = ("tile_util", "tile_index")                  # per-bundle: not a figure
        d = {k: v for k, v in dataclasses.asdict(self).items() if k not in skip}
        d.update(mxu_cycles=self.mxu_cycles, occupancy=self.occupancy)
        return d


def _read(path: Path) -> str:
    """A dump file's text (``.gz`` too: the test fixtures are gzipped)."""
    if path.suffix == ".gz":
        import gzip
        return gzip.decompress(path.read_bytes()).decode()
    return path.read_text()


def _strip_comments(s: str) -> str:
    return re.sub(r"/\*.*?\*/", "", s, flags=re.S)


def parse_bundles(text: str, path: str = "<text>") -> list[Bundle]:
    """Bundles of a ``packed-bundles-post-ra`` dump, in order (continuation lines joined)."""
    chunks: list[list[str]] = []
    for line in text.splitlines():
        if _BUNDLE.match(line):
            chunks.append([line])
        elif chunks:
            chunks[-1].append(line)
    if not chunks:
        raise ScheduleFormatError(f"{path}: no bundle lines ('0x..  :  {{ ... }}'); the dump "
                                  f"format moved or this is not a packed-bundles file")
    out = []
    for i, lines in enumerate(chunks):
        raw = "\n".join(lines)
        m = _BUNDLE.match(lines[0])
        if int(m.group(1), 0) != i:
            raise ScheduleFormatError(f"{path}: bundle {i} is numbered {m.group(1)}: bundles "
                                      f"are no longer consecutive, cannot count cycles")
        body = _strip_comments(raw)
        if "}" not in body:
            raise ScheduleFormatError(f"{path}: bundle {i} has no closing '}}'")
        body = body[body.index("{") + 1: body.rindex("}")]
        ops = [o.strip() for o in body.split(";;") if o.strip()]
        out.append(Bundle(i, m.group(2) or "", ops, raw))
    return out


def parse_utilization(text: str, path: str = "<text>") -> tuple[dict, list[list[int]]]:
    """``({column: capacity}, rows)`` of a ``static-per-bundle-utilization`` table."""
    lines = text.splitlines()
    try:
        i = next(k for k, ln in enumerate(lines) if ln.startswith("== CAPAC"))
        cols = [c.strip() for c in lines[i + 1].split(",")]
        caps = [int(x) for x in lines[i + 2].split()]
        j = next(k for k, ln in enumerate(lines) if ln.startswith("== UTILIZATION"))
        rows = [[int(x) for x in ln.split()] for ln in lines[j + 1:] if ln.strip()]
    except (StopIteration, IndexError, ValueError) as e:
        raise ScheduleFormatError(f"{path}: expected '== CAPACITY' (column names, capacities) "
                                  f"and '== UTILIZATION' (one row per bundle): {e!r}") from e
    if len(cols) != len(caps) or any(len(r) != len(cols) for r in rows):
        raise ScheduleFormatError(f"{path}: {len(cols)} columns {cols} but capacities "
                                  f"{caps} / rows of other widths")
    for need in ("MXU", "VPOP"):
        if need not in cols:
            raise ScheduleFormatError(f"{path}: no {need!r} column in {cols}")
    return dict(zip(cols, caps)), rows


def _streamed(b: Bundle, path: str) -> list[int]:
    """The MXU rows each vmatmul of bundle ``b`` streams: 8 sublanes times the LHS dtype's
    packing, half that for ``mubr`` and ``lmr``."""
    rows = []
    for op in b.opcodes:
        if (m := _MATMUL.match(op)) is None:
            continue
        if m.group(2) not in MXU_ROWS:
            raise ScheduleFormatError(f"{path}: bundle {b.index}: {op}: unknown matmul "
                                      f"dtype {m.group(2)!r} (known: {list(MXU_ROWS)})")
        rows.append(MXU_ROWS[m.group(2)] // (2 if m.group(1) else 1))
    return rows


def matmul_rows(bundles: list[Bundle], path: str = "<text>") -> dict[int, int]:
    """Bundle index -> the MXU rows its vmatmuls stream, for each bundle that issues one."""
    return {b.index: sum(r) for b in bundles if (r := _streamed(b, path))}


def mxu_busy(bundles: list[Bundle], path: str = "<text>") -> list[int]:
    """Per bundle, how many MXUs are busy under our model (see the module docstring)."""
    busy = [0] * (len(bundles) + 64)
    for b in bundles:
        for rows in _streamed(b, path):
            for c in range(b.index + 1, b.index + 1 + rows):
                busy[c] += 1
    return busy


def unit_of(opcode: str) -> str:
    """The unit an instruction issues to (one of :data:`UNITS`)."""
    opcode = re.sub(r"\[\d+\]", "", opcode)
    head = opcode.split(".")[0]
    if re.search(r"\.mxu\d+$", opcode):
        return "MXU"
    if re.search(r"\.xlu\d+$", opcode) or head in ("vxpose", "vrot", "vperm"):
        return "XLU"
    if head in _EUP or opcode.startswith("vpop.eup"):
        return "EUP"
    if head.startswith("vld"):
        return "load"
    if head.startswith("vst"):
        return "store"
    if head == "dma":
        return "DMA"
    if head.startswith(("vsync", "sfence", "vwait")) or head == "vdelay":
        return "sync"
    if head.startswith("v"):
        return "VPU"
    return "scalar"


def _crosscheck(bundles, caps, rows, path, util_path):
    if len(rows) != len(bundles):
        raise ScheduleFormatError(f"{util_path}: {len(rows)} utilization rows but {path} has "
                                  f"{len(bundles)} bundles: the two dumps no longer align")
    cols = list(caps)
    mine = mxu_busy(bundles, path)
    # the VPOP column counts vector pops; vpop.sfrf (a vector-to-scalar move) is not one
    pops = [sum(op.startswith("vpop") and not op.startswith("vpop.sfrf") for op in b.opcodes)
            for b in bundles]
    for name, model in (("MXU", mine), ("VPOP", pops)):
        k = cols.index(name)
        for b in bundles:
            if model[b.index] != rows[b.index][k]:
                raise ScheduleFormatError(
                    f"{path}: bundle {b.index} ({b.index:#x}): our {name} model says "
                    f"{model[b.index]} busy, the compiler's table ({util_path}) says "
                    f"{rows[b.index][k]}. The MXU model (vmatmul busy for {MXU_ROWS} rows, "
                    f"from the next bundle) or the dump format moved: re-derive it.")
    return mine


def _branches(bundles):
    fwd, back = [], []
    for b in bundles:
        for m in _BRANCH.finditer(_strip_comments(b.text)):
            t = int(m.group(2))
            (fwd if t > b.index else back).append(Region(b.index, t, int(m.group(3))))
    return fwd, back


def analyze(packed_path, util_path=None, kernel: str | None = None) -> TileSchedule:
    """Read one kernel's ``packed-bundles-post-ra`` dump (and its utilization table).

    ``util_path`` defaults to the companion file of the same dump (``...-01-packed-bundles-
    post-ra.txt`` -> ``...-02-pre-delay_hlo-static-per-bundle-utilization.txt``). Raises
    :class:`ScheduleFormatError` when the structure is not one grid loop with one tile region,
    or when our MXU model disagrees with the compiler's table.
    """
    packed_path = Path(packed_path)
    if util_path is None:
        util_path = Path(str(packed_path).replace(
            "01-packed-bundles-post-ra", "02-pre-delay_hlo-static-per-bundle-utilization"))
    util_path = Path(util_path)
    for p in (packed_path, util_path):
        if not p.exists():
            raise FileNotFoundError(f"{p}: no such dump file (dump with DUMP_FLAGS; the table "
                                    f"is written next to the packed-bundles file)")
    bundles = parse_bundles(_read(packed_path), str(packed_path))
    caps, rows = parse_utilization(_read(util_path), str(util_path))
    busy = _crosscheck(bundles, caps, rows, str(packed_path), str(util_path))
    fwd, back = _branches(bundles)
    loops = [r for r in back if r.target <= r.branch]
    if len(loops) != 1:
        raise ScheduleFormatError(f"{packed_path}: expected one grid loop (one backward "
                                  f"sbr.rel), found {len(loops)}: {loops}")
    start, end = loops[0].target, loops[0].branch          # body: bundles start..end
    if bundles[start].label != "LB":
        raise ScheduleFormatError(f"{packed_path}: the loop's first bundle {start} is not "
                                  f"labelled 'LB:'; the loop markers moved")
    inner = [r for r in fwd if start <= r.branch and r.target <= end]
    streamed = matmul_rows(bundles, str(packed_path))
    mm = sorted(streamed)                                  # the bundles issuing vmatmuls
    if not mm or mm[0] < start or mm[-1] > end:
        raise ScheduleFormatError(f"{packed_path}: vmatmuls at bundles {mm[:1]}..{mm[-1:]} "
                                  f"are not all inside the grid loop {start}..{end}")
    holding = [r for r in inner if r.branch < mm[0] and mm[-1] < r.target]
    if not holding:
        raise ScheduleFormatError(f"{packed_path}: no predicated region holds every vmatmul "
                                  f"of the loop; cannot tell the tile apart")
    tile = anchor = min(holding, key=lambda r: r.cycles)   # init/finalize: beside the anchor

    def free_of(r, units=("DMA", "MXU")):                  # region r issues none of units
        return not any(unit_of(o) in units
                       for b in bundles[r.branch + 1: r.target] for o in b.opcodes)

    partial, cases, own = tpu_paths.partial_path(tile, inner, mm), [], []
    if partial is not None:           # two tile paths: the full one is the tile (and anchor)
        tile, partial, chunks = partial
        anchor = tile
    elif (found := tpu_paths.case_paths(tile, inner, mm, streamed)) is not None:
        tile, cases = found           # the whole tile, and the diagonal's cases, in the anchor
    else:   # no branch of the tile's own (unpredicated): init, finalize inside the pipeline's
        # stage region, before the first vmatmul and after the last (finalize: maybe a vpop)
        inside = [r for r in inner if anchor.contains(r)]
        own = [r for r in inside if not any(p.contains(r) for p in inside)
               and free_of(r, ("DMA",)) and (r.target <= mm[0] or r.branch >= mm[-1])]
    parents = [r for r in inner if r.contains(anchor)]
    parent = min(parents, key=lambda r: r.cycles) if parents else None

    def is_sibling(r):
        if r == anchor or r.contains(anchor) or anchor.contains(r):
            return False
        ps = [p for p in inner if p.contains(r)]
        return (min(ps, key=lambda p: p.cycles) if ps else None) == parent

    before, after = (mm[0], mm[-1]) if own else (anchor.branch, anchor.target)
    sib = own or [r for r in inner if is_sibling(r) and free_of(r)]
    nested = [r for r in back if tile.branch < r.target and r.branch < tile.target]
    if nested:
        raise ScheduleFormatError(f"{packed_path}: the tile region {tile} holds an inner loop "
                                  f"{nested}: its trip count is not in the dump, so static "
                                  f"bundles would undercount the tile")
    init = sum(r.cycles for r in sib if r.target <= before)
    fin = sum(r.cycles for r in sib if r.branch >= after)
    loop_cycles = end - start + 1
    partial_cycles = partial.cycles if partial is not None else 0
    chunk_cycles = sum(r.cycles for r in chunks) / len(chunks) if partial is not None else 0.0
    cols = list(caps)
    in_tile = [i for i in range(tile.branch + 1, tile.target)      # less init, finalize
               if not any(r.branch < i < r.target for r in own)]
    ops = [o for i in in_tile for o in bundles[i].opcodes]
    mix = collections.Counter(unit_of(o) for o in ops)
    dtypes = collections.Counter(m.group(2) for o in ops if (m := _MATMUL.match(o)))
    return TileSchedule(
        kernel=kernel or packed_path.name, path=str(packed_path), total_cycles=len(bundles),
        loop_cycles=loop_cycles, tile_cycles=len(in_tile), init_cycles=init,
        finalize_cycles=fin, unpredicated=bool(own),
        step_cycles=(loop_cycles - len(in_tile) - partial_cycles - init - fin
                     - sum(r.cycles for r in cases)),
        case_cycles=[r.cycles for r in cases],
        partial_overhead_cycles=(partial_cycles - sum(r.cycles for r in chunks)
                                 if partial is not None else 0),
        chunk_cycles=chunk_cycles,
        init_regions=[(r.cycles, sum(unit_of(o) == "store" for b in bundles[r.branch + 1:r.target]
                                     for o in b.opcodes))
                      for r in sib if r.target <= before],
        outside_loop_cycles=len(bundles) - loop_cycles, num_mxu=caps["MXU"],
        mxu_busy_cycles=sum(busy[i] for i in in_tile),
        unit_busy={c: sum(rows[i][k] for i in in_tile) for k, c in enumerate(cols)},
        unit_capacity=dict(caps), op_mix={u: mix.get(u, 0) for u in UNITS},
        matmuls=dict(dtypes), tile_util=[rows[i] for i in in_tile], tile_index=in_tile)


def kernel_cycles(s: TileSchedule, *, steps: int, tiles: int, rows: int, partial: int = 0,
                  partial_chunks: int = 0, once: int = 0, once_cycles: int = 0,
                  cases: tuple = ()) -> int:
    """Whole-kernel static cycles: ``steps x per-step + tiles x tile + rows x (init +
    finalize) + prologue/epilogue``. ``steps``: grid steps; ``tiles``: steps whose tile runs
    (visible blocks); ``rows``: runs of init/finalize (the grid without its innermost axis).
    ``partial`` of the tiles take the forward's partial path instead, running
    ``partial_chunks`` row chunks in all (:meth:`ForwardConfig.chunk_visits`). ``once``: runs
    of an init region of ``once_cycles`` (one of :attr:`TileSchedule.init_regions`) that runs
    that many times instead of ``rows``. ``cases``: per region of
    :attr:`TileSchedule.case_cycles`, the tiles that take it instead of the whole tile."""
    cycles = (s.outside_loop_cycles + steps * s.step_cycles + tiles * s.tile_cycles
              + rows * (s.init_cycles + s.finalize_cycles) - (rows - once) * once_cycles)
    if partial:
        cycles += (partial * (s.partial_overhead_cycles - s.tile_cycles)
                   + round(partial_chunks * s.chunk_cycles))
    if len(cases) != len(s.case_cycles):
        raise ValueError(f"cases: expected a count for each of the schedule's "
                         f"{len(s.case_cycles)} diagonal case regions, got {len(cases)}")
    return cycles + sum(n * (c - s.tile_cycles) for n, c in zip(cases, s.case_cycles))
