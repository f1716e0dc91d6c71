"""Property tests of flashlab.ladder.online_softmax: blocks in any split and any order give softmax."""
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings, strategies as st

from flashlab.ladder import online_softmax as osm

ATOL = 2e-6   # fp32, unit-normal scores and values: max abs error vs float64 softmax·V


def _softmax_out(s, v, vis):
    """Float64 reference: softmax over the visible keys of each row, times v; and lse."""
    s = np.where(vis, s.astype(np.float64), -np.inf)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.where(vis, np.exp(s - m), 0.0)
    l = p.sum(-1, keepdims=True)
    out = (p / np.where(l > 0, l, 1.0)) @ v.astype(np.float64)
    with np.errstate(divide="ignore"):
        lse = np.where(l[..., 0] > 0, m[..., 0] + np.log(np.where(l[..., 0] > 0, l[..., 0], 1)),
                       -np.inf)
    return out, lse


def _state_of(s, v, vis, cuts):
    """One state per block of keys between consecutive cut points."""
    states = []
    edges = [0, *cuts, s.shape[-1]]
    for a, b in zip(edges[:-1], edges[1:]):
        st_ = osm.init(s.shape[:-1], v.shape[-1])
        states.append(osm.update(st_, jnp.asarray(s[..., a:b]), jnp.asarray(v[a:b]),
                                 jnp.asarray(vis[..., a:b])))
    return states


problem = st.tuples(st.integers(1, 5), st.integers(2, 40), st.integers(1, 6),
                    st.integers(0, 2**16 - 1), st.floats(0.0, 0.9))


def _make(rows, keys, d, seed, p_masked, scale=3.0):
    rng = np.random.default_rng(seed)
    s = (scale * rng.standard_normal((rows, keys))).astype(np.float32)
    v = rng.standard_normal((keys, d)).astype(np.float32)
    vis = rng.random((rows, keys)) >= p_masked
    return rng, s, v, vis


@settings(max_examples=8)   # ~4 s each: eager merges of new shapes
@given(problem, st.data())
def test_any_split_any_order_equals_softmax(prob, data):
    rows, keys, d, seed, p_masked = prob
    rng, s, v, vis = _make(rows, keys, d, seed, p_masked)
    n_cuts = data.draw(st.integers(0, min(5, keys - 1)))
    cuts = sorted(data.draw(st.lists(st.integers(1, keys - 1), min_size=n_cuts,
                                     max_size=n_cuts, unique=True)))
    states = _state_of(s, v, vis, cuts)
    order = data.draw(st.permutations(range(len(states))))
    acc = states[order[0]]
    for i in order[1:]:
        acc = osm.merge(acc, states[i])
    out, lse = osm.finalize(acc)
    ref, ref_lse = _softmax_out(s, v, vis)
    np.testing.assert_allclose(np.asarray(out), ref, atol=ATOL, rtol=0)
    np.testing.assert_allclose(np.asarray(lse), ref_lse, atol=ATOL, rtol=1e-6)


@settings(max_examples=10)
@given(problem)
def test_sequential_updates_equal_softmax(prob):
    """Folding blocks one after another with update (the tiled rung's loop)."""
    rows, keys, d, seed, p_masked = prob
    _, s, v, vis = _make(rows, keys, d, seed, p_masked)
    state = osm.init((rows,), d)
    for a in range(0, keys, 7):
        state = osm.update(state, jnp.asarray(s[:, a:a + 7]), jnp.asarray(v[a:a + 7]),
                           jnp.asarray(vis[:, a:a + 7]))
    out, lse = osm.finalize(state)
    ref, ref_lse = _softmax_out(s, v, vis)
    np.testing.assert_allclose(np.asarray(out), ref, atol=ATOL, rtol=0)
    np.testing.assert_allclose(np.asarray(lse), ref_lse, atol=ATOL, rtol=1e-6)


def _close(a: osm.State, b: osm.State, atol=1e-5):
    for x, y in zip(a, b):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol, rtol=1e-6)


