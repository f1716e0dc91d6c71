"""Variable-length documents as fixed-shape batches: packed rows with segment ids, or padded.

Both forms are a :class:`Batch` of ``[rows, row_len]`` arrays. In the packed form a row holds
several documents back to back; ``segment_ids`` say which document each token belongs to
(``1, 2, ...`` within the row; ``0`` is padding) and ``positions`` restart at 0 at every
document, so a model that masks attention by segment and embeds positions from ``positions``
computes for each document exactly what it computes for that document alone. The padded form
(:func:`pad`) puts one document per row: the same model, the same outputs, more rows.
"""
from __future__ import annotations

import dataclasses

import numpy as np

__all__ = ["Batch", "pack", "pad", "unpack"]


@dataclasses.dataclass(frozen=True)
class Batch:
    """A fixed-shape batch of documents. All arrays are ``[rows, row_len]``.

    Attributes:
      tokens: int32 token ids, ``0`` on padding.
      labels: int32 labels (``0`` on padding).
      segment_ids: int32, ``1, 2, ...`` for the documents of a row in order, ``0`` on padding.
      positions: int32 position of each token inside its document (``0`` on padding).
      weights: float32, 1 on document tokens and 0 on padding (the loss weights).
      spans: per document, ``(row, start, length)`` in input order (for :func:`unpack`).
    """
    tokens: np.ndarray
    labels: np.ndarray
    segment_ids: np.ndarray
    positions: np.ndarray
    weights: np.ndarray
    spans: tuple[tuple[int, int, int], ...]

    @property
    def shape(self) -> tuple[int, int]:
        return self.tokens.shape

    def fill(self) -> float:
        """Fraction of the ``rows * row_len`` slots that hold document tokens."""
        return float(self.weights.mean())


def _build(docs, placements, rows: int, row_len: int) -> Batch:
    arrays = {n: np.zeros((rows, row_len), np.int32)
              for n in ("tokens", "labels", "segment_ids", "positions")}
    seg_count = np.zeros(rows, np.int32)
    for (tokens, labels), (r, s) in zip(docs, placements):
        n = len(tokens)
        seg_count[r] += 1
        arrays["tokens"][r, s:s + n] = tokens
        arrays["labels"][r, s:s + n] = labels
        arrays["segment_ids"][r, s:s + n] = seg_count[r]
        arrays["positions"][r, s:s + n] = np.arange(n)
    weights = (arrays["segment_ids"] > 0).astype(np.float32)
    spans = tuple((r, s, len(d[0])) for d, (r, s) in zip(docs, placements))
    return Batch(**arrays, weights=weights, spans=spans)


def pack(docs, row_len: int, rows: int | None = None, *, drop_overflow: bool = False) -> Batch:
    """Pack documents ``[(tokens [L_i], labels [L_i]), ...]`` into ``[rows, row_len]`` rows.

    Next-fit in input order: a document goes into the current row if it fits, else it starts
    the next row. ``rows=None`` uses as many rows as needed. With a fixed ``rows`` (a fixed
    shape for ``jit``), documents that do not fit raise ``ValueError``, or are dropped with
    ``drop_overflow=True`` (``Batch.spans`` lists only the documents kept).
    """
    placements, kept = [], []
    r, s = 0, 0
    for d in docs:
        n = len(d[0])
        if n > row_len:
            raise ValueError(f"docs: a document of length {n} does not fit row_len={row_len}")
        if s + n > row_len:
            r, s = r + 1, 0
        if rows is not None and r >= rows:
            if drop_overflow:
                break
            raise ValueError(f"docs: {len(docs)} documents do not fit {rows} rows of {row_len}")
        placements.append((r, s))
        kept.append(d)
        s += n
    used = (placements[-1][0] + 1) if placements else 0
    return _build(kept, placements, used if rows is None else rows, row_len)


def pad(docs, row_len: int | None = None) -> Batch:
    """One document per row, padded to ``row_len`` (default: the longest document)."""
    row_len = max(len(d[0]) for d in docs) if row_len is None else row_len
    if any(len(d[0]) > row_len for d in docs):
        raise ValueError(f"docs: a document is longer than row_len={row_len}")
    return _build(list(docs), [(i, 0) for i in range(len(docs))], len(docs), row_len)


def unpack(batch: Batch, values) -> list[np.ndarray]:
    """Per-token ``values [rows, row_len, ...]`` -> one ``[L_i, ...]`` array per document."""
    values = np.asarray(values)
    return [values[r, s:s + n] for r, s, n in batch.spans]

