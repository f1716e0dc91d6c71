"""One import of ``shard_map`` for every supported JAX.

JAX >= 0.7 exposes ``jax.shard_map`` with ``check_vma`` (varying-manual-axes type checking);
older releases had ``jax.experimental.shard_map.shard_map`` with ``check_rep``. Callers use
:func:`shard_map` below with ``check=`` and never touch either spelling.
"""
from __future__ import annotations

import jax

__all__ = ["shard_map", "SHARD_MAP_SOURCE"]

if hasattr(jax, "shard_map"):
    _shard_map = jax.shard_map
    _CHECK_KW = "check_vma"
    SHARD_MAP_SOURCE = "jax.shard_map"
else:  # pragma: no cover - older JAX
    from jax.experimental.shard_map import shard_map as _shard_map
    _CHECK_KW = "check_rep"
    SHARD_MAP_SOURCE = "jax.experimental.shard_map.shard_map"


def shard_map(f, *, mesh, in_specs, out_specs, check: bool = True):
    """``shard_map(f, mesh=, in_specs=, out_specs=)`` with the checker switch ``check``."""
    return _shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **{_CHECK_KW: check})
