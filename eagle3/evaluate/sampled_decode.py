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
    vocab), fed back as greedy chains feed theirs; root out [1, H] and logits [Vd] at the last committed index.
    Returns the chain with, per draft, the distribution it was drawn from over the target vocab [S, V]."""
    vocab = runner.drafter.dims.vocab_size
    draft_ids = runner.to_target_ids(torch.arange(len(runner.d2t), device=runner.device))  # [Vd] their target ids
    root_position = runner.num_committed - 1
    tokens, rows = [], []
    for j in range(1, steps + 1):
        q_draft = probabilities(logits, sampler.params)  # [Vd]
        token = runner.to_target_ids(draw(q_draft, sampler.uniform(1)))  # [1] target id
        tokens.append(token)
        rows.append(q_draft.new_zeros(vocab).index_copy(0, draft_ids, q_draft))  # [V]: 0 outside the draft vocab
        if j < steps:
            ancestors = torch.ones(1, runner.num_draft_entries + 1, dtype=torch.bool, device=runner.device)
            hidden, level = runner.draft(hidden, token, root_position + j, ancestors)
            logits = level[0]
    return DraftTree.chain(torch.cat(tokens).tolist(), draft_probs=torch.stack(rows))  # one device sync per round


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
        """An EAGLE chain's drafts drawn from the drafter; every other proposer's (trees, prompt lookup, DFlash
        blocks) deterministic drafts, verified with q a point mass (eagle3.evaluate.sampling)."""
        if isinstance(proposer, EagleProposer) and proposer.topk == 1:
            return sampled_chain(proposer.runner, *proposer.root, proposer.steps, self.sampler)
        return proposer.propose(context)

    def verify(self, target: TargetRunner, tree: DraftTree, context: list[int]) -> tuple[list[int], list[int], Tensor]:
        """speculate.verify with speculative sampling (eagle3.evaluate.sampling): (new tokens, accepted nodes, aux)."""
        out = verify_forward(target, tree, context, with_logits=True)
        assert out.logits is not None, "the verify ran with_logits"
        p = probabilities(out.logits, self.sampler.params)  # [N+1, V]
        if tree.draft_probs is not None and tree.tokens:  # drafts drawn from q: the rejection rule
            num = len(tree.tokens)
            drafts = torch.tensor(tree.tokens, device=p.device)
            accepted, token = chain_accept(
                p, tree.draft_probs.to(p), drafts, self.sampler.uniform(num), self.sampler.uniform(1)[0]
            )
            path, bonus = list(range(int(accepted))), int(token)
        else:  # deterministic candidates: one draw per row, walk into the child that drew it
            path, bonus = accept_path(tree, draw(p, self.sampler.uniform(len(p))).tolist())
        new = [tree.tokens[i] for i in path] + [bonus]
        rows = [0, *(i + 1 for i in path)]  # the row that predicted each new token
        chosen = p[torch.tensor(rows, device=p.device), torch.tensor(new, device=p.device)]
        self._pending = list(zip(new, chosen.tolist()))
        return new, path, keep_accepted(target, len(context) - 1, path, out)

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
