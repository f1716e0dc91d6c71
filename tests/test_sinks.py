"""Attention sinks (``sinks=[q_heads]``): values, the sink's own gradient, empty rows, errors.

Forward and dQ/dK/dV of every backend are in the conformance suite (option ``"sinks"``);
here: ``dsink`` against central differences of the float64 oracle (tolerance 1e-4 relative
to max |dsink|), rows with no visible key (zero output, zero finite gradients), validation.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flashlab import attention
from flashlab.ladder.reference import oracle_attention

B, T, S, N, K, H = 2, 16, 24, 4, 2, 16
KW = dict(key_value_seq_lengths=np.array([S, 0], np.int32), local_window_size=(3, 2))


def _inputs():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, T, N, H)).astype(np.float32)
    k = rng.standard_normal((B, S, K, H)).astype(np.float32)
    v = rng.standard_normal((B, S, K, H)).astype(np.float32)
    sinks = (2 * rng.standard_normal(N)).astype(np.float32)
    dout = rng.standard_normal((B, T, N, H)).astype(np.float32)
    return q, k, v, sinks, dout


def _oracle_dsink(q, k, v, sinks, dout, eps=1e-5):
    """Central differences of sum(oracle * dO) in each head's sink (float64: error ~eps²)."""
    f = lambda s: (oracle_attention(q, k, v, sinks=s, **KW) * dout).sum()  # noqa: E731
    s64 = sinks.astype(np.float64)
    return np.array([(f(s64 + eps * e) - f(s64 - eps * e)) / (2 * eps) for e in np.eye(N)])


@pytest.mark.parametrize("backend", ["reference", "tiled", "pallas_tpu"])
def test_sink_gradient_matches_oracle(backend):
    q, k, v, sinks, dout = _inputs()
    f = lambda q, k, v, s: attention(q, k, v, sinks=s, backend=backend, **KW)  # noqa: E731
    out, vjp = jax.vjp(f, q, k, v, sinks)
    np.testing.assert_allclose(np.asarray(out), oracle_attention(q, k, v, sinks=sinks, **KW),
                               atol=2e-5, rtol=0)
    dq, dk, dv, dsink = (np.asarray(g) for g in vjp(jnp.asarray(dout)))
    ref = _oracle_dsink(q, k, v, sinks, dout)
    assert np.abs(dsink - ref).max() <= 1e-4 * np.abs(ref).max(), (dsink, ref)
    # Batch row 1 sees no key: zero output and zero, finite gradients despite the sink.
    assert (np.asarray(out)[1] == 0).all() and (dq[1] == 0).all()
    assert all(np.isfinite(g).all() for g in (dq, dk, dv, dsink))


def test_sink_lowers_every_weight():
    """A sink of -inf is no sink; a very large sink takes all the weight (output -> 0)."""
    q, k, v, _, _ = _inputs()
    plain = attention(q, k, v, backend="tiled")
    none = attention(q, k, v, sinks=jnp.full((N,), -jnp.inf), backend="tiled")
    np.testing.assert_allclose(np.asarray(none), np.asarray(plain), atol=1e-6)
    huge = attention(q, k, v, sinks=jnp.full((N,), 60.0), backend="tiled")
    assert np.abs(np.asarray(huge)).max() < 1e-12


def test_sinks_traced_under_jit():
    q, k, v, sinks, _ = _inputs()
    out = jax.jit(lambda s: attention(q, k, v, sinks=s, backend="reference", **KW))(sinks)
    np.testing.assert_allclose(np.asarray(out), oracle_attention(q, k, v, sinks=sinks, **KW),
                               atol=2e-5)


def test_sinks_validation():
    q, k, v, sinks, _ = _inputs()
    with pytest.raises(ValueError, match=r"sinks: expected shape \[q_heads\] = \[4\], got \(2,\)"):
        attention(q, k, v, sinks=sinks[:2])
    with pytest.raises(TypeError, match="sinks: expected a floating dtype, got int32"):
        attention(q, k, v, sinks=np.zeros(N, np.int32))
    with pytest.raises(TypeError, match="sinks: expected a float array"):
        attention(q, k, v, sinks=[0.0] * N)
    with pytest.raises(NotImplementedError, match="feature 'sinks'.*'reference'"):
        attention(q, k, v, sinks=sinks, backend="xla")
