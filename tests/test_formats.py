"""The serving formats (experiments/lib/formats/: a module per format, each written and read), without vLLM.

Every exported directory is read twice: by this project's importer and by tests/format_reference.py, an
independent reader written from vLLM 0.32's loaders (speculators' package pulls torchvision, torchaudio and
CUDA-built dependencies into the venv, so its model classes are not imported here). Drafts are compared:
- on an ORACLE base, a Llama whose next token is a fixed permutation of the last: drafters given weights whose
  first draft at every position is known in closed form (the token two or more steps ahead);
- on a random Llama base with random drafters: first drafts at every position and 3-token chains equal.
Negative controls show each format detail matters: absolute ids in d2t, SGLang's layer-id convention (+1), a
Medusa config without `medusa_fc_bias`, each makes the reference reader draft otherwise.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from experiments.lib.formats import eagle, eagle3, medusa
from experiments.lib.formats.common import layer_config
from experiments.lib.store.served_dir import MARK, FormatError, write_directory
from medusa.heads import MedusaHeads
from prophet.model import Prophet, base_features
from tests import format_reference as ref
from tests.test_hf import llama
from verify.backends.hf import HFBase

V, H = 48, 64
PERM = torch.randperm(V, generator=torch.Generator().manual_seed(3))
EVEN = torch.arange(0, V, 2)  # the oracle's trimmed draft vocabulary
PERM_EVEN = EVEN[torch.randperm(V // 2, generator=torch.Generator().manual_seed(4))]  # perm of the even ids


def oracle_base(perm: torch.Tensor) -> HFBase:
    """A Llama whose residual stream is the token's embedding 4 e_x at every layer (attention and MLP outputs are
    zero) and whose output layer reads e_x as perm[x]: the next token is perm[last]."""
    config = transformers.LlamaConfig(
        vocab_size=V,
        hidden_size=H,
        intermediate_size=2 * H,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.copy_(4 * torch.eye(V, H))
        model.lm_head.weight.zero_()
        model.lm_head.weight[perm, torch.arange(V)] = 1.0  # row perm[x] reads channel x
    return HFBase(model)


def permutation_matrix(perm: torch.Tensor) -> torch.Tensor:
    """(H, H): e_x -> e_perm[x] on the first V channels."""
    m = torch.zeros(H, H)
    m[perm, torch.arange(V)] = 1.0
    return m


def aux_states(base: HFBase, tokens: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """vLLM's aux hidden states: the residual stream ENTERING layer k for each id k, concatenated (b, n, A*H)."""
    with torch.no_grad():
        states = base.hf(tokens, output_hidden_states=True).hidden_states  # [k]: input of layer k, k < depth
    return torch.cat([states[k] for k in ids], dim=-1)


def project_first_drafts(prophet: Prophet, base, tokens: torch.Tensor, vocab=None) -> torch.Tensor:
    """The project's first draft at every position t of tokens[:, :-1], reading (f_t, x_{t+1}): (b, n - 1) ids."""
    hidden, _, layers = base_features(base, tokens[:, :-1], prophet.fuse_layers)
    with torch.no_grad():
        pred = prophet(hidden, tokens[:, 1:], layers)
        ids, weight, bias = prophet.output_layer(vocab)
        index = torch.nn.functional.linear(prophet.readout(pred), weight, bias).argmax(-1)
    return index if ids is None else ids[index]


def project_chain(prophet: Prophet, base, tokens: torch.Tensor, steps: int, vocab=None) -> torch.Tensor:
    """The project's greedy chain of `steps` drafts after the whole of tokens (b, n) (the last one pending), on
    the prophet's cache as its drafter runs it: (b, steps) ids."""
    hidden, _, layers = base_features(base, tokens[:, :-1], prophet.fuse_layers)
    ids, weight, bias = prophet.output_layer(vocab)
    cache = prophet.new_cache(tokens.shape[0], 64)
    with torch.no_grad():
        out = prophet.step(prophet.seed(hidden, layers), tokens[:, 1:], cache)[:, -1:]
        drafts = []
        for _ in range(steps):
            index = torch.nn.functional.linear(prophet.readout(out), weight, bias).argmax(-1)  # (b, 1)
            drafts.append(index if ids is None else ids[index])
            out = prophet.step(out, drafts[-1], cache)
    return torch.cat(drafts, dim=1)


