"""Timing tools of the decode benchmarks (lab/eval_speed.py): best-of wall time, warm-up per forward width, a
forward's pace back to back, and torch.profiler tables of one decode."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import torch

from eagle3.evaluate.static_drafter import StaticDrafterRunner
from eagle3.evaluate.static_target import StaticTargetRunner

T = TypeVar("T")


def timed(fn: Callable[[], T], repeats: int) -> tuple[float, T]:
    """(best wall seconds over ``repeats`` >= 1 calls, last result)."""
    best, out = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    assert out is not None, "timed needs repeats >= 1"
    return best, out


def warm_widths(target: StaticTargetRunner, runner: StaticDrafterRunner, drafter: bool = True) -> None:
    """Compile or capture each width of the target and (with ``drafter``) drafter forwards, printing the first-call
    seconds of each."""
    dims = runner.drafter.dims
    calls = [
        ("target", w, lambda w=w: target.step(torch.zeros(w, dtype=torch.long, device=target.device)))
        for w in target.widths
    ]
    calls += [
        (
            "drafter",
            w,
            lambda w=w: runner.extend(
                torch.zeros(w, dims.num_aux * dims.target_hidden_size, device=runner.device),
                torch.zeros(w, dtype=torch.long, device=runner.device),
                0,
            ),
        )
        for w in runner.widths
        if drafter
    ]
    for name, width, call in calls:
        start = time.perf_counter()
        for _ in range(2):  # the first call allocates, compiles or captures
            target.reset()
            runner.reset()
            call()
        if target.device.type == "cuda":
            torch.cuda.synchronize()
        print(f"warmup_{name}_width_{width}_s: {time.perf_counter() - start:.1f}", flush=True)
    target.reset()
    runner.reset()


def forward_ms(target: StaticTargetRunner, position: int, count: int = 100) -> float:
    """ms per single-token target forward back to back, no host read in between (the device's pace when the
    host keeps ahead)."""
    token = torch.zeros(1, dtype=torch.long, device=target.device)
    target.reset()
    target.step(torch.zeros(position, dtype=torch.long, device=target.device))
    if target.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(count):
        target.step(token, with_aux=False)
    if target.device.type == "cuda":
        torch.cuda.synchronize()
    target.reset()
    return 1000 * (time.perf_counter() - start) / count


def profile_decode(name: str, decode, device: str, rows: int = 15, steps: bool = True) -> None:
    """torch.profiler over one decode: the ops that take the most host time, and (on CUDA) the most device time
    (kernels inside CUDA graph replays included) with the kernel count per generated token."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        out = decode()
        if device == "cuda":
            torch.cuda.synchronize()
    table = prof.key_averages()
    rounds = f"{len(out.steps)} rounds, " if steps else ""
    print(f"profile {name}: {rounds}{len(out.tokens)} tokens; top ops by host time")
    print(table.table(sort_by="self_cpu_time_total", row_limit=rows))
    if device == "cuda":
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        busy_us = sum(e.self_device_time_total for e in kernels)
        per_token = max(len(out.tokens), 1)
        print(
            f"profile {name}: {len(kernels) / per_token:.1f} kernels and {busy_us / 1000 / per_token:.3f} ms of "
            "kernels per token; top ops by device time"
        )
        print(table.table(sort_by="self_cuda_time_total", row_limit=rows))
