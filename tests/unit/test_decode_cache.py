"""Static-cache decoding (eagle3/evaluate/decode_cache.py) on the tiny random target and drafter: token-identical to
plain greedy for chain, tree and n-gram (drafts rejected and accepted, small chunks, cache growth), the same logits as
the eager runners, and the same results through torch.compile (Dynamo with the eager backend on CPU)."""

from __future__ import annotations

import pytest
import torch

from eagle3.config import EvaluateConfig
from eagle3.evaluate import decode_cache
from eagle3.evaluate.decode_cache import bucket, decode_widths
from eagle3.evaluate.graphs import CompileSettings, resolve_decode
from eagle3.evaluate.proposers import EagleProposer, NgramProposer
from eagle3.evaluate.runners import DrafterRunner, TargetRunner
from eagle3.evaluate.session import make_runners
from eagle3.evaluate.speculate import (
    DraftTree,
    check_lossless,
    greedy_decode,
    speculative_decode,
    teacher_forced_drafts,
    verify,
)
from eagle3.evaluate.static_drafter import StaticDrafterRunner
from eagle3.evaluate.static_target import StaticTargetRunner
from eagle3.target.tiny import build_tiny_tokenizer
from tests.unit.test_speculate import (
    AUX_IDS,
    MAX_NEW,
    QUESTIONS,
    FakeOracleProposer,
    prompt_ids,
    tiny_drafter,
    tiny_target,
)

COMPILED = CompileSettings(enabled=True, backend="eager", mode=None)  # Dynamo traces, graphs run eagerly


