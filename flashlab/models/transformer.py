"""A small ``flax.nnx`` transformer that labels the tokens of documents, with swappable attention.

Attention is plugged in the Flax way: each block holds an ``nnx.MultiHeadAttention`` whose
``attention_fn`` is :func:`flashlab.as_flax_attention_fn` for the chosen backend. How packed
documents are kept apart (``ModelConfig.attention``):

- ``"segment_ids"`` (default): the block runs the layer's own q/k/v/out projections and calls
  its ``attention_fn`` with ``segment_ids=`` and ``is_causal=True``. The kernel receives
  ``O(seq)`` integers and builds each tile's mask itself, so memory stays ``O(seq)``.
- ``"dense_mask"``: the stock Flax call ``mha(x, mask=...)`` with the ``[batch, 1, seq, seq]``
  boolean mask built from the segment ids (Flax's ``attention_fn`` signature has only ``mask``
  and ``bias``). Same numbers, but an ``O(seq^2)`` mask is materialized and read by every
  backend, which gives back the memory wall that flash attention removed.

Both modes share the same parameters (the projections are the MultiHeadAttention's), so one
model can be run either way.

Generation (chapter 12): attention is causal, so a model whose head has one class per token
(``num_labels == vocab_size``) is a next-token language model. :meth:`DocumentModel.step`
runs new tokens through per-layer :class:`flashlab.KVCache` s with
:func:`flashlab.decode_attention` instead of attending over the whole prefix again;
:func:`flashlab.models.generate` drives it (chunked prefill, then decode).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from flashlab.dispatch.api import as_flax_attention_fn

__all__ = ["ModelConfig", "DocumentModel", "sinusoidal_positions"]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Sizes of a :class:`DocumentModel` (hashable: usable as a static argument).

    Attributes:
      vocab_size: token ids ``0 .. vocab_size - 1`` (``0`` is padding).
      d_model, num_heads, num_layers, mlp_ratio: width, heads (``head_dim = d_model //
        num_heads``), blocks, MLP hidden width as a multiple of ``d_model``.
      num_labels: classes per token.
      attention: ``"segment_ids"`` or ``"dense_mask"`` (see the module docstring).
    """
    vocab_size: int = 64
    d_model: int = 64
    num_heads: int = 4
    num_layers: int = 2
    mlp_ratio: int = 2
    num_labels: int = 2
    attention: str = "segment_ids"

    def __post_init__(self):
        if self.d_model % self.num_heads:
            raise ValueError(f"num_heads: must divide d_model={self.d_model}, got {self.num_heads}")
        if self.attention not in ("segment_ids", "dense_mask"):
            raise ValueError("attention: expected 'segment_ids' or 'dense_mask', "
                             f"got {self.attention!r}")


