"""Training samples read lazily from the HDF5 written by `data prepare`.

Nothing is tokenized here and no corpus is loaded whole: each sample is one slice read from the
chunked token array. The file is opened on first access in each process (DataLoader workers
included), never shared across a fork.
"""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import torch
from torch.utils.data import Dataset

from llm.data.prepare import SCHEMA_VERSION, TOKENIZER_DIR, TOKENS_FILE
from llm.errors import UserError


def read_data_attrs(data_dir: str | Path, kind: str) -> dict:
    """Root attributes of `data_dir/tokens.h5`, checked for schema version and kind."""
    path = Path(data_dir) / TOKENS_FILE
    if not path.is_file():
        raise UserError(f"{data_dir}: no {TOKENS_FILE}; create it with `zerollm data prepare --kind {kind}`")
    with h5py.File(path, "r") as h5:
        attrs = {k: (v.item() if isinstance(v, np.generic) else v) for k, v in h5.attrs.items()}
    if attrs.get("schema_version") != SCHEMA_VERSION:
        raise UserError(f"{path}: schema version {attrs.get('schema_version')} is not {SCHEMA_VERSION}; prepare the data again")
    if attrs.get("kind") != kind:
        raise UserError(f"{path}: holds '{attrs.get('kind')}' data, this stage needs '{kind}'")
    return attrs


def tokenizer_dir_of(data_dir: str | Path) -> Path:
    return Path(data_dir) / TOKENIZER_DIR


class PretrainWindows(Dataset):
    """Non-overlapping windows of `seq_len + 1` tokens over a split's packed token stream.

    Sample i covers tokens [i * seq_len, (i + 1) * seq_len]; inputs are its first seq_len tokens and
    targets the last seq_len, so every token of the stream is predicted exactly once.
    """

    def __init__(self, data_dir: str | Path, split: str, seq_len: int) -> None:
        self.path = Path(data_dir) / TOKENS_FILE
        self.split, self.seq_len = split, seq_len
        with h5py.File(self.path, "r") as h5:
            n_tokens = h5[split]["tokens"].shape[0]
        self.num_windows = max(0, (n_tokens - 1) // seq_len)
        self._tokens = None

    def __len__(self) -> int:
        return self.num_windows

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if self._tokens is None:
            self._tokens = h5py.File(self.path, "r")[self.split]["tokens"]
        start = index * self.seq_len
        window = torch.from_numpy(self._tokens[start:start + self.seq_len + 1].astype(np.int64))
        return {"tokens": window[:-1], "targets": window[1:]}

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_tokens": None}
