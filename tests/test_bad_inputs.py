"""Bad inputs to the entry points (benchmark, generate, baseline, peer): every one a one-line error naming the
value and what is allowed, raised before anything loads or trains; results files written atomically.

No model is trained here: the checkpoints are written directly (save_checkpoint), and every function that
would load or train is replaced by one that fails the test, so a check that comes too late shows up as an
AssertionError instead of the expected one-line error."""

from __future__ import annotations

import ast
import copy
import errno
import functools
import json
import os
import re
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf, open_dict
from safetensors.torch import save_file
from tokenizers import Tokenizer, models

from experiments import baseline
from experiments import benchmark as bench_mod
from experiments import generate as gen
from experiments import peer as peer_mod
from experiments.lib.cli import preflight
from experiments.lib.common.errors import USER_ERRORS, atomic_path, write_atomic
from experiments.lib.methods import decode_checks
from experiments.lib.methods import registry as methods
from experiments.lib.report import results as report
from experiments.lib.store.checkpoint import save_checkpoint
from experiments.lib.store.lm import build_lm
from experiments.lib.training import artifacts

ROOT = Path(__file__).resolve().parents[1]
PARSER = OverridesParser.create()
LM = dict(num_tokens=64, dim=32, depth=1, heads=4, max_seq_len=32)
MODULES = {  # each family's module config as its conf/drafter/*.yaml has it
    "medusa": {"num_heads": 4, "num_layers": 1, "share_base_projection": False, "init": "medusa1"},
    "sequential": {"num_heads": 4, "num_layers": 1, "prefix": False, "dropout": 0.0},
    "prophet": {"dim": 128, "depth": 1, "heads": 4, "attn_dim_head": None, "ff_mult": 4, "fuse_layers": None},
    "prophet_block": {
        "block": 4,
        "dim": 128,
        "depth": 1,
        "heads": 4,
        "attn_dim_head": None,
        "ff_mult": 4,
        "fuse_layers": None,
    },
    "early_exit": {"layer": 2, "num_layers": 1},
    "draft": {"dim": 128, "depth": 2, "heads": 4, "ff_mult": 4, "attn_dim_head": None},
}
TYPED = {  # family -> a value a user types that differs from the checkpoint's (key, typed, recorded)
    "medusa": ("module.num_heads", "64", "4"),
    "sequential": ("module.num_layers", "2", "1"),
    "prophet": ("loss.unroll", "3", "1"),
    "prophet_block": ("module.block", "6", "4"),
    "early_exit": ("module.layer", "1", "2"),
    "draft": ("module.dim", "64", "128"),
}


def tokenizer_json(size: int) -> str:
    return Tokenizer(models.WordLevel({f"t{i}": i for i in range(size)}, unk_token="t0")).to_str()


def save_lm(directory: Path, *, tokens: int = 60, eos_id: int = 0, config: dict | None = None) -> Path:
    torch.manual_seed(0)
    config = config or LM
    return save_checkpoint(
        directory,
        model=build_lm(**config),
        model_config=config,
        tokenizer_json=tokenizer_json(tokens),
        step=1,
        extra={"kind": "base_lm", "data": {"config": None, "eos_id": eos_id}},
    )


