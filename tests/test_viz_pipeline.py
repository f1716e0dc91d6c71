"""Chapter 04-05 figures replay the kernels' own index maps."""
import matplotlib

matplotlib.use("Agg")
import numpy as np  # noqa: E402

from flashlab.kernels import examples, forward_grid_spec, make_config  # noqa: E402
from flashlab.kernels.replay import replay_index_maps  # noqa: E402
from flashlab.contract.masks import validate
from flashlab.viz.pipeline import (block_skipping_figure, forward_skip_table,  # noqa: E402
                                   pipeline_residency_figure)
from flashlab.widgets.pipeline import pipeline_widget  # noqa: E402


def test_matmul_replay_counts_copies():
    gs = examples.matmul_grid_spec(256, 256, 384, 128, 128, 128)
    specs = {"X": gs["in_specs"][0], "Y": gs["in_specs"][1], "O": gs["out_specs"]}
    recs = replay_index_maps(gs["grid"], specs)
    assert len(recs) == 2 * 2 * 3
    assert sum(r["fetched"]["O"] for r in recs) == 4          # output resident along k
    assert pipeline_residency_figure(gs["grid"], specs).axes
    assert pipeline_widget(gs["grid"], specs) is not None


def test_causal_skip_table():
    q = np.zeros((1, 512, 1, 64), np.float32)
    *_, spec = validate(q, q, q, is_causal=True)
    gs = forward_grid_spec(make_config(spec, block_q=128, block_k=128))
    computed, fetched = forward_skip_table(gs, [512], [512])
    assert (computed == np.tril(np.ones((4, 4), bool))).all()
    assert (fetched == np.minimum(np.arange(4)[None], np.arange(4)[:, None])).all()
    assert block_skipping_figure(gs, [512], [512]).axes
