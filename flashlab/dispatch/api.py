"""flashlab.attention: one contract, many backends.

``attention`` is a drop-in for ``jax.nn.dot_product_attention`` (same layout
``[batch, seq, heads, head_dim]``, same argument names and meanings) plus flashlab's
``segment_ids``, ``logits_soft_cap`` and ``backend``. It validates once
(:func:`flashlab.contract.masks.validate`), asks the registry which backend serves the request
(:func:`flashlab.dispatch.registry.choose`) and hands that backend the one normalised
:class:`~flashlab.contract.masks.AttentionSpec`. ``as_flax_attention_fn`` wraps it in Flax's
``attention_fn`` signature.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from flashlab.contract import autodiff, layouts
from flashlab.dispatch import registry
from flashlab.contract.masks import validate

__all__ = ["attention", "explain", "as_flax_attention_fn"]


def attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
              query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
              segment_ids=None, logits_soft_cap=None, backend: str = "auto", interpret=None,
              explain: bool = False, sinks=None, implementation: str | None = None,
              return_residual: bool = False, q_offset=None, kv_offset=None,
              layout: str = "BTNH"):
    """Scaled dot-product attention through the backend that suits the request.

    Args:
      query: ``[batch, q_seq, heads, head_dim]`` float array, or unbatched
        ``[q_seq, heads, head_dim]`` (as jax.nn: key/value may then be rank 3 too, and the
        result has the query's rank). Python lists are accepted as jax.nn accepts them.
      key, value: ``[batch, kv_seq, kv_heads, head_dim]``; ``heads`` a multiple of
        ``kv_heads`` (GQA/MQA: query head ``h`` reads kv head ``h // (heads // kv_heads)``).
      bias: optional, broadcastable as in jax.nn to ``[batch, heads, q_seq, kv_seq]`` (rank
        <= 4, leading ones added, each dim 1 or full), added to the logits; integer/bool
        biases become float. Its gradient has its own shape.
      mask: optional bool, same shape rule; True = visible.
      scale: logit scale, default ``1/sqrt(head_dim)``; a number, NumPy/JAX scalar or traced
        value (data, not a compile-time constant: learnable, no recompile per value).
      is_causal: key ``j`` visible from query ``i`` only if ``j <= i`` (top-left aligned);
        a Python/NumPy bool or a concrete JAX bool.
      query_seq_lengths, key_value_seq_lengths: optional int ``[batch]`` valid lengths.
      local_window_size: int ``w`` or pair ``(left, right)``: keys ``i-left .. i+right``.
      segment_ids: int ``[batch, seq]`` or a pair ``(q_ids, kv_ids)``.
      logits_soft_cap: ``c > 0``: logits become ``c * tanh(logits / c)`` after scaling.
      backend: ``"auto"`` or a name from :func:`flashlab.backends`.
      sinks: optional float ``[heads]``: a per-head logit that joins each row's softmax
        denominator and takes no value (attention sinks, as in gpt-oss); differentiable.
        A row with no visible key stays all zeros.
      interpret: Pallas backends off their platform: ``None`` = the backend's default (our
        kernels interpret, the official TPU kernels refuse), ``True`` = interpret (official
        kernels: TPU interpret mode), or a ``pltpu.InterpretParams``.
      explain: also return the :class:`flashlab.dispatch.registry.Choice` (which backend and why).
      implementation: jax.nn's switch: ``None`` (no constraint), ``"xla"`` or ``"cudnn"``
        (the ``xla``/``cudnn`` backends, as in jax.nn); conflicts with ``backend`` raise.
      return_residual: as jax.nn: also return the logsumexp ``[batch, q_seq, heads]`` (query
        dtype, no gradient; ``-inf`` on rows with no visible key). Served by the ``tiled``
        backend (``auto`` picks it); other named backends raise ``NotImplementedError``.
      q_offset, kv_offset: global positions of the first query / key (int or traced int32
        scalar): causal, window and lengths are evaluated at global positions and lengths are
        global (one block of a longer sequence, as ring attention computes it).
      layout: ``"BTNH"`` (default, jax.nn's ``[batch, seq, heads, head_dim]``) or ``"BNTH"``
        (heads-major ``[batch, heads, seq, head_dim]`` for query, key, value and the result;
        the residual is then ``[batch, heads, q_seq]``). Under ``jit`` the Pallas kernels read
        ``"BNTH"`` arrays in place (no transposed copies in HBM; :mod:`flashlab.contract.layouts`).

    Returns:
      ``[batch, q_seq, heads, value_head_dim]`` in the query's dtype (and the residual when
      ``return_residual``, and the ``Choice`` when ``explain=True``). A query row with no
      visible key is all zeros, with zero gradients; a row whose logits are NaN is NaN.
      ``q_seq == 0`` or ``kv_seq == 0`` (or ``batch == 0``) gives the empty/zero result.

    Raises:
      TypeError: an argument of the wrong type or dtype (names it, what it got and wanted).
      ValueError: an argument of the wrong shape or value (names it, what it got and wanted).
      NotImplementedError: the named backend's declaration excludes this request (names the
        feature and the backends that support it).
    """
    backend = _backend_for(backend, implementation, return_residual)
    query, key, value = layouts.to_contract(layout, query, key, value)
    query, key, value, unbatched = _ensure_4d(query, key, value)
    q, k, v, spec = validate(
        query, key, value, bias, mask, scale=scale, is_causal=is_causal,
        query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
        local_window_size=local_window_size, segment_ids=segment_ids,
        logits_soft_cap=logits_soft_cap, sinks=sinks, allow_empty=True,
        q_offset=q_offset, kv_offset=kv_offset)
    choice = registry.choose(spec, backend, interpret=interpret,
                             autodiff_features=autodiff.requested(q, k, v, spec.bias))
    lse = None
    if min(spec.batch, spec.q_len, spec.kv_len) == 0:      # as jax.nn: an empty/zero result
        out = jnp.zeros((spec.batch, spec.q_len, spec.num_heads, spec.head_dim_v), q.dtype)
        lse = jnp.full((spec.batch, spec.num_heads, spec.q_len), -jnp.inf, jnp.float32)
    elif return_residual:
        from flashlab.ladder.tiled import tiled_attention_with_lse_from_spec
        out, lse = tiled_attention_with_lse_from_spec(q, k, v, spec)
    else:
        out = registry.get(choice.backend).fn(q, k, v, spec, interpret=interpret)
    if unbatched:
        out = out[0]
    result = out = layouts.from_contract(layout, out)
    if return_residual:   # lse [B, N, T] -> jax.nn's [B, T, N] (or [T, N]), no gradient
        if layout == "BTNH":
            lse = jnp.swapaxes(lse, -1, -2)
        lse = jax.lax.stop_gradient(lse.astype(q.dtype))
        result = (out, lse[0] if unbatched else lse)
    return (result, choice) if explain else result


_IMPLEMENTATIONS = {"xla": "xla", "cudnn": "cudnn"}


def _backend_for(backend, implementation, return_residual) -> str:
    """Fold jax.nn's ``implementation=`` and ``return_residual=`` into a backend name."""
    if implementation is not None:
        if implementation not in _IMPLEMENTATIONS:
            raise ValueError(f"implementation: expected None, 'xla' or 'cudnn' (jax.nn's values;"
                             f" flashlab's backends are chosen with backend=), got "
                             f"{implementation!r}")
        if backend not in ("auto", _IMPLEMENTATIONS[implementation]):
            raise ValueError(f"implementation={implementation!r} conflicts with backend="
                             f"{backend!r}: pass one of them")
        backend = _IMPLEMENTATIONS[implementation]
    if not isinstance(return_residual, (bool, np.bool_)):
        raise TypeError(f"return_residual: expected a bool, got {return_residual!r}")
    if return_residual:
        if backend not in ("auto", "tiled"):
            raise NotImplementedError(
                f"return_residual=True is served by backend 'tiled' (it returns the lse), not "
                f"by backend={backend!r}; use backend='auto' or 'tiled'")
        backend = "tiled"
    return backend


