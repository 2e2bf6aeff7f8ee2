"""Run directories for the trainer tests (no tests here): the real tiny pipeline, or a synthetic run.

``real_tiny_run`` runs the data stages and the capture on the tiny preset once per test session
(~10 s) and copies the result per test. ``synthetic_run`` writes every input the trainer reads
(target config + embeddings/lm_head, tokenized.parquet, vocab map, feature shards, manifests) from
random tensors, without transformers or tokenizers, so it also builds on the GPU machine; its final
states are a fixed function of the aux states, so the drafter has something to learn.
"""

from __future__ import annotations

import atexit
import functools
import json
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle3.config import RunConfig, load_config, save_config


def copy_run(src_workdir: Path, dst_workdir: Path, name: str, overrides: list[str]) -> Path:
    """Copy a workdir and re-point its config (workdir + overrides); returns the new config.json."""
    shutil.copytree(src_workdir, dst_workdir)
    cfg_path = dst_workdir / name / "config.json"
    data = json.loads(cfg_path.read_text())
    data["run"]["workdir"] = str(dst_workdir)
    from eagle3.config import apply_overrides, validate_config

    cfg = validate_config(apply_overrides(data, overrides), str(cfg_path))
    save_config(cfg, cfg_path)
    return cfg_path


@functools.cache
def _real_tiny_workdir() -> Path:
    from eagle3.features.capture import run_capture
    from eagle3.run.stages import run_all

    root = Path(tempfile.mkdtemp(prefix="eagle3-train-tiny-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)  # built once per session, removed at its end
    workdir = root / "runs"
    cfg = load_config("tiny", [f"run.workdir={workdir}"])
    run_all(cfg)
    run_capture(cfg)
    return workdir


def real_tiny_run(dst_workdir: Path, overrides: list[str] = ()) -> Path:
    """A private copy of the tiny preset's run (data, vocab, features) with ``overrides``; its config.json."""
    return copy_run(_real_tiny_workdir(), Path(dst_workdir), "tiny", list(overrides))


# ----------------------------------------------------------------------------------------------- synthetic


@dataclass(frozen=True)
class SyntheticShape:
    """Sizes of a synthetic target and dataset."""

    hidden_size: int = 32
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 64
    num_layers: int = 8
    vocab_size: int = 96
    draft_vocab_size: int = 48
    lengths: tuple[int, ...] = (40, 17, 63, 25, 90, 33, 12, 51, 70, 28, 44, 9)
    val_every: int = 4  # every val_every-th sample is a val sample
    topk: int | None = None  # None: final_hidden supervision; K: the target's top-K log-probs instead


def _write_target(model_dir: Path, shape: SyntheticShape, gen: torch.Generator) -> None:
    from safetensors.torch import save_file

    model_dir.mkdir(parents=True)
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.hidden_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.hidden_size // shape.num_heads,
        "intermediate_size": shape.intermediate_size,
        "vocab_size": shape.vocab_size,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "eos_token_id": 2,
    }
    (model_dir / "config.json").write_text(json.dumps(cfg))
    save_file(
        {
            "model.embed_tokens.weight": torch.randn(shape.vocab_size, shape.hidden_size, generator=gen),
            "lm_head.weight": torch.randn(shape.vocab_size, shape.hidden_size, generator=gen),
        },
        str(model_dir / "model.safetensors"),
    )


def _samples(shape: SyntheticShape, gen: torch.Generator) -> list[dict]:
    rows = []
    for i, length in enumerate(shape.lengths):
        ids = torch.randint(3, shape.vocab_size, (length,), generator=gen)
        mask = (torch.arange(length) >= length // 3).to(torch.uint8)  # a "prompt" third, then the answer
        rows.append(
            {
                "id": f"syn:{i}",
                "split": "val" if i % shape.val_every == shape.val_every - 1 else "train",
                "input_ids": ids.tolist(),
                "loss_mask": mask.tolist(),
                "num_tokens": length,
                "num_loss_tokens": int(mask.sum()),
                "truncated": False,
            }
        )
    return rows


def _write_tokenized(path: Path, rows: list[dict]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


def _write_features(
    run_dir: Path, model_dir: Path, shape: SyntheticShape, rows: list[dict], gen: torch.Generator
) -> None:
    from safetensors.torch import load_file

    from eagle3.features.shards.layout import shard_path
    from eagle3.features.shards.writer import write_shard
    from eagle3.features.spec import CapturedSample, FeatureSpec
    from eagle3.run.stage import write_manifest
    from eagle3.target.load import default_aux_layer_ids, fingerprint

    fdir = run_dir / "features"
    fdir.mkdir(parents=True)
    spec = FeatureSpec(
        target_name="synthetic",
        target_fingerprint=fingerprint(model_dir),
        hidden_size=shape.hidden_size,
        num_layers=shape.num_layers,
        vocab_size=shape.vocab_size,
        aux_layer_ids=default_aux_layer_ids(shape.num_layers),
        dtype="float32",
        aux_dtype="float32",
        max_len=4096,
        chat_template_hash="none",
        backend="hf",
        supervision="topk_logprobs" if shape.topk else "final_hidden",
        topk=shape.topk,
    )
    spec.save(fdir / "spec.json")
    lm_head = load_file(str(model_dir / "model.safetensors"))["lm_head.weight"]  # [V, H]
    samples = []
    for row in rows:
        aux = torch.randn(row["num_tokens"], 3 * shape.hidden_size, generator=gen)
        final = torch.tanh(aux[:, : shape.hidden_size] + 0.5 * aux[:, shape.hidden_size : 2 * shape.hidden_size])
        sample = CapturedSample(row["id"], torch.tensor(row["input_ids"]), torch.tensor(row["loss_mask"]), aux, final)
        if shape.topk:
            logprobs = torch.log_softmax(final @ lm_head.T, dim=-1).topk(shape.topk)  # [T, K] each
            sample.final, sample.topk_ids, sample.topk_logprobs = None, logprobs.indices, logprobs.values
        samples.append(sample)
    half = len(samples) // 2  # two shards, so the reader's cross-shard lookup is exercised
    for index, part in enumerate((samples[:half], samples[half:])):
        write_shard(shard_path(fdir, index), spec, part)
    outputs = {f"shard-{i}": fdir / f"shard-0000{i}.done.json" for i in range(2)}
    write_manifest(fdir / "capture.manifest.json", "capture", "synthetic", outputs, {})


def _write_vocab(run_dir: Path, shape: SyntheticShape) -> None:
    from eagle3.data.vocab import build_vocab_map
    from eagle3.run.stage import write_manifest

    paths, _ = build_vocab_map(
        run_dir / "data" / "tokenized.parquet",
        shape.vocab_size,
        shape.draft_vocab_size,
        [2],
        run_dir / "vocab",
        "synthetic",
    )
    write_manifest(run_dir / "vocab" / "vocab.manifest.json", "vocab", "synthetic", paths, {})


def synthetic_run(
    workdir: Path, overrides: list[str] = (), shape: SyntheticShape = SyntheticShape(), seed: int = 0
) -> Path:
    """A complete synthetic run directory under ``workdir``; returns its config.json."""
    workdir = Path(workdir)
    gen = torch.Generator().manual_seed(seed)
    model_dir = workdir / "_targets" / "synthetic"
    _write_target(model_dir, shape, gen)
    cfg = load_config(
        "tiny",
        [
            f"run.workdir={workdir}",
            "run.name=syn",
            "target.kind=hf",
            f"target.path={model_dir}",
            "target.name=synthetic",
            *overrides,
        ],
    )
    rows = _samples(shape, gen)
    _write_tokenized(cfg.run_dir / "data" / "tokenized.parquet", rows)
    _write_vocab(cfg.run_dir, shape)
    _write_features(cfg.run_dir, model_dir, shape, rows, gen)
    return save_config(cfg, cfg.run_dir / "config.json")


def load_run_config(config_path: Path) -> RunConfig:
    """The RunConfig stored in a run's config.json."""
    return RunConfig.model_validate(json.loads(Path(config_path).read_text()))


def step_losses(cfg: RunConfig) -> list[tuple[int, float]]:
    """(step, loss) of every training step the run's metrics recorded."""
    from eagle3.train.metrics import read_metrics

    return [(r["step"], r["loss"]) for r in read_metrics(cfg.run_dir / "train" / "metrics.jsonl")]


def assert_resume_matches(full_cfg: RunConfig, full, workdir: Path, overrides: list[str], steps: int = 6) -> None:
    """Train a fresh copy of the tiny run for half of ``steps``, stop, resume to the end: the per-step losses
    (1e-6) and the final weights equal the uninterrupted run ``full`` (the TrainResult of ``full_cfg``)."""
    from safetensors.torch import load_file

    from eagle3.train.loop import train

    cfg = load_run_config(real_tiny_run(workdir, overrides))
    first = train(cfg, stop_after_steps=steps // 2)
    second = train(cfg)
    assert (first.status, first.step, second.status, second.step) == ("stopped", steps // 2, "done", steps)
    got, want = step_losses(cfg), step_losses(full_cfg)
    assert [s for s, _ in got] == [s for s, _ in want] == list(range(1, steps + 1))
    assert all(abs(a - b) <= 1e-6 for (_, a), (_, b) in zip(got, want))
    resumed = load_file(second.checkpoint / "model.safetensors")
    straight = load_file(full.checkpoint / "model.safetensors")
    assert resumed.keys() == straight.keys()
    assert all(torch.equal(resumed[k], straight[k]) for k in straight)


def torchrun_two(config: Path, parallel: str) -> subprocess.CompletedProcess:
    """``python -m eagle3.train`` on 2 CPU processes (torchrun, gloo) with ``train.parallel`` = ddp or fsdp."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "eagle3.train",
        "--config",
        str(config),
        "--set",
        f"train.parallel={parallel}",
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)
