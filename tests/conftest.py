"""Shared fixtures and strategies for the flashlab test suite."""
import numpy as np
import pytest
from hypothesis import settings

settings.register_profile("ci", deadline=None, max_examples=25, derandomize=True,
                          print_blob=True)
settings.load_profile("ci")


@pytest.fixture
def rng():
    return np.random.default_rng(0)


from flashlab.dispatch.conformance import random_qkv
