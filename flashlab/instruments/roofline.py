"""Chips and the roofline: how long attention must take on a chip, at best.

A kernel that does ``F`` FLOPs and moves ``B`` bytes between HBM and the chip needs at least
``max(F / peak_flops, B / hbm_bandwidth)`` seconds. Its arithmetic intensity ``F / B`` decides
which term wins: below the chip's ridge point ``peak_flops / hbm_bandwidth`` it is
memory-bound, above it compute-bound.

Chip figures are per chip (all TensorCores of the chip), from the public pages cited per figure
in ``Chip.sources``: Google's Cloud TPU pages for HBM and bf16 peak, the scaling book for ICI,
NVIDIA's datasheets for the GPUs. VMEM is per TensorCore (one kernel instance runs on one core)
and, like the default scoped VMEM limit, comes from the real TPU compiler's verdicts (libtpu
0.0.42, compile-only), which agree with JAX's ``pltpu.get_tpu_info_for_chip``. That JAX table is
only a cross-check (:func:`jax_cross_check`): it never replaces a public figure silently.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

__all__ = ["Chip", "chips", "chip", "CHIP_NAMES", "arithmetic_intensity", "time_bound",
           "jax_cross_check"]

SCALING_BOOK = "https://jax-ml.github.io/scaling-book/tpus/"


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator chip. Bandwidths in bytes/s, peaks in FLOP/s, capacities in bytes.

    ``vmem_bytes``: physical on-chip memory a kernel tiles into (TPU: VMEM of one TensorCore;
    GPU: shared memory/SRAM of one SM, the paper's M). ``scoped_vmem_bytes``: the TPU
    compiler's default scoped VMEM limit, what a Pallas kernel may use unless it raises it with
    ``vmem_limit_bytes`` (``None`` for GPUs). ``ici_bytes_per_s``: chip-to-chip bandwidth (TPU
    ICI, GPU NVLink), bidirectional, all links. ``fp32_flops``: matmul peak for fp32 operands.
    ``source``: one line naming the sources; ``sources``: ``(figure, source)`` pairs.
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
    scoped_vmem_bytes: int | None = None
    sources: tuple[tuple[str, str], ...] = ()

    @property
    def ridge_point(self) -> float:
        """FLOPs per byte above which bf16 work is compute-bound on this chip."""
        return self.bf16_flops / self.hbm_bytes_per_s

    def peak_flops(self, dtype="bfloat16") -> float:
        import jax.numpy as jnp
        return self.fp32_flops if jnp.dtype(dtype).itemsize >= 4 else self.bf16_flops


GOOGLE = "cloud.google.com/tpu/docs/"
# The real compiler's verdicts (flashlab.instruments.roofline docstring): a VMEM scratch one MiB
# over ``vmem_bytes`` fails with "Allocation ... would exceed memory (size=...)", and pipelined
# blocks over ``scoped_vmem_bytes`` fail with CompileTimeScopedVmemOom unless the kernel passes
# ``vmem_limit_bytes`` (measured with one double-buffered input and output block: 16 MiB of
# blocks compile on v4, v5e, v5p and 16.25 do not; v6e: 32 yes, 32.25 no; 7x: 44 yes, 44.25 no).
COMPILER = "TPU compiler verdict (libtpu 0.0.42, compile-only); = jax pltpu.get_tpu_info_for_chip"

# fp32 on TPU: the MXU multiplies bf16; an fp32 matmul at Precision.HIGHEST runs as 6 bf16
# passes (bf16_6x), so we take bf16/6 — an estimate, not a published figure.
# HBM capacities as Google's pages give them, in GiB (v5e's page writes "16 GB").
_PUBLIC: dict[str, dict[str, Any]] = {
    "v4": dict(hbm_bytes_per_s=1.2e12, bf16_flops=2.75e14, hbm_bytes=32 * 2**30,
               vmem_bytes=16 * 2**20, scoped_vmem_bytes=16 * 2**20,
               ici_bytes_per_s=6 * 9e10, cores=2, page=GOOGLE + "v4"),
    "v5e": dict(hbm_bytes_per_s=8.19e11, bf16_flops=1.97e14, hbm_bytes=16 * 2**30,
                vmem_bytes=128 * 2**20, scoped_vmem_bytes=16 * 2**20,
                ici_bytes_per_s=4 * 9e10, cores=1, page=GOOGLE + "v5e"),
    "v5p": dict(hbm_bytes_per_s=2.765e12, bf16_flops=4.59e14, hbm_bytes=95 * 2**30,
                vmem_bytes=64 * 2**20, scoped_vmem_bytes=16 * 2**20,
                ici_bytes_per_s=6 * 1.8e11, cores=2, page=GOOGLE + "v5p"),
    "v6e": dict(hbm_bytes_per_s=1.64e12, bf16_flops=9.18e14, hbm_bytes=32 * 2**30,
                vmem_bytes=128 * 2**20, scoped_vmem_bytes=32 * 2**20,
                ici_bytes_per_s=4 * 1.8e11, cores=1, page=GOOGLE + "v6e"),
    # Ironwood: 192 GiB HBM, 7.37 TB/s, 1.2 TB/s ICI on the tpu7x page itself.
    "7x": dict(hbm_bytes_per_s=7.37e12, bf16_flops=2.307e15, hbm_bytes=192 * 2**30,
               vmem_bytes=64 * 2**20, scoped_vmem_bytes=44 * 2**20,
               ici_bytes_per_s=1.2e12, cores=2, page=GOOGLE + "tpu7x", ici_page=GOOGLE + "tpu7x"),
}

def _gpu_sources(sheet: str, sram: str) -> tuple[tuple[str, str], ...]:
    return tuple((k, sheet) for k in ("hbm_bytes_per_s", "bf16_flops", "fp32_flops", "hbm_bytes",
                                      "ici_bytes_per_s")) + (("vmem_bytes", sram),)


_GPUS = (
    # NVIDIA A100 datasheet (SXM 40 GB): 1555 GB/s, 312 TFLOP/s bf16 dense, 19.5 fp32 (non
    # tensor core); 192 KB SRAM per SM (paper Sec. 2.1); NVLink 600 GB/s.
    Chip("A100", 1.555e12, 3.12e14, 1.95e13, 192 * 1024, 40 * 10**9, 6.0e11, "gpu",
         "NVIDIA A100 datasheet (SXM4 40GB); arXiv 2205.14135 Sec. 2.1",
         sources=_gpu_sources("NVIDIA A100 datasheet (SXM4 40GB)",
                              "arXiv 2205.14135 Sec. 2.1 (192 KB per SM)")),
    # NVIDIA H100 SXM datasheet: 3.35 TB/s, 989 TFLOP/s bf16 dense, 67 fp32; 228 KB SRAM
    # per SM; NVLink 900 GB/s.
    Chip("H100", 3.35e12, 9.89e14, 6.7e13, 228 * 1024, 80 * 10**9, 9.0e11, "gpu",
         "NVIDIA H100 datasheet (SXM5 80GB)",
         sources=_gpu_sources("NVIDIA H100 datasheet (SXM5 80GB)",
                              "NVIDIA Hopper tuning guide (228 KB per SM)")),
)

CHIP_NAMES = ("v4", "v5e", "v5p", "v6e", "7x", "A100", "H100")


def _from_jax(name: str) -> dict[str, Any] | None:
    """Per-chip figures from ``pltpu.get_tpu_info_for_chip`` (None if this JAX lacks them)."""
    from flashlab.compat import pallas as compat
    try:
        info = compat.get_tpu_info_for_chip(compat.ChipVersion(name), 1)
    except Exception:  # older JAX: no table (None is not callable), or no such chip
        return None
    cores = _PUBLIC[name]["cores"]          # the table is per TensorCore
    return dict(hbm_bytes_per_s=float(info.mem_bw_bytes_per_second) * cores,
                bf16_flops=float(info.bf16_ops_per_second) * cores,
                vmem_bytes=int(info.vmem_capacity_bytes),
                hbm_bytes=int(info.hbm_capacity_bytes) * cores)


def _tpu_sources(pub: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    return (("hbm_bytes_per_s", pub["page"]), ("bf16_flops", pub["page"]),
            ("hbm_bytes", pub["page"]), ("vmem_bytes", COMPILER),
            ("scoped_vmem_bytes", "TPU compiler verdict (libtpu 0.0.42, compile-only)"),
            ("ici_bytes_per_s", pub.get("ici_page", SCALING_BOOK)),
            ("fp32_flops", "bf16 / 6 (fp32 as 6 bf16 MXU passes): an estimate"))


def chips(*, use_jax: bool = False) -> dict[str, Chip]:
    """Every chip of the book, by name: v4, v5e, v5p, v6e, 7x (TPUs), A100, H100 (GPUs).

    The figures are the public ones cited in each chip's ``sources``. ``use_jax=True`` asks
    for JAX's own table instead where this JAX has one (HBM bandwidth and capacity, bf16
    peak, VMEM; per TensorCore, times the cores of a chip): it differs from the public figures
    (v5p: 2.46 TB/s and 103 GB against 2.765 TB/s and 95 GiB), see :func:`jax_cross_check`.
    """
    out: dict[str, Chip] = {}
    for name, pub in _PUBLIC.items():
        got = _from_jax(name) if use_jax else None
        vals = {k: pub[k] for k in ("hbm_bytes_per_s", "bf16_flops", "vmem_bytes", "hbm_bytes")}
        srcs = _tpu_sources(pub)
        src = f"{pub['page']}; ICI {dict(srcs)['ici_bytes_per_s']}; VMEM: TPU compiler"
        if got is not None:
            vals.update(got)
            src = "jax pltpu.get_tpu_info_for_chip (HBM, bf16, VMEM per core); ICI: " + src
            srcs = tuple((k, "jax pltpu.get_tpu_info_for_chip" if k in got else v)
                         for k, v in srcs)
        out[name] = Chip(name, vals["hbm_bytes_per_s"], vals["bf16_flops"],
                         vals["bf16_flops"] / 6, vals["vmem_bytes"], vals["hbm_bytes"],
                         pub["ici_bytes_per_s"], "tpu", src, pub["scoped_vmem_bytes"], srcs)
    for g in _GPUS:
        out[g.name] = g
    return out


def jax_cross_check(rel: float = 0.02) -> list[dict[str, Any]]:
    """Where JAX's per-core table (times the cores) disagrees with the public per-chip figures.

    Returns one row ``{"chip", "figure", "public", "jax", "ratio"}`` per figure that differs by
    more than ``rel`` (an empty list if this JAX has no table).
    """
    public, rows = chips(), []
    for name in _PUBLIC:
        got = _from_jax(name)
        for fig, val in (got or {}).items():
            pub = getattr(public[name], fig)
            if abs(val / pub - 1) > rel:
                rows.append({"chip": name, "figure": fig, "public": pub, "jax": val,
                             "ratio": val / pub})
    return rows


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
