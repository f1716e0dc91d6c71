"""The contract under adversarial input: jax.nn parity, NaN honesty, traced values, bad input.

``flashlab.attention`` is a drop-in for ``jax.nn.dot_product_attention``; the one difference on
purpose is that a row with no visible key is 0 (jax.nn: mean(V)). Every CPU backend that
declares a case is compared with jax.nn over jax.nn's input space (broadcast forms of mask
and bias, GQA, cross attention, lengths static/traced/out of range, windows, scales as data,
jit/vmap/grad); rows that jax.nn leaves empty are checked to be exactly 0 (emptiness from the
independent float64 oracle). Tolerances: float32 outputs 2e-5 absolute (O(1) values),
gradients 1e-4. Compile time dominates, so the kernel rungs (tiled, pallas_tpu in the generic
interpreter) run a few drawn cases on one shape; reference and xla run the full breadth.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import flashlab
from flashlab.ladder.reference import oracle_attention

SHAPES = [(2, 8, 8, 4, 2, 16), (2, 8, 12, 2, 1, 16)]        # (B, T, S, N, K, H)
FAST = ["reference", "xla"]
KERNELS = ["tiled", "pallas_tpu"]
ALL = FAST + KERNELS
ATOL, GTOL = 2e-5, 1e-4


def _qkv(shape, seed=0):
    B, T, S, N, K, H = shape
    r = np.random.default_rng(seed)
    return (r.standard_normal((B, T, N, H)).astype(np.float32),
            r.standard_normal((B, S, K, H)).astype(np.float32),
            r.standard_normal((B, S, K, H)).astype(np.float32))


def _form(kind, shape, r, form):
    """A mask/bias in one of jax.nn's broadcast forms (``form`` names its dims)."""
    B, T, S, N, _, _ = shape
    dims = {"B": B, "N": N, "T": T, "S": S, "1": 1}
    shp = tuple(dims[c] for c in form)
    if kind == "mask":
        return np.asarray(r.random(shp) > 0.25)
    if kind == "int":
        return r.integers(-2, 3, shp).astype(np.int32)
    return r.standard_normal(shp).astype(np.float32)


MASK_FORMS = [None, "B11S", "BN1S", "B1T1", "TS", "NTS", "11TS", "BNTS", "1NTS", ""]
BIAS_FORMS = [None, "B11S", "TS", "1NTS", "B1T1", "intNTS", "BNTS"]


@st.composite
def cases(draw, shapes=tuple(range(len(SHAPES)))):
    """One request: arguments for flashlab.attention and jax.nn alike, plus traced values."""
    shape = SHAPES[draw(st.sampled_from(shapes))]
    B, T, S = shape[:3]
    r = np.random.default_rng(draw(st.integers(0, 2**16)))
    kw, traced = {}, {}
    mf, bf = draw(st.sampled_from(MASK_FORMS)), draw(st.sampled_from(BIAS_FORMS))
    if mf is not None:
        kw["mask"] = _form("mask", shape, r, mf)
    if bf is not None:
        kw["bias"] = _form("int" if bf.startswith("int") else "bias", shape, r,
                           bf.removeprefix("int"))
    kw["is_causal"] = draw(st.sampled_from([False, True, np.bool_(True), jnp.bool_(False)]))
    w = draw(st.sampled_from([None, 2, (1, 3), (0, 10**12)]))
    if w is not None:
        kw["local_window_size"] = w
    how = draw(st.sampled_from(["none", "static", "traced"]))
    if how != "none":
        hi = S + 3 if how == "traced" else S          # traced: beyond S is clamped
        kv = r.integers(0, hi + 1, B).astype(np.int32)
        q = r.integers(0, (T + 3 if how == "traced" else T) + 1, B).astype(np.int32)
        (traced if how == "traced" else kw).update(
            key_value_seq_lengths=kv, query_seq_lengths=q)
    sc = draw(st.sampled_from([None, 0.3, "array", "traced"]))
    if sc == "array":
        kw["scale"] = jnp.float32(0.4)
    elif sc == "traced":
        traced["scale"] = np.float32(0.45)
    elif sc is not None:
        kw["scale"] = sc
    return shape, kw, traced


