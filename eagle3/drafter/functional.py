"""The EAGLE-3 drafter's math as functions: one TTT step, its attention over the cached steps, RoPE.

The drafter's modules (eagle3.drafter.model) only hold the weights; the layer is written once, here, as the
functional step (attention_inputs, the TTT attention, step_outputs) that ``Eagle3Drafter.forward``, the training
unroll (eagle3.drafter.ttt) and the decoders (eagle3.evaluate) all run. The DFlash drafter (eagle3.drafter.dflash)
reuses its RoPE, norm and key/value repeat.

Shape letters used in the comments (here and in eagle3.drafter.model):
    B   rows of a micro-batch               T    tokens per row (documents may be packed)
    S   TTT steps whose keys are cached     H    drafter hidden size (= target hidden size)
    Ht  target hidden size                  A    aux layers (fc reads A * Ht)
    nH  query heads    nKV  key/value heads    hd  head dim    I  MLP width
    V   target vocab   Vd   draft vocab
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from eagle3.drafter.masks import causal_document_mask, ttt_mask_mod

try:  # flex_attention is the CUDA path only; CPU runs (and older torch builds) use the dense path
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
except ImportError:  # pragma: no cover - depends on the torch build
    create_block_mask = flex_attention = None  # type: ignore[assignment]  # FLEX_AVAILABLE tells the callers

FLEX_AVAILABLE = flex_attention is not None
AttnImpl = Literal["auto", "dense", "flex"]


def upcast(x: Tensor) -> Tensor:
    """x in at least fp32 (bf16/fp16 are raised; fp64 stays fp64, so float64 checks keep their precision)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


