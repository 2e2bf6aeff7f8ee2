"""Regeneration: turn-by-turn history, retries, errors, resume, limits, timeouts, HF batching."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eagle3.config import RegenerateConfig
from eagle3.data.regenerate import (
    JOURNAL_NAME,
    Completion,
    EndpointUnreachable,
    HFGenerateBackend,
    OpenAIChatBackend,
    make_backend,
    regenerate,
)
from eagle3.data.regenerate_turns import plan_turns
from eagle3.run.journal import Journal
from tests.fakes.openai_server import FakeOpenAIServer, fake_answer

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


def _conv(i: int, num_turns: int = 2, marker: str = "") -> dict[str, Any]:
    messages = [{"role": "system", "content": "be brief"}]
    for t in range(num_turns):
        messages += [
            {"role": "user", "content": f"q{i}.{t}{marker}"},
            {"role": "assistant", "content": f"ORIGINAL {i}.{t}"},
        ]
    return {"id": f"src:{i}", "source": "src", "split": "train", "messages": messages, "content_hash": f"h{i}"}


def _write_merged(path: Path, rows: list[dict[str, Any]]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMA), path)
    return path


def _cfg(server: FakeOpenAIServer, **kw: Any) -> RegenerateConfig:
    base = {"endpoint": server.base_url, "max_concurrency": 2, "timeout_s": 5.0, "max_retries": 2}
    return RegenerateConfig(**{**base, **kw})


def _backend(cfg: RegenerateConfig) -> OpenAIChatBackend:
    # Tiny backoff: the tests check retry logic, not the waiting.
    return OpenAIChatBackend(cfg, backoff_base_s=0.01, backoff_max_s=0.05)


def _read_out(paths: dict[str, Path]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    rows = pq.read_table(paths["regenerated"]).to_pylist()
    errors = [json.loads(line) for line in paths["errors"].read_text().splitlines()]
    return rows, errors


def _balanced(stats: dict[str, Any]) -> bool:
    parts = ("success", "error", "skipped_done", "skipped_source", "skipped_limit")
    return sum(stats[k] for k in parts) == stats["input"]


def test_plan_turns_answers_each_user_run_and_trailing_user():
    """Assistant turns are replaced, consecutive users get one answer, a trailing user gets one too."""
    msgs = [
        {"role": "assistant", "content": "hi"},
        {"role": "user", "content": "a"},
        {"role": "user", "content": "b"},
        {"role": "assistant", "content": "x"},
        {"role": "user", "content": "c"},
    ]
    plan = plan_turns(msgs)
    assert [p["role"] if p else None for p in plan] == ["assistant", "user", "user", None, "user", None]


def test_turn_by_turn_history_uses_regenerated_answers(tmp_path):
    """The second request carries the regenerated first answer, never the original one."""
    src = _write_merged(tmp_path / "merged.parquet", [_conv(0)])
    with FakeOpenAIServer() as server:
        paths, stats = regenerate(src, tmp_path / "out", _cfg(server), _backend(_cfg(server)))
    first, second = server.requests
    assert [m["role"] for m in first.messages] == ["system", "user"]
    sent = second.messages
    assert sent[2] == {"role": "assistant", "content": fake_answer(first.messages)}
    assert not any("ORIGINAL" in m["content"] for r in server.requests for m in r.messages)
    rows, errors = _read_out(paths)
    assert rows[0]["messages"][-1]["content"] == fake_answer(sent) and errors == []
    assert rows[0]["content_hash"] == "h0" and rows[0]["split"] == "train"
    assert stats["success"] == 1 and stats["finish_reasons"] == {"stop": 2}


def test_request_body_and_api_key_header(tmp_path, monkeypatch):
    """The body has model/messages/max_tokens/temperature and the key comes from the named env var."""
    monkeypatch.setenv("FAKE_KEY_ENV", "sk-test")
    src = _write_merged(tmp_path / "merged.parquet", [_conv(0, num_turns=1)])
    with FakeOpenAIServer() as server:
        cfg = _cfg(server, api_key_env="FAKE_KEY_ENV", model="m1", max_new_tokens=7, temperature=0.5)
        regenerate(src, tmp_path / "out", cfg, _backend(cfg))
    req = server.requests[0]
    assert req.path == "/v1/chat/completions"
    assert {k: req.body[k] for k in ("model", "max_tokens", "temperature")} == {
        "model": "m1",
        "max_tokens": 7,
        "temperature": 0.5,
    }
    assert req.headers["authorization"] == "Bearer sk-test"
    assert "sk-test" not in repr(_backend(cfg))


def test_unset_api_key_env_is_an_error(monkeypatch):
    """A configured key variable that is not set fails at construction, naming the variable."""
    monkeypatch.delenv("MISSING_KEY_ENV", raising=False)
    with pytest.raises(ValueError, match="MISSING_KEY_ENV"):
        OpenAIChatBackend(RegenerateConfig(api_key_env="MISSING_KEY_ENV"))


def test_retries_on_503_then_success(tmp_path):
    """Two 503 answers are retried and the conversation still succeeds."""
    src = _write_merged(tmp_path / "merged.parquet", [_conv(0, num_turns=1)])
    with FakeOpenAIServer(fail_first=2) as server:
        cfg = _cfg(server, max_concurrency=1)
        backend = _backend(cfg)
        paths, stats = regenerate(src, tmp_path / "out", cfg, backend)
    assert len(server.requests) == 3 and backend.num_retries == 2
    assert stats["success"] == 1 and stats["error"] == 0
    assert len(_read_out(paths)[0]) == 1


@pytest.mark.parametrize("status", [429, 500])
def test_429_and_5xx_are_retried(tmp_path, status):
    """A rate limit (429) and a server error (5xx) are retried like a 503."""
    src = _write_merged(tmp_path / "merged.parquet", [_conv(0, num_turns=1)])
    with FakeOpenAIServer(fail_first=1, fail_first_status=status) as server:
        _, stats = regenerate(src, tmp_path / "out", _cfg(server), _backend(_cfg(server)))
    assert len(server.requests) == 2 and stats["success"] == 1


def test_unreachable_endpoint_stops_the_run_without_marking_rows(tmp_path):
    """Connection refused (after retries) aborts with the endpoint named and journals no row."""
    src = _write_merged(tmp_path / "merged.parquet", [_conv(0, num_turns=1), _conv(1, num_turns=1)])
    with FakeOpenAIServer() as server:
        cfg = _cfg(server, max_retries=1)
    backend = _backend(cfg)
    with pytest.raises(EndpointUnreachable, match=server.base_url):
        regenerate(src, tmp_path / "out", cfg, backend)
    assert backend.num_requests >= 2 and backend.num_retries >= 1
    journal = tmp_path / "out" / JOURNAL_NAME
    assert not journal.exists() or journal.read_text() == ""


def test_regenerate_works_inside_a_running_event_loop(tmp_path):
    """regenerate() can be called from code that already runs an event loop (a notebook)."""
    src = _write_merged(tmp_path / "merged.parquet", [_conv(0, num_turns=1)])

    async def caller() -> dict[str, Any]:
        return regenerate(src, tmp_path / "out", _cfg(server), _backend(_cfg(server)))[1]

    with FakeOpenAIServer() as server:
        stats = asyncio.run(caller())
    assert stats["success"] == 1


def test_permanent_failures_go_to_errors_with_reason(tmp_path):
    """503 forever, 400 and empty content become error records; no half conversation is written."""
    rows = [_conv(0), _conv(1, marker=" FAIL"), _conv(2, marker=" BAD"), _conv(3, marker=" EMPTY")]
    src = _write_merged(tmp_path / "merged.parquet", rows)
    with FakeOpenAIServer(fail_marker="FAIL", bad_marker="BAD", empty_marker="EMPTY") as server:
        paths, stats = regenerate(src, tmp_path / "out", _cfg(server), _backend(_cfg(server)))
    out, errors = _read_out(paths)
    assert [r["id"] for r in out] == ["src:0"]
    by_id = {e["id"]: e for e in errors}
    assert by_id["src:1"]["error_type"] == "http_503" and by_id["src:1"]["attempts"] == 3
    assert by_id["src:2"]["error_type"] == "http_400" and by_id["src:2"]["attempts"] == 1
    assert by_id["src:3"]["error_type"] == "empty_content" and "empty" in by_id["src:3"]["message"]
    bad_requests = [r for r in server.requests if "BAD" in r.last_user]
    assert len(bad_requests) == 1, "a 400 must not be retried"
    assert stats["success"] == 1 and stats["error"] == 3 and _balanced(stats)


class _Abort(BaseException):
    """Stands in for a kill (Ctrl-C, OOM): not an Exception, so nothing may swallow it."""


class _DyingBackend:
    """Wraps a backend and aborts on the first turn after ``num_ok`` completed conversations."""

    def __init__(self, inner: OpenAIChatBackend, num_ok: int):
        self.inner, self.num_ok = inner, num_ok
        self.max_parallel = inner.max_parallel
        self.session = inner.session

    async def complete(self, messages: list[dict[str, str]], request_id: str) -> Completion:
        if int(request_id.split(":")[1].split("#")[0]) >= self.num_ok:
            raise _Abort()
        return await self.inner.complete(messages, request_id)


def test_resume_after_abort_skips_done_rows_and_matches_clean_run(tmp_path):
    """After a kill, done rows are not re-sent and the final parquet equals an uninterrupted run's."""
    src = _write_merged(tmp_path / "merged.parquet", [_conv(i) for i in range(5)])
    with FakeOpenAIServer() as server:
        cfg = _cfg(server, max_concurrency=1)
        with pytest.raises(_Abort):
            regenerate(src, tmp_path / "out", cfg, _DyingBackend(_backend(cfg), num_ok=2))
        assert not (tmp_path / "out" / "regenerated.parquet").exists()
        journal = (tmp_path / "out" / JOURNAL_NAME).read_text().splitlines()
        assert [json.loads(line)["id"] for line in journal] == ["src:0", "src:1"]
        num_before = len(server.requests)
        paths, stats = regenerate(src, tmp_path / "out", cfg, _backend(cfg))
        resent = {r.messages[1]["content"].split(".")[0] for r in server.requests[num_before:]}
        clean_paths, _ = regenerate(src, tmp_path / "clean", cfg, _backend(cfg))
    assert resent == {"q2", "q3", "q4"}
    assert stats["skipped_done"] == 2 and stats["success"] == 3 and _balanced(stats)
    resumed = pq.read_table(paths["regenerated"])
    assert resumed.column("id").to_pylist() == [f"src:{i}" for i in range(5)]
    assert resumed.equals(pq.read_table(clean_paths["regenerated"]))


