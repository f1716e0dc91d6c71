"""The compile matrix: every kernel compiled by the real TPU compiler for v4, v5e, v5p, v6e, 7x.

Nothing runs: each case is ``jax.jit(...).lower(...).compile()`` by libtpu (XLA TPU + Mosaic)
for compile-only devices of the chip (:mod:`flashlab.instruments.tpu_compile`), and must compile
with no error. Each flashlab case is ONE program holding the forward kernel (inference: no lse) and
``jax.grad`` through it (the forward with lse, then the backward), so one compile covers the
forward and a backward. Which backward: at the default blocks ``backward="auto"`` (the default,
the fused kernel wherever its resident dQ fits, which at these lengths is everywhere), at the
largest blocks ``backward="split"`` (the dK/dV kernel and the dQ kernel): each option and
each chip compiles both backwards, over the cases, at no extra compile.

Which combination runs where, and why (each program costs ~7 s of CPU to compile: a full cross
product, 5 chips x 26 options x 2 block choices, would take ~15 min on 2 cores; these 50
programs took 354 s of CPU, ~3 min on 2 cores):

* ``BASE`` on every chip, at the default blocks and at the largest blocks flashlab's VMEM
  check accepts (:func:`largest_blocks`): causal bf16, d = 128, T = S = 2048. This is the
  representative set per chip: the chips differ in VMEM (16 MiB v4, 64 MiB v5p/7x, 128 MiB
  v5e/v6e), so the largest blocks differ per chip and probe each chip's limit.
* ``OPTIONS``: each option of the issue's list once, on the chip given in the table (round
  robin, so every chip sees ~6 options), alternating default and largest blocks. The tightest
  cases (fp32 and head_dim 256 at the largest blocks) sit on v4, the chip with least VMEM.
* ``ADAPTERS``: the official ``splash`` and ``jax_pallas_flash`` kernels through flashlab's
  adapters (forward + grad) on the features they declare in the registry, spread over chips.
* a padding mask ``[B, 1, 1, S]`` with a per-row bias ``[B, 1, T, 1]`` (blocks of 1 on the
  broadcast dim) on v5e and v4, ~10 s each.
* ``DISTRIBUTED``: ``ring_attention`` (ppermute ring) and ``sharded_attention`` (shard_map
  around the Pallas kernel) on a 4-chip v5e slice and on a v5p 2x2x1 slice, forward + grad,
  so the collectives go through the real compiler too.

Needs libtpu (``pip install "jax[tpu]"``, in requirements.txt). Without it these tests skip
with that reason, except where ``FLASHLAB_REQUIRE_LIBTPU=1`` (``.ci/dev.py test`` sets it):
there a missing libtpu fails them.
"""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashlab
from flashlab.instruments import tpu_compile
from flashlab.dispatch.conformance import mask_kwargs
from flashlab.kernels import blocks as blk

if not tpu_compile.available():
    if os.environ.get("FLASHLAB_REQUIRE_LIBTPU") == "1":
        raise RuntimeError("FLASHLAB_REQUIRE_LIBTPU=1 but libtpu is missing: "
                           f"{tpu_compile.INSTALL}")
    pytest.skip(f"libtpu (the TPU compiler) is not installed: {tpu_compile.INSTALL}",
                allow_module_level=True)

pytestmark = pytest.mark.tpu_compile
BF16, F32 = jnp.bfloat16, jnp.float32


def largest_blocks(T, S, d, dtype, chip, dv=None, **kw) -> tuple[int, int]:
    """The largest ``(block_q, block_k)`` (by area, then block_q) that flashlab's VMEM check
    accepts for ``chip``, among powers of two (x the tiling rule) up to the padded sequence."""
    rule = blk._sublane_rule(dtype, kw.get("bias_dtype"), kw.get("has_mask", False))
    best = None
    for bk in (128, 256, 512, 1024, 2048, 4096):
        if bk > blk.round_up(S, 128):
            break
        for bq in (rule * 2 ** i for i in range(12)):
            if bq > blk.round_up(T, rule):
                break
            try:
                blk.check_block_sizes(bq, bk, head_dim=d, dtype=dtype, head_dim_v=dv, chip=chip,
                                      **kw)
            except ValueError:
                continue
            if best is None or (bq * bk, bq) > (best[0] * best[1], best[0]):
                best = (bq, bk)
    return best


