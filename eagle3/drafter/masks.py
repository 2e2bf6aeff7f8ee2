"""Document-aware positions, shifts and attention masks for packed training-time-test batches.

A packed row holds several documents back to back. ``document_ids[b, t]`` names the document of
token t: any integers, equal inside a document, each document one contiguous run (padding may be a
run of its own). Nothing may flow between documents: attention is causal inside a document, RoPE
positions restart at 0 per document, and a shift that pulls a value across a document end yields
an invalid slot (filled, and reported as invalid so that the loss never sees it).

Shape letters: B rows, T tokens per row, S TTT steps whose keys are cached (the current one included).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor


def single_document_ids(batch: int, seq_len: int, device: torch.device | str = "cpu") -> Tensor:
    """Document ids for unpacked rows: every row is one document."""
    return torch.zeros(batch, seq_len, dtype=torch.long, device=device)  # [B, T]


def positions_from_documents(document_ids: Tensor) -> Tensor:
    """RoPE positions that restart at 0 at the first token of each document: int64 [B, T]."""
    _, seq_len = document_ids.shape
    index = torch.arange(seq_len, device=document_ids.device).expand_as(document_ids)  # [B, T]
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    # The running max of "index where a document started" is the start of the current document.
    start_index = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values  # [B, T]
    return index - start_index


def shift_left(x: Tensor, n: int, fill: int | float | bool) -> Tensor:
    """out[:, t] = x[:, t + n], and ``fill`` where t + n runs past the row: same shape as x."""
    if n == 0:
        return x.clone()
    out = torch.full_like(x, fill)
    if n < x.shape[1]:
        out[:, : x.shape[1] - n] = x[:, n:]
    return out


def same_document_ahead(document_ids: Tensor, n: int) -> Tensor:
    """bool [B, T]: token t + n exists in the row and belongs to the same document as token t."""
    # Slots past the row end are cleared by `inside`, so the shift's fill value never matters.
    ahead = shift_left(document_ids, n, 0)
    inside = torch.zeros_like(document_ids, dtype=torch.bool)
    inside[:, : max(document_ids.shape[1] - n, 0)] = True
    return inside & (ahead == document_ids)


def causal_document_mask(document_ids: Tensor) -> Tensor:
    """bool [B, 1, T, T]: query t may see key s iff s <= t and both lie in the same document."""
    seq_len = document_ids.shape[1]
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=document_ids.device).tril()  # [T, T]
    same = document_ids[:, :, None] == document_ids[:, None, :]  # [B, T, T]
    return (causal & same)[:, None]


def ttt_dense_mask(document_ids: Tensor, num_steps: int) -> Tensor:
    """bool [B, 1, T, S*T] over keys laid out step by step: step 0 causal in-document, later steps diagonal."""
    seq_len = document_ids.shape[1]
    eye = torch.eye(seq_len, dtype=torch.bool, device=document_ids.device)  # [T, T]
    blocks = [causal_document_mask(document_ids)]
    blocks += [eye.expand(document_ids.shape[0], 1, seq_len, seq_len)] * (num_steps - 1)
    return torch.cat(blocks, dim=-1)


def ttt_mask_mod(
    document_ids: Tensor, seq_len: int, num_steps: Tensor | None = None
) -> Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]:
    """flex_attention mask_mod over keys laid out step by step (kv index = step * T + token).

    ``num_steps`` (a 0-dim int tensor) hides the keys of steps >= num_steps: a key tensor laid out for more
    steps than exist yet (zeros there) then gives the same result. A tensor, not an int, so that a compiled
    kernel reads it as an input instead of compiling once per value.
    """

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        step = kv_idx // seq_len
        kv_tok = kv_idx - step * seq_len
        # Step 0 holds the real context; a later step k holds only the token's own draft-k key.
        context = (step == 0) & (kv_tok <= q_idx) & (document_ids[b, kv_tok] == document_ids[b, q_idx])
        later = (step > 0) & (kv_tok == q_idx)
        if num_steps is not None:
            later = later & (step < num_steps)
        return context | later

    return mask_mod


def ttt_block_masks(document_ids: Tensor, num_steps: int, block_size: int = 128) -> list[Any]:
    """Flex BlockMasks of steps 0..S-1 over ONE key layout of S*T keys, from a single create_block_mask.

    Step k (k+1 cached steps) keeps the key blocks below (k+1)*T/block of the whole layout's mask, and its
    mask_mod hides the later steps' keys as well, so the eager (dense) flex path, which ignores the block
    lists, agrees. T must be a multiple of ``block_size``: then no key block straddles two steps.
    """
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask

    batch, seq_len = document_ids.shape
    if seq_len % block_size:
        raise ValueError(f"one block mask for all steps needs T ({seq_len}) to be a multiple of {block_size}")
    whole = create_block_mask(
        ttt_mask_mod(document_ids, seq_len),
        batch,
        None,
        seq_len,
        num_steps * seq_len,
        device=document_ids.device,
        BLOCK_SIZE=block_size,
        _compile=document_ids.is_cuda,
    )
    # Counts as device tensors (no host sync); one clone each so every mask owns a plain 0-dim tensor.
    counts = torch.arange(1, num_steps + 1, device=document_ids.device)
    masks = []
    for k in range(num_steps):
        limit = (k + 1) * seq_len // block_size
        kv_num, kv_idx = keep_blocks_below(whole.kv_num_blocks, whole.kv_indices, limit)
        full_num, full_idx = (
            (None, None)
            if whole.full_kv_num_blocks is None or whole.full_kv_indices is None
            else (keep_blocks_below(whole.full_kv_num_blocks, whole.full_kv_indices, limit))
        )
        masks.append(
            BlockMask.from_kv_blocks(
                kv_num,
                kv_idx,
                full_num,
                full_idx,
                BLOCK_SIZE=whole.BLOCK_SIZE,
                mask_mod=ttt_mask_mod(document_ids, seq_len, counts[k].clone()),
                seq_lengths=(seq_len, num_steps * seq_len),
            )
        )
    return masks


def keep_blocks_below(num_blocks: Tensor, indices: Tensor, limit: int) -> tuple[Tensor, Tensor]:
    """A BlockMask row list [..., rows], [..., rows, n] cut to the block indices < limit (kept ones first, in order)."""
    slot = torch.arange(indices.shape[-1], device=indices.device)
    keep = (slot < num_blocks[..., None]) & (indices < limit)  # [..., rows, n]
    order = torch.argsort(keep.to(torch.int32), dim=-1, descending=True, stable=True)
    return keep.sum(-1, dtype=torch.int32), indices.gather(-1, order).to(torch.int32)
