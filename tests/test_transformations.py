"""Every JAX transformation on every CPU backend that declares it, against the float64 oracle.

jit, vmap, grad, grad of jax.checkpoint, lax.scan, jvp, jacfwd, grad of grad and the hessian of a
small problem, per backend; a backend that does not declare a derivative (``Backend.autodiff``)
must refuse it with a NotImplementedError naming the backends that do, and ``auto`` must pick
one that works at every size. shard_map (``check_vma=True``) on 8 simulated devices runs in a
fresh process (tests/transform_dist_cases.py). References: forward values and gradients from
``flashlab.ladder.reference.oracle_attention``/``conformance.oracle_grads`` (NumPy float64);
tangents, Jacobians and Hessians by central differences of those float64 functions.
"""
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashlab
from flashlab.dispatch import registry
from flashlab.dispatch.conformance import oracle_grads, random_qkv
from flashlab.ladder.reference import oracle_attention

HERE = Path(__file__).resolve().parent
CPU = ("reference", "xla", "tiled", "pallas_tpu")
KW = dict(is_causal=True)
FWD_ATOL = 2e-5      # fp32 outputs of unit-scale inputs vs float64
GRAD_RTOL = 1e-4     # fp32 derivatives, relative to the largest float64 entry
EPS = 1e-6           # central-difference step on float64 functions (error ~1e-11)


def _att(backend):
    return lambda q, k, v: flashlab.attention(q, k, v, backend=backend, **KW)


def _rel(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert np.isfinite(got).all()
    return np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    q, k, v = random_qkv(rng, 2, 16, 16, 4, 2, 8)             # GQA, causal
    w = rng.standard_normal(q.shape).astype(np.float32)        # d loss / d out
    tangents = random_qkv(rng, 2, 16, 16, 4, 2, 8)
    return q, k, v, w, tangents


def _declares(backend, feature):
    return feature in registry.get(backend).autodiff


def _refuses(fn, feature):
    with pytest.raises(NotImplementedError) as e:
        fn()
    msg = str(e.value)
    assert f"feature {feature!r}" in msg and "reference" in msg.split("support this request")[-1]


# ----------------------------------------------------------------------------- first order

@pytest.mark.parametrize("backend", CPU)
def test_jit_vmap_scan(backend, data):
    q, k, v, _, (tq, tk, tv) = data
    f = _att(backend)
    want = oracle_attention(q, k, v, **KW)
    assert np.abs(np.asarray(jax.jit(f)(q, k, v)) - want).max() <= FWD_ATOL
    qs, ks, vs = (np.stack([a, b]) for a, b in ((q, tq), (k, tk), (v, tv)))
    wants = np.stack([want, oracle_attention(tq, tk, tv, **KW)])
    assert np.abs(np.asarray(jax.vmap(f)(qs, ks, vs)) - wants).max() <= FWD_ATOL
    _, outs = jax.lax.scan(lambda c, x: (c, f(*x)), 0, (qs, ks, vs))
    assert np.abs(np.asarray(outs) - wants).max() <= FWD_ATOL


@pytest.mark.parametrize("checkpoint", [False, True], ids=["grad", "grad_checkpoint"])
@pytest.mark.parametrize("backend", CPU)
def test_grad(backend, checkpoint, data):
    q, k, v, w, _ = data
    f = jax.checkpoint(_att(backend)) if checkpoint else _att(backend)
    g = jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) * w), argnums=(0, 1, 2)))(q, k, v)
    for got, want in zip(g, oracle_grads(q, k, v, w, **KW)):
        assert _rel(got, want) <= GRAD_RTOL


# ----------------------------------------------------------------------------- forward mode

@pytest.mark.parametrize("backend", CPU)
def test_jvp(backend, data):
    q, k, v, _, t = data
    f = _att(backend)
    if not _declares(backend, "forward_mode"):
        _refuses(lambda: jax.jvp(f, (q, k, v), t), "forward_mode")
        return
    out, tan = jax.jit(lambda p, t: jax.jvp(f, p, t))((q, k, v), t)
    x64 = [np.asarray(a, np.float64) for a in (q, k, v)]
    step = lambda s: oracle_attention(*(a + s * EPS * b for a, b in zip(x64, t)), **KW)  # noqa: E731
    assert np.abs(np.asarray(out) - oracle_attention(q, k, v, **KW)).max() <= FWD_ATOL
    assert _rel(tan, (step(1) - step(-1)) / (2 * EPS)) <= GRAD_RTOL


def _small():
    q, k, v = random_qkv(np.random.default_rng(1), 1, 4, 4, 1, 1, 3)
    return q, k, v


@pytest.mark.parametrize("backend", CPU)
def test_jacfwd(backend):
    q, k, v = _small()
    f = lambda q: _att(backend)(q, k, v)  # noqa: E731
    if not _declares(backend, "forward_mode"):
        _refuses(lambda: jax.jacfwd(f)(q), "forward_mode")
        return
    jac = np.asarray(jax.jit(jax.jacfwd(f))(q)).reshape(q.size, q.size)
    q64 = np.asarray(q, np.float64).ravel()
    cols = []
    for i in range(q.size):
        e = np.zeros(q.size)
        e[i] = EPS
        cols.append((oracle_attention((q64 + e).reshape(q.shape), k, v, **KW)
                     - oracle_attention((q64 - e).reshape(q.shape), k, v, **KW)).ravel() / (2 * EPS))
    assert _rel(jac, np.stack(cols, axis=1)) <= GRAD_RTOL