@pytest.fixture(scope="module")
def setup():
    """Tiny target and drafter, the eager runners and the eager greedy references of the three prompts."""
    model = tiny_target()
    tokenizer = build_tiny_tokenizer()
    prompts = [prompt_ids(tokenizer, q) for q in QUESTIONS]
    prompts.append(prompt_ids(tokenizer, "Repeat: the capital of France is Paris. " * 4))  # n-gram hits
    eager = TargetRunner(model, AUX_IDS)
    refs = [greedy_decode(eager, p, MAX_NEW) for p in prompts]
    drafter, d2t = tiny_drafter(model)
    return {"model": model, "eager": eager, "prompts": prompts, "refs": refs, "drafter": drafter, "d2t": d2t}


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 8 rows and caches growing in steps of 16: a prompt runs in several chunks and the caches grow."""
    monkeypatch.setattr(decode_cache, "CHUNK", 8)
    monkeypatch.setattr(decode_cache, "WIDTHS", (1, 4, 8))
    monkeypatch.setattr(decode_cache, "CAPACITY_STEP", 16)


def proposers(setup, runner) -> dict:
    drafter, d2t = setup["drafter"], setup["d2t"]
    return {
        "chain": EagleProposer(drafter, d2t, steps=3, runner=runner),
        "tree": EagleProposer(drafter, d2t, steps=3, topk=3, num_draft_tokens=7, runner=runner),
        "ngram": NgramProposer(),
    }


def eager_proposers(setup) -> dict:
    drafter, d2t = setup["drafter"], setup["d2t"]
    return {
        "chain": EagleProposer(drafter, d2t, steps=3),
        "tree": EagleProposer(drafter, d2t, steps=3, topk=3, num_draft_tokens=7),
        "ngram": NgramProposer(),
    }


def test_bucket_widths():
    """Rows are padded to the smallest fixed width that holds them; more than a chunk is refused."""
    assert [bucket(n) for n in (1, 2, 4, 5, 8, 9, 64)] == [1, 4, 4, 8, 8, 64, 64]
    with pytest.raises(ValueError, match="1..64 rows"):
        bucket(65)


def test_static_greedy_and_methods_equal_the_eager_path(setup, small_chunks):
    """Chunked, growing static caches: greedy equals the eager greedy reference, and chain, tree and n-gram are
    token-identical to it with the very same verify steps (accepted counts) as the eager runners."""
    target = StaticTargetRunner(setup["model"], AUX_IDS, capacity=16)
    runner = StaticDrafterRunner(setup["drafter"], setup["d2t"], capacity=16)
    static, eager = proposers(setup, runner), eager_proposers(setup)
    for prompt, ref in zip(setup["prompts"], setup["refs"]):
        assert greedy_decode(target, prompt, MAX_NEW).tokens == ref.tokens
        for name in static:
            result = speculative_decode(target, static[name], prompt, MAX_NEW)
            assert check_lossless(ref, result.tokens, near_tie_gap=0.0).kind == "identical", name
            assert result.steps == speculative_decode(setup["eager"], eager[name], prompt, MAX_NEW).steps, name
    assert target.capacity > 16 and runner.capacity > 16  # both grew while in use
    accepted = [s.accepted for s in speculative_decode(target, static["ngram"], setup["prompts"][3], MAX_NEW).steps]
    assert max(accepted) >= 2 and min(accepted) == 0  # drafts both accepted and rejected


def test_static_tree_keeps_the_accepted_branch(setup):
    """Trees whose right branch sits behind wrong siblings (test double): the accepted rows are moved down the
    static cache, so every later token still equals greedy; and one verify leaves exactly that path."""
    target = StaticTargetRunner(setup["model"], AUX_IDS, capacity=16)
    for prompt, ref in zip(setup["prompts"], setup["refs"]):
        result = speculative_decode(target, FakeOracleProposer(prompt, ref.tokens, 4, tree=True), prompt, MAX_NEW)
        assert result.tokens == ref.tokens and [s.accepted for s in result.steps] == [4] * 6 + [2]
    prompt, (g0, g1, g2) = setup["prompts"][0], setup["refs"][0].tokens[:3]
    wrong = [(g0 + 1) % 384, (g1 + 1) % 384]
    target.reset()
    target.step(prompt[:-1])
    new, path, aux = verify(target, DraftTree([wrong[0], g0, wrong[1], g1], [-1, -1, 0, 1]), prompt)
    assert (new, path, target.length) == ([g0, g1, g2], [1, 3], len(prompt) + 2)
    eager = setup["eager"]
    eager.reset()
    torch.testing.assert_close(aux, eager.forward([*prompt, g0, g1])[1][-3:], rtol=1e-9, atol=1e-9)
    after = target.step([g2])
    eager.reset()
    reference = eager.forward([*prompt, g0, g1, g2])[0][-1]
    assert int(after.greedy[0]) == int(reference.argmax())
    torch.testing.assert_close(after.top_values[0], reference.topk(5).values, rtol=1e-9, atol=1e-9)


def test_static_drafter_equals_the_eager_drafter(setup, small_chunks):
    """Chunked extends and a tree draft level give the eager DrafterRunner's outputs; a teacher-forced pass too."""
    drafter, d2t = setup["drafter"], setup["d2t"]
    gen = torch.Generator().manual_seed(3)
    aux, ids = torch.randn(19, 192, generator=gen, dtype=torch.float64), torch.randint(0, 300, (19,), generator=gen)
    eager, static = DrafterRunner(drafter, d2t), StaticDrafterRunner(drafter, d2t, capacity=16)
    for runner in (eager, static):
        runner.reset()
    for start, stop in ((0, 13), (13, 19)):  # 13 rows: two chunks of 8, the second padded
        expected, got = (
            eager.extend(aux[start:stop], ids[start:stop].tolist(), start),
            static.extend(aux[start:stop], ids[start:stop].tolist(), start),
        )
        for e, g in zip(expected, got):
            torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-9)
    root = expected[0][-1:]
    level = (root.expand(2, -1), torch.tensor([7, 9]), 19, torch.eye(2, dtype=torch.bool))
    for e, g in zip(eager.draft(*level), static.draft(*level)):  # 2 nodes padded to width 4
        torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-9)
    prompt, ref = setup["prompts"][1], setup["refs"][1]
    target = StaticTargetRunner(setup["model"], AUX_IDS, capacity=16)
    assert teacher_forced_drafts(target, static, prompt, ref.tokens) == teacher_forced_drafts(
        setup["eager"], eager, prompt, ref.tokens
    )


