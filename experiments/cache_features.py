"""Write the feature cache of a frozen base: its outputs over the training corpus, once, for every drafter.

    python -m experiments.cache_features base_checkpoint=outputs/reference/base_small/checkpoint
    python -m experiments.cache_features base_checkpoint=... layers=[2,5]            # for a fused prophet
    python -m experiments.cache_features base_checkpoint=... features.source=greedy features.windows=2000
    python -m experiments.cache_features base=smollm2 features.source=generated features.questions=mix  # + its own

train_drafter writes the same cache on first use (same spec, same directory); this command does it up
front, with a size estimate before it starts and its progress as it goes (a bar on a terminal; in a job's log a line
every 30 s with the windows done, the rate and the time left: experiments/lib/common/progress.py), and resumes an
interrupted run.
"""

from __future__ import annotations

import json
import logging
import sys
import time

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from experiments.lib.cli.preflight import hydra_preflight
from experiments.lib.common.errors import exit_on_user_error
from experiments.lib.data.pipeline import base_data_config, prepare_data
from experiments.lib.store.checkpoint import load_lm, tokenizer_mismatch
from experiments.lib.training.features import check_features_config, default_seq_len, feature_spec, open_features
from experiments.lib.training.generated import generated_windows
from experiments.lib.training.settings import resolve_device

log = logging.getLogger(__name__)


def run(cfg: DictConfig) -> dict:
    """Write (or reuse) the cache; return where it is and what it holds."""
    features = OmegaConf.to_container(cfg.features, resolve=True)
    check_features_config(features)
    if OmegaConf.is_missing(cfg, "base_checkpoint") or cfg.base_checkpoint is None:
        raise ValueError("base_checkpoint is required: the directory of a trained base (experiments.train_base)")
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    base, tokenizer, base_meta = load_lm(cfg.base_checkpoint, device=str(resolve_device(cfg.device)))
    seq_len = default_seq_len(cfg.seq_len, base.max_seq_len)
    if not 2 <= seq_len <= base.max_seq_len:
        raise ValueError(f"seq_len={seq_len}: must lie in [2, the base's context {base.max_seq_len}]")
    data = prepare_data(**base_data_config(base_meta, OmegaConf.to_container(cfg.data, resolve=True)))
    if data.tokenizer.to_str() != tokenizer.to_str():
        raise ValueError(tokenizer_mismatch("the data config", data.tokenizer, tokenizer, "use the base's data config"))
    spec = feature_spec(
        features, base_meta=base_meta, data=data, seq_len=seq_len, layers=tuple(cfg.layers or ()),
        device=next(base.parameters()).device,
    )  # fmt: skip
    started = time.perf_counter()
    answered = None
    if spec.source == "generated":
        answered = generated_windows(
            spec, base, tokenizer, base_meta, root=features["answers_root"], max_new_tokens=spec.answer_tokens,
            batch=features["answer_batch"], shipped=features["answers_shipped"],
        )  # fmt: skip
    cache = open_features(  # mapped: written, not read here
        base, data.train_ids, spec, answered=answered, directory=features["dir"], root=features["root"], mapped=True
    )
    seconds = time.perf_counter() - started
    positions = spec.windows * spec.seq_len
    return {
        "directory": str(cache.directory),
        "key": spec.key(),
        "windows": spec.windows,
        "positions": positions,
        "seconds": round(seconds, 1),
        "positions_per_s": positions / seconds if seconds > 1 else None,
    }


@hydra_preflight
@hydra.main(version_base="1.3", config_path="../conf", config_name="cache_features")
@exit_on_user_error
def main(cfg: DictConfig) -> None:
    print(json.dumps(run(cfg)), file=sys.stdout)


if __name__ == "__main__":
    main()
