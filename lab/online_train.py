"""Online vs offline training throughput on one GPU, with a random-weight target built on the device.

Both modes run the trainer's own pieces on the same packed rows (eagle3.train.data.pack of the same
documents) and the same drafter step (eagle3.train.step.ttt_update: supervise -> backward_rows -> optimizer_step):
  offline  the capture stage's writer first stores every document's states as shards (capture_and_write, the
           stage's own code, default settings), then training reads each row back through RowLoader
           (safetensors slices, pinned, prefetched on a thread) -> the step;
  online   RowLoader over the token ids alone, OnlineFeatures.fill runs the frozen target on the device -> the step,
           once per --online-forward mode: packed (a row in one forward, documents kept apart by a flex mask)
           and padded (a row's documents as padded batches); each mode also prints the target's rate alone.
           The documents' tokens are read from the row the loader made on the host, as the trainer does;
           --device-tokens also times each mode reading them from the row's device copy, which waits for the
           kernels queued before it (the trainer before it took the host row), and prints the ratio.
  cached   (--feature-cache) online with train.feature_cache_gib's cache already holding every document (the
           later epochs of a run whose cache holds its data): one untimed pass fills it, the timed pass hits for
           every document, so the step runs no target forward. --profile N prints the top ops of N steps of each online
           mode and of the cached pass.
Printed per mode after --warmup untimed steps: training tokens/s, peak GiB; offline also the capture's tokens/s,
bytes on disk and the tokens/s of capture + one epoch together (what offline costs when the features are
used once). Documents: real lengths from a --tokens-file (lab/capture.py --save-tokens), or random.

    python lab/online_train.py --target smollm2 --tokens-file sharegpt_smollm2_tokens.npz
    python lab/online_train.py --target llama8b --seq-len 4096 --rows 24 --ttt-steps 7
    python lab/online_train.py --target smollm2 --tokens-file sharegpt_smollm2_tokens.npz --ttt-steps 7 \
        --online-forward padded --feature-cache --profile 4
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from eagle3.config import apply_overrides, validate_config
from eagle3.drafter.model import DrafterDims
from eagle3.drafter.ttt import TTTObjective
from eagle3.features.hf_backend import HFCaptureBackend
from eagle3.features.plan import plan_shards
from eagle3.features.shards.layout import shard_path
from eagle3.features.spec import FeatureSpec, SampleTokens
from eagle3.features.writers import capture_and_write
from eagle3.train.build import build_optimizer, build_scheduler, ttt_objective
from eagle3.train.data import RowLoader, batch_to, pack
from eagle3.train.dist import DistInfo
from eagle3.train.online import OnlineFeatures
from eagle3.train.state_cache import StateCache
from eagle3.train.step import step_options_for, ttt_update

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file (python lab/x.py): `lab` importable
from lab.shapes import LLAMA31_8B, SMOLLM2_135M, random_drafter  # noqa: E402

SHAPES = {"smollm2": (SMOLLM2_135M, 16384), "llama8b": (LLAMA31_8B, 32000)}  # (target shape, draft vocab)


class MemoryTokens:
    """The token source of the online loader: ids and loss masks by sample id (TokenReader's interface)."""

    def __init__(self, samples: list[SampleTokens]):
        self._by_id = {s.id: s for s in samples}

    def get(self, sample_id: str) -> dict[str, torch.Tensor]:
        s = self._by_id[sample_id]
        return {
            "input_ids": torch.tensor(s.input_ids, dtype=torch.int32),
            "loss_mask": torch.tensor(s.loss_mask, dtype=torch.uint8),
        }


def documents(args: argparse.Namespace, vocab: int) -> list[SampleTokens]:
    """Documents enough for --rows rows of --seq-len tokens: real ids and lengths from a file, or random."""
    need, out = args.rows * args.seq_len, []
    if args.tokens_file:
        data = np.load(args.tokens_file)
        ids, lengths = data["ids"].astype(np.int64), data["lengths"]
        start = 0
        for n in lengths:
            out.append(SampleTokens(f"doc{len(out)}", ids[start : start + n].tolist(), [1] * int(n)))
            start += n
            if start >= need:
                break
    gen = np.random.default_rng(0)
    while sum(len(s.input_ids) for s in out) < need:
        n = int(gen.integers(64, 1024))
        out.append(SampleTokens(f"doc{len(out)}", gen.integers(0, vocab, n).tolist(), [1] * n))
    return out


def build_target(shape: dict, layers: int | None, device: torch.device):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**{**shape, "num_hidden_layers": layers or shape["num_hidden_layers"]})
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def random_objective(cfg, model, shape: dict, draft_vocab: int, device: torch.device) -> TTTObjective:
    """The trainer's objective (eagle3.train.build.ttt_objective) over a seeded random drafter of the target's dims
    with a random draft vocab; the target's own lm_head supervises."""
    c = model.config
    dims = DrafterDims(
        hidden_size=c.hidden_size,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.hidden_size // c.num_attention_heads,
        intermediate_size=c.intermediate_size,
        rms_norm_eps=c.rms_norm_eps,
        rope_theta=shape["rope_theta"],
        rope_scaling=None,
        vocab_size=c.vocab_size,
        draft_vocab_size=draft_vocab,
        num_aux=3,
        target_hidden_size=c.hidden_size,
        max_position_embeddings=c.max_position_embeddings,
    )
    drafter, t2d, d2t = random_drafter(dims, device, torch.Generator(device=device).manual_seed(0))
    lm_head = model.get_output_embeddings().weight.detach()
    if device.type == "cpu":
        lm_head = lm_head.float()
    return ttt_objective(cfg, drafter, t2d, d2t, lm_head, step_options_for(cfg.train, device))


