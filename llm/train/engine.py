"""The DeepSpeed side: the resolved DeepSpeed config and the engines (`deepspeed.initialize`).

One source of truth: hyperparameters live in the run config; the DeepSpeed JSON carries engine
settings (ZeRO stage, precision switch, buckets, offload). Every "auto" in the JSON is filled from
the run config; an explicit value that disagrees with the run config is an error naming both.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.util
import inspect
import io
import json
import logging
import math
from typing import Any

import pydantic
import torch

from kernels.runtime import cuda_has_bf16
from llm.config import RunConfig
from llm.devices import DTYPES
from llm.errors import UserError
from llm.runtime.accelerator import ensure_accelerator_env
from llm.runtime.deferred_compile import defer_muon_compile
from llm.train.checkpoint import weight_decayed
from llm.train.ds_scheduler import resolve_scheduler, scheduler_name

ensure_accelerator_env()
import deepspeed  # noqa: E402 - after the accelerator is chosen
from deepspeed.monitor.config import DeepSpeedMonitorConfig  # noqa: E402
from deepspeed.ops.op_builder.cpu.no_impl import NotImplementedBuilder  # noqa: E402
from deepspeed.runtime.config import DtypeEnum  # noqa: E402
from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer  # noqa: E402
from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer  # noqa: E402
from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config  # noqa: E402
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig  # noqa: E402
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum  # noqa: E402
from deepspeed.runtime.zero.utils import ZERO_SUPPORTED_OPTIMIZERS  # noqa: E402

defer_muon_compile()

CONCRETE_PRECISIONS = ("bf16", "fp16", "fp32")
DYNAMIC_LOSS_SCALING = {"loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2,
                        "min_loss_scale": 1}
"""DeepSpeed's fp16 section when the JSON leaves it to us: a dynamic loss scale starting at 2^16, halved on an
overflow (after `hysteresis` of them), doubled after 1000 steps without one."""

WIDTH_SIZES = {"reduce_bucket_size": lambda dim: dim * dim,
               "stage3_prefetch_bucket_size": lambda dim: int(0.9 * dim * dim),
               "stage3_param_persistence_threshold": lambda dim: 10 * dim}
"""ZeRO sizes that Hugging Face's DeepSpeed configs (its zero3.json) leave "auto", filled from the model's width as
its Trainer fills them from `hidden_size`: here `model.dim`."""


def cpu_has_native_bf16() -> bool:
    """Whether oneDNN has bf16 kernels for this CPU (AVX-512 on x86, the BF16 extension on Arm). Without them (AVX2
    only: most laptops) bf16 matmuls are emulated: training ran 21x slower than in fp32 on a 2-core AVX2 machine
    (docs/benchmarks.md). False where torch was built without oneDNN."""
    try:
        return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # the op is missing from some builds (e.g. Jetson's)
        return False


def resolve_precision(requested: str, device: torch.device) -> str:
    """train.precision for this device: 'auto' is bf16 where the device has it (CPUs with oneDNN bf16 kernels,
    Ampere and newer GPUs, Apple GPUs on macOS 14+), fp16 with dynamic loss scaling on older GPUs (T4,
    V100, RTX 20), fp32 on other CPUs and older Macs; a precision the device cannot run is refused."""
    if device.type == "mps":
        if requested == "auto":
            return "bf16" if torch.backends.mps.is_macos_or_newer(14, 0) else "fp32"
        return requested
    if device.type != "cuda":
        if requested == "fp16":
            raise UserError("train.precision=fp16 needs a CUDA GPU (DeepSpeed's CPU accelerator has no fp16); "
                            "use bf16 or fp32 here")
        if requested == "auto":
            return "bf16" if cpu_has_native_bf16() else "fp32"
        return requested
    has_bf16 = cuda_has_bf16()
    if requested == "auto":
        return "bf16" if has_bf16 else "fp16"
    if requested == "bf16" and not has_bf16:
        major, minor = torch.cuda.get_device_capability(device)
        raise UserError(f"train.precision=bf16: {torch.cuda.get_device_name(device)} (sm_{major}{minor}) has no "
                        "bf16; use fp16 (dynamic loss scaling), auto or fp32")
    return requested


def loss_scale_of(engine) -> float | None:
    """The current fp16 loss scale of an engine, None when it does not scale the loss. Read as
    `optimizer.loss_scale`, the one name all four of DeepSpeed's fp16 optimizers give it in every version: since
    DeepSpeed 0.18.6 only ZeRO's (stages 1-2 and 3) also call it `cur_scale`, which FP16_Optimizer and
    FP16_UnfusedOptimizer (fp16 without ZeRO; fused Adam, or torch's AdamW) lack, so an fp16 run with
    --zero-stage 0 failed at its first logged step."""
    if not engine.fp16_enabled():
        return None
    return float(engine.optimizer.loss_scale)


def set_loss_scale(engine, scale: float) -> None:
    """Continue an fp16 engine at loss scale `scale` (a resumed run's). `optimizer.loss_scale` is, in each of
    DeepSpeed's fp16 optimizers, a property that sets what its backward and step read (ZeRO's `loss_scaler.cur_scale`,
    the others' `loss_scale_config.cur_scale` since DeepSpeed 0.18.6); a `cur_scale` set on FP16_Optimizer or
    FP16_UnfusedOptimizer there was a new attribute that nothing read."""
    engine.optimizer.loss_scale = scale


def keeps_no_grad_norm(engine) -> bool:
    """Whether DeepSpeed keeps no gradient norm for this engine's steps: without ZeRO in fp32, its torch optimizer
    has none, and the clipping it does there keeps none (`get_global_grad_norm` was None at every step)."""
    return not (engine.fp16_enabled() or engine.bfloat16_enabled()) and engine.zero_optimization_stage() == 0


def grad_norm_before_step(engine) -> torch.Tensor:
    """The norm of the gradients the coming optimizer step takes (every rank holds them whole without ZeRO), before
    any clipping: what DeepSpeed's ZeRO optimizers keep. A tensor on the gradients' device: read only when logged."""
    norms = [torch.linalg.vector_norm(p.grad) for p in engine.module.parameters() if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())


def unscaled_grad_norm(engine, scale: float | None) -> float | None:
    """The gradient norm of the engine's last optimizer step (None where DeepSpeed computes none), of the gradients
    as the loss gave them. Under fp16 FP16_UnfusedOptimizer (no ZeRO, torch's AdamW: `"torch_adam": true`) keeps
    the norm of the gradients still multiplied by the loss scale, where the fused and ZeRO optimizers divide it:
    the logged norm was 65536 times too high at the start of a run. `scale`: the loss scale those gradients were
    computed with (`loss_scale_of` before the step, which may change it)."""
    norm = engine.get_global_grad_norm()
    if norm is None or scale is None or not isinstance(engine.optimizer, FP16_UnfusedOptimizer):
        return norm
    return float(norm) / scale


LOSS_SCALE_AT_MINIMUM = "Current loss scale already at minimum"
"""How DeepSpeed says, in a bare Exception, that a step's gradients overflowed with the fp16 loss scale already at
fp16.min_loss_scale: its DynamicLossScaler, which ZeRO's optimizers (stages 1-3) update in their step. (Without ZeRO
the fp16 optimizers keep the scale at the minimum and skip the step.)"""


def is_loss_scale_at_minimum(exc: BaseException) -> bool:
    """Whether `exc` is DeepSpeed's `LOSS_SCALE_AT_MINIMUM` exception."""
    return type(exc) is Exception and str(exc).startswith(LOSS_SCALE_AT_MINIMUM)


def overflowed_at_minimum_scale(engine, scale: float | None) -> bool:
    """Whether the fp16 optimizer step just taken without ZeRO (FP16_Optimizer, FP16_UnfusedOptimizer) skipped
    overflowing gradients computed at `scale` (`loss_scale_of` before the step, None without fp16), the dynamic loss
    scale's minimum; where ZeRO's would raise `LOSS_SCALE_AT_MINIMUM`, these skip every step from there on. Their
    scaling settings are in `loss_scale_config` since DeepSpeed 0.18.6, on the optimizer itself before."""
    optimizer = engine.optimizer if scale is not None else None
    if not isinstance(optimizer, FP16_Optimizer | FP16_UnfusedOptimizer):
        return False
    config = getattr(optimizer, "loss_scale_config", optimizer)
    return bool(config.dynamic_loss_scale and optimizer.overflow and scale <= config.min_loss_scale)


SECTION_KEYS = {"optimizer": ("type", "params", "legacy_fusion"), "scheduler": ("type", "params")}
"""The keys DeepSpeed reads in these sections (`deepspeed.runtime.config`): another, a misspelt "parms", was ignored,
and the run config's values were used in its place."""


OTHER_SECTIONS = ("checkpoint", "data_types", "flops_profiler", "torch_autocast", "hybrid_engine", "pipeline")
"""Sections DeepSpeed reads as objects that zerollm does not fill ("checkpoint": "x" was a traceback in every rank)."""


def resolve_ds_config(raw: dict[str, Any], cfg: RunConfig, world_size: int, source: str = "DeepSpeed config",
                      zero_stage: int | None = None) -> dict[str, Any]:
    """Fill "auto" values from the run config; refuse values that contradict it, sections that are not objects, an
    optimizer DeepSpeed does not have or cannot build here (`_refuse_unbuildable`), optimizer params the optimizer
    does not take (the run config fills only those it takes: no betas for SGD), a zero_optimization section
    DeepSpeed's model refuses, sections of removed features or of monitors whose package is missing
    (`_refuse_removed_features`) and steps_per_print below 1 (DeepSpeed would fail on those in every rank with a
    traceback); also a top-level key that is a near miss of one DeepSpeed knows (`_refuse_misspelt_keys`), sections
    zerollm would not act on (`_refuse_unused_features`), features that take LOCAL_RANK for a rank's place on its
    node (`_refuse_local_rank_features`) and what ZeRO-2 and 3 fail on (`_refuse_unsupported_by_reduce_scatter`).
    "bfloat16", bf16's older name, is read as "bf16"; ZeRO sizes left "auto" as Hugging Face's configs leave them are
    filled from the model's width (`WIDTH_SIZES`)."""
    ds = copy.deepcopy(raw)
    t = cfg.train

    def require_object(value: Any, key: str) -> None:
        if not isinstance(value, dict):
            raise UserError(f"{source}: '{key}' must be a JSON object {{...}}, got {json.dumps(value)[:60]}")

    if "bfloat16" in ds:  # DeepSpeed's older name: filling "bf16" beside it overrode the user's setting
        if "bf16" in ds:
            raise UserError(f"{source}: give one of 'bf16' and 'bfloat16' (its older name), not both")
        ds["bf16"] = ds.pop("bfloat16")
    _refuse_misspelt_keys(ds, source)
    _refuse_removed_features(ds, source)
    _refuse_unused_features(ds, source)
    for section in ("bf16", "fp16", "optimizer", "zero_optimization", *MONITORS, *OTHER_SECTIONS):  # read or
        if section in ds:  # filled below, checked against DeepSpeed's models of them, or read by DeepSpeed alone
            require_object(ds[section], section)
    for section, keys in SECTION_KEYS.items():
        if isinstance(ds.get(section), dict) and (unknown := [key for key in ds[section] if key not in keys]):
            raise UserError(f"{source}: '{section}.{unknown[0]}' is not a key DeepSpeed reads in '{section}' (it reads "
                            f"{', '.join(keys)}); remove it or correct its name")
    if "optimizer" in ds:
        require_object(ds["optimizer"].get("params", {}), "optimizer.params")
        name, supported = ds["optimizer"].get("type"), deepspeed.runtime.config.DEEPSPEED_OPTIMIZERS
        if not (isinstance(name, str) and (name.lower() in supported or
                                           isinstance(getattr(torch.optim, name, None), type))):
            raise UserError(f"{source}: 'optimizer.type' is {json.dumps(name)}, not an optimizer DeepSpeed has: one of "
                            f"{', '.join(supported)} (any case) or a torch.optim class name")

    def fill(container: dict, path: str, value: Any, run_key: str) -> None:
        """Fill "auto" (or a missing value) at `path` (dotted, in the JSON) in `container`, its innermost object."""
        key = path.rpartition(".")[2]
        current = container.get(key, "auto")
        if current == "auto":
            container[key] = value
        elif current != value or isinstance(current, bool) != isinstance(value, bool):  # true equals 1 to Python
            raise UserError(f"{source}: '{path}' is {json.dumps(current)} but {run_key} is {json.dumps(value)}; "
                            f"set it to \"auto\" or make them equal")

    fill(ds, "train_micro_batch_size_per_gpu", t.micro_batch_size, "train.micro_batch_size")
    fill(ds, "gradient_accumulation_steps", t.grad_accum, "train.grad_accum")
    fill(ds, "train_batch_size", t.micro_batch_size * t.grad_accum * world_size,
         "train.micro_batch_size * train.grad_accum * world size")
    fill(ds, "gradient_clipping", t.grad_clip, "train.grad_clip")
    if t.precision not in CONCRETE_PRECISIONS:
        raise ValueError(f"resolve train.precision={t.precision!r} with resolve_precision first")
    for name in ("bf16", "fp16"):
        enabled = ds.setdefault(name, {}).get("enabled", "auto")
        if enabled == "auto":
            enabled = ds[name]["enabled"] = t.precision == name
        elif enabled in (0, 1) and not isinstance(enabled, float):  # DeepSpeed reads 1 as true
            enabled = ds[name]["enabled"] = bool(enabled)
        if not isinstance(enabled, bool):  # "true" was called a disagreement with a bf16 run
            raise UserError(f"{source}: '{name}.enabled' is {json.dumps(enabled)[:60]}; give true, false or \"auto\"")
        if enabled != (t.precision == name):
            other = f"train.precision={name} where the device has it" if enabled is True else \
                "another train.precision (fp32 runs everywhere)"
            raise UserError(f"{source}: '{name}.enabled' is {json.dumps(enabled)} but this run trains in {t.precision} "
                            f"(train.precision, auto made concrete for this device); set '{name}.enabled' to "
                            f"\"auto\", or {other}")
    fp16 = ds["fp16"]
    if t.precision == "fp16":
        for key, value in DYNAMIC_LOSS_SCALING.items():
            fp16.setdefault(key, value)
    _refuse_invalid_sections(ds, source)
    if "scheduler" in ds:
        resolve_scheduler(ds["scheduler"], cfg, source, fill, ds.get("optimizer", {}).get("params", {}))
    if zero_stage is not None:
        ds.setdefault("zero_optimization", {})["stage"] = zero_stage
    stage = ds.get("zero_optimization", {}).get("stage", 0)
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):  # true is 1 to Python
        raise UserError(f"{source}: zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")
    if isinstance(stage, float):  # 2.0, as DeepSpeed reads it: the run said "ZeRO stage 2.0"
        stage = ds["zero_optimization"]["stage"] = int(stage)
    for key, size in WIDTH_SIZES.items():
        if ds.get("zero_optimization", {}).get(key) == "auto":
            ds["zero_optimization"][key] = size(cfg.model.dim)
    if stage == 0:  # DeepSpeed offloads nothing without ZeRO, yet builds its CPU optimizer, which then fails at the
        for key in ("offload_optimizer", "cpu_offload"):  # first step on a GPU's parameters (cpu_offload: the
            ds.get("zero_optimization", {}).pop(key, None)  # older name of an offload of the optimizer to the cpu)
    zero = _zero_config(ds.get("zero_optimization", {}), source)
    _fill_grad_accum_dtype(ds, t.precision, stage, source)
    _refuse_param_and_buffer_dtypes(ds, t.precision, source)
    _refuse_local_rank_features(ds, zero, source)
    _refuse_unusable_nvme(zero, source)
    _refuse_unbuildable_quantizer(zero, stage, source)
    _refuse_unsupported_by_reduce_scatter(ds, zero, stage, source)
    optimizer = ds.setdefault("optimizer", {"type": "AdamW", "params": {"torch_adam": True}})
    params = optimizer.setdefault("params", {})
    offload = zero.offload_optimizer is not None and zero.offload_optimizer.device != OffloadDeviceEnum.none
    optimizer_class = _optimizer_class(optimizer["type"], params, offload, source)
    takes = _optimizer_keywords(optimizer["type"], optimizer_class, params)
    if takes is not None:
        if "lr" not in takes:
            raise UserError(f"{source}: 'optimizer.type' {optimizer['type']} has no learning rate for the run "
                            "config's schedule; choose another optimizer")
        for key in [key for key in params if key not in takes]:
            if params[key] != "auto" and key not in ADAM_SWITCHES:
                raise UserError(f"{source}: 'optimizer.params.{key}' is not a parameter of {optimizer['type']} "
                                f"(it takes {', '.join(sorted(takes))}); remove it")
            del params[key]  # "auto" where it does not apply, or a switch of DeepSpeed's Adam
    for key, value, run_key in (("lr", t.lr, "train.lr"), ("betas", [t.beta1, t.beta2], "[train.beta1, train.beta2]"),
                                ("eps", t.adam_eps, "train.adam_eps"),
                                ("weight_decay", t.weight_decay, "train.weight_decay")):
        if takes is None or (key in takes and _same_kind(takes[key], value)):
            fill(params, f"optimizer.params.{key}", value, run_key)
        elif params.get(key) == "auto":  # the optimizer's own kind of value (Adafactor's eps is a pair)
            del params[key]
    _refuse_unbuildable(optimizer["type"], optimizer_class, stage, ds, source)
    _refuse_auto(ds, source)
    _refuse_bad_values(optimizer["type"], optimizer_class, params, source)
    steps_per_print = ds.get("steps_per_print")
    if steps_per_print is not None:
        if (isinstance(steps_per_print, bool) or not isinstance(steps_per_print, (int, float))
                or not math.isfinite(steps_per_print) or steps_per_print != int(steps_per_print)
                or steps_per_print < 1):
            raise UserError(f"{source}: 'steps_per_print' must be a whole number >= 1 (or null: never), "
                            f"got {json.dumps(steps_per_print)[:60]}")
        ds["steps_per_print"] = int(steps_per_print)  # 10.0 is 10, as DeepSpeed takes it
    _refuse_what_deepspeed_refuses(ds, source)
    return ds


DEEPSPEED_CONFIG_ERRORS = (ValueError, TypeError, AttributeError, KeyError, AssertionError, ArithmeticError,
                           pydantic.ValidationError, deepspeed.runtime.config.DeepSpeedConfigError)
"""What DeepSpeed's reading of a config raises on a value it cannot use (its own error is an Exception of its own)."""


def _refuse_what_deepspeed_refuses(ds: dict[str, Any], source: str) -> None:
    """DeepSpeed's own reading of the whole config (`DeepSpeedConfig`, as `deepspeed.initialize` reads it), here, once:
    a value only it checks (communication_data_type "int8" or 5, checkpoint.tag_validation "Nope",
    data_types.param_dtype "bogus", gradient_allreduce_op "max", a section that is not an object) was a traceback in
    every rank, which two ranks reported as a failed node (exit 76, 'start the job again with --resume auto'); and
    gradient_predivide_factor, which it divides by, at any ZeRO stage (0: a ZeroDivisionError at the first step, after
    the run folder was written). The batch size is left to it to compute: the command line checks the config for the
    job's ranks in a process of its own."""
    factor = ds.get("gradient_predivide_factor", 1.0)
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor <= 0:
        raise UserError(f"{source}: 'gradient_predivide_factor' must be a number above 0, got "
                        f"{json.dumps(factor)[:60]}")
    probe = {key: value for key, value in ds.items() if key != "train_batch_size"}
    try:
        with contextlib.redirect_stdout(io.StringIO()), _deepspeed_logs_quiet():
            deepspeed.runtime.config.DeepSpeedConfig(probe)
    except DEEPSPEED_CONFIG_ERRORS as exc:
        said = " ".join(str(exc).split())[:300] or type(exc).__name__
        raise UserError(f"{source}: DeepSpeed cannot use it: {said}") from None


@contextlib.contextmanager
def _deepspeed_logs_quiet():
    """DeepSpeed's logger below errors left out: DeepSpeedConfig logs its world size at info level, and its warnings
    come again as the engine reads the config."""
    logger = deepspeed.utils.logger
    level = logger.level
    logger.setLevel(max(level, logging.ERROR))
    try:
        yield
    finally:
        logger.setLevel(level)


def _data_type(given: Any, key: str, source: str, also: str = "") -> torch.dtype:
    """The torch dtype `given` names in data_types.`key`, or a UserError saying which names DeepSpeed knows (`also`
    adds what else the key takes)."""
    try:
        return DtypeEnum(given).value
    except (ValueError, TypeError):
        raise UserError(f"{source}: 'data_types.{key}' is {json.dumps(given)[:60]}, not a dtype DeepSpeed knows: "
                        f"fp32, bf16 or fp16{also}") from None


def _refuse_param_and_buffer_dtypes(ds: dict[str, Any], precision: str, source: str) -> None:
    """data_types.param_dtype and buffer_dtype, which DeepSpeed reads only as it builds the engine: a name it does not
    know ('bogus' is not a valid DtypeEnum), or a param_dtype other than the run's precision (an AssertionError), was a
    traceback in every rank. A buffer_dtype other than fp32 casts the model's buffers, RoPE's tables, which it keeps
    in fp32 in every precision (DeepSpeed leaves buffers alone where buffer_dtype is unset)."""
    for key in ("param_dtype", "buffer_dtype"):
        given = ds.get("data_types", {}).get(key)
        if given is None:
            continue
        dtype = _data_type(given, key, source)
        if key == "param_dtype" and dtype != DTYPES[precision]:
            raise UserError(f"{source}: 'data_types.param_dtype' is {json.dumps(given)} but this run trains in "
                            f"{precision} (train.precision); remove it, or make them equal")
        if key == "buffer_dtype" and dtype != torch.float32:
            raise UserError(f"{source}: 'data_types.buffer_dtype' is {json.dumps(given)}, which would cast RoPE's "
                            "tables, kept in fp32 in every precision; remove it")


FP32_GRAD_ACCUM_STAGES = (2, 3)
"""ZeRO stages whose bf16 gradients zerollm accumulates in fp32 by default (`_fill_grad_accum_dtype`)."""


def _fill_grad_accum_dtype(ds: dict[str, Any], precision: str, stage: int, source: str) -> None:
    """bf16 under ZeRO-2 and ZeRO-3: gradients summed over micro-batches in fp32 (DeepSpeed's
    `data_types.grad_accum_dtype`) unless the config says otherwise ("auto" or absent is filled). DeepSpeed's
    default sums them in bf16, one rounding to 8 bits of mantissa per micro-batch: with 16 micro-batches a step,
    gradients were off by up to 1.1 % of their value (the fp32 sum is exact there, tests/test_precision.py); both
    stages keep their gradient partition in fp32 for it (2 more bytes per parameter over the ranks), and the ranks
    still reduce in bf16. Without ZeRO DeepSpeed
    cannot do it (bf16 with fp32 accumulation is refused in one line here, not DeepSpeed's NotImplementedError from
    every rank); ZeRO-1's would switch to DeepSpeed's BF16_Optimizer, another checkpoint layout, so it is left to the
    config. A sum in another precision than the run's own or fp32 (bf16 in an fp32 run, fp16 in a bf16 one) is
    refused: ZeRO-2 ignored it without a word, and it is worth nothing where it applies."""
    data_types = ds.get("data_types", {})
    if not isinstance(data_types, dict):
        raise UserError(f"{source}: 'data_types' must be a JSON object {{...}}, got {json.dumps(data_types)[:60]}")
    given = data_types.get("grad_accum_dtype")
    if given in (None, "auto"):
        if precision == "bf16" and stage in FP32_GRAD_ACCUM_STAGES:
            ds["data_types"] = {**data_types, "grad_accum_dtype": "fp32"}
        elif given == "auto":  # DeepSpeed's own default: the model's dtype
            ds["data_types"] = {key: value for key, value in data_types.items() if key != "grad_accum_dtype"}
        return
    accum = _data_type(given, "grad_accum_dtype", source, ' (or "auto")')
    if stage == 0 and accum != DTYPES[precision]:
        raise UserError(f"{source}: 'data_types.grad_accum_dtype' {json.dumps(given)} differs from this run's "
                        f"{precision}, which DeepSpeed does only under ZeRO (stage 1-3); remove it or raise "
                        "zero_optimization.stage")
    if accum not in (DTYPES[precision], torch.float32):  # ZeRO-2 summed in the run's precision without a word
        raise UserError(f"{source}: 'data_types.grad_accum_dtype' {json.dumps(given)} would sum this {precision} "
                        "run's gradients in another precision than its own or fp32, which DeepSpeed's ZeRO-2 ignores; "
                        "remove it, or give \"fp32\"")


MAX_BUCKET_ELEMENTS = 1 << 32
"""The largest ZeRO bucket taken: DeepSpeed allocates a buffer of that many elements (16 GiB in fp32); models need
buckets of 10^7-10^9."""
BUCKETS = {"reduce_bucket_size": "reduce_bucket_size", "allgather_bucket_size": "allgather_bucket_size",
           "stage3_prefetch_bucket_size": "prefetch_bucket_size"}
"""The JSON's bucket keys, each with the field of DeepSpeed's model that holds it."""


def _zero_config(zero: dict[str, Any], source: str):
    """The zero_optimization section as DeepSpeed reads it (its pydantic model), or a UserError naming the key at
    fault (`_section_model`) or a bucket above MAX_BUCKET_ELEMENTS (one of 10^12 passed, and the first backward
    failed to allocate 4 TB, or overflowed, in a traceback after the run's files were written)."""
    config = _section_model(DeepSpeedZeroConfig, zero, "zero_optimization", "ZeRO", source)
    for key, field in BUCKETS.items():
        if getattr(config, field) > MAX_BUCKET_ELEMENTS:
            given = key if key in zero else field  # DeepSpeed's model takes its field's name too
            raise UserError(f"{source}: 'zero_optimization.{given}' is {json.dumps(zero[given])[:60]}, more than "
                            f"{MAX_BUCKET_ELEMENTS:,} elements (DeepSpeed allocates a buffer of that many); give a "
                            "smaller bucket (DeepSpeed's defaults: 5e8, and 5e7 for the prefetch bucket)")
    return config


MONITORS = ("tensorboard", "wandb", "csv_monitor", "comet")
"""DeepSpeed's monitor sections, each a top-level key (`deepspeed.monitor.config.get_monitor_config`)."""


def _refuse_invalid_sections(ds: dict[str, Any], source: str) -> None:
    """Refuse what DeepSpeed's models of the bf16, fp16 and monitor sections refuse (`_section_model`): a misspelt
    key in them ("bf16": {"enabeld": true}) was a ValidationError traceback from `deepspeed.initialize` in every
    rank, which two ranks reported as a failed node (exit 76)."""
    for section, model, name in (("bf16", DeepSpeedBF16Config, "bf16"), ("fp16", DeepSpeedFP16Config, "fp16")):
        _section_model(model, ds.get(section, {}), section, name, source)
    monitors = {section: ds[section] for section in MONITORS if section in ds}
    _section_model(DeepSpeedMonitorConfig, monitors, None, "monitor", source)


def _section_model(model: type, section: dict[str, Any], key: str | None, name: str, source: str):
    """`model(**section)`, DeepSpeed's pydantic model of a section (at `key` in the JSON; None: at the top level, its
    fields being sections), or a UserError naming the key at fault (DeepSpeed would fail on it in every rank with a
    ValidationError traceback); `name` says whose setting a key is not."""
    _refuse_auto(section, source, key or "")  # DeepSpeed's models take "auto" for some values
    try:
        return model(**section)
    except pydantic.ValidationError as exc:
        error = exc.errors()[0]
        at = ".".join([*([key] if key else []), *map(str, error["loc"])])
        if error["type"] == "extra_forbidden":
            raise UserError(f"{source}: '{at}' is not one of DeepSpeed's {name} settings; remove it or correct "
                            "its name") from None
        said = str(error["ctx"]["error"]) if error["type"] in ("value_error", "assertion_error") else error["msg"]
        message = said[:1].lower() + said[1:]  # not "Value error, " nor "Assertion failed, "
        if not error["loc"]:  # the section as a whole (keys that do not go together): its value cut short said nothing
            raise UserError(f"{source}: '{at}': {message}") from None
        raise UserError(f"{source}: '{at}' is {json.dumps(error.get('input'), default=str)[:60]}: "
                        f"{message}") from None


ADAM_SWITCHES = ("torch_adam", "adam_w_mode", "fp32_optimizer_states")
"""optimizer.params that DeepSpeed takes for itself when it builds Adam or AdamW (which class, which mode): dropped
from the other optimizers' params, which would fail on them."""

MUP_OPTIMIZERS = {"muadam": torch.optim.Adam, "muadamw": torch.optim.AdamW, "musgd": torch.optim.SGD}


def _optimizer_class(name: str, params: dict[str, Any], offload: bool, source: str) -> type | None:
    """The class DeepSpeed builds for optimizer `name` (DeepSpeedEngine._configure_basic_optimizer: torch's Adam or
    AdamW with torch_adam, else DeepSpeed's CPU or fused kernels), None for Muon (which sorts its params into its two
    halves and ignores the rest)."""
    lower = name.lower()
    if lower == "muon":
        return None
    if lower in ("adam", "adamw"):
        if params.get("torch_adam"):  # DeepSpeed builds torch's AdamW, or Adam with adam_w_mode false
            return torch.optim.Adam if lower == "adam" and params.get("adam_w_mode") is False else torch.optim.AdamW
        return deepspeed.ops.adam.DeepSpeedCPUAdam if offload else deepspeed.ops.adam.FusedAdam
    if lower in MUP_OPTIMIZERS:  # mup's wrappers of torch's optimizers
        if importlib.util.find_spec("mup") is None:
            raise UserError(f"{source}: 'optimizer.type' {name} needs the mup package: pip install mup")
        return MUP_OPTIMIZERS[lower]
    return {"adagrad": deepspeed.ops.adagrad.DeepSpeedCPUAdagrad if offload else torch.optim.Adagrad,
            "lamb": deepspeed.ops.lamb.FusedLamb,
            "lion": deepspeed.ops.lion.DeepSpeedCPULion if offload else deepspeed.ops.lion.FusedLion,
            }.get(lower) or getattr(torch.optim, name)


def _refuse_unbuildable(name: str, cls: type | None, stage: int, ds: dict[str, Any], source: str) -> None:
    """Refuse an optimizer DeepSpeed would fail to build or step in every rank: a fused kernel this accelerator has
    none of (Lamb and Lion on a CPU), Muon under ZeRO-3 with reduce_scatter on, torch's SparseAdam (dense gradients),
    torch's Adagrad under ZeRO, or one
    DeepSpeed calls untested under ZeRO unless the config allows it."""
    if cls in (deepspeed.ops.lamb.FusedLamb, deepspeed.ops.lion.FusedLion) and \
            deepspeed.get_accelerator().device_name() == "cpu":
        offload = " (or offload_optimizer to the cpu, which has DeepSpeed's CPU Lion)" if cls.__name__ == "FusedLion" \
            else ""
        raise UserError(f"{source}: 'optimizer.type' {name} is DeepSpeed's {cls.__name__}, which has no CPU kernel; "
                        f"choose another optimizer{offload}")
    if name.lower() == "muon" and stage == 3 and ds.get("zero_optimization", {}).get("reduce_scatter", True):
        raise UserError(f"{source}: 'optimizer.type' {name} under ZeRO-3 needs \"reduce_scatter\": false in "
                        "zero_optimization (DeepSpeed's ZeRO-3 does not reduce-scatter Muon's gradients)")
    if cls is torch.optim.SparseAdam:  # a RuntimeError traceback in every rank at the first step
        raise UserError(f"{source}: 'optimizer.type' {name} is torch's SparseAdam, which steps sparse gradients "
                        "only, and the model's are dense; choose another optimizer (AdamW)")
    if cls is torch.optim.Adagrad and stage > 0:  # an IndexError in every rank at the first step
        raise UserError(f"{source}: 'optimizer.type' {name} is torch's Adagrad, which DeepSpeed's ZeRO (stage {stage}) "
                        "fails on; set zero_optimization.stage to 0, or offload_optimizer to the cpu (DeepSpeed's CPU "
                        "Adagrad)")
    if cls is not None and stage > 0 and cls not in ZERO_SUPPORTED_OPTIMIZERS and \
            not ds.get("zero_allow_untested_optimizer"):
        raise UserError(f"{source}: DeepSpeed calls {name} untested under ZeRO (stage {stage}); add "
                        "\"zero_allow_untested_optimizer\": true to use it anyway, or set zero_optimization.stage to 0")


def _refuse_bad_values(name: str, cls: type | None, params: dict[str, Any], source: str) -> None:
    """Refuse optimizer params the optimizer itself refuses as it is built, which it would do in every rank (a
    traceback each, exit 1): a torch optimizer is built once here, on parameters grouped as the trainer groups them
    (`param_groups`), so that its own checks run (a momentum below 0, text where a number goes, Nesterov without
    momentum, LBFGS's single group); DeepSpeed's Adam kernels have no AMSGrad."""
    if cls in (deepspeed.ops.adam.FusedAdam, deepspeed.ops.adam.DeepSpeedCPUAdam) and params.get("amsgrad"):
        raise UserError(f"{source}: 'optimizer.params.amsgrad': DeepSpeed's {cls.__name__} has no AMSGrad; remove it, "
                        "or add \"torch_adam\": true for torch's")
    if cls is None or not cls.__module__.startswith("torch.optim"):
        return
    taken = inspect.signature(cls).parameters
    keywords = {key: value for key, value in params.items() if key in taken}
    try:  # a Linear's weight and bias: one parameter in each of the trainer's two groups
        cls(param_groups(torch.nn.Linear(1, 1), params.get("weight_decay", 0.0)), **keywords)
    except Exception as exc:  # noqa: BLE001 - whatever it raises, every rank would raise: Rprop's etas [1], IndexError
        said = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(f"{source}: 'optimizer' {name} refuses its params ({said})") from None


MONITOR_PACKAGES = {"tensorboard": "tensorboard", "comet": "comet_ml"}
"""DeepSpeed's monitor sections and the package each needs (DeepSpeed imports it as the engine is built)."""


@functools.cache
def deepspeed_keys() -> frozenset[str]:
    """The top-level keys DeepSpeed reads from a config: those `DeepSpeedConfig` looks up while it reads an empty one
    and checks it for warnings (recorded as it looks) and the two that `deepspeed.initialize` reads itself; none when
    its reader cannot be run so."""

    class Recorder(dict):
        def __init__(self):
            super().__init__()
            self.asked: set[str] = set()

        def __bool__(self) -> bool:  # `if param_dict and KEY in param_dict.keys()`
            return True

        def __contains__(self, key) -> bool:
            self.asked.add(key)
            return False

        def get(self, key, default=None):
            self.asked.add(key)
            return default

        def keys(self):
            return self

    recorder = Recorder()
    config = deepspeed.runtime.config
    reader = config.DeepSpeedConfig.__new__(config.DeepSpeedConfig)
    reader._param_dict = recorder
    try:  # DeepSpeed's private readers: another DeepSpeed may read otherwise, and then no near miss is refused
        reader._initialize_params(recorder)
        reader._do_warning_check()  # vocabulary_size
    except Exception:  # noqa: BLE001 - whatever another version raises: the check is a help, not a requirement
        return frozenset()
    return frozenset(recorder.asked | {"sequence_parallel_size", "data_parallel_size"})


def _refuse_misspelt_keys(ds: dict[str, Any], source: str) -> None:
    """Refuse a top-level key DeepSpeed does not know that is a typo of one it does (a letter or two added, dropped
    or changed: `schedular`, `zero_optimisation`, `gradient_clippin`), cut short (`train_micro_batch_size`,
    `gradient_accumulation`), or another trainer's name for one (`grad_accum`, `max_grad_norm`): DeepSpeed ignores
    it, so the run went on without the setting. Other unknown keys (a "comment", another tool's `sequence_parallel`
    or `lr_scheduler`) are left alone, as DeepSpeed leaves them, and so are the removed features' (refused next)."""
    removed = set(getattr(deepspeed.runtime.config, "_REMOVED_TOP_LEVEL_CONFIG_KEYS", {}))  # in DeepSpeed >= 0.18
    for key in ds:
        if key in deepspeed_keys() or key in removed or key in OTHER_TOOLS_KEYS:
            continue
        most = 1 if len(key) < LONG_KEY else 2  # "comment" is not a typo of "comet"
        match = OTHER_NAMES.get(key) or next((known for known in sorted(deepspeed_keys()) if _edits(key, known) <= most
                                              or len(key) >= LONG_KEY and known.startswith(key)), None)
        if match is not None:
            raise UserError(f"{source}: '{key}' is not a setting DeepSpeed knows (it would ignore it); did you mean "
                            f"'{match}'? {'Put it there' if '.' in match else 'Correct its name'}")


LONG_KEY = 12
"""A misspelt DeepSpeed key this long or longer may differ by two letters, or be cut short; a shorter one may
differ by one (`_refuse_misspelt_keys`)."""
OTHER_NAMES = {"micro_batch_size": "train_micro_batch_size_per_gpu",
               "per_device_train_batch_size": "train_micro_batch_size_per_gpu",
               "batch_size": "train_batch_size", "global_batch_size": "train_batch_size",
               "grad_accum": "gradient_accumulation_steps", "grad_clip": "gradient_clipping",
               "grad_clipping": "gradient_clipping", "max_grad_norm": "gradient_clipping",
               "lr": "optimizer.params.lr", "learning_rate": "optimizer.params.lr"}
"""Other trainers' names (Hugging Face's, zerollm's own run config's, PyTorch habits) for DeepSpeed settings, at the
top level of a DeepSpeed config where DeepSpeed ignores them."""
OTHER_TOOLS_KEYS = frozenset({"sequence_parallel"})
"""Unknown top-level keys other tools put in a DeepSpeed config (Megatron's), cut-short look-alikes of DeepSpeed's
own (`sequence_parallel_size`) that are none of its settings."""


def _edits(a: str, b: str) -> int:
    """Levenshtein distance: the fewest letters added, dropped or changed that make `a` into `b`."""
    row = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        previous, row[0] = row[0], i
        for j, y in enumerate(b, 1):
            previous, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, previous + (x != y))
    return row[-1]