def test_torn_journal_line_is_ignored_and_redone(tmp_path):
    """A half-written last journal line (killed mid-write) is dropped and that row is redone."""
    src = _write_merged(tmp_path / "merged.parquet", [_conv(0, num_turns=1), _conv(1, num_turns=1)])
    out = tmp_path / "out"
    with FakeOpenAIServer() as server:
        cfg = _cfg(server)
        regenerate(src, out, cfg, _backend(cfg))
        lines = (out / JOURNAL_NAME).read_text().splitlines()
        (out / JOURNAL_NAME).write_text(lines[0] + "\n" + lines[1][:10])
        _, stats = regenerate(src, out, cfg, _backend(cfg))
    assert stats["skipped_done"] == 1 and stats["success"] == 1
    assert len(pq.read_table(out / "regenerated.parquet")) == 2


def test_errors_are_done_unless_retry_errors(tmp_path):
    """A journaled error is not re-sent on resume, but is with retry_errors=True."""
    src = _write_merged(tmp_path / "merged.parquet", [_conv(0, num_turns=1, marker=" FAIL")])
    with FakeOpenAIServer(fail_marker="FAIL") as server:
        cfg = _cfg(server, max_retries=0)
        regenerate(src, tmp_path / "out", cfg, _backend(cfg))
        _, again = regenerate(src, tmp_path / "out", cfg, _backend(cfg))
        assert len(server.requests) == 1 and again["skipped_done"] == 1
        _, retried = regenerate(src, tmp_path / "out", cfg, _backend(cfg), retry_errors=True)
    assert len(server.requests) == 2 and retried["error"] == 1 and _balanced(retried)


