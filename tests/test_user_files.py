"""Users' DeepSpeed configs and tokenizer files that are malformed: one-line errors naming the file and the key,
before any rank trains (DeepSpeed, json and the chat template code would fail with tracebacks in every rank)."""

import importlib.util
import json
import os
import pathlib
import re
import shutil

import pytest
import torch
from forked_ranks import run_job

from conftest import FIXTURES, ZERO_RUN, run_cli, train_args
from llm.chat_template import CHAT_TEMPLATE
from llm.config import build_config
from llm.errors import UserError
from llm.tokenizer import Tokenizer
from llm.train import engine
from llm.train.ds_config_file import load_ds_config
from llm.train.engine import resolve_ds_config

MINIMIND = FIXTURES / "tokenizers" / "minimind"


def resolved(change: dict, precision: str = "fp32") -> dict:
    """The shipped pretrain.json with `change` merged into it (sections replaced), resolved for a demo run."""
    raw, _ = load_ds_config(None, "pretrain")
    return resolve_ds_config({**raw, **change}, build_config("demo", [f"train.precision={precision}"]), 1, "x.json")


@pytest.mark.parametrize("content, message", [
    (b'{"steps_per_print": "\xff"}', r"bad.json: not UTF-8 \(byte 0xff at offset 21\); save the DeepSpeed config as "
                                    "UTF-8 JSON$"),
    (b"[" * 100_000, r"bad.json: invalid JSON \(nested too deeply\)$"),
    # read, then a RecursionError traceback from copying it (every rank's, some thousand lines each)
    (b'{"comment": ' + b'{"a": ' * 600 + b"1" + b"}" * 601, r"bad.json: invalid JSON \(nested too deeply: more than "
                                                           r"100 levels\)$"),
    # Hjson read these as {}: the run trained at ZeRO 0, not at the stage's own config
    *[(empty, r"bad.json: is empty; give the DeepSpeed settings as a JSON object, or leave --deepspeed out for the "
              r"stage's own \(pretrain\)$") for empty in (b"", b"  \n\t\n", b"// to do\n# later\n/* { } */\n")],
    # Hjson read `key: value` lines as an object: Accelerate's YAML trained at ZeRO 0 with DeepSpeed's defaults, a
    # DeepSpeed section in YAML was "'zero_optimization' must be a JSON object {...}, got \"stage: 2\""
    *[(yaml, r"bad.json: not a JSON object \(it does not open with '\{'\): a YAML file\? DeepSpeed reads its config as "
             "JSON; an Accelerate config names its DeepSpeed JSON in deepspeed_config_file$")
      for yaml in (b"compute_environment: LOCAL_MACHINE\ndeepspeed_config:\n  zero_stage: 2\nmixed_precision: bf16\n",
                   b"# mine\nzero_optimization:\n  stage: 2\n")],
    # the error blamed the comment, which DeepSpeed takes ("Expecting property name enclosed in double quotes")
    (b'{\n // c\n "gradient_clipping": 1e400\n}\n', r"bad.json:3:23: invalid JSON \(the number 1e400 is beyond a "
                                                 r"float's range \(it would be Infinity\)\)$"),
])
def test_deepspeed_config_that_is_not_utf8_nested_too_deeply_or_empty_is_refused(tmp_path, content, message):
    bad = tmp_path / "bad.json"
    bad.write_bytes(content)
    with pytest.raises(UserError, match=message):
        load_ds_config(bad, "pretrain")


def test_ds_config_file_is_read_as_deepspeed_reads_it(tmp_path):
    """DeepSpeed reads its config file as Hjson and refuses a key given twice: comments and trailing commas were
    refused here, and `"stage": 3, "stage": 1` ran ZeRO-1 without a word."""
    path = tmp_path / "ds.json"
    path.write_text('{\n  // ZeRO-2\n  "zero_optimization": {"stage": 2,},\n  /* note */ "bf16": {"enabled": "auto"},}')
    assert load_ds_config(path, "pretrain")[0] == {"zero_optimization": {"stage": 2}, "bf16": {"enabled": "auto"}}
    path.write_bytes(b'\xef\xbb\xbf{"zero_optimization": {"stage": 1}}\r\n')  # a Windows editor's: "a YAML file?"
    assert load_ds_config(path, "pretrain")[0] == {"zero_optimization": {"stage": 1}}
    path.write_text("// nothing but\n{}")  # an empty object, as written: taken
    assert load_ds_config(path, "pretrain")[0] == {}
    path.write_text('{"zero_optimization": {"stage": 3, "stage": 1}}')
    with pytest.raises(UserError, match=f"^{path}: invalid JSON \\(the key 'stage' is given twice in one object\\)$"):
        load_ds_config(path, "pretrain")
    path.write_text('{\n  "zero_optimization": {"stage": 2, "x": [1}\n}')  # neither reads it: JSON's own words
    with pytest.raises(UserError, match=f"^{path}:2:44: invalid JSON \\(Expecting ',' delimiter\\)$"):
        load_ds_config(path, "pretrain")
    path.write_text('{\n  // ZeRO-2\n  "zero_optimization": {"stage": 2, "x": [1}\n}')  # not at the comment
    with pytest.raises(UserError, match=f"^{path}:3:44: invalid JSON \\(Found a punctuator character "):
        load_ds_config(path, "pretrain")


