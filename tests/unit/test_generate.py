"""Fast generation (eagle3/data/generate.py, its decode attention eagle3/data/decode_attention.py): every backend
gives plain greedy generate's tokens."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from eagle3.data import decode_attention as decode
from eagle3.data import generate as gen
from eagle3.data.generate import GenerationSettings, TokenGenerator, cut_after_eos, left_pad

NEW = 12


def _tiny_llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(cfg).eval()


def _prompts(n: int = 10, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(rng.randrange(2, 40))] for _ in range(n)]


def _plain(model: Any, prompts: list[list[int]], eos: tuple[int, ...]) -> list[list[int]]:
    """Reference: one plain generate call (dynamic cache) on the whole left-padded batch."""
    ids, mask = left_pad(prompts, max(map(len, prompts)), 0)
    out = model.generate(
        input_ids=ids.to(model.device),
        attention_mask=mask.to(model.device),
        max_new_tokens=NEW,
        do_sample=False,
        eos_token_id=list(eos),
        pad_token_id=0,
    )
    return [cut_after_eos(r, eos) for r in out[:, ids.shape[1] :].tolist()]


@pytest.fixture(scope="module")
def case() -> tuple[Any, list[list[int]], tuple[int, ...], list[list[int]]]:
    """A tiny GQA Llama, prompts of 2..39 tokens, eos ids that stop some rows early, and plain generate's answers."""
    model = _tiny_llama()
    prompts = _prompts()
    free = _plain(model, prompts, (2,))
    eos = (2, free[0][4], free[3][1])  # tokens the model really emits: rows stop at different steps
    ref = _plain(model, prompts, eos)
    assert len({len(r) for r in ref}) > 1, "the eos choice must stop rows at different lengths"
    return model, prompts, eos, ref


@pytest.fixture
def block_masks(monkeypatch) -> list:
    """The shapes of every flex decode block mask built while the test runs (empty: flex never ran)."""
    masks, real_mask = [], decode.decode_block_mask
    monkeypatch.setattr(decode, "decode_block_mask", lambda valid: masks.append(valid.shape) or real_mask(valid))
    return masks


def _settings(eos: tuple[int, ...], **kw: Any) -> GenerationSettings:
    return GenerationSettings(
        **{"max_new_tokens": NEW, "eos_ids": eos, "pad_id": 0, "batch_size": 4, "prompt_bucket": 16, **kw}
    )


@pytest.mark.parametrize(
    "backend,attention",
    [
        ("dynamic", "kv_heads"),
        ("static", "kv_heads"),
        ("static", "sdpa"),
        ("static", "flex"),
        ("continuous", "kv_heads"),
    ],
)
def test_backends_equal_plain_generate_token_for_token(case, backend, attention, block_masks):
    """Greedy answers of each backend (batches of 4 with a short last batch, left padding) equal plain generate's;
    with flex the decode steps really ran through its block mask."""
    model, prompts, eos, ref = case
    got = TokenGenerator(model, _settings(eos, backend=backend, decode_attention=attention)).generate(prompts)
    assert bool(block_masks) == (backend == "static" and attention == "flex")
    model.set_attn_implementation("sdpa")
    assert got == ref


def test_static_calls_use_fixed_shapes_and_kv_head_attention(case, monkeypatch):
    """Static calls all have batch_size rows, bucketed widths, power-of-two caches, and decode through sdpa_kv_heads."""
    model, prompts, eos, ref = case
    calls: list[tuple[int, int, int]] = []
    decode_calls = []
    real_generate, real_attention = model.generate, decode.sdpa_kv_heads

    def spy_generate(**kw: Any) -> Any:
        calls.append((*kw["input_ids"].shape, kw["max_cache_len"]))
        return real_generate(**kw)

    def spy_attention(module, query, *args, **kw):
        decode_calls.append(query.shape[2])
        return real_attention(module, query, *args, **kw)

    monkeypatch.setattr(model, "generate", spy_generate)
    monkeypatch.setattr(decode, "sdpa_kv_heads", spy_attention)
    try:
        got = TokenGenerator(model, _settings(eos, backend="static")).generate(prompts)
    finally:
        model.set_attn_implementation("sdpa")
    assert got == ref
    assert [c[0] for c in calls] == [4, 4, 4] and all(c[1] % 16 == 0 for c in calls)
    assert all(c[2] & (c[2] - 1) == 0 and c[2] >= c[1] + NEW for c in calls)
    assert 1 in decode_calls, "the decode steps must run through the kv-head attention"


