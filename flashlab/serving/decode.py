"""Serving: attention of a few new tokens over a KV cache (decode and chunked prefill).

``decode_attention`` is the serving contract (validated once by
:func:`flashlab.contract.decode_validate.validate_decode`, then served by a backend from the decode
registry below, declared with :class:`flashlab.dispatch.registry.Backend` in the decode vocabulary
``paged, local_window, soft_cap, sinks, gqa, chunked_prefill``):

* ``reference``: gathers the pages into one contiguous cache and runs naive attention;
* ``tiled``: plain JAX, walks the cache a block of pages at a time with
  :func:`flashlab.ladder.online_softmax.update`, all ``G`` query heads of a kv head (times the new
  tokens) folded into the rows of one tile, so each K/V block is read once per kv head;
* ``pallas_tpu``: the Pallas TPU decode kernel (:mod:`flashlab.kernels.decode`).

Sinks (a per-head logit ``s_h`` that joins the softmax denominator and takes no value, as in
gpt-oss) are one more online-softmax state: ``m = s_h, l = 1, acc = 0``. Merging it with
:func:`flashlab.ladder.online_softmax.merge` adds ``exp(s_h - m)`` to the denominator and nothing
to the numerator: :func:`sink_state`.
"""
from __future__ import annotations

import jax.numpy as jnp

from flashlab.contract import device
from flashlab.dispatch import registry
from flashlab.contract.decode_validate import DECODE_FEATURES, DecodeSpec, validate_decode
from flashlab.dispatch.registry import Backend, Choice
from flashlab.ladder.decode import reference_decode, tiled_decode

__all__ = ["decode_attention", "decode_backends", "choose_decode", "register_decode",
           "DecodeSpec", "validate_decode"]


# ----------------------------------------------------------------------------- the registry

_DECODE_REGISTRY: dict[str, Backend] = {}


def register_decode(backend: Backend, *, replace: bool = False) -> Backend:
    """Add a decode backend (a :class:`flashlab.dispatch.registry.Backend` whose ``fn`` is
    ``fn(query, k_cache, v_cache, spec: DecodeSpec, *, interpret)``)."""
    if backend.name in _DECODE_REGISTRY and not replace:
        raise ValueError(f"backend: decode backend {backend.name!r} is already registered")
    _DECODE_REGISTRY[backend.name] = backend
    return backend


def decode_backends() -> list[Backend]:
    """Registered decode backends in registration order."""
    return list(_DECODE_REGISTRY.values())


_DECODE_PREFERENCE = {"tpu": ("pallas_tpu", "tiled", "reference"),
                      "gpu": ("tiled", "reference"), "cpu": ("tiled", "reference")}


def choose_decode(spec: DecodeSpec, backend: str = "auto", *, interpret=None,
                  platform: str | None = None) -> Choice:
    """Pick the decode backend for ``spec`` (``"auto"`` or a name) and say why.

    The platform is the compile target's while :func:`flashlab.instruments.tpu_compile.compile`
    builds for a TPU (:func:`flashlab.contract.device.target_chip`), else this host's.
    """
    if platform is None:
        platform = "tpu" if device.target_chip() is not None else device.platform()
    if backend != "auto":
        if not isinstance(backend, str) or backend not in _DECODE_REGISTRY:
            raise ValueError(f"backend: expected 'auto' or one of {list(_DECODE_REGISTRY)}, "
                             f"got {backend!r}")
        b = _DECODE_REGISTRY[backend]
        why = b.unsupported(spec, platform, interpret)
        if why:
            others = [o.name for o in decode_backends() if o.name != b.name
                      and not o.unsupported(spec, platform, interpret)]
            raise NotImplementedError(
                f"decode backend {b.name!r} does not support {', '.join(why)} (its "
                f"declaration: {b.declaration()}); decode backends that support this "
                f"request here: {others or 'none'}")
        return Choice(b.name, b.mode(platform, interpret), "requested by name", platform)
    considered = []
    for name in _DECODE_PREFERENCE.get(platform, _DECODE_PREFERENCE["cpu"]):
        b = _DECODE_REGISTRY.get(name)
        if b is None:
            continue
        why = b.unsupported(spec, platform, interpret)
        if why:
            considered.append((name, "does not support " + ", ".join(why)))
            continue
        return Choice(name, b.mode(platform, interpret), b.description, platform,
                      tuple(considered))
    raise NotImplementedError(f"no decode backend supports this request on {platform}: "
                              + "; ".join(f"{n}: {v}" for n, v in considered))


