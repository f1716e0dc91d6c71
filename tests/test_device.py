import jax
import pytest

from flashlab.contract import device
from flashlab.instruments import measure


def test_platform_and_interpret_mode():
    assert device.platform() in ("cpu", "gpu", "tpu")
    assert device.interpret_mode() is (device.platform() != "tpu")
    assert device.interpret_mode(True) is True
    params = device.tpu_interpret_params()
    assert params.detect_races and params.uninitialized_memory == "nan"


def test_problem_sizes():
    for p in ("cpu", "gpu", "tpu"):
        s = device.problem_sizes(p)
        assert s.seq_len in s.seq_lens or s.seq_len > 0
    assert device.problem_sizes("cpu").seq_lens[-1] <= 4096
    with pytest.raises(ValueError, match="which: expected one of"):
        device.problem_sizes("abacus")


def test_describe_and_measure():
    info = device.describe()
    assert info["platform"] == device.platform() and info["device_count"] >= 1
    x = jax.numpy.ones((64, 64))
    mem = measure.compiled_memory_bytes(lambda a: a @ a, x)
    assert mem["arguments"] == 64 * 64 * 4 and mem["outputs"] == 64 * 64 * 4
    assert measure.time_fn(lambda a: a @ a, x, repeats=2) > 0
    assert measure.device_memory_bytes() > 2**28
