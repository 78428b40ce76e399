"""Precision: 'auto' per device, fp16 with dynamic loss scaling on GPUs without bf16, refused where it cannot run,
and the loss scale carried through checkpoints."""

from __future__ import annotations

import json
import re
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
from forked_ranks import run_job
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from conftest import train_args
from llm import rundir
from llm.config import ModelConfig, build_config
from llm.errors import EXIT_OK, EXIT_PREEMPTED, UserError
from llm.model import Transformer
from llm.runtime.distributed import DistInfo
from llm.runtime.rank_env import free_port
from llm.train import checkpoint, metrics
from llm.train import engine as engine_module
from llm.train.ds_config_file import load_ds_config
from llm.train.engine import loss_scale_of, resolve_ds_config, resolve_precision
from llm.train.objectives import MicroStep
from llm.train.steps import DataSteps
from llm.train.trainer import Trainer

CPU = torch.device("cpu")
GPU = torch.device("cuda", 0)


@pytest.mark.parametrize("native_bf16, expected", [(True, "bf16"), (False, "fp32")])
def test_auto_on_the_cpu_is_bf16_only_where_it_multiplies_bf16_in_hardware(monkeypatch, native_bf16, expected):
    monkeypatch.setattr(engine_module, "cpu_has_native_bf16", lambda: native_bf16)
    assert resolve_precision("auto", CPU) == expected
    assert resolve_precision("bf16", CPU) == "bf16"  # asked for: slow without hardware support, but it runs


def test_fp32_runs_on_the_cpu_and_fp16_is_refused_there():
    assert resolve_precision("fp32", CPU) == "fp32"
    with pytest.raises(UserError, match="fp16 needs a CUDA GPU"):
        resolve_precision("fp16", CPU)


def _gpu_bf16(monkeypatch, native: bool, emulated: bool) -> None:
    """torch.cuda.is_bf16_supported as torch answers it on a GPU: yes where bf16 tensors can be made at all (a T4, a
    V100: emulated), unless asked about native support (including_emulation=False)."""
    monkeypatch.setattr(engine_module.torch.cuda, "is_bf16_supported",
                        lambda including_emulation=True: native or (including_emulation and emulated))


@pytest.mark.parametrize("native, emulated, expected", [(True, True, "bf16"), (False, True, "fp16"),
                                                         (False, False, "fp16")])
def test_auto_on_a_gpu_is_bf16_only_where_it_has_it_natively(monkeypatch, native, emulated, expected):
    """A T4 or V100 (bf16 emulated: torch's is_bf16_supported() says yes) trained and served in bf16, at a fraction
    of fp16's speed; it takes fp16 with loss scaling, as documented."""
    from llm.devices import resolve

    _gpu_bf16(monkeypatch, native, emulated)
    assert resolve_precision("auto", GPU) == expected
    monkeypatch.setattr(engine_module.torch.cuda, "is_available", lambda: True)
    assert resolve("auto", "auto") == (torch.device("cuda"), {"bf16": torch.bfloat16, "fp16": torch.float16}[expected])


def test_bf16_on_a_gpu_without_it_is_refused_naming_the_gpu(monkeypatch):
    cuda = engine_module.torch.cuda
    _gpu_bf16(monkeypatch, native=False, emulated=True)
    monkeypatch.setattr(cuda, "get_device_capability", lambda device=None: (7, 5))
    monkeypatch.setattr(cuda, "get_device_name", lambda device=None: "Tesla T4")
    with pytest.raises(UserError, match=r"Tesla T4 \(sm_75\) has no bf16; use fp16"):
        resolve_precision("bf16", GPU)


def test_fp16_resolves_to_dynamic_loss_scaling():
    cfg = build_config("demo", ["train.precision=fp16"])
    raw, source = load_ds_config(None, "pretrain")
    ds = resolve_ds_config(raw, cfg, world_size=1, source=source)
    assert ds["fp16"] == {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                          "hysteresis": 2, "min_loss_scale": 1}
    assert ds["bf16"]["enabled"] is False


def test_fp16_in_the_json_against_a_bf16_run_names_both(tmp_path):
    path = tmp_path / "ds.json"
    raw, _ = load_ds_config(None, "pretrain")
    path.write_text(json.dumps({**raw, "fp16": {"enabled": True}}))
    message = ("'fp16.enabled' is true but this run trains in bf16 (train.precision, auto made concrete for this "
               "device); set 'fp16.enabled' to \"auto\", or train.precision=fp16 where the device has it")
    with pytest.raises(UserError, match=f"{re.escape(message)}$"):
        resolve_ds_config(*load_ds_config(path, "pretrain")[:1], build_config("demo", ["train.precision=bf16"]),
                          world_size=1, source=str(path))


