"""Distributed checks on 8 simulated CPU devices, run in a fresh process by test_distributed.py.

``python tests/dist_cases.py CASE`` sets ``XLA_FLAGS`` *before* importing jax (a pytest worker
may have imported jax already, with one device), runs one case and exits non-zero on failure.
Gradients are compared with ``jax.grad`` of the reference rung in float64 (x64 is on here).
"""
import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cases import mask_kwargs  # noqa: E402
from conftest import random_qkv  # noqa: E402

from flashlab.scale import ring_layout
from flashlab.scale.distributed import sharded_attention
from flashlab.scale.ring import ring_attention, ring_block_counts
from flashlab.ladder.reference import naive_attention, oracle_attention

FWD_ATOL = 2e-5      # fp32 outputs of unit-scale inputs vs the float64 oracle
GRAD_RTOL = 1e-4     # fp32 gradients, relative to the largest float64 gradient entry


def _loss(fn):
    # A non-trivial cotangent (sin) so every output entry matters.
    return lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v).astype(jnp.float64)))


def check(fn, q, k, v, kw, *, grads=True):
    """fn(q, k, v, **kw) in fp32 against the oracle and float64 jax.grad of the reference."""
    f = jax.jit(lambda q, k, v: fn(q, k, v, **kw))
    out = np.asarray(f(q, k, v))
    ref = oracle_attention(q, k, v, **kw)
    assert out.dtype == np.float32, out.dtype
    err = np.abs(out - ref).max()
    assert err <= FWD_ATOL, f"forward max abs err {err:.2e} > {FWD_ATOL}"
    if not grads:
        return out, None
    g = jax.jit(jax.grad(_loss(lambda q, k, v: fn(q, k, v, **kw)), argnums=(0, 1, 2)))(q, k, v)
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    g_ref = jax.grad(_loss(lambda q, k, v: naive_attention(q, k, v, **kw)), argnums=(0, 1, 2))(
        q64, k64, v64)
    for name, a, b in zip(("dq", "dk", "dv"), g, g_ref):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == np.float32 and np.isfinite(a).all(), name
        rel = np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)
        assert rel <= GRAD_RTOL, f"{name}: relative err {rel:.2e} > {GRAD_RTOL}"
    return out, g


def ring(axis="sp", **fixed):
    return lambda q, k, v, **kw: ring_attention(q, k, v, axis_name=axis, **fixed, **kw)


def sharded(**fixed):
    return lambda q, k, v, **kw: sharded_attention(q, k, v, **fixed, **kw)


# ----------------------------------------------------------------------------- cases

def case_ring_zigzag_causal_gqa():
    mesh = jax.make_mesh((8,), ("sp",))
    q, k, v = random_qkv(np.random.default_rng(1), 2, 64, 64, 4, 2, 8)
    check(ring(mesh=mesh), q, k, v, {"is_causal": True})


def case_ring_contiguous_segments_softcap():
    mesh = jax.make_mesh((8,), ("sp",))
    rng = np.random.default_rng(2)
    q, k, v = random_qkv(rng, 2, 32, 32, 2, 2, 8)
    # Uneven segments: boundaries fall inside device blocks; one segment spans 3 devices.
    seg = np.array([[0] * 3 + [1] * 14 + [2] * 15, [0] * 20 + [1] * 1 + [2] * 11], np.int32)
    check(ring(mesh=mesh, layout="contiguous"), q, k, v,
          {"segment_ids": seg, "logits_soft_cap": 3.0})
    check(ring(mesh=mesh, layout="zigzag"), q, k, v, {"segment_ids": seg, "is_causal": True})


