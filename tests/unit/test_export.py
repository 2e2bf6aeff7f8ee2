"""The drafter export: round trip, strict key/shape/dtype check, config golden fields, aux ids, the export stage.

The helpers at the top (tiny drafter, tiny target folder, TTT logits) are shared with the SGLang and
speculators tests, which load these exports with those projects' own classes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3.drafter.functional import Llama3RopeScaling, TTTCache
from eagle3.drafter.masks import shift_left, single_document_ids
from eagle3.drafter.model import DrafterDims, Eagle3Drafter, export_state_dict, init_weights
from eagle3.export.checks import (
    ExportError,
    aux_id_warnings,
    ours_from_speculators,
    sglang_aux_ids,
    speculators_aux_ids,
)
from eagle3.export.sglang import check_sglang_export, export_sglang, load_sglang_export, sglang_config
from eagle3.export.speculators import check_speculators_export, export_speculators
from eagle3.target.load import default_aux_layer_ids

AUX = [1, 3, 4]  # output-of-layer ids of an 8-layer target: [1, N//2-1, N-4]
NUM_TARGET_LAYERS = 8
ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------------------- helpers


def tiny_dims(vocab: int = 64, draft: int = 24) -> DrafterDims:
    """A drafter small enough for any CPU: H=32, 4 query / 2 kv heads, I=48."""
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
        max_position_embeddings=256,
    )


def vocab_maps(dims: DrafterDims) -> tuple[torch.Tensor, torch.Tensor]:
    """d2t/t2d of a draft vocab made of every other target id (so d2t is not all zeros)."""
    used = torch.arange(dims.draft_vocab_size) * 2 + 1  # [Vd] ascending target ids
    t2d = torch.zeros(dims.vocab_size, dtype=torch.bool)
    t2d[used] = True
    return used - torch.arange(dims.draft_vocab_size), t2d


def write_target(folder: Path, dims: DrafterDims, seed: int = 1) -> Path:
    """A tiny Llama target folder: config.json and the tensors the drafter and speculators read."""
    gen = torch.Generator().manual_seed(seed)
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": dims.hidden_size,
        "intermediate_size": dims.intermediate_size,
        "num_attention_heads": dims.num_attention_heads,
        "num_key_value_heads": dims.num_key_value_heads,
        "head_dim": dims.head_dim,
        "num_hidden_layers": NUM_TARGET_LAYERS,
        "vocab_size": dims.vocab_size,
        "rms_norm_eps": dims.rms_norm_eps,
        "rope_theta": dims.rope_theta,
        "max_position_embeddings": dims.max_position_embeddings,
        "tie_word_embeddings": False,
    }
    (folder / "config.json").write_text(json.dumps(config))
    h, v = dims.hidden_size, dims.vocab_size
    save_file(
        {
            "model.embed_tokens.weight": torch.randn(v, h, generator=gen),
            "lm_head.weight": torch.randn(v, h, generator=gen),
            "model.norm.weight": 1 + 0.1 * torch.randn(h),
        },
        str(folder / "model.safetensors"),
    )
    return folder


def random_drafter(dims: DrafterDims, target: Path | None = None, seed: int = 0) -> Eagle3Drafter:
    """Seeded weights with non-trivial norms (so a swapped norm shows), the target's embeddings if given."""
    drafter = Eagle3Drafter(dims)
    init_weights(drafter, std=0.2, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for param in drafter.parameters():
            if param.ndim == 1:
                param.add_(0.3 * torch.randn(param.shape, generator=gen))
        if target is not None:
            drafter.embed_tokens.weight.copy_(load_file(str(target / "model.safetensors"))["model.embed_tokens.weight"])
    return drafter.eval()


def ttt_inputs(dims: DrafterDims, seq_len: int = 12, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux [1, T, A*Ht], token ids [1, T]) of one unpacked row."""
    gen = torch.Generator().manual_seed(seed)
    aux = torch.randn(1, seq_len, dims.num_aux * dims.target_hidden_size, generator=gen)
    return aux, torch.randint(0, dims.vocab_size, (1, seq_len), generator=gen)


@torch.no_grad()
def ttt_logits(drafter: Eagle3Drafter, aux: torch.Tensor, ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Draft logits [1, T, Vd] of each TTT step as ttt_loss runs it: token x_{t+1+k}, position t + k."""
    docs = single_document_ids(*ids.shape)
    positions = torch.arange(ids.shape[1])[None]
    hidden, cache, out = drafter.project_aux(aux), TTTCache(), []
    for k in range(steps):
        hidden, logits = drafter(hidden, shift_left(ids, 1 + k, 0), positions + k, docs, cache, "dense")
        out.append(logits)
    return out


def sglang_export(tmp_path: Path, dtype: torch.dtype = torch.float32, aux: list[int] = AUX):
    """(export dir, target dir, drafter, dims) of a random tiny drafter exported in the SGLang layout."""
    dims = tiny_dims()
    target = write_target(tmp_path / "target", dims)
    drafter = random_drafter(dims, target)
    d2t, t2d = vocab_maps(dims)
    out = export_sglang(export_state_dict(drafter), dims, d2t, t2d, aux, tmp_path / "sglang", dtype)
    return out, target, drafter, dims


def test_python_m_eagle3_export_checks_a_folder(tmp_path):
    """``python -m eagle3.export --check DIR`` (the package's __main__) checks a folder and exits 2 on a broken one."""
    out, *_ = sglang_export(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}

    def check() -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "eagle3.export", "--check", str(out)],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )

    good = check()
    assert good.returncode == 0 and good.stdout.strip() == f"{out}: sglang layout, check passed"
    rewrite_weights(out, lambda t: t.pop("norm.weight"))
    bad = check()
    assert bad.returncode == 2 and "missing keys ['norm.weight']" in bad.stderr


