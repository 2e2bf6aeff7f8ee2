"""Speculative sampling at temperature > 0: lossless in distribution (chi-square over 10^5 draws on the tiny target,
chain and tree, the first two generated positions), broken rules caught by the same test, filters, and the real decode
loops (with top_k = 1 sampling is greedy, so every method must give greedy's tokens)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from eagle3.evaluate.proposers import EagleProposer, NgramProposer
from eagle3.evaluate.runners import TargetRunner
from eagle3.evaluate.sampled_decode import SampledRounds, sample_decode, sampled_check, sampled_speculative_decode
from eagle3.evaluate.sampling import (
    SamplingParams,
    chain_accept,
    draw,
    probabilities,
    residual,
    sampler_for,
    stream_seed,
)
from eagle3.evaluate.speculate import (
    DecodeResult,
    DraftTree,
    accept_path,
    greedy_decode,
    speculative_decode,
    verify_forward,
)
from eagle3.target.tiny import build_tiny_tokenizer
from tests.unit.test_speculate import AUX_IDS, QUESTIONS, prompt_ids, tiny_drafter, tiny_target

NUM_SAMPLES = 100_000
CHUNK = 25_000  # draws per batch: [CHUNK, V] float64 tables stay small
PARAMS = [SamplingParams(1.0), SamplingParams(0.8, top_p=0.9, top_k=60)]


# ---------------------------------------------------------------------------------------------- the rules


def test_probabilities_golden():
    """Temperature scales logits; top-k keeps the k best (k-th ties too); top-p the shortest head reaching p."""
    logits = torch.tensor([2.0, 1.0, 0.0, 0.0, -1.0])
    plain = torch.softmax(logits.double(), -1)
    assert torch.allclose(probabilities(logits, SamplingParams(1.0)), plain)
    assert torch.allclose(probabilities(logits, SamplingParams(0.5)), torch.softmax(logits.double() * 2, -1))
    top2 = probabilities(logits, SamplingParams(1.0, top_k=2))
    assert torch.allclose(top2, torch.cat([plain[:2] / plain[:2].sum(), torch.zeros(3, dtype=torch.float64)]))
    assert (probabilities(logits, SamplingParams(1.0, top_k=3)) > 0).tolist() == [True, True, True, True, False]
    head = plain[0]  # 0.64: top_p 0.5 keeps the best alone, top_p 0.7 the best two
    assert (probabilities(logits, SamplingParams(1.0, top_p=float(head) - 0.01)) > 0).sum() == 1
    assert (probabilities(logits, SamplingParams(1.0, top_p=float(head) + 0.01)) > 0).sum() == 2


def test_draw_is_the_inverse_cdf_and_skips_zero_mass():
    """draw returns the first token whose cumulative mass exceeds u * total; zero-probability tokens never."""
    probs = torch.tensor([0.25, 0.0, 0.5, 0.25], dtype=torch.float64)
    u = torch.tensor([0.0, 0.2499, 0.25, 0.7499, 0.75, 0.999999], dtype=torch.float64)
    assert draw(probs.expand(6, 4), u).tolist() == [0, 0, 2, 2, 3, 3]
    assert draw(probs * 3, u).tolist() == [0, 0, 2, 2, 3, 3]  # unnormalized mass: the same tokens


def test_chain_accept_golden():
    """Hand-made: u < p/q accepts; the first rejection draws from norm(max(0, p - q)); all accepted: bonus from p[S]."""
    p = torch.tensor([[0.5, 0.5, 0.0], [0.1, 0.1, 0.8], [0.0, 0.0, 1.0]], dtype=torch.float64)
    q = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]], dtype=torch.float64)
    drafts = torch.tensor([0, 1])
    accepted, token = chain_accept(p, q, drafts, torch.tensor([0.4, 0.05]).double(), torch.tensor(0.3).double())
    assert (int(accepted), int(token)) == (2, 2)  # 0.4 < 0.5 and 0.05 < 0.1: bonus from the last row
    accepted, token = chain_accept(p, q, drafts, torch.tensor([0.6, 0.0]).double(), torch.tensor(0.3).double())
    assert (int(accepted), int(token)) == (0, 1)  # rejected: residual max(0, p0 - q0) = token 1 only
    accepted, token = chain_accept(p, q, drafts, torch.tensor([0.1, 0.5]).double(), torch.tensor(0.0).double())
    assert (int(accepted), int(token)) == (1, 0)  # residual of row 1: (0.1, 0, 0.8) -> u 0 draws token 0
    assert torch.equal(residual(p[0], p[0]), p[0])  # p == q: no residual mass, p itself


def test_stream_seeds_are_stable_and_distinct():
    """One stream per (seed, prompt, method): stable across processes, different for another name or seed."""
    assert stream_seed(0, "mtbench:81/chain-3-1-4") == stream_seed(0, "mtbench:81/chain-3-1-4")
    assert len({stream_seed(0, "a"), stream_seed(0, "b"), stream_seed(1, "a")}) == 3
    assert sampler_for(None, 0, "a", "cpu") is None


# ------------------------------------------------------------------------------------- lossless in distribution


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square p-value of ``counts`` against ``probs``; cells expected below 5 are pooled into one."""
    expected = probs.double() * counts.sum()
    small = expected < 5
    observed = torch.cat([counts[~small].double(), counts[small].double().sum().reshape(1)])
    expected = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    observed, expected = observed[expected > 0], expected[expected > 0]
    stat = ((observed - expected) ** 2 / expected).sum()
    dof = torch.tensor(len(expected) - 1, dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, stat / 2))


