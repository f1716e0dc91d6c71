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
    """One empty :class:`flashlab.serving.kv_cache.KVCache` per block for ``batch`` rows of up to
    ``max_len`` tokens.

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
             prefill_chunk: int = 256, page_size: int | None = None, prompt_lengths=None,
             progress: bool = True) -> jax.Array:
    """Greedy continuation of each prompt, through a KV cache.

    Args:
      model: a :class:`DocumentModel` with ``num_labels == vocab_size``.
      prompt_tokens: int ``[batch, prompt_len]``, one document per row.
      max_new_tokens: how many tokens to generate per row.
      prompt_lengths: optional int ``[batch]`` in ``[1, prompt_len]``: row ``b``'s prompt is
        ``prompt_tokens[b, :prompt_lengths[b]]`` (right-padded; the padding is never read).
        Default: every row is ``prompt_len`` long.
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
    lengths = _prompt_lengths(prompt_lengths, B, T)
    caches = init_caches(model, B, T + max_new_tokens, page_size=page_size)
    graphdef, state = nnx.split(model)
    L = T + max_new_tokens
    pos = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
    # Chunked prefill over the positions every prompt has; then one token per row per step.
    # Row b feeds its own prompt token while it has one (t < lengths[b]) and its last
    # generated token after, so every row sits at the same position t and a ragged batch
    # needs no per-row loop: row b's new tokens are the steps t = lengths[b] - 1, ... .
    common = int(lengths.min())
    for c0 in range(0, common, prefill_chunk):
        c1 = min(common, c0 + prefill_chunk)
        token, caches = _step(graphdef, state, prompt[:, c0:c1], pos[:, c0:c1], backend, caches)
    steps = [token]                                   # the token predicted after position t
    last = int(lengths.max()) + max_new_tokens - 1    # the last position any row still needs
    for t in tqdm(range(common, last), desc="decode", disable=not progress):
        feed = jnp.where(t < lengths, prompt[:, min(t, T - 1)], token)
        token, caches = _step(graphdef, state, feed[:, None], pos[:, t:t + 1], backend, caches)
        steps.append(token)
    steps = jnp.stack(steps, axis=1)                  # [B, last - common + 1]
    first = jnp.asarray(lengths - common)             # row b's first new token's step
    idx = first[:, None] + jnp.arange(max_new_tokens)[None, :]
    return jnp.take_along_axis(steps, idx, axis=1)


def _prompt_lengths(prompt_lengths, B: int, T: int) -> np.ndarray:
    """Concrete int ``[B]`` in ``[1, T]`` (default: all ``T``), or a ValueError naming it."""
    if prompt_lengths is None:
        return np.full((B,), T, np.int64)
    try:
        lengths = np.asarray(prompt_lengths)
    except Exception as e:   # a tracer: the loop bounds need concrete lengths
        raise TypeError(f"prompt_lengths: expected concrete ints (generate runs a Python loop "
                        f"over positions), got {type(prompt_lengths).__name__}") from e
    if lengths.shape != (B,) or not np.issubdtype(lengths.dtype, np.integer):
        raise ValueError(f"prompt_lengths: expected int [batch] = [{B}], got shape "
                         f"{lengths.shape} dtype {lengths.dtype}")
    if lengths.min() < 1 or lengths.max() > T:
        raise ValueError(f"prompt_lengths: expected values in [1, prompt_len = {T}], got "
                         f"{lengths.tolist()}")
    return lengths.astype(np.int64)


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
