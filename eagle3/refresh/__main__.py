"""python -m eagle3.refresh --preset NAME [--set refresh.prompts=PATH ...] | --config <run>/config.json

One refresh of the run (eagle3.refresh.core): prints the round's report, then its outcome as JSON. Exit 0 whether
the candidate was promoted or kept (the report says which and why); 2 on a user error (the run lock held, no
refresh.prompts, a prompt file rewritten under its watermark).
"""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> None:
    """Parse the config arguments and run one refresh (it takes the run lock itself)."""
    from eagle3.refresh.core import run_refresh
    from eagle3.refresh.records import RefreshOutcome
    from eagle3.refresh.report import refresh_markdown
    from eagle3.run.cli_args import add_config_args, print_json, stage_main

    parser = add_config_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))

    def show(outcome: RefreshOutcome) -> None:
        print(refresh_markdown(outcome))
        print_json(outcome)

    stage_main(parser, argv, lambda cfg, args: run_refresh(cfg), show=show)


if __name__ == "__main__":
    main()
