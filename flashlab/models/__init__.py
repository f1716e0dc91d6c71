"""A small document model that reuses flashlab's attention (chapter 11).

- :mod:`~flashlab.models.corpus`: synthetic documents whose tokens are labelled "has the key
  token appeared so far in this document?", generated from a seed.
- :mod:`~flashlab.models.packing`: documents packed into fixed rows with segment ids and
  in-document positions (:func:`pack`), or padded one per row (:func:`pad`).
- :mod:`~flashlab.models.transformer`: :class:`DocumentModel`, a ``flax.nnx`` transformer whose
  attention is :func:`flashlab.as_flax_attention_fn` for any backend.
- :mod:`~flashlab.models.training`: :func:`train` (plain Adam, tqdm progress).
- :mod:`~flashlab.models.generation`: :func:`generate` (greedy, chunked prefill then decode
  through :class:`flashlab.KVCache`) and :func:`generate_without_cache` (the baseline).
- :mod:`~flashlab.models.memory`: peak memory of a long-document forward in a child process
  under an address-space cap.

Needs ``flax`` (``pip install "flashlab[flax]"``).
"""
from flashlab.models.corpus import KEY, PAD, key_seen, make_documents
from flashlab.models.generation import generate, generate_without_cache, init_caches
from flashlab.models.memory import forward_memories, forward_memory
from flashlab.models.packing import Batch, pack, pad, unpack
from flashlab.models.training import TrainConfig, train, train_model
from flashlab.models.transformer import DocumentModel, ModelConfig

__all__ = ["KEY", "PAD", "key_seen", "make_documents", "Batch", "pack", "pad", "unpack",
           "ModelConfig", "DocumentModel", "TrainConfig", "train", "train_model", "forward_memory",
           "forward_memories", "generate", "generate_without_cache", "init_caches"]
