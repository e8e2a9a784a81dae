"""Data: tokenizers, corpus readers, Megatron indexed datasets and the preprocessing pipeline.
Import the submodules directly; this package imports nothing at load time."""