def _expected(q, k, v, kw, traced):
    """jax.nn's answer, and which rows have no visible key (float64 oracle, own code)."""
    every = {**kw, **traced}
    nn_kw = dict(every)
    if nn_kw.get("local_window_size") == (0, 10**12):       # jax.nn overflows int32 on it
        nn_kw["local_window_size"] = (0, q.shape[1] + k.shape[1])
    ref = jax.nn.dot_product_attention(q, k, v, **nn_kw)
    okw = dict(every)
    okw["is_causal"] = bool(okw.get("is_causal", False))
    bias, mask = okw.pop("bias", None), okw.pop("mask", None)
    G = q.shape[2] // k.shape[2]
    for name in ("query_seq_lengths", "key_value_seq_lengths"):
        if name in okw:
            okw[name] = np.minimum(okw[name], (q if name[0] == "q" else k).shape[1])
    _, lse = oracle_attention(q, np.repeat(k, G, 2), np.repeat(v, G, 2), bias, mask,
                              return_lse=True, **okw)
    empty = np.transpose(np.isneginf(lse), (0, 2, 1))             # [B, T, N]
    return np.asarray(ref), empty


def _run(backend, q, k, v, kw, traced):
    if not traced:
        return np.asarray(flashlab.attention(q, k, v, backend=backend, **kw))
    f = jax.jit(lambda q, k, v, t: flashlab.attention(q, k, v, backend=backend, **kw, **t))
    return np.asarray(f(q, k, v, traced))


def _check(backends, case):
    shape, kw, traced = case
    q, k, v = _qkv(shape)
    ref, empty = _expected(q, k, v, kw, traced)
    for backend in backends:
        out = _run(backend, q, k, v, kw, traced)
        assert out.shape == ref.shape
        np.testing.assert_array_equal(out[empty], 0.0)
        np.testing.assert_allclose(out[~empty], ref[~empty], atol=ATOL, rtol=0, err_msg=backend)


@settings(max_examples=8)   # ~5 s each (every fast backend, eager and jit)
@given(case=cases())
def test_jax_nn_parity_breadth(case):
    _check(FAST, case)


@pytest.mark.parametrize("backend", KERNELS)
@settings(max_examples=3)
@given(case=cases(shapes=(0,)))
def test_jax_nn_parity_kernels(backend, case):
    _check([backend], case)


@pytest.mark.parametrize("backend", ALL)
def test_broadcast_bias_gradient_has_the_bias_shape(backend):
    """Padding-style [B,1,1,S] bias and [B,1,1,S] mask under vmap-free grad: values and shape."""
    shape = SHAPES[0]
    q, k, v = _qkv(shape)
    r = np.random.default_rng(1)
    bias = r.standard_normal((2, 1, 1, 8)).astype(np.float32)
    mask = r.random((2, 1, 1, 8)) > 0.2
    loss = lambda f, q, b: (f(q, b) ** 2).sum()  # noqa: E731
    ours = jax.jit(jax.grad(lambda q, b: loss(lambda q, b: flashlab.attention(
        q, k, v, b, mask, backend=backend), q, b), argnums=(0, 1)))(q, bias)
    theirs = jax.jit(jax.grad(lambda q, b: loss(lambda q, b: jax.nn.dot_product_attention(
        q, k, v, b, mask), q, b), argnums=(0, 1)))(q, bias)
    assert ours[1].shape == bias.shape
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a, b, atol=GTOL, rtol=0)


# (mask form, bias form, bias differentiated): the padding masks and per-row biases that the
# kernels read in their broadcast form (a block of 1 on T or S); a constant bias keeps that
# form in the backward too, a differentiated one is read at full T/S there.
LENGTH1_FORMS = [("B11S", "B1T1", True), ("BN1S", "B11S", True), ("B1T1", "1N11", False)]


@pytest.mark.parametrize("backend,mask_form,bias_form,with_dbias",
                         [("pallas_tpu", *f) for f in LENGTH1_FORMS] + [("tiled", *LENGTH1_FORMS[0])])
