"""``python -m flashlab bench tiled``: the tiled rung against naive and XLA attention on CPU.

Every configuration runs in a fresh subprocess, so that its peak resident memory (the child
reports its own ``VmHWM``) belongs to that configuration alone, and ratios are taken
between numbers measured in the same run. fp32, batch 1, 8 heads, head_dim 64.

Targets (2-core x86 CPU): forward at N=8192 >= 5x naive; N=16384 >= 8x naive and peak RSS
<= 1 GB; N=4096 >= 2.5x ``jax.nn.dot_product_attention(implementation="xla")``; forward
FLOP rate >= 60% of this machine's fp32 matmul rate; causal <= 0.6x non-causal;
fwd+bwd at N=4096 <= 4x the forward; peak RSS of fwd+bwd at N=8192 <= 1.5 GB.

The FLOP-rate and causal targets are ratios, and a shared machine's speed drifts by 20% or
more over minutes; so they are measured in one process by their own configuration
(``kind="rate"``), which alternates calls of the tiled forward, its causal run, the ceiling
probe (:func:`tile_matmuls_only`, the loop's matmuls alone) and the square matmul, and
divides the medians.

GFLOP/s counts matmul FLOPs: ``4·N²·d`` per head for the forward (halved when causal),
3.5x that for forward + backward.

Options: ``--quick`` (small N, under a minute), ``--sweep`` (the rate child at other block
sizes, :data:`SWEEP_BLOCKS`), ``--json PATH`` (write all results).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

from flashlab.instruments.measure import host_memory_available_bytes

__all__ = ["main", "run_child", "tile_matmuls_only"]

HEADS, HEAD_DIM, BATCH = 8, 64, 1
GB = 1e9


# ----------------------------------------------------------------------------- child side

def run_child(cfg: dict) -> dict:
    """Run one configuration in this process and return its measurements."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from flashlab.instruments import measure
    from flashlab.ladder.reference import naive_attention
    from flashlab.ladder.tiled import tiled_attention

    kind, n, repeats, warmup = cfg["kind"], cfg["n"], cfg.get("repeats", 3), cfg.get("warmup", 1)

    def square_matmul(m):
        a = jnp.asarray(np.random.default_rng(0).standard_normal((m, m)), jnp.float32)
        return jax.jit(lambda a: a @ a).lower(a).compile(), a

    if kind == "matmul":
        f, a = square_matmul(n)
        t = measure.time_fn(f, a, repeats=max(repeats, 5))
        return {"seconds": t, "flops": 2.0 * n ** 3}
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((BATCH, n, HEADS, HEAD_DIM)), jnp.float32)
               for _ in range(3))
    causal = cfg.get("causal", False)
    impl = cfg["impl"]
    if impl == "tiled":
        bq, bk = cfg.get("block_q"), cfg.get("block_k")
        attn = lambda q, k, v: tiled_attention(q, k, v, is_causal=causal, block_q=bq, block_k=bk)
    elif impl == "naive":
        attn = lambda q, k, v: naive_attention(q, k, v, is_causal=causal)
    elif impl == "xla":
        attn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                            implementation="xla")
    elif impl == "matmuls":
        attn = tile_matmuls_only
    else:
        raise ValueError(f"impl: unknown {impl!r}")
    if kind in ("fwd", "rate"):
        f = jax.jit(attn)
    elif kind == "fwdbwd":
        f = jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(attn(q, k, v)), argnums=(0, 1, 2)))
    else:
        raise ValueError(f"kind: unknown {kind!r}")
    f = f.lower(q, k, v).compile()        # compiled ahead: no timed run includes compilation
    # Forward: 2 matmuls of 2·N²·d each. Forward + backward: the forward's 2 plus the
    # backward's 5 (S recomputed, dP, dV, dK, dQ): 3.5x the forward's count.
    flops = 4.0 * BATCH * HEADS * n * n * HEAD_DIM * (0.5 if causal else 1.0)
    if kind == "fwdbwd":
        flops *= 3.5
    if kind == "rate":
        # Alternate the tiled forward, its causal run, the ceiling probe (the same loop's
        # matmuls alone) and the square matmul call by call, so machine drift hits all four.
        bq, bk = cfg.get("block_q"), cfg.get("block_k")
        causal_f = jax.jit(lambda q, k, v: tiled_attention(
            q, k, v, is_causal=True, block_q=bq, block_k=bk)).lower(q, k, v).compile()
        probe = jax.jit(lambda q, k, v: tile_matmuls_only(q, k, v, bq, bk)).lower(q, k, v).compile()
        mm, a = square_matmul(cfg["matmul_n"])
        calls = {"seconds": (f, (q, k, v)), "causal_seconds": (causal_f, (q, k, v)),
                 "ceiling_seconds": (probe, (q, k, v)), "matmul_seconds": (mm, (a,))}
        times = {name: [] for name in calls}
        for r in range(warmup + repeats):
            for name, (fn, args) in calls.items():
                t_call = measure.time_fn(fn, *args, repeats=1, warmup=0)
                if r >= warmup:
                    times[name].append(t_call)
        out = {name: statistics.median(ts) for name, ts in times.items()}
        return dict(out, flops=flops, matmul_flops=2.0 * cfg["matmul_n"] ** 3)
    t = measure.time_fn(f, q, k, v, repeats=repeats, warmup=warmup)
    return {"seconds": t, "flops": flops}


