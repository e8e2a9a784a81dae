"""The save cadence of the training loop: when to save, and asynchronous saves.

An asynchronous save (checkpoint.async_save) goes through Megatron-Core's own machinery: the save
is planned and its shards copied off the device at a step boundary, a forked process writes them
(Megatron-Core's AsyncCallsQueue), checks they are finite and hashes them, and training goes on. At each later step boundary the queue
is asked, collectively, whether every rank's write has completed; the first boundary where it has
runs the save's finalize step (engine.checkpoint: Megatron's write results and metadata, then the
manifest, the rename into place and `latest`). Until then the save is `iter_N.tmp`, which nothing
reads, so a crash keeps the previous checkpoint. A save waits for the one before it, and the saves
of a stop (a signal, the time limit) and of the run's end are written before the loop goes on.
"""

from __future__ import annotations

import multiprocessing
from pathlib import Path

from megacli.engine import checkpoint, nonfinite


def can_save_async() -> bool:
    """Megatron-Core's writer forks the training process (it copies nothing but what it writes)."""
    return "fork" in multiprocessing.get_all_start_methods()


def checkpoint_recipe_yaml(recipe, *, writer: bool) -> str:
    """The recipe.yaml of the run's checkpoints. It names the tokenizer the checkpoint directory
    carries (with the chat template a finetuning run trains with), which the writer (rank 0, the
    one that writes recipe.yaml) copies there now, once for the run (megacli.checkpoint.carried)."""
    from megacli.recipe.base import dump

    if not (recipe.checkpoint.dir and writer):
        return dump(recipe, carried=True)
    from megacli.checkpoint.carried import carry
    from megacli.data.sft import trained_chat_template

    section = carry(Path(recipe.checkpoint.dir), recipe.tokenizer, chat_template=trained_chat_template(recipe))
    return dump(recipe, carried=True, tokenizer=section)


class Saves:
    """Owns checkpoint.dir's saves for one run: ``step`` at every step boundary, ``finish`` when the
    loop ends, ``abort`` when it fails."""

    def __init__(self, *, recipe, trainer, recipe_yaml: str, run_id: str, lora_base, last_good, log, stream_meta):
        self.ck, self.trainer, self.log = recipe.checkpoint, trainer, log
        self.on_nonfinite = recipe.train.on_nonfinite
        self.recipe_yaml, self.run_id, self.lora_base, self.stream_meta = recipe_yaml, run_id, lora_base, stream_meta
        self.last_good = last_good  # the newest published checkpoint with finite weights
        self.queue = None
        if self.ck.dir and self.ck.async_save and self.ck.save_interval and can_save_async():
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            self.queue = AsyncCallsQueue()  # Megatron-Core's forked (not persistent) caller
        self.in_flight: dict[int, Path] = {}  # the queue's call index -> the directory it publishes
        self.strategy = None
        if self.ck.dir:
            from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

            # A run's model and optimizer keep their structure, so Megatron-Core's save plan is reused
            # (Megatron-LM's --ckpt-assume-constant-structure): checked against the first at the second
            # save, not computed again from the third. Each save's writer names its own directory.
            self.strategy = TorchDistSaveShardedStrategy("torch_dist", 1, cached_metadata=True)

    def step(self, *, iteration: int, consumed: int, last: bool) -> tuple[bool, Path | None]:
        """Collective, after each step: publish what completed, then save when due (``last``: the
        run ends or stops after this step, and the save is written before returning). Returns
        whether the loop paused here, and the directory saved (or being saved) at this step."""
        due = self.ck.dir and (last or (self.ck.save_interval and iteration % self.ck.save_interval == 0))
        paused = self._publish(blocking=bool(due))  # a save waits for the one before it
        if not due:
            return paused, None
        queue = None if last else self.queue
        try:
            path = checkpoint.save(ckpt_dir=self.ck.dir, iteration=iteration, consumed_samples=consumed,
                                   chunks=self.trainer.chunks, optimizer=self.trainer.optimizer,
                                   scheduler=self.trainer.scheduler, recipe_yaml=self.recipe_yaml,
                                   keep_last=self.ck.keep_last, run_id=self.run_id, lora_base=self.lora_base,
                                   extra_meta=self.stream_meta(), queue=queue, check_finite=True,
                                   strategy=self.strategy)
        except nonfinite.NonFiniteSave as bad:
            raise nonfinite.stopped(str(bad), self.last_good, self.on_nonfinite) from None
        if queue is None:
            self._published(path)
        else:
            self.in_flight[queue.call_idx] = path
        return True, path

    def _publish(self, *, blocking: bool) -> bool:
        """Collective while a save is in flight: publish the saves every rank has written (with
        ``blocking``, after waiting for them). Whether one was published."""
        if not self.in_flight:
            return False
        try:
            done = self.queue.maybe_finalize_async_calls(blocking=blocking)
        except nonfinite.NonFiniteSave as bad:
            raise nonfinite.stopped(str(bad), self.last_good, self.on_nonfinite) from None
        for index in done:
            self._published(self.in_flight.pop(index))
        return bool(done)

    def _published(self, path: Path) -> None:
        self.log.say(f"saved checkpoint {path}")
        self.log.plot(background=True)
        self.last_good = path

    def finish(self) -> None:
        """Collective: wait for the save in flight and publish it."""
        self._publish(blocking=True)

    def abort(self) -> None:
        """The loop failed: stop the writer of the save in flight, which stays unpublished."""
        if self.queue is not None:
            for call in self.queue.async_calls:
                call.async_caller.close(abort=True)  # the forked writer is killed
            self.queue.async_calls.clear()
        self.in_flight.clear()
