"""Chain acceptance from one teacher-forced pass (eagle3/evaluate/teacher_forced.py) against real decoding on the
tiny random target and drafter (float64)."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch

from eagle3.evaluate.proposers import EagleProposer, NgramProposer
from eagle3.evaluate.runners import TargetRunner
from eagle3.evaluate.speculate import speculative_decode
from eagle3.evaluate.teacher_forced import chain_match_lengths, simulate_chain, simulate_ngram
from tests.unit.test_speculate import MAX_NEW, setup  # noqa: F401 (setup: the module fixture tiny builds on)

STEPS = 4


@pytest.fixture(scope="module")
def tiny(setup):  # noqa: F811 (the fixture imported above, requested by name)
    """test_speculate's tiny target runner, random drafter and greedy references (as token lists)."""
    return setup["target"], setup["prompts"], [r.tokens for r in setup["refs"]], setup["drafter"], setup["d2t"]


def _aux(target: TargetRunner, seq: list[int]):
    target.reset()
    aux = target.step(seq).aux  # [L, A*H]
    target.reset()
    return aux


def test_the_pass_reproduces_every_draft_of_a_decoded_chain_round(tiny):
    """Fed a round's own drafts as text, the pass's row c - 2 matches all STEPS of them (and one fewer when the
    last is changed): its steps 1.. compute what the decode's drafter forwards computed, not only step 0."""
    target, prompts, refs, drafter, d2t = tiny
    proposer = EagleProposer(drafter, d2t, steps=STEPS)
    rounds = 0
    for prompt, ref in zip(prompts, refs):
        for done in (1, 6, 13):
            context = [*prompt, *ref[:done]]
            target.reset()
            proposer.reset()
            proposer.observe(target.step(context[:-1]).aux, context[1:], 0)  # the drafter state a round starts from
            drafts = proposer.propose(context).tokens
            assert len(drafts) == STEPS
            seq = [*context, *drafts]
            assert chain_match_lengths(drafter, d2t, _aux(target, seq), seq, STEPS)[len(context) - 2] == STEPS
            wrong = [*context, *drafts[:-1], drafts[-1] + 1]
            assert chain_match_lengths(drafter, d2t, _aux(target, wrong), wrong, STEPS)[len(context) - 2] == STEPS - 1
            rounds += 1
    assert rounds == 9


def test_replayed_rounds_equal_the_decoded_ones(tiny):
    """The rounds replayed from one pass commit what speculative_decode's rounds commit (the very same list), for
    chains of 1 and STEPS drafts. The drafter always proposes the text's most common token (zero lm_head: every
    draft is draft id 0, mapped to that token), so rounds accept none, one or more drafts (the random drafter
    alone accepts none on these texts)."""
    target, prompts, refs, drafter, d2t = tiny
    constant = copy.deepcopy(drafter)
    with torch.no_grad():
        constant.lm_head.weight.zero_()  # all draft logits 0: argmax is draft id 0 everywhere
    committed: set[int] = set()
    for prompt, ref in zip(prompts, refs):
        common = Counter(ref).most_common(1)[0][0]
        to_common = d2t.clone()
        to_common[0] = common  # draft id 0 -> target id common (d2t holds target id minus draft id)
        seq = [*prompt, *ref]
        matched = chain_match_lengths(constant, to_common, _aux(target, seq), seq, STEPS)
        for steps in (1, STEPS):
            decoded = speculative_decode(target, EagleProposer(constant, to_common, steps=steps), prompt, MAX_NEW)
            assert decoded.tokens == ref
            assert simulate_chain(matched, len(prompt), len(ref), steps) == [s.committed for s in decoded.steps]
            committed.update(s.committed for s in decoded.steps)
    assert {1, 2, 3} <= committed, committed  # rounds that accepted none, one and two drafts


def test_replay_golden_rounds():
    """Golden rounds: a prompt of 3, a text of 9 tokens, chain of 2; the prefill commits token 1, then each round
    reads matched at its context minus 2 and the last round takes only what is left."""
    matched = [0, 0, 2, 9, 9, 1, 9, 0, 9, 9, 9, 9]
    # context 4 -> row 2: 2 drafts + 1 = 3 (done 4); context 7 -> row 5: 1 + 1 = 2 (done 6);
    # context 9 -> row 7: 0 + 1 = 1 (done 7); context 10 -> row 8: min(9, 2) + 1 = 3, cut to the 2 left
    assert simulate_chain(matched, 3, 9, 2) == [3, 2, 1, 2]
    assert simulate_chain(matched, 3, 1, 2) == []
    with pytest.raises(ValueError, match="at least one"):
        simulate_chain(matched, 3, 9, 0)


def test_ngram_rounds_replayed_from_the_text_equal_the_decoded_ones(tiny):
    """Prompt-lookup rounds replayed from the greedy text alone commit what speculative_decode's rounds commit,
    with some rounds accepting drafts (the tiny target's texts repeat)."""
    target, prompts, refs, _, _ = tiny
    committed: set[int] = set()
    for prompt, ref in zip(prompts, refs):
        for proposer in (NgramProposer(3, 1, 3), NgramProposer(2, 2, 5)):
            decoded = speculative_decode(target, proposer, prompt, MAX_NEW)
            assert decoded.tokens == ref
            assert simulate_ngram(proposer, prompt, ref) == [s.committed for s in decoded.steps]
            committed.update(s.committed for s in decoded.steps)
    assert len(committed) >= 3 and max(committed) > 1, committed
