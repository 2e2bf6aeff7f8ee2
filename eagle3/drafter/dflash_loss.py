"""The DFlash training objective: sample anchors in a row, draft a block at each, score it against the row.

For an anchor at position p (a real token of the row), the block is [x_p, mask, ..., mask] at positions
p .. p+K-1; it sees the target's context features of its own document strictly before p (as at decoding time,
where the anchor's own target states do not exist yet) and its own K tokens, no other block. The output at slot
k >= 1, read through the target's lm_head, is scored against the token AT position p+k (same-position
prediction, no shift: docs/dflash.md, "The block"). Slot 0 is never scored.

    supervised(b, n, k) = valid[b, n] and p+k < T and x_{p+k} in p's document and loss_mask[p+k] = 1
    w_k                 = exp(-(k-1) / gamma)            (gamma None: w_k = 1)
    loss                = sum w_k * CE(b, n, k) / sum w_k      over the supervised (b, n, k)
    CE(b, n, k)         = -sum_v P_{p+k-1}(v) log q_k(v)   with a teacher (the target's own distribution at p+k-1,
                          i.e. its prediction of the token at p+k: what a verify accepts), else -log q_k(x_{p+k})

A draft counts as right when it equals the target's argmax at p+k-1 (EAGLE-3's accuracy, and what greedy
verification accepts) whenever the batch carries the target's supervision, whichever the labels; otherwise when
it equals x_{p+k}. The token labels are SpecForge's
objective (specforge/core/dflash.py ``OnlineDFlashModel.forward``: same-position labels, the anchor slot
excluded, the loss mask and the row end applied, ``loss_decay_gamma`` weights normalised by their sum) with
packed documents added. The teacher is EAGLE-3's supervision (eagle3.drafter.alignment) over the full vocab: it
matters when the row's answers were not written by the target, whose own greedy tokens are what drafts must
match. All N blocks of a row run in ONE drafter forward: the row's features are the context of every block and
``block_visibility`` cuts each block's view at its own anchor and document start, so the result equals one
decode call per block (tests/unit/test_dflash_loss.py checks it).

Shape letters used in the comments:
    B   rows          T   tokens per row (the context: every token's target features)     N   anchors per row
    K   block size    H   hidden size     F*H  concatenated context features              V   target vocab
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from eagle3.drafter.alignment import Supervision, supervision_from_topk
from eagle3.drafter.dflash import DFlashDrafter
from eagle3.drafter.dflash_blocks import block_input_ids, block_positions, block_visibility, flex_block_visibility
from eagle3.drafter.functional import AttnImpl, resolve_attn_impl, upcast
from eagle3.drafter.masks import positions_from_documents, same_document_ahead, shift_left, single_document_ids
from eagle3.drafter.ttt import TTTBatch

# ------------------------------------------------------------------------------------------------ anchors


def anchor_candidates(loss_mask: Tensor, block_size: int, document_ids: Tensor | None = None) -> Tensor:
    """bool [B, T]: p may anchor a block, i.e. p .. p+K-1 lie inside the row and inside p's document, and at
    least one of the block's targets p+1 .. p+K-1 is supervised (loss_mask = 1)."""
    batch, seq_len = loss_mask.shape
    docs = single_document_ids(batch, seq_len, loss_mask.device) if document_ids is None else document_ids
    # Documents are contiguous runs, so "p+K-1 exists and shares p's document" keeps the whole block in it.
    inside = same_document_ahead(docs, block_size - 1)  # [B, T]
    marked = (loss_mask > 0).long().cumsum(dim=1)  # [B, T] supervised tokens in 0 .. t
    # marked[p+K-1] - marked[p] counts the supervised targets p+1 .. p+K-1; past the row `inside` is False, so
    # the shift's fill never matters.
    has_target = (shift_left(marked, block_size - 1, 0) - marked) > 0
    return inside & has_target