def test_max_conversations_keeps_original_answers_beyond_limit(tmp_path):
    """Rows beyond max_conversations are not sent, count as skipped_limit and keep their answers."""
    rows = [_conv(i) for i in range(4)]
    src = _write_merged(tmp_path / "merged.parquet", rows)
    with FakeOpenAIServer() as server:
        cfg = _cfg(server, max_conversations=2)
        paths, stats = regenerate(src, tmp_path / "out", cfg, _backend(cfg))
    assert {r.messages[1]["content"].split(".")[0] for r in server.requests} == {"q0", "q1"}
    out, _ = _read_out(paths)
    assert [r["id"] for r in out] == [r["id"] for r in rows]
    assert out[2]["messages"] == rows[2]["messages"] and out[3]["messages"] == rows[3]["messages"]
    assert "ORIGINAL" not in out[0]["messages"][2]["content"]
    assert stats["skipped_limit"] == 2 and stats["success"] == 2 and _balanced(stats)


def test_stalling_server_times_out_into_an_error(tmp_path):
    """A server that answers only after 10 s yields a 'timeout' error (0.3 s) after 1 retry: 2 sends, no answer kept."""
    src = _write_merged(tmp_path / "merged.parquet", [_conv(0, num_turns=1, marker=" STALL"), _conv(1)])
    with FakeOpenAIServer(stall_marker="STALL", stall_s=10.0) as server:
        cfg = _cfg(server, timeout_s=0.3, max_retries=1)
        paths, stats = regenerate(src, tmp_path / "out", cfg, _backend(cfg))
    out, errors = _read_out(paths)
    assert [r["id"] for r in out] == ["src:1"] and sum("STALL" in r.last_user for r in server.requests) == 2
    assert errors == [{"id": "src:0", "error_type": "timeout", "message": errors[0]["message"], "attempts": 2}]
    assert _balanced(stats)


