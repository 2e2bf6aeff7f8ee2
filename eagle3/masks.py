"""Document-aware positions, shifts and attention masks for packed training-time-test batches.

A packed row holds several documents back to back. ``document_ids[b, t]`` names the document of
token t: any integers, equal inside a document, each document one contiguous run (padding may be a
run of its own). Nothing may flow between documents: attention is causal inside a document, RoPE
positions restart at 0 per document, and a shift that pulls a value across a document end yields
an invalid slot (filled, and reported as invalid so that the loss never sees it).

Shape letters: B rows, T tokens per row, S TTT steps whose keys are cached (the current one included).
"""

from __future__ import annotations

from typing import Callable

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


def ttt_mask_mod(document_ids: Tensor, seq_len: int) -> Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]:
    """flex_attention mask_mod over keys laid out step by step (kv index = step * T + token)."""

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        step = kv_idx // seq_len
        kv_tok = kv_idx - step * seq_len
        # Step 0 holds the real context; a later step k holds only the token's own draft-k key.
        context = (step == 0) & (kv_tok <= q_idx) & (document_ids[b, kv_tok] == document_ids[b, q_idx])
        return context | ((step > 0) & (kv_tok == q_idx))

    return mask_mod
