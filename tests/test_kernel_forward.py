"""The Pallas forward kernel against the float64 oracle: breadth (generic interpreter),
depth (TPU interpret mode with the race detector and NaN-poisoned memory), errors.

Tolerances (unit-normal inputs): float32 max abs error <= 2e-5. bfloat16: the oracle runs on
the bf16-rounded inputs and the bound is 2e-2 (P is rounded to bf16 before the PV matmul, as
on the MXU; observed ~1e-2 at head_dim 128).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from cases import MASK_OPTIONS, draw_shape, mask_kwargs
from conftest import kernel_eqns, random_qkv
from flashlab.contract import device
from flashlab.compat import pallas as compat
from flashlab.kernels import flash_attention, flash_attention_forward
from flashlab.contract.masks import validate
from flashlab.ladder.reference import oracle_attention

F32_TOL = 2e-5
BF16_TOL = 2e-2


def _check(q, k, v, kw, *, dtype=np.float32, interpret=True, **blocks):
    qj, kj, vj = (jnp.asarray(x, dtype) for x in (q, k, v))
    out = flash_attention(qj, kj, vj, **kw, interpret=interpret, **blocks)
    assert out.dtype == jnp.dtype(dtype) and out.shape == q.shape[:3] + (v.shape[3],)
    # The oracle sees exactly the inputs the kernel saw (bf16-rounded for bf16).
    ref = oracle_attention(*(np.asarray(x.astype(jnp.float32)) for x in (qj, kj, vj)), **kw)
    got = np.asarray(out.astype(jnp.float32))
    assert np.isfinite(got).all()
    err = np.abs(got - ref).max()
    assert err <= (F32_TOL if dtype == np.float32 else BF16_TOL), err
    return got, ref


@pytest.mark.parametrize("option", MASK_OPTIONS)
def test_every_mask_option(option):
    rng = np.random.default_rng(1)
    B, T, S, N, K, H = 2, 45, 45, 4, 2, 64
    q, k, v = random_qkv(rng, B, T, S, N, K, H)
    _check(q, k, v, mask_kwargs(option, rng, B, T, S, N), block_q=32, block_k=128)


@pytest.mark.parametrize("option", ["causal", "window_pair", "segments_pair", "seq_lengths",
                                    "dense_mask", "bias", "everything"])
def test_cross_attention_with_several_kv_blocks(option):
    rng = np.random.default_rng(2)
    B, T, S, N, K, H = 2, 37, 300, 2, 1, 64     # Tq != Tk, 3 kv blocks, MQA
    q, k, v = random_qkv(rng, B, T, S, N, K, H)
    _check(q, k, v, mask_kwargs(option, rng, B, T, S, N), block_q=32, block_k=128)


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_head_dims_and_dtypes(head_dim, dtype):
    rng = np.random.default_rng(3)
    q, k, v = random_qkv(rng, 1, 70, 70, 2, 2, head_dim)
    _check(q, k, v, {"is_causal": True}, dtype=dtype)


def test_value_head_dim_differs():
    rng = np.random.default_rng(4)
    q, k, v = random_qkv(rng, 1, 20, 33, 2, 1, 64, Hv=96)
    _check(q, k, v, {"local_window_size": 4})


@settings(deadline=None, max_examples=10)   # ~3 s each: every option also has its own test
@given(data=st.data())
def test_hypothesis_breadth(data):
    B, T, S, N, K, H = draw_shape(data, [64, 80, 96, 128, 256])
    dtype = data.draw(st.sampled_from([np.float32, jnp.bfloat16]), "dtype")
    option = data.draw(st.sampled_from(MASK_OPTIONS), "option")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16), "seed"))
    kw = mask_kwargs(option, rng, B, T, S, N)
    sub = 32 if "mask" in kw else 16 if dtype != np.float32 else 8
    blocks = data.draw(st.sampled_from([{}, {"block_q": sub, "block_k": 128},
                                        {"block_q": 2 * sub, "block_k": 256}]), "blocks")
    q, k, v = random_qkv(rng, B, T, S, N, K, H)
    _check(q, k, v, kw, dtype=dtype, **blocks)


def test_one_token():
    rng = np.random.default_rng(5)
    q, k, v = random_qkv(rng, 1, 1, 1, 1, 1, 64)
    got, _ = _check(q, k, v, {"is_causal": True})
    np.testing.assert_allclose(got[0, 0, 0], v[0, 0, 0], atol=1e-6)   # softmax of one key


def test_fully_masked_rows_are_zeros():
    rng = np.random.default_rng(6)
    B, T, S, N, H = 2, 24, 200, 2, 64
    q, k, v = random_qkv(rng, B, T, S, N, N, H)
    kw = {"key_value_seq_lengths": np.array([0, 150], np.int32),        # batch row 0: no keys
          "query_seq_lengths": np.array([24, 10], np.int32),            # rows >= 10 in row 1
          "local_window_size": (3, 0)}
    got, ref = _check(q, k, v, kw, block_q=8, block_k=128)
    assert (got[0] == 0).all() and (got[1, 10:] == 0).all() and (ref[0] == 0).all()
    # lse is -inf exactly there and matches the oracle elsewhere.
    qj, kj, vj, spec = validate(q, k, v, **kw)
    out, lse = flash_attention_forward(qj, kj, vj, spec, interpret=True)
    _, ref_lse = oracle_attention(q, k, v, **kw, return_lse=True)
    lse = np.asarray(lse)
    assert np.array_equal(np.isinf(lse), np.isinf(ref_lse))
    fin = np.isfinite(ref_lse)
    assert np.abs(lse[fin] - ref_lse[fin]).max() < 1e-5


def test_jit_with_traced_lengths_and_masks():
    rng = np.random.default_rng(7)
    q, k, v = random_qkv(rng, 2, 30, 30, 2, 2, 64)
    lens = np.array([30, 11], np.int32)
    f = jax.jit(lambda q, k, v, lens: flash_attention(q, k, v, key_value_seq_lengths=lens,
                                                      is_causal=True, interpret=True))
    got = np.asarray(f(q, k, v, lens))
    ref = oracle_attention(q, k, v, key_value_seq_lengths=lens, is_causal=True)
    assert np.abs(got - ref).max() <= F32_TOL


# ----------------------------------------------------------------------------- errors

def test_grad_goes_through_the_backward_kernels():
    """Differentiable since chapter 07 (tests/test_kernel_backward.py checks the values)."""
    rng = np.random.default_rng(8)
    q, k, v = random_qkv(rng, 1, 16, 16, 1, 1, 64)
    loss = lambda q: flash_attention(q, k, v, interpret=True).sum()  # noqa: E731
    assert np.isfinite(np.asarray(jax.grad(loss)(jnp.asarray(q)))).all()


@pytest.mark.parametrize("kw, exc, match", [
    ({"block_q": 12}, ValueError, "block_q: expected a multiple of 8"),
    ({"block_k": 64}, ValueError, "block_k: expected a multiple of 128"),
    ({"block_q": 0}, ValueError, "block_q"),
    ({"block_q": 8.0}, TypeError, "block_q"),
    ({"block_q": 4096, "block_k": 8192}, ValueError, "block_q, block_k:.*VMEM"),
    ({"interpret": "yes"}, TypeError, "interpret"),
])
def test_bad_kernel_arguments(kw, exc, match):
    q = jnp.zeros((1, 16, 1, 64), jnp.float32)
    with pytest.raises(exc, match=match):
        flash_attention(q, q, q, **kw)


def test_bf16_and_mask_rules_name_the_argument():
    q = jnp.zeros((1, 16, 1, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="block_q: expected a multiple of 16"):
        flash_attention(q, q, q, block_q=8, interpret=True)
    m = jnp.ones((1, 1, 16, 16), bool)
    with pytest.raises(ValueError, match="block_q: expected a multiple of 32.*int8 mask"):
        flash_attention(q, q, q, mask=m, block_q=16, interpret=True)


def test_bad_inputs_use_the_shared_validation():
    q = jnp.zeros((1, 16, 2, 64), jnp.float32)
    with pytest.raises(ValueError, match="key: expected head_dim 64"):
        flash_attention(q, jnp.zeros((1, 16, 2, 32)), q, interpret=True)
    with pytest.raises(ValueError, match="key_value_seq_lengths"):
        flash_attention(q, q, q, key_value_seq_lengths=np.array([1, 2]), interpret=True)
    with pytest.raises(TypeError, match="query: the Pallas TPU kernel supports float32 and bfloat16"):
        flash_attention(q.astype(jnp.float16), q.astype(jnp.float16), q.astype(jnp.float16))


# ----------------------------------------------------------------------------- Mosaic lowering

@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_lowers_to_mosaic_for_tpu(dtype):
    """Cross-platform lowering runs Pallas' Mosaic lowering on this CPU (block-shape rules,
    supported primitives); the final Mosaic compile only happens on a TPU."""
    rng = np.random.default_rng(9)
    B, T, S, N, K, H = 2, 40, 300, 4, 2, 80
    q, k, v = (jnp.asarray(x, dtype) for x in random_qkv(rng, B, T, S, N, K, H))
    kw = mask_kwargs("everything", rng, B, T, S, N)
    kw["segment_ids"] = (np.zeros((B, T), np.int32), np.zeros((B, S), np.int32))
    kw["query_seq_lengths"] = np.array([40, 7], np.int32)
    f = jax.jit(lambda q, k, v: flash_attention(q, k, v, **kw, interpret=False))
    text = f.trace(q, k, v).lower(lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in text


# ----------------------------------------------------------------------------- TPU interpret mode

@pytest.mark.parametrize("case", [
    dict(B=1, T=40, S=40, N=2, K=1, H=64, dtype=np.float32, option="causal_window", bq=16, bk=128),
    dict(B=2, T=20, S=260, N=2, K=2, H=80, dtype=np.float32, option="everything", bq=32, bk=128),
    dict(B=1, T=48, S=48, N=2, K=2, H=128, dtype=jnp.bfloat16, option="segments", bq=16, bk=128),
    # every block visible: no init region, a q row's first step selects its state over the
    # unwritten (NaN-filled) scratch
    dict(B=2, T=64, S=256, N=2, K=1, H=64, dtype=np.float32, option="none", bq=32, bk=128),
])
def test_tpu_interpret_mode_no_races_no_uninitialized_reads(case):
    rng = np.random.default_rng(10)
    q, k, v = random_qkv(rng, case["B"], case["T"], case["S"], case["N"], case["K"], case["H"])
    kw = mask_kwargs(case["option"], rng, case["B"], case["T"], case["S"], case["N"])
    params = device.tpu_interpret_params()       # detect_races=True, uninitialized -> NaN
    got, _ = _check(q, k, v, kw, dtype=case["dtype"], interpret=params,
                    block_q=case["bq"], block_k=case["bk"])
    assert compat.races_found() is False


def test_soft_cap_folds_its_scale_into_the_query_block():
    """Under a soft cap the tile builds ``cap·log2(e)·tanh(((scale/cap)·Q_i) K_jᵀ)``:
    ``scale/cap`` rides on the ``[B_r, d]`` query block, so each ``[B_r, B_c]`` score costs
    one tanh and one multiply, no divide (v6e's causal 512² tile: 1321 -> 1117 cycles), and
    the softmax stays in base 2."""
    q = jnp.zeros((1, 256, 1, 128), jnp.bfloat16)
    k = jnp.zeros((1, 512, 1, 128), jnp.bfloat16)
    [kernel] = kernel_eqns(lambda q, k: flash_attention(q, k, k, logits_soft_cap=30.0,
                                                        block_q=128, block_k=256, chip="v6e"),
                           q, k)
    per_score = [e.primitive.name for e in kernel
                 if [getattr(v.aval, "shape", ()) for v in e.outvars] == [(128, 256)]]
    assert "div" not in per_score and "exp" not in per_score
    assert per_score.count("tanh") == 1 and per_score.count("mul") == 1


@pytest.mark.parametrize("chip, bq, bk, folded", [
    ("v5e", 512, 512, True), ("v5e", 1024, 1024, True), ("v5e", 2048, 2048, False),
    ("v5e", 2048, 1024, True), ("v5e", 512, 2048, False), ("v5e", 1024, 2048, False),
    ("v5p", 2048, 2048, False), ("v5p", 2048, 512, True), ("v6e", 2048, 2048, True),
    ("v4", 2048, 512, True)])
def test_soft_cap_stays_unfolded_where_measured_to_pack_better(chip, bq, bk, folded):
    """forward_config.SOFT_CAP_UNFOLDED: v5e and v5p keep ``cap·tanh(scale·s / cap)`` on
    natural logits for a tile in row chunks of 2048 keys (2048²: 3.55 against 3.83 ms folded
    on v5e); every other tile folds and runs in base 2."""
    from flashlab.kernels.forward_config import make_config
    x = jnp.zeros((1, 8192, 1, 128), jnp.bfloat16)
    *_, spec = validate(x, x, x, is_causal=True, logits_soft_cap=50.0)
    cfg = make_config(spec, block_q=bq, block_k=bk, chip=chip)
    assert (cfg.cap_in_query, cfg.log2_scores) == (folded, folded)


@pytest.mark.parametrize("causal", [False, True])
def test_first_step_selects_its_state_where_every_block_is_visible(causal):
    """Non-causal with no window, lengths or offsets, a q row's first step takes ``(-inf, 0,
    0)`` through a select and the kernel has no init region (v5e T=8192 512²: 7.70 -> 7.57
    ms); v4 (forward.INIT_REGION) and any mask that can hide a block keep the region."""
    from flashlab.kernels.forward import INIT_REGION
    x = jnp.zeros((1, 512, 1, 128), jnp.bfloat16)

    def conds(chip):
        [kernel] = kernel_eqns(lambda x: flash_attention(x, x, x, is_causal=causal, chip=chip,
                                                         block_q=128, block_k=128), x)
        return sum(e.primitive.name == "cond" for e in kernel)
    assert INIT_REGION == {"v4"}
    assert conds("v4") - conds("v5e") == (0 if causal else 1)
    assert conds("v6e") == conds("v5e")


def _chunked(monkeypatch, chunks=4):
    """Make the v5e forward fold a 128-row tile in ``chunks`` row chunks (the real table
    chunks only tiles of at least 1024 columns, too big for an interpreted test)."""
    from flashlab.kernels import forward_config
    monkeypatch.setitem(forward_config.FORWARD_ROW_CHUNKS, "v5e", chunks)
    monkeypatch.setattr(forward_config, "CHUNK_MIN_ROWS", 32)
    monkeypatch.setitem(forward_config.CHUNK_MIN_BLOCK_K, "v5e", 128)


@pytest.mark.parametrize("option", ["none", "causal_window", "seq_lengths", "segments_pair",
                                    "dense_mask", "bias", "bias_broadcast", "soft_cap",
                                    "sinks", "everything"])
def test_row_chunks_match_the_oracle(monkeypatch, option):
    """The tile folded in 4 independent row chunks (forward_config.FORWARD_ROW_CHUNKS) is the
    same attention: every operand with query rows (q, bias, mask, segment ids) is cut to the
    chunk, a broadcast one is not, and the chunk's mask sees its own global rows."""
    from flashlab.kernels.forward_config import make_config
    _chunked(monkeypatch)
    rng = np.random.default_rng(12)
    B, T, S, N, K, H = 2, 200, 300, 4, 2, 64      # 2 q blocks of 128 (the second padded)
    q, k, v = random_qkv(rng, B, T, S, N, K, H)
    kw = mask_kwargs(option, rng, B, T, S, N)
    *_, spec = validate(*(jnp.asarray(x) for x in (q, k, v)), **kw)
    cfg = make_config(spec, block_q=128, block_k=128, chip="v5e")
    assert (cfg.chunk_rows, cfg.row_chunks) == (32, 4)
    _check(q, k, v, kw, block_q=128, block_k=128, chip="v5e")


