"""Rank agreement, checked at rendezvous before any training step.

Every rank all-gathers a fingerprint: the code version, the software versions, every key of the
resolved run config and DeepSpeed config, the digest of its data (the run record's, `llm.train.run_record`: of
all the data, not a sample of it) and the tokenizer hash. Nodes
started with a different checkout, config or data would otherwise train silently on different
things (or deadlock in mismatched collectives); here the job stops on every rank with one message
naming the differing fields and ranks. Node-local paths (data.path, train.init_from, train.teacher,
grpo.prompts) are not compared; the data and weights they hold are, through their digests.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import platform
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from llm.errors import UserError
from llm.runtime.distributed import raise_together

PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the checkout (llm/runtime/ is two levels down)
CODE_DIRS = ("llm", "kernels", "launch", "ds_configs")
NODE_LOCAL_KEYS = {"config.data.path", "config.train.init_from", "config.train.teacher", "config.grpo.prompts"}
PRECISION_FIELD = "config.train.precision"
"""Resolved on each node (`llm.train.engine.resolve_precision`), so `auto` can differ between unlike CPUs."""
_CHUNK = 1 << 20


def code_version() -> str:
    """Digest of the package's source files (works without git, and catches uncommitted edits)."""
    digest = hashlib.sha256()
    for top in CODE_DIRS:
        for path in sorted((PACKAGE_ROOT / top).rglob("*")):
            if path.suffix in (".py", ".json", ".yaml") and "__pycache__" not in path.parts:
                digest.update(str(path.relative_to(PACKAGE_ROOT)).encode())
                digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def file_digest(path: Path) -> str:
    """Size plus the first and last MiB: cheap on multi-GB files, blind to a change between them (what runs
    recorded as their data's digest before `whole_file_digest`, and what weights are identified by)."""
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        digest.update(f.read(_CHUNK))
        f.seek(max(0, size - _CHUNK))
        digest.update(f.read(_CHUNK))
    return digest.hexdigest()[:16]


STRIDED_SAMPLES, STRIDED_BYTES = 256, 4096


def strided_digest(path: Path) -> str:
    """The size and `STRIDED_SAMPLES` reads of `STRIDED_BYTES` spread evenly through the file: a megabyte of a
    weights file of any size, which sees a tensor changed anywhere in it that is longer than the stride (a layer's
    matrix retrained, adapters merged into it) where `file_digest`'s two ends did not."""
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        for sample in range(STRIDED_SAMPLES):
            f.seek(sample * max(0, size - STRIDED_BYTES) // max(1, STRIDED_SAMPLES - 1))
            digest.update(f.read(STRIDED_BYTES))
    return digest.hexdigest()[:16]


def whole_file_digest(path: Path, folder_files: list[Path] | None = None) -> str:
    """sha256 of every byte of the file, read a MiB at a time; of a folder (a datasets save_to_disk folder, which
    GRPO's prompts may be), of each of `folder_files` in it (by default every file under it), in sorted order: its
    path in the folder, then its bytes."""
    digest = hashlib.sha256()
    if path.is_dir() and folder_files is None:
        folder_files = [file for file in path.rglob("*") if file.is_file()]
    for file in sorted(folder_files) if path.is_dir() else [path]:
        if file != path:
            digest.update(f"\0{file.relative_to(path)}\0".encode())
        with open(file, "rb") as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()[:16]


WEIGHTS_PARTS = "; "
"""Separates the parts of a weights identity (`llm.loading.weights_summary`): an export's weights file (a sharded
export's index, then its shards), then their strided digest."""


def same_weights(recorded: str, now: str) -> bool:
    """Whether the weights identity `now` is the one `recorded` before. A record from before a part was added (the
    shards' digest after the index's, the strided digest after those) matches while its parts are unchanged, as it
    did when it was written."""
    return now == recorded or now.startswith(recorded + WEIGHTS_PARTS)


def _flatten(prefix: str, node: Any, out: dict[str, str]) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            _flatten(f"{prefix}.{key}", value, out)
    else:
        out[prefix] = repr(node)


def fingerprint(config: dict, ds_config: dict, data_digest: str, tokenizer_hash: str,
                models: dict[str, str] | None = None) -> dict[str, str]:
    """What the ranks of a job compare before they train: code, software, data, tokenizer, config, and the weights of
    the frozen `models` they load (a teacher, a base: `llm.loading.weights_summary`'s `weights`)."""
    fields = {"code": code_version(),
              "software": f"python {platform.python_version()}, torch {torch.__version__}, "
                          f"deepspeed {importlib.metadata.version('deepspeed')}",
              "data": data_digest, "tokenizer": tokenizer_hash,
              **{f"{role} weights": weights for role, weights in (models or {}).items()}}
    _flatten("config", config, fields)
    _flatten("ds_config", ds_config, fields)
    for key in NODE_LOCAL_KEYS:
        fields.pop(key, None)
    return fields


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(map(str, ranks))


def mismatch_message(prints: list[dict[str, str]]) -> str | None:
    """One message naming every field on which the ranks disagree, with the ranks holding each value."""
    differing, differing_fields = [], set()
    for field in sorted(set().union(*prints)):
        holders: dict[str, list[int]] = {}
        for rank, fields in enumerate(prints):
            holders.setdefault(fields.get(field, "<missing>"), []).append(rank)
        if len(holders) > 1:
            values = "; ".join(f"{value[:60]} on {_ranks(ranks)}" for value, ranks in holders.items())
            differing.append(f"{field}: {values}")
            differing_fields.add(field)
    if not differing:
        return None
    advice = "Start every node with the same code, config, data and tokenizer"
    if PRECISION_FIELD in differing_fields:
        advice += (" (train.precision=auto chooses by each node's hardware: set train.precision=bf16 or fp32 for "
                   "the whole job)")
    return "ranks disagree, nothing was trained: " + " | ".join(differing) + ". " + advice


class RanksDisagree(UserError):
    """Raised on every rank; `announce` is true on one rank per node, which prints it."""


def check_ranks_agree(mine: dict[str, str], announce: bool) -> None:
    """All-gather every rank's fingerprint; raise `RanksDisagree` on every rank if any field differs."""
    prints: list[dict[str, str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(prints, mine)
    message = mismatch_message(prints)
    if message:
        raise_together(message, announce, RanksDisagree)
