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

``base2=True`` (``update``, ``merge`` and ``finalize`` take it) keeps the scores and ``m`` in log2 units
(``s₂ = s · log2(e)``, ``l`` a sum of ``2^(s₂ − m)``): the same state, one multiply per score
cheaper where the caller folds ``log2(e)`` into its scale (the Pallas forward folds it, with
the softmax scale, into the query block). ``finalize`` still returns the natural-log ``lse``.

Masked scores are ``-inf``. A row that has seen no visible key keeps ``m = -inf, l = 0`` and
finalizes to zeros with ``lse = -inf``: never NaN, never mean(V). A row whose visible logits
hold a NaN (or a ``+inf``, where ``exp(inf - inf)`` is NaN) is *not* such a row: its ``m`` or
``l`` is NaN, and :func:`finalize` tells the two apart by ``m == -inf`` ("nothing seen"), never
by ``l > 0`` (which is False for NaN too), so a diverging run sees NaN in every backend.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["State", "EMPTY", "init", "update", "merge", "finalize", "from_output", "NEG_INF",
           "LN2", "LOG2E", "sink_state", "sink_grad", "widen"]

NEG_INF = float("-inf")


class State(NamedTuple):
    m: jax.Array    # [..., Br]      float32 running row max
    l: jax.Array    # [..., Br]      float32 running row sum of exp(s - m)
    acc: jax.Array  # [..., Br, d]   float32 running unnormalised output


# A row that has seen nothing, as scalars: m = -inf, l = 0, acc = 0. init broadcasts it; a
# kernel stores it at a row's first step, or selects it there (kernels/forward.py).
EMPTY = State(NEG_INF, 0.0, 0.0)


def init(shape, head_dim: int, dtype=jnp.float32) -> State:
    """Empty state (:data:`EMPTY`) for rows of ``shape`` (``[..., Br]``) and value width
    ``head_dim``.

    ``dtype`` is the accumulation dtype: float32, or float64 for float64 inputs.
    """
    return State(*(jnp.full(s, e, dtype)
                   for s, e in zip((shape, shape, (*shape, head_dim)), EMPTY)))


def _safe(m):
    # exp(s - m) with m = -inf would be exp(-inf + inf) = NaN; use 0 for rows with nothing yet.
    return jnp.where(m == NEG_INF, 0.0, m)


def widen(x, n: int):
    """A lane-replicated ``[..., Br, L]`` -> ``[..., Br, n]`` (``n`` a multiple of ``L``, or
    ``n <= L``): whole copies side by side, elementwise work with no cross-lane reduction."""
    L = x.shape[-1]
    if n == L:
        return x
    if n < L:
        return x[..., :n]
    return jnp.concatenate([x] * (n // L), axis=-1)


LN2 = 0.6931471805599453       # ln(2): a log2-unit lse back to natural log
LOG2E = 1.4426950408889634     # log2(e) = 1 / ln(2): natural-log logits to log2 units


def _exp(base2: bool):
    return jnp.exp2 if base2 else jnp.exp


def update(state: State, s_block: jax.Array, v_block: jax.Array, visible=None, *,
           lanes: bool = False, base2: bool = False) -> State:
    """Fold one block of scores into the running state.

    s_block  [..., Br, Bc]  scores (scaled, capped, biased); masked entries may be -inf
    v_block  [..., Bc, d]   values for the block's keys
    visible  [..., Br, Bc]  optional bool; False entries are treated as -inf
    lanes    ``False``: ``m``, ``l`` are ``[..., Br]``. ``True``: they are lane-replicated
             ``[..., Br, L]`` (a TPU kernel's VMEM scratch; every lane holds the row's value)
             and stay so: the block's row max and sum are the only cross-lane reductions,
             everything else is elementwise (:func:`widen` tiles them across ``Bc`` and ``d``).
    base2    ``s_block`` and ``m`` in log2 units (see the module docstring).
    """
    m, l, acc = state
    exp = _exp(base2)
    s = s_block.astype(m.dtype)
    if visible is not None:
        s = jnp.where(visible, s, NEG_INF)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=lanes))   # [..., Br] / [..., Br, L]
    m_use = _safe(m_new)
    wide = (lambda x, n: widen(x, n)) if lanes else (lambda x, n: x[..., None])
    p = exp(s - wide(m_use, s.shape[-1]))                      # [..., Br, Bc]; masked -> 0
    alpha = exp(m - m_use)                                     # m=-inf -> 0
    l_new = alpha * l + jnp.sum(p, axis=-1, keepdims=lanes)
    pv = jnp.einsum("...qk,...kd->...qd", p.astype(v_block.dtype), v_block,
                    preferred_element_type=acc.dtype)
    return State(m_new, l_new, wide(alpha, acc.shape[-1]) * acc + pv)


