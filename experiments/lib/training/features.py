"""The feature cache: the frozen base's outputs over the training corpus, computed once, read by every drafter.

A drafter trains on what the frozen base computes for each window of tokens: its final hidden states
(the prophet regresses them, Medusa's heads read them), optionally the residual states of chosen layers
(the prophet's EAGLE-3 fusion), and the base's own next-token distribution as its top-k ids and
log-probabilities (the self-distillation teacher, verify/training/distill.py). None of it changes while the
base is frozen, so running the base on every training step (the old recipe) wasted most of the step.

Layout of a cache directory:
    meta.json                   the FeatureSpec (base fingerprint, data key, windows, ...), dims, shard sizes
    shard-00000.safetensors     tokens (n, T+1) int32, hidden (n, T, d), [layers (n, T, S, d)],
    ...                         top_ids (n, T, k) int32, top_logp (n, T, k) float32
Shards are written to a temporary name and renamed, so a shard that exists is complete; an interrupted
run resumes at the first missing shard, and a complete `corpus` or `generated` cache asked for more windows
grows in place (its first windows are the larger cache's: only its short last shard and the new ones are
computed; an explicit features.dir, since the default name hashes the windows). meta.json records the spec, and a
cache for another base, data config or setting is refused in one line (the default directory's name is the
spec's hash, so a retrained base simply gets a new cache).

Sources: `corpus` caches windows of the training split; `greedy` and `sample` cache the base's own
continuations (T = 0 and T = 1) of the first `prompt_len` tokens of those windows: the text the drafter
will really draft for; `generated` caches the base's own answered turns (half greedy, half at T = 1) to the
training question bank in its chat template, one per window, prompts of at most `prompt_len` tokens, with a
`mask` (n, T) that keeps the loss on the answer's tokens (experiments/lib/training/generated.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from experiments.lib.common.errors import atomic_path, remove_orphans, write_atomic
from experiments.lib.common.progress import track
from experiments.lib.training.generated import answer_dtype
from experiments.lib.training.mapped import MappedRows, mapped_tensors
from experiments.lib.training.precision import cast_copy
from prophet.model import base_features
from verify.backends.choose import make_target
from verify.loop.plain import plain_generate
from verify.loop.sampling import SamplingConfig
from verify.training.features import FeatureBatch

log = logging.getLogger(__name__)
FORMAT_VERSION = 1
# Positions per training window when seq_len is null: the base's context, up to this. A pretrained base's
# context (SmolLM2: 8,192) would make each window's cached features 8,192 x width floats (200 windows: 2.1 GB)
# and a drafter needs far less context than the base was trained on to learn the next few tokens.
DEFAULT_WINDOW = 512
SOURCES = ("corpus", "greedy", "sample", "generated")
QUESTIONS = ("bank", "self", "mix")  # the question bank's, the base's own (self_questions.py), both alternating
PREFIX_SOURCES = ("corpus", "generated")  # a larger cache's first windows are a smaller one's (greedy / sample: their
# sampling seeds follow the caching batches)
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
TEACHERS = ("auto", "fp32", "bf16")  # auto: the answers' dtype for source=generated, fp32 for the others


class StaleFeatures(ValueError):
    """A cache directory that holds features of another base, data config or setting."""


@dataclass(frozen=True)
class FeatureSpec:
    """Everything that decides a cache's contents; its hash names the default directory."""

    base_fingerprint: str
    data_key: str  # PreparedData.cache_key: the corpus, split and tokenizer
    seq_len: int  # positions per window (each window holds seq_len + 1 tokens)
    windows: int  # number of windows cached
    source: str = "corpus"
    prompt_len: int = 32  # greedy / sample: corpus tokens before the base's own continuation; generated: the
    # longest chat prompt kept
    layers: tuple[int, ...] = ()  # base blocks whose residual states are kept (1-based)
    top_k: int = 16  # teacher tokens kept per position
    dtype: str = "float16"  # storage of hidden and layer states (the teacher's log-probs stay float32)
    seed: int = 0  # which windows, and the sampling of `sample`
    batch: int = 16  # windows the base runs at once; for greedy / sample it also decides each batch's seed, so
    # it is part of what the cache holds (generated answers do not depend on it)
    answer_tokens: int = 512  # generated: the most tokens the base writes per answered turn
    questions: str = "bank"  # generated: what is answered, QUESTIONS (experiments/lib/training/generated.py)
    self_questions: int | None = None  # generated, questions self / mix: how many of the base's own questions
    # (None: as many as the windows need, all of them for self, half for mix)
    self_steering: bool = True  # ... each steered towards a bank category by a line of system text, or not
    teacher: str = "fp32"  # what the base computes the features in: fp32, or bf16 (what it decodes in on a device
    # that computes bf16 natively: generated answers are bf16 decoding's, so their features are too)

    def __post_init__(self) -> None:
        for name in ("seq_len", "windows", "top_k", "prompt_len", "batch", "answer_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"features.{name}={value!r}: must be an integer >= 1")
        n = self.self_questions
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"features.self_questions={n!r}: must be an integer >= 1, or null (as many as needed)")
        if self.questions not in QUESTIONS:
            raise ValueError(f"features.questions={self.questions!r}: must be one of {', '.join(QUESTIONS)}")
        if not isinstance(self.self_steering, bool):
            raise ValueError(f"features.self_steering={self.self_steering!r}: must be true or false")
        if self.questions != "bank" and self.source != "generated":
            raise ValueError(
                f"features.questions={self.questions!r}: questions are answered by features.source=generated only"
            )
        if self.questions == "bank":  # the self-question settings do nothing: recorded as their defaults, so an
            object.__setattr__(self, "self_questions", None)  # explicit cache directory is not refused over them
            object.__setattr__(self, "self_steering", True)
        if self.seq_len < 2:
            raise ValueError(f"features seq_len={self.seq_len}: must be at least 2")
        if self.source not in SOURCES:
            raise ValueError(f"features.source={self.source!r}: must be one of {', '.join(SOURCES)}")
        if self.source != "corpus" and self.prompt_len > self.seq_len:
            raise ValueError(f"features.prompt_len={self.prompt_len}: must be at most seq_len={self.seq_len}")
        if self.dtype not in DTYPES:
            raise ValueError(f"features.dtype={self.dtype!r}: must be one of {', '.join(DTYPES)}")
        if self.teacher not in TEACHERS[1:]:
            raise ValueError(f"features.teacher={self.teacher!r}: must be fp32 or bf16 (feature_spec resolves auto)")
        object.__setattr__(self, "layers", tuple(self.layers))

    def key(self) -> str:
        record = {**asdict(self), "format": FORMAT_VERSION}
        if self.batch == 16 or self.source == "generated":  # 16: every cache's batch before it was a setting
            del record["batch"]
        if self.source != "generated":  # the setting of generated answers only: other caches keep their names
            del record["answer_tokens"]
        else:
            record["format"] = 2  # one answered turn per window, with its answer mask
        if self.source != "generated" or self.questions == "bank":  # the bank's caches keep their names
            del record["questions"], record["self_questions"], record["self_steering"]
        if self.teacher == "fp32":  # every cache's teacher before it was a setting: those keep their names
            del record["teacher"]
        return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:16]

    def bytes_per_window(self, dim: int) -> int:
        t, width = self.seq_len, DTYPES[self.dtype].itemsize
        return 4 * (t + 1) + width * t * dim * (1 + len(self.layers)) + 8 * t * self.top_k + t


