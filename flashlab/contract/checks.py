"""Argument checks of :func:`flashlab.contract.masks.validate`, one per argument.

Each raises ``TypeError``/``ValueError`` naming the argument, the value given and what was
expected, and returns the argument normalised (an array, int32 lengths, a clamped window...).
The broadcasting and value rules they implement are in :mod:`flashlab.contract.masks`'s
docstring.
"""
from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

WINDOW_CAP = 2 ** 30   # local_window_size sides above it are clamped (positions stay int32)

FLOAT_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64)


def shape(x) -> tuple[int, ...]:
    return tuple(np.shape(x))


def as_array(name, x, what="a jax or numpy array"):
    """Python lists/tuples of numbers -> a jnp array (as jax.nn accepts them); else as is."""
    if isinstance(x, (list, tuple)):
        try:
            return jnp.asarray(x)
        except (TypeError, ValueError) as e:
            raise TypeError(f"{name}: expected {what} (or a nested list of numbers), got a "
                            f"{type(x).__name__} that is not one: {e}") from None
    return x


def qkv(query, key, value, allow_empty=False):
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name}: expected a jax or numpy array, got {type(x).__name__}")
        if x.ndim != 4:
            raise ValueError(f"{name}: expected rank 4 [batch, seq, heads, head_dim], "
                             f"got shape {shape(x)} (rank {x.ndim})")
        dt = jnp.dtype(x.dtype)
        if not any(dt == jnp.dtype(f) for f in FLOAT_DTYPES):
            raise TypeError(f"{name}: expected a floating dtype (float16, bfloat16, float32, "
                            f"float64), got {dt}")
    if jnp.dtype(key.dtype) != jnp.dtype(query.dtype) or jnp.dtype(value.dtype) != jnp.dtype(query.dtype):
        raise TypeError(f"query, key, value: expected one dtype, got {query.dtype}, "
                        f"{key.dtype}, {value.dtype}")
    B, T, N, H = query.shape
    Bk, S, K, Hk = key.shape
    if Bk != B:
        raise ValueError(f"key: expected batch {B} (query's), got shape {shape(key)}")
    if Hk != H:
        raise ValueError(f"key: expected head_dim {H} (query's), got shape {shape(key)}")
    if value.shape[:3] != (B, S, K):
        raise ValueError(f"value: expected shape [{B}, {S}, {K}, head_dim] (key's batch, seq "
                         f"and heads), got {shape(value)}")
    low = min(N, K, H, value.shape[3]) if allow_empty else min(B, T, S, N, K, H, value.shape[3])
    if low < 1:
        which = "heads and head_dim" if allow_empty else "every dimension"
        raise ValueError(f"query/key/value: {which} must be >= 1, got query "
                         f"{shape(query)}, key {shape(key)}, value {shape(value)}")
    if N % K:
        raise ValueError(f"key: query heads ({N}) must be a multiple of kv heads; got key "
                         f"shape {shape(key)} with {K} heads")


def bias_or_mask(name, x, B, N, T, S, kind, float_dtype=jnp.float32):
    """Check a bias/mask against jax.nn's rule and return it as ``[B|1, N|1, T|1, S|1]``.

    jax.nn: rank <= 4 (leading 1s added), each dim 1 or full, mask bool, bias any real
    dtype. Every dim of 1 stays 1 (nothing is materialised; each backend reads the
    broadcast form, and the bias gradient comes back in the bias's own shape).
    """
    x = as_array(name, x, "an array")
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name}: expected an array, got {type(x).__name__}")
    want = f"[{B} or 1, {N} or 1, {T} or 1, {S} or 1]"
    if x.ndim > 4:
        raise ValueError(f"{name}: expected rank <= 4 broadcastable to [batch, heads, q_seq, "
                         f"kv_seq] = {want}, got shape {shape(x)} (rank {x.ndim})")
    shape4 = (1,) * (4 - x.ndim) + shape(x)
    b, n, t, s = shape4
    if b not in (1, B) or n not in (1, N) or t not in (1, T) or s not in (1, S):
        raise ValueError(f"{name}: expected shape {want} (rank 4, or fewer dims with leading "
                         f"ones as jax.nn), got {shape(x)}")
    dt = jnp.dtype(x.dtype)
    if kind == "mask" and dt != jnp.dtype(bool):
        raise TypeError(f"mask: expected dtype bool (True = visible), got {dt}")
    if kind == "bias" and not (jnp.issubdtype(dt, jnp.floating) or jnp.issubdtype(dt, jnp.integer)
                               or dt == jnp.dtype(bool)):
        raise TypeError(f"bias: expected a real (floating, integer or bool) dtype, got {dt}")
    x = jnp.reshape(jnp.asarray(x), shape4)
    if kind == "bias" and not jnp.issubdtype(dt, jnp.floating):
        x = x.astype(float_dtype)
    return x


