"""What ``bench tpu-static`` compiles: each library's forward, or ``jax.grad`` through it, on
abstract inputs (``build``, run in :func:`flashlab.instruments.tpu_dump.schedules`' child).

``flashlab`` runs ``backward="auto"`` (the fused backward wherever its resident dQ fits);
``flashlab_split`` its split backward; ``splash`` splash at its defaults or the blocks given;
``splash_fused`` splash with ``use_fused_bwd_kernel``; ``jax_pallas_flash`` jax's
``flash_attention``.

``window``: ``None``, or the ``(left, right)`` sliding window every library gets (flashlab's
``local_window_size``, splash's ``LocalMask``; query ``i`` sees keys ``i - left .. i + right``,
and no key past ``i`` when causal). ``soft_cap``: ``None``, or the ``cap`` of
``cap·tanh(logits / cap)`` (flashlab's ``logits_soft_cap``, splash's
``attn_logits_soft_cap``). jax's kernel has neither: its builder refuses them.
"""
from __future__ import annotations

__all__ = ["build", "BUILDERS", "window_of", "forward_flops", "OPTIONS_JAX_LACKS"]

#: What jax's ``flash_attention`` rows say under ``--window`` or ``--soft-cap``.
OPTIONS_JAX_LACKS = "jax's flash_attention has no sliding window and no soft cap"


def window_of(left: int | None, causal: bool) -> tuple[int, int] | None:
    """``--window LEFT`` as a ``(left, right)`` window: ``(LEFT, 0)`` causal (the LEFT keys
    before each query and itself), ``(LEFT, LEFT)`` otherwise; ``None`` for no window."""
    return None if left is None else (left, 0 if causal else left)


def forward_flops(batch, heads, seq_len, head_dim, causal, window=None) -> float:
    """The forward's matmul FLOPs (``2 x 2·d`` per visible score). Without a window: the
    half-square causal count every stored run uses; with one, the visible scores counted
    exactly (query ``i`` sees keys ``max(0, i - left) .. min(T - 1, i + right)``, none past
    ``i`` when causal)."""
    from flashlab.benchmarks.backends import attention_flops
    if window is None:
        return attention_flops(batch, heads, seq_len, seq_len, head_dim, causal)
    left, right = window
    right = 0 if causal else right
    seen = sum(min(seq_len - 1, i + right) - max(0, i - left) + 1 for i in range(seq_len))
    return 4.0 * batch * heads * head_dim * seen


def _flashlab_split(chip, backward, causal, block, shape, dtype, window=None, soft_cap=None):
    """flashlab with ``backward="split"`` (its dK/dV and dQ kernels), where ``flashlab`` runs
    what ``backward="auto"`` picks (the fused kernel wherever its resident dQ fits)."""
    return _flashlab(chip, backward, causal, block, shape, dtype, window, soft_cap,
                     which="split")


def _flashlab(chip, backward, causal, block, shape, dtype, window=None, soft_cap=None,
              which="auto"):
    import jax
    from flashlab.contract import masks
    from flashlab.kernels import backward_grid, band, diagonal
    from flashlab.kernels import forward_config
    from flashlab.kernels import flash
    B, T, H, d = shape
    x = jax.ShapeDtypeStruct((B, T, H, d), dtype)
    bq, bk = block if block else (None, None)
    got = {}

    def probe(q, k, v):                      # the blocks as the kernels resolve them
        q, k, v, spec = masks.validate(q, k, v, None, None, is_causal=causal,
                                       local_window_size=window, logits_soft_cap=soft_cap)
        # differentiated, the forward writes lse too: its VMEM check counts that block
        f = forward_config.make_config(spec, block_q=bq, block_k=bk, chip=chip,
                                       return_lse=backward)
        got["fwd"] = (f.block_q, f.block_k)
        # the query strips' cases, or a window's edge tiles (band.py), else row chunks
        got["forward_cases"] = diagonal.forward_visits(f) or band.forward_visits(f)
        got["chunk_visits"] = (0, 0) if got["forward_cases"] else f.chunk_visits()
        c, got["fused"] = backward_grid.resolve_backward(spec, which, block_q=bq, block_k=bk,
                                                         chip=chip)
        got["bwd"] = [c.block_q, c.block_k]
        got["cases"] = (diagonal.visits(c) or band.visits(c)) if got["fused"] else ()
        return q
    jax.eval_shape(probe, x, x, x)
    fb = got["fwd"]

    def f(q, k, v):      # the blocks a user gets: passing fb would size the backward by them
        return flash.flash_attention(q, k, v, is_causal=causal, block_q=bq, block_k=bk,
                                     local_window_size=window, logits_soft_cap=soft_cap,
                                     interpret=False, chip=chip, backward=which)
    info = {"forward": list(fb), "dq": got["bwd"], "dkdv": got["bwd"],
            "fused": bool(got["fused"]), "dq_chunks": int(got["fused"]),
            "fused_cases": list(got["cases"]), "forward_cases": list(got["forward_cases"]),
            "chunk_visits": list(got["chunk_visits"])}
    return f, (x, x, x), info