def save_drafter(directory: Path, family: str, base_fingerprint: str) -> Path:
    """A drafter checkpoint's files (meta.json as train_drafter writes it); the weights are a stand-in."""
    loss = {"unroll": 1, "target": "kl"} if family == "prophet" else {"target": "kl"}
    drafter = {"package": family, "module": MODULES[family], "loss": loss}
    return save_checkpoint(
        directory,
        model=torch.nn.Linear(2, 2),
        model_config={"package": family, "module": MODULES[family]},
        tokenizer_json=None,
        step=1,
        extra={"kind": "drafter", "base_fingerprint": base_fingerprint, "base_checkpoint": "?", "drafter": drafter},
    )


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Checkpoints and prompts files, good and bad, by name (the {names} in the overrides below)."""
    tmp = tmp_path_factory.mktemp("bad_inputs")
    lm = save_lm(tmp / "lm")
    base_fp = json.loads((lm / "meta.json").read_text())["fingerprint"]
    out = {"lm": lm, "tmp": tmp}
    for family in MODULES:
        out[family] = save_drafter(tmp / family, family, base_fp)
    out["other_base_medusa"] = save_drafter(tmp / "other", "medusa", "0123456789abcdef")
    out["big_tokenizer"] = save_lm(tmp / "big_tokenizer", tokens=100)
    out["bad_eos"] = save_lm(tmp / "bad_eos", eos_id=500)
    out["truncated"] = save_lm(tmp / "truncated")
    weights = out["truncated"] / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    out["run_dir"] = tmp / "run"
    save_lm(out["run_dir"] / "checkpoint")
    (tmp / "not_a_checkpoint").mkdir()
    out["not_a_checkpoint"] = tmp / "not_a_checkpoint"
    out["served_eagle3"] = tmp / "served_eagle3"  # a serving-format directory (experiments/lib/formats/)
    out["served_eagle3"].mkdir()
    (out["served_eagle3"] / "config.json").write_text(json.dumps({"speculators_model_type": "eagle3"}))
    layer = {"hidden_size": 32, "num_attention_heads": 4, "intermediate_size": 64, "vocab_size": 64}
    eagle3 = {"speculators_model_type": "eagle3", "transformer_layer_config": layer}
    served = {  # broken serving-format directories: name -> (config.json text, weight files)
        "truncated": (json.dumps(eagle3), {"model.safetensors": b"\x08\x00\x00\x00\x00\x00\x00\x00{}"}),
        "pickle": (json.dumps(eagle3), {"pytorch_model.bin": b"\x80\x04"}),
        "bad_json": ('{"speculators_model_type": "eagle3",', {}),
        "no_heads": (json.dumps({**eagle3, "transformer_layer_config": {"hidden_size": 32}}), {}),
    }
    for name, (config, weights) in served.items():
        directory = tmp / f"served_{name}"
        directory.mkdir()
        (directory / "config.json").write_text(config)
        for file, data in weights.items():
            (directory / file).write_bytes(data)
        if not weights:
            save_file({"fc.weight": torch.zeros(1)}, str(directory / "model.safetensors"))
        out[f"served_{name}"] = directory
    prompts = {
        "empty.jsonl": b"",
        "no_prompt.jsonl": b'{"prompt": "a"}\n{"text": "b"}\n',
        "prompts.json": b'{"prompt": "a"}\n',
        "latin1.txt": "caf\xe9\n".encode("latin-1"),
        "blank.txt": b"\n  \n",
        "a_file": b"x",
        "one_turn.jsonl": b'{"category": "qa", "turns": ["a?"]}\n{"category": "qa", "turns": ["b?"]}\n',
        "two.txt": b"first prompt\nsecond prompt\n",
    }
    for name, data in prompts.items():
        (tmp / name).write_bytes(data)
        out[name.replace(".", "_")] = tmp / name
    return {k: str(v) for k, v in out.items()}


ENTRY = {  # entry point -> (config name, the run function, settings every case shares)
    "benchmark": (
        "benchmark",
        lambda cfg: bench_mod.benchmark(cfg),
        ["base_checkpoint={lm}", "logger=none", "out_dir={tmp}/out"],
    ),
    "generate": ("generate", lambda cfg: gen.generate(cfg), ["base_checkpoint={lm}", "method=prompt_lookup"]),
    "baseline": (
        "benchmark",
        lambda cfg: baseline.compare(cfg),
        ["base_checkpoint={lm}", "logger=none", "out_dir={tmp}/out"],
    ),
    "peer": ("peer", lambda cfg: peer_mod.peer(cfg), ["out_dir={tmp}/out"]),
}


@functools.cache
def composed(entry: str, hydra_node: bool) -> DictConfig:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(ENTRY[entry][0], return_hydra_config=hydra_node)


def make_cfg(entry: str, overrides: list[str], files: dict, *, hydra_node: bool = False) -> DictConfig:
    """The entry point's config with the overrides applied as Hydra applies command-line overrides after
    composing (parsed by its grammar: nan, lists, quoted strings), without composing it again for each case."""
    tmp = Path(files["tmp"])  # out_dir and artifacts.root are never written: loading and training fail the test
    lines = [o.format(**files) for o in [f"artifacts.root={tmp / 'artifacts'}", *ENTRY[entry][2], *overrides]]
    cfg = copy.deepcopy(composed(entry, hydra_node))
    for override in PARSER.parse_overrides(lines):
        OmegaConf.update(cfg, override.key_or_group, override.value(), merge=True)
    if hydra_node:
        cfg.hydra.overrides.task = lines
    return cfg


@pytest.fixture
def no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading or training anything fails the test: every check must come before."""

    def work(*args, **kwargs):
        raise AssertionError("a model was loaded or trained before the settings were checked")

    # Where each name is looked up: the entry points load the base; experiments/lib/methods/registry.py trains artifacts
    # (checkpoint_for), loads drafters and draft models, and reads the corpus (prompts, the drafters' vocabulary).
    for module, names in (
        (bench_mod, ("load_lm",)),
        (methods, ("ensure", "load_lm", "load_drafter", "prepare_data")),
        (gen, ("load_lm",)),
        (baseline, ("load_lm",)),
        (peer_mod, ("ensure", "load_lm", "prepare_data")),
    ):
        for name in names:
            monkeypatch.setattr(module, name, work)


@contextmanager
def typed_on_the_command_line(entry: str, overrides: list[str], files: dict):
    """The config as a Hydra app gets it, with HydraConfig knowing which keys were typed (overrides.task)."""
    cfg = make_cfg(entry, overrides, files, hydra_node=True)
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg["hydra"]
    try:
        yield cfg
    finally:
        HydraConfig.instance().cfg = None  # other tests run outside a Hydra app


def run_bad(entry: str, overrides: list[str], fragment: str, files: dict) -> str:
    with pytest.raises(USER_ERRORS) as excinfo:  # what the CLI prints as one line `error: ...`, exit 2
        ENTRY[entry][1](make_cfg(entry, overrides, files))
    message = str(excinfo.value)
    assert "\n" not in message and fragment in message, message
    return message


# -------------------------------------------------------------------------------------- the decode config

