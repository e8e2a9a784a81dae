"""Getting worker processes: PyTorch's elastic launcher (torch.distributed.run) when megacli is
started by hand, or the environment of an existing job (torchrun, Slurm srun).

Workers run `python -m megacli.worker JOB RECIPE.yaml` on the resolved recipe written into the run
directory. A worker that fails writes its error to <run.dir>/errors/rank<N>.json; the launcher shows
the first one, once, instead of a traceback from every rank.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import sys
import time
import uuid
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

from megacli.errors import UserError
from megacli.rundir import STOPPED_FILE, error_dir

# Set by torchrun / torch.distributed.run for every worker.
_LAUNCHED_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def inside_torchrun() -> bool:
    return all(v in os.environ for v in _LAUNCHED_VARS)


@contextmanager
def as_single_worker():
    """This process as the one worker of a one-process job: the env:// variables torchrun would
    set, restored afterwards (a later job started from this process must not think it is a worker)."""
    saved = {k: os.environ.get(k) for k in (*_LAUNCHED_VARS, "LOCAL_WORLD_SIZE")}
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def inside_srun_per_process() -> bool:
    """srun started one task per worker (not one per node)."""
    return "SLURM_PROCID" in os.environ and int(os.environ.get("SLURM_STEP_NUM_TASKS", os.environ.get("SLURM_NTASKS", "1"))) > 1


def first_slurm_host(nodelist: str) -> str:
    """First hostname of a Slurm nodelist such as 'gpu[003-010,012],cpu1' -> 'gpu003'."""
    head = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist)
    if not head:
        return nodelist
    base, ranges = head.group(1), head.group(3)
    if not ranges:
        return base
    return base + ranges.split(",")[0].split("-")[0]


def slurm_to_torch_env(env: dict[str, str]) -> dict[str, str]:
    """The torch.distributed env:// variables for a task started by `srun` (one task per worker)."""
    ntasks = int(env.get("SLURM_STEP_NUM_TASKS", env.get("SLURM_NTASKS", "1")))
    nnodes = int(env.get("SLURM_STEP_NUM_NODES", env.get("SLURM_NNODES", "1")))
    job_id = int(env.get("SLURM_JOB_ID", "0"))
    # Another port after each requeue: an attempt's tasks on a node that stopped answering may hold the last one.
    restarts = int(env.get("SLURM_RESTART_COUNT") or 0)
    return {
        "RANK": env["SLURM_PROCID"],
        "WORLD_SIZE": str(ntasks),
        "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
        "LOCAL_WORLD_SIZE": str(ntasks // max(nnodes, 1)),
        "MASTER_ADDR": env.get("MASTER_ADDR") or first_slurm_host(env.get("SLURM_STEP_NODELIST", env.get("SLURM_JOB_NODELIST", "localhost"))),
        "MASTER_PORT": env.get("MASTER_PORT") or str(20000 + (job_id + 997 * restarts) % 20000),
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_id(*, given: str | None, rdzv_endpoint: str | None, env=os.environ) -> str:
    """One id for every node and rank of a job: launch.job_id, else the scheduler's job id (Slurm),
    else torchrun's run id, else one derived from the rendezvous endpoint (the same on every node
    started by hand), else (one node) a new one."""
    if given:
        return given
    for var in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"):
        if env.get(var):
            return env[var]
    if rdzv_endpoint:
        import hashlib

        return "megacli-" + hashlib.blake2b(rdzv_endpoint.encode(), digest_size=6).hexdigest()
    return "megacli-" + uuid.uuid4().hex[:12]


def wait_for_nodes(*, endpoint: str, job: str, nnodes: int, node_rank: int, timeout_s: float):
    """Count the nodes of `job` arriving at the rendezvous endpoint (node 0 hosts its store) and wait
    for all of them, so a missing node is named instead of a silent wait. Returns the store, which
    node 0 keeps open: torch's rendezvous, in the same process, uses it."""
    from torch.distributed import TCPStore

    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit():
        raise UserError(f"launch.rdzv_endpoint = {endpoint!r}: expected HOST:PORT")
    deadline = time.monotonic() + timeout_s
    try:
        store = TCPStore(host, int(port), is_master=node_rank == 0, multi_tenant=True, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout_s))
    except (RuntimeError, TimeoutError, ValueError) as exc:
        role = "host it" if node_rank == 0 else f"reach it (is node_rank 0 started on {host}?)"
        raise UserError(f"launch.rdzv_endpoint = {endpoint!r}: could not {role}: {exc}") from None
    key = f"megacli/{job}/nodes_arrived"
    arrived = store.add(key, 1)
    while arrived < nnodes:
        if time.monotonic() > deadline:
            raise UserError(f"rendezvous at {endpoint} (job id {job!r}): {arrived} of launch.nnodes = {nnodes} nodes "
                            f"arrived within {timeout_s / 60:g} min (launch.timeout_minutes). Start `megacli` on every "
                            f"node with the same launch.rdzv_endpoint and launch.job_id, node_rank 0..{nnodes - 1}")
        time.sleep(0.5)
        arrived = store.add(key, 0)
    return store


# Signals the launcher's elastic agent passes on to the workers; SIGUSR1 is Slurm's warning before
# preemption or the time limit (--signal=USR1@120).
FORWARDED_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


def _supported_launch_options(**options) -> dict:
    """The LaunchConfig options this torch has: older releases (torch 2.11 among them) lack
    signals_to_handle and shutdown_timeout; there SIGUSR1 is not passed on to the workers and a
    stopping worker gets the elastic agent's default 30 s before SIGKILL."""
    import dataclasses

    from torch.distributed.launcher.api import LaunchConfig

    known = {f.name for f in dataclasses.fields(LaunchConfig)}
    return {name: value for name, value in options.items() if name in known}


def launch_workers(job: str, recipe_file: Path, *, run_dir: str, nproc: int, nnodes: int, node_rank: int,
                   rdzv_endpoint: str | None, job_id: str, timeout_minutes: float) -> None:
    """Start nproc workers on this node through torch.distributed's elastic launcher and wait.
    Raises UserError (the first worker's message) when a worker fails. A signal is passed on to the
    workers, which get `timeout_minutes` to save and stop before they are killed."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from megacli.lifetime import LAUNCHER_PID_VAR

    # The elastic agent logs every SIGTERM it sends to surviving workers; the first error is what matters.
    for name in ("torch.distributed.elastic", "torch.distributed.launcher"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    for stale in [*error_dir(run_dir).glob("rank*.json"), Path(run_dir) / STOPPED_FILE]:
        stale.unlink(missing_ok=True)
    standalone = nnodes == 1 and rdzv_endpoint is None
    timeout_s = timeout_minutes * 60
    store = None  # node 0 hosts the rendezvous store for the whole job
    if not standalone:
        store = wait_for_nodes(endpoint=rdzv_endpoint or "", job=job_id, nnodes=nnodes, node_rank=node_rank,
                               timeout_s=timeout_s)
    config = LaunchConfig(
        min_nodes=nnodes,
        max_nodes=nnodes,
        nproc_per_node=nproc,
        run_id=job_id,
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}" if standalone else (rdzv_endpoint or ""),
        rdzv_configs={"rank": node_rank, "join_timeout": int(timeout_s) + 1} if not standalone else {},
        max_restarts=0,
        monitor_interval=0.5,
        start_method="spawn",
        **_supported_launch_options(signals_to_handle=FORWARDED_SIGNALS, shutdown_timeout=int(timeout_s) + 1),
    )
    # For the workers only: a later job run from this process (or a child it starts) has no launcher.
    previous = os.environ.get(LAUNCHER_PID_VAR)
    os.environ[LAUNCHER_PID_VAR] = str(os.getpid())
    try:
        elastic_launch(config, sys.executable)("-m", "megacli.worker", job, str(recipe_file))
    except ChildFailedError as exc:
        raise first_worker_error(run_dir, fallback=exc) from None
    except SignalException as exc:
        check_stopped_cleanly(run_dir, exc.sigval)
    finally:
        del store
        if previous is None:
            os.environ.pop(LAUNCHER_PID_VAR, None)
        else:
            os.environ[LAUNCHER_PID_VAR] = previous


def check_stopped_cleanly(run_dir: str | Path, sig: signal.Signals) -> None:
    """After `sig` was passed on to the workers: return when they stopped at a step boundary (they
    said what they saved); raise the first worker's error, or say that nothing was saved."""
    if (Path(run_dir) / STOPPED_FILE).is_file():
        return
    if any(error_dir(run_dir).glob("rank*.json")):
        raise first_worker_error(run_dir)
    err = UserError(f"stopped on {sig.name} before a step boundary: nothing saved")
    err.exit_code = 128 + int(sig)
    raise err


def first_worker_error(run_dir: str | Path, fallback: BaseException | None = None) -> UserError:
    """The earliest error a worker recorded, as one message (user errors without traceback)."""
    records = []
    for path in error_dir(run_dir).glob("rank*.json"):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    if not records:
        detail = ""
        if fallback is not None and getattr(fallback, "failures", None):
            rank, failure = min(fallback.failures.items(), key=lambda kv: kv[1].timestamp)
            detail = f": rank {rank} exited with code {failure.exitcode}"
        err = UserError(f"a worker process failed{detail} (no error was recorded; it may have been killed, e.g. out of memory)")
        err.exit_code = 1
        return err
    first = min(records, key=lambda r: r["time"])
    if first["user_error"]:
        err = UserError(first["message"])
        err.exit_code = first.get("exit_code", 2)
    else:
        err = UserError(f"rank {first['rank']} failed with {first['type']}: {first['message']}\n\n{first['traceback']}"
                        f"(every rank's error is in {error_dir(run_dir)})")
        err.exit_code = 1
    return err
