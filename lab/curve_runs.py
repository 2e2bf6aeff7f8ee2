"""The data-scaling curve's runs (lab/quality_curve.py): a size (a train token budget), a recipe variant of the
sweep, and the config and run directory of each (runs/<name>-N, its data/ and vocab/ linked to the data run's)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lab.curve_report import token_label


@dataclass(frozen=True)
class Size:
    """One point of the curve: its token budget and its run."""

    tokens: int

    @property
    def label(self) -> str:
        """'3M'."""
        return token_label(self.tokens)


@dataclass(frozen=True)
class Variant:
    """A recipe change trained, exported and measured at the largest size, beside that size's own run."""

    label: str
    overrides: tuple[str, ...]
    own_vocab: bool = False  # the draft vocab changes: the run maps its own vocab/ instead of linking the data run's


def sweep_variants(base) -> list[Variant]:
    """The recipe sweep: lr x2, x4 (x2 beat the base) and /2, half and twice the epochs, twice the draft vocab."""
    lr, epochs, vocab = base.train.lr, base.train.num_epochs, base.vocab.draft_vocab_size
    counts = sorted({max(1, epochs // 2), 2 * epochs} - {epochs})
    return [
        *(Variant(label, (f"train.lr={k * lr:g}",)) for label, k in (("lr-x2", 2), ("lr-x4", 4), ("lr-half", 0.5))),
        *(Variant(f"epochs-{n}", (f"train.num_epochs={n}",)) for n in counts),
        Variant(f"vocab-{2 * vocab}", (f"vocab.draft_vocab_size={2 * vocab}",), own_vocab=True),
    ]


def parse_tokens(text: str) -> int:
    """'3M' -> 3_000_000, '500K' -> 500_000, '1.5M', '20000'."""
    text = text.strip().upper()
    scale = {"K": 1_000, "M": 1_000_000}.get(text[-1:], 1)
    try:
        value = float(text[:-1] if scale > 1 else text) * scale
    except ValueError:
        raise SystemExit(f"error: size {text!r} is not a token count like 3M, 500K or 20000") from None
    if value < 1:
        raise SystemExit(f"error: size {text!r} must be at least one token")
    return int(value)


def base_config(preset: str, overrides: list[str]):
    """The run holding the data (runs/<name>)."""
    from eagle3.config import load_config

    return load_config(preset, overrides)


def run_name(base_name: str, size: Size, variant: Variant | None = None) -> str:
    """<name>-N, or <name>-N-<variant> for a recipe variant at size N."""
    return f"{base_name}-{size.label}" + (f"-{variant.label}" if variant else "")


def size_config(preset: str, overrides: list[str], size: Size, with_ngram: bool, variant: Variant | None = None):
    """The run of one size (and recipe variant): same preset, its own name, train.max_train_tokens, the variant's
    overrides, n-gram only where asked."""
    from eagle3.config import load_config

    base = load_config(preset, overrides)
    extra = [
        f"run.name={run_name(base.run.name, size, variant)}",
        f"train.max_train_tokens={size.tokens}",
        *(variant.overrides if variant else ()),
    ]
    if not with_ngram:
        methods = [m for m in base.evaluate.methods if m != "ngram"] or base.evaluate.methods
        extra.append(f"evaluate.methods=[{','.join(methods)}]")
    return load_config(preset, [*overrides, *extra])


def prepare_size_run(base, cfg, parts: tuple[str, ...] = ("data", "vocab")) -> Path:
    """runs/<name>-N with ``parts`` (data/, vocab/) linked to the data run's, and its config.json; returns the
    config path."""
    from eagle3.run.stages import write_run_config

    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    for part in parts:
        link, target = cfg.run_dir / part, base.run_dir.resolve() / part
        if link.is_symlink() and link.resolve() == target:
            continue
        if link.exists() or link.is_symlink():
            raise SystemExit(f"error: {link} exists and is not a link to {target}; remove it to reuse the data run")
        link.symlink_to(target, target_is_directory=True)
    return write_run_config(cfg)
