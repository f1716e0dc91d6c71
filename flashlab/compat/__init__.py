"""Everything that knows JAX versions differ: Pallas names (``pallas``) and ``shard_map``
(``shard_map``).

Chapter 08 tells why this layer exists: a fork that reached into private APIs broke with every
JAX release. Everything else imports Pallas and ``shard_map`` through here. Imports nothing from
flashlab.
"""
from flashlab.compat import pallas, shard_map

__all__ = ["pallas", "shard_map"]
