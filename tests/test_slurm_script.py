"""The batch script `megacli submit` writes runs nothing but what megacli wrote, whatever a shared
recipe puts in the fields that reach it. Without a cluster: stub sbatch, sinfo, srun, scontrol and
scancel on PATH only log their arguments, and the written job.sh is executed by bash under them with
a PATH holding nothing else but the four tools the script itself uses (rm, head, grep, cut)."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import MOCK_GPT, ROOT, cli

STUBS = ("sbatch", "sinfo", "srun", "scontrol", "scancel")
TOOLS = ("rm", "head", "grep", "cut")  # the external commands of the script itself
SEP = "\x1f"  # between the logged arguments of one call
LAYOUT = ["parallel.tensor=1", "parallel.pipeline=1", "launch.nproc=1"]


def stub_slurm(tmp_path: Path, sinfo: str = "debug*|2|(null)") -> tuple[Path, Path]:
    """A directory of stubs (each logs its name and arguments; sinfo prints ``sinfo``, sbatch a job
    id) and symlinks to TOOLS; and the log."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    for name in STUBS:
        answer = {"sinfo": f"printf '%s\\n' {shlex.quote(sinfo)}", "sbatch": "echo 4242"}.get(name, "")
        logged = f"{{ printf '%s' {name}; printf '{SEP}%s' \"$@\"; printf '\\n'; }} >> {shlex.quote(str(log))}"
        (bin_dir / name).write_text(f"#!/bin/bash\n{logged}\n{answer}\n")
        (bin_dir / name).chmod(0o755)
    for tool in TOOLS:
        (bin_dir / tool).symlink_to(shutil.which(tool))
    return bin_dir, log


def calls(log: Path) -> list[list[str]]:
    return [line.split(SEP) for line in log.read_text().splitlines()] if log.exists() else []


def submit(tmp_path: Path, bin_dir: Path, run_dir: Path, *sets: str, extra: tuple[str, ...] = ()):
    every = [*MOCK_GPT, *LAYOUT, f"run.dir={run_dir}", *sets]
    args = ["submit", ROOT / "recipes" / "gpt_tiny.yaml", *[x for s in every for x in ("--set", s)]]
    return cli(*args, *(["--", *extra] if extra else []), env={"PATH": str(bin_dir)})


def test_the_script_runs_only_what_megacli_wrote(tmp_path):
    """Shell syntax in every field that reaches the script (run.dir and the values derived from it,
    the job name, account, an sbatch option, an option after --) stays text: the script passes
    `bash -n`, and run under the stubs it calls scontrol twice and srun once with megacli's command
    line, prints its one line, and creates none of the files the fields try to."""
    bin_dir, log = stub_slurm(tmp_path)
    attempts = {i: f"$(touch${{IFS}}pwned{i})" for i in range(4)}  # in the directory the script runs in
    run_dir = tmp_path / f"run{attempts[0]}`touch${{IFS}}pwned_b`;touch${{IFS}}pwned_c"
    res = submit(tmp_path, bin_dir, run_dir, f"launch.slurm.job_name=j{attempts[1]}",
                 f"launch.slurm.account=a;{attempts[2]}", f"launch.slurm.sbatch_options=['--comment={attempts[3]}']",
                 extra=("--qos=`touch${IFS}pwned4`",))
    assert res.exit_code == 0, res.output
    script = run_dir.absolute() / "slurm" / "job.sh"
    assert [c[0] for c in calls(log)] == ["sbatch", "sinfo", "sbatch"] and calls(log)[-1][1:] == ["--parsable", str(script)]
    assert subprocess.run([shutil.which("bash"), "-n", script], capture_output=True).returncode == 0
    log.unlink()
    work = tmp_path / "work"
    work.mkdir()
    done = subprocess.run([shutil.which("bash"), script], cwd=work, capture_output=True, text=True, timeout=60,
                          env={"PATH": str(bin_dir), "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n1"})
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    assert done.stdout == "megacli: job 7, restart 0, nodes n1\n"
    recipe = str(run_dir.absolute() / "slurm" / "recipe.yaml")
    assert calls(log) == [["scontrol", "show", "hostnames", "n1"], ["scontrol", "show", "node", ""],
                          ["srun", "--kill-on-bad-exit=1", sys.executable, "-m", "megacli", "pretrain", recipe]]
    assert not list(work.iterdir()) and not [p for p in tmp_path.rglob("*") if p.name.startswith("pwned")]


@pytest.mark.parametrize("sets, extra, message", [
    (['launch.slurm.job_name="x\\ntouch pwned"'], (), "launch.slurm.job_name = 'x\\ntouch pwned': holds '\\n'"),
    (["launch.slurm.account='a b'"], (), "launch.slurm.account = 'a b': holds ' '"),
    (['launch.slurm.partition="p\\rq"'], (), "launch.slurm.partition = 'p\\rq': holds '\\r'"),
    (["launch.slurm.sbatch_options=['--qos=high --wrap=id']"], (), "entry 0 ('--qos=high --wrap=id') holds ' '"),
    (["launch.slurm.sbatch_options=['--comment=\"x\"']"], (), "holds '\"' (a quote or backslash)"),
    (["launch.slurm.sbatch_options=['touch']"], (), "entry 0 ('touch') is not an option"),
    (['run.dir="{tmp}/x\\ntouch pwned/run"'], (), "the job's log directory (from run.dir) = "),
    (["run.name='my run'"], (), "the job name (launch.slurm.job_name is not set: run.name, else run.dir's name) = 'my run'"),
    ([], ("--qos=high\ntouch pwned",), "sbatch option after -- '--qos=high\\ntouch pwned' holds '\\n'"),
    ([], ("--x\x00",), "holds '\\x00'"),
], ids=["job-name", "account", "partition", "sbatch-option", "quote", "not-an-option", "run-dir", "run-name", "extra",
        "nul"])
def test_a_field_that_would_split_the_script_is_refused(tmp_path, sets, extra, message):
    bin_dir, log = stub_slurm(tmp_path)
    run_dir = tmp_path / "run"
    res = submit(tmp_path, bin_dir, run_dir, *[s.replace("{tmp}", str(tmp_path)) for s in sets], extra=extra)
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert message in res.output, res.output
    assert ["sbatch", "--parsable"] not in [c[:2] for c in calls(log)] and not list(tmp_path.glob("*/slurm")) \
        and not list(tmp_path.glob("*/run/slurm"))


@pytest.mark.parametrize("sinfo", ["garbage", "debug*|two|(null)", "|2|(null)"])
def test_unexpected_sinfo_output_is_a_message(tmp_path, sinfo):
    bin_dir, _ = stub_slurm(tmp_path, sinfo)
    res = submit(tmp_path, bin_dir, tmp_path / "run")
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert f"printed {sinfo!r}, not partition|nodes|gres" in " ".join(res.output.split()), res.output
