"""A window's tiles wholly inside its band build no mask (kernels/band.py, chapters 05 and
07): the inside test against the mask itself, the edge count the static bench prices, where
it applies, and the forward and fused backward against the float64 oracle in both interpret
modes (tolerances as in test_kernel_forward / test_kernel_backward: float32 2e-5 absolute on
the output, 1e-4 relative on the gradients)."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import kernel_eqns, random_qkv
from flashlab.compat import pallas as compat
from flashlab.contract import device
from flashlab.contract.masks import block_fully_visible, structural_visible, validate
from flashlab.kernels import band, flash_attention
from flashlab.kernels.backward_grid import make_backward_config
from flashlab.kernels.block_ranges import q_block_range
from flashlab.kernels.forward_config import make_config
from flashlab.ladder.reference import oracle_attention
from test_kernel_backward import F32_RTOL, oracle_grads

F32_TOL = 2e-5


def _spec(T=1024, **kw):
    x = jax.ShapeDtypeStruct((1, T, 2, 64), jnp.float32)
    return jax.eval_shape(lambda q: validate(q, q, q, **kw)[-1], x)


@pytest.mark.parametrize("causal, window", [(True, (40, 0)), (False, (40, 24)),
                                            (False, (None, 30)), (True, (None, None))])
def test_fully_visible_is_the_mask_at_every_score(causal, window):
    """``block_fully_visible`` is true exactly where every score of the block passes
    ``structural_visible``, over every block of 16 x 8 positions of a 96 x 96 grid."""
    pos = np.arange(96)
    vis = np.asarray(structural_visible(pos[:, None], pos[None, :], is_causal=causal,
                                        window=window))
    for q0, k0 in itertools.product(range(0, 96, 4), range(0, 96, 4)):
        whole = bool(vis[q0:q0 + 16, k0:k0 + 8].all()) and q0 + 16 <= 96 and k0 + 8 <= 96
        if q0 + 16 <= 96 and k0 + 8 <= 96:
            assert block_fully_visible(q0, q0 + 16, k0, k0 + 8, is_causal=causal,
                                       window=window) == whole, (q0, k0)


def test_edge_tiles_are_counted_from_positions():
    """At T = 32768 with a 4096 window and 512² blocks a q block sees 9 tiles, 7 of them
    inside the band (the first eight q blocks see fewer, and only the diagonal's tile is
    crossed): the edge count is the visible tiles that are not inside, tile by tile."""
    cfg = make_config(_spec(32768, is_causal=True, local_window_size=(4096, 0)),
                      block_q=512, block_k=512, chip="v6e")
    assert band.applies(cfg) and band.forward_applies(cfg)
    edge = 0
    for i, j in itertools.product(range(64), range(64)):
        q0, k0 = 512 * i, 512 * j
        seen = max(k0, q0 - 4096) <= min(k0 + 511, q0 + 511)          # some score visible
        edge += seen and not (k0 + 511 <= q0 and k0 >= q0 + 511 - 4096)
    assert band.visits(cfg) == (edge,) and edge == 8 + 2 * 56


@pytest.mark.parametrize("kw, applies", [
    ({"is_causal": True}, False),                                  # no window: the strips' job
    ({"local_window_size": (100, 0), "is_causal": True}, True),
    ({"local_window_size": (100, 50)}, True),
    ({"local_window_size": (100, 0), "key_value_seq_lengths": np.array([900])}, False),
    ({"local_window_size": (100, 0), "q_offset": 3}, False),
    ({"local_window_size": (100, 0), "bias": np.zeros((1, 1, 1024, 1024), np.float32)}, False),
])
def test_band_applies_only_to_positions_alone(kw, applies):
    """A length, an offset, a bias (or a mask, or segment ids) would still hide or change
    scores of an inside tile, so the split needs the window alone; kv padding is a length."""
    q = jnp.zeros((1, 1024, 2, 64), jnp.float32)
    spec = validate(q, q, q, **kw)[-1]
    assert band.applies(make_config(spec, block_q=256, block_k=256, chip="v6e")) == applies
    assert not band.applies(make_config(validate(q[:, :1000], q[:, :1000], q[:, :1000],
                                                 local_window_size=(100, 0))[-1],
                                        block_q=256, block_k=256, chip="v6e"))


def test_forward_keeps_whole_paths_beside_the_partial_one():
    """Where a tile's row chunks may run one by one (a left side that is no multiple of B_c)
    the forward keeps that path and builds no band split; the fused backward has none."""
    cfg = make_config(_spec(32768, is_causal=True, local_window_size=(4300, 0)),
                      block_q=512, block_k=512, chip="v5e")
    assert cfg.partial_tiles and band.applies(cfg) and not band.forward_applies(cfg)
    assert band.forward_visits(cfg) == ()


CASES = [  # (T, blocks, kw, chip): square, B_r > B_c, B_r < B_c, non-causal, v5e row chunks
    (1024, (128, 128), {"is_causal": True, "local_window_size": (256, 0)}, "v6e"),
    (1024, (256, 128), {"is_causal": True, "local_window_size": (384, 0)}, "v6e"),
    (1024, (128, 256), {"is_causal": True, "local_window_size": (512, 0)}, "v6e"),
    (1024, (128, 128), {"local_window_size": (256, 128)}, "v6e"),
    (2048, (512, 512), {"is_causal": True, "local_window_size": (1024, 0)}, "v5e"),
]


@pytest.mark.parametrize("T, blocks, kw, chip", CASES)
def test_forward_matches_the_oracle(T, blocks, kw, chip):
    rng = np.random.default_rng(41)
    q, k, v = random_qkv(rng, 2, T, T, 4, 2, 64)
    cfg = make_config(validate(*(jnp.asarray(x) for x in (q, k, v)), **kw)[-1],
                      block_q=blocks[0], block_k=blocks[1], chip=chip)
    assert band.forward_applies(cfg) and band.visits(cfg)[0] < cfg.computed_pairs()
    out = flash_attention(q, k, v, **kw, block_q=blocks[0], block_k=blocks[1], chip=chip,
                          interpret=True)
    assert np.abs(np.asarray(out) - oracle_attention(q, k, v, **kw)).max() <= F32_TOL


@pytest.mark.parametrize("T, blocks, kw, chip", CASES[:4])
def test_fused_backward_matches_the_oracle(T, blocks, kw, chip):
    rng = np.random.default_rng(42)
    q, k, v = random_qkv(rng, 1, T, T, 4, 2, 64)
    dout = rng.standard_normal(q.shape).astype(np.float32)
    spec = validate(*(jnp.asarray(x) for x in (q, k, v)), **kw)[-1]
    assert band.applies(make_backward_config(spec, block_q=blocks[0], block_k=blocks[1],
                                             chip=chip, fused=True))

    def loss(q, k, v):
        out = flash_attention(q, k, v, **kw, block_q=blocks[0], block_k=blocks[1], chip=chip,
                              interpret=True, backward="fused")
        return jnp.sum(out * dout)
    got = jax.grad(loss, argnums=(0, 1, 2))(*(jnp.asarray(x) for x in (q, k, v)))
    ref = oracle_grads(q, k, v, dout, kw)
    scale = max(np.abs(r).max() for r in ref)
    for label, g, r in zip(("dq", "dk", "dv"), got, ref):
        assert np.abs(np.asarray(g) - r).max() / scale <= F32_RTOL, label


def test_no_races_in_tpu_interpret_mode():
    """Forward and fused backward in TPU interpret mode, race detector on."""
    rng = np.random.default_rng(43)
    q, k, v = random_qkv(rng, 1, 512, 512, 2, 1, 64)
    kw = {"is_causal": True, "local_window_size": (128, 0)}
    mode = device.tpu_interpret_params()

    def loss(q, k, v):
        out = flash_attention(q, k, v, **kw, block_q=128, block_k=128, chip="v6e",
                              interpret=mode, backward="fused")
        return jnp.sum(out)
    out = flash_attention(q, k, v, **kw, block_q=128, block_k=128, chip="v6e", interpret=mode)
    assert np.abs(np.asarray(out) - oracle_attention(q, k, v, **kw)).max() <= F32_TOL
    jax.block_until_ready(jax.grad(loss, argnums=(0, 1, 2))(q, k, v))
    assert compat.races_found() is False


def test_only_the_edge_path_builds_a_mask():
    """The forward's inside path has no iota; its edge path builds the mask once per row
    chunk (two iotas: query and key positions). The fused backward: two in all."""
    q = jnp.zeros((1, 1024, 2, 64), jnp.float32)
    kw = dict(is_causal=True, local_window_size=(256, 0), block_q=128, block_k=128, chip="v6e")
    [fwd] = kernel_eqns(lambda q: flash_attention(q, q, q, **kw), q)
    assert sum(e.primitive.name == "iota" for e in fwd) == 2

    def loss(q):
        return jnp.sum(flash_attention(q, q, q, **kw, backward="fused"))
    kernels = kernel_eqns(jax.grad(loss), q)
    assert [sum(e.primitive.name == "iota" for e in k) for k in kernels][-1] == 2


BAND_GRIDS = [  # (q_len, kv_len, blocks, kw): the dK/dV kernel's band grid
    (1024, 1024, (128, 128), {"is_causal": True, "local_window_size": (256, 0)}),
    (1000, 1000, (128, 256), {"is_causal": True, "local_window_size": (300, 0)}),   # padding
    (1024, 1024, (128, 128), {"local_window_size": (256, 128)}),
    (1024, 1024, (128, 256), {"local_window_size": (256, 256)}),
]


@pytest.mark.parametrize("q_len, kv_len, blocks, kw", BAND_GRIDS)
def test_band_grid_covers_each_kv_rows_visible_q_blocks(q_len, kv_len, blocks, kw):
    """Every q block that sees some key of kv block ``j`` (score by score, from the mask
    itself) lies in ``[lo, lo + q_steps)``, ``lo`` the first of ``q_block_range(j)``; and the
    band grid's q index map, replayed over its steps, fetches each
    row's visible q blocks in order (repeats only where a step is past the row's last)."""
    bq, bk = blocks
    x = jax.ShapeDtypeStruct((1, q_len, 2, 64), jnp.float32)
    kx = jax.ShapeDtypeStruct((1, kv_len, 1, 64), jnp.float32)
    spec = jax.eval_shape(lambda q, k: validate(q, k, k, **kw)[-1], x, kx)
    cfg = make_backward_config(spec, block_q=bq, block_k=bk, chip="v6e")
    assert band.grid_applies(cfg)
    from flashlab.kernels.backward_grid import dkdv_grid_spec
    gs = dkdv_grid_spec(cfg, fused=1)
    n = band.q_steps(cfg)
    assert gs.grid == (1, 1, cfg.num_kv_blocks, 2, n) and gs.visit_rows is None
    qp, kp = np.arange(q_len), np.arange(kv_len)
    vis = np.asarray(structural_visible(qp[:, None], kp[None, :],
                                        is_causal=kw.get("is_causal", False),
                                        window=kw["local_window_size"]))
    ql = kl = None
    for j in range(cfg.num_kv_blocks):
        seen = [i for i in range(cfg.num_q_blocks)
                if vis[i * bq:(i + 1) * bq, j * bk:(j + 1) * bk].any()]
        first = q_block_range(j, q_len, kv_len, block_q=bq, block_k=bk,
                              is_causal=kw.get("is_causal", False),
                              window=kw["local_window_size"])[0]
        assert all(first <= i < first + n for i in seen), (j, first, n, seen)
        ql, kl = np.array([q_len]), np.array([kv_len])
        fetched = [int(gs.spec("q").index_map(0, 0, j, 1, t, ql, kl)[2]) for t in range(n)]
        assert [i for t, i in enumerate(fetched) if t == 0 or i != fetched[t - 1]] == (
            seen or fetched[:1]), (j, fetched, seen)
    # bounds checks are off (ForwardGridSpec.bounds_checks): no step may leave an array,
    # whatever run-time lengths are passed (test_kernel_visit replays the other grids)
    big = 2 ** 30
    for ql, kl in [(-5, -5), (0, 0), (1, big), (big, 1), (big, big)]:
        ql, kl = np.array([ql], np.int64), np.array([kl], np.int64)
        for step in itertools.product(*map(range, gs.grid)):
            for spec_, shape in zip(gs.in_specs + gs.out_specs, gs.in_shapes + gs.out_shapes):
                idx = spec_.index_map(*step, ql, kl)
                for x, m, b in zip(idx, shape.shape, spec_.block_shape):
                    assert 0 <= int(x) < (m if b is None else m // b), (step, idx, shape)


def test_band_grid_only_where_it_pays():
    """The band grid replaces the transposed visit list under a window where the kernels skip
    steps (``visit_grid``), with the whole dQ resident, and at most GRID_MAX_SHARE times the
    list's steps; never without a window, on the dense grid, or in query chunks."""
    def cfg(T=1024, visit_grid=None, block_q=128, **kw):
        return make_backward_config(_spec(T, **kw), block_q=block_q, block_k=128, chip="v6e",
                                    visit_grid=visit_grid)
    win = dict(is_causal=True, local_window_size=(256, 0))
    assert band.grid_applies(cfg(**win)) and not band.grid_applies(cfg(**win), q_chunks=2)
    assert not band.grid_applies(cfg(visit_grid=False, **win))
    assert not band.grid_applies(cfg(is_causal=True))
    wide = cfg(T=1024, local_window_size=(640, 640))      # wider than most rows: no visits
    assert not wide.visit_grid and not band.grid_applies(wide)
    c = cfg(**win)
    assert band.q_steps(c) * c.num_kv_blocks <= band.GRID_MAX_SHARE * len(
        c.visits(transposed=True))
    # 256-row q blocks over 128-key kv blocks: kv rows alternate 3 and 2 q blocks seen
    ragged = cfg(block_q=256, is_causal=True, local_window_size=(512, 0))
    assert band.q_steps(ragged) * ragged.num_kv_blocks > band.GRID_MAX_SHARE * len(
        ragged.visits(transposed=True)) and not band.grid_applies(ragged)


