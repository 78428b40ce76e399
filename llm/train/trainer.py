"""The training loop, one for every stage: the story of a step.

draw micro-batches -> objective -> engine.backward / engine.step (DeepSpeed accumulates, clips,
steps the optimizer and the schedule) -> advance the sampler -> log -> evaluate -> checkpoint.
SIGTERM or SIGINT on any rank makes every rank save a checkpoint and exit with `EXIT_PREEMPTED`.
"""

from __future__ import annotations

import json
import random
import shutil
import signal
import sys
import time
import traceback
import uuid
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from tqdm import tqdm

from launch.fingerprint import check_ranks_agree, fingerprint
from launch.supervisor import watch_supervisor
from launch.watchdog import Watchdog
from llm.config import ModelConfig, RunConfig
from llm.data.datasets import DATASETS, read_data_attrs, tokenizer_dir_of
from llm.data.prepare import TOKENS_FILE
from llm.data.sampler import ResumableDistributedSampler
from llm.errors import UserError
from llm.model import Transformer
from llm.train import checkpoint
from llm.train.engine import DistInfo, build_engine, load_ds_config, resolve_ds_config, setup_distributed
from llm.train.metrics import MetricsSink, flops_per_token, peak_flops_per_rank, peak_memory_mb
from llm.train.objectives import DPOObjective, MicroStep, causal_lm
from llm.train.schedule import lr_multiplier

EXIT_PREEMPTED = 75
"""Exit code after a SIGTERM/SIGINT: a checkpoint was saved; rerun with --resume auto."""

CONFIG_FILE, DS_CONFIG_FILE, TOKENIZER_DIR = "config.yaml", "ds_config.json", "tokenizer"


def seed_rank_rngs(seed: int, rank: int) -> None:
    """Seed python, numpy and torch from (run seed, rank)."""
    derived = int(np.random.SeedSequence([seed, rank]).generate_state(1)[0])
    random.seed(derived)
    np.random.seed(derived)
    torch.manual_seed(derived)


SHAPE_FIELDS = ("vocab_size", "dim", "n_layers", "n_heads", "kv_heads", "ffn_hidden_dim", "tie_embeddings", "moe",
                "n_experts", "n_shared_experts")


def initial_weights(cfg: ModelConfig, init_from: str, data_tokenizer_hash: str) -> dict[str, torch.Tensor]:
    """Weights of a run or export directory, refused when its shape or tokenizer differs from this run's."""
    from llm.export import load_model_dir
    from llm.tokenizer import TOKENIZER_FILE, Tokenizer

    source, tokenizer_dir = load_model_dir(init_from)
    differing = [f"model.{f} {getattr(source.cfg, f)} there, {getattr(cfg, f)} here" for f in SHAPE_FIELDS
                 if getattr(source.cfg, f) != getattr(cfg, f)]
    if differing:
        raise UserError(f"--init-from {init_from}: the model differs from this run's config ({'; '.join(differing)})")
    if (tokenizer_dir / TOKENIZER_FILE).is_file() and Tokenizer.load(tokenizer_dir).hash != data_tokenizer_hash:
        raise UserError(f"--init-from {init_from}: its tokenizer differs from the one the data was prepared with; "
                        f"prepare the data with {tokenizer_dir}")
    return source.state_dict()


def reference_engine(cfg: ModelConfig, weights: dict[str, torch.Tensor], ds_config: dict):
    """The frozen DPO reference as an inference-only DeepSpeed engine: partitioned like the policy under
    ZeRO-3, replicated (stage 0) otherwise."""
    import deepspeed

    model = Transformer(cfg)
    model.load_state_dict(weights)
    model.requires_grad_(False)
    config = {k: v for k, v in ds_config.items() if k not in ("optimizer", "scheduler")}
    if ds_config.get("zero_optimization", {}).get("stage", 0) != 3:
        config["zero_optimization"] = {"stage": 0}
    engine = deepspeed.initialize(model=model, config=config)[0]
    engine.eval()
    return engine


