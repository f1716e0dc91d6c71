"""Adapters: one validated request (q, k, v, AttentionSpec) -> each backend's own calling
convention.

Every adapter has the signature ``fn(query, key, value, spec, *, interpret) -> out`` with the
public layout ``[batch, seq, heads, head_dim]`` in and out. Whatever a backend needs that the
contract does not give it directly is done here and only here: the layout change to
``[batch, heads, seq, head_dim]``, the scale convention, padding to a block multiple, segment
ids standing in for lengths and padding, and the zero-row contract (a query row with no
visible key returns zeros) for kernels that would otherwise return mean(V) for such rows.
Official kernels are called, never forked. Our own rungs (tiled, pallas_tpu) are imported
lazily so that this module imports on any branch.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from flashlab.contract import device
from flashlab.contract.masks import AttentionSpec
from flashlab.compat.shard_map import vma_of

__all__ = ["reference_fn", "xla_fn", "cudnn_fn", "tiled_fn", "pallas_tpu_fn",
           "jax_pallas_flash_fn", "splash_fn", "zero_invisible_rows", "blank_bias_as_mask",
           "OFFICIAL_BLOCK"]

OFFICIAL_BLOCK = 128   # the official TPU kernels' default block (and minimum lane multiple)


# ----------------------------------------------------------------------------- helpers

def zero_invisible_rows(out, spec: AttentionSpec, mask=None):
    """Enforce the zero-row contract on ``out [B, T, N, Dv]``: rows with no visible key -> 0.

    ``jnp.where`` also zeroes the cotangent flowing into those rows, so their gradients are
    exactly zero whatever the backend did inside (mean(V) rows, large finite mask values).
    ``mask`` replaces ``spec.mask`` (e.g. the one of :func:`blank_bias_as_mask`).
    """
    if mask is not None:
        spec = dataclasses.replace(spec, mask=mask)
    has_key = spec.dense_visible().any(axis=-1)           # [B|1, N|1, T]
    has_key = jnp.transpose(has_key, (0, 2, 1))[..., None]  # [B|1, T, N|1, 1]
    return jnp.where(has_key, out, jnp.zeros((), out.dtype))


def blank_bias_as_mask(spec: AttentionSpec):
    """``(bias, mask)`` with the bias's ``-inf`` entries moved into the mask.

    The contract's logits are ``-inf`` where the bias is ``-inf``; a row whose every logit is
    ``-inf`` has no visible key and returns 0. Libraries that mask with a large *finite*
    value (jax.nn, the official kernels) would give NaN (``-inf - -inf``) or mean(V) for such
    a row, so the adapters hand them a bias with those entries at 0 and a mask that hides
    them, and :func:`zero_invisible_rows` then zeroes the rows this mask leaves empty. A NaN
    or ``+inf`` bias stays in the bias: NaN logits must come out NaN. The mask has the
    broadcast shape of the mask and the bias (each ``[B|1, N|1, T|1, S|1]``), no larger.
    """
    if spec.bias is None:
        return None, spec.mask
    blank = spec.bias == -jnp.inf
    bias = jnp.where(blank, jnp.zeros((), spec.bias.dtype), spec.bias)
    return bias, _and_masks(spec.mask, jnp.logical_not(blank))


def _window_ints(spec: AttentionSpec):
    """``(left, right)`` with unbounded sides made finite (for APIs that need ints)."""
    if spec.window is None:
        return None
    big = max(spec.q_len, spec.kv_len)
    left, right = spec.window
    return (big if left is None else left, big if right is None else right)


def _segment_mask(spec: AttentionSpec):
    """Segment ids as a dense bool mask ``[B, 1, T, S]`` (or ``None``)."""
    if spec.q_segment_ids is None:
        return None
    return spec.q_segment_ids[:, None, :, None] == spec.kv_segment_ids[:, None, None, :]


def _and_masks(a, b):
    if a is None:
        return b
    if b is None:
        return a
    return a & b


# ----------------------------------------------------------------------------- reference / xla

def reference_fn(query, key, value, spec, *, interpret=None):
    """Naive attention (materializes the score matrix): every feature, every dtype."""
    from flashlab.ladder.reference import attention_from_spec
    return attention_from_spec(query, key, value, spec)


def _jax_nn(query, key, value, spec, implementation):
    # Segment ids become part of the dense boolean mask: jax.nn has no segment argument.
    # A -inf bias entry becomes a masked one (jax.nn would give NaN for a row of them).
    bias, mask = blank_bias_as_mask(spec)
    out = jax.nn.dot_product_attention(
        query, key, value, bias, _and_masks(mask, _segment_mask(spec)), scale=spec.scale,
        is_causal=spec.is_causal, query_seq_lengths=spec.q_lengths,
        key_value_seq_lengths=spec.kv_lengths, local_window_size=_window_ints(spec),
        implementation=implementation)
    # jax.nn masks with a large finite value: a row with no visible key would be mean(V).
    return zero_invisible_rows(out, spec, mask)


def xla_fn(query, key, value, spec, *, interpret=None):
    """``jax.nn.dot_product_attention(implementation="xla")`` + the zero-row contract."""
    return _jax_nn(query, key, value, spec, "xla")


def cudnn_fn(query, key, value, spec, *, interpret=None):
    """``jax.nn.dot_product_attention(implementation="cudnn")`` (GPU, fp16/bf16)."""
    return _jax_nn(query, key, value, spec, "cudnn")


def cudnn_check(spec: AttentionSpec) -> str | None:
    """Constraints of cuDNN's fused attention beyond feature names (None = fine)."""
    if spec.window is not None and not spec.is_causal and spec.window[1] not in (0,):
        return "cuDNN supports local_window_size only with right == 0 or is_causal=True"
    if spec.window is not None and spec.window[0] is None:
        return "cuDNN needs a bounded left window"
    if spec.head_dim % 8 or spec.head_dim > 256:
        return f"cuDNN needs head_dim a multiple of 8 and <= 256, got {spec.head_dim}"
    return None


