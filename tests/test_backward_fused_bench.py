"""``python -m flashlab.benchmarks.backward_fused``'s accounting, on stand-in schedules (no compile):
the split backward's two kernels and the fused one, each on its visit grid, count their steps,
tiles and init/finalize runs as ``bench tpu-static`` does."""
import types

from flashlab.benchmarks import backward_fused
from flashlab.instruments import tpu_dump


def _schedule(tile, step, init, fin, case_cycles=()):
    return types.SimpleNamespace(tile_cycles=tile, step_cycles=step, init_cycles=init,
                                 finalize_cycles=fin, outside_loop_cycles=10, occupancy=0.5,
                                 op_mix={"XLU": 0}, case_cycles=list(case_cycles))


def test_split_and_fused_on_visit_grids(monkeypatch):
    # B=1 H=2 T=2048 causal, 512-blocks: 4 x 4 blocks, 10 visible per head
    grids = {False: {"dkdv": (1, 2, 10, 1), "dq": (1, 2, 10)},
             True: {"dkdv": (1, 2, 10, 1)}}

    def fake(builder, chip, *, fused, **kw):
        ks = {role: tpu_dump.KernelDump(f"flashlab_flash_backward_{role}{'_fused' * fused}.1",
                                        role, g, _schedule(100, 10, 3, 4, [60] * fused))
              for role, g in grids[fused].items()}
        return tpu_dump.Dump(chip, ks, "0.0", "0.0")

    monkeypatch.setattr(tpu_dump, "schedules", fake)
    rows, _ = backward_fused.measure(chips=["v5e"], batch=1, seq_len=2048, heads=2,
                                     head_dim=128, block=512)
    split, fused = rows
    # visit grids: 20 steps and 20 tiles; init/finalize once per row: 8 q rows, 8 kv rows
    for name, k in split["kernels"].items():
        assert k["est_cycles"] == 10 + 20 * 10 + 20 * 100 + 8 * 7, name
    # the fused kernel on the transposed visit list: 20 steps, 20 tiles, 8 kv rows; the 8
    # diagonal tiles (4 per head) run as their kv strips, one case region of 60 cycles
    (k,) = fused["kernels"].values()
    assert fused["diagonal_tiles"] == [8]
    assert k["est_cycles"] == 10 + 20 * 10 + 12 * 100 + 8 * 60 + 8 * 7
    assert fused["resident_dq_bytes"] == 2048 * 128 * 4 and split["resident_dq_bytes"] == 0
    assert fused["ratio_split"] == k["est_cycles"] / split["est_cycles"]
