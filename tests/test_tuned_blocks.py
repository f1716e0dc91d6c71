"""The per-chip default forward blocks as data (flashlab/kernels/tuned_blocks.py)."""
import jax.numpy as jnp

from flashlab.kernels import blocks as blk, tuned_blocks


def _rows():
    base = dict(library="flashlab", kernel="forward", causal=True, head_dim=128, seq_len=8192,
                batch=2, heads=16)
    return [dict(base, chip="v5e", block_q=512, block_k=512, est_cycles=9),
            dict(base, chip="v5e", block_q=1024, block_k=512, est_cycles=7),
            dict(base, chip="v5e", block_q=512, block_k=1024, est_cycles=8),
            dict(base, library="splash", chip="v5e", block_q=128, block_k=128, est_cycles=1)]


def test_table_picks_the_fastest_and_the_heuristic_covers_the_rest(tmp_path, monkeypatch):
    p = tmp_path / "tpu_blocks.json"
    e = tuned_blocks.entries_from_rows(_rows(), dtype="bfloat16", command="c", commit="k",
                                       versions={})
    tuned_blocks.write(p, e)
    assert [(x["block_q"], x["block_k"]) for x in tuned_blocks.table(p)] == [(1024, 512)]
    assert len(tuned_blocks.table(p)[0]["tried"]) == 3
    monkeypatch.setattr(tuned_blocks, "TABLE", p)
    bf = jnp.bfloat16
    assert blk.choose_block_sizes(8192, 8192, 128, bf, "v5e", is_causal=True) == (1024, 512)
    assert blk.choose_block_sizes(5000, 5000, 64, bf, "v5e", is_causal=True) == (1024, 512)
    # a length out of [T/2, 2T): the nearest measured class's pair (here the only one)
    assert blk.choose_block_sizes(32768, 32768, 128, bf, "v5e", is_causal=True) == (1024, 512)
    assert blk.choose_block_sizes(2048, 1536, 128, bf, "v5e", is_causal=True) == (1024, 512)
    # no class of this causality on the chip: the other causality's
    assert blk.choose_block_sizes(8192, 8192, 128, bf, "v5e", is_causal=False) == (1024, 512)
    # no class for this chip or dtype at all: the heuristic
    for args, kw in [((8192, 8192, 128, bf, "v6e"), dict(is_causal=True)),
                     ((8192, 8192, 128, jnp.float32, "v5e"), dict(is_causal=True))]:
        got = blk.choose_block_sizes(*args, **kw)
        assert got == blk.choose_block_sizes(*args), (args, kw, got)


def test_backward_pairs_are_ranked_by_dq_plus_dkdv(tmp_path, monkeypatch):
    base = dict(library="flashlab", causal=True, head_dim=128, seq_len=8192, chip="v6e")
    rows = [dict(base, kernel="dq", block_q=512, block_k=512, est_cycles=5),
            dict(base, kernel="dkdv", block_q=512, block_k=512, est_cycles=5),
            dict(base, kernel="dq", block_q=1024, block_k=1024, est_cycles=3),
            dict(base, kernel="dkdv", block_q=1024, block_k=1024, est_cycles=6),
            dict(base, kernel="dq", block_q=1024, block_k=512, est_cycles=1),   # no dK/dV row
            dict(base, kernel="forward", block_q=512, block_k=1024, est_cycles=4)]
    p = tmp_path / "tpu_blocks.json"
    tuned_blocks.write(p, tuned_blocks.entries_from_rows(rows, dtype="bfloat16", command="c",
                                                         commit="k", versions={}))
    got = {e["kernel"]: (e["block_q"], e["block_k"], e["est_cycles"])
           for e in tuned_blocks.table(p)}
    assert got == {"backward": (1024, 1024, 9), "forward": (512, 1024, 4)}
    monkeypatch.setattr(tuned_blocks, "TABLE", p)
    bf = jnp.bfloat16
    assert blk.choose_backward_block_sizes(8192, 8192, 128, bf, "v6e", is_causal=True) == \
        (1024, 1024)
    assert blk.choose_block_sizes(8192, 8192, 128, bf, "v6e", is_causal=True) == (512, 1024)
    # other classes, and no is_causal: the heuristic
    heuristic = blk.choose_backward_block_sizes(8192, 8192, 128, bf, "v6e")
    assert heuristic == (512, 512)
    assert blk.choose_backward_block_sizes(8192, 8192, 128, bf, "v5e", is_causal=True) == \
        blk.choose_backward_block_sizes(8192, 8192, 128, bf, "v5e")     # no v5e class
    assert blk.choose_backward_block_sizes(8192, 8192, 128, bf, "v6e", is_causal=False) == \
        (1024, 1024)                                                    # the causal class's
    # T = 1024 is outside [4096, 16384): the nearest class's pair, not the heuristic's 512²
    assert blk.choose_backward_block_sizes(1024, 1024, 128, bf, "v6e", is_causal=True) == \
        (1024, 1024)
    import pytest
    with pytest.raises(ValueError, match="kernel: expected one of"):
        tuned_blocks.lookup(8192, 8192, 128, bf, "v6e", is_causal=True, kernel="dq")


