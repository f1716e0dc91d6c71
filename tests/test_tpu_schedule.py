"""The TPU compiler's schedule, read tile by tile (flashlab.instruments.tpu_schedule, tpu_dump, the
bench).

The fixture is a real dump (gzipped, ~100 KB): flashlab's forward kernel, B=2, T=8192, H=16,
d=128, bf16, causal, 512x512 blocks, compiled for v5e by libtpu 0.0.50 (jax 0.12.0.1) with
tpu_schedule.DUMP_FLAGS. The live tests compile with this machine's libtpu and skip, saying
so, when it is not installed.
"""
import gzip
from pathlib import Path

import pytest

from flashlab.instruments import tpu_dump, tpu_schedule as ts

DATA = Path(__file__).parent / "data" / "tpu_schedule"
PACKED = DATA / "v5e_flashlab_forward_512x512-packed-bundles-post-ra.txt.gz"
UTIL = DATA / "v5e_flashlab_forward_512x512-static-per-bundle-utilization.txt.gz"


def _libtpu():
    try:
        from flashlab.instruments import tpu_compile
    except ImportError:
        return False
    return tpu_compile.available()


needs_libtpu = pytest.mark.skipif(not _libtpu(), reason='libtpu (the TPU compiler) is not '
                                  'installed: pip install "jax[tpu]" to run the live compile')


@pytest.fixture(scope="module")
def fixture():
    return ts.analyze(PACKED, UTIL, kernel="flashlab_flash_forward")


def test_fixture_tile_step_and_mxu(fixture):
    s = fixture
    # One tile of Q K^T and P V at 512x512x128 bf16: 256 vmatmuls x 16 rows on 4 MXUs.
    assert s.matmuls == {"bf16": 256} and s.num_mxu == 4
    assert s.mxu_busy_cycles == 256 * 16 and s.mxu_cycles == 1024
    # Cycle counts of this dump (regions of the packed bundles, read by hand once).
    assert (s.tile_cycles, s.init_cycles, s.finalize_cycles) == (1416, 197, 401)
    assert s.loop_cycles == s.tile_cycles + s.init_cycles + s.finalize_cycles + s.step_cycles
    assert s.total_cycles == s.loop_cycles + s.outside_loop_cycles == 2363
    assert s.occupancy == pytest.approx(1024 / 1416)
    # Op mix: 256 vmatmul + 64 weight pushes + 512 result pops on the MXUs; the table agrees.
    assert s.op_mix["MXU"] == 832 and s.unit_busy["MXU"] == 4096
    assert s.op_mix["DMA"] == 0 and s.op_mix["EUP"] > 0 and s.op_mix["XLU"] > 0
    assert len(s.tile_util) == s.tile_cycles and "tile_util" not in s.as_dict()


def test_kernel_cycles_whole_kernel_estimate(fixture):
    s = fixture
    steps, tiles, rows = 2 * 16 * 16 * 16, 2 * 16 * 136, 2 * 16 * 16
    got = ts.kernel_cycles(s, steps=steps, tiles=tiles, rows=rows)
    assert got == (s.outside_loop_cycles + steps * s.step_cycles + tiles * s.tile_cycles
                   + rows * (s.init_cycles + s.finalize_cycles))


def _write(tmp_path, packed_text, util_text):
    p = tmp_path / "k-01-packed-bundles-post-ra.txt"
    u = tmp_path / "k-02-pre-delay_hlo-static-per-bundle-utilization.txt"
    p.write_text(packed_text)
    u.write_text(util_text)
    return p, u


def _texts():
    return tuple(gzip.decompress(p.read_bytes()).decode() for p in (PACKED, UTIL))


def test_mxu_table_disagreement_fails_loudly(tmp_path):
    packed, util = _texts()
    lines = util.splitlines()
    k = next(i for i, ln in enumerate(lines) if ln.startswith("== UTIL")) + 700
    row = lines[k].split()
    row[0] = str(int(row[0]) + 1)                         # the compiler "says" one more MXU
    lines[k] = " ".join(row)
    p, u = _write(tmp_path, packed, "\n".join(lines))
    with pytest.raises(ts.ScheduleFormatError, match=r"bundle 699 .*MXU model.*table"):
        ts.analyze(p, u)


