"""Capture benchmark: how much the capture path costs on top of the bare forward, and what it stores.

Prints ``name: value`` lines for the setup and the shared figures, then ONE LINE PER CASE:
  raw_tok_s                  decoder-only forward (model.model, no lm_head) on the capture's own batches,
                             outputs discarded (best pass);
  capture_tok_s              forward + hooks + copy to host + shard writes + fsync + sha256 + done files +
                             manifest, with the case's write knobs (best pass);
  capture_over_raw           their ratio (1.0 = capture is free);
  disk_GB_s, disk_tok_s      the disk's write bandwidth measured alone (write + fsync of --disk-probe-gb),
                             and the tokens/s it can absorb at this spec's bytes per token;
  capture_over_bound         capture / min(raw, disk): how close capture gets to its real bound;
  disk_ratio                 bytes on disk per token / ((num_aux + 1) * H * 2), against bare bf16 states;
  wait_s                     time the capture loop waited for writers (backpressure; 0 = writers kept up).
A case is a comma-separated list of CaptureConfig write knobs (stream_writes, num_writers, write_queue_bytes,
early_writeback, pinned_handoff); ``--case`` repeats, and all cases share one model, one sample set and the
raw passes (interleaved ABBA so drift hits all alike). fp8 figures: e4m3 + per-token scale error of the
captured aux states.

    python lab/capture.py --preset smollm2-demo --num-samples 50 --device cpu
    python lab/capture.py --random-llama8b --device cuda --num-samples 256 --max-sample-tokens 2048 \\
        --tokens-per-forward 16384 --tokens-per-shard 65536 \\
        --case stream_writes=false,num_writers=1 --case num_writers=1 --case num_writers=2
    python lab/capture.py --random-smollm2 --device cuda --num-samples 2000 --max-sample-tokens 2048
    python lab/capture.py --random-smollm2 --device cuda --num-samples 2000 --max-sample-tokens 2048 \
        --per-sample-attention  # the bitwise per-sample path instead of the default (padded batches on a GPU)

The preset mode needs the run's tokenized data (`eagle3 stage all --preset smollm2-demo`), or
``--synthetic`` for random tokens with the preset's target. The random modes build a random-weight
model with Llama-3.1-8B or SmolLM2-135M shapes directly on the device and a synthetic token set, so
they need no weights, no data and no network.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from eagle3.config import CaptureConfig
from eagle3.features.fp8 import fp8_error
from eagle3.features.hf_backend import HFCaptureBackend
from eagle3.features.hf_models import resolve_device
from eagle3.features.plan import plan_shards
from eagle3.features.shards.layout import shard_path
from eagle3.features.shards.writer import write_shard
from eagle3.features.spec import FeatureSpec, SampleTokens
from eagle3.features.writers import WriteOptions, WriteStats, capture_and_write
from infra.storage import atomic_write_json

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file (python lab/x.py): `lab` importable
from lab.capture_setup import preset_setup, random_setup, save_tokens  # noqa: E402

CASE_KNOBS = ("stream_writes", "num_writers", "write_queue_bytes", "early_writeback", "pinned_handoff")
DEFAULT_CASES = ["stream_writes=false,num_writers=1", ""]
"""The previous scheme (whole shards, one writer) and the config's defaults."""