def export_eagle3(prophet, base, vocab, path):
    tensors = eagle3.export_tensors(prophet, vocab)
    config = eagle3.export_config(
        prophet, base, verifier="base", draft_vocab=tensors["lm_head.weight"].shape[0], tokens=3
    )
    return write_directory(path, config, tensors)


def rewrite(path, *, config=None, tensors=None):
    """Edit an exported directory in place (a negative control's broken variant)."""
    old_config, old_tensors = ref.read_dir(path)
    return write_directory(path, config or old_config, tensors or old_tensors, overwrite=True)


# ------------------------------------------------------------------------------------------------- oracle


@pytest.fixture(scope="module")
def oracle():
    perm = torch.arange(V)
    perm[EVEN] = PERM_EVEN  # even ids map among themselves: a sequence from an even token stays even
    perm[EVEN + 1] = PERM_EVEN + 1
    base = oracle_base(perm)
    tokens = [EVEN[5].item()]
    for _ in range(15):
        tokens.append(perm[tokens[-1]].item())
    return base, perm, torch.tensor([tokens])


def oracle_eagle3(base, perm) -> Prophet:
    """fc maps the layer-1 state 4 e_x to 4 e_perm[x] = 4 e_{x_{t+1}}; the layer adds nothing (zero outputs), so
    norm(g') = 8 e_{x_{t+1}} and the base's output rows draft perm[x_{t+1}] = x_{t+2}: right at every position."""
    prophet = Prophet.from_base(base, arch="eagle3", fuse_layers=[1, 2, 3]).eval()
    with torch.no_grad():
        prophet.mix.weight.zero_()
        prophet.mix.weight[:, :H] = permutation_matrix(perm)
        prophet.decoder.o_proj.weight.zero_()
        prophet.decoder.down_proj.weight.zero_()
    return prophet


def test_oracle_eagle3_drafts_the_token_after_next_in_the_project_and_the_reference(oracle, tmp_path):
    base, perm, tokens = oracle
    prophet = oracle_eagle3(base, perm)
    closed_form = perm[perm[tokens[:, :-1]]]  # x_{t+2} at every position t
    assert torch.equal(project_first_drafts(prophet, base, tokens, EVEN), closed_form)
    path = export_eagle3(prophet, base, EVEN, tmp_path / "e3")
    config, tensors = ref.read_dir(path)
    assert config["draft_vocab_size"] == V // 2 and torch.equal(tensors["d2t"], EVEN - torch.arange(V // 2))
    emb = base.hf.model.embed_tokens.weight
    aux = aux_states(base, tokens[:, :-1], config["eagle_aux_hidden_state_layer_ids"])
    assert torch.equal(ref.eagle3_draft(path, aux, tokens[:, 1:], embedding=emb), closed_form)
    assert torch.equal(project_first_drafts(eagle3.read(path, base), base, tokens), closed_form)


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_an_oracle_eagle3_drafter_is_accepted_and_decodes_exactly_what_plain_decoding_does(oracle, mode):
    from prophet.drafter import ProphetDrafter
    from verify.backends.choose import make_target
    from verify.loop.plain import plain_generate
    from verify.loop.speculative import SpecConfig, speculative_generate

    base, perm, tokens = oracle
    prompts = [tokens[0, :5].tolist(), tokens[0, 3:6].tolist()]  # ragged rows
    target = make_target(base)
    plain = plain_generate(target, prompts, max_new_tokens=12)
    drafter = ProphetDrafter(oracle_eagle3(base, perm), mode=mode, top_k=2, depth=3, tree_nodes=6, vocab=EVEN)
    out = speculative_generate(target, drafter, prompts, max_new_tokens=12, spec=SpecConfig(gamma=3))
    assert out.tokens == plain.tokens
    # the first draft of every step is right (the closed form); a chain's later ones repeat it and are wrong
    assert int(out.stats.accepted_by_position[0]) == int(out.stats.proposed_by_position[0]) > 0


