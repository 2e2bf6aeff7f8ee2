"""Offline speculative decoding on tiny random models: drafter cache = TTT unroll, tree masks, losslessness,
acceptance accounting (perfect and wrong drafters), prompt lookup and the lossless check itself."""

from __future__ import annotations

import pytest
import torch

from eagle3.config import TinyTargetConfig
from eagle3.drafter.functional import TTTCache
from eagle3.drafter.masks import shift_left
from eagle3.drafter.model import DrafterDims, Eagle3Drafter, init_weights
from eagle3.evaluate.proposers import EagleProposer, NgramProposer
from eagle3.evaluate.runners import DrafterRunner, TargetRunner
from eagle3.evaluate.speculate import (
    DecodeResult,
    DraftTree,
    accept_path,
    check_lossless,
    greedy_decode,
    rounding_step,
    speculative_decode,
    teacher_forced_drafts,
    verify,
)
from eagle3.target.tiny import build_tiny_model, build_tiny_tokenizer

AUX_IDS = [1, 3, 4]  # the default [1, N//2-1, N-4] of the 8-layer tiny target
MAX_NEW = 33  # 1 token from the prefill + 8 verify steps of 4 (chain of 3) or of 5 (depth 4: not a multiple)
QUESTIONS = [
    "What is the capital of France?",
    "Write a short function in Python that returns the sum.",
    "Please explain how this works, with an example.",
]


def tiny_target(seed: int = 0):
    """The 8-layer tiny random Llama in float64: verify and single-token forwards then agree far below any gap."""
    return build_tiny_model(build_tiny_tokenizer(), TinyTargetConfig(), seed=seed).double()


def tiny_drafter(model, draft_vocab: int | None = None, seed: int = 0) -> tuple[Eagle3Drafter, torch.Tensor]:
    """A random drafter sized for the tiny target, with its embeddings; draft id i <-> target id 2i (or i)."""
    cfg = model.config
    vocab = cfg.vocab_size
    draft_vocab = draft_vocab or vocab // 2
    dims = DrafterDims(
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.hidden_size // cfg.num_attention_heads,
        intermediate_size=cfg.intermediate_size,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=None,
        vocab_size=vocab,
        draft_vocab_size=draft_vocab,
        num_aux=len(AUX_IDS),
        target_hidden_size=cfg.hidden_size,
    )
    drafter = Eagle3Drafter(dims)
    init_weights(drafter, std=0.2, seed=seed)  # large enough that draft logits are far from ties
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(model.get_input_embeddings().weight)
    step = 2 if 2 * draft_vocab <= vocab else 1
    d2t = torch.arange(draft_vocab) * (step - 1)  # used = step * i, d2t = used - i
    return drafter.to(torch.float64), d2t


