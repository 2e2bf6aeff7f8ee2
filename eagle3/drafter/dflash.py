"""The DFlash drafter as SGLang's ``DFlashDraftModel`` runs it: a whole block of draft tokens in one forward.

A block is K tokens at positions p .. p+K-1: the anchor (the last token the target produced, whose own hidden
states do not exist yet) followed by K-1 copies of the mask token. The block attends, in every draft layer and
without a causal mask, to itself and to the target's context features of the tokens before the anchor
(positions < p). The output at block slot i >= 1, read through the TARGET's lm_head, is the draft for the token
AT position p+i; slot 0's output is never used. Sources (docs/dflash.md has the full manual):
SGLang python/sglang/srt/models/dflash.py (DFlashDraftModel, DFlashDecoderLayer, DFlashAttention),
srt/speculative/dflash_worker_v2.py (DFlashWorkerV2.forward_batch_generation: the block, the positions and the
head; _append_target_hidden_sequential: the context keys and values), and the reference implementation
z-lab/dflash dflash/model.py (DFlashDraftModel, Qwen3DFlashAttention, dflash_generate).

One draft layer (Qwen3-style, pre-norm):
    ctx    = hidden_norm(fc(cat of the target's states at target_layer_ids))   once per context token, all layers
    h      = input_layernorm(x)                                  x: the block's residual stream (its embeddings first)
    q      = rope(q_norm(q_proj(h)))                             per-head RMSNorm over hd, then RoPE
    keys   = [rope(k_norm(k_proj(ctx))) ; rope(k_norm(k_proj(h)))]    values = [v_proj(ctx) ; v_proj(h)]
    x      = x + o_proj(softmax(q keys^T / sqrt(hd), visible) values)   (no causal mask inside the block)
    x      = x + down(silu(gate(post_attention_layernorm(x))) * up(...))
    out    = norm(x) after the last layer; logits = target lm_head(out)
The context keys are NOT input-layernormed (SGLang's prepare_context_hidden_for_kv returns them as they are; the
reference's k_proj(target_hidden) likewise). Module names are the checkpoint's (``layers.i.self_attn.q_proj``,
``fc``, ``hidden_norm``, ``norm``), so the state dict exports 1:1; ``embed_tokens`` and ``lm_head`` are the
target's, frozen, kept out of the optimizer and of the export.

The layer is written once, as functions (``project_context``, ``context_kv``, ``block_forward``) over the weight
tuples of ``dflash_weights``: ``DFlashDrafter.forward`` runs them for one call, a decoder can cache ``context_kv``
per committed token as SGLang's draft KV cache does, and training runs ``block_forward`` over many blocks per row
with ``block_visibility`` (each block sees the context before its own anchor; eagle3/drafter/dflash_blocks.py lays
out the blocks). This file reads no files.

Shape letters used in the comments:
    B   rows                   C   context tokens (target states) per row      N   blocks per row
    K   block size             Q   block tokens per row (N * K)                 S   keys per row (C + Q)
    H   hidden size (= the target's)         F   context features (target layers; fc reads F * H)
    nH  query heads   nKV  key/value heads   hd  head dim   I  MLP width   L  draft layers   V  target vocab
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from eagle3.drafter.dflash_blocks import Visibility, block_input_ids, block_positions, block_visibility
from eagle3.drafter.functional import (
    Llama3RopeScaling,
    apply_rope,
    flex_attention_over,
    repeat_kv,
    rms_norm,
    rope_cos_sin,
    rope_inv_freq_on,
    upcast,
)
from eagle3.drafter.model import RMSNorm, SwiGLU

# ----------------------------------------------------------------------------------------------- dimensions


@dataclass(frozen=True)
class DFlashDims:
    """Every size a DFlash drafter needs (the target fixes H, the heads' layout is the drafter's own)."""

    hidden_size: int  # H: SGLang's fc maps F * hidden_size -> hidden_size and the block input is the target's embedding
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    num_hidden_layers: int  # L
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Llama3RopeScaling | None
    vocab_size: int  # V: the target's; the drafter has no head of its own
    num_context_features: int  # F = len(target_layer_ids)
    block_size: int  # K: the anchor + K-1 mask tokens; SGLang verifies K tokens per step
    mask_token_id: int
    max_position_embeddings: int = 2048

    def __post_init__(self) -> None:
        problems = []
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append(
                f"{self.num_attention_heads} query heads are not a multiple of "
                f"{self.num_key_value_heads} key/value heads"
            )
        if self.head_dim % 2 or self.intermediate_size <= 0:
            problems.append(
                f"need an even head_dim and intermediate_size > 0, got {self.head_dim}, {self.intermediate_size}"
            )
        if self.num_hidden_layers < 1 or self.num_context_features < 1:
            problems.append(
                f"need >= 1 layer and >= 1 context feature, got {self.num_hidden_layers}, {self.num_context_features}"
            )
        if self.block_size < 2:
            problems.append(f"block_size {self.block_size} drafts nothing (the anchor takes one slot)")
        if not 0 <= self.mask_token_id < self.vocab_size:
            problems.append(
                f"mask_token_id {self.mask_token_id} is outside the target vocab [0, {self.vocab_size}) "
                f"(SGLang cannot grow the target's embeddings for it)"
            )
        if problems:
            raise ValueError("; ".join(problems))


# ---------------------------------------------------------------------------------------- the functions


class LayerWeights(NamedTuple):
    """The tensors of one draft layer (linear weights possibly cast; see dflash_weights)."""

    input_norm: Tensor  # [H]
    q: Tensor  # [nH*hd, H]
    k: Tensor  # [nKV*hd, H]
    v: Tensor  # [nKV*hd, H]
    o: Tensor  # [H, nH*hd]
    q_norm: Tensor  # [hd]
    k_norm: Tensor  # [hd]
    post_norm: Tensor  # [H]
    gate: Tensor  # [I, H]
    up: Tensor  # [I, H]
    down: Tensor  # [H, I]


class DFlashWeights(NamedTuple):
    """The drafter's own tensors; the target's embeddings and lm_head are passed separately."""

    fc: Tensor  # [H, F*H]
    hidden_norm: Tensor  # [H]
    layers: tuple[LayerWeights, ...]  # L
    norm: Tensor  # [H]


def _linear(x: Tensor, weight: Tensor) -> Tensor:
    # The activation cast autocast makes, made explicit (a no-op when the dtypes agree).
    return F.linear(x.to(weight.dtype), weight)


def _heads(y: Tensor, n: int) -> Tensor:
    """[B, T, n*hd] -> [B, n, T, hd]."""
    batch, seq_len, _ = y.shape
    return y.view(batch, seq_len, n, -1).transpose(1, 2)


def project_context(w: DFlashWeights, features: Tensor, eps: float) -> Tensor:
    """[B, C, F*H] target states (features concatenated in ascending layer order) -> [B, C, H] context hidden.

    SGLang's DFlashDraftModel.project_target_hidden: hidden_norm(fc(x)). SGLang's target concatenates the captured
    layers in its layer-loop order, i.e. ascending ids, whatever order the config lists them in.
    """
    return rms_norm(_linear(features, w.fc), w.hidden_norm, eps)


def rotary(dims: DFlashDims, positions: Tensor, like: Tensor) -> tuple[Tensor, Tensor]:
    """cos, sin [B, 1, T, hd] for integer positions [B, T] (fp32 angles, fp64 for fp64 checks)."""
    inv_freq = rope_inv_freq_on(dims.head_dim, dims.rope_theta, dims.rope_scaling, positions.device)
    return rope_cos_sin(inv_freq, positions, upcast(like).dtype)


def _keys(lw: LayerWeights, x: Tensor, cos: Tensor, sin: Tensor, dims: DFlashDims) -> tuple[Tensor, Tensor]:
    """Post-RoPE keys and values [B, nKV, T, hd] of x [B, T, H] (k_norm per head before RoPE, as SGLang)."""
    k = rms_norm(_heads(_linear(x, lw.k), dims.num_key_value_heads), lw.k_norm, dims.rms_norm_eps)
    return apply_rope(k, cos, sin), _heads(_linear(x, lw.v), dims.num_key_value_heads)


def context_kv(w: DFlashWeights, context: Tensor, positions: Tensor, dims: DFlashDims) -> list[tuple[Tensor, Tensor]]:
    """Every layer's keys and values [B, nKV, C, hd] of the context hidden [B, C, H] at positions [B, C].

    What SGLang writes into the draft KV cache for each committed token (DFlashWorkerV2's
    _append_target_hidden_sequential: kv_proj_only, apply_k_norm, apply_k_rope): no input_layernorm on the
    context, the same context hidden for every layer. A decoder may cache these and append new tokens' entries.
    """
    cos, sin = rotary(dims, positions, context)
    return [_keys(lw, context, cos, sin, dims) for lw in w.layers]


def block_attention(q: Tensor, keys: Tensor, values: Tensor, visible: Visibility) -> Tensor:
    """[B, nH, Q, hd] queries over keys/values [B, nKV, S, hd] -> [B, nH, Q, hd]; ``visible`` bool [B|1, 1, Q, S]
    (None: every key) or the same as a flex BlockMask (flex_block_visibility), no causal mask; scale 1/sqrt(hd)
    (DFlashAttention.scaling); softmax in fp32."""
    if visible is not None and not isinstance(visible, Tensor):
        return flex_attention_over(q, keys, values, visible)  # its default scale is 1/sqrt(hd) too
    groups = q.shape[1] // keys.shape[1]
    scores = torch.matmul(q, repeat_kv(keys, groups).transpose(-1, -2)) * q.shape[-1] ** -0.5  # [B, nH, Q, S]
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(upcast(scores), dim=-1).to(q.dtype)
    return torch.matmul(probs, repeat_kv(values, groups))


def decoder_layer(
    lw: LayerWeights,
    x: Tensor,
    ctx: tuple[Tensor, Tensor],
    cos: Tensor,
    sin: Tensor,
    visible: Visibility,
    dims: DFlashDims,
) -> Tensor:
    """One DFlashDecoderLayer on the block's residual stream x [B, Q, H] -> [B, Q, H].

    ``ctx``: this layer's context keys and values [B, nKV, C, hd] (context_kv); cos/sin [B, 1, Q, hd] of the
    block positions. The block's keys follow the context's, as in SGLang's KV cache (prefix, then the block).
    """
    eps, batch, seq_len = dims.rms_norm_eps, x.shape[0], x.shape[1]
    h = rms_norm(x, lw.input_norm, eps)
    q = apply_rope(rms_norm(_heads(_linear(h, lw.q), dims.num_attention_heads), lw.q_norm, eps), cos, sin)
    key, value = _keys(lw, h, cos, sin, dims)  # [B, nKV, Q, hd] x 2
    keys, values = torch.cat([ctx[0], key], dim=2), torch.cat([ctx[1], value], dim=2)  # [B, nKV, S, hd]
    attn = block_attention(q, keys, values, visible)  # [B, nH, Q, hd]
    x = x + _linear(attn.transpose(1, 2).reshape(batch, seq_len, -1), lw.o)
    m = rms_norm(x, lw.post_norm, eps)
    return x + _linear(F.silu(_linear(m, lw.gate)) * _linear(m, lw.up), lw.down)


def block_forward(
    w: DFlashWeights,
    ctx: list[tuple[Tensor, Tensor]],
    block_embeds: Tensor,
    positions: Tensor,
    visible: Visibility,
    dims: DFlashDims,
) -> Tensor:
    """The draft model on the block tokens: embeddings [B, Q, H] at positions [B, Q] -> norm(x) [B, Q, H].

    ``ctx``: context_kv's per-layer keys and values; ``visible``: block_visibility (None: every key).
    SGLang's DFlashDraftModel.forward returns the same normed hidden states (its fused residual + norm is
    x + y then RMSNorm); the target's lm_head turns them into logits.
    """
    cos, sin = rotary(dims, positions, block_embeds)  # [B, 1, Q, hd]
    x = block_embeds
    for lw, layer_ctx in zip(w.layers, ctx, strict=True):
        x = decoder_layer(lw, x, layer_ctx, cos, sin, visible, dims)
    return rms_norm(x, w.norm, dims.rms_norm_eps)


# ------------------------------------------------------------------------------------------------- modules


class DFlashAttention(nn.Module):
    """q/k/v/o projections (no bias) and the per-head q/k RMSNorms."""

    def __init__(self, dims: DFlashDims) -> None:
        super().__init__()
        h, q_out = dims.hidden_size, dims.num_attention_heads * dims.head_dim
        kv_out = dims.num_key_value_heads * dims.head_dim
        self.q_proj = nn.Linear(h, q_out, bias=False)  # [nH*hd, H]
        self.k_proj = nn.Linear(h, kv_out, bias=False)  # [nKV*hd, H]
        self.v_proj = nn.Linear(h, kv_out, bias=False)  # [nKV*hd, H]
        self.o_proj = nn.Linear(q_out, h, bias=False)  # [H, nH*hd]
        self.q_norm = RMSNorm(dims.head_dim)  # [hd]
        self.k_norm = RMSNorm(dims.head_dim)  # [hd]


class DFlashLayer(nn.Module):
    """One draft layer: pre-norm attention over [context ; block], pre-norm SwiGLU."""

    def __init__(self, dims: DFlashDims) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(dims.hidden_size)
        self.self_attn = DFlashAttention(dims)
        self.post_attention_layernorm = RMSNorm(dims.hidden_size)
        self.mlp = SwiGLU(dims.hidden_size, dims.intermediate_size)


class DFlashDrafter(nn.Module):
    """layers + norm + fc + hidden_norm (the export), with the target's frozen embed_tokens and lm_head."""

    def __init__(self, dims: DFlashDims) -> None:
        super().__init__()
        self.dims = dims
        h = dims.hidden_size
        self.layers = nn.ModuleList(DFlashLayer(dims) for _ in range(dims.num_hidden_layers))
        self.norm = RMSNorm(h)
        self.fc = nn.Linear(dims.num_context_features * h, h, bias=False)  # [H, F*H]
        self.hidden_norm = RMSNorm(h)
        # The target's own tables, shared with it at serving time (SGLang passes input_embeds from the target's
        # embedding and samples with the target's lm_head): frozen, never exported.
        self.embed_tokens = nn.Embedding(dims.vocab_size, h)
        self.lm_head = nn.Linear(h, dims.vocab_size, bias=False)
        self.embed_tokens.weight.requires_grad_(False)
        self.lm_head.weight.requires_grad_(False)

    def forward(
        self,
        context_features: Tensor,
        context_positions: Tensor,
        block_ids: Tensor,
        positions: Tensor,
        visible: Visibility = None,
    ) -> Tensor:
        """Normed hidden states [B, Q, H] of the block tokens block_ids [B, Q] at positions [B, Q].

        context_features [B, C, F*H] at context_positions [B, C]; ``visible`` as block_visibility (None: every
        context key and every block key, i.e. one block per row over the whole context).
        """
        d, w = self.dims, dflash_weights(self)
        ctx = context_kv(w, project_context(w, context_features, d.rms_norm_eps), context_positions, d)
        embeds = F.embedding(block_ids, self.embed_tokens.weight)  # [B, Q, H]
        return block_forward(w, ctx, embeds, positions, visible, d)

    def logits(self, hidden: Tensor) -> Tensor:
        """The target's lm_head over normed hidden states [..., H] -> [..., V]."""
        return _linear(hidden, self.lm_head.weight)

    def draft_block(self, context_features: Tensor, context_end: Tensor, anchor_ids: Tensor) -> Tensor:
        """Greedy drafts [B, K-1] for one block per row, as SGLang's worker proposes them.

        Row b's committed tokens are positions 0 .. context_end[b]-1 (context_features[b, :context_end[b]], later
        slots are padding); its anchor anchor_ids[b] sits at position context_end[b]; the drafts are the argmax
        of the target's lm_head at block slots 1 .. K-1 (the tokens at positions context_end[b] + 1 ..).
        """
        d = self.dims
        batch, num_context, _ = context_features.shape
        context_positions = torch.arange(num_context, device=context_features.device).expand(batch, -1)
        ids = block_input_ids(anchor_ids[:, None], d.block_size, d.mask_token_id)  # [B, K]
        positions = block_positions(context_end[:, None], d.block_size)  # [B, K]
        visible = block_visibility(context_end[:, None], num_context, d.block_size)  # [B, 1, K, C+K]
        hidden = self.forward(context_features, context_positions, ids, positions, visible)  # [B, K, H]
        return self.logits(hidden[:, 1:]).argmax(dim=-1)  # [B, K-1]


