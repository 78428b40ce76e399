"""The training loop, one for every stage: the story of a step.

    draw grad_accum micro-batches -> objective -> engine.backward / engine.step (DeepSpeed accumulates, clips,
    steps the optimizer and the schedule) -> advance the sampler -> evaluate (and write samples) when due ->
    log when due -> agree on stopping -> checkpoint when due -> publish the time budget's clock

The run ends after train.max_steps steps or, with a time budget, before a step that would end past it
(`llm.train.time_budget`), whichever comes first; the last step is evaluated and saved.

Nothing in a step waits for the device: losses and the objective's metrics stay on it and are reduced
across ranks once per logged step. Evaluation, logging, checkpoints and the stop vote are the only points
where the host waits. Starting a job (config, engines, resume) is `llm.train.job`.
"""

from __future__ import annotations

import uuid
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from llm.config import RunConfig
from llm.data.sampler import ResumableDistributedSampler
from llm.errors import EXIT_OK, EXIT_PREEMPTED, UserError
from llm.runtime.distributed import DistInfo
from llm.runtime.preemption import Preemption
from llm.runtime.watchdog import Watchdog
from llm.train import checkpoint
from llm.train.engine import loss_scale_of
from llm.train.metrics import MetricsLogger, StepStats
from llm.train.objectives import MicroStep
from llm.train.samples import SampleGenerator
from llm.train.time_budget import TimeBudget