def prompt_ids(tokenizer, question: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def setup():
    """Model, runner, drafter and the shared greedy references of the three prompts."""
    tokenizer = build_tiny_tokenizer()
    model = tiny_target()
    target = TargetRunner(model, AUX_IDS)
    prompts = [prompt_ids(tokenizer, q) for q in QUESTIONS]
    refs = [greedy_decode(target, p, MAX_NEW) for p in prompts]
    drafter, d2t = tiny_drafter(model)
    return {"model": model, "target": target, "prompts": prompts, "refs": refs, "drafter": drafter, "d2t": d2t}


class FakeOracleProposer:
    """Test double: proposes the greedy reference's next tokens (a perfect drafter) or, with ``wrong``,
    each of those plus one (never accepted); as a tree, hides the right chain behind a wrong sibling."""

    def __init__(
        self,
        prompt: list[int],
        reference: list[int],
        steps: int,
        wrong: bool = False,
        tree: bool = False,
        vocab: int = 384,
    ) -> None:
        self.full = [*prompt, *reference]
        self.steps, self.wrong, self.tree, self.vocab = steps, wrong, tree, vocab

    def other(self, token: int, offset: int) -> int:
        """A token id that is not ``token`` (offset 1 or 2), still inside the vocab."""
        return (token + offset) % self.vocab

    def reset(self) -> None:
        pass

    def observe(self, aux, next_tokens, start) -> None:
        pass

    def propose(self, context: list[int]) -> DraftTree:
        assert context == self.full[: len(context)], "the decode left the greedy path"
        upcoming = self.full[len(context) : len(context) + self.steps]
        if self.wrong:
            return DraftTree.chain([self.other(t, 1) for t in upcoming])
        if not self.tree:
            return DraftTree.chain(upcoming)
        tokens, parents, parent = [], [], -1
        for token in upcoming:  # per depth: a wrong node (with a wrong child of its own), then the right one
            tokens += [self.other(token, 1), self.other(token, 2), token]
            parents += [parent, len(tokens) - 3, parent]
            parent = len(tokens) - 1
        return DraftTree(tokens, parents)


# --------------------------------------------------------------------------------------------- the drafter


def test_drafter_cache_equals_ttt_unroll(setup):
    """Chunked extends + teacher-forced draft steps reproduce the TTT unroll's logits at every index and step."""
    drafter, d2t = setup["drafter"], setup["d2t"]
    gen = torch.Generator().manual_seed(1)
    seq_len, steps, n = 14, 4, 8
    aux = torch.randn(1, seq_len, 3 * 64, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, drafter.dims.vocab_size, (1, seq_len), generator=gen)
    with torch.no_grad():  # the training path: Eagle3Drafter.forward, one TTT step at a time
        hidden, cache, ref = drafter.project_aux(aux), TTTCache(), []
        for k in range(steps):
            hidden, logits = drafter(
                hidden,
                shift_left(ids, 1 + k, 0),
                torch.arange(seq_len)[None] + k,
                torch.zeros_like(ids),
                cache,
                "dense",
            )
            ref.append(logits[0])  # [T, Vd]
    runner = DrafterRunner(drafter, d2t)
    _, first = runner.extend(aux[0, :5], ids[0, 1:6].tolist(), 0)
    out, second = runner.extend(aux[0, 5 : n + 1], ids[0, 6 : n + 2].tolist(), 5)
    torch.testing.assert_close(torch.cat([first, second]), ref[0][: n + 1], rtol=1e-9, atol=1e-9)
    hidden = out[-1:]
    for j in range(1, steps):  # draft step j at index n: token x_{n+1+j}, position n + j
        hidden, logits = runner.draft(hidden, ids[0, n + 1 + j : n + 2 + j], n + j, torch.ones(1, j, dtype=torch.bool))
        torch.testing.assert_close(logits[0], ref[j][n], rtol=1e-9, atol=1e-9)
    _, later = runner.extend(aux[0, n + 1 : n + 3], ids[0, n + 2 : n + 4].tolist(), n + 1)  # drafts dropped first
    torch.testing.assert_close(later, ref[0][n + 1 : n + 3], rtol=1e-9, atol=1e-9)


def test_tree_draft_mask_equals_separate_chains(setup):
    """Two branches drafted together under an ancestor mask give each branch's logits when drafted alone."""
    drafter, d2t = setup["drafter"], setup["d2t"]
    gen = torch.Generator().manual_seed(2)
    aux, ids = torch.randn(6, 192, generator=gen, dtype=torch.float64), torch.randint(0, 300, (6,), generator=gen)

    def fresh() -> tuple[DrafterRunner, torch.Tensor]:
        runner = DrafterRunner(drafter, d2t)
        out, _ = runner.extend(aux, ids.tolist(), 0)
        return runner, out[-1:]

    runner, root = fresh()
    level1, _ = runner.draft(root.expand(2, -1), torch.tensor([7, 9]), 6, torch.eye(2, dtype=torch.bool))
    ancestors = torch.tensor([[1, 0, 1, 0], [0, 1, 0, 1]], dtype=torch.bool)  # child of 7, child of 9
    _, level2 = runner.draft(level1, torch.tensor([11, 13]), 7, ancestors)
    for branch, (a, b) in enumerate([(7, 11), (9, 13)]):
        alone, root = fresh()
        h, _ = alone.draft(root, torch.tensor([a]), 6, torch.ones(1, 1, dtype=torch.bool))
        _, logits = alone.draft(h, torch.tensor([b]), 7, torch.ones(1, 2, dtype=torch.bool))
        torch.testing.assert_close(level2[branch], logits[0], rtol=1e-9, atol=1e-9)


# ---------------------------------------------------------------------------------------------- the target


def test_tree_verify_and_cache_select_match_sequential_runs(setup):
    """Each tree row's logits equal a plain run of its path; verify() accepts the greedy branch, returns its
    aux rows and leaves exactly that path in the cache."""
    target, prompt = setup["target"], setup["prompts"][0]
    m = len(prompt) - 1

    def plain(tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        target.reset()
        return target.forward(tokens)

    tree = DraftTree([40, 41, 42, 43, 44], [-1, -1, 0, 1, 3])
    target.reset()
    target.forward(prompt[:-1])
    logits, _ = target.forward([prompt[-1], *tree.tokens], [m, *(m + d for d in tree.depths())], tree.ancestor_mask())
    for row, path in enumerate([[], [40], [41], [40, 42], [41, 43], [41, 43, 44]]):
        torch.testing.assert_close(logits[row], plain([*prompt, *path])[0][-1], rtol=1e-9, atol=1e-9)

    g0 = int(plain(prompt)[0][-1].argmax())
    g1 = int(plain([*prompt, g0])[0][-1].argmax())
    full_logits, full_aux = plain([*prompt, g0, g1])
    bonus = int(full_logits[-1].argmax())
    wrong = [(g0 + 1) % 384, (g1 + 1) % 384]
    tree = DraftTree([wrong[0], g0, wrong[1], g1], [-1, -1, 0, 1])  # the greedy branch sits behind wrong nodes
    target.reset()
    target.forward(prompt[:-1])
    new, path, aux = verify(target, tree, prompt)
    assert (new, path, target.length) == ([g0, g1, bonus], [1, 3], m + 3)
    torch.testing.assert_close(aux, full_aux[-3:], rtol=1e-9, atol=1e-9)
    after = target.forward([bonus])[0][-1]
    torch.testing.assert_close(after, plain([*prompt, g0, g1, bonus])[0][-1], rtol=1e-9, atol=1e-9)


def test_greedy_equals_transformers_generate(setup):
    """greedy_decode's tokens are transformers' own greedy generate output."""
    prompt = setup["prompts"][1]
    out = setup["model"].generate(
        torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    assert out[0, len(prompt) :].tolist() == setup["refs"][1].tokens


def test_accept_path_walks_the_matching_branch():
    """The accepted path follows the child equal to each row's greedy token; the bonus is the next greedy token."""
    tree = DraftTree([5, 6, 7, 8], [-1, -1, 1, 1])  # rows: root, 5, 6, 7, 8
    assert accept_path(tree, [6, 0, 8, 0, 3]) == ([1, 3], 3)
    assert accept_path(tree, [9, 0, 0, 0, 0]) == ([], 9)


# ------------------------------------------------------------------------------------------------ lossless


@pytest.mark.parametrize("method", ["chain", "tree", "ngram"])
def test_methods_are_token_identical_to_greedy(setup, method):
    """Chain, tree and n-gram decoding with a random drafter give exactly the greedy reference on every prompt."""
    proposer = {
        "chain": lambda: EagleProposer(setup["drafter"], setup["d2t"], steps=3),
        "tree": lambda: EagleProposer(setup["drafter"], setup["d2t"], steps=3, topk=3, num_draft_tokens=7),
        "ngram": NgramProposer,
    }[method]()
    for prompt, ref in zip(setup["prompts"], setup["refs"]):
        result = speculative_decode(setup["target"], proposer, prompt, MAX_NEW)
        assert check_lossless(ref, result.tokens, near_tie_gap=0.0).kind == "identical"
        assert sum(s.committed for s in result.steps) == len(result.tokens) - 1


def test_perfect_drafter_accepts_every_token(setup):
    """A drafter proposing the greedy tokens (test double) gives acceptance length s+1 = 4.0 exactly, losslessly."""
    for prompt, ref in zip(setup["prompts"], setup["refs"]):
        result = speculative_decode(setup["target"], FakeOracleProposer(prompt, ref.tokens, 3), prompt, MAX_NEW)
        assert result.tokens == ref.tokens
        assert result.accept_len == 4.0 and len(result.steps) == 8
        assert all(s.accepted == 3 and s.draft_depth == 3 for s in result.steps)


def test_wrong_drafter_accepts_nothing_and_stays_lossless(setup):
    """A drafter that is always wrong (test double) gives acceptance length exactly 1.0 and the greedy output."""
    prompt, ref = setup["prompts"][0], setup["refs"][0]
    result = speculative_decode(setup["target"], FakeOracleProposer(prompt, ref.tokens, 3, wrong=True), prompt, MAX_NEW)
    assert result.tokens == ref.tokens and result.accept_len == 1.0 and len(result.steps) == MAX_NEW - 1


def test_tree_accepts_the_right_branch_behind_wrong_siblings(setup):
    """A tree whose right chain sits behind wrong siblings: acceptance length = depth + 1, greedy output
    (the cache keeps scattered rows, so a wrong row selection would change the tokens)."""
    for prompt, ref in zip(setup["prompts"], setup["refs"]):
        fake = FakeOracleProposer(prompt, ref.tokens, 4, tree=True)
        result = speculative_decode(setup["target"], fake, prompt, MAX_NEW)
        assert result.tokens == ref.tokens
        # 1 + 6 x 5 = 31 tokens; the last tree is only 2 deep (the reference ends), 2 tokens fit
        assert [s.accepted for s in result.steps] == [4] * 6 + [2]
        assert [s.committed for s in result.steps] == [5] * 6 + [2]


def test_real_drafter_agreeing_with_a_constant_target(setup):
    """Target and drafter with zeroed final norms both pick id 0: the real EAGLE path accepts all s = 3 drafts."""
    model = tiny_target()
    drafter, d2t = tiny_drafter(model)
    with torch.no_grad():
        model.model.norm.weight.zero_()  # all target logits 0: argmax = id 0
        drafter.norm.weight.zero_()  # all draft logits 0: draft id 0 = target id 0 + d2t[0] = 0
    target = TargetRunner(model, AUX_IDS)
    prompt = setup["prompts"][0]
    result = speculative_decode(target, EagleProposer(drafter, d2t, steps=3), prompt, MAX_NEW)
    assert result.tokens == [0] * MAX_NEW == greedy_decode(target, prompt, MAX_NEW).tokens
    assert result.accept_len == 4.0
    target.close()


def test_tree_with_topk_one_equals_the_chain(setup):
    """The tree drafter with topk 1 and steps + 1 draft tokens proposes exactly the chain, step for step."""
    prompt = setup["prompts"][2]
    chain = speculative_decode(setup["target"], EagleProposer(setup["drafter"], setup["d2t"], steps=3), prompt, MAX_NEW)
    proposer = EagleProposer(setup["drafter"], setup["d2t"], steps=3)
    proposer.propose = lambda context: proposer._tree()  # force the tree code path
    tree = speculative_decode(setup["target"], proposer, prompt, MAX_NEW)
    assert tree.tokens == chain.tokens and tree.steps == chain.steps


def test_teacher_forced_drafts_are_the_chain_rounds_first_drafts(setup):
    """Every chain round's first draft token is the teacher-forced draft at that round's start, and the
    list covers every generated token after the first."""
    for prompt, _ref in zip(setup["prompts"], setup["refs"]):
        proposer = EagleProposer(setup["drafter"], setup["d2t"], steps=3)
        firsts: list[tuple[int, int]] = []  # (context length, first draft token)
        propose = proposer.propose
        proposer.propose = lambda context, propose=propose, firsts=firsts: (
            tree := propose(context),
            firsts.append((len(context), tree.tokens[0])),
        )[0]
        result = speculative_decode(setup["target"], proposer, prompt, MAX_NEW)
        drafts = teacher_forced_drafts(
            setup["target"], DrafterRunner(setup["drafter"], setup["d2t"]), prompt, result.tokens
        )
        assert len(drafts) == len(result.tokens) - 1 and len(firsts) == len(result.steps) > 1
        assert [drafts[c - len(prompt) - 1] for c, _ in firsts] == [token for _, token in firsts]
        assert [s.accepted >= 1 for s in result.steps] == [
            drafts[c - len(prompt) - 1] == result.tokens[c - len(prompt)] for c, _ in firsts
        ]


# ------------------------------------------------------------------------------------------------- n-grams


def test_ngram_proposes_what_followed_the_latest_occurrence():
    """Longest n-gram first (3 down to 1), latest earlier occurrence, up to 3 tokens; nothing without a match."""
    ngram = NgramProposer(max_ngram=3, min_ngram=1, num_tokens=3)
    assert ngram.propose([1, 2, 3, 9, 8, 1, 2, 3]).tokens == [9, 8, 1]
    assert ngram.propose([5, 1, 2, 7, 1, 2, 8, 4, 1, 2]).tokens == [8, 4, 1]  # bigram at 4 is later than at 1
    assert ngram.propose([4, 6, 4]).tokens == [6, 4]
    assert ngram.propose([1, 2, 3]).tokens == []


def test_ngram_accepts_more_than_one_on_a_repetitive_prompt(setup):
    """On a prompt of a repeated phrase, prompt lookup gives acceptance length > 1 and the greedy output."""
    tokenizer = build_tiny_tokenizer()
    prompt = prompt_ids(tokenizer, "Repeat: the capital of France is Paris. " * 4)
    ref = greedy_decode(setup["target"], prompt, MAX_NEW)
    result = speculative_decode(setup["target"], NgramProposer(), prompt, MAX_NEW)
    assert result.tokens == ref.tokens and result.accept_len > 1.0


# -------------------------------------------------------------------------------------------- lossless check


def test_lossless_check_reports_an_injected_mismatch(setup):
    """Changing one generated token is reported as a mismatch at exactly that position, with the gaps."""
    ref = setup["refs"][0]
    tokens = list(ref.tokens)
    tokens[10] = ref.top_ids[10][2]  # the reference's third choice there
    check = check_lossless(ref, tokens, near_tie_gap=1e-9)
    assert (check.kind, check.position, check.reference_token, check.method_token) == (
        "mismatch",
        10,
        ref.tokens[10],
        tokens[10],
    )
    assert check.token_gap == pytest.approx(ref.top_logits[10][0] - ref.top_logits[10][2])
    assert check_lossless(ref, ref.tokens[:20], near_tie_gap=1.0).position == 20  # an output cut short


def test_lossless_check_tells_a_near_tie_from_a_bug():
    """The second choice within the threshold of the top logit is a near-tie; beyond it, or outside the top-K, a bug."""
    ref = DecodeResult([5, 6], 0.0, top_ids=[[5, 1, 2], [6, 8, 9]], top_logits=[[3.0, 2.0, 1.0], [4.0, 3.9999, 1.0]])
    assert check_lossless(ref, [5, 6], 1e-3).kind == "identical"
    near = check_lossless(ref, [5, 8], 1e-3)
    assert (near.kind, near.position) == ("near_tie", 1) and near.top2_gap == pytest.approx(1e-4)
    assert check_lossless(ref, [5, 9], 1e-3).kind == "mismatch"
    assert check_lossless(ref, [5, 77], 1e-3).token_gap is None


def test_lossless_check_allows_one_rounding_step_of_the_compute_dtype():
    """In bf16 two logits one rounding step apart (0.0625 at 15.3) are a near-tie; the same gap in fp32 is a bug."""
    ref = DecodeResult([5], 0.0, top_ids=[[5, 8]], top_logits=[[15.3125, 15.25]])
    assert check_lossless(ref, [8], 1e-3, torch.bfloat16).kind == "near_tie"
    assert check_lossless(ref, [8], 1e-3, torch.float32).kind == "mismatch"
    assert rounding_step(15.3, torch.bfloat16) == 0.0625 and rounding_step(0.0, torch.float32) == torch.finfo().eps


@pytest.mark.parametrize("stop_at", [0, 2, 7, 8, 10])
def test_greedy_ends_at_the_first_stop_token_wherever_the_device_is_read(setup, stop_at):
    """A stop id first generated at position k ends greedy at k + 1 tokens, with the reference's tokens and tops,
    whether k falls on, before or after a read of the device (every STOP_CHECK_EVERY tokens)."""
    ref = setup["refs"][0]
    stop = ref.tokens[stop_at]
    first = ref.tokens.index(stop)
    got = greedy_decode(setup["target"], setup["prompts"][0], MAX_NEW, stop_ids=[stop])
    assert got.tokens == ref.tokens[: first + 1]
    assert got.top_ids == ref.top_ids[: first + 1] and got.top_logits == ref.top_logits[: first + 1]
