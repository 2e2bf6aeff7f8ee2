"""The SGLang releases this code follows and the server modes it launches, as tables: which release's parser takes
which mode, which modes speculate or capture, and what SGLang resolves itself for a mode (not flags of ours).
infra/sglang_spec.py builds each mode's argv; tests and `eagle3 doctor` check it against each release's parser.
"""

from __future__ import annotations

from typing import Literal

# The SGLang releases whose own argument parser every argv of infra/sglang_spec.py is checked against (tests and
# `eagle3 doctor`): 0.5.16, the GPU host's (its wheel pins torch 2.11, the host's torch), and 0.5.23, the
# release whose flags and JSON this code follows (SGLANG_VERSION, the newest).
SGLANG_VERSIONS: tuple[str, ...] = ("0.5.16", "0.5.23")
SGLANG_VERSION = SGLANG_VERSIONS[-1]
# Modes a release's parser cannot take, with the reason; every other (version, mode) pair must parse.
# 0.5.16 has neither --enable-return-aux-hidden-states nor --return-aux-hidden-state-layer-ids.
MODE_GAPS: dict[str, dict[str, str]] = {
    "0.5.16": {
        "capture_aux": "needs SGLang >= 0.5.23's --enable-return-aux-hidden-states (0.5.16's parser has no such flag)"
    },
}
Mode = Literal["capture_packed", "capture_aux", "capture_final", "serve", "speculative", "dflash", "ngram"]
MODES: tuple[str, ...] = ("capture_packed", "capture_aux", "capture_final", "serve", "speculative", "dflash", "ngram")
# Modes that speculate (a drafter, or NGRAM's n-grams): the server verifies drafts, its answers report verify steps.
SPECULATIVE_MODES = ("speculative", "dflash", "ngram")
# What SGLang's _handle_dflash resolves for a DFLASH server: not flags of ours, so not on the parsed namespace.
DFLASH_RESOLVED = ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens")
# What SGLang's _handle_ngram resolves for an NGRAM server (top-k from the max BFS breadth, steps from the tokens).
NGRAM_RESOLVED = ("speculative_num_steps", "speculative_eagle_topk")
CAPTURE_MODES = ("capture_packed", "capture_aux", "capture_final")