def test_fp16_training_on_the_cpu_is_one_clear_error_and_writes_nothing(pretrain_data, tmp_path):
    run = tmp_path / "run"
    result = run_job(*train_args(pretrain_data, run, "train.max_steps=1", "train.precision=fp16"))
    assert result.returncode == 2, result.stderr[-2000:]
    assert "fp16 needs a CUDA GPU" in result.stderr and "Traceback" not in result.stderr
    assert not (run / "config.yaml").exists()


DYNAMIC_ARGS = {"init_scale": 2.0 ** 16, "scale_window": 1000, "delayed_shift": 2, "consecutive_hysteresis": False,
                "min_scale": 1}
"""DeepSpeed's dynamic loss scaling arguments (`dynamic_loss_scale_args`) for DYNAMIC_LOSS_SCALING."""

FP16_OPTIMIZERS = ("unfused", "fused", "zero", "zero3")
"""DeepSpeed's four fp16 optimizers: without ZeRO FP16_UnfusedOptimizer (torch's AdamW) and FP16_Optimizer (fused
Adam), with ZeRO DeepSpeedZeroOptimizer (stages 1-2) and DeepSpeedZeroOptimizer_Stage3."""


def _fp16_optimizer(kind: str, module: torch.nn.Module, **dynamic):
    """One of `FP16_OPTIMIZERS` over `module`'s parameters (torch's AdamW at lr 0 inside, so that the weights stay as
    they are), with DYNAMIC_ARGS changed by `dynamic`. Without ZeRO the real optimizer, on the CPU; ZeRO's need an
    accelerator to be built, so those are DeepSpeed's classes with only what their loss scale and param groups read:
    their loss scaler, DeepSpeed's DynamicLossScaler."""
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    inner = torch.optim.AdamW(module.parameters(), lr=0.0)
    args = {**DYNAMIC_ARGS, **dynamic}
    if kind in ("unfused", "fused"):
        cls = FP16_UnfusedOptimizer if kind == "unfused" else FP16_Optimizer
        return cls(inner, dynamic_loss_scale=True, dynamic_loss_args=args, verbose=False)
    zero = object.__new__(DeepSpeedZeroOptimizer if kind == "zero" else DeepSpeedZeroOptimizer_Stage3)
    zero.optimizer, zero.custom_loss_scaler, zero.loss_scaler = inner, False, DynamicLossScaler(**args)
    return zero


def _scale_read_by_step(optimizer) -> float:
    """The loss scale `optimizer`'s backward and step multiply and divide by: ZeRO's loss scaler's (stage_1_and_2.py,
    stage3.py), else its LossScaleConfig's (fused_optimizer.py, unfused_optimizer.py)."""
    holder = optimizer.loss_scaler if hasattr(optimizer, "loss_scaler") else optimizer.loss_scale_config
    return holder.cur_scale


class _FakeFP16Engine:
    """Stands in for a DeepSpeed fp16 engine around `optimizer`, one of DeepSpeed's fp16 optimizers: what the
    trainer calls, done as DeepSpeedEngine does it (backward and step go to the optimizer, and `_take_model_step`
    keeps the optimizer's gradient norm)."""

    def __init__(self, optimizer, module: torch.nn.Module | None = None) -> None:
        self.optimizer = optimizer
        self.module = torch.nn.Module() if module is None else module  # no frozen parameters
        self._global_grad_norm = None

    def fp16_enabled(self) -> bool:
        return True

    def load_checkpoint(self, *args, **kwargs):
        return "loaded", {}

    def __call__(self, *args):
        return self.module(*args)

    def train(self) -> None:
        self.module.train()

    def get_lr(self) -> list[float]:
        return [self.optimizer.param_groups[0]["lr"]]

    def backward(self, loss: torch.Tensor) -> None:
        self.optimizer.backward(loss)

    def step(self) -> None:
        self.optimizer.step()
        self._global_grad_norm = self.optimizer._global_grad_norm
        self.optimizer.zero_grad()

    def get_global_grad_norm(self):
        return self._global_grad_norm

    def is_gradient_accumulation_boundary(self) -> bool:
        return True  # one micro-batch a step


@pytest.fixture
def process_group_of_one():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def deepspeed_group_of_one(process_group_of_one, deepspeed_without_shared_memory, monkeypatch):
    """DeepSpeed's communication over the process group of one, as `setup_distributed` starts it on a CPU: DeepSpeed's
    fp16 optimizers ask it their rank and agree on overflows."""
    import deepspeed
    from deepspeed.utils import groups

    for cached in ("_WORLD_GROUP", "_DATA_PARALLEL_GROUP"):  # an engine's groups, of an earlier test's process group
        monkeypatch.setattr(groups, cached, None)
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)


