"""Block sizes, the VMEM estimate, and block skipping replayed from the kernel's own index maps."""
import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from flashlab.contract import masks
from flashlab.kernels import blocks as blk
from flashlab.kernels import (choose_block_sizes, forward_grid_spec, make_config, vmem_bytes,
                              vmem_capacity_bytes)
from flashlab.compat import pallas as compat
from flashlab.contract.masks import validate


def test_vmem_table_matches_jax_tpu_info():
    for chip, nbytes in blk.VMEM_BYTES.items():
        assert vmem_capacity_bytes(chip) == nbytes
    if compat.get_tpu_info_for_chip is not None:
        info = compat.get_tpu_info_for_chip(compat.ChipVersion("v5e"), 1)
        assert info.vmem_capacity_bytes == 128 << 20
    with pytest.raises(ValueError, match="chip: expected one of"):
        vmem_capacity_bytes("v9z")


def test_vmem_bytes_counts_double_buffering():
    one = vmem_bytes(128, 128, 128, jnp.float32, buffers=1)
    two = vmem_bytes(128, 128, 128, jnp.float32, buffers=2)
    blocks = 4 * 128 * 128 * 4                           # Q, K, V, O blocks
    assert two - one == blocks
    assert vmem_bytes(128, 128, 64, jnp.float32) == two   # head_dim 64 is lane-padded to 128
    assert vmem_bytes(128, 128, 128, jnp.float32, bias_dtype=jnp.float32) > two
    # A mask and a bias add Mosaic spill slots as well as their blocks (measured on v4).
    tile = 128 * 128 * 4
    masked = vmem_bytes(128, 128, 128, jnp.float32, has_mask=True, buffers=1)
    assert masked - one == 128 * 128 + int(blk.FORWARD_SPILL_TILES["mask"] * tile)


def test_v4_takes_the_forward_at_1024_squared():
    # Mosaic needs 8.35 MiB for it (9.35 with lse) under v4's 16 MiB limit: the estimate
    # (an upper bound of that) admits it, as it admits splash's 1024x1024 there.
    blk.check_block_sizes(1024, 1024, head_dim=128, dtype=jnp.bfloat16, chip="v4",
                          return_lse=True)
    with pytest.raises(ValueError, match=r"over the 16 MiB limit of v4"):
        blk.check_block_sizes(2048, 1024, head_dim=128, dtype=jnp.bfloat16, chip="v4")


