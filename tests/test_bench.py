"""The bench CLI on a tiny grid: runs, prints a table, writes JSON rows and a figure."""
import json
import subprocess
import sys

import pytest

from flashlab.benchmarks import backends as bench


def test_bench_quick_json_and_plot(tmp_path):
    out, fig = tmp_path / "rows.json", tmp_path / "bench.png"
    r = subprocess.run([sys.executable, "-m", "flashlab", "bench", "--quick", "--seq-lens", "64",
                        "128", "--json", str(out), "--plot", str(fig), "--no-progress"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())
    assert rows and {"reference", "xla"} <= {row["backend"] for row in rows}
    for row in rows:
        for key in ("backend", "seq_len", "head_dim", "dtype", "causal", "seconds",
                    "flops_per_s", "mode"):
            assert key in row
        assert row["seconds"] > 0 and row["seq_len"] in (64, 128)
    assert "% of peak" in r.stdout and "modes:" in r.stdout
    assert fig.stat().st_size > 0


def test_attention_flops():
    assert bench.attention_flops(1, 1, 4, 4, 2, False) == 4 * 16 * 2
    assert bench.attention_flops(1, 1, 4, 4, 2, True) == 4 * 16


def test_bench_subcommand_dispatch_and_unknown_backend(monkeypatch):
    import importlib.machinery
    import types
    fake = types.ModuleType("fake_bench_tiled")
    fake.__spec__ = importlib.machinery.ModuleSpec("fake_bench_tiled", None)
    seen = []
    fake.main = lambda argv: seen.append(argv) or 0
    monkeypatch.setitem(sys.modules, "fake_bench_tiled", fake)
    monkeypatch.setitem(bench.SUBCOMMANDS, "tiled", "fake_bench_tiled")
    assert bench.main(["tiled", "--quick"]) == 0 and seen == [["--quick"]]


@pytest.mark.parametrize("argv, words", [
    (["--heads", "0"], ["--heads", "positive integer", "0"]),
    (["--batch", "0"], ["--batch", "positive integer", "0"]),
    (["--repeats", "0"], ["--repeats", "positive integer", "0"]),
    (["--seq-lens", "-5"], ["--seq-lens", "positive integer", "-5"]),
    (["--seq-lens", "64", "x"], ["--seq-lens", "positive integer", "'x'"]),
    (["--head-dims", "0"], ["--head-dims", "positive integer", "0"]),
    (["--backends", "nope"], ["--backends", "unknown backend 'nope'", "'tiled'"]),
    (["--dtype", "int8"], ["--dtype", "invalid choice", "'int8'"]),
    (["--causal", "maybe"], ["--causal", "invalid choice"]),
])
def test_bench_bad_arguments_exit_2_with_a_usage_message(argv, words, capsys):
    """Refused by argparse before anything runs: exit status 2, the option, value and want."""
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m flashlab bench")
    for w in words:
        assert w in err, (w, err)


def test_bench_help_describes_every_option(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    options = [a for a in bench._parser()._actions if a.option_strings]
    assert len(options) >= 14
    for action in options:
        assert action.help and action.help.strip(), action.option_strings
        assert action.option_strings[-1] in out
    assert "number of heads, positive" in out and "timed calls per case" in out


def test_bench_run_refuses_non_positive_sizes():
    with pytest.raises(ValueError, match="heads: expected positive ints, got 0"):
        bench.run(backends=["reference"], seq_lens=(8,), heads=0, progress=False)


def test_bench_skip_line_names_the_cli_flag(capsys):
    """An official kernel off its TPU is skipped with the CLI's spelling of the fix."""
    assert bench.main(["--backends", "splash", "--seq-lens", "128", "--repeats", "1",
                       "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "skipped splash (N=128)" in out and "pass --interpret" in out
    assert "interpret=True" not in out


def test_tile_matmuls_probe_is_the_tiled_loops_matmuls():
    """The benchmark's ceiling probe computes exactly sum_j (Q_i K_jᵀ) V_j per q block."""
    import numpy as np
    from flashlab.benchmarks.tiled import markdown, targets, tile_matmuls_only
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 64, 2, 8)).astype(np.float32) for _ in range(3))
    got = np.asarray(tile_matmuls_only(q, k, v, block_q=16, block_k=32))   # [2, 4, 16, 8]
    qh, kh, vh = (x.transpose(0, 2, 1, 3)[0] for x in (q, k, v))           # [2, 64, 8]
    want = np.einsum("hqs,hsd->hqd", qh @ kh.transpose(0, 2, 1), vh)
    np.testing.assert_allclose(got.reshape(2, 64, 8), want, rtol=1e-4, atol=1e-3)
    rss = dict(peak_rss_bytes=1e8)
    results = [dict(kind="fwd", impl="tiled", n=64, seconds=1.0, flops=1.0, **rss),
               dict(kind="rate", impl="tiled", n=64, matmul_n=8, seconds=1.0, flops=1.0,
                    causal_seconds=0.5, ceiling_seconds=0.5, matmul_seconds=1.0,
                    matmul_flops=4.0, **rss),
               dict(kind="rate", impl="tiled", n=64, matmul_n=8, block_q=16, block_k=32,
                    seconds=0.5, flops=1.0, causal_seconds=0.4, ceiling_seconds=0.25,
                    matmul_seconds=1.0, matmul_flops=4.0, **rss)]
    text = markdown(dict(machine="m", date="d", results=results, targets=targets(results)))
    assert "50% of the matmul rate" in text and "reaches 50% of that ceiling" in text
    assert "| rate   matmuls N=64 (the loop's matmuls alone), alternating | 500.0 ms | 0.0" \
        in text
    # The sweep row goes to the block-size table only, and the targets use the default row.
    assert "| 64x64 (default) | 0.0 | 25% | 50% | 0.50x |" in text
    assert "| 16x32 | 0.0 | 50% | 100% | 0.80x |" in text and "blocks 16x32" not in text
    causal = next(t for t in targets(results) if "causal" in t["target"])
    assert causal["value"] == "0.50x" and causal["met"] is True


def test_flop_rate_target_uses_the_interleaved_rate_run():
    """The FLOP-rate target divides the two medians of one alternating run when there is one,
    not rates measured minutes apart in separate processes."""
    from flashlab.benchmarks.tiled import markdown, run_child, targets
    r = run_child(dict(kind="rate", impl="tiled", n=128, matmul_n=64, repeats=2))
    assert min(r[k] for k in ("seconds", "causal_seconds", "ceiling_seconds", "matmul_seconds")) > 0
    assert r["matmul_flops"] == 2.0 * 64 ** 3 and r["flops"] == 4.0 * 8 * 128 ** 2 * 64
    rss = dict(peak_rss_bytes=1e8)
    results = [dict(kind="matmul", impl="-", n=64, seconds=1.0, flops=1.0, **rss),
               dict(kind="fwd", impl="tiled", n=64, seconds=1.0, flops=1.0, **rss),
               dict(kind="rate", impl="tiled", n=64, matmul_n=8, seconds=1.0, flops=1.0,
                    causal_seconds=0.7, ceiling_seconds=1.0, matmul_seconds=1.0,
                    matmul_flops=4.0, **rss)]
    rate = next(t for t in targets(results) if "FLOP rate" in t["target"])
    assert rate["value"] == "25%" and rate["met"] is False
    assert "rate   matmul N=8 (square), alternating" in markdown(
        dict(machine="m", date="d", results=results, targets=targets(results)))
