"""Sliced regeneration without Prefect: balanced disjoint slices, one journal per slice, and a merge whose outputs
are byte-identical to a one-process run (also after a slice is killed and run again, or the parent is)."""

from __future__ import annotations

import contextlib
import json
import random
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eagle3.config import RegenerateConfig
from eagle3.data.regenerate import (
    JOURNAL_NAME,
    Completion,
    CompletionError,
    pending_work,
    regenerate,
    slice_journal_path,
    slice_journals,
)
from eagle3.data.regenerate_slices import (
    SLICES_NAME,
    AnsweredCounter,
    plan_slices,
    read_slice,
    regenerate_slice,
    regenerate_sliced,
    write_slice_plan,
)
from eagle3.run.slices import split_balanced
from tests.fakes.openai_server import fake_answer

MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string())])
SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("source", pa.string()),
        ("split", pa.string()),
        ("messages", pa.list_(MESSAGE)),
        ("content_hash", pa.string()),
    ]
)
CFG = RegenerateConfig(num_slices=3, max_concurrency=2)


class _Kill(BaseException):
    """Stands in for SIGKILL of a slice's process: not an Exception, so nothing may swallow it."""


class FakeBackend:
    """A fake ChatBackend answering in-process like tests/fakes/openai_server.py (same text for the same history);
    a last user turn containing "BAD" is a row error; after ``die_after`` answered conversations it raises _Kill."""

    def __init__(self, die_after: int | None = None):
        self.max_parallel, self.die_after = 2, die_after
        self.answered: list[str] = []  # conversation ids whose first turn was asked

    @contextlib.asynccontextmanager
    async def session(self):
        yield

    async def complete(self, messages: list[dict[str, str]], request_id: str) -> Completion:
        conv = request_id.split("#")[0]
        if request_id.endswith("#0"):
            if self.die_after is not None and len(self.answered) >= self.die_after:
                raise _Kill()
            self.answered.append(conv)
        if "BAD" in messages[-1]["content"]:
            raise CompletionError("http_400", "fake bad request")
        return Completion(fake_answer(messages), "stop")


def _rows(num: int, seed: int = 0) -> list[dict[str, Any]]:
    """Conversations of 1-3 user turns and uneven lengths; every seventh one fails."""
    rng = random.Random(seed)
    rows = []
    for i in range(num):
        messages = []
        for t in range(rng.randint(1, 3)):
            text = f"q{i}.{t} " + "x" * rng.randint(0, 200) + (" BAD" if i % 7 == 3 else "")
            messages += [{"role": "user", "content": text}, {"role": "assistant", "content": f"ORIGINAL {i}.{t}"}]
        rows.append(
            {"id": f"src:{i}", "source": "src", "split": "train", "messages": messages, "content_hash": f"h{i}"}
        )
    return rows


def _merged(tmp_path: Path, rows: list[dict[str, Any]]) -> Path:
    path = tmp_path / "merged.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMA), path)
    return path


def _in_turn(src: Path, out: Path, backends: dict[int, FakeBackend] | None = None):
    """A SliceRunner that runs the slices one after another in this process (a fake of the flow runs)."""

    def run(num_slices, poll):
        for k in range(num_slices):
            regenerate_slice(src, out, CFG, (backends or {}).get(k, FakeBackend()), k)
            poll()

    return run


def _outputs(out: Path) -> tuple[bytes, bytes]:
    return (out / "regenerated.parquet").read_bytes(), (out / "regenerate_errors.jsonl").read_bytes()