# ----------------------------------------------------------------------------- our rungs

def tiled_fn(query, key, value, spec, *, interpret=None):
    """flashlab.ladder.tiled: blockwise attention in plain JAX (branch ``tiled``)."""
    from flashlab.ladder.tiled import tiled_attention_from_spec
    return tiled_attention_from_spec(query, key, value, spec)


def pallas_tpu_fn(query, key, value, spec, *, interpret=None):
    """flashlab.kernels: our Pallas TPU kernels (branch ``kernel``); interpret off-TPU."""
    from flashlab.kernels import flash_attention_from_spec
    mode = device.interpret_mode(interpret)
    if mode is not False and vma_of(spec.q_lengths, spec.kv_lengths):
        spec = _lengths_as_segments(spec)
    return flash_attention_from_spec(query, key, value, spec, interpret=mode)


def _lengths_as_segments(spec: AttentionSpec) -> AttentionSpec:
    """The same visibility with the lengths folded into segment ids (``_padded_segment_ids``).

    Used for our kernels in interpret mode inside ``shard_map(check_vma=True)`` when the
    lengths differ per device: JAX's Pallas interpreter (jax 0.10) slices scalar-prefetch
    operands with its own loop index, which is not varying, and the checker rejects that
    ("dynamic_slice requires varying manual axes to match"). Segment ids are ordinary
    operands, so the kernel sees the same mask; only length-based block skipping is lost,
    which an interpreter does not need.
    """
    q_seg, kv_seg = _padded_segment_ids(spec, spec.q_len, spec.kv_len)
    return dataclasses.replace(spec, q_lengths=None, kv_lengths=None, q_segment_ids=q_seg,
                               kv_segment_ids=kv_seg)


# ----------------------------------------------------------------------------- official kernels

def _tpu_interpret_params(interpret):
    """``None`` for compiled; the InterpretParams to force TPU interpret mode with otherwise."""
    if interpret is None or interpret is False:
        return None
    from flashlab.compat import pallas as compat
    if interpret is True:
        return compat.InterpretParams()
    return interpret