def test_compiled_static_path_is_lossless(setup):
    """Through torch.compile (Dynamo, eager backend) every width compiles and chain, tree and n-gram stay
    token-identical to greedy, with the eager path's verify steps."""
    target, runner = make_runners(setup["model"], AUX_IDS, setup["drafter"], setup["d2t"], True, COMPILED, 128)
    target.warm_up_widths()
    runner.warm_up_widths()
    static, eager = proposers(setup, runner), eager_proposers(setup)
    for prompt, ref in zip(setup["prompts"][2:], setup["refs"][2:]):
        assert greedy_decode(target, prompt, MAX_NEW).tokens == ref.tokens
        for name in static:
            result = speculative_decode(target, static[name], prompt, MAX_NEW)
            assert result.tokens == ref.tokens, name
            assert result.steps == speculative_decode(setup["eager"], eager[name], prompt, MAX_NEW).steps, name
    assert target.step_fn.compiled and runner.step_fn.compiled  # no fallback to eager happened


def test_resolve_decode_switches():
    """auto: static + CUDA graphs of the eager kernels on cuda, eager on cpu; on: Inductor (inside the graphs on
    cuda); both fall back to eager on an error, off has nothing to fall back from; compile=on without the static
    cache fails."""
    assert resolve_decode("auto", "auto", "cpu") == (False, CompileSettings(False, fallback=True))
    assert resolve_decode("auto", "auto", "cuda") == (True, CompileSettings(False, graphs=True, fallback=True))
    assert resolve_decode("auto", "on", "cuda") == (True, CompileSettings(True, graphs=True, fallback=True))
    assert resolve_decode("on", "off", "cuda") == (True, CompileSettings(False, fallback=False))
    assert resolve_decode("on", "on", "cpu") == (True, CompileSettings(True, fallback=True))
    graphed = StaticTargetRunner(tiny_target(), AUX_IDS, 64, CompileSettings(True, graphs=True))
    assert graphed.step_fn.compiled and not graphed.chunk_fn.compiled  # with graphs, prompt chunks skip Inductor
    drafter, d2t = tiny_drafter(tiny_target())
    graphed_drafter = StaticDrafterRunner(drafter, d2t, 64, CompileSettings(True, graphs=True))
    assert graphed_drafter.step_fn.compiled and not graphed_drafter.chunk_fn.compiled
    with pytest.raises(ValueError, match="static cache"):
        resolve_decode("off", "on", "cuda")
    with pytest.raises(ValueError, match="evaluate.compile=on needs the static cache"):
        EvaluateConfig(static_cache="off", compile="on")


@pytest.mark.parametrize("settings", [CompileSettings(), COMPILED], ids=["uncompiled", "compiled"])
def test_static_chain_round_in_one_call_equals_step_by_step_drafts(setup, settings):
    """StaticDrafterRunner.chain (one call per round) proposes the tokens and leaves the cache entries that
    steps - 1 calls of draft give, after extends at several lengths, also through torch.compile."""
    drafter, d2t = setup["drafter"], setup["d2t"]
    fused, stepwise = (StaticDrafterRunner(drafter, d2t, capacity=64, compile_settings=settings) for _ in range(2))
    gen = torch.Generator().manual_seed(5)
    aux, ids = torch.randn(30, 192, generator=gen, dtype=torch.float64), torch.randint(0, 300, (30,), generator=gen)
    for stop in (5, 17, 30):
        for runner in (fused, stepwise):
            runner.reset()
            out, logits = runner.extend(aux[:stop], ids[:stop].tolist(), 0)
        root = (out[-1:], logits[-1])
        for steps in (1, 3, 7):
            fused_tokens = fused.chain(*root, steps).tolist()
            tokens, (hidden, level) = [], root
            for j in range(1, steps + 1):
                token = stepwise.to_target_ids(level.argmax(-1, keepdim=True))
                tokens.append(int(token))
                if j < steps:
                    hidden, rows = stepwise.draft(
                        hidden, token, stop - 1 + j, torch.ones(1, stepwise.num_draft_entries + 1, dtype=torch.bool)
                    )
                    level = rows[0]
            assert fused_tokens == tokens, (stop, steps)
            assert fused.num_draft_entries == stepwise.num_draft_entries == steps - 1
            end = stop + steps - 1
            torch.testing.assert_close(fused.keys[:, :, :end], stepwise.keys[:, :, :end], rtol=0, atol=0)
            stepwise._num_entries = stepwise.num_committed  # drop the round's drafts, as extend would
            fused._num_entries = fused.num_committed


