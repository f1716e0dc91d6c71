"""Figures of the book: one function per figure, each returns a matplotlib Figure."""
from flashlab.viz.backward import (
    backward_tile_map_figure, backward_traffic_figure, loss_curves_figure)
from flashlab.viz.bench import bench_figure
from flashlab.viz.decode import decode_roofline_figure, page_walk_figure, paged_cache_figure
from flashlab.viz.hard import vmem_vs_seq_len
from flashlab.viz.online_softmax import online_softmax_figure
from flashlab.viz.tiled import traffic_figure
from flashlab.viz.naive import naive_scaling_figure, score_matrix_figure
from flashlab.viz.pipeline import block_skipping_figure, pipeline_residency_figure
from flashlab.viz.reuse import backend_loss_figure, long_document_figure, packing_figure
from flashlab.viz.ring import comm_model_figure, load_balance_figure, ring_steps_figure
from flashlab.viz.tpu_schedule import static_estimates_figure, tile_timeline_figure
from flashlab.viz.traffic import (
    explorer_figure, roofline_figure, tile_schedule_figure, traffic_vs_block_size_figure,
    traffic_vs_seq_len_figure)

__all__ = ["naive_scaling_figure", "score_matrix_figure", "bench_figure", "ring_steps_figure",
           "load_balance_figure", "comm_model_figure", "pipeline_residency_figure",
           "block_skipping_figure", "traffic_vs_seq_len_figure", "traffic_vs_block_size_figure",
           "roofline_figure", "tile_schedule_figure", "explorer_figure",
           "online_softmax_figure", "traffic_figure", "backward_traffic_figure",
           "backward_tile_map_figure", "loss_curves_figure", "vmem_vs_seq_len",
           "packing_figure", "backend_loss_figure", "long_document_figure",
           "decode_roofline_figure", "paged_cache_figure", "page_walk_figure",
           "static_estimates_figure", "tile_timeline_figure"]
