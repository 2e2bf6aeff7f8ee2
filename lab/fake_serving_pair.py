"""The deploy benchmark client (infra/sglang_bench.py) timed for real against a pair of FAKE SGLang servers.

    PYTHONPATH=. .venv/bin/python lab/fake_serving_pair.py --step-s 0.01 --spec-step-cost 1.5 --accept-length 2.5

The fakes (tests/fakes/sglang_server.py) sleep ``step-s`` per target forward, a verify step costing
``spec-step-cost`` forwards, so the speedup is near accept length / spec_step_cost. This prints,
per concurrency level, the measured tok/s of both, the speedup and the acceptance length, and whether
1 < speedup <= acceptance length held on this machine now: a check of the client's timing path and of
the machine's load, which the tests leave out (they feed the same arithmetic a scripted clock). The
figures are the fakes' inventions, not SGLang's.
"""

from __future__ import annotations

import argparse

from infra.sglang_bench import run_benchmark
from infra.sglang_bench_records import BenchSettings, MeasurementError, fixed_prompts
from infra.sglang_compare import compare
from tests.fakes.sglang_model import FakeServing, LaunchArgs
from tests.fakes.sglang_server import FakeSGLangServer

SPEC_FLAGS = dict(
    speculative_algorithm="EAGLE3",
    speculative_draft_model_path="/d",
    speculative_num_steps=3,
    speculative_eagle_topk=1,
    speculative_num_draft_tokens=4,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step-s", type=float, default=0.01, help="seconds per fake target forward")
    parser.add_argument("--spec-step-cost", type=float, default=1.5, help="a verify step in target forwards")
    parser.add_argument("--accept-length", type=float, default=2.5, help="the fake's tokens per verify step")
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    settings = BenchSettings(
        tuple(args.levels), num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens, num_warmup=2
    )
    serving = FakeServing(accept_length=args.accept_length, step_s=args.step_s, spec_step_cost=args.spec_step_cost)
    runs = []
    for flags in ({}, SPEC_FLAGS):
        with FakeSGLangServer(LaunchArgs(max_running_requests=32, **flags), serving=serving) as fake:
            runs.append(
                run_benchmark(
                    fake.base_url, fixed_prompts(settings.num_prompts), settings, speculative=fake.speculative
                )
            )
    try:
        rows = compare(*runs)
    except MeasurementError as exc:
        print(f"ordering_held: no ({exc})")
        return
    for r in rows:
        print(f"c{r.concurrency}.baseline_tok_per_s: {r.baseline_tok_per_s:.1f}")
        print(f"c{r.concurrency}.speculative_tok_per_s: {r.speculative_tok_per_s:.1f}")
        print(f"c{r.concurrency}.speedup: {r.speedup:.3f}")
        print(f"c{r.concurrency}.accept_length: {r.accept_length:.3f}")
        print(f"c{r.concurrency}.ordering_held: {'yes' if 1.0 < r.speedup <= r.accept_length else 'no'}")


if __name__ == "__main__":
    main()
