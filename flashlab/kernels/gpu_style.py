"""A GPU-shaped FlashAttention forward in Pallas: the port chapter 08 warns about.

This is how a Triton kernel reads when translated line by line into ``pl.pallas_call``:

* one program per ``(batch, head, query block)``, 64x64 tiles (a warp-friendly size), the
  public layout ``[batch, seq, heads, head_dim]`` indexed in place (``head_dim = 64`` last);
* no TPU memory spaces, no scalar prefetch, no ``dimension_semantics``: the whole K/V row of
  one head is handed to the program and the kernel walks it with a ``fori_loop`` and
  ``pl.ds`` slices -- on a GPU those are loads from global memory into shared memory
  (``tl.load``); warps reduce the row max and row sum.

The online softmax maps unchanged (it is :func:`flashlab.ladder.online_softmax.update`, as in every
rung). What does not map to a TPU: a ``(1, 64)`` block over ``[seq, heads]`` breaks the
``(8, 128)`` tiling rule, 64-wide tiles half-fill a 128x128 (v5e: 4x 128x128) MXU, the whole
K/V row must fit VMEM (there is no "global memory pointer" inside a TPU kernel: BlockSpecs are
what move data, pipelined by Pallas, where a GPU kernel issues async copies itself), and warps
and shared memory have no TPU counterpart. It runs with ``interpret=True`` anywhere; chapter
08 lowers it for TPU to show the error, then runs :func:`gpu_style_attention_relaid`, the same
kernel relaid to ``[batch, heads, seq, head_dim]`` which lowers.

Teaching code: float32/bfloat16, no masks except ``is_causal``, ``T % block_q == 0`` and
``S % block_k == 0``. Use :func:`flashlab.kernels.flash_attention` for real work.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from flashlab.ladder import online_softmax
from flashlab.compat.pallas import pl

__all__ = ["gpu_style_attention", "gpu_style_attention_relaid", "tpu_lowering_error", "gpu_style_vmem_bytes", "GPU_BLOCK"]

GPU_BLOCK = 64    # a typical Triton tile: 64 rows x 64 keys, 4 warps


def _kernel(q_ref, k_ref, v_ref, o_ref, *, block_k, kv_len, scale, is_causal, block_q, q_axis):
    # q_ref [block_q, d]; k_ref, v_ref [S, d] (the whole row of this head); o_ref [block_q, d]
    i = pl.program_id(q_axis)
    q = q_ref[...].astype(jnp.float32) * scale
    state = online_softmax.init((q.shape[0],), v_ref.shape[-1])

    def body(j, state):
        # "tl.load(K_ptr + offsets)": stage one [block_k, d] tile (shared memory on a GPU).
        k = k_ref[pl.ds(j * block_k, block_k), :].astype(jnp.float32)
        v = v_ref[pl.ds(j * block_k, block_k), :]
        s = jnp.dot(q, k.T, preferred_element_type=jnp.float32)        # [block_q, block_k]
        visible = None
        if is_causal:
            rows = i * block_q + jax.lax.broadcasted_iota(jnp.int32, s.shape, 0)
            cols = j * block_k + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
            visible = cols <= rows
        return online_softmax.update(state, s, v.astype(jnp.float32), visible)

    state = jax.lax.fori_loop(0, kv_len // block_k, body, state)
    out, _ = online_softmax.finalize(state)
    o_ref[...] = out.astype(o_ref.dtype)


def _check(query, key, block_q, block_k):
    T, S = query.shape[1], key.shape[1]
    if T % block_q or S % block_k:
        raise ValueError(f"block_q, block_k: expected divisors of the sequence lengths "
                         f"(T={T}, S={S}), got ({block_q}, {block_k})")
    if key.shape[2] != query.shape[2]:
        raise ValueError("key: the GPU-style teaching kernel has no GQA; expected "
                         f"{query.shape[2]} heads, got {key.shape[2]}")


@functools.partial(jax.jit, static_argnames=("block_q", "block_k", "is_causal", "interpret"))
def gpu_style_attention(query, key, value, *, block_q: int = GPU_BLOCK,
                        block_k: int = GPU_BLOCK, is_causal: bool = False, interpret=True):
    """Attention with the literal GPU port: blocks ``(1, block_q, 1, d)`` of ``[B, T, N, d]``.

    query [B, T, N, d], key/value [B, S, N, d] -> [B, T, N, d]. On TPU this fails to lower:
    the block's last two dims ``(1, d)`` are ``(heads, head_dim)``, and a squeezed head of a
    ``N``-head axis is neither a multiple of 8 nor the whole axis.
    """
    _check(query, key, block_q, block_k)
    B, T, N, d = query.shape
    S = key.shape[1]
    kern = functools.partial(_kernel, block_k=block_k, kv_len=S, scale=1 / math.sqrt(d),
                             is_causal=is_causal, block_q=block_q, q_axis=2)
    q_spec = pl.BlockSpec((None, block_q, None, d), lambda b, h, i: (b, i, h, 0))
    kv_spec = pl.BlockSpec((None, S, None, d), lambda b, h, i: (b, 0, h, 0))
    return pl.pallas_call(kern, out_shape=jax.ShapeDtypeStruct(query.shape, query.dtype),
                          grid=(B, N, T // block_q), in_specs=[q_spec, kv_spec, kv_spec],
                          out_specs=q_spec, interpret=interpret)(query, key, value)


@functools.partial(jax.jit, static_argnames=("block_q", "block_k", "is_causal", "interpret"))
def gpu_style_attention_relaid(query, key, value, *, block_q: int = GPU_BLOCK,
                               block_k: int = GPU_BLOCK, is_causal: bool = False,
                               interpret=True):
    """The same kernel after the relayout ``[B, T, N, d] -> [B, N, T, d]``.

    Blocks are now ``(block_q, d)`` and ``(S, d)`` over ``[seq, head_dim]``: 64 is a multiple
    of 8 and ``d`` is the whole axis, so the tiling rule holds and Mosaic lowers it (``d = 64``
    still fills half of each 128-lane vreg: :mod:`flashlab.kernels.forward` pads to 128).
    """
    _check(query, key, block_q, block_k)
    B, T, N, d = query.shape
    S = key.shape[1]
    q, k, v = (jnp.swapaxes(x, 1, 2) for x in (query, key, value))      # [B, N, T, d]
    kern = functools.partial(_kernel, block_k=block_k, kv_len=S, scale=1 / math.sqrt(d),
                             is_causal=is_causal, block_q=block_q, q_axis=2)
    q_spec = pl.BlockSpec((None, None, block_q, d), lambda b, h, i: (b, h, i, 0))
    kv_spec = pl.BlockSpec((None, None, S, d), lambda b, h, i: (b, h, 0, 0))
    out = pl.pallas_call(kern, out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
                         grid=(B, N, T // block_q), in_specs=[q_spec, kv_spec, kv_spec],
                         out_specs=q_spec, interpret=interpret)(q, k, v)
    return jnp.swapaxes(out, 1, 2)


def tpu_lowering_error(fn, *args, **kwargs) -> str | None:
    """Lower ``fn(*args, interpret=False)`` for TPU (Mosaic; works on a CPU) and return the
    error message, or ``None`` if it lowers. File paths in the message are cut to the file
    name, so the text is the same on every machine."""
    import re
    try:
        jax.jit(lambda *a: fn(*a, interpret=False, **kwargs)).trace(*args).lower(
            lowering_platforms=("tpu",))
    except Exception as e:  # noqa: BLE001 -- we want whatever Pallas raises
        msg = re.sub(r"\x1b\[[0-9;]*m", "", str(e).strip())        # jaxpr colours
        return re.sub(r"(/[^\s:]+/)([\w.]+\.py):\d+", r"\2", msg)
    return None


def gpu_style_vmem_bytes(kv_len: int, head_dim: int, dtype, *, block_q: int = GPU_BLOCK,
                         buffers: int = 2) -> int:
    """VMEM the relaid GPU-style kernel needs on a TPU: it grows with the sequence length.

    A GPU program walks K/V through global-memory pointers and stages one 64x64 tile at a
    time in shared memory; the literal Pallas port hands the program the whole K/V row of
    its head as a block instead, so VMEM holds ``2 * kv_len * d`` (double-buffered), plus the
    Q/O blocks and the fp32 state. Lanes are padded to 128 as on the chip.
    """
    from flashlab.kernels.blocks import lane_pad, round_up
    e = jnp.dtype(dtype).itemsize
    d = lane_pad(head_dim)
    kv = 2 * round_up(kv_len, 8) * d * e
    qo = 2 * block_q * d * e
    state = (2 * block_q * 128 + block_q * d) * 4
    temps = 2 * block_q * round_up(GPU_BLOCK, 128) * 4
    return buffers * (kv + qo) + state + temps
