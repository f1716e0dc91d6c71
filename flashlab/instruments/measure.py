"""Small, honest measurement helpers: wall time, compiled memory, device memory.

Timings are medians of several runs after a warm-up (compilation excluded), with
``block_until_ready`` so that JAX's asynchronous dispatch does not hide the work.
"""
from __future__ import annotations

import os
import statistics
import time
from typing import Callable

import jax

__all__ = ["time_fn", "compiled_memory_bytes", "device_memory_bytes", "host_memory_available_bytes",
           "peak_rss_bytes"]


def time_fn(fn: Callable, *args, repeats: int = 5, warmup: int = 1, **kwargs) -> float:
    """Median wall-clock seconds of ``fn(*args, **kwargs)`` (results blocked on)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args, **kwargs))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args, **kwargs))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def compiled_memory_bytes(fn: Callable, *args, **kwargs) -> dict[str, int]:
    """XLA's own accounting of a jitted ``fn``'s buffers, without running it.

    Returns ``{"arguments", "outputs", "temporaries", "peak"}`` in bytes, where ``peak`` is
    arguments + outputs + temporaries (an upper bound on what one call holds at once).
    """
    compiled = jax.jit(fn).lower(*args, **kwargs).compile()
    ma = compiled.memory_analysis()
    if ma is None:  # some backends do not report
        raise RuntimeError("this backend reports no memory_analysis()")
    out = {"arguments": int(ma.argument_size_in_bytes), "outputs": int(ma.output_size_in_bytes),
           "temporaries": int(ma.temp_size_in_bytes)}
    out["peak"] = out["arguments"] + out["outputs"] + out["temporaries"]
    return out


def device_memory_bytes() -> int:
    """Memory available to one device: HBM limit on TPU/GPU, MemAvailable on CPU."""
    dev = jax.devices()[0]
    stats = getattr(dev, "memory_stats", lambda: None)()
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    return host_memory_available_bytes()


def host_memory_available_bytes() -> int:
    """The host's ``MemAvailable`` (Linux), else its physical memory, in bytes."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def peak_rss_bytes() -> int:
    """This process's peak resident set size (``VmHWM``), in bytes (Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("VmHWM not found in /proc/self/status (Linux only)")
