"""FlashAttention forward and backward for one head, no masks: the tiled rung before its options.

``flashlab.ladder.tiled`` is the production rung (masks, GQA, padding, bias, soft cap, lengths,
three loop ranges per block, ``custom_vjp``); its backward is some sixty lines. This module is what
it reduces to for one head of ``[N, d]`` float32 arrays with ``N`` a multiple of the blocks and no
mask: the paper's Algorithm 1 forward (with ``lse`` kept) and FlashAttention-2's backward, each
in a few lines, with Python loops over blocks so every step can be read (and printed) in order.
Chapter 03 reads it before the production code; the tests check it against the float64 oracle.
"""
from __future__ import annotations

import jax.numpy as jnp

from flashlab.ladder import online_softmax as osm

__all__ = ["minimal_forward", "minimal_backward"]


def minimal_forward(q, k, v, *, block_q: int = 64, block_k: int = 64):
    """``(O [N, d], lse [N])`` of softmax(q kᵀ/√d) v for one head, one query block at a time.

    q, k, v: ``[N, d]`` float32 with ``N`` a multiple of ``block_q`` (B_r) and ``block_k`` (B_c).
    """
    N, d = q.shape
    scale = d ** -0.5
    outs, lses = [], []
    for i in range(0, N, block_q):                      # query block Q_i: [B_r, d]
        state = osm.init((block_q,), v.shape[-1])       # m = -inf, l = 0, acc = 0
        for j in range(0, N, block_k):                  # key/value block K_j, V_j: [B_c, d]
            s = scale * q[i:i + block_q] @ k[j:j + block_k].T          # S_ij [B_r, B_c]
            state = osm.update(state, s, v[j:j + block_k])
        o, lse = osm.finalize(state)                    # O_i = acc / l, lse_i = m + log l
        outs.append(o)
        lses.append(lse)
    return jnp.concatenate(outs), jnp.concatenate(lses)


def minimal_backward(q, k, v, o, lse, do, *, block_q: int = 64, block_k: int = 64):
    """``(dQ, dK, dV)``, each ``[N, d]``, from ``O`` and ``lse`` only: P is recomputed per tile.

    q, k, v, o, do: ``[N, d]`` float32; lse: ``[N]`` from :func:`minimal_forward`. Key blocks
    are the outer loop, so ``dK_j, dV_j`` are finished by the inner loop and written once, while
    ``dQ`` accumulates across them (FlashAttention-2, Algorithm 2).
    """
    N, d = q.shape
    scale = d ** -0.5
    D = jnp.sum(do * o, axis=-1)                        # D_i = rowsum(dO_i ∘ O_i)   [N]
    dq = jnp.zeros_like(q)
    dks, dvs = [], []
    for j in range(0, N, block_k):                      # outer: K_j, V_j  [B_c, d]
        kj, vj = k[j:j + block_k], v[j:j + block_k]
        dk, dv = jnp.zeros_like(kj), jnp.zeros_like(vj)
        for i in range(0, N, block_q):                  # inner: Q_i, dO_i  [B_r, d]
            r = slice(i, i + block_q)
            p = jnp.exp(scale * q[r] @ kj.T - lse[r, None])   # P_ij, recomputed  [B_r, B_c]
            dv = dv + p.T @ do[r]                             # dV_j += P_ijᵀ dO_i
            dp = do[r] @ vj.T                                 # dP_ij = dO_i V_jᵀ
            ds = p * (dp - D[r, None])                        # dS_ij = P_ij ∘ (dP_ij − D_i)
            dq = dq.at[r].add(scale * ds @ kj)                # dQ_i += τ dS_ij K_j
            dk = dk + scale * ds.T @ q[r]                     # dK_j += τ dS_ijᵀ Q_i
        dks.append(dk)
        dvs.append(dv)
    return dq, jnp.concatenate(dks), jnp.concatenate(dvs)