def _ensure_4d(query, key, value):
    """jax.nn's unbatched form: rank-3 ``[seq, heads, head_dim]`` arrays get a batch of 1.

    Returns ``(query, key, value, unbatched)``; ``unbatched`` when the query was rank 3 (the
    result then drops the batch dim again, as jax.nn reshapes to the query's shape).
    """
    def four(x):
        return x[None] if hasattr(x, "ndim") and x.ndim == 3 else x
    unbatched = hasattr(query, "ndim") and query.ndim == 3
    if isinstance(query, (list, tuple)):
        query = jnp.asarray(query)
        unbatched = query.ndim == 3
    key, value = (jnp.asarray(x) if isinstance(x, (list, tuple)) else x for x in (key, value))
    return four(query), four(key), four(value), unbatched


def explain(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
            query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
            segment_ids=None, logits_soft_cap=None, backend: str = "auto",
            interpret=None, sinks=None, implementation: str | None = None,
            return_residual: bool = False) -> registry.Choice:
    """Which backend :func:`attention` would use for these arguments, and why (runs nothing).

    Arrays may be ``jax.ShapeDtypeStruct``-like stand-ins only where validation can read
    shapes and dtypes; pass real arrays for lengths/segments if you want them value-checked.
    """
    backend = _backend_for(backend, implementation, return_residual)
    query, key, value, _ = _ensure_4d(query, key, value)
    query, key, value, spec = validate(
        query, key, value, bias, mask, scale=scale, is_causal=is_causal,
        query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
        local_window_size=local_window_size, segment_ids=segment_ids,
        logits_soft_cap=logits_soft_cap, sinks=sinks, allow_empty=True)
    return registry.choose(spec, backend, interpret=interpret,
                           autodiff_features=autodiff.requested(query, key, value, spec.bias))