def test_progress_callback_reports_counts(tmp_path):
    """The progress callback ends at done == total with success/error counts in info."""
    src = _write_merged(tmp_path / "merged.parquet", [_conv(0, num_turns=1), _conv(1, num_turns=1, marker=" BAD")])
    calls: list[tuple[int, int, dict[str, Any]]] = []
    with FakeOpenAIServer(bad_marker="BAD") as server:
        regenerate(
            src,
            tmp_path / "out",
            _cfg(server),
            _backend(_cfg(server)),
            progress=lambda d, t, info: calls.append((d, t, info)),
        )
    with_counts = [c for c in calls if "success" in c[2]]
    assert calls[-1][:2] == (2, 2)
    assert with_counts[-1][2]["success"] == 1 and with_counts[-1][2]["error"] == 1


def test_make_backend_hf_requires_model():
    """make_backend picks by cfg.backend and refuses hf without a model and tokenizer."""
    assert isinstance(make_backend(RegenerateConfig()), OpenAIChatBackend)
    with pytest.raises(ValueError, match="model and tokenizer"):
        make_backend(RegenerateConfig(backend="hf"))


@pytest.fixture(scope="module")
def tiny_target():
    tiny = pytest.importorskip("eagle3.target.tiny")
    from eagle3.config import TinyTargetConfig

    tokenizer = tiny.build_tiny_tokenizer(chat_template="chatml")
    model = tiny.build_tiny_model(tokenizer, TinyTargetConfig(), seed=0)
    return model.eval(), tokenizer


class _RecordingHF(HFGenerateBackend):
    """Notes the size of every generate batch."""

    def __init__(self, *args: Any):
        super().__init__(*args)
        self.batch_sizes: list[int] = []

    def generate_batch(self, conversations):
        self.batch_sizes.append(len(conversations))
        return super().generate_batch(conversations)


