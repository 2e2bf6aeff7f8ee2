"""How well an exported drafter predicts on its training distribution versus the evaluation's texts.

    .venv/bin/python lab/drafter_shift.py --config runs/<run>/config.json [--set k=v ...] \
        --journal runs/<run>/data/regenerate.journal.jsonl --eval-prompts runs/<run>/eval/prompts.jsonl

The drafter's first draft token is teacher-forced (TTT step 0 as training computes it, through the same
runner the offline decode uses) on three kinds of text, all answers of the target itself:
  - regenerated conversations of the validation split, and a sample of the training split (from the
    regeneration journal; the split is recomputed from the ids with the run's seed and val_fraction),
  - the greedy outputs of an evaluation (its prompts.jsonl), per dataset: over every token, and at the
    chain's round starts only, next to the chain's measured position-1 acceptance on the same rounds (the
    last two differ only where the decode's numerics differ from this pass's);
  - on the same greedy outputs, every chain method's acceptance replayed from one teacher-forced pass of all its
    steps (eagle3/evaluate/teacher_forced.py) next to the decode's, and how many prompts' replayed rounds equal
    the decoded rounds exactly: where they agree, a curve can measure chain acceptance from that pass alone.
Validation close to training but evaluation far below says the drafter does not transfer to the evaluation
prompts (more or closer training data helps); evaluation teacher-forced far above the decode's position-1
acceptance would say the decode feeds the drafter differently from training (a bug). Prints `name: value` lines.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from eagle3.config import RunConfig
from eagle3.data.merge import split_for
from eagle3.evaluate.prompts import load_prompts, render
from eagle3.evaluate.proposers import NgramProposer
from eagle3.evaluate.records import MethodSpec, PromptRecord
from eagle3.evaluate.runners import DrafterRunner, TargetRunner
from eagle3.evaluate.session import method_specs
from eagle3.evaluate.speculate import draft_hits, teacher_forced_drafts
from eagle3.evaluate.stage import resolve_device
from eagle3.evaluate.teacher_forced import chain_match_lengths, simulate_chain, simulate_ngram
from eagle3.export.sglang import load_sglang_export
from eagle3.run.cli_args import add_config_args, config_from_args
from eagle3.run.journal import Journal
from eagle3.run.progress import Progress
from eagle3.target.load import load_model, load_tokenizer, prepare_target


def hits(drafts: list[int], generated: list[int]) -> tuple[int, int]:
    """(matches, tokens): drafts[i] predicts generated[i + 1]."""
    return draft_hits(drafts, generated), len(drafts)


def conversations(journal: Path, cfg: RunConfig, split: str, limit: int) -> Iterator[tuple[str, str]]:
    """(user text, the target's answer) of first turns journaled as ok, in a seeded random order.

    The split is the merge's (a seeded hash of the id); rows the merge later rejected (too long) can be among them.
    """
    journaled = [r for _, r in sorted(Journal(journal).load().items())]
    records = [
        r
        for r in journaled
        if r.get("status") == "ok"
        and len(r["messages"]) >= 2
        and split_for(r["id"], cfg.run.seed, cfg.data.val_fraction) == split
    ]
    random.Random(0).shuffle(records)
    for r in records[:limit]:
        yield r["messages"][0]["content"], r["messages"][1]["content"]


def answer_ids(tokenizer, user: str, answer: str, max_len: int) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids) under the chat template, cut to the tokenizer's max_len like training."""
    prompt = render(tokenizer, user)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": user}, {"role": "assistant", "content": answer}], tokenize=False
    )
    full = list(tokenizer(text, add_special_tokens=False)["input_ids"])[:max_len]
    if full[: len(prompt)] != prompt:
        raise ValueError("the rendered prompt is not a prefix of the rendered conversation")
    return prompt, full[len(prompt) :]


def measure_conversations(runners, tokenizer, cfg: RunConfig, journal: Path, split: str, limit: int) -> None:
    items = list(conversations(journal, cfg, split, limit))
    num_hits = num_tokens = 0
    with Progress(len(items), f"{split} conversations") as bar:
        for user, answer in items:
            prompt, generated = answer_ids(tokenizer, user, answer, cfg.tokenize.max_len)
            h, n = hits(teacher_forced_drafts(*runners, prompt, generated), generated)
            num_hits, num_tokens = num_hits + h, num_tokens + n
            bar.update()
    print(f"{split}_conversations: {len(items)}")
    print(f"{split}_teacher_forced_acc_0: {num_hits / max(num_tokens, 1):.4f} ({num_tokens} tokens)")