@pytest.mark.parametrize("kind", FP16_OPTIMIZERS)
def test_the_loss_scale_is_checkpointed_and_restored_on_resume(tmp_path, deepspeed_group_of_one, kind):
    """Every fp16 optimizer: only ZeRO's have `cur_scale`, which was read (an AttributeError at the first logged step
    or checkpoint of an fp16 run without ZeRO) and set on resume (a new attribute nothing read: the resumed run
    started from the initial scale again)."""
    cfg = build_config("demo", ["train.micro_batch_size=1"])
    info = DistInfo(rank=0, local_rank=0, world_size=1, local_world_size=1, device=CPU)
    engine = _FakeFP16Engine(_fp16_optimizer(kind, torch.nn.Linear(4, 3).half(), init_scale=2.0 ** 11))
    trainer = Trainer(cfg, tmp_path, info, engine, objective=None, steps=DataSteps(cfg, CPU), train_set=list(range(4)),
                      val_set=[], n_params=1)
    state = trainer.client_state(stopped_by_signal=False)
    assert state["loss_scale"] == 2048.0 and loss_scale_of(engine) == 2048.0

    tag_dir = tmp_path / "checkpoints" / "global_step7"
    tag_dir.mkdir(parents=True)
    (tag_dir / "client_state.json").write_text(json.dumps({**state, "step": 7}))
    torch.save(checkpoint.rng_state(), rundir.rng_file(tmp_path, "global_step7", 0))
    engine.optimizer.loss_scale = 65536.0  # a fresh engine starts from its initial scale
    trainer.resume("global_step7", universal=False)
    assert _scale_read_by_step(engine.optimizer) == 2048.0 and trainer.step == 7


def test_the_cpu_peak_stops_growing_its_matmul_once_one_takes_long_enough(monkeypatch):
    """A CPU that emulates bf16 took 13 s per rank at the start of every run to time 1024^3 products."""
    clock, sizes = [0.0], []

    def mm(a, b):  # one nanosecond per multiply-add: 256^3 takes 17 ms, 512^3 134 ms
        sizes.append(a.shape[0])
        clock[0] += a.shape[0] ** 3 * 1e-9
        return a

    monkeypatch.setattr(metrics.torch, "mm", mm)
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: clock[0])
    assert metrics.measure_peak_flops(CPU, torch.bfloat16) == pytest.approx(2e9)
    assert sorted(set(sizes)) == [128, 256, 512]
    sizes.clear()
    assert metrics.measure_peak_flops(CPU, torch.float32, enough_s=1.0) == pytest.approx(2e9)
    assert max(sizes) == 1024  # never beyond it
    sizes.clear()
    metrics.measure_peak_flops(CPU, torch.float32, max_size=1000, enough_s=1.0)
    assert sorted(set(sizes)) == [128, 256, 512, 1000]


def test_the_cpu_peak_is_not_taken_from_a_small_matmul_slowed_by_a_loaded_machine(monkeypatch):
    """On a loaded machine a small product waits for its threads: a 128^3 one took over 20 ms, the peak was taken
    from it, and MFU read 33.5."""
    clock, sizes = [0.0], []

    def mm(a, b):  # a 2 GFLOP/s CPU whose every product also waits 25 ms for its threads
        sizes.append(a.shape[0])
        clock[0] += a.shape[0] ** 3 * 1e-9 + 0.025
        return a

    monkeypatch.setattr(metrics.torch, "mm", mm)
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: clock[0])
    assert metrics.measure_peak_flops(CPU, torch.float32) == pytest.approx(2 * 1024 ** 3 / (1024 ** 3 * 1e-9 + 0.025))
    assert max(sizes) == 1024


def test_a_torch_without_onednn_bf16_checks_counts_as_emulating_bf16(monkeypatch):
    def missing():
        raise AttributeError("'_OpNamespace' 'mkldnn' object has no attribute '_is_mkldnn_bf16_supported'")

    monkeypatch.setattr(engine_module.torch.backends.mkldnn, "is_available", lambda: True)
    monkeypatch.setattr(engine_module.torch.ops.mkldnn, "_is_mkldnn_bf16_supported", missing)
    assert engine_module.cpu_has_native_bf16() is False
    assert resolve_precision("auto", CPU) == "fp32"
    monkeypatch.setattr(engine_module.torch.backends.mkldnn, "is_available", lambda: False)
    assert engine_module.cpu_has_native_bf16() is False