# ----------------------------------------------------------------------------- second order

def _hessian_fd(q, k, v):
    """Hessian of ``L(q) = sum(sin(attention(q, k, v)))`` by differences of float64 gradients."""
    q64 = np.asarray(q, np.float64).ravel()

    def grad(x):
        x = x.reshape(q.shape)
        return oracle_grads(x, k, v, np.cos(oracle_attention(x, k, v, **KW)), **KW)[0].ravel()
    rows = []
    for i in range(q.size):
        e = np.zeros(q.size)
        e[i] = EPS
        rows.append((grad(q64 + e) - grad(q64 - e)) / (2 * EPS))
    return np.stack(rows)


@pytest.mark.parametrize("backend", CPU)
def test_hessian_and_grad_of_grad(backend):
    q, k, v = _small()
    loss = lambda q: jnp.sum(jnp.sin(_att(backend)(q, k, v)))  # noqa: E731
    t = np.random.default_rng(2).standard_normal(q.shape).astype(np.float32)
    hvp = lambda q: jax.grad(lambda q: jnp.vdot(jax.grad(loss)(q), t))(q)  # noqa: E731
    if not _declares(backend, "second_order"):
        _refuses(lambda: jax.hessian(loss)(q), "second_order")
        _refuses(lambda: hvp(q), "second_order")
        return
    want = _hessian_fd(q, k, v)
    hess = jax.jit(jax.hessian(loss))(q)
    assert _rel(np.asarray(hess).reshape(q.size, q.size), want) <= GRAD_RTOL
    assert _rel(jax.jit(hvp)(q).ravel(), want @ t.ravel()) <= GRAD_RTOL


# ----------------------------------------------------------------------------- auto

@pytest.mark.parametrize("T", [16, 1024], ids=["short", "long"])
def test_auto_chooses_a_backend_that_can_differentiate(T):
    """At both sides of the CPU crossover (xla below, tiled above) auto never fails."""
    q, k, v = random_qkv(np.random.default_rng(3), 1, T, T, 1, 1, 4)
    f = _att("auto")
    _, tan = jax.jit(lambda q: jax.jvp(lambda q: f(q, k, v), (q,), (q,)))(q)
    assert tan.shape == q.shape and np.isfinite(np.asarray(tan)).all()
    loss = lambda q: jnp.sum(f(q, k, v) ** 2)  # noqa: E731
    gg = jax.jit(jax.grad(lambda q: jnp.sum(jax.grad(loss)(q) ** 2)))(q)
    assert np.isfinite(np.asarray(gg)).all()
    # What explain says under each transformation: the request, not only the size, decides.
    seen = []
    probe = lambda q: seen.append(flashlab.explain(q, k, v, **KW)) or jnp.sum(q)  # noqa: E731
    jax.jvp(probe, (q,), (q,))
    jax.grad(lambda q: jnp.sum(jax.grad(probe)(q)))(q)
    assert [c.backend for c in seen] == (["xla", "xla"] if T == 16 else ["tiled", "xla"])
    if T == 1024:    # tiled pushes tangents through its loops, but has no second derivative
        assert "tiled: does not support feature 'second_order'" in str(seen[1])


# ----------------------------------------------------------------------------- official kernels

def test_official_kernel_interpreted_under_vmap_grad_checkpoint():
    """The official kernels in TPU interpret mode under jax.vmap and jax.grad(jax.checkpoint):
    the interpreter's io_callback effects (refused by remat partial eval) and its unbatchable
    pallas_call stay inside one effect-free host callback per pass (adapters._under_tpu_interpret).
    jax_pallas_flash only (splash goes through the same wrapper; ~10 s each)."""
    rng = np.random.default_rng(1)
    q, k, v, w = (rng.standard_normal((2, 1, 128, 1, 128)).astype(np.float32) for _ in range(4))
    kvl = np.array([100], np.int32)                  # lengths reach the kernel as segment ids
    f = jax.checkpoint(lambda q, k, v: flashlab.attention(
        q, k, v, backend="jax_pallas_flash", interpret=True, key_value_seq_lengths=kvl, **KW))
    g = jax.grad(lambda q, k, v: jnp.sum(jax.vmap(f)(q, k, v) * w), argnums=(0, 1, 2))(q, k, v)
    for i in range(2):
        want = oracle_grads(q[i], k[i], v[i], w[i], key_value_seq_lengths=kvl, **KW)
        for got, wi in zip(g, want):
            assert _rel(got[i], wi) <= GRAD_RTOL


# ----------------------------------------------------------------------------- shard_map

def test_shard_map_check_vma_on_8_cpu_devices():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent),
                                                       os.environ.get("PYTHONPATH", "")]))
    env.pop("XLA_FLAGS", None)
    cases = ["user_shard_map", "sharded_attention"]
    proc = subprocess.run([sys.executable, str(HERE / "transform_dist_cases.py"), *cases],
                          env=env, capture_output=True, text=True, timeout=900, cwd=HERE.parent)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    for c in cases:
        assert f"ok {c}" in proc.stdout