class HostSampledRunner(StaticDrafterRunner):
    """The static runner without its one-call sampled chain: sampled_decode.sampled_chain drafts step by step."""

    @property
    def sampled_chain(self):
        raise AttributeError("sampled_chain: this runner makes sampled_decode draft a sampled chain step by step")


@pytest.mark.parametrize("settings", [CompileSettings(), COMPILED], ids=["uncompiled", "compiled"])
def test_static_sampled_chain_round_in_one_call_equals_step_by_step_draws(setup, settings):
    """StaticDrafterRunner.sampled_chain (one call per round) draws the tokens, gives the distributions and leaves
    the cache entries that step-by-step draws from the same uniforms give (temperature 1, and 0.8 with top-p and
    top-k), after extends at several lengths, also through torch.compile."""
    from eagle3.evaluate.sampled_decode import sampled_chain
    from eagle3.evaluate.sampling import SamplingParams, sampler_for

    drafter, d2t = setup["drafter"], setup["d2t"]
    fused = StaticDrafterRunner(drafter, d2t, capacity=64, compile_settings=settings)
    stepwise = HostSampledRunner(drafter, d2t, capacity=64)
    gen = torch.Generator().manual_seed(5)
    aux, ids = torch.randn(30, 192, generator=gen, dtype=torch.float64), torch.randint(0, 300, (30,), generator=gen)
    for params in (SamplingParams(1.0), SamplingParams(0.8, top_p=0.9, top_k=40)):
        for stop in (5, 17, 30):
            for runner in (fused, stepwise):
                runner.reset()
                out, logits = runner.extend(aux[:stop], ids[:stop].tolist(), 0)
            for steps in (1, 3, 7):
                trees = [
                    sampled_chain(runner, out[-1:], logits[-1], steps, sampler_for(params, 9, f"{stop}/{steps}", "cpu"))
                    for runner in (fused, stepwise)
                ]
                assert trees[0].tokens == trees[1].tokens, (params, stop, steps)
                torch.testing.assert_close(trees[0].draft_probs, trees[1].draft_probs, rtol=0, atol=0)
                end = stop + steps - 1
                torch.testing.assert_close(fused.keys[:, :, :end], stepwise.keys[:, :, :end], rtol=0, atol=0)
                for runner in (fused, stepwise):
                    runner._num_entries = runner.num_committed  # drop the round's drafts, as extend would


class HostTreeRunner(StaticDrafterRunner):
    """The static runner without its device-side tree: EagleProposer builds the tree on the host, level by level."""

    @property
    def tree(self):
        raise AttributeError("tree: this runner makes EagleProposer build its tree on the host")


@pytest.mark.parametrize("settings", [CompileSettings(), COMPILED], ids=["uncompiled", "compiled"])
def test_static_tree_round_built_on_the_device_equals_the_host_tree(setup, settings):
    """StaticDrafterRunner.tree (one call per round, on the device) proposes the tree the host builds level by level
    (tokens and parents) and writes the same draft entries, for several shapes and context lengths (some keeping
    every proposed node, so the frontier choice shows), also through torch.compile."""
    drafter, d2t = setup["drafter"], setup["d2t"]
    device_runner = StaticDrafterRunner(drafter, d2t, capacity=64, compile_settings=settings)
    host_runner = HostTreeRunner(drafter, d2t, capacity=64)
    gen = torch.Generator().manual_seed(7)
    aux, ids = torch.randn(30, 192, generator=gen, dtype=torch.float64), torch.randint(0, 300, (30,), generator=gen)
    for steps, topk, num_tokens in ((3, 3, 7), (5, 4, 8), (3, 3, 1 + 3 + 2 * 9), (4, 2, 1 + 2 + 3 * 4), (1, 3, 3)):
        device_side = EagleProposer(drafter, d2t, steps, topk, num_tokens, runner=device_runner)
        host_side = EagleProposer(drafter, d2t, steps, topk, num_tokens, runner=host_runner)
        for stop in (6, 19, 30):
            for proposer in (device_side, host_side):
                proposer.reset()
                proposer.observe(aux[:stop], ids[:stop].tolist(), 0)
            got, expected = device_side.propose([]), host_side.propose([])
            assert got == expected, (steps, topk, num_tokens, stop)
            end = stop + (steps - 1) * topk
            assert device_runner.num_draft_entries == host_runner.num_draft_entries == end - stop
            torch.testing.assert_close(device_runner.keys[:, :, :end], host_runner.keys[:, :, :end], rtol=0, atol=0)