def _parser() -> argparse.ArgumentParser:
    from eagle3.run.cli_args import add_config_args

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(parser)
    parser.add_argument("--num-samples", type=int, default=50, help="samples to capture")
    parser.add_argument("--max-sample-tokens", type=int, default=512, help="only samples up to this many tokens")
    parser.add_argument("--min-sample-tokens", type=int, default=128, help="shortest synthetic sample")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: capture.device of the config)")
    parser.add_argument("--tokens-per-shard", type=int, default=8192, help="shard size for the benchmark's writes")
    parser.add_argument("--tokens-per-forward", type=int, default=None, help="override capture.tokens_per_forward")
    parser.add_argument("--repeats", type=int, default=2, help="timed passes of each; the best is reported")
    parser.add_argument(
        "--case",
        dest="cases",
        action="append",
        default=None,
        metavar="KNOB=V,...",
        help=f"write knobs of one case, among {', '.join(CASE_KNOBS)} (repeatable; default: {DEFAULT_CASES})",
    )
    parser.add_argument("--out-dir", type=Path, default=None, help="where shards are written (default: a temp dir)")
    parser.add_argument("--disk-probe-gb", type=float, default=2.0, help="GB written + fsynced to measure the disk")
    parser.add_argument("--fp8-rows", type=int, default=32768, help="aux rows used for the fp8 error")
    random = parser.add_mutually_exclusive_group()
    random.add_argument("--random-llama8b", action="store_true", help="random Llama-3.1-8B-shaped model on the device")
    random.add_argument("--random-smollm2", action="store_true", help="random SmolLM2-135M-shaped model on the device")
    parser.add_argument("--num-layers", type=int, default=None, help="decoder layers of the random model")
    parser.add_argument("--synthetic", action="store_true", help="preset mode: random tokens instead of its data")
    parser.add_argument(
        "--padded-attention",
        action="store_true",
        help="one padded SDPA per layer, not per-sample attention (capture.per_sample_attention)",
    )
    parser.add_argument(
        "--per-sample-attention",
        action="store_true",
        help="one attention call per sample (bitwise batch-invariant; the CPU default)",
    )
    parser.add_argument("--check", action="store_true", help="first compare captured states with a plain forward")
    parser.add_argument(
        "--tokens-file",
        type=Path,
        default=None,
        help="random modes: real token ids and lengths from an .npz written by --save-tokens",
    )
    parser.add_argument(
        "--save-tokens",
        type=Path,
        default=None,
        help="preset mode: write the selected tokenized samples to this .npz and exit",
    )
    parser.add_argument(
        "--raw-sweep",
        default=None,
        metavar="B1,B2,...",
        help="also time the bare forward at these token budgets; the best is the raw bound",
    )
    return parser


def _cases(cfg: Any, specs: list[str] | None) -> list[tuple[str, CaptureConfig]]:
    """(label, capture config with the case's knobs) for every --case; bad knobs exit naming them."""
    cases = []
    for text in specs if specs is not None else DEFAULT_CASES:
        pairs = dict(item.split("=", 1) for item in text.split(",") if item.strip())
        unknown = sorted(set(pairs) - set(CASE_KNOBS))
        if unknown:
            sys.exit(f"--case {text!r}: unknown knobs {unknown}; use {', '.join(CASE_KNOBS)}")
        cap = CaptureConfig.model_validate({**cfg.capture.model_dump(), **{k.strip(): v for k, v in pairs.items()}})
        cases.append((_label(cap), cap))
    return cases


def _label(cap: CaptureConfig) -> str:
    """A case's knobs in short: stream=1,writers=2,queue_GB=4.3,writeback=1,pinned=0."""
    return (
        f"stream={int(cap.stream_writes)},writers={cap.num_writers},queue_GB={cap.write_queue_bytes / 1e9:.3g},"
        f"writeback={int(cap.early_writeback)},pinned={int(cap.pinned_handoff)}"
    )


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


def _time_capture(
    backend: HFCaptureBackend, spec: FeatureSpec, shards: list[list[SampleTokens]], out: Path, cap: CaptureConfig
) -> dict[str, Any]:
    """Capture into shards under ``out`` exactly as the stage does, with the case's write knobs."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    backend.pinned_handoff = cap.pinned_handoff
    jobs = [(shard_path(out, index), shard) for index, shard in enumerate(shards)]
    stats = WriteStats()
    start = time.perf_counter()
    spec.save(out / "spec.json")
    docs = capture_and_write(backend, spec, jobs, options=WriteOptions.from_config(cap), stats=stats)
    atomic_write_json(out / "capture.manifest.json", {"num_shards": len(shards)})
    total_s = time.perf_counter() - start
    num_bytes = sum(p.stat().st_size for p in out.iterdir() if p.name.startswith("shard-"))
    return {
        "total_s": total_s,
        "num_bytes": num_bytes,
        "wait_s": stats.wait_s,
        "peak_queued_bytes": stats.peak_queued_bytes,
        "sha256": [d.sha256 for d in docs],
    }


def _disk_probe(out: Path, num_bytes: int) -> float:
    """GB/s of writing ``num_bytes`` of random bytes to a file under ``out`` and fsyncing it (nothing else)."""
    out.mkdir(parents=True, exist_ok=True)
    block = os.urandom(64 << 20)  # incompressible, so a compressing filesystem cannot flatter the figure
    path = out / "disk-probe.bin"
    start = time.perf_counter()
    with open(path, "wb") as fh:
        for _ in range(max(1, num_bytes // len(block))):
            fh.write(block)
        fh.flush()
        os.fsync(fh.fileno())
    elapsed_s = time.perf_counter() - start
    written = path.stat().st_size
    path.unlink()
    return written / elapsed_s / 1e9


def _sha256_probe(num_bytes: int = 1 << 30) -> float:
    """GB/s of one sha256 stream on this CPU (each shard is hashed by one thread)."""
    block = os.urandom(64 << 20)
    digest = hashlib.sha256()
    start = time.perf_counter()
    for _ in range(num_bytes // len(block)):
        digest.update(block)
    return num_bytes / (time.perf_counter() - start) / 1e9


def _aux_rows(out: Path, spec: FeatureSpec, backend: HFCaptureBackend, samples: list, num_rows: int) -> torch.Tensor:
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
    print(f"{name}: {json.dumps(value) if isinstance(value, list) else value}", flush=True)


def _timed_passes(
    backend: HFCaptureBackend,
    spec: FeatureSpec,
    shards: list[list[SampleTokens]],
    out: Path,
    cases: list[tuple[str, CaptureConfig]],
    repeats: int,
    device: str,
) -> tuple[list, dict]:
    """Raw and every case's capture passes in ABBA order (raw, c1..cn, then cn..c1, raw, ...)."""
    raw_s: list[float] = []
    caps: dict[str, list[dict[str, Any]]] = {label: [] for label, _ in cases}
    order = [("raw", None), *cases]
    for rep in range(repeats):
        for label, cap in order if rep % 2 == 0 else order[::-1]:
            if cap is None:
                raw_s.append(_time_raw(backend, shards, device))
                _report("pass raw_s", round(raw_s[-1], 3))
            else:
                caps[label].append(_time_capture(backend, spec, shards, out / "features", cap))
                _report(f"pass capture_s[{label}]", round(caps[label][-1]["total_s"], 3))
    return raw_s, caps


