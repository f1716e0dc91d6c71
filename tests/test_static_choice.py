"""``auto`` on a TPU orders the TPU kernels by the committed static table and says so."""
import json
from pathlib import Path

import jax.numpy as jnp

from flashlab.benchmarks import tpu_static_report
from flashlab.benchmarks.tpu_static_remeasured import measured_again, remeasured
from flashlab.dispatch import registry, static_table
from flashlab.kernels import blocks as blk, forward_grid, tuned_blocks
from flashlab.kernels.forward import INIT_REGION
from flashlab.contract.masks import validate


def _spec():
    return validate(*(jnp.zeros((1, 256, 2, 128), jnp.bfloat16),) * 3, is_causal=True)[3]


def _rows(chip, ms):
    return [dict(chip=chip, library=lib, kernel=k, blocks="default", est_ms=v / 3)
            for lib, v in ms.items() for k in ("forward", "dq", "dkdv")]


def test_auto_on_tpu_follows_the_static_table(tmp_path, monkeypatch):
    p = tmp_path / "tpu_static.json"
    p.write_text(json.dumps(dict(versions={}, args={}, rows=_rows(
        "v5e", {"flashlab": 9.0, "splash": 6.0, "jax_pallas_flash": 12.0}))))
    monkeypatch.setattr(static_table, "STORED", p)
    monkeypatch.setattr(static_table, "STORED_SHAPES", ())
    c = registry.choose(_spec(), platform="tpu")
    assert c.backend == "splash"
    assert "splash 6.00 ms" in c.reason and "pallas_tpu 9.00 ms" in c.reason
    assert "forward+dq+dkdv" in c.reason


def test_auto_on_tpu_without_figures_says_so(tmp_path, monkeypatch):
    p = tmp_path / "tpu_static.json"
    p.write_text(json.dumps(dict(versions={}, args={}, rows=_rows("v6e", {"splash": 1.0}))))
    monkeypatch.setattr(static_table, "STORED", p)
    monkeypatch.setattr(static_table, "STORED_SHAPES", ())
    c = registry.choose(_spec(), platform="tpu")     # target chip: v5e (no TPU here)
    assert c.backend == "pallas_tpu" and "no static figure for v5e" in c.reason


def test_auto_on_tpu_ranks_by_the_run_of_the_nearest_shape_class(tmp_path, monkeypatch):
    """Each stored run is a shape class: ``auto`` follows the run nearest the request (same
    causality, then head_dim class, then length on a log scale) and ``explain`` names it."""
    runs = {}
    for name, (t, d, causal), ms in [
            ("main", (8192, 128, True), {"flashlab": 9.0, "splash": 6.0}),
            ("t2048", (2048, 128, True), {"flashlab": 1.0, "splash": 2.0}),
            ("noncausal", (8192, 128, False), {"flashlab": 5.0, "jax_pallas_flash": 4.0})]:
        runs[name] = tmp_path / f"tpu_static_{name}.json"
        runs[name].write_text(json.dumps(dict(
            versions={}, args=dict(seq_len=t, head_dim=d, causal=causal, commit=name),
            rows=_rows("v5e", ms))))
    monkeypatch.setattr(static_table, "STORED", runs["main"])
    monkeypatch.setattr(static_table, "STORED_SHAPES", (runs["t2048"], runs["noncausal"]))
    near = static_table.nearest_run
    assert near(256, 256, 128, True) == near(2048, 4096, 64, True) == runs["t2048"]
    assert near(8192, 8192, 64, True) == near(65536, 65536, 128, True) == runs["main"]
    assert near(2048, 2048, 128, False) == runs["noncausal"]

    def spec(t, causal):
        return validate(*(jnp.zeros((1, t, 2, 128), jnp.bfloat16),) * 3, is_causal=causal)[3]
    c = registry.choose(spec(256, True), platform="tpu")
    assert c.backend == "pallas_tpu" and "tpu_static_t2048.json" in c.reason
    assert "T=2048" in c.reason and "commit t2048" in c.reason
    c = registry.choose(spec(16384, True), platform="tpu")
    assert c.backend == "splash" and "tpu_static_main.json" in c.reason
    c = registry.choose(spec(256, False), platform="tpu")
    assert c.backend == "jax_pallas_flash" and "non-causal" in c.reason


