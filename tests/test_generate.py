"""Generation through the KV cache equals recomputing the prefix, token by token.

A random next-token DocumentModel (num_labels == vocab_size) continues two prompts greedily:
chunked prefill (two chunks) then decode, through contiguous and paged caches, against
generate_without_cache (the whole prefix recomputed for each new token). Speed is measured
by ``python -m flashlab bench generate``, never here.
"""
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")
from flax import nnx  # noqa: E402

from flashlab.models import DocumentModel, ModelConfig, generate, generate_without_cache  # noqa: E402

CFG = ModelConfig(vocab_size=32, d_model=32, num_heads=4, num_layers=2, num_labels=32)


@pytest.fixture(scope="module")
def setup():
    model = DocumentModel(CFG, "tiled", rngs=nnx.Rngs(0))
    prompt = jnp.asarray(np.random.default_rng(0).integers(1, 32, (2, 10)), jnp.int32)
    return model, prompt, np.asarray(generate_without_cache(model, prompt, 6, progress=False))


@pytest.mark.parametrize("page_size", [None, 4])
def test_cached_generation_equals_recomputing(setup, page_size):
    model, prompt, want = setup
    got = generate(model, prompt, 6, prefill_chunk=5, page_size=page_size, backend="tiled",
                   progress=False)
    assert got.shape == (2, 6) and got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got), want)


def test_ragged_prompts_equal_each_prompt_alone(setup):
    """Rows of different prompt lengths (right-padded) continue as each prompt would alone.

    Row 0 (all 10 tokens) against the recomputed continuation; row 1 (7 tokens, the rest
    padding that must never be read) against a batch whose every prompt is those 7 tokens
    (same shapes, so nothing new compiles).
    """
    model, prompt, want = setup
    padded = prompt.at[1, 7:].set(0)
    run = lambda n: generate(model, padded, 4, prefill_chunk=4, prompt_lengths=np.array(n),  # noqa: E731
                             backend="tiled", progress=False)
    got, seven = run([10, 7]), run([7, 7])
    np.testing.assert_array_equal(np.asarray(got[0]), want[0, :4])
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(seven[1]))
    with pytest.raises(ValueError, match=r"prompt_lengths: expected values in \[1, prompt_len = 10\]"):
        generate(model, prompt, 2, prompt_lengths=np.array([0, 10]), progress=False)


def test_generate_rejects_a_labeller():
    labeller = DocumentModel(ModelConfig(vocab_size=16, d_model=16, num_heads=2, num_layers=1),
                             rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="needs a next-token head .* got num_labels=2"):
        generate(labeller, jnp.ones((1, 4), jnp.int32), 2)
    model = DocumentModel(CFG, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="max_new_tokens: expected a positive int, got 0"):
        generate(model, jnp.ones((1, 4), jnp.int32), 0)
    with pytest.raises(ValueError, match=r"prompt_tokens: expected int \[batch, prompt_len"):
        generate(model, jnp.ones((4,), jnp.int32), 2)


def test_bench_generate_runs():
    """The benchmark CLI's measurement runs end to end on a tiny context (no timing asserted)."""
    from flashlab.benchmarks import generate as bench_generate
    r = bench_generate.run(context=48, new_tokens=4, recompute_tokens=2, prefill_chunk=16,
                           d_model=16, num_heads=2, num_layers=1, vocab_size=16)
    assert r["prompt"] == 44 and r["cached_s_per_token"] > 0 and r["recompute_s_per_token"] > 0
    assert "decode speed-up" in bench_generate.format_report(r)
