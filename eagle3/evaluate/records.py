"""The evaluation's records, typed: what one prompt measured (journal lines and prompts.jsonl), the summary rows
and the settings (results.json). ``to_json`` gives the exact dicts these files have always held (same keys, same
order, optional keys left out when absent), so files written before these classes existed load with
``from_json`` and are written back byte for byte. Torch-free: benchmarks and reports read these files too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal, TypeVar

T = TypeVar("T")


class RecordError(ValueError):
    """An evaluation record that does not have the fields this code reads."""


def _parse(what: str, doc: Any, build: Callable[[Mapping[str, Any]], T]) -> T:
    """``build(doc)``, with a missing field, a wrong type or a non-object named with ``what``."""
    if not isinstance(doc, Mapping):
        raise RecordError(f"{what}: expected a JSON object, got {type(doc).__name__}")
    try:
        return build(doc)
    except RecordError as exc:
        raise RecordError(f"{what}: {exc}") from None
    except KeyError as exc:
        raise RecordError(f"{what}: missing field {exc}") from None
    except (TypeError, ValueError, AttributeError) as exc:
        raise RecordError(f"{what}: {exc}") from None


def _ints(values: Any) -> list[int]:
    return [int(v) for v in values]


# ---------------------------------------------------------------------------------------------- lossless


@dataclass(frozen=True)
class LosslessCheck:
    """How a method's output compares with the greedy reference, at the first differing token."""

    # sampled: at temperature > 0, where token identity cannot hold; every committed token lay inside the target's
    # sampling support (mismatch: one did not, at ``position``)
    kind: Literal["identical", "near_tie", "mismatch", "sampled"]
    position: int | None = None  # index into the generated tokens (0 = first generated token)
    reference_token: int | None = None
    method_token: int | None = None  # None: the method's output ended there
    top2_gap: float | None = None  # reference's top-1 minus top-2 logit at that position
    token_gap: float | None = None  # reference's top-1 logit minus its logit of the method's token (None: not in top-K)

    def to_json(self) -> dict[str, Any]:
        """JSON-able dict: every field, in declaration order."""
        return dict(self.__dict__)

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> LosslessCheck:
        """The check ``to_json`` wrote (fields left out read as None)."""

        def build(d: Mapping[str, Any]) -> LosslessCheck:
            if d["kind"] not in ("identical", "near_tie", "mismatch", "sampled"):
                raise RecordError(f"unknown kind {d['kind']!r}")
            unknown = set(d) - {f.name for f in fields(cls)}
            if unknown:
                raise RecordError(f"unknown fields {sorted(unknown)}")
            return cls(**d)

        return _parse("lossless", doc, build)


# ----------------------------------------------------------------------------------------- one prompt


@dataclass(frozen=True)
class GreedyReference:
    """Plain greedy decoding of one prompt (at temperature > 0 the target's own sampling): the reference, and its
    wall time."""

    num_tokens: int
    wall_s: float
    tokens: list[int]
    logprob: float | None = None  # sampling: the target's log-prob of its tokens, summed (None when greedy)
    # evaluate.speed_baseline one_row: the same number of tokens decoded again at one row a forward, timed (the
    # speedups' baseline); None when the reference's own time is the baseline
    baseline_wall_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        doc = {"num_tokens": self.num_tokens, "wall_s": self.wall_s, "tokens": self.tokens}
        doc |= {"logprob": self.logprob} if self.logprob is not None else {}
        return doc | ({"baseline_wall_s": self.baseline_wall_s} if self.baseline_wall_s is not None else {})

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> GreedyReference:
        return _parse(
            "greedy",
            doc,
            lambda d: cls(
                int(d["num_tokens"]),
                d["wall_s"],
                _ints(d["tokens"]),
                d.get("logprob"),
                float(d["baseline_wall_s"]) if d.get("baseline_wall_s") is not None else None,
            ),
        )

    @property
    def speed_wall_s(self) -> float:
        """The wall time speedups divide: the one-row baseline's where measured, else the reference's."""
        return self.baseline_wall_s if self.baseline_wall_s is not None else self.wall_s


