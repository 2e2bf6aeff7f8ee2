"""Decode speed of the offline evaluation at batch 1: the eager runners against the static-cache, compiled ones.

    python lab/eval_speed.py                  # on a GPU host: SmolLM2-135M-shaped random target
    python lab/eval_speed.py --tiny           # CPU smoke run: a tiny random target, uncompiled static path
    python lab/eval_speed.py --capacity 1408 --prompt-len 300 --dtype bfloat16 --profile   # as the evaluation
    python lab/eval_speed.py --compile on     # Inductor's kernels inside the graphs (minutes of warm-up)
    python lab/eval_speed.py --compile on --temperature 1 --only-greedy   # sampled chain rounds, no greedy methods

Builds a random Llama with SmolLM2-135M's shape (hidden 576, 30 layers, 9 heads, 3 key/value heads, MLP 1536,
vocab 49152, tied embeddings; nothing is downloaded) and a random EAGLE-3 drafter of matching dims. Random
weights accept almost no draft, so the chain and tree rounds are also timed with an oracle: the drafter runs
as usual (its cost is measured) but its tokens are replaced by the greedy reference's next tokens, so verify
accepts them and the accepted-row paths (drafter extends, tree row moves) run. Prints ``name: value`` lines:
the warm-up (compile or capture) time of each forward width, greedy tok/s of the eager path, of the static
path at ``--decode-rows`` (what the evaluation's reference runs) and at width 1 (the padding's cost), ms per
target forward, ms per verify round per method, and how many outputs are token-identical to the static greedy
reference (the evaluation's lossless check) and to the eager one. ``--fused``: the static path runs the
target with its MLPs' gate and up products fused (evaluate.fuse_projections). ``--width-1-attention
sdpa,sdpa-math,flex,packed`` times the one-row decode (the evaluation's speed baseline) once per attention, each
checked against the static greedy. Needs torch, transformers,
pydantic and pyyaml only.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path
from typing import cast, get_args

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3.drafter.model import DrafterDims, Eagle3Drafter, init_weights  # noqa: E402
from eagle3.evaluate.fused_projections import fuse_projections  # noqa: E402
from eagle3.evaluate.graphs import CompileSettings, resolve_decode  # noqa: E402
from eagle3.evaluate.proposers import EagleProposer, NgramProposer  # noqa: E402
from eagle3.evaluate.runners import DrafterRunner, TargetRunner  # noqa: E402
from eagle3.evaluate.sampled_decode import sample_decode, sampled_speculative_decode  # noqa: E402
from eagle3.evaluate.sampling import SamplingParams, sampler_for  # noqa: E402
from eagle3.evaluate.speculate import (  # noqa: E402
    DecodeResult,
    DraftTree,
    check_lossless,
    greedy_decode,
    speculative_decode,
)
from eagle3.evaluate.static_attention import MaskedAttention  # noqa: E402
from eagle3.evaluate.static_drafter import StaticDrafterRunner  # noqa: E402
from eagle3.evaluate.static_target import StaticTargetRunner  # noqa: E402
from lab.decode_timing import forward_ms, profile_decode, timed, warm_widths  # noqa: E402

SMOLLM2 = dict(
    hidden_size=576,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    intermediate_size=1536,
    vocab_size=49152,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
)
TINY = dict(
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=512,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
)


def build(shape: dict, device: str, dtype: torch.dtype, draft_vocab: int) -> tuple:
    """(random Llama target, random drafter of its dims, d2t, aux layer ids)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**shape, tie_word_embeddings=True, max_position_embeddings=8192, attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).to(device, dtype).eval()
    layers = shape["num_hidden_layers"]
    aux = [1, layers // 2 - 1, layers - 4]  # the project's default aux layers
    heads = shape["num_attention_heads"]
    dims = DrafterDims(
        hidden_size=shape["hidden_size"],
        num_attention_heads=heads,
        num_key_value_heads=shape["num_key_value_heads"],
        head_dim=shape["hidden_size"] // heads,
        intermediate_size=shape["intermediate_size"],
        rms_norm_eps=shape["rms_norm_eps"],
        rope_theta=shape["rope_theta"],
        rope_scaling=None,
        vocab_size=shape["vocab_size"],
        draft_vocab_size=draft_vocab,
        num_aux=len(aux),
        target_hidden_size=shape["hidden_size"],
    )
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


class WithoutSampledRound:
    """Test double for timing: a static drafter runner without its one-call sampled chain, so
    sampled_decode.sampled_chain drafts step by step through it (the path before that round existed)."""

    def __init__(self, inner: StaticDrafterRunner) -> None:
        self._inner = inner

    def __getattr__(self, name: str):
        if name == "sampled_chain":
            raise AttributeError(name)
        return getattr(self._inner, name)


def sampled_rounds(target, runner, drafter, d2t, prompt: list[int], n: int, temperature: float, repeats: int) -> None:
    """Speculative sampling at ``temperature``: the target's own sampling (the evaluation's reference and baseline
    then), and chain 3 and 7 rounds drafted in one call and step by step (random weights: few drafts accepted, so
    these are round costs)."""
    params = SamplingParams(temperature)
    device = str(target.device)
    sample = lambda: sample_decode(target, prompt, n, [], sampler_for(params, 0, "own", device))  # noqa: E731
    sample()
    wall, own = timed(sample, repeats)
    print(f"sampled_target_tok_s: {len(own.tokens) / wall:.1f}  (temperature {temperature:g})")
    for steps in (3, 7):
        for label, inner in (("", runner), ("_stepwise", WithoutSampledRound(runner))):
            proposer = EagleProposer(drafter, d2t, steps, runner=inner)
            run = lambda proposer=proposer, stream=f"chain-{steps}": sampled_speculative_decode(  # noqa: E731
                target, proposer, prompt, n, [], sampler_for(params, 0, stream, device)
            )
            run()
            wall, out = timed(run, repeats)
            print(
                f"sampled_chain-{steps}{label}_round_ms: {1000 * wall / max(len(out.steps), 1):.2f}  "
                f"(accept_len {out.accept_len:.2f}, {len(out.tokens) / wall:.1f} tok/s)"
            )


# sdpa-BACKEND variants of the one-row decode: torch's scaled_dot_product_attention kernels (on an H100 the default
# dispatch picks cuDNN's, 24 us a layer at one row over a 1,408-entry cache)
SDPA_BACKENDS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "math": SDPBackend.MATH,
}