def _sync(device: torch.device, reset_peak: bool = False) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
        if reset_peak:
            torch.cuda.reset_peak_memory_stats()


def stepper(cfg, objective, fill, info: DistInfo):
    """One training step per row, as the trainer takes it (fill, then eagle3.train.step.ttt_update)."""
    optimizer = build_optimizer(cfg, objective, 1e-4, info.device)
    scheduler = build_scheduler(cfg, optimizer, 10_000)

    def step(row) -> None:
        ttt_update(objective, [fill(batch_to(row.batch, info.device), row)], optimizer, scheduler, 0.5, info)

    return step


def train_pass(cfg, objective, loader: RowLoader, fill, info: DistInfo, warmup: int) -> tuple[float, int, float]:
    """(seconds of the timed steps, their tokens, peak GiB): one row per step, the first ``warmup`` untimed."""
    step = stepper(cfg, objective, fill, info)
    tokens, start = 0, None
    for i, row in enumerate(loader):
        if i == warmup:
            _sync(info.device, reset_peak=True)
            start = time.perf_counter()
        step(row)
        tokens += row.num_tokens if i >= warmup else 0
    _sync(info.device)
    peak = torch.cuda.max_memory_allocated() / 2**30 if info.device.type == "cuda" else float("nan")
    return time.perf_counter() - start, tokens, peak


def target_rate(
    online: OnlineFeatures,
    loader: RowLoader,
    fdt: torch.dtype,
    device: torch.device,
    warmup: int,
    host_tokens: bool = True,
) -> float:
    """Tokens/s of the online target alone (row_states, no drafter step) over the loader's rows after ``warmup``."""
    tokens, start = 0, 0.0
    for k, row in enumerate(loader):
        if k == warmup:
            _sync(device)
            start = time.perf_counter()
        batch = batch_to(row.batch, device)
        online.row_states(batch, list(row.lengths), fdt, row.batch if host_tokens else None)
        tokens += row.num_tokens if k >= warmup else 0
    _sync(device)
    return tokens / (time.perf_counter() - start)


def online_pass(
    cfg,
    args,
    model,
    shape,
    draft_vocab,
    backend,
    spec,
    rows,
    docs,
    fdir,
    fdt,
    info,
    mode: str,
    host_tokens: bool = True,
) -> tuple[float, float]:
    """Online training over ``rows`` with train.online_forward=``mode``: prints the target's and the step's rates;
    ``host_tokens``: the documents' tokens from the host row (the trainer's way), else from its device copy."""
    device = info.device
    online = OnlineFeatures(backend, spec, mode)

    def loader() -> RowLoader:
        return RowLoader(
            fdir, rows, args.seq_len, fdt, depth=2, pin_memory=device.type == "cuda", reader=MemoryTokens(docs)
        )

    with torch.no_grad():
        target_tok_s = target_rate(online, loader(), fdt, device, args.warmup, host_tokens)
    torch.manual_seed(0)
    on_obj = random_objective(cfg, model, shape, draft_vocab, device)

    def fill(b, r):
        return online.fill(b, list(r.lengths), fdt, host=r.batch if host_tokens else None)

    on_s, on_tokens, on_gib = train_pass(cfg, on_obj, loader(), fill, info, args.warmup)
    if args.profile and host_tokens:
        profile_steps(cfg, on_obj, loader(), fill, info, args.profile, f"online ({mode} target forward)")
    on_tok_s = on_tokens / on_s
    tokens = "" if host_tokens else ", tokens read from the device"
    print(
        f"online train ({mode} target forward{tokens}): {on_tok_s:,.0f} tokens/s, peak {on_gib:.1f} GiB; the target "
        f"alone {target_tok_s:,.0f} tokens/s",
        flush=True,
    )
    del on_obj
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return on_tok_s, on_gib