@pytest.mark.parametrize("optimizer, kind, offload", [
    ("SGD", torch.optim.SGD, False),
    ("Adagrad", torch.optim.Adagrad, False),
    ("Adamax", torch.optim.Adamax, False),
    ("RMSprop", torch.optim.RMSprop, False),
])
def test_ds_config_fills_only_the_parameters_the_optimizer_takes(optimizer, kind, offload):
    ds = resolved({"optimizer": {"type": optimizer, "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                               "weight_decay": "auto", "torch_adam": True}},
                   "zero_optimization": {"stage": 0}})  # no ZeRO: torch's Adagrad fails under it
    params = ds["optimizer"]["params"]
    cfg = build_config("demo").train
    assert params["lr"] == cfg.lr and params["weight_decay"] == cfg.weight_decay
    assert "torch_adam" not in params and ("betas" in params) == (optimizer == "Adamax")
    kind([torch.nn.Parameter(torch.zeros(2))], **params)  # as DeepSpeed builds it: it failed on betas before


def test_ds_config_leaves_a_parameter_of_another_kind_to_the_optimizer():
    # Adafactor's eps is a pair (None, 1e-3): train.adam_eps, a number, made torch fail in every rank
    ds = resolved({"optimizer": {"type": "Adafactor", "params": {"eps": "auto", "weight_decay": "auto"}},
                   "zero_allow_untested_optimizer": True})
    params = ds["optimizer"]["params"]
    assert "eps" not in params and params["weight_decay"] == build_config("demo").train.weight_decay
    torch.optim.Adafactor([torch.nn.Parameter(torch.zeros(2, 2))], **params).step()


def test_ds_config_keeps_adams_parameters_and_switches():
    params = resolved({})["optimizer"]["params"]
    assert params["torch_adam"] is True and params["betas"] == [0.9, 0.95] and params["eps"] == 1e-8
    adam = {"type": "Adam", "params": {"torch_adam": True, "adam_w_mode": False, "decoupled_weight_decay": False}}
    assert resolved({"optimizer": adam})["optimizer"]["params"]["decoupled_weight_decay"] is False  # torch's Adam


@pytest.mark.parametrize("optimizer, message", [
    ({"type": "AdamW", "params": {"foo": 1, "torch_adam": True}},
     r"x.json: 'optimizer.params.foo' is not a parameter of AdamW \(it takes adam_w_mode, amsgrad, betas, .*\); "
     "remove it$"),
    ({"type": "SGD", "params": {"betas": [0.9, 0.95]}},
     r"x.json: 'optimizer.params.betas' is not a parameter of SGD \(it takes .*momentum.*\); remove it$"),
    ({"type": "Adagrad", "params": {"momentum": 0.9}}, "x.json: 'optimizer.params.momentum' is not a parameter of "
                                                       "Adagrad"),
    ({"type": "Optimizer", "params": {}}, "x.json: 'optimizer.type' Optimizer has no learning rate"),
])
def test_ds_config_optimizer_parameter_the_optimizer_does_not_take_is_refused(optimizer, message):
    with pytest.raises(UserError, match=message):
        resolved({"optimizer": optimizer})


UNKNOWN = "is not a setting DeepSpeed knows (it would ignore it);"

@pytest.mark.parametrize("change, message", [
    # DeepSpeed failed on each of these in every rank with a traceback
    ({"optimizer": {"type": "SGD", "params": {"momentum": 0.9}}},
     "x.json: DeepSpeed calls SGD untested under ZeRO (stage 2); add \"zero_allow_untested_optimizer\": true to use it "
     "anyway, or set zero_optimization.stage to 0"),
    ({"optimizer": {"type": "Lamb", "params": {}}},
     "x.json: 'optimizer.type' Lamb is DeepSpeed's FusedLamb, which has no CPU kernel; choose another optimizer"),
    ({"optimizer": {"type": "Lion", "params": {}}}, "x.json: 'optimizer.type' Lion is DeepSpeed's FusedLion, which "
     "has no CPU kernel; choose another optimizer (or offload_optimizer to the cpu, which has DeepSpeed's CPU Lion)"),
    ({"sparse_gradients": False}, "x.json: Sparse compression of dense torch.nn.Embedding gradients has been removed."),
    ({"amp": {"enabled": True, "opt_level": "O1"}}, "x.json: NVIDIA Apex AMP integration has been removed."),
    ({"tensorboard": {"enabled": True, "output_path": "tb"}}, "x.json: the 'tensorboard' monitor needs the tensorboard "
     "package: pip install tensorboard"),
    ({"optimizer": {"type": "MuAdamW", "params": {}}}, "x.json: 'optimizer.type' MuAdamW needs the mup package: pip "
     "install mup"),
    ({"optimizer": {"type": "SparseAdam", "params": {"lr": "auto"}}}, "x.json: 'optimizer.type' SparseAdam is torch's "
     "SparseAdam, which steps sparse gradients only, and the model's are dense; choose another optimizer (AdamW)"),
    # a RuntimeError traceback in every rank at the first step
    ({"bfloat16": {"enabled": True}, "bf16": {"enabled": False}}, "x.json: give one of 'bf16' and 'bfloat16'"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}, "x.json: "
     "'zero_optimization.offload_param.device' is nvme but no 'nvme_path' names the folder on the NVMe drive to "
     "offload to; give one"),  # an AssertionError
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}}, "x.json: "
     "'zero_optimization.offload_optimizer.device' nvme needs DeepSpeed's async_io op, which cannot be built here "
     "(it needs libaio: e.g. apt install libaio-dev); offload to \"cpu\" instead"),  # a RuntimeError
    ({"zero_optimization": {"stage": 3, "zero_quantized_weights": True}}, "x.json: "
     "'zero_optimization.zero_quantized_weights' needs DeepSpeed's quantizer op, which this accelerator (cpu) has "
     "none of; remove it"),  # ValueError: This op had not been implemented on CPU backend, and exit 76
    ({"data_efficiency": {"enabled": True, "data_routing": {"enabled": True, "random_ltd": {"enabled": True}}}},
     "x.json: 'data_efficiency' needs DeepSpeed's own data loader and layers"),  # a KeyError
    ({"wandb": {"enabled": True, "project": "x"}}, "x.json: 'wandb' is not for zerollm: DeepSpeed's wandb monitor "
     "fails where wandb has no API key, and zerollm logs the run to wandb itself (--wandb online or offline); remove "
     "the section or set its 'enabled' to false"),  # a UsageError without an API key
    ({"prescale_gradients": True}, "x.json: 'prescale_gradients' is true, which DeepSpeed's ZeRO-2 does not support "
     "with reduce_scatter; remove it, or set zero_optimization.reduce_scatter to false"),  # AssertionErrors
    ({"gradient_predivide_factor": 2.0}, "x.json: 'gradient_predivide_factor' is 2.0, which DeepSpeed's ZeRO-2 does "
     "not support with reduce_scatter; remove it, or set zero_optimization.reduce_scatter to false"),
    ({"prescale_gradients": True, "zero_optimization": {"stage": 3}}, "x.json: 'prescale_gradients' is true, which "
     "DeepSpeed's ZeRO-3 does not support with reduce_scatter; remove it, or set zero_optimization.reduce_scatter to "
     "false"),  # only ZeRO-2's was refused: an AssertionError traceback
    ({"gradient_predivide_factor": 2.0, "zero_optimization": {"stage": 3}}, "x.json: 'gradient_predivide_factor' is "
     "2.0, which DeepSpeed's ZeRO-3 does not support with reduce_scatter; remove it, or set "
     "zero_optimization.reduce_scatter to false"),
    ({"tensor_parallel": {"autotp_size": 2}}, "x.json: 'tensor_parallel' would not apply: zerollm's model has no "
     "tensor parallelism DeepSpeed can find; remove the section (each rank holds the whole model, or its ZeRO-3 "
     "share)"),  # an AssertionError traceback in every rank

    ({"sequence_parallel_size": 2}, "x.json: 'sequence_parallel_size' is 2, but zerollm's model has no sequence "
     "parallelism; remove it (each rank trains on whole sequences)"),  # an AssertionError
    ({"compile": {"enabled": True}}, "x.json: 'compile' would not apply: zerollm never calls DeepSpeed's "
     "engine.compile(); remove the section"),  # a ValidationError
    ({"optimizer": {"type": "Muon", "params": {}}, "zero_optimization": {"stage": 3}}, "x.json: 'optimizer.type' "
     "Muon under ZeRO-3 needs \"reduce_scatter\": false in zero_optimization (DeepSpeed's ZeRO-3 does not "
     "reduce-scatter Muon's gradients)"),  # a ValueError as the engine is built
    ({"optimizer": {"type": "Adagrad", "params": {}}}, "x.json: 'optimizer.type' Adagrad is torch's Adagrad, which "
     "DeepSpeed's ZeRO (stage 2) fails on; set zero_optimization.stage to 0, or offload_optimizer to the cpu "
     "(DeepSpeed's CPU Adagrad)"),  # an IndexError at the first step
    ({"checkpoint": {"load_universal": True}}, "x.json: 'checkpoint.load_universal' makes a resume from zerollm's own "
     "checkpoints fail; remove it (zerollm converts a checkpoint to universal itself when the number of ranks "
     "changes)"),  # an AssertionError on resuming
    # DeepSpeed takes LOCAL_RANK for a rank's place on its node, which it is not for a rank that sees one GPU (its
    # LOCAL_RANK is 0, the GPU's index): a resume hung until the collective timeout (ZeRO-3 on 2 CPU ranks of
    # LOCAL_RANK 0, or resumed on 2 ranks from 1), or every such rank wrote the same model-states file
    ({"zero_optimization": {"stage": 3, "pipeline_loading_checkpoint": True}}, "x.json: "
     "'zero_optimization.pipeline_loading_checkpoint' is not for zerollm: DeepSpeed passes the load from rank to rank "
     "by LOCAL_RANK, and a resume hangs on a job of several nodes, of ranks that each see one GPU, or of another "
     "number of ranks than saved; remove it"),
    ({"checkpoint": {"writer": {"type": "python"}}}, "x.json: 'checkpoint.writer' is not for zerollm: DeepSpeed's "
     "checkpoint writers fail as its engine starts in zerollm's jobs"),  # KeyError: 'CROSS_SIZE' in every rank
    ({"checkpoint": {"writer": {"type": "decoupled"}}}, "x.json: 'checkpoint.writer' is not for zerollm"),
    ({"checkpoint": {"writer": {}}}, "x.json: 'checkpoint.writer' is not for zerollm"),  # DeepSpeed's default writer
    ({"checkpoint": {"use_node_local_storage": True}}, "x.json: 'checkpoint.use_node_local_storage' is not for "
     "zerollm: its checkpoints live in one run directory every host sees, where the option has the first rank of "
     "every node (every rank, where each sees one GPU) write the same model-states file; remove it"),
    ({"autotuning": {"enabled": True}}, "x.json: 'autotuning' is not for zerollm: DeepSpeed would end the run after "
     "its profiling steps, without a checkpoint (zerollm bench train measures throughput); remove the section or set "
     "its 'enabled' to false"),  # the run ended early with exit status 0
    # silently ignored: nothing calls deepspeed.checkpointing, engine.compile() or deepspeed.comm.log_summary()
    ({"activation_checkpointing": {"partition_activations": True}}, "x.json: 'activation_checkpointing' would not "
     "apply: zerollm's model does not checkpoint activations through DeepSpeed; remove the section"),
    ({"compile": {"deepcompile": True}}, "x.json: 'compile' would not apply"),
    ({"comms_logger": {"enabled": True, "prof_all": True}}, "x.json: 'comms_logger' is not for zerollm: zerollm "
     "never prints DeepSpeed's communication summary; remove the section or set its 'enabled' to false"),
    # misspelt: DeepSpeed ignores a key it does not know
    ({"schedular": {"type": "WarmupLR", "params": {}}}, "x.json: 'schedular' is not a setting DeepSpeed knows (it "
     "would ignore it); did you mean 'scheduler'? Correct its name"),
    ({"zero_optimisation": {"stage": 3}}, "x.json: 'zero_optimisation' is not a setting DeepSpeed knows (it would "
     "ignore it); did you mean 'zero_optimization'? Correct its name"),
    ({"gradient_clippin": 1.0}, "x.json: 'gradient_clippin' is not a setting DeepSpeed knows (it would ignore it); "
     "did you mean 'gradient_clipping'? Correct its name"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}}, "x.json: "
     "'zero_optimization': partial offloading only supported for ZeRO Stage 3."),  # was the section cut short:
    # "'zero_optimization' is {\"stage\": 2, \"overlap_comm\": false, \"contiguous_gradients\": : assertion failed, ..."
    ({"bf16": {"enabled": "true"}}, "x.json: 'bf16.enabled' is \"true\"; give true, false or \"auto\""),  # was
    # "'bf16.enabled' is \"true\" but this run trains in bf16"
    # cut short, or another trainer's name: the batch and clipping the user wrote went unused, without a word
    ({"train_micro_batch_size": 4}, "x.json: 'train_micro_batch_size' is not a setting DeepSpeed knows (it would "
     "ignore it); did you mean 'train_micro_batch_size_per_gpu'? Correct its name"),
    ({"gradient_accumulation": 4}, f"x.json: 'gradient_accumulation' {UNKNOWN} did you mean "
     "'gradient_accumulation_steps'? Correct its name"),
    ({"gradient_clip": 1.0}, f"x.json: 'gradient_clip' {UNKNOWN} did you mean 'gradient_clipping'? Correct its name"),
    ({"micro_batch_size": 4}, f"x.json: 'micro_batch_size' {UNKNOWN} did you mean 'train_micro_batch_size_per_gpu'? "
     "Correct its name"),
    ({"max_grad_norm": 1.0}, f"x.json: 'max_grad_norm' {UNKNOWN} did you mean 'gradient_clipping'? Correct its name"),
    ({"lr": 1e-3}, "x.json: 'lr' is not a setting DeepSpeed knows (it would ignore it); did you mean "
     "'optimizer.params.lr'? Put it there"),
    # values only DeepSpeed's reading of the config checks: a traceback in every rank (two ranks: exit 76, resume)
    ({"communication_data_type": "int8"}, "x.json: DeepSpeed cannot use it: Invalid communication_data_type. "
     "Supported data types: ['fp16', 'bf16', 'fp32']. Got: int8"),
    ({"checkpoint": {"tag_validation": "Nope"}}, "x.json: DeepSpeed cannot use it: Checkpoint config contains invalid "
     "tag_validation value of NOPE"),
    ({"data_types": {"param_dtype": "bogus"}}, "x.json: 'data_types.param_dtype' is \"bogus\", not a dtype DeepSpeed "
     "knows: fp32, bf16 or fp16"),
    ({"data_types": {"buffer_dtype": 16}}, "x.json: 'data_types.buffer_dtype' is 16, not a dtype DeepSpeed knows"),
    ({"data_types": {"param_dtype": "bf16"}}, "x.json: 'data_types.param_dtype' is \"bf16\" but this run trains in "
     "fp32 (train.precision); remove it, or make them equal"),
    ({"data_types": {"buffer_dtype": "bf16"}}, "x.json: 'data_types.buffer_dtype' is \"bf16\", which would cast "
     "RoPE's tables, kept in fp32 in every precision; remove it"),
    ({"gradient_allreduce_op": "max"}, "x.json: DeepSpeed cannot use it: Invalid gradient_allreduce_op"),
    ({"wall_clock_breakdown": "x"}, "x.json: DeepSpeed cannot use it: unsupported operand"),
    ({"checkpoint": "x"}, "x.json: 'checkpoint' must be a JSON object {...}, got \"x\""),
    ({"pipeline": [1]}, "x.json: 'pipeline' must be a JSON object {...}, got [1]"),
    # DeepSpeed divides by it, at any stage: a ZeroDivisionError at the first step of ZeRO-0, the run folder written
    ({"gradient_predivide_factor": 0, "zero_optimization": {"stage": 0}}, "x.json: 'gradient_predivide_factor' must "
     "be a number above 0, got 0"),
    ({"gradient_predivide_factor": "x", "zero_optimization": {"stage": 0}}, "x.json: 'gradient_predivide_factor' "
     "must be a number above 0, got \"x\""),
    # trained in another precision than the run says and records (bf16 autocast on an fp32 run)
    ({"torch_autocast": {"enabled": True}}, "x.json: 'torch_autocast' would run the model in another precision than "
     "train.precision, which the run records and says: remove the section, or set train.precision=bf16 (or fp16) for "
     "mixed precision"),
])
def test_ds_config_deepspeed_would_fail_on_is_one_line(monkeypatch, change, message):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, package=None: None)  # tensorboard, mup: not here
    monkeypatch.setattr(engine, "async_io_builds", lambda: False)  # no libaio here
    with pytest.raises(UserError) as raised:
        resolved(change)
    assert str(raised.value).startswith(message), str(raised.value)