def test_unfolded_soft_cap_matches_the_oracle(monkeypatch):
    """Where the soft cap stays unfolded (forward_config.SOFT_CAP_UNFOLDED, here made to cover
    the test's chunked 128-key tiles) the tile computes ``cap·tanh(scale·s / cap)`` on natural
    logits: the same attention as the folded base-2 one."""
    from flashlab.kernels import forward_config
    _chunked(monkeypatch)
    monkeypatch.setattr(forward_config, "SOFT_CAP_UNFOLDED", frozenset({("v5e", 128)}))
    rng = np.random.default_rng(13)
    B, T, S, N, K, H = 2, 200, 300, 4, 2, 64
    q, k, v = random_qkv(rng, B, T, S, N, K, H)
    kw = mask_kwargs("soft_cap", rng, B, T, S, N)
    *_, spec = validate(*(jnp.asarray(x) for x in (q, k, v)), **kw)
    cfg = forward_config.make_config(spec, block_q=128, block_k=128, chip="v5e")
    assert (cfg.chunk_rows, cfg.cap_in_query, cfg.log2_scores) == (32, False, False)
    _check(q, k, v, kw, block_q=128, block_k=128, chip="v5e")


@pytest.mark.parametrize("bias_shape, mask_shape", [((1, 4, 1, 300), (2, 1, 200, 1)),
                                                     ((2, 1, 200, 1), (1, 4, 1, 300))])
