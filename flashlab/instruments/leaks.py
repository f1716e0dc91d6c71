"""Catching device-memory leaks and silent recompilation (chapter 08, "the memory leak").

A training step that leaks does one of three things on every call: keeps a device buffer
alive (an output appended to a list a closure holds, a cache keyed on arrays), or compiles
again (a fresh ``jax.jit`` per call, a Python float passed as a static argument, a shape that
changes). Both are visible from Python: ``jax.live_arrays()`` lists every live device buffer,
and JAX reports each backend compile as a ``jax.monitoring`` duration event
(``/jax/core/compile/backend_compile_duration``). :func:`assert_no_growth` calls a function
repeatedly and fails if either grows.
"""
from __future__ import annotations

import collections
import dataclasses
import gc
import threading
from typing import Callable

import jax

__all__ = ["LeakError", "GrowthReport", "live_arrays_summary", "compile_count",
           "count_compiles", "measure_growth", "assert_no_growth", "BACKEND_COMPILE_EVENT"]

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class LeakError(AssertionError):
    """Live device arrays or compilations grew across repeated calls."""


# One listener for the whole process, registered once; counters only ever increase, so any
# number of callers (and threads) can take deltas without unregistering anything.
_lock = threading.Lock()
_compiles = 0
_registered = False


def _on_duration(event: str, duration_secs: float, **_kw) -> None:
    global _compiles
    if event == BACKEND_COMPILE_EVENT:
        with _lock:
            _compiles += 1


def compile_count() -> int:
    """Backend compilations in this process since flashlab.instruments.leaks started listening."""
    global _registered
    with _lock:
        if not _registered:
            jax.monitoring.register_event_duration_secs_listener(_on_duration)
            _registered = True
        return _compiles


class count_compiles:
    """Context manager: ``with count_compiles() as c: ...; c.count`` -- compiles inside."""

    def __enter__(self):
        self._start = compile_count()
        self.count = 0
        return self

    def __exit__(self, *exc):
        self.count = compile_count() - self._start
        return False


def _key(a) -> str:
    return f"{a.dtype}{list(a.shape)}".replace(" ", "")


def _live() -> tuple[collections.Counter, dict]:
    """Live device arrays as a multiset of ``dtype[shape]`` keys, and bytes per key."""
    gc.collect()
    counts, nbytes = collections.Counter(), {}
    for a in jax.live_arrays():
        k = _key(a)
        counts[k] += 1
        nbytes[k] = a.size * a.dtype.itemsize
    return counts, nbytes


def live_arrays_summary(arrays=None) -> dict[str, int]:
    """``{"float32[128,64]": count, ...}`` of the live device arrays (or of ``arrays``)."""
    arrays = jax.live_arrays() if arrays is None else arrays
    c = collections.Counter(_key(a) for a in arrays)
    return dict(sorted(c.items()))


@dataclasses.dataclass(frozen=True)
class GrowthReport:
    """What ``repeats`` more calls left behind.

    new_arrays: live device arrays that did not exist before the calls, by dtype/shape;
    new_bytes: their total size; compiles: backend compilations during the calls.
    """

    repeats: int
    new_arrays: dict
    new_bytes: int
    compiles: int

    @property
    def ok(self) -> bool:
        return not self.new_arrays and self.compiles == 0

    def __str__(self) -> str:
        if self.ok:
            return f"no growth over {self.repeats} calls"
        n = sum(self.new_arrays.values())
        return (f"over {self.repeats} calls: {n} new live arrays ({self.new_bytes} bytes: "
                f"{self.new_arrays}), {self.compiles} compilations")


def _release(out) -> None:
    jax.block_until_ready(out)


def measure_growth(fn: Callable, *args, repeats: int = 5, warmup: int = 1, **kwargs) -> GrowthReport:
    """Call ``fn(*args, **kwargs)`` ``warmup`` times, then ``repeats`` times, and report growth.

    Warm-up calls may compile and fill caches; only what the later calls add counts. Each
    call's result is waited for and dropped, so a correct function returns to the same
    multiset of live arrays (counted by dtype and shape).
    """
    if repeats < 1:
        raise ValueError(f"repeats: expected a positive int, got {repeats!r}")
    for _ in range(warmup):
        _release(fn(*args, **kwargs))
    before, _ = _live()
    start = compile_count()
    for _ in range(repeats):
        _release(fn(*args, **kwargs))
    compiles = compile_count() - start
    after, nbytes = _live()
    # Compared as multisets of dtype[shape]: a buffer that is replaced on every call (an
    # interpreter's state, a donated buffer) is not growth; one more of it per call is.
    grown = after - before
    new_bytes = sum(n * nbytes[k] for k, n in grown.items())
    return GrowthReport(repeats, dict(sorted(grown.items())), int(new_bytes), compiles)


def assert_no_growth(fn: Callable, *args, repeats: int = 5, warmup: int = 1,
                     allow_compiles: int = 0, **kwargs) -> GrowthReport:
    """Raise :class:`LeakError` if repeated calls of ``fn`` leave arrays alive or recompile.

    Returns the :class:`GrowthReport` when there is no growth.
    """
    report = measure_growth(fn, *args, repeats=repeats, warmup=warmup, **kwargs)
    if report.new_arrays or report.compiles > allow_compiles:
        raise LeakError(f"{getattr(fn, '__name__', fn)!s}: {report}")
    return report
