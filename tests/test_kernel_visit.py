"""The kernels' visit grids (flashlab/kernels/visit.py): the lists, the blocks they copy, and
the forward and backward kernels on them against the float64 oracle and the dense grid (tiny
shapes, interpret mode)."""
import numpy as np
import pytest

import jax.numpy as jnp

from conftest import flag_at_import
from flashlab.contract import masks
from flashlab.ladder import reference
from flashlab.kernels import blocks as blk, forward as fw, visit
from flashlab.kernels import forward_grid
from flashlab.kernels import forward_config
from flashlab.kernels import flash
from flashlab.kernels import backward as bw, backward_grid

CASES = [  # (q_len, kv_len, block_q, block_k, is_causal, window)
    (512, 512, 128, 128, True, None),
    (500, 700, 128, 256, True, None),          # padding on both sides
    (1024, 1024, 256, 128, False, (200, 0)),   # sliding window
    (384, 256, 128, 128, False, (0, 0)),       # q rows past every key: EMPTY visits
    (256, 640, 128, 128, True, (64, None)),
]


@pytest.mark.parametrize("q_len,kv_len,bq,bk,causal,window", CASES)
def test_visits_are_the_visible_pairs_and_copy_the_dense_grids_blocks(q_len, kv_len, bq, bk,
                                                                      causal, window):
    nq, nk = -(-q_len // bq), -(-kv_len // bk)
    kw = dict(q_len=q_len, kv_len=kv_len, block_q=bq, block_k=bk, is_causal=causal,
              window=window)
    v = visit.visit_table(num_q_blocks=nq, num_kv_blocks=nk, **kw)
    i, j, flags = visit.unpack(v.astype(np.int64))
    real = (flags & visit.EMPTY) == 0
    # every row appears, once FIRST and once LAST, rows in order, j increasing in a row
    assert sorted(set(i.tolist())) == list(range(nq))
    assert np.all(np.diff(i) >= 0)
    for r in range(nq):
        rows = np.flatnonzero(i == r)
        assert (flags[rows[0]] & visit.FIRST) and (flags[rows[-1]] & visit.LAST)
        assert np.all(np.diff(j[rows]) == 1)
    # the non-empty visits are exactly the pairs the dense grid computes
    dense = {(a, b) for a in range(nq) for b in range(nk)
             if masks.block_maybe_visible(a * bq, a * bq + bq, b * bk, b * bk + bk,
                                          is_causal=causal, window=window)
             and b * bk < kv_len and a * bq < q_len}
    assert {(a, b) for a, b, ok in zip(i.tolist(), j.tolist(), real) if ok} == dense
    assert int(real.sum()) == blk.num_visible_blocks(nq, nk, **kw)
    # the kv blocks a pipeline copies: the same sequence as the dense grid's clamped maps
    seq_dense = []
    for a in range(nq):
        lo, hi = blk.kv_block_range(a, q_len, kv_len, block_q=bq, block_k=bk,
                                    is_causal=causal, window=window)
        seq_dense += [(a, blk.clamp_block(b, lo, hi, nk)) for b in range(nk)]
    seq_visit = list(zip(i.tolist(), j.tolist()))
    assert visit.copied_blocks([b for _, b in seq_visit]) == \
        visit.copied_blocks([b for _, b in seq_dense])


def _spec(q_len, kv_len, causal, window, **kw):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, q_len, 2, 128)).astype(np.float32)
    kk = rng.standard_normal((1, kv_len, 1, 128)).astype(np.float32)
    v = rng.standard_normal((1, kv_len, 1, 128)).astype(np.float32)
    return q, kk, v, dict(is_causal=causal, local_window_size=window, **kw)


def test_auto_visit_grid_only_where_it_skips_steps():
    def cfg(causal, window=None, **kw):
        q, k, v, a = _spec(256, 256, causal, window)
        spec = masks.validate(q, k, v, None, None, **a)[3]
        return forward_config.make_config(spec, block_q=128, block_k=128, **kw)
    assert cfg(True).visit_grid and not cfg(False).visit_grid
    assert not cfg(True, visit_grid=False).visit_grid
    gs = forward_grid.forward_grid_spec(cfg(True))
    assert gs.grid == (1, 2, 3) and gs.num_scalar_prefetch == 3
    with pytest.raises(TypeError, match="visit_grid"):
        cfg(True, visit_grid="yes")