#        id             chip   B  T     S     N  K  d    dv   dtype option         blocks
BASE = [(f"base-{c}-{b}", c, 2, 2048, 2048, 4, 4, 128, None, BF16, "causal", b)
        for c in tpu_compile.CHIPS for b in ("default", "max")]
OPTIONS = [
    ("window", "v4", 2, 1024, 1024, 4, 4, 128, None, BF16, "window_pair", "default"),
    ("causal-window", "v5e", 2, 1024, 1024, 4, 4, 128, None, BF16, "causal_window", "max"),
    ("segments", "v5p", 2, 1024, 1024, 4, 4, 128, None, BF16, "segments", "default"),
    ("q-kv-lengths", "v6e", 2, 1024, 1024, 4, 4, 128, None, BF16, "seq_lengths", "max"),
    ("kv-length-zero", "7x", 2, 1024, 1024, 4, 4, 128, None, BF16, "kv_lengths_zero", "default"),
    ("dense-mask", "v4", 2, 1024, 1024, 4, 4, 128, None, BF16, "dense_mask", "max"),
    ("dense-mask-per-head", "v5e", 2, 1024, 1024, 4, 4, 128, None, BF16, "dense_mask_per_head",
     "default"),
    ("bias-grad", "v5p", 2, 1024, 1024, 4, 4, 128, None, BF16, "bias", "max"),
    ("bias-no-grad", "v6e", 2, 1024, 1024, 4, 4, 128, None, BF16, "bias-const", "default"),
    ("bias-broadcast", "7x", 2, 1024, 1024, 4, 4, 128, None, BF16, "bias_broadcast", "max"),
    ("soft-cap", "v4", 2, 1024, 1024, 4, 4, 128, None, BF16, "soft_cap", "default"),
    ("gqa", "v5e", 2, 1024, 1024, 8, 2, 128, None, BF16, "causal", "max"),
    ("mqa", "v5p", 2, 1024, 1024, 8, 1, 128, None, BF16, "causal", "default"),
    ("cross-ragged", "v6e", 2, 999, 1501, 4, 2, 128, None, BF16, "seq_lengths", "max"),
    ("cross-ragged-causal", "7x", 2, 1001, 777, 4, 4, 128, None, BF16, "causal", "default"),
    ("fp32", "v4", 2, 1024, 1024, 4, 4, 128, None, F32, "causal", "max"),
    ("fp32-everything", "v5e", 2, 1000, 1000, 4, 2, 128, None, F32, "everything", "default"),
    ("everything", "7x", 2, 1000, 1000, 4, 2, 128, None, BF16, "everything", "max"),
    ("d64", "v5p", 2, 1024, 1024, 4, 4, 64, None, BF16, "causal", "max"),
    ("d80", "v6e", 2, 1024, 1024, 4, 4, 80, None, BF16, "causal", "default"),
    ("d96", "7x", 2, 1024, 1024, 4, 4, 96, None, BF16, "causal", "max"),
    ("d192", "v5e", 2, 1024, 1024, 4, 4, 192, None, BF16, "causal", "default"),
    ("d256", "v4", 2, 1024, 1024, 4, 4, 256, None, BF16, "causal", "max"),
    ("d256-fp32", "v4", 2, 1024, 1024, 4, 4, 256, None, F32, "none", "max"),
    # d = 256's measured defaults (tpu_static_d256.json): v4 forward 1024², backward 512², its
    # tightest VMEM; v5e 2048² both, the forward with its lse block under jax.grad
    ("d256-defaults", "v4", 1, 8192, 8192, 2, 2, 256, None, BF16, "causal", "default"),
    ("d256-defaults-2048", "v5e", 1, 8192, 8192, 2, 2, 256, None, BF16, "causal", "default"),
    ("dv-ne-d", "v5p", 2, 1024, 1024, 4, 4, 128, 64, BF16, "causal", "default"),
    ("dv-ne-d-wide", "v6e", 2, 1024, 1024, 4, 4, 64, 256, BF16, "none", "max"),
]


