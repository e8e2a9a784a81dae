"""Process group and Megatron parallel state from the recipe; seeding; teardown."""

from __future__ import annotations

import os
import random
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta


@dataclass(frozen=True)
class Runtime:
    """Where this process sits. Built once by setup(); passed explicitly, never global."""

    device: "object"  # torch.device
    rank: int
    world_size: int
    local_rank: int

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


def resolve_device(choice: str) -> str:
    import torch

    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        from megacli.errors import UserError

        raise UserError("launch.device = 'cuda' but no CUDA device is visible (use 'auto' or 'cpu')")
    return choice


def quiet_megatron_imports() -> None:
    """Megatron-Core warns at import about every missing TE/Apex kernel; we say once what is used."""
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|apex|TE).*")
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\..*")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"megatron\..*")
    import logging

    logging.getLogger("megatron").setLevel(logging.ERROR)
    # The checkpoint writer logs a failed write before raising it; the raised error is what megacli reports.
    logging.getLogger("megatron.core.dist_checkpointing.strategies.filesystem_async").setLevel(logging.CRITICAL)


def setup(*, parallel, launch, seed: int, deterministic: bool = False, cores_kept: int = 0) -> Runtime:
    """Initialise torch.distributed (nccl on CUDA, gloo on CPU) and Megatron's parallel groups. On
    CPU the ranks of a machine share its cores as torch threads, less ``cores_kept`` left for other
    work of the job (unless launch.threads_per_process says how many)."""
    quiet_megatron_imports()
    import torch
    import torch.distributed as dist

    device_type = resolve_device(launch.device)
    if deterministic:
        use_deterministic_kernels(device_type)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cpu":
        from megacli.backend import cpu

        cpu.enable()
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        threads = launch.threads_per_process or max(1, ((os.cpu_count() or 1) - cores_kept) // local_world)
        torch.set_num_threads(threads)
        device = torch.device("cpu")
    else:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    if not dist.is_initialized():
        # a one-process job rendezvous with itself in memory: no port to bind, none to lose to another process
        store = {"store": dist.HashStore()} if world == 1 else {}
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo", rank=rank, world_size=world,
                                timeout=timedelta(minutes=launch.timeout_minutes), **store)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tensor,
        pipeline_model_parallel_size=parallel.pipeline,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline,
        context_parallel_size=parallel.context,
        expert_model_parallel_size=parallel.expert,
        expert_tensor_parallel_size=parallel.expert_tensor,
        distributed_timeout_minutes=launch.timeout_minutes,
    )
    seed_everything(seed)
    return Runtime(device=device, rank=rank, world_size=world, local_rank=local_rank)


def use_deterministic_kernels(device_type: str) -> None:
    """train.deterministic. Runs before anything touches CUDA: cuBLAS reads its workspace setting
    when its first handle is made, NCCL its algorithm when its first communicator is."""
    import torch

    if device_type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # what deterministic cuBLAS needs
        os.environ.setdefault("NCCL_ALGO", "Ring")  # one reduction order (not NCCL's per-size choice)
        # The flash, cuDNN and memory-efficient attention backward passes may accumulate with atomics.
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        torch.backends.cuda.enable_cudnn_sdp(False)
        torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True)


def seed_everything(seed: int) -> None:
    """The same seed on every rank for python/numpy/torch (weights are initialised by name, see
    engine.init), and Megatron's tensor-parallel RNG tracker for dropout inside TP regions."""
    import numpy as np
    import torch
    from megatron.core import tensor_parallel

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


@contextmanager
def running(*, parallel, launch, seed: int, deterministic: bool = False, cores_kept: int = 0):
    """setup(), the body with its Runtime, then teardown() however the body ends. A collective that
    timed out becomes one message naming this rank and the collective."""
    runtime = setup(parallel=parallel, launch=launch, seed=seed, deterministic=deterministic, cores_kept=cores_kept)
    try:
        yield runtime
    except RuntimeError as exc:  # torch's DistBackendError on a collective timeout is one
        stalled = stall_error(exc, rank=runtime.rank, timeout_minutes=launch.timeout_minutes)
        if stalled is None:
            raise
        raise stalled from None
    finally:
        teardown()


def teardown() -> None:
    """Ends the run's process groups and Megatron-Core's per-run state, so that a second run in this
    process (the in-process path) starts clean."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megacli.engine.core_compat import forget_moe_metrics

    forget_moe_metrics()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def stall_error(exc: BaseException, *, rank: int, timeout_minutes: float):
    """A UserError saying which collective timed out on this rank (as far as the error tells), or
    None when `exc` is not a collective timeout."""
    import re
    import traceback

    text = str(exc)
    if not re.search(r"timed out|timeout", text, re.IGNORECASE):
        return None
    op = re.search(r"OpType=(\w+)", text)  # NCCL's watchdog names the operation
    where = ""
    if op is None:  # gloo does not: the innermost torch.distributed call in the traceback does
        frames = traceback.extract_tb(exc.__traceback__)
        c10d = [f for f in frames if f.filename.endswith("distributed_c10d.py")]
        plumbing = ("/torch/", "/megacli/backend/", "/megacli/engine/distributed")  # not where the model called it
        callers = [f for f in frames if not any(part in f.filename for part in plumbing)]
        if not c10d and "gloo" not in text:
            return None
        # an asynchronous collective times out where its handle is waited on, outside torch.distributed
        where = f" called from {callers[-1].name} ({callers[-1].filename.rsplit('/', 2)[-1]}:{callers[-1].lineno})" if callers else ""
    collective = op.group(1).lower() if op else (c10d[-1].name if c10d else "an asynchronous collective")
    from megacli.errors import UserError

    err = UserError(f"rank {rank} waited {timeout_minutes:g} min (launch.timeout_minutes) in {collective}{where} for a "
                    f"rank that stopped answering (stopped, hung or dead): {text.strip().splitlines()[0]}")
    err.exit_code = 1
    return err


def is_reporting_rank() -> bool:
    """Last pipeline stage, first TP/DP/CP rank: where the loss lives."""
    from megatron.core import parallel_state as ps

    return (ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0
            and ps.get_data_parallel_rank(with_context_parallel=True) == 0)
