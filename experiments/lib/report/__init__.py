"""Benchmark results as files people read, figures per prompt category, the encoder-decoder benchmark."""
