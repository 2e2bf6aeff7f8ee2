"""The TTT alignment: what step k reads and is scored against at each row index, and the target's supervision.

Our convention: a prediction is supervised iff the token it predicts is marked in ``loss_mask``. A row holds
tokens x_0..x_{T-1}; g_t are the target's aux states at position t and p_j is the target's distribution at
position j (its prediction of x_{j+1}). At TTT step k, row index t:
    feature    fc(g_t) at k = 0, else the drafter's own step-(k-1) pre-norm output at index t
    token      x_{t+1+k}                 (teacher forced: TOKEN_SHIFT + k)
    position   pos_t + k                 (pos restarts at 0 in every packed document)
    predicts   x_{t+2+k}, scored against p_{t+1+k}
    supervised iff loss_mask[t+2+k] = 1 (PREDICT_SHIFT + k), x_{t+2+k} lies in t's document, and the
               target's full-vocab argmax at t+1+k is in the draft vocab (SpecForge's position mask).
Upstream offsets: SpecForge (specforge/core/eagle3.py) reads loss_mask[t] (two tokens before the predicted
one), speculators (src/speculators/models/eagle3/core.py) loss_mask[t+1+k] (the input token); we read the bit
of the predicted token itself, which is what tokenization marks: "the tokens the drafter should learn to produce".

The supervision (p restricted to the draft vocab, and the target's full-vocab argmax) comes from the final hidden
state through the target's lm_head, or from the target's top-K log-probs.

Shape letters: B rows, T tokens, Ht target hidden, K top-K, V target vocab, Vd draft vocab, S steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from eagle3.drafter.functional import upcast
from eagle3.drafter.masks import same_document_ahead, shift_left

TOKEN_SHIFT = 1
"""Step k at row index t reads token x_{t + TOKEN_SHIFT + k} and is scored against p_{t + TOKEN_SHIFT + k}."""
PREDICT_SHIFT = 2
"""...and predicts x_{t + PREDICT_SHIFT + k}, whose loss_mask bit decides supervision."""
PAD_TOKEN = 0
"""Fills token slots shifted past a document end; predictions from them are never supervised."""


@dataclass
class Supervision:
    """The target's signal at every position, computed once per micro-batch and shifted per step."""

    probs: Tensor  # [B, T, Vd] target distribution restricted to the draft vocab, renormalised
    argmax: Tensor  # [B, T] target argmax over the FULL vocab (target ids)


@dataclass
class StepAlignment:
    """What step k reads and is scored against at each row index t (see the module docstring)."""

    input_ids: Tensor  # [B, T] x_{t+1+k}; PAD_TOKEN where t+1+k leaves t's document
    target_argmax: Tensor  # [B, T] target argmax at t+1+k; -1 where it leaves t's document
    predicts_marked: Tensor  # [B, T] bool: x_{t+2+k} is in t's document and marked in loss_mask
    position_mask: Tensor  # [B, T] bool: predicts_marked and the target argmax is in the draft vocab


# ------------------------------------------------------------------------------------------------ supervision


@torch.no_grad()
def supervision_from_final(
    final_hidden: Tensor, lm_head_weight: Tensor, t2d: Tensor, chunk_tokens: int = 1024, draft_ids: Tensor | None = None
) -> Supervision:
    """Target logits = final @ W^T, computed ``chunk_tokens`` tokens at a time so only [chunk, V] lives at once.

    The full-vocab logits are needed for the argmax (position mask, accuracy); the distribution keeps the
    draft-vocab columns and renormalises them. ``draft_ids`` [Vd] (the target ids of the draft vocab,
    ascending) saves the host sync of finding them in t2d.
    """
    batch, seq_len, _ = final_hidden.shape
    used = t2d.nonzero().squeeze(1) if draft_ids is None else draft_ids  # [Vd] ascending = draft order
    probs, argmax = [], []
    for chunk in final_hidden.reshape(batch * seq_len, -1).split(chunk_tokens):
        logits = F.linear(chunk.to(lm_head_weight.dtype), lm_head_weight)  # [c, V] in the compute dtype
        # Upcasting is exact, so the argmax and the column gather give the same on the narrow logits; only the
        # draft columns are widened for the softmax (not a [c, V] fp32 copy).
        argmax.append(logits.argmax(-1))
        probs.append(torch.softmax(upcast(logits[:, used]), dim=-1))  # [c, Vd]
    return Supervision(torch.cat(probs).view(batch, seq_len, -1), torch.cat(argmax).view(batch, seq_len))