@pytest.mark.parametrize("T, block, chip, bwd_on_visits", [
    (2048, 1024, "7x", False), (8192, 1024, "v5e", True), (2048, 512, "7x", True),
    (2048, 512, "v5e", False), (2048, 512, "v4", False), (2048, 512, "v5p", True)])
def test_the_backward_takes_a_visit_list_only_where_it_pays(T, block, chip, bwd_on_visits):
    # causal: T=2048 at 1024² keeps 3 of 4 steps (the forward's visit step pays, the
    # backward's dearer ones do not: forward_config.VISIT_MAX_SHARE), T=8192 keeps 36 of 64,
    # T=2048 at 512² 10 of 16 (enough, except on v4 and v5e, whose dense steps are the
    # cheapest against their visit steps).
    x = jnp.zeros((1, T, 2, 128), jnp.bfloat16)
    spec = masks.validate(x, x, x, None, None, is_causal=True)[3]
    fwd = forward_config.make_config(spec, block_q=block, block_k=block, chip=chip)
    bwd = backward_grid.make_backward_config(spec, block_q=block, block_k=block, chip=chip)
    assert fwd.visit_grid
    assert bwd.visit_grid == bwd_on_visits
    assert backward_grid.make_backward_config(spec, block_q=block, block_k=block, chip=chip,
                                              visit_grid=True).visit_grid


def test_visit_grid_refused_with_offsets():
    import dataclasses
    q, k, v, a = _spec(256, 256, True, None)
    spec = masks.validate(q, k, v, None, None, **a)[3]
    spec = dataclasses.replace(spec, q_offset=jnp.int32(128), kv_offset=jnp.int32(0))
    assert not forward_config.make_config(spec, block_q=128, block_k=128).visit_grid
    with pytest.raises(ValueError, match="offsets"):
        forward_config.make_config(spec, block_q=128, block_k=128, visit_grid=True)


@pytest.mark.parametrize("causal,window,lengths", [(True, None, (200, 250)),
                                                    (False, (96, 0), None)])
