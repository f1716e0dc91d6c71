"""``python -m flashlab bench ring --step-model``: one ring step, measured vs modelled.

On ``P`` simulated CPU devices (one child process, ``c`` tokens per device, fp32), this times

* **compute**: one ring step's block -- the backend's forward of the local queries
  ``[1, c, H, d]`` against one K/V block ``[1, c, K, d]``, every entry visible (no mask), on
  all ``P`` devices at once (``shard_map``), as a ring step runs it;
* **send**: one ring step's ``ppermute`` of one K and one V block ``[1, c, K, d]`` to the
  neighbour -- exactly the bytes :func:`flashlab.instruments.comm_model.ring_step_bytes`
  counts (``bytes_per_element=4``);
* **step**: the whole forward ring (contiguous layout, no mask, so every step is one such
  block) divided by ``P``;

and sets next to them :func:`~flashlab.instruments.comm_model.ring_step_times` for the same
sizes, on a "chip" whose two numbers are **calibrated in the same run**: peak FLOP/s from a
``n x n`` fp32 matmul on every device at once, and "link" bytes/s from a ``ppermute`` of a
known, larger buffer (``--calib-mib`` per device). A CPU has no link: simulated devices share
one memory, so the "link" is a memory copy between buffers, and all devices share the cores.
The model is the TPU one (compute = FLOPs / peak, send = bytes / bandwidth, overlapped step =
``max``, serial step = sum); the ratios say how far a block's real cost is from those two
numbers here. Timings are medians of ``--repeats`` calls (wall clock, milliseconds).
"""
from __future__ import annotations

import math

__all__ = ["run_step_child", "step_rows", "step_table", "ASSUMPTIONS"]

#: What the modelled column assumes (printed with the table and stored with the run).
ASSUMPTIONS = (
    "model = flashlab.instruments.comm_model.ring_step_times on a RingChip calibrated in this "
    "run: peak FLOP/s = fp32 n x n matmul (2n^3 FLOPs) timed on all P devices at once, per "
    "device; link B/s = ppermute of a known buffer per device (one hop, all devices sending) "
    "timed the same way; mfu = 1; compute FLOPs = 2*B*H*c^2*(d + d_v) (no mask: "
    "work_fraction = 1); send bytes = B*c*K*(d + d_v)*4 (fp32); CPU simulated devices share "
    "cores and memory, so the 'link' is a memory copy; timings are wall-clock medians")


