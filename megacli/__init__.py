"""megacli: Megatron-Core pretraining behind a clean command line.

Data flows one way: CLI -> recipe (pydantic) -> engine -> Megatron-Core.
Nothing here imports torch or Megatron at import time (the CLI must answer --help fast,
and Megatron's async checkpoint writer spawns processes that re-import modules).
"""

__version__ = "0.1.0"