def test_length1_t_or_s_dims_forward_and_gradients(backend, mask_form, bias_form, with_dbias):
    """Mask/bias with a T or S dim of 1: output and dq, dk, dv (and dbias, in the bias's own
    shape) equal the reference rung's within the fp32 tolerances above (the reference, not
    jax.nn: a [B, 1, T, 1] mask empties whole rows, which jax.nn fills with mean(V); the
    reference itself is held to jax.nn on these forms by the breadth test above)."""
    shape = SHAPES[1]
    q, k, v = _qkv(shape, seed=3)
    r = np.random.default_rng(4)
    mask, bias = _form("mask", shape, r, mask_form), _form("bias", shape, r, bias_form)
    argnums = (0, 1, 2, 3) if with_dbias else (0, 1, 2)

    def grads(f):
        loss = lambda q, k, v, b: (f(q, k, v, b, mask) ** 2).sum()
        return jax.jit(jax.value_and_grad(loss, argnums=argnums))(q, k, v, bias)

    (lo, ours) = grads(lambda *a: flashlab.attention(*a, backend=backend))
    (lt, theirs) = grads(lambda *a: flashlab.attention(*a, backend="reference"))
    np.testing.assert_allclose(lo, lt, rtol=1e-5)
    np.testing.assert_allclose(flashlab.attention(q, k, v, bias, mask, backend=backend),
                               flashlab.attention(q, k, v, bias, mask, backend="reference"),
                               atol=ATOL, rtol=0)
    if with_dbias:
        assert ours[3].shape == bias.shape
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a, b, atol=GTOL, rtol=0)


def test_length1_t_or_s_dims_stay_1_in_the_spec_and_the_kernel_blocks():
    """No [.., T, S] copy of a [B, 1, 1, S] mask or a [B, 1, T, 1] bias: the spec keeps the 1s
    and the forward and backward kernels' BlockSpecs read a block of 1 at block index 0."""
    from flashlab.contract.masks import validate
    from flashlab.kernels.backward_grid import backward_grid_specs, make_backward_config
    from flashlab.kernels.forward_config import make_config
    from flashlab.kernels.forward_grid import forward_grid_spec
    B, T, S = SHAPES[0][:3]
    q, k, v = _qkv(SHAPES[0])
    r = np.random.default_rng(0)
    _, _, _, spec = validate(q, k, v, _form("bias", SHAPES[0], r, "B1T1"),
                             _form("mask", SHAPES[0], r, "B11S"))
    assert spec.bias.shape == (B, 1, T, 1) and spec.mask.shape == (B, 1, 1, S)
    cfg = make_config(spec, chip="v5e")
    specs = [forward_grid_spec(cfg)]
    specs += backward_grid_specs(make_backward_config(spec, chip="v5e"), with_dbias=False).values()
    for gs in specs:
        c = gs.config
        for name, one, block in (("bias", 3, (None, None, c.block_q, 1)),
                                 ("mask", 2, (None, None, 1, c.block_k))):
            assert tuple(gs.spec(name).block_shape) == block, (getattr(gs, "name", "fwd"), name)
            assert gs.shape(name).shape[one] == 1
            idx = gs.spec(name).index_map(*(1,) * len(gs.grid),
                                          *(np.full((B,), n, np.int32) for n in (T, S)))
            assert idx[one] == 0


@pytest.mark.parametrize("backend", ALL)
def test_traced_lengths_above_the_dimension_are_clamped(backend):
    """Traced lengths > seq under jit == eager with the clamped lengths (pallas was 6e-2 off)."""
    q, k, v = _qkv(SHAPES[0])
    big = np.array([11, 5], np.int32)
    f = jax.jit(lambda q, L: flashlab.attention(q, k, v, key_value_seq_lengths=L,
                                                query_seq_lengths=L, backend=backend))
    g = jax.jit(jax.grad(lambda q, L: f(q, L).sum()))
    L = np.array([8, 5], np.int32)
    want = flashlab.attention(q, k, v, key_value_seq_lengths=L, query_seq_lengths=L,
                              backend="reference")
    np.testing.assert_allclose(f(q, big), want, atol=ATOL, rtol=0)
    gw = jax.grad(lambda q: flashlab.attention(q, k, v, key_value_seq_lengths=L,
                                               query_seq_lengths=L, backend="reference").sum())(q)
    np.testing.assert_allclose(g(q, big), gw, atol=GTOL, rtol=0)
    with pytest.raises(ValueError, match=r"key_value_seq_lengths: expected values in \[0, 8\], got \[11, 5\]"):
        flashlab.attention(q, k, v, key_value_seq_lengths=big, backend=backend)


