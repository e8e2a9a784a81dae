"""`megacli submit` and training under Slurm: the sbatch script, the checks against the cluster, and
(marked slurm) jobs on a real two-node cluster on this host: a run to its end, the warning before the
time limit (save, requeue, resume with the same losses), scancel, and a node that stops answering.
Jobs that fit on the nodes together (4 CPUs each) run at the same time."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests import conftest
from tests.conftest import MOCK_GPT, ROOT

# Two nodes × two tasks; a step lasts at least STEP_S (slow_loss), so a signal sent after a logged
# step finds the run still training.
STEP_S = 0.2
LAYOUT = ["parallel.tensor=1", "parallel.pipeline=1", "launch.nnodes=2", "launch.nproc=2"]
SLOW = [*MOCK_GPT, "model.num_layers=2", "train.loss=tests.test_slurm:slow_loss", f"train.loss_kwargs={{seconds: {STEP_S}}}"]
ITERS = 12


def slow_loss(losses, *, labels, loss_mask, seconds):
    """Each token's loss as it is, after a pause: steps long enough to signal the job between two."""
    time.sleep(seconds)
    return losses


def megacli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`megacli ARGS` in conftest's warm interpreter, with this checkout on the path of the jobs'
    workers too (sbatch passes its environment on to the job), which start as a fresh submit's would."""
    return conftest.megacli_here(*args, env={"PYTHONPATH": str(ROOT), "MEGACLI_IN_PROCESS": None, **(env or {})},
                                 timeout=300)


def submit_args(run_dir: Path, *sets: str) -> list[str]:
    every = [*SLOW, *LAYOUT, f"train.iters={ITERS}", *sets, f"run.dir={run_dir}"]
    return ["submit", str(ROOT / "recipes" / "gpt_tiny.yaml"), "--job", "pretrain", *[x for s in every for x in ("--set", s)]]


# ---- the script and the checks, without a cluster ----

def test_dry_run_prints_the_script_and_writes_nothing(tmp_path):
    run = tmp_path / "run"
    out = megacli(*submit_args(run, "launch.slurm.partition=gpu", "launch.slurm.account=proj", "launch.slurm.time_limit_minutes=90",
                               "launch.slurm.signal_seconds=300", "launch.device=cuda"), "--dry-run", "--", "--qos=high")
    assert out.returncode == 0, out.stderr
    script = out.stdout
    assert script.startswith("#!/bin/bash\n")
    options = re.findall(r"^#SBATCH (\S+)$", script, re.MULTILINE)
    assert options == ["--job-name=run", "--nodes=2", "--ntasks-per-node=2", "--gpus-per-node=2", "--time=90",
                       "--partition=gpu", "--account=proj", "--signal=B:USR1@300", "--requeue", "--open-mode=append",
                       f"--output={run.absolute()}/slurm/%j.out", f"--error={run.absolute()}/slurm/%j.err",
                       f"--chdir={Path.cwd()}", "--qos=high"]
    assert f"srun --kill-on-bad-exit=1 {sys.executable} -m megacli pretrain {run.absolute()}/slurm/recipe.yaml &" in script
    assert "scontrol requeue" in script
    assert not run.exists()
    cpu = megacli(*submit_args(run, "launch.slurm.requeue=false", "launch.slurm.signal_seconds=0"), "--dry-run")
    assert "#SBATCH --no-requeue" in cpu.stdout and "#SBATCH --signal" not in cpu.stdout and "--gpus-per-node" not in cpu.stdout
    assert "scontrol requeue" not in cpu.stdout


