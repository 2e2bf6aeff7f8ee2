"""SGLang's accept length against eagle3 eval's on the prompts an evaluation of a subset measured.

The deploy stage checks SGLang against `eagle3 eval` on the whole prompt set. When the evaluation could only cover
the first N prompts of each dataset (e.g. run on a CPU, where 160 prompts take hours), this pairs each evaluated
prompt with the same prompt of the deploy benchmark (the k-th prompt of dataset d on both sides: both take the first
prompts of every dataset, in the same order) and compares, per dataset and over all of them:

* accept length = tokens / verify steps on each side (SGLang's at the lowest concurrency measured);
* the same on only the prompts whose outputs are token-identical (divergent text cannot move that one).

The share of identical outputs is printed too: pairing the wrong prompts would make it ~0.

    python lab/sglang_accept_subset.py --deploy runs/<run>/deploy/results.json --eval runs/<run>/eval \\
        [--trio 3-1-4] [--out runs/<run>/deploy/accept-subset.json]
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

from eagle3.deploy_checks import eval_method_name, same_output  # noqa: E402
from eagle3.evaluate.records import PromptRecord  # noqa: E402
from infra.sglang_compare import group_indices  # noqa: E402


@dataclass(frozen=True)
class Pair:
    """One prompt measured on both sides: tokens and verify steps of each, and whether the outputs are equal."""

    dataset: str
    sglang_tokens: int
    sglang_verify: int
    eval_tokens: int
    eval_verify: int
    same_text: bool


@dataclass(frozen=True)
class Row:
    """Accept lengths of one dataset (or 'all') on the paired prompts, and on the identical-output ones."""

    dataset: str
    prompts: int
    sglang: float
    evaluate: float
    rel_diff: float
    same_text_prompts: int
    same_text_sglang: float | None
    same_text_evaluate: float | None


def pair_prompts(level: dict[str, Any], groups: list[str], records: list[PromptRecord], method: str) -> list[Pair]:
    """The k-th evaluated prompt of each dataset against the k-th prompt of that dataset in the deploy run."""
    positions: dict[str, list[int]] = {}
    for i, dataset in enumerate(groups):
        positions.setdefault(dataset, []).append(i)
    seen: dict[str, int] = {}
    pairs = []
    for rec in sorted(records, key=lambda r: r.index):
        k = seen.get(rec.dataset, 0)
        seen[rec.dataset] = k + 1
        run = rec.methods.get(method)
        if run is None:
            raise SystemExit(f"eval record {rec.index} ({rec.dataset}) has no {method}: evaluate that drafting")
        if k >= len(positions.get(rec.dataset, [])):
            raise SystemExit(f"the deploy run has fewer than {k + 1} {rec.dataset} prompts")
        i = positions[rec.dataset][k]
        ours = run.tokens if run.tokens is not None else rec.greedy.tokens
        pairs.append(
            Pair(
                rec.dataset,
                level["completion_by_prompt"][i],
                level["verify_by_prompt"][i],
                run.num_tokens,
                len(run.committed),
                same_output(level["output_digests"][i], list(ours)),
            )
        )
    return pairs


def ratio(tokens: int, verify: int) -> float | None:
    return tokens / verify if verify else None


def rows_of(pairs: list[Pair]) -> list[Row]:
    """Per dataset in first-seen order, then 'all'."""
    rows = []
    for dataset, idx in group_indices([p.dataset for p in pairs]):
        mine = [pairs[i] for i in idx]
        same = [p for p in mine if p.same_text]
        sg = sum(p.sglang_tokens for p in mine) / sum(p.sglang_verify for p in mine)
        ev = sum(p.eval_tokens for p in mine) / sum(p.eval_verify for p in mine)
        rows.append(
            Row(
                dataset,
                len(mine),
                sg,
                ev,
                abs(sg - ev) / ev,
                len(same),
                ratio(sum(p.sglang_tokens for p in same), sum(p.sglang_verify for p in same)),
                ratio(sum(p.eval_tokens for p in same), sum(p.eval_verify for p in same)),
            )
        )
    return rows


def read_records(eval_dir: Path) -> list[PromptRecord]:
    path = eval_dir / "prompts.jsonl"
    if not path.is_file():
        raise SystemExit(f"no {path}: run the evaluate stage (a subset is fine) first")
    return [PromptRecord.from_json(json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deploy", type=Path, required=True, help="the deploy stage's results.json")
    parser.add_argument("--eval", type=Path, required=True, help="the evaluate stage's folder (prompts.jsonl)")
    parser.add_argument("--trio", default="3-1-4")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    doc = json.loads(args.deploy.read_text())
    runs = [r for r in doc["speculative"] if r["trio"] == args.trio]
    if not runs:
        raise SystemExit(f"no speculative run {args.trio!r} in {args.deploy}")
    level = min(runs[0]["result"]["levels"], key=lambda lv: lv["concurrency"])
    method = eval_method_name(args.trio)
    rows = rows_of(pair_prompts(level, list(runs[0]["groups"]), read_records(args.eval), method))
    print(f"{args.trio} (SGLang, concurrency {level['concurrency']}) against eagle3 eval's {method}")
    for r in rows:
        same = f"; identical outputs {r.same_text_prompts}/{r.prompts}"
        if r.same_text_prompts:
            same += f": {r.same_text_sglang:.3f} / {r.same_text_evaluate:.3f}"
        print(f"  {r.dataset}: {r.prompts} prompts, {r.sglang:.3f} / {r.evaluate:.3f} (gap {r.rel_diff:.1%}){same}")
    if args.out:
        args.out.write_text(
            json.dumps({"trio": args.trio, "method": method, "rows": [asdict(r) for r in rows]}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
