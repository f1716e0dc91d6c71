"""The bench CLI on a tiny grid: runs, prints a table, writes JSON rows and a figure."""
import json
import subprocess
import sys

import pytest

from flashlab import bench


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
    with pytest.raises(ValueError, match="backend: expected"):
        bench.main(["--backends", "nope"])