@pytest.mark.parametrize("seed", range(20))
def test_split_balanced_is_disjoint_covering_and_balanced(seed):
    """Every item lands in exactly one slice in the input's order, and the heaviest slice exceeds an even split
    by at most one item's weight."""
    rng = random.Random(seed)
    weights = {f"id{i}": rng.randint(0, 1000) for i in rng.sample(range(500), rng.randint(1, 80))}
    n = rng.randint(1, 8)
    slices = split_balanced(weights, n)
    flat = [k for s in slices for k in s]
    assert sorted(flat) == sorted(weights) and len(flat) == len(set(flat))
    assert len(slices) == min(n, len(weights))
    order = list(weights)
    assert all(s == sorted(s, key=order.index) for s in slices)
    loads = [sum(weights[k] for k in s) for s in slices]
    assert max(loads) <= sum(loads) / len(slices) + max(weights.values())


def test_plan_slices_golden_split_by_characters(tmp_path):
    """Conversations are weighed by characters: golden slices of five conversations over two slices."""
    rows = [
        {"id": f"c{i}", "messages": [{"role": "user", "content": "x" * n}]}
        for i, n in enumerate([50, 300, 120, 110, 90])
    ]
    work = pending_work(
        _merged(tmp_path, [{**r, "source": "s", "split": "train", "content_hash": r["id"]} for r in rows]),
        tmp_path / "out",
        CFG,
    )
    # heaviest first: c1 (300) -> 0; c2 (120), c3 (110), c4 (90) -> 1 (320); c0 (50) -> 0 (350); shortest first
    assert plan_slices(work, 2) == [["c0", "c1"], ["c4", "c3", "c2"]]
    assert plan_slices(work, 1) == [[r["id"] for r in work.todo]]


def test_three_slices_write_the_same_bytes_as_one_process(tmp_path):
    """Regenerated parquet and errors file of a 3-slice run equal a one-process run's byte for byte; each
    conversation was asked of exactly one slice, and the slice journals are folded into the main one."""
    rows = _rows(40)
    src = _merged(tmp_path, rows)
    regenerate(src, tmp_path / "one", CFG, FakeBackend())
    backends = {k: FakeBackend() for k in range(3)}
    paths, stats = regenerate_sliced(src, tmp_path / "three", CFG, _in_turn(src, tmp_path / "three", backends))
    assert _outputs(tmp_path / "three") == _outputs(tmp_path / "one")
    asked = [c for b in backends.values() for c in b.answered]
    assert sorted(asked) == sorted(r["id"] for r in rows) and all(b.answered for b in backends.values())
    plan = json.loads((tmp_path / "three" / SLICES_NAME).read_text())["slices"]
    assert [sorted(b.answered) for b in backends.values()] == [sorted(s) for s in plan]
    assert slice_journals(tmp_path / "three") == []
    errors = sum(i % 7 == 3 for i in range(40))
    assert (stats["success"], stats["error"], stats["skipped_done"]) == (40 - errors, errors, 0)


def test_a_killed_slice_run_again_skips_its_journal_and_the_output_is_unchanged(tmp_path):
    """Slice 1 is killed after 3 conversations; run again it asks only the rest of its slice, and the merged output
    equals a one-process run's."""
    src = _merged(tmp_path, _rows(30))
    regenerate(src, tmp_path / "one", CFG, FakeBackend())
    out, again = tmp_path / "three", FakeBackend()

    def run(num_slices, poll):
        for k in range(num_slices):
            with contextlib.suppress(_Kill):
                regenerate_slice(src, out, CFG, FakeBackend(die_after=3 if k == 1 else None), k)
        assert len(slice_journals(out)) == 3 and poll() is None
        regenerate_slice(src, out, CFG, again, 1)  # what a re-submitted slice run does

    regenerate_sliced(src, out, CFG, run)
    assert len(again.answered) == len(read_slice(out, 1)) - 3
    assert _outputs(out) == _outputs(tmp_path / "one")


