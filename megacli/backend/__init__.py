"""Execution backends: the thin layers that let Megatron-Core's code run where it was not written
to run (``cpu``: CPU tensors and gloo collectives instead of CUDA and NCCL).

Nothing in this package does work at import; a backend is switched on by an explicit call.
"""
