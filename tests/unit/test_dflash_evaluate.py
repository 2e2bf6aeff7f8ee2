"""DFlash decoding in the offline evaluation: the proposer's cached context equals a one-shot block forward, greedy
speculative decoding with a DFlash drafter is token-identical to plain greedy (and a broken verification is caught),
and the evaluate stage measures a DFlash export beside n-gram."""

from __future__ import annotations

import json

import pytest
import torch

from eagle3.config import load_config
from eagle3.drafter.dflash import DFlashDims, DFlashDrafter, export_state_dict, init_dflash_weights
from eagle3.evaluate import speculate
from eagle3.evaluate.dflash_decode import DFlashProposer
from eagle3.evaluate.runners import TargetRunner
from eagle3.evaluate.speculate import check_lossless, greedy_decode, speculative_decode
from eagle3.target.tiny import build_tiny_tokenizer
from tests.unit.test_speculate import AUX_IDS, MAX_NEW, QUESTIONS, prompt_ids, tiny_target

BLOCK = 4


def tiny_dflash(model, block: int = BLOCK, layers: int = 2, seed: int = 0) -> DFlashDrafter:
    """A random DFlash drafter as wide as the tiny target, reading its aux layers, with its embeddings and lm_head."""
    cfg = model.config
    dims = DFlashDims(
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.hidden_size // cfg.num_attention_heads,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=layers,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=None,
        vocab_size=cfg.vocab_size,
        num_context_features=len(AUX_IDS),
        block_size=block,
        mask_token_id=2,
    )
    drafter = DFlashDrafter(dims)
    init_dflash_weights(drafter, std=0.2, seed=seed)  # large enough that draft logits are far from ties
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(model.get_input_embeddings().weight)
        drafter.lm_head.weight.copy_(model.lm_head.weight)
    return drafter.to(model.dtype).eval()


@pytest.fixture(scope="module")
def setup():
    """The float64 tiny target, its runner reading the aux layers, a random DFlash drafter, the greedy references."""
    tokenizer = build_tiny_tokenizer()
    model = tiny_target()
    target = TargetRunner(model, AUX_IDS)
    prompts = [prompt_ids(tokenizer, q) for q in QUESTIONS]
    refs = [greedy_decode(target, p, MAX_NEW) for p in prompts]
    return {"target": target, "prompts": prompts, "refs": refs, "drafter": tiny_dflash(model)}


def test_cached_context_drafts_what_a_one_shot_block_drafts(setup):
    """Committing the prompt, then 5 and 3 more tokens into the proposer's cache drafts, at each point, the block
    DFlashDrafter.draft_block computes from all the committed states at once (1e-12 in float64: same argmax)."""
    target, drafter = setup["target"], setup["drafter"]
    seq = setup["prompts"][0] + setup["refs"][0].tokens
    target.reset()
    aux = target.step(seq).aux  # [L, A*H] states of every token
    proposer = DFlashProposer(drafter)
    start = 0
    for end in (len(setup["prompts"][0]), len(setup["prompts"][0]) + 5, len(setup["prompts"][0]) + 8):
        proposer.observe(aux[start:end], seq[start + 1 : end + 1], start)
        start = end
        cached = proposer.propose(seq[: end + 1]).tokens
        one_shot = drafter.draft_block(aux[None, :end], torch.tensor([end]), torch.tensor([seq[end]]))[0].tolist()
        assert cached == one_shot and len(cached) == BLOCK - 1


def test_dflash_decoding_is_lossless(setup):
    """Every prompt decodes to the greedy reference token for token; each round drafts K-1 tokens and commits
    accepted + 1 of them, MAX_NEW tokens in all."""
    proposer = DFlashProposer(setup["drafter"])
    for prompt, ref in zip(setup["prompts"], setup["refs"]):
        out = speculative_decode(setup["target"], proposer, prompt, MAX_NEW)
        assert check_lossless(ref, out.tokens, 1e-3).kind == "identical"
        assert all(s.draft_depth == BLOCK - 1 and s.committed <= s.accepted + 1 for s in out.steps)
        assert 1 + sum(s.committed for s in out.steps) == len(ref.tokens) == MAX_NEW


def test_broken_verification_is_caught(setup, monkeypatch):
    """With a verification that accepts every draft, the DFlash output leaves the greedy reference and the lossless
    check reports a mismatch: the lossless result above depends on the verification."""

    def accept_all(tree, greedy):
        return list(range(len(tree.tokens))), greedy[len(tree.tokens)]

    monkeypatch.setattr(speculate, "accept_path", accept_all)
    proposer = DFlashProposer(setup["drafter"])
    kinds = [
        check_lossless(ref, speculative_decode(setup["target"], proposer, prompt, MAX_NEW).tokens, 1e-3).kind
        for prompt, ref in zip(setup["prompts"], setup["refs"])
    ]
    assert "mismatch" in kinds, kinds


def test_propose_refuses_an_unobserved_context(setup):
    """A block needs the states of every token before its anchor: proposing past what was observed is an error."""
    proposer = DFlashProposer(setup["drafter"])
    with pytest.raises(RuntimeError, match="observed"):
        proposer.propose(setup["prompts"][0])


