"""The deploy flow's serve + benchmark part, run by Prefect against the FAKE SGLang server.

server.launch_module points at tests/fakes/sglang_server.py, so ManagedServer launches, probes and
kills real processes, but the figures are the fake's inventions: the tests check plumbing (reports,
artifacts, arithmetic, clean shutdown), not performance.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

import infra.sglang_bench
from eagle3.config import RunConfig
from flows.deploy import NOT_ENABLED, eagle3_deploy
from infra.process import group_alive, pid_alive, port_in_use
from tests.fakes.clock import FakeClock
from tests.fakes.sglang_server import two_free_ports

REPO = Path(__file__).resolve().parents[2]
FAKE = "tests.fakes.sglang_server"


def _write_tiny_export(export_root):
    """A small random drafter exported in the SGLang layout (the fake servers never read its weights)."""
    from tests.unit.test_export import sglang_export

    out, *_ = sglang_export(export_root)
    assert out == export_root / "sglang"


@pytest.fixture
def serve_cfg(tmp_path, monkeypatch) -> RunConfig:
    monkeypatch.chdir(REPO)  # `python -m tests.fakes.sglang_server` resolves from the repository root
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(
        json.dumps(
            {"hidden_size": 16, "num_hidden_layers": 8, "vocab_size": 256, "architectures": ["LlamaForCausalLM"]}
        )
    )
    _write_tiny_export(tmp_path / "dep" / "export")  # a real export: deploy runs the export's strict check
    return RunConfig.model_validate(
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


def _artifact_keys(*keys: str) -> set[str]:
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=list(keys))))
    return {a.key for a in found}


def test_deploy_flow_benchmarks_every_fake_server_and_reports(serve_cfg, monkeypatch):
    """Benchmark-only run with serve.ngram: the baseline, the EAGLE-3 and the n-gram server each benchmarked and
    gone; results.json + report.md + artifacts with the scripted clock's figures, the n-gram server's own rows."""
    monkeypatch.setattr(infra.sglang_bench, "clock", FakeClock(0.01))  # a level of 8 requests lasts 3 x 8 + 1 ticks
    cfg = serve_cfg.model_copy(deep=True)
    cfg.serve.ngram, cfg.serve.ngram_num_draft_tokens = True, 8
    state = eagle3_deploy(config=cfg, steps=["benchmark"], return_state=True)
    assert state.is_completed(), state.message
    out = cfg.run_dir / "deploy"
    doc = json.loads((out / "results.json").read_text())
    assert doc["valid"] and [(row["trio"], row["concurrency"]) for row in doc["comparison"]] == [
        ("3-1-4", 1),
        ("3-1-4", 4),
        ("ngram", 1),
        ("ngram", 4),
    ]
    for row in doc["comparison"]:
        assert row["accept_length"] == pytest.approx(16 / 7)  # ceil(16 / 2.5) = 7 verify steps per request
        assert [row["baseline_tok_per_s"], row["speculative_tok_per_s"]] == pytest.approx([8 * 16 / 0.25] * 2)
        assert row["speedup"] == pytest.approx(1.0)  # the same ticks for all servers
    speculative, ngram = doc["speculative"]
    for run in (doc["baseline"], speculative, ngram):
        assert not group_alive(run["pid"])
        assert "a test double, not SGLang" in Path(run["log"]).read_text()
    assert "--speculative-num-draft-tokens 4" in speculative["argv"]
    assert "--speculative-algorithm NGRAM --speculative-num-draft-tokens 8" in ngram["argv"]
    assert "--speculative-draft-model-path" not in ngram["argv"] and ngram["log"].endswith(
        "sglang-speculative-ngram.log"
    )
    assert ngram["result"]["server_settings"]["speculative_eagle_topk"] == 10  # the max BFS breadth, as SGLang sets it
    assert "--api-key" not in doc["baseline"]["argv"] and "--config " in doc["baseline"]["argv"]  # key in a file
    report = (out / "report.md").read_text()
    assert "not SGLang measurements" in report and report.count("| 1.00x | 2.29") == 4
    assert "## n-gram\n" in report and "breadth 1-10, trie depth 18, match BFS" in report
    assert doc["accept_checks"] == [] and doc["ngram_beside_eval"] == []  # fixed prompts: nothing from eagle3 eval
    assert _artifact_keys("dep-deploy-report", "dep-deploy-benchmark") == {"dep-deploy-report", "dep-deploy-benchmark"}
    bound = [int(re.search(r"--port (\d+)", run["argv"])[1]) for run in (doc["baseline"], speculative, ngram)]
    assert bound == [cfg.serve.port, cfg.serve.port + 1, cfg.serve.port + 1]  # picked free by two_free_ports
    assert not any(port_in_use("127.0.0.1", port) for port in bound)  # the servers' own ports, released


def test_a_speculative_server_whose_draft_never_runs_fails_the_flow_and_is_stopped(serve_cfg):
    """The speculative server fails readiness (no verify steps): the flow fails, no report, no process left."""
    cfg = serve_cfg.model_copy(deep=True)
    cfg.serve.concurrency_levels, cfg.serve.num_prompts, cfg.serve.num_warmup = [1], 2, 0  # a short baseline run
    cfg.server.extra_args = [*cfg.server.extra_args, "--fake-spec-verify-ct-zero"]
    state = eagle3_deploy(config=cfg, steps=["benchmark"], return_state=True)
    assert state.is_failed()
    log = (cfg.run_dir / "deploy" / "sglang-speculative-3-1-4.log").read_text()
    pids = [int(m) for m in re.findall(r"a test double, not SGLang\) pid (\d+)", log)]
    assert len(pids) == 1 and not pid_alive(pids[0])  # launched once (no restart), then killed
    assert not (cfg.run_dir / "deploy" / "results.json").exists()
    assert not port_in_use("127.0.0.1", cfg.serve.port + 1)
    with pytest.raises(Exception, match="the draft did not run"):
        state.result()


def test_benchmark_is_skipped_without_a_serving_host(tmp_path):
    """serve.enabled false: the benchmark step starts nothing and says why."""
    cfg = RunConfig.model_validate({"run": {"workdir": str(tmp_path), "name": "off"}})
    result = eagle3_deploy(config=cfg, steps=["benchmark"])
    assert result["benchmark"] == {"skipped": NOT_ENABLED} and not (tmp_path / "off" / "deploy").exists()
