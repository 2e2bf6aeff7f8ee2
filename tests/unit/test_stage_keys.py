"""Every stage's key is pinned: a refactoring that changes one makes every existing run redo that stage.

The run directory is built by hand so that the keys depend only on how each stage computes its key: the target's
fingerprint is fixed (a tiny target's random weights differ between torch versions), every input manifest names
one file of fixed content, and the chat source is a relative path (an absolute one would put the checkout's place
into the merge key). The golden values were computed by the code as it was before the stages moved into their
own modules.
"""

from __future__ import annotations

import pytest

from eagle3.config import load_config
from eagle3.run.layout import run_layout
from eagle3.run.registry import STAGES, get_stage
from eagle3.run.stage import write_manifest

FINGERPRINT = "0123456789abcdef"
CHATS = '{"id": "c0", "messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]}\n'

GOLDEN: dict[str, dict[str, str]] = {
    "tiny": {
        "synthesize": "5a23e5dff454cfeaa02d33ad789c74623d23b0d7e4486e478713834c6ebfb1a5",
        "merge": "4087398b4eb498043b519f1e65004f00d8fb6adb675ebee88857888e6a212dbb",
        "regenerate": "5687914650cf9b19ae403e6b7a76400c51d82aba43ee1b3c8754db98d1cf79d0",
        "tokenize": "7d3d3f17afe1a995832329ab1f9809250847e2ef7840d512b08976c7c6208e42",
        "vocab": "279a2ef931c7df0fa20aa78d4ed0bb98aaeac5562037a81df48af8865fa53019",
        "capture": "733716eb9813c90ff2bb3ba26fb489c059dfc0da1c361b5900313ef88d667621",
        "train": "4ebedc1b232ad03586f48a571900321b821bca95d1fb8e5fe4fe9f6855329240",
        "export": "3f08922739a9e424f7c98fac7082b10d60a8e68b840a084c6ef0d9d45ecb78ab",
        "evaluate": "4aa6b8509dd24bd4bf39abde4c385f52c0d5ea17595a4dc70bf6b1e298f1e77c",
    },
    "regenerate": {
        "synthesize": "5a23e5dff454cfeaa02d33ad789c74623d23b0d7e4486e478713834c6ebfb1a5",
        "merge": "4087398b4eb498043b519f1e65004f00d8fb6adb675ebee88857888e6a212dbb",
        "regenerate": "824cef1f7447e0ae42fff373bb32425c06e7510b9a14bc41ab68d597686b8a26",
        "tokenize": "19e77f7083c6f551584b80ca6488445555441b9ecc0d5e70de39dc303ec5f021",
        "vocab": "279a2ef931c7df0fa20aa78d4ed0bb98aaeac5562037a81df48af8865fa53019",
        "capture": "733716eb9813c90ff2bb3ba26fb489c059dfc0da1c361b5900313ef88d667621",
        "train": "4ebedc1b232ad03586f48a571900321b821bca95d1fb8e5fe4fe9f6855329240",
        "export": "3f08922739a9e424f7c98fac7082b10d60a8e68b840a084c6ef0d9d45ecb78ab",
        "evaluate": "4aa6b8509dd24bd4bf39abde4c385f52c0d5ea17595a4dc70bf6b1e298f1e77c",
    },
    "online": {
        "synthesize": "5a23e5dff454cfeaa02d33ad789c74623d23b0d7e4486e478713834c6ebfb1a5",
        "merge": "4087398b4eb498043b519f1e65004f00d8fb6adb675ebee88857888e6a212dbb",
        "regenerate": "5687914650cf9b19ae403e6b7a76400c51d82aba43ee1b3c8754db98d1cf79d0",
        "tokenize": "7d3d3f17afe1a995832329ab1f9809250847e2ef7840d512b08976c7c6208e42",
        "vocab": "279a2ef931c7df0fa20aa78d4ed0bb98aaeac5562037a81df48af8865fa53019",
        "capture": "733716eb9813c90ff2bb3ba26fb489c059dfc0da1c361b5900313ef88d667621",
        "train": "1c825d2b56dd34ef3413d47f9a0d5dce33f70a03cff393a7d2a5feb8032b3c27",
        "export": "83a2494b3f4ca6d986b4d49592b0ad5fe6e7e10aef524f41206d48cb298c8c99",
        "evaluate": "4aa6b8509dd24bd4bf39abde4c385f52c0d5ea17595a4dc70bf6b1e298f1e77c",
    },
    "synthetic": {
        "synthesize": "c35b8e974d53aa589d9c32a200ec116e1492c8ecba4647fb48d448bc810ab14f",
        "merge": "902a741ca395d0fbb3a8ce585ff4a94d99bef2fd90b93b92e5c0c4f9727536ed",
        "regenerate": "5687914650cf9b19ae403e6b7a76400c51d82aba43ee1b3c8754db98d1cf79d0",
        "tokenize": "7d3d3f17afe1a995832329ab1f9809250847e2ef7840d512b08976c7c6208e42",
        "vocab": "279a2ef931c7df0fa20aa78d4ed0bb98aaeac5562037a81df48af8865fa53019",
        "capture": "733716eb9813c90ff2bb3ba26fb489c059dfc0da1c361b5900313ef88d667621",
        "train": "4ebedc1b232ad03586f48a571900321b821bca95d1fb8e5fe4fe9f6855329240",
        "export": "3f08922739a9e424f7c98fac7082b10d60a8e68b840a084c6ef0d9d45ecb78ab",
        "evaluate": "4aa6b8509dd24bd4bf39abde4c385f52c0d5ea17595a4dc70bf6b1e298f1e77c",
    },
}
"""{variant: {stage: key}} as the code before the change computed them."""

