"""Generation benchmark: plain ``generate`` against regeneration's fast path, on one device.

Prints ``name: value`` lines:
  plain_tok_s        plain ``model.generate`` (dynamic cache, eager) on the prompts, in batches of --batch;
  fast_tok_s         ``TokenGenerator`` at regeneration's defaults for the device (static cache compiled by
                     transformers on CUDA, kv-head decode attention), same batches, after a warm-up pass
                     (fast_warmup_s: the first pass, compile included);
  fast_over_plain    their ratio;
  identical_rows     rows of the timed runs whose greedy tokens are equal (the model's dtype: bf16 rounding
                     differs between kernels, so a near tie can flip a token of a random model);
  check_identical    the same on --check-rows prompts in float32 with a fresh float32 copy of the model,
                     plain vs fast, so kernel rounding cannot flip ties (the correctness check);
  sweep B: tok_s     the fast path at other batch sizes (--sweep; each size compiles once more);
  fast_step_ms       the timed pass's wall time per decode step (seconds over the steps of its generate calls);
  fast_shapes        per cache shape, its first call's seconds (a compile, on CUDA) and its calls; with
                     --compile-dynamic the decode step is compiled once for every shape (regenerate.compile_dynamic);
  decode_attention K the other --decode-attention ways on the same prompts and model: tok/s, step time, ratio
                     to the first, and rows identical to it;
  --profile          a torch.profiler table of one more fast call (the kernels and host calls a step spends on).
Tokens per second count generated tokens up to and including each row's first eos (a row that stopped
early costs steps in static generate but its idle steps are not counted).

    python lab/generation.py --tiny                                # CPU smoke run (seconds)
    python lab/generation.py --device cuda                         # SmolLM2-135M shape, random weights
    python lab/generation.py --device cuda --sweep 1024,4096 --check-rows 0
    python lab/generation.py --device cuda --skip-plain --check-rows 0 --batch 512 --num-prompts 2048 \
        --min-len 100 --max-len 3000 --new-tokens 512 --cold [--compile-dynamic]   # compiles, three cache lengths
    python lab/generation.py --device cuda --model-dir path/to/SmolLM2-135M-Instruct

Needs only torch and transformers (and the repository root on PYTHONPATH).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for a plain `python lab/...`

from eagle3.data.generate import GenerationSettings, TokenGenerator, cut_after_eos, left_pad  # noqa: E402
from lab.shapes import SMOLLM2_135M  # noqa: E402

TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1000,
    "max_position_embeddings": 1024,
    "num_hidden_layers": 2,
    "tie_word_embeddings": True,
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model-dir", default=None, help="a transformers model folder instead of the random model")
    p.add_argument("--tiny", action="store_true", help="a 2-layer random Llama and small sizes (CPU smoke run)")
    p.add_argument("--dtype", default=None, help="bfloat16 (default on cuda) or float32 (default on cpu)")
    p.add_argument("--batch", type=int, default=None, help="rows per generate call (default 2048; 8 with --tiny)")
    p.add_argument("--num-prompts", type=int, default=None, help="prompts (default: one batch)")
    p.add_argument("--min-len", type=int, default=None, help="shortest prompt (default 32; 4 with --tiny)")
    p.add_argument("--max-len", type=int, default=None, help="longest prompt (default 512; 40 with --tiny)")
    p.add_argument("--new-tokens", type=int, default=None, help="max new tokens (default 256; 16 with --tiny)")
    p.add_argument("--backend", default="auto", choices=("auto", "static", "dynamic", "continuous"))
    p.add_argument(
        "--decode-attention",
        default="kv_heads",
        help="static: sdpa, kv_heads or flex; a comma list times each on the same prompts (first is 'fast')",
    )
    p.add_argument("--check-rows", type=int, default=64, help="float32 identity check rows (0 = skip)")
    p.add_argument("--check-new-tokens", type=int, default=32)
    p.add_argument("--sweep", default="", help="comma-separated extra batch sizes for the fast path")
    p.add_argument("--skip-plain", action="store_true", help="time only the fast path")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--cold",
        action="store_true",
        help="no warm-up call: the timed pass pays each shape's compile (read fast_shapes; one process per run)",
    )
    p.add_argument(
        "--compile-dynamic",
        action="store_true",
        help="the fast path compiles its decode step once with symbolic sizes (regenerate.compile_dynamic)",
    )
    p.add_argument("--profile", action="store_true", help="profile one more fast call of --batch rows")
    return p


def _defaults(args: argparse.Namespace) -> None:
    tiny = {"batch": 8, "min_len": 4, "max_len": 40, "new_tokens": 16}
    full = {"batch": 2048, "min_len": 32, "max_len": 512, "new_tokens": 256}
    for name, value in (tiny if args.tiny else full).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.tiny:
        args.check_rows, args.check_new_tokens = min(args.check_rows, 8), min(args.check_new_tokens, 8)
    args.num_prompts = args.num_prompts or args.batch
    args.dtype = args.dtype or ("bfloat16" if torch.device(args.device).type == "cuda" else "float32")


def build_model(args: argparse.Namespace) -> Any:
    """A random-weight Llama of SmolLM2-135M's shape (or --tiny), or the model in --model-dir."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    dtype = getattr(torch, args.dtype)
    if args.model_dir:
        return (
            AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=dtype, attn_implementation="sdpa")
            .to(args.device)
            .eval()
        )
    torch.manual_seed(args.seed)
    cfg = LlamaConfig(
        **(TINY if args.tiny else SMOLLM2_135M),
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        attn_implementation="sdpa",
    )
    with torch.device(args.device):
        model = LlamaForCausalLM(cfg)
    return model.to(dtype).eval()