def test_a_resumed_run_keeps_its_precision_and_refuses_another(pretrain_data, tmp_path):
    """`auto` on a resume takes what the run was saved in, even where this CPU would choose the other (a run begun
    before `auto` chose fp32 on CPUs that emulate bf16, or moved between machines): DeepSpeed names a bf16 run's
    optimizer files differently, so loading in the other precision failed half way with a traceback."""
    run = tmp_path / "run"
    other = "fp32" if engine_module.cpu_has_native_bf16() else "bf16"  # not what auto picks here
    result = run_job(*train_args(pretrain_data, run, "train.max_steps=1", f"train.precision={other}"))
    assert result.returncode == 0, result.stderr[-2000:]
    mismatch = "bf16" if other == "fp32" else "fp32"
    result = run_job(*train_args(pretrain_data, run, "train.max_steps=2", f"train.precision={mismatch}",
                                 extra=["--resume", "auto"]))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert f"{run} was trained in {other}; train.precision={mismatch} cannot resume it" in result.stderr
    result = run_job(*train_args(pretrain_data, run, "train.max_steps=2", "train.precision=auto",
                                 extra=["--resume", "auto"]))
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"ZeRO stage 2, {other}," in result.stdout and "resumed at step 1" in result.stdout
    assert rundir.recorded_config(run)["train"]["precision"] == other
    edited = rundir.config_file(run).read_text().replace(f"precision: {other}", f"precision: {mismatch}")
    rundir.config_file(run).write_text(edited)  # the run's record edited by hand: it was a traceback in every rank
    for requested in ("auto", mismatch, other):
        result = run_job(*train_args(pretrain_data, run, "train.max_steps=3", f"train.precision={requested}",
                                     extra=["--resume", "auto"]))
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
        trained = "bf16" if other == "bf16" else "fp32 (or fp16)"
        assert result.stderr.splitlines()[-1] == (
            f"zerollm: error: {rundir.config_file(run)} says train.precision {mismatch}, but checkpoint global_step2 "
            f"was saved in {trained} (DeepSpeed names a bf16 run's optimizer files apart); put back the precision it "
            "was trained in there")



def test_attention_flops_count_the_heads_width_where_head_dim_is_set_apart_from_dim():
    """Qwen3-0.6B's shape (dim 1024, 16 heads of 128): attention was counted at dim's width, and MFU read 22 % low."""
    cfg = ModelConfig(vocab_size=1000, dim=1024, n_layers=2, n_heads=16, n_kv_heads=8, head_dim=128, qk_norm=True)
    params = cfg.parameter_count
    attention = metrics.flops_per_token(cfg, params, 4096) - 6 * metrics.matmul_params_per_token(cfg, params)
    assert attention == 12 * 2 * (16 * 128) * 4096


class _SquareObjective:
    """The mean square of a linear layer's output, in fp32 (as DeepSpeed's fp16 optimizers scale it)."""

    token_mask = metric_mask = None

    def __call__(self, engine, batch: dict[str, torch.Tensor]) -> MicroStep:
        return MicroStep(engine(batch["x"]).float().pow(2).mean(), torch.tensor(len(batch["x"])))


def _fit(engine, run_dir, *sets: str, stop_at: int | None = None, code: int = 0) -> list[dict]:
    """Train `engine` with the trainer's loop (`Trainer.fit`) for train.max_steps steps of one micro-batch, each the
    same input, which ends with exit `code`; return its metrics.jsonl rows. Checkpoints are left out, and signals
    but a stop the ranks agree on after step `stop_at`."""
    cfg = build_config("demo", ["train.micro_batch_size=1", "train.grad_accum=1", "train.log_every=1",
                                "train.eval_every=0", "train.peak_tflops=1", *sets])
    info = DistInfo(rank=0, local_rank=0, world_size=1, local_world_size=1, device=CPU)
    x = torch.linspace(-1, 1, 4).half()
    trainer = Trainer(cfg, run_dir, info, engine, _SquareObjective(), DataSteps(cfg, CPU), [{"x": x}] * 4, None,
                      n_params=15)
    trainer.preemption = SimpleNamespace(install=lambda: None, agreed=lambda: trainer.step == stop_at,
                                         saved=lambda: None, requested=False, output_lost=lambda error: None,
                                         output_lost_now=False)
    never = SimpleNamespace(due=lambda *args: False, after_step=lambda *args, **kwargs: None)
    logger = metrics.MetricsLogger(cfg, info, n_params=15, start_step=0,
                                   sink=metrics.MetricsSink(run_dir, cfg, trainer.run_id, 0))
    assert trainer.fit(logger, never, watchdog=None) == code
    return [json.loads(line) for line in (run_dir / rundir.METRICS_FILE).read_text().splitlines()]


def test_only_the_rank_that_writes_the_metrics_measures_the_peak(monkeypatch, tmp_path):
    """Every rank measured the CPU's matmul rate (0.3 CPU-s at each start) that only rank 0's rows use."""
    measured = []
    monkeypatch.setattr(metrics, "measure_peak_flops", lambda device, dtype: measured.append(device) or 2e9)
    cfg = build_config("demo", [])
    for rank, sink in ((1, None), (0, metrics.MetricsSink(tmp_path, cfg, "run", 0))):
        info = DistInfo(rank=rank, local_rank=rank, world_size=2, local_world_size=2, device=CPU)
        logger = metrics.MetricsLogger(cfg, info, n_params=15, start_step=0, sink=sink)
    assert measured == [CPU] and logger.peak_flops == 4e9


