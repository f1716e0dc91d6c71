"""Which backward runs, at which blocks (chapter 07): the split (a dK/dV and a dQ kernel) or
the fused (one kernel, its dQ resident in VMEM, whole or in query chunks).

:func:`resolve_backward` is what ``flash_attention(..., backward=...)`` asks;
:func:`make_backward_config` sizes the blocks; :func:`dq_chunks` splits the fused kernel's
resident dQ where the whole of it does not fit VMEM. The grids themselves are in
:mod:`flashlab.kernels.backward_grid`.
"""
from __future__ import annotations

import jax.numpy as jnp

from flashlab.contract.masks import AttentionSpec
from flashlab.kernels import blocks as blk
from flashlab.kernels import forward_config
from flashlab.kernels.forward_config import ForwardConfig

__all__ = ["BACKWARDS", "GRADS_ON_LANES", "MAX_DQ_CHUNKS", "dq_chunks",
           "grads_on_lanes", "make_backward_config", "resolve_backward"]

#: The fused backward against the split one, whole backward on the static schedule (the stored
#: ``bench tpu-static`` run, B=2 T=8192 H=16 d=128 bf16 causal, jax 0.12.0.1 / libtpu
#: 0.0.50.1): 0.65x at 1024x1024 on v5e and v5p, 0.66x on v6e and 7x (its diagonal strips
#: included); on v4, whose 16 MiB of VMEM holds the whole resident dQ only beside smaller
#: tiles, 0.68x at 512x1024 against the split at its best (1024x1024). So ``"auto"`` runs it
#: wherever it fits.
BACKWARDS = ("auto", "split", "fused")
#: The most query chunks the fused backward splits its resident dQ into when the whole
#: ``[G, T, d]`` does not fit VMEM (:func:`dq_chunks`). Each chunk re-reads K and V and writes
#: float32 dK, dV partials ``[B, K, S, d]`` that XLA sums after (HBM bytes the static
#: schedule does not see): at 4 chunks, B=2 K=16 S=32768 d=128, 4 GiB written and read
#: again, against the ~8 GiB of K, V re-reads the split's dQ kernel adds at 1024-blocks.
#: Past 8 chunks the split runs.
MAX_DQ_CHUNKS = 8
#: The chips whose fused kernel, where every block is visible, reads dO as ``[d, B_r]``
#: blocks and keeps its dQ as ``[G, d, T / n]``: the query positions on lanes
#: (:func:`grads_on_lanes`). Then ``dQᵀ = Kᵀ dS'ᵀ`` needs no transpose of the tile ``dS'ᵀ``,
#: which ``dQ = dS' K`` does, and ``dPᵀ = V dOᵀ`` pushes its weights plainly. The fused tile,
#: B=2 T=8192 H=16 d=128 bf16 non-causal, jax 0.12.0.1 / libtpu 0.0.50.1, at 512² (2048²):
#: v6e 1611 -> 1487 cycles (20931 -> 18828), 7x 1634 -> 1479 (20849 -> 18767). Not on v5e
#: and v5p, whose XLUs hide that transpose: 2805 -> 2804 (41451 -> 41527) on v5e, even with dP
#: issued first 2777 (41542); nor on v4: 2876 -> 3193. dO is transposed from the caller's
#: layout anyway ([B, T, N, d] -> [B, N, T, d]): from "BTNH" this costs no HBM pass.
GRADS_ON_LANES = frozenset({"v6e", "7x"})


def _vmem_kw(spec: AttentionSpec, fused: bool) -> dict:
    """What the backward's VMEM estimate needs of ``spec`` (the fused kernel: its resident dQ
    ``[G, T, d]``)."""
    kw = dict(forward_config.block_kwargs(spec), soft_cap=spec.soft_cap is not None,
              fused=fused)
    return dict(kw, q_len=spec.q_len, group=spec.group_size) if fused else kw


def make_backward_config(spec: AttentionSpec, *, block_q=None, block_k=None,
                         chip=None, fused: bool = False,
                         visit_grid: bool | None = None) -> ForwardConfig:
    """The backward kernels' configuration: the forward's, with the backward's block sizes.

    Explicit ``block_q``/``block_k`` (the ones given to ``flash_attention``) are used when they
    fit :func:`blocks.backward_vmem_bytes`; missing or too large ones come from
    :func:`blocks.choose_backward_block_sizes` for ``chip`` (``None``: the compile target,
    :func:`blocks.resolve_chip`). ``block_q`` is rounded up to a multiple of 128: the dK/dV
    kernel computes the transposed tile ``Sᵀ [B_c, B_r]``, where B_r is the lane dim.
    ``fused``: blocks beside which the fused backward's resident float32 dQ fits, whole or in
    at most :data:`MAX_DQ_CHUNKS` query chunks (:func:`dq_chunks`); the default ones hold the
    whole dQ where some do, else they are the split's.
    ``visit_grid``: as in :func:`forward_config.make_config` (``None``: where it skips enough
    steps to pay, :data:`forward_config.VISIT_MAX_SHARE`).
    """
    chip = blk.resolve_chip(chip)
    dt = jnp.dtype(spec.dtype)
    kw = _vmem_kw(spec, fused)
    choose_kw = {k: v for k, v in kw.items() if k != "q_len"}
    auto_q, auto_k = blk.choose_backward_block_sizes(spec.q_len, spec.kv_len, spec.head_dim, dt,
                                                     chip, is_causal=spec.is_causal,
                                                     window=spec.window, **choose_kw)
    if fused and not blk._backward_fits(auto_q, auto_k, spec.head_dim, dt, chip, **kw):
        split_kw = {k: v for k, v in _vmem_kw(spec, False).items() if k != "q_len"}
        auto_q, auto_k = blk.choose_backward_block_sizes(    # no whole dQ fits: chunk it
            spec.q_len, spec.kv_len, spec.head_dim, dt, chip, is_causal=spec.is_causal,
            window=spec.window, **split_kw)
    auto_q = blk.round_up(auto_q, blk.LANES)
    bq = auto_q if block_q is None else blk.round_up(block_q, blk.LANES)
    bk = auto_k if block_k is None else block_k
    if not any(blk._backward_fits(bq, bk, spec.head_dim, dt, chip, q_chunks=n, **kw)
               for n in _chunk_counts(spec.q_len, bq, fused)):
        bq, bk = auto_q, auto_k
    return forward_config.make_config(spec, block_q=bq, block_k=bk, chip=chip,
                                      visit_grid=visit_grid, backward_blocks=True)


