"""The trainer on the tiny preset's real run: resume parity, SIGTERM, outputs, idempotence, schedule, LR rule."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest

from eagle3.train.build import WarmupCosine, scaled_lr
from eagle3.train.checkpoint import latest_checkpoint
from eagle3.train.loop import train
from eagle3.train.metrics import read_metrics
from tests.unit.test_train_helpers import assert_resume_matches, load_run_config, real_tiny_run

# ~7 rows of 1024 tokens per epoch, 2 rows per step: 6 steps cross from epoch 0 into epoch 1.
OVERRIDES = [
    "train.tokens_per_row=1024",
    "train.grad_accum_steps=2",
    "train.num_epochs=2",
    "train.max_steps=6",
    "train.lr=1e-3",
    "train.warmup_steps=2",
    "train.eval_every_steps=3",
    "train.checkpoint_every_steps=0",
    "train.aux_noise=uniform",
    "train.progress_every_s=0",
]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The 6-step run without interruption."""
    cfg = load_run_config(real_tiny_run(tmp_path_factory.mktemp("full") / "runs", OVERRIDES))
    result = train(cfg)
    return cfg, result


def test_resume_matches_uninterrupted_run(uninterrupted, tmp_path):
    """3 steps, stop, resume for 3 more: the same per-step losses (1e-6) and the same final weights."""
    full_cfg, full = uninterrupted
    assert_resume_matches(full_cfg, full, tmp_path / "runs", OVERRIDES)


def test_run_writes_metrics_progress_and_manifest(uninterrupted):
    """Per-step records carry loss_k/acc_k/lr/tok/s/grad_norm; progress says done; the manifest names the checkpoint."""
    cfg, result = uninterrupted
    train_dir = cfg.run_dir / "train"
    records = read_metrics(train_dir / "metrics.jsonl")
    need = {"step", "epoch", "lr", "loss", "loss_0", "acc_0", "loss_2", "acc_2", "tokens_per_s", "grad_norm", "mfu"}
    assert len(records) == 6 and all(need <= r.keys() for r in records)
    assert {r["epoch"] for r in records} == {0, 1}
    progress = json.loads((train_dir / "progress.json").read_text())
    assert (progress["state"], progress["step"], progress["total_steps"]) == ("done", 6, 6)
    manifest = json.loads((train_dir / "train.manifest.json").read_text())
    final_checkpoint = str(result.checkpoint.relative_to(train_dir))
    assert manifest["stats"]["final_checkpoint"] == "checkpoints/step-6" == final_checkpoint


def test_eval_reports_metrics_and_the_unigram_baseline(uninterrupted):
    """Eval records (every 3 steps and at the end) hold acc_k, accept_len_est and the unigram accuracy."""
    from eagle3.data.vocab import count_train_tokens

    cfg, _ = uninterrupted
    evals = read_metrics(cfg.run_dir / "train" / "metrics.jsonl", "eval")
    counts, _ = count_train_tokens(cfg.run_dir / "data" / "tokenized.parquet", 384)
    assert [e["step"] for e in evals] == [3, 6]
    assert all(e["unigram_token"] == int(counts.argmax()) and 0 <= e["unigram_acc_0"] <= 1 for e in evals)
    assert all(e["accept_len_est"] >= 1 and "full_acc_1" in e for e in evals)


def test_completed_run_is_a_noop(uninterrupted):
    """Training again with the same config and inputs does nothing (the manifest matches)."""
    cfg, _ = uninterrupted
    assert train(cfg).status == "up_to_date"


def test_sigterm_checkpoints_and_rerun_resumes(tmp_path):
    """SIGTERM mid-run: the step finishes, a checkpoint appears, exit code 0; the rerun resumes from it."""
    overrides = [
        "train.tokens_per_row=256",
        "train.num_epochs=200",
        "train.checkpoint_every_steps=0",
        "train.eval_every_steps=0",
        "train.progress_every_s=0",
    ]
    config = real_tiny_run(tmp_path / "runs", overrides)
    cfg = load_run_config(config)
    cmd = [sys.executable, "-m", "eagle3.train", "--config", str(config)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    metrics = cfg.run_dir / "train" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while len(read_metrics(metrics)) < 2 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert "received SIGTERM" in out
    stopped_at = int(latest_checkpoint(cfg.run_dir / "train" / "checkpoints").name.removeprefix("step-"))
    assert stopped_at >= 2
    rerun = subprocess.run(cmd + ["--stop-after-steps", "1"], capture_output=True, text=True, env=env, timeout=120)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert "resuming from" in rerun.stdout and f"step {stopped_at}," in rerun.stdout
    assert json.loads(rerun.stdout.strip().splitlines()[-1])["step"] == stopped_at + 1


def test_warmup_then_cosine_schedule():
    """LR factor rises linearly over the warmup, is 1 at its end, and decays by cosine to min_ratio."""
    f = WarmupCosine(total_steps=12, warmup_steps=4, min_ratio=0.1)
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == pytest.approx(1.0) and f(8) == pytest.approx(0.1 + 0.9 * 0.5)
    assert f(12) == pytest.approx(0.1)
    assert all(f(s) >= f(s + 1) for s in range(4, 12))


def test_lr_scaling_rules():
    """none keeps lr; linear scales by rows/reference; sqrt by its square root."""
    assert scaled_lr(1e-4, "none", 16, 2) == 1e-4
    assert scaled_lr(1e-4, "linear", 16, 2) == pytest.approx(8e-4)
    assert scaled_lr(1e-4, "sqrt", 16, 2) == pytest.approx(1e-4 * math.sqrt(8))


def test_missing_features_are_a_clear_error(tmp_path):
    """A run whose capture has not run fails with a message naming the missing stage."""
    config = real_tiny_run(tmp_path / "runs", [])
    cfg = load_run_config(config)
    (cfg.run_dir / "features" / "capture.manifest.json").unlink()
    with pytest.raises(ValueError, match="capture"):
        train(cfg)


def test_known_key_with_overrides_is_refused(tmp_path, capsys):
    """--known-key is the key of the --config file as it is: with --set overrides it is refused, before training."""
    from eagle3.train.__main__ import main

    with pytest.raises(SystemExit) as stopped:
        main(["--preset", "tiny", "--set", f"run.workdir={tmp_path}", "--known-key", "0123abcd"])
    assert stopped.value.code == 2 and "--known-key" in capsys.readouterr().err
