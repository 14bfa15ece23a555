"""Generate from a prompt with plain decoding and one drafter, side by side, with the statistics.

    python -m experiments.generate 'prompt="def fib(n):"' method=prophet_tree   # quoted: Hydra's grammar
    python -m experiments.generate interactive=true method=prompt_lookup   # one prompt a line from stdin
    python -m experiments.generate base_checkpoint=... checkpoints.draft=... method=draft_model temperature=1

A console tool in the spirit of the early public speculative decoding examples: the two outputs are
shown in two panels, the speculative one with every accepted draft token in green (the target's own
tokens, its corrections and bonus tokens, in the default colour), followed by tau, alpha, tokens/s,
speedup, the draft/target time split and acceptance by position. One run per prompt (after a short
warm-up): timings here are a demonstration; experiments.benchmark measures speedups properly. At
temperature 0 a lossless rule must reproduce plain decoding token for token, or this fails loudly.

The settings are checked, and the method's drafter made, by the library the benchmark uses:
experiments/lib/methods/decode_checks.py and experiments/lib/methods/registry.py. This file holds the console tool
itself.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import hydra
import torch
from omegaconf import DictConfig, OmegaConf
from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text
from tokenizers import Tokenizer

from experiments.lib.cli.preflight import hydra_preflight
from experiments.lib.common.errors import USER_ERRORS, exit_on_user_error, one_line
from experiments.lib.data.chat import ChatTemplate, chat_template_for
from experiments.lib.data.prompts import check_prompt_text
from experiments.lib.methods.calibrate import CALIBRATION_DIR, decode_precision
from experiments.lib.methods.decode_checks import (
    check_checkpoints,
    check_decode,
    check_exact,
    check_family_decode,
    check_hybrid_config,
    check_prompt_lookup,
    check_run,
    check_temperature,
    command_line_keys,
    sampling_for,
)
from experiments.lib.methods.registry import (
    ALL_METHODS,
    DRAFTER_KINDS,
    check_drafters_before_base,
    checkpoint_for,
    checkpoint_kinds,
    make_methods,
    shipped_directories,
    verify_widths,
)
from experiments.lib.store.checkpoint import load_lm
from experiments.lib.training.precision import decode_in, resolve_decode_dtype
from experiments.lib.training.settings import check_bool, check_int
from verify.backends.choose import make_target
from verify.backends.graphs import check_mode
from verify.backends.target import Target, TargetOutput
from verify.common.numerics import EosId
from verify.loop.drafter import Draft, Verdict
from verify.loop.plain import Generation, plain_generate
from verify.loop.sampling import SamplingConfig
from verify.loop.speculative import SpecConfig, speculative_generate

ACCEPTED_STYLE = "green"


# ------------------------------------------------------------------------------------ what was accepted


class RecordingDrafter:
    """Any drafter, unchanged, plus a record of every verdict's row 0: (accepted, step tokens).

    The tensors are cloned, not read, so recording adds no host sync to the timed loop."""

    def __init__(self, drafter) -> None:
        self.drafter = drafter
        self.vocab_size: int = drafter.vocab_size
        self.steps: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __getattr__(self, name: str):
        # the optional parts of the drafter protocol (target_layers, attach) are the inner drafter's
        return getattr(self.__dict__["drafter"], name)

    def begin(self, prompts: list[list[int]], prefill: TargetOutput, pending: torch.Tensor) -> None:
        self.drafter.begin(prompts, prefill, pending)

    def propose(self, gamma: int, sampling: SamplingConfig, generator: torch.Generator | None) -> Draft:
        return self.drafter.propose(gamma, sampling, generator)

    def commit(self, verdict: Verdict) -> None:
        self.steps.append((verdict.accepted[0].clone(), verdict.tokens[0].clone()))
        self.drafter.commit(verdict)


def accepted_mask(tokens: list[int], steps: list[tuple[torch.Tensor, torch.Tensor]]) -> list[bool]:
    """Per emitted token: True for an accepted draft token, False for the target's own token.

    The first token comes from the prefill; each step then emits its `accepted` drafts and one token of
    the target's (the last step may be cut by EOS or the budget)."""
    mask, emitted = [False], tokens[:1]
    for accepted, step in steps:
        a = int(accepted)
        mask += [True] * a + [False]
        emitted += step[: a + 1].tolist()
    if emitted[: len(tokens)] != tokens:  # the record and the loop's output must tell the same story
        raise RuntimeError("the recorded verdicts do not reproduce the speculative output")
    return mask[: len(tokens)]


# ------------------------------------------------------------------------------------------- tokenizer


def encode(tokenizer: Tokenizer, text: str) -> list[int]:
    # As in the data pipeline: a literal "<|endoftext|>" in a prompt is text, not a document boundary.
    tokenizer.encode_special_tokens = True
    return tokenizer.encode(text, add_special_tokens=False).ids


