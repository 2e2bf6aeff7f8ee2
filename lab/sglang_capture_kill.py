"""The kill-and-resume test of the capture stage against a managed SGLang server (``sglang_capture.py --kill-test``).

Runs the REAL capture stage, ``python -m eagle3.features.capture --config ...`` with capture.backend sglang, in a
subprocess on a copy of the first N train rows (run ``<name>-sglang-killtest`` beside RUN; tokens_per_shard set
for >= ``--min-shards`` shards), waits for 2 complete shards, SIGKILLs the SGLang server (the descendant of the
capture process whose command line holds the launch module and ``--port <capture.sglang.port>``), lets the managed
server's supervisor restart it, and checks: the stage exits 0, every shard is complete, the shards done before the
kill were not rewritten (sha256 and mtime), the server log shows the restart; then runs the stage again, which must
rewrite nothing. The kill run keeps server.launch_module (``-m sglang.launch_server``); with another ``--module``
(the dry run's fake) the stage gets a small interpreter shim that swaps the module.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import types
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from eagle3.config import RunConfig, read_config_file, save_config, validate_config  # noqa: E402
from infra.process import descendants  # noqa: E402
from infra.sglang import LAUNCH_MODULE  # noqa: E402
from infra.storage import sha256_file, sha256_text  # noqa: E402
from lab.sglang_lab import bench_config, say  # noqa: E402

KILL_MARKER = ".sglang-killtest"


@dataclass(frozen=True)
class FileStamp:
    """A file's content hash and modification time (a rewrite changes the mtime even with equal bytes)."""

    sha256: str
    mtime_ns: int


def stamp(path: Path) -> FileStamp:
    return FileStamp(sha256_file(path), path.stat().st_mtime_ns)


def done_shards(fdir: Path) -> list[Path]:
    """Done files of the features folder, sorted."""
    return sorted(fdir.glob("shard-*.done.json"))


def stamps(fdir: Path) -> dict[str, FileStamp]:
    """Shard name -> stamp of its safetensors file, and of its done file (both must stay unchanged)."""
    out = {}
    for done in done_shards(fdir):
        shard = done.with_name(done.name.replace(".done.json", ".safetensors"))
        out[shard.name], out[done.name] = stamp(shard), stamp(done)
    return out


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def server_pid(capture_pid: int, module: str, port: int) -> int | None:
    """The descendant of the capture process running ``-m module`` with ``--port port`` (the group leader)."""
    for pid in descendants(capture_pid):
        argv = cmdline(pid)
        if module in argv and "--port" in argv and argv[argv.index("--port") + 1 :][:1] == [str(port)]:
            return pid
    return None


def health_ok(base_url: str) -> bool:
    """GET /health answers 200 (no key needed)."""
    import httpx

    try:
        return httpx.get(f"{base_url}/health", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def prepare_kill_run(cfg: RunConfig, args: argparse.Namespace) -> tuple[RunConfig, Path]:
    """A fresh run beside RUN with the first N train rows and their tokenize manifest; its config file."""
    from eagle3.run.layout import run_layout
    from eagle3.run.registry import get_stage

    kcfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"name": f"{cfg.run.name}-sglang-killtest"})})
    kdir = kcfg.run_dir
    if kdir.exists():
        if not (kdir / KILL_MARKER).is_file():
            raise RuntimeError(f"{kdir} exists and was not made by this benchmark (no {KILL_MARKER}): move it away")
        shutil.rmtree(kdir)
    src, dst = run_layout(cfg), run_layout(kcfg)
    dst.tokenized.parent.mkdir(parents=True)
    (kdir / KILL_MARKER).write_text("made by lab/sglang_capture.py --kill-test; safe to delete\n")
    num_tokens = write_first_rows(src.tokenized, dst.tokenized, args.samples)
    tokenize = get_stage("tokenize")
    copy_tokenize_manifest(tokenize.manifest(src.root), tokenize.manifest(dst.root), dst.tokenized, args.samples)
    tokens_per_shard = shard_budget(dst.tokenized, num_tokens, args.min_shards)
    bench = bench_config(kcfg, args, "sglang")
    capture = bench.capture.model_copy(
        update={"supervision": cfg.capture.supervision, "tokens_per_shard": tokens_per_shard}
    )
    server = bench.server.model_copy(update={"python": stage_python(kdir, args)})
    # The stage captures nothing for a run that trains online: this run is offline whatever RUN does.
    kcfg = kcfg.model_copy(
        update={"capture": capture, "server": server, "train": kcfg.train.model_copy(update={"features": "offline"})}
    )
    path = save_config(kcfg, kdir / "bench-config.json")
    return validate_config(read_config_file(path), str(path)), path