def case_ring_lengths_fully_masked():
    mesh = jax.make_mesh((8,), ("sp",))
    rng = np.random.default_rng(3)
    q, k, v = random_qkv(rng, 3, 32, 32, 2, 1, 8)
    kw = {"is_causal": True, "key_value_seq_lengths": np.array([0, 13, 32], np.int32),
          "query_seq_lengths": np.array([32, 9, 30], np.int32)}
    out, (dq, dk, dv) = check(ring(mesh=mesh), q, k, v, kw)
    # batch row 0 sees no keys: zeros, zero gradients; rows past q_len too.
    assert (out[0] == 0).all() and (np.asarray(dq)[0] == 0).all()
    assert (np.asarray(dk)[0] == 0).all() and (np.asarray(dv)[0] == 0).all()
    assert (out[1, 9:] == 0).all() and (np.asarray(dq)[1, 9:] == 0).all()
    # segments where a query's own segment has no key before it under causal: zero rows.
    seg = (np.array([[1] * 16 + [2] * 16]), np.array([[2] * 16 + [1] * 16]))
    q1, k1, v1 = q[:1], k[:1], v[:1]
    out, _ = check(ring(mesh=mesh), q1, k1, v1, {"is_causal": True, "segment_ids": seg})
    assert (out[0, :16] == 0).all()


def case_ring_window_cross_batch_mesh():
    mesh = jax.make_mesh((2, 4), ("data", "sp"))
    rng = np.random.default_rng(4)
    q, k, v = random_qkv(rng, 2, 16, 32, 4, 2, 8)            # cross attention, T != S
    check(ring(mesh=mesh, batch_axis="data"), q, k, v, {"local_window_size": (5, 2)})
    mesh = jax.make_mesh((2, 4), ("heads", "sp"))
    q, k, v = random_qkv(rng, 1, 32, 32, 4, 2, 8)
    check(ring(mesh=mesh, head_axis="heads"), q, k, v,
          {"is_causal": True, "local_window_size": (6, 0)})


def case_ring_pallas_zigzag_causal_gqa():
    # Our Pallas kernel (generic interpreter on CPU) computes every ring step's block.
    mesh = jax.make_mesh((8,), ("sp",))
    q, k, v = random_qkv(np.random.default_rng(11), 1, 32, 32, 4, 2, 8)
    check(ring(mesh=mesh, backend="pallas_tpu"), q, k, v, {"is_causal": True})


def case_ring_pallas_window_segments_lengths():
    mesh = jax.make_mesh((8,), ("sp",))
    rng = np.random.default_rng(12)
    q, k, v = random_qkv(rng, 2, 32, 32, 2, 1, 8)
    seg = np.array([[0] * 5 + [1] * 19 + [2] * 8, [0] * 30 + [1] * 2], np.int32)
    check(ring(mesh=mesh, backend="pallas_tpu", layout="contiguous"), q, k, v,
          {"segment_ids": seg, "local_window_size": (6, 3),
           "key_value_seq_lengths": np.array([29, 17], np.int32)})


def case_ring_block_counts_balance():
    mesh = jax.make_mesh((8,), ("sp",))
    q, k, v = random_qkv(np.random.default_rng(5), 1, 64, 64, 2, 2, 8)
    P = 8
    cont = ring_block_counts(q, k, v, mesh=mesh, axis_name="sp", layout="contiguous",
                             is_causal=True)
    zig = ring_block_counts(q, k, v, mesh=mesh, axis_name="sp", layout="zigzag", is_causal=True)
    # What the ring actually ran equals the table the figures and the cost model use.
    for layout, got in (("contiguous", cont), ("zigzag", zig)):
        want = ring_layout.visible_pairs(P, layout, is_causal=True).sum(axis=(0, 2, 3))
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(cont, np.arange(1, P + 1))           # device i: i+1 blocks
    assert (zig == 2 * P + 1).all(), zig                               # balanced
    full = ring_block_counts(q, k, v, mesh=mesh, axis_name="sp", layout="zigzag")
    assert (full == 4 * P).all(), full                                 # no mask: nothing skipped
    # The kernel backend skips the same blocks (the ring decides, before calling it).
    pz = ring_block_counts(q, k, v, mesh=mesh, axis_name="sp", layout="zigzag", is_causal=True,
                           backend="pallas_tpu")
    np.testing.assert_array_equal(pz, zig)


def case_sharded_gqa_batch_heads():
    mesh = jax.make_mesh((2, 4), ("data", "heads"))
    rng = np.random.default_rng(6)
    for K in (4, 2, 1):                 # kv heads split with their groups; MQA: replicated
        q, k, v = random_qkv(rng, 2, 16, 16, 8, K, 8)
        kw = mask_kwargs("everything", rng, 2, 16, 16, 8)
        check(sharded(mesh=mesh, batch_axis="data", head_axis="heads"), q, k, v, kw)