@pytest.mark.parametrize("gathered", [False, True], ids=["masked", "gathered"])
def test_decode_rows_runs_every_decode_forward_at_one_width_so_bf16_methods_equal_greedy_bit_for_bit(setup, gathered):
    """With decode_rows=8 every target forward but a long input's chunks runs 8 rows wide (greedy tokens and
    verifies alike), and in bfloat16 chain, tree, n-gram and perfect drafts (chain and tree) all give greedy's
    tokens exactly, with the keys masked in place or gathered in sequence order."""
    import copy

    model = copy.deepcopy(setup["model"]).to(torch.bfloat16)
    drafter, d2t = copy.deepcopy(setup["drafter"]).to(torch.bfloat16), setup["d2t"]
    assert decode_widths(8) == (8, 64) and decode_widths(None) == (1, 4, 8, 64) and decode_widths(64) == (64,)
    target, runner = make_runners(
        model, AUX_IDS, drafter, d2t, True, CompileSettings(), 128, decode_rows=8, gathered_keys=gathered
    )
    widths: list[int] = []
    chunk_widths: list[int] = []
    for step, seen in ((target.step_fn, widths), (target.chunk_fn, chunk_widths)):
        step.fn = lambda ids, *rest, inner=step.fn, seen=seen: seen.append(len(ids)) or inner(ids, *rest)
    methods = {**proposers(setup, runner), "chain-7": EagleProposer(drafter, d2t, steps=7, runner=runner)}
    for prompt in setup["prompts"]:
        ref = greedy_decode(target, prompt, MAX_NEW)
        cases = {
            **methods,
            "oracle-chain": FakeOracleProposer(prompt, ref.tokens, 4),
            "oracle-tree": FakeOracleProposer(prompt, ref.tokens, 4, tree=True),
        }
        for name, proposer in cases.items():
            result = speculative_decode(target, proposer, prompt, MAX_NEW)
            assert result.tokens == ref.tokens, name
        assert max(s.accepted for s in result.steps) == 4  # the oracle's drafts were accepted
    assert set(widths) == {8} and len(widths) > 100 and set(chunk_widths) == {64}  # prompts: chunks of 64
    with pytest.raises(ValueError, match="decode_rows 4 must hold the widest verify"):
        EvaluateConfig(methods=["chain", "tree"], chain_steps=[3], decode_rows=4)


def _oracle_tree(greedy: list[int]) -> tuple[list[int], list[int], torch.Tensor]:
    """The greedy tokens as a tree's right branch, each behind a wrong sibling that has a wrong child (so the right
    nodes sit at verify rows 3, 6, 9, ...): (tokens, positions after the root, ancestor mask with the root)."""
    tokens, parents, parent = [], [], -1
    for g in greedy:
        tokens += [(g + 1) % 384, (g + 2) % 384, g]
        parents += [parent, len(tokens) - 3, parent]
        parent = len(tokens) - 1
    n = len(tokens) + 1
    tree, depth = torch.eye(n, dtype=torch.bool), [0] * n
    for i, p in enumerate(parents, start=1):
        tree[i] |= tree[0 if p < 0 else p + 1]
        depth[i] = depth[0 if p < 0 else p + 1] + 1
    return tokens, depth, tree