def offset(name, x):
    """``q_offset``/``kv_offset`` as an int32 scalar array (or ``None``)."""
    if x is None:
        return None
    if isinstance(x, bool) or not (isinstance(x, (int, np.integer)) or hasattr(x, "dtype")):
        raise TypeError(f"{name}: expected an int >= 0 or an int32 scalar array, got {x!r}")
    if hasattr(x, "dtype"):
        if shape(x) != ():
            raise ValueError(f"{name}: expected a scalar (shape ()), got shape {shape(x)}")
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise TypeError(f"{name}: expected an integer dtype, got {x.dtype}")
    static = None if isinstance(x, jax.core.Tracer) else int(np.asarray(x))
    if static is not None and static < 0:
        raise ValueError(f"{name}: expected a global position >= 0, got {static}")
    return jnp.asarray(x, jnp.int32)


def lengths(name, x, B, limit):
    if x is None:
        return None
    if not hasattr(x, "shape"):
        x = np.asarray(x)
    if shape(x) != (B,):
        raise ValueError(f"{name}: expected shape [batch] = [{B}], got {shape(x)}")
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name}: expected an integer dtype, got {x.dtype}")
    if not isinstance(x, jax.core.Tracer):
        xs = np.asarray(x)
        if (xs < 0).any() or (limit is not None and (xs > limit).any()):
            raise ValueError(f"{name}: expected values in [0, {limit}], got {xs.tolist()}")
        return jnp.asarray(xs.astype(np.int32))
    # Traced: cannot raise on a value, so clamp to [0, limit] (in the input's own dtype,
    # before any narrowing to int32) -- exactly what every backend's masks make of it.
    return jnp.clip(x, 0, limit).astype(jnp.int32)


def window(w):
    if w is None:
        return None
    concrete = isinstance(w, (jax.Array, np.ndarray)) and not isinstance(w, jax.core.Tracer)
    if concrete and w.ndim == 0:
        w = w.item()                        # a concrete NumPy/JAX integer scalar
    if isinstance(w, (int, np.integer)) and not isinstance(w, bool):
        w = (int(w), int(w))
    if not isinstance(w, (tuple, list)) or len(w) != 2:
        raise TypeError(f"local_window_size: expected an int or a pair (left, right) of ints, got {w!r}")
    out = []
    for side, v in zip(("left", "right"), w):
        if v is None:
            out.append(None)
            continue
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"local_window_size: {side} must be an int >= 0 (or None), got {v!r}")
        if v < 0:
            raise ValueError(f"local_window_size: {side} must be >= 0, got {v}")
        out.append(min(int(v), WINDOW_CAP))
    return tuple(out)


def segments(seg, B, T, S):
    if seg is None:
        return None, None
    if isinstance(seg, (tuple, list)):
        if len(seg) != 2:
            raise TypeError(f"segment_ids: expected one array [batch, seq] or a pair "
                            f"(q_ids [batch, q_seq], kv_ids [batch, kv_seq]), got {len(seg)} items")
        q_ids, kv_ids = seg
    else:
        if T != S:
            raise ValueError(f"segment_ids: a single array needs q_seq == kv_seq, got q_seq={T}, "
                             f"kv_seq={S}; pass a pair (q_ids, kv_ids)")
        q_ids = kv_ids = seg
    q_ids = as_array("segment_ids (query)", q_ids, "an int array")
    kv_ids = as_array("segment_ids (key/value)", kv_ids, "an int array")
    for name, x, L in (("segment_ids (query)", q_ids, T), ("segment_ids (key/value)", kv_ids, S)):
        if not hasattr(x, "shape"):
            raise TypeError(f"{name}: expected an array, got {type(x).__name__}")
        if shape(x) != (B, L):
            raise ValueError(f"{name}: expected shape [batch, seq] = [{B}, {L}], got {shape(x)}")
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise TypeError(f"{name}: expected an integer dtype, got {x.dtype}")
    return segments_int32(q_ids, kv_ids)


