"""HBM traffic of a Pallas kernel, replayed from its own grid and BlockSpecs.

(The formula side, the FlashAttention paper's IO analysis, is
:mod:`flashlab.instruments.io_model`.)

* **Replay** (:func:`replay`, :func:`kernel_hbm_bytes`): walk the kernel's real grid in
  row-major order (the order Pallas TPU runs it), evaluate each operand's real BlockSpec
  index map at every step, and apply the TPU pipeline's rule — an input block is copied
  HBM→VMEM only when its block index differs from the previous grid step's, an output
  block is copied VMEM→HBM when its block index is about to change or the grid ends.
  Nothing about the kernel is restated here: the grid and the BlockSpec objects come from
  the kernel module, the same objects its ``pallas_call`` uses.

The replay is vectorised: each index map is ``jax.vmap``-ed over a chunk of grid points and
evaluated once, so a 16k-step grid replays in milliseconds. :func:`replay` with
``method="loop"`` is the readable version (one Python step per grid point) the tests
compare it against.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

import numpy as np


__all__ = ["Operand", "KernelGrid", "from_block_specs", "replay", "tile_schedule", "kernel_grid",
           "kernel_hbm_bytes", "pipeline_vmem_bytes"]


# --------------------------------------------------------------------------------------
# 2. Replay of a kernel's grid + BlockSpecs
# --------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Operand:
    """One pallas_call operand as the pipeline sees it.

    ``shape``/``dtype``: the HBM array. ``block_shape``: the BlockSpec's ``block_shape``
    (ints, ``None``/``pl.Squeezed()`` for squeezed size-1 dims, ``pl.Blocked(n)``,
    ``pl.Element(n)``). ``index_map``: the BlockSpec's own index map,
    ``index_map(*grid_indices, *scalar_prefetch) -> block indices`` (element offsets for
    ``pl.Element`` dims). ``role``: ``"in"`` or ``"out"``.
    """

    name: str
    shape: tuple[int, ...]
    dtype: Any
    block_shape: tuple
    index_map: Callable
    role: str = "in"

    def __post_init__(self):
        if self.role not in ("in", "out"):
            raise ValueError(f"role: expected 'in' or 'out', got {self.role!r}")
        if len(self.block_shape) != len(self.shape):
            raise ValueError(f"block_shape of {self.name!r}: {tuple(self.block_shape)} has "
                             f"{len(self.block_shape)} dims, array shape {self.shape} has "
                             f"{len(self.shape)}")

    @property
    def itemsize(self) -> int:
        return np.dtype(_np_dtype(self.dtype)).itemsize

    def dims(self) -> list[tuple[str, int]]:
        """Per dim ``(kind, size)`` with kind ``"blocked"``, ``"element"`` or ``"squeezed"``."""
        out = []
        for b in self.block_shape:
            kind, size = _block_dim(b)
            out.append((kind, size))
        return out

    def block_bytes(self) -> int:
        """Bytes of one full block (what one VMEM buffer of this operand holds)."""
        return math.prod(s for _, s in self.dims()) * self.itemsize


@dataclasses.dataclass(frozen=True)
class KernelGrid:
    """A pallas_call's schedule as data: the grid, its operands, scalar-prefetch values.

    ``scratch_bytes``: VMEM scratch the kernel allocates besides its pipeline buffers.
    """

    grid: tuple[int, ...]
    operands: tuple[Operand, ...]
    scalar_prefetch: tuple = ()
    scratch_bytes: int = 0
    name: str = ""

    @property
    def num_steps(self) -> int:
        return math.prod(self.grid)

    def operand(self, name: str) -> Operand:
        for op in self.operands:
            if op.name == name:
                return op
        raise KeyError(f"no operand named {name!r}; have {[o.name for o in self.operands]}")


def _np_dtype(dtype):
    import jax.numpy as jnp
    return jnp.dtype(dtype)


def _block_dim(b) -> tuple[str, int]:
    from jax.experimental import pallas as pl
    if b is None or isinstance(b, pl.Squeezed):
        return "squeezed", 1
    if isinstance(b, (int, np.integer)):
        return "blocked", int(b)
    if isinstance(b, pl.Blocked):
        return "blocked", int(b.block_size)
    if isinstance(b, pl.Element):
        if tuple(b.padding) != (0, 0):
            raise NotImplementedError(f"pl.Element with padding {b.padding} is not replayed")
        return "element", int(b.block_size)
    raise NotImplementedError(f"block dim {b!r} ({type(b).__name__}) is not replayed "
                              "(BoundedSlice/Indirect dims move a data-dependent amount)")


def from_block_specs(grid: Sequence[int], in_specs: Sequence, out_specs: Sequence,
                     in_shapes: Sequence, out_shapes: Sequence, *,
                     in_names: Sequence[str] | None = None,
                     out_names: Sequence[str] | None = None, scalar_prefetch: Sequence = (),
                     scratch_bytes: int = 0, name: str = "") -> KernelGrid:
    """Build a :class:`KernelGrid` from ``pl.BlockSpec`` objects and array shapes.

    ``in_shapes``/``out_shapes``: anything with ``.shape`` and ``.dtype`` (arrays,
    ``jax.ShapeDtypeStruct``). A BlockSpec whose ``memory_space`` is HBM/ANY is a raw HBM ref
    the kernel copies by hand: the pipeline moves nothing for it, so it is left out (its
    DMAs are not visible to the replay).
    """
    grid = tuple(int(g) for g in ((grid,) if isinstance(grid, int) else grid))
    in_names = list(in_names) if in_names is not None else [f"in{i}" for i in range(len(in_specs))]
    out_names = (list(out_names) if out_names is not None
                 else [f"out{i}" for i in range(len(out_specs))])
    if len(in_names) != len(in_specs) or len(in_shapes) != len(in_specs):
        raise ValueError(f"in_specs ({len(in_specs)}), in_shapes ({len(in_shapes)}) and "
                         f"in_names ({len(in_names)}) must have the same length")
    if len(out_names) != len(out_specs) or len(out_shapes) != len(out_specs):
        raise ValueError(f"out_specs ({len(out_specs)}), out_shapes ({len(out_shapes)}) and "
                         f"out_names ({len(out_names)}) must have the same length")
    ops = []
    for role, specs, shapes, names in (("in", in_specs, in_shapes, in_names),
                                       ("out", out_specs, out_shapes, out_names)):
        for spec, shp, nm in zip(specs, shapes, names):
            if _is_hbm_space(getattr(spec, "memory_space", None)):
                continue
            shape = tuple(int(s) for s in shp.shape)
            block = tuple(spec.block_shape) if spec.block_shape is not None else shape
            imap = spec.index_map if spec.index_map is not None else (
                lambda *a, _n=len(shape): (0,) * _n)
            ops.append(Operand(nm, shape, shp.dtype, block, imap, role))
    return KernelGrid(grid, tuple(ops), tuple(scalar_prefetch), int(scratch_bytes), name)


def _is_hbm_space(ms) -> bool:
    if ms is None:
        return False
    s = str(ms).lower()
    return "any" in s or "hbm" in s


def _index_fn(op: Operand, num_grid: int, scalar_prefetch: tuple):
    """jit(vmap(index_map)) over grid points: int32 ``[P]`` arrays -> ``[P, ndim]``."""
    import jax
    import jax.numpy as jnp
    refs = tuple(jnp.asarray(s) for s in scalar_prefetch)
    ndim = len(op.shape)

    def one(*g):
        idx = op.index_map(*g, *refs)
        if not isinstance(idx, (tuple, list)):
            idx = (idx,)
        if len(idx) != ndim:
            raise ValueError(f"index_map of {op.name!r} returned {len(idx)} indices for a "
                             f"{ndim}-dim array")
        return jnp.stack([jnp.asarray(i, jnp.int32) for i in idx])

    return jax.jit(jax.vmap(one, in_axes=(0,) * num_grid))


def _transfer_bytes(op: Operand, idx: np.ndarray) -> np.ndarray:
    """Bytes moved for blocks at indices ``idx [P, ndim]`` (edge blocks clipped to the array)."""
    ext = np.ones(idx.shape[0], np.int64)
    for a, ((kind, size), dim) in enumerate(zip(op.dims(), op.shape)):
        start = idx[:, a].astype(np.int64) * (size if kind == "blocked" else 1)
        ext *= np.clip(np.minimum(start + size, dim) - np.maximum(start, 0), 0, None)
    return ext * op.itemsize


def replay(kg: KernelGrid, *, method: str = "vectorized", chunk: int = 1 << 18
           ) -> dict[str, dict[str, Any]]:
    """Count the pipeline's HBM↔VMEM copies for every operand of ``kg``.

    The grid runs in row-major order (last grid dim fastest), as on a single TensorCore.
    Input block copied in when step ``t == 0`` or its block index differs from step
    ``t − 1``'s; output block copied out when ``t`` is the last step or its block index
    differs from step ``t + 1``'s. Both equal the number of *runs* of equal consecutive block
    indices, so one count serves both.

    ``method="vectorized"`` evaluates ``jax.vmap(index_map)`` over chunks of grid points;
    ``method="loop"`` is the readable reference (a Python loop over every grid point).

    Returns ``{name: {"role", "copies", "bytes", "block_bytes"}}`` plus ``"total"``
    (``{"bytes": ...}``), ``"read"`` and ``"written"`` (bytes).
    """
    if method not in ("vectorized", "loop"):
        raise ValueError(f"method: expected 'vectorized' or 'loop', got {method!r}")
    res: dict[str, dict[str, Any]] = {}
    for op in kg.operands:
        if method == "loop":
            copies, nbytes = _replay_loop(kg, op)
        else:
            copies, nbytes = _replay_vectorized(kg, op, chunk)
        res[op.name] = {"role": op.role, "copies": int(copies), "bytes": int(nbytes),
                        "block_bytes": op.block_bytes()}
    read = sum(v["bytes"] for v in res.values() if v["role"] == "in")
    written = sum(v["bytes"] for v in res.values() if v["role"] == "out")
    res["read"] = {"bytes": read}
    res["written"] = {"bytes": written}
    res["total"] = {"bytes": read + written}
    return res


def _replay_vectorized(kg: KernelGrid, op: Operand, chunk: int) -> tuple[int, int]:
    T = kg.num_steps
    if T == 0:
        return 0, 0
    fn = _index_fn(op, len(kg.grid), kg.scalar_prefetch)
    P = min(chunk, T)
    copies, nbytes, prev = 0, 0, None
    for t0 in range(0, T, P):
        t = np.arange(t0, t0 + P)
        n_valid = min(P, T - t0)
        t[n_valid:] = T - 1                                     # pad: one jit shape
        g = np.unravel_index(t, kg.grid)                        # row-major grid points
        idx = np.asarray(fn(*(x.astype(np.int32) for x in g)))[:n_valid]   # [P, ndim]
        first = np.ones(n_valid, bool)                          # starts a new run?
        first[1:] = np.any(idx[1:] != idx[:-1], axis=1)
        if prev is not None:
            first[0] = bool(np.any(idx[0] != prev))
        prev = idx[-1]
        copies += int(first.sum())
        nbytes += int(_transfer_bytes(op, idx[first]).sum())
    return copies, nbytes


def _replay_loop(kg: KernelGrid, op: Operand) -> tuple[int, int]:
    import jax.numpy as jnp
    refs = tuple(jnp.asarray(s) for s in kg.scalar_prefetch)
    copies, nbytes, prev = 0, 0, None
    for g in np.ndindex(*kg.grid):                              # row-major, like the TPU
        idx = op.index_map(*(jnp.int32(x) for x in g), *refs)
        idx = tuple(int(i) for i in (idx if isinstance(idx, (tuple, list)) else (idx,)))
        if idx != prev:                                         # new block: one copy
            copies += 1
            nbytes += int(_transfer_bytes(op, np.asarray([idx]))[0])
        prev = idx
    return copies, nbytes


def tile_schedule(kg: KernelGrid, *, max_steps: int | None = None) -> dict[str, Any]:
    """Block index of every operand at every grid step, and whether it was copied.

    Returns ``{"grid_points": [T, len(grid)], "ops": {name: {"index": [T, ndim],
    "copied": [T] bool, "role"}}}`` for the first ``max_steps`` steps (all by default).
    ``copied`` marks input fetches at the step that needs them and output write-backs at the
    step after which they happen. This is what the tile-schedule figure draws.
    """
    T = kg.num_steps if max_steps is None else min(max_steps, kg.num_steps)
    t = np.arange(T + 1 if T < kg.num_steps else T)
    g = np.unravel_index(t, kg.grid)
    out = {"grid_points": np.stack(g, axis=1)[:T], "ops": {}}
    for op in kg.operands:
        fn = _index_fn(op, len(kg.grid), kg.scalar_prefetch)
        idx = np.asarray(fn(*(x.astype(np.int32) for x in g)))
        change = np.ones(len(idx), bool)
        change[1:] = np.any(idx[1:] != idx[:-1], axis=1)
        if op.role == "in":
            copied = change[:T]
        else:                                    # written after step t if t+1 changes
            nxt = np.ones(len(idx), bool)
            nxt[:-1] = change[1:]
            if len(idx) == T and T == kg.num_steps:
                nxt[-1] = True
            copied = nxt[:T]
        out["ops"][op.name] = {"index": idx[:T], "copied": copied, "role": op.role}
    return out


def pipeline_vmem_bytes(kg: KernelGrid, *, buffers: int = 2) -> int:
    """VMEM the pipeline holds: ``buffers`` copies of every operand's block + scratch."""
    return buffers * sum(op.block_bytes() for op in kg.operands) + kg.scratch_bytes


