"""Hugging Face bases through experiments/: a Llama base trained by train_base, a save_pretrained directory
with its own tokenizer, a drafter trained on it, and the peer benchmark against transformers' generate.

One tiny Llama (dim 32, depth 2, 512-token BPE on 30 stdlib files) is trained once per module."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from experiments import baseline  # noqa: E402
from experiments import peer as peer_mod
from experiments.lib.data.pipeline import prepare_data  # noqa: E402
from experiments.lib.data.tokenizer import load_tokenizer  # noqa: E402
from experiments.lib.store.checkpoint import CheckpointError, load_lm  # noqa: E402
from experiments.lib.store.lm import build_lm  # noqa: E402
from experiments.lib.training import base_trainer, drafter_trainer  # noqa: E402
from tests.test_experiments import DATA, make_cfg  # noqa: E402
from verify.backends.hf import HFBase  # noqa: E402

LLAMA = [
    "base=llama_small",
    "base.dim=32",
    "base.depth=2",
    "base.heads=2",
    "base.kv_heads=1",
    *DATA,
    "logger=none",
    "max_steps=6",
    "optim.warmup_steps=1",
    "batch_size=4",
    "seq_len=64",
    "eval_blocks=2",
    "eval_every=6",
    "checkpoint_every=6",
]
pytestmark = pytest.mark.usefixtures("one_thread")
PEER = [
    "prompts.num_prompts=2",
    "prompts.prompt_len=8",
    "max_new_tokens=8",
    "repeats=1",
    "batch_sizes=[1,2]",
    "threads=1",
    "ours=[{engine:lean,compile:false},{engine:hf,compile:false}]",
]  # eager: compiling is for the real run


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("data_cache"))


@pytest.fixture(scope="module")
def llama_base(tmp_path_factory, cache_dir) -> Path:
    out_dir = tmp_path_factory.mktemp("llama")
    result = base_trainer.train(make_cfg("train_base", *LLAMA, f"data.cache_dir={cache_dir}", f"out_dir={out_dir}"))
    return Path(result["checkpoint"])


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, llama_base) -> Path:
    """The trained base as a user's own model: save_pretrained + tokenizer.json + tokenizer_config.json."""
    directory = tmp_path_factory.mktemp("hf_model")
    base, _, _ = load_lm(llama_base)
    base.hf.save_pretrained(directory)
    shutil.copy(llama_base / "tokenizer.json", directory / "tokenizer.json")
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return directory


def test_a_llama_base_trains_and_reloads_as_an_hf_base(llama_base):
    base, tokenizer, meta = load_lm(llama_base)
    assert isinstance(base, HFBase) and type(base.hf).__name__ == "LlamaForCausalLM"
    assert meta["model_config"]["arch"] == "llama" and meta["model_config"]["kv_heads"] == 1
    assert base.hf.config.num_key_value_heads == 1 and base.depth == 2
    again, _, _ = load_lm(llama_base)
    tokens = torch.tensor([tokenizer.encode("def f(x):\n    return x").ids])
    torch.testing.assert_close(base(tokens), again(tokens))


def test_a_save_pretrained_directory_loads_with_its_own_tokenizer(llama_base, hf_dir, cache_dir):
    ours, tokenizer, _ = load_lm(llama_base)
    theirs, their_tokenizer, meta = load_lm(hf_dir)
    assert their_tokenizer.to_str() == tokenizer.to_str()
    assert meta["data"]["tokenizer_path"] == str(hf_dir.resolve()) and meta["data"]["eos_id"] == tokenizer.token_to_id(
        "<|endoftext|>"
    )
    tokens = torch.tensor([[5, 6, 7, 8]])
    torch.testing.assert_close(ours(tokens), theirs(tokens))
    # The corpus tokenized with the model's tokenizer equals the corpus the base was trained on.
    own = prepare_data(max_files=30, tokenizer=str(hf_dir), cache_dir=cache_dir)
    trained = prepare_data(max_files=30, vocab_size=512, cache_dir=cache_dir)
    assert torch.equal(own.train_ids, trained.train_ids) and own.eos_id == trained.eos_id


def drafter_on(base: Path, family: str, cache_dir: str, out_dir: Path, *overrides: str):
    return make_cfg(
        "train_drafter",
        f"drafter={family}",
        f"base_checkpoint={base}",
        *DATA,
        "logger=none",
        "max_steps=2",
        "eval_every=2",
        "eval_blocks=2",
        "batch_size=2",
        "seq_len=32",
        "optim.warmup_steps=1",
        "features.use=false",
        f"data.cache_dir={cache_dir}",
        f"out_dir={out_dir}",
        *overrides,
    )


@pytest.mark.parametrize(
    "family, overrides",
    [
        ("medusa", []),
        ("sequential", []),
        ("prophet", ["drafter.module.dim=32", "drafter.module.heads=2", "drafter.module.fuse_layers=[1]"]),
        ("draft", ["drafter.module.dim=32", "drafter.module.depth=1", "drafter.module.heads=2"]),
        ("early_exit", ["drafter.module.layer=1"]),  # a Llama: its first block's states, on the lean Llama engine
    ],
)
def test_every_drafter_family_trains_on_an_hf_directory_base(family, overrides, hf_dir, cache_dir, tmp_path):
    result = drafter_trainer.train(drafter_on(hf_dir, family, cache_dir, tmp_path, *overrides))
    assert result["step"] == 2 and Path(result["checkpoint"]).is_dir()


