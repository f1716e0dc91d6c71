"""Ring attention over the sequence axis of a mesh (chapter 10).

Each device keeps its block of queries; the K/V blocks travel around a ring
(``jax.lax.ppermute``, the next block's send issued before the current block's compute), and
each device folds every block it receives into its running online-softmax state with
:func:`flashlab.ladder.online_softmax.merge`, the same merge that combines tiles inside a
kernel (chapter 02), now combining devices. Each block is computed by a backend (``tiled`` or
the Pallas kernel), told where it sits in the sequence by the spec's ``q_offset``/``kv_offset``.
The zig-zag layout (:mod:`flashlab.scale.ring_layout`) balances causal work across devices.
"""
from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import PartitionSpec as PS

from flashlab.scale import ring_layout
from flashlab.contract.masks import validate
from flashlab.compat.shard_map import shard_map
from flashlab.scale.distributed import (
    axis_size, check_distinct, check_mesh, place_all)
from flashlab.scale.ring_steps import (
    RING_BACKENDS, RingConfig, block_functions, ring_backend, ring_core, ring_forward,
    zigzag_deal)
__all__ = ["RING_BACKENDS", "block_functions", "ring_attention", "ring_block_counts"]


# ----------------------------------------------------------------------------- ring: entry

def _ring_config(query, key, value, bias, mask, *, mesh, axis_name, layout, batch_axis,
                 head_axis, backend, interpret=None, **mask_kw):
    """Validate once (``masks.validate``) and check the mesh; return ``(q, k, v, spec, cfg)``."""
    query, key, value, spec = validate(query, key, value, bias, mask, **mask_kw)
    if spec.bias is not None or spec.mask is not None:
        which = "bias" if spec.bias is not None else "mask"
        raise ValueError(f"{which}: ring_attention takes no dense [batch, heads, q_seq, kv_seq] "
                         f"{which} (it would be O(N²) on every device); express the pattern with "
                         f"is_causal, local_window_size, segment_ids or sequence lengths, or "
                         f"use sharded_attention")
    backend = ring_backend(backend)
    check_mesh(mesh)
    if not isinstance(axis_name, str):
        raise TypeError(f"axis_name: expected one mesh axis name (str), got {axis_name!r}")
    if head_axis is not None and not isinstance(head_axis, str):
        raise TypeError(f"head_axis: expected one mesh axis name (str) or None, got {head_axis!r}")
    check_distinct(axis_name=axis_name, batch_axis=batch_axis, head_axis=head_axis)
    P = axis_size(mesh, axis_name, "axis_name")
    Pb = axis_size(mesh, batch_axis, "batch_axis")
    Ph = axis_size(mesh, head_axis, "head_axis")
    if layout not in ring_layout.LAYOUTS:
        raise ValueError(f"layout: expected one of {ring_layout.LAYOUTS}, got {layout!r}")
    nc = ring_layout.chunks_per_device(layout)
    for name, x in (("query", query), ("key", key)):
        if x.shape[1] % (P * nc):
            raise ValueError(f"{name}: sequence length {x.shape[1]} (shape {tuple(x.shape)}) must "
                             f"be a multiple of {P * nc} ({P} devices along {axis_name!r} x {nc} "
                             f"chunks per device, layout={layout!r})")
    if spec.batch % Pb:
        raise ValueError(f"batch_axis: batch {spec.batch} must be a multiple of {Pb} devices")
    if spec.num_kv_heads % Ph:
        raise ValueError(f"head_axis: kv heads {spec.num_kv_heads} (key shape {tuple(key.shape)}) "
                         f"must be a multiple of the {Ph} devices along {head_axis!r}")
    T, S = spec.q_len, spec.kv_len
    cfg = RingConfig(
        axis=axis_name, P=P, nc=nc, cq=T // (P * nc), ck=S // (P * nc),
        q_starts=tuple(map(tuple, ring_layout.chunk_starts(T, P, layout).tolist())),
        k_starts=tuple(map(tuple, ring_layout.chunk_starts(S, P, layout).tolist())),
        scale=spec.scale, soft_cap=spec.soft_cap, is_causal=spec.is_causal, window=spec.window,
        backend=backend, interpret=_interpret(backend, interpret))
    return query, key, value, spec, cfg


def _interpret(backend, interpret):
    if backend != "pallas_tpu":
        return None
    from flashlab.contract import device
    return device.interpret_mode(interpret)


def _aux_of(spec):
    """The ring's integer side inputs (natural order): lengths and segment ids."""
    aux = {"q_len": spec.q_lengths, "kv_len": spec.kv_lengths,
           "q_seg": spec.q_segment_ids, "kv_seg": spec.kv_segment_ids}
    return {n: a for n, a in aux.items() if a is not None}


