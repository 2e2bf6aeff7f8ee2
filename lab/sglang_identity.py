"""Why greedy outputs differ between two servers (or a server and eagle3 eval): where they split, and on what margin.

For every prompt whose outputs differ, the first position where they do (or where one stops), and the target's
own logits there, computed again in float32 on the shared prefix (prompt + the common output tokens): the
float32 logit gap between the two tokens each side chose, and which one float32 prefers. A split on a gap of a
few hundredths of a logit is a near-tie that bf16 kernels (other batch shapes, other attention kernels) may
resolve either way; a split where float32 clearly prefers one side's token, with a wide gap, is the sign of a bug
on the other side (the drafter cannot change a verified token: a speculative server whose outputs split from its
baseline on a wide margin verifies wrongly).

    python lab/sglang_identity.py --config runs/<run>/config.json --deploy runs/<run>/deploy/results.json \\
        [--set serve.prompts=evaluation ...] [--trio 3-1-4] [--against baseline|eval] [--device cuda] \\
        [--out runs/<run>/deploy/identity.json]

``--trio`` names the speculative server (default: the deploy's first, the serve section's own setting; for a
DFlash drafter its ``{K-1}-1-{K}``, e.g. 15-1-16).

Give the same ``--set serve.*`` overrides the deploy benchmark ran with: the prompts are rendered again from the
config, and a prompt set whose digest differs from the one in results.json is refused (outputs would be paired with
the wrong prompts).

``--against baseline`` (default) compares the speculative server with the baseline server; ``--against eval``
compares the baseline server with eagle3 eval's greedy reference (``eval/prompts.jsonl``). Reads the lowest
concurrency level (one request at a time). Needs results written with the output ids (infra.sglang_bench
keeps them per prompt).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from eagle3.config import RunConfig  # noqa: E402
from eagle3.run.cli_args import add_config_args, config_from_args  # noqa: E402
from infra.sglang_compare import group_indices  # noqa: E402

NEAR_TIE = 0.25  # float32 logits: bf16 rounding of logits around 20 is ~0.06-0.12, kernels differ by a few of those


@dataclass(frozen=True)
class Split:
    """One prompt whose two outputs differ: where, the two tokens, and float32's view of that position."""

    prompt: int
    dataset: str
    position: int  # index into the output (0 = first generated token)
    token_a: int | None  # None: that side stopped here
    token_b: int | None
    gap_fp32: float | None  # float32 logit of token_a minus that of token_b (None when one side stopped)
    fp32_argmax: int
    fp32_top2_gap: float  # float32 top-1 minus top-2 logit at this position

    @property
    def near_tie(self) -> bool:
        return self.gap_fp32 is not None and abs(self.gap_fp32) <= NEAR_TIE


def first_split(a: list[int], b: list[int]) -> int | None:
    """The first index where a and b differ, or where the shorter ends; None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def logits_at(model: Any, prompt: list[int], prefix: list[int], device: str) -> Any:
    """float32 logits [V] of the next token after prompt + prefix."""
    import torch

    ids = torch.tensor([prompt + prefix], device=device)
    with torch.no_grad():
        return model(input_ids=ids).logits[0, -1].float().cpu()


def analyse(
    model: Any, prompts: list[list[int]], groups: list[str], a: list[list[int]], b: list[list[int]], device: str
) -> list[Split]:
    """A Split for every prompt whose outputs a and b differ."""
    splits = []
    for i, (prompt, out_a, out_b) in enumerate(zip(prompts, a, b, strict=True)):
        at = first_split(out_a, out_b)
        if at is None:
            continue
        logits = logits_at(model, prompt, out_a[:at], device)
        top = logits.topk(2)
        tok_a = out_a[at] if at < len(out_a) else None
        tok_b = out_b[at] if at < len(out_b) else None
        gap = float(logits[tok_a] - logits[tok_b]) if tok_a is not None and tok_b is not None else None
        splits.append(
            Split(i, groups[i], at, tok_a, tok_b, gap, int(top.indices[0]), float(top.values[0] - top.values[1]))
        )
    return splits


def summarize(splits: list[Split], groups: list[str], names: tuple[str, str]) -> dict[str, Any]:
    """Per dataset: identical outputs, near-tie splits, and splits where float32 prefers one side clearly."""
    out: dict[str, Any] = {}
    for dataset, idx in group_indices(groups):
        total = len(idx)
        mine = [s for s in splits if dataset in ("all", s.dataset)]
        wide = [s for s in mine if s.gap_fp32 is not None and not s.near_tie]
        out[dataset] = {
            "prompts": total,
            "identical": total - len(mine),
            "near_tie": sum(s.near_tie for s in mine),
            "stopped": sum(s.gap_fp32 is None for s in mine),
            f"wide_for_{names[0]}": sum(s.gap_fp32 > 0 for s in wide if s.gap_fp32 is not None),
            f"wide_for_{names[1]}": sum(s.gap_fp32 < 0 for s in wide if s.gap_fp32 is not None),
        }
    return out


def first_trio(doc: dict[str, Any]) -> str:
    """The deploy's first speculative server: the serve section's own trio (EAGLE-3) or a DFlash drafter's
    {K-1}-1-{K}; extra settings and SGLang's n-gram server come after it."""
    if not doc.get("speculative"):
        raise ValueError("no speculative run in the deploy results")
    return str(doc["speculative"][0]["trio"])


