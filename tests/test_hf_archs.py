"""The Hugging Face adapter across architectures and attention implementations: tiny random-weight models of
each architecture (built from a config here, nothing downloaded), under eager and sdpa attention, decode
token for token what transformers' own greedy `generate` does, plain and speculative (a chain with
rollback, a tree), at batch 1 and in a ragged batch. Models the adapter cannot run exactly are refused at
construction in one line.

Eager attention adds a 4D mask to the scores: a boolean mask there masked nothing (prefill logits off by
9-15 from the model's own forward), so these tests fail if the adapter passes a mask in the wrong form.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from medusa.drafter import MedusaDrafter  # noqa: E402
from medusa.heads import MedusaHeads  # noqa: E402
from tests.test_hf import PROMPTS, hf_greedy, noisy, perturbed  # noqa: E402
from verify.backends.choose import make_target  # noqa: E402
from verify.backends.hf import HFBase, HFTarget  # noqa: E402
from verify.drafters.draft_model import DraftModelDrafter  # noqa: E402
from verify.loop.plain import plain_generate  # noqa: E402
from verify.loop.speculative import SpecConfig, speculative_generate  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
V, NEW = 97, 16
T = transformers
# Shared by the decoder configs below; a wide initialisation gives peaked logits, where greedy does not ride on noise.
DEC = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, initializer_range=0.5)
ROPE = dict(DEC, num_key_value_heads=2, max_position_embeddings=128)
GPT = dict(n_embd=32, n_layer=2, n_head=4, n_positions=128, initializer_range=0.5)

# name -> (config class, its arguments): the architectures the adapter is checked on (each in well under a second).
ARCHS = {
    "llama": (T.LlamaConfig, ROPE),
    "gpt2": (T.GPT2Config, GPT),
    "qwen2": (T.Qwen2Config, ROPE),
    "mistral": (T.MistralConfig, dict(ROPE, sliding_window=None)),
    "gpt_neox": (T.GPTNeoXConfig, dict(DEC, max_position_embeddings=128)),
    "opt": (
        T.OPTConfig,
        dict(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128)
        | dict(word_embed_proj_dim=32, init_std=0.5),
    ),
    "falcon": (
        T.FalconConfig,
        dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128)
        | dict(initializer_range=0.5, alibi=False, new_decoder_architecture=True, num_kv_heads=2),
    ),
    "gpt_neo": (
        T.GPTNeoConfig,
        dict(hidden_size=32, num_layers=2, num_heads=4, max_position_embeddings=128, initializer_range=0.5)
        | dict(attention_types=[[["global", "local"], 1]], window_size=128),  # a local window covering the context
    ),
}
MORE_ARCHS = {
    "phi": (T.PhiConfig, dict(DEC, max_position_embeddings=128)),
    "phi3": (T.Phi3Config, ROPE),
    "gemma": (T.GemmaConfig, dict(ROPE, head_dim=8)),
    "stablelm": (T.StableLmConfig, dict(ROPE, num_key_value_heads=4)),
    "gptj": (T.GPTJConfig, dict(GPT, rotary_dim=4)),
    "codegen": (T.CodeGenConfig, dict(GPT, n_ctx=128, rotary_dim=4)),
    "starcoder2": (T.Starcoder2Config, ROPE),
    "qwen3": (T.Qwen3Config, dict(ROPE, head_dim=8)),
    "olmo": (T.OlmoConfig, dict(DEC, max_position_embeddings=128)),
    "olmo2": (T.Olmo2Config, dict(DEC, max_position_embeddings=128)),
    "gpt_bigcode": (T.GPTBigCodeConfig, GPT),
    "mixtral": (T.MixtralConfig, dict(ROPE, num_local_experts=2, num_experts_per_tok=1)),
    "persimmon": (T.PersimmonConfig, dict(DEC, max_position_embeddings=128)),
    "biogpt": (T.BioGptConfig, dict(DEC, max_position_embeddings=128)),
    "falcon_multi_query": (
        T.FalconConfig,
        dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128)
        | dict(initializer_range=0.5, alibi=False, new_decoder_architecture=False, multi_query=True),
    ),
    # Sliding windows: the target's context is the window, within which sliding attention is full attention.
    "mistral_window": (T.MistralConfig, dict(ROPE, sliding_window=40)),
    "qwen2_window": (T.Qwen2Config, dict(ROPE, sliding_window=40, use_sliding_window=True, max_window_layers=0)),
    "gemma3_window": (T.Gemma3TextConfig, dict(ROPE, head_dim=8, sliding_window=40, final_logit_softcapping=None)),
}
# transformers implements these with eager attention only
EAGER_ONLY = {"gpt_neo", "biogpt"}


def build(name: str, attention: str, seed: int = 0) -> HFBase:
    klass, args = {**ARCHS, **MORE_ARCHS}[name]
    ids = dict(bos_token_id=None, eos_token_id=None) | ({} if name == "gpt_neo" else dict(pad_token_id=None))
    torch.manual_seed(seed)
    config = klass(vocab_size=V, **ids, **args)
    return HFBase(T.AutoModelForCausalLM.from_config(config, attn_implementation=attention)).eval()


def cases(archs: dict) -> list:
    return [(n, a) for n in archs for a in ("eager", "sdpa") if not (a == "sdpa" and n in EAGER_ONLY)]


FAST = [pytest.param(n, a, id=f"{n}-{a}") for n, a in cases(ARCHS)]
MORE = [pytest.param(n, a, id=f"{n}-{a}") for n, a in cases(MORE_ARCHS)]


def check_decoding(base: HFBase, engine: str = "hf") -> None:
    """Plain and speculative greedy decoding (a draft model's chain, a Medusa tree), batch 1 and ragged,
    equal transformers' own greedy generate of each prompt alone."""
    want = [hf_greedy(base, p, NEW) for p in PROMPTS]
    assert base.hf.config._attn_implementation in ("eager", "sdpa")
    for prompts, reference in ((PROMPTS[:1], want[:1]), (PROMPTS, want)):
        assert plain_generate(make_target(base, engine=engine), prompts, max_new_tokens=NEW).tokens == reference
        drafters = {
            "draft_model": DraftModelDrafter(perturbed(base, scale=0.3), engine=engine),
            "medusa_tree": MedusaDrafter(noisy(MedusaHeads.from_base(base, num_heads=2, num_layers=1)), tree_nodes=6),
        }
        for name, drafter in drafters.items():
            out = speculative_generate(
                make_target(base, engine=engine), drafter, prompts, max_new_tokens=NEW, spec=SpecConfig(gamma=3)
            )
            assert out.tokens == reference, (name, len(prompts))


@pytest.mark.parametrize("name, attention", FAST + MORE)
def test_greedy_decoding_equals_transformers_generate(name, attention):
    check_decoding(build(name, attention))


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_llama_on_the_lean_engine_under_each_attention(attention):
    check_decoding(build("llama", attention), engine="lean")


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_prefill_logits_equal_the_models_own_forward(attention):
    """The measured defect in one number: eager prefill logits were 9-15 away from the model's forward."""
    base = build("llama", attention)
    out = HFTarget(base).prefill(PROMPTS)
    for i, p in enumerate(PROMPTS):
        with torch.no_grad():
            own = base.hf(torch.tensor([p])).logits[0]
        torch.testing.assert_close(out.logits[i, -len(p) :], own, atol=1e-5, rtol=1e-4)


def test_a_sliding_window_is_the_targets_context():
    """Within the window sliding attention is full attention; the target refuses to reach past it."""
    base = build("mistral_window", "sdpa")
    target = HFTarget(base)
    assert base.max_seq_len == target.max_seq_len == 40
    with pytest.raises(ValueError, match=r"at most max_seq_len - max_new_tokens = 16") as e:
        target.check_tokens([[1] * 17], max_new_tokens=24)
    assert "\n" not in str(e.value)


def with_config(name: str, **changes) -> transformers.PreTrainedModel:
    klass, args = {**ARCHS, **MORE_ARCHS}[name]
    config = klass(vocab_size=V, **args)
    for key, value in changes.items():
        setattr(config, key, value)
    return config


REFUSED = {
    "bloom": (
        lambda: T.BloomConfig(vocab_size=V, hidden_size=32, n_layer=2, n_head=4),
        r"^bloom model uses ALiBi position biases: the adapter supports models whose positions come from position_ids",
    ),
    "mpt": (lambda: T.MptConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=4), r"^mpt model uses ALiBi"),
    "falcon_alibi": (lambda: with_config("falcon", alibi=True), r"^falcon model uses ALiBi"),
    "gpt_neo_local": (
        lambda: with_config("gpt_neo", window_size=16),
        r"^gpt_neo model has local attention layers with window_size=16 < its maximum length 128",
    ),
    "chunked": (
        lambda: with_config("llama", layer_types=["chunked_attention", "full_attention"]),
        r"^llama model has chunked_attention layers: the adapter supports full_attention and sliding_attention",
    ),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_models_the_adapter_cannot_run_exactly_are_refused_in_one_line(name):
    make_config, match = REFUSED[name]
    model = T.AutoModelForCausalLM.from_config(make_config())
    with pytest.raises(ValueError, match=match) as e:
        HFBase(model)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("attention", ["flex_attention", "flash_attention_2"])
def test_attention_implementations_without_4d_masks_are_refused(attention):
    base = build("llama", "sdpa")
    base.hf.config._attn_implementation = attention  # what loading with that implementation records
    with pytest.raises(
        ValueError, match=rf"^attn_implementation='{attention}': the Hugging Face target supports sdpa, eager"
    ):
        HFTarget(base)


def test_a_config_without_a_maximum_length_is_refused_in_one_line():
    """A length is read from the field the architecture uses; a config with none of them is refused."""
    from types import SimpleNamespace

    from verify.backends.hf import check_decodable

    assert check_decodable(SimpleNamespace(model_type="chatglm", seq_length=64)) == 64
    with pytest.raises(
        ValueError, match=r"^custom model has no maximum length in its config: the adapter needs one of"
    ):
        check_decodable(SimpleNamespace(model_type="custom", max_position_embeddings=None))


@pytest.mark.parametrize("name", ["gpt_neo", "gpt2"])
def test_ragged_batches_reach_the_last_position(name):
    """Rows that finish early keep running (outputs unused) and rows that accept different counts leave holes:
    near the model's last position neither may index past its position table (GPT-2) or its slot-indexed
    causal mask (GPT-Neo). Before: IndexError and a tensor size mismatch."""
    base = build(name, "eager")
    target = HFTarget(base)
    new = target.max_seq_len - max(len(p) for p in PROMPTS)  # the longest prompt ends at the last position
    want = [hf_greedy(base, p, new) for p in PROMPTS]
    for scale in (0.1, 0.3):
        out = speculative_generate(
            HFTarget(base),
            DraftModelDrafter(perturbed(base, scale=scale)),
            PROMPTS,
            max_new_tokens=new,
            spec=SpecConfig(gamma=6),
        )
        assert out.tokens == want, scale
        assert len(set(out.stats.accepted.tolist())) > 1  # ragged: the rows accepted different counts
