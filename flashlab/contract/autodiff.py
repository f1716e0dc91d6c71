"""Which derivatives a call is being traced for: forward mode, second order.

Backends built on a ``custom_vjp`` (``tiled``, ``pallas_tpu``, the official kernels, cuDNN)
have one derivative: the first-order reverse-mode one their backward kernel computes. JAX
cannot push a tangent forward through a ``custom_vjp`` (``jax.jvp``, ``jax.jacfwd``) nor
differentiate its backward again (grad of grad, ``jax.hessian``). The registry cannot see at
dispatch time what the caller will do with the result, but it can see the tracers it is
handed: ``jax.jvp``/``jacfwd`` wrap the inputs in JVP tracers, ``jax.grad``/``vjp`` in
linearize tracers, and a derivative of a derivative nests two of them. :func:`requested`
reads that off the inputs, and the registry treats the answer like any other feature: a
backend that does not declare it is skipped by ``auto`` and refuses by name with a
``NotImplementedError`` naming the backends that do support it.

What this cannot see: a transformation applied *outside* a ``jax.jit`` whose body calls
attention (``jax.jvp(jax.jit(model))``): inside the jit the inputs are plain staged values, and
JAX's own error ("can't apply forward-mode autodiff (jvp) to a custom_vjp function") is what
the caller gets. ``jax.linearize`` looks like reverse mode at dispatch but evaluates tangents
forward, so it needs ``backend="reference"`` or ``"xla"`` explicitly.
"""
from __future__ import annotations

import jax

__all__ = ["FEATURES", "requested", "describe", "under_vmap"]

FEATURES = frozenset({"forward_mode", "second_order"})

_WHAT = {"forward_mode": "a tangent pushed forward: jax.jvp / jax.jacfwd",
         "second_order": "a derivative of a derivative: grad of grad / jax.hessian"}


def _ad_layers(x) -> list[str]:
    """The AD tracer kinds wrapping ``x``, outermost first (``"jvp"`` or ``"linearize"``)."""
    from jax._src.interpreters import ad, batching
    layers = []
    for _ in range(64):                   # nesting depth of transformations, bounded
        if isinstance(x, ad.JVPTracer):
            layers.append("jvp")
            x = x.primal
        elif type(x).__name__ == "LinearizeTracer" and hasattr(x, "primal"):
            layers.append("linearize")
            x = x.primal
        elif isinstance(x, batching.BatchTracer):
            x = x.val
        else:
            break
    return layers


def requested(*arrays) -> frozenset:
    """Autodiff features the inputs are traced for: a subset of :data:`FEATURES`.

    ``"forward_mode"``: some input carries a JVP tracer (``jax.jvp``, ``jax.jacfwd``).
    ``"second_order"``: some input is wrapped by two or more AD transformations.
    """
    out = set()
    for x in jax.tree_util.tree_leaves(arrays):
        if not isinstance(x, jax.core.Tracer):
            continue
        layers = _ad_layers(x)
        if "jvp" in layers:
            out.add("forward_mode")
        if len(layers) >= 2:
            out.add("second_order")
    return frozenset(out)


def describe(feature: str) -> str:
    """``feature 'forward_mode' (a tangent pushed forward: jax.jvp / jax.jacfwd)``."""
    return f"feature {feature!r} ({_WHAT[feature]})"


def under_vmap(*arrays) -> bool:
    """True if some input is batched by ``jax.vmap`` (a batch tracer at any depth)."""
    from jax._src.interpreters import batching
    for x in jax.tree_util.tree_leaves(arrays):
        for _ in range(64):
            if isinstance(x, batching.BatchTracer):
                return True
            if not hasattr(x, "primal"):
                break
            x = x.primal
    return False