def test_committed_table_quoted():
    c = registry.choose(_spec(), platform="tpu")
    assert "static table on" in c.reason and "ms" in c.reason


def test_forward_optimisation_rows_are_measured_and_tabulated():
    from flashlab.viz import tpu_schedule as viz
    rows = viz.optimisation_rows()
    assert rows[0]["step"] == "baseline" and all(r["command"].startswith("python -m flashlab")
                                                 and r["commit"] for r in rows)
    assert rows[1]["tile_cycles"] < rows[0]["tile_cycles"]
    assert rows[2]["est_cycles"] < rows[1]["est_cycles"]
    # the grid step's two changes: bounds checks off, then the visit list read as planes
    assert rows[2]["step_cycles"] > rows[3]["step_cycles"] > rows[4]["step_cycles"]
    assert rows[3]["tile_cycles"] == rows[4]["tile_cycles"] == rows[2]["tile_cycles"]
    # the finalize without its empty-row test: same tile and step, a cheaper finalize
    assert (rows[5]["tile_cycles"], rows[5]["step_cycles"]) == (rows[4]["tile_cycles"],
                                                                rows[4]["step_cycles"])
    assert rows[5]["finalize_cycles"] < rows[4]["finalize_cycles"]
    assert rows[6]["tile_cycles"] < rows[5]["tile_cycles"]        # two row chunks at 512²
    text = viz.optimisation_table(rows)
    assert str(rows[0]["tile_cycles"]) in text and "VALU" in text


def test_taller_tiles_keep_256_row_chunks_as_measured():
    """``forward_tall_chunks.json``: v5e's and v5p's plain 2048² tile in four row chunks of 512
    rows (before) and in eight of 256 (after, as ``FORWARD_ROW_CHUNKS`` cuts it now), each row
    compiled from its own commit: after, the tile is shorter and spills less on both chips."""
    from flashlab.kernels.forward_config import make_config
    from flashlab.viz import tpu_schedule as viz
    rows = viz.optimisation_rows(static_table.STORED.parent / "forward_tall_chunks.json")
    before, after = rows[:2], rows[2:]
    assert len({r["tree"] for r in before} | {r["tree"] for r in after}) == 2
    x = jnp.zeros((1, 8192, 1, 128), jnp.bfloat16)
    *_, spec = validate(x, x, x)
    for b, a in zip(before, after):
        assert b["chip"] == a["chip"] and (b["block_q"], b["block_k"]) == (2048, 2048)
        assert make_config(spec, block_q=2048, block_k=2048, chip=a["chip"]).chunk_rows == 256
        assert a["tile_cycles"] < b["tile_cycles"] and a["est_cycles"] < b["est_cycles"]
        assert a["unit_busy"]["VSTORE:SPILL"] < b["unit_busy"]["VSTORE:SPILL"]


def test_taller_chunks_speed_up_only_the_tiles_they_cut():
    """Against the stored BEFORE rows (``forward_tall_before``: v5e's and v5p's forward rows of
    the eleven runs at ad88965), in every run measured again since: a tile of 2048 rows or more
    (eight chunks where it had four) and a soft-capped chunked tile 2048 keys wide (unfolded
    where it folded, or in shorter chunks) got faster; every other row compiled to the same
    cycles."""
    doc = tpu_static_report.stored_before("forward_tall_before")
    cycles = ("tile_cycles", "step_cycles", "init_cycles", "finalize_cycles", "est_cycles")
    paths = (static_table.STORED, *static_table.STORED_SHAPES, *static_table.STORED_OPTIONS)
    again = changed = 0
    for path, run, before in remeasured(doc, paths):
        if before is None:
            continue                                          # not measured again since
        again += 1
        after = [r for r in tuned_blocks.stored_rows(run)
                 if (r["library"], r["kernel"]) == ("flashlab", "forward")]
        for b, a in _matched(before, after):
            cut = b["block_q"] >= 2048 or (b.get("soft_cap") and b["block_k"] == 2048
                                           and b["block_q"] >= 512)
            changed += bool(cut)
            if cut:
                assert a["est_cycles"] < b["est_cycles"], (path.name, b)
            else:
                assert [a[c] for c in cycles] == [b[c] for c in cycles], (path.name, b)
    assert again >= 1 and changed >= 2 * again


