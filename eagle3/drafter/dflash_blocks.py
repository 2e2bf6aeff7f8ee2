"""Where a DFlash drafter's block tokens sit and what they see: the block's ids and positions, and its visibility
over [context | blocks] as a dense bool mask (decoding, CPU training) or a flex BlockMask (training on CUDA, where
thousands of blocks a row would not fit a dense mask). eagle3/drafter/dflash.py has the model that reads them.

Shape letters as in eagle3/drafter/dflash.py: B rows, N blocks per row, K block size, C context tokens,
Q block tokens per row (N * K), S keys per row (C + Q).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Union

import torch
from torch import Tensor

from eagle3.drafter.functional import FLEX_AVAILABLE

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

Visibility = Union[Tensor, "BlockMask", None]
"""What a block query sees: block_visibility's bool mask, flex_block_visibility's BlockMask, or None (every key)."""


# ------------------------------------------------------------------------------------------ block layout


def block_input_ids(anchor_ids: Tensor, block_size: int, mask_token_id: int) -> Tensor:
    """[B, N] anchors -> [B, N*K] block tokens: each anchor followed by K-1 mask tokens (SGLang's block_ids)."""
    batch, blocks = anchor_ids.shape
    ids = torch.full((batch, blocks, block_size), mask_token_id, dtype=anchor_ids.dtype, device=anchor_ids.device)
    ids[:, :, 0] = anchor_ids
    return ids.view(batch, blocks * block_size)


def block_positions(anchor_positions: Tensor, block_size: int) -> Tensor:
    """[B, N] anchor positions -> [B, N*K]: anchor + 0 .. K-1 (SGLang: prefix_lens + _block_pos_offsets)."""
    offsets = torch.arange(block_size, device=anchor_positions.device, dtype=anchor_positions.dtype)
    return (anchor_positions[..., None] + offsets).flatten(1)


def block_visibility(
    context_end: Tensor, num_context: int, block_size: int, context_start: Tensor | None = None
) -> Tensor:
    """bool [B, 1, Q, S]: which keys each block token attends to, keys laid out as [context (C) | blocks (Q)].

    Block n of row b sees context keys j with context_start[b, n] <= j < context_end[b, n] (default start 0) and
    every token of its own block, none of another block's. Decoding (one block per row): context_end = the
    number of committed tokens, the block's anchor position, as SGLang's draft attention sees the prefix
    [0, prefix_len) of the draft KV cache plus the block (ENCODER_ONLY: no causal mask). Training: many blocks
    per row, context_end = each block's anchor index (strictly before the anchor, as at decoding time), and
    context_start = its document's first index in a packed row.
    """
    batch, blocks = context_end.shape
    device = context_end.device
    key = torch.arange(num_context, device=device)  # [C]
    start = torch.zeros_like(context_end) if context_start is None else context_start
    sees_context = (key >= start[..., None]) & (key < context_end[..., None])  # [B, N, C]
    own = torch.eye(blocks, dtype=torch.bool, device=device)  # [N, N]: block n sees block n only
    sees_blocks = own.repeat_interleave(block_size, dim=1).expand(batch, blocks, -1)  # [B, N, Q]
    visible = torch.cat([sees_context, sees_blocks], dim=-1)  # [B, N, S]
    return visible.repeat_interleave(block_size, dim=1)[:, None]  # [B, 1, Q, S]


def block_mask_mod(context_start: Tensor, context_end: Tensor, num_context: int, block_size: int) -> Any:
    """flex_attention mask_mod of block_visibility: query q (block q // K) sees context key kv when
    context_start[b, block] <= kv < context_end[b, block], and block key kv (>= C) when it is in its own block."""

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        block = q_idx // block_size
        in_context = (kv_idx < num_context) & (kv_idx >= context_start[b, block]) & (kv_idx < context_end[b, block])
        return in_context | ((kv_idx >= num_context) & ((kv_idx - num_context) // block_size == block))

    return mask_mod


def flex_block_visibility(
    context_end: Tensor, num_context: int, block_size: int, context_start: Tensor | None = None
) -> BlockMask:
    """block_visibility as a flex BlockMask: the score tiles no block query sees are skipped, never computed.

    With many anchors per row the dense [B, nH, Q, C + Q] scores grow with N * T (4,096 blocks of 16 over a
    16K-token row: 65,536 queries x 81,920 keys, 5.4G scores per head); flex computes only the tiles under each
    block's own context and its own block: for ascending anchors about half the context columns, and the diagonal.
    """
    if not FLEX_AVAILABLE:
        raise RuntimeError("flex_attention is not available in this torch build; use drafter.attn_impl=dense")
    from torch.nn.attention.flex_attention import create_block_mask

    batch, blocks = context_end.shape
    start = torch.zeros_like(context_end) if context_start is None else context_start
    num_queries = blocks * block_size
    return create_block_mask(
        block_mask_mod(start, context_end, num_context, block_size),
        batch,
        None,
        num_queries,
        num_context + num_queries,
        device=context_end.device,
        _compile=context_end.is_cuda,
    )
