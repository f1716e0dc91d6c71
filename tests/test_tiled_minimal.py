"""flashlab.ladder.tiled_minimal: the one-head, no-mask forward and backward against float64 oracles."""
import numpy as np

from flashlab import oracle_attention
from flashlab.dispatch.conformance import oracle_grads
from flashlab.ladder.tiled_minimal import minimal_backward, minimal_forward


def test_minimal_forward_and_backward_match_the_float64_oracles():
    rng = np.random.default_rng(0)
    N, d = 128, 32                            # 2 query blocks x 4 key blocks (64 x 32)
    q, k, v, do = (rng.standard_normal((N, d)).astype(np.float32) for _ in range(4))
    o, lse = minimal_forward(q, k, v, block_q=64, block_k=32)
    ref = oracle_attention(q[None, :, None], k[None, :, None], v[None, :, None])[0, :, 0]
    np.testing.assert_allclose(np.asarray(o), ref, atol=2e-5, rtol=0)
    s = (q.astype(np.float64) @ k.T.astype(np.float64)) / np.sqrt(d)
    ref_lse = np.log(np.exp(s - s.max(-1, keepdims=True)).sum(-1)) + s.max(-1)
    np.testing.assert_allclose(np.asarray(lse), ref_lse, atol=2e-5, rtol=0)
    grads = minimal_backward(q, k, v, o, lse, do, block_q=64, block_k=32)
    refs = oracle_grads(q[None, :, None], k[None, :, None], v[None, :, None], do[None, :, None])
    for g, r in zip(grads, refs):
        r = r[0, :, 0]
        np.testing.assert_allclose(np.asarray(g), r, atol=1e-4 * np.abs(r).max(), rtol=0)
