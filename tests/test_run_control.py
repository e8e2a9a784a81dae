"""How a run is controlled as a process: its metrics history on resume, the job id and rendezvous
of several nodes, the run-directory lock, signals, stalled ranks and the death of the launcher."""

from __future__ import annotations

import json

import torch


def test_resumed_run_replaces_the_records_after_its_checkpoint(tmp_path):
    from megacli.engine.metrics import MetricsLog

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"iteration": i, "loss": 1.0}) + "\n" for i in (1, 2, 3, 4)))
    log = MetricsLog(run_dir=str(tmp_path), enabled=True, total_iters=6, start_iter=2, tokens_per_step=1,
                     flops_per_step=1.0, world_size=1, device=torch.device("cpu"), tensorboard=False)
    log.close()
    assert [json.loads(line)["iteration"] for line in path.read_text().splitlines()] == [1, 2]
