"""``flash_attention``: the forward kernel and the backward kernels joined by ``jax.custom_vjp``.

The forward (:mod:`flashlab.kernels.forward`, chapter 05) saves ``O`` and ``lse [B, N, T]``;
the backward (:mod:`flashlab.kernels.backward`, chapter 07) recomputes each tile's
probabilities from them. This module is the only one that imports both, so neither imports
the other's caller.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from flashlab.compat.shard_map import in_manual_mesh, pvary, vma_of
from flashlab.contract import layouts, masks
from flashlab.contract.masks import AttentionSpec
from flashlab.kernels import backward
from flashlab.kernels import blocks as blk
from flashlab.kernels import backward_grid
from flashlab.kernels import forward as fwd
from flashlab.kernels import forward_config
from flashlab.ladder import online_softmax

__all__ = ["flash_attention", "flash_attention_from_spec"]


def _attention_impl(query, key, value, spec, cfg, bwd_cfg, interpret):
    return fwd._forward(query, key, value, spec, cfg=cfg, interpret=interpret)[0]


# Two registrations of one rule. ``_attention`` asks for symbolic zeros, so the backward knows
# whether the bias is differentiated (a constant bias, e.g. ALiBi, gets no [B, N, T, S] dS
# written). JAX does not implement symbolic zeros inside shard_map, so there
# ``_attention_manual`` is used: it treats a bias as differentiated (its cotangent is dropped
# by the caller when it is not).
_attention = jax.custom_vjp(_attention_impl, nondiff_argnums=(4, 5, 6))
_attention_manual = jax.custom_vjp(_attention_impl, nondiff_argnums=(4, 5, 6))


def _check_lse_fits(spec: AttentionSpec, cfg) -> None:
    """Raise ``ValueError`` where ``cfg``'s blocks fit the forward alone but not the forward
    that differentiation runs, which also writes lse (``[block_q, 128]`` float32, double
    buffered: 2 MiB at ``block_q`` = 2048), instead of letting Mosaic run out of VMEM (v4,
    d=256, 2048 x 512: 16.0 MiB estimated without lse, 18.0 with; Mosaic used 16.68 of 16).
    The same check as :func:`forward_config.make_config`'s, on the same request facts
    (:func:`forward_config.block_kwargs`), with the lse block counted."""
    try:
        blk.check_block_sizes(cfg.block_q, cfg.block_k, head_dim=spec.head_dim, dtype=cfg.dtype,
                              chip=cfg.chip,
                              **dict(forward_config.block_kwargs(spec), return_lse=True))
    except ValueError as e:
        raise ValueError(f"{e} (differentiated, the forward also writes lse, [block_q, 128] "
                         f"float32)") from None


def _attention_fwd(query, key, value, spec, cfg, bwd_cfg, interpret):
    # symbolic_zeros=True: every array leaf arrives as CustomVJPPrimal(value, perturbed), so
    # the backward knows whether the bias is differentiated (a constant bias gets no dS).
    is_primal = lambda x: isinstance(x, jax.custom_derivatives.CustomVJPPrimal)  # noqa: E731
    if is_primal(query):
        with_dbias = spec.bias is not None and bool(spec.bias.perturbed)
        query, key, value, spec = jax.tree_util.tree_map(
            lambda x: x.value, (query, key, value, spec), is_leaf=is_primal)
    else:                                                 # _attention_manual
        with_dbias = spec.bias is not None
    # Differentiated: also emit lse [B, N, T] (O(N)), the only residual besides the inputs/O;
    # blocks given for the forward alone may not leave VMEM for its block (_check_lse_fits).
    _check_lse_fits(spec, cfg)
    cfg = dataclasses.replace(cfg, return_lse=True)
    out, lse = fwd._forward(query, key, value, spec, cfg=cfg, interpret=interpret)
    flag = jnp.zeros((0,), jnp.float32) if with_dbias else None     # static, in the structure
    return out, (query, key, value, spec, out, lse, flag)


def _attention_bwd(cfg, bwd_cfg, interpret, residuals, d_out):
    query, key, value, spec, out, lse, flag = residuals
    if isinstance(d_out, jax.custom_derivatives.SymbolicZero):
        d_out = jnp.zeros(d_out.shape, d_out.dtype)
    bwd_cfg, fused = bwd_cfg                    # (backward config, the fused option): static
    dq, dk, dv, dbias = backward._backward(query, key, value, spec, out, lse, d_out,
                                           cfg=bwd_cfg, interpret=interpret,
                                           with_dbias=flag is not None, fused=fused)
    # The spec's cotangent: dBias for the bias, symbolic zeros (None) for masks and lengths.
    d_spec = jax.tree_util.tree_map(lambda _: None, spec)
    if dbias is not None:
        d_spec = dataclasses.replace(d_spec, bias=dbias)
    if spec.sinks is not None:   # O and lse include the sink, so the kernels' dQ/dK/dV hold
        d_spec = dataclasses.replace(d_spec, sinks=_sink_grad(spec.sinks, out, lse, d_out))
    return dq, dk, dv, d_spec


_attention.defvjp(_attention_fwd, _attention_bwd, symbolic_zeros=True)
_attention_manual.defvjp(_attention_fwd, _attention_bwd)


def _sink_grad(sinks, out, lse, d_out):
    """``dsinks [N]``: ``-sum_{b,i} exp(sink - lse) D_i`` (an O(N·d) XLA fusion, no kernel)."""
    di = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)   # [B, T, N]
    d = online_softmax.sink_grad(sinks[None, :, None], lse, jnp.swapaxes(di, 1, 2))  # [B, N]
    return jnp.sum(d, axis=0).astype(sinks.dtype)


BACKWARDS = backward_grid.BACKWARDS


def flash_attention_from_spec(query, key, value, spec: AttentionSpec, *, block_q=None,
                              block_k=None, interpret=None, chip=None, backward="auto"):
    """The forward kernel on already validated inputs (what the backend registry calls)."""
    cfg = forward_config.make_config(spec, block_q=block_q, block_k=block_k, chip=chip)
    bwd_cfg = backward_grid.resolve_backward(spec, backward, block_q=block_q, block_k=block_k,
                                             chip=chip)
    f = _attention_manual if in_manual_mesh() else _attention
    # Inside shard_map: every operand varies over the same mesh axes, so each cotangent has
    # its primal's type (JAX sums a replicated input's cotangent outside, as for any op).
    query, key, value, spec = pvary((query, key, value, spec), vma_of(query, key, value, spec))
    return f(query, key, value, spec, cfg, bwd_cfg, fwd._resolve_interpret(interpret))


def flash_attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
                    query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
                    segment_ids=None, logits_soft_cap=None, block_q=None, block_k=None,
                    interpret=None, chip=None, sinks=None, backward="auto", layout="BTNH"):
    """FlashAttention forward as a Pallas TPU kernel.

    Same arguments, semantics and validation as :func:`flashlab.ladder.reference.naive_attention`
    (layout ``[batch, seq, heads, head_dim]``; float32 or bfloat16; any lengths; GQA/MQA),
    plus:

      block_q, block_k: B_r and B_c. Default: :func:`flashlab.kernels.choose_block_sizes` for
        this TPU generation and shape (under a window, priced for its band). block_q must be a multiple of the sublane tile (8 fp32, 16 bf16,
        32 with a mask), block_k of 128, and the blocks' VMEM estimate (``blocks.vmem_bytes``;
        under ``jax.grad`` with the forward's lse block too) must fit the limit the kernel asks
        for (``blocks.vmem_limit_bytes``); otherwise ``ValueError`` naming the argument. The
        default blocks fit the differentiated forward.
      interpret: ``None`` (compiled with Mosaic on a TPU, the generic interpreter elsewhere),
        ``True``/``False``, or a ``pltpu.InterpretParams`` (TPU interpret mode).
      chip: the TPU generation ("v4", "v5e", "v5p", "v6e", "7x") whose VMEM sizes the default
        blocks, the VMEM check and the compiled kernel's ``vmem_limit_bytes``, forward and
        backward. ``None`` (default) reads the compile target: the chip
        :func:`flashlab.instruments.tpu_compile.compile` compiles for, or the TPU devices of the
        mesh being traced under, else this host's TPU, else ``v5e``. An explicit ``chip`` wins.
      sinks: optional float ``[heads]`` sink logits, merged into each row's state at the
        last kv step (``online_softmax.sink_state``); differentiable.
      backward: which backward ``jax.grad`` runs: ``"auto"`` (default:
        :func:`flashlab.kernels.backward_grid.resolve_backward`, fused where its resident dQ
        fits VMEM, whole or in at most 8 query chunks, else split), ``"split"`` (a dK/dV kernel
        and a dQ kernel, 7 matmuls per tile) or ``"fused"`` (one kernel, 5 matmuls per tile,
        dQ ``[G, T, d]`` float32 resident in VMEM, whole or per query chunk; ``ValueError``
        where not even 8 chunks fit).
        Chapter 07 weighs the two.
      layout: ``"BTNH"`` (default) or ``"BNTH"``: query, key, value and the result as
        ``[batch, heads, seq, head_dim]``, which the kernels read in place under ``jit`` (no
        transposed copies in HBM; :mod:`flashlab.contract.layouts`).

    Returns ``[batch, q_seq, heads, head_dim_v]`` (``[batch, heads, q_seq, head_dim_v]`` with
    ``layout="BNTH"``) in the query's dtype (fp32 accumulation).
    Rows with no visible key are zeros, with zero gradients. Differentiable (``jax.grad``
    w.r.t. query, key, value and bias) through the backward kernels of
    :mod:`flashlab.kernels.backward` (chapter 07); the backward's block sizes are
    ``block_q``/``block_k`` when they fit its VMEM estimate, else
    :func:`flashlab.kernels.blocks.choose_backward_block_sizes`.
    """
    query, key, value = layouts.to_contract(layout, query, key, value)
    query, key, value, spec = masks.validate(
        query, key, value, bias, mask, scale=scale, is_causal=is_causal,
        query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
        local_window_size=local_window_size, segment_ids=segment_ids,
        logits_soft_cap=logits_soft_cap, sinks=sinks)
    out = flash_attention_from_spec(query, key, value, spec, block_q=block_q, block_k=block_k,
                                    interpret=interpret, chip=chip, backward=backward)
    return layouts.from_contract(layout, out)
