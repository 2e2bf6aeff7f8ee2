"""One matrix product where a decoder layer's MLP runs two on the same input: gate and up.

A batch-1 decode of a small target is bound by launching kernels, not by arithmetic: each of a layer's small
products is a kernel of a few microseconds, whatever its width (on an H200, SmolLM2-135M's forward takes 1.6 ms
for one row and 2.3 ms for sixteen). Fusing gate and up takes one kernel off every layer of every decode forward.
SGLang's Llama layers are built the same way (MergedColumnParallelLinear). Greedy and every verify run the same
fused forward, so the lossless check is unaffected; the logits differ from the unfused model's by rounding only.

The MLP module is swapped for one that computes the same function with a stateless forward. q/k/v are left
separate: the attention's own forward calls the three projections in turn, and fusing them would mean keeping
the product between those calls as module state, which torch.compile turns into extra graph outputs and guards
(an attempt at it fell back to eager kernels under CUDA graphs on an H200).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

GATE_UP_MLPS = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP", "DeepseekV3MLP"})
"""MLP classes whose forward is down(act(gate(x)) * up(x)), which FusedGateUpMLP computes (others stay as they are)."""


class FusedGateUpMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up as one product."""

    def __init__(self, mlp: Any) -> None:
        super().__init__()
        gate, up = mlp.gate_proj, mlp.up_proj
        self.gate_up_weight = nn.Parameter(
            torch.cat([gate.weight.detach(), up.weight.detach()]), requires_grad=False
        )  # [2I, H]
        self.gate_up_bias = (
            None
            if gate.bias is None
            else nn.Parameter(torch.cat([gate.bias.detach(), up.bias.detach()]), requires_grad=False)
        )  # [2I]
        self.down_proj, self.act_fn = mlp.down_proj, mlp.act_fn

    def forward(self, x: Tensor) -> Tensor:
        gate, up = F.linear(x, self.gate_up_weight, self.gate_up_bias).chunk(2, dim=-1)  # [..., I] each
        return self.down_proj(self.act_fn(gate) * up)


def _fusable(mlp: Any) -> bool:
    """A known gate/up MLP whose gate and up are plain Linears of one shape, both with or both without bias."""
    if type(mlp).__name__ not in GATE_UP_MLPS:
        return False
    gate, up = mlp.gate_proj, mlp.up_proj
    return (
        type(gate) is nn.Linear
        and type(up) is nn.Linear
        and gate.weight.shape == up.weight.shape
        and (gate.bias is None) == (up.bias is None)
    )


def fuse_projections(model: Any) -> int:
    """Fuse the gate/up products of every decoder layer's MLP of ``model`` in place where the MLP is a known
    gate/up form (MoE experts, for one, stay as they are); returns how many MLPs were fused."""
    fused = 0
    for layer in getattr(getattr(model, "model", None), "layers", []):
        if _fusable(getattr(layer, "mlp", None)):
            layer.mlp = FusedGateUpMLP(layer.mlp)
            fused += 1
    return fused
