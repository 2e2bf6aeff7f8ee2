"""Training throughput of the drafter step with Llama-3.1-8B shapes, on random features built on the device.

The timed step is the trainer's own (eagle3.train.step.ttt_update: supervise -> backward_rows -> optimizer_step):
target supervision from final hidden states through a frozen bf16 target lm_head, the TTT unroll,
the soft cross-entropy, AdamW (fused) on fp32 master weights under bf16 autocast, grad clipping.
One packed row of --seq-len tokens per step and GPU. No files are read.

Each case is the default RunConfig plus --set overrides plus the case's own overrides; the step's
switches are train.compile, train.loss_chunk_tokens, train.reuse_block_mask (and drafter.attn_impl,
drafter.ttt_steps). Every case prints ONE markdown table row (a table of all rows is repeated at the
end): step ms, tokens/s (all GPUs), peak GiB, TFLOP per step (eagle3.train.metrics formula), MFU
against the device's dense bf16 peak (989 TFLOP/s for an H200), tokens/s at the peer's FLOPs per token
(speculators 0.9.0: frozen lm_head, no target lm_head in the step), the first step's loss and gradient
norm (same seed and batch in every case: equal up to bf16 noise when the paths agree), the warm-up
seconds (compilation) and the graph breaks torch.compile reported. A failing case prints its error
and the next case runs.

    python lab/train_throughput.py --ab                  # the A/B table of the step's switches
    python lab/train_throughput.py --ttt-steps 7 3 --set train.compile=false
    python lab/train_throughput.py --case "eager train.compile=false" --case default --profile default
    python -m torch.distributed.run --standalone --nproc-per-node=8 lab/train_throughput.py --parallel fsdp

Peer figure (speculators 0.9.0's Eagle3DraftModel, vllm-project/speculators src/speculators/models/eagle3/core.py,
with its own compiled step on Llama-3.1-8B drafter shapes and random inputs, one H200, torch 2.11, T=4096, full
causal, mean of 20 steps after 5 warm-up steps): ttt 7 168.4 ms,
24,326 tokens/s, 20.9 GiB; ttt 3 78.5 ms, 52,146 tokens/s. Its step does 61.0 / 27.2 TFLOP (frozen
lm_head, fc once); ours trains lm_head and applies the target lm_head in the step: 72.8 / 34.4 TFLOP.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch._dynamo
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python lab/train_throughput.py` imports lab.shapes

from eagle3.config import RunConfig, apply_overrides, validate_config  # noqa: E402
from eagle3.drafter.model import DrafterDims  # noqa: E402
from eagle3.drafter.ttt import TTTBatch, TTTObjective, metrics_from_counts  # noqa: E402
from eagle3.train.build import build_optimizer, build_scheduler, ttt_objective  # noqa: E402
from eagle3.train.dist import DistInfo, init_distributed, shutdown, wrap  # noqa: E402
from eagle3.train.metrics import drafter_row_flops, peak_flops  # noqa: E402
from eagle3.train.step import step_options_for, ttt_update  # noqa: E402
from lab.shapes import random_drafter  # noqa: E402

LLAMA31_8B = DrafterDims(
    hidden_size=4096,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=14336,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_scaling=None,
    vocab_size=128256,
    draft_vocab_size=32000,
    num_aux=3,
    target_hidden_size=4096,
    max_position_embeddings=8192,
)
PEER_TFLOP = {7: 61.0, 3: 27.2}
"""TFLOP per step of the peer's run at T=4096 (its own count: frozen lm_head, fc once, no target lm_head)."""
PLAIN = ["train.compile=false", "train.loss_chunk_tokens=0", "train.reuse_block_mask=false"]
AB_CASES = [
    ("default", []),
    ("mask_reuse", ["train.reuse_block_mask=true"]),
    ("no_compile", ["train.compile=false"]),
    ("no_fused_loss", ["train.loss_chunk_tokens=0"]),
    ("plain", PLAIN),
    ("default_ttt3", ["drafter.ttt_steps=3"]),
]
"""--ab: the defaults (compiled step, fused loss, one flex mask per step), each switch flipped alone, all off
(rows' loss0/grad_norm0 must agree), then ttt 3 with the defaults."""
HEADER = (
    "| case | ttt | T | step ms | tokens/s | peak GiB | TFLOP/step | MFU | tok/s at peer work | loss0 | "
    "grad_norm0 | warmup s | graph breaks | overrides |"
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--ttt-steps",
        type=int,
        nargs="+",
        default=[7],
        help="TTT unroll lengths (cases that do not set drafter.ttt_steps run once per value)",
    )
    p.add_argument("--seq-len", type=int, default=4096, help="tokens of the packed row of each GPU")
    p.add_argument("--parallel", choices=("ddp", "fsdp"), default="ddp", help="wrapper under torchrun")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps (compilation happens here)")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--frozen-lm-head", action="store_true", help="freeze the draft lm_head (the peer's setting)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override for every case, e.g. --set train.compile=false (repeatable)",
    )
    p.add_argument(
        "--case",
        dest="cases",
        action="append",
        default=[],
        metavar="'NAME [KEY=VALUE ...]'",
        help="a named case with its own overrides (repeatable); default: one case 'default'",
    )
    p.add_argument("--ab", action="store_true", help="run the A/B cases of the step's switches (AB_CASES)")
    p.add_argument("--time-budget-s", type=float, default=None, help="skip the cases left once this much has passed")
    p.add_argument(
        "--profile",
        nargs="*",
        default=None,
        metavar="CASE",
        help="after the named cases (all when none is named), the top CUDA ops of two profiled steps",
    )
    return p


