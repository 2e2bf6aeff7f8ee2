"""What the drafter takes from the target's files: its sizes and RoPE (config.json), its embeddings and lm_head.

The drafter (eagle3.drafter.model) reads no files: its dims and frozen tensors are built here and handed to it,
so the model file holds only the layer math. Tensors come through ``read_tensor`` (one tensor, or a row range,
from sharded safetensors without loading the model).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from eagle3.drafter.functional import Llama3RopeScaling
from eagle3.drafter.model import DrafterDims, Eagle3Drafter
from eagle3.target.load import EMBED_TENSOR, TargetInfo, lm_head_name, read_model_config, read_tensor, target_info


def rope_settings(cfg: dict[str, Any], plain_if_unsupported: bool = False) -> tuple[float, Llama3RopeScaling | None]:
    """(theta, llama3 scaling or None) from a transformers 4 (rope_scaling) or 5 (rope_parameters) config; a
    RoPE type other than default/llama3 raises, or with ``plain_if_unsupported`` gives (theta, None)."""
    params: dict[str, Any] = cfg.get("rope_parameters") or {}
    scaling: dict[str, Any] = cfg.get("rope_scaling") or params
    theta = float(cfg.get("rope_theta") or params.get("rope_theta") or 10000.0)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        if plain_if_unsupported:
            return theta, None
        raise ValueError(f"RoPE type {rope_type!r} is not supported by the drafter (only default and llama3)")
    original = scaling.get("original_max_position_embeddings", cfg.get("max_position_embeddings"))
    if original is None:  # a missing field, as for the other keys (dims_from_llama_fields names it)
        raise KeyError("original_max_position_embeddings")
    return theta, Llama3RopeScaling(
        float(scaling["factor"]), float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"]), int(original)
    )


def drafter_dims(info: TargetInfo, model_dir: Path | str, draft_vocab_size: int) -> DrafterDims:
    """Dims of a drafter for this target: its widths, heads, norm eps and RoPE; the draft vocab clipped to V.

    MLA/MoE targets (DeepSeek-V3, Kimi-K2) get a Llama layer as SGLang's LlamaForCausalLMEagle3 runs it:
    the target's query and key/value head counts, head_dim = v_head_dim (TargetInfo), intermediate_size
    = the target's dense MLP width (SpecForge's Kimi-K2 drafter config has the same numbers). The drafter's
    positions are its own (trained, exported and served with the RoPE in its config): a target RoPE it does
    not implement (DeepSeek-V3/Kimi-K2's YaRN) gives it plain RoPE at the target's theta, as SpecForge's too.
    """
    cfg = read_model_config(model_dir)
    theta, scaling = rope_settings(cfg, plain_if_unsupported=True)
    return DrafterDims(
        hidden_size=info.hidden_size,
        num_attention_heads=info.num_attention_heads,
        num_key_value_heads=info.num_key_value_heads,
        head_dim=info.head_dim,
        intermediate_size=info.intermediate_size,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        vocab_size=info.vocab_size,
        draft_vocab_size=min(draft_vocab_size, info.vocab_size),
        num_aux=len(info.aux_layer_ids),
        target_hidden_size=info.hidden_size,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
    )


def read_rows(model_dir: Path | str, name: str, ids: Tensor, chunk_rows: int = 16384) -> Tensor:
    """Rows ``ids`` (ascending) of a [V, H] target tensor, reading ``chunk_rows`` rows at a time."""
    parts = []
    for start in range(0, int(ids.max()) + 1, chunk_rows):
        wanted = ids[(ids >= start) & (ids < start + chunk_rows)] - start
        if len(wanted):
            parts.append(read_tensor(Path(model_dir), name, rows=slice(start, start + chunk_rows))[wanted])
    return torch.cat(parts)  # [len(ids), H]


def _copy_checked(dst: Tensor, src: Tensor, what: str) -> None:
    if tuple(src.shape) != tuple(dst.shape):
        raise ValueError(f"{what}: target tensor has shape {list(src.shape)}, the drafter expects {list(dst.shape)}")
    dst.copy_(src)


def load_target_weights(
    model: Eagle3Drafter, model_dir: Path | str, t2d: Tensor, init_lm_head_from_target: bool, chunk_rows: int = 16384
) -> None:
    """Copy the target's embeddings; optionally start lm_head from the target lm_head rows of the draft vocab."""
    with torch.no_grad():
        _copy_checked(model.embed_tokens.weight, read_tensor(Path(model_dir), EMBED_TENSOR), EMBED_TENSOR)
        if init_lm_head_from_target:
            name = lm_head_name(target_info(Path(model_dir)))
            used = t2d.nonzero().squeeze(1)  # [Vd] target ids of the draft vocab, ascending = draft order
            _copy_checked(model.lm_head.weight, read_rows(model_dir, name, used, chunk_rows), name)


def load_target_lm_head(model_dir: Path | str) -> Tensor:
    """The target's full output projection [V, Ht] (the embeddings when the target ties them)."""
    return read_tensor(Path(model_dir), lm_head_name(target_info(Path(model_dir))))