def _inputs(B, T, S, N, K, d, dv, dtype, option):
    """ShapeDtypeStructs of q, k, v and the option's arrays; the option's static kwargs."""
    grad_bias = option.startswith("bias") and option != "bias-const"
    opt = "bias" if option == "bias-const" else option
    kw = mask_kwargs(opt, np.random.default_rng(0), B, T, S, N) if opt != "none" else {}
    arrays = {k: v for k, v in kw.items() if not isinstance(v, (bool, int, float, tuple))
              or (isinstance(v, tuple) and isinstance(v[0], np.ndarray))}
    static = {k: v for k, v in kw.items() if k not in arrays}
    sds = lambda *s: jax.ShapeDtypeStruct(s, dtype)  # noqa: E731
    return (sds(B, T, N, d), sds(B, S, K, d), sds(B, S, K, dv or d)), arrays, static, grad_bias


def _program(attn, static, grad_bias):
    """``(q, k, v, arrays) -> (out, grads)``: the inference forward and jax.grad through it."""
    def program(q, k, v, arrays):
        bias = arrays.get("bias")
        rest = {n: a for n, a in arrays.items() if n != "bias"}

        def f(q, k, v, bias):
            return attn(q, k, v, bias, **rest, **static)

        loss = lambda *a: f(*a).astype(jnp.float32).sum()  # noqa: E731
        argnums = (0, 1, 2, 3) if grad_bias else (0, 1, 2)
        return f(q, k, v, bias), jax.grad(loss, argnums=argnums)(q, k, v, bias)
    return program


def _check(report):
    assert report.ok, str(report)
    assert report.memory and report.memory["generated_code"] > 0, report


@pytest.mark.parametrize("case", BASE + OPTIONS, ids=lambda c: c[0])
def test_flashlab_kernels_compile(case):
    name, chip, B, T, S, N, K, d, dv, dtype, option, blocks = case
    (q, k, v), arrays, static, grad_bias = _inputs(B, T, S, N, K, d, dv, dtype, option)
    block_kw = {}
    if blocks == "max":
        bias = arrays.get("bias")
        bq, bk = largest_blocks(T, S, d, dtype, chip, dv=dv,
                                bias_dtype=None if bias is None else jnp.dtype(bias.dtype),
                                has_mask="mask" in arrays,
                                has_segments="segment_ids" in arrays,
                                return_lse=True)        # the program differentiates
        block_kw = {"block_q": bq, "block_k": bk, "backward": "split"}
    attn = lambda *a, **kw: flashlab.flash_attention(*a, **kw, **block_kw, interpret=False)  # noqa: E731,E501
    _check(tpu_compile.compile(_program(attn, static, grad_bias), q, k, v, arrays, chip=chip))


#            id                    backend             chip   B  T    S    N  K  d    option
ADAPTERS = [("splash-causal-gqa", "splash", "v5e", 2, 1024, 1024, 8, 2, 128, "causal"),
            ("splash-window-softcap", "splash", "v6e", 2, 1024, 1024, 4, 4, 128, "causal_window"),
            ("splash-segments", "splash", "v5p", 2, 1024, 1024, 4, 4, 128, "segments"),
            ("splash-cross-lengths", "splash", "7x", 2, 1000, 1200, 4, 4, 128, "seq_lengths"),
            ("splash-soft-cap", "splash", "v4", 2, 1024, 1024, 4, 4, 128, "soft_cap"),
            ("flash-causal", "jax_pallas_flash", "v4", 2, 1024, 1024, 4, 4, 128, "causal"),
            ("flash-bias-mask", "jax_pallas_flash", "v5e", 2, 512, 512, 4, 4, 128, "bias"),
            ("flash-mask", "jax_pallas_flash", "v6e", 2, 512, 512, 4, 4, 128, "dense_mask"),
            ("flash-segments", "jax_pallas_flash", "v5p", 2, 1024, 1024, 4, 4, 128, "segments"),
            ("flash-cross-lengths", "jax_pallas_flash", "7x", 2, 1000, 1200, 4, 4, 128,
             "seq_lengths")]


@pytest.mark.parametrize("case", ADAPTERS, ids=lambda c: c[0])
def test_official_adapters_compile(case):
    name, backend, chip, B, T, S, N, K, d, option = case
    (q, k, v), arrays, static, grad_bias = _inputs(B, T, S, N, K, d, None, BF16, option)
    attn = lambda *a, **kw: flashlab.attention(*a, **kw, backend=backend)  # noqa: E731
    _check(tpu_compile.compile(_program(attn, static, grad_bias), q, k, v, arrays, chip=chip))