def tree_rows_unlike_the_chain(target: StaticTargetRunner, prompts: list[list[int]]) -> int:
    """Rows of a tree's right branch (4 greedy tokens behind wrong siblings) whose logits differ in any bit from the
    same tokens verified as a chain, over ``prompts``."""
    differing = 0
    for prompt in prompts:
        greedy = greedy_decode(target, prompt, 4).tokens
        tokens, depth, tree = _oracle_tree(greedy)
        target.reset()
        target.step(prompt[:-1])
        as_tree = target.step([prompt[-1], *tokens], positions=[len(prompt) - 1 + d for d in depth], visible=tree)
        target.reset()
        target.step(prompt[:-1])
        as_chain = target.step([prompt[-1], *greedy])
        differing += sum(
            not torch.equal(as_tree.top_values[row], as_chain.top_values[k]) for k, row in enumerate([0, 3, 6, 9, 12])
        )
    return differing


def test_gathered_keys_make_a_tree_verify_compute_the_chains_logits_bit_for_bit(setup):
    """A tree's right branch verified behind wrong siblings against the same tokens verified as a chain: with keys
    gathered in sequence order every row's logits are the chain's to the last bit; attending the cache in place
    they are not (float32 on this CPU: the mask moves the keys to other lanes of the reductions)."""
    import copy

    differing = {}
    for gathered in (False, True):
        model = copy.deepcopy(setup["model"]).to(torch.float32)
        target = StaticTargetRunner(model, AUX_IDS, 128, CompileSettings(), decode_rows=16, gathered_keys=gathered)
        differing[gathered] = tree_rows_unlike_the_chain(target, setup["prompts"][:3])
    assert differing[True] == 0 and differing[False] > 0, differing


def _gathered_lossless(setup, settings: CompileSettings) -> None:
    """Gathered keys through ``settings``: chain, tree and n-gram equal greedy, with no fallback to eager."""
    import copy

    model = copy.deepcopy(setup["model"])
    target, runner = make_runners(
        model, AUX_IDS, setup["drafter"], setup["d2t"], True, settings, 128, decode_rows=16, gathered_keys=True
    )
    static = proposers(setup, runner)
    for prompt, ref in zip(setup["prompts"][2:], setup["refs"][2:]):
        assert greedy_decode(target, prompt, MAX_NEW).tokens == ref.tokens
        for name in static:
            assert speculative_decode(target, static[name], prompt, MAX_NEW).tokens == ref.tokens, name
    assert target.step_fn.compiled and target.step_fn.fallback_reason is None


@pytest.mark.slow
def test_inductor_compiled_gathered_path_is_lossless(setup):
    """Gathered keys compiled by Inductor's CPU kernels (needs a C++ compiler) stay lossless."""
    _gathered_lossless(setup, CompileSettings(enabled=True, backend="inductor", mode=None))


def test_compiled_gathered_path_is_lossless(setup):
    """Gathered keys through torch.compile (Dynamo, eager backend): chain, tree and n-gram equal greedy."""
    _gathered_lossless(setup, COMPILED)
    gathered = EvaluateConfig(methods=["chain", "tree"], dtype="float32", decode_keys="gathered").resolved("cuda")
    assert gathered.decode_rows == 16  # gathered keys need one decode width, also in float32
    with pytest.raises(ValueError, match="decode_keys=gathered needs the static cache"):
        EvaluateConfig(decode_keys="gathered", static_cache="off")
    on_cpu = EvaluateConfig(decode_keys="gathered").resolved("cpu")  # static auto is off on cpu: nothing to gather
    assert on_cpu.decode_keys == "masked" and EvaluateConfig.model_validate(on_cpu.model_dump()) == on_cpu


def test_evaluate_auto_dtype_and_decode_rows_resolve_per_device():
    """auto: bf16 with one 16-row decode width (or the widest verify) on cuda, fp32 with per-size widths on cpu;
    explicit settings are kept."""
    auto = EvaluateConfig(methods=["chain", "tree"], chain_steps=[3, 7])
    assert (auto.resolved("cuda").dtype, auto.resolved("cuda").decode_rows) == ("bfloat16", 16)
    assert (auto.resolved("cpu").dtype, auto.resolved("cpu").decode_rows) == ("float32", None)
    wide = EvaluateConfig(methods=["tree"], tree_steps=5, tree_topk=4, tree_num_draft_tokens=24).resolved("cuda")
    assert wide.decode_rows == 24
    fixed = EvaluateConfig(dtype="float32", decode_rows=8).resolved("cuda")
    assert (fixed.dtype, fixed.decode_rows) == ("float32", 8)
    assert EvaluateConfig(dtype="float16", static_cache="on").resolved("cpu").decode_rows == 16
    assert EvaluateConfig(dtype="float16").resolved("cpu").decode_rows is None  # no static path on cpu: unused


