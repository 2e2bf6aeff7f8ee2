"""The decode loops' sampled parts at temperature > 0: the target's own sampling (the reference), chain drafts drawn
from the drafter, and the verify step of speculative sampling (rules in eagle3.evaluate.sampling).

Token identity with a reference cannot hold when both sample, so what a decode keeps instead: the target's log-prob
of every committed token (summed: equal in expectation to the reference's when lossless) and the first token the
target gives probability 0 after top-k/top-p (none in a correct decode, whatever the random numbers). Whether the
output is distributed as the target's sampling is tested offline, by a chi-square test over >= 10^5 draws on a tiny
target (tests/unit/test_sampling.py).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from eagle3.evaluate.proposers import EagleProposer
from eagle3.evaluate.records import LosslessCheck
from eagle3.evaluate.runners import StepOut, TargetRunner
from eagle3.evaluate.sampling import Sampler, SamplingParams, chain_accept, draw, probabilities, sampler_for
from eagle3.evaluate.speculate import (
    STOP_CHECK_EVERY,
    DecodeResult,
    DraftTree,
    _clock,
    accept_path,
    greedy_decode,
    keep_accepted,
    speculative_decode,
    verify_forward,
)


def sampled_chain(runner: Any, hidden: Tensor, logits: Tensor, steps: int, sampler: Sampler) -> DraftTree:
    """``steps`` chain drafts, each drawn from the drafter's distribution (temperature, top-k, top-p over the draft
    vocab) with one of ``steps`` uniforms drawn first, fed back as greedy chains feed theirs; root out [1, H] and
    logits [Vd] at the last committed index. Returns the chain with, per draft, the distribution it was drawn from
    over the target vocab [S, V]. A static runner drafts the whole round in one (compiled) call."""
    uniforms = sampler.uniform(steps)  # [S] float64
    if hasattr(runner, "sampled_chain"):
        tokens, q = runner.sampled_chain(hidden, logits, steps, sampler.params, uniforms)
        return DraftTree.chain(tokens.tolist(), draft_probs=q)  # one device sync per round
    vocab = runner.drafter.dims.vocab_size
    draft_ids = runner.to_target_ids(torch.arange(len(runner.d2t), device=runner.device))  # [Vd] their target ids
    root_position = runner.num_committed - 1
    token_list, rows = [], []
    for j in range(1, steps + 1):
        q_draft = probabilities(logits, sampler.params)  # [Vd]
        token = runner.to_target_ids(draw(q_draft, uniforms[j - 1 : j]))  # [1] target id
        token_list.append(token)
        rows.append(q_draft.new_zeros(vocab).index_copy(0, draft_ids, q_draft))  # [V]: 0 outside the draft vocab
        if j < steps:
            ancestors = torch.ones(1, runner.num_draft_entries + 1, dtype=torch.bool, device=runner.device)
            hidden, level = runner.draft(hidden, token, root_position + j, ancestors)
            logits = level[0]
    return DraftTree.chain(torch.cat(token_list).tolist(), draft_probs=torch.stack(rows))  # one device sync per round


class SampledRounds:
    """One speculative-sampling decode's random stream, draws and per-token bookkeeping (speculate.speculative_decode
    calls it where a greedy decode reads argmaxes)."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler
        self.logprob = 0.0
        self.outside: tuple[int, int] | None = None
        self._pending: list[tuple[int, float]] = []  # the last round's (token, target probability), in order

    def first_token(self, first: StepOut) -> int:
        """The prefill's token, drawn from the target's distribution at the last prompt row."""
        assert first.logits is not None, "the prefill ran with_logits"
        p = probabilities(first.logits[-1], self.sampler.params)  # [V]
        token = int(draw(p, self.sampler.uniform(1))[0])
        self._pending = [(token, float(p[token]))]
        self.commit(0, 1)
        return token

    def propose(self, proposer: Any, context: list[int]) -> DraftTree:
        """An EAGLE chain's drafts drawn from the drafter (chain_rule rejection); every other proposer's (chains
        under target_only, trees, prompt lookup, DFlash blocks) deterministic drafts, verified with q a point mass
        (eagle3.evaluate.sampling)."""
        rejection = self.sampler.params.chain_rule == "rejection"
        if rejection and isinstance(proposer, EagleProposer) and proposer.topk == 1:
            return sampled_chain(proposer.runner, *proposer.root, proposer.steps, self.sampler)
        return proposer.propose(context)

    def verify(self, target: TargetRunner, tree: DraftTree, context: list[int]) -> tuple[list[int], list[int], Tensor]:
        """speculate.verify with speculative sampling (eagle3.evaluate.sampling): (new tokens, accepted nodes, aux)."""
        out = verify_forward(target, tree, context, with_logits=True)
        assert out.logits is not None, "the verify ran with_logits"
        p = probabilities(out.logits, self.sampler.params)  # [N+1, V]
        if tree.draft_probs is not None and tree.tokens:  # drafts drawn from q: the rejection rule
            new, chosen = self._chain_verdict(p, tree)
            path = list(range(len(new) - 1))
        else:  # deterministic candidates: one draw per row, walk into the child that drew it
            drawn = draw(p, self.sampler.uniform(len(p)))  # [N+1]
            probs = p.gather(-1, drawn[:, None])[:, 0]  # [N+1] each row's drawn token's probability
            host = torch.cat([drawn.to(probs.dtype), probs]).tolist()  # one device read per round
            tokens, row_probs = [int(t) for t in host[: len(p)]], host[len(p) :]
            path, bonus = accept_path(tree, tokens)
            new = [tree.tokens[i] for i in path] + [bonus]
            chosen = [row_probs[r] for r in (0, *(i + 1 for i in path))]  # new token j was drawn at this row
        self._pending = list(zip(new, chosen))
        return new, path, keep_accepted(target, len(context) - 1, path, out)

    def _chain_verdict(self, p: Tensor, tree: DraftTree) -> tuple[list[int], list[float]]:
        """A sampled chain's verify by the rejection rule, p [S+1, V]: (new tokens: the accepted drafts then the
        residual or bonus draw, the target's probability of each), read from the device once."""
        assert tree.draft_probs is not None
        num = len(tree.tokens)
        drafts = torch.tensor(tree.tokens, device=p.device)  # [S]
        accepted, token = chain_accept(
            p, tree.draft_probs.to(p), drafts, self.sampler.uniform(num), self.sampler.uniform(1)[0]
        )  # [], []
        rows = torch.arange(num + 1, device=p.device)  # [S+1]
        # row i's token: draft i while i < accepted, the draw at i == accepted (later rows are not read)
        tokens = torch.where(rows == accepted, token, torch.cat([drafts, drafts[:1]]))  # [S+1]
        probs = p[rows, tokens]  # [S+1]
        host = torch.cat([accepted[None].to(p.dtype), tokens.to(p.dtype), probs]).tolist()  # one device read
        kept = int(host[0]) + 1
        return [int(t) for t in host[1 : 1 + kept]], host[2 + num : 2 + num + kept]

    def commit(self, position: int, num: int) -> None:
        """The first ``num`` tokens of the last round were kept, the first at output ``position``."""
        for offset, (token, prob) in enumerate(self._pending[:num]):
            if prob <= 0:
                self.outside = self.outside or (position + offset, token)
            else:
                self.logprob += math.log(prob)

    def finish(self, result: DecodeResult) -> DecodeResult:
        """``result`` with the decode's log-prob and first out-of-support token."""
        result.logprob, result.outside = self.logprob, self.outside
        return result


