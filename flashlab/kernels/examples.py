"""First Pallas kernels of chapter 04: a tiled add and a tiled matmul.

They are small on purpose: a grid, BlockSpecs with index maps, a VMEM accumulator and the
"parallel"/"arbitrary" dimension semantics, with nothing else in the way. The FlashAttention
forward (:mod:`flashlab.kernels.forward`) is the matmul kernel plus the online softmax.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from flashlab.contract import device
from flashlab.compat import pallas as compat
from flashlab.compat.pallas import pl

__all__ = ["add_kernel", "tiled_add", "add_grid_spec", "matmul_kernel", "tiled_matmul",
           "matmul_grid_spec"]


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
        compiler_params=compat.CompilerParams(dimension_semantics=("parallel", "parallel")),
        cost_estimate=compat.CostEstimate(flops=m * n, transcendentals=0,
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
        scratch_shapes=[compat.VMEM((bm, bn), jnp.float32)])


@functools.partial(jax.jit, static_argnames=("bm", "bn", "bk", "interpret"))
def tiled_matmul(x, y, *, bm: int = 128, bn: int = 128, bk: int = 128, interpret=None):
    """``x @ y`` (``[M, K] @ [K, N]``) with fp32 accumulation in a VMEM scratch."""
    m, kdim = x.shape
    n = y.shape[1]
    if m % bm or n % bn or kdim % bk:
        raise ValueError(f"bm, bn, bk: expected divisors of M, N, K = {m}, {n}, {kdim}, "
                         f"got ({bm}, {bn}, {bk})")
    gs = matmul_grid_spec(m, n, kdim, bm, bn, bk)
    e = x.dtype.itemsize
    return pl.pallas_call(
        matmul_kernel, out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        grid_spec=compat.PrefetchScalarGridSpec(num_scalar_prefetch=0, **gs),
        compiler_params=compat.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
        cost_estimate=compat.CostEstimate(
            flops=2 * m * n * kdim, transcendentals=0,
            bytes_accessed=(m * kdim * (n // bn) + kdim * n * (m // bm) + m * n) * e),
        interpret=device.interpret_mode(interpret))(x, y)
