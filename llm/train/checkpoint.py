"""Checkpoints: DeepSpeed's layout plus our client state, a manifest and an atomic `latest` (layout: `llm.rundir`).

A save runs in this order, so that a job killed at any instant resumes from a complete checkpoint:

    every rank writes its files (DeepSpeed's, and rng_rank<R>.pt) and fsyncs them      -> agreement
        (under NVMe optimizer offload, DeepSpeed's copy of its swap files in offloaded_tensors/rank<NN> too)
    rank 0 gathers each rank's list of the files it wrote, with their sizes once flushed
    rank 0: client_state.json, then manifest.json (every file with its size), then `latest`, each durably
    rank 0: prune complete checkpoints older than the `keep` newest                     -> agreement

Each agreement is a barrier at which the ranks also learn whether any rank's writes ran out of room (a full disk, a
quota, the file size limit): then every rank ends with one UserError, said once, and the unfinished folder is gone.

A model with frozen parameters (LoRA: `llm.model.lora`) saves only its trainable ones (its adapters): model states,
optimizer partitions and all; the frozen base comes back from --init-from when the run is loaded or resumed.

Loading (resume, and the consolidated weights of `llm.loading`) runs every `torch.load` with weights_only=True
(`restricted_unpickling`): our RNG files hold tensors and plain values only, and DeepSpeed's files need just four
plain-data DeepSpeed classes on top (`deepspeed_state_classes`).
"""

from __future__ import annotations

import errno
import inspect
import json
import os
import pickle
import random
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from llm import durable, rundir
from llm.config import LoRAConfig, ModelConfig
from llm.errors import UserError
from llm.model import Transformer
from llm.model.from_weights import shapes_only
from llm.model.lora import apply_lora, is_adapter_key
from llm.runtime.accelerator import ensure_accelerator_env
from llm.runtime.distributed import agreed, raise_together, refuse_together
from llm.runtime.rerun import rerun_advice

FORCE_WEIGHTS_ONLY = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"  # read by torch on every torch.load
DELETING_PREFIX = ".deleting-"


def rng_state() -> dict[str, Any]:
    """Every RNG of this process, as tensors and plain values (so it loads with weights_only=True)."""
    version, mersenne, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    state = {"python": [version, list(mersenne), gauss],
             "numpy": [kind, keys.tolist(), pos, has_gauss, cached_gaussian],
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, mersenne, gauss = state["python"]
    random.setstate((version, tuple(mersenne), gauss))
    kind, keys, pos, has_gauss, cached_gaussian = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached_gaussian))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def deepspeed_state_classes() -> list[type]:
    """The plain-data DeepSpeed classes its checkpoints pickle (ZeRO optimizer files): enum, loss scalers (static,
    and fp16's dynamic one with its current scale), fragment offsets. Allowing them runs no code of the file's
    choosing: none has a __setstate__, and their constructors only store the numbers and flags they are given."""
    ensure_accelerator_env()
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler  # noqa: PLC0415 - after the accelerator
    from deepspeed.runtime.zero.config import ZeroStageEnum  # noqa: PLC0415
    from deepspeed.utils.tensor_fragment import fragment_address  # noqa: PLC0415

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


@contextmanager
def restricted_unpickling(source: Path) -> Iterator[None]:
    """Inside, every `torch.load` (DeepSpeed's own, which asks for weights_only=False, included) unpickles only
    tensors, plain containers and `deepspeed_state_classes`; anything else is a UserError naming the file (in
    `source`, the checkpoint being read) instead of running, and so is a file torch cannot read at all (damaged)."""
    classes = deepspeed_state_classes()
    saved = os.environ.get(FORCE_WEIGHTS_ONLY)
    os.environ[FORCE_WEIGHTS_ONLY] = "1"
    try:
        with torch.serialization.safe_globals(classes):
            yield
    except Exception as exc:  # noqa: BLE001 - re-raised below unless torch.load failed on the file's bytes
        path = _file_being_loaded(exc, source)
        if isinstance(exc, RuntimeError):  # also a tensor torch cannot place (map_location): not the file's fault
            unreadable = path is not None and any(mark in str(exc) for mark in DAMAGE_MARKS)
        else:  # the unpickler on bytes of no pickle: EOFError, KeyError, IndexError, ValueError, ...
            unreadable = isinstance(exc, pickle.UnpicklingError) or (
                path is not None and not isinstance(exc, OSError | MemoryError))
        if not unreadable:
            raise  # not raised reading a file: the caller's error
        path = path or source
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        payload = next((line for line in lines if "GLOBAL" in line), None)
        if isinstance(exc, pickle.UnpicklingError) and payload is not None:
            raise UserError(f"{path} holds more than tensors and plain values, so it was not loaded ({payload})"
                            ) from None
        boilerplate = ("Weights only load failed", "Please file an issue", "Check the documentation")
        if isinstance(exc, EOFError):
            detail = "it ends early"
        else:
            detail = next((line for line in lines if not line.startswith(boilerplate)), type(exc).__name__)
        if "legacy .tar format" in detail:  # torch's guess for bytes it cannot place (zeros)
            detail = "neither a zip archive nor a pickle"
        raise UserError(f"{path} is damaged: it is not a checkpoint file torch can read ({detail.split('. ')[0]}); "
                        f"{_damaged_advice(path, source)}") from None
    finally:
        if saved is None:
            os.environ.pop(FORCE_WEIGHTS_ONLY)
        else:
            os.environ[FORCE_WEIGHTS_ONLY] = saved