@dataclass(frozen=True)
class TeacherForced:
    """The drafter's first draft token at every greedy position, teacher-forced: how many equal the greedy token."""

    num_tokens: int
    num_hits: int
    wall_s: float = 0.0  # the cross-check's own time (outside every timed decode; 0 in records made before it)

    def to_json(self) -> dict[str, Any]:
        timed = {"wall_s": self.wall_s} if self.wall_s else {}  # a record made before it is written back as it was
        return {"num_tokens": self.num_tokens, "num_hits": self.num_hits, **timed}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> TeacherForced:
        return _parse(
            "teacher_forced", doc, lambda d: cls(int(d["num_tokens"]), int(d["num_hits"]), float(d.get("wall_s", 0.0)))
        )


@dataclass(frozen=True)
class MethodRun:
    """One drafting method on one prompt: output length, wall time, lossless check and one entry per verify step."""

    num_tokens: int
    wall_s: float
    lossless: LosslessCheck
    depth: list[int]  # draft depth proposed at each verify step
    accepted: list[int]  # draft tokens accepted at each verify step
    committed: list[int]  # tokens committed at each verify step (accepted + bonus, fewer where the output ends)
    tokens: list[int] | None = None  # the output, kept only when it is not identical to the greedy reference
    logprob: float | None = None  # sampling: the target's log-prob of the committed tokens, summed

    def to_json(self) -> dict[str, Any]:
        doc = {
            "num_tokens": self.num_tokens,
            "wall_s": self.wall_s,
            "lossless": self.lossless.to_json(),
            "depth": self.depth,
            "accepted": self.accepted,
            "committed": self.committed,
        }
        doc |= {"tokens": self.tokens} if self.tokens is not None else {}
        return doc | ({"logprob": self.logprob} if self.logprob is not None else {})

    @classmethod
    def from_json(cls, doc: Mapping[str, Any], what: str = "method") -> MethodRun:
        return _parse(
            what,
            doc,
            lambda d: cls(
                int(d["num_tokens"]),
                d["wall_s"],
                LosslessCheck.from_json(d["lossless"]),
                _ints(d["depth"]),
                _ints(d["accepted"]),
                _ints(d["committed"]),
                _ints(d["tokens"]) if "tokens" in d else None,
                d.get("logprob"),
            ),
        )


@dataclass(frozen=True)
class PromptRecord:
    """Everything measured on one prompt: a journal line's record and a line of prompts.jsonl."""

    index: int  # position in the planned prompt list (outputs are in this order)
    dataset: str
    id: str
    prompt_tokens: int
    greedy: GreedyReference
    teacher_forced: TeacherForced | None  # None in journals written before the cross-check existed
    methods: dict[str, MethodRun] = field(default_factory=dict)
    decode_fallbacks: dict[str, str] = field(default_factory=dict)  # steps of its process that ran eagerly: why
    category: str | None = None  # a prompt file's category of this prompt

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"index": self.index, "dataset": self.dataset, "id": self.id}
        if self.category is not None:
            doc["category"] = self.category
        doc |= {"prompt_tokens": self.prompt_tokens, "greedy": self.greedy.to_json()}
        if self.teacher_forced is not None:
            doc["teacher_forced"] = self.teacher_forced.to_json()
        doc["methods"] = {name: run.to_json() for name, run in self.methods.items()}
        if self.decode_fallbacks:
            doc["decode_fallbacks"] = dict(self.decode_fallbacks)
        return doc

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> PromptRecord:
        """The record ``to_json`` wrote; a bad one raises RecordError naming the prompt and the field."""
        what = f"evaluation record {doc.get('id', '?')!r}" if isinstance(doc, Mapping) else "evaluation record"
        return _parse(
            what,
            doc,
            lambda d: cls(
                int(d["index"]),
                str(d["dataset"]),
                str(d["id"]),
                int(d["prompt_tokens"]),
                GreedyReference.from_json(d["greedy"]),
                TeacherForced.from_json(d["teacher_forced"]) if "teacher_forced" in d else None,
                {str(name): MethodRun.from_json(run, f"method {name}") for name, run in d["methods"].items()},
                {str(k): str(v) for k, v in d.get("decode_fallbacks", {}).items()},
                str(d["category"]) if d.get("category") is not None else None,
            ),
        )


