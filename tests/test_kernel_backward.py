"""The Pallas backward kernels against the float64 oracle's gradients.

The oracle gradient is ``jax.grad`` of :func:`flashlab.ladder.reference.naive_attention` on float64
inputs (``jax.enable_x64(True)``): dQ, dK, dV and dBias. Breadth runs in the generic interpreter;
a few tiny shapes run in TPU interpret mode (race detector, NaN-poisoned uninitialized
memory); parity with the official Pallas TPU kernel's gradients on shared features.

Tolerances (unit-normal inputs): float32 relative error ``max|g − g_ref| / G`` <= 1e-4, with
``G`` the largest float64 gradient entry of the problem (dQ, dK, dV, dBias). bfloat16: the
oracle sees the bf16-rounded inputs and the bound is 5e-2 (P and dS
are rounded to bf16 before their matmuls, as on the MXU, and the gradients come out in
bf16; observed ~1e-2).
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st


from cases import MASK_OPTIONS, draw_shape, mask_kwargs
from conftest import random_qkv
from flashlab.contract import device
from flashlab.instruments import traffic
from flashlab.compat import pallas as compat
from flashlab.kernels import blocks as blk
from flashlab.kernels import flash_attention
from flashlab.kernels.backward import flash_attention_backward
from flashlab.kernels.backward_grid import (backward_grid_specs, make_backward_config,
                                            grads_on_lanes)
from flashlab.kernels.forward import flash_attention_forward
from flashlab.contract.masks import block_maybe_visible, validate
from flashlab.ladder.reference import naive_attention

F32_RTOL = 1e-4
BF16_RTOL = 5e-2


def oracle_grads(q, k, v, dout, kw):
    """float64 ``jax.grad`` of ``sum(naive_attention(...) * dout)``: (dq, dk, dv[, dbias])."""
    kw = dict(kw)
    bias = kw.pop("bias", None)
    with jax.enable_x64(True):
        f64 = lambda x: jnp.asarray(np.asarray(x, np.float64))  # noqa: E731
        args = [f64(q), f64(k), f64(v)] + ([] if bias is None else [f64(bias)])
        d = f64(dout)

        def loss(q, k, v, *b):
            return jnp.sum(naive_attention(q, k, v, *b, **kw) * d)

        grads = jax.grad(loss, argnums=tuple(range(len(args))))(*args)
        return [np.asarray(g) for g in grads]


def _grads(q, k, v, dout, kw, *, dtype=np.float32, interpret=True, **blocks):
    kw = dict(kw)
    bias = kw.pop("bias", None)
    args = [jnp.asarray(x, dtype) for x in (q, k, v)]
    if bias is not None:
        args.append(jnp.asarray(bias))

    def loss(q, k, v, *b):
        out = flash_attention(q, k, v, *b, **kw, interpret=interpret, **blocks)
        return jnp.sum(out.astype(jnp.float32) * dout)

    return jax.grad(loss, argnums=tuple(range(len(args))))(*args), args


def _check(q, k, v, kw, *, dtype=np.float32, interpret=True, seed=0, **blocks):
    dout = np.random.default_rng(seed).standard_normal(q.shape[:3] + (v.shape[3],)).astype(
        np.float32)
    got, args = _grads(q, k, v, dout, kw, dtype=dtype, interpret=interpret, **blocks)
    # the oracle sees exactly the inputs the kernel saw (bf16-rounded for bf16)
    seen = [np.asarray(a.astype(jnp.float32)) for a in args[:3]]
    ref = oracle_grads(*seen, dout, kw)
    tol = F32_RTOL if dtype == np.float32 else BF16_RTOL
    errs = []
    # Errors relative to the problem's gradient scale, the largest float64 gradient entry
    # (a gradient that is exactly zero in exact arithmetic, e.g. dQ under window 0 where P is
    # one-hot and dS = P ∘ (dP − D) = 0, has no scale of its own).
    scale = max(max(np.abs(r).max() for r in ref), 1e-6)
    for label, g, r in zip(("dq", "dk", "dv", "dbias"), got, ref):
        g = np.asarray(g.astype(jnp.float32))
        assert g.shape == r.shape and g.dtype == np.float32, (label, g.shape, r.shape)
        assert np.isfinite(g).all(), f"{label} has non-finite entries"
        err = np.abs(g - r).max() / scale
        errs.append(err)
        assert err <= tol, f"{label}: relative error {err:.2e} > {tol}"
    assert got[0].dtype == jnp.dtype(dtype)
    return got, ref, errs


# ----------------------------------------------------------------------------- breadth

@pytest.mark.parametrize("option", MASK_OPTIONS)
def test_every_mask_option(option):
    rng = np.random.default_rng(1)
    B, T, S, N, K, H = 2, 40, 150, 4, 2, 64          # GQA, cross, 2 kv blocks, ragged
    q, k, v = random_qkv(rng, B, T, S, N, K, H)
    _check(q, k, v, mask_kwargs(option, rng, B, T, S, N), block_q=32, block_k=128)


@settings(deadline=None, max_examples=5)   # ~20 s each (interpreted kernels, new shapes)
@given(data=st.data())
def test_hypothesis_breadth(data):
    B, T, S, N, K, H = draw_shape(data, [64, 80, 128])
    option = data.draw(st.sampled_from(MASK_OPTIONS), "option")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16), "seed"))
    kw = mask_kwargs(option, rng, B, T, S, N)
    sub = 32 if "mask" in kw else 8
    blocks = data.draw(st.sampled_from([{}, {"block_q": sub, "block_k": 128}]), "blocks")
    q, k, v = random_qkv(rng, B, T, S, N, K, H)
    _check(q, k, v, kw, **blocks)


@pytest.mark.parametrize("early", [True, False], ids=["early-dV", "late-dV"])
def test_both_dv_orders_match_the_oracle(monkeypatch, early):
    """The dK/dV kernel's two orders (backward_tile.EARLY_DV: dV issued before dP on v5e/v5p,
    after dS elsewhere) compute the same gradients."""
    from flashlab.kernels import backward_tile
    monkeypatch.setattr(backward_tile, "EARLY_DV", frozenset(
        {(blk.resolve_chip(), True)} if early else ()))
    rng = np.random.default_rng(5)
    T = 256 if early else 384                  # a shape of its own: no trace cached across
    q, k, v = random_qkv(rng, 1, T, T, 2, 2, 64)
    _check(q, k, v, {"is_causal": True}, block_q=128, block_k=128)


def test_bfloat16_documented_bound():
    rng = np.random.default_rng(2)
    q, k, v = random_qkv(rng, 1, 48, 48, 2, 1, 128)
    _, _, errs = _check(q, k, v, {"is_causal": True}, dtype=jnp.bfloat16, block_q=16,
                        block_k=128)
    print("bf16 relative errors", [f"{e:.1e}" for e in errs])


def test_value_head_dim_differs_and_soft_cap_with_bias():
    rng = np.random.default_rng(3)
    B, T, S, N = 1, 20, 33, 2
    q, k, v = random_qkv(rng, B, T, S, N, 1, 64, Hv=96)
    kw = {"logits_soft_cap": 1.5, "bias": rng.standard_normal((B, 1, T, S)).astype(np.float32),
          "local_window_size": (5, 1)}
    _check(q, k, v, kw)


def test_fused_backward_option_matches_the_oracle():
    """One kernel for dQ, dK, dV (dQ resident in VMEM per (batch, kv head)): the oracle's
    gradients, with GQA, causal, 2 x 2 blocks and a full-shape bias (its dS via the dBias
    kernel, since there is no dQ kernel)."""
    rng = np.random.default_rng(12)
    B, T, N, K, H = 1, 160, 2, 1, 64
    q, k, v = random_qkv(rng, B, T, T, N, K, H)
    bias = rng.standard_normal((B, N, T, T)).astype(np.float32)
    dout = rng.standard_normal((B, T, N, H)).astype(np.float32)
    q_, k_, v_, spec = validate(*(jnp.asarray(x) for x in (q, k, v)), jnp.asarray(bias), None,
                                is_causal=True)
    out, lse = flash_attention_forward(q_, k_, v_, spec, block_q=128, block_k=128,
                                       interpret=True)
    got = flash_attention_backward(q_, k_, v_, spec, out, lse, jnp.asarray(dout), block_q=128,
                                   block_k=128, interpret=True, fused=True)
    ref = oracle_grads(q, k, v, dout, {"is_causal": True, "bias": bias})
    scale = max(np.abs(r).max() for r in ref)
    for label, g, r in zip(("dq", "dk", "dv", "dbias"), got, ref):
        assert np.abs(np.asarray(g) - r).max() / scale <= F32_RTOL, label
    with pytest.raises(TypeError, match="fused"):
        flash_attention_backward(q_, k_, v_, spec, out, lse, jnp.asarray(dout), fused="yes")


def _assert_matches_oracle(got, q, k, v, dout, kw):
    """``got`` (dq, dk, dv[, dbias]) within float32 tolerance of the float64 oracle's, relative
    to the largest oracle gradient."""
    ref = oracle_grads(q, k, v, dout, kw)
    scale = max(np.abs(r).max() for r in ref)
    for label, g, r in zip(("dq", "dk", "dv", "dbias"), got, ref):
        assert np.abs(np.asarray(g) - r).max() / scale <= F32_RTOL, label


def _causal_case(seed, B, T, N, K, H, block):
    """Random causal inputs and the forward's residuals: ``(q, k, v, dout, (q_, k_, v_,
    spec, out, lse))``, the NumPy inputs and what the backward kernels take."""
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, B, T, T, N, K, H)
    dout = rng.standard_normal((B, T, N, H)).astype(np.float32)
    q_, k_, v_, spec = validate(*(jnp.asarray(x) for x in (q, k, v)), None, None,
                                is_causal=True)
    out, lse = flash_attention_forward(q_, k_, v_, spec, block_q=block, block_k=block,
                                       interpret=True)
    return q, k, v, dout, (q_, k_, v_, spec, out, lse)


def _interpretable_strips(monkeypatch):
    """Diagonal strips from 256-blocks, 128 rows each on every chip (the real minimum, 512,
    is too big to interpret)."""
    from flashlab.kernels import diagonal
    monkeypatch.setattr(diagonal, "MIN_BLOCK_K", 256)
    monkeypatch.setattr(diagonal, "MIN_BLOCK_Q", 256)
    monkeypatch.setattr(diagonal, "STRIP_ROWS", {})               # 128 rows everywhere


def _fused_matches_causal_oracle(q, k, v, dout, residuals, cfg, interpret, chunks):
    """The fused backward at ``cfg`` (dQ in ``chunks``), in ``interpret`` mode ("tpu": the
    race detector on), against the float64 oracle's causal gradients."""
    from flashlab.kernels import backward
    mode = device.tpu_interpret_params() if interpret == "tpu" else True
    got = backward._backward(*residuals, jnp.asarray(dout), cfg=cfg, interpret=mode,
                             fused=chunks)[:3]
    _assert_matches_oracle(got, q, k, v, dout, {"is_causal": True})
    if interpret == "tpu":
        assert compat.races_found() is False


