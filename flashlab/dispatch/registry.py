"""The backend registry: name -> what it supports + how to call it, and how ``auto`` chooses.

Each :class:`Backend` declares its capabilities in the vocabulary of
``AttentionSpec.features()`` (``bias``, ``mask``, ``causal``, ``local_window``, ``seq_lengths``,
``segment_ids``, ``soft_cap``, ``gqa``, ``cross_attention``, ``sinks``, ``offsets``) plus
platforms, dtypes, gradients and a distinct value head dim. A backend asked for something outside
its declaration raises
``NotImplementedError`` naming the feature and the backends that do support it; the
conformance suite (tests/test_conformance.py) runs every registered backend through the same
cases and skips exactly what the declaration excludes. Adding a backend = :func:`register`
it, then pass the suite.
"""
from __future__ import annotations

import dataclasses
import importlib.util
from typing import Callable

import jax.numpy as jnp

from flashlab.dispatch import adapters, static_table
from flashlab.contract import autodiff, device
from flashlab.contract.masks import AttentionSpec

__all__ = ["Backend", "Choice", "register", "backends", "get", "choose", "ALL_FEATURES",
           "CPU_TILED_MIN_SCORES"]

ALL_FEATURES = frozenset({"bias", "mask", "causal", "local_window", "seq_lengths",
                          "segment_ids", "soft_cap", "gqa", "cross_attention", "sinks",
                          "offsets"})
ALL_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})
PLATFORMS = ("cpu", "gpu", "tpu")

# On CPU `auto` switches from XLA's fused-but-materializing attention to the tiled rung when
# the score matrix per (batch, head) reaches this many entries (T*S). Re-measured 2026-12-03
# (fp32, batch 1, 8 heads, d=64, default blocks; one process per run, xla and tiled calls
# alternating, medians of 17-41 calls; a shared 2-core x86 CPU, load average 6-9), xla / tiled
# forward time, two runs: N=32: 0.84x; N=64: 0.95x, 0.91x; N=128: 1.01x, 1.19x; N=192: 0.92x,
# 1.30x; N=256: 1.03x, 1.49x; N=320: 1.32x; N=384: 1.96x, 1.72x; N=512: 4.73x, 3.10x;
# N=1024: 6.18x. Forward + backward: N=128: 1.01x; N=256: 1.44x; N=512: 1.43x. XLA wins only
# below N=128 (by 5-16%), the two tie around 128-192, and tiled wins from N=256 on in every
# run. (The previous threshold, 1024*1024, came from fresh-process runs whose N=512 point
# favoured XLA once; the alternating runs above and chapter 03's table never did.)
CPU_TILED_MIN_SCORES = 256 * 256