def tile_matmuls_only(q, k, v, block_q: int | None = None, block_k: int | None = None):
    """The tiled forward's loop with its two matmuls per tile and nothing else (no softmax,
    no masks), one head at a time as the tiled rung runs: a ceiling for the tiled rung on this
    machine, not attention.

    ``q, k, v [B, N, H, d]`` -> ``[B·H, N/block_q, block_q, d]`` (sums of ``S·V``).
    """
    import jax
    import jax.numpy as jnp

    from flashlab.ladder.tiled_schedule import block_sizes as _block_sizes

    B, T, H, d = q.shape
    bq, bk = _block_sizes(block_q, block_k, T, T)          # the tiled rung's own choice
    q3, k3, v3 = (x.transpose(0, 2, 1, 3).reshape(B * H, T, d) for x in (q, k, v))

    def head(xs):
        qh, kh, vh = xs                                                   # [T, d] each

        def q_block(i):
            q_blk = jax.lax.dynamic_slice_in_dim(qh, i * bq, bq, 0)      # [bq, d]

            def body(j, acc):
                k_blk = jax.lax.dynamic_slice_in_dim(kh, j * bk, bk, 0)  # [bk, d]
                v_blk = jax.lax.dynamic_slice_in_dim(vh, j * bk, bk, 0)
                return acc + (q_blk @ k_blk.T) @ v_blk                    # [bq, bk] @ [bk, d]
            return jax.lax.fori_loop(0, T // bk, body, jnp.zeros((bq, d), q.dtype))
        return jax.lax.map(q_block, jnp.arange(T // bq))

    return jax.lax.map(head, (q3, k3, v3))


def _child_main(cfg_json: str) -> int:
    cfg = json.loads(cfg_json)
    res = run_child(cfg)
    from flashlab.instruments.measure import peak_rss_bytes
    res["peak_rss_bytes"] = peak_rss_bytes()
    print("RESULT " + json.dumps(res), flush=True)
    return 0


# ----------------------------------------------------------------------------- parent side

def _spawn(cfg: dict, timeout: float = 1800) -> dict:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "flashlab.benchmarks.tiled", "--child",
                           json.dumps(cfg)], capture_output=True, text=True, env=env,
                          timeout=timeout)
    wall = time.perf_counter() - t0
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            out = dict(cfg, **json.loads(line[7:]), wall_s=wall)
            return out
    if proc.returncode == -9:
        return dict(cfg, error="killed by the OS (out of memory)", wall_s=wall)
    tail = (proc.stderr or proc.stdout)[-600:]
    return dict(cfg, error=f"child exited {proc.returncode}: {tail}", wall_s=wall)


def _label(c):
    s = f"{c['kind']:6s} {c['impl']:5s} N={c['n']:<6d}"
    if c.get("causal"):
        s += " causal"
    if c.get("block_q") is not None:
        s += f" blocks {c['block_q']}x{c['block_k']}"
    return s


# ``--sweep``: other (block_q, block_k) for the rate child at N=8192 (the default is 512x512).
SWEEP_BLOCKS = ((512, 1024), (1024, 512), (1024, 1024), (2048, 512), (2048, 2048))


def plan(quick: bool, sweep: bool = False) -> list[dict]:
    """The configurations to run (dicts understood by :func:`run_child`)."""
    if quick:
        ns, big = (512, 1024), 1024
        cfgs = [dict(kind="matmul", impl="-", n=1024)]
        for n in ns:
            cfgs += [dict(kind="fwd", impl=i, n=n) for i in ("tiled", "naive", "xla")]
        cfgs += [dict(kind="rate", impl="tiled", n=big, matmul_n=1024),
                 dict(kind="fwdbwd", impl="tiled", n=big)]
        if sweep:
            cfgs += [dict(kind="rate", impl="tiled", n=big, matmul_n=1024, block_q=256,
                          block_k=512)]
        return cfgs
    cfgs = [dict(kind="matmul", impl="-", n=2048)]
    for n in (512, 1024, 2048, 4096):                       # crossover xla vs tiled
        cfgs += [dict(kind="fwd", impl="tiled", n=n), dict(kind="fwd", impl="xla", n=n)]
    # Naive at N >= 8192 takes minutes per call: one timed call (compiled ahead, no warm-up).
    slow = dict(repeats=1, warmup=0)
    cfgs += [dict(kind="fwd", impl="tiled", n=8192),
             dict(kind="rate", impl="tiled", n=8192, matmul_n=2048, repeats=5),
             dict(kind="fwd", impl="naive", n=8192, **slow),
             dict(kind="fwd", impl="tiled", n=16384),
             dict(kind="fwd", impl="naive", n=16384, **slow),
             dict(kind="fwdbwd", impl="tiled", n=4096), dict(kind="fwdbwd", impl="tiled", n=8192)]
    if sweep:
        cfgs += [dict(kind="rate", impl="tiled", n=8192, matmul_n=2048, block_q=bq, block_k=bk)
                 for bq, bk in SWEEP_BLOCKS]
    return cfgs


def _need_bytes(c) -> float:
    """RAM a configuration needs: naive and XLA hold about 2.2 N×N float32 score arrays per
    head at their peak (measured: 4.74 GB at N=8192), the tiled rung well under 1 GB."""
    if c["impl"] in ("naive", "xla"):
        return 2.25 * BATCH * HEADS * c["n"] ** 2 * 4 + 0.5 * GB
    return 2 * GB


def run(quick: bool = False, sweep: bool = False, progress=print) -> dict:
    results = []
    cfgs = plan(quick, sweep)
    for idx, c in enumerate(cfgs, 1):
        need = _need_bytes(c)
        avail = host_memory_available_bytes()
        if avail < need:
            r = dict(c, skipped=f"MemAvailable {avail / GB:.1f} GB < {need / GB:.1f} GB needed")
        else:
            progress(f"[{idx}/{len(cfgs)}] {_label(c)} ...", end=" ", flush=True)
            r = _spawn(c)
            if "error" in r:
                progress("error")
            else:
                progress(f"{r['seconds'] * 1e3:9.1f} ms  {r['flops'] / r['seconds'] / 1e9:6.1f} "
                         f"GFLOP/s  peak RSS {r['peak_rss_bytes'] / GB:.2f} GB")
            results.append(r)
            continue
        progress(f"[{idx}/{len(cfgs)}] {_label(c)} skipped: {r['skipped']}")
        results.append(r)
    return {"machine": _machine(), "date": datetime.date.today().isoformat(), "quick": quick,
            "results": results, "targets": targets(results)}


def _machine() -> str:
    import jax
    return (f"{platform.machine()} {os.cpu_count()} cores, {platform.processor() or 'cpu'}, "
            f"jax {jax.__version__}, load avg {os.getloadavg()[0]:.1f}")


def _find(results, **kw):
    for r in results:
        if all(r.get(k, False if k == "causal" else None) == v for k, v in kw.items()) \
                and "seconds" in r:
            return r
    return None


def targets(results) -> list[dict]:
    """Each target: name, measured value, threshold, met (True/False/None when not measured)."""
    out = []

    def add(name, value, goal, ok, fmt):
        out.append(dict(target=name, value=None if value is None else fmt(value), goal=goal,
                        met=None if value is None else bool(ok(value))))

    def t(**kw):
        r = _find(results, **kw)
        return None if r is None else r["seconds"]

    def ratio(a, b):
        return None if a is None or b is None else a / b

    ns = sorted({r["n"] for r in results if r["kind"] == "fwd"})
    big = max(ns)
    mid = 8192 if 8192 in ns else big
    add(f"fwd N={mid}: naive / tiled", ratio(t(kind="fwd", impl="naive", n=mid),
                                             t(kind="fwd", impl="tiled", n=mid)),
        ">= 5x", lambda x: x >= 5, lambda x: f"{x:.1f}x")
    if 16384 in ns:
        add("fwd N=16384: naive / tiled", ratio(t(kind="fwd", impl="naive", n=16384),
                                                t(kind="fwd", impl="tiled", n=16384)),
            ">= 8x", lambda x: x >= 8, lambda x: f"{x:.1f}x")
        r = _find(results, kind="fwd", impl="tiled", n=16384)
        add("fwd N=16384: tiled peak RSS", None if r is None else r["peak_rss_bytes"] / GB,
            "<= 1 GB", lambda x: x <= 1.0, lambda x: f"{x:.2f} GB")
    nx = 4096 if 4096 in ns else big
    add(f"fwd N={nx}: xla / tiled", ratio(t(kind="fwd", impl="xla", n=nx),
                                          t(kind="fwd", impl="tiled", n=nx)),
        ">= 2.5x", lambda x: x >= 2.5, lambda x: f"{x:.1f}x")
    # The rate and causal targets come from the rate child at the default blocks, which
    # alternates the calls they divide in one process.
    rate = _find(results, kind="rate", impl="tiled", n=mid, block_q=None, block_k=None)
    if rate is not None:
        mm, tr = dict(flops=rate["matmul_flops"], seconds=rate["matmul_seconds"]), rate
    else:
        mm, tr = _find(results, kind="matmul"), _find(results, kind="fwd", impl="tiled", n=mid)
    add(f"fwd N={mid}: tiled FLOP rate / matmul rate",
        None if mm is None or tr is None else
        (tr["flops"] / tr["seconds"]) / (mm["flops"] / mm["seconds"]),
        ">= 60%", lambda x: x >= 0.6, lambda x: f"{100 * x:.0f}%")
    add(f"fwd N={mid}: causal / non-causal (alternating)",
        None if rate is None else rate["causal_seconds"] / rate["seconds"],
        "<= 0.6x", lambda x: x <= 0.6, lambda x: f"{x:.2f}x")
    nb = 4096 if _find(results, kind="fwdbwd", n=4096) else max(
        [r["n"] for r in results if r["kind"] == "fwdbwd"] or [big])
    add(f"fwd+bwd N={nb} / fwd", ratio(t(kind="fwdbwd", impl="tiled", n=nb),
                                       t(kind="fwd", impl="tiled", n=nb)),
        "<= 4x", lambda x: x <= 4, lambda x: f"{x:.2f}x")
    r = _find(results, kind="fwdbwd", impl="tiled", n=8192)
    if r is not None or not any(x.get("quick") for x in results):
        add("fwd+bwd N=8192: tiled peak RSS", None if r is None else r["peak_rss_bytes"] / GB,
            "<= 1.5 GB", lambda x: x <= 1.5, lambda x: f"{x:.2f} GB")
    return out


def _rate(r, call: str = "") -> float:
    """FLOP/s of one of a rate row's calls: ``""`` (the tiled forward), ``"causal"`` (half its
    FLOPs), ``"ceiling"`` (the probe does every tile's two matmuls: the forward's count) or
    ``"matmul"``."""
    flops = {"": r["flops"], "causal": r["flops"] / 2, "ceiling": r["flops"],
             "matmul": r["matmul_flops"]}[call]
    return flops / r[f"{call}_seconds" if call else "seconds"]


def _blocks(r) -> str:
    from flashlab.ladder.tiled_schedule import block_sizes as _block_sizes
    bq, bk = _block_sizes(r.get("block_q"), r.get("block_k"), r["n"], r["n"])
    return f"{bq}x{bk}"


def markdown(report: dict) -> str:
    """The results, the targets and (with ``--sweep``) the block-size table, as markdown
    (what chapter 03 stores)."""
    lines = [f"Machine: {report['machine']}; date {report['date']}.", "",
             "| config | time | GFLOP/s | peak RSS |", "|---|---|---|---|"]
    rates = [r for r in report["results"] if r["kind"] == "rate" and "seconds" in r]
    for r in report["results"]:
        if r["kind"] == "rate" and r.get("block_q") is not None:
            continue                                         # sweep rows: the table below
        if "seconds" not in r:
            lines.append(f"| {_label(r).strip()} | skipped: {r.get('skipped') or r.get('error')}"
                         f" | | |")
            continue
        lines.append(f"| {_label(r).strip()} | {r['seconds'] * 1e3:.1f} ms | "
                     f"{r['flops'] / r['seconds'] / 1e9:.1f} | {r['peak_rss_bytes'] / GB:.2f} GB |")
        if r["kind"] == "rate":
            for call, name in (("causal", f"tiled N={r['n']} causal"),
                               ("ceiling", f"matmuls N={r['n']} (the loop's matmuls alone)"),
                               ("matmul", f"matmul N={r['matmul_n']} (square)")):
                lines.append(f"| rate   {name}, alternating | {r[f'{call}_seconds'] * 1e3:.1f} ms"
                             f" | {_rate(r, call) / 1e9:.1f} | |")
    lines += ["", "| target | measured | goal | met |", "|---|---|---|---|"]
    for t in report["targets"]:
        met = {True: "yes", False: "**no**", None: "not measured"}[t["met"]]
        lines.append(f"| {t['target']} | {t['value']} | {t['goal']} | {met} |")
    main = next((r for r in rates if r.get("block_q") is None), None)
    if main is not None:
        tiled, ceiling, matmul = (_rate(main, c) for c in ("", "ceiling", "matmul"))
        lines += ["", f"Ceiling: the tiled loop's two matmuls per tile alone (no softmax) at "
                  f"N={main['n']} run at {ceiling / 1e9:.1f} GFLOP/s, "
                  f"{100 * ceiling / matmul:.0f}% of the matmul rate; the tiled forward "
                  f"reaches {100 * tiled / ceiling:.0f}% of that ceiling (all alternating in "
                  f"one process)."]
    if len(rates) > 1:
        lines += ["", f"Block sizes at N={rates[0]['n']} (each row one process alternating "
                  f"its four calls; % of that row's square-matmul rate):", "",
                  "| block_q x block_k | tiled GFLOP/s | tiled % | loop's matmuls % "
                  "| causal / non-causal |", "|---|---|---|---|---|"]
        for r in rates:
            mm = _rate(r, "matmul")
            tag = " (default)" if r.get("block_q") is None else ""
            lines.append(f"| {_blocks(r)}{tag} | {_rate(r) / 1e9:.1f} | "
                         f"{100 * _rate(r) / mm:.0f}% | {100 * _rate(r, 'ceiling') / mm:.0f}% | "
                         f"{r['causal_seconds'] / r['seconds']:.2f}x |")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:
        return _child_main(argv[1])
    p = argparse.ArgumentParser(prog="python -m flashlab bench tiled", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small N only (under a minute)")
    p.add_argument("--sweep", action="store_true",
                   help="also run the rate child at other block sizes (about 2 more minutes)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = p.parse_args(argv)
    report = run(quick=args.quick, sweep=args.sweep, progress=print)
    print()
    print(markdown(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