def test_target_table_compares_with_the_better_official_kernel():
    rows = [dict(chip="v5e", library=lib, kernel="forward", blocks=b, block_q=q, block_k=q,
                 est_cycles=c, est_ms=c / 1e3)
            for lib, b, q, c in [("flashlab", "equal", 512, 90), ("splash", "equal", 512, 120),
                                 ("jax_pallas_flash", "equal", 512, 100),
                                 ("flashlab", "sweep", 1024, 80), ("splash", "sweep", 1024, 85)]]
    text = tpu_static_report.target_table(rows).splitlines()
    assert "jax_pallas_flash" in text[1] and "0.90" in text[1] and "met" in text[1]
    assert "splash" in text[2] and "0.94" in text[2] and "<= 0.9 MISSED" in text[2]
    for r in rows:                       # v5p's target is "no worse than 1.0x"
        r["chip"] = "v5p"
    text = tpu_static_report.target_table(rows).splitlines()
    assert "0.94" in text[2] and "<= 1.0 met" in text[2]
    assert "<= 0.9 MISSED" in tpu_static_report.target_table(rows, target=0.9).splitlines()[2]
    rows[0]["est_cycles"] = 90.4                  # 0.904: three digits where two read 0.90
    assert " 0.904 <= 0.9 MISSED" in tpu_static_report.target_table(rows, target=0.9)
    rows[0]["est_cycles"] = 89.952                # 0.8995: four digits where three read 0.900
    line = tpu_static_report.target_table(rows, target=0.9).splitlines()[1]
    assert " 0.8995 " in line and line.endswith("<= 0.9 met")


def test_a_training_step_is_the_forward_plus_the_whole_backward_at_each_best():
    """``step_rows``: at 512² the equal rows summed; at best blocks each kernel's fastest on
    its own (the forward at one pair, the backward at another), the split's dQ + dK/dV or a
    fused kernel, whichever is faster; a splash_fused row counts as splash's backward."""
    def row(lib, kernel, blocks, q, c):
        return dict(chip="v5e", library=lib, kernel=kernel, blocks=blocks, block_q=q, block_k=q,
                    est_cycles=c, est_ms=c / 10, tile_cycles=c, step_cycles=1, name=kernel)
    rows = [row("flashlab", "forward", "equal", 512, 50), row("flashlab", "forward", "sweep",
                                                               1024, 40),
            row("flashlab", "fused", "equal", 512, 100), row("flashlab", "fused", "sweep", 2048,
                                                               70),
            row("flashlab_split", "dq", "equal", 512, 40),
            row("flashlab_split", "dkdv", "equal", 512, 50),
            row("splash", "forward", "equal", 512, 60), row("splash", "dq", "equal", 512, 50),
            row("splash", "dkdv", "equal", 512, 70), row("splash_fused", "fused", "equal", 512,
                                                          100)]
    steps = {(r["library"], r["blocks"]): r for r in tpu_static_report.step_rows(rows)}
    assert steps["flashlab", "equal"]["est_cycles"] == 50 + 90          # the split is faster
    best = steps["flashlab", "best"]
    assert (best["est_cycles"], best["block_q"], best["bwd_blocks"]) == (40 + 70, 1024,
                                                                         "2048x2048")
    assert steps["splash", "equal"]["est_cycles"] == 60 + 100          # its fused backward
    text = tpu_static_report.target_table(list(steps.values()), kernel="step").splitlines()
    assert "14.00 ms" in text[1] and "0.88" in text[1] and "0.69" in text[2]
    assert "1024x1024+2048x2048" in text[2]
    other = [dict(r, seq_len=2048, est_cycles=1) for r in rows]       # a second shape
    steps = tpu_static_report.step_rows(rows + other)
    assert sorted(r["est_cycles"] for r in steps if r["library"] == "flashlab") == [
        2, 2, 110, 140]


