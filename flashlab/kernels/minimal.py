"""The smallest FlashAttention forward kernel: no masks, one grid step per (b, h, i, j).

Read this before :mod:`flashlab.kernels.forward`. It is chapter 04's tiled matmul plus the
online softmax of chapter 02, and nothing else:

* the grid is ``(batch, heads, N / B_r, N / B_c)``; step ``(b, h, i, j)`` sees the VMEM blocks
  ``Q_i`` (``[B_r, d]``) and ``K_j, V_j`` (``[B_c, d]``) of head ``h`` of batch row ``b``;
* ``m, l, acc`` (the running max, sum and unnormalised output of query block ``i``) live in
  VMEM scratch, which persists from one grid step to the next: the kv axis ``j`` is the
  innermost, "arbitrary" (sequential) axis, so steps ``j = 0 … T_c - 1`` of one query block
  run back to back on one core and update the same scratch;
* at ``j == 0`` the state is reset; at the last ``j`` the output block ``O_i = acc / l`` is
  written (its BlockSpec ignores ``j``, so Pallas copies it to HBM once, after the last step).

Layout ``[batch, heads, seq, head_dim]``; ``N`` must be a multiple of both blocks and ``d`` a
multiple of 128 (or the whole axis). What the production kernel adds, one feature at a time:
causal and window masks with block skipping, sequence lengths through scalar prefetch,
padding, GQA, bias, soft cap, segment ids, lse output and the block-size choice.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from flashlab.contract import device
from flashlab.ladder import online_softmax
from flashlab.compat.pallas import pl, pltpu

__all__ = ["minimal_flash_kernel", "minimal_flash_attention"]


def minimal_flash_kernel(q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref, *, scale: float):
    """Grid step ``(b, h, i, j)``: fold ``S_ij = scale · Q_i K_jᵀ`` into ``(m, l, acc)``.

    ``m_ref, l_ref`` are ``[B_r, 128]`` (a row's value repeated over the 128 lanes: VMEM is tiled
    in 128-lane rows), ``acc_ref`` is ``[B_r, d]``, all float32.
    """
    j = pl.program_id(3)

    @pl.when(j == 0)                                        # a new query block: empty state
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, online_softmax.NEG_INF, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def state():                                            # scratch -> (m [B_r], l [B_r], acc)
        return online_softmax.State(m_ref[:, 0], l_ref[:, 0], acc_ref[...])

    s = scale * jax.lax.dot_general(q_ref[...], k_ref[...], (((1,), (1,)), ((), ())),
                                    preferred_element_type=jnp.float32)   # S_ij [B_r, B_c]
    m, l, acc = online_softmax.update(state(), s, v_ref[...])            # chapter 02's update
    m_ref[...] = jnp.broadcast_to(m[:, None], m_ref.shape)
    l_ref[...] = jnp.broadcast_to(l[:, None], l_ref.shape)
    acc_ref[...] = acc

    @pl.when(j == pl.num_programs(3) - 1)                   # last kv block: O_i = acc / l
    def _finish():
        o, _ = online_softmax.finalize(state())
        o_ref[...] = o.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("block_q", "block_k", "interpret"))
def minimal_flash_attention(q, k, v, *, block_q: int = 128, block_k: int = 128, interpret=None):
    """softmax(q kᵀ/√d) v for ``q, k, v [batch, heads, N, d]`` (no masks); out like ``q``.

    ``block_q`` (B_r) and ``block_k`` (B_c) must divide ``N``. ``interpret``: ``None`` compiles
    on a TPU and uses the generic interpreter elsewhere; ``True``, ``False`` or a
    ``pltpu.InterpretParams`` (TPU interpret mode) are passed to ``pl.pallas_call``.
    """
    B, H, N, d = q.shape
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"k, v: expected the shape of q {q.shape}, got {k.shape} and {v.shape}")
    if N % block_q or N % block_k:
        raise ValueError(f"block_q, block_k: expected divisors of N={N}, got "
                         f"({block_q}, {block_k})")
    q_spec = pl.BlockSpec((None, None, block_q, d), lambda b, h, i, j: (b, h, i, 0))
    kv_spec = pl.BlockSpec((None, None, block_k, d), lambda b, h, i, j: (b, h, j, 0))
    return pl.pallas_call(
        functools.partial(minimal_flash_kernel, scale=d ** -0.5),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid=(B, H, N // block_q, N // block_k),
        in_specs=[q_spec, kv_spec, kv_spec],
        out_specs=q_spec,                                   # O_i: same block for every j
        scratch_shapes=[pltpu.VMEM((block_q, 128), jnp.float32),   # m, broadcast over lanes
                        pltpu.VMEM((block_q, 128), jnp.float32),   # l
                        pltpu.VMEM((block_q, d), jnp.float32)],    # acc
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=device.interpret_mode(interpret))(q, k, v)