def _cache_rows(target: StaticTargetRunner) -> list[torch.Tensor]:
    return [t.clone() for layer in target.cache.layers for t in (layer.keys, layer.values)]


def test_cache_row_move_warms_up_on_arguments_that_leave_the_cache_unchanged(setup):
    """A graph capture runs its function twice before recording it: the row move's warm-up arguments leave the
    cache as it was, while the real move of an accepted branch applied twice differs from applying it once."""
    target = StaticTargetRunner(setup["model"], AUX_IDS, capacity=32)
    target.step(setup["prompts"][0][:20])
    src, dst = torch.tensor([4, 7, 8, 9]), torch.tensor([4, 5, 6, 7])  # a branch whose sources overlap its targets
    before = _cache_rows(target)
    target._move_rows(*target.move_fn.warmup_args((src, dst)))
    assert all(torch.equal(a, b) for a, b in zip(before, _cache_rows(target)))
    target._move_rows(src, dst)
    once = _cache_rows(target)
    target._move_rows(src, dst)
    assert not all(torch.equal(a, b) for a, b in zip(once, _cache_rows(target)))


def test_the_row_moves_capture_call_compiles_nothing_its_warm_up_did_not(setup):
    """Through torch.compile, the call a capture records after the two warm-up calls (on warmup_args) hits their
    compiled code: a compile there would run inside the CUDA graph capture (Inductor's compile then fails there).
    Warm-up arguments that alias each other, as the same tensor twice did, recompile at that call."""
    from torch._dynamo.utils import counters

    target, _ = make_runners(setup["model"], AUX_IDS, setup["drafter"], setup["d2t"], True, COMPILED, 128)
    target.warm_up_widths()
    inputs = (torch.tensor([5, 7, 9, 11]), torch.tensor([4, 5, 6, 7]))
    for warmup_args, recompiles in ((target.move_fn.warmup_args, 0), (lambda a: (a[1], a[1]), 1)):
        torch._dynamo.reset()
        for _ in range(2):
            target.move_fn._run(*warmup_args(inputs))
        before = counters["stats"]["unique_graphs"]
        target.move_fn._run(*inputs)
        assert counters["stats"]["unique_graphs"] - before == recompiles


def test_warm_up_runs_the_row_move_at_every_width_and_leaves_an_empty_cache(setup):
    """The warm-up moves rows at the decode width (so no timed tree decode compiles the move) onto themselves."""
    target = StaticTargetRunner(setup["model"], AUX_IDS, capacity=128, decode_rows=16)
    widths, real_move = [], target.move_fn

    def spy(src, dst):
        widths.append(len(src))
        assert torch.equal(src, dst), "a warm-up move must leave the cache as it was"
        return real_move(src, dst)

    target.move_fn = spy
    target.warm_up_widths()
    assert widths == [16] and list(target.widths) == [16, decode_cache.CHUNK] and target.length == 0


def test_compiled_step_falls_back_to_eager_with_its_reason_and_fails_loudly_without_fallback():
    """A backend that fails: with fallback the step warns, keeps the reason and returns the eager results; without
    fallback the error reaches the caller."""
    from eagle3.evaluate.graphs import CompiledStep

    def failing_backend(graph_module, example_inputs):
        raise RuntimeError("no kernels for this shape")

    fn = lambda x: (x * 2,)  # noqa: E731
    step = CompiledStep(
        fn, CompileSettings(True, backend=failing_backend, fallback=True), torch.device("cpu"), "test step"
    )
    with pytest.warns(UserWarning, match="test step: compiling or capturing a CUDA graph failed"):
        (out,) = step(torch.ones(3))
    assert out.tolist() == [2.0, 2.0, 2.0] and not step.compiled
    assert "no kernels for this shape" in step.fallback_reason
    strict = CompiledStep(fn, CompileSettings(True, backend=failing_backend, fallback=False), torch.device("cpu"))
    with pytest.raises(Exception, match="no kernels for this shape"):
        strict(torch.ones(3))


