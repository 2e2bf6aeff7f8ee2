"""regenerate.backend=sglang: the stage starts an SGLang server on the target, answers every user turn through its
OpenAI route, and stops it; a server that never starts fails the stage with its log named and writes nothing.
The server here is tests/fakes/sglang_server.py (a TEST DOUBLE, not SGLang), whose chat route answers as the fake
OpenAI server does (tests/fakes/openai_server.py fake_answer)."""

from __future__ import annotations

import socket
import sys

import pyarrow.parquet as pq
import pytest

from eagle3.config import load_config
from eagle3.data.sglang_chat import LOG_NAME
from eagle3.data.stages import merge, regenerate
from eagle3.run.layout import run_layout
from infra.sglang import ServerStartError
from tests.fakes.openai_server import fake_answer
from tests.fakes.sglang_server import two_free_ports


def config(tmp_path, module: str = "tests.fakes.sglang_server"):
    return load_config(
        "tiny",
        [
            f"run.workdir={tmp_path}",
            "regenerate.enabled=true",
            "regenerate.backend=sglang",
            f"regenerate.sglang_port={two_free_ports()}",
            "regenerate.max_concurrency=4",
            f"server.python={sys.executable}",
            f"server.launch_module={module}",
            "server.api_key_env=null",
            "server.startup_timeout_s=30",
            'server.extra_args=["--fake-lifetime-s", "120"]',
        ],
    )


def port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def test_the_stage_answers_through_a_server_it_starts_and_stops(tmp_path):
    """Every regenerated answer is the server's answer to its history (the new answers before it), and the
    server is gone when the stage returns."""
    cfg = config(tmp_path)
    merge.run(cfg)
    outcome = regenerate.run(cfg)
    assert outcome is not None
    rows = pq.read_table(run_layout(cfg).regenerated).to_pylist()
    answers = 0
    for row in rows:
        history: list[dict[str, str]] = []
        for message in row["messages"]:
            if message["role"] == "assistant":
                assert message["content"] == fake_answer(history), row["id"]
                answers += 1
            history.append({"role": message["role"], "content": message["content"]})
    assert len(rows) == 60 and answers >= 60  # the tiny preset's 60 chats, each answered at least once
    assert port_is_free(cfg.regenerate.sglang_port)
    assert (cfg.run_dir / "logs" / LOG_NAME).exists()


def test_a_server_that_never_starts_fails_the_stage_and_writes_nothing(tmp_path):
    """A launch module that exits at once: ServerStartError naming the server log, no regenerated file."""
    cfg = config(tmp_path, module="tests.fakes.no_such_server_module")
    merge.run(cfg)
    with pytest.raises(ServerStartError, match=LOG_NAME):
        regenerate.run(cfg)
    assert not run_layout(cfg).regenerated.exists()
    assert port_is_free(cfg.regenerate.sglang_port)
