"""The EAGLE-3 drafter as SGLang's ``LlamaForCausalLMEagle3`` runs it: its dims, modules, init and export.

One step of the drafter (SGLang's python/sglang/srt/models/llama_eagle3.py; SpecForge's
specforge/modeling/draft/llama3_eagle.py and EAGLE's eagle/model/cnets.py compute the same):
    h      = fc(aux)                                     (step 0 only; later steps reuse their own output)
    x      = cat(input_layernorm(embed(token)), hidden_norm(h))
    h      = h + o_proj(attention(q/k/v_proj(x)))        (residual on the UN-normed feature, as SGLang)
    h      = h + mlp(post_attention_layernorm(h))        (SwiGLU)
    logits = lm_head(norm(h)); the pre-norm h is the next step's feature.
Module names are SGLang's weight names (``fc``, ``midlayer.*``, ``norm``, ``lm_head``), so the state dict
exports 1:1; ``embed_tokens`` is the target's, frozen, kept out of the optimizer and of the export.
The modules only hold those weights: the layer is written once, as the functional step of
eagle3.drafter.functional (attention_inputs, the TTT attention, step_outputs), which ``Eagle3Drafter.forward``
runs on them (step_weights). This file reads no files: the dims and the target's tensors come from
eagle3.target.tensors. Shape letters in the comments: eagle3.drafter.functional's legend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from eagle3.drafter.functional import (
    AttnImpl,
    Llama3RopeScaling,
    StepWeights,
    TTTCache,
    attention_inputs,
    rope_cos_sin,
    rope_inv_freq_on,
    step_outputs,
    ttt_attention,
    upcast,
)

SGLANG_WEIGHT_NAMES = (
    "fc.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "norm.weight",
    "lm_head.weight",
)
"""Weight names SGLang's EAGLE-3 loader matches (it silently skips any other name)."""


# ----------------------------------------------------------------------------------------------- dimensions


@dataclass(frozen=True)
class DrafterDims:
    """Every size the drafter needs; the target fixes all but the draft vocab (eagle3.target.tensors.drafter_dims)."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Llama3RopeScaling | None
    vocab_size: int
    draft_vocab_size: int
    num_aux: int
    target_hidden_size: int
    max_position_embeddings: int = 2048

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"{self.num_attention_heads} query heads are not a multiple of "
                f"{self.num_key_value_heads} key/value heads"
            )
        if self.intermediate_size <= 0 or self.head_dim % 2:
            raise ValueError(
                f"need intermediate_size > 0 and an even head_dim, got {self.intermediate_size}, "
                f"{self.head_dim} (MoE targets: pass a dense intermediate size)"
            )
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} must lie in [1, {self.vocab_size}]")


# ------------------------------------------------------------------------------------------------- modules


class RMSNorm(nn.Module):
    """The weight of one rms_norm (its eps is DrafterDims.rms_norm_eps)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))  # [H]


class Eagle3Attention(nn.Module):
    """q/k/v read the 2H-wide [embedding, feature] input; o_proj writes back to H."""

    def __init__(self, dims: DrafterDims) -> None:
        super().__init__()
        width = 2 * dims.hidden_size
        heads, kv_heads = dims.num_attention_heads * dims.head_dim, dims.num_key_value_heads * dims.head_dim
        self.q_proj = nn.Linear(width, heads, bias=False)  # [nH*hd, 2H]
        self.k_proj = nn.Linear(width, kv_heads, bias=False)  # [nKV*hd, 2H]
        self.v_proj = nn.Linear(width, kv_heads, bias=False)  # [nKV*hd, 2H]
        self.o_proj = nn.Linear(heads, dims.hidden_size, bias=False)  # [H, nH*hd]


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)  # [I, H]
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)  # [I, H]
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)  # [H, I]


class MidLayer(nn.Module):
    """The one decoder layer of EAGLE-3: attention over [norm(embedding), norm(feature)], then SwiGLU."""

    def __init__(self, dims: DrafterDims) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(dims.hidden_size)
        self.hidden_norm = RMSNorm(dims.hidden_size)
        self.self_attn = Eagle3Attention(dims)
        self.post_attention_layernorm = RMSNorm(dims.hidden_size)
        self.mlp = SwiGLU(dims.hidden_size, dims.intermediate_size)


