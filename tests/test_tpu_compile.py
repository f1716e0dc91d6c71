"""flashlab.instruments.tpu_compile: its errors, and the kernels taking their chip from the compile
target.

The tests marked ``tpu_compile`` need libtpu (``pip install "jax[tpu]"``); they skip without it
unless ``FLASHLAB_REQUIRE_LIBTPU=1`` (set by ``.ci/dev.py test``), where they fail instead.
"""
from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import flashlab
from flashlab.contract import device
from flashlab.instruments import tpu_compile
from flashlab.kernels import blocks as blk
from flashlab.kernels.forward_grid import scoped_vmem_bytes
from flashlab.compat.pallas import pl

HAVE = tpu_compile.available()
needs_libtpu = pytest.mark.skipif(
    not HAVE and os.environ.get("FLASHLAB_REQUIRE_LIBTPU") != "1",
    reason=f"libtpu (the TPU compiler) is not installed: {tpu_compile.INSTALL}")

Q = jax.ShapeDtypeStruct((1, 4096, 2, 256), jnp.float32)


def _grad(*a, **kw):
    loss = lambda *a: flashlab.flash_attention(*a, **kw, interpret=False).sum()  # noqa: E731
    return jax.grad(loss, argnums=(0, 1, 2))(*a)


def test_unknown_chip_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"chip: expected one of \['v4', 'v5e', 'v5p', 'v6e', "
                                         r"'7x'\], got 'v9'"):
        tpu_compile.compile(jnp.sin, Q, chip="v9")
    with pytest.raises(ValueError, match="chip: expected one of"):
        tpu_compile.pallas_calls(jnp.sin, Q, chip="tpu-v5")


def test_missing_libtpu_names_the_install_command(monkeypatch):
    monkeypatch.setattr(tpu_compile, "available", lambda: False)
    with pytest.raises(tpu_compile.LibtpuMissingError, match=r'pip install "jax\[tpu\]"'):
        tpu_compile.compile(jnp.sin, Q, chip="v5e")


