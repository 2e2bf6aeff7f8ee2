"""One matrix product where a decoder layer runs several on the same input: q/k/v, and the MLP's gate/up.

A batch-1 decode of a small target is bound by launching kernels, not by arithmetic: each of a layer's small
products is a kernel of a few microseconds, whatever its width. Fusing q, k and v into one product and gate and up
into another takes three kernels off every layer of every decode forward. SGLang's Llama layers are built the same
way (QKVParallelLinear, MergedColumnParallelLinear). Greedy and every verify run the same fused forward, so the
lossless check is unaffected; the logits differ from the unfused model's by rounding only.

The model's modules are swapped in place, its own forward code unchanged: the attention still calls
``q_proj(x)``, ``k_proj(x)``, ``v_proj(x)`` in turn, so ``q_proj`` becomes the fused product and keeps the key
and value slices for the two calls after it (each checks it gets the same input, and computes its own slice of
the fused weight otherwise). The MLP's gate and up become one product split in two.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class FusedProjection(nn.Module):
    """Replaces the first of several projections of one input: one product, the others' slices kept for them."""

    def __init__(self, linears: list[nn.Linear]) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.cat([m.weight.detach() for m in linears]), requires_grad=False)
        biases = [m.bias for m in linears]
        self.bias = None if biases[0] is None else nn.Parameter(torch.cat([b.detach() for b in biases]),
                                                                requires_grad=False)
        self.sizes = [m.out_features for m in linears]
        self.in_features, self.out_features = linears[0].in_features, self.sizes[0]
        self._input: Tensor | None = None  # the input of the last fused product, and its other slices
        self._parts: list[Tensor] = []

    def forward(self, x: Tensor) -> Tensor:
        first, *rest = F.linear(x, self.weight, self.bias).split(self.sizes, dim=-1)
        self._input, self._parts = x, rest
        return first

    def part(self, x: Tensor, index: int) -> Tensor:
        """Projection ``index`` (1 = the second fused one) of ``x``: the kept slice when x is the fused input."""
        if self._input is x:
            return self._parts[index - 1]
        start = sum(self.sizes[:index])
        end = start + self.sizes[index]
        return F.linear(x, self.weight[start:end], None if self.bias is None else self.bias[start:end])


class ProjectionPart(nn.Module):
    """Replaces a later projection of a FusedProjection's input: returns its slice of the fused product."""

    def __init__(self, fused: FusedProjection, index: int) -> None:
        super().__init__()
        self._fused = (fused,)  # a tuple: not registered twice as a submodule (the weights stay counted once)
        self.index = index
        self.out_features = fused.sizes[index]

    def forward(self, x: Tensor) -> Tensor:
        return self._fused[0].part(x, self.index)


class FusedGateUpMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up as one product."""

    def __init__(self, mlp: Any) -> None:
        super().__init__()
        self.gate_up = FusedProjection([mlp.gate_proj, mlp.up_proj])
        self.down_proj, self.act_fn = mlp.down_proj, mlp.act_fn

    def forward(self, x: Tensor) -> Tensor:
        gate, up = F.linear(x, self.gate_up.weight, self.gate_up.bias).chunk(2, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


GATE_UP_MLPS = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP", "DeepseekV3MLP"})
"""MLP classes whose forward is down(act(gate(x)) * up(x)), which FusedGateUpMLP computes (others stay as they are)."""


def _plain_linears(*modules: Any) -> bool:
    """Plain nn.Linear of one input width, all with or all without bias."""
    return all(type(m) is nn.Linear for m in modules) and len({m.in_features for m in modules}) == 1 \
        and len({m.bias is None for m in modules}) == 1


def fuse_projections(model: Any) -> int:
    """Fuse every decoder layer's q/k/v and gate/up products of ``model`` in place, where they are plain Linears
    of one input (others, e.g. MLA attention or MoE experts, stay as they are); returns how many were fused."""
    fused = 0
    names = ("q_proj", "k_proj", "v_proj")
    for layer in getattr(getattr(model, "model", None), "layers", []):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is not None and all(hasattr(attn, n) for n in names) \
                and _plain_linears(*(getattr(attn, n) for n in names)):
            qkv = FusedProjection([getattr(attn, n) for n in names])
            attn.q_proj, attn.k_proj, attn.v_proj = qkv, ProjectionPart(qkv, 1), ProjectionPart(qkv, 2)
            fused += 1
        if type(mlp).__name__ in GATE_UP_MLPS and _plain_linears(mlp.gate_proj, mlp.up_proj):
            layer.mlp = FusedGateUpMLP(mlp)
            fused += 1
    return fused