def run_step_child(a) -> dict:
    """In a fresh process with ``a.child`` simulated devices: calibrate, measure, model."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    from jax.sharding import NamedSharding  # noqa: PLC0415
    from jax.sharding import PartitionSpec as PS  # noqa: PLC0415

    from flashlab.compat.shard_map import shard_map
    from flashlab.contract.masks import validate
    from flashlab.instruments import comm_model
    from flashlab.instruments.measure import time_fn
    from flashlab.scale.ring import block_functions, ring_attention

    P, c, H, K, d = a.child, a.tokens_per_device, a.heads, a.kv_heads, a.head_dim
    if P < 2:
        raise ValueError(f"--devices: the step model needs a ring of >= 2 devices, got {P}")
    mesh = jax.make_mesh((P,), ("sp",))
    perm = [(j, (j + 1) % P) for j in range(P)]
    def on_all(f):                                # f on every device's shard [1, ...], jitted
        return jax.jit(shard_map(f, mesh=mesh, in_specs=PS("sp"), out_specs=PS("sp")))
    put = lambda x: jax.device_put(x, NamedSharding(mesh, PS("sp")))  # noqa: E731
    rng = np.random.default_rng(0)
    rand = lambda *s: put(rng.standard_normal(s).astype(np.float32))  # noqa: E731
    t = lambda f, *x: time_fn(f, *x, repeats=a.repeats)  # noqa: E731

    # Calibration 1: FLOP/s of an n x n fp32 matmul, every device at once.
    n = a.calib_matmul
    mm = on_all(lambda x, y: x[0] @ y[0])
    x = rand(P, n, n)
    t_mm = t(mm, x, x)
    flops = 2.0 * n ** 3 / t_mm
    # Calibration 2: bytes/s of one ppermute hop of a known buffer, every device sending.
    calib_bytes = int(a.calib_mib * 2 ** 20) // 4 * 4
    hop = on_all(lambda z: jax.lax.ppermute(z, "sp", perm))
    t_cal = t(hop, put(jnp.zeros((P, calib_bytes // 4), jnp.float32)))
    link = calib_bytes / t_cal
    chip = comm_model.RingChip("CPU (calibrated)", flops, link)

    # Measured: one step's block compute, one step's send, the whole step.
    q, k, v = rand(P, c, H, d), rand(P, c, K, d), rand(P, c, K, d)   # [P·1, c, ., d]
    blk_fwd, _ = block_functions(a.backend)
    local = lambda n: np.zeros((1, c, n, d), np.float32)  # noqa: E731 -- one device's shapes
    _, _, _, spec = validate(local(H), local(K), local(K))
    block = on_all(lambda q, k, v: blk_fwd(q, k, v, spec)[0])
    t_block = t(block, q, k, v)
    send = on_all(lambda k, v: jax.lax.ppermute((k, v), "sp", perm))
    t_send = t(send, k, v)
    t_floor = t(hop, put(jnp.zeros((P, 1), jnp.float32)))      # 4 bytes: the fixed cost of a call
    seq = NamedSharding(mesh, PS(None, "sp"))
    gq, gk, gv = (jax.device_put(np.asarray(x).reshape(1, P * c, *x.shape[2:]), seq)
                  for x in (q, k, v))                          # [1, N, ., d], N/P per device
    ring = jax.jit(lambda q, k, v: ring_attention(q, k, v, mesh=mesh, axis_name="sp",
                                                  backend=a.backend, layout="contiguous"))
    t_step = t(ring, gq, gk, gv) / P

    model = comm_model.ring_step_times(chip, batch=1, tokens_per_device=c, heads=H, kv_heads=K,
                                       head_dim=d, bytes_per_element=4)
    return {"P": P, "c": c, "N": P * c, "H": H, "K": K, "d": d, "backend": a.backend,
            "calibration": {"matmul_n": n, "matmul_s": t_mm, "flops_per_s": flops,
                            "ppermute_bytes": calib_bytes, "ppermute_s": t_cal,
                            "link_bytes_per_s": link},
            "step_flops": model["flops"], "step_bytes": model["bytes"],
            "measured": {"compute_s": t_block, "send_s": t_send, "step_s": t_step,
                         "send_4_bytes_s": t_floor},
            "modelled": {"compute_s": model["compute_s"], "send_s": model["comm_s"],
                         "step_overlapped_s": max(model["compute_s"], model["comm_s"]),
                         "step_serial_s": model["compute_s"] + model["comm_s"]}}


def step_rows(result: dict) -> list[dict]:
    """``[{quantity, measured_ms, modelled_ms, ratio}]`` from :func:`run_step_child`'s dict."""
    me, mo = result["measured"], result["modelled"]
    pairs = [("compute (one c x c block)", me["compute_s"], mo["compute_s"]),
             ("send (one K + one V block)", me["send_s"], mo["send_s"]),
             ("step vs model, overlapped (max)", me["step_s"], mo["step_overlapped_s"]),
             ("step vs model, serial (sum)", me["step_s"], mo["step_serial_s"])]
    rows = []
    for name, m, p in pairs:
        if not (math.isfinite(m) and math.isfinite(p)) or m <= 0 or p <= 0:
            raise ValueError(f"{name}: expected positive finite seconds, got measured {m!r}, "
                             f"modelled {p!r}")
        rows.append({"quantity": name, "measured_ms": m * 1e3, "modelled_ms": p * 1e3,
                     "ratio": m / p})
    return rows


def step_table(result: dict) -> str:
    """The markdown table and its conditions (what the chapter prints from the stored run)."""
    cal = result["calibration"]
    head = (f"P = {result['P']} simulated CPU devices, c = N/P = {result['c']} tokens per device, "
            f"H = {result['H']}, K = {result['K']}, d = {result['d']}, fp32, "
            f"backend = {result['backend']}\n"
            f"calibrated here: {cal['flops_per_s'] / 1e9:.2f} GFLOP/s per device "
            f"({cal['matmul_n']}^3 matmul), 'link' {cal['link_bytes_per_s'] / 1e9:.2f} GB/s "
            f"(ppermute of {cal['ppermute_bytes'] / 2**20:.0f} MiB per device)\n"
            f"per step: {result['step_flops'] / 1e6:.1f} MFLOP, "
            f"{result['step_bytes'] / 2**10:.0f} KiB sent per device; a 4-byte ppermute (the "
            f"fixed cost of one call, not in the model) measured "
            f"{result['measured']['send_4_bytes_s'] * 1e3:.3f} ms\n")
    out = ["| per ring step | measured ms | modelled ms | measured / modelled |",
           "|---|---|---|---|"]
    out += [f"| {r['quantity']} | {r['measured_ms']:.3f} | {r['modelled_ms']:.3f} "
            f"| {r['ratio']:.2f} |" for r in step_rows(result)]
    return head + "\n".join(out)
