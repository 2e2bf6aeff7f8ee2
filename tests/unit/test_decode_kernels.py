"""Fewer kernels per decode forward and fewer compiles in the evaluation's warm-up: fused gate/up products
(eagle3/evaluate/fused_projections.py), the drafter's extends at the target's one decode width, and the
seconds each compiled step spent per shape (eagle3/evaluate/graphs.py), printed so a slow warm-up says where it went."""

from __future__ import annotations

import copy

import pytest
import torch

from eagle3.evaluate.decode_cache import CHUNK
from eagle3.evaluate.fused_projections import FusedGateUpMLP, fuse_projections
from eagle3.evaluate.graphs import CompiledStep, CompileSettings, warmup_summary
from eagle3.evaluate.proposers import EagleProposer
from eagle3.evaluate.runners import TargetRunner
from eagle3.evaluate.session import make_runners
from eagle3.evaluate.speculate import greedy_decode, speculative_decode
from eagle3.evaluate.static_target import StaticTargetRunner
from tests.unit.test_decode_cache import COMPILED, setup  # noqa: F401  (the module fixture)
from tests.unit.test_speculate import AUX_IDS, MAX_NEW, FakeOracleProposer


def test_with_decode_rows_the_drafter_extends_at_that_one_width_and_decodes_stay_lossless(setup):  # noqa: F811
    """decode_rows=8: every drafter extend after a verify (1..5 accepted rows here) runs 8 rows wide, the warm-up
    runs the drafter at 8 and CHUNK only, and chains (drafted and perfect) still give greedy's tokens."""
    target, runner = make_runners(
        setup["model"], AUX_IDS, setup["drafter"], setup["d2t"], True, CompileSettings(), 128, decode_rows=8
    )
    widths: list[int] = []
    inner = runner.step_fn.fn
    runner.step_fn.fn = lambda hidden, *rest: widths.append(len(hidden)) or inner(hidden, *rest)
    runner.warm_up_widths()
    assert widths == [8] and runner.widths == (8, CHUNK)
    widths.clear()
    for prompt in setup["prompts"]:
        ref = greedy_decode(target, prompt, MAX_NEW)
        for proposer in (
            EagleProposer(setup["drafter"], setup["d2t"], steps=3, runner=runner),
            FakeOracleProposer(prompt, ref.tokens, 4),
        ):
            out = speculative_decode(target, proposer, prompt, MAX_NEW)
            assert out.tokens == ref.tokens
    assert widths and set(widths) == {8}  # the prompts' extends are CHUNK rows: the chunk step, not this one


def test_compiled_steps_time_each_new_shape_once_and_the_summary_lists_them_slowest_first():
    """A compiled step records seconds for the first call of each argument shape only (later calls add nothing),
    and the summary names step and shape of every entry, slowest first."""
    step = CompiledStep(lambda x: (x * 2,), COMPILED, torch.device("cpu"), "test step")
    for n in (3, 5, 3, 5, 5):
        step(torch.ones(n))
    assert sorted(step.setup_s) == ["3", "5"] and all(s > 0 for s in step.setup_s.values())
    before = dict(step.setup_s)
    step(torch.ones(3))
    assert step.setup_s == before
    other = CompiledStep(lambda x: (x + 1,), COMPILED, torch.device("cpu"), "other step")
    step.setup_s, other.setup_s = {"3": 1.25, "5": 0.5}, {"2x4": 7.0}
    assert warmup_summary([step, other]) == "other step (2x4) 7.0 s; test step (3) 1.2 s; test step (5) 0.5 s"
    eager = CompiledStep(lambda x: (x,), CompileSettings(), torch.device("cpu"), "eager step")
    eager(torch.ones(2))
    assert eager.setup_s == {} and warmup_summary([eager]) == ""  # nothing compiled: nothing to report


def _params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def test_fused_gate_up_computes_the_unfused_logits_and_decodes_give_greedys_tokens(setup):  # noqa: F811
    """Every Llama layer's MLP gets one gate/up product, no parameter is added or lost, the logits equal the
    unfused model's (float64, to rounding) also through Dynamo with no graph break and no recompile on a new input,
    and the static decodes, fused, give the unfused eager greedy's tokens (drafts and perfect drafts)."""
    from torch._dynamo.utils import counters

    model = copy.deepcopy(setup["model"])
    assert fuse_projections(model) == len(model.model.layers) and _params(model) == _params(setup["model"])
    assert all(isinstance(layer.mlp, FusedGateUpMLP) for layer in model.model.layers)
    ids = torch.tensor([setup["prompts"][0]])
    with torch.no_grad():
        plain = setup["model"](input_ids=ids).logits
        torch.testing.assert_close(model(input_ids=ids).logits, plain, rtol=1e-12, atol=1e-12)
        counters.clear()
        compiled = torch.compile(lambda x: model(input_ids=x).logits, backend="eager", dynamic=False)
        torch.testing.assert_close(compiled(ids), plain, rtol=1e-12, atol=1e-12)
        with torch.compiler.set_stance("fail_on_recompile"):
            compiled(ids.clone())
    assert not counters["graph_break"]
    target, runner = make_runners(
        model, AUX_IDS, setup["drafter"], setup["d2t"], True, CompileSettings(), 128, decode_rows=8
    )
    for prompt, ref in zip(setup["prompts"], setup["refs"]):
        assert greedy_decode(target, prompt, MAX_NEW).tokens == ref.tokens
        for proposer in (
            EagleProposer(setup["drafter"], setup["d2t"], steps=3, runner=runner),
            EagleProposer(setup["drafter"], setup["d2t"], steps=3, topk=3, num_draft_tokens=7, runner=runner),
            FakeOracleProposer(prompt, ref.tokens, 4, tree=True),
        ):
            assert speculative_decode(target, proposer, prompt, MAX_NEW).tokens == ref.tokens