def _refuse_removed_features(ds: dict[str, Any], source: str) -> None:
    """Refuse a section of a DeepSpeed feature this DeepSpeed has removed (sparse_gradients, amp, elasticity, ...),
    and an enabled monitor whose package is missing: DeepSpeed fails on either in every rank with a traceback."""
    reject = getattr(deepspeed.runtime.config, "_reject_removed_config_keys", None)  # in DeepSpeed >= 0.18
    if reject is not None:
        try:
            reject(ds)
        except deepspeed.runtime.config.DeepSpeedConfigError as exc:
            raise UserError(f"{source}: {str(exc).split(' See ')[0]} Remove that section.") from None
    for section, package in MONITOR_PACKAGES.items():
        if _is_set(ds, section, "enabled") and importlib.util.find_spec(package) is None:
            raise UserError(f"{source}: the '{section}' monitor needs the {package} package: pip install {package} "
                            "(or remove the section; zerollm logs metrics.jsonl and wandb itself)")


def _is_set(ds: dict[str, Any], section: str, key: str) -> bool:
    """Whether the DeepSpeed config's `section` is a mapping whose `key` is set (true, or any non-empty value)."""
    value = ds.get(section)
    return isinstance(value, dict) and bool(value.get(key))


def _refuse_unused_features(ds: dict[str, Any], source: str) -> None:
    """Refuse a section asking for what DeepSpeed does only through a model, data loader or call of its own, or what
    zerollm does itself: activation checkpointing (the model calls deepspeed.checkpointing: ours does not, so the
    section was silently ignored), data efficiency (DeepSpeed's curriculum sampler and random-LTD layers: a KeyError
    traceback in every rank), tensor and sequence parallelism (AssertionErrors), compile (only `engine.compile()` reads
    it; keys its model refuses were a ValidationError traceback), the comms logger (only `deepspeed.comm.log_summary()`
    prints it), autotuning (DeepSpeed exits after its profiling steps: the run ended early, with exit status 0 and no
    checkpoint), DeepSpeed's wandb monitor (a UsageError traceback where wandb has no API key; `--wandb` logs the run)
    loading universal checkpoints (zerollm converts to one itself when the rank count changes; the key made a normal
    resume fail) and DeepSpeed's checkpoint writers (a KeyError or AttributeError traceback in every rank as the engine
    was built)."""
    checkpointing = ds.get("activation_checkpointing")
    if isinstance(checkpointing, dict) and any(checkpointing.values()):
        raise UserError(f"{source}: 'activation_checkpointing' would not apply: zerollm's model does not checkpoint "
                        "activations through DeepSpeed; remove the section (or lower train.micro_batch_size and raise "
                        "train.grad_accum to save activation memory)")
    if _is_set(ds, "data_efficiency", "enabled"):
        raise UserError(f"{source}: 'data_efficiency' needs DeepSpeed's own data loader and layers; zerollm feeds "
                        "its own batches and model, so remove the section or set its 'enabled' to false")
    if _is_set(ds, "tensor_parallel", "autotp_size") and ds["tensor_parallel"]["autotp_size"] not in (0, 1):
        raise UserError(f"{source}: 'tensor_parallel' would not apply: zerollm's model has no tensor parallelism "
                        "DeepSpeed can find; remove the section (each rank holds the whole model, or its ZeRO-3 "
                        "share)")
    if ds.get("sequence_parallel_size", 1) != 1:
        raise UserError(f"{source}: 'sequence_parallel_size' is {json.dumps(ds['sequence_parallel_size'])[:60]}, but "
                        "zerollm's model has no sequence parallelism; remove it (each rank trains on whole sequences)")
    compiling = ds.get("compile", {})
    if not isinstance(compiling, dict) or compiling.get("deepcompile") or not compiling.keys() <= _compile_keys():
        raise UserError(f"{source}: 'compile' would not apply: zerollm never calls DeepSpeed's engine.compile(); "
                        "remove the section")
    for section, why in (("comms_logger", "zerollm never prints DeepSpeed's communication summary"),
                         ("autotuning", "DeepSpeed would end the run after its profiling steps, without a checkpoint "
                                        "(zerollm bench train measures throughput)"),
                         ("wandb", "DeepSpeed's wandb monitor fails where wandb has no API key, and zerollm logs the "
                                   "run to wandb itself (--wandb online or offline)")):
        if _is_set(ds, section, "enabled"):
            raise UserError(f"{source}: '{section}' is not for zerollm: {why}; remove the section or set its "
                            "'enabled' to false")
    if _is_set(ds, "torch_autocast", "enabled"):  # the run trained in another precision than the one it said
        raise UserError(f"{source}: 'torch_autocast' would run the model in another precision than train.precision, "
                        "which the run records and says: remove the section, or set train.precision=bf16 (or fp16) "
                        "for mixed precision")
    if _is_set(ds, "checkpoint", "load_universal"):
        raise UserError(f"{source}: 'checkpoint.load_universal' makes a resume from zerollm's own checkpoints fail; "
                        "remove it (zerollm converts a checkpoint to universal itself when the number of ranks "
                        "changes)")
    if isinstance(ds.get("checkpoint"), dict) and ds["checkpoint"].get("writer") is not None:  # {}: the default one
        raise UserError(f"{source}: 'checkpoint.writer' is not for zerollm: DeepSpeed's checkpoint writers fail as "
                        "its engine starts in zerollm's jobs (they read its launcher's CROSS_SIZE and a parallel "
                        "layout zerollm's engine does not have); remove it (zerollm writes, flushes and publishes "
                        "every checkpoint itself)")