@pytest.mark.parametrize("chip", ["v4", "v5e", "v5p", "v6e", "7x"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("q_len, kv_len, d", [(1, 1, 64), (100, 3000, 80), (8192, 8192, 128),
                                              (32768, 32768, 256)])
def test_choose_block_sizes_obeys_tiling_and_budget(chip, dtype, q_len, kv_len, d):
    bq, bk = choose_block_sizes(q_len, kv_len, d, dtype, chip)
    assert bq % blk.sublane_tile(dtype) == 0 and bk % 128 == 0
    assert bq <= blk.round_up(q_len, blk.sublane_tile(dtype)) and bk <= blk.round_up(kv_len, 128)
    assert vmem_bytes(bq, bk, d, dtype) <= blk.vmem_limit_bytes(chip)
    blk.check_block_sizes(bq, bk, head_dim=d, dtype=dtype, chip=chip)   # does not raise


@pytest.mark.parametrize("chip", ["v4", "v5e", "v5p", "v6e", "7x"])
def test_the_forward_asks_for_its_need_between_the_default_and_the_ceiling(chip):
    """forward_grid.scoped_vmem_bytes: need + 1/4 in whole MiB, at least Mosaic's 16 MiB default
    (or the whole VMEM of a smaller chip), at most the chip's ceiling; None: the ceiling."""
    from flashlab.kernels.forward_grid import scoped_vmem_bytes
    ceiling, default = blk.vmem_limit_bytes(chip), 16 << 20
    assert scoped_vmem_bytes(None, chip) == ceiling
    assert scoped_vmem_bytes(1, chip) == min(default, ceiling)
    assert scoped_vmem_bytes(20 << 20, chip) == min(ceiling, 25 << 20)
    assert scoped_vmem_bytes((20 << 20) + 1, chip) == min(ceiling, 26 << 20)
    assert scoped_vmem_bytes(1 << 40, chip) == ceiling
    need = vmem_bytes(512, 512, 128, jnp.bfloat16)       # v5e's 512² forward: 16 of its 96 MiB
    assert need < 8 << 20 and scoped_vmem_bytes(need, "v5e") == default


def test_long_sequences_get_blocks_larger_than_128():
    bq, bk = choose_block_sizes(8192, 8192, 128, jnp.bfloat16, "v5e")
    assert bq >= 256 and bk >= 512
    # v4 has 16 MiB of VMEM: the same problem gets no larger blocks there.
    bq4, bk4 = choose_block_sizes(8192, 8192, 256, jnp.float32, "v4")
    assert bq4 * bk4 <= bq * bk


def test_a_mask_needs_int8_tiles():
    bq, _ = choose_block_sizes(50, 50, 64, jnp.float32, has_mask=True)
    assert bq % 32 == 0


@pytest.mark.parametrize("is_causal, window", [(False, None), (True, None), (False, (5, 2)),
                                               (True, (9, 0)), (False, (None, 0)), (False, (0, None)),
                                               (False, (300, 300))])
def test_kv_block_range_is_block_maybe_visible(is_causal, window):
    """The index maps' range equals the kernel's pl.when predicate at every (i, j)."""
    for bq, bk, q_len, kv_len in itertools.product([8, 32], [128, 256], [1, 40, 300], [0, 1, 200, 700]):
        nq, nk = blk.round_up(q_len, bq) // bq, max(1, blk.round_up(kv_len, bk) // bk)
        for i, j in itertools.product(range(nq), range(nk)):
            lo, hi = blk.kv_block_range(i, q_len, kv_len, block_q=bq, block_k=bk,
                                        is_causal=is_causal, window=window)
            q0, k0 = i * bq, j * bk
            run = bool(masks.block_maybe_visible(q0, q0 + bq, k0, k0 + bk, is_causal=is_causal,
                                                 window=window)) and k0 < kv_len and q0 < q_len
            assert (lo <= j <= hi) == run, (bq, bk, q_len, kv_len, i, j, lo, hi)
            assert 0 <= blk.clamp_block(j, lo, hi, nk) < nk


def _replay(gs, name, q_lengths, kv_lengths):
    """Block index of operand ``name`` at every grid step, from the kernel's own index map."""
    spec = gs.spec(name)
    return {idx: spec.index_map(*idx, q_lengths, kv_lengths)
            for idx in itertools.product(*(range(g) for g in gs.grid))}


@pytest.mark.parametrize("kw", [{"is_causal": True}, {"local_window_size": (40, 0)},
                                {"key_value_seq_lengths": np.array([100, 700], np.int32)}])
def test_skipped_steps_fetch_nothing(kw):
    B, T, S, N = 2, 512, 768, 2
    q = np.zeros((B, T, N, 64), np.float32)
    k = np.zeros((B, S, N, 64), np.float32)
    *_, spec = validate(q, k, k, **kw)
    # the dense grid (kept with offsets); the visit grid's blocks: tests/test_kernel_visit.py
    cfg = make_config(spec, block_q=128, block_k=128, visit_grid=False)
    gs = forward_grid_spec(cfg)
    ql = np.full(B, T, np.int32)
    kl = np.asarray(spec.kv_lengths) if spec.kv_lengths is not None else np.full(B, S, np.int32)
    idx = _replay(gs, "k", ql, kl)
    steps = sorted(idx)
    fetches = computed = 0
    for n, step in enumerate(steps):
        b, h, i, j = step
        lo, hi = blk.kv_block_range(i, ql[b], kl[b], block_q=128, block_k=128,
                                    is_causal=cfg.is_causal,
                                    window=cfg.window)
        if lo <= j <= hi:
            computed += 1
            assert idx[step] == (b, h, j, 0)               # a computed step sees its own block
        if n == 0 or idx[step] != idx[steps[n - 1]]:
            fetches += 1                                   # the pipeline copies only on change
    assert fetches <= computed + B * N * cfg.num_q_blocks   # <= one extra per q block
    assert computed < B * N * cfg.num_q_blocks * cfg.num_kv_blocks


def test_grid_spec_is_what_pallas_call_gets():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 50, 4, 64)).astype(np.float32)
    k = rng.standard_normal((2, 70, 2, 64)).astype(np.float32)
    *_, spec = validate(q, k, k, bias=np.zeros((1, 4, 50, 70), np.float32), is_causal=True,
                        segment_ids=(np.zeros((2, 50), np.int32), np.zeros((2, 70), np.int32)))
    cfg = make_config(spec, block_q=16, block_k=128)
    gs = forward_grid_spec(cfg)
    assert gs.grid == (2, 4, 4, 1)
    assert gs.in_names == ("q", "k", "v", "bias", "q_segment_ids", "kv_segment_ids")
    assert gs.spec("k").index_map(1, 3, 0, 0, np.array([50, 50]), np.array([70, 70])) == (1, 1, 0, 0)
    assert gs.spec("bias").index_map(1, 3, 2, 0, np.array([50, 50]), np.array([70, 70])) == (0, 3, 2, 0)
    assert gs.dimension_semantics == ("parallel", "parallel", "parallel", "arbitrary")
    pgs = gs.pallas_grid_spec()
    assert pgs.num_scalar_prefetch == 2


