"""The packing loader: document isolation, coverage across ranks, determinism, truncation, noise, resume."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from eagle3.features.shards.reader import ShardReader
from eagle3.train.data import PackedRow, RowLoader, SampleRef, add_aux_noise, collate_row, pack, plan_epoch, read_split
from tests.unit.test_train_helpers import load_run_config, synthetic_run

MAX_TOKENS = 128


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A synthetic run (12 samples of 9..90 tokens, two shards) and its train split."""
    cfg = load_run_config(synthetic_run(tmp_path_factory.mktemp("data")))
    tokenized = cfg.run_dir / "data" / "tokenized.parquet"
    return cfg, read_split(tokenized, "train"), ShardReader(cfg.run_dir / "features")


def _runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """(value, start, stop) of each run of equal values."""
    out, start = [], 0
    for t in range(1, len(ids) + 1):
        if t == len(ids) or ids[t] != ids[start]:
            out.append((ids[start], start, t))
            start = t
    return out


def test_rows_never_mix_documents(run):
    """Each document-id run of a packed row is exactly one sample's tokens; positions restart; padding is inert."""
    _, train, reader = run
    plan = plan_epoch(train, MAX_TOKENS, epoch=0, seed=0, multiple=1, shuffle=True)
    for row in plan.rows:
        batch = collate_row(reader, row, MAX_TOKENS, torch.float32)
        runs = _runs(batch.document_ids[0].tolist())
        assert len(runs) == len(row.samples) + (row.num_tokens < MAX_TOKENS)
        for (_doc, start, stop), ref in zip(runs, row.samples):
            sample = reader.get(ref.sample_id)
            assert torch.equal(batch.input_ids[0, start:stop], sample["input_ids"][: ref.num_tokens].long())
            assert torch.equal(batch.aux[0, start:stop], sample["aux"][: ref.num_tokens].float())
            assert batch.position_ids[0, start:stop].tolist() == list(range(stop - start))
        if row.num_tokens < MAX_TOKENS:
            assert batch.loss_mask[0, row.num_tokens :].sum() == 0


def test_every_train_sample_once_per_epoch_across_ranks(run):
    """Counted rows of all ranks hold each train sample exactly once; repeats pad to equal per-rank counts."""
    _, train, _ = run
    world, accum = 2, 3
    plan = plan_epoch(train, 64, epoch=1, seed=5, multiple=world * accum, shuffle=True)
    per_rank = [plan.rows_for(r, world) for r in range(world)]
    assert len({len(rows) for rows in per_rank}) == 1 and len(per_rank[0]) % accum == 0
    seen = Counter(ref.sample_id for rows in per_rank for row in rows if row.counted for ref in row.samples)
    assert seen == Counter(sid for sid, _ in train)
    assert 0 <= sum(not row.counted for row in plan.rows) < world * accum


def test_plan_is_deterministic_per_seed_and_epoch(run):
    """Same seed and epoch give the same plan; another epoch or seed gives another order."""
    _, train, _ = run
    order = [ref.sample_id for row in plan_epoch(train, MAX_TOKENS, 2, 7, 1, True).rows for ref in row.samples]
    again = [ref.sample_id for row in plan_epoch(train, MAX_TOKENS, 2, 7, 1, True).rows for ref in row.samples]
    other_epoch = [ref.sample_id for row in plan_epoch(train, MAX_TOKENS, 3, 7, 1, True).rows for ref in row.samples]
    other_seed = [ref.sample_id for row in plan_epoch(train, MAX_TOKENS, 2, 8, 1, True).rows for ref in row.samples]
    assert order == again and order != other_epoch and order != other_seed


def test_packing_respects_the_budget_and_keeps_every_token():
    """No row exceeds the token budget, and packing loses no token of samples that fit."""
    samples = [(f"s{i}", n) for i, n in enumerate([30, 50, 20, 64, 1, 33, 60, 7, 64, 12])]
    rows, stats = pack(samples, 64)
    assert all(row.num_tokens <= 64 for row in rows)
    assert stats.num_tokens == sum(n for _, n in samples) and stats.num_truncated == 0
    assert sorted(ref.sample_id for row in rows for ref in row.samples) == sorted(s for s, _ in samples)


