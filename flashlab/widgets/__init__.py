"""ipywidgets explorers of the book; each has a static figure in :mod:`flashlab.viz` beside it."""