def token_pieces(tokenizer: Tokenizer, ids: list[int]) -> list[str]:
    """The text each token adds; "".join(pieces) == tokenizer.decode(ids).

    Byte-level tokens may split a multi-byte character: its text goes to the token that completes it."""
    pieces, shown = [], 0
    for i in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:i])
        if text.endswith("\ufffd") and i < len(ids):  # an incomplete character: wait for its last byte
            pieces.append("")
            continue
        pieces.append(text[shown:])
        shown = len(text)
    return pieces


# --------------------------------------------------------------------------------------- configuration


# decode keys of the benchmark's that generate does not read: typed here, they would silently do nothing
NOT_READ = {
    "decode.temperatures": "temperature",
    "decode.max_new_tokens": "max_new_tokens",
    "decode.batch_size": "nothing (one prompt at a time)",
}


def check_config(cfg: DictConfig) -> tuple[SamplingConfig, SpecConfig, str]:
    """One-line errors for bad settings before anything is loaded or trained; (sampling, spec, resolved rule)."""
    if cfg.method not in ALL_METHODS:
        raise ValueError(f"method={cfg.method!r}: must be one of {', '.join(ALL_METHODS)}")
    if not check_bool("interactive", cfg.interactive):
        check_prompt(cfg.prompt)
    check_int("max_new_tokens", cfg.max_new_tokens)
    if check_bool("prompts.chat", cfg.prompts.chat) and cfg.prompts.system is not None:
        check_prompt_text(cfg.prompts.system, "prompts.system", " (or null for the template's own)")
    check_mode(cfg.compile)
    check_bool("stop_at_eos", cfg.stop_at_eos)
    check_int("warmup_tokens", cfg.warmup_tokens, minimum=0)
    check_int("threads", cfg.threads, allow_null=True)
    check_int("vocab", cfg.vocab, allow_null=True)
    resolve_decode_dtype(cfg.dtype, check_run(cfg))
    typed = command_line_keys()
    for key, instead in NOT_READ.items():
        if key in typed:
            raise ValueError(f"{key} is the benchmark's setting, not read by generate: set {instead}")
    _, spec = check_decode(cfg.decode)  # spec: decode_checks.spec_from, as the benchmark builds it
    sampling, rule = sampling_for(cfg.decode, check_temperature("temperature", cfg.temperature))
    check_prompt_lookup(cfg.prompt_lookup)
    check_hybrid_config(cfg.hybrid)
    shipped_directories(cfg, [cfg.method])  # a shipped_* method's drafter present and whole
    check_family_decode(cfg)
    check_checkpoints(cfg, checkpoint_kinds([cfg.method]))
    return sampling, spec, rule


def check_prompt(prompt: Any) -> str:
    return check_prompt_text(prompt, "prompt", ", e.g. 'prompt=\"def fib(n):\"'")


def methods_config(cfg: DictConfig) -> DictConfig:
    """The keys make_methods reads, resolved, with the one chosen method."""
    keys = ("checkpoints", "artifacts", "prompt_lookup", "hybrid", *DRAFTER_KINDS, "data")
    resolved = {k: OmegaConf.to_container(cfg[k], resolve=True) for k in keys}
    return OmegaConf.create(
        {"methods": [cfg.method], "vocab": cfg.vocab, "shipped_drafters": cfg.shipped_drafters, **resolved}
    )


# ------------------------------------------------------------------------------------------- decoding


@dataclass
class Session:
    """Everything loaded once and reused for every prompt."""

    target: Target
    factory: Callable[[], Any]  # a fresh drafter per generation
    tokenizer: Tokenizer
    eos_id: EosId  # one id, several (a Hugging Face generation_config may list some), or None
    sampling: SamplingConfig
    spec: SpecConfig
    rule: str
    cfg: DictConfig
    template: ChatTemplate | None = None  # prompts.chat=true: the base's chat template
    warm: bool = False


def load_session(cfg: DictConfig, checked: tuple[SamplingConfig, SpecConfig, str]) -> Session:
    """Load (or train, through the artifact cache) the base and the method's drafter; `checked` is check_config's."""
    sampling, spec, rule = checked
    device = check_run(cfg)
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    check_drafters_before_base(methods_config(cfg))  # before the base loads or trains
    base_ckpt = checkpoint_for(cfg, "base")
    base, tokenizer, base_meta = load_lm(base_ckpt, device=str(device))
    key_parts = {"base": base_meta["fingerprint"]}
    precision = decode_precision(cfg.dtype, base, device, key_parts=key_parts, cache_dir=CALIBRATION_DIR)
    decode_in(base, precision)  # drafters load in the base's dtype
    make = make_methods(methods_config(cfg), base, base_meta, base_ckpt, tokenizer)[0][cfg.method]
    # an id or a list of ids (a Hugging Face model's generation_config may list several: checkpoint.hf_eos_id)
    eos_id = base_meta.get("data", {}).get("eos_id", 0) if cfg.stop_at_eos else None
    ordered = cfg.decode.get("ordered", True)
    target = make_target(base, compile=cfg.compile, widths=verify_widths(cfg, [spec.gamma]), ordered=ordered)
    template = chat_template_for(base_meta, system=cfg.prompts.system) if cfg.prompts.chat else None
    return Session(target, lambda: make(compile=cfg.compile), tokenizer, eos_id, sampling, spec, rule, cfg, template)


