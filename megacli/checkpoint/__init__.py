"""Checkpoint files on disk: their manifest (sizes and checksums) and the space a save needs."""
