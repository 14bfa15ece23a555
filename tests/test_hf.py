"""Hugging Face causal LMs as the frozen base (verify/backends/hf.py): tiny randomly initialised Llama and GPT-2
models built from a config here (nothing is downloaded). Greedy output of every drafter must be
token-identical to transformers' own greedy `generate`; sampling must stay the target's distribution;
per-row rollback must leave the cache as a fresh run would; bad inputs get one-line errors.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from medusa.drafter import MedusaDrafter  # noqa: E402
from medusa.heads import MedusaHeads  # noqa: E402
from medusa.sequential import SequentialHeads  # noqa: E402
from medusa.sequential_drafter import SequentialDrafter  # noqa: E402
from prophet.drafter import ProphetDrafter  # noqa: E402
from prophet.model import Prophet, base_features  # noqa: E402
from tests.conftest import make_lm  # noqa: E402
from tests.test_lossless import NEW, PROMPT, TRIALS, VOCAB, chi_square, exact_joint  # noqa: E402
from verify.backends.choose import make_target  # noqa: E402
from verify.backends.hf import HFBase, HFTarget, load_hf_base  # noqa: E402
from verify.drafters.draft_model import DraftModelDrafter  # noqa: E402
from verify.drafters.early_exit import EarlyExitDrafter  # noqa: E402
from verify.drafters.prompt_lookup import PromptLookupDrafter  # noqa: E402
from verify.loop.plain import plain_generate  # noqa: E402
from verify.loop.sampling import SamplingConfig  # noqa: E402
from verify.loop.speculative import SpecConfig, speculative_generate  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
V = 97
PROMPTS = [[5, 9, 3, 5, 9, 3, 7, 5, 9], [4, 4, 2], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 12]]  # ragged; 0 is a real token
NEW_TOKENS = 24


def llama(*, seed: int = 0, layers: int = 2, dim: int = 32, vocab: int = V, init: float = 0.5) -> HFBase:
    # A wide initialisation: the default 0.02 gives near-uniform logits, where greedy rides on float noise.
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=dim,
        intermediate_size=2 * dim,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=init,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    return HFBase(transformers.LlamaForCausalLM(config)).eval()


def gpt2(*, seed: int = 0, layers: int = 2, dim: int = 32, vocab: int = V) -> HFBase:
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        vocab_size=vocab,
        n_embd=dim,
        n_layer=layers,
        n_head=4,
        n_positions=128,
        initializer_range=0.5,
        bos_token_id=None,
        eos_token_id=None,
    )
    return HFBase(transformers.GPT2LMHeadModel(config)).eval()


BASES = {"llama": llama, "gpt2": gpt2}


def perturbed(base: HFBase, *, scale: float = 0.1, seed: int = 1) -> HFBase:
    """A copy of base with noise on every weight: an assistant that agrees often but not always."""
    copy = type(base)(type(base.hf)(base.hf.config)).eval()
    copy.load_state_dict(base.state_dict())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in copy.parameters():
            p.add_(scale * p.std() * torch.randn(p.shape, generator=gen))
    return copy


def hf_greedy(base: HFBase, prompt: list[int], n: int = NEW_TOKENS) -> list[int]:
    """transformers' own greedy decoding of one prompt (its attention mask given: token 0 is not padding)."""
    ids = torch.tensor([prompt])
    out = base.hf.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