def test_absolute_ids_in_d2t_draft_other_tokens_and_are_refused(oracle, tmp_path):
    base, perm, tokens = oracle
    path = export_eagle3(oracle_eagle3(base, perm), base, EVEN, tmp_path / "e3")
    _, tensors = ref.read_dir(path)
    rewrite(path, tensors=tensors | {"d2t": EVEN.clone()})  # absolute ids where offsets belong
    aux = aux_states(base, tokens[:, :-1], [1, 2, 3])
    drafts = ref.eagle3_draft(path, aux, tokens[:, 1:], embedding=base.hf.model.embed_tokens.weight)
    assert not torch.equal(drafts, perm[perm[tokens[:, :-1]]])
    with pytest.raises(FormatError, match="OFFSETS"):
        eagle3.read(path, base)


def test_oracle_eagle_and_medusa_draft_their_closed_forms(oracle, tmp_path):
    base, perm, tokens = oracle
    prophet = Prophet.from_base(base, arch="eagle").eval()
    with torch.no_grad():  # fc: the feature part (8 e_x after the final norm) -> 8 e_perm[x]; the layer adds nothing
        prophet.fuse.weight.zero_()
        prophet.fuse.weight[:, :H] = permutation_matrix(perm)
        prophet.decoder.o_proj.weight.zero_()
        prophet.decoder.down_proj.weight.zero_()
    closed_form = perm[perm[tokens[:, :-1]]]
    assert torch.equal(project_first_drafts(prophet, base, tokens), closed_form)
    path = write_directory(tmp_path / "e1", layer_config(base, prophet.decoder), eagle.export_tensors(prophet))
    hidden, _, _ = base_features(base, tokens[:, :-1])
    emb, head = base.hf.model.embed_tokens.weight, base.to_logits.weight
    assert torch.equal(ref.eagle_draft(path, hidden, tokens[:, 1:], emb, head), closed_form)

    heads = MedusaHeads.from_base(base, num_heads=3, num_layers=1)  # blocks start as the identity
    with torch.no_grad():
        for k, projection in enumerate(heads.projections):  # head k reads e_x as perm^(k+2)[x]
            ahead = torch.arange(V)
            for _ in range(k + 2):
                ahead = perm[ahead]
            projection.weight.zero_()
            projection.weight[ahead, torch.arange(V)] = 1.0
    tensors, config = medusa.export_tensors(heads, base)
    path = write_directory(tmp_path / "m", config, tensors)
    hidden, _, _ = base_features(base, tokens)
    drafts = ref.medusa_draft(path, hidden)  # (1, n, 3): head k at t guesses x_{t+2+k}
    n = tokens.shape[1]
    for k in range(3):
        assert torch.equal(drafts[0, : n - 2 - k, k], tokens[0, 2 + k :])
    with torch.no_grad():
        ours = heads(hidden).argmax(-1)
    assert torch.equal(ours, drafts)


# ------------------------------------------------------------------------------------------------- random


@pytest.fixture(scope="module")
def rand():
    base = llama(layers=6, dim=64)  # 97 tokens, 4 heads over 2 kv heads of 16
    tokens = torch.randint(0, base.num_tokens, (2, 14), generator=torch.Generator().manual_seed(1))
    vocab = torch.randperm(base.num_tokens, generator=torch.Generator().manual_seed(2))[:40].sort().values
    return base, tokens, vocab


