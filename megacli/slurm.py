"""`megacli submit`: the sbatch script of a training recipe, the cluster's checks of it, and sbatch.

The script starts one task per worker (`srun` with launch.nproc tasks on each of launch.nnodes
nodes); each task runs `megacli pretrain` on the resolved recipe, which maps its SLURM_* variables
to torch.distributed's (megacli.launch.slurm_to_torch_env). The batch shell passes Slurm's warning
before the time limit (USR1) and a TERM on to the tasks, which save at their next step boundary and
stop; after the warning the job requeues itself and resumes from the latest checkpoint.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from megacli.errors import UserError
from megacli.rundir import STOPPED_FILE, error_dir

SCRIPT_DIR = "slurm"  # under run.dir: the script, the recipe it runs, the job's logs
SCRIPT_FILE = "job.sh"
RECIPE_FILE = "recipe.yaml"


@dataclass(frozen=True)
class Partition:
    name: str
    nodes: int
    gpus_per_node: int  # the most any of its nodes has


@dataclass(frozen=True)
class Submitted:
    job_id: str
    script: Path
    output: Path
    error: Path


def script_dir(run_dir: str | Path) -> Path:
    return Path(run_dir).absolute() / SCRIPT_DIR


def gpus_in_gres(gres: str) -> int:
    """GPUs in a node's generic resources as sinfo prints them: 'gpu:a100:4(S:0-1),nvme:1' -> 4."""
    total = 0
    for item in gres.split(","):
        found = re.match(r"gpu(?::[^:(]+)?:(\d+)", item.strip())
        if found:
            total += int(found.group(1))
    return total


def partitions() -> tuple[dict[str, Partition], str | None]:
    """The cluster's partitions by name, and the default one (sinfo)."""
    out = _slurm_command(["sinfo", "--noheader", "--format=%P|%D|%G"])
    nodes: dict[str, int] = {}
    gpus: dict[str, int] = {}
    default = None
    for line in out.splitlines():
        if not line.strip():
            continue
        name, count, gres = _sinfo_fields(line)
        if name.endswith("*"):
            name = name[:-1]
            default = name
        nodes[name] = nodes.get(name, 0) + count
        gpus[name] = max(gpus.get(name, 0), gpus_in_gres(gres))
    return {name: Partition(name, nodes[name], gpus[name]) for name in nodes}, default


def _sinfo_fields(line: str) -> tuple[str, int, str]:
    """One line of `sinfo --format=%P|%D|%G`: partition, node count, generic resources."""
    fields = line.strip().split("|", 2)
    if len(fields) == 3 and fields[0] and fields[1].isdigit():
        return fields[0], int(fields[1]), fields[2]
    raise UserError(f"`sinfo --noheader --format=%P|%D|%G` printed {line.strip()!r}, not partition|nodes|gres: "
                    f"megacli cannot read this cluster's partitions (check `sinfo` here; `megacli submit --dry-run` "
                    f"prints the script without asking the cluster)")


