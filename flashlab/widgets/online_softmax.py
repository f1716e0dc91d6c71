"""A stepper over the blocks of one row (static twin: ``flashlab.viz.online_softmax.online_softmax_figure``)."""
from __future__ import annotations

from flashlab.viz.online_softmax import draw_online_softmax_step, online_softmax_trace


def online_softmax_widget(scores, values, block: int = 8):
    """ipywidgets stepper: fold one block more into (m, l, O) and watch the output converge."""
    import ipywidgets as W
    import matplotlib.pyplot as plt

    trace = online_softmax_trace(scores, values, block)
    step = W.IntSlider(value=0, min=0, max=len(trace["m"]) - 1, description="block")
    out = W.Output()

    def redraw(*_):
        with out:
            out.clear_output(wait=True)
            fig, (a, b) = plt.subplots(1, 2, figsize=(7, 3.2), dpi=80)
            draw_online_softmax_step(a, b, trace, step.value)
            fig.tight_layout()
            plt.show()

    step.observe(redraw, names="value")
    redraw()
    return W.VBox([step, out])