def test_backward_before_after_table_reads_the_stored_rows():
    """The stored BEFORE rows (issue 18's backward changes) join the current tpu_static rows:
    every chip, both kernels, with provenance; the table prints before > after per row."""
    before = tpu_static_report.stored_before("backward_optimisations")
    assert before["versions"]["libtpu"] and before["command"] and before["changes"]
    assert {(r["chip"], r["kernel"]) for r in before["rows"]} == {
        (c, k) for c in ("v4", "v5e", "v5p", "v6e", "7x") for k in ("dq", "dkdv")}
    after = [dict(r, tile_cycles=r["tile_cycles"] - 100, est_cycles=r["est_cycles"] // 2,
                  est_ms=r["est_ms"] / 2) for r in before["rows"]]
    after += [dict(r, library="splash", est_cycles=r["est_cycles"]) for r in before["rows"]]
    lines = tpu_static_report.before_after_table(before["rows"], after).splitlines()
    assert len(lines) == 1 + 10
    v5e_dq = next(ln for ln in lines if ln.startswith("v5e  dQ"))
    b = next(r for r in before["rows"] if (r["chip"], r["kernel"]) == ("v5e", "dq"))
    assert f"{b['tile_cycles']} > {b['tile_cycles'] - 100}" in v5e_dq and v5e_dq.endswith("0.50")


def test_a_fused_backward_row_is_the_whole_backward(tmp_path, monkeypatch):
    """flashlab's default backward is one fused kernel: forward + fused is its training
    step, set against splash's forward + dQ + dK/dV; variants of the bench are no backend."""
    p = tmp_path / "tpu_static.json"
    rows = _rows("v5e", {"splash": 6.0, "jax_pallas_flash": 12.0})
    rows += [dict(chip="v5e", library="flashlab", kernel=k, blocks="default", est_ms=v)
             for k, v in (("forward", 1.0), ("fused", 4.0))]
    rows += [dict(chip="v5e", library="splash_fused", kernel="fused", blocks="default",
                  est_ms=0.1)]
    p.write_text(json.dumps(dict(versions={}, args={}, rows=rows)))
    monkeypatch.setattr(static_table, "STORED", p)
    monkeypatch.setattr(static_table, "STORED_SHAPES", ())
    ranked, _ = static_table.static_ranking("v5e")
    assert [(lib, round(ms, 2), k) for lib, ms, k in ranked] == [
        ("flashlab", 5.0, ("forward", "fused")), ("splash", 6.0, static_table.KERNELS),
        ("jax_pallas_flash", 12.0, static_table.KERNELS)]
    c = registry.choose(_spec(), platform="tpu")
    assert c.backend == "pallas_tpu" and "forward+fused" in c.reason


def test_each_stored_run_is_one_run_of_the_bench():
    """Issue 18's tables come from one run each: the main shape's file and each other shape's
    file are a ``bench tpu-static --json`` output installed as it came out (its commit and
    command in ``args``, no row measured elsewhere), at the shape its ``args`` name; the
    other shapes are the issue's (T = 2048 and 32768, d = 64, non-causal at T = 2048, 8192
    and 32768 and at d = 64) and d = 256, each once."""
    paths = (static_table.STORED, *static_table.STORED_SHAPES)
    shapes = set()
    for p in paths:
        doc = static_table.stored(p)
        a = doc["args"]
        assert a["commit"] and a["command"].startswith("python -m flashlab bench tpu-static")
        assert "updates" not in doc and not any("commit" in r for r in doc["rows"]), p
        shape = (a["seq_len"], a["head_dim"], a["causal"])
        assert {(r["seq_len"], r["head_dim"], r["causal"]) for r in doc["rows"]} == {shape}, p
        assert {r["library"] for r in doc["rows"]} >= {"flashlab", "splash", "jax_pallas_flash"}
        assert {r["chip"] for r in doc["rows"]} == {"v4", "v5e", "v5p", "v6e", "7x"}, p
        shapes.add(shape)
    assert shapes == {(8192, 128, True), (2048, 128, True), (32768, 128, True),
                      (8192, 64, True), (2048, 128, False), (8192, 128, False),
                      (32768, 128, False), (8192, 64, False),
                      (8192, 256, True)}
    both = static_table.stored_shapes()
    assert [r["path"] for r in both["runs"]] == list(map(str, static_table.STORED_SHAPES))
    text = tpu_static_report.target_tables_by_shape(both["rows"])
    for run in both["runs"]:
        assert f"(commit {run['args']['commit']})" in text