def test_a_tile_with_no_branch_of_its_own_is_its_stage_region_less_init_and_finalize(
        tmp_path, fixture):
    """A dense grid whose every step computes runs its tile with no ``pl.when`` around it
    (the forward and the dK/dV kernel where every block is visible): the smallest region
    holding every vmatmul is then the pipeline's stage region, with init and finalize
    inside it. The fixture with its tile's branch taken out reads so: the same init and
    finalize, the tile grown by the stage region's own per-step work."""
    packed, util = _texts()
    branch = "sbr.rel (%p767_p0) target bundleno = 1891 (0x763), region = 52"   # the tile's
    assert packed.count(branch) == 1
    p, u = _write(tmp_path, packed.replace(branch, "snop"), util)
    s = ts.analyze(p, u)
    assert s.unpredicated and not fixture.unpredicated
    assert (s.init_cycles, s.finalize_cycles) == (fixture.init_cycles, fixture.finalize_cycles)
    assert s.tile_cycles == 2106 - 197 - 401          # the stage region, less init, finalize
    assert s.loop_cycles == s.tile_cycles + s.init_cycles + s.finalize_cycles + s.step_cycles
    assert s.tile_cycles + s.step_cycles == fixture.tile_cycles + fixture.step_cycles
    assert s.mxu_busy_cycles == fixture.mxu_busy_cycles and len(s.tile_util) == s.tile_cycles


@needs_libtpu
@pytest.mark.parametrize("causal", [False, True])
def test_live_compile_reads_an_unbranched_tile_where_every_block_is_visible(causal):
    """Non-causal, no lengths: the forward and the fused backward compute at every step, with
    no branch around the tile; causal keeps one (it skips or masks blocks). Either reads to
    the same identity, loop = tile + step + init + finalize (+ the causal diagonal's cases)."""
    from flashlab.benchmarks import tpu_static as bts
    d = tpu_dump.schedules("flashlab.benchmarks.tpu_static_builders:build", "v5e",
                           library="flashlab", backward=True, dtype="bfloat16", causal=causal,
                           block=512, batch=1, seq_len=1024, heads=2, head_dim=128)
    assert d.info["blocks"]["fused"] and set(d.kernels) == {"forward", "dkdv"}   # fused
    for role in ("forward", "dkdv"):
        s = d.kernels[role].schedule
        assert s.unpredicated is not causal, role
        assert s.loop_cycles == (s.tile_cycles + s.step_cycles + s.init_cycles
                                 + s.finalize_cycles + sum(s.case_cycles)), role
        assert s.finalize_cycles > 0 and s.step_cycles > 0 and s.mxu_cycles < s.tile_cycles
    # the fused backward's only init is its dQ zeroing: dK, dV are written at a kv row's
    # first step (non-causal) or first crossed tile (causal, diagonal.writes_first); where
    # every block is visible the first kv row writes dQ too, and there is no init at all
    fused = d.kernels["dkdv"].schedule
    assert bts.resident_zeroing(fused, seq_len=1024, block_q=512, head_dim=128) == (
        fused.init_cycles)
    assert (fused.init_cycles > 0) is causal


@pytest.mark.parametrize("edit, match", [
    (lambda p, u: (p, u.replace("== UTILIZATION", "== USAGE")), "UTILIZATION"),
    (lambda p, u: (p, "\n".join(u.splitlines()[:-5])), "no longer align"),
    (lambda p, u: (p.replace("vmatmul.bf16", "vmatmul.bf17"), u), "unknown matmul dtype"),
    (lambda p, u: (p.replace(" LB:", "   :"), u), "LB"),
    (lambda p, u: ("nothing here\n", u), "no bundle lines"),
    (lambda p, u: (p.replace("sbr.rel", "sbr.abs"), u), "one grid loop"),
])
def test_format_moved_fails_loudly(tmp_path, edit, match):
    p, u = _write(tmp_path, *edit(*_texts()))
    with pytest.raises(ts.ScheduleFormatError, match=match):
        ts.analyze(p, u)


def test_missing_file_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope-01-packed"):
        ts.analyze(tmp_path / "nope-01-packed-bundles-post-ra.txt")


