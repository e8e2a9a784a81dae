"""launch.slurm: what `megacli submit` writes into the sbatch script besides the layout
(launch.nnodes nodes, launch.nproc tasks on each)."""

from __future__ import annotations

from typing import Optional

from pydantic import NonNegativeInt, PositiveInt, field_validator

from megacli.recipe.base import Section


def sbatch_word_problem(value: str) -> str | None:
    """Why ``value`` cannot be written as one word of an ``#SBATCH`` line of the batch script (None
    when it can): a line break would end the line and start a command of the script, a space would
    split it into two options, and sbatch reads quotes and backslashes in those lines."""
    for char in value:
        if not char.isprintable() or char.isspace():
            return f"holds {char!r} (a control character or space), which would split the script's #SBATCH line"
        if char in "\"'\\":
            return f"holds {char!r} (a quote or backslash), which sbatch would read in the script's #SBATCH line"
    return None


class SlurmSection(Section):
    partition: Optional[str] = None
    """Slurm partition (sbatch --partition); null: the cluster's default partition."""
    account: Optional[str] = None
    """Account charged for the job (sbatch --account); null: your default account."""
    time_limit_minutes: Optional[PositiveInt] = None
    """The job's time limit in minutes (sbatch --time); null: the partition's default. Each
    allocation (every requeue starts a new one) gets this much."""
    signal_seconds: NonNegativeInt = 120
    """How long before the time limit Slurm warns the job (sbatch --signal=B:USR1@N): the workers
    save at their next step boundary and stop, and the job requeues itself (launch.slurm.requeue).
    Slurm sends it up to about a minute early, never late: leave room for a step and a save. 0: no warning."""
    requeue: bool = True
    """Requeue the job after it stopped on the warning (it resumes from the latest checkpoint in a
    new allocation), and let Slurm requeue it after a node failure or preemption (sbatch --requeue).
    false: the job ends there (sbatch --no-requeue)."""
    job_name: Optional[str] = None
    """The job's name in squeue (sbatch --job-name); null: run.name, else the run directory's name."""
    sbatch_options: list[str] = []
    """More sbatch options, each written as one #SBATCH line, e.g. [--qos=high, --constraint=a100]
    (options given after -- on the command line are added after these). Each is one option: it starts
    with '-' and holds no space, control character, quote or backslash."""

    @field_validator("partition", "account", "job_name")
    @classmethod
    def _one_word(cls, value: Optional[str]) -> Optional[str]:
        problem = None if value is None else ("is empty" if not value else sbatch_word_problem(value))
        if problem:
            raise ValueError(problem)
        return value

    @field_validator("sbatch_options")
    @classmethod
    def _one_option_each(cls, options: list[str]) -> list[str]:
        for i, option in enumerate(options):
            problem = option_problem(option)
            if problem:
                raise ValueError(f"entry {i} ({option!r}) {problem}")
        return options


def option_problem(option: str) -> str | None:
    """Why ``option`` cannot be one sbatch option of the script (None when it can)."""
    if not option.startswith("-"):
        return "is not an option (it does not start with '-')"
    return sbatch_word_problem(option)