@torch.no_grad()
def teacher_batch(base: nn.Module, tokens: Tensor, *, layers: tuple[int, ...] = (), top_k: int = 16) -> FeatureBatch:
    """Run the frozen base (fp32, no autocast: the teacher is the base that decodes) on tokens (B, T + 1)."""
    hidden, logits, states = base_features(base, tokens[:, :-1], tuple(layers))
    top = logits.float().log_softmax(dim=-1).topk(min(top_k, logits.shape[-1]), dim=-1)
    return FeatureBatch(
        tokens=tokens.long(),
        hidden=hidden.float(),
        top_ids=top.indices,
        top_logp=top.values,
        layers=None if states is None else states.float(),
    )


# ---------------------------------------------------------------------------------------------- writing


def corpus_windows(ids: Tensor, *, seq_len: int, windows: int | None, seed: int) -> Tensor:
    """(N, seq_len + 1) non-overlapping windows of a token stream, a seeded random choice of them."""
    available = (ids.numel() - 1) // seq_len
    if available < 1:
        raise ValueError(f"the training split has {ids.numel()} tokens, fewer than seq_len + 1 = {seq_len + 1}")
    if windows is not None and windows > available:
        raise ValueError(
            f"features.windows={windows}: the training split holds only {available} windows of {seq_len} tokens"
        )
    order = torch.randperm(available, generator=torch.Generator().manual_seed(seed))[: windows or available]
    return ids[order[:, None] * seq_len + torch.arange(seq_len + 1)].long()