# --------------------------------------------------------------------------------------
# 3. flashlab's own kernels
# --------------------------------------------------------------------------------------

def kernel_grid(kernel: str, *, batch: int, heads: int, seq_len: int, head_dim: int, dtype,
                block_q: int, block_k: int, is_causal: bool = False,
                kv_seq_len: int | None = None, kv_heads: int | None = None,
                local_window_size=None, return_lse: bool = False,
                head_dim_v: int | None = None) -> KernelGrid:
    """The :class:`KernelGrid` of one of flashlab's Pallas kernels, from the kernel itself.

    ``kernel="forward"``: the grid, BlockSpecs, operand shapes (padded to whole blocks and
    to 128 lanes, as the kernel pads them), scratch and scalar-prefetch lengths that
    :func:`flashlab.kernels.forward_grid.forward_grid_spec` builds for ``pallas_call`` — the same
    objects, with the kernel's own block-size checks (``make_config``).
    ``kernel="backward_dkdv"`` / ``"backward_dq"``: the two backward kernels'
    (:func:`flashlab.kernels.backward_grid.dkdv_grid_spec`,
    :func:`~flashlab.kernels.backward_grid.dq_grid_spec`).
    ``kernel="backward_fused"``: the fused backward's one kernel (``dkdv_grid_spec(...,
    fused=True)``: its dQ block ``[G, T, d]`` resident per (batch, kv head)).
    ``kernel="backward"`` names two kernels: use :func:`kernel_hbm_bytes`, which sums them.
    """
    names = ("forward", "backward_dkdv", "backward_dq", "backward_fused")
    if kernel == "backward":
        raise ValueError("kernel='backward' is two pallas_calls: ask kernel_grid for "
                         "'backward_dkdv' or 'backward_dq' (kernel_hbm_bytes('backward') "
                         "sums both)")
    if kernel not in names:
        raise ValueError(f"kernel: expected 'forward' or 'backward' (or one of {names[1:]}), "
                         f"got {kernel!r}")
    try:
        from flashlab.kernels import forward as kfwd
        from flashlab.kernels import forward_grid
        from flashlab.kernels import forward_config
    except ImportError as err:       # a checkout without the kernel rung
        raise NotImplementedError(f"kernel={kernel!r}: flashlab.kernels is not available ({err})"
                                  ) from err
    from flashlab.contract.masks import AttentionSpec
    import jax.numpy as jnp
    dt = _np_dtype(dtype)
    kv_len = seq_len if kv_seq_len is None else kv_seq_len
    window = None
    if local_window_size is not None:
        w = local_window_size
        window = (w, w) if isinstance(w, (int, np.integer)) else tuple(w)
    spec = AttentionSpec(batch=batch, q_len=seq_len, kv_len=kv_len, num_heads=heads,
                         num_kv_heads=heads if kv_heads is None else kv_heads,
                         head_dim=head_dim, head_dim_v=head_dim if head_dim_v is None else head_dim_v,
                         dtype=dt, scale=1.0 / math.sqrt(head_dim), is_causal=bool(is_causal),
                         window=window, soft_cap=None)
    # The dense grids: the visit grids (kernels/visit.py; the forward's and dQ's, and dK/dV's
    # transposed one) copy the same blocks (tests/test_kernel_visit.py), in the same order but
    # for dK/dV under GQA, which takes a (j, i) pair's G heads innermost: as many copies.
    cfg = forward_config.make_config(spec, block_q=block_q, block_k=block_k, return_lse=return_lse,
                           visit_grid=False)
    if kernel == "forward":
        gs, name = forward_grid.forward_grid_spec(cfg), "flashlab_flash_forward"
    else:
        from flashlab.kernels import backward as kbwd
        from flashlab.kernels import backward_grid
        gs = (backward_grid.dq_grid_spec(cfg) if kernel == "backward_dq" else
              backward_grid.dkdv_grid_spec(cfg, fused=kernel == "backward_fused"))
        name = gs.name
    # the scalar-prefetch operands the wrapper passes: full q and kv lengths per batch row
    lengths = (np.full((batch,), seq_len, np.int32), np.full((batch,), kv_len, np.int32))
    scratch = sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in gs.scratch_shapes)
    return from_block_specs(gs.grid, gs.in_specs, gs.out_specs, gs.in_shapes, gs.out_shapes,
                            in_names=gs.in_names, out_names=gs.out_names,
                            scalar_prefetch=lengths[:gs.num_scalar_prefetch],
                            scratch_bytes=scratch, name=name)


