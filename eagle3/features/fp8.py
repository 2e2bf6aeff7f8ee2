"""Per-token fp8 (e4m3) storage of aux hidden states: half the bytes of bf16 for the largest tensor.

Each token row gets its own fp32 scale ``amax(|row|) / 448`` (448 = largest finite e4m3 value),
so a row's largest entry lands exactly on the top of the fp8 range and outlier tokens (the
attention-sink token often has 100x larger activations) do not crush the precision of the others.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, D] float -> ([T, D] e4m3, [T] fp32 scale) with x ~= q * scale[:, None]."""
    x32 = x.float()
    scale = x32.abs().amax(dim=-1) / FP8_MAX  # [T]
    # An all-zero row has scale 0; divide by 1 there so it quantizes to zeros instead of NaN.
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (x32 / safe[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)  # [T, D]
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """([T, D] e4m3, [T] fp32) -> [T, D] in ``dtype``."""
    return (q.float() * scale.float()[:, None]).to(dtype)


def fp8_error(aux: torch.Tensor) -> dict[str, float]:
    """Reconstruction error of the fp8 round trip (as stored, then read back as bf16) of [T, D] states.

    max_abs: largest absolute error; rel_rms: ||x - x_hat|| / ||x|| over the whole tensor.
    """
    x = aux.float()
    q, scale = quantize_fp8(x)
    err = dequantize_fp8(q, scale, torch.bfloat16).float() - x
    norm = x.norm().item()
    return {
        "max_abs": err.abs().max().item() if err.numel() else 0.0,
        "rel_rms": err.norm().item() / norm if norm > 0 else 0.0,
    }