def test_tree_orders_by_counting_equal_stable_sorts():
    """The tree round's sort-free orders equal torch.sort's: descending scores with ties by index (many ties,
    -inf included), and distinct integers ascending."""
    from eagle3.evaluate.tree_draft import _ascending, _order

    gen = torch.Generator().manual_seed(11)
    for n in (1, 4, 16, 68):
        scores = torch.randint(-3, 3, (n,), generator=gen).double()
        scores[torch.rand(n, generator=gen) < 0.2] = float("-inf")
        assert _order(scores).tolist() == torch.sort(-scores, stable=True).indices.tolist()
        values = torch.randperm(200, generator=gen)[:n]
        assert _ascending(values).tolist() == torch.sort(values).values.tolist()


def test_evaluate_switches_read_yaml_booleans_as_on_and_off():
    """A bare `compile: on` in YAML arrives as True: it means "on" (and False "off"), not a validation error."""
    import yaml

    section = EvaluateConfig.model_validate(yaml.safe_load("compile: on\nstatic_cache: on\n"))
    assert (section.compile, section.static_cache) == ("on", "on")
    assert EvaluateConfig.model_validate(yaml.safe_load("compile: off\nstatic_cache: off\n")).compile == "off"
    with pytest.raises(ValueError, match="compile"):
        EvaluateConfig(compile="fast")


def test_a_session_records_which_compiled_steps_fell_back(setup):
    """A step whose compile fails is named, with its reason, in every later prompt record of the session."""
    from eagle3.evaluate.graphs import fallbacks
    from eagle3.evaluate.session import EvalSession, decode_fallbacks

    def failing_backend(graph_module, example_inputs):
        raise RuntimeError("no kernels for this shape")

    settings = CompileSettings(True, backend=failing_backend, fallback=True)
    target, runner = make_runners(setup["model"], AUX_IDS, setup["drafter"], setup["d2t"], True, settings, 128)
    session = EvalSession(target, proposers(setup, runner), runner, None, [])
    assert decode_fallbacks(session) == {}
    prompt, ref = setup["prompts"][0], setup["refs"][0]
    with pytest.warns(UserWarning, match="compiling or capturing a CUDA graph failed"):
        assert greedy_decode(target, prompt, MAX_NEW).tokens == ref.tokens  # eager kernels, same tokens
    fell_back = decode_fallbacks(session)
    assert "target forward" in fell_back and "no kernels for this shape" in fell_back["target forward"]
    assert fell_back == fallbacks([*target.compiled_steps(), *runner.compiled_steps()])


@pytest.mark.parametrize("architecture", ["deepseek_v3", "qwen3"])
def test_gathered_keys_on_mla_and_qwen3_targets_equal_eager_greedy(architecture):
    """Gathered keys on DeepSeek-V3 (MLA: value heads narrower than query/key heads) and Qwen3 tiny targets: the
    static greedy and a perfect drafter's trees behind wrong siblings give the eager greedy's tokens."""
    from eagle3.config import TinyTargetConfig
    from eagle3.target import tiny

    tok = tiny.build_tiny_tokenizer()
    model = tiny.build_tiny_model(tok, TinyTargetConfig(architecture=architecture), seed=0).eval()
    prompt = list(range(5, 30))
    ref = greedy_decode(TargetRunner(model, [1]), prompt, 24).tokens
    target = StaticTargetRunner(model, [1], 128, CompileSettings(), decode_rows=16, gathered_keys=True)
    assert greedy_decode(target, prompt, 24).tokens == ref
    oracle = FakeOracleProposer(prompt, ref, 4, tree=True, vocab=len(tok))
    assert speculative_decode(target, oracle, prompt, 24).tokens == ref
