"""A managed SGLang 0.5.23 server: launch, readiness, supervision. Request bodies and response checks are
infra/sglang_checks.py, the readiness probe infra/sglang_probe.py.

``ServerSpec`` (infra/sglang_spec.py, re-exported here) describes a server (model, mode, TP/DP,
port, flags) and builds its argv; tests check every argv against SGLang's own argument parser.
``ManagedServer`` launches it in its own process
group with a log file, reports ready only after the probe of ``probe_ready`` (model_info ->
health_generate -> server_info -> our own checked forward pass), restarts it with backoff when it
dies, and kills the whole group on exit. Every error names the log file and shows its tail.

The API key reaches the server in a 0600 YAML file beside the log (``--config``, removed on stop), not
on its command line, and the server's environment has no variable holding the key. SGLang itself
writes the key into its log (the startup ``server_args=`` line) and returns it from /server_info to
key holders, so the log of a server with a key is created 0600 too.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path

import httpx

from infra.process import ProcessDiedError, RestartPolicy, SupervisedProcess, port_bindable, port_in_use
from infra.sglang_modes import (  # noqa: F401 (re-exported: callers import the modes from infra.sglang)
    CAPTURE_MODES,
    MODES,
    SGLANG_VERSION,
    SGLANG_VERSIONS,
    Mode,
)
from infra.sglang_pairs import (  # noqa: F401 (re-exported: callers import the pairs from infra.sglang)
    dflash_serving_pair,
    ngram_serving_pair,
    serving_pair,
)
from infra.sglang_probe import ProbeExpectations, ReadyReport, ServerCheckError, ServerGoneError, probe_ready
from infra.sglang_spec import (  # noqa: F401 (re-exported: callers import the spec from infra.sglang)
    LAUNCH_MODULE,
    NgramSettings,
    ServerSpec,
    ServerSpecError,
)
from infra.storage import private_write_text

HEALTH_POLL_S = 0.5  # between /health checks of a server its supervisor calls ready


class ServerStartError(RuntimeError):
    """A managed server did not become ready; the message names the log and shows its tail."""


def key_file_for(log_path: Path) -> Path:
    """Where a managed server's API key file lives: hidden, beside its log, named for SGLang's YAML check."""
    return log_path.with_name(f".{log_path.stem}.api-key.yaml")


def env_without_secret(env: Mapping[str, str], secret: str | None) -> dict[str, str]:
    """``env`` minus every variable whose value is the secret (the server gets its key from the key file)."""
    return {k: v for k, v in env.items() if not secret or v != secret}


def _make_private(path: Path) -> None:
    """Create ``path`` (or keep it) readable by this user only: SGLang logs its API key at startup."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)


def launch_env(spec: ServerSpec, env: Mapping[str, str] | None) -> dict[str, str]:
    """The caller's environment (default ours) plus what the spec's mode needs; PYTHONPATH is prepended to."""
    merged = dict(os.environ if env is None else env)
    for key, value in spec.launch_env().items():
        merged[key] = value + os.pathsep + merged[key] if key == "PYTHONPATH" and merged.get(key) else value
    return merged