class Trainer:
    def __init__(self, cfg: RunConfig, run_dir: Path, dist_info: DistInfo, ds_config: dict, data_attrs: dict) -> None:
        self.cfg, self.run_dir, self.dist = cfg, run_dir, dist_info
        t = cfg.train
        dataset = DATASETS[t.stage]
        self.train_set = dataset(cfg.data.path, "train", cfg.data.seq_len, data_attrs["pad_id"])
        self.val_set = dataset(cfg.data.path, "val", cfg.data.seq_len, data_attrs["pad_id"])
        self.global_batch = t.micro_batch_size * t.grad_accum * dist_info.world_size
        if len(self.train_set) < self.global_batch:
            raise UserError(f"{cfg.data.path}: the train split has {len(self.train_set)} samples of data.seq_len "
                            f"positions, fewer than one global batch ({self.global_batch}); add data or lower "
                            "train.micro_batch_size / data.seq_len")
        self.sampler = ResumableDistributedSampler(len(self.train_set), dist_info.world_size, dist_info.rank, seed=t.seed)
        torch.manual_seed(t.seed)  # identical initial weights on every rank
        model = Transformer(cfg.model)
        weights = initial_weights(cfg.model, t.init_from, data_attrs["tokenizer_hash"]) if t.init_from else None
        if weights is not None:
            model.load_state_dict(weights)
        self.n_params = model.num_parameters()
        seed_rank_rngs(t.seed, dist_info.rank)  # then per-rank streams (dropout, sampling)
        self.engine = build_engine(model, cfg, ds_config, lambda step: lr_multiplier(step, t))
        if t.stage == "dpo":
            self.objective = DPOObjective(reference_engine(cfg.model, weights, ds_config), t.dpo_beta, t.dpo_loss,
                                          t.dpo_sft_weight)
        else:
            self.objective = causal_lm
        self.step = 0
        self.run_id = uuid.uuid4().hex[:12]
        self._batches = None
        self._stop_requested = False

    # ---- state ---------------------------------------------------------------------------------

    def resume(self, tag: str, universal: bool) -> None:
        state = checkpoint.load(self.engine, self.run_dir, tag, universal)
        self.step, self.run_id = state["step"], state["run_id"]
        self.sampler.load_state_dict(state["sampler"])

    def save(self, stopped_by_signal: bool = False) -> None:
        state = {"step": self.step, "run_id": self.run_id, "world_size": self.dist.world_size,
                 "sampler": self.sampler.state_dict(), "stopped_by_signal": stopped_by_signal}
        checkpoint.save(self.engine, self.run_dir, self.step, state, keep=self.cfg.train.keep_checkpoints)

    # ---- data ----------------------------------------------------------------------------------

    def _next_micro_batch(self) -> dict[str, torch.Tensor]:
        if self._batches is None:
            loader = DataLoader(self.train_set, batch_size=self.cfg.train.micro_batch_size, sampler=self.sampler,
                                num_workers=self.cfg.data.loader_workers)
            self._batches = iter(loader)
        return {k: v.to(self.dist.device) for k, v in next(self._batches).items()}

    def _start_epoch_if_needed(self) -> None:
        """An epoch ends when less than one global batch remains (that tail is not trained on)."""
        if self.sampler.num_samples - self.sampler.consumed < self.global_batch:
            self.sampler.set_epoch(self.sampler.epoch + 1)
            self._batches = None

    # ---- one step ------------------------------------------------------------------------------

    def train_step(self) -> tuple[float, int, dict[str, float]]:
        """One optimizer step over grad_accum micro-batches; returns the loss and the objective's metrics
        (means over micro-batches and ranks) and the loss-bearing tokens (sum)."""
        self._start_epoch_if_needed()
        self.engine.train()
        micros: list[MicroStep] = []
        for _ in range(self.cfg.train.grad_accum):
            micro = self.objective(self.engine, self._next_micro_batch())
            self.engine.backward(micro.loss)
            self.engine.step()
            micros.append(micro)
        self.sampler.advance(self.global_batch)
        self.step += 1
        names = sorted(micros[0].metrics)
        totals = torch.tensor([[m.loss.detach().float().item(), *(m.metrics[k] for k in names)] for m in micros],
                              dtype=torch.float64).sum(0)
        tokens = torch.tensor([sum(m.loss_tokens for m in micros)], dtype=torch.float64)
        dist.all_reduce(totals)
        dist.all_reduce(tokens)
        means = (totals / (len(micros) * self.dist.world_size)).tolist()
        return means[0], int(tokens.item()), dict(zip(names, means[1:]))

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean loss over the first eval_batches * micro_batch_size * world val windows (same on every call)."""
        micro, world = self.cfg.train.micro_batch_size, self.dist.world_size
        per_rank = min(self.cfg.train.eval_batches * micro, len(self.val_set) // world)
        if per_rank == 0:
            return None
        self.engine.eval()
        totals = torch.zeros(2, dtype=torch.float64)
        indices = list(range(self.dist.rank, per_rank * world, world))
        for start in range(0, per_rank, micro):
            samples = [self.val_set[i] for i in indices[start:start + micro]]
            batch = {k: torch.stack([s[k] for s in samples]).to(self.dist.device) for k in samples[0]}
            result = self.objective(self.engine, batch)
            totals += torch.tensor([result.loss.float().item() * result.loss_tokens, result.loss_tokens],
                                   dtype=torch.float64)
        dist.all_reduce(totals)
        return totals[0].item() / totals[1].item()

    def _stop_agreed(self) -> bool:
        """True on every rank as soon as any rank got SIGTERM/SIGINT."""
        flag = torch.tensor([1 if self._stop_requested else 0])
        if self.dist.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _request_stop(self, signum, frame) -> None:
        self._stop_requested = True

    def _supervisor_lost(self, reason: str) -> None:
        print(f"rank {self.dist.rank}: {reason}; saving a checkpoint and stopping", flush=True)
        self._stop_requested = True

    # ---- the run -------------------------------------------------------------------------------

    def fit(self, sink: MetricsSink | None, watchdog: Watchdog | None = None) -> int:
        t, seq_len = self.cfg.train, self.cfg.data.seq_len
        signal.signal(signal.SIGTERM, self._request_stop)
        signal.signal(signal.SIGINT, self._request_stop)
        watch_supervisor(self._supervisor_lost)
        flops = flops_per_token(self.cfg.model, self.n_params, seq_len)
        dtype = torch.bfloat16 if t.precision == "bf16" else torch.float32
        peak = peak_flops_per_rank(self.dist.device, t.peak_tflops, dtype) * self.dist.world_size
        tokens_per_step = self.global_batch * seq_len
        interactive = sys.stdout.isatty()  # a bar on a terminal, plain lines in a log file
        bar = tqdm(total=t.max_steps, initial=self.step, desc=t.stage, unit="step", dynamic_ncols=True,
                   disable=not (self.dist.is_main and interactive), file=sys.stdout)
        while self.step < t.max_steps:
            lr = self.engine.get_lr()[0]
            if watchdog is not None:
                watchdog.busy(f"step {self.step + 1}")
            start = time.perf_counter()
            loss, loss_tokens, stage_metrics = self.train_step()
            if watchdog is not None:
                watchdog.idle()  # evaluation and checkpoints may take longer; collective timeouts still bound them
            elapsed = time.perf_counter() - start
            grad_norm = self.engine.get_global_grad_norm()
            row = {"step": self.step, "loss": loss, "lr": lr,
                   "grad_norm": None if grad_norm is None else float(grad_norm),
                   "tokens_per_sec": tokens_per_step / elapsed, "loss_tokens_per_sec": loss_tokens / elapsed,
                   "mfu": flops * tokens_per_step / elapsed / peak, "peak_mem_mb": peak_memory_mb(self.dist.device),
                   "epoch": self.sampler.epoch, **stage_metrics}
            last = self.step == t.max_steps
            eval_now = (t.eval_every and self.step % t.eval_every == 0) or last
            if eval_now:
                row["val_loss"] = self.evaluate()
            status = {"loss": f"{loss:.4f}", "lr": f"{lr:.2e}", "tok/s": f"{row['tokens_per_sec']:.0f}"}
            if row.get("val_loss") is not None:
                status["val_loss"] = f"{row['val_loss']:.4f}"
            if sink is not None and (self.step % t.log_every == 0 or eval_now):
                sink.log(row)
                if not interactive:
                    print(f"step {self.step}/{t.max_steps} " + " ".join(f"{k} {v}" for k, v in status.items()), flush=True)
            bar.update(1)
            bar.set_postfix(status)
            stop = self._stop_agreed()
            if stop or last or (t.save_every and self.step % t.save_every == 0):
                self.save(stopped_by_signal=stop)
            if stop:
                bar.close()
                if self.dist.is_main:
                    print(f"stopped by signal at step {self.step}; checkpoint saved in {self.run_dir}; "
                          f"rerun with --resume auto to continue", flush=True)
                return EXIT_PREEMPTED
        bar.close()
        return 0


def check_tokenizer(run_dir: Path, data_dir: Path, data_hash: str) -> None:
    """Refuse data tokenized with another tokenizer than the one this run directory already keeps."""
    from llm.tokenizer import Tokenizer

    kept = run_dir / TOKENIZER_DIR
    if kept.is_dir() and (kept_hash := Tokenizer.load(kept).hash) != data_hash:
        raise UserError(f"{data_dir} was tokenized with another tokenizer (hash {data_hash}) than this run's "
                        f"{kept} (hash {kept_hash}); prepare the data with {kept}")


def keep_tokenizer(run_dir: Path, data_dir: Path) -> None:
    """Copy the data's tokenizer into the run directory, so the run is self-contained."""
    source, kept = tokenizer_dir_of(data_dir), run_dir / TOKENIZER_DIR
    if source.is_dir() and not kept.is_dir():
        shutil.copytree(source, kept)