def test_hf_backend_batched_equals_one_at_a_time(tmp_path, tiny_target):
    """Greedy HF regeneration batches k-th turns together, equals one-at-a-time output and is deterministic."""
    model, tokenizer = tiny_target
    rows = [_conv(0, num_turns=2), _conv(1, num_turns=1), _conv(2, num_turns=2)]
    rows[1]["messages"][1]["content"] = "a much longer first question to force left padding"
    src = _write_merged(tmp_path / "merged.parquet", rows)
    outs, sizes = {}, {}
    for name, width in (("batched", 3), ("single", 1), ("again", 3)):
        cfg = RegenerateConfig(backend="hf", batch_size_conversations=width, max_new_tokens=8)
        backend = _RecordingHF(model, tokenizer, cfg)
        paths, stats = regenerate(src, tmp_path / name, cfg, backend)
        outs[name], sizes[name] = pq.read_table(paths["regenerated"]).to_pylist(), backend.batch_sizes
        assert stats["success"] + stats["error"] == 3 and _balanced(stats)
        assert stats["generation"]["rows"] == 5 and stats["generation"]["calls"] == len(backend.batch_sizes)
    assert sizes["batched"] == [3, 2] and sizes["single"] == [1] * 5
    assert outs["batched"] == outs["single"] == outs["again"]
    assert all("ORIGINAL" not in m["content"] for r in outs["batched"] for m in r["messages"])


def test_hf_backend_stops_at_eos_and_decodes_only_new_tokens(tiny_target):
    """Answers are the decoded new tokens of plain greedy generate, cut at the first eos id."""
    import copy

    model, tokenizer = tiny_target
    conv = [{"role": "user", "content": "hello there"}]
    prompt = tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids
    new = model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1] :].tolist()
    cfg = RegenerateConfig(backend="hf", max_new_tokens=8)
    [full] = HFGenerateBackend(model, tokenizer, cfg).generate_batch([conv])
    assert full == Completion(tokenizer.decode(new, skip_special_tokens=True), "length")
    cut = next(
        k for k in range(2, 8) if new[k] not in new[:k] and tokenizer.decode(new[:k], skip_special_tokens=True).strip()
    )
    stopping = copy.deepcopy(model)
    stopping.generation_config.eos_token_id = [tokenizer.eos_token_id, new[cut]]
    [short] = HFGenerateBackend(stopping, tokenizer, cfg).generate_batch([conv])
    assert short == Completion(tokenizer.decode(new[:cut], skip_special_tokens=True), "stop")


def test_plan_turns_max_user_turns_stops_after_that_many_answers():
    """max_user_turns=1 keeps the system prompt and first user turn, one answer slot, and nothing after it."""
    msgs = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "x"},
        {"role": "user", "content": "b"},
        {"role": "assistant", "content": "y"},
    ]
    plan = plan_turns(msgs, max_user_turns=1)
    assert [p["content"] if p else None for p in plan] == ["s", "a", None]
    assert [p["content"] if p else None for p in plan_turns(msgs, max_user_turns=2)] == ["s", "a", None, "b", None]


def test_journal_keeps_records_with_unicode_line_separators(tmp_path):
    """A journaled answer holding U+2028 / U+0085 (left unescaped by json.dumps) is read back whole."""
    journal = Journal(tmp_path / JOURNAL_NAME)
    texts = ["one\u2028two", "three\x85four\u2029", "plain"]
    with journal.appender() as append:
        for i, text in enumerate(texts):
            append({"id": f"src:{i}", "status": "ok", "messages": [{"role": "assistant", "content": text}]})
    loaded = journal.load()
    assert [loaded[f"src:{i}"]["messages"][0]["content"] for i in range(3)] == texts