# -------------------------------------------------------------------------------------------- summaries


@dataclass(frozen=True)
class LosslessDifference:
    """A prompt whose output differs from the greedy reference, and where."""

    prompt: str  # the prompt's id
    check: LosslessCheck

    def to_json(self) -> dict[str, Any]:
        return {"prompt": self.prompt, **self.check.to_json()}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> LosslessDifference:
        return _parse(
            "lossless difference",
            doc,
            lambda d: cls(str(d["prompt"]), LosslessCheck.from_json({k: v for k, v in d.items() if k != "prompt"})),
        )


@dataclass(frozen=True)
class LosslessCounts:
    """Lossless checks of one method over some prompts, counted by kind, with every difference."""

    identical: int
    near_tie: int
    mismatch: int
    differences: list[LosslessDifference]
    sampled: int = 0  # temperature > 0: outputs with every token inside the target's sampling support

    def to_json(self) -> dict[str, Any]:
        doc = {"identical": self.identical, "near_tie": self.near_tie, "mismatch": self.mismatch}
        doc |= {"sampled": self.sampled} if self.sampled else {}
        return doc | {"differences": [d.to_json() for d in self.differences]}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> LosslessCounts:
        return _parse(
            "lossless",
            doc,
            lambda d: cls(
                int(d["identical"]),
                int(d["near_tie"]),
                int(d["mismatch"]),
                [LosslessDifference.from_json(x) for x in d["differences"]],
                int(d.get("sampled", 0)),
            ),
        )


@dataclass(frozen=True)
class SummaryRow:
    """One dataset x method of results.json (definitions in eagle3.evaluate.stage's docstring)."""

    dataset: str  # a dataset name, or "all"
    method: str
    num_prompts: int
    num_tokens: int
    num_verify: int
    accept_len: float
    per_position: list[float]
    per_position_conditional: list[float | None]
    wall_s: float
    tokens_per_s: float
    greedy_wall_s: float
    greedy_tokens_per_s: float
    speedup: float
    teacher_forced_acc_0: float | None
    lossless: LosslessCounts
    speedup_vs_ngram: float | None = None  # None when no n-gram row was measured on the same prompts
    category: str | None = None  # a row of one category of a prompt file (results.json's by_category)
    logprob_per_token: float | None = None  # sampling: the target's mean log-prob of the method's tokens
    reference_logprob_per_token: float | None = None  # ... and of the target's own sampling on the same prompts
    reference_tokens_per_s: float | None = None  # the reference's own rate, where a one-row baseline is the greedy

    def to_json(self) -> dict[str, Any]:
        """results.json's row: every field in declaration order (the last three only when set)."""
        doc = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _ROW_IF_SET}
        return (
            doc
            | {"lossless": self.lossless.to_json()}
            | {name: getattr(self, name) for name in _ROW_IF_SET if getattr(self, name) is not None}
        )

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> SummaryRow:
        """A results.json row (one written before the teacher-forced cross-check reads it as None)."""
        what = (
            f"results row {doc.get('dataset', '?')}/{doc.get('method', '?')}"
            if isinstance(doc, Mapping)
            else "results row"
        )
        optional = {"teacher_forced_acc_0", "speedup_vs_ngram", *_ROW_IF_SET}

        def build(d: Mapping[str, Any]) -> SummaryRow:
            values: dict[str, Any] = {
                f.name: d[f.name] if f.name not in optional else d.get(f.name) for f in fields(cls)
            }
            return cls(**values | {"lossless": LosslessCounts.from_json(d["lossless"])})

        return _parse(what, doc, build)


_ROW_IF_SET = ("category", "logprob_per_token", "reference_logprob_per_token", "reference_tokens_per_s")
"""SummaryRow fields results.json holds only where set (files written before them stay byte for byte)."""


