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


def flag_at_import(module: str, name: str, **env) -> bool:
    """``module.name`` (a flag read from the environment at import) in a fresh interpreter
    whose environment adds ``env``: what a process started that way sees."""
    import os
    import subprocess
    import sys
    code = f"from {module} import {name} as f; import sys; sys.exit(0 if f else 3)"
    rc = subprocess.run([sys.executable, "-c", code], timeout=120,
                        env=dict(os.environ, JAX_PLATFORMS="cpu", **env)).returncode
    assert rc in (0, 3), rc
    return rc == 0


def kernel_eqns(f, *args) -> list:
    """The equations of every ``pallas_call`` kernel that ``f(*args)`` traces, one list per
    kernel, sub-jaxprs (``pl.when``'s branches) included: what a kernel builds per tile."""
    import jax

    def walk(jaxpr):
        for e in jaxpr.eqns:
            yield e
            for p in e.params.values():
                for sub in p if isinstance(p, (tuple, list)) else (p,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        yield from walk(inner)
    top = jax.make_jaxpr(f)(*args).jaxpr
    return [list(walk(e.params["jaxpr"])) for e in walk(top) if e.primitive.name == "pallas_call"]