@pytest.fixture(scope="module")
def dflash_run(tmp_path_factory):
    """A tiny target run with a random DFlash drafter exported in SGLang's DFlash layout (float32)."""
    from eagle3.export.dflash import export_dflash
    from eagle3.target.load import prepare_target
    from eagle3.train.dflash import dflash_setup

    workdir = tmp_path_factory.mktemp("dflash-eval")
    cfg = load_config(
        "tiny",
        [
            f"run.workdir={workdir}",
            "evaluate.num_prompts=2",
            "evaluate.max_new_tokens=12",
            "evaluate.methods=[chain,tree,ngram]",
            "evaluate.device=cpu",
            "evaluate.datasets=[mtbench,gsm8k]",
            "drafter.family=dflash",
            f"drafter.dflash.block_size={BLOCK}",
        ],
    )
    model_dir = prepare_target(cfg)
    setup = dflash_setup(cfg, model_dir, AUX_IDS)
    drafter = DFlashDrafter(setup.dims)
    init_dflash_weights(drafter, std=0.2)
    export_dir = export_dflash(
        export_state_dict(drafter),
        setup.dims,
        setup.target_layer_ids,
        setup.num_target_layers,
        workdir / "dflash-export",
        torch.float32,
    )
    return cfg, export_dir


def test_stage_measures_a_dflash_export_losslessly(dflash_run):
    """eagle3 eval on a DFlash export: one block method (dflash-3-1-4, in place of chain and tree) and n-gram per
    dataset, every prompt identical to greedy, acceptance reported like the chains'; no teacher-forced record."""
    from eagle3.evaluate.stage import run_evaluate

    cfg, export_dir = dflash_run
    run_evaluate(cfg, export_dir=export_dir)
    doc = json.loads((cfg.run_dir / "eval" / "results.json").read_text())
    rows = {(r["dataset"], r["method"]): r for r in doc["results"]}
    assert set(rows) == {(d, m) for d in ("mtbench", "gsm8k", "all") for m in ("dflash-3-1-4", "ngram")}
    for row in rows.values():
        assert row["lossless"]["identical"] == row["num_prompts"] and row["lossless"]["mismatch"] == 0, row
        assert row["accept_len"] >= 1.0 and len(row["per_position"]) <= BLOCK - 1
    assert doc["settings"]["aux_layer_ids"] == AUX_IDS
    assert [m["name"] for m in doc["settings"]["methods"]] == ["dflash-3-1-4", "ngram"]
    prompts = [json.loads(line) for line in (cfg.run_dir / "eval" / "prompts.jsonl").read_text().splitlines()]
    assert len(prompts) == 4 and all("teacher_forced" not in p for p in prompts)


def test_fixed_size_cache_drafts_what_the_growing_cache_drafts(setup, monkeypatch):
    """StaticDFlashProposer (one fixed-shape block call over the whole cache, later entries hidden) drafts what
    DFlashProposer drafts at every round of every prompt, also across cache growth (8-entry steps here), so the
    decodes commit the same tokens round by round."""
    from eagle3.evaluate import decode_cache
    from eagle3.evaluate.dflash_static import StaticDFlashProposer

    monkeypatch.setattr(decode_cache, "CAPACITY_STEP", 8)
    growing, fixed = DFlashProposer(setup["drafter"]), StaticDFlashProposer(setup["drafter"], capacity=8)
    for prompt, ref in zip(setup["prompts"], setup["refs"]):
        a = speculative_decode(setup["target"], growing, prompt, MAX_NEW)
        b = speculative_decode(setup["target"], fixed, prompt, MAX_NEW)
        assert a.tokens == b.tokens == ref.tokens
        assert [(s.accepted, s.committed) for s in a.steps] == [(s.accepted, s.committed) for s in b.steps]
    assert fixed.capacity > 8 and fixed.capacity % 8 == 0  # it grew


def test_stage_with_the_static_cache_drafts_through_the_fixed_size_cache(dflash_run, monkeypatch):
    """With evaluate.static_cache=on the evaluation's DFlash method drafts every round through
    StaticDFlashProposer and stays lossless."""
    from eagle3.evaluate.dflash_static import StaticDFlashProposer
    from eagle3.evaluate.stage import run_evaluate

    calls = []
    propose = StaticDFlashProposer.propose
    monkeypatch.setattr(StaticDFlashProposer, "propose", lambda self, ctx: calls.append(1) or propose(self, ctx))
    cfg, export_dir = dflash_run
    cfg = cfg.model_copy(update={"evaluate": cfg.evaluate.model_copy(update={"static_cache": "on", "num_workers": 1})})
    run_evaluate(cfg, export_dir=export_dir)
    assert len(calls) >= 4  # at least a round per prompt
    doc = json.loads((cfg.run_dir / "eval" / "results.json").read_text())
    rows = [r for r in doc["results"] if r["method"] == "dflash-3-1-4"]
    assert rows and all(r["lossless"]["identical"] == r["num_prompts"] for r in rows)
