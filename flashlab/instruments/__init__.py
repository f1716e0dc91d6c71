"""What measures the rungs; never imported by them.

- :mod:`~flashlab.instruments.traffic`: HBM bytes replayed from the kernels' own BlockSpecs;
  :mod:`~flashlab.instruments.io_model`: the paper's IO model and the roofline points.
- :mod:`~flashlab.instruments.roofline`: chip figures with sources, and the roofline.
- :mod:`~flashlab.instruments.tpu_compile`, :mod:`~flashlab.instruments.tpu_dump`,
  :mod:`~flashlab.instruments.tpu_schedule`: the real TPU compiler on CPU and its static schedule;
  :mod:`~flashlab.instruments.tpu_edges`: where in a tile the MXUs wait.
- :mod:`~flashlab.instruments.comm_model`, :mod:`~flashlab.instruments.ring_overlap`: the ring's
  communication model and its compiled overlap.
- :mod:`~flashlab.instruments.decode_cases`: decode steps as compile cases for the static bench.
- :mod:`~flashlab.instruments.decode_traffic`, :mod:`~flashlab.instruments.measure`,
  :mod:`~flashlab.instruments.profiling`, :mod:`~flashlab.instruments.leaks`: decode bytes,
  timing, profiles and memory.
"""
from flashlab.instruments import (
    comm_model, decode_traffic, io_model, leaks, measure, profiling, roofline, tpu_compile,
    traffic)

__all__ = ["comm_model", "decode_traffic", "io_model", "leaks", "measure", "profiling",
           "roofline", "tpu_compile", "traffic"]
