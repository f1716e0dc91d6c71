"""Peak memory of one long-document forward, measured in a child process under a memory cap.

``forward_memory`` starts ``python -m flashlab.models.memory`` with ``RLIMIT_AS`` (the
address-space limit) set to the cap, builds a :class:`DocumentModel`, runs one jitted forward
over a single document of ``seq_len`` tokens and reports the process's peak resident memory
(``VmHWM`` in ``/proc/self/status``) or the error that stopped it. A child process keeps the
parent's memory out of the figure and lets an out-of-memory failure happen safely.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import subprocess
import sys
import time

__all__ = ["forward_memory", "forward_memories"]


def _launch(backend, seq_len, cap_bytes, model_cfg, attention, seed):
    from flashlab.models.transformer import ModelConfig
    cfg = dataclasses.asdict(model_cfg or ModelConfig())
    if attention is not None:
        cfg["attention"] = attention
    args = [sys.executable, "-m", "flashlab.models.memory", "--backend", backend,
            "--seq-len", str(seq_len), "--cap-bytes", str(cap_bytes), "--seed", str(seed),
            "--config", json.dumps(cfg)]
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    return proc, {"backend": backend, "seq_len": seq_len, "cap_bytes": cap_bytes,
                  "attention": cfg["attention"]}


def _collect(proc, result, timeout):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        return dict(result, ok=False, error=f"timed out after {timeout:.0f} s")
    lines = [l for l in out.splitlines() if l.startswith("{")]
    if lines:
        return dict(result, **json.loads(lines[-1]))
    # killed or aborted before it could report (e.g. std::bad_alloc inside the runtime)
    err = [l for l in err.splitlines() if l.strip()]
    return dict(result, ok=False,
                error=f"exit status {proc.returncode}: " + (err[-1] if err else "no output"))


def forward_memory(backend: str, seq_len: int, *, cap_bytes: int = 3 * 2**30,
                   model_cfg=None, attention: str | None = None, seed: int = 0,
                   timeout: float = 300.0) -> dict:
    """Run one forward of ``seq_len`` tokens through ``backend`` in a capped child process.

    Args:
      backend: a :func:`flashlab.backends` name.
      seq_len: tokens in the one document (batch 1).
      cap_bytes: the child's ``RLIMIT_AS`` (bytes of address space).
      model_cfg: a :class:`~flashlab.models.ModelConfig` (default ``ModelConfig()``);
        ``attention`` overrides its ``attention`` field.
      seed: weights and tokens (memory does not depend on their values).

    Returns:
      A dict with ``ok`` (bool), ``backend``, ``seq_len``, ``cap_bytes``, ``attention``,
      ``peak_rss_bytes`` (the child's ``VmHWM``), ``seconds`` (forward including compilation,
      when ok) and ``error`` (its first line, when not ok).
    """
    return forward_memories([dict(backend=backend, seq_len=seq_len, attention=attention)],
                            cap_bytes=cap_bytes, model_cfg=model_cfg, seed=seed,
                            timeout=timeout)[0]


def forward_memories(runs, *, cap_bytes: int = 3 * 2**30, model_cfg=None, seed: int = 0,
                     timeout: float = 300.0) -> list[dict]:
    """:func:`forward_memory` for several runs at once, each in its own child (concurrently).

    ``runs`` is a list of dicts with ``backend``, ``seq_len`` and optionally ``attention``.
    Each child has its own cap, so concurrent runs do not share a budget; their peak RSS is
    their own.
    """
    procs = [_launch(r["backend"], r["seq_len"], cap_bytes, model_cfg, r.get("attention"), seed)
             for r in runs]
    return [_collect(p, res, timeout) for p, res in procs]


def _child(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", required=True)
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--cap-bytes", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--config", required=True)
    a = p.parse_args(argv)
    resource.setrlimit(resource.RLIMIT_AS, (a.cap_bytes, a.cap_bytes))   # before jax loads
    from flashlab.instruments.measure import peak_rss_bytes
    try:
        import jax
        import numpy as np
        from flax import nnx

        from flashlab.models.transformer import DocumentModel, ModelConfig

        cfg = ModelConfig(**json.loads(a.config))
        model = DocumentModel(cfg, a.backend, rngs=nnx.Rngs(a.seed))
        rng = np.random.default_rng(a.seed)
        tokens = rng.integers(1, cfg.vocab_size, (1, a.seq_len)).astype(np.int32)
        seg = np.ones((1, a.seq_len), np.int32)
        pos = np.arange(a.seq_len, dtype=np.int32)[None]
        t0 = time.perf_counter()
        out = nnx.jit(lambda m, t, s, p: m(t, s, p))(model, tokens, seg, pos)
        jax.block_until_ready(out)
        seconds = time.perf_counter() - t0
        print(json.dumps({"ok": True, "peak_rss_bytes": peak_rss_bytes(), "seconds": seconds}))
    except Exception as e:   # noqa: BLE001  (out of memory surfaces as several types)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        print(json.dumps({"ok": False, "error": f"{type(e).__name__}: {first}"[:300],
                          "peak_rss_bytes": peak_rss_bytes()}))
    sys.stdout.flush()


if __name__ == "__main__":
    _child()
