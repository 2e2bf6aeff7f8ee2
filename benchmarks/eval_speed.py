"""Decode speed of the offline evaluation at batch 1: the eager runners against the static-cache, compiled ones.

    python benchmarks/eval_speed.py                  # on a GPU host: SmolLM2-135M-shaped random target
    python benchmarks/eval_speed.py --tiny           # CPU smoke run: a tiny random target, uncompiled static path
    python benchmarks/eval_speed.py --capacity 1408 --prompt-len 300 --dtype bfloat16 --profile   # as the evaluation

Builds a random Llama with SmolLM2-135M's shape (hidden 576, 30 layers, 9 heads, 3 key/value heads, MLP 1536,
vocab 49152, tied embeddings; nothing is downloaded) and a random EAGLE-3 drafter of matching dims. Random
weights accept almost no draft, so the chain and tree rounds are also timed with an oracle: the drafter runs
as usual (its cost is measured) but its tokens are replaced by the greedy reference's next tokens, so verify
accepts them and the accepted-row paths (drafter extends, tree row moves) run. Prints ``name: value`` lines:
the compile time of each forward width, greedy tok/s of both paths, ms per verify round per method, and how
many outputs are token-identical to the eager greedy reference (lossless check). Needs torch, transformers,
pydantic and pyyaml only.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3.evaluate.decode_cache import CompileSettings, StaticDrafterRunner, StaticTargetRunner  # noqa: E402
from eagle3.drafter.model import DrafterDims, Eagle3Drafter, init_weights  # noqa: E402
from eagle3.evaluate.runners import DrafterRunner, TargetRunner  # noqa: E402
from eagle3.evaluate.speculate import (DecodeResult, DraftTree, EagleProposer, NgramProposer, check_lossless,  # noqa: E402
                              greedy_decode, speculative_decode)

SMOLLM2 = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
               intermediate_size=1536, vocab_size=49152, rope_theta=100000.0, rms_norm_eps=1e-5)
TINY = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=512, rope_theta=10000.0, rms_norm_eps=1e-5)


def build(shape: dict, device: str, dtype: torch.dtype, draft_vocab: int) -> tuple:
    """(random Llama target, random drafter of its dims, d2t, aux layer ids)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**shape, tie_word_embeddings=True, max_position_embeddings=8192, attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).to(device, dtype).eval()
    layers = shape["num_hidden_layers"]
    aux = [1, layers // 2 - 1, layers - 4]  # the project's default aux layers
    heads = shape["num_attention_heads"]
    dims = DrafterDims(hidden_size=shape["hidden_size"], num_attention_heads=heads,
                       num_key_value_heads=shape["num_key_value_heads"], head_dim=shape["hidden_size"] // heads,
                       intermediate_size=shape["intermediate_size"], rms_norm_eps=shape["rms_norm_eps"],
                       rope_theta=shape["rope_theta"], rope_scaling=None, vocab_size=shape["vocab_size"],
                       draft_vocab_size=draft_vocab, num_aux=len(aux), target_hidden_size=shape["hidden_size"])
    drafter = Eagle3Drafter(dims)
    init_weights(drafter)
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(model.get_input_embeddings().weight)
    return model, drafter.to(device, dtype).eval(), torch.zeros(draft_vocab, dtype=torch.long), aux


class OracleProposer:
    """Test double for timing: runs the real drafter, then puts the greedy reference's next tokens on its chain
    (or on the tree's deepest branch), so verify accepts them."""

    def __init__(self, inner: EagleProposer, full: list[int]) -> None:
        self.inner, self.full = inner, full

    def reset(self) -> None:
        self.inner.reset()

    def observe(self, aux, next_tokens, start) -> None:
        self.inner.observe(aux, next_tokens, start)

    def propose(self, context: list[int]) -> DraftTree:
        tree = self.inner.propose(context)
        tokens, depths = list(tree.tokens), tree.depths()
        node = max(range(len(tokens)), key=lambda i: (depths[i], -i))
        while node >= 0:  # the deepest branch, from its leaf up
            ahead = len(context) + depths[node] - 1
            tokens[node] = self.full[ahead] if ahead < len(self.full) else tokens[node]
            node = tree.parents[node]
        return DraftTree(tokens, tree.parents)


def timed(fn, repeats: int) -> tuple[float, object]:
    """(best wall seconds over ``repeats`` calls, last result)."""
    best, out = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def warm_widths(target: StaticTargetRunner, runner: StaticDrafterRunner, widths: list[int]) -> None:
    """Compile each width of the target and drafter forwards, printing the first-call seconds of each."""
    dims = runner.drafter.dims
    for width in widths:
        for name, call in (("target", lambda: target.step(torch.zeros(width, dtype=torch.long, device=target.device))),
                           ("drafter", lambda: runner.extend(
                               torch.zeros(width, dims.num_aux * dims.target_hidden_size, device=runner.device),
                               torch.zeros(width, dtype=torch.long, device=runner.device), 0))):
            start = time.perf_counter()
            for _ in range(2):  # the first call compiles, the second records the CUDA graph
                target.reset()
                runner.reset()
                call()
            if target.device.type == "cuda":
                torch.cuda.synchronize()
            print(f"warmup_{name}_width_{width}_s: {time.perf_counter() - start:.1f}", flush=True)
    target.reset()
    runner.reset()


def profile_decode(name: str, decode, device: str, rows: int = 15) -> None:
    """torch.profiler over one decode: the ops that take the most host time, and (on CUDA) the most device time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        out = decode()
        if device == "cuda":
            torch.cuda.synchronize()
    table = prof.key_averages()
    print(f"profile {name}: {len(out.steps)} rounds, {len(out.tokens)} tokens; top ops by host time")
    print(table.table(sort_by="self_cpu_time_total", row_limit=rows))
    if device == "cuda":
        print(f"profile {name}: top ops by device time")
        print(table.table(sort_by="self_cuda_time_total", row_limit=rows))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny target on CPU (a smoke run of this script)")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens generated per decode")
    parser.add_argument("--prompt-len", type=int, default=8, help="prompt tokens (a repeated 4-token phrase)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per figure (best is printed)")
    parser.add_argument("--widths", default="1,4,8", help="forward widths compiled before timing (eval adds 64)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="target and drafter dtype (the evaluation's evaluate.dtype; it defaults to float32)")
    parser.add_argument("--capacity", type=int, default=None,
                        help="static cache entries (default prompt + new tokens + 128; the evaluation sizes it for "
                             "its longest prompt, e.g. ~1,400 for the 160 prompts of smollm2-quality)")
    parser.add_argument("--profile", action="store_true",
                        help="after timing, print torch.profiler tables (host and device time per op) of one "
                             "chain-3-oracle and one tree-5-4-8-oracle decode: where a round's time goes")
    args = parser.parse_args(argv)
    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    model, drafter, d2t, aux_ids = build(TINY if args.tiny else SMOLLM2, device, getattr(torch, args.dtype),
                                         256 if args.tiny else 16384)
    settings = CompileSettings(enabled=device == "cuda", mode="reduce-overhead", fallback=True)
    prompt = ([11, 12, 13, 14] * args.prompt_len)[: args.prompt_len]
    n = args.new_tokens
    capacity = args.capacity or args.prompt_len + n + 128
    print(f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}; torch {torch.__version__}; "
          f"{args.dtype}; static cache {capacity} entries")

    eager = TargetRunner(model, aux_ids)
    greedy_decode(eager, prompt, 4)
    eager_s, reference = timed(lambda: greedy_decode(eager, prompt, n), 1 if device == "cuda" else args.repeats)
    print(f"greedy_eager_tok_s: {n / eager_s:.1f}")

    target = StaticTargetRunner(model, aux_ids, capacity=capacity, compile_settings=settings)
    runner = StaticDrafterRunner(drafter, d2t, capacity=capacity, compile_settings=settings)
    start = time.perf_counter()
    warm_widths(target, runner, [int(w) for w in args.widths.split(",")])
    print(f"warmup_total_s: {time.perf_counter() - start:.1f}")
    static_s, static_ref = timed(lambda: greedy_decode(target, prompt, n), args.repeats)
    print(f"greedy_static_tok_s: {n / static_s:.1f}")
    print(f"greedy_static_speedup: {eager_s / static_s:.2f}")

    full = [*prompt, *reference.tokens]
    methods = {
        "chain-3": lambda: EagleProposer(drafter, d2t, 3, runner=runner),
        "chain-3-oracle": lambda: OracleProposer(EagleProposer(drafter, d2t, 3, runner=runner), full),
        "tree-5-4-8": lambda: EagleProposer(drafter, d2t, 5, 4, 8, runner=runner),
        "tree-5-4-8-oracle": lambda: OracleProposer(EagleProposer(drafter, d2t, 5, 4, 8, runner=runner), full),
        "ngram": NgramProposer,
    }
    results: list[tuple[str, DecodeResult]] = [("greedy-static", static_ref)]
    for name, make in methods.items():
        proposer = make()
        speculative_decode(target, proposer, prompt, 8)  # warm the python paths
        wall, out = timed(lambda: speculative_decode(target, proposer, prompt, n), args.repeats)
        rounds = max(len(out.steps), 1)
        print(f"{name}_round_ms: {1000 * wall / rounds:.2f}  (accept_len {out.accept_len:.2f}, "
              f"{len(out.tokens) / wall:.1f} tok/s)")
        results.append((name, out))
    eager_runner = DrafterRunner(drafter, d2t)
    wall, out = timed(lambda: speculative_decode(eager, OracleProposer(EagleProposer(drafter, d2t, 3,
                                                                                     runner=eager_runner), full),
                                                 prompt, n), 1)
    print(f"chain-3-oracle_eager_round_ms: {1000 * wall / max(len(out.steps), 1):.2f}")
    results.append(("chain-3-oracle-eager", out))
    kinds = [check_lossless(reference, out.tokens, 1e-3).kind for _, out in results]
    print(f"lossless_identical: {kinds.count('identical')} of {len(kinds)} (near_tie {kinds.count('near_tie')}, "
          f"mismatch {kinds.count('mismatch')}; outputs vs the eager greedy reference)")
    if args.profile:
        for name in ("chain-3-oracle", "tree-5-4-8-oracle"):
            profile_decode(name, lambda: speculative_decode(target, methods[name](), prompt, n), device)
    if device == "cuda":
        from torch._dynamo.utils import counters

        print(f"cudagraph_skips: {dict(counters['inductor'].get('cudagraph_skips', {})) or 0}"
              f"  (target compiled {target.step_fn.compiled}, drafter compiled {runner.step_fn.compiled})")


if __name__ == "__main__":
    main()
