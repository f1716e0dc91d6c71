"""The conformance suite as a library: every backend, the same cases, the float64 oracle.

tests/test_conformance.py parametrizes over :func:`cases` and runs :func:`run_case`; a second
engineer who writes a backend runs the same cases with :func:`check_backend` (chapter 08).
The case list -- mask options, shapes, the smaller set for slow interpreted backends, the
tolerances -- lives here and only here.

Each backend runs forward (fp32, bf16) and gradients through every mask option, on
self-attention, GQA and cross-attention shapes, with ragged lengths and fully masked rows
among the options. A case is skipped (:class:`Skip`) only when the backend's own declaration
excludes it (the reason quotes the declaration) or the backend is not importable here.
Backends that run in TPU interpret mode off-TPU are slow there, so they get fewer cases.

Tolerances (unit-normal inputs, outputs of magnitude <= ~3):
  fp32 forward  max abs error <= 2e-5
  bf16 forward  max abs error <= 3e-2 (8-bit mantissa inputs, fp32 accumulation, bf16 output;
                the oracle sees the same bf16-rounded inputs)
  fp32 grads    max abs error <= 1e-4 * max |oracle grad| (relative to the gradient's scale)
"""
from __future__ import annotations

import dataclasses
import time
import zlib

import jax
import jax.numpy as jnp
import numpy as np

from flashlab.contract import device
from flashlab.dispatch import registry
from flashlab.contract.masks import validate
from flashlab.ladder.reference import oracle_attention

__all__ = ["FP32_ATOL", "BF16_ATOL", "GRAD_RTOL", "SHAPES", "MASK_OPTIONS", "KINDS",
           "mask_kwargs", "random_qkv", "Skip", "cases", "run_case", "check_backend",
           "CheckReport", "oracle_grads"]

FP32_ATOL = 2e-5
BF16_ATOL = 3e-2
GRAD_RTOL = 1e-4

KINDS = ("fwd", "bf16", "grad", "zero_rows")

#               B   T   S   N  K  H
SHAPES = {"self": (2, 24, 24, 4, 4, 16),
          "gqa": (2, 24, 24, 4, 2, 16),
          "cross": (2, 16, 40, 4, 2, 16)}

MASK_OPTIONS = ("none", "causal", "window_int", "window_pair", "causal_window", "seq_lengths",
                "kv_lengths_zero", "segments", "segments_pair", "dense_mask",
                "dense_mask_per_head", "bias", "bias_broadcast", "soft_cap", "sinks", "everything")

# The cases a TPU-interpret-mode backend runs on CPU (each call takes ~1 s there).
SLOW_FWD = ("none", "causal", "window_pair", "seq_lengths", "kv_lengths_zero", "segments",
            "dense_mask", "bias", "soft_cap", "everything")
SLOW_GRAD = ("causal", "kv_lengths_zero", "segments")
SLOW_BF16 = ("causal", "segments")


