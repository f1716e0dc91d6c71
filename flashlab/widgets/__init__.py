"""ipywidgets explorers of the book; each has a static figure in :mod:`flashlab.viz` beside it."""
from .ring import ring_widget

__all__ = ["ring_widget"]