def noisy(module, scale: float = 0.05, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.requires_grad:
                p.add_(scale * torch.randn(p.shape, generator=gen))
    return module


def drafters(base: HFBase, engine: str) -> dict:
    return {
        "prompt_lookup": lambda: PromptLookupDrafter(vocab_size=V),
        "draft_model": lambda: DraftModelDrafter(perturbed(base), engine=engine),
        "medusa_chain": lambda: MedusaDrafter(
            noisy(MedusaHeads.from_base(base, num_heads=3, num_layers=1)), mode="chain"
        ),
        "medusa_tree": lambda: MedusaDrafter(
            noisy(MedusaHeads.from_base(base, num_heads=3, num_layers=1)), tree_nodes=8
        ),
        "sequential_tree": lambda: SequentialDrafter(noisy(SequentialHeads.from_base(base, num_heads=3)), tree_nodes=8),
        "prophet_chain": lambda: ProphetDrafter(noisy(Prophet.from_base(base, dim=32, heads=2)), mode="chain"),
        "prophet_tree": lambda: ProphetDrafter(
            noisy(Prophet.from_base(base, dim=32, heads=2, fuse_layers=[1])),
            mode="tree",
            top_k=3,
            depth=3,
            tree_nodes=8,
        ),
        "eagle_chain": lambda: ProphetDrafter(noisy(Prophet.from_base(base, arch="eagle")), mode="chain"),
        "eagle3_tree": lambda: ProphetDrafter(
            noisy(Prophet.from_base(base, arch="eagle3", fuse_layers=[1])), mode="tree", top_k=3, depth=3, tree_nodes=8
        ),
    }


# (model, engine): transformers' own forward and cache (hf) for both; the Llama also on the lean engine
@pytest.fixture(scope="module", params=[("llama", "hf"), ("llama", "lean"), ("gpt2", "hf")], ids="-".join)
def base_and_reference(request):
    name, engine = request.param
    base = BASES[name]()
    return base, [hf_greedy(base, p) for p in PROMPTS], engine


# ------------------------------------------------------------------------------------------ exactness


def test_plain_greedy_equals_transformers_generate(base_and_reference):
    base, reference, engine = base_and_reference
    target = make_target(base, engine=engine)
    assert isinstance(target, HFTarget) == (engine == "hf")
    out = plain_generate(target, PROMPTS, max_new_tokens=NEW_TOKENS)
    assert out.tokens == reference


@pytest.mark.parametrize(
    "name",
    [
        "prompt_lookup",
        "draft_model",
        "medusa_chain",
        "medusa_tree",
        "sequential_tree",
        "prophet_chain",
        "prophet_tree",
        "eagle_chain",
        "eagle3_tree",
    ],
)
@pytest.mark.parametrize("gamma", [1, 3])
def test_speculative_greedy_equals_transformers_generate(base_and_reference, name, gamma):
    base, reference, engine = base_and_reference
    out = speculative_generate(
        make_target(base, engine=engine),
        drafters(base, engine)[name](),
        PROMPTS,
        max_new_tokens=NEW_TOKENS,
        spec=SpecConfig(gamma=gamma),
    )
    assert out.tokens == reference
    if name == "draft_model":  # a perturbed copy agrees often: the rollback paths really ran
        assert int(out.stats.accepted.sum()) > 0


def test_batch_rows_match_their_single_runs(base_and_reference):
    """Rows that accept different counts leave holes in the shared cache; each row must still decode alone."""
    base, reference, engine = base_and_reference
    out = speculative_generate(
        make_target(base, engine=engine),
        DraftModelDrafter(perturbed(base, scale=0.3), engine=engine),
        PROMPTS,
        max_new_tokens=NEW_TOKENS,
        spec=SpecConfig(gamma=4),
    )
    accepted = out.stats.accepted.tolist()
    assert len(set(accepted)) > 1, f"rows accepted {accepted}: the test needs rows that differ"
    assert out.tokens == reference


# -------------------------------------------------------------------------------- the target itself


def full_logits(base: HFBase, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return base(torch.tensor([tokens]))[0]  # (n, V)


def test_prefill_chain_and_rollback_match_fresh_runs():
    base = llama()
    target = HFTarget(base)
    pre = target.prefill(PROMPTS)
    for i, p in enumerate(PROMPTS):  # left-padded: row i ends at the last index
        torch.testing.assert_close(pre.logits[i, -len(p) :], full_logits(base, p), atol=1e-5, rtol=1e-4)
    draft = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]])
    target.extend(draft)
    kept = [3, 0, 1]  # a different count per row
    target.commit(torch.arange(4) < torch.tensor(kept)[:, None])
    assert target.row_lengths.tolist() == [len(p) + k for p, k in zip(PROMPTS, kept)]
    nxt = torch.tensor([[20, 21], [22, 23], [24, 25]])
    out = target.extend(nxt)
    for i, p in enumerate(PROMPTS):
        seq = p + draft[i, : kept[i]].tolist() + nxt[i].tolist()
        torch.testing.assert_close(out.logits[i], full_logits(base, seq)[-2:], atol=1e-5, rtol=1e-4)


def test_a_batch_of_one_never_keeps_rejected_slots():
    target = HFTarget(llama())
    target.prefill([PROMPTS[0]])
    target.extend(torch.tensor([[1, 2, 3, 4]]))
    target.commit(torch.tensor([[True, True, False, False]]))
    assert target.cache.get_seq_length() == len(PROMPTS[0]) + 2 == target.valid.shape[1]