class ManagedServer:
    """An SGLang server we launch, probe, restart when it dies, and kill as a group (context manager).

    After ``start()`` a watchdog thread checks the child every ``watch_s`` seconds; when it died, the
    server is marked not ready, restarted with backoff and probed again. Clients that hit a dead
    server call ``wait_ready()`` and retry once it returns.
    """

    def __init__(
        self,
        spec: ServerSpec,
        log_path: Path,
        *,
        expect: ProbeExpectations = ProbeExpectations(),
        startup_timeout_s: float = 1800.0,
        policy: RestartPolicy = RestartPolicy(),
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        poll_s: float = 1.0,
        watch_s: float = 2.0,
    ):
        if spec.mode in CAPTURE_MODES and expect.hidden_size is None:
            raise ServerSpecError("a capture server needs expect.hidden_size: its smoke check compares row widths")
        self.spec, self.expect, self.startup_timeout_s = spec, expect, startup_timeout_s
        self.poll_s, self.watch_s = poll_s, watch_s
        self.key_file = key_file_for(Path(log_path)) if spec.api_key else None
        self.process = SupervisedProcess(
            spec.argv(str(self.key_file) if self.key_file else None),
            log_path,
            env=env_without_secret(launch_env(spec, env), spec.api_key),
            cwd=cwd,
            policy=policy,
            secret_flags=("--api-key",),
        )
        self.report: ReadyReport | None = None
        self._ready, self._stopping = threading.Event(), threading.Event()
        self._failure: BaseException | None = None
        self._watchdog: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        return self.spec.base_url

    @property
    def api_key(self) -> str | None:
        return self.spec.api_key

    @property
    def log_path(self) -> Path:
        return self.process.log_path

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def num_restarts(self) -> int:
        return self.process.num_restarts

    @property
    def ready(self) -> bool:
        """True only between a passed probe and the next death or stop."""
        return self._ready.is_set() and self._failure is None and not self._stopping.is_set()

    def check_port(self) -> None:
        """ServerStartError unless this server's port is free to listen on (call before a slow launch)."""
        if port_in_use(self.spec.host, self.spec.port):
            # The probe would talk to that server instead of ours, and might even find it healthy.
            raise ServerStartError(
                f"{self.spec.host}:{self.spec.port} already answers: stop that server "
                "(a stale one?) or pick another port"
            )
        try:
            bindable = port_bindable(self.spec.host, self.spec.port)
        except OSError as exc:
            raise ServerStartError(f"{self.spec.host}:{self.spec.port} cannot be listened on: {exc}") from exc
        if not bindable:
            raise ServerStartError(
                f"{self.spec.host}:{self.spec.port} is held by another socket (nothing "
                "answers there, but the server could not bind it): pick another port"
            )

    def start(self) -> ReadyReport:
        """Launch and probe, restarting a child that dies during start-up; ServerStartError if never ready."""
        self.check_port()
        if self.key_file is not None:
            private_write_text(self.key_file, self.spec.key_file_text())
            _make_private(self.log_path)
        self.process.start()
        try:
            self.report = self._bring_up()
        except BaseException:
            self._stopping.set()
            self.process.stop()
            raise
        self._watchdog = threading.Thread(target=self._watch, name=f"sglang-watchdog-{self.spec.port}", daemon=True)
        self._watchdog.start()
        return self.report

    def _alive(self) -> bool:
        return not self._stopping.is_set() and self.process.alive()

    def _bring_up(self) -> ReadyReport:
        """Probe until ready; a death restarts (bounded by the policy), a failed check stops for good."""
        while True:
            try:
                report = probe_ready(
                    self.spec, self.expect, timeout_s=self.startup_timeout_s, is_alive=self._alive, poll_s=self.poll_s
                )
            except ServerGoneError:
                if self._stopping.is_set():
                    raise
                self._restart()
                continue
            except (ServerCheckError, TimeoutError) as exc:
                raise ServerStartError(self.process.failure_message(f"SGLang server not ready: {exc}")) from exc
            self._ready.set()
            return report

    def _restart(self) -> None:
        try:
            self.process.restart(self._stopping)
        except ProcessDiedError as exc:
            raise ServerStartError(str(exc)) from exc

    def _watch(self) -> None:
        while not self._stopping.wait(self.watch_s):
            if self.process.alive():
                continue
            self._ready.clear()
            try:
                self._restart()
                self.report = self._bring_up()
            except BaseException as exc:  # recorded for wait_ready(); a watchdog must not die silently
                self._failure = exc
                self.process.stop()  # a child that failed its checks must not keep the GPUs
                self._ready.set()  # wake waiters so they see the failure
                return

    def wait_ready(self, timeout_s: float) -> None:
        """Block until the server is ready again and answers /health; raise if the supervisor gave up or time runs
        out. The supervisor's word alone is not enough: a server whose listener is gone can still be alive for a
        moment (SGLang's main process takes a while to exit after a fatal error), so until /health answers the
        supervisor is asked again, and it notices the death and restarts."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._wait_supervised(max(deadline - time.monotonic(), 0.0))
            if self._answers_health():
                return
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    self.process.failure_message(
                        f"SGLang server at {self.base_url} is called ready "
                        f"but did not answer /health within {timeout_s:.0f} s"
                    )
                )
            time.sleep(HEALTH_POLL_S)

    def _wait_supervised(self, timeout_s: float) -> None:
        """Block until the supervisor calls the server ready (after a restart if it died)."""
        if self._ready.is_set() and self._failure is None and not self.process.alive():
            self._ready.clear()  # the client saw the death before the watchdog did
        if not self._ready.wait(timeout_s):
            raise TimeoutError(
                self.process.failure_message(
                    f"SGLang server at {self.base_url} not ready again within {timeout_s:.0f} s"
                )
            )
        if self._stopping.is_set():
            raise ServerGoneError(f"SGLang server at {self.base_url} was stopped")
        if self._failure is not None:
            raise ServerStartError(str(self._failure)) from self._failure

    def _answers_health(self) -> bool:
        """GET /health answers 200 (no key needed: SGLang serves it to anyone); a refused connection is False."""
        try:
            return httpx.get(f"{self.base_url}/health", timeout=HEALTH_POLL_S * 10).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        """Stop watching, then kill the whole process group (idempotent); wakes wait_ready() callers."""
        self._stopping.set()
        if self._watchdog is not None and self._watchdog is not threading.current_thread():
            self._watchdog.join(timeout=max(30.0, self.watch_s * 2))
        self.process.stop()
        if self.key_file is not None:
            self.key_file.unlink(missing_ok=True)
        self._ready.set()  # waiters wake, see _stopping and raise instead of blocking until their timeout

    def __enter__(self) -> ManagedServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
