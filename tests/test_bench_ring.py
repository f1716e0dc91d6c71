"""bench ring: the measured-vs-modelled step table and the stored runs (shapes and signs only:
timings are never asserted, the machines are noisy)."""
import json
import math
from importlib.resources import files

import pytest

from flashlab.benchmarks import ring as bench_ring
from flashlab.benchmarks.ring_step import ASSUMPTIONS, step_rows, step_table


def _stored(name):
    return json.loads(files("flashlab").joinpath(f"data/{name}").read_text())


def _result(**measured):
    m = {"compute_s": 2e-3, "send_s": 1e-3, "step_s": 4e-3, "send_4_bytes_s": 5e-4}
    m.update(measured)
    return {"P": 8, "c": 64, "N": 512, "H": 4, "K": 2, "d": 64, "backend": "tiled",
            "calibration": {"matmul_n": 128, "matmul_s": 1e-3, "flops_per_s": 4e9,
                            "ppermute_bytes": 2 ** 20, "ppermute_s": 1e-3,
                            "link_bytes_per_s": 1e9},
            "step_flops": 4e6, "step_bytes": 65536, "measured": m,
            "modelled": {"compute_s": 1e-3, "send_s": 6.5e-5, "step_overlapped_s": 1e-3,
                         "step_serial_s": 1.065e-3}}


def test_step_rows_give_ratios_and_the_table_states_units_and_conditions():
    rows = step_rows(_result())
    assert [r["quantity"].split()[0] for r in rows] == ["compute", "send", "step", "step"]
    assert rows[0]["ratio"] == pytest.approx(2.0) and rows[0]["measured_ms"] == pytest.approx(2.0)
    table = step_table(_result())
    for words in ("measured ms", "modelled ms", "measured / modelled", "GFLOP/s", "GB/s",
                  "calibrated here", "simulated CPU devices", "KiB sent per device"):
        assert words in table, words
    assert "calibrated in this run" in ASSUMPTIONS and "ppermute" in ASSUMPTIONS


def test_step_rows_refuse_non_positive_or_non_finite_times():
    with pytest.raises(ValueError, match="compute"):
        step_rows(_result(compute_s=0.0))
    with pytest.raises(ValueError, match="send"):
        step_rows(_result(send_s=float("nan")))


def test_stored_step_model_run():
    run = _stored("ring_step_model.json")
    assert run["command"].startswith("python -m flashlab bench ring --step-model")
    assert run["commit"] and {"jax", "jaxlib", "python"} <= set(run["versions"])
    assert run["assumptions"] == ASSUMPTIONS
    assert run["rows"] == step_rows(run["result"])          # the table is the stored numbers'
    for r in run["rows"]:
        for key in ("measured_ms", "modelled_ms", "ratio"):
            assert math.isfinite(r[key]) and r[key] > 0, r
    cal = run["result"]["calibration"]
    assert cal["flops_per_s"] > 0 and cal["link_bytes_per_s"] > 0


def test_stored_two_process_memory_run():
    run = _stored("ring_memory_processes.json")
    assert "--processes 2" in run["command"] and "--memory-only" in run["command"]
    rows = run["rows"]
    assert len(rows) >= 2 and [r["P"] for r in rows] == sorted(r["P"] for r in rows)
    for r in rows:
        assert r["processes"] == 2 and len(r["per_process"]) == 2 and r["N"] == r["c"] * r["P"]
        assert all(x["peak"] > 0 and x["peak"] == x["arguments"] + x["outputs"] +
                   x["temporaries"] for x in r["per_process"])
    table = bench_ring.markdown_processes(rows).splitlines()
    assert len(table) == 2 + len(rows) and "process 1 MiB/device" in table[0]


@pytest.mark.parametrize("argv, words", [
    (["--processes", "2"], "--processes: only with --memory-only"),
    (["--memory-only", "--processes", "2", "--devices", "2", "3"], "multiple of --processes"),
    (["--step-model", "--memory-only"], "choose one"),
    (["--step-model", "--devices", "1"], "ring of >= 2 devices"),
    (["--tokens-per-device", "0"], "--tokens-per-device: expected an int >= 1"),
    (["--calib-mib", "-1"], "--calib-mib: expected a positive size"),
])
def test_bench_ring_bad_options_name_the_option(argv, words):
    with pytest.raises(SystemExit, match=words):
        bench_ring.main(argv)
