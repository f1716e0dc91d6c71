"""First Pallas kernels of chapter 04: a tiled add, a tiled matmul, a gather, a row softmax.

They are small on purpose: a grid, BlockSpecs with index maps, a VMEM accumulator, the
"parallel"/"arbitrary" dimension semantics, an index map that reads a scalar-prefetched table
(:func:`gather_blocks`) and the answer to the chapter's exercise (:func:`row_softmax`), with
nothing else in the way. They use the public ``pl.`` / ``pltpu.`` names (chapter 08 explains
why the rest of flashlab reaches some of them through :mod:`flashlab.compat.pallas`). The
FlashAttention forward (:mod:`flashlab.kernels.forward`) is the matmul kernel plus the online
softmax.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from flashlab.contract import device
from flashlab.compat.pallas import pl, pltpu

__all__ = ["add_kernel", "tiled_add", "add_grid_spec", "matmul_kernel", "tiled_matmul",
           "matmul_grid_spec", "gather_kernel", "gather_blocks", "row_softmax_kernel",
           "row_softmax"]


def add_kernel(x_ref, y_ref, o_ref):
    """One grid step: the refs are VMEM blocks ``[block_m, block_n]``; add them."""
    o_ref[...] = x_ref[...] + y_ref[...]


def add_grid_spec(m: int, n: int, block_m: int, block_n: int):
    """Grid and BlockSpecs of :func:`tiled_add`: block ``(i, j)`` of x, y and out."""
    index_map = lambda i, j: (i, j)  # noqa: E731 -- grid step (i, j) -> block (i, j)
    spec = pl.BlockSpec((block_m, block_n), index_map)
    return dict(grid=(m // block_m, n // block_n), in_specs=[spec, spec], out_specs=spec)


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "interpret"))
def tiled_add(x, y, *, block_m: int = 8, block_n: int = 128, interpret=None):
    """``x + y`` for ``[M, N]`` arrays, one ``[block_m, block_n]`` tile per grid step."""
    m, n = x.shape
    if m % block_m or n % block_n:
        raise ValueError(f"block_m, block_n: expected divisors of x.shape={x.shape}, "
                         f"got ({block_m}, {block_n})")
    gs = add_grid_spec(m, n, block_m, block_n)
    return pl.pallas_call(
        add_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), **gs,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        cost_estimate=pl.CostEstimate(flops=m * n, transcendentals=0,
                                          bytes_accessed=3 * m * n * x.dtype.itemsize),
        interpret=device.interpret_mode(interpret))(x, y)


def matmul_kernel(x_ref, y_ref, o_ref, acc_ref):
    """Grid step ``(i, j, k)``: ``acc += X_ik @ Y_kj``; write ``O_ij`` at the last ``k``."""
    k = pl.program_id(2)

    @pl.when(k == 0)
    def _init():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    acc_ref[...] += jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)

    @pl.when(k == pl.num_programs(2) - 1)
    def _store():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def matmul_grid_spec(m: int, n: int, kdim: int, bm: int, bn: int, bk: int):
    """Grid ``(M/bm, N/bn, K/bk)`` and the BlockSpecs of :func:`tiled_matmul`.

    The output block ``(i, j)`` does not change along ``k``: it stays resident in VMEM
    while the X row-panel and Y column-panel stream past it.
    """
    return dict(
        grid=(m // bm, n // bn, kdim // bk),
        in_specs=[pl.BlockSpec((bm, bk), lambda i, j, k: (i, k)),     # X_ik
                  pl.BlockSpec((bk, bn), lambda i, j, k: (k, j))],    # Y_kj
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, k: (i, j)),     # O_ij
        scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)])


@functools.partial(jax.jit, static_argnames=("bm", "bn", "bk", "vmem_limit_bytes", "interpret"))
def tiled_matmul(x, y, *, bm: int = 128, bn: int = 128, bk: int = 128,
                 vmem_limit_bytes: int | None = None, interpret=None):
    """``x @ y`` (``[M, K] @ [K, N]``, out ``[M, N]`` in x's dtype), fp32 accumulation in VMEM.

    ``vmem_limit_bytes``: the scoped VMEM the compiled kernel may use (``None``: the
    compiler's default scoped limit,
    ``flashlab.instruments.roofline.chip(name).scoped_vmem_bytes``).
    """
    m, kdim = x.shape
    n = y.shape[1]
    if m % bm or n % bn or kdim % bk:
        raise ValueError(f"bm, bn, bk: expected divisors of M, N, K = {m}, {n}, {kdim}, "
                         f"got ({bm}, {bn}, {bk})")
    gs = matmul_grid_spec(m, n, kdim, bm, bn, bk)
    e = x.dtype.itemsize
    return pl.pallas_call(
        matmul_kernel, out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        **gs,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=vmem_limit_bytes),
        cost_estimate=pl.CostEstimate(
            flops=2 * m * n * kdim, transcendentals=0,
            bytes_accessed=(m * kdim * (n // bn) + kdim * n * (m // bm) + m * n) * e),
        interpret=device.interpret_mode(interpret))(x, y)


# ------------------------------------------------------------ scalar prefetch: a gather


def gather_kernel(perm_ref, x_ref, o_ref):
    """Grid step ``i``: copy the block the index map chose (``perm_ref`` is the SMEM table)."""
    del perm_ref                          # the table was used by the index map, not here
    o_ref[...] = x_ref[...]


def _check_block_indices(perm, num_blocks: int) -> None:
    """Raise ``ValueError`` naming the entries of ``perm`` outside ``[0, num_blocks)``."""
    bad = np.asarray(perm)
    bad = bad[(bad < 0) | (bad >= num_blocks)]
    if bad.size:
        raise ValueError(f"perm: expected block indices in [0, {num_blocks}), got {bad.tolist()}")


def gather_blocks(x: jax.Array, perm: jax.Array, *, block_m: int = 8,
                  interpret=None) -> jax.Array:
    """Row block ``i`` of the output is row block ``perm[i]`` of ``x``.

    ``x [M, N]``; ``perm [M / block_m]`` int32, a block index per output block (values in
    ``[0, M / block_m)``, repeats allowed; they are data, not shape, so they may be traced: an
    index out of range raises a ``ValueError`` naming it; a traced one fails the call when it
    runs, with the same message, through a host callback).
    ``perm`` is *scalar-prefetched*: copied to SMEM before the grid starts, and passed to every
    index map after the grid indices, so the map can read ``perm_ref[i]`` to pick the block
    the pipeline fetches. This is how a paged KV cache's block table or splash attention's
    list of visible blocks steers the DMAs.
    """
    m = x.shape[0]
    if x.ndim != 2 or m % block_m:
        raise ValueError(f"x, block_m: expected x [M, N] with M a multiple of block_m, got "
                         f"x.shape={x.shape}, block_m={block_m}")
    if jnp.shape(perm) != (m // block_m,) or not jnp.issubdtype(jnp.result_type(perm), jnp.integer):
        raise ValueError(f"perm: expected an integer array of shape ({m // block_m},) (one "
                         f"block index per output block), got {jnp.result_type(perm)}"
                         f"{jnp.shape(perm)}")
    if not isinstance(perm, jax.core.Tracer):      # concrete: check now, before any tracing
        _check_block_indices(perm, m // block_m)
    return _gather_blocks(x, jnp.asarray(perm, jnp.int32), block_m=block_m, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("block_m", "interpret"))
def _gather_blocks(x, perm, *, block_m: int, interpret):
    """The ``pallas_call`` of :func:`gather_blocks` (arguments already checked)."""
    m, n = x.shape
    jax.debug.callback(_check_block_indices, perm, m // block_m)   # traced perm: check at run
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,                                    # perm -> SMEM
        grid=(m // block_m,),
        in_specs=[pl.BlockSpec((block_m, n), lambda i, perm_ref: (perm_ref[i], 0))],
        out_specs=pl.BlockSpec((block_m, n), lambda i, perm_ref: (i, 0)))
    return pl.pallas_call(
        gather_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=device.interpret_mode(interpret))(perm, x)


# ------------------------------------------------------------ the exercise: a row softmax


def row_softmax_kernel(x_ref, o_ref):
    """Grid step ``i``: softmax over each row of the ``[block_m, N]`` block, in float32."""
    x = x_ref[...].astype(jnp.float32)
    e = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))       # subtract the row max: no overflow
    o_ref[...] = (e / jnp.sum(e, axis=-1, keepdims=True)).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("block_m", "interpret"))
def row_softmax(x: jax.Array, *, block_m: int = 8, interpret=None) -> jax.Array:
    """``jax.nn.softmax(x, axis=-1)`` for ``x [M, N]``, one ``[block_m, N]`` row block per step.

    A block spans whole rows (its last dim is the whole ``N``, which the (8, 128) rule allows),
    so each step sees every value its rows' max and sum need. Out: ``[M, N]``, x's dtype.
    """
    if x.ndim != 2:
        raise ValueError(f"x: expected a 2-d array [M, N], got shape {x.shape}")
    m, n = x.shape
    if m % block_m:
        raise ValueError(f"block_m: expected a divisor of x.shape[0]={m}, got {block_m}")
    spec = pl.BlockSpec((block_m, n), lambda i: (i, 0))
    return pl.pallas_call(
        row_softmax_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(m // block_m,), in_specs=[spec], out_specs=spec,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=device.interpret_mode(interpret))(x)