@pytest.mark.parametrize("architecture", ["deepseek_v3", "qwen3"])
def test_fusion_leaves_moe_experts_alone_and_keeps_greedy(architecture):
    """DeepSeek-V3 (MLA attention, MoE layers): only its dense MLPs fuse; Qwen3: every MLP. The static greedy of
    the fused model equals the unfused eager greedy on both."""
    from eagle3.config import TinyTargetConfig
    from eagle3.target import tiny

    tok = tiny.build_tiny_tokenizer()
    model = tiny.build_tiny_model(tok, TinyTargetConfig(architecture=architecture), seed=0).eval()
    prompt = list(range(5, 30))
    ref = greedy_decode(TargetRunner(model, [1]), prompt, 24).tokens
    fused = copy.deepcopy(model)
    count = fuse_projections(fused)
    mlps = [type(layer.mlp).__name__ for layer in model.model.layers]
    expected = mlps.count("DeepseekV3MLP") if architecture == "deepseek_v3" else len(mlps)
    assert count == expected and count > 0 and _params(fused) == _params(model)
    target = StaticTargetRunner(fused, [1], 128, CompileSettings(), decode_rows=16)
    assert greedy_decode(target, prompt, 24).tokens == ref


@pytest.mark.parametrize("kind", ["packed", "matmul"])
@pytest.mark.parametrize("width", [1, 5, 16])
def test_packed_gqa_attention_equals_attention_over_the_repeated_cache(width, kind):
    """Query heads packed as rows of their key/value head, each row with its own mask (through sdpa, or written out
    as matrix products), give the attention over keys and values repeated per query head (float64, to rounding),
    also through Dynamo without a graph break."""
    from torch._dynamo.utils import counters

    from eagle3.evaluate import packed_attention as module_of

    attention = getattr(module_of, f"{kind}_attention")

    gen = torch.Generator().manual_seed(width)
    heads, kv_heads, length, dim = 6, 2, 40, 8
    query = torch.randn(1, width, heads, dim, generator=gen, dtype=torch.float64).transpose(1, 2)  # as HF: strided
    key, value = (torch.randn(1, kv_heads, length, dim, generator=gen, dtype=torch.float64) for _ in range(2))
    visible = torch.rand(width, length, generator=gen) < 0.6
    visible[:, 0] = True  # every row sees a key
    mask = torch.zeros(1, 1, width, length, dtype=torch.float64).masked_fill(~visible, torch.finfo(torch.float64).min)
    module = torch.nn.Module()
    module.num_key_value_groups = heads // kv_heads
    repeated = torch.nn.functional.scaled_dot_product_attention(
        query, key.repeat_interleave(3, dim=1), value.repeat_interleave(3, dim=1), attn_mask=mask, scale=0.5
    ).transpose(1, 2)  # [1, w, H, D]
    packed, _ = attention(module, query, key, value, mask, scaling=0.5)
    torch.testing.assert_close(packed, repeated, rtol=1e-12, atol=1e-12)
    if kind == "matmul":  # a bool mask (True = attend) means the same as the additive one
        torch.testing.assert_close(attention(module, query, key, value, visible[None, None], scaling=0.5)[0], repeated)
    counters.clear()
    compiled = torch.compile(lambda *a: attention(module, *a, scaling=0.5)[0], backend="eager")
    torch.testing.assert_close(compiled(query, key, value, mask), repeated, rtol=1e-12, atol=1e-12)
    assert not counters["graph_break"]


