"""Parity with the official Pallas TPU kernels, both run in TPU interpret mode on this CPU.

``jax.experimental.pallas.ops.tpu.flash_attention`` takes no ``interpret`` argument: it runs
under ``pltpu.force_tpu_interpret_mode(params)``. Splash attention takes ``interpret=params``.
Shared features only (layout [B, N, T, d], block-divisible lengths, no fully masked rows).
fp32 max abs error <= 1e-5 between the kernels.
"""
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import random_qkv
from flashlab.contract import device
from flashlab.compat import pallas as compat
from flashlab.kernels import flash_attention

official = pytest.importorskip("jax.experimental.pallas.ops.tpu.flash_attention")
splash = pytest.importorskip("jax.experimental.pallas.ops.tpu.splash_attention")

TOL = 1e-5
B, T, N, D = 1, 256, 2, 128


def _ours(q, k, v, **kw):
    return np.asarray(flash_attention(q, k, v, block_q=128, block_k=128,
                                      interpret=device.tpu_interpret_params(), **kw))


def _bnth(x):
    return jnp.swapaxes(jnp.asarray(x), 1, 2)   # [B, T, N, d] -> [B, N, T, d]


@pytest.mark.parametrize("features", ["causal", "segments", "bias_causal"])
def test_parity_with_official_flash_attention(features):
    rng = np.random.default_rng(0)
    q, k, v = random_qkv(rng, B, T, T, N, N, D)
    scale = 1 / np.sqrt(D)
    kw, okw = {}, {}
    if "causal" in features:
        kw["is_causal"] = okw["causal"] = True
    if features == "segments":
        seg = np.repeat(np.array([[0, 1, 1, 2]], np.int32), T // 4, axis=1)
        kw["segment_ids"] = seg
        okw["segment_ids"] = official.SegmentIds(q=jnp.asarray(seg), kv=jnp.asarray(seg))
    if "bias" in features:
        bias = rng.standard_normal((B, N, T, T)).astype(np.float32)
        kw["bias"] = bias
        # The official kernel adds ab before sm_scale; pass it pre-divided to match ours.
        okw["ab"] = jnp.asarray(bias / scale)
    with compat.force_tpu_interpret_mode(device.tpu_interpret_params()):
        theirs = official.flash_attention(_bnth(q), _bnth(k), _bnth(v), sm_scale=scale, **okw)
    theirs = np.asarray(jnp.swapaxes(theirs, 1, 2))
    ours = _ours(q, k, v, **kw)
    err = np.abs(ours - theirs).max()
    print(f"parity {features}: max abs err {err:.2e}")
    assert err <= TOL


def _splash_kernel(mask, soft_cap=None, is_mqa=False):
    bs = splash.BlockSizes(block_q=128, block_kv=128, block_kv_compute=128)
    make = splash.make_splash_mqa_single_device if is_mqa else splash.make_splash_mha_single_device
    return make(splash.MultiHeadMask([mask] * N), block_sizes=bs, attn_logits_soft_cap=soft_cap,
                interpret=device.tpu_interpret_params())


@pytest.mark.parametrize("features", ["causal", "local_window", "soft_cap_mqa"])
def test_parity_with_splash_attention(features):
    import jax
    rng = np.random.default_rng(1)
    K = 1 if "mqa" in features else N
    q, k, v = random_qkv(rng, B, T, T, N, K, D)
    scale = 1 / np.sqrt(D)
    kw = {}
    if features == "causal":
        mask = splash.CausalMask((T, T))
        kw["is_causal"] = True
    elif features == "local_window":
        mask = splash.LocalMask((T, T), window_size=(20, 5), offset=0)
        kw["local_window_size"] = (20, 5)
    else:
        mask = splash.FullMask((T, T))
        kw["logits_soft_cap"] = 3.0
    kern = _splash_kernel(mask, kw.get("logits_soft_cap"), is_mqa="mqa" in features)
    qs = _bnth(q)[0] * scale                                # splash has no scale argument
    if "mqa" in features:
        theirs = kern(qs, _bnth(k)[0, 0], _bnth(v)[0, 0])   # [N, T, d], [T, d], [T, d]
    else:
        theirs = kern(qs, _bnth(k)[0], _bnth(v)[0])
    theirs = np.asarray(jnp.swapaxes(theirs[None], 1, 2))
    ours = _ours(q, k, v, **kw)
    err = np.abs(ours - theirs).max()
    print(f"parity {features}: max abs err {err:.2e}")
    assert err <= TOL
    del jax