def measure_eval(runners, tokenizer, prompts_file: Path, chains: list[MethodSpec]) -> None:
    records = [
        PromptRecord.from_json(json.loads(line)) for line in prompts_file.read_text().splitlines() if line.strip()
    ]
    datasets = list(dict.fromkeys(r.dataset for r in records))
    ids = {p.id: i for p, i in load_prompts(datasets, None, tokenizer)}
    tallies: dict[str, list[int]] = {d: [0] * 5 for d in datasets}  # hits, tokens, round hits (tf, decode), rounds
    with Progress(len(records), "eval texts") as bar:
        for r in records:
            generated = r.greedy.tokens
            drafts = teacher_forced_drafts(*runners, ids[r.id], generated)
            chain = next(m for name, m in r.methods.items() if name.startswith("chain"))
            starts = round_starts(chain.committed)
            counts = (
                *hits(drafts, generated),
                sum(drafts[i] == generated[i + 1] for i in starts),
                sum(a >= 1 for a in chain.accepted),
                len(starts),
            )
            tallies[r.dataset] = [t + c for t, c in zip(tallies[r.dataset], counts)]
            bar.update()
    for d, (h, n, tf_round_hits, round_hits, rounds) in tallies.items():
        print(f"eval_{d}_teacher_forced_acc_0: {h / max(n, 1):.4f} ({n} tokens)")
        print(f"eval_{d}_teacher_forced_at_chain_round_starts: {tf_round_hits / max(rounds, 1):.4f} ({rounds} rounds)")
        print(f"eval_{d}_chain_position1_acceptance: {round_hits / max(rounds, 1):.4f} ({rounds} rounds)")
    replay_chains(runners, records, ids, chains)


def matched_runs(runners, seq: list[int], deepest: int) -> list[int]:
    """Each row's run of right drafts (up to ``deepest``) over prompt + greedy text, from one teacher-forced pass."""
    target, drafter = runners
    target.reset()
    aux = target.step(seq).aux  # [L, A*H]
    target.reset()
    return chain_match_lengths(drafter.drafter, drafter.d2t, aux, seq, deepest)


def replay_chains(runners, records: list[PromptRecord], ids: dict[str, list[int]], chains: list[MethodSpec]) -> None:
    """Per dataset and chain method: acceptance replayed from one teacher-forced pass against the decoded one."""
    chains = [m for m in chains if any(m.name in r.methods for r in records)]
    if not chains:
        return
    deepest = max(m.steps for m in chains)
    tallies: dict[tuple[str, str], list[int]] = {}  # committed (replayed, decoded), rounds (replayed, decoded), same
    with Progress(len(records), "chain replays") as bar:
        for r in records:
            matched = matched_runs(runners, [*ids[r.id], *r.greedy.tokens], deepest)
            for method in chains:
                run = r.methods.get(method.name)
                if run is None:
                    continue
                replayed = simulate_chain(matched, len(ids[r.id]), len(r.greedy.tokens), method.steps)
                counts = (
                    sum(replayed),
                    sum(run.committed),
                    len(replayed),
                    len(run.committed),
                    int(replayed == run.committed),
                )
                key = (r.dataset, method.name)
                tallies[key] = [t + c for t, c in zip(tallies.get(key, [0] * 5), counts)]
            bar.update()
    for (d, name), (tf_tokens, tokens, tf_rounds, rounds, same) in tallies.items():
        prompts = sum(1 for r in records if r.dataset == d and name in r.methods)
        print(
            f"eval_{d}_{name}_replayed_accept_len: {tf_tokens / max(tf_rounds, 1):.4f} "
            f"(decoded {tokens / max(rounds, 1):.4f}; identical rounds on {same}/{prompts} prompts)"
        )