def segments_int32(q_ids, kv_ids):
    """Segment ids as int32, exactly: only ``q_id == kv_id`` matters, so ids that do not fit
    int32 (int64/uint64, concrete out of range or traced) become their rank among all ids of
    the call (``searchsorted`` into the sorted ids: equal ids, equal ranks); uint32 ids are
    reinterpreted bit-for-bit (a bijection). Never a silent merge of 0 and 2**32."""
    i32 = np.iinfo(np.int32)
    dts = {jnp.dtype(q_ids.dtype), jnp.dtype(kv_ids.dtype)}
    narrow = all(d.itemsize <= 4 for d in dts)
    concrete = not any(isinstance(x, jax.core.Tracer) for x in (q_ids, kv_ids))
    if not narrow and concrete:
        lo = min(int(np.min(q_ids, initial=0)), int(np.min(kv_ids, initial=0)))
        hi = max(int(np.max(q_ids, initial=0)), int(np.max(kv_ids, initial=0)))
        narrow = i32.min <= lo and hi <= i32.max
    if narrow:
        cast = lambda x: (jax.lax.bitcast_convert_type(jnp.asarray(x), jnp.int32)  # noqa: E731
                          if jnp.dtype(x.dtype) == jnp.dtype(jnp.uint32)
                          else jnp.asarray(x).astype(jnp.int32))
        return cast(q_ids), cast(kv_ids)
    q_ids, kv_ids = jnp.asarray(q_ids), jnp.asarray(kv_ids)
    both = jnp.sort(jnp.concatenate([q_ids.ravel(), kv_ids.ravel().astype(q_ids.dtype)]))
    rank = lambda x: jnp.searchsorted(both, x.astype(both.dtype)).astype(jnp.int32)  # noqa: E731
    return rank(q_ids), rank(kv_ids)


def is_causal(is_causal) -> bool:
    """A Python/NumPy bool or a concrete JAX/NumPy 0-d bool array (static: it picks code)."""
    concrete = (isinstance(is_causal, (jax.Array, np.ndarray))
                and not isinstance(is_causal, jax.core.Tracer))
    if concrete:
        if is_causal.shape == () and jnp.dtype(is_causal.dtype) == jnp.dtype(bool):
            return bool(is_causal)
    if isinstance(is_causal, jax.core.Tracer):
        raise TypeError(f"is_causal: expected a static bool (it selects the mask), got a traced "
                        f"value {is_causal!r}; pass a Python bool or mark it static in jit")
    if not isinstance(is_causal, (bool, np.bool_)):
        raise TypeError(f"is_causal: expected a Python bool, got {is_causal!r}")
    return bool(is_causal)


def scale(scale, query):
    """``(query, static scale)``: an explicit scale becomes data, folded into the query.

    ``None`` -> ``1/sqrt(head_dim)``, static. A Python number with a 16-bit query stays static
    (exact); any other explicit scale (a Python number with a 32/64-bit query, a NumPy/JAX
    scalar, a traced value) multiplies the query and the spec's scale is 1.
    """
    H = query.shape[-1]
    if scale is None:
        return query, 1.0 / math.sqrt(H)
    if isinstance(scale, bool) or isinstance(scale, (np.bool_,)):
        raise TypeError(f"scale: expected a number, got {scale!r}")
    python = isinstance(scale, numbers.Real)
    if not python:
        if not hasattr(scale, "dtype") or not hasattr(scale, "shape"):
            raise TypeError(f"scale: expected a number or a scalar array, got {scale!r}")
        if shape(scale) != ():
            raise ValueError(f"scale: expected a scalar, got shape {shape(scale)}")
        dt = scale.dtype
        if not (jnp.issubdtype(dt, jnp.floating) or jnp.issubdtype(dt, jnp.integer)):
            raise TypeError(f"scale: expected a real dtype, got {scale.dtype}")
    if not isinstance(scale, jax.core.Tracer) and not math.isfinite(float(scale)):
        raise ValueError(f"scale: expected a finite number, got {scale!r}")
    if python and jnp.dtype(query.dtype).itemsize < 4:
        return query, float(scale)
    return query * jnp.asarray(scale).astype(query.dtype), 1.0


def sinks(sinks, N):
    if sinks is None:
        return None
    if not hasattr(sinks, "shape") or not hasattr(sinks, "dtype"):
        raise TypeError(f"sinks: expected a float array [q_heads] = [{N}], got "
                        f"{type(sinks).__name__}")
    if shape(sinks) != (N,):
        raise ValueError(f"sinks: expected shape [q_heads] = [{N}], got {shape(sinks)}")
    if not jnp.issubdtype(sinks.dtype, jnp.floating):
        raise TypeError(f"sinks: expected a floating dtype, got {jnp.dtype(sinks.dtype)}")
    return jnp.asarray(sinks).astype(jnp.promote_types(sinks.dtype, jnp.float32))


def soft_cap(logits_soft_cap):
    """``logits_soft_cap``: ``None`` or a finite Python float > 0 (returned as ``float``)."""
    if logits_soft_cap is None:
        return None
    if isinstance(logits_soft_cap, bool) or not isinstance(logits_soft_cap, numbers.Real):
        raise TypeError(f"logits_soft_cap: expected a Python float > 0, got {logits_soft_cap!r}")
    if not (float(logits_soft_cap) > 0 and math.isfinite(float(logits_soft_cap))):
        raise ValueError(f"logits_soft_cap: expected a float > 0 and finite (None for no cap), "
                         f"got {logits_soft_cap!r}")
    return float(logits_soft_cap)
