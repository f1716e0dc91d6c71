"""The conformance suite: every registered backend, the same cases, the float64 oracle.

The cases, shapes and tolerances live in :mod:`flashlab.dispatch.conformance` (so that a notebook
or a second engineer can run them with ``flashlab.dispatch.conformance.check_backend(name)``); this
module only parametrizes pytest over them. A case is skipped only when the backend's own
declaration excludes it (the skip reason quotes the declaration) or the backend is not importable
here.

Adding a backend: ``flashlab.dispatch.registry.register(Backend(...))``, then pass this module.
Tolerances: see :mod:`flashlab.dispatch.conformance` (fp32 2e-5 abs, bf16 3e-2 abs, grads 1e-4
rel).
"""
import pytest

from flashlab.dispatch import conformance


def _params(kind):
    return [pytest.param(b, s, o, id=f"{b}-{s}-{o}") for b, s, o in conformance.cases(kind)]


def _run(kind, name, shape="", option=""):
    try:
        conformance.run_case(kind, name, shape, option)
    except conformance.Skip as e:
        pytest.skip(str(e))


@pytest.mark.parametrize("name,shape,option", _params("fwd"))
def test_forward_fp32(name, shape, option):
    _run("fwd", name, shape, option)


@pytest.mark.parametrize("name,shape,option", _params("bf16"))
def test_forward_bf16(name, shape, option):
    _run("bf16", name, shape, option)


@pytest.mark.parametrize("name,shape,option", _params("grad"))
def test_gradients_fp32(name, shape, option):
    _run("grad", name, shape, option)


@pytest.mark.parametrize("name", [b for b, _, _ in conformance.cases("zero_rows")])
def test_fully_masked_rows(name):
    """Rows masked by a dense mask and a batch row with no keys: zeros, zero finite grads."""
    _run("zero_rows", name)


def test_check_backend_reports_a_wrong_backend():
    """check_backend runs the same cases programmatically and catches a broken kernel."""
    from flashlab.dispatch import registry
    ref = registry.get("reference")
    bad = registry.Backend("broken_for_test", "reference, times 1.001",
                           lambda q, k, v, spec, *, interpret=None: ref.fn(q, k, v, spec) * 1.001,
                           platforms=ref.platforms)
    registry.register(bad, replace=True)
    try:
        rep = conformance.check_backend("broken_for_test", kinds=("fwd",), options=("none",))
        assert not rep.ok and len(rep.failures) == len(conformance.SHAPES)
        good = conformance.check_backend("reference", kinds=("fwd",), options=("none",))
        assert good.ok and good.passed == len(conformance.SHAPES)
    finally:
        registry._REGISTRY.pop("broken_for_test", None)