def replay_only(runners, tokenizer, prompts_file: Path, cfg: RunConfig, out: Path | None) -> None:
    """Chain acceptance of this drafter (and n-gram's, when the config lists it) replayed on an evaluation's greedy
    texts, with no decode of its own: the texts depend on the target and prompts only, so one evaluation's
    prompts.jsonl serves every drafter of a curve. Prints per dataset and overall (committed tokens per round);
    writes them as JSON to ``out`` if given."""
    specs = method_specs(cfg.evaluate)
    chains, ngrams = [m for m in specs if m.kind == "chain"], [m for m in specs if m.kind == "ngram"]
    ngram = NgramProposer(cfg.evaluate.ngram_max, cfg.evaluate.ngram_min, cfg.evaluate.ngram_num_tokens)
    records = [
        PromptRecord.from_json(json.loads(line)) for line in prompts_file.read_text().splitlines() if line.strip()
    ]
    ids = {p.id: i for p, i in load_prompts(list(dict.fromkeys(r.dataset for r in records)), None, tokenizer)}
    deepest = max((m.steps for m in chains), default=1)
    tallies: dict[tuple[str, str], list[int]] = {}  # (dataset or "all", method) -> [committed tokens, rounds]
    num_prompts = {d: sum(r.dataset == d for r in records) for d in dict.fromkeys(r.dataset for r in records)}
    with Progress(len(records), "chain replays") as bar:
        for r in records:
            matched = matched_runs(runners, [*ids[r.id], *r.greedy.tokens], deepest)
            for method in [*chains, *ngrams]:
                replayed = (
                    simulate_ngram(ngram, ids[r.id], r.greedy.tokens)
                    if method.kind == "ngram"
                    else simulate_chain(matched, len(ids[r.id]), len(r.greedy.tokens), method.steps)
                )
                for key in ((r.dataset, method.name), ("all", method.name)):
                    tallies[key] = [t + c for t, c in zip(tallies.get(key, [0, 0]), (sum(replayed), len(replayed)))]
            bar.update()
    result = {f"{d}/{name}": tokens / max(rounds, 1) for (d, name), (tokens, rounds) in tallies.items()}
    for name, value in result.items():
        print(f"replayed_accept_len {name}: {value:.4f}")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(
            json.dumps(
                {
                    "source": str(prompts_file),
                    "accept_len": result,
                    "num_prompts": {**num_prompts, "all": len(records)},
                },
                indent=1,
            )
        )


def round_starts(committed: list[int]) -> list[int]:
    """Indices into teacher_forced_drafts of each verify round's first draft: the prefill commits generated[0],
    round k then starts after 1 + sum(committed[:k]) generated tokens."""
    starts, done = [], 1
    for num in committed:
        starts.append(done - 1)
        done += num
    return starts


def main(argv: list[str] | None = None) -> None:
    parser = add_config_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    parser.add_argument("--export-dir", type=Path, help="SGLang export (default <run>/export/sglang)")
    parser.add_argument("--journal", type=Path, help="the regeneration journal (.jsonl)")
    parser.add_argument("--eval-prompts", type=Path, help="an evaluation's prompts.jsonl")
    parser.add_argument("--num-conversations", type=int, default=64, help="per split")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or auto (cuda when visible)")
    parser.add_argument(
        "--replay-only",
        action="store_true",
        help="with --eval-prompts: only the chain acceptance replayed on its greedy texts",
    )
    parser.add_argument("--out", type=Path, help="with --replay-only: write the figures here as JSON")
    args = parser.parse_args(argv)
    cfg = config_from_args(args)
    model_dir = prepare_target(cfg)
    tokenizer = load_tokenizer(model_dir)
    export_dir = args.export_dir or cfg.run_dir / "export" / "sglang"
    device = resolve_device(args.device)
    loaded = load_sglang_export(export_dir, model_dir, device, torch.float32)
    runners = (
        TargetRunner(load_model(model_dir, "float32", device), loaded.aux_layer_ids),
        DrafterRunner(loaded.drafter, loaded.d2t),
    )
    print(f"export: {export_dir}", file=sys.stderr)
    if args.journal:
        for split in ("val", "train"):
            measure_conversations(runners, tokenizer, cfg, args.journal, split, args.num_conversations)
    if args.eval_prompts:
        chains = [m for m in method_specs(cfg.evaluate) if m.kind == "chain"]
        if args.replay_only:
            replay_only(runners, tokenizer, args.eval_prompts, cfg, args.out)
        else:
            measure_eval(runners, tokenizer, args.eval_prompts, chains)


if __name__ == "__main__":
    main()