def test_ds_config_refusals_leave_what_applies_alone():
    """What is near a refused setting but works is taken: a key DeepSpeed does not know and that is no typo of one it
    does (DeepSpeed ignores it: other tools' keys), offload where the stage does it or not (DeepSpeed-Chat writes
    offload_param at stage 2; --zero-stage may lower the stage of Hugging Face's zero3.json), sections that ask for
    nothing (compile's defaults include true values)."""
    assert {"scheduler", "zero_optimization", "gradient_clipping", "vocabulary_size"} <= engine.deepspeed_keys()
    ds = resolved({"comment": "mine", "vocabulary_size": 512, "compile": {"deepcompile": False, "double_buffer": True},
                   "wandb": {"enabled": False}, "comms_logger": {"enabled": False}, "sequence_parallel_size": 1,
                   "prescale_gradients": 0, "gradient_predivide_factor": 1.0,
                   "checkpoint": {"load_universal": False, "use_node_local_storage": False, "writer": None},
                   "sequence_parallel": False, "lr_scheduler": None, "tensor_parallel_size": 1})
    assert ds["comment"] == "mine"
    assert resolved({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})
    offloaded = {"stage": 1, "offload_optimizer": {"device": "cpu"}}
    adagrad = {"type": "Adagrad", "params": {}}
    assert resolved({"zero_optimization": offloaded, "optimizer": adagrad})["optimizer"]["type"] == "Adagrad"
    assert resolved({"zero_optimization": {"stage": 0}, "optimizer": adagrad})["optimizer"]["type"] == "Adagrad"
    assert resolved({"zero_optimization": {"stage": 2, "reduce_scatter": False}, "prescale_gradients": True})
    assert resolved({"zero_optimization": {"stage": 3, "pipeline_loading_checkpoint": False}})
    assert resolved({"data_types": {"param_dtype": "fp32", "buffer_dtype": "fp32"},
                     "torch_autocast": {"enabled": False}, "gradient_predivide_factor": 2,
                     "zero_optimization": {"stage": 0}})
    assert resolved({"data_types": {"buffer_dtype": "fp32"}}, precision="bf16")  # RoPE's tables stay fp32