def test_row_chunks_keep_a_row_broadcast_block_whole(monkeypatch, bias_shape, mask_shape):
    """A bias or mask broadcast over the query rows arrives as a one-row block: every chunk
    reads it whole (forward.rows_of), while a full-row one is cut per chunk."""
    _chunked(monkeypatch)
    rng = np.random.default_rng(14)
    B, T, S, N, K, H = 2, 200, 300, 4, 2, 64
    q, k, v = random_qkv(rng, B, T, S, N, K, H)
    kw = {"bias": rng.standard_normal(bias_shape).astype(np.float32),
          "mask": rng.random(mask_shape) < 0.8, "is_causal": True}
    _check(q, k, v, kw, block_q=128, block_k=128, chip="v5e")


@pytest.mark.parametrize("kw, bq", [(dict(is_causal=True), 256),
                                     (dict(is_causal=True, local_window_size=(40, 0)), 128),
                                     (dict(local_window_size=(30, 30)), 128)])
def test_partial_tiles_run_only_their_visible_chunks(monkeypatch, kw, bq):
    """A visible tile where some row chunk sees none of its keys (causal with B_r > B_c, a
    window) takes the partial path: its other chunks only, each behind its own pl.when. The
    output is the oracle's, and forward_config counts those tiles for the static estimate."""
    from flashlab.kernels.forward_config import make_config
    _chunked(monkeypatch)
    rng = np.random.default_rng(15)
    B, T, N, H = 1, 512, 2, 64
    q, k, v = random_qkv(rng, B, T, T, N, N, H)
    *_, spec = validate(*(jnp.asarray(x) for x in (q, k, v)), **kw)
    cfg = make_config(spec, block_q=bq, block_k=128, chip="v5e")
    assert cfg.partial_tiles and cfg.row_chunks == 4
    partial, chunks = cfg.chunk_visits()
    assert partial > 0 and 0 < chunks < 4 * partial
    _check(q, k, v, kw, block_q=bq, block_k=128, chip="v5e")


