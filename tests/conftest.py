"""What several test files share: the tiny recipes, the runners of `megacli` commands (a fresh
interpreter; a process forked from a warm interpreter per pytest worker, where a one-worker run's
worker runs in the CLI's own process; this process), warm_call (which tests/_dist.py's ranks fork
from too), reading a run's metrics back, the loss comparison, and the hypothesis profile. Hugging
Face model builders: tests/_convert_models.py; N-process gloo runs below the CLI: tests/_dist.py;
CUDA runs: tests/_gpu.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SLURM_CLUSTER_SCRIPT = ROOT / ".ci" / "slurm_cluster.sh"

# OpenMP threads wait for work asleep, not spinning: the suite runs two pytest workers (and the
# processes they start) on two cores, where a spinning thread takes the core another process needs.
# It changes no result (the thread count stays the engine's).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# A tiny GPT on mock data with the byte tokenizer, fp32, 6 logged steps, no checkpoints: the
# recipe the pretraining tests vary (same padded vocabulary, 512, at TP 1 and 2).
MOCK_GPT = [
    "data.path=null", "data.mock=true", "tokenizer.type=byte", "tokenizer.path=null",
    "model.num_layers=4", "model.hidden_size=64", "model.num_attention_heads=4", "model.ffn_hidden_size=128",
    "model.seq_length=32", "model.make_vocab_size_divisible_by=256",
    "train.iters=6", "train.micro_batch_size=2", "train.global_batch_size=8", "train.log_interval=1",
    "train.eval_interval=null", "optim.warmup_iters=1", "optim.lr=1e-2", "train.precision=fp32",
    "checkpoint.dir=null",
]

# A tiny Llama-shaped GPT (RoPE, RMSNorm, SwiGLU, GQA, untied, no biases) on mock data, fp32: the
# model the Megatron-LM interop tests write and read.
MOCK_LLAMA = [
    "data.path=null", "data.mock=true", "tokenizer.type=byte", "tokenizer.path=null",
    "model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=4", "model.num_query_groups=2",
    "model.ffn_hidden_size=64", "model.seq_length=16", "model.activation=swiglu", "model.normalization=rmsnorm",
    "model.position_embedding=rope", "model.untie_embeddings=true", "model.add_bias_linear=false",
    "model.make_vocab_size_divisible_by=64", "train.eval_interval=null", "train.precision=fp32",
]


def layout(tp=1, pp=1, dp=1, cp=1, vp=None, sp=False, dist_opt=False) -> list[str]:
    """The overrides of a parallel layout: TP x PP x CP x DP workers."""
    return [f"parallel.tensor={tp}", f"parallel.pipeline={pp}", f"parallel.context={cp}",
            f"parallel.sequence_parallel={str(sp).lower()}", f"parallel.distributed_optimizer={str(dist_opt).lower()}",
            f"parallel.virtual_pipeline={vp or 'null'}", f"launch.nproc={tp * pp * cp * dp}"]


def sets_args(sets: list[str]) -> list[str]:
    """``--set`` before each override."""
    return [x for s in sets for x in ("--set", s)]


def one_worker(sets: list[str]) -> bool:
    """The overrides say the run has one worker (the last launch.nproc is 1)."""
    nproc = [s for s in sets if s.startswith("launch.nproc=")]
    return nproc[-1:] == ["launch.nproc=1"]


# Training commands run with train.plot=false unless their arguments set it: a plot.png redraw
# costs about a CPU-second (at every checkpoint and at the end), and test_track checks the picture.
PLOTTING_COMMANDS = ("pretrain", "finetune", "submit")


def without_plot(args) -> list[str]:
    """``args`` with ``--set train.plot=false`` added to a training command that does not set it."""
    args = [str(a) for a in args]
    if args[:1] and args[0] in PLOTTING_COMMANDS and not any(a.startswith("train.plot=") for a in args):
        args = [args[0], "--set", "train.plot=false", *args[1:]]  # before any `--` and what follows it
    return args


def megacli(*args, env: dict | None = None, in_process: bool = False, timeout: float = 900,
            cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`megacli ARGS` in a fresh interpreter: the finished process. ``env`` adds to (a None value:
    removes from) this process's environment; ``in_process``: a one-worker job's worker runs in
    that interpreter (the CLI's in-process path) instead of one the launcher starts."""
    full = {**os.environ, "COLUMNS": "400"}  # long tmp paths must not wrap a message
    if in_process:
        full["MEGACLI_IN_PROCESS"] = "1"
    for k, v in (env or {}).items():
        if v is None:
            full.pop(k, None)
        else:
            full[k] = v
    return subprocess.run([sys.executable, "-m", "megacli", *without_plot(args)], capture_output=True, text=True,
                          timeout=timeout, env=full, cwd=cwd)