def continue_windows(base: nn.Module, windows: Tensor, *, prompt_len: int, temperature: float, seed: int) -> Tensor:
    """The base's own continuation of each window's first prompt_len tokens, to the window's length."""
    new = windows.shape[1] - prompt_len
    prompts = windows[:, :prompt_len].tolist()
    generator = torch.Generator(device=windows.device).manual_seed(seed)
    out = plain_generate(
        make_target(base),
        prompts,
        max_new_tokens=new,
        sampling=SamplingConfig(temperature=temperature),
        generator=generator,
    ).tokens  # no EOS stop: every row runs to full length
    return torch.cat((windows[:, :prompt_len], torch.tensor(out, dtype=torch.long, device=windows.device)), dim=1)


def _shard_path(directory: Path, i: int) -> Path:
    return directory / f"shard-{i:05d}.safetensors"


def _check_meta(directory: Path, spec: FeatureSpec, *, grow: bool = False) -> dict | None:
    """The directory's meta.json, refused in one line when it records another spec; None when absent.

    A cache that holds more layers than asked serves the request (a fused prophet's cache serves Medusa); a complete
    `corpus` or `generated` cache of more windows serves fewer, its first ones (the windows a smaller cache of the
    same setting would hold: both sources take windows in a fixed order), so a data-scaling study caches once.
    grow=True (writing): a complete cache of those sources with fewer windows is accepted too, to be grown."""
    path = directory / "meta.json"
    if not path.exists():
        return None
    try:
        meta = json.loads(path.read_text())
        found = FeatureSpec(**{**meta["spec"], "layers": tuple(meta["spec"]["layers"])})
    except (ValueError, KeyError, TypeError) as e:
        raise StaleFeatures(
            f"{path} is not a feature cache's meta.json ({type(e).__name__}): delete {directory} or choose another "
            "directory"
        ) from None
    wanted = asdict(spec) | {"layers": found.layers if set(spec.layers) <= set(found.layers) else spec.layers}
    if meta.get("complete") and found.source in PREFIX_SOURCES and (grow or found.windows >= spec.windows):
        wanted["windows"] = found.windows
    diff = ", ".join(f"{k}: cached {v!r}, wanted {wanted[k]!r}" for k, v in asdict(found).items() if v != wanted[k])
    if diff:
        raise StaleFeatures(
            f"feature cache {directory} was written for another setting ({diff}): delete it or choose another directory"
        )
    return meta


