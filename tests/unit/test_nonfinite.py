"""A diverged training never ships: a non-finite loss stops training (after train.nonfinite_loss_patience skipped
steps) and the export refuses NaN or infinite weights, naming the tensors. (Non-finite settings: test_config.)"""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3.drafter.model import export_state_dict
from eagle3.export.checks import ExportError
from eagle3.export.sglang import check_sglang_export, export_sglang
from eagle3.export.speculators import check_speculators_export, export_speculators
from eagle3.train import loop, step
from eagle3.train.checkpoint import checkpoints_dir, list_checkpoints
from eagle3.train.metrics import read_metrics
from tests.unit.test_export import AUX, random_drafter, tiny_dims, vocab_maps, write_target
from tests.unit.test_train_helpers import load_run_config, synthetic_run

OVERRIDES = [
    "train.tokens_per_row=96",
    "train.lr=1e-3",
    "train.max_steps=4",
    "train.eval_every_steps=0",
    "train.checkpoint_every_steps=1",
    "train.keep_checkpoints=4",
    "train.progress_every_s=0",
    "drafter.ttt_steps=2",
]


def _poison_steps(monkeypatch, steps: set[int]) -> None:
    """Make the optimizer steps numbered ``steps`` (1-based, this process) diverge: NaN loss and gradients."""
    real, calls = step.backward_rows, [0]

    def backward_rows(model, batches, sups, counts, info):
        sums = real(model, batches, sups, counts, info)
        calls[0] += 1
        if calls[0] in steps:
            for param in model.parameters():
                if param.grad is not None:
                    param.grad.fill_(float("nan"))
            sums[0] = float("nan")
        return sums

    monkeypatch.setattr(step, "backward_rows", backward_rows)


def _finite(cfg, step: int) -> bool:
    weights = load_file(str(checkpoints_dir(cfg.run_dir) / f"step-{step}" / "model.safetensors"))
    return all(bool(torch.isfinite(t).all()) for t in weights.values())


def test_a_nan_loss_stops_training_before_it_is_checkpointed(tmp_path, monkeypatch):
    """Default patience 0: the first NaN step ends training with an error naming the step and the setting; the
    checkpoints before it stay, none holds the diverged state, and no train manifest blesses anything."""
    cfg = load_run_config(synthetic_run(tmp_path, OVERRIDES))
    assert cfg.train.nonfinite_loss_patience == 0
    _poison_steps(monkeypatch, {2})
    with pytest.raises(loop.NonFiniteLossError, match=r"step 2.*train\.nonfinite_loss_patience"):
        loop.train(cfg)
    assert [s for s, _ in list_checkpoints(checkpoints_dir(cfg.run_dir))] == [1] and _finite(cfg, 1)
    assert not (cfg.run_dir / "train" / "train.manifest.json").exists()
    assert math.isnan(read_metrics(cfg.run_dir / "train" / "metrics.jsonl")[-1]["loss"])


def test_non_finite_steps_within_the_patience_are_skipped(tmp_path, monkeypatch):
    """Patience 1: one NaN step is skipped (no update: the weights stay finite) and training finishes."""
    cfg = load_run_config(synthetic_run(tmp_path, [*OVERRIDES, "train.nonfinite_loss_patience=1"]))
    _poison_steps(monkeypatch, {2})
    result = loop.train(cfg)
    assert (result.status, result.step) == ("done", 4)
    assert all(_finite(cfg, s) for s, _ in list_checkpoints(checkpoints_dir(cfg.run_dir)))


def test_non_finite_steps_beyond_the_patience_stop_training(tmp_path, monkeypatch):
    """Patience 1: two NaN steps in a row stop training at the second."""
    cfg = load_run_config(synthetic_run(tmp_path, [*OVERRIDES, "train.nonfinite_loss_patience=1"]))
    _poison_steps(monkeypatch, {2, 3})
    with pytest.raises(loop.NonFiniteLossError, match="step 3"):
        loop.train(cfg)
    assert all(_finite(cfg, s) for s, _ in list_checkpoints(checkpoints_dir(cfg.run_dir)))


def _poisoned_weights(dims, target):
    weights = export_state_dict(random_drafter(dims, target))
    weights["fc.weight"][0, 0] = float("nan")
    weights["midlayer.mlp.up_proj.weight"][1, 2] = float("inf")
    return weights


@pytest.mark.parametrize("layout", ["sglang", "speculators"])
def test_export_refuses_non_finite_weights_naming_them(tmp_path, layout):
    """NaN and inf weights are an ExportError naming each tensor; no folder is written."""
    dims = tiny_dims()
    target = write_target(tmp_path / "target", dims)
    weights, out = _poisoned_weights(dims, target), tmp_path / layout
    with pytest.raises(ExportError, match=r"fc\.weight.*up_proj\.weight|up_proj\.weight.*fc\.weight") as err:
        if layout == "sglang":
            export_sglang(weights, dims, *vocab_maps(dims), AUX, out, torch.float32)
        else:
            embed = {"embed_tokens.weight": torch.zeros(dims.vocab_size, dims.hidden_size)}
            export_speculators(
                weights | embed, dims, *vocab_maps(dims), AUX, out, torch.float32, verifier_name_or_path=str(target)
            )
    assert "non-finite" in str(err.value) and not out.exists()


def test_export_refuses_weights_that_overflow_the_export_dtype(tmp_path):
    """A finite fp32 weight beyond float16's range becomes inf in a float16 export: refused, named."""
    dims = tiny_dims()
    target = write_target(tmp_path / "target", dims)
    weights = export_state_dict(random_drafter(dims, target))
    weights["norm.weight"][0] = 1e6
    with pytest.raises(ExportError, match=r"norm\.weight"):
        export_sglang(weights, dims, *vocab_maps(dims), AUX, tmp_path / "out", torch.float16)


@pytest.mark.parametrize("layout", ["sglang", "speculators"])
def test_check_of_an_export_folder_finds_non_finite_tensors(tmp_path, layout):
    """`python -m eagle3.export --check DIR` (check_*_export) fails on a folder whose weights hold a NaN."""
    dims = tiny_dims()
    target = write_target(tmp_path / "target", dims)
    drafter = random_drafter(dims, target)
    if layout == "sglang":
        out = export_sglang(export_state_dict(drafter), dims, *vocab_maps(dims), AUX, tmp_path / "x", torch.float32)
        check = check_sglang_export
    else:
        out = export_speculators(
            drafter.state_dict(),
            dims,
            *vocab_maps(dims),
            AUX,
            tmp_path / "x",
            torch.float32,
            verifier_name_or_path=str(target),
        )
        check = check_speculators_export
    stored = load_file(str(out / "model.safetensors"))
    name = next(k for k in sorted(stored) if k.endswith("q_proj.weight"))
    stored[name][0, 0] = float("nan")
    save_file(stored, str(out / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ExportError, match=name.replace(".", r"\.")):
        check(out)