@pytest.mark.parametrize("opcode, unit", [
    ("vmatmul.bf16.gmra.mxu0", "MXU"), ("vpop.f32.mrb[3].mxu1", "MXU"),
    ("vmax.xlane.f32.xlu2", "XLU"), ("vexp2.f32", "EUP"), ("vpop.eup", "EUP"),
    ("vld", "load"), ("vst", "store"), ("dma.hbm_to_vmem", "DMA"), ("vadd.f32", "VPU"),
    ("sadd.s32", "scalar"), ("vsyncadd", "sync")])
def test_unit_of(opcode, unit):
    assert ts.unit_of(opcode) == unit


@pytest.mark.parametrize("name, role", [
    ("flashlab_flash_forward.1", "forward"), ("flashlab_flash_backward_dkdv.1", "dkdv"),
    ("flashlab_flash_backward_dq.1", "dq"), ("splash_mha_dkv_no_residuals.1", "dkdv"),
    ("jvp_jit_flash_attention__.1", "forward"), ("_flash_attention_dq_kernel", "dq")])
def test_role_of(name, role):
    assert tpu_dump.role_of(name) == role


@pytest.mark.parametrize("args, match", [
    (["--block", "100"], "--block: expected a multiple of 128"),
    (["--block", "0"], "--block: expected a positive integer"),
    (["--chip", "v9"], "invalid choice: 'v9'"),
    (["--seq-len", "1000", "--blocks", "default"], "--seq-len: expected a multiple of 128"),
    (["--sweep", "512x1000"], "--sweep: block_k must be a multiple of 128"),
    (["--sweep", "512"], "--sweep: expected BQxBK"),
    (["--blocks"], "--blocks: none given and no --sweep pairs"),
    (["--window", "0"], "--window: expected a positive integer"),
    (["--window", "1024", "--update", "x.json"], "--window 1024: not with --update"),
    (["--window", "1024", "--blocks-table", "x.json"], "--window 1024: not with --update"),
    (["--soft-cap", "0"], "--soft-cap: expected a positive finite number, got 0.0"),
    (["--soft-cap", "nan"], "--soft-cap: expected a positive finite number, got nan"),
    (["--soft-cap", "30", "--update", "x.json"], "--soft-cap 30.0: not with --update"),
])
def test_bench_cli_validation(args, match, capsys):
    from flashlab.benchmarks import backends as bench
    with pytest.raises(SystemExit) as e:
        bench.main(["tpu-static", *args])
    assert e.value.code == 2 and match in capsys.readouterr().err


@needs_libtpu
def test_live_compile_bench_rows():
    """One real compile (flashlab forward, v5e): the dump parses, the cross-check passes."""
    from flashlab.benchmarks import tpu_static as bts
    from flashlab.benchmarks import tpu_static_report
    rows, versions = bts.measure(chips=["v5e"], libraries=["flashlab"], modes=["equal"],
                                 kernels=["forward"], block=512, batch=1, seq_len=4096,
                                 heads=4, progress=False)
    assert versions["libtpu"] and len(rows) == 1, rows
    r = rows[0]
    # causal: the forward's grid runs over the 36 visible blocks of 8 x 8 (kernels/visit.py)
    assert (r["block_q"], r["block_k"], r["grid"]) == (512, 512, [1, 4, 36])
    assert r["tiles"] == 4 * 36 and r["rows"] == 4 * 8 and r["steps"] == 4 * 36
    assert r["mxu_cycles"] == 1024 and r["tile_cycles"] > r["mxu_cycles"]
    assert 0 < r["occupancy"] < 1 and r["ratio_floor"] > 1 and r["step_cycles"] > 0
    assert "not wall time" in tpu_static_report.header(versions, dict(batch=1, seq_len=4096, heads=4,
                                                        head_dim=128, dtype="bfloat16",
                                                        causal=True, block=512)).lower()


