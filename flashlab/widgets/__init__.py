"""ipywidgets explorers of the book; each has a static figure in :mod:`flashlab.viz` beside it."""
from flashlab.widgets.online_softmax import online_softmax_widget
from flashlab.widgets.pipeline import pipeline_widget
from flashlab.widgets.ring import ring_widget
from flashlab.widgets.traffic import tile_schedule_widget, traffic_explorer

__all__ = ["online_softmax_widget", "pipeline_widget", "ring_widget", "tile_schedule_widget", "traffic_explorer"]