DECODE = [
    ("decode.temperatures=[nan]", "decode.temperatures[0]=nan: must be a finite number >= 0"),
    ("decode.temperatures=[0,inf]", "decode.temperatures[1]=inf: must be a finite number >= 0"),
    ("decode.temperatures=[-0.5]", "decode.temperatures[0]=-0.5"),
    ("decode.temperatures=['0.5']", "decode.temperatures[0]='0.5'"),
    ("decode.temperatures=[true]", "decode.temperatures[0]=True"),
    ("decode.temperatures=[]", "decode.temperatures=[]"),
    ("decode.temperatures=[0,0.0]", "give each temperature once"),
    ("decode.top_p=0", "decode.top_p=0: must be a number in (0, 1]"),
    ("decode.top_p=1.5", "decode.top_p=1.5"),
    ("decode.top_p=nan", "decode.top_p=nan"),
    ("decode.top_k=0", "decode.top_k=0: must be null or an integer >= 1"),
    ("decode.top_k=2.5", "decode.top_k=2.5"),
    ("decode.max_new_tokens=0", "decode.max_new_tokens=0: must be an integer >= 1"),
    ("decode.max_new_tokens='8'", "decode.max_new_tokens='8'"),
    ("decode.max_new_tokens=true", "decode.max_new_tokens=True"),
    ("decode.max_new_tokens=[8]", "decode.max_new_tokens=[8]"),
    ("decode.batch_size=0", "decode.batch_size=0"),
    ("decode.gamma=0", "decode.gamma=0"),
    ("decode.gamma=2.0", "decode.gamma=2.0"),
    ("decode.max_gamma=0", "decode.max_gamma=0"),
    ("decode.adaptive_gamma=true decode.max_gamma=2", "decode.max_gamma=2: must be >= decode.gamma=4"),
    ("decode.adaptive_gamma=maybe", "decode.adaptive_gamma='maybe': must be true or false"),
    ("decode.rule=magic", "decode.rule='magic': must be one of auto, greedy, speculative, typical"),
    ("decode.rule=[greedy]", "decode.rule=['greedy']"),
    ("decode.rule=greedy", "greedy acceptance needs temperature 0"),
    ("decode.delta=-0.1", "decode.delta=-0.1: must be a number in [0, 1]"),
    ("decode.delta=nan", "decode.delta=nan"),
    ("decode.typical_epsilon=2", "decode.typical_epsilon=2: must be a number in (0, 1]"),
    ("decode.typical_epsilon=0", "decode.typical_epsilon=0: must be a number in (0, 1]"),
    ("decode.typical_alpha=-1", "decode.typical_alpha=-1: must be a number > 0"),
    ("decode.typical_alpha=0", "decode.typical_alpha=0: must be a number > 0"),
    ("decode.temperatures=[1e-30]", "temperature=1e-30: must be a number >= 0, and 0 or at least 1e-06"),
    ("decode.typical_alpha=inf", "decode.typical_alpha=inf"),
]


@pytest.mark.parametrize("entry", ["benchmark", "generate", "baseline"])
@pytest.mark.parametrize("override, fragment", DECODE)
def test_bad_decode_setting_fails_before_any_work(
    entry: str, override: str, fragment: str, files: dict, no_work
) -> None:
    if entry != "benchmark" and override == "decode.rule=greedy":  # T=1 is the benchmark's second temperature
        override = (
            "decode.rule=greedy temperature=1" if entry == "generate" else "decode.temperatures=[1] decode.rule=greedy"
        )
    run_bad(entry, override.split(" "), fragment, files)


def test_typical_settings_reach_the_loop(files: dict) -> None:
    cfg = make_cfg(
        "benchmark", ["decode.typical_epsilon=0.2", "decode.typical_alpha=0.5", "decode.rule=typical"], files
    )
    _, spec = decode_checks.check_decode(cfg.decode)
    assert (spec.typical_epsilon, spec.typical_alpha, spec.rule) == (0.2, 0.5, "typical")


# ------------------------------------------------------------------------------ everything else, per entry point