def write_features(
    directory: str | Path,
    base: nn.Module,
    train_ids: Tensor,
    spec: FeatureSpec,
    *,
    answered: tuple[Tensor, Tensor] | None = None,
    shard_windows: int = 256,
    batch_size: int | None = None,
) -> Path:
    """Compute and store the cache for `spec` (resumes an interrupted one, grows a smaller one); returns the directory.
    answered: source `generated`'s windows (N, T + 1) and answer masks (N, T) (generated.generated_windows)."""
    directory = Path(directory)
    meta = _check_meta(directory, spec, grow=True)
    if meta is not None and meta.get("complete") and meta["spec"]["windows"] < spec.windows:
        meta = _grown(directory, meta, spec.windows)
    if meta is not None and meta.get("complete"):
        return directory
    if meta is not None:  # resume the interrupted cache exactly as it was begun (its layers, its shard size)
        spec = FeatureSpec(**{**meta["spec"], "layers": tuple(meta["spec"]["layers"])})
        shard_windows = meta["shard_windows"]
    dim = base.to_logits.in_features
    size = spec.windows * spec.bytes_per_window(dim)
    shards = -(-spec.windows // shard_windows)
    log.info(
        "feature cache %s: %d windows x %d positions (%s), %d shards, about %.2f GB",
        directory,
        spec.windows,
        spec.seq_len,
        spec.source,
        shards,
        size / 1e9,
    )
    directory.mkdir(parents=True, exist_ok=True)
    for orphan in remove_orphans(directory):  # a run killed mid-shard left its temporary file: gigabytes
        log.info("removed %s, a shard a killed run was writing", orphan)
    meta = {
        "spec": asdict(spec),
        "format": FORMAT_VERSION,
        "dim": dim,
        "shard_windows": shard_windows,
        "shards": shards,
        "bytes": size,
        "complete": False,
    }
    _write_meta(directory, meta)
    device = next(base.parameters()).device
    teacher = cast_copy(base, spec.teacher)
    masks = None
    if spec.source == "generated":
        if answered is None or answered[0].shape != (spec.windows, spec.seq_len + 1):
            got = None if answered is None else tuple(answered[0].shape)
            raise ValueError(f"features.source=generated needs windows ({spec.windows}, {spec.seq_len + 1}), got {got}")
        windows, masks = answered
    else:
        windows = corpus_windows(train_ids, seq_len=spec.seq_len, windows=spec.windows, seed=spec.seed)
    # a shard takes minutes: progress moves with each teacher batch, as a bar on a terminal, a log line elsewhere
    with track("features", spec.windows, unit="windows", logger=log) as progress:
        for i in range(shards):
            rows = windows[i * shard_windows : (i + 1) * shard_windows]
            if _shard_rows(directory, i) == len(rows):  # written by an earlier run
                progress.skip(len(rows))
                continue
            _write_shard(  # missing, or a smaller cache's last shard (grown)
                directory,
                i,
                teacher,
                rows,
                spec,
                batch_size=batch_size or spec.batch,
                device=device,
                mask=None if masks is None else masks[i * shard_windows : (i + 1) * shard_windows],
                done=progress.advance,
            )
    _write_meta(directory, {**meta, "complete": True})
    return directory


def _grown(directory: Path, meta: dict, windows: int) -> dict:
    """A complete cache's meta, reopened for `windows` windows: its first windows are the larger cache's (the
    source takes them in a fixed order), so its whole shards are kept and only the rest is computed (SmolLM2's
    answer windows grown from 2,016 to 3,616: 1,792 windows fewer to compute, 12 minutes of teacher on 2 cores)."""
    old = meta["spec"]["windows"]
    log.info("feature cache %s grows from %d to %d windows: its %d whole shards are kept", directory, old, windows,
             old // meta["shard_windows"])  # fmt: skip
    meta = {**meta, "spec": {**meta["spec"], "windows": windows}, "complete": False}
    _write_meta(directory, meta)  # at once: a grow cut short resumes as the larger cache; the old last shard, short
    return meta  # of rows, is written again (write_features checks each shard's rows)


def _shard_rows(directory: Path, i: int) -> int:
    """Windows shard i holds; 0 when it is not written."""
    path = _shard_path(directory, i)
    if not path.exists():
        return 0
    with safe_open(str(path), framework="pt") as shard:
        return shard.get_slice("tokens").get_shape()[0]


def _write_meta(directory: Path, meta: dict) -> None:
    write_atomic(directory / "meta.json", json.dumps(meta, indent=1))  # never half-written, even on a full disk


def _write_shard(
    directory: Path,
    i: int,
    base: nn.Module,
    rows,
    spec: FeatureSpec,
    *,
    batch_size: int,
    device: torch.device,
    mask: Tensor | None = None,
    done: Callable[[int], None] | None = None,
) -> None:
    """rows: (n, T + 1) windows; mask (n, T): source `generated`'s answer positions, stored with them. `base` is
    the teacher, already in spec.teacher's dtype; done(k) is called as each batch of k windows is computed."""
    n, t = rows.shape[0], rows.shape[1] - 1
    store, dim = DTYPES[spec.dtype], base.to_logits.in_features
    out = {
        "tokens": torch.zeros(n, t + 1, dtype=torch.int32),
        "hidden": torch.zeros(n, t, dim, dtype=store),
        "top_ids": torch.zeros(n, t, spec.top_k, dtype=torch.int32),
        "top_logp": torch.zeros(n, t, spec.top_k, dtype=torch.float32),
    }
    if spec.layers:
        out["layers"] = torch.zeros(n, t, len(spec.layers), dim, dtype=store)
    for j, (index, length) in enumerate(_chunks(rows, mask, batch_size)):
        chunk, seed = rows[index, :length].to(device), spec.seed * 1_000_003 + i * 4099 + j
        if spec.source in ("greedy", "sample"):  # every chunk has its own seed, so a resumed shard samples the same
            chunk = continue_windows(
                base, chunk, prompt_len=spec.prompt_len, seed=seed, temperature=0.0 if spec.source == "greedy" else 1.0
            )
        batch = teacher_batch(base, chunk, layers=spec.layers, top_k=spec.top_k)
        if mask is None:  # greedy / sample wrote their own continuations; answered turns are stored as given
            out["tokens"][index, :length] = batch.tokens.int().cpu()
        out["hidden"][index, : length - 1] = batch.hidden.to(store).cpu()
        out["top_ids"][index, : length - 1] = batch.top_ids.int().cpu()
        out["top_logp"][index, : length - 1] = batch.top_logp.float().cpu()
        if batch.layers is not None:
            out["layers"][index, : length - 1] = batch.layers.to(store).cpu()
        if done is not None:
            done(len(index))
    if mask is not None:
        out["tokens"] = rows.int()  # whole, the padding past each answer too
        out["mask"] = mask.to(torch.uint8).contiguous()
    # a shard that exists is whole; a failed write (a full disk: shards are gigabytes) leaves no temporary file and
    # the shard it was replacing (a grown cache's short last one) as it was
    with atomic_path(_shard_path(directory, i)) as tmp:
        save_file(out, str(tmp))


def _chunks(rows: Tensor, mask: Tensor | None, batch_size: int) -> list[tuple[Tensor, int]]:
    """The teacher's batches of a shard: (window indices, tokens each is cut to). Windows in order, whole, without
    a mask; with one (answered turns, padded past the answer), by length and cut after their last answer token:
    a window is on average two thirds answered turn and one third padding, and a batch that runs to its longest
    window computed the padding of the others (on SmolLM2's answers the teacher computes 30% fewer positions and
    takes 30% less time).
    Causal attention: what a position computes does not depend on the tokens after it, so a cut changes what the
    loss reads only by float rounding (products of another shape: 1e-6 in fp32); positions past the answer are
    masked, and stored as zeros."""
    n, t = rows.shape[0], rows.shape[1] - 1
    if mask is None:
        return [(torch.arange(j, min(j + batch_size, n)), t + 1) for j in range(0, n, batch_size)]
    last = torch.where(mask.any(1), t - 1 - mask.flip(1).int().argmax(1), 0)  # (n,) the last answer position
    lengths = last + 2  # tokens up to the last answer token
    order = torch.sort(lengths, stable=True).indices
    return [(index, int(lengths[index].max())) for index in order.split(batch_size)]


# ---------------------------------------------------------------------------------------------- reading


class FeatureCache:
    """A complete cache, loaded into memory (only the fields and layers `spec` asks for), checked against it.
    mapped=True: the hidden and layer states stay in the shards' files, read a batch's rows at a time (mapped.py)."""

    def __init__(self, directory: str | Path, spec: FeatureSpec, *, mapped: bool = False) -> None:
        directory = Path(directory)
        meta = _check_meta(directory, spec)
        if meta is None or not meta.get("complete"):
            raise ValueError(
                f"feature cache {directory} is missing or incomplete: write it first (experiments.cache_features)"
            )
        cached_layers = list(meta["spec"]["layers"])
        keep = [cached_layers.index(layer) for layer in spec.layers]  # the asked layers, in the asked order
        self.data: dict[str, Tensor | MappedRows] = {}  # filled shard by shard: a 1M-token cache of 3 layers is
        filled = 0  # 9 GB, and concatenating shards would hold it twice
        big = {"hidden", "layers"} if mapped else set()
        for i in range(meta["shards"]):
            if filled >= spec.windows:
                break  # the first spec.windows windows of a larger cache (_check_meta)
            maps = mapped_tensors(_shard_path(directory, i), big) if big else {}
            with safe_open(str(_shard_path(directory, i)), framework="pt") as shard:
                n = min(shard.get_slice("tokens").get_shape()[0], spec.windows - filled)
                names = ["tokens", "hidden", "top_ids", "top_logp"] + ["layers"] * bool(keep)
                for name in names + ["mask"] * ("mask" in shard.keys()):
                    if name in maps:
                        rows = self.data.setdefault(name, MappedRows(keep if name == "layers" else None))
                        rows.append(maps[name][:n])
                        continue
                    part = shard.get_slice(name)[:n]
                    part = part[:, :, keep] if name == "layers" else part.bool() if name == "mask" else part
                    if name not in self.data:
                        self.data[name] = torch.empty(spec.windows, *part.shape[1:], dtype=part.dtype)
                    self.data[name][filled : filled + n] = part
            filled += n
        self.directory, self.spec, self.dim = directory, spec, meta["dim"]
        if filled != spec.windows or self.data["tokens"].shape != (spec.windows, spec.seq_len + 1):
            raise StaleFeatures(
                f"feature cache {directory} holds tokens {(filled, *self.data['tokens'].shape[1:])}, "
                f"not ({spec.windows}, {spec.seq_len + 1}): delete it and write it again"
            )

    @property
    def windows(self) -> int:
        return self.spec.windows

    def batch(self, rows: Tensor) -> FeatureBatch:
        """Windows `rows` (B,) as float32 / long tensors on the CPU."""
        d = self.data
        layers = d["layers"][rows].float() if "layers" in d else None
        return FeatureBatch(
            tokens=d["tokens"][rows].long(),
            hidden=d["hidden"][rows].float(),
            top_ids=d["top_ids"][rows].long(),
            top_logp=d["top_logp"][rows],
            layers=layers,
            mask=d["mask"][rows] if "mask" in d else None,
        )

    def sample(self, *, step: int, seed: int, batch_size: int) -> FeatureBatch:
        """B random windows, a pure function of (seed, step) like the base's batches: resuming needs no state."""
        generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
        return self.batch(torch.randint(0, self.windows, (batch_size,), generator=generator))


def open_features(
    base: nn.Module,
    train_ids: Tensor,
    spec: FeatureSpec,
    *,
    answered: tuple[Tensor, Tensor] | None = None,
    directory: str | Path | None = None,
    root: str | Path = ".cache/features",
    mapped: bool = False,
) -> FeatureCache:
    """The cache for `spec`, written first when missing or incomplete (in `directory`, or root/<spec key>); mapped:
    its hidden and layer states read from the files a batch at a time, not loaded.

    An explicit `directory` may hold more layers than `spec` asks for: one cache serves every drafter."""
    directory = Path(directory) if directory is not None else Path(root) / spec.key()
    write_features(directory, base, train_ids, spec, answered=answered)
    return FeatureCache(directory, spec, mapped=mapped)


def check_features_config(features: dict) -> None:
    """One-line errors for conf/features values, before any base runs (a placeholder spec validates them)."""
    for name in ("use", "mapped"):
        if not isinstance(features.get(name, False), bool):
            raise ValueError(f"features.{name} must be true or false, got {features[name]!r}")
    windows = features["windows"]
    if windows is not None and (isinstance(windows, bool) or not isinstance(windows, int) or windows < 1):
        raise ValueError(f"features.windows={windows!r}: must be a positive integer or null (every window)")
    batch = features["answer_batch"]
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"features.answer_batch={batch!r}: must be an integer >= 1 (rows answered at once)")
    if features["teacher"] not in TEACHERS:
        raise ValueError(f"features.teacher={features['teacher']!r}: must be one of {', '.join(TEACHERS)}")
    if not isinstance(features["answers_root"], str) or not features["answers_root"]:
        raise ValueError(f"features.answers_root={features['answers_root']!r}: give a directory for the answers")
    shipped = features.get("answers_shipped")
    if shipped is not None and (not isinstance(shipped, str) or not shipped):
        raise ValueError(f"features.answers_shipped={shipped!r}: give a directory of shipped answers, or null")
    FeatureSpec(
        base_fingerprint="",
        data_key="",
        seq_len=max(2, features["prompt_len"]) if isinstance(features["prompt_len"], int) else 2,
        windows=1,
        source=features["source"],
        prompt_len=features["prompt_len"],
        top_k=features["top_k"],
        dtype=features["dtype"],
        seed=features["seed"],
        batch=features["batch"],
        answer_tokens=features["answer_tokens"],
        questions=features["questions"],
        self_questions=features["self_questions"],
        self_steering=features["self_steering"],
    )


def feature_spec(
    features: dict,
    *,
    base_meta: dict,
    data,
    seq_len: int,
    layers: tuple[int, ...] = (),
    device: torch.device | None = None,
) -> FeatureSpec:
    """The spec of conf/features for this base, data and window length on `device` (the base's: it decides what
    teacher=auto means); windows=null means every non-overlapping window of the training split."""
    windows = features["windows"] if features["windows"] is not None else (data.train_ids.numel() - 1) // seq_len
    return FeatureSpec(
        base_fingerprint=base_meta["fingerprint"],
        data_key=data.cache_key,
        seq_len=seq_len,
        windows=windows,
        source=features["source"],
        prompt_len=features["prompt_len"],
        layers=tuple(layers),
        top_k=features["top_k"],
        dtype=features["dtype"],
        seed=features["seed"],
        batch=features["batch"],
        answer_tokens=features["answer_tokens"],
        questions=features["questions"],
        self_questions=features["self_questions"],
        self_steering=features["self_steering"],
        teacher=teacher_dtype(features["teacher"], features["source"], device or torch.device("cpu")),
    )


def teacher_dtype(requested: str, source: str, device: torch.device) -> str:
    """What the base computes the cached features in. auto: for source=generated, the dtype its answers were
    decoded in (bf16 where the device computes it natively, as the benchmark decodes the base there: a drafter then
    trains on the states it will read, and the teacher pass runs 1.7x faster than fp32's on an AVX512-bf16 CPU);
    fp32 for the other sources."""
    if requested != "auto":
        return requested
    return answer_dtype(device) if source == "generated" else "fp32"


def default_seq_len(seq_len: int | None, max_seq_len: int) -> int:
    """The training window: `seq_len` when given, else the base's context `max_seq_len` up to DEFAULT_WINDOW."""
    return seq_len if seq_len is not None else min(max_seq_len, DEFAULT_WINDOW)
