"""No device-memory growth and no recompilation across repeated calls, for every backend.

The ``no_growth`` fixture is :func:`flashlab.instruments.leaks.assert_no_growth`; each backend in
``flashlab.backends()`` that can run here is called repeatedly, forward and gradient, jitted
(as a training step would be) and fails on a new live array or a compile after warm-up.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashlab
from flashlab.dispatch import conformance, registry
from flashlab.instruments import leaks
from flashlab.contract.masks import validate
from conftest import random_qkv


@pytest.fixture
def no_growth():
    """``no_growth(fn, *args)``: assert repeated calls leak no arrays and do not recompile."""
    return functools.partial(leaks.assert_no_growth, repeats=3, warmup=1)


# ----------------------------------------------------------------------------- the helper

def test_clean_function_has_no_growth(no_growth):
    f = jax.jit(lambda x: jnp.sin(x) * 2)
    rep = no_growth(f, jnp.ones((8, 128)))
    assert rep.ok and rep.compiles == 0 and "no growth" in str(rep)


def test_closure_that_keeps_outputs_is_caught():
    history = []
    f = jax.jit(lambda x: x * 2)

    def step(x):
        y = f(x)
        history.append(y)              # the leak: every output stays alive
        return y

    with pytest.raises(leaks.LeakError, match=r"3 new live arrays .*float32\[4,128\]"):
        leaks.assert_no_growth(step, jnp.ones((4, 128)), repeats=3)
    history.clear()


def test_cache_keyed_on_arrays_is_caught():
    cache = {}

    def step(x):
        key = x + 0                       # a fresh array each call: never a cache hit
        cache[id(key)] = (key, x * 3)
        return cache[id(key)][1]

    rep = leaks.measure_growth(step, jnp.ones((2, 128)), repeats=4)
    assert not rep.ok and rep.new_bytes >= 4 * 2 * 2 * 128 * 4
    cache.clear()


def test_recompilation_is_caught():
    def step(x):
        return jax.jit(lambda x: x + 1)(x)      # a new function object: compiles every call

    with pytest.raises(leaks.LeakError, match="3 compilations"):
        leaks.assert_no_growth(step, jnp.ones((3,)), repeats=3)
    rep = leaks.assert_no_growth(step, jnp.ones((3,)), repeats=2, allow_compiles=2)
    assert rep.compiles == 2


def test_count_compiles_and_summary():
    f = jax.jit(lambda x: x - 1)
    x5, x6 = jnp.ones(5), jnp.ones(6)
    with leaks.count_compiles() as c:
        f(x5).block_until_ready()
        f(x6).block_until_ready()      # new shape -> second compile
        f(x6).block_until_ready()
    assert c.count == 2
    assert leaks.live_arrays_summary([jnp.ones((2, 3)), jnp.ones((2, 3))]) == {"float32[2,3]": 2}
    with pytest.raises(ValueError, match="repeats"):
        leaks.measure_growth(f, jnp.ones(5), repeats=0)


# ----------------------------------------------------------------------------- every backend

B, T, N, K, H = 1, 32, 2, 2, 16


def _runnable():
    out = []
    q, k, v = random_qkv(np.random.default_rng(0), B, T, T, N, K, H)
    _, _, _, spec = validate(q, k, v, is_causal=True)
    for b in flashlab.backends():
        if b.availability() is None and not b.unsupported(spec, None, conformance.interpret_for(b)):
            out.append(b.name)
    return out


def _step(name, grad):
    interpret = conformance.interpret_for(registry.get(name))

    def loss(q, k, v):
        return flashlab.attention(q, k, v, is_causal=True, backend=name,
                                  interpret=interpret).sum()

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)) if grad else loss)


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "grad"])
@pytest.mark.parametrize("name", _runnable())
def test_backend_has_no_growth(name, grad, no_growth):
    b = registry.get(name)
    if grad and not b.gradients:
        pytest.skip(f"{name} declares gradients=False")
    q, k, v = (jnp.asarray(x) for x in random_qkv(np.random.default_rng(1), B, T, T, N, K, H))
    step = _step(name, grad)
    try:
        rep = no_growth(step, q, k, v)
    except NotImplementedError as e:      # a backend whose backward is not written yet
        pytest.skip(f"{name}: {e}")
    assert rep.ok
