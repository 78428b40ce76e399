"""A prepared data folder (what `zerollm data prepare` wrote) as training reads it first: the root attributes of its
`tokens.h5`, checked. Light (h5py, no torch), so a command can refuse a wrong `--data` before it loads torch."""

from __future__ import annotations

import re
from pathlib import Path

import h5py
import numpy as np

from llm import durable, rundir
from llm.data.prepare import SCHEMA_VERSION, SPLITS, STREAMS, TOKENS_FILE
from llm.errors import UserError
from llm.tokenizer import Tokenizer

DISTILL_DATA_KINDS = ("pretrain", "sft")
"""Prepared data a student is distilled on: documents (every target bears loss) or conversations (the replies)."""


def h5_attrs(h5: h5py.File) -> dict:
    """The file's root attributes as Python values."""
    return {k: (v.item() if isinstance(v, np.generic) else v) for k, v in h5.attrs.items()}


def layout_problem(h5: h5py.File, kind: str | None) -> str | None:
    """What of the arrays `data prepare` writes for data of `kind` (every split's fields and offsets, `STREAMS`) the
    file lacks or holds in another type, or None (also for an unknown kind, refused by its name after)."""
    for split in SPLITS:
        for stream, fields in STREAMS.get(kind, {}).items():
            for name in (*fields, f"{stream}_offsets"):
                array = h5.get(f"{split}/{name}")
                if not isinstance(array, h5py.Dataset) or array.ndim != 1:
                    return f"the {split} split has no {name} array"
                kind_wanted = "i" if name.endswith("_offsets") else "u"
                if array.dtype.kind != kind_wanted:
                    wanted = "signed integers" if kind_wanted == "i" else "unsigned integers"
                    return f"{split}/{name} holds {array.dtype} values, not the {wanted} data prepare writes"
    return None


def read_data_attrs(data_dir: str | Path, kind: str | tuple[str, ...], reader: str = "this stage") -> dict:
    """Root attributes of `data_dir/tokens.h5`, checked for schema version and kind (one kind, or any of several,
    which `reader` needs), and the tokenizer copy beside it (`data_dir/tokenizer/`, when there is one) checked
    against the hash the tokens were made with."""
    kinds = (kind,) if isinstance(kind, str) else kind
    path = Path(data_dir) / TOKENS_FILE
    if not Path(data_dir).is_dir():
        problem = f"{data_dir}: not a directory" if Path(data_dir).exists() else durable.no_such_folder(Path(data_dir))
        raise UserError(f"{problem}; pass the folder `zerollm data prepare --out` wrote")
    if not path.is_file():
        raise UserError(f"{data_dir}: no {TOKENS_FILE}; create it with `zerollm data prepare --kind "
                        f"{' or --kind '.join(kinds)}`")
    try:
        with h5py.File(path, "r") as h5:
            attrs = h5_attrs(h5)
            layout = layout_problem(h5, attrs.get("kind"))
    except PermissionError:  # h5py raises its open's errno as Python's subclass of OSError
        raise UserError(f"{path}: permission denied; give this user read access to it") from None
    except OSError as exc:  # cut short by a copy, or not HDF5: h5py says why in parentheses
        reason = re.search(r"\((.*)\)", str(exc))
        raise UserError(f"{path}: not a readable HDF5 file ({reason[1] if reason else exc}); copy it again, or "
                        "prepare the data again with `zerollm data prepare`") from None
    if attrs.get("schema_version") != SCHEMA_VERSION:
        raise UserError(f"{path}: schema version {attrs.get('schema_version')} is not {SCHEMA_VERSION}; "
                        "prepare the data again")
    if attrs.get("kind") not in kinds:
        raise UserError(f"{path}: holds '{attrs.get('kind')}' data, {reader} needs "
                        f"{' or '.join(repr(k) for k in kinds)}")
    if layout is not None:
        raise UserError(f"{path}: {layout}; the file was changed after `zerollm data prepare` wrote it: prepare the "
                        "data again")
    tokenizer_dir = rundir.tokenizer_dir(Path(data_dir))
    if tokenizer_dir.is_dir() and not (copy := Tokenizer.load(tokenizer_dir)).has_hash(attrs["tokenizer_hash"]):
        raise UserError(f"{tokenizer_dir} (hash {copy.hash}) is not the tokenizer {path} was made with (hash "
                        f"{attrs['tokenizer_hash']}); prepare the data again with `zerollm data prepare`")
    return attrs


def stage_data_attrs(stage: str, data_dir: str | None) -> dict:
    """The checked attributes of the prepared data (`--data`) a training stage other than GRPO trains on."""
    if not data_dir:
        raise UserError("no training data: pass --data DIR (a directory made by `zerollm data prepare`)")
    return read_data_attrs(data_dir, DISTILL_DATA_KINDS if stage == "distill" else stage)
