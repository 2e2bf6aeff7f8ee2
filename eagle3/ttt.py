"""Training-time test (TTT): the EAGLE-3 unroll, its alignment, loss and metrics.

Alignment (ARCHITECTURE section 4: a prediction is supervised iff the token it predicts is marked in
``loss_mask``). A row holds tokens x_0..x_{T-1}; g_t are the target's aux states at position t and p_j
is the target's distribution at position j (its prediction of x_{j+1}). At TTT step k, row index t:
    feature    fc(g_t) at k = 0, else the drafter's own step-(k-1) pre-norm output at index t
    token      x_{t+1+k}                 (teacher forced: TOKEN_SHIFT + k)
    position   pos_t + k                 (pos restarts at 0 in every packed document)
    predicts   x_{t+2+k}, scored against p_{t+1+k}
    supervised iff loss_mask[t+2+k] = 1 (PREDICT_SHIFT + k), x_{t+2+k} lies in t's document, and the
               target's full-vocab argmax at t+1+k is in the draft vocab (SpecForge's position mask).
In the offsets of the reference doc: SpecForge reads loss_mask[t] (two tokens before the predicted one),
speculators loss_mask[t+1+k] (the input token); we read the bit of the predicted token itself, which is
what tokenization marks: "the tokens the drafter should learn to produce".

Loss: L_k = soft cross-entropy between softmax(target logits restricted to the draft vocab) and
log_softmax(draft logits), summed over the supervised positions of step k and divided by their count
(a masked mean); total = sum_k 0.8^k L_k. SpecForge divides by B*T instead, which makes the loss scale
(and so the effective learning rate) depend on how much of a batch is prompt or padding, and quietly
down-weights later steps (they have fewer supervised positions) beyond 0.8^k. The per-step sums and
counts are returned too, so a trainer can normalise by the supervised-token count of a whole
accumulation window instead of per micro-batch.

Metrics: acc_k counts, over every prediction of a marked token (targets outside the draft vocab included:
the drafter can never propose them, and dropping them would inflate the estimate), how often the draft
argmax mapped through d2t equals the target's full-vocab argmax; full_acc_k requires steps 0..k all right
at the same index; accept_len_est = 1 + sum_k prod_{i<=k} acc_i (the 1 is the target's bonus token).

Shape letters: B rows, T tokens, H hidden, A*Ht aux width, K top-K, V target vocab, Vd draft vocab, S steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from eagle3.masks import positions_from_documents, same_document_ahead, shift_left, single_document_ids
from eagle3.model import AttnImpl, Eagle3Drafter, TTTCache, upcast
from eagle3.target import lm_head_name, read_tensor, target_info

TOKEN_SHIFT = 1
"""Step k at row index t reads token x_{t + TOKEN_SHIFT + k} and is scored against p_{t + TOKEN_SHIFT + k}."""
PREDICT_SHIFT = 2
"""...and predicts x_{t + PREDICT_SHIFT + k}, whose loss_mask bit decides supervision."""
PAD_TOKEN = 0
"""Fills token slots shifted past a document end; predictions from them are never supervised."""
STEP_DECAY = 0.8
"""Weight of step k is STEP_DECAY**k (EAGLE, SpecForge)."""


@dataclass
class TTTBatch:
    """One micro-batch of captured features; documents may be packed along T."""

    aux: Tensor  # [B, T, A*Ht] concatenated aux states
    input_ids: Tensor  # [B, T] target-vocab ids
    loss_mask: Tensor  # [B, T] 1 = a token the drafter should learn to produce
    document_ids: Tensor | None = None  # [B, T]; None = one document per row
    position_ids: Tensor | None = None  # [B, T]; None = restart at 0 per document
    final_hidden: Tensor | None = None  # [B, T, Ht] post-norm final state (supervision "final_hidden")
    topk_ids: Tensor | None = None  # [B, T, K] (supervision "topk_logprobs")
    topk_logprobs: Tensor | None = None  # [B, T, K] log-probs over the full target vocab


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

def load_target_lm_head(model_dir: Path | str) -> Tensor:
    """The target's full output projection [V, Ht] (the embeddings when the target ties them)."""
    return read_tensor(Path(model_dir), lm_head_name(target_info(Path(model_dir))))


@torch.no_grad()
def supervision_from_final(final_hidden: Tensor, lm_head_weight: Tensor, t2d: Tensor,
                           chunk_tokens: int = 1024) -> Supervision:
    """Target logits = final @ W^T, computed ``chunk_tokens`` tokens at a time so only [chunk, V] lives at once.

    The full-vocab logits are needed for the argmax (position mask, accuracy); the distribution keeps the
    draft-vocab columns and renormalises them.
    """
    batch, seq_len, _ = final_hidden.shape
    used = t2d.nonzero().squeeze(1)  # [Vd] target ids of the draft vocab, ascending = draft order
    probs, argmax = [], []
    for chunk in final_hidden.reshape(batch * seq_len, -1).split(chunk_tokens):
        logits = upcast(F.linear(chunk.to(lm_head_weight.dtype), lm_head_weight))  # [c, V]
        argmax.append(logits.argmax(-1))
        probs.append(torch.softmax(logits[:, used], dim=-1))  # [c, Vd]
    return Supervision(torch.cat(probs).view(batch, seq_len, -1), torch.cat(argmax).view(batch, seq_len))