@pytest.mark.parametrize("kind", ["packed", "matmul"])
def test_static_decode_on_packed_attention_gives_the_repeated_caches_logits_and_greedys_tokens(  # noqa: F811
    setup,  # noqa: F811
    monkeypatch,
    kind,
):
    """With attention="packed" (or "matmul") the static runner's forwards run that attention (the target switched to the
    static decode's attention; without it the target stays on sdpa): their logits equal those over the repeated
    cache (float64, to rounding), and greedy and a tree decode give the eager greedy's tokens."""
    from eagle3.evaluate import packed_attention
    from eagle3.evaluate.static_attention import STATIC_ATTENTION

    calls: list[int] = []
    real = getattr(packed_attention, f"{kind}_attention")
    monkeypatch.setattr(packed_attention, f"{kind}_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    plain_model, packed_model = copy.deepcopy(setup["model"]), copy.deepcopy(setup["model"])
    plain_model.set_attn_implementation("sdpa")
    assert plain_model.config.num_key_value_heads < plain_model.config.num_attention_heads  # a GQA target
    plain = StaticTargetRunner(plain_model, AUX_IDS, 128, CompileSettings(), decode_rows=8)  # sdpa
    packed = StaticTargetRunner(packed_model, AUX_IDS, 128, CompileSettings(), decode_rows=8, attention=kind)
    assert (plain_model.config._attn_implementation, packed_model.config._attn_implementation) == (
        "sdpa",
        STATIC_ATTENTION,
    )
    prompt = setup["prompts"][0]
    logits = [runner.step(prompt, with_logits=True).logits for runner in (plain, packed)]
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-12, atol=1e-12)
    logits = [runner.step(prompt[:5], with_logits=True).logits for runner in (plain, packed)]  # 5 rows at width 8
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-12, atol=1e-12)
    ref = setup["refs"][0]
    assert greedy_decode(packed, prompt, MAX_NEW).tokens == ref.tokens
    oracle = FakeOracleProposer(prompt, ref.tokens, 4, tree=True)
    assert speculative_decode(packed, oracle, prompt, MAX_NEW).tokens == ref.tokens
    assert calls  # that attention ran, not sdpa under its name


def test_runners_of_one_model_each_keep_their_own_attention(setup, monkeypatch):  # noqa: F811
    """The evaluation's pair on one model: a gathered-keys reference at 8 rows and a one-row flex baseline made after
    it. Each forward runs its own runner's attention (the reference gathers, the baseline builds flex block masks),
    and both decode the eager greedy's tokens."""
    from eagle3.data import decode_attention
    from eagle3.evaluate import gathered

    seen: list[str] = []
    real_mask, real_gathered = decode_attention.decode_block_mask, gathered.gathered_attention
    monkeypatch.setattr(decode_attention, "decode_block_mask", lambda v: seen.append("flex") or real_mask(v))
    monkeypatch.setattr(gathered, "gathered_attention", lambda *a: seen.append("gathered") or real_gathered(*a))
    model = copy.deepcopy(setup["model"])
    reference = StaticTargetRunner(model, AUX_IDS, 256, CompileSettings(), decode_rows=8, gathered_keys=True)
    baseline = StaticTargetRunner(model, AUX_IDS, 256, CompileSettings(), decode_rows=1, attention="flex")
    prompt, ref = setup["prompts"][0], setup["refs"][0]
    for runner, kind in ((reference, "gathered"), (baseline, "flex"), (reference, "gathered")):
        seen.clear()
        assert greedy_decode(runner, prompt, MAX_NEW).tokens == ref.tokens, kind
        assert seen and set(seen) == {kind}, (kind, set(seen))


def test_one_row_flex_attention_reads_the_used_key_blocks_and_gives_greedys_tokens(setup, monkeypatch):  # noqa: F811
    """attention="flex": the one-row forwards run flex over a block mask (their logits equal sdpa's to rounding,
    float64), wider forwards keep sdpa, and greedy and a chain decode give the eager greedy's tokens; gathered keys
    refuse another attention."""
    from eagle3.data import decode_attention

    built: list[tuple[int, ...]] = []
    real = decode_attention.decode_block_mask
    monkeypatch.setattr(
        decode_attention, "decode_block_mask", lambda valid: built.append(tuple(valid.shape)) or real(valid)
    )
    plain_model, flex_model = copy.deepcopy(setup["model"]), copy.deepcopy(setup["model"])
    plain_model.set_attn_implementation("sdpa")
    plain = StaticTargetRunner(plain_model, AUX_IDS, 256, CompileSettings(), decode_rows=1)
    flex = StaticTargetRunner(flex_model, AUX_IDS, 256, CompileSettings(), decode_rows=1, attention="flex")
    prompt = setup["prompts"][0]
    for runner in (plain, flex):
        runner.step(prompt)
    assert built == []  # the prompt's chunks: sdpa
    logits = [runner.step(prompt[:1], with_logits=True).logits for runner in (plain, flex)]
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-10, atol=1e-10)
    assert built and set(built) == {(1, 256)}
    ref = setup["refs"][0]
    assert greedy_decode(flex, prompt, MAX_NEW).tokens == ref.tokens
    oracle = FakeOracleProposer(prompt, ref.tokens, 4)
    assert speculative_decode(flex, oracle, prompt, MAX_NEW).tokens == ref.tokens
    with pytest.raises(ValueError, match="gathered decode keys bring their own attention"):
        StaticTargetRunner(copy.deepcopy(setup["model"]), AUX_IDS, 256, CompileSettings(), 8, True, attention="flex")