def test_each_stored_option_run_is_one_run_of_the_bench():
    """The option runs (``--window``, ``--soft-cap``) are one run each, installed as they came
    out, every row carrying its option; jax's kernel, which has neither, is an error row on
    every chip, and flashlab and splash are measured on all five."""
    for p, option in zip(static_table.STORED_OPTIONS, ("window", "soft_cap")):
        doc = static_table.stored(p)
        a = doc["args"]
        assert a["commit"] and a["command"].startswith("python -m flashlab bench tpu-static")
        assert a[option] and all(r.get(option) for r in doc["rows"]), p
        assert "updates" not in doc and not any("commit" in r for r in doc["rows"]), p
        jax_rows = [r for r in doc["rows"] if r["library"] == "jax_pallas_flash"]
        assert jax_rows and all("no sliding window and no soft cap" in r["error"]
                                for r in jax_rows)
        for lib in ("flashlab", "splash"):
            ok = {r["chip"] for r in doc["rows"] if r["library"] == lib and "error" not in r}
            assert ok == {"v4", "v5e", "v5p", "v6e", "7x"}, (p, lib)


def _noncausal_rows() -> list:
    """Every row of the stored non-causal runs (:data:`static_table.STORED_SHAPES`)."""
    return [r for p in static_table.STORED_SHAPES for r in static_table.stored(p)["rows"]
            if not r["causal"]]


def _matched(before_rows, after_rows):
    """``(before, after)`` row pairs of one compile (shape, chip, library, kernel, block pair;
    a later after row replaces an earlier one), pairs with an error on both sides left out. A
    BEFORE row that no row after matches must be a default pair the runs since no longer take."""
    def key(r):
        return (tpu_static_report.shape_of(r), r["chip"], r["library"], r["kernel"],
                r.get("block_q"), r.get("block_k"))
    after = {key(r): r for r in after_rows}
    for b in before_rows:
        a = after.get(key(b))
        if a is None:
            assert b["blocks"] == "default", b
        elif "error" in b or "error" in a:
            assert ("error" in b) == ("error" in a), b
        else:
            yield b, a


def test_the_non_causal_runs_read_jaxs_unbranched_tile_as_its_own():
    """jax's kernel computes its non-causal tile with no branch of its own; the reader before
    a14da70 took the stage region around it, init and finalize inside, for its tile and so
    charged both at every grid step. The stored BEFORE rows (``noncausal_branch_before``)
    and the runs since differ by exactly that: the same kernel, read with init and finalize
    apart. flashlab's forward and fused rows there are a kernel change (no branch around
    the tile, no per-row zeroing in the fused one): no slower at any pair, faster at 512².
    Our forward and fused kernel have changed since (the next tests): their rows right after
    this change are the stored ``forward_init_before`` and ``dq_zeroing_before``."""
    before = tpu_static_report.stored_before("noncausal_branch_before")["rows"]
    after = _noncausal_rows() + [r for name in ("forward_init_before", "dq_zeroing_before")
                                 for r in tpu_static_report.stored_before(name)["rows"]]
    jax_rows = flashlab_rows = 0
    for b, a in _matched(before, after):
        if b["library"] == "jax_pallas_flash":
            jax_rows += 1
            assert b["tile_cycles"] == (a["tile_cycles"] + a["init_cycles"]
                                        + a["finalize_cycles"]), b
            assert b["step_cycles"] == a["step_cycles"]
            assert a["est_cycles"] <= b["est_cycles"]
        else:
            flashlab_rows += 1
            assert a["est_cycles"] <= b["est_cycles"], b
            if b["blocks"] == "equal":
                assert a["est_cycles"] < b["est_cycles"], b
    assert jax_rows > 300 and flashlab_rows > 300


