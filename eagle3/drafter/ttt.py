"""Training-time test (TTT): the EAGLE-3 unroll, its alignment, loss and metrics.

Alignment (our convention: a prediction is supervised iff the token it predicts is marked in
``loss_mask``). A row holds tokens x_0..x_{T-1}; g_t are the target's aux states at position t and p_j
is the target's distribution at position j (its prediction of x_{j+1}). At TTT step k, row index t:
    feature    fc(g_t) at k = 0, else the drafter's own step-(k-1) pre-norm output at index t
    token      x_{t+1+k}                 (teacher forced: TOKEN_SHIFT + k)
    position   pos_t + k                 (pos restarts at 0 in every packed document)
    predicts   x_{t+2+k}, scored against p_{t+1+k}
    supervised iff loss_mask[t+2+k] = 1 (PREDICT_SHIFT + k), x_{t+2+k} lies in t's document, and the
               target's full-vocab argmax at t+1+k is in the draft vocab (SpecForge's position mask).
Upstream offsets: SpecForge (specforge/core/eagle3.py) reads loss_mask[t] (two tokens before the predicted
one), speculators (src/speculators/models/eagle3/core.py) loss_mask[t+1+k] (the input token); we read the bit
of the predicted token itself, which is what tokenization marks: "the tokens the drafter should learn to produce".

Loss: L_k = soft cross-entropy between softmax(target logits restricted to the draft vocab) and
log_softmax(draft logits), summed over the supervised positions of step k and divided by their count
(a masked mean); total = sum_k 0.8^k L_k. SpecForge divides by B*T instead, which makes the loss scale
(and so the effective learning rate) depend on how much of a batch is prompt or padding, and quietly
down-weights later steps (they have fewer supervised positions) beyond 0.8^k. The per-step sums and
counts are returned too, so a trainer can normalise by the supervised-token count of a whole
accumulation window instead of per micro-batch. ``train.loss`` (a TokenLoss) may score the positions by an
acceptance-targeted loss instead of the soft cross-entropy (eagle3.drafter.acceptance); sums, masks,
counts and step weights stay as described.

Metrics: acc_k counts, over every prediction of a marked token (targets outside the draft vocab included:
the drafter can never propose them, and dropping them would inflate the estimate), how often the draft
argmax mapped through d2t equals the target's full-vocab argmax; full_acc_k requires steps 0..k all right
at the same index; accept_len_est = 1 + sum_k prod_{i<=k} acc_i (the 1 is the target's bonus token).

How the unroll runs (StepOptions; TrainConfig's compile, loss_chunk_tokens, reuse_block_mask) never changes
what it computes, only the float rounding: the plain path calls the drafter module per step and scores with
log_softmax; the fast path casts the linear weights once per micro-batch, runs the step as two compiled
functions around the attention, builds one flex block mask for all steps, and scores each step with
ChunkedSoftCE (per token chunk: logsumexp in fp32, the logits gradient recomputed in backward), so no fp32
[T, Vd] tensor is ever materialised. Tests compare every path with a loop-by-loop reference.

Shape letters: B rows, T tokens, H hidden, A*Ht aux width, K top-K, V target vocab, Vd draft vocab, S steps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from eagle3.drafter.acceptance import SOFT_CE, TokenLoss, acceptance_kernels, step_token_loss
from eagle3.drafter.masks import (
    positions_from_documents,
    same_document_ahead,
    shift_left,
    single_document_ids,
    ttt_block_masks,
)
from eagle3.drafter.model import (
    AttnImpl,
    Eagle3Drafter,
    TTTCache,
    attention_inputs,
    compiled_step_pieces,
    flex_attention_over,
    resolve_attn_impl,
    rope_cos_sin,
    rope_inv_freq_on,
    step_outputs,
    step_weights,
    ttt_attention,
    upcast,
)

TOKEN_SHIFT = 1
"""Step k at row index t reads token x_{t + TOKEN_SHIFT + k} and is scored against p_{t + TOKEN_SHIFT + k}."""
PREDICT_SHIFT = 2
"""...and predicts x_{t + PREDICT_SHIFT + k}, whose loss_mask bit decides supervision."""
PAD_TOKEN = 0
"""Fills token slots shifted past a document end; predictions from them are never supervised."""
STEP_DECAY = 0.8
"""Weight of step k is STEP_DECAY**k (EAGLE, SpecForge)."""
FLEX_BLOCK = 128
"""flex_attention's default block size: one block mask serves all steps when T is a multiple of it."""


