"""The plain-JAX rungs of the ladder (chapters 01-03). Imports compat and contract.

- :mod:`~flashlab.ladder.reference`: naive attention and the float64 oracle.
- :mod:`~flashlab.ladder.online_softmax`: the (m, l, acc) state and its merge, written once.
- :mod:`~flashlab.ladder.tiled`: tiled FlashAttention forward and backward in plain JAX (its
  schedule in :mod:`~flashlab.ladder.tiled_schedule`, its loops in
  :mod:`~flashlab.ladder.tiled_loops`).
- :mod:`~flashlab.ladder.tiled_minimal`: the same with no masks, for chapter 03 to read.
- :mod:`~flashlab.ladder.decode`: the plain-JAX decode rungs and their layout helpers
  (chapter 12).
"""
from flashlab.ladder import decode, online_softmax, reference, tiled, tiled_minimal

__all__ = ["decode", "online_softmax", "reference", "tiled", "tiled_minimal"]