@needs_libtpu
def test_live_compile_v6e_prices_a_256_deep_pass_like_a_128_deep_one():
    """v6e's compiler gives the fused backward tile at d=256 (twice the FLOPs) barely more MXU
    cycles than at d=128 (causal 512²: 1280 against 1152, dO and dQ on lanes,
    ``backward_config.grads_on_lanes``), so with the clock derived from JAX's peak the d=256
    estimate reads below the peak-FLOP floor; the table marks the row and says why
    (BELOW_FLOOR) instead of printing an impossible figure unremarked."""
    from flashlab.benchmarks import tpu_static as bts
    from flashlab.benchmarks import tpu_static_report
    rows = {d: bts.measure(chips=["v6e"], libraries=["flashlab"], modes=["equal"],
                           kernels=["fused"], block=512, batch=1, seq_len=2048, heads=2,
                           head_dim=d, causal=True, progress=False)[0][0] for d in (128, 256)}
    assert rows[128]["mxu_cycles"] < rows[256]["mxu_cycles"] <= 1.125 * rows[128]["mxu_cycles"]
    assert rows[128]["ratio_floor"] > 1 > rows[256]["ratio_floor"]
    text = tpu_static_report.table([rows[128], rows[256]])
    assert text.count("!") == 2 and tpu_static_report.BELOW_FLOOR[:40] in text.replace("\n", " ")
    assert "!" not in tpu_static_report.table([rows[128]])


@pytest.mark.parametrize("causal", [True, False])
def test_window_flops_count_every_visible_score(causal):
    """``--window LEFT``: ``(LEFT, 0)`` causal, ``(LEFT, LEFT)`` not; its FLOPs count the
    visible scores of the oracle's own mask exactly (4·d per score: two matmuls)."""
    import numpy as np
    from flashlab.benchmarks import tpu_static_builders as tb
    from flashlab.contract import masks
    T, d, window = 640, 128, tb.window_of(100, causal)
    assert window == ((100, 0) if causal else (100, 100)) and tb.window_of(None, causal) is None
    i = np.arange(T)
    seen = np.asarray(masks.structural_visible(i[:, None], i[None, :], is_causal=causal,
                                               window=window)).sum()
    assert tb.forward_flops(2, 3, T, d, causal, window) == 4.0 * 2 * 3 * d * seen
    assert tb.forward_flops(2, 3, T, d, causal) == 4.0 * 2 * 3 * T * T * d / (2 if causal else 1)


@needs_libtpu
def test_live_compile_bench_with_a_window():
    """``--window``: flashlab and splash (its ``LocalMask``) compile with the same window, the
    tiles and FLOPs count the band only, and jax's kernel, which has no window, is a row that
    says so, not a crash of the run."""
    from flashlab.benchmarks import tpu_static as bts
    from flashlab.benchmarks import tpu_static_report as rep
    rows, _ = bts.measure(chips=["v5e"], libraries=["flashlab", "splash", "jax_pallas_flash"],
                          modes=["equal"], kernels=["forward"], block=512, batch=1,
                          seq_len=4096, heads=2, window=(1024, 0), progress=False)
    by = {r["library"]: r for r in rows}
    assert "no sliding window" in by["jax_pallas_flash"]["error"]
    for lib in ("flashlab", "splash"):
        r = by[lib]
        # 8 q blocks of 512 against a 1024-key band: 1 + 2 + 6 x 3 = 21 tiles of the 36 causal
        assert r["window"] == [1024, 0] and r["tiles"] == 2 * 21, r
        assert r["flops"] == bts.forward_flops(1, 2, 4096, 128, True, (1024, 0))
    assert by["flashlab"]["ratio_splash"] > 0 and "window=(1024, 0)" in rep.shape_of(by["splash"])


@needs_libtpu
def test_live_compile_bench_with_a_soft_cap():
    """``--soft-cap``: both libraries' gradients compile with the cap, the rows and the whole
    backward say so in their shape, and jax's kernel, which has none, is a row that says so."""
    from flashlab.benchmarks import tpu_static as bts
    from flashlab.benchmarks import tpu_static_report as rep
    rows, _ = bts.measure(chips=["v6e"], libraries=["flashlab", "splash", "jax_pallas_flash"],
                          modes=["equal"], kernels=["forward", "dq", "dkdv", "fused"],
                          block=512, batch=1, seq_len=2048, heads=1, soft_cap=30.0,
                          progress=False)
    assert all(r["soft_cap"] == 30.0 for r in rows)
    assert {r["library"] for r in rows if "error" in r} == {"jax_pallas_flash"}
    whole = rep.backward_rows(rows)
    assert {r["library"] for r in whole} == {"flashlab", "splash"}
    assert all("soft cap 30" in rep.shape_of(r) for r in whole)


