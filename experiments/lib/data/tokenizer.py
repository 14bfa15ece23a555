"""The tokenizer: a byte-level BPE trained on the training split, or a model's own, loaded from its files.

Byte-level: every byte is in the alphabet, so any text encodes and decodes back exactly. One EOS token
follows every document in the token streams; a literal "<|endoftext|>" inside a document stays text.
`tokenizer_sample` picks the training documents the BPE learns from when its text is capped
(tokenizer_max_bytes): spread over the whole split, never from validation. The id cache's build
(experiments/lib/data/id_cache.py) trains or loads the tokenizer and saves it in its entry, to be loaded back.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS = "<|endoftext|>"
# Documents per encode_batch_fast call; also the most documents in one chunk of the id cache's build,
# whose text is capped by id_cache.ENCODE_BYTES.
ENCODE_CHUNK = 256


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE: every byte is in the alphabet, so any text encodes and decodes back exactly.

    `texts` may be a generator: the trainer pulls documents from it a few at a time and keeps only its
    word counts, not the text."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],  # first special token, so EOS gets id 0
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return configure_tokenizer(tokenizer)


def load_tokenizer(path: str) -> tuple[Tokenizer, int]:
    """A model's own tokenizer: a tokenizer.json file, or a Hugging Face model directory holding one ->
    (tokenizer, EOS id). EOS is tokenizer_config.json's `eos_token` beside it when there is one, else
    a token named <|endoftext|>, </s> or <eos>: documents are joined with it, as the model was trained."""
    file = Path(path) / "tokenizer.json" if Path(path).is_dir() else Path(path)
    if not file.is_file():
        raise ValueError(
            f"tokenizer={path!r}: no such tokenizer.json (give the file or the model directory holding it)"
        )
    tokenizer = configure_tokenizer(Tokenizer.from_file(str(file)))
    names = [EOS, "</s>", "<eos>"]
    config = file.parent / "tokenizer_config.json"
    if config.is_file():
        eos = json.loads(config.read_text()).get("eos_token")
        names = [eos.get("content") if isinstance(eos, dict) else eos] if eos else names
    for name in names:
        if tokenizer.token_to_id(name) is not None:
            return tokenizer, tokenizer.token_to_id(name)
    raise ValueError(f"tokenizer={path!r} has none of the end-of-text tokens {names}: documents need one between them")


def configure_tokenizer(tokenizer: Tokenizer) -> Tokenizer:
    # A literal "<|endoftext|>" inside a document is text, not a document boundary. This flag is not
    # saved in tokenizer.json, so it is set again on every load.
    tokenizer.encode_special_tokens = True
    return tokenizer


def tokenize_documents(tokenizer: Tokenizer, texts: list[str], eos_id: int) -> np.ndarray:
    """(N,) int64: each document's tokens followed by EOS. encode_batch_fast is encode_batch minus offsets."""
    pieces = []
    for i in range(0, len(texts), ENCODE_CHUNK):
        for enc in tokenizer.encode_batch_fast(texts[i : i + ENCODE_CHUNK], add_special_tokens=False):
            pieces += [np.asarray(enc.ids, dtype=np.int64), np.array([eos_id], dtype=np.int64)]
    return np.concatenate(pieces)


def tokenizer_sample(train_positions: list[int], sizes: list[int], max_bytes: int | None) -> list[int]:
    """Which training documents (positions in the corpus) the tokenizer learns from: all of them, or
    with max_bytes every k-th one (k spreads the sample over the whole split), at most max_bytes of text
    and at least one document."""
    if max_bytes is None:
        return list(train_positions)
    total = sum(sizes[j] for j in train_positions)
    picked, taken = [], 0
    for j in train_positions[:: max(1, math.ceil(total / max_bytes))]:
        if picked and taken + sizes[j] > max_bytes:
            break
        picked.append(j)
        taken += sizes[j]
    return picked