VARIANTS: dict[str, list[str]] = {
    "tiny": [],
    "regenerate": ["regenerate.enabled=true", "regenerate.backend=hf"],
    "online": ["train.features=online", "export.formats=[sglang]"],
    "synthetic": ["data.sources=[{name: chats, path: chats.jsonl}, {name: made, format: synthetic}]"],
}


def _run_dir(tmp_path, monkeypatch, overrides: list[str]):
    """A tiny run whose every stage has a manifest over a fixed file, and the files the train key reads."""
    import eagle3.target.load as target_load
    from eagle3.data.vocab import MAP_FILE
    from eagle3.features.run_spec import build_spec
    from eagle3.target.load import prepare_target, target_info

    monkeypatch.setattr(target_load, "fingerprint", lambda model_dir: FINGERPRINT)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "chats.jsonl").write_text(CHATS)
    cfg = load_config("tiny", [f"run.workdir={tmp_path / 'runs'}", "data.sources.0.path=chats.jsonl", *overrides])
    layout = run_layout(cfg)
    model_dir = prepare_target(cfg)
    info = target_info(model_dir, cfg.target)
    spec = build_spec(cfg, model_dir)
    layout.features.mkdir(parents=True)
    spec.save(layout.spec)
    layout.vocab.mkdir(parents=True)
    _save_vocab(layout.vocab / MAP_FILE, info.vocab_size, cfg.vocab.draft_vocab_size)
    for stage in STAGES:
        manifest = stage.manifest(layout.root)
        manifest.parent.mkdir(parents=True, exist_ok=True)
        out = manifest.parent / f"{stage.name}.golden"
        out.write_text(f"the output of {stage.name}\n")
        write_manifest(manifest, stage.name, f"golden-{stage.name}", {"out": out}, {})
    return cfg


def _save_vocab(path, vocab_size: int, draft: int) -> None:
    """A valid vocab map over the first ``draft`` target ids (d2t all zeros)."""
    import torch
    from safetensors.torch import save_file

    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[:draft] = True
    save_file({"d2t": torch.zeros(draft, dtype=torch.int64), "t2d": t2d}, str(path))


def stage_keys(tmp_path, monkeypatch, overrides: list[str]) -> dict[str, str]:
    """{stage: key} of every stage in the registry."""
    cfg = _run_dir(tmp_path, monkeypatch, overrides)
    return {stage.name: get_stage(stage.name).key(cfg) for stage in STAGES}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_stage_keys_match_the_keys_existing_runs_were_written_with(tmp_path, monkeypatch, variant):
    """Each stage's key of a fixed run directory equals the golden value (a changed key reruns the stage)."""
    keys = stage_keys(tmp_path, monkeypatch, VARIANTS[variant])
    assert {k: v for k, v in keys.items() if k in GOLDEN[variant]} == GOLDEN[variant]