@torch.no_grad()
def supervision_from_topk(topk_ids: Tensor, topk_logprobs: Tensor, t2d: Tensor) -> Supervision:
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
    probs = torch.zeros(*ids.shape[:2], int(t2d.sum()), device=ids.device)  # [B, T, Vd]
    probs.scatter_add_(-1, torch.where(inside, draft_index[ids], 0), mass)
    probs = probs / probs.sum(-1, keepdim=True).clamp_min(torch.finfo(probs.dtype).tiny)
    argmax = ids.gather(-1, topk_logprobs.argmax(-1, keepdim=True)).squeeze(-1)  # [B, T]
    return Supervision(probs, argmax)


# -------------------------------------------------------------------------------------------------- alignment

def align_step(input_ids: Tensor, loss_mask: Tensor, document_ids: Tensor, target_argmax: Tensor,
               t2d: Tensor, k: int) -> StepAlignment:
    """Inputs and masks of TTT step k; every shift that would cross a document end is cut there."""
    token_ok = same_document_ahead(document_ids, TOKEN_SHIFT + k)  # [B, T]
    predict_ok = same_document_ahead(document_ids, PREDICT_SHIFT + k)  # [B, T]
    tokens = torch.where(token_ok, shift_left(input_ids, TOKEN_SHIFT + k, PAD_TOKEN), PAD_TOKEN)
    argmax = torch.where(token_ok, shift_left(target_argmax, TOKEN_SHIFT + k, -1), -1)
    marked = predict_ok & shift_left(loss_mask.bool(), PREDICT_SHIFT + k, False)
    in_vocab = (argmax >= 0) & t2d[argmax.clamp(min=0)]
    return StepAlignment(tokens, argmax, marked, marked & in_vocab)


def step_soft_ce(logits: Tensor, probs: Tensor, shift: int) -> Tensor:
    """[B, T]: -sum_v probs[t + shift, v] * log_softmax(logits[t])_v, 0 where t + shift is past the row."""
    seq_len = logits.shape[1]
    n = max(seq_len - shift, 0)
    log_q = torch.log_softmax(upcast(logits[:, :n]), dim=-1)  # [B, n, Vd]
    ce = -(probs[:, shift:shift + n] * log_q).sum(-1)  # [B, n]
    return F.pad(ce, (0, seq_len - n))


# ----------------------------------------------------------------------------------------- loss and metrics

@dataclass
class TTTOutput:
    """The weighted loss plus per-step sums and counts (sum them across micro-batches before dividing)."""

    loss: Tensor  # [] sum_k decay^k * loss_sum[k] / max(num_supervised[k], 1); differentiable
    loss_sum: Tensor  # [S] soft CE summed over each step's supervised positions; differentiable
    num_supervised: Tensor  # [S] positions in each step's loss (position mask)
    num_predicted: Tensor  # [S] predictions of a marked token (accuracy denominators)
    num_correct: Tensor  # [S] of those, draft argmax (via d2t) == target argmax over the full vocab
    num_full_correct: Tensor  # [S] of those, every step <= k correct at the same row index
    step_decay: float = STEP_DECAY

    def metrics(self) -> dict[str, float]:
        """loss, loss_k, acc_k, full_acc_k, num_supervised_k and accept_len_est as floats (one device sync)."""
        return metrics_from_counts(self.loss_sum, self.num_supervised, self.num_predicted, self.num_correct,
                                   self.num_full_correct, self.step_decay)


def weighted_loss(loss_sum: Tensor, num_supervised: Tensor, step_decay: float = STEP_DECAY) -> Tensor:
    """sum_k decay^k * (loss_sum_k / max(n_k, 1)): a masked mean per step, then the step weights."""
    weights = step_decay ** torch.arange(len(loss_sum), device=loss_sum.device, dtype=loss_sum.dtype)
    return (weights * loss_sum / num_supervised.clamp_min(1)).sum()


def metrics_from_counts(loss_sum: Tensor, num_supervised: Tensor, num_predicted: Tensor, num_correct: Tensor,
                        num_full_correct: Tensor, step_decay: float = STEP_DECAY) -> dict[str, float]:
    """Per-step metrics from (possibly accumulated) sums; accept_len_est = 1 + sum_k prod_{i<=k} acc_i."""
    rows = torch.stack([loss_sum.detach().double() / num_supervised.clamp_min(1),
                        num_correct.double() / num_predicted.clamp_min(1),
                        num_full_correct.double() / num_predicted.clamp_min(1), num_supervised.double()])
    loss_k, acc_k, full_k, n_k = rows.cpu().tolist()  # the only device sync
    out = {"loss": sum(step_decay**k * value for k, value in enumerate(loss_k))}
    running, accept = 1.0, 1.0  # the leading 1 is the bonus token the target always adds, as engines count it
    for k, acc in enumerate(acc_k):
        running *= acc
        accept += running
        out |= {f"loss_{k}": loss_k[k], f"acc_{k}": acc, f"full_acc_{k}": full_k[k], f"num_supervised_{k}": n_k[k]}
    out["accept_len_est"] = accept
    return out