def _chunk_counts(q_len: int, block_q: int, fused: bool) -> list[int]:
    """The query-chunk counts a fused backward may split its dQ into at ``block_q`` (the
    divisors of its q-block count up to :data:`MAX_DQ_CHUNKS`); ``[1]`` for the split."""
    nq = -(-q_len // block_q)
    return [n for n in range(1, MAX_DQ_CHUNKS + 1) if nq % n == 0] if fused else [1]


def grads_on_lanes(cfg: ForwardConfig, fused: int) -> bool:
    """Whether the dK/dV kernel at ``cfg`` reads dO as ``[B, N, d, T]`` (blocks ``[d, B_r]``)
    and writes its dQ as ``[B, N, d, T]`` float32: the fused kernel (``fused`` ≥ 1) on a chip
    of :data:`GRADS_ON_LANES`, where every block is visible (no mask at all) or causal is the
    only mask (no window or lengths: the diagonal's pieces slice dO's block by columns, as
    they slice the transposed statistics)."""
    causal = cfg.causal_only and not cfg.length_masked
    return (bool(fused) and cfg.chip in GRADS_ON_LANES
            and (blk.every_block_visible(cfg) or causal))


def dq_chunks(spec: AttentionSpec, cfg: ForwardConfig) -> int:
    """How many query chunks the fused backward splits its resident dQ into at ``cfg``'s
    blocks: the fewest (a divisor of ``cfg.num_q_blocks``, at most :data:`MAX_DQ_CHUNKS`)
    whose ``[G, T / n, d]`` float32 block fits VMEM beside the tiles
    (:func:`blocks.backward_vmem_bytes`); 1 is the whole sequence; 0: none fits."""
    kw = _vmem_kw(spec, True)
    return next((n for n in _chunk_counts(spec.q_len, cfg.block_q, True)
                 if blk._backward_fits(cfg.block_q, cfg.block_k, spec.head_dim,
                                       jnp.dtype(spec.dtype), cfg.chip, q_chunks=n, **kw)), 0)


def resolve_backward(spec: AttentionSpec, backward: str = "auto", *, block_q=None,
                     block_k=None, chip=None) -> tuple[ForwardConfig, int]:
    """``(config, fused)``: which backward ``jax.grad`` runs, and its configuration.

    ``fused`` is 0 for the split backward (the dK/dV and dQ kernels), else the number of
    query chunks of the fused backward's resident dQ (:func:`dq_chunks`; 1: the whole
    sequence). ``"split"``: 0. ``"fused"``: the fused kernel (raises ``ValueError`` where
    even :data:`MAX_DQ_CHUNKS` chunks of its dQ do not fit VMEM). ``"auto"``: fused wherever
    it fits at the backward's blocks (the ones given, else the measured table's,
    :func:`blocks.choose_backward_block_sizes`, which ranks each pair by the backward that
    runs there), else split: the fused backward is faster on every chip where it fits
    (0.65-0.68x the split's static estimate), and the choice never trades tiles for it.
    """
    if not isinstance(backward, str) or backward not in BACKWARDS:
        raise ValueError(f"backward: expected one of {BACKWARDS}, got {backward!r}")
    cfg = make_backward_config(spec, block_q=block_q, block_k=block_k, chip=chip,
                               fused=backward == "fused")
    if backward == "split":
        return cfg, 0
    n = dq_chunks(spec, cfg)
    if backward == "fused" and not n:
        need = blk.backward_vmem_bytes(cfg.block_q, cfg.block_k, spec.head_dim,
                                       jnp.dtype(spec.dtype), q_chunks=MAX_DQ_CHUNKS,
                                       **_vmem_kw(spec, True))
        raise ValueError(
            f"backward='fused': q_len={spec.q_len} with {spec.group_size} query head(s) per kv "
            f"head needs {need / 2**20:.1f} MiB of VMEM on {cfg.chip} even with its dQ "
            f"[G, T, d] float32 in {MAX_DQ_CHUNKS} chunks, over the "
            f"{blk.vmem_limit_bytes(cfg.chip) / 2**20:.0f} MiB limit; expected "
            f"backward='split' or 'auto' at this length")
    return cfg, n