@needs_libtpu
def test_live_compile_reads_the_partial_path(monkeypatch):
    """The forward in row chunks at B_r > B_c (v6e, 2048 x 1024, causal, T=4096: 2 chunks of
    1024 rows), crossed tiles whole (``FLASHLAB_FORWARD_STRIPS=0``, which the compiling child
    inherits), has two tile paths. The reader takes the straight-line one as the tile and the
    other as the partial path: a little control around chunks of their own; the estimate runs
    the 2 partial tiles per head (a q block's second diagonal tile) as one chunk each."""
    from flashlab.benchmarks import tpu_static as bts
    monkeypatch.setenv("FLASHLAB_FORWARD_STRIPS", "0")
    rows, _ = bts.measure(chips=["v6e"], libraries=["flashlab"], modes=[],
                          sweep=[(2048, 1024)], kernels=["forward"], batch=1, seq_len=4096,
                          heads=2, progress=False)
    (r,) = rows
    assert (r["partial_tiles"], r["partial_chunks"], r["tiles"]) == (2 * 2, 2 * 2, 2 * 6)
    assert 0 <= r["partial_overhead_cycles"] < 50
    assert r["tile_cycles"] / 2 < r["chunk_cycles"] < r["tile_cycles"]
    full = r["est_cycles"] + r["partial_tiles"] * (
        r["tile_cycles"] - r["partial_overhead_cycles"] - r["chunk_cycles"])
    assert r["est_cycles"] < full        # cheaper than running every chunk of those tiles


@needs_libtpu
def test_live_compile_reads_the_forward_strips():
    """The forward at 2048 x 1024 (v6e, causal, T=4096) runs a crossed tile as the query
    strips of its offset d = 0 or d = 1024 (kernels/diagonal.py): two straight-line case
    regions beside the whole tile (2 chunks), each cheaper than it, 2 tiles per head each."""
    from flashlab.benchmarks import tpu_static as bts
    rows, _ = bts.measure(chips=["v6e"], libraries=["flashlab"], modes=[],
                          sweep=[(2048, 1024)], kernels=["forward"], batch=1, seq_len=4096,
                          heads=2, progress=False)
    (r,) = rows
    assert r["case_tiles"] == [2 * 2, 2 * 2] and r["partial_chunks"] == 0
    d_zero, d_diag = r["case_cycles"]      # d = 1024: half the rows see nothing
    assert 0 < d_diag < d_zero < r["tile_cycles"]


@needs_libtpu
def test_live_compile_one_block_is_its_own_case():
    """T = B_r = B_c (2048, causal): the one visible tile is crossed and the compiler, knowing
    it, keeps only that case: the reader's tile is the case, priced once per head."""
    from flashlab.benchmarks import tpu_static as bts
    rows, _ = bts.measure(chips=["v6e"], libraries=["flashlab"], modes=[],
                          sweep=[(2048, 2048)], kernels=["forward"], batch=1, seq_len=2048,
                          heads=2, progress=False)
    (r,) = rows
    assert "error" not in r and r["tiles"] == 2 and r["case_tiles"] == []
    assert 0 < r["tile_cycles"] < r["mxu_cycles"] * 2


@needs_libtpu
def test_live_compile_reads_the_diagonal_cases():
    """The fused backward at 1024 x 2048 (v6e, causal, T=4096) runs a crossed tile as the kv
    strips of its offset d = -1024 or d = 0 (kernels/diagonal.py), each case a straight-line
    region beside the whole tile: the reader finds both, in program order, cheaper than the
    tile, and the estimate prices the 2 tiles per head that take each by its own region."""
    from flashlab.benchmarks import tpu_static as bts
    rows, _ = bts.measure(chips=["v6e"], libraries=["flashlab"], modes=[],
                          sweep=[(1024, 2048)], kernels=["fused"], batch=1, seq_len=4096,
                          heads=2, progress=False)
    (r,) = rows
    assert r["case_tiles"] == [2 * 2, 2 * 2] and len(r["case_cycles"]) == 2
    d_minus, d_zero = r["case_cycles"]     # d = 0: half its kv rows see nothing, 5/16 computed
    assert r["tile_cycles"] / 2 < d_minus < r["tile_cycles"] and 0 < d_zero < d_minus
    assert 0 < r["step_cycles"] < 1000 and r["init_cycles"] > 0


