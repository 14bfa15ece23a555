"""Shipped drafters (experiments/lib/store/shipped_drafters.py, experiments/ship_drafters.py): a trimmed bf16 copy of a
drafter checkpoint that loads on its base with the source's weights wherever the drafter reads them, decodes exactly,
and is refused in one line when damaged, foreign or too large, with nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from experiments import ship_drafters as cli
from experiments.lib.families.registry import family, load_drafter
from experiments.lib.methods.registry import check_base
from experiments.lib.store.checkpoint import CheckpointError, load_lm, save_checkpoint
from experiments.lib.store.shipped_drafters import SUMS_FILE, file_sha256
from tests.test_export_safety import save_base
from verify.backends.target import Target
from verify.loop.plain import plain_generate
from verify.loop.speculative import SpecConfig, speculative_generate

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parent.parent
VOCAB_IDS = [0, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53]  # the drafted subset of the base's 64


def save_drafter(directory: Path, base_dir: Path, package: str, module: dict, *, ids=VOCAB_IDS, seed=0) -> Path:
    """A drafter checkpoint of `package` on the base, its weights moved off their initialisation."""
    base, _, meta = load_lm(base_dir)
    model = family(package).build(base, **module)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=g))
    extra = {
        "kind": "drafter",
        "base_fingerprint": meta["fingerprint"],
        "base_checkpoint": str(base_dir),
        "drafter": {"package": package, "module": module, "loss": {"target": "kl"}},
        "train_vocab_ids": ids,
        "train_vocab": None if ids is None else len(ids),
        "elapsed_s": 90.0,
    }
    config = {"package": package, "module": module}
    return save_checkpoint(directory, model=model, model_config=config, tokenizer_json=None, step=3, extra=extra)


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("shipped")
    base = save_base(tmp / "base", 0)
    return {
        "base": base,
        "other_base": save_base(tmp / "other_base", 1),
        "sequential": save_drafter(tmp / "sequential", base, "sequential", {"num_heads": 2, "num_layers": 1}),
        "medusa": save_drafter(tmp / "medusa", base, "medusa", {"num_heads": 2, "num_layers": 1}, ids=None),
        "draft": tmp / "draft_is_not_shippable",
    }


def ship(made: dict, out: Path, *pairs: str) -> int:
    return cli.main([*pairs, "--out", str(out), "--command", "python -m experiments.train_drafter (test)"])


def test_a_shipped_copy_is_trimmed_bf16_and_loads_with_the_source_weights(made, tmp_path):
    assert ship(made, tmp_path / "d", f"sequential={made['sequential']}") == 0
    out = tmp_path / "d" / "sequential"
    assert sorted(p.name for p in out.iterdir()) == ["SHA256SUMS", "meta.json", "model.safetensors"]
    meta = json.loads((out / "meta.json").read_text())
    assert meta["shipped"]["trimmed"] == ["projections.0.weight", "projections.1.weight"]
    assert meta["shipped"]["minutes"] == 1.5 and meta["shipped"]["command"].startswith("python -m")
    base, _, base_meta = load_lm(made["base"])
    source, _, _ = load_drafter(made["sequential"], base, base_meta)
    shipped, _, _ = load_drafter(out, base, base_meta)
    fresh = family("sequential").build(base, num_heads=2, num_layers=1).state_dict()
    rows = torch.tensor(VOCAB_IDS)
    outside = torch.ones(64, dtype=torch.bool)
    outside[rows] = False
    for key, want in source.state_dict().items():
        got = shipped.state_dict()[key]
        if key.startswith("projections"):  # the drafted rows the source's in bf16; the others the initialisation
            assert torch.equal(got[rows], want[rows].bfloat16().float())
            assert torch.equal(got[outside], fresh[key][outside])
        else:
            assert torch.equal(got, want.bfloat16().float()), key
    drafter = family("sequential").make_drafter(shipped, base, mode="chain", vocab=rows)
    prompts = [[1, 2, 3, 4, 5, 6], [9, 8, 7]]
    want = plain_generate(Target(base), prompts, max_new_tokens=12).tokens
    got = speculative_generate(Target(base), drafter, prompts, max_new_tokens=12, spec=SpecConfig(gamma=2))
    assert got.tokens == want


def test_a_drafter_of_the_full_vocabulary_ships_whole_in_bf16(made, tmp_path):
    assert ship(made, tmp_path / "d", f"medusa={made['medusa']}") == 0
    meta = json.loads((tmp_path / "d" / "medusa" / "meta.json").read_text())
    assert meta["shipped"]["trimmed"] == []
    base, _, base_meta = load_lm(made["base"])
    source, _, _ = load_drafter(made["medusa"], base, base_meta)
    shipped, _, _ = load_drafter(tmp_path / "d" / "medusa", base, base_meta)
    for key, want in source.state_dict().items():
        assert torch.equal(shipped.state_dict()[key], want.bfloat16().float()), key


@pytest.mark.parametrize("damage", ["weights", "meta"])
def test_a_damaged_copy_is_refused_in_one_line(made, tmp_path, damage):
    assert ship(made, tmp_path / "d", f"sequential={made['sequential']}") == 0
    out = tmp_path / "d" / "sequential"
    if damage == "weights":
        data = bytearray((out / "model.safetensors").read_bytes())
        data[-3] ^= 0x40
        (out / "model.safetensors").write_bytes(bytes(data))
        match = "fingerprint"
    else:
        meta = json.loads((out / "meta.json").read_text())
        meta["metrics"] = {"chain_tau": 9.9}
        (out / "meta.json").write_text(json.dumps(meta))
        match = "meta.json does not match its sha256 in SHA256SUMS"
    base, _, base_meta = load_lm(made["base"])
    with pytest.raises(CheckpointError, match=match) as info:
        load_drafter(out, base, base_meta)
    assert "\n" not in str(info.value)


def test_the_sums_are_the_files_sha256(made, tmp_path):
    assert ship(made, tmp_path / "d", f"sequential={made['sequential']}") == 0
    out = tmp_path / "d" / "sequential"
    listed = dict(reversed(line.split("  ")) for line in (out / SUMS_FILE).read_text().splitlines())
    assert listed == {name: file_sha256(out / name) for name in ("model.safetensors", "meta.json")}


def test_another_base_is_refused_in_one_line(made, tmp_path):
    assert ship(made, tmp_path / "d", f"sequential={made['sequential']}") == 0
    _, _, other = load_lm(made["other_base"])
    meta = json.loads((tmp_path / "d" / "sequential" / "meta.json").read_text())
    with pytest.raises(CheckpointError, match="was trained on base .*, not on this base .*leave out the shipped_"):
        check_base(tmp_path / "d" / "sequential", meta, other)


@pytest.mark.parametrize(
    "pairs, message",
    [
        (["draft=x"], "give <family>=<checkpoint directory> once per family"),
        (["sequential"], "give <family>=<checkpoint directory> once per family"),
        (["sequential={seq}", "sequential={seq}"], "once per family"),
        (["medusa={missing}"], "checkpoint directory not found"),
    ],
)
def test_bad_arguments_write_nothing(made, tmp_path, capsys, pairs, message):
    pairs = [p.format(seq=made["sequential"], missing=tmp_path / "nope") for p in pairs]
    assert ship(made, tmp_path / "d", *pairs) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "d").exists()


def test_copies_beyond_the_limit_write_nothing(made, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli, "LIMIT_BYTES", 1000)
    assert ship(made, tmp_path / "d", f"sequential={made['sequential']}") == 2
    assert "MiB of drafters: at most" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()


def test_a_shipped_eagle3_prophet_exports_to_vllms_format(tmp_path, monkeypatch):
    """A shipped copy is a drafter checkpoint: experiments.export writes it in speculators' EAGLE-3 format. Its base
    is named relative to the working directory, where a clone unpacks its own."""
    from experiments import export as export_mod
    from tests.test_export_safety import cfg, save_prophet

    monkeypatch.chdir(tmp_path)
    save_base(Path("base"), 0)
    save_prophet(Path("prophet"), Path("base"))
    assert cli.main(["prophet=prophet", "--out", "shipped", "--command", "test"]) == 0
    meta = json.loads(Path("shipped/prophet/meta.json").read_text())
    assert meta["base_checkpoint"] == "base"
    out = export_mod.export(cfg(checkpoint="shipped/prophet", out="e3"))
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()


def test_a_failed_check_leaves_every_shipped_copy_as_it_was(made, tmp_path, monkeypatch, capsys):
    """Two families shipped; shipping both again with the second's check failing replaces neither."""
    out = tmp_path / "d"
    assert ship(made, out, f"sequential={made['sequential']}", f"medusa={made['medusa']}") == 0
    before = {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}

    def failing(source, copy, base, base_meta):
        if "medusa" in str(copy):
            raise CheckpointError(f"{copy}: projections.0.weight differs")

    monkeypatch.setattr(cli, "check_copy", failing)
    assert ship(made, out, f"sequential={made['sequential']}", f"medusa={made['medusa']}") == 2
    assert "projections.0.weight differs" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()} == before  # no staged copy left