BENCHMARK = [
    ("seed=-1", "seed=-1: must be an integer >= 0"),
    ("seed=abc", "seed='abc'"),
    ("repeats=0", "repeats=0: must be an integer >= 1"),
    ("repeats=[1]", "repeats=[1]"),
    ("stop_at_eos=maybe", "stop_at_eos='maybe': must be true or false"),
    ("device=[cpu]", "device=['cpu']: must be auto, cpu or cuda[:N]"),
    ("device=tpu", "device must be auto, cpu or cuda[:N], got 'tpu'"),
    ("vocab=0", "vocab=0: must be null or an integer >= 1"),
    ("vocab=true", "vocab=True"),
    ("threads=true", "threads=True"),
    ("methods=[nope]", "methods contain ['nope']"),
    ("methods=[prompt_lookup,prompt_lookup]", "give each method once"),
    ("prompt_lookup.max_ngram=x", "prompt_lookup.max_ngram='x': must be an integer >= 1"),
    ("prompt_lookup.min_ngram=0", "prompt_lookup.min_ngram=0"),
    ("prompt_lookup.min_ngram=4", "min_ngram=4, max_ngram=3"),
    ("prompts.num_prompts=0", "prompts.num_prompts=0"),
    ("prompts.prompt_len=-1", "prompts.prompt_len=-1"),
    ("prompts.file=/no/prompts.jsonl", "prompts file '/no/prompts.jsonl' does not exist"),
    ("prompts.file={empty_jsonl}", "holds no prompts"),
    ("prompts.file={blank_txt}", "holds no prompts"),
    (
        "prompts.file={no_prompt_jsonl}",
        "no_prompt.jsonl:2 must be a JSON string, an object with a string field 'prompt', or a Spec-Bench question",
    ),
    ("prompts.file={prompts_json}", "name a JSON-lines file .jsonl"),
    ("prompts.file={latin1_txt}", "is not UTF-8 text"),
    ("prompts.file={tmp}", "is a directory"),
    ("budget=sometimes", "budget='sometimes'"),
    ("budget_search.pilot_prompts=0", "budget_search.pilot_prompts=0"),
    ("medusa.decode.tree_nodes=0", "medusa.decode.tree_nodes=0"),
    ("prophet.decode.top_k=0", "prophet.decode.top_k=0"),
    ("prophet.decode.depth=two", "prophet.decode.depth='two'"),
    ("early_exit.decode.share_cache=maybe", "early_exit.decode.share_cache='maybe'"),
    ("prophet.decode.candidates=top", "prophet.decode.candidates='top': must be one of sampled, ranked"),
    ("medusa.decode.tree=[]", "medusa.decode.tree=[]: must be null (the default tree) or a non-empty list"),
    ("sequential.decode.tree=[[0],[-1]]", "sequential.decode.tree=[[0], [-1]]"),
    ("out_dir={a_file}", "out_dir="),
    ("out_dir=[a]", "out_dir=['a']: must be a directory path"),
    ("artifacts.medusa='max_steps=2'", "artifacts.medusa='max_steps=2': must be a list of Hydra overrides"),
    ("base_checkpoint=/no/base", "checkpoint directory not found: /no/base"),
    ("base_checkpoint={not_a_checkpoint}", "is not a checkpoint directory (no meta.json, no model.safetensors)"),
    ("base_checkpoint={run_dir}", "is a run directory, not a checkpoint: give"),
    ("base_checkpoint={truncated}", "corrupted or truncated"),
    (
        "base_checkpoint={medusa}",
        "is a drafter checkpoint (kind=drafter); base_checkpoint takes a base LM checkpoint (experiments.train_base)",
    ),
    ("base_checkpoint={big_tokenizer}", "its tokenizer has 100 tokens, more than the model's 64"),
    ("base_checkpoint={bad_eos}", "its EOS id 500 is not a token of its 60-token tokenizer"),
    ("checkpoints.medusa=5", "checkpoints.medusa=5: must be a checkpoint directory or null"),
    ("checkpoints.medusa={lm}", "is a base LM checkpoint (kind='base_lm'), not a drafter: train one on it with"),
    ("checkpoints.medusa={prophet}", "is a prophet drafter checkpoint, not a medusa one"),
    ("checkpoints.medusa={other_base_medusa}", "was trained on base 0123456789abcdef, not on base_checkpoint="),
    ("checkpoints.medusa={truncated}", "corrupted or truncated"),
    ("checkpoints.draft={medusa}", "is a medusa drafter checkpoint, not a draft one"),
    ("checkpoints.medusa={served_eagle3}", "is a eagle3 directory: it is a prophet drafter"),
    ("checkpoints.prophet={served_truncated}", "corrupted or truncated"),
    (
        "checkpoints.prophet={served_pickle}",
        "holds no *.safetensors weights (only pytorch_model.bin): pickled weights are never loaded",
    ),
    ("checkpoints.prophet={served_bad_json}", "served_bad_json/config.json is not valid JSON"),
    ("checkpoints.prophet={served_no_heads}", "(transformer_layer_config) has no 'num_attention_heads'"),
    ("prompts.file={two_txt} prompts.num_prompts=3", "prompts.num_prompts=3: prompts.file="),
    (
        "prompts.file={one_turn_jsonl} prompts.num_prompts=2 prompts.chat=true prompts.turns=2",
        "prompts.turns=2: none of the 2 questions taken from prompts.file=",
    ),
    ("checkpoints.draft={big_tokenizer}", "its tokenizer has 100 tokens"),
    ("checkpoints.early_exit=/no/exit", "checkpoint directory not found: /no/exit"),
]
GENERATE = [
    ("method=magic", "method='magic': must be one of draft_model"),
    ("temperature=nan", "temperature=nan: must be a finite number >= 0"),
    ("temperature=hot", "temperature='hot'"),
    ("max_new_tokens=0", "max_new_tokens=0"),
    ("max_new_tokens=1.5", "max_new_tokens=1.5"),
    ("warmup_tokens=true", "warmup_tokens=True: must be an integer >= 0"),
    ("warmup_tokens=-1", "warmup_tokens=-1"),
    ("interactive=maybe", "interactive='maybe'"),
    ("prompt=", "prompt='': give a non-empty text"),
    ("prompt=[a]", "prompt=['a']"),
    ("compile=maybe", "compile='maybe'"),
    ("threads=0", "threads=0"),
    ("seed=1.5", "seed=1.5"),
    ("vocab=-3", "vocab=-3"),
    ("stop_at_eos=2", "stop_at_eos=2"),
    ("prompt_lookup.min_ngram=x", "prompt_lookup.min_ngram='x'"),
    ("method=medusa_tree medusa.decode.tree_nodes=0", "medusa.decode.tree_nodes=0"),
    ("method=medusa_chain checkpoints.medusa={sequential}", "is a sequential drafter checkpoint, not a medusa one"),
    ("method=draft_model checkpoints.draft={not_a_checkpoint}", "is not a checkpoint directory"),
    ("base_checkpoint={prophet}", "is a drafter checkpoint (kind=drafter)"),
]
BASELINE = [
    ("threads=[1,2]", "threads=[1, 2]: the baseline takes one setting"),
    ("compile=[false,true]", "compile=[False, True]: the baseline takes one setting"),
    ("repeats=0", "repeats=0"),
    ("seed=[0]", "seed=[0]"),
    ("prompts.num_prompts=0", "prompts.num_prompts=0"),
    (
        "prompts.file={no_prompt_jsonl}",
        "must be a JSON string, an object with a string field 'prompt', or a Spec-Bench question",
    ),
    ("base_checkpoint={sequential}", "is a drafter checkpoint (kind=drafter)"),
    ("base_checkpoint={truncated}", "corrupted or truncated"),
]
PEER = [
    ("seed=-2", "seed=-2"),
    ("device=7", "device=7"),
    ("prompts.num_prompts=0", "prompts.num_prompts=0"),
    ("prompts.prompt_len=x", "prompts.prompt_len='x'"),
    ("gamma=0", "gamma=0"),
    ("batch_sizes=[]", "batch_sizes=[]"),
    ("prompt_lookup.max_ngram=0", "prompt_lookup.max_ngram=0"),
    ("out_dir={a_file}", "out_dir="),
    ("checkpoints.base={lm}", "is an x-transformers LM: the peer benchmark compares against transformers"),
    ("checkpoints.base={draft}", "is a drafter checkpoint (kind=drafter); checkpoints.base takes a base LM checkpoint"),
    ("checkpoints.assistant={truncated}", "corrupted or truncated"),
    ("checkpoints.assistant=/no/assistant", "checkpoint directory not found"),
]


