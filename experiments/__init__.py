"""Experiments: training the base and the drafters, benchmarking, generating.

experiments/*.py are the entry points, each `python -m experiments.<name>` with a Hydra config of the same
name in conf/ (train_seq2seq's is conf/seq2seq.yaml): train_base, cache_features, train_drafter, benchmark,
generate, baseline, peer, grow_tree, train_seq2seq, summarize, curves. An entry point parses its config and
calls the library; it never imports another entry point.

experiments/lib/ is the library they share, as subpackages that stack one way (common, data, store, families,
training, methods, report, cli; lowest first, listed in experiments/lib/__init__.py). tests/test_structure.py
checks these rules.
"""
