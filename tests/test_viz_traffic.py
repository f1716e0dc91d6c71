"""Chapter 06 figures and widgets build (small sizes, Agg backend)."""
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from flashlab.viz import traffic as vt  # noqa: E402


@pytest.mark.parametrize("make", [
    lambda: vt.traffic_vs_seq_len_figure((256, 512, 1024), highlight="kernel"),
    lambda: vt.traffic_vs_block_size_figure((128, 256), seq_len=1024),
    lambda: vt.roofline_figure(("v5e", "A100"), seq_len=1024, measured=[
        {"backend": "pallas_tpu", "seq_len": 1024, "head_dim": 128, "dtype": "bfloat16",
         "causal": False, "seconds": 1e-3, "flops_per_s": 5e13}]),
    lambda: vt.tile_schedule_figure(seq_len=256, steps=[0, 1, 2, 3]),
    lambda: vt.explorer_figure(seq_len=1024, block_q=256, block_k=256, is_causal=True),
])
def test_figures_build(make):
    fig = make()
    assert fig.axes
    plt.close(fig)


def test_widgets_build():
    pytest.importorskip("ipywidgets")
    from flashlab.widgets import traffic as wt
    w = wt.traffic_explorer(seq_len=1024, block_q=256, block_k=256)
    s = wt.tile_schedule_widget(seq_len=256)
    assert w.children and s.children
    plt.close("all")
