"""Refresh: new prompts folded in behind a watermark, a candidate warm-started from the promoted drafter, a gate on
measured acceptance, and an atomic promotion with rollback (docs/refresh.md).

    python -m eagle3.refresh --preset tiny --set refresh.prompts=prompts/       # one refresh, no Prefect
    eagle3 promote --preset tiny --rollback                                      # back to the previous drafter

Modules: source (the prompt source and its watermark), line (promoted drafters, the `current` pointer, the card),
gate (both drafters measured on one frozen prompt file), candidate (the round's data and training), core (one
refresh from lock to report), report (its markdown), warm_start (what the train stage loads from refresh.init_from).
"""
