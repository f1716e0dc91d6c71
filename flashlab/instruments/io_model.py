"""The FlashAttention paper's IO model, and where standard and flash attention sit on a roofline.

* :func:`analytic_hbm_bytes`: the paper's IO analysis (Dao et al. 2022, arXiv 2205.14135,
  Theorem 2 and Algorithms 0, 1, 3, 4). Standard attention writes and reads the N×N matrices S
  and P; FlashAttention reads K and V once and Q, O once per outer step: Θ(N² d² / M) with M
  the SRAM size in elements. :func:`paper_gpt2_table` checks it against the paper's Table 1.
* :func:`forward_closed_form_bytes`: the same count for flashlab's TPU forward grid, in closed
  form (:mod:`flashlab.instruments.traffic` replays the kernel's BlockSpecs instead).
* :func:`algorithm_points`, :func:`measured_points`: those bytes and FLOPs placed on a chip's
  roofline (:mod:`flashlab.instruments.roofline`).
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

import numpy as np

from flashlab.instruments import roofline, traffic
from flashlab.ladder.reference import naive_hbm_bytes

__all__ = ["flash_block_sizes", "analytic_hbm_bytes", "attention_flops", "paper_gpt2_table",
           "PAPER_GPT2_MEDIUM", "forward_closed_form_bytes", "algorithm_points",
           "measured_points"]



def flash_block_sizes(sram_bytes: int, head_dim: int, bytes_per_element: int) -> tuple[int, int]:
    """Algorithm 1's block sizes ``(B_r, B_c)`` for an SRAM of ``sram_bytes``.

    The paper states SRAM size M in *elements*: ``M = sram_bytes // bytes_per_element``.
    ``B_c = ceil(M / 4d)`` so that K_j, V_j (B_c×d each) and Q_i, O_i (B_r×d each, B_r ≤ B_c)
    fit together; ``B_r = min(B_c, d)``.
    """
    for name, v in (("sram_bytes", sram_bytes), ("head_dim", head_dim),
                    ("bytes_per_element", bytes_per_element)):
        if not isinstance(v, (int, np.integer)) or v <= 0:
            raise ValueError(f"{name}: expected a positive int, got {v!r}")
    M = sram_bytes // bytes_per_element
    B_c = -(-M // (4 * head_dim))
    B_r = min(B_c, head_dim)
    return B_r, B_c


def analytic_hbm_bytes(algorithm: str, *, batch: int, heads: int, seq_len: int, head_dim: int,
                       bytes_per_element: int, sram_bytes: int | None = None,
                       backward: bool = False, masked: bool = False, dropout: bool = False,
                       stat_bytes: int = 4) -> dict[str, int]:
    """HBM bytes read + written by attention, as the FlashAttention paper counts them.

    Per (batch, head), with ``N = seq_len``, ``d = head_dim``, ``e = bytes_per_element``
    (Q, K, V, O, dO, dQ, dK, dV and, for standard attention, S and P are stored in the input
    dtype, as in the paper's fp16 experiments):

    ``algorithm="standard"`` (Algorithm 0 forward, Algorithm 3 backward). Every step is its
    own kernel that reads its inputs from HBM and writes its output back:

    * forward: ``S = QKᵀ`` (read Q, K; write S), ``P = softmax(S)`` (read S, write P),
      ``O = PV`` (read P, V; write O) — :func:`flashlab.ladder.reference.naive_hbm_bytes`.
      ``masked=True`` adds a separate masking pass (read S, write S: 2·N²) before the softmax,
      ``dropout=True`` a dropout pass on P (read P, write P: 2·N²). With both off, scaling and
      masking are assumed fused into the softmax pass.
    * backward: ``dV = Pᵀ dO`` (read P, dO; write dV), ``dP = dO Vᵀ`` (read dO, V; write dP),
      ``dS = P ∘ (dP − D)`` (read P, dP; write dS), ``dQ = dS K`` (read dS, K; write dQ),
      ``dK = dSᵀ Q`` (read dS, Q; write dK): 7·N² + 8·N·d elements (Algorithm 3 forms
      ``D_i = Σ_l P_il dP_il`` inside the dS pass). ``dropout`` adds its backward pass on dP
      (2·N²),
      ``masked`` one on dS (2·N²). The stored P is read back; nothing is recomputed.

    ``algorithm="flash"`` (Algorithm 1 forward, Algorithm 4 backward), with SRAM
    ``sram_bytes`` giving ``M = sram_bytes // e`` elements and block sizes
    ``B_c = ceil(M / 4d)``, ``B_r = min(B_c, d)`` (:func:`flash_block_sizes`),
    ``T_c = ceil(N / B_c)`` outer steps:

    * forward: initialise O, ℓ, m in HBM (write N·d + 2·N); read every K_j, V_j once (2·N·d);
      per outer step read all Q_i, O_i, ℓ_i, m_i and write O_i, ℓ_i, m_i back
      (3·N·d + 4·N per outer step).
    * backward: initialise dQ (write N·d); read K_j, V_j and write dK_j, dV_j once (4·N·d);
      per outer step read Q_i, O_i, dO_i, dQ_i, ℓ_i, m_i and write dQ_i (5·N·d + 2·N).
    * ℓ and m are ``stat_bytes`` (fp32) each; the dropout mask is regenerated from the RNG
      state and never stored; masking happens in SRAM. ``masked``/``dropout`` cost no bytes.

    Returns bytes per term plus ``"forward"``, ``"backward"`` (0 unless ``backward``) and
    ``"total"``.
    """
    for name, v in (("batch", batch), ("heads", heads), ("seq_len", seq_len),
                    ("head_dim", head_dim), ("bytes_per_element", bytes_per_element),
                    ("stat_bytes", stat_bytes)):
        if not isinstance(v, (int, np.integer)) or v <= 0:
            raise ValueError(f"{name}: expected a positive int, got {v!r}")
    bh, N, d, e = batch * heads, seq_len, head_dim, bytes_per_element
    out: dict[str, int] = {}
    if algorithm == "standard":
        nv = naive_hbm_bytes(batch=batch, heads=heads, q_len=N, kv_len=N, head_dim=d,
                             bytes_per_element=e, score_bytes=e)
        out["fwd_q_k_v_o"] = nv["q_k_v_o"]
        out["fwd_scores"] = nv["scores"]                       # S write/read, P write/read
        out["fwd_mask_pass"] = bh * 2 * N * N * e if masked else 0
        out["fwd_dropout_pass"] = bh * 2 * N * N * e if dropout else 0
        fwd = sum(out.values())
        bwd = 0
        if backward:
            out["bwd_matrices"] = bh * 7 * N * N * e               # P, dP, dS traffic
            out["bwd_vectors"] = bh * 8 * N * d * e                # dO×2 V K Q reads, dV dQ dK writes
            out["bwd_mask_pass"] = bh * 2 * N * N * e if masked else 0
            out["bwd_dropout_pass"] = bh * 2 * N * N * e if dropout else 0
            bwd = sum(out.values()) - fwd
    elif algorithm == "flash":
        if sram_bytes is None:
            raise ValueError("sram_bytes: flash attention's traffic depends on the SRAM size; "
                             "got None, expected bytes (e.g. 192 * 1024 for an A100 SM)")
        B_r, B_c = flash_block_sizes(sram_bytes, d, e)
        T_c = -(-N // B_c)
        s = stat_bytes
        out["fwd_init"] = bh * (N * d * e + 2 * N * s)
        out["fwd_k_v"] = bh * 2 * N * d * e
        out["fwd_q_o_per_outer_step"] = bh * T_c * (3 * N * d * e + 4 * N * s)
        fwd = sum(out.values())
        bwd = 0
        if backward:
            out["bwd_init"] = bh * N * d * e
            out["bwd_k_v_dk_dv"] = bh * 4 * N * d * e
            out["bwd_per_outer_step"] = bh * T_c * (5 * N * d * e + 2 * N * s)
            bwd = sum(out.values()) - fwd
        out["block_q"], out["block_k"] = B_r, B_c      # the B_r, B_c the model used
    else:
        raise ValueError(f"algorithm: expected 'standard' or 'flash', got {algorithm!r}")
    out["forward"], out["backward"], out["total"] = fwd, bwd, fwd + bwd
    return out


def attention_flops(algorithm: str, *, batch: int, heads: int, seq_len: int, head_dim: int,
                    backward: bool = False, kv_seq_len: int | None = None,
                    causal_fraction: float = 1.0) -> int:
    """Matmul FLOPs (2 per multiply-add) of attention.

    Forward: ``QKᵀ`` and ``PV``, ``4·N·N_k·d``. Backward: standard attention does 4 matmuls
    (dV, dP, dQ, dK: ``8·N·N_k·d``); flash attention recomputes S first (``10·N·N_k·d``).
    ``causal_fraction`` scales the work for kernels that skip masked blocks (≈ 0.5 causal).
    """
    if algorithm not in ("standard", "flash"):
        raise ValueError(f"algorithm: expected 'standard' or 'flash', got {algorithm!r}")
    nk = seq_len if kv_seq_len is None else kv_seq_len
    unit = batch * heads * seq_len * nk * head_dim * causal_fraction
    f = 4 * unit
    if backward:
        f += (8 if algorithm == "standard" else 10) * unit
    return int(f)


# Fig. 2 (left) of arXiv 2205.14135: GPT-2 medium attention, forward + backward, A100.
PAPER_GPT2_MEDIUM = {
    "batch": 64, "heads": 16, "seq_len": 1024, "head_dim": 64, "bytes_per_element": 2,
    "sram_bytes": 192 * 1024,       # A100: 192 KB of SRAM per SM (paper, Section 2.1)
    "chip": "A100",
    "paper": {"standard": {"hbm_gb": 40.3, "gflops": 66.6, "runtime_ms": 41.7},
              "flash": {"hbm_gb": 4.4, "gflops": 75.2, "runtime_ms": 7.3}},
}


def paper_gpt2_table(*, masked: bool = True, dropout: bool = True,
                     hbm_bytes_per_s: float | None = None) -> list[dict[str, Any]]:
    """The paper's GPT-2 medium numbers beside this model's, one row per algorithm.

    GPT-2 training applies a causal mask and dropout, so by default the standard-attention
    model counts a masking and a dropout pass (forward and backward). Each row has
    ``algorithm``, ``paper_hbm_gb``, ``model_hbm_gb``, ``model_over_paper``,
    ``paper_runtime_ms``, ``model_hbm_time_ms`` (model bytes / A100 HBM bandwidth: the
    memory-bound time; the paper's measured runtime is larger because kernels also launch,
    compute and do not reach peak bandwidth) and ``model_gflops`` (matmul FLOPs,
    :func:`attention_flops`).
    """
    p = PAPER_GPT2_MEDIUM
    if hbm_bytes_per_s is None:
        hbm_bytes_per_s = roofline.chip(p["chip"]).hbm_bytes_per_s
    size = {k: p[k] for k in ("batch", "heads", "seq_len", "head_dim")}
    rows = []
    for alg in ("standard", "flash"):
        m = analytic_hbm_bytes(alg, **size, bytes_per_element=p["bytes_per_element"],
                               sram_bytes=p["sram_bytes"], backward=True, masked=masked,
                               dropout=dropout)
        gb = m["total"] / 1e9
        rows.append({
            "algorithm": alg,
            "paper_hbm_gb": p["paper"][alg]["hbm_gb"],
            "model_hbm_gb": round(gb, 2),
            "model_over_paper": round(gb / p["paper"][alg]["hbm_gb"], 2),
            "paper_runtime_ms": p["paper"][alg]["runtime_ms"],
            "model_hbm_time_ms": round(m["total"] / hbm_bytes_per_s * 1e3, 1),
            "model_gflops": round(attention_flops(alg, **size, backward=True) / 1e9, 1),
        })
    return rows


def forward_closed_form_bytes(*, batch: int, heads: int, seq_len: int, head_dim: int,
                              dtype, block_q: int, kv_seq_len: int | None = None) -> int:
    """Q, K, V, O bytes of a non-causal forward with grid ``(b, h, i, j)``.

    Per (batch, head): Q read once (N·d), O written once (N·d), K and V each read once per
    query block (``N/block_q`` times): ``(2 + 2·N/block_q)·N·d·bytes`` for ``N_k = N``.
    """
    e = np.dtype(traffic._np_dtype(dtype)).itemsize
    nk = seq_len if kv_seq_len is None else kv_seq_len
    nq_blocks = -(-seq_len // block_q)
    return batch * heads * (2 * seq_len * head_dim + 2 * nq_blocks * nk * head_dim) * e


def algorithm_points(chip_: roofline.Chip | str, *, batch: int, heads: int, seq_len: int,
                     head_dim: int, dtype="bfloat16", backward: bool = False,
                     block_q: int | None = None, is_causal: bool = False
                     ) -> dict[str, dict[str, float]]:
    """Standard and flash attention placed on ``chip_``'s roofline.

    Standard attention: the paper's model (:func:`flashlab.instruments.analytic_hbm_bytes`).
    Flash attention on a TPU: the forward kernel's schedule ``(2 + 2N/block_q)·N·d`` bytes
    (``block_q`` default: 512 capped at N), or on a GPU the paper's model with the chip's
    SRAM. Causal halves the FLOPs (and the flash K/V traffic). Returns per algorithm
    ``{"flops", "bytes", "intensity", "seconds", "bound", "flops_per_s"}`` where
    ``flops_per_s`` is the attainable rate ``flops / seconds``.
    """
    import jax.numpy as jnp
    c = roofline.chip(chip_) if isinstance(chip_, str) else chip_
    e = jnp.dtype(dtype).itemsize
    size = dict(batch=batch, heads=heads, seq_len=seq_len, head_dim=head_dim)
    frac = 0.5 if is_causal else 1.0
    out = {}
    std = analytic_hbm_bytes("standard", **size, bytes_per_element=e,
                                     backward=backward, masked=is_causal)["total"]
    if c.kind == "tpu" and not backward:
        bq = min(block_q or 512, seq_len)
        nqb = -(-seq_len // bq)
        fl = batch * heads * (2 * seq_len * head_dim + 2 * nqb * seq_len * head_dim * frac) * e
    else:
        fl = analytic_hbm_bytes("flash", **size, bytes_per_element=e,
                                        sram_bytes=min(c.vmem_bytes, 16 * 2**20),
                                        backward=backward)["total"]
    for alg, b in (("standard", std), ("flash", fl)):
        f = attention_flops(alg, **size, backward=backward,
                                    causal_fraction=frac if alg == "flash" else 1.0)
        tb = roofline.time_bound(f, b, c, dtype=dtype)
        out[alg] = {"flops": float(f), "bytes": float(b), "intensity": tb["intensity"],
                    "seconds": tb["seconds"], "bound": tb["bound"],
                    "flops_per_s": f / tb["seconds"]}
    return out


def measured_points(rows: Iterable[Mapping[str, Any]], *, batch: int | None = None,
                    heads: int | None = None) -> list[dict[str, Any]]:
    """Place bench CLI rows (``python -m flashlab bench --json``) on the roofline.

    Each row needs ``backend, seq_len, head_dim, dtype, causal, seconds, flops_per_s``;
    rows may carry ``batch``/``heads`` (else the arguments). Returns rows with the measured
    ``flops_per_s`` and an ``intensity`` computed from the forward flash schedule's bytes
    for tiled/kernel backends and from the standard model for the rest. Rows missing a key
    are skipped.
    """
    import jax.numpy as jnp
    need = ("backend", "seq_len", "head_dim", "dtype", "seconds", "flops_per_s")
    out = []
    for r in rows:
        if any(k not in r for k in need):
            continue
        B = int(r.get("batch", batch or 1))
        H = int(r.get("heads", heads or 1))
        N, d = int(r["seq_len"]), int(r["head_dim"])
        e = jnp.dtype(r["dtype"]).itemsize
        flops = float(r["flops_per_s"]) * float(r["seconds"])
        if any(s in str(r["backend"]) for s in ("pallas", "flash", "splash", "tiled")):
            byt = forward_closed_form_bytes(batch=B, heads=H, seq_len=N, head_dim=d,
                                                    dtype=r["dtype"],
                                                    block_q=int(r.get("block_q", min(512, N))))
        else:
            byt = analytic_hbm_bytes("standard", batch=B, heads=H, seq_len=N,
                                             head_dim=d, bytes_per_element=e)["total"]
        out.append({**dict(r), "intensity": flops / byt, "bytes": byt})
    return out