def test_case_paths_finds_the_whole_tile_beside_its_cases():
    """Synthetic regions: an anchor holding the whole tile (most vmatmuls) and two cases; a
    case with a nested matmul region (the forward's chunks) is not a straight-line case."""
    from flashlab.instruments import tpu_paths
    R = ts.Region
    anchor, case0, case1, full = R(0, 100, 0), R(1, 20, 1), R(21, 40, 2), R(41, 99, 3)
    mm = [5, 25, 50, 60, 70]
    assert tpu_paths.case_paths(anchor, [anchor, case0, case1, full], mm) == (full, [case0,
                                                                                      case1])
    assert tpu_paths.case_paths(anchor, [anchor, case0, R(2, 10, 4), full], [5, 50, 60]) is None
    assert tpu_paths.case_paths(anchor, [anchor, full], [50]) is None


def test_init_runs_once_per_row_of_a_visit_grid():
    """B=2 H=4 T=4096 causal, 512 x 1024 blocks: 8 q-block rows, 4 kv-block rows per head."""
    from flashlab.benchmarks.tpu_static import init_runs
    kw = dict(batch=2, heads=4, seq_len=4096, block_q=512, block_k=1024)
    assert init_runs("flashlab", "forward", (2, 4, 20), **kw) == 2 * 4 * 8
    assert init_runs("flashlab", "dq", (2, 4, 20), **kw) == 2 * 4 * 8
    assert init_runs("flashlab", "dkdv", (2, 4, 20, 1), **kw) == 2 * 4 * 4
    # dense grids: every step of the grid without its innermost axis
    assert init_runs("flashlab", "dq", (2, 4, 8, 4), **kw) == 2 * 4 * 8
    assert init_runs("flashlab", "dkdv", (2, 4, 4, 1, 8), **kw) == 2 * 4 * 4
    assert init_runs("splash", "dkdv", (4, 4, 8), **kw) == 4 * 4
    # the fused backward with its dQ in 2 query chunks: each kv row once per chunk
    assert init_runs("flashlab", "fused", (2, 4, 24, 1), dq_chunks=2, **kw) == 2 * 4 * 4 * 2


@needs_libtpu
def test_live_unknown_chip():
    with pytest.raises(ValueError, match="chip: expected one of"):
        tpu_dump.schedules("flashlab.benchmarks.tpu_static:build", "v9")


def test_bench_records_flashlab_vmem_refusal_as_a_row():
    """Blocks flashlab's own VMEM check refuses (for its default backward and its split one) (2048 x 1024 on v4: 17 MiB estimated against
    its 16 MiB limit) are a row with the check's message, as a compile the compiler rejects
    is, not a crash of the whole run (nothing is compiled: the check runs before the dump
    child)."""
    from flashlab.benchmarks import tpu_static as bts
    rows, _ = bts.measure(chips=["v4"], libraries=["flashlab", "flashlab_split"], modes=(),
                          sweep=[(2048, 1024)], kernels=("dq", "dkdv"), progress=False)
    assert [(r["library"], r["kernel"], r["block_q"], r["block_k"]) for r in rows] == \
        [(lib, k, 2048, 1024) for lib in ("flashlab", "flashlab_split")
         for k in ("dq", "dkdv")], rows
    assert all(r["error"].startswith("block_q, block_k: (2048, 1024) need about") for r in rows)


def test_update_rows_replaces_only_the_same_shape(tmp_path):
    """--update replaces a stored row by (chip, library, kernel, blocks, shape[, pair]): a run
    at another sequence length or head_dim adds rows, a re-run of the same shape replaces."""
    from flashlab.benchmarks import tpu_static_report as rep
    p = tmp_path / "run.json"
    row = dict(chip="v5e", library="flashlab", kernel="forward", blocks="equal", seq_len=8192,
               head_dim=128, causal=True, est_cycles=1)
    rep.update_rows(p, [row], versions={}, command="a", commit="c")
    rep.update_rows(p, [dict(row, seq_len=2048, est_cycles=2), dict(row, head_dim=64)],
                    versions={}, command="b", commit="c")
    doc = rep.update_rows(p, [dict(row, est_cycles=3)], versions={}, command="c", commit="c")
    got = sorted((r["seq_len"], r["head_dim"], r["est_cycles"], r["command"]) for r in doc["rows"])
    assert got == [(2048, 128, 2, "b"), (8192, 64, 1, "b"), (8192, 128, 3, "c")]


