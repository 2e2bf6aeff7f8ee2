"""Multi-node training through deployments: train.nnodes = N starts N flow runs of `eagle3-train-node`.

The parent (eagle3-train, or the pipeline's train step) submits one run per node_rank 0..N-1 to that
deployment on the gpu pool, so N workers (one per host) each start one torchrun; the torchruns meet at
train.rdzv_endpoint (torchrun's c10d store, served by the agent on that host) and form one world. The parent
waits for all of them. When a node ends Failed or Crashed its peers fail too (their collectives lose a rank),
so the parent submits all nodes again, at most MAX_ROUNDS times in all, and the trainer resumes from the newest
checkpoint. Every host must see the run directory at the same path (shared storage) and reach the endpoint.

The node task carries no `gpu` tag: that concurrency limit counts slots on the whole server, and the N nodes
must hold theirs at the same time (a node queued behind another would leave it waiting at the rendezvous).
"""

from __future__ import annotations

from pathlib import Path
from uuid import UUID

from prefect import flow, get_run_logger

from eagle3.config import RunConfig
from flows.common import submit_run, wait_runs
from infra.locks import hand_down_file
from tasks.train import TrainSummary, train_node_task, train_summary

NODE_DEPLOYMENT = "eagle3-train-node/eagle3-train-node"
MAX_ROUNDS = 2


@flow(name="eagle3-train-node", log_prints=True)
def eagle3_train_node(config: RunConfig, node_rank: int = 0, lock_token_file: str | None = None) -> None:
    """One node of a multi-node training; eagle3-train starts one run of it per node.

    Args:
        config: The run's full configuration (train.nnodes above 1 and train.rdzv_endpoint set).
        node_rank: This node's rank, 0 to train.nnodes - 1.
        lock_token_file: Path of the private file (0600, in the run directory) through which the parent flow that
            holds the run directory hands its lock down to this round of nodes; the secret is never a parameter.
    """
    from infra.locks import adopt_token_file

    if lock_token_file:  # the trainer's rank 0 (on any node) then counts as the holder's, as under a single-node flow
        try:
            adopt_token_file(lock_token_file)
        except FileNotFoundError:  # that round is over: its token is revoked, and rank 0 is refused the run lock
            get_run_logger().warning("lock token file %s is gone (its round ended)", lock_token_file)
    train_node_task(config, node_rank)


def train_nodes(cfg: RunConfig, poll_s: float = 5.0) -> TrainSummary:
    """Run the node flow runs to completion (all re-submitted together after a failure); the training summary."""
    if not cfg.train.rdzv_endpoint:
        raise ValueError(f"train.nnodes={cfg.train.nnodes} needs train.rdzv_endpoint (host:port every node reaches)")
    logger = get_run_logger()
    for attempt in range(1, MAX_ROUNDS + 1):
        with hand_down_file(cfg.run_dir) as token_file:  # revoked when the round ends: a late node is refused
            ids = [_submit(cfg, rank, attempt, token_file) for rank in range(cfg.train.nnodes)]
            logger.info("attempt %d: %d node runs submitted to %s", attempt, len(ids), NODE_DEPLOYMENT)
            states = wait_runs(ids, poll_s, deadline_s=cfg.train.timeout_s + 3600.0)
        failed = {rank: name for rank, name in enumerate(states) if name != "COMPLETED"}
        if "TIMEOUT" in failed.values():  # still running: a new attempt would train beside it in the same run
            raise RuntimeError(
                f"node runs {[str(ids[r]) for r, n in failed.items() if n == 'TIMEOUT']} still run "
                f"after train.timeout_s + 1 h; cancel them before running the training again"
            )
        if not failed:
            return train_summary(cfg)
        logger.warning("attempt %d: nodes %s did not complete (%s)", attempt, sorted(failed), failed)
    raise RuntimeError(f"multi-node training failed {MAX_ROUNDS} times; last node states: {failed}")


def _submit(cfg: RunConfig, rank: int, attempt: int, token_file: Path | None) -> UUID:
    params = {"config": cfg, "node_rank": rank, "lock_token_file": str(token_file) if token_file else None}
    return submit_run(NODE_DEPLOYMENT, params, f"train-{cfg.run.name}-node{rank}-try{attempt}")
