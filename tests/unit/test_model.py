"""The EAGLE-3 drafter: SGLang weight names, sizes, RoPE, TTT attention (dense, flex, packed), target weights."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from eagle3.drafter.functional import (
    FLEX_AVAILABLE,
    TTTCache,
    apply_rope,
    attention_inputs,
    dense_ttt_attention,
    flex_ttt_attention,
    rope_cos_sin,
    rope_inv_freq,
    rope_inv_freq_on,
    step_outputs,
)
from eagle3.drafter.masks import positions_from_documents, ttt_block_masks, ttt_dense_mask, ttt_mask_mod
from eagle3.drafter.model import (
    SGLANG_WEIGHT_NAMES,
    DrafterDims,
    Eagle3Drafter,
    export_state_dict,
    init_weights,
    step_weights,
    trainable_parameters,
)
from eagle3.target.load import target_info
from eagle3.target.tensors import drafter_dims, load_target_weights, rope_settings

SGLANG_KEYS = {
    "fc.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.post_attention_layernorm.weight",
    "norm.weight",
    "lm_head.weight",
}
LLAMA31_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 32,
    "vocab_size": 128256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": LLAMA31_ROPE,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
}


def tiny_dims(vocab: int = 50, draft: int = 20) -> DrafterDims:
    return DrafterDims(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=48,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=None,
        vocab_size=vocab,
        draft_vocab_size=draft,
        num_aux=3,
        target_hidden_size=32,
    )


def qkv_steps(steps: int, seq_len: int = 12, seed: int = 0) -> tuple[torch.Tensor, list, list]:
    """Random q [2, 4, T, 8] and per-step keys/values [2, 2, T, 8] (GQA: 2 query heads per key head)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, seq_len, 8, generator=g)
    keys = [torch.randn(2, 2, seq_len, 8, generator=g) for _ in range(steps)]
    return q, keys, [torch.randn(2, 2, seq_len, 8, generator=g) for _ in range(steps)]


def write_config(folder: Path, cfg: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_state_dict_names_are_exactly_sglangs():
    """state_dict keys minus embed_tokens are SGLang's EAGLE-3 weight names, one to one, and the export has them."""
    model = Eagle3Drafter(tiny_dims())
    keys = set(model.state_dict())
    assert keys - {"embed_tokens.weight"} == SGLANG_KEYS
    assert set(export_state_dict(model)) == SGLANG_KEYS == set(SGLANG_WEIGHT_NAMES)


def test_the_drafter_package_imports_nothing_from_the_target_package():
    """eagle3/drafter/ never imports eagle3.target: the model reads no files (eagle3.target.tensors feeds it)."""
    import ast

    imported = set()
    for path in (Path(__file__).resolve().parents[2] / "eagle3" / "drafter").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module)
            elif isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
    assert "eagle3.drafter.masks" in imported  # the walk sees the package's own imports
    assert sorted(m for m in imported if m.split(".")[:2] == ["eagle3", "target"]) == []


def test_embeddings_are_frozen_and_out_of_the_optimizer():
    """embed_tokens needs no grad, is not among the trainable parameters and gets no gradient from a step."""
    model = Eagle3Drafter(tiny_dims())
    assert not model.embed_tokens.weight.requires_grad
    assert all(p is not model.embed_tokens.weight for p in trainable_parameters(model))
    ids = torch.randint(0, 50, (1, 6))
    hidden = model.project_aux(torch.randn(1, 6, 96))
    _, logits = model(hidden, ids, positions_from_documents(torch.zeros_like(ids)), torch.zeros_like(ids), TTTCache())
    logits.sum().backward()
    assert model.embed_tokens.weight.grad is None and model.fc.weight.grad is not None


def test_shapes_follow_the_dims():
    """fc reads A*Ht, q/k/v read 2H, lm_head writes the draft vocab: the shapes SGLang's loader expects."""
    sd = Eagle3Drafter(tiny_dims()).state_dict()
    assert sd["fc.weight"].shape == (32, 96)
    assert sd["midlayer.self_attn.q_proj.weight"].shape == (32, 64)
    assert sd["midlayer.self_attn.k_proj.weight"].shape == (16, 64)
    assert sd["midlayer.self_attn.o_proj.weight"].shape == (32, 32)
    assert sd["lm_head.weight"].shape == (20, 32) and sd["embed_tokens.weight"].shape == (50, 32)


