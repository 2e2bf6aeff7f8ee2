"""Measured acceptance during training (train.measured, eagle3.train.measured) on the tiny run: when it is measured,
that it changes no trained byte, train.select=measured, and the early stop after train.measured.patience."""

from __future__ import annotations

import json

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file

from eagle3.config import TrainConfig
from eagle3.config_base import key_fields
from eagle3.export.model_card import select_checkpoint
from eagle3.train import measured
from eagle3.train.loop import train
from eagle3.train.metrics import read_metrics
from tests.unit.test_train_helpers import load_run_config, real_tiny_run

BASE = [
    "train.tokens_per_row=1024",
    "train.num_epochs=2",
    "train.lr=1e-2",
    "train.warmup_steps=0",
    "train.checkpoint_every_steps=0",
    "train.keep_checkpoints=1",
    "train.progress_every_s=0",
    "train.device=cpu",
    "drafter.ttt_steps=2",
    "evaluate.datasets=[mtbench]",
]
MEASURED = ["train.measured.num_prompts=2", "train.measured.max_new_tokens=12"]


def _run(tmp_path, overrides: list[str]):
    return load_run_config(real_tiny_run(tmp_path / "runs", [*BASE, *overrides]))


def _stats(cfg) -> dict:
    return json.loads((cfg.run_dir / "train" / "train.manifest.json").read_text())["stats"]


def _weights(cfg, checkpoint: str) -> dict[str, torch.Tensor]:
    return load_file(str(cfg.run_dir / "train" / checkpoint / "model.safetensors"))


def _scripted(monkeypatch, values: list[float]) -> list[int]:
    """Replace the decode by a script: the i-th measurement reports values[i]; returns the list of measured calls."""
    calls: list[int] = []

    def decode(m, weights):
        calls.append(len(calls))
        return {
            "accept_len": values[len(calls) - 1],
            "num_prompts": 1,
            "num_tokens": 4,
            "num_verify": 2,
            "chain_steps": 3,
            "decode_s": 0.0,
        }

    monkeypatch.setattr(measured, "decode", decode)
    return calls


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """The same 5-step tiny run trained without and with a real measurement every 2 steps: (plain, measured)."""
    plain = load_run_config(
        real_tiny_run(
            tmp_path_factory.mktemp("plain") / "runs", [*BASE, "train.max_steps=5", "train.eval_every_steps=2"]
        )
    )
    with_it = load_run_config(
        real_tiny_run(
            tmp_path_factory.mktemp("measured") / "runs",
            [*BASE, *MEASURED, "train.max_steps=5", "train.eval_every_steps=2", "train.measured.every_steps=2"],
        )
    )
    assert train(plain).status == "done" and train(with_it).status == "done"
    return plain, with_it


def test_acceptance_is_measured_every_n_steps_and_at_the_last(pair):
    """every_steps=2 over 5 steps: measured records at steps 2, 4 and 5, each a real decode of the 2 prompts (an
    acceptance length between 1 and chain_steps + 1, at most 12 tokens each) at the tokens seen by then; the
    manifest's history and best step agree with them."""
    _, cfg = pair
    path = cfg.run_dir / "train" / "metrics.jsonl"
    records, seen = read_metrics(path, "measured"), {r["step"]: r["tokens_seen"] for r in read_metrics(path)}
    assert [r["step"] for r in records] == [2, 4, 5]
    for r in records:
        assert 1.0 <= r["accept_len"] <= 4.0 and r["chain_steps"] == 3 and r["num_prompts"] == 2
        assert 2 <= r["num_tokens"] <= 24 and r["num_verify"] >= 1 and r["tokens_seen"] == seen[r["step"]]
        # bonus included: every verify forward commits >= 1 token; the prefill's token is in neither count
        assert r["accept_len"] == pytest.approx((r["num_tokens"] - r["num_prompts"]) / r["num_verify"])
    stats = _stats(cfg)
    values = [r["accept_len"] for r in records]
    best = records[values.index(max(values))]["step"]
    assert stats["measured_history"] == [[r["step"], r["accept_len"]] for r in records]
    assert (stats["best_measured_step"], stats["best_measured_accept_len"]) == (best, max(values))
    assert stats["best_measured_checkpoint"] == f"checkpoints/step-{best}" and stats["stopped_early"] is False


