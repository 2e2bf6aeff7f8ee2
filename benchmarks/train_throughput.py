"""Training throughput of the drafter step with Llama-3.1-8B shapes, on random features built on the device.

The timed step is the trainer's own (eagle3.train.loop: supervise -> backward_rows -> optimizer_step):
target supervision from final hidden states through a frozen bf16 target lm_head, the TTT unroll with
flex attention, the soft cross-entropy, AdamW (fused) on fp32 master weights under bf16 autocast, grad
clipping. One packed row of --seq-len tokens per step and GPU. No files are read.

Prints ``name: value`` lines: step_ms, tokens_per_s (all GPUs), peak_memory_gib, flops_per_step and the
formula (eagle3.train.metrics), mfu against 989 TFLOP/s dense bf16, and the same at the peer's work
(speculators 0.9.0: frozen lm_head, no target lm_head in the step, see --frozen-lm-head).

    python benchmarks/train_throughput.py --ttt-steps 7 3
    python benchmarks/train_throughput.py --ttt-steps 7 --frozen-lm-head --profile
    python -m torch.distributed.run --standalone --nproc-per-node=8 benchmarks/train_throughput.py --parallel fsdp

Peer reference (reference/eagle3-training.md, appendix; H200, T=4096, full causal): ttt 7 168.4 ms,
24,326 tokens/s, 20.9 GiB; ttt 3 78.5 ms, 52,146 tokens/s. Its step does 61.0 / 27.2 TFLOP (frozen
lm_head, fc once); ours trains lm_head and applies the target lm_head in the step: 72.8 / 34.4 TFLOP.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
from torch import nn

from eagle3.config import RunConfig
from eagle3.model import DrafterDims, Eagle3Drafter, resolve_attn_impl
from eagle3.train.build import TrainObjective, build_optimizer, build_scheduler
from eagle3.train.dist import DistInfo, init_distributed, shutdown, wrap
from eagle3.train.loop import backward_rows, optimizer_step, supervise
from eagle3.train.metrics import drafter_row_flops, peak_flops
from eagle3.ttt import TTTBatch

LLAMA31_8B = DrafterDims(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         intermediate_size=14336, rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=None,
                         vocab_size=128256, draft_vocab_size=32000, num_aux=3, target_hidden_size=4096,
                         max_position_embeddings=8192)
PEER_TFLOP = {7: 61.0, 3: 27.2}
"""TFLOP per step of the peer's run at T=4096 (its own count: frozen lm_head, fc once, no target lm_head)."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ttt-steps", type=int, nargs="+", default=[7, 3], help="TTT unroll lengths to measure")
    p.add_argument("--seq-len", type=int, default=4096, help="tokens of the packed row of each GPU")
    p.add_argument("--parallel", choices=("ddp", "fsdp"), default="ddp", help="wrapper under torchrun")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps (flex attention compiles here)")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--frozen-lm-head", action="store_true", help="freeze the draft lm_head (the peer's setting)")
    p.add_argument("--profile", action="store_true", help="print the top-10 CUDA ops of two steps")
    return p


def build(dims: DrafterDims, ttt_steps: int, frozen_lm_head: bool, info: DistInfo) -> TrainObjective:
    """Drafter and frozen tensors allocated on the device with random values (no CPU init of 1B numbers)."""
    gen = torch.Generator(device=info.device).manual_seed(0)
    with torch.device(info.device):
        drafter = Eagle3Drafter(dims)
        for module in drafter.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02, generator=gen)
        target_lm_head = torch.randn(dims.vocab_size, dims.hidden_size, generator=gen, dtype=torch.bfloat16) * 0.02
        used = torch.randperm(dims.vocab_size, generator=gen)[: dims.draft_vocab_size].sort().values
        t2d = torch.zeros(dims.vocab_size, dtype=torch.bool)
        t2d[used] = True
        d2t = used - torch.arange(dims.draft_vocab_size)
    drafter.lm_head.weight.requires_grad_(not frozen_lm_head)
    return TrainObjective(drafter, t2d, d2t, target_lm_head, ttt_steps, attn_impl="auto")


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


def one_step(model: nn.Module, optimizer: Any, scheduler: Any, batch: TTTBatch, info: DistInfo) -> None:
    """The trainer's optimizer step on one row (grad clip 1.0, as the peer)."""
    from eagle3.train.dist import unwrap

    sups, counts = supervise(unwrap(model), [batch], info)
    backward_rows(model, [batch], sups, counts, info)
    optimizer_step(model, optimizer, scheduler, grad_clip=1.0)


