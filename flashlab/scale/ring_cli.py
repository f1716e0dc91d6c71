"""``python -m flashlab ring``: ring attention across processes on this machine (loopback only).

The launcher picks a free port on 127.0.0.1 and starts ``--processes`` Python processes, each
with ``--devices-per-process`` simulated CPU devices. Each process joins JAX's own distributed
runtime (``jax.distributed.initialize``, the CPU collectives over gloo), builds the same global
Q, K, V from a seed, and runs :func:`flashlab.scale.ring.ring_attention` forward and
backward over *all* devices with the chosen backend. Process 0 checks the output and the gradients
against the float64 oracle and prints per-device block counts and timings.

Every wait is bounded: the coordinator connection (``--timeout``), and the launcher's wait on
its children (``--timeout`` again, for the whole run). When a process fails, the launcher
stops the others and exits non-zero naming the process; a worker that cannot reach the
coordinator exits with a message naming itself and the address.

Run it::

    python -m flashlab ring --processes 2 --devices-per-process 4 --seq 256 --backend tiled
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time

__all__ = ["main", "free_port", "launch", "worker", "wait_for_coordinator"]

FWD_ATOL = 2e-5      # fp32 outputs of unit-scale inputs vs the float64 oracle (as the tests)
GRAD_RTOL = 1e-4     # fp32 gradients relative to the largest float64 gradient entry


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m flashlab ring", description=__doc__.split("\n")[0])
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--devices-per-process", type=int, default=4)
    p.add_argument("--seq", type=int, default=256, help="global sequence length N")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--backend", default="tiled", help="tiled, pallas_tpu or auto")
    p.add_argument("--layout", default="zigzag", help="zigzag or contiguous")
    p.add_argument("--axis-name", default="sp", help="mesh axis the ring runs over")
    p.add_argument("--mesh-axis", default="sp", help="name given to the mesh's axis")
    p.add_argument("--no-causal", action="store_true")
    p.add_argument("--window", type=int, nargs=2, default=None, metavar=("LEFT", "RIGHT"))
    p.add_argument("--repeats", type=int, default=3, help="timed calls after the compile")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds for every wait")
    p.add_argument("--memory-only", action="store_true",
                   help="compile only: print one JSON line with the per-device bytes of the "
                        "forward+backward program (XLA memory analysis) of every process")
    p.add_argument("--seed", type=int, default=0)
    # Internal / testing.
    p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--coordinator", default=None, help=argparse.SUPPRESS)
    p.add_argument("--fail-process", type=int, default=None,
                   help="testing: this process exits with an error after joining")
    p.add_argument("--skew-shape-process", type=int, default=None,
                   help="testing: this process builds a query one token longer")
    return p


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------- launcher

def launch(args, argv) -> int:
    """Start the workers, wait for all of them (bounded), stop the rest if one fails."""
    port = free_port()
    coord = args.coordinator or f"127.0.0.1:{port}"
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={args.devices_per_process}")
    env.pop("JAX_ENABLE_X64", None)
    procs, logs = [], []
    for pid in range(args.processes):
        cmd = [sys.executable, "-m", "flashlab", "ring", *argv, "--worker", str(pid),
               "--coordinator", coord]
        # Files, not pipes: a chatty runtime (gloo logs) must never fill a pipe nobody reads
        # while we poll, which would hang the worker.
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        logs.append((out, err))
        procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=err, text=True))
    deadline = time.monotonic() + args.timeout
    failed = None
    while time.monotonic() < deadline:
        codes = [p.poll() for p in procs]
        bad = [i for i, c in enumerate(codes) if c not in (None, 0)]
        if bad:
            failed = (bad[0], f"exited with status {codes[bad[0]]}")
            break
        if all(c == 0 for c in codes):
            break
        time.sleep(0.1)
    else:
        failed = (next(i for i, p in enumerate(procs) if p.poll() is None),
                  f"did not finish within --timeout {args.timeout:g} s")
    for p in procs:                       # stop the others: nobody waits forever on a peer
        if p.poll() is None:
            p.terminate()
    outs = []
    for p, (out, err) in zip(procs, logs):
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        out.seek(0), err.seek(0)
        outs.append((out.read(), err.read()))
        out.close(), err.close()
    print(outs[0][0], end="")
    if failed is None:
        return 0
    i, why = failed
    print(f"ring: process {i} of {args.processes} {why}; the others were stopped.\n"
          f"--- process {i} stderr (tail) ---\n{outs[i][1][-3000:]}", file=sys.stderr)
    return 1


# ----------------------------------------------------------------------------- worker

def wait_for_coordinator(address: str, timeout: float, process_id: int) -> None:
    """Poll a TCP connect to ``host:port`` until it succeeds; ``RuntimeError`` after ``timeout``.

    JAX's client aborts the whole process (no Python exception) when it cannot register with
    the coordinator, so workers other than 0 check reachability first, in Python.
    """
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=1.0):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise RuntimeError(f"process {process_id}: could not reach the coordinator at "
                                   f"{address} within {timeout:g} s ({e})") from None
            time.sleep(0.2)


def _initialize(args):
    """Join the distributed runtime; a clear error naming this process if it cannot."""
    import jax  # noqa: PLC0415
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if args.worker != 0:
        wait_for_coordinator(args.coordinator, args.timeout, args.worker)
    try:
        jax.distributed.initialize(coordinator_address=args.coordinator,
                                   num_processes=args.processes, process_id=args.worker,
                                   initialization_timeout=max(1, int(args.timeout)),
                                   heartbeat_timeout_seconds=max(10, int(args.timeout)),
                                   shutdown_timeout_seconds=max(1, int(args.timeout)))
    except Exception as e:  # noqa: BLE001 -- re-raised with who and where
        raise RuntimeError(f"process {args.worker}: could not reach the coordinator at "
                           f"{args.coordinator} within {args.timeout:g} s "
                           f"({type(e).__name__}: {str(e)[:300]})") from e


def _check_same_shapes(shapes: dict, process_id: int):
    """Every process must build the same global shapes; name the first that differs."""
    import numpy as np  # noqa: PLC0415
    from jax.experimental import multihost_utils  # noqa: PLC0415
    flat = np.array([d for s in shapes.values() for d in s], np.int64)
    every = np.asarray(multihost_utils.process_allgather(flat))      # [processes, n]
    for p in range(every.shape[0]):
        if not (every[p] == every[0]).all():
            raise ValueError(f"process {p}: global shapes differ from process 0's: "
                             f"{every[p].tolist()} vs {every[0].tolist()} (query, key, value "
                             f"dims); every process must pass the same --seq/--heads/...")
    del process_id


def worker(args) -> int:
    _initialize(args)
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    from jax.experimental import multihost_utils  # noqa: PLC0415
    from jax.sharding import NamedSharding  # noqa: PLC0415
    from jax.sharding import PartitionSpec as PS  # noqa: PLC0415

    from flashlab.dispatch import conformance
    from flashlab.scale.ring import ring_attention, ring_block_counts
    from flashlab.ladder.reference import oracle_attention

    me = jax.process_index()
    if args.fail_process == me:
        raise SystemExit(f"process {me}: failing on purpose (--fail-process {me})")
    P = jax.device_count()
    mesh = jax.make_mesh((P,), (args.mesh_axis,))
    if args.memory_only:
        return _memory_only(args, mesh)
    B, N, H, K, d = args.batch, args.seq, args.heads, args.kv_heads, args.head_dim
    q, k, v = conformance.random_qkv(np.random.default_rng(args.seed), B, N, N, H, K, d)
    dout = np.random.default_rng(args.seed + 1).standard_normal(q.shape).astype(np.float32)
    if args.skew_shape_process == me:
        q = np.concatenate([q, q[:, :1]], axis=1)
    _check_same_shapes({"q": q.shape, "k": k.shape, "v": v.shape}, me)
    kw = {"is_causal": not args.no_causal}
    if args.window is not None:
        kw["local_window_size"] = tuple(args.window)
    # Global arrays: each process supplies the slices its own devices hold.
    shard = NamedSharding(mesh, PS(None, args.mesh_axis if N % P == 0 else None))
    glob = lambda x: jax.make_array_from_callback(x.shape, shard, lambda i: x[i])  # noqa: E731
    gq, gk, gv, gdo = (glob(x) for x in (q, k, v, dout))
    ring = dict(mesh=mesh, axis_name=args.axis_name, layout=args.layout, backend=args.backend)

    def loss(q, k, v, do):
        return jnp.sum(ring_attention(q, k, v, **ring, **kw) * do)

    fwd = jax.jit(lambda q, k, v: ring_attention(q, k, v, **ring, **kw)).lower(gq, gk, gv).compile()
    bwd = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(gq, gk, gv, gdo).compile()
    ma = bwd.memory_analysis()                              # per device: the SPMD program
    peak = ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes

    def timed(fn, *a):
        jax.block_until_ready(fn(*a))                       # first run
        ts = []
        for _ in range(max(1, args.repeats)):
            t0 = time.perf_counter()
            r = jax.block_until_ready(fn(*a))
            ts.append(time.perf_counter() - t0)
        return r, float(np.median(ts))

    out, t_fwd = timed(fwd, gq, gk, gv)
    (_, grads), t_bwd = timed(bwd, gq, gk, gv, gdo)
    counts = ring_block_counts(gq, gk, gv, mesh=mesh, axis_name=args.axis_name,
                               layout=args.layout, backend=args.backend, **kw)
    gather = lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True))  # noqa: E731
    out = gather(out)
    grads = [gather(g) for g in grads]
    times = np.asarray(multihost_utils.process_allgather(np.array([t_fwd, t_bwd])))
    if me != 0:
        return 0
    ref = oracle_attention(q, k, v, **kw)
    err = float(np.abs(out - ref).max())
    g_ref = conformance.oracle_grads(q, k, v, dout, **kw)
    rel = [float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)) for a, b in zip(grads, g_ref)]
    print(f"ring attention over {P} devices in {jax.process_count()} processes "
          f"(backend={args.backend}, layout={args.layout}, {kw}); B={B} N={N} H={H} K={K} d={d}")
    print(f"per-device bytes of the forward+backward program (XLA memory analysis): "
          f"{peak / 2**20:.2f} MiB (global Q, K, V: {3 * q.nbytes / 2**20:.2f} MiB)")
    print(f"{'device':>6} {'process':>7} {'blocks':>6} {'fwd ms':>8} {'fwd+bwd ms':>10}")
    for i, dev in enumerate(mesh.devices.flat):             # i = position on the ring
        t = times[dev.process_index]
        print(f"{i:>6} {dev.process_index:>7} {int(counts[i]):>6} {t[0] * 1e3:>8.1f} "
              f"{t[1] * 1e3:>10.1f}")
    ok = err <= FWD_ATOL and max(rel) <= GRAD_RTOL
    print(f"forward max abs err vs float64 oracle: {err:.2e} (tol {FWD_ATOL:g}); gradient "
          f"relative errs dq/dk/dv: {', '.join(f'{r:.2e}' for r in rel)} (tol {GRAD_RTOL:g})")
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


def _memory_only(args, mesh) -> int:
    """Compile (no run) the forward+backward ring on global shapes; every process reports its
    per-device bytes and process 0 prints them as one JSON line, prefixed ``MEMORY``."""
    import json  # noqa: PLC0415

    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    from jax.experimental import multihost_utils  # noqa: PLC0415
    from jax.sharding import NamedSharding  # noqa: PLC0415
    from jax.sharding import PartitionSpec as PS  # noqa: PLC0415

    from flashlab.scale.ring import ring_attention
    P, B, N, H, K, d = (jax.device_count(), args.batch, args.seq, args.heads, args.kv_heads,
                        args.head_dim)
    if N % P:
        raise ValueError(f"--seq: global length {N} must be a multiple of the {P} devices "
                         f"(each holds N/P tokens)")
    shard = NamedSharding(mesh, PS(None, args.mesh_axis))     # N/P tokens per device
    sds = lambda n: jax.ShapeDtypeStruct((B, N, n, d), jnp.float32, sharding=shard)  # noqa: E731
    kw = {"is_causal": not args.no_causal}

    def loss(q, k, v, do):
        return jnp.sum(ring_attention(q, k, v, mesh=mesh, axis_name=args.axis_name,
                                      layout=args.layout, backend=args.backend, **kw) * do)

    ma = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(
        sds(H), sds(K), sds(K), sds(H)).compile().memory_analysis()
    mine = np.array([ma.argument_size_in_bytes, ma.output_size_in_bytes,
                     ma.temp_size_in_bytes], np.int64)
    every = np.asarray(multihost_utils.process_allgather(mine))      # [processes, 3]
    if jax.process_index() == 0:
        rows = [{"process": p, "arguments": int(a), "outputs": int(o), "temporaries": int(t),
                 "peak": int(a + o + t)} for p, (a, o, t) in enumerate(every)]
        print("MEMORY " + json.dumps({"P": P, "processes": jax.process_count(), "N": N,
                                      "c": N // P, "per_process": rows}), flush=True)
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    for name in ("processes", "devices_per_process", "seq"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')}: expected an int >= 1, got "
                             f"{getattr(args, name)}")
    if args.worker is None:
        return launch(args, argv)
    try:
        return worker(args)
    except (Exception, SystemExit) as e:  # noqa: BLE001 -- any failure: say it, exit now
        print(f"ring: {e}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        # Skip JAX's exit-time shutdown barrier, which would wait for the peers this process
        # is abandoning; the launcher sees the status at once and stops the others.
        os._exit(1)