def ok(out: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """Fails the test with the process's output unless it exited 0."""
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def pretrain(run_dir: Path, sets: list[str], *, recipe: Path | None = None, command: str = "pretrain",
             env: dict | None = None, check: bool = True, timeout: float = 900,
             fresh: bool = False) -> subprocess.CompletedProcess:
    """`megacli COMMAND [RECIPE] --set SETS... --set run.dir=RUN_DIR` from the warm interpreter
    (megacli_here): a one-worker run's worker in the CLI's process, any other's workers started by
    the launcher. ``fresh``: in a fresh interpreter instead (what only an exiting process shows,
    such as errors printed at its exit). ``check``: fail the test unless it exits 0."""
    args = [command, *([recipe] if recipe else []), *sets_args([*sets, f"run.dir={run_dir}"])]
    if fresh:
        out = megacli(*args, env=env, in_process=one_worker(sets), timeout=timeout)
    else:
        out = megacli_here(*args, env=env, timeout=timeout, workers=not one_worker(sets))
    return ok(out) if check else out


def records(run_dir: Path) -> list[dict]:
    """metrics.jsonl's records, in order."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def steps(run_dir: Path) -> dict[int, dict]:
    """The per-step records (evaluations left out), by iteration."""
    return {r["iteration"]: r for r in records(run_dir) if "loss" in r}


def losses(run_dir: Path) -> dict[int, float]:
    """The loss of each logged step, by iteration."""
    return {i: r["loss"] for i, r in steps(run_dir).items()}


def assert_close(got: dict, want: dict, iterations, rel: float, key: str = "loss") -> None:
    """|got - want| <= rel * |want| at each iteration, of losses by iteration or of records' ``key``."""
    for i in iterations:
        a, b = (got[i][key], want[i][key]) if isinstance(got[i], dict) else (got[i], want[i])
        assert abs(a - b) <= rel * abs(b), f"step {i} {key}: {a} vs {b}"


def pretrain_losses(args: list[str], run_dir: Path, *, in_process: bool) -> tuple[subprocess.CompletedProcess, dict[int, float]]:
    """`megacli pretrain ARGS --set run.dir=RUN_DIR` from the warm interpreter (megacli_here): with
    ``in_process`` (a one-worker run) its worker in the CLI's process, else workers the launcher
    starts; the finished process and the loss of each logged step."""
    args = [*args, "--set", f"run.dir={run_dir}"]
    out = megacli_here("pretrain", *args, workers=not in_process)
    return out, (losses(run_dir) if out.returncode == 0 else {})


# What the warm interpreter imports before it forks (after Megatron-Core, imported as a CPU run
# imports it): what most commands import, paid once.
WARM_IMPORTS = ["megacli.cli", "megacli.worker", "megacli.launch", "torch.distributed.launcher.api",
                "megacli.engine.loop", "megacli.engine.data", "megacli.engine.optim", "megacli.engine.models.gpt",
                "megacli.engine.models.bert", "megacli.engine.models.t5",
                "megatron.core.optimizer", "megatron.core.pipeline_parallel.schedules",
                "megatron.core.datasets.blended_megatron_dataset_builder", "megatron.core.datasets.gpt_dataset",
                "megatron.core.dist_checkpointing.strategies.torch", "torch._dynamo", "transformers"]


def _serve_calls(conn) -> None:
    """The warm interpreter's loop (see warm_call): imports WARM_IMPORTS, then runs each request
    (function, args) in a process forked for it (no state of one call reaches the next), answered
    with ("ok", what it returned), ("error", the traceback of what it raised), or ("died", its exit
    status) when it ended without an answer."""
    import importlib
    import multiprocessing
    import traceback

    os.setsid()  # its own process group: _stop_warm ends it with the call it runs
    import torch

    from megacli.backend import cpu

    cpu.import_megatron(torch)
    for name in WARM_IMPORTS:
        importlib.import_module(name)
    while True:
        try:
            function, args = conn.recv()
        except EOFError:  # the pytest worker has gone
            return
        reader, writer = multiprocessing.Pipe(duplex=False)
        pid = os.fork()
        if pid == 0:
            reader.close()
            try:
                try:
                    reply = ("ok", function(*args))
                except BaseException:
                    reply = ("error", traceback.format_exc())
                writer.send(reply)
            finally:
                os._exit(0)  # none of the warm interpreter's exit handlers
        writer.close()
        try:
            reply = reader.recv()
        except EOFError:  # it exited inside the call (os._exit) or crashed
            reply = None
        status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        reader.close()
        conn.send(reply or ("died", status))


def _run_command(args, environ, cwd) -> tuple[int, str, str]:
    """`megacli ARGS` through its CLI in environment ``environ`` and directory ``cwd``: (exit code,
    stdout, stderr with the traceback of an uncaught exception). The processes it starts (a
    multi-worker job's workers) write to this process's file descriptors 1 and 2: what they write
    follows the CLI's own output."""
    import tempfile
    import traceback

    env = {**{k: None for k in os.environ if k not in environ}, **environ}
    os.chdir(cwd)
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        result = cli(*args, env=env)
        stderr = result.stderr
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            stderr += "".join(traceback.format_exception(*result.exc_info))
        sys.stdout.flush()
        sys.stderr.flush()
        out.seek(0)
        err.seek(0)
        return result.exit_code, result.stdout + out.read(), stderr + err.read()


_warm = None  # this pytest worker's warm interpreter: (process, connection)


def _stop_warm() -> None:
    """Ends the warm interpreter and the command it may be running (its process group)."""
    import signal

    global _warm
    if _warm is not None:
        proc, conn = _warm
        _warm = None
        conn.close()  # its loop ends when idle
        proc.join(10)
        if proc.is_alive():
            os.killpg(proc.pid, signal.SIGKILL)
            proc.join(30)


def warm_call(function, *args, timeout: float = 900):
    """``function(*args)`` in a process forked from a warm interpreter: one process per pytest
    worker, started on first use, that imports torch, Megatron-Core (as a CPU run imports it) and
    megacli once. ``function`` is pickled by name (a module-level function). Returns ("ok", what it
    returned), ("error", the traceback of what it raised) or ("died", exit status) when its process
    ended without an answer. The pytest process itself stays free of the calls' threads and of the
    CPU backend's patches of torch."""
    global _warm
    import atexit
    import multiprocessing

    if _warm is None or not _warm[0].is_alive():
        ctx = multiprocessing.get_context("spawn")
        conn, child = ctx.Pipe()
        proc = ctx.Process(target=_serve_calls, args=(child,), name="megacli-warm")
        proc.start()
        child.close()
        if _warm is None:
            atexit.register(_stop_warm)
        _warm = (proc, conn)
    proc, conn = _warm
    conn.send((function, args))
    if not conn.poll(timeout):
        _stop_warm()
        raise TimeoutError(f"{function.__name__} did not answer within {timeout} s")
    try:
        return conn.recv()
    except EOFError:  # the warm interpreter died: the next call starts another
        proc.join(30)
        _warm = None
        return "died", proc.exitcode


def megacli_here(*args, env: dict | None = None, timeout: float = 900,
                 cwd: Path | None = None, workers: bool = False) -> subprocess.CompletedProcess:
    """`megacli ARGS` as megacli runs it (this process's environment, ``env`` added; in ``cwd``, by
    default this process's directory), in a process forked from the warm interpreter (warm_call):
    a one-worker job's worker runs in the CLI's process (MEGACLI_IN_PROCESS). ``workers``: the
    job's workers are processes the launcher starts (a multi-worker job), as from a fresh
    interpreter; the launcher itself is the warm fork."""
    environ = {**os.environ, "COLUMNS": "400"}
    if not workers:
        environ["MEGACLI_IN_PROCESS"] = "1"
    for k, v in (env or {}).items():
        if v is None:
            environ.pop(k, None)
        else:
            environ[k] = v
    command = ["megacli", *without_plot(args)]
    try:
        status, answer = warm_call(_run_command, command[1:], environ, str(cwd or os.getcwd()), timeout=timeout)
    except TimeoutError:
        raise subprocess.TimeoutExpired(command, timeout) from None
    if status == "died":
        return subprocess.CompletedProcess(command, answer, "", f"the command's process ended without an answer (exit {answer})")
    if status == "error":  # as a process would: exit 1, the traceback on stderr
        return subprocess.CompletedProcess(command, 1, "", answer)
    return subprocess.CompletedProcess(command, *answer)


def cli(*args, env: dict | None = None):
    """`megacli ARGS` in this process, through its CLI (typer's CliRunner result)."""
    from typer.testing import CliRunner

    from megacli.cli import _register, app

    _register()
    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "200", **(env or {})})