def level_outputs(doc: dict[str, Any], role: str, trio: str | None) -> list[list[int]]:
    """Output ids per prompt at the lowest concurrency of one server in a deploy results.json."""
    runs = [doc["baseline"]] if role == "baseline" else [r for r in doc["speculative"] if r["trio"] == trio]
    if not runs:
        raise ValueError(f"no speculative run {trio!r} in the deploy results")
    level = min(runs[0]["result"]["levels"], key=lambda lv: lv["concurrency"])
    ids = level.get("output_ids_by_prompt")
    if not ids:
        raise ValueError("these deploy results hold no output ids (written before the benchmark kept them)")
    return [list(x) for x in ids]


def eval_outputs(cfg: RunConfig, count: int) -> list[list[int]]:
    """eagle3 eval's greedy reference per prompt, in prompt order."""
    from eagle3.deploy_checks import eval_records

    records = eval_records(cfg)
    if records is None:
        raise FileNotFoundError("no eval/prompts.jsonl in the run: run the evaluate stage first")
    missing = [i for i in range(count) if i not in records]
    if missing:
        raise SystemExit(
            f"eval/prompts.jsonl has no record of {len(missing)} of the {count} prompts (first: {missing[0]}): "
            "evaluate the same prompts the deploy benchmark sent (evaluate.datasets and num_prompts)"
        )
    return [list(records[i].greedy.tokens) for i in range(count)]


def check_same_prompts(doc: dict[str, Any], prompts: list[Any]) -> None:
    """Refuse a prompt set other than the one the deploy benchmark sent (its digest is in results.json)."""
    from infra.sglang_bench import prompts_digest

    sent = doc["baseline"]["result"]["prompts_digest"]
    mine = prompts_digest(prompts)
    if mine != sent:
        raise SystemExit(
            f"the config renders {len(prompts)} prompts with digest {mine}, the deploy benchmark sent {sent}: give "
            "the same --set serve.* overrides it ran with (e.g. --set serve.prompts=evaluation)"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_config_args(parser)  # --config <run>/config.json and the --set overrides the deploy benchmark ran with
    parser.add_argument("--deploy", type=Path, required=True, help="the deploy stage's results.json")
    parser.add_argument("--trio", help="the speculative server compared (default: the deploy's first)")
    parser.add_argument("--against", choices=["baseline", "eval"], default="baseline")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.config is None:
        parser.error("--config <run>/config.json is required (the run whose deploy results are read)")
    import torch
    from transformers import AutoModelForCausalLM

    from eagle3.deploy import deploy_prompts
    from eagle3.target.load import prepare_target

    cfg = config_from_args(args)
    doc = json.loads(args.deploy.read_text())
    model_dir = prepare_target(cfg)
    sent = deploy_prompts(cfg, str(model_dir))
    check_same_prompts(doc, sent.prompts)
    if args.against == "baseline":
        trio = args.trio or first_trio(doc)
        names = ("baseline", trio)
        a, b = level_outputs(doc, "baseline", None), level_outputs(doc, "speculative", trio)
    else:
        if cfg.serve.prompts != "evaluation":
            raise SystemExit(
                "--against eval compares the evaluation's prompts: the deploy must have sent them "
                "(serve.prompts=evaluation)"
            )
        names = ("eval", "baseline")
        a, b = eval_outputs(cfg, len(sent.prompts)), level_outputs(doc, "baseline", None)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(args.device).eval()
    splits = analyse(model, [list(p) for p in sent.prompts], sent.groups, a, b, args.device)
    summary = summarize(splits, sent.groups, names)
    for dataset, row in summary.items():
        print(f"{dataset}: " + ", ".join(f"{k} {v}" for k, v in row.items()))
    result = {
        "compared": names,
        "near_tie_logits": NEAR_TIE,
        "summary": summary,
        "splits": [asdict(s) | {"near_tie": s.near_tie} for s in splits],
    }
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