class Trainer:
    def __init__(self, cfg: RunConfig, run_dir: Path, info: DistInfo, engine, objective, train_set: Dataset,
                 val_set: Dataset, n_params: int, budget: TimeBudget | None = None,
                 samples: SampleGenerator | None = None) -> None:
        """`engine`: the DeepSpeed engine of the model being trained; `objective(engine, batch) -> MicroStep`;
        `n_params`: the model's parameter count (for throughput in FLOPs); `budget`: the time budget the schedule
        reads (None: train.max_steps only); `samples`: what generates samples at each evaluation (None: none)."""
        self.cfg, self.run_dir, self.dist = cfg, run_dir, info
        self.engine, self.objective, self.n_params = engine, objective, n_params
        self.train_set, self.val_set = train_set, val_set
        t = cfg.train
        self.global_batch = t.micro_batch_size * t.grad_accum * info.world_size
        if len(train_set) < self.global_batch:
            raise UserError(f"{cfg.data.path}: the train split has {len(train_set)} samples of data.seq_len "
                            f"positions, fewer than one global batch ({self.global_batch}); add data or lower "
                            "train.micro_batch_size / data.seq_len")
        self.sampler = ResumableDistributedSampler(len(train_set), info.world_size, info.rank, seed=t.seed)
        self.preemption = Preemption(info)
        self.budget = budget or TimeBudget(t, info)
        self.samples = samples
        self.step = 0
        self.run_id = uuid.uuid4().hex[:12]
        self._batches = None
        self._metric_names: list[str] = []
        self._tokens_since_log = torch.zeros(1, dtype=torch.float64, device=info.device)

    # ---- state ---------------------------------------------------------------------------------

    def resume(self, tag: str, universal: bool) -> None:
        state = checkpoint.load(self.engine, self.run_dir, tag, universal)
        self.step, self.run_id = state["step"], state["run_id"]
        try:
            self.sampler.load_state_dict(state["sampler"])
        except ValueError as exc:
            error = UserError(f"{self.run_dir}: {tag} does not fit the data in {self.cfg.data.path} ({exc}); resume "
                              "with the data and train.seed it was trained on, or start a new run with --init-from "
                              f"{self.run_dir}")
            error.announce = self.dist.is_main  # every rank raises it
            raise error from None
        if state.get("loss_scale") is not None:  # fp16: continue with the scale the run had reached, exactly
            self.engine.optimizer.cur_scale = state["loss_scale"]
        self.budget.load_state_dict(state.get("time_budget"))

    def client_state(self, stopped_by_signal: bool) -> dict[str, Any]:
        return {"step": self.step, "run_id": self.run_id, "world_size": self.dist.world_size,
                "sampler": self.sampler.state_dict(), "stopped_by_signal": stopped_by_signal,
                "loss_scale": loss_scale_of(self.engine), "time_budget": self.budget.state_dict()}

    # ---- data ----------------------------------------------------------------------------------

    def _next_micro_batch(self) -> dict[str, torch.Tensor]:
        if self._batches is None:
            on_gpu = self.dist.device.type == "cuda"
            workers = self.cfg.data.loader_workers
            loader = DataLoader(self.train_set, batch_size=self.cfg.train.micro_batch_size, sampler=self.sampler,
                                num_workers=(2 if on_gpu else 0) if workers is None else workers, pin_memory=on_gpu)
            self._batches = iter(loader)
        return {k: v.to(self.dist.device, non_blocking=True) for k, v in next(self._batches).items()}

    def _start_epoch_if_needed(self) -> None:
        """An epoch ends when less than one global batch remains (that tail is not trained on)."""
        if self.sampler.num_samples - self.sampler.consumed < self.global_batch:
            self.sampler.set_epoch(self.sampler.epoch + 1)
            self._batches = None

    # ---- one step ------------------------------------------------------------------------------

    def _micro_values(self, micro: MicroStep) -> torch.Tensor:
        """The micro-batch's loss and metrics as one float64 vector on the device."""
        self._metric_names = sorted(micro.metrics)
        return torch.stack([micro.loss.detach().float(),
                            *(micro.metrics[k].float() for k in self._metric_names)]).double()

    def train_step(self) -> torch.Tensor:
        """One optimizer step over grad_accum micro-batches. Returns this rank's sums over its micro-batches of
        the loss and the objective's metrics, on the device (reduce them with `reduce_step`)."""
        self._start_epoch_if_needed()
        self.engine.train()
        sums = None
        for _ in range(self.cfg.train.grad_accum):
            micro = self.objective(self.engine, self._next_micro_batch())
            self.engine.backward(micro.loss)
            self.engine.step()
            values = self._micro_values(micro)
            sums = values if sums is None else sums + values
            self._tokens_since_log += micro.loss_tokens
        self.sampler.advance(self.global_batch)
        self.step += 1
        return sums

    def reduce_step(self, sums: torch.Tensor) -> StepStats:
        """The step's means over micro-batches and ranks, with the loss-bearing tokens since the last reduction:
        one collective, and the host waits for the device here."""
        packed = torch.cat([sums, self._tokens_since_log])
        dist.all_reduce(packed)
        self._tokens_since_log.zero_()
        *values, tokens = packed.tolist()
        n = self.cfg.train.grad_accum * self.dist.world_size
        return StepStats(values[0] / n, {k: v / n for k, v in zip(self._metric_names, values[1:])}, int(tokens))

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean loss over the first eval_batches * micro_batch_size * world val windows (same on every call)."""
        micro, world = self.cfg.train.micro_batch_size, self.dist.world_size
        per_rank = min(self.cfg.train.eval_batches * micro, len(self.val_set) // world)
        if per_rank == 0:
            return None
        self.engine.eval()
        totals = torch.zeros(2, dtype=torch.float64, device=self.dist.device)
        indices = list(range(self.dist.rank, per_rank * world, world))
        for start in range(0, per_rank, micro):
            samples = [self.val_set[i] for i in indices[start:start + micro]]
            batch = {k: torch.stack([s[k] for s in samples]).to(self.dist.device, non_blocking=True)
                     for k in samples[0]}
            result = self.objective(self.engine, batch)
            tokens = result.loss_tokens.double()
            totals += torch.stack([result.loss.float().double() * tokens, tokens])
        dist.all_reduce(totals)
        loss_sum, tokens = totals.tolist()
        return loss_sum / tokens

    # ---- the run -------------------------------------------------------------------------------

    def _finished(self) -> bool:
        """No step is left: the step budget is spent, or the next step would end past the time budget."""
        return self.step >= self.cfg.train.max_steps or self.budget.out_of_time(self.step)

    def _eval_due(self, last: bool) -> bool:
        t = self.cfg.train
        return last or bool(t.eval_every and self.step % t.eval_every == 0)

    def fit(self, logger: MetricsLogger, checkpointer: checkpoint.Checkpointer, watchdog: Watchdog | None) -> int:
        self.preemption.install()
        self.budget.start(self.step)
        last = self._finished()
        while not last:
            lr = self.engine.get_lr()[0]
            with watchdog.watching(f"step {self.step + 1}") if watchdog else nullcontext(), logger.timed():
                sums = self.train_step()
                last = self._finished()
                calibrate = self.budget.calibration_due(self.step)  # measure what the final step will cost
                eval_due = self._eval_due(last) or calibrate
                stats = self.reduce_step(sums) if logger.due(self.step, eval_due) else None
            with self.budget.overhead("eval" if eval_due else None):
                val_loss = self.evaluate() if eval_due else None
                samples = self.samples.generate(self.step) if eval_due and self.samples else None
            logger.log(self.step, lr, stats, self.engine.get_global_grad_norm(), self.sampler.epoch, val_loss)
            logger.log_samples(self.step, samples)
            stop = self.preemption.agreed()
            save_due = checkpointer.due(self.step, last or calibrate, stop)
            with self.budget.overhead("save" if save_due else None):
                checkpointer.after_step(self.step, last=last or calibrate, stopped_by_signal=stop)
            self.budget.end_iteration(self.step)
            if stop:
                if self.dist.is_main:
                    logger.bar.close()
                    print(f"stopped by signal at step {self.step}; checkpoint saved in {self.run_dir}; "
                          f"rerun with --resume auto to continue", flush=True)
                return EXIT_PREEMPTED
        return EXIT_OK