def _refuse_local_rank_features(ds: dict[str, Any], zero, source: str) -> None:
    """Refuse DeepSpeed's features that take LOCAL_RANK for a rank's place on its node, which it is not where a rank
    sees one GPU (`llm.runtime.distributed.setup_distributed` sets LOCAL_RANK to 0 there, the GPU's index), and which
    fail in zerollm's jobs anyway; they are refused in every job (whether a run will be resumed on other ranks is
    not known when it starts):

    - Serial checkpoint loading (zero_optimization.pipeline_loading_checkpoint): a rank whose LOCAL_RANK is not 0
      waits for the previous rank, and a rank whose LOCAL_RANK is not the job's last rank sends to the next. With
      one-GPU ranks (all LOCAL_RANK 0) every rank sends and none waits, the last to a rank that does not exist; on
      several nodes the last rank of each node sends to a rank that does not wait; on a universal checkpoint
      (zerollm's resume on another number of ranks) no rank sends. The resume hangs, then fails at the
      collective timeout.
    - Node-local storage (checkpoint.use_node_local_storage): the rank of LOCAL_RANK 0 writes the model states, so
      the first rank of every node (every one-GPU rank) writes the same file; zerollm keeps a checkpoint in one run
      directory every host sees, its manifest listing every rank's files.

    (checkpoint.writer reads LOCAL_RANK too; it is refused for failing in any job: `_refuse_unused_features`.)"""
    if zero.pipeline_loading_checkpoint:
        raise UserError(f"{source}: 'zero_optimization.pipeline_loading_checkpoint' is not for zerollm: DeepSpeed "
                        "passes the load from rank to rank by LOCAL_RANK, and a resume hangs on a job of several "
                        "nodes, of ranks that each see one GPU, or of another number of ranks than saved; remove it")
    if _is_set(ds, "checkpoint", "use_node_local_storage"):
        raise UserError(f"{source}: 'checkpoint.use_node_local_storage' is not for zerollm: its checkpoints live in "
                        "one run directory every host sees, where the option has the first rank of every node (every "
                        "rank, where each sees one GPU) write the same model-states file; remove it")