@torch.no_grad()
def supervision_from_topk(
    topk_ids: Tensor, topk_logprobs: Tensor, t2d: Tensor, draft_vocab_size: int | None = None
) -> Supervision:
    """A draft-vocab distribution rebuilt from the target's top-K log-probs.

    p_v is proportional to exp(logprob_v) for the top-K ids inside the draft vocab and 0 for every other
    draft id: the mass beyond the top K is unknown, so it is dropped and the known part renormalised (a
    truncated teacher; exact when the top K hold all the draft-vocab mass). The argmax is the id with the
    largest log-prob. A position whose top K has no draft-vocab id gets all-zero probs; its argmax is then
    outside the draft vocab, so the position mask drops it.
    """
    ids = topk_ids.long()  # [B, T, K]
    draft_index = t2d.long().cumsum(0) - 1  # [V] draft index of target id v (valid where t2d[v])
    inside = t2d[ids]  # [B, T, K]
    mass = torch.where(inside, topk_logprobs.float().exp(), torch.zeros((), device=ids.device))
    num_draft = int(t2d.sum()) if draft_vocab_size is None else draft_vocab_size  # the sum costs a host sync
    probs = torch.zeros(*ids.shape[:2], num_draft, device=ids.device)  # [B, T, Vd]
    probs.scatter_add_(-1, torch.where(inside, draft_index[ids], 0), mass)
    probs = probs / probs.sum(-1, keepdim=True).clamp_min(torch.finfo(probs.dtype).tiny)
    argmax = ids.gather(-1, topk_logprobs.argmax(-1, keepdim=True)).squeeze(-1)  # [B, T]
    return Supervision(probs, argmax)


# -------------------------------------------------------------------------------------------------- alignment


def align_step(
    input_ids: Tensor, loss_mask: Tensor, document_ids: Tensor, target_argmax: Tensor, t2d: Tensor, k: int
) -> StepAlignment:
    """Inputs and masks of TTT step k; every shift that would cross a document end is cut there."""
    token_ok = same_document_ahead(document_ids, TOKEN_SHIFT + k)  # [B, T]
    predict_ok = same_document_ahead(document_ids, PREDICT_SHIFT + k)  # [B, T]
    tokens = torch.where(token_ok, shift_left(input_ids, TOKEN_SHIFT + k, PAD_TOKEN), PAD_TOKEN)
    argmax = torch.where(token_ok, shift_left(target_argmax, TOKEN_SHIFT + k, -1), -1)
    marked = predict_ok & shift_left(loss_mask.bool(), PREDICT_SHIFT + k, False)
    in_vocab = (argmax >= 0) & t2d[argmax.clamp(min=0)]
    return StepAlignment(tokens, argmax, marked, marked & in_vocab)


def align_steps(
    input_ids: Tensor, loss_mask: Tensor, document_ids: Tensor, target_argmax: Tensor, t2d: Tensor, num_steps: int
) -> list[StepAlignment]:
    """align_step for k = 0..S-1, computed together: a dozen [B, S, T] ops instead of ~25 small ones per step."""
    batch, seq_len = input_ids.shape
    steps = torch.arange(num_steps, device=input_ids.device)
    index = torch.arange(seq_len, device=input_ids.device)

    def ahead(x: Tensor, first: int, fill: int | bool) -> Tensor:  # [B, S, T]: x[:, t + first + k], fill past the row
        padded = torch.cat([x, x.new_full((batch, first + num_steps), fill)], dim=1)
        return padded.unfold(1, seq_len, 1)[:, first : first + num_steps]

    def same_document(first: int) -> Tensor:  # [B, S, T]: token t + first + k exists and shares t's document
        inside = (index + first + steps[:, None]) < seq_len  # [S, T]
        return inside & (ahead(document_ids, first, 0) == document_ids[:, None])

    token_ok, predict_ok = same_document(TOKEN_SHIFT), same_document(PREDICT_SHIFT)
    tokens = torch.where(token_ok, ahead(input_ids, TOKEN_SHIFT, PAD_TOKEN), PAD_TOKEN)
    argmax = torch.where(token_ok, ahead(target_argmax, TOKEN_SHIFT, -1), -1)
    marked = predict_ok & ahead(loss_mask.bool(), PREDICT_SHIFT, False)
    in_loss = marked & (argmax >= 0) & t2d[argmax.clamp(min=0)]
    return [StepAlignment(tokens[:, k], argmax[:, k], marked[:, k], in_loss[:, k]) for k in range(num_steps)]