@pytest.mark.parametrize("visit", [True, False], ids=["visit-grid", "dense-grid"])
def test_fused_backward_resident_dq_on_both_grids(visit):
    """The fused kernel adds each tile's ``dS'ᵀᵀ K_j`` into rows ``i`` of head ``g`` of one
    resident float32 block ``[G, T, d]`` per (batch, kv head): GQA with G = 2, two batch rows
    and two kv heads (the block moves on three times), T = 200 padded to 256, causal, on the
    visit grid and the dense grid; the oracle's gradients to float32 tolerance."""
    from flashlab.kernels import backward
    from flashlab.kernels.backward_grid import dkdv_grid_spec
    q, k, v, dout, (q_, k_, v_, spec, out, lse) = _causal_case(21, 2, 200, 4, 2, 64, 128)
    cfg = make_backward_config(spec, block_q=128, block_k=128, fused=True, visit_grid=visit)
    gs = dkdv_grid_spec(cfg, fused=True)
    assert len(gs.grid) == (4 if visit else 5) and "dq" in gs.out_names
    assert gs.spec("dq").block_shape == (None, 2, 256, 64)         # [G, T_pad, d]
    assert gs.dimension_semantics[:2] == ("parallel", "parallel")
    assert set(gs.dimension_semantics[2:]) == {"arbitrary"}        # dQ carries across j
    got = backward._backward(q_, k_, v_, spec, out, lse, jnp.asarray(dout), cfg=cfg,
                             interpret=True, fused=True)[:3]
    _assert_matches_oracle(got, q, k, v, dout, {"is_causal": True})


@pytest.mark.parametrize("chunks,interpret,chip", [
    (1, "generic", "v6e"), (2, "generic", "v6e"), (1, "tpu", "v6e"), (2, "tpu", "v6e"),
    (1, "generic", "v5e"), (2, "tpu", "v5e")],
    ids=["whole", "chunks", "tpu-interpret", "tpu-interpret-chunks", "v5e", "v5e-tpu-chunks"])
