"""Serving (chapter 12): ``decode_attention`` over a contiguous or paged KV cache, and
``KVCache``. Imports everything below it (compat ... dispatch).
"""
from flashlab.serving import decode, kv_cache

__all__ = ["decode", "kv_cache"]
