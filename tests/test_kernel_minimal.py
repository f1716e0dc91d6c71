"""The minimal flash forward kernel (flashlab.kernels.minimal) against the float64 oracle."""
import numpy as np
import pytest

from flashlab.contract import device
from flashlab import oracle_attention
from flashlab.kernels import minimal


@pytest.mark.parametrize("interpret", [True, "tpu"])
def test_minimal_kernel_matches_the_oracle(interpret):
    mode = device.tpu_interpret_params() if interpret == "tpu" else True
    rng = np.random.default_rng(0)
    B, H, N, d = 1, 1, 256, 128          # grid (1, 1, 2, 2): two query blocks x two kv blocks
    q, k, v = (rng.standard_normal((B, H, N, d)).astype(np.float32) for _ in range(3))
    out = minimal.minimal_flash_attention(q, k, v, block_q=128, block_k=128, interpret=mode)
    ref = oracle_attention(*(x.transpose(0, 2, 1, 3) for x in (q, k, v))).transpose(0, 2, 1, 3)
    np.testing.assert_allclose(np.asarray(out), ref, atol=2e-5, rtol=0)


def test_minimal_kernel_bad_blocks():
    q = np.zeros((1, 1, 256, 128), np.float32)
    with pytest.raises(ValueError, match="block_q, block_k"):
        minimal.minimal_flash_attention(q, q, q, block_q=96)
