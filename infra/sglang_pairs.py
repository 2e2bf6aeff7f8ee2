"""A benchmark's two servers as specs: a baseline and its speculative twin (EAGLE-3, DFlash or n-gram) with the same
shared fields on consecutive ports, so only the ``--speculative-*`` flags (and the port) differ, as a fair comparison
needs.
"""

from __future__ import annotations

from typing import Any

from infra.sglang_spec import NgramSettings, ServerSpec


def serving_pair(
    model_path: str,
    draft_model_path: str,
    *,
    port: int,
    num_steps: int,
    topk: int,
    num_draft_tokens: int,
    rejection_sampling: bool = False,
    **shared: Any,
) -> tuple[ServerSpec, ServerSpec]:
    """(baseline, speculative) specs for a benchmark: the same ``shared`` fields, ports ``port`` and ``port + 1``.

    Only the ``--speculative-*`` flags (and the port) differ, as a fair comparison needs; the
    EAGLE-3 trio is always explicit, so SGLang's per-architecture defaults never pick it silently.
    ``rejection_sampling`` (topk 1 only): sampled requests verify drafts drawn from the drafter by the rejection rule.
    """
    baseline = ServerSpec(model_path, "serve", port=port, **shared)
    speculative = ServerSpec(
        model_path,
        "speculative",
        port=port + 1,
        draft_model_path=draft_model_path,
        num_steps=num_steps,
        topk=topk,
        num_draft_tokens=num_draft_tokens,
        rejection_sampling=rejection_sampling,
        **shared,
    )
    return baseline, speculative


def dflash_serving_pair(
    model_path: str, draft_model_path: str, *, port: int, block_size: int, **shared: Any
) -> tuple[ServerSpec, ServerSpec]:
    """(baseline, DFlash) specs for a benchmark, as ``serving_pair``: the same ``shared`` fields, ports ``port`` and
    ``port + 1``; the block size is always explicit (it must equal the draft's config.json block_size)."""
    baseline = ServerSpec(model_path, "serve", port=port, **shared)
    dflash = ServerSpec(
        model_path, "dflash", port=port + 1, draft_model_path=draft_model_path, block_size=block_size, **shared
    )
    return baseline, dflash


def ngram_serving_pair(
    model_path: str, *, port: int, ngram: NgramSettings | None = None, **shared: Any
) -> tuple[ServerSpec, ServerSpec]:
    """(baseline, n-gram) specs for a benchmark, as ``serving_pair``: the same ``shared`` fields, ports ``port`` and
    ``port + 1``; SGLang's NGRAM drafts from the requests' own tokens, so there is no draft model."""
    baseline = ServerSpec(model_path, "serve", port=port, **shared)
    return baseline, ServerSpec(model_path, "ngram", port=port + 1, ngram=ngram or NgramSettings(), **shared)
