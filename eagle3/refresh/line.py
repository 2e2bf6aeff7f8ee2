"""The promoted drafters of a run and the ``current`` pointer that serving reads.

    <run>/promoted/
        drafters/<id>/    an SGLang export, never changed once it has its name: config.json, model.safetensors, the
                          export's provenance files, promotion.json (why it was promoted, its measured table, the
                          data digests) and README.md (its export card followed by its promotion)
        current           a symlink to drafters/<id>: what the deploy stage and a user's SGLang command load
        events.jsonl      one fsynced line per promotion and rollback (eagle3.run.journal)
        README.md         the line's card: the current drafter, then every event, newest first

Atomicity: a drafter folder is written under a temp name, fsynced and renamed (it exists whole or not at all), and
``current`` is replaced by renaming a new symlink over it, the last write of a promotion; so a reader, or a process
killed at any instruction, sees the old drafter or the new one, never a mix. Nothing is deleted: the drafter
``current`` pointed at before stays for ``rollback``, which points ``current`` at the drafter the current one
replaced (promotion.json's ``replaces``). The events journal and the line's card are written after the pointer
and repaired by the next promotion, rollback or refresh (``record_current``).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import time
from pathlib import Path

from eagle3.refresh.records import Promotion
from eagle3.refresh.report import promotion_lines
from eagle3.run.journal import Journal
from infra.storage import atomic_write_json, atomic_write_text, fsync_dir, seal_dir

PROMOTED_DIR, DRAFTERS_DIR, CURRENT = "promoted", "drafters", "current"
EVENTS_FILE, PROMOTION_FILE, CARD_FILE = "events.jsonl", "promotion.json", "README.md"


class PromotionError(ValueError):
    """A promotion or rollback that cannot be done (nothing to roll back to, no export to promote)."""


def utc_now() -> str:
    """The time as promotion records and events write it."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class Line:
    """The promoted drafters of the run in ``run_dir``. Callers hold the run lock while they change it."""

    def __init__(self, run_dir: Path):
        self.root = Path(run_dir) / PROMOTED_DIR
        self.events = Journal(self.root / EVENTS_FILE)

    @property
    def pointer(self) -> Path:
        """promoted/current."""
        return self.root / CURRENT

    def drafter_dir(self, drafter_id: str) -> Path:
        """promoted/drafters/<id>."""
        return self.root / DRAFTERS_DIR / drafter_id

    def current_id(self) -> str | None:
        """The id ``current`` points at, or None before the first promotion."""
        try:
            return Path(os.readlink(self.pointer)).name
        except FileNotFoundError:
            return None

    def current_dir(self) -> Path | None:
        """The folder ``current`` points at (resolved: it stays that drafter after a later promotion)."""
        drafter = self.current_id()
        return self.drafter_dir(drafter) if drafter else None

    def promotion(self, drafter_id: str) -> Promotion:
        """promotion.json of a drafter."""
        return Promotion.from_json(json.loads((self.drafter_dir(drafter_id) / PROMOTION_FILE).read_text()))

    def lineage(self) -> list[Promotion]:
        """The current drafter's promotion, then the one it replaced, and so on back to the first."""
        chain: list[Promotion] = []
        drafter = self.current_id()
        while drafter is not None and len(chain) < 10_000:
            chain.append(self.promotion(drafter))
            drafter = chain[-1].replaces
        return chain

    # ------------------------------------------------------------------------------------------- writing

    def promote(self, export_dir: Path, promotion: Promotion, card_head: str = "") -> Path:
        """Publish ``export_dir`` as drafter ``promotion.id`` (unless a killed earlier call published it already),
        point ``current`` at it, then journal the event and rewrite the card. ``card_head``: the export's card."""
        folder = self.drafter_dir(promotion.id)
        if not folder.is_dir():
            self._publish(Path(export_dir), promotion, card_head)
        self._point(promotion.id)
        self.record_current()
        return folder

    def rollback(self) -> Promotion:
        """Point ``current`` at the drafter the current one replaced; its promotion record."""
        self.record_current()  # a killed promotion's event first, so the journal keeps the order
        drafter = self.current_id()
        if drafter is None:
            raise PromotionError(f"{self.root} has no current drafter: nothing to roll back")
        previous = self.promotion(drafter).replaces
        if previous is None:
            raise PromotionError(f"current drafter {drafter} is the first of {self.root}: nothing to roll back to")
        self._point(previous)
        with self.events.appender() as append:
            append(
                {
                    "id": f"rollback-{len(self.events.load()) + 1:04d}",
                    "event": "rollback",
                    "from": drafter,
                    "to": previous,
                    "at": utc_now(),
                }
            )
        self.write_card()
        return self.promotion(previous)

    def record_current(self) -> None:
        """Journal the promotion of the current drafter if the events lack it (a kill between the pointer and the
        journal), and rewrite the card."""
        drafter = self.current_id()
        if drafter is None:
            return
        events = self.events.load()
        if f"promote-{drafter}" not in events:
            promotion = self.promotion(drafter)
            with self.events.appender() as append:
                append(
                    {
                        "id": f"promote-{drafter}",
                        "event": "promote",
                        "to": drafter,
                        "from": promotion.replaces,
                        "kind": promotion.kind,
                        "at": promotion.at,
                    }
                )
        self.write_card()

    def write_card(self) -> Path:
        """promoted/README.md (line_card)."""
        return atomic_write_text(self.root / CARD_FILE, line_card(self))

    def _publish(self, export_dir: Path, promotion: Promotion, card_head: str) -> None:
        """The export's files, promotion.json and the card into a temp folder, fsynced, renamed to drafters/<id>."""
        final = self.drafter_dir(promotion.id)
        final.parent.mkdir(parents=True, exist_ok=True)
        for stale in final.parent.glob(f".{promotion.id}.tmp-*"):  # left by a killed promotion
            shutil.rmtree(stale, ignore_errors=True)
        tmp = final.with_name(f".{promotion.id}.tmp-{os.getpid()}")
        tmp.mkdir()
        try:
            for path in sorted(export_dir.iterdir()):
                if path.is_file() and path.name not in (CARD_FILE, PROMOTION_FILE):
                    shutil.copy2(path, tmp / path.name)
            atomic_write_json(tmp / PROMOTION_FILE, promotion.to_json())
            card = (card_head.rstrip() + "\n\n" if card_head.strip() else "") + "\n".join(promotion_lines(promotion))
            atomic_write_text(tmp / CARD_FILE, card + "\n")
            seal_dir(tmp)
            os.rename(tmp, final)
            fsync_dir(final.parent)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def _point(self, drafter_id: str) -> None:
        """current -> drafters/<id> (relative, so the run stays movable), by renaming a new symlink over it."""
        if not (self.drafter_dir(drafter_id) / PROMOTION_FILE).is_file():
            raise PromotionError(f"{self.drafter_dir(drafter_id)} is not a promoted drafter (no {PROMOTION_FILE})")
        for stale in self.root.glob(f".{CURRENT}.*.tmp"):  # a killed swap's new link
            with contextlib.suppress(FileNotFoundError):
                stale.unlink()
        tmp = self.root / f".{CURRENT}.{secrets.token_hex(4)}.tmp"
        os.symlink(Path(DRAFTERS_DIR) / drafter_id, tmp)
        os.replace(tmp, self.pointer)
        fsync_dir(self.root)


def line_card(line: Line) -> str:
    """promoted/README.md: the current drafter, the serving path, its lineage's promotions, every event."""
    current = line.current_id()
    lines = [
        "# Promoted drafters",
        "",
        f"Current: `{current}` (`{line.pointer}` -> `{line.current_dir()}`)." if current else "Nothing promoted.",
        "",
        "SGLang loads the current drafter through the pointer: `--speculative-draft-model-path "
        f"{line.pointer.parent.resolve() / line.pointer.name}`; `eagle3 promote --rollback` returns to the one it "
        "replaced.",
        "",
        "## Events (newest first)",
        "",
    ]
    events = sorted(line.events.load().values(), key=lambda e: e["at"], reverse=True)
    lines += [f"- {e['at']}: {e['event']} `{e.get('from')}` -> `{e['to']}`" for e in events] or ["- none"]
    for promotion in line.lineage():
        lines += ["", *promotion_lines(promotion)]
    return "\n".join(lines) + "\n"
