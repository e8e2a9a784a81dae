"""What the training loop does around its steps, one owner per cadence, each called once a step:
the log window (step lines), evaluations and the non-finite policy. Saves are engine.saves',
stop requests engine.stop's."""

from __future__ import annotations

from megacli.engine import nonfinite
from megacli.engine.metrics import Stopwatch, is_preference, perplexity


class LogWindow:
    """Step lines: losses and step time averaged over the steps since the last line (every
    train.log_interval steps and at the last one); the pauses of the loop (evaluations, saves)
    are left out of the step time."""

    def __init__(self, *, log, recipe, trainer, tokenizer, expert_stats, stop_at: int, device):
        self.log, self.recipe, self.trainer, self.tokenizer = log, recipe, trainer, tokenizer
        self.expert_stats, self.stop_at, self.device = expert_stats, stop_at, device
        self.watch = Stopwatch(device)
        self.losses: dict[str, float] = {}
        self.steps, self.seconds = 0, 0.0
        self.grad_norm, self.lr, self.ok = None, None, True  # of the newest step taken (lr: the rate it used)
        self.memory_reported = False

    def step(self, *, iteration: int, losses: dict | None, lr: float, grad_norm, ok: bool, skipped: int) -> None:
        """After each step; ``losses`` None for a step left out (skipped as non-finite); ``lr``: the
        learning rate the step used (read before the scheduler advanced it)."""
        t = self.recipe.train
        self.seconds += self.watch.lap()
        if losses is not None:
            for k, v in losses.items():
                self.losses[k] = self.losses.get(k, 0.0) + v
            self.steps += 1
            self.grad_norm, self.lr, self.ok = grad_norm, lr, ok
        if not (self.steps and (iteration % t.log_interval == 0 or iteration == self.stop_at)):
            self.log.advance(iteration)
            return
        optimizer = self.trainer.optimizer
        mean = {k: v / self.steps for k, v in self.losses.items()}
        extra = {**({} if self.ok else {"skipped_step": True}), **({"nonfinite_skipped": skipped} if skipped else {})}
        self.log.step(iteration=iteration, loss=mean.pop("loss"), lr=self.lr,
                      grad_norm=float(self.grad_norm) if self.grad_norm is not None else None,
                      seconds_per_step=self.seconds / self.steps,
                      loss_scale=optimizer.get_loss_scale().item() if t.precision == "fp16" else None,
                      extra=extra or None, losses=mean,
                      experts=self.expert_stats.collect(self.steps) if self.expert_stats else None)
        self.losses, self.steps, self.seconds = {}, 0, 0.0
        if not self.memory_reported:  # the first step line: measured peak memory beside the estimate
            from megacli.engine.memory import peak_memory_line

            self.log.say(peak_memory_line(self.recipe, tokenizer=self.tokenizer, device=self.device))
            self.memory_reported = True

    def paused(self) -> None:
        """The loop did something else since the last step (an evaluation, a save)."""
        self.watch.lap()


class Evaluations:
    """Every train.eval_interval steps and at train.iters: the validation losses (the split and
    the named sets) and the harness tasks. ``evaluate(trainer, dataset, batches=)`` measures one set."""

    def __init__(self, *, trainer, log, evaluate, run_tasks=None):
        self.trainer, self.log, self.evaluate, self.run_tasks = trainer, log, evaluate, run_tasks
        self.last_val = None  # the newest split-based validation losses

    def step(self, iteration: int) -> bool:
        """Collective, after each step. Whether an evaluation ran."""
        t, trainer = self.trainer.recipe.train, self.trainer
        if not (t.eval_interval and (iteration % t.eval_interval == 0 or iteration == t.iters)):
            return False
        val = self.evaluate(trainer, trainer.valid_data, batches=t.eval_iters)
        named = {name: self.evaluate(trainer, ds, batches=ds.batches) for name, ds in trainer.named_valid.items()}
        tasks = self.run_tasks(iteration) if self.run_tasks is not None else None
        self.log.evaluation(iteration=iteration, val=val, named=named, tasks=tasks)
        self.last_val = val if val is not None else self.last_val
        return True

    def summary(self, iteration: int) -> str:
        """The run's closing line."""
        val = self.last_val
        if val is not None and is_preference(val):
            return (f"done: {iteration} iterations | final validation loss {val['loss']:.4f} | "
                    f"reward accuracy {val['rewards/accuracy']:.3f}")
        if val is not None:
            return f"done: {iteration} iterations | final validation loss {val['loss']:.4f} | perplexity {perplexity(val):.2f}"
        return f"done: {iteration} iterations"


class NonFinitePolicy:
    """train.on_nonfinite for a step whose loss or gradients are not finite (caught before the
    optimizer applies it): stop, naming the newest good checkpoint, or skip the step and count it."""

    def __init__(self, *, on_nonfinite: str, log, saves):
        self.on_nonfinite, self.log, self.saves = on_nonfinite, log, saves
        self.skipped = 0

    def step(self, take_step, iteration: int) -> tuple[dict | None, object, bool]:
        """``take_step()``'s (losses, grad norm, taken) for step ``iteration``; losses None when skipped."""
        try:
            return take_step()
        except nonfinite.NonFiniteStep as bad:
            if self.on_nonfinite == "stop":
                self.saves.finish()  # every rank raises alike; a save in flight holds the last finite weights
                raise nonfinite.stopped(f"{bad} at iteration {iteration} (not applied)", self.saves.last_good,
                                        self.on_nonfinite) from None
            self.skipped += 1
            self.log.say(f"iteration {iteration}: {bad}, step skipped ({self.skipped} so far; train.on_nonfinite = skip)")
            return None, None, False

    def summary(self) -> str | None:
        if not self.skipped:
            return None
        return f"{self.skipped} step(s) skipped for a non-finite loss or gradients (train.on_nonfinite = skip)"