def case_sharded_masks():
    mesh = jax.make_mesh((8,), ("data",))
    rng = np.random.default_rng(7)
    q, k, v = random_qkv(rng, 8, 16, 16, 2, 1, 8)
    for opt in ("segments", "kv_lengths_zero", "dense_mask", "bias_broadcast"):
        kw = mask_kwargs(opt, rng, 8, 16, 16, 2)
        out, _ = check(sharded(mesh=mesh, batch_axis="data"), q, k, v, kw, grads=opt != "dense_mask")
        if opt == "kv_lengths_zero":
            assert (out[0] == 0).all()
    mesh = jax.make_mesh((4, 2), ("heads", "data"))
    q, k, v = random_qkv(rng, 2, 16, 16, 4, 4, 8)
    kw = mask_kwargs("dense_mask_per_head", rng, 2, 16, 16, 4)
    check(sharded(mesh=mesh, batch_axis="data", head_axis="heads", backend="reference"),
          q, k, v, kw)


def case_errors():
    mesh = jax.make_mesh((8,), ("sp",))
    q, k, v = random_qkv(np.random.default_rng(8), 2, 24, 24, 2, 2, 8)

    def raises(exc, words, fn):
        try:
            fn()
        except exc as e:
            for w in words:
                assert w in str(e), (w, str(e))
            return
        raise AssertionError(f"expected {exc.__name__} mentioning {words}")

    raises(ValueError, ["query", "24", "16"], lambda: ring_attention(q, k, v, mesh=mesh, axis_name="sp"))
    q2, k2, v2 = random_qkv(np.random.default_rng(8), 2, 32, 32, 2, 2, 8)
    raises(ValueError, ["axis_name", "'seq'"], lambda: ring_attention(q2, k2, v2, mesh=mesh, axis_name="seq"))
    raises(ValueError, ["bias"], lambda: ring_attention(q2, k2, v2, np.zeros((1, 1, 32, 32), np.float32),
                                                        mesh=mesh, axis_name="sp"))
    raises(ValueError, ["layout", "'striped'"], lambda: ring_attention(q2, k2, v2, mesh=mesh, axis_name="sp",
                                                                       layout="striped"))
    raises(NotImplementedError, ["backend", "'splash'", "offsets"],
           lambda: ring_attention(q2, k2, v2, mesh=mesh, axis_name="sp", backend="splash"))
    raises(TypeError, ["mesh"], lambda: ring_attention(q2, k2, v2, mesh="sp", axis_name="sp"))
    raises(ValueError, ["batch_axis", "2", "8"], lambda: sharded_attention(q2, k2, v2, mesh=mesh, batch_axis="sp"))
    mesh2 = jax.make_mesh((8,), ("heads",))
    qh, kh, vh = random_qkv(np.random.default_rng(8), 1, 8, 8, 12, 3, 8)
    raises(ValueError, ["head_axis", "12", "8"], lambda: sharded_attention(qh, kh, vh, mesh=mesh2, head_axis="heads"))
    qh, kh, vh = random_qkv(np.random.default_rng(8), 1, 8, 8, 24, 3, 8)
    raises(ValueError, ["head_axis", "3 kv heads"], lambda: sharded_attention(qh, kh, vh, mesh=mesh2, head_axis="heads"))
    raises(ValueError, ["query_seq_lengths"], lambda: ring_attention(
        q2, k2, v2, mesh=mesh, axis_name="sp", query_seq_lengths=np.array([1, 99])))


def run(cases: dict, names) -> None:
    """Run the named cases on the 8 devices, printing ``ok NAME`` after each."""
    assert jax.device_count() == 8, jax.devices()
    for name in names:
        cases[name]()
        print(f"ok {name}")


CASES = {n[len("case_"):]: f for n, f in sorted(globals().items()) if n.startswith("case_")}

if __name__ == "__main__":
    run(CASES, sys.argv[1:])
