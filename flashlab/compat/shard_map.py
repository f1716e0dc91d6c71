"""One import of ``shard_map`` for every supported JAX.

JAX >= 0.7 exposes ``jax.shard_map`` with ``check_vma`` (varying-manual-axes type checking);
older releases had ``jax.experimental.shard_map.shard_map`` with ``check_rep``. Callers use
:func:`shard_map` below with ``check=`` and never touch either spelling.
"""
from __future__ import annotations

import jax

__all__ = ["shard_map", "SHARD_MAP_SOURCE", "vma_of", "pvary", "shape_dtype", "in_manual_mesh"]

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


# ----------------------------------------------------------------------------- varying manual axes
#
# Inside ``shard_map(..., check_vma=True)`` every value carries the set of mesh axes it varies
# over (its "vma"). A loop carry must keep its type, and a ``pallas_call`` must be told the vma
# of its outputs, so code that builds constants (a loop's initial state, an ``out_shape``)
# gives them the vma of the data they will be combined with. Outside ``shard_map`` every vma
# is empty and these helpers are the identity. The spelling moved between releases
# (``aval.vma`` -> ``aval.manual_axis_type.varying``, ``lax.pvary`` -> ``lax.pcast``,
# ``ShapeDtypeStruct(vma=)`` -> ``ShapeDtypeStruct(manual_axis_type=)``); it is resolved here.

def vma_of(*trees) -> frozenset:
    """The mesh axes any array leaf of ``trees`` varies over (empty outside ``shard_map``)."""
    axes = frozenset()
    for x in jax.tree_util.tree_leaves(trees):
        try:
            aval = jax.typeof(x)
        except TypeError:
            continue
        mat = getattr(aval, "manual_axis_type", None)
        axes |= frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))
    return axes


def pvary(tree, axes):
    """Mark every array leaf of ``tree`` as varying over ``axes`` (those it does not yet)."""
    axes = frozenset(axes)
    if not axes:
        return tree

    def one(x):
        missing = tuple(sorted(axes - vma_of(x)))
        if not missing:
            return x
        if hasattr(jax.lax, "pcast"):
            return jax.lax.pcast(x, missing, to="varying")
        return jax.lax.pvary(x, missing)  # pragma: no cover - older JAX
    return jax.tree_util.tree_map(one, tree)


def shape_dtype(shape, dtype, axes=frozenset()) -> jax.ShapeDtypeStruct:
    """``jax.ShapeDtypeStruct(shape, dtype)`` varying over the manual mesh axes ``axes``."""
    if not axes:
        return jax.ShapeDtypeStruct(shape, dtype)
    try:
        from jax.sharding import ManualAxisType
        return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=ManualAxisType(varying=axes))
    except ImportError:  # pragma: no cover - older JAX
        return jax.ShapeDtypeStruct(shape, dtype, vma=frozenset(axes))


def in_manual_mesh() -> bool:
    """True while tracing inside ``shard_map`` (some mesh axis is manual), checked or not."""
    get = getattr(jax.sharding, "get_abstract_mesh", None)
    if get is None:  # pragma: no cover - older JAX
        return False
    mesh = get()
    return bool(getattr(mesh, "manual_axes", ()) or getattr(mesh, "_any_axis_manual", False))
