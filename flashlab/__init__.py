"""flashlab: FlashAttention on TPU, built rung by rung, ending in a kernel you can import.

Layout everywhere is ``[batch, seq, heads, head_dim]`` with ``jax.nn.dot_product_attention``'s
argument names. ``flashlab.attention(...)`` is the contract; ``flashlab.backends()`` lists what
can serve it. See the book for the story and ``README.md`` for the quickstart.

The package, by role. Each subpackage may import only from those above it in this list (a test,
``tests/test_layout.py``, fails on an import that points down the list or on any cycle):

- ``compat``: the only modules that know JAX versions differ (Pallas and ``shard_map`` names).
- ``contract``: what every backend agrees on: ``masks.validate`` builds the one
  :class:`AttentionSpec`; ``device`` (platform, target chip), ``autodiff``, ``decode_validate``.
- ``ladder``: the plain-JAX rungs: ``reference`` (naive + float64 oracle), ``online_softmax`` (the
  one merge), ``tiled``.
- ``kernels``: the Pallas TPU kernels: forward, backward, decode, block sizes.
- ``dispatch``: ``attention``/``explain``, the backend registry, adapters for other kernels, and
  the conformance suite every backend passes.
- ``serving``: ``decode_attention`` and ``KVCache``.
- ``scale``: sharded and ring attention across devices and processes.
- ``instruments``: what measures the rungs: HBM traffic, roofline, the real TPU compiler and its
  schedule, memory, communication models.
- ``models``: a small document model that reuses the kernel (needs flax).
- ``viz``, ``widgets``: the book's figures and interactive widgets.
- ``benchmarks``: the ``python -m flashlab bench ...`` command lines.
"""
import sys

from flashlab import compat, contract, dispatch, instruments, kernels, ladder, scale, serving
from flashlab.contract.masks import AttentionSpec, validate
from flashlab.dispatch.api import as_flax_attention_fn, attention, explain
from flashlab.dispatch.registry import backends
from flashlab.kernels import flash_attention
from flashlab.ladder.reference import naive_attention, oracle_attention
from flashlab.ladder.tiled import tiled_attention
from flashlab.scale.distributed import sharded_attention
from flashlab.scale.ring import ring_attention
from flashlab.serving.decode import decode_attention
from flashlab.serving.kv_cache import KVCache

# ``flashlab.tpu_compile`` is the name the book and issue 16 use for the real TPU compiler on
# CPU; its code lives in ``instruments`` with the other measuring tools. One module object
# under both names (``import flashlab.tpu_compile`` works too); importing it loads no libtpu.
tpu_compile = instruments.tpu_compile
sys.modules[__name__ + ".tpu_compile"] = tpu_compile

__version__ = "0.1.0"


def __getattr__(name):
    # ``flashlab.models`` needs flax (an optional dependency): imported on first use.
    if name == "models":
        import importlib
        return importlib.import_module(".models", __name__)
    raise AttributeError(f"module 'flashlab' has no attribute {name!r}")


__all__ = [
    # the contract
    "attention", "explain", "backends", "as_flax_attention_fn", "AttentionSpec", "validate",
    # the rungs
    "naive_attention", "oracle_attention", "tiled_attention", "flash_attention",
    "sharded_attention", "ring_attention",
    # serving (chapter 12)
    "decode_attention", "KVCache",
    # subpackages
    "compat", "contract", "ladder", "kernels", "dispatch", "serving", "scale", "instruments",
    # the real TPU compiler on CPU (chapter 04; an alias of instruments.tpu_compile)
    "tpu_compile",
    # chapter 11: a document model that reuses the kernel (needs flax; imported on first use)
    "models",
]
