"""Is the ring's send in flight while it computes? Read it off the compiled program's schedule.

A compiled XLA module lists each computation's instructions in the order the scheduler chose.
For every ``collective-permute`` (the ring's ``ppermute``) this module finds, in that order,
what runs between the send being *issued* and its result being *needed*:

* an async pair (``collective-permute-start`` ... ``collective-permute-done``, what TPUs and
  GPUs emit): the instructions between start and done run while the transfer is in flight;
* a synchronous ``collective-permute`` (XLA:CPU): the transfer completes where it is issued,
  so nothing overlaps on CPU; what the schedule shows is the *order* -- issued before this
  step's compute, first used only by the next step -- which is what lets an async backend
  overlap it.

Works on ``jax.jit(f).lower(...).compile().as_text()`` from any backend.
"""
from __future__ import annotations

import re

__all__ = ["schedule", "send_overlap", "block_computes_in_flight", "loop_summary",
           "format_rows", "tpu_ring_schedule", "COMPUTE_OPS"]

#: Instructions that do real work (the rest is bookkeeping: tuples, slices, bitcasts, copies).
COMPUTE_OPS = ("fusion", "conditional", "custom-call", "dot", "convolution", "while", "call")

_INSTR = re.compile(r"^\s*(ROOT\s+)?%([\w.\-]+)\s*=\s*(.*?)\s([a-z][a-z0-9\-]*)\((.*)$")


def schedule(hlo_text: str) -> dict[str, list[dict]]:
    """``{computation: [{"name", "op", "operands"}, ...]}`` in scheduled order."""
    comps: dict[str, list[dict]] = {}
    current = None
    for line in hlo_text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            head = line.split()                     # [ENTRY] %name (params) -> type {
            current = head[1 if head[0] == "ENTRY" else 0].lstrip("%").split("(")[0]
            comps[current] = []
            continue
        m = _INSTR.match(line)
        if m and current is not None:
            args = m.group(5).split("), ")[0]
            comps[current].append({"name": m.group(2), "op": m.group(4),
                                   "operands": re.findall(r"%([\w.\-]+)", args)})
    return comps


def send_overlap(hlo_text: str) -> list[dict]:
    """One row per ring send: where it is issued, where it is needed, the compute in between.

    Row: ``computation``, ``send`` (instruction name), ``kind`` (``"async"``/``"sync"``),
    ``issued_at`` and ``needed_at`` (positions in the schedule; ``needed_at`` is the ``done``
    of an async pair, else the first instruction that reads the result), ``compute_between``
    (names of :data:`COMPUTE_OPS` instructions in between) and ``needed_by`` (that reader).
    """
    rows = []
    for comp, instrs in schedule(hlo_text).items():
        for i, x in enumerate(instrs):
            if x["op"] not in ("collective-permute", "collective-permute-start"):
                continue
            kind = "async" if x["op"].endswith("start") else "sync"
            users = [j for j, y in enumerate(instrs) if x["name"] in y["operands"]]
            if kind == "async":
                done = [j for j in users if instrs[j]["op"] == "collective-permute-done"]
                needed = done[0] if done else len(instrs)
            else:
                needed = users[0] if users else len(instrs)
            between = [y["name"] for y in instrs[i + 1:needed] if y["op"] in COMPUTE_OPS]
            rows.append({"computation": comp, "send": x["name"], "kind": kind, "issued_at": i,
                         "needed_at": needed, "compute_between": between,
                         "needed_by": instrs[needed]["op"] if needed < len(instrs) else None})
    return rows


def block_computes_in_flight(rows) -> dict[str, list[int]]:
    """``{computation: [block computes between issue and need, one per send]}``.

    A block compute is a ``conditional`` (the ring's ``lax.cond`` around each backend call).
    In the ring's loop bodies the forward has 2 sends (K, V) and the backward 4 (K, V, dK,
    dV); with ``n`` chunk pairs per step each should read ``n`` when the sends overlap."""
    out: dict[str, list[int]] = {}
    for r in rows:
        out.setdefault(r["computation"], []).append(
            sum(n.startswith("conditional") for n in r["compute_between"]))
    return out


def loop_summary(rows) -> str:
    """One line per loop body (every computation but the entry): its sends and the block
    computes in flight for each -- 2 sends is the forward ring (K, V), 4 the backward's (K, V,
    dK, dV)."""
    what = {2: "forward ring loop (K, V)", 4: "backward ring loop (K, V, dK, dV)"}
    bodies = [v for c, v in block_computes_in_flight(rows).items() if not c.startswith("main")]
    return "\n".join(f"{what.get(len(v), f'loop with {len(v)} sends')}: block computes in "
                     f"flight per send {v}" for v in sorted(bodies, key=len))


def tpu_ring_schedule(chip: str = "v5e", devices: int = 4, *, seq: int = 4096, heads: int = 4,
                      head_dim: int = 128, grad: bool = False) -> list[dict]:
    """:func:`send_overlap` of ring attention (our Pallas kernel on every step) compiled by the
    real TPU compiler for a ``devices``-chip slice of ``chip``
    (``flashlab.instruments.tpu_compile``: needs
    libtpu, no TPU). ``grad``: the forward+backward program instead of the forward alone."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    from flashlab.instruments import tpu_compile
    from flashlab.scale.ring import ring_attention
    mesh = tpu_compile.mesh(chip, (devices,), ("sp",))
    x = jax.ShapeDtypeStruct((1, seq, heads, head_dim), jnp.bfloat16)

    def ring(q, k, v):
        return ring_attention(q, k, v, mesh=mesh, axis_name="sp", backend="pallas_tpu",
                              interpret=False, is_causal=True)

    fn = ring if not grad else jax.grad(
        lambda q, k, v: jnp.sum(ring(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2))
    report = tpu_compile.compile(fn, x, x, x, chip=chip, num_devices=devices)
    report.raise_if_failed()
    return send_overlap(report.compiled.as_text())


def format_rows(rows) -> str:
    """One line per send: kind, where issued and needed, and the compute in between."""
    out = []
    for r in rows:
        conds = sum(n.startswith("conditional") for n in r["compute_between"])
        out.append(f"{r['send']:28s} {r['kind']:5s} issued at #{r['issued_at']}, needed at "
                   f"#{r['needed_at']} (by {r['needed_by']}): {len(r['compute_between'])} compute "
                   f"ops in between, {conds} of them block computes (lax.cond)")
    return "\n".join(out)


def main(argv=None) -> int:
    """``python -m flashlab.instruments.ring_overlap [--chip v5e] [--devices 4]``: the TPU schedules."""
    import argparse  # noqa: PLC0415
    p = argparse.ArgumentParser(prog="python -m flashlab.instruments.ring_overlap")
    p.add_argument("--chip", default="v5e")
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    a = p.parse_args(argv)
    for grad in (False, True):
        print(f"ring attention, {'forward+backward' if grad else 'forward'}, pallas_tpu, causal, "
              f"N={a.seq}, {a.devices}-chip {a.chip} (real TPU compiler, compile only):")
        rows = tpu_ring_schedule(a.chip, a.devices, seq=a.seq, grad=grad)
        print(format_rows(rows))
        print(loop_summary(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
