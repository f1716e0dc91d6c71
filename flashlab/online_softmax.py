"""The running state of FlashAttention, written once.

A query row's softmax-weighted sum over keys can be built one block of keys at a time if
we carry three numbers per row (Milakov & Gimelshein 2018; Dao et al. 2022):

    m    running max of the scores seen so far          [..., Br]
    l    running sum of exp(score - m)                  [..., Br]
    acc  running sum of exp(score - m) * v (unnormalised O)  [..., Br, d]

``update`` folds one block of scores into the state; ``merge`` combines two states built
over disjoint key sets (it is associative and commutative, so blocks may be combined in any
order: tiles inside a kernel, grid steps, devices in a ring); ``finalize`` divides out ``l``.
The tiled rung, the Pallas kernels and ring attention all call these functions.

Masked scores are ``-inf``. A row that has seen no visible key keeps ``m = -inf, l = 0`` and
finalizes to zeros with ``lse = -inf``: never NaN, never mean(V).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["State", "init", "update", "merge", "finalize", "from_output", "NEG_INF"]

NEG_INF = float("-inf")


class State(NamedTuple):
    m: jax.Array    # [..., Br]      float32 running row max
    l: jax.Array    # [..., Br]      float32 running row sum of exp(s - m)
    acc: jax.Array  # [..., Br, d]   float32 running unnormalised output


def init(shape, head_dim: int) -> State:
    """Empty state for rows of ``shape`` (``[..., Br]``) and value width ``head_dim``."""
    return State(jnp.full(shape, NEG_INF, jnp.float32), jnp.zeros(shape, jnp.float32),
                 jnp.zeros((*shape, head_dim), jnp.float32))


def _safe(m):
    # exp(s - m) with m = -inf would be exp(-inf + inf) = NaN; use 0 for rows with nothing yet.
    return jnp.where(m == NEG_INF, 0.0, m)


def update(state: State, s_block: jax.Array, v_block: jax.Array, visible=None) -> State:
    """Fold one block of scores into the running state.

    s_block  [..., Br, Bc]  scores (scaled, capped, biased); masked entries may be -inf
    v_block  [..., Bc, d]   values for the block's keys
    visible  [..., Br, Bc]  optional bool; False entries are treated as -inf
    """
    m, l, acc = state
    s = s_block.astype(jnp.float32)
    if visible is not None:
        s = jnp.where(visible, s, NEG_INF)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))               # [..., Br]
    m_use = _safe(m_new)
    p = jnp.exp(s - m_use[..., None])                          # [..., Br, Bc]; masked -> 0
    alpha = jnp.exp(m - m_use)                                 # [..., Br]; m=-inf -> 0
    l_new = alpha * l + jnp.sum(p, axis=-1)
    pv = jnp.einsum("...qk,...kd->...qd", p.astype(v_block.dtype), v_block,
                    preferred_element_type=jnp.float32)
    return State(m_new, l_new, alpha[..., None] * acc + pv)


def merge(a: State, b: State) -> State:
    """Combine two states built over disjoint sets of keys (associative, commutative)."""
    m = jnp.maximum(a.m, b.m)
    m_use = _safe(m)
    wa, wb = jnp.exp(a.m - m_use), jnp.exp(b.m - m_use)
    return State(m, wa * a.l + wb * b.l, wa[..., None] * a.acc + wb[..., None] * b.acc)


def finalize(state: State):
    """Normalise: ``O = acc / l`` and ``lse = m + log l``; rows with ``l == 0`` give 0 and -inf.

    Returns ``(out [..., Br, d] float32, lse [..., Br] float32)``.
    """
    m, l, acc = state
    seen = l > 0
    l_safe = jnp.where(seen, l, 1.0)
    out = jnp.where(seen[..., None], acc / l_safe[..., None], 0.0)
    lse = jnp.where(seen, m + jnp.log(l_safe), NEG_INF)
    return out, lse


def from_output(out, lse) -> State:
    """The state of a finished attention call, ready to :func:`merge` with others.

    ``out [B, T, N, d]`` (public layout, any float dtype) and ``lse [B, N, T]`` give the state
    ``m = lse, l = 1, acc = O`` ([B, N, T] and [B, N, T, d] float32): ``acc / l`` is ``O`` and
    ``m + log l`` is ``lse``. Rows with no visible key (``lse = -inf``) get ``l = 0``.
    """
    lse = lse.astype(jnp.float32)
    seen = lse > NEG_INF
    acc = jnp.swapaxes(out, 1, 2).astype(jnp.float32)
    return State(lse, seen.astype(jnp.float32), jnp.where(seen[..., None], acc, 0.0))
