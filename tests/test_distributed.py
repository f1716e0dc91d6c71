"""flashlab.scale.distributed on 8 simulated CPU devices, plus the layout tables and the comm
model.

The device count must be fixed before jax is imported, and a pytest(-xdist) worker may have
imported jax already; so each multi-device case runs in a fresh interpreter
(``tests/dist_cases.py``), which works under plain ``pytest`` and ``pytest -n 2`` alike.
"""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from flashlab.instruments import comm_model
from flashlab.scale import ring_layout

HERE = Path(__file__).resolve().parent
CASES = ["ring_zigzag_causal_gqa", "ring_contiguous_segments_softcap",
         "ring_lengths_fully_masked", "ring_window_cross_batch_mesh",
         "ring_pallas_zigzag_causal_gqa", "ring_pallas_window_segments_lengths",
         "ring_block_counts_balance", "sharded_gqa_batch_heads", "sharded_masks", "errors"]


def test_case_list_matches_the_script():
    src = (HERE / "dist_cases.py").read_text()
    assert sorted(CASES) == sorted(l.split("(")[0][len("def case_"):] for l in src.splitlines()
                                   if l.startswith("def case_"))


@pytest.mark.parametrize("case", CASES)
def test_on_8_cpu_devices(case):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, str(HERE / "dist_cases.py"), case], env=env,
                          capture_output=True, text=True, timeout=600, cwd=HERE.parent)
    assert proc.returncode == 0, f"{case} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert f"ok {case}" in proc.stdout


# ----------------------------------------------------------------------------- layout tables

@pytest.mark.parametrize("layout", ring_layout.LAYOUTS)
@pytest.mark.parametrize("P", [1, 2, 4, 8])
def test_permutation_round_trip(layout, P):
    n = 4 * P
    perm = ring_layout.permutation(n, P, layout)
    assert sorted(perm.tolist()) == list(range(n))
    np.testing.assert_array_equal(perm[ring_layout.inverse_permutation(perm)], np.arange(n))
    # device i's slice of the layout order = its chunks, in natural positions
    c = ring_layout.chunk_len(n, P, layout)
    for i, chunks in enumerate(ring_layout.device_chunks(P, layout)):
        want = np.concatenate([np.arange(ch * c, (ch + 1) * c) for ch in chunks])
        per_dev = n // P
        np.testing.assert_array_equal(perm[i * per_dev:(i + 1) * per_dev], want)


def test_ring_schedule_visits_every_block_once():
    sched = ring_layout.ring_schedule(8)
    for i in range(8):
        assert sorted(sched[:, i]) == list(range(8))
    assert (sched[0] == np.arange(8)).all()                 # step 0: own block


@pytest.mark.parametrize("P", [2, 4, 8, 16])
def test_causal_work_balance(P):
    cont = ring_layout.work_per_device(P, "contiguous", is_causal=True)
    zig = ring_layout.work_per_device(P, "zigzag", is_causal=True)
    assert (np.diff(cont) > 0).all()                        # contiguous: last device does most
    assert cont.max() / cont.min() == P
    assert (zig == zig[0]).all() and zig[0] == 2 * P + 1    # zig-zag: every device equal
    assert zig.sum() < cont.sum()                           # finer blocks skip more
    full = ring_layout.work_per_device(P, "zigzag")
    assert (full == 4 * P).all()


def test_layout_errors_name_the_argument():
    with pytest.raises(ValueError, match="layout"):
        ring_layout.chunks_per_device("striped")
    with pytest.raises(ValueError, match="multiple of 16"):
        ring_layout.permutation(24, 8, "zigzag")


# ----------------------------------------------------------------------------- comm model

def test_comm_model_formulas():
    kw = dict(batch=2, tokens_per_device=1024, head_dim=128)
    assert comm_model.ring_step_bytes(kv_heads=8, **kw) == 2 * 1024 * 8 * 256 * 2
    assert comm_model.ring_step_flops(heads=32, **kw) == 4 * 2 * 32 * 1024 ** 2 * 128
    for chip in comm_model.RING_CHIPS:
        c = comm_model.min_tokens_per_device(chip, heads=32, kv_heads=8)
        below = comm_model.ring_step_times(chip, batch=1, tokens_per_device=int(c * 0.9),
                                           heads=32, kv_heads=8, head_dim=64)
        above = comm_model.ring_step_times(chip, batch=1, tokens_per_device=int(c * 1.1) + 1,
                                           heads=32, kv_heads=8, head_dim=64)
        assert not below["hidden"] and above["hidden"]
    # GQA moves 4x fewer bytes -> needs 4x fewer tokens; causal half-work doubles the bar.
    mha = comm_model.min_tokens_per_device("v5e", heads=32, kv_heads=32)
    assert comm_model.min_tokens_per_device("v5e", heads=32, kv_heads=8) == pytest.approx(mha / 4)
    assert comm_model.min_tokens_per_device("v5e", heads=32, kv_heads=32,
                                            work_fraction=0.5) == pytest.approx(2 * mha)
    with pytest.raises(ValueError, match="chip"):
        comm_model.min_tokens_per_device("v9", heads=1, kv_heads=1)


def test_figures_and_widget_build():
    pytest.importorskip("matplotlib")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from flashlab.viz import ring as viz_ring
    for fig in (viz_ring.ring_steps_figure(4), viz_ring.load_balance_figure(4),
                viz_ring.comm_model_figure()):
        assert fig.axes
        plt.close(fig)
    pytest.importorskip("ipywidgets")
    from flashlab.widgets.ring import ring_widget
    w = ring_widget(4)
    w.children[0].children[0].value = 2                     # move the slider: redraws
    plt.close("all")


@pytest.mark.parametrize("P", [1, 2, 3, 8])
def test_zigzag_sends_deal_each_device_its_two_chunks(P):
    # sharded in natural order device i holds chunks 2i, 2i+1; the two ppermutes (even chunks,
    # odd chunks) must each be a permutation and leave device j with chunks j and 2P-1-j
    even, odd = ring_layout.zigzag_sends(P)
    got = {j: set() for j in range(P)}
    for pairs, parity in ((even, 0), (odd, 1)):
        assert sorted(s for s, _ in pairs) == sorted(d for _, d in pairs) == list(range(P))
        for src, dst in pairs:
            got[dst].add(2 * src + parity)
    assert got == {j: set(ring_layout.device_chunks(P, "zigzag")[j].tolist()) for j in range(P)}