def _compile_keys() -> set[str]:
    """The keys DeepSpeed's compile section takes (none in a DeepSpeed without DeepCompile)."""
    try:
        from deepspeed.compile.config import CompileConfig  # noqa: PLC0415 - only where there is a compile section
    except ImportError:
        return set()
    return set(CompileConfig.model_fields)


def _refuse_unsupported_by_reduce_scatter(ds: dict[str, Any], zero, stage: int, source: str) -> None:
    """Refuse what ZeRO-2 and ZeRO-3 with reduce_scatter fail on in every rank (an AssertionError traceback):
    prescaled gradients or a predivide factor."""
    if stage >= 2 and zero.reduce_scatter:
        for key, asks in (("prescale_gradients", bool(ds.get("prescale_gradients"))),
                          ("gradient_predivide_factor", ds.get("gradient_predivide_factor", 1.0) != 1.0)):
            if asks:
                raise UserError(f"{source}: '{key}' is {json.dumps(ds[key])[:60]}, which DeepSpeed's ZeRO-{stage} "
                                "does not support with reduce_scatter; remove it, or set "
                                "zero_optimization.reduce_scatter to false")


def async_io_builds() -> bool:
    """Whether DeepSpeed's async_io op (NVMe offload) can be built for this accelerator here."""
    async_io = deepspeed.get_accelerator().create_op_builder("AsyncIOBuilder")
    return async_io is not None and async_io.is_compatible(verbose=False)