def test_peer_benchmark_end_to_end(llama_base, hf_dir, cache_dir, tmp_path):
    """Ours and transformers' on the same weights: every contender emits transformers' greedy tokens; at
    batch 2 only transformers' plain generate runs beside ours."""
    cfg = make_cfg(
        "peer",
        f"checkpoints.base={llama_base}",
        f"checkpoints.assistant={hf_dir}",
        *PEER,
        f"data.cache_dir={cache_dir}",
        f"out_dir={tmp_path}",
    )
    out = peer_mod.peer(cfg)
    result = json.loads((tmp_path / "results.json").read_text())
    names = {(r["batch_size"], r["name"]) for r in result["rows"]}
    assert {
        (1, "transformers/draft/same_gamma"),
        (1, "transformers/draft/defaults"),
        (1, "ours[lean]/draft"),
        (1, "ours[hf]/draft"),
        (1, "transformers/prompt_lookup/defaults"),
        (2, "ours[lean]/draft"),
        (2, "transformers/plain/defaults"),
    } <= names
    assert not any(b == 2 and n.startswith("transformers/") and "plain" not in n for b, n in names)
    assert all(r["identical"] for r in result["rows"])
    # The assistant is the base itself: every draft token is accepted, on both sides.
    draft = {r["name"]: r["tau"] for r in result["rows"] if r["batch_size"] == 1 and r["pair"] == "draft"}
    assert min(draft["ours[lean]/draft"], draft["ours[hf]/draft"], draft["transformers/draft/same_gamma"]) > 1.5
    assert all(1.0 <= r["tau"] <= 5.0 for r in result["rows"])  # at most gamma + 1 tokens per target forward
    assert all(r["tau"] == 1.0 for r in result["rows"] if r["pair"] == "plain")
    assert {(s["ours"], s["batch_size"]) for s in out["summary"]} == {
        (f"ours[{e}]/{p}", b) for e in ("lean", "hf") for p in peer_mod.PAIRS for b in (1, 2)
    }
    assert "| 1 | ours[lean]/plain |" in (tmp_path / "results.md").read_text()


@pytest.mark.parametrize(
    "override, match",
    [
        ("gamma=0", r"gamma=0: must be an integer >= 1"),
        ("batch_sizes=[]", r"batch_sizes=\[\]: must be a non-empty list"),
        ("max_new_tokens=true", r"max_new_tokens=True: must be an integer >= 1"),
        ("prompt_lookup.min_ngram=4", r"min_ngram=4, max_ngram=3"),
        ("ours=[{engine:hf,compile:true}]", r"the transformers adapter runs eager only"),
        (
            "ours=[{engine:fast,compile:false}]",
            r"ours=\[\{'engine': 'fast', 'compile': False\}\]: must be a non-empty list",
        ),
    ],
)
def test_peer_settings_fail_before_any_model_loads(override, match, tmp_path):
    cfg = make_cfg("peer", "checkpoints.base=/nonexistent", override, f"out_dir={tmp_path}")
    with pytest.raises(ValueError, match=match) as excinfo:
        peer_mod.peer(cfg)
    assert "\n" not in str(excinfo.value)


def test_peer_refuses_an_x_transformers_base(tmp_path, cache_dir, llama_base):
    xt = tmp_path / "xt"
    base_trainer.train(
        make_cfg(
            "train_base",
            *[o for o in LLAMA if not o.startswith(("base=", "base.kv_heads"))],
            "max_steps=1",
            "eval_every=1",
            "checkpoint_every=1",
            f"data.cache_dir={cache_dir}",
            f"out_dir={xt}",
        )
    )
    cfg = make_cfg(
        "peer",
        f"checkpoints.base={xt / 'checkpoint'}",
        f"checkpoints.assistant={llama_base}",
        *PEER,
        f"data.cache_dir={cache_dir}",
        f"out_dir={tmp_path}",
    )
    with pytest.raises(ValueError, match="both models must be Hugging Face models"):
        peer_mod.peer(cfg)
    bcfg = make_cfg("benchmark", f"base_checkpoint={llama_base}", f"data.cache_dir={cache_dir}", "logger=none")
    with pytest.raises(ValueError, match="for a Hugging Face base run python -m experiments.peer"):
        baseline.compare(bcfg)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(arch="gpt"), r"arch='gpt': must be one of x-transformers, llama"),
        (dict(kv_heads=2), r"kv_heads=2: grouped-query attention is built for arch=llama only"),
        (dict(arch="llama", kv_heads=3), r"kv_heads=3 must divide heads=4"),
        (dict(arch="llama", kv_heads=0), r"kv_heads must be a positive integer, got 0"),
    ],
)
def test_bad_model_configs_raise_one_line_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_lm(**{**dict(num_tokens=64, dim=32, depth=1, heads=4, max_seq_len=32), **kwargs})


def test_bad_model_directories_and_tokenizers_are_refused(tmp_path, hf_dir):
    for name in ("config.json", "model.safetensors"):
        shutil.copy(hf_dir / name, tmp_path / name)
    with pytest.raises(CheckpointError, match=r"no such tokenizer.json"):
        load_lm(tmp_path)
    with pytest.raises(ValueError, match=r"tokenizer='/nonexistent': no such tokenizer.json"):
        prepare_data(tokenizer="/nonexistent")
    shutil.copy(hf_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<nope>"}}))
    with pytest.raises(ValueError, match=r"has none of the end-of-text tokens \['<nope>'\]"):
        load_tokenizer(str(tmp_path))
