"""DFlash speculative sampling at temperature > 0: lossless in distribution (chi-square over 10^5 draws on the tiny
target, the first two generated positions, plain and with top-p/top-k), broken rules caught by the same test, and
the real decode loop (with top_k = 1 sampling is greedy, so it must give greedy's tokens).

A DFlash block's drafts are the drafter's argmax, so the rejection rule sees each draft as a point mass q (as SGLang
verifies them, docs/dflash.md): the decode draws one token per verify row and walks the chain while the drawn token
equals the draft (eagle3.evaluate.sampled_decode.SampledRounds.verify), which eagle3.evaluate.sampling states is the
standard rule (chain_accept) with q one-hot. Both are tested here on the real block and the real verify rows.

A random drafter's drafts get ~1/V of the target's mass, so rules that mishandle a draft would go unseen: the drafter
here is first trained (dflash_loss, the train stage's objective) on the target's greedy continuation of the prompt,
so that its drafts carry target mass and rounds accept some of them.
"""

from __future__ import annotations

import pytest
import torch

from eagle3.drafter.dflash_loss import dflash_loss
from eagle3.evaluate.dflash_decode import DFlashProposer
from eagle3.evaluate.runners import TargetRunner
from eagle3.evaluate.sampled_decode import SampledRounds, sample_decode, sampled_check, sampled_speculative_decode
from eagle3.evaluate.sampling import SamplingParams, chain_accept, draw, probabilities, sampler_for
from eagle3.evaluate.speculate import DraftTree, accept_path, greedy_decode, speculative_decode, verify_forward
from eagle3.target.tiny import build_tiny_tokenizer
from tests.unit.test_dflash_evaluate import tiny_dflash
from tests.unit.test_sampling import CHUNK, NUM_SAMPLES, PARAMS, AcceptRule, accept_all, chi_square_p, residual_from_p
from tests.unit.test_speculate import AUX_IDS, QUESTIONS, prompt_ids, tiny_target

BLOCK = 4  # K: 3 drafts per round
MAX_NEW = 9


@pytest.fixture(scope="module")
def drafter():
    """A DFlash drafter trained until every block anchored in the tiny target's greedy continuation of the prompt
    (MAX_NEW tokens) drafts that continuation (argmax of each slot)."""
    model = tiny_target()
    target = TargetRunner(model, AUX_IDS)
    prompt = prompt_ids(build_tiny_tokenizer(), QUESTIONS[0])
    seq = prompt + greedy_decode(target, prompt, MAX_NEW + BLOCK - 1).tokens
    target.reset()
    features = target.step(seq).aux[None]  # [1, T, F*H]
    ids = torch.tensor(seq)[None]  # [1, T]
    loss_mask = (torch.arange(len(seq)) >= len(prompt)).long()[None]
    anchors = torch.arange(len(prompt), len(prompt) + MAX_NEW)[None]  # a block at every generated position
    model_drafter = tiny_dflash(model, block=BLOCK).train()
    optimizer = torch.optim.Adam([w for w in model_drafter.parameters() if w.requires_grad], lr=1e-2)
    for _ in range(300):
        out = dflash_loss(model_drafter, features, ids, loss_mask, anchors, torch.ones_like(anchors, dtype=torch.bool))
        if torch.equal(out.num_full_correct, out.num_supervised):
            return model_drafter.eval()
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
    raise AssertionError(f"the drafter did not learn the continuation: {out.num_full_correct} of {out.num_supervised}")


@pytest.fixture(scope="module")
def world(drafter):
    """The tiny target (final norm x12, so its next-token distribution is far from uniform; its aux states and greedy
    tokens are the unsharpened target's, which the drafter learned), a prompt whose first token is committed, that
    round's block and its verify rows, and the target's rows after the prompt and one more token x, for every x."""
    model = tiny_target()
    with torch.no_grad():
        model.model.norm.weight.mul_(12)
    target = TargetRunner(model, AUX_IDS)
    proposer = DFlashProposer(drafter)
    prompt = prompt_ids(build_tiny_tokenizer(), QUESTIONS[0])
    first = target.step(prompt, last_only=True)
    context = [*prompt, int(first.greedy[-1])]
    proposer.observe(first.aux, context[1:], 0)
    block = proposer.propose(context)
    logits = verify_forward(target, block, context, with_logits=True).logits  # [K, V]
    target.keep(len(context) - 1, [])  # back to the context
    vocab = model.config.vocab_size
    every = verify_forward(target, DraftTree(list(range(vocab)), [-1] * vocab), context, with_logits=True).logits
    target.keep(len(context) - 1, [])
    return {"target": target, "context": context, "block": block, "logits": logits, "every": every}


