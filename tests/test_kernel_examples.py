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