register_decode(Backend(
    "reference", "gathers the pages, then naive attention over the whole cache",
    reference_decode, platforms=frozenset(registry.PLATFORMS), features=DECODE_FEATURES,
    gradients=False))
register_decode(Backend(
    "tiled", "plain JAX: a block of pages at a time, G heads folded, online softmax",
    tiled_decode, platforms=frozenset(registry.PLATFORMS), features=DECODE_FEATURES,
    gradients=False))


def _pallas_tpu_decode(query, k_cache, v_cache, spec: DecodeSpec, *, interpret=None):
    from flashlab.kernels.decode import pallas_decode
    return pallas_decode(query, k_cache, v_cache, spec, interpret=interpret)


register_decode(Backend(
    "pallas_tpu", "flashlab.kernels.decode: page walk in the index maps, G heads folded, "
    "split-K merged with online_softmax.merge", _pallas_tpu_decode,
    platforms=frozenset({"tpu"}), interpret_platforms=frozenset({"cpu", "gpu"}),
    interpret_by_default=True, dtypes=frozenset({"bfloat16", "float32"}),
    features=DECODE_FEATURES, gradients=False, interpret_kind="Pallas interpreter"))


# ----------------------------------------------------------------------------- the contract

def decode_attention(query, k_cache, v_cache, *, cache_lengths, page_table=None, scale=None,
                     local_window_size=None, logits_soft_cap=None, sinks=None,
                     backend: str = "auto", interpret=None):
    """Attention of ``new_tokens`` queries per sequence over a (paged) KV cache.

    Args:
      query: ``[batch, new_tokens, q_heads, head_dim]``; ``new_tokens = 1`` is decode, more is
        a chunked prefill. Token ``t`` of sequence ``b`` sits at absolute position
        ``cache_lengths[b] - new_tokens + t``; its own key/value is already in the cache.
      k_cache, v_cache: contiguous ``[batch, max_len, kv_heads, head_dim(_v)]`` or paged
        ``[num_pages, page_size, kv_heads, head_dim(_v)]``, the query's dtype; ``q_heads`` a
        multiple of ``kv_heads`` (query head ``h`` reads kv head ``h // (q_heads // kv_heads)``).
      cache_lengths: int ``[batch]``: valid positions per sequence (0 = empty slot: zeros).
      page_table: int32 ``[batch, pages_per_sequence]`` for a paged cache: page
        ``page_table[b, i]`` holds positions ``i*page_size .. (i+1)*page_size - 1``.
      scale: logit scale, default ``1/sqrt(head_dim)``.
      local_window_size: int ``w`` (or a pair whose left side is used): a query at position
        ``p`` sees keys ``p - w .. p``.
      logits_soft_cap: ``c > 0``: logits become ``c * tanh(logits / c)`` after scaling.
      sinks: float ``[q_heads]``: a per-head logit that joins the softmax denominator and
        takes no value.
      backend: ``"auto"`` or a name from :func:`flashlab.serving.decode.decode_backends`.
      interpret: for ``pallas_tpu`` off a TPU: ``None``/``True`` generic interpreter, or a
        ``pltpu.InterpretParams`` (TPU interpret mode).

    Returns:
      ``[batch, new_tokens, q_heads, head_dim_v]`` in the query's dtype. Sequences whose
      traced lengths or page-table entries are out of range come back as NaN rows (see
      :mod:`flashlab.contract.decode_validate`); concrete bad values raise ``ValueError``.
    """
    q, k, v, spec = validate_decode(
        query, k_cache, v_cache, cache_lengths=cache_lengths, page_table=page_table,
        scale=scale, local_window_size=local_window_size, logits_soft_cap=logits_soft_cap,
        sinks=sinks)
    choice = choose_decode(spec, backend, interpret=interpret)
    out = _DECODE_REGISTRY[choice.backend].fn(q, k, v, spec, interpret=interpret)
    if spec.invalid is not None:
        out = jnp.where(spec.invalid[:, None, None, None], jnp.nan, out).astype(out.dtype)
    return out
