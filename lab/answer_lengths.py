"""How long the target's answers and self-written user turns run, and what each token cap makes of a batch.

    .venv/bin/python lab/answer_lengths.py --preset smollm2-curve --num-prompts 48 --caps 128,256,512

A batched ``generate`` keeps every row until the batch's longest row ends (or hits the cap): the share of the
decode work that yields kept tokens (the slot use the data stages print) is set by the spread of the lengths,
not by the GPU. This program measures the lengths on real prompts and prints, for each cap, what a batch of
``--batch`` rows drawn from them would keep and waste, so a cap can be chosen from the target's own behaviour.

Measured: greedy answers to the first user turn of the first ``--num-prompts`` conversations of the preset's
first file source (they pass its ``data.max_chars`` check), up to the largest cap; with ``--synthetic N``, N user
turns the target writes from its template's user-turn prefix (the synthetic source's way, at its temperature).
Derived (printed as such): per cap, the mean kept tokens, the share of rows cut by the cap, and the slot use of
batches of ``--batch`` rows drawn with replacement from the measured lengths (``--draws`` batches, seeded),
without and with ``regenerate.straggler_rows`` (``--straggler-rows``: the rows still running when a batch is down
to that many go on in a batch of that size; its extra prefill is not counted).
``--measure-stragglers K`` also runs the user turns twice in batches of ``--gen-batch``, without and with
``straggler_rows`` K, and prints the slot use and time each measured. Lengths count the end token. On a CPU the
model runs in float32 with plain ``generate`` (dynamic cache), so the lengths are the target's, not those of a
particular GPU kernel; bf16 on a GPU can turn at near-ties.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass

import torch

from eagle3.config import load_config
from eagle3.data.chat_backends import generation_eos_ids
from eagle3.data.generate import GenerationSettings, TokenGenerator
from eagle3.data.sources import Conversation, read_source
from eagle3.data.synthesize import user_turn_prefix
from eagle3.target.load import load_model, load_tokenizer, prepare_target


@dataclass(frozen=True)
class Lengths:
    """Generated lengths (end token counted; a row that did not end has ``limit`` tokens) and whether each ended."""

    name: str
    tokens: list[int]
    ended: list[bool]
    limit: int
    prompt_tokens: list[int]
    seconds: float


@dataclass(frozen=True)
class CapFigures:
    """What a cap makes of the measured lengths (derived, not timed)."""

    cap: int
    mean_kept: float  # tokens kept per row: min(length, cap)
    cut_share: float  # rows that reach the cap without an end token
    slot_use: float  # kept tokens / (rows x steps) over the drawn batches, steps = the batch's longest kept row
    straggler_slot_use: float  # the same with regenerate.straggler_rows (row-steps of both batches counted)


def batch_row_steps(rows: list[int], stragglers: int) -> int:
    """Row-steps a batch of these kept lengths runs: all rows to the longest, or, with ``stragglers`` > 0, all rows
    until at most that many are running, then a batch of ``stragglers`` rows to the longest."""
    longest = max(rows)
    if not 0 < stragglers < len(rows):
        return len(rows) * longest
    stop = sorted(rows)[len(rows) - stragglers - 1]  # the step after which at most `stragglers` rows run
    return len(rows) * stop + stragglers * (longest - stop)


def cap_figures(lengths: Lengths, cap: int, batch: int, draws: int, seed: int, stragglers: int = 0) -> CapFigures:
    """Per-cap figures; a row that did not end within ``lengths.limit`` runs to any cap <= limit, and is cut by it."""
    if cap > lengths.limit:
        raise ValueError(f"cap {cap} is above the measured limit {lengths.limit}: those lengths are unknown")
    kept = [min(n, cap) for n in lengths.tokens]
    cut = [not done or n > cap for n, done in zip(lengths.tokens, lengths.ended, strict=True)]
    rng = random.Random(seed)
    used = steps = shrunk = 0
    for _ in range(draws):
        rows = rng.choices(kept, k=batch)
        used, steps = used + sum(rows), steps + batch_row_steps(rows, 0)
        shrunk += batch_row_steps(rows, stragglers)
    return CapFigures(cap, statistics.fmean(kept), sum(cut) / len(cut), used / steps, used / shrunk)


def first_turns(cfg, count: int) -> list[list[dict[str, str]]]:
    """The first user turn (with a leading system turn) of the first ``count`` conversations of the first file
    source."""
    src = next((s for s in cfg.data.sources if s.path), None)
    if src is None:
        raise SystemExit(f"preset {cfg.run.name} has no file source to take prompts from")
    out: list[list[dict[str, str]]] = []
    stream = read_source(src, cfg.data.max_chars, cfg.data.max_chars_of)
    try:
        for item in stream:
            if isinstance(item, Conversation):
                msgs = item.messages
                first_user = next(i for i, m in enumerate(msgs) if m["role"] == "user")
                out.append(msgs[: first_user + 1])
                if len(out) == count:
                    break
    finally:
        stream.close()
    return out


def measure(name: str, gen: TokenGenerator, prompts: list[list[int]], eos: tuple[int, ...], limit: int) -> Lengths:
    start = time.perf_counter()
    rows = gen.generate(prompts)
    seconds = time.perf_counter() - start
    ended = [bool(r) and r[-1] in eos for r in rows]
    return Lengths(name, [len(r) for r in rows], ended, limit, [len(p) for p in prompts], seconds)


def report(lengths: Lengths, caps: list[int], batch: int, draws: int, seed: int, stragglers: int) -> None:
    toks = sorted(lengths.tokens)
    q = statistics.quantiles(toks, n=20)
    n = lengths.name
    print(f"{n}.rows: {len(toks)}")
    print(f"{n}.generate_s: {lengths.seconds:.1f}")
    print(f"{n}.prompt_tokens_median: {statistics.median(lengths.prompt_tokens):.0f}")
    print(f"{n}.not_ended_within_{lengths.limit}: {lengths.ended.count(False)}")
    print(f"{n}.length_p10_p50_p90_p95: {q[1]:.0f} {q[9]:.0f} {q[17]:.0f} {q[18]:.0f}")
    print(f"{n}.length_mean: {statistics.fmean(toks):.1f}")
    print(f"{n}.lengths (input order, {lengths.limit} = did not end): {' '.join(map(str, lengths.tokens))}")
    for cap in caps:
        f = cap_figures(lengths, cap, batch, draws, seed, stragglers)
        print(
            f"{n}.cap[{cap}] (derived, batches of {batch}): mean_kept {f.mean_kept:.1f}, cut_share "
            f"{f.cut_share:.3f}, slot_use {f.slot_use:.3f}, with straggler_rows {stragglers} "
            f"(its prefill not counted): {f.straggler_slot_use:.3f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="smollm2-curve")
    parser.add_argument("--num-prompts", type=int, default=48, help="first user turns answered greedily")
    parser.add_argument("--synthetic", type=int, default=0, help="user turns the target writes (0: none)")
    parser.add_argument("--caps", default="128,256,512", help="answer caps to derive figures for (largest = limit)")
    parser.add_argument("--prompt-caps", default="64,128,256", help="user-turn caps (largest = limit)")
    parser.add_argument("--batch", type=int, default=512, help="rows per batch in the derived slot use")
    parser.add_argument("--draws", type=int, default=200, help="batches drawn per cap")
    parser.add_argument("--straggler-rows", type=int, default=64, help="regenerate.straggler_rows to derive for")
    parser.add_argument(
        "--measure-stragglers",
        type=int,
        default=0,
        help="also run the user turns in batches of --gen-batch without and with this straggler_rows",
    )
    parser.add_argument("--gen-batch", type=int, default=16, help="rows per generate call while measuring")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    caps = sorted(int(c) for c in args.caps.split(","))
    prompt_caps = sorted(int(c) for c in args.prompt_caps.split(","))
    cfg = load_config(args.preset, args.overrides)
    model_dir = prepare_target(cfg)
    dtype = "float32" if args.device == "cpu" else cfg.target.dtype
    model, tok = load_model(model_dir, dtype, args.device), load_tokenizer(model_dir)
    eos = generation_eos_ids(model, tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    backend = "dynamic" if args.device == "cpu" else "static"

    def generator(limit: int, temperature: float, stragglers: int = 0) -> TokenGenerator:
        return TokenGenerator(
            model,
            GenerationSettings(limit, eos, int(pad), temperature, backend, args.gen_batch, straggler_rows=stragglers),
        )

    if args.num_prompts:
        texts = [
            tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
            for m in first_turns(cfg, args.num_prompts)
        ]
        prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
        answers = measure("answers", generator(caps[-1], 0.0), prompts, eos, caps[-1])
        report(answers, caps, args.batch, args.draws, args.seed, args.straggler_rows)
    if args.synthetic:
        syn = next((s.synthetic for s in cfg.data.sources if s.synthetic), None)
        temperature = syn.temperature if syn else 1.0
        torch.manual_seed(args.seed)
        prefix = list(tok(user_turn_prefix(tok), add_special_tokens=False)["input_ids"])
        turns = measure(
            "user_turns", generator(prompt_caps[-1], temperature), [prefix] * args.synthetic, eos, prompt_caps[-1]
        )
        report(turns, prompt_caps, args.batch, args.draws, args.seed, args.straggler_rows)
        for rows in (0, args.measure_stragglers) if args.measure_stragglers else ():  # the same turns, run for real
            torch.manual_seed(args.seed)
            gen = generator(prompt_caps[-1], temperature, rows)
            gen.generate([prefix] * args.synthetic)
            st = gen.stats.to_json()
            print(
                f"user_turns.measured[straggler_rows={rows}, batches of {args.gen_batch}]: slot_use "
                f"{st['slot_use']}, generate_s {st['seconds']}, calls {st['calls']}, new_tokens {st['new_tokens']}"
            )


if __name__ == "__main__":
    main()