def write_first_rows(src: Path, dst: Path, num: int) -> int:
    """The first ``num`` train rows of src, all columns and schema kept; returns their token count."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    table = pq.read_table(src)
    table = table.filter(pc.equal(table["split"], "train")).slice(0, num)
    pq.write_table(table, dst)
    return int(pc.sum(table["num_tokens"]).as_py())


def copy_tokenize_manifest(src: Path, dst: Path, tokenized: Path, num: int) -> None:
    """The tokenize manifest for the cut parquet: its size and sha256, a key of its own, the rejects copied."""
    from infra.storage import atomic_write_text

    doc = json.loads(src.read_text())
    for entry in doc["outputs"].values():
        if entry["path"] != tokenized.name:
            shutil.copyfile(src.parent / entry["path"], dst.parent / entry["path"])
    doc["outputs"]["tokenized"] |= {"bytes": tokenized.stat().st_size, "sha256": sha256_file(tokenized)}
    doc["key"] = sha256_text(f"{doc['key']}:first {num} train rows")
    atomic_write_text(dst, json.dumps(doc, indent=2) + "\n")


def shard_budget(tokenized: Path, num_tokens: int, min_shards: int) -> int:
    """tokens_per_shard giving at least ``min_shards`` shards (the greedy planner's own count)."""
    import pyarrow.parquet as pq

    from eagle3.features.plan import plan_shards

    table = pq.read_table(tokenized, columns=["id", "num_tokens"])
    ids, lengths = table["id"].to_pylist(), table["num_tokens"].to_pylist()
    if len(ids) < min_shards:
        raise ValueError(f"{len(ids)} samples cannot make {min_shards} shards: raise --samples")
    budget = max(1, num_tokens // (min_shards + 2))
    while len(plan_shards(ids, lengths, budget)) < min_shards and budget > 1:
        budget = max(1, budget * 3 // 4)
    return budget


def stage_python(kdir: Path, args: argparse.Namespace) -> str:
    """The server interpreter the stage gets: args.python, or a shim running args.module instead of sglang's."""
    if args.module == LAUNCH_MODULE:
        return args.python
    shim = kdir / "python-shim"
    shim.write_text(
        f"#!/bin/sh\n# -m {LAUNCH_MODULE} -> -m {args.module} (lab/sglang_capture.py dry run)\n"
        f'if [ "$1" = "-m" ] && [ "$2" = "{LAUNCH_MODULE}" ]; then shift 2; '
        f'exec "{os.path.abspath(args.python)}" -m {args.module} "$@"; fi\n'
        f'exec "{os.path.abspath(args.python)}" "$@"\n'
    )
    shim.chmod(0o755)
    return str(shim)


def stage_command(config_path: Path) -> list[str]:
    """The capture stage's command line."""
    return [sys.executable, "-m", "eagle3.features.capture", "--config", str(config_path)]


def run_kill_test(cfg: RunConfig, args: argparse.Namespace, results: dict[str, Any]) -> list[str]:
    """The kill test; its figures go to results['kill_test']; returns the failed checks."""
    kcfg, config_path = prepare_kill_run(cfg, args)
    from eagle3.run.layout import run_layout

    fdir = run_layout(kcfg).features
    sg = types.SimpleNamespace(host=kcfg.server.host, port=kcfg.capture.sglang.port)  # the managed server's address
    log_path = kcfg.run_dir / "logs" / "sglang-capture_packed.log"
    cmd = stage_command(config_path)
    figures: dict[str, Any] = {
        "run_dir": str(kcfg.run_dir),
        "tokens_per_shard": kcfg.capture.tokens_per_shard,
        "command": cmd,
    }
    results["kill_test"] = figures
    say(f"kill test: {' '.join(cmd)}")
    first = launch_stage(cmd, kcfg.run_dir / "capture-stage-1.out")
    try:
        failures = kill_during(first, fdir, args.module, sg, figures, args.kill_timeout_s)
    finally:
        stop_stage(first, args.module, sg.port)
    plan = json.loads((fdir / "plan.json").read_text()) if (fdir / "plan.json").is_file() else {"shards": []}
    figures["num_shards_planned"] = len(plan["shards"])
    after = stamps(fdir)
    figures["num_shards_after"] = len(done_shards(fdir))
    failures += check_after_kill(figures, after, log_path, fdir)
    if failures:  # a second run would capture again what the first left undone: not a no-op test
        figures["failures"] = failures
        for failure in failures:
            say(f"kill test FAILED: {failure}")
        return [f"kill test: {f}" for f in failures]
    failures += check_rerun(cmd, kcfg.run_dir / "capture-stage-2.out", fdir, after, figures, args.kill_timeout_s)
    figures["failures"] = failures
    for failure in failures:
        say(f"kill test FAILED: {failure}")
    if not failures:
        say("kill test passed")
    return [f"kill test: {f}" for f in failures]


def launch_stage(cmd: list[str], out: Path) -> subprocess.Popen[bytes]:
    """The stage in its own process group (so a failed test can kill it whole), output to ``out``."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(out, "wb") as sink:
        return subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True)


def stop_stage(proc: subprocess.Popen[bytes], module: str, port: int) -> None:
    """A stage still running after a failed check: kill its server's group (own session), then the stage."""
    if proc.poll() is not None:
        return
    pid = server_pid(proc.pid, module, port)
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def kill_during(
    proc: subprocess.Popen[bytes], fdir: Path, module: str, sg: Any, figures: dict[str, Any], timeout_s: float
) -> list[str]:
    """Wait for 2 done shards, SIGKILL the server, watch it come back, wait for the stage to end."""
    t0 = time.monotonic()
    while len(done_shards(fdir)) < 2:
        if proc.poll() is not None:
            return [f"the capture stage ended (exit {proc.returncode}) before 2 shards were complete"]
        if time.monotonic() - t0 > timeout_s:
            return [f"no 2 complete shards within {timeout_s:.0f} s"]
        time.sleep(0.05)
    pid = server_pid(proc.pid, module, sg.port)
    before = stamps(fdir)
    figures |= {"shards_done_before_kill": len(before) // 2, "seconds_to_two_shards": round(time.monotonic() - t0, 2)}
    if pid is None:
        return [f"no child of the capture process {proc.pid} runs -m {module} --port {sg.port}"]
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    say(f"kill test: SIGKILLed server pid {pid} with {len(before) // 2} shards complete")
    figures |= {"killed_pid": pid, "shards_before": {k: asdict(v) for k, v in before.items()}}
    figures |= watch_restart(proc, pid, module, sg, killed_at, len(before) // 2, fdir, timeout_s)
    try:
        proc.wait(timeout=max(1.0, timeout_s - (time.monotonic() - t0)))
    except subprocess.TimeoutExpired:
        return [f"the capture stage did not finish within {timeout_s:.0f} s"]
    figures["stage_exit"] = proc.returncode
    failures = [] if proc.returncode == 0 else [f"the capture stage exited {proc.returncode}"]
    after = stamps(fdir)
    rewritten = [name for name, s in before.items() if after.get(name) != s]
    figures["rewritten_after_kill"] = rewritten
    return failures + ([f"shards done before the kill were rewritten: {rewritten}"] if rewritten else [])


def watch_restart(
    proc: subprocess.Popen[bytes],
    old_pid: int,
    module: str,
    sg: Any,
    killed_at: float,
    done_at_kill: int,
    fdir: Path,
    timeout_s: float,
) -> dict[str, Any]:
    """Seconds from the kill to: a new server process, its /health answering 200, the next complete shard."""
    seen: dict[str, Any] = {}
    url = f"http://{sg.host}:{sg.port}"
    while proc.poll() is None and time.monotonic() - killed_at < timeout_s:
        now = round(time.monotonic() - killed_at, 2)
        if "new_server_s" not in seen:
            pid = server_pid(proc.pid, module, sg.port)
            if pid is not None and pid != old_pid:
                seen |= {"new_server_s": now, "new_pid": pid}
        elif "health_ok_s" not in seen and health_ok(url):
            seen["health_ok_s"] = now
        if "next_shard_s" not in seen and len(done_shards(fdir)) > done_at_kill:
            seen["next_shard_s"] = now
        if len(seen) == 4:
            break
        time.sleep(0.05)
    say(f"kill test: after the kill {seen}")
    return {"restart": seen}


def check_after_kill(figures: dict[str, Any], after: dict[str, FileStamp], log_path: Path, fdir: Path) -> list[str]:
    """Every planned shard complete, the manifest written, the restart in the server log."""
    failures = []
    if figures["num_shards_planned"] < 6:
        failures.append(f"only {figures['num_shards_planned']} shards planned (want >= 6)")
    if figures["num_shards_after"] != figures["num_shards_planned"]:
        failures.append(f"{figures['num_shards_after']} of {figures['num_shards_planned']} shards complete")
    if not (fdir / "capture.manifest.json").is_file():
        failures.append(f"no {fdir / 'capture.manifest.json'}")
    log = log_path.read_text(errors="replace") if log_path.is_file() else ""
    figures["log_restart_lines"] = [line for line in log.splitlines() if "restart" in line or "died" in line][-5:]
    if "restart 1/" not in log:
        failures.append(f"{log_path} shows no 'restart 1/' line")
    return failures


def check_rerun(
    cmd: list[str], out: Path, fdir: Path, after: dict[str, FileStamp], figures: dict[str, Any], timeout_s: float
) -> list[str]:
    """The stage once more: exit 0, computed false, no shard file touched."""
    t0 = time.monotonic()
    proc = launch_stage(cmd, out)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stop_stage(proc, LAUNCH_MODULE, -1)
        return [f"the second capture run did not finish within {timeout_s:.0f} s"]
    text = out.read_text(errors="replace")
    computed = '"computed": false' not in text
    touched = [name for name, s in stamps(fdir).items() if after.get(name) != s]
    figures["rerun"] = {
        "exit": proc.returncode,
        "elapsed_s": round(time.monotonic() - t0, 2),
        "computed": computed,
        "touched": touched,
    }
    failures = [] if proc.returncode == 0 else [f"the second run exited {proc.returncode}: {text[-500:]}"]
    if computed:
        failures.append("the second run was not a no-op (no '\"computed\": false' in its output)")
    return failures + ([f"the second run rewrote {touched}"] if touched else [])


# ---------------------------------------------------------------- command line
