"""Step through a Pallas grid and watch which blocks are resident (chapter 04).

Static figure beside it: :func:`flashlab.viz.pipeline.pipeline_residency_figure`.
"""
from __future__ import annotations

from flashlab.viz.pipeline import pipeline_residency_figure

__all__ = ["pipeline_widget"]


def pipeline_widget(grid, specs, *prefetch, max_steps=24):
    """A slider over grid steps; the figure marks the current step's resident blocks."""
    import ipywidgets as widgets
    import matplotlib.pyplot as plt
    from IPython.display import display

    out = widgets.Output()
    slider = widgets.IntSlider(value=0, min=0, max=max_steps - 1, description="grid step")

    def draw(change=None):
        with out:
            out.clear_output(wait=True)
            fig = pipeline_residency_figure(grid, specs, *prefetch, max_steps=max_steps,
                                            highlight=slider.value)
            display(fig)
            plt.close(fig)

    slider.observe(draw, names="value")
    draw()
    return widgets.VBox([slider, out])