@pytest.mark.parametrize("kind, window", [("unfused", 1), ("fused", 1000)])
def test_the_logged_gradient_norm_is_of_the_unscaled_gradients(tmp_path, deepspeed_group_of_one, kind, window):
    """fp16 without ZeRO: FP16_UnfusedOptimizer (torch's AdamW) keeps the norm of the gradients still multiplied by
    the loss scale, and metrics.jsonl had a grad_norm 65536 times too high; FP16_Optimizer divides it itself. With
    a scale window of 1 the unfused optimizer's second step doubles the scale before its gradients are unscaled:
    the norm is divided by the scale they were computed with."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 3)
    reference = torch.nn.Linear(4, 3)
    reference.load_state_dict(layer.half().state_dict())  # the same weights, in fp32
    reference(torch.linspace(-1, 1, 4)).pow(2).mean().backward()
    true_norm = torch.cat([p.grad.flatten() for p in reference.parameters()]).norm().item()

    engine = _FakeFP16Engine(_fp16_optimizer(kind, layer, scale_window=window), layer)
    rows = _fit(engine, tmp_path, "train.max_steps=2")
    assert [row["grad_norm"] for row in rows] == pytest.approx([true_norm] * 2, rel=1e-2)
    assert loss_scale_of(engine) == 2.0 ** 16 * (2 if window == 1 else 1)  # the second step doubled it


@pytest.mark.parametrize("stop_at, code", [(1, EXIT_PREEMPTED), (2, EXIT_OK)])
def test_a_signal_during_the_last_steps_evaluation_or_checkpoint_ends_a_complete_run(tmp_path, deepspeed_group_of_one,
                                                                                    stop_at, code, capsys):
    """A stop agreed at the last step (a SIGINT during its final evaluation) came after the run's final evaluation
    and checkpoint, yet it said 'stopped by signal ... rerun with --resume auto' and exited 75: a scheduler requeued
    a job that had nothing left to train."""
    layer = torch.nn.Linear(4, 3).half()
    rows = _fit(_FakeFP16Engine(_fp16_optimizer("unfused", layer), layer), tmp_path, "train.max_steps=2",
                stop_at=stop_at, code=code)
    assert len(rows) == stop_at and ("stopped by signal" in capsys.readouterr().out) == (stop_at == 1)


class _OverflowingZeroEngine(_FakeFP16Engine):
    """An fp16 ZeRO engine whose every step overflows: its optimizer updates its loss scale as ZeRO's step does on
    overflowing gradients (stage_1_and_2.py `step`: `self._update_scale(self.overflow)`)."""

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        self.optimizer._update_scale(True)


def test_gradients_overflowing_at_the_minimum_loss_scale_end_the_run_in_one_line(tmp_path, deepspeed_group_of_one):
    """fp16 with ZeRO: at its minimum loss scale DeepSpeed's DynamicLossScaler raises a bare Exception from the
    step, a traceback from every rank; the run ends as a diverged run does."""
    layer = torch.nn.Linear(4, 3).half()
    engine = _OverflowingZeroEngine(_fp16_optimizer("zero", layer, init_scale=4.0, delayed_shift=1), layer)
    with pytest.raises(UserError) as raised:
        _fit(engine, tmp_path, "train.max_steps=5")
    assert str(raised.value) == (
        "step 3: the gradients overflow even at the minimum fp16 loss scale, 1 (fp16.min_loss_scale): the weights, "
        "gradients or activations overflowed; stopped without saving; no checkpoint was saved before: lower "
        "train.lr, or change what made the run diverge")


class _OverflowingEngine(_FakeFP16Engine):
    """An fp16 engine without ZeRO whose every step overflows: its real optimizer sees infinite gradients."""

    def backward(self, loss: torch.Tensor) -> None:
        super().backward(loss * float("inf"))


@pytest.mark.parametrize("kind", ["unfused", "fused"])
def test_gradients_overflowing_at_the_minimum_loss_scale_end_a_run_without_zero_too(tmp_path, deepspeed_group_of_one,
                                                                                      kind):
    """fp16 without ZeRO: FP16_Optimizer and FP16_UnfusedOptimizer keep the scale at its minimum and skip the step,
    and every later one: the run went on to its last step training nothing, and saved that."""
    layer = torch.nn.Linear(4, 3).half()
    engine = _OverflowingEngine(_fp16_optimizer(kind, layer, init_scale=4.0, delayed_shift=1), layer)
    with pytest.raises(UserError, match=r"^step 3: the gradients overflow even at the minimum fp16 loss scale, 1 "):
        _fit(engine, tmp_path, "train.max_steps=5")


class _FailingZeroEngine(_OverflowingZeroEngine):
    """An fp16 ZeRO engine whose step fails otherwise."""

    def step(self) -> None:
        raise Exception("Current loss scale is fine, but something else failed")  # bare, as DeepSpeed raises its own


def test_another_exception_from_the_step_is_left_as_it_is(tmp_path, deepspeed_group_of_one):
    layer = torch.nn.Linear(4, 3).half()
    engine = _FailingZeroEngine(_fp16_optimizer("zero", layer), layer)
    with pytest.raises(Exception, match="^Current loss scale is fine, but something else failed$") as raised:
        _fit(engine, tmp_path, "train.max_steps=1")
    assert type(raised.value) is Exception


@pytest.mark.parametrize("kind", ["unfused", "fused"])
def test_an_overflow_at_the_minimum_scale_is_seen_on_deepspeed_before_0_18_6(kind):
    """Before DeepSpeed 0.18.6 FP16_Optimizer and FP16_UnfusedOptimizer kept cur_scale, min_loss_scale and
    dynamic_loss_scale on themselves (no loss_scale_config), which pyproject's deepspeed>=0.16 allows: the check
    looked for loss_scale_config only, so those versions skipped every later step silently again."""
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    from llm.train.engine import overflowed_at_minimum_scale

    optimizer = object.__new__(FP16_UnfusedOptimizer if kind == "unfused" else FP16_Optimizer)
    optimizer.__dict__.update(cur_scale=1.0, min_loss_scale=1.0, dynamic_loss_scale=True, overflow=True)
    engine = SimpleNamespace(optimizer=optimizer)
    assert overflowed_at_minimum_scale(engine, 1.0)
    assert not overflowed_at_minimum_scale(engine, 2.0)  # the scale could still be lowered
    optimizer.overflow = False
    assert not overflowed_at_minimum_scale(engine, 1.0)
    assert not overflowed_at_minimum_scale(engine, None)  # not fp16


MICRO_BATCHES = 16


def _accumulated_gradient(cfg, ds) -> tuple[torch.Tensor, torch.Tensor]:
    """(the gradient DeepSpeed holds at the end of one step of MICRO_BATCHES bf16 micro-batches, the exact sum of
    the micro-batches' bf16 gradients computed apart, in fp64), for one bf16 linear layer."""
    from deepspeed.utils import safe_get_full_grad

    torch.manual_seed(0)
    layer = torch.nn.Linear(256, 64, bias=False)
    apart = torch.nn.Linear(256, 64, bias=False).bfloat16()
    apart.load_state_dict({key: value.bfloat16() for key, value in layer.state_dict().items()})
    inputs = [(torch.randn(1, 256) + 1).bfloat16() for _ in range(MICRO_BATCHES)]
    exact = torch.zeros(64, 256, dtype=torch.float64)
    for x in inputs:
        apart.zero_grad()
        (apart(x).float().sum() / MICRO_BATCHES).backward()  # DeepSpeed divides each loss by the micro-batches
        exact += apart.weight.grad.double()
    engine = engine_module.build_engine(layer, cfg, ds, lambda step: 1.0)
    for x in inputs:
        engine.backward(engine(x).float().sum())
        if engine.is_gradient_accumulation_boundary():
            held = safe_get_full_grad(engine.module.weight).double()
        engine.step()
    return held, exact


@pytest.mark.parametrize("stage", [2, 3])
def test_bf16_gradients_are_summed_over_micro_batches_in_fp32(deepspeed_group_of_one, monkeypatch, stage):
    """DeepSpeed's default sums bf16 gradients over the micro-batches of a step in bf16: with 16 micro-batches they
    were off by up to 1.1 % of their value. zerollm's configs sum them in fp32 under ZeRO-2 and ZeRO-3, where
    the sum is exact."""
    cfg = build_config("demo", [f"train.grad_accum={MICRO_BATCHES}", "train.micro_batch_size=1",
                                "train.precision=bf16", "train.grad_clip=0"])
    ds = resolve_ds_config(load_ds_config(None, "pretrain")[0], cfg, world_size=1, zero_stage=stage)
    assert ds["data_types"] == {"grad_accum_dtype": "fp32"}
    monkeypatch.setenv("LOCAL_RANK", "0")  # DeepSpeed's engine asks for it
    held, exact = _accumulated_gradient(cfg, ds)
    assert torch.equal(held, exact)


def test_bf16_without_zero_starts_from_the_models_weights_and_no_adam_step(deepspeed_group_of_one, monkeypatch):
    """DeepSpeed's bf16 optimizer without ZeRO (FP16_UnfusedOptimizer) stepped AdamW once with zero gradients as it
    was built: its fp32 master weights decayed by train.lr x train.weight_decay (x 0.9 here) before training, and the
    first real update was 0.73 of AdamW's (its step count one ahead). ZeRO-2 never did."""
    cfg = build_config("demo", ["model.vocab_size=64", "model.dim=32", "model.n_layers=1", "model.n_heads=2",
                                "train.precision=bf16", "train.lr=1.0", "train.weight_decay=0.1"])
    ds = resolve_ds_config(load_ds_config(None, "pretrain")[0], cfg, world_size=1, zero_stage=0)
    monkeypatch.setenv("LOCAL_RANK", "0")  # DeepSpeed's engine asks for it
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    engine = engine_module.build_engine(model, cfg, ds, lambda step: 0.1)
    optimizer = engine.optimizer
    assert type(optimizer).__name__ == "FP16_UnfusedOptimizer" and not optimizer.optimizer.state
    for weights, masters in zip(optimizer.fp16_groups, optimizer.fp32_groups, strict=True):
        assert all(torch.equal(master, weight.float()) for weight, master in zip(weights, masters, strict=True))


@pytest.mark.parametrize("kind", ["unfused", "fused"])
def test_the_step_deepspeeds_fp16_optimizers_take_to_be_built_is_undone(deepspeed_group_of_one, kind):
    """FP16_Optimizer (fp16 without ZeRO on a GPU) takes the same step as FP16_UnfusedOptimizer."""
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 3).half()
    inner = torch.optim.AdamW(layer.parameters(), lr=1.0, weight_decay=0.1)
    cls = FP16_UnfusedOptimizer if kind == "unfused" else FP16_Optimizer
    optimizer = cls(inner, dynamic_loss_scale=True, dynamic_loss_args=DYNAMIC_ARGS, verbose=False)
    masters = optimizer.fp32_groups[0] if kind == "unfused" else [optimizer.fp32_groups_flat[0]]
    weights = optimizer.fp16_groups[0] if kind == "unfused" else [optimizer.fp16_groups_flat[0]]
    assert inner.state and not torch.equal(masters[0], weights[0].float())  # decayed by the step
    engine_module._undo_the_step_taken_to_build(optimizer)
    assert not inner.state and all(torch.equal(m, w.float()) for m, w in zip(masters, weights, strict=True))


