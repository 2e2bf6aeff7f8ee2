"""Checks on the text of records: word n-grams, near duplicates, degenerate text, overlap with evaluation prompts.

All checks work on normalized words: lowercased runs of letters, digits and '_' (``\\w+``), so case,
punctuation and whitespace edits do not hide a copy.

* ``NearDuplicates`` finds an earlier text whose word n-gram set has a Jaccard similarity >= a threshold.
  It is exact, not sampled (unlike MinHash): each set is ordered by one global order, and two sets with
  Jaccard >= t must share one of the first ``len - ceil(t * len) + 1`` grams of each (prefix filtering,
  Chaudhuri et al. 2006), so only those grams are indexed and only texts sharing one are compared.
* ``degenerate_reason`` flags text that is mostly not letters or digits, or loops (most word 3-grams repeat).
* ``loop_cut`` finds where a runaway loop starts in a text (from some word on, nearly every word 3-gram repeats
  an earlier one) and the character offset to cut it at, a few repeats later.
* ``EvalOverlap`` holds the word 8-grams of every evaluation prompt, built once; a record is contaminated
  when it shares ``min_shared`` 8-grams that occur in one evaluation prompt only (boilerplate that many prompts
  share, like HumanEval's instruction line, is no evidence), or every 8-gram of one prompt (it contains it).
  8-grams that are mostly numbers or one-letter words (a matrix literal's '0 0 1 0 ...') are not indexed,
  unless a prompt has no other ('x+y = 4z, x*y = 4z^2, express x-y in z').
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

WORD_RE = re.compile(r"\w+")
NEAR_DUPLICATE_NGRAM = 3
"""Word n-gram size of the near-duplicate check."""
MIN_ALNUM_FRACTION = 0.5
"""Text whose non-space characters are less than this fraction letters or digits is degenerate."""
LOOP_NGRAM = 3
MAX_REPEATED_FRACTION = 0.5
"""Text in which at least this fraction of the word 3-grams repeat an earlier one is a loop (degenerate)."""
MIN_LOOP_NGRAMS = 8
"""Fewer word 3-grams than this are too few to call a loop."""
LOOP_TAIL_FRACTION = 0.9
"""A runaway loop: from its first repeated 3-gram to the end, at least this fraction of the 3-grams repeat."""
LOOP_TAIL_MIN_WORDS = 32
"""Shorter repetitive tails (a list's last items, a closing code block) are not called a runaway loop."""
LOOP_KEEP_WORDS = 24
"""Words of the loop kept before the cut: the data still shows loops starting (greedy outputs have them)."""
EVAL_NGRAM = 8
"""Word n-gram size of the evaluation-overlap check."""


def words(text: str) -> list[str]:
    """Lowercased words (``\\w+`` runs) of a text."""
    return WORD_RE.findall(text.lower())


def word_ngrams(ws: list[str], n: int) -> set[tuple[str, ...]]:
    """Every n consecutive words (empty when there are fewer than n)."""
    return set(zip(*(ws[i:] for i in range(n))))


# --------------------------------------------------------------------------- near duplicates


class NearDuplicates:
    """Texts seen so far, and which earlier one (if any) a new text nearly repeats."""

    def __init__(self, threshold: float, n: int = NEAR_DUPLICATE_NGRAM):
        self.threshold, self.n = threshold, n
        self._sets: list[frozenset[int]] = []  # hashed n-grams of each added text
        self._ids: list[str] = []
        self._index: dict[int, list[int]] = defaultdict(list)  # prefix gram -> texts whose prefix holds it

    def _grams(self, text: str) -> list[int]:
        ws = words(text)
        grams = word_ngrams(ws, self.n) or ({tuple(ws)} if ws else set())  # a short text is one gram
        return sorted(hash(g) for g in grams)  # sorted hashes: the global order the prefix filter needs

    def _prefix(self, grams: list[int]) -> list[int]:
        # Jaccard >= t means overlap >= t * len of each set; the 1e-9 keeps 0.7 * 10 from rounding up to 8.
        return grams[: len(grams) - math.ceil(self.threshold * len(grams) - 1e-9) + 1]

    def find(self, text: str) -> tuple[str, float] | None:
        """(id, Jaccard) of the most similar earlier text at or above the threshold, else None."""
        grams = self._grams(text)
        if not grams:
            return None
        mine = frozenset(grams)
        candidates = {k for g in self._prefix(grams) for k in self._index.get(g, ())}
        best: tuple[str, float] | None = None
        for k in sorted(candidates):
            shared = len(mine & self._sets[k])
            jaccard = shared / (len(mine) + len(self._sets[k]) - shared)
            if jaccard >= self.threshold and (best is None or jaccard > best[1]):
                best = (self._ids[k], jaccard)
        return best

    def add(self, text: str, ident: str) -> None:
        """Remember a kept text under ``ident``."""
        grams = self._grams(text)
        if not grams:
            return
        k = len(self._sets)
        self._sets.append(frozenset(grams))
        self._ids.append(ident)
        for g in self._prefix(grams):
            self._index[g].append(k)


# --------------------------------------------------------------------------- degenerate text


def degenerate_reason(text: str) -> str | None:
    """Why a text is degenerate (mostly symbols, or a loop), or None."""
    chars = [c for c in text if not c.isspace()]
    if chars:
        alnum = sum(c.isalnum() for c in chars) / len(chars)
        if alnum < MIN_ALNUM_FRACTION:
            return f"only {alnum:.0%} of its non-space characters are letters or digits"
    grams = list(zip(*(words(text)[i:] for i in range(LOOP_NGRAM))))
    if len(grams) >= MIN_LOOP_NGRAMS:
        repeated = 1 - len(set(grams)) / len(grams)
        if repeated >= MAX_REPEATED_FRACTION:
            return f"{repeated:.0%} of its word {LOOP_NGRAM}-grams repeat earlier ones (a loop)"
    return None


_CJK = "\u2e80-\u9fff\uac00-\ud7af\uf900-\ufaff"
LOOP_WORD_RE = re.compile(f"[{_CJK}]|[^\\W{_CJK}]+")
"""loop_cut's words: ``\\w+`` runs, but each CJK character on its own (those scripts put no spaces between words)."""


def loop_cut(text: str) -> int | None:
    """The character offset at which to cut a runaway loop off ``text`` (``LOOP_KEEP_WORDS`` words after the
    loop starts), or None when no tail of at least ``LOOP_TAIL_MIN_WORDS`` words repeats itself that much.

    The loop starts at the first word whose 3-gram repeats an earlier one and from which at least
    ``LOOP_TAIL_FRACTION`` of the 3-grams to the end repeat; cutting there keeps the clean answer before it.
    Every number reads as the same word ('1. The Earth is ... 2. The Earth is ...' loops); each CJK character is a word.
    """
    spans = [m.span() for m in LOOP_WORD_RE.finditer(text)]
    ws = ["0" if text[a:b].isdigit() else text[a:b].lower() for a, b in spans]  # numbered lines loop too
    grams = list(zip(*(ws[i:] for i in range(LOOP_NGRAM))))
    seen: set[tuple[str, ...]] = set()
    repeated = []
    for g in grams:
        repeated.append(g in seen)
        seen.add(g)
    tail_repeats = 0
    start = None  # the earliest qualifying start, scanning from the end
    for i in range(len(grams) - 1, -1, -1):
        tail_repeats += repeated[i]
        tail = len(grams) - i
        if repeated[i] and tail + LOOP_NGRAM - 1 >= LOOP_TAIL_MIN_WORDS and tail_repeats >= LOOP_TAIL_FRACTION * tail:
            start = i
    if start is None or start + LOOP_KEEP_WORDS >= len(ws):
        return None
    return spans[start + LOOP_KEEP_WORDS][0]


# --------------------------------------------------------------------------- evaluation overlap


@dataclass(frozen=True)
class EvalHit:
    """The evaluation prompt a record overlaps, and by how much."""

    prompt_id: str
    shared: int
    """Word n-grams of the prompt found in the record."""
    total: int
    """Word n-grams of the prompt."""

    def describe(self) -> str:
        """One line for rejects.jsonl."""
        return f"shares {self.shared} of the {self.total} word {EVAL_NGRAM}-grams of evaluation prompt {self.prompt_id}"


def _informative(gram: tuple[str, ...]) -> bool:
    """At least half the words are words (two or more characters, a letter): runs of numbers and symbols like
    '0 0 1 0 0 1 0 0' from a matrix literal occur everywhere and prove no copy."""
    return 2 * sum(len(w) > 1 and any(c.isalpha() for c in w) for w in gram) >= len(gram)


class EvalOverlap:
    """Word n-gram index of the evaluation prompts, built once; ``check`` tells whether a record overlaps one."""

    def __init__(self, prompts: Iterable[tuple[str, str]], min_shared: int, n: int = EVAL_NGRAM):
        self.min_shared, self.n = min_shared, n
        self.ids: list[str] = []
        self._sizes: list[int] = []
        self._index: dict[tuple[str, ...], list[int]] = defaultdict(list)
        for prompt_id, text in prompts:
            ws = words(text)
            if not ws:
                continue
            every = word_ngrams(ws, min(n, len(ws)))  # a prompt shorter than n words is one shorter gram
            grams = {g for g in every if _informative(g)} or every  # all of them when none is informative
            for gram in grams:
                self._index[gram].append(len(self.ids))
            self.ids.append(prompt_id)
            self._sizes.append(len(grams))
        self._lengths = sorted({len(g) for g in self._index})  # n, and shorter sizes only for short prompts

    def check(self, texts: Iterable[str]) -> EvalHit | None:
        """The evaluation prompt the texts (a record's turns) contain or nearly copy, else None."""
        found: set[tuple[str, ...]] = set()  # per turn: an n-gram never spans two turns
        for text in texts:
            ws = words(text)
            for length in self._lengths:
                found |= word_ngrams(ws, length) & self._index.keys()
        shared: Counter[int] = Counter()
        distinctive: Counter[int] = Counter()
        for gram in found:
            owners = self._index[gram]
            shared.update(owners)
            if len(owners) == 1:
                distinctive[owners[0]] += 1
        hits = [k for k in shared if distinctive[k] >= self.min_shared or shared[k] >= self._sizes[k]]
        if not hits:
            return None
        best = min(hits, key=lambda k: (-shared[k] / self._sizes[k], k))
        return EvalHit(self.ids[best], shared[best], self._sizes[best])
