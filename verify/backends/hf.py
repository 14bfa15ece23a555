"""Hugging Face `transformers` causal LMs as the frozen base: the attributes the drafters read of a base,
and a target with the same interface as `verify.backends.target.Target`, so the one speculative loop, plain
decoding and every drafter run on them unchanged.

`transformers` is optional: this module imports it only inside the functions that need it.

The target keeps transformers' own KV cache (`DynamicCache`) and handles rows that accept different
numbers of tokens without moving anything: every extend appends k slots to every row; a row's rejected
slots stay in the cache as holes that its attention mask hides from then on, and each token gets its
position from `position_ids` (a row's count of valid tokens, plus its depth in a tree), not from its
slot. Slots no row keeps at the end are cropped (`cache.crop(-n)`), so a batch of one never has holes.
Tree drafts see their ancestors through a 4D attention mask (b, 1, k, slots + k), in the form the model's
attention implementation reads: transformers hands a 4D mask to the attention function unchanged, and SDPA
reads a boolean one (True = attend) while eager attention adds it to the scores (so it gets 0 = attend and
the dtype's minimum = blocked; a boolean mask there would add +1 / +0 and mask nothing).

What the adapter runs exactly (`check_decodable`, at construction; anything else is refused in one line):
models whose positions come from `position_ids` (rotary or learned absolute positions: Llama, Mistral,
Qwen, GPT-2, GPT-NeoX, OPT, Falcon without ALiBi, GPT-Neo, ...), full or sliding-window attention layers,
eager or sdpa attention. ALiBi (Bloom, MPT, Falcon with alibi=True) biases attention by slot distance,
which holes and tree nodes break, and is refused. A sliding window limits the target's context to the
window (max_seq_len = min(the model's maximum, the window)): no query is ever a window away from a key,
so sliding attention equals full attention and the cache keeps every layer whole.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from einops import repeat
from torch import Tensor, nn

from verify.backends.cache import tree_attention
from verify.backends.engine import check_layers
from verify.backends.target import TargetOutput, check_prompts, pad_prompts, right_to_left
from verify.common.vocab import check_vocab, trim_linear

# Transforms some CausalLM classes apply to the output layer's logits; the adapter computes logits from the
# backbone's hidden states with the output layer alone, so it refuses models that have them.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "output_multiplier_scale", "logits_scaling")
# Where configs keep the longest sequence the model takes (GPT-2 n_positions, ChatGLM seq_length, MPT max_seq_len).
_MAX_LENGTH_FIELDS = (
    "max_position_embeddings",
    "n_positions",
    "n_ctx",
    "seq_length",
    "max_seq_len",
    "max_sequence_length",
)
# The mask form each attention implementation reads from a 4D attention_mask.
MASK_FORMS = {"sdpa": "bool", "eager": "additive"}
_LAYER_TYPES = ("full_attention", "sliding_attention")


def _name(config) -> str:
    return f"{config.model_type} model" if getattr(config, "model_type", None) else "model"


def max_length(config) -> int:
    """The longest sequence the model takes, from the field its architecture uses; refused when none is set."""
    for field in _MAX_LENGTH_FIELDS:
        value = getattr(config, field, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    raise ValueError(
        f"{_name(config)} has no maximum length in its config: the adapter needs one of {', '.join(_MAX_LENGTH_FIELDS)}"
    )


def _uses_alibi(config) -> bool:
    attn = getattr(config, "attn_config", None)  # MPT keeps it there
    return (
        getattr(config, "model_type", None) == "bloom"
        or bool(getattr(config, "alibi", False))
        or bool(getattr(attn, "alibi", False) if not isinstance(attn, dict) else attn.get("alibi", False))
        or getattr(config, "position_embedding_type", None) == "alibi"
    )


def _layer_types(config) -> list[str]:
    """Each decoder layer's attention kind, as transformers' cache infers it."""
    types = getattr(config, "layer_types", None)
    if types is not None:
        return list(types)
    if getattr(config, "attention_chunk_size", None) is not None:
        return ["chunked_attention"]
    sliding = getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True)
    return ["sliding_attention" if sliding else "full_attention"]


def check_decodable(config) -> int:
    """Refuse, in one line, a causal LM the adapter cannot decode exactly; return the target's context length
    (the model's maximum, or its sliding window where that is shorter)."""
    name = _name(config)
    if _uses_alibi(config):
        raise ValueError(
            f"{name} uses ALiBi position biases: the adapter supports models whose positions come from "
            "position_ids (rotary or learned absolute positions)"
        )
    longest = max_length(config)
    kinds = _layer_types(config)
    other = sorted(set(kinds) - set(_LAYER_TYPES))
    if other:
        raise ValueError(f"{name} has {other[0]} layers: the adapter supports {' and '.join(_LAYER_TYPES)} layers")
    local = getattr(config, "attention_layers", None) or []  # GPT-Neo masks its local layers itself, by cache slot
    if "local" in local and config.window_size < longest:
        raise ValueError(
            f"{name} has local attention layers with window_size={config.window_size} < its maximum length "
            f"{longest}: the adapter supports GPT-Neo only where the window covers the whole context"
        )
    if "sliding_attention" in kinds:
        window = getattr(config, "sliding_window", None)
        if not isinstance(window, int) or window < 1:
            raise ValueError(
                f"{name} has sliding-window layers with sliding_window={window!r}: must be an integer >= 1"
            )
        longest = min(longest, window)
    return longest


def attention_mask(allow: Tensor, implementation: str, dtype: torch.dtype) -> Tensor:
    """allow (b, n, slots) boolean -> the 4D mask (b, 1, n, slots) in the form `implementation` reads."""
    allow = allow[:, None]
    if MASK_FORMS[implementation] == "bool":
        return allow
    return torch.zeros(allow.shape, dtype=dtype, device=allow.device).masked_fill_(~allow, torch.finfo(dtype).min)


class _Embedding(nn.Module):
    """`base.token_emb.emb`, as x-transformers names the input embedding (what the prophet borrows)."""

    def __init__(self, emb: nn.Embedding):
        super().__init__()
        self.emb = emb


class HFBase(nn.Module):
    """A `transformers` causal LM seen as the project sees a base.

    forward(tokens (b, n)) -> logits (b, n, V), like an x-transformers TransformerWrapper, so base training
    and its loss need no change; `features` gives hidden states and layer states for drafter training.
    `num_tokens`, `max_seq_len`, `depth`, `to_logits` (the output layer) and `token_emb.emb` (the input
    embedding) are what drafters read; the last two are the HF model's own modules, not copies.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        config = model.config
        if getattr(config, "is_encoder_decoder", False):
            raise ValueError(f"{type(model).__name__} is an encoder-decoder: HFBase takes a causal LM")
        for name in _LOGIT_TRANSFORMS:
            if getattr(config, name, None) not in (None, 1, 1.0):
                raise ValueError(
                    f"{type(model).__name__} has {name}={getattr(config, name)!r}: the adapter supports "
                    "causal LMs whose logits are the output layer applied to the final hidden state"
                )
        if not isinstance(model.get_output_embeddings(), nn.Linear):
            raise ValueError(f"{type(model).__name__} has no nn.Linear output layer (get_output_embeddings)")
        self.hf = model
        self.num_tokens: int = config.vocab_size
        self.max_seq_len: int = check_decodable(config)  # the model's maximum length, or its sliding window
        self.depth: int = config.num_hidden_layers

    @property
    def to_logits(self) -> nn.Linear:
        return self.hf.get_output_embeddings()

    @property
    def token_emb(self) -> _Embedding:
        return _Embedding(self.hf.get_input_embeddings())

    def forward(self, tokens: Tensor) -> Tensor:
        """tokens (b, n) -> logits (b, n, V)."""
        return self.hf(input_ids=tokens, use_cache=False).logits

    def backbone(
        self, tokens: Tensor, *, layers: tuple[int, ...] = (), **kwargs
    ) -> tuple[Tensor, Tensor | None, object]:
        """Run the model without its output layer: final hidden states (b, n, d) after the final norm, the
        states after `layers` (b, n, S, d) or None, and the model output (its `past_key_values`)."""
        out = self.hf.base_model(input_ids=tokens, output_hidden_states=bool(layers), **kwargs)
        # hidden_states[i] is the residual stream after block i (0: the embeddings), as layer i is defined
        # for every base (verify.backends.engine.check_layers); layer `depth` is refused there.
        states = torch.stack([out.hidden_states[i] for i in layers], dim=2) if layers else None
        return out.last_hidden_state, states, out

    @torch.no_grad()
    def features(self, tokens: Tensor, layers: tuple[int, ...] = ()) -> tuple[Tensor, Tensor, Tensor | None]:
        """(hidden (b, n, d), logits (b, n, V), layer states (b, n, S, d) or None), all float32."""
        layers = check_layers(layers, self.depth)
        hidden, states, _ = self.backbone(tokens, layers=layers, use_cache=False)
        logits = self.to_logits(hidden)
        return hidden.float(), logits.float(), None if states is None else states.float()


def load_hf_base(
    directory: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> HFBase:
    """A causal LM saved by `save_pretrained` in a local directory (config.json + *.safetensors).
    Never downloads: `local_files_only`; never unpickles: safetensors only."""
    path = Path(directory)
    if not (path / "config.json").is_file():
        raise ValueError(f"{directory}: not a Hugging Face model directory (no config.json)")
    if not any(path.glob("*.safetensors")):
        raise ValueError(f"{directory}: no *.safetensors weights (pickled .bin weights are refused: they can run code)")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, use_safetensors=True, dtype=dtype)
    return HFBase(model).to(device).eval()


class HFTarget:
    """A frozen `HFBase` plus transformers' KV cache, with the interface of `verify.backends.target.Target`:
    prefill, extend (a chain or a tree in one forward), per-row commit (rollback), row_lengths.

    `vocab` (ids (N,)) makes every output's logits (b, n, N) over that subset: for a draft model.
    Eager only (`compile=True` is refused): the cache grows by concatenation, so shapes change every step.
    """

    def __init__(
        self,
        base: HFBase,
        *,
        pad_id: int = 0,
        compile: bool = False,
        vocab: Tensor | None = None,
        max_draft: int = 64,
        widths: tuple[int, ...] = (1,),
        ordered: bool = True,
    ):
        # widths are the lean engine's compiled widths; a DynamicCache needs none. max_draft: see GPT-Neo below.
        # ordered: the lean engine's position-ordered attention; transformers' forward sums its own way.
        self.ordered = False
        self.ordered_attention = "-"
        if not isinstance(base, HFBase):
            raise ValueError(f"HFTarget takes an HFBase, got {type(base).__name__}")
        if compile:
            raise ValueError(
                f"compile={compile!r}: the Hugging Face adapter runs eager only (its cache grows every step); "
                "use compile=false, or engine=lean for a Llama"
            )
        self.attention = base.hf.config._attn_implementation
        if self.attention not in MASK_FORMS:
            raise ValueError(
                f"attn_implementation={self.attention!r}: the Hugging Face target supports "
                f"{', '.join(MASK_FORMS)} (its per-row and tree masks are 4D)"
            )
        base.eval()
        for p in base.parameters():
            p.requires_grad_(False)
        self.model = base
        self.vocab = check_vocab(vocab, base.num_tokens)
        self.weight, self.bias = trim_linear(base.to_logits, self.vocab)  # (N, d), (N,) or None
        self.vocab_size, self.max_seq_len, self.pad_id = base.num_tokens, base.max_seq_len, pad_id
        if base.hf.config.model_type == "gpt_neo":
            # GPT-Neo indexes its causal mask, sized by its maximum length, by cache slot; a step appends up to
            # max_draft slots after the longest row (rows that finished keep theirs): leave that room.
            self.max_seq_len -= max_draft
            if self.max_seq_len < 2:
                raise ValueError(
                    f"max_draft={max_draft}: a GPT-Neo target needs max_draft < its maximum length "
                    f"{base.max_seq_len} - 1 (steps append up to max_draft slots within it)"
                )
        self.device = next(base.parameters()).device
        self.layers: tuple[int, ...] = ()
        self.reset()

    def reset(self) -> None:
        self.cache = None
        self.valid: Tensor | None = None  # (b, slots) which cache slots hold a token of the row
        self.lengths: Tensor | None = None  # (b,) valid tokens per row
        self.added = 0  # slots the last extend appended

    def use_layers(self, layers: tuple[int, ...]) -> None:
        """From the next forward on, outputs carry the residual states after these blocks (see `Target`)."""
        self.layers = check_layers(layers, self.model.depth)

    @property
    def row_lengths(self) -> Tensor:
        return self.lengths

    def check_tokens(self, prompts: list[list[int]], *, max_new_tokens: int) -> None:
        check_prompts(prompts, vocab_size=self.vocab_size, max_seq_len=self.max_seq_len, max_new_tokens=max_new_tokens)

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], *, last_logits: bool = False) -> TargetOutput:
        """Run the prompts; returns outputs for every prompt position, left-padded (row b ends at index W - 1);
        last_logits: the logits of each row's last position only (b, 1, V), as `Target.prefill`."""
        from transformers import DynamicCache

        tokens, lengths = pad_prompts(prompts, self.pad_id, self.device)  # right-padded: (b, W)
        b, width = tokens.shape
        # Full layers everywhere (no config): a sliding layer's cache would drop slots the context still uses,
        # and check_decodable keeps the context within any window.
        self.cache = DynamicCache()
        self.valid = torch.arange(width, device=self.device) < lengths[:, None]  # (b, W)
        causal = torch.ones(width, width, dtype=torch.bool, device=self.device).tril()
        positions = repeat(torch.arange(width, device=self.device), "w -> b w", b=b)
        out = self._forward(tokens, causal & self.valid[:, None, :], positions)
        self.lengths, self.added = lengths, 0
        self._crop()
        logits, hidden, layers = (
            None if x is None else right_to_left(x, lengths) for x in (out.logits, out.hidden, out.layers)
        )
        return TargetOutput(logits[:, -1:] if last_logits else logits, hidden, layers)

    @torch.inference_mode()
    def extend(self, tokens: Tensor, *, parents: Tensor | None = None) -> TargetOutput:
        """Run k new tokens (b, k) on top of the cache and append them (chain, or a tree with `parents`
        (k,) or (b, k), -1 = child of the cached prefix: a node sees the prefix, its ancestors and itself)."""
        b, k = tokens.shape
        if parents is None:
            allow = torch.ones(k, k, dtype=torch.bool, device=self.device).tril().expand(b, k, k)
            depth = torch.arange(k, device=self.device).expand(b, k)
        else:
            parents = repeat(parents, "k -> b k", b=b) if parents.ndim == 1 else parents
            allow, depth = tree_attention(parents.to(self.device))
        if self.valid.shape[1] + k > self.model.max_seq_len:  # holes could push slots past the model's length
            self._compact()
        mask = torch.cat((self.valid[:, None, :].expand(b, k, -1), allow), dim=2)  # (b, k, slots + k)
        # Rows that finished still run (their outputs unused) and may pass the model's last position: clamp,
        # or a model with learned positions (GPT-2, OPT, GPT-Neo) indexes past its position table.
        positions = (self.lengths[:, None] + depth).clamp(max=self.model.max_seq_len - 1)
        out = self._forward(tokens, mask, positions)
        self.valid = torch.cat((self.valid, torch.ones(b, k, dtype=torch.bool, device=self.device)), dim=1)
        self.lengths, self.added = self.lengths + k, self.added + k
        return out

    def commit(self, keep: Tensor, *, prefix: bool = False) -> None:
        """Roll back: of the last k slots (k <= slots appended since the last commit or prefill, all of
        them valid), keep those where keep (b, k) is True. Kept tokens must be root paths (a chain
        prefix, a tree's accepted path): their positions were given at extend time as length + depth.
        `prefix` (the Target interface's hint) changes nothing: nothing here is read back to the host."""
        b, k = keep.shape
        if b != self.valid.shape[0] or k > self.added:
            raise ValueError(
                f"commit: keep has shape {(b, k)}; the target holds {self.valid.shape[0]} rows and "
                f"{self.added} slots appended since the last commit"
            )
        keep = keep.to(self.device)
        self.valid = torch.cat((self.valid[:, : self.valid.shape[1] - k], keep), dim=1)
        self.lengths = self.lengths - k + keep.sum(1)
        self.added = 0
        self._crop()

    def _forward(self, tokens: Tensor, allow: Tensor, positions: Tensor) -> TargetOutput:
        """tokens (b, n), allow (b, n, slots + n), positions (b, n) -> outputs, appending n slots to the cache."""
        hidden, states, _ = self.model.backbone(
            tokens,
            layers=self.layers,
            attention_mask=attention_mask(allow, self.attention, self.model.hf.dtype),
            position_ids=positions,
            past_key_values=self.cache,
            use_cache=True,
        )
        return TargetOutput(logits=F.linear(hidden, self.weight, self.bias), hidden=hidden, layers=states)

    def _compact(self) -> None:
        """Close the holes: move each row's committed slots, in order, to the end of the committed region and
        drop the leading slots no row uses then, so the slot count is the longest row's length (plus slots
        appended since the last commit, left where they are). Ragged batches otherwise grow more slots than
        any row has tokens, and GPT-Neo indexes its causal mask, sized by its maximum length, by slot.
        Positions come from position_ids, so moving a key changes nothing it computes."""
        b, slots = self.valid.shape
        n = slots - self.added
        holes_first = torch.sort(self.valid[:, :n].to(torch.uint8), dim=1, stable=True).indices  # (b, n)
        lead = n - int(self.valid[:, :n].sum(1).max())
        index = torch.cat((holes_first[:, lead:], torch.arange(n, slots, device=self.device).expand(b, -1)), dim=1)
        for layer in self.cache.layers:
            at = repeat(index, "b s -> b h s d", h=layer.keys.shape[1], d=layer.keys.shape[-1])
            layer.keys, layer.values = layer.keys.gather(2, at), layer.values.gather(2, at)
        self.valid = self.valid.gather(1, index)

    def _crop(self) -> None:
        """Drop trailing slots that no row keeps (for a batch of one: every rejected slot)."""
        used = self.valid.any(0)
        keep = int(used.nonzero().max()) + 1 if bool(used.any()) else 0
        drop = self.valid.shape[1] - keep
        if drop > 0:
            self.cache.crop(-drop)
            self.valid = self.valid[:, :keep]
