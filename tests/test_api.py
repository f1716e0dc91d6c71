"""flashlab.attention as a drop-in, the Flax adapter, explain, and the registry's errors."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flashlab.dispatch import registry
from flashlab.dispatch.api import as_flax_attention_fn, attention, explain
from flashlab.contract.masks import validate
from conftest import random_qkv


# ----------------------------------------------------------------------------- drop-in

@pytest.mark.parametrize("backend", ["auto", "xla", "reference"])
@pytest.mark.parametrize("kw", [
    {}, {"is_causal": True}, {"local_window_size": (3, 1)}, {"local_window_size": 2},
    {"key_value_seq_lengths": np.array([5, 9], np.int32)},
    {"query_seq_lengths": np.array([12, 7], np.int32),
     "key_value_seq_lengths": np.array([6, 12], np.int32)},
    {"scale": 0.3}, {"bias": "b"}, {"mask": "m"}])
def test_drop_in_equals_jax_nn(backend, kw):
    """Where every row sees a key, we equal jax.nn.dot_product_attention on its own features."""
    rng = np.random.default_rng(2)
    q, k, v = random_qkv(rng, 2, 12, 12, 4, 2, 8)
    kw = dict(kw)
    if kw.get("bias") == "b":
        kw["bias"] = rng.standard_normal((1, 4, 12, 12)).astype(np.float32)
    if kw.get("mask") == "m":
        m = rng.random((2, 1, 12, 12)) < 0.7
        m[..., 0] = True          # every row sees a key (jax.nn gives mean(V) otherwise)
        kw["mask"] = m
    expected = jax.nn.dot_product_attention(q, k, v, implementation="xla", **kw)
    out = attention(q, k, v, backend=backend, **kw)
    rows = np.ones(q.shape[:3], bool)
    if "query_seq_lengths" in kw:   # padded query rows: the contract says zeros; compare valid rows
        rows = np.arange(12)[None, :, None] < kw["query_seq_lengths"][:, None, None]
        rows = np.broadcast_to(rows, q.shape[:3])
    np.testing.assert_allclose(np.asarray(out)[rows], np.asarray(expected)[rows], atol=2e-6)


def test_positional_bias_and_mask_and_jit():
    rng = np.random.default_rng(0)
    q, k, v = random_qkv(rng, 1, 8, 8, 2, 2, 8)
    bias = rng.standard_normal((1, 2, 8, 8)).astype(np.float32)
    mask = np.tril(np.ones((8, 8), bool))[None, None]
    a = jax.jit(lambda q, k, v: attention(q, k, v, bias, mask))(q, k, v)
    b = jax.nn.dot_product_attention(q, k, v, bias, mask)
    np.testing.assert_allclose(a, b, atol=2e-6)


def test_zero_rows_differ_from_jax_nn_on_purpose():
    """jax.nn returns mean(V) for a row with no visible key; the contract says zeros."""
    rng = np.random.default_rng(1)
    q, k, v = random_qkv(rng, 1, 4, 4, 1, 1, 4)
    mask = np.ones((1, 1, 4, 4), bool)
    mask[0, 0, 2] = False
    out = attention(q, k, v, mask=mask, backend="xla")
    np.testing.assert_array_equal(out[0, 2], 0)


# ----------------------------------------------------------------------------- errors

def test_unsupported_feature_names_feature_and_supporters():
    q, k, v = random_qkv(np.random.default_rng(0), 1, 8, 8, 2, 2, 8)
    with pytest.raises(NotImplementedError) as e:
        attention(q, k, v, logits_soft_cap=2.0, backend="xla")
    msg = str(e.value)
    assert "'soft_cap'" in msg and "xla" in msg and "reference" in msg


def test_unsupported_dtype_and_platform():
    q, k, v = (jnp.asarray(x, jnp.float32) for x in random_qkv(np.random.default_rng(0), 1, 8, 8, 2, 2, 8))
    with pytest.raises(NotImplementedError, match="dtype float32"):
        attention(q, k, v, backend="cudnn")
    if jax.default_backend() == "cpu":
        with pytest.raises(NotImplementedError, match="interpret=True"):
            attention(q, k, v, backend="splash")


def test_unknown_backend_is_a_value_error_naming_the_argument():
    q, k, v = random_qkv(np.random.default_rng(0), 1, 8, 8, 2, 2, 8)
    with pytest.raises(ValueError, match="backend: expected 'auto' or one of"):
        attention(q, k, v, backend="nope")


def test_validation_still_names_the_argument():
    q, k, v = random_qkv(np.random.default_rng(0), 1, 8, 8, 2, 2, 8)
    with pytest.raises(ValueError, match="mask: expected shape"):
        attention(q, k, v, mask=np.ones((1, 1, 8, 7), bool))


# ----------------------------------------------------------------------------- explain / registry

def test_backends_are_registered_with_declarations():
    names = [b.name for b in registry.backends()]
    for n in ("reference", "xla", "tiled", "pallas_tpu", "jax_pallas_flash", "splash", "cudnn"):
        assert n in names
    for b in registry.backends():
        assert b.platforms and b.dtypes and b.features <= registry.ALL_FEATURES
        assert b.name in b.declaration()


def test_explain_auto_on_cpu():
    if jax.default_backend() != "cpu":
        pytest.skip("explain's CPU choice")
    q, k, v = random_qkv(np.random.default_rng(0), 1, 16, 16, 2, 2, 8)
    c = explain(q, k, v, is_causal=True)
    assert c.backend == "xla" and c.mode == "compiled" and "T*S" in str(c)
    c = explain(q, k, v, logits_soft_cap=3.0)
    assert c.backend == "reference"
    assert "xla: does not support feature 'soft_cap'" in str(c)
    out, c2 = attention(q, k, v, logits_soft_cap=3.0, explain=True)
    assert c2 == c and out.shape == q.shape


def test_explain_long_sequence_prefers_tiled_when_available():
    _, _, _, spec = validate(*(jnp.zeros((1, 4096, 1, 8), jnp.float32),) * 3)
    c = registry.choose(spec, platform="cpu")
    if registry.get("tiled").availability() is None:
        assert c.backend == "tiled"
    else:
        assert c.backend == "xla" and "tiled: unavailable" in str(c)


def test_explain_named_and_interpret():
    q, k, v = random_qkv(np.random.default_rng(0), 1, 8, 8, 2, 2, 8)
    c = explain(q, k, v, backend="splash", interpret=True)
    if jax.default_backend() == "cpu":
        assert c.mode == "interpret (TPU interpret mode)"
    assert "requested by name" in str(c)


def test_choose_on_other_platforms():
    _, _, _, spec = validate(
        *(jnp.zeros((1, 256, 2, 64), jnp.bfloat16),) * 3, is_causal=True)
    tpu = registry.choose(spec, platform="tpu")
    assert tpu.backend in ("pallas_tpu", "splash")
    gpu = registry.choose(spec, platform="gpu")
    assert gpu.backend == "cudnn"
    _, _, _, spec32 = validate(
        *(jnp.zeros((1, 256, 2, 64), jnp.float32),) * 3)
    assert registry.choose(spec32, platform="gpu").backend == "xla"


# ----------------------------------------------------------------------------- Flax

def _mha(attention_fn):
    from flax import nnx
    kw = {} if attention_fn is None else {"attention_fn": attention_fn}
    return nnx.MultiHeadAttention(num_heads=2, in_features=8, qkv_features=16, decode=False,
                                  rngs=nnx.Rngs(0), **kw)


@pytest.mark.parametrize("mask_kind", ["none", "causal", "padding", "bool_per_head"])
def test_flax_adapter_matches_flax_default(mask_kind):
    from flax import nnx
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 6, 8)), jnp.float32)
    mask = None
    if mask_kind == "causal":
        mask = nnx.make_causal_mask(jnp.ones((2, 6)))                  # [2, 1, 6, 6]
    elif mask_kind == "padding":
        valid = jnp.asarray([[1] * 6, [1] * 4 + [0] * 2])
        mask = nnx.make_attention_mask(valid, valid)                   # [2, 1, 6, 6]
    elif mask_kind == "bool_per_head":
        m = rng.random((1, 2, 6, 6)) < 0.7
        m[..., 0] = True
        mask = jnp.asarray(m)
    ours, theirs = _mha(as_flax_attention_fn()), _mha(None)

    def loss(model, x):
        return (model(x, mask=mask, deterministic=True) ** 2).sum()

    a, b = ours(x, mask=mask), theirs(x, mask=mask)
    rows = np.ones(a.shape[:2], bool)
    if mask_kind == "padding":    # rows 4, 5 of batch 1 see nothing: zeros vs Flax's mean(V)
        rows[1, 4:] = False
    np.testing.assert_allclose(np.asarray(a)[rows], np.asarray(b)[rows], atol=2e-6)
    if mask_kind != "padding":
        ga = nnx.grad(loss)(ours, x)
        gb = nnx.grad(loss)(theirs, x)
        for la, lb in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
            np.testing.assert_allclose(la, lb, atol=2e-5, rtol=1e-4)


def test_flax_adapter_bias_and_broadcast_q_dim():
    rng = np.random.default_rng(0)
    q, k, v = random_qkv(rng, 2, 6, 6, 2, 2, 8)
    fn = as_flax_attention_fn()
    bias = rng.standard_normal((2, 6, 6)).astype(np.float32)          # rank 3: [heads?..] -> prepends
    pad = np.ones((2, 1, 1, 6), bool)
    pad[1, ..., 4:] = False                                            # kv padding, q dim broadcast
    from flax.nnx import dot_product_attention as flax_dpa
    a = fn(q, k, v, bias=bias[None], mask=pad)
    b = flax_dpa(q, k, v, bias=bias[None], mask=pad)
    np.testing.assert_allclose(a, b, atol=2e-6)


def test_flax_adapter_refuses_dropout_and_bad_mask():
    q, k, v = random_qkv(np.random.default_rng(0), 2, 6, 6, 2, 2, 8)
    fn = as_flax_attention_fn()
    with pytest.raises(NotImplementedError, match="dropout_rate=0.1"):
        fn(q, k, v, dropout_rate=0.1, deterministic=False)
    fn(q, k, v, dropout_rate=0.1, deterministic=True)     # fine: no dropout applied
    with pytest.raises(ValueError, match="mask: kv must be 1 or 6"):
        fn(q, k, v, mask=np.ones((2, 1, 6, 5), bool))
    with pytest.raises(ValueError, match="mask: heads must be 1 or 2"):
        fn(q, k, v, mask=np.ones((2, 3, 6, 6), bool))


def test_flax_adapter_padding_gradients_on_valid_rows():
    """With a padding mask, rows that see keys match Flax's default in value and gradient
    (the padded rows differ on purpose: zeros here, mean(V) in Flax; the loss skips them)."""
    from flax import nnx
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((2, 6, 8)), jnp.float32)
    valid = jnp.asarray([[1] * 6, [1] * 4 + [0] * 2])
    mask = nnx.make_attention_mask(valid, valid)                       # [2, 1, 6, 6]
    keep = valid[..., None].astype(jnp.float32)                        # [2, 6, 1]

    def loss(model, x):
        return ((model(x, mask=mask, deterministic=True) * keep) ** 2).sum()

    ours, theirs = _mha(as_flax_attention_fn()), _mha(None)
    ga, gb = nnx.grad(loss, argnums=(0, 1))(ours, x), nnx.grad(loss, argnums=(0, 1))(theirs, x)
    for la, lb in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
        np.testing.assert_allclose(la, lb, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", ["reference", "tiled"])
def test_flax_adapter_passes_segment_ids(backend):
    """``segment_ids=`` (beyond Flax's signature) reaches flashlab.attention unchanged,
    also with extra leading batch dims."""
    rng = np.random.default_rng(4)
    q, k, v = random_qkv(rng, 2, 8, 8, 2, 2, 8)
    seg = np.array([[1, 1, 1, 2, 2, 2, 2, 0], [1, 1, 1, 1, 1, 1, 2, 2]], np.int32)
    fn = as_flax_attention_fn(backend=backend)
    want = attention(q, k, v, is_causal=True, segment_ids=seg, backend="reference")
    np.testing.assert_allclose(fn(q, k, v, is_causal=True, segment_ids=seg), want, atol=2e-6)
    got = fn(q[None], k[None], v[None], is_causal=True, segment_ids=seg[None])   # [1, 2, ...]
    np.testing.assert_allclose(got[0], want, atol=2e-6)
