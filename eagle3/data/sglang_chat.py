"""Regeneration through an SGLang server the stage starts itself (``regenerate.backend: sglang``).

The server is SGLang's plain ``serve`` mode on the target directory (``infra.sglang.ManagedServer`` with
``ServerSpec(target, "serve")``), launched as the run's ``server`` section says (interpreter, launch module, host,
tensor parallelism, attention backend, extra flags) at ``regenerate.sglang_port``, in the target's compute dtype,
with an API key from ``server.api_key_env`` or one generated for this launch. Answers go through its
OpenAI-compatible ``/v1/chat/completions`` (``OpenAIChatBackend``, the openai backend's client, model name = the
served path), so SGLang's continuous batching answers ``regenerate.max_concurrency`` conversations at once. The
server is stopped when regeneration ends, also on an error; its log is ``logs/sglang-regenerate.log`` in the run.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

from eagle3.config import RunConfig
from eagle3.data.chat_backends import OpenAIChatBackend
from infra.sglang import ManagedServer
from infra.sglang_spec import ServerSpec

LOG_NAME = "sglang-regenerate.log"
"""The managed server's log, under the run's logs/."""


def server_spec(cfg: RunConfig, model_dir: Path, api_key: str) -> ServerSpec:
    """The launch of the regeneration server: the target served plainly, as the server section says."""
    server = cfg.server
    return ServerSpec(
        str(model_dir),
        "serve",
        port=cfg.regenerate.sglang_port,
        host=server.host,
        allow_remote=server.allow_remote_host,
        tp_size=server.tp_size,
        api_key=api_key,
        # as capture's servers: without --dtype SGLang serves a float32 checkpoint (a converted GGUF target) in
        # float16, not in the dtype the in-process path computes in
        dtype=cfg.target.dtype,
        attention_backend=server.attention_backend,
        extra_args=tuple(server.extra_args),
        python=server.python,
        module=server.launch_module,
    )


@contextlib.contextmanager
def managed_chat_backend(cfg: RunConfig, model_dir: Path) -> Iterator[OpenAIChatBackend]:
    """Start the server, yield an OpenAI client on it, stop the server on the way out (whatever happened)."""
    server = cfg.server
    api_key = (os.environ.get(server.api_key_env) if server.api_key_env else None) or secrets.token_hex(16)
    managed = ManagedServer(
        server_spec(cfg, model_dir, api_key),
        cfg.run_dir / "logs" / LOG_NAME,
        startup_timeout_s=server.startup_timeout_s,
    )
    managed.check_port()  # a busy port fails now, not after minutes of loading weights
    try:
        managed.start()
        regen = cfg.regenerate.model_copy(
            update={"backend": "openai", "endpoint": managed.base_url + "/v1", "model": str(model_dir)}
        )
        yield OpenAIChatBackend(regen, api_key=api_key)
    finally:
        managed.stop()  # idempotent; also removes the key file a failed start leaves