@torch.no_grad()
def sample_decode(
    target: TargetRunner, prompt: list[int], max_new_tokens: int, stop_ids: list[int], sampler: Sampler
) -> DecodeResult:
    """The target's own sampling, one forward per token, timed: the reference and baseline at temperature > 0.

    As greedy_decode: each forward reads the previous token on the device, the host reads every STOP_CHECK_EVERY
    tokens and keeps the output up to the first stop."""
    stops = set(stop_ids)
    start_s = _clock(target.device)
    target.reset()
    out = target.step(prompt, last_only=True, with_aux=False, with_logits=True)
    tokens: list[Tensor] = []
    chosen: list[Tensor] = []
    while True:
        assert out.logits is not None, "the forward ran with_logits"
        p = probabilities(out.logits[-1:], sampler.params)  # [1, V]
        token = draw(p, sampler.uniform(1))  # [1]
        tokens.append(token)
        chosen.append(p[0, token])
        if len(tokens) >= max_new_tokens:
            break
        if len(tokens) % STOP_CHECK_EVERY == 0 and stops & set(torch.cat(tokens[-STOP_CHECK_EVERY:]).tolist()):
            break
        out = target.step(token, with_aux=False, with_logits=True)
    ids = torch.cat(tokens).tolist()
    end = next((i + 1 for i, t in enumerate(ids) if t in stops), len(ids))
    wall_s = (_clock(target.device) - start_s) * end / len(ids)  # as greedy_decode: forwards past the stop left out
    logprob = float(torch.cat(chosen[:end]).log().sum())
    return DecodeResult(ids[:end], wall_s, logprob=logprob)


def sampled_speculative_decode(
    target: TargetRunner, proposer: Any, prompt: list[int], max_new_tokens: int, stop_ids: list[int], sampler: Sampler
) -> DecodeResult:
    """speculate.speculative_decode verifying by speculative sampling, from ``sampler``'s random stream."""
    return speculative_decode(target, proposer, prompt, max_new_tokens, stop_ids, SampledRounds(sampler))


def sampled_check(result: DecodeResult) -> LosslessCheck:
    """The check of a sampled decode: 'sampled' (every token inside the target's sampling support), or 'mismatch'
    at the first token the target could not have drawn."""
    if result.outside is None:
        return LosslessCheck("sampled")
    position, token = result.outside
    return LosslessCheck("mismatch", position, None, token)


def decode_reference(
    target: TargetRunner,
    ids: list[int],
    max_new_tokens: int,
    stop_ids: list[int],
    params: SamplingParams | None,
    seed: int,
    stream: str,
) -> DecodeResult:
    """The reference of one prompt: greedy_decode, or with ``params`` the target's own sampling (stream ``stream``)."""
    sampler = sampler_for(params, seed, stream, target.device)
    if sampler is None:
        return greedy_decode(target, ids, max_new_tokens, stop_ids)
    return sample_decode(target, ids, max_new_tokens, stop_ids, sampler)


def decode_method(
    target: TargetRunner,
    proposer: Any,
    ids: list[int],
    max_new_tokens: int,
    stop_ids: list[int],
    params: SamplingParams | None,
    seed: int,
    stream: str,
) -> DecodeResult:
    """One method on one prompt: greedy verification, or with ``params`` speculative sampling (stream ``stream``)."""
    sampler = sampler_for(params, seed, stream, target.device)
    if sampler is None:
        return speculative_decode(target, proposer, ids, max_new_tokens, stop_ids)
    return sampled_speculative_decode(target, proposer, ids, max_new_tokens, stop_ids, sampler)