def mask_kwargs(option: str, rng, B: int, T: int, S: int, N: int) -> dict:
    """Keyword arguments exercising one mask option at shapes (B, T, S, N)."""
    if option == "none":
        return {}
    if option == "causal":
        return {"is_causal": True}
    if option == "window_int":
        return {"local_window_size": int(rng.integers(0, 6))}
    if option == "window_pair":
        return {"local_window_size": (int(rng.integers(0, 8)), int(rng.integers(0, 3)))}
    if option == "causal_window":
        return {"is_causal": True, "local_window_size": (int(rng.integers(1, 9)), 0)}
    if option == "seq_lengths":
        return {"query_seq_lengths": rng.integers(1, T + 1, size=B).astype(np.int32),
                "key_value_seq_lengths": rng.integers(1, S + 1, size=B).astype(np.int32)}
    if option == "kv_lengths_zero":  # a batch row with no keys at all: all-zero output
        kv = rng.integers(1, S + 1, size=B).astype(np.int32)
        kv[0] = 0
        return {"key_value_seq_lengths": kv}
    if option == "segments":
        if T != S:
            q_ids = np.sort(rng.integers(0, 3, size=(B, T)), axis=1).astype(np.int32)
            kv_ids = np.sort(rng.integers(0, 3, size=(B, S)), axis=1).astype(np.int32)
            return {"segment_ids": (q_ids, kv_ids)}
        return {"segment_ids": np.sort(rng.integers(0, 3, size=(B, T)), axis=1).astype(np.int32)}
    if option == "segments_pair":
        q_ids = np.sort(rng.integers(0, 3, size=(B, T)), axis=1).astype(np.int32)
        kv_ids = np.sort(rng.integers(0, 3, size=(B, S)), axis=1).astype(np.int32)
        return {"segment_ids": (q_ids, kv_ids)}
    if option == "dense_mask":
        return {"mask": rng.random((B, 1, T, S)) < 0.7}
    if option == "dense_mask_per_head":
        return {"mask": rng.random((1, N, T, S)) < 0.7}
    if option == "bias":
        return {"bias": rng.standard_normal((B, N, T, S)).astype(np.float32)}
    if option == "bias_broadcast":
        return {"bias": rng.standard_normal((1, 1, T, S)).astype(np.float32)}
    if option == "soft_cap":
        return {"logits_soft_cap": float(rng.uniform(0.5, 5.0))}
    if option == "sinks":   # with a window, so some rows see few keys and the sink matters
        return {"sinks": (2 * rng.standard_normal(N)).astype(np.float32),
                "local_window_size": (int(rng.integers(0, 4)), 1)}
    if option == "everything":
        return {"is_causal": True, "local_window_size": (6, 2),
                "key_value_seq_lengths": rng.integers(1, S + 1, size=B).astype(np.int32),
                "mask": rng.random((B, N, T, S)) < 0.8,
                "bias": rng.standard_normal((1, N, T, S)).astype(np.float32),
                "logits_soft_cap": 2.0}
    raise KeyError(option)


def random_qkv(rng, B, T, S, N, K, H, dtype=np.float32, Hv=None):
    """Unit-normal q [B,T,N,H], k [B,S,K,H], v [B,S,K,Hv]."""
    q = rng.standard_normal((B, T, N, H)).astype(dtype)
    k = rng.standard_normal((B, S, K, H)).astype(dtype)
    v = rng.standard_normal((B, S, K, Hv or H)).astype(dtype)
    return q, k, v


class Skip(Exception):
    """The backend's declaration excludes this case (or it is not importable here)."""


def _platform():
    return device.platform()


def interpret_for(b: registry.Backend):
    """``True`` when the backend can run here only interpreted (and must be asked to)."""
    p = _platform()
    if b.mode(p, None) is None and p in b.interpret_platforms:
        return True
    return None


def is_slow(b: registry.Backend) -> bool:
    return interpret_for(b) is True and "TPU interpret" in b.interpret_kind


# Gradients of a backend run by the generic Pallas interpreter off-TPU (three kernels traced
# and compiled per case, ~3 s each on CPU): every mask option on the GQA shape, and the
# options that meet MHA, cross-attention and ragged lengths on the other two shapes.
INTERPRETED_GRAD = {"gqa": MASK_OPTIONS,
                    "self": ("none", "causal", "kv_lengths_zero", "bias_broadcast"),
                    "cross": ("causal", "seq_lengths", "segments_pair", "everything")}


def is_interpreted(b: registry.Backend) -> bool:
    """Runs here only through the generic Pallas interpreter (by default or when asked)."""
    p = _platform()
    mode = b.mode(p, None) or b.mode(p, True) or ""
    return "interpret" in mode and not is_slow(b)


def _options(b: registry.Backend, kind: str, shape: str) -> tuple[str, ...]:
    slow = is_slow(b)
    if kind == "fwd":
        opts = SLOW_FWD if slow else MASK_OPTIONS
        if slow and shape == "cross":
            opts = ("none", "causal")
    elif kind == "grad":
        opts = SLOW_GRAD if slow else MASK_OPTIONS
        if slow and shape != "self":
            opts = ()
        if is_interpreted(b):
            opts = INTERPRETED_GRAD[shape]
    elif kind == "bf16":
        opts = SLOW_BF16 if slow else MASK_OPTIONS
        if shape != "self":
            opts = () if slow else ("causal", "segments_pair", "kv_lengths_zero")
    else:
        raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")
    return tuple(opts)


def cases(kind: str, names=None) -> list[tuple[str, str, str]]:
    """``(backend, shape, option)`` triples of one kind (``"zero_rows"``: ``(backend, "", "")``)."""
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")
    bs = registry.backends() if names is None else [registry.get(n) for n in names]
    if kind == "zero_rows":
        return [(b.name, "", "") for b in bs]
    return [(b.name, shape, o) for b in bs for shape in SHAPES for o in _options(b, kind, shape)]


