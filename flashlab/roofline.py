"""Chips and the roofline: how long attention must take on a chip, at best.

A kernel that does ``F`` FLOPs and moves ``B`` bytes between HBM and the chip needs at least
``max(F / peak_flops, B / hbm_bandwidth)`` seconds. Its arithmetic intensity ``F / B`` decides
which term wins: below the chip's ridge point ``peak_flops / hbm_bandwidth`` it is
memory-bound, above it compute-bound.

Chip figures are per chip (all TensorCores of the chip). TPU rows are read from JAX's own
table (``pltpu.get_tpu_info_for_chip``, per TensorCore, multiplied by the cores of a chip)
where this JAX has one; what that table lacks (fp32 peak, ICI) and the GPU rows come from
the public figures cited per row in ``source``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping

__all__ = ["Chip", "chips", "chip", "CHIP_NAMES", "arithmetic_intensity", "time_bound",
           "algorithm_points", "measured_points"]

SCALING_BOOK = "https://jax-ml.github.io/scaling-book/tpus/"


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator chip. Bandwidths in bytes/s, peaks in FLOP/s, capacities in bytes.

    ``vmem_bytes``: on-chip memory a kernel tiles into (TPU VMEM per TensorCore; GPU: shared
    memory/SRAM of one SM, the paper's M). ``ici_bytes_per_s``: chip-to-chip bandwidth
    (TPU ICI, GPU NVLink), bidirectional, all links. ``fp32_flops``: matmul peak for fp32
    operands. ``source``: where each number comes from.
    """

    name: str
    hbm_bytes_per_s: float
    bf16_flops: float
    fp32_flops: float
    vmem_bytes: int
    hbm_bytes: int
    ici_bytes_per_s: float
    kind: str = "tpu"
    source: str = ""

    @property
    def ridge_point(self) -> float:
        """FLOPs per byte above which bf16 work is compute-bound on this chip."""
        return self.bf16_flops / self.hbm_bytes_per_s

    def peak_flops(self, dtype="bfloat16") -> float:
        import jax.numpy as jnp
        return self.fp32_flops if jnp.dtype(dtype).itemsize >= 4 else self.bf16_flops


# Public figures the JAX table does not have, and fallbacks if it is missing.
# fp32 on TPU: the MXU multiplies bf16; an fp32 matmul at Precision.HIGHEST runs as 6 bf16
# passes (bf16_6x), so we take bf16/6 — an estimate, not a published figure.
_PUBLIC: dict[str, dict[str, Any]] = {
    # https://cloud.google.com/tpu/docs/v4 ; scaling book table (v4p)
    "v4": dict(hbm_bytes_per_s=1.2e12, bf16_flops=2.75e14, vmem_bytes=32 * 2**20,
               hbm_bytes=32 * 10**9, ici_bytes_per_s=6 * 9e10, cores=2,
               source="cloud.google.com/tpu/docs/v4; " + SCALING_BOOK),
    # https://cloud.google.com/tpu/docs/v5e
    "v5e": dict(hbm_bytes_per_s=8.1e11, bf16_flops=1.97e14, vmem_bytes=128 * 2**20,
                hbm_bytes=16 * 10**9, ici_bytes_per_s=4 * 9e10, cores=1,
                source="cloud.google.com/tpu/docs/v5e; " + SCALING_BOOK),
    # https://cloud.google.com/tpu/docs/v5p
    "v5p": dict(hbm_bytes_per_s=2.76e12, bf16_flops=4.59e14, vmem_bytes=2 * 64 * 2**20,
                hbm_bytes=95 * 10**9, ici_bytes_per_s=6 * 1.8e11, cores=2,
                source="cloud.google.com/tpu/docs/v5p; " + SCALING_BOOK),
    # https://cloud.google.com/tpu/docs/v6e
    "v6e": dict(hbm_bytes_per_s=1.64e12, bf16_flops=9.18e14, vmem_bytes=128 * 2**20,
                hbm_bytes=32 * 10**9, ici_bytes_per_s=4 * 1.8e11, cores=1,
                source="cloud.google.com/tpu/docs/v6e; " + SCALING_BOOK),
    # https://cloud.google.com/tpu/docs/tpu7x (Ironwood): 192 GB HBM, 7.37 TB/s, 1.2 TB/s ICI
    "7x": dict(hbm_bytes_per_s=7.37e12, bf16_flops=2.307e15, vmem_bytes=2 * 64 * 2**20,
               hbm_bytes=192 * 10**9, ici_bytes_per_s=1.2e12, cores=2,
               source="cloud.google.com/tpu/docs/tpu7x"),
}

