"""Multi-node torchrun on CPU (gloo, loopback): 2 nodes x 1 process meet at a c10d rendezvous and train exactly as
1 node x 2 processes; the commands are the ones the train-node task launches (tasks.train.torchrun_spec)."""

from __future__ import annotations

import socket
import threading

import pytest

from eagle3.run.stages import write_run_config
from eagle3.train.metrics import read_metrics
from infra.torchrun import run_torchrun
from tests.unit.test_train_helpers import load_run_config, real_tiny_run

TRAIN = [
    "train.tokens_per_row=512",
    "train.num_epochs=1",
    "train.max_steps=6",
    "train.lr=1e-2",
    "train.warmup_steps=0",
    "train.eval_every_steps=3",
    "train.checkpoint_every_steps=0",
    "train.progress_every_s=0",
    "train.prefetch_rows=0",
    "drafter.ttt_steps=2",
    "train.nproc_per_node=1",
]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _nodes(cfg) -> list[str]:
    """Start one torchrun per node (threads stand in for hosts), as the train-node task does; their errors."""
    from tasks.train import torchrun_log, torchrun_spec

    config_path, errors = write_run_config(cfg), []

    def node(rank: int) -> None:
        try:
            run_torchrun(torchrun_spec(cfg, config_path, 0, rank), torchrun_log(cfg, rank), timeout_s=600)
        except Exception as exc:  # reported by the test with the node's log tail
            errors.append(f"node {rank}: {exc}")

    threads = [threading.Thread(target=node, args=(rank,)) for rank in range(cfg.train.nnodes)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The tiny run trained by 2 nodes x 1 process (c10d rendezvous) and by 1 node x 2 processes (standalone)."""
    endpoint = f"127.0.0.1:{_free_port()}"
    multi = load_run_config(
        real_tiny_run(
            tmp_path_factory.mktemp("nodes2") / "runs", [*TRAIN, "train.nnodes=2", f"train.rdzv_endpoint={endpoint}"]
        )
    )
    assert _nodes(multi) == []
    single = load_run_config(
        real_tiny_run(tmp_path_factory.mktemp("nodes1") / "runs", [*TRAIN, "train.nproc_per_node=2"])
    )
    assert _nodes(single) == []
    return {"multi": multi, "single": single}


def _losses(cfg, kind: str) -> list[float]:
    return [r["loss"] for r in read_metrics(cfg.run_dir / "train" / "metrics.jsonl", kind)]


def test_two_nodes_give_the_loss_curve_of_one_node_with_two_processes(runs):
    """Train and val losses of 2 nodes x 1 process equal those of 1 node x 2 processes (same world, same ranks)."""
    multi, single = runs["multi"], runs["single"]
    assert len(_losses(multi, "train")) == len(_losses(single, "train")) == 6
    assert _losses(multi, "train") == pytest.approx(_losses(single, "train"), rel=1e-5)
    assert _losses(multi, "eval") == pytest.approx(_losses(single, "eval"), rel=1e-5)


def test_each_node_logs_its_own_torchrun_and_rank_zero_writes_the_run(runs):
    """Each node kept its own log; exactly one node ran global rank 0 (it logs the steps and writes the manifest).

    With the c10d rendezvous torchrun assigns global ranks in joining order, not by --node-rank, so which
    node holds rank 0 is not fixed."""
    train_dir = runs["multi"].run_dir / "train"
    logs = [(train_dir / f"torchrun.node{rank}.log").read_text() for rank in (0, 1)]
    leaders = [log for log in logs if "[rank 0] step " in log]
    assert len(leaders) == 1 and "world 2" in leaders[0]
    assert not (train_dir / "torchrun.log").exists() and (train_dir / "train.manifest.json").exists()