@pytest.fixture(scope="module")
def world():
    """The tiny target (final norm x12, so its next-token distribution is far from uniform), a random drafter of half
    its vocab, and a prompt whose first token is committed."""
    model = tiny_target()
    with torch.no_grad():
        model.model.norm.weight.mul_(12)  # logits x12: entropy ~4.2 nats of 5.95 at temperature 1
    target = TargetRunner(model, AUX_IDS)
    drafter, d2t = tiny_drafter(model)
    prompt = prompt_ids(build_tiny_tokenizer(), QUESTIONS[0])
    return {"model": model, "target": target, "drafter": drafter, "d2t": d2t, "prompt": prompt}


def _after_first_token(world, proposer):
    """Prefill the prompt, commit the greedy first token, let the proposer observe: (context, prefill StepOut)."""
    target, prompt = world["target"], world["prompt"]
    target.reset()
    proposer.reset()
    first = target.step(prompt, last_only=True)
    context = [*prompt, int(first.greedy[-1])]
    proposer.observe(first.aux, context[1:], 0)
    return context, first


def _next_rows(world, proposer, context) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One verify forward of a tree whose root has every token as a child: (logits [V+1, V]: row 0 the target after
    the context, row 1 + x after the context and x; the kept root aux; the root's drafter features)."""
    target, vocab = world["target"], world["model"].config.vocab_size
    every = DraftTree(list(range(vocab)), [-1] * vocab)
    out = verify_forward(target, every, context, with_logits=True)
    target.keep(len(context) - 1, [])  # back to the context
    return out.logits, out.aux[:1], proposer.runner.drafter.project_aux(out.aux[:1])


def _round_two_q(world, proposer, context, root_aux, root_feature, params) -> torch.Tensor:
    """Per first token x (every target id), the drafter's first-draft distribution [V, V] after the round that
    committed x alone: its extend of (root feature, x) at the root's index, batched as one draft level of V rows."""
    runner, vocab = proposer.runner, world["model"].config.vocab_size
    m = len(context) - 1
    ids = torch.arange(vocab)
    _, logits = runner.draft(root_feature.expand(vocab, -1), ids, m, torch.eye(vocab, dtype=torch.bool))
    runner._drop_drafts()
    for x in (3, 200):  # the batched rows are what a real extend computes
        state = (runner.keys, runner.values, runner.num_committed)
        _, real = runner.extend(root_aux, [x], m)
        runner.keys, runner.values, runner.num_committed = state
        assert torch.allclose(real[0], logits[x], atol=1e-9), "batched round-two rows equal a real extend"
    return _to_target_vocab(runner, probabilities(logits, params), vocab)


def _to_target_vocab(runner, q_draft: torch.Tensor, vocab: int) -> torch.Tensor:
    """[..., Vd] -> [..., V] with each draft id's mass at its target id."""
    out = q_draft.new_zeros(*q_draft.shape[:-1], vocab)
    out[..., runner.to_target_ids(torch.arange(q_draft.shape[-1]))] = q_draft
    return out


AcceptRule = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple]


