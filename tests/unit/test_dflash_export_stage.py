"""The export stage with drafter.family=dflash: SGLang's DFlash layout in export/sglang from the selected checkpoint,
checked (non-finite weights refused, naming them), the formats without a DFlash layout recorded as skipped."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from eagle3.export.checks import ExportError
from eagle3.export.dflash import load_dflash_export
from eagle3.export.stage import check_export, run_export
from eagle3.target.load import prepare_target
from eagle3.train.loop import train
from tests.unit.test_dflash_train import OVERRIDES
from tests.unit.test_train_helpers import load_run_config, real_tiny_run

TRAINED = [*OVERRIDES, "train.max_steps=2", "train.eval_every_steps=1", "export.dtype=float32"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A DFlash drafter trained 2 steps on the tiny preset's run."""
    workdir = tmp_path_factory.mktemp("dflash-export") / "runs"
    cfg = load_run_config(real_tiny_run(workdir, TRAINED))
    assert train(cfg).status == "done"
    return workdir


def _copy(trained, tmp_path, overrides=()):
    from tests.unit.test_train_helpers import copy_run

    return load_run_config(copy_run(trained, tmp_path / "runs", "tiny", list(overrides)))


def test_export_writes_the_dflash_layout_of_the_selected_checkpoint(trained, tmp_path):
    """export/sglang is a checked DFlashDraftModel folder whose weights are the best checkpoint's (float32: equal),
    with the block size, the captured layers and the tokenizer's pad token as mask; speculators is skipped, named."""
    cfg = _copy(trained, tmp_path)
    outcome = run_export(cfg)
    folder = cfg.run_dir / "export" / "sglang"
    assert check_export(folder) == "dflash"
    config = json.loads((folder / "config.json").read_text())
    assert config["dflash_config"] == {"block_size": 4, "target_layer_ids": [1, 3, 4], "mask_token_id": 2}
    assert config["num_target_layers"] == 8 and config["num_hidden_layers"] == 1
    stats = outcome.stats
    assert "speculators format has no DFlash drafter" in stats["formats"]["speculators"]["skipped"]
    assert not (cfg.run_dir / "export" / "speculators").exists()
    checkpoint = cfg.run_dir / stats["checkpoint"] / "model.safetensors"
    exported, trained_weights = load_file(str(folder / "model.safetensors")), load_file(str(checkpoint))
    assert exported.keys() == trained_weights.keys()
    assert all(torch.equal(exported[k], trained_weights[k]) for k in exported)
    loaded = load_dflash_export(folder, prepare_target(cfg))
    assert loaded.target_layer_ids == [1, 3, 4] and loaded.drafter.dims.block_size == 4
    assert run_export(cfg).computed is False  # the manifest matches: nothing redone


def test_export_refuses_non_finite_checkpoint_weights(trained, tmp_path, monkeypatch):
    """A NaN in the checkpoint's weights fails the export with the tensor named; no manifest is written."""
    import safetensors.torch

    cfg = _copy(trained, tmp_path)
    real_load = safetensors.torch.load_file

    def poisoned(path, *args, **kwargs):
        weights = real_load(path, *args, **kwargs)
        weights["layers.0.mlp.down_proj.weight"][0, 0] = float("nan")
        return weights

    monkeypatch.setattr(safetensors.torch, "load_file", poisoned)
    with pytest.raises(ExportError, match=r"non-finite.*layers\.0\.mlp\.down_proj\.weight"):
        run_export(cfg)
    assert not (cfg.run_dir / "export" / "export.manifest.json").exists()


def test_formats_without_a_dflash_layout_are_refused(trained, tmp_path):
    """export.formats=[speculators] would write nothing for a DFlash drafter: refused, naming the fix."""
    cfg = _copy(trained, tmp_path, ["export.formats=[speculators]"])
    with pytest.raises(ValueError, match=r"export.formats \['speculators'\] holds no layout of a DFlash drafter"):
        run_export(cfg)
