"""Speculative sampling at temperature > 0: the target's sampling distribution, draws from given uniforms, and the
rejection rule that keeps the output distributed exactly as the target's own sampling.

The rule (Leviathan et al. 2023, arXiv 2211.17192; Chen et al. 2023, arXiv 2302.01318). p = the target's distribution
after the committed prefix, q = the distribution the draft token x was drawn from, both after the same temperature,
top-k and top-p. Accept x with probability min(1, p(x)/q(x)); on rejection draw from norm(max(0, p - q)) and end the
round; after the last accepted draft the bonus token is drawn from p. Then P(token = y) = min(p(y), q(y)) +
(1 - sum_x min(p(x), q(x))) * norm(max(0, p - q))(y) = p(y): lossless in distribution, whatever q is.

Where the draws come from:
  * chain drafts sampled from the drafter (EAGLE-3 chains, chain_rule "rejection"): q is the drafter's distribution
    at each step (``chain_accept``);
  * deterministic candidates (a tree's top-k children, an EAGLE-3 chain's top tokens under chain_rule "target_only",
    prompt lookup, a DFlash block): q is a point mass on each
    candidate, so the rule accepts candidate x with probability p(x) and otherwise zeroes p(x) and renormalizes before
    the next sibling. That sequence is the same distribution as one draw y ~ p per node followed by walking into the
    child whose token is y, and stopping with y where there is none, which is how it is implemented
    (``draw`` on every verified row, then speculate.accept_path on the drawn tokens).
Random numbers come from a per-(prompt, method) generator (``sampler_for``), so a run's outputs depend on the seed,
not on how prompts were spread over workers.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

ChainRule = Literal["rejection", "target_only"]


@dataclass(frozen=True)
class SamplingParams:
    """How a token is drawn from logits: temperature (> 0), then top-k (0 = off), then top-p (1 = off); and how an
    EAGLE-3 chain's drafts are chosen: drawn from the drafter (rejection) or its top token (target_only)."""

    temperature: float
    top_p: float = 1.0
    top_k: int = 0
    chain_rule: ChainRule = "rejection"

    def __post_init__(self) -> None:
        if not (self.temperature > 0 and 0 < self.top_p <= 1 and self.top_k >= 0):
            raise ValueError(f"sampling needs temperature > 0, 0 < top_p <= 1, top_k >= 0; got {self}")
        if self.chain_rule not in ("rejection", "target_only"):
            raise ValueError(f"chain_rule is rejection or target_only; got {self.chain_rule!r}")


@dataclass
class Sampler:
    """Sampling parameters and the random stream one decode draws from (a generator on the decode's device)."""

    params: SamplingParams
    generator: torch.Generator

    def uniform(self, *shape: int) -> Tensor:
        """float64 uniforms in [0, 1) of ``shape``, on the generator's device."""
        return torch.rand(shape, generator=self.generator, device=self.generator.device, dtype=torch.float64)


def sampling_params(
    temperature: float, top_p: float = 1.0, top_k: int = 0, chain_rule: ChainRule = "rejection"
) -> SamplingParams | None:
    """The evaluate section's sampling settings; None at temperature 0 (greedy)."""
    return SamplingParams(temperature, top_p, top_k, chain_rule) if temperature > 0 else None


def stream_seed(seed: int, stream: str) -> int:
    """A 63-bit seed for one named random stream ('<prompt id>/<method>') of a run seeded with ``seed``."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{stream}".encode()).digest()[:8], "little") >> 1


def sampler_for(params: SamplingParams | None, seed: int, stream: str, device: torch.device | str) -> Sampler | None:
    """A Sampler on ``device`` for one stream, or None when ``params`` is None (greedy)."""
    if params is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(stream_seed(seed, stream))
    return Sampler(params, generator)


def probabilities(logits: Tensor, params: SamplingParams) -> Tensor:
    """logits [..., V] -> float64 probabilities [..., V]: softmax(logits / temperature) restricted to the top_k most
    likely tokens (ties with the k-th kept, as transformers does), then to the smallest set of most likely tokens
    whose mass reaches top_p (the most likely always kept), renormalized."""
    scaled = logits.double() / params.temperature
    if params.top_k and params.top_k < scaled.shape[-1]:
        kth = scaled.topk(params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1:
        ordered, order = probs.sort(dim=-1, descending=True, stable=True)  # ties: lower id first
        before = ordered.cumsum(-1) - ordered  # [..., V] mass of the tokens ranked above each
        drop = torch.zeros_like(ordered, dtype=torch.bool).scatter(-1, order, before >= params.top_p)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def draw(probs: Tensor, u: Tensor) -> Tensor:
    """Tokens [...] drawn from probs [..., V] (need not be normalized) with uniforms u [...] in [0, 1): the first token
    whose cumulative mass exceeds u * total (inverse CDF), so a zero-probability token is never drawn."""
    cdf = probs.cumsum(-1)  # [..., V], non-decreasing
    target = (u.to(cdf.dtype) * cdf[..., -1]).unsqueeze(-1)  # [..., 1]
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp(max=probs.shape[-1] - 1)


def residual(p: Tensor, q: Tensor) -> Tensor:
    """norm(max(0, p - q)) over the last axis; where p <= q everywhere (p == q: a rejection had probability 0 and only
    rounding got there) p itself."""
    rest = (p - q).clamp(min=0)
    mass = rest.sum(-1, keepdim=True)
    return torch.where(mass > 0, rest / mass.clamp(min=torch.finfo(rest.dtype).tiny), p)


def chain_accept(p: Tensor, q: Tensor, drafts: Tensor, u_accept: Tensor, u_draw: Tensor) -> tuple[Tensor, Tensor]:
    """The rejection rule over a chain of S drafts drawn from q; batched over any leading axes.

    p [..., S+1, V] (row i: the target after the root and drafts 1..i), q [..., S, V] (row i: the distribution draft
    i+1 was drawn from), drafts [..., S], u_accept [..., S] and u_draw [...] uniforms in [0, 1). Returns (accepted
    [...]: drafts accepted in a row, token [...]: the residual draw at the first rejection, or the bonus from p[S]).
    """
    num = drafts.shape[-1]
    p_draft = p[..., :num, :].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)  # [..., S] p(x_i)
    q_draft = q.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)  # [..., S] q(x_i) > 0: x_i was drawn from it
    ok = u_accept * q_draft < p_draft  # u < p/q, without dividing
    accepted = ok.long().cumprod(-1).sum(-1)  # [...] leading run of acceptances
    vocab = p.shape[-1]
    index = accepted[..., None, None].expand(*accepted.shape, 1, vocab)  # [..., 1, V]
    row_p = p.gather(-2, index).squeeze(-2)  # [..., V]
    q_bonus = torch.cat([q, torch.zeros_like(q[..., :1, :])], dim=-2)  # the bonus row had no draft: residual = p
    row_q = q_bonus.gather(-2, index).squeeze(-2)
    return accepted, draw(residual(row_p, row_q), u_draw)