def test_journal_answers_for_fewer_user_turns_are_redone(tmp_path):
    """A row journaled under max_user_turns=1 is regenerated when all turns are asked for; a one-turn row is not."""
    src = _write_merged(tmp_path / "merged.parquet", [_conv(0, num_turns=2), _conv(1, num_turns=1)])
    out = tmp_path / "out"
    with FakeOpenAIServer() as server:
        regenerate(src, out, _cfg(server, max_user_turns=1), _backend(_cfg(server)))
        cfg = _cfg(server)
        paths, stats = regenerate(src, out, cfg, _backend(cfg))
    assert stats["skipped_done"] == 1 and stats["success"] == 1
    answered = [
        sum(m["role"] == "assistant" for m in r)
        for r in pq.read_table(paths["regenerated"]).column("messages").to_pylist()
    ]
    assert answered == [2, 1]


def test_hf_static_backend_regenerates_like_dynamic_and_resumes(tmp_path, tiny_target):
    """generation_backend=static (fixed batch, bucketed padding) writes the dynamic run's parquet; a re-run skips all
    rows."""
    model, tokenizer = tiny_target
    rows = [_conv(0, num_turns=2), _conv(1, num_turns=1), _conv(2, num_turns=2)]
    rows[1]["messages"][1]["content"] = "a much longer first question to force left padding"
    src = _write_merged(tmp_path / "merged.parquet", rows)
    outs = {}
    try:
        for name in ("dynamic", "static"):
            cfg = RegenerateConfig(
                backend="hf", batch_size_conversations=2, max_new_tokens=8, generation_backend=name, prompt_bucket=16
            )
            paths, stats = regenerate(src, tmp_path / name, cfg, HFGenerateBackend(model, tokenizer, cfg))
            outs[name] = pq.read_table(paths["regenerated"]).to_pylist()
            assert stats["success"] + stats["error"] == 3 and _balanced(stats)
        _, again = regenerate(src, tmp_path / "static", cfg, HFGenerateBackend(model, tokenizer, cfg))
    finally:
        model.set_attn_implementation("sdpa")
    assert outs["static"] == outs["dynamic"]
    assert again["skipped_done"] == 3 and again["success"] == 0


def test_hf_regenerates_every_user_turn_on_the_regenerated_history(tmp_path, tiny_target):
    """max_user_turns unset: each of three user turns is answered by the tiny target, each request carrying the
    target's earlier answers (never the originals), and the output holds exactly those answers."""
    model, tokenizer = tiny_target
    src = _write_merged(tmp_path / "merged.parquet", [_conv(0, num_turns=3), _conv(1, num_turns=1)])
    cfg = RegenerateConfig(backend="hf", batch_size_conversations=2, max_new_tokens=6)
    assert cfg.max_user_turns is None
    backend = _RecordingHF(model, tokenizer, cfg)
    sent: list[list[dict[str, str]]] = []
    original = backend.generate_batch
    backend.generate_batch = lambda convs: (sent.extend(convs), original(convs))[1]
    paths, stats = regenerate(src, tmp_path / "out", cfg, backend)
    rows = {r["id"]: r["messages"] for r in pq.read_table(paths["regenerated"]).to_pylist()}
    three = rows["src:0"]
    assert [m["role"] for m in three] == ["system"] + ["user", "assistant"] * 3
    assert [m["content"] for m in three if m["role"] == "user"] == ["q0.0", "q0.1", "q0.2"]
    requests = [c for c in sent if c[1]["content"] == "q0.0"]
    assert [len(c) for c in requests] == [2, 4, 6]  # system + u1; + a1', u2; + a2', u3
    assert requests[1][:3] == three[:3] and requests[2][:5] == three[:5]  # each turn saw the regenerated answers
    assert all("ORIGINAL" not in m["content"] for c in sent for m in c)
    assert stats["num_turns"] == 4 and stats["success"] == 2 and _balanced(stats)