def test_chunk_visits_count_the_partial_tiles():
    """Causal T=8192 at 2048 x 1024 in 2 chunks, crossed tiles whole (no query strips, as with
    a window or a bias): a q block's second diagonal tile has a first chunk that sees nothing
    (4 of 20 tiles, one chunk each); square or wide blocks have none. (With the strips of
    kernels/diagonal.py the kernel runs those tiles as strips instead: the bench then counts
    no partial tiles, tests/test_forward_strips.py.)"""
    from flashlab.kernels.forward_config import make_config
    q = jnp.zeros((1, 8192, 1, 128), jnp.bfloat16)
    *_, spec = validate(q, q, q, is_causal=True)
    cfg = make_config(spec, block_q=2048, block_k=1024, chip="v6e")
    assert (cfg.row_chunks, len(cfg.visits()), cfg.chunk_visits()) == (2, 20, (4, 4))
    # v5e: 8 chunks of 256 rows, the 4 in the second tile's lower half see keys
    assert make_config(spec, block_q=2048, block_k=1024, chip="v5e").chunk_visits() == (4, 16)
    for bq, bk in ((1024, 1024), (1024, 2048)):
        cfg = make_config(spec, block_q=bq, block_k=bk, chip="v5e")
        assert not cfg.partial_tiles and cfg.chunk_visits() == (0, 0)


