"""Offline evaluation: prompts, speculative decoding (chain, tree, n-gram) with eager or static caches, the report."""
