"""The drafter-family registry, and the two families that live here: the draft model and early exit."""