@pytest.mark.parametrize("T, S, bq, option", [(64, 256, 64, "everything"),
                                               (256, 256, 256, "causal")])
def test_row_chunks_no_races_in_tpu_interpret_mode(monkeypatch, T, S, bq, option):
    """Chunks write disjoint rows of m, l and acc: the race detector agrees (bf16; a mask,
    segments and a bias cut per chunk; causal at B_r > B_c, where the partial path runs)."""
    _chunked(monkeypatch, chunks=2)
    rng = np.random.default_rng(13)
    B, N, K, H = 1, 2, 1, 128
    q, k, v = random_qkv(rng, B, T, S, N, K, H)
    kw = mask_kwargs(option, rng, B, T, S, N)
    _check(q, k, v, kw, dtype=jnp.bfloat16, interpret=device.tpu_interpret_params(),
           block_q=bq, block_k=128, chip="v5e")
    assert compat.races_found() is False


def test_row_chunks_only_where_measured_to_pay():
    """forward_config.FORWARD_ROW_CHUNKS: wide tiles on v5e, v5p, v4 and v6e; never on 7x, with
    fewer than 1024 columns (512 on v5e and v5p: CHUNK_MIN_BLOCK_K), or for the backward's
    kernels."""
    from flashlab.kernels.forward_config import make_config
    q = jnp.zeros((1, 4096, 2, 128), jnp.bfloat16)
    *_, spec = validate(q, q, q, is_causal=True)
    rows = lambda chip, bq, bk, **kw: make_config(  # noqa: E731
        spec, block_q=bq, block_k=bk, chip=chip, **kw).chunk_rows
    assert [rows(c, 1024, 1024) for c in ("v5e", "v5p", "v4", "v6e", "7x")] == [
        256, 256, 512, 512, None]
    assert rows("v5e", 1024, 2048) == 256 and rows("v6e", 2048, 1024) == 1024
    # v5e and v5p: chunks of 256 rows however tall the tile (2048²: 8, 4096 x 2048: 16)
    assert rows("v5e", 2048, 2048) == rows("v5p", 2048, 1024) == rows("v5e", 4096, 2048) == 256
    assert rows("v5e", 512, 1024) == 256                # two chunks of at least 256 rows
    assert rows("v5e", 512, 512) == rows("v5p", 512, 512) == 256     # 512 columns: v5e, v5p
    assert rows("v4", 512, 512) is None and rows("v6e", 512, 512) is None
    assert rows("v5e", 512, 256) is None and rows("v4", 2048, 512) is None
    assert rows("v5e", 1024, 1024, backward_blocks=True) is None
    # a masked tile on v5e keeps natural logits in one chain, base 2 in chunks
    log2 = lambda bq, bk: make_config(spec, block_q=bq, block_k=bk, chip="v5e").log2_scores  # noqa
    assert log2(512, 256) is False and log2(512, 512) is True


