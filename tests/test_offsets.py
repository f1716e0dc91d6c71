"""Offsets in the contract: blocks at global positions, for every backend that declares them.

``q_offset``/``kv_offset`` place the query and key blocks at global positions; causal, window
and lengths are evaluated there (lengths are global), segment ids are local. Checked against
the float64 oracle (which shifts its positions independently), forward and gradients, with
static and traced offsets, and with enough blocks that the skipping paths run.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flashlab import attention
from flashlab.contract import masks
from flashlab.dispatch.conformance import FP32_ATOL, GRAD_RTOL, oracle_grads, random_qkv
from flashlab.kernels import blocks as blk
from flashlab.ladder.reference import oracle_attention

CASES = {  # (T, S, q_offset, kv_offset, mask kwargs)
    "causal_q_after": (16, 24, 40, 20, {"is_causal": True}),
    "causal_q_before": (16, 24, 8, 20, {"is_causal": True}),
    "window_lengths": (16, 24, 50, 30, {"is_causal": True, "local_window_size": (13, 0),
                                        "key_value_seq_lengths": np.array([47, 100]),
                                        "query_seq_lengths": np.array([60, 53])}),
    "window_pair_segments": (16, 24, 5, 9, {"local_window_size": (6, 3)}),
}


def _case(name):
    T, S, qo, ko, kw = CASES[name]
    rng = np.random.default_rng(len(name))
    q, k, v = random_qkv(rng, 2, T, S, 4, 2, 8)
    kw = dict(kw, q_offset=qo, kv_offset=ko)
    if "segments" in name:
        kw["segment_ids"] = (np.sort(rng.integers(0, 3, (2, T)), 1).astype(np.int32),
                             np.sort(rng.integers(0, 3, (2, S)), 1).astype(np.int32))
    return q, k, v, kw


@pytest.mark.parametrize("backend", ["reference", "tiled", "pallas_tpu"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_backends_at_global_positions(backend, name):
    if backend == "pallas_tpu" and name not in ("causal_q_after", "window_lengths"):
        pytest.skip("interpreted kernel: two cases keep CI short (the ring tests run more)")
    q, k, v, kw = _case(name)
    static = {n: kw.pop(n) for n in ("q_offset", "kv_offset")}
    # Offsets traced (as in a ring step) and static give the same, oracle-checked answer.
    f = jax.jit(lambda q, k, v, qo, ko: attention(q, k, v, backend=backend, q_offset=qo,
                                                  kv_offset=ko, **kw))
    out = np.asarray(f(q, k, v, *(jnp.int32(static[n]) for n in ("q_offset", "kv_offset"))))
    ref = oracle_attention(q, k, v, **kw, **static)
    np.testing.assert_allclose(out, ref, atol=FP32_ATOL, rtol=0)
    dout = np.cos(ref).astype(np.float32)
    g = jax.grad(lambda q, k, v: jnp.sum(attention(q, k, v, backend=backend, **kw, **static)
                                         * dout), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(g, oracle_grads(q, k, v, dout, **kw, **static)):
        assert np.abs(np.asarray(a) - b).max() <= GRAD_RTOL * np.abs(b).max()


def test_tiled_skips_blocks_by_global_position():
    from flashlab.ladder.tiled import tiled_attention_from_spec
    q, k, v, kw = _case("window_lengths")
    _, _, _, spec = masks.validate(q, k, v, **kw)
    out = tiled_attention_from_spec(q, k, v, spec, block_q=4, block_k=4)   # 4 x 6 tiles
    np.testing.assert_allclose(np.asarray(out), oracle_attention(q, k, v, **kw), atol=FP32_ATOL)


def test_kernel_skips_blocks_by_global_position():
    from flashlab.kernels.forward import flash_attention_forward
    rng = np.random.default_rng(3)
    q, k, v = random_qkv(rng, 1, 16, 384, 2, 1, 8)                 # 2 x 3 blocks
    kw = {"is_causal": True, "local_window_size": (140, 0), "q_offset": 300, "kv_offset": 0}
    _, _, _, spec = masks.validate(q, k, v, **kw)
    out, lse = flash_attention_forward(q, k, v, spec, block_q=8, block_k=128)
    ref, ref_lse = oracle_attention(q, k, v, **kw, return_lse=True)
    np.testing.assert_allclose(np.asarray(out), ref, atol=FP32_ATOL)
    np.testing.assert_allclose(np.asarray(lse), ref_lse, atol=1e-4)


@pytest.mark.parametrize("is_causal, window", [(True, None), (False, (5, 2)), (True, (9, 0)),
                                               (False, (None, 3))])
def test_block_ranges_with_shift_equal_block_maybe_visible(is_causal, window):
    bq, bk, nq, nk = 8, 8, 4, 5
    geo = dict(block_q=bq, block_k=bk, is_causal=is_causal, window=window)
    for shift in (-30, -9, -1, 0, 3, 17, 40):
        qo, ko = max(shift, 0), max(-shift, 0)

        def maybe(i, j):
            return masks.block_maybe_visible(qo + i * bq, qo + (i + 1) * bq, ko + j * bk,
                                             ko + (j + 1) * bk, is_causal=is_causal, window=window)

        # Row r of each table against block_maybe_visible at the global positions.
        for rows, cols, fn, pair in (
                (nq, nk, lambda r: blk.kv_block_range(r, nq * bq, nk * bk,
                                                      shift=shift, **geo), lambda r, c: (r, c)),
                (nk, nq, lambda r: blk.q_block_range(r, nq * bq, nk * bk,
                                                     shift=shift, **geo), lambda r, c: (c, r))):
            for r in range(rows):
                lo, hi = fn(r)
                want = [c for c in range(cols) if maybe(*pair(r, c))]
                assert [c for c in range(cols) if lo <= c <= hi] == want, (shift, r)


def test_offsets_bad_input_and_undeclared_backends():
    q, k, v = random_qkv(np.random.default_rng(0), 1, 8, 8, 2, 2, 8)
    with pytest.raises(ValueError, match="q_offset.*>= 0.*-1"):
        masks.validate(q, k, v, q_offset=-1)
    with pytest.raises(TypeError, match="kv_offset"):
        masks.validate(q, k, v, kv_offset=1.5)
    with pytest.raises(ValueError, match="kv_offset.*scalar"):
        masks.validate(q, k, v, kv_offset=np.array([1, 2]))
    with pytest.raises(NotImplementedError, match="'offsets'"):
        attention(q, k, v, backend="xla", q_offset=4, is_causal=True)
    # Global lengths may exceed the block (the sequence goes on past it).
    _, _, _, spec = masks.validate(q, k, v, kv_offset=8, key_value_seq_lengths=np.array([12]))
    assert spec.local_lengths()[1].tolist() == [4] and "offsets" in spec.features()
