"""Training datasets over a prepared tokens.h5 (`llm.data.datasets`): what reading them costs."""

import random
from pathlib import Path

import h5py
import numpy as np
import pytest

from llm.data.datasets import PretrainWindows
from llm.data.prepare import CHUNK_TOKENS, TOKENS_FILE


def _bytes_read() -> int:
    """Bytes this process has read through read() and pread() so far (Linux's /proc/self/io `rchar`)."""
    line = next(line for line in Path("/proc/self/io").read_text().splitlines() if line.startswith("rchar:"))
    return int(line.split()[1])


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="counts the bytes read through Linux's /proc/self/io")
def test_random_windows_read_only_their_own_tokens(tmp_path):
    """Training reads windows in a shuffled order. Through HDF5's default chunk cache each window read the whole
    chunk of 64 Ki tokens around it: at seq 512, 128 times the bytes it used, from a shared file system on every
    rank."""
    seq_len, n_tokens = 512, 16 * CHUNK_TOKENS
    with h5py.File(tmp_path / TOKENS_FILE, "w") as h5:
        h5.create_group("train").create_dataset("tokens", data=np.arange(n_tokens, dtype=np.uint32),
                                                chunks=(CHUNK_TOKENS,))
    windows = PretrainWindows(tmp_path, "train", seq_len)
    windows[0]  # opened: its metadata read
    order = random.Random(0).sample(range(len(windows)), 200)
    before = _bytes_read()
    for index in order:
        sample = windows[index]
        assert int(sample["tokens"][0]) == index * seq_len and int(sample["targets"][-1]) == (index + 1) * seq_len
    used = len(order) * (seq_len + 1) * 4
    assert _bytes_read() - before < 2 * used
