"""Encoder-decoder targets: the lean cross-attention decoder (cross_decoder), speculative decoding of an
x-transformers encoder-decoder with a small draft encoder-decoder (seq2seq) and the same for a Hugging
Face T5 (t5). The top of verify/: may import every other verify subpackage."""