@functools.lru_cache(maxsize=64)
def _ring_program(cfg: RingConfig, mesh, layout: str, batch_axis, head_axis,
                  aux_keys: tuple, count_blocks: bool = False):
    """A jitted ``(q, k, v, aux) -> out`` (or block counts): one ``shard_map`` that deals each
    device's contiguous shard into the layout (:func:`zigzag_deal`), runs the per-device ring and
    deals the output back. Cached per configuration."""
    x_spec = PS(batch_axis, cfg.axis, head_axis, None)
    s_spec = PS(batch_axis, cfg.axis)
    aux_specs = {n: (PS(batch_axis) if n.endswith("len") else s_spec) for n in aux_keys}
    in_specs = (x_spec, x_spec, x_spec, aux_specs)

    zigzag = layout == "zigzag"

    def deal(q, k, v, a, inverse=False):
        # Natural order -> layout order on the devices themselves (two ppermutes per array):
        # per-device memory stays O(N/P), where a global gather would be O(N).
        if not zigzag:
            return q, k, v, a
        z = functools.partial(zigzag_deal, axis=cfg.axis, P=cfg.P, inverse=inverse)
        a = {n: (z(x) if n.endswith("seg") else x) for n, x in a.items()}
        return z(q), z(k), z(v), a

    def run(query, key, value, aux):
        args = place_all((query, key, value, dict(aux)), in_specs, mesh)
        if count_blocks:
            def count(q, k, v, a):
                return ring_forward(*deal(q, k, v, a), cfg)[2][None]
            return shard_map(count, mesh=mesh, in_specs=in_specs, out_specs=PS(cfg.axis),
                             check=False)(*args)
        core = ring_core(cfg)

        def ring(q, k, v, a):
            out = core(*deal(q, k, v, a))
            return zigzag_deal(out, cfg.axis, cfg.P, inverse=True) if zigzag else out
        return shard_map(ring, mesh=mesh, in_specs=in_specs, out_specs=x_spec,
                         check=False)(*args)

    return jax.jit(run)


def ring_attention(query, key, value, bias=None, mask=None, *, mesh, axis_name: str,
                   layout: str = "zigzag", batch_axis=None, head_axis=None,
                   backend: str = "auto", scale=None, is_causal=False, query_seq_lengths=None,
                   key_value_seq_lengths=None, local_window_size=None, segment_ids=None,
                   logits_soft_cap=None, interpret=None):
    """Sequence-parallel (ring) attention over the mesh axis ``axis_name``.

    Args:
      query: ``[B, T, N, d]``, a global array in natural token order.
      key, value: ``[B, S, K, d]``, global arrays in natural token order. ``T`` and ``S`` must
        be multiples of ``P`` (contiguous) or ``2P`` (zig-zag), with
        ``P = mesh.shape[axis_name]``.
      mesh, axis_name: the ring runs over this mesh axis.
      layout: ``"zigzag"`` (default; device ``i`` holds sequence chunks ``i`` and ``2P-1-i`` so
        causal work is balanced) or ``"contiguous"``. The permutation into the layout (and
        back) runs on the devices as two ``ppermute`` s per array, so per-device memory stays
        ``O(N/P)``.
      batch_axis, head_axis: optional further mesh axes splitting batch / kv heads.
      backend: what computes each step's block: ``"tiled"``, ``"pallas_tpu"`` (our kernel;
        the Pallas interpreter off-TPU), or ``"auto"`` (``pallas_tpu`` on a TPU, else
        ``tiled``). The block's global positions reach the backend as the spec's
        ``q_offset``/``kv_offset``; other backends raise ``NotImplementedError``.
      interpret: for ``pallas_tpu``, as in :func:`flashlab.attention`.
      is_causal, local_window_size, query_seq_lengths, key_value_seq_lengths: as
        :func:`flashlab.ladder.reference.naive_attention`.
      segment_ids, scale, logits_soft_cap: as :func:`flashlab.ladder.reference.naive_attention`.
        Dense ``bias``/``mask`` are rejected (O(N²) per device).

    Each of the ``P`` steps: send the held K/V block to the next device (``ppermute``, issued
    before the compute so the two overlap), run the backend on (local queries, held block)
    unless ``block_maybe_visible`` rules it out, and ``online_softmax.merge`` its
    ``(out, lse)`` into the running state. Differentiable: a custom VJP runs a second ring
    that runs the backend's backward from the global ``(O, lse)`` and carries dK/dV around
    with K/V.
    Returns ``[B, T, N, d_v]`` in the query's dtype, natural order.
    """
    query, key, value, spec, cfg = _ring_config(
        query, key, value, bias, mask, mesh=mesh, axis_name=axis_name, layout=layout,
        batch_axis=batch_axis, head_axis=head_axis, backend=backend, scale=scale,
        is_causal=is_causal, query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths, local_window_size=local_window_size,
        segment_ids=segment_ids, logits_soft_cap=logits_soft_cap, interpret=interpret)
    aux = _aux_of(spec)
    run = _ring_program(cfg, mesh, layout, batch_axis, head_axis, tuple(sorted(aux)))
    return run(query, key, value, aux)


def ring_block_counts(query, key, value, *, mesh, axis_name: str, layout: str = "zigzag",
                      backend: str = "auto", **mask_kw) -> np.ndarray:
    """``[P]`` int: (q chunk, kv chunk) blocks each device of the ring *actually computed*
    in a forward pass (the ``lax.cond`` skips counted out). For checking load balance."""
    query, key, value, spec, cfg = _ring_config(
        query, key, value, None, None, mesh=mesh, axis_name=axis_name, layout=layout,
        batch_axis=None, head_axis=None, backend=backend, **mask_kw)
    aux = _aux_of(spec)
    run = _ring_program(cfg, mesh, layout, None, None, tuple(sorted(aux)), count_blocks=True)
    counts = run(query, key, value, aux)
    if not counts.is_fully_addressable:              # several processes: gather to each host
        from jax.experimental import multihost_utils  # noqa: PLC0415
        counts = multihost_utils.process_allgather(counts, tiled=True)
    return np.asarray(counts)