def _col_chunked(monkeypatch):
    """Make the v6e forward fold a 128 x 256 tile in 2 row chunks of 64, each in 2 column
    chunks of 128 (the real tables chunk only 2048-column tiles, too big to interpret)."""
    from flashlab.kernels import forward_config
    monkeypatch.setitem(forward_config.FORWARD_ROW_CHUNKS, "v6e", 2)
    monkeypatch.setattr(forward_config, "CHUNK_MIN_ROWS", 32)
    monkeypatch.setitem(forward_config.CHUNK_MIN_BLOCK_K, "v6e", 128)
    monkeypatch.setitem(forward_config.FORWARD_COL_CHUNK, "v6e", 128)
    monkeypatch.setattr(forward_config, "COL_CHUNK_MIN_ROWS", 64)


@pytest.mark.parametrize("dtype, option", [(np.float32, "none"), (np.float32, "soft_cap"),
                                           (np.float32, "sinks_no_window"),
                                           (jnp.bfloat16, "none")])
def test_col_chunks_match_the_oracle(monkeypatch, dtype, option):
    """A plain tile folded in row chunks and, within each, column chunks
    (forward_config.FORWARD_COL_CHUNK: one online-softmax update per piece, row-major) is the
    same attention, in float32 and bfloat16, with a soft cap and with sinks."""
    from flashlab.kernels.forward_config import make_config
    _col_chunked(monkeypatch)
    rng = np.random.default_rng(16)
    B, T, S, N, K, H = 1, 256, 512, 4, 2, 64      # 2 q blocks of 128, 2 kv blocks of 256
    q, k, v = random_qkv(rng, B, T, S, N, K, H)
    kw = ({"sinks": (2 * rng.standard_normal(N)).astype(np.float32)}
          if option == "sinks_no_window" else mask_kwargs(option, rng, B, T, S, N))
    *_, spec = validate(*(jnp.asarray(x, dtype) for x in (q, k, v)), **kw)
    cfg = make_config(spec, block_q=128, block_k=256, chip="v6e")
    assert (cfg.chunk_rows, cfg.row_chunks, cfg.chunk_cols, cfg.col_chunks) == (64, 2, 128, 2)
    _check(q, k, v, kw, dtype=dtype, block_q=128, block_k=256, chip="v6e")