def test_a_config_that_asks_for_bf16_accumulation_keeps_it():
    cfg = build_config("demo", ["train.precision=bf16"])
    raw = {**load_ds_config(None, "pretrain")[0], "data_types": {"grad_accum_dtype": "bf16"}}
    assert resolve_ds_config(raw, cfg, world_size=1)["data_types"] == {"grad_accum_dtype": "bf16"}
    auto = {**load_ds_config(None, "pretrain")[0], "data_types": {"grad_accum_dtype": "auto"}}
    assert resolve_ds_config(auto, cfg, world_size=1)["data_types"] == {"grad_accum_dtype": "fp32"}
    assert resolve_ds_config(auto, cfg, world_size=1, zero_stage=1)["data_types"] == {}  # DeepSpeed's default
    for precision, stage in (("fp32", 2), ("bf16", 1), ("bf16", 0)):  # nothing to do, or left to the config
        ds = resolve_ds_config(load_ds_config(None, "pretrain")[0],
                               build_config("demo", [f"train.precision={precision}"]), world_size=1, zero_stage=stage)
        assert "data_types" not in ds


@pytest.mark.parametrize("data_types, message", [
    ({"grad_accum_dtype": "fp32"}, "'data_types.grad_accum_dtype' \"fp32\" differs from this run's bf16, which "
                                   "DeepSpeed does only under ZeRO (stage 1-3); remove it or raise "
                                   "zero_optimization.stage"),
    ({"grad_accum_dtype": "fp64"}, "'data_types.grad_accum_dtype' is \"fp64\", not a dtype DeepSpeed knows: fp32, "
                                   "bf16 or fp16 (or \"auto\")"),
    (["fp32"], "'data_types' must be a JSON object {...}, got [\"fp32\"]")])