def test_a_killed_parent_plans_only_what_the_slices_did_not_answer(tmp_path):
    """The parent dies while slices run: the next sliced run folds their journals first and slices only the rest,
    and its output equals a one-process run's."""
    rows = _rows(30)
    src = _merged(tmp_path, rows)
    regenerate(src, tmp_path / "one", CFG, FakeBackend())
    out = tmp_path / "three"

    def dying(num_slices, poll):
        regenerate_slice(src, out, CFG, FakeBackend(), 0)
        with contextlib.suppress(_Kill):
            regenerate_slice(src, out, CFG, FakeBackend(die_after=2), 2)
        raise _Kill()

    with pytest.raises(_Kill):
        regenerate_sliced(src, out, CFG, dying)
    first = json.loads((out / SLICES_NAME).read_text())["slices"]
    done = set(first[0]) | {json.loads(line)["id"] for line in slice_journal_path(out, 2).read_text().splitlines()}
    _, stats = regenerate_sliced(src, out, CFG, _in_turn(src, out))
    second = json.loads((out / SLICES_NAME).read_text())["slices"]
    assert sorted(i for s in second for i in s) == sorted(r["id"] for r in rows if r["id"] not in done)
    assert stats["skipped_done"] == len(done)
    assert _outputs(out) == _outputs(tmp_path / "one")


def test_a_slice_that_ended_without_answering_stops_the_merge(tmp_path):
    """When a runner returns but a slice's conversations have no record, no output is written and the error
    names how many are missing."""
    src = _merged(tmp_path, _rows(12))
    with pytest.raises(RuntimeError, match=r"conversations planned for slices have no answer"):
        regenerate_sliced(
            src, tmp_path / "out", CFG, lambda n, poll: regenerate_slice(src, tmp_path / "out", CFG, FakeBackend(), 0)
        )
    assert not (tmp_path / "out" / "regenerated.parquet").exists()


def test_answered_counter_reads_only_new_whole_lines(tmp_path):
    """The parent's progress counts distinct wanted ids over the slice journals; a line still being written
    counts once it is complete, a torn one never."""
    path0, path1 = slice_journal_path(tmp_path, 0), slice_journal_path(tmp_path, 1)
    count = AnsweredCounter(tmp_path, ["a", "b", "c"])
    path0.write_text('{"id": "a"}\n{"id": "zz"}\n{"id": "b"')
    assert count() == 1
    with open(path0, "a") as fh:
        fh.write('}\n{"id": "c", "tor\n')
    path1.write_text('{"id": "a"}\n')
    assert count() == 2 and count.answered == {"a", "b"}


def test_a_missing_slice_plan_is_an_error_naming_the_file(tmp_path):
    """A slice run with no plan, or an index outside it, fails with the plan's path and the reason."""
    with pytest.raises(ValueError, match=SLICES_NAME):
        read_slice(tmp_path, 0)
    (tmp_path / SLICES_NAME).write_text(json.dumps({"slices": [["a"]]}))
    with pytest.raises(ValueError, match="there is no slice 1"):
        read_slice(tmp_path, 1)
    assert JOURNAL_NAME not in {p.name for p in tmp_path.iterdir()}


def test_a_slice_result_carries_its_in_process_backends_generation_figures(tmp_path):
    """A slice answered by a backend that keeps GenerationStats (the in-process one) returns them; others None."""
    from types import SimpleNamespace

    from eagle3.data.generate import GenerationStats

    class CountingBackend(FakeBackend):
        def __init__(self):
            super().__init__()
            self.generator = SimpleNamespace(stats=GenerationStats())

        async def complete(self, messages, request_id):
            out = await super().complete(messages, request_id)
            self.generator.stats.add("dynamic", 1, 1, len(out.content.split()), len(out.content.split()), 0.01)
            return out

    src = _merged(tmp_path, _rows(12))
    out = tmp_path / "out"
    work = pending_work(src, out, CFG)
    write_slice_plan(out, plan_slices(work, CFG.num_slices))
    counting = CountingBackend()
    stats = regenerate_slice(src, out, CFG, counting, 0)
    assert stats.generation == counting.generator.stats.to_json() and stats.generation["calls"] > 0
    assert stats.to_json()["generation"]["rows"] == stats.generation["calls"]
    assert regenerate_slice(src, out, CFG, FakeBackend(), 1).generation is None