def case_list(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    """(name, overrides) of every case to run, --set first, the case's own after (they win)."""
    cases = list(AB_CASES) if args.ab else []
    for spec in args.cases:
        name, *overrides = spec.split()
        cases.append((name, overrides))
    cases = cases or [("default", [])]
    out = []
    for name, overrides in cases:
        sets_ttt = any(o.startswith("drafter.ttt_steps=") for o in overrides)
        for ttt in [None] if sets_ttt else args.ttt_steps:
            ttt_set = [] if ttt is None else [f"drafter.ttt_steps={ttt}"]
            out.append((name, [*ttt_set, *args.overrides, *overrides]))
    return out


def build(cfg: RunConfig, frozen_lm_head: bool, info: DistInfo) -> TTTObjective:
    """The trainer's objective (eagle3.train.build.ttt_objective) over a random drafter and a random frozen target
    lm_head, allocated on the device."""
    gen = torch.Generator(device=info.device).manual_seed(0)  # every random tensor from it: cases share one init
    drafter, t2d, d2t = random_drafter(LLAMA31_8B, info.device, gen)
    target_lm_head = (
        torch.randn(
            LLAMA31_8B.vocab_size, LLAMA31_8B.hidden_size, generator=gen, dtype=torch.bfloat16, device=info.device
        )
        * 0.02
    )
    drafter.lm_head.weight.requires_grad_(not frozen_lm_head)
    return ttt_objective(cfg, drafter, t2d, d2t, target_lm_head, step_options_for(cfg.train, info.device))


def random_batch(dims: DrafterDims, seq_len: int, device: torch.device) -> TTTBatch:
    """One packed row of random features: a single document, 80% of tokens supervised."""
    gen = torch.Generator(device=device).manual_seed(1)
    kw: dict[str, Any] = {"device": device, "generator": gen}
    return TTTBatch(
        aux=torch.randn(1, seq_len, dims.num_aux * dims.target_hidden_size, dtype=torch.bfloat16, **kw),
        input_ids=torch.randint(0, dims.vocab_size, (1, seq_len), **kw),
        loss_mask=(torch.rand(1, seq_len, **kw) < 0.8).to(torch.uint8),
        document_ids=torch.zeros(1, seq_len, dtype=torch.long, device=device),
        position_ids=torch.arange(seq_len, device=device)[None],
        final_hidden=torch.randn(1, seq_len, dims.hidden_size, dtype=torch.bfloat16, **kw) * 3,
    )


def one_step(
    model: nn.Module, optimizer: Any, scheduler: Any, batch: TTTBatch, info: DistInfo
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The trainer's optimizer step on one row (grad clip 1.0, as the peer): (metric sums, counts, grad norm)."""
    sums, counts, grad_norm, _ = ttt_update(model, [batch], optimizer, scheduler, 1.0, info)
    return sums, counts, grad_norm


def measure(cfg: RunConfig, args: argparse.Namespace, info: DistInfo, profiled: bool) -> dict[str, Any]:
    """Warm up (the first step's loss and grad norm recorded), then time ``args.steps`` steps."""
    model = wrap(build(cfg, args.frozen_lm_head, info), args.parallel, info)
    optimizer = build_optimizer(cfg, model, 1e-4, info.device)
    scheduler = build_scheduler(cfg, optimizer, args.warmup + args.steps + 4)
    batch = random_batch(LLAMA31_8B, args.seq_len, info.device)
    breaks_before = _graph_breaks()
    start = time.perf_counter()
    sums, counts, grad_norm0 = one_step(model, optimizer, scheduler, batch, info)
    loss0 = metrics_from_counts(sums[0], counts, sums[1], sums[2], sums[3])["loss"]
    for _ in range(args.warmup - 1):
        one_step(model, optimizer, scheduler, batch, info)
    torch.cuda.synchronize()
    warmup_s = time.perf_counter() - start
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(args.steps):
        one_step(model, optimizer, scheduler, batch, info)
    torch.cuda.synchronize()
    result = {
        "step_s": (time.perf_counter() - start) / args.steps,
        "warmup_s": warmup_s,
        "loss0": loss0,
        "grad_norm0": grad_norm0,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "graph_breaks": _graph_breaks() - breaks_before,
    }
    if profiled:
        result["profile"] = profile(model, optimizer, scheduler, batch, info)
    return result


def _graph_breaks() -> int:
    from torch._dynamo.utils import counters

    return int(sum(counters["graph_break"].values()))


def profile(model: nn.Module, optimizer: Any, scheduler: Any, batch: TTTBatch, info: DistInfo) -> str:
    """torch.profiler over two steps: the 15 ops with the most self CUDA time, and the GPU's busy share."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    start = time.perf_counter()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            one_step(model, optimizer, scheduler, batch, info)
        torch.cuda.synchronize()
    wall_us = (time.perf_counter() - start) * 1e6
    events = prof.key_averages()
    key = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
    busy_us = sum(getattr(e, key) for e in events)
    table = events.table(sort_by=key, row_limit=15)
    return f"{table}\nGPU busy (kernel time / wall, profiler on): {busy_us / wall_us:.1%}"


def table_row(
    name: str, cfg: RunConfig, overrides: list[str], args: argparse.Namespace, result: dict[str, Any], info: DistInfo
) -> str:
    """One markdown row: the numbers of one case (HEADER names the columns)."""
    ttt = cfg.drafter.ttt_steps
    flops = drafter_row_flops(LLAMA31_8B, args.seq_len, ttt)
    lm_head_wgrad = args.seq_len * ttt * 2 * LLAMA31_8B.hidden_size * LLAMA31_8B.draft_vocab_size
    if args.frozen_lm_head:  # no weight gradient for lm_head: 2x instead of 3x its forward
        flops["total"] -= lm_head_wgrad
    peer_work = flops["total"] - flops["supervision"] - (0 if args.frozen_lm_head else lm_head_wgrad)
    step_s = result["step_s"]
    tokens_per_s = args.seq_len * info.world_size / step_s
    mfu = flops["total"] / step_s / (peak_flops(info.device) or 989e12)
    cells = [
        f"{name}{'_frozen_lm_head' if args.frozen_lm_head else ''}",
        ttt,
        args.seq_len,
        f"{step_s * 1e3:.1f}",
        f"{tokens_per_s:,.0f}",
        f"{result['peak_gib']:.1f}",
        f"{flops['total'] / 1e12:.2f}",
        f"{mfu:.3f}",
        f"{tokens_per_s * flops['total'] / peer_work:,.0f}",
        f"{result['loss0']:.5f}",
        f"{result['grad_norm0']:.5f}",
        f"{result['warmup_s']:.1f}",
        result["graph_breaks"],
        " ".join(overrides) or "-",
    ]
    return "| " + " | ".join(str(c) for c in cells) + " |"


def run_case(name: str, overrides: list[str], args: argparse.Namespace, info: DistInfo) -> str:
    """Measure one case; a failure becomes its row (the next case still runs)."""
    try:
        cfg = validate_config(apply_overrides({}, overrides), f"case {name}")
        result = measure(cfg, args, info, args.profile is not None and (not args.profile or name in args.profile))
        row = table_row(name, cfg, overrides, args, result, info)
        if "profile" in result and info.is_main:
            print(f"\nprofile of case {name} ({' '.join(overrides) or 'defaults'}):\n{result['profile']}\n", flush=True)
    except Exception as exc:  # noqa: BLE001 - a broken path must not hide the other cases
        message = " ".join(str(exc).split())[:300]  # one line, whatever the error says
        row = f"| {name} | FAILED: {type(exc).__name__}: {message} | {' '.join(overrides) or '-'} |"
        torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()
    return row


def main() -> None:
    args = _parser().parse_args()
    info = init_distributed("cuda")
    torch.backends.cuda.matmul.allow_tf32 = True
    for name in ("recompile_limit", "cache_size_limit"):  # every case adds its own compiled variants
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    rows, start = [], time.perf_counter()
    try:
        if info.is_main:
            print(
                f"device: {torch.cuda.get_device_name(info.device)} x{info.world_size}, torch {torch.__version__}, "
                f"{args.warmup} warm-up + {args.steps} timed steps per case\n{HEADER}\n{_rule()}",
                flush=True,
            )
        for name, overrides in case_list(args):
            if args.time_budget_s is not None and time.perf_counter() - start > args.time_budget_s:
                rows.append(
                    f"| {name} | skipped: time budget of {args.time_budget_s:.0f} s spent | "
                    f"{' '.join(overrides) or '-'} |"
                )
            else:
                rows.append(run_case(name, overrides, args, info))
            if info.is_main:
                print(rows[-1], flush=True)
        if info.is_main:
            print("\nall cases:\n" + "\n".join([HEADER, _rule(), *rows]), flush=True)
    finally:
        shutdown(info)


def _rule() -> str:
    return "|" + "---|" * HEADER.count(" | ") + "---|"


if __name__ == "__main__":
    main()
