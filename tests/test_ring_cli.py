"""``python -m flashlab ring`` across 2 processes on 127.0.0.1 (JAX distributed + gloo).

Bounded: every run has a ``--timeout`` (the workers' coordinator wait and the launcher's wait
on its children) and a subprocess timeout above it; only loopback addresses and a free port.
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flashlab.scale.ring_cli import free_port

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["--processes", "2", "--devices-per-process", "2", "--seq", "32", "--heads", "2",
         "--kv-heads", "1", "--head-dim", "8", "--repeats", "1"]


def _run(args, timeout=240, env_extra=None):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "flashlab", "ring", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_two_processes_forward_backward_match_the_oracle():
    proc = _run(SMALL + ["--timeout", "200"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "over 4 devices in 2 processes" in proc.stdout
    lines = [l.strip() for l in proc.stdout.splitlines()]
    assert "OK" in lines and "MISMATCH" not in lines, proc.stdout[-3000:]
    # Table rows only: the runtime may log to stdout too (gloo once printed "3 peer ranks...").
    table = re.compile(r"^\s*(\d+)\s+(\d+)\s+(\d+)\s+[\d.]+\s+[\d.]+\s*$")
    rows = [m.groups() for m in map(table.match, proc.stdout.splitlines()) if m]
    rows = [r for r in rows if r[0] in ("0", "3")]
    assert len(rows) == 2 and rows[1][1] == "1"          # device 3 lives in process 1
    # zig-zag, causal, 4 devices: every device computes 2P + 1 = 9 blocks.
    assert all(r[2] == "9" for r in rows), rows


@pytest.mark.parametrize("extra, words", [
    (["--fail-process", "1"], ["process 1 of 2", "failing on purpose", "others were stopped"]),
    (["--skew-shape-process", "1"], ["process 1: global shapes differ"]),
    (["--seq", "36"], ["query", "sequence length 36", "multiple of 8"]),
    (["--axis-name", "seq"], ["axis_name", "'seq' is not an axis"]),
])
def test_failures_name_the_process_and_every_process_exits(extra, words):
    proc = _run(SMALL + ["--timeout", "120"] + extra)
    assert proc.returncode != 0
    for w in words:
        assert w in proc.stderr, (w, proc.stderr[-3000:])


def test_unreachable_coordinator_times_out_naming_the_process():
    port = free_port()                                  # nobody listens there
    proc = _run(SMALL + ["--worker", "1", "--coordinator", f"127.0.0.1:{port}",
                         "--timeout", "3"], timeout=120,
                env_extra={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
    assert proc.returncode == 1
    assert f"process 1: could not reach the coordinator at 127.0.0.1:{port} within 3 s" \
        in proc.stderr, proc.stderr[-3000:]


def test_memory_only_reports_every_process_per_device_bytes():
    """Compile-only across 2 processes x 1 device: one MEMORY line, the same SPMD program's
    per-device bytes from each process (bench ring --memory-only --processes 2 reads it)."""
    import json
    proc = _run(["--processes", "2", "--devices-per-process", "1", "--seq", "16", "--heads", "1",
                 "--kv-heads", "1", "--head-dim", "8", "--memory-only", "--timeout", "100",
                 "--layout", "contiguous", "--no-causal"],  # the cheapest compile
                timeout=160)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("MEMORY ")]
    r = json.loads(lines[-1][len("MEMORY "):])
    assert (r["P"], r["processes"], r["N"], r["c"]) == (2, 2, 16, 8)
    peaks = [x["peak"] for x in r["per_process"]]
    assert len(peaks) == 2 and peaks[0] == peaks[1] > 0
