"""The training loop, one for every stage: the story of a step.

    the step source makes the step's micro-batches (drawn data; GRPO: sampled and scored rollouts) ->
    for each of its updates: objective (a token mean, e.g. SFT's: weighted by the micro-batch's share of the
    step's tokens) -> engine.backward / engine.step over the micro-batches (DeepSpeed
    accumulates, clips, steps the optimizer and the schedule) -> advance the sampler -> evaluate (and write
    samples) when due -> log when due -> agree on stopping -> checkpoint when due -> publish the time budget's clock

The run ends after train.max_steps steps or, with a time budget, before a step that would end past it
(`llm.train.time_budget`), whichever comes first; the last step is evaluated and saved.

Nothing in a step waits for the device: losses and the objective's metrics stay on it and are reduced
across ranks once per logged step. Evaluation, logging, checkpoints and the stop vote are the only points
where the host waits (and GRPO's rollouts, which need the sampled text on the host to score it). Starting a job
(config, engines, resume) is `llm.train.job`; what a step trains on is `llm.train.steps`.
"""

from __future__ import annotations

import math
import sys
import uuid
from contextlib import nullcontext
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from llm import rundir
from llm.config import RunConfig
from llm.data.datasets import checked_to
from llm.data.sampler import ResumableDistributedSampler
from llm.devices import CPU_OUT_OF_MEMORY, exact_dtype, out_of_memory
from llm.errors import EXIT_OK, EXIT_PREEMPTED, EXIT_RANK_LOST, StepInputError, UserError, report
from llm.runtime.distributed import DistInfo, raise_together
from llm.runtime.preemption import Preemption, data_loader_worker_init
from llm.runtime.rerun import rerun_advice
from llm.runtime.watchdog import Watchdog
from llm.stdout import output_loss_handled
from llm.train import checkpoint
from llm.train.engine import (
    grad_norm_before_step,
    is_loss_scale_at_minimum,
    keeps_no_grad_norm,
    loss_scale_of,
    overflowed_at_minimum_scale,
    set_loss_scale,
    unscaled_grad_norm,
)
from llm.train.loader_watch import LIMIT, NoBatch, WatchedLoader, WorkerDied, torch_said, worker_failure
from llm.train.metrics import MetricsLogger, StepStats
from llm.train.objectives import MicroStep
from llm.train.samples import SampleGenerator
from llm.train.steps import StepBatches
from llm.train.time_budget import TimeBudget


def refuse_too_few(steps: Any, n_samples: int, info: DistInfo) -> None:
    """Refuse, on every rank, a train split of `n_samples` that holds fewer than the samples all ranks draw a step
    (`steps`: the stage's step source)."""
    needed = steps.draw_size * steps.draws_per_step * info.world_size
    if n_samples < needed:  # every rank finds it
        raise_together(steps.too_few(n_samples, needed), announce=info.local_rank == 0)


def nothing_left(max_steps: int, budget: TimeBudget, step: int) -> str | None:
    """Why no step is left to train after `step` (train.max_steps reached, or the time `budget` spent), said for a
    resume that finds none; None while one is."""
    if step >= max_steps:
        return f"train.max_steps is {max_steps}; set a higher train.max_steps to train further"
    if budget.out_of_time(step):
        return (f"its time budget train.max_time={budget.max_time:g} s is spent ({budget.elapsed:.1f} s trained, "
                f"{budget.step_seconds:.2g} s a step); set a longer train.max_time to train further")
    return None