def _splash_fused(chip, backward, causal, block, shape, dtype, window=None, soft_cap=None):
    """splash with its own fused backward (``use_fused_bwd_kernel``): one dK/dV kernel that
    also writes a dQ partial per kv block in the inputs' dtype, ``[T_c, B, H, T, d]`` in HBM,
    summed by XLA after (that sum and those bytes are not on the static schedule)."""
    return _splash(chip, backward, causal, block, shape, dtype, window, soft_cap, fused=True)


def _splash(chip, backward, causal, block, shape, dtype, window=None, soft_cap=None,
            fused=False):
    import jax
    from flashlab.compat.pallas import official_splash_attention
    sa = official_splash_attention()
    B, T, H, d = shape
    x = jax.ShapeDtypeStruct((B, H, T, d), dtype)
    if window is not None:         # right = 0 when causal: LocalMask alone is causal too
        one = sa.LocalMask((T, T), window_size=(window[0], 0 if causal else window[1]),
                           offset=0)
    else:
        one = sa.CausalMask((T, T)) if causal else sa.FullMask((T, T))
    bq, bk = block if block else (128, 128)        # splash's defaults: 128 everywhere
    bs = sa.BlockSizes(block_q=bq, block_kv=bk, block_kv_compute=bk, block_q_dkv=bq,
                       block_kv_dkv=bk, block_kv_dkv_compute=bk, use_fused_bwd_kernel=fused,
                       **({} if fused else dict(block_q_dq=bq, block_kv_dq=bk)))
    if not block and not fused:
        assert bs == sa.BlockSizes.get_default(), "splash's defaults moved: update the bench"
    kernel = sa.make_splash_mha(sa.MultiHeadMask([one] * H), block_sizes=bs, head_shards=1,
                                q_seq_shards=1, attn_logits_soft_cap=soft_cap)
    info = {"forward": [bs.block_q, bs.block_kv], "dq": [bs.block_q_dq, bs.block_kv_dq],
            "dkdv": [bs.block_q_dkv, bs.block_kv_dkv], "fused": fused}
    return jax.vmap(kernel), (x, x, x), info


def _jax_flash(chip, backward, causal, block, shape, dtype, window=None, soft_cap=None):
    import jax
    if window is not None or soft_cap is not None:
        raise NotImplementedError(OPTIONS_JAX_LACKS)
    from flashlab.compat.pallas import official_flash_attention
    fa = official_flash_attention()
    B, T, H, d = shape
    x = jax.ShapeDtypeStruct((B, H, T, d), dtype)
    q, b = block if block else (None, None)
    bs = fa.BlockSizes.get_default(B, H, T, T, d) if not b else fa.BlockSizes(
        block_q=q, block_k_major=b, block_k=b, block_b=1, block_q_major_dkv=q,
        block_k_major_dkv=b, block_k_dkv=b, block_q_dkv=q, block_k_major_dq=b, block_k_dq=b,
        block_q_dq=q)

    def f(q, k, v):
        return fa.flash_attention(q, k, v, causal=causal, sm_scale=d ** -0.5, block_sizes=bs)
    info = {"forward": [bs.block_q, bs.block_k_major], "dq": [bs.block_q_dq, bs.block_k_major_dq],
            "dkdv": [bs.block_q_major_dkv, bs.block_k_major_dkv]}
    return f, (x, x, x), info


BUILDERS = {"flashlab": _flashlab, "splash": _splash, "jax_pallas_flash": _jax_flash,
             "splash_fused": _splash_fused, "flashlab_split": _flashlab_split}


def build(*, chip: str, library: str, backward: bool, batch: int, seq_len: int, heads: int,
          head_dim: int, dtype: str, causal: bool, block: int | None,
          window: tuple[int, int] | None = None, soft_cap: float | None = None):
    """``(fn, args, info)`` for :func:`flashlab.instruments.tpu_dump.schedules` (runs in its
    child).

    ``fn`` is the library's forward on ``[batch, seq, heads, head_dim]`` (flashlab) or
    ``[batch, heads, seq, head_dim]`` (the official kernels), or ``jax.grad`` of its sum
    w.r.t. q, k, v when ``backward``; ``block``: ``None`` for the library's default blocks,
    an int for ``block x block`` everywhere, or a pair ``(block_q, block_k)``; ``window``
    and ``soft_cap``: the module docstring's. ``info["blocks"]``: (block_q, block_k) per kernel.
    """
    import jax
    import jax.numpy as jnp
    if isinstance(block, int):
        block = (block, block)
    f, args, blocks = BUILDERS[library](chip, backward, causal, block,
                                         (batch, seq_len, heads, head_dim), jnp.dtype(dtype),
                                         None if window is None else tuple(window), soft_cap)
    if backward:
        g = jax.grad(lambda q, k, v: f(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))
        return g, args, {"blocks": blocks}
    return f, args, {"blocks": blocks}