def make_prompts(args: argparse.Namespace, vocab: int, n: int) -> list[list[int]]:
    """n prompts of uniformly random lengths in [min_len, max_len], random non-special token ids (seeded)."""
    rng = random.Random(args.seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(args.min_len, args.max_len))] for _ in range(n)]


def plain_generate(model: Any, prompts: list[list[int]], s: GenerationSettings) -> list[list[int]]:
    """Plain generate (dynamic cache) in input order, batches of s.batch_size, cut after the first eos."""
    device, out = next(model.parameters()).device, []
    for start in range(0, len(prompts), s.batch_size):
        rows = prompts[start : start + s.batch_size]
        ids, mask = left_pad(rows, max(map(len, rows)), s.pad_id)
        with torch.no_grad():  # the mode generate itself runs in, not inference_mode
            new = model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                do_sample=False,
                max_new_tokens=s.max_new_tokens,
                eos_token_id=list(s.eos_ids),
                pad_token_id=s.pad_id,
            )
        out += [cut_after_eos(r, s.eos_ids) for r in new[:, ids.shape[1] :].tolist()]
    return out


def timed(fn: Any, *args: Any) -> tuple[list[list[int]], float]:
    """fn(*args) and its wall time, with the device synchronized on both ends."""
    _sync()
    start = time.perf_counter()
    result = fn(*args)
    _sync()
    return result, time.perf_counter() - start


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _tok_s(rows: list[list[int]], seconds: float) -> float:
    return sum(map(len, rows)) / seconds


