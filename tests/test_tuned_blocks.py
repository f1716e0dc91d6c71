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