def decode_both(s: Session, prompt: list[int], max_new_tokens: int) -> tuple[Generation, Generation, RecordingDrafter]:
    """Plain decoding, then the drafter, on one prompt with the same seed and settings."""
    kwargs = dict(max_new_tokens=max_new_tokens, sampling=s.sampling, eos_id=s.eos_id)
    seeded = lambda: torch.Generator(device=s.target.device).manual_seed(s.cfg.seed)  # noqa: E731
    plain = plain_generate(s.target, [prompt], generator=seeded(), **kwargs)
    drafter = RecordingDrafter(s.factory())
    spec = speculative_generate(s.target, drafter, [prompt], spec=s.spec, generator=seeded(), **kwargs)
    return plain, spec, drafter


def generate_one(s: Session, text: str) -> dict[str, Any]:
    """Decode one prompt both ways; the result record (texts, accepted mask, statistics)."""
    text = check_prompt(text)
    if s.template is not None:  # shown as the model reads it: the rendered conversation
        # the user's text encoded as text: a typed "<|im_start|>" never becomes a turn marker
        prompt = s.template.encode(s.tokenizer, [text])
        text = s.template.render([text])
    else:
        prompt = encode(s.tokenizer, text)
    s.target.check_tokens([prompt], max_new_tokens=s.cfg.max_new_tokens)
    if not s.warm and s.cfg.warmup_tokens:
        decode_both(s, prompt, min(s.cfg.warmup_tokens, s.cfg.max_new_tokens))
        s.warm = True
    plain, spec, drafter = decode_both(s, prompt, s.cfg.max_new_tokens)
    plain_ids, spec_ids = plain.tokens[0], spec.tokens[0]
    exact, lossless = check_exact(
        s.cfg.method, plain_ids, spec_ids, rule=s.rule, delta=s.spec.delta, greedy=s.sampling.greedy
    )
    return {
        "prompt": text,
        "method": s.cfg.method,
        "plain": s.tokenizer.decode(plain_ids),
        "speculative": s.tokenizer.decode(spec_ids),
        "plain_ids": plain_ids,
        "speculative_ids": spec_ids,
        "accepted_mask": accepted_mask(spec_ids, drafter.steps),
        "stats": stats_of(plain, spec, rule=s.rule, lossless=lossless, exact=exact, temperature=s.sampling.temperature),
    }


def stats_of(plain: Generation, spec: Generation, **extra: Any) -> dict[str, Any]:
    """The view's figures of one prompt (verify/loop/stats.py's DecodeStats of each decoder), and `extra`."""
    p, q = plain.stats, spec.stats
    return {
        **extra,
        "tau": q.tau,
        "alpha": q.alpha,
        "acceptance_by_position": q.acceptance_by_position,
        "plain_tokens": p.total_tokens,
        "speculative_tokens": q.total_tokens,
        "plain_forwards": int(p.forwards.sum()),
        "speculative_forwards": int(q.forwards.sum()),
        "plain_tokens_per_s": p.tokens_per_s,
        "speculative_tokens_per_s": q.tokens_per_s,
        "speedup": q.tokens_per_s / p.tokens_per_s,
        "plain_seconds": p.time_total,
        "speculative_seconds": q.time_total,
        "time_draft": q.time_draft,
        "time_target": q.time_target,
        "time_other": q.time_other,
        "draft_share": q.time_draft / q.time_total,
        "target_share": q.time_target / q.time_total,
    }


# ------------------------------------------------------------------------------------------- the view


def render(console: Console, s: Session, result: dict[str, Any]) -> None:
    """Two panels (plain | speculative, accepted drafts in green), then the statistics."""
    plain = Text.assemble((result["prompt"], "dim"), result["plain"])
    spec = Text.assemble((result["prompt"], "dim"))
    for piece, accepted in zip(token_pieces(s.tokenizer, result["speculative_ids"]), result["accepted_mask"]):
        spec.append(piece, style=ACCEPTED_STYLE if accepted else None)
    side = Table.grid(expand=True, padding=(0, 1))
    side.add_column(ratio=1, overflow="fold")  # long runs without spaces wrap, never "…"
    side.add_column(ratio=1, overflow="fold")
    side.add_row(Panel(plain, title="plain"), Panel(spec, title=f"speculative: {result['method']}"))
    legend = Text.assemble(
        ("green", ACCEPTED_STYLE),
        " = accepted draft tokens; default colour = the target's own "
        "tokens (corrections and bonus tokens); dim = the prompt",
    )
    console.print(Group(side, legend, stats_table(result["stats"]), verdict_line(result["stats"])))