@pytest.mark.parametrize("backward", ["fused", "split"])
def test_band_grid_backward_with_lengths_and_gqa(backward):
    """The dK/dV kernel on the band grid, split and fused, with run-time q and kv lengths
    (whose steps past a row's last visible block compute nothing) and GQA: the float64
    oracle's gradients."""
    rng = np.random.default_rng(44)
    B, T = 2, 1024
    q, k, v = random_qkv(rng, B, T, T, 4, 2, 64)
    kw = {"is_causal": True, "local_window_size": (256, 0),
          "query_seq_lengths": np.array([1024, 700], np.int32),
          "key_value_seq_lengths": np.array([900, 1024], np.int32)}
    dout = rng.standard_normal(q.shape).astype(np.float32)
    dout[1, 700:] = 0.0                                   # rows past q_len: no cotangent
    args = [jnp.asarray(x) for x in (q, k, v)]
    jkw = {n: (jnp.asarray(x) if isinstance(x, np.ndarray) else x) for n, x in kw.items()}
    spec = validate(*args, **jkw)[-1]
    assert band.grid_applies(make_backward_config(spec, block_q=128, block_k=128, chip="v6e"))

    def loss(q, k, v):
        out = flash_attention(q, k, v, **jkw, block_q=128, block_k=128, chip="v6e",
                              interpret=True, backward=backward)
        return jnp.sum(out * dout)
    got = jax.grad(loss, argnums=(0, 1, 2))(*args)
    ref = oracle_grads(q, k, v, dout, kw)
    scale = max(np.abs(r).max() for r in ref)
    for label, g, r in zip(("dq", "dk", "dv"), got, ref):
        assert np.abs(np.asarray(g) - r).max() / scale <= F32_RTOL, label