def sample_anchors(
    loss_mask: Tensor, block_size: int, num_blocks: int, generator: torch.Generator, document_ids: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Up to ``num_blocks`` distinct anchors per row, uniformly without replacement among anchor_candidates.

    Returns (anchors int64 [B, N], valid bool [B, N]): each row's chosen anchors in ascending order, then
    padding (anchor 0, valid False) when the row has fewer than N candidates. N is always ``num_blocks`` (a
    fixed shape, so a compiled step or a cached block mask sees one shape per row length). Deterministic given
    the generator's state: the random keys are drawn on the generator's device, then moved.

    Follows SpecForge's ``OnlineDFlashModel._sample_anchor_positions`` (specforge/core/dflash.py): a uniform
    random key per candidate, the smallest N keys taken, sorted by position, a keep mask for the padding, and
    only anchors whose full block fits in the row. Two deliberate differences: SpecForge asks for
    loss_mask[p] = 1 at the anchor itself, we ask for a supervised TARGET among p+1 .. p+K-1 (our convention,
    as eagle3.drafter.alignment's: a prediction counts iff the token it predicts is marked; so the block anchored at
    the last prompt token, which drafts the answer's first tokens, is trained, and a block whose targets are
    all unmarked is never drawn to score nothing); and the block must stay inside one packed document
    (SpecForge's rows are single documents). SpecForge also trims N to the largest row's count; we keep it fixed.
    """
    batch, seq_len = loss_mask.shape
    candidates = anchor_candidates(loss_mask, block_size, document_ids)  # [B, T]
    keys = torch.rand(batch, seq_len, generator=generator, device=generator.device).to(loss_mask.device)
    keys = torch.where(candidates, keys, 2.0)  # non-candidates sort after every candidate
    take = min(num_blocks, seq_len)
    chosen = keys.argsort(dim=1, stable=True)[:, :take]  # [B, take] positions, candidates first
    chosen_ok = candidates.gather(1, chosen)
    # Ascending positions, the padding last: give the padding a position past the row before sorting.
    ordered = torch.where(chosen_ok, chosen, seq_len).sort(dim=1).values
    valid = ordered < seq_len
    anchors = torch.where(valid, ordered, 0)
    pad = num_blocks - take
    if pad:
        anchors = F.pad(anchors, (0, pad), value=0)
        valid = F.pad(valid, (0, pad), value=False)
    return anchors, valid


# -------------------------------------------------------------------------------------------- the teacher


def teacher_index(anchors: Tensor, block_size: int, seq_len: int) -> Tensor:
    """int64 [B, N, K-1]: p+k-1 for slot k = 1 .. K-1, the row index whose target distribution predicts the token
    at p+k (clamped into the row: a slot past the row end is never supervised)."""
    index = anchors[..., None] + torch.arange(block_size - 1, device=anchors.device)
    return index.clamp(max=seq_len - 1)


def _at_slots(x: Tensor, flat: Tensor) -> Tensor:
    """x [B, T, D] at the row indices flat [B, M] -> [B, M, D]."""
    return x.gather(1, flat[..., None].expand(-1, -1, x.shape[-1]))


@torch.no_grad()
def block_teacher(batch: TTTBatch, anchors: Tensor, block_size: int, lm_head_weight: Tensor) -> Supervision | None:
    """The target's distribution over its FULL vocab for every block slot: probs fp32 [B, N, K-1, V], argmax
    [B, N, K-1]; None when the batch carries no supervision.

    From ``final_hidden`` through the target's lm_head (only the N*(K-1) gathered positions, so never a [T, V]
    tensor), or from the top-K log-probs (eagle3.drafter.alignment.supervision_from_topk with every id in vocab).
    """
    index = teacher_index(anchors, block_size, batch.input_ids.shape[1])  # [B, N, K-1]
    flat = index.flatten(1)  # [B, M]
    if batch.final_hidden is not None:
        logits = F.linear(_at_slots(batch.final_hidden, flat).to(lm_head_weight.dtype), lm_head_weight)  # [B, M, V]
        probs = torch.softmax(upcast(logits), dim=-1)
        return Supervision(probs.view(*index.shape, -1), logits.argmax(-1).view_as(index))
    if batch.topk_ids is not None and batch.topk_logprobs is not None:
        vocab = lm_head_weight.shape[0]
        every = torch.ones(vocab, dtype=torch.bool, device=index.device)
        sup = supervision_from_topk(_at_slots(batch.topk_ids, flat), _at_slots(batch.topk_logprobs, flat), every, vocab)
        return Supervision(sup.probs.view(*index.shape, -1), sup.argmax.view_as(index))
    return None


@torch.no_grad()
def block_target_argmax(
    batch: TTTBatch, anchors: Tensor, block_size: int, lm_head_weight: Tensor, chunk: int = 0
) -> Tensor | None:
    """block_teacher's argmax alone [B, N, K-1] (no softmax over the vocab); None without supervision.
    ``chunk``: slots per lm_head product (0: all at once), so no [B, N*(K-1), V] logits exist at once."""
    index = teacher_index(anchors, block_size, batch.input_ids.shape[1])
    flat = index.flatten(1)
    if batch.final_hidden is not None:
        hidden = _at_slots(batch.final_hidden, flat).to(lm_head_weight.dtype)  # [B, M, H]
        step = flat.shape[1] if chunk <= 0 else max(1, chunk // flat.shape[0])
        parts = [F.linear(hidden[:, s : s + step], lm_head_weight).argmax(-1) for s in range(0, flat.shape[1], step)]
        return torch.cat(parts, dim=1).view_as(index)
    if batch.topk_ids is not None and batch.topk_logprobs is not None:
        best = _at_slots(batch.topk_logprobs, flat).argmax(-1, keepdim=True)  # [B, M, 1]
        return _at_slots(batch.topk_ids, flat).gather(-1, best).squeeze(-1).long().view_as(index)
    return None


# ---------------------------------------------------------------------------------------------- the loss


@dataclass
class DFlashLossOutput:
    """The weighted loss plus per-slot sums and counts for slots k = 1 .. K-1 (index k-1); sum the sums and
    counts across micro-batches before dividing, as eagle3.drafter.ttt.TTTOutput."""

    loss: Tensor  # [] sum_k w_k * loss_sum[k] / max(sum_k w_k * num_supervised[k], tiny); differentiable
    loss_sum: Tensor  # [K-1] unweighted CE summed over each slot's supervised targets; differentiable
    num_supervised: Tensor  # [K-1] supervised targets per slot
    num_correct: Tensor  # [K-1] of those, argmax of the draft logits == the reference
    num_full_correct: Tensor  # [K-1] of those, slots 1 .. k of the block all right (a verify would accept k)
    reference: Tensor  # [B, N, K-1] what a draft is counted right against: the teacher's argmax, else the token
    supervised: Tensor  # [B, N, K-1] bool, block_targets' mask

    def slot_accuracy(self) -> Tensor:
        """[K-1] per-slot accuracy (0 where a slot has no supervised target)."""
        return self.num_correct.double() / self.num_supervised.clamp_min(1)


def slot_weights(block_size: int, gamma: float | None, device: torch.device | str = "cpu") -> Tensor:
    """float32 [K-1]: w_k = exp(-(k-1)/gamma) for slots k = 1 .. K-1 (slot 1 weighs 1); ones when gamma is None.

    SpecForge's ``loss_decay_gamma``: the first drafts decide the accepted length (a draft counts only when every
    earlier one was accepted), so later slots may weigh less.
    """
    k = torch.arange(1, block_size, device=device, dtype=torch.float32)
    if gamma is None:
        return torch.ones_like(k)
    if not gamma > 0 or math.isinf(gamma):
        raise ValueError(f"gamma must be a positive finite number or None, got {gamma}")
    return torch.exp(-(k - 1) / gamma)


def block_targets(
    input_ids: Tensor, loss_mask: Tensor, document_ids: Tensor, anchors: Tensor, valid: Tensor, block_size: int
) -> tuple[Tensor, Tensor]:
    """(targets int64 [B, N, K-1], supervised bool [B, N, K-1]): the token at p+k for slot k = 1 .. K-1, and
    whether it is scored (the anchor valid, p+k inside the row and p's document, loss_mask[p+k] = 1).

    Checked here rather than trusted from sample_anchors, so that any anchors (hand-made ones too) are safe."""
    seq_len = input_ids.shape[1]
    index = anchors[..., None] + torch.arange(1, block_size, device=anchors.device)  # [B, N, K-1]
    inside = index < seq_len
    safe = index.clamp(max=seq_len - 1).flatten(1)  # [B, N*(K-1)]: gathers need in-row indices

    def at(x: Tensor) -> Tensor:
        return x.gather(1, safe).view_as(index)

    same_doc = at(document_ids) == document_ids.gather(1, anchors)[..., None]
    supervised = valid[..., None] & inside & same_doc & (at(loss_mask) > 0)
    return at(input_ids), supervised


def _slot_ce(
    hidden: Tensor, logits_of: Callable[[Tensor], Tensor], targets: Tensor, probs: Tensor | None
) -> tuple[Tensor, Tensor]:
    """hidden [M, H] of M slots through ``logits_of`` (DFlashDrafter.logits, the target's lm_head): (CE [M] against
    probs [M, V] if given, else against targets [M]; the drafts, argmax [M]). The logits are fp32 at least."""
    logits = upcast(logits_of(hidden))  # [M, V]
    if probs is None:
        ce = F.cross_entropy(logits, targets, reduction="none")
    else:
        ce = -(probs * torch.log_softmax(logits, dim=-1)).sum(-1)
    return ce, logits.detach().argmax(dim=-1)


def slot_cross_entropy(
    hidden: Tensor, logits_of: Callable[[Tensor], Tensor], targets: Tensor, probs: Tensor | None, chunk: int = 0
) -> tuple[Tensor, Tensor]:
    """Every slot's CE and draft: hidden [B, N, K-1, H] read by ``logits_of`` (DFlashDrafter.logits), targets
    [B, N, K-1], probs [B, N, K-1, V] or None -> (CE, argmax), each [B, N, K-1].

    ``chunk`` > 0 and fewer than the slots: ``chunk`` slots at a time, each under activation checkpointing, so
    one chunk's [chunk, V] logits (and their softmax) live at a time instead of [B*N*(K-1), V]; the backward
    recomputes them. Slot by slot the same numbers either way.
    """
    shape = targets.shape
    h, t = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    p = None if probs is None else probs.reshape(-1, probs.shape[-1])
    if chunk <= 0 or t.numel() <= chunk:
        ce, drafts = _slot_ce(h, logits_of, t, p)
        return ce.view(shape), drafts.view(shape)
    parts = []
    for s in range(0, t.numel(), chunk):
        part = (h[s : s + chunk], logits_of, t[s : s + chunk], None if p is None else p[s : s + chunk])
        if torch.is_grad_enabled():
            parts.append(checkpoint(_slot_ce, *part, use_reentrant=False))
        else:
            parts.append(_slot_ce(*part))
    ce, drafts = (torch.cat(x) for x in zip(*parts, strict=True))
    return ce.view(shape), drafts.view(shape)


def dflash_loss(
    drafter: DFlashDrafter,
    features: Tensor,
    input_ids: Tensor,
    loss_mask: Tensor,
    anchors: Tensor,
    valid: Tensor,
    document_ids: Tensor | None = None,
    gamma: float | None = None,
    teacher: Supervision | None = None,
    reference: Tensor | None = None,
    *,
    attn: Literal["dense", "flex"] = "dense",
    chunk: int = 0,
) -> DFlashLossOutput:
    """The DFlash loss of N blocks per row in one drafter forward.

    features [B, T, F*H] (the target's states for every token of the row, ascending layer order), input_ids and
    loss_mask [B, T], anchors int64 and valid bool [B, N] (sample_anchors), document_ids [B, T] for packed rows
    (None: one document per row). ``teacher`` (block_teacher): the CE is against its distribution, else against
    the row's tokens. A draft is counted right when it equals ``reference`` [B, N, K-1] (block_target_argmax),
    else the teacher's argmax, else the row's token.
    Positions restart at 0 in every document, as each document is served alone (RoPE makes only differences
    matter, but this keeps them within max_position_embeddings as served).
    Invalid anchors still run (a fixed shape) but score nothing. ``attn``: the blocks' attention as a dense bool
    mask or a flex BlockMask (the same keys); ``chunk``: slots per lm_head chunk (slot_cross_entropy).
    """
    d = drafter.dims
    batch, seq_len = input_ids.shape
    k_size = d.block_size
    docs = single_document_ids(batch, seq_len, input_ids.device) if document_ids is None else document_ids
    positions = positions_from_documents(docs)  # [B, T]
    doc_start = torch.arange(seq_len, device=docs.device) - positions  # [B, T] first index of t's document

    # Each block sees its document's context strictly before its anchor, and its own K tokens.
    see = flex_block_visibility if attn == "flex" else block_visibility
    visible = see(anchors, seq_len, k_size, context_start=doc_start.gather(1, anchors))
    ids = block_input_ids(input_ids.gather(1, anchors), k_size, d.mask_token_id)  # [B, N*K]
    hidden = drafter(features, positions, ids, block_positions(positions.gather(1, anchors), k_size), visible)
    hidden = hidden.view(batch, anchors.shape[1], k_size, -1)[:, :, 1:]  # [B, N, K-1, H]: slot 0 is never scored

    targets, supervised = block_targets(input_ids, loss_mask, docs, anchors, valid, k_size)
    probs = None if teacher is None else teacher.probs
    ce, drafts = slot_cross_entropy(hidden, drafter.logits, targets, probs, chunk)  # [B, N, K-1] x 2
    if reference is None:
        reference = targets if teacher is None else teacher.argmax
    mask = supervised.to(ce.dtype)
    loss_sum = (ce * mask).sum(dim=(0, 1))  # [K-1]
    num_supervised = supervised.sum(dim=(0, 1))  # [K-1]
    w = slot_weights(k_size, gamma, ce.device).to(ce.dtype)
    # A weighted mean (SpecForge divides by the weights' sum too): uniform weights give the plain mean, and a
    # batch with nothing supervised gives 0 (still attached to the graph) instead of NaN.
    loss = (w * loss_sum).sum() / (w * num_supervised).sum().clamp_min(torch.finfo(ce.dtype).tiny)
    with torch.no_grad():
        hits = drafts == reference  # [B, N, K-1]
        num_correct = (hits & supervised).sum(dim=(0, 1))
        # Slot k is accepted only after slots 1 .. k-1 were: the run of hits from the block's start.
        num_full_correct = (hits.int().cumprod(dim=-1).bool() & supervised).sum(dim=(0, 1))
    return DFlashLossOutput(loss, loss_sum, num_supervised, num_correct, num_full_correct, reference, supervised)


# ---------------------------------------------------------------------------------------------- the objective


class DFlashObjective(nn.Module):
    """The drafter and how a trainer feeds it (what DDP/FSDP wrap): its context features out of the captured aux
    states, the anchors of each row, the loss.

    ``feature_index``: for each of the drafter's target layers (ascending, fc's order), its place in the captured
    aux concatenation of ``num_aux`` layers; so one capture serves an EAGLE-3 and a DFlash drafter, and a DFlash
    drafter may read a subset of the captured layers. ``attn_impl``: the blocks' attention kernel (auto = flex on
    CUDA, dense elsewhere); ``loss_chunk``: slots per lm_head chunk of the loss (0: all at once).
    """

    def __init__(
        self,
        drafter: DFlashDrafter,
        feature_index: list[int],
        num_aux: int,
        num_blocks: int,
        gamma: float | None = None,
        labels: Literal["tokens", "target"] = "tokens",
        attn_impl: AttnImpl = "auto",
        loss_chunk: int = 0,
    ) -> None:
        super().__init__()
        if sorted(feature_index) != feature_index or not all(0 <= i < num_aux for i in feature_index):
            raise ValueError(f"feature_index {feature_index} must be ascending places among {num_aux} aux layers")
        if len(feature_index) != drafter.dims.num_context_features:
            raise ValueError(
                f"{len(feature_index)} feature layers for a drafter whose fc reads {drafter.dims.num_context_features}"
            )
        self.drafter, self.feature_index, self.num_aux = drafter, list(feature_index), num_aux
        self.num_blocks, self.gamma, self.labels = num_blocks, gamma, labels
        self.attn_impl, self.loss_chunk = attn_impl, loss_chunk

    @property
    def num_slots(self) -> int:
        """Scored slots per block: K-1."""
        return self.drafter.dims.block_size - 1

    def features(self, aux: Tensor) -> Tensor:
        """[B, T, A*H] captured aux states -> [B, T, F*H] the drafter's context features (its layers, in order)."""
        if self.feature_index == list(range(self.num_aux)):
            return aux
        batch, seq_len, _ = aux.shape
        return aux.view(batch, seq_len, self.num_aux, -1)[:, :, self.feature_index].flatten(2)

    def anchors(self, batch: TTTBatch, seed: int) -> tuple[Tensor, Tensor]:
        """(anchors, valid) [B, N] of a row: sample_anchors from a CPU generator seeded by ``seed`` (the same row
        gets the same anchors on every device and after a resume)."""
        generator = torch.Generator().manual_seed(seed)
        return sample_anchors(
            batch.loss_mask, self.drafter.dims.block_size, self.num_blocks, generator, batch.document_ids
        )

    def supervised_counts(self, batch: TTTBatch, anchors: tuple[Tensor, Tensor]) -> Tensor:
        """[K-1] targets each slot is scored on (block_targets' mask; no drafter forward)."""
        docs = batch.document_ids
        if docs is None:
            docs = single_document_ids(batch.input_ids.shape[0], batch.input_ids.shape[1], batch.input_ids.device)
        _, supervised = block_targets(batch.input_ids, batch.loss_mask, docs, *anchors, self.drafter.dims.block_size)
        return supervised.sum(dim=(0, 1))

    def forward(self, batch: TTTBatch, anchors: tuple[Tensor, Tensor]) -> DFlashLossOutput:
        """dflash_loss of the row's blocks (``anchors``: this objective's ``anchors`` of the batch), with the
        target's distribution as the teacher whenever the batch carries the target's supervision."""
        assert batch.aux is not None, "online features fill aux first"
        k_size, head = self.drafter.dims.block_size, self.drafter.lm_head.weight
        teacher, reference = None, None
        if self.labels == "target":
            teacher = block_teacher(batch, anchors[0], k_size, head)
            if teacher is None:
                raise ValueError(
                    "drafter.dflash.labels=target needs the target's supervision in the batch (final_hidden or "
                    "topk_logprobs features), and this batch has neither"
                )
        else:
            reference = block_target_argmax(batch, anchors[0], k_size, head, self.loss_chunk)
        return dflash_loss(
            self.drafter,
            self.features(batch.aux),
            batch.input_ids,
            batch.loss_mask,
            *anchors,
            batch.document_ids,
            self.gamma,
            teacher,
            reference,
            attn=resolve_attn_impl(self.attn_impl, batch.input_ids.device),
            chunk=self.loss_chunk,
        )
