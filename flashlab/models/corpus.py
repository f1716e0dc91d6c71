"""A synthetic document corpus, generated from a seed (nothing is downloaded).

The task is token labelling that needs attention across the document and only within it:
**has the key token appeared so far in this document?** Some documents contain the key token
``KEY`` once, at a random place; every token from there on is labelled 1, every token before
it (and every token of a document without it) 0. A token's label depends on the earlier tokens
of its own document and on nothing outside it: a model that attends across a document
boundary (packed rows without segment ids) sees an earlier document's key and gets it wrong.
"""
from __future__ import annotations

import numpy as np

__all__ = ["PAD", "KEY", "key_seen", "make_documents"]

PAD = 0          # token id of padding
KEY = 1          # the key token; ordinary tokens are 2 .. vocab_size - 1


def key_seen(tokens, key: int = KEY) -> np.ndarray:
    """Labels ``[L] int32`` for one document ``tokens [L]``: 1 from the first ``key`` on."""
    return (np.cumsum(np.asarray(tokens) == key) > 0).astype(np.int32)


def make_documents(rng: np.random.Generator | int, num_docs: int, *, vocab_size: int = 64,
                   min_len: int = 4, max_len: int = 48,
                   key_prob: float = 0.5) -> list[tuple[np.ndarray, np.ndarray]]:
    """``num_docs`` documents ``(tokens [L] int32, labels [L] int32)``, ``L`` uniform in
    ``[min_len, max_len]``.

    Ordinary tokens are uniform in ``2 .. vocab_size - 1``; with probability ``key_prob`` one
    of them, at a uniform position, is replaced by ``KEY``. Labels are :func:`key_seen`.
    ``rng`` is a ``numpy.random.Generator`` or a seed.
    """
    if not 1 <= min_len <= max_len:
        raise ValueError("min_len, max_len: expected 1 <= min_len <= max_len, "
                         f"got {min_len}, {max_len}")
    if vocab_size < 3:
        raise ValueError("vocab_size: expected >= 3 (padding, key, one ordinary token), "
                         f"got {vocab_size}")
    rng = np.random.default_rng(rng)
    docs = []
    for _ in range(num_docs):
        length = int(rng.integers(min_len, max_len + 1))
        tokens = rng.integers(KEY + 1, vocab_size, length).astype(np.int32)
        if rng.random() < key_prob:
            tokens[rng.integers(length)] = KEY
        docs.append((tokens, key_seen(tokens)))
    return docs