def randomized(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every weight drawn at a scale where argmaxes are far from ties (norm gains around 1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.3 * noise if "norm" in name else noise * p.shape[-1] ** -0.5)
    return module.eval()


def random_eagle3(base, **layer) -> Prophet:
    prophet = Prophet.from_base(base, arch="eagle3", fuse_layers=[1, 3, 4])
    prophet.decoder.norm_before_residual = layer.get("norm_before_residual", False)
    return randomized(prophet, 5)


def test_eagle3_first_drafts_and_chains_equal_the_reference_and_round_trip_bit_exact(rand, tmp_path):
    base, tokens, vocab = rand
    emb = base.hf.model.embed_tokens.weight
    for nbr in (False, True):
        prophet = random_eagle3(base, norm_before_residual=nbr)
        path = export_eagle3(prophet, base, vocab, tmp_path / f"e3_{nbr}")
        config, _ = ref.read_dir(path)
        assert config["norm_before_residual"] is nbr  # always written: vLLM would read its absence as true
        aux = aux_states(base, tokens[:, :-1], config["eagle_aux_hidden_state_layer_ids"])
        ours = project_first_drafts(prophet, base, tokens, vocab)
        assert torch.equal(ref.eagle3_draft(path, aux, tokens[:, 1:], embedding=emb), ours)
        chain = ref.eagle3_draft(path, aux, tokens[:, 1:], steps=3, embedding=emb)
        assert torch.equal(chain, project_chain(prophet, base, tokens, 3, vocab))
        imported = eagle3.read(path, base)
        assert torch.equal(project_first_drafts(imported, base, tokens), ours)
        again = export_eagle3(imported, base, None, tmp_path / f"again_{nbr}")
        first, second = ref.read_dir(path)[1], ref.read_dir(again)[1]
        assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def test_a_wrong_layer_convention_or_a_missing_norm_flag_drafts_otherwise(rand, tmp_path):
    base, tokens, vocab = rand
    emb = base.hf.model.embed_tokens.weight
    prophet = random_eagle3(base)
    path = export_eagle3(prophet, base, vocab, tmp_path / "e3")
    config, _ = ref.read_dir(path)
    ours = project_first_drafts(prophet, base, tokens, vocab)
    sglang = [k + 1 for k in config["eagle_aux_hidden_state_layer_ids"]]  # SGLang counts one more
    aux = aux_states(base, tokens[:, :-1], sglang)
    assert not torch.equal(ref.eagle3_draft(path, aux, tokens[:, 1:], embedding=emb), ours)
    aux = aux_states(base, tokens[:, :-1], config["eagle_aux_hidden_state_layer_ids"])
    rewrite(path, config={k: v for k, v in config.items() if k != "norm_before_residual"})
    assert not torch.equal(ref.eagle3_draft(path, aux, tokens[:, 1:], embedding=emb), ours)


def test_eagle_drafts_equal_the_reference_and_an_fc_bias_is_refused(rand, tmp_path):
    base, tokens, _ = rand
    prophet = randomized(Prophet.from_base(base, arch="eagle"), 6)
    path = write_directory(tmp_path / "e1", layer_config(base, prophet.decoder), eagle.export_tensors(prophet))
    hidden, _, _ = base_features(base, tokens[:, :-1])
    emb, head = base.hf.model.embed_tokens.weight, base.to_logits.weight
    ours = project_first_drafts(prophet, base, tokens)
    assert torch.equal(ref.eagle_draft(path, hidden, tokens[:, 1:], emb, head), ours)
    chain = ref.eagle_draft(path, hidden, tokens[:, 1:], emb, head, steps=3)
    assert torch.equal(chain, project_chain(prophet, base, tokens, 3))
    assert torch.equal(project_first_drafts(eagle.read(path, base), base, tokens), ours)
    _, tensors = ref.read_dir(path)
    rewrite(path, tensors=tensors | {"fc.bias": torch.ones(H)})
    with pytest.raises(FormatError, match="fc.bias"):
        eagle.read(path, base)


def test_medusa_drafts_equal_the_reference_and_need_the_bias_flag(rand, tmp_path):
    base, tokens, _ = rand
    heads = randomized(MedusaHeads.from_base(base, num_heads=3, num_layers=2), 7)
    tensors, config = medusa.export_tensors(heads, base)
    path = write_directory(tmp_path / "m", config, tensors)
    hidden, _, _ = base_features(base, tokens)
    with torch.no_grad():
        ours = heads(hidden).argmax(-1)
    assert torch.equal(ref.medusa_draft(path, hidden), ours)
    imported = medusa.read(path, base)
    with torch.no_grad():
        assert torch.equal(imported(hidden), heads(hidden))
    rewrite(path, config={k: v for k, v in config.items() if k != "medusa_fc_bias"})  # vLLM then drops the biases
    dropped = ref.medusa_draft(path, hidden)
    assert not torch.equal(dropped, ours)
    with torch.no_grad():  # and the importer reads the directory as vLLM does
        assert torch.equal(medusa.read(path, base)(hidden).argmax(-1), dropped)


# ------------------------------------------------------------------------------------------------- refusals


def test_what_no_format_holds_is_refused_in_one_line(rand, tmp_path, lm):
    from experiments.export import check_vocab_fits, choose_format

    base, _, vocab = rand
    with pytest.raises(FormatError, match="x-transformers network"):
        choose_format("prophet", {"dim": 128}, "auto")
    with pytest.raises(FormatError, match="no serving format"):
        choose_format("prophet_block", {}, "auto")
    with pytest.raises(FormatError, match="exports to eagle3"):
        choose_format("prophet", {"arch": "eagle3"}, "medusa")
    with pytest.raises(FormatError, match="drafts from all of them"):
        check_vocab_fits("medusa", vocab, False)
    check_vocab_fits("eagle3", vocab, False)
    with pytest.raises(ValueError, match="ascending"):
        Prophet.from_base(base, arch="eagle3", fuse_layers=[3, 1])
    with pytest.raises(ValueError, match="fuse_layers"):
        Prophet.from_base(base, arch="eagle3")
    with pytest.raises(ValueError, match="arch='nope'"):
        Prophet.from_base(base, arch="nope", dim=32)
    with pytest.raises(ValueError, match="block prophet"):
        from prophet.block import BlockProphet

        BlockProphet.from_base(base, arch="eagle3", fuse_layers=[1, 2, 3])
    with pytest.raises(FormatError, match="Hugging Face Llama"):
        layer_config(lm)
    path = write_directory(tmp_path / "x", {"model_type": "llama"}, {"w": torch.zeros(1)})
    with pytest.raises(FormatError, match="exists and is not empty"):
        write_directory(path, {}, {})
    assert json.loads((path / "config.json").read_text()) == {"model_type": "llama", MARK: {"exported": True}}


def test_a_llama_draft_model_exports_as_a_plain_hugging_face_llama(rand, tmp_path, lm):
    from experiments.lib.families import draft
    from experiments.lib.formats import llama

    base, tokens, _ = rand
    module = randomized(draft.build(base, dim=32, depth=2, heads=4, arch="llama", kv_heads=2), 8)
    path = write_directory(tmp_path / "draft", *reversed(llama.export_tensors(module)))
    loaded = transformers.LlamaForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, module(tokens))
        assert torch.equal(llama.read(path)(tokens).logits, module(tokens))  # this project's reader: the same
    with pytest.raises(FormatError, match="arch=llama"):
        llama.export_tensors(draft.build(base, dim=32, depth=1, heads=4))


