"""The conformance suite: every registered backend, the same cases, the float64 oracle.

Each backend runs forward (fp32, bf16) and gradients through every mask option of
tests/cases.py, on self-attention, GQA and cross-attention shapes, with ragged lengths and
fully masked rows among the options. A case is skipped only when the backend's own
declaration excludes it (the skip reason quotes the declaration) or the backend is not
importable on this checkout. Backends that run in TPU interpret mode off-TPU (the official
kernels on CPU) are slow there, so they get a smaller set of cases; gradients of a backend
run by the generic Pallas interpreter get every mask option on one shape (INTERPRETED_GRAD).

Adding a backend: ``flashlab.registry.register(Backend(...))``, then pass this module.

Tolerances (unit-normal inputs, outputs of magnitude <= ~3):
  fp32 forward  max abs error <= 2e-5
  bf16 forward  max abs error <= 3e-2 (8-bit mantissa inputs, fp32 accumulation, bf16 output;
                the oracle sees the same bf16-rounded inputs)
  fp32 grads    max abs error <= 1e-4 * max |oracle grad| (relative to the gradient's scale)
"""
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flashlab import device, registry
from flashlab.api import attention
from flashlab.masks import validate
from flashlab.reference import oracle_attention
from cases import MASK_OPTIONS, mask_kwargs
from conftest import random_qkv

FP32_ATOL = 2e-5
BF16_ATOL = 3e-2
GRAD_RTOL = 1e-4

PLATFORM = device.platform()
#               B   T   S   N  K  H
SHAPES = {"self": (2, 24, 24, 4, 4, 16),
          "gqa": (2, 24, 24, 4, 2, 16),
          "cross": (2, 16, 40, 4, 2, 16)}

# The cases a TPU-interpret-mode backend runs on CPU (each call takes ~1 s there).
SLOW_FWD = ("none", "causal", "window_pair", "seq_lengths", "kv_lengths_zero", "segments",
            "dense_mask", "bias", "soft_cap", "everything")
SLOW_GRAD = ("causal", "kv_lengths_zero", "segments")
SLOW_BF16 = ("causal", "segments")
# Gradients of a backend run by the generic Pallas interpreter off-TPU (three kernels traced
# and compiled per case, ~3 s each on CPU): every mask option on the GQA shape, and the
# options that meet MHA, cross-attention and ragged lengths on the other two shapes.
INTERPRETED_GRAD = {"gqa": MASK_OPTIONS,
                    "self": ("none", "causal", "kv_lengths_zero", "bias_broadcast"),
                    "cross": ("causal", "seq_lengths", "segments_pair", "everything")}


def _interpret_for(b: registry.Backend):
    """``True`` when the backend can run here only interpreted (and must be asked to)."""
    if b.mode(PLATFORM, None) is None and PLATFORM in b.interpret_platforms:
        return True
    return None


def _is_slow(b):
    return _interpret_for(b) is True and "TPU interpret" in b.interpret_kind


def _is_interpreted(b):
    """Runs here only through the generic Pallas interpreter (by default or when asked)."""
    mode = b.mode(PLATFORM, None) or b.mode(PLATFORM, True) or ""
    return "interpret" in mode and not _is_slow(b)


def _params(kind):
    out = []
    for b in registry.backends():
        slow = _is_slow(b)
        for shape in SHAPES:
            if kind == "fwd":
                opts = SLOW_FWD if slow else MASK_OPTIONS
                if slow and shape == "cross":
                    opts = ("none", "causal")
            elif kind == "grad":
                opts = SLOW_GRAD if slow else MASK_OPTIONS
                if slow and shape != "self":
                    opts = ()
                if _is_interpreted(b):
                    opts = INTERPRETED_GRAD[shape]
            else:  # bf16
                opts = SLOW_BF16 if slow else MASK_OPTIONS
                if shape != "self":
                    opts = () if slow else ("causal", "segments_pair", "kv_lengths_zero")
            for o in opts:
                out.append(pytest.param(b.name, shape, o, id=f"{b.name}-{shape}-{o}"))
    return out


def _seed(shape, option):
    return zlib.crc32(f"{shape}/{option}".encode()) % 2**16


def _case(shape, option, seed, dtype=np.float32):
    B, T, S, N, K, H = SHAPES[shape]
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, B, T, S, N, K, H)
    kw = mask_kwargs(option, rng, B, T, S, N)
    return q, k, v, kw


def _backend_or_skip(name, q, k, v, kw, *, need_grad=False):
    b = registry.get(name)
    missing = b.availability()
    if missing:
        pytest.skip(f"{name} unavailable: {missing}")
    _, _, _, spec = validate(q, k, v, **kw)
    interpret = _interpret_for(b)
    why = b.unsupported(spec, PLATFORM, interpret)
    if why:
        pytest.skip(f"{name} declares no support for {', '.join(why)} -- {b.declaration()}")
    if need_grad and not b.gradients:
        pytest.skip(f"{name} declares gradients=False -- {b.declaration()}")
    return interpret


def _empty_rows(q, k, kw):
    """Bool [B, T, N]: rows with no visible key (oracle lse == -inf)."""
    v1 = np.ones((*k.shape[:3], 1), np.float64)
    _, lse = oracle_attention(q, k, v1, **kw, return_lse=True)   # [B, N, T]
    return np.transpose(np.isneginf(lse), (0, 2, 1))