def convert_if_resharded(run_dir: Path, tag: str, info: DistInfo) -> bool:
    """Whether resuming `tag` needs a universal checkpoint (its optimizer state is partitioned over another number
    of ranks than this job's); if so, rank 0 makes it while the others wait at a barrier (bounded by
    train.collective_timeout_s)."""
    saved_world = checkpoint.client_state_of(run_dir, tag)["world_size"]
    if saved_world == info.world_size or not checkpoint.is_partitioned(run_dir, tag):
        return False
    if info.is_main:
        print(f"{tag} was saved by {saved_world} rank(s), this job has {info.world_size}: converting it to a "
              "universal checkpoint", flush=True)
        checkpoint.convert_to_universal(run_dir, tag)
    dist.barrier()
    return True


def run(cfg: RunConfig, run_dir: Path, ds_config_path: str | None, resume: bool, zero_stage: int | None = None) -> int:
    """Train `cfg` into `run_dir` under DeepSpeed; returns the process exit code. In a multi-rank job, a rank
    that fails, dies or hangs ends the job on every rank (see `launch.watchdog`)."""
    if not cfg.data.path:
        raise UserError("no training data: pass --data DIR (a directory made by `zerollm data prepare`)")
    attrs = read_data_attrs(cfg.data.path, cfg.train.stage)
    if attrs["vocab_size"] > cfg.model.vocab_size:
        raise UserError(f"{cfg.data.path}: tokenizer has {attrs['vocab_size']} tokens but model.vocab_size is "
                        f"{cfg.model.vocab_size}; set model.vocab_size >= {attrs['vocab_size']}")
    check_tokenizer(run_dir, Path(cfg.data.path), attrs["tokenizer_hash"])
    raw_ds, ds_source = load_ds_config(ds_config_path, cfg.train.stage)
    if not resume and checkpoint.latest_tag(run_dir) is not None:
        raise UserError(f"{run_dir} already holds checkpoints; pass --resume auto to continue it, or choose another --out")
    info = setup_distributed(cfg.train.collective_timeout_s)
    ds_config = resolve_ds_config(raw_ds, cfg, info.world_size, ds_source, zero_stage)
    watchdog = None
    if info.world_size > 1:
        watchdog = Watchdog(info.rank, info.world_size, cfg.train.collective_timeout_s, announce=info.local_rank == 0)
    try:
        code = _run_job(cfg, run_dir, info, ds_config, attrs, resume, watchdog)
    except UserError:
        raise
    except Exception as exc:
        if watchdog is None:
            raise
        traceback.print_exc()
        watchdog.end_job(watchdog.diagnose() or f"failed with {type(exc).__name__}: {exc}")
    if watchdog is not None:
        watchdog.stop()
    dist.barrier()  # every rank is done writing; the caller ends the process (see `llm.cli.cmd_train`)
    return code


