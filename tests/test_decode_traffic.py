"""Decode traffic from the kernel's own BlockSpecs, and the chapter-12 figures."""
import matplotlib
import numpy as np
import pytest

matplotlib.use("Agg")

from flashlab.instruments import decode_traffic, traffic
from flashlab import viz


def test_each_visible_page_is_copied_once():
    lengths = [40, 17, 64, 1]
    kg = decode_traffic.decode_kernel_grid(lengths=lengths, q_heads=8, kv_heads=2,
                                           page_size=16, num_splits=1, pages_per_block=1)
    r = traffic.replay(kg)
    pages = sum(-(-L // 16) for L in lengths)
    assert r["k"]["copies"] == r["v"]["copies"] == pages
    assert traffic.replay(kg, method="loop")["total"] == r["total"]


def test_pages_per_block_copies_at_most_n_minus_1_extra_pages_per_sequence():
    # n = 3 page operands per step: an operand past the last page keeps the page it holds
    # (no copy), also into the next sequence when that has no page for it.
    lengths, n = [16 * 7, 40, 16 * 6, 1], 3
    kg = decode_traffic.decode_kernel_grid(lengths=lengths, q_heads=8, kv_heads=2,
                                           page_size=16, num_splits=1, pages_per_block=n)
    r = traffic.replay(kg)
    copies = sum(r[f"k{t or ''}"]["copies"] for t in range(n))
    assert kg.operand("k2").shape == kg.operand("k").shape
    # pages 7, 3, 6, 1: operands 1, 2 keep pages 4, 5 of sequence 0 and of sequence 2
    assert copies == 7 + 3 + 6 + 1


def test_window_skips_pages_before_it():
    kg = decode_traffic.decode_kernel_grid(lengths=[160], q_heads=4, kv_heads=1,
                                           page_size=16, window=40, num_splits=1,
                                           pages_per_block=1)
    # positions 119..159 are visible: pages 7, 8, 9
    assert traffic.replay(kg)["k"]["copies"] == 3


@pytest.mark.parametrize("q_heads,kv_heads", [(32, 4), (16, 16)], ids=["gqa8", "mha"])
def test_decode_step_within_1_1x_of_the_lower_bound(q_heads, kv_heads):
    lengths = np.linspace(256, 2048, 4).astype(int)
    d = decode_traffic.decode_step_bytes(lengths=lengths, q_heads=q_heads, kv_heads=kv_heads)
    assert 1.0 <= d["ratio"] <= 1.1, d


def test_prefill_kernel_reads_the_cache_once_per_query_head():
    p = decode_traffic.prefill_kernel_decode_bytes(length=2048, batch=2, q_heads=32, kv_heads=4)
    assert 7.5 <= p["ratio"] <= 8.5, p


def test_decode_sits_at_intensity_g_below_every_ridge():
    pts = viz.decode.decode_points(length=1024, batch=2, q_heads=8, group_sizes=(1, 8))
    assert [round(p["intensity"]) for p in pts] == [1, 8]
    from flashlab.instruments import roofline
    assert all(p["intensity"] < roofline.chip(c).ridge_point / 10
               for p in pts for c in ("v4", "v5e", "v5p", "v6e", "7x"))


def test_figures_build():
    import matplotlib.pyplot as plt
    for fig in (viz.decode_roofline_figure(length=1024, batch=2, q_heads=8, group_sizes=(8,)),
                viz.paged_cache_figure(), viz.page_walk_figure()):
        assert fig.axes
        plt.close(fig)