def _slurm_command(args: list[str]) -> str:
    if shutil.which(args[0]) is None:
        raise UserError(f"`{args[0]}` is not on PATH: `megacli submit` runs where Slurm's commands are (a login node); "
                        f"`megacli submit --dry-run` prints the script without them")
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode != 0:
        raise UserError(f"`{shlex.join(args)}` failed: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


def gpus_per_node(launch, partition: Partition | None) -> int:
    """GPUs each node's tasks ask for: one per task on CUDA (launch.device cuda, or auto on a
    partition with GPUs), none on the CPU backend. Raises when the nodes have too few."""
    if launch.device == "cpu":
        return 0
    have = partition.gpus_per_node if partition is not None else None
    if launch.device == "auto" and not have:
        return 0  # no GPUs there (or not looked up): the CPU backend
    if have is not None and launch.nproc > have:
        where = f"the nodes of partition {partition.name!r} have {have or 'no'} GPU{'s' if have != 1 else ''}"
        raise UserError(f"launch.nproc = {launch.nproc}: one GPU per process, but {where} "
                        f"(lower launch.nproc, pick another partition in launch.slurm.partition, or set launch.device: cpu)")
    return launch.nproc


def check_partition(launch) -> Partition:
    """The partition the job goes to, checked: it exists and has launch.nnodes nodes."""
    known, default = partitions()
    name = launch.slurm.partition or default
    if name is None:
        raise UserError("launch.slurm.partition is not set and the cluster has no default partition "
                        f"(partitions: {', '.join(sorted(known)) or 'none'})")
    if name not in known:
        raise UserError(f"launch.slurm.partition = {name!r}: no such partition on this cluster "
                        f"(sinfo lists {', '.join(sorted(known)) or 'none'})")
    part = known[name]
    if launch.nnodes > part.nodes:
        raise UserError(f"launch.nnodes = {launch.nnodes}: partition {name!r} has {part.nodes} node{'s' if part.nodes != 1 else ''}")
    return part


def sbatch_options(recipe, *, gpus: int, extra: list[str]) -> list[str]:
    """The #SBATCH options, in the script's order; every value one word of its line (the recipe's
    own fields are checked when it loads; the values derived from others and the options after --, here)."""
    from megacli.recipe.slurm import option_problem

    ln, sl = recipe.launch, recipe.launch.slurm
    logs = script_dir(recipe.run.dir)
    name = sl.job_name or _one_word(recipe.run.name or Path(recipe.run.dir).name,
                                    "the job name (launch.slurm.job_name is not set: run.name, else run.dir's name)",
                                    "set launch.slurm.job_name")
    _one_word(str(logs), "the job's log directory (from run.dir)", "choose another run.dir")
    _one_word(str(Path.cwd()), "the working directory (the job's --chdir)", "submit from another directory")
    for option in extra:
        problem = option_problem(option)
        if problem:
            raise UserError(f"sbatch option after -- {option!r} {problem}")
    options = [f"--job-name={name}", f"--nodes={ln.nnodes}", f"--ntasks-per-node={ln.nproc}"]
    if gpus:
        options.append(f"--gpus-per-node={gpus}")
    if ln.threads_per_process:
        options.append(f"--cpus-per-task={ln.threads_per_process}")
    if sl.time_limit_minutes:
        options.append(f"--time={sl.time_limit_minutes}")
    if sl.partition:
        options.append(f"--partition={sl.partition}")
    if sl.account:
        options.append(f"--account={sl.account}")
    if sl.signal_seconds:
        options.append(f"--signal=B:USR1@{sl.signal_seconds}")
    options += ["--requeue" if sl.requeue else "--no-requeue", "--open-mode=append",
                f"--output={logs / '%j.out'}", f"--error={logs / '%j.err'}", f"--chdir={Path.cwd()}",
                *sl.sbatch_options, *extra]
    return options


def _one_word(value: str, what: str, fix: str) -> str:
    """``value`` when it can be one word of an #SBATCH line, else a UserError naming ``what``."""
    from megacli.recipe.slurm import sbatch_word_problem

    problem = sbatch_word_problem(value)
    if problem:
        raise UserError(f"{what} = {value!r} {problem}: {fix}")
    return value


def batch_script(recipe, *, job: str, recipe_file: Path, gpus: int, extra: list[str]) -> str:
    """The sbatch script that runs ``job`` (pretrain or finetune) on ``recipe_file``."""
    sl = recipe.launch.slurm
    run_dir = Path(recipe.run.dir).absolute()
    q = shlex.quote
    header = "\n".join(f"#SBATCH {option}" for option in sbatch_options(recipe, gpus=gpus, extra=extra))
    command = shlex.join([sys.executable, "-m", "megacli", job, str(recipe_file)])
    requeue = ""
    if sl.requeue:
        requeue = f"""
# Stopped on the warning with a checkpoint: run again in a new allocation, from the latest checkpoint.
if [ "$warned" = 1 ] && [ "$status" = 0 ] && [ -f {q(str(run_dir / STOPPED_FILE))} ]; then
    echo "megacli: saved before the time limit; requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID"
fi"""
    return f"""#!/bin/bash
# Written by `megacli submit` for run.dir {run_dir}; keep it, edit it, submit it with `sbatch {script_dir(run_dir) / SCRIPT_FILE}`.
{header}

# One task per worker: srun starts launch.nproc tasks on each node, and each `megacli {job}` reads
# its rank, the world size and the first node's address from Slurm's SLURM_* variables.
# What an earlier attempt of this job left behind: whether it stopped, and its workers' errors.
rm -f {q(str(run_dir / STOPPED_FILE))} {q(str(error_dir(run_dir)))}/rank*.json

# Slurm signals this shell (USR1 before the time limit, TERM from `scancel --full`); it is passed on
# to every task (not through srun, which ends its tasks on a TERM), which saves at its next step
# boundary and stops.
warned=0
signals=0
pass_on() {{
    signals=$((signals + 1))
    [ "$1" = USR1 ] && warned=1
    scancel --signal="$1" "$SLURM_JOB_ID"
}}
trap 'pass_on USR1' USR1
trap 'pass_on TERM' TERM

# The first node hosts the rendezvous, at the address Slurm reaches it by (its NodeAddr).
first_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_ADDR=$(scontrol show node "$first_node" | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2)

echo "megacli: job $SLURM_JOB_ID, restart ${{SLURM_RESTART_COUNT:-0}}, nodes $SLURM_JOB_NODELIST"
srun --kill-on-bad-exit=1 {command} &
step=$!
while :; do  # a signal interrupts `wait`: wait again until the tasks have ended
    before=$signals
    wait "$step"
    status=$?
    [ "$signals" = "$before" ] && break
done
{requeue}
exit "$status"
"""


def write_script(recipe, *, job: str, gpus: int, extra: list[str]) -> Path:
    """Write the resolved recipe and the script under <run.dir>/slurm; return the script's path."""
    from megacli.recipe.base import dump
    from megacli.rundir import unwritable_names

    directory = script_dir(recipe.run.dir)
    recipe_file, script = directory / RECIPE_FILE, directory / SCRIPT_FILE
    text = batch_script(recipe, job=job, recipe_file=recipe_file, gpus=gpus, extra=extra)  # refused before writing
    with unwritable_names(directory, "run.dir", recipe_file, script):
        directory.mkdir(parents=True, exist_ok=True)
        recipe_file.write_text(dump(recipe))
        script.write_text(text)
        script.chmod(0o755)
    return script


def submit(recipe, *, job: str, extra: list[str]) -> Submitted:
    """Check the recipe against the cluster, write the script and submit it."""
    _slurm_command(["sbatch", "--version"])  # sbatch is there before anything is written
    gpus = gpus_per_node(recipe.launch, check_partition(recipe.launch))
    script = write_script(recipe, job=job, gpus=gpus, extra=extra)
    out = _slurm_command(["sbatch", "--parsable", str(script)])
    job_id = out.strip().split(";")[0]
    logs = script.parent
    return Submitted(job_id, script, logs / f"{job_id}.out", logs / f"{job_id}.err")

