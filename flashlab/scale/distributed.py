"""Attention across devices with JAX's own SPMD machinery: ``shard_map`` and ``ppermute``.

Two ways to split one attention call over a mesh of devices:

* :func:`sharded_attention` -- batch and/or heads. Every (batch, head) pair is independent, so
  each device runs ordinary single-device attention (any backend) on its slice; no
  communication at all. GQA: a device gets whole kv heads together with their query heads.
* :func:`flashlab.scale.ring.ring_attention` -- the sequence: K/V blocks travel around a ring
  of devices and each device merges them into its online-softmax state.

Both take the public layout ``[batch, seq, heads, head_dim]`` (global arrays; jit places them)
and the argument names of ``jax.nn.dot_product_attention`` plus flashlab's extras.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.sharding import PartitionSpec as PS

from flashlab.contract.masks import AttentionSpec, validate
from flashlab.ladder.reference import attention_from_spec as _reference_from_spec
from flashlab.compat.shard_map import shard_map

__all__ = ["sharded_attention", "local_attention", "spec_to_kwargs", "axis_size",
           "check_mesh", "place_all", "check_distinct"]


# ----------------------------------------------------------------------------- backends

def _api():
    """``flashlab.dispatch.api`` when it exists (after the ``api`` branch is merged), else ``None``."""
    try:
        from flashlab.dispatch import api
    except ImportError:
        return None
    return api


def spec_to_kwargs(spec: AttentionSpec) -> dict[str, Any]:
    """The public keyword arguments that rebuild ``spec`` through ``masks.validate``."""
    kw: dict[str, Any] = dict(bias=spec.bias, mask=spec.mask, scale=spec.scale,
                              is_causal=spec.is_causal, query_seq_lengths=spec.q_lengths,
                              key_value_seq_lengths=spec.kv_lengths,
                              local_window_size=spec.window, logits_soft_cap=spec.soft_cap)
    if spec.q_segment_ids is not None:
        kw["segment_ids"] = (spec.q_segment_ids, spec.kv_segment_ids)
    if spec.sinks is not None:
        kw["sinks"] = spec.sinks
    return kw


def local_attention(query, key, value, spec: AttentionSpec, backend: str = "auto"):
    """Single-device attention on validated inputs through the backend registry.

    ``"reference"`` (and ``"auto"`` while ``flashlab.dispatch.api`` is absent) runs
    :func:`flashlab.ladder.reference.attention_from_spec`; any other name is looked up by
    ``flashlab.dispatch.api``.
    """
    if not isinstance(backend, str):
        raise TypeError(f"backend: expected a backend name (str), got {backend!r}")
    if backend == "reference":
        return _reference_from_spec(query, key, value, spec)
    api = _api()
    if api is None:
        if backend == "auto":
            return _reference_from_spec(query, key, value, spec)
        raise ValueError(f"backend: {backend!r} needs flashlab.dispatch.api, which is not available in "
                         f"this installation; use 'auto' or 'reference'")
    if hasattr(api, "attention_from_spec"):
        return api.attention_from_spec(query, key, value, spec, backend=backend)
    return api.attention(query, key, value, backend=backend, **spec_to_kwargs(spec))


# ----------------------------------------------------------------------------- mesh helpers

def axis_size(mesh, axis, arg: str) -> int:
    """Devices along ``axis`` (a name, a tuple of names, or ``None`` -> 1)."""
    if axis is None:
        return 1
    names = axis if isinstance(axis, tuple) else (axis,)
    size = 1
    for a in names:
        if a not in mesh.shape:
            raise ValueError(f"{arg}: {a!r} is not an axis of the mesh; mesh axes are "
                             f"{tuple(mesh.axis_names)}")
        size *= mesh.shape[a]
    return size


def check_mesh(mesh):
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(f"mesh: expected a jax.sharding.Mesh, got {type(mesh).__name__}")


def _is_explicit(mesh) -> bool:
    types = getattr(mesh, "axis_types", None) or ()
    explicit = getattr(getattr(jax.sharding, "AxisType", None), "Explicit", None)
    return explicit is not None and any(t == explicit for t in types)


def _place(x, mesh, spec):
    """Under an explicit-sharding mesh (``jax.make_mesh``'s default in new JAX) shard_map wants
    its inputs already laid out as ``in_specs``: reshard them. Auto meshes need nothing."""
    if x is None or not _is_explicit(mesh):
        return x
    reshard = getattr(jax.sharding, "reshard", None) or jax.reshard
    return reshard(x, jax.sharding.NamedSharding(mesh, spec))


def place_all(args, specs, mesh):
    """``_place`` over matching tuples/dicts of arrays and PartitionSpecs."""
    if isinstance(args, dict):
        return {n: _place(a, mesh, specs[n]) for n, a in args.items()}
    if isinstance(args, (tuple, list)):
        return type(args)(place_all(a, s, mesh) for a, s in zip(args, specs))
    return _place(args, mesh, specs)


def check_distinct(**axes):
    seen = {}
    for arg, axis in axes.items():
        for a in (() if axis is None else axis if isinstance(axis, tuple) else (axis,)):
            if a in seen:
                raise ValueError(f"{arg}: mesh axis {a!r} is already used by {seen[a]}")
            seen[a] = arg


# ----------------------------------------------------------------------------- batch / heads

def sharded_attention(query, key, value, bias=None, mask=None, *, mesh, batch_axis=None,
                      head_axis=None, backend: str = "auto", scale=None, is_causal=False,
                      query_seq_lengths=None, key_value_seq_lengths=None,
                      local_window_size=None, segment_ids=None, logits_soft_cap=None):
    """Batch- and head-parallel attention: ``shard_map`` around a single-device backend.

    Args:
      query: ``[B, T, N, d]`` (a global array).
      key, value: ``[B, S, K, d]`` (global arrays). The masks, bias, lengths and segment ids
        are as in :func:`flashlab.ladder.reference.naive_attention`.
      mesh: a ``jax.sharding.Mesh``.
      batch_axis: mesh axis name (or tuple of names) splitting ``B``; ``None`` = not split.
      head_axis: mesh axis name splitting the heads. Device ``j`` of ``P_h`` gets query heads
        ``j·N/P_h ..`` and the kv heads they read: kv heads are split too when ``K % P_h == 0``
        (each device holds whole GQA groups), otherwise (``P_h % K == 0``, e.g. MQA) K/V are
        replicated and each device picks its one kv head.
      backend: per-device attention (``"auto"``, ``"reference"`` or a registry name).

    Masks, bias, lengths and segment ids are split the same way as the batch/heads they
    belong to (a broadcast dimension of size 1 stays replicated). No communication happens:
    outputs stay sharded like the query. Returns ``[B, T, N, d_v]`` in the query's dtype.
    """
    query, key, value, spec = validate(
        query, key, value, bias, mask, scale=scale, is_causal=is_causal,
        query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
        local_window_size=local_window_size, segment_ids=segment_ids,
        logits_soft_cap=logits_soft_cap)
    check_mesh(mesh)
    check_distinct(batch_axis=batch_axis, head_axis=head_axis)
    if head_axis is not None and not isinstance(head_axis, str):
        raise TypeError(f"head_axis: expected one mesh axis name (str) or None, got {head_axis!r}")
    Pb = axis_size(mesh, batch_axis, "batch_axis")
    Ph = axis_size(mesh, head_axis, "head_axis")
    B, N, K = spec.batch, spec.num_heads, spec.num_kv_heads
    if B % Pb:
        raise ValueError(f"batch_axis: batch {B} (query shape {tuple(query.shape)}) must be a "
                         f"multiple of the {Pb} devices along {batch_axis!r}")
    if N % Ph:
        raise ValueError(f"head_axis: query heads {N} (query shape {tuple(query.shape)}) must be "
                         f"a multiple of the {Ph} devices along {head_axis!r}")
    split_kv = K % Ph == 0
    if not split_kv and Ph % K:
        raise ValueError(f"head_axis: {K} kv heads (key shape {tuple(key.shape)}) and {Ph} "
                         f"devices along {head_axis!r}: need kv heads % devices == 0 or "
                         f"devices % kv heads == 0 so no GQA group is split")
    b, h = batch_axis, head_axis
    qkv_specs = (PS(b, None, h, None), PS(b, None, h if split_kv else None, None))
    arrays, specs = {}, {}
    for name in ("bias", "mask"):
        x = getattr(spec, name)
        if x is not None:
            arrays[name] = x
            specs[name] = PS(b if x.shape[0] == B else None, h if x.shape[1] == N else None)
    for name in ("q_lengths", "kv_lengths", "q_segment_ids", "kv_segment_ids"):
        x = getattr(spec, name)
        if x is not None:
            arrays[name] = x
            specs[name] = PS(b)
    Nl, Kl = N // Ph, (K // Ph if split_kv else 1)

    def per_device(q, k, v, arrs):
        if not split_kv:
            # MQA-like: this device's Nl query heads all read kv head (j·Nl) // G.
            kv_head = (jax.lax.axis_index(h) * Nl) // spec.group_size
            k = jax.lax.dynamic_slice_in_dim(k, kv_head, 1, axis=2)
            v = jax.lax.dynamic_slice_in_dim(v, kv_head, 1, axis=2)
        local = dataclasses.replace(spec, batch=B // Pb, num_heads=Nl, num_kv_heads=Kl, **arrs)
        return local_attention(q, k, v, local, backend)

    in_specs = (qkv_specs[0], qkv_specs[1], qkv_specs[1], specs)
    # check=False: a per-device Pallas kernel's out_shape carries no varying-mesh-axes type, and
    # compiled under the checker Pallas refuses it ("`manual_axis_type` on jax.ShapeDtypeStruct
    # must not be None", found by compiling for a TPU slice). No collective runs in here, so
    # the checker has nothing to verify: every output is per-device by out_specs.
    fn = shard_map(per_device, mesh=mesh, in_specs=in_specs, out_specs=qkv_specs[0], check=False)
    return fn(*place_all((query, key, value, arrays), in_specs, mesh))
