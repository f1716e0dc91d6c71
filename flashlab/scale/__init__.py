"""Scale-out (chapter 10): sharded and ring attention over a mesh, the ring's zig-zag layout,
and ``python -m flashlab ring`` across processes. Imports everything below it.
"""
from flashlab.scale import distributed, ring, ring_layout, ring_steps

__all__ = ["distributed", "ring", "ring_layout", "ring_steps"]
