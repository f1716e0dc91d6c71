"""decode_attention: every decode backend against the float64 NumPy oracle, and validation."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashlab
from flashlab.ladder.decode import oracle_decode_attention
from flashlab.serving.decode import decode_backends

from decode_cases import CASES, decode_case

CPU_BACKENDS = ["reference", "tiled"]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("name,case,extra", CASES, ids=[c[0] for c in CASES])
def test_backend_matches_oracle(backend, name, case, extra):
    q, k, v, kw = decode_case(**case)
    want = oracle_decode_attention(q, k, v, **kw, **extra)
    got = flashlab.decode_attention(q, k, v, **kw, **extra, backend=backend)
    assert got.shape == want.shape and got.dtype == q.dtype
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=2e-5)
    empty = np.asarray(kw["cache_lengths"]) == 0
    assert (np.asarray(got)[empty] == 0).all()


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_bfloat16_under_jit(backend):
    q, k, v, kw = decode_case(dtype=jnp.bfloat16, sinks=True, new_tokens=2)
    want = oracle_decode_attention(q, k, v, **kw)
    f = jax.jit(lambda q, k, v, lengths, table, sinks: flashlab.decode_attention(
        q, k, v, cache_lengths=lengths, page_table=table, sinks=sinks, backend=backend))
    got = f(q, k, v, kw["cache_lengths"], kw["page_table"], kw["sinks"])
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=3e-2, rtol=3e-2)


def test_auto_is_tiled_on_cpu_and_registry_declares_features():
    names = [b.name for b in decode_backends()]
    assert names[:2] == ["reference", "tiled"]
    q, k, v, kw = decode_case()
    _, _, _, spec = flashlab.contract.decode_validate.validate_decode(q, k, v, **kw)
    assert flashlab.serving.decode.choose_decode(spec, platform="cpu").backend == "tiled"
    assert flashlab.serving.decode.choose_decode(spec, platform="tpu").backend == "pallas_tpu"
    with pytest.raises(NotImplementedError, match="does not support dtype float64"):
        flashlab.serving.decode.choose_decode(dataclasses.replace(spec, dtype=jnp.dtype("float64")),
                                      "pallas_tpu", platform="cpu")
    assert spec.features() == {"paged", "gqa"}


# ----------------------------------------------------------------------------- validation

def _bad(**change):
    q, k, v, kw = decode_case(batch=2, lengths=[5, 20])
    args = dict(query=q, k_cache=k, v_cache=v, **kw)
    args.update(change)
    return args


@pytest.mark.parametrize("change,exc,words", [
    (dict(cache_lengths=jnp.array([5, 40], jnp.int32)), ValueError, ["cache_lengths", "40", "capacity=32"]),
    (dict(cache_lengths=jnp.array([5, -1], jnp.int32)), ValueError, ["cache_lengths", "-1"]),
    (dict(cache_lengths=jnp.array([5.0, 6.0])), TypeError, ["cache_lengths", "float"]),
    (dict(cache_lengths=jnp.array([5, 6, 7], jnp.int32)), ValueError, ["cache_lengths", "[2]"]),
    (dict(page_table=jnp.array([[0, 1, 2, 3], [4, 99, -1, -1]], jnp.int32)), ValueError,
     ["page_table", "99", "num_pages=11"]),
    (dict(page_table=jnp.array([[-1, 1, 2, 3], [4, 5, 6, 7]], jnp.int32)), ValueError,
     ["page_table[0, 0] = -1"]),
    (dict(page_table=jnp.zeros((2, 4), jnp.float32)), TypeError, ["page_table", "float32"]),
    (dict(page_table=jnp.zeros((3, 4), jnp.int32)), ValueError, ["page_table", "(3, 4)"]),
    (dict(k_cache=jnp.zeros((11, 8, 2, 16), jnp.bfloat16)), TypeError, ["k_cache", "bfloat16"]),
    (dict(k_cache=jnp.zeros((11, 8, 3, 16))), ValueError, ["v_cache"]),
    (dict(query=jnp.zeros((2, 1, 3, 16))), ValueError, ["query heads (3)", "kv heads"]),
    (dict(query=jnp.zeros((2, 1, 4, 8))), ValueError, ["k_cache", "head_dim 8"]),
    (dict(query=jnp.zeros((2, 1, 4, 16), jnp.int32)), TypeError, ["query", "int32"]),
    (dict(sinks=jnp.zeros((3,))), ValueError, ["sinks", "[q_heads] = [4]"]),
    (dict(scale="x"), TypeError, ["scale"]),
    (dict(logits_soft_cap=0.0), ValueError, ["logits_soft_cap"]),
    (dict(local_window_size=-2), ValueError, ["local_window_size"]),
])
def test_bad_input_names_argument(change, exc, words):
    with pytest.raises(exc) as e:
        flashlab.decode_attention(**_bad(**change))
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_new_tokens_larger_than_length():
    q, k, v, kw = decode_case(batch=2, new_tokens=4, lengths=[4, 20])
    kw["cache_lengths"] = jnp.array([3, 20], jnp.int32)
    with pytest.raises(ValueError, match=r"cache_lengths: expected 0 \(an empty slot\) or a length in \[new_tokens=4"):
        flashlab.decode_attention(q, k, v, **kw)


def test_contiguous_batch_mismatch_and_unknown_backend():
    q, k, v, kw = decode_case(batch=2, paged=False, lengths=[3, 4])
    with pytest.raises(ValueError, match="contiguous cache needs batch 2"):
        flashlab.decode_attention(q, k[:1], v[:1], **kw)
    with pytest.raises(ValueError, match="backend: expected 'auto' or one of"):
        flashlab.decode_attention(q, k, v, **kw, backend="nope")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_traced_bad_values_give_nan_rows_not_silent_answers(backend):
    q, k, v, kw = decode_case(batch=3, lengths=[5, 20, 9])
    f = jax.jit(lambda lengths, table: flashlab.decode_attention(
        q, k, v, cache_lengths=lengths, page_table=table, backend=backend))
    good = np.asarray(f(kw["cache_lengths"], kw["page_table"]))
    assert np.isfinite(good).all()
    table = kw["page_table"].at[1, 1].set(1000)               # used page outside the pool
    lengths = kw["cache_lengths"].at[2].set(99)                # over capacity
    out = np.asarray(f(lengths, table))
    assert np.isnan(out[1]).all() and np.isnan(out[2]).all()
    np.testing.assert_array_equal(out[0], good[0])