_GPUS = (
    # NVIDIA A100 datasheet (SXM 40 GB): 1555 GB/s, 312 TFLOP/s bf16 dense, 19.5 fp32 (non
    # tensor core); 192 KB SRAM per SM (paper Sec. 2.1); NVLink 600 GB/s.
    Chip("A100", 1.555e12, 3.12e14, 1.95e13, 192 * 1024, 40 * 10**9, 6.0e11, "gpu",
         "NVIDIA A100 datasheet (SXM4 40GB); arXiv 2205.14135 Sec. 2.1"),
    # NVIDIA H100 SXM datasheet: 3.35 TB/s, 989 TFLOP/s bf16 dense, 67 fp32; 228 KB SRAM
    # per SM; NVLink 900 GB/s.
    Chip("H100", 3.35e12, 9.89e14, 6.7e13, 228 * 1024, 80 * 10**9, 9.0e11, "gpu",
         "NVIDIA H100 datasheet (SXM5 80GB)"),
)

CHIP_NAMES = ("v4", "v5e", "v5p", "v6e", "7x", "A100", "H100")


def _from_jax(name: str) -> dict[str, Any] | None:
    """Per-chip figures from ``pltpu.get_tpu_info_for_chip`` (None if this JAX lacks them)."""
    from .kernels import _pallas_compat as compat     # every Pallas API through one module
    try:
        info = compat.get_tpu_info_for_chip(compat.ChipVersion(name), 1)
    except Exception:  # older JAX: no table (None is not callable), or no such chip
        return None
    cores = _PUBLIC[name]["cores"]          # the table is per TensorCore
    return dict(hbm_bytes_per_s=float(info.mem_bw_bytes_per_second) * cores,
                bf16_flops=float(info.bf16_ops_per_second) * cores,
                vmem_bytes=int(info.vmem_capacity_bytes),
                hbm_bytes=int(info.hbm_capacity_bytes) * cores)


def chips(*, use_jax: bool = True) -> dict[str, Chip]:
    """Every chip of the book, by name: v4, v5e, v5p, v6e, 7x (TPUs), A100, H100 (GPUs)."""
    out: dict[str, Chip] = {}
    for name, pub in _PUBLIC.items():
        got = _from_jax(name) if use_jax else None
        vals = {k: pub[k] for k in ("hbm_bytes_per_s", "bf16_flops", "vmem_bytes", "hbm_bytes")}
        src = pub["source"]
        if got is not None:
            vals.update(got)
            src = "jax pltpu.get_tpu_info_for_chip (HBM, bf16, VMEM per core); ICI: " + src
        out[name] = Chip(name, vals["hbm_bytes_per_s"], vals["bf16_flops"],
                         vals["bf16_flops"] / 6, vals["vmem_bytes"], vals["hbm_bytes"],
                         pub["ici_bytes_per_s"], "tpu", src)
    for g in _GPUS:
        out[g.name] = g
    return out


def chip(name: str) -> Chip:
    """One chip of :func:`chips` by name (``"v5e"``, ``"A100"``, ...)."""
    table = chips()
    if name not in table:
        raise ValueError(f"chip: expected one of {list(table)}, got {name!r}")
    return table[name]


def arithmetic_intensity(flops: float, hbm_bytes: float) -> float:
    """FLOPs per HBM byte."""
    if hbm_bytes <= 0:
        raise ValueError(f"hbm_bytes: expected > 0, got {hbm_bytes!r}")
    return flops / hbm_bytes


def time_bound(flops: float, hbm_bytes: float, chip_: Chip | str, *, dtype="bfloat16"
               ) -> dict[str, float]:
    """Roofline lower bound on one chip: ``max(flops / peak, bytes / bandwidth)`` seconds.

    Returns ``{"seconds", "compute_s", "memory_s", "intensity", "bound"}`` with ``bound``
    ``"compute"`` or ``"memory"``.
    """
    c = chip(chip_) if isinstance(chip_, str) else chip_
    compute = flops / c.peak_flops(dtype)
    memory = hbm_bytes / c.hbm_bytes_per_s
    return {"seconds": max(compute, memory), "compute_s": compute, "memory_s": memory,
            "intensity": arithmetic_intensity(flops, hbm_bytes),
            "bound": "compute" if compute >= memory else "memory"}


