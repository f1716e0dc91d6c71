"""Show the lines of a function that matter for one feature, numbered from its ``def`` line.

Chapter 05 grows the minimal kernel into the production one a feature at a time; for each it
prints the lines that feature adds with :func:`source_lines` rather than the whole kernel.
A pattern that matches nothing raises, so a chapter cannot silently show stale code.
"""
from __future__ import annotations

import inspect
from typing import Callable

__all__ = ["source_lines"]


def source_lines(fn: Callable, *needles: str, context: int = 0) -> str:
    """The lines of ``fn``'s source containing any of ``needles`` (plain substrings).

    ``context`` lines are kept on each side of a hit; runs are separated by ``...``. Each line
    is prefixed with its number within ``fn`` (the ``def`` line is 1, decorators before it), so
    the listing changes only when ``fn`` does, not when code above it in the file moves.
    Returns one string. Raises ``ValueError`` naming a needle that occurs nowhere in ``fn``,
    and when no needle is given.
    """
    if not needles:
        raise ValueError("needles: expected at least one substring to look for, got none")
    lines, _ = inspect.getsourcelines(fn)
    first = 1 - next(i for i, line in enumerate(lines) if line.lstrip().startswith("def "))
    missing = [n for n in needles if not any(n in line for line in lines)]
    if missing:
        raise ValueError(f"needles: {missing} do not occur in the source of "
                         f"{fn.__module__}.{fn.__qualname__}")
    keep = sorted({k for i, line in enumerate(lines) if any(n in line for n in needles)
                   for k in range(max(0, i - context), min(len(lines), i + context + 1))})
    out, prev = [], None
    for i in keep:
        if prev is not None and i != prev + 1:
            out.append("   ...")
        out.append(f"{first + i:3d}  {lines[i].rstrip()}")
        prev = i
    return "\n".join(out)
