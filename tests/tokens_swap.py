"""A prepared folder's tokens.h5 replaced as `zerollm data prepare` replaces it, for the tests of a run whose data
changes under it."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import h5py

from llm.data.prepare import DIGEST_ATTR, content_digest


def replace_tokens_file(tokens_file: Path, change: Callable[[h5py.File], None]) -> None:
    """`tokens_file` replaced by a copy with `change` applied, renamed over it."""
    new = tokens_file.with_name("new.h5")
    shutil.copy(tokens_file, new)
    with h5py.File(new, "r+") as h5:
        change(h5)
    os.replace(new, tokens_file)


def reversed_tokens(h5: h5py.File) -> None:
    """The train split's tokens in reverse order, with the digest `data prepare` would store for them."""
    h5["train/tokens"][:] = h5["train/tokens"][:][::-1]
    if DIGEST_ATTR in h5.attrs:
        h5.attrs[DIGEST_ATTR] = content_digest(h5)