DAMAGE_MARKS = ("PytorchStreamReader", "magic number", "legacy .tar format")
"""Words of torch.load's RuntimeErrors on a file that is not a checkpoint it can read (a zip it cannot open, bytes
of no pickle protocol, zeros)."""


def _file_being_loaded(exc: BaseException, source: Path) -> Path | None:
    """The file the innermost `torch.load` that `exc` came through was reading, `source` (the checkpoint being read)
    for bytes in memory, None where `exc` came from elsewhere."""
    found, frame = None, exc.__traceback__
    while frame is not None:
        if frame.tb_frame.f_code is torch.serialization.load.__code__:
            f = frame.tb_frame.f_locals.get("f")
            found = Path(f) if isinstance(f, str | os.PathLike) else Path(getattr(f, "name", source))
        frame = frame.tb_next
    return found


def _damaged_advice(path: Path, source: Path) -> str:
    """What to do about damaged file `path`, read while loading checkpoint folder `source`: remove a universal
    conversion, so that it is made again; else `rundir.damaged_checkpoint_advice` for the checkpoint holding it."""
    folder = source if path.is_relative_to(source) else path.parent
    if folder.parent.name == rundir.UNIVERSAL_DIR:
        return f"remove {folder} so that it is converted again"
    if folder.parent.name != rundir.CHECKPOINTS_DIR or not rundir.is_tag(folder.name):
        return f"remove {folder}"
    return rundir.damaged_checkpoint_advice(folder.parent.parent, folder.name)


def save(engine, run_dir: Path, step: int, client_state: Callable[[], dict[str, Any]], keep: int) -> None:
    """Save on every rank; rank 0 then writes the manifest, publishes the checkpoint as `latest` and prunes.
    `client_state()` is called as rank 0 publishes, once every rank's files are written: the time budget's
    clock in it counts their writing (taken before it, a run stopped by a signal and resumed ran past its budget by
    the stop's checkpoint).

    Each rank flushes only the files it wrote (`_write_rank_files`) and sends their names and sizes to rank 0 alone
    (a gather): every rank listing the folder and flushing all it saw there was, at 512 ranks, 512 fsyncs of each
    file of the checkpoint (each a metadata round trip on Lustre or NFS), and an all-gather of those listings sent
    every rank's to every rank (world^2 x files names). The manifest lists the union of the writers' lists, each
    file with its size as its writer saw it once flushed, so a rank (rank 0) whose view of a shared file system lags
    cannot leave another rank's file out.

    A write that runs out of room (a full disk, a quota, the file size limit) on any rank ends the save on every
    rank, after every rank's writes, with one UserError said once (`_refuse_out_of_room`): the unfinished folder is
    removed and `latest` still names the previous checkpoint."""
    root, tag = rundir.checkpoint_dir(run_dir), rundir.tag_for(step)
    directory = root / tag
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0 and directory.exists():
        if tag == rundir.latest_tag(run_dir) and rundir.incompleteness(run_dir, tag) is None:
            raise RuntimeError(f"{directory} is the published checkpoint; it is never written over")
        shutil.rmtree(directory)  # an unfinished save of this step by an earlier attempt: none of it may count
    dist.barrier()
    own: dict[str, int] = {}
    _refuse_out_of_room(_out_of_room_in(lambda: own.update(_write_rank_files(engine, run_dir, tag, rank))),
                        run_dir, step)
    written: list[dict[str, int] | None] | None = [None] * world if rank == 0 else None
    dist.gather_object(own, written, dst=0)  # NCCL: through the current device, which setup_distributed set
    reason = None
    if rank == 0:
        reason = _out_of_room_in(lambda: _publish(run_dir, tag, step, world, written, client_state))
        if reason is None and (unpruned := _out_of_room_in(lambda: prune(run_dir, keep))) is not None:
            print(f"zerollm: note: {rundir.checkpoint_dir(run_dir)}: {unpruned} while removing checkpoints older "
                  f"than the {keep} newest; they are kept", file=sys.stderr, flush=True)
    _refuse_out_of_room(reason, run_dir, step)


def _write_rank_files(engine, run_dir: Path, tag: str, rank: int) -> dict[str, int]:
    """This rank's files of checkpoint `tag` (those DeepSpeed's checkpoint engine saved on this rank, the swap files
    DeepSpeed copied into offloaded_tensors/rank<NN> under NVMe optimizer offload, and its RNG file), each flushed to
    the disk, and the subfolders holding them; their paths in the folder (`rundir.checkpoint_files`), with their
    sizes once flushed. Only these are flushed: not the other ranks' files, nor anything this rank wrote outside the
    folder. A DeepSpeed write or copy that ran out of room is raised once DeepSpeed's save is over
    (`_writes_held_at_first_failure`)."""
    directory = rundir.checkpoint_dir(run_dir) / tag
    with frozen_parameters_left_out(engine) as leaving_out, \
            _writes_held_at_first_failure(engine, directory) as (failures, saved):
        engine.save_checkpoint(str(directory.parent), tag=tag, save_latest=False,
                               exclude_frozen_parameters=leaving_out)
    if failures:
        raise failures[0]
    rng = rundir.rng_file(run_dir, tag, rank)
    with open(rng, "wb") as f:  # a file object: torch.save keeps a write's errno
        torch.save(rng_state(), f)
    folder, own, subfolders = Path(os.path.abspath(directory)), {}, set()
    for path in [*saved, rng]:
        path = Path(os.path.abspath(path))
        if not path.is_relative_to(folder) or (name := path.relative_to(folder).as_posix()) in own:
            continue
        durable.fsync(path)
        own[name] = path.stat().st_size
        subfolders.update(parent for parent in path.parents if parent != folder and parent.is_relative_to(folder))
    for subfolder in sorted(subfolders, reverse=True):  # their entries: offloaded_tensors/rank<NN>, then its parent
        durable.fsync(subfolder)
    return own


