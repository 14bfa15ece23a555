"""Export a trained drafter to a directory vLLM serves: speculators' EAGLE-3, vLLM's EAGLE and Medusa, a Hugging
Face Llama draft model (experiments/lib/formats/, a module per format, says what each holds and what it refuses).

    python -m experiments.export checkpoint=outputs/<run>/checkpoint out=exports/prophet_eagle3

The drafter is rebuilt on its own base (the checkpoint's base_checkpoint), converted, written into a temporary
directory beside out=, read back by its format's reader (every format: EAGLE-3, EAGLE, Medusa, the draft model),
whose logits on a probe sequence must equal the original's bit for bit, and only then renamed into place: an
export that would draft otherwise is never left behind. out='s lock is held from before the base loads, so a
second export to the same out= is refused in one line, and nothing that appears at out= meanwhile is replaced
(experiments/lib/store/served_dir.py). conf/export.yaml lists the settings.
"""

from __future__ import annotations

from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from experiments.lib.cli.preflight import hydra_preflight
from experiments.lib.common.errors import exit_on_user_error
from experiments.lib.families.registry import load_drafter
from experiments.lib.formats.common import FORMATS, llama_config
from experiments.lib.formats.registry import write
from experiments.lib.store.checkpoint import load_lm, read_meta
from experiments.lib.store.served_dir import MARK, FormatError, check_out, claim


def choose_format(package: str, module_config: dict, asked: str) -> str:
    """The format a drafter exports to: `asked`, or from its family and arch; what no format holds is refused."""
    natural = {"medusa": "medusa", "draft": "draft_model"}.get(package)
    if package == "prophet":
        arch = module_config.get("arch", "xtransformers")
        if arch == "xtransformers":
            raise FormatError(
                "the prophet is an x-transformers network, which no serving format holds: train it with "
                "drafter.module.arch=eagle3 (or eagle)"
            )
        natural = arch
    if natural is None:
        raise FormatError(f"a {package} drafter has no serving format: export prophet (eagle3/eagle), medusa or draft")
    if asked not in ("auto", natural):
        raise FormatError(f"format={asked}: a {package} drafter exports to {natural}")
    return natural


def check_vocab_fits(fmt: str, vocab: torch.Tensor | None, allow_full_vocab: bool) -> None:
    """eagle, medusa (a head per position) and draft_model draft from every token in vLLM: a drafter trained to
    draft from fewer would differ there. Only EAGLE-3 carries a draft vocabulary (d2t)."""
    if vocab is not None and fmt != "eagle3" and not allow_full_vocab:
        raise FormatError(
            f"the drafter drafts from {vocab.numel()} tokens, and vLLM's {fmt} drafts from all of them: retrain with "
            "vocab=null, or pass allow_full_vocab=true to export it drafting from every token"
        )


def required_path(cfg: DictConfig, key: str, what: str) -> str:
    """cfg[key] as a non-empty path, else one line naming the key and what it wants."""
    value = None if OmegaConf.is_missing(cfg, key) else cfg[key]
    if value is None:
        raise FormatError(f"{key} is required: give {key}=<{what}>")
    if not isinstance(value, str) or not value.strip():
        raise FormatError(f"{key}={value!r}: give {what}")
    return value


def export(cfg: DictConfig) -> Path:
    checkpoint = required_path(cfg, "checkpoint", "a drafter checkpoint directory (train_drafter's checkpoint/)")
    out = required_path(cfg, "out", "the directory to write the export to")
    if cfg.format not in ("auto", *FORMATS):
        raise FormatError(f"format={cfg.format!r}: must be auto or one of {', '.join(FORMATS)}")
    tokens = cfg.speculative_tokens
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise FormatError(f"speculative_tokens={cfg.speculative_tokens!r}: must be an integer >= 1")
    meta = read_meta(checkpoint)
    if meta.get("kind") != "drafter":
        raise FormatError(f"{checkpoint} is not a drafter checkpoint (kind={meta.get('kind')!r})")
    package, module_config = meta["model_config"]["package"], meta["model_config"]["module"]
    fmt = choose_format(package, module_config, cfg.format)
    ids = meta.get("train_vocab_ids")
    check_vocab_fits(fmt, None if ids is None else torch.tensor(ids), cfg.allow_full_vocab)
    keep = (checkpoint, meta["base_checkpoint"])  # what overwrite=true may never remove
    check_out(out, overwrite=cfg.overwrite, keep=keep)
    with claim(out):  # from before the base loads: a second export to the same out= is refused at once
        return _convert(cfg, checkpoint, out, fmt, meta, keep)


def _convert(cfg: DictConfig, checkpoint: str, out: str, fmt: str, meta: dict, keep: tuple[str, str]) -> Path:
    """Rebuild the drafter on its base and write it to `out` in `fmt` (its lock held)."""
    ids = meta.get("train_vocab_ids")
    base, _, base_meta = load_lm(meta["base_checkpoint"], device=cfg.device)
    llama_config(base)  # a base vLLM cannot load is refused before anything is built
    module, _, meta = load_drafter(cfg.checkpoint, base, base_meta)
    module = module.float()
    vocab = None if ids is None else torch.tensor(ids, device=base.to_logits.weight.device)
    verifier = cfg.verifier or str(Path(meta["base_checkpoint"]).resolve())
    provenance = {
        MARK: {
            "checkpoint": str(Path(checkpoint).resolve()),
            "fingerprint": meta["fingerprint"],
            "base_fingerprint": base_meta["fingerprint"],
        }
    }
    return write(
        fmt,
        module,
        base,
        out,
        vocab=vocab,
        verifier=verifier,
        tokens=cfg.speculative_tokens,
        provenance=provenance,
        overwrite=cfg.overwrite,
        keep=keep,
    )


@hydra_preflight
@hydra.main(version_base="1.3", config_path="../conf", config_name="export")
@exit_on_user_error
def main(cfg: DictConfig) -> None:
    export(cfg)


if __name__ == "__main__":
    main()
