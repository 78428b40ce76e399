"""A record of every run: what ran, on what, with what, written when a run starts or resumes.

RUN_DIR/run_record.jsonl gets one JSON object per session (start or resume), and the wandb run's config gets the
newest as `run_record`:

    time, command      UTC start time; the command line as typed (`zerollm ... --nproc 2`: `launch.local` passes
                       it to the ranks it starts) and working directory
    code               git commit and whether the checkout had uncommitted changes or files git does not ignore
                       (when the package runs from a git checkout), and the digest of the package source
                       (`llm.runtime.fingerprint.code_version`)
    versions           python, torch (with its CUDA), deepspeed and the other libraries that shape the numbers
    ranks              rank, local rank, host, pid, device and CPU threads of every rank (gathered at the start)
    data               the data directory, the digest of all of tokens.h5 (`llm.data.prepare.tokens_digest`) or of
                       the GRPO prompt files, `digest_method` "whole" (a record without one holds the digest of size
                       and first and last MiB, `llm.runtime.fingerprint.file_digest`), the tokenizer hash and the
                       tokens of each split
    resumed_from       the checkpoint tag a resumed session started from

A session that trains nothing (a resume of a finished run) adds no record.

Resuming on other data than the run was trained on is refused (`check_same_data`), naming what differs.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import h5py
import torch
import torch.distributed as dist

from launch.local import COMMAND_VARIABLE
from llm import durable, rundir
from llm.data.prepare import SPLITS, TOKENS_FILE, stored_digest, tokens_digest
from llm.data.readers import dataset_files
from llm.errors import UserError
from llm.jsonl import JsonLine, json_text, jsonl_lines
from llm.runtime.distributed import DistInfo
from llm.runtime.fingerprint import PACKAGE_ROOT, code_version, file_digest, same_weights, whole_file_digest

LIBRARIES = ("zerollm", "deepspeed", "numpy", "h5py", "tokenizers", "safetensors", "triton", "transformers", "wandb")
DIGEST_METHOD = "whole"
"""How the data digests of new records are made: from all of the data. Records without `digest_method` hold
`sampled_digest`s, and are compared with those (`check_same_data`)."""


def data_summary(data_dir: Path, attrs: dict[str, Any]) -> dict[str, Any]:
    """What identifies a prepared data directory: digest, tokenizer hash, tokens per split."""
    path = data_dir / TOKENS_FILE
    with h5py.File(path, "r") as h5:
        tokens = {split: int(sum(h5[split][name].shape[0] for name in h5[split] if not name.endswith("offsets")
                                 and name != "loss_mask"))
                  for split in SPLITS if split in h5}
    return {"path": str(data_dir.resolve()), "digest": tokens_digest(path), "digest_method": DIGEST_METHOD,
            "tokenizer_hash": attrs["tokenizer_hash"], "tokens": tokens}


def prompts_summary(files: list[Path], attrs: dict[str, Any]) -> dict[str, Any]:
    """What identifies GRPO's prompt files (read raw, so no token counts): their paths and digests, the tokenizer."""
    return {"path": ",".join(str(path.resolve()) for path in files),
            "digest": ",".join(whole_file_digest(path, dataset_files(path) if path.is_dir() else None)
                               for path in files), "digest_method": DIGEST_METHOD,
            "tokenizer_hash": attrs["tokenizer_hash"], "tokens": {}}


def _every_file_digest(files: list[Path]) -> str:
    """The prompt files' digest as the version before `dataset_files` made it: of every file in a save_to_disk
    folder, the cache files of a `.map()` included. A record it made is still taken for the same prompts."""
    return ",".join(whole_file_digest(path) for path in files)


def sampled_digest(files: list[Path]) -> str:
    """The data digest of records made before `digest_method` (size and first and last MiB of each file)."""
    return ",".join(file_digest(path) for path in files)