def _figures(
    backend: HFCaptureBackend,
    spec: FeatureSpec,
    shards: list[list[SampleTokens]],
    raw_s: list[float],
    write: tuple[int, float],
    disk_gb_s: float,
    sha_gb_s: float,
    aux: torch.Tensor,
) -> dict[str, Any]:
    """The shared figures (setup, raw forward, write alone, disk, fp8), in print order."""
    num_tokens = sum(len(s.input_ids) for shard in shards for s in shard)
    ideal = (spec.num_aux + 1) * spec.hidden_size * 2  # bare bf16 aux + final states per token
    fp8 = fp8_error(aux)
    return {
        "device": str(backend.input_device),
        "model_dtype": str(next(backend.model.parameters()).dtype)[6:],
        "hidden_size": spec.hidden_size,
        "num_layers": spec.num_layers,
        "aux_layer_ids": spec.aux_layer_ids,
        "num_samples": sum(len(shard) for shard in shards),
        "num_tokens": num_tokens,
        "num_batches": sum(len(backend.batches(shard)) for shard in shards),
        "tokens_per_forward": backend.tokens_per_forward,
        "num_shards": len(shards),
        "per_sample_attention": backend.per_sample,
        "raw_s_each": [round(t, 2) for t in raw_s],
        "raw_tokens_per_s": round(num_tokens / min(raw_s), 1),
        "first_shard_tokens": write[0],
        "first_shard_write_s": round(write[1], 3),
        "write_alone_tokens_per_s": round(write[0] / write[1], 1),
        "disk_write_GB_s": round(disk_gb_s, 3),
        "sha256_GB_s": round(sha_gb_s, 3),
        "spec_bytes_per_token": spec.bytes_per_token(),
        "bf16_states_bytes_per_token": ideal,
        "spec_aux_dtype": spec.aux_dtype,
        "fp8_disk_ratio": round(spec.model_copy(update={"aux_dtype": "float8_e4m3fn"}).bytes_per_token() / ideal, 4),
        "fp8_aux_rows": aux.shape[0],
        "fp8_aux_max_abs": round(fp8["max_abs"], 5),
        "fp8_aux_rel_rms": round(fp8["rel_rms"], 5),
    }


def _raw_sweep(
    backend: HFCaptureBackend, shards: list[list[SampleTokens]], device: str, budgets: str | None
) -> dict[int, float]:
    """{budget: bare-forward tokens/s} at each --raw-sweep budget (warm pass, then the best of two timed)."""
    if not budgets:
        return {}
    default, out = backend.tokens_per_forward, {}
    num_tokens = sum(len(s.input_ids) for shard in shards for s in shard)
    try:
        for budget in (int(b) for b in budgets.split(",")):
            backend.tokens_per_forward = budget
            _time_raw(backend, shards, device)
            out[budget] = num_tokens / min(_time_raw(backend, shards, device) for _ in range(2))
    finally:
        backend.tokens_per_forward = default
    return out


