"""DFlash training step time and memory against anchors per row, dense block mask against flex, on one device.

A random one-layer DFlash drafter with SmolLM2-135M's shapes (the target's hidden size, heads and MLP, its 49,152
token vocab as the frozen embeddings and lm_head), three context features, block 16; one packed row of --seq-len
tokens of random features and ids (one document, every token supervised). A step is the objective's forward
(eagle3.drafter.dflash_loss.DFlashObjective: anchors drawn from a seeded generator, the loss in
train.loss_chunk_tokens chunks), backward and a fused AdamW step, under bf16 autocast on CUDA. No files are read.

Each (blocks, kernel) case prints one row: step ms (mean of --steps after --warmup), peak GiB, the first step's
loss, and for flex the ratio of the dense step's time to flex's at the same blocks (> 1: flex faster); the loss
of both kernels at the same blocks must agree to bf16 noise (same seed, same anchors). A case that fails (out of
memory) prints its error and the next one runs.

    python lab/dflash_train_speed.py --blocks 256 1024 4096 --kernels dense flex
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path
from typing import Any, Literal

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python lab/dflash_train_speed.py` imports lab.shapes

from eagle3.drafter.dflash import DFlashDims, DFlashDrafter, init_dflash_weights  # noqa: E402
from eagle3.drafter.dflash_loss import DFlashObjective  # noqa: E402
from eagle3.drafter.ttt import TTTBatch  # noqa: E402
from lab.shapes import SMOLLM2_135M  # noqa: E402

FEATURES = 3
BLOCK = 16
Kernel = Literal["dense", "flex"]


def dims(num_layers: int) -> DFlashDims:
    """SmolLM2-135M's shapes for the drafter (as eagle3.train.dflash.dflash_setup derives them from the target)."""
    s = SMOLLM2_135M
    return DFlashDims(
        hidden_size=s["hidden_size"],
        num_attention_heads=s["num_attention_heads"],
        num_key_value_heads=s["num_key_value_heads"],
        head_dim=s["hidden_size"] // s["num_attention_heads"],
        intermediate_size=s["intermediate_size"],
        num_hidden_layers=num_layers,
        rms_norm_eps=s["rms_norm_eps"],
        rope_theta=s["rope_theta"],
        rope_scaling=None,
        vocab_size=s["vocab_size"],
        num_context_features=FEATURES,
        block_size=BLOCK,
        mask_token_id=0,
        max_position_embeddings=s["max_position_embeddings"],
    )


def build(d: DFlashDims, blocks: int, kernel: Kernel, chunk: int, device: torch.device) -> DFlashObjective:
    drafter = DFlashDrafter(d)
    init_dflash_weights(drafter, seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(torch.randn(drafter.embed_tokens.weight.shape, generator=gen) * 0.05)
        drafter.lm_head.weight.copy_(drafter.embed_tokens.weight)  # tied, as SmolLM2's
    objective = DFlashObjective(drafter, list(range(FEATURES)), FEATURES, blocks, attn_impl=kernel, loss_chunk=chunk)
    return objective.to(device)


def random_row(d: DFlashDims, seq_len: int, device: torch.device) -> TTTBatch:
    gen = torch.Generator().manual_seed(2)
    aux = torch.randn(1, seq_len, FEATURES * d.hidden_size, generator=gen).to(device, torch.bfloat16)
    ids = torch.randint(1, d.vocab_size, (1, seq_len), generator=gen).to(device)
    mask = torch.ones(1, seq_len, dtype=torch.long, device=device)
    docs = torch.zeros(1, seq_len, dtype=torch.long, device=device)
    return TTTBatch(aux=aux, input_ids=ids, loss_mask=mask, document_ids=docs)


def measure(args: argparse.Namespace, blocks: int, kernel: Kernel, device: torch.device) -> dict[str, Any]:
    d = dims(args.layers)
    objective = build(d, blocks, kernel, args.chunk, device)
    optimizer = torch.optim.AdamW(
        [p for p in objective.parameters() if p.requires_grad], lr=1e-4, fused=device.type == "cuda"
    )
    batch = random_row(d, args.seq_len, device)
    anchors = objective.anchors(batch, seed=3)
    losses: list[float] = []

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            out = objective(batch, anchors)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(out.loss.detach()))

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(args.warmup):
        step()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync()
    ms = (time.perf_counter() - start) / args.steps * 1e3
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    return {"ms": ms, "peak_gib": peak, "loss": losses[0]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=16384, help="tokens of the packed row")
    p.add_argument("--blocks", type=int, nargs="+", default=[256, 1024, 4096], help="anchors per row")
    p.add_argument("--kernels", nargs="+", choices=("dense", "flex"), default=["dense", "flex"])
    p.add_argument("--layers", type=int, default=1, help="draft layers")
    p.add_argument("--chunk", type=int, default=4096, help="train.loss_chunk_tokens: slots per lm_head chunk")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps (flex compiles here)")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"# {name}, torch {torch.__version__}, row {args.seq_len} tokens, block {BLOCK}, {args.layers} layer(s)")
    print("| blocks | kernel | step ms | peak GiB | first loss | dense ms / flex ms |")
    print("|---:|---|---:|---:|---:|---:|")
    for blocks in args.blocks:
        dense_ms = None
        for kernel in args.kernels:
            try:
                r = measure(args, blocks, kernel, device)
            except Exception as exc:  # noqa: BLE001 - a case that fails (out of memory) says so; the next runs
                print(f"| {blocks} | {kernel} | failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]} | | | |")
                r = None
            finally:
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            if r is None:
                continue
            dense_ms = r["ms"] if kernel == "dense" else dense_ms
            ratio = f"{dense_ms / r['ms']:.2f}" if kernel == "flex" and dense_ms else ""
            print(
                f"| {blocks} | {kernel} | {r['ms']:.1f} | {r['peak_gib']:.2f} | {r['loss']:.4f} | {ratio} |", flush=True
            )


if __name__ == "__main__":
    main()