def _walk(p: torch.Tensor, block: DraftTree, u_rows: torch.Tensor) -> list[list[int]]:
    """The decode's rule on CHUNK rounds: one draw per verify row p [K, V] (uniforms [CHUNK, K]), then the walk
    down the chain while the drawn token is the draft (speculate.accept_path): each round's new tokens."""
    drawn = draw(p.expand(len(u_rows), -1, -1), u_rows).tolist()  # [CHUNK, K]
    out = []
    for tokens in drawn:
        path, bonus = accept_path(block, tokens)
        out.append([block.tokens[i] for i in path] + [bonus])
    return out


def _rule(rule: AcceptRule, p: torch.Tensor, block: DraftTree, u_rows: torch.Tensor) -> list[list[int]]:
    """A chain rejection rule on CHUNK rounds, each draft a point mass q (the drafter's argmax): new tokens."""
    drafts = torch.tensor(block.tokens)  # [S]
    q = torch.nn.functional.one_hot(drafts, p.shape[-1]).double()  # [S, V]
    num = len(drafts)
    accepted, token = rule(
        p.expand(len(u_rows), -1, -1),
        q.expand(len(u_rows), -1, -1),
        drafts.expand(len(u_rows), -1),
        u_rows[:, :num],
        u_rows[:, num],
    )
    return [[*block.tokens[:a], t] for a, t in zip(accepted.tolist(), token.tolist())]