def _under_tpu_interpret(fn, params):
    """``fn`` run in TPU interpret mode, as one effect-free host callback per pass.

    ``pltpu.force_tpu_interpret_mode`` applies to pallas_calls *traced* under it, and the TPU
    interpreter simulates memory with ``io_callback``s, whose effects ``jax.checkpoint``
    refuses ("Effects not supported in partial-eval of `checkpoint`/`remat`"). So the
    interpreted forward (and the backward, ``jax.vjp`` of it) runs inside a ``pure_callback``
    that jits and calls it on the host: the caller's program sees no effect, and remat may
    replay it (re-simulating a kernel changes nothing). The callbacks are ``custom_vjp``-joined;
    the backward recomputes the forward from the saved inputs, as remat would. A caller's
    ``jax.vmap`` loops over the callback (``vmap_method="sequential"``), so the interpreter,
    which cannot batch a ``pallas_call`` (jax 0.10: a ``safe_zip`` length error), never sees it.
    """
    if params is None:
        return fn
    from flashlab.compat.pallas import force_tpu_interpret_mode

    @jax.jit
    def fwd_host(args):
        with force_tpu_interpret_mode(params):
            return fn(*args)

    def shapes(tree):
        return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)

    def call(host, out, *args):
        def on_cpu(*a):             # the interpreter is a CPU program, wherever the caller is
            with jax.default_device(jax.devices("cpu")[0]):
                return host(*a)
        return jax.pure_callback(on_cpu, out, *args, vmap_method="sequential")

    @jax.custom_vjp
    def wrapped(*args):
        return call(fwd_host, jax.eval_shape(fn, *shapes(args)), args)

    def fwd(*args):
        return wrapped(*args), args

    def bwd(args, g):
        # Cotangents of the float leaves from the host; integer leaves (segment ids) get
        # float0 zeros, as JAX wants for them.
        leaves, tree = jax.tree_util.tree_flatten(args)
        is_f = [jnp.issubdtype(x.dtype, jnp.inexact) for x in leaves]

        def merge(fl, ints):
            fl, ints = iter(fl), iter(ints)
            return [next(fl) if f else next(ints) for f in is_f]

        @jax.jit
        def bwd_host(fl, ints, g):
            f = lambda fl: fn(*tree.unflatten(merge(fl, ints)))
            with force_tpu_interpret_mode(params):
                return jax.vjp(f, fl)[1](g)[0]

        fl = [x for x, f in zip(leaves, is_f) if f]
        ints = [x for x, f in zip(leaves, is_f) if not f]
        dfl = call(bwd_host, shapes(fl), fl, ints, g)
        zeros = [np.zeros(x.shape, jax.dtypes.float0) for x in ints]
        return tuple(tree.unflatten(merge(dfl, zeros)))

    wrapped.defvjp(fwd, bwd)
    return wrapped


def _pad_to(x, axis, multiple):
    n = x.shape[axis]
    pad = (-n) % multiple
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def _padded_segment_ids(spec: AttentionSpec, Tp: int, Sp: int):
    """Segment ids ``[B, Tp]``, ``[B, Sp]`` that also encode lengths and padding, or ``None``.

    Padded or beyond-length queries get an id no key has and padded or beyond-length keys
    an id no query has, so the kernel's own segment mask hides them.
    """
    T, S, B = spec.q_len, spec.kv_len, spec.batch
    need = (spec.q_segment_ids is not None or spec.q_lengths is not None
            or spec.kv_lengths is not None or Tp != T or Sp != S)
    if not need:
        return None
    q_seg = jnp.zeros((B, T), jnp.int32) if spec.q_segment_ids is None else spec.q_segment_ids
    kv_seg = jnp.zeros((B, S), jnp.int32) if spec.kv_segment_ids is None else spec.kv_segment_ids
    lo = jnp.minimum(q_seg.min(), kv_seg.min())
    q_valid = jnp.arange(Tp)[None, :] < (T if spec.q_lengths is None else spec.q_lengths[:, None])
    kv_valid = jnp.arange(Sp)[None, :] < (S if spec.kv_lengths is None else spec.kv_lengths[:, None])
    q_valid &= jnp.arange(Tp)[None, :] < T
    kv_valid &= jnp.arange(Sp)[None, :] < S
    q_seg = jnp.where(q_valid, jnp.pad(q_seg, ((0, 0), (0, Tp - T))), lo - 1)
    kv_seg = jnp.where(kv_valid, jnp.pad(kv_seg, ((0, 0), (0, Sp - S))), lo - 2)
    return q_seg, kv_seg


def jax_pallas_flash_fn(query, key, value, spec, *, interpret=None):
    """The official ``jax.experimental.pallas.ops.tpu.flash_attention``.

    Its logits are ``(q·k + ab) * sm_scale``; ours are ``scale * q·k + bias``, so ``ab`` is
    ``bias / scale``. The dense mask joins ``ab`` as a large negative value. Sequences are
    padded to multiples of 128 (its block size); lengths and padding become segment ids.
    """
    from flashlab.compat.pallas import official_flash_attention
    fa = official_flash_attention()
    B, T, N, D = query.shape
    S = key.shape[1]
    blk = OFFICIAL_BLOCK
    Tp, Sp = T + (-T) % blk, S + (-S) % blk
    # [B, T, N, D] -> [B, N, T, D], padded along the sequence.
    q, k, v = (_pad_to(jnp.swapaxes(x, 1, 2), 2, blk) for x in (query, key, value))
    ab = None
    bias, mask = blank_bias_as_mask(spec)
    if bias is not None or mask is not None:
        ab = jnp.zeros((1, 1, T, S), jnp.float32)
        if bias is not None:
            ab = ab + bias.astype(jnp.float32) / spec.scale
        if mask is not None:
            ab = jnp.where(mask, ab, -1e30)
        ab = jnp.broadcast_to(ab, (B, N, T, S))
        ab = _pad_to(_pad_to(ab, 2, blk), 3, blk)
    seg = _padded_segment_ids(spec, Tp, Sp)
    sizes = fa.BlockSizes(block_q=blk, block_k_major=blk, block_k=blk, block_b=1,
                          block_q_major_dkv=blk, block_k_major_dkv=blk, block_k_dkv=blk,
                          block_q_dkv=blk, block_k_major_dq=blk, block_k_dq=blk, block_q_dq=blk)

    def run(q, k, v, ab, seg):
        seg_ids = None if seg is None else fa.SegmentIds(q=seg[0], kv=seg[1])
        return fa.flash_attention(q, k, v, ab, seg_ids, causal=spec.is_causal,
                                  sm_scale=spec.scale, block_sizes=sizes)

    out = _under_tpu_interpret(run, _tpu_interpret_params(interpret))(q, k, v, ab, seg)
    out = jnp.swapaxes(out[:, :, :T], 1, 2)               # [B, T, N, D]
    return zero_invisible_rows(out, spec, mask)