@pytest.mark.parametrize("chip", ["v5e", "v5p"])
@pytest.mark.parametrize("which", ["ring", "sharded"])
def test_distributed_compiles_on_a_slice(chip, which):
    """4 chips: a v5e 2x2 slice and a v5p 2x2x1 slice; ring over 4, heads split over 4."""
    B, T, N, d = 2, 2048, 8, 128
    axis = "sp" if which == "ring" else "heads"
    mesh = tpu_compile.mesh(chip, (4,), (axis,))
    if which == "ring":
        attn = lambda q, k, v: flashlab.ring_attention(q, k, v, mesh=mesh, axis_name="sp",  # noqa: E731,E501
                                                       is_causal=True)
        spec = jax.sharding.PartitionSpec(None, "sp")
    else:
        attn = lambda q, k, v: flashlab.sharded_attention(q, k, v, mesh=mesh, head_axis="heads",  # noqa: E731,E501
                                                          is_causal=True)
        spec = jax.sharding.PartitionSpec(None, None, "heads")
    sharding = jax.sharding.NamedSharding(mesh, spec)

    def program(q, k, v):
        loss = lambda *a: attn(*a).astype(jnp.float32).sum()  # noqa: E731
        return attn(q, k, v), jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    x = jax.ShapeDtypeStruct((B, T, N, d), BF16)
    report = tpu_compile.compile(program, x, x, x, chip=chip, num_devices=4,
                                 in_shardings=(sharding,) * 3)
    _check(report)
    assert report.compiled.as_text().count("collective-permute" if which == "ring" else
                                           "tpu_custom_call") > 0


def test_broadcast_bias_gradient_makes_no_full_scores_array():
    """dBias of a bias broadcast over batch and heads is accumulated inside the dBias kernel:
    the compiled program's temporaries stay far below one float32 [B, N, T, S] array (at
    517cb85, which wrote dS and summed it in XLA: temp 71.6 MB here; now 12.8 MB)."""
    B, T, N, d = 2, 1024, 8, 128
    x = jax.ShapeDtypeStruct((B, T, N, d), BF16)
    bias = jax.ShapeDtypeStruct((1, 1, T, T), F32)

    def grad(q, k, v, bias):
        loss = lambda *a: flashlab.kernels.flash_attention(  # noqa: E731
            *a, is_causal=True, interpret=False).astype(jnp.float32).sum()
        return jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, bias)

    report = tpu_compile.compile(grad, x, x, x, bias, chip="v6e")
    _check(report)
    text = report.compiled.as_text()
    assert "flashlab_flash_backward_dbias" in text
    full = B * N * T * T * 4                       # 64 MiB: what the old dS output was
    assert report.memory["temp"] < full // 2, (report.memory, full)


@pytest.mark.parametrize("chip,grad_bias", [("v5e", False), ("v4", True)])
def test_length1_mask_and_bias_blocks_compile(chip, grad_bias):
    """A padding mask [B, 1, 1, S] and a per-row bias [B, 1, T, 1] reach the kernels in that
    form, as blocks [1, B_c] and [B_r, 1] (a block dim equal to the array's dim of 1 is legal
    under the (8, 128) rule): forward + grad compile on v5e (the backward kernels read the
    constant bias broadcast too) and v4 (least VMEM, no int8 VPU; the bias differentiated,
    which the backward reads at full T)."""
    B, T, N, d = 2, 1024, 4, 128
    x = jax.ShapeDtypeStruct((B, T, N, d), BF16)
    arrays = {"bias": jax.ShapeDtypeStruct((B, 1, T, 1), F32),
              "mask": jax.ShapeDtypeStruct((B, 1, 1, T), jnp.bool_)}
    attn = lambda *a, **kw: flashlab.flash_attention(*a, **kw, interpret=False)
    program = _program(attn, {}, grad_bias)
    calls = tpu_compile.pallas_calls(program, x, x, x, arrays, chip=chip)
    for call in calls:                      # bias [B_r, 1] and mask [1, B_c] in every kernel
        if call["name"] != "flashlab_flash_backward_dbias" and not grad_bias:
            assert any(b[-1] == 1 for b in call["blocks"]) and \
                any(b[-2] == 1 for b in call["blocks"]), call
    assert any(b[-1] == 1 for b in calls[0]["blocks"]), calls[0]     # the forward, always
    _check(tpu_compile.compile(program, x, x, x, arrays, chip=chip))