def test_a_backward_compile_replaces_its_own_earlier_rows(tmp_path):
    """A backward that was split (dQ + dK/dV rows) and is now fused (one row) leaves no stale
    split rows of that compile; other libraries, block pairs and the forward keep theirs."""
    from flashlab.benchmarks import tpu_static_report as rep
    p = tmp_path / "run.json"
    base = dict(chip="v5e", library="flashlab", blocks="sweep", block_q=1024, block_k=1024,
                seq_len=8192, head_dim=128, causal=True, est_cycles=1)
    rep.update_rows(p, [dict(base, kernel="dq"), dict(base, kernel="dkdv"),
                        dict(base, kernel="forward"), dict(base, kernel="dq", block_q=512),
                        dict(base, kernel="dq", library="flashlab_split")],
                    versions={}, command="a", commit="c")
    doc = rep.update_rows(p, [dict(base, kernel="fused", est_cycles=2)], versions={},
                          command="b", commit="c")
    got = sorted((r["library"], r["kernel"], r["block_q"]) for r in doc["rows"])
    assert got == [("flashlab", "dq", 512), ("flashlab", "forward", 1024),
                   ("flashlab", "fused", 1024), ("flashlab_split", "dq", 1024)]


def test_backward_rows_sum_a_whole_backward_and_count_variants_as_their_library():
    """dQ + dK/dV, or one fused kernel; splash_fused counts as splash, flashlab_split as
    flashlab; the training step adds each library's fastest backward to its forward."""
    from flashlab.benchmarks import tpu_static_report as rep
    base = dict(chip="v5e", blocks="equal", block_q=512, block_k=512, batch=2, heads=16,
                seq_len=8192, head_dim=128, causal=True, tile_cycles=1, step_cycles=1,
                name="k", flops=1)
    rows = [dict(base, library=lib, kernel=k, est_cycles=c, est_ms=c / 10, floor_ms=1.0)
            for lib, k, c in [("flashlab", "forward", 10), ("flashlab", "fused", 50),
                              ("flashlab_split", "dq", 30), ("flashlab_split", "dkdv", 40),
                              ("splash", "forward", 11), ("splash", "dq", 31),
                              ("splash", "dkdv", 41), ("splash_fused", "fused", 55),
                              ("jax_pallas_flash", "dq", 33)]]    # no dK/dV: not a backward
    got = sorted((r["library"], r["option"], r["est_cycles"]) for r in rep.backward_rows(rows))
    assert got == [("flashlab", "fused", 50), ("flashlab", "split", 70),
                   ("splash", "fused", 55), ("splash", "split", 72)]
    table = rep.training_step_table(rows, blocks="equal").splitlines()
    # flashlab 1.0 + 5.0 ms against splash 1.1 + 5.5 ms (its fused backward, the faster)
    assert any(l.split()[:3] == ["v5e", "flashlab", "6.00"] and l.split()[-1] == "0.91"
               for l in table), table
    assert "0.91" in rep.target_table(rows + rep.backward_rows(rows), kernel="backward")


def test_the_fused_backwards_dq_zeroing_is_priced_once_per_head():
    """The fused backward zeroes its resident dQ [T, d] once per (batch, kv head), an init
    region that stores the whole block; the rest of its init runs once per kv row."""
    import types
    from flashlab.benchmarks import tpu_static as bts
    s = types.SimpleNamespace(outside_loop_cycles=0, step_cycles=1, tile_cycles=10,
                              init_cycles=1000 + 20, finalize_cycles=5,
                              init_regions=[(1000, 1024), (20, 4)], case_cycles=[])
    # T = 8192, d = 128: 1024 vregs of float32 stored by the zeroing region
    zero = bts.resident_zeroing(s, seq_len=8192, block_q=1024, head_dim=128)
    assert zero == 1000
    assert bts.resident_zeroing(s, seq_len=16384, block_q=1024, head_dim=128) == 0
    # T = 16384 in 2 query chunks: the same 1024 vregs, once per (batch, kv head, chunk)
    assert bts.resident_zeroing(s, seq_len=16384, block_q=1024, head_dim=128,
                                dq_chunks=2) == 1000
    c = ts.kernel_cycles(s, steps=100, tiles=50, rows=64, once=2, once_cycles=zero)
    assert c == 100 + 500 + 64 * 25 + 2 * 1000


