"""Chain acceptance from one teacher-forced pass over a greedy text, instead of a decode per prompt.

A chain round of ``speculative_decode`` whose context holds c tokens drafts from the drafter's row c - 2 (the
aux state of token c - 2 paired with token c - 1): step 0 proposes token c, and step j feeds the drafter its
own step j - 1 output and draft token. While every draft so far equals the greedy text, that is exactly TTT
step j at row c - 2 with the text's own tokens fed (eagle3.drafter.alignment: step k at row t reads x_{t+1+k} and
predicts x_{t+2+k}), so the round accepts as many drafts as the TTT steps at that row get right in a row.
``chain_match_lengths`` runs the TTT unroll once over prompt + greedy text (k drafter passes over the whole
row, instead of one verify and k - 1 drafter forwards per round), and ``simulate_chain`` replays the rounds
from those lengths: the committed tokens per round, hence the acceptance, of every chain length up to k.

Equal to the decode in exact arithmetic; in floating point the two runs can part at a near tie (the decode's
aux states come from verify forwards over a few rows, these from one forward over the whole text), so a
measurement made this way is checked against decoded rounds (tests/unit/test_teacher_forced.py on CPU).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from eagle3.drafter.alignment import PAD_TOKEN, PREDICT_SHIFT, TOKEN_SHIFT
from eagle3.drafter.functional import TTTCache
from eagle3.drafter.masks import positions_from_documents, shift_left, single_document_ids
from eagle3.drafter.model import Eagle3Drafter
from eagle3.evaluate.proposers import NgramProposer
from eagle3.evaluate.speculate import accept_path


@torch.no_grad()
def chain_match_lengths(drafter: Eagle3Drafter, d2t: Tensor, aux: Tensor, seq: Sequence[int], steps: int) -> list[int]:
    """For every row t of ``seq`` (prompt + greedy text, L tokens), how many chain drafts from t in a row equal
    the text: the TTT steps 0..steps-1 at row t whose drafts (target ids) equal seq[t + 2 + k].

    aux [L, A*Ht]: the target's aux states of every token of ``seq`` (as capture stores them); d2t [Vd]: target id
    minus draft id. Returns L values in 0..steps (rows near the end run out of text and stop early).
    """
    device = aux.device
    ids = torch.tensor([list(seq)], dtype=torch.long, device=device)  # [1, L]
    docs = single_document_ids(1, ids.shape[1], device)  # [1, L]
    positions = positions_from_documents(docs)  # [1, L]
    cache = TTTCache()
    hidden = drafter.project_aux(aux[None].to(drafter.fc.weight.dtype))  # [1, L, H]
    going = torch.ones_like(ids, dtype=torch.bool)  # [1, L]: every draft so far right
    matched = torch.zeros_like(ids)  # [1, L]
    d2t = d2t.to(device)
    for k in range(steps):
        fed = shift_left(ids, TOKEN_SHIFT + k, PAD_TOKEN)  # [1, L]
        # dense: on CUDA "auto" takes flex, compiled per (length, key length), i.e. once per text (an H200 ran
        # 0.3 texts/s that way); one short text's dense scores [nH, L, (k + 1) L] are small
        hidden, logits = drafter(hidden, fed, positions + k, docs, cache, attn_impl="dense")  # [1, L, H], [1, L, Vd]
        draft = logits.argmax(-1)  # [1, L] draft ids
        going &= (draft + d2t[draft]) == shift_left(ids, PREDICT_SHIFT + k, -1)  # -1: past the text, never a hit
        matched += going
    return matched[0].tolist()


def simulate_chain(matched: Sequence[int], prompt_len: int, num_generated: int, steps: int) -> list[int]:
    """The tokens each round of a chain of ``steps`` drafts commits (bonus included) over a greedy text of
    ``num_generated`` tokens after a prompt of ``prompt_len``, as ``speculative_decode`` runs it: the prefill
    commits the first token, then a round with context c accepts min(matched[c - 2], steps) drafts plus the
    target's own token, and the last round commits only what the text has left."""
    if steps < 1:
        raise ValueError(f"a chain drafts at least one token, got steps={steps}")
    committed: list[int] = []
    done = 1
    while done < num_generated:
        row = prompt_len + done - 2  # context c = prompt_len + done
        take = min(min(matched[row], steps) + 1, num_generated - done)
        committed.append(take)
        done += take
    return committed


def simulate_ngram(proposer: NgramProposer, prompt: Sequence[int], generated: Sequence[int]) -> list[int]:
    """The tokens each round of prompt-lookup drafting commits over a greedy text, as ``speculative_decode`` runs it:
    n-gram drafts read only the context, so the rounds follow from the text alone (no target forward)."""
    committed: list[int] = []
    done = 1
    while done < len(generated):
        context = [*prompt, *generated[:done]]
        tree = proposer.propose(context)
        rows = len(tree.tokens) + 1  # verify rows: the context's last token, then each draft
        argmax = [*generated[done : done + rows], *[-1] * rows][:rows]  # the text's next tokens; -1 past its end
        path, _ = accept_path(tree, argmax)
        take = min(len(path) + 1, len(generated) - done)
        committed.append(take)
        done += take
    return committed