def dflash_weights(model: DFlashDrafter, linear_dtype: torch.dtype | None = None) -> DFlashWeights:
    """The drafter's tensors; ``linear_dtype`` casts each linear weight once (norm weights are never cast)."""

    def linear(module: nn.Linear) -> Tensor:
        return module.weight if linear_dtype is None else module.weight.to(linear_dtype)

    def of(layer: DFlashLayer) -> LayerWeights:
        attn, mlp = layer.self_attn, layer.mlp
        return LayerWeights(
            layer.input_layernorm.weight,
            linear(attn.q_proj),
            linear(attn.k_proj),
            linear(attn.v_proj),
            linear(attn.o_proj),
            attn.q_norm.weight,
            attn.k_norm.weight,
            layer.post_attention_layernorm.weight,
            linear(mlp.gate_proj),
            linear(mlp.up_proj),
            linear(mlp.down_proj),
        )

    layers = tuple(of(cast(DFlashLayer, layer)) for layer in model.layers)
    return DFlashWeights(linear(model.fc), model.hidden_norm.weight, layers, model.norm.weight)


# ---------------------------------------------------------------------------------------------- init, export


def init_dflash_weights(model: DFlashDrafter, std: float = 0.02, seed: int = 0) -> None:
    """N(0, std) for the drafter's own linears, ones for its norms; the target's embed_tokens/lm_head untouched.

    Numbers are drawn on CPU from a seeded generator, so the init is the same on every device.
    """
    gen = torch.Generator().manual_seed(seed)
    shared = {id(model.embed_tokens), id(model.lm_head)}
    with torch.no_grad():
        for module in model.modules():
            if id(module) in shared:
                continue
            if isinstance(module, nn.Linear):
                module.weight.copy_(torch.randn(module.weight.shape, generator=gen) * std)
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)


def export_state_dict(model: DFlashDrafter) -> dict[str, Tensor]:
    """The checkpoint's weights under SGLang's names (eagle3.export.dflash.dflash_tensor_specs); the target's
    embeddings and lm_head stay out."""
    return {k: v for k, v in model.state_dict().items() if not k.startswith(("embed_tokens.", "lm_head."))}