@pytest.mark.parametrize("chip", ["v4", "v5p"])
def test_kernels_take_blocks_and_vmem_limit_from_the_compile_target(chip):
    """Traced for v4 (16 MiB VMEM) vs v5p (64 MiB): each chip's blocks and limit, fwd and bwd
    (the split backward: its dQ kernel's grid shows the backward's blocks)."""
    import functools
    kernels = tpu_compile.pallas_calls(functools.partial(_grad, backward="split"), Q, Q, Q,
                                       chip=chip)
    assert [k["name"] for k in kernels] == ["flashlab_flash_forward",
                                            "flashlab_flash_backward_dkdv",
                                            "flashlab_flash_backward_dq"]
    fwd_q, fwd_k = blk.choose_block_sizes(4096, 4096, 256, jnp.float32, chip, return_lse=True)
    bwd_q, bwd_k = blk.choose_backward_block_sizes(4096, 4096, 256, jnp.float32, chip)
    assert kernels[0]["grid"] == (1, 2, 4096 // fwd_q, 4096 // fwd_k)
    assert kernels[2]["grid"] == (1, 2, 4096 // bwd_q, 4096 // bwd_k)
    # the forward asks for what its blocks need, with a quarter of headroom in whole MiB, between
    # Mosaic's 16 MiB default and the chip's ceiling (forward_grid.scoped_vmem_bytes); the
    # backward kernels ask for the ceiling (backward_grid.BackwardGridSpec.vmem_need)
    need = blk.vmem_bytes(fwd_q, fwd_k, 256, jnp.float32, return_lse=True)
    assert [k["vmem_limit_bytes"] for k in kernels] == [
        scoped_vmem_bytes(need, chip), blk.vmem_limit_bytes(chip), blk.vmem_limit_bytes(chip)]
    assert all(blk.DEFAULT_SCOPED_VMEM_BYTES <= k["vmem_limit_bytes"] <= blk.vmem_limit_bytes(chip)
               for k in kernels)
    assert scoped_vmem_bytes(need, chip) == min(
        blk.vmem_limit_bytes(chip), max(16 << 20, -(-need * 5 // 4 // 2**20) * 2**20))
    # index maps that provably stay in range (tests/test_kernel_visit.py): no DMA checks
    assert not any(k["bounds_checks"] for k in kernels)
    # the ceiling: twice the planning budget, at most 3/4 of VMEM, never below Mosaic's 16 MiB
    assert blk.vmem_limit_bytes(chip) == max(
        min(blk.VMEM_BYTES[chip] * 3 // 4, 2 * blk.vmem_budget_bytes(chip)),
        min(blk.VMEM_BYTES[chip], blk.DEFAULT_SCOPED_VMEM_BYTES))


def test_the_chips_differ_where_vmem_differs():
    v4, v5p = (tpu_compile.pallas_calls(_grad, Q, Q, Q, chip=c) for c in ("v4", "v5p"))
    # v4's 16 MiB is its whole VMEM (the ceiling); v5p's fused backward asks for its 48 MiB
    assert {k["vmem_limit_bytes"] for k in v4} == {16 << 20}
    assert v5p[1]["vmem_limit_bytes"] == 48 << 20
    # 1024x1024 backward blocks at d=256 float32 fit v5p's 48 MiB, not v4's 16 MiB: v4 falls
    # back to its own choice
    from flashlab.contract.masks import validate
    from flashlab.kernels.backward_grid import make_backward_config
    x = jnp.zeros(Q.shape, Q.dtype)
    spec = validate(x, x, x)[3]
    got = {c: make_backward_config(spec, block_q=1024, block_k=1024, chip=c) for c in ("v4", "v5p")}
    assert (got["v5p"].block_q, got["v5p"].block_k) == (1024, 1024)
    assert (got["v4"].block_q, got["v4"].block_k) == blk.choose_backward_block_sizes(
        4096, 4096, 256, jnp.float32, "v4", is_causal=False)


def test_explicit_chip_wins_over_the_compile_target():
    kernels = tpu_compile.pallas_calls(lambda *a: _grad(*a, chip="v4"), Q, Q, Q, chip="v5p")
    assert {k["vmem_limit_bytes"] for k in kernels} == {blk.vmem_limit_bytes("v4")}
    with device.compile_target("v5p"):
        assert blk.resolve_chip() == "v5p" and blk.resolve_chip("v4") == "v4"
        assert device.platform() == "tpu"           # backends choose as on a TPU
    assert blk.resolve_chip() == (device.detect_chip() or blk.DEFAULT_CHIP)


def test_import_flashlab_does_not_load_libtpu():
    code = "import sys, flashlab; print(any('libtpu' in m for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "JAX_PLATFORMS": ""})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False" and out.stderr.strip() == ""


@needs_libtpu
@pytest.mark.tpu_compile
def test_compile_reports_memory_cost_versions_and_the_target():
    seen = []

    def fn(q, k, v):
        seen.append(blk.resolve_chip())
        return flashlab.flash_attention(q, k, v, is_causal=True, interpret=False)

    x = jax.ShapeDtypeStruct((1, 1024, 2, 128), jnp.bfloat16)
    report = tpu_compile.compile(fn, x, x, x, chip="v4")
    assert report.ok and report.error is None and seen == ["v4"], report
    assert report.memory["argument"] == 3 * 1024 * 2 * 128 * 2
    assert report.memory["output"] == 1024 * 2 * 128 * 2 and report.memory["generated_code"] > 0
    assert report.cost["flops"] > 0
    assert report.jax_version == jax.__version__ and report.libtpu_version
    assert "v4: compiled" in str(report)
    assert [d.device_kind for d in tpu_compile.devices("v5e", 4)] == ["TPU v5 lite"] * 4


def _copy_kernel(x):
    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2
    spec = pl.BlockSpec(x.shape, lambda i: (0, 0))
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(1,),
                          in_specs=[spec], out_specs=spec)(x)


def test_vmem_placement_reads_the_kernels_operands_from_the_hlo():
    """Each Pallas kernel's operands and result with their memory space (S(1): VMEM), and the
    scoped VMEM the kernel was given, from the optimized HLO's text."""
    hlo = """
  %q.1 = bf16[2,8,16]{2,1,0:T(8,128)(2,1)} parameter(0)
  %copy = bf16[2,16,8]{2,1,0:T(8,128)(2,1)S(1)} copy(%q.1), metadata={op_name="q"}
  %k = bf16[2,16,8]{2,1,0:T(8,128)(2,1)} parameter(1)
  ROOT %fwd.1 = bf16[2,16,8]{2,1,0:T(8,128)(2,1)} custom-call(%copy, %k), custom_call_target=\
"tpu_custom_call", backend_config={"scoped_memory_configs":[{"memory_space":"1","offset":"64",\
"size":"16"}]}
"""
    compiled = type("Compiled", (), {"as_text": lambda self: hlo})()
    report = tpu_compile.CompileReport(chip="v5e", ok=True, compiled=compiled)
    [k] = tpu_compile.vmem_placement(report)
    assert k["name"] == "fwd.1" and k["scoped"] == (64, 16)
    assert [(a, v) for a, _, v in k["operands"]] == [("copy", True), ("k", False)]
    assert k["result"][2] is False


@needs_libtpu
@pytest.mark.tpu_compile
def test_a_forward_asking_for_its_need_leaves_xla_room_for_its_query(monkeypatch):
    """v5e, B=2 T=8192 H=16 d=64, 512²: asking Mosaic for 16 MiB (its need and a quarter, at
    least the default) instead of the 96 MiB ceiling, the program keeps the forward's query
    (its [B, H, T, d] copy, 32 MiB) in VMEM; with the ceiling it has no room for it."""
    from flashlab.kernels import forward_grid
    x = jax.ShapeDtypeStruct((2, 8192, 16, 64), jnp.bfloat16)
    f = lambda q, k, v: flashlab.flash_attention(  # noqa: E731
        q, k, v, block_q=512, block_k=512, interpret=False)
    [k] = tpu_compile.vmem_placement(tpu_compile.compile(f, x, x, x, chip="v5e"))
    assert k["scoped"][1] == 16 << 20
    assert [v for _, _, v in k["operands"][2:]] == [True, False, False]     # q; k and v: HBM
    monkeypatch.setattr(forward_grid, "scoped_vmem_bytes",
                        lambda need, chip=None: blk.vmem_limit_bytes(chip))
    jax.clear_caches()                   # the kernel's jit traced its compiler params already
    [k] = tpu_compile.vmem_placement(tpu_compile.compile(f, x, x, x, chip="v5e"))
    assert k["scoped"][1] == 96 << 20 and not any(v for _, _, v in k["operands"][2:])
    monkeypatch.undo()
    jax.clear_caches()                   # no later test gets the ceiling's kernel from a cache


@needs_libtpu
@pytest.mark.tpu_compile
def test_a_rejected_kernel_gives_the_compilers_vmem_report_never_a_silent_success():
    # One 16 MiB block in, one out (fp32 2048 x 2048): over the 16 MiB default scoped limit.
    report = tpu_compile.compile(_copy_kernel, jax.ShapeDtypeStruct((2048, 2048), jnp.float32),
                                 chip="v5e")
    assert not report.ok and report.stage == "compile" and report.compiled is None
    assert "vmem" in report.error.lower() and "Traceback" not in report.error
    assert "FAILED at compile" in str(report)
    with pytest.raises(tpu_compile.CompileError, match="(?i)vmem"):
        report.raise_if_failed()


@needs_libtpu
@pytest.mark.tpu_compile
def test_a_mistake_in_the_call_raises_as_under_jit():
    x = jax.ShapeDtypeStruct((1, 128, 2, 128), jnp.float32)
    y = jax.ShapeDtypeStruct((1, 128, 2, 64), jnp.float32)
    with pytest.raises(ValueError, match="key"):
        tpu_compile.compile(flashlab.flash_attention, x, y, y, chip="v5e", interpret=False)
    with pytest.raises(ValueError, match="n: expected an int in 1..4"):
        tpu_compile.devices("v5e", 5)


# (chip, block_q, block_k, options): the forward (with lse, as training runs it) compiled with
# its scoped-VMEM limit set to blocks.vmem_bytes itself, so Mosaic checks that the estimate
# bounds its real need (measured: v4 1024x1024 needs 9.35 MiB against an estimate of 10.0; a
# mask with segment ids is the tightest there, 10.32 against 11.06 at 512x1024). Tiles of 1024
# columns run in row chunks on v4 and v5e (forward_config.FORWARD_ROW_CHUNKS) and are checked
# that way.
_FORWARD_ESTIMATE_CASES = [
    ("v4", 1024, 1024, {}),
    ("v4", 1024, 512, {"bias": True, "mask": True, "segments": True, "soft_cap": True}),
    ("v4", 1024, 1024, {"mask": True}),
    ("v4", 512, 1024, {"mask": True, "segments": True}),
    ("v4", 512, 512, {"d": 256}),
    ("v5e", 2048, 1024, {}),
    # four row chunks of 256 (FORWARD_ROW_CHUNKS): the bias, int8 mask and segment ids cut
    ("v5e", 1024, 1024, {"bias": True, "mask": True, "segments": True}),
    # plain tiles in column chunks of 1024 (FORWARD_COL_CHUNK): v6e in 2 row chunks, 7x in one
    ("v6e", 2048, 2048, {"noncausal": True}),
    ("7x", 1024, 2048, {"noncausal": True}),
]


@needs_libtpu
@pytest.mark.tpu_compile
@pytest.mark.parametrize("chip, bq, bk, opts", _FORWARD_ESTIMATE_CASES,
                         ids=[f"{c}-{q}x{k}-{'-'.join(o) or 'plain'}"
                              for c, q, k, o in _FORWARD_ESTIMATE_CASES])
def test_the_forward_vmem_estimate_bounds_what_mosaic_allocates(monkeypatch, chip, bq, bk, opts):
    from flashlab.contract.masks import validate
    from flashlab.kernels import forward
    B, T, N, d = 1, 2048, 2, opts.get("d", 128)
    dt = jnp.bfloat16
    need = blk.vmem_bytes(bq, bk, d, dt, bias_dtype=dt if opts.get("bias") else None,
                          has_mask=bool(opts.get("mask")),
                          has_segments=bool(opts.get("segments")), return_lse=True)
    monkeypatch.setattr(blk, "vmem_limit_bytes", lambda chip=None: need)
    x = jax.ShapeDtypeStruct((B, T, N, d), dt)
    args, extra = [x, x, x], {}
    for name, aval in (("bias", jax.ShapeDtypeStruct((1, N, T, T), dt)),
                       ("mask", jax.ShapeDtypeStruct((B, N, T, T), jnp.bool_)),
                       ("segments", jax.ShapeDtypeStruct((B, T), jnp.int32))):
        if opts.get(name):
            args.append(aval)
            extra["segment_ids" if name == "segments" else name] = len(args) - 1

    def f(*a):
        q, k, v, spec = validate(a[0], a[1], a[2], **{n: a[i] for n, i in extra.items()},
                                 is_causal=not opts.get("noncausal"),
                                 logits_soft_cap=30.0 if opts.get("soft_cap") else None)
        return forward.flash_attention_forward(q, k, v, spec, block_q=bq, block_k=bk,
                                               interpret=False, chip=chip)
    report = tpu_compile.compile(f, *args, chip=chip)
    assert report.ok, report.error[:2000]


# (chip, block_q, block_k, options): the backward compiled with its scoped-VMEM limit set to
# blocks.backward_vmem_bytes itself, so Mosaic checks that the estimate bounds its real need
# (pipelined blocks, scratch and its own spill slots; measured: v4 1024x1024 needs 11.96 MiB
# for dK/dV against an estimate of 13.06).
_ESTIMATE_CASES = [
    ("v4", 1024, 1024, {}),
    ("v4", 1024, 1024, {"segments": True}),
    ("v4", 512, 512, {"soft_cap": True, "bias": True}),
    ("v4", 512, 1024, {"mask": True}),
    ("v4", 512, 512, {"fused": 1}),
    ("v4", 512, 1024, {"fused": 1, "T": 8192}),            # v4's fused default at T = 8192
    ("v4", 512, 1024, {"fused": 4, "T": 32768}),           # and at 32768: dQ in 4 chunks
    ("v5e", 1024, 1024, {"fused": 1, "T": 32768}),         # a 16 MiB resident dQ
    ("v5e", 2048, 1024, {"soft_cap": True}),
    ("v4", 1024, 1024, {"fused": 2, "T": 8192}),           # 15.06 of v4's 16 MiB
    # the fused kernel's spill slots (BACKWARD_SPILL_TILES["fused"]) at 2048², non-causal (its
    # largest need): 7x's 48 MiB limit, and every option that adds a tile
    ("7x", 2048, 2048, {"fused": 1, "T": 8192, "causal": False}),
    ("v5e", 2048, 2048, {"fused": 1, "T": 4096, "causal": False, "soft_cap": True,
                         "mask": True, "segments": True}),
]


@needs_libtpu
@pytest.mark.tpu_compile
@pytest.mark.parametrize("chip, bq, bk, opts", _ESTIMATE_CASES,
                         ids=[f"{c}-{q}x{k}-" + ("-".join(
                             f"{n}{v}" if n in ("T", "fused", "causal") else n
                             for n, v in o.items()) or "plain")
                              for c, q, k, o in _ESTIMATE_CASES])
def test_the_backward_vmem_estimate_bounds_what_mosaic_allocates(monkeypatch, chip, bq, bk,
                                                                    opts):
    from flashlab.contract.masks import validate
    from flashlab.kernels import backward, backward_grid
    B, T, N, d = 1, opts.get("T", 2048), 2, 128
    dt = jnp.bfloat16
    need = blk.backward_vmem_bytes(
        bq, bk, d, dt, bias_dtype=dt if opts.get("bias") else None,
        has_mask=bool(opts.get("mask")), has_segments=bool(opts.get("segments")),
        soft_cap=bool(opts.get("soft_cap")), fused=bool(opts.get("fused")),
        **({"q_len": T, "q_chunks": opts["fused"]} if opts.get("fused") else {}))
    monkeypatch.setattr(blk, "vmem_limit_bytes", lambda chip=None: need)
    x = jax.ShapeDtypeStruct((B, T, N, d), dt)
    args = [x, x, x, x, jax.ShapeDtypeStruct((B, N, T), jnp.float32), x]
    extra = {}
    if opts.get("bias"):
        args.append(jax.ShapeDtypeStruct((1, N, T, T), dt))
        extra["bias"] = len(args) - 1
    if opts.get("mask"):
        args.append(jax.ShapeDtypeStruct((B, N, T, T), jnp.bool_))
        extra["mask"] = len(args) - 1
    if opts.get("segments"):
        args.append(jax.ShapeDtypeStruct((B, T), jnp.int32))
        extra["segment_ids"] = len(args) - 1

    def f(*a):
        q, k, v, spec = validate(a[0], a[1], a[2], **{n: a[i] for n, i in extra.items()},
                                 is_causal=opts.get("causal", True),
                                 logits_soft_cap=30.0 if opts.get("soft_cap") else None)
        cfg, chunks = backward_grid.resolve_backward(
            spec, "fused" if opts.get("fused") else "split", block_q=bq, block_k=bk, chip=chip)
        assert (cfg.block_q, cfg.block_k, chunks) == (bq, bk, opts.get("fused", 0))  # admitted
        return backward.flash_attention_backward(q, k, v, spec, a[3], a[4], a[5], block_q=bq,
                                                 block_k=bk, interpret=False, chip=chip,
                                                 fused=bool(opts.get("fused")))
    report = tpu_compile.compile(f, *args, chip=chip)
    assert report.ok, report.error[:2000]