def test_kv_head_attention_equals_sdpa_with_padding_mask():
    """sdpa_kv_heads on a one-token query equals transformers' sdpa (repeat_kv) under a left-padding mask."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(1)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 3, True
    q, k, v = torch.randn(2, 6, 1, 8), torch.randn(2, 2, 20, 8), torch.randn(2, 2, 20, 8)
    mask = torch.ones(2, 1, 1, 20, dtype=torch.bool)
    mask[0, ..., :7] = False  # row 0 is left padded
    want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.35)
    got, _ = decode.sdpa_kv_heads(module, q, k, v, mask, scaling=0.35)
    assert got.shape == want.shape == (2, 1, 6, 8)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_flex_decode_equals_sdpa_with_padding_mask_and_lists_only_used_key_blocks(monkeypatch):
    """flex_decode on a one-token query equals transformers' sdpa under left padding; its block mask lists exactly
    the key blocks holding a valid key (so the kernel skips the rest)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    monkeypatch.setattr(decode, "FLEX_KV_BLOCK", 8)
    torch.manual_seed(1)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 3, True
    q, k, v = torch.randn(3, 6, 1, 8), torch.randn(3, 2, 32, 8), torch.randn(3, 2, 32, 8)
    mask = torch.zeros(3, 1, 1, 32, dtype=torch.bool)
    mask[0, ..., 7:20] = True  # left padded, then the cache past the position
    mask[1, ..., :32] = True
    mask[2, ..., 17:18] = True
    want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.35)
    got, _ = decode.flex_decode(module, q, k, v, mask, scaling=0.35)
    assert got.shape == want.shape == (3, 1, 6, 8)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    blocks = decode.decode_block_mask(mask[:, 0, 0, :])
    num, idx = blocks.kv_num_blocks[:, 0, 0].tolist(), blocks.kv_indices[:, 0, 0].tolist()
    assert num == [3, 4, 1] and [row[:n] for row, n in zip(idx, num)] == [[0, 1, 2], [0, 1, 2, 3], [2]]


@pytest.mark.parametrize("backend,attention", [("static", "kv_heads"), ("static", "flex"), ("dynamic", "kv_heads")])
def test_stragglers_go_on_in_a_small_batch_with_the_same_greedy_tokens(case, backend, attention):
    """With straggler_rows 2, batches of 4 that drop to 2 running rows hand them to a batch of 2: every greedy answer
    still equals plain generate's, each prompt is counted once, and fewer row-steps are run."""
    model, prompts, eos, ref = case
    full = TokenGenerator(model, _settings(eos, backend=backend, decode_attention=attention))
    shrunk = TokenGenerator(model, _settings(eos, backend=backend, decode_attention=attention, straggler_rows=2))
    got_full, got = full.generate(prompts), shrunk.generate(prompts)
    model.set_attn_implementation("sdpa")
    assert got == got_full == ref
    assert shrunk.stats.calls > full.stats.calls, "no batch handed its stragglers on"
    assert shrunk.stats.rows == full.stats.rows == len(prompts)
    assert shrunk.stats.new_tokens == full.stats.new_tokens
    assert shrunk.stats.slot_steps < full.stats.slot_steps
    if backend == "static":
        assert any(shape.startswith("static 2 x ") for shape in shrunk.stats.shapes), shrunk.stats.shapes


def test_straggler_batches_carry_several_rows_past_fillers_and_keep_the_cache_length():
    """Prompts of 45-52 tokens (bucket 4: width 52, cache 52 + 12 = 64 exactly) in batches of 4 and 3 (one filler
    row): each batch hands 2 rows on, the greedy answers equal plain generate's, and no straggler call makes
    transformers keep a longer static cache (re-rounding the width would have asked for 128)."""
    model, rng = _tiny_llama(), random.Random(1)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (45, 46, 47, 48, 50, 51, 52)]
    free = _plain(model, prompts, (2,))
    eos = (2, free[0][4], free[6][2])
    ref = _plain(model, prompts, eos)
    gen_ = TokenGenerator(model, _settings(eos, backend="static", straggler_rows=2, prompt_bucket=4))
    calls, real = [], gen_._generate_batch

    def spy(rows, max_new, batch_size, stop_at, continued=False, at_width=None):
        calls.append((len(rows), continued))
        return real(rows, max_new, batch_size, stop_at, continued, at_width)

    gen_._generate_batch = spy
    model.__dict__.pop("_previous_max_cache_length", None)
    got = gen_.generate(prompts)
    assert calls == [(4, False), (2, True), (3, False), (2, True)]
    assert got == ref
    assert model._previous_max_cache_length == 64
    assert set(gen_.stats.shapes) == {"static 4 x 64", "static 2 x 64"}