def _vmap_map(f, *xs):
    return jax.vmap(f)(*xs)


def _python_map(f, *xs):
    return jnp.stack([f(*(x[i] for x in xs)) for i in range(xs[0].shape[0])])


def _splash_mask(spec: AttentionSpec, Tp: int, Sp: int, heads: int):
    from flashlab.compat.pallas import official_splash_attention
    sa = official_splash_attention()
    shape = (Tp, Sp)
    w = spec.window
    if w is not None and spec.is_causal:
        # causal & window(l, r) = window(l, 0) since r >= 0.
        one = sa.CausalMask(shape) if w[0] is None else sa.LocalMask(shape, (w[0], 0), offset=0)
    elif w is not None:
        one = sa.LocalMask(shape, w, offset=0)
    elif spec.is_causal:
        one = sa.CausalMask(shape)
    else:
        one = sa.FullMask(shape)
    return sa.MultiHeadMask([one] * heads)


def splash_fn(query, key, value, spec, *, interpret=None):
    """The official splash attention (``jax.experimental.pallas.ops.tpu.splash_attention``).

    Splash has no scale argument (q is pre-scaled) and works on one batch row ``[H, T, D]``
    (vmapped over batch); GQA runs the MQA kernel once per kv head (vmapped), so K/V are never
    repeated. Causal/window masks are splash's own lazy masks; lengths, segments and padding to
    a multiple of 128 become segment ids.
    """
    from flashlab.compat.pallas import official_splash_attention
    sa = official_splash_attention()
    B, T, N, D = query.shape
    S, K = key.shape[1], key.shape[2]
    G = N // K
    blk = OFFICIAL_BLOCK
    Tp, Sp = T + (-T) % blk, S + (-S) % blk
    q = _pad_to(jnp.swapaxes(query * jnp.asarray(spec.scale, query.dtype), 1, 2), 2, blk)
    k, v = (_pad_to(jnp.swapaxes(x, 1, 2), 2, blk) for x in (key, value))   # [B, K, Sp, D]
    seg = _padded_segment_ids(spec, Tp, Sp)
    params = _tpu_interpret_params(interpret)
    kw = dict(head_shards=1, q_seq_shards=1, attn_logits_soft_cap=spec.soft_cap)
    if params is not None:
        kw["interpret"] = params

    # Compiled: vmap over rows. TPU interpret mode in jax 0.10 mis-handles the grid axis vmap
    # adds to a pallas_call, so interpreted runs loop in Python (tiny shapes only anyway); a
    # caller's jax.vmap never reaches the interpreter (see _under_tpu_interpret).
    _map = _vmap_map if params is None else _python_map

    def run(q, k, v, seg):
        # Over batch rows for MHA, over (batch, kv head) pairs for GQA/MQA.
        if G == 1:
            kernel = sa.make_splash_mha(_splash_mask(spec, Tp, Sp, N), **kw)
        else:
            kernel = sa.make_splash_mqa(_splash_mask(spec, Tp, Sp, G), **kw)
            q = q.reshape(B * K, G, Tp, D)                    # [B*K, G, Tp, D]
            k, v = k.reshape(B * K, Sp, D), v.reshape(B * K, Sp, D)
            if seg is not None:                               # ids per (batch, kv head)
                seg = tuple(jnp.repeat(x, K, axis=0) for x in seg)
        if seg is None:
            out = _map(lambda q, k, v: kernel(q, k, v), q, k, v)
        else:
            out = _map(lambda q, k, v, sq, skv: kernel(q, k, v, segment_ids=sa.SegmentIds(sq, skv)),
                       q, k, v, *seg)
        return out.reshape(B, N, Tp, D)

    out = _under_tpu_interpret(run, params)(q, k, v, seg)
    out = jnp.swapaxes(out[:, :, :T], 1, 2).astype(query.dtype)
    return zero_invisible_rows(out, spec)