def one_row_variant(variant: str) -> tuple[MaskedAttention, contextlib.AbstractContextManager[object]]:
    """(the runner's attention, the sdpa kernels allowed while it compiles and captures) of a --width-1-attention
    entry: a MaskedAttention (no restriction), or sdpa-BACKEND or packed-BACKEND (that sdpa kernel only)."""
    attention, _, backend = variant.partition("-")
    if attention in get_args(MaskedAttention) and attention != "sdpa" and not backend:
        return cast(MaskedAttention, attention), contextlib.nullcontext()
    if attention in ("sdpa", "packed") and (not backend or backend in SDPA_BACKENDS):
        return attention, sdpa_kernel([SDPA_BACKENDS[backend]]) if backend else contextlib.nullcontext()
    raise SystemExit(
        f"--width-1-attention {variant}: use {', '.join(get_args(MaskedAttention))}, or sdpa-/packed-"
        f"{{{','.join(SDPA_BACKENDS)}}}"
    )


def one_row(
    model: torch.nn.Module,
    aux_ids: list[int],
    capacity: int,
    settings: CompileSettings,
    variant: str,
    prompt: list[int],
    static_s: float,
    static_ref: DecodeResult,
    args: argparse.Namespace,
    device: str,
) -> None:
    """Time greedy one row a forward with one attention variant; print its rate, forward time and whether it decodes
    the static greedy's tokens (it must: only the kernel differs)."""
    n = args.new_tokens
    attention, kernels = one_row_variant(variant)
    # every call inside the allowance: the kernels are chosen as the runner compiles and captures, and a compiled
    # graph that guards on the allowance would recompile with the default kernels outside it
    with kernels:
        narrow = StaticTargetRunner(
            model, aux_ids, capacity=capacity, compile_settings=settings, decode_rows=1, attention=attention
        )
        greedy_decode(narrow, prompt, 8)
        narrow_s, narrow_out = timed(lambda: greedy_decode(narrow, prompt, n), args.repeats)
        kind = check_lossless(static_ref, narrow_out.tokens, 1e-3).kind
        print(
            f"greedy_width_1_tok_s[{variant}]: {n / narrow_s:.1f}  (the same path one row wide; {args.decode_rows} "
            f"rows run at {narrow_s / static_s:.2f} of its rate; vs the static greedy: {kind})"
        )
        print(f"target_forward_width_1_ms[{variant}]: {forward_ms(narrow, args.prompt_len):.3f}")
        if args.profile:  # the evaluation's one-row speed baseline: where a plain decode step's time goes
            profile_decode(f"greedy-width-1-{variant}", lambda: greedy_decode(narrow, prompt, n), device, steps=False)
    narrow.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny target on CPU (a smoke run of this script)")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens generated per decode")
    parser.add_argument("--prompt-len", type=int, default=8, help="prompt tokens (a repeated 4-token phrase)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per figure (best is printed)")
    parser.add_argument(
        "--compile",
        default="auto",
        choices=("auto", "on", "off"),
        help="evaluate.compile: auto = CUDA graphs of the eager kernels, on = Inductor's kernels",
    )
    parser.add_argument(
        "--decode-rows",
        type=int,
        default=16,
        help="evaluate.decode_rows: rows of every target decode forward (0 = per-size widths)",
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="target and drafter dtype (the evaluation's evaluate.dtype: auto is bfloat16 on cuda)",
    )
    parser.add_argument(
        "--capacity",
        type=int,
        default=None,
        help="static cache entries (default prompt + new tokens + 128; the evaluation sizes it for "
        "its longest prompt, e.g. ~1,400 for the 160 prompts of smollm2-quality)",
    )
    parser.add_argument(
        "--gathered-keys",
        action="store_true",
        help="evaluate.decode_keys=gathered: each row's keys gathered in sequence order",
    )
    parser.add_argument(
        "--fused",
        action="store_true",
        help="static path: the target's MLP gate and up products fused (evaluate.fuse_projections)",
    )
    parser.add_argument(
        "--attention",
        default="sdpa",
        choices=get_args(MaskedAttention),
        help="static path, masked keys: transformers' sdpa (the cache repeated per query head), query heads packed "
        "as rows of their key/value head (through sdpa, or matmul: written out), or flex over the key blocks in use "
        "at one row (MaskedAttention)",
    )
    parser.add_argument(
        "--width-1-attention",
        type=lambda text: text.split(","),
        default=None,
        help="comma list of the one-row decodes to time (default: --attention): sdpa, packed, matmul, flex, or "
        "sdpa-BACKEND / packed-BACKEND (only that sdpa kernel allowed while the runner compiles and captures: "
        + ", ".join(SDPA_BACKENDS)
        + ")",
    )
    parser.add_argument(
        "--only-greedy",
        action="store_true",
        help="time (and with --profile profile) greedy at both widths only: no methods, no eager chain",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="> 0: also time speculative sampling at this temperature (chain rounds in one call and step by step, "
        "against the target's own sampling)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="after timing, print torch.profiler tables (host and device time per op) of one "
        "chain-3-oracle and one tree-5-4-8-oracle decode: where a round's time goes",
    )
    args = parser.parse_args(argv)
    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    model, drafter, d2t, aux_ids = build(
        TINY if args.tiny else SMOLLM2, device, getattr(torch, args.dtype), 256 if args.tiny else 16384
    )
    _, settings = resolve_decode("on", args.compile, device)
    rows = args.decode_rows or None
    prompt = ([11, 12, 13, 14] * args.prompt_len)[: args.prompt_len]
    n = args.new_tokens
    capacity = args.capacity or args.prompt_len + n + 128
    print(
        f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}; torch {torch.__version__}; "
        f"{args.dtype}; static cache {capacity} entries; compile {args.compile}; decode rows {rows}"
    )

    eager = TargetRunner(model, aux_ids)
    greedy_decode(eager, prompt, 4)
    eager_s, reference = timed(lambda: greedy_decode(eager, prompt, n), 1 if device == "cuda" else args.repeats)
    print(f"greedy_eager_tok_s: {n / eager_s:.1f}")

    if args.fused:  # after the eager reference, which stays unfused
        print(f"fused_mlps: {fuse_projections(model)}")
    attention = args.attention
    target = StaticTargetRunner(
        model,
        aux_ids,
        capacity=capacity,
        compile_settings=settings,
        decode_rows=rows,
        gathered_keys=args.gathered_keys,
        attention=attention,
    )
    print(f"attention: {model.config._attn_implementation}")
    runner = StaticDrafterRunner(drafter, d2t, capacity=capacity, compile_settings=settings, decode_rows=rows)
    start = time.perf_counter()
    warm_widths(target, runner, drafter=not args.only_greedy)
    print(f"warmup_total_s: {time.perf_counter() - start:.1f}")
    static_s, static_ref = timed(lambda: greedy_decode(target, prompt, n), args.repeats)
    print(f"greedy_static_tok_s: {n / static_s:.1f}  (target forwards {target.widths[0]} rows wide)")
    print(f"greedy_static_speedup: {eager_s / static_s:.2f}")
    print(f"target_forward_ms: {forward_ms(target, args.prompt_len):.3f}  (one token, back to back)")
    if rows is not None and rows > 1:
        for variant in args.width_1_attention or [attention]:
            one_row(model, aux_ids, capacity, settings, variant, prompt, static_s, static_ref, args, device)
    if args.profile:  # the evaluation's reference: greedy at the decode width
        wide = f"greedy-width-{target.widths[0]}"
        profile_decode(wide, lambda: greedy_decode(target, prompt, n), device, steps=False)

    if args.temperature > 0:
        sampled_rounds(target, runner, drafter, d2t, prompt, n, args.temperature, args.repeats)
    if args.only_greedy:
        kind = check_lossless(reference, static_ref.tokens, 1e-3).kind
        print(f"static_greedy_vs_eager: {kind}")
        return
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
        wall, out = timed(lambda proposer=proposer: speculative_decode(target, proposer, prompt, n), args.repeats)
        rounds = max(len(out.steps), 1)
        print(
            f"{name}_round_ms: {1000 * wall / rounds:.2f}  (accept_len {out.accept_len:.2f}, "
            f"{len(out.tokens) / wall:.1f} tok/s)"
        )
        results.append((name, out))
    eager_runner = DrafterRunner(drafter, d2t)
    wall, out = timed(
        lambda: speculative_decode(
            eager, OracleProposer(EagleProposer(drafter, d2t, 3, runner=eager_runner), full), prompt, n
        ),
        1,
    )
    print(f"chain-3-oracle_eager_round_ms: {1000 * wall / max(len(out.steps), 1):.2f}")
    results.append(("chain-3-oracle-eager", out))
    kinds = [check_lossless(static_ref, out.tokens, 1e-3).kind for _, out in results[1:-1]]
    print(
        f"lossless_identical: {kinds.count('identical')} of {len(kinds)} (near_tie {kinds.count('near_tie')}, "
        f"mismatch {kinds.count('mismatch')}; static methods vs the static greedy reference)"
    )
    kinds = [check_lossless(reference, out.tokens, 1e-3).kind for _, out in results]
    print(
        f"eager_reference_identical: {kinds.count('identical')} of {len(kinds)} (near_tie "
        f"{kinds.count('near_tie')}, mismatch {kinds.count('mismatch')}; every output vs the eager greedy)"
    )
    if args.profile:
        for name in ("chain-3-oracle", "tree-5-4-8-oracle"):
            profile_decode(name, lambda name=name: speculative_decode(target, methods[name](), prompt, n), device)
    if device == "cuda":
        from torch._dynamo.utils import counters

        print(
            f"graphs: target {target.step_fn.num_graphs} (on {target.step_fn.use_graphs}), drafter "
            f"{runner.step_fn.num_graphs} (on {runner.step_fn.use_graphs}), rounds "
            f"{sum(r.num_graphs for r in runner._rounds.values())}; compiled target {target.step_fn.compiled}, "
            f"drafter {runner.step_fn.compiled}; dynamo graph breaks {sum(counters['graph_break'].values())}"
        )
        for step in (target.step_fn, runner.step_fn, *runner._rounds.values()):
            if step.fallback_reason:
                print(f"fallback: {step.name} runs eagerly: {step.fallback_reason}")


if __name__ == "__main__":
    main()
