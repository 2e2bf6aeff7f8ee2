"""A served flow whose train task runs the fake trainer (tests/flows/test_cancel_train.py cancels it).

    python tests/fakes/cancel_train_flow.py      # serves deployment eagle3-test-cancel-train/cancel-probe

The flow calls the real train task on the tiny preset; only the torchrun command is swapped for the fake trainer
under torchrun (two ranks that hang, and on SIGTERM take --stop-delay-s to stop, as a trainer finishing its step
and checkpointing does) and no GPU is looked for.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from prefect import flow  # noqa: E402

import tasks.train  # noqa: E402
from eagle3.config import load_config  # noqa: E402
from infra.torchrun import TorchrunSpec  # noqa: E402

STOP_DELAY_S = 120.0


@flow(name="eagle3-test-cancel-train")
def cancel_train_probe(workdir: str, pid_dir: str) -> None:
    """Train (the fake trainer, hanging) until the run is cancelled."""

    def fake_spec(cfg, config_path, num_gpus, node_rank=None, known_key=None):
        return TorchrunSpec(
            module="tests.fakes.fake_trainer",
            nproc_per_node=2,
            env={"OMP_NUM_THREADS": "1"},
            args=("--pid-dir", pid_dir, "--hang", "--launcher-guard", "--stop-delay-s", str(STOP_DELAY_S)),
        )

    tasks.train.torchrun_spec = fake_spec
    tasks.train._visible_gpus = lambda cfg: []
    tasks.train.train_task(load_config("tiny", [f"run.workdir={workdir}", "run.name=cancel-probe"]))


if __name__ == "__main__":
    cancel_train_probe.serve(name="cancel-probe", pause_on_shutdown=False, print_starting_message=False)