# ----------------------------------------------------------------------------- NaN / inf

@pytest.mark.parametrize("backend", ALL)
def test_nan_and_inf_propagate_like_jax_nn_but_empty_rows_are_zero(backend):
    q, k, v = _qkv(SHAPES[0])
    qn = q.copy()
    qn[0, 3, 1, 0] = np.nan                      # one query row's logits are NaN
    ki = k.copy()
    ki[1, 5, 0, 0] = np.inf                      # a +inf key: rows that see it are NaN
    bias = np.zeros((2, 4, 8, 8), np.float32)
    bias[0, 2, 6, :] = -np.inf                   # a row blanked by a -inf bias: 0, not NaN
    for args in ((qn, k, v), (q, ki, v)):
        out = np.asarray(flashlab.attention(*args, is_causal=True, backend=backend))
        ref = np.asarray(jax.nn.dot_product_attention(args[0], np.repeat(args[1], 2, 2),
                                                      np.repeat(args[2], 2, 2), is_causal=True))
        np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
        assert np.isnan(out).any()
    out = np.asarray(flashlab.attention(q, k, v, bias, is_causal=True, backend=backend))
    assert not np.isnan(out).any() and np.all(out[0, 6, 2] == 0)
    g = jax.jit(jax.grad(lambda q: flashlab.attention(q, k, v, bias, is_causal=True,
                                                      backend=backend).sum()))(q)
    assert np.isfinite(g).all() and np.all(g[0, 6, 2] == 0)
    gn = jax.jit(jax.grad(lambda q: flashlab.attention(q, k, v, is_causal=True,
                                                       backend=backend).sum()))(qn)
    assert np.isnan(gn[0, 3, 1]).all(), "the gradient of a NaN row must be NaN"


@pytest.mark.parametrize("backend", ["reference", "tiled"])
def test_debug_nans_fires_on_nan_and_never_on_empty_rows(backend):
    q, k, v = _qkv(SHAPES[0])
    mask = np.ones((2, 1, 8, 8), bool)
    mask[:, :, 2] = False                         # fully masked rows: no NaN anywhere
    with jax.debug_nans(True):
        flashlab.attention(q, k, v, mask=mask, backend=backend).block_until_ready()
        jax.grad(lambda q: flashlab.attention(q, k, v, mask=mask, backend=backend).sum())(q)
        qn = q.copy()
        qn[0, 1, 0, 0] = np.nan
        with pytest.raises(FloatingPointError):
            flashlab.attention(qn, k, v, mask=mask, backend=backend).block_until_ready()


# ----------------------------------------------------------------------------- signature

@pytest.mark.parametrize("backend", ALL)
def test_scale_is_data_learnable_and_does_not_recompile(backend):
    q, k, v = _qkv(SHAPES[0])
    kr, vr = np.repeat(k, 2, 2), np.repeat(v, 2, 2)
    t = jnp.float32(0.3)
    ours = jax.jit(jax.grad(lambda t: flashlab.attention(q, k, v, scale=t,
                                                         backend=backend).sum()))(t)
    theirs = jax.grad(lambda t: jax.nn.dot_product_attention(q, kr, vr, scale=t).sum())(t)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5)
    f = jax.jit(lambda q, s: flashlab.attention(q, k, v, scale=s, backend=backend))
    f(q, 0.5)
    n = f._cache_size()
    for s in (0.51, 0.52):
        np.testing.assert_allclose(f(q, s), jax.nn.dot_product_attention(q, kr, vr, scale=s),
                                   atol=ATOL)
        flashlab.attention(q, k, v, scale=s, backend=backend)
    assert f._cache_size() == n