def stats_table(st: dict[str, Any]) -> Table:
    table = Table(title=f"T={st['temperature']:g}, rule {st['rule']}", title_justify="left")
    for name in ("", "plain", "speculative"):
        table.add_column(name, justify="left" if not name else "right")
    total = st["speculative_seconds"]
    share = lambda t: f"{t:.3f} s ({t / total:.0%})"  # noqa: E731
    table.add_row("tokens", str(st["plain_tokens"]), str(st["speculative_tokens"]))
    table.add_row("target forwards", str(st["plain_forwards"]), str(st["speculative_forwards"]))
    table.add_row("tau (tokens / forward)", "1.00", f"{st['tau']:.2f}")
    table.add_row("alpha (accepted / proposed)", "-", f"{st['alpha']:.2f}")
    table.add_row("tokens/s", f"{st['plain_tokens_per_s']:.1f}", f"{st['speculative_tokens_per_s']:.1f}")
    table.add_row("speedup", "1.00x", f"{st['speedup']:.2f}x")
    table.add_row("time", f"{st['plain_seconds']:.3f} s", f"{total:.3f} s")
    split = " / ".join(share(st[k]) for k in ("time_draft", "time_target", "time_other"))
    table.add_row("  drafter / target / other", "", split)
    by_position = "  ".join(f"{i + 1}:{a:.2f}" for i, a in enumerate(st["acceptance_by_position"])) or "-"
    table.add_row("acceptance by position", "", by_position)
    return table


def verdict_line(st: dict[str, Any]) -> Text:
    if st["exact"]:
        return Text(
            f"identical: at temperature 0 the {st['rule']} rule is lossless, and the outputs match token for token",
            style="bold green",
        )
    if not st["lossless"]:
        return Text(
            f"the {st['rule']} rule is NOT lossless: the output may differ from plain decoding", style="bold yellow"
        )
    return Text(
        f"lossless {st['rule']} rule at temperature {st['temperature']:g}: both are samples of the target's "
        "distribution, so the texts may differ by chance"
    )


# ---------------------------------------------------------------------------------------- entry point


def read_lines(stream) -> Iterator[bytes | str]:
    """Lines from a stream, as they come, until EOF or an empty line. A binary stream's lines are bytes
    (sys.stdin is read through its buffer, so a line that is not UTF-8 is one bad prompt, not a crash)."""
    if stream is None:  # the process was started with its stdin closed
        return
    raw = getattr(stream, "buffer", stream)
    while True:
        if stream.isatty():
            print("prompt> ", end="", flush=True)
        line = raw.readline()
        if not line.strip():
            return
        yield line


def prompt_text(line: bytes | str, number: int) -> str:
    """One stdin line as a prompt: UTF-8 text, without its line ending."""
    if isinstance(line, bytes):
        try:
            line = line.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"stdin line {number} is not UTF-8 text ({e.reason} at byte {e.start}): skipped") from None
    return line.rstrip("\r\n")


def generate(cfg: DictConfig, console: Console | None = None) -> dict[str, Any]:
    """One-shot: the result record of cfg.prompt. Interactive: {"results": [one record per stdin prompt]}.

    Prints the view of each prompt; in interactive mode a bad prompt prints a one-line error and the
    session goes on. Piped input is read up to its first prompt before anything loads: an empty one
    (EOF at once, `< /dev/null`) ends the run with a note, without loading or training anything."""
    console = console or Console()
    checked = check_config(cfg)
    if not cfg.interactive:
        session = load_session(cfg, checked)
        result = generate_one(session, cfg.prompt)
        render(console, session, result)
        return result
    lines = read_lines(sys.stdin)
    if sys.stdin is None or not sys.stdin.isatty():
        first = next(lines, None)
        if first is None:
            console.print("no prompt on standard input (it was empty or closed): nothing to generate")
            return {"results": []}
        lines = itertools.chain([first], lines)
    session, results = load_session(cfg, checked), []
    for number, line in enumerate(lines, start=1):
        try:
            results.append(generate_one(session, prompt_text(line, number)))
        except USER_ERRORS as e:
            console.print(Text(f"error: {one_line(e)}", style="red"))
            continue
        render(console, session, results[-1])
    return {"results": results}


@hydra_preflight
@hydra.main(version_base="1.3", config_path="../conf", config_name="generate")
@exit_on_user_error
def main(cfg: DictConfig) -> None:
    generate(cfg)


if __name__ == "__main__":
    main()
