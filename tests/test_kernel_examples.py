"""Chapter 04's first kernels: a tiled add and a tiled matmul, in both interpret modes."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flashlab.contract import device
from flashlab.kernels import examples


@pytest.mark.parametrize("interpret", [True, "tpu"])
def test_tiled_add_and_matmul(interpret):
    mode = device.tpu_interpret_params() if interpret == "tpu" else True
    x = jax.random.normal(jax.random.key(0), (16, 256))
    np.testing.assert_array_equal(examples.tiled_add(x, x, interpret=mode), x + x)
    a = jax.random.normal(jax.random.key(1), (256, 256))
    b = jax.random.normal(jax.random.key(2), (256, 128))
    ref = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
    got = examples.tiled_matmul(a, b, interpret=mode)
    assert np.abs(np.asarray(got) - ref).max() < 1e-3      # fp32 sums of 256 products


def test_bad_blocks():
    x = jnp.zeros((16, 256))
    with pytest.raises(ValueError, match="block_m, block_n"):
        examples.tiled_add(x, x, block_m=5)


def test_gather_blocks_follows_the_prefetched_table():
    x = jnp.arange(32 * 128, dtype=jnp.float32).reshape(32, 128)
    perm = np.array([3, 0, 3, 1], np.int32)              # repeats allowed: a gather, not a sort
    got = examples.gather_blocks(x, perm, interpret=True)
    np.testing.assert_array_equal(got, x.reshape(4, 8, 128)[perm].reshape(32, 128))
    with pytest.raises(ValueError, match=r"perm: expected block indices in \[0, 4\), got \[4\]"):
        examples.gather_blocks(x, np.array([0, 1, 2, 4], np.int32), interpret=True)
    traced = jax.jit(lambda p: examples.gather_blocks(x, p, interpret=True))
    with pytest.raises(Exception, match=r"perm: expected block indices in \[0, 4\), got \[-1\]"):
        jax.block_until_ready(traced(np.array([0, 1, 2, -1], np.int32)))
    with pytest.raises(ValueError, match=r"perm: expected an integer array of shape \(4,\)"):
        examples.gather_blocks(x, np.zeros(3, np.int32), interpret=True)


def test_row_softmax_exercise_answer():
    x = jax.random.normal(jax.random.key(3), (16, 200)) * 30      # large logits: max subtracted
    x64 = np.asarray(x, np.float64)
    e = np.exp(x64 - x64.max(-1, keepdims=True))
    ref = e / e.sum(-1, keepdims=True)                         # float64 softmax
    got = examples.row_softmax(x, interpret=True)
    np.testing.assert_allclose(got, ref, atol=1e-6, rtol=0)
    np.testing.assert_allclose(got, jax.nn.softmax(x, axis=-1), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="block_m: expected a divisor"):
        examples.row_softmax(x, block_m=5)