def test_fused_vs_split_table_reads_both_backwards_at_one_pair():
    from flashlab.benchmarks import tpu_static_report as rep
    base = dict(chip="v5e", blocks="sweep", block_q=1024, block_k=1024, batch=2, heads=16,
                seq_len=8192, head_dim=128, causal=True, step_cycles=1, name="k", flops=1,
                floor_ms=1.0)
    rows = [dict(base, library=lib, kernel=k, tile_cycles=t, est_cycles=c, est_ms=c / 10)
            for lib, k, t, c in [("flashlab_split", "dq", 6, 30), ("flashlab_split", "dkdv", 8, 40),
                                 ("flashlab", "fused", 10, 50), ("splash_fused", "fused", 11, 55)]]
    (line,) = rep.fused_vs_split_table(rows).splitlines()[1:]
    assert line.split() == ["v5e", "14", "10", "7.00", "5.00", "0.71", "5.50", "(fused)",
                            "512", "MiB"]      # 8 kv blocks x [2, 16, 8192, 128] bf16


def test_diagonal_table_prices_the_diagonal_tile_at_each_stage():
    """Whole tile; then the partial path's own cycles + the sub-tiles it runs on average (3 of
    4 at 1024²); then the kv strips' case regions weighted by the tiles that take each; set
    against splash's fused backward in the last stage."""
    from flashlab.benchmarks import tpu_static_report as rep
    base = dict(chip="v5e", kernel="fused", block_q=1024, block_k=1024, library="flashlab")
    whole = [dict(base, tile_cycles=10443, step_cycles=428, est_ms=8.42)]
    quarters = [dict(base, tile_cycles=10443, step_cycles=441, est_ms=8.07, partial_tiles=256,
                     partial_chunks=768, partial_overhead_cycles=14, chunk_cycles=2764.0)]
    strips = [dict(base, tile_cycles=10443, step_cycles=431, est_ms=7.74, partial_tiles=256,
                   case_tiles=[192, 64], case_cycles=[6400, 6500]),
              dict(base, library="splash_fused", tile_cycles=10528, step_cycles=407,
                   est_ms=8.69)]
    table = rep.diagonal_table([("whole", whole), ("2x2", quarters), ("strips", strips)])
    line = table.splitlines()[2].split()
    assert line[:2] == ["v5e", "1024x1024"]
    assert line[2:5] == ["10443", str(14 + 3 * 2764), "6425"]
    assert line[6:9] == ["8.42", "8.07", "7.74"] and line[-1] == f"{7.74 / 8.69:.2f}"


def test_before_after_table_sets_a_fused_backward_against_splashs_fused_one():
    """The grid-step change (chapter 05): forward and fused rows before and after; the fused
    kernel's ratio is to splash's fused backward (``splash_fused``), the forward's to the
    better official forward."""
    from flashlab.benchmarks import tpu_static_report as rep
    base = dict(library="flashlab", blocks="equal", block_q=512, block_k=512)
    before = [dict(base, chip="v5e", kernel=k, tile_cycles=t, step_cycles=s, est_cycles=c,
                   est_ms=c / 1e6) for k, t, s, c in [("forward", 1328, 266, 7190),
                                                      ("fused", 2764, 430, 13800)]]
    after = [dict(r, step_cycles=r["step_cycles"] - 90, est_cycles=r["est_cycles"] - 400,
                  est_ms=(r["est_cycles"] - 400) / 1e6) for r in before]
    after += [dict(base, chip="v5e", kernel=k, library=lib, tile_cycles=1, step_cycles=1,
                   est_cycles=c, est_ms=c / 1e6)
              for k, lib, c in [("forward", "jax_pallas_flash", 7550),
                                ("fused", "splash_fused", 14940)]]
    lines = rep.before_after_table(before, after, kernels=("forward", "fused")).splitlines()
    assert lines[1].split() == ["v5e", "forward", "1328", ">", "1328", "266", ">", "176",
                                "0.01", ">", "0.01", f"{6790 / 7550:.2f}"]
    assert lines[2].split()[:2] == ["v5e", "fused"] and lines[2].split()[-1] == \
        f"{13400 / 14940:.2f}"
