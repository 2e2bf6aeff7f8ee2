"""The online target's forwards, replicated on every rank or FSDP2-sharded across them (train.target_sharding).

Run under torchrun, once per mode; each rank builds the same random-weight target (seeded, on the host), then
either moves it whole to its GPU (replicate) or shards it with ``eagle3.train.target_shard.shard_target``
(fsdp), and fills the states of its packed rows exactly as online training does
(``HFCaptureBackend.device_states`` / ``ShardedCaptureBackend.device_states``, collective-safe forward counts).
Rows of --seq-len tokens are packed from random documents (64..1023 tokens), dealt to the ranks as the trainer
deals them. Printed by rank 0 after --warmup untimed rows: target tokens/s over all ranks, the largest peak GPU
memory of any rank, and the forward batches run (real and dummy, summed over the ranks).

    torchrun --nproc-per-node 8 lab/online_sharded.py --target llama8b --sharding fsdp
    torchrun --nproc-per-node 8 lab/online_sharded.py --target llama8b --sharding replicate
    torchrun --nproc-per-node 2 lab/online_sharded.py --device cpu --num-layers 2 --seq-len 512 --rows 4
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from eagle3.features.hf_backend import HFCaptureBackend
from eagle3.features.spec import SampleTokens
from eagle3.train.data import pack
from eagle3.train.dist import init_distributed, shutdown
from eagle3.train.target_shard import ShardedCaptureBackend, shard_target

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file (python lab/x.py): `lab` importable
from lab.shapes import LLAMA31_8B, SMOLLM2_135M  # noqa: E402

SHAPES = {"smollm2": SMOLLM2_135M, "llama8b": LLAMA31_8B}


def build_target(shape: dict, layers: int | None, dtype: torch.dtype):
    """The same random target on every rank (seeded), on the host."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**{**shape, "num_hidden_layers": layers or shape["num_hidden_layers"]})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=dtype).eval().requires_grad_(False)


def rows_of(args: argparse.Namespace, vocab: int, rank: int, world: int) -> list[list[SampleTokens]]:
    """This rank's packed rows (rows rank, rank + W, ... of the plan, as the trainer deals them)."""
    gen = np.random.default_rng(0)
    docs: list[SampleTokens] = []
    while sum(len(d.input_ids) for d in docs) < args.rows * args.seq_len * world:
        n = int(gen.integers(64, 1024))
        docs.append(SampleTokens(f"doc{len(docs)}", gen.integers(0, vocab, n).tolist(), [1] * n))
    by_id = {d.id: d for d in docs}
    rows, _ = pack([(d.id, len(d.input_ids)) for d in docs], args.seq_len)
    mine = rows[: args.rows * world][rank::world]
    return [
        [
            SampleTokens(r.sample_id, by_id[r.sample_id].input_ids[: r.num_tokens], [1] * r.num_tokens)
            for r in row.samples
        ]
        for row in mine
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", choices=sorted(SHAPES), default="llama8b")
    p.add_argument("--sharding", choices=["replicate", "fsdp"], default="fsdp")
    p.add_argument("--num-layers", type=int, default=None, help="target decoder layers (default: the real count)")
    p.add_argument("--seq-len", type=int, default=4096, help="tokens per packed row (train.tokens_per_row)")
    p.add_argument("--rows", type=int, default=16, help="timed + warm-up rows per rank")
    p.add_argument("--warmup", type=int, default=2, help="untimed rows per rank")
    p.add_argument("--tokens-per-forward", default="auto", help="capture.tokens_per_forward")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    args = p.parse_args()
    info = init_distributed(args.device)
    if not info.initialized:
        raise SystemExit("run under torchrun (a process group is needed)")
    cuda = info.device.type == "cuda"
    shape = SHAPES[args.target]
    model = build_target(shape, args.num_layers, torch.bfloat16 if cuda else torch.float32)
    layers = model.config.num_hidden_layers
    aux = [1, layers // 2 - 1, layers - 4] if layers >= 8 else [0, layers - 1]
    budget = args.tokens_per_forward if args.tokens_per_forward == "auto" else int(args.tokens_per_forward)
    if args.sharding == "fsdp":
        backend = ShardedCaptureBackend(
            None, aux, model=shard_target(model), device=str(info.device), tokens_per_forward=budget
        )
    else:
        backend = HFCaptureBackend(
            None, aux, model=model.to(info.device), device=str(info.device), tokens_per_forward=budget
        )
    rows = rows_of(args, shape["vocab_size"], info.rank, info.world_size)
    tokens, counts, start = 0, [], time.perf_counter()
    with torch.no_grad():
        for i, row in enumerate(rows):
            if i == args.warmup:
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                dist.barrier()
                tokens, counts, start = 0, [], time.perf_counter()
            backend.device_states(row)
            tokens += sum(len(d.input_ids) for d in row)
            counts.append(len(backend.online_batches(row)[1]))  # this rank's real forward batches of the row
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    stats = torch.tensor([tokens], dtype=torch.float64, device=info.device)
    dist.all_reduce(stats)
    gathered = [None] * info.world_size
    dist.all_gather_object(gathered, (peak, counts))
    if info.is_main:
        name = torch.cuda.get_device_name() if cuda else "cpu"
        per_row = list(zip(*[c for _, c in gathered]))  # [rows][ranks] real forward batches
        real = sum(map(sum, per_row))
        dummy = sum(len(r) * max(r) - sum(r) for r in per_row) if args.sharding == "fsdp" else 0
        print(
            f"device: {name} x{info.world_size}, torch {torch.__version__}; target random-{args.target} ({layers} "
            f"layers), sharding {args.sharding}, forward batch budget {backend.tokens_per_forward} tokens"
        )
        print(
            f"summary: sharding={args.sharding} target_tok_s={float(stats[0]) / seconds:,.0f} "
            f"peak_gib_max_rank={max(p for p, _ in gathered):.2f} forward_batches={real} dummy_batches={dummy} "
            f"rows_per_rank={len(per_row)} seconds={seconds:.2f}",
            flush=True,
        )
    shutdown(info)


if __name__ == "__main__":
    main()