def test_overlong_sample_is_truncated_to_the_budget_and_counted(run):
    """A sample longer than a row is cut to the row length; the cut is counted in the stats."""
    _, train, reader = run
    longest = max(train, key=lambda s: s[1])
    rows, stats = pack([longest], 32)
    assert stats.num_truncated == 1 and stats.num_truncated_tokens == longest[1] - 32
    batch = collate_row(reader, rows[0], 32, torch.float32)
    assert torch.equal(batch.input_ids[0], reader.get(longest[0])["input_ids"][:32].long())


def test_val_plan_ignores_the_seed_and_pads_with_uncounted_rows(run):
    """Val is not shuffled (any seed, same plan), holds each val sample once, and pads with uncounted rows."""
    cfg, _, _ = run
    val = read_split(cfg.run_dir / "data" / "tokenized.parquet", "val")
    plan = plan_epoch(val, 48, epoch=0, seed=0, multiple=4, shuffle=False)
    counted = Counter(ref.sample_id for row in plan.rows if row.counted for ref in row.samples)
    assert counted == Counter(sid for sid, _ in val) and len(plan.rows) % 4 == 0
    assert plan.rows == plan_epoch(val, 48, epoch=3, seed=9, multiple=4, shuffle=False).rows


def test_loader_started_mid_epoch_yields_the_remaining_rows(run):
    """A loader started at row k (resume) yields exactly rows k.. of a full pass, in order, with prefetch."""
    cfg, train, _ = run
    rows = plan_epoch(train, 64, 0, 0, 1, True).rows
    full = list(RowLoader(cfg.run_dir / "features", list(rows), 64, torch.float32, depth=2))
    tail = list(RowLoader(cfg.run_dir / "features", list(rows), 64, torch.float32, start=3, depth=0))
    assert [b.noise_seed for b in tail] == [b.noise_seed for b in full[3:]]
    for a, b in zip(tail, full[3:]):
        assert torch.equal(a.batch.input_ids, b.batch.input_ids) and torch.equal(a.batch.aux, b.batch.aux)


def test_a_row_gets_the_same_seed_on_any_rank(run):
    """Each row's noise seed (which also seeds DFlash anchors) follows the row, not the rank: rank r of a 2-rank
    world reads rows r, r + 2, ... with the seeds one process gives them, and no two rows share a seed."""
    cfg, train, _ = run
    rows = plan_epoch(train, 64, 1, 0, 2, True).rows

    def load(part: list[PackedRow]) -> list[int]:
        return [b.noise_seed for b in RowLoader(cfg.run_dir / "features", part, 64, torch.float32, depth=0, epoch=1)]

    one = load(list(rows))
    assert [load(list(rows[r::2])) for r in range(2)] == [one[0::2], one[1::2]]
    assert len(set(one)) == len(rows) > 2


def test_loader_error_surfaces_in_the_training_thread(run):
    """A row whose sample is missing raises in the consumer, not silently in the prefetch thread."""
    cfg, _, _ = run
    rows = [PackedRow((SampleRef("no-such-sample", 4),))]
    with pytest.raises(KeyError, match="no-such-sample"):
        list(RowLoader(cfg.run_dir / "features", rows, 16, torch.float32, depth=2))


@pytest.mark.parametrize("kind", ["uniform", "gaussian"])
def test_aux_noise_is_seeded_and_scaled(kind):
    """Same seed -> same noise; uniform stays within +-scale, gaussian has std ~ scale."""
    aux = torch.zeros(64, 96)
    a, b = add_aux_noise(aux, kind, 0.05, seed=3), add_aux_noise(aux, kind, 0.05, seed=3)
    c = add_aux_noise(aux, kind, 0.05, seed=4)
    assert torch.equal(a, b) and not torch.equal(a, c)
    if kind == "uniform":
        assert a.abs().max() <= 0.05
    else:
        assert abs(a.std().item() - 0.05) < 0.005


def test_no_noise_leaves_features_untouched():
    """aux_noise 'none' returns the features unchanged."""
    aux = torch.randn(4, 6)
    assert add_aux_noise(aux, "none", 0.05, seed=1) is aux