def test_unbatched_lists_empty_and_jax_nn_keywords():
    q, k, v = _qkv(SHAPES[0])
    kr, vr = np.repeat(k, 2, 2), np.repeat(v, 2, 2)
    out = flashlab.attention(q[0], kr[0], vr[0])                     # [T, N, H]
    np.testing.assert_allclose(out, jax.nn.dot_product_attention(q[0], kr[0], vr[0]), atol=ATOL)
    out = flashlab.attention(q[0].tolist(), kr[0].tolist(), vr[0].tolist(), is_causal=True)
    np.testing.assert_allclose(out, jax.nn.dot_product_attention(q[0], kr[0], vr[0],
                                                                 is_causal=True), atol=ATOL)
    for T, S in ((0, 8), (8, 0), (0, 0)):
        qq, kk = np.zeros((2, T, 4, 16), np.float32), np.zeros((2, S, 4, 16), np.float32)
        ours, theirs = flashlab.attention(qq, kk, kk), jax.nn.dot_product_attention(qq, kk, kk)
        assert ours.shape == theirs.shape
        np.testing.assert_array_equal(ours, theirs)
    out, lse = flashlab.attention(q, k, v, is_causal=True, return_residual=True)
    o2, lse2 = jax.nn.dot_product_attention(q, kr, vr, is_causal=True, return_residual=True)
    assert lse.shape == lse2.shape == (2, 8, 4)
    np.testing.assert_allclose(out, o2, atol=ATOL)
    np.testing.assert_allclose(lse, lse2, atol=ATOL)
    assert flashlab.explain(q, k, v, implementation="xla").backend == "xla"
    np.testing.assert_allclose(flashlab.attention(q, k, v, implementation="xla"),
                               jax.nn.dot_product_attention(q, kr, vr, implementation="xla"),
                               atol=ATOL)


def test_vmap_over_a_leading_axis_matches_jax_nn():
    q, k, v = _qkv(SHAPES[0])
    kr, vr = np.repeat(k, 2, 2), np.repeat(v, 2, 2)
    mask = np.random.default_rng(3).random((2, 1, 1, 8)) > 0.2
    ours = jax.vmap(lambda q, k, v, m: flashlab.attention(q, k, v, mask=m, backend="tiled"))(
        q[:, None], k[:, None], v[:, None], mask[:, None])
    theirs = jax.vmap(lambda q, k, v, m: jax.nn.dot_product_attention(q, k, v, mask=m))(
        q[:, None], kr[:, None], vr[:, None], mask[:, None])
    np.testing.assert_allclose(ours, theirs, atol=ATOL)


def test_int64_segment_ids_and_float64_are_exact():
    q, k, v = _qkv(SHAPES[0])
    with jax.enable_x64(True):
        seg = np.array([[0, 0, 0, 2**32, 2**32, 2**32, 0, 0]] * 2, np.int64)
        same = (seg == 0).astype(np.int32)
        want = flashlab.attention(q, k, v, segment_ids=same, backend="reference")
        np.testing.assert_allclose(flashlab.attention(q, k, v, segment_ids=seg,
                                                      backend="reference"), want, atol=ATOL)
        for backend in KERNELS:      # they narrow ids to int32 inside: ranks, traced too
            traced = jax.jit(lambda s: flashlab.attention(q, k, v, segment_ids=s,
                                                          backend=backend))(seg)
            np.testing.assert_allclose(traced, want, atol=ATOL)
        q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
        o = flashlab.attention(q64, k64, v64, is_causal=True, backend="tiled")
        assert o.dtype == jnp.float64
        G = 2
        np.testing.assert_allclose(o, oracle_attention(q64, np.repeat(k64, G, 2),
                                                       np.repeat(v64, G, 2), is_causal=True),
                                   atol=1e-12, rtol=0)


# ----------------------------------------------------------------------------- bad input