def rewrite_weights(export_dir: Path, edit) -> None:
    """Apply ``edit(dict)`` to the folder's model.safetensors (to make a broken export)."""
    tensors = load_file(str(export_dir / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(export_dir / "model.safetensors"))


# ---------------------------------------------------------------------------------------------- round trip


def test_round_trip_gives_identical_tensors_and_forward(tmp_path):
    """export (fp32) -> load_sglang_export: the same weights, the target's embeddings, d2t/t2d, and equal logits."""
    out, target, drafter, dims = sglang_export(tmp_path)
    loaded = load_sglang_export(out, target)
    assert not loaded.drafter.training
    mine, theirs = drafter.state_dict(), loaded.drafter.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    d2t, t2d = vocab_maps(dims)
    assert torch.equal(loaded.d2t, d2t) and loaded.d2t.dtype == torch.int64
    assert torch.equal(loaded.t2d, t2d) and loaded.t2d.dtype == torch.bool
    assert loaded.aux_layer_ids == AUX and loaded.config["draft_vocab_size"] == dims.draft_vocab_size
    aux, ids = ttt_inputs(dims)
    for a, b in zip(ttt_logits(drafter, aux, ids, 3), ttt_logits(loaded.drafter, aux, ids, 3)):
        assert torch.equal(a, b)


def test_bf16_export_holds_the_rounded_weights(tmp_path):
    """A bf16 export stores each weight rounded to bf16 (d2t int64, t2d bool) and loads back to those values."""
    out, target, drafter, _ = sglang_export(tmp_path, torch.bfloat16)
    stored = load_file(str(out / "model.safetensors"))
    assert stored["d2t"].dtype == torch.int64 and stored["t2d"].dtype == torch.bool
    for name, value in export_state_dict(drafter).items():
        assert stored[name].dtype == torch.bfloat16 and torch.equal(stored[name], value.to(torch.bfloat16))
    loaded = load_sglang_export(out, target)
    assert torch.equal(loaded.drafter.fc.weight, drafter.fc.weight.to(torch.bfloat16).float())


def test_export_folder_has_config_weights_and_provenance_only(tmp_path):
    """Exactly config.json, model.safetensors and eagle3_export.json (no run config given); no temp folder left."""
    out, *_ = sglang_export(tmp_path)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "eagle3_export.json", "model.safetensors"]
    info = json.loads((out / "eagle3_export.json").read_text())
    assert info["aux_layer_ids"] == {"output_of_layer": AUX, "sglang": AUX, "capture_before": [2, 4, 5]}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sglang", "target"]


# --------------------------------------------------------------------------------------------- strict check


