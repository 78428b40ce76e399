"""Models from disk: a run directory (its newest complete checkpoint, any ZeRO stage and world size) or an export
directory (ours, or a Llama model saved by `transformers`), for inference, export and `--init-from`.

Nothing read here is unpickled beyond tensors and plain values (`llm.train.checkpoint.restricted_unpickling`);
exports are safetensors and JSON."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from llm import durable, rundir
from llm.config import ModelConfig, RunConfig, build_config, settable_key
from llm.data.prepare import RANDOM_TOKENS_HASH
from llm.errors import UserError
from llm.export import (
    HF_CONFIG_FILE,
    WEIGHTS_FILE,
    WEIGHTS_INDEX_FILE,
    attention_window,
    drop_tied_copy,
    export_model_config,
    import_model,
    weight_files,
)
from llm.infer.suggested_sampling import declared_stop_ids
from llm.model import Transformer
from llm.model.from_weights import model_from_weights
from llm.model.host_memory import check_fits_in_memory
from llm.model.lora import apply_lora, merge
from llm.runtime.fingerprint import WEIGHTS_PARTS, file_digest, same_weights, strided_digest
from llm.tokenizer import TOKENIZER_FILE, Tokenizer, no_tokenizer_json_advice
from llm.train.checkpoint import (
    config_mismatch,
    is_partitioned,
    mismatch_reason,
    restricted_unpickling,
    weight_decayed,
)
from llm.train.run_record import last_record

T = TypeVar("T")

READ_ATTEMPTS = 5
"""How many times `newest_checkpoint` chooses the newest checkpoint again when a training saving meanwhile pruned
the one it chose before it was read."""


def consolidated_weights(run_dir: Path, tag: str | None = None) -> dict[str, torch.Tensor]:
    """Full fp32 model weights of a checkpoint of any ZeRO stage and world size, on the CPU: `tag`, or the newest
    complete checkpoint (`newest_checkpoint`). No file is unpickled beyond tensors and plain values."""
    if tag is not None:
        return _checkpoint_weights(run_dir, tag)
    return newest_checkpoint(run_dir, lambda newest: _checkpoint_weights(run_dir, newest))[1]


def newest_checkpoint(run_dir: Path, read: Callable[[str], T]) -> tuple[str, T]:
    """(tag, read(tag)) for the newest complete checkpoint (`rundir.usable_tag`) at the moment it is read: one that
    a training still saving into the run prunes (train.keep_checkpoints) while it is chosen or read is replaced by
    the newest then, `READ_ATTEMPTS` times at most. Pruned while chosen: `latest` read, then the checkpoint it named
    pruned as its files were listed (the run was said to hold no complete checkpoint, or a FileNotFoundError
    traceback); while read: a file gone (FileNotFoundError, or torch's RuntimeError for a file it maps)."""
    for _ in range(READ_ATTEMPTS):
        latest, tag = rundir.latest_tag(run_dir), None
        try:
            tag = rundir.usable_tag(run_dir)
            if tag is None:
                raise UserError(f"{run_dir}: no checkpoint found (expected "
                                f"{rundir.checkpoint_dir(run_dir) / rundir.LATEST})")
            return tag, read(tag)
        except (FileNotFoundError, UserError, RuntimeError):
            gone = not (rundir.checkpoint_dir(run_dir) / tag).is_dir() if tag is not None else \
                rundir.latest_tag(run_dir) != latest
            if not gone:
                raise  # the checkpoint's own problem, not a training's prune
    raise UserError(f"{run_dir}: a training is saving checkpoints faster than they can be read (the newest one was "
                    f"pruned before it was read, {READ_ATTEMPTS} times); retry, or raise train.keep_checkpoints")


def _checkpoint_weights(run_dir: Path, tag: str) -> dict[str, torch.Tensor]:
    """`consolidated_weights` of checkpoint `tag`, which must be complete."""
    if (problem := rundir.incompleteness(run_dir, tag)) is not None:
        raise UserError(f"{rundir.checkpoint_dir(run_dir) / tag}: incomplete checkpoint ({problem})")
    with restricted_unpickling(rundir.checkpoint_dir(run_dir) / tag):
        if is_partitioned(run_dir, tag):
            from deepspeed.utils.zero_to_fp32 import (  # noqa: PLC0415 - deepspeed only after the accelerator is chosen
                get_fp32_state_dict_from_zero_checkpoint,
            )

            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                return get_fp32_state_dict_from_zero_checkpoint(str(rundir.checkpoint_dir(run_dir)), tag=tag)
        state = torch.load(rundir.checkpoint_dir(run_dir) / tag / rundir.MODEL_STATES, map_location="cpu",
                           weights_only=True)
    return _unpartitioned_weights(state)


def _unpartitioned_weights(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The fp32 weights of a checkpoint saved without ZeRO: the module's, where a bf16 or fp16 run rounded them,
    replaced by the fp32 master copies its optimizer state keeps (DeepSpeed's fp16 optimizers, bf16 too: a tensor
    per parameter, `fp32_groups`, or one per parameter group, `fp32_groups_flat`, in the groups of
    `engine.param_groups`); the module's own where the copies do not line up with it (Muon's groups, which DeepSpeed
    splits its own way)."""
    module = state["module"]
    weights = {name: tensor.float() for name, tensor in module.items()}
    optimizer = state.get("optimizer")
    masters = (optimizer.get("fp32_groups") or optimizer.get("fp32_groups_flat")) if isinstance(optimizer, dict) \
        else None
    if not masters or all(tensor.dtype == torch.float32 for tensor in module.values()):
        return weights
    first: dict[tuple, str] = {}  # each parameter once: a tied output matrix is its embeddings
    for name, tensor in module.items():
        first.setdefault((tensor.data_ptr(), tensor.shape), name)
    trained = list(first.values())
    groups = [[n for n in trained if weight_decayed(module[n])], [n for n in trained if not weight_decayed(module[n])]]
    groups = [names for names in groups if names]  # DeepSpeed drops an empty group (a LoRA run has no vectors)
    if len(masters) != len(groups):
        return weights
    copies = {}
    for names, master in zip(groups, masters, strict=True):
        sizes = [module[n].numel() for n in names]
        if isinstance(master, torch.Tensor):  # one flat tensor: the group's parameters one after another
            master = master.split(sizes) if master.numel() == sum(sizes) else []
        if [m.numel() for m in master] != sizes:
            return weights
        copies.update((n, m.detach().float().view(module[n].shape)) for n, m in zip(names, master, strict=True))
    return {name: copies[first[tensor.data_ptr(), tensor.shape]] for name, tensor in module.items()}


def load_trained_model(run_dir: Path, tag: str | None = None) -> tuple[Transformer, RunConfig]:
    """(model in eval mode, run config) rebuilt from RUN_DIR/config.yaml and its newest checkpoint. A LoRA run's
    checkpoint holds its adapters only: they are loaded onto its --init-from model and merged into it."""
    cfg = trained_config(run_dir)
    check_fits_in_memory(cfg.model, remedy=f" ({run_dir / rundir.CONFIG_FILE})")
    if cfg.lora.r:
        return merge(load_lora_model(run_dir, cfg, tag)).eval(), cfg
    state = consolidated_weights(run_dir, tag)
    output, embeddings = state.get("output.weight"), state.get("tok_embeddings.weight")
    tied = output is None or embeddings is None or torch.equal(output, embeddings)
    why = mismatch_reason({name: tuple(tensor.shape) for name, tensor in state.items()}, tied, cfg.model)
    if why is not None:
        raise UserError(config_mismatch(run_dir, None, why))
    if cfg.model.tie_embeddings:
        drop_tied_copy(state, "tok_embeddings.weight", "output.weight")
    try:
        model = model_from_weights(cfg.model, state)
    except RuntimeError as exc:  # names that differ (another model's): torch lists every one, the first is enough
        raise UserError(config_mismatch(run_dir, None, str(exc).strip().splitlines()[0])) from None
    return model.eval(), cfg


def load_lora_model(run_dir: Path, cfg: RunConfig, tag: str | None = None) -> Transformer:
    """The unmerged LoRA model of a LoRA run: its --init-from model (which must still be where the run found it)
    with the run's adapters loaded."""
    base = cfg.train.init_from
    if not base or not Path(base).is_dir():
        raise UserError(f"{run_dir}: a LoRA run whose checkpoints hold adapters only; its base model "
                        f"(train.init_from {base}) is not there; put it back or set train.init_from in "
                        f"{rundir.config_file(run_dir)}")
    record = last_record(run_dir)
    trained_on = record["data"].get("base") if record else None
    now = weights_summary(base, "train.init_from") if trained_on is not None else None
    base_tag = None  # the base's newest checkpoint
    if now is not None and not same_weights(trained_on["weights"], now["weights"]):
        base_tag = _checkpoint_still_there(Path(base), trained_on)
        if base_tag is None:
            raise UserError(f"{run_dir}: its adapters were trained on {trained_on['path']} ({trained_on['weights']}), "
                            f"but train.init_from {base} holds {now['weights']}; merged onto other weights they would "
                            "make a wrong model: put that base back")
    if differing := model_differences(model_config_of(base), cfg.model):  # its config.json edited: other function
        raise UserError(f"{run_dir}: its adapters were trained on the model {rundir.CONFIG_FILE} records, but its base "
                        f"train.init_from {base} now differs ({'; '.join(differing)}; there is the base, here the "
                        "run); merged onto it they would make a wrong model: put that base back as it was")
    model = load_model_dir(base, base_tag)[0]
    if model.cfg.max_seq_len != cfg.model.max_seq_len:  # trained at a longer context than its base's: kept
        model = model_from_weights(dataclasses.replace(model.cfg, max_seq_len=cfg.model.max_seq_len),
                                   model.state_dict())
    adapters = consolidated_weights(run_dir, tag)
    if why := mismatch_reason({name: tuple(tensor.shape) for name, tensor in adapters.items()}, None, cfg.model,
                              cfg.lora):
        raise UserError(config_mismatch(run_dir, tag, why))
    model = apply_lora(model, cfg.lora, cfg.train.seed)
    model.load_state_dict(adapters, strict=False)  # the base's weights are in place; every adapter is there
    return model.eval()


def lora_bases(cfg: RunConfig) -> list[Path]:
    """The models a run (`cfg`) is loaded onto, nearest first: a LoRA run's train.init_from and, where that is a
    LoRA run too, its bases in turn; [] for a run that is not LoRA."""
    bases: list[Path] = []
    while cfg.lora.r and cfg.train.init_from and Path(cfg.train.init_from) not in bases:
        bases.append(Path(cfg.train.init_from))
        if not rundir.is_run_dir(bases[-1]):
            break
        cfg = trained_config(bases[-1])
    return bases


def base_to_resume_on(run_dir: Path) -> str | None:
    """The train.init_from that run directory `run_dir` records, where resuming it loads that model again: a LoRA
    run's base, a DPO or GRPO run's reference (and GRPO's tokenizer). None for other runs, whose checkpoints hold
    every weight, and where there is no run yet."""
    recorded = _recorded_run_config(run_dir)
    train, lora = recorded.get("train") or {}, recorded.get("lora") or {}
    needed = lora.get("r") or train.get("stage") in ("dpo", "grpo")
    base = (train.get("init_from") or None) if needed else None
    if base is not None and not Path(base).exists():  # said as an export without weights, naming no remedy
        raise UserError(f"{run_dir} records its base model (train.init_from) as {base}, which is not there any more; "
                        "if it was moved, resume with --init-from naming its new place")
    return base


def _checkpoint_still_there(base: Path, trained_on: dict[str, Any]) -> str | None:
    """The checkpoint of run directory `base` that a LoRA run's adapters were trained on (`trained_on`, its record
    of the base), where the base trained on since and that checkpoint is still there, complete; else None. A LoRA
    run of a base that goes on training could no longer be loaded once the base saved a newer checkpoint."""
    tag = trained_on.get("tag")
    if not (isinstance(tag, str) and rundir.is_tag(tag) and rundir.is_run_dir(base)) or \
            rundir.incompleteness(base, tag) is not None:
        return None
    return tag if f"run {rundir.client_state_of(base, tag)['run_id']} {tag}" == trained_on["weights"] else None


def is_run_or_export(directory: Path, option: str = "") -> bool:
    """True for a run directory, False for an export directory; anything else is refused, naming `option`
    (e.g. "--teacher") before the path when given."""
    if rundir.is_run_dir(directory):
        return True
    if (directory / HF_CONFIG_FILE).is_file():
        return False
    said = f"{option} " if option else ""
    if not directory.exists():
        raise UserError(f"{said}{durable.no_such_folder(directory)}")
    raise UserError(f"{said}{directory}: neither a run directory ({rundir.CONFIG_FILE}) nor an export directory "
                    f"({HF_CONFIG_FILE})")


def weights_summary(path: str | Path, option: str) -> dict[str, Any]:
    """What identifies the model of a run or export directory: its path; its weights (a run directory's run id and
    newest usable checkpoint, also as `tag`, the one to load; or the digest of an export's weight files:
    model.safetensors, or the index and every shard it names); and its config's shape and function fields (`model`:
    an edited RoPE base is another function of the same weights). `option` names it in errors."""
    directory = Path(path)
    tag = None
    if not directory.exists():
        raise UserError(f"{option} {durable.no_such_folder(directory)}")
    if rundir.is_run_dir(directory):
        tag = rundir.usable_tag(directory)
        if tag is None:
            raise UserError(f"{option} {directory}: no checkpoint found (expected "
                            f"{rundir.checkpoint_dir(directory) / rundir.LATEST}); train it first")
        weights = f"run {rundir.client_state_of(directory, tag)['run_id']} {tag}"
    else:
        try:
            files = weight_files(directory)
        except UserError as exc:
            raise UserError(f"{option} {exc}") from None
        if WEIGHTS_FILE in files:
            weights = f"{WEIGHTS_FILE} digest {file_digest(directory / WEIGHTS_FILE)}"
            shards = [WEIGHTS_FILE]
        else:  # the index and every shard it names: a shard replaced under an unchanged index is other weights
            shards = sorted(files)
            digest = hashlib.sha256()
            for shard in shards:
                digest.update(f"\0{shard}\0{file_digest(directory / shard)}".encode())
            weights = (f"{WEIGHTS_INDEX_FILE} digest {file_digest(directory / WEIGHTS_INDEX_FILE)}{WEIGHTS_PARTS}its "
                       f"{len(files)} shards digest {digest.hexdigest()[:16]}")
        strided = hashlib.sha256("".join(strided_digest(directory / shard) for shard in shards).encode())
        weights += f"{WEIGHTS_PARTS}strided digest {strided.hexdigest()[:16]}"  # a later part: `same_weights` takes
        # a record of the parts before it alone (made before it was added) as it was taken
    config = model_config_of(directory)
    model = json.loads(json.dumps({name: getattr(config, name) for name in (*SHAPE_FIELDS, *FUNCTION_FIELDS)}))
    return {"path": str(directory.resolve()), "weights": weights, "model": model, **({"tag": tag} if tag else {})}


def load_model_dir(path: str | Path, tag: str | None = None, option: str = "") -> tuple[Transformer, Path]:
    """A run directory (checkpoint `tag`, or its newest) or an export directory -> (model, directory of its
    tokenizer). A `tag` (the checkpoint a run checked as it started, `weights_summary`) gone since, or weights that
    cannot be loaded, are one line naming `option`."""
    directory = Path(path)
    if tag is not None and not (rundir.checkpoint_dir(directory) / tag).is_dir():
        raise UserError(f"{option + ' ' if option else ''}{directory}: its checkpoint {tag}, the newest as this run "
                        "started, was removed since (its training keeps only its newest checkpoints); start this "
                        "run again")
    try:
        if is_run_or_export(directory):
            loaded = load_trained_model(directory, tag)[0], rundir.tokenizer_dir(directory)
        else:
            loaded = import_model(directory), directory
        _refuse_weights_that_are_not_numbers(loaded[0], directory)
        return loaded
    except UserError as exc:  # e.g. a damaged checkpoint: said with the option that named the model
        said = str(exc)
        if not option or said.startswith(option):
            raise
        raise UserError(f"{option} {said}" if said.startswith(str(directory)) else f"{option} {directory}: {said}") \
            from None


def _refuse_weights_that_are_not_numbers(model: Transformer, directory: Path) -> None:
    """Weights holding NaN or infinity (a damaged download, another tool's diverged run) generated text of one repeated
    token, scored a loss of nan, and ended a run trained from them at its first step with advice to lower the
    learning rate."""
    for name, parameter in model.named_parameters():
        if not torch.isfinite(parameter).all():
            raise UserError(f"{directory}: its weight {name} holds values that are not numbers (NaN or infinity); "
                            "nothing can be generated, scored or trained from it: use other weights")


def load_tokenizer_copy(kept: Path, remedy: str) -> Tokenizer:
    """The copy of its input's tokenizer a run directory keeps (`rundir.tokenizer_dir`, which exists); one that cannot
    be loaded (cut short by a kill or a full disk, a file of it deleted or damaged) is refused as damaged, naming the
    file and what is wrong with it, followed by `remedy`."""
    try:
        return Tokenizer.load(kept)
    except UserError as exc:
        reason = " ".join(str(exc).split()) if (kept / TOKENIZER_FILE).is_file() else f"no {TOKENIZER_FILE}"
        raise UserError(f"{kept} is damaged ({reason}); it is this run's copy of its input's tokenizer: "
                        f"{remedy}") from None


def run_tokenizer(run_dir: Path) -> Tokenizer | None:
    """The tokenizer a run directory keeps (None when it keeps none), whole (`load_tokenizer_copy`)."""
    kept = rundir.tokenizer_dir(run_dir)
    if not kept.is_dir():
        return None
    return load_tokenizer_copy(kept, f"copy the tokenizer the run was trained with back into {kept}")


def load_for_inference(path: str | Path, tag: str | None = None) -> tuple[Transformer, Tokenizer]:
    """A run (checkpoint `tag`, or its newest) or export directory -> (model, tokenizer); the tokenizer files must be
    there, and a run's copy of its tokenizer whole (`load_tokenizer_copy`)."""
    model, tokenizer_dir = load_model_dir(path, tag)
    if rundir.is_run_dir(Path(path)) and tokenizer_dir.is_dir():
        tokenizer = run_tokenizer(Path(path))
    elif (tokenizer_dir / TOKENIZER_FILE).is_file():
        tokenizer = Tokenizer.load(tokenizer_dir)
    else:
        raise UserError(f"{path}: no tokenizer files ({TOKENIZER_FILE}) beside the model"
                        f"{no_tokenizer_json_advice(tokenizer_dir) or ''}")
    if tokenizer.vocab_size > model.cfg.vocab_size:  # fewer is fine: padded embedding rows no token reaches
        raise UserError(f"{path}: its tokenizer {tokenizer_dir} has {tokenizer.vocab_size} tokens, more than the "
                        f"model's vocab_size {model.cfg.vocab_size}; use the tokenizer the model was trained with")
    return model, tokenizer.stop_also(declared_stop_ids(path))


def load_scored(path: str | Path) -> tuple[Transformer, Tokenizer, str | None]:
    """`load_for_inference`, and the checkpoint it read (None for an export directory): what an evaluation names as
    the weights it scored, a run still training being read at its newest complete checkpoint."""
    if not rundir.is_run_dir(Path(path)):
        return *load_for_inference(path), None
    tag, (model, tokenizer) = newest_checkpoint(Path(path), lambda newest: load_for_inference(path, newest))
    return model, tokenizer, tag


SHAPE_FIELDS = ("vocab_size", "dim", "n_layers", "n_heads", "kv_heads", "attention_head_dim", "ffn_hidden_dim",
                "tie_embeddings", "moe", "n_experts", "n_shared_experts", "qk_norm", "qkv_bias")
"""What the weights' shapes and names depend on."""
FUNCTION_FIELDS = ("rope_theta", "norm_eps", "rope_scaling", "rope_factor", "rope_original_max_seq_len",
                   "yarn_beta_fast", "yarn_beta_slow", "llama3_low_freq_factor", "llama3_high_freq_factor",
                   "n_experts_per_token", "norm_topk_prob")
"""What the trained function depends on beyond the shapes: training on other values would silently change it."""


ADOPTED_FIELDS = ("vocab_size", "dim", "n_layers", "n_heads", "head_dim", "n_kv_heads", "hidden_dim", "multiple_of",
                  "max_seq_len", "tie_embeddings", "moe", "n_experts", "n_shared_experts", "qk_norm", "qkv_bias",
                  *FUNCTION_FIELDS)
"""The model.* keys a run with --init-from takes from that model instead of its recipe: its shape, its function and
its context length."""


def trained_config(run_dir: Path) -> RunConfig:
    """The run config a run directory's model was trained with, from its config.yaml; one without model.vocab_size
    (edited, or cut short) is refused as damaged: a model built from it failed with a TypeError."""
    cfg = build_config(rundir.recorded_config(run_dir))
    if cfg.model.vocab_size is None:  # training records the one it used
        raise UserError(f"{rundir.config_file(run_dir)} is damaged (it lacks model.vocab_size); `zerollm train` wrote "
                        "it: restore it")
    return cfg


def model_config_of(path: str | Path, option: str = "--init-from") -> ModelConfig:
    """The model config of a run directory (its config.yaml) or an export directory (its config.json), read without
    its weights; `option` names the path in errors."""
    directory = Path(path)
    if is_run_or_export(directory, option):
        return trained_config(directory).model
    return export_model_config(directory)


def recipe_for_init_from(recipe: dict[str, Any], init_from: str | None, resumed: Path | None,
                         option: str = "--init-from") -> dict[str, Any]:
    """The raw `recipe` with its model section's `ADOPTED_FIELDS` replaced by those of the model the run starts
    from: its --init-from model, or, resuming run `resumed` without --init-from, the one recorded there (a run that
    had one). Fine-tuning a downloaded Qwen2.5 or Llama needs no recipe written for it; `--set` model keys still
    apply after, and where they differ from the model's, loading its weights refuses them by name
    (`initial_weights`). `option`: how the user gave `init_from`, for messages (`train.init_from` from --set or the
    recipe)."""
    if not isinstance(recipe.get("model", {}), dict):  # refused by build_config, naming the section
        return recipe
    if init_from:
        source = model_config_of(init_from, option)
        model = {name: getattr(source, name) for name in ADOPTED_FIELDS}
    elif resumed is not None and (recorded := _recorded_run_config(resumed)).get("train", {}).get("init_from"):
        model = {name: recorded["model"][name] for name in ADOPTED_FIELDS if name in recorded.get("model", {})}
    else:
        return recipe
    return {**recipe, "model": {**(recipe.get("model") or {}), **model}}


def _recorded_run_config(run_dir: Path) -> dict[str, Any]:
    """The config a run directory records; empty where there is none or it cannot be read (what is wrong with the
    folder is said where its use as the output is checked, `rundir.check_run_output`)."""
    try:
        return rundir.recorded_config(run_dir) if rundir.config_file(run_dir).is_file() else {}
    except UserError:
        return {}


def model_differences(there: ModelConfig, here: ModelConfig) -> list[str]:
    """'model.KEY X there, Y here' for each shape or function field (`SHAPE_FIELDS`, `FUNCTION_FIELDS`) in which the
    model config `there` differs from `here`."""
    differing = [f"{settable_key(f'model.{f}')} {getattr(there, f)} there, {getattr(here, f)} here"
                 for f in (*SHAPE_FIELDS, *FUNCTION_FIELDS)
                 if f != "attention_head_dim" and getattr(there, f) != getattr(here, f)]
    # the head width once model.dim and model.n_heads are set as there: otherwise a second refusal would name it
    if there.attention_head_dim != dataclasses.replace(here, dim=there.dim, n_heads=there.n_heads).attention_head_dim:
        said = here.head_dim if here.head_dim is not None else "unset (model.dim / model.n_heads)"
        differing.append(f"model.head_dim {there.attention_head_dim} there, {said} here")
    return differing


def initial_weights(cfg: ModelConfig, init_from: str, data_tokenizer_hash: str,
                    tag: str | None = None) -> dict[str, torch.Tensor]:
    """Weights of a run (checkpoint `tag`, or its newest) or export directory, refused when its shape or tokenizer
    differs from this run's."""
    source, tokenizer_dir = load_model_dir(init_from, tag, "--init-from")
    if differing := model_differences(source.cfg, cfg):
        raise UserError(f"--init-from {init_from}: the model differs from this run's config ({'; '.join(differing)}); "
                        "set those model.* keys to the values there")
    exported = not rundir.is_run_dir(Path(init_from))
    if exported and (window := attention_window(Path(init_from))) and cfg.max_seq_len > window:
        raise UserError(f"--init-from {init_from}: its attention sees {window} positions back (a sliding window), "
                        f"and ours has none: model.max_seq_len {cfg.max_seq_len} would train it on another function "
                        f"past them; set model.max_seq_len to at most {window}")
    if not (tokenizer_dir / TOKENIZER_FILE).is_file():
        if data_tokenizer_hash == RANDOM_TOKENS_HASH:  # `bench train --lora`: random tokens on a random export
            return source.state_dict()
        raise UserError(f"--init-from {init_from}: no tokenizer ({tokenizer_dir / TOKENIZER_FILE} is missing), so "
                        "nothing shows it is the one the data was prepared with; give a model that keeps its "
                        "tokenizer files")
    if not Tokenizer.load(tokenizer_dir).has_hash(data_tokenizer_hash):
        raise UserError(f"--init-from {init_from}: its tokenizer differs from the one the data was prepared with; "
                        f"prepare the data with {tokenizer_dir}")
    return source.state_dict()
