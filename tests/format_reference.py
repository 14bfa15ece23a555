"""An independent reader of the three drafter checkpoint formats that vLLM 0.32 serves, used by the format tests.

It was written from vLLM 0.32's own loaders and forward passes (model_executor/models/llama_eagle3.py, llama_eagle.py,
medusa.py, llama.py, transformers_utils/configs/{speculators,medusa,eagle}.py, v1/spec_decode), NOT from this
project's exporter, and it imports nothing from this repository: a test exports a drafter, reads the directory back
with this module and checks that the drafts agree. Everything is plain float32 torch, greedy (argmax) drafting.

Where vLLM would refuse a directory, or would silently compute something else than the tensors say (a dropped bias,
an ignored table), this reader raises ValueError instead of guessing. Conventions (b rows, n positions, H hidden):
- EAGLE-3 aux input: the verifier's residual stream ENTERING decoder layer k (after k layers, before the final norm)
  for each k of `eagle3_layer_ids`, concatenated in ASCENDING layer order (vLLM sorts and de-duplicates the ids).
- position t of every EAGLE draft reads (hidden_t, token_{t+1}): `tokens` are those next tokens.
"""

import json
import math
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import Tensor


def read_dir(path: str | Path) -> tuple[dict, dict[str, Tensor]]:
    """config.json and every tensor of every *.safetensors file in the directory."""
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    tensors: dict[str, Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return config, tensors


def eagle3_layer_ids(config: dict, num_verifier_layers: int) -> list[int]:
    """The verifier layer ids whose entering residual stream vLLM concatenates into `aux`, in that order."""
    ids = config.get("eagle_aux_hidden_state_layer_ids") or [2, num_verifier_layers // 2, num_verifier_layers - 3]
    return sorted(set(ids))  # EagleModelMixin._set_aux_hidden_state_layers: tuple(sorted(set(layers)))


def _rms(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def _llama(cfg: dict) -> dict:
    """The attention/MLP shape of a one-layer Llama config; refuses options this reader does not model."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default" or "partial_rotary_factor" in {**cfg, **rope}:
        raise ValueError(f"only plain RoPE is modelled, got {rope}")
    if cfg.get("attention_bias") or cfg.get("mlp_bias") or cfg.get("hidden_act", "silu") != "silu":
        raise ValueError("attention/MLP bias or a non-silu activation is not modelled")
    if cfg.get("num_hidden_layers", 1) != 1 or cfg.get("model_type", "llama") != "llama":
        raise ValueError("only one-layer Llama drafters are modelled (layers past the first differ in vLLM)")
    heads = cfg["num_attention_heads"]
    return {
        "heads": heads,
        "kv_heads": cfg.get("num_key_value_heads") or heads,
        "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // heads,
        "eps": cfg.get("rms_norm_eps", 1e-6),
        "theta": rope.get("rope_theta") or cfg.get("rope_theta") or 10000.0,  # get_rope's default base
    }


def _rotate(x: Tensor, pos: Tensor, theta: float) -> Tensor:
    """Neox / transformers "rotate_half" RoPE on (b, heads, m, d) at integer positions (m,)."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angle = pos.float()[:, None] * inv_freq[None]
    cos, sin = torch.cat([angle, angle], -1).cos(), torch.cat([angle, angle], -1).sin()
    return x * cos + torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1) * sin


def _attention(w: dict[str, Tensor], a: dict, x: Tensor, pos: Tensor, cache: dict[str, Tensor]) -> Tensor:
    """Causal grouped-query attention of new entries x (b, m, ·) at positions pos over the cached entries and them.

    The cache (keys "k", "v", "pos") grows in place, so a chained draft step sees every earlier entry."""
    b, m, _ = x.shape
    h, kvh, d = a["heads"], a["kv_heads"], a["head_dim"]
    q = (x @ w["self_attn.q_proj.weight"].float().T).view(b, m, h, d).transpose(1, 2)
    k = (x @ w["self_attn.k_proj.weight"].float().T).view(b, m, kvh, d).transpose(1, 2)
    v = (x @ w["self_attn.v_proj.weight"].float().T).view(b, m, kvh, d).transpose(1, 2)
    q, k = _rotate(q, pos, a["theta"]), _rotate(k, pos, a["theta"])
    if cache:
        k, v, pos_k = torch.cat([cache["k"], k], 2), torch.cat([cache["v"], v], 2), torch.cat([cache["pos"], pos])
    else:
        pos_k = pos
    cache.update(k=k, v=v, pos=pos_k)
    # query head i reads kv head i // (h // kvh), as vLLM's kernels and transformers' repeat_kv do
    k, v = k.repeat_interleave(h // kvh, 1), v.repeat_interleave(h // kvh, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    scores = scores.masked_fill(pos_k[None, :] > pos[:, None], float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, m, h * d)
    return out @ w["self_attn.o_proj.weight"].float().T


def _block(w: dict[str, Tensor], a: dict, x: Tensor, residual: Tensor, pos: Tensor, cache: dict) -> Tensor:
    """residual + attention(x), then the Llama MLP with its pre-norm and residual; returns the pre-norm output."""
    x = residual + _attention(w, a, x, pos, cache)
    y = _rms(x, w["post_attention_layernorm.weight"], a["eps"])
    gate, up = y @ w["mlp.gate_proj.weight"].float().T, y @ w["mlp.up_proj.weight"].float().T
    return x + (torch.nn.functional.silu(gate) * up) @ w["mlp.down_proj.weight"].float().T


def _check_names(tensors: dict[str, Tensor], allowed: set[str]) -> None:
    # vLLM's AutoWeightsLoader raises on an unknown name, but silently drops an unknown `*.bias`
    for name in tensors:
        if name.endswith(".bias"):
            raise ValueError(f"{name}: vLLM drops it (unexpected biases are ignored), so the drafts would differ")
        if name not in allowed:
            raise ValueError(f"{name}: vLLM refuses to load an unknown tensor")


_LAYER = [f"self_attn.{p}_proj.weight" for p in "qkvo"] + [f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
_NORMS = ["post_attention_layernorm.weight"]


def _chain(
    step: Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]], first: tuple[Tensor, Tensor], n: int, steps: int
) -> Tensor:
    """steps=1: the draft at every position (b, n). Else: chain from the last position, one new entry per step."""
    out, ids = first
    if steps == 1:
        return ids
    drafted = [ids[:, -1]]
    hidden = out[:, -1:]
    for s in range(1, steps):
        hidden, ids = step(hidden, drafted[-1][:, None], torch.tensor([n - 1 + s]))
        drafted.append(ids[:, -1])
    return torch.stack(drafted, 1)


def eagle3_draft(
    path: str | Path,
    aux: Tensor,
    tokens: Tensor,
    steps: int = 1,
    *,
    embedding: Tensor | None = None,
    lm_head: Tensor | None = None,
) -> Tensor:
    """Greedy drafts of a speculators-format EAGLE-3 directory.

    aux (b, n, A*H): see the module docstring; tokens (b, n) target ids of token t+1; embedding (V, H) and lm_head
    (V, H) are the verifier's, used only where the directory has no `embed_tokens.weight` / `lm_head.weight`.
    Returns target ids (b, n) of the draft at each position, or (b, steps) chained from the last position."""
    config, t = read_dir(path)
    if config.get("speculators_model_type") != "eagle3":
        raise ValueError("not a speculators eagle3 directory")
    try:  # validate_speculators_config: needed to serve the directory alone (`vllm serve DIR`, verifier inside)
        _ = config["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
        _ = config["speculators_config"]["verifier"]["name_or_path"]
    except (KeyError, IndexError, TypeError) as e:
        raise ValueError("invalid speculators_config: vLLM refuses the directory") from e
    layer = config["transformer_layer_config"]
    a, vocab = _llama(layer), layer["vocab_size"]
    vd = config.get("draft_vocab_size") or vocab
    t = {k.replace("midlayer.", "layers.0."): v for k, v in t.items() if k != "t2d"}  # vLLM skips t2d
    if "d2t" in t and vd == vocab:
        raise ValueError("d2t with a full draft vocabulary: vLLM has no parameter to load it into")
    num_aux = config.get("num_aux_hidden_states") or len(config.get("eagle_aux_hidden_state_layer_ids") or [0] * 3)
    allowed = {"fc.weight", "norm.weight", "d2t", "embed_tokens.weight", "lm_head.weight"}
    allowed |= {f"layers.0.{k}" for k in _LAYER + _NORMS + ["input_layernorm.weight", "hidden_norm.weight"]}
    if config.get("norm_before_fc"):
        allowed.add("input_norm.weight")
    elif "input_norm.weight" in t:
        raise ValueError("input_norm.weight without norm_before_fc: vLLM drops it")
    if config.get("fc_norm"):
        allowed |= {f"fc_norm.{i}.weight" for i in range(num_aux)}
    _check_names(t, allowed)
    w = {k[len("layers.0.") :]: v for k, v in t.items() if k.startswith("layers.0.")}
    emb, head = t.get("embed_tokens.weight", embedding), t.get("lm_head.weight", lm_head)
    if emb is None or head is None:
        raise ValueError("no embed_tokens.weight / lm_head.weight in the directory: pass the verifier's")
    emb, head = emb.float(), head.float()
    if head.shape[0] != vd:
        raise ValueError(f"lm_head has {head.shape[0]} rows, draft_vocab_size is {vd}")
    offsets = t.get("d2t", torch.zeros(vd, dtype=torch.long)).long()  # vLLM's d2t parameter starts at zeros
    eps, cache = a["eps"], {}

    def step(g: Tensor, tok: Tensor, pos: Tensor) -> tuple[Tensor, Tensor]:
        hn = _rms(g, w["hidden_norm.weight"], eps)
        residual = hn if config.get("norm_before_residual", True) else g  # algos.py: default True
        x = torch.cat([_rms(emb[tok], w["input_layernorm.weight"], eps), hn], -1)
        out = _block(w, a, x, residual, pos, cache)
        normed = _rms(out, t["norm.weight"], eps)
        ids = (normed @ head.T).argmax(-1)
        return (normed if config.get("norm_output") else out), ids + offsets[ids]

    x = aux.float()
    if config.get("norm_before_fc"):
        x = _rms(x, t["input_norm.weight"], eps)
    if config.get("fc_norm"):
        x = torch.cat([_rms(c, t[f"fc_norm.{i}.weight"], eps) for i, c in enumerate(x.chunk(num_aux, -1))], -1)
    g = x @ t["fc.weight"].float().T
    return _chain(step, step(g, tokens, torch.arange(aux.shape[1])), aux.shape[1], steps)


def eagle_draft(
    path: str | Path, hidden: Tensor, tokens: Tensor, embedding: Tensor, lm_head: Tensor, steps: int = 1
) -> Tensor:
    """Greedy drafts of vLLM's native EAGLE-1 directory (a one-layer Llama config.json).

    hidden (b, n, H): the verifier's final hidden state (after its final norm); tokens (b, n) ids of token t+1;
    embedding (V, H) and lm_head (V, H) the verifier's (a `embed_tokens.weight` in the directory wins, as in vLLM).
    Returns ids (b, n), or (b, steps) chained from the last position."""
    config, t = read_dir(path)
    a = _llama(config)
    if "layers.0.input_layernorm.weight" in t:
        raise ValueError("layers.0.input_layernorm.weight: vLLM's first EAGLE layer has none (nn.Identity)")
    if "fc.bias" in t:
        raise ValueError("fc.bias: vLLM builds fc without a bias and drops it")
    if "lm_head.weight" in t:
        raise ValueError("lm_head.weight: EagleLlamaForCausalLM has no lm_head to load it into")
    _check_names(t, {"fc.weight", "embed_tokens.weight"} | {f"layers.0.{k}" for k in _LAYER + _NORMS})
    w = {k[len("layers.0.") :]: v for k, v in t.items() if k.startswith("layers.0.")}
    emb, head, cache = t.get("embed_tokens.weight", embedding).float(), lm_head.float(), {}

    def step(h: Tensor, tok: Tensor, pos: Tensor) -> tuple[Tensor, Tensor]:
        x = torch.cat([emb[tok], h.float()], -1) @ t["fc.weight"].float().T  # embedding first
        out = _block(w, a, x, x, pos, cache)  # no input norm, no final norm
        return out, (out @ head.T).argmax(-1)

    return _chain(step, step(hidden, tokens, torch.arange(hidden.shape[1])), hidden.shape[1], steps)


def medusa_draft(path: str | Path, hidden: Tensor) -> Tensor:
    """Greedy drafts of vLLM's native Medusa directory.

    hidden (b, n, H): the verifier's final (normed) hidden state at t. Returns (b, n, num_heads) target ids; head k
    (0-based) predicts the token at t+2+k. Tensors vLLM would not load (biases without medusa_fc_bias) are ignored."""
    config, t = read_dir(path)
    for key in list(config):  # MedusaConfig.from_pretrained renames e.g. medusa_num_heads / medusa_num_layers
        if "num" in key and "heads" in key:
            config["num_heads"] = config.pop(key)
        elif "num" in key and "layers" in key:
            config["num_hidden_layers"] = config.pop(key)
    t = {k.replace("medusa_heads.", ""): v for k, v in t.items()}
    vocab = config["vocab_size"]
    truncated = config.get("truncated_vocab_size") or vocab
    token_map = t.get("token_map") if truncated < vocab else None  # ignored unless the vocabulary is truncated
    shared = config.get("original_lm_head", False)
    if truncated < vocab and (token_map is None or not shared):
        raise ValueError("a truncated Medusa vocabulary loads in vLLM only with token_map and original_lm_head")
    drafts = []
    for k in range(config.get("num_heads", 5)):  # MedusaConfig's defaults: 5 heads of 1 layer
        x = hidden.float()
        for j in range(config.get("num_hidden_layers", 1)):
            y = x @ t[f"blocks.{k}.layers.{j}.weight"].float().T
            if config.get("medusa_fc_bias", False):
                y = y + t[f"blocks.{k}.layers.{j}.bias"].float()
            x = x + torch.nn.functional.silu(y)
        if shared:  # original_lm_head: one head for all, loaded from lm_head.weight or lm_heads.0.weight
            head = t.get("lm_head.weight", t.get("lm_heads.0.weight"))
        else:
            head = t[f"lm_heads.{k}.weight"]
        if token_map is not None and head.shape[0] > token_map.shape[0]:
            head = head[token_map]  # vLLM keeps only the token_map rows
        if head.shape[0] != truncated:
            raise ValueError(f"lm_head of head {k} has {head.shape[0]} rows, vLLM expects {truncated}")
        ids = (x @ head.float().T).argmax(-1)
        drafts.append(ids if token_map is None else token_map.long()[ids])
    return torch.stack(drafts, -1)


def _save(path: Path, config: dict, tensors: dict[str, Tensor]) -> Path:
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path


def _random_dirs(root: Path, h: int = 64, vd: int = 20, v: int = 50, seed: int = 0) -> dict[str, Path]:
    """Small random EAGLE-3 (trimmed vocabulary, 3 aux layers), EAGLE-1 and Medusa (3 heads) directories.

    H = h = 4 heads x 16 with 2 kv heads; used by the self-check below and by cross-checks outside the repository."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=g) / shape[-1] ** 0.5

    def layer(width: int) -> dict[str, Tensor]:  # q/k/v read `width` features: 2H for EAGLE-3, H for EAGLE-1
        w = {f"self_attn.{p}_proj.weight": rnd(32 if p in "kv" else 64, width) for p in "qkv"}
        w |= {f"mlp.{p}_proj.weight": rnd(2 * h, h) for p in ("gate", "up")}
        w |= {"self_attn.o_proj.weight": rnd(h, 64), "mlp.down_proj.weight": rnd(h, 2 * h)}
        w |= {"post_attention_layernorm.weight": 1 + 0.1 * rnd(h)}
        return {f"layers.0.{k}": x for k, x in w.items()}

    rope = {"rope_type": "default", "rope_theta": 500.0}
    llama = dict(model_type="llama", hidden_size=h, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    llama |= dict(intermediate_size=2 * h, rms_norm_eps=1e-6, vocab_size=v, rope_parameters=rope, num_hidden_layers=1)
    ids = torch.randperm(v, generator=g)[:vd].sort().values  # the draft vocabulary, as target ids
    eagle3 = layer(2 * h) | {f"layers.0.{n}.weight": 1 + 0.1 * rnd(h) for n in ("input_layernorm", "hidden_norm")}
    eagle3 |= {"fc.weight": rnd(h, 3 * h), "norm.weight": 1 + 0.1 * rnd(h), "lm_head.weight": rnd(vd, h)}
    eagle3 |= {"d2t": ids - torch.arange(vd), "t2d": torch.zeros(v, dtype=torch.bool).index_fill(0, ids, True)}
    spec = {"speculators_model_type": "eagle3", "transformer_layer_config": llama, "draft_vocab_size": vd}
    spec["eagle_aux_hidden_state_layer_ids"] = [1, 3, 5]
    spec["speculators_config"] = {"proposal_methods": [{"speculative_tokens": 3}], "verifier": {"name_or_path": "x"}}
    medusa = {f"blocks.{k}.layers.0.weight": rnd(h, h) for k in range(3)}
    medusa |= {f"blocks.{k}.layers.0.bias": rnd(h) for k in range(3)}  # loaded only with medusa_fc_bias
    medusa |= {f"lm_heads.{k}.weight": rnd(v, h) for k in range(3)}
    medusa_config = {"model_type": "medusa", "num_heads": 3, "num_hidden_layers": 1, "hidden_size": h, "vocab_size": v}
    return {
        "eagle3": _save(root / "eagle3", spec, eagle3),
        "eagle": _save(root / "eagle", llama, layer(h) | {"fc.weight": rnd(h, 2 * h)}),
        "medusa": _save(root / "medusa", medusa_config, medusa),
    }


if __name__ == "__main__":  # a self-check of shapes and vocabulary maps: python tests/format_reference.py
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        dirs, (b, n, v) = _random_dirs(Path(tmp)), (3, 12, 50)
        emb, head, tokens = torch.randn(v, 64), torch.randn(v, 64), torch.randint(0, v, (b, n))
        allowed = load_file(str(dirs["eagle3"] / "model.safetensors"))["t2d"]
        for steps in (1, 4):
            drafts = eagle3_draft(dirs["eagle3"], torch.randn(b, n, 192), tokens, steps, embedding=emb)
            assert drafts.shape == (b, n if steps == 1 else steps) and allowed[drafts].all(), drafts
            drafts = eagle_draft(dirs["eagle"], torch.randn(b, n, 64), tokens, emb, head, steps)
            assert drafts.shape == (b, n if steps == 1 else steps) and ((0 <= drafts) & (drafts < v)).all()
        hidden = torch.randn(b, n, 64)
        plain = medusa_draft(dirs["medusa"], hidden)  # the bias tensors are in the directory but not loaded
        assert plain.shape == (b, n, 3) and ((0 <= plain) & (plain < v)).all()
        config, tensors = read_dir(dirs["medusa"])
        _save(dirs["medusa"], config | {"medusa_fc_bias": True}, tensors)
        assert not torch.equal(medusa_draft(dirs["medusa"], hidden), plain)
    print("format_reference self-check passed")
