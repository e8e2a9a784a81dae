"""launch.slurm: what `megacli submit` writes into the sbatch script besides the layout
(launch.nnodes nodes, launch.nproc tasks on each)."""

from __future__ import annotations

from typing import Optional

from pydantic import NonNegativeInt, PositiveInt

from megacli.recipe.base import Section


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
    (options given after -- on the command line are added after these)."""