def test_tree_nodes_see_exactly_their_path():
    base = gpt2()
    target = HFTarget(base)
    target.prefill(PROMPTS[:2])
    parents = torch.tensor([-1, 0, 0, 1, 2, -1])  # two roots; nodes 3 and 4 at depth 2
    tokens = torch.tensor([[11, 12, 13, 14, 15, 16], [21, 22, 23, 24, 25, 26]])
    out = target.extend(tokens, parents=parents)
    for i, p in enumerate(PROMPTS[:2]):
        for node in range(6):
            path, j = [], node
            while j >= 0:
                path, j = [int(tokens[i, j])] + path, int(parents[j])
            torch.testing.assert_close(out.logits[i, node], full_logits(base, p + path)[-1], atol=1e-5, rtol=1e-4)


def test_layer_states_are_the_models_hidden_states():
    base = llama(layers=3)
    target = HFTarget(base)
    target.use_layers((2, 1))
    out = target.prefill([PROMPTS[0]])
    with torch.no_grad():
        states = base.hf(torch.tensor([PROMPTS[0]]), output_hidden_states=True).hidden_states
    torch.testing.assert_close(out.layers[0, :, 0], states[2][0])
    torch.testing.assert_close(out.layers[0, :, 1], states[1][0])
    hidden, logits, layers = base_features(base, torch.tensor([PROMPTS[0]]), (2, 1))
    torch.testing.assert_close(layers, out.layers)
    torch.testing.assert_close(logits, out.logits)


@pytest.mark.parametrize(
    "config",
    [
        dict(num_key_value_heads=2),  # grouped-query attention: 2 query heads per cached kv head
        dict(num_key_value_heads=4, attention_bias=True, head_dim=16),  # biases; a head width other than dim / heads
    ],
)
def test_the_lean_llama_engine_equals_the_transformers_forward(config):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=V,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=128,
            initializer_range=0.5,
            rms_norm_eps=1e-5,
            rope_theta=500.0,
            **config,
        )
    )
    base = HFBase(model).eval()
    lean_target, hf_target = make_target(base, engine="lean"), HFTarget(base)
    lean_target.use_layers((1,))
    hf_target.use_layers((1,))
    a, b = lean_target.prefill(PROMPTS), hf_target.prefill(PROMPTS)
    for i, p in enumerate(PROMPTS):
        for x, y in ((a.logits, b.logits), (a.hidden, b.hidden), (a.layers, b.layers)):
            torch.testing.assert_close(x[i, -len(p) :], y[i, -len(p) :], atol=1e-4, rtol=1e-4)
    parents = torch.tensor([-1, 0, 0, 1])
    tokens = torch.tensor([[11, 12, 13, 14]] * 3)
    torch.testing.assert_close(
        lean_target.extend(tokens, parents=parents).logits,
        hf_target.extend(tokens, parents=parents).logits,
        atol=1e-4,
        rtol=1e-4,
    )


@pytest.mark.slow
def test_compiled_lean_llama_decodes_what_transformers_generates():
    base = llama()
    reference = [hf_greedy(base, p) for p in PROMPTS]
    target = make_target(base, compile=True, widths=(1, 4))
    assert plain_generate(target, PROMPTS, max_new_tokens=NEW_TOKENS).tokens == reference
    out = speculative_generate(
        target,
        DraftModelDrafter(perturbed(base), compile=True),
        PROMPTS,
        max_new_tokens=NEW_TOKENS,
        spec=SpecConfig(gamma=3),
    )
    assert out.tokens == reference


def test_a_saved_model_loads_from_its_directory(tmp_path):
    base = llama()
    base.hf.save_pretrained(tmp_path)  # config.json + model.safetensors
    loaded = load_hf_base(tmp_path)
    assert (
        plain_generate(make_target(loaded), PROMPTS, max_new_tokens=8).tokens
        == plain_generate(HFTarget(base), PROMPTS, max_new_tokens=8).tokens
    )


# ------------------------------------------------------------------------------------- losslessness


def sharp_llama(seed: int) -> HFBase:
    # vocab 6 and sharpened logits (as tests/test_lossless.py): p and q differ visibly, every joint cell enumerable
    base = llama(seed=seed, layers=1, dim=16, vocab=VOCAB, init=0.3)
    with torch.no_grad():
        base.to_logits.weight.mul_(2.0)
    return base


