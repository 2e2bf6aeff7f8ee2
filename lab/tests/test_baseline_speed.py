"""lab/baseline_speed.py against the fake SGLang server on the tiny target (CPU): the plumbing, not a figure."""

from __future__ import annotations

import json
import sys

import pytest

from lab import baseline_speed
from tests.fakes.sglang_server import two_free_ports

FAKE = "tests.fakes.sglang_server"


def test_eval_decodes_as_many_tokens_as_the_server_returned_per_prompt_for_every_attention(tmp_path):
    """The fake baseline server answers the evaluation prompts; every --attention variant then decodes each prompt
    for exactly the server's token count, and the JSON carries both rates and their ratio."""
    out = tmp_path / "speed.json"
    sets = [
        f"run.workdir={tmp_path}",
        "evaluate.num_prompts=4",
        "evaluate.num_prompts_by_dataset={}",
        "evaluate.device=cpu",
        "evaluate.static_cache=on",
        "evaluate.compile=off",
        "serve.num_prompts=4",
        "serve.max_new_tokens=9",
        "serve.num_warmup=1",
        "serve.concurrency_levels=[1]",
        f"serve.port={two_free_ports()}",
        "server.api_key_env=null",
        "server.startup_timeout_s=60",
        'server.extra_args=["--fake-step-s","0.001","--fake-lifetime-s","120"]',
    ]
    argv = ["--preset", "tiny", "--out", str(out), "--attention", "sdpa,matmul+fused", "--module", FAKE]
    argv += ["--python", sys.executable, *(x for s in sets for x in ("--set", s))]
    assert baseline_speed.main(argv) == 0
    doc = json.loads(out.read_text())
    sglang = doc["sglang"]
    assert sglang["concurrency"] == 1 and len(sglang["output_ids"]) == 4
    assert sglang["completion_tokens"] == sum(map(len, sglang["output_ids"])) == 4 * 9
    for variant in ("sdpa", "matmul+fused"):
        row = doc["eval"][variant]
        assert row["tokens"] == 4 * 9 and row["wall_s"] > 0
        assert row["ratio"] == pytest.approx(row["tok_per_s"] / sglang["tok_per_s"])
    assert doc["eval"]["matmul+fused"]["fused"] and not doc["eval"]["sdpa"]["fused"]
    assert doc["failures"] == []


def test_an_unknown_attention_is_refused_by_name_before_any_server_starts(tmp_path):
    """A misspelt variant stops the run naming it and the accepted values."""
    with pytest.raises(SystemExit, match="--attention flash: use sdpa, packed, matmul, flex"):
        baseline_speed.main(["--out", str(tmp_path / "x.json"), "--attention", "sdpa,flash"])
