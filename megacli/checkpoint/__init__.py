"""Checkpoint files on disk: their layout, formats (torch_dist, Megatron-LM legacy), the tensor-parallel
split rule and safe reading. Imports only errors, recipe types and backend."""
