"""Keeping the best checkpoint by validation (train.select) and the model card of each export, on the tiny run."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from eagle3.export.model_card import CARD_FILE, select_checkpoint
from eagle3.train.loop import train
from eagle3.train.metrics import read_metrics
from tests.unit.test_train_helpers import load_run_config, real_tiny_run

# lr 1e-2 makes the validation estimate fall after step 1 and climb back to a tie at steps 5-6: the best is
# step 1 (ties keep the earlier step), neither the last step nor the last improvement.
OVERRIDES = [
    "train.tokens_per_row=1024",
    "train.num_epochs=2",
    "train.max_steps=6",
    "train.lr=1e-2",
    "train.warmup_steps=0",
    "train.eval_every_steps=1",
    "train.checkpoint_every_steps=0",
    "train.keep_checkpoints=1",
    "train.progress_every_s=0",
    "drafter.ttt_steps=2",
    "evaluate.num_prompts=1",
    "evaluate.max_new_tokens=8",
    "evaluate.methods=[chain,ngram]",
    "evaluate.chain_steps=[3]",
    "evaluate.datasets=[mtbench]",
    "evaluate.device=cpu",
]


def _manifest(cfg) -> dict:
    return json.loads((cfg.run_dir / "train" / "train.manifest.json").read_text())["stats"]


def _weights(cfg, checkpoint: str) -> dict[str, torch.Tensor]:
    return load_file(str(cfg.run_dir / "train" / checkpoint / "model.safetensors"))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The 6-step tiny run validated after every step, keeping 1 checkpoint; its RunConfig."""
    cfg = load_run_config(real_tiny_run(tmp_path_factory.mktemp("select") / "runs", OVERRIDES))
    assert train(cfg).status == "done"
    return cfg


def test_best_step_is_the_argmax_of_the_validations(trained):
    """The manifest's best step is the first argmax of accept_len_est over metrics.jsonl's eval records."""
    evals = read_metrics(trained.run_dir / "train" / "metrics.jsonl", "eval")
    values = [e["accept_len_est"] for e in evals]
    assert [e["step"] for e in evals] == list(range(1, 7))
    golden = evals[values.index(max(values))]["step"]
    stats = _manifest(trained)
    assert golden != 6 and max(values[golden:]) == max(values) > min(values)  # a later tie and a dip: not trivial
    assert (stats["best_step"], stats["best_accept_len_est"]) == (golden, max(values))
    assert stats["best_checkpoint"] == f"checkpoints/step-{golden}" and stats["best_eval"]["step"] == golden
    assert stats["eval_history"] == [[e["step"], e["accept_len_est"]] for e in evals]


def test_best_checkpoint_survives_rotation(trained):
    """keep_checkpoints=1 leaves the final checkpoint and the best one; the best's info names itself as best."""
    best = _manifest(trained)["best_step"]
    ckpts = trained.run_dir / "train" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == sorted([f"step-{best}", "step-6"])
    info = json.loads((ckpts / f"step-{best}" / "checkpoint.json").read_text())
    assert info["best_step"] == best and info["step"] == best
    manifest = json.loads((trained.run_dir / "train" / "train.manifest.json").read_text())
    assert manifest["outputs"]["best_model"]["path"] == f"checkpoints/step-{best}/model.safetensors"


def test_export_of_select_best_ships_the_best_weights(trained):
    """Export (select=best) writes the best checkpoint's weights, names the step and why in eagle3_export.json."""
    from eagle3.export.stage import run_export

    outcome = run_export(trained)
    best = _manifest(trained)["best_step"]
    stored = load_file(str(trained.run_dir / "export" / "sglang" / "model.safetensors"))
    want, final = _weights(trained, f"checkpoints/step-{best}"), _weights(trained, "checkpoints/step-6")
    assert all(torch.equal(stored[k], v.to(torch.bfloat16)) for k, v in want.items())
    assert not all(torch.equal(want[k], final[k]) for k in want)  # the choice matters
    info = json.loads((trained.run_dir / "export" / "speculators" / "eagle3_export.json").read_text())
    assert info["selection"]["step"] == best == outcome.stats["selection"]["step"]
    assert info["selection"]["rule"] == "best" and "accept_len_est" in info["selection"]["reason"]


def test_select_last_exports_the_final_weights_without_retraining(trained):
    """train.select=last: training stays up to date (operational knob), the export runs again with step 6."""
    from eagle3.export.stage import run_export

    last = trained.model_copy(deep=True)
    last.train.select = "last"
    assert train(last).status == "up_to_date"
    outcome = run_export(last)
    assert outcome.computed and outcome.stats["selection"]["step"] == 6
    stored = load_file(str(last.run_dir / "export" / "sglang" / "model.safetensors"))
    assert all(torch.equal(stored[k], v.to(torch.bfloat16)) for k, v in _weights(last, "checkpoints/step-6").items())
    assert run_export(trained).computed  # back to best: the selection is part of the export's key


