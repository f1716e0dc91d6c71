"""flashlab: FlashAttention on TPU, built rung by rung, ending in a kernel you can import.

Layout everywhere is ``[batch, seq, heads, head_dim]`` with ``jax.nn.dot_product_attention``'s
argument names. ``flashlab.attention(...)`` is the contract; ``flashlab.backends()`` lists what
can serve it. See the book for the story and ``README.md`` for the quickstart.
"""
from . import device, masks, online_softmax, reference
from . import adapters, api, registry
from . import comm_model, distributed, ring_layout
from . import kernels, roofline, tiled, traffic
from . import conformance, leaks, profiling
from . import decode, decode_validate, kv_cache
from . import tpu_compile
from .api import as_flax_attention_fn, attention, explain
from .decode import decode_attention
from .kv_cache import KVCache
from .distributed import ring_attention, sharded_attention
from .kernels import flash_attention
from .masks import AttentionSpec, validate
from .reference import naive_attention, oracle_attention
from .registry import backends
from .tiled import tiled_attention

__version__ = "0.1.0"


def __getattr__(name):
    # ``flashlab.models`` needs flax (an optional dependency): imported on first use.
    if name == "models":
        import importlib
        return importlib.import_module(".models", __name__)
    raise AttributeError(f"module 'flashlab' has no attribute {name!r}")


__all__ = [
    # the contract
    "attention", "explain", "backends", "as_flax_attention_fn",
    # serving (chapter 12)
    "decode_attention", "decode", "decode_validate", "KVCache", "kv_cache",
    # the rungs
    "naive_attention", "oracle_attention", "tiled_attention", "flash_attention", "sharded_attention", "ring_attention",
    # validation and the one mask description
    "AttentionSpec", "validate",
    # modules
    "device", "masks", "online_softmax", "reference", "registry", "api", "adapters",
    "distributed", "ring_layout", "comm_model", "kernels", "traffic", "roofline", "tiled", "conformance", "leaks", "profiling",
    "tpu_compile",
    # chapter 11: a document model that reuses the kernel (needs flax; imported on first use)
    "models",
]