def fake_slurm(tmp_path: Path, sinfo_lines: str) -> dict:
    """A PATH whose sinfo prints ``sinfo_lines`` (partition|nodes|gres) and whose sbatch only answers --version."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sinfo").write_text(f"#!/bin/sh\nprintf '{sinfo_lines}'\n")
    (bin_dir / "sbatch").write_text("#!/bin/sh\n[ \"$1\" = --version ] && echo 'slurm 22.05.8' && exit 0\nexit 1\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    return {"PATH": f"{bin_dir}:/usr/bin:/bin"}


@pytest.mark.parametrize("sets, sinfo, message", [
    (["launch.slurm.partition=big"], "debug*|2|(null)\\n",
     "launch.slurm.partition = 'big': no such partition on this cluster (sinfo lists debug)"),
    (["launch.slurm.partition=gpu", "launch.nproc=4", "train.global_batch_size=16"], "debug*|2|(null)\\ngpu|4|gpu:a100:2(S:0-1)\\n",
     "launch.nproc = 4: one GPU per process, but the nodes of partition 'gpu' have 2 GPUs"),
    (["launch.device=cuda"], "debug*|2|(null)\\n", "launch.nproc = 2: one GPU per process, but the nodes of partition 'debug' have no GPUs"),
    (["launch.nnodes=3", "train.global_batch_size=12"], "debug*|2|(null)\\n", "launch.nnodes = 3: partition 'debug' has 2 nodes"),
], ids=["unknown-partition", "too-few-gpus", "no-gpus", "too-few-nodes"])
def test_what_the_cluster_cannot_run_is_refused_before_anything_is_written(tmp_path, sets, sinfo, message):
    out = megacli(*submit_args(tmp_path / "run", *sets), env=fake_slurm(tmp_path, sinfo))
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert message in " ".join(out.stderr.split())
    assert not (tmp_path / "run").exists()


def test_without_sbatch_submit_says_so(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    out = megacli(*submit_args(tmp_path / "run"), env={"PATH": str(empty)})
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "`sbatch` is not on PATH" in " ".join(out.stderr.split())


def test_a_requeued_job_gets_another_port_and_says_its_restart_count():
    from megacli.engine.metrics import scheduler_fields
    from megacli.launch import slurm_to_torch_env

    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_ID": "7"}
    first = slurm_to_torch_env(env)["MASTER_PORT"]
    assert first == "20007" and slurm_to_torch_env({**env, "SLURM_RESTART_COUNT": "1"})["MASTER_PORT"] != first
    assert scheduler_fields(env) == {"slurm_restart_count": 0}
    assert scheduler_fields({**env, "SLURM_RESTART_COUNT": "2"}) == {"slurm_restart_count": 2}
    assert scheduler_fields({}) == {}


# ---- jobs on the two-node cluster ----

def submitted_job(out: subprocess.CompletedProcess) -> str:
    assert out.returncode == 0, out.stdout + out.stderr
    return re.search(r"submitted job (\d+)", out.stdout).group(1)


def job_fields(job: str) -> dict[str, str]:
    """The job's fields as scontrol shows them; asked again when scontrol fails (a busy slurmctld
    can drop its connection)."""
    for attempt in range(5):
        shown = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True)
        if shown.returncode == 0:
            return dict(re.findall(r"(\w+)=(\S*)", shown.stdout))
        time.sleep(1)
    raise AssertionError(f"scontrol show job {job} failed ({shown.returncode}): {shown.stderr}")


def wait_for_job(job: str, states: set[str], timeout: float = 240) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        fields = job_fields(job)
        if fields["JobState"] in states:
            return fields
        time.sleep(0.5)
    raise AssertionError(f"job {job} not {states} within {timeout} s: {job_fields(job)}")


def records(run_dir: Path) -> list[dict]:
    """conftest's records, none before the run has written its metrics."""
    return conftest.records(run_dir) if (run_dir / "metrics.jsonl").is_file() else []