def test_sampled_stragglers_are_reproducible_and_complete(case):
    """Sampled rows that go on in a straggler batch come back whole (an eos, or exactly max_new_tokens) and the same
    seed gives the same rows."""
    model, prompts, _, _ = case
    eos = tuple(range(3, 40))  # ~12% of the vocabulary: sampled rows end after a few steps, some run on
    gen_ = TokenGenerator(model, _settings(eos, backend="static", temperature=1.0, straggler_rows=2))
    runs = []
    for _ in range(2):
        torch.manual_seed(5)
        runs.append(gen_.generate(prompts))
    model.set_attn_implementation("sdpa")
    assert runs[0] == runs[1]
    assert all((row and row[-1] in eos) or len(row) == NEW for row in runs[0]), runs[0]
    assert any(shape.startswith("static 2 x ") for shape in gen_.stats.shapes), gen_.stats.shapes


def test_straggler_rows_must_be_below_the_batch():
    """A straggler batch as large as the batch would never shrink anything: the config refuses it, naming both."""
    from pydantic import ValidationError

    from eagle3.config import RegenerateConfig

    with pytest.raises(ValidationError, match=r"straggler_rows \(4\) must be below batch_size_conversations \(4\)"):
        RegenerateConfig(batch_size_conversations=4, straggler_rows=4)
    assert RegenerateConfig(batch_size_conversations=4, straggler_rows=3).straggler_rows == 3


def _compiled_static(case: Any, compile_backend: str, attention: decode.DecodeAttention, block_masks: list) -> None:
    """Static generation with transformers' compile forced on CPU equals plain generate, in one graph (no break);
    with flex, the compiled decode steps built its block mask."""
    from torch._dynamo.utils import counters
    from transformers import CompileConfig

    model, prompts, eos, ref = case
    compile_config = CompileConfig(backend=compile_backend, dynamic=False)
    compile_config._compile_all_devices = True  # CPU is not compiled by default (transformers' device gate)
    model.generation_config.compile_config = compile_config
    torch._dynamo.reset()
    counters.clear()
    try:
        got = TokenGenerator(model, _settings(eos, backend="static", decode_attention=attention)).generate(prompts)
        assert hasattr(model, "_compiled_call"), "the compiled forward was not used"
    finally:
        model.generation_config.compile_config = None
        model.set_attn_implementation("sdpa")
        for attr in ("_compiled_call", "_last_compile_config"):  # the next test compiles its own
            model.__dict__.pop(attr, None)
    assert dict(counters["graph_break"]) == {}
    assert bool(block_masks) == (attention == "flex")
    assert got == ref


@pytest.mark.parametrize(
    "compile_backend,attention",
    [  # flex's AOT trace takes ~80 s on a 2-core CPU: slow suite
        ("eager", "kv_heads"),
        pytest.param("aot_eager", "flex", marks=pytest.mark.slow),
    ],
)
def test_compiled_static_equals_plain_generate(case, compile_backend, attention, block_masks):
    """With transformers' compile forced on CPU (Dynamo; AOT tracing for flex) the static path equals plain
    generate with no graph break, and flex's block mask is built inside the compiled decode step."""
    _compiled_static(case, compile_backend, attention, block_masks)


@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_dynamic_traces_the_decode_step_once_for_every_cache_length(case, dynamic):
    """compile_dynamic: Dynamo traces transformers' decode step once across two cache lengths (32 and 64), where
    transformers' default (dynamic=None: static first, automatic dynamic after a change) traces it twice; the
    tokens equal plain generate either way."""
    from transformers import CompileConfig

    model, prompts, eos, ref = case
    traced: list[int] = []

    def counting_backend(graph: Any, example_inputs: Any) -> Any:
        traced.append(len(example_inputs))
        return graph.forward

    forced = CompileConfig(backend=counting_backend, dynamic=None, mode=None)  # a callable backend takes no mode
    forced._compile_all_devices = True  # CPU is not compiled by default (transformers' device gate)
    model.generation_config.compile_config = forced
    model.__dict__.pop("_previous_max_cache_length", None)  # an earlier test's longer cache would be the floor
    torch._dynamo.reset()
    try:
        generator = TokenGenerator(model, _settings(eos, backend="static", batch_size=2, compile_dynamic=dynamic))
        got = generator.generate(prompts)
    finally:
        model.generation_config.compile_config = None
        model.set_attn_implementation("sdpa")
        for attr in ("_compiled_call", "_last_compile_config", "_previous_max_cache_length"):
            model.__dict__.pop(attr, None)
    assert got == ref
    lengths = {shape.rsplit(" x ", 1)[1] for shape in generator.stats.shapes}
    assert lengths == {"32", "64"}, generator.stats.shapes
    assert len(traced) == (1 if dynamic else 2), traced