def test_the_forward_opens_a_row_with_a_select_where_every_block_is_visible():
    """Where every block is visible a q row's first step takes its state (-inf, 0, 0) through
    a select instead of an init region storing it (55bc3d9), on every chip but v4
    (``forward.INIT_REGION``). Against the stored BEFORE rows (``forward_init_before``: the
    forward rows of the four non-causal runs at a14da70): v4 compiles to the same cycles, every
    other chip has no init left, and its forward is faster at 512² and no slower at its default
    blocks (at T = 2048 a 2048² row is one step, and compiles to the same cycles)."""
    before = tpu_static_report.stored_before("forward_init_before")["rows"]
    cycles = ("tile_cycles", "step_cycles", "init_cycles", "finalize_cycles", "est_cycles")
    seen = 0
    for b, a in _matched(before, _noncausal_rows()):
        seen += 1
        if b["chip"] in INIT_REGION:
            assert [a[c] for c in cycles] == [b[c] for c in cycles], b
            continue
        assert a["init_cycles"] == 0, a
        if b["blocks"] == "equal":
            assert a["est_cycles"] < b["est_cycles"], b
        elif b["blocks"] == "default":  # 2048² at T = 2048: one step a row, the same cycles
            assert a["est_cycles"] <= b["est_cycles"], b
    assert seen > 150


def test_the_forward_asking_for_its_vmem_need_is_faster_or_the_same_kernel():
    """The forward asks Mosaic for the scoped VMEM its blocks need (0d632bb,
    ``forward_grid.scoped_vmem_bytes``), not the chip's ceiling. Against the stored BEFORE rows
    (``forward_vmem_before``: the forward rows of the eleven runs at 7ccc6a6), in every run
    measured again since: v4, whose ceiling is Mosaic's 16 MiB default (the limit it asks for
    now too), compiles to the same cycles; no row got slower; and on v5e and v6e every 512² row
    got faster where a ``[B, H, T, d]`` copy fits the VMEM the kernel leaves XLA (XLA keeps an
    operand there: a grid step with a DMA fewer), and compiled to the same cycles where none
    does (d = 256: a 128 MiB copy)."""
    doc = tpu_static_report.stored_before("forward_vmem_before")
    cycles = ("tile_cycles", "step_cycles", "init_cycles", "finalize_cycles", "est_cycles")
    again = 0
    paths = (static_table.STORED, *static_table.STORED_SHAPES, *static_table.STORED_OPTIONS)
    for path, run, before in remeasured(doc, paths):
        if before is None:
            continue                                          # the run before the change
        again += 1
        after = [r for r in tuned_blocks.stored_rows(run) if r["kernel"] == "forward"]
        pairs = list(_matched(before, after))
        # every 512² and swept row has its before (a default pair may have moved since)
        ours = [r for r in after if r["library"] == "flashlab" and r["blocks"] != "default"]
        assert len(pairs) >= len(ours) >= 5, path
        for b, a in pairs:
            if b["chip"] == "v4":
                assert [a[c] for c in cycles] == [b[c] for c in cycles], b
            assert a["est_cycles"] <= b["est_cycles"], b
            if b["chip"] in ("v5e", "v6e") and b["blocks"] == "equal":
                dtype = jnp.dtype(run["args"]["dtype"])
                copy = b["batch"] * b["heads"] * b["seq_len"] * b["head_dim"] * dtype.itemsize
                room = blk.vmem_capacity_bytes(b["chip"]) - forward_grid.scoped_vmem_bytes(
                    blk.vmem_bytes(b["block_q"], b["block_k"], b["head_dim"], dtype), b["chip"])
                fits = copy <= room
                assert (a["est_cycles"] < b["est_cycles"]) == fits, (fits, b)
                assert fits or [a[c] for c in cycles] == [b[c] for c in cycles], b
    assert again >= 1


