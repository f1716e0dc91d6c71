"""Chapter 11's document model: corpus, packing, packed == unpacked, training on every CPU backend."""
import numpy as np
import pytest

pytest.importorskip("flax")
from flax import nnx  # noqa: E402

from flashlab.dispatch import registry
from flashlab.models import (KEY, DocumentModel, ModelConfig, TrainConfig, forward_memories,  # noqa: E402
                             key_seen, make_documents, pack, pad, train, unpack)

CPU_BACKENDS = ["reference", "xla", "tiled", "pallas_tpu"]
SMALL = ModelConfig(vocab_size=16, d_model=32, num_heads=2, num_layers=1)
SMALL_TRAIN = TrainConfig(rows=2, row_len=64, max_len=32, lr=1e-2)
# float32 throughout. Packed vs padded: the same per-document math, only the number of
# masked-out keys differs, so outputs agree to rounding (measured: exactly equal on CPU).
PACK_ATOL = 1e-5
# Two training steps on different backends: measured |difference| <= 2e-7.
LOSS_ATOL = 1e-5


def _available(name):
    b = registry.get(name)
    return b.availability() is None


def test_corpus_is_seeded_and_labelled():
    a, b = make_documents(3, 20), make_documents(3, 20)
    assert all((x[0] == y[0]).all() for x, y in zip(a, b))
    for tokens, labels in a:
        assert 4 <= len(tokens) <= 48 and tokens.dtype == np.int32
        np.testing.assert_array_equal(labels, key_seen(tokens))
    np.testing.assert_array_equal(key_seen([5, 1, 7, 1, 2]), [0, 1, 1, 1, 1])
    assert 0.2 < np.mean([(t == KEY).any() for t, _ in make_documents(0, 400)]) < 0.8
    with pytest.raises(ValueError, match="min_len"):
        make_documents(0, 1, min_len=5, max_len=4)


def test_pack_and_pad_layout():
    docs = make_documents(1, 9, max_len=30)
    p = pack(docs, 64)
    assert p.tokens.shape[1] == 64 and len(p.spans) == 9
    for (tokens, labels), got_t, got_l, got_pos, got_seg in zip(
            docs, unpack(p, p.tokens), unpack(p, p.labels), unpack(p, p.positions),
            unpack(p, p.segment_ids)):
        np.testing.assert_array_equal(got_t, tokens)
        np.testing.assert_array_equal(got_l, labels)
        np.testing.assert_array_equal(got_pos, np.arange(len(tokens)))
        assert len(set(got_seg.tolist())) == 1 and got_seg[0] >= 1
    assert ((p.segment_ids == 0) == (p.weights == 0)).all()
    assert p.weights.sum() == sum(len(t) for t, _ in docs)
    d = pad(docs)
    assert d.shape == (9, max(len(t) for t, _ in docs)) and set(np.unique(d.segment_ids)) <= {0, 1}
    assert p.fill() > d.fill()
    with pytest.raises(ValueError, match="do not fit"):
        pack(docs, 64, rows=1)
    assert len(pack(docs, 64, rows=1, drop_overflow=True).spans) < 9
    with pytest.raises(ValueError, match="row_len"):
        pack(docs, 8)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_packed_outputs_equal_unpacked(backend):
    """The same model on packed rows (segment ids) and on one padded document per row."""
    if not _available(backend):
        pytest.skip(registry.get(backend).availability())
    docs = make_documents(2, 8, vocab_size=16, max_len=30)
    packed, padded = pack(docs, 64), pad(docs)
    model = DocumentModel(SMALL, backend, rngs=nnx.Rngs(0))
    a = model(packed.tokens, packed.segment_ids, packed.positions)
    b = model(padded.tokens, padded.segment_ids, padded.positions)
    for x, y in zip(unpack(packed, a), unpack(padded, b)):
        np.testing.assert_allclose(x, y, atol=PACK_ATOL, rtol=0)
    # The test has teeth: without segment ids, documents see their neighbours' keys.
    leaky = model(packed.tokens, (packed.segment_ids > 0).astype(np.int32), packed.positions)
    assert max(np.abs(x - y).max() for x, y in zip(unpack(packed, leaky), unpack(padded, b))) > 1e-3


def test_segment_ids_and_dense_mask_modes_agree():
    """Same parameters, two ways to keep documents apart: O(N) ids or Flax's O(N^2) mask."""
    docs = make_documents(4, 8, vocab_size=16, max_len=30)
    p = pack(docs, 64)
    ids = DocumentModel(SMALL, "tiled", rngs=nnx.Rngs(0))
    dense = DocumentModel(ModelConfig(**{**SMALL.__dict__, "attention": "dense_mask"}), "tiled",
                          rngs=nnx.Rngs(0))
    np.testing.assert_allclose(ids(p.tokens, p.segment_ids, p.positions),
                               dense(p.tokens, p.segment_ids, p.positions), atol=PACK_ATOL)


@pytest.fixture(scope="module")
def reference_losses():
    return train(SMALL, "reference", steps=2, seed=0, cfg=SMALL_TRAIN, progress=False)


@pytest.mark.parametrize("backend", CPU_BACKENDS[1:])
def test_two_training_steps_agree_across_backends(backend, reference_losses):
    if not _available(backend):
        pytest.skip(registry.get(backend).availability())
    losses = train(SMALL, backend, steps=2, seed=0, cfg=SMALL_TRAIN, progress=False)
    assert losses.shape == (2,) and np.isfinite(losses).all()
    assert losses[0] > 0.3                       # an untrained binary labeller: ~log 2
    np.testing.assert_allclose(losses, reference_losses, atol=LOSS_ATOL, rtol=0)


def test_long_document_out_of_memory_is_reported_by_the_capped_child():
    """The reference materializes [heads, T, T] float32 scores (1 GiB at T = 8192, 4 heads):
    under a 3 GiB address-space cap the child reports the allocation failure instead of dying.
    (The tiled run that fits is measured in chapter 11.)"""
    cap = 3 * 2**30
    (ref,) = forward_memories([dict(backend="reference", seq_len=8192)], cap_bytes=cap,
                              model_cfg=ModelConfig(num_heads=4, num_layers=1))
    assert not ref["ok"] and "RESOURCE_EXHAUSTED" in ref["error"], ref
    assert 0 < ref["peak_rss_bytes"] < cap