def test_llama31_8b_drafter_has_424_7m_trainable_parameters(tmp_path):
    """Dims read from a Llama-3.1-8B config give 424.7M trainable (formula) and 525.3M frozen, on the meta device."""
    folder = write_config(tmp_path / "llama31", LLAMA31_8B)
    dims = drafter_dims(target_info(folder), folder, 32000)
    with torch.device("meta"):
        model = Eagle3Drafter(dims)
    trainable = sum(p.numel() for p in trainable_parameters(model))
    h, i, hd = 4096, 14336, 128
    formula = 3 * h * h + 2 * h * (32 + 8 + 8) * hd + 32 * hd * h + 3 * h * i + h * 32000 + 4 * h
    assert trainable == formula == 424_689_664
    assert round(trainable / 1e6, 1) == 424.7
    assert model.embed_tokens.weight.numel() == 128256 * 4096  # 525.3M, frozen


def test_dims_from_target_read_norm_eps_and_rope_in_both_config_styles(tmp_path):
    """transformers 4 (rope_theta + rope_scaling) and 5 (rope_parameters) configs give the same dims."""
    v4 = write_config(tmp_path / "v4", LLAMA31_8B)
    v5_cfg = {k: v for k, v in LLAMA31_8B.items() if k not in ("rope_theta", "rope_scaling")}
    v5 = write_config(tmp_path / "v5", {**v5_cfg, "rope_parameters": {**LLAMA31_ROPE, "rope_theta": 500000.0}})
    a, b = (drafter_dims(target_info(f), f, 64) for f in (v4, v5))
    assert a == b
    assert (a.rms_norm_eps, a.rope_theta, a.rope_scaling.factor, a.num_aux) == (1e-5, 500000.0, 8.0, 3)
    assert a.rope_scaling.original_max_position_embeddings == 8192


def test_unsupported_rope_types_are_refused():
    """A yarn (or any non-llama3) scaling is an error, never silently ignored."""
    with pytest.raises(ValueError, match="yarn"):
        rope_settings({"rope_theta": 1e6, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    assert rope_settings({"rope_theta": 1e6}) == (1e6, None)
    yarn = {"rope_theta": 5e4, "rope_scaling": {"type": "yarn", "factor": 64.0}}
    assert rope_settings(yarn, plain_if_unsupported=True) == (5e4, None)  # the drafter's own RoPE (drafter_dims)


def test_llama3_rope_matches_transformers():
    """inv_freq and the rotated q/k equal transformers' llama3 RoPE for a Llama-3.1 config.

    Positions stay below 1000: both sides build fp32 angles, whose rounding (and the last-bit difference between
    our fp64-then-rounded inv_freq and transformers' fp32 pow) grows with the position, to ~1e-3 at 9000.
    """
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = LlamaConfig(
        hidden_size=4096,
        num_attention_heads=32,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling=dict(LLAMA31_ROPE),
    )
    theta, scaling = rope_settings(config.to_dict())
    expected, attention_scale = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    ours = rope_inv_freq(128, theta, scaling)
    torch.testing.assert_close(ours.float(), expected.float(), rtol=1e-6, atol=0)
    assert attention_scale == 1.0 and not torch.allclose(ours, rope_inv_freq(128, theta, None))
    positions = torch.tensor([[0, 1, 7, 100, 900]])
    q, k = torch.randn(2, 1, 32, 5, 128, generator=torch.Generator().manual_seed(0)).unbind(0)
    cos, sin = LlamaRotaryEmbedding(config)(q, positions)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    our_cos, our_sin = rope_cos_sin(ours, positions)
    torch.testing.assert_close(apply_rope(q, our_cos, our_sin), want_q, rtol=0, atol=1e-3)
    torch.testing.assert_close(apply_rope(k, our_cos, our_sin), want_k, rtol=0, atol=1e-3)


def test_positions_restart_at_each_document():
    """RoPE positions count from 0 again at every document start of a packed row."""
    docs = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2], [5, 5, 5, 5, 5, 5, 5, 5, 5]])
    assert positions_from_documents(docs).tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3], list(range(9))]


@pytest.mark.parametrize("steps", [1, 3])
def test_dense_ttt_attention_equals_sdpa_with_the_explicit_mask(steps):
    """The diagonal-score shortcut equals plain SDPA over all S*T keys with the causal+diagonal boolean mask."""
    q, keys, values = qkv_steps(steps)
    docs = torch.tensor([[0] * 5 + [1] * 7, [0] * 12])
    got = dense_ttt_attention(q, keys, values, docs)
    all_k = torch.cat(keys, 2).repeat_interleave(2, dim=1)  # [B, nH, S*T, hd]
    all_v = torch.cat(values, 2).repeat_interleave(2, dim=1)
    want = F.scaled_dot_product_attention(q, all_k, all_v, attn_mask=ttt_dense_mask(docs, steps))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_ttt_mask_is_causal_in_document_then_diagonal():
    """Query t sees step-0 keys s <= t of its own document and, at each later step, only its own key."""
    mask = ttt_dense_mask(torch.tensor([[0, 0, 1, 1]]), 2)[0, 0].int()
    assert mask.tolist() == [
        [1, 0, 0, 0, 1, 0, 0, 0],
        [1, 1, 0, 0, 0, 1, 0, 0],
        [0, 0, 1, 0, 0, 0, 1, 0],
        [0, 0, 1, 1, 0, 0, 0, 1],
    ]


