"""The deploy benchmark client (infra/sglang_bench.py) against the FAKE SGLang server, plus its pure arithmetic.

The fake (tests/fakes/sglang_server.py) invents acceptance and timing; these tests check the client's
arithmetic, request hygiene and refusals, never a figure of SGLang.
"""

from __future__ import annotations

import json
import math

import pytest

import infra.sglang_bench
from infra.sglang import ServerSpec
from infra.sglang_bench import BenchmarkError, check_bench_answer, run_benchmark
from infra.sglang_bench_records import (
    BenchResult,
    BenchSettings,
    LevelResult,
    MeasurementError,
    RequestSample,
    fixed_prompts,
    nearest_rank,
    summarize_level,
)
from infra.sglang_compare import LevelComparison, compare, compare_groups, render_report, where_it_pays
from infra.sglang_probe import ProbeExpectations, ServerCheckError, probe_ready
from infra.sglang_spec import ServerSpecError
from tests.fakes.clock import FakeClock
from tests.fakes.sglang_model import FakeServing, Faults, LaunchArgs
from tests.fakes.sglang_server import FakeSGLangServer

SPEC_FLAGS = dict(
    speculative_algorithm="EAGLE3",
    speculative_draft_model_path="/d",
    speculative_num_steps=3,
    speculative_eagle_topk=1,
    speculative_num_draft_tokens=4,
)
SETTINGS = BenchSettings((1, 4), num_prompts=8, max_new_tokens=16, num_warmup=2, request_timeout_s=20)


def baseline_fake(faults: Faults | None = None, **serving) -> FakeSGLangServer:
    return FakeSGLangServer(LaunchArgs(max_running_requests=32), faults or Faults(), FakeServing(**serving))


def spec_fake(faults: Faults | None = None, **serving) -> FakeSGLangServer:
    return FakeSGLangServer(
        LaunchArgs(max_running_requests=32, **SPEC_FLAGS), faults or Faults(), FakeServing(**serving)
    )


def bench(fake: FakeSGLangServer, settings: BenchSettings = SETTINGS) -> BenchResult:
    return run_benchmark(fake.base_url, fixed_prompts(settings.num_prompts), settings, speculative=fake.speculative)


def sample(index: int, completion: int, verify: int | None, latency: float, ttft: float) -> RequestSample:
    return RequestSample(index, latency, ttft, completion, 0, verify, f"d{index}")


# ---------------------------------------------------------------- arithmetic


def test_acceptance_length_is_total_tokens_over_total_verify_steps():
    """accept length = sum completion / sum verify_ct (64/22), not the mean of per-request ratios (3.07)."""
    samples = [sample(0, 16, 4, 1.0, 0.1), sample(1, 16, 8, 2.0, 0.2), sample(2, 32, 10, 4.0, 0.4)]
    level = summarize_level(4, samples, duration_s=8.0, speculative=True)
    assert level.accept_length == pytest.approx(64 / 22)
    assert (level.completion_tokens, level.spec_verify_ct, level.output_tok_per_s) == (64, 22, 8.0)
    assert (level.median_latency_s, level.p90_latency_s, level.median_ttft_s) == (2.0, 4.0, 0.2)
    # TPOT per request: (1.0-0.1)/15 = 0.06, (2.0-0.2)/15 = 0.12, (4.0-0.4)/31 = 0.1161...; median 0.1161
    assert level.median_tpot_ms == pytest.approx(1000 * 3.6 / 31)


def test_a_baseline_level_has_no_acceptance_length():
    """A baseline's samples carry no verify steps, and its level reports none."""
    level = summarize_level(1, [sample(0, 16, None, 1.0, 0.1)], duration_s=1.0, speculative=False)
    assert level.accept_length is None and level.spec_verify_ct is None


def test_nearest_rank_quantiles():
    """p90 of 1..10 is 9, the median of 1..10 is 5 (nearest rank), of [3] is 3."""
    assert (nearest_rank(range(1, 11), 0.9), nearest_rank(range(1, 11), 0.5), nearest_rank([3], 0.9)) == (9, 5, 3)


def test_fixed_prompts_are_distinct_and_deterministic():
    """Prompt sets are reproducible and have no duplicates (a duplicate would hit the prefix cache)."""
    assert fixed_prompts(100) == fixed_prompts(100) and len(set(fixed_prompts(100))) == 100


