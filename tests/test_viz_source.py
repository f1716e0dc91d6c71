"""flashlab.viz.source.source_lines: the feature-by-feature listings of chapter 05."""
import pytest

from flashlab.kernels import minimal
from flashlab.viz.source import source_lines


def test_source_lines_numbers_hits_and_context():
    out = source_lines(minimal.minimal_flash_kernel, "pl.when", context=1)
    assert out.count("pl.when") == 2 and "   ..." in out
    listing = source_lines(minimal.minimal_flash_kernel, "def minimal_flash_kernel",
                           "pl.when(j == 0)")
    assert listing.splitlines()[0].split()[:2] == ["1", "def"]     # numbered from the def line


def test_source_lines_refuses_a_stale_needle():
    with pytest.raises(ValueError, match=r"needles: \['no_such_line'\] do not occur"):
        source_lines(minimal.minimal_flash_kernel, "pl.when", "no_such_line")
    with pytest.raises(ValueError, match="needles: expected at least one"):
        source_lines(minimal.minimal_flash_kernel)