@dataclasses.dataclass(frozen=True)
class Backend:
    """One way to compute attention, and what it promises.

    Attributes:
      name: registry key (``attention(..., backend=name)``).
      description: one line for tables and ``explain``.
      fn: ``fn(query, key, value, spec, *, interpret) -> out`` in the public layout.
      platforms: where it runs compiled (``"cpu"``, ``"gpu"``, ``"tpu"``).
      interpret_platforms: where it can run in a Pallas interpreter instead.
      interpret_by_default: run interpreted off its platforms without being asked (our own
        kernels do; the official kernels only when asked with ``interpret=True``).
      dtypes: supported input dtypes (names).
      features: supported ``AttentionSpec.features()`` names.
      gradients: differentiable (the conformance suite checks its gradients).
      value_head_dim: supports ``value.shape[-1] != query.shape[-1]``.
      requires: import path that must be present (``None``: always importable).
      check: extra constraint beyond the declaration: ``check(spec) -> reason or None``.
      interpret_kind: what "interpret" means for it (for ``explain``).
      autodiff: derivatives beyond first-order reverse mode
        (``flashlab.contract.autodiff.FEATURES``: ``"forward_mode"`` for ``jax.jvp``/``jacfwd``,
        ``"second_order"`` for grad of grad and ``jax.hessian``), seen at dispatch by :func:`flashlab.contract.autodiff.requested`.
    """

    name: str
    description: str
    fn: Callable
    platforms: frozenset
    dtypes: frozenset = ALL_DTYPES
    features: frozenset = ALL_FEATURES
    gradients: bool = True
    value_head_dim: bool = True
    interpret_platforms: frozenset = frozenset()
    interpret_by_default: bool = False
    requires: str | None = None
    check: Callable[[AttentionSpec], str | None] | None = None
    interpret_kind: str = ""
    autodiff: frozenset = frozenset()

    @property
    def gqa(self) -> bool:
        return "gqa" in self.features

    @property
    def ragged(self) -> bool:
        return "seq_lengths" in self.features

    def availability(self) -> str | None:
        """``None`` if importable here, else why not."""
        if self.requires is None:
            return None
        try:
            found = importlib.util.find_spec(self.requires) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            return f"module {self.requires} is not installed/merged on this checkout"
        return None

    def declaration(self) -> str:
        """The capability declaration in one line (quoted by skip messages)."""
        return (f"{self.name}: platforms={sorted(self.platforms)} "
                f"interpret={sorted(self.interpret_platforms)} dtypes={sorted(self.dtypes)} "
                f"features={sorted(self.features)} gradients={self.gradients} "
                f"value_head_dim={self.value_head_dim} autodiff={sorted(self.autodiff)}")

    def mode(self, platform: str, interpret) -> str | None:
        """``"compiled"``, ``"interpret (...)"`` or ``None`` (cannot run here with that choice)."""
        if platform in self.platforms and not (interpret and platform in self.interpret_platforms):
            return "compiled"
        if platform in self.interpret_platforms:
            if interpret or (interpret is None and self.interpret_by_default):
                return f"interpret ({self.interpret_kind})"
        return None

    def unsupported(self, spec: AttentionSpec, platform: str | None = None,
                    interpret=None, autodiff_features=frozenset()) -> list[str]:
        """Reasons this backend cannot serve ``spec`` here (empty list: it can).

        ``autodiff_features``: what :func:`flashlab.contract.autodiff.requested` saw in the inputs.
        """
        platform = device.platform() if platform is None else platform
        why = []
        if self.mode(platform, interpret) is None:
            if platform in self.interpret_platforms:
                why.append(f"platform {platform!r} (only in interpret mode: pass interpret=True"
                           f" to run it interpreted, for correctness, not speed)")
            else:
                why.append(f"platform {platform!r}")
        if jnp.dtype(spec.dtype).name not in self.dtypes:
            why.append(f"dtype {jnp.dtype(spec.dtype).name}")
        for f in sorted(spec.features() - self.features):
            why.append(f"feature {f!r}")
        if spec.head_dim_v != spec.head_dim and not self.value_head_dim:
            why.append("feature 'value_head_dim' (value head_dim != query head_dim)")
        for f in sorted(frozenset(autodiff_features) - self.autodiff):
            why.append(autodiff.describe(f))
        if self.check is not None:
            extra = self.check(spec)
            if extra:
                why.append(extra)
        return why


@dataclasses.dataclass(frozen=True)
class Choice:
    """Which backend serves a request, how it runs, and why (``str()`` reads as a sentence)."""

    backend: str
    mode: str
    reason: str
    platform: str
    considered: tuple[tuple[str, str], ...] = ()

    def __str__(self) -> str:
        lines = [f"backend={self.backend} ({self.mode} on {self.platform}): {self.reason}"]
        for name, verdict in self.considered:
            lines.append(f"  - {name}: {verdict}")
        return "\n".join(lines)


_REGISTRY: dict[str, Backend] = {}


def register(backend: Backend, *, replace: bool = False) -> Backend:
    """Add ``backend`` to the registry (``replace=True`` to overwrite a name)."""
    if backend.name in _REGISTRY and not replace:
        raise ValueError(f"backend: {backend.name!r} is already registered")
    _REGISTRY[backend.name] = backend
    return backend


def backends(available_only: bool = False) -> list[Backend]:
    """Registered backends in registration order (``available_only``: importable here)."""
    return [b for b in _REGISTRY.values() if not available_only or b.availability() is None]