@torch.no_grad()
def _step_hits(logits: Tensor, d2t: Tensor, aligned: StepAlignment, chain: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(correct count, all-steps-correct count, updated chain [B, T]) over the predictions of a marked token."""
    draft_top = logits.argmax(-1)  # [B, T] draft ids
    hit = (draft_top + d2t[draft_top]) == aligned.target_argmax  # compared in target ids, full vocab
    chain = chain & hit
    marked = aligned.predicts_marked
    return (hit & marked).sum(), (chain & marked).sum(), chain


def _documents_and_positions(batch: TTTBatch) -> tuple[Tensor, Tensor]:
    b, t = batch.input_ids.shape
    docs = batch.document_ids if batch.document_ids is not None else single_document_ids(b, t, batch.input_ids.device)
    positions = batch.position_ids if batch.position_ids is not None else positions_from_documents(docs)
    return docs, positions  # [B, T] each


def ttt_loss(drafter: Eagle3Drafter, batch: TTTBatch, supervision: Supervision, t2d: Tensor, d2t: Tensor,
             ttt_steps: int, step_decay: float = STEP_DECAY, attn_impl: AttnImpl = "auto") -> TTTOutput:
    """Unroll ``ttt_steps`` steps of the drafter over one micro-batch and score every step (module docstring)."""
    docs, positions = _documents_and_positions(batch)
    hidden = drafter.project_aux(batch.aux)  # [B, T, H]
    cache, chain = TTTCache(), torch.ones_like(docs, dtype=torch.bool)
    sums, counts = [], []
    for k in range(ttt_steps):
        aligned = align_step(batch.input_ids, batch.loss_mask, docs, supervision.argmax, t2d, k)
        hidden, logits = drafter(hidden, aligned.input_ids, positions + k, docs, cache, attn_impl)  # [B,T,H], [B,T,Vd]
        ce = step_soft_ce(logits, supervision.probs, TOKEN_SHIFT + k)  # [B, T]
        sums.append(torch.where(aligned.position_mask, ce, torch.zeros_like(ce)).sum())
        correct, full_correct, chain = _step_hits(logits, d2t, aligned, chain)
        counts.append(torch.stack([aligned.position_mask.sum(), aligned.predicts_marked.sum(), correct, full_correct]))
    loss_sum, count = torch.stack(sums), torch.stack(counts).T  # [S], [4, S]
    return TTTOutput(weighted_loss(loss_sum, count[0], step_decay), loss_sum, *count, step_decay=step_decay)


class TTTObjective(nn.Module):
    """The drafter plus frozen supervision tensors; ``forward(batch)`` is the whole unroll (what DDP/FSDP wrap).

    The target lm_head, t2d and d2t are non-persistent buffers: they follow ``.to(device)`` but never enter
    the optimizer, the checkpoint or the export.
    """

    def __init__(self, drafter: Eagle3Drafter, t2d: Tensor, d2t: Tensor, target_lm_head: Tensor | None,
                 ttt_steps: int, step_decay: float = STEP_DECAY, attn_impl: AttnImpl = "auto",
                 chunk_tokens: int = 1024) -> None:
        super().__init__()
        self.drafter = drafter
        self.register_buffer("t2d", t2d.bool(), persistent=False)  # [V]
        self.register_buffer("d2t", d2t.long(), persistent=False)  # [Vd]
        self.register_buffer("target_lm_head", target_lm_head, persistent=False)  # [V, Ht] or None
        self.ttt_steps, self.step_decay = ttt_steps, step_decay
        self.attn_impl, self.chunk_tokens = attn_impl, chunk_tokens

    def supervision(self, batch: TTTBatch) -> Supervision:
        """From the final hidden state when the batch has it, else from its top-K log-probs."""
        if batch.final_hidden is not None:
            if self.target_lm_head is None:
                raise ValueError("final_hidden supervision needs the target lm_head (target_lm_head=None)")
            return supervision_from_final(batch.final_hidden, self.target_lm_head, self.t2d, self.chunk_tokens)
        if batch.topk_ids is None or batch.topk_logprobs is None:
            raise ValueError("the batch carries neither final_hidden nor topk_ids/topk_logprobs")
        return supervision_from_topk(batch.topk_ids, batch.topk_logprobs, self.t2d)

    def forward(self, batch: TTTBatch) -> TTTOutput:
        return ttt_loss(self.drafter, batch, self.supervision(batch), self.t2d, self.d2t, self.ttt_steps,
                        self.step_decay, self.attn_impl)