# --------------------------------------------------------------------------------------------------- RoPE


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama-3.1 RoPE frequency scaling (config ``rope_type: llama3``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


def llama3_scale(inv_freq: Tensor, s: Llama3RopeScaling) -> Tensor:
    """Llama-3.1 scaling: long wavelengths are slowed by ``factor``, short ones kept, a linear blend between.

    With L = original context, a wavelength above L / low_freq_factor gets inv_freq / factor, one below
    L / high_freq_factor is kept, and in between the weight of the kept frequency rises linearly in L / wavelen.
    """
    wavelen = 2 * math.pi / inv_freq
    kept = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    kept = kept.clamp(0.0, 1.0)  # 0: fully scaled, 1: untouched
    return (1 - kept) * inv_freq / s.factor + kept * inv_freq


@lru_cache(maxsize=8)
def rope_inv_freq(head_dim: int, theta: float, scaling: Llama3RopeScaling | None = None) -> Tensor:
    """float64 [hd/2] inverse frequencies theta^(-2i/hd), llama3-scaled when asked (cached on CPU; callers cast)."""
    inv_freq = theta ** -(torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if scaling is not None:
        inv_freq = llama3_scale(inv_freq, scaling)
    return inv_freq


@lru_cache(maxsize=16)
def rope_inv_freq_on(head_dim: int, theta: float, scaling: Llama3RopeScaling | None, device: torch.device) -> Tensor:
    """rope_inv_freq copied to ``device`` once: a host-to-device copy per step would stall the host every step."""
    return rope_inv_freq(head_dim, theta, scaling).to(device)


def rope_cos_sin(inv_freq: Tensor, positions: Tensor, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """cos, sin [B, 1, T, hd] for integer positions [B, T] (half-split layout, as Llama and SGLang).

    Angles are fp32 like the engines' tables; ``dtype=torch.float64`` serves exact float64 checks.
    """
    angles = positions[..., None].to(dtype) * inv_freq.to(positions.device, dtype)  # [B, T, hd/2]
    angles = torch.cat([angles, angles], dim=-1)  # [B, T, hd]
    return angles.cos()[:, None], angles.sin()[:, None]


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs (x_i, x_{i+hd/2}) of x [B, n, T, hd] by the position angles."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    # Cast the tables, not x: q, k and v must share a dtype for the attention kernels under autocast.
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


# -------------------------------------------------------------------------------------------- TTT attention


@dataclass
class TTTCache:
    """Post-RoPE keys and values of the TTT steps run so far, one entry per step."""

    keys: list[Tensor] = field(default_factory=list)  # S x [B, nKV, T, hd]
    values: list[Tensor] = field(default_factory=list)  # S x [B, nKV, T, hd]


def repeat_kv(x: Tensor, groups: int) -> Tensor:
    """[B, nKV, T, hd] -> [B, nKV * groups, T, hd]: each key/value head serves ``groups`` query heads."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def dense_ttt_attention(q: Tensor, keys: list[Tensor], values: list[Tensor], document_ids: Tensor) -> Tensor:
    """[B, nH, T, hd]: queries of step S-1 over step 0's keys (causal in-document) and their own later-step keys.

    The later steps contribute one key per query (the diagonal), so their scores are per-token dot products
    and memory stays O(T^2 + S*T) instead of O(S*T^2); one softmax runs over both parts.
    """
    seq_len, groups, scale = q.shape[2], q.shape[1] // keys[0].shape[1], q.shape[-1] ** -0.5
    context = torch.matmul(q, repeat_kv(keys[0], groups).transpose(-1, -2)) * scale  # [B, nH, T, T]
    context = context.masked_fill(~causal_document_mask(document_ids), float("-inf"))
    diagonal = [(q * repeat_kv(k, groups)).sum(-1, keepdim=True) * scale for k in keys[1:]]  # S-1 x [B, nH, T, 1]
    probs = torch.softmax(upcast(torch.cat([context, *diagonal], dim=-1)), dim=-1).to(q.dtype)  # [B, nH, T, T+S-1]
    out = torch.matmul(probs[..., :seq_len], repeat_kv(values[0], groups))  # [B, nH, T, hd]
    for j, v in enumerate(values[1:]):
        out = out + probs[..., seq_len + j, None] * repeat_kv(v, groups)
    return out


@lru_cache(maxsize=1)
def _compiled_flex_attention() -> Any:
    # Uncompiled flex_attention materializes the full score matrix; only the compiled kernel is worth it.
    # Every (T, key length) shape and grad mode compiles once. One block mask per step (flex_ttt_attention)
    # means ttt_steps key lengths, twice with evaluation: ttt 7 passes dynamo's default recompile limit (8)
    # and the rest falls back to the slow path. One key layout for all steps (masks.ttt_block_masks,
    # flex_attention_over) compiles once for training and once for evaluation. The limit is raised so that
    # per-step masks stay compiled too: the slow path's score matrix does not fit at T = 16k.
    from eagle3.compiling import raise_recompile_limit

    raise_recompile_limit(32)
    return torch.compile(flex_attention, dynamic=False)


def flex_ttt_attention(q: Tensor, keys: list[Tensor], values: list[Tensor], document_ids: Tensor) -> Tensor:
    """Same result as dense_ttt_attention through a flex_attention block mask over all S*T cached keys."""
    if not FLEX_AVAILABLE:
        raise RuntimeError("flex_attention is not available in this torch build; use attn_impl='dense'")
    batch, _, seq_len, _ = q.shape
    all_keys, all_values = torch.cat(keys, dim=2), torch.cat(values, dim=2)  # [B, nKV, S*T, hd]
    block_mask = create_block_mask(
        ttt_mask_mod(document_ids, seq_len),
        batch,
        None,
        seq_len,
        all_keys.shape[2],
        device=q.device,
        _compile=q.is_cuda,
    )
    attend = _compiled_flex_attention() if q.is_cuda else flex_attention
    return attend(q, all_keys, all_values, block_mask=block_mask, enable_gqa=True)


def resolve_attn_impl(impl: AttnImpl, device: torch.device) -> Literal["dense", "flex"]:
    """'auto' = flex on CUDA when importable, dense elsewhere."""
    if impl == "auto":
        return "flex" if FLEX_AVAILABLE and device.type == "cuda" else "dense"
    if impl == "flex" and not FLEX_AVAILABLE:
        raise RuntimeError("attn_impl='flex' but flex_attention is not importable in this torch build")
    return impl


def ttt_attention(
    q: Tensor, keys: list[Tensor], values: list[Tensor], document_ids: Tensor, impl: AttnImpl = "auto"
) -> Tensor:
    """TTT attention of the current step's queries q [B, nH, T, hd] -> [B, nH, T, hd] (see dense_ttt_attention)."""
    if resolve_attn_impl(impl, q.device) == "flex":
        return flex_ttt_attention(q, keys, values, document_ids)
    return dense_ttt_attention(q, keys, values, document_ids)


def flex_attention_over(q: Tensor, keys: Tensor, values: Tensor, block_mask: Any, scale: float | None = None) -> Tensor:
    """flex_attention of q [B, nH, T, hd] over a whole key layout [B, nKV, L, hd] that ``block_mask`` covers.

    ``scale``: the score scale (None: 1 / sqrt(hd)).
    """
    attend = _compiled_flex_attention() if q.is_cuda else flex_attention
    return attend(q, keys, values, block_mask=block_mask, scale=scale, enable_gqa=True)


# ---------------------------------------------------------------------------------- the layer: one step


class StepWeights(NamedTuple):
    """The tensors one TTT step reads (the drafter's own, linear weights possibly cast; see step_weights)."""

    embed: Tensor  # [V, H] frozen target embeddings
    input_norm: Tensor  # [H]
    hidden_norm: Tensor  # [H]
    q: Tensor  # [nH*hd, 2H]
    k: Tensor  # [nKV*hd, 2H]
    v: Tensor  # [nKV*hd, 2H]
    o: Tensor  # [H, nH*hd]
    post_norm: Tensor  # [H]
    gate: Tensor  # [I, H]
    up: Tensor  # [I, H]
    down: Tensor  # [H, I]
    norm: Tensor  # [H]
    lm_head: Tensor  # [Vd, H]


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x / rms(x) * weight."""
    # Normalise in fp32 (bf16 squares lose digits) and cast back before the weight, as Llama's norm does.
    wide = upcast(x)
    wide = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
    return weight * wide.to(x.dtype)


def _linear(x: Tensor, weight: Tensor) -> Tensor:
    # The activation cast autocast makes, made explicit (a no-op when the dtypes already agree).
    return F.linear(x.to(weight.dtype), weight)


def attention_inputs(
    w: StepWeights,
    input_ids: Tensor,
    hidden: Tensor,
    cos: Tensor,
    sin: Tensor,
    eps: float,
    num_heads: int,
    num_kv_heads: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """MidLayer up to the attention: q [B, nH, T, hd], this step's post-RoPE key and value [B, nKV, T, hd]."""
    embeds = F.embedding(input_ids, w.embed)  # [B, T, H]
    # The embedding comes first in the concatenation: SGLang's q/k/v weights expect that order.
    x = torch.cat([rms_norm(embeds, w.input_norm, eps), rms_norm(hidden, w.hidden_norm, eps)], dim=-1)  # [B, T, 2H]
    batch, seq_len, _ = x.shape

    def heads(y: Tensor, n: int) -> Tensor:
        return y.view(batch, seq_len, n, -1).transpose(1, 2)  # [B, n, T, hd]

    q = apply_rope(heads(_linear(x, w.q), num_heads), cos, sin)
    k = apply_rope(heads(_linear(x, w.k), num_kv_heads), cos, sin)
    return q, k, heads(_linear(x, w.v), num_kv_heads)


def step_outputs(w: StepWeights, hidden: Tensor, attn: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """MidLayer after the attention [B, nH, T, hd], then the head: (pre-norm output [B, T, H], logits [B, T, Vd])."""
    batch, _, seq_len, _ = attn.shape
    # The residual is the UN-normed feature (SGLang and SpecForge; speculators' norm_before_residual differs).
    h = hidden + _linear(attn.transpose(1, 2).reshape(batch, seq_len, -1), w.o)  # [B, T, H]
    x = rms_norm(h, w.post_norm, eps)
    out = h + _linear(F.silu(_linear(x, w.gate)) * _linear(x, w.up), w.down)  # SwiGLU, [B, T, H]
    return out, _linear(rms_norm(out, w.norm, eps), w.lm_head)


@lru_cache(maxsize=4)
def compiled_step_pieces(backend: str = "inductor") -> tuple[Any, Any]:
    """(attention_inputs, step_outputs) under torch.compile with static shapes.

    Their shapes do not depend on the TTT step, so each compiles once per row shape and grad mode (train,
    eval); the attention between them (whose key count grows with the step) stays outside.
    """
    return (
        torch.compile(attention_inputs, dynamic=False, backend=backend),
        torch.compile(step_outputs, dynamic=False, backend=backend),
    )