def get(name: str) -> Backend:
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(f"backend: expected 'auto' or one of {list(_REGISTRY)}, got {name!r}")
    return _REGISTRY[name]


def _supporters(spec, platform, interpret, exclude, autodiff_features=frozenset()) -> list[str]:
    return [b.name for b in backends() if b.name != exclude and b.availability() is None
            and not b.unsupported(spec, platform, interpret, autodiff_features)]


# Preference order of `auto` per platform (first that is available and supports the request).
_PREFERENCE = {
    "tpu": ("pallas_tpu", "splash", "xla", "tiled", "reference"),
    "gpu": ("cudnn", "xla", "tiled", "reference"),
    "cpu": ("xla", "reference"),              # + tiled first for long sequences, see choose()
}

# The TPU kernels ranked by the committed static table (static_table.static_ranking).
_TPU_LIBRARY = {"pallas_tpu": "flashlab", "splash": "splash",
                "jax_pallas_flash": "jax_pallas_flash"}


def _tpu_order_by_static_table(order, spec: AttentionSpec):
    """``order`` with the TPU kernels sorted by the stored static estimate for the target chip
    and the request's shape class (the stored run nearest it: ``static_table.nearest_run``),
    and the sentence ``explain`` quotes (the figures it chose on, or why there are none)."""
    from flashlab.kernels import blocks
    chip = blocks.resolve_chip(None)
    ranked, source = static_table.static_ranking(
        chip, shape=(spec.q_len, spec.kv_len, spec.head_dim, spec.is_causal))
    if not ranked:
        return order, f"no static figure for {chip} ({source}): the fixed order"
    lib_to_backend = {v: k for k, v in _TPU_LIBRARY.items()}
    kernels = [lib_to_backend[lib] for lib, _, _ in ranked if lib in lib_to_backend]
    rest = [n for n in order if n not in _TPU_LIBRARY]
    what = "+".join(ranked[0][2])
    figures = ", ".join(f"{lib_to_backend.get(lib, lib)} {ms:.2f} ms" for lib, ms, _ in ranked)
    return kernels + rest, (f"static table on {chip}, {what} est at default blocks: {figures}; "
                            f"{source}")


_WHY = {
    "pallas_tpu": "our Pallas TPU kernel: compiled with Mosaic, O(N) memory",
    "splash": "the official splash kernel",
    "cudnn": "cuDNN's fused flash attention: fastest on NVIDIA GPUs for fp16/bf16",
    "xla": "XLA's fused attention: fastest here for short sequences",
    "tiled": "the tiled rung: O(N) memory, wins once the score matrix is large",
    "reference": "the naive rung: supports every feature",
}


def choose(spec: AttentionSpec, backend: str = "auto", *, interpret=None,
           platform: str | None = None, autodiff_features=frozenset()) -> Choice:
    """Pick the backend for ``spec`` (``"auto"`` or a name) and say why.

    ``autodiff_features`` (from :func:`flashlab.contract.autodiff.requested`) are required like the
    spec's own features: ``auto`` never picks a backend that cannot differentiate that way.

    Raises ``NotImplementedError`` if a named backend's declaration excludes the request,
    naming the feature and the backends that do support it, and ``RuntimeError`` if it is
    not available on this checkout.
    """
    platform = device.platform() if platform is None else platform
    if backend != "auto":
        b = get(backend)
        missing = b.availability()
        if missing:
            raise RuntimeError(f"backend {b.name!r} is not available: {missing}")
        why = b.unsupported(spec, platform, interpret, autodiff_features)
        if why:
            others = _supporters(spec, platform, interpret, b.name, autodiff_features)
            raise NotImplementedError(
                f"backend {b.name!r} does not support {', '.join(why)} "
                f"(its declaration: {b.declaration()}); backends that support this request "
                f"here: {others or 'none'}")
        return Choice(b.name, b.mode(platform, interpret), "requested by name", platform)

    order = list(_PREFERENCE.get(platform, _PREFERENCE["cpu"]))
    static_note = None
    if platform == "tpu":
        order, static_note = _tpu_order_by_static_table(order, spec)
    long = spec.q_len * spec.kv_len >= CPU_TILED_MIN_SCORES
    if platform == "cpu" and long:
        order.insert(0, "tiled")
    considered = []
    for name in order:
        if name not in _REGISTRY:
            continue
        b = _REGISTRY[name]
        missing = b.availability()
        if missing:
            considered.append((name, f"unavailable: {missing}"))
            continue
        why = b.unsupported(spec, platform, interpret, autodiff_features)
        if why:
            considered.append((name, "does not support " + ", ".join(why)))
            continue
        reason = _WHY.get(name, b.description)
        if platform == "cpu":
            n = f"T*S = {spec.q_len}*{spec.kv_len}"
            thr = f"{CPU_TILED_MIN_SCORES} (measured crossover)"
            reason += f" ({n} {'>=' if long else '<'} {thr})"
        if static_note is not None and name in _TPU_LIBRARY:
            reason += f" ({static_note})"
        return Choice(name, b.mode(platform, interpret), reason, platform, tuple(considered))
    raise NotImplementedError(f"no registered backend supports this request on {platform}: "
                              + "; ".join(f"{n}: {v}" for n, v in considered))