def _seed(shape, option):
    return zlib.crc32(f"{shape}/{option}".encode()) % 2**16


def _case(shape, option, seed):
    B, T, S, N, K, H = SHAPES[shape]
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, B, T, S, N, K, H)
    kw = mask_kwargs(option, rng, B, T, S, N)
    return q, k, v, kw


def _backend_or_skip(name, q, k, v, kw, *, need_grad=False):
    b = registry.get(name)
    missing = b.availability()
    if missing:
        raise Skip(f"{name} unavailable: {missing}")
    _, _, _, spec = validate(q, k, v, **kw)
    interpret = interpret_for(b)
    why = b.unsupported(spec, _platform(), interpret)
    if why:
        raise Skip(f"{name} declares no support for {', '.join(why)} -- {b.declaration()}")
    if need_grad and not b.gradients:
        raise Skip(f"{name} declares gradients=False -- {b.declaration()}")
    return interpret


def _empty_rows(q, k, kw):
    """Bool [B, T, N]: rows with no visible key (oracle lse == -inf)."""
    v1 = np.ones((*k.shape[:3], 1), np.float64)
    kw = {n: x for n, x in kw.items() if n != "sinks"}       # a sink makes every lse finite
    _, lse = oracle_attention(q, k, v1, **kw, return_lse=True)   # [B, N, T]
    return np.transpose(np.isneginf(lse), (0, 2, 1))


def oracle_grads(q, k, v, dout, **kw):
    """Float64 gradients (dq, dk, dv) of ``sum(attention(q, k, v) * dout)``.

    The attention matrix P is read out of the float64 oracle itself (attention is linear in
    V, so V = identity returns P), then the textbook backward: dV = Pᵀ dO, dP = dO Vᵀ,
    D = rowsum(dP ∘ P), dS = P ∘ (dP − D), through the soft cap, then dQ = scale·dS K,
    dK = scale·dSᵀ Q; GQA sums over the query heads of each kv head.
    """
    q, k, v, dout = (np.asarray(x, np.float64) for x in (q, k, v, dout))
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    eye = np.broadcast_to(np.eye(S), (B, K, S, S)).transpose(0, 2, 1, 3)   # [B, S, K, S]
    P = oracle_attention(q, k, eye, **kw).transpose(0, 2, 1, 3)           # [B, N, T, S]
    kr, vr = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)
    scale = kw.get("scale") or 1 / np.sqrt(H)
    dv = np.einsum("bhts,bthd->bshd", P, dout)
    dP = np.einsum("bthd,bshd->bhts", dout, vr)
    dS = P * (dP - (dP * P).sum(-1, keepdims=True))
    cap = kw.get("logits_soft_cap")
    if cap is not None:
        s_raw = np.einsum("bthd,bshd->bhts", q, kr) * scale
        dS = dS * (1 - np.tanh(s_raw / cap) ** 2)
    dq = scale * np.einsum("bhts,bshd->bthd", dS, kr)
    dk = scale * np.einsum("bhts,bthd->bshd", dS, q)
    fold = lambda x: x.reshape(B, S, K, G, -1).sum(3)  # noqa: E731
    return dq, fold(dk), fold(dv)


def _attention(*a, **kw):
    from flashlab.dispatch.api import attention
    return attention(*a, **kw)


def _run_fwd(name, shape, option):
    q, k, v, kw = _case(shape, option, seed=_seed(shape, option))
    interpret = _backend_or_skip(name, q, k, v, kw)
    out = _attention(q, k, v, **kw, backend=name, interpret=interpret)
    assert out.shape == q.shape[:3] + (v.shape[3],) and out.dtype == jnp.float32
    ref = oracle_attention(q, k, v, **kw)
    np.testing.assert_allclose(np.asarray(out), ref, atol=FP32_ATOL, rtol=0)
    empty = _empty_rows(q, k, kw)
    np.testing.assert_array_equal(np.asarray(out)[empty], 0)   # exactly zero, not mean(V)


def _run_bf16(name, shape, option):
    q, k, v, kw = _case(shape, option, seed=7 + _seed(shape, option))
    qb, kb, vb = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    interpret = _backend_or_skip(name, qb, kb, vb, kw)
    out = _attention(qb, kb, vb, **kw, backend=name, interpret=interpret)
    assert out.dtype == jnp.bfloat16
    ref = oracle_attention(*(np.asarray(x, np.float32) for x in (qb, kb, vb)), **kw)
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, atol=BF16_ATOL, rtol=0)


