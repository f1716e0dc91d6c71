"""``python -m flashlab bench ring``: ring attention's per-device memory and time per step.

Two questions, on simulated CPU devices (``--xla_force_host_platform_device_count``):

* **Memory.** Grow the global length with the device count (``N = c·P`` for a fixed ``c``
  tokens per device) and read XLA's own accounting (``compiled.memory_analysis()``) of the
  forward+backward program *per device*: it should stay flat, while one device running the
  whole sequence grows with ``N``.
* **Time per step, measured vs modelled.** The measured ring time divided by ``P`` steps,
  against a model built from two measurements on this machine, the way
  :mod:`flashlab.instruments.comm_model` builds it for TPUs: one block's compute time (the backend
  alone on one ``c × c`` block) and one hop's transfer time (a lone ``ppermute`` of one K/V block).
  With the send overlapped, a step costs ``max(compute, transfer)``; without, their sum.
* **One step against** :mod:`flashlab.instruments.comm_model` (``--step-model``): one step's
  compute and one step's send timed on the largest ``--devices``, next to the model's figures
  for the same sizes on a CPU "chip" calibrated in the same run
  (:mod:`flashlab.benchmarks.ring_step`).
* **Across processes** (``--memory-only --processes 2``): the same memory question with the
  devices split over processes on 127.0.0.1 (JAX distributed, gloo), each size one bounded run
  of the launcher ``python -m flashlab ring --memory-only`` (:mod:`flashlab.scale.ring_cli`).

The device count must be set before JAX starts, so each configuration runs in a fresh child
process (``--child``) that prints one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["main", "run_child", "markdown", "run_processes", "markdown_processes"]


def _parser():
    p = argparse.ArgumentParser(prog="python -m flashlab bench ring", description=__doc__.split("\n")[0])
    p.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--tokens-per-device", type=int, default=512)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--backend", default="tiled")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--memory-only", action="store_true", help="compile only: no timings")
    p.add_argument("--processes", type=int, default=1,
                   help="with --memory-only: split each --devices count over this many "
                        "processes on 127.0.0.1 (python -m flashlab ring --memory-only)")
    p.add_argument("--step-model", action="store_true",
                   help="time one ring step's compute and send on the largest --devices, next "
                        "to comm_model's figures on a CPU calibrated in the same run")
    p.add_argument("--calib-matmul", type=int, default=512,
                   help="--step-model: n of the n x n fp32 matmul that calibrates FLOP/s")
    p.add_argument("--calib-mib", type=float, default=8.0,
                   help="--step-model: MiB per device of the ppermute that calibrates the link")
    p.add_argument("--json", metavar="PATH", help="also write the rows, command and commit")
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    return p


def run_child(a) -> dict:
    """One configuration in this (fresh) process: memory of the ring and of one device."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    from flashlab.instruments import comm_model
    from flashlab.scale.ring import block_functions, ring_attention
    from flashlab.contract.masks import validate
    from flashlab.instruments.measure import compiled_memory_bytes, time_fn
    from flashlab.compat.shard_map import shard_map

    P, c = a.child, a.tokens_per_device
    N, H, K, d = c * P, a.heads, a.kv_heads, a.head_dim
    mesh = jax.make_mesh((P,), ("sp",))
    rng = np.random.default_rng(0)
    # Inputs sharded along the sequence, as a training step holds them: device i has N/P tokens.
    seq = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "sp"))
    put = lambda n: jax.device_put(jnp.asarray(rng.standard_normal((1, N, n, d)), jnp.float32), seq)  # noqa: E731
    q, k, v = put(H), put(K), put(K)

    def train(q, k, v):
        return jax.value_and_grad(lambda q, k, v: jnp.sum(ring_attention(
            q, k, v, mesh=mesh, axis_name="sp", backend=a.backend, is_causal=True) ** 2),
            argnums=(0, 1, 2))(q, k, v)

    ring_mem = compiled_memory_bytes(train, q, k, v)            # per device (SPMD program)
    if a.memory_only:
        return {"P": P, "N": N, "c": c, "ring_peak": ring_mem["peak"],
                "ring_temp": ring_mem["temporaries"], "ring_args": ring_mem["arguments"],
                "one_device_peak": _one_device_peak(a, N, H, K, d) if P > 1 else ring_mem["peak"]}
    fwd = jax.jit(lambda q, k, v: ring_attention(q, k, v, mesh=mesh, axis_name="sp",
                                                 backend=a.backend, is_causal=True))
    t_ring = time_fn(fwd, q, k, v, repeats=a.repeats)
    # The model's two inputs, measured here: one block's compute, one hop's transfer.
    blk_fwd, _ = block_functions(a.backend)
    qc, kc, vc = q[:, :c // 2], k[:, :c // 2], v[:, :c // 2]    # zig-zag: 4 half-blocks a step
    _, _, _, spec = validate(qc, kc, vc)
    t_block = 4 * time_fn(jax.jit(lambda q, k, v: blk_fwd(q, k, v, spec)), qc, kc, vc,
                          repeats=a.repeats)
    t_hop = 0.0
    if P > 1:
        hop = jax.jit(shard_map(lambda x: jax.lax.ppermute(
            x, "sp", [(j, (j + 1) % P) for j in range(P)]), mesh=mesh,
            in_specs=jax.sharding.PartitionSpec("sp"), out_specs=jax.sharding.PartitionSpec("sp")))
        kv = jax.device_put(jnp.zeros((P, 2, c, K, d), jnp.float32),   # one K, one V block each
                            jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("sp")))
        t_hop = time_fn(hop, kv, repeats=a.repeats)
    step_bytes = comm_model.ring_step_bytes(batch=1, tokens_per_device=c, kv_heads=K,
                                            head_dim=d, bytes_per_element=4)
    return {"P": P, "N": N, "c": c, "ring_peak": ring_mem["peak"],
            "ring_temp": ring_mem["temporaries"], "step_s": t_ring / P, "block_s": t_block,
            "hop_s": t_hop, "step_bytes": step_bytes,
            "one_device_peak": _one_device_peak(a, N, H, K, d) if P > 1 else ring_mem["peak"]}


