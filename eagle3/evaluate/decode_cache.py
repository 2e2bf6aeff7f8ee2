"""Static KV caches and fixed-shape forwards for the offline evaluation at batch 1 (on CUDA: CUDA graphs).

The eager runners (eagle3/evaluate/runners.py) grow their caches at every forward and launch every kernel from Python;
at batch 1 a small target is then bound by kernel launches, not by the GPU. The runners here keep fixed-size
caches and run every forward at one of a few widths (fewer rows are padded, more are cut into chunks of CHUNK
rows), so each width is one CUDA graph (eagle3/evaluate/graphs.py), replayed. This module holds those widths and
the rules below; the runners are eagle3/evaluate/static_target.py and eagle3/evaluate/static_drafter.py, and
eagle3.evaluate.session.make_runners picks them or the eager ones.

Why a static cache stays exact without clean-up:
- Every forward writes its rows at explicit cache indices and attends through an explicit mask over the whole
  cache. A row sees the committed entries, itself and the rows its caller marks (its ancestors), never anything
  past the committed length. Rejected draft rows and padding rows are therefore invisible: rolling back is
  setting the length, and later forwards overwrite those entries before anyone may see them.
- After a tree verify the accepted rows are moved down to consecutive indices (``keep``), which is what the
  dynamic cache's index_select does.
- The target's cache is transformers' StaticCache; only the write position is ours (PositionedStaticCache).
  transformers passes a prepared 4D float mask through unchanged, so the model attends exactly as told.

Bit-exact verification in any dtype (``decode_rows``): a verify row and the single-token forward that plain
greedy runs at the same place compute the same function, but a matrix product of 4 rows and one of 1 row are
different kernels that round differently, which in bf16 is enough to flip a near-tied argmax now and then.
With ``decode_rows`` set, every target forward that is not a long input's chunk (greedy tokens and verifies
alike) runs at that one width, so each row goes through the very same kernels whatever its neighbours are, and
a chain's or n-gram's output is greedy's bit for bit (padding rows only see themselves). A tree verify still
differs: its accepted rows sit at non-consecutive cache indices while verified, so their attention sums the
same keys in another order than greedy's forwards (in bf16 a tree's output can part from greedy at a near-tie),
unless ``gathered_keys`` gives every decode row its keys in sequence order (eagle3/evaluate/gathered.py).

Host reads: the runners never read device values themselves; the decode loops do (one read per verify round,
one per few greedy tokens).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

CHUNK = 64
"""Rows per forward of a long input (a prompt): longer inputs run in chunks, the last one padded."""
WIDTHS = (1, 4, 8, CHUNK)
"""The forward widths: a greedy token, chain/n-gram verifies and draft levels, deeper verifies, chunks (the
drafter's draft levels always; the target and the drafter's extends unless they run at one ``decode_rows`` width)."""
CAPACITY_STEP = 256
"""Cache lengths are multiples of this; a longer sequence reallocates (and captures or recompiles) once."""


def bucket(num: int, widths: Sequence[int] | None = None) -> int:
    """The width a forward of ``num`` (1 <= num <= CHUNK) rows runs at: the smallest of ``widths`` (default WIDTHS)
    that holds it."""
    if not 1 <= num <= CHUNK:
        raise ValueError(f"a fixed-width forward takes 1..{CHUNK} rows, got {num}")
    return next(w for w in (widths or WIDTHS) if w >= num)


def decode_widths(decode_rows: int | None) -> tuple[int, ...]:
    """Decode forward widths (target, drafter extends): WIDTHS, or ``decode_rows`` up to it and CHUNK for chunks."""
    if decode_rows is None:
        return WIDTHS
    if not 1 <= decode_rows <= CHUNK:
        raise ValueError(f"decode_rows must be 1..{CHUNK}, got {decode_rows}")
    return (decode_rows, CHUNK) if decode_rows < CHUNK else (CHUNK,)


def pad_rows(x: Tensor, width: int) -> Tensor:
    """x [n, ...] -> [width, ...] with zero rows appended."""
    return x if len(x) == width else torch.cat([x, x.new_zeros((width - len(x), *x.shape[1:]))])


def round_up(n: int) -> int:
    """``n`` rounded up to a multiple of CAPACITY_STEP (a cache length)."""
    return -(-n // CAPACITY_STEP) * CAPACITY_STEP
