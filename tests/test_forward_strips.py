"""The forward's crossed tiles cut into query strips (kernels/diagonal.py, chapter 05): the
staircase, where it applies, and the output against the float64 oracle in both interpret
modes (tolerances as in test_kernel_forward: float32 2e-5, bfloat16 2e-2)."""
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import flag_at_import, kernel_eqns, random_qkv
from flashlab.compat import pallas as compat
from flashlab.contract import device
from flashlab.contract.masks import validate
from flashlab.kernels import diagonal, flash_attention
from flashlab.kernels.diagonal import Piece
from flashlab.kernels.forward_config import make_config
from flashlab.ladder.reference import oracle_attention

F32_TOL, BF16_TOL = 2e-5, 2e-2


def _spec(T=8192, S=None, d=128, **kw):
    q = jnp.zeros((1, T, 1, d), jnp.bfloat16)
    k = jnp.zeros((1, S or T, 1, d), jnp.bfloat16)
    return validate(q, k, k, **{"is_causal": True, **kw})[-1]


def test_strips_cut_the_staircase_from_the_query_side():
    """v5e 1024²: four 256-row strips, strip a sees keys [0, a + 256), every one masked: 10/16
    of the tile. 2048 x 1024: two offsets; at d = 1024 the first 1024 rows see nothing."""
    cfg = make_config(_spec(), block_q=1024, block_k=1024, chip="v5e")
    ((d, pieces),) = diagonal.forward_cases(cfg)
    assert d == 0 and pieces == tuple(Piece(0, a + 256, a, a + 256, True)
                                      for a in range(0, 1024, 256))
    area = sum((p.k_hi - p.k_lo) * (p.q_hi - p.q_lo) for p in pieces)
    assert area / 1024**2 == 10 / 16 and diagonal.forward_visits(cfg) == (8,)
    # drawn as S transposed (kv rows down, queries across), like the backward's pieces
    assert diagonal.picture(cfg, 0, cell=256, forward=True).splitlines() == [
        "\\###", ".\\##", "..\\#", "...\\"]
    cfg = make_config(_spec(), block_q=2048, block_k=1024, chip="v6e")
    (d0, p0), (d1, p1) = diagonal.forward_cases(cfg)
    assert (d0, d1) == (0, 1024) and diagonal.forward_visits(cfg) == (4, 4)
    assert p0 == (Piece(0, 512, 0, 512, True), Piece(0, 1024, 512, 1024, True),
                  Piece(0, 1024, 1024, 1536, False), Piece(0, 1024, 1536, 2048, False))
    assert p1 == (Piece(0, 512, 1024, 1536, True), Piece(0, 1024, 1536, 2048, True))


@pytest.mark.parametrize("kw, blocks", [
    ({}, (512, 512)),                                          # too small to pay
    ({}, (1024, 256)),                                         # a 1024-row block: cut
    ({"local_window_size": (100, 0)}, (1024, 1024)),          # a window: not positional alone
    ({"bias": np.zeros((1, 1, 8192, 8192), np.float32)}, (1024, 1024)),
    ({"is_causal": False}, (1024, 1024)),
])
def test_strips_only_where_the_pieces_follow_from_positions(kw, blocks):
    cfg = make_config(_spec(**kw), block_q=blocks[0], block_k=blocks[1], chip="v5e")
    expect = blocks == (1024, 256) and not kw
    assert diagonal.forward_applies(cfg) is expect
    assert (diagonal.forward_cases(cfg) != ()) is expect


def test_strips_from_512_on_v4_only():
    """diagonal.FORWARD_MIN_BLOCK_BY_CHIP: v4 cuts 512² tiles (its whole forward 7.97 ->
    7.19 ms); v5e and v5p do not (a 0.5% loss); v6e's strips of 512 rows leave one."""
    def cuts(chip):
        return diagonal.forward_applies(make_config(_spec(), block_q=512, block_k=512,
                                                    chip=chip))
    assert cuts("v4") and not any(map(cuts, ("v5e", "v5p", "v6e", "7x")))


def test_strips_switch_off_with_the_environment():
    """``FLASHLAB_FORWARD_STRIPS=0`` (read at import) compiles crossed tiles whole."""
    flag = ("flashlab.kernels.diagonal", "FORWARD_STRIPS")
    assert not flag_at_import(*flag, FLASHLAB_FORWARD_STRIPS="0")
    assert flag_at_import(*flag, FLASHLAB_FORWARD_STRIPS="1")


def _small_strips(monkeypatch):
    """Strips of 128 rows from 256-row blocks on v5e (the real table cuts only blocks of at
    least 1024, too big for an interpreted test)."""
    monkeypatch.setitem(diagonal.FORWARD_STRIP_ROWS, "v5e", 128)
    monkeypatch.setattr(diagonal, "FORWARD_MIN_BLOCK", 256)


def _check(q, k, v, kw, *, dtype=np.float32, interpret=True, **blocks):
    qj, kj, vj = (jnp.asarray(x, dtype) for x in (q, k, v))
    *_, spec = validate(qj, kj, vj, **kw)
    cfg = make_config(spec, chip="v5e", **blocks)
    assert diagonal.forward_cases(cfg), "the test must run the strips"
    out = flash_attention(qj, kj, vj, **kw, interpret=interpret, chip="v5e", **blocks)
    ref = oracle_attention(*(np.asarray(x.astype(jnp.float32)) for x in (qj, kj, vj)), **kw)
    got = np.asarray(out.astype(jnp.float32))
    assert np.isfinite(got).all()
    assert np.abs(got - ref).max() <= (F32_TOL if dtype == np.float32 else BF16_TOL)