# ----------------------------------------------------------------------------- Flax adapter

def _flax_to_4d(name, x, batch_shape, N, T, S):
    """Flax's broadcastable ``[batch..., heads, q, kv]`` mask/bias -> our
    ``[B|1, N|1, T|1, S|1]``.

    Flax documents these as *broadcastable*; we broadcast only the leading batch dims (to
    flatten them into one; a dim of 1 elsewhere stays 1, as :func:`validate` keeps it), and
    refuse anything else with a message naming the shape.
    """
    if x is None:
        return None
    x = jnp.asarray(x)
    nb = len(batch_shape)
    want = f"broadcastable to [{', '.join(map(str, batch_shape))}, {N}, {T}, {S}]"
    if x.ndim > nb + 3:
        raise ValueError(f"{name}: expected rank <= {nb + 3} ({want}), got shape {x.shape}")
    x = x.reshape((1,) * (nb + 3 - x.ndim) + x.shape)
    for got, full, what in zip(x.shape, (*batch_shape, N, T, S),
                               [f"batch dim {i}" for i in range(nb)] + ["heads", "q", "kv"]):
        if got not in (1, full):
            raise ValueError(f"{name}: {what} must be 1 or {full} ({want}), got shape {x.shape}")
    b_all_one = all(d == 1 for d in x.shape[:nb])
    x = jnp.broadcast_to(x, (*(x.shape[:nb] if b_all_one else batch_shape), *x.shape[nb:]))
    B = 1 if b_all_one else int(np.prod(batch_shape))
    return x.reshape(B, *x.shape[nb:])


def as_flax_attention_fn(backend: str = "auto", **attention_kwargs):
    """A callable with Flax's ``attention_fn`` signature that runs :func:`attention`.

    Use as ``nnx.MultiHeadAttention(..., attention_fn=flashlab.as_flax_attention_fn())``.
    Applies Flax's ``mask`` (bool or 0/1, broadcastable to ``[batch..., heads, q, kv]``) and
    ``bias``; casts to ``dtype`` like Flax; refuses dropout (``dropout_rate > 0`` while not
    ``deterministic``) and weight sowing (``module``), which need the attention weights that
    flash attention never materializes. ``attention_kwargs`` (e.g. ``logits_soft_cap``) are
    passed to every call.

    Beyond Flax's signature the returned function takes keyword-only ``segment_ids``
    (``[batch..., seq]`` int, or a ``(q_ids, kv_ids)`` pair), passed to :func:`attention`
    as they are. Flax's own modules never pass it (``nnx.MultiHeadAttention`` forwards only
    ``mask``); a model that calls ``attention_fn`` itself can, and then packed documents cost
    ``O(seq)`` ids instead of an ``O(seq^2)`` dense mask built from them
    (see :class:`flashlab.models.DocumentModel`).
    """

    def attention_fn(query, key, value, bias=None, mask=None, broadcast_dropout=True,
                     dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
                     precision=None, module=None, promote_dtype=None, is_causal=False, *,
                     segment_ids=None):
        if dropout_rate > 0.0 and not deterministic:
            raise NotImplementedError(
                f"flashlab attention_fn: dropout_rate={dropout_rate} with deterministic=False "
                "needs the attention weights, which flash attention never materializes; use "
                "dropout_rate=0.0 or deterministic=True")
        if module is not None:
            raise NotImplementedError(
                "flashlab attention_fn: module= (sow_weights=True) needs the attention "
                "weights, which flash attention never materializes; use sow_weights=False")
        if dtype is not None:
            query, key, value = (jnp.asarray(x, dtype) for x in (query, key, value))
        elif promote_dtype is not None:
            query, key, value = promote_dtype((query, key, value), dtype=dtype)
        batch_shape = query.shape[:-3]
        T, N = query.shape[-3], query.shape[-2]
        S = key.shape[-3]
        if mask is not None:
            mask = jnp.asarray(mask)
            mask = mask if mask.dtype == jnp.bool_ else mask != 0
        mask = _flax_to_4d("mask", mask, batch_shape, N, T, S)
        bias = _flax_to_4d("bias", bias, batch_shape, N, T, S)
        flat = lambda x: x.reshape((-1, *x.shape[-3:]))
        if len(batch_shape) != 1:
            query, key, value = flat(query), flat(key), flat(value)
            if segment_ids is not None:   # [batch..., seq] -> [batch, seq], each of a pair
                seg = segment_ids if isinstance(segment_ids, (tuple, list)) else (segment_ids,)
                seg = tuple(jnp.reshape(s, (-1, jnp.shape(s)[-1])) for s in seg)
                segment_ids = seg if len(seg) == 2 else seg[0]
        out = attention(query, key, value, bias, mask, is_causal=is_causal, backend=backend,
                        segment_ids=segment_ids, **attention_kwargs)
        return out.reshape((*batch_shape, *out.shape[-3:]))

    return attention_fn
