"""``layout="BNTH"``: heads-major arrays in and out, the same numbers as jax.nn's layout, and
(compiled for a TPU) no transposed copies of q, k, v or the output around the kernels."""
from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashlab
from conftest import random_qkv
from flashlab.instruments import tpu_compile

ATOL = 2e-5     # float32: the same kernels on swapped views, only summation order may differ


def _sw(x):
    return jnp.swapaxes(x, -3, -2)


@pytest.mark.parametrize("backend", ["reference", "tiled", "pallas_tpu"])
def test_bnth_equals_btnh_forward_and_gradients(backend):
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(x) for x in random_qkv(rng, 2, 40, 56, 4, 2, 64))   # GQA, T != S
    kw = {"is_causal": True, "backend": backend, "key_value_seq_lengths": jnp.array([56, 30])}

    def loss(layout, q, k, v):
        return jnp.sum(flashlab.attention(q, k, v, layout=layout, **kw) ** 2)

    want = flashlab.attention(q, k, v, **kw)
    got = flashlab.attention(_sw(q), _sw(k), _sw(v), layout="BNTH", **kw)
    assert got.shape == (2, 4, 40, 64)
    np.testing.assert_allclose(_sw(got), want, atol=ATOL, rtol=0)
    g_want = jax.grad(lambda *a: loss("BTNH", *a), argnums=(0, 1, 2))(q, k, v)
    g_got = jax.grad(lambda *a: loss("BNTH", *a), argnums=(0, 1, 2))(_sw(q), _sw(k), _sw(v))
    for a, b in zip(g_got, g_want):
        np.testing.assert_allclose(_sw(a), b, atol=ATOL * 10, rtol=0)


def test_bnth_unbatched_residual_and_kernel_entry():
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(x) for x in random_qkv(rng, 1, 24, 24, 2, 2, 32))
    out, lse = flashlab.attention(_sw(q)[0], _sw(k)[0], _sw(v)[0], layout="BNTH",
                                  return_residual=True)
    want, want_lse = flashlab.attention(q[0], k[0], v[0], return_residual=True)
    assert out.shape == (2, 24, 32) and lse.shape == (2, 24)     # [heads, seq(, head_dim)]
    np.testing.assert_allclose(_sw(out), want, atol=ATOL, rtol=0)
    np.testing.assert_allclose(lse.T, want_lse, atol=ATOL, rtol=0)
    got = flashlab.flash_attention(_sw(q), _sw(k), _sw(v), layout="BNTH", interpret=True)
    np.testing.assert_allclose(_sw(got), flashlab.attention(q, k, v), atol=ATOL, rtol=0)


def test_bad_layouts_are_refused():
    q = jnp.zeros((1, 8, 2, 16))
    with pytest.raises(ValueError, match=r"layout: expected one of \('BTNH', 'BNTH'\).*got 'bhtd'"):
        flashlab.attention(q, q, q, layout="bhtd")
    with pytest.raises(ValueError, match=r"layout: expected one of"):
        flashlab.flash_attention(q, q, q, layout=None)
    with pytest.raises(ValueError, match=r"layout='BNTH': expected \[batch, heads, seq, "
                                         r"head_dim\].*got shape \(8, 16\)"):
        flashlab.attention(q[0, :, 0], q[0, :, 0], q[0, :, 0], layout="BNTH")


def _copies(hlo: str) -> int:
    """Transposes and copies in a compiled TPU module (the layout changes XLA makes in HBM)."""
    return (len(re.findall(r"= \S+ (?:transpose|copy)\(", hlo))
            + len(re.findall(r"%copy\S*fusion\S* = ", hlo)))


@pytest.mark.tpu_compile
@pytest.mark.skipif(not tpu_compile.available()
                    and os.environ.get("FLASHLAB_REQUIRE_LIBTPU") != "1",
                    reason=f"libtpu (the TPU compiler) is not installed: {tpu_compile.INSTALL}")
def test_bnth_compiles_without_transposed_copies():
    """The real compiler, v5e: with "BNTH" the forward kernel reads the caller's arrays in
    place (XLA cancels the two swaps), with "BTNH" q, k, v and the output are copied; the
    gradient program keeps fewer copies too. (At B=2, T=8192, N=16, d=128, bf16 the forward's
    bytes accessed, XLA's cost analysis, go from 1.54 GB to 0.74 GB; the grad's 6.54 to 5.20.)"""
    B, T, N, D = 1, 1024, 4, 128
    found = {}
    for layout, shape in (("BTNH", (B, T, N, D)), ("BNTH", (B, N, T, D))):
        f = lambda q, k, v, layout=layout: flashlab.attention(  # noqa: E731
            q, k, v, is_causal=True, backend="pallas_tpu", layout=layout)
        g = jax.grad(lambda *a, f=f: jnp.sum(f(*a).astype(jnp.float32)), argnums=(0, 1, 2))
        for name, fn in (("fwd", f), ("grad", g)):
            r = tpu_compile.compile(fn, *[jax.ShapeDtypeStruct(shape, jnp.bfloat16)] * 3,
                                    chip="v5e")
            assert r.ok, r.error
            found[layout, name] = (_copies(r.compiled.as_text()), r.cost["bytes accessed"])
    assert found["BNTH", "fwd"][0] == 0 and found["BTNH", "fwd"][0] >= 4, found
    assert found["BNTH", "grad"][0] < found["BTNH", "grad"][0], found
    for name in ("fwd", "grad"):
        assert found["BNTH", name][1] < found["BTNH", name][1], found
