"""HBM bytes of one decode step, by replaying the decode kernel's own BlockSpecs.

Decode reads the whole visible cache to produce one token per sequence: the lower bound of
its traffic is the visible K and V once, plus the queries and the outputs.
:func:`decode_step_bytes` replays :func:`flashlab.kernels.decode_grid.decode_grid_spec` (the objects
its ``pallas_call`` gets, with the page table and lengths its index maps read) through
:func:`flashlab.instruments.traffic.replay` and adds the split-K epilogue (reading the partial
states back and writing the output). :func:`prefill_kernel_decode_bytes` replays today's prefill
kernel (:mod:`flashlab.kernels.forward`) asked to do the same step: its grid runs per *query* head,
so it reads each kv head's cache once per query head of the group, and pads one query row
to a whole block.
"""
from __future__ import annotations

import functools
import math

import jax.numpy as jnp
import numpy as np

from flashlab.instruments import traffic
from flashlab.contract.decode_validate import DecodeSpec

__all__ = ["decode_kernel_grid", "decode_lower_bound_bytes", "decode_step_bytes",
           "prefill_kernel_decode_bytes", "decode_traffic_table"]


def _spec(batch, q_heads, kv_heads, head_dim, page_size, pages_per_sequence, num_pages,
          lengths, new_tokens, dtype, window) -> DecodeSpec:
    return DecodeSpec(batch=batch, new_tokens=new_tokens, num_heads=q_heads,
                      num_kv_heads=kv_heads, head_dim=head_dim, head_dim_v=head_dim,
                      dtype=jnp.dtype(dtype), scale=1.0 / math.sqrt(head_dim), window=window,
                      soft_cap=None, paged=True, page_size=page_size,
                      pages_per_sequence=pages_per_sequence, num_pages=num_pages,
                      lengths=np.asarray(lengths, np.int32))


