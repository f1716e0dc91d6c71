"""flashlab.ladder.tiled against the float64 oracle and jax.grad of the reference.

Tolerances (unit-normal inputs):
  fp32 forward   max abs error <= 2e-5 vs the float64 oracle
  bf16 forward   max abs error <= 3e-2 (bf16 inputs, P cast to bf16 for P·V, bf16 output;
                 the oracle sees the same bf16-rounded inputs)
  fp32 gradients max abs error <= 1e-4 · max |reference gradient|
Small blocks (N not a multiple of them) so every test crosses blocks, padding and skipping.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flashlab.ladder.reference import naive_attention, oracle_attention
from flashlab.ladder.tiled import (
    block_tables, tiled_attention, tiled_attention_with_lse_from_spec, visit_ranges)
from flashlab.contract.masks import validate
from cases import MASK_OPTIONS, mask_kwargs
from conftest import random_qkv

FP32_ATOL, BF16_ATOL, GRAD_RTOL = 2e-5, 3e-2, 1e-4
#         B  T   S   N  K  H
SHAPES = [(2, 37, 37, 4, 2, 16), (1, 21, 50, 3, 1, 8), (2, 40, 24, 2, 2, 12)]
BLOCKS = dict(block_q=8, block_k=16)


# Every mask option on the GQA shape; the cross-attention shapes get a representative subset.
SUBSET = ("none", "causal", "window_pair", "seq_lengths", "kv_lengths_zero", "segments_pair",
          "dense_mask_per_head", "bias_broadcast", "everything")
FWD_CASES = [(o, 0) for o in MASK_OPTIONS] + [(o, si) for si in (1, 2) for o in SUBSET]


@pytest.mark.parametrize("option,si", FWD_CASES)
def test_forward_fp32_vs_oracle(option, si):
    B, T, S, N, K, H = SHAPES[si]
    rng = np.random.default_rng(100 * si + MASK_OPTIONS.index(option))
    q, k, v = random_qkv(rng, B, T, S, N, K, H)
    kw = mask_kwargs(option, rng, B, T, S, N)
    out = tiled_attention(q, k, v, **kw, **BLOCKS)
    assert out.dtype == jnp.float32 and out.shape == (B, T, N, H)
    ref, lse_ref = oracle_attention(q, k, v, **kw, return_lse=True)
    np.testing.assert_allclose(np.asarray(out), ref, atol=FP32_ATOL, rtol=0)
    _, _, _, spec = validate(q, k, v, **kw)
    _, lse = tiled_attention_with_lse_from_spec(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                                spec, **BLOCKS)
    np.testing.assert_allclose(np.asarray(lse), lse_ref, atol=FP32_ATOL, rtol=1e-6)


@pytest.mark.parametrize("option", ["none", "causal", "segments_pair", "kv_lengths_zero",
                                    "bias", "everything"])
def test_forward_bf16_vs_oracle(option):
    B, T, S, N, K, H = SHAPES[0]
    rng = np.random.default_rng(7)
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in random_qkv(rng, B, T, S, N, K, H))
    kw = mask_kwargs(option, rng, B, T, S, N)
    out = tiled_attention(q, k, v, **kw, **BLOCKS)
    assert out.dtype == jnp.bfloat16
    ref = oracle_attention(*(np.asarray(x, np.float32) for x in (q, k, v)), **kw)
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, atol=BF16_ATOL, rtol=0)


def _grads(fn, q, k, v, kw, dout):
    """Gradients of sum(fn(...) * dout) w.r.t. q, k, v (and bias when given)."""
    kw = dict(kw)
    bias = kw.pop("bias", None)
    args = (q, k, v) if bias is None else (q, k, v, bias)
    loss = lambda *a: jnp.sum(fn(*a[:3], *a[3:], **kw) * dout)
    return jax.grad(loss, argnums=tuple(range(len(args))))(*args)


@pytest.mark.parametrize("option", MASK_OPTIONS)
def test_gradients_vs_reference(option):
    B, T, S, N, K, H = SHAPES[0] if option != "segments_pair" else SHAPES[1]
    rng = np.random.default_rng(11 + MASK_OPTIONS.index(option))
    q, k, v = random_qkv(rng, B, T, S, N, K, H)
    kw = mask_kwargs(option, rng, B, T, S, N)
    dout = rng.standard_normal((B, T, N, H)).astype(np.float32)
    got = _grads(lambda *a, **k_: tiled_attention(*a, **k_, **BLOCKS), q, k, v, kw, dout)
    want = _grads(naive_attention, q, k, v, kw, dout)
    for name, g, r in zip(("dq", "dk", "dv", "dbias"), got, want):
        g, r = np.asarray(g), np.asarray(r)
        assert np.isfinite(g).all(), name
        err = np.abs(g - r).max() / max(np.abs(r).max(), 1e-6)
        assert err <= GRAD_RTOL, f"{name}: relative error {err:.2e}"


def test_lse_gradient():
    """The (out, lse) variant is differentiable in both outputs (for merging outside)."""
    B, T, S, N, K, H = SHAPES[1]
    q, k, v = random_qkv(np.random.default_rng(2), B, T, S, N, K, H)
    _, _, _, spec = validate(q, k, v, is_causal=True)

    def f(fn, q, k, v):
        out, lse = fn(q, k, v)
        return jnp.sum(out ** 2) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * 0.3)

    def ref(q, k, v):
        s = jnp.einsum("btnd,bsnd->bnts", q, jnp.repeat(k, N // K, 2)) * spec.scale
        s = jnp.where(jnp.tril(jnp.ones((T, S), bool)), s, -jnp.inf)
        return naive_attention(q, k, v, is_causal=True), jax.nn.logsumexp(s, axis=-1)

    tiled = lambda q, k, v: tiled_attention_with_lse_from_spec(q, k, v, spec, **BLOCKS)
    got = jax.grad(lambda *a: f(tiled, *a), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(lambda *a: f(ref, *a), argnums=(0, 1, 2))(q, k, v)
    for g, r in zip(got, want):
        assert np.abs(np.asarray(g) - r).max() <= GRAD_RTOL * np.abs(r).max()


def test_fully_masked_rows_zero_output_and_zero_finite_grads():
    B, T, N, H = 2, 20, 2, 8
    q, k, v = random_qkv(np.random.default_rng(3), B, T, T, N, N, H)
    mask = np.ones((B, 1, T, T), bool)
    mask[0, :, 3, :] = False
    kw = dict(mask=mask, key_value_seq_lengths=np.array([T, 0], np.int32))
    f = lambda q, k, v: tiled_attention(q, k, v, **kw, **BLOCKS)
    out = np.asarray(f(q, k, v))
    assert np.all(out[0, 3] == 0) and np.all(out[1] == 0)
    grads = jax.grad(lambda *a: (f(*a) ** 2).sum() + f(*a).sum(), argnums=(0, 1, 2))(q, k, v)
    for g in grads:
        g = np.asarray(g)
        assert np.isfinite(g).all() and np.all(g[1] == 0)
    assert np.all(np.asarray(grads[0])[0, 3] == 0)


def test_jit_vmap_and_grad_of_jit():
    B, T, S, N, K, H = SHAPES[0]
    q, k, v = random_qkv(np.random.default_rng(4), B, T, S, N, K, H)
    f = lambda q, k, v: tiled_attention(q, k, v, is_causal=True, **BLOCKS)
    ref = oracle_attention(q, k, v, is_causal=True)
    np.testing.assert_allclose(np.asarray(jax.jit(f)(q, k, v)), ref, atol=FP32_ATOL, rtol=0)
    # vmap over an extra leading axis (two independent problems).
    qs, ks, vs = (np.stack([x, x[::-1]]) for x in (q, k, v))
    outs = jax.vmap(f)(qs, ks, vs)
    np.testing.assert_allclose(np.asarray(outs[1]), oracle_attention(q[::-1], k[::-1], v[::-1],
                               is_causal=True), atol=FP32_ATOL, rtol=0)
    g1 = jax.grad(lambda q: jax.jit(f)(q, k, v).sum())(q)
    g2 = jax.jit(jax.grad(lambda q: f(q, k, v).sum()))(q)
    g3 = jax.grad(lambda q: naive_attention(q, k, v, is_causal=True).sum())(q)
    for g in (g1, g2):
        assert np.abs(np.asarray(g) - g3).max() <= GRAD_RTOL * np.abs(np.asarray(g3)).max()
    gv = jax.vmap(jax.grad(lambda q, k, v: f(q, k, v).sum()))(qs, ks, vs)
    assert np.abs(np.asarray(gv[0]) - g3).max() <= GRAD_RTOL * np.abs(np.asarray(g3)).max()


def test_default_blocks_and_block_larger_than_sequence():
    q, k, v = random_qkv(np.random.default_rng(5), 1, 70, 70, 2, 2, 8)
    ref = oracle_attention(q, k, v, local_window_size=(9, 3))
    for kw in ({}, dict(block_q=4096, block_k=3)):
        out = tiled_attention(q, k, v, local_window_size=(9, 3), **kw)
        np.testing.assert_allclose(np.asarray(out), ref, atol=FP32_ATOL, rtol=0)


@pytest.mark.parametrize("name,value,exc", [("block_q", 0, ValueError), ("block_k", -4, ValueError),
                                            ("block_q", 2.5, TypeError), ("block_k", True, TypeError),
                                            ("block_k", "64", TypeError)])
def test_bad_block_sizes_raise(name, value, exc):
    q, k, v = random_qkv(np.random.default_rng(0), 1, 8, 8, 1, 1, 4)
    with pytest.raises(exc, match=name):
        tiled_attention(q, k, v, **{name: value})


def test_block_skipping_tables():
    """Causal: q block i visits kv blocks 0..i only; window: a band; none are wasted."""
    maybe, full, lo, hi = block_tables(64, 64, 16, 16, is_causal=True)
    assert lo.tolist() == [0, 0, 0, 0] and hi.tolist() == [1, 2, 3, 4]
    assert not full.diagonal().any() and full[np.tril_indices(4, -1)].all()
    maybe, full, lo, hi = block_tables(64, 64, 16, 16, window=(16, 0))
    assert lo.tolist() == [0, 0, 1, 2] and hi.tolist() == [1, 2, 3, 4]
    maybe, full, _, _ = block_tables(40, 40, 16, 16)
    assert full[:, :2].all() and not full[:, 2].any()     # last kv block holds padding


def test_skipped_blocks_are_not_computed():
    """A jaxpr-level check: causal tiles visited = Tr·(Tr+1)/2, counted via the loop bounds."""
    maybe, _, lo, hi = block_tables(4096, 4096, 512, 512, is_causal=True)
    assert int((hi - lo).sum()) == 8 * 9 // 2 and int(maybe.sum()) == 36


def test_only_edge_tiles_are_masked():
    """Causal: of the Tr·(Tr+1)/2 visited tiles only the Tr diagonal ones pay for a mask; a
    window masks its two edges; a dense mask makes every visited tile masked."""
    maybe, full, _, _ = block_tables(64, 64, 16, 16, is_causal=True)
    lo, flo, fhi, hi = visit_ranges(maybe, full)
    assert lo.tolist() == [0] * 4 and hi.tolist() == [1, 2, 3, 4]
    assert flo.tolist() == [0] * 4 and fhi.tolist() == [0, 1, 2, 3]       # no first loop
    lo, flo, fhi, hi = visit_ranges(maybe.T, full.T)          # the backward walks kv blocks
    assert lo.tolist() == [0, 1, 2, 3] and hi.tolist() == [4] * 4
    assert flo.tolist() == [1, 2, 3, 3] and fhi.tolist() == [4, 4, 4, 3]
    maybe, full, _, _ = block_tables(64, 64, 16, 16, window=(40, 0))
    lo, flo, fhi, hi = visit_ranges(maybe, full)
    masked = (flo - lo) + (hi - fhi)
    assert masked.tolist() == [1, 1, 2, 3] and (fhi - flo).tolist() == [0, 1, 1, 1]
    assert (masked + fhi - flo).tolist() == maybe.sum(1).tolist()      # every visible tile
    lo, flo, fhi, hi = visit_ranges(maybe, full, all_masked=True)
    assert (flo == lo).all() and (fhi == lo).all()