class Eagle3Drafter(nn.Module):
    """fc + midlayer + norm + lm_head, with the target's frozen embeddings; ``forward`` is one TTT step."""

    def __init__(self, dims: DrafterDims) -> None:
        super().__init__()
        self.dims = dims
        self.embed_tokens = nn.Embedding(dims.vocab_size, dims.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)  # the target's own table, shared with it at serving time
        self.fc = nn.Linear(dims.num_aux * dims.target_hidden_size, dims.hidden_size, bias=False)
        self.midlayer = MidLayer(dims)
        self.norm = RMSNorm(dims.hidden_size)
        self.lm_head = nn.Linear(dims.hidden_size, dims.draft_vocab_size, bias=False)

    def project_aux(self, aux: Tensor) -> Tensor:
        """The step-0 feature: fc over the concatenated aux states, [B, T, A*Ht] -> [B, T, H]."""
        return self.fc(aux)

    def forward(
        self,
        hidden: Tensor,
        input_ids: Tensor,
        positions: Tensor,
        document_ids: Tensor,
        cache: TTTCache,
        attn_impl: AttnImpl = "auto",
    ) -> tuple[Tensor, Tensor]:
        """One TTT step: (pre-norm output [B, T, H], the next step's feature; draft logits [B, T, Vd]).

        Appends this step's keys and values to ``cache``; the attention covers every step cached so far.
        """
        d, w = self.dims, step_weights(self)
        inv_freq = rope_inv_freq_on(d.head_dim, d.rope_theta, d.rope_scaling, positions.device)
        cos, sin = rope_cos_sin(inv_freq, positions, upcast(hidden).dtype)  # [B, 1, T, hd]
        q, key, value = attention_inputs(
            w, input_ids, hidden, cos, sin, d.rms_norm_eps, d.num_attention_heads, d.num_key_value_heads
        )  # [B, nH, T, hd], [B, nKV, T, hd] x 2
        cache.keys.append(key)
        cache.values.append(value)
        attn = ttt_attention(q, cache.keys, cache.values, document_ids, attn_impl)  # [B, nH, T, hd]
        return step_outputs(w, hidden, attn, d.rms_norm_eps)


def step_weights(model: Eagle3Drafter, linear_dtype: torch.dtype | None = None) -> StepWeights:
    """The step's tensors; ``linear_dtype`` casts each linear weight once (per micro-batch).

    Under autocast that is what eager mode does too (its cast cache keeps one bf16 copy of each weight
    for the whole forward, and the TTT steps' gradients meet in that copy); a compiled step would
    otherwise re-cast 0.4B weights at every TTT step. Norm weights and embeddings are never cast.
    """
    layer, attn, mlp = model.midlayer, model.midlayer.self_attn, model.midlayer.mlp

    def linear(module: nn.Linear) -> Tensor:
        return module.weight if linear_dtype is None else module.weight.to(linear_dtype)

    return StepWeights(
        model.embed_tokens.weight,
        layer.input_layernorm.weight,
        layer.hidden_norm.weight,
        linear(attn.q_proj),
        linear(attn.k_proj),
        linear(attn.v_proj),
        linear(attn.o_proj),
        layer.post_attention_layernorm.weight,
        linear(mlp.gate_proj),
        linear(mlp.up_proj),
        linear(mlp.down_proj),
        model.norm.weight,
        linear(model.lm_head),
    )


# ---------------------------------------------------------------------------------------------- init, export


def init_weights(model: Eagle3Drafter, std: float = 0.02, seed: int = 0) -> None:
    """N(0, std) for every Linear (HF Llama's init), ones for the norms; embeddings untouched.

    Numbers are drawn on CPU from a seeded generator, so the init is the same on every device.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear):
                module.weight.copy_(torch.randn(module.weight.shape, generator=gen) * std)
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """What the optimizer gets: every parameter but the frozen embeddings."""
    return [p for p in model.parameters() if p.requires_grad]


def export_state_dict(model: Eagle3Drafter) -> dict[str, Tensor]:
    """The SGLang weights (names in SGLANG_WEIGHT_NAMES); embeddings are the target's and stay out."""
    return {k: v for k, v in model.state_dict().items() if not k.startswith("embed_tokens.")}
