"""The JAX-version compatibility subset (pytest marker ``compat``).

``python3 .ci/dev.py test`` runs these tests again in a venv with the oldest supported JAX
and one with the newest that installs (``-m compat``), so they must stay small and quick:
the compat module itself, the audit that nothing else imports Pallas, the reference, the
online softmax and the kernel forward on a few shapes (interpret mode and Mosaic lowering).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flashlab.ladder import online_softmax
from flashlab.compat import pallas as compat
from flashlab.kernels import flash_attention
from flashlab.ladder.reference import naive_attention, oracle_attention
from conftest import random_qkv

pytestmark = pytest.mark.compat


def test_compat_module_resolves_every_name():
    for name in ("pl", "pltpu", "BlockSpec", "CostEstimate", "PrefetchScalarGridSpec",
                 "CompilerParams", "InterpretParams", "VMEM", "SMEM"):
        assert getattr(compat, name) is not None, name
    assert compat.is_interpret_params(compat.InterpretParams())
    params = compat.CompilerParams(dimension_semantics=("parallel",))
    assert params is not None
    v = compat.versions()
    assert v["jax"] == jax.__version__
    with compat.force_tpu_interpret_mode():
        pass
    compat.reset_tpu_interpret_mode_state()


def test_official_kernel_modules_load_through_compat():
    fa = compat.official_flash_attention()
    sa = compat.official_splash_attention()
    assert hasattr(fa, "flash_attention") and hasattr(fa, "BlockSizes")
    assert hasattr(sa, "make_splash_mha") and hasattr(sa, "CausalMask")


def test_no_module_but_the_compat_module_imports_pallas():
    offenders = compat.direct_pallas_imports()
    assert not offenders, f"import Pallas via flashlab.compat.pallas: {offenders}"


def test_the_audit_finds_a_direct_import(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "ok.py").write_text("import jax\n")
    (pkg / "bad.py").write_text("from jax.experimental.pallas import tpu as pltpu\n")
    assert compat.direct_pallas_imports(pkg) == {"pkg/bad.py": ["jax.experimental.pallas"]}


def test_reference_matches_oracle():
    rng = np.random.default_rng(0)
    q, k, v = random_qkv(rng, 2, 24, 40, 4, 2, 16)
    out = naive_attention(q, k, v, is_causal=True)
    np.testing.assert_allclose(np.asarray(out), oracle_attention(q, k, v, is_causal=True),
                               atol=2e-5, rtol=0)


def test_online_softmax_blocks_equal_one_softmax():
    rng = np.random.default_rng(1)
    s = rng.standard_normal((3, 8, 64)).astype(np.float32)
    v = rng.standard_normal((3, 64, 16)).astype(np.float32)
    st = online_softmax.init((3, 8), 16)
    for j in range(0, 64, 16):
        st = online_softmax.update(st, s[..., j:j + 16], v[:, j:j + 16])
    out, lse = online_softmax.finalize(st)
    p = np.exp(s - s.max(-1, keepdims=True))
    want = (p / p.sum(-1, keepdims=True)) @ v
    np.testing.assert_allclose(np.asarray(out), want, atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(lse), np.log(np.exp(s.astype(np.float64)).sum(-1)),
                               atol=1e-5, rtol=0)


@pytest.mark.parametrize("shape,kw,dtype,atol", [
    ((1, 40, 40, 2, 2, 64), dict(is_causal=True), np.float32, 2e-5),
    ((2, 20, 260, 4, 2, 80), dict(local_window_size=(8, 2)), np.float32, 2e-5),
    ((1, 48, 48, 2, 1, 128), dict(is_causal=True), jnp.bfloat16, 3e-2),
])
def test_kernel_forward_matches_oracle(shape, kw, dtype, atol):
    B, T, S, N, K, H = shape
    q, k, v = (jnp.asarray(x, dtype) for x in random_qkv(np.random.default_rng(2), *shape))
    out = flash_attention(q, k, v, **kw, interpret=True)
    assert out.shape == (B, T, N, H) and out.dtype == dtype
    ref = oracle_attention(*(np.asarray(x, np.float32) for x in (q, k, v)), **kw)
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, atol=atol, rtol=0)


def test_kernel_lowers_with_mosaic_for_tpu():
    q = jnp.zeros((1, 256, 2, 64), jnp.float32)
    f = jax.jit(lambda q: flash_attention(q, q, q, is_causal=True, interpret=False))
    assert "tpu_custom_call" in f.trace(q).lower(lowering_platforms=("tpu",)).as_text()