@pytest.mark.parametrize("name,shape,option", _params("fwd"))
def test_forward_fp32(name, shape, option):
    q, k, v, kw = _case(shape, option, seed=_seed(shape, option))
    interpret = _backend_or_skip(name, q, k, v, kw)
    out = attention(q, k, v, **kw, backend=name, interpret=interpret)
    assert out.shape == q.shape[:3] + (v.shape[3],) and out.dtype == jnp.float32
    ref = oracle_attention(q, k, v, **kw)
    np.testing.assert_allclose(np.asarray(out), ref, atol=FP32_ATOL, rtol=0)
    empty = _empty_rows(q, k, kw)
    np.testing.assert_array_equal(np.asarray(out)[empty], 0)   # exactly zero, not mean(V)


@pytest.mark.parametrize("name,shape,option", _params("bf16"))
def test_forward_bf16(name, shape, option):
    q, k, v, kw = _case(shape, option, seed=7 + _seed(shape, option))
    qb, kb, vb = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    interpret = _backend_or_skip(name, qb, kb, vb, kw)
    out = attention(qb, kb, vb, **kw, backend=name, interpret=interpret)
    assert out.dtype == jnp.bfloat16
    ref = oracle_attention(*(np.asarray(x, np.float32) for x in (qb, kb, vb)), **kw)
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, atol=BF16_ATOL, rtol=0)


def oracle_grads(q, k, v, dout, **kw):
    """Float64 gradients (dq, dk, dv) of ``sum(attention(q, k, v) * dout)``.

    The attention matrix P is read out of the float64 oracle itself (attention is linear in
    V, so V = identity returns P), then the textbook backward: dV = Pᵀ dO, dP = dO Vᵀ,
    D = rowsum(dP ∘ P), dS = P ∘ (dP − D), through the soft cap, then dQ = scale·dS K,
    dK = scale·dSᵀ Q; GQA sums over the query heads of each kv head.
    """
    q, k, v, dout = (np.asarray(x, np.float64) for x in (q, k, v, dout))
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    eye = np.broadcast_to(np.eye(S), (B, K, S, S)).transpose(0, 2, 1, 3)   # [B, S, K, S]
    P = oracle_attention(q, k, eye, **kw).transpose(0, 2, 1, 3)           # [B, N, T, S]
    kr, vr = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)
    scale = kw.get("scale") or 1 / np.sqrt(H)
    dv = np.einsum("bhts,bthd->bshd", P, dout)
    dP = np.einsum("bthd,bshd->bhts", dout, vr)
    dS = P * (dP - (dP * P).sum(-1, keepdims=True))
    cap = kw.get("logits_soft_cap")
    if cap is not None:
        s_raw = np.einsum("bthd,bshd->bhts", q, kr) * scale
        dS = dS * (1 - np.tanh(s_raw / cap) ** 2)
    dq = scale * np.einsum("bhts,bshd->bthd", dS, kr)
    dk = scale * np.einsum("bhts,bthd->bshd", dS, q)
    fold = lambda x: x.reshape(B, S, K, G, -1).sum(3)
    return dq, fold(dk), fold(dv)


@pytest.mark.parametrize("name,shape,option", _params("grad"))
def test_gradients_fp32(name, shape, option):
    q, k, v, kw = _case(shape, option, seed=11 + _seed(shape, option))
    interpret = _backend_or_skip(name, q, k, v, kw, need_grad=True)
    dout = np.random.default_rng(5).standard_normal(q.shape[:3] + (v.shape[3],)).astype(np.float32)
    loss = lambda q, k, v: jnp.sum(attention(q, k, v, **kw, backend=name, interpret=interpret)
                                   * dout)
    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    for label, g, ref in zip("qkv", grads, oracle_grads(q, k, v, dout, **kw)):
        g = np.asarray(g)
        assert np.isfinite(g).all(), f"d{label} has non-finite entries"
        err = np.abs(g - ref).max() / max(np.abs(ref).max(), 1e-6)
        assert err <= GRAD_RTOL, f"d{label}: relative error {err:.2e} > {GRAD_RTOL}"
    empty = _empty_rows(q, k, kw)
    np.testing.assert_array_equal(np.asarray(grads[0])[empty], 0)


@pytest.mark.parametrize("name", [b.name for b in registry.backends()])
def test_fully_masked_rows(name):
    """Rows masked by a dense mask and a batch row with no keys: zeros, zero finite grads."""
    B, T, N, H = 2, 16, 2, 8
    q, k, v = random_qkv(np.random.default_rng(3), B, T, T, N, N, H)
    mask = np.ones((B, 1, T, T), bool)
    mask[0, :, 3, :] = False
    kw = dict(mask=mask, key_value_seq_lengths=np.array([T, 0], np.int32))
    b = registry.get(name)
    if "mask" not in b.features and "seq_lengths" in b.features:
        kw.pop("mask")
    interpret = _backend_or_skip(name, q, k, v, kw, need_grad=True)
    f = lambda q, k, v: attention(q, k, v, **kw, backend=name, interpret=interpret)
    out = np.asarray(f(q, k, v))
    if "mask" in kw:
        np.testing.assert_array_equal(out[0, 3], 0)
    np.testing.assert_array_equal(out[1], 0)
    grads = jax.grad(lambda *a: (f(*a) ** 2).sum() + f(*a).sum(), argnums=(0, 1, 2))(q, k, v)
    for g in grads:
        assert np.isfinite(np.asarray(g)).all()
        np.testing.assert_array_equal(np.asarray(g)[1], 0)
