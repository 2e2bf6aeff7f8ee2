"""Training-time test (TTT): the EAGLE-3 unroll, its loss and metrics.

Each step k reads and is scored at the offsets of eagle3.drafter.alignment (a prediction is supervised iff the
token it predicts is marked in ``loss_mask``); the soft cross-entropy itself is eagle3.drafter.soft_ce.

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
from typing import Any

import torch
from torch import Tensor, nn

from eagle3.drafter.acceptance import SOFT_CE, TokenLoss, acceptance_kernels, step_token_loss
from eagle3.drafter.alignment import (
    TOKEN_SHIFT,
    StepAlignment,
    Supervision,
    align_steps,
    supervision_from_final,
    supervision_from_topk,
)
from eagle3.drafter.functional import (
    AttnImpl,
    TTTCache,
    attention_inputs,
    compiled_step_pieces,
    flex_attention_over,
    resolve_attn_impl,
    rope_cos_sin,
    rope_inv_freq_on,
    step_outputs,
    ttt_attention,
    upcast,
)
from eagle3.drafter.masks import positions_from_documents, single_document_ids, ttt_block_masks
from eagle3.drafter.model import Eagle3Drafter, step_weights
from eagle3.drafter.soft_ce import (
    ChunkedSoftCE,
    compiled_loss_kernels,
    pad_probs,
    soft_ce_chunk,
    soft_ce_chunk_grad,
    step_soft_ce,
)

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
        return metrics_from_counts(
            self.loss_sum,
            self.num_supervised,
            self.num_predicted,
            self.num_correct,
            self.num_full_correct,
            self.step_decay,
        )


def weighted_loss(loss_sum: Tensor, num_supervised: Tensor, step_decay: float = STEP_DECAY) -> Tensor:
    """sum_k decay^k * (loss_sum_k / max(n_k, 1)): a masked mean per step, then the step weights."""
    weights = step_decay ** torch.arange(len(loss_sum), device=loss_sum.device, dtype=loss_sum.dtype)
    return (weights * loss_sum / num_supervised.clamp_min(1)).sum()


def metrics_from_counts(
    loss_sum: Tensor,
    num_supervised: Tensor,
    num_predicted: Tensor,
    num_correct: Tensor,
    num_full_correct: Tensor,
    step_decay: float = STEP_DECAY,
) -> dict[str, float]:
    """Per-step metrics from (possibly accumulated) sums; accept_len_est = 1 + sum_k prod_{i<=k} acc_i."""
    rows = torch.stack(
        [
            loss_sum.detach().double() / num_supervised.clamp_min(1),
            num_correct.double() / num_predicted.clamp_min(1),
            num_full_correct.double() / num_predicted.clamp_min(1),
            num_supervised.double(),
        ]
    )
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


def ttt_loss(
    drafter: Eagle3Drafter,
    batch: TTTBatch,
    supervision: Supervision,
    t2d: Tensor,
    d2t: Tensor,
    ttt_steps: int,
    step_decay: float = STEP_DECAY,
    attn_impl: AttnImpl = "auto",
    options: StepOptions | None = None,
    loss: TokenLoss = SOFT_CE,
) -> TTTOutput:
    """Unroll ``ttt_steps`` steps of the drafter over one micro-batch and score every step by ``loss`` (module
    docstring)."""
    options = options or StepOptions()
    docs, positions = _documents_and_positions(batch)
    assert batch.aux is not None, "online features fill aux first"
    hidden = drafter.project_aux(batch.aux)  # [B, T, H]
    step = (
        _FunctionalUnroll(drafter, docs, positions, hidden, ttt_steps, attn_impl, options).step
        if options.functional_step
        else _module_step(drafter, docs, positions, attn_impl)
    )
    score = _scorer(supervision.probs, ttt_steps, options, loss)
    chain = torch.ones_like(docs, dtype=torch.bool)
    sums, counts = [], []
    for k, aligned in enumerate(
        align_steps(batch.input_ids, batch.loss_mask, docs, supervision.argmax, t2d, ttt_steps)
    ):
        hidden, logits = step(hidden, aligned.input_ids, k)  # [B, T, H], [B, T, Vd]
        loss_sum, draft_top = score(logits, aligned.position_mask, k)
        sums.append(loss_sum)
        correct, full_correct, chain = _step_hits(draft_top, d2t, aligned, chain)
        counts.append(torch.stack([aligned.position_mask.sum(), aligned.predicts_marked.sum(), correct, full_correct]))
    loss_sum, count = torch.stack(sums), torch.stack(counts).T  # [S], [4, S]
    return TTTOutput(
        weighted_loss(loss_sum, count[0], step_decay),
        loss_sum,
        count[0],
        count[1],
        count[2],
        count[3],
        step_decay=step_decay,
    )


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

    def __init__(
        self,
        drafter: Eagle3Drafter,
        docs: Tensor,
        positions: Tensor,
        hidden: Tensor,
        num_steps: int,
        attn_impl: AttnImpl,
        options: StepOptions,
    ) -> None:
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
        return ChunkedSoftCE.apply(logits, padded, position_mask, TOKEN_SHIFT + k, options.loss_chunk_tokens, kernels)

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

    def __init__(
        self,
        drafter: Eagle3Drafter,
        t2d: Tensor,
        d2t: Tensor,
        target_lm_head: Tensor | None,
        ttt_steps: int,
        step_decay: float = STEP_DECAY,
        attn_impl: AttnImpl = "auto",
        chunk_tokens: int = 1024,
        options: StepOptions | None = None,
        loss: TokenLoss = SOFT_CE,
    ) -> None:
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
            return supervision_from_final(
                batch.final_hidden, self.target_lm_head, self.t2d, self.chunk_tokens, self.draft_ids
            )
        if batch.topk_ids is None or batch.topk_logprobs is None:
            raise ValueError("the batch carries neither final_hidden nor topk_ids/topk_logprobs")
        return supervision_from_topk(batch.topk_ids, batch.topk_logprobs, self.t2d, len(self.d2t))

    def unroll(self, batch: TTTBatch, supervision: Supervision) -> TTTOutput:
        """ttt_loss with this objective's tensors and settings (``options`` and ``loss`` included)."""
        return ttt_loss(
            self.drafter,
            batch,
            supervision,
            self.t2d,
            self.d2t,
            self.ttt_steps,
            self.step_decay,
            self.attn_impl,
            self.options,
            self.loss,
        )

    def forward(self, batch: TTTBatch, supervision: Supervision | None = None) -> TTTOutput:
        """The unroll; the supervision is computed here unless given (a trainer computes it first for its counts)."""
        return self.unroll(batch, self.supervision(batch) if supervision is None else supervision)