@dataclass(frozen=True)
class StepOptions:
    """How the unroll runs on the device, never what it computes (results agree up to float rounding).

    The defaults are the plain path: the drafter module per step and log_softmax for the loss.
    """

    compile_backend: str | None = None
    """torch.compile backend for the step's pieces and the fused loss ("inductor" on CUDA); None = eager."""
    loss_chunk_tokens: int = 0
    """Fused soft cross-entropy over this many tokens at a time (no fp32 [T, Vd] tensors); 0 = log_softmax path."""
    reuse_block_mask: bool = False
    """flex: one block mask per micro-batch over a fixed S*T key layout instead of one per step."""

    @property
    def functional_step(self) -> bool:
        """Whether the step runs as functions over once-cast weights (see _FunctionalUnroll) instead of the module."""
        return self.compile_backend is not None or self.reuse_block_mask


@dataclass
class TTTBatch:
    """One micro-batch of captured features; documents may be packed along T."""

    aux: Tensor | None  # [B, T, A*Ht] concatenated aux states; None until online features fill them
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

@torch.no_grad()
def supervision_from_final(final_hidden: Tensor, lm_head_weight: Tensor, t2d: Tensor,
                           chunk_tokens: int = 1024, draft_ids: Tensor | None = None) -> Supervision:
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
def supervision_from_topk(topk_ids: Tensor, topk_logprobs: Tensor, t2d: Tensor,
                          draft_vocab_size: int | None = None) -> Supervision:
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


def align_steps(input_ids: Tensor, loss_mask: Tensor, document_ids: Tensor, target_argmax: Tensor, t2d: Tensor,
                num_steps: int) -> list[StepAlignment]:
    """align_step for k = 0..S-1, computed together: a dozen [B, S, T] ops instead of ~25 small ones per step."""
    batch, seq_len = input_ids.shape
    steps = torch.arange(num_steps, device=input_ids.device)
    index = torch.arange(seq_len, device=input_ids.device)

    def ahead(x: Tensor, first: int, fill: int | bool) -> Tensor:  # [B, S, T]: x[:, t + first + k], fill past the row
        padded = torch.cat([x, x.new_full((batch, first + num_steps), fill)], dim=1)
        return padded.unfold(1, seq_len, 1)[:, first:first + num_steps]

    def same_document(first: int) -> Tensor:  # [B, S, T]: token t + first + k exists and shares t's document
        inside = (index + first + steps[:, None]) < seq_len  # [S, T]
        return inside & (ahead(document_ids, first, 0) == document_ids[:, None])

    token_ok, predict_ok = same_document(TOKEN_SHIFT), same_document(PREDICT_SHIFT)
    tokens = torch.where(token_ok, ahead(input_ids, TOKEN_SHIFT, PAD_TOKEN), PAD_TOKEN)
    argmax = torch.where(token_ok, ahead(target_argmax, TOKEN_SHIFT, -1), -1)
    marked = predict_ok & ahead(loss_mask.bool(), PREDICT_SHIFT, False)
    in_loss = marked & (argmax >= 0) & t2d[argmax.clamp(min=0)]
    return [StepAlignment(tokens[:, k], argmax[:, k], marked[:, k], in_loss[:, k]) for k in range(num_steps)]


def step_soft_ce(logits: Tensor, probs: Tensor, shift: int) -> Tensor:
    """[B, T]: -sum_v probs[t + shift, v] * log_softmax(logits[t])_v, 0 where t + shift is past the row."""
    seq_len = logits.shape[1]
    n = max(seq_len - shift, 0)
    log_q = torch.log_softmax(upcast(logits[:, :n]), dim=-1)  # [B, n, Vd]
    ce = -(probs[:, shift:shift + n] * log_q).sum(-1)  # [B, n]
    return F.pad(ce, (0, seq_len - n))