def _result(
    speculative: bool, tok_per_s: list[float], accept: list[float] | None = None, **server: object
) -> BenchResult:
    levels = tuple(
        LevelResult(
            c,
            8,
            1.0,
            128,
            t,
            0.1,
            0.2,
            0.01,
            5.0,
            0,
            10 if accept else None,
            accept[i] if accept else None,
            None,
            ("a",) * 8,
        )
        for i, (c, t) in enumerate(zip(SETTINGS.concurrency_levels, tok_per_s))
    )
    settings = {"model_path": "M", "max_running_requests": 32} | server
    return BenchResult("http://x", speculative, SETTINGS, "p", settings, levels)


def test_compare_gives_the_throughput_ratio_per_level():
    """speedup = spec tok/s / baseline tok/s at each level; identical outputs are counted."""
    rows = compare(_result(False, [100.0, 300.0]), _result(True, [250.0, 450.0], accept=[3.0, 3.0]))
    assert [r.speedup for r in rows] == [2.5, 1.5] and [r.identical_outputs for r in rows] == [8, 8]


def test_speedup_above_acceptance_length_is_a_measurement_error():
    """A 3.2x speedup with acceptance length 3.0 cannot be real: MeasurementError names the level."""
    with pytest.raises(MeasurementError, match="concurrency 4: speedup 3.200 > acceptance length 3.000"):
        compare(_result(False, [100.0, 100.0]), _result(True, [250.0, 320.0], accept=[3.0, 3.0]))


def test_runs_with_different_server_settings_are_not_compared():
    """A speculative server with another max_running_requests (SGLang's reset to 48) is refused by name."""
    with pytest.raises(MeasurementError, match="max_running_requests: baseline 32, speculative 48"):
        compare(_result(False, [1.0, 1.0]), _result(True, [1.0, 1.0], accept=[2.0, 2.0], max_running_requests=48))


def test_bench_result_round_trips_through_json():
    """results.json holds BenchResult.to_json(); from_json gives back an equal object."""
    result = _result(True, [1.0, 2.0], accept=[2.0, 2.0])
    assert BenchResult.from_json(json.loads(json.dumps(result.to_json()))) == result


# ---------------------------------------------------------------- answer checks


def _answer(rid: str, tokens: int, verify: int | None = None) -> dict:
    meta = {"id": rid, "completion_tokens": tokens} | ({"spec_verify_ct": verify} if verify is not None else {})
    return {"output_ids": list(range(tokens)), "meta_info": meta}


@pytest.mark.parametrize(
    "answer, speculative, check",
    [
        (_answer("r", 15), False, "completion_tokens"),
        (_answer("other", 16), False, "id"),
        (_answer("r", 16, verify=5), False, "spec_verify_ct"),
        (_answer("r", 16), True, "spec_verify_ct"),
        (_answer("r", 16, verify=0), True, "spec_verify_ct"),
        ({"output_ids": [1]}, False, "shape"),
        (None, False, "stream"),
    ],
)
def test_bad_answers_are_refused_with_the_failed_check(answer, speculative, check):
    """Short completions, a foreign id, verify steps on a baseline or none on a spec server are refused."""
    from infra.sglang_checks import ResponseCheckError

    with pytest.raises(ResponseCheckError) as exc:
        check_bench_answer(answer, rid="r", max_new_tokens=16, speculative=speculative)
    assert exc.value.check == check


def test_without_ignore_eos_an_answer_may_stop_at_end_of_turn_but_not_past_the_cap():
    """ignore_eos off (evaluation prompts): 1..max_new_tokens tokens pass; more, or none, are refused."""
    from infra.sglang_checks import ResponseCheckError

    assert check_bench_answer(_answer("r", 5), rid="r", max_new_tokens=16, speculative=False, ignore_eos=False)
    for tokens in (0, 17):
        with pytest.raises(ResponseCheckError) as exc:
            check_bench_answer(_answer("r", tokens), rid="r", max_new_tokens=16, speculative=False, ignore_eos=False)
        assert exc.value.check == "completion_tokens"