B, T, S, N, K, H = SHAPES[0]
_q, _k, _v = _qkv(SHAPES[0])
BAD = [
    # (overrides, exception, fragments that must all be in the message: argument and value)
    (dict(mask=np.ones((B, 3, T, S), bool)), ValueError, ["mask", "(2, 3, 8, 8)"]),
    (dict(mask=np.ones((B, 1, T, S), np.float32)), TypeError, ["mask", "float32"]),
    (dict(mask=np.ones((1, B, N, T, S), bool)), ValueError, ["mask", "rank 5"]),
    (dict(bias=np.ones((T, S + 1), np.float32)), ValueError, ["bias", "(8, 9)"]),
    (dict(bias=np.ones((B, 1, T, S), np.complex64)), TypeError, ["bias", "complex64"]),
    (dict(query=_q.astype(np.int32)), TypeError, ["query", "int32"]),
    (dict(query=_q[..., None]), ValueError, ["query", "rank 5"]),
    (dict(key=np.zeros((3, S, K, H), np.float32)), ValueError, ["key", "(3, 8, 2, 16)"]),
    (dict(value=np.zeros((B, S + 1, K, H), np.float32)), ValueError, ["value", "(2, 9, 2, 16)"]),
    (dict(key=np.zeros((B, S, 3, H), np.float32), value=np.zeros((B, S, 3, H), np.float32)),
     ValueError, ["key", "3 heads"]),
    (dict(key=_k.astype(np.float16)), TypeError, ["dtype", "float16"]),
    (dict(is_causal="yes"), TypeError, ["is_causal", "'yes'"]),
    (dict(is_causal=1), TypeError, ["is_causal", "1"]),
    (dict(scale=float("nan")), ValueError, ["scale", "nan"]),
    (dict(scale="x"), TypeError, ["scale", "'x'"]),
    (dict(scale=np.ones(2, np.float32)), ValueError, ["scale", "(2,)"]),
    (dict(logits_soft_cap=float("inf")), ValueError, ["logits_soft_cap", "inf"]),
    (dict(logits_soft_cap=0.0), ValueError, ["logits_soft_cap", "0.0"]),
    (dict(local_window_size=-1), ValueError, ["local_window_size", "-1"]),
    (dict(local_window_size=1.5), TypeError, ["local_window_size", "1.5"]),
    (dict(local_window_size=(1, 2, 3)), TypeError, ["local_window_size", "(1, 2, 3)"]),
    (dict(key_value_seq_lengths=np.array([1, 9])), ValueError,
     ["key_value_seq_lengths", "[1, 9]", "[0, 8]"]),
    (dict(query_seq_lengths=np.array([1.0, 2.0])), TypeError, ["query_seq_lengths", "float64"]),
    (dict(query_seq_lengths=np.array([1, 2, 3])), ValueError, ["query_seq_lengths", "(3,)"]),
    (dict(segment_ids=np.zeros((B, T), np.float32)), TypeError, ["segment_ids", "float32"]),
    (dict(segment_ids=np.zeros((B, T + 1), np.int32)), ValueError, ["segment_ids", "(2, 9)"]),
    (dict(implementation="pallas"), ValueError, ["implementation", "'pallas'"]),
    (dict(implementation="xla", backend="tiled"), ValueError, ["implementation", "'tiled'"]),
    (dict(return_residual=True, backend="xla"), NotImplementedError, ["return_residual", "'xla'"]),
    (dict(return_residual="yes"), TypeError, ["return_residual", "'yes'"]),
    (dict(backend="nope"), ValueError, ["backend", "'nope'"]),
    (dict(backend="xla", logits_soft_cap=5.0), NotImplementedError, ["xla", "soft_cap"]),
    (dict(query=_q.astype(np.float16), key=_k.astype(np.float16), value=_v.astype(np.float16),
          backend="pallas_tpu"), NotImplementedError, ["pallas_tpu", "float16"]),
]


@pytest.mark.parametrize("override,exc,fragments", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_input_names_the_argument_and_the_value(override, exc, fragments):
    args = dict(query=_q, key=_k, value=_v)
    args.update({n: x for n, x in override.items() if n in args})
    kw = {n: x for n, x in override.items() if n not in args}
    with pytest.raises(exc) as info:
        flashlab.attention(args["query"], args["key"], args["value"], **kw)
    for f in fragments:
        assert f in str(info.value), (f, str(info.value))


def test_a_traced_is_causal_is_refused_by_name():
    with pytest.raises(TypeError, match="is_causal: expected a static bool"):
        jax.jit(lambda c: flashlab.attention(_q, _k, _v, is_causal=c))(True)
