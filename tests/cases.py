"""Mask-option cases shared by every rung's tests.

The list lives in :mod:`flashlab.conformance` (the conformance library a second engineer runs
on a new backend); tests import it from here so there is one definition of "every mask option".
"""
from flashlab.conformance import MASK_OPTIONS, mask_kwargs

__all__ = ["MASK_OPTIONS", "mask_kwargs"]
