"""The engine: distributed setup, model builder, data, one training loop, checkpoints."""