@pytest.mark.skipif(not FLEX_AVAILABLE, reason="flex_attention is not importable")
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_flex_attention_equals_the_dense_path():
    """flex_attention (eager on CPU, forward only) with the block mask equals the dense path on packed rows."""
    q, keys, values = qkv_steps(3)
    docs = torch.tensor([[0] * 4 + [1] * 8, [0] * 12])
    torch.testing.assert_close(
        flex_ttt_attention(q, keys, values, docs), dense_ttt_attention(q, keys, values, docs), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("impl", ["dense", "flex"])
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_attention_does_not_leak_across_documents(impl):
    """Perturbing one document's q/k/v at every step leaves the other document's outputs unchanged."""
    if impl == "flex" and not FLEX_AVAILABLE:
        pytest.skip("flex_attention is not importable")
    attend = dense_ttt_attention if impl == "dense" else flex_ttt_attention
    docs = torch.tensor([[0] * 5 + [1] * 7] * 2)
    q, keys, values = qkv_steps(3)
    base = attend(q, keys, values, docs)
    for span, other in ((slice(0, 5), slice(5, 12)), (slice(5, 12), slice(0, 5))):
        q2, k2, v2 = q.clone(), [k.clone() for k in keys], [v.clone() for v in values]
        for t in (q2, *k2, *v2):
            t[:, :, span] = torch.randn_like(t[:, :, span]) * 5
        torch.testing.assert_close(attend(q2, k2, v2, docs)[:, :, other], base[:, :, other], rtol=0, atol=1e-6)


def test_residual_is_the_unnormed_feature():
    """With attention and MLP outputs silenced, a step returns its input feature unchanged, whatever its scale."""
    model = Eagle3Drafter(tiny_dims())
    init_weights(model)
    with torch.no_grad():
        model.midlayer.self_attn.o_proj.weight.zero_()
        model.midlayer.mlp.down_proj.weight.zero_()
    hidden = 100 * torch.randn(1, 6, 32)
    ids = torch.randint(0, 50, (1, 6))
    out, _ = model(hidden, ids, positions_from_documents(torch.zeros_like(ids)), torch.zeros_like(ids), TTTCache())
    assert torch.equal(out, hidden)


def test_embedding_enters_only_through_input_layernorm():
    """Scaling the embedding table leaves a step unchanged: the token embedding is RMS-normed before use."""
    model = Eagle3Drafter(tiny_dims())
    init_weights(model)
    ids, hidden = torch.randint(0, 50, (1, 6)), torch.randn(1, 6, 32)
    docs = torch.zeros_like(ids)
    before = model(hidden, ids, positions_from_documents(docs), docs, TTTCache())[1]
    with torch.no_grad():
        model.embed_tokens.weight.mul_(7.0)
    after = model(hidden, ids, positions_from_documents(docs), docs, TTTCache())[1]
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)


def _write_sharded_target(folder: Path, embed: torch.Tensor, lm_head: torch.Tensor, tied: bool) -> Path:
    cfg = {
        **LLAMA31_8B,
        "hidden_size": embed.shape[1],
        "vocab_size": embed.shape[0],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 48,
        "num_hidden_layers": 8,
        "tie_word_embeddings": tied,
    }
    write_config(folder, cfg)
    save_file({"model.embed_tokens.weight": embed}, str(folder / "model-00001-of-00002.safetensors"))
    shards = {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}
    if not tied:
        save_file({"lm_head.weight": lm_head}, str(folder / "model-00002-of-00002.safetensors"))
        shards["lm_head.weight"] = "model-00002-of-00002.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": shards}))
    return folder


@pytest.mark.parametrize("tied", [False, True])
def test_load_target_weights_copies_embeddings_and_the_draft_rows_of_lm_head(tmp_path, tied):
    """embed_tokens = target embeddings; lm_head row i = target lm_head row of draft id i (chunked reads)."""
    g = torch.Generator().manual_seed(0)
    embed, lm_head = torch.randn(50, 32, generator=g), torch.randn(50, 32, generator=g)
    folder = _write_sharded_target(tmp_path / "t", embed, lm_head, tied)
    used = [1, 4, 5, 17, 18, 19, 22, 30, 41, 44, 45, 46, 47, 48, 49, 0, 2, 3, 6, 7]
    t2d = torch.zeros(50, dtype=torch.bool)
    t2d[used] = True
    model = Eagle3Drafter(tiny_dims())
    load_target_weights(model, folder, t2d, init_lm_head_from_target=True, chunk_rows=7)
    assert torch.equal(model.embed_tokens.weight, embed)
    source = embed if tied else lm_head
    assert torch.equal(model.lm_head.weight, source[sorted(used)])
    assert torch.equal(model.lm_head.weight[8], source[17])  # used ids ascending: 0..7, then 17 is draft id 8


