"""Megatron-LM's own checkpoints (torch_dist, its default, and legacy ``--ckpt-format torch``), read,
written, staged for a reshard and resumed; its run arguments mapped to and from a recipe."""
