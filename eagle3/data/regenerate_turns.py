"""One conversation's regeneration: which messages get a new answer, answering them, and what the answers became.

Which messages become answers (``plan_turns``):
  * a generated answer follows each maximal run of user messages (also a trailing user turn);
  * every original assistant message after the first user message is dropped (it is replaced);
  * assistant messages before the first user message (an opening greeting) answer nothing and
    are kept verbatim as context; system and other messages are kept in place.

``regenerate_conversation`` answers them in order on the regenerated history; ``truncated_turns`` names the answers
that stopped at the token cap, and ``LoopCuts`` cuts a capped answer where it ran into a loop. The run over a
whole dataset (journal, workers, outputs) is eagle3.data.regenerate's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eagle3.data.chat_backends import ChatBackend, Message
from eagle3.data.textcheck import loop_cut


def plan_turns(messages: list[Message], max_user_turns: int | None = None) -> list[Message | None]:
    """The regenerated conversation's skeleton: kept messages, and None where an answer goes.

    With ``max_user_turns``, everything after the answer to that many user turns is left out.
    """
    plan: list[Message | None] = []
    seen_user = False
    for i, msg in enumerate(messages):
        if msg["role"] == "assistant" and seen_user:
            continue
        if max_user_turns is not None and plan.count(None) >= max_user_turns:
            break
        plan.append({"role": msg["role"], "content": msg["content"]})
        if msg["role"] == "user":
            seen_user = True
            if i + 1 == len(messages) or messages[i + 1]["role"] != "user":
                plan.append(None)
    return plan


async def regenerate_conversation(
    messages: list[Message], backend: ChatBackend, row_id: str, max_user_turns: int | None = None
) -> tuple[list[Message], list[str | None]]:
    """Answer each user turn on the regenerated history; returns (messages, finish reasons)."""
    history: list[Message] = []
    finish_reasons: list[str | None] = []
    for item in plan_turns(messages, max_user_turns):
        if item is not None:
            history.append(item)
            continue
        done = await backend.complete(list(history), f"{row_id}#{len(finish_reasons)}")
        history.append({"role": "assistant", "content": done.content})
        finish_reasons.append(done.finish_reason)
    return history, finish_reasons


def truncated_turns(row: dict[str, Any], record: dict[str, Any], max_user_turns: int | None) -> list[int]:
    """Indices, in the regenerated messages, of the answers that stopped at the token cap (finish_reason length):
    the answers sit where plan_turns put None, in the order of the record's finish reasons."""
    slots = [i for i, item in enumerate(plan_turns(row["messages"], max_user_turns)) if item is None]
    return [slot for slot, reason in zip(slots, record["finish_reasons"], strict=True) if reason == "length"]


@dataclass
class LoopCuts:
    """What regenerate.cut_loops removed: capped answers cut where they ran into a loop, and the turns after them."""

    answers: int = 0
    chars_removed: int = 0
    later_turns_dropped: int = 0

    def cut(self, messages: list[Message], truncated: list[int]) -> tuple[list[Message], list[int]]:
        """``messages`` up to the first capped answer that loops, that answer cut (textcheck.loop_cut) and still
        marked truncated; the later turns answered a history holding the whole loop, so they go too."""
        for i in sorted(truncated):
            at = loop_cut(messages[i]["content"])
            if at is None:
                continue
            self.answers += 1
            self.chars_removed += len(messages[i]["content"]) - at
            self.later_turns_dropped += sum(m["role"] == "assistant" for m in messages[i + 1 :])
            return [*messages[:i], {**messages[i], "content": messages[i]["content"][:at]}], [
                t for t in truncated if t <= i
            ]
        return messages, truncated
