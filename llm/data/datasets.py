"""Training samples read lazily from the HDF5 written by `data prepare`.

Nothing is tokenized here and no corpus is loaded whole: each sample is a few slices read from the
chunked arrays. The file is opened on first access in each process (DataLoader workers included),
never shared across a fork.

    pretrain  PretrainWindows       windows over the packed token stream
    sft       PackedConversations   conversations packed into windows, loss mask, segment ids
    dpo       PreferencePairs       prompt + chosen / prompt + rejected with reply masks
"""

from __future__ import annotations

import bisect
import os
from pathlib import Path

import h5py
import numpy as np
import torch
from torch.utils.data import Dataset

from llm.data.prepare import DIGEST_ATTR, TOKENS_FILE
from llm.data.prepared import h5_attrs
from llm.errors import UserError


def _check_fits(data_dir: str | Path, h5: h5py.File, longest: int, seq_len: int, what: str) -> None:
    """Refuse samples longer than data.seq_len (never cut them silently), naming both lengths."""
    if longest > seq_len:
        prepared = h5_attrs(h5).get("seq_len")
        raise UserError(f"{data_dir}: {what} take up to {longest} positions (prepared with --seq-len {prepared}), "
                        f"more than data.seq_len {seq_len}; set data.seq_len={prepared} or prepare the data again "
                        f"with --seq-len {seq_len}")


def check_token_ids(batch: dict[str, torch.Tensor], vocab_size: int, data_dir: str | Path, split: str) -> None:
    """Refuse a batch (on the host, before it reaches the device) holding a token id the model has no embedding for:
    an IndexError traceback on the CPU, a device-side assert on a GPU. `data prepare` writes only ids of the
    tokenizer it records, so such an id means a file changed since."""
    ids = [v for k, v in batch.items() if k.endswith(("tokens", "targets")) and v.numel()]
    if not ids:  # a batch of other inputs
        return
    highest = max(int(v.max()) for v in ids)
    if highest >= vocab_size:
        raise UserError(f"{Path(data_dir) / TOKENS_FILE}: the {split} split holds token id {highest}, beyond the "
                        f"model's vocabulary of {vocab_size} (ids 0-{vocab_size - 1}); the file was changed after "
                        "`zerollm data prepare` wrote it: prepare the data again")


def checked_to(device: torch.device, batch: dict[str, torch.Tensor], vocab_size: int, data_dir: str | Path,
               split: str) -> dict[str, torch.Tensor]:
    """`batch` on `device` (copied without waiting on a GPU), its token ids checked first (`check_token_ids`)."""
    check_token_ids(batch, vocab_size, data_dir, split)
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def _identity(h5: h5py.File) -> tuple:
    """Which data an open tokens.h5 holds: its stored digest of everything in it (`prepare.DIGEST_ATTR`), or, in a
    file prepared before there was one, its size and modification time. Not its inode: on FUSE and some network
    file systems one file's inode changes."""
    if (digest := h5.attrs.get(DIGEST_ATTR)) is not None:
        return (str(digest),)
    stat = os.fstat(h5.id.get_vfd_handle())
    return stat.st_size, stat.st_mtime_ns


class _LazyH5:
    """Opens `tokens.h5` on first access in each process (DataLoader workers included), without HDF5's chunk cache:
    training reads windows at random, and through the default 1 MiB cache each window read the whole 64 Ki-token
    chunk around it (a 2,049-token window of uint32 tokens: 29 times the bytes used; 128 times at seq 512), from a
    shared file system on every rank.

    Every open after the first (the dataset's own, as it is built) must find the same file, unchanged: the workers
    of each epoch open it again, and a `data prepare` into the folder meanwhile (which replaces the file) had them
    train on the new data, and packed samples on the old one's offsets, without a word."""

    def __init__(self, data_dir: str | Path, split: str) -> None:
        self.path, self.split = Path(data_dir) / TOKENS_FILE, split
        self._group = None
        self.identity: tuple | None = None

    def open(self) -> h5py.File:
        try:
            h5 = h5py.File(self.path, "r", rdcc_nbytes=0)
        except OSError as exc:
            if self.identity is None:  # the first open: what is wrong is said where the data is checked
                raise
            raise UserError(f"{self.path}: cannot open it again ({exc.strerror or exc}) after this run started reading "
                            "it (removed or moved?); a run reads its data until it ends") from None
        found = _identity(h5)
        if self.identity is None:
            self.identity = found
        elif found != self.identity:
            h5.close()
            raise UserError(f"{self.path} was replaced or changed after this run started reading it (a `zerollm data "
                            f"prepare` into {os.path.abspath(self.path.parent)}?); a run trains on one version of its "
                            "data: prepare new data into another folder")
        return h5

    def group(self) -> h5py.Group:
        if self._group is None:
            self._group = self.open()[self.split]
        return self._group

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_group": None}


