"""Self-speculative drafting by early exit (Draft & Verify, LayerSkip; lucidrains' early-exit idea):
the frozen target's own first `layer` blocks plus a small trained exit head draft a chain; there is no
second model. It runs wherever the lean engine runs the base: an x-transformers base (engine.py's LeanLM) or
a Hugging Face Llama (lean_llama.py's LeanLlama, which has the same `first_blocks`).

What is shared with verification (`share_cache=True`, the default). The drafter runs the target's
first blocks with the target's own weights on the target's own KV cache. After every verification
the target's cache already holds, for the first `layer` attention layers, the keys and values of
every accepted token: the same numbers the drafter would compute, since the inputs, the positions and
the weights are the same. So the drafter needs no cache, no prefill and no catch-up of its own. A draft
step appends one entry per row to those layers beyond each row's cached length (the pending token,
then the drafts); `propose` rewinds the cache to where it found it before it returns, so the
verification forward sees exactly the cache plain decoding would, and rewrites those slots. What is
not shared: the first blocks' computation for the drafted tokens themselves, which verification
repeats (LayerSkip reuses it; that needs a verification forward that starts at block `layer`).

`share_cache=False` keeps an own cache of the first blocks instead (the way the independent draft
model works, verify/drafters/draft_model.py): a prefill of the prompts through the first blocks, and drafted
entries kept when accepted. It exists to measure what sharing saves.

The target hands itself over through the optional `attach(target)` hook of the drafter protocol
(verify/loop/drafter.py), which the decode loop calls before its prefill.

Drafts are the exit head's argmax at temperature 0; otherwise they are sampled from the head's
distribution after the shared sampling transform, and q is returned (lossless speculative sampling).
`vocab` (sorted ids (N,)) trims the head's output layer: drafts never leave the subset, q is zero outside it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from verify.backends.engine import check_layers
from verify.backends.graphs import static_step
from verify.backends.hf import HFBase, HFTarget
from verify.backends.lean import COMPILE_OPTIONS, lean
from verify.backends.target import Target, TargetOutput, pad_prompts
from verify.common.vocab import check_vocab
from verify.drafters.draft_model import roll_uncached
from verify.loop.drafter import Draft, Verdict
from verify.loop.sampling import SamplingConfig, draft_from_logits

LLAMA = "LlamaForCausalLM"  # the one Hugging Face class the lean engine runs (verify/backends/lean_llama.py)


def check_lean_base(base: nn.Module) -> None:
    """Early exit runs the base's own first blocks on the lean engine: an x-transformers base or a Hugging Face
    Llama. Any other Hugging Face model runs on transformers' own forward (HFTarget), which has no first-blocks
    step and no cache to share."""
    if isinstance(base, HFBase) and type(base.hf).__name__ != LLAMA:
        raise ValueError(
            f"early exit needs a base the lean engine runs (x-transformers, or a Hugging Face {LLAMA}): it drafts "
            f"with the base's first blocks on the target's own cache; got a Hugging Face {type(base.hf).__name__}"
        )


class EarlyExitDrafter:
    def __init__(
        self,
        base: nn.Module,
        head: Callable[[Tensor], Tensor],
        *,
        layer: int,
        vocab: Tensor | None = None,
        share_cache: bool = True,
        compile: bool | str = False,
    ):
        """base: the frozen target's model (an x-transformers TransformerWrapper or an HFBase around a Llama);
        head: states after block `layer` (b, n, d) -> logits (b, n, N) over `vocab` (all V when None)."""
        if not isinstance(share_cache, bool):
            raise ValueError(f"share_cache={share_cache!r}: must be true or false")
        check_lean_base(base)
        self.base, self.engine = (
            base,
            lean(base, compile=compile),
        )  # the target's own fused weights (built once per base)
        self.layer = check_layers([layer], self.engine.decoder.depth, name="layer")[0]
        self.head, self.share_cache = head, share_cache
        # on its own cache it rolls back as the draft model does, keeping its own drafted entries (DraftModelDrafter)
        self.rolls_own_draft = not share_cache
        self.vocab = check_vocab(vocab, base.num_tokens)  # (N,) or None = all V
        self.vocab_size: int = base.num_tokens
        # A compiled or graphed draft step runs on the cache's whole buffers: one program per width (1; 2 with an
        # own cache). Kept on the engine, which lives as long as the base: a drafter is built per generation,
        # and a step made per drafter would compile or capture again every time.
        steps = self.engine.block_steps
        if compile and compile not in steps:
            steps[compile] = static_step(self.engine.forward_blocks, compile, options=COMPILE_OPTIONS)
        self.step = steps[compile] if compile else None
        self.target: Target | None = None

    def attach(self, target: Target) -> None:
        """The decode loop hands over its target (before the prefill): its cache is the one drafted on."""
        if target.model is not self.base:
            raise ValueError(
                "the early-exit drafter was built on another model than the target: it drafts with the target's own "
                "first blocks"
            )
        if self.share_cache and isinstance(target, HFTarget):
            raise ValueError(
                "share_cache=True drafts on the lean engine's cache, and this target runs on transformers' own forward "
                "(HFTarget): decode on the lean engine (engine=lean or auto), or set share_cache=false"
            )
        self.target = target

    @torch.inference_mode()
    def begin(self, prompts: list[list[int]], prefill: TargetOutput, pending: Tensor) -> None:
        self.fed = 0  # entries the last propose appended to the drafting cache
        if self.share_cache:
            if self.target is None or self.target.cache is None:
                raise ValueError(
                    "share_cache=True needs the target: decode with verify.loop.speculative.speculative_generate, "
                    "which calls drafter.attach(target) (a wrapper must pass attach on)"
                )
            self.cache = self.target.cache  # holds every prompt token's entries; the pending token is next
            self.uncached = pending[:, None]  # (b, 1)
            return
        tokens, lengths = pad_prompts(prompts, 0, pending.device)  # (b, W), rows from index 0
        width = tokens.shape[1]
        self.cache = self.engine.decoder.new_cache(
            len(prompts), self.engine.max_seq_len + 65, device=pending.device, layers=self.layer
        )  # one attention layer per block
        self.engine.first_blocks(tokens, self.cache, blocks=self.layer)  # eager: every prompt width is a new shape
        # keep all but the last prompt token: it opens the first draft forward with the pending token
        self.cache.commit(torch.arange(width, device=pending.device) < (lengths - 1)[:, None])
        self.uncached = torch.cat((tokens.gather(1, (lengths - 1)[:, None]), pending[:, None]), dim=1)  # (b, 2)

    def _forward(self, tokens: Tensor) -> Tensor:
        """tokens (b, n) through the first blocks on the drafting cache -> logits (b, n, N) of the exit head."""
        return self.head(self.engine.first_blocks(tokens, self.cache, blocks=self.layer, step=self.step))

    @torch.inference_mode()
    def propose(self, gamma: int, sampling: SamplingConfig, generator: torch.Generator | None) -> Draft:
        x, tokens, qs = self.uncached, [], []
        for _ in range(gamma):
            logits = self._forward(x)[:, -1]  # (b, N)
            token, q = draft_from_logits(logits, sampling, generator, vocab=self.vocab, vocab_size=self.vocab_size)
            tokens.append(token)
            qs += [] if q is None else [q]  # (b, V), zero outside the subset
            x = token[:, None]
        self.fed = self.uncached.shape[1] + gamma - 1
        if self.share_cache:  # rewind the target's cache before it verifies: a length rewind, nothing moves
            self.cache.commit(torch.zeros(x.shape[0], self.fed, dtype=torch.bool, device=x.device), prefix=True)
        return Draft(tokens=torch.stack(tokens, dim=1), q=torch.stack(qs, dim=1) if qs else None)

    def commit(self, verdict: Verdict) -> None:
        if self.share_cache:  # verification wrote the accepted tokens' entries into the shared cache
            self.uncached = verdict.pending[:, None]
        else:  # an own cache rolls back as the draft model's does
            self.uncached = roll_uncached(self.cache, self.uncached, self.fed, verdict)
        self.fed = 0


def make_drafter(
    module: nn.Module,
    base: nn.Module,
    *,
    mode: str = "chain",
    vocab: Tensor | None = None,
    share_cache: bool = True,
    compile: bool = False,
) -> EarlyExitDrafter:
    """The early-exit drafter: the base's first `module.layer` blocks and this head (decode kwargs from
    conf/drafter/early_exit.yaml `decode:`). It drafts chains only (`mode` is there for the benchmark's
    <family>_<mode> method names)."""
    if mode != "chain":
        raise ValueError(f"mode={mode!r}: the early-exit drafter drafts chains only (mode=chain)")
    return EarlyExitDrafter(
        base,
        module.eval().for_decoding(vocab),
        layer=module.layer,
        vocab=vocab,
        share_cache=share_cache,
        compile=compile,
    )
