"""The token streams evaluation scores: the documents of users' files, or a split prepared by `data prepare`.

A stream is one flat sequence of token ids laid out as `data prepare` writes a split (every document opened by the
tokenizer's `document_start_ids`, BOS for Llama-style tokenizers and nothing for ours, and closed by
<|endoftext|>), with one more <|endoftext|> in front as the context of the first document. Every token after that
leading one is scored except a document's start ids (`document_start_positions`): they are context, as
lm-evaluation-harness reads the BOS before a text, not text to predict. So the scored text is exactly the
documents' text and each one's <|endoftext|>.

Bytes, for bits per byte: the UTF-8 bytes of the text of the scored tokens. Documents are decoded one at a time
(split at <|endoftext|>), so no multi-byte character is cut; <|endoftext|> counts zero bytes (its prediction still
counts in the loss), and so does a document's start (it is not scored). For files it is the UTF-8 length of the
documents' text as the readers return it, counted from that text (decoding the tokens would count less for a
tokenizer that normalises, NFC or NFKC as Qwen's do, or has no token for some characters); for a prepared split,
where only the tokens remain, it is what they decode to.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

import h5py
import numpy as np
import torch
from tqdm import tqdm

from llm.data.datasets import check_token_ids
from llm.data.formats import Skipped, expand_inputs, read_records, skipped_note
from llm.data.prepare import SPLITS, TOKENS_FILE, encode_pretrain
from llm.data.prepared import read_data_attrs
from llm.errors import UserError
from llm.tokenizer import TextNotEncoded, Tokenizer

DECODE_CHUNK = 1 << 20


class TokenStream:
    """A flat sequence of token ids, read by slices (`read(start, end)` -> int64 array)."""

    eos_id: int

    def __len__(self) -> int:
        raise NotImplementedError

    def read(self, start: int, end: int) -> np.ndarray:
        raise NotImplementedError

    def chunks(self, size: int = DECODE_CHUNK) -> Iterator[np.ndarray]:
        for start in range(0, len(self), size):
            yield self.read(start, min(start + size, len(self)))


class ArrayStream(TokenStream):
    """A stream held in memory (users' files, tokenized here); `text_bytes`: the UTF-8 bytes of the text it holds,
    where that text was read."""

    def __init__(self, tokens: np.ndarray, eos_id: int, text_bytes: int | None = None) -> None:
        self.tokens, self.eos_id, self.text_bytes = tokens, eos_id, text_bytes

    def __len__(self) -> int:
        return len(self.tokens)

    def read(self, start: int, end: int) -> np.ndarray:
        return self.tokens[start:end].astype(np.int64)


class SplitStream(TokenStream):
    """A prepared split read lazily from tokens.h5, behind a virtual leading <|endoftext|>."""

    def __init__(self, path: Path, split: str, eos_id: int, vocab_size: int | None = None) -> None:
        self.path, self.split, self.eos_id, self.vocab_size = path, split, eos_id, vocab_size
        self._tokens = h5py.File(path, "r")[split]["tokens"]  # both splits there (`prepared.layout_problem`)

    def __len__(self) -> int:
        return 1 + self._tokens.shape[0]

    def read(self, start: int, end: int) -> np.ndarray:
        head = [self.eos_id] if start == 0 else []
        body = self._tokens[max(0, start - 1):max(0, end - 1)].astype(np.int64)
        if self.vocab_size is not None:  # an id beyond the model's embeddings: an IndexError traceback
            check_token_ids({"tokens": torch.from_numpy(body)}, self.vocab_size, self.path.parent, self.split)
        return np.concatenate([np.array(head, dtype=np.int64), body])


@dataclass
class FilesReport:
    """What was read from users' files."""

    documents: int = 0
    skipped: list[str] = field(default_factory=list)
    """Every unusable record as 'file:line: reason'."""


def stream_of_files(paths: list[str], tokenizer: Tokenizer, progress: bool = False) -> tuple[ArrayStream, FilesReport]:
    """The documents of `paths` (any format `data prepare` reads, as pretraining text) tokenized into one stream;
    `progress`: a bar of the records read, shown after 2 s (large inputs take minutes)."""
    report, text_bytes = FilesReport(), 0
    # token ids held as 4 bytes (windows are read as int64): three int64 copies took 5 bytes of memory per byte of
    # text, 893 MiB for 100 MB of Chinese
    pieces: list[np.ndarray] = [np.array([tokenizer.eos_id], dtype=np.int32)]
    records = read_records(expand_inputs(paths), "pretrain")
    for record in tqdm(records, desc="tokenizing", unit=" records", disable=not progress, delay=2, file=sys.stderr):
        if isinstance(record, Skipped):
            report.skipped.append(str(record))
            continue
        # a long document arrives in pieces (bounded memory); the end-of-text token follows its last piece
        try:
            pieces.append(np.array(encode_pretrain(tokenizer, record)["tokens"], dtype=np.int32))
        except TextNotEncoded as exc:
            report.skipped.append(str(Skipped(record.source, record.line, str(exc))))
            continue
        text_bytes += len(record.value.encode("utf-8"))
        report.documents += record.last
    if report.documents == 0:
        raise UserError(f"{', '.join(map(str, paths))}: no usable text records to evaluate on"
                        f"{skipped_note(report.skipped)}")
    return ArrayStream(np.concatenate(pieces), tokenizer.eos_id, text_bytes), report


def split_data_attrs(data_dir: str | Path, split: str) -> dict:
    """The checked attributes of the prepared data `eval --data --split` reads, before any model loads."""
    if split not in SPLITS:
        raise UserError(f"--split must be one of {', '.join(SPLITS)}, got '{split}'")
    return read_data_attrs(data_dir, "pretrain", reader="eval --data")


def stream_of_split(data_dir: str | Path, split: str, tokenizer: Tokenizer,
                    vocab_size: int | None = None) -> SplitStream:
    """A pretraining split of a prepared data directory, refused when another tokenizer made it; with `vocab_size`
    (the model's), each read refuses a token id beyond it."""
    attrs = split_data_attrs(data_dir, split)
    if not tokenizer.has_hash(attrs["tokenizer_hash"]):
        raise UserError(f"{data_dir} was tokenized with another tokenizer (hash {attrs['tokenizer_hash']}) than the "
                        f"model's (hash {tokenizer.hash}); prepare the data with the model's tokenizer")
    stream = SplitStream(Path(data_dir) / TOKENS_FILE, split, tokenizer.eos_id, vocab_size)
    if len(stream) < 2:
        raise UserError(f"{data_dir}: the '{split}' split holds no tokens")
    return stream


def document_start_positions(stream: TokenStream, tokenizer: Tokenizer, start: int, end: int) -> np.ndarray:
    """Positions in [start, end) of `stream` that hold a document's start ids: the tokenizer's `document_start_ids`
    right after an <|endoftext|> (none for our tokenizers, nor in data prepared before documents had them)."""
    ids = tokenizer.document_start_ids
    if not ids:
        return np.zeros(0, dtype=np.int64)
    low = max(0, start - len(ids))  # the <|endoftext|> before a start that reaches into [start, end)
    tokens = stream.read(low, min(len(stream), end + len(ids) - 1))
    opens = [q for q in np.flatnonzero(tokens == stream.eos_id) + 1 if tokens[q:q + len(ids)].tolist() == ids]
    positions = low + np.array([q + j for q in opens for j in range(len(ids))], dtype=np.int64)
    return positions[(positions >= start) & (positions < end)]


def scored_text_bytes(stream: TokenStream, tokenizer: Tokenizer) -> int:
    """UTF-8 bytes of the text of every token after the first (see the module docstring for the rule)."""
    if isinstance(stream, ArrayStream) and stream.text_bytes is not None:
        return stream.text_bytes
    total, carry = 0, np.zeros(0, dtype=np.int64)
    for chunk in stream.chunks():
        tokens = np.concatenate([carry, chunk])
        ends = np.flatnonzero(tokens == stream.eos_id)
        cut = int(ends[-1]) + 1 if len(ends) else 0
        total += _document_bytes(tokens[:cut], stream.eos_id, tokenizer)
        carry = tokens[cut:]
    return total + _document_bytes(carry, stream.eos_id, tokenizer)


def _document_bytes(tokens: np.ndarray, eos_id: int, tokenizer: Tokenizer) -> int:
    """Bytes of whole documents (each closed by eos_id, the last one possibly not), less their start ids."""
    bounds = [0, *(np.flatnonzero(tokens == eos_id) + 1).tolist(), len(tokens)]
    documents = [tokens[a:b] for a, b in pairwise(bounds) if b > a]
    return sum(len(tokenizer.decode(_text_ids(doc, eos_id, tokenizer)).encode("utf-8")) for doc in documents)


def _text_ids(document: np.ndarray, eos_id: int, tokenizer: Tokenizer) -> list[int]:
    """A document's ids less its end-of-text and the start ids it opens with (data prepared before documents had
    them opens with its text)."""
    ids = document[document != eos_id].tolist()
    start = tokenizer.document_start_ids
    return ids[len(start):] if start and ids[:len(start)] == start else ids