def test_per_dataset_rows_sum_each_group_and_count_identical_outputs():
    """A group's accept length is its tokens over its verify steps, its rate tokens over summed latencies."""
    base = summarize_level(
        1, [sample(0, 10, None, 1.0, 0.1), sample(1, 20, None, 2.0, 0.1), sample(2, 30, None, 1.0, 0.1)], 4.0, False
    )
    spec_samples = [
        sample(0, 10, 5, 0.5, 0.1),
        sample(1, 20, 5, 4.0, 0.1),
        RequestSample(2, 1.0, 0.1, 30, 0, 10, "other"),
    ]
    spec = summarize_level(1, spec_samples, 5.5, True)
    b = BenchResult("b", False, BenchSettings((1,), 3, 32, 0), "d", {}, (base,))
    s = BenchResult("s", True, BenchSettings((1,), 3, 32, 0), "d", {}, (spec,))
    rows = {r.group: r for r in compare_groups(b, s, ["x", "x", "y"])}
    assert rows["x"].accept_length == 3.0 and rows["y"].accept_length == 3.0 and rows["all"].accept_length == 3.0
    assert rows["x"].baseline_tok_per_s == 10.0 and rows["x"].speculative_tok_per_s == pytest.approx(30 / 4.5)
    assert (rows["x"].identical_outputs, rows["y"].identical_outputs, rows["all"].identical_outputs) == (2, 0, 2)
    assert rows["all"].num_requests == 3


# ---------------------------------------------------------------- against the fake server


def test_speculative_run_against_the_fake_reports_its_acceptance_exactly():
    """Fake accept 3: ceil(16/3) = 6 verify steps per request, so accept length 16/6, client and server agree."""
    with spec_fake(accept_length=3.0) as fake:
        result = bench(fake)
    for level in result.levels:
        assert (level.num_requests, level.completion_tokens, level.spec_verify_ct) == (8, 128, 48)
        assert level.accept_length == pytest.approx(16 / 6) and level.server_accept_length == pytest.approx(16 / 6)
    assert result.server_settings["speculative_num_draft_tokens"] == 4


def test_warmup_then_flush_cache_precede_every_measured_level():
    """Per level: the warmup requests, one /flush_cache, then exactly the measured requests, in that order."""
    with baseline_fake() as fake:
        bench(fake)
        events = list(fake.events)
    expected = []
    for level in SETTINGS.concurrency_levels:
        expected += [f"warmup-c{level}"] * SETTINGS.num_warmup + ["flush"] + [f"c{level}"] * SETTINGS.num_prompts
    # rids are bench-<label>-<prompt index>-<random>; the label says warmup or measured, and the level
    seen = ["flush" if kind == "flush" else "-".join(rid.split("-")[1:-2]) for kind, rid in events]
    assert seen == expected


def test_requests_in_flight_match_the_concurrency_level():
    """At level 4 the fake sees exactly 4 requests at once (it holds each until 4 are in flight), never more."""
    with baseline_fake(step_s=0.001, hold_until_in_flight=4) as fake:
        bench(fake, BenchSettings((4,), num_prompts=8, max_new_tokens=16, num_warmup=0))
        assert fake.max_in_flight == 4


def test_a_short_completion_fails_the_benchmark():
    """A server that stops one token early (EOS not ignored) fails the run, naming completion_tokens."""
    with baseline_fake(Faults(short_completion=1)) as fake, pytest.raises(BenchmarkError, match="completion_tokens"):
        bench(fake)


def test_a_refused_flush_fails_the_benchmark():
    """/flush_cache answering 400 (server busy) stops the run: the level would start with a warm cache."""
    with (
        baseline_fake(Faults(flush_fails=True)) as fake,
        pytest.raises(BenchmarkError, match="flush_cache answered 400"),
    ):
        bench(fake)


def _bench_timed(fake: FakeSGLangServer, tick: float, settings: BenchSettings, monkeypatch) -> BenchResult:
    """Benchmark with a FakeClock: a level of N requests lasts 3N + 1 ticks (start, each request's send, first
    chunk and end, finish), a request at concurrency 1 two ticks, its first token one."""
    monkeypatch.setattr(infra.sglang_bench, "clock", FakeClock(tick))
    return bench(fake, settings)


def test_fake_pair_gives_the_ratio_of_its_timings_and_a_report(monkeypatch):
    """Clock ticks of 15 ms (baseline) and 10 ms (spec): tok/s, latency and a speedup of exactly 1.5 <= 16/7."""
    settings = BenchSettings((1, 4), num_prompts=4, max_new_tokens=16, num_warmup=1)
    with baseline_fake() as base, spec_fake() as spec:
        base_run = _bench_timed(base, 0.015, settings, monkeypatch)
        rows = compare(base_run, result := _bench_timed(spec, 0.010, settings, monkeypatch))
    level = base_run.levels[0]  # concurrency 1: 4 requests x 16 tokens in 13 ticks
    assert level.output_tok_per_s == pytest.approx(64 / (13 * 0.015))
    assert (level.median_latency_s, level.median_ttft_s) == (pytest.approx(0.030), pytest.approx(0.015))
    assert level.median_tpot_ms == pytest.approx(1000 * 0.015 / 15)
    for row in rows:
        assert row.speedup == pytest.approx(1.5) and row.accept_length == pytest.approx(16 / math.ceil(16 / 2.5))
        assert row.identical_outputs == 4  # the fake's greedy chain is the same for both servers
    report = render_report(rows, result, result, {"target": "fake"})
    assert report.count("\n| 1 |") == 1 and report.count("\n| 4 |") == 1
    assert "Speculation paid at every concurrency measured (1, 4)." in report


