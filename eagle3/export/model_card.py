"""What an export ships and why: the checkpoint selection and the model card (README.md in each export folder).

Selection (``select_checkpoint``): ``export.checkpoint`` when set; else ``train.select`` -- best = the checkpoint
of the highest validation accept_len_est the train manifest records, measured = the checkpoint of the highest
acceptance measured during training (train.measured), last = the final checkpoint (also what best and measured fall
back to when no validation or measurement ran). The export writes the selection into eagle3_export.json.

The card names the target, the data mix and token counts, the recipe, the selected step with its validation
metrics, the measured acceptance table when the evaluation of this export has run, and the commands that
serve the drafter with SGLang (argv built by infra.sglang_spec, checked against SGLang's parser in tests) and
vLLM. A DFlash export (eagle3_export.json format "dflash", written to the sglang folder) gets the same card with
its own header, recipe and SGLang command (``--speculative-algorithm DFLASH`` with its block size); no vLLM line.
It is rendered from the run directory by ``render_card``; the export stage writes it without the table
and the evaluate stage writes it again with it. It is not one of the export manifest's hashed outputs (config
and weights are), so a rewritten card never makes the export look changed; engines ignore it.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from eagle3.config import RunConfig
from eagle3.run.layout import MERGE_STATS_FILE
from eagle3.run.stage import read_manifest

CARD_FILE = "README.md"
VLLM_DOCS = "https://docs.vllm.ai/en/latest/features/speculative_decoding/eagle/"
MAX_HISTORY = 40
"""Validations listed in the card (the last ones); the train manifest has all."""


# ---------------------------------------------------------------------------------------------- selection


@dataclass(frozen=True)
class Selection:
    """The checkpoint an export ships and why."""

    checkpoint: str  # relative to <run>/train, e.g. checkpoints/step-40
    step: int | None
    rule: str  # best | last | export.checkpoint
    reason: str  # one sentence for people
    accept_len_est: float | None  # its validation estimate (None: not validated at that step)

    def to_json(self) -> dict[str, Any]:
        """JSON-able dict (eagle3_export.json's "selection")."""
        return asdict(self)


def select_checkpoint(select: str, override: str | None, train_stats: dict[str, Any]) -> Selection:
    """The checkpoint to export from the train manifest's stats (see the module docstring)."""
    from eagle3.train.checkpoint import CHECKPOINT_RE

    history = {int(step): value for step, value in train_stats.get("eval_history") or []}
    if override:
        match = CHECKPOINT_RE.match(Path(override).name)
        step = int(match.group(1)) if match else None
        return Selection(
            override,
            step,
            "export.checkpoint",
            f"export.checkpoint is set to {override}",
            history.get(step) if step is not None else None,
        )
    best, final = train_stats.get("best_checkpoint"), train_stats.get("final_checkpoint") or ""
    if select == "best" and best:
        value = train_stats["best_accept_len_est"]
        return Selection(
            best,
            train_stats["best_step"],
            "best",
            f"train.select=best: the highest validation accept_len_est ({value:.4f}) of {len(history)} validations",
            value,
        )
    measured = train_stats.get("best_measured_checkpoint")
    if select == "measured" and measured:
        step, value = train_stats["best_measured_step"], train_stats["best_measured_accept_len"]
        return Selection(
            measured,
            step,
            "measured",
            f"train.select=measured: the highest measured acceptance length "
            f"({value:.4f}) of {len(train_stats.get('measured_history') or [])} measurements during "
            "training",
            history.get(step),
        )
    step = train_stats.get("step")
    missing = "validation (empty val split?)" if select == "best" else "measurement"
    why = (
        "train.select=last: the final checkpoint"
        if select == "last"
        else f"train.select={select}, but the run recorded no {missing}: the final checkpoint"
    )
    return Selection(final, step, "last", why, history.get(step) if step is not None else None)


# --------------------------------------------------------------------------------------------------- card


@dataclass(frozen=True)
class CardInputs:
    """What one export folder's card is rendered from (read by the caller from the run directory)."""

    cfg: RunConfig
    folder: Path  # this export folder
    fmt: str  # sglang | speculators
    sglang_folder: Path | None  # the run's SGLang-layout folder (what SGLang serves), if exported
    model_dir: Path  # the prepared target folder
    info: dict[str, Any]  # this folder's eagle3_export.json
    train_stats: dict[str, Any]  # stats of train/train.manifest.json
    results: dict[str, Any] | None = None  # eval/results.json when it measured this export


def write_card(inputs: CardInputs) -> Path:
    """<folder>/README.md, written atomically."""
    from infra.storage import atomic_write_text

    return atomic_write_text(inputs.folder / CARD_FILE, render_card(inputs))


def render_card(c: CardInputs) -> str:
    """The model card as markdown."""
    sections: list[Callable[[CardInputs], list[str]]] = [
        _header,
        _target,
        _serving,
        _data,
        _recipe,
        _selected,
        _measured,
    ]
    return "\n".join(line for section in sections for line in section(c) + [""]).rstrip() + "\n"


def is_dflash(c: CardInputs) -> bool:
    """A DFlash drafter's folder (SGLang's DFlashDraftModel layout), by what its export recorded."""
    return c.info.get("format") == "dflash"


def _header(c: CardInputs) -> list[str]:
    if is_dflash(c):
        d = c.cfg.drafter.dflash
        return [
            f"# DFlash drafter for `{c.cfg.target.name}`",
            "",
            f"A block-parallel DFlash draft model ({d.num_layers} layer(s), block of {c.info.get('block_size')} "
            f"tokens) trained on hidden states of `{c.cfg.target.name}` (run `{c.cfg.run.name}`), in SGLang's "
            f"`DFlashDraftModel` layout; weights in {c.info.get('dtype')}. Each round it drafts a whole block in "
            "one forward; the target verifies every drafted token, so the target's output never changes.",
        ]
    layout = {
        "sglang": "the official EAGLE-3 layout (`LlamaForCausalLMEagle3`, read by SGLang and vLLM)",
        "speculators": "the speculators layout (`Eagle3Speculator`, read by vLLM)",
    }[c.fmt]
    return [
        f"# EAGLE-3 drafter for `{c.cfg.target.name}`",
        "",
        f"A one-layer EAGLE-3 draft model trained on hidden states of `{c.cfg.target.name}` (run "
        f"`{c.cfg.run.name}`), in {layout}; weights in {c.info.get('dtype')}. It speeds up the target's own "
        "decoding and never changes its output: every drafted token is verified by the target.",
    ]


def _target(c: CardInputs) -> list[str]:
    from eagle3.target.load import fingerprint

    config = read_manifest(c.model_dir / "config.json") or {}
    aux = (c.info.get("aux_layer_ids") or {}).get("output_of_layer") or c.info.get("target_layer_ids")
    return [
        "## Target",
        "",
        f"- name: `{c.cfg.target.name}` ({c.cfg.target.kind})",
        f"- path: `{target_path(c.cfg, c.model_dir)}`",
        f"- fingerprint: `{fingerprint(c.model_dir)}`",
        f"- architecture: `{', '.join(config.get('architectures') or ['?'])}`, "
        f"{config.get('num_hidden_layers')} layers, hidden size {config.get('hidden_size')}, "
        f"vocab {config.get('vocab_size')}",
        f"- hidden states the drafter reads: outputs of layers {aux} (0-based)",
    ]


def target_path(cfg: RunConfig, model_dir: Path) -> str:
    """What a server loads as the target: serve.model_path, else target.path (hf), else the prepared folder."""
    hf_path = cfg.target.path if cfg.target.kind == "hf" else None
    return cfg.serve.model_path or hf_path or str(Path(model_dir).resolve())


def sglang_command(cfg: RunConfig, model_dir: Path, draft: Path) -> str:
    """The SGLang launch command of the target with this drafter (serve.* draft settings; infra.sglang_spec)."""
    from infra.sglang_spec import ServerSpec

    s = cfg.serve
    spec = ServerSpec(
        model_path=target_path(cfg, model_dir),
        mode="speculative",
        draft_model_path=str(draft.resolve()),
        num_steps=s.num_steps,
        topk=s.eagle_topk,
        num_draft_tokens=s.num_draft_tokens,
    )
    return shlex.join(spec.argv())


def dflash_command(cfg: RunConfig, model_dir: Path, draft: Path, block_size: int) -> str:
    """The SGLang launch command of the target with a DFlash drafter of ``block_size`` (infra.sglang_spec)."""
    from infra.sglang_spec import ServerSpec

    spec = ServerSpec(
        model_path=target_path(cfg, model_dir),
        mode="dflash",
        draft_model_path=str(draft.resolve()),
        block_size=block_size,
    )
    return shlex.join(spec.argv())


def vllm_command(cfg: RunConfig, model_dir: Path, draft: Path) -> str:
    """vLLM's serve command with an EAGLE-3 drafter (its --speculative-config keys: method, model,
    num_speculative_tokens; export.speculative_tokens draft tokens)."""
    config = {
        "method": "eagle3",
        "model": str(draft.resolve()),
        "num_speculative_tokens": cfg.export.speculative_tokens,
    }
    return shlex.join(["vllm", "serve", target_path(cfg, model_dir), "--speculative-config", json.dumps(config)])


def _serving(c: CardInputs) -> list[str]:
    if is_dflash(c):
        block = int(c.info["block_size"])
        command = dflash_command(c.cfg, c.model_dir, c.folder, block)
        return [
            "## Serving",
            "",
            f"SGLang (DFLASH: a block of {block - 1} drafts and {block} tokens verified per "
            "round; SGLang runs one step, top-1):",
            "",
            "```bash",
            command,
            "```",
            "",
            "No vLLM command: this pipeline writes no vLLM configuration for a DFlash drafter.",
        ]
    lines = ["## Serving", ""]
    if c.sglang_folder is not None:
        lines += [
            f"SGLang ({c.cfg.serve.num_steps} draft steps, top-k {c.cfg.serve.eagle_topk}, "
            f"{c.cfg.serve.num_draft_tokens} tokens verified per step; the SGLang layout):",
            "",
            "```bash",
            sglang_command(c.cfg, c.model_dir, c.sglang_folder),
            "```",
            "",
        ]
    lines += [
        f"vLLM ({c.cfg.export.speculative_tokens} draft tokens per step; `--speculative-config` as in "
        f"[vLLM's EAGLE docs]({VLLM_DOCS}); not run by this pipeline):",
        "",
        "```bash",
        vllm_command(c.cfg, c.model_dir, c.folder),
        "```",
    ]
    if c.fmt == "speculators":
        lines += [
            "",
            f"The folder's speculators_config names the verifier, so `vllm serve {c.folder.resolve()}` also works.",
        ]
    return lines


def _data(c: CardInputs) -> list[str]:
    from eagle3.data.stages import tokenize
    from eagle3.data.stages import vocab as vocab_stage
    from eagle3.run.layout import run_layout

    merge = read_manifest(run_layout(c.cfg).data / MERGE_STATS_FILE) or {}
    tok = (read_manifest(tokenize.STAGE.manifest(c.cfg.run_dir)) or {}).get("stats", {})
    vocab = (read_manifest(vocab_stage.STAGE.manifest(c.cfg.run_dir)) or {}).get("stats", {})
    lines = ["## Training data", ""]
    sources = merge.get("sources") or {}
    if sources:
        lines += [
            "| source | format | conversations kept | train | val | user+assistant turns |",
            "|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {name} | {s.get('format', '?')} | {_n(s.get('kept'))} | {_n(s.get('train'))} | "
            f"{_n(s.get('val'))} | {_n(s.get('num_turns'))} |"
            for name, s in sources.items()
        ]
        lines.append("")
    r = c.cfg.regenerate
    lines.append(
        f"- answers: regenerated by the target ({r.backend} backend, temperature {r.temperature}, at most "
        f"{r.max_new_tokens} new tokens per turn)"
        if r.enabled
        else "- answers: as written in the sources"
    )
    if tok:
        lines.append(
            f"- tokenized: {_n(tok.get('rows_written'))} conversations, {_n(tok.get('num_tokens'))} tokens, "
            f"{_n(tok.get('num_loss_tokens'))} of them answer tokens trained on"
        )
    if vocab and not is_dflash(c):  # a DFlash drafter reads the target's lm_head: no draft vocabulary
        lines.append(
            f"- draft vocabulary: {_n(vocab.get('draft_vocab_size'))} of {_n(vocab.get('target_vocab_size'))}"
            f" target tokens, covering {vocab.get('coverage', float('nan')):.4f} of the "
            f"{_n(vocab.get('num_train_loss_tokens'))} trained-on tokens of the train split"
        )
    seen = (c.train_stats.get("train") or {}).get("tokens_seen")
    lines.append(f"- tokens seen in training (all epochs): {_n(seen)}")
    return lines


def _recipe(c: CardInputs) -> list[str]:
    d, t, s = c.cfg.drafter, c.cfg.train, c.train_stats
    family: list[tuple[str, Any]] = (
        [
            ("block size (tokens verified per round)", d.dflash.block_size),
            ("draft layers", d.dflash.num_layers),
            ("blocks drawn per packed row", d.dflash.num_blocks),
            ("slot loss decay gamma", d.dflash.loss_decay_gamma or "none (every slot alike)"),
        ]
        if is_dflash(c)
        else [("TTT steps (draft positions trained)", d.ttt_steps), ("step loss decay", d.step_decay)]
    )
    vocab = (
        []
        if is_dflash(c)
        else [("draft vocabulary (configured; clipped to the target's)", c.cfg.vocab.draft_vocab_size)]
    )
    rows = [
        *family,
        ("peak learning rate", f"{t.lr:g} ({t.lr_scaling} scaling)"),
        ("epochs", t.num_epochs),
        ("optimizer steps", f"{s.get('step')} of {s.get('total_steps')}"),
        ("packed rows per step x tokens per row", f"{s.get('rows_per_step')} x {t.tokens_per_row}"),
        *vocab,
        ("features", f"{t.features} (online: the target runs in each training step; offline: captured once)"),
        ("aux noise", t.aux_noise),
        ("seed", c.cfg.run.seed),
    ]
    return ["## Recipe", "", "| setting | value |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)]


def _selected(c: CardInputs) -> list[str]:
    sel = c.info.get("selection") or {}
    lines = ["## Selected checkpoint", "", f"`{sel.get('checkpoint')}` (step {sel.get('step')}): {sel.get('reason')}."]
    history = c.train_stats.get("eval_history") or []
    rec = next(
        (
            e
            for e in [c.train_stats.get("best_eval"), c.train_stats.get("eval")]
            if e and e.get("step") == sel.get("step")
        ),
        None,
    )
    if rec:
        accs = ", ".join(f"acc_{k} {rec[f'acc_{k}']:.3f}" for k in range(32) if f"acc_{k}" in rec)
        lines += [
            "",
            f"Validation at that step (teacher-forced, {rec.get('num_rows')} packed rows): loss "
            f"{rec.get('loss', float('nan')):.4f}, accept_len_est {rec.get('accept_len_est', float('nan')):.3f}; "
            f"{accs}.",
        ]
    if history:
        shown = history[-MAX_HISTORY:]
        lines += [
            "",
            f"Validation accept_len_est by step{'' if shown == history else f' (last {len(shown)})'}: "
            + ", ".join(f"{st}: {v:.3f}" for st, v in shown),
        ]
    return lines


MEASURED_HEADING = "## Measured acceptance"
"""The card's last section: write_measured replaces it alone."""


def write_measured(folder: Path, results: dict[str, Any]) -> Path | None:
    """Replace the measured table of ``folder``'s card with ``results``', the rest of the card as the export wrote it
    (for an evaluation of the run's export on a host without its data, where the whole card cannot be rendered);
    None when the folder has no card, or a card without that section."""
    from infra.storage import atomic_write_text

    card = Path(folder) / CARD_FILE
    text = card.read_text() if card.is_file() else ""
    head, found, _ = text.partition(MEASURED_HEADING)
    if not found:
        return None
    return atomic_write_text(card, head + "\n".join(measured_lines(results)) + "\n")


def _measured(c: CardInputs) -> list[str]:
    return measured_lines(c.results)


def measured_lines(results: dict[str, Any] | None) -> list[str]:
    """The card's measured section: the evaluation's table, or a note that it has not run."""
    if not results:
        return [MEASURED_HEADING, "", "Not measured yet: the evaluate stage writes its table here."]
    settings = results.get("settings", {})
    lines = [
        MEASURED_HEADING,
        "",
        f"Speculative decoding against the target, greedy, {settings.get('max_new_tokens')} new tokens per "
        f"prompt, on {settings.get('device')} ({settings.get('dtype')}); "
        "accept len = tokens per target verify forward, "
        "bonus token included; lossless = outputs token-identical to plain greedy decoding."
        + (
            f" Speeds measured by {settings['num_workers']} processes sharing the device (contention included)."
            if (settings.get("num_workers") or 1) > 1
            else ""
        ),
        "",
        "| dataset | method | prompts | accept len | speedup | lossless |",
        "|---|---|---|---|---|---|",
    ]
    for r in results.get("results", []):
        lossless = r.get("lossless", {})
        lines.append(
            f"| {r.get('dataset')} | {r.get('method')} | {r.get('num_prompts')} | "
            f"{r.get('accept_len', float('nan')):.3f} | {r.get('speedup', float('nan')):.2f}x | "
            f"{lossless.get('identical')}/{r.get('num_prompts')} identical |"
        )
    return lines


def _n(value: Any) -> str:
    return f"{value:,}" if isinstance(value, int) else "?" if value is None else str(value)
