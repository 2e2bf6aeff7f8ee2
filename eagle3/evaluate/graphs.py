"""How the static decode runners' fixed-shape functions run: eagerly, through torch.compile, and on CUDA as one
CUDA graph per input shape, captured and replayed here.

Why own graphs rather than torch.compile's mode="reduce-overhead": a batch-1 decode of a small target is bound
by launching kernels, so the forward has to be one graph replay; capturing the eager forward takes well under a
second per shape, where Inductor spends minutes compiling every width before the first prompt. With ``compile``
on, the graph records Inductor's kernels instead (fewer, fused kernels: a faster replay for a longer warm-up).

Rules the replayed functions follow (they are the runners' ``_forward_rows``, ``_rows_step`` and draft rounds):
no host reads, fixed shapes, every tensor they read or write outside their arguments keeps its address
(caches, weights, index vectors); a runner whose caches move calls ``clear`` so the next call captures again.
A capture first runs the function twice untimed (compiling, lazy initialisations): a function whose second call
does not repeat its first (a cache row move whose sources overlap its destinations) names harmless arguments of
the same shapes for those calls (``warmup_args``), or the warm-up would apply it three times.
Arguments are copied into the graph's own input buffers and the outputs are cloned after each replay, so results
stay valid past the next replay and a step's graphs can share one memory pool.

Pools are per step and dropped with its graphs (``clear``, a fallback): PyTorch refuses to capture into a pool
whose graphs were all destroyed while tensors it allocated are still alive ("it->second->use_count > 0 INTERNAL
ASSERT FAILED" in CUDACachingAllocator's create_or_incref_pool). With one process-wide pool, that assert stopped
the row move's capture in tests/gpu on an H200, twice, once earlier runners' graphs had been collected (the likely
sequence; per-step pools have not run on a GPU yet).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from eagle3.compiling import raise_recompile_limit
from eagle3.config_base import switch_on

RECOMPILE_LIMIT = 64
"""Dynamo's per-function recompile limit while compiled decoding is on: every (width, cache length) is one
compile, and past the default limit (8) dynamo silently runs the function uncompiled."""


@dataclass(frozen=True)
class CompileSettings:
    """How the fixed-shape forwards run: eagerly or through torch.compile, and on CUDA as CUDA graphs or not."""

    enabled: bool = False  # torch.compile the function
    backend: str = "inductor"
    mode: str | None = None  # torch.compile's mode (graphs are ours: never "reduce-overhead" with graphs on)
    fallback: bool = False  # on an error while compiling or capturing, warn and run that function eagerly
    graphs: bool = False  # on CUDA: capture one CUDA graph per input shape and replay it


@dataclass
class _Graph:
    graph: Any  # torch.cuda.CUDAGraph
    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]


class CompiledStep:
    """``fn`` run eagerly or compiled and, with graphs on CUDA, replayed as one CUDA graph per argument shapes."""

    def __init__(
        self,
        fn: Callable[..., tuple[Tensor, ...]],
        settings: CompileSettings,
        device: torch.device,
        name: str = "decode step",
        warmup_args: Callable[[tuple[Tensor, ...]], tuple[Tensor, ...]] | None = None,
    ) -> None:
        self.fn, self.settings, self.cuda, self.name = fn, settings, device.type == "cuda", name
        self.warmup_args = warmup_args or (lambda args: args)  # what the untimed calls before a capture run on
        self.fallback_reason: str | None = None  # why compiling or capturing failed, once it fell back to eager
        self._compiled: Any = None
        self._graphs: dict[tuple, _Graph] = {}
        self._pool: Any = None  # this step's graph memory pool; a new one after its graphs are dropped
        self._seen: set[tuple] = set()  # argument shapes run at least once (compiled, without graphs)
        self.setup_s: dict[str, float] = {}  # "16x576" (first argument's shape) -> seconds compiling, capturing
        self.use_graphs = settings.graphs and self.cuda
        if settings.enabled:
            raise_recompile_limit(RECOMPILE_LIMIT)
            self._compiled = torch.compile(fn, backend=settings.backend, mode=settings.mode, dynamic=False)

    @property
    def compiled(self) -> bool:
        """Whether calls go through torch.compile (False after a fallback)."""
        return self._compiled is not None

    @property
    def num_graphs(self) -> int:
        """CUDA graphs captured so far (one per argument shapes since the last ``clear``)."""
        return len(self._graphs)

    def clear(self) -> None:
        """Forget the captured graphs: the tensors they read moved (a cache grew)."""
        self._graphs.clear()
        self._pool = None  # never capture again into a pool whose graphs are gone (module docstring)

    def _run(self, *args: Tensor) -> tuple[Tensor, ...]:
        return (self._compiled or self.fn)(*args)

    def _first_call(self, key: tuple, args: tuple[Tensor, ...], call: Callable[[], Any]) -> Any:
        """call(), its seconds added to setup_s under the shape of ``args`` (a warm-up's cost, per step)."""
        start = time.perf_counter()
        out = call()
        label = shape_label(args)
        self.setup_s[label] = self.setup_s.get(label, 0.0) + time.perf_counter() - start
        self._seen.add(key)
        return out

    def __call__(self, *args: Tensor) -> tuple[Tensor, ...]:
        try:
            if self.use_graphs:
                return self._replay(args)
            key = tuple((a.shape, a.dtype) for a in args)
            if self._compiled is not None and key not in self._seen:
                return self._first_call(key, args, lambda: self._run(*args))
            return self._run(*args)
        except Exception as err:  # compile and capture errors surface at the first call of each shape
            if not self.settings.fallback or (self._compiled is None and not self.use_graphs):
                raise
            self.fallback_reason = f"{err!r:.500}"
            warnings.warn(
                f"{self.name}: compiling or capturing a CUDA graph failed, running it eagerly from now on: "
                f"{self.fallback_reason}",
                stacklevel=2,
            )
            self._compiled, self.use_graphs = None, False
            self.clear()  # a failed capture can also leave its pool recording ('beginAllocateToPool: already
            # recording to mempool_id', seen on an H200): nothing captures into it again
            return self.fn(*args)

    def _replay(self, args: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        key = tuple((a.shape, a.dtype) for a in args)
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._graphs[key] = self._first_call(key, args, lambda: self._capture(args))
        for buffer, arg in zip(entry.inputs, args):
            buffer.copy_(arg)
        entry.graph.replay()
        return tuple(t.clone() for t in entry.outputs)

    def _capture(self, args: tuple[Tensor, ...]) -> _Graph:
        """Warm up on a side stream (compiling, lazy initialisations), then record one call into a graph.

        The warm-up calls write what the first replay writes (the same inputs, or ``warmup_args``' harmless ones),
        so caches see no stray entries."""
        inputs = tuple(a.clone() for a in args)
        warm = self.warmup_args(inputs)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._run(*warm)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # The warm-up compiled every guard this call checks; a compile inside the capture would fail obscurely
        # ("Offset increment outside graph capture", seen on an H200), so a recompile here is an error that names it.
        stance = torch.compiler.set_stance("fail_on_recompile") if self._compiled is not None else nullcontext()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._pool), stance:
            outputs = self._run(*inputs)
        return _Graph(graph, inputs, tuple(outputs))


def shape_label(args: tuple[Tensor, ...]) -> str:
    """'16x576' when the first argument is [16, 576]: its width names a call in the warm-up timings."""
    return "x".join(str(d) for d in args[0].shape) if args else "no arguments"


def warmup_summary(steps: Iterable[CompiledStep]) -> str:
    """'target forward (16) 31.2 s; ...': the compile and capture seconds of every step and shape, slowest
    first (where a warm-up's time goes)."""
    rows = [(s, step.name, label) for step in steps for label, s in step.setup_s.items()]
    return "; ".join(f"{name} ({label}) {s:.1f} s" for s, name, label in sorted(rows, key=lambda r: -r[0]))


def eager_graph_settings(settings: CompileSettings) -> CompileSettings:
    """Settings for calls that run rarely or do little (a prompt's chunks, once per decode; a tree's row move):
    with graphs, a graph of the eager kernels is worth more than Inductor's compile of them (on an H200 with
    SmolLM2-135M: ~23 s for the chunk width, 11.6 s for the row move)."""
    return replace(settings, enabled=False) if settings.graphs else settings


def fallbacks(steps: Iterable[CompiledStep]) -> dict[str, str]:
    """{step name: why it fell back} for the steps that run eagerly after a compile or capture failure."""
    return {step.name: step.fallback_reason for step in steps if step.fallback_reason is not None}


def resolve_decode(static_cache: str, compile_mode: str, device: str) -> tuple[bool, CompileSettings]:
    """(static cache?, settings) from the evaluate section's auto|on|off switches on ``device``.

    static_cache auto: on for CUDA, off for CPU. compile auto: on CUDA, CUDA graphs of the eager kernels (captured
    in seconds); on: Inductor's kernels (inside the graphs on CUDA); off: neither. With auto and on, a function
    that fails to compile or capture runs eagerly from then on, named with its reason in the report, rather
    than ending an evaluation that may have run for minutes.
    """
    cuda = device.startswith("cuda")
    static = switch_on(static_cache, cuda)
    if compile_mode == "on" and not static:
        raise ValueError("compiled decoding needs the static cache")
    graphs = static and cuda and compile_mode != "off"
    return static, CompileSettings(
        enabled=static and compile_mode == "on", graphs=graphs, fallback=compile_mode != "off"
    )
