"""HBM traffic: the paper's IO model, and a replay of a Pallas kernel's own grid + BlockSpecs.

Two ways to count the bytes that move between HBM and on-chip memory:

* **Formula** (:func:`analytic_hbm_bytes`): the FlashAttention paper's IO analysis
  (Dao et al. 2022, arXiv 2205.14135, Theorem 2 and Algorithms 0, 1, 3, 4). Standard
  attention writes and reads the N×N matrices S and P; FlashAttention reads K and V once
  and Q, O once per outer step: Θ(N² d² / M) with M the SRAM size in elements.
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

from .reference import naive_hbm_bytes

__all__ = [
    "flash_block_sizes", "analytic_hbm_bytes", "attention_flops", "paper_gpt2_table",
    "PAPER_GPT2_MEDIUM", "Operand", "KernelGrid", "from_block_specs", "replay",
    "tile_schedule", "kernel_grid", "kernel_hbm_bytes", "pipeline_vmem_bytes",
    "forward_closed_form_bytes",
]


# --------------------------------------------------------------------------------------
# 1. The paper's model
# --------------------------------------------------------------------------------------

def flash_block_sizes(sram_bytes: int, head_dim: int, bytes_per_element: int) -> tuple[int, int]:
    """Algorithm 1's block sizes ``(B_r, B_c)`` for an SRAM of ``sram_bytes``.

    The paper states SRAM size M in *elements*: ``M = sram_bytes // bytes_per_element``.
    ``B_c = ceil(M / 4d)`` so that K_j, V_j (B_c×d each) and Q_i, O_i (B_r×d each, B_r ≤ B_c)
    fit together; ``B_r = min(B_c, d)``.
    """
    for name, v in (("sram_bytes", sram_bytes), ("head_dim", head_dim),
                    ("bytes_per_element", bytes_per_element)):
        if not isinstance(v, (int, np.integer)) or v <= 0:
            raise ValueError(f"{name}: expected a positive int, got {v!r}")
    M = sram_bytes // bytes_per_element
    B_c = -(-M // (4 * head_dim))
    B_r = min(B_c, head_dim)
    return B_r, B_c


def analytic_hbm_bytes(algorithm: str, *, batch: int, heads: int, seq_len: int, head_dim: int,
                       bytes_per_element: int, sram_bytes: int | None = None,
                       backward: bool = False, masked: bool = False, dropout: bool = False,
                       stat_bytes: int = 4) -> dict[str, int]:
    """HBM bytes read + written by attention, as the FlashAttention paper counts them.

    Per (batch, head), with ``N = seq_len``, ``d = head_dim``, ``e = bytes_per_element``
    (Q, K, V, O, dO, dQ, dK, dV and, for standard attention, S and P are stored in the input
    dtype, as in the paper's fp16 experiments):

    ``algorithm="standard"`` (Algorithm 0 forward, Algorithm 3 backward). Every step is its
    own kernel that reads its inputs from HBM and writes its output back:

    * forward: ``S = QKᵀ`` (read Q, K; write S), ``P = softmax(S)`` (read S, write P),
      ``O = PV`` (read P, V; write O) — :func:`flashlab.reference.naive_hbm_bytes`.
      ``masked=True`` adds a separate masking pass (read S, write S: 2·N²) before the softmax,
      ``dropout=True`` a dropout pass on P (read P, write P: 2·N²). With both off, scaling and
      masking are assumed fused into the softmax pass.
    * backward: ``dV = Pᵀ dO`` (read P, dO; write dV), ``dP = dO Vᵀ`` (read dO, V; write dP),
      ``dS = P ∘ (dP − D)`` (read P, dP; write dS), ``dQ = dS K`` (read dS, K; write dQ),
      ``dK = dSᵀ Q`` (read dS, Q; write dK): 7·N² + 8·N·d elements (Algorithm 3 forms
      ``D_i = Σ_l P_il dP_il`` inside the dS pass). ``dropout`` adds its backward pass on dP (2·N²),
      ``masked`` one on dS (2·N²). The stored P is read back; nothing is recomputed.

    ``algorithm="flash"`` (Algorithm 1 forward, Algorithm 4 backward), with SRAM
    ``sram_bytes`` giving ``M = sram_bytes // e`` elements and block sizes
    ``B_c = ceil(M / 4d)``, ``B_r = min(B_c, d)`` (:func:`flash_block_sizes`),
    ``T_c = ceil(N / B_c)`` outer steps:

    * forward: initialise O, ℓ, m in HBM (write N·d + 2·N); read every K_j, V_j once (2·N·d);
      per outer step read all Q_i, O_i, ℓ_i, m_i and write O_i, ℓ_i, m_i back
      (3·N·d + 4·N per outer step).
    * backward: initialise dQ (write N·d); read K_j, V_j and write dK_j, dV_j once (4·N·d);
      per outer step read Q_i, O_i, dO_i, dQ_i, ℓ_i, m_i and write dQ_i (5·N·d + 2·N).
    * ℓ and m are ``stat_bytes`` (fp32) each; the dropout mask is regenerated from the RNG
      state and never stored; masking happens in SRAM. ``masked``/``dropout`` cost no bytes.

    Returns bytes per term plus ``"forward"``, ``"backward"`` (0 unless ``backward``) and
    ``"total"``.
    """
    for name, v in (("batch", batch), ("heads", heads), ("seq_len", seq_len),
                    ("head_dim", head_dim), ("bytes_per_element", bytes_per_element),
                    ("stat_bytes", stat_bytes)):
        if not isinstance(v, (int, np.integer)) or v <= 0:
            raise ValueError(f"{name}: expected a positive int, got {v!r}")
    bh, N, d, e = batch * heads, seq_len, head_dim, bytes_per_element
    out: dict[str, int] = {}
    if algorithm == "standard":
        nv = naive_hbm_bytes(batch=batch, heads=heads, q_len=N, kv_len=N, head_dim=d,
                             bytes_per_element=e, score_bytes=e)
        out["fwd_q_k_v_o"] = nv["q_k_v_o"]
        out["fwd_scores"] = nv["scores"]                       # S write/read, P write/read
        out["fwd_mask_pass"] = bh * 2 * N * N * e if masked else 0
        out["fwd_dropout_pass"] = bh * 2 * N * N * e if dropout else 0
        fwd = sum(out.values())
        bwd = 0
        if backward:
            out["bwd_matrices"] = bh * 7 * N * N * e               # P, dP, dS traffic
            out["bwd_vectors"] = bh * 8 * N * d * e                # dO×2 V K Q reads, dV dQ dK writes
            out["bwd_mask_pass"] = bh * 2 * N * N * e if masked else 0
            out["bwd_dropout_pass"] = bh * 2 * N * N * e if dropout else 0
            bwd = sum(out.values()) - fwd
    elif algorithm == "flash":
        if sram_bytes is None:
            raise ValueError("sram_bytes: flash attention's traffic depends on the SRAM size; "
                             "got None, expected bytes (e.g. 192 * 1024 for an A100 SM)")
        B_r, B_c = flash_block_sizes(sram_bytes, d, e)
        T_c = -(-N // B_c)
        s = stat_bytes
        out["fwd_init"] = bh * (N * d * e + 2 * N * s)
        out["fwd_k_v"] = bh * 2 * N * d * e
        out["fwd_q_o_per_outer_step"] = bh * T_c * (3 * N * d * e + 4 * N * s)
        fwd = sum(out.values())
        bwd = 0
        if backward:
            out["bwd_init"] = bh * N * d * e
            out["bwd_k_v_dk_dv"] = bh * 4 * N * d * e
            out["bwd_per_outer_step"] = bh * T_c * (5 * N * d * e + 2 * N * s)
            bwd = sum(out.values()) - fwd
        out["block_q"], out["block_k"] = B_r, B_c      # the B_r, B_c the model used
    else:
        raise ValueError(f"algorithm: expected 'standard' or 'flash', got {algorithm!r}")
    out["forward"], out["backward"], out["total"] = fwd, bwd, fwd + bwd
    return out


def attention_flops(algorithm: str, *, batch: int, heads: int, seq_len: int, head_dim: int,
                    backward: bool = False, kv_seq_len: int | None = None,
                    causal_fraction: float = 1.0) -> int:
    """Matmul FLOPs (2 per multiply-add) of attention.

    Forward: ``QKᵀ`` and ``PV``, ``4·N·N_k·d``. Backward: standard attention does 4 matmuls
    (dV, dP, dQ, dK: ``8·N·N_k·d``); flash attention recomputes S first (``10·N·N_k·d``).
    ``causal_fraction`` scales the work for kernels that skip masked blocks (≈ 0.5 causal).
    """
    if algorithm not in ("standard", "flash"):
        raise ValueError(f"algorithm: expected 'standard' or 'flash', got {algorithm!r}")
    nk = seq_len if kv_seq_len is None else kv_seq_len
    unit = batch * heads * seq_len * nk * head_dim * causal_fraction
    f = 4 * unit
    if backward:
        f += (8 if algorithm == "standard" else 10) * unit
    return int(f)


# Fig. 2 (left) of arXiv 2205.14135: GPT-2 medium attention, forward + backward, A100.
PAPER_GPT2_MEDIUM = {
    "batch": 64, "heads": 16, "seq_len": 1024, "head_dim": 64, "bytes_per_element": 2,
    "sram_bytes": 192 * 1024,       # A100: 192 KB of SRAM per SM (paper, Section 2.1)
    "chip": "A100",
    "paper": {"standard": {"hbm_gb": 40.3, "gflops": 66.6, "runtime_ms": 41.7},
              "flash": {"hbm_gb": 4.4, "gflops": 75.2, "runtime_ms": 7.3}},
}


def paper_gpt2_table(*, masked: bool = True, dropout: bool = True,
                     hbm_bytes_per_s: float | None = None) -> list[dict[str, Any]]:
    """The paper's GPT-2 medium numbers beside this model's, one row per algorithm.

    GPT-2 training applies a causal mask and dropout, so by default the standard-attention
    model counts a masking and a dropout pass (forward and backward). Each row has
    ``algorithm``, ``paper_hbm_gb``, ``model_hbm_gb``, ``model_over_paper``,
    ``paper_runtime_ms``, ``model_hbm_time_ms`` (model bytes / A100 HBM bandwidth: the
    memory-bound time; the paper's measured runtime is larger because kernels also launch,
    compute and do not reach peak bandwidth) and ``model_gflops`` (matmul FLOPs,
    :func:`attention_flops`).
    """
    p = PAPER_GPT2_MEDIUM
    if hbm_bytes_per_s is None:
        from .roofline import chip
        hbm_bytes_per_s = chip(p["chip"]).hbm_bytes_per_s
    size = {k: p[k] for k in ("batch", "heads", "seq_len", "head_dim")}
    rows = []
    for alg in ("standard", "flash"):
        m = analytic_hbm_bytes(alg, **size, bytes_per_element=p["bytes_per_element"],
                               sram_bytes=p["sram_bytes"], backward=True, masked=masked,
                               dropout=dropout)
        gb = m["total"] / 1e9
        rows.append({
            "algorithm": alg,
            "paper_hbm_gb": p["paper"][alg]["hbm_gb"],
            "model_hbm_gb": round(gb, 2),
            "model_over_paper": round(gb / p["paper"][alg]["hbm_gb"], 2),
            "paper_runtime_ms": p["paper"][alg]["runtime_ms"],
            "model_hbm_time_ms": round(m["total"] / hbm_bytes_per_s * 1e3, 1),
            "model_gflops": round(attention_flops(alg, **size, backward=True) / 1e9, 1),
        })
    return rows


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

def forward_closed_form_bytes(*, batch: int, heads: int, seq_len: int, head_dim: int,
                              dtype, block_q: int, kv_seq_len: int | None = None) -> int:
    """Q, K, V, O bytes of a non-causal forward with grid ``(b, h, i, j)``.

    Per (batch, head): Q read once (N·d), O written once (N·d), K and V each read once per
    query block (``N/block_q`` times): ``(2 + 2·N/block_q)·N·d·bytes`` for ``N_k = N``.
    """
    e = np.dtype(_np_dtype(dtype)).itemsize
    nk = seq_len if kv_seq_len is None else kv_seq_len
    nq_blocks = -(-seq_len // block_q)
    return batch * heads * (2 * seq_len * head_dim + 2 * nq_blocks * nk * head_dim) * e


def kernel_grid(kernel: str, *, batch: int, heads: int, seq_len: int, head_dim: int, dtype,
                block_q: int, block_k: int, is_causal: bool = False,
                kv_seq_len: int | None = None, kv_heads: int | None = None,
                local_window_size=None, return_lse: bool = False,
                head_dim_v: int | None = None) -> KernelGrid:
    """The :class:`KernelGrid` of one of flashlab's Pallas kernels, from the kernel itself.

    ``kernel="forward"``: the grid, BlockSpecs, operand shapes (padded to whole blocks and
    to 128 lanes, as the kernel pads them), scratch and scalar-prefetch lengths that
    :func:`flashlab.kernels.forward.forward_grid_spec` builds for ``pallas_call`` — the same
    objects, with the kernel's own block-size checks (``make_config``).
    ``kernel="backward_dkdv"`` / ``"backward_dq"``: the two backward kernels'
    (:func:`flashlab.kernels.backward.dkdv_grid_spec`,
    :func:`~flashlab.kernels.backward.dq_grid_spec`).
    ``kernel="backward"`` names two kernels: use :func:`kernel_hbm_bytes`, which sums them.
    """
    names = ("forward", "backward_dkdv", "backward_dq")
    if kernel == "backward":
        raise ValueError("kernel='backward' is two pallas_calls: ask kernel_grid for "
                         "'backward_dkdv' or 'backward_dq' (kernel_hbm_bytes('backward') "
                         "sums both)")
    if kernel not in names:
        raise ValueError(f"kernel: expected 'forward' or 'backward' (or one of {names[1:]}), "
                         f"got {kernel!r}")
    try:
        from .kernels import forward as kfwd
    except ImportError as err:       # a checkout without the kernel rung
        raise NotImplementedError(f"kernel={kernel!r}: flashlab.kernels is not available ({err})"
                                  ) from err
    from .masks import AttentionSpec
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
    cfg = kfwd.make_config(spec, block_q=block_q, block_k=block_k, return_lse=return_lse)
    if kernel == "forward":
        gs, name = kfwd.forward_grid_spec(cfg), "flashlab_flash_forward"
    else:
        from .kernels import backward as kbwd
        gs = (kbwd.dkdv_grid_spec if kernel == "backward_dkdv" else kbwd.dq_grid_spec)(cfg)
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
    The bytes are those of the kernel's padded operands: a head_dim below 128 is padded to
    128 lanes and moves as 128. See :func:`replay` for the pipeline rule.
    """
    kw = dict(batch=batch, heads=heads, seq_len=seq_len, head_dim=head_dim, dtype=dtype,
              block_q=block_q, block_k=block_k, is_causal=is_causal, kv_seq_len=kv_seq_len,
              kv_heads=kv_heads, local_window_size=local_window_size)
    if kernel != "backward":
        kg = kernel_grid(kernel, **kw, return_lse=return_lse)
        return {k: v["bytes"] for k, v in replay(kg).items()}
    out: dict[str, int] = {}
    read = written = 0
    for part in ("dkdv", "dq"):
        kg = kernel_grid(f"backward_{part}", **kw)
        r = replay(kg)
        for name, v in r.items():
            if name not in ("read", "written", "total"):
                out[f"{part}/{name}"] = v["bytes"]
        out[f"{part}/total"] = r["total"]["bytes"]
        read += r["read"]["bytes"]
        written += r["written"]["bytes"]
    do = kg.operand("do")                     # D_i = rowsum(dO ∘ O): read O and dO, write D
    st = kg.operand("stats")                  # (lse and D written together, float32)
    out["rowsum_D"] = 2 * math.prod(do.shape) * do.itemsize + math.prod(st.shape) * 4
    read += 2 * math.prod(do.shape) * do.itemsize
    written += math.prod(st.shape) * 4
    out["read"], out["written"], out["total"] = read, written, read + written
    return out
