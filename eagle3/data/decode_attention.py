"""The one-token decode step's attention for transformers' static-cache generation (eagle3.data.generate).

Registered with transformers' ``AttentionInterface`` under a name of its own (``use_decode_attention``), so only
the static cache's decode runs it; prefill and every other shape go to transformers' own sdpa function:
  * ``kv_heads`` (``sdpa_kv_heads``): the query heads of one key/value head become query rows of one SDPA call on
    the unrepeated cache, instead of transformers' compiled path (``sdpa``), which copies the whole static cache
    per layer and step to repeat it for every query head (``repeat_kv``);
  * ``flex`` (``flex_decode``): flex_attention with a block mask that lists, per row, only the key blocks holding
    a valid key, where SDPA reads the whole static cache whatever the position: on an H200 the decode attention
    was 78% of a step at batch 512, cache 2,048 (lab/generation.py --profile).

Imports torch, transformers and eagle3.features.attention (torch only).
"""

from __future__ import annotations

from typing import Any, Literal

import torch

DecodeAttention = Literal["sdpa", "kv_heads", "flex"]
KV_HEAD_ATTENTION = "sdpa_kv_heads"
"""Name under which the kv-head decode attention is registered with transformers."""
FLEX_DECODE_ATTENTION = "flex_decode_blocks"
"""Name under which the block-skipping flex decode attention is registered with transformers."""
FLEX_KV_BLOCK = 128
"""Keys per block of the flex decode's block mask (at most the cache length)."""


def kv_head_rows(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
) -> torch.Tensor:
    """Grouped-query attention on the unrepeated cache: query [B, H, q, D] with H = Hkv * G, key/value [B, Hkv, L, D],
    attention_mask None or [B or 1, 1, q, L] -> [B, q, H, Dv].

    The G query heads sharing a key/value head (query head h reads head h // G, as ``repeat_kv`` orders them) become
    G * q query rows of it, group g's row r at g * q + r, each with its row's mask; one query row's mask broadcasts
    over the G rows without a copy. Each query sees the same keys and weights as through the repeated cache."""
    batch, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    rows = query.reshape(batch, kv_heads, groups * q_len, dim)  # [B, Hkv, G*q, D]
    mask = attention_mask
    if mask is not None and q_len > 1:  # [B, 1, q, L] -> [B, 1, G*q, L]
        mask = mask.expand(mask.shape[0], groups, q_len, mask.shape[-1]).reshape(mask.shape[0], 1, groups * q_len, -1)
    out = torch.nn.functional.scaled_dot_product_attention(
        rows, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling
    )  # [B, Hkv, G*q, Dv]
    return out.reshape(batch, heads, q_len, out.shape[-1]).transpose(1, 2).contiguous()  # [B, q, H, Dv]


def sdpa_kv_heads(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """SDPA that never repeats the kv cache for grouped-query attention in a one-token decode step (``kv_head_rows``;
    the mask [B, 1, 1, L] broadcasts over a group's rows). Everything else (prefill, no grouping, position bias)
    goes to transformers' own sdpa function."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    q_len = query.shape[2]
    mask_ok = attention_mask is None or (attention_mask.shape[1] == 1 and attention_mask.shape[2] == 1)
    if q_len != 1 or groups == 1 or not mask_ok or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    return kv_head_rows(query, key, value, attention_mask, dropout, scaling), None  # [B, 1, H, D]


def decode_block_mask(valid: torch.Tensor) -> Any:
    """valid bool [B, L] (True = attend) -> a flex BlockMask for one query row per batch row that lists, per row,
    only the key blocks holding a valid key (first), so the kernel never reads the others; mask_mod masks inside
    them. Tensor ops only: it builds inside a compiled decode step, one graph for every position."""
    from torch.nn.attention.flex_attention import BlockMask

    batch, length = valid.shape
    block = min(FLEX_KV_BLOCK, length)
    used = valid.view(batch, length // block, block).any(-1)  # [B, NB]
    order = torch.argsort((~used).to(torch.int8), dim=-1, stable=True)  # [B, NB]: used blocks first, ascending
    num = used.sum(-1, dtype=torch.int32)  # [B]

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return valid[b, kv]

    return BlockMask.from_kv_blocks(
        num[:, None, None],
        order[:, None, None, :].to(torch.int32),
        BLOCK_SIZE=(FLEX_KV_BLOCK, block),
        mask_mod=mask_mod,
        seq_lengths=(1, length),
    )


def flex_decode(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """One-token decode attention that reads only the key blocks a row's mask uses (flex_attention).

    query [B, H, 1, D], key/value [B, Hkv, L, D] unrepeated (grouped heads go to flex's enable_gqa), mask bool
    [B, 1, 1, L]. Everything else (prefill, float masks, position bias) goes to transformers' own sdpa."""
    from torch.nn.attention.flex_attention import flex_attention
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    batch, heads, q_len, dim = query.shape
    length = key.shape[2]
    usable = (
        q_len == 1
        and attention_mask is not None
        and attention_mask.dtype == torch.bool
        and attention_mask.shape[1:3] == (1, 1)
        and kwargs.get("position_bias") is None
        and dropout == 0.0
        and length % min(FLEX_KV_BLOCK, length) == 0
    )  # whole blocks (static caches are powers of two)
    if not usable or attention_mask is None:  # (usable implies a mask; the test narrows its type)
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    valid = attention_mask[:, 0, 0, :].expand(batch, length)  # [B, L]
    out = flex_attention(
        query, key, value, block_mask=decode_block_mask(valid), scale=scaling, enable_gqa=heads != key.shape[1]
    )  # [B, H, 1, D]
    return out.transpose(1, 2).contiguous(), None  # [B, 1, H, D], the layout sdpa_attention_forward returns


_DECODE_ATTENTION_NAMES = {"kv_heads": KV_HEAD_ATTENTION, "flex": FLEX_DECODE_ATTENTION}


def use_decode_attention(model: Any, kind: DecodeAttention) -> None:
    """Register the ``kind`` decode attention (with the sdpa mask) and switch an sdpa model to it (``sdpa``: back
    to transformers' own); a model on another attention is left alone."""
    from eagle3.features.attention import use_attention

    ours = set(_DECODE_ATTENTION_NAMES.values())
    if model.config._attn_implementation not in ("sdpa", *ours):
        return
    if kind == "sdpa":
        if model.config._attn_implementation != "sdpa":
            model.set_attn_implementation("sdpa")
        return
    use_attention(model, _DECODE_ATTENTION_NAMES[kind], sdpa_kv_heads if kind == "kv_heads" else flex_decode)
