"""flashlab.instruments.ring_overlap reads the send/compute order off a compiled schedule (no devices)."""
from flashlab.instruments.ring_overlap import schedule, send_overlap

ASYNC = """HloModule m

%body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %p = (s32[], f32[4]) parameter(0)
  %x = f32[4]{0} get-tuple-element(%p), index=1
  %start = (f32[4]{0}, f32[4]{0}) collective-permute-start(%x), channel_id=1, source_target_pairs={{0,1},{1,0}}
  %conditional.1 = (f32[4]{0}) conditional(%pred, %x, %x), true_computation=%a, false_computation=%b
  %fusion.2 = f32[4]{0} fusion(%conditional.1), kind=kLoop, calls=%f
  %done = f32[4]{0} collective-permute-done(%start)
  ROOT %t = (s32[], f32[4]) tuple(%i, %done)
}

ENTRY %main (a: f32[4]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  %cp = f32[4]{0} collective-permute(%a), channel_id=2, source_target_pairs={{0,1},{1,0}}
  %fusion.9 = f32[4]{0} fusion(%a), kind=kLoop, calls=%g
  ROOT %add = f32[4]{0} add(%cp, %fusion.9)
}
"""


def test_async_pair_and_sync_send():
    comps = schedule(ASYNC)
    assert set(comps) == {"body", "main"}
    rows = {r["send"]: r for r in send_overlap(ASYNC)}
    a, s = rows["start"], rows["cp"]
    assert a["kind"] == "async" and a["needed_by"] == "collective-permute-done"
    assert a["compute_between"] == ["conditional.1", "fusion.2"]
    assert s["kind"] == "sync" and s["needed_by"] == "add" and s["compute_between"] == ["fusion.9"]


_CPU_RING = """
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, jax.numpy as jnp
from flashlab.scale.ring import ring_attention
from flashlab.instruments import ring_overlap
mesh = jax.make_mesh((4,), ("sp",))
x = jnp.ones((1, 32, 1, 8), jnp.float32)
ring = lambda q, k, v: ring_attention(q, k, v, mesh=mesh, axis_name="sp", is_causal=True,
                                      layout="contiguous")
grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(ring(q, k, v)), argnums=(0, 1, 2)))
rows = ring_overlap.send_overlap(grad.lower(x, x, x).compile().as_text())
print(repr(ring_overlap.block_computes_in_flight(rows)))
"""


def test_ring_sends_forward_and_backward_have_the_block_compute_in_flight():
    """The compiled forward+backward ring (XLA:CPU, 4 simulated devices, one chunk pair per
    step): in the forward loop body both sends (K, V), and in the backward loop body all
    four (K, V and the dK/dV accumulators), are issued before the step's block compute and
    needed only after it. A fresh interpreter, since the device count is fixed at import."""
    import ast
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    path = os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path)
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "-c", _CPU_RING], env=env, capture_output=True,
                          text=True, timeout=300, cwd=root)
    assert proc.returncode == 0, proc.stderr[-4000:]
    per_comp = ast.literal_eval(proc.stdout.strip().splitlines()[-1])
    # The loop bodies (every computation but the entry): the forward's sends K and V, the
    # backward's K, V, dK and dV. Each send has the step's block compute (a lax.cond) between
    # its issue and its first use. (Before the backward was pipelined it read [1, 1, 0, 0].)
    bodies = {c: v for c, v in per_comp.items() if not c.startswith("main")}
    assert sorted(map(len, bodies.values())) == [2, 4], per_comp
    assert all(min(v) >= 1 for v in bodies.values()), per_comp