def profile_steps(cfg, objective, loader: RowLoader, fill, info: DistInfo, steps: int, what: str) -> None:
    """Prints the ops that took the most device time (CPU time on a CPU) over ``steps`` training steps."""
    from torch.profiler import ProfilerActivity, profile

    step, cuda = stepper(cfg, objective, fill, info), info.device.type == "cuda"
    rows = iter(loader)
    for _, row in zip(range(2), rows):  # untimed: compilation and the optimizer's first step stay out of the profile
        step(row)
    _sync(info.device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _, row in zip(range(steps), rows):
            step(row)
        _sync(info.device)
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    print(f"profile of {steps} {what} steps, top ops by {sort}:", flush=True)
    print(prof.key_averages().table(sort_by=sort, row_limit=25), flush=True)


def cached_pass(
    cfg, args, model, shape, draft_vocab, backend, spec, rows, docs, fdir, fdt, info
) -> tuple[float, float]:
    """Online training with every document's states already in the feature cache (module docstring)."""
    device = info.device
    online = OnlineFeatures(backend, spec, "padded", cache=StateCache(1 << 40))  # the rows' states fit: few rows

    def loader() -> RowLoader:
        return RowLoader(
            fdir, rows, args.seq_len, fdt, depth=2, pin_memory=device.type == "cuda", reader=MemoryTokens(docs)
        )

    def fill(batch, row):
        return online.fill(batch, list(row.lengths), fdt, row.ids, host=row.batch)

    with torch.no_grad():
        for row in loader():  # the pass that fills the cache (the first epoch), untimed
            fill(batch_to(row.batch, device), row)
    torch.manual_seed(0)
    obj = random_objective(cfg, model, shape, draft_vocab, device)
    seconds, tokens, gib = train_pass(cfg, obj, loader(), fill, info, args.warmup)
    if args.profile:
        profile_steps(cfg, obj, loader(), fill, info, args.profile, "cached")
    print(
        f"online train (cached states, every document a hit): {tokens / seconds:,.0f} tokens/s, peak {gib:.1f} GiB; "
        f"{online.cache.describe()}",
        flush=True,
    )
    del obj
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return tokens / seconds, gib


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", choices=sorted(SHAPES), default="smollm2")
    p.add_argument("--num-layers", type=int, default=None, help="target decoder layers (default: the real count)")
    p.add_argument("--seq-len", type=int, default=16384, help="tokens per packed row (train.tokens_per_row)")
    p.add_argument("--rows", type=int, default=24, help="packed rows (= optimizer steps) per mode")
    p.add_argument("--warmup", type=int, default=4, help="untimed steps per mode (compilation)")
    p.add_argument("--ttt-steps", type=int, default=7)
    p.add_argument("--tokens-file", type=Path, default=None, help="real documents (lab/capture.py --save-tokens)")
    p.add_argument("--device", default="cuda", help="cuda (figures), or cpu for a smoke run with --num-layers 4")
    p.add_argument(
        "--online-forward",
        default="packed,padded",
        help="train.online_forward modes to time, comma-separated (packed: one forward per row)",
    )
    p.add_argument("--out-dir", type=Path, default=None, help="where the offline shards go (default: a temp dir)")
    p.add_argument(
        "--device-tokens",
        action="store_true",
        help="also time each online mode reading the documents' tokens from the device (the old way)",
    )
    p.add_argument("--feature-cache", action="store_true", help="also time online training from a full feature cache")
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="print the top ops of N steps of each online mode (and of the cached pass)",
    )
    args = p.parse_args()
    device = torch.device(args.device)
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=device, initialized=False)
    shape, draft_vocab = SHAPES[args.target]
    cfg = validate_config(
        apply_overrides({}, [f"drafter.ttt_steps={args.ttt_steps}", "train.reuse_block_mask=true"]), "benchmark"
    )
    model = build_target(shape, args.num_layers, device)
    fdt = torch.bfloat16 if device.type == "cuda" else torch.float32  # the trainer's feature dtype
    layers = model.config.num_hidden_layers
    aux = [1, layers // 2 - 1, layers - 4]
    spec = FeatureSpec(
        target_name=f"random-{args.target}",
        target_fingerprint="random",
        hidden_size=shape["hidden_size"],
        num_layers=layers,
        vocab_size=shape["vocab_size"],
        aux_layer_ids=aux,
        max_len=1 << 20,
        chat_template_hash="none",
        backend="hf",
    )
    backend = HFCaptureBackend(None, aux, model=model, device=str(device), tokens_per_forward="auto")
    docs = documents(args, shape["vocab_size"])
    rows, _ = pack([(d.id, len(d.input_ids)) for d in docs], args.seq_len)
    rows = rows[: args.rows]
    used = {ref.sample_id for row in rows for ref in row.samples}
    docs = [d for d in docs if d.id in used]
    num_tokens = sum(len(d.input_ids) for d in docs)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(
        f"device: {name}, torch {torch.__version__}; target random-{args.target} "
        f"({layers} layers, bf16), capture batch {backend.tokens_per_forward} tokens "
        f"({'per-sample' if backend.per_sample else 'padded'} attention); {len(rows)} rows of {args.seq_len} "
        f"tokens, {len(docs)} documents, {num_tokens} tokens; ttt {args.ttt_steps}",
        flush=True,
    )
    out = args.out_dir or Path(tempfile.mkdtemp(prefix="eagle3-online-bench-"))
    try:
        # offline: capture every document to shards (the stage's writer, default settings), then train from disk
        fdir = out / "features"
        fdir.mkdir(parents=True, exist_ok=True)
        spec.save(fdir / "spec.json")
        plan = plan_shards([d.id for d in docs], [len(d.input_ids) for d in docs], 262144)
        by_id = {d.id: d for d in docs}
        jobs = [(shard_path(fdir, i), [by_id[s] for s in shard.sample_ids]) for i, shard in enumerate(plan)]
        list(backend.capture(jobs[0][1][:8]))  # warm the capture path
        _sync(device)
        start = time.perf_counter()
        capture_and_write(backend, spec, jobs)
        capture_s = time.perf_counter() - start
        disk = sum(f.stat().st_size for f in fdir.glob("shard-*.safetensors"))
        print(
            f"offline capture: {num_tokens / capture_s:,.0f} tokens/s, {capture_s:.1f} s, "
            f"{disk / 1e9:.2f} GB on disk ({disk / num_tokens:,.0f} B/token)",
            flush=True,
        )
        torch.manual_seed(0)
        off_obj = random_objective(cfg, model, shape, draft_vocab, device)
        loader = RowLoader(fdir, rows, args.seq_len, fdt, depth=2, pin_memory=device.type == "cuda")
        off_s, off_tokens, off_gib = train_pass(cfg, off_obj, loader, lambda b, r: b, info, args.warmup)
        off_tok_s = off_tokens / off_s
        print(f"offline train: {off_tok_s:,.0f} tokens/s, peak {off_gib:.1f} GiB (shards read from disk)", flush=True)
        del off_obj
        if device.type == "cuda":
            torch.cuda.empty_cache()
        # online: token ids only; the frozen target fills each row on the device, per forward mode
        rates = {}
        for mode in args.online_forward.split(","):
            rates[mode] = online_pass(
                cfg, args, model, shape, draft_vocab, backend, spec, rows, docs, fdir, fdt, info, mode
            )
        both = 1 / (1 / (num_tokens / capture_s) + 1 / off_tok_s)
        for mode, (on_tok_s, on_gib) in rates.items():
            print(
                f"summary: online_forward={mode} online_tok_s={on_tok_s:,.0f} offline_train_tok_s={off_tok_s:,.0f} "
                f"offline_capture_plus_one_epoch_tok_s={both:,.0f} "
                f"online_over_offline_train={on_tok_s / off_tok_s:.3f} "
                f"online_over_capture_plus_epoch={on_tok_s / both:.3f} disk_bytes_per_token={disk / num_tokens:,.0f} "
                f"peak_gib_online={on_gib:.1f} peak_gib_offline={off_gib:.1f}",
                flush=True,
            )
        for mode in args.online_forward.split(",") if args.device_tokens else ():
            slow, _ = online_pass(
                cfg,
                args,
                model,
                shape,
                draft_vocab,
                backend,
                spec,
                rows,
                docs,
                fdir,
                fdt,
                info,
                mode,
                host_tokens=False,
            )
            print(
                f"summary: online_forward={mode} host_tokens_over_device_tokens={rates[mode][0] / slow:.3f}", flush=True
            )
        if {"packed", "padded"} <= rates.keys():
            print(f"packed_over_padded_online={rates['packed'][0] / rates['padded'][0]:.3f}", flush=True)
        if args.feature_cache:
            cached_tok_s, cached_gib = cached_pass(
                cfg, args, model, shape, draft_vocab, backend, spec, rows, docs, fdir, fdt, info
            )
            best_online = max(r[0] for r in rates.values())
            print(
                f"summary: cached_tok_s={cached_tok_s:,.0f} cached_over_online={cached_tok_s / best_online:.3f} "
                f"cached_over_offline_train={cached_tok_s / off_tok_s:.3f} peak_gib_cached={cached_gib:.1f}",
                flush=True,
            )
    finally:
        if args.out_dir is None:
            shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