def _refuse_unusable_nvme(zero, source: str) -> None:
    """Offload to NVMe needs a folder on the drive and DeepSpeed's async_io op (built against libaio): without
    either DeepSpeed fails in every rank with an AssertionError or a RuntimeError traceback."""
    for name in ("offload_param", "offload_optimizer"):
        offload = getattr(zero, name)
        if offload is None or offload.device != OffloadDeviceEnum.nvme:
            continue
        if offload.nvme_path is None:
            raise UserError(f"{source}: 'zero_optimization.{name}.device' is nvme but no 'nvme_path' names the folder "
                            "on the NVMe drive to offload to; give one")
        if not async_io_builds():
            raise UserError(f"{source}: 'zero_optimization.{name}.device' nvme needs DeepSpeed's async_io op, which "
                            "cannot be built here (it needs libaio: e.g. apt install libaio-dev); offload to \"cpu\" "
                            "instead")


def parameter_offload_note(ds_config: dict[str, Any]) -> str | None:
    """A note where `offload_param` is set at ZeRO stage 0, 1 or 2, which DeepSpeed ignores (it offloads parameters
    under ZeRO-3 only; DeepSpeed-Chat writes it at stage 2; `--zero-stage 0` over a ZeRO-3 offload config): the run
    trained with every parameter on the device, without a word. None otherwise."""
    zero = ds_config.get("zero_optimization", {})
    device = (zero.get("offload_param") or {}).get("device", "none")
    if zero.get("stage", 0) == 3 or device in ("none", None):
        return None
    return (f"note: zero_optimization.offload_param offloads parameters under ZeRO stage 3 only: at stage "
            f"{zero.get('stage', 0)} every parameter stays on the device (--zero-stage 3 offloads them)")