# The files that take longest on 2 cores (their durations summed), longest first. `-n 2 --dist loadfile`
# hands whole files to the two workers in collection order, these first: a long file started last
# would leave one worker running it alone at the end.
LONGEST_FILES = [
    "test_slurm.py", "test_run_control.py", "test_bert_t5.py", "test_docs.py", "test_megatron_lm_resume.py", "test_serve.py",
    "test_reshard.py", "test_eval.py", "test_pretrain.py", "test_gpu_bench.py", "test_preference_training.py",
    "test_stream_data.py", "test_planner.py", "test_fp8.py", "test_serve_bench.py", "test_checkpoint_carries.py",
]


def pytest_configure(config):
    if getattr(config.option, "dist", "no") == "loadfile":
        config.option.loadscopereorder = False  # xdist's default: files with the most tests first


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest in collection order


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A two-node Slurm cluster on this host (.ci/slurm_cluster.sh: nodes n1 and n2), started once
    for the tests that ask for it and stopped after them; SLURM_CONF names its configuration
    meanwhile. Yields its directory (pids/, log/). Skipped, with the reason, where it cannot start
    (not root, no apt-get, no network for the packages)."""
    directory = tmp_path_factory.mktemp("slurm")
    started = subprocess.run(["bash", str(SLURM_CLUSTER_SCRIPT), "start", str(directory)], capture_output=True, text=True,
                             timeout=600)
    if started.returncode != 0:
        pytest.skip(f"no Slurm cluster here: {(started.stderr.strip() or started.stdout.strip())[-500:]}")
    previous = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(directory / "slurm.conf")
    try:
        yield directory
    finally:
        subprocess.run(["bash", str(SLURM_CLUSTER_SCRIPT), "stop", str(directory)], capture_output=True, timeout=300)
        if previous is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = previous


try:
    from hypothesis import HealthCheck, settings
except ImportError:  # the [test] extra brings it; without it the property tests are skipped
    pass
else:
    # Deterministic property tests: the same examples on every run, nothing stored between runs.
    settings.register_profile("megacli", derandomize=True, database=None, deadline=None, max_examples=60,
                              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    settings.load_profile("megacli")


def certain_lm():
    """The harness's model interface answering every request alike."""
    from lm_eval.api.model import LM

    class Certain(LM):
        def loglikelihood(self, requests):
            return [(-1.0, True) for _ in requests]

        def loglikelihood_rolling(self, requests):
            return [-1.0 for _ in requests]

        def generate_until(self, requests):
            return ["" for _ in requests]

    return Certain()
