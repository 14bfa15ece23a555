"""The decode loop and its rules: plain decoding (plain) and speculative decoding (speculative), the
acceptance rules (acceptance: rejection sampling, greedy, typical, delta), token trees (tree), the one
sampling transform (sampling), the Drafter protocol every drafter implements (drafter) and the per-run
statistics (stats). Sees a target only through verify.backends' Target and TargetOutput; may import the
subpackages below it (common, plan, training, backends)."""