def test_col_chunks_no_races_in_tpu_interpret_mode(monkeypatch):
    """Column chunks of one row chunk update the same rows of m, l and acc one after the
    other, never at once: the race detector agrees (bf16)."""
    _col_chunked(monkeypatch)
    rng = np.random.default_rng(17)
    q, k, v = random_qkv(rng, 1, 128, 512, 2, 1, 128)
    _check(q, k, v, {}, dtype=jnp.bfloat16, interpret=device.tpu_interpret_params(),
           block_q=128, block_k=256, chip="v6e")
    assert compat.races_found() is False


def test_col_chunks_only_where_measured_to_pay():
    """forward_config.FORWARD_COL_CHUNK: column chunks of 1024 on v6e and 7x, for a plain tile
    (or a causal one the query strips leave whole, or one inside a window's band) wider than
    1024 whose row chunks keep at least 1024 rows; never on the other chips, for a tile that
    masks anything else or adds a bias, or for the backward's kernels."""
    from flashlab.kernels.forward_config import make_config
    q = jnp.zeros((1, 8192, 2, 128), jnp.bfloat16)

    def cols(chip, bq, bk, backward_blocks=False, **kw):
        *_, spec = validate(q, q, q, **kw)
        return make_config(spec, block_q=bq, block_k=bk, chip=chip,
                           backward_blocks=backward_blocks).chunk_cols
    assert cols("v6e", 2048, 2048) == 1024                  # 2 row chunks of 1024 rows
    assert cols("7x", 1024, 2048) == cols("7x", 2048, 2048) == 1024   # one chain
    assert cols("v6e", 1024, 2048) is None                  # row chunks of 512
    assert cols("7x", 2048, 1024) is None                   # no wider than a chunk
    assert cols("v5e", 2048, 2048) is cols("v5p", 2048, 2048) is cols("v4", 1024, 2048) is None
    # causal alone: the interior tiles the query strips leave whole mask nothing; a window
    # alone: its tiles inside the band (kernels/band.py) mask nothing, its edge tiles keep
    # whole rows; a window with a length masks every tile
    assert cols("v6e", 2048, 2048, is_causal=True) == 1024
    assert cols("v6e", 2048, 2048, is_causal=True, local_window_size=(4096, 0)) == 1024
    assert cols("v6e", 2048, 2048, is_causal=True, local_window_size=(4096, 0),
                key_value_seq_lengths=jnp.array([8000])) is None
    assert cols("v6e", 4096, 2048, is_causal=True) is None   # row chunks run one by one there
    assert cols("v6e", 2048, 2048, bias=jnp.zeros((1, 1, 1, 8192), jnp.bfloat16)) is None
    assert cols("v6e", 2048, 2048, backward_blocks=True) is None
    r = jnp.zeros((1, 8000, 2, 128), jnp.bfloat16)           # kv padding masks the tile
    *_, spec = validate(r, r, r)
    assert make_config(spec, block_q=2048, block_k=2048, chip="7x").chunk_cols is None