def dflash_samples(world, params: SamplingParams, rule: AcceptRule | None = None) -> tuple[torch.Tensor, ...]:
    """NUM_SAMPLES first and second generated tokens of DFlash speculative sampling after the committed first token:
    round one verifies the block by the decode's walk (``rule`` None) or by ``rule``; where it commits one token
    the second is round two's first, which any block's verify draws from the target's row after that token.
    Also the target's own distributions: (x1, x2, p1 [V], p2 = sum_x p1(x) p(. | x) [V])."""
    p = probabilities(world["logits"], params)  # [K, V]
    p_every = probabilities(world["every"], params)  # [V+1, V]: row 0 after the context, 1 + x after x
    gen = torch.Generator().manual_seed(2)
    firsts, seconds = [], []
    for _ in range(NUM_SAMPLES // CHUNK):
        u = torch.rand(CHUNK, BLOCK + 1, generator=gen, dtype=torch.float64)
        rounds = _walk(p, world["block"], u[:, :BLOCK]) if rule is None else _rule(rule, p, world["block"], u)
        x1 = torch.tensor([new[0] for new in rounds])
        fresh = draw(p_every[1 + x1], u[:, BLOCK])  # round two's first token
        firsts.append(x1)
        seconds.append(torch.tensor([new[1] if len(new) > 1 else int(f) for new, f in zip(rounds, fresh)]))
    return torch.cat(firsts), torch.cat(seconds), p_every[0], p_every[0] @ p_every[1:]


def test_the_block_and_its_rows_are_usable(world):
    """The round under test drafts K-1 tokens, each with target probability > 0.05 at temperature 1 (so a rule that
    mishandles a draft moves the distribution), and the verify's row 0 is the target's row after the context."""
    p = probabilities(world["logits"], PARAMS[0])
    assert len(world["block"].tokens) == BLOCK - 1
    chosen = p[torch.arange(BLOCK - 1), torch.tensor(world["block"].tokens)]
    assert (chosen > 0.05).all(), chosen
    assert torch.allclose(world["logits"][0], world["every"][0], atol=1e-9)


def test_the_walk_is_what_the_decode_runs(world):
    """SampledRounds.verify on the real block commits, for 20 random streams, the tokens the batched walk gives
    from the same uniforms: the test below samples the decode's own rule."""
    target, context, block = world["target"], world["context"], world["block"]
    params = PARAMS[0]
    p = probabilities(world["logits"], params)
    lengths = set()
    for stream in range(20):
        rounds = SampledRounds(sampler_for(params, 0, f"walk/{stream}", "cpu"))
        new, path, _ = rounds.verify(target, block, context)
        target.keep(len(context) - 1, [])
        u = sampler_for(params, 0, f"walk/{stream}", "cpu").uniform(BLOCK)
        assert new == _walk(p, block, u[None])[0] and len(path) == len(new) - 1
        lengths.add(len(new))
    assert len(lengths) > 1, "some rounds accept a draft, some do not"


@pytest.mark.parametrize("rule", [None, chain_accept], ids=["decode-walk", "chain-accept"])
@pytest.mark.parametrize("params", PARAMS, ids=["t1", "t0.8-p0.9-k60"])
def test_dflash_speculative_sampling_matches_the_target(world, params, rule):
    """A DFlash block verified by speculative sampling (the decode's walk, and the standard rule with q a point mass
    on each draft): the first and second generated tokens are distributed as the target's own sampling (chi-square
    p > 0.01 over 10^5 draws, the filters applied to both), and never outside the top-k/top-p set."""
    x1, x2, p1, p2 = dflash_samples(world, params, rule)
    vocab = len(p1)
    assert chi_square_p(torch.bincount(x1, minlength=vocab), p1) > 0.01
    assert chi_square_p(torch.bincount(x2, minlength=vocab), p2) > 0.01
    if params.top_p < 1:
        assert (p1[x1] > 0).all(), "no token outside the target's top-k/top-p set"


@pytest.mark.parametrize("rule", [accept_all, residual_from_p])
def test_broken_rules_fail_the_test(world, rule):
    """The same test rejects a DFlash decode that accepts every draft, or after a rejection draws from p instead of
    norm(max(0, p - q)) (so the rejected draft can come back): p < 1e-6, the check can fail."""
    x1, _, p1, _ = dflash_samples(world, PARAMS[0], rule)
    assert chi_square_p(torch.bincount(x1, minlength=len(p1)), p1) < 1e-6


# ----------------------------------------------------------------------------------------------- the decode loop


@pytest.fixture(scope="module")
def decode_world(drafter):
    """The unsharpened tiny target, the trained DFlash drafter, the prompt and its greedy reference."""
    target = TargetRunner(tiny_target(), AUX_IDS)
    prompt = prompt_ids(build_tiny_tokenizer(), QUESTIONS[0])
    return {
        "target": target,
        "proposer": DFlashProposer(drafter),
        "prompt": prompt,
        "reference": greedy_decode(target, prompt, MAX_NEW),
    }


def test_top_k_one_sampling_is_greedy(decode_world):
    """With top_k = 1 every distribution is one-hot, so DFlash speculative sampling must commit greedy's tokens, here
    whole blocks (the drafter drafts the greedy continuation): the loop reads the right rows and commits what the
    walk accepts."""
    params = SamplingParams(1.0, top_k=1)
    target, proposer = decode_world["target"], decode_world["proposer"]
    out = sampled_speculative_decode(
        target, proposer, decode_world["prompt"], MAX_NEW, [], sampler_for(params, 0, "dflash", "cpu")
    )
    assert out.tokens == decode_world["reference"].tokens
    assert max(s.accepted for s in out.steps) == BLOCK - 1
    assert sampled_check(out).kind == "sampled" and out.logprob == 0.0


def test_sampled_dflash_decode_at_temperature_one(decode_world, capsys):
    """At temperature 1 the DFlash decode stays inside the target's support with a finite log-prob, repeats itself
    from the same seed, drafts K-1 tokens a round; acceptance at t=0 and t=1 printed for the record."""
    target, proposer, prompt = decode_world["target"], decode_world["proposer"], decode_world["prompt"]
    params = SamplingParams(1.0)
    runs = [
        sampled_speculative_decode(target, proposer, prompt, MAX_NEW, [], sampler_for(params, 7, "dflash", "cpu"))
        for _ in range(2)
    ]
    assert runs[0].tokens == runs[1].tokens and len(runs[0].tokens) == MAX_NEW
    assert sampled_check(runs[0]).kind == "sampled" and runs[0].logprob is not None and runs[0].logprob < 0
    assert all(s.draft_depth == BLOCK - 1 and s.committed <= s.accepted + 1 for s in runs[0].steps)
    own = sample_decode(target, prompt, MAX_NEW, [], sampler_for(params, 7, "ref", "cpu"))
    assert sampled_check(own).kind == "sampled"
    greedy = speculative_decode(target, proposer, prompt, MAX_NEW)
    with capsys.disabled():
        print(
            f"\ntiny target, trained DFlash drafter (K={BLOCK}), 1 prompt: accept length t=0 "
            f"{greedy.accept_len:.3f}, t=1 {runs[0].accept_len:.3f}"
        )
