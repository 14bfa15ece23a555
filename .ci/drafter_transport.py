"""Carry drafter checkpoints back from a lent GPU machine, whose returned files are few and small (8 files of
16 MiB at most).

    python .ci/drafter_transport.py pack   outputs/gpu/medusa/checkpoint  packs/medusa.safetensors
    python .ci/drafter_transport.py unpack packs/medusa.safetensors       outputs/gpu/medusa/checkpoint

A drafter trained with a trimmed vocabulary (meta.json's train_vocab_ids) drafts from those rows of its output
projections only, so `pack` keeps just those rows of every [vocabulary, ...] output matrix (Medusa's and the
sequential heads' projections, the draft model's to_logits; never an input embedding), stores every tensor in
bf16 (the drafters decode under bf16 autocast, where a linear layer's weight is cast to bf16 anyway), and
drops the optimizer state. `unpack` writes a checkpoint directory the project loads: the kept rows in place,
zeros in the rows no draft reads, fp32 tensors, the fingerprint of those weights, and meta.json's
"transport" field saying what was done. A medusa checkpoint of 458 MB packs into about 12 MB.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from experiments.lib.store.checkpoint import fingerprint  # noqa: E402

OUTPUT_MATRICES = ("projections.", "to_logits.")  # names of [vocabulary, dim] output layers


def _sliced(name: str, tensor: torch.Tensor, vocab_size: int) -> bool:
    return tensor.dim() == 2 and tensor.shape[0] == vocab_size and name.startswith(OUTPUT_MATRICES)


def pack(directory: Path, out: Path) -> None:
    meta = json.loads((directory / "meta.json").read_text())
    ids = meta.get("train_vocab_ids")
    if ids is None:
        raise SystemExit(f"{directory}: no train_vocab_ids in meta.json: nothing to trim, copy the checkpoint")
    state = load_file(str(directory / "model.safetensors"))
    vocab_size = max(t.shape[0] for t in state.values() if t.dim() == 2)
    rows = torch.tensor(ids, dtype=torch.long)
    packed, sliced = {}, []
    for name, tensor in state.items():
        if _sliced(name, tensor, vocab_size):
            tensor, _ = tensor[rows], sliced.append(name)
        packed[name] = tensor.to(torch.bfloat16).contiguous()
    header = {"meta": json.dumps(meta), "sliced": json.dumps(sliced), "vocab_size": str(vocab_size)}
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(packed, str(out), metadata=header)
    size = out.stat().st_size / 1e6
    print(f"{directory} -> {out}: {len(sliced)} output matrices cut to {len(ids)} rows, {size:.1f} MB")


def unpack(pack_file: Path, directory: Path) -> None:
    with safe_open(str(pack_file), framework="pt") as f:
        header = f.metadata()
    meta, sliced, vocab_size = json.loads(header["meta"]), json.loads(header["sliced"]), int(header["vocab_size"])
    rows = torch.tensor(meta["train_vocab_ids"], dtype=torch.long)
    state = {}
    for name, tensor in load_file(str(pack_file)).items():
        tensor = tensor.float()
        if name in sliced:
            full = torch.zeros(vocab_size, tensor.shape[1])
            full[rows] = tensor
            tensor = full
        state[name] = tensor.contiguous()
    meta |= {
        "fingerprint": fingerprint(state),
        "has_optimizer": False,
        "transport": "bf16-rounded weights; rows outside train_vocab_ids of the output matrices zeroed "
        f"({', '.join(sliced) or 'none'}); optimizer state dropped (.ci/drafter_transport.py)",
    }
    directory.mkdir(parents=True, exist_ok=True)
    save_file(state, str(directory / "model.safetensors"))
    (directory / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"{pack_file} -> {directory}: fingerprint {meta['fingerprint']}")


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] not in ("pack", "unpack"):
        raise SystemExit("usage: drafter_transport.py pack CHECKPOINT_DIR FILE | unpack FILE CHECKPOINT_DIR")
    (pack if sys.argv[1] == "pack" else unpack)(Path(sys.argv[2]), Path(sys.argv[3]))
