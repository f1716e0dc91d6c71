"""Attention across devices with JAX's own SPMD machinery: ``shard_map`` and ``ppermute``.

Two ways to split one attention call over a mesh of devices:

* :func:`sharded_attention` -- batch and/or heads. Every (batch, head) pair is independent, so
  each device runs ordinary single-device attention (any backend) on its slice; no
  communication at all. GQA: a device gets whole kv heads together with their query heads.
* :func:`ring_attention` -- the sequence. Each device keeps its block of queries; the K/V
  blocks travel around a ring (``jax.lax.ppermute``), and each device folds every block it
  receives into its running online-softmax state with :func:`flashlab.ladder.online_softmax.merge`
  -- the same merge that combines tiles inside a kernel (chapter 02), now combining devices.
  Each block is computed by a backend (``tiled`` or our Pallas kernel), told where the block
  sits in the sequence by the spec's ``q_offset``/``kv_offset``.

Both take the public layout ``[batch, seq, heads, head_dim]`` (global arrays; jit places them)
and the argument names of ``jax.nn.dot_product_attention`` plus flashlab's extras.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as PS

from flashlab.ladder import online_softmax as osm
from flashlab.scale import ring_layout
from flashlab.contract.masks import AttentionSpec, block_maybe_visible, validate
from flashlab.ladder.reference import attention_from_spec as _reference_from_spec
from flashlab.compat.shard_map import shard_map

__all__ = ["sharded_attention", "ring_attention", "ring_block_counts", "local_attention",
           "spec_to_kwargs", "block_functions", "RING_BACKENDS"]


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

def _axis_size(mesh, axis, arg: str) -> int:
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


def _check_mesh(mesh):
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


def _place_all(args, specs, mesh):
    """``_place`` over matching tuples/dicts of arrays and PartitionSpecs."""
    if isinstance(args, dict):
        return {n: _place(a, mesh, specs[n]) for n, a in args.items()}
    if isinstance(args, (tuple, list)):
        return type(args)(_place_all(a, s, mesh) for a, s in zip(args, specs))
    return _place(args, mesh, specs)


def _check_distinct(**axes):
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
    _check_mesh(mesh)
    _check_distinct(batch_axis=batch_axis, head_axis=head_axis)
    if head_axis is not None and not isinstance(head_axis, str):
        raise TypeError(f"head_axis: expected one mesh axis name (str) or None, got {head_axis!r}")
    Pb = _axis_size(mesh, batch_axis, "batch_axis")
    Ph = _axis_size(mesh, head_axis, "head_axis")
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
    return fn(*_place_all((query, key, value, arrays), in_specs, mesh))


# ----------------------------------------------------------------------------- ring: one block

#: Backends a ring step can run: each gives a forward returning ``(out, lse)`` and a backward
#: from a given (global) ``(out, lse)``, and both honour the spec's offsets.
RING_BACKENDS = ("tiled", "pallas_tpu")


def _ring_backend(backend: str) -> str:
    """``"auto"`` -> ``pallas_tpu`` on a TPU, ``tiled`` elsewhere; check a named one."""
    if not isinstance(backend, str):
        raise TypeError(f"backend: expected a backend name (str), got {backend!r}")
    if backend == "auto":
        from flashlab.contract import device
        return "pallas_tpu" if device.platform() == "tpu" else "tiled"
    if backend not in RING_BACKENDS:
        raise NotImplementedError(
            f"backend: ring_attention runs each step's block with a backend that returns "
            f"(out, lse), runs its backward from a given (out, lse) and honours q/kv offsets; "
            f"expected 'auto' or one of {RING_BACKENDS}, got {backend!r}")
    return backend


def block_functions(backend: str, interpret=None):
    """``(forward, backward)`` of one ring step with ``backend`` (``"tiled"``/``"pallas_tpu"``).

    ``forward(q [B, cq, N, d], k, v [B, ck, K, d|d_v], spec) -> (out [B, cq, N, d_v],
    lse [B, N, cq] float32)``; ``backward(q, k, v, spec, out, lse, d_out) -> (dq, dk, dv)``
    float32, where ``out``/``lse`` may be the *global* ones (so the result is this block's
    share of the gradients). ``spec`` carries the blocks' global offsets.
    """
    f32 = lambda *xs: tuple(x.astype(jnp.float32) for x in xs)  # noqa: E731
    if backend == "tiled":
        from flashlab.ladder.tiled import (
            tiled_attention_backward_from_spec, tiled_attention_with_lse_from_spec)
        return (tiled_attention_with_lse_from_spec,
                lambda *a: f32(*tiled_attention_backward_from_spec(*a)[:3]))
    if backend == "pallas_tpu":
        from flashlab.kernels.backward import flash_attention_backward
        from flashlab.kernels.forward import flash_attention_forward
        return (lambda q, k, v, spec: flash_attention_forward(q, k, v, spec,
                                                              interpret=interpret),
                lambda *a: f32(*flash_attention_backward(*a, interpret=interpret)[:3]))
    raise ValueError(f"backend: expected one of {RING_BACKENDS}, got {backend!r}")


# ----------------------------------------------------------------------------- ring: forward

@dataclasses.dataclass(frozen=True)
class _RingConfig:
    axis: str
    P: int                       # devices on the ring
    nc: int                      # chunks per device (1 contiguous, 2 zig-zag)
    cq: int                      # query tokens per chunk
    ck: int                      # key tokens per chunk
    q_starts: tuple              # [P][nc] first global query position of each local chunk
    k_starts: tuple              # [P][nc] same for keys
    scale: float
    soft_cap: float | None
    is_causal: bool
    window: Any
    backend: str = "tiled"       # what computes each (q chunk, kv chunk) block
    interpret: Any = None        # pallas_tpu off-TPU: the interpreter

    def starts(self, which, device):
        table = jnp.asarray(np.asarray(self.q_starts if which == "q" else self.k_starts,
                                       np.int32))
        return table[device]                                   # [nc] int32

    def maybe(self, qs, ks):
        """May (q chunk from ``qs``, kv chunk from ``ks``) have a visible entry? bool or traced."""
        return block_maybe_visible(qs, qs + self.cq, ks, ks + self.ck,
                                   is_causal=self.is_causal, window=self.window)

    def block_spec(self, q, k, v, aux, q_seg, kv_seg, q_start, k_start) -> AttentionSpec:
        """The spec of one block: local shapes, global offsets and lengths, local segment ids."""
        B, cq, N, d = q.shape
        return AttentionSpec(
            batch=B, q_len=cq, kv_len=k.shape[1], num_heads=N, num_kv_heads=k.shape[2],
            head_dim=d, head_dim_v=v.shape[3], dtype=jnp.dtype(q.dtype), scale=self.scale,
            is_causal=self.is_causal, window=self.window, soft_cap=self.soft_cap,
            q_lengths=aux.get("q_len"), kv_lengths=aux.get("kv_len"), q_segment_ids=q_seg,
            kv_segment_ids=kv_seg, q_offset=q_start, kv_offset=k_start)


def _ring_perm(P):
    return [(j, (j + 1) % P) for j in range(P)]                # device j sends to j + 1


def _chunk(x, nc, axis=1):
    """``[B, nc·c, ...]`` -> list of nc arrays ``[B, c, ...]`` (``None`` stays ``None``)."""
    if x is None:
        return [None] * nc
    c = x.shape[axis] // nc
    return [jax.lax.slice_in_dim(x, a * c, (a + 1) * c, axis=axis) for a in range(nc)]


def _zigzag(x, axis: str, P: int, inverse: bool = False):
    """Inside ``shard_map``: a device's contiguous shard ``[B, 2c, ...]`` (natural chunks
    ``2i, 2i+1``) -> its zig-zag chunks ``i, 2P-1-i``, by two ``ppermute`` s
    (:func:`flashlab.scale.ring_layout.zigzag_sends`); ``inverse`` deals them back. ``None`` stays."""
    if x is None:
        return None
    even, odd = ring_layout.zigzag_sends(P)
    first_is_even = jax.lax.axis_index(axis) % 2 == 0
    a, b = _chunk(x, 2)
    if not inverse:                               # a = chunk 2i, b = chunk 2i+1
        e, o = jax.lax.ppermute(a, axis, even), jax.lax.ppermute(b, axis, odd)
        return jnp.where(first_is_even, jnp.concatenate([e, o], 1), jnp.concatenate([o, e], 1))
    e = jnp.where(first_is_even, a, b)            # this device's even and odd chunks
    o = jnp.where(first_is_even, b, a)
    flip = lambda pairs: [(d, s) for s, d in pairs]  # noqa: E731
    return jnp.concatenate([jax.lax.ppermute(e, axis, flip(even)),
                            jax.lax.ppermute(o, axis, flip(odd))], 1)


def _ring_loop(step, carry, P):
    """Steps ``0 .. P-2`` in a ``fori_loop`` (each sends), then the last one without a send."""
    carry = jax.lax.fori_loop(0, P - 1, lambda s, c: step(s, c, True), carry)
    return step(P - 1, carry, False)


def _ring_forward(q, k, v, aux, cfg: _RingConfig):
    """One device's forward ring. ``q [B, Cq, N, d]``, ``k, v [B, Ck, K, d]`` (layout order).

    Returns ``out [B, Cq, N, d_v]`` float32, ``lse [B, N, Cq]`` and the number of
    (q chunk, kv chunk) blocks this device actually computed.
    """
    idx = jax.lax.axis_index(cfg.axis)
    block_fwd, _ = block_functions(cfg.backend, cfg.interpret)
    B, N, dv = q.shape[0], q.shape[2], v.shape[-1]
    q_chunks, q_segs = _chunk(q, cfg.nc), _chunk(aux.get("q_seg"), cfg.nc)
    q_starts = cfg.starts("q", idx)
    states = [osm.init((B, N, cfg.cq), dv) for _ in range(cfg.nc)]
    kv = {"k": k, "v": v, "kv_seg": aux.get("kv_seg")}

    def step(s, carry, send):
        kv, states, work = carry
        # Issue the send of the block we hold *before* computing on it: the transfer to the
        # next device and this step's compute are independent, so they overlap.
        kv_next = jax.lax.ppermute(kv, cfg.axis, _ring_perm(cfg.P)) if send else kv
        k_starts = cfg.starts("k", (idx - s) % cfg.P)          # whose K/V block we hold now
        k_chunks, v_chunks = _chunk(kv["k"], cfg.nc), _chunk(kv["v"], cfg.nc)
        kv_segs = _chunk(kv["kv_seg"], cfg.nc)
        states = list(states)
        for b in range(cfg.nc):
            for a in range(cfg.nc):
                def compute(st, work, a=a, b=b):
                    spec = cfg.block_spec(q_chunks[a], k_chunks[b], v_chunks[b], aux, q_segs[a],
                                          kv_segs[b], q_starts[a], k_starts[b])
                    out, lse = block_fwd(q_chunks[a], k_chunks[b], v_chunks[b], spec)
                    return osm.merge(st, osm.from_output(out, lse)), work + 1  # chapter 02

                maybe = cfg.maybe(q_starts[a], k_starts[b])
                if maybe is True:
                    states[a], work = compute(states[a], work)
                else:                                          # skip blocks ruled out
                    states[a], work = jax.lax.cond(maybe, compute, lambda st, w: (st, w),
                                                   states[a], work)
        return kv_next, states, work

    _, states, work = _ring_loop(step, (kv, states, jnp.zeros((), jnp.int32)), cfg.P)
    outs, lses = zip(*(osm.finalize(st) for st in states))
    out = jnp.concatenate(outs, axis=2)                        # [B, N, Cq, d_v]
    lse = jnp.concatenate(lses, axis=2)                        # [B, N, Cq]
    return jnp.swapaxes(out, 1, 2), lse, work


# ----------------------------------------------------------------------------- ring: backward

def _ring_backward(q, k, v, aux, out, lse, dout, cfg: _RingConfig):
    """One device's backward ring (FlashAttention-2 style, P recomputed from the global lse).

    Each step runs the backend's backward on (local queries, held block) with the *global*
    ``out`` and ``lse``, which yields exactly this block's share of dQ, dK, dV. dQ stays
    home; the dK/dV accumulators travel around the ring with their K/V block and, after ``P``
    hops, arrive back at the device that owns the block. Like the K/V, they are sent as soon
    as they are complete: this step's contribution is computed into fresh zeros, so the
    accumulator arriving from the previous device is needed only for the final add.
    """
    idx = jax.lax.axis_index(cfg.axis)
    _, block_bwd = block_functions(cfg.backend, cfg.interpret)
    f32 = jnp.float32
    q_chunks, q_segs = _chunk(q, cfg.nc), _chunk(aux.get("q_seg"), cfg.nc)
    o_chunks, do_chunks = _chunk(out, cfg.nc), _chunk(dout, cfg.nc)
    l_chunks = _chunk(lse, cfg.nc, axis=2)
    q_starts = cfg.starts("q", idx)
    perm = _ring_perm(cfg.P)
    kv = {"k": k, "v": v, "kv_seg": aux.get("kv_seg")}
    grads = {"dk": jnp.zeros(k.shape, f32), "dv": jnp.zeros(v.shape, f32)}
    dq = [jnp.zeros(c.shape, f32) for c in q_chunks]

    def step(s, carry, send):
        kv, grads_in, dq = carry
        kv_next = jax.lax.ppermute(kv, cfg.axis, perm) if send else kv
        k_starts = cfg.starts("k", (idx - s) % cfg.P)
        k_chunks, v_chunks = _chunk(kv["k"], cfg.nc), _chunk(kv["v"], cfg.nc)
        kv_segs = _chunk(kv["kv_seg"], cfg.nc)
        dk = [jnp.zeros(c.shape, f32) for c in k_chunks]
        dv = [jnp.zeros(c.shape, f32) for c in v_chunks]
        dq = list(dq)
        for b in range(cfg.nc):
            for a in range(cfg.nc):
                def compute(acc, a=a, b=b):
                    spec = cfg.block_spec(q_chunks[a], k_chunks[b], v_chunks[b], aux, q_segs[a],
                                          kv_segs[b], q_starts[a], k_starts[b])
                    g = block_bwd(q_chunks[a], k_chunks[b], v_chunks[b], spec, o_chunks[a],
                                  l_chunks[a], do_chunks[a])
                    return tuple(x + y for x, y in zip(acc, g))

                acc = (dq[a], dk[b], dv[b])
                maybe = cfg.maybe(q_starts[a], k_starts[b])
                acc = compute(acc) if maybe is True else jax.lax.cond(maybe, compute,
                                                                       lambda x: x, acc)
                dq[a], dk[b], dv[b] = acc
        mine = {"dk": jnp.concatenate(dk, axis=1), "dv": jnp.concatenate(dv, axis=1)}
        # The accumulators follow their block: after the last step one more hop brings
        # them home (the K/V themselves need not travel again).
        grads = jax.lax.ppermute(jax.tree_util.tree_map(jnp.add, grads_in, mine), cfg.axis, perm)
        return kv_next, grads, dq

    _, grads, dq = _ring_loop(step, (kv, grads, dq), cfg.P)
    dq = jnp.concatenate(dq, axis=1)
    return dq.astype(q.dtype), grads["dk"].astype(k.dtype), grads["dv"].astype(v.dtype)


def _ring_core(cfg: _RingConfig):
    """The per-device ring with a custom VJP: ``(q, k, v, aux) -> out``."""

    @jax.custom_vjp
    def core(q, k, v, aux):
        return _ring_forward(q, k, v, aux, cfg)[0].astype(q.dtype)

    def fwd(q, k, v, aux):
        out, lse, _ = _ring_forward(q, k, v, aux, cfg)
        out = out.astype(q.dtype)
        # Residuals: inputs, O and lse -- O(N/P) per device, never an (N/P)² block of P.
        return out, (q, k, v, aux, out, lse)

    def bwd(res, dout):
        q, k, v, aux, out, lse = res
        dq, dk, dv = _ring_backward(q, k, v, aux, out, lse, dout, cfg)
        return dq, dk, dv, None                                # integer aux: no cotangent

    core.defvjp(fwd, bwd)
    return core


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
    backend = _ring_backend(backend)
    _check_mesh(mesh)
    if not isinstance(axis_name, str):
        raise TypeError(f"axis_name: expected one mesh axis name (str), got {axis_name!r}")
    if head_axis is not None and not isinstance(head_axis, str):
        raise TypeError(f"head_axis: expected one mesh axis name (str) or None, got {head_axis!r}")
    _check_distinct(axis_name=axis_name, batch_axis=batch_axis, head_axis=head_axis)
    P = _axis_size(mesh, axis_name, "axis_name")
    Pb = _axis_size(mesh, batch_axis, "batch_axis")
    Ph = _axis_size(mesh, head_axis, "head_axis")
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
    cfg = _RingConfig(
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
def _ring_program(cfg: _RingConfig, mesh, layout: str, batch_axis, head_axis,
                  aux_keys: tuple, count_blocks: bool = False):
    """A jitted ``(q, k, v, aux) -> out`` (or block counts): one ``shard_map`` that deals each
    device's contiguous shard into the layout (:func:`_zigzag`), runs the per-device ring and
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
        z = functools.partial(_zigzag, axis=cfg.axis, P=cfg.P, inverse=inverse)
        a = {n: (z(x) if n.endswith("seg") else x) for n, x in a.items()}
        return z(q), z(k), z(v), a

    def run(query, key, value, aux):
        args = _place_all((query, key, value, dict(aux)), in_specs, mesh)
        if count_blocks:
            def count(q, k, v, a):
                return _ring_forward(*deal(q, k, v, a), cfg)[2][None]
            return shard_map(count, mesh=mesh, in_specs=in_specs, out_specs=PS(cfg.axis),
                             check=False)(*args)
        core = _ring_core(cfg)

        def ring(q, k, v, a):
            out = core(*deal(q, k, v, a))
            return _zigzag(out, cfg.axis, cfg.P, inverse=True) if zigzag else out
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