def test_an_sglang_specforge_eagle3_directory_imports_as_the_same_drafter(rand, tmp_path):
    base, tokens, vocab = rand
    prophet = random_eagle3(base)
    path = export_eagle3(prophet, base, vocab, tmp_path / "e3")
    config, tensors = ref.read_dir(path)
    plain = config["transformer_layer_config"] | {
        "architectures": ["LlamaForCausalLMEagle3"],
        "draft_vocab_size": config["draft_vocab_size"],
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": config["eagle_aux_hidden_state_layer_ids"]},
    }
    renamed = {k.replace("layers.0.", "midlayer."): v for k, v in tensors.items()}
    sglang = write_directory(tmp_path / "sglang", plain, renamed)
    ours = project_first_drafts(prophet, base, tokens, vocab)
    assert torch.equal(project_first_drafts(eagle3.read(sglang, base), base, tokens), ours)


def test_medusa_rows_outside_the_training_vocabulary_export_as_zeros(rand, tmp_path):
    base, tokens, vocab = rand
    heads = randomized(MedusaHeads.from_base(base, num_heads=2, num_layers=1), 9)
    tensors, config = medusa.export_tensors(heads, base, vocab)
    outside = torch.ones(base.num_tokens, dtype=torch.bool)
    outside[vocab] = False
    for k, projection in enumerate(heads.projections):
        rows = tensors[f"lm_heads.{k}.weight"]
        assert torch.equal(rows[vocab], projection.weight[vocab]) and not rows[outside].any()
    path = write_directory(tmp_path / "m", config, tensors)
    hidden, _, _ = base_features(base, tokens)
    with torch.no_grad():
        trimmed = heads(hidden, vocab)  # (b, n, K, N): the drafter trained on the subset
    served = ref.medusa_draft(path, hidden)  # all V rows, as vLLM drafts
    positive = trimmed.amax(-1) > 0  # where a trained row scores above the zero rows, the drafts are the same
    assert positive.any() and torch.equal(served[positive], vocab[trimmed.argmax(-1)][positive])
