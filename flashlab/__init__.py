"""flashlab: FlashAttention on TPU, built rung by rung, ending in a kernel you can import.

Layout everywhere is ``[batch, seq, heads, head_dim]`` with ``jax.nn.dot_product_attention``'s
argument names. See the book for the story and ``README.md`` for the quickstart.
"""
from . import device, masks, online_softmax, reference
from .masks import AttentionSpec, validate
from .reference import naive_attention, oracle_attention

__version__ = "0.1.0"

__all__ = [
    "AttentionSpec", "validate", "naive_attention", "oracle_attention",
    "device", "masks", "online_softmax", "reference",
]
