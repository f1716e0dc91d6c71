"""``bench decode-static``: flashlab's decode kernel vs the official paged_attention on the
TPU compiler's static schedule. The live test compiles both (tiny shape, v5e) and skips without
libtpu unless ``FLASHLAB_REQUIRE_LIBTPU=1``."""
import os

import pytest

from flashlab.benchmarks import backends as bench
from flashlab.instruments import tpu_compile

needs_libtpu = pytest.mark.skipif(
    not tpu_compile.available() and os.environ.get("FLASHLAB_REQUIRE_LIBTPU") != "1",
    reason=f"libtpu (the TPU compiler) is not installed: {tpu_compile.INSTALL}")


def test_cli_rejects_tokens_not_whole_blocks(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["decode-static", "--tokens", "1000", "--page-size", "16"])
    assert e.value.code == 2
    assert "--tokens: expected a multiple of page size x --pages-per-compute-block" in \
        capsys.readouterr().err


@needs_libtpu
def test_live_decode_step_both_kernels():
    from flashlab.benchmarks import decode_static as bds
    rows, versions = bds.measure(chips=["v5e"], page_sizes=[16], batch=2, kv_heads=2, group=4,
                                 tokens=256, progress=False)
    assert versions["libtpu"] and [r["library"] for r in rows] == ["flashlab", "official"], rows
    ours, theirs = rows
    assert "error" not in ours and "error" not in theirs, rows
    # flashlab: grid (batch, splits, blocks); 16 pages of 16 in one block of 256 positions
    assert ours["grid"] == [2, 1, 1] and ours["pages_per_block"] == 16
    # official: grid (cores, batch, kv_heads), 2 blocks of 8 pages per (batch, kv head)
    assert theirs["grid"] == [1, 2, 2] and theirs["grid_trips"] == 2 * 2 + 2
    assert theirs["blocks"] == 2 * 2 * 2
    for r in rows:
        assert r["est_cycles"] > r["block_cycles"] > 0 and r["busiest_unit"]
    assert ours["ratio_official"] == pytest.approx(ours["est_cycles"] / theirs["est_cycles"])
    text = bds.header(versions, dict(batch=2, kv_heads=2, group=4, head_dim=128,
                                     dtype="bfloat16", tokens=256, pages_per_compute_block=8))
    assert "NOT wall time" in text and "x official" in bds.table(rows)


def test_stored_run_has_both_kernels_on_v5e_and_v6e():
    from flashlab.benchmarks import decode_static as bds
    d = bds.stored()
    assert d["args"]["command"].startswith("python -m flashlab bench decode-static")
    assert d["args"]["commit"] and d["versions"]["libtpu"]
    got = {(r["chip"], r["library"], r["page_size"]) for r in d["rows"] if "error" not in r}
    assert {(c, lib, 16) for c in ("v5e", "v6e") for lib in bds.LIBRARIES} <= got
    assert bds.table(d["rows"]).count(" official ") == 4    # one row per chip and page size
