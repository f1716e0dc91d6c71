"""A slider over the steps of ring attention (static twin: ``flashlab.viz.ring.ring_steps_figure``)."""
from __future__ import annotations

from flashlab.viz.ring import draw_ring_step


def ring_widget(num_devices: int = 4, layout: str = "zigzag", *, is_causal: bool = True):
    """ipywidgets explorer: pick the layout and the step; see who holds which K/V block and
    which score blocks have been computed so far."""
    import ipywidgets as W
    import matplotlib.pyplot as plt

    step = W.IntSlider(value=0, min=0, max=num_devices - 1, description="step")
    lay = W.Dropdown(options=["zigzag", "contiguous"], value=layout, description="layout")
    causal = W.Checkbox(value=is_causal, description="causal")
    out = W.Output()

    def redraw(*_):
        with out:
            out.clear_output(wait=True)
            fig, (a, b) = plt.subplots(1, 2, figsize=(6, 3), dpi=80)
            draw_ring_step(a, b, num_devices, lay.value, step.value, is_causal=causal.value)
            fig.tight_layout()
            plt.show()

    for w in (step, lay, causal):
        w.observe(redraw, names="value")
    redraw()
    return W.VBox([W.HBox([step, lay, causal]), out])