def test_grad_accum_dtypes_deepspeed_cannot_do_are_one_line(data_types, message):
    """Without ZeRO DeepSpeed raised NotImplementedError("unsupported mix of model_dtype=... and grad_accum_dtype=...")
    from every rank."""
    raw = {**load_ds_config(None, "pretrain")[0], "data_types": data_types}
    with pytest.raises(UserError, match=f"^ds.json: {re.escape(message)}$"):
        resolve_ds_config(raw, build_config("demo", ["train.precision=bf16"]), world_size=1, source="ds.json",
                          zero_stage=0)


@pytest.mark.parametrize("precision, given", [("fp32", "bf16"), ("fp32", "fp16"), ("bf16", "fp16")])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_sum_of_gradients_in_another_precision_than_the_runs_or_fp32_is_refused(precision, given, stage):
    """ZeRO-2 summed them in the run's own precision without a word (the losses were bit for bit the run's without
    the setting)."""
    raw = {**load_ds_config(None, "pretrain")[0], "data_types": {"grad_accum_dtype": given}}
    with pytest.raises(UserError, match=f"^ds.json: 'data_types.grad_accum_dtype' \"{given}\" would sum this "
                                        f"{precision} run's gradients in another precision than its own or fp32"):
        resolve_ds_config(raw, build_config("demo", [f"train.precision={precision}"]), world_size=1, source="ds.json",
                          zero_stage=stage)