# --------------------------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class MethodSpec:
    """One drafting method; names follow SGLang's steps-topk-num_draft_tokens (chain-3-1-4, tree-5-4-8)."""

    name: str
    kind: str  # chain | tree | ngram
    steps: int = 0
    topk: int = 1
    num_draft_tokens: int = 0

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> MethodSpec:
        return _parse("method spec", doc, lambda d: cls(**d))


@dataclass(frozen=True)
class PartialInfo:
    """Of a partial report: how many prompts the unfinished evaluation had measured, of how many planned."""

    num_measured: int
    num_planned: int
    num_measured_by_dataset: dict[str, int]

    def to_json(self) -> dict[str, Any]:
        return {
            "num_measured": self.num_measured,
            "num_planned": self.num_planned,
            "num_measured_by_dataset": self.num_measured_by_dataset,
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> PartialInfo:
        return _parse(
            "partial",
            doc,
            lambda d: cls(int(d["num_measured"]), int(d["num_planned"]), dict(d["num_measured_by_dataset"])),
        )


@dataclass(frozen=True)
class EvalSettings:
    """What an evaluation measured with: results.json's settings."""

    evaluate: dict[str, Any]  # the evaluate section as JSON (EvaluateConfig.model_dump)
    target: str
    target_dir: str
    target_fingerprint: str
    export_dir: str
    aux_layer_ids: list[int] | None  # as the export's config.json names them
    device: str
    gpu: str | None  # the CUDA device's name, None on CPU
    dtype: str
    max_new_tokens: int
    num_prompts: dict[str, int]  # planned prompts per dataset
    stop_ids: list[int]
    ngram: str  # the n-gram method in words
    methods: list[MethodSpec]
    num_workers: int
    torch: str
    transformers: str
    partial: PartialInfo | None = None  # only in a partial report
    decode_fallbacks: dict[str, str] = field(default_factory=dict)  # compiled steps that ran eagerly, and why
    prompt_rejects: dict[str, int] = field(default_factory=dict)  # prompt file -> lines rejected (eval/rejects.jsonl)

    def to_json(self) -> dict[str, Any]:
        optional = ("partial", "decode_fallbacks", "prompt_rejects")
        doc = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in optional}
        doc["methods"] = [m.to_json() for m in self.methods]
        if self.decode_fallbacks:
            doc["decode_fallbacks"] = dict(self.decode_fallbacks)
        if self.prompt_rejects:
            doc["prompt_rejects"] = dict(self.prompt_rejects)
        return doc | ({"partial": self.partial.to_json()} if self.partial is not None else {})

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> EvalSettings:
        def build(d: Mapping[str, Any]) -> EvalSettings:
            optional = ("methods", "partial", "decode_fallbacks", "prompt_rejects")
            values = {f.name: d[f.name] for f in fields(cls) if f.name not in optional}
            partial = PartialInfo.from_json(d["partial"]) if d.get("partial") else None
            return cls(
                **values,
                methods=[MethodSpec.from_json(m) for m in d["methods"]],
                partial=partial,
                decode_fallbacks={str(k): str(v) for k, v in d.get("decode_fallbacks", {}).items()},
                prompt_rejects={str(k): int(v) for k, v in d.get("prompt_rejects", {}).items()},
            )

        return _parse("settings", doc, build)


@dataclass(frozen=True)
class EvalResults:
    """results.json: the settings, one row per dataset x method and, for prompt files with categories, one per
    dataset x category x method (kept apart, so readers of ``results`` see each dataset once)."""

    settings: EvalSettings
    results: list[SummaryRow]
    by_category: list[SummaryRow] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        doc = {"settings": self.settings.to_json(), "results": [r.to_json() for r in self.results]}
        return doc | ({"by_category": [r.to_json() for r in self.by_category]} if self.by_category else {})

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> EvalResults:
        return _parse(
            "results.json",
            doc,
            lambda d: cls(
                EvalSettings.from_json(d["settings"]),
                [SummaryRow.from_json(r) for r in d["results"]],
                [SummaryRow.from_json(r) for r in d.get("by_category", [])],
            ),
        )
