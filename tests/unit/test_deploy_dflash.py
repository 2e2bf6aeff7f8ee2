"""The deploy stage with drafter.family=dflash: `python -m eagle3.deploy` against the FAKE SGLang server.

As tests/unit/test_deploy_stage.py: server.launch_module is tests/fakes/sglang_server.py (a test double, not SGLang;
it resolves DFLASH flags as SGLang's _handle_dflash does, tests/unit/test_dflash_serving.py), the stage runs in a
child process without prefect, and the figures are the fake's inventions. What is real: the export checked as a
DFlash layout, the servers' argv, readiness, the report and the accept-length check against eagle3 eval's
``dflash-*`` rows.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from eagle3.config import RunConfig, save_config
from infra.process import group_alive
from tests.fakes.sglang_server import two_free_ports
from tests.unit.test_deploy_stage import FAKE, _run, _run_stage


def _config(tmp_path: Path, **serve) -> Path:
    """<run>/config.json of a DFlash run whose <run>/export/sglang holds a real tiny DFlash export (block size 4)."""
    from eagle3.drafter.dflash import export_state_dict
    from eagle3.export.dflash import export_dflash
    from tests.unit.test_dflash_model import random_dflash, tiny_dflash_dims

    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(
        json.dumps(
            {"hidden_size": 16, "num_hidden_layers": 8, "vocab_size": 256, "architectures": ["LlamaForCausalLM"]}
        )
    )
    drafter = random_dflash(tiny_dflash_dims(block_size=4))
    export_dflash(export_state_dict(drafter), drafter.dims, [1, 3, 5], 8, tmp_path / "dep" / "export" / "sglang")
    cfg = RunConfig.model_validate(
        {
            "run": {"workdir": str(tmp_path), "name": "dep"},
            "drafter": {"family": "dflash", "dflash": {"block_size": 4}},
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
            }
            | serve,
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


def test_deploy_serves_a_dflash_export_beside_the_baseline(tmp_path):
    """family dflash: the export passes the DFlash check, the baseline and one DFLASH server of the export's block
    size are benchmarked on the same prompts and stopped, the report names DFlash, the figures are the fake's."""
    config = _config(tmp_path)
    proc = _run_stage("--config", str(config))
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = config.parent / "deploy"
    doc = json.loads((out / "results.json").read_text())
    assert doc["valid"] and [run["trio"] for run in doc["speculative"]] == ["3-1-4"]
    draft = str((config.parent / "export" / "sglang").resolve())
    argv = doc["speculative"][0]["argv"]
    assert (
        f"--speculative-algorithm DFLASH --speculative-draft-model-path {draft} --speculative-dflash-block-size 4"
    ) in argv
    assert "--speculative-num-steps" not in argv and "--speculative-eagle-topk" not in argv
    assert "--speculative" not in doc["baseline"]["argv"]
    assert doc["baseline"]["result"]["prompts_digest"] == doc["speculative"][0]["result"]["prompts_digest"]
    spec_settings = doc["speculative"][0]["result"]["server_settings"]
    assert (spec_settings["speculative_algorithm"], spec_settings["speculative_num_draft_tokens"]) == ("DFLASH", 4)
    for row in doc["comparison"]:
        assert row["trio"] == "3-1-4" and row["accept_length"] == pytest.approx(16 / 7)  # ceil(16 / 2.5) verify steps
    for run in [doc["baseline"], *doc["speculative"]]:
        assert not group_alive(run["pid"])
    report = (out / "report.md").read_text()
    assert report.startswith("# DFlash deploy benchmark") and "## DFlash 3-1-4" in report
    assert "EAGLE-3" not in report and (out / "sglang-speculative-3-1-4.log").exists()


def test_an_eagle3_export_is_refused_before_any_server_starts(tmp_path):
    """family dflash with an EAGLE-3 export in <run>/export/sglang: exit 2 naming the architecture, nothing launched."""
    from tests.unit.test_export import sglang_export

    config = _config(tmp_path)
    sglang_export(tmp_path / "dep" / "export")  # overwrites export/sglang with the EAGLE-3 layout
    proc = _run_stage("--config", str(config))
    assert proc.returncode == 2 and "expected ['DFlashDraftModel']" in proc.stderr, proc.stderr[-3000:]
    assert not list((config.parent / "deploy").glob("sglang-*.log"))


def test_eagle3_settings_to_compare_are_refused_for_a_dflash_drafter(tmp_path):
    """serve.extra_speculative lists EAGLE-3 trios; a DFlash drafter runs one way, so the stage refuses the list."""
    proc = _run_stage("--config", str(_config(tmp_path, extra_speculative=["5-4-8"])))
    assert proc.returncode == 2 and "serve.extra_speculative" in proc.stderr, proc.stderr[-3000:]


def test_sglang_accept_length_is_checked_against_evals_dflash_rows(tmp_path):
    """With family dflash the 3-1-4 server is compared with eval's dflash-3-1-4 rows, not a chain-3-1-4 measured
    beside them; a gap above serve.accept_tolerance (3%) fails that dataset."""
    from eagle3.deploy_checks import accept_checks

    cfg = RunConfig.model_validate(
        {
            "run": {"workdir": str(tmp_path), "name": "r"},
            "drafter": {"family": "dflash", "dflash": {"block_size": 4}},
            "serve": {"prompts": "evaluation", "max_new_tokens": 256},
        }
    )
    results = [
        {"method": "dflash-3-1-4", "dataset": "mtbench", "num_tokens": 300, "num_verify": 100},
        {"method": "dflash-3-1-4", "dataset": "gsm8k", "num_tokens": 250, "num_verify": 100},
        {"method": "chain-3-1-4", "dataset": "mtbench", "num_tokens": 100, "num_verify": 100},
        {"method": "dflash-3-1-4", "dataset": "all", "num_tokens": 550, "num_verify": 200},
    ]
    (cfg.run_dir / "eval").mkdir(parents=True)
    (cfg.run_dir / "eval" / "results.json").write_text(
        json.dumps({"settings": {"max_new_tokens": 256}, "results": results})
    )
    # mtbench 3.0 vs 3.0; gsm8k 2.7 vs 2.5 (8% off); all 570/200 = 2.85 vs 2.75 (3.6% off)
    checks, skipped = accept_checks(cfg, _run("3-1-4", ["mtbench", "gsm8k"], [300, 270], [100, 100]))
    assert skipped is None
    assert {c.dataset: (round(c.sglang, 4), c.evaluate, c.ok) for c in checks} == {
        "mtbench": (3.0, 3.0, True),
        "gsm8k": (2.7, 2.5, False),
        "all": (2.85, 2.75, False),
    }