@pytest.mark.parametrize("delta, lossless", [(0.0, True), (0.5, False)])
def test_sampling_is_the_targets_distribution(delta, lossless):
    """Chi-square of the first NEW tokens of 20,000 rows against the exact joint; delta = 0.5 (not
    lossless) must be rejected by the same test, so the test has the power to see a loss."""
    target, draft = sharp_llama(0), sharp_llama(1)
    sampling = SamplingConfig(temperature=1.0)
    out = speculative_generate(
        HFTarget(target),
        DraftModelDrafter(draft),
        [PROMPT] * TRIALS,
        max_new_tokens=NEW + 1,
        spec=SpecConfig(gamma=2, delta=delta),
        sampling=sampling,
        generator=torch.Generator().manual_seed(0),
    )
    stat, critical = chi_square([t[:NEW] for t in out.tokens], exact_joint(target, sampling))
    assert (stat < critical) == lossless, f"chi2 {stat:.1f} vs critical {critical:.1f} (delta {delta})"


# -------------------------------------------------------------------------------------- bad input


def t5():
    config = transformers.T5Config(vocab_size=V, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2)
    return transformers.T5ForConditionalGeneration(config)


def gelu_llama():
    config = transformers.LlamaConfig(
        vocab_size=V,
        hidden_size=16,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        hidden_act="gelu",
    )
    return HFBase(transformers.LlamaForCausalLM(config))


def softcapped():
    config = transformers.Gemma2Config(
        vocab_size=V,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        final_logit_softcapping=30.0,
    )
    return transformers.Gemma2ForCausalLM(config)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: HFTarget(make_lm()), r"HFTarget takes an HFBase, got TransformerWrapper"),
        (lambda: HFTarget(llama(), compile=True), r"compile=True: the Hugging Face adapter runs eager only"),
        (lambda: HFTarget(llama(), compile="graph"), r"compile='graph': the Hugging Face adapter runs eager only"),
        (lambda: make_target(gpt2(), engine="lean"), r"GPT2LMHeadModel: the lean engine runs LlamaForCausalLM"),
        (
            lambda: make_target(make_lm(), engine="hf"),
            r"engine='hf' takes a Hugging Face model \(HFBase\), got TransformerWrapper",
        ),
        (lambda: make_target(llama(), engine="fast"), r"engine='fast': must be one of auto, lean, hf"),
        (
            lambda: make_target(gelu_llama(), engine="lean"),
            r"hidden_act='gelu': the lean Llama engine does not implement it",
        ),
        (lambda: HFBase(t5()), r"T5ForConditionalGeneration is an encoder-decoder"),
        (lambda: HFBase(softcapped()), r"final_logit_softcapping=30.0"),
        (lambda: HFTarget(llama()).use_layers((2,)), r"2 is not a block index in \[1, 1\]"),
        (lambda: HFTarget(llama()).check_tokens([[1, V]], max_new_tokens=4), rf"prompt 0 has token id {V}"),
        (lambda: HFTarget(llama()).check_tokens([[1] * 120], max_new_tokens=10), r"max_seq_len - max_new_tokens = 118"),
        (
            lambda: EarlyExitDrafter(gpt2(), lambda s: s, layer=1),
            r"early exit needs a base the lean engine runs .*got a Hugging Face GPT2LMHeadModel",
        ),
        (
            lambda: speculative_generate(
                HFTarget(llama()), PromptLookupDrafter(vocab_size=V + 1), PROMPTS, max_new_tokens=4
            ),
            r"drafter vocabulary size 98 differs from the target's 97",
        ),
    ],
)
def test_bad_arguments_raise_one_line_errors(make, match):
    with pytest.raises(ValueError, match=match) as excinfo:
        make()
    assert "\n" not in str(excinfo.value)


def test_commit_refuses_more_slots_than_were_added():
    target = HFTarget(llama())
    target.prefill(PROMPTS)
    target.extend(torch.ones(3, 2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"keep has shape \(3, 3\); the target holds 3 rows and 2 slots"):
        target.commit(torch.ones(3, 3, dtype=torch.bool))


def test_model_directories_without_safe_weights_are_refused(tmp_path):
    with pytest.raises(ValueError, match="not a Hugging Face model directory"):
        load_hf_base(tmp_path)
    llama().hf.save_pretrained(tmp_path)
    for f in tmp_path.glob("*.safetensors"):
        f.rename(f.with_suffix(".bin"))
    with pytest.raises(ValueError, match=r"no \*.safetensors weights"):
        load_hf_base(tmp_path)