def test_ds_config_in_deepspeeds_older_words_means_what_it_says():
    """"bfloat16" (bf16's older name) was overridden: a "bf16" section filled beside it turned bf16 off in fp32 runs."""
    raw, _ = load_ds_config(None, "pretrain")
    raw = {**{key: value for key, value in raw.items() if key != "bf16"}, "bfloat16": {"enabled": True}}
    with pytest.raises(UserError, match="'bf16.enabled' is true but this run trains in fp32 "):
        resolve_ds_config(raw, build_config("demo", ["train.precision=fp32"]), 1, "x.json")
    assert resolve_ds_config(raw, build_config("demo", ["train.precision=bf16"]), 1, "x.json")["bf16"]["enabled"]


@pytest.mark.parametrize("steps", [0, -3, 2.5, "10", True, float("inf"), float("nan")])  # int(inf) was a traceback
def test_ds_config_steps_per_print_below_one_is_refused(steps):
    with pytest.raises(UserError, match=r"x.json: 'steps_per_print' must be a whole number >= 1 \(or null: never\), "
                                        f"got {json.dumps(steps)}$"):
        resolved({"steps_per_print": steps})
    assert resolved({"steps_per_print": None})["steps_per_print"] is None
    assert resolved({"steps_per_print": 10.0})["steps_per_print"] == 10  # a whole number, as DeepSpeed takes it