def test_head_dim_64_is_its_own_class_and_falls_back_to_128(tmp_path, monkeypatch):
    """d = 64 runs unpadded (tiling.kernel_head_dim), so it is measured as its own class; a
    request of d = 64 without one takes the 128-lane class, as it did before."""
    rows = [dict(r, head_dim=64, block_q=r["block_q"] * 2) for r in _rows()] + _rows()
    p = tmp_path / "tpu_blocks.json"
    tuned_blocks.write(p, tuned_blocks.entries_from_rows(rows, dtype="bfloat16", command="c",
                                                         commit="k", versions={}))
    assert sorted((e["head_dim"], e["block_q"], e["block_k"]) for e in tuned_blocks.table(p)) \
        == [(64, 2048, 512), (128, 1024, 512)]
    look = lambda d, path=p: tuned_blocks.lookup(8192, 8192, d, jnp.bfloat16, "v5e",  # noqa
                                                 is_causal=True, path=path)
    assert look(64)["block_q"] == 2048 and look(128)["block_q"] == 1024
    assert look(80)["block_q"] == 1024          # no class of 80: the 128-lane one
    only128 = tmp_path / "only128.json"
    tuned_blocks.write(only128, tuned_blocks.entries_from_rows(
        _rows(), dtype="bfloat16", command="c", commit="k", versions={}))
    assert look(64, only128)["block_q"] == 1024


def test_tpu_blocks_ranks_every_stored_row(tmp_path, capsys):
    """``bench tpu-blocks`` ranks the rows of several stored runs together (a pair measured in
    one run, a faster one in another) and records the commits it ranked; a default-blocks row
    and a sweep row of the same pair count once, at the lower estimate."""
    import json
    from flashlab.benchmarks import tpu_blocks
    a, b = _rows()[:2], _rows()[2:]
    a = [dict(r, commit="aaa") for r in a] + [dict(a[0], blocks="default", est_cycles=12,
                                                   commit="old")]
    b = [dict(r, commit="bbb", est_cycles=6 if r["library"] == "flashlab" else 1) for r in b]
    runs = []
    for name, rows in (("a.json", a), ("b.json", b)):
        runs.append(tmp_path / name)
        runs[-1].write_text(json.dumps(dict(versions={"jax": "x"}, rows=rows)))
    table = tmp_path / "tpu_blocks.json"
    assert tpu_blocks.main(["--runs", *map(str, runs), "--table", str(table)]) == 0
    (e,) = tuned_blocks.table(table)
    assert (e["block_q"], e["block_k"], e["est_cycles"]) == (512, 1024, 6)
    assert {(t["block_q"], t["block_k"]): t["est_cycles"] for t in e["tried"]} == {
        (512, 512): 9, (1024, 512): 7, (512, 1024): 6}
    assert e["row_commits"] == ["aaa", "bbb", "old"] and e["versions"] == {"jax": "x"}
    assert e["commit"] == "aaa, bbb, old" and e["command"].startswith(
        "python -m flashlab bench tpu-blocks --runs")
    assert "512x1024 (3 pairs)" in capsys.readouterr().out
    # a run installed as it came out: its rows carry no commit, its args do
    runs[1].write_text(json.dumps(dict(versions={"jax": "x"}, args={"commit": "ccc"},
                                       rows=[{k: v for k, v in r.items() if k != "commit"}
                                             for r in b])))
    assert tpu_blocks.main(["--runs", *map(str, runs), "--table", str(table)]) == 0
    assert tuned_blocks.table(table)[0]["row_commits"] == ["aaa", "ccc", "old"]
    import pytest
    with pytest.raises(SystemExit):
        tpu_blocks.main(["--runs", str(tmp_path / "missing.json")])