def _settings(model: Any, args: argparse.Namespace, batch: int, new_tokens: int) -> GenerationSettings:
    eos = model.generation_config.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, list) else (int(eos),)
    pad = model.generation_config.pad_token_id
    return GenerationSettings(
        max_new_tokens=new_tokens,
        eos_ids=eos_ids,
        pad_id=eos_ids[0] if pad is None else pad,
        backend=args.backend,
        batch_size=batch,
        decode_attention=args.decode_attention.split(",")[0],
        compile_dynamic=args.compile_dynamic,
    )


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    _defaults(args)
    begin = time.perf_counter()
    model = build_model(args)
    vocab = model.config.vocab_size
    prompts = make_prompts(args, vocab, args.num_prompts)
    s = _settings(model, args, args.batch, args.new_tokens)
    print(f"device: {args.device} ({torch.cuda.get_device_name() if args.device.startswith('cuda') else 'cpu'})")
    print(f"model: {args.model_dir or ('tiny' if args.tiny else 'random SmolLM2-135M shape')}, {args.dtype}")
    print(
        f"prompts: {len(prompts)}, lengths {args.min_len}-{args.max_len}, new tokens {args.new_tokens}, "
        f"batch {args.batch}"
    )
    plain = None
    if not args.skip_plain:
        plain_generate(model, prompts[:2], GenerationSettings(**{**s.__dict__, "max_new_tokens": 4}))  # warm-up
        plain, plain_s = timed(plain_generate, model, prompts, s)
        print(f"plain_tok_s: {_tok_s(plain, plain_s):.0f} ({sum(map(len, plain))} tokens in {plain_s:.1f} s)")
    fast_gen = TokenGenerator(model, s)
    print(f"fast_backend: {fast_gen.settings.backend}, attention {model.config._attn_implementation}")
    fast, fast_s, warm_s, step_ms = warm_and_time(fast_gen, prompts, 0 if args.cold else args.batch)
    print(f"fast_warmup_s: {warm_s:.1f}")
    print(f"fast_tok_s: {_tok_s(fast, fast_s):.0f} ({sum(map(len, fast))} tokens in {fast_s:.1f} s)")
    print(f"fast_step_ms: {step_ms:.2f} (slot use {fast_gen.stats.to_json()['slot_use']})")
    print(
        "fast_shapes: "
        + ", ".join(
            f"{name} first call {st.first_call_s:.1f} s of {st.calls}" for name, st in fast_gen.stats.shapes.items()
        )
    )
    if args.profile:
        profile(fast_gen, prompts[: args.batch])
    for kind in args.decode_attention.split(",")[1:]:
        other = TokenGenerator(model, replace(s, decode_attention=kind))
        rows, secs, warm, ms = warm_and_time(other, prompts, args.batch)
        print(
            f"decode_attention {kind}: {_tok_s(rows, secs):.0f} tok/s, step {ms:.2f} ms (warm-up {warm:.1f} s), "
            f"over {s.decode_attention} {_tok_s(rows, secs) / _tok_s(fast, fast_s):.2f}, "
            f"identical rows {sum(a == b for a, b in zip(rows, fast))}/{len(fast)} ({args.dtype})"
        )
    if plain is not None:
        print(f"fast_over_plain: {_tok_s(fast, fast_s) / _tok_s(plain, plain_s):.2f}")
        print(f"identical_rows: {sum(a == b for a, b in zip(plain, fast))}/{len(fast)} ({args.dtype})")
    for batch in [int(b) for b in args.sweep.split(",") if b.strip()]:
        gen = TokenGenerator(model, _settings(model, args, batch, args.new_tokens))
        sweep_prompts = make_prompts(args, vocab, max(batch, args.num_prompts))
        _, warm = timed(gen.generate, sweep_prompts[:batch])
        rows, secs = timed(gen.generate, sweep_prompts)
        print(f"sweep {batch}: {_tok_s(rows, secs):.0f} tok/s (warm-up {warm:.1f} s)")
    if args.check_rows:
        check(model, args, vocab)
    print(f"total_s: {time.perf_counter() - begin:.0f}")


def warm_and_time(
    gen: TokenGenerator, prompts: list[list[int]], batch: int
) -> tuple[list[list[int]], float, float, float]:
    """(rows, seconds, warm-up seconds, ms per decode step) of a timed pass over ``prompts`` after one untimed
    call of ``batch`` rows (its compile; none when ``batch`` is 0); the step time is the timed pass's seconds over
    its decode steps. The warm-up's longest row sets transformers' cache-length floor for every later call."""
    _, warm_s = timed(gen.generate, prompts[:batch]) if batch else (None, 0.0)
    calls, slots, slot_steps = gen.stats.calls, gen.stats.slots, gen.stats.slot_steps
    rows, seconds = timed(gen.generate, prompts)
    steps = (gen.stats.slot_steps - slot_steps) / max(gen.stats.slots - slots, 1) * (gen.stats.calls - calls)
    return rows, seconds, warm_s, 1000 * seconds / max(steps, 1)


def profile(gen: TokenGenerator, prompts: list[list[int]]) -> None:
    """One more generate call under torch.profiler: the top device kernels and host calls by total time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with torch_profile(activities=activities) as prof:
        timed(gen.generate, prompts)
    averages = prof.key_averages()
    if torch.cuda.is_available():
        print(averages.table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=60))
    print(averages.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60))


def check(model: Any, args: argparse.Namespace, vocab: int) -> None:
    """Plain vs fast greedy tokens on a float32 copy of the model (its own batch size: one more compile)."""
    del model  # the timed model may be bf16; the check builds its own float32 copy from the same seed / folder
    _sync()
    args32 = argparse.Namespace(**{**vars(args), "dtype": "float32"})
    model32 = build_model(args32)
    prompts = make_prompts(argparse.Namespace(**{**vars(args), "seed": args.seed + 1}), vocab, args.check_rows)
    s = _settings(model32, args32, args.check_rows, args.check_new_tokens)
    plain = plain_generate(model32, prompts, s)
    fast = TokenGenerator(model32, s).generate(prompts)
    same = sum(a == b for a, b in zip(plain, fast))
    print(f"check_identical: {same}/{len(prompts)} (float32, {args.check_new_tokens} new tokens)")


if __name__ == "__main__":
    main()