def kernel_hbm_bytes(kernel: str, *, batch: int, heads: int, seq_len: int, head_dim: int,
                     dtype, block_q: int, block_k: int, is_causal: bool = False,
                     kv_seq_len: int | None = None, kv_heads: int | None = None,
                     local_window_size=None, return_lse: bool = False) -> dict[str, int]:
    """HBM bytes per operand of a flashlab Pallas kernel, by replaying its grid + BlockSpecs.

    ``dtype``: a dtype or its name (``"bfloat16"``). ``kernel="forward"`` returns
    ``{operand name: bytes}`` (``q``, ``k``, ``v``, ``o`` and, with ``return_lse``, ``lse``)
    plus ``"read"``, ``"written"`` and ``"total"``. ``kernel="backward"`` replays both backward
    kernels and returns ``"dkdv/<operand>"`` and ``"dq/<operand>"`` entries (``q``, ``k``,
    ``v``, ``do``, ``stats`` = lse and D_i lane-replicated float32 ``[B_r, 256]`` (dQ) or
    ``stats_t`` = lse and D_i as sublane rows ``[8, B_r]`` (dK/dV), in; ``dk``,
    ``dv`` / ``dq`` out), each kernel's
    ``"<kernel>/total"``, plus ``"rowsum_D"`` (the XLA pass before them: read O and dO, write
    the lane-replicated float32 D) and the summed ``"read"``, ``"written"``, ``"total"``.
    ``kernel="backward_fused"``: the fused backward, ``"fused/<operand>"`` entries (its
    ``dq`` float32, written once per (batch, kv head)) and ``"rowsum_D"`` writing ``stats_t``.
    The bytes are those of the kernel's padded operands: a head_dim below 128 is padded to
    128 lanes and moves as 128. See :func:`replay` for the pipeline rule.
    """
    kw = dict(batch=batch, heads=heads, seq_len=seq_len, head_dim=head_dim, dtype=dtype,
              block_q=block_q, block_k=block_k, is_causal=is_causal, kv_seq_len=kv_seq_len,
              kv_heads=kv_heads, local_window_size=local_window_size)
    if kernel not in ("backward", "backward_fused"):
        kg = kernel_grid(kernel, **kw, return_lse=return_lse)
        return {k: v["bytes"] for k, v in replay(kg).items()}
    out: dict[str, int] = {}
    read = written = 0
    for part in (("fused",) if kernel == "backward_fused" else ("dkdv", "dq")):
        kg = kernel_grid(f"backward_{part}", **kw)
        r = replay(kg)
        for name, v in r.items():
            if name not in ("read", "written", "total"):
                out[f"{part}/{name}"] = v["bytes"]
        out[f"{part}/total"] = r["total"]["bytes"]
        read += r["read"]["bytes"]
        written += r["written"]["bytes"]
    do = kg.operand("do")                     # D_i = rowsum(dO ∘ O): read O and dO, write D
    st = kg.operand("stats_t" if kernel == "backward_fused" else "stats")  # lse and D, float32
    out["rowsum_D"] = 2 * math.prod(do.shape) * do.itemsize + math.prod(st.shape) * 4
    read += 2 * math.prod(do.shape) * do.itemsize
    written += math.prod(st.shape) * 4
    out["read"], out["written"], out["total"] = read, written, read + written
    return out
