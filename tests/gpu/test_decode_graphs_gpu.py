"""The evaluation's static runners on CUDA with CUDA graphs (evaluate.compile=auto): every method gives greedy's
tokens, the graphs are captured (no fallback), and they are captured again when the caches grow."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from eagle3.evaluate import decode_cache
from eagle3.evaluate.graphs import resolve_decode
from eagle3.evaluate.proposers import EagleProposer, NgramProposer
from eagle3.evaluate.runners import TargetRunner
from eagle3.evaluate.session import make_runners
from eagle3.evaluate.speculate import greedy_decode, speculative_decode
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

pytestmark = pytest.mark.gpu


def _setup(dtype: torch.dtype):
    model = tiny_target()
    drafter, d2t = tiny_drafter(model)
    model, drafter = copy.deepcopy(model).to("cuda", dtype), copy.deepcopy(drafter).to("cuda", dtype)
    tokenizer = build_tiny_tokenizer()
    prompts = [prompt_ids(tokenizer, q) for q in QUESTIONS]
    prompts.append(prompt_ids(tokenizer, "Repeat: the capital of France is Paris. " * 4))
    return model, drafter, d2t, prompts


@pytest.mark.parametrize(
    "dtype,gathered",
    [(torch.float64, False), (torch.bfloat16, False), (torch.bfloat16, True)],
    ids=["float64", "bfloat16", "bfloat16-gathered"],
)
def test_graphed_static_methods_equal_greedy_and_recapture_after_growth(dtype, gathered, monkeypatch):
    """Graphs on (compile=auto), decode_rows 16, caches that start small and grow: chain, tree, n-gram and a
    perfect drafter give greedy's tokens (keys masked in place or gathered); in float64 greedy also equals the
    eager runner's."""
    monkeypatch.setattr(decode_cache, "CAPACITY_STEP", 16)
    model, drafter, d2t, prompts = _setup(dtype)
    static, settings = resolve_decode("auto", "auto", "cuda")
    assert static and settings.graphs and not settings.enabled
    target, runner = make_runners(
        model, AUX_IDS, drafter, d2t, static, settings, 16, decode_rows=16, gathered_keys=gathered
    )
    eager = TargetRunner(model, AUX_IDS)
    methods = {
        "chain": EagleProposer(drafter, d2t, 3, runner=runner),
        "tree": EagleProposer(drafter, d2t, 3, 3, 7, runner=runner),
        "ngram": NgramProposer(),
    }
    for prompt in prompts:
        ref = greedy_decode(target, prompt, MAX_NEW)
        if dtype == torch.float64:
            assert ref.tokens == greedy_decode(eager, prompt, MAX_NEW).tokens
        cases = {**methods, "oracle": FakeOracleProposer(prompt, ref.tokens, 4, tree=True)}
        for name, proposer in cases.items():
            assert speculative_decode(target, proposer, prompt, MAX_NEW).tokens == ref.tokens, name
    assert target.capacity > 16 and runner.capacity > 16  # both grew, so their graphs were captured again
    assert target.step_fn.use_graphs and runner.step_fn.use_graphs and target.move_fn.use_graphs  # no fallback
    assert target.step_fn.num_graphs >= 1 and runner.step_fn.num_graphs >= 1
    assert all(r.use_graphs and r.num_graphs >= 1 for r in runner._rounds.values())  # chain and tree rounds
    assert len(runner._rounds) == 2 and target.move_fn.num_graphs >= 1