@pytest.mark.parametrize(
    "entry, override, fragment",
    [
        *(("benchmark", o, f) for o, f in BENCHMARK),
        *(("generate", o, f) for o, f in GENERATE),
        *(("baseline", o, f) for o, f in BASELINE),
        *(("peer", o, f) for o, f in PEER),
    ],
)
def test_bad_setting_fails_before_any_work(entry: str, override: str, fragment: str, files: dict, no_work) -> None:
    run_bad(entry, override.split(" "), fragment, files)


def test_the_good_settings_reach_the_work(files: dict, no_work) -> None:
    """The shared settings of the cases above are valid: each entry point gets as far as loading."""
    for entry in ("benchmark", "generate", "baseline"):
        with pytest.raises(AssertionError, match="before the settings were checked"):
            ENTRY[entry][1](
                make_cfg(entry, [f"checkpoints.{k}={{{k}}}" for k in MODULES] if entry == "benchmark" else [], files)
            )


def test_unwritable_out_dir_fails_before_any_work(files: dict, no_work, tmp_path: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("root writes whatever the mode says")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        for entry in ("benchmark", "peer"):
            run_bad(
                entry, [f"out_dir={locked / 'run'}"], f"out_dir='{locked / 'run'}' is not a writable directory", files
            )
    finally:
        locked.chmod(0o700)


def test_typed_drafter_setting_must_match_the_checkpoint(files: dict, no_work) -> None:
    """A drafter setting typed on the command line that disagrees with the given checkpoint is refused, naming
    both values; the same value typed, or a disagreeing value that only a default or preset holds, is not."""
    for family, (key, typed, recorded) in TYPED.items():
        given = f"checkpoints.{family}={{{family}}}"
        with typed_on_the_command_line("benchmark", [given, f"{family}.{key}={typed}"], files) as cfg:
            with pytest.raises(ValueError) as excinfo:
                bench_mod.benchmark(cfg)
        message = str(excinfo.value)
        name = key.split(".")[1]
        assert f"{family}.{key}={typed} was set on the command line" in message, message
        assert f"checkpoints.{family}={files[family]} was trained with {recorded}" in message and "\n" not in message
        with typed_on_the_command_line("benchmark", [given, f"{family}.{key}={recorded}"], files) as cfg:
            decode_checks.check_benchmark(cfg)
        with typed_on_the_command_line("benchmark", [given], files) as cfg:
            with open_dict(cfg):  # as a preset would set it: recorded from the checkpoint instead (test_experiments)
                cfg[family][key.split(".")[0]][name] = int(typed)
            decode_checks.check_benchmark(cfg)
    with typed_on_the_command_line(
        "generate", ["method=medusa_tree", "checkpoints.medusa={medusa}", "medusa.module.num_heads=64"], files
    ) as cfg:
        with pytest.raises(ValueError, match="num_heads=64 was set on the command line"):
            gen.generate(cfg)


def test_decode_keys_an_entry_point_does_not_read_are_refused_when_typed(files: dict, no_work) -> None:
    for key, value in (("decode.max_new_tokens", 8), ("decode.temperatures", "[1]"), ("decode.batch_size", 2)):
        with typed_on_the_command_line("generate", [f"{key}={value}"], files) as cfg:
            with pytest.raises(ValueError, match=f"{key} is the benchmark's setting, not read by generate"):
                gen.generate(cfg)
    with typed_on_the_command_line("baseline", ["decode.temperatures=[1]"], files) as cfg:
        with pytest.raises(ValueError, match="decode.temperatures is not read by the baseline: it decodes greedily"):
            baseline.compare(cfg)
    with typed_on_the_command_line("baseline", ["decode.max_new_tokens=8"], files) as cfg:
        with pytest.raises(AssertionError, match="before the settings were checked"):  # read: on to loading
            baseline.compare(cfg)


# ----------------------------------------------------------------------------------------- atomic writes


def test_write_atomic_writes_text_and_bytes(tmp_path: Path) -> None:
    write_atomic(tmp_path / "a.json", "{}")
    write_atomic(tmp_path / "b.png", b"\x89PNG")
    write_atomic(tmp_path / "a.json", "[1]")
    assert (tmp_path / "a.json").read_text() == "[1]" and (tmp_path / "b.png").read_bytes() == b"\x89PNG"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "b.png"]


