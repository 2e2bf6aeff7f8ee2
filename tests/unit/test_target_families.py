"""Target families beyond Llama: tiny random Qwen3 and DeepSeek-V3 (MLA + MoE, Kimi-K2's text model) targets, built
from transformers' own classes, go through tokenize, capture, training, export and evaluation; the shapes each
stage derives from the target (aux ids, drafter dims, tensor names) are checked against golden values."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle3.config import RunConfig, load_config
from eagle3.target.load import EMBED_TENSOR, lm_head_name, load_model, prepare_target, read_tensor, target_info
from eagle3.target.tensors import drafter_dims

ARCHITECTURES = ("qwen3", "deepseek_v3")
"""Families run end to end here (the tiny Llama runs through every other stage test)."""
TRAIN_MODES = ("offline", "online")
"""How the drafter gets its target states; each mode is one more parametrization of the whole pipeline."""


@dataclass(frozen=True)
class Family:
    """What the tiny preset (8 layers, H 64, 4 heads, 2 KV heads, MLP 128) must become for one architecture."""

    hf_class: str
    norm_class: str
    num_key_value_heads: int  # the drafter's; MLA keeps one key/value head per query head


FAMILIES = {
    "qwen3": Family("Qwen3ForCausalLM", "Qwen3RMSNorm", num_key_value_heads=2),
    "deepseek_v3": Family("DeepseekV3ForCausalLM", "DeepseekV3RMSNorm", num_key_value_heads=4),
}
TINY_AUX_IDS = [1, 3, 4]
"""[1, N//2-1, N-4] for the tiny preset's N = 8 layers."""


def family_config(workdir: Path, architecture: str, mode: str) -> RunConfig:
    """The tiny preset on ``architecture``, cut to seconds: 2 train steps, 1 evaluation prompt of 8 tokens."""
    overrides = [
        f"run.workdir={workdir}",
        f"target.tiny.architecture={architecture}",
        f"target.name=tiny-{architecture}",
        "train.max_steps=2",
        "drafter.ttt_steps=2",
        "train.eval_every_steps=0",
        "train.checkpoint_every_steps=0",
        "train.progress_every_s=0",
        "train.tokens_per_row=256",
        "evaluate.num_prompts=1",
        "evaluate.max_new_tokens=8",
        "evaluate.methods=[chain]",
        "evaluate.device=cpu",
    ]
    if mode != "offline":
        overrides.append(f"train.features={mode}")
    return load_config("tiny", overrides)


def run_training(cfg: RunConfig, mode: str) -> None:
    """Capture (offline mode only: online training runs the target inside its steps), then train to the end."""
    from eagle3.train.loop import train

    if mode == "offline":
        from eagle3.features.capture import run_capture

        assert run_capture(cfg).computed
    assert train(cfg).status == "done"


@pytest.fixture(scope="module", params=[(a, m) for a in ARCHITECTURES for m in TRAIN_MODES], ids=lambda p: "-".join(p))
def family_run(request, tmp_path_factory) -> tuple[str, RunConfig]:
    """(architecture, config) of a tiny run taken through every stage without Prefect."""
    from eagle3.evaluate.stage import run_evaluate
    from eagle3.export.stage import run_export
    from eagle3.run.stages import run_all

    architecture, mode = request.param
    cfg = family_config(tmp_path_factory.mktemp(f"family-{architecture}-{mode}"), architecture, mode)
    run_all(cfg)
    run_training(cfg, mode)
    assert run_export(cfg).computed
    assert run_evaluate(cfg).computed
    return architecture, cfg


def test_target_is_the_requested_family_with_its_golden_shape(family_run):
    """config.json names the transformers class; TargetInfo gives 8 layers, aux [1, 3, 4], H 64, head_dim 16."""
    architecture, cfg = family_run
    info = target_info(prepare_target(cfg), cfg.target)
    fam = FAMILIES[architecture]
    assert info.architecture == fam.hf_class
    assert (info.num_layers, info.hidden_size, info.aux_layer_ids) == (8, 64, TINY_AUX_IDS)
    assert (info.num_attention_heads, info.num_key_value_heads, info.head_dim) == (4, fam.num_key_value_heads, 16)
    assert info.intermediate_size == 128 and not info.tie_word_embeddings


def test_tensors_read_from_safetensors_are_the_models(family_run):
    """embed_tokens and lm_head (whole and a row slice) read by name equal the loaded model's; the final norm is
    the family's RMSNorm at model.model.norm, the module capture hooks."""
    architecture, cfg = family_run
    model_dir = prepare_target(cfg)
    info = target_info(model_dir, cfg.target)
    model = load_model(model_dir)
    assert lm_head_name(info) == "lm_head.weight" and model.get_output_embeddings() is model.lm_head
    assert torch.equal(read_tensor(model_dir, lm_head_name(info)), model.lm_head.weight)
    assert torch.equal(read_tensor(model_dir, EMBED_TENSOR), model.get_input_embeddings().weight)
    assert torch.equal(read_tensor(model_dir, lm_head_name(info), rows=slice(5, 9)), model.lm_head.weight[5:9])
    assert type(model.model.norm).__name__ == FAMILIES[architecture].norm_class
    assert len(model.model.layers) == info.num_layers


def test_captured_states_are_the_models_hidden_states(family_run):
    """Stored aux = hidden_states[j + 1] for j in the aux ids, stored final = the post-norm last state, for the
    first captured sample run alone through the model (to the stored dtype's rounding)."""
    from eagle3.features.capture import features_dir
    from eagle3.features.shards.reader import ShardReader

    _, cfg = family_run
    if cfg.train.features == "online":
        pytest.skip("online training captures nothing (tests/unit/test_train_online.py checks its rows)")
    reader = ShardReader(features_dir(cfg))
    stored = reader.get(reader.ids()[0])
    model = load_model(prepare_target(cfg))
    with torch.no_grad():
        out = model(input_ids=stored["input_ids"].long()[None], output_hidden_states=True)
    states = out.hidden_states  # N + 1 entries of [1, T, H]; the last one is after the final norm
    aux = torch.cat([states[j + 1][0] for j in TINY_AUX_IDS], dim=-1)  # [T, 3H]
    tol = {"rtol": 1.6e-2, "atol": 1e-5}  # bf16 storage: its rounding, plus a flip from batch-shape noise (MoE)
    torch.testing.assert_close(stored["aux"].float(), aux, **tol)
    torch.testing.assert_close(stored["final"].float(), states[-1][0], **tol)
    reader.close()


def test_export_carries_the_targets_dims_and_aux_ids(family_run):
    """The SGLang config: target_hidden_size 64, the drafter's heads/head_dim/MLP from the target, eagle aux ids
    [1, 3, 4]; speculators' capture-before ids [2, 4, 5]; fc reads 3 x 64 and both layouts pass their checks."""
    from eagle3.export.sglang import check_sglang_export
    from eagle3.export.speculators import check_speculators_export

    architecture, cfg = family_run
    sglang, speculators = cfg.run_dir / "export" / "sglang", cfg.run_dir / "export" / "speculators"
    check_sglang_export(sglang)
    check_speculators_export(speculators)
    doc = json.loads((sglang / "config.json").read_text())
    assert doc["target_hidden_size"] == doc["hidden_size"] == 64
    heads = (doc["num_attention_heads"], doc["num_key_value_heads"], doc["head_dim"], doc["intermediate_size"])
    assert heads == (4, FAMILIES[architecture].num_key_value_heads, 16, 128)
    assert doc["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == TINY_AUX_IDS
    spec_doc = json.loads((speculators / "config.json").read_text())
    assert spec_doc["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert load_file(str(sglang / "model.safetensors"))["fc.weight"].shape == (64, 3 * 64)


def test_speculative_decoding_is_lossless_on_the_family(family_run):
    """The evaluation's chain decoding with the exported drafter equals plain greedy decoding of the target."""
    _, cfg = family_run
    doc = json.loads((cfg.run_dir / "eval" / "results.json").read_text())
    rows = [r for r in doc["results"] if r["dataset"] == "mtbench"]
    assert [r["method"] for r in rows] == ["chain-3-1-4"]
    assert rows[0]["lossless"]["mismatch"] == 0 and rows[0]["num_prompts"] == 1
    assert doc["settings"]["aux_layer_ids"] == TINY_AUX_IDS


def test_per_sample_attention_keeps_mla_batch_invariant():
    """Capture batches an all-dense tiny DeepSeek-V3 (MLA: query/key heads 24 wide, value heads 16) through the
    per-sample attention and gets bitwise the states of each sample run alone. (Its MoE layers are left dense:
    an expert's GEMM runs over the tokens the whole batch routes to it, which no attention choice fixes.)"""
    from transformers import DeepseekV3ForCausalLM

    from eagle3.config import TinyTargetConfig
    from eagle3.features.hf_backend import HFCaptureBackend
    from eagle3.features.spec import SampleTokens
    from eagle3.target.tiny import build_tiny_model, build_tiny_tokenizer

    config = build_tiny_model(build_tiny_tokenizer(), TinyTargetConfig(architecture="deepseek_v3"), seed=0).config
    config.first_k_dense_replace = config.num_hidden_layers  # every layer dense
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (40, 70, 55, 90)]  # >= 12 rows: see hf_backend
    samples = [SampleTokens(id=f"s{i}", input_ids=row, loss_mask=[1] * len(row)) for i, row in enumerate(ids)]
    backend = HFCaptureBackend(None, TINY_AUX_IDS, model=model, device="cpu", tokens_per_forward=4096)
    assert backend.per_sample and len(backend.batches(samples)) == 1
    batched = list(backend.capture(samples))
    for sample, got in zip(samples, batched):
        alone = next(backend.capture([sample]))
        assert torch.equal(got.aux, alone.aux) and torch.equal(got.final, alone.final), sample.id


# ------------------------------------------------------------------------------------- Kimi-K2.5, config only

KIMI_K25_TEXT = {  # the text_config of moonshotai/Kimi-K2.5's config.json (the fields read here)
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "kimi_k2",
    "num_hidden_layers": 61,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "vocab_size": 163840,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 50000.0,
    "max_position_embeddings": 262144,
    "tie_word_embeddings": False,
    "rope_scaling": {
        "type": "yarn",
        "factor": 64.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
}


def test_kimi_k25_preset_derives_the_drafter_of_specforges_kimi_config(tmp_path):
    """A Kimi-K2.5-shaped config (multimodal wrapper, MLA, YaRN): the kimi-k25 preset's aux ids [1, 29, 57] are the
    default for 61 layers, and the drafter gets 64 heads, 64 KV heads, head_dim 128 (v_head_dim), MLP 18432 (as
    SpecForge's kimi-k25-eagle3.json) and plain RoPE at the target's theta (it does not implement YaRN)."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "kimi_k25", "text_config": KIMI_K25_TEXT}))
    preset = load_config("kimi-k25", [])
    info = target_info(tmp_path, preset.target)
    assert info.aux_layer_ids == target_info(tmp_path).aux_layer_ids == [1, 29, 57]
    dims = drafter_dims(info, tmp_path, preset.vocab.draft_vocab_size)
    assert (dims.hidden_size, dims.target_hidden_size, dims.num_aux, dims.vocab_size) == (7168, 7168, 3, 163840)
    assert (dims.num_attention_heads, dims.num_key_value_heads, dims.head_dim) == (64, 64, 128)
    assert (dims.intermediate_size, dims.draft_vocab_size, dims.rms_norm_eps) == (18432, 32000, 1e-5)
    assert (dims.rope_theta, dims.rope_scaling, dims.max_position_embeddings) == (50000.0, None, 262144)
