"""flashlab.instruments.traffic: the paper's IO model, and the replay of grids + BlockSpecs."""
import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax.experimental import pallas as pl

from flashlab.instruments import io_model, traffic
from flashlab.ladder.reference import naive_hbm_bytes


# ---------- a hand-written flash forward schedule (what the kernel's BlockSpecs look like) ----

def flash_forward_grid(B, H, N, d, bq, bk, *, causal=False, dtype=jnp.float32, Hk=None,
                       with_lse=False):
    """Grid (b, h, i, j); K/V index clamped to the last visible block under causal masking."""
    Hk = Hk or H
    G = H // Hk
    nq, nk = -(-N // bq), -(-N // bk)

    def kv_map(b, h, i, j):
        if causal:
            j = jnp.minimum(j, ((i + 1) * bq - 1) // bk)     # skipped steps keep the block
        return (b, h // G, j, 0)

    q_map = lambda b, h, i, j: (b, h, i, 0)
    in_specs = [pl.BlockSpec((None, None, bq, d), q_map),
                pl.BlockSpec((None, None, bk, d), kv_map),
                pl.BlockSpec((None, None, bk, d), kv_map)]
    out_specs = [pl.BlockSpec((None, None, bq, d), q_map)]
    q = jax.ShapeDtypeStruct((B, H, N, d), dtype)
    kv = jax.ShapeDtypeStruct((B, Hk, N, d), dtype)
    outs, names = [q], ["o"]
    if with_lse:
        out_specs.append(pl.BlockSpec((None, None, bq, 128), q_map))
        outs.append(jax.ShapeDtypeStruct((B, H, N, 128), jnp.float32))
        names.append("lse")
    return traffic.from_block_specs((B, H, nq, nk), in_specs, out_specs, [q, kv, kv], outs,
                                    in_names=["q", "k", "v"], out_names=names)


def hand_loop_bytes(B, H, N, d, bq, bk, *, causal=False, itemsize=4, Hk=None):
    """Brute force: the flash forward written as loops, counting each block it loads."""
    Hk = Hk or H
    G = H // Hk
    nq, nk = -(-N // bq), -(-N // bk)
    resident = {"q": None, "k": None, "v": None}
    moved = collections.Counter()
    rows = lambda blk, size: (min(N, (blk + 1) * size) - blk * size)
    for b in range(B):
        for h in range(H):
            for i in range(nq):
                for j in range(nk):
                    jj = min(j, ((i + 1) * bq - 1) // bk) if causal else j
                    want = {"q": (b, h, i), "k": (b, h // G, jj), "v": (b, h // G, jj)}
                    for name, blk in want.items():
                        if resident[name] != blk:            # not in VMEM: DMA it in
                            resident[name] = blk
                            size = bq if name == "q" else bk
                            moved[name] += rows(blk[2], size) * d * itemsize
                moved["o"] += rows(i, bq) * d * itemsize       # O_i written after row i
    return dict(moved)


@settings(deadline=None, max_examples=15)
@given(B=st.integers(1, 2), H=st.sampled_from([1, 2, 4]), N=st.integers(8, 96),
       bq=st.sampled_from([8, 16, 32]), bk=st.sampled_from([8, 16, 32]), causal=st.booleans(),
       gqa=st.booleans())
def test_replay_matches_hand_written_loop(B, H, N, bq, bk, causal, gqa):
    Hk = 1 if gqa else H
    kg = flash_forward_grid(B, H, N, 8, bq, bk, causal=causal, Hk=Hk)
    got = traffic.replay(kg)
    want = hand_loop_bytes(B, H, N, 8, bq, bk, causal=causal, Hk=Hk)
    assert {k: got[k]["bytes"] for k in want} == want


@pytest.mark.parametrize("causal", [False, True])
def test_vectorized_equals_loop_replay(causal):
    kg = flash_forward_grid(2, 2, 80, 16, 16, 8, causal=causal, with_lse=True)
    # a tiny chunk forces the carry between chunks to be exercised
    assert traffic.replay(kg, chunk=7) == traffic.replay(kg, method="loop")


def test_replay_generic_grid_with_element_dim_and_scalar_prefetch():
    # A 1-D gather: step t reads rows starting at offsets[t] (pl.Element), writes block t.
    offsets = np.array([0, 0, 4, 4, 4, 2, 0], np.int32)
    in_spec = pl.BlockSpec((pl.Element(4), 8), lambda t, off: (off[t], 0))
    out_spec = pl.BlockSpec((1, 8), lambda t, off: (t // 2, 0))
    x = jax.ShapeDtypeStruct((10, 8), jnp.float32)
    y = jax.ShapeDtypeStruct((4, 8), jnp.float32)
    kg = traffic.from_block_specs((7,), [in_spec], [out_spec], [x], [y],
                                  scalar_prefetch=(offsets,))
    for method in ("vectorized", "loop"):
        r = traffic.replay(kg, method=method)
        assert r["in0"]["copies"] == 4                   # runs: 0 0 | 4 4 4 | 2 | 0
        assert r["in0"]["bytes"] == 4 * 4 * 8 * 4
        assert r["out0"]["copies"] == 4                  # t//2: 0 0 | 1 1 | 2 2 | 3
        assert r["out0"]["bytes"] == 4 * 8 * 4


def test_edge_blocks_are_clipped():
    kg = flash_forward_grid(1, 1, 20, 8, 16, 16)     # 20 rows in blocks of 16: 16 + 4
    r = traffic.replay(kg)
    assert r["q"]["bytes"] == 20 * 8 * 4
    assert r["k"]["bytes"] == 2 * 20 * 8 * 4         # two query blocks read all of K


@pytest.mark.parametrize("N,bq,bk", [(256, 64, 32), (512, 128, 128), (384, 128, 64)])
def test_non_causal_closed_form(N, bq, bk):
    B, H, d = 2, 3, 64
    kg = flash_forward_grid(B, H, N, d, bq, bk, dtype=jnp.bfloat16)
    r = traffic.replay(kg)
    want = io_model.forward_closed_form_bytes(batch=B, heads=H, seq_len=N, head_dim=d,
                                             dtype="bfloat16", block_q=bq)
    assert want == B * H * (2 + 2 * N // bq) * N * d * 2
    assert r["q"]["bytes"] + r["k"]["bytes"] + r["v"]["bytes"] + r["o"]["bytes"] == want


def test_causal_roughly_halves_kv_traffic():
    args = (1, 1, 4096, 128, 128, 128)
    full = traffic.replay(flash_forward_grid(*args, dtype=jnp.bfloat16))
    causal = traffic.replay(flash_forward_grid(*args, causal=True, dtype=jnp.bfloat16))
    assert causal["total"]["bytes"] <= 0.6 * full["total"]["bytes"]
    kv = lambda r: r["k"]["bytes"] + r["v"]["bytes"]
    n = 4096 // 128
    # row i fetches K blocks 0..i; row 1 starts on block 0, still resident from row 0
    assert kv(causal) / kv(full) == (n * (n + 1) // 2 - 1) / n**2


def test_replay_scales_to_16k():
    """The vectorised replay handles a 16k grid (its speed is a benchmark matter, not a test's)."""
    kg = flash_forward_grid(1, 1, 16384, 128, 128, 128, causal=True, dtype=jnp.bfloat16)
    n = 16384 // 128
    r = traffic.replay(kg)
    assert r["q"]["bytes"] == 16384 * 128 * 2                   # Q_i fetched once per row
    assert r["k"]["bytes"] == (n * (n + 1) // 2 - 1) * 128 * 128 * 2


def test_tile_schedule_marks_copies():
    kg = flash_forward_grid(1, 1, 32, 8, 8, 8, causal=True)
    s = traffic.tile_schedule(kg)
    assert s["grid_points"].shape == (16, 4)
    k = s["ops"]["k"]
    # row i = 0: block 0 fetched at j = 0, then j = 1..3 are skipped (clamped to 0)
    assert k["index"][:4, 2].tolist() == [0, 0, 0, 0]
    assert k["copied"][:4].tolist() == [True, False, False, False]
    assert s["ops"]["o"]["copied"].sum() == 4                   # one write per query block
    assert s["ops"]["o"]["copied"][3] and not s["ops"]["o"]["copied"][2]
    assert int(sum(k["copied"])) == traffic.replay(kg)["k"]["copies"]


def test_pipeline_vmem_bytes():
    kg = flash_forward_grid(1, 1, 256, 64, 128, 64, dtype=jnp.bfloat16)
    assert traffic.pipeline_vmem_bytes(kg) == 2 * (128 * 64 * 2 * 2 + 64 * 64 * 2 * 2)


def test_interpret_mode_dmas_match_replay(monkeypatch):
    """TPU interpret mode copies each block in/out itself; count its copies and compare."""
    pltpu = pytest.importorskip("jax.experimental.pallas.tpu")
    try:
        from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
        orig_get, orig_store = ipc.get, ipc.store
    except (ImportError, AttributeError):
        pytest.skip("this JAX's TPU interpreter has no get/store hooks to count copies")
    moved = collections.Counter()

    def get(*a, input_name=None, **k):
        tok, val = orig_get(*a, input_name=input_name, **k)
        if input_name is not None:                        # a pipeline HBM -> VMEM copy
            moved[input_name] += np.asarray(val).nbytes
        return tok, val

    def store(*a, output_name=None, **k):
        if output_name is not None:                       # a pipeline VMEM -> HBM copy
            moved[output_name] += np.asarray(a[6]).nbytes
        return orig_store(*a, output_name=output_name, **k)

    monkeypatch.setattr(ipc, "get", get)
    monkeypatch.setattr(ipc, "store", store)
    jax.clear_caches()                                    # retrace with the hooks in place

    B, H, N, d, bq, bk = 1, 2, 48, 8, 16, 8
    kg = flash_forward_grid(B, H, N, d, bq, bk, causal=True)

    def kernel(q_ref, k_ref, v_ref, o_ref):
        @pl.when(pl.program_id(3) == 0)
        def _():
            o_ref[...] = jnp.zeros_like(o_ref)
        o_ref[...] += q_ref[...] + jnp.sum(k_ref[...]) + jnp.sum(v_ref[...])

    specs = {op.name: pl.BlockSpec(op.block_shape, op.index_map) for op in kg.operands}
    x = jnp.ones((B, H, N, d), jnp.float32)
    f = pl.pallas_call(kernel, grid=kg.grid, in_specs=[specs["q"], specs["k"], specs["v"]],
                       out_specs=specs["o"], out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                       interpret=pltpu.InterpretParams())
    jax.block_until_ready(f(x, x, x))
    r = traffic.replay(kg)
    assert dict(moved) == {f"{n}_ref": r[n]["bytes"] for n in ("q", "k", "v", "o")}


# ---------- the paper's model ----------

def test_block_sizes_follow_algorithm_1():
    assert io_model.flash_block_sizes(192 * 1024, 64, 2) == (64, 384)   # ceil(98304 / 256)
    assert io_model.flash_block_sizes(1000, 64, 4) == (1, 1)            # ceil(250 / 256)
    with pytest.raises(ValueError, match="sram_bytes"):
        io_model.flash_block_sizes(0, 64, 2)


def test_standard_reuses_naive_model():
    kw = dict(batch=2, heads=3, seq_len=128, head_dim=32)
    std = io_model.analytic_hbm_bytes("standard", **kw, bytes_per_element=2)
    nv = naive_hbm_bytes(batch=2, heads=3, q_len=128, kv_len=128, head_dim=32,
                         bytes_per_element=2, score_bytes=2)
    assert std["total"] == nv["total"] and std["backward"] == 0


def test_flash_model_scales_as_n2_d2_over_m():
    kw = dict(batch=1, heads=1, head_dim=64, bytes_per_element=2)
    small = io_model.analytic_hbm_bytes("flash", seq_len=8192, sram_bytes=64 * 1024, **kw)
    big = io_model.analytic_hbm_bytes("flash", seq_len=8192, sram_bytes=256 * 1024, **kw)
    # dominant per-outer-step term is ∝ T_c = N / B_c ∝ 1 / M
    assert small["fwd_q_o_per_outer_step"] == pytest.approx(4 * big["fwd_q_o_per_outer_step"])
    std = io_model.analytic_hbm_bytes("standard", seq_len=8192, **kw)
    assert small["total"] < std["total"]


def test_paper_table_within_2x_and_ratio():
    rows = {r["algorithm"]: r for r in io_model.paper_gpt2_table()}
    for r in rows.values():
        assert 0.5 <= r["model_over_paper"] <= 2.0, r
    assert rows["standard"]["model_hbm_gb"] / rows["flash"]["model_hbm_gb"] >= 5


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="algorithm"):
        io_model.analytic_hbm_bytes("tiled", batch=1, heads=1, seq_len=8, head_dim=8,
                                   bytes_per_element=2)
    with pytest.raises(ValueError, match="sram_bytes"):
        io_model.analytic_hbm_bytes("flash", batch=1, heads=1, seq_len=8, head_dim=8,
                                   bytes_per_element=2)
    with pytest.raises(ValueError, match="seq_len"):
        io_model.analytic_hbm_bytes("standard", batch=1, heads=1, seq_len=0, head_dim=8,
                                   bytes_per_element=2)
    with pytest.raises(ValueError, match="method"):
        traffic.replay(flash_forward_grid(1, 1, 8, 8, 8, 8), method="fast")
    with pytest.raises(ValueError, match="kernel"):
        traffic.kernel_hbm_bytes("sideways", batch=1, heads=1, seq_len=8, head_dim=8,
                                 dtype="float32", block_q=8, block_k=8)


def test_backward_is_two_kernels():
    with pytest.raises(ValueError, match="backward_dkdv"):
        traffic.kernel_grid("backward", batch=1, heads=1, seq_len=128, head_dim=64,
                            dtype="bfloat16", block_q=128, block_k=128)


# ---------- flashlab's own forward kernel ----------

kernels = pytest.importorskip("flashlab.kernels", reason="the kernel rung is not in this checkout")


@pytest.mark.parametrize("N,bq,bk", [(1024, 128, 128), (2048, 256, 128), (1024, 512, 256)])
def test_forward_kernel_non_causal_closed_form(N, bq, bk):
    B, H, d = 2, 3, 128                                  # d = 128: no lane padding
    r = traffic.kernel_hbm_bytes("forward", batch=B, heads=H, seq_len=N, head_dim=d,
                                 dtype="bfloat16", block_q=bq, block_k=bk)
    assert r["q"] + r["k"] + r["v"] + r["o"] == B * H * (2 + 2 * N // bq) * N * d * 2
    assert r["total"] == r["q"] + r["k"] + r["v"] + r["o"]        # nothing else without lse
    lse = traffic.kernel_hbm_bytes("forward", batch=B, heads=H, seq_len=N, head_dim=d,
                                   dtype="bfloat16", block_q=bq, block_k=bk, return_lse=True)
    assert lse["lse"] == B * H * N * 128 * 4                      # lane-replicated fp32 lse


def test_forward_kernel_causal_halves_kv():
    kw = dict(batch=1, heads=2, seq_len=4096, head_dim=128, dtype=jnp.bfloat16,
              block_q=128, block_k=128)
    full = traffic.kernel_hbm_bytes("forward", **kw)
    causal = traffic.kernel_hbm_bytes("forward", **kw, is_causal=True)
    assert causal["total"] <= 0.6 * full["total"]
    assert causal["k"] < 0.55 * full["k"]


def test_forward_kernel_replay_uses_the_kernels_own_specs(monkeypatch):
    built = []
    orig = kernels.forward_grid.forward_grid_spec

    def spy(cfg):                               # record what the kernel module builds
        built.append(orig(cfg))
        return built[-1]

    monkeypatch.setattr(kernels.forward_grid, "forward_grid_spec", spy)
    kg = traffic.kernel_grid("forward", batch=1, heads=2, seq_len=256, head_dim=64,
                             dtype="float32", block_q=128, block_k=128, is_causal=True)
    (gs,) = built
    assert kg.grid == gs.grid
    for op, spec in zip(kg.operands, gs.in_specs + gs.out_specs):
        assert op.index_map is spec.index_map                # the same objects, not a copy
        assert op.block_shape == tuple(spec.block_shape)
    assert traffic.replay(kg) == traffic.replay(kg, method="loop")


def test_forward_kernel_dmas_in_tpu_interpret_mode(monkeypatch):
    """Run the real kernel in TPU interpret mode, count its pipeline copies, compare."""
    pltpu = pytest.importorskip("jax.experimental.pallas.tpu")
    try:
        from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
        orig_get, orig_store = ipc.get, ipc.store
    except (ImportError, AttributeError):
        pytest.skip("this JAX's TPU interpreter has no get/store hooks to count copies")
    reads, writes = {}, {}

    def get(*a, input_name=None, **k):
        tok, val = orig_get(*a, input_name=input_name, **k)
        if input_name is not None:
            reads[input_name] = reads.get(input_name, 0) + np.asarray(val).nbytes
        return tok, val

    def store(*a, output_name=None, **k):
        if output_name is not None:
            writes[output_name] = writes.get(output_name, 0) + np.asarray(a[6]).nbytes
        return orig_store(*a, output_name=output_name, **k)

    monkeypatch.setattr(ipc, "get", get)
    monkeypatch.setattr(ipc, "store", store)
    jax.clear_caches()
    B, T, H, d = 1, 384, 1, 128
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((B, T, H, d)), jnp.float32) for _ in range(3))
    out = kernels.flash_attention(q, k, v, is_causal=True, block_q=128, block_k=128,
                                  interpret=pltpu.InterpretParams())
    jax.block_until_ready(out)
    r = traffic.kernel_hbm_bytes("forward", batch=B, heads=H, seq_len=T, head_dim=d,
                                 dtype="float32", block_q=128, block_k=128, is_causal=True)
    # the interpreter names operands by the kernel's argument names: order is q, k, v / o
    assert list(reads.values()) == [r["q"], r["k"], r["v"]]
    assert list(writes.values()) == [r["o"]]
