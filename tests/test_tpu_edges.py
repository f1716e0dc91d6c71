"""A tile's MXU edges (flashlab.instruments.tpu_edges), read from the stored v5e forward dump
(tests/data/tpu_schedule: flashlab's forward, 512x512, libtpu 0.0.50; see test_tpu_schedule)."""
import dataclasses

import pytest

from flashlab.instruments import tpu_edges, tpu_schedule as ts
from test_tpu_schedule import PACKED, UTIL, _texts, _write


@pytest.fixture(scope="module")
def tile():
    return ts.analyze(PACKED, UTIL, kernel="flashlab_flash_forward")


def test_edges_split_the_tile_and_agree_with_the_compilers_table(tile):
    e = tpu_edges.mxu_edges(tile)
    # read from the dump once: the MXUs wait 69 cycles for their first weights and the tile
    # runs 128 cycles after the last is idle; 67 cycles between have no MXU busy
    assert (e.open_cycles, e.close_cycles, e.idle_cycles) == (69, 128, 67)
    assert e.edge_cycles == 197
    assert (e.open_cycles + e.close_cycles + e.idle_cycles + e.partial_cycles
            + e.full_cycles) == tile.tile_cycles
    # every busy MXU-cycle lies between the edges: all-busy cycles account for 4 each
    assert 4 * e.full_cycles <= tile.mxu_busy_cycles <= 4 * e.full_cycles + 3 * e.partial_cycles


def test_the_opening_is_the_transposed_push_of_k(tile):
    """Q Kᵀ pushes K into the MXUs transposed: a round of four pushes (one an MXU) every
    8 cycles, 8 rounds, and only then the first vmatmul."""
    line = tpu_edges.opening_line(tile)
    assert len(line) == tpu_edges.mxu_edges(tile).open_cycles
    assert line == "." * 5 + "xxxx...." * 7 + "xxxx" + "..." + "M"
    first = tpu_edges.opening(tile, 9)
    assert first[5] == ["vld", "vmatpush.bf16.xpose.msra.mxu0", "vld", "vld"]
    assert [len(ops) for ops in first[:4]] == [0, 0, 0, 0]        # empty latency bundles


def test_an_unpredicated_tile_counts_the_steps_work_in_its_opening(tmp_path, tile):
    """Where the tile has no branch of its own, its region holds the step's work too (the
    pipeline's waits before the first push): the opening grows by it, the rest is the same."""
    packed, util = _texts()
    branch = "sbr.rel (%p767_p0) target bundleno = 1891 (0x763), region = 52"
    p, u = _write(tmp_path, packed.replace(branch, "snop"), util)
    s, e = ts.analyze(p, u), tpu_edges.mxu_edges(tile)
    got = tpu_edges.mxu_edges(s)
    assert s.unpredicated and got.open_cycles > e.open_cycles
    assert (got.idle_cycles, got.partial_cycles, got.full_cycles) == (
        e.idle_cycles, e.partial_cycles, e.full_cycles)
    assert tpu_edges.opening_line(s).endswith("xxxx...M")


def test_bad_input_names_the_argument(tile):
    with pytest.raises(ValueError, match=r"s: a TileSchedule with its table rows"):
        tpu_edges.mxu_edges(dataclasses.replace(tile, tile_util=[]))
    k = list(tile.unit_capacity).index("MXU")
    idle = [[0 if i == k else v for i, v in enumerate(row)] for row in tile.tile_util]
    with pytest.raises(ValueError, match=r"keeps no MXU busy"):
        tpu_edges.mxu_edges(dataclasses.replace(tile, tile_util=idle))
    busy_first = [list(row) for row in tile.tile_util]
    busy_first[0][k] = 1                       # an MXU busy from the tile's first cycle
    warm = dataclasses.replace(tile, tile_util=busy_first)
    assert tpu_edges.mxu_edges(warm).open_cycles == 0 and tpu_edges.opening_line(warm) == ""
    for n in (0, -1, 2.5, True, "8"):
        with pytest.raises(ValueError, match=r"n: expected a positive int"):
            tpu_edges.opening(tile, n)
    assert "tile_index" not in tile.as_dict() and len(tile.tile_index) == tile.tile_cycles