@pytest.mark.parametrize(
    "edit, needle",
    [
        (lambda t: t.pop("midlayer.hidden_norm.weight"), "missing keys ['midlayer.hidden_norm.weight']"),
        (
            lambda t: t.update({"midlayer.self_attn.qk_norm.weight": torch.ones(8)}),
            "unexpected keys ['midlayer.self_attn.qk_norm.weight']",
        ),
        (lambda t: t.update({"draft_model.fc.weight": t.pop("fc.weight")}), "prefix ['draft_model.fc.weight']"),
        (
            lambda t: t.update({"lm_head.weight": t["lm_head.weight"][:-1]}),
            "lm_head.weight: shape [23, 32], expected [24, 32]",
        ),
        (lambda t: t.update({"fc.weight": t["fc.weight"].double()}), "fc.weight: dtype float64, expected float32"),
        (lambda t: t.update({"norm.weight": t["norm.weight"].half()}), "norm.weight: dtype float16, expected float32"),
        (lambda t: t.update({"d2t": t["d2t"].int()}), "d2t: dtype int32, expected int64"),
        (lambda t: t.update({"t2d": t["t2d"].flip(0)}), "d2t/t2d"),
    ],
)
def test_strict_check_names_the_bad_key(tmp_path, edit, needle):
    """Each broken export (missing, unknown, prefixed, wrong shape/dtype, inconsistent maps) fails, naming the key."""
    out, *_ = sglang_export(tmp_path)
    check_sglang_export(out)
    rewrite_weights(out, edit)
    with pytest.raises(ExportError) as err:
        check_sglang_export(out)
    assert needle in str(err.value)


@pytest.mark.parametrize(
    "field, value, needle",
    [
        ("architectures", ["LlamaForCausalLM"], "architectures"),
        ("num_hidden_layers", 2, "num_hidden_layers"),
        ("draft_vocab_size", None, "draft_vocab_size"),
        ("eagle_config", {"eagle_aux_hidden_state_layer_ids": [4, 1, 3], "use_aux_hidden_state": True}, "ascending"),
        ("torch_dtype", "int8", "torch_dtype"),
    ],
)
def test_strict_check_refuses_bad_config_fields(tmp_path, field, value, needle):
    """A config.json SGLang would misread (architecture, layers, no draft vocab, bad aux ids, dtype) fails."""
    out, *_ = sglang_export(tmp_path)
    config = json.loads((out / "config.json").read_text())
    config[field] = value
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError, match=needle):
        check_sglang_export(out)


def test_loader_refuses_a_broken_export(tmp_path):
    """load_sglang_export runs the strict check first: a misnamed key is an error, not a random parameter."""
    out, target, *_ = sglang_export(tmp_path)
    rewrite_weights(out, lambda t: t.update({"midlayer.mlp.gate.weight": t.pop("midlayer.mlp.gate_proj.weight")}))
    with pytest.raises(ExportError, match="midlayer.mlp.gate_proj.weight"):
        load_sglang_export(out, target)


