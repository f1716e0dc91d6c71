"""One device's ring loops (chapter 10): forward and backward, inside ``shard_map``.

:func:`ring_forward` passes K/V around the ring, issuing the next block's ``ppermute`` before
computing the current one, and merges each block's ``(out, lse)`` with
:func:`flashlab.ladder.online_softmax.merge`; :func:`ring_backward` carries dK/dV around one
step behind them (software-pipelined: every send issued before the step's compute).
:mod:`flashlab.scale.ring` builds the configuration and the ``shard_map`` program.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flashlab.ladder import online_softmax as osm
from flashlab.scale import ring_layout
from flashlab.contract.masks import AttentionSpec, block_maybe_visible


# ----------------------------------------------------------------------------- ring: one block

#: Backends a ring step can run: each gives a forward returning ``(out, lse)`` and a backward
#: from a given (global) ``(out, lse)``, and both honour the spec's offsets.
RING_BACKENDS = ("tiled", "pallas_tpu")


def ring_backend(backend: str) -> str:
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
class RingConfig:
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


def zigzag_deal(x, axis: str, P: int, inverse: bool = False):
    """Inside ``shard_map``: a device's contiguous shard ``[B, 2c, ...]`` (natural chunks
    ``2i, 2i+1``) -> its zig-zag chunks ``i, 2P-1-i``, by two ``ppermute`` s
    (:func:`flashlab.scale.ring_layout.zigzag_sends`); ``inverse`` deals them back. ``None``
    stays."""
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


def ring_forward(q, k, v, aux, cfg: RingConfig):
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

def ring_backward(q, k, v, aux, out, lse, dout, cfg: RingConfig):
    """One device's backward ring (FlashAttention-2 style, P recomputed from the global lse).

    Each step runs the backend's backward on (local queries, held block) with the *global*
    ``out`` and ``lse``, which yields exactly this block's share of dQ, dK, dV. dQ stays
    home; the dK/dV accumulators travel around the ring one step behind their K/V block.

    Software-pipelined so that every send is issued before the step's compute and consumed
    only after it. At step ``s`` device ``i`` holds block ``i - s``; it issues

    * the ``ppermute`` of that K/V block (to ``i + 1``, for step ``s + 1``), and
    * the ``ppermute`` of the accumulator it finished at step ``s - 1`` (block ``i - s + 1``,
      which ``i + 1`` holds at step ``s``) -- so the one it *receives* is, from ``i - 1``,
      the accumulator of the very block ``i`` holds now;

    then computes this step's contribution into fresh zeros and only then adds the received
    accumulator. After step ``P - 1`` device ``i`` holds the finished accumulator of block
    ``i + 1``; one last hop brings it home. Same sends as the unpipelined ring (``P - 1``
    K/V hops and ``P`` accumulator hops), none of them waiting on this step's compute.
    """
    idx = jax.lax.axis_index(cfg.axis)
    _, block_bwd = block_functions(cfg.backend, cfg.interpret)
    f32 = jnp.float32
    q_chunks, q_segs = _chunk(q, cfg.nc), _chunk(aux.get("q_seg"), cfg.nc)
    o_chunks, do_chunks = _chunk(out, cfg.nc), _chunk(dout, cfg.nc)
    l_chunks = _chunk(lse, cfg.nc, axis=2)
    q_starts = cfg.starts("q", idx)
    perm = _ring_perm(cfg.P)
    send = lambda x: jax.lax.ppermute(x, cfg.axis, perm)  # noqa: E731

    def contribution(s, kv, dq):
        """This step's share: ``dq`` (home) plus fresh ``{dk, dv}`` of the held block."""
        k_starts = cfg.starts("k", (idx - s) % cfg.P)          # whose K/V block we hold now
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
        return dq, {"dk": jnp.concatenate(dk, axis=1), "dv": jnp.concatenate(dv, axis=1)}

    def step(s, carry, send_kv, send_acc):
        kv, acc, dq = carry
        # Both sends first: neither depends on this step's compute.
        kv_next = send(kv) if send_kv else kv                  # K/V for step s + 1
        acc_in = send(acc) if send_acc else None               # dK/dV of the block held now
        dq, mine = contribution(s, kv, dq)
        acc = mine if acc_in is None else jax.tree_util.tree_map(jnp.add, acc_in, mine)
        return kv_next, acc, dq

    kv = {"k": k, "v": v, "kv_seg": aux.get("kv_seg")}
    dq = [jnp.zeros(c.shape, f32) for c in q_chunks]
    P = cfg.P
    carry = step(0, (kv, None, dq), P > 1, False)              # prologue: no accumulator yet
    if P > 1:
        carry = jax.lax.fori_loop(1, P - 1, lambda s, c: step(s, c, True, True), carry)
        carry = step(P - 1, carry, False, True)                # epilogue: K/V need not move
    _, acc, dq = carry
    grads = send(acc) if P > 1 else acc                        # block i + 1's dK/dV: home
    dq = jnp.concatenate(dq, axis=1)
    return dq.astype(q.dtype), grads["dk"].astype(k.dtype), grads["dv"].astype(v.dtype)


def ring_core(cfg: RingConfig):
    """The per-device ring with a custom VJP: ``(q, k, v, aux) -> out``."""

    @jax.custom_vjp
    def core(q, k, v, aux):
        return ring_forward(q, k, v, aux, cfg)[0].astype(q.dtype)

    def fwd(q, k, v, aux):
        out, lse, _ = ring_forward(q, k, v, aux, cfg)
        out = out.astype(q.dtype)
        # Residuals: inputs, O and lse -- O(N/P) per device, never an (N/P)² block of P.
        return out, (q, k, v, aux, out, lse)

    def bwd(res, dout):
        q, k, v, aux, out, lse = res
        dq, dk, dv = ring_backward(q, k, v, aux, out, lse, dout, cfg)
        return dq, dk, dv, None                                # integer aux: no cotangent

    core.defvjp(fwd, bwd)
    return core
