"""Read a trace of SGLang's own profiler (``/start_profile``; torch profiler chrome trace, ``*.trace.json.gz``):
where a speculative round's time goes.

Prints, for the span the GPU kernels cover: the share of it the GPU was busy (union of kernel intervals), the
CPU-side time of SGLang's phase annotations per round (``draft``, ``step[TARGET_VERIFY ...]``, ``draft_extend``,
``scheduler.*``), the kernels by total time, and the CUDA launch calls (graph launches vs single kernels).
A round = one ``step[TARGET_VERIFY ...]`` annotation. The profiler's Python tracing slows the CPU side, so CPU
times here are upper bounds; GPU kernel times are not affected.

    python lab/sglang_trace.py runs/<run>/levers/profile/levers-TP-0.trace.json.gz [--json OUT]
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any


def load_events(path: Path) -> list[dict[str, Any]]:
    """The trace's complete events (chrome trace format, gzip or plain JSON)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        doc = json.load(f)
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (microseconds)."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def summarize_trace(events: list[dict[str, Any]], top: int = 12) -> dict[str, Any]:
    """GPU busy share, per-round phase times, top kernels and launch counts of one profiled stretch."""
    kernels = [e for e in events if e.get("cat") == "kernel"]
    if not kernels:
        raise ValueError("the trace has no GPU kernel events (profile with activities CPU and GPU)")
    span = max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)
    busy = busy_us([(e["ts"], e["ts"] + e["dur"]) for e in kernels])
    phases: dict[str, float] = defaultdict(float)
    for e in events:
        if e.get("cat") == "user_annotation":
            phases[e["name"].split(" ")[0] if e["name"].startswith("step[") else e["name"]] += e["dur"]
    rounds = sum(1 for e in events if e.get("cat") == "user_annotation" and e["name"].startswith("step[TARGET_VERIFY"))
    by_kernel: dict[str, float] = defaultdict(float)
    for e in kernels:
        by_kernel[e["name"][:80]] += e["dur"]
    launch_events = [
        e
        for e in events
        if e.get("cat") == "cuda_runtime"
        and e["name"] in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cudaGraphLaunch")
    ]
    launches = Counter(e["name"] for e in launch_events)
    annotations = defaultdict(list)  # thread -> its phase annotations (scheduler.run_batch encloses them all)
    for e in events:
        if e.get("cat") == "user_annotation" and e["name"] != "scheduler.run_batch":
            annotations[e.get("tid")].append(e)
    phases_of_launches = Counter(f"{enclosing_phase(e, annotations[e.get('tid')])}: {e['name']}" for e in launch_events)
    per_round = max(rounds, 1)
    return {
        "rounds": rounds,
        "kernel_span_ms": span / 1000,
        "gpu_busy_ms": busy / 1000,
        "gpu_busy_share": busy / span,
        "gpu_busy_ms_per_round": busy / 1000 / per_round,
        "cpu_ms_per_round": {k: v / 1000 / per_round for k, v in sorted(phases.items(), key=lambda kv: -kv[1])},
        "top_kernels_ms": {k: v / 1000 for k, v in sorted(by_kernel.items(), key=lambda kv: -kv[1])[:top]},
        "launches_per_round": {k: v / per_round for k, v in launches.items()},
        "launches_per_round_by_phase": {k: v / per_round for k, v in phases_of_launches.most_common()},
    }


def enclosing_phase(event: dict[str, Any], annotations: list[dict[str, Any]]) -> str:
    """The innermost of ``annotations`` (the phases on the event's thread) around the event."""
    inner = [a for a in annotations if a["ts"] <= event["ts"] <= a["ts"] + a["dur"]]
    return min(inner, key=lambda a: a["dur"])["name"].split(" ")[0] if inner else "(no phase)"


def render(summary: dict[str, Any]) -> str:
    """The summary as a few readable lines."""
    lines = [
        f"rounds (TARGET_VERIFY steps): {summary['rounds']}; GPU busy {summary['gpu_busy_ms']:.1f} ms of a "
        f"{summary['kernel_span_ms']:.1f} ms kernel span ({summary['gpu_busy_share']:.1%}); "
        f"{summary['gpu_busy_ms_per_round']:.3f} ms of kernels per round",
        "CPU time per round by SGLang annotation (profiler overhead included):",
    ]
    lines += [f"  {v:8.3f} ms  {k}" for k, v in summary["cpu_ms_per_round"].items()]
    lines.append("kernels by total time:")
    lines += [f"  {v:8.2f} ms  {k}" for k, v in summary["top_kernels_ms"].items()]
    lines.append(
        "launch calls per round: " + ", ".join(f"{k} {v:.1f}" for k, v in summary["launches_per_round"].items())
    )
    lines.append("launch calls per round, by the phase around them:")
    lines += [f"  {v:6.1f}  {k}" for k, v in summary["launches_per_round_by_phase"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--json", type=Path, help="also write the summary here")
    args = parser.parse_args(argv)
    summary = summarize_trace(load_events(args.trace))
    print(render(summary))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