def test_bad_weights_are_refused_before_anything_is_written(tmp_path):
    """A typo in the weights given to the exporter raises and leaves an earlier export untouched."""
    out, _, drafter, dims = sglang_export(tmp_path)
    before = (out / "model.safetensors").read_bytes()
    weights = export_state_dict(drafter)
    weights["midlayer.self_attn.qproj.weight"] = weights.pop("midlayer.self_attn.q_proj.weight")
    with pytest.raises(ExportError, match="q_proj"):
        export_sglang(weights, dims, *vocab_maps(dims), AUX, out, torch.float32)
    assert (out / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sglang", "target"]


def test_speculators_export_names_and_check(tmp_path):
    """layers.0.* names, capture-before aux ids, our flags; the check catches a leftover midlayer.* name."""
    dims = tiny_dims()
    target = write_target(tmp_path / "target", dims)
    drafter = random_drafter(dims, target)
    out = export_speculators(
        drafter.state_dict(),
        dims,
        *vocab_maps(dims),
        AUX,
        tmp_path / "spec",
        torch.float32,
        verifier_name_or_path=str(target),
    )
    config = json.loads((out / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert (config["norm_before_residual"], config["norm_output"], config["architectures"]) == (
        False,
        False,
        ["Eagle3Speculator"],
    )
    assert config["speculators_config"]["verifier"] == {
        "name_or_path": str(target),
        "architectures": ["LlamaForCausalLM"],
    }
    stored = load_file(str(out / "model.safetensors"))
    assert torch.equal(stored["layers.0.self_attn.q_proj.weight"], drafter.midlayer.self_attn.q_proj.weight)
    assert not any(k.startswith("midlayer.") for k in stored)
    rewrite_weights(out, lambda t: t.update({"midlayer.hidden_norm.weight": t.pop("layers.0.hidden_norm.weight")}))
    with pytest.raises(ExportError, match="layers.0.hidden_norm.weight"):
        check_speculators_export(out)


# ------------------------------------------------------------------------------------ config and aux ids

LLAMA31_8B = DrafterDims(
    hidden_size=4096,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=14336,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_scaling=Llama3RopeScaling(8.0, 1.0, 4.0, 8192),
    vocab_size=128256,
    draft_vocab_size=32000,
    num_aux=3,
    target_hidden_size=4096,
    max_position_embeddings=131072,
)


def test_sglang_config_golden_fields_for_llama31_8b():
    """config.json of a Llama-3.1-8B drafter: SGLang's class, one layer, both vocab sizes, aux ids [1, 15, 28]."""
    config = sglang_config(LLAMA31_8B, default_aux_layer_ids(32), torch.bfloat16)
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert (config["num_hidden_layers"], config["vocab_size"], config["draft_vocab_size"]) == (1, 128256, 32000)
    assert (config["hidden_size"], config["intermediate_size"], config["target_hidden_size"]) == (4096, 14336, 4096)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (32, 8, 128)
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 15, 28], "use_aux_hidden_state": True}
    assert config["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert (config["tie_word_embeddings"], config["torch_dtype"], config["rope_theta"]) == (False, "bfloat16", 5e5)


@pytest.mark.parametrize(
    "num_layers, ours, sglang, speculators",
    [
        (30, [1, 14, 26], [1, 14, 26], [2, 15, 27]),  # SmolLM2-135M
        (32, [1, 15, 28], [1, 15, 28], [2, 16, 29]),  # Llama-3.1-8B (speculators: src/speculators/models/utils.py)
    ],
)
def test_aux_id_translation_golden(num_layers, ours, sglang, speculators):
    """Our default ids, SGLang's eagle_config ids (it adds 1 itself) and speculators' capture-before ids."""
    assert default_aux_layer_ids(num_layers) == ours
    assert sglang_aux_ids(ours) == sglang and speculators_aux_ids(ours) == speculators
    assert ours_from_speculators(speculators) == ours
    # SGLang's Llama adds 1 to explicit ids; its own default list [2, N//2, N-3] is what ours become there.
    assert [i + 1 for i in sglang] == [2, num_layers // 2, num_layers - 3] == speculators


def test_ids_not_starting_at_one_are_flagged():
    """SGLang's deepseek/glm code adds 1 only when the first id is 1: any other start earns a warning."""
    assert aux_id_warnings([1, 15, 28]) == []
    assert "do not start at 1" in aux_id_warnings([2, 15, 28])[0]


# ------------------------------------------------------------------------------------------------ the stage


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A synthetic run trained for one step (real train manifest and checkpoint); its RunConfig."""
    from eagle3.train.loop import train
    from tests.unit.test_train_helpers import load_run_config, synthetic_run

    overrides = [
        "train.max_steps=1",
        "drafter.ttt_steps=1",
        "train.eval_every_steps=0",
        "train.checkpoint_every_steps=0",
        "train.tokens_per_row=256",
        "train.progress_every_s=0",
    ]
    cfg = load_run_config(synthetic_run(tmp_path_factory.mktemp("export") / "runs", overrides))
    assert train(cfg).status == "done"
    return cfg


def test_run_export_writes_both_layouts_then_skips(trained_run):
    """run_export writes sglang/ and speculators/ from the final checkpoint, then is a no-op until a setting changes."""
    from eagle3.export.stage import run_export

    cfg = trained_run
    first = run_export(cfg)
    assert first.computed and set(first.stats["formats"]) == {"sglang", "speculators"}
    assert first.stats["checkpoint"] == "train/checkpoints/step-1"
    check_sglang_export(cfg.run_dir / "export" / "sglang")
    check_speculators_export(cfg.run_dir / "export" / "speculators")
    ckpt = load_file(str(cfg.run_dir / "train" / "checkpoints" / "step-1" / "model.safetensors"))
    stored = load_file(str(cfg.run_dir / "export" / "sglang" / "model.safetensors"))
    assert all(torch.equal(stored[k], v.to(torch.bfloat16)) for k, v in ckpt.items())
    run_config = json.loads((cfg.run_dir / "export" / "sglang" / "eagle3_run_config.json").read_text())
    assert run_config["run"]["name"] == cfg.run.name
    assert first.stats["formats"]["speculators"]["aux_layer_ids"] == [2, 4, 5]
    assert not run_export(cfg).computed
    changed = cfg.model_copy(deep=True)
    changed.export.dtype = "float32"
    assert run_export(changed).computed


def test_cli_prints_where_it_wrote_and_the_check(trained_run, capsys):
    """python -m eagle3.export --config ...: one line per layout with its folder, aux ids and 'check passed'."""
    from eagle3.export.stage import main

    main(["--config", str(trained_run.run_dir / "config.json")])
    out = capsys.readouterr().out
    assert "sglang" in out and "speculators" in out and out.count("check passed") == 2
    main(["--check", str(trained_run.run_dir / "export" / "sglang")])
    assert "sglang layout, check passed" in capsys.readouterr().out