# ----------------------------------------------------------------------------- registrations

register(Backend(
    "reference", "naive attention in jnp (materializes the score matrix)", adapters.reference_fn,
    platforms=frozenset(PLATFORMS), autodiff=autodiff.FEATURES))
register(Backend(
    "xla", "jax.nn.dot_product_attention(implementation='xla')", adapters.xla_fn,
    platforms=frozenset(PLATFORMS),
    features=ALL_FEATURES - {"soft_cap", "sinks", "offsets"}, value_head_dim=False,
    autodiff=autodiff.FEATURES))
register(Backend(
    "tiled", "flashlab.ladder.tiled: blockwise attention in plain JAX, custom_vjp backward",
    adapters.tiled_fn, platforms=frozenset(PLATFORMS), requires="flashlab.ladder.tiled",
    autodiff=frozenset({"forward_mode"})))   # jvp through its forward loops (flashlab.ladder.tiled)
register(Backend(
    "pallas_tpu", "flashlab.kernels: our Pallas TPU flash attention", adapters.pallas_tpu_fn,
    platforms=frozenset({"tpu"}), interpret_platforms=frozenset({"cpu", "gpu"}),
    interpret_by_default=True, dtypes=frozenset({"bfloat16", "float32"}),
    gradients=True,   # backward kernels: flashlab.kernels.backward (chapter 07)
    requires="flashlab.kernels", interpret_kind="Pallas interpreter"))
register(Backend(
    "jax_pallas_flash", "jax.experimental.pallas.ops.tpu.flash_attention (official)",
    adapters.jax_pallas_flash_fn, platforms=frozenset({"tpu"}),
    interpret_platforms=frozenset({"cpu"}), dtypes=frozenset({"bfloat16", "float32"}),
    features=frozenset({"bias", "mask", "causal", "seq_lengths", "segment_ids",
                        "cross_attention"}),
    value_head_dim=False, requires="jax.experimental.pallas.ops.tpu.flash_attention",
    interpret_kind="TPU interpret mode"))
register(Backend(
    "splash", "jax.experimental.pallas.ops.tpu.splash_attention (official)", adapters.splash_fn,
    platforms=frozenset({"tpu"}), interpret_platforms=frozenset({"cpu"}),
    dtypes=frozenset({"bfloat16", "float32"}),
    features=frozenset({"causal", "local_window", "seq_lengths", "segment_ids", "soft_cap",
                        "gqa", "cross_attention"}),
    value_head_dim=False, requires="jax.experimental.pallas.ops.tpu.splash_attention",
    interpret_kind="TPU interpret mode"))
register(Backend(
    "cudnn", "jax.nn.dot_product_attention(implementation='cudnn') (GPU)", adapters.cudnn_fn,
    platforms=frozenset({"gpu"}), dtypes=frozenset({"float16", "bfloat16"}),
    features=frozenset({"bias", "mask", "causal", "local_window", "seq_lengths", "segment_ids",
                        "gqa", "cross_attention"}),
    value_head_dim=False, check=adapters.cudnn_check))
