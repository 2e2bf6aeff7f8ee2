"""SGLangCaptureBackend: target hidden states from SGLang 0.5.23 capture servers, over HTTP JSON.

Each sample is one ``POST /generate`` (``infra.sglang_checks.capture_request_body``): ``input_ids``, ``rid`` =
sample id, a fresh ``extra_key``, ``max_new_tokens`` 1 at temperature 0, ``return_hidden_states``, the
prompt ids echoed back, and for top-K supervision ``return_logprob`` / ``logprob_start_len`` 0 /
``top_logprobs_num`` K. The aux pass goes to servers launched in mode ``capture_aux`` (rows are
num_aux * H wide); supervision ``final_hidden`` needs a second pass on ``capture_final`` servers (rows
H wide), because SGLang does not return the final hidden state in aux mode. The two halves are joined
by sample id, and both echoes of the prompt must equal the ids we sent.

Requests, retries and the per-response checks: eagle3.features.sglang_requests.

Cost of the JSON path: a row is sent as decimal text, about 10-12 bytes per value, and SGLang builds
the Python floats in its scheduler process. One sample of T tokens is T x (num_aux + 1) x H values over
the two passes: T = 4096 at H = 4096 is 67 M values, roughly 700 MB of JSON, seconds of parsing on each
side, and a stalled scheduler meanwhile. That is fine for tests and modest datasets. A binary path would
need a server that writes the tensors itself and returns only their keys: a patched SGLang (like
SpecForge's spec-capture sink), or an ``SGLANG_EXTERNAL_MODEL_PACKAGE`` model wrapper whose forward
writes ``<sample id>.safetensors`` (aux + final, one pass) into a shared directory and whose response
names the file; the client would then check shape/finiteness from the file. Not built here.

Config: ``capture.sglang.endpoints`` are aux-capture servers; for final_hidden with existing servers
``from_config`` also reads ``capture.sglang.final_endpoints`` once that field exists. Empty endpoints
launch managed servers (``infra.sglang.ManagedServer``) that this backend stops in ``close()``.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from eagle3.config import RunConfig
from eagle3.features.sglang_requests import CaptureSession, LoopThread, ServerHandle
from eagle3.features.sglang_response import to_captured_sample
from eagle3.features.spec import CapturedSample, FeatureSpec, SampleTokens
from infra.gpus import check_gpus_free
from infra.process import RestartPolicy
from infra.sglang import ManagedServer, ServerSpec
from infra.sglang_probe import ProbeExpectations
from infra.sglang_spec import Mode


class SGLangCaptureBackend:
    """CaptureBackend over SGLang servers (several endpoints, or sglang-router replicas, share the work).

    Endpoints are base URLs, or handles with ``wait_ready`` (a ManagedServer) that are waited on after a
    dropped connection. Before the first request each endpoint's /server_info must show the capture
    mode and exactly the spec's aux layers; pass ``check_servers=False`` for a router that does not
    forward /server_info (the per-response checks still apply). The caller owns the servers.
    """

    def __init__(
        self,
        spec: FeatureSpec,
        aux_endpoints: Sequence[str | ServerHandle],
        final_endpoints: Sequence[str | ServerHandle] = (),
        *,
        api_key: str | None = None,
        max_concurrency: int = 4,
        request_timeout_s: float = 600.0,
        max_retries: int = 2,
        retry_backoff_s: float = 0.5,
        ready_timeout_s: float = 1800.0,
        check_servers: bool = True,
        owned_servers: Sequence[ManagedServer] = (),
        packed: bool = False,
    ):
        if not aux_endpoints:
            raise ValueError("SGLangCaptureBackend needs at least one aux endpoint")
        if packed and final_endpoints:
            raise ValueError("capture_packed servers return the final state themselves: give no final_endpoints")
        if spec.supervision == "final_hidden" and not final_endpoints and not packed:
            raise ValueError(
                "supervision final_hidden needs final_endpoints: servers in mode capture_final "
                "(SGLang returns no final hidden state from an aux-capture server)"
            )
        if spec.supervision == "topk_logprobs" and not spec.topk:
            raise ValueError("supervision topk_logprobs needs spec.topk")
        self.spec, self.api_key = spec, api_key
        self.aux_targets, self.final_targets = list(aux_endpoints), list(final_endpoints)
        self.max_concurrency, self.request_timeout_s = max_concurrency, request_timeout_s
        self.max_retries, self.retry_backoff_s, self.ready_timeout_s = max_retries, retry_backoff_s, ready_timeout_s
        self.check_servers, self.owned_servers = check_servers, list(owned_servers)
        self.packed = packed
        self.num_retries = 0

    @classmethod
    def from_config(cls, cfg: RunConfig, model_dir: Path, spec: FeatureSpec) -> SGLangCaptureBackend:
        """capture.sglang settings -> a backend on existing endpoints, or on managed servers it launches (as the
        run's server section says) and owns.

        Managed: a capture_aux server on ``port`` and, for final_hidden, a capture_final server on
        ``port + 1``, on the same GPUs (each gets half the memory unless mem_fraction_static is set).
        """
        sg, server = cfg.capture.sglang, cfg.server
        managed = _MANAGED.get(sg.endpoints[0]) if sg.endpoints else None
        api_key = managed.api_key if managed is not None else None
        api_key = api_key or (os.environ.get(server.api_key_env) if server.api_key_env else None)
        kwargs: dict[str, Any] = dict(
            max_concurrency=sg.max_concurrency,
            request_timeout_s=sg.request_timeout_s,
            ready_timeout_s=server.startup_timeout_s,
            packed=sg.server_mode == "capture_packed",
        )
        if sg.endpoints:  # this process's managed servers come as handles: a restart is waited for, not failed on
            return cls(
                spec,
                [_MANAGED.get(u, u) for u in sg.endpoints],
                [_MANAGED.get(u, u) for u in sg.final_endpoints],
                api_key=api_key,
                **kwargs,
            )
        api_key = api_key or secrets.token_hex(16)
        servers = _launch_servers(cfg, model_dir, spec, api_key)
        return cls(spec, servers[:1], servers[1:], api_key=api_key, owned_servers=servers, **kwargs)

    def capture(self, samples: list[SampleTokens]) -> Iterator[CapturedSample]:
        """Yield one validated CapturedSample per input sample, in order; raise CaptureError on a bad one."""
        if not samples:
            return
        loop, session = LoopThread(), CaptureSession(self, list(samples))
        try:
            loop.run(session.open())
            for index in range(len(samples)):
                yield to_captured_sample(samples[index], loop.run(session.result(index)))
        finally:
            loop.run(session.aclose())
            loop.close()

    def close(self) -> None:
        """Stop the servers this backend launched (clients live only inside capture())."""
        for server in self.owned_servers:
            server.stop()
        self.owned_servers = []


def _launch_servers(cfg: RunConfig, model_dir: Path, spec: FeatureSpec, api_key: str) -> list[ManagedServer]:
    """Start the capture_aux (and for final_hidden the capture_final) server; stop both if either fails."""
    sg, server = cfg.capture.sglang, cfg.server
    modes: list[Mode]
    if sg.server_mode == "capture_packed":
        modes = ["capture_packed"]
    else:
        modes = ["capture_aux"]
        if spec.supervision == "final_hidden":
            modes.append("capture_final")
    mem = sg.mem_fraction_static or (0.8 / len(modes) if len(modes) > 1 else None)
    check_gpus_free(_gpu_indices(server.tp_size * sg.dp_size), allow_shared=cfg.capture.allow_shared_gpus)
    servers: list[ManagedServer] = []
    try:
        for offset, mode in enumerate(modes):
            server_spec = ServerSpec(
                str(model_dir),
                mode,
                port=sg.port + offset,
                host=server.host,
                allow_remote=server.allow_remote_host,
                tp_size=server.tp_size,
                dp_size=sg.dp_size,
                api_key=api_key,
                mem_fraction_static=mem,
                # the in-process capture's compute dtype: without --dtype SGLang serves a float32 checkpoint (a
                # converted GGUF target) in float16, whose states differ from bf16 ones and can overflow
                dtype=cfg.target.dtype,
                attention_backend=server.attention_backend,
                aux_layer_ids=tuple(spec.aux_layer_ids) if mode != "capture_final" else None,
                extra_args=tuple(server.extra_args),
                python=server.python,
                module=server.launch_module,
            )
            managed = ManagedServer(
                server_spec,
                cfg.run_dir / "logs" / f"sglang-{mode}.log",
                expect=ProbeExpectations(hidden_size=spec.hidden_size, vocab_size=spec.vocab_size),
                startup_timeout_s=server.startup_timeout_s,
                policy=RestartPolicy(max_restarts=sg.max_restarts),
            )
            managed.check_port()  # both ports, before the first launch spends minutes loading weights
            servers.append(managed)
        for managed in servers:
            managed.start()
    except BaseException:
        for managed in servers:
            managed.stop()
        raise
    return servers


def _gpu_indices(num_gpus: int) -> list[int]:
    """The GPUs a server will use: the first of CUDA_VISIBLE_DEVICES (when numeric), else 0..n-1."""
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip().isdigit()]
    return [int(d) for d in visible[:num_gpus]] if visible else list(range(num_gpus))


_MANAGED: dict[str, ManagedServer] = {}
"""Base URL -> the server ``managed_endpoints`` runs in this process (its API key, and its restarts to wait for)."""


@contextlib.contextmanager
def managed_endpoints(cfg: RunConfig, model_dir: Path, spec: FeatureSpec) -> Iterator[RunConfig]:
    """Launch the capture servers once for a whole capture and yield a config that points at them.

    Shard tasks (threads of this process) then build backends on existing endpoints (no launch per
    shard); the API key is handed over in this process's memory (``_MANAGED``), never through
    ``os.environ``, which every child process would inherit. Servers stop on exit.
    """
    sg = cfg.capture.sglang
    if sg.endpoints:
        yield cfg
        return
    env = cfg.server.api_key_env
    api_key = (os.environ.get(env) if env else None) or secrets.token_hex(16)
    servers = _launch_servers(cfg, model_dir, spec, api_key)
    urls = [server.spec.base_url for server in servers]
    _MANAGED.update({server.spec.base_url: server for server in servers})
    try:
        sglang = sg.model_copy(update={"endpoints": urls[:1], "final_endpoints": urls[1:]})
        yield cfg.model_copy(update={"capture": cfg.capture.model_copy(update={"sglang": sglang})})
    finally:
        for server in servers:
            server.stop()
        for url in urls:
            _MANAGED.pop(url, None)