def merge(a: State, b: State, *, lanes: bool = False, base2: bool = False) -> State:
    """Combine two states built over disjoint sets of keys (associative, commutative).

    ``lanes``: ``m``, ``l`` lane-replicated ``[..., Br, L]`` (see :func:`update`); ``base2``:
    both states in log2 units."""
    m = jnp.maximum(a.m, b.m)
    m_use = _safe(m)
    exp = _exp(base2)
    wa, wb = exp(a.m - m_use), exp(b.m - m_use)
    d = a.acc.shape[-1]
    wide = (lambda x: widen(x, d)) if lanes else (lambda x: x[..., None])
    return State(m, wa * a.l + wb * b.l, wide(wa) * a.acc + wide(wb) * b.acc)


def finalize(state: State, *, lanes: bool = False, base2: bool = False, inverse=None):
    """Normalise: ``O = acc / l`` and ``lse = m + log l``.

    A row with no visible key (``m == -inf``: nothing seen, or every visible logit ``-inf``)
    gives 0 and ``lse = -inf``. A row whose logits held a NaN (``m`` or ``l`` NaN) gives NaN:
    it is a divergence to report, not an empty row.
    Returns ``(out [..., Br, d], lse [..., Br])`` in the state's dtype (float32 or float64).
    ``lanes``: ``m``, ``l`` lane-replicated ``[..., Br, L]`` (see :func:`update`); then ``lse``
    is ``[..., Br, L]`` too and ``O = acc * (1 / max(l, 1))``: one reciprocal per row (on
    ``[Br, L]``) and a multiply per element, with no empty-row test (see below).
    ``base2``: the state is in log2 units; ``lse`` is returned in natural log all the same.
    ``inverse``: computes ``1 / l`` (``lanes`` only) for ``l >= 1`` or NaN; default ``1 / l``.
    """
    m, l, acc = state
    seen = m != NEG_INF                       # True for NaN m: NaN flows through
    l_safe = jnp.where(seen, l, 1.0)
    lse = ((m + jnp.log2(l_safe)) * LN2) if base2 else (m + jnp.log(l_safe))
    lse = jnp.where(seen, lse, NEG_INF)
    if lanes:
        # A seen row's l is at least 1, exactly: the step that found its max added exp(0) = 1,
        # and every later step keeps that 1 or adds a new one. An empty row's l and acc are 0.
        # So 1 / max(l, 1) is 1 / l on every seen row and makes an empty row acc * 1 = 0 (every
        # p was 0; unless V itself holds inf/NaN, which then shows, as it does in every seen
        # row), with no test of m per element; NaN l stays NaN.
        l_one = jnp.maximum(l, 1.0)
        inv = (1.0 / l_one) if inverse is None else inverse(l_one)
        return acc * widen(inv, acc.shape[-1]), lse
    out = jnp.where(seen[..., None], acc / l_safe[..., None], 0.0)
    return out, lse


def sink_state(sink, head_dim: int, *, lanes: bool = False) -> State:
    """An attention sink as one more state: ``m = sink``, ``l = 1``, ``acc = 0``.

    ``sink`` ``[..., Br]`` float (each row's sink logit). :func:`merge` it into a row's state
    before :func:`finalize` and the sink joins the denominator like a key whose logit is the
    sink and whose value is zero: ``O = acc / (l + exp(sink - m))``. A row with no visible
    key finalizes to ``O = 0`` and ``lse = sink``. ``lanes``: ``sink`` is lane-replicated
    ``[..., Br, L]`` (see :func:`update`).
    """
    m = jnp.asarray(sink, jnp.float32)
    rows = m.shape[:-1] if lanes else m.shape
    return State(m, jnp.ones_like(m), jnp.zeros((*rows, head_dim), jnp.float32))


def sink_grad(sink, lse, D):
    """The sink's gradient ``-sum_i p_sink,i · D_i`` over the last (row) axis.

    ``lse`` ``[..., Br]`` includes the sink, ``sink`` broadcasts against it, ``D_i =
    rowsum(dO_i ∘ O_i)`` (minus the lse cotangent, if any) ``[..., Br]``. The sink's weight
    in row ``i`` is ``p_sink,i = exp(sink - lse_i)``; it takes no value, so only the shared
    normalisation carries gradient to it: ``dsink = sum_i p_sink,i (0 - D_i)``. Returns
    ``[...]`` float32.
    """
    finite = jnp.isfinite(lse)
    p = jnp.where(finite, jnp.exp(sink - jnp.where(finite, lse, 0.0)), 0.0)
    return -jnp.sum(p * D.astype(jnp.float32), axis=-1)


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