class Trainer:
    def __init__(self, cfg: RunConfig, run_dir: Path, info: DistInfo, engine, objective, steps, train_set: Dataset,
                 val_set: Dataset | None, n_params: int, budget: TimeBudget | None = None,
                 samples: SampleGenerator | None = None) -> None:
        """`engine`: the DeepSpeed engine of the model being trained; `objective(engine, batch) -> MicroStep`;
        `steps`: the step source (`llm.train.steps`) that turns draws from `train_set` into micro-batches;
        `val_set`: None for no evaluation; `n_params`: the model's parameter count (for throughput in FLOPs);
        `budget`: the time budget the schedule reads (None: train.max_steps only); `samples`: what generates
        samples at each evaluation (None: none)."""
        self.cfg, self.run_dir, self.dist = cfg, run_dir, info
        self.engine, self.objective, self.steps, self.n_params = engine, objective, steps, n_params
        self.train_set, self.val_set = train_set, val_set
        t = cfg.train
        self.tokens_per_step = t.micro_batch_size * t.grad_accum * info.world_size * cfg.data.seq_len * (
            2 if t.stage == "dpo" else 1)
        """The positions a step trains on: the global batch x data.seq_len, twice for DPO (a pair's chosen and
        rejected rows) (`tokens_seen`)."""
        self.samples_per_step = steps.draw_size * steps.draws_per_step * info.world_size
        """Samples drawn by all ranks together per step (GRPO: prompts; a global batch of completions)."""
        refuse_too_few(steps, len(train_set), info)
        self.sampler = ResumableDistributedSampler(len(train_set), info.world_size, info.rank, seed=t.seed)
        self.preemption = Preemption(info)
        self.budget = budget or TimeBudget(t, info)
        self.samples = samples
        self.step = 0
        self.tokens_seen = 0
        """Positions trained on since the run began (global batch x data.seq_len per step, whatever the batch was
        when each step ran): the x axis `zerollm plot` draws against tokens, right across a resume on other ranks."""
        self.run_id = uuid.uuid4().hex[:12]
        self._batches = None
        self._metric_names: list[str] = []
        self._step_metric_names: list[str] = []
        self._exact = exact_dtype(info.device)
        """float64 for the step's sums and counters (float32 on Apple's MPS, which has no float64)."""
        self._tokens_since_log = torch.zeros(1, dtype=self._exact, device=info.device)
        self._positions_since_log = 0
        self._generated_since_log = 0
        self._generation_seconds_since_log = 0.0
        self._update_loss_scale: float | None = None
        """fp16: the loss scale of the last optimizer update's gradients (the update may change it), to unscale
        its gradient norm (`unscaled_grad_norm`)."""
        self._norm_taken_here = keeps_no_grad_norm(engine)
        self._last_grad_norm: torch.Tensor | None = None
        """Where DeepSpeed keeps none (`keeps_no_grad_norm`): the last optimizer step's gradient norm, kept on the
        device (read at logged steps only: no wait for the device at every step)."""

    # ---- state ---------------------------------------------------------------------------------

    def resume(self, tag: str, universal: bool) -> None:
        state = checkpoint.load(self.engine, self.run_dir, tag, universal, clock_driven=self.budget.enabled)
        self.step, self.run_id = state["step"], state["run_id"]
        self.tokens_seen = state["tokens_seen"] if "tokens_seen" in state else self._tokens_before_the_count()
        try:
            self.sampler.load_state_dict(state["sampler"])
        except ValueError as exc:  # every rank finds it
            raise_together(f"{self.run_dir}: {tag} does not fit the data in {self.steps.inputs} ({exc}); resume "
                           "with the data and train.seed it was trained on, or start a new run with --init-from "
                           f"{self.run_dir}", announce=self.dist.local_rank == 0)
        if state.get("loss_scale") is not None:  # fp16: continue with the scale the run had reached, exactly
            set_loss_scale(self.engine, state["loss_scale"])
        self.budget.load_state_dict(state.get("time_budget"), self.step)

    def _tokens_before_the_count(self) -> int:
        """The tokens seen by a checkpoint an earlier version saved, which keeps no count: its steps at the batch
        the run directory records (its last session's, not yet replaced by this one's: `zerollm plot` drew its rows
        so), or at this session's where the run directory does not say."""
        try:
            return self.step * rundir.recorded_tokens_per_step(self.run_dir)
        except UserError:
            return self.step * self.tokens_per_step

    def client_state(self, stopped_by_signal: bool) -> dict[str, Any]:
        return {"step": self.step, "run_id": self.run_id, "world_size": self.dist.world_size,
                "tokens_seen": self.tokens_seen, "sampler": self.sampler.state_dict(),
                "stopped_by_signal": stopped_by_signal, "loss_scale": loss_scale_of(self.engine),
                "time_budget": self.budget.state_dict(self.step)}

    # ---- data ----------------------------------------------------------------------------------

    def _draw(self):
        """The next `steps.draw_size` samples of this rank, collated by the step source, drawn as
        `llm.train.loader_watch.WatchedLoader.next` watches it. The loader draws its workers' base seed from a
        generator of its own: from the global RNG, a resumed run (which starts a loader where the uninterrupted one
        continued its own) would shift every dropout mask after it."""
        if self._batches is None:
            on_gpu = self.dist.device.type == "cuda"
            workers = self.cfg.data.loader_workers
            loader = DataLoader(self.train_set, batch_size=self.steps.draw_size, sampler=self.sampler,
                                collate_fn=self.steps.collate,
                                num_workers=(2 if on_gpu else 0) if workers is None else workers, pin_memory=on_gpu,
                                worker_init_fn=data_loader_worker_init, generator=torch.Generator())
            self._batches = WatchedLoader(iter(loader), self.dist.device, self.steps.inputs)
        return self._batches.next(self.step + 1, lambda: self.preemption.requested, self.dist.world_size,
                                  self.cfg.train.collective_timeout_s)

    def _start_epoch_if_needed(self) -> None:
        """An epoch ends when less than one step's samples remain (that tail is not trained on)."""
        if self.sampler.num_samples - self.sampler.consumed < self.samples_per_step:
            self.sampler.set_epoch(self.sampler.epoch + 1)
            self._batches = None

    # ---- one step ------------------------------------------------------------------------------

    @staticmethod
    def _micro_loss(micro: MicroStep, weight: torch.Tensor | None) -> torch.Tensor:
        """What a micro-batch backpropagates: its loss times its token weight (`_token_weights`), plus its
        load-balancing term (an MoE policy's), which is the micro-batch's own and takes no token weight."""
        loss = micro.loss if weight is None else micro.loss * weight
        return loss if micro.aux is None else loss + micro.aux

    def _micro_values(self, loss: torch.Tensor, micro: MicroStep, metric_weight: torch.Tensor | None) -> torch.Tensor:
        """The micro-batch's backpropagated `loss` and its metrics, these times their token weight where they are
        token means (the objective's `metric_mask`: distillation's `ce` and `distill_kl`, GRPO's `kl` and
        `clip_fraction`), as one vector of `_exact` numbers on the device."""
        self._metric_names = sorted(micro.metrics)
        metrics = [micro.metrics[k].float() for k in self._metric_names]
        if metric_weight is not None:
            metrics = [m * metric_weight for m in metrics]
        return torch.stack([loss.detach().float(), *metrics]).to(self._exact)

    def _token_weights(self, micro_batches: list, key: str | None) -> list[torch.Tensor] | None:
        """Weights that make a step's loss the mean over every token of mask `key` in the step (the objective's
        `token_mask`; its `metric_mask` for its metrics).

        Such a micro-batch's loss (SFT's, distillation's on SFT data, GRPO's with grpo.token_mean) is the mean over
        its own masked tokens, whose number varies from one micro-batch to the next. DeepSpeed averages the
        micro-batches' losses (over grad_accum and over ranks), so on its own it would weigh a token by the size of
        the micro-batch it fell into. That would make a step depend on how its samples are split, and a run
        resumed on another number of ranks would not repeat itself. Each weight is (the micro-batch's tokens /
        the step's tokens on every rank) * micro-batches * ranks: one collective per step. None where `key` is None
        (the loss or metrics are no token means: DPO's; GRPO's loss by default, a mean over completions) or the
        batch has no such mask (pretraining, whose every target bears loss)."""
        if key is None or key not in micro_batches[0]:
            return None
        counts = torch.stack([b[key].sum() for b in micro_batches]).to(self._exact)
        total = counts.sum()
        dist.all_reduce(total)
        return list((counts * (len(counts) * self.dist.world_size) / total.clamp(min=1)).float())

    def _step_weights(self, micro_batches: list) -> tuple[list[torch.Tensor] | None, list[torch.Tensor] | None]:
        """The token weights (`_token_weights`) of the step's micro-batches for their losses and for their metrics."""
        weights = self._token_weights(micro_batches, self.objective.token_mask)
        if self.objective.metric_mask == self.objective.token_mask:
            return weights, weights
        return weights, self._token_weights(micro_batches, self.objective.metric_mask)

    def _train_micro(self, batch: dict[str, torch.Tensor], weight: torch.Tensor | None,
                     metric_weight: torch.Tensor | None) -> torch.Tensor:
        """One micro-step: the objective's loss backpropagated as `_micro_loss` makes it, then DeepSpeed's step (an
        optimizer step at the end of each accumulation); returns its logged values (`_micro_values`)."""
        micro = self.objective(self.engine, batch)
        loss = self._micro_loss(micro, weight)
        self.engine.backward(loss)
        self._engine_step()
        self._tokens_since_log += micro.loss_tokens
        return self._micro_values(loss, micro, metric_weight)

    def _engine_step(self) -> None:
        """`engine.step()`. Gradients that overflow with the fp16 loss scale already at its minimum
        (fp16.min_loss_scale) mean the run diverged, and it ends as such (`_stop_diverged`), on every rank (the
        overflow is agreed across ranks): with ZeRO, DeepSpeed's loss scaler raises a bare Exception from the step
        (a traceback from every rank); without, its optimizer skipped that step and every later one, silently."""
        boundary = self.engine.is_gradient_accumulation_boundary()
        scale = loss_scale_of(self.engine) if boundary else None
        if boundary and self._norm_taken_here:
            self._last_grad_norm = grad_norm_before_step(self.engine)
        try:
            self.engine.step()
        except Exception as exc:  # noqa: BLE001 - re-raised unless it is DeepSpeed's at the minimum loss scale
            if not is_loss_scale_at_minimum(exc):
                raise
        else:
            if not overflowed_at_minimum_scale(self.engine, scale):
                return
        self._stop_diverged(self.step + 1, "the gradients overflow even at the minimum fp16 loss scale, "
                            f"{loss_scale_of(self.engine):g} (fp16.min_loss_scale): the weights, gradients or "
                            "activations overflowed")

    def train_step(self) -> tuple[torch.Tensor, StepBatches]:
        """One step: the step source's micro-batches, trained `updates_per_step` times (one optimizer step per
        pass over them). Returns this rank's sums over its micro-steps of the loss and the objective's metrics,
        on the device, and the step's batches (reduce both with `reduce_step`)."""
        self._start_epoch_if_needed()
        batches = self.steps.step_batches(self._draw, self.step)
        self.engine.train()
        sums = None
        weights, metric_weights = self._step_weights(batches.micro_batches)
        for _ in range(self.steps.updates_per_step):
            self._update_loss_scale = loss_scale_of(self.engine)
            for i, batch in enumerate(batches.micro_batches):
                values = self._train_micro(batch, None if weights is None else weights[i],
                                           None if metric_weights is None else metric_weights[i])
                sums = values if sums is None else sums + values
        self._positions_since_log += batches.positions * self.steps.updates_per_step
        self._generated_since_log += batches.generated_tokens
        self._generation_seconds_since_log += batches.generation_seconds
        self.sampler.advance(self.samples_per_step)
        self.step += 1
        self.tokens_seen += self.tokens_per_step
        return sums, batches

    def _refuse_diverged(self, loss: float | torch.Tensor) -> None:
        """End the run, on every rank, at a step whose loss or gradient norm is not a number (`loss`: the reduced
        loss of a logged step, or this rank's sums, then summed over the ranks), before a checkpoint of such weights
        replaces a good one: an infinite gradient makes the weights NaN (clipped by a factor of 0, or through Adam's
        moments) even where the loss was finite. Under fp16 DeepSpeed skips such a step and lowers its loss scale, down
        to its minimum (`_engine_step`)."""
        if loss_scale_of(self.engine) is not None:
            return
        if isinstance(loss, torch.Tensor):
            total = loss[:1].detach().to(self._exact)
            if self.dist.world_size > 1:
                dist.all_reduce(total)
            loss = total.item()
        norm = self._grad_norm()
        for what, value in (("training loss", loss), ("gradient norm", None if norm is None else float(norm))):
            if value is not None and not math.isfinite(value):
                self._stop_diverged(self.step, f"the {what} is {value} (no longer a number: the weights, gradients "
                                    "or activations overflowed)")

    def _grad_norm(self) -> float | None:
        """The gradient norm of the last optimizer step: DeepSpeed's (unscaled), or the one taken before it where
        DeepSpeed keeps none."""
        if not self._norm_taken_here:
            return unscaled_grad_norm(self.engine, self._update_loss_scale)
        return None if self._last_grad_norm is None else float(self._last_grad_norm)

    def _log_step(self, logger: MetricsLogger, lr: float, stats: StepStats | None, val_loss: float | None) -> None:
        """Hand the step to `logger`, with the gradient norm at a logged step only (`stats`): where the trainer keeps
        the norm (fp32 without ZeRO) reading it waits for the device, and every step did."""
        grad_norm = self._grad_norm() if stats is not None else None
        logger.log(self.step, lr, stats, grad_norm, self.sampler.epoch, self.tokens_seen, val_loss)

    def _stop_diverged(self, step: int, what: str) -> NoReturn:
        """End the run on every rank (a collective) with one line: step `step` diverged (`what`), and the newest
        complete checkpoint from before it is the one to resume from with a lower learning rate."""
        newest = rundir.newest_complete_tag(self.run_dir, before_step=step)  # `latest` may be lost
        advice = (f"the newest checkpoint, {newest}, is from before: {rerun_advice()} with a lower train.lr "
                  "(--set train.lr=...), or change what made the run diverge"
                  if newest else "no checkpoint was saved before: lower train.lr, or change what made the run diverge")
        raise_together(f"step {step}: {what}; stopped without saving; {advice}", announce=self.dist.local_rank == 0)

    def reduce_step(self, sums: torch.Tensor, batches: StepBatches) -> StepStats:
        """The step's means over micro-steps and ranks (its step-level metrics: over ranks), with the loss-bearing
        tokens, positions and generated tokens since the last reduction: one collective, and the host waits for
        the device here."""
        self._step_metric_names = sorted(batches.metrics)
        step_metrics = [batches.metrics[k].detach().to(self._exact).reshape(1) for k in self._step_metric_names]
        counters = torch.tensor([self._positions_since_log, self._generated_since_log], dtype=self._exact,
                                device=self.dist.device)
        packed = torch.cat([sums, *step_metrics, self._tokens_since_log, counters])
        dist.all_reduce(packed)
        self._tokens_since_log.zero_()
        world, micro_steps = self.dist.world_size, len(batches.micro_batches) * self.steps.updates_per_step
        n_micro, n_step = len(sums), len(step_metrics)
        totals = packed.tolist()  # the one wait for the device
        micro_means = [v / (micro_steps * world) for v in totals[:n_micro]]
        step_means = [v / world for v in totals[n_micro:n_micro + n_step]]
        loss_tokens, positions, generated = totals[n_micro + n_step:]
        stats = StepStats(micro_means[0], {**dict(zip(self._metric_names, micro_means[1:], strict=True)),
                                           **dict(zip(self._step_metric_names, step_means, strict=True))},
                          int(loss_tokens), int(positions), int(generated), self._generation_seconds_since_log)
        self._positions_since_log = self._generated_since_log = 0
        self._generation_seconds_since_log = 0.0
        return stats

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean loss over the first eval_batches * micro_batch_size * world val samples (same on every call), as the
        training loss is a mean: over the loss-bearing tokens of a token-mean objective (`token_mask`), else over the
        samples (DPO's pairs, whose loss was weighed by their reply tokens: it changed with micro_batch_size)."""
        if self.val_set is None:
            return None
        micro, world = self.cfg.train.micro_batch_size, self.dist.world_size
        per_rank = min(self.cfg.train.eval_batches * micro, len(self.val_set) // world)
        if per_rank == 0:
            return None
        self.engine.eval()
        totals = torch.zeros(2, dtype=self._exact, device=self.dist.device)
        indices = list(range(self.dist.rank, per_rank * world, world))
        for start in range(0, per_rank, micro):
            samples = [self.val_set[i] for i in indices[start:start + micro]]
            batch = {k: torch.stack([s[k] for s in samples]) for k in samples[0]}
            batch = checked_to(self.dist.device, batch, self.cfg.model.vocab_size, self.cfg.data.path, "val")
            result = self.objective(self.engine, batch)
            weight = result.loss_tokens.to(self._exact) if self.objective.token_mask is not None else \
                torch.tensor(float(len(samples)), dtype=self._exact, device=self.dist.device)
            totals += torch.stack([result.loss.float().to(self._exact) * weight, weight])
        dist.all_reduce(totals)
        loss_sum, weight = totals.tolist()
        return loss_sum / weight

    # ---- the run -------------------------------------------------------------------------------

    def _finished(self) -> bool:
        """No step is left: the step budget is spent, or the next step would end past the time budget."""
        return self.nothing_left() is not None

    def nothing_left(self) -> str | None:
        """Why no step is left to train (`_finished`), said for a resume that finds none; None while one is."""
        return nothing_left(self.cfg.train.max_steps, self.budget, self.step)

    def _eval_due(self, last: bool) -> bool:
        t = self.cfg.train
        return last or bool(t.eval_every and self.step % t.eval_every == 0)

    def fit(self, logger: MetricsLogger, checkpointer: checkpoint.Checkpointer, watchdog: Watchdog | None) -> int:
        """Train to the end, or until stopped; the exit code. A data-loader worker that dies (the out-of-memory
        killer's SIGKILL) ends the job with one line, wherever the rank was when torch raised it (`worker_failure`)."""
        try:
            with output_loss_handled(self.preemption.output_lost):  # `| head`: a stop with a checkpoint
                return self._train(logger, checkpointer, watchdog)
        except (WorkerDied, RuntimeError) as exc:
            if (asked := out_of_memory(exc)) is not None:
                raise UserError(self._out_of_memory_said(asked, host=CPU_OUT_OF_MEMORY in str(exc))) from None
            if not worker_failure(exc):
                raise
            dead = self._batches.dead_workers() if self._batches is not None else None
            return self._end_for_data(dead or torch_said(exc) or str(exc).strip(), "a data-loader worker of it died",
                                      logger, watchdog)

    def _out_of_memory_said(self, asked: str, host: bool) -> str:
        """A step (or its evaluation) that ran out of memory, a traceback in every rank before: what to lower.
        `host`: the host refused it (on a GPU too: ZeRO's offload), else the device."""
        t, device = self.cfg.train, self.dist.device
        where = "the host" if host else f"{device.type} device {device.index or 0}"
        rollouts = f"grpo.rollout_batch_size ({self.cfg.grpo.rollout_batch_size}; 0: the micro batch), " \
            if t.stage == "grpo" else ""
        return (f"rank {self.dist.rank} ran out of memory in step {self.step + 1} ({where} refused "
                f"{asked or 'an allocation'}); lower {rollouts}train.micro_batch_size ({t.micro_batch_size}; a "
                f"higher train.grad_accum keeps the samples a step) or data.seq_len ({self.cfg.data.seq_len})")

    def _train(self, logger: MetricsLogger, checkpointer: checkpoint.Checkpointer, watchdog: Watchdog | None) -> int:
        self.preemption.install()
        self.budget.start(self.step)
        last, sums, failed = self._finished(), None, None
        while not last:
            lr = self.engine.get_lr()[0]
            with watchdog.watching(f"step {self.step + 1}") if watchdog else nullcontext(), logger.timed():
                try:
                    sums, batches = self.train_step()
                except NoBatch as stalled:
                    return self._stop_without_batch(stalled, sums, logger, checkpointer, watchdog)
                except StepInputError as failure:  # saved outside the step's watch, as every checkpoint is
                    failed = failure
                    break
                last = self._finished()
                calibrate = self.budget.calibration_due(self.step)  # measure what the final step will cost
                eval_due = self._eval_due(last) or (calibrate and self.budget.eval_seconds is None)
                stats = self.reduce_step(sums, batches) if logger.due(self.step, eval_due) else None
                if stats is not None:
                    self._refuse_diverged(stats.loss)
            with self.budget.overhead("eval" if eval_due else None):
                val_loss = self.evaluate() if eval_due else None
                samples = self.samples.generate(self.step) if eval_due and self.samples else None
            self._log_step(logger, lr, stats, val_loss)
            logger.log_samples(self.step, samples)
            stop = self.preemption.agreed()
            save_due = checkpointer.due(self.step, last or calibrate, stop)
            if save_due and stats is None:
                self._refuse_diverged(sums)
            with self.budget.overhead("save" if save_due else None):
                checkpointer.after_step(self.step, last=last or calibrate, stopped_by_signal=stop)
            if stop or last:
                self.preemption.saved()
            self.budget.end_iteration(self.step, wait=calibrate)
            if not last and self.budget.spent_by_calibration(calibrate, self.step):
                last = True
                self.preemption.saved()
            notes = (self.budget.warmup_note(self.step), self.budget.overrun_note()) if last else ()
            for note in filter(None, notes) if self.dist.is_main else ():
                logger.bar.write(f"{self.cfg.train.stage}: {note}", file=sys.stdout)
            if stop and not last:  # a signal during the last step's evaluation or checkpoint: the run is complete
                if self.dist.is_main:
                    logger.bar.close()
                    lost = self.preemption.output_lost_now  # said where it can be read
                    print(f"stopped {'as its output was lost' if lost else 'by signal'} at step {self.step}; "
                          f"checkpoint saved in {self.run_dir}; {rerun_advice(' to continue')}",
                          file=sys.stderr if lost else sys.stdout, flush=True)
                return EXIT_PREEMPTED
        if failed is not None:
            self._save_then_fail(failed, sums, logger, checkpointer)
        return EXIT_OK

    def _stop_without_batch(self, stalled: NoBatch, sums: torch.Tensor | None, logger: MetricsLogger,
                            checkpointer: checkpoint.Checkpointer, watchdog: Watchdog | None) -> int:
        """A draw that got no batch (`WatchedLoader.next`). A one-rank job asked to stop saves its last complete step:
        nothing of the step it was drawing for was trained, and drawing used no RNG the checkpoint keeps, so a resume
        continues as the run would have. Ranks of a job of several cannot: the others wait inside the step, in
        collectives that need this rank's batch; the job ends on every rank, saying why (`_end_for_data`)."""
        if not stalled.stopped:
            return self._end_for_data(f"{stalled}; the limit is {LIMIT:g} x train.collective_timeout_s="
                                      f"{self.cfg.train.collective_timeout_s:g}",
                                      f"its data loader gave no batch for step {stalled.step} in "
                                      f"{stalled.waited:.0f} s", logger, watchdog)
        if self.dist.world_size > 1:
            return self._end_for_data(f"asked to stop while waiting {stalled.waited:.0f} s for step {stalled.step}'s "
                                      f"data: {stalled.loader}; the other ranks cannot end the step without it, so "
                                      "no checkpoint was saved",
                                      f"asked to stop, its data loader gave no batch for step {stalled.step}: no "
                                      "checkpoint was saved", logger, watchdog)
        saved, tag = self._save_last_complete_step(sums, checkpointer, stopped_by_signal=True)
        self.preemption.saved()
        if self.dist.is_main:
            logger.bar.close()
            where = (f"checkpoint saved in {self.run_dir}" if saved else
                     f"checkpoint {tag} is in {self.run_dir}" if self.step else "nothing was trained, nothing saved")
            print(f"stopped by signal at step {self.step} while waiting for step {stalled.step}'s data: "
                  f"{stalled.loader}; {where}; {rerun_advice(' to continue')}", flush=True)
        return EXIT_PREEMPTED

    def _save_last_complete_step(self, sums: torch.Tensor | None, checkpointer: checkpoint.Checkpointer,
                                 stopped_by_signal: bool) -> tuple[bool, str]:
        """Save the last complete step, unless none was trained or a complete checkpoint of it exists (where the job
        resumed from it: not saved over), its loss checked first where it was not logged (`sums`); (whether it was
        saved, its tag). Every rank does as rank 0 finds: a shared file system that lags could show another rank
        an older state, and the ranks' collectives would part."""
        tag = rundir.tag_for(self.step)
        saved = [self.step > 0 and rundir.incompleteness(self.run_dir, tag) is not None]
        if self.dist.world_size > 1:
            dist.broadcast_object_list(saved, src=0)
        if saved[0]:
            if sums is not None:
                self._refuse_diverged(sums)
            checkpointer.after_step(self.step, last=True, stopped_by_signal=stopped_by_signal)
        return saved[0], tag

    def _save_then_fail(self, failed: StepInputError, sums: torch.Tensor | None, logger: MetricsLogger,
                        checkpointer: checkpoint.Checkpointer) -> NoReturn:
        """A step whose inputs failed on every rank (`StepInputError`: a reward that raised) trained nothing, so the
        run is still at its last complete step, RNGs included (the step source put them back): saved, so that a
        resume once the cause is fixed continues from it as the run would have (GRPO's rollouts are seeded by their
        step), the steps since the last checkpoint kept. Then the error, with where that step is, on every rank."""
        try:
            saved, tag = self._save_last_complete_step(sums, checkpointer, stopped_by_signal=False)
        except UserError as exc:  # the save failed too (out of room): both said
            raise_together(f"{failed}; saving step {self.step} failed too: {exc}", announce=self.dist.local_rank == 0)
        if self.dist.is_main:
            logger.bar.close()
        where = (f"step {self.step} is saved in {self.run_dir}" if saved else
                 f"checkpoint {tag} is in {self.run_dir}" if self.step else "nothing was trained, nothing saved")
        raise_together(f"{failed}; {where}" + (f"; {rerun_advice(' once it is corrected')}" if self.step else ""),
                       announce=self.dist.local_rank == 0)

    def _end_for_data(self, message: str, brief: str, logger: MetricsLogger, watchdog: Watchdog | None) -> int:
        """End the job on every rank over this rank's data loader, with one line naming the rank and `message`. One
        rank returns EXIT_RANK_LOST. Of several, the watchdog ends them all (it never returns), and the rank of each
        node that says its news says `brief`; this rank says `message` itself unless it is that rank: the
        watchdog's heartbeat can end the rank that asked it to end the job before its line, and the launcher then
        stops the others before they say it."""
        said = f"rank {self.dist.rank}: {message}"
        if watchdog is not None:
            if not watchdog.announce:
                report(said)
            watchdog.end_job(brief if not watchdog.announce else message)
        logger.bar.close()
        newest = rundir.newest_complete_tag(self.run_dir)
        report(f"{said}; " + (rerun_advice(f" to continue from {newest}") if newest else
                              "no checkpoint was saved"))
        return EXIT_RANK_LOST
