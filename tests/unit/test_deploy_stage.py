"""The deploy stage without Prefect: `python -m eagle3.deploy` against the FAKE SGLang server.

server.launch_module points at tests/fakes/sglang_server.py (a test double, not SGLang), so the stage
launches, probes and kills real processes while the figures are the fake's inventions; a scripted clock
(tests/fakes/clock.py) makes them exact. The stage runs in a child process in which importing prefect fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3.config import RunConfig, save_config
from infra.process import group_alive, port_in_use
from tests.fakes.sglang_server import two_free_ports

REPO = Path(__file__).resolve().parents[2]
FAKE = "tests.fakes.sglang_server"
WITHOUT_PREFECT = """
import sys
sys.modules["prefect"] = None  # any `import prefect` (or of a submodule) now raises ImportError
import infra.sglang_bench
from tests.fakes.clock import FakeClock
infra.sglang_bench.clock = FakeClock(0.01)  # a level of 8 requests lasts 3 x 8 + 1 ticks
from eagle3.deploy import main
main(sys.argv[1:])
"""


@pytest.fixture
def config_file(tmp_path) -> Path:
    """<run>/config.json of a run with a real tiny SGLang export, served by the fake on two free ports."""
    from tests.unit.test_export import sglang_export

    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(
        json.dumps(
            {"hidden_size": 16, "num_hidden_layers": 8, "vocab_size": 256, "architectures": ["LlamaForCausalLM"]}
        )
    )
    sglang_export(tmp_path / "dep" / "export")  # deploy runs the export's strict check on <run>/export/sglang
    cfg = RunConfig.model_validate(
        {
            "run": {"workdir": str(tmp_path), "name": "dep"},
            "serve": {
                "enabled": True,
                "model_path": str(target),
                "port": two_free_ports(),
                "concurrency_levels": [1, 4],
                "num_prompts": 8,
                "max_new_tokens": 16,
                "num_warmup": 2,
                "max_running_requests": 8,
                "cuda_graph_max_bs_decode": 8,
            },
            "server": {
                "python": sys.executable,
                "launch_module": FAKE,
                "api_key_env": None,
                "startup_timeout_s": 30,
                "extra_args": ["--fake-step-s", "0.005", "--fake-lifetime-s", "120"],
            },
        }
    )
    return save_config(cfg, cfg.run_dir / "config.json")


def _run_stage(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_PREFECT, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=240
    )


def test_deploy_stage_runs_without_prefect_against_the_fake_server(config_file):
    """With prefect unimportable, the stage benchmarks both fake servers, writes the golden figures, stops both."""
    proc = _run_stage("--config", str(config_file))
    assert proc.returncode == 0, proc.stderr[-4000:]
    printed = json.loads(proc.stdout[proc.stdout.index("\n{") + 1 :])  # the report's markdown, then the JSON
    out = config_file.parent / "deploy"
    assert printed["results"] == str(out / "results.json") and printed["report"] == str(out / "report.md")
    doc = json.loads((out / "results.json").read_text())
    assert doc["valid"] and doc["comparison"] == printed["comparison"]
    assert [row["concurrency"] for row in doc["comparison"]] == [1, 4]
    for row in doc["comparison"]:
        assert row["accept_length"] == pytest.approx(16 / 7)  # ceil(16 / 2.5) = 7 verify steps per request
        assert [row["baseline_tok_per_s"], row["speculative_tok_per_s"]] == pytest.approx([8 * 16 / 0.25] * 2)
        assert row["speedup"] == pytest.approx(1.0)
    for role, run in [("baseline", doc["baseline"]), *[("speculative", r) for r in doc["speculative"]]]:
        assert run["role"] == role and not group_alive(run["pid"])
        assert "a test double, not SGLang" in Path(run["log"]).read_text()
    report = (out / "report.md").read_text()
    assert "not SGLang measurements" in report and report in proc.stdout
    port = json.loads(config_file.read_text())["serve"]["port"]
    assert not port_in_use("127.0.0.1", port) and not port_in_use("127.0.0.1", port + 1)


def test_deploy_stage_refuses_a_run_without_a_serving_host(tmp_path):
    """serve.enabled false: the command exits 2 naming the setting, starts nothing and writes nothing."""
    cfg = RunConfig.model_validate({"run": {"workdir": str(tmp_path), "name": "off"}})
    proc = _run_stage("--config", str(save_config(cfg, cfg.run_dir / "config.json")))
    assert proc.returncode == 2 and "serve.enabled is false" in proc.stderr
    assert not (cfg.run_dir / "deploy").exists()


def test_every_extra_eagle3_setting_gets_its_own_server_against_one_baseline(config_file):
    """serve.extra_speculative adds one speculative server per setting; one baseline; rows name their setting."""
    proc = _run_stage("--config", str(config_file), "--set", 'serve.extra_speculative=["5-4-8"]')
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads((config_file.parent / "deploy" / "results.json").read_text())
    assert [run["trio"] for run in doc["speculative"]] == ["3-1-4", "5-4-8"]
    assert [(row["trio"], row["concurrency"]) for row in doc["comparison"]] == [
        ("3-1-4", 1),
        ("3-1-4", 4),
        ("5-4-8", 1),
        ("5-4-8", 4),
    ]
    assert "--speculative-eagle-topk 4" in doc["speculative"][1]["argv"]
    assert (config_file.parent / "deploy" / "sglang-speculative-5-4-8.log").exists()


def test_a_sampled_evaluation_makes_the_benchmark_sample_with_the_same_chain_rule(config_file):
    """evaluate.temperature 1: every request samples, the chain server verifies by the rejection rule (the flag SGLang
    takes, read back from /server_info), the tree server keeps SGLang's default, and no output is counted identical;
    the report says so."""
    proc = _run_stage(
        "--config", str(config_file), "--set", "evaluate.temperature=1", "--set", 'serve.extra_speculative=["5-4-8"]'
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = config_file.parent / "deploy"
    doc = json.loads((out / "results.json").read_text())
    chain, tree = doc["speculative"]
    assert "--speculative-use-rejection-sampling" in chain["argv"]
    assert "--speculative-use-rejection-sampling" not in tree["argv"]
    assert chain["result"]["server_settings"]["speculative_use_rejection_sampling"] is True
    assert doc["baseline"]["result"]["settings"]["temperature"] == 1.0
    report = (out / "report.md").read_text()
    assert "temperature 1 (top-p 1, top-k all)" in report and "| sampled |" in report


def test_eval_results_of_other_sampling_are_not_compared(tmp_path):
    """An evaluation at temperature 0 is not compared with servers asked to sample (nor at temperature 1 one that
    drafted chains by another rule), and at temperature > 0 no same-text check runs: each says why."""
    from eagle3.deploy_checks import accept_checks, same_text_checks

    cfg = RunConfig.model_validate(
        {
            "run": {"workdir": str(tmp_path), "name": "r"},
            "serve": {"prompts": "evaluation", "max_new_tokens": 256},
            "evaluate": {"temperature": 1.0},
        }
    )
    (cfg.run_dir / "eval").mkdir(parents=True)
    row = {"method": "chain-3-1-4", "dataset": "mtbench", "num_prompts": 1, "num_tokens": 4, "num_verify": 2}
    results = cfg.run_dir / "eval" / "results.json"
    run = _run("3-1-4", ["mtbench"], [4], [2])
    for evaluated, named in (
        ({"temperature": 0.0}, "evaluate.temperature=0.0"),
        ({"temperature": 1.0, "chain_sampling": "target_only"}, "evaluate.chain_sampling"),
    ):
        settings = {"max_new_tokens": 256, "evaluate": evaluated}
        results.write_text(json.dumps({"settings": settings, "results": [row, row | {"dataset": "all"}]}))
        checks, skipped = accept_checks(cfg, run)
        assert checks == [] and named in skipped, skipped
    results.write_text(
        json.dumps(
            {
                "settings": {"max_new_tokens": 256, "evaluate": {"temperature": 1.0}},
                "results": [row, row | {"dataset": "all"}],
            }
        )
    )
    checks, skipped = accept_checks(cfg, run)
    assert skipped is None and [c.dataset for c in checks] == ["mtbench", "all"]
    same, why = same_text_checks(cfg, run)
    assert same == [] and "requests sampled" in why


def _run(trio: str, groups: list[str], completion: list[int], verify: list[int]):
    from eagle3.deploy_records import ServerRun
    from infra.sglang_bench import BenchResult, BenchSettings, RequestSample, summarize_level

    samples = [
        RequestSample(i, 1.0, 0.1, c, 0, v, str(i)) for i, (c, v) in enumerate(zip(completion, verify, strict=True))
    ]
    level = summarize_level(1, samples, 1.0, True)
    result = BenchResult("u", True, BenchSettings((1,), len(samples), 256, 0), "d", {}, (level,))
    return ServerRun("speculative", "argv", "log", None, {}, result, trio, tuple(groups))


def test_sglang_accept_length_is_checked_against_eagle3_eval_per_dataset(tmp_path):
    """Sums of tokens / verify steps per dataset and overall vs eval/results.json; a gap over the tolerance fails."""
    from eagle3.deploy_checks import accept_checks

    cfg = RunConfig.model_validate(
        {"run": {"workdir": str(tmp_path), "name": "r"}, "serve": {"prompts": "evaluation", "max_new_tokens": 256}}
    )
    results = [
        {"method": "chain-3-1-4", "dataset": "mtbench", "num_tokens": 200, "num_verify": 100},
        {"method": "chain-3-1-4", "dataset": "gsm8k", "num_tokens": 300, "num_verify": 100},
        {"method": "chain-3-1-4", "dataset": "all", "num_tokens": 500, "num_verify": 200},
    ]
    (cfg.run_dir / "eval").mkdir(parents=True)
    (cfg.run_dir / "eval" / "results.json").write_text(
        json.dumps({"settings": {"max_new_tokens": 256}, "results": results})
    )
    # mtbench 2.0 vs 2.0; gsm8k 2.7 vs 3.0 (10% off); all 4.7/2 = 2.35... vs 2.5 (6% off)
    checks, skipped = accept_checks(cfg, _run("3-1-4", ["mtbench", "gsm8k"], [100, 270], [50, 100]))
    assert skipped is None
    got = {c.dataset: (round(c.sglang, 4), c.evaluate, c.ok) for c in checks}
    assert got == {"mtbench": (2.0, 2.0, True), "gsm8k": (2.7, 3.0, False), "all": (round(370 / 150, 4), 2.5, True)}
    checks, skipped = accept_checks(cfg, _run("7-1-8", ["mtbench", "gsm8k"], [100, 270], [50, 100]))
    assert checks == [] and "did not measure chain-7-1-8" in skipped


def test_an_evaluation_of_other_prompts_than_the_servers_were_sent_is_not_compared(tmp_path):
    """eval measured 1 mtbench prompt, the servers were sent 2: no accept check and no same-text check (prompts
    are paired by position), each saying why."""
    from eagle3.deploy_checks import accept_checks, same_text_checks

    cfg = RunConfig.model_validate(
        {"run": {"workdir": str(tmp_path), "name": "r"}, "serve": {"prompts": "evaluation", "max_new_tokens": 256}}
    )
    (cfg.run_dir / "eval").mkdir(parents=True)
    row = {"method": "chain-3-1-4", "dataset": "mtbench", "num_prompts": 1, "num_tokens": 4, "num_verify": 2}
    (cfg.run_dir / "eval" / "results.json").write_text(
        json.dumps({"settings": {"max_new_tokens": 256}, "results": [row, row | {"dataset": "all"}]})
    )
    (cfg.run_dir / "eval" / "prompts.jsonl").write_text(json.dumps(_eval_record(0, "mtbench", [1, 2, 3, 4], 2)) + "\n")
    run = _digest_run("3-1-4", ["mtbench", "mtbench"], [[1, 2, 3, 4], [5, 6]], [2, 1])
    checks, skipped = accept_checks(cfg, run)
    assert checks == [] and "measured 1 mtbench prompts, the servers were sent 2" in skipped
    same, why = same_text_checks(cfg, run)
    assert same == [] and "measured 1 mtbench prompts, the servers were sent 2" in why


def _digest_run(trio: str, groups: list[str], outputs: list[list[int]], verify: list[int]):
    """A speculative ServerRun whose per-prompt output digests are those of ``outputs``."""
    from eagle3.deploy_records import ServerRun
    from infra.sglang_bench import BenchResult, BenchSettings, RequestSample, output_digest, summarize_level

    samples = [
        RequestSample(i, 1.0, 0.1, len(o), 0, v, output_digest(o))
        for i, (o, v) in enumerate(zip(outputs, verify, strict=True))
    ]
    level = summarize_level(1, samples, 1.0, True)
    result = BenchResult("u", True, BenchSettings((1,), len(samples), 256, 0), "d", {}, (level,))
    return ServerRun("speculative", "argv", "log", None, {}, result, trio, tuple(groups))


def _eval_record(index: int, dataset: str, tokens: list[int], verify: int) -> dict:
    from eagle3.evaluate.records import GreedyReference, LosslessCheck, MethodRun, PromptRecord

    committed = [1] * verify
    run = MethodRun(len(tokens), 0.1, LosslessCheck("identical"), [3] * verify, [0] * verify, committed)
    return PromptRecord(
        index, dataset, f"{dataset}:{index}", 5, GreedyReference(len(tokens), 0.1, tokens), None, {"chain-3-1-4": run}
    ).to_json()


def test_accept_lengths_are_compared_on_the_prompts_whose_outputs_are_identical(tmp_path):
    """Only token-identical outputs (end-of-turn token kept or dropped by SGLang) count; verify steps compared there."""
    from eagle3.deploy_checks import same_text_checks

    cfg = RunConfig.model_validate(
        {"run": {"workdir": str(tmp_path), "name": "r"}, "serve": {"prompts": "evaluation", "max_new_tokens": 256}}
    )
    ours = [[5, 6, 7, 2], [8, 9, 2], [4, 4, 4, 4, 2], [1, 2]]
    (cfg.run_dir / "eval").mkdir(parents=True)
    (cfg.run_dir / "eval" / "prompts.jsonl").write_text(
        "".join(
            json.dumps(_eval_record(i, g, t, v)) + "\n"
            for i, (g, t, v) in enumerate(
                zip(["mtbench", "mtbench", "gsm8k", "gsm8k"], ours, [2, 2, 2, 1], strict=True)
            )
        )
    )
    served = [[5, 6, 7, 2], [8, 9], [4, 4, 3, 3, 2], [1, 2]]  # 0 same, 1 same without end of turn, 2 diverged, 3 same
    checks, skipped = same_text_checks(
        cfg, _digest_run("3-1-4", ["mtbench", "mtbench", "gsm8k", "gsm8k"], served, [2, 1, 3, 1])
    )
    assert skipped is None
    got = {c.dataset: (c.num_same, c.num_prompts, round(c.sglang, 4), round(c.evaluate, 4), c.ok) for c in checks}
    # mtbench: 7 tokens in 3 SGLang verify steps vs 4 of ours; gsm8k: prompt 3 only, 2 tokens in 1 step each
    assert got == {
        "mtbench": (2, 2, round(7 / 3, 4), 1.75, False),
        "gsm8k": (1, 2, 2.0, 2.0, True),
        "all": (3, 4, 2.25, 1.8, False),
    }


def test_a_whole_set_gap_names_the_same_text_gap_and_where_it_comes_from():
    """A failed dataset whose identical outputs agree says the gap comes from diverged outputs; both kinds fail."""
    from eagle3.deploy_checks import AcceptCheck, SameTextCheck, check_errors, render_checks

    checks = [
        AcceptCheck("3-1-4", "humaneval", 1.410, 1.463, 0.036, False),
        AcceptCheck("3-1-4", "all", 1.43, 1.44, 0.007, True),
    ]
    same = [
        SameTextCheck("3-1-4", "humaneval", 19, 40, 1.45, 1.452, 0.001, True),
        SameTextCheck("3-1-4", "all", 70, 160, 1.50, 1.40, 0.071, False),
    ]
    errors = check_errors(checks, same, 0.03)
    assert len(errors) == 2
    assert "3.6% > 3%" in errors[0] and "19 prompts with identical outputs the gap is 0.1%" in errors[0]
    assert "not from the drafter or a train/serve mismatch" in errors[0] and "(aux layer ids" not in errors[0]
    gap = [AcceptCheck("3-1-4", "humaneval", 1.410, 1.463, 0.036, False)]
    drifted = [SameTextCheck("3-1-4", "humaneval", 19, 40, 1.40, 1.46, 0.041, False)]
    (mismatch, _) = check_errors(gap, drifted, 0.03)
    assert "a train/serve mismatch (aux layer ids" in mismatch and "identical outputs the gap is 4.1%" in mismatch
    assert errors[1].startswith("3-1-4 all: on 70 prompts with identical outputs") and "7.1% > 3%" in errors[1]
    table = render_checks(checks, same, None)
    assert "| humaneval | 1.410 | 1.463 | 3.6% FAIL | 19/40 | 1.450 / 1.452 | 0.1% |" in table
    assert "| all | 1.430 | 1.440 | 0.7% | 70/160 | 1.500 / 1.400 | 7.1% FAIL |" in table


def test_report_only_rebuilds_the_report_from_the_recorded_runs_without_a_server(config_file):
    """--report-only writes the same comparison from results.json, starts no server, and needs a benchmark first."""
    out = config_file.parent / "deploy"
    proc = _run_stage("--config", str(config_file), "--report-only")
    assert proc.returncode == 2 and f"no {out / 'results.json'}" in proc.stderr
    assert _run_stage("--config", str(config_file)).returncode == 0
    first = json.loads((out / "results.json").read_text())
    logs = {p.name: p.read_text() for p in out.glob("sglang-*.log")}
    (out / "report.md").unlink()
    proc = _run_stage("--config", str(config_file), "--report-only")
    assert proc.returncode == 0, proc.stderr[-4000:]
    again = json.loads((out / "results.json").read_text())
    assert again["comparison"] == first["comparison"] and again["baseline"] == first["baseline"]
    assert (out / "report.md").read_text() in proc.stdout
    assert {p.name: p.read_text() for p in out.glob("sglang-*.log")} == logs  # no server was started


def test_report_only_checks_accept_lengths_against_an_evaluation_run_after_the_benchmark(tmp_path):
    """An eval/results.json written after the benchmark turns 'not compared' into per-dataset accept checks."""
    from dataclasses import replace

    from eagle3.deploy import report_again
    from eagle3.deploy_records import ServerRun

    cfg = RunConfig.model_validate(
        {"run": {"workdir": str(tmp_path), "name": "r"}, "serve": {"prompts": "evaluation", "max_new_tokens": 256}}
    )
    spec = _run("3-1-4", ["mtbench", "gsm8k"], [100, 270], [50, 100])
    base = ServerRun("baseline", "argv", "log", None, {}, replace(spec.result, speculative=False), None, spec.groups)
    (cfg.run_dir / "deploy").mkdir(parents=True)
    (cfg.run_dir / "deploy" / "results.json").write_text(
        json.dumps({"baseline": base.to_json(), "speculative": [spec.to_json()]})
    )
    first = report_again(cfg)
    assert first.accept_checks == [] and "not compared with eagle3 eval: no " in first.markdown
    results = [
        {"method": "chain-3-1-4", "dataset": d, "num_tokens": t, "num_verify": v}
        for d, t, v in [("mtbench", 100, 50), ("gsm8k", 270, 100), ("all", 370, 150)]
    ]
    (cfg.run_dir / "eval").mkdir()
    (cfg.run_dir / "eval" / "results.json").write_text(
        json.dumps({"settings": {"max_new_tokens": 256}, "results": results})
    )
    again = report_again(cfg)
    assert {(c.dataset, c.ok) for c in again.accept_checks} == {("mtbench", True), ("gsm8k", True), ("all", True)}
    assert json.loads(again.results.read_text())["accept_checks"][0]["evaluate"] == 2.0


def test_the_ngram_server_is_shown_beside_eagle3_evals_ngram_and_never_checked_against_it(tmp_path):
    """An n-gram run gets its own section and rows; its accept length far from eagle3 eval's n-gram fails nothing
    (another implementation): the two stand side by side, while the EAGLE-3 setting is still checked."""
    from dataclasses import replace

    from eagle3.deploy import report_again

    cfg = RunConfig.model_validate(
        {"run": {"workdir": str(tmp_path), "name": "r"}, "serve": {"prompts": "evaluation", "max_new_tokens": 256}}
    )
    spec = _run("3-1-4", ["mtbench", "gsm8k"], [100, 270], [50, 100])
    ngram = _run("ngram", ["mtbench", "gsm8k"], [100, 270], [80, 200])  # 1.25 and 1.35 against eval's 3.0
    base = replace(spec, role="baseline", trio=None, result=replace(spec.result, speculative=False))
    (cfg.run_dir / "deploy").mkdir(parents=True)
    (cfg.run_dir / "deploy" / "results.json").write_text(
        json.dumps({"baseline": base.to_json(), "speculative": [spec.to_json(), ngram.to_json()]})
    )
    results = [
        {"method": m, "dataset": d, "num_tokens": t, "num_verify": v}
        for m in ("chain-3-1-4", "ngram")
        for d, t, v in [("mtbench", 100, 50), ("gsm8k", 270, 100), ("all", 370, 150)]
    ]
    results = [r if r["method"] != "ngram" else r | {"num_verify": r["num_tokens"] / 3} for r in results]
    (cfg.run_dir / "eval").mkdir()
    (cfg.run_dir / "eval" / "results.json").write_text(
        json.dumps({"settings": {"max_new_tokens": 256}, "results": results})
    )
    report = report_again(cfg)  # raises MeasurementError if any check failed
    doc = json.loads(report.results.read_text())
    assert doc["valid"] and {row["trio"] for row in doc["comparison"]} == {"3-1-4", "ngram"}
    assert {c["trio"] for c in doc["accept_checks"]} == {"3-1-4"}
    beside = {c["dataset"]: (round(c["sglang"], 4), c["evaluate"]) for c in doc["ngram_beside_eval"]}
    assert beside == {"mtbench": (1.25, 3.0), "gsm8k": (1.35, 3.0), "all": (round(370 / 280, 4), 3.0)}
    assert "## n-gram\n" in report.markdown and "a different implementation" in report.markdown
    assert "| gsm8k | 1.350 | 3.000 |" in report.markdown
