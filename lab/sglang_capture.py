"""SGLang capture vs the in-process HF capture: same samples, same spec; parity, speed, and a kill-and-resume test.

What it does (the run's merge/tokenize/vocab stages must be done in RUN):
  1. takes the first ``--samples`` train rows of RUN/data/tokenized.parquet;
  2. SGLang: ``SGLangCaptureBackend.from_config`` with capture.sglang.server_mode capture_packed launches ONE
     managed server (start timed on its own: launch + readiness probe + smoke forward), captures ``--warmup``
     samples untimed, then all samples timed (tokens/s); the server is stopped before the HF part, because
     the GPU check refuses to launch next to a process holding GPU memory (this one, once HF has loaded);
  3. HF: ``eagle3.features.capture.make_backend`` with capture.backend hf (cfg's capture.device and
     target.dtype: cuda/bfloat16 in the host's run config), warm-up, then all samples timed;
  4. compares per sample and overall: relative RMS error ||sglang - hf|| / ||hf|| of each aux layer (the aux
     rows [T, K*H] split into K blocks of H) and of the final state, max abs difference, non-finite values;
     prints a table, writes JSON (figures, SGLang version from the ready probe's /server_info, device, counts)
     and exits 1 when any rel RMS exceeds ``--tol`` (default 1e-2; the goal), naming each offender.
Supervision is forced to final_hidden in the benchmark's copy of the config, so the final state is compared.
``--compare-with-self`` replaces step 2 by a second HF capture (parity of the comparison code: all errors 0).
``--reference-dtype float32`` runs the HF reference of step 3 in float32: against SGLang, each state's error from
the (nearly) exact value; with ``--compare-with-self``, HF's own bf16 error, the floor two bf16 engines share.

``--kill-test`` (after step 2, before step 3; ``--no-compare`` runs it alone): the kill-and-resume test of the
capture stage against a real managed server, in lab/sglang_capture_kill.py.

GPU host (sglang 0.5.16 behind the wrapper that server.python names):
    python lab/sglang_capture.py --config RUN/config.json --samples 200 --out RUN/bench-capture.json \\
        --server-args="--attention-backend triton --sampling-backend pytorch"
    python lab/sglang_capture.py --config RUN/config.json --samples 200 --no-compare --kill-test \\
        --out RUN/bench-capture-kill.json --server-args="--attention-backend triton --sampling-backend pytorch"

CPU dry run (the FAKE SGLang server, tests/fakes/sglang_server.py, a test double; a fake nvidia-smi first on
PATH): the fake's states are made up, so the comparison reports a large error and exit status 1 -- expected:
    python lab/sglang_capture.py --config /tmp/sglab/tiny/config.json --samples 40 \\
        --module tests.fakes.sglang_server --python .venv/bin/python --kill-test \\
        --server-args="--fake-stall-s 0.02"

Verified where: only on this CPU machine, against the fake server and the tiny preset (random tiny Llama).
Not verified against a real SGLang: the JSON field names and the capture_packed rows come from reading
SGLang's source (eagle3/features/sglang_backend.py, infra/sglang_plugin); the numbers on the host are the test.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from eagle3.config import RunConfig, read_config_file, validate_config  # noqa: E402
from eagle3.features.spec import CapturedSample, FeatureSpec, SampleTokens  # noqa: E402
from lab.sglang_capture_kill import run_kill_test  # noqa: E402
from lab.sglang_lab import (  # noqa: E402
    add_server_args,
    bench_config,
    device_name,
    installed_sglang,
    run_and_record,
    say,
)

DEFAULT_TOL = 1e-2


# ---------------------------------------------------------------- pure comparison


@dataclass
class BlockSums:
    """Running sums of one state (an aux layer or the final state): enough for rel RMS and max abs."""

    diff_sq: float = 0.0
    ref_sq: float = 0.0
    max_abs: float = 0.0
    nonfinite: int = 0

    def add(self, other: BlockSums) -> None:
        self.diff_sq += other.diff_sq
        self.ref_sq += other.ref_sq
        self.max_abs = max(self.max_abs, other.max_abs)
        self.nonfinite += other.nonfinite

    @property
    def rel_rms(self) -> float:
        """||got - ref|| / ||ref|| (nan when a value was non-finite; inf for a zero reference with a difference)."""
        if self.nonfinite:
            return math.nan
        if self.ref_sq == 0.0:
            return 0.0 if self.diff_sq == 0.0 else math.inf
        return math.sqrt(self.diff_sq / self.ref_sq)

    def to_json(self) -> dict[str, Any]:
        return {"rel_rms": _num(self.rel_rms), "max_abs": _num(self.max_abs), "nonfinite": self.nonfinite}


def block_sums(ref: np.ndarray, got: np.ndarray) -> BlockSums:
    """Sums of one [T, H] block pair in float64; non-finite values (in either) are counted, not summed."""
    if ref.shape != got.shape:
        raise ValueError(f"shapes differ: reference {ref.shape}, other {got.shape}")
    ref64, got64 = ref.astype(np.float64), got.astype(np.float64)
    finite = np.isfinite(ref64) & np.isfinite(got64)
    diff = np.where(finite, got64 - ref64, 0.0)
    ref_f = np.where(finite, ref64, 0.0)
    return BlockSums(
        float(np.sum(diff * diff)),
        float(np.sum(ref_f * ref_f)),
        float(np.max(np.abs(diff))) if diff.size else 0.0,
        int(finite.size - finite.sum()),
    )


def split_blocks(aux: np.ndarray, num_blocks: int) -> list[np.ndarray]:
    """[T, K*H] -> K arrays [T, H] (layer k's block is columns k*H .. (k+1)*H - 1)."""
    if aux.ndim != 2 or aux.shape[1] % num_blocks:
        raise ValueError(f"aux of shape {aux.shape} does not split into {num_blocks} equal blocks")
    return np.split(aux, num_blocks, axis=1)


def compare_states(
    ref_aux: np.ndarray, got_aux: np.ndarray, num_aux: int, ref_final: np.ndarray | None, got_final: np.ndarray | None
) -> dict[str, BlockSums]:
    """Per aux layer ('aux0'..) and 'final': the sums of got against ref (final only when both have it)."""
    out = {
        f"aux{k}": block_sums(r, g)
        for k, (r, g) in enumerate(zip(split_blocks(ref_aux, num_aux), split_blocks(got_aux, num_aux)))
    }
    if ref_final is not None and got_final is not None:
        out["final"] = block_sums(ref_final, got_final)
    return out


def offenders(figures: dict[str, BlockSums], tol: float) -> list[str]:
    """Names whose rel RMS exceeds tol or is not finite (nan counts as a failure)."""
    return [name for name, sums in figures.items() if not sums.rel_rms <= tol]


def _num(x: float) -> float | str:
    """JSON has no nan/inf: write them as strings."""
    return x if math.isfinite(x) else str(x)


# ---------------------------------------------------------------- samples and captures


@dataclass
class States:
    """One captured sample, as float32 numpy on the host."""

    id: str
    input_ids: list[int]
    aux: np.ndarray
    final: np.ndarray | None

    @classmethod
    def of(cls, sample: CapturedSample) -> States:
        def host(t: Any) -> np.ndarray:  # a copy: a backend may reuse the buffer behind a tensor it yielded
            import torch

            return t.to(torch.float32, copy=True).numpy()

        return cls(
            sample.id, sample.input_ids.tolist(), host(sample.aux), None if sample.final is None else host(sample.final)
        )


@dataclass
class Timing:
    """One backend's capture of the sample set."""

    num_samples: int
    num_tokens: int
    warmup_s: float
    elapsed_s: float
    start_s: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / max(self.elapsed_s, 1e-9)

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"tokens_per_s": round(self.tokens_per_s, 1)}