@pytest.mark.parametrize("chip, causal, log2", [("v5e", True, False), ("v6e", True, True),
                                                ("v5e", False, True), ("7x", False, True)])
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_log2_scores_match_the_oracle(chip, causal, log2, dtype):
    """Both score paths of the forward (forward_config.KEEP_NATURAL_SCORES: natural logits,
    or scale·log2(e) folded into the query block with a base-2 online softmax) give the
    oracle's output at the stated tolerances and its lse within 1e-5 (float32), with a bias
    and sinks (and kv lengths, causal); the chip only picks the path (both run interpreted
    here)."""
    from flashlab.kernels.forward_config import make_config
    rng = np.random.default_rng(11)
    B, T, N, H = 2, 128, 2, 64          # T a multiple of 128: no kv padding to mask
    q, k, v = random_qkv(rng, B, T, T, N, N, H)
    kw = {"bias": rng.standard_normal((1, N, T, T)).astype(np.float32), "is_causal": causal}
    if causal:     # a masked tile either way (lengths alone also mask: v5e keeps natural)
        kw["key_value_seq_lengths"] = np.array([128, 77], np.int32)
    sinks = rng.standard_normal(N).astype(np.float32)
    qj, kj, vj = (jnp.asarray(x, dtype) for x in (q, k, v))
    *_, spec = validate(qj, kj, vj, **kw, sinks=sinks)
    assert make_config(spec, chip=chip).log2_scores is log2
    out, lse = flash_attention_forward(qj, kj, vj, spec, interpret=True, chip=chip)
    f32 = [np.asarray(x.astype(jnp.float32)) for x in (qj, kj, vj)]
    ref, ref_lse = oracle_attention(*f32, **kw, sinks=sinks, return_lse=True)
    err = np.abs(np.asarray(out.astype(jnp.float32)) - ref).max()
    assert err <= (F32_TOL if dtype == np.float32 else BF16_TOL), err
    lse_tol = 1e-5 if dtype == np.float32 else BF16_TOL
    assert np.abs(np.asarray(lse) - ref_lse).max() <= lse_tol


def test_partial_tiles_at_traced_offsets(monkeypatch):
    """With traced q/kv offsets (a ring step) the partial path decides at run time, from the
    chunk's global rows, which chunks see something; the output is the oracle's."""
    from flashlab.kernels import flash_attention_forward
    _chunked(monkeypatch)
    rng = np.random.default_rng(16)
    B, T, S, N, H = 1, 512, 384, 2, 64
    q, k, v = random_qkv(rng, B, T, S, N, N, H)
    kw = dict(is_causal=True, local_window_size=(200, 0))

    @jax.jit
    def f(q, k, v, qo, ko):
        *_, spec = validate(q, k, v, **kw, q_offset=qo, kv_offset=ko)
        return flash_attention_forward(q, k, v, spec, block_q=256, block_k=128, chip="v5e",
                                       interpret=True)[0]
    out = np.asarray(f(*(jnp.asarray(x) for x in (q, k, v)), jnp.int32(300), jnp.int32(250)))
    ref = oracle_attention(q, k, v, **kw, q_offset=300, kv_offset=250)
    assert np.abs(out - ref).max() <= F32_TOL