def measure(args: argparse.Namespace, ttt_steps: int, info: DistInfo) -> dict[str, float]:
    """Warm up, then time ``args.steps`` steps between two synchronizations."""
    objective = build(LLAMA31_8B, ttt_steps, args.frozen_lm_head, info)
    model = wrap(objective, args.parallel, info)
    cfg = RunConfig()
    optimizer = build_optimizer(cfg, model, 1e-4, info.device)
    scheduler = build_scheduler(cfg, optimizer, args.warmup + args.steps + 4)
    batch = random_batch(LLAMA31_8B, args.seq_len, info.device)
    start = time.perf_counter()
    for _ in range(args.warmup):
        one_step(model, optimizer, scheduler, batch, info)
    torch.cuda.synchronize()
    warmup_s = time.perf_counter() - start
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(args.steps):
        one_step(model, optimizer, scheduler, batch, info)
    torch.cuda.synchronize()
    step_s = (time.perf_counter() - start) / args.steps
    if args.profile:
        profile(model, optimizer, scheduler, batch, info)
    return {"step_s": step_s, "warmup_s": warmup_s, "peak_gib": torch.cuda.max_memory_allocated() / 2**30}


def profile(model: nn.Module, optimizer: Any, scheduler: Any, batch: TTTBatch, info: DistInfo) -> None:
    """torch.profiler over two steps: the 10 ops with the most CUDA time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            one_step(model, optimizer, scheduler, batch, info)
        torch.cuda.synchronize()
    if info.is_main:
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=10))


def report(args: argparse.Namespace, ttt_steps: int, result: dict[str, float], info: DistInfo) -> None:
    """The ``name: value`` lines of one measurement."""
    flops = drafter_row_flops(LLAMA31_8B, args.seq_len, ttt_steps)
    lm_head_wgrad = args.seq_len * ttt_steps * 2 * LLAMA31_8B.hidden_size * LLAMA31_8B.draft_vocab_size
    if args.frozen_lm_head:  # no weight gradient for lm_head: 2x instead of 3x its forward
        flops["total"] -= lm_head_wgrad
    peer_work = flops["total"] - flops["supervision"] - (0 if args.frozen_lm_head else lm_head_wgrad)
    peak = peak_flops(info.device) or 989e12
    step_s = result["step_s"]
    tokens_per_s = args.seq_len * info.world_size / step_s
    lines = {
        "name": f"ttt{ttt_steps}_T{args.seq_len}_{args.parallel}_x{info.world_size}"
                + ("_frozen_lm_head" if args.frozen_lm_head else ""),
        "attn_impl": resolve_attn_impl("auto", info.device),
        "step_ms": f"{step_s * 1e3:.1f}",
        "tokens_per_s": f"{tokens_per_s:,.0f}",
        "peak_memory_gib": f"{result['peak_gib']:.1f}",
        "warmup_s": f"{result['warmup_s']:.1f}",
        "flops_per_step_tflop": f"{flops['total'] / 1e12:.2f}",
        "flops_formula": "3 x (linear_fwd + attention_fwd) + supervision (eagle3/train/metrics.py docstring)",
        "flops_parts_tflop": ", ".join(f"{k} {v / 1e12:.2f}" for k, v in flops.items()),
        "mfu": f"{flops['total'] / step_s / peak:.3f}",
        "peer_work_tflop": f"{peer_work / 1e12:.2f} (frozen lm_head, no target lm_head; peer counted "
                           f"{PEER_TFLOP.get(ttt_steps, float('nan'))})",
        "tokens_per_s_at_peer_work": f"{tokens_per_s * flops['total'] / peer_work:,.0f} "
                                     "(same efficiency, the peer's FLOPs per token)",
    }
    if info.is_main:
        for key, value in lines.items():
            print(f"{key}: {value}", flush=True)
        print(flush=True)


def main() -> None:
    args = _parser().parse_args()
    info = init_distributed("cuda")
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        if info.is_main:
            print(f"device: {torch.cuda.get_device_name(info.device)} x{info.world_size}, torch {torch.__version__}")
        for ttt_steps in args.ttt_steps:
            report(args, ttt_steps, measure(args, ttt_steps, info), info)
            torch.cuda.empty_cache()
    finally:
        shutdown(info)


if __name__ == "__main__":
    main()
