"""Training the document model: packed synthetic batches, weighted cross-entropy, plain Adam.

Everything is seeded: the same ``seed`` gives the same initial weights and the same batches
whatever the backend, so two backends' loss curves differ only by floating-point rounding.
Adam is written out with ``jax.tree.map`` (a few lines; no optimizer library needed).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flashlab.models.corpus import make_documents
from flashlab.models.packing import Batch, pack
from flashlab.models.transformer import DocumentModel, ModelConfig

__all__ = ["TrainConfig", "sample_batch", "loss_fn", "adam_init", "adam_update", "train",
           "train_model"]


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Batch shape, corpus and optimizer settings of :func:`train`.

    Attributes:
      rows, row_len: every step packs documents into ``[rows, row_len]``.
      min_len, max_len: document lengths (uniform); ``max_len <= row_len``.
      lr, b1, b2, eps: Adam's step size and moments.
    """
    rows: int = 8
    row_len: int = 128
    min_len: int = 4
    max_len: int = 48
    lr: float = 3e-3
    b1: float = 0.9
    b2: float = 0.99
    eps: float = 1e-8


def sample_batch(seed: int, step: int, model_cfg: ModelConfig, cfg: TrainConfig) -> Batch:
    """The packed batch of ``step`` (a pure function of ``seed`` and ``step``)."""
    mean_len = (cfg.min_len + cfg.max_len) / 2
    n = int(2 * cfg.rows * cfg.row_len / mean_len) + cfg.rows        # more than enough
    docs = make_documents(np.random.default_rng([seed, step]), n, vocab_size=model_cfg.vocab_size,
                          min_len=cfg.min_len, max_len=cfg.max_len)
    return pack(docs, cfg.row_len, cfg.rows, drop_overflow=True)


def loss_fn(model: DocumentModel, tokens, labels, segment_ids, positions, weights):
    """Mean cross-entropy over document tokens (``weights`` 1) of ``[B, T]`` inputs; scalar."""
    logits = model(tokens, segment_ids, positions)                        # [B, T, labels]
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]  # [B, T]
    return (nll * weights).sum() / jnp.maximum(weights.sum(), 1.0)


def adam_init(params):
    """Adam state for a pytree of parameters: zero first and second moments, step 0."""
    zeros = jax.tree.map(jnp.zeros_like, params)
    return {"m": zeros, "v": zeros, "t": jnp.zeros((), jnp.int32)}


def adam_update(params, grads, state, cfg: TrainConfig):
    """One Adam step: ``(params, state) -> (new_params, new_state)`` (bias-corrected moments)."""
    t = state["t"] + 1
    m = jax.tree.map(lambda m, g: cfg.b1 * m + (1 - cfg.b1) * g, state["m"], grads)
    v = jax.tree.map(lambda v, g: cfg.b2 * v + (1 - cfg.b2) * g * g, state["v"], grads)
    c1, c2 = 1 - cfg.b1 ** t, 1 - cfg.b2 ** t
    new = jax.tree.map(lambda p, m, v: p - cfg.lr * (m / c1) / (jnp.sqrt(v / c2) + cfg.eps),
                       params, m, v)
    return new, {"m": m, "v": v, "t": t}


def train_model(model_cfg: ModelConfig, backend: str = "auto", steps: int = 100, seed: int = 0,
                cfg: TrainConfig = TrainConfig(), *, progress: bool = True):
    """Train a fresh :class:`DocumentModel`; returns ``(model, losses [steps] float64)``.

    ``losses[i]`` is the loss of step ``i``'s batch before its update. ``progress`` shows a
    tqdm bar.
    """
    if progress:
        from tqdm import tqdm   # the `flax` extra installs it
    else:
        def tqdm(it, **_):
            return it

    model = DocumentModel(model_cfg, backend, rngs=nnx.Rngs(seed))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    @jax.jit
    def step_fn(params, opt, batch):
        def loss_of(p):
            return loss_fn(nnx.merge(graphdef, p, rest), *batch)
        loss, grads = jax.value_and_grad(loss_of)(params)
        params, opt = adam_update(params, grads, opt, cfg)
        return params, opt, loss

    opt = adam_init(params)
    losses = np.zeros(steps)
    for i in tqdm(range(steps), desc=f"train [{backend}]"):
        b = sample_batch(seed, i, model_cfg, cfg)
        batch = (b.tokens, b.labels, b.segment_ids, b.positions, b.weights)
        params, opt, loss = step_fn(params, opt, batch)
        losses[i] = float(loss)
    return nnx.merge(graphdef, params, rest), losses


def train(model_cfg: ModelConfig, backend: str = "auto", steps: int = 100, seed: int = 0,
          cfg: TrainConfig = TrainConfig(), *, progress: bool = True) -> np.ndarray:
    """Train a fresh model with attention from ``backend``; returns the per-step losses
    ``[steps]`` (see :func:`train_model`)."""
    return train_model(model_cfg, backend, steps, seed, cfg, progress=progress)[1]