@pytest.mark.parametrize("zero, message", [
    ({"stage": 2, "bogus": 1},
     "x.json: 'zero_optimization.bogus' is not one of DeepSpeed's ZeRO settings; remove it or correct its name$"),
    ({"stage": 2, "reduce_bucket_size": -5},
     "x.json: 'zero_optimization.reduce_bucket_size' is -5: input should be greater than 0$"),
    ({"stage": 2, "reduce_bucket_size": "big"},
     "x.json: 'zero_optimization.reduce_bucket_size' is \"big\": input should be a valid integer"),
    ({"stage": 3, "offload_optimizer": {"device": "gpu"}},
     "x.json: 'zero_optimization.offload_optimizer.device' is \"gpu\": input should be 'none', 'cpu' or 'nvme'$"),
    ({"stage": 2, "allgather_bucket_size": "auto"}, "x.json: no run-config value fills \"auto\" at "
                                                    "zero_optimization.allgather_bucket_size; give it a value$"),
    # DeepSpeed took them, and the first backward failed to allocate 4 TB (or overflowed) in a traceback
    *[({"stage": stage, key: size}, f"x.json: 'zero_optimization.{key}' is {size}, more than 4,294,967,296 elements "
                                    r"\(DeepSpeed allocates a buffer of that many\); give a smaller bucket "
                                    r"\(DeepSpeed's defaults: 5e8, and 5e7 for the prefetch bucket\)$")
      for stage, key, size in ((2, "reduce_bucket_size", 10**12), (2, "allgather_bucket_size", 10**40),
                               (3, "stage3_prefetch_bucket_size", 10**13),
                               (3, "prefetch_bucket_size", 10**13))],  # the model's own name: a KeyError
])
def test_ds_config_zero_section_deepspeed_refuses_is_one_line(zero, message):
    with pytest.raises(UserError, match=message):
        resolved({"zero_optimization": zero})


def test_a_zero_stage_written_as_a_float_is_that_stage_and_a_switch_written_1_is_true():
    """2.0 was taken, and the run announced "ZeRO stage 2.0". bf16.enabled 1, which DeepSpeed reads as true, is
    true (refusing "true" as text refused 1 too)."""
    stage = resolved({"zero_optimization": {"stage": 2.0}})["zero_optimization"]["stage"]
    assert stage == 2 and type(stage) is int
    assert resolved({"bf16": {"enabled": 1}}, precision="bf16")["bf16"]["enabled"] is True
    assert resolved({"bf16": {"enabled": 0}})["bf16"]["enabled"] is False


