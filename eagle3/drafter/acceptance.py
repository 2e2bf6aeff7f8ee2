"""Acceptance-targeted token losses (``train.loss``): what one TTT step is scored by, beside the soft cross-entropy.

Speculative sampling accepts a draft token v ~ q with probability min(1, p_v / q_v), so a draft step is accepted
with probability
    alpha(p, q) = sum_v min(p_v, q_v) = 1 - TV(p, q),        TV(p, q) = 0.5 * sum_v |p_v - q_v|
Here both sums run over the draft vocab: p is the target's distribution restricted to the draft vocab and
renormalised (eagle3.drafter.alignment.Supervision), q = softmax(draft logits). The losses of one supervised position:
    kl         CE = -sum_v p_v log q_v                  the default: KL(p || q) + H(p), so KL's gradient
    tv         1 - alpha                                the acceptance itself; weak gradient while alpha is small
    kl+tv      (1 - w) CE + w (1 - alpha)               w = train.loss_tv_weight
    lk_alpha   -log(alpha + EPS)                        TV's gradient scaled by 1 / (alpha + EPS)
    lk_lambda  lam CE + (1 - lam)(1 - alpha)            lam = exp(-eta * alpha), alpha not differentiated
                                                        (eta = train.loss_lk_eta), per position
lk_alpha and lk_lambda are the "LK losses" of arXiv 2602.23881 as public implementations of them describe them
(docs/train.md, "The loss"); they use KL where CE stands here, which has the same gradient (lam is a constant to
the gradient) and a value larger by lam * H(p).

Gradients with respect to the draft logits x of one position (q = softmax(x)):
    dCE/dx     = q * sum_v p_v - p
    dalpha/dx  = q * (s - A),    s_v = 1 if q_v < p_v, 1/2 if q_v = p_v (torch.minimum's rule), else 0,
                                 A = sum_v s_v q_v
so a row whose loss is w_ce CE + w_tv (1 - alpha) + w_nla (-log(alpha + EPS)) has the logits gradient
    w_ce (q sum(p) - p) + (w_tv + w_nla / (alpha + EPS)) q (A - s).
The plain path lets autograd differentiate token_loss; the fused path (soft_ce.ChunkedSoftCE with these kernels)
recomputes q per token chunk in backward and applies the formula, so no fp32 [T, Vd] tensor is kept.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from eagle3.drafter.functional import upcast

LOSS_KINDS = ("kl", "tv", "kl+tv", "lk_alpha", "lk_lambda")
"""The values of train.loss (the config's Literal lists the same, tests check it)."""
EPS = 1e-5
"""lk_alpha's floor inside the log: -log(alpha + EPS) stays finite and its gradient bounded where alpha is 0."""


@dataclass(frozen=True)
class TokenLoss:
    """Which per-position loss a TTT step is scored by, and its weights (the module docstring's table)."""

    kind: str = "kl"
    tv_weight: float = 0.5  # kl+tv only
    lk_eta: float = 3.0  # lk_lambda only

    def __post_init__(self) -> None:
        if self.kind not in LOSS_KINDS:
            raise ValueError(f"loss {self.kind!r} is not one of {LOSS_KINDS}")


SOFT_CE = TokenLoss()
"""The default: the soft cross-entropy (the unroll's own code path, eagle3.drafter.soft_ce)."""

Weight = Tensor | float


def row_weights(alpha: Tensor, loss: TokenLoss) -> tuple[Weight, Weight, Weight]:
    """(w_ce, w_tv, w_nla) of every position; ``alpha`` [...] is only read without gradient (lk_lambda's lam)."""
    if loss.kind == "lk_lambda":
        lam = torch.exp(-loss.lk_eta * alpha.detach())
        return lam, 1 - lam, 0.0
    w = loss.tv_weight
    return {"kl": (1.0, 0.0, 0.0), "tv": (0.0, 1.0, 0.0), "kl+tv": (1 - w, w, 0.0), "lk_alpha": (0.0, 0.0, 1.0)}[
        loss.kind
    ]


def token_loss(log_q: Tensor, p: Tensor, loss: TokenLoss) -> Tensor:
    """[...]: the loss of each position from the draft's log-probs and the target's probs [..., Vd] (same dtype)."""
    q = log_q.exp()
    ce = -(p * log_q).sum(-1)
    alpha = torch.minimum(p, q).sum(-1)
    w_ce, w_tv, w_nla = row_weights(alpha, loss)
    return w_ce * ce + w_tv * (1 - alpha) + w_nla * -torch.log(alpha + EPS)


def step_token_loss(logits: Tensor, probs: Tensor, shift: int, loss: TokenLoss) -> Tensor:
    """[B, T]: the loss of logits[t] against probs[t + shift] in at least fp32, 0 where t + shift is past the row."""
    seq_len = logits.shape[1]
    n = max(seq_len - shift, 0)
    log_q = torch.log_softmax(upcast(logits[:, :n]), dim=-1)  # [B, n, Vd]
    values = token_loss(log_q, probs[:, shift : shift + n].to(log_q.dtype), loss)  # [B, n]
    return F.pad(values, (0, seq_len - n))


# ------------------------------------------------------------------------------------------- fused kernels


def acceptance_chunk(logits: Tensor, probs: Tensor, mask: Tensor, loss: TokenLoss) -> tuple[Tensor, Tensor, Tensor]:
    """(sum of the masked loss [], logsumexp [c], draft argmax [c]) of logits [c, Vd] against probs [c, Vd]."""
    x = upcast(logits)
    lse = torch.logsumexp(x, dim=-1)  # [c]
    values = token_loss(x - lse[:, None], probs.to(x.dtype), loss)  # [c]
    return torch.where(mask, values, 0).sum(), lse, logits.argmax(-1)


def acceptance_chunk_grad(
    logits: Tensor, probs: Tensor, mask: Tensor, lse: Tensor, grad_sum: Tensor, loss: TokenLoss
) -> Tensor:
    """d(grad_sum * loss sum)/d logits [c, Vd] on masked rows, in the logits' dtype (module docstring's formula)."""
    x = upcast(logits)
    p = probs.to(x.dtype)
    q = torch.exp(x - lse[:, None])  # [c, Vd]
    alpha = torch.minimum(p, q).sum(-1, keepdim=True)  # [c, 1]
    s = (q < p).to(x.dtype) + 0.5 * (q == p).to(x.dtype)  # [c, Vd]: where min(p, q) follows q
    w_ce, w_tv, w_nla = row_weights(alpha, loss)
    grad = w_ce * (q * p.sum(-1, keepdim=True) - p) + (w_tv + w_nla / (alpha + EPS)) * q * ((s * q).sum(-1, True) - s)
    return torch.where(mask[:, None], grad * grad_sum, 0).to(logits.dtype)


@lru_cache(maxsize=8)
def acceptance_kernels(loss: TokenLoss, backend: str | None = None) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """(forward, gradient) kernels of ``loss`` with ChunkedSoftCE's signatures; under torch.compile when ``backend``."""

    def forward(logits: Tensor, probs: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return acceptance_chunk(logits, probs, mask, loss)

    def gradient(logits: Tensor, probs: Tensor, mask: Tensor, lse: Tensor, grad_sum: Tensor) -> Tensor:
        return acceptance_chunk_grad(logits, probs, mask, lse, grad_sum, loss)

    if backend is None:
        return forward, gradient
    return (
        torch.compile(forward, dynamic=False, backend=backend),
        torch.compile(gradient, dynamic=False, backend=backend),
    )
