"""flashlab.instruments.profiling: what XLA's cost model and a profiler trace can see."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flashlab.instruments import profiling
from flashlab.kernels import examples, flash_attention
from flashlab.compat.pallas import pl


def _matmul(x, y):
    return x @ y


def test_cost_report_counts_matmul_flops():
    x = jnp.ones((64, 32), jnp.float32)
    y = jnp.ones((32, 16), jnp.float32)
    rep = profiling.cost_report(_matmul, x, y)
    assert rep.platform == jax.devices()[0].platform
    assert rep.flops == pytest.approx(2 * 64 * 32 * 16, rel=0.01)
    assert rep.argument_bytes == (64 * 32 + 32 * 16) * 4
    assert rep.output_bytes == 64 * 16 * 4
    assert "MFLOP" in str(rep)


def _plain_copy(x):
    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          interpret=False)(x)


def test_tpu_cost_estimates_with_and_without():
    x = jnp.ones((8, 128), jnp.float32)
    assert profiling.tpu_cost_estimates(_plain_copy, x) == [None]     # no CostEstimate: blind
    est = profiling.tpu_cost_estimates(
        lambda x, y: examples.tiled_add(x, y, interpret=False), x, x)
    assert len(est) == 1
    want = {"flops": 8 * 128, "transcendentals": 0, "bytes_accessed": 3 * 8 * 128 * 4}
    assert {k: est[0][k] for k in want} == want     # newer JAX adds remote_bytes_transferred
    q = jnp.zeros((1, 256, 2, 64), jnp.float32)
    (fa,) = profiling.tpu_cost_estimates(lambda q: flash_attention(q, q, q, interpret=False), q)
    assert fa["flops"] > 0 and fa["bytes_accessed"] > 0 and fa["transcendentals"] > 0


def test_trace_summary_groups_by_named_scope():
    x = jnp.ones((16, 16))

    def f(x):
        with jax.named_scope("scores"):
            s = x @ x.T
        with jax.named_scope("softmax"):
            p = jax.nn.softmax(s)
        return p @ x

    with_scopes = profiling.trace_summary(f, x)
    assert "scores" in with_scopes and "softmax" in with_scopes
    without = profiling.trace_summary(lambda x: jax.nn.softmax(x @ x.T) @ x, x)
    assert not {"scores", "softmax"} & set(without)
    assert all(isinstance(v, int) and v > 0 for v in with_scopes.values())


def test_capture_trace_writes_files(tmp_path):
    f = jax.jit(lambda x: jnp.sin(x).sum())
    files = profiling.capture_trace(f, np.ones(8, np.float32), logdir=str(tmp_path), repeats=1)
    assert files and all(str(tmp_path) in p for p in files)