def decode_kernel_grid(*, lengths, q_heads: int, kv_heads: int, head_dim: int = 128,
                       page_size: int = 16, new_tokens: int = 1, dtype="bfloat16",
                       window: int | None = None, num_splits: int | None = None,
                       pages_per_block: int | None = None,
                       seed: int = 0) -> traffic.KernelGrid:
    """The decode kernel's :class:`flashlab.instruments.traffic.KernelGrid` for sequences of
    ``lengths``.

    The page pool holds exactly the pages the batch needs, handed out in a shuffled order
    (a page table as a server's allocator leaves it); the capacity is the longest length
    rounded up to whole pages. ``pages_per_block``: the kernel's pages per grid step (its
    default when ``None``); each of them is its own K and V operand (``k``, ``k1``, ...).
    """
    from flashlab.kernels import decode as kdecode
    from flashlab.kernels import decode_grid
    lengths = np.asarray(lengths, np.int32)
    B = len(lengths)
    P = max(1, -(-int(lengths.max()) // page_size))
    table = np.random.default_rng(seed).permutation(B * P).reshape(B, P).astype(np.int32)
    spec = _spec(B, q_heads, kv_heads, head_dim, page_size, P, B * P, lengths, new_tokens,
                 dtype, window)
    cfg = decode_grid.make_decode_config(spec, page_size, P, B * P, num_splits=num_splits,
                                     pages_per_block=pages_per_block)
    gs = decode_grid.decode_grid_spec(cfg)
    flat = decode_grid.page_schedule(cfg, lengths, table)
    scratch = sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in gs.scratch_shapes)
    return traffic.from_block_specs(gs.grid, gs.in_specs, gs.out_specs, gs.in_shapes,
                                    gs.out_shapes, in_names=gs.in_names,
                                    out_names=gs.out_names, scalar_prefetch=(lengths, flat),
                                    scratch_bytes=scratch, name="flashlab_decode")


def decode_lower_bound_bytes(*, lengths, q_heads: int, kv_heads: int, head_dim: int = 128,
                             new_tokens: int = 1, dtype="bfloat16",
                             window: int | None = None) -> int:
    """Visible K and V read once, plus q read and the output written (``dtype`` bytes)."""
    e = jnp.dtype(dtype).itemsize
    lengths = np.asarray(lengths, np.int64)
    visible = lengths if window is None else np.minimum(lengths, new_tokens + window)
    cache = int(visible.sum()) * kv_heads * 2 * head_dim * e
    qo = len(lengths) * new_tokens * q_heads * 2 * head_dim * e
    return cache + qo


def decode_step_bytes(*, lengths, q_heads: int, kv_heads: int, head_dim: int = 128,
                      page_size: int = 16, new_tokens: int = 1, dtype="bfloat16",
                      window: int | None = None, num_splits: int | None = None) -> dict:
    """Bytes of one decode step through the Pallas decode kernel, replayed.

    Returns ``{"q", "k", "v", "m", "l", "acc"`` (kernel operands, replayed)``, "epilogue"``
    (the split-K merge in XLA: read the partial states, write the output), ``"total"``,
    ``"lower_bound"``, ``"ratio"``, ``"num_splits"}``. Cached per arguments (a figure and a
    table of the same chapter ask for the same steps).
    """
    return dict(_decode_step_bytes(tuple(int(x) for x in np.asarray(lengths)), q_heads,
                                   kv_heads, head_dim, page_size, new_tokens,
                                   jnp.dtype(dtype).name, window, num_splits))


@functools.lru_cache(maxsize=64)
def _decode_step_bytes(lengths, q_heads, kv_heads, head_dim, page_size, new_tokens, dtype,
                       window, num_splits) -> dict:
    kg = decode_kernel_grid(lengths=lengths, q_heads=q_heads, kv_heads=kv_heads,
                            head_dim=head_dim, page_size=page_size, new_tokens=new_tokens,
                            dtype=dtype, window=window, num_splits=num_splits)
    r = traffic.replay(kg)
    out = {k: 0 for k in ("k", "v")}
    for k, v in r.items():               # the n page operands k, k1, ... summed as "k"
        if k not in ("read", "written", "total"):
            name = k[0] if k[0] in "kv" and k[1:].isdigit() else k
            out[name] = out.get(name, 0) + v["bytes"]
    B = len(np.asarray(lengths))
    out["epilogue"] = (r["written"]["bytes"]
                       + B * new_tokens * q_heads * head_dim * jnp.dtype(dtype).itemsize)
    out["total"] = r["total"]["bytes"] + out["epilogue"]
    out["lower_bound"] = decode_lower_bound_bytes(
        lengths=lengths, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
        new_tokens=new_tokens, dtype=dtype, window=window)
    out["ratio"] = out["total"] / out["lower_bound"]
    out["num_splits"] = kg.operand("m").shape[1]
    return out


def prefill_kernel_decode_bytes(*, length: int, batch: int, q_heads: int, kv_heads: int,
                                head_dim: int = 128, dtype="bfloat16", block_q: int = 16,
                                block_k: int = 512) -> dict:
    """Bytes of the same decode step through today's prefill kernel (one query token against a
    contiguous cache of ``length``), replayed from :mod:`flashlab.kernels.forward`."""
    r = traffic.kernel_hbm_bytes("forward", batch=batch, heads=q_heads, seq_len=1,
                                 kv_seq_len=length, kv_heads=kv_heads, head_dim=head_dim,
                                 dtype=dtype, block_q=block_q, block_k=block_k)
    lb = decode_lower_bound_bytes(lengths=[length] * batch, q_heads=q_heads,
                                  kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
    return {"total": r["total"], "lower_bound": lb, "ratio": r["total"] / lb}


def decode_traffic_table(*, length: int = 4096, batch: int = 8, head_dim: int = 128,
                         dtype="bfloat16", configs=(("GQA 8:1", 32, 4), ("MHA", 32, 32)),
                         ragged: bool = True) -> list[dict]:
    """Rows ``{"config", "kernel", "bytes", "lower_bound", "ratio"}``: the decode kernel (ragged
    lengths spread over ``length/4 .. length``, and uniform) vs the prefill kernel (uniform)."""
    rows = []
    spread = np.linspace(length // 4, length, batch).astype(int)
    for name, hq, hk in configs:
        cases = [("decode kernel, uniform", [length] * batch)]
        if ragged:
            cases.append(("decode kernel, ragged", spread))
        for label, lens in cases:
            d = decode_step_bytes(lengths=lens, q_heads=hq, kv_heads=hk, head_dim=head_dim,
                                  dtype=dtype)
            rows.append({"config": name, "kernel": label, "bytes": d["total"],
                         "lower_bound": d["lower_bound"], "ratio": d["ratio"]})
        p = prefill_kernel_decode_bytes(length=length, batch=batch, q_heads=hq, kv_heads=hk,
                                        head_dim=head_dim, dtype=dtype)
        rows.append({"config": name, "kernel": "prefill kernel, uniform", "bytes": p["total"],
                     "lower_bound": p["lower_bound"], "ratio": p["ratio"]})
    return rows