class Block(nnx.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, cfg: ModelConfig, backend: str, *, rngs: nnx.Rngs):
        d = cfg.d_model
        self.mode = cfg.attention
        self.norm1 = nnx.LayerNorm(d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            num_heads=cfg.num_heads, in_features=d, decode=False, rngs=rngs,
            attention_fn=as_flax_attention_fn(backend=backend))
        self.norm2 = nnx.LayerNorm(d, rngs=rngs)
        self.mlp_in = nnx.Linear(d, cfg.mlp_ratio * d, rngs=rngs)
        self.mlp_out = nnx.Linear(cfg.mlp_ratio * d, d, rngs=rngs)

    def attend(self, h, segment_ids):
        """Causal self-attention within each segment: ``h [B, T, d_model]`` -> same shape."""
        a = self.attn
        if self.mode == "dense_mask":
            same = nnx.make_attention_mask(segment_ids, segment_ids, jnp.equal)   # [B, 1, T, T]
            return a(h, mask=same, is_causal=True)
        q, k, v = a.query(h), a.key(h), a.value(h)                 # [B, T, heads, head_dim]
        o = a.attention_fn(q, k, v, is_causal=True, segment_ids=segment_ids)
        return a.out(o)                                            # [B, T, d_model]

    def __call__(self, x, segment_ids):
        x = x + self.attend(self.norm1(x), segment_ids)
        return self.feed_forward(x)

    def feed_forward(self, x):
        """``x + mlp(norm(x))``: ``[B, T, d_model]`` -> same shape."""
        return x + self.mlp_out(jax.nn.gelu(self.mlp_in(self.norm2(x))))

    def step(self, x, cache, backend: str = "auto"):
        """The block on ``n`` new tokens ``x [B, n, d_model]`` of one document per row.

        Their keys/values join ``cache`` (a :class:`flashlab.KVCache`), and they attend over
        it with :func:`flashlab.decode_attention` (causal within the row's cache: the same
        numbers as :meth:`__call__` on the whole prefix). Returns ``(x, cache)``.
        """
        a = self.attn
        h = self.norm1(x)
        q, k, v = a.query(h), a.key(h), a.value(h)                 # [B, n, heads, head_dim]
        cache = cache.append(k.astype(cache.k.dtype), v.astype(cache.v.dtype))
        o = cache.attend(q.astype(cache.k.dtype), backend=backend)
        return self.feed_forward(x + a.out(o.astype(x.dtype))), cache


def sinusoidal_positions(positions, d_model: int):
    """Fixed sine/cosine embeddings of int ``positions [B, T]`` -> ``[B, T, d_model]`` float32.

    No table, so the same trained model runs at any document length.
    """
    i = jnp.arange(d_model // 2, dtype=jnp.float32)
    freq = 1.0 / (10_000.0 ** (2 * i / d_model))                 # [d_model / 2]
    angle = positions[..., None].astype(jnp.float32) * freq      # [B, T, d_model / 2]
    return jnp.concatenate([jnp.sin(angle), jnp.cos(angle)], axis=-1)


_List = getattr(nnx, "List", list)   # nnx.List on flax >= 0.12; a plain list before


class DocumentModel(nnx.Module):
    """Token labeller: token embedding + sinusoidal in-document position, blocks, norm, head.

    ``model(tokens, segment_ids, positions)`` with int ``[B, T]`` arrays (a
    :class:`flashlab.models.Batch`'s fields) returns logits ``[B, T, num_labels]`` float32.
    ``backend`` is any name of :func:`flashlab.backends` (or ``"auto"``); it changes how
    attention is computed, never what.
    """

    def __init__(self, cfg: ModelConfig, backend: str = "auto", *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, rngs=rngs)
        self.blocks = _List([Block(cfg, backend, rngs=rngs) for _ in range(cfg.num_layers)])
        self.norm = nnx.LayerNorm(cfg.d_model, rngs=rngs)
        self.head = nnx.Linear(cfg.d_model, cfg.num_labels, rngs=rngs)

    def __call__(self, tokens, segment_ids, positions):
        x = self.embed(tokens) + sinusoidal_positions(positions, self.cfg.d_model)  # [B, T, d]
        for block in self.blocks:
            x = block(x, segment_ids)
        return self.head(self.norm(x))                             # [B, T, num_labels]

    def step(self, tokens, positions, caches, backend: str = "auto"):
        """Run ``n`` new tokens per row through the caches: the serving path.

        ``tokens``/``positions`` int ``[B, n]`` (one document per row, positions continuing
        each row's cache), ``caches`` one :class:`flashlab.KVCache` per block. Returns
        ``(logits [B, n, num_labels] float32, caches)``; the logits equal ``self(...)``'s at
        those positions. ``backend`` names a :func:`flashlab.decode_attention` backend.
        """
        x = self.embed(tokens) + sinusoidal_positions(positions, self.cfg.d_model)
        new = []
        for block, cache in zip(self.blocks, caches):
            x, cache = block.step(x, cache, backend)
            new.append(cache)
        return self.head(self.norm(x)), new
