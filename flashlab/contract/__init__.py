"""What every backend agrees on. Imports only :mod:`flashlab.compat`.

- :mod:`~flashlab.contract.masks`: ``validate`` checks every argument once and builds the one
  :class:`~flashlab.contract.masks.AttentionSpec` the backends consume.
- :mod:`~flashlab.contract.device`: platform, interpret mode, the TPU generation being built for.
- :mod:`~flashlab.contract.autodiff`: which derivatives a call asks for (forward mode, second
  order).
- :mod:`~flashlab.contract.decode_validate`: the same for one decode step (``DecodeSpec``).
- :mod:`~flashlab.contract.layouts`: jax.nn's ``[B, T, N, H]`` or heads-major ``[B, N, T, H]``.
"""
from flashlab.contract import autodiff, decode_validate, device, layouts, masks

__all__ = ["autodiff", "decode_validate", "device", "layouts", "masks"]
