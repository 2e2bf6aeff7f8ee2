"""python -m eagle3.train --config <run>/config.json [--set train.lr=2e-4] [--stop-after-steps N] [--known-key KEY]

Trains the drafter of a run whose features and vocab map exist, resuming from the latest checkpoint.
Works as a plain process (world size 1) or under torchrun (one process per GPU):

    python -m eagle3.train --config runs/tiny/config.json
    python -m torch.distributed.run --standalone --nproc-per-node=8 -m eagle3.train --config runs/x/config.json

SIGTERM (or Ctrl-C) finishes the current step, writes a checkpoint and exits 0; running the same
command again continues with the next batch. ``--stop-after-steps N`` does the same after N steps of
this invocation (a planned preemption: smoke runs, tests). ``--known-key`` is the pipeline's: its train task
computed the stage key of the config it passes, and the trainer takes it instead of computing it again.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

PR_SET_PDEATHSIG = 1


def _configure_logging() -> None:
    """INFO on rank 0, warnings only on the other ranks (one step line per step, not one per GPU)."""
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        stream=sys.stdout,
        format=f"%(asctime)s [rank {rank}] %(message)s",
        datefmt="%H:%M:%S",
    )


def _stop_with_launcher() -> None:
    """Under torchrun: SIGTERM this worker when its launcher dies.

    The launcher is SIGKILLed with the orchestrating process (infra.torchrun asks for that); without
    this, its workers would train on unsupervised and race the next attempt. SIGTERM makes the
    trainer checkpoint and exit, so the work done so far is kept.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() == 1:  # the launcher died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


def main(argv: list[str] | None = None) -> None:
    """Parse the config arguments and run the train stage (rank 0 prints the result as one JSON line)."""
    from eagle3.run.cli_args import add_config_args, stage_main

    parser = add_config_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument(
        "--stop-after-steps",
        type=int,
        default=None,
        metavar="N",
        help="checkpoint and exit 0 after N optimizer steps of this invocation",
    )
    parser.add_argument(
        "--known-key",
        default=None,
        metavar="KEY",
        help="the train key of this config, computed by the caller (the pipeline's train task); "
        "taken as given, not computed again",
    )

    def run(cfg, args: argparse.Namespace):
        from eagle3.config import ConfigError
        from eagle3.train.loop import train

        if args.known_key and args.overrides:  # the key was computed of the config file, not of the overrides
            raise ConfigError("--known-key names the key of the --config file as it is: it cannot go with --set")
        _configure_logging()
        _stop_with_launcher()
        return train(cfg, args.stop_after_steps, args.known_key)

    def show(result) -> None:
        if int(os.environ.get("RANK", "0")) == 0:
            print(
                json.dumps(
                    {
                        "status": result.status,
                        "step": result.step,
                        "checkpoint": str(result.checkpoint) if result.checkpoint else None,
                    }
                )
            )

    # no lock here: rank 0 of the trainer holds it (every rank must learn that it is taken)
    stage_main(parser, argv, run, show=show)


if __name__ == "__main__":
    main()