def _run_grad(name, shape, option):
    q, k, v, kw = _case(shape, option, seed=11 + _seed(shape, option))
    interpret = _backend_or_skip(name, q, k, v, kw, need_grad=True)
    dout = np.random.default_rng(5).standard_normal(q.shape[:3] + (v.shape[3],)).astype(np.float32)

    def loss(q, k, v):
        return jnp.sum(_attention(q, k, v, **kw, backend=name, interpret=interpret) * dout)

    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    for label, g, ref in zip("qkv", grads, oracle_grads(q, k, v, dout, **kw)):
        g = np.asarray(g)
        assert np.isfinite(g).all(), f"d{label} has non-finite entries"
        err = np.abs(g - ref).max() / max(np.abs(ref).max(), 1e-6)
        assert err <= GRAD_RTOL, f"d{label}: relative error {err:.2e} > {GRAD_RTOL}"
    empty = _empty_rows(q, k, kw)
    np.testing.assert_array_equal(np.asarray(grads[0])[empty], 0)


def _run_zero_rows(name, shape="", option=""):
    """Rows masked by a dense mask and a batch row with no keys: zeros, zero finite grads."""
    B, T, N, H = 2, 16, 2, 8
    q, k, v = random_qkv(np.random.default_rng(3), B, T, T, N, N, H)
    mask = np.ones((B, 1, T, T), bool)
    mask[0, :, 3, :] = False
    kw = dict(mask=mask, key_value_seq_lengths=np.array([T, 0], np.int32))
    b = registry.get(name)
    if "mask" not in b.features and "seq_lengths" in b.features:
        kw.pop("mask")
    interpret = _backend_or_skip(name, q, k, v, kw, need_grad=True)
    f = lambda q, k, v: _attention(q, k, v, **kw, backend=name, interpret=interpret)  # noqa: E731
    out = np.asarray(f(q, k, v))
    if "mask" in kw:
        np.testing.assert_array_equal(out[0, 3], 0)
    np.testing.assert_array_equal(out[1], 0)
    grads = jax.grad(lambda *a: (f(*a) ** 2).sum() + f(*a).sum(), argnums=(0, 1, 2))(q, k, v)
    for g in grads:
        assert np.isfinite(np.asarray(g)).all()
        np.testing.assert_array_equal(np.asarray(g)[1], 0)


_RUNNERS = {"fwd": _run_fwd, "bf16": _run_bf16, "grad": _run_grad, "zero_rows": _run_zero_rows}


def run_case(kind: str, name: str, shape: str = "", option: str = "") -> None:
    """Run one case; raises :class:`Skip` if excluded, ``AssertionError`` if it fails."""
    if kind not in _RUNNERS:
        raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")
    _RUNNERS[kind](name, shape, option)


@dataclasses.dataclass
class CheckReport:
    """Outcome of :func:`check_backend`: counts, the failures (case, message) and the time."""

    backend: str
    passed: int = 0
    skipped: int = 0
    failures: list = dataclasses.field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failures and self.passed > 0

    def __str__(self) -> str:
        s = (f"{self.backend}: {self.passed} passed, {self.skipped} skipped (excluded by its "
             f"declaration), {len(self.failures)} failed")
        for case, msg in self.failures[:5]:
            s += f"\n  FAIL {case}: {msg.splitlines()[0] if msg else ''}"
        return s


def check_backend(name: str, kinds=KINDS, options=None, shapes=None) -> CheckReport:
    """Run the conformance cases of ``kinds`` on backend ``name``; never raises on failure.

    ``options``/``shapes`` restrict the cases (e.g. a quick check in a notebook).
    """
    report = CheckReport(name)
    t0 = time.perf_counter()
    for kind in kinds:
        for b, shape, option in cases(kind, [name]):
            if kind != "zero_rows" and ((options and option not in options)
                                        or (shapes and shape not in shapes)):
                continue
            label = f"{kind}-{shape}-{option}" if shape else kind
            try:
                run_case(kind, b, shape, option)
                report.passed += 1
            except Skip:
                report.skipped += 1
            except AssertionError as e:
                report.failures.append((label, str(e).strip()))
    report.seconds = time.perf_counter() - t0
    return report
