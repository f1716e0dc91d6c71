"""The Pallas TPU decode kernel: generic interpreter (breadth), TPU interpret mode with the race
detector (a few shapes), and parity with the official paged_attention and
ragged_paged_attention kernels in TPU interpret mode."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashlab
from flashlab.contract import device
from flashlab.contract.decode_validate import validate_decode
from flashlab.ladder.decode import oracle_decode_attention
from flashlab.compat import pallas as compat
from flashlab.kernels import decode as kdecode
from flashlab.kernels import decode_grid

from decode_cases import CASES, decode_case

KERNEL_CASES = [c for c in CASES if c[0] in (
    "gqa_paged_ragged_empty", "mha_contig_value_dim", "chunked_window_contig",
    "sinks_chunked_window_cap")]


@pytest.mark.parametrize("name,case,extra", KERNEL_CASES, ids=[c[0] for c in KERNEL_CASES])
def test_kernel_matches_oracle(name, case, extra):
    q, k, v, kw = decode_case(**case)
    want = oracle_decode_attention(q, k, v, **kw, **extra)
    got = flashlab.decode_attention(q, k, v, **kw, **extra, backend="pallas_tpu")
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("num_splits", [3])
def test_split_k_merge_matches_oracle(num_splits):
    # a long ragged cache walked by 1 or 3 splits; their states merged by online_softmax.merge
    q, k, v, kw = decode_case(batch=2, page_size=8, pages_per_seq=12, lengths=[90, 7], sinks=True)
    _, _, _, spec = validate_decode(q, k, v, **kw)
    got = kdecode.pallas_decode(q, k, v, spec, num_splits=num_splits)
    np.testing.assert_allclose(np.asarray(got), oracle_decode_attention(q, k, v, **kw),
                               atol=2e-5, rtol=2e-5)


def test_pages_per_block_clamps_match_oracle():
    # 3 pages per grid step, 2 splits: operands past a sequence's end, before its window, and
    # in a split with no visible page (lengths 0 and 5) hold other pages, masked by position.
    q, k, v, kw = decode_case(batch=3, page_size=8, pages_per_seq=7, lengths=[53, 0, 5])
    _, _, _, spec = validate_decode(q, k, v, **kw, local_window_size=20)
    got = kdecode.pallas_decode(q, k, v, spec, num_splits=2, pages_per_block=3)
    np.testing.assert_allclose(np.asarray(got), oracle_decode_attention(
        q, k, v, **kw, local_window_size=20), atol=2e-5, rtol=2e-5)


def test_choose_num_splits():
    assert decode_grid.choose_num_splits(batch=1, capacity=8192) == 4
    assert decode_grid.choose_num_splits(batch=1, capacity=2048) == 2
    assert decode_grid.choose_num_splits(batch=8, capacity=8192) == 1
    assert decode_grid.choose_num_splits(batch=1, capacity=512) == 1


def _tpu_interpret():
    compat.reset_tpu_interpret_mode_state()
    return device.tpu_interpret_params()


@pytest.mark.parametrize("case,extra,splits", [
    (dict(batch=2, page_size=8, pages_per_seq=4, lengths=[29, 8]), {}, 2),
    (dict(batch=2, new_tokens=2, q_heads=4, kv_heads=2, lengths=[2, 21], sinks=True),
     dict(local_window_size=6, logits_soft_cap=5.0), 1),
], ids=["gqa_split", "chunked_sinks_window"])
def test_tpu_interpret_mode_no_races(case, extra, splits):
    q, k, v, kw = decode_case(**case)
    _, _, _, spec = validate_decode(q, k, v, **kw, **extra)
    got = kdecode.pallas_decode(q, k, v, spec, num_splits=splits, interpret=_tpu_interpret())
    assert compat.races_found() is False
    np.testing.assert_allclose(np.asarray(got), oracle_decode_attention(q, k, v, **kw, **extra),
                               atol=2e-5, rtol=2e-5)


def _bf16_exact(x):
    # paged_attention casts K and V pages to bfloat16 inside (its _maybe_dequantize defaults to
    # dtype=bfloat16, even for float32 pages): give both kernels float32 values that bfloat16
    # holds exactly, so the comparison measures the algorithms, not that rounding.
    return x.astype(jnp.bfloat16).astype(jnp.float32)


def test_parity_with_official_paged_attention():
    q, k, v, kw = decode_case(batch=2, q_heads=8, kv_heads=2, head_dim=128, page_size=16,
                              pages_per_seq=4, lengths=[50, 17], extra_pages=0)
    k, v = _bf16_exact(k), _bf16_exact(v)
    ours = flashlab.decode_attention(q, k, v, **kw, backend="pallas_tpu")
    pa = compat.official_paged_attention()
    table = jnp.where(kw["page_table"] < 0, 0, kw["page_table"])   # it reads whole blocks
    with compat.force_tpu_interpret_mode(_tpu_interpret()):
        theirs = pa.paged_attention(q[:, 0] / np.sqrt(128), jnp.swapaxes(k, 0, 2).swapaxes(1, 2),
                                    jnp.swapaxes(v, 0, 2).swapaxes(1, 2), kw["cache_lengths"],
                                    table, pages_per_compute_block=2)
    np.testing.assert_allclose(np.asarray(ours[:, 0]), np.asarray(theirs), atol=2e-5, rtol=2e-5)


def test_parity_with_official_ragged_paged_attention():
    """Chunked prefill (3 new tokens), window and soft cap against the official ragged kernel.

    Its sliding_window w keeps keys ``q - w < k`` (ours: ``q - w <= k``), so ours ``w`` is
    theirs ``w + 1``. The kernel itself cannot run in TPU interpret mode (jax 0.10.2 and
    0.12.0): it reshapes a ref after a DMA wait (``cur_async_copy_kv.wait().reshape(...)``)
    and the interpreter's ``to_range`` has no case for a ``ReshapeTransform``
    (``AttributeError: 'ReshapeTransform' object has no attribute 'indices'``). We then
    compare with the official reference of that kernel, ``ref_ragged_paged_attention``.
    """
    q, k, v, kw = decode_case(batch=2, new_tokens=3, q_heads=8, kv_heads=2, head_dim=128,
                              page_size=16, pages_per_seq=4, lengths=[50, 17], extra_pages=0)
    window, cap = 20, 8.0
    ours = flashlab.decode_attention(q, k, v, **kw, local_window_size=window,
                                     logits_soft_cap=cap, backend="pallas_tpu")
    rpa = compat.official_ragged_paged_attention()
    kv = jnp.stack([k, v], axis=3).reshape(*k.shape[:2], 2 * k.shape[2], k.shape[3])
    table = jnp.where(kw["page_table"] < 0, 0, kw["page_table"])
    B, T = q.shape[:2]
    args = (q.reshape(B * T, *q.shape[2:]), kv, kw["cache_lengths"], table,
            jnp.arange(B + 1, dtype=jnp.int32) * T, jnp.array([B], jnp.int32))
    opts = dict(sm_scale=1 / np.sqrt(128), sliding_window=window + 1, soft_cap=cap)
    try:
        with compat.force_tpu_interpret_mode(_tpu_interpret()):
            theirs = rpa.ragged_paged_attention(*args, **opts, num_kv_pages_per_block=2,
                                                num_queries_per_block=8)
            theirs.block_until_ready()
    except Exception as e:   # the interpreter gap described above, and nothing else
        assert "ReshapeTransform" in str(e), e
        compat.reset_tpu_interpret_mode_state()
        theirs = rpa.ref_ragged_paged_attention(*args, **opts)
    np.testing.assert_allclose(np.asarray(ours).reshape(B * T, -1, 128), np.asarray(theirs),
                               atol=2e-5, rtol=2e-5)


def test_too_many_resident_rows_is_a_clear_error():
    # a 2048-token chunk x G=8 keeps 16k rows per kv head resident: over any chip's VMEM budget
    q, k, v, kw = decode_case(batch=1, new_tokens=2048, q_heads=16, kv_heads=2, head_dim=128,
                              page_size=256, pages_per_seq=8, lengths=[2048])
    with pytest.raises(ValueError, match=r"new_tokens: 2048 new tokens x 8 query heads .* "
                                         r"smaller chunks"):
        flashlab.decode_attention(q, k, v, **kw, backend="pallas_tpu")