def test_optimizer_offload_is_dropped_without_zero():
    """At stage 0 (a zero3.json with --zero-stage 0) DeepSpeed offloads nothing but still built its CPU Adam from
    offload_optimizer, which fails at the first step on a GPU's parameters ("CPUAdam param is on cuda:0 and must be
    'cpu'"); the run trains with the device's own optimizer instead."""
    offloaded = {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}
    ds = resolved({"zero_optimization": {"stage": 0, **offloaded}})
    assert ds["zero_optimization"] == {"stage": 0, "offload_param": {"device": "cpu"}}
    assert resolved({"zero_optimization": {"stage": 1, **offloaded}})["zero_optimization"] == {"stage": 1, **offloaded}
    older = resolved({"zero_optimization": {"stage": 0, "cpu_offload": True}})  # DeepSpeed's older name: it was kept
    assert older["zero_optimization"] == {"stage": 0} and older["optimizer"]["params"].get("torch_adam") is True


def test_parameter_offload_below_zero_3_is_noted():
    """DeepSpeed offloads parameters under ZeRO-3 only: at stage 1 or 2 the run trained with every parameter on the
    device, without a word (it is taken, as DeepSpeed-Chat writes it at stage 2)."""
    said = ("note: zero_optimization.offload_param offloads parameters under ZeRO stage 3 only: at stage {} every "
            "parameter stays on the device (--zero-stage 3 offloads them)")
    for stage in (0, 1, 2):  # stage 0 had none: --zero-stage 0 over a ZeRO-3 offload config
        ds = resolved({"zero_optimization": {"stage": stage, "offload_param": {"device": "cpu"}}})
        assert engine.parameter_offload_note(ds) == said.format(stage)
    for zero in ({"stage": 3, "offload_param": {"device": "cpu"}}, {"stage": 2, "offload_param": {"device": "none"}},
                 {"stage": 2}):
        assert engine.parameter_offload_note(resolved({"zero_optimization": zero})) is None


def test_ds_config_zero_section_of_every_shipped_config_and_an_offload_pass():
    for path in sorted(FIXTURES.parents[1].joinpath("ds_configs").glob("*.json")):
        raw, source = load_ds_config(path, "pretrain")
        resolve_ds_config(raw, build_config("demo", ["train.precision=fp32"]), 2, source)
    # the optimizer is DeepSpeed's CPU Adam under an offload: its parameters are checked against that class
    offloaded = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    adam = {"type": "AdamW", "params": {"fp32_optimizer_states": True}}
    assert resolved({"zero_optimization": offloaded, "optimizer": adam})["optimizer"]["params"]["betas"] == [0.9, 0.95]
    with pytest.raises(UserError, match="'optimizer.params.adamw_mode' is not a parameter of AdamW"):
        resolved({"zero_optimization": offloaded, "optimizer": {"type": "AdamW", "params": {"adamw_mode": True}}})


@pytest.mark.parametrize("change, message", [
    ({"bf16": {"enabeld": True}}, "'bf16.enabeld' is not one of DeepSpeed's bf16 settings; remove it or correct"),
    ({"fp16": {"enabled": "auto", "loss_scal": 0}}, "'fp16.loss_scal' is not one of DeepSpeed's fp16 settings; "),
    ({"fp16": {"loss_scale": -1}}, r"'fp16.loss_scale' is -1: fp16.loss_scale must be >= 0 \(0 enables dynamic "),
    ({"tensorboard": {"enabled": False, "outputpath": "x"}},
     "'tensorboard.outputpath' is not one of DeepSpeed's monitor settings; remove it or correct its name$"),
    ({"csv_monitor": [1]}, r"'csv_monitor' must be a JSON object \{...\}, got \[1\]$"),
    ({"optimizer": {"type": "AdamW", "parms": {"lr": 1e-5}}},
     r"'optimizer.parms' is not a key DeepSpeed reads in 'optimizer' \(it reads type, params, legacy_fusion\); "),
    ({"scheduler": {"type": "WarmupLR", "parmas": {}}}, r"'scheduler.parmas' is not a key DeepSpeed reads in "),
])
def test_a_bad_key_in_the_precision_monitor_optimizer_or_scheduler_sections_is_named(change, message):
    """DeepSpeed's models of the precision and monitor sections refused them in every rank with a ValidationError
    traceback, which two ranks reported as a failed node (exit 76); a misspelt key in the optimizer or scheduler
    section was ignored, the run config's values used in its place."""
    with pytest.raises(UserError, match="^x.json: " + message):
        resolved(change)
    hugging_face_fp16 = {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
                         "hysteresis": 2, "min_loss_scale": 1}
    assert resolved({"fp16": hugging_face_fp16, "bf16": {"enabled": "auto"}})["fp16"]["enabled"] is False


SHIPPED_PRETRAIN = json.loads((FIXTURES.parents[1] / "ds_configs" / "pretrain.json").read_text())


@pytest.mark.parametrize("name, ds_config, message", [
    ("no_print", {**SHIPPED_PRETRAIN, "steps_per_print": 0},
     "no_print.json: 'steps_per_print' must be a whole number >= 1 (or null: never), got 0"),
    ("bogus", {**SHIPPED_PRETRAIN, "zero_optimization": {"stage": 2, "bogus": 1}},
     "bogus.json: 'zero_optimization.bogus' is not one of DeepSpeed's ZeRO settings; remove it or correct its name"),
    ("node_local", {**SHIPPED_PRETRAIN, "checkpoint": {"use_node_local_storage": True}},
     "node_local.json: 'checkpoint.use_node_local_storage' is not for zerollm"),
])
def test_train_with_a_bad_deepspeed_config_exits_2_with_one_line_once(pretrain_data, tmp_path, name, ds_config,
                                                                      message):
    """Every rank finds the mistake; the job says it once (it said it once per rank)."""
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(ds_config))
    result = run_job(*train_args(pretrain_data, tmp_path / "run", "train.max_steps=2", "train.precision=fp32",
                                 nproc=2, extra=["--deepspeed", path]))
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.count("zerollm: error:") == 1, result.stderr[-3000:]
    assert f"zerollm: error: {path.parent}/{message}" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("name, ds_config, message", [
    ("deep", "[" * 100_000, "deep.json: invalid JSON (nested too deeply)"),
    ("missing", None, "missing.json: DeepSpeed config not found (give a JSON file, or a shipped one by name: "
                      "distill, dpo, grpo, pretrain, pretrain_zero3, sft)"),
])
def test_an_unreadable_deepspeed_config_is_refused_before_any_rank_starts(pretrain_data, tmp_path, monkeypatch, name,
                                                                          ds_config, message):
    """`--nproc 2` reads the JSON before it starts ranks (each rank read it, and said so unless the first to fail
    had the other killed first): one line, and no rank started (a `sitecustomize` notes every Python process
    started with a rank's RANK variable)."""
    path = tmp_path / f"{name}.json"
    if ds_config is not None:
        path.write_text(ds_config)
    hook, started = tmp_path / "hook", tmp_path / "ranks_started"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(f"import os\nif 'RANK' in os.environ:\n    open({str(started)!r}, 'a')\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")])))
    result = run_cli(*train_args(pretrain_data, tmp_path / "run", nproc=2, extra=["--deepspeed", path]))
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr == f"zerollm: error: {path.parent}/{message}\n"
    assert result.stdout == "" and not (tmp_path / "run").exists() and not started.exists()


