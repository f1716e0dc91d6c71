"""flashlab.instruments.roofline: the chip table and the time bound."""
import pytest

from flashlab.instruments import io_model, roofline


def test_every_chip_is_there_with_sane_numbers():
    table = roofline.chips()
    assert set(roofline.CHIP_NAMES) == set(table)
    for c in table.values():
        assert 1e11 < c.hbm_bytes_per_s < 1e13, c
        assert 1e14 < c.bf16_flops < 1e16, c
        assert 0 < c.fp32_flops < c.bf16_flops, c
        assert c.vmem_bytes > 0 and c.hbm_bytes > 1e9 and c.ici_bytes_per_s > 0, c
        assert 100 < c.ridge_point < 1000, c          # FLOPs/byte: every chip is ~200-600
        assert c.source, c


def test_tpu_rows_agree_with_the_cited_public_figures():
    # JAX's table (when present) and the public figures must not disagree by > 15 %.
    with_jax, public = roofline.chips(use_jax=True), roofline.chips()
    for n in ("v4", "v5e", "v5p", "v6e", "7x"):
        for field in ("hbm_bytes_per_s", "bf16_flops"):
            a, b = getattr(with_jax[n], field), getattr(public[n], field)
            assert a == pytest.approx(b, rel=0.15), (n, field, a, b)


def test_public_figures_win_and_every_figure_has_a_source():
    table = roofline.chips()
    v5p = table["v5p"]          # Google's v5p page: 2,765 GB/s, 95 GiB; JAX's table differs
    assert v5p.hbm_bytes_per_s == 2.765e12 and v5p.hbm_bytes == 95 * 2**30
    figures = {"hbm_bytes_per_s", "bf16_flops", "fp32_flops", "hbm_bytes", "vmem_bytes",
               "ici_bytes_per_s"}
    for c in table.values():
        assert figures <= dict(c.sources).keys(), c.name
        if c.kind == "tpu":        # physical VMEM per core >= the default scoped limit
            assert 0 < c.scoped_vmem_bytes <= c.vmem_bytes, c.name
    # The kernels' VMEM table (blocks.py) and the roofline table are the same VMEM.
    from flashlab.kernels import blocks
    for n in ("v4", "v5e", "v5p", "v6e", "7x"):
        assert table[n].vmem_bytes == blocks.VMEM_BYTES[n], n
    for row in roofline.jax_cross_check():
        assert row["public"] == getattr(table[row["chip"]], row["figure"])


def test_time_bound_is_the_max_of_compute_and_memory():
    c = roofline.chip("v5e")
    flops, nbytes = 1e12, 1e9
    tb = roofline.time_bound(flops, nbytes, c)
    assert tb["seconds"] == max(flops / c.bf16_flops, nbytes / c.hbm_bytes_per_s)
    assert tb["bound"] == "compute" and tb["intensity"] == 1000
    mem = roofline.time_bound(1e9, 1e9, "v5e")
    assert mem["bound"] == "memory" and mem["seconds"] == pytest.approx(1e9 / c.hbm_bytes_per_s)
    f32 = roofline.time_bound(1e12, 1e9, c, dtype="float32")
    assert f32["compute_s"] > tb["compute_s"]


def test_flash_has_higher_intensity_and_a_lower_bound():
    for name in ("v5e", "v6e", "A100"):
        p = io_model.algorithm_points(name, batch=4, heads=16, seq_len=4096, head_dim=128)
        # standard ≈ d·e/2 FLOPs/byte (S, P in HBM); flash ≈ block_q (K, V once per row block)
        # (on the A100 the paper's model with 192 KB SRAM gives small blocks: only ~2x)
        factor = 5 if roofline.chip(name).kind == "tpu" else 1.5
        assert p["flash"]["intensity"] > factor * p["standard"]["intensity"]
        assert p["flash"]["seconds"] < p["standard"]["seconds"]
        assert p["standard"]["bound"] == "memory"
        assert p["flash"]["flops_per_s"] <= roofline.chip(name).bf16_flops * (1 + 1e-9)


def test_measured_points_from_bench_rows():
    rows = [
        {"backend": "pallas_tpu", "seq_len": 1024, "head_dim": 64, "dtype": "bfloat16",
         "causal": False, "seconds": 1e-3, "flops_per_s": 1e13},
        {"backend": "xla", "seq_len": 1024, "head_dim": 64, "dtype": "float32",
         "causal": True, "seconds": 2e-3, "flops_per_s": 5e12},
        {"backend": "broken"},                       # missing keys: skipped
    ]
    pts = io_model.measured_points(rows, batch=1, heads=8)
    assert [p["backend"] for p in pts] == ["pallas_tpu", "xla"]
    assert pts[0]["intensity"] > pts[1]["intensity"] > 0


def test_unknown_chip_names_the_argument():
    with pytest.raises(ValueError, match="chip"):
        roofline.chip("v9000")
