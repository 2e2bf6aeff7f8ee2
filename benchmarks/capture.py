"""Capture benchmark: how much the capture path costs on top of the bare forward, and what it stores.

Prints, one per line as ``name: value``:
  (a) raw_tokens_per_s     decoder-only forward (model.model, no lm_head) on the capture's own batches,
                           outputs discarded;
      capture_tokens_per_s forward + hooks + copy to host + shard write + fsync + sha256 + done files + manifest;
      capture_over_raw     their ratio (1.0 = capture is free);
  (b) disk_ratio           bytes on disk per token / ((num_aux + 1) * H * 2), i.e. against bare bf16 states
                           (goal <= 1.02);
  (c) fp8_aux_max_abs, fp8_aux_rel_rms   e4m3 + per-token scale reconstruction error of the captured aux
                           states (against the bf16 states stored in the first shard, or freshly captured ones
                           when the shards are fp8 already).

    python benchmarks/capture.py --preset smollm2-demo --num-samples 50 --device cpu
    python benchmarks/capture.py --random-llama8b --device cuda --num-samples 256 [--num-layers 8]

The preset mode needs the run's tokenized data (`eagle3 stage all --preset smollm2-demo`). The
random mode builds a random-weight model with Llama-3.1-8B shapes directly on the device and a
synthetic token set, so it needs no weights and no network.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from eagle3.features.fp8 import fp8_error
from eagle3.features.hf_backend import HFCaptureBackend, resolve_device
from eagle3.features.plan import plan_shards
from eagle3.features.shards import shard_path, write_shard
from eagle3.features.spec import FeatureSpec, SampleTokens
from infra.storage import atomic_write_json

LLAMA31_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
              "vocab_size": 128256, "rope_theta": 500000.0, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5}


def _parser() -> argparse.ArgumentParser:
    from eagle3.cli_args import add_config_args

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(parser)
    parser.add_argument("--num-samples", type=int, default=50, help="samples to capture")
    parser.add_argument("--max-sample-tokens", type=int, default=512, help="only samples up to this many tokens")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: capture.device of the config)")
    parser.add_argument("--tokens-per-shard", type=int, default=8192, help="shard size for the benchmark's writes")
    parser.add_argument("--repeats", type=int, default=2, help="timed passes of each; the best is reported")
    parser.add_argument("--out-dir", type=Path, default=None, help="where shards are written (default: a temp dir)")
    parser.add_argument("--fp8-rows", type=int, default=32768, help="aux rows used for the fp8 error")
    parser.add_argument("--random-llama8b", action="store_true", help="random Llama-3.1-8B-shaped model on the device")
    parser.add_argument("--num-layers", type=int, default=32, help="decoder layers of the random model")
    parser.add_argument("--min-sample-tokens", type=int, default=128, help="shortest synthetic sample (random mode)")
    parser.add_argument("--max-tokens-per-batch", type=int, default=None, help="override capture.max_tokens_per_batch")
    parser.add_argument("--check", action="store_true", help="first compare captured states with a plain forward")
    return parser


def _preset_setup(cfg: Any, args: argparse.Namespace, device: str) -> tuple[HFCaptureBackend, FeatureSpec, list]:
    """The configured target, its spec, and the first samples of its tokenized data that fit the length cap."""
    from eagle3.data.tokenize import read_tokenized
    from eagle3.features.capture import build_spec
    from eagle3.target import prepare_target

    model_dir = prepare_target(cfg)
    spec = build_spec(cfg, model_dir)
    table = read_tokenized(cfg.run_dir / "data" / "tokenized.parquet", columns=["id", "input_ids", "loss_mask",
                                                                                "num_tokens"])
    rows = [r for r in table.to_pylist() if r["num_tokens"] <= args.max_sample_tokens][:args.num_samples]
    if not rows:
        sys.exit(f"no tokenized samples of <= {args.max_sample_tokens} tokens under {cfg.run_dir}: tokenize first")
    samples = [SampleTokens(r["id"], r["input_ids"], r["loss_mask"]) for r in rows]
    budget = args.max_tokens_per_batch or cfg.capture.max_tokens_per_batch
    backend = HFCaptureBackend.from_spec(model_dir, spec, device=device, dtype=cfg.target.dtype,
                                         max_tokens_per_batch=budget, device_map=cfg.capture.device_map)
    return backend, spec, samples


def _random_setup(cfg: Any, args: argparse.Namespace, device: str) -> tuple[HFCaptureBackend, FeatureSpec, list]:
    """A random-weight Llama-3.1-8B-shaped model built on the device, and synthetic samples."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from eagle3.target import default_aux_layer_ids

    config = LlamaConfig(num_hidden_layers=args.num_layers, tie_word_embeddings=False, **LLAMA31_8B)
    torch.manual_seed(cfg.run.seed)
    with torch.device(device):  # weights materialize on the device: nothing is loaded or carried
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    aux = cfg.target.aux_layer_ids or default_aux_layer_ids(args.num_layers)
    spec = FeatureSpec(target_name="random-llama-3.1-8b", target_fingerprint="random", hidden_size=config.hidden_size,
                       num_layers=args.num_layers, vocab_size=config.vocab_size, aux_layer_ids=aux,
                       supervision=cfg.capture.supervision,
                       topk=cfg.capture.topk if cfg.capture.supervision == "topk_logprobs" else None,
                       dtype=cfg.capture.dtype, aux_dtype=cfg.capture.aux_dtype, max_len=args.max_sample_tokens,
                       chat_template_hash="none", backend="hf")
    gen = torch.Generator().manual_seed(cfg.run.seed)
    lengths = torch.randint(args.min_sample_tokens, args.max_sample_tokens + 1, (args.num_samples,), generator=gen)
    samples = [SampleTokens(f"synthetic:{i}", torch.randint(0, config.vocab_size, (int(n),), generator=gen).tolist(),
                            [1] * int(n)) for i, n in enumerate(lengths)]
    budget = args.max_tokens_per_batch or cfg.capture.max_tokens_per_batch
    backend = HFCaptureBackend(None, aux, supervision=spec.supervision, topk=spec.topk, device=device,
                               max_tokens_per_batch=budget, model=model)
    return backend, spec, samples