ZERO_QUANTIZED = ("zero_quantized_weights", "zero_quantized_nontrainable_weights", "zero_quantized_gradients")
"""ZeRO++'s switches (stage 3): each needs DeepSpeed's quantizer op."""


def _refuse_unbuildable_quantizer(zero, stage: int, source: str) -> None:
    """ZeRO++'s quantization (stage 3) where DeepSpeed's quantizer op cannot be built (a CPU): every rank ended in a
    traceback, and the job was called a lost rank, to be resumed."""
    asked = [name for name in ZERO_QUANTIZED if stage == 3 and getattr(zero, name, False)]
    if not asked:
        return
    quantizer = deepspeed.get_accelerator().create_op_builder("QuantizerBuilder")
    if quantizer is None or isinstance(quantizer, NotImplementedBuilder) or not quantizer.is_compatible(verbose=False):
        raise UserError(f"{source}: 'zero_optimization.{asked[0]}' needs DeepSpeed's quantizer op, which this "
                        f"accelerator ({deepspeed.get_accelerator().device_name()}) has none of; remove it")


def _optimizer_keywords(name: str, cls: type | None, params: dict[str, Any]) -> dict[str, Any] | None:
    """The optimizer.params keys that optimizer `name`, built as `cls` (`_optimizer_class`), takes, each with its
    default (None for DeepSpeed's switches), or None where any key goes (Muon)."""
    if cls is None:
        return None
    lower, extra, taken = name.lower(), set(), set()
    if lower in ("adam", "adamw"):
        extra = set(ADAM_SWITCHES) | ({"foreach"} if params.get("torch_adam") else set())
        if cls is deepspeed.ops.adam.DeepSpeedCPUAdam:
            taken = {"adamw_mode"}  # DeepSpeed passes it
    elif lower in MUP_OPTIMIZERS:
        extra = {"decoupled_wd"}
    parameters = list(inspect.signature(cls).parameters.values())
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    keywords = {key: None for key in extra} | {p.name: p.default for p in parameters[1:]}  # [0]: what to optimize
    return {key: default for key, default in keywords.items() if key not in taken}