@settings(max_examples=10)
@given(problem)
def test_merge_associative_and_commutative(prob):
    rows, keys, d, seed, p_masked = prob
    _, s, v, vis = _make(rows, keys, d, seed, p_masked)
    cuts = sorted({max(1, keys // 3), max(1, 2 * keys // 3)} - {keys})
    states = _state_of(s, v, vis, cuts)
    while len(states) < 3:
        states.append(osm.init((rows,), d))          # the empty state is the identity
    a, b, c = states[:3]
    # Compare finalized values (m may differ only where l == 0, and then both are empty).
    _close(osm.merge(a, b), osm.merge(b, a))
    _close(osm.merge(osm.merge(a, b), c), osm.merge(a, osm.merge(b, c)))
    _close(osm.merge(a, osm.init((rows,), d)), a)


def test_fully_masked_rows_finalize_to_zero_and_neg_inf():
    rng = np.random.default_rng(0)
    s = rng.standard_normal((3, 10)).astype(np.float32)
    v = rng.standard_normal((10, 4)).astype(np.float32)
    vis = np.ones((3, 10), bool)
    vis[1] = False
    state = osm.init((3,), 4)
    for a in (0, 5):
        state = osm.update(state, jnp.asarray(s[:, a:a + 5]), jnp.asarray(v[a:a + 5]),
                           jnp.asarray(vis[:, a:a + 5]))
    state = osm.merge(state, osm.init((3,), 4))
    out, lse = osm.finalize(state)
    out, lse = np.asarray(out), np.asarray(lse)
    assert np.all(out[1] == 0) and np.isneginf(lse[1])
    assert np.isfinite(out).all() and np.isfinite(lse[[0, 2]]).all()
    # Scores given as -inf (instead of a mask) behave the same.
    st2 = osm.update(osm.init((1,), 4), jnp.full((1, 10), -jnp.inf), jnp.asarray(v))
    o2, l2 = osm.finalize(st2)
    assert np.all(np.asarray(o2) == 0) and np.isneginf(np.asarray(l2)).all()


def test_nan_logits_finalize_to_nan_and_empty_rows_to_zero():
    """'No visible key' (m = -inf) and 'NaN logits' (m or l NaN) are told apart: only the
    first is 0. A +inf logit gives NaN too (exp(inf - inf)), as in jax.nn."""
    v = jnp.ones((4, 2), jnp.float32)
    s = jnp.zeros((4, 4), jnp.float32).at[0, 1].set(jnp.nan).at[1, 2].set(jnp.inf)
    vis = jnp.ones((4, 4), bool).at[3].set(False).at[2, 1].set(False)
    s = s.at[2, 1].set(jnp.nan)                  # NaN under the mask: invisible, harmless
    state = osm.merge(osm.update(osm.init((4,), 2), s[:, :2], v[:2], vis[:, :2]),
                      osm.update(osm.init((4,), 2), s[:, 2:], v[2:], vis[:, 2:]))
    out, lse = (np.asarray(x) for x in osm.finalize(state))
    assert np.isnan(out[:2]).all() and np.isnan(lse[:2]).all()
    assert np.allclose(out[2], 1.0) and np.isfinite(lse[2])
    assert np.all(out[3] == 0) and np.isneginf(lse[3])


def test_lanes_finalize_needs_no_empty_row_test():
    """The kernels' layout (m, l lane-replicated [rows, 128]): every seen row's l is at least 1
    exactly (finalize takes 1 / max(l, 1) instead of testing m per element), an empty row
    still gives 0 and lse -inf, NaN logits NaN, and seen rows match the plain layout."""
    L = 128
    rng = np.random.default_rng(3)
    s = jnp.asarray(rng.standard_normal((5, 8)) * 30, jnp.float32).at[0, 1].set(jnp.nan)
    v = jnp.asarray(rng.standard_normal((8, 2)), jnp.float32)
    vis = jnp.ones((5, 8), bool).at[3].set(False).at[4, :6].set(False)
    lanes = osm.State(jnp.full((5, L), osm.NEG_INF), jnp.zeros((5, L)), jnp.zeros((5, 2)))
    plain = osm.init((5,), 2)
    for a in (0, 4):
        cut = (s[:, a:a + 4], v[a:a + 4], vis[:, a:a + 4])
        lanes = osm.update(lanes, *cut, lanes=True)
        plain = osm.update(plain, *cut)
    seen = [1, 2, 4]
    assert (np.asarray(lanes.l)[seen] >= 1.0).all()
    out, lse = (np.asarray(x) for x in osm.finalize(lanes, lanes=True,
                                                     inverse=lambda l: 1.0 / l))
    ref, ref_lse = (np.asarray(x) for x in osm.finalize(plain))
    assert np.isnan(out[0]).all() and np.all(out[3] == 0) and np.isneginf(lse[3]).all()
    np.testing.assert_allclose(out[seen], ref[seen], rtol=1e-6)
    np.testing.assert_allclose(lse[seen, 0], ref_lse[seen], rtol=1e-6)