@pytest.mark.parametrize("d, dv, carried", [(64, 64, (64, 64)), (32, 96, (32, 96)),
                                            (128, 128, (128, 128)), (192, 64, (256, 64))])
def test_head_dim_below_128_is_not_padded(d, dv, carried):
    """Below 128 lanes q, k, v, O and dQ, dK, dV are blocked at their own head_dim (a block dim
    equal to the array dim obeys the (8, 128) rule): at d = 64 they move half the bytes of a
    128-padded layout. Above 128 the head_dim is rounded up to a multiple of 128. Read from
    the blocks every ``pallas_call`` of the forward and of the gradient gets."""
    import jax
    from flashlab.instruments import tpu_compile
    from flashlab.kernels import flash
    assert (blk.kernel_head_dim(d), blk.kernel_head_dim(dv)) == carried
    B, T, N = 1, 256, 2
    q = jax.ShapeDtypeStruct((B, T, N, d), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((B, T, N, dv), jnp.bfloat16)
    for backward, names in (("split", ["flashlab_flash_backward_dkdv",
                                       "flashlab_flash_backward_dq"]),
                            ("auto", ["flashlab_flash_backward_dkdv_fused"])):   # fits: fused
        f = lambda q, k, v: flash.flash_attention(q, k, v, is_causal=True,  # noqa: E731
                                                  interpret=False, backward=backward)
        g = jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), argnums=(0, 1, 2))
        calls = tpu_compile.pallas_calls(g, q, q, v, chip="v5e")
        assert [c["name"] for c in calls] == ["flashlab_flash_forward"] + names, calls
        minor = {b[-1] for c in calls for b in c["blocks"]
                 if len(b) == 4 and b[0] is None and b[1] in (None, 1)}
        assert minor & {carried[0], carried[1]} and minor <= {*carried, 128, 256}, calls
    fwd = calls[0]["blocks"]
    assert fwd[0][-1] == carried[0] and fwd[2][-1] == carried[1], fwd   # q, v blocks


def test_grad_refuses_blocks_that_fit_the_forward_alone():
    """v4, d=256, 2048 x 512: the forward alone fits (16.0 MiB estimated, 16 MiB limit), the
    forward that jax.grad runs writes lse too (18.0 MiB; Mosaic ran out at 16.68 of 16): a
    ValueError naming the blocks and the lse when grad traces, not RESOURCE_EXHAUSTED from the
    compiler. The default blocks fit it."""
    import jax
    from flashlab.kernels import flash
    x = jax.ShapeDtypeStruct((1, 8192, 2, 256), jnp.bfloat16)

    def loss(q, k, v, **kw):
        return flash.flash_attention(q, k, v, is_causal=True, chip="v4", interpret=True,
                                     **kw).astype(jnp.float32).sum()
    blocks = dict(block_q=2048, block_k=512)
    jax.eval_shape(lambda q, k, v: loss(q, k, v, **blocks), x, x, x)       # forward: fits
    with pytest.raises(ValueError, match=r"block_q, block_k: \(2048, 512\).*writes lse"):
        jax.eval_shape(jax.grad(lambda q, k, v: loss(q, k, v, **blocks)), x, x, x)
    jax.eval_shape(jax.grad(loss), x, x, x)                                   # defaults: fit


@pytest.mark.parametrize("chip", ["v4", "v5e", "v5p", "v6e", "7x"])
def test_default_blocks_fit_the_differentiated_forward(chip):
    """Every default forward pair (the measured tables and the heuristic) fits the VMEM
    estimate with the lse block the differentiated forward writes."""
    import dataclasses
    from flashlab.kernels import flash
    for d, T, causal in itertools.product((64, 128, 256), (2048, 8192, 32768), (True, False)):
        x = jnp.zeros((1, 1, 1, d), jnp.bfloat16)
        spec = validate(x, x, x, None, None, is_causal=causal)[3]
        spec = dataclasses.replace(spec, q_len=T, kv_len=T)
        cfg = make_config(spec, chip=chip)
        flash._check_lse_fits(spec, cfg)