def test_the_report_says_at_which_concurrency_speculation_stops_paying():
    """Levels with speedup > 1 are named as paying, the others (1.0 included) as not, in level order."""

    def level(concurrency: int, speedup: float) -> LevelComparison:
        return LevelComparison(concurrency, 100.0, 100.0 * speedup, speedup, 3.0, None, 1.0, 1.0, 0.1, 0.1, 0, 8)

    rows = [level(1, 1.51), level(8, 1.09), level(32, 0.77), level(128, 1.0)]
    assert where_it_pays(rows) == "Speculation paid at concurrency 1, 8; it did not at 32, 128."
    assert where_it_pays(rows[2:]) == "Speculation did not pay at any concurrency measured (32, 128)."


def test_fake_spec_server_faster_than_its_acceptance_is_caught(monkeypatch):
    """A spec run timed 5x faster than its baseline, with acceptance length 16/7, is a MeasurementError."""
    with baseline_fake() as base, spec_fake() as spec:
        settings = BenchSettings((1,), num_prompts=4, max_new_tokens=16, num_warmup=0)
        base_run, spec_run = (
            _bench_timed(base, 0.010, settings, monkeypatch),
            _bench_timed(spec, 0.002, settings, monkeypatch),
        )
        with pytest.raises(MeasurementError, match="concurrency 1: speedup 5.000 > acceptance length 2.286"):
            compare(base_run, spec_run)


# ---------------------------------------------------------------- readiness of a speculative server


def test_readiness_fails_when_the_draft_never_runs():
    """A speculative server whose smoke answer has no verify steps (spec_verify_ct 0) is not ready."""
    with spec_fake(Faults(spec_verify_ct_zero=True)) as fake:
        spec = ServerSpec(
            "fake-model",
            "speculative",
            port=fake.args.port,
            draft_model_path="/d",
            num_steps=3,
            topk=1,
            num_draft_tokens=4,
            max_running_requests=32,
        )
        with pytest.raises(ServerCheckError, match="spec_verify_ct None.*the draft did not run"):
            probe_ready(spec, ProbeExpectations(vocab_size=256), timeout_s=10, poll_s=0.05)


def test_readiness_checks_the_serving_limits_the_server_reports():
    """A speculative server left at SGLang's max_running_requests 48 fails a spec that asks for 32."""
    with FakeSGLangServer(LaunchArgs(**SPEC_FLAGS)) as fake:
        spec = ServerSpec(
            "fake-model",
            "speculative",
            port=fake.args.port,
            draft_model_path="/d",
            num_steps=3,
            topk=1,
            num_draft_tokens=4,
            max_running_requests=32,
        )
        with pytest.raises(ServerCheckError, match="max_running_requests: server has 48, expected 32"):
            probe_ready(spec, ProbeExpectations(vocab_size=256), timeout_s=10, poll_s=0.05)


def test_serving_limits_must_be_positive():
    """max_running_requests 0 is refused before any launch."""
    with pytest.raises(ServerSpecError, match="max_running_requests 0 must be >= 1"):
        ServerSpec("M", "serve", max_running_requests=0)


@pytest.mark.parametrize(
    "serve, fragment",
    [
        ({"num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 6}, "num_steps \\+ 1 = 4"),
        ({"concurrency_levels": [1, 64]}, "exceeds max_running_requests"),
        ({"concurrency_levels": [4, 4]}, "distinct"),
    ],
)
def test_serve_config_refuses_an_unfair_or_impossible_benchmark(serve, fragment):
    """A trio SGLang would override, or a level that would measure queueing, is a config error naming the field."""
    from eagle3.config import ConfigError, validate_config

    with pytest.raises(ConfigError, match=fragment):
        validate_config({"serve": serve}, "test")