HF_ZERO3 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16, "hysteresis": 2,
             "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True, "contiguous_gradients": True,
        "sub_group_size": 1e9, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}
"""The Hugging Face Trainer's zero3.json habit (ZeRO-3, parameters and optimizer offloaded to the CPU, every size and
batch "auto"), without its "scheduler" section: DeepSpeed's schedule would replace the run config's, which the
shipped runs it is compared with follow (tests/test_ds_scheduler.py)."""


def test_zero_sizes_left_auto_as_hugging_face_leaves_them_are_filled_from_the_width():
    """As its Trainer fills them from hidden_size (they were refused: no run-config value filled them)."""
    cfg = build_config("demo", ["train.precision=fp32"])
    dim = cfg.model.dim
    zero = resolve_ds_config(HF_ZERO3, cfg, 2, "zero3.json")["zero_optimization"]
    assert (zero["reduce_bucket_size"], zero["stage3_prefetch_bucket_size"],
            zero["stage3_param_persistence_threshold"]) == (dim * dim, int(0.9 * dim * dim), 10 * dim)
    given = {**HF_ZERO3, "zero_optimization": {**HF_ZERO3["zero_optimization"], "reduce_bucket_size": 5e8}}
    assert resolve_ds_config(given, cfg, 2, "zero3.json")["zero_optimization"]["reduce_bucket_size"] == 5e8


def test_hugging_face_zero3_offload_config_trains_as_the_shipped_one(zero_runs, pretrain_data, tmp_path):
    """Offloaded to the CPU (DeepSpeed's CPU Adam, compiled on its first use on a machine), the session's ZeRO-3 job
    takes the same steps as with ds_configs/pretrain.json: the first loss equal, the rest within float rounding."""
    path = tmp_path / "zero3.json"
    path.write_text(json.dumps(HF_ZERO3))
    result = run_job(*train_args(pretrain_data, tmp_path / "run", *ZERO_RUN, nproc=2, extra=["--deepspeed", path]))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    zero = json.loads((tmp_path / "run" / "ds_config.json").read_text())["zero_optimization"]
    assert zero["offload_optimizer"]["device"] == zero["offload_param"]["device"] == "cpu"

    def losses(run):
        return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]

    offloaded, shipped = losses(tmp_path / "run"), losses(zero_runs[3])
    assert len(offloaded) == len(shipped) == 4 and offloaded[0] == shipped[0]
    assert offloaded == pytest.approx(shipped, rel=1e-5)


def copy_tokenizer(tmp_path, config: dict | None = None):
    shutil.copy(MINIMIND / "tokenizer.json", tmp_path / "tokenizer.json")
    if config is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return json.loads((MINIMIND / "tokenizer_config.json").read_text())


def test_tokenizer_config_nested_too_deeply_is_refused(tmp_path):
    copy_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("[" * 100_000)
    with pytest.raises(UserError, match=r"tokenizer_config.json: invalid JSON \(nested too deeply\)$"):
        Tokenizer.load(tmp_path)


@pytest.mark.parametrize("content, problem", [
    (b'{"x": "\xff"}', r"not UTF-8 \(byte 0xff at offset 7\); save the tokenizer config as UTF-8 JSON"),  # a traceback
    (b'{"x": 1,\n}', r"2:1: invalid JSON \(Expecting property name enclosed in double quotes\)"),
    (b"[1]", r"the tokenizer config must be a JSON object {...}, got \[1\]"),
])
def test_tokenizer_config_that_is_not_a_utf8_json_object_is_one_line(tmp_path, content, problem):
    """The tokenizer config is read like the DeepSpeed config and an import's config.json (one reader)."""
    copy_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_bytes(content)
    separator = ":" if problem[0].isdigit() else ": "
    with pytest.raises(UserError, match=f"^{tmp_path}/tokenizer_config.json{separator}{problem}$"):
        Tokenizer.load(tmp_path)


def test_chat_template_file_that_is_not_utf8_is_refused(tmp_path):
    copy_tokenizer(tmp_path)
    (tmp_path / "chat_template.jinja").write_bytes(b"{{ '\xff' }}")
    with pytest.raises(UserError, match=f"^{tmp_path}/chat_template.jinja: not UTF-8 \\(byte 0xff at offset 4\\); "
                                        "save the chat template as UTF-8$"):
        Tokenizer.load(tmp_path)


@pytest.mark.parametrize("entry", [{"name": ["x"], "template": "a"}, {"name": "default", "template": 7}, 1,
                                   {"template": "a"}])
