"""Mask-option cases shared by every rung's tests.

The list lives in :mod:`flashlab.dispatch.conformance` (the conformance library a second engineer
runs on a new backend); tests import it from here so there is one definition of "every mask
option".
"""
from hypothesis import strategies as st

from flashlab.dispatch.conformance import MASK_OPTIONS, mask_kwargs

__all__ = ["MASK_OPTIONS", "mask_kwargs", "draw_shape"]


def draw_shape(data, head_dims):
    """Hypothesis: ``(B, T, S, N, K, H)`` with self or cross attention, MHA or GQA, ragged T/S."""
    B = data.draw(st.integers(1, 2), "B")
    T = data.draw(st.integers(1, 140), "T")
    S = data.draw(st.integers(1, 140), "S") if data.draw(st.booleans(), "cross") else T
    K = data.draw(st.sampled_from([1, 2]), "K")
    N = K * data.draw(st.sampled_from([1, 2]), "G")
    H = data.draw(st.sampled_from(head_dims), "H")
    return B, T, S, N, K, H
