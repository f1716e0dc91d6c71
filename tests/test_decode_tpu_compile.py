"""The decode kernel (with its split-K merge) through the real TPU compiler, all five chips.

Needs libtpu (``pip install "jax[tpu]"``); skips without it unless ``FLASHLAB_REQUIRE_LIBTPU=1``
(set by ``.ci/dev.py test``), where it fails instead.
"""
import os

import pytest

from flashlab.instruments import tpu_compile
from flashlab.instruments.decode_cases import decode_step_case

needs_libtpu = pytest.mark.skipif(
    not tpu_compile.available() and os.environ.get("FLASHLAB_REQUIRE_LIBTPU") != "1",
    reason=f"libtpu (the TPU compiler) is not installed: {tpu_compile.INSTALL}")

CASES = {
    # GQA 8:1 decode, bf16, batch 1 and a long cache: flash-decoding splits, sinks merged
    "gqa8_bf16_split_sinks": dict(batch=1, q_heads=32, kv_heads=4, pages_per_sequence=512,
                                  sinks=True),
    # MHA chunked prefill, float32, head_dim 64, window + soft cap
    "mha_chunk_f32": dict(batch=2, q_heads=4, kv_heads=4, head_dim=64, new_tokens=4,
                          pages_per_sequence=8, dtype="float32", window=32, soft_cap=20.0),
}


@needs_libtpu
@pytest.mark.parametrize("chip", list(tpu_compile.CHIPS))
def test_decode_compiles_for_every_chip(chip):
    for name, kw in CASES.items():
        fn, args = decode_step_case(**kw)
        report = tpu_compile.compile(fn, *args, chip=chip)
        assert report.ok, f"{name} on {chip}:\n{report.error}"


@needs_libtpu
@pytest.mark.parametrize("chip", ["v5e", "v6e"])
def test_official_paged_attention_compiles_on_the_same_shapes(chip):
    # the comparison case for static schedules (bench tpu-static): same decode step, both kernels
    from flashlab.instruments.decode_cases import official_paged_step_case
    for case in (decode_step_case, official_paged_step_case):
        fn, args = case(batch=8, q_heads=32, kv_heads=4, pages_per_sequence=64)
        report = tpu_compile.compile(fn, *args, chip=chip)
        assert report.ok, f"{case.__name__} on {chip}:\n{report.error}"


def test_decode_keeps_mosaics_dma_bounds_checks():
    """Its page table is the caller's data, so unlike the forward and backward kernels (whose
    index maps provably stay in range) the decode kernel keeps Mosaic's DMA checks."""
    fn, args = decode_step_case(**next(iter(CASES.values())))
    calls = tpu_compile.pallas_calls(fn, *args, chip="v5e")
    assert calls and all(k["bounds_checks"] for k in calls if "decode" in k["name"])
    assert any("decode" in k["name"] for k in calls)
