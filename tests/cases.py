"""Mask-option cases shared by every rung's tests: one place lists what 'every mask option' is."""
import numpy as np


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
    if option == "everything":
        return {"is_causal": True, "local_window_size": (6, 2),
                "key_value_seq_lengths": rng.integers(1, S + 1, size=B).astype(np.int32),
                "mask": rng.random((B, N, T, S)) < 0.8,
                "bias": rng.standard_normal((1, N, T, S)).astype(np.float32),
                "logits_soft_cap": 2.0}
    raise KeyError(option)


MASK_OPTIONS = ("none", "causal", "window_int", "window_pair", "causal_window", "seq_lengths",
                "kv_lengths_zero", "segments", "segments_pair", "dense_mask",
                "dense_mask_per_head", "bias", "bias_broadcast", "soft_cap", "everything")