def _one_device_peak(a, N, H, K, d) -> int:
    """Per-device bytes of the same training step on ONE device holding the whole sequence."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    from flashlab.dispatch.api import attention
    from flashlab.instruments.measure import compiled_memory_bytes
    sds = lambda n: jax.ShapeDtypeStruct((1, N, n, d), jnp.float32)  # noqa: E731

    def train(q, k, v):
        return jax.value_and_grad(lambda q, k, v: jnp.sum(attention(
            q, k, v, backend=a.backend, is_causal=True) ** 2), argnums=(0, 1, 2))(q, k, v)
    return compiled_memory_bytes(train, sds(H), sds(K), sds(K))["peak"]


def markdown(rows) -> str:
    """The table the chapter stores: memory per device and time per step, measured vs model."""
    mib = lambda b: f"{b / 2**20:.1f}"  # noqa: E731
    if "step_s" not in rows[0]:
        out = ["| devices P | global N | ring MiB/device | of which arguments | temporaries "
               "| 1 device MiB |", "|---|---|---|---|---|---|"]
        out += [f"| {r['P']} | {r['N']} | {mib(r['ring_peak'])} | {mib(r['ring_args'])} "
                f"| {mib(r['ring_temp'])} | {mib(r['one_device_peak'])} |" for r in rows]
        return "\n".join(out)
    out = ["| devices P | global N | ring MiB/device | 1 device MiB | step ms | block ms "
           "| hop ms | model overlapped ms | model serial ms |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        over, serial = max(r["block_s"], r["hop_s"]), r["block_s"] + r["hop_s"]
        out.append(f"| {r['P']} | {r['N']} | {mib(r['ring_peak'])} | {mib(r['one_device_peak'])} "
                   f"| {r['step_s'] * 1e3:.1f} | {r['block_s'] * 1e3:.1f} | {r['hop_s'] * 1e3:.2f} "
                   f"| {over * 1e3:.1f} | {serial * 1e3:.1f} |")
    return "\n".join(out)


def main(argv=None) -> int:
    a = _parser().parse_args(argv)
    for name in ("tokens_per_device", "heads", "kv_heads", "head_dim", "repeats",
                 "calib_matmul", "processes"):
        if getattr(a, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')}: expected an int >= 1, got "
                             f"{getattr(a, name)}")
    if not a.calib_mib > 0:
        raise SystemExit(f"--calib-mib: expected a positive size in MiB, got {a.calib_mib}")
    if a.step_model and a.memory_only:
        raise SystemExit("--step-model, --memory-only: choose one")
    if a.child is not None:
        if a.step_model:
            from flashlab.benchmarks.ring_step import run_step_child
            print(json.dumps(run_step_child(a)))
        else:
            print(json.dumps(run_child(a)))
        return 0
    rows = []
    base = [x for x in (sys.argv[1:] if argv is None else argv) if x]
    if a.json:                                       # children print; the parent writes
        i = base.index("--json")
        base = base[:i] + base[i + 2:]
    if a.processes > 1:
        return _processes_report(a, argv)
    if a.step_model and max(a.devices) < 2:
        raise SystemExit(f"--devices: --step-model needs a ring of >= 2 devices, got {a.devices}")
    for P in (a.devices if not a.step_model else [max(a.devices)]):
        env = dict(os.environ, JAX_PLATFORMS="cpu",
                   XLA_FLAGS=f"--xla_force_host_platform_device_count={P}")
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "flashlab", "bench", "ring", *base,
                               "--child", str(P)], env=env, capture_output=True, text=True,
                              timeout=a.timeout)
        if proc.returncode:
            print(f"bench ring: P={P} failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
            return 1
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(f"P={P} done in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    if a.step_model:
        return _step_report(a, argv, rows[0])
    print(markdown(rows))
    flat = max(r["ring_peak"] for r in rows) / min(r["ring_peak"] for r in rows)
    grow = rows[-1]["one_device_peak"] / rows[0]["one_device_peak"]
    print(f"per-device peak, largest/smallest over P={a.devices}: ring {flat:.2f}x; one device "
          f"holding the whole sequence: {grow:.2f}x")
    if a.json:
        from flashlab.benchmarks.tpu_static import _commit
        import jax  # noqa: PLC0415
        Path(a.json).write_text(json.dumps(dict(
            command="python -m flashlab bench ring " + " ".join(
                sys.argv[1:] if argv is None else argv), commit=_commit(), jax=jax.__version__,
            what="XLA memory_analysis of the compiled forward+backward ring, per device "
                 "(peak = arguments + outputs + temporaries), on simulated CPU devices; "
                 "N = tokens_per_device x P", rows=rows), indent=1) + "\n")
        print(f"wrote {a.json}")
    return 0


def run_processes(a, P: int) -> dict:
    """One bounded 2-process (``a.processes``) launch: per-device bytes of every process."""
    n = a.processes
    cmd = [sys.executable, "-m", "flashlab", "ring", "--processes", str(n),
           "--devices-per-process", str(P // n), "--seq", str(a.tokens_per_device * P),
           "--heads", str(a.heads), "--kv-heads", str(a.kv_heads), "--head-dim", str(a.head_dim),
           "--backend", a.backend, "--memory-only", "--timeout", f"{a.timeout:g}"]
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.timeout + 60)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("MEMORY ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"processes: {' '.join(cmd[1:])} failed (status "
                           f"{proc.returncode}):\n{proc.stderr[-2000:]}")
    r = json.loads(lines[-1][len("MEMORY "):])
    worst = max(r["per_process"], key=lambda x: x["peak"])
    return {**r, "ring_peak": worst["peak"], "ring_args": worst["arguments"],
            "ring_temp": worst["temporaries"]}


def markdown_processes(rows) -> str:
    """Per-device MiB of the forward+backward ring, one column per process."""
    mib = lambda b: f"{b / 2**20:.2f}"  # noqa: E731
    n = len(rows[0]["per_process"])
    out = ["| devices P | processes x devices | global N | " + " | ".join(
        f"process {i} MiB/device" for i in range(n)) + " | of which arguments | temporaries |",
        "|---" * (5 + n) + "|"]
    out += [f"| {r['P']} | {n} x {r['P'] // n} | {r['N']} | " + " | ".join(
        mib(x["peak"]) for x in r["per_process"]) + f" | {mib(r['ring_args'])} "
        f"| {mib(r['ring_temp'])} |" for r in rows]
    return "\n".join(out)


def _processes_report(a, argv) -> int:
    if not a.memory_only:
        raise SystemExit("--processes: only with --memory-only (the time per step is measured "
                         "on simulated devices of one process: --step-model)")
    bad = [P for P in a.devices if P % a.processes]
    if bad:
        raise SystemExit(f"--devices: each count must be a multiple of --processes "
                         f"{a.processes}, got {bad}")
    rows = []
    for P in a.devices:
        t0 = time.perf_counter()
        rows.append(run_processes(a, P))
        print(f"P={P} ({a.processes} processes) done in {time.perf_counter() - t0:.0f} s",
              file=sys.stderr)
    print(markdown_processes(rows))
    flat = max(r["ring_peak"] for r in rows) / min(r["ring_peak"] for r in rows)
    print(f"per-device peak, largest/smallest over P={a.devices} (N = {a.tokens_per_device} P): "
          f"{flat:.2f}x")
    if a.json:
        from flashlab.benchmarks.tpu_static import _commit
        Path(a.json).write_text(json.dumps(dict(
            command="python -m flashlab bench ring " + " ".join(
                sys.argv[1:] if argv is None else argv), commit=_commit(), versions=_versions(),
            what="XLA memory_analysis of the compiled forward+backward ring (loss sum(O * dO), "
                 "dO an input), per device, reported by every process; processes on 127.0.0.1 "
                 "joined by jax.distributed (gloo CPU collectives); N = tokens_per_device x P; "
                 "fp32, causal, zig-zag", rows=rows), indent=1) + "\n")
        print(f"wrote {a.json}")
    return 0


def _versions() -> dict:
    import platform  # noqa: PLC0415

    import jax  # noqa: PLC0415
    import jaxlib  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    return {"python": platform.python_version(), "jax": jax.__version__,
            "jaxlib": jaxlib.__version__, "numpy": np.__version__,
            "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores",
            "load_average_1m_at_end": round(os.getloadavg()[0], 2)}


def _step_report(a, argv, result) -> int:
    """Print the measured-vs-modelled step table (and store it with ``--json``)."""
    from flashlab.benchmarks.ring_step import ASSUMPTIONS, step_rows, step_table
    print(step_table(result))
    print(f"assumptions: {ASSUMPTIONS}")
    if a.json:
        from flashlab.benchmarks.tpu_static import _commit
        Path(a.json).write_text(json.dumps(dict(
            command="python -m flashlab bench ring " + " ".join(
                sys.argv[1:] if argv is None else argv), commit=_commit(),
            versions=_versions(), assumptions=ASSUMPTIONS, result=result,
            rows=step_rows(result)), indent=1) + "\n")
        print(f"wrote {a.json}")
    return 0