def _publish(run_dir: Path, tag: str, step: int, world: int, written: list[dict[str, int]],
             client_state: Callable[[], dict[str, Any]]) -> None:
    """Rank 0: client_state.json, the manifest of every file of the checkpoint, then `latest`. `written`: each rank's
    files, by their paths in the folder, with their sizes once flushed (`_write_rank_files`).

    A file in the folder or its subfolders that no rank reported (a DeepSpeed that writes one neither through its
    checkpoint engine nor by the NVMe offload copy `_writes_held_at_first_failure` follows) is flushed and listed by
    rank 0, as rank 0 sees it: one listing of the folder's names (and of each subfolder's), on one rank. With
    DeepSpeed 0.19 there is none."""
    directory = rundir.checkpoint_dir(run_dir) / tag
    files: dict[str, int] = {}
    for own in written:
        for name, size in own.items():
            files[name] = max(size, files.get(name, 0))
    for name in set(rundir.checkpoint_files(directory)) - files.keys():
        durable.fsync(directory / name)
        files[name] = (directory / name).stat().st_size
    files = dict(sorted(files.items()))
    durable.write_text(directory / rundir.CLIENT_STATE, json.dumps(client_state(), indent=1))
    files[rundir.CLIENT_STATE] = (directory / rundir.CLIENT_STATE).stat().st_size
    manifest = {"step": step, "world_size": world, "files": files}
    durable.write_text(rundir.manifest_file(run_dir, tag), json.dumps(manifest, indent=1))
    durable.write_text(rundir.checkpoint_dir(run_dir) / rundir.LATEST, tag)


def _out_of_room_in(write: Callable[[], None]) -> str | None:
    """Run `write`; why it ran out of room (`durable.out_of_room`), None when it did not. Any other failure is
    raised."""
    try:
        write()
    except Exception as exc:  # noqa: BLE001 - re-raised unless a write ran out of room
        reason = durable.out_of_room(exc)
        if reason is None:
            raise
        return reason
    return None


def _refuse_out_of_room(reason: str | None, run_dir: Path, step: int) -> None:
    """Every rank (a collective, in place of a barrier) raises one UserError, said by rank 0, when any rank's writes
    of step `step` ran out of room (`reason`), after rank 0 removed the unfinished checkpoint folder (never the one
    `latest` names: a failure after `latest` was replaced, in flushing its folder, leaves that checkpoint whole)."""
    problem, tag = None, rundir.tag_for(step)
    published = rundir.latest_tag(run_dir) == tag
    if reason is not None:
        previous = rundir.newest_complete_tag(run_dir, before_step=step)  # `latest` may be lost
        before = (f"its checkpoint ({tag}) was published first" if published else
                  f"the previous checkpoint ({previous}) is intact" if previous else "no checkpoint was saved before")
        problem = (f"{rundir.checkpoint_dir(run_dir)}: {reason} while saving step {step}; {before}; free space and "
                   f"{rerun_advice()}")
    try:
        refuse_together(problem, announce=dist.get_rank() == 0)
    except UserError:
        if dist.get_rank() == 0 and not published:
            shutil.rmtree(rundir.checkpoint_dir(run_dir) / tag, ignore_errors=True)
        raise