class PretrainWindows(Dataset):
    """Non-overlapping windows of `seq_len + 1` tokens over a split's packed token stream.

    Sample i covers tokens [i * seq_len, (i + 1) * seq_len]; inputs are its first seq_len tokens and
    targets the last seq_len, so every token of the stream is predicted exactly once.
    """

    def __init__(self, data_dir: str | Path, split: str, seq_len: int, pad_id: int = 0) -> None:
        self.h5, self.seq_len = _LazyH5(data_dir, split), seq_len
        with self.h5.open() as h5:
            n_tokens = h5[split]["tokens"].shape[0]
        self.num_windows = max(0, (n_tokens - 1) // seq_len)

    def __len__(self) -> int:
        return self.num_windows

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        start = index * self.seq_len
        window = torch.from_numpy(self.h5.group()["tokens"][start:start + self.seq_len + 1].astype(np.int64))
        return {"tokens": window[:-1], "targets": window[1:]}


def pack_best_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices grouped into bins of total length <= capacity: best-fit decreasing, deterministic."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    free: list[tuple[int, int]] = []  # (remaining capacity, bin), sorted
    bins: list[list[int]] = []
    for i in order:
        slot = bisect.bisect_left(free, (lengths[i], -1))
        if slot == len(free):
            bins.append([i])
            bisect.insort(free, (capacity - lengths[i], len(bins) - 1))
        else:
            remaining, b = free.pop(slot)
            bins[b].append(i)
            bisect.insort(free, (remaining - lengths[i], b))
    return bins


class PackedConversations(Dataset):
    """SFT conversations packed several to a window of `seq_len` predicted positions.

    A conversation of n tokens takes n - 1 positions (inputs t[:-1], targets t[1:], loss mask m[1:]);
    windows are filled best-fit decreasing, so little is padding. `segment_ids` (1, 2, ... per sample,
    0 for padding) make the model restart positions and keep attention inside each sample.
    """

    def __init__(self, data_dir: str | Path, split: str, seq_len: int, pad_id: int) -> None:
        self.h5, self.seq_len, self.pad_id = _LazyH5(data_dir, split), seq_len, pad_id
        with self.h5.open() as h5:
            self.offsets = h5[split]["doc_offsets"][:]
            lengths = (np.diff(self.offsets) - 1).tolist()
            _check_fits(data_dir, h5, max(lengths, default=0), seq_len, "conversations")
        self.windows = pack_best_fit(lengths, seq_len)
        used = sum(lengths)
        self.padding_fraction = 1 - used / (len(self.windows) * seq_len) if self.windows else 0.0

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        group = self.h5.group()
        out = {"tokens": torch.full((self.seq_len,), self.pad_id, dtype=torch.long),
               "targets": torch.full((self.seq_len,), self.pad_id, dtype=torch.long),
               "loss_mask": torch.zeros(self.seq_len, dtype=torch.long),
               "segment_ids": torch.zeros(self.seq_len, dtype=torch.long)}
        pos = 0
        for segment, sample in enumerate(self.windows[index], start=1):
            start, end = self.offsets[sample], self.offsets[sample + 1]
            tokens = torch.from_numpy(group["tokens"][start:end].astype(np.int64))
            mask = torch.from_numpy(group["loss_mask"][start:end].astype(np.int64))
            n = len(tokens) - 1
            out["tokens"][pos:pos + n], out["targets"][pos:pos + n] = tokens[:-1], tokens[1:]
            out["loss_mask"][pos:pos + n], out["segment_ids"][pos:pos + n] = mask[1:], segment
            pos += n
        return out


class PreferencePairs(Dataset):
    """DPO pairs: prompt + chosen and prompt + rejected, each right-padded to `seq_len` positions with a loss
    mask on the reply's targets. A pair longer than `seq_len` positions is refused, not cut (a cut prompt
    would leave no reply token to learn from)."""

    def __init__(self, data_dir: str | Path, split: str, seq_len: int, pad_id: int) -> None:
        self.h5, self.seq_len, self.pad_id = _LazyH5(data_dir, split), seq_len, pad_id
        with self.h5.open() as h5:
            self.offsets = {name: h5[split][f"{name}_offsets"][:] for name in ("prompt", "chosen", "rejected")}
            lengths = {name: np.diff(offsets) for name, offsets in self.offsets.items()}
            pairs = lengths["prompt"] + np.maximum(lengths["chosen"], lengths["rejected"]) - 1
            _check_fits(data_dir, h5, int(pairs.max(initial=0)), seq_len, "preference pairs")

    def __len__(self) -> int:
        return len(self.offsets["prompt"]) - 1

    def _read(self, name: str, index: int) -> np.ndarray:
        offsets = self.offsets[name]
        return self.h5.group()[name][offsets[index]:offsets[index + 1]].astype(np.int64)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        prompt = self._read("prompt", index)
        out = {}
        for reply in ("chosen", "rejected"):
            seq = torch.from_numpy(np.concatenate([prompt, self._read(reply, index)]))
            n = len(seq) - 1
            tokens = torch.full((self.seq_len,), self.pad_id, dtype=torch.long)
            targets, mask = tokens.clone(), torch.zeros(self.seq_len, dtype=torch.long)
            tokens[:n], targets[:n] = seq[:-1], seq[1:]
            mask[len(prompt) - 1:n] = 1
            out |= {f"{reply}_tokens": tokens, f"{reply}_targets": targets, f"{reply}_mask": mask}
        return out


DATASETS = {"pretrain": PretrainWindows, "sft": PackedConversations, "dpo": PreferencePairs}
