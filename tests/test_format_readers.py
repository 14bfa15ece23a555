"""Every serving format is read back after writing, and every reader refuses what it would not read as written.

An export's directory is read by its format's reader before it is renamed into place, its logits compared with
the drafter's bit for bit (Medusa's and the draft model's as EAGLE's are); a reader meets a config whose sizes
are not its tensors' (refused before anything of that size is built), a tensor missing, unexpected, misshapen
or not finite, each in one line naming the directory. tests/test_formats.py checks what the formats draft.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from experiments.lib.families import draft
from experiments.lib.formats import eagle, eagle3, llama, medusa, registry
from experiments.lib.formats.common import layer_config
from experiments.lib.formats.registry import check_served
from experiments.lib.store.served_dir import FormatError, is_export, read_directory, write_directory
from medusa.heads import MedusaHeads
from prophet.model import Prophet
from tests.test_formats import export_eagle3, randomized
from tests.test_hf import llama as llama_base
from verify.backends.hf import HFBase


@pytest.fixture(scope="module")
def base() -> HFBase:
    return llama_base(layers=4, dim=32)  # 97 tokens, 4 heads over 2 kv heads


def export(fmt: str, module: torch.nn.Module, base: HFBase, out: Path, vocab: torch.Tensor | None = None) -> Path:
    return registry.write(
        fmt, module, base, out, vocab=vocab, verifier="base", tokens=3, provenance={}, overwrite=False, keep=()
    )


def heads(base: HFBase) -> MedusaHeads:
    return randomized(MedusaHeads.from_base(base, num_heads=2, num_layers=1), 7)


def draft_model(base: HFBase) -> HFBase:
    return randomized(draft.build(base, dim=32, depth=1, heads=4, arch="llama", kv_heads=2), 8)


def rewrite(path: Path, *, config: dict | None = None, tensors: dict | None = None, edit=None) -> Path:
    """The directory with its config replaced or edited (a function of the dict), or its tensors replaced."""
    old_config, old_tensors = read_directory(path)
    if edit is not None:
        edit(old_config)
    return write_directory(path, config or old_config, tensors or old_tensors, overwrite=True)


def refused(read, path: Path, fragment: str) -> None:
    with pytest.raises(FormatError) as excinfo:
        read()
    message = str(excinfo.value)
    assert fragment in message and str(path) in message and "\n" not in message, message


# ------------------------------------------------------------------------------------------ read back


@pytest.mark.parametrize("fmt", ["medusa", "draft_model"])
def test_every_export_is_read_back_and_refused_when_it_reads_otherwise(
    base: HFBase, tmp_path: Path, fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    reader, make = {"medusa": (medusa, heads), "draft_model": (llama, draft_model)}[fmt]
    module = make(base)
    assert is_export(export(fmt, module, base, tmp_path / "ok"))
    real, calls = reader.read, []

    def reads_otherwise(*args):
        calls.append(args[0])
        imported = real(*args)
        with torch.no_grad():
            next(imported.parameters()).add_(1e-3)  # a writer or reader that is off by a little
        return imported

    monkeypatch.setattr(reader, "read", reads_otherwise)
    with pytest.raises(FormatError, match="read back with other logits"):
        export(fmt, module, base, tmp_path / "bad")
    assert calls and not (tmp_path / "bad").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok"]  # no temporary directory, no lock left


def test_a_tied_draft_model_is_written_tied_or_untied_as_its_rows_need(tmp_path: Path) -> None:
    """A draft cut from a tied base (as SmolLM2's) exports tied; with a trimmed vocabulary its zeroed rows need an
    lm_head of its own, which a tied config would have vLLM ignore: that export is untied."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    tied = HFBase(transformers.LlamaForCausalLM(config)).eval()
    module = draft.build(tied, init="base", depth=1)
    path = export("draft_model", module, tied, tmp_path / "tied")
    written, tensors = read_directory(path)
    assert written["tie_word_embeddings"] is True and "lm_head.weight" not in tensors
    vocab = torch.arange(0, 97, 2)
    path = export("draft_model", module, tied, tmp_path / "trimmed", vocab)
    written, tensors = read_directory(path)
    assert written["tie_word_embeddings"] is False and not tensors["lm_head.weight"][1::2].any()
    served = transformers.LlamaForCausalLM.from_pretrained(path).eval()
    tokens = torch.arange(12)[None]
    with torch.no_grad():
        assert torch.equal(served(tokens).logits[..., vocab], module(tokens)[..., vocab])


# ------------------------------------------------------------------------------------------ Medusa


@pytest.fixture
def medusa_dir(base: HFBase, tmp_path: Path) -> Path:
    tensors, config = medusa.export_tensors(heads(base), base)
    return write_directory(tmp_path / "m", config, tensors)


def without(tensors: dict, suffix: str) -> dict:
    return {k: v for k, v in tensors.items() if not k.endswith(suffix)}


MEDUSA_FAULTS = [
    ("biases_missing", dict(tensors=lambda t: without(t, ".bias")), "lacks the tensors ['blocks.0.layers.0.bias',"),
    ("bias_misshapen", dict(tensors=lambda t: t | {"blocks.1.layers.0.bias": torch.zeros(1)}), "bias is (1,)"),
    ("unknown", dict(tensors=lambda t: t | {"extra.weight": torch.zeros(2)}), "reader reads: ['extra.weight']"),
    ("nan", dict(tensors=lambda t: t | {"lm_heads.1.weight": t["lm_heads.1.weight"] * torch.nan}), "NaN or inf"),
    ("heads_absent", dict(edit=lambda c: c.update(num_heads=200)), "lacks the tensors ['blocks.2.layers.0.weight'"),
    ("heads_huge", dict(edit=lambda c: c.update(num_heads=10**9)), "num_heads=1000000000 must be a positive integer"),
    ("bias_flag", dict(edit=lambda c: c.update(medusa_fc_bias="yes")), "medusa_fc_bias='yes' must be true or false"),
]


@pytest.mark.parametrize("name, how, fragment", MEDUSA_FAULTS, ids=[f[0] for f in MEDUSA_FAULTS])
def test_the_medusa_reader_refuses_what_it_would_not_read_as_written(
    base: HFBase, medusa_dir: Path, name: str, how: dict, fragment: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    config, tensors = read_directory(medusa_dir)
    rewrite(medusa_dir, tensors=how["tensors"](tensors) if "tensors" in how else None, edit=how.get("edit"))
    monkeypatch.setattr(medusa.MedusaHeads, "from_base", lambda *a, **k: pytest.fail("built before the checks"))
    refused(lambda: medusa.read(medusa_dir, base), medusa_dir, fragment)
    if name not in ("bias_misshapen", "nan"):  # those need the tensors themselves, not their names
        refused(lambda: check_served(medusa_dir, "medusa"), medusa_dir, fragment)


def test_medusa_biases_without_the_flag_are_read_as_vllm_drops_them(base: HFBase, medusa_dir: Path) -> None:
    rewrite(medusa_dir, edit=lambda c: c.pop("medusa_fc_bias"))
    imported = medusa.read(medusa_dir, base)
    assert all(not block.linear.bias.any() for blocks in imported.blocks for block in blocks)


# ------------------------------------------------------------------------------------------ EAGLE, EAGLE-3


def test_an_eagle_layer_whose_sizes_are_not_its_tensors_is_refused_before_it_is_built(
    base: HFBase, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prophet = Prophet.from_base(base, arch="eagle")
    path = write_directory(tmp_path / "e1", layer_config(base, prophet.decoder), eagle.export_tensors(prophet))
    rewrite(path, edit=lambda c: c.update(intermediate_size=10**6))
    monkeypatch.setattr(eagle, "new_prophet", lambda *a, **k: pytest.fail("built before the checks"))
    refused(lambda: eagle.read(path, base), path, "layers.0.mlp.gate_proj.weight is (64, 32), the layer needs")


@pytest.fixture
def eagle3_dir(base: HFBase, tmp_path: Path) -> Path:
    prophet = randomized(Prophet.from_base(base, arch="eagle3", fuse_layers=[1, 2, 3]), 5)
    return export_eagle3(prophet, base, torch.arange(0, 97, 3), tmp_path / "e3")


def test_an_eagle3_tensor_no_reader_reads_is_named(base: HFBase, eagle3_dir: Path) -> None:
    config, tensors = read_directory(eagle3_dir)
    rewrite(eagle3_dir, tensors=tensors | {"layers.1.mlp.up_proj.weight": torch.zeros(2)})
    refused(lambda: eagle3.read(eagle3_dir, base), eagle3_dir, "no EAGLE-3 reader reads: ['layers.1.mlp.up_proj")
    refused(lambda: check_served(eagle3_dir, "prophet"), eagle3_dir, "no EAGLE-3 reader reads: ['layers.1.mlp")


def test_an_eagle3_copy_of_the_embedding_is_read_only_when_it_is_the_bases(base: HFBase, eagle3_dir: Path) -> None:
    config, tensors = read_directory(eagle3_dir)
    embedding = base.hf.model.embed_tokens.weight.detach().clone()
    rewrite(eagle3_dir, tensors=tensors | {"embed_tokens.weight": embedding})  # as SpecForge writes it
    eagle3.read(eagle3_dir, base)
    rewrite(eagle3_dir, tensors=tensors | {"embed_tokens.weight": embedding + 1})
    refused(lambda: eagle3.read(eagle3_dir, base), eagle3_dir, "is not the base's token embedding")


@pytest.mark.parametrize("size", [0, 98, 10**12])
def test_an_eagle3_draft_vocabulary_beyond_the_bases_is_refused(base: HFBase, eagle3_dir: Path, size: int) -> None:
    rewrite(eagle3_dir, edit=lambda c: c.update(draft_vocab_size=size))
    refused(lambda: eagle3.read(eagle3_dir, base), eagle3_dir, f"draft_vocab_size={size} must be an integer from 1")


# ------------------------------------------------------------------------------------------ the draft model


@pytest.fixture
def llama_dir(base: HFBase, tmp_path: Path) -> Path:
    return export("draft_model", draft_model(base), base, tmp_path / "d")


LLAMA_FAULTS = [
    ("missing", dict(tensors=lambda t: without(t, "model.norm.weight")), "lacks the tensors ['model.norm.weight']"),
    ("unexpected", dict(tensors=lambda t: t | {"extra": torch.zeros(1)}), "no Llama of its config has: ['extra']"),
    ("misshapen", dict(tensors=lambda t: t | {"model.norm.weight": torch.ones(31)}), "is (31,), its config needs"),
    ("layers", dict(edit=lambda c: c.update(num_hidden_layers=1000)), "num_hidden_layers=1000, the file holds 1"),
    ("tied", dict(edit=lambda c: c.update(tie_word_embeddings=True)), "lm_head.weight differs from model.embed"),
    ("not_llama", dict(edit=lambda c: c.update(model_type="gpt2")), "model_type='gpt2', a draft model is 'llama'"),
    ("nan", dict(tensors=lambda t: t | {"model.norm.weight": torch.full((32,), torch.inf)}), "32 NaN or infinite"),
]


@pytest.mark.parametrize("name, how, fragment", LLAMA_FAULTS, ids=[f[0] for f in LLAMA_FAULTS])
def test_the_draft_model_reader_refuses_what_it_would_not_read_as_written(
    llama_dir: Path, name: str, how: dict, fragment: str
) -> None:
    config, tensors = read_directory(llama_dir)
    rewrite(llama_dir, tensors=how["tensors"](tensors) if "tensors" in how else None, edit=how.get("edit"))
    refused(lambda: llama.read(llama_dir), llama_dir, fragment)
    assert json.loads((llama_dir / "config.json").read_text())["model_type"]  # the file itself is untouched