def test_the_measurement_changes_no_trained_byte(pair):
    """With and without the measurement: the same losses at every step, the same validations, the same final
    weights bit for bit (it decodes a copy) and the same torch random state in the final checkpoint (it puts back the
    stream its loading draws from). Python's global stream is not compared here: other threads of a test process
    (Prefect's services, left by earlier tests) draw from it; the next test checks that the measurement restores it."""
    plain, with_it = pair
    for kind in ("train", "eval"):
        a = read_metrics(plain.run_dir / "train" / "metrics.jsonl", kind)
        b = read_metrics(with_it.run_dir / "train" / "metrics.jsonl", kind)
        assert [r["loss"] for r in a] == [r["loss"] for r in b] and len(a) == len(b) > 0
    a, b = _weights(plain, "checkpoints/step-5"), _weights(with_it, "checkpoints/step-5")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rng_a, rng_b = (
        torch.load(c.run_dir / "train" / "checkpoints" / "step-5" / "trainer.pt", weights_only=False)["rng"][0]
        for c in (plain, with_it)
    )
    assert torch.equal(rng_a["torch"], rng_b["torch"])  # seeds untouched
    assert "best_measured_step" not in _stats(plain)  # (the manifest of a run without it is as before)


def test_kept_random_state_puts_back_python_and_torch_streams_drawn_inside():
    """What the measurement's loading and decode run inside: python's and torch's streams leave it as they entered,
    however much the body drew from them."""
    import random

    random.seed(3)
    torch.manual_seed(3)
    python_before, torch_before = random.getstate(), torch.get_rng_state()
    with measured.kept_random_state(torch.device("cpu")):
        drawn = [random.random() for _ in range(700)], torch.nn.Linear(64, 64)  # past one Mersenne block; an init
    assert random.getstate() == python_before and torch.equal(torch.get_rng_state(), torch_before)
    assert len(set(drawn[0])) == 700  # the body did draw


def test_the_run_report_plots_measured_and_estimated_acceptance(pair):
    """plot_metrics writes acceptance.png for the measured run only."""
    from eagle3.train.plots import ACCEPTANCE_PLOT, plot_metrics

    plain, with_it = pair
    assert ACCEPTANCE_PLOT not in [p.name for p in plot_metrics(plain.run_dir / "train" / "metrics.jsonl")]
    written = plot_metrics(with_it.run_dir / "train" / "metrics.jsonl")
    assert written[-1].name == ACCEPTANCE_PLOT and written[-1].stat().st_size > 0


def test_select_measured_exports_the_best_measured_checkpoint(tmp_path, monkeypatch):
    """Scripted measurements 1.2, 1.9, 1.4, 1.9, 1.3, 1.0 over 6 steps: step 2 is the best (the tie at step 4 keeps
    the earlier step); keep_checkpoints=1 still keeps it, and select=measured exports its weights."""
    from eagle3.export.stage import run_export

    calls = _scripted(monkeypatch, [1.2, 1.9, 1.4, 1.9, 1.3, 1.0])
    cfg = _run(
        tmp_path,
        [
            *MEASURED,
            "train.max_steps=6",
            "train.eval_every_steps=3",
            "train.measured.every_steps=1",
            "train.select=measured",
        ],
    )
    assert train(cfg).status == "done" and len(calls) == 6
    stats = _stats(cfg)
    assert (stats["best_measured_step"], stats["best_measured_accept_len"]) == (2, 1.9)
    ckpts = cfg.run_dir / "train" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-2", "step-6"]
    outcome = run_export(cfg)
    sel = outcome.stats["selection"]
    assert (sel["rule"], sel["step"], sel["checkpoint"]) == ("measured", 2, "checkpoints/step-2")
    stored = load_file(str(cfg.run_dir / "export" / "sglang" / "model.safetensors"))
    want, final = _weights(cfg, "checkpoints/step-2"), _weights(cfg, "checkpoints/step-6")
    assert all(torch.equal(stored[k], v.to(torch.bfloat16)) for k, v in want.items())
    assert not all(torch.equal(want[k], final[k]) for k in want)  # the choice matters


def test_patience_stops_training_after_k_measurements_without_a_new_best(tmp_path, monkeypatch):
    """Scripted 1.5, 2.0, 1.9, 2.0 with patience 2: steps 3 and 4 bring no new best, so training stops after step 4
    of 8, validated and checkpointed there, done (manifest written, stopped_early), the best step 2 kept; a rerun
    is up to date."""
    calls = _scripted(monkeypatch, [1.5, 2.0, 1.9, 2.0, 9.9])
    cfg = _run(
        tmp_path,
        [
            *MEASURED,
            "train.max_steps=8",
            "train.eval_every_steps=0",
            "train.measured.every_steps=1",
            "train.measured.patience=2",
        ],
    )
    result = train(cfg)
    assert (result.status, result.step, len(calls)) == ("done", 4, 4)
    stats = _stats(cfg)
    assert (stats["step"], stats["total_steps"], stats["stopped_early"]) == (4, 8, True)
    assert stats["best_measured_step"] == 2 and stats["measured_history"] == [[1, 1.5], [2, 2.0], [3, 1.9], [4, 2.0]]
    assert [e["step"] for e in read_metrics(cfg.run_dir / "train" / "metrics.jsonl", "eval")] == [4]
    assert sorted(p.name for p in (cfg.run_dir / "train" / "checkpoints").iterdir()) == ["step-2", "step-4"]
    assert train(cfg).status == "up_to_date" and len(calls) == 4


