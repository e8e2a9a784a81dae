"""Checkpoint files on disk: their layout, formats (torch_dist; Megatron-LM's in megatron_lm/), the
tensor-parallel split rule, safe reading, manifests (sizes and checksums) and the space a save needs.
Imports only errors, recipe types and data's tokenizers."""