def test_the_fused_backward_writes_dq_on_its_first_kv_row_where_every_block_is_visible():
    """Where every block is visible the fused kernel's first kv row writes each q block's dQ
    rows (4b76501), where an init region behind a branch had zeroed the resident dQ at each
    (batch, kv head, query chunk)'s first step. Against the stored BEFORE rows
    (``dq_zeroing_before``: our fused rows of the four non-causal runs at 09233ef), in every
    run measured again since: no init region is left (the zeroing was the fused kernel's only
    one there). Where a (b, hk) is one grid step (T = 2048 at 2048²) the branch was always
    taken and had compiled away: no init before either, and no slower. Elsewhere on v5e, v5p
    and v6e the tile is 10-22 cycles shorter at every pair and the whole kernel faster; on v4
    and 7x the scheduler moves the tile both ways (7x at 512² and T = 8192 1624 -> 1634, at
    2048² 21119 -> 20849), and at most three pairs a run got slower, by under 1% (7x at 512²
    at T = 8192 and d = 64; v4 at d = 64 at 512² and 1024²). v6e's and 7x's fused rows have
    changed since (the next test): theirs right after this change are the stored
    ``grads_on_lanes_before``."""
    doc = tpu_static_report.stored_before("dq_zeroing_before")
    lanes_before = tpu_static_report.stored_before("grads_on_lanes_before")["rows"]
    again = 0
    for path, run, before in remeasured(doc, static_table.STORED_SHAPES):
        if before is None:
            continue                                       # not measured again since
        again += 1
        after = [r for r in tuned_blocks.stored_rows(run)       # v6e, 7x: as they were
                 if (r["library"], r["kernel"]) == ("flashlab", "fused")] + lanes_before
        pairs = list(_matched(before, after))
        assert len(pairs) >= 40, path                      # 5 chips x (512² and 7 sweeps)
        slower = set()
        for b, a in pairs:
            assert a["init_cycles"] == 0, a
            if b["init_cycles"] == 0:                      # one step a (b, hk): no branch left
                assert b["block_k"] == b["seq_len"], b
                assert a["est_cycles"] <= b["est_cycles"], b
            elif b["chip"] in ("v5e", "v5p", "v6e"):
                assert 10 <= b["tile_cycles"] - a["tile_cycles"] <= 22, b
                assert a["est_cycles"] < b["est_cycles"], b
            elif a["est_cycles"] > b["est_cycles"]:
                assert a["est_cycles"] < 1.01 * b["est_cycles"], b
                slower.add((b["chip"], b["block_q"], b["block_k"]))
        assert len(slower) <= 3, (path, slower)
    assert again >= 3


def test_the_fused_backward_holds_do_and_dq_on_lanes_on_v6e_and_7x():
    """On v6e and 7x, where every block is visible, the fused kernel reads dO in ``[d, B_r]``
    blocks and keeps its dQ as ``[G, d, T / n]`` (``backward_config.GRADS_ON_LANES``): ``dQᵀ
    = Kᵀ dS'ᵀ`` takes the tile ``dS'ᵀ`` as it is, where ``dQ = dS' K`` transposed it on the
    XLU first, and its output is ``B_r`` wide, not ``d``: their MXUs are 256 wide. Against
    the stored BEFORE rows (``grads_on_lanes_before``: v6e's and 7x's fused rows of the four
    non-causal runs at 396a8c9), in each of the four, all measured again since, at every
    pair: the XLU transposes ``K_j`` (``B_c / 8`` cycles) where it transposed ``dS'`` (``B_r
    B_c / 1024``), the MXUs are busy a tenth less (one matmul of five at half its cycles; at
    d = 64, whose ``dQᵀ`` streams 64 rows, 15% less), the tile is 8-13% shorter and the
    whole kernel faster."""
    doc = tpu_static_report.stored_before("grads_on_lanes_before")
    again = 0
    for path, run, before in remeasured(doc, static_table.STORED_SHAPES):
        if before is None:
            continue                                       # not measured again since
        again += 1
        after = [r for r in tuned_blocks.stored_rows(run)
                 if (r["library"], r["kernel"]) == ("flashlab", "fused")]
        pairs = list(_matched(before, after))
        assert len(pairs) >= 16, path                      # 2 chips x (512² and 7 sweeps)

        def need(r, unit):                                 # cycles the unit alone needs
            return r["unit_busy"][unit] // r["unit_capacity"][unit]
        for b, a in pairs:
            assert need(b, "XLU") == b["block_q"] * b["block_k"] // 1024, b
            assert need(a, "XLU") == a["block_k"] // 8, b
            assert need(a, "MXU") * (10 if b["head_dim"] == 128 else 20) == need(b, "MXU") * (
                9 if b["head_dim"] == 128 else 17), b
            assert 0.87 * b["tile_cycles"] < a["tile_cycles"] < 0.925 * b["tile_cycles"], b
            assert a["est_cycles"] < b["est_cycles"], b
    assert again == 4                                      # T = 2048, 8192, 32768, d = 64
    # the change before it, read as it stood right after (chapter 07): v6e at T = 8192, 512²,
    # 1625 -> 1611 cycles there, not -> 1487 (today's, after this change too)
    text = measured_again(tpu_static_report.stored_before("dq_zeroing_before"),
                          static_table.STORED_SHAPES, kernels=("fused",), later=[doc])
    assert "v6e  fused       1625 > 1611 " in text and "> 1487 " not in text


