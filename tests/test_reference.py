"""The reference rung against the float64 oracle, and the oracle against jax.nn."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import flashlab
from flashlab.ladder.reference import naive_attention, naive_hbm_bytes, oracle_attention
from cases import MASK_OPTIONS, mask_kwargs
from conftest import random_qkv

# Stated tolerances (max abs error, unit-normal inputs, outputs of magnitude <= ~3):
FP32_ATOL = 2e-5      # float32 scores with HIGHEST-precision matmuls
BF16_ATOL = 3e-2      # bf16 inputs (8-bit mantissa), fp32 accumulation, output rounded to bf16


@settings(max_examples=12)   # ~3.5 s each on 2 cores; every option also has its own bf16 test
@given(B=st.integers(1, 2), T=st.integers(1, 40), S=st.integers(1, 40),
       K=st.sampled_from([1, 2]), G=st.sampled_from([1, 2, 3]), H=st.sampled_from([4, 8, 16]),
       option=st.sampled_from(MASK_OPTIONS), seed=st.integers(0, 2**16))
def test_reference_matches_oracle_fp32(B, T, S, K, G, H, option, seed):
    rng = np.random.default_rng(seed)
    N = K * G
    q, k, v = random_qkv(rng, B, T, S, N, K, H)
    kw = mask_kwargs(option, rng, B, T, S, N)
    if "segment_ids" in kw and not isinstance(kw["segment_ids"], tuple) and T != S:
        kw = {}
    out = naive_attention(q, k, v, **kw)
    assert out.dtype == jnp.float32 and out.shape == (B, T, N, H)
    np.testing.assert_allclose(out, oracle_attention(q, k, v, **kw), atol=FP32_ATOL, rtol=0)


@pytest.mark.parametrize("option", MASK_OPTIONS)
def test_reference_matches_oracle_bf16(option):
    rng = np.random.default_rng(1)
    B, T, S, N, K, H = 2, 24, 24, 4, 2, 16
    q, k, v = random_qkv(rng, B, T, S, N, K, H)
    kw = mask_kwargs(option, rng, B, T, S, N)
    qb, kb, vb = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    out = naive_attention(qb, kb, vb, **kw)
    assert out.dtype == jnp.bfloat16
    # the oracle sees the same bf16-rounded inputs: the error measured is the computation's
    ref = oracle_attention(*(np.asarray(x, np.float32) for x in (qb, kb, vb)), **kw)
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, atol=BF16_ATOL, rtol=0)


@pytest.mark.parametrize("kw", [{}, {"is_causal": True}, {"local_window_size": (3, 1)},
                                {"local_window_size": 2},
                                {"key_value_seq_lengths": np.array([5, 9], np.int32)}])
def test_oracle_agrees_with_jax_nn(kw):
    """Drop-in meaning: where every row sees a key, we equal jax.nn.dot_product_attention."""
    rng = np.random.default_rng(2)
    q, k, v = random_qkv(rng, 2, 12, 12, 4, 2, 8)
    expected = jax.nn.dot_product_attention(q, k, v, implementation="xla", **kw)
    np.testing.assert_allclose(oracle_attention(q, k, v, **kw), expected, atol=2e-6)
    np.testing.assert_allclose(naive_attention(q, k, v, **kw), expected, atol=2e-6)


def test_fully_masked_rows_are_zero_with_zero_finite_gradients():
    rng = np.random.default_rng(3)
    q, k, v = random_qkv(rng, 2, 8, 8, 2, 2, 8)
    mask = np.ones((2, 1, 8, 8), bool)
    mask[0, :, 3, :] = False                      # row 3 of batch 0 sees nothing
    kw = dict(mask=mask, key_value_seq_lengths=np.array([8, 0], np.int32))  # batch 1: no keys
    out = naive_attention(q, k, v, **kw)
    np.testing.assert_array_equal(out[0, 3], 0)
    np.testing.assert_array_equal(out[1], 0)
    grads = jax.grad(lambda q, k, v: (naive_attention(q, k, v, **kw) ** 2).sum() +
                     naive_attention(q, k, v, **kw).sum(), argnums=(0, 1, 2))(q, k, v)
    for g in grads:
        assert np.isfinite(np.asarray(g)).all()
    np.testing.assert_array_equal(grads[0][0, 3], 0)
    np.testing.assert_array_equal(grads[0][1], 0)
    np.testing.assert_array_equal(grads[1][1], 0)
    np.testing.assert_array_equal(grads[2][1], 0)


def test_gradients_match_oracle_finite_differences():
    """jax.grad of the reference against central differences of the float64 oracle."""
    rng = np.random.default_rng(4)
    q, k, v = random_qkv(rng, 1, 5, 6, 2, 1, 4)
    kw = dict(is_causal=True, logits_soft_cap=2.0)
    w = rng.standard_normal((1, 5, 2, 4))
    gq = jax.grad(lambda q: (naive_attention(q, k, v, **kw) * w).sum())(q)
    eps, fd = 1e-6, np.zeros_like(q, np.float64)
    for idx in np.ndindex(q.shape):
        qp, qm = q.astype(np.float64), q.astype(np.float64)
        qp[idx] += eps
        qm[idx] -= eps
        fd[idx] = ((oracle_attention(qp, k, v, **kw) - oracle_attention(qm, k, v, **kw)) * w).sum() / (2 * eps)
    np.testing.assert_allclose(gq, fd, rtol=1e-4, atol=1e-5)


def test_jit_and_vmap():
    rng = np.random.default_rng(5)
    q, k, v = random_qkv(rng, 3, 8, 8, 2, 2, 8)
    f = jax.jit(lambda q, k, v: naive_attention(q, k, v, is_causal=True))
    np.testing.assert_allclose(f(q, k, v), naive_attention(q, k, v, is_causal=True), atol=1e-6)
    per_row = jax.vmap(lambda q, k, v: naive_attention(q[None], k[None], v[None], is_causal=True)[0])
    np.testing.assert_allclose(per_row(q, k, v), f(q, k, v), atol=1e-6)


def test_naive_traffic_formula():
    b = naive_hbm_bytes(batch=1, heads=1, q_len=4, kv_len=4, head_dim=2, bytes_per_element=2)
    assert b["q_k_v_o"] == 4 * 4 * 2 * 2 and b["scores"] == 4 * 16 * 4
    assert b["total"] == b["q_k_v_o"] + b["scores"]
