"""What runs a target model: the static KV cache (cache), the lean engine for x-transformers decoders
(engine) and for transformers' Llama (lean_llama), steps replayed as CUDA graphs (graphs), the builder that
picks, checks and compiles an engine (lean), the Target with its prefill/extend/rollback (target), the
adapter on transformers' own forward (hf), and the choice between them (choose: make_target). Knows nothing
of drafting or acceptance; may import verify.common, verify.plan and verify.training."""
