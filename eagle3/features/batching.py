"""Token-budget batching of a capture forward: the automatic budget (capture.tokens_per_forward=auto, from the
free GPU memory and an upper estimate of a token's activations) and the batches that fit it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

AUTO_CPU_TOKENS = 4096
"""capture.tokens_per_forward=auto on a CPU (compute-bound: bigger batches buy nothing)."""
AUTO_MAX_TOKENS = 65536
"""Upper bound of the auto budget on a GPU: past ~32K padded tokens a forward no longer gets faster per token."""
AUTO_MEMORY_SHARE = 0.5
"""Share of the free GPU memory the auto budget may plan for (the rest: allocator slack, host-copy overlap)."""


def activation_bytes_per_token(config: Any, num_outputs: int, dtype: torch.dtype) -> int:
    """Upper estimate of the device bytes one token of a capture forward holds at its peak.

    The residual stream and attention projections (~8 x H), the MLP's gate/up/act (3 x intermediate), and
    the kept outputs (num_outputs x H) in the model dtype; MoE layers are counted as one dense MLP of the
    widest of their intermediate sizes, which the estimate's margin covers.
    """
    hidden = config.hidden_size
    inter = max(
        getattr(config, "intermediate_size", 0) or 0, getattr(config, "moe_intermediate_size", 0) or 0, 4 * hidden
    )
    width = torch.finfo(dtype).bits // 8
    return width * (8 * hidden + 3 * inter + num_outputs * hidden)


def auto_tokens_per_forward(config: Any, num_outputs: int, dtype: torch.dtype, device: torch.device) -> int:
    """capture.tokens_per_forward=auto: a power of two that fits AUTO_MEMORY_SHARE of the free GPU memory."""
    device = torch.device(device)
    if device.type != "cuda":
        return AUTO_CPU_TOKENS
    free, _ = torch.cuda.mem_get_info(device)
    fit = int(free * AUTO_MEMORY_SHARE) // activation_bytes_per_token(config, num_outputs, dtype)
    if fit < 1:
        raise ValueError(
            f"capture.tokens_per_forward=auto: {free:,} bytes free on {device} hold no batch; "
            f"free the GPU or set capture.tokens_per_forward"
        )
    return min(AUTO_MAX_TOKENS, 1 << (fit.bit_length() - 1))


def plan_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Consecutive index groups whose padded size (count x longest) fits max_tokens; order kept."""
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i, n in enumerate(lengths):
        grown = max(longest, n)
        if current and (len(current) + 1) * grown > max_tokens:
            batches.append(current)
            current, grown = [], n
        current.append(i)
        longest = grown
    if current:
        batches.append(current)
    return batches
