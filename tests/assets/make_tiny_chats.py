"""Generate the bundled synthetic chats (the tiny preset's data) deterministically.

    python tests/assets/make_tiny_chats.py          # rewrite eagle3/assets/tiny_chats*.json[l]
    python tests/assets/make_tiny_chats.py --check  # exit 1 if the committed files are stale

Every conversation is short and ASCII so a byte-level tokenizer and a tiny model digest it in
seconds; the facts about invented places are made up on purpose (no real data, no licence).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from infra.storage import atomic_write_text

ASSETS = Path(__file__).resolve().parents[2] / "eagle3" / "assets"
OPENAI_PATH = ASSETS / "tiny_chats.jsonl"
SHAREGPT_PATH = ASSETS / "tiny_chats_sharegpt.json"
NUM_CONVERSATIONS = 60
NUM_SHAREGPT = 20
SEED = 1234

GENERIC_PROMPT = "You are a helpful assistant. Keep answers short."
MATH_PROMPT = "You are a concise math tutor. Answer in one sentence."
VELMORA_PROMPT = "You answer questions about the made-up land of Velmora."

# (unit, base unit, factor): "1 <unit> = factor <base unit>"
UNITS = [
    ("kilometers", "meters", 1000),
    ("kilograms", "grams", 1000),
    ("hours", "minutes", 60),
    ("minutes", "seconds", 60),
    ("liters", "milliliters", 1000),
    ("days", "hours", 24),
]

# Invented facts: (question, answer); none of these places exist.
FACTS = [
    ("What is the capital of Velmora?", "The capital of Velmora is Brinsk."),
    ("How many moons does the planet Zorbia have?", "Zorbia has three moons: Tal, Ivo and Sen."),
    ("Which river flows through Brinsk?", "The river Ostrel flows through Brinsk."),
    ("What do people in Velmora eat for breakfast?", "Most people in Velmora eat barley cakes with plum jam."),
    ("How tall is Mount Kessa?", "Mount Kessa is 4,210 meters tall."),
    ("What language is spoken in Velmora?", "People in Velmora speak Velmic."),
    ("When is the Lantern Festival in Brinsk?", "The Lantern Festival in Brinsk is held on the first night of spring."),
    ("What is the currency of Velmora?", "Velmora uses the crown, which is split into 100 pips."),
]

FOLLOW_UPS = [
    ("Thanks! Can you say that more briefly?", "Sure: {short}"),
    ("Are you sure?", "Yes. {short}"),
]


def arithmetic(rng: random.Random) -> list[dict[str, str]]:
    """One question and answer, sometimes with a 'double it' follow-up."""
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    op = rng.choice(["+", "-", "*"])
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    turns = [
        {"role": "user", "content": f"What is {a} {op} {b}?"},
        {"role": "assistant", "content": f"{a} {op} {b} = {value}."},
    ]
    if rng.random() < 0.4:
        turns += [
            {"role": "user", "content": "And if you double that?"},
            {"role": "assistant", "content": f"Doubling {value} gives {2 * value}."},
        ]
    return turns


def conversion(rng: random.Random) -> list[dict[str, str]]:
    """A unit conversion with its reason, sometimes converted back."""
    unit, base, factor = rng.choice(UNITS)
    amount = rng.choice([2, 3, 5, 7, 1.5, 2.5, 12])
    result = amount * factor
    result_text = f"{result:g}"
    turns = [
        {"role": "user", "content": f"How many {base} are in {amount:g} {unit}?"},
        {
            "role": "assistant",
            "content": f"{amount:g} {unit} = {result_text} {base}, because 1 {unit[:-1]} = {factor} {base}.",
        },
    ]
    if rng.random() < 0.3:
        turns += [
            {"role": "user", "content": f"And how many {unit} is {result_text} {base}?"},
            {"role": "assistant", "content": f"{result_text} {base} is {amount:g} {unit}."},
        ]
    return turns


def fact(rng: random.Random) -> list[dict[str, str]]:
    """A made-up fact, sometimes with one or two follow-ups (up to three user turns)."""
    question, answer = rng.choice(FACTS)
    turns = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    for _ in range(rng.choice([0, 0, 1, 2])):
        ask, reply = rng.choice(FOLLOW_UPS)
        turns += [{"role": "user", "content": ask}, {"role": "assistant", "content": reply.format(short=answer)}]
    return turns


MAKERS = [(arithmetic, MATH_PROMPT), (conversion, MATH_PROMPT), (fact, VELMORA_PROMPT)]


def build_conversations() -> list[dict]:
    """The NUM_CONVERSATIONS records, in OpenAI 'messages' form, identical on every call."""
    rng = random.Random(SEED)
    records, seen = [], set()
    while len(records) < NUM_CONVERSATIONS:
        maker, topic_prompt = MAKERS[len(records) % len(MAKERS)]
        messages = maker(rng)
        if rng.random() < 0.3:
            messages.insert(0, {"role": "system", "content": rng.choice([GENERIC_PROMPT, topic_prompt])})
        # Redraw exact repeats: the merge would drop them as duplicate_content, shrinking the preset.
        key = json.dumps(messages, sort_keys=True)
        if key not in seen:
            seen.add(key)
            records.append({"id": f"chat-{len(records):04d}", "messages": messages})
    return records


def to_sharegpt(record: dict) -> dict:
    """The same conversation in ShareGPT form (human/gpt/system)."""
    names = {"user": "human", "assistant": "gpt", "system": "system"}
    turns = [{"from": names[m["role"]], "value": m["content"]} for m in record["messages"]]
    return {"id": record["id"].replace("chat-", "sg-"), "conversations": turns}


def render() -> dict[Path, str]:
    """File path -> exact text to write."""
    records = build_conversations()
    jsonl = "".join(json.dumps(r, ensure_ascii=True) + "\n" for r in records)
    sharegpt = json.dumps([to_sharegpt(r) for r in records[:NUM_SHAREGPT]], indent=1) + "\n"
    return {OPENAI_PATH: jsonl, SHAREGPT_PATH: sharegpt}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare with the committed files")
    args = parser.parse_args()
    stale = [p for p, text in render().items() if not p.is_file() or p.read_text() != text]
    if args.check:
        for path in stale:
            print(f"stale: {path}", file=sys.stderr)
        return 1 if stale else 0
    for path, text in render().items():
        atomic_write_text(path, text)
    print(f"wrote {len(render())} files under {ASSETS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