def _case_line(
    label: str,
    passes: list[dict[str, Any]],
    num_tokens: int,
    raw_best_s: float,
    sweep_best_s: float,
    disk_gb_s: float,
    spec: FeatureSpec,
) -> str:
    """One case: raw, capture, their ratio, the disk bound, the ratio against min(raw, disk), bytes per token;
    ``capture_over_best_bound`` against min(bare forward at the best swept budget, disk)."""
    best = min(passes, key=lambda p: p["total_s"])
    raw_tok_s, cap_tok_s = num_tokens / raw_best_s, num_tokens / best["total_s"]
    bytes_per_token = best["num_bytes"] / num_tokens
    disk_tok_s = disk_gb_s * 1e9 / bytes_per_token
    figures = {
        "raw_tok_s": round(raw_tok_s),
        "capture_tok_s": round(cap_tok_s),
        "capture_over_raw": round(cap_tok_s / raw_tok_s, 3),
        "disk_GB_s": round(disk_gb_s, 3),
        "disk_tok_s": round(disk_tok_s),
        "bound": "disk" if disk_tok_s < raw_tok_s else "raw",
        "capture_over_bound": round(cap_tok_s / min(raw_tok_s, disk_tok_s), 3),
        "best_raw_tok_s": round(num_tokens / sweep_best_s),
        "capture_over_best_bound": round(cap_tok_s / min(num_tokens / sweep_best_s, disk_tok_s), 3),
        "bytes_per_token": round(bytes_per_token, 1),
        "disk_ratio": round(bytes_per_token / ((spec.num_aux + 1) * spec.hidden_size * 2), 4),
        "capture_s_each": json.dumps([round(p["total_s"], 2) for p in passes]),
        "wait_s": round(best["wait_s"], 2),
        "peak_queue_MB": round(best["peak_queued_bytes"] / 1e6),
    }
    return f"case [{label}]: " + " ".join(f"{k}={v}" for k, v in figures.items())


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark and print the shared figures, then one line per case."""
    from eagle3.run.cli_args import config_from_args

    args = _parser().parse_args(argv)
    cfg = config_from_args(args)
    cases = _cases(cfg, args.cases)
    device = resolve_device(args.device or cfg.capture.device)
    setup = random_setup if (args.random_llama8b or args.random_smollm2) else preset_setup
    backend, spec, samples = setup(cfg, args, device)
    if args.save_tokens:
        return save_tokens(args.save_tokens, samples)
    out = args.out_dir or Path(tempfile.mkdtemp(prefix="eagle3-capture-bench-"))
    try:
        shards = _shards(samples, args.tokens_per_shard)
        # Warm-up: a GPU's first large batches pay for allocator growth and GEMM heuristics (2x on an H200),
        # and the first capture for pinned host buffers.
        # The whole raw pass once: every batch shape of the timed passes is then warm.
        if device.startswith("cuda"):
            _time_raw(backend, shards, device)
            list(backend.capture(shards[0]))
        else:
            backend.forward_only(samples[:2])
        sweep = _raw_sweep(backend, shards, device, args.raw_sweep)
        for budget, tok_s in sweep.items():
            _report(f"raw_sweep_tok_s[{budget}]", round(tok_s))
        if args.check:
            for name, value in _check(backend, samples).items():
                _report(name, f"{value:.3g}")
        disk_gb_s = _disk_probe(out / "probe", int(args.disk_probe_gb * 1e9))
        _report("disk_write_GB_s", round(disk_gb_s, 3))
        raw_s, caps = _timed_passes(backend, spec, shards, out, cases, args.repeats, device)
        backend.pinned_handoff = False
        aux = _aux_rows(out / "features", spec, backend, samples, args.fp8_rows)
        write = (sum(len(s.input_ids) for s in shards[0]), _time_write(spec, backend, shards[0], out / "write-only"))
        for name, value in _figures(backend, spec, shards, raw_s, write, disk_gb_s, _sha256_probe(), aux).items():
            _report(name, value)
        hashes = {tuple(p["sha256"]) for passes in caps.values() for p in passes}
        _report("shards_identical_across_passes", len(hashes) == 1)  # same batches: same bytes, any write knobs
        num_tokens = sum(len(s.input_ids) for s in samples)
        best_raw_s = min([*raw_s, *(num_tokens / t for t in sweep.values())])
        for label, passes in caps.items():
            print(_case_line(label, passes, num_tokens, min(raw_s), best_raw_s, disk_gb_s, spec), flush=True)
    finally:
        if args.out_dir is None:
            shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