def accept_all(p, q, drafts, u_accept, u_draw):
    """A broken rule: every draft accepted, the bonus from p."""
    num = drafts.shape[-1]
    return torch.full(drafts.shape[:-1], num), draw(p[..., num, :], u_draw)


def residual_from_p(p, q, drafts, u_accept, u_draw):
    """A broken rule: the right acceptance, but a rejection draws from p instead of norm(max(0, p - q))."""
    accepted, _ = chain_accept(p, q, drafts, u_accept, u_draw)
    index = accepted[..., None, None].expand(*accepted.shape, 1, p.shape[-1])
    return accepted, draw(p.gather(-2, index).squeeze(-2), u_draw)


def chain_samples(world, params: SamplingParams, rule: AcceptRule = chain_accept) -> tuple[torch.Tensor, ...]:
    """NUM_SAMPLES first and second generated tokens of chain-2 speculative sampling, batched: drafts drawn from the
    real drafter's distributions, the target's rows from real verify forwards, ``rule`` deciding; where round one
    commits only one token the second comes from round two's first draft and verify. Also the target's own
    distributions: (x1, x2, p1 [V], p2 = sum_x p1(x) p(. | x) [V])."""
    proposer = EagleProposer(world["drafter"], world["d2t"], 2)
    context, _ = _after_first_token(world, proposer)
    runner, vocab, m = proposer.runner, world["model"].config.vocab_size, len(context) - 1
    hidden, root_logits = proposer.root
    draft_targets = runner.to_target_ids(torch.arange(len(world["d2t"])))  # [Vd]
    q1_draft = probabilities(root_logits, params)  # [Vd]
    num_draft = len(q1_draft)
    _, level = runner.draft(hidden.expand(num_draft, -1), draft_targets, m, torch.eye(num_draft, dtype=torch.bool))
    runner._drop_drafts()
    q2_draft = probabilities(level, params)  # [Vd, Vd]: draft 2's distribution after draft 1 = each draft id
    logits, root_aux, root_feature = _next_rows(world, proposer, context)
    p_rows = probabilities(logits, params)  # [V+1, V]
    q_next = _round_two_q(world, proposer, context, root_aux, root_feature, params)  # [V, V]
    q1, q2 = _to_target_vocab(runner, q1_draft, vocab), _to_target_vocab(runner, q2_draft, vocab)
    gen = torch.Generator().manual_seed(0)
    firsts, seconds = [], []
    for _ in range(NUM_SAMPLES // CHUNK):
        u = torch.rand(CHUNK, 8, generator=gen, dtype=torch.float64)
        d1 = draw(q1_draft.expand(CHUNK, -1), u[:, 0])  # draft ids
        d2 = draw(q2_draft[d1], u[:, 1])
        t1, t2 = draft_targets[d1], draft_targets[d2]
        p = torch.stack([p_rows[0].expand(CHUNK, -1), p_rows[1 + t1], p_rows[0].expand(CHUNK, -1)], 1)  # row 3 unused
        q = torch.stack([q1.expand(CHUNK, -1), q2[d1]], 1)
        accepted, token = rule(p, q, torch.stack([t1, t2], 1), u[:, 2:4], u[:, 4])
        x1 = torch.where(accepted >= 1, t1, token)
        # round two (after a rejection at draft 1): one draft from the drafter's state after x1, its verify row
        d_next = draw(q_next[x1], u[:, 5])
        p2 = torch.stack([p_rows[1 + x1], p_rows[0].expand(CHUNK, -1)], 1)
        accepted_next, token_next = rule(p2, q_next[x1][:, None], d_next[:, None], u[:, 6:7], u[:, 7])
        next_token = torch.where(accepted_next >= 1, d_next, token_next)
        x2 = torch.where(accepted >= 2, t2, torch.where(accepted == 1, token, next_token))
        firsts.append(x1)
        seconds.append(x2)
    return torch.cat(firsts), torch.cat(seconds), p_rows[0], p_rows[0] @ p_rows[1:]


@pytest.mark.parametrize("params", PARAMS, ids=["t1", "t0.8-p0.9-k60"])
def test_chain_speculative_sampling_matches_the_target(world, params):
    """Chain drafts drawn from the drafter and the rejection rule: the first and second generated tokens are
    distributed as the target's own sampling (chi-square p > 0.01 over 10^5 draws, the filters applied to both)."""
    x1, x2, p1, p2 = chain_samples(world, params)
    vocab = len(p1)
    assert chi_square_p(torch.bincount(x1, minlength=vocab), p1) > 0.01
    assert chi_square_p(torch.bincount(x2, minlength=vocab), p2) > 0.01
    if params.top_p < 1:
        assert (p1[x1] > 0).all(), "no token outside the target's top-k/top-p set"


@pytest.mark.parametrize("rule", [accept_all, residual_from_p])
def test_broken_chain_rules_fail_the_test(world, rule):
    """The same test rejects a decode that accepts every draft, or draws from p instead of the residual after a
    rejection (p < 1e-6): the check can fail."""
    x1, _, p1, _ = chain_samples(world, PARAMS[0], rule)
    assert chi_square_p(torch.bincount(x1, minlength=len(p1)), p1) < 1e-6


def tree_samples(
    world, params: SamplingParams, first_child_always: bool = False, shape: tuple[int, int, int] = (5, 4, 8)
) -> tuple[torch.Tensor, ...]:
    """NUM_SAMPLES first and second generated tokens of tree speculative sampling (the drafter's top-k tree of
    ``shape``, steps-topk-tokens, 5-4-8 by default; topk 1: a chain of its top tokens, chain_rule target_only):
    deterministic candidates, from a real tree verify: one draw per row, then the walk into matching children
    (``first_child_always``: a broken walk that always takes the root's first child)."""
    proposer = EagleProposer(world["drafter"], world["d2t"], *shape)
    context, _ = _after_first_token(world, proposer)
    tree = proposer.propose(context)
    rows = probabilities(verify_forward(world["target"], tree, context, with_logits=True).logits, params)
    world["target"].keep(len(context) - 1, [])  # back to the context
    logits, _, _ = _next_rows(world, proposer, context)
    p_next = probabilities(logits, params)  # [V+1, V]
    gen = torch.Generator().manual_seed(1)
    firsts, seconds = [], []
    for _ in range(NUM_SAMPLES // CHUNK):
        drawn = draw(rows.expand(CHUNK, -1, -1), torch.rand(CHUNK, len(rows), generator=gen, dtype=torch.float64))
        fresh = draw(p_next[1:][drawn[:, 0]], torch.rand(CHUNK, generator=gen, dtype=torch.float64))
        for sample, tokens in enumerate(drawn.tolist()):
            if first_child_always:
                tokens[0] = tree.tokens[0]
            path, bonus = accept_path(tree, tokens)
            new = [tree.tokens[i] for i in path] + [bonus]
            firsts.append(new[0])
            seconds.append(new[1] if len(new) > 1 else int(fresh[sample]))  # else round two's first draw
    return torch.tensor(firsts), torch.tensor(seconds), p_next[0], p_next[0] @ p_next[1:]


def test_tree_speculative_sampling_matches_the_target(world):
    """A top-k tree's candidates verified by sampling: first and second tokens distributed as the target's sampling
    (chi-square p > 0.01 over 10^5 draws); a walk that always takes the first child fails the same test."""
    params = PARAMS[0]
    x1, x2, p1, p2 = tree_samples(world, params)
    vocab = len(p1)
    assert chi_square_p(torch.bincount(x1, minlength=vocab), p1) > 0.01
    assert chi_square_p(torch.bincount(x2, minlength=vocab), p2) > 0.01
    broken, _, _, _ = tree_samples(world, params, first_child_always=True)
    assert chi_square_p(torch.bincount(broken, minlength=vocab), p1) < 1e-6


def test_target_only_chain_matches_the_target(world):
    """A chain of the drafter's top tokens (chain_rule target_only, SGLang's default rule at temperature > 0), each
    kept with the target's probability: first and second tokens distributed as the target's sampling (chi-square
    p > 0.01 over 10^5 draws); the first-child walk fails the same test."""
    x1, x2, p1, p2 = tree_samples(world, PARAMS[1], shape=(3, 1, 4))
    vocab = len(p1)
    assert chi_square_p(torch.bincount(x1, minlength=vocab), p1) > 0.01
    assert chi_square_p(torch.bincount(x2, minlength=vocab), p2) > 0.01
    broken, _, _, _ = tree_samples(world, PARAMS[0], first_child_always=True, shape=(3, 1, 4))
    assert chi_square_p(torch.bincount(broken, minlength=vocab), p1) < 1e-6


# ----------------------------------------------------------------------------------------------- decode loops

MAX_NEW = 9


@pytest.fixture(scope="module")
def decode_world(world):
    """The unsharpened tiny target (its own runner) and the greedy reference of one prompt."""
    model = tiny_target()
    target = TargetRunner(model, AUX_IDS)
    drafter, d2t = tiny_drafter(model)
    reference = greedy_decode(target, world["prompt"], MAX_NEW)
    return {"target": target, "drafter": drafter, "d2t": d2t, "prompt": world["prompt"], "reference": reference}


def _methods(decode_world) -> dict[str, object]:
    drafter, d2t = decode_world["drafter"], decode_world["d2t"]
    return {
        "chain": EagleProposer(drafter, d2t, 3),
        "tree": EagleProposer(drafter, d2t, 3, 4, 8),
        "ngram": NgramProposer(),
    }


def test_top_k_one_sampling_is_greedy_in_every_decode(decode_world):
    """With top_k = 1 the target's and drafter's distributions are one-hot, so speculative sampling must commit
    greedy's tokens for chain, tree and n-gram, and the target's own sampling too: the loops read the right rows."""
    params = SamplingParams(1.0, top_k=1)
    target, prompt, reference = decode_world["target"], decode_world["prompt"], decode_world["reference"]
    own = sample_decode(target, prompt, MAX_NEW, [], sampler_for(params, 0, "ref", "cpu"))
    assert own.tokens == reference.tokens and own.logprob == 0.0
    for name, proposer in _methods(decode_world).items():
        out = sampled_speculative_decode(target, proposer, prompt, MAX_NEW, [], sampler_for(params, 0, name, "cpu"))
        assert out.tokens == reference.tokens, name
        assert sampled_check(out).kind == "sampled" and out.logprob == 0.0


def test_sampled_decodes_report_acceptance_at_both_temperatures(decode_world, capsys):
    """Every method at temperature 0 (token-identical to greedy) and 1 (every token inside the target's support,
    a finite log-prob, the same tokens again from the same seed); acceptance lengths printed for the record."""
    target, prompt, reference = decode_world["target"], decode_world["prompt"], decode_world["reference"]
    params, lines = SamplingParams(1.0), []
    for name, proposer in _methods(decode_world).items():
        greedy = speculative_decode(target, proposer, prompt, MAX_NEW)
        assert greedy.tokens == reference.tokens, name
        runs = [
            sampled_speculative_decode(target, proposer, prompt, MAX_NEW, [], sampler_for(params, 7, name, "cpu"))
            for _ in range(2)
        ]
        assert runs[0].tokens == runs[1].tokens and sampled_check(runs[0]).kind == "sampled", name
        assert runs[0].logprob is not None and runs[0].logprob < 0
        lines.append(f"{name}: accept length t=0 {greedy.accept_len:.3f}, t=1 {runs[0].accept_len:.3f}")
    with capsys.disabled():
        print("\ntiny target, random drafter, 1 prompt, " + "; ".join(lines))


def test_chain_rule_decides_how_a_chain_is_drafted(decode_world):
    """rejection draws a chain's drafts from the drafter (with their distributions); target_only proposes the greedy
    chain (no distributions: verified as deterministic candidates) and decodes inside the target's support."""
    target, prompt = decode_world["target"], decode_world["prompt"]
    drafter, d2t = decode_world["drafter"], decode_world["d2t"]
    proposer = EagleProposer(drafter, d2t, 3)
    context, _ = _after_first_token(decode_world, proposer)
    greedy_chain = proposer.propose(context)
    proposer.runner._drop_drafts()  # each proposal below drafts from the same committed state
    rules = {"rejection": True, "target_only": False}  # rule -> drafts come with their distributions
    for rule, has_q in rules.items():
        rounds = SampledRounds(sampler_for(SamplingParams(1.0, chain_rule=rule), 0, rule, "cpu"))
        tree = rounds.propose(proposer, context)
        proposer.runner._drop_drafts()
        assert (tree.draft_probs is not None) is has_q, rule
        if not has_q:
            assert tree.tokens == greedy_chain.tokens
    for rule in rules:
        out = sampled_speculative_decode(
            target, proposer, prompt, MAX_NEW, [], sampler_for(SamplingParams(1.0, chain_rule=rule), 5, rule, "cpu")
        )
        assert sampled_check(out).kind == "sampled" and len(out.tokens) == MAX_NEW, rule


def test_sampled_check_names_a_token_outside_the_support():
    """A decode that committed a token of probability 0 is a mismatch at that position, never 'sampled'."""
    bad = DecodeResult([5, 6], 1.0, outside=(1, 6))
    assert sampled_check(bad).kind == "mismatch" and sampled_check(bad).position == 1
    assert sampled_check(DecodeResult([5, 6], 1.0)).kind == "sampled"


def test_static_runners_sample_what_the_eager_ones_sample(decode_world):
    """The static-cache runners (fixed-width forwards, the logits as an extra output) give the eager runners' sampled
    tokens from the same seed, for chain, tree and the target's own sampling (float64: the same distributions)."""
    from eagle3.evaluate.graphs import CompileSettings
    from eagle3.evaluate.session import make_runners

    eager, prompt = decode_world["target"], decode_world["prompt"]
    drafter, d2t = decode_world["drafter"], decode_world["d2t"]
    target, runner = make_runners(eager.model, AUX_IDS, drafter, d2t, True, CompileSettings(), capacity=64)
    params = SamplingParams(1.0)
    for name, (steps, topk, size) in {"chain": (3, 1, 4), "tree": (3, 4, 8)}.items():
        outs = [
            sampled_speculative_decode(
                t,
                EagleProposer(drafter, d2t, steps, topk, size, runner=r),
                prompt,
                MAX_NEW,
                [],
                sampler_for(params, 3, name, "cpu"),
            )
            for t, r in ((eager, None), (target, runner))
        ]
        assert outs[0].tokens == outs[1].tokens and outs[0].steps == outs[1].steps, name
    own = [sample_decode(t, prompt, MAX_NEW, [], sampler_for(params, 3, "ref", "cpu")) for t in (eager, target)]
    assert own[0].tokens == own[1].tokens