def test_visit_grid_kernel_matches_oracle(causal, window, lengths):
    """GQA, padding, run-time lengths and windows on the visit grid (f32 tol 2e-5)."""
    q, k, v, a = _spec(250, 250, causal, window)
    if lengths is not None:
        a.update(query_seq_lengths=jnp.array([lengths[0]]),
                 key_value_seq_lengths=jnp.array([lengths[1]]))
    out = flash.flash_attention(q, k, v, block_q=128, block_k=128, interpret=True, **a)
    ref = reference.oracle_attention(q, k, v, **a)
    rows = slice(None) if lengths is None else slice(0, lengths[0])
    np.testing.assert_allclose(np.asarray(out)[:, rows], np.asarray(ref)[:, rows],
                               atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("q_len,kv_len,bq,bk,causal,window", CASES)
def test_transposed_visits_are_the_visible_pairs_and_copy_the_dense_grids_blocks(
        q_len, kv_len, bq, bk, causal, window):
    """The dK/dV kernel's list: rows are kv blocks j, each listing the q blocks that see it."""
    nq, nk = -(-q_len // bq), -(-kv_len // bk)
    kw = dict(q_len=q_len, kv_len=kv_len, block_q=bq, block_k=bk, is_causal=causal,
              window=window)
    v = visit.visit_table(num_q_blocks=nq, num_kv_blocks=nk, transposed=True, **kw)
    j, i, flags = visit.unpack(v.astype(np.int64))
    real = (flags & visit.EMPTY) == 0
    assert sorted(set(j.tolist())) == list(range(nk)) and np.all(np.diff(j) >= 0)
    for r in range(nk):
        rows = np.flatnonzero(j == r)
        assert (flags[rows[0]] & visit.FIRST) and (flags[rows[-1]] & visit.LAST)
        assert np.all(np.diff(i[rows]) == 1)
    forward = visit.visit_table(num_q_blocks=nq, num_kv_blocks=nk, **kw)
    fi, fj, ff = visit.unpack(forward.astype(np.int64))
    assert ({(a, b) for a, b, ok in zip(i.tolist(), j.tolist(), real) if ok}
            == {(a, b) for a, b, f in zip(fi.tolist(), fj.tolist(), ff) if not f & visit.EMPTY})
    seq_dense = []
    for b in range(nk):
        lo, hi = blk.q_block_range(b, q_len, kv_len, block_q=bq, block_k=bk, is_causal=causal,
                                   window=window)
        seq_dense += [blk.clamp_block(a, lo, hi, nq) for a in range(nq)]
    assert visit.copied_blocks(i.tolist()) == visit.copied_blocks(seq_dense)


@pytest.mark.parametrize("q_len,kv_len,bq,bk,causal,window", CASES)
def test_chunked_transposed_visits_cover_each_chunk_once(q_len, kv_len, bq, bk, causal,
                                                         window):
    """The fused backward's list with its dQ in query chunks: chunk after chunk, every kv row
    once per chunk (opened and closed there, a placeholder in the chunk where no q block of
    it sees the row), q blocks inside their chunk, and together exactly the unchunked list's
    visible pairs."""
    nq, nk = -(-q_len // bq), -(-kv_len // bk)
    kw = dict(num_q_blocks=nq, num_kv_blocks=nk, q_len=q_len, kv_len=kv_len, block_q=bq,
              block_k=bk, is_causal=causal, window=window, transposed=True)
    whole = visit.visit_table(**kw)
    wj, wi, wf = visit.unpack(whole.astype(np.int64))
    pairs = {(a, b) for a, b, f in zip(wj.tolist(), wi.tolist(), wf) if not f & visit.EMPTY}
    for n in (c for c in (2, 3, 4) if nq % c == 0):
        j, i, flags = visit.unpack(visit.visit_table(**kw, q_chunks=n).astype(np.int64))
        chunk = i // (nq // n)
        assert np.all(np.diff(chunk) >= 0)
        for c in range(n):
            rows = j[chunk == c]
            assert sorted(set(rows.tolist())) == list(range(nk)) and np.all(np.diff(rows) >= 0)
            for r in range(nk):
                at = np.flatnonzero((chunk == c) & (j == r))
                assert (flags[at[0]] & visit.FIRST) and (flags[at[-1]] & visit.LAST)
        assert {(a, b) for a, b, f in zip(j.tolist(), i.tolist(), flags)
                if not f & visit.EMPTY} == pairs
    with pytest.raises(ValueError, match="q_chunks"):
        visit.visit_table(**dict(kw, transposed=False), q_chunks=2)


def _backward_on(q, k, v, a, dout, visit_grid, bq=128, bk=128):
    """(dq, dk, dv) of the backward kernels on the visit grid or the dense one."""
    q, k, v, spec = masks.validate(q, k, v, None, None, **a)
    cfg = backward_grid.make_backward_config(spec, block_q=bq, block_k=bk,
                                             visit_grid=visit_grid)
    gs = backward_grid.backward_grid_specs(cfg)
    assert (gs["dq"].visit_rows, gs["dkdv"].visit_rows) == (
        ("q", "kv") if visit_grid else (None, None))
    out, lse = fw.flash_attention_forward(q, k, v, spec, block_q=bq, block_k=bk,
                                          interpret=True)
    return bw._backward(q, k, v, spec, out, lse, jnp.asarray(dout), cfg=cfg,
                        interpret=True)[:3]


@pytest.mark.parametrize("q_len,kv_len,causal,window,lengths", [
    (250, 250, True, None, (200, 250)),
    (250, 250, False, (96, 0), None),
    (250, 250, True, (64, None), None),
    (120, 380, True, None, None)])      # kv blocks 1, 2 seen by no query: EMPTY dK/dV rows
def test_backward_visit_grid_matches_dense_grid_and_oracle(q_len, kv_len, causal, window,
                                                           lengths):
    """GQA (2 query heads per kv head), padding, run-time lengths, windows and kv blocks no
    query sees: the dQ and dK/dV kernels on their visit grids give the dense grids' gradients
    (f32, 1e-6 of the largest gradient: the same tiles in the same order) and the float64
    oracle's (1e-4)."""
    import jax
    q, k, v, a = _spec(q_len, kv_len, causal, window)
    if lengths is not None:
        a.update(query_seq_lengths=jnp.array([lengths[0]]),
                 key_value_seq_lengths=jnp.array([lengths[1]]))
    dout = np.random.default_rng(1).standard_normal(q.shape).astype(np.float32)
    if lengths is not None:
        dout[:, lengths[0]:] = 0.0                       # rows past q_len: no cotangent
    on_visits = _backward_on(q, k, v, a, dout, True)
    dense = _backward_on(q, k, v, a, dout, False)
    with jax.enable_x64(True):
        f64 = [jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v, dout)]
        ref = jax.grad(lambda q, k, v: jnp.sum(reference.naive_attention(q, k, v, **a) *
                                               f64[3]), argnums=(0, 1, 2))(*f64[:3])
    scale = max(float(np.abs(np.asarray(r)).max()) for r in ref)
    for name, got, want, r in zip("qkv", on_visits, dense, ref):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6 * scale,
                                   err_msg=f"d{name}: visit grid vs dense grid")
        np.testing.assert_allclose(np.asarray(got), np.asarray(r), atol=1e-4 * scale,
                                   err_msg=f"d{name}: visit grid vs float64 oracle")


@pytest.mark.parametrize("causal,window,visit_grid,fused", [
    (True, None, True, 0), (True, None, False, 0), (False, (96, 0), True, 2),
    (True, (64, None), False, 1)])
def test_every_index_map_stays_in_bounds_for_any_lengths(causal, window, visit_grid, fused):
    """The forward and backward kernels compile with Mosaic's DMA bounds checks off
    (``ForwardGridSpec.bounds_checks``): that is sound only if no index map can leave its
    array, whatever run-time lengths the caller passes (negative, zero, past the end, huge).
    Replay every BlockSpec of the forward, dQ and dK/dV grids (fused: whole dQ, or 2 query
    chunks) at every grid step against its operand's block count; the decode kernel keeps the
    checks (its page table is the caller's)."""
    import itertools
    from flashlab.kernels import decode_grid
    q, k, v, a = _spec(500, 700, causal, window)
    a.update(query_seq_lengths=jnp.array([1]), key_value_seq_lengths=jnp.array([1]))
    spec = masks.validate(q, k, v, None, None, **a)[3]
    cfg = forward_config.make_config(spec, block_q=128, block_k=128, visit_grid=visit_grid)
    bcfg = backward_grid.make_backward_config(spec, block_q=128, block_k=128,
                                              visit_grid=visit_grid)
    assert cfg.mask_q_len and cfg.mask_kv_len and cfg.visit_grid == visit_grid
    grids = [forward_grid.forward_grid_spec(cfg), backward_grid.dq_grid_spec(bcfg, False),
             backward_grid.dkdv_grid_spec(bcfg, fused=fused)]
    big = 2 ** 30
    lengths = [(-5, -5), (0, 0), (1, big), (big, 1), (499, 700), (big, big), (37, 0)]
    for gs in grids:
        assert not gs.bounds_checks and gs.compiler_params(False).disable_bounds_checks
        assert not gs.compiler_params(True).disable_bounds_checks     # interpret: no kwargs
        if isinstance(gs, backward_grid.BackwardGridSpec):   # the visit planes, if any
            pre = [np.asarray(x) for x in gs.visits()]
        else:
            pre = [visit.planes(cfg.visits())] if cfg.visit_grid else []
        for ql, kl in lengths:
            ql, kl = np.array([ql], np.int64), np.array([kl], np.int64)
            for step in itertools.product(*map(range, gs.grid)):
                for spec_, shape in zip(gs.in_specs + gs.out_specs,
                                        gs.in_shapes + gs.out_shapes):
                    idx = spec_.index_map(*step, ql, kl, *pre)
                    for x, n, blk_ in zip(idx, shape.shape, spec_.block_shape):
                        count = n if blk_ is None else n // blk_
                        assert 0 <= int(x) < count, (gs.grid, step, ql, kl, idx, shape)
    assert decode_grid.DecodeGridSpec.bounds_checks
    import unittest.mock
    with unittest.mock.patch.object(forward_grid, "BOUNDS_CHECKS", True):   # the env switch
        assert not grids[0].compiler_params(False).disable_bounds_checks
    assert grids[0].compiler_params(False).disable_bounds_checks


def test_bounds_checks_come_back_with_the_environment_switch():
    """``FLASHLAB_BOUNDS_CHECKS=1`` (read at import) turns Mosaic's DMA checks back on."""
    flag = ("flashlab.kernels.forward_grid", "BOUNDS_CHECKS")
    assert flag_at_import(*flag, FLASHLAB_BOUNDS_CHECKS="1")
    assert not flag_at_import(*flag, FLASHLAB_BOUNDS_CHECKS="")


@pytest.mark.parametrize("transposed", [False, True])
def test_planes_hold_the_packed_list(transposed):
    """The kernels' operand (rows | columns | flags) reads back every visit of the packed list."""
    kw = dict(num_q_blocks=4, num_kv_blocks=6, q_len=500, kv_len=700, block_q=128,
              block_k=128, is_causal=True, transposed=transposed)
    packed = visit.visit_table(**kw)
    p = visit.planes(packed)
    assert p.dtype == np.int32 and p.shape == (3 * len(packed),)
    for t, v in enumerate(packed.tolist()):
        r, c, f = visit.unpack(v)
        assert visit.at(p, t) == (r, c)
        assert visit.step_at(p, t) == (r, c, bool(f & visit.FIRST), bool(f & visit.LAST),
                                       not f & visit.EMPTY)


def test_grids_where_every_block_is_visible_fetch_their_own_blocks():
    """Non-causal, no window, no run-time lengths, kv padding or offsets
    (``blocks.every_block_visible``): every index map of the forward, dQ and dK/dV grids
    (fused whole, and in 3 query chunks) hands back the grid's own block: no clamp or range
    test in its jaxpr (GQA's ``h // G`` is the one division left). Any of the others keeps the
    clamp. (The kernels then test no range: one always-true compare keeps the tile a
    predicated region for the schedule reader.)"""
    import itertools
    import jax
    q, k, v, a = _spec(384, 384, False, None)
    spec = masks.validate(q, k, v, None, None, **a)[3]
    cfg = forward_config.make_config(spec, block_q=128, block_k=128)
    bcfg = backward_grid.make_backward_config(spec, block_q=128, block_k=128)
    assert blk.every_block_visible(cfg) and blk.every_block_visible(bcfg)
    grids = [forward_grid.forward_grid_spec(cfg), backward_grid.dq_grid_spec(bcfg, False),
             backward_grid.dkdv_grid_spec(bcfg), backward_grid.dkdv_grid_spec(bcfg, fused=1),
             backward_grid.dkdv_grid_spec(bcfg, fused=3)]
    ql = kl = np.array([384], np.int32)
    scalar_ops = {"min", "max", "select_n", "lt", "le", "gt", "ge", "clamp", "rem"}
    for gs in grids:
        assert len(gs.grid) in (4, 5, 6), gs.grid            # dense grids, no visit list
        for spec_ in gs.in_specs + gs.out_specs:
            ids = [jnp.int32(0)] * len(gs.grid)
            jaxpr = jax.make_jaxpr(lambda *i: spec_.index_map(*i, ql, kl))(*ids)
            used = {e.primitive.name for e in jaxpr.jaxpr.eqns} & scalar_ops
            assert not used, (gs.grid, spec_.block_shape, used)
        for step in itertools.product(*map(range, gs.grid)):
            for spec_ in gs.in_specs:                      # blocks of kv (j) and q (i) rows
                idx = spec_.index_map(*step, ql, kl)
                assert all(0 <= int(x) for x in idx)
    fwd_kv = grids[0].spec("k").index_map
    assert [int(fwd_kv(0, 1, 2, j, ql, kl)[2]) for j in range(3)] == [0, 1, 2]
    dkdv_q = grids[2].spec("q").index_map                    # (b, hk, j, g, i) -> i
    assert [int(dkdv_q(0, 0, 1, 1, i, ql, kl)[2]) for i in range(3)] == [0, 1, 2]
    for causal, window, kv_len, extra in [(True, None, 384, {}), (False, (64, 0), 384, {}),
                                          (False, None, 380, {}),
                                          (False, None, 384, {"q_offset": 0})]:
        q, k, v, a = _spec(384, kv_len, causal, window, **extra)
        spec = masks.validate(q, k, v, None, None, **a)[3]
        assert not blk.every_block_visible(
            forward_config.make_config(spec, block_q=128, block_k=128, visit_grid=False))