def test_resumed_run_selects_what_the_uninterrupted_run_selects(trained, tmp_path):
    """Stop after 3 steps (past the best, in the dip), resume: the same best step, estimate and weights."""
    cfg = load_run_config(real_tiny_run(tmp_path / "runs", OVERRIDES))
    assert train(cfg, stop_after_steps=3).status == "stopped"
    assert train(cfg).status == "done"
    got, want = _manifest(cfg), _manifest(trained)
    assert (got["best_step"], got["best_accept_len_est"], got["eval_history"]) == (
        want["best_step"],
        want["best_accept_len_est"],
        want["eval_history"],
    )
    best = f"checkpoints/step-{want['best_step']}"
    a, b = _weights(cfg, best), _weights(trained, best)
    assert all(torch.equal(a[k], b[k]) for k in b)


def test_model_card_names_target_step_tokens_and_serve_commands(trained):
    """Each export folder's README.md names the target, the selected step, the token counts and both commands."""
    from eagle3.export.stage import run_export
    from eagle3.run.stages import manifest_path

    run_export(trained)
    tokens = json.loads(manifest_path(trained, "tokenize").read_text())["stats"]["num_tokens"]
    best = _manifest(trained)["best_step"]
    for fmt in ("sglang", "speculators"):
        card = (trained.run_dir / "export" / fmt / CARD_FILE).read_text()
        assert f"# EAGLE-3 drafter for `{trained.target.name}`" in card and "- fingerprint: `" in card
        assert f"`checkpoints/step-{best}` (step {best}): train.select=best" in card
        assert f"{tokens:,} tokens" in card and "| tiny-chats |" in card
        sglang = trained.run_dir.resolve() / "export" / "sglang"
        assert (
            f"python -m sglang.launch_server --model-path {trained.run_dir.parent.resolve()}" in card
            and f"--speculative-algorithm EAGLE3 --speculative-draft-model-path {sglang} "
            "--speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4"
            in card
        )
        draft = json.dumps(
            {"method": "eagle3", "model": str(trained.run_dir.resolve() / "export" / fmt), "num_speculative_tokens": 3}
        )
        assert "vllm serve " in card and f"--speculative-config '{draft}'" in card
        assert "Not measured yet" in card


def test_evaluation_writes_its_table_into_the_cards_and_keeps_the_export_whole(trained):
    """After evaluate: the cards hold the measured table; export and evaluate are still up to date and checked."""
    from eagle3.evaluate.stage import run_evaluate
    from eagle3.export.stage import check_export, run_export

    run_export(trained)
    outcome = run_evaluate(trained)
    rows = json.loads((trained.run_dir / "eval" / "results.json").read_text())["results"]
    for fmt in ("sglang", "speculators"):
        card = (trained.run_dir / "export" / fmt / CARD_FILE).read_text()
        assert "Not measured yet" not in card
        for r in rows:
            assert f"| {r['dataset']} | {r['method']} | 1 | {r['accept_len']:.3f} |" in card
        assert check_export(trained.run_dir / "export" / fmt) == fmt
    assert outcome.computed and not run_export(trained).computed and not run_evaluate(trained).computed


def test_an_evaluation_of_the_runs_export_named_explicitly_updates_only_its_measured_table(trained, tmp_path):
    """--export-dir <run>/export/sglang (a drafter carried without its data): the card's measured table is rewritten
    from the results and the rest of the card kept byte for byte; another folder's card is left alone."""
    import shutil

    from eagle3.evaluate.stage import run_evaluate
    from eagle3.export.model_card import MEASURED_HEADING, write_measured
    from eagle3.export.stage import run_export

    run_export(trained)
    card = trained.run_dir / "export" / "sglang" / CARD_FILE
    head = card.read_text().partition(MEASURED_HEADING)[0]
    card.write_text(head + MEASURED_HEADING + "\n\nNot measured yet: the evaluate stage writes its table here.\n")
    other = tmp_path / "other"
    shutil.copytree(card.parent, other)
    run_evaluate(trained, export_dir=other, force=True)
    assert "Not measured yet" in (other / CARD_FILE).read_text() and "Not measured yet" in card.read_text()
    run_evaluate(trained, export_dir=card.parent, force=True)
    rows = json.loads((trained.run_dir / "eval" / "results.json").read_text())["results"]
    text = card.read_text()
    assert text.startswith(head) and "Not measured yet" not in text
    assert all(f"| {r['dataset']} | {r['method']} | 1 | {r['accept_len']:.3f} |" in text for r in rows)
    assert write_measured(tmp_path, {"results": []}) is None  # no card there


def test_selection_rules_without_a_training_run():
    """export.checkpoint overrides; select=best without validations falls back to the final checkpoint."""
    stats = {
        "final_checkpoint": "checkpoints/step-9",
        "step": 9,
        "best_checkpoint": "checkpoints/step-4",
        "best_step": 4,
        "best_accept_len_est": 2.5,
        "eval_history": [[4, 2.5], [8, 2.1]],
    }
    assert select_checkpoint("best", None, stats).checkpoint == "checkpoints/step-4"
    assert select_checkpoint("last", None, stats).checkpoint == "checkpoints/step-9"
    override = select_checkpoint("best", "checkpoints/step-8", stats)
    assert (override.step, override.rule, override.accept_len_est) == (8, "export.checkpoint", 2.1)
    none = select_checkpoint("best", None, {"final_checkpoint": "checkpoints/step-9", "step": 9})
    assert (none.checkpoint, none.rule) == ("checkpoints/step-9", "last") and "no validation" in none.reason
