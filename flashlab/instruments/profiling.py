"""What a profiler and XLA's cost model can see of a computation (chapter 08, "blind profilers").

A Pallas kernel is one opaque custom call to XLA: unless the kernel says otherwise
(``pl.CostEstimate``), XLA's scheduler and the profiler's roofline see zero FLOPs and zero
bytes for it, and an op name that says nothing about which part of the model it belongs to
(``jax.named_scope`` fixes that). These helpers read both facts out of the compiled or lowered
computation, on any platform:

* :func:`cost_report` -- ``compiled.cost_analysis()`` and ``compiled.memory_analysis()`` of
  ``jax.jit(fn)`` on this device, as one small record;
* :func:`tpu_cost_estimates` -- the cost estimates Pallas attached to each
  ``tpu_custom_call`` when ``fn`` is lowered *for TPU* (works on a CPU: Mosaic lowering runs
  here, only the final compile needs a chip);
* :func:`trace_summary` -- how many HLO ops sit under each ``named_scope`` path (the names
  a ``jax.profiler`` trace shows);
* :func:`capture_trace` -- a ``jax.profiler`` trace of a few calls into a directory.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import os
import re
from typing import Callable

import jax

__all__ = ["CostReport", "cost_report", "tpu_cost_estimates", "trace_summary", "capture_trace"]


@dataclasses.dataclass(frozen=True)
class CostReport:
    """XLA's view of one compiled call (``None`` where this backend does not say).

    flops, transcendentals, bytes_accessed: from ``compiled.cost_analysis()``;
    argument_bytes, output_bytes, temp_bytes: from ``compiled.memory_analysis()``.
    """

    platform: str
    flops: float | None
    transcendentals: float | None
    bytes_accessed: float | None
    argument_bytes: int | None
    output_bytes: int | None
    temp_bytes: int | None

    def __str__(self) -> str:
        def num(x, unit):
            return "n/a" if x is None else f"{x / 1e6:.2f} M{unit}"
        return (f"{self.platform}: flops {num(self.flops, 'FLOP')}, bytes accessed "
                f"{num(self.bytes_accessed, 'B')}, temp {num(self.temp_bytes, 'B')}")


def _cost_dict(compiled) -> dict:
    ca = compiled.cost_analysis()
    if isinstance(ca, (list, tuple)):        # older JAX: one dict per program
        ca = ca[0] if ca else {}
    return dict(ca or {})


def cost_report(fn: Callable, *args, **kwargs) -> CostReport:
    """Compile ``jax.jit(fn)`` for ``args`` and report XLA's cost and memory analysis."""
    compiled = jax.jit(fn).lower(*args, **kwargs).compile()
    ca = _cost_dict(compiled)
    try:
        mem = compiled.memory_analysis()
    except Exception:  # pragma: no cover - some backends do not implement it
        mem = None
    get = lambda name: None if mem is None else getattr(mem, name, None)  # noqa: E731
    return CostReport(platform=jax.devices()[0].platform, flops=ca.get("flops"),
                      transcendentals=ca.get("transcendentals"),
                      bytes_accessed=ca.get("bytes accessed"),
                      argument_bytes=get("argument_size_in_bytes"),
                      output_bytes=get("output_size_in_bytes"),
                      temp_bytes=get("temp_size_in_bytes"))


_COST_RE = re.compile(r'"cost_estimate"\s*:\s*\{([^}]*)\}')
_NUM_RE = re.compile(r'"(\w+)"\s*:\s*(-?\d+)')


def tpu_cost_estimates(fn: Callable, *args, **kwargs) -> list[dict | None]:
    """Per ``tpu_custom_call`` in ``fn`` lowered for TPU: its cost estimate, or ``None``.

    ``{"flops": ..., "transcendentals": ..., "bytes_accessed": ...}`` is what the kernel's
    ``pl.CostEstimate`` told XLA; ``None`` means the kernel gave none, and XLA schedules it
    (and the profiler's roofline shows it) as if it cost nothing. Call ``fn`` with
    ``interpret=False`` so the kernels lower with Mosaic.
    """
    text = jax.jit(fn).trace(*args, **kwargs).lower(lowering_platforms=("tpu",)).as_text()
    out = []
    for line in text.splitlines():
        if "@tpu_custom_call" not in line:
            continue
        line = line.replace("\\22", '"').replace("\\0A", " ")
        m = _COST_RE.search(line)
        out.append(None if m is None else {k: int(v) for k, v in _NUM_RE.findall(m.group(1))})
    return out


_OP_NAME_RE = re.compile(r'op_name="([^"]+)"')


def trace_summary(fn: Callable, *args, depth: int = 1, **kwargs) -> dict[str, int]:
    """HLO ops of the compiled ``jax.jit(fn)`` counted by ``named_scope`` path.

    Each op's ``op_name`` metadata (what a profiler trace labels it with) is
    ``jit(fn)/scope/.../primitive``; ops are grouped by their first ``depth`` scopes, and ops
    outside every scope by their primitive name (``"<no scope> dot_general"``). Sorted by
    count, then name.
    """
    text = jax.jit(fn).lower(*args, **kwargs).compile().as_text()
    counts = collections.Counter()
    for name in _OP_NAME_RE.findall(text):
        parts = name.split("/")
        if not parts[0].startswith(("jit(", "pjit(")) or len(parts) < 2:
            continue                      # parameter names, not ops of the traced function
        parts = parts[1:]
        # einsum specs and other transform names look like scopes; keep named scopes only.
        scopes = [p for p in parts[:-1] if re.fullmatch(r"[A-Za-z_][\w.\-]*", p)]
        key = "/".join(scopes[:depth]) if scopes else f"<no scope> {parts[-1] if parts else name}"
        counts[key] += 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def capture_trace(fn: Callable, *args, logdir: str, repeats: int = 3) -> list[str]:
    """Run ``fn(*args)`` ``repeats`` times under ``jax.profiler.trace(logdir)``.

    Returns the files written (open them with TensorBoard's profile plugin or Perfetto).
    The first call (compilation) happens before the trace starts.
    """
    jax.block_until_ready(fn(*args))
    with jax.profiler.trace(logdir):
        for _ in range(repeats):
            jax.block_until_ready(fn(*args))
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(logdir) for f in fs)


def _dumps(x) -> str:  # pragma: no cover - debugging aid
    return json.dumps(x, indent=1, default=str)