def _check(backend: HFCaptureBackend, samples: list, num: int = 3) -> dict[str, float]:
    """Relative error of batched capture against a lone-sample output_hidden_states forward (stock attention)."""
    worst = {"check_rel_err_aux": 0.0, "check_rel_err_final": 0.0}
    for sample, got in zip(samples[:num], backend.capture(samples[:num])):
        ids = torch.tensor([sample.input_ids], device=backend.input_device)
        with torch.no_grad():
            ref = backend.decoder(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
        pairs = {"check_rel_err_aux": (got.aux, torch.cat([ref[j + 1][0] for j in backend.aux_layer_ids], -1))}
        if got.final is not None:
            pairs["check_rel_err_final"] = (got.final, ref[-1][0])
        for name, (a, b) in pairs.items():
            b = b.float().cpu()
            worst[name] = max(worst[name], ((a.float() - b).norm() / b.norm()).item())
    return worst


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _shards(samples: list, tokens_per_shard: int) -> list[list[SampleTokens]]:
    """The samples of each shard, planned as the capture stage plans them."""
    by_id = {s.id: s for s in samples}
    plan = plan_shards([s.id for s in samples], [len(s.input_ids) for s in samples], tokens_per_shard)
    return [[by_id[i] for i in shard.sample_ids] for shard in plan]


def _time_raw(backend: HFCaptureBackend, shards: list[list[SampleTokens]], device: str) -> float:
    """The capture's own batches (formed per shard), decoder forward only, outputs discarded."""
    _sync(device)
    start = time.perf_counter()
    for shard in shards:
        backend.forward_only(shard)
    _sync(device)
    return time.perf_counter() - start


def _time_capture(backend: HFCaptureBackend, spec: FeatureSpec, shards: list[list[SampleTokens]],
                  out: Path) -> dict[str, float]:
    """Capture into shards under ``out`` exactly as the stage does (writes overlap forwards)."""
    from eagle3.features.capture import capture_and_write

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    jobs = [(shard_path(out, index), shard) for index, shard in enumerate(shards)]
    start = time.perf_counter()
    spec.save(out / "spec.json")
    capture_and_write(backend, spec, jobs)
    atomic_write_json(out / "capture.manifest.json", {"num_shards": len(shards)})
    total_s = time.perf_counter() - start
    num_bytes = sum(p.stat().st_size for p in out.iterdir() if p.name.startswith("shard-"))
    return {"total_s": total_s, "num_bytes": num_bytes}


def _aux_rows(out: Path, spec: FeatureSpec, backend: HFCaptureBackend, samples: list,
              num_rows: int) -> torch.Tensor:
    """Up to ``num_rows`` aux rows [R, A*H]: the first shard's stored bf16 states, or, when the shards
    hold fp8 already, a fresh (untimed) capture of the first samples."""
    from safetensors import safe_open

    if spec.aux_dtype != "float8_e4m3fn":
        with safe_open(str(shard_path(out, 0)), framework="pt") as fh:
            return fh.get_slice("aux")[:num_rows]
    rows, taken = [], 0
    for sample in samples:
        if taken >= num_rows:
            break
        rows.append(next(iter(backend.capture([sample]))).aux)
        taken += rows[-1].shape[0]
    return torch.cat(rows)[:num_rows]


def _time_write(spec: FeatureSpec, backend: HFCaptureBackend, shard: list[SampleTokens], out: Path) -> float:
    """Seconds to validate, write, fsync and hash one shard alone (no forward in the timing)."""
    captured = list(backend.capture(shard))
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    write_shard(shard_path(out, 0), spec, captured, shard)
    return time.perf_counter() - start


def _report(name: str, value: Any) -> None:
    print(f"{name}: {value}", flush=True)


def _timed_passes(backend: HFCaptureBackend, spec: FeatureSpec, shards: list[list[SampleTokens]], out: Path,
                  repeats: int, device: str) -> tuple[list[float], list[dict[str, float]]]:
    """Raw and capture passes interleaved in ABBA order, so slow drift of a busy machine hits both alike."""
    raw_s, cap = [], []
    for rep in range(repeats):
        for kind in ("raw", "capture") if rep % 2 == 0 else ("capture", "raw"):
            if kind == "raw":
                raw_s.append(_time_raw(backend, shards, device))
            else:
                cap.append(_time_capture(backend, spec, shards, out / "features"))
    return raw_s, cap


def _figures(backend: HFCaptureBackend, spec: FeatureSpec, shards: list[list[SampleTokens]], raw_s: list[float],
             cap: list[dict[str, float]], write: tuple[int, float], aux: torch.Tensor) -> dict[str, Any]:
    """Everything the benchmark prints, in order (best pass of each kind)."""
    samples = [s for shard in shards for s in shard]
    num_tokens = sum(len(s.input_ids) for s in samples)
    best = min(cap, key=lambda c: c["total_s"])
    ideal = (spec.num_aux + 1) * spec.hidden_size * 2  # bare bf16 aux + final states per token
    fp8_spec = spec.model_copy(update={"aux_dtype": "float8_e4m3fn"})
    fp8 = fp8_error(aux)
    return {
        "device": str(backend.input_device), "model_dtype": str(next(backend.model.parameters()).dtype)[6:],
        "hidden_size": spec.hidden_size, "num_layers": spec.num_layers, "aux_layer_ids": spec.aux_layer_ids,
        "num_samples": len(samples), "num_tokens": num_tokens,
        "num_batches": sum(len(backend.batches(shard)) for shard in shards),
        "max_tokens_per_batch": backend.max_tokens_per_batch, "num_shards": len(shards),
        "per_sample_attention": backend.per_sample,
        "raw_s_each": [round(t, 2) for t in raw_s], "capture_s_each": [round(c["total_s"], 2) for c in cap],
        "raw_s": round(min(raw_s), 3), "capture_s": round(best["total_s"], 3),
        "first_shard_tokens": write[0], "first_shard_write_s": round(write[1], 3),
        "write_tokens_per_s": round(write[0] / write[1], 1),
        "raw_tokens_per_s": round(num_tokens / min(raw_s), 1),
        "capture_tokens_per_s": round(num_tokens / best["total_s"], 1),
        "capture_over_raw": round(min(raw_s) / best["total_s"], 3),
        "bytes_on_disk_per_token": round(best["num_bytes"] / num_tokens, 2), "bf16_states_bytes_per_token": ideal,
        "disk_ratio": round(best["num_bytes"] / num_tokens / ideal, 4), "spec_aux_dtype": spec.aux_dtype,
        "fp8_disk_ratio": round(fp8_spec.bytes_per_token() / ideal, 4), "fp8_aux_rows": aux.shape[0],
        "fp8_aux_max_abs": round(fp8["max_abs"], 5), "fp8_aux_rel_rms": round(fp8["rel_rms"], 5),
    }


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark and print one figure per line."""
    from eagle3.cli_args import config_from_args

    args = _parser().parse_args(argv)
    cfg = config_from_args(args)
    device = resolve_device(args.device or cfg.capture.device)
    setup = _random_setup if args.random_llama8b else _preset_setup
    backend, spec, samples = setup(cfg, args, device)
    out = args.out_dir or Path(tempfile.mkdtemp(prefix="eagle3-capture-bench-"))
    try:
        shards = _shards(samples, args.tokens_per_shard)
        # Warm-up: a GPU's first large batches pay for allocator growth and GEMM heuristics (2x on an H200).
        backend.forward_only(shards[0] if device.startswith("cuda") else samples[:2])
        if args.check:
            for name, value in _check(backend, samples).items():
                _report(name, f"{value:.3g}")
        raw_s, cap = _timed_passes(backend, spec, shards, out, args.repeats, device)
        aux = _aux_rows(out / "features", spec, backend, samples, args.fp8_rows)
        write = (sum(len(s.input_ids) for s in shards[0]), _time_write(spec, backend, shards[0], out / "write-only"))
        for name, value in _figures(backend, spec, shards, raw_s, cap, write, aux).items():
            _report(name, json.dumps(value) if isinstance(value, list) else value)
    finally:
        if args.out_dir is None:
            shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
