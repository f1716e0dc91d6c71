"""``python -m flashlab bench generate``: tokens/s with a KV cache vs recomputing the prefix.

The chapter-11 document model (``ModelConfig`` defaults: d_model 64, 4 heads, 2 layers) with a
next-token head generates greedily at a ``--context`` of 2048 tokens, one process, one run:

* cached: chunked prefill of the prompt (``--prefill-chunk``), then one decode step per new
  token through the KV caches (:func:`flashlab.models.generate`'s step function);
* recompute: every new token runs the whole model over the ``context``-token buffer again
  (:func:`flashlab.models.generate_without_cache`'s step function).

Compilation is excluded (each step function runs once on the same shapes first). The two
paths are interleaved (a run of decode steps, then one recompute step) so that they see the
same machine load, and each path's time per token is the median of its steps. Reports
seconds per token, tokens/s, and the ratios: decode alone, and end to end (prefill plus the
new tokens vs the same tokens recomputed). The issue's target: decode >= 10x at 2k context.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["main", "run"]


def _block(x):
    return jax.block_until_ready(x)


def run(*, context: int = 2048, new_tokens: int = 32, recompute_tokens: int = 8,
        prefill_chunk: int = 512, batch: int = 1, backend: str = "auto",
        page_size: int | None = None, d_model: int = 64, num_heads: int = 4,
        num_layers: int = 2, vocab_size: int = 64, seed: int = 0) -> dict:
    """Time both paths; returns a dict of the measurements (seconds, tokens/s, ratios)."""
    from flax import nnx

    from flashlab.models import DocumentModel, ModelConfig
    from flashlab.models import generation as gen

    cfg = ModelConfig(vocab_size=vocab_size, d_model=d_model, num_heads=num_heads,
                      num_layers=num_layers, num_labels=vocab_size)
    model = DocumentModel(cfg, "auto", rngs=nnx.Rngs(seed))
    T = context - new_tokens
    if T < 1:
        raise ValueError(f"new_tokens: must be < context={context}, got {new_tokens}")
    rng = np.random.default_rng(seed)
    prompt = jnp.asarray(rng.integers(1, vocab_size, (batch, T)), jnp.int32)
    graphdef, state = nnx.split(model)
    pos = jnp.broadcast_to(jnp.arange(context, dtype=jnp.int32), (batch, context))

    def prefill():
        caches = gen.init_caches(model, batch, context, page_size=page_size)
        for c0 in range(0, T, prefill_chunk):
            c1 = min(T, c0 + prefill_chunk)
            tok, caches = gen._step(graphdef, state, prompt[:, c0:c1], pos[:, c0:c1], backend,
                                    caches)
        return _block((tok, caches))

    def decode_step(tok, caches, t):
        return _block(gen._step(graphdef, state, tok[:, None], pos[:, t:t + 1], backend, caches))

    buf = jnp.zeros((batch, context), jnp.int32).at[:, :T].set(prompt)
    tok, caches = prefill()                               # compile the prefill chunk shapes
    decode_step(tok, caches, T)                           # compile the decode step
    _block(gen._full_step(graphdef, state, buf, T))       # compile the recompute step
    t0 = time.perf_counter()
    tok, caches = prefill()
    t_prefill = time.perf_counter() - t0
    # Interleaved (a run of decode steps, then one recompute step), so that both paths see
    # the same machine load; each path's time per token is the median of its steps.
    cached, full = [], []
    per_round = max(1, new_tokens // recompute_tokens)
    for t in range(T, T + new_tokens):
        t0 = time.perf_counter()
        tok, caches = decode_step(tok, caches, t)
        cached.append(time.perf_counter() - t0)
        if (t - T + 1) % per_round == 0 and len(full) < recompute_tokens:
            t0 = time.perf_counter()
            buf = _block(gen._full_step(graphdef, state, buf, T + len(full)))
            full.append(time.perf_counter() - t0)
    t_decode, t_full = float(np.median(cached)), float(np.median(full))

    end_cached = t_prefill + new_tokens * t_decode
    end_full = new_tokens * t_full
    return dict(device=jax.devices()[0].device_kind, context=context, prompt=T,
                new_tokens=new_tokens, batch=batch, backend=backend, page_size=page_size,
                model=dict(d_model=d_model, num_heads=num_heads, num_layers=num_layers,
                           vocab_size=vocab_size),
                prefill_s=t_prefill, cached_s_per_token=t_decode,
                recompute_s_per_token=t_full,
                cached_tokens_per_s=batch / t_decode, recompute_tokens_per_s=batch / t_full,
                decode_ratio=t_full / t_decode, end_to_end_ratio=end_full / end_cached)


def format_report(r: dict) -> str:
    m = r["model"]
    lines = [
        f"generate on {r['device']}: context {r['context']} (prompt {r['prompt']} + "
        f"{r['new_tokens']} new), batch {r['batch']}, decode backend {r['backend']}, "
        f"{'paged ' + str(r['page_size']) if r['page_size'] else 'contiguous'} cache; model "
        f"d_model={m['d_model']} heads={m['num_heads']} layers={m['num_layers']} "
        f"vocab={m['vocab_size']}",
        f"  prefill (chunked)     {r['prefill_s'] * 1e3:10.1f} ms",
        f"  cached decode         {r['cached_s_per_token'] * 1e3:10.2f} ms/token  "
        f"{r['cached_tokens_per_s']:9.1f} tokens/s",
        f"  recompute the prefix  {r['recompute_s_per_token'] * 1e3:10.2f} ms/token  "
        f"{r['recompute_tokens_per_s']:9.1f} tokens/s",
        f"  decode speed-up       {r['decode_ratio']:10.1f}x  (target >= 10x)",
        f"  end to end ({r['new_tokens']} tokens, prefill included) "
        f"{r['end_to_end_ratio']:.1f}x",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m flashlab bench generate",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--recompute-tokens", type=int, default=8,
                   help="tokens timed on the (slow) recompute path")
    p.add_argument("--prefill-chunk", type=int, default=512)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--backend", default="auto", help="decode_attention backend")
    p.add_argument("--page-size", type=int, default=None, help="paged caches (default contiguous)")
    p.add_argument("--json", action="store_true", help="print the measurements as JSON")
    a = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    r = run(context=a.context, new_tokens=a.new_tokens, recompute_tokens=a.recompute_tokens,
            prefill_chunk=a.prefill_chunk, batch=a.batch, backend=a.backend,
            page_size=a.page_size)
    print(json.dumps(r, indent=1) if a.json else format_report(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
