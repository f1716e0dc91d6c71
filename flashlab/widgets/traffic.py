"""ipywidgets for chapter 06: the tile-schedule slider and the traffic explorer.

Each widget redraws a figure of :mod:`flashlab.viz.traffic`; the book shows those static
figures beside the widget (static HTML has no kernel to run the callbacks).
"""
from __future__ import annotations

__all__ = ["tile_schedule_widget", "traffic_explorer"]


def _w():
    import ipywidgets as widgets
    return widgets


def tile_schedule_widget(*, seq_len: int = 512, block_q: int = 128, block_k: int = 128,
                         is_causal: bool = True, head_dim: int = 128, dtype="bfloat16"):
    """A step slider over the forward kernel's grid: one frame of the tile schedule per step.

    Static counterpart: :func:`flashlab.viz.traffic.tile_schedule_figure`.
    """
    import matplotlib.pyplot as plt
    from flashlab.instruments import traffic
    from flashlab.viz.traffic import tile_schedule_frame
    widgets = _w()
    kg = traffic.kernel_grid("forward", batch=1, heads=1, seq_len=seq_len, head_dim=head_dim,
                             dtype=dtype, block_q=block_q, block_k=block_k, is_causal=is_causal)
    sch = traffic.tile_schedule(kg)
    nq, nk = kg.grid[2], kg.grid[3]
    out = widgets.Output()
    step = widgets.IntSlider(value=0, min=0, max=len(sch["grid_points"]) - 1,
                             description="grid step")

    def draw(change=None):
        with out:
            out.clear_output(wait=True)
            fig, ax = plt.subplots(figsize=(3.2, 3.2), dpi=90)
            tile_schedule_frame(ax, sch, step.value, num_q_blocks=nq, num_kv_blocks=nk)
            plt.show()

    step.observe(draw, names="value")
    draw()
    play = widgets.Play(min=0, max=step.max, interval=400, description="play")
    widgets.jslink((play, "value"), (step, "value"))
    return widgets.VBox([widgets.HBox([play, step]), out])


def traffic_explorer(*, seq_len: int = 4096, head_dim: int = 128, block_q: int = 512,
                     block_k: int = 512, dtype="bfloat16", chip: str = "v5e"):
    """Sliders for N, d, B_r, B_c, dtype, chip and causal; redraws traffic, VMEM, roofline.

    Static counterpart: :func:`flashlab.viz.traffic.explorer_figure`.
    """
    import matplotlib.pyplot as plt
    from flashlab.instruments import roofline
    from flashlab.viz.traffic import explorer_figure
    widgets = _w()
    pow2 = lambda lo, hi: [2**k for k in range(lo, hi + 1)]  # noqa: E731
    n = widgets.SelectionSlider(options=pow2(8, 15), value=seq_len, description="N")
    d = widgets.SelectionSlider(options=[64, 128, 256], value=head_dim, description="d")
    bq = widgets.SelectionSlider(options=pow2(7, 11), value=block_q, description="B_r")
    bk = widgets.SelectionSlider(options=pow2(7, 11), value=block_k, description="B_c")
    dt = widgets.Dropdown(options=["bfloat16", "float32"], value=str(dtype), description="dtype")
    ch = widgets.Dropdown(options=list(roofline.CHIP_NAMES[:5]), value=chip, description="chip")
    causal = widgets.Checkbox(value=False, description="causal")
    out = widgets.Output()

    def draw(change=None):
        with out:
            out.clear_output(wait=True)
            try:
                explorer_figure(seq_len=n.value, head_dim=d.value, block_q=min(bq.value, n.value),
                                block_k=min(bk.value, n.value), dtype=dt.value, chip=ch.value,
                                is_causal=causal.value)
                plt.show()
            except ValueError as err:        # e.g. blocks that do not fit the VMEM budget
                print(err)

    for w in (n, d, bq, bk, dt, ch, causal):
        w.observe(draw, names="value")
    draw()
    return widgets.VBox([widgets.HBox([widgets.VBox([n, d, bq, bk]),
                                       widgets.VBox([dt, ch, causal])]), out])
