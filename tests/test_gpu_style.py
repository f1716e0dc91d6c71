"""The GPU-shaped teaching kernel of chapter 08: correct in interpret mode; only the relaid
version satisfies the TPU (8, 128) block rule."""
import numpy as np
import pytest

from flashlab.kernels import gpu_style
from flashlab.ladder.reference import oracle_attention
from conftest import random_qkv


@pytest.mark.parametrize("fn", [gpu_style.gpu_style_attention,
                                gpu_style.gpu_style_attention_relaid])
@pytest.mark.parametrize("causal", [False, True])
def test_matches_oracle(fn, causal):
    q, k, v = random_qkv(np.random.default_rng(0), 1, 128, 128, 2, 2, 64)
    out = fn(q, k, v, is_causal=causal)
    np.testing.assert_allclose(np.asarray(out), oracle_attention(q, k, v, is_causal=causal),
                               atol=2e-5, rtol=0)


def test_literal_port_breaks_the_tiling_rule_and_relaid_lowers():
    q, k, v = random_qkv(np.random.default_rng(1), 1, 128, 128, 4, 4, 64)
    msg = gpu_style.tpu_lowering_error(gpu_style.gpu_style_attention, q, k, v)
    assert msg is not None and "divisible by 8 and 128" in msg and "/work" not in msg
    assert gpu_style.tpu_lowering_error(gpu_style.gpu_style_attention_relaid, q, k, v) is None


def test_bad_blocks_name_the_argument():
    q, k, v = random_qkv(np.random.default_rng(2), 1, 96, 96, 2, 2, 64)
    with pytest.raises(ValueError, match="block_q, block_k"):
        gpu_style.gpu_style_attention(q, k, v)
    q2, k2, _ = random_qkv(np.random.default_rng(2), 1, 64, 64, 2, 1, 64)
    with pytest.raises(ValueError, match="key: the GPU-style teaching kernel has no GQA"):
        gpu_style.gpu_style_attention(q2, k2, k2)
