"""How a run is controlled as a process: its metrics history on resume, the job id and rendezvous
of several nodes, the run-directory lock, signals, stalled ranks and the death of the launcher."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from tests.conftest import MOCK_GPT as TINY, layout


def test_resumed_run_replaces_the_records_after_its_checkpoint(tmp_path):
    from megacli.engine.metrics import MetricsLog

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"iteration": i, "loss": 1.0}) + "\n" for i in (1, 2, 3, 4)) + '{"itera')
    log = MetricsLog(run_dir=str(tmp_path), enabled=True, total_iters=6, start_iter=2, tokens_per_step=1,
                     flops_per_step=1.0, world_size=1, device=torch.device("cpu"), loggers=[])
    log.close()
    assert [json.loads(line)["iteration"] for line in path.read_text().splitlines()] == [1, 2]


# ---- through the real launcher ----

FOREVER = ["train.iters=100000", "optim.warmup_iters=1"]


def command(run_dir: Path, *sets: str) -> list[str]:
    every = [*TINY, *layout(), *sets, f"run.dir={run_dir}"]
    return [sys.executable, "-m", "megacli", "pretrain", *[x for s in every for x in ("--set", s)]]


def start(run_dir: Path, *sets: str) -> subprocess.Popen:
    return subprocess.Popen(command(run_dir, *sets), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_until(proc: subprocess.Popen, reached, missed: str, timeout: float = 300) -> None:
    """Until ``reached()`` while the run goes on; the run's output if it ends first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the run ended early: {proc.communicate()}")
        if reached():
            return
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(missed)


def wait_for_steps(proc: subprocess.Popen, run_dir: Path, steps: int, timeout: float = 300) -> None:
    metrics = run_dir / "metrics.jsonl"
    wait_until(proc, lambda: metrics.is_file() and len(metrics.read_text().splitlines()) >= steps,
               "no training steps logged", timeout)


def workers_of(launcher: subprocess.Popen) -> list[psutil.Process]:
    return [p for p in psutil.Process(launcher.pid).children(recursive=True) if "megacli.worker" in " ".join(p.cmdline())]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_signal_saves_at_the_next_step_and_exits_0(tmp_path, sig):
    """SIGTERM as systemd, Kubernetes and Slurm send it, to every process of the job at once: the
    worker gets it twice (once passed on by the launcher), and that is one stop request. SIGUSR1 to
    the launcher alone, which passes it on."""
    ck = tmp_path / "ck"
    proc = start(tmp_path / "run", *FOREVER, f"checkpoint.dir={ck}")
    wait_for_steps(proc, tmp_path / "run", 2)
    if sig == signal.SIGTERM:
        (worker,) = workers_of(proc)
        worker.send_signal(sig)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    assert "Traceback" not in out + err and "SignalException" not in out + err, err
    saved = (ck / "latest").read_text().strip()
    assert f"stopped on {sig.name} at iteration {int(saved.split('_')[1])}: saved checkpoint" in " ".join(out.split())