def wait_for_iteration(job: str, run_dir: Path, iteration: int, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(r.get("iteration", 0) >= iteration for r in records(run_dir)):
            return
        assert job_fields(job)["JobState"] in ("PENDING", "RUNNING"), (run_dir / "slurm" / f"{job}.out").read_text()
        time.sleep(0.2)
    raise AssertionError(f"job {job} did not log iteration {iteration} within {timeout} s")


def wait_for_checkpoint(job: str, ck: Path, timeout: float = 240) -> None:
    """Until the job has published a checkpoint (``latest`` written)."""
    deadline = time.monotonic() + timeout
    while not (ck / "latest").is_file():
        assert time.monotonic() < deadline, f"job {job} published no checkpoint within {timeout} s: {job_fields(job)}"
        time.sleep(0.2)


def log_of(run_dir: Path, job: str) -> str:
    return " ".join((run_dir / "slurm" / f"{job}.out").read_text().split())


ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"}


def ended(jobs: dict[str, tuple]) -> dict[str, tuple]:
    """Each job of ``jobs`` (name: (run dir, ..., job id)) once it has ended: its tuple with the
    job's final fields added."""
    return {name: (*job, wait_for_job(job[-1], ENDED)) for name, job in jobs.items()}


@pytest.fixture(scope="module")
def two_jobs(slurm_cluster, tmp_path_factory):
    """Two 2-node × 2-task runs at the same time, both ended: "whole" runs to its end; "warned" is
    sent USR1 to its batch shell once it has logged step 3, as `--signal=B:USR1@N` sends it before
    the time limit. Each: (run dir, job id, final fields)."""
    root = tmp_path_factory.mktemp("slurm_jobs")
    whole, warned = root / "whole", root / "warned"
    jobs = {"whole": (whole, submitted_job(megacli(*submit_args(whole)))),
            "warned": (warned, submitted_job(megacli(*submit_args(warned, f"checkpoint.dir={root / 'ck'}"))))}
    wait_for_iteration(jobs["warned"][1], warned, 3)
    subprocess.run(["scancel", "--batch", "--signal=USR1", jobs["warned"][1]], check=True)
    return ended(jobs)


@pytest.mark.slurm
def test_a_two_node_job_runs_to_its_end(two_jobs):
    run, job, fields = two_jobs["whole"]
    assert fields["JobState"] == "COMPLETED", (run / "slurm" / f"{job}.out").read_text() + (run / "slurm" / f"{job}.err").read_text()
    logged = records(run)
    assert [r["iteration"] for r in logged] == list(range(1, ITERS + 1))
    assert {r["slurm_restart_count"] for r in logged} == {0}
    assert "DP 4 on 4 cpu processes" in log_of(run, job) and f"done: {ITERS} iterations" in log_of(run, job)


@pytest.mark.slurm
def test_the_warning_saves_requeues_and_resumes_with_the_same_losses(two_jobs):
    """USR1 to the batch shell, as `--signal=B:USR1@N` sends it before the time limit: the tasks save
    at the next step boundary, the job requeues itself and resumes from that checkpoint."""
    whole = two_jobs["whole"][0]
    run, job, fields = two_jobs["warned"]
    log = log_of(run, job)
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "1", log
    stopped_at = int(re.search(r"stopped on SIGUSR1 at iteration (\d+): saved checkpoint", log).group(1))
    assert 3 <= stopped_at < ITERS
    assert f"requeueing job {job}" in log and f"at iteration {stopped_at}" in log.split("restart 1")[1]
    logged, reference = records(run), {r["iteration"]: r["loss"] for r in records(whole)}
    assert [r["iteration"] for r in logged] == list(range(1, ITERS + 1))
    for r in logged:
        assert abs(r["loss"] - reference[r["iteration"]]) <= 1e-6 * abs(reference[r["iteration"]]), r
        assert r["slurm_restart_count"] == (0 if r["iteration"] <= stopped_at else 1)


def complete_checkpoint(ck: Path, *, unfinished_allowed: bool = False) -> int:
    """The iteration `latest` names, after checking every checkpoint in ``ck`` against its manifest;
    an unfinished save (iter_N.tmp, never named by `latest`) only where ``unfinished_allowed``."""
    from megacli.checkpoint.manifest import verify

    for saved in ck.glob("iter_*"):
        if saved.name.endswith(".tmp"):
            assert unfinished_allowed, list(ck.iterdir())
        else:
            assert verify(saved).startswith("manifest: OK")
    return int((ck / "latest").read_text().strip().split("_")[1])


# The ways of stopping a job with scancel: its options.
SCANCEL = {"TERM-to-the-steps": ["--signal=TERM"], "TERM-to-the-batch-shell": ["--batch", "--signal=TERM"], "cancel": []}


@pytest.fixture(scope="module")
def cancelled(slurm_cluster, tmp_path_factory):
    """One 2-node × 1-task job per way of SCANCEL, at the same time, checkpointing every 2 steps;
    each stopped that way once it has logged step 3 and published a checkpoint, and ended. Each: (run dir, checkpoint dir,
    job id, final fields)."""
    root = tmp_path_factory.mktemp("scancel")
    jobs = {}
    for name in SCANCEL:
        run, ck = root / name / "run", root / name / "ck"
        jobs[name] = (run, ck, submitted_job(megacli(*submit_args(run, "launch.nproc=1", "train.iters=1000",
                                                                  f"checkpoint.dir={ck}", "checkpoint.save_interval=2"))))
    for name, (run, ck, job) in jobs.items():
        wait_for_iteration(job, run, 3)
        wait_for_checkpoint(job, ck)  # saves are asynchronous: iteration 2's is published a step or more later
        subprocess.run(["scancel", *SCANCEL[name], job], check=True)
    return ended(jobs)


@pytest.mark.slurm
@pytest.mark.parametrize("way", list(SCANCEL))
def test_scancel_leaves_only_complete_checkpoints(cancelled, way):
    """TERM to the tasks (plain --signal), or to the batch shell, which passes it on: they save at the
    next step boundary and the job ends. A plain scancel (TERM to everything, KILL 10 s later): what
    was saved stays complete."""
    run, ck, job, fields = cancelled[way]
    log = log_of(run, job)
    assert fields["Restarts"] == "0", log
    saved = complete_checkpoint(ck, unfinished_allowed=not SCANCEL[way])
    if SCANCEL[way]:
        assert fields["JobState"] == "COMPLETED", log
        assert f"stopped on SIGTERM at iteration {saved}: saved checkpoint" in log
    else:
        assert fields["JobState"] == "CANCELLED" and saved >= 2, log


def tasks_on(node: str, job: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            env = proc.environ()
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        if env.get("SLURMD_NODENAME") == node and env.get("SLURM_JOB_ID") == job:
            found.append(proc)
    return found


@pytest.mark.slurm
def test_a_node_that_stops_answering_requeues_the_job_from_the_last_complete_checkpoint(slurm_cluster, tmp_path):
    """Node n2 stops answering (its slurmd and the job's processes there paused): Slurm sets it DOWN
    after SlurmdTimeout and requeues the job, which starts again when the node is back and resumes
    from the newest complete checkpoint."""
    run, ck = tmp_path / "run", tmp_path / "ck"
    job = submitted_job(megacli(*submit_args(run, "launch.nproc=1", "train.iters=10", f"checkpoint.dir={ck}",
                                             "checkpoint.save_interval=2")))
    wait_for_iteration(job, run, 3)
    wait_for_checkpoint(job, ck)  # saves are asynchronous: iteration 2's is published a step or more later
    slurmd = psutil.Process(int((slurm_cluster / "pids" / "slurmd-n2.pid").read_text()))
    tasks = tasks_on("n2", job)
    assert tasks
    for proc in [slurmd, *tasks]:
        proc.send_signal(signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 120
        while job_fields(job)["Restarts"] == "0":
            assert time.monotonic() < deadline, f"job {job} not requeued: {job_fields(job)}"
            time.sleep(0.5)
        # The node comes back as if rebooted: without the job's processes, which Slurm cannot reach.
        for proc in tasks:
            proc.kill()
        psutil.wait_procs(tasks, timeout=30)
        saved = complete_checkpoint(ck, unfinished_allowed=True)  # a save n1 was in the middle of stays unfinished
        assert saved >= 2
    finally:
        slurmd.send_signal(signal.SIGCONT)
    fields = wait_for_job(job, ENDED)
    log = log_of(run, job)
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "1", log
    assert f"resumed from {ck / f'iter_{saved:07d}'} at iteration {saved}" in log
    assert [r["iteration"] for r in records(run)] == list(range(1, 11))
    complete_checkpoint(ck)
