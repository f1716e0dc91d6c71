"""``python -m flashlab bench``: every available backend over a grid of shapes, on this device.

For each (backend, seq_len, head_dim, dtype, causal) it reports the median forward time,
achieved FLOP/s (``4·B·H·N²·d``, halved when causal), the fraction of the device's peak
(measured matmul peak on CPU/GPU, the chip table below on TPU), and the compiled peak memory
(XLA's ``memory_analysis``). Kernels that cannot compile here run only with ``--interpret``,
and their times then measure the interpreter, not the kernel.

Subcommands: ``python -m flashlab bench tiled ...`` runs ``flashlab.benchmarks.tiled.main(argv)``;
``bench tpu-static`` runs ``flashlab.benchmarks.tpu_static`` (the TPU compiler's static schedule);
``bench tpu-blocks`` ranks its stored runs into the default-blocks table.
``bench generate`` runs ``flashlab.benchmarks.generate.main(argv)`` (KV cache vs recompute).
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from flashlab.contract import device
from flashlab.instruments import measure
from flashlab.dispatch import registry
from flashlab.contract.masks import validate

__all__ = ["main", "run", "attention_flops", "device_peak_flops", "TPU_PEAK_BF16_FLOPS",
           "SUBCOMMANDS"]

# Peak dense bf16 matmul FLOP/s per chip (vendor figures), keyed by a substring of
# jax.Device.device_kind. Minimal on purpose: flashlab.instruments.roofline holds the full chip table.
TPU_PEAK_BF16_FLOPS = {
    "v4": 275e12,
    "v5 lite": 197e12, "v5e": 197e12,
    "v5p": 459e12, "v5": 459e12,
    "v6 lite": 918e12, "v6e": 918e12,
    "7x": 2307e12,
}

SUBCOMMANDS = {"tiled": "flashlab.benchmarks.tiled", "tpu-static": "flashlab.benchmarks.tpu_static",
               "generate": "flashlab.benchmarks.generate", "ring": "flashlab.benchmarks.ring",
               "decode-static": "flashlab.benchmarks.decode_static",
               "tpu-blocks": "flashlab.benchmarks.tpu_blocks"}

QUICK_SEQ_LENS = (128, 256, 512)


def attention_flops(batch, heads, q_len, kv_len, head_dim, causal) -> float:
    """Forward FLOPs: two matmuls of ``2·N·M·d`` each per (batch, head); causal halves them."""
    f = 4.0 * batch * heads * q_len * kv_len * head_dim
    return f / 2 if causal else f


def device_peak_flops(dtype) -> tuple[float, str]:
    """``(peak FLOP/s, how it was obtained)`` for ``dtype`` on the default device."""
    plat = device.platform()
    if plat == "tpu":
        kind = jax.devices()[0].device_kind.lower()
        for key in sorted(TPU_PEAK_BF16_FLOPS, key=len, reverse=True):
            if key in kind:
                return TPU_PEAK_BF16_FLOPS[key], f"chip table ({kind}, bf16)"
        return float("nan"), f"chip {kind!r} not in the table"
    n = 1024 if plat == "cpu" else 8192
    a = jnp.ones((n, n), dtype)
    f = jax.jit(lambda a, b: a @ b)
    t = measure.time_fn(f, a, a, repeats=5)
    return 2.0 * n ** 3 / t, f"measured {n}x{n} {jnp.dtype(dtype).name} matmul"


def _fmt_time(s):
    return f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.2f} s"


def _fmt_rate(r):
    return f"{r / 1e9:.1f} GFLOP/s" if r < 1e12 else f"{r / 1e12:.2f} TFLOP/s"


def _fmt_mem(b):
    return f"{b / 2**20:.1f} MiB" if b < 2**30 else f"{b / 2**30:.2f} GiB"


def run(*, backends=None, seq_lens=None, head_dims=None, dtypes=None, causals=(False, True),
        batch=None, heads=None, interpret=False, repeats=5, progress=True):
    """Measure; returns a list of row dicts (the JSON the CLI writes)."""
    sizes = device.problem_sizes()
    seq_lens = tuple(seq_lens or sizes.seq_lens)
    head_dims = tuple(head_dims or (sizes.head_dim,))
    plat = device.platform()
    dtypes = tuple(dtypes or (("float32",) if plat == "cpu" else ("bfloat16",)))
    batch = sizes.batch if batch is None else batch
    heads = sizes.heads if heads is None else heads
    for name, vals in (("batch", [batch]), ("heads", [heads]), ("repeats", [repeats]),
                       ("seq_lens", seq_lens), ("head_dims", head_dims)):
        for n in vals:
            if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
                raise ValueError(f"{name}: expected positive ints, got {n!r}")
    names = list(backends or [b.name for b in registry.backends()])
    grid = [(n, t, d, dt, c) for n in names for dt in dtypes for d in head_dims
            for c in causals for t in seq_lens]
    peaks = {dt: device_peak_flops(jnp.dtype(dt)) for dt in dtypes}
    mem_limit = measure.device_memory_bytes()
    rows, skipped = [], []
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(grid), desc="bench", unit="case", file=sys.stderr)
    for name, T, D, dt, causal in grid:
        if bar is not None:
            bar.set_postfix_str(f"{name} N={T}")
            bar.update(1)
        b = registry.get(name)
        shape = (batch, T, heads, D)
        q = k = v = jnp.zeros(shape, dt)
        _, _, _, spec = validate(q, k, v, is_causal=causal)
        why = b.availability()
        if why is None:
            why = "; ".join(b.unsupported(spec, plat, bool(interpret))) or None
        # Materializing backends: guard the [B, H, N, N] score matrix (fp32, ~3 copies).
        if why is None and name in ("reference", "xla") and \
                3 * 4 * batch * heads * T * T > mem_limit // 2:
            why = "score matrix would not fit in half the device memory"
        if why:
            skipped.append((name, T, why))
            continue
        rng = np.random.default_rng(0)
        q, k, v = (jnp.asarray(rng.standard_normal(shape), dt) for _ in range(3))
        mode = b.mode(plat, bool(interpret))
        fn = jax.jit(lambda q, k, v, _n=name, _c=causal: registry.get(_n).fn(
            q, k, v, validate(q, k, v, is_causal=_c)[3], interpret=bool(interpret)))
        try:
            secs = measure.time_fn(fn, q, k, v, repeats=repeats)
            try:
                mem = measure.compiled_memory_bytes(fn, q, k, v)["peak"]
            except RuntimeError:
                mem = None
        except Exception as e:  # noqa: BLE001 - report, keep benchmarking the rest
            skipped.append((name, T, f"failed: {type(e).__name__}: {str(e)[:120]}"))
            continue
        flops = attention_flops(batch, heads, T, T, D, causal)
        peak, peak_src = peaks[dt]
        rows.append(dict(backend=name, seq_len=T, head_dim=D, dtype=dt, causal=causal,
                         batch=batch, heads=heads, seconds=secs, flops_per_s=flops / secs,
                         fraction_of_peak=(flops / secs) / peak, peak_flops_per_s=peak,
                         peak_source=peak_src, peak_memory_bytes=mem, mode=mode,
                         platform=plat))
    if bar is not None:
        bar.close()
    return rows, skipped


def format_table(rows) -> str:
    head = ("backend", "N", "d", "dtype", "causal", "mode", "time", "achieved", "of peak",
            "peak mem")
    lines = [[r["backend"], str(r["seq_len"]), str(r["head_dim"]), r["dtype"],
              "yes" if r["causal"] else "no", r["mode"], _fmt_time(r["seconds"]),
              _fmt_rate(r["flops_per_s"]), f"{100 * r['fraction_of_peak']:.1f}% of peak",
              "-" if r["peak_memory_bytes"] is None else _fmt_mem(r["peak_memory_bytes"])]
             for r in rows]
    widths = [max(len(h), *(len(l[i]) for l in lines)) if lines else len(h)
              for i, h in enumerate(head)]
    fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths))
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(l) for l in lines])


def _positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (0 and negatives are refused, never a silent default)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {n}")
    return n


def _backend_name(text: str) -> str:
    """argparse type: a registered backend name."""
    known = [b.name for b in registry.backends()]
    if text not in known:
        raise argparse.ArgumentTypeError(f"unknown backend {text!r}; expected one of {known}")
    return text


def _parser():
    sizes = "default: this platform's problem size, flashlab.contract.device.problem_sizes()"
    p = argparse.ArgumentParser(
        prog="python -m flashlab bench",
        description="Benchmark the available attention backends on this device: median "
                    "forward time, achieved FLOP/s, fraction of the device's peak and compiled "
                    "peak memory per (backend, N, d, dtype, causal). Subcommands: "
                    + ", ".join(f"'bench {k}' ({v})" for k, v in SUBCOMMANDS.items()))
    p.add_argument("--backends", nargs="+", type=_backend_name, metavar="NAME",
                   help="backend names to run (default: every registered backend; those that "
                        "cannot run here are listed as skipped, with the reason)")
    p.add_argument("--seq-lens", nargs="+", type=_positive_int, metavar="N",
                   help=f"sequence lengths N, positive (T = S = N; {sizes})")
    p.add_argument("--head-dims", nargs="+", type=_positive_int, metavar="D",
                   help=f"head dims d, positive ({sizes})")
    p.add_argument("--dtype", nargs="+", choices=["float32", "bfloat16", "float16"],
                   help="input dtypes (default: float32 on CPU, bfloat16 elsewhere)")
    p.add_argument("--causal", choices=["both", "yes", "no"], default="both",
                   help="causal masking: both (default), yes or no")
    p.add_argument("--batch", type=_positive_int, metavar="B",
                   help=f"batch size, positive ({sizes})")
    p.add_argument("--heads", type=_positive_int, metavar="H",
                   help=f"number of heads, positive ({sizes})")
    p.add_argument("--repeats", type=_positive_int, default=5, metavar="R",
                   help="timed calls per case, positive; the median is reported (default: 5)")
    p.add_argument("--quick", action="store_true",
                   help=f"a small grid (N in {QUICK_SEQ_LENS}, causal only, 3 repeats)")
    p.add_argument("--interpret", action="store_true",
                   help="also run Pallas kernels that cannot compile here, interpreted "
                        "(their times measure the interpreter, not the kernel)")
    p.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a figure (png/svg/pdf)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar on stderr (for logs and CI)")
    return p


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:
        modname = SUBCOMMANDS[argv[0]]
        if importlib.util.find_spec(modname) is None:
            print(f"bench {argv[0]}: {modname} is not on this checkout", file=sys.stderr)
            return 2
        return importlib.import_module(modname).main(argv[1:]) or 0
    a = _parser().parse_args(argv)   # bad values: a usage message and exit status 2
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[a.causal]
    seq_lens, repeats = a.seq_lens, a.repeats
    if a.quick:
        seq_lens = seq_lens or QUICK_SEQ_LENS
        causals = causals if a.causal != "both" else (True,)
        repeats = min(repeats, 3)
    info = device.describe()
    print(f"device: {info['platform']} ({info['device_kind']}), jax {jax.__version__}")
    rows, skipped = run(backends=a.backends, seq_lens=seq_lens, head_dims=a.head_dims,
                        dtypes=a.dtype, causals=causals, batch=a.batch, heads=a.heads,
                        interpret=a.interpret, repeats=repeats, progress=not a.no_progress)
    if rows:
        print(f"batch={rows[0]['batch']} heads={rows[0]['heads']}; peak: "
              + "; ".join(sorted({f"{r['dtype']}: {_fmt_rate(r['peak_flops_per_s'])} "
                                  f"({r['peak_source']})" for r in rows})))
    print(format_table(rows))
    modes = sorted({r["mode"] for r in rows})
    print("modes:", ", ".join(modes) or "-")
    if any(m.startswith("interpret") for m in modes):
        print("note: interpret-mode times measure the Pallas interpreter on this host, "
              "not kernel speed")
    by_reason = {}
    for name, T, why in skipped:
        by_reason.setdefault((name, why), []).append(T)
    for (name, why), Ts in by_reason.items():
        why = why.replace("pass interpret=True", "pass --interpret")   # the CLI's spelling
        print(f"skipped {name} (N={','.join(map(str, sorted(set(Ts))))}): {why}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
        print(f"wrote {len(rows)} rows to {a.json}")
    if a.plot:
        from flashlab.viz.bench import bench_figure
        bench_figure(rows).savefig(a.plot, dpi=100, bbox_inches="tight")
        print(f"wrote figure to {a.plot}")
    return 0
