"""A DFlash drafter started from the target's own layers (``drafter.dflash.init: target``).

A drafter from random weights must first learn to route attention: to the anchor inside its block and to the newest
context states, which EAGLE-3 is handed as its input; on a small budget it may never get there (docs/dflash.md).
The target's layers already attend by content and position. Draft layer j starts as the target's layer
``first + j``, where ``first`` is the layer right after the deepest one the drafter reads, so that the context a
draft layer attends to is, at the start, what that target layer reads:

    fc           the identity on the deepest read layer's slice (zeros elsewhere): ctx = h_deep
    hidden_norm  layer first's input_layernorm (the context keys/values skip input_layernorm: it stands in)
    layer j      layer first + j: input/post-attention norms, q/k/v/o, gate/up/down, q_norm/k_norm where the
                 target has them (Qwen3-style); otherwise the drafter's per-head q/k norms stay ones
    norm         the target's final norm (the drafter's output goes through the target's lm_head)

Only the starting point changes; the layout SGLang serves, the loss and the export are the same.
"""

from __future__ import annotations

from pathlib import Path

import torch

from eagle3.drafter.dflash import DFlashDrafter
from eagle3.target.load import read_tensor

LAYER_TENSORS = (
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)
"""The tensors every target decoder layer has, under the same names in a draft layer."""
QK_NORMS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")
"""Copied when the target has them (Qwen3); a Llama target has none."""


def first_copied_layer(target_layer_ids: list[int], num_target_layers: int, num_draft_layers: int) -> int:
    """The target layer the first draft layer copies: the one after the deepest read layer, moved down so that
    every draft layer has a target layer to copy."""
    if num_draft_layers > num_target_layers:
        raise ValueError(
            f"drafter.dflash.init=target copies one target layer per draft layer: {num_draft_layers} draft layers, "
            f"the target has {num_target_layers}"
        )
    return min(max(target_layer_ids) + 1, num_target_layers - num_draft_layers)


def _copy(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if tuple(tensor.shape) != tuple(param.shape):
        raise ValueError(f"target tensor {name} has shape {tuple(tensor.shape)}, the drafter's is {tuple(param.shape)}")
    param.copy_(tensor.to(param.dtype))


@torch.no_grad()
def init_from_target(
    drafter: DFlashDrafter, model_dir: Path, target_layer_ids: list[int], num_target_layers: int
) -> list[str]:
    """Overwrite the drafter's own weights as the module docstring says; returns the target tensors copied."""
    model_dir = Path(model_dir)
    d = drafter.dims
    first = first_copied_layer(target_layer_ids, num_target_layers, d.num_hidden_layers)
    copied = []
    params = dict(drafter.named_parameters())
    for j in range(d.num_hidden_layers):
        for suffix in LAYER_TENSORS:
            name = f"model.layers.{first + j}.{suffix}"
            _copy(params[f"layers.{j}.{suffix}"], read_tensor(model_dir, name), name)
            copied.append(name)
        for suffix in QK_NORMS:
            name = f"model.layers.{first + j}.{suffix}"
            try:
                tensor = read_tensor(model_dir, name)
            except KeyError:
                continue
            _copy(params[f"layers.{j}.{suffix}"], tensor, name)
            copied.append(name)
    h = d.hidden_size
    drafter.fc.weight.zero_()
    drafter.fc.weight[:, (d.num_context_features - 1) * h :] = torch.eye(h, dtype=drafter.fc.weight.dtype)
    name = f"model.layers.{first}.input_layernorm.weight"
    _copy(drafter.hidden_norm.weight, read_tensor(model_dir, name), name)
    _copy(drafter.norm.weight, read_tensor(model_dir, "model.norm.weight"), "model.norm.weight")
    return [*copied, name, "model.norm.weight"]