def test_fused_dense_grid_writes_dq_on_its_first_kv_row(chunks, interpret, chip):
    """Every block visible (non-causal, whole lengths): the fused kernel's first kv row writes
    each q block's dQ rows and later rows add, so no step zeroes the resident dQ and the only
    branch left is the row's last step (dK, dV out). GQA (G = 2), two batch rows and two kv
    heads, dQ whole and in two query chunks; in TPU interpret mode too, where uninitialized
    VMEM is NaN (a select that let the old contents through would show) and the race
    detector is on. On v6e with dO and dQ's query positions on lanes (dO read as ``[d,
    B_r]`` blocks, dQ ``[G, d, T / n]``, :func:`backward_grid.grads_on_lanes`), on v5e as
    ``[B_r, d]``. The float64 oracle's gradients."""
    from conftest import kernel_eqns
    from flashlab.kernels import backward
    from flashlab.kernels.backward_grid import dkdv_grid_spec
    rng = np.random.default_rng(37)
    q, k, v = random_qkv(rng, 2, 512, 512, 4, 2, 64)
    dout = rng.standard_normal((2, 512, 4, 64)).astype(np.float32)
    q_, k_, v_, spec = validate(*(jnp.asarray(x) for x in (q, k, v)), None, None)
    out, lse = flash_attention_forward(q_, k_, v_, spec, block_q=128, block_k=128,
                                       interpret=True)
    cfg = make_backward_config(spec, block_q=128, block_k=128, fused=True, visit_grid=False,
                               chip=chip)
    assert blk.every_block_visible(cfg)
    gs = dkdv_grid_spec(cfg, fused=chunks)
    assert len(gs.grid) == (5 if chunks == 1 else 6)
    lanes = chip == "v6e"
    assert grads_on_lanes(cfg, chunks) == lanes and not grads_on_lanes(cfg, 0)
    shapes = dict(zip(gs.in_names, (s.block_shape for s in gs.in_specs)))
    assert shapes["q"] == (None, None, 128, 64)
    assert shapes["do"] == ((None, None, 64, 128) if lanes else (None, None, 128, 64))
    assert gs.out_specs[2].block_shape == ((None, 2, 64, 512 // chunks) if lanes else
                                           (None, 2, 512 // chunks, 64))
    args = (q_, k_, v_, spec, out, lse, jnp.asarray(dout))
    [kernel] = kernel_eqns(lambda *a: backward._backward(*a, cfg=cfg, interpret=True,
                                                         fused=chunks)[:3], *args)
    assert sum(e.primitive.name == "cond" for e in kernel) == 1          # pl.when(last)
    mode = device.tpu_interpret_params() if interpret == "tpu" else True
    got = backward._backward(*args, cfg=cfg, interpret=mode, fused=chunks)[:3]
    _assert_matches_oracle(got, q, k, v, dout, {})
    if interpret == "tpu":
        assert compat.races_found() is False


@pytest.mark.parametrize("chip", ["v6e", "v5e"], ids=["lanes", "rows"])
def test_fused_backward_with_grads_on_lanes_and_every_in_tile_option(chip):
    """dO and dQ with the query positions on lanes (v6e, :func:`backward_grid.grads_on_lanes`;
    v5e reads them as rows) under every option that hides scores inside a tile but no block:
    a bias broadcast over batch (its gradient through the dBias kernel), a dense mask,
    segment ids, a soft cap, GQA (G = 2) and a value head_dim (96) other than the query's
    (64), T = 384 in three q blocks. The float64 oracle's gradients to float32 tolerance."""
    from flashlab.kernels import backward
    rng = np.random.default_rng(41)
    B, T, N, K = 2, 384, 4, 2
    q, k, v = random_qkv(rng, B, T, T, N, K, 64, Hv=96)
    seg = np.repeat(np.arange(3), 128)[None].repeat(B, 0)
    seg[1, 200:] = 7
    kw = {"bias": rng.standard_normal((1, N, T, T)).astype(np.float32),
          "mask": rng.random((B, N, T, T)) > 0.2, "segment_ids": jnp.asarray(seg),
          "logits_soft_cap": 3.0}
    dout = rng.standard_normal((B, T, N, 96)).astype(np.float32)
    q_, k_, v_, spec = validate(*(jnp.asarray(x) for x in (q, k, v)), jnp.asarray(kw["bias"]),
                                jnp.asarray(kw["mask"]), segment_ids=kw["segment_ids"],
                                logits_soft_cap=3.0)
    out, lse = flash_attention_forward(q_, k_, v_, spec, block_q=128, block_k=128,
                                       interpret=True)
    cfg = make_backward_config(spec, block_q=128, block_k=128, fused=True, chip=chip)
    assert grads_on_lanes(cfg, 1) == (chip == "v6e")
    got = backward._backward(q_, k_, v_, spec, out, lse, jnp.asarray(dout), cfg=cfg,
                             interpret=True, fused=1)
    _assert_matches_oracle(got, q, k, v, dout, kw)


@pytest.mark.parametrize("visit,chunks,interpret,T,bq,bk", [
    (True, 1, "generic", 700, 256, 256), (False, 1, "generic", 700, 256, 256),
    (True, 3, "generic", 700, 256, 256), (False, 3, "generic", 700, 256, 256),
    (True, 1, "generic", 512, 256, 512), (False, 2, "generic", 1024, 512, 256),
    (True, 1, "tpu", 700, 256, 256)],
    ids=["visit", "dense", "visit-chunks", "dense-chunks", "kv-twice-q", "q-twice-kv",
         "tpu-interpret"])
def test_fused_backward_runs_diagonal_tiles_as_strips(monkeypatch, visit, chunks, interpret,
                                                      T, bq, bk):
    """A causal tile the diagonal crosses runs as its kv strips of 128 rows, each from the
    first query it sees (here from 256-blocks: the real minimum, 512, is too big to
    interpret), on both grids, with dQ whole and in query chunks, GQA (G = 2): square blocks
    with T = 700 padded to 768 (lengths masked in every piece), B_c = 2 B_r (two crossing
    offsets, the unmasked strips merged into one piece without a mask) and B_r = 2 B_c; in
    TPU interpret mode too (race detector on). The float64 oracle's gradients."""
    from flashlab.kernels import diagonal
    _interpretable_strips(monkeypatch)
    q, k, v, dout, (q_, k_, v_, spec, out, lse) = _causal_case(29, 1, T, 2, 1, 64, 256)
    cfg = make_backward_config(spec, block_q=bq, block_k=bk, visit_grid=visit)
    assert diagonal.applies(cfg) and diagonal.cases(cfg)
    _fused_matches_causal_oracle(q, k, v, dout, (q_, k_, v_, spec, out, lse), cfg, interpret,
                                 chunks)


@pytest.mark.parametrize("visit,chunks,G,interpret,bq,bk", [
    (True, 1, 1, "generic", 256, 256), (False, 2, 2, "generic", 256, 256),
    (True, 1, 1, "generic", 256, 512), (False, 1, 1, "generic", 512, 256),
    (True, 2, 2, "tpu", 256, 256)],
    ids=["visit", "dense-chunks-gqa", "kv-twice-q", "q-twice-kv", "tpu-interpret"])
def test_causal_fused_backward_reads_do_by_columns_on_v6e(monkeypatch, visit, chunks, G,
                                                          interpret, bq, bk):
    """Causal the only mask, on v6e: dO and dQ hold the query positions on lanes
    (:func:`backward_config.grads_on_lanes`), so each diagonal strip reads its queries of dO
    as columns ``[d, q_hi − q_lo]``, as it reads the transposed statistics. T = 1024 (whole
    blocks: lengths would keep dO on rows) on both grids, dQ whole and in two query chunks
    with GQA (G = 2), kv blocks twice the q block and half of it; in TPU interpret mode too
    (race detector on). The float64 oracle's gradients to float32 tolerance."""
    from flashlab.kernels import diagonal
    from flashlab.kernels.backward_grid import dkdv_grid_spec
    _interpretable_strips(monkeypatch)
    q, k, v, dout, (q_, k_, v_, spec, out, lse) = _causal_case(31, 1, 1024, 2 * G, 2, 64,
                                                               256)
    cfg = make_backward_config(spec, block_q=bq, block_k=bk, visit_grid=visit, chip="v6e")
    assert diagonal.applies(cfg) and grads_on_lanes(cfg, chunks)
    assert dkdv_grid_spec(cfg, fused=chunks).spec("do").block_shape == (None, None, 64, bq)
    _fused_matches_causal_oracle(q, k, v, dout, (q_, k_, v_, spec, out, lse), cfg, interpret,
                                 chunks)


def test_fused_backward_masks_only_the_crossed_pieces(monkeypatch):
    """A tile below the causal diagonal is seen whole: the fused backward's interior tile
    builds no mask (v6e 2048²: 22742 -> 20890 cycles a tile), only the crossed tiles' masked
    strips do (two iotas each: query and key positions)."""
    from conftest import kernel_eqns
    from flashlab.kernels import backward, diagonal
    _interpretable_strips(monkeypatch)
    q, k, v, dout, (q_, k_, v_, spec, out, lse) = _causal_case(29, 1, 768, 2, 1, 64, 256)
    cfg = make_backward_config(spec, block_q=256, block_k=256)
    masked = sum(p.masked for _, pieces in diagonal.cases(cfg) for p in pieces)
    [kernel] = kernel_eqns(lambda *a: backward._backward(*a, cfg=cfg, interpret=True,
                                                         fused=1)[:3],
                           q_, k_, v_, spec, out, lse, jnp.asarray(dout))
    assert masked == 2 and sum(e.primitive.name == "iota" for e in kernel) == 2 * masked


@pytest.mark.parametrize("visit,interpret,T,bq,bk", [
    (True, "generic", 1024, 256, 256), (False, "generic", 768, 256, 256),
    (True, "generic", 768, 256, 256), (False, "generic", 1024, 256, 512),
    (True, "generic", 1024, 512, 256), (True, "tpu", 1024, 256, 512)],
    ids=["folded", "dense", "visit", "kv-twice-q", "q-twice-kv", "tpu-interpret"])
def test_fused_backward_first_visit_writes_dk_dv(monkeypatch, visit, interpret, T, bq, bk):
    """With one query head per kv head, whole lengths and dQ whole, the first tile that sees
    a kv block is the crossed one at ``d >= 0``: its strips write dK, dV (rows no strip
    reaches, where B_c > B_r, are zeroed there) and no step zeroes the accumulators. On the
    folded grid (an even number of kv blocks), else on the dense and the visit grids; the
    float64 oracle's gradients, in TPU interpret mode too (race detector on)."""
    from flashlab.kernels import backward, diagonal
    _interpretable_strips(monkeypatch)
    q, k, v, dout, (q_, k_, v_, spec, out, lse) = _causal_case(31, 1, T, 2, 2, 64, 256)
    cfg = make_backward_config(spec, block_q=bq, block_k=bk, visit_grid=visit)
    assert diagonal.writes_first(cfg, 1) and not diagonal.writes_first(cfg, 2)
    assert diagonal.folds(cfg, 1) == (cfg.num_kv_blocks % 2 == 0)   # folded: any visit_grid
    assert diagonal.uncovered(dict(diagonal.cases(cfg))[0], bk) == (
        ((bq, bk),) if bk > bq else ())
    mode = device.tpu_interpret_params() if interpret == "tpu" else True
    got = backward._backward(q_, k_, v_, spec, out, lse, jnp.asarray(dout), cfg=cfg,
                             interpret=mode, fused=1)[:3]
    _assert_matches_oracle(got, q, k, v, dout, {"is_causal": True})
    if interpret == "tpu":
        assert compat.races_found() is False


def test_folded_grid_with_fewer_keys_than_queries(monkeypatch):
    """Causal with kv_len < q_len (no padding, top-left aligned): every kv block is still first
    seen by its crossed tile, so the folded grid and the first-visit write hold; the float64
    oracle's gradients."""
    from flashlab.kernels import backward, diagonal
    _interpretable_strips(monkeypatch)
    rng = np.random.default_rng(33)
    q, k, v = random_qkv(rng, 1, 1024, 512, 2, 2, 64)
    dout = rng.standard_normal((1, 1024, 2, 64)).astype(np.float32)
    q_, k_, v_, spec = validate(*(jnp.asarray(x) for x in (q, k, v)), None, None,
                                is_causal=True)
    out, lse = flash_attention_forward(q_, k_, v_, spec, block_q=256, block_k=256,
                                       interpret=True)
    cfg = make_backward_config(spec, block_q=256, block_k=256)
    assert diagonal.folds(cfg, 1)
    got = backward._backward(q_, k_, v_, spec, out, lse, jnp.asarray(dout), cfg=cfg,
                             interpret=True, fused=1)[:3]
    _assert_matches_oracle(got, q, k, v, dout, {"is_causal": True})


def test_first_visit_writes_only_where_every_kv_row_is_first_seen_on_the_diagonal():
    """GQA (G query heads each visit a kv block first), padding or run-time lengths (the
    crossed tile may skip), dQ in chunks, kv longer than q, or no strips: the accumulators
    are zeroed as before."""
    from flashlab.kernels import diagonal

    def cfg_of(T=2048, S=None, N=1, K=1, block=512, lengths=False):
        x = jax.ShapeDtypeStruct((1, T, N, 64), jnp.bfloat16)
        y = jax.ShapeDtypeStruct((1, S or T, K, 64), jnp.bfloat16)
        n = jax.ShapeDtypeStruct((1,), jnp.int32)
        spec = jax.eval_shape(lambda q, k, v, n: validate(
            q, k, v, None, None, is_causal=True, query_seq_lengths=n if lengths else None)[3],
            x, y, y, n)
        return make_backward_config(spec, block_q=block, block_k=block, chip="v5e")
    assert diagonal.writes_first(cfg_of(), 1)
    assert not diagonal.writes_first(cfg_of(), 2)                       # dQ in chunks
    assert not diagonal.writes_first(cfg_of(N=2), 1)                    # G = 2
    assert not diagonal.writes_first(cfg_of(T=2000), 1)                 # kv padding
    assert not diagonal.writes_first(cfg_of(S=4096), 1)                 # kv longer than q
    assert not diagonal.writes_first(cfg_of(block=256), 1)              # no strips
    assert not diagonal.writes_first(cfg_of(lengths=True), 1)           # run-time lengths
    pieces = (diagonal.Piece(0, 128, 0, 256, True), diagonal.Piece(256, 384, 0, 256, True))
    assert diagonal.uncovered(pieces, 512) == ((128, 256), (384, 512))


@pytest.mark.parametrize("T,bq,bk", [(2048, 512, 512), (4096, 512, 1024), (4096, 1024, 512),
                                     (8192, 2048, 2048)])
def test_the_folded_grid_runs_every_visible_tile_once_and_nothing_else(T, bq, bk):
    """Folded row ``p`` holds kv block ``p`` then kv block ``T_c − 1 − p``, each from its
    crossed q block to the last: replayed on ints, the steps are exactly the causal visible
    tiles, each once, with one first and one last visit per kv block, in order; and the
    fused kernel's grid is ``(B, K, T_c / 2, R)`` with no empty step."""
    from flashlab.kernels import diagonal
    from flashlab.kernels.backward_grid import dkdv_grid_spec
    x = jax.ShapeDtypeStruct((2, T, 3, 64), jnp.bfloat16)
    spec = jax.eval_shape(lambda q, k, v: validate(q, k, v, None, None, is_causal=True)[3],
                          x, x, x)
    cfg = make_backward_config(spec, block_q=bq, block_k=bk, chip="v5e", fused=True)
    assert diagonal.folds(cfg, 1) and not diagonal.folds(cfg, 2)
    nk, nq, R = cfg.num_kv_blocks, cfg.num_q_blocks, diagonal.fold_length(cfg)
    seen, firsts, lasts = [], [], []
    for p in range(nk // 2):
        for s in range(R):
            j, i, first, last = diagonal.fold_step(cfg, p, s)
            seen.append((int(j), int(i)))
            firsts += [int(j)] * bool(first)
            lasts += [int(j)] * bool(last)
    visible = [(j, i) for j in range(nk) for i in range(nq)
               if (i + 1) * bq - 1 >= j * bk]                       # some q >= some k
    assert sorted(seen) == sorted(visible) and len(seen) == len(set(seen))
    assert sorted(firsts) == sorted(lasts) == list(range(nk))
    for j in range(nk):                             # a kv block's visits are consecutive
        at = [t for t, (jj, _) in enumerate(seen) if jj == j]
        assert at == list(range(at[0], at[0] + len(at)))
    gs = dkdv_grid_spec(cfg, fused=1)
    assert gs.grid == (2, 3, nk // 2, R) and gs.visit_rows is None
    assert math.prod(gs.grid) == 2 * 3 * len(visible)


def test_diagonal_strips_cut_the_staircase():
    """At 1024² with 128-row strips (v5e) the diagonal tile is 8 masked strips, strip a from
    query a on: 9/16 of the tile, against 3/4 for 2 x 2 sub-tiles. At 1024 x 2048 with
    256-row strips (v6e) a crossed tile sits at d = 0 (4 strips, the upper half of its kv rows
    sees nothing) or d = -1024 (one unmasked 1024² piece, then 4 strips). T = 2048: 2 diagonal
    tiles per head. Below 512-blocks, and with a window, tiles stay whole."""
    from flashlab.kernels import diagonal
    from flashlab.kernels.diagonal import Piece
    spec = _abstract_spec(2048)
    cfg = make_backward_config(spec, block_q=1024, block_k=1024, chip="v5e", fused=True)
    ((d, pieces),) = diagonal.cases(cfg)
    assert d == 0 and [p.q_lo for p in pieces] == list(range(0, 1024, 128))
    assert all(p.masked and p.k_hi - p.k_lo == 128 for p in pieces)
    area = sum((p.k_hi - p.k_lo) * (1024 - p.q_lo) for p in pieces)
    assert area / 1024**2 == 9 / 16 and diagonal.visits(cfg) == (2,)
    assert diagonal.picture(cfg, 0).splitlines()[:2] == ["\\#######", ".\\######"]
    with pytest.raises(ValueError, match=r"d: expected one of the crossing offsets \[0\]"):
        diagonal.picture(cfg, 512)
    cfg = make_backward_config(spec, block_q=1024, block_k=2048, chip="v6e", fused=True)
    strips = tuple(Piece(a, a + 256, a - 1024 * (a >= 1024), 1024, True)
                   for a in range(0, 2048, 256))
    assert diagonal.cases(cfg) == ((-1024, (Piece(0, 1024, 0, 1024, False), *strips[4:])),
                                   (0, strips[:4]))
    assert diagonal.visits(cfg) == (1, 1)
    assert diagonal.picture(cfg, -1024).splitlines()[9] == "x\\######"   # a 256-row strip
    assert not diagonal.applies(make_backward_config(spec, block_q=256, block_k=256,
                                                     chip="v5e"))
    x = jax.ShapeDtypeStruct((1, 2048, 1, 128), jnp.bfloat16)
    windowed = jax.eval_shape(lambda q, k, v: validate(q, k, v, None, None, is_causal=True,
                                                       local_window_size=(256, 0))[3], x, x, x)
    cfg = make_backward_config(windowed, block_q=1024, block_k=1024, chip="v5e")
    assert not diagonal.applies(cfg) and diagonal.cases(cfg) == ()


def _abstract_spec(T, *, heads=1, kv_heads=1, d=128):
    x = jax.ShapeDtypeStruct((1, T, heads, d), jnp.bfloat16)
    y = jax.ShapeDtypeStruct((1, T, kv_heads, d), jnp.bfloat16)
    return jax.eval_shape(lambda q, k, v: validate(q, k, v, None, None, is_causal=True)[3],
                          x, y, y)


def test_auto_backward_is_fused_where_its_resident_dq_fits():
    """``backward="auto"`` runs the fused kernel at the split's own blocks: its dQ ``[G, T, d]``
    float32 (one buffer, ``pl.Buffered(1)``) whole where it fits the VMEM limit, else in the
    fewest query chunks that fit (at most ``MAX_DQ_CHUNKS``), else the split. ``"fused"``
    where even those cannot fit is refused by name."""
    from flashlab.kernels.backward_grid import MAX_DQ_CHUNKS, resolve_backward
    cfg, fused = resolve_backward(_abstract_spec(8192), "auto", chip="v5e")
    split, _ = resolve_backward(_abstract_spec(8192), "split", chip="v5e")
    assert fused == 1 and (cfg.block_q, cfg.block_k) == (split.block_q, split.block_k)
    resident = 8192 * 128 * 4                      # dQ [1, T, d] float32, one buffer
    assert blk.backward_vmem_bytes(1024, 1024, 128, jnp.bfloat16, fused=True, q_len=8192) - (
        blk.backward_vmem_bytes(1024, 1024, 128, jnp.bfloat16, fused=True, q_len=1024)) == (
        resident - 1024 * 128 * 4)                 # the estimate grows with T by dQ alone
    partials = 2 * 1024 * (128 + 128) * (4 - 2)    # dK, dV blocks float32, double-buffered
    assert blk.backward_vmem_bytes(1024, 1024, 128, jnp.bfloat16, fused=True, q_len=8192,
                                   q_chunks=4) == blk.backward_vmem_bytes(
        1024, 1024, 128, jnp.bfloat16, fused=True, q_len=8192) - resident * 3 // 4 + partials
    # v4 (16 MiB): at 1024-blocks the dQ in 2 chunks (tests/test_tpu_compile.py compiles it at
    # the estimate); 2048 x 1024 fits in no form: the measured default blocks run instead
    assert resolve_backward(_abstract_spec(8192), "auto", chip="v4",
                            block_q=1024, block_k=1024)[1] == 2
    cfg, _ = resolve_backward(_abstract_spec(8192), "auto", chip="v4", block_q=2048, block_k=1024)
    assert (cfg.block_q, cfg.block_k) == blk.choose_backward_block_sizes(
        8192, 8192, 128, jnp.bfloat16, "v4", is_causal=True, fused=True)
    assert resolve_backward(_abstract_spec(8192), "auto", chip="v4", block_q=512,
                            block_k=1024)[1] == 1
    # 128 MiB of dQ on v5e: two chunks of 64; G = 8 query heads per kv head at T = 32768
    # (128 MiB) on v6e at 1024²: two chunks; on v4 at 512x512, T = 131072 (64 MiB): eight chunks
    assert resolve_backward(_abstract_spec(262144), "auto", chip="v5e", block_q=512,
                            block_k=512)[1] == 2
    assert resolve_backward(_abstract_spec(32768, heads=8), "auto", chip="v6e", block_q=1024,
                            block_k=1024)[1] == 2
    assert resolve_backward(_abstract_spec(131072), "auto", chip="v4", block_q=512,
                            block_k=512)[1] == MAX_DQ_CHUNKS
    assert not resolve_backward(_abstract_spec(8192), "split", chip="v5e")[1]
    with pytest.raises(ValueError, match=r"backward='fused': q_len=262144 .* MiB of VMEM on "
                                         r"v4 even with its dQ .* in 8 chunks.* expected "
                                         r"backward='split'"):
        resolve_backward(_abstract_spec(262144), "fused", chip="v4")
    with pytest.raises(ValueError, match="backward: expected one of"):
        resolve_backward(_abstract_spec(8192), "fast", chip="v5e")


@pytest.mark.parametrize("visit,option,interpret", [
    (True, "causal", "generic"), (False, "causal", "generic"),
    (False, "everything", "generic"), (True, "causal", "tpu"), (False, "plain", "generic")],
    ids=["visit-grid", "dense-grid", "dense-everything", "visit-tpu-interpret", "dense-plain"])
def test_fused_backward_in_query_chunks(visit, option, interpret):
    """The fused kernel with its resident dQ in 2 and 3 query chunks (dK, dV as float32
    partials, summed after): grid ``(b, hk, c, j, g, i)`` or the chunked visit list, GQA
    (G = 2), two batch rows and kv heads, T = 330 padded to 384 (three 128-row q blocks),
    on both grids; with every option at once (bias, mask, segment ids, lengths, window) on
    the dense grid; on the visit grid in TPU interpret mode (race detector on, uninitialized
    memory NaN); plain non-causal at T = 384, where every block is visible and the grid
    fetches its own blocks unclamped (``blocks.every_block_visible``). The float64 oracle's
    gradients to float32 tolerance."""
    from flashlab.kernels import backward
    from flashlab.kernels.backward_grid import dkdv_grid_spec
    rng = np.random.default_rng(23)
    B, T, N, K, H = 2, 384 if option == "plain" else 330, 4, 2, 64
    q, k, v = random_qkv(rng, B, T, T, N, K, H)
    kw = ({"is_causal": True} if option == "causal" else {} if option == "plain"
          else mask_kwargs("everything", rng, B, T, T, N))
    dout = rng.standard_normal((B, T, N, H)).astype(np.float32)
    q_, k_, v_, spec = validate(*(jnp.asarray(x) for x in (q, k, v)),
                                *(jnp.asarray(kw[n]) if kw.get(n) is not None else None
                                  for n in ("bias", "mask")),
                                **{n: x for n, x in kw.items() if n not in ("bias", "mask")})
    out, lse = flash_attention_forward(q_, k_, v_, spec, block_q=128, block_k=128,
                                       interpret=True)
    cfg = make_backward_config(spec, block_q=128, block_k=128, visit_grid=visit)
    assert blk.every_block_visible(cfg) == (option == "plain")
    ref = oracle_grads(q, k, v, dout, kw)
    scale = max(np.abs(r).max() for r in ref)
    mode = device.tpu_interpret_params() if interpret == "tpu" else True
    for n in ((3,) if interpret == "tpu" else (3, 1)):
        gs = dkdv_grid_spec(cfg, fused=n)
        dims = (H, 384 // n) if grads_on_lanes(cfg, n) else (384 // n, H)   # v6e, 7x: lanes
        assert gs.q_chunks == n and gs.spec("dq").block_shape == (None, 2, *dims)
        if n > 1:
            assert gs.shape("dk").shape == (n, B, K, 384, H)        # float32 partials
            assert len(gs.grid) == (4 if visit else 6)
        got = backward._backward(q_, k_, v_, spec, out, lse, jnp.asarray(dout), cfg=cfg,
                                 interpret=mode, fused=n)
        for label, g, r in zip(("dq", "dk", "dv", "dbias"), got, ref):
            assert np.abs(np.asarray(g) - r).max() / scale <= F32_RTOL, (n, label)
    if interpret == "tpu":
        assert compat.races_found() is False


def test_fused_backward_through_jax_grad():
    """``flash_attention(..., backward="fused")`` is what ``jax.grad`` runs: the same
    gradients as the split kernels (to float32 summation order); a bad value is refused."""
    rng = np.random.default_rng(13)
    q, k, v = (jnp.asarray(x) for x in random_qkv(rng, 1, 128, 256, 2, 1, 64))

    def grads(backward):
        loss = lambda q, k, v: jnp.sum(flash_attention(   # noqa: E731
            q, k, v, is_causal=True, block_q=64, block_k=128, interpret=True,
            backward=backward) ** 2)
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    for label, f, s in zip(("dq", "dk", "dv"), grads("fused"), grads("split")):
        scale = float(jnp.abs(s).max())
        assert float(jnp.abs(f - s).max()) <= F32_RTOL * scale, label
    with pytest.raises(ValueError, match="backward: expected one of"):
        flash_attention(q, k, v, backward="fast", interpret=True)


def test_fully_masked_rows_have_zero_finite_gradients():
    rng = np.random.default_rng(4)
    B, T, S, N, H = 2, 24, 200, 2, 64
    q, k, v = random_qkv(rng, B, T, S, N, N, H)
    kw = {"key_value_seq_lengths": np.array([0, 150], np.int32),       # row 0: no keys
          "query_seq_lengths": np.array([24, 10], np.int32),           # rows >= 10 of row 1
          "local_window_size": (3, 0)}
    (dq, dk, dv), _, _ = _check(q, k, v, kw, block_q=8, block_k=128)
    dq, dk, dv = (np.asarray(x) for x in (dq, dk, dv))
    assert (dq[0] == 0).all() and (dk[0] == 0).all() and (dv[0] == 0).all()
    assert (dq[1, 10:] == 0).all() and (dk[1, 150:] == 0).all()


# ----------------------------------------------------------------------------- transforms

def test_jit_grad_vmap_and_checkpoint():
    rng = np.random.default_rng(5)
    B, T, N, H = 2, 30, 2, 64
    q, k, v = (jnp.asarray(x) for x in random_qkv(rng, B, T, T, N, N, H))
    w = jnp.asarray(rng.standard_normal((H, H)).astype(np.float32) / 8)

    def model(w, q, k, v, attn):                     # one attention layer + a projection
        return jnp.sum(attn(q @ w, k, v) ** 2)

    ours = lambda q, k, v: flash_attention(q, k, v, is_causal=True, interpret=True)  # noqa
    ref = lambda q, k, v: naive_attention(q, k, v, is_causal=True)                    # noqa
    g_ref = jax.grad(model, argnums=(0, 1, 2, 3))(w, q, k, v, ref)
    g_jit = jax.jit(jax.grad(model, argnums=(0, 1, 2, 3)), static_argnums=4)(w, q, k, v, ours)
    g_ckpt = jax.jit(jax.grad(jax.checkpoint(model, static_argnums=(4,)),
                              argnums=(0, 1, 2, 3)), static_argnums=4)(w, q, k, v, ours)
    # vmap over a leading axis (two independent problems), grad inside
    g_vmap = jax.vmap(jax.grad(lambda q, k, v: model(w, q, k, v, ours), argnums=(0, 1, 2)))(
        q[:, None], k[:, None], v[:, None])
    for g, r in zip(g_jit, g_ref):
        assert np.abs(np.asarray(g - r)).max() <= F32_RTOL * np.abs(np.asarray(r)).max()
    for g, r in zip(g_ckpt, g_ref):
        assert np.abs(np.asarray(g - r)).max() <= F32_RTOL * np.abs(np.asarray(r)).max()
    for g, r in zip(g_vmap, g_ref[1:]):
        g = np.asarray(g)[:, 0]
        assert np.abs(g - np.asarray(r)).max() <= F32_RTOL * np.abs(np.asarray(r)).max()


def test_backward_entry_point_and_bias_cotangent_shape():
    rng = np.random.default_rng(6)
    B, T, N, H = 2, 20, 2, 64
    q, k, v = random_qkv(rng, B, T, T, N, N, H)
    bias = rng.standard_normal((1, N, T, T)).astype(np.float32)
    qj, kj, vj, spec = validate(q, k, v, bias, is_causal=True)
    out, lse = flash_attention_forward(qj, kj, vj, spec, interpret=True)
    dout = jnp.ones_like(out)
    dq, dk, dv, dbias = flash_attention_backward(qj, kj, vj, spec, out, lse, dout,
                                                 interpret=True)
    assert dq.shape == q.shape and dk.shape == k.shape and dbias.shape == bias.shape
    ref = oracle_grads(q, k, v, np.ones(out.shape, np.float32), {"bias": bias, "is_causal": True})
    assert np.abs(np.asarray(dbias) - ref[3]).max() <= F32_RTOL * np.abs(ref[3]).max()


# ----------------------------------------------------------------------------- block ranges

@settings(deadline=None, max_examples=40)
@given(q_len=st.integers(1, 300), kv_len=st.integers(0, 300), bq=st.sampled_from([8, 32]),
       bk=st.sampled_from([8, 128]), causal=st.booleans(),
       window=st.sampled_from([None, (3, 0), (0, 5), (None, 2), (7, None)]))
def test_q_block_range_is_exactly_the_visible_blocks(q_len, kv_len, bq, bk, causal, window):
    nq, nk = -(-q_len // bq), max(1, -(-kv_len // bk))
    for j in range(nk):
        lo, hi = blk.q_block_range(j, q_len, kv_len, block_q=bq, block_k=bk,
                                   is_causal=causal, window=window)
        want = [i for i in range(nq)
                if block_maybe_visible(i * bq, i * bq + bq, j * bk, j * bk + bk,
                                       is_causal=causal, window=window) is not False
                and bool(block_maybe_visible(i * bq, min(i * bq + bq, q_len), j * bk,
                                             min(j * bk + bk, kv_len), is_causal=causal,
                                             window=window))
                and j * bk < kv_len]
        got = list(range(lo, hi + 1))
        assert set(want) <= set(got)                 # never skips a visible block
        # and is tight up to the partial last blocks (exact for full blocks)
        full = [i for i in range(nq) if block_maybe_visible(
            i * bq, i * bq + bq, j * bk, j * bk + bk, is_causal=causal, window=window)
            and j * bk < kv_len and i * bq < q_len]
        assert set(got) <= set(full)


def test_backward_block_sizes_fit_every_chip():
    for chip in blk.VMEM_BYTES:
        for d in (64, 128, 256):
            bq, bk = blk.choose_backward_block_sizes(8192, 8192, d, jnp.bfloat16, chip,
                                                     bias_dtype=jnp.float32, has_mask=True)
            assert bq % 32 == 0 and bk % 128 == 0
            assert blk.backward_vmem_bytes(bq, bk, d, jnp.bfloat16, bias_dtype=jnp.float32,
                                           has_mask=True) <= blk.vmem_limit_bytes(chip)
    assert blk.choose_backward_block_sizes(40, 100, 64, jnp.float32) == (40, 128)
    # a soft cap holds one more [B_r, B_c] float32 tile; the fused kernel charges its own
    # measured spill slots (BACKWARD_SPILL_TILES["fused"]) and its resident dQ (one block here)
    base = blk.backward_vmem_bytes(512, 512, 128, jnp.bfloat16)
    tile = 512 * 512 * 4
    spill = blk.BACKWARD_SPILL_TILES
    assert blk.backward_vmem_bytes(512, 512, 128, jnp.bfloat16, soft_cap=True) == base + tile
    assert blk.backward_vmem_bytes(512, 512, 128, jnp.bfloat16, fused=True) == (
        base - int(spill["dkdv"] * tile) + int(spill["fused"] * tile) + 512 * 128 * 4)
    # explicit blocks that do not fit the backward fall back to the backward's choice
    spec = validate(jnp.zeros((1, 8192, 1, 256)), jnp.zeros((1, 8192, 1, 256)),
                    jnp.zeros((1, 8192, 1, 256)))[3]
    cfg = make_backward_config(spec, block_q=4096, block_k=4096)
    assert (cfg.block_q, cfg.block_k) == blk.choose_backward_block_sizes(8192, 8192, 256,
                                                                         jnp.float32)


# ----------------------------------------------------------------------------- traffic

@pytest.mark.parametrize("N,bq,bk", [(1024, 128, 128), (1024, 256, 512)])
def test_backward_traffic_closed_form(N, bq, bk):
    """Non-causal, d = 128 (no lane padding), bf16: per (b, h)
    dK/dV kernel: K, V read and dK, dV written once; Q, dO, stats_t re-read per kv block;
    dQ kernel: Q, dO, stats read and dQ written once; K, V re-read per q block.
    stats_t: lse and D_i as 8 sublane rows per position; stats: 256 lanes (lse | D_i)."""
    B, H, d, e = 2, 3, 128, 2
    r = traffic.kernel_hbm_bytes("backward", batch=B, heads=H, seq_len=N, head_dim=d,
                                 dtype="bfloat16", block_q=bq, block_k=bk)
    Tc, Tr, bh = N // bk, N // bq, B * H
    assert r["dkdv/k"] == r["dkdv/dk"] == bh * N * d * e
    assert r["dkdv/q"] == r["dkdv/do"] == bh * Tc * N * d * e
    assert r["dkdv/stats_t"] == bh * Tc * N * 8 * 4
    assert r["dq/q"] == r["dq/dq"] == bh * N * d * e and r["dq/stats"] == bh * N * 256 * 4
    assert r["dq/k"] == r["dq/v"] == bh * Tr * N * d * e
    assert r["total"] == r["dkdv/total"] + r["dq/total"] + r["rowsum_D"]


def test_backward_traffic_causal_and_gqa():
    kw = dict(batch=1, heads=4, seq_len=2048, head_dim=128, dtype="bfloat16", block_q=128,
              block_k=128)
    full = traffic.kernel_hbm_bytes("backward", **kw)
    causal = traffic.kernel_hbm_bytes("backward", **kw, is_causal=True)
    n = 2048 // 128
    # kv block j is seen by q blocks j..n-1; the last j reuses the block already resident
    assert causal["dkdv/q"] / full["dkdv/q"] == (n * (n + 1) // 2 - 1) / n**2
    assert causal["dq/k"] < 0.6 * full["dq/k"] and causal["total"] < 0.7 * full["total"]
    gqa = traffic.kernel_hbm_bytes("backward", **kw, kv_heads=1)
    assert gqa["dkdv/k"] == full["dkdv/k"] // 4 and gqa["dkdv/dk"] == full["dkdv/dk"] // 4
    assert gqa["dkdv/q"] == full["dkdv/q"]           # K/V never repeated: Q streams as before


def test_backward_grids_are_the_kernels_own():
    spec = validate(jnp.zeros((1, 300, 4, 64)), jnp.zeros((1, 300, 2, 64)),
                    jnp.zeros((1, 300, 2, 64)), is_causal=True)[3]
    # causal: the visit grids, 6 of the 3 x 3 block pairs (kv rows for dK/dV, heads innermost)
    gs = backward_grid_specs(make_backward_config(spec, block_q=128, block_k=128,
                                                  visit_grid=True))
    assert gs["dkdv"].grid == (1, 2, 6, 2) and gs["dq"].grid == (1, 4, 6)
    assert gs["dkdv"].dimension_semantics == ("parallel", "parallel", "arbitrary", "arbitrary")
    cfg = make_backward_config(spec, block_q=128, block_k=128, visit_grid=False)
    gs = backward_grid_specs(cfg)
    assert gs["dkdv"].grid == (1, 2, 3, 2, 3) and gs["dq"].grid == (1, 4, 3, 3)
    assert gs["dkdv"].dimension_semantics[-2:] == ("arbitrary", "arbitrary")
    kg = traffic.kernel_grid("backward_dkdv", batch=1, heads=4, kv_heads=2, seq_len=300,
                             head_dim=64, dtype="float32", block_q=128, block_k=128,
                             is_causal=True)
    assert kg.grid == gs["dkdv"].grid


# ----------------------------------------------------------------------------- Mosaic / TPU

def test_backward_lowers_to_mosaic_for_tpu():
    rng = np.random.default_rng(9)
    B, T, S, N, K, H = 2, 40, 300, 4, 2, 80
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in random_qkv(rng, B, T, S, N, K, H))
    kw = mask_kwargs("everything", rng, B, T, S, N)
    bias = jnp.asarray(kw.pop("bias"))
    kw["segment_ids"] = (np.zeros((B, T), np.int32), np.zeros((B, S), np.int32))
    kw["query_seq_lengths"] = np.array([40, 7], np.int32)

    def loss(q, k, v, bias):
        return jnp.sum(flash_attention(q, k, v, bias, **kw, interpret=False).astype(jnp.float32))

    f = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
    text = f.trace(q, k, v, bias).lower(lowering_platforms=("tpu",)).as_text()
    assert text.count("tpu_custom_call") >= 2          # forward, the fused backward


@pytest.mark.parametrize("case", [
    dict(B=1, T=40, S=40, N=2, K=1, H=64, option="causal_window", bq=16, bk=128),
    dict(B=2, T=20, S=140, N=2, K=2, H=64, option="everything", bq=32, bk=128),
    # every block visible: no init region, a kv row's first step selects over the unwritten
    # (NaN-filled) accumulators instead of adding to them
    dict(B=2, T=64, S=256, N=2, K=1, H=64, option="none", bq=32, bk=128),
])
@pytest.mark.parametrize("backward", ["auto", "split"])   # auto: fused (its dQ fits)
def test_tpu_interpret_mode_no_races_no_uninitialized_reads(case, backward):
    rng = np.random.default_rng(10)
    q, k, v = random_qkv(rng, case["B"], case["T"], case["S"], case["N"], case["K"], case["H"])
    kw = mask_kwargs(case["option"], rng, case["B"], case["T"], case["S"], case["N"])
    _check(q, k, v, kw, interpret=device.tpu_interpret_params(), block_q=case["bq"],
           block_k=case["bk"], backward=backward)
    assert compat.races_found() is False


def test_gradient_parity_with_official_flash_attention():
    official = pytest.importorskip("jax.experimental.pallas.ops.tpu.flash_attention")
    rng = np.random.default_rng(11)
    B, T, N, D = 1, 256, 1, 128
    q, k, v = random_qkv(rng, B, T, T, N, N, D)
    scale = 1 / np.sqrt(D)
    bnth = lambda x: jnp.swapaxes(jnp.asarray(x), 1, 2)  # noqa: E731
    dout = rng.standard_normal(q.shape).astype(np.float32)

    def theirs(q, k, v):
        o = official.flash_attention(q, k, v, causal=True, sm_scale=scale)
        return jnp.sum(o * bnth(dout))

    with compat.force_tpu_interpret_mode(device.tpu_interpret_params()):
        g_theirs = jax.grad(theirs, argnums=(0, 1, 2))(bnth(q), bnth(k), bnth(v))
    g_theirs = [np.asarray(jnp.swapaxes(g, 1, 2)) for g in g_theirs]
    g_ours, _ = _grads(q, k, v, dout, {"is_causal": True},
                       interpret=device.tpu_interpret_params(), block_q=128, block_k=128)
    for label, a, b in zip(("dq", "dk", "dv"), g_ours, g_theirs):
        err = np.abs(np.asarray(a) - b).max() / np.abs(b).max()
        print(f"official parity {label}: relative error {err:.2e}")
        assert err <= F32_RTOL