@contextmanager
def _writes_held_at_first_failure(engine, directory: Path) -> Iterator[tuple[list[Exception], list[Path]]]:
    """Inside, DeepSpeed writes each checkpoint file of its torch engine through a file object (torch.save given a
    path says only '[enforce fail at inline_container.cc:672] . unexpected pos', not why), and the first write that
    runs out of room is recorded in the first yielded list instead of raised, with no file written after it:
    DeepSpeed goes on through its collectives, so a rank whose disk is full leaves no other rank waiting in one.
    The second yielded list gets the path of each file DeepSpeed's checkpoint engine saved (whichever engine it is)
    and of each file it copied into checkpoint folder `directory` (`_copies_followed`): this rank's own files, which
    it alone flushes (`_write_rank_files`)."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import (  # noqa: PLC0415 - after the accelerator
        TorchCheckpointEngine,
    )

    failures: list[Exception] = []
    saved: list[Path] = []
    writer, save_file, copy_scripts = engine.checkpoint_engine, engine.checkpoint_engine.save, \
        engine._copy_recovery_script

    def through_a_file(state_dict, path: str) -> None:  # the names DeepSpeed calls it with
        with open(path, "wb") as f:
            save_file(state_dict, f)

    save_one = through_a_file if isinstance(writer, TorchCheckpointEngine) else save_file

    def recorded(state_dict, path: str) -> None:
        save_one(state_dict, path)
        saved.append(Path(path))

    writer.save = _held(recorded, failures)
    engine._copy_recovery_script = _held(copy_scripts, failures)
    try:
        with _copies_followed(directory, failures, saved):
            yield failures, saved
    finally:
        del writer.save, engine._copy_recovery_script  # the classes' methods again


def _held(write: Callable[..., Any], failures: list[Exception]) -> Callable[..., Any]:
    """`write`, done only while `failures` is empty, and a failure for lack of room recorded there instead of
    raised (what it returns, else None); any other failure is raised."""
    def unless_failed(*args, **kwargs) -> Any:
        if failures:
            return None
        try:
            return write(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - re-raised unless it ran out of room
            if durable.out_of_room(exc) is None:
                raise
            failures.append(exc)
            return None
    return unless_failed


@contextmanager
def _copies_followed(directory: Path, failures: list[Exception], saved: list[Path],
                     out_of: bool = False) -> Iterator[None]:
    """Inside, a `shutil.copytree` into checkpoint folder `directory` (DeepSpeed's save under ZeRO-Infinity's NVMe
    optimizer offload copies the optimizer swapper's folder on the NVMe drive, outside its checkpoint engine, to
    <tag>/offloaded_tensors/rank<NN>: `DeepSpeedEngine.save_checkpoint`, which imports copytree from shutil as it
    runs), or with `out_of` one out of it (its load's copy back to the drive: `_copy_back_held`), records each
    file it copies in `saved`, and is held as the checkpoint engine's writes are: the first copy that runs out of
    room (copytree would go on with the next file and raise a shutil.Error of texts at the end) is recorded in
    `failures` and nothing more is copied; a copy after an earlier failure copies nothing. Copies elsewhere, by any
    thread, are copytree's own."""
    copytree = shutil.copytree
    signature = inspect.signature(copytree)

    def held_copy(copy):
        def copy_recorded(source, target, *args, **kwargs) -> None:
            copy(source, target, *args, **kwargs)
            saved.append(Path(target))

        copy_held = _held(copy_recorded, failures)
        copy_held.held = True
        return copy_held

    def followed(src, dst, *args, **kwargs):
        if not Path(os.path.abspath(src if out_of else dst)).is_relative_to(os.path.abspath(directory)):
            return copytree(src, dst, *args, **kwargs)
        call = signature.bind(src, dst, *args, **kwargs)
        call.apply_defaults()
        copy = call.arguments["copy_function"]
        if not getattr(copy, "held", False):  # copytree calls itself for each subfolder, with the copy it was given
            call.arguments["copy_function"] = held_copy(copy)
        # held too: its folder could not be made, or a shutil.Error gathering the texts of its other failures
        return _held(copytree, failures)(*call.args, **call.kwargs)

    shutil.copytree = followed
    try:
        yield
    finally:
        shutil.copytree = copytree


def prune(run_dir: Path, keep: int) -> None:
    """Keep the `keep` newest complete checkpoints up to the one `latest` names (0 keeps all). Only complete
    checkpoints older than `latest` are deleted: never `latest`, never an incomplete folder, never a newer one.
    A checkpoint is renamed to a hidden name before its files go, so an interrupted deletion leaves no folder
    that looks like a checkpoint (the leftover is removed by the next prune)."""
    root, latest = rundir.checkpoint_dir(run_dir), rundir.latest_tag(run_dir)
    for leftover in root.glob(f"{DELETING_PREFIX}*"):
        shutil.rmtree(leftover)
    if keep <= 0 or latest is None:
        return
    older = [tag for tag in rundir.checkpoint_tags(run_dir)
             if rundir.step_of(tag) < rundir.step_of(latest) and rundir.incompleteness(run_dir, tag) is None]
    for tag in older[:max(0, len(older) - (keep - 1))]:
        doomed = root / f"{DELETING_PREFIX}{tag}"
        os.replace(root / tag, doomed)
        shutil.rmtree(doomed)


def has_frozen_parameters(engine) -> bool:
    """Whether some of the engine's parameters are frozen (LoRA's base): its checkpoints leave them out."""
    return any(not p.requires_grad for p in engine.module.parameters())


@contextmanager
def frozen_parameters_left_out(engine) -> Iterator[bool]:
    """Inside, the engine's module state (what DeepSpeed saves as 'module') lacks every frozen parameter, under each
    of its names; yields whether the engine has any. DeepSpeed's own `exclude_frozen_parameters` drops a frozen
    parameter under one name only, so a tied weight (the frozen embedding, also `output.weight`) would be saved."""
    frozen = {name for name, p in engine.module.named_parameters(remove_duplicate=False) if not p.requires_grad}
    if not frozen:
        yield False
        return
    whole = engine.module_state_dict

    def without_frozen(*args, **kwargs):
        state = whole(*args, **kwargs)
        for name in frozen & state.keys():
            del state[name]
        return state

    engine.module_state_dict = without_frozen
    try:
        yield True
    finally:
        del engine.module_state_dict  # the class's method again


def weight_decayed(parameter: torch.Tensor) -> bool:
    """Whether a parameter is in the optimizer's first group, with weight decay (matrices), or its second, without
    (norms and other vectors): `engine.param_groups`, whose order the fp32 master copies in a checkpoint follow."""
    return parameter.ndim >= 2


def is_partitioned(run_dir: Path, tag: str) -> bool:
    """Whether the optimizer state is split across the ranks that saved it (ZeRO, or bf16's optimizer)."""
    return any((rundir.checkpoint_dir(run_dir) / tag).glob("*zero_pp_rank_*optim_states.pt"))


_UNIVERSAL_CONVERTER = ("import runpy, torch; from llm.train.checkpoint import deepspeed_state_classes; "
                        "torch.serialization.add_safe_globals(deepspeed_state_classes()); "
                        "runpy.run_module('deepspeed.checkpoint.ds_to_universal', run_name='__main__', alter_sys=True)")
CONVERSION_RECORD = "converted_from.json"
"""Written last into a universal conversion: the checkpoint it was made from (`_identity`) and its own files with
their sizes. A conversion is used only while both still hold (`_is_conversion_of`)."""


def convert_to_universal(run_dir: Path, tag: str) -> None:
    """DeepSpeed's universal checkpoint of `tag` (one file per parameter and optimizer state, loadable on any
    world size), written to checkpoints/universal/<tag> by `deepspeed.checkpoint.ds_to_universal`, whose loads
    are restricted as in `restricted_unpickling`. It is made whole or not at all (`durable.staged_folder`: every
    file and folder of it is flushed before it is renamed into place, and universal/ after), so that a power loss
    leaves no conversion whose files are torn or empty for a later resume to trust.

    A conversion left there by an earlier job is used only when it is whole and was made from checkpoint `tag` as
    it is now; anything else is removed and converted again: one made from an earlier checkpoint of the same step (a
    refused resume leaves its conversion, and the run may then save that step again, with files of the same sizes),
    one that an earlier job was killed while removing, one made before conversions recorded their source."""
    universal = rundir.universal_dir(run_dir)
    target = universal / tag
    source = rundir.checkpoint_dir(run_dir) / tag
    identity = _identity(source)
    if target.is_dir():
        if identity is not None and _is_conversion_of(target, identity):
            return
        shutil.rmtree(target)
    if not universal.is_dir():
        universal.mkdir(parents=True, exist_ok=True)
        durable.fsync(universal.parent)  # its entry in checkpoints/, before a conversion is renamed into it
    with durable.staged_folder(target) as partial:  # its files, subfolders and it flushed before it is renamed in
        command = [sys.executable, "-c", _UNIVERSAL_CONVERTER, "--input_folder", str(source),
                   "--output_folder", str(partial), "--inject_missing_state"]
        result = subprocess.run(command, capture_output=True, text=True, check=False,
                                env={**os.environ, FORCE_WEIGHTS_ONLY: "1"})
        if result.returncode != 0:
            if (reason := _conversion_out_of_room(result, partial, source)) is not None:
                raise UserError(f"{universal}: {reason} while converting {source} to a universal checkpoint (to "
                                "resume it on another number of ranks); the checkpoint is intact: free space and "
                                "rerun")
            raise UserError(f"{source}: conversion to a universal checkpoint failed ({_exception_said(result)}); "
                            "resume it on the number of ranks that saved it, or remove it to resume from the "
                            "checkpoint before it")
        (universal / "latest_universal").unlink(missing_ok=True)  # written by the tool; we keep `latest`
        if identity is not None:  # else (the source unreadable) it is converted again next time
            record = {"source": identity, "files": _converted_files(partial)}
            (partial / CONVERSION_RECORD).write_text(json.dumps(record, indent=1))


def _conversion_out_of_room(result: subprocess.CompletedProcess, partial: Path, source: Path) -> str | None:
    """Why the conversion of checkpoint `source` into `partial` ran out of room (`durable.OUT_OF_ROOM`), or None: the
    reason as its output says it, or, where torch.save given a path lost it ('unexpected pos'), less room left
    beside what it wrote than the checkpoint's size (about what a conversion writes). The failure was blamed on the
    checkpoint, and its removal advised."""
    said = result.stdout + result.stderr
    found = next((reason for number, reason in durable.OUT_OF_ROOM.items() if os.strerror(number) in said), None)
    if found is None and "unexpected pos" in said:
        size = sum(path.stat().st_size for path in source.rglob("*") if path.is_file())
        if shutil.disk_usage(partial.parent).free < size:  # the converter may not have made `partial`
            found = durable.OUT_OF_ROOM[errno.ENOSPC]
    return found


def _exception_said(result: subprocess.CompletedProcess) -> str:
    """The exception that ended a Python subprocess: the last line of its output naming one (`ValueError: ...`; a
    message of several lines goes on after it), else its last line, else its exit code."""
    said = [line.strip() for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    named = [line for line in said if re.match(r"[\w.]+(Error|Exception|Interrupt|Exit): ", line)]
    return (named or said or [f"exit code {result.returncode}"])[-1]


def _identity(source: Path) -> dict[str, list[int]] | None:
    """What tells checkpoint folder `source` from another checkpoint of the same step: its manifest and each file
    the manifest lists, with their sizes and modification times (a checkpoint saved again under the same tag may
    have the same manifest and client state, byte for byte). None where the manifest cannot be read."""
    try:
        listed = json.loads((source / rundir.MANIFEST).read_text())["files"]
        return {name: [stat.st_size, stat.st_mtime_ns] for name in [rundir.MANIFEST, *sorted(listed)]
                for stat in [(source / name).stat()]}
    except (OSError, ValueError, KeyError, TypeError, RecursionError):  # RecursionError: JSON nested too deep
        return None


def _converted_files(folder: Path) -> dict[str, int]:
    """Every file under `folder` but the record, by its path there, with its size."""
    return {path.relative_to(folder).as_posix(): path.stat().st_size for path in sorted(folder.rglob("*"))
            if path.is_file() and path.name != CONVERSION_RECORD}


def _is_conversion_of(target: Path, identity: dict[str, list[int]]) -> bool:
    """Whether universal checkpoint `target` was converted from the checkpoint of `identity` and is whole: its record
    is there, names that checkpoint, and lists exactly its files with their sizes."""
    try:
        record = json.loads((target / CONVERSION_RECORD).read_text())
        return isinstance(record, dict) and record.get("source") == identity and \
            record.get("files") == _converted_files(target)
    except (OSError, ValueError, RecursionError):
        return False


def resume_tag(run_dir: Path, model: ModelConfig, lora: LoRAConfig | None = None) -> str | None:
    """The checkpoint every rank resumes from: rank 0 picks it (`rundir.usable_tag`, which names on stderr what it
    passes over), checks its client state and its parameters' shapes against `model` with the `lora` adapters (None:
    no LoRA) (`_refuse_other_shapes`) and
    tells the others, so that all agree even where their views of a shared file system lag. None: start from step 0.
    A UserError (no complete checkpoint, a damaged client state, another model's checkpoint) is raised on every rank
    and printed by rank 0 (every rank reading a damaged client state printed it once per rank)."""
    answer: list[tuple[str, str | None] | None] = [None]
    if dist.get_rank() == 0:
        try:
            tag = rundir.usable_tag(run_dir)
            if tag is not None:
                rundir.client_state_of(run_dir, tag)
                _refuse_other_shapes(run_dir, tag, model, lora)
            answer = [("tag", tag)]
        except UserError as exc:
            answer = [("error", str(exc))]
    dist.broadcast_object_list(answer, src=0)
    kind, value = answer[0]
    if kind == "error":
        raise_together(value, announce=dist.get_rank() == 0)
    return value


def _refuse_other_shapes(run_dir: Path, tag: str, model: ModelConfig, lora: LoRAConfig | None) -> None:
    """A UserError where checkpoint `tag` holds a parameter of another shape than `model` gives it (another model's
    checkpoint folder copied into the run), or was trained with its output layer tied where `model` unties it, or
    the reverse (config.yaml edited), or holds a whole model where the run trains LoRA adapters, adapters where it
    trains the whole model, or adapters of other ranks or layers: DeepSpeed's load ended every rank with a traceback
    (a size mismatch, missing keys, its parameter layout, or the universal loader's assertion after a conversion).
    Removing the checkpoint is advised only where the one before it fits: config.yaml edited, every checkpoint
    differs from it, and that advice led to the same refusal."""
    why = _shape_mismatch(run_dir, tag, model, lora)
    if why is None:
        return
    put_back = f"{config_mismatch(run_dir, tag, why)}: put {rundir.CONFIG_FILE} back as the run was trained"
    earlier = rundir.earlier_complete_tag(run_dir, tag)
    if earlier is not None and _shape_mismatch(run_dir, earlier, model, lora) is not None:
        raise UserError(f"{put_back} ({earlier} differs from it too, so {rundir.CONFIG_FILE} is what changed)")
    raise UserError(f"{put_back}; if the checkpoint is another run's, {rundir.damaged_checkpoint_advice(run_dir, tag)}")


def _shape_mismatch(run_dir: Path, tag: str, model: ModelConfig, lora: LoRAConfig | None) -> str | None:
    """Why checkpoint `tag` cannot load into `model` with the `lora` adapters (`mismatch_reason`), None where it can.
    The shapes are read without the tensors (`mmap`). Tying is not compared where the checkpoint holds no base
    weights (LoRA's). A file torch cannot map (not a zip archive at both ends: damaged) is left for the load to
    name."""
    folder = rundir.checkpoint_dir(run_dir) / tag
    states = next((path for name in (rundir.MODEL_STATES, f"zero_pp_rank_0_{rundir.MODEL_STATES}")
                   if (path := folder / name).is_file()), None)  # ZeRO-3: each rank's, with the shapes
    if states is None or not _zip_archive(states):
        return None
    with restricted_unpickling(folder):
        state = torch.load(states, map_location="cpu", mmap=True, weights_only=True)
    module = state.get("module") or {}
    if state.get("param_shapes"):  # the parameters by name: a tied output layer is none of them
        saved = {name: tuple(shape) for group in state["param_shapes"] for name, shape in group.items()}
        tied = "output.weight" not in saved
    else:  # the module's state: a tied output layer is the embedding's storage under a second name
        saved = {name: tuple(tensor.shape) for name, tensor in module.items()}
        output, embedding = module.get("output.weight"), module.get("tok_embeddings.weight")
        tied = output is None or (embedding is not None and
                                  output.untyped_storage().data_ptr() == embedding.untyped_storage().data_ptr())
    return mismatch_reason(saved, tied if "tok_embeddings.weight" in saved else None, model, lora)


def _zip_archive(path: Path) -> bool:
    """Whether the file is a zip archive at both ends: `zipfile.is_zipfile` reads its end alone, and torch's mapped
    load of a file damaged at its start ended in a traceback about `_use_new_zipfile_serialization`."""
    with path.open("rb") as f:
        return f.read(4) == b"PK\x03\x04" and zipfile.is_zipfile(f)


def saved_in_bf16(run_dir: Path, tag: str) -> bool | None:
    """Whether checkpoint `tag` was saved by a bf16 run, where its ZeRO optimizer files tell: DeepSpeed names a bf16
    run's `bf16_zero_pp_rank_*`, another precision's `zero_pp_rank_*`. None without them (no ZeRO: the optimizer's
    state is in the model states, whatever the precision)."""
    names = [path.name for path in (rundir.checkpoint_dir(run_dir) / tag).glob("*zero_pp_rank_*_optim_states.pt")]
    return any(name.startswith("bf16_") for name in names) if names else None


def mismatch_reason(saved: dict[str, tuple[int, ...]], tied: bool | None, model: ModelConfig,
                    lora: LoRAConfig | None = None) -> str | None:
    """Why weights of the shapes `saved`, trained with the output layer `tied` to the embeddings or not (None: they
    hold no base weights to tell), cannot load into the model `model` describes with the `lora` adapters (None or r
    0: none); None where they can. A LoRA run's checkpoint holds its adapters alone, every one the config gives;
    another run's holds no adapter. Other names the model does not have (a tied model's output layer) are passed
    over."""
    lora = lora if lora is not None and lora.r else None
    with shapes_only():
        net = Transformer(model)
        expected = {name: tuple(param.shape) for name, param in
                    (apply_lora(net, lora, seed=0) if lora else net).named_parameters()}
    adapters = sorted(name for name in saved if is_adapter_key(name))
    if lora is None and adapters:
        return f"it holds LoRA adapters ({adapters[0]}, ...), but lora.r is 0 in the config"
    if lora is not None and (base := [name for name in saved if not is_adapter_key(name) and name in expected]):
        return f"it holds the whole model ({base[0]}, ...), but lora.r is {lora.r} in the config: adapters alone"
    for name, shape in saved.items():
        if name in expected and shape != expected[name]:
            return f"size mismatch for {name}: {list(shape)} in the checkpoint, {list(expected[name])} in the config"
    if lora is not None:
        missing = sorted(name for name in expected if is_adapter_key(name) and name not in saved)
        unexpected = sorted(name for name in saved if name not in expected)
        if missing or unexpected:
            return (f"LoRA adapters {'missing' if missing else 'unexpected'}: {(missing or unexpected)[0]}, ...; "
                    f"lora.targets is {','.join(lora.targets)} in the config")
    if tied is not None and tied != model.tie_embeddings:
        return (f"model.tie_embeddings is {str(model.tie_embeddings).lower()}, but the checkpoint was trained "
                f"{'tied' if tied else 'untied'}")
    return None


def config_mismatch(run_dir: Path, tag: str | None, why: str) -> str:
    """The line for a checkpoint (`tag`; None: the newest) that does not fit the run's config.yaml, `why`."""
    return f"{run_dir}: checkpoint {f'{tag} ' if tag else ''}does not match {rundir.CONFIG_FILE} ({why})"


def load(engine, run_dir: Path, tag: str, universal: bool = False, clock_driven: bool = False) -> dict[str, Any]:
    """Restore engine, optimizer, scheduler and this rank's RNGs; return the client state. `tag` is a complete
    checkpoint (`rundir.usable_tag`). `universal`: load the conversion made by `convert_to_universal` (the job has
    another world size than the one that saved; a rank that did not exist then keeps its freshly seeded RNGs).
    The optimizer's learning rates are set to what this run's schedule gives at the restored step (`_continue_at`),
    except where the schedule follows the clock (`clock_driven`: train.max_time) and train.lr is unchanged: the
    saved rate was computed from the clock as it was then.

    A collective: a file that only some ranks read (their optimizer partition, their RNG file) and find damaged
    ends every rank with that rank's UserError, said once; a rank that refused alone left the others waiting in
    their next collective, which then failed with a traceback. So does a rank whose NVMe drive runs out of room
    while DeepSpeed copies its offloaded optimizer files back there (`_copy_back_held`)."""
    client_state = rundir.client_state_of(run_dir, tag)
    root = rundir.universal_dir(run_dir) if universal else rundir.checkpoint_dir(run_dir)
    schedule = getattr(engine, "lr_scheduler", None)
    lambda_schedule = isinstance(schedule, torch.optim.lr_scheduler.LambdaLR)
    configured = list(schedule.base_lrs) if lambda_schedule else None  # this run config's learning rates
    settings = _optimizer_settings(engine)  # and its weight decay, betas, eps: the load brings back the saved ones

    def restore() -> None:
        with restricted_unpickling(root / tag):
            with _read_failures_held(engine) as failures, _copy_back_held(engine, root / tag) as copy_failures:
                path, _ = engine.load_checkpoint(str(root), tag=tag, load_optimizer_states=True,
                                                 load_lr_scheduler_states=True,
                                                 load_module_strict=not has_frozen_parameters(engine))
            if failures:
                raise failures[0]
            if copy_failures:
                swap = engine.optimizer.optimizer_swapper.swap_folder
                raise UserError(f"{swap}: {durable.out_of_room(copy_failures[0])} while copying the optimizer's "
                                f"swap files back from {root / tag / 'offloaded_tensors'}; the checkpoint is intact: "
                                f"free space there and {rerun_advice()}")
            if path is None:
                raise UserError(f"{root / tag}: DeepSpeed could not load this checkpoint")
            if universal and engine.zero_optimization_partition_weights():
                _separate_zero3_steps(engine)
            if dist.get_rank() < client_state["world_size"]:
                restore_rng_state(run_dir, tag, dist.get_rank())

    agreed(restore, announce=dist.get_rank() == 0)
    for group, own in zip(engine.optimizer.param_groups, settings, strict=True):
        group.update(own)
    if lambda_schedule and (schedule.base_lrs != configured or not clock_driven):
        schedule.base_lrs = configured
        _continue_at([base * multiplier(schedule.last_epoch)
                      for base, multiplier in zip(configured, schedule.lr_lambdas, strict=True)], schedule)
    elif schedule is not None and not lambda_schedule:  # DeepSpeed's WarmupLR, WarmupDecayLR, WarmupCosineLR
        _continue_at(schedule.get_lr(), schedule)
    return client_state


@contextmanager
def _read_failures_held(engine) -> Iterator[list[Exception]]:
    """Inside, a failure of DeepSpeed's engine to read its model or optimizer files (a damaged file that only this
    rank reads: its optimizer partition, its ZeRO-3 model states) is recorded in the yielded list instead of raised,
    and the load goes on without that file's state through the collectives after it (ZeRO-3 gathers its persistent
    parameters), where the other ranks wait; the caller raises it. With one rank, nothing is held."""
    failures: list[Exception] = []
    if dist.get_world_size() == 1:
        yield failures
        return

    def held(read, instead):
        def holding(*args, **kwargs):
            try:
                return read(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - raised by the caller once DeepSpeed's load is over
                failures.append(exc)
                return instead
        return holding

    engine._load_checkpoint = held(engine._load_checkpoint, (None, None))  # as for no checkpoint: no partition read
    engine._load_zero_checkpoint = held(engine._load_zero_checkpoint, True)  # True: no fallback to the weights
    try:
        yield failures
    finally:
        del engine._load_checkpoint, engine._load_zero_checkpoint  # the class's methods again


@contextmanager
def _copy_back_held(engine, folder: Path) -> Iterator[list[Exception]]:
    """Inside, DeepSpeed's load under NVMe optimizer offload, which copies checkpoint folder `folder`'s
    offloaded_tensors/rank<NN> back to the optimizer swapper's folder on the NVMe drive (`DeepSpeedEngine.
    load_checkpoint`), holds that copy as its save holds its copy out to the checkpoint (`_copies_followed`): the
    first file that runs out of room (a full drive) is recorded in the yielded list and nothing more is copied, nor
    read back from the drive (the optimizer's `reset_swap_buffers`), so that the rank goes on through the load's
    collectives where the others wait; the caller raises it. A copy that raised on one rank ended that rank alone,
    with a shutil.Error of texts."""
    failures: list[Exception] = []
    optimizer = engine.optimizer
    swapped_back = getattr(optimizer, "reset_swap_buffers", None)
    own = "reset_swap_buffers" in getattr(optimizer, "__dict__", {})
    if swapped_back is not None:
        optimizer.reset_swap_buffers = _held(swapped_back, failures)
    try:
        with _copies_followed(folder, failures, [], out_of=True):
            yield failures
    finally:
        if own:
            optimizer.reset_swap_buffers = swapped_back
        elif swapped_back is not None:
            del optimizer.reset_swap_buffers  # the class's method again


SCHEDULED = ("params", "lr", "initial_lr", "step")
"""Param group entries that are not the run config's settings: the parameters, what the schedule sets, and the step
count an optimizer (DeepSpeed's FusedAdam) keeps there."""


def _optimizer_settings(engine) -> list[dict[str, Any]]:
    """The run config's settings of each param group (weight decay, betas, eps, ...), as the engine was built: a
    checkpoint's optimizer state brings back the settings it was saved with, and a resume that changed them (the
    documented way to change them) trained on with the old ones."""
    return [{key: value for key, value in group.items() if key not in SCHEDULED}
            for group in engine.optimizer.param_groups]


def _separate_zero3_steps(engine) -> None:
    """Undo what DeepSpeed's ZeRO-3 universal load (`load_hp_checkpoint_state_from_checkpoint_dir_stage3`) does to
    Adam's step count, which silently changed the resumed run's updates and was saved with its checkpoints: it gives
    every sub-group the same `step` tensor, which Adam then advances once per sub-group each step (the bias
    corrections of a later step). Each sub-group gets a step of its own. (That load also sets every param group's
    settings to the first group's, weight decay on the norms and biases: `load` sets every group's own again.)"""
    zero = engine.optimizer
    for flat in zero.fp32_partitioned_groups_flat:
        state = zero.optimizer.state.get(flat, {})
        if isinstance(state.get("step"), torch.Tensor):
            state["step"] = state["step"].clone()


def _continue_at(rates: list[float], schedule) -> None:
    """Train the next step at `rates`, this run's schedule at its restored step. The loaded optimizer state brought
    back the rates the saved run had computed for that step, so a resume with another train.lr trained at the old
    rate throughout, and one with another train.max_steps or warmup (or a DeepSpeed schedule's total_num_steps) for
    its first step."""
    for group, rate in zip(schedule.optimizer.param_groups, rates, strict=True):
        group["lr"] = rate
    schedule._last_lr = list(rates)


def restore_rng_state(run_dir: Path, tag: str, rank: int) -> None:
    """Set this process's RNGs from the RNG file of `rank` in checkpoint `tag` (`rng_state`, written by `save`);
    a missing file or one of another structure is a UserError naming it."""
    path = rundir.rng_file(run_dir, tag, rank)
    try:
        state = torch.load(path, weights_only=True)
    except FileNotFoundError:
        raise UserError(f"{path} is missing, so rank {rank}'s random state cannot be restored; "
                        f"{rundir.damaged_checkpoint_advice(run_dir, tag)}") from None
    try:
        set_rng_state(state)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError, RuntimeError) as exc:
        raise UserError(f"{path} is damaged (not the random state of a rank: {type(exc).__name__}: {exc}), so "
                        f"checkpoint {tag} cannot be used; {rundir.damaged_checkpoint_advice(run_dir, tag)}") from None


class Checkpointer:
    """Decides when a step is saved: every `save_every` steps (0 = never on a schedule), at the end of the run,
    and when the ranks agreed to stop. `client_state(stopped_by_signal)` gives what the checkpoint records beside
    DeepSpeed's own state."""

    def __init__(self, engine, run_dir: Path, save_every: int, keep: int,
                 client_state: Callable[[bool], dict[str, Any]]) -> None:
        self.engine, self.run_dir, self.save_every, self.keep = engine, run_dir, save_every, keep
        self.client_state = client_state

    def due(self, step: int, last: bool, stopped_by_signal: bool) -> bool:
        return last or stopped_by_signal or bool(self.save_every and step % self.save_every == 0)

    def after_step(self, step: int, last: bool, stopped_by_signal: bool) -> None:
        if self.due(step, last, stopped_by_signal):
            save(self.engine, self.run_dir, step, lambda: self.client_state(stopped_by_signal), self.keep)
