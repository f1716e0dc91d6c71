"""Figures of the book: one function per figure, each returns a matplotlib Figure."""
from .bench import bench_figure
from .naive import naive_scaling_figure, score_matrix_figure
from .ring import comm_model_figure, load_balance_figure, ring_steps_figure

__all__ = ["naive_scaling_figure", "score_matrix_figure", "bench_figure", "ring_steps_figure",
           "load_balance_figure", "comm_model_figure"]