def test_right_after_reads_an_earlier_change_as_it_stood():
    """A row a later change's BEFORE file holds stands for today's row (same shape, chip,
    library, kernel, blocks and option): a soft-capped row is not the plain one's."""
    from flashlab.benchmarks.tpu_static_remeasured import right_after
    plain = dict(chip="v6e", library="flashlab", kernel="fused", blocks="equal", seq_len=8192,
                 head_dim=128, causal=True, tile_cycles=1445)
    capped = dict(plain, soft_cap=50.0, tile_cycles=1700)
    later = [{"rows": [dict(plain, tile_cycles=1569), dict(capped, tile_cycles=1800)]}]
    got = right_after([plain, capped, dict(plain, chip="v5e", tile_cycles=2805)], later)
    assert [r["tile_cycles"] for r in got] == [1569, 1800, 2805]


def test_the_causal_fused_backward_holds_do_and_dq_on_lanes_on_v6e_and_7x():
    """On v6e and 7x, where causal is the only mask (no window, no run-time lengths), the fused
    kernel holds dO and dQ with the query positions on lanes too (f4e67fa): each diagonal
    strip reads its queries of dO as columns. Against the stored BEFORE rows
    (``causal_lanes_before``: v6e's and 7x's fused rows of the six causal runs before), in
    each of the six runs, all measured again since, at every pair: the tile is 7-12% shorter
    (under the soft cap, at v6e's 2048², 24%: 27628 -> 20967 cycles) and the whole kernel
    faster. At d = 256 the layout barely moves the tile, 4% shorter to 0.3% longer (v6e 512²,
    1642 -> 1647 cycles), and the whole kernel is faster at every chip's best blocks."""
    doc = tpu_static_report.stored_before("causal_lanes_before")
    paths = (static_table.STORED, *static_table.STORED_SHAPES, *static_table.STORED_OPTIONS)
    again = []
    for path, run, before in remeasured(doc, paths):
        if before is None:
            continue                                       # not measured again since
        again.append(path.name)
        after = [r for r in tuned_blocks.stored_rows(run)
                 if (r["library"], r["kernel"]) == ("flashlab", "fused")]
        pairs = list(_matched(before, after))
        assert len(pairs) >= 4, path                       # 2 chips x (512², defaults, ...)
        for b, a in pairs:
            low, high = 0.88, 0.93
            if b["head_dim"] == 256:                       # the layout barely moves it
                low, high = 0.95, 1.005
            elif (b.get("soft_cap"), b["chip"], b["block_k"]) == (50.0, "v6e", 2048):
                low = 0.75
            assert low * b["tile_cycles"] < a["tile_cycles"] < high * b["tile_cycles"], b
            if b["head_dim"] != 256:
                assert a["est_cycles"] < b["est_cycles"], b
        for chip in ("v6e", "7x"):                         # faster at the best blocks
            mine = [(b, a) for b, a in pairs if b["chip"] == chip]
            assert min(a["est_cycles"] for _, a in mine) < min(b["est_cycles"] for b, _ in mine)
    assert sorted(again) == sorted(doc["runs"])            # every causal run measured again
    assert len(again) == 6
    # a BEFORE file naming a run at the commit it still stands at reads "not measured again"
    d256 = next(Path(p) for p in paths if Path(p).name == "tpu_static_d256.json")
    now = static_table.stored(d256)["args"]["commit"]
    text = measured_again(dict(doc, runs={d256.name: now}), paths, kernels=("fused",))
    assert text.strip().endswith(f"not measured again, its run is the one at {now}")