def git_state(root: Path = PACKAGE_ROOT) -> dict[str, Any] | None:
    """The commit and dirtiness of the checkout the package runs from; None outside a git checkout (an installed
    package, even one inside another repository's tree)."""
    def git(*args: str) -> str | None:
        try:
            result = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30,
                                    check=False)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return result.stdout.strip() if result.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != root.resolve():
        return None
    # dirty: uncommitted changes, or files git does not ignore but was not told about (a new module)
    return {"commit": git("rev-parse", "HEAD"),
            "dirty": bool(git("status", "--porcelain", "--untracked-files=normal"))}


def versions() -> dict[str, str]:
    found = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda or "none"}
    for name in LIBRARIES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def _this_rank(info: DistInfo) -> dict[str, Any]:
    device = torch.cuda.get_device_name(info.device) if info.device.type == "cuda" else platform.processor() or "cpu"
    return {"rank": info.rank, "local_rank": info.local_rank, "host": socket.gethostname(), "pid": os.getpid(),
            "device": f"{info.device} ({device})", "cpu_threads": torch.get_num_threads()}


def run_record(info: DistInfo, data: dict[str, Any], resumed_from: str | None) -> dict[str, Any]:
    """This session's record; call on every rank (the ranks' hosts are all-gathered)."""
    ranks: list[dict[str, Any] | None] = [None] * info.world_size
    if info.world_size > 1:
        dist.all_gather_object(ranks, _this_rank(info))
    else:
        ranks = [_this_rank(info)]
    return {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": os.environ.get(COMMAND_VARIABLE) or shlex.join(["zerollm", *sys.argv[1:]]), "cwd": os.getcwd(),
            "code": {"git": git_state(), "digest": code_version()}, "versions": versions(),
            "world_size": info.world_size, "ranks": ranks, "data": data, "resumed_from": resumed_from}


def _is_record(value: Any) -> bool:
    return isinstance(value, dict) and isinstance(value.get("data"), dict)


def _records(path: Path) -> tuple[list[JsonLine], JsonLine | None]:
    """The lines of a run_record.jsonl, and apart from them its last line if a kill left it unfinished (no newline
    after it, not a record): its session was writing its record, and trained nothing."""
    lines = list(jsonl_lines(path)) if path.is_file() else []
    torn = lines.pop() if lines and not lines[-1].ended and not _is_record(lines[-1].value) else None
    return lines, torn


def write_run_record(run_dir: Path, record: dict[str, Any]) -> None:
    """Add `record` as a line of its own, in place of a last line a killed session left unfinished. The file is
    replaced whole (`durable.write_bytes`), so a kill or a full disk leaves it as it was; one that runs out of room
    is a UserError naming the run directory."""
    path = run_dir / rundir.RUN_RECORD_FILE
    lines, torn = _records(path)
    before = path.read_bytes() if path.is_file() else b""
    if torn is not None:
        print(f"zerollm: note: {path}:{torn.number}: dropped a line that is not a run record (torn by a killed run)",
              file=sys.stderr, flush=True)
        before = before[:torn.offset]
    unended = torn is None and bool(lines) and not lines[-1].ended  # a record a text editor left without its newline
    line = ("\n" if unended else "") + json_text(record) + "\n"
    with durable.room_needed(run_dir, rundir.RUN_RECORD_FILE):
        durable.write_bytes(path, before + line.encode("utf-8"))


def last_record(run_dir: Path) -> dict[str, Any] | None:
    """The newest session's record (a last line left unfinished by a killed session does not count); None for a run
    without one."""
    path = run_dir / rundir.RUN_RECORD_FILE
    lines, _ = _records(path)
    if not lines:
        return None
    last = lines[-1]
    if not _is_record(last.value):
        raise UserError(f"{path}:{last.number}: not a run record (the file is damaged); `zerollm train` writes one "
                        "line per session: restore the file, or delete that line to resume without the checks it "
                        "enables")
    return last.value


