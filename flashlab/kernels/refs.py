"""Name a Pallas kernel's refs instead of slicing them by offset.

``pallas_call`` hands a kernel its refs positionally, in a fixed order: scalar-prefetch
operands, then inputs, then outputs, then scratch. Slicing that list by arithmetic
(``refs[n_in + 1 + has_lse:]``) lets one added operand silently shift every ref after it. The
grid-spec builders list each group's names next to the BlockSpecs they build; the kernel asks
for refs by those names.
"""
from __future__ import annotations

from typing import Any, Mapping, NamedTuple, Sequence

__all__ = ["RefNames", "name_refs", "Window"]


class RefNames(NamedTuple):
    """The names of a kernel's refs, per group, in ``pallas_call`` order."""
    prefetch: tuple[str, ...]     # scalar-prefetch operands (SMEM)
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    scratch: tuple[str, ...]

    def all(self) -> tuple[str, ...]:
        return (*self.prefetch, *self.inputs, *self.outputs, *self.scratch)


def name_refs(refs: Sequence[Any], names: RefNames) -> Mapping[str, Any]:
    """``{name: ref}`` for a kernel's positional ``refs``; an error if the counts disagree.

    A name that is absent from ``names`` (an optional operand not passed) is absent from the
    result, so ``"bias" in refs`` is the test for an optional operand.
    """
    flat = names.all()
    if len(refs) != len(flat):
        raise ValueError(f"refs: the kernel got {len(refs)} refs, its grid spec names "
                         f"{len(flat)}: {flat}")
    if len(set(flat)) != len(flat):
        raise ValueError(f"names: duplicate ref names in {flat}")
    return dict(zip(flat, refs))


class Window:
    """``ref[rows, cols]`` read as ``view[...]`` (``view[r, :]``: rows ``r`` of the window's
    columns): a slice of a block in VMEM (a row chunk, a diagonal piece,
    :class:`flashlab.kernels.diagonal.Piece`) that a tile function reads as the whole block.
    No copy: each read is a window of the resident block."""

    def __init__(self, ref, rows=slice(None), cols=slice(None)):
        self.ref, self.rows, self.cols = ref, rows, cols

    def __getitem__(self, index):
        if index is Ellipsis:
            return self.ref[self.rows, self.cols]
        return self.ref[index[0], self.cols]
