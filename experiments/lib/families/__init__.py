"""The drafter-family registry, the two families that live here (the draft model and early exit), and the sequential
heads' build with Hydra++'s prefix layer."""