@pytest.mark.slow
def test_inductor_compiled_flex_decode_equals_plain_generate(case, block_masks):
    """Inductor's CPU kernels for the flex decode (needs a C++ compiler) give plain generate's tokens, one graph."""
    _compiled_static(case, "inductor", "flex", block_masks)


def test_auto_backend_is_dynamic_on_cpu_and_static_on_cuda():
    """auto resolves to the compiled static cache on CUDA only."""
    assert gen.resolve_backend("auto", "cpu") == "dynamic"
    assert gen.resolve_backend("auto", "cuda:0") == "static"
    assert gen.resolve_backend("continuous", "cpu") == "continuous"


def test_empty_prompt_is_refused(case):
    """An empty prompt is an error, not a silent empty answer."""
    model, _, eos, _ = case
    with pytest.raises(ValueError, match="empty prompt"):
        TokenGenerator(model, _settings(eos)).generate([[5, 6], []])


@pytest.mark.parametrize("backend", ["dynamic", "static", "continuous"])
def test_generation_stats_count_what_the_calls_did(case, backend):
    """The stats count every prompt and kept token; static batches count their filler rows and cache shape."""
    model, prompts, eos, ref = case
    generator = TokenGenerator(model, _settings(eos, backend=backend))
    out = generator.generate(prompts)
    doc = generator.stats.to_json()
    assert doc["rows"] == len(prompts) and doc["new_tokens"] == sum(map(len, out)) == sum(map(len, ref))
    assert doc["seconds"] > 0 and doc["new_tokens_per_s"] > 0
    if backend == "continuous":
        assert doc["slot_use"] is None and doc["shapes"]["continuous"]["calls"] == 1
        return
    batches = -(-len(prompts) // 4)  # batch_size 4 (the last batch short)
    assert doc["calls"] == batches and 0 < doc["slot_use"] <= 1
    if backend == "static":
        assert doc["slots"] == 4 * batches  # the short batch ran filler copies
        assert all(k.startswith("static 4 x ") for k in doc["shapes"])
        assert sum(v["calls"] for v in doc["shapes"].values()) == batches
    else:
        assert doc["slots"] == len(prompts) and list(doc["shapes"]) == ["dynamic"]


def _loop_stop_reference(row: list[int], n: int) -> list[int]:
    """``row`` up to the first length whose last n tokens equal the n before them shifted by a period <= n."""
    for end in range(2 * n, len(row) + 1):
        tail = row[end - 2 * n : end]
        if any(tail[j : j + n] == tail[n:] for j in range(n)):
            return row[:end]
    return row


@pytest.mark.parametrize("backend,stragglers", [("static", 0), ("static", 2), ("dynamic", 2)])
def test_looping_rows_stop_where_their_tokens_start_repeating(backend, stragglers):
    """With loop_stop_tokens 3, each greedy answer is plain generate's up to the first point where its last 3 tokens
    repeat with a period <= 3 (a reference computed here) and rows that never loop are whole; with straggler batches
    fewer row-steps run, and a stopped row is not handed on (it would come back longer)."""
    model, new = _tiny_llama(), 40
    prompts = _prompts(8, seed=3)
    ids, mask = left_pad(prompts, max(map(len, prompts)), 0)
    out = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False, eos_token_id=[2], pad_token_id=0
    )
    plain = [cut_after_eos(r, (2,)) for r in out[:, ids.shape[1] :].tolist()]
    want = [_loop_stop_reference(r, 3) for r in plain]
    assert any(w != p for w, p in zip(want, plain)) and any(w == p for w, p in zip(want, plain)), (
        "the case needs rows that loop and rows that do not"
    )
    kw = {"max_new_tokens": new, "backend": backend, "straggler_rows": stragglers}
    whole = TokenGenerator(model, _settings((2,), **kw))
    stopped = TokenGenerator(model, _settings((2,), **kw, loop_stop_tokens=3))
    assert whole.generate(prompts) == plain
    assert stopped.generate(prompts) == want
    assert stopped.stats.new_tokens < whole.stats.new_tokens
    if stragglers:  # without them a batch still runs to its longest row
        assert stopped.stats.slot_steps < whole.stats.slot_steps
