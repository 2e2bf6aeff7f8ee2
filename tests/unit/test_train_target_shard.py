"""The online target sharded with FSDP2 (train.target_sharding=fsdp) on CPU/gloo, 2 processes: the same states and
the same training as a replicated target, and no deadlock when the ranks' rows split into different batch counts."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from eagle3.train.metrics import read_metrics
from tests.unit.test_train_helpers import load_run_config, real_tiny_run

DEADLINE_S = 90.0  # a deadlock fails the test after this instead of hanging the suite
BUDGET = 64  # capture.tokens_per_forward of the workers: rank 0's documents need 3 batches, rank 1's one


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _documents(rank: int):
    """Rank 0: 4 documents in 3 batches (BUDGET); rank 1: 2 short ones in a single batch."""
    from eagle3.features.spec import SampleTokens

    lengths = [40, 33, 25, 12] if rank == 0 else [9, 7]
    gen = torch.Generator().manual_seed(rank)
    return [
        SampleTokens(f"r{rank}d{i}", torch.randint(0, 300, (n,), generator=gen).tolist(), [1] * n)
        for i, n in enumerate(lengths)
    ]


def _tiny(tied: bool):
    from eagle3.config import TinyTargetConfig
    from eagle3.target.tiny import build_tiny_model, build_tiny_tokenizer

    model = build_tiny_model(build_tiny_tokenizer(), TinyTargetConfig(num_hidden_layers=4), seed=0).eval()
    if tied:  # SmolLM2-style tied embeddings: the shared weight must land in the root's FSDP group once
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def _packed_row(docs) -> tuple:
    """(input_ids, document_ids, position_ids [1, T], real document lengths) of ``docs`` in one row, 5 pad tokens."""
    lengths = [len(d.input_ids) for d in docs] + [5]
    ids = torch.tensor([t for d in docs for t in d.input_ids] + [0] * 5)
    doc_ids = torch.cat([torch.full((n,), k) for k, n in enumerate(lengths)])
    pos = torch.cat([torch.arange(n) for n in lengths])
    return ids[None], doc_ids[None], pos[None], lengths[:-1]


def _states_worker(rank: int, port: int, out_dir: str) -> None:
    """One rank: every row's states through the sharded target equal the replicated target's, bitwise."""
    import torch.distributed as dist

    from eagle3.features.hf_backend import HFCaptureBackend
    from eagle3.train.target_shard import ShardedCaptureBackend, shard_target

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    docs = _documents(rank)
    for supervision, topk, tied in (("final_hidden", None, False), ("topk_logprobs", 4, True)):
        kwargs = {"supervision": supervision, "topk": topk, "device": "cpu", "tokens_per_forward": BUDGET}
        whole = HFCaptureBackend(None, [0, 1, 3], model=_tiny(tied), **kwargs)
        sharded = ShardedCaptureBackend(None, [0, 1, 3], model=shard_target(_tiny(tied)), **kwargs)
        assert len(whole.online_batches(docs)[1]) == (3 if rank == 0 else 1)
        with torch.no_grad():
            want, got = whole.device_states(docs), sharded.device_states(docs)
            got_again = sharded.device_states(docs[::-1])  # a second row: the FSDP state carries over
        assert want.keys() == got.keys()
        for name in want:
            assert torch.equal(got[name], want[name]), (supervision, name)
        n_last = len(docs[-1].input_ids)
        assert torch.equal(got_again["aux"][:n_last], want["aux"][-n_last:])
        row = _packed_row(docs)  # train.online_forward=packed: the row in one forward on both
        with torch.no_grad():
            want_packed, got_packed = whole.packed_states(*row), sharded.packed_states(*row)
        for name in want:
            assert torch.equal(got_packed[name], want_packed[name]), (supervision, name, "packed")
    with open(os.path.join(out_dir, f"ok{rank}"), "w") as f:
        f.write("checked")
    # Both ranks past their last collective before either tears gloo down: a rank that destroyed its group while
    # the other still held the pair's connection aborted once under a loaded CI ("terminate called without an
    # active exception", SIGABRT).
    dist.barrier()
    dist.destroy_process_group()


def _spawn_with_deadline(fn, args: tuple, out_dir) -> None:
    """Run ``fn(rank, *args)`` on 2 spawned processes; fail (and end them) if they pass DEADLINE_S."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(fn, args=args, nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + DEADLINE_S
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                pytest.fail(f"the 2 ranks did not finish within {DEADLINE_S:.0f} s (a collective deadlock)")
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()
    assert sorted(p.name for p in out_dir.iterdir()) == ["ok0", "ok1"]


