"""The corpus and its split, the tokenizer, the token-id cache, prompts (held-out, chat), the seq2seq pairs."""
