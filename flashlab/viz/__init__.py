"""Figures of the book: one function per figure, each returns a matplotlib Figure."""
from .naive import naive_scaling_figure, score_matrix_figure

__all__ = ["naive_scaling_figure", "score_matrix_figure"]