def first_train_samples(tokenized: Path, num: int) -> list[SampleTokens]:
    """The first ``num`` train rows of tokenized.parquet (file order) as SampleTokens."""
    from eagle3.data.tokenize import read_tokenized

    table = read_tokenized(tokenized, columns=["id", "input_ids", "loss_mask"], split="train").slice(0, num)
    if table.num_rows == 0:
        raise ValueError(f"{tokenized} has no train rows")
    return [
        SampleTokens(i, ids, mask)
        for i, ids, mask in zip(table["id"].to_pylist(), table["input_ids"].to_pylist(), table["loss_mask"].to_pylist())
    ]


def timed_capture(backend: Any, samples: list[SampleTokens], warmup: int, label: str) -> tuple[list[States], Timing]:
    """Capture ``warmup`` samples untimed, then all of them timed; progress about ten times."""
    t0 = time.perf_counter()
    for _ in backend.capture(samples[:warmup]):
        pass
    warmup_s = time.perf_counter() - t0
    say(f"{label}: warm-up of {min(warmup, len(samples))} samples took {warmup_s:.2f} s")
    out: list[States] = []
    every = max(1, len(samples) // 10)
    tokens = 0
    t0 = time.perf_counter()
    for captured in backend.capture(samples):
        out.append(States.of(captured))
        tokens += len(out[-1].input_ids)
        if len(out) % every == 0 or len(out) == len(samples):
            rate = tokens / max(time.perf_counter() - t0, 1e-9)
            say(f"{label}: {len(out)}/{len(samples)} samples, {tokens} tokens, {rate:.0f} tokens/s")
    return out, Timing(len(out), tokens, round(warmup_s, 3), round(time.perf_counter() - t0, 3))


def hf_capture(
    cfg: RunConfig, model_dir: Path, spec: FeatureSpec, samples: list[SampleTokens], warmup: int
) -> tuple[list[States], Timing]:
    """The in-process HF capture, built as the capture stage builds it (make_backend, cfg's device and dtype)."""
    from eagle3.features.capture import make_backend

    say(f"hf: loading the target ({cfg.capture.device}, {cfg.target.dtype})")
    t0 = time.perf_counter()
    backend = make_backend(cfg, model_dir, spec)
    load_s = time.perf_counter() - t0
    try:
        states, timing = timed_capture(backend, samples, warmup, "hf")
    finally:
        backend.close()
    timing.start_s = round(load_s, 3)
    say(f"hf: {timing.tokens_per_s:.0f} tokens/s over {timing.num_tokens} tokens (load {load_s:.1f} s)")
    return states, timing


def sglang_capture(
    cfg: RunConfig, model_dir: Path, spec: FeatureSpec, samples: list[SampleTokens], warmup: int, module: str
) -> tuple[list[States], Timing]:
    """A managed capture_packed server through SGLangCaptureBackend.from_config; stopped before returning."""
    from eagle3.features.sglang_backend import SGLangCaptureBackend

    cfg = cfg.model_copy(update={"server": cfg.server.model_copy(update={"launch_module": module})})
    say(
        f"sglang: starting a managed capture_packed server ({cfg.server.python} -m {module}, "
        f"port {cfg.capture.sglang.port})"
    )
    t0 = time.perf_counter()
    try:
        backend = SGLangCaptureBackend.from_config(cfg, model_dir, spec)
    except Exception as exc:
        raise RuntimeError(
            f"SGLang capture server did not start (log: {cfg.run_dir / 'logs'}): {type(exc).__name__}: {exc}"
        ) from exc
    start_s = time.perf_counter() - t0
    try:
        (server,) = backend.owned_servers
        report = server.report
        say(f"sglang: server ready after {start_s:.1f} s: version {report.version}, smoke: {report.smoke}")
        states, timing = timed_capture(backend, samples, warmup, "sglang")
        timing.extra = {
            "version": report.version,
            "smoke": report.smoke,
            "num_retries": backend.num_retries,
            "num_restarts": server.num_restarts,
            "log": str(server.log_path),
            "argv": server.process.printable_argv,
        }
    finally:
        backend.close()
    timing.start_s = round(start_s, 3)
    say(f"sglang: {timing.tokens_per_s:.0f} tokens/s over {timing.num_tokens} tokens")
    return states, timing


# ---------------------------------------------------------------- comparison report


def compare_all(
    ref: list[States], got: list[States], num_aux: int
) -> tuple[list[dict[str, Any]], dict[str, BlockSums]]:
    """Per-sample figures and the overall sums; a sample whose ids differ is an error (not compared)."""
    per_sample, overall = [], {}
    for r, g in zip(ref, got, strict=True):
        if r.id != g.id or r.input_ids != g.input_ids:
            raise ValueError(f"sample {r.id!r}: the SGLang capture returned {g.id!r} with other input ids")
        figures = compare_states(r.aux, g.aux, num_aux, r.final, g.final)
        for name, sums in figures.items():
            overall.setdefault(name, BlockSums()).add(sums)
        per_sample.append(
            {"id": r.id, "num_tokens": len(r.input_ids)} | {name: sums.to_json() for name, sums in figures.items()}
        )
    return per_sample, overall


def print_table(overall: dict[str, BlockSums], per_sample: list[dict[str, Any]], aux_layer_ids: list[int]) -> None:
    """Overall rows, then the worst sample per state."""
    names = state_labels(aux_layer_ids)
    print(f"{'state':<20} {'rel_rms':>11} {'max_abs':>11} {'nonfinite':>9}  worst sample (rel_rms)", flush=True)
    for key, sums in overall.items():
        worst = max(per_sample, key=lambda s: _sortable(s[key]["rel_rms"]))
        print(
            f"{names.get(key, key):<20} {sums.rel_rms:>11.3e} {sums.max_abs:>11.3e} {sums.nonfinite:>9}  "
            f"{worst['id']} ({worst[key]['rel_rms']})",
            flush=True,
        )


def state_labels(aux_layer_ids: list[int]) -> dict[str, str]:
    """'aux0' -> 'aux layer 1' ..., 'final' -> 'final (post-norm)'."""
    return {f"aux{k}": f"aux layer {j}" for k, j in enumerate(aux_layer_ids)} | {"final": "final (post-norm)"}


def _sortable(x: float | str) -> float:
    return math.inf if isinstance(x, str) else x


def run_compare(cfg: RunConfig, args: argparse.Namespace, results: dict[str, Any]) -> list[str]:
    """Steps 1-4 (the kill test runs between the SGLang and the HF capture); returns the failures."""
    from eagle3.features.run_spec import build_spec
    from eagle3.run.layout import run_layout
    from eagle3.target.load import prepare_target

    samples = first_train_samples(run_layout(cfg).tokenized, args.samples)
    results["num_samples"], results["num_tokens"] = len(samples), sum(len(s.input_ids) for s in samples)
    say(f"{len(samples)} train samples, {results['num_tokens']} tokens")
    model_dir = prepare_target(cfg)
    scfg, hcfg = bench_config(cfg, args, "sglang"), bench_config(cfg, args, "hf")
    spec = build_spec(scfg, model_dir)
    results["aux_layer_ids"], results["hidden_size"] = spec.aux_layer_ids, spec.hidden_size
    if args.compare_with_self:
        got, timing = hf_capture(hcfg, model_dir, spec, samples, args.warmup)
        results["other"] = {"backend": "hf (--compare-with-self)"} | timing.to_json()
    else:
        got, timing = sglang_capture(scfg, model_dir, spec, samples, args.warmup, args.module)
        results["sglang"] = timing.to_json()
        results["sglang_version"] = timing.extra.get("version")
    failures = run_kill_test(cfg, args, results) if args.kill_test else []
    rcfg = hcfg  # the reference: HF in the run's dtype, or in --reference-dtype (float32: the truth, nearly)
    if args.reference_dtype:
        rcfg = hcfg.model_copy(update={"target": hcfg.target.model_copy(update={"dtype": args.reference_dtype})})
        results["reference_dtype"] = args.reference_dtype
    ref, hf_timing = hf_capture(rcfg, model_dir, spec, samples, args.warmup)
    results["hf"] = hf_timing.to_json()
    results["device"] = device_name(hcfg.capture.device)
    per_sample, overall = compare_all(ref, got, spec.num_aux)
    results["overall"] = {name: sums.to_json() for name, sums in overall.items()}
    results["per_sample"] = per_sample
    print_table(overall, per_sample, spec.aux_layer_ids)
    bad = offenders(overall, args.tol)
    results["goal"] = {"tol": args.tol, "met": not bad, "offenders": bad}
    label = state_labels(spec.aux_layer_ids)
    return failures + [f"rel RMS of {label[name]} is {overall[name].rel_rms:.3e} > {args.tol:g}" for name in bad]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, required=True, help="RUN/config.json (data stages done)")
    parser.add_argument("--samples", type=int, default=200, help="first N train rows (default 200)")
    parser.add_argument("--warmup", type=int, default=3, help="samples captured untimed first (default 3)")
    parser.add_argument("--out", type=Path, help="results JSON (default RUN/bench-capture/results.json)")
    add_server_args(parser, "cfg's server.python")
    parser.add_argument("--tol", type=float, default=DEFAULT_TOL, help="rel RMS goal (default 1e-2)")
    parser.add_argument("--compare-with-self", action="store_true", help="compare HF against HF (no SGLang)")
    parser.add_argument(
        "--reference-dtype",
        choices=["float32"],
        help="run the HF reference in this dtype: with --compare-with-self, HF's own bf16 error",
    )
    parser.add_argument("--kill-test", action="store_true", help="also run the kill-and-resume test")
    parser.add_argument("--no-compare", action="store_true", help="only the kill test")
    parser.add_argument("--min-shards", type=int, default=6, help="kill test: shards at least (default 6)")
    parser.add_argument("--kill-timeout-s", type=float, default=1800.0, help="kill test: limit per stage run")
    args = parser.parse_args(argv)
    if args.no_compare and not args.kill_test:
        parser.error("--no-compare needs --kill-test")
    import shlex

    args.server_args = shlex.split(args.server_args)
    return args


def load_run_config(path: Path) -> RunConfig:
    if not path.is_file():
        raise FileNotFoundError(f"config {path} not found (the run's config.json)")
    return validate_config(read_config_file(path), str(path))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = load_run_config(args.config)
    args.python = args.python or cfg.server.python
    out = args.out or cfg.run_dir / "bench-capture" / "results.json"
    results: dict[str, Any] = {
        "config": str(args.config),
        "module": args.module,
        "python": args.python,
        "server_args": args.server_args,
        "samples_asked": args.samples,
    }

    def body() -> list[str]:
        if args.kill_test or not args.compare_with_self:  # SGLang runs
            results["installed_sglang"] = installed_sglang(args.python)
        return run_kill_test(cfg, args, results) if args.no_compare else run_compare(cfg, args, results)

    return run_and_record(out, results, body)


if __name__ == "__main__":
    sys.exit(main())