def test_sharded_target_states_equal_the_replicated_target_without_deadlock(tmp_path):
    """FSDP2-sharded target: aux/final/top-K bitwise the replicated ones, ranks with 4 vs 1 batches per row finish."""
    _spawn_with_deadline(_states_worker, (_free_port(), str(tmp_path)), tmp_path)


TRAIN = [
    "train.features=online",
    "train.tokens_per_row=512",
    "train.max_steps=2",
    "train.lr=1e-2",
    "train.warmup_steps=0",
    "train.eval_every_steps=1",
    "train.checkpoint_every_steps=0",
    "train.progress_every_s=0",
    "train.prefetch_rows=0",
    "drafter.ttt_steps=2",
    "train.aux_noise=uniform",
    "capture.tokens_per_forward=128",
]  # several target batches per row, a different number on each rank


def _descendants(pid: int) -> list[int]:
    """Process ids below ``pid`` (torchrun puts its workers in sessions of their own: killpg misses them)."""
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            for child in map(int, f.read().split()):
                found += [child, *_descendants(child)]
    return found


def _torchrun(config, sharding: str, log_path) -> tuple[int, str]:
    """(exit code, output) of torchrun x2; past DEADLINE_S it and its workers are killed and the test fails."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "eagle3.train",
        "--config",
        str(config),
        "--set",
        f"train.target_sharding={sharding}",
    ]
    with open(log_path, "w") as log:  # a file, not a pipe: a stuck worker cannot hold the test's read open
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            proc.wait(timeout=DEADLINE_S)
        except subprocess.TimeoutExpired:
            for pid in [*_descendants(proc.pid), proc.pid]:  # workers first: they ignore SIGTERM mid-collective
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proc.wait()
            pytest.fail(f"torchrun x2 with target_sharding={sharding} did not finish within {DEADLINE_S:.0f} s")
    return proc.returncode, Path(log_path).read_text()


def test_sharded_online_training_equals_replicated(tmp_path):
    """Online training on 2 ranks: target_sharding=fsdp gives the train and val metrics of replicate, exactly."""
    import shutil

    records = {}
    for sharding in ("replicate", "fsdp"):
        config = real_tiny_run(tmp_path / sharding, TRAIN)
        cfg = load_run_config(config)
        shutil.rmtree(cfg.run_dir / "features")
        code, out = _torchrun(config, sharding, tmp_path / f"{sharding}.log")
        assert code == 0, out[-5000:]
        assert ("online target sharded over 2 ranks" in out) == (sharding == "fsdp")
        path = cfg.run_dir / "train" / "metrics.jsonl"
        records[sharding] = read_metrics(path, "train") + read_metrics(path, "eval")
    keys = ("type", "step", "loss", "acc_0", "grad_norm", "num_tokens", "accept_len_est")
    got = [[r.get(k) for k in keys] for r in records["fsdp"]]
    want = [[r.get(k) for k in keys] for r in records["replicate"]]
    assert len(got) == 2 + 2 and got == want  # 2 train records and 2 evaluations, equal to the last bit


def test_target_sharding_choice():
    """fsdp only with a process group; auto replicates on CPU and in a one-process world; explicit choices hold."""
    from eagle3.train.dist import DistInfo
    from eagle3.train.target_shard import resolve_sharding

    alone = DistInfo(0, 1, 0, torch.device("cpu"), False)
    gloo_pair = DistInfo(0, 2, 0, torch.device("cpu"), True)
    assert [resolve_sharding(s, alone, None, "float32") for s in ("auto", "replicate", "fsdp")] == ["replicate"] * 3
    assert [resolve_sharding(s, gloo_pair, None, "float32") for s in ("auto", "replicate", "fsdp")] == [
        "replicate",
        "replicate",
        "fsdp",
    ]


def test_target_param_bytes_counts_the_loaded_parameters(tmp_path):
    """The meta-device count of auto's rule equals the parameter bytes of the loaded target, in the asked dtype."""
    from eagle3.config import TinyTargetConfig
    from eagle3.features.hf_models import load_model
    from eagle3.target.tiny import save_tiny_target
    from eagle3.train.target_shard import target_param_bytes

    model_dir = save_tiny_target(tmp_path / "tiny", TinyTargetConfig(num_hidden_layers=2), seed=0)
    model = load_model(model_dir, "bfloat16", "cpu")
    assert target_param_bytes(model_dir, "bfloat16") == sum(p.numel() * 2 for p in model.parameters())
    assert target_param_bytes(model_dir, "float32") == 2 * target_param_bytes(model_dir, "bfloat16")