class _NoFloat64(TorchFunctionMode):
    """Apple's MPS as far as float64 goes: any tensor of it is MPS's TypeError."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(isinstance(t, torch.Tensor) and t.dtype == torch.float64 for t in tree_flatten(out)[0]):
            raise TypeError(f"{getattr(func, '__name__', func)}: Cannot convert a MPS Tensor to float64 dtype")
        return out


def test_without_float64_as_on_mps_training_sampling_and_scoring_run(tmp_path, deepspeed_group_of_one, monkeypatch):
    """MPS has no float64: the trainer's counters, sampling at a temperature above 0 (serve's default) and eval's
    scoring made float64 tensors on the device, and each failed at once there."""
    from llm import devices
    from llm.eval.scoring import score_sequences
    from llm.infer.sampling import SamplingParams, choose_next

    assert devices.exact_dtype(torch.device("mps")) == torch.float32
    assert devices.exact_dtype(CPU) == torch.float64
    for module in ("llm.train.trainer", "llm.infer.sampling", "llm.eval.scoring"):
        monkeypatch.setattr(f"{module}.exact_dtype", lambda device: torch.float32)
    layer = torch.nn.Linear(4, 3).half()
    engine = _FakeFP16Engine(_fp16_optimizer("unfused", layer), layer)
    model = Transformer(ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2, max_seq_len=16)).eval()
    logits, seen = torch.randn(2, 64), torch.zeros(2, 64, dtype=torch.bool)
    with _NoFloat64():
        assert len(_fit(engine, tmp_path, "train.max_steps=2")) == 2
        for temperature in (0.7, 1e-300):  # a tiny one is the greedy limit, as in float64
            chosen = choose_next(logits, SamplingParams(temperature=temperature), seen, None)
        assert chosen.tolist() == logits.argmax(-1).tolist()
        assert len(list(score_sequences(model, [np.arange(8)], [4], 1))) == 1


def test_a_validation_loss_gets_a_line_of_its_own_on_a_terminal(monkeypatch, tmp_path, capsys):
    """On a terminal it was shown only in the progress bar's text, cut at 80 columns and replaced at the next step."""
    monkeypatch.setattr(metrics, "on_terminal", lambda: True)
    cfg = build_config("demo", ["train.peak_tflops=1"])
    info = DistInfo(rank=0, local_rank=0, world_size=1, local_world_size=1, device=CPU)
    sink = metrics.MetricsSink(tmp_path, cfg, "r", 0)
    logger = metrics.MetricsLogger(cfg, info, n_params=15, start_step=0, sink=sink)
    stats = metrics.StepStats(loss=2.0, positions=10, loss_tokens=10, metrics={})
    for step, val_loss in ((5, 1.23456), (6, None)):
        with logger.timed():
            time.sleep(0.001)
        logger.log(step, 1e-3, stats, None, 0, 10 * step, val_loss=val_loss)
    assert capsys.readouterr().out.count("step 5 val_loss 1.2346\n") == 1


def test_a_logged_row_s_throughput_fields_follow_from_the_step_s_counts(monkeypatch, tmp_path):
    """The tests checked that mfu and loss_tokens_per_sec were there, not their values (an mfu of positions rather
    than tokens per second passed)."""
    monkeypatch.setattr(metrics, "measure_peak_flops", lambda device, dtype: 1e9)
    cfg = build_config("demo", [])
    info = DistInfo(rank=0, local_rank=0, world_size=2, local_world_size=2, device=torch.device("cpu"))
    logger = metrics.MetricsLogger(cfg, info, n_params=1000, start_step=0,
                                   sink=metrics.MetricsSink(tmp_path, cfg, "run", 0))
    logger._seconds = 4.0  # the steps since the last logged one took 4 s, 1 of them generating
    stats = metrics.StepStats(loss=2.0, metrics={}, loss_tokens=300, positions=1200, generated_tokens=50,
                              generation_seconds=1.0)
    logger.log(step=3, lr=1e-3, stats=stats, grad_norm=0.5, epoch=0, tokens_seen=3600)
    logger.close(0)
    row = json.loads((tmp_path / rundir.METRICS_FILE).read_text().splitlines()[-1])
    assert row["tokens_per_sec"] == pytest.approx(1200 / 3.0)  # generation's second left out
    assert row["loss_tokens_per_sec"] == pytest.approx(300 / 4.0)
    assert row["rollout_tokens_per_sec"] == pytest.approx(50 / 1.0)
    assert row["mfu"] == pytest.approx(logger.flops_per_token * (1200 / 3.0) / 2e9)  # the peak of both ranks
    assert (row["lr"], row["tokens"]) == (1e-3, 3600)