@pytest.mark.slow
def test_time_limit_saves_and_exits_0(tmp_path):
    ck = tmp_path / "ck"
    out = subprocess.run(command(tmp_path / "run", *FOREVER, f"checkpoint.dir={ck}", "train.time_limit_minutes=0.0001"),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (ck / "latest").read_text().strip() == "iter_0000001"
    assert "stopped on the time limit (train.time_limit_minutes = 0.0001) at iteration 1" in " ".join(out.stdout.split())


@pytest.mark.slow
def test_a_second_job_on_the_same_run_dir_is_refused_and_workers_die_with_a_killed_launcher(tmp_path):
    """One running job: a second job on its run directory is refused; the launcher is killed and its
    workers die with it; the killed launcher's lock is stale and the next job takes it over."""
    proc = start(tmp_path / "run", *FOREVER)
    workers = []
    try:
        wait_for_steps(proc, tmp_path / "run", 1)
        workers = workers_of(proc)
        assert workers
        out = subprocess.run(command(tmp_path / "run"), capture_output=True, text=True, timeout=300)
        assert out.returncode == 2 and "Traceback" not in out.stderr
        assert f"{(tmp_path / 'run').resolve()} is in use by job" in " ".join(out.stderr.split())
        assert f"pid {proc.pid}" in out.stderr
    finally:
        proc.stdout.close()  # the workers hold the pipes too
        proc.stderr.close()
        proc.kill()
        proc.wait()
        _, alive = psutil.wait_procs(workers, timeout=10)
        for p in alive:
            p.kill()
    assert not alive, "workers outlived their launcher"
    # The launcher was killed: its lock is stale and the next job takes it over.
    out = subprocess.run(command(tmp_path / "run", "train.iters=2"), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "taking over its lock" in out.stderr
    assert not (tmp_path / "run" / "megacli.lock").exists()


def test_copies_of_a_stop_signal_are_one_request_and_a_later_one_stops_at_once():
    """The signal a worker got from the scheduler and the launcher's copy of it, in either order and
    of either kind, are one request (a second signal used to stop the worker before it could save);
    a signal after REPEAT_WINDOW_S (shortened here) stops the process at once."""
    code = ("import os, signal, time\n"
            "from megacli.engine import stop\n"
            "stop.REPEAT_WINDOW_S = 1.0\n"
            "requests = stop.StopRequests(save_on_signal=True, time_limit_minutes=None, device='cpu', max_wait_s=600,\n"
            "                             give_up=lambda *args: print('gave up', flush=True))\n"
            "for sig in (signal.SIGTERM, signal.SIGTERM, signal.SIGUSR1):\n"
            "    os.kill(os.getpid(), sig)\n"
            "print('one request:', requests.received.name, flush=True)\n"
            "time.sleep(1.5)\n"
            "os.kill(os.getpid(), signal.SIGTERM)\n"
            "time.sleep(5)\n"
            "print('still running', flush=True)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout == "one request: SIGTERM\n", out.stdout + out.stderr
    assert out.returncode == -signal.SIGTERM


def test_every_run_that_saves_gets_the_shielded_writer_queue():
    """With or without stop-signal handling (checkpoint.save_on_signal; a run driven from another
    thread has none), a run that saves gets the checkpoint writer's queue whose server holds
    pickled bytes and has the stop signals blocked."""
    code = ("import threading\n"
            "from megatron.core.dist_checkpointing.strategies import filesystem_async\n"
            "from megacli.engine import stop\n"
            "kinds = []\n"
            "def run(save_on_signal):\n"
            "    filesystem_async._results_queue = None\n"
            "    requests = stop.StopRequests(save_on_signal=save_on_signal, time_limit_minutes=None, device='cpu',\n"
            "                                 max_wait_s=600, saves=True)\n"
            "    kinds.append(type(filesystem_async._results_queue).__name__)\n"
            "    requests.close()\n"
            "run(False)\n"
            "thread = threading.Thread(target=run, args=(True,))\n"
            "thread.start(); thread.join()\n"
            "print(kinds)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "['PickledItems', 'PickledItems']", out.stdout + out.stderr[-3000:]


def test_no_step_boundary_within_the_wait_gives_up(monkeypatch):
    from megacli.engine import stop

    monkeypatch.setattr(stop, "MIN_BOUNDARY_WAIT_S", 0.3)
    given_up = []
    requests = stop.StopRequests(save_on_signal=True, time_limit_minutes=None, device="cpu", max_wait_s=600,
                                 give_up=lambda sig, waited: given_up.append((sig, waited)))
    try:
        assert requests.boundary_wait_s() == 0.3
        requests.slowest_interval = 1.0  # three of the slowest intervals between two step boundaries
        assert requests.boundary_wait_s() == 3.0
        requests.max_wait_s = 0.5  # at most half of launch.timeout_minutes
        assert requests.boundary_wait_s() == 0.5
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 30
        while not given_up and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        requests.close()
    assert given_up == [(signal.SIGTERM, 0.5)]


def hang_from_call(losses, *, labels, loss_mask, call, hung):
    """A train.loss that never returns from its ``call``-th call on: a run that cannot reach a step
    boundary. The file ``hung`` is made when it starts hanging."""
    hang_from_call.calls = getattr(hang_from_call, "calls", 0) + 1
    if hang_from_call.calls >= call:
        Path(hung).touch()
    while hang_from_call.calls >= call:
        time.sleep(1)
    return losses


@pytest.mark.slow
def test_a_run_stuck_before_a_step_boundary_ends_after_a_signal_saying_nothing_was_saved(tmp_path):
    """Stuck in step 3 (4 micro-batches a step), on a SIGTERM: it ends within half of
    launch.timeout_minutes, saying why nothing was saved (it used to run on until the launcher's
    SIGKILL, 10 minutes by default; for ever without a launcher)."""
    run_dir, hung = tmp_path / "run", tmp_path / "hung"
    sets = [*FOREVER, f"checkpoint.dir={tmp_path / 'ck'}", "checkpoint.save_interval=0", "launch.timeout_minutes=0.2",
            "train.loss=tests.test_run_control:hang_from_call", f"train.loss_kwargs={{call: 9, hung: '{hung}'}}"]
    proc = subprocess.Popen(command(run_dir, *sets), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, MEGACLI_IN_PROCESS="1"))
    try:
        # Signalled once stuck: step 2's metrics line comes before its step boundary's stop check.
        wait_until(proc, hung.exists, "the run never reached its stuck call")
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    took = time.monotonic() - sent
    assert proc.returncode == 128 + signal.SIGTERM and "Traceback" not in err, err[-3000:]
    assert "stopped on SIGTERM: no step boundary was reached within 6 s of the signal" in err and \
        "nothing could be saved" in err, err[-3000:]
    assert 5 < took < 30, took
    assert not (tmp_path / "ck" / "latest").exists()


def test_one_job_id_for_every_node():
    from megacli.launch import job_id

    by_hand = [job_id(given=None, rdzv_endpoint="node0:29400", env={}) for _ in range(2)]
    assert by_hand[0] == by_hand[1] != job_id(given=None, rdzv_endpoint="node0:29401", env={})
    assert job_id(given=None, rdzv_endpoint="node0:29400", env={"SLURM_JOB_ID": "77"}) == "77"
    assert job_id(given="mine", rdzv_endpoint="node0:29400", env={"SLURM_JOB_ID": "77"}) == "mine"


@pytest.mark.slow
def test_two_nodes_started_by_hand_meet(tmp_path):
    from megacli.launch import free_port

    endpoint = f"127.0.0.1:{free_port()}"
    sets = ["launch.nnodes=2", f"launch.rdzv_endpoint={endpoint}", "parallel.tensor=2", "launch.nproc=1", "train.iters=2"]
    nodes = [start(tmp_path / "run", *sets, f"launch.node_rank={rank}") for rank in (1, 0)]
    outs = [node.communicate(timeout=300) for node in nodes]
    for node, (out, err) in zip(nodes, outs):
        assert node.returncode == 0, out[-2000:] + err[-2000:]
    records = [line for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2 and "TP 2 × PP 1 × CP 1 × DP 1 on 2 cpu processes" in outs[1][0] + outs[0][0]


def test_rendezvous_timeout_names_the_nodes_that_arrived(tmp_path):
    from megacli.launch import free_port

    out = subprocess.run(command(tmp_path / "run", "launch.nnodes=2", f"launch.rdzv_endpoint=127.0.0.1:{free_port()}",
                                 "launch.timeout_minutes=0.05"), capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "1 of launch.nnodes = 2 nodes arrived within 0.05 min" in " ".join(out.stderr.split())


def test_launch_timeout_is_the_process_group_timeout(monkeypatch):
    import torch.distributed as dist

    from megacli.engine import distributed
    from megacli.recipe.sections import LaunchSection, ParallelSection

    seen = {}

    def fake_init(backend, **kwargs):
        seen.update(kwargs)
        raise RuntimeError("stop here")

    monkeypatch.setattr(dist, "init_process_group", fake_init)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(RuntimeError, match="stop here"):
        distributed.setup(parallel=ParallelSection(), launch=LaunchSection(device="cpu", timeout_minutes=2.5), seed=1)
    assert seen["timeout"].total_seconds() == 150


@pytest.mark.slow
def test_a_stalled_rank_is_named_with_the_collective(tmp_path):
    """Rank 1 is stopped (SIGSTOP): rank 0 gives up after launch.timeout_minutes, naming the collective.
    Once rank 0 has ended, rank 1 is let go on (the launcher would otherwise wait 30 s to kill it)."""
    proc = start(tmp_path / "run", *FOREVER, "parallel.tensor=2", "launch.nproc=2", "launch.timeout_minutes=0.2")
    wait_for_steps(proc, tmp_path / "run", 1)
    ranks = {p.environ().get("RANK"): p for p in workers_of(proc)}
    stalled = ranks["1"]
    stalled.suspend()
    try:
        psutil.wait_procs([ranks["0"]], timeout=120)
        stalled.resume()
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        if stalled.is_running():
            stalled.kill()
    text = " ".join(err.split())
    assert proc.returncode == 1 and "Traceback" not in err, err[-3000:]
    assert "rank 0 waited 0.2 min (launch.timeout_minutes) in" in text and "stopped answering" in text, text


@pytest.mark.slow
def test_ctrl_c_stops_at_once_without_a_traceback(tmp_path):
    proc = start(tmp_path / "run", *FOREVER)
    wait_for_steps(proc, tmp_path / "run", 1)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 130 and "Traceback" not in out + err, err[-3000:]
    assert "stopped on SIGINT" in err


def test_a_workers_forked_helpers_die_with_it():
    """Megatron's checkpoint writers are forked from the worker: they must not outlive it."""
    code = ("import multiprocessing, time\n"
            "from megacli.lifetime import worker_dies_with_launcher\n"
            "worker_dies_with_launcher()\n"
            "helper = multiprocessing.get_context('fork').Process(target=time.sleep, args=(600,))\n"
            "helper.start()\n"
            "print(helper.pid, flush=True)\n"
            "time.sleep(600)\n")
    worker = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    helper = psutil.Process(int(worker.stdout.readline()))
    worker.stdout.close()  # the helper holds the pipe too
    worker.kill()
    worker.wait()
    _, alive = psutil.wait_procs([helper], timeout=10)
    for p in alive:
        p.kill()
    assert not alive, "a helper outlived its worker"


def test_exit_now_joins_threads_runs_exit_handlers_and_keeps_the_code_and_output():
    code = ("import atexit, sys, threading, time\n"
            "from megacli.lifetime import exit_now\n"
            "atexit.register(lambda: print('handler', end=''))\n"
            "threading.Thread(target=lambda: (time.sleep(0.3), print('thread ', end=''))).start()\n"
            "sys.stdout.write('out '); sys.stderr.write('err')\n"
            "exit_now(3)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout, out.stderr) == (3, "out thread handler", "err")


def test_a_timed_out_asynchronous_collective_is_named_where_it_was_waited_on():
    """A TP all-reduce started in backward times out in `handle.wait()`, with no torch.distributed frame
    in the traceback (seen under load in test_a_stalled_rank_is_named_with_the_collective)."""
    from megacli.engine.distributed import stall_error

    def backward():  # stands in for Megatron's LinearWithGradAccumulation backward
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
                           "12000ms for recv operation to complete")

    try:
        backward()
    except RuntimeError as exc:
        err = stall_error(exc, rank=0, timeout_minutes=0.2)
    assert err is not None and err.exit_code == 1
    assert str(err).startswith("rank 0 waited 0.2 min (launch.timeout_minutes) in an asynchronous collective called "
                               "from backward (test_run_control.py:"), str(err)
    try:
        raise RuntimeError("connection timeout")  # not a collective's
    except RuntimeError as exc:
        assert stall_error(exc, rank=0, timeout_minutes=0.2) is None


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_an_unwritable_directory_is_named_and_nothing_is_left_behind(tmp_path, monkeypatch, code):
    """A full filesystem creates the lock's draft and fails to write it (a 0-byte file was left); a
    read-only one fails to create it. Simulated in-process (a real read-only or full tmpfs needs root)."""
    from megacli import rundir
    from megacli.errors import UserError

    real_write = Path.write_text

    def write_text(self, *args, **kwargs):
        if self.parent.name == "ck":
            if code == errno.ENOSPC:
                self.touch()
            raise OSError(code, os.strerror(code))
        return real_write(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", write_text)
    (tmp_path / "run").mkdir()
    with pytest.raises(UserError) as err:
        with rundir.locked({"run.dir": str(tmp_path / "run"), "checkpoint.dir": str(tmp_path / "ck")}, job_id="j"):
            raise AssertionError("the block ran without the lock")
    assert str(err.value).startswith(f"checkpoint.dir {(tmp_path / 'ck').resolve()}: cannot write there ({os.strerror(code)})")
    assert list(tmp_path.rglob("*")) == [tmp_path / "run"], "the run.dir lock or a draft was left behind"


def test_the_launcher_pid_is_the_workers_alone(tmp_path, monkeypatch):
    """launch_workers tells its workers the launcher's pid through the environment, and takes it back
    afterwards: a later job run from the same process (a test's, a notebook's) is no launcher's
    worker, so a stuck run there says why it stopped instead of leaving it to a launcher that is gone."""
    import torch.distributed.launcher.api as launcher_api

    from megacli import launch
    from megacli.lifetime import LAUNCHER_PID_VAR

    seen = []
    monkeypatch.delenv(LAUNCHER_PID_VAR, raising=False)
    monkeypatch.setattr(launcher_api, "elastic_launch",
                        lambda config, entry: lambda *args: seen.append(os.environ.get(LAUNCHER_PID_VAR)))
    launch.launch_workers("pretrain", tmp_path / "recipe.yaml", run_dir=str(tmp_path), nproc=1, nnodes=1, node_rank=0,
                          rdzv_endpoint=None, job_id="j", timeout_minutes=1)
    assert seen == [str(os.getpid())]
    assert LAUNCHER_PID_VAR not in os.environ
