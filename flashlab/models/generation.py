"""Greedy generation with a KV cache (chunked prefill, then decode), and without one.

:func:`generate` runs the prompt through :meth:`DocumentModel.step` a chunk at a time
(chunked prefill: each chunk attends to the cache so far plus itself), then one token per
step (decode): every step computes q, k, v for the new tokens only and reads the cache once.
:func:`generate_without_cache` is the baseline that recomputes the whole prefix for every
new token. Greedy outputs are equal token by token (tests/test_generate.py); the speed ratio
is ``python -m flashlab bench generate``.

The model must predict the next token: a :class:`DocumentModel` whose ``num_labels`` equals
its ``vocab_size``. Each row of ``prompt_tokens`` is one document (positions ``0 .. T-1``).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from flashlab.serving.kv_cache import KVCache
from flashlab.models.transformer import DocumentModel

__all__ = ["generate", "generate_without_cache", "init_caches"]


def _check(model, prompt_tokens, max_new_tokens):
    if not isinstance(model, DocumentModel):
        raise TypeError(f"model: expected a flashlab.models.DocumentModel, got "
                        f"{type(model).__name__}")
    cfg = model.cfg
    if cfg.num_labels != cfg.vocab_size:
        raise ValueError(f"model: generation needs a next-token head (num_labels == vocab_size"
                         f" = {cfg.vocab_size}), got num_labels={cfg.num_labels}")
    p = jnp.asarray(prompt_tokens)
    if p.ndim != 2 or p.shape[1] < 1 or not jnp.issubdtype(p.dtype, jnp.integer):
        raise ValueError(f"prompt_tokens: expected int [batch, prompt_len >= 1], got shape "
                         f"{tuple(p.shape)} dtype {p.dtype}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) \
            or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected a positive int, got {max_new_tokens!r}")
    return p.astype(jnp.int32)


def init_caches(model: DocumentModel, batch: int, max_len: int, *, page_size: int | None = None,
                dtype=jnp.float32) -> list[KVCache]:
    """One empty :class:`flashlab.serving.kv_cache.KVCache` per block for ``batch`` rows of up to ``max_len`` tokens.

    ``page_size=None``: contiguous ``[batch, max_len, heads, head_dim]``; otherwise paged,
    a pool of ``batch * ceil(max_len / page_size)`` pages.
    """
    cfg = model.cfg
    H, D = cfg.num_heads, cfg.d_model // cfg.num_heads
    if page_size is None:
        make = lambda: KVCache.contiguous(batch, max_len, H, D, dtype)   # noqa: E731
    else:
        per_seq = -(-max_len // page_size)
        make = lambda: KVCache.paged(batch, batch * per_seq, page_size, H, D,   # noqa: E731
                                     pages_per_sequence=per_seq, dtype=dtype)
    return [make() for _ in range(cfg.num_layers)]


# The caches are donated: each step updates them in place instead of copying them whole.
@functools.partial(jax.jit, static_argnums=(0, 4), donate_argnums=(5,))
def _step(graphdef, state, tokens, positions, backend, caches):
    model = nnx.merge(graphdef, state)
    logits, caches = model.step(tokens, positions, caches, backend)
    return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32), caches


def generate(model: DocumentModel, prompt_tokens, max_new_tokens: int, *, backend: str = "auto",
             prefill_chunk: int = 256, page_size: int | None = None,
             progress: bool = True) -> jax.Array:
    """Greedy continuation of each prompt, through a KV cache.

    Args:
      model: a :class:`DocumentModel` with ``num_labels == vocab_size``.
      prompt_tokens: int ``[batch, prompt_len]``, one document per row.
      max_new_tokens: how many tokens to generate per row.
      backend: the :func:`flashlab.decode_attention` backend (``"auto"``, ``"tiled"``, ...).
      prefill_chunk: prompt tokens per prefill step (chunked prefill).
      page_size: ``None`` for contiguous caches, else paged caches with this page size.
      progress: a tqdm bar over the generated tokens.

    Returns:
      int32 ``[batch, max_new_tokens]``: the new tokens (argmax of each step's logits).
    """
    prompt = _check(model, prompt_tokens, max_new_tokens)
    if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk < 1:
        raise ValueError(f"prefill_chunk: expected a positive int, got {prefill_chunk!r}")
    B, T = prompt.shape
    caches = init_caches(model, B, T + max_new_tokens, page_size=page_size)
    graphdef, state = nnx.split(model)
    pos = jnp.broadcast_to(jnp.arange(T + max_new_tokens, dtype=jnp.int32), (B, T + max_new_tokens))
    for c0 in range(0, T, prefill_chunk):                       # chunked prefill
        c1 = min(T, c0 + prefill_chunk)
        token, caches = _step(graphdef, state, prompt[:, c0:c1], pos[:, c0:c1], backend, caches)
    out = [token]
    for t in tqdm(range(T, T + max_new_tokens - 1), desc="decode", disable=not progress,
                  initial=1, total=max_new_tokens):
        token, caches = _step(graphdef, state, token[:, None], pos[:, t:t + 1], backend, caches)
        out.append(token)
    return jnp.stack(out, axis=1)


@functools.partial(jax.jit, static_argnums=(0,))
def _full_step(graphdef, state, buf, t):
    model = nnx.merge(graphdef, state)
    B, L = buf.shape
    pos = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
    logits = model(buf, jnp.ones_like(buf), pos)                 # [B, L, vocab]
    token = jnp.argmax(jax.lax.dynamic_index_in_dim(logits, t - 1, 1, False), axis=-1)
    return jax.lax.dynamic_update_index_in_dim(buf, token.astype(buf.dtype), t, 1)


def generate_without_cache(model: DocumentModel, prompt_tokens, max_new_tokens: int, *,
                           progress: bool = True) -> jax.Array:
    """Greedy continuation recomputing the whole prefix for every new token (the baseline).

    Each step runs ``model(...)`` over a buffer of ``prompt_len + max_new_tokens`` tokens
    (one compilation; causal attention keeps the not-yet-written tail from affecting the
    prefix) and reads the logits at the last written position. Attention uses the backend
    the model was built with. Returns int32 ``[batch, max_new_tokens]``.
    """
    prompt = _check(model, prompt_tokens, max_new_tokens)
    B, T = prompt.shape
    L = T + max_new_tokens
    buf = jnp.zeros((B, L), jnp.int32).at[:, :T].set(prompt)
    graphdef, state = nnx.split(model)
    for t in tqdm(range(T, L), desc="recompute", disable=not progress):
        buf = _full_step(graphdef, state, buf, t)
    return buf[:, T:]