def _same_kind(default: Any, value: Any) -> bool:
    """Whether the run config's `value` (a number, or a pair for betas) fits a parameter whose default is `default`
    (None: any value goes)."""
    return default is None or isinstance(default, (tuple, list)) == isinstance(value, (tuple, list))


def _refuse_auto(node: Any, source: str, path: str = "") -> None:
    """A UserError naming the first "auto" left in `node` (at `path` in the DeepSpeed config): no run-config value
    fills it."""
    found = _find_auto(node, path)
    if found:
        raise UserError(f"{source}: no run-config value fills \"auto\" at {found}; give it a value")


def _find_auto(node: Any, path: str) -> str | None:
    if node == "auto":
        return path or "<root>"
    if isinstance(node, dict):
        for key, value in node.items():
            found = _find_auto(value, f"{path}.{key}" if path else key)
            if found:
                return found
    return None


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices, none on norms and other vectors."""
    decay = [p for p in model.parameters() if p.requires_grad and weight_decayed(p)]
    no_decay = [p for p in model.parameters() if p.requires_grad and not weight_decayed(p)]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _initialize(**kwargs):
    """`deepspeed.initialize` without what DeepSpeed print()s while building the engine: BF16_Optimizer's memory
    reports (six lines or more on rank 0, before the run's first line) come whatever the config says, and a bf16
    engine without ZeRO has one: the DPO, GRPO and distillation reference (`frozen_engine`), or ZeRO-1 with fp32
    gradient accumulation. DeepSpeed's warnings and errors still reach the user: its logger writes to the stream it
    was created with, not to `sys.stdout`, and stderr is left as it is."""
    with contextlib.redirect_stdout(io.StringIO()):
        return deepspeed.initialize(**kwargs)


def build_engine(model: torch.nn.Module, cfg: RunConfig, ds_config: dict[str, Any], lr_lambda):
    """`deepspeed.initialize` with our parameter groups and a LambdaLR schedule on its optimizer, or the schedule of
    the config's `scheduler` section (`llm.train.ds_scheduler`), which DeepSpeed builds."""

    def make_scheduler(optimizer):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)

    engine, _, _, _ = _initialize(model=model, model_parameters=param_groups(model, cfg.train.weight_decay),
                                  config=ds_config, lr_scheduler=None if scheduler_name(ds_config) else make_scheduler)
    _undo_the_step_taken_to_build(engine.optimizer)
    return engine


