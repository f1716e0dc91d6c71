"""When does the ring hide its communication? Bytes per ring step against FLOPs per ring step.

Every ring step each device sends one K block and one V block to its neighbour (``ppermute``)
while it computes attention of its local queries against the block it holds. With ``P``
devices, sequence length ``N``, ``c = N/P`` tokens per device, ``H`` query heads, ``K`` kv heads,
head dims ``d`` (and ``d_v``), per device and per step:

    bytes  = B · c · K · (d + d_v) · bytes_per_element           (one K and one V block)
    FLOPs  = 2 · B · H · c² · (d + d_v)    (= 4·B·H·c²·d: QKᵀ and PV, 2 FLOPs per MAC)

The transfer is hidden when FLOPs / peak ≥ bytes / link bandwidth, i.e. when

    c ≥ bytes_per_element · (K / H) · peak / (2 · link_bandwidth)

so each device needs *enough tokens*; GQA (small ``K/H``) lowers the bar, faster chips raise it.
A causal mask under the zig-zag layout computes about half of each step (``work_fraction=0.5``),
which doubles the bar.

Chip numbers: bf16 peak FLOP/s and one-way ICI bandwidth per link, from "How to Scale Your
Model", part 2 (Austin et al., jax-ml.github.io/scaling-book/tpus, tables of TPU specs). The
lead's ``flashlab.instruments.roofline`` holds the full chip table; this one is only what the ring
needs.
"""
from __future__ import annotations

import dataclasses

__all__ = ["RingChip", "RING_CHIPS", "ring_step_bytes", "ring_step_flops", "ring_step_times",
           "min_tokens_per_device"]


@dataclasses.dataclass(frozen=True)
class RingChip:
    name: str
    bf16_flops: float          # peak FLOP/s per chip (bf16 MXU)
    ici_link_bytes: float      # bytes/s, one direction of one ICI link (a ring hop uses one)


#: Scaling book, part 2 ("How to Think About TPUs"): bf16 FLOP/s per chip and one-way ICI
#: bandwidth per link.
RING_CHIPS = {
    "v4": RingChip("TPU v4", 2.75e14, 4.5e10),
    "v5e": RingChip("TPU v5e", 1.97e14, 4.5e10),
    "v5p": RingChip("TPU v5p", 4.59e14, 9.0e10),
    "v6e": RingChip("TPU v6e", 9.20e14, 9.0e10),
}


def _chip(chip) -> RingChip:
    if isinstance(chip, RingChip):
        return chip
    if chip not in RING_CHIPS:
        raise ValueError(f"chip: expected one of {sorted(RING_CHIPS)} or a RingChip, got {chip!r}")
    return RING_CHIPS[chip]


def ring_step_bytes(*, batch: int, tokens_per_device: int, kv_heads: int, head_dim: int,
                    head_dim_v: int | None = None, bytes_per_element: int = 2) -> int:
    """Bytes one device sends per ring step: one K and one V block ``[B, c, K, d]``."""
    dv = head_dim if head_dim_v is None else head_dim_v
    return batch * tokens_per_device * kv_heads * (head_dim + dv) * bytes_per_element


def ring_step_flops(*, batch: int, tokens_per_device: int, heads: int, head_dim: int,
                    head_dim_v: int | None = None, work_fraction: float = 1.0) -> float:
    """FLOPs one device spends per ring step: ``2·B·H·c²·(d + d_v)`` times ``work_fraction``."""
    dv = head_dim if head_dim_v is None else head_dim_v
    return 2.0 * batch * heads * tokens_per_device ** 2 * (head_dim + dv) * work_fraction


def ring_step_times(chip, *, batch: int, tokens_per_device: int, heads: int, kv_heads: int,
                    head_dim: int, bytes_per_element: int = 2, work_fraction: float = 1.0,
                    mfu: float = 1.0) -> dict:
    """Seconds per ring step to compute (at ``mfu`` of peak) and to send the next block."""
    c = _chip(chip)
    fl = ring_step_flops(batch=batch, tokens_per_device=tokens_per_device, heads=heads,
                         head_dim=head_dim, work_fraction=work_fraction)
    by = ring_step_bytes(batch=batch, tokens_per_device=tokens_per_device, kv_heads=kv_heads,
                         head_dim=head_dim, bytes_per_element=bytes_per_element)
    compute_s, comm_s = fl / (c.bf16_flops * mfu), by / c.ici_link_bytes
    return {"flops": fl, "bytes": by, "compute_s": compute_s, "comm_s": comm_s,
            "hidden": compute_s >= comm_s}


def min_tokens_per_device(chip, *, heads: int, kv_heads: int, bytes_per_element: int = 2,
                          work_fraction: float = 1.0, mfu: float = 1.0) -> float:
    """Smallest ``c = N/P`` at which compute per step covers the transfer (batch and d cancel)."""
    c = _chip(chip)
    return (bytes_per_element * (kv_heads / heads) * c.bf16_flops * mfu
            / (2.0 * c.ici_link_bytes * work_fraction))