# ------------------------------------------------------------------------------------- fused soft cross-entropy

def soft_ce_chunk(logits: Tensor, probs: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(sum of the masked CE [], logsumexp [c], draft argmax [c]) of logits [c, Vd] against probs [c, Vd].

    CE_t = -sum_v p_tv (x_tv - lse_t), with x the logits widened to fp32 inside the kernel only.
    """
    x = upcast(logits)
    lse = torch.logsumexp(x, dim=-1)  # [c]
    ce = -(probs.to(x.dtype) * (x - lse[:, None])).sum(-1)  # [c]
    return torch.where(mask, ce, 0).sum(), lse, logits.argmax(-1)


def soft_ce_chunk_grad(logits: Tensor, probs: Tensor, mask: Tensor, lse: Tensor, grad_sum: Tensor) -> Tensor:
    """d(grad_sum * CE sum)/d logits [c, Vd] = grad_sum * (softmax(x) * sum_v p - p) on masked rows (logits' dtype)."""
    x = upcast(logits)
    p = probs.to(x.dtype)
    grad = torch.exp(x - lse[:, None]) * p.sum(-1, keepdim=True) - p  # [c, Vd]
    return torch.where(mask[:, None], grad * grad_sum, 0).to(logits.dtype)


@lru_cache(maxsize=4)
def compiled_loss_kernels(backend: str = "inductor") -> tuple[Any, Any]:
    """soft_ce_chunk and soft_ce_chunk_grad under torch.compile: each becomes one or two fused passes."""
    return (torch.compile(soft_ce_chunk, dynamic=False, backend=backend),
            torch.compile(soft_ce_chunk_grad, dynamic=False, backend=backend))


class ChunkedSoftCE(torch.autograd.Function):
    """Masked soft-CE sum of one TTT step, token chunk by token chunk, never holding fp32 [N, Vd] tensors.

    The kernels decide the token loss: soft_ce_chunk and its gradient, or an acceptance-targeted loss's
    (eagle3.drafter.acceptance.acceptance_kernels, same signatures).

    Forward keeps only the logsumexp per token; backward recomputes softmax per chunk and returns the
    logits gradient in the logits' dtype (one rounding, as the log_softmax path's cast back does).
    """

    @staticmethod
    def forward(ctx: Any, logits: Tensor, probs: Tensor, mask: Tensor, shift: int, chunk: int,
                kernels: tuple[Callable, Callable]) -> tuple[Tensor, Tensor]:
        # logits [B, T, Vd]; probs [B*T + pad, Vd] flat with rows past the end (pad >= shift); mask [B, T] bool.
        flat, flat_mask = logits.reshape(-1, logits.shape[-1]), mask.reshape(-1)
        bounds = _chunk_bounds(flat.shape[0], chunk)
        parts = [kernels[0](flat[a:b], probs[a + shift:b + shift], flat_mask[a:b]) for a, b in bounds]
        loss_sum = parts[0][0] if len(parts) == 1 else torch.stack([p[0] for p in parts]).sum()
        lse, top = (torch.cat([p[i] for p in parts]) if len(parts) > 1 else parts[0][i] for i in (1, 2))
        ctx.save_for_backward(logits, probs, flat_mask, lse)
        ctx.shift, ctx.bounds, ctx.kernels = shift, bounds, kernels
        ctx.mark_non_differentiable(top)
        return loss_sum, top.view(mask.shape)

    @staticmethod
    def backward(ctx: Any, grad_sum: Tensor, _grad_top: Any) -> tuple[Tensor | None, ...]:
        logits, probs, mask, lse = ctx.saved_tensors
        flat, shift = logits.reshape(-1, logits.shape[-1]), ctx.shift
        grads = [ctx.kernels[1](flat[a:b], probs[a + shift:b + shift], mask[a:b], lse[a:b], grad_sum)
                 for a, b in ctx.bounds]
        grad = grads[0] if len(grads) == 1 else torch.cat(grads)
        return grad.view(logits.shape), None, None, None, None, None


def _chunk_bounds(num_rows: int, chunk: int) -> list[tuple[int, int]]:
    return [(a, min(a + chunk, num_rows)) for a in range(0, num_rows, chunk)]


def pad_probs(probs: Tensor, num_steps: int) -> Tensor:
    """[B*T + S, Vd]: the flat target probs plus S zero rows, so step k's read at row + 1 + k (< B*T + S) stays inside.

    Reads past a row's end land in the next row or the zeros; the position mask never supervises them.
    """
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.cat([flat, flat.new_zeros(num_steps, flat.shape[1])])


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
def _step_hits(draft_top: Tensor, d2t: Tensor, aligned: StepAlignment, chain: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(correct count, all-steps-correct count, updated chain [B, T]) over the predictions of a marked token."""
    hit = (draft_top + d2t[draft_top]) == aligned.target_argmax  # draft_top [B, T]; compared in target ids
    chain = chain & hit
    marked = aligned.predicts_marked
    return (hit & marked).sum(), (chain & marked).sum(), chain


def _documents_and_positions(batch: TTTBatch) -> tuple[Tensor, Tensor]:
    b, t = batch.input_ids.shape
    docs = batch.document_ids if batch.document_ids is not None else single_document_ids(b, t, batch.input_ids.device)
    positions = batch.position_ids if batch.position_ids is not None else positions_from_documents(docs)
    return docs, positions  # [B, T] each


StepFn = Callable[[Tensor, Tensor, int], tuple[Tensor, Tensor]]
"""(feature [B, T, H], input ids [B, T], step k) -> (pre-norm output [B, T, H], draft logits [B, T, Vd])."""
ScoreFn = Callable[[Tensor, Tensor, int], tuple[Tensor, Tensor]]
"""(logits [B, T, Vd], position mask [B, T], step k) -> (masked loss sum [], draft argmax [B, T])."""


def ttt_loss(drafter: Eagle3Drafter, batch: TTTBatch, supervision: Supervision, t2d: Tensor, d2t: Tensor,
             ttt_steps: int, step_decay: float = STEP_DECAY, attn_impl: AttnImpl = "auto",
             options: StepOptions | None = None, loss: TokenLoss = SOFT_CE) -> TTTOutput:
    """Unroll ``ttt_steps`` steps of the drafter over one micro-batch and score every step by ``loss`` (module
    docstring)."""
    options = options or StepOptions()
    docs, positions = _documents_and_positions(batch)
    assert batch.aux is not None, "online features fill aux first"
    hidden = drafter.project_aux(batch.aux)  # [B, T, H]
    step = (_FunctionalUnroll(drafter, docs, positions, hidden, ttt_steps, attn_impl, options).step
            if options.functional_step else _module_step(drafter, docs, positions, attn_impl))
    score = _scorer(supervision.probs, ttt_steps, options, loss)
    chain = torch.ones_like(docs, dtype=torch.bool)
    sums, counts = [], []
    for k, aligned in enumerate(align_steps(batch.input_ids, batch.loss_mask, docs, supervision.argmax, t2d,
                                            ttt_steps)):
        hidden, logits = step(hidden, aligned.input_ids, k)  # [B, T, H], [B, T, Vd]
        loss_sum, draft_top = score(logits, aligned.position_mask, k)
        sums.append(loss_sum)
        correct, full_correct, chain = _step_hits(draft_top, d2t, aligned, chain)
        counts.append(torch.stack([aligned.position_mask.sum(), aligned.predicts_marked.sum(), correct, full_correct]))
    loss_sum, count = torch.stack(sums), torch.stack(counts).T  # [S], [4, S]
    return TTTOutput(weighted_loss(loss_sum, count[0], step_decay), loss_sum, count[0], count[1], count[2], count[3],
                     step_decay=step_decay)


def _module_step(drafter: Eagle3Drafter, docs: Tensor, positions: Tensor, attn_impl: AttnImpl) -> StepFn:
    """The plain step: the drafter module's forward, one flex block mask per step."""
    cache = TTTCache()

    def step(hidden: Tensor, input_ids: Tensor, k: int) -> tuple[Tensor, Tensor]:
        return drafter(hidden, input_ids, positions + k, docs, cache, attn_impl)

    return step


class _FunctionalUnroll:
    """The step as functions over tensors prepared once per micro-batch: weights cast once, RoPE tables of
    every step, and (flex) one block mask layout for all steps; the pieces compiled when asked.

    The functions Eagle3Drafter.forward calls too, over once-cast weights (tests compare the paths). It reads
    the drafter's parameters directly, which a wrapper that shards the whole objective (DDP, FSDP2 over the
    root) gathers before the forward.
    """

    pre: Callable[..., Any]  # attention_inputs, compiled when asked
    post: Callable[..., Any]  # step_outputs, compiled when asked

    def __init__(self, drafter: Eagle3Drafter, docs: Tensor, positions: Tensor, hidden: Tensor, num_steps: int,
                 attn_impl: AttnImpl, options: StepOptions) -> None:
        dims, device = drafter.dims, hidden.device
        autocast_on = torch.is_autocast_enabled(device.type)
        self.weights = step_weights(drafter, torch.get_autocast_dtype(device.type) if autocast_on else None)
        inv_freq = rope_inv_freq_on(dims.head_dim, dims.rope_theta, dims.rope_scaling, device)
        self.rope = [rope_cos_sin(inv_freq, positions + k, upcast(hidden).dtype) for k in range(num_steps)]
        self.impl, self.docs, self.num_steps = resolve_attn_impl(attn_impl, device), docs, num_steps
        self.masks = None
        if self.impl == "flex" and options.reuse_block_mask and docs.shape[1] % FLEX_BLOCK == 0:
            self.masks = ttt_block_masks(docs, num_steps, FLEX_BLOCK)
        backend = options.compile_backend
        self.pre, self.post = compiled_step_pieces(backend) if backend else (attention_inputs, step_outputs)
        self.eps, self.heads = dims.rms_norm_eps, (dims.num_attention_heads, dims.num_key_value_heads)
        self.keys: list[Tensor] = []  # S x [B, nKV, T, hd]
        self.values: list[Tensor] = []

    def step(self, hidden: Tensor, input_ids: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """Step k (see StepFn)."""
        cos, sin = self.rope[k]
        q, key, value = self.pre(self.weights, input_ids, hidden, cos, sin, self.eps, *self.heads)
        self.keys.append(key)
        self.values.append(value)
        if self.masks is None:
            attn = ttt_attention(q, self.keys, self.values, self.docs, self.impl)
        else:
            attn = flex_attention_over(q, self._layout(self.keys), self._layout(self.values), self.masks[k])
        return self.post(self.weights, hidden, attn, self.eps)

    def _layout(self, parts: list[Tensor]) -> Tensor:
        """[B, nKV, S*T, hd]: the steps so far, then zeros for the steps to come (their blocks are never read)."""
        missing = self.num_steps - len(parts)
        if missing:
            batch, heads, seq_len, head_dim = parts[0].shape
            parts = [*parts, parts[0].new_zeros(batch, heads, missing * seq_len, head_dim)]
        return torch.cat(parts, dim=2)


def _scorer(probs: Tensor, num_steps: int, options: StepOptions, loss: TokenLoss = SOFT_CE) -> ScoreFn:
    """The per-step loss: log_softmax over the whole step (plain) or chunk by chunk (fused); the soft CE, or the
    acceptance-targeted ``loss`` (the soft CE keeps its own code, so its results stay bitwise what they were)."""
    if options.loss_chunk_tokens <= 0:
        def plain(logits: Tensor, position_mask: Tensor, k: int) -> tuple[Tensor, Tensor]:
            if loss.kind == SOFT_CE.kind:
                values = step_soft_ce(logits, probs, TOKEN_SHIFT + k)  # [B, T]
            else:
                values = step_token_loss(logits, probs, TOKEN_SHIFT + k, loss)  # [B, T]
            return torch.where(position_mask, values, torch.zeros_like(values)).sum(), logits.detach().argmax(-1)
        return plain

    padded = pad_probs(probs, num_steps)  # [B*T + S, Vd]
    backend = options.compile_backend
    if loss.kind != SOFT_CE.kind:
        kernels = acceptance_kernels(loss, backend)
    else:
        kernels = compiled_loss_kernels(backend) if backend else (soft_ce_chunk, soft_ce_chunk_grad)

    def fused(logits: Tensor, position_mask: Tensor, k: int) -> tuple[Tensor, Tensor]:
        return ChunkedSoftCE.apply(logits, padded, position_mask, TOKEN_SHIFT + k, options.loss_chunk_tokens,
                                   kernels)

    return fused


class TTTObjective(nn.Module):
    """The drafter plus frozen supervision tensors; ``forward(batch)`` is the whole unroll (what DDP/FSDP wrap).

    The target lm_head, t2d and d2t are non-persistent buffers: they follow ``.to(device)`` but never enter
    the optimizer, the checkpoint or the export.
    """

    t2d: Tensor  # [V] bool (buffers, registered in __init__)
    d2t: Tensor  # [Vd] long
    draft_ids: Tensor  # [Vd] long
    target_lm_head: Tensor | None  # [V, Ht]

    def __init__(self, drafter: Eagle3Drafter, t2d: Tensor, d2t: Tensor, target_lm_head: Tensor | None,
                 ttt_steps: int, step_decay: float = STEP_DECAY, attn_impl: AttnImpl = "auto",
                 chunk_tokens: int = 1024, options: StepOptions | None = None, loss: TokenLoss = SOFT_CE) -> None:
        super().__init__()
        self.drafter = drafter
        self.register_buffer("t2d", t2d.bool(), persistent=False)  # [V]
        self.register_buffer("d2t", d2t.long(), persistent=False)  # [Vd]
        # [Vd] target ids of the draft vocab (d2t holds target id - draft id), ascending = draft order
        self.register_buffer("draft_ids", d2t.long() + torch.arange(len(d2t), device=d2t.device), persistent=False)
        self.register_buffer("target_lm_head", target_lm_head, persistent=False)  # [V, Ht] or None
        self.ttt_steps, self.step_decay = ttt_steps, step_decay
        self.attn_impl, self.chunk_tokens = attn_impl, chunk_tokens
        self.options = options or StepOptions()
        self.loss = loss  # what each step is scored by (train.loss)

    def supervision(self, batch: TTTBatch) -> Supervision:
        """From the final hidden state when the batch has it, else from its top-K log-probs."""
        if batch.final_hidden is not None:
            if self.target_lm_head is None:
                raise ValueError("final_hidden supervision needs the target lm_head (target_lm_head=None)")
            return supervision_from_final(batch.final_hidden, self.target_lm_head, self.t2d, self.chunk_tokens,
                                          self.draft_ids)
        if batch.topk_ids is None or batch.topk_logprobs is None:
            raise ValueError("the batch carries neither final_hidden nor topk_ids/topk_logprobs")
        return supervision_from_topk(batch.topk_ids, batch.topk_logprobs, self.t2d, len(self.d2t))

    def unroll(self, batch: TTTBatch, supervision: Supervision) -> TTTOutput:
        """ttt_loss with this objective's tensors and settings (``options`` and ``loss`` included)."""
        return ttt_loss(self.drafter, batch, supervision, self.t2d, self.d2t, self.ttt_steps, self.step_decay,
                        self.attn_impl, self.options, self.loss)

    def forward(self, batch: TTTBatch, supervision: Supervision | None = None) -> TTTOutput:
        """The unroll; the supervision is computed here unless given (a trainer computes it first for its counts)."""
        return self.unroll(batch, self.supervision(batch) if supervision is None else supervision)
