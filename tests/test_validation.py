"""Every bad input raises a clear ValueError/TypeError naming the argument."""
import jax.numpy as jnp
import numpy as np
import pytest

from flashlab import naive_attention
from flashlab.contract.masks import block_maybe_visible, structural_visible

B, T, S, N, K, H = 2, 8, 6, 4, 2, 16
q = np.zeros((B, T, N, H), np.float32)
k = np.zeros((B, S, K, H), np.float32)
v = np.zeros((B, S, K, H), np.float32)

BAD = [
    # (kwargs or positional overrides, exception, message fragment)
    (dict(query=q[0]), ValueError, "query: expected rank 4"),   # rank 3 only via attention()
    (dict(key=k[..., 0]), ValueError, "key: expected rank 4"),
    (dict(key=np.zeros((3, S, K, H), np.float32)), ValueError, "key: expected batch 2"),
    (dict(key=np.zeros((B, S, K, 8), np.float32)), ValueError, "key: expected head_dim 16"),
    (dict(value=np.zeros((B, S + 1, K, H), np.float32)), ValueError, "value: expected shape"),
    (dict(key=np.zeros((B, S, 3, H), np.float32), value=np.zeros((B, S, 3, H), np.float32)),
     ValueError, "query heads (4) must be a multiple of kv heads"),
    (dict(query=q.astype(np.int32)), TypeError, "query: expected a floating dtype"),
    (dict(value=v.astype(np.complex64)), TypeError, "value: expected a floating dtype"),
    (dict(key=k.astype(np.float16)), TypeError, "expected one dtype"),
    (dict(query="q"), TypeError, "query: expected a jax or numpy array"),
    (dict(query=[[1.0]]), ValueError, "query: expected rank 4"),
    (dict(query=[[None]]), TypeError, "query: expected a jax or numpy array"),
    (dict(mask=np.ones((1, B, N, T, S), bool)), ValueError, "mask: expected rank <= 4"),
    (dict(mask=np.ones((B, N, T, S + 1), bool)), ValueError, "mask: expected shape"),
    (dict(mask=np.ones((B, 3, T, S), bool)), ValueError, "mask: expected shape [2 or 1, 4 or 1"),
    (dict(mask=np.ones((B, 1, T, S), np.float32)), TypeError, "mask: expected dtype bool"),
    (dict(bias=np.ones((B, 1, T, 2), np.float32)), ValueError, "bias: expected shape"),
    (dict(bias=np.ones((T + 1, S), np.float32)), ValueError, "bias: expected shape"),
    (dict(bias=np.ones((B, 1, T, S), np.complex64)), TypeError, "bias: expected a real"),
    (dict(local_window_size=-1), ValueError, "local_window_size: left must be >= 0"),
    (dict(local_window_size=(2, -3)), ValueError, "local_window_size: right must be >= 0"),
    (dict(local_window_size=1.5), TypeError, "local_window_size"),
    (dict(local_window_size=(1, 2, 3)), TypeError, "local_window_size"),
    (dict(query_seq_lengths=np.array([1, 2, 3])), ValueError, "query_seq_lengths: expected shape [batch] = [2]"),
    (dict(key_value_seq_lengths=np.array([[1, 2]])), ValueError, "key_value_seq_lengths: expected shape"),
    (dict(key_value_seq_lengths=np.array([1.0, 2.0])), TypeError, "key_value_seq_lengths: expected an integer"),
    (dict(key_value_seq_lengths=np.array([1, 7])), ValueError, "key_value_seq_lengths: expected values in [0, 6]"),
    (dict(query_seq_lengths=np.array([-1, 2])), ValueError, "query_seq_lengths: expected values"),
    (dict(logits_soft_cap=0.0), ValueError, "logits_soft_cap: expected a float > 0"),
    (dict(logits_soft_cap=-2.0), ValueError, "logits_soft_cap"),
    (dict(logits_soft_cap="3"), TypeError, "logits_soft_cap"),
    (dict(logits_soft_cap=float("inf")), ValueError, "logits_soft_cap: expected a float > 0 and finite"),
    (dict(segment_ids=np.zeros((B, T), np.int32)), ValueError, "segment_ids: a single array needs q_seq == kv_seq"),
    (dict(segment_ids=(np.zeros((B, T), np.int32), np.zeros((B, S + 1), np.int32))), ValueError,
     "segment_ids (key/value): expected shape [batch, seq] = [2, 6]"),
    (dict(segment_ids=(np.zeros((B, T), np.float32), np.zeros((B, S), np.int32))), TypeError,
     "segment_ids (query): expected an integer dtype"),
    (dict(is_causal="yes"), TypeError, "is_causal"),
    (dict(scale=float("nan")), ValueError, "scale"),
]


@pytest.mark.parametrize("override,exc,fragment", BAD, ids=[b[2][:40] for b in BAD])
def test_bad_input_raises_named_error(override, exc, fragment):
    args = dict(query=q, key=k, value=v)
    args.update({n: x for n, x in override.items() if n in args})
    kw = {n: x for n, x in override.items() if n not in ("query", "key", "value")}
    with pytest.raises(exc) as info:
        naive_attention(args["query"], args["key"], args["value"], **kw)
    assert fragment in str(info.value), str(info.value)


def test_valid_broadcast_shapes_are_accepted():
    naive_attention(q, k, v, mask=np.ones((1, 1, T, S), bool), bias=np.zeros((B, N, T, S), np.float32))
    naive_attention(q, k, v, mask=np.ones((T, S), bool), bias=np.zeros((B, 1, T, 1), np.int32))
    naive_attention(q, k, v, local_window_size=(None, 2))


def test_structural_visible_matches_definitions():
    i = jnp.arange(6)[:, None]
    j = jnp.arange(6)[None, :]
    np.testing.assert_array_equal(structural_visible(i, j, is_causal=True), np.tril(np.ones((6, 6), bool)))
    w = structural_visible(i, j, window=(1, 2))
    assert w[3].tolist() == [False, False, True, True, True, True]


def test_block_maybe_visible_is_conservative():
    """200 random blocks, windows and causal flags: the block test says "maybe visible" exactly
    when some position pair is. The dense side is one batched call of the one definition,
    blocks padded to 8 x 8 and cut back by their lengths (a loop of 200 eager calls compiled
    a new shape each time: 22 s)."""
    rng = np.random.default_rng(0)
    n = 200
    qs, ks = rng.integers(0, 40, (2, n))
    bq, bk = rng.integers(1, 9, (2, n))
    left, right = rng.integers(0, 10, (2, n))
    causal = rng.integers(0, 2, n).astype(bool)
    col = lambda x: x[:, None, None]                                   # noqa: E731
    q_pos = col(qs) + np.arange(8)[None, :, None]                      # [n, 8, 1]
    k_pos = col(ks) + np.arange(8)[None, None, :]                      # [n, 1, 8]
    dense = {c: np.asarray(structural_visible(
        q_pos, k_pos, is_causal=c, window=(col(left), col(right)), q_len=col(qs + bq),
        kv_len=col(ks + bk))).any(axis=(1, 2)) for c in (False, True)}
    for t in range(n):
        got = block_maybe_visible(int(qs[t]), int(qs[t] + bq[t]), int(ks[t]), int(ks[t] + bk[t]),
                                  is_causal=bool(causal[t]),
                                  window=(int(left[t]), int(right[t])))
        assert bool(got) == bool(dense[bool(causal[t])][t]), t