def algorithm_points(chip_: Chip | str, *, batch: int, heads: int, seq_len: int,
                     head_dim: int, dtype="bfloat16", backward: bool = False,
                     block_q: int | None = None, is_causal: bool = False
                     ) -> dict[str, dict[str, float]]:
    """Standard and flash attention placed on ``chip_``'s roofline.

    Standard attention: the paper's model (:func:`flashlab.traffic.analytic_hbm_bytes`).
    Flash attention on a TPU: the forward kernel's schedule ``(2 + 2N/block_q)·N·d`` bytes
    (``block_q`` default: 512 capped at N), or on a GPU the paper's model with the chip's
    SRAM. Causal halves the FLOPs (and the flash K/V traffic). Returns per algorithm
    ``{"flops", "bytes", "intensity", "seconds", "bound", "flops_per_s"}`` where
    ``flops_per_s`` is the attainable rate ``flops / seconds``.
    """
    import jax.numpy as jnp
    from . import traffic
    c = chip(chip_) if isinstance(chip_, str) else chip_
    e = jnp.dtype(dtype).itemsize
    size = dict(batch=batch, heads=heads, seq_len=seq_len, head_dim=head_dim)
    frac = 0.5 if is_causal else 1.0
    out = {}
    std = traffic.analytic_hbm_bytes("standard", **size, bytes_per_element=e,
                                     backward=backward, masked=is_causal)["total"]
    if c.kind == "tpu" and not backward:
        bq = min(block_q or 512, seq_len)
        nqb = -(-seq_len // bq)
        fl = batch * heads * (2 * seq_len * head_dim + 2 * nqb * seq_len * head_dim * frac) * e
    else:
        fl = traffic.analytic_hbm_bytes("flash", **size, bytes_per_element=e,
                                        sram_bytes=min(c.vmem_bytes, 16 * 2**20),
                                        backward=backward)["total"]
    for alg, b in (("standard", std), ("flash", fl)):
        f = traffic.attention_flops(alg, **size, backward=backward,
                                    causal_fraction=frac if alg == "flash" else 1.0)
        tb = time_bound(f, b, c, dtype=dtype)
        out[alg] = {"flops": float(f), "bytes": float(b), "intensity": tb["intensity"],
                    "seconds": tb["seconds"], "bound": tb["bound"],
                    "flops_per_s": f / tb["seconds"]}
    return out


def measured_points(rows: Iterable[Mapping[str, Any]], *, batch: int | None = None,
                    heads: int | None = None) -> list[dict[str, Any]]:
    """Place bench CLI rows (``python -m flashlab bench --json``) on the roofline.

    Each row needs ``backend, seq_len, head_dim, dtype, causal, seconds, flops_per_s``;
    rows may carry ``batch``/``heads`` (else the arguments). Returns rows with the measured
    ``flops_per_s`` and an ``intensity`` computed from the forward flash schedule's bytes
    for tiled/kernel backends and from the standard model for the rest. Rows missing a key
    are skipped.
    """
    import jax.numpy as jnp
    from . import traffic
    need = ("backend", "seq_len", "head_dim", "dtype", "seconds", "flops_per_s")
    out = []
    for r in rows:
        if any(k not in r for k in need):
            continue
        B = int(r.get("batch", batch or 1))
        H = int(r.get("heads", heads or 1))
        N, d = int(r["seq_len"]), int(r["head_dim"])
        e = jnp.dtype(r["dtype"]).itemsize
        flops = float(r["flops_per_s"]) * float(r["seconds"])
        if any(s in str(r["backend"]) for s in ("pallas", "flash", "splash", "tiled")):
            byt = traffic.forward_closed_form_bytes(batch=B, heads=H, seq_len=N, head_dim=d,
                                                    dtype=r["dtype"],
                                                    block_q=int(r.get("block_q", min(512, N))))
        else:
            byt = traffic.analytic_hbm_bytes("standard", batch=B, heads=H, seq_len=N,
                                             head_dim=d, bytes_per_element=e)["total"]
        out.append({**dict(r), "intensity": flops / byt, "bytes": byt})
    return out
