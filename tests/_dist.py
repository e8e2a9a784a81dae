"""Run a function in N gloo processes and collect what each returns: processes forked from the
warm interpreter (tests/conftest.py warm_call), which has imported torch and Megatron-Core as a CPU
run imports them.

Used by tests that prove parallel behaviour below the CLI; end-to-end tests go through the real
launcher (`megacli pretrain` with launch.nproc) instead.
"""

from __future__ import annotations

import io
import os
import traceback
from queue import Empty

import torch
import torch.multiprocessing as mp

from megacli.launch import free_port  # noqa: F401  (tests that need a port of their own)


# Stores hosted for each spawn: a rank function that builds a second process group after destroying the
# first moves to the next one (use_next_store), since the first still holds the old group's keys.
STORES_PER_SPAWN = 2


def use_next_store() -> None:
    """In a rank: point the next ``init_process_group`` at the next store its parent hosts."""
    ports = os.environ["MEGACLI_TEST_STORE_PORTS"].split(",")
    os.environ["MASTER_PORT"] = ports[ports.index(os.environ["MASTER_PORT"]) + 1]


def _entry(rank, world_size, ports, fn, args, queue):
    # The parent hosts the stores on ports it bound itself, and every rank joins as a client (as
    # under torchrun's agent): no port is handed over free for another process to take meanwhile.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[0]), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
                      TORCHELASTIC_USE_AGENT_STORE="True",
                      MEGACLI_TEST_STORE_PORTS=",".join(map(str, ports)))
    import torch

    torch.set_num_threads(1)
    try:
        # torch.save to bytes: tensors sent through a Queue would share memory with a process about to exit.
        buf = io.BytesIO()
        torch.save(fn(rank, world_size, *args), buf)
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException:  # report to the parent, which fails the test with this traceback
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn, world_size: int, *args, timeout: float = 600) -> list:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes; return results by rank.
    ``fn`` must be a module-level function (it is pickled by name)."""
    from tests.conftest import warm_call

    status, replies = warm_call(_fork_ranks, fn, world_size, args, timeout, timeout=timeout + 120)
    if status != "ok":
        raise AssertionError(f"the process starting the workers failed ({status}): {replies}")
    errors = [f"rank {rank}:\n{payload}" for rank, kind, payload in replies if kind == "error"]
    if errors:
        raise AssertionError("worker failed\n" + "\n".join(errors))
    results = {rank: torch.load(io.BytesIO(payload), weights_only=False) for rank, _, payload in replies}
    return [results[r] for r in range(world_size)]


def _fork_ranks(fn, world_size: int, args: tuple, timeout: float) -> list:
    """The ranks' processes, forked from this one: their (rank, status, payload) answers, up to the
    first error."""
    from torch.distributed import TCPStore

    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    stores = [TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
              for _ in range(STORES_PER_SPAWN)]
    ports = [store.port for store in stores]
    procs = [ctx.Process(target=_entry, args=(r, world_size, ports, fn, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    replies = []
    try:
        for _ in range(world_size):
            try:
                replies.append(queue.get(timeout=timeout))
            except Empty:
                replies.append(("(missing)", "error", f"{world_size - len(replies)} rank(s) gave no answer within {timeout} s"))
            if replies[-1][1] == "error":
                break
    finally:
        failed = replies and replies[-1][1] == "error"
        for p in procs:
            p.join(timeout=5 if failed else 60)
            if p.is_alive():
                p.kill()
    return replies