def check_same_data(run_dir: Path, data: dict[str, Any], files: list[Path],
                    legacy_tokenizer_hash: str | None = None) -> None:
    """Refuse to resume `run_dir` on data other than what its newest session trained on, naming the differences.
    `data` summarizes `files` (`data_summary`, `prompts_summary`); a record made before `digest_method` is compared
    with the `sampled_digest` of the files. `legacy_tokenizer_hash`: the whole-file hash an earlier version recorded
    for the same tokenizer (GRPO, whose input's hash is its tokenizer's, `Tokenizer.legacy_hash`)."""
    record = last_record(run_dir)
    if record is None:
        return
    before = record["data"]
    differences = []
    same_method = before.get("digest_method") == data["digest_method"]
    digest = data["digest"] if same_method else sampled_digest(files)
    if before["digest"] != digest and not same_method and data["tokens"] and stored_digest(files[0]):
        print(f"zerollm: note: {run_dir}'s record, made by an earlier version, identifies its data by the first and "
              f"last MiB of tokens.h5, which `data prepare` by this version changes (it stores a digest there): the "
              "data is compared by its token counts and tokenizer only", file=sys.stderr, flush=True)
    elif before["digest"] != digest and not (not data["tokens"] and before["digest"] == _every_file_digest(files)):
        what = "tokens.h5" if data["tokens"] else "prompt files"
        differences.append(f"{what} digest {before['digest']} then, {digest} now")
    for split in SPLITS:
        then, now = before["tokens"].get(split), data["tokens"].get(split)
        if then != now:
            differences.append(f"{split} split {then} tokens then, {now} now")
    if before["tokenizer_hash"] not in (data["tokenizer_hash"], legacy_tokenizer_hash):
        differences.append(f"tokenizer {before['tokenizer_hash']} then, {data['tokenizer_hash']} now")
    if differences:
        where = "" if before["path"] == data["path"] else f" (trained on {before['path']})"
        raise UserError(f"{data['path']}: not the data {run_dir} was trained on{where}: {'; '.join(differences)}. "
                        f"Resume with the original data, or start a new run from this one's weights with "
                        f"--init-from {run_dir}")


def check_same_weights(run_dir: Path, role: str, summary: dict[str, Any], option: str) -> None:
    """Refuse to resume `run_dir` with another model as its `role` (the distillation 'teacher', the LoRA 'base') than
    its newest session used (`llm.loading.weights_summary`): other weights, or the same weights under a config
    whose shape or function fields changed (recorded since they were), naming both. An export moved elsewhere is
    the same model (its weights are known by their digest); a run directory elsewhere is not (it is known by its run
    id and checkpoint, which a copy trained on keeps), unless none is left where it was: moved, not copied (a moved
    DPO run of a moved base could not be resumed, but as a new run)."""
    record = last_record(run_dir)
    before = record["data"].get(role) if record else None
    if before is None:
        return
    moved_run = "tag" in summary and before["path"] != summary["path"] and Path(before["path"]).exists()
    if moved_run or not same_weights(before["weights"], summary["weights"]):
        elsewhere = (" (a run directory is known by its path: a copy elsewhere may have trained on under the same "
                     "run id)") if moved_run and same_weights(before["weights"], summary["weights"]) else ""
        raise UserError(f"{option} {summary['path']} ({summary['weights']}): not the {role} {run_dir} was trained "
                        f"with ({before['path']}, {before['weights']}){elsewhere}; resume with that {role}, or start "
                        f"a new run from this one's weights with --init-from {run_dir}")
    then, now = before.get("model", {}), summary["model"]
    if changed := [f"model.{name} {then[name]} then, {now.get(name)} now" for name in then
                   if then[name] != now.get(name)]:
        raise UserError(f"{option} {summary['path']}: the weights {run_dir} was trained with, but their config changed "
                        f"since ({'; '.join(changed)}): another function; put its config back as it was")