def test_first_graphed_move_after_a_growth_moves_the_rows_once():
    """The first keep after the graphs were cleared captures the row move: the cache ends as one eager move leaves
    it (warming up on the real rows moved an overlapping branch three times)."""
    model, _, _, prompts = _setup(torch.float32)
    static, settings = resolve_decode("auto", "auto", "cuda")
    graphed, _ = make_runners(model, AUX_IDS, None, None, static, settings, 64, decode_rows=16)
    eager, _ = make_runners(model, AUX_IDS, None, None, static, replace(settings, graphs=False), 64, decode_rows=16)
    for target in (graphed, eager):
        target.step(prompts[0][:20])
        target.keep(8, [9, 12, 13, 15])  # sources 12, 13 are also targets 10, 11 of earlier rows
    assert graphed.move_fn.num_graphs == 1
    for a, b in zip(graphed.cache.layers, eager.cache.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_gathered_keys_make_a_cuda_bf16_tree_verify_compute_the_chains_logits_bit_for_bit():
    """On CUDA in bf16 with graphs: a tree's right branch behind wrong siblings gives the chain's logits to the last
    bit with gathered keys (the masked count is printed: the near-ties of the 160-prompt evaluation came from it)."""
    from tests.unit.test_decode_cache import tree_rows_unlike_the_chain

    static, settings = resolve_decode("auto", "auto", "cuda")
    differing = {}
    for gathered in (False, True):
        model, _, _, prompts = _setup(torch.bfloat16)
        target, _ = make_runners(
            model, AUX_IDS, None, None, static, settings, 256, decode_rows=16, gathered_keys=gathered
        )
        differing[gathered] = tree_rows_unlike_the_chain(target, prompts)
    print(f"tree rows whose logits differ from the chain's: masked {differing[False]}, gathered {differing[True]}")
    assert differing[True] == 0


@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused-gate-up"])
def test_inductor_graphs_with_gathered_keys_equal_greedy_in_bf16(fused):
    """The GPU presets' evaluation path (compile=on: Inductor's kernels in CUDA graphs; gathered keys; one 16-row
    decode width), with the MLPs' gate/up products separate or fused: chain, tree, n-gram and a perfect drafter
    give greedy's tokens in bf16, and no step fell back to eager kernels (the warm-up's seconds are printed)."""
    from eagle3.evaluate.fused_projections import fuse_projections
    from eagle3.evaluate.graphs import fallbacks, warmup_summary

    model, drafter, d2t, prompts = _setup(torch.bfloat16)
    assert not fused or fuse_projections(model) == len(model.model.layers)
    static, settings = resolve_decode("auto", "on", "cuda")
    assert settings.enabled and settings.graphs
    target, runner = make_runners(
        model, AUX_IDS, drafter, d2t, static, settings, 512, decode_rows=16, gathered_keys=True
    )
    target.warm_up_widths()
    runner.warm_up_widths()
    methods = {
        "chain": EagleProposer(drafter, d2t, 3, runner=runner),
        "tree": EagleProposer(drafter, d2t, 3, 3, 7, runner=runner),
        "ngram": NgramProposer(),
    }
    for prompt in prompts:
        ref = greedy_decode(target, prompt, MAX_NEW)
        cases = {**methods, "oracle": FakeOracleProposer(prompt, ref.tokens, 4, tree=True)}
        for name, proposer in cases.items():
            assert speculative_decode(target, proposer, prompt, MAX_NEW).tokens == ref.tokens, name
    steps = [*target.compiled_steps(), *runner.compiled_steps()]
    print(f"warm-up by step: {warmup_summary(steps)}")
    assert fallbacks(steps) == {}


def test_a_step_captures_again_after_its_graphs_were_dropped_while_their_tensors_live():
    """A step whose graphs were dropped (a cache grew) captures again although a tensor its old pool allocated is
    still alive, and a second step captures beside it: the case that failed PyTorch's pool assert with one
    process-wide pool."""
    from eagle3.evaluate.graphs import CompiledStep, CompileSettings

    settings = CompileSettings(graphs=True)  # eager kernels in graphs, no fallback: a capture error fails the test
    x = torch.arange(8.0, device="cuda")
    step = CompiledStep(lambda t: (t * 2 + 1,), settings, torch.device("cuda"), "test step")
    assert torch.equal(step(x)[0], x * 2 + 1) and step.num_graphs == 1
    alive = next(iter(step._graphs.values())).outputs  # allocated from the step's pool during the capture
    step.clear()
    torch.cuda.synchronize()
    assert torch.equal(step(x + 1)[0], (x + 1) * 2 + 1) and step.num_graphs == 1
    other = CompiledStep(lambda t: (t - 3,), settings, torch.device("cuda"), "other step")
    assert torch.equal(other(x)[0], x - 3) and alive[0].is_cuda