def test_a_backward_pair_is_ranked_by_the_backward_that_ran_there():
    """Where ``backward="auto"`` ran the fused kernel its one row is the pair's backward;
    where it ran the split, dQ + dK/dV."""
    base = dict(library="flashlab", causal=True, head_dim=128, seq_len=8192, chip="v4")
    rows = [dict(base, kernel="dq", block_q=1024, block_k=1024, est_cycles=8),
            dict(base, kernel="dkdv", block_q=1024, block_k=1024, est_cycles=10),
            dict(base, kernel="fused", block_q=512, block_k=1024, est_cycles=15)]
    (e,) = tuned_blocks.entries_from_rows(rows, dtype="bfloat16", command="c", commit="k",
                                          versions={})
    assert (e["kernel"], e["block_q"], e["block_k"], e["est_cycles"]) == ("backward", 512,
                                                                          1024, 15)
    assert sorted(t["est_cycles"] for t in e["tried"]) == [15, 18]


def test_a_measured_block_is_halved_where_half_pads_less():
    """A class is measured at one length: its winner is kept where it tiles a request as well
    as its half, and halved where it would pad more (blocks.padding_fit), forward and
    backward alike (the committed table: v5e's T in [1024, 4095] class is 2048 x 2048)."""
    assert [blk.padding_fit(t, 2048, 128) for t in (2048, 3000, 4096, 5000, 8000)] == [
        2048, 1024, 2048, 1024, 2048]
    assert blk.padding_fit(3000, 2048, 2048) == 2048        # never below the unit
    bf16 = jnp.dtype(jnp.bfloat16)
    for choose in (blk.choose_block_sizes, blk.choose_backward_block_sizes):
        assert choose(2048, 2048, 128, bf16, "v5e", is_causal=True) == (2048, 2048)
        assert choose(3000, 3000, 128, bf16, "v5e", is_causal=True) == (1024, 1024)


def test_a_window_prices_each_pair_of_the_stored_window_run(tmp_path, monkeypatch):
    """Under a window the default is the stored window run's pair (tuned_blocks.band_rows)
    with the lowest :func:`blocks.band_estimate` at the request's lengths and window: its
    estimate scaled by the work its tiles do there (step + inside tile each, plus the edge
    tile's extra where an edge crosses) against the run's. At the run's own shape that is its
    estimate; a narrower band takes the smaller pair the run ranked second. Without a window,
    or without rows for the chip, the class's own pair (here: the heuristic)."""
    import json
    base = dict(library="flashlab", kernel="forward", chip="v6e", head_dim=128, causal=True,
                seq_len=32768, window=[4096, 0], step_cycles=100, case_tiles=[1])
    rows = [dict(base, block_q=512, block_k=512, tile_cycles=1000, case_cycles=[1200]),
            dict(base, block_q=2048, block_k=2048, tile_cycles=14000, case_cycles=[19000]),
            dict(base, library="splash", block_q=128, block_k=128, tile_cycles=1,
                 step_cycles=1)]
    bf = jnp.bfloat16
    n = lambda bq, bk, w, f: f(32768 // bq, 32768 // bk, q_len=32768, kv_len=32768,  # noqa
                               block_q=bq, block_k=bk, is_causal=True, window=w)
    for r in rows[:2]:                    # an estimate consistent with its parts
        r["est_cycles"] = (n(r["block_q"], r["block_k"], (4096, 0), blk.num_visible_blocks)
                           * (r["tile_cycles"] + 100)
                           + n(r["block_q"], r["block_k"], (4096, 0), blk.num_edge_blocks)
                           * (r["case_cycles"][0] - r["tile_cycles"]))
    p = tmp_path / "tpu_static_window.json"
    p.write_text(json.dumps(dict(args=dict(dtype="bfloat16"), rows=rows)))
    monkeypatch.setattr(tuned_blocks, "BAND_RUN", p)
    got = tuned_blocks.band_rows(128, bf, "v6e")
    assert [(r["block_q"], r["block_k"]) for r in got] == [(512, 512), (2048, 2048)]
    assert tuned_blocks.band_rows(128, bf, "v5e") == [] == tuned_blocks.band_rows(
        128, jnp.float32, "v6e")
    for r in got:
        assert blk.band_estimate(r, 32768, 32768, is_causal=True,
                                 window=(4096, 0)) == r["est_cycles"]
    # 512²: 540 tiles, 120 crossed (the first 8 rows only by the diagonal); 2048²: 45 and 30:
    # 1100 x 540 + 200 x 120 = 618000 against 14100 x 45 + 5000 x 30 = 784500
    assert got[0]["est_cycles"] == 618000 and got[1]["est_cycles"] == 784500
    assert blk.choose_block_sizes(32768, 32768, 128, bf, "v6e", is_causal=True,
                                  window=(4096, 0)) == (512, 512)
    wide = dict(is_causal=False, window=(30000, 30000))       # nearly every tile, none crossed
    assert (blk.band_estimate(got[1], 32768, 32768, **wide)
            < blk.band_estimate(got[0], 32768, 32768, **wide))
    assert blk.choose_block_sizes(32768, 32768, 128, bf, "v6e", **wide) == (2048, 2048)
    # no rows for v5e: its class's own pair, as without a window
    assert blk.choose_block_sizes(32768, 32768, 128, bf, "v5e", is_causal=True,
                                  window=(4096, 0)) == blk.choose_block_sizes(
        32768, 32768, 128, bf, "v5e", is_causal=True)


