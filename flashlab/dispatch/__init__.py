"""The front door: ``attention``/``explain``, the registry of backends, adapters for other
kernels (XLA, cuDNN, the official Pallas kernels, splash), and the conformance suite every backend
passes. Imports compat, contract, ladder and kernels.
"""
from flashlab.dispatch import adapters, api, conformance, registry

__all__ = ["adapters", "api", "conformance", "registry"]
