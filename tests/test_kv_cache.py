"""KVCache: appends at each sequence's own length, page allocation from the pool, capacity.

Every read goes through flashlab.decode_attention (reference backend) and is compared with
the float64 decode oracle on the same cache (fp32 tolerance 2e-5 absolute).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flashlab.ladder.decode import oracle_decode_attention
from flashlab.serving.kv_cache import KVCache

B, K, N, D = 3, 2, 4, 8


def _kv(rng, n):
    return (jnp.asarray(rng.standard_normal((B, n, K, D)), jnp.float32),
            jnp.asarray(rng.standard_normal((B, n, K, D)), jnp.float32))


def _fill(cache, rng, steps):
    """Append chunks with some sequences inactive; returns the cache and each row's history."""
    hist = [[] for _ in range(B)]
    for n, active in steps:
        k, v = _kv(rng, n)
        cache = cache.append(k, v, active=np.array(active))
        for b in range(B):
            if active[b]:
                hist[b].append((np.asarray(k[b]), np.asarray(v[b])))
    return cache, hist


STEPS = [(5, (1, 1, 1)), (1, (1, 0, 1)), (3, (0, 1, 1)), (1, (1, 1, 0))]


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_append_then_attend_matches_oracle(kind):
    rng = np.random.default_rng(0)
    cache = (KVCache.contiguous(B, 16, K, D) if kind == "contiguous"
             else KVCache.paged(B, num_pages=12, page_size=4, kv_heads=K, head_dim=D,
                                pages_per_sequence=4))
    cache, hist = _fill(cache, rng, STEPS)
    want = [sum(n for n, a in STEPS if a[b]) for b in range(B)]
    assert np.asarray(cache.lengths).tolist() == want == [7, 9, 9]
    for b in range(B):     # what was appended is what the cache holds, in order
        k_b = np.concatenate([k for k, _ in hist[b]])
        if cache.is_paged:
            table = np.asarray(cache.page_table)[b]
            held = np.concatenate([np.asarray(cache.k)[p] for p in table if p >= 0])
        else:
            held = np.asarray(cache.k)[b]
        np.testing.assert_array_equal(held[:want[b]], k_b)
    q = jnp.asarray(rng.standard_normal((B, 1, N, D)), jnp.float32)
    out = cache.attend(q, backend="reference")
    ref = oracle_decode_attention(q, cache.k, cache.v, cache_lengths=cache.lengths,
                                  page_table=cache.page_table)
    np.testing.assert_allclose(np.asarray(out), ref, atol=2e-5, rtol=0)


def test_pages_come_from_the_pool_and_go_back():
    cache = KVCache.paged(2, num_pages=5, page_size=4, kv_heads=K, head_dim=D)
    k = jnp.zeros((2, 6, K, D))
    cache = cache.append(k, k)                       # 2 pages each: 4 of 5 taken
    assert int(cache.num_free) == 1
    table = np.asarray(cache.page_table)
    assert sorted(table[:, :2].ravel().tolist()) == [0, 1, 2, 3] and (table[:, 2:] == -1).all()
    with pytest.raises(ValueError, match="needs 2 new pages .* pool has 1 free of 5"):
        cache.append(jnp.zeros((2, 3, K, D)), jnp.zeros((2, 3, K, D)))
    cache = cache.release(np.array([True, False]))   # row 0's two pages go back
    assert int(cache.num_free) == 3 and int(cache.lengths[0]) == 0
    cache = cache.append(jnp.zeros((2, 3, K, D)), jnp.zeros((2, 3, K, D)))
    assert int(cache.num_free) == 1
    used = np.asarray(cache.page_table)
    used = used[used >= 0]
    assert len(set(used.tolist())) == len(used) == 4      # no page handed out twice


def test_capacity_errors_and_bad_inputs():
    cache = KVCache.contiguous(B, 4, K, D)
    k, v = _kv(np.random.default_rng(1), 3)
    cache = cache.append(k, v)
    with pytest.raises(ValueError, match="sequence 0 holds 3 positions; 3 more exceed the cache "
                                         "capacity 4"):
        cache.append(k, v)
    with pytest.raises(ValueError, match=r"k_new: expected shape \[3, new_tokens, 2, 8\]"):
        cache.append(k[:, :, :1], v)
    with pytest.raises(TypeError, match="k_new: expected dtype float32"):
        cache.append(k.astype(jnp.bfloat16), v)
    with pytest.raises(ValueError, match="max_len: expected a positive int, got 0"):
        KVCache.contiguous(B, 0, K, D)


def test_overflow_under_jit_is_loud():
    """Traced lengths cannot raise: the overflowing sequence reads back as NaN rows (and
    outside jit, reading it raises the decode validation's ValueError)."""
    cache = KVCache.paged(2, num_pages=3, page_size=4, kv_heads=K, head_dim=D,
                          pages_per_sequence=2)
    k = jnp.ones((2, 6, K, D))
    step = jax.jit(lambda c, k: c.append(k, k, active=jnp.array([True, False])))
    cache = step(cache, k)                            # row 0: 6 positions, 2 pages
    cache = step(cache, k)                            # row 0: 12 > capacity 8
    out = jax.jit(lambda c: c.attend(jnp.ones((2, 1, N, D)), backend="reference"))(cache)
    assert np.isnan(np.asarray(out[0])).all() and (np.asarray(out[1]) == 0).all()
    with pytest.raises(ValueError, match=r"cache_lengths: .* got \[12, 0\]"):
        cache.attend(jnp.ones((2, 1, N, D)), backend="reference")