def test_the_shipped_window_defaults_are_the_window_runs_fastest():
    """On the shipped window run, its own shape (causal T = 32768, 4096 window) takes each
    chip's fastest pair of the run, forward and fused backward, and a narrower band never
    takes larger blocks."""
    bf = jnp.bfloat16
    for chip in ("v4", "v5e", "v5p", "v6e", "7x"):
        for kernel, choose in (("forward", blk.choose_block_sizes),
                               ("backward", blk.choose_backward_block_sizes)):
            rows = tuned_blocks.band_rows(128, bf, chip, kernel=kernel)
            best = min(rows, key=lambda r: r["est_cycles"])
            got = choose(32768, 32768, 128, bf, chip, is_causal=True, window=(4096, 0))
            assert got == (best["block_q"], best["block_k"]), (chip, kernel)
            narrow = choose(8192, 8192, 128, bf, chip, is_causal=True, window=(1024, 0))
            assert narrow[0] * narrow[1] <= got[0] * got[1], (chip, kernel)


def test_a_length_no_sweep_measured_takes_the_nearest_class(tmp_path):
    """Between and beyond the measured lengths: the class measured nearest
    (:func:`tuned_blocks.log_distance`), the shorter on a tie; a head_dim with a class of its
    own keeps to it; a causality without a class on the chip takes the other's."""
    def rows(T, bq, d=128):
        return [dict(r, seq_len=T, head_dim=d, block_q=bq) for r in _rows()[:1]]
    p = tmp_path / "tpu_blocks.json"
    tuned_blocks.write(p, tuned_blocks.entries_from_rows(
        rows(2048, 256) + rows(32768, 1024) + rows(8192, 512, d=64), dtype="bfloat16",
        command="c", commit="k", versions={}))

    def look(q, kv, d=128):
        return tuned_blocks.lookup(q, kv, d, jnp.bfloat16, "v5e", is_causal=True,
                                   path=p)["block_q"]
    assert look(2048, 2048) == 256 and look(32768, 32768) == 1024     # held by their class
    assert look(512, 512) == 256 and look(131072, 131072) == 1024     # beyond both ends
    assert look(4096, 4096) == 256                  # 1 doubling from 2048, 3 from 32768
    assert look(8192, 8192) == 256                  # 2 and 2: the tie goes to the shorter
    assert look(16384, 16384) == 1024
    assert look(512, 131072) == 256                 # √(512·131072) = 8192: the tie again
    assert look(65536, 65536, d=64) == 512          # d = 64's own class, however far
    # no non-causal class: the causal ones, by the same rule; one of its own comes first
    assert tuned_blocks.lookup(8192, 8192, 128, jnp.bfloat16, "v5e", is_causal=False,
                               path=p)["block_q"] == 256
    nc = [dict(r, causal=False) for r in rows(65536, 128)]
    tuned_blocks.write(p, tuned_blocks.entries_from_rows(nc, dtype="bfloat16", command="c",
                                                         commit="k", versions={}))
    assert tuned_blocks.lookup(2048, 2048, 128, jnp.bfloat16, "v5e", is_causal=False,
                               path=p)["block_q"] == 128
    assert look(2048, 2048) == 256
    assert tuned_blocks.lookup(8192, 8192, 128, jnp.float32, "v5e", is_causal=True,
                               path=p) is None      # no float32 class: the heuristic