def _undo_the_step_taken_to_build(optimizer) -> None:
    """DeepSpeed's fp16 and bf16 optimizers without ZeRO (FP16_Optimizer, FP16_UnfusedOptimizer) step the optimizer
    they wrap once, with zero gradients, as they are built, to make its state: under AdamW that decayed every fp32
    master weight by train.lr x train.weight_decay (the full rate, before any warmup) and counted an Adam step that
    never was (the first real update's bias correction a step off: 0.73 of AdamW's). The masters are copied back
    from the model's weights they were made from, and the state is dropped: the first real step makes it."""
    if isinstance(optimizer, FP16_UnfusedOptimizer):
        for weights, masters in zip(optimizer.fp16_groups, optimizer.fp32_groups, strict=True):
            for weight, master in zip(weights, masters, strict=True):
                master.data.copy_(weight.data)
    elif isinstance(optimizer, FP16_Optimizer):
        for weights, masters in zip(optimizer.fp16_groups_flat, optimizer.fp32_groups_flat, strict=True):
            masters.data.copy_(weights.data)
    else:
        return
    optimizer.optimizer.state.clear()


def full_parameters(engine):
    """A context in which the engine's module holds its full parameters on every rank: gathered (read-only) under
    ZeRO-3, as they are under the other stages."""
    return gathered(list(engine.module.parameters()))


def gathered(params: list[torch.nn.Parameter]):
    """A context in which `params` are whole on every rank: gathered (read-only) where ZeRO-3 partitions them, as
    they are otherwise."""
    return deepspeed.zero.GatheredParameters(params, enabled=any(hasattr(p, "ds_id") for p in params))


def frozen_engine(model: torch.nn.Module, ds_config: dict[str, Any]):
    """An inference-only DeepSpeed engine of a frozen model (DPO's and GRPO's reference): partitioned like the policy
    under ZeRO-3, replicated (stage 0) otherwise."""
    model.requires_grad_(False)
    config = {k: v for k, v in ds_config.items() if k not in ("optimizer", "scheduler")}
    if ds_config.get("zero_optimization", {}).get("stage", 0) != 3:
        config["zero_optimization"] = {"stage": 0}
    engine = _initialize(model=model, config=config)[0]
    engine.eval()
    return engine