def test_a_resumed_run_stops_where_the_uninterrupted_run_stops(tmp_path, monkeypatch):
    """Stopped after 3 steps and resumed: the measurements since the best come back from the checkpoint, so
    patience stops the run at the same step with the same best."""
    _scripted(monkeypatch, [1.5, 2.0, 1.9, 2.0, 9.9])
    cfg = _run(
        tmp_path,
        [
            *MEASURED,
            "train.max_steps=8",
            "train.eval_every_steps=0",
            "train.measured.every_steps=1",
            "train.measured.patience=2",
        ],
    )
    assert train(cfg, stop_after_steps=3).status == "stopped"
    result = train(cfg)
    assert (result.status, result.step) == ("done", 4)
    stats = _stats(cfg)
    assert stats["best_measured_step"] == 2 and [s for s, _ in stats["measured_history"]] == [1, 2, 3, 4]


# ------------------------------------------------------------------------------------ settings, key, selection


def test_train_key_holds_the_measured_section_only_once_set():
    """A config without train.measured keys as before it existed; every measured setting enters the key once set."""
    base = TrainConfig()
    assert "measured" not in key_fields(base)
    on = base.model_copy(update={"measured": base.measured.model_copy(update={"every_steps": 5})})
    assert key_fields(on)["measured"]["every_steps"] == 5 and key_fields(on) != key_fields(base)


def test_train_key_extra_names_the_prompts_only_when_measuring(tmp_path):
    """key_extra: {} while off (keys as before); the measured prompt sets (evaluate.datasets by default) once on."""
    from eagle3.config import load_config

    off = load_config("tiny", [f"run.workdir={tmp_path}"])
    assert measured.key_extra(off) == {}
    on = load_config("tiny", [f"run.workdir={tmp_path}", "train.measured.every_steps=3", "evaluate.datasets=[gsm8k]"])
    assert measured.key_extra(on) == {"measured_prompts": ["gsm8k"], "measured_prompt_files": {}}


def test_bad_measured_settings_are_refused_with_their_name():
    """select=measured needs measurements; a prompt set must be a named set or a .jsonl file."""
    with pytest.raises(ValidationError, match="train.select=measured needs train.measured.every_steps"):
        TrainConfig(select="measured")
    with pytest.raises(ValidationError, match="train.measured.prompts"):
        TrainConfig.model_validate({"measured": {"every_steps": 1, "prompts": ["prompts.txt"]}})
    assert TrainConfig.model_validate({"select": "measured", "measured": {"every_steps": 2}}).select == "measured"


def test_selection_by_measurement_without_a_training_run():
    """select=measured takes the manifest's best measured checkpoint (its estimate from the validations), and falls
    back to the final checkpoint, saying why, when nothing was measured."""
    stats = {
        "final_checkpoint": "checkpoints/step-9",
        "step": 9,
        "best_checkpoint": "checkpoints/step-4",
        "best_step": 4,
        "best_accept_len_est": 2.5,
        "eval_history": [[4, 2.5], [6, 2.1]],
        "best_measured_checkpoint": "checkpoints/step-6",
        "best_measured_step": 6,
        "best_measured_accept_len": 2.2,
        "measured_history": [[3, 1.8], [6, 2.2], [9, 2.0]],
    }
    sel = select_checkpoint("measured", None, stats)
    assert (sel.checkpoint, sel.step, sel.rule, sel.accept_len_est) == ("checkpoints/step-6", 6, "measured", 2.1)
    assert "2.2000" in sel.reason and "3 measurements" in sel.reason
    assert select_checkpoint("best", None, stats).checkpoint == "checkpoints/step-4"
    none = select_checkpoint("measured", None, {"final_checkpoint": "checkpoints/step-9", "step": 9})
    assert (none.checkpoint, none.rule) == ("checkpoints/step-9", "last") and "no measurement" in none.reason