def test_a_base_checkpoint_is_not_a_drafter_to_ship(made, tmp_path, capsys):
    assert ship(made, tmp_path / "d", f"sequential={made['base']}") == 2
    err = capsys.readouterr().err
    assert "checkpoint cannot ship: only drafters of the families" in err and err.count("\n") == 1
    assert not (tmp_path / "d").exists()


SHIPPED = ROOT / "results" / "drafters"


@pytest.mark.parametrize("name", ["sequential", "prophet"])
def test_the_committed_drafters_load_on_smollm2_and_draft_what_it_writes(smol, smol_bf16, name):
    """The drafters committed under results/drafters: their sha256 hold, they load on SmolLM2 (bf16, as decoding
    runs), their greedy chains equal plain decoding and accept what a trained drafter does (tau well above 1),
    and the sequential heads' hybrid too."""
    from verify.backends.choose import make_target
    from verify.drafters.hybrid import HybridDrafter

    directory = SHIPPED / name
    _, _, meta, prompts = smol
    module, package, shipped_meta = load_drafter(directory, smol_bf16, meta)
    assert shipped_meta["shipped"]["minutes"] > 5 and shipped_meta["base_fingerprint"] == meta["fingerprint"]
    vocab = torch.tensor(shipped_meta["train_vocab_ids"])
    target = make_target(smol_bf16)
    want = plain_generate(target, prompts, max_new_tokens=32).tokens
    learned = package.make_drafter(module, smol_bf16, mode="chain", vocab=vocab)
    drafters = [learned] + ([HybridDrafter(package.make_drafter(module, smol_bf16, mode="chain", vocab=vocab))]
                            if name == "sequential" else [])  # fmt: skip
    for drafter in drafters:
        got = speculative_generate(target, drafter, prompts, max_new_tokens=32, spec=SpecConfig(gamma=3))
        assert got.tokens == want
        assert got.stats.tau > 1.3, (type(drafter).__name__, got.stats.tau)
