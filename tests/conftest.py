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


def random_qkv(rng, B, T, S, N, K, H, dtype=np.float32, Hv=None):
    """Unit-normal q [B,T,N,H], k [B,S,K,H], v [B,S,K,Hv]."""
    q = rng.standard_normal((B, T, N, H)).astype(dtype)
    k = rng.standard_normal((B, S, K, H)).astype(dtype)
    v = rng.standard_normal((B, S, K, Hv or H)).astype(dtype)
    return q, k, v