def test_named_chat_templates_of_the_wrong_shape_are_refused(tmp_path, entry):
    config = copy_tokenizer(tmp_path)
    copy_tokenizer(tmp_path, {**config, "chat_template": [{"name": "tool_use", "template": "b"}, entry]})
    with pytest.raises(UserError, match=f"^{tmp_path}: 'chat_template' in tokenizer_config.json is a list of named "
                                        "templates .* one entry is "):
        Tokenizer.load(tmp_path)


def test_named_chat_templates_pick_the_default(tmp_path):
    config = copy_tokenizer(tmp_path)
    named = [{"name": "tool_use", "template": "b"}, {"name": "default", "template": config["chat_template"]}]
    copy_tokenizer(tmp_path, {**config, "chat_template": named})
    assert Tokenizer.load(tmp_path).chat_template == config["chat_template"]


@pytest.mark.parametrize("given", [5, {"template": "x"}])
def test_a_chat_template_that_is_not_a_string_is_said_as_it_is(tmp_path, given):
    """It was 'the tokenizer has no chat template (tokenizer_config.json has no 'chat_template' and the vocabulary no
    <|im_start|>/<|im_end|>)': both false. Pretraining needs no template, so the tokenizer still loads."""
    config = copy_tokenizer(tmp_path)
    copy_tokenizer(tmp_path, {**config, "chat_template": given})
    tokenizer = Tokenizer.load(tmp_path)
    with pytest.raises(UserError, match=f"^{tmp_path}: 'chat_template' in tokenizer_config.json is "
                                        f"{re.escape(json.dumps(given))}, not a template string; fix or remove it$"):
        tokenizer.encode_chat([{"role": "user", "content": "hi"}], add_generation_prompt=True)


def test_an_empty_chat_template_is_none(tmp_path):
    """An empty one left a tokenizer with <|im_start|>/<|im_end|> without the ChatML template it gets without one."""
    config = copy_tokenizer(tmp_path)
    copy_tokenizer(tmp_path, {**config, "chat_template": ""})
    assert Tokenizer.load(tmp_path).chat_template == CHAT_TEMPLATE


def test_deepspeed_config_and_chat_template_that_cannot_be_read_are_refused(tmp_path, monkeypatch):
    """A file the user may not read (root reads every file, so the refusal is simulated)."""
    open_file = pathlib.Path.open

    def refused(path, *args, **kwargs):
        if path.suffix in (".jinja", ".json") and path.name != "tokenizer.json" and path.parent == tmp_path:
            raise PermissionError(13, "Permission denied")
        return open_file(path, *args, **kwargs)

    copy_tokenizer(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("{{ 'hi' }}")
    (tmp_path / "ds.json").write_text("{}")
    monkeypatch.setattr(pathlib.Path, "open", refused)
    with pytest.raises(UserError, match=f"^{tmp_path}/ds.json: cannot be read \\(Permission denied\\)$"):
        load_ds_config(tmp_path / "ds.json", "pretrain")
    with pytest.raises(UserError, match=f"^{tmp_path}/chat_template.jinja: cannot be read \\(Permission denied\\)$"):
        Tokenizer.load(tmp_path)


@pytest.mark.parametrize("damage, reason", [
    (lambda kept: (kept / "tokenizer.json").write_text((MINIMIND / "tokenizer.json").read_text()[:1000]),
     "cannot load tokenizer ("),
    (lambda kept: (kept / "tokenizer.json").unlink(), "no tokenizer.json)"),
])
def test_a_run_s_damaged_tokenizer_copy_is_named_with_where_to_copy_it_from(tmp_path, damage, reason):
    """A kill during the first start's copy left RUN/tokenizer partial, and every later start was refused with
    advice to train a tokenizer (`zerollm tokenizer train`). The copy is made whole or not at all now; one that an
    earlier version left partial is named, with the data's tokenizer to copy it from again."""
    from llm.train.job import check_tokenizer

    data, run = tmp_path / "data", tmp_path / "run"
    shutil.copytree(MINIMIND, data / "tokenizer")
    shutil.copytree(MINIMIND, run / "tokenizer")
    damage(run / "tokenizer")
    cfg = build_config("demo", paths={"data.path": str(data)})
    with pytest.raises(UserError) as refused:
        check_tokenizer(run, cfg, Tokenizer.load(data / "tokenizer").hash)
    message = str(refused.value)
    assert message.startswith(f"{run / 'tokenizer'} is damaged (") and reason in message, message
    assert message.endswith(f"; it is this run's copy of its input's tokenizer: delete it, and the next start copies "
                            f"it again from {data / 'tokenizer'}") and "tokenizer train" not in message, message


def test_a_slow_tokenizers_folder_is_told_how_to_write_tokenizer_json(tmp_path):
    """A Hugging Face folder of GPT-2's vocab.json and merges.txt, or SentencePiece's tokenizer.model, without a
    tokenizer.json was told to give a Hugging Face tokenizer directory, which it is."""
    (tmp_path / "vocab.json").write_text("{}")
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    with pytest.raises(UserError) as refused:
        Tokenizer.load(tmp_path)
    assert str(refused.value) == (f"{tmp_path}: no tokenizer.json (vocab.json and merges.txt are a slow tokenizer's, "
                                  "which zerollm does not read; write tokenizer.json with transformers: "
                                  "AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR))")


def test_a_folder_whose_tokenizer_is_one_level_down_is_pointed_there(tmp_path):
    """`--tokenizer DATA` (a prepared data folder, or a run) said only 'no tokenizer.json'."""
    (tmp_path / "tokenizer").mkdir()
    copy_tokenizer(tmp_path / "tokenizer")
    with pytest.raises(UserError, match=f"^{tmp_path}: no tokenizer.json \\(its tokenizer is in "
                                        f"{tmp_path / 'tokenizer'}: give that\\)$"):
        Tokenizer.load(tmp_path)
