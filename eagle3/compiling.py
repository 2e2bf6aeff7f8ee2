"""One setting of torch.compile shared by the compiled paths (generation, the evaluation's decode, the drafter)."""

from __future__ import annotations


def raise_recompile_limit(at_least: int) -> None:
    """Let Dynamo keep at least ``at_least`` compiled variants per function: each fixed shape (batch, cache length,
    key layout) is one, and past the limit (8 by default) Dynamo silently runs the function uncompiled."""
    import torch._dynamo

    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"  # renamed in torch 2.6
    setattr(cfg, name, max(getattr(cfg, name), at_least))
