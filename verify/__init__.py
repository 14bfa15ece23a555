"""verify: the shared layer under every drafter family: decoding, verification and the pieces they share.

Subpackages, lowest first. Each may import only from the ones above it in this list (and from itself),
never from medusa/, prophet/ or experiments/; tests/test_structure.py checks it from the source.

    common     argument checks, non-finite guards, vocabulary subsets                 (imports nothing)
    plan       budgets: choosing gamma or a tree size from measured step costs
    training   what every family's loss reads: FeatureBatch, self-distillation, agreement
    backends   what runs a target: the static KV cache, the lean engine, the Target, HF adapters
    loop       the decode loop and its rules: plain and speculative decoding, acceptance, trees,
               the one sampling transform, the Drafter protocol, statistics
    drafters   drafters that need no drafter training of their own: a draft model, prompt lookup,
               early exit
    encdec     encoder-decoder targets (seq2seq, T5) and their drafting

medusa/ builds on verify/, prophet/ on both, experiments/ on all three.
"""
