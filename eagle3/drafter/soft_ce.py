"""The soft cross-entropy of one TTT step: the plain log_softmax form and the fused, token-chunked one.

ChunkedSoftCE scores a step token chunk by token chunk (logsumexp in fp32, the logits gradient recomputed in
backward), so no fp32 [T, Vd] tensor is ever materialised; its kernels may be an acceptance-targeted loss's
instead (eagle3.drafter.acceptance). Shape letters: B rows, T tokens, Vd draft vocab, S steps, c chunk tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from eagle3.drafter.functional import upcast


def step_soft_ce(logits: Tensor, probs: Tensor, shift: int) -> Tensor:
    """[B, T]: -sum_v probs[t + shift, v] * log_softmax(logits[t])_v, 0 where t + shift is past the row."""
    seq_len = logits.shape[1]
    n = max(seq_len - shift, 0)
    log_q = torch.log_softmax(upcast(logits[:, :n]), dim=-1)  # [B, n, Vd]
    ce = -(probs[:, shift : shift + n] * log_q).sum(-1)  # [B, n]
    return F.pad(ce, (0, seq_len - n))


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
    return (
        torch.compile(soft_ce_chunk, dynamic=False, backend=backend),
        torch.compile(soft_ce_chunk_grad, dynamic=False, backend=backend),
    )


class ChunkedSoftCE(torch.autograd.Function):
    """Masked soft-CE sum of one TTT step, token chunk by token chunk, never holding fp32 [N, Vd] tensors.

    The kernels decide the token loss: soft_ce_chunk and its gradient, or an acceptance-targeted loss's
    (eagle3.drafter.acceptance.acceptance_kernels, same signatures).

    Forward keeps only the logsumexp per token; backward recomputes softmax per chunk and returns the
    logits gradient in the logits' dtype (one rounding, as the log_softmax path's cast back does).
    """

    @staticmethod
    def forward(
        ctx: Any,
        logits: Tensor,
        probs: Tensor,
        mask: Tensor,
        shift: int,
        chunk: int,
        kernels: tuple[Callable, Callable],
    ) -> tuple[Tensor, Tensor]:
        # logits [B, T, Vd]; probs [B*T + pad, Vd] flat with rows past the end (pad >= shift); mask [B, T] bool.
        flat, flat_mask = logits.reshape(-1, logits.shape[-1]), mask.reshape(-1)
        bounds = _chunk_bounds(flat.shape[0], chunk)
        parts = [kernels[0](flat[a:b], probs[a + shift : b + shift], flat_mask[a:b]) for a, b in bounds]
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
        grads = [
            ctx.kernels[1](flat[a:b], probs[a + shift : b + shift], mask[a:b], lse[a:b], grad_sum)
            for a, b in ctx.bounds
        ]
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