def test_rows_of_kept_sources_are_copied_without_requests(tmp_path):
    """Rows of keep_sources (synthetic: answered by the target already) are copied as they are, counted as
    skipped_source, and never sent."""
    rows = [_conv(0), {**_conv(1), "id": "syn:1", "source": "syn"}, _conv(2)]
    src = _write_merged(tmp_path / "merged.parquet", rows)
    with FakeOpenAIServer() as server:
        cfg = _cfg(server)
        paths, stats = regenerate(src, tmp_path / "out", cfg, _backend(cfg), keep_sources=frozenset({"syn"}))
    out, errors = _read_out(paths)
    assert [r["id"] for r in out] == ["src:0", "syn:1", "src:2"] and errors == []
    assert out[1] == {**rows[1], "truncated_turns": []} and "ORIGINAL" not in out[0]["messages"][2]["content"]
    assert stats["skipped_source"] == 1 and stats["success"] == 2 and _balanced(stats)
    assert not any("q1." in m["content"] for r in server.requests for m in r.messages)


def test_sources_with_keep_answers_are_kept_like_synthetic_ones_and_the_old_keys_stay():
    """keep_answers puts a file source beside the synthetic ones in the rows regeneration copies; a synthetic
    source cannot set it; left at its default it does not enter the data section's key."""
    from eagle3.config import load_config
    from eagle3.config_base import key_fields
    from eagle3.run.stages import kept_answer_sources

    two = "[{name: a, path: 'pkg://eagle3/assets/tiny_chats.jsonl'}, {name: s, format: synthetic}"
    cfg = load_config("tiny", [f"data.sources={two}, {{name: b, path: x.json, keep_answers: true}}]"])
    assert kept_answer_sources(cfg) == frozenset({"s", "b"})
    assert kept_answer_sources(load_config("tiny", [f"data.sources={two}]"])) == frozenset({"s"})
    with pytest.raises(Exception, match="keep_answers is for file sources"):
        load_config("tiny", ["data.sources=[{name: s, format: synthetic, keep_answers: true}]"])
    assert "keep_answers" not in str(key_fields(load_config("tiny", [f"data.sources={two}]"]).data))


def test_answers_cut_at_the_token_cap_are_listed_by_message_index(tmp_path):
    """An answer the server ends with finish_reason length is named in truncated_turns by its index in the
    regenerated messages (also for rows rebuilt from the journal); finished answers and kept rows are not."""
    rows = [_conv(0, marker=""), _conv(1, num_turns=3)]
    rows[1]["messages"][3]["content"] += " CUT"  # the second user turn of row 1: messages [sys, u, a, u*, a, u, a]
    src = _write_merged(tmp_path / "merged.parquet", rows)
    with FakeOpenAIServer(length_marker="CUT") as server:
        paths, stats = regenerate(src, tmp_path / "out", _cfg(server), _backend(_cfg(server)))
    out, _ = _read_out(paths)
    assert [r["truncated_turns"] for r in out] == [[], [4]]
    assert out[1]["messages"][4]["role"] == "assistant" and stats["finish_reasons"] == {"length": 1, "stop": 4}
    again, _ = _read_out(regenerate(src, tmp_path / "out", _cfg(server), _backend(_cfg(server)))[0])
    assert again == out  # from the journal alone: the server is closed


def test_retry_jitter_stays_within_its_ceiling_and_never_moves_the_process_random_stream():
    """Backoff draws full jitter up to base * 2**(attempt-1) (capped), from a generator of its own: a regeneration
    retrying beside training in one process leaves python's global random stream where it was."""
    import random

    from eagle3.config import RegenerateConfig
    from eagle3.data.chat_backends import OpenAIChatBackend

    backend = OpenAIChatBackend(RegenerateConfig(api_key_env=None), backoff_base_s=1.0, backoff_max_s=5.0)
    random.seed(7)
    before = random.getstate()
    waits = [backend._backoff_s(attempt, 0.0) for attempt in (1, 2, 3, 4, 5) for _ in range(50)]
    assert random.getstate() == before
    for i, attempt in enumerate((1, 2, 3, 4, 5)):
        assert all(0.0 <= w <= min(5.0, 2 ** (attempt - 1)) for w in waits[50 * i : 50 * (i + 1)])
    assert backend._backoff_s(1, 3.0) >= 3.0  # a server's Retry-After is honoured (up to the cap)
