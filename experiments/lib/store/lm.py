"""The frozen base language model: an x-transformers decoder with rotary positions, or (arch="llama") a
Hugging Face transformers Llama of the same sizes, wrapped as verify.backends.hf.HFBase (needs the `hf` extra).

One builder, `build_lm`, used by base training, by checkpoint loading and (through `_target_`) by the
`conf/base/*.yaml` size presets. It takes plain keyword arguments so a checkpoint's `meta.json` can
rebuild the exact network with `build_lm(**meta["model_config"])`.

Choices, and why:
- rotary positions and no absolute position embedding: drafters and tree verification pass explicit
  `pos` and additive attention biases, which x-transformers supports with rotary only;
- pre-norm with a final norm (the x-transformers default): the final hidden state that Medusa heads and
  the prophet read is normalised, like the published bases;
- `attn_dim_head` defaults to dim // heads, so the attention width equals the model width (x-transformers
  would otherwise use 64 per head whatever the width; the 2.9M and 10.5M presets assume dim // heads).
"""

from __future__ import annotations

import torch
from x_transformers import Decoder, TransformerWrapper

__all__ = ["ARCHS", "build_lm", "check_lm_sizes", "count_parameters"]

ARCHS = ("x-transformers", "llama")


def _check_positive_int(name: str, value: object) -> None:
    # bool is an int subclass: `depth=True` is a typo, not a size
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def check_lm_sizes(
    *,
    arch: str = "x-transformers",
    num_tokens: int,
    dim: int,
    depth: int,
    heads: int,
    max_seq_len: int,
    ff_mult: int = 4,
    attn_dim_head: int | None = None,
    kv_heads: int | None = None,
) -> None:
    """Raise a one-line ValueError for any size that cannot build a model (cheap: builds nothing)."""
    if arch not in ARCHS:
        raise ValueError(f"arch={arch!r}: must be one of {', '.join(ARCHS)}")
    if kv_heads is not None:
        if arch != "llama":
            raise ValueError(f"kv_heads={kv_heads!r}: grouped-query attention is built for arch=llama only; use null")
        _check_positive_int("kv_heads", kv_heads)
        if heads % kv_heads != 0:
            raise ValueError(f"kv_heads={kv_heads} must divide heads={heads}")
    if arch == "llama":
        try:
            import transformers  # noqa: F401
        except ImportError:
            raise ValueError("arch=llama needs transformers: pip install -e '.[hf]'") from None
    sizes = dict(num_tokens=num_tokens, dim=dim, depth=depth, heads=heads, max_seq_len=max_seq_len, ff_mult=ff_mult)
    for name, value in sizes.items():
        _check_positive_int(name, value)
    if attn_dim_head is None:
        if dim % heads != 0:
            raise ValueError(f"dim ({dim}) must be divisible by heads ({heads}) unless attn_dim_head is given")
        if dim // heads < 2:
            raise ValueError(f"dim // heads = {dim // heads} is too small for rotary positions (need at least 2)")
    else:
        _check_positive_int("attn_dim_head", attn_dim_head)
        if attn_dim_head < 2:
            raise ValueError(f"attn_dim_head must be at least 2 for rotary positions, got {attn_dim_head}")


def build_lm(
    *,
    arch: str = "x-transformers",
    num_tokens: int,
    dim: int,
    depth: int,
    heads: int,
    max_seq_len: int,
    ff_mult: int = 4,
    attn_dim_head: int | None = None,
    kv_heads: int | None = None,
) -> torch.nn.Module:
    """A decoder-only LM: token ids (B, N) -> logits (B, N, num_tokens). `kv_heads` (grouped-query
    attention) only for arch="llama"."""
    check_lm_sizes(
        arch=arch,
        num_tokens=num_tokens,
        dim=dim,
        depth=depth,
        heads=heads,
        max_seq_len=max_seq_len,
        ff_mult=ff_mult,
        attn_dim_head=attn_dim_head,
        kv_heads=kv_heads,
    )
    dim_head = attn_dim_head if attn_dim_head is not None else dim // heads
    if arch == "llama":
        return _llama(
            num_tokens=num_tokens,
            dim=dim,
            depth=depth,
            heads=heads,
            kv_heads=kv_heads or heads,
            max_seq_len=max_seq_len,
            hidden=ff_mult * dim,
            dim_head=dim_head,
        )
    decoder = Decoder(
        dim=dim,
        depth=depth,
        heads=heads,
        attn_dim_head=dim_head,
        ff_mult=ff_mult,
        rotary_pos_emb=True,
        # x-transformers warns when the rotary dim (dim_head // 2) is below 32; our small heads are deliberate
        verbose=False,
    )
    return TransformerWrapper(
        num_tokens=num_tokens,
        max_seq_len=max_seq_len,
        attn_layers=decoder,
        use_abs_pos_emb=False,
    )


def _llama(
    *, num_tokens: int, dim: int, depth: int, heads: int, kv_heads: int, max_seq_len: int, hidden: int, dim_head: int
) -> torch.nn.Module:
    """transformers' LlamaForCausalLM (RMSNorm, SwiGLU, rotary, untied output layer), random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from verify.backends.hf import HFBase

    config = LlamaConfig(
        vocab_size=num_tokens,
        hidden_size=dim,
        intermediate_size=hidden,
        num_hidden_layers=depth,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=dim_head,
        max_position_embeddings=max_seq_len,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    return HFBase(LlamaForCausalLM(config))


def count_parameters(model: torch.nn.Module, *, trainable_only: bool = False) -> int:
    """Number of scalar parameters (shared tensors counted once, as `parameters()` yields them once)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
