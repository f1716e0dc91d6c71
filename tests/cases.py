"""Mask-option cases shared by every rung's tests: one place lists what 'every mask option' is.

The list lives in :mod:`flashlab.conformance` (the conformance suite as a library, chapter 08);
this module re-exports it for the tests that import ``cases``.
"""
from flashlab.conformance import MASK_OPTIONS, mask_kwargs

__all__ = ["MASK_OPTIONS", "mask_kwargs"]