def _run_job(cfg: RunConfig, run_dir: Path, info: DistInfo, ds_config: dict, attrs: dict, resume: bool,
             watchdog: Watchdog | None) -> int:
    if info.world_size > 1:
        check_ranks_agree(fingerprint(cfg.to_dict(), ds_config, Path(cfg.data.path) / TOKENS_FILE,
                                      attrs["tokenizer_hash"]), announce=info.local_rank == 0)
    tag = checkpoint.latest_tag(run_dir) if resume else None
    universal = tag is not None and convert_if_resharded(run_dir, tag, info)
    engine_config = {**ds_config, "checkpoint": {**ds_config.get("checkpoint", {}), "load_universal": True}} \
        if universal else ds_config
    trainer = Trainer(cfg, run_dir, info, engine_config, attrs)
    if tag is not None:
        trainer.resume(tag, universal)
        if universal:
            dist.barrier()
            if info.is_main:
                shutil.rmtree(checkpoint.universal_dir(run_dir))
    if info.is_main:  # written once the run is known to start (a refused resume leaves the directory as it was)
        run_dir.mkdir(parents=True, exist_ok=True)
        keep_tokenizer(run_dir, Path(cfg.data.path))
        cfg.save(run_dir / CONFIG_FILE)
        (run_dir / DS_CONFIG_FILE).write_text(json.dumps(ds_config, indent=2))
        print(f"{cfg.train.stage}: {trainer.n_params / 1e6:.3f} M parameters, {info.world_size} rank(s), "
              f"ZeRO stage {ds_config.get('zero_optimization', {}).get('stage', 0)}, {cfg.train.precision}, "
              f"{len(trainer.train_set):,} train samples"
              + (f" ({100 * trainer.train_set.padding_fraction:.1f} % padding)" if cfg.train.stage == "sft" else "")
              + (f", resumed at step {trainer.step}" if tag is not None else ""), flush=True)
    sink = MetricsSink(run_dir, cfg, trainer.run_id, trainer.step) if info.is_main else None
    try:
        return trainer.fit(sink, watchdog)
    finally:
        if sink is not None:
            sink.close()