def test_load_target_weights_leaves_lm_head_alone_unless_asked(tmp_path):
    """init_lm_head_from_target=False copies only the embeddings."""
    g = torch.Generator().manual_seed(1)
    folder = _write_sharded_target(
        tmp_path / "t", torch.randn(50, 32, generator=g), torch.randn(50, 32, generator=g), tied=False
    )
    model = Eagle3Drafter(tiny_dims())
    before = model.lm_head.weight.detach().clone()
    load_target_weights(model, folder, torch.arange(50) < 20, init_lm_head_from_target=False)
    assert torch.equal(model.lm_head.weight, before)


def test_init_is_seeded_and_device_independent():
    """Same seed -> identical weights; norms start at 1; linear weights have std ~ 0.02."""
    a, b = Eagle3Drafter(tiny_dims()), Eagle3Drafter(tiny_dims())
    init_weights(a, seed=3)
    init_weights(b, seed=3)
    assert all(torch.equal(x, y) for x, y in zip(export_state_dict(a).values(), export_state_dict(b).values()))
    assert torch.equal(a.norm.weight, torch.ones(32))
    assert math.isclose(float(a.midlayer.mlp.up_proj.weight.detach().std()), 0.02, rel_tol=0.1)


@pytest.mark.skipif(not FLEX_AVAILABLE, reason="flex_attention is not importable")
def test_block_masks_of_one_layout_equal_masks_built_per_step():
    """Each step's mask cut from the one S*T layout has the blocks create_block_mask gives for that step alone."""
    from torch.nn.attention.flex_attention import create_block_mask

    docs, steps = torch.tensor([[0] * 100 + [1] * 156]), 3
    masks = ttt_block_masks(docs, steps, block_size=128)
    for k, got in enumerate(masks):
        want = create_block_mask(
            ttt_mask_mod(docs, 256, torch.tensor(k + 1)), 1, None, 256, steps * 256, device="cpu", BLOCK_SIZE=128
        )
        assert torch.equal(got.to_dense(), want.to_dense()), k
        for name in ("kv_num_blocks", "full_kv_num_blocks", "q_num_blocks", "full_q_num_blocks"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (k, name)
    assert masks[0].kv_num_blocks.sum() < masks[2].kv_num_blocks.sum()  # later steps add their diagonal blocks


def test_functional_step_equals_the_module_step():
    """attention_inputs -> attention -> step_outputs over step_weights is the module forward, number for number."""
    model = Eagle3Drafter(tiny_dims()).double()
    init_weights(model, std=0.2)
    g = torch.Generator().manual_seed(4)
    hidden, ids = torch.randn(2, 9, 32, generator=g, dtype=torch.float64), torch.randint(0, 50, (2, 9), generator=g)
    docs = torch.tensor([[0] * 4 + [1] * 5, [0] * 9])
    positions, cache, keys, values = positions_from_documents(docs), TTTCache(), [], []
    w, d = step_weights(model), model.dims
    for k in range(3):
        want_out, want_logits = model(hidden, ids, positions + k, docs, cache, "dense")
        cos, sin = rope_cos_sin(
            rope_inv_freq_on(d.head_dim, d.rope_theta, None, hidden.device), positions + k, torch.float64
        )
        q, key, value = attention_inputs(w, ids, hidden, cos, sin, d.rms_norm_eps, 4, 2)
        keys.append(key)
        values.append(value)
        out, logits = step_outputs(w, hidden, dense_ttt_attention(q, keys, values, docs), d.rms_norm_eps)
        torch.testing.assert_close(out, want_out, rtol=1e-14, atol=1e-14)
        torch.testing.assert_close(logits, want_logits, rtol=1e-14, atol=1e-14)
        hidden = out


def test_step_weights_cast_linear_weights_once_and_keep_the_gradient_path():
    """step_weights(bf16) casts only the linear weights; a loss on them reaches the fp32 parameters."""
    model = Eagle3Drafter(tiny_dims())
    w = step_weights(model, torch.bfloat16)
    assert w.q.dtype == w.lm_head.dtype == torch.bfloat16
    assert w.norm is model.norm.weight and w.embed is model.embed_tokens.weight
    w.q.float().sum().backward()
    assert model.midlayer.self_attn.q_proj.weight.grad.dtype == torch.float32
    assert torch.equal(model.midlayer.self_attn.q_proj.weight.grad, torch.ones(32, 64))
    assert torch.equal(rope_inv_freq_on(8, 10000.0, None, torch.device("cpu")), rope_inv_freq(8, 10000.0))