def test_atomic_path_renames_only_a_whole_file(tmp_path: Path) -> None:
    path = tmp_path / "shard.bin"
    path.write_bytes(b"old")
    with pytest.raises(RuntimeError), atomic_path(path) as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("killed mid-write")
    assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["shard.bin"]
    with atomic_path(path) as tmp:
        assert tmp.parent == tmp_path and tmp != path
        tmp.write_bytes(b"new")
    assert path.read_bytes() == b"new" and [p.name for p in tmp_path.iterdir()] == ["shard.bin"]


def full_disk(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("fails", ["fsync", "replace"])
@pytest.mark.parametrize("existed", [True, False])
def test_full_disk_leaves_the_previous_file(
    fails: str, existed: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "results.json"
    if existed:
        path.write_text("previous")
    monkeypatch.setattr(os, fails, full_disk)
    with pytest.raises(OSError) as excinfo:
        write_atomic(path, "x" * 100_000)
    assert excinfo.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == (["results.json"] if existed else [])  # no partial or temporary file
    assert not existed or path.read_text() == "previous"


def test_report_on_a_full_disk_keeps_the_previous_results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    results = {"plain": [], "methods": [], "cpu": "test"}
    report.write_report(results, tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert set(before) == {"results.json", "results.md"}
    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space left"):
        report.write_report({**results, "cpu": "other"}, tmp_path)
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_artifact_result_on_a_full_disk_leaves_no_partial_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from experiments.lib.training import base_trainer

    monkeypatch.setattr(base_trainer, "train", lambda cfg: {"step": 1})
    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space left"):
        artifacts.ensure("base", ["max_steps=3"], root=tmp_path)
    (run,) = tmp_path.iterdir()
    assert list(run.iterdir()) == []  # no result.json, whole or partial


# ------------------------------------------------------------------------------------- the command line


@pytest.mark.slow
def test_command_line_refuses_a_typed_setting_the_checkpoint_disagrees_with(files: dict, tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.benchmark",
            f"base_checkpoint={files['lm']}",
            f"checkpoints.medusa={files['medusa']}",
            "medusa.module.num_heads=64",
            "methods=[medusa_chain]",
            "logger=none",
            f"hydra.run.dir={tmp_path}",
            f"artifacts.root={tmp_path / 'artifacts'}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: medusa.module.num_heads=64 was set"), (
        proc.stderr
    )
    assert "was trained with 4" in proc.stderr and not (tmp_path / "artifacts").exists()


@pytest.mark.parametrize(
    "override, fragment",
    [
        (
            'artifacts.medusa=["max_minutes=-1"]',
            "artifacts.medusa (the recipe training medusa): max_minutes must be positive",
        ),
        ('artifacts.prophet=["nokey=1"]', "artifacts.prophet does not compose: Could not override 'nokey'"),
        ('artifacts.draft=["optim.lr=0"]', "artifacts.draft (the recipe training draft): optim.lr must be positive"),
    ],
)
def test_a_bad_artifact_recipe_fails_before_any_work(override: str, fragment: str, files: dict, no_work) -> None:
    run_bad("benchmark", [override], fragment, files)


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("medusa.module.num_heads=0", "medusa.module.num_heads=0: must be an integer >= 1"),
        ("prophet.module.fuse_layers=[99]", "fuse_layers=[99]: 99 is not a block index"),
    ],
)
def test_a_drafter_setting_its_training_would_refuse_fails_before_any_training(
    override: str, fragment: str, files: dict
) -> None:
    """Checked on the loaded base before the first artifact trains (methods.make_methods calls it first)."""
    from tests.conftest import make_lm

    cfg = make_cfg("benchmark", [override, "methods=[draft_model,medusa_chain,prophet_chain]"], files)
    with pytest.raises(ValueError, match=re.escape(fragment)):
        methods.check_untrained_drafters(cfg, make_lm())
    methods.check_untrained_drafters(make_cfg("benchmark", ["methods=[draft_model,medusa_chain]"], files), make_lm())


@pytest.mark.parametrize(
    "entry, method", [("benchmark", "methods=[medusa_chain]"), ("generate", "method=medusa_chain")]
)
@pytest.mark.parametrize("base", ["base_checkpoint={lm}", "base_checkpoint=null"])  # loaded, or trained by its recipe
def test_a_drafter_setting_is_refused_before_the_base_loads_or_trains(
    entry: str, method: str, base: str, files: dict, no_work
) -> None:
    """Checked on a weightless stand-in of the base (its shape from the checkpoint's meta or the recipe), so a
    base artifact never trains for minutes before `medusa.module.num_heads=0` is refused."""
    run_bad(
        entry, [base, method, "medusa.module.num_heads=0"], "medusa.module.num_heads=0: must be an integer >= 1", files
    )


@pytest.mark.parametrize(
    "base, families",
    [
        (
            "base_checkpoint=null",
            "draft_model,medusa_chain,prophet_chain,prophet_block_chain,sequential_chain,early_exit_chain",
        ),
        (  # one block: no exit
            "base_checkpoint={lm}",
            "draft_model,medusa_chain,prophet_chain,prophet_block_chain,sequential_chain",
        ),
    ],
)
def test_every_family_passes_the_stand_in_check_with_good_settings(base: str, families: str, files: dict) -> None:
    """The weightless stand-in must not refuse what the real base accepts (early exit's build computes on it)."""
    methods.check_drafters_before_base(make_cfg("benchmark", [base, f"methods=[{families}]"], files))


# --------------------------------------------------------------------- failures inside Hydra, before main(cfg)
# Hydra composes the config and creates the run directory before the entry point's code runs; hydra_preflight
# (experiments/lib/cli/preflight.py) checks both first. The entry points run in this process (sys.argv as typed), with
# their work replaced by a stub: a check that lets a bad command line through reaches the stub, not the work.


@pytest.fixture
def hydra_app(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture):
    """Run an entry point's main() on a command line; returns (exit status, stderr, what the stub received)."""
    started = []

    def stub(cfg: DictConfig, *args, **kwargs) -> None:
        started.append(cfg)
        raise AssertionError("the run started")  # a bug to the entry point: a traceback and exit 1

    monkeypatch.setattr(bench_mod, "benchmark", stub)
    monkeypatch.setattr(gen, "generate", lambda cfg: started.append(cfg))

    def run(module, argv: list[str]) -> tuple[int, str, list]:
        # The config directory given as typed: imported (not run as __main__), Hydra would look for ../conf as a
        # package next to the module's package.
        monkeypatch.setattr(sys, "argv", [module.__file__, f"--config-path={ROOT / 'conf'}", *argv])
        capsys.readouterr()
        try:
            module.main()
            status = 0
        except SystemExit as e:
            status = e.code if isinstance(e.code, int) else 1
        return status, capsys.readouterr().err, started

    return run


def assert_one_line_error(status: int, stderr: str, fragments: list[str]) -> None:
    assert status == 2, stderr
    assert stderr.startswith("error: ") and stderr.count("\n") == 1 and "Traceback" not in stderr, stderr
    for fragment in fragments:
        assert fragment in stderr, stderr


@pytest.mark.parametrize(
    "argv, fragments",
    [
        (["nosuch=1"], ["error: nosuch=1: the config has no key 'nosuch'; its keys are: ", "decode", "seed"]),
        (["decode.nosuch=1"], ["error: decode.nosuch=1: decode has no key 'nosuch'; its keys are: temperatures,"]),
        (
            ["experiment=nosuch"],
            ["error: experiment=nosuch: no option 'nosuch' in config group experiment; the options are: base_draft,"],
        ),
        (
            ["drafter=nosuch"],
            [
                "error: drafter=nosuch: config group drafter is set per package, as one of drafter@draft,",
                "the options are: draft, early_exit, medusa, prophet, prophet_block, sequential",
            ],
        ),
        (
            ["-m", "drafter@medusa=medusa,nosuch"],  # a multirun's job 1 would fail after job 0 ran
            ["error: drafter@medusa=medusa,nosuch: no option 'nosuch' in config group drafter; the options are: "],
        ),
        (["decode.gamma=[1"], ["error: cannot parse the override 'decode.gamma=[1': no viable alternative"]),
    ],
)
def test_a_command_line_hydra_cannot_compose_is_one_line(
    argv: list[str], fragments: list[str], hydra_app, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    where = f"hydra.sweep.dir={run_dir}" if "-m" in argv else f"hydra.run.dir={run_dir}"
    status, stderr, started = hydra_app(bench_mod, [*argv, "logger=none", where])
    assert_one_line_error(status, stderr, fragments)
    assert not started and not run_dir.exists()


def fail_probe(code: int):
    def write_probe(path: Path) -> None:
        raise OSError(code, os.strerror(code), str(path))

    return write_probe


@pytest.mark.parametrize(
    "run_dir, fault, fragment",
    [
        ("/proc/x", None, "error: hydra.run.dir=/proc/x: cannot create /proc/x: No such file or directory"),
        ("/sys/x", None, "error: hydra.run.dir=/sys/x: cannot write /sys/x: permission denied"),
        (
            "{tmp}/file/run",
            None,
            "error: hydra.run.dir={tmp}/file/run: cannot create {tmp}/file/run: {tmp}/file is a file",
        ),
        (
            "{tmp}/a/run",
            errno.ENOSPC,
            "error: hydra.run.dir={tmp}/a/run: disk full while writing {tmp}/a/run: free some",
        ),
        (
            "{tmp}/a/run",
            errno.EROFS,
            "error: hydra.run.dir={tmp}/a/run: cannot write {tmp}/a/run: read-only file system",
        ),
    ],
)
def test_a_run_directory_hydra_cannot_write_is_one_line(
    run_dir: str, fault: int | None, fragment: str, hydra_app, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: a traceback from Hydra's mkdir, its logging set-up or its saving of the config (exit 1)."""
    if run_dir.startswith(("/proc", "/sys")) and not Path(run_dir).parent.is_dir():
        pytest.skip("no /proc or /sys here")
    (tmp_path / "file").write_text("")
    if fault is not None:
        monkeypatch.setattr(preflight, "write_probe", fail_probe(fault), raising=False)  # fails the same without it
    run_dir = run_dir.format(tmp=tmp_path)
    status, stderr, started = hydra_app(gen, [f"hydra.run.dir={run_dir}"])
    assert_one_line_error(status, stderr, [fragment.format(tmp=tmp_path)])
    assert not started and sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # the probe's directories are gone


def test_a_multirun_sweep_directory_hydra_cannot_write_is_one_line(hydra_app, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    status, stderr, started = hydra_app(bench_mod, ["-m", "decode.gamma=1,2", f"hydra.sweep.dir={tmp_path}/file/x"])
    assert_one_line_error(status, stderr, [f"error: hydra.sweep.dir={tmp_path}/file/x: cannot create"])
    assert not started


def test_a_good_command_line_still_runs_in_its_run_directory(hydra_app, tmp_path: Path) -> None:
    run_dir = tmp_path / "a" / "run"
    status, stderr, started = hydra_app(gen, ["decode.gamma=2", f"hydra.run.dir={run_dir}"])
    assert status == 0 and stderr == "", stderr
    assert [cfg.decode.gamma for cfg in started] == [2]
    assert sorted(p.name for p in run_dir.iterdir()) == [".hydra", "generate.log"]  # no probe left behind


def test_a_run_directory_named_by_the_time_is_the_one_checked(
    hydra_app, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default run directory is named by the second: Hydra resolving it again after the check, a second
    later, would run in another directory and leave the checked one behind, empty."""
    import datetime as dt

    import hydra.core.utils

    class Ticking(dt.datetime):
        clock = dt.datetime(2026, 1, 1, 12, 0, 0)

        @classmethod
        def now(cls, tz=None):  # a second passes between any two readings
            cls.clock += dt.timedelta(seconds=1)
            return cls.clock

    monkeypatch.setattr(hydra.core.utils, "datetime", Ticking)
    monkeypatch.chdir(tmp_path)
    status, stderr, started = hydra_app(gen, ["decode.gamma=2"])
    assert status == 0 and stderr == "", stderr
    runs = list((tmp_path / "outputs" / "generate").iterdir())
    assert len(runs) == 1 and sorted(p.name for p in runs[0].iterdir()) == [".hydra", "generate.log"], runs


def test_a_refused_run_leaves_no_run_directory(hydra_app, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run that ends in a one-line user error removes the run directory made for it (only Hydra's files)."""
    monkeypatch.setattr(gen, "generate", lambda cfg: (_ for _ in ()).throw(ValueError("prompt=x: refused")))
    monkeypatch.chdir(tmp_path)
    status, stderr, _ = hydra_app(gen, ["decode.gamma=2"])
    assert status == 2 and stderr == "error: prompt=x: refused\n", stderr
    assert list(tmp_path.iterdir()) == []
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "mine.txt").write_text("x")
    status, _, _ = hydra_app(gen, ["decode.gamma=2", f"hydra.run.dir={kept}"])  # it existed: never removed
    assert status == 2 and sorted(p.name for p in kept.iterdir()) == [".hydra", "generate.log", "mine.txt"]


def test_every_entry_point_checks_its_command_line_before_hydra() -> None:
    """@hydra_preflight outside @hydra.main on every entry point: the check must run before Hydra starts."""
    mains = 0
    for path in sorted((ROOT / "experiments").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef):
                continue
            names = [ast.unparse(d.func if isinstance(d, ast.Call) else d) for d in node.decorator_list]
            if "hydra.main" in names:
                mains += 1
                assert names[:2] == ["hydra_preflight", "hydra.main"], (path.name, names)
    assert mains >= 9


def test_the_command_line_itself_prints_one_line(tmp_path: Path) -> None:
    """As a user runs it (python -m: the config path found from the file, not the package)."""
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.benchmark", "experiment=nosuch", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    fragment = "error: experiment=nosuch: no option 'nosuch' in config group experiment; the options are: base_draft,"
    assert_one_line_error(proc.returncode, proc.stderr, [fragment])
    assert not (tmp_path / "run").exists()


def test_a_run_directory_another_process_just_made_passes_the_check(tmp_path: Path, monkeypatch) -> None:
    """torchrun's ranks check one run directory at once: the one that loses the race to create it must pass
    (it failed with 'File exists'), and a passing check keeps the directory for Hydra, removing it under no one."""
    run_dir = tmp_path / "ddp"
    run_dir.mkdir()  # made by the other rank between this rank's look and its mkdir
    real = os.path.lexists
    monkeypatch.setattr(preflight.os.path, "lexists", lambda p: False if Path(p) == run_dir else real(p))
    preflight.probe_directory(run_dir)
    assert run_dir.is_dir() and list(run_dir.iterdir()) == []


@pytest.mark.parametrize(
    "name, value, fragment",
    [
        ("WINDOWS", "abc", "WINDOWS=abc: must be a whole number of windows >= 1"),
        ("WINDOWS", "0", "WINDOWS=0: must be a whole number"),
        ("SCALE", "0", "SCALE=0: must be a number > 0"),
        ("SCALE", "-1", "SCALE=-1: must be a number > 0"),
    ],
)
def test_the_reference_script_refuses_bad_settings_before_any_work(tmp_path: Path, name, value, fragment) -> None:
    env = {**os.environ, name: value, "OUT": str(tmp_path / "run"), "FEATURES": str(tmp_path / "features")}
    proc = subprocess.run(
        ["bash", "experiments/smollm2_reference.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert_one_line_error(proc.returncode, proc.stderr, [fragment])
    assert not (tmp_path / "run").exists() and not (tmp_path / "features").exists()
