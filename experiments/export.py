"""Export a trained drafter to a directory vLLM serves: speculators' EAGLE-3, vLLM's EAGLE and Medusa, a Hugging
Face Llama draft model (experiments/lib/store/formats.py says what each holds and what it refuses).

    python -m experiments.export checkpoint=outputs/<run>/checkpoint out=exports/prophet_eagle3

The drafter is rebuilt on its own base (the checkpoint's base_checkpoint), converted, written atomically, and
read back by this project's importer (experiments/lib/families/imported.py), whose first draft tokens on a
probe sequence must equal the original's: an export that would draft otherwise is never left behind.
conf/export.yaml lists the settings.
"""

from __future__ import annotations

import logging
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from experiments.lib.cli.preflight import hydra_preflight
from experiments.lib.common.errors import exit_on_user_error
from experiments.lib.families.imported import import_prophet
from experiments.lib.families.registry import load_drafter
from experiments.lib.store.checkpoint import load_lm, read_meta
from experiments.lib.store.formats import (
    FORMATS,
    FormatError,
    eagle3_config,
    eagle3_tensors,
    eagle_tensors,
    layer_config,
    llama_config,
    medusa_tensors,
    outside_zeroed,
)
from experiments.lib.store.served_dir import MARK, check_out, write_directory
from prophet.model import base_features

log = logging.getLogger(__name__)


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
    if fmt == "eagle3":
        tensors = eagle3_tensors(module, vocab)
        draft_vocab = tensors["lm_head.weight"].shape[0]
        config = eagle3_config(module, base, verifier=verifier, draft_vocab=draft_vocab, tokens=cfg.speculative_tokens)
    elif fmt == "eagle":
        tensors, config = eagle_tensors(module), layer_config(base, module.decoder)
    elif fmt == "medusa":
        tensors, config = medusa_tensors(module, base, vocab)
    else:
        return write_draft_model(module, out, vocab=vocab, overwrite=cfg.overwrite, provenance=provenance, keep=keep)

    def check(tmp: Path) -> None:  # the prophet formats read back as this project reads them, before renaming
        if fmt in ("eagle3", "eagle"):
            check_round_trip(module, import_prophet(tmp, base), base, vocab, out)

    out = write_directory(out, config | provenance, tensors, overwrite=cfg.overwrite, keep=keep, check=check)
    log.info("wrote %s (%s, %d tensors) for verifier %s", out, fmt, len(tensors), verifier)
    print(f"exported {fmt}: {out}")
    return out


def write_draft_model(
    module: torch.nn.Module,
    out: str,
    *,
    vocab: torch.Tensor | None = None,
    overwrite: bool = False,
    provenance: dict | None = None,
    keep: tuple = (),
) -> Path:
    """A draft model built as a Hugging Face Llama (drafter.module.arch=llama) -> save_pretrained's layout; the
    output rows outside `vocab` (the ids it was trained to draft from) zeroed (formats.outside_zeroed)."""
    hf = getattr(module, "hf", None)
    if hf is None or type(hf).__name__ != "LlamaForCausalLM":
        raise FormatError(
            "the draft model is an x-transformers network (LayerNorm, GELU), not a Llama: train it with "
            "drafter.module.arch=llama to export it"
        )
    config = hf.config.to_dict() | {"architectures": ["LlamaForCausalLM"], "torch_dtype": "float32"}
    tensors = dict(hf.state_dict())
    tensors["lm_head.weight"] = outside_zeroed(tensors["lm_head.weight"], vocab)
    return write_directory(out, config | (provenance or {}), tensors, overwrite=overwrite, keep=keep)


@torch.no_grad()
def check_round_trip(original, imported, base, vocab: torch.Tensor | None, out: Path) -> None:
    """The imported prophet's logits equal the original's, bit for bit, on a probe sequence (the first draft at
    every position); else the export is refused (write_directory runs this on the directory before it is renamed
    to `out`, so nothing is left and an earlier export stays)."""
    tokens = torch.arange(24, device=base.to_logits.weight.device)[None] % base.num_tokens
    logits = []
    for prophet in (original, imported):  # each with its layers in its own order (an export sorts them)
        hidden, _, layers = base_features(base, tokens, prophet.fuse_layers)
        _, weight, bias = prophet.output_layer(vocab)
        logits.append(torch.nn.functional.linear(prophet.readout(prophet(hidden, tokens, layers)), weight, bias))
    if not torch.equal(*logits):
        raise FormatError(f"{out} read back with other logits than the drafter's: not written")


@hydra_preflight
@hydra.main(version_base="1.3", config_path="../conf", config_name="export")
@exit_on_user_error
def main(cfg: DictConfig) -> None:
    export(cfg)


if __name__ == "__main__":
    main()
