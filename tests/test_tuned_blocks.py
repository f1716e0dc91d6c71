"""The per-chip default forward blocks as data (flashlab/kernels/tuned_blocks.py)."""
import jax.numpy as jnp

from flashlab.kernels import blocks as blk, tuned_blocks


def _rows():
    base = dict(library="flashlab", kernel="forward", causal=True, head_dim=128, seq_len=8192,
                batch=2, heads=16)
    return [dict(base, chip="v5e", block_q=512, block_k=512, est_cycles=9),
            dict(base, chip="v5e", block_q=1024, block_k=512, est_cycles=7),
            dict(base, chip="v5e", block_q=512, block_k=1024, est_cycles=8),
            dict(base, library="splash", chip="v5e", block_q=128, block_k=128, est_cycles=1)]


def test_table_picks_the_fastest_and_the_heuristic_covers_the_rest(tmp_path, monkeypatch):
    p = tmp_path / "tpu_blocks.json"
    e = tuned_blocks.entries_from_rows(_rows(), dtype="bfloat16", command="c", commit="k",
                                       versions={})
    tuned_blocks.write(p, e)
    assert [(x["block_q"], x["block_k"]) for x in tuned_blocks.table(p)] == [(1024, 512)]
    assert len(tuned_blocks.table(p)[0]["tried"]) == 3
    monkeypatch.setattr(tuned_blocks, "TABLE", p)
    bf = jnp.bfloat16
    assert blk.choose_block_sizes(8192, 8192, 128, bf, "v5e", is_causal=True) == (1024, 512)
    assert blk.choose_block_sizes(5000, 5000, 64, bf, "v5e", is_causal=True) == (1024, 512)
    heuristic = blk.choose_block_sizes(8192, 8192, 128, bf, "v5e")
    # outside every measured class: another chip, non-causal, fp32, T out of [T/2, 2T)
    for args, kw in [((8192, 8192, 128, bf, "v6e"), dict(is_causal=True)),
                     ((8192, 8192, 128, bf, "v5e"), dict(is_causal=False)),
                     ((8192, 8192, 128, jnp.float32, "v5e"), dict(is_causal=True)),
                     ((32768, 32768, 128, bf, "v5e"), dict(is_causal=True))]:
        got = blk.choose_block_sizes(*args, **kw)
        assert got == blk.choose_block_sizes(*args), (args, kw, got)
    assert heuristic == blk.choose_block_sizes(8192, 8192, 128, bf, "v5e", is_causal=False)


def test_backward_pairs_are_ranked_by_dq_plus_dkdv(tmp_path, monkeypatch):
    base = dict(library="flashlab", causal=True, head_dim=128, seq_len=8192, chip="v6e")
    rows = [dict(base, kernel="dq", block_q=512, block_k=512, est_cycles=5),
            dict(base, kernel="dkdv", block_q=512, block_k=512, est_cycles=5),
            dict(base, kernel="dq", block_q=1024, block_k=1024, est_cycles=3),
            dict(base, kernel="dkdv", block_q=1024, block_k=1024, est_cycles=6),
            dict(base, kernel="dq", block_q=1024, block_k=512, est_cycles=1),   # no dK/dV row
            dict(base, kernel="forward", block_q=512, block_k=1024, est_cycles=4)]
    p = tmp_path / "tpu_blocks.json"
    tuned_blocks.write(p, tuned_blocks.entries_from_rows(rows, dtype="bfloat16", command="c",
                                                         commit="k", versions={}))
    got = {e["kernel"]: (e["block_q"], e["block_k"], e["est_cycles"])
           for e in tuned_blocks.table(p)}
    assert got == {"backward": (1024, 1024, 9), "forward": (512, 1024, 4)}
    monkeypatch.setattr(tuned_blocks, "TABLE", p)
    bf = jnp.bfloat16
    assert blk.choose_backward_block_sizes(8192, 8192, 128, bf, "v6e", is_causal=True) == \
        (1024, 1024)
    assert blk.choose_block_sizes(8192, 8192, 128, bf, "v6e", is_causal=True) == (512, 1024)
    # other classes, and no is_causal: the heuristic
    heuristic = blk.choose_backward_block_sizes(8192, 8192, 128, bf, "v6e")
    assert heuristic == (512, 512)
    for args, kw in [((8192, 8192, 128, bf, "v6e"), dict(is_causal=False)),
                     ((8192, 8192, 128, bf, "v5e"), dict(is_causal=True)),
                     ((1024, 1024, 128, bf, "v6e"), dict(is_causal=True))]:
        assert blk.choose_backward_block_sizes(*args, **kw) == \
            blk.choose_backward_block_sizes(*args), (args, kw)
    import pytest
    with pytest.raises(ValueError, match="kernel: expected one of"):
        tuned_blocks.lookup(8192, 8192, 128, bf, "v6e", is_causal=True, kernel="dq")