@pytest.mark.parametrize("T, bq, bk", [(768, 256, 256), (700, 256, 256), (1024, 512, 256),
                                       (1024, 256, 512), (640, 256, 128)])
@pytest.mark.parametrize("kw", [{}, {"logits_soft_cap": 20.0}, {"key_value_seq_lengths": [600, 301]}])
def test_strips_match_the_oracle(monkeypatch, T, bq, bk, kw):
    """Square, B_r > B_c (unmasked strips beside masked ones, and strips that see nothing),
    B_r < B_c, kv padding (T=700: every piece keeps the length mask), GQA, a soft cap."""
    _small_strips(monkeypatch)
    rng = np.random.default_rng(21)
    B, N, K, H = 2, 4, 2, 64
    q, k, v = random_qkv(rng, B, T, T, N, K, H)
    kw = {"is_causal": True, **{n: np.asarray(x, np.int32) if n.endswith("lengths") else x
                                for n, x in kw.items()}}
    if "key_value_seq_lengths" in kw:
        kw["key_value_seq_lengths"] = np.minimum(kw["key_value_seq_lengths"], T)
    _check(q, k, v, kw, block_q=bq, block_k=bk)


def test_strips_no_races_in_tpu_interpret_mode(monkeypatch):
    """Strips write disjoint rows of m, l and acc: the race detector agrees (bf16, 2 q blocks
    of 512 by kv blocks of 256: both offsets, masked and unmasked strips)."""
    _small_strips(monkeypatch)
    rng = np.random.default_rng(22)
    q, k, v = random_qkv(rng, 1, 1024, 1024, 2, 1, 128)
    _check(q, k, v, {"is_causal": True}, dtype=jnp.bfloat16,
           interpret=device.tpu_interpret_params(), block_q=512, block_k=256)
    assert compat.races_found() is False


def test_strips_give_the_oracle_lse_and_sinks(monkeypatch):
    """The training forward (lse out, what the backward recomputes P from) and sinks merged at
    the finalize, through the strips: lse within 1e-5, the output within 2e-5 (float32)."""
    from flashlab.kernels import flash_attention_forward
    _small_strips(monkeypatch)
    rng = np.random.default_rng(23)
    q, k, v = random_qkv(rng, 1, 700, 700, 2, 2, 64)
    sinks = rng.standard_normal(2).astype(np.float32)
    qj, kj, vj = (jnp.asarray(x) for x in (q, k, v))
    *_, spec = validate(qj, kj, vj, is_causal=True, sinks=sinks)
    assert diagonal.forward_cases(make_config(spec, block_q=256, block_k=256, chip="v5e"))
    out, lse = flash_attention_forward(qj, kj, vj, spec, block_q=256, block_k=256, chip="v5e",
                                       interpret=True)
    ref, ref_lse = oracle_attention(q, k, v, is_causal=True, sinks=sinks, return_lse=True)
    assert np.abs(np.asarray(out) - ref).max() <= F32_TOL
    assert np.abs(np.asarray(lse) - ref_lse).max() <= 1e-5


def test_only_the_crossed_pieces_build_a_mask(monkeypatch):
    """Under the strips causal is the only mask, so a tile the diagonal does not cross is seen
    whole once it runs: its chunks build no mask (v6e causal 2048²: 11785 -> 10318 cycles a
    tile). The kernel's iotas (two per mask: query and key positions) are exactly the
    crossed tiles' masked pieces'."""
    _small_strips(monkeypatch)
    q = jnp.zeros((1, 768, 2, 64), jnp.float32)
    *_, spec = validate(q, q, q, is_causal=True)
    cfg = make_config(spec, block_q=256, block_k=256, chip="v5e")
    masked = sum(p.masked for _, pieces in diagonal.forward_cases(cfg) for p in pieces)
    [kernel] = kernel_eqns(lambda q: flash_attention(q, q, q, is_causal=True, block_q=256,
                                                     block_k=256, chip="v5e"), q)
    assert masked == 2 and sum(e.primitive.name == "iota" for e in kernel) == 2 * masked


@pytest.mark.parametrize("left, tiles", [(4096, 0), (4300, 55)])
def test_partial_path_only_where_a_chunk_can_see_nothing(left, tiles):
    """v5e folds a 512² tile in two row chunks. Under a window whose left side is a multiple
    of B_c no visible tile holds a chunk that sees nothing, so the kernel builds no partial
    path (its per-step test cost 20 cycles: 193 -> 173); at 4300 the last tile of each band
    row (from the tenth q block on: 55 of them per head at T = 32768) holds one, its second
    chunk, and the path stays."""
    cfg = make_config(_spec(T=32768, local_window_size=(left, 0)), block_q=512, block_k=512,
                      chip="v5e")
    assert cfg.row_chunks == 2 and cfg.partial_tiles == bool(tiles)
    assert cfg.chunk_visits() == (tiles, tiles)
