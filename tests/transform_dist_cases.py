"""shard_map cases on 8 simulated CPU devices, run in a fresh process by test_transformations.py.

``python tests/transform_dist_cases.py CASE...`` sets ``XLA_FLAGS`` before importing jax (a
pytest worker may have imported jax already, with one device). Every case runs under
``jax.shard_map``'s default ``check_vma=True`` (the varying-manual-axes type checker), forward
and backward (under ``jit``, and eager: ``sharded_attention`` is an eager ``shard_map``),
against the float64 oracle and float64 ``jax.grad`` of the reference rung.
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dist_cases  # noqa: E402  (8 CPU devices via XLA_FLAGS before jax loads; x64 on)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

import flashlab  # noqa: E402
from flashlab.dispatch.conformance import random_qkv
from flashlab.scale.distributed import sharded_attention
from flashlab.ladder.reference import naive_attention, oracle_attention
from flashlab.compat.shard_map import SHARD_MAP_SOURCE

FWD_ATOL, GRAD_RTOL = dist_cases.FWD_ATOL, dist_cases.GRAD_RTOL   # the same tolerances
# reference and xla have no loop carries or custom rules of their own; test_distributed.py
# runs them under shard_map's checker (through sharded_attention).
BACKENDS = ("tiled", "pallas_tpu")


def _loss(fn):
    return lambda *a: jnp.sum(jnp.sin(fn(*a).astype(jnp.float64)))


def _compare(name, got, want, rtol):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and np.isfinite(got).all(), (name, got.shape, want.shape)
    err = np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)
    assert err <= rtol, f"{name}: relative err {err:.2e} > {rtol}"


def _truth(kw, ref_args):
    """Float64 output (oracle) and gradients (jax.grad of the reference) w.r.t. every arg."""
    if len(ref_args) > 3:                                  # a differentiated bias
        kw = {n: a for n, a in kw.items() if n != "bias"}
    bias_of = lambda a: {"bias": a[3]} if len(a) > 3 else {}  # noqa: E731
    want = oracle_attention(*ref_args[:3], **bias_of(ref_args), **kw)
    ref = lambda *a: naive_attention(*a[:3], **bias_of(a), **kw)  # noqa: E731
    g_want = jax.grad(_loss(ref), argnums=tuple(range(len(ref_args))))(
        *(np.asarray(a, np.float64) for a in ref_args))
    return want, g_want


def _check(label, fn, args, truth, *, eager):
    """``fn(*args)`` (jitted, or eager: shard_map's op-by-op path) and its gradients w.r.t.
    every arg, against ``truth = (out, grads)`` in float64."""
    t0 = time.perf_counter()
    want, g_want = truth
    f = fn if eager else jax.jit(fn)
    out = f(*args)
    assert np.asarray(out).dtype == np.float32
    err = np.abs(np.asarray(out) - want).max()
    assert err <= FWD_ATOL, f"{label}: forward err {err:.2e} > {FWD_ATOL}"
    g = jax.grad(_loss(f), argnums=tuple(range(len(args))))(*args)
    for n, a, b in zip(("dq", "dk", "dv", "dbias"), g, g_want):
        _compare(f"{label} {n}", a, b, GRAD_RTOL)
    print(f"  {label} ({'eager' if eager else 'jit'}): forward and gradients ok "
          f"{time.perf_counter() - t0:.1f} s")


def case_user_shard_map():
    """A model's own ``jax.shard_map`` (batch split 8 ways) with flashlab.attention inside."""
    assert SHARD_MAP_SOURCE == "jax.shard_map", SHARD_MAP_SOURCE
    mesh = Mesh(np.array(jax.devices()), ("data",))
    rng = np.random.default_rng(0)
    B, T, N, K, H = 8, 16, 4, 2, 8
    q, k, v = random_qkv(rng, B, T, T, N, K, H)
    seg = np.sort(rng.integers(0, 2, size=(B, T)), axis=1).astype(np.int32)
    kv_len = rng.integers(1, T + 1, size=B).astype(np.int32)
    bias = rng.standard_normal((B, N, T, T)).astype(np.float32)
    kw = dict(is_causal=True, segment_ids=seg, key_value_seq_lengths=kv_len)
    truth = _truth(kw, (q, k, v, bias))
    for backend in BACKENDS:
        def local(q, k, v, bias, seg, kv_len, backend=backend):
            return flashlab.attention(q, k, v, bias, is_causal=True, segment_ids=seg,
                                      key_value_seq_lengths=kv_len, backend=backend)
        sm = jax.shard_map(local, mesh=mesh, in_specs=(P("data"),) * 6, out_specs=P("data"))
        fn = lambda q, k, v, bias, sm=sm: sm(q, k, v, bias, seg, kv_len)  # noqa: E731
        _check(f"shard_map {backend}", fn, (q, k, v, bias), truth, eager=False)


def case_sharded_attention():
    """``sharded_attention`` (batch x heads over a 2 x 4 mesh) through each backend."""
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "heads"))
    rng = np.random.default_rng(1)
    B, T, N, K, H = 2, 16, 8, 4, 8
    q, k, v = random_qkv(rng, B, T, T, N, K, H)
    seg = np.sort(rng.integers(0, 2, size=(B, T)), axis=1).astype(np.int32)
    bias = rng.standard_normal((1, N, T, T)).astype(np.float32)   # constant: not differentiated
    kw = dict(is_causal=True, segment_ids=seg, bias=bias)
    truth = _truth(kw, (q, k, v))
    for backend in ("pallas_tpu",):   # eager shard_map: no symbolic zeros (tiled: jit above)
        fn = lambda q, k, v, backend=backend: sharded_attention(  # noqa: E731
            q, k, v, mesh=mesh, batch_axis="data", head_axis="heads", backend=backend, **kw)
        _check(f"sharded_attention {backend}", fn, (q, k, v), truth, eager=True)


CASES = {n[len("case_"):]: f for n, f in sorted(globals().items()) if n.startswith("case_")}

if __name__ == "__main__":
    dist_cases.run(CASES, sys.argv[1:])
