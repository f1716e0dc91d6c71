"""Which tokens live on which device in ring attention, and how much work each device does.

The sequence (length ``n``) is cut into equal chunks and dealt to the ``P`` devices of the ring:

* ``"contiguous"``: ``P`` chunks; device ``i`` holds chunk ``i`` (tokens ``i·n/P .. (i+1)·n/P``).
  Under a causal mask device ``P-1`` sees every key and device 0 only its own: unbalanced.
* ``"zigzag"``: ``2P`` chunks; device ``i`` holds chunks ``i`` and ``2P-1-i``: one early chunk
  (few visible keys) and one late chunk (many), so every device has the same causal work
  (Brandon et al. 2023 "striped"/zig-zag load balancing, as used by Megatron context parallel).

Everything here is plain NumPy on Python ints: the ring (``flashlab.scale.distributed``), the
figures (``flashlab.viz.ring``) and the tests read the same tables. Visibility of a (query chunk,
key chunk) pair is decided by :func:`flashlab.contract.masks.block_maybe_visible`, the same test
the ring uses to skip a block.
"""
from __future__ import annotations

import numpy as np

from flashlab.contract.masks import block_maybe_visible

__all__ = ["LAYOUTS", "chunks_per_device", "device_chunks", "chunk_starts", "permutation",
           "inverse_permutation", "ring_schedule", "visible_pairs", "work_per_device",
           "zigzag_sends"]

LAYOUTS = ("contiguous", "zigzag")


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")


def chunks_per_device(layout: str) -> int:
    """1 for ``"contiguous"``, 2 for ``"zigzag"``."""
    _check_layout(layout)
    return 1 if layout == "contiguous" else 2


def device_chunks(num_devices: int, layout: str) -> np.ndarray:
    """``[P, chunks_per_device]`` int: the chunk ids device ``i`` holds, in its local order."""
    P = num_devices
    if layout == "contiguous":
        return np.arange(P)[:, None]
    _check_layout(layout)
    i = np.arange(P)
    return np.stack([i, 2 * P - 1 - i], axis=1)


def chunk_len(n: int, num_devices: int, layout: str) -> int:
    """Tokens per chunk; raises if ``n`` does not split evenly."""
    parts = num_devices * chunks_per_device(layout)
    if n % parts:
        raise ValueError(f"sequence length {n} must be a multiple of {parts} "
                         f"({num_devices} devices x {chunks_per_device(layout)} chunks, "
                         f"layout={layout!r})")
    return n // parts


def chunk_starts(n: int, num_devices: int, layout: str) -> np.ndarray:
    """``[P, chunks_per_device]`` int32: first token (natural position) of each local chunk."""
    return (device_chunks(num_devices, layout) * chunk_len(n, num_devices, layout)).astype(np.int32)


def permutation(n: int, num_devices: int, layout: str) -> np.ndarray:
    """``perm [n]``: layout index -> natural position (``x_layout = x[:, perm]``).

    Device ``i`` owns layout indices ``i·n/P .. (i+1)·n/P`` (what ``PartitionSpec(axis)`` gives
    it).
    """
    c = chunk_len(n, num_devices, layout)
    starts = chunk_starts(n, num_devices, layout).reshape(-1)          # [P * nc]
    return (starts[:, None] + np.arange(c)[None, :]).reshape(-1).astype(np.int32)


def inverse_permutation(perm: np.ndarray) -> np.ndarray:
    """``inv`` with ``inv[perm[j]] = j`` (``x = x_layout[:, inv]``)."""
    inv = np.empty_like(perm)
    inv[perm] = np.arange(perm.size, dtype=perm.dtype)
    return inv


def ring_schedule(num_devices: int) -> np.ndarray:
    """``[steps, P]``: at step ``s`` device ``i`` holds the K/V block of device ``(i - s) mod P``.

    (Every step each device sends its block to ``i + 1`` with ``ppermute``.)
    """
    P = num_devices
    return (np.arange(P)[None, :] - np.arange(P)[:, None]) % P


def visible_pairs(num_devices: int, layout: str, *, is_causal: bool = False, window=None,
                  n: int | None = None) -> np.ndarray:
    """``[steps, P, nc, nc]`` bool: whether device ``i`` computes (local q chunk a, kv chunk b)
    at step ``s`` (False = skipped by ``block_maybe_visible``). ``n`` defaults to ``2P·nc``."""
    P, nc = num_devices, chunks_per_device(layout)
    n = 2 * P * nc if n is None else n
    c = chunk_len(n, P, layout)
    starts = chunk_starts(n, P, layout)
    sched = ring_schedule(P)
    out = np.zeros((P, P, nc, nc), bool)
    for s in range(P):
        for i in range(P):
            src = sched[s, i]
            for a in range(nc):
                for b in range(nc):
                    qs, ks = int(starts[i, a]), int(starts[src, b])
                    out[s, i, a, b] = bool(block_maybe_visible(qs, qs + c, ks, ks + c,
                                                               is_causal=is_causal, window=window))
    return out


def work_per_device(num_devices: int, layout: str, *, is_causal: bool = False, window=None,
                    n: int | None = None) -> np.ndarray:
    """``[P]`` float: score entries each device computes over the whole ring, in units of
    ``(n / 2P)²`` (one zig-zag chunk pair), so the two layouts compare on one scale."""
    P, nc = num_devices, chunks_per_device(layout)
    pairs = visible_pairs(P, layout, is_causal=is_causal, window=window, n=n)
    unit = (2 / nc) ** 2                  # a contiguous chunk pair is 2x2 zig-zag chunk pairs
    return pairs.sum(axis=(0, 2, 3)) * unit


def zigzag_sends(num_devices: int) -> tuple[list, list]:
    """The two ``ppermute`` s that deal a contiguously sharded sequence into the zig-zag layout.

    Sharded in natural order, device ``i`` holds chunks ``2i`` and ``2i+1`` (of ``2P``). Each
    device owns one even and one odd chunk (``j`` and ``2P-1-j`` differ in parity), so
    sending every even chunk to its owner is one permutation, every odd chunk another:
    ``(even_pairs, odd_pairs)``, each ``[(source, destination)]``. The receiver ``j`` puts the
    chunk it receives first (slot 0, chunk ``j``) from the even send when ``j`` is even, else
    from the odd one. Reversed pairs undo it. Nothing is gathered: each device sends and
    receives ``2 · n/(2P)`` tokens.
    """
    P = num_devices
    owner = {int(c): j for j, cs in enumerate(device_chunks(P, "zigzag")) for c in cs}
    return ([(i, owner[2 * i]) for i in range(P)], [(i, owner[2 * i + 1]) for i in range(P)])
