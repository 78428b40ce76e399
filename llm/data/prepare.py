"""Canonical records -> tokenized HDF5, tokenized in parallel worker processes, in bounded memory.

Output directory layout:
    tokens.h5     one group per split ('train', 'val'); root attributes record the schema version,
                  kind, tokenizer hash, vocabulary size, special ids (and seq_len for sft/dpo), and
                  `content_digest`, a digest of everything else the file holds (function `content_digest`).
                  Token arrays are flat (uint16 when the vocabulary fits, else uint32) with int64
                  offsets (n_samples + 1) per stream:
                    pretrain  tokens + doc_offsets (each document opens with the tokenizer's document start,
                              BOS for Llama-style tokenizers, nothing for ours, and end-of-text closes it)
                    sft       tokens, loss_mask (uint8, 1 on assistant replies and their <|im_end|>) + doc_offsets
                    dpo       prompt + prompt_offsets (ChatML prompt ending in the assistant header),
                              chosen + chosen_offsets, rejected + rejected_offsets (replies + <|im_end|>)
    report.json   samples and tokens per split, the skipped and the truncated records (file:line: reason; the
                  first 10,000 of each, all of them counted by reason)
    tokenizer/    a copy of the tokenizer used, so training and inference find it

The whole directory is written beside OUT and swapped in at the end (`llm.data.output`): an interrupted run
leaves the previous output untouched, and two runs into one OUT cannot interleave.

Memory stays bounded whatever the input: records are read streaming (a long document in pieces, a JSON record
over `max_record_mb` skipped), each worker job holds at most `JOB_RECORDS` records or about `JOB_CHARS`
characters, at most two jobs per worker are in flight, and samples reach the HDF5 file through a buffer of
about `CHUNK_TOKENS` tokens.
"""

from __future__ import annotations

import hashlib
import math
import multiprocessing as mp
import os
import re
import signal
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import h5py
import numpy as np
from tqdm import tqdm

from llm import held_locks
from llm.chat_template import MessagesRefused
from llm.data.formats import Chat, Item, Pair, Skipped, expand_inputs, read_records, skipped_note
from llm.data.output import OutputDir, cannot_write_output
from llm.data.readers import DEFAULT_MAX_RECORD_MB, RecordLimit, strings
from llm.errors import STOP_SIGNALS, UserError
from llm.jsonl import json_text
from llm.rundir import PREPARED_ENTRIES, PREPARED_REPORT_FILE, TOKENIZER_DIR, TOKENS_FILE
from llm.tokenizer import CONFIG_FILE, TOKENIZER_FILE, TextNotEncoded, Tokenizer

SCHEMA_VERSION = 1
SPLITS = ("train", "val")
JOB_RECORDS = 256
JOB_CHARS = 1 << 20
CHUNK_TOKENS = 1 << 16
CHUNK_OFFSETS = 1 << 14
MAX_SEQ_LEN = 1 << 24
"""The largest --seq-len: 16,777,216 tokens, beyond the context of any model (the checks need a bound: a huge
number was read through and then failed to be stored)."""


NOTES_KEPT = 10_000
"""The truncated and the skipped records a report names, each, and the reasons it counts them by; the rest are counted
(a corpus of millions of unusable records held a note of every one in memory until the end)."""
OTHER_REASONS = "other reasons"


@dataclass
class Report:
    files: dict[str, int] = field(default_factory=dict)
    """Usable records read from each input file (the unusable ones are in `skipped`)."""
    documents: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SPLITS, 0))
    """Samples written per split (documents, conversations or preference pairs)."""
    tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SPLITS, 0))
    seq_len: int | None = None
    """sft/dpo: the --seq-len the samples were cut for (training checks data.seq_len against it)."""
    truncated: list[str] = field(default_factory=list)
    """The first NOTES_KEPT samples cut to fit --seq-len as 'file:line: what' (conversations at a turn boundary;
    pairs: prompt start, reply end)."""
    skipped: list[str] = field(default_factory=list)
    """The first NOTES_KEPT unusable records as 'file:line: reason'."""
    reasoning_left_out: list[str] = field(default_factory=list)
    """sft/dpo: the first NOTES_KEPT records whose reasoning the chat template leaves out of a reply learnt, as
    'file:line: which'."""
    counts: dict[str, dict[str, int]] = field(default_factory=lambda: {"truncated": {}, "skipped": {},
                                                                       "reasoning_left_out": {}})
    """Every record noted, by kind and reason (numbers in it as N; past NOTES_KEPT reasons, under OTHER_REASONS)."""

    def note(self, kind: str, text: str) -> None:
        """Note a 'truncated', 'skipped' or 'reasoning_left_out' record, `text` being 'file:line: reason'."""
        entries = getattr(self, kind)
        if len(entries) < NOTES_KEPT:
            entries.append(text)
        reason = re.sub(r"\b\d+\b", "N", text.split(": ", 1)[1])  # \ud800 stays
        counts = self.counts[kind]
        if reason not in counts and len(counts) >= NOTES_KEPT:  # reasons quoting their record (its keys) differ
            reason = OTHER_REASONS
        counts[reason] = counts.get(reason, 0) + 1

    def total(self, kind: str) -> int:
        """How many records of a kind were noted, named or not."""
        return sum(self.counts[kind].values())

    def summary(self, shown: int = 20) -> str:
        # pretraining's documents are not its samples (windows of data.seq_len tokens, which training counts)
        counted = "documents" if self.seq_len is None else "samples"
        lines = [f"{counted:<10} train {self.documents['train']:,}  val {self.documents['val']:,}",
                 f"tokens     train {self.tokens['train']:,}  val {self.tokens['val']:,}"]
        empty = [name for name, count in self.files.items() if count == 0]
        if empty:
            lines.append(f"files with no usable records: {', '.join(empty)}")
        for title, kind in ((f"truncated to fit --seq-len {self.seq_len}", "truncated"), ("skipped", "skipped"),
                            ("reasoning left out by the chat template, so not learnt", "reasoning_left_out")):
            entries, reasons, total = getattr(self, kind), Counter(self.counts[kind]), self.total(kind)
            if not entries:
                continue
            by_reason = "; ".join(f"{r} x{n}" for r, n in reasons.most_common(5)) if len(reasons) > 1 else ""
            lines.append(f"{title}: {total:,} records" + (f": {by_reason}" if by_reason else ""))
            lines += [f"  {s}" for s in entries[:shown]]
            if len(entries) > shown:
                beyond = f" (the first {len(entries):,} of them)" if total > len(entries) else ""
                lines.append(f"  ... {len(entries) - shown} more in {PREPARED_REPORT_FILE}{beyond}")
        return "\n".join(lines)


# ---- worker side: records -> token arrays --------------------------------------------------------

STREAMS = {  # per kind: streams of fields that share one offsets array
    "pretrain": {"doc": ("tokens",)},
    "sft": {"doc": ("tokens", "loss_mask")},
    "dpo": {"prompt": ("prompt",), "chosen": ("chosen",), "rejected": ("rejected",)},
}
MASK_FIELDS = ("loss_mask",)

Sample = dict[str, Any]
"""Token (and mask) lists or arrays by field name."""
Result = tuple[Sample, bool, list[int]] | Skipped
"""An encoded sample, whether it was cut to fit and the replies whose reasoning the chat template leaves out
(`MaskedChat.reasoning_left_out`), or the reason it was skipped."""


class TooLong(ValueError):
    """A conversation whose first reply cannot fit the sequence length; becomes a skipped record."""


def token_dtype(vocab_size: int) -> type:
    return np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32


def encode_pretrain(tok: Tokenizer, piece: Item) -> Sample:
    """A document's tokens (or a piece's, `Item.piece` and `Item.last`): the tokenizer's document start (BOS for
    Llama-style tokenizers, nothing for ours) before its first piece, end-of-text after its last."""
    tokens = tok.encode_document(piece.value) if piece.piece == 0 else tok.encode_continuation(piece.value)
    return {"tokens": tokens + ([tok.eos_id] if piece.last else [])}


def encode_sft(tok: Tokenizer, record: Chat, max_tokens: int) -> tuple[Sample, bool, list[int]]:
    """Chat-template tokens with loss mask 1 exactly on the assistant turns learnt (not of weight 0) and their
    end-of-turn token; cut after the end-of-turn token of the last such turn that fits `max_tokens` (then the flag
    is True); the messages kept whose reasoning the template leaves out."""
    chat = tok.encode_chat_masked(record.messages, record.tools)
    tokens, mask = chat.ids, chat.loss_mask
    truncated = len(tokens) > max_tokens
    if truncated:  # cut after a reply learnt (one of weight 0 at the end would be context for nothing), not after
        # the newline after its turn: a reply whose end-of-turn token fitted was cut for the unlearned token after it
        learnt = [end for start, end in chat.replies if any(mask[start:end])] or [end for _, end in chat.replies]
        fitting = [end for end in learnt if end <= max_tokens]
        if not fitting:
            raise TooLong(f"too long: the first reply ends after {learnt[0]} tokens, more than --seq-len "
                          f"{max_tokens - 1} holds ({max_tokens}: the window and its last target)")
        tokens, mask = tokens[:fitting[-1]], mask[:fitting[-1]]
    replies = [number for number, message in enumerate(record.messages, 1) if message.get("role") == "assistant"]
    kept = {number for number, (_, end) in zip(replies, chat.replies, strict=True) if end <= len(tokens)}
    return {"tokens": tokens, "loss_mask": mask}, truncated, [n for n in chat.reasoning_left_out if n in kept]


def encode_dpo(tok: Tokenizer, pair: Pair, max_tokens: int) -> tuple[Sample, bool, list[int]]:
    """Prompt ids (ending in the generation prompt) and each reply's masked turn, so that prompt + reply are the
    ids of the answered conversation; the messages whose reasoning the template leaves out (the reply's number
    where either reply's is; the prompt's replies are not learnt)."""
    chosen_chat, rejected_chat = (tok.encode_chat_masked([*pair.prompt, reply], pair.tools)
                                  for reply in (pair.chosen, pair.rejected))
    shared = min(chosen_chat.replies[-1][0], rejected_chat.replies[-1][0])
    shared = next((k for k in range(shared) if chosen_chat.ids[k] != rejected_chat.ids[k]), shared)
    sample = {"prompt": chosen_chat.ids[:shared], "chosen": chosen_chat.ids[shared:chosen_chat.replies[-1][1]],
              "rejected": rejected_chat.ids[shared:rejected_chat.replies[-1][1]]}
    longest_reply = max(len(sample["chosen"]), len(sample["rejected"]))
    truncated = len(sample["prompt"]) + longest_reply > max_tokens
    if truncated:  # keep the prompt's end, all that fits beside the longer reply but at least half the budget (a
        # prompt of 59 tokens beside a reply of 8 kept its last 32 of the 57 that fit), then cut the replies
        sample["prompt"] = sample["prompt"][-max(max_tokens - longest_reply, max_tokens // 2):]
        for reply in ("chosen", "rejected"):
            sample[reply] = sample[reply][:max_tokens - len(sample["prompt"])]
    reply = len(pair.prompt) + 1  # the prompt's replies are context, not learnt
    return sample, truncated, [reply] if reply in chosen_chat.reasoning_left_out + rejected_chat.reasoning_left_out \
        else []


ENCODERS = {"sft": encode_sft, "dpo": encode_dpo}

_worker_tokenizer: Tokenizer | None = None


def _init_worker(tokenizer_dir: str) -> None:
    global _worker_tokenizer
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker_tokenizer = Tokenizer.load(tokenizer_dir)


def _init_pool_worker(tokenizer_dir: str, main_pid: int) -> None:
    """A pool worker leaves the process group, so Ctrl-C and a SIGTERM to the group reach only the main process,
    which stops the run and terminates its workers (`TokenizerPool`). It ignores SIGINT sent to it alone and dies on
    SIGTERM (the main process's handlers, inherited, are for the main process); both are blocked from its start
    (`TokenizerPool`) until then, and one sent to the group before it left is discarded. A worker whose main process
    died ends within `ORPHAN_POLL_S`: nothing else would end it (it waits for a job on a queue its siblings also hold
    open). It closes its copies of the main process's locks (`llm.held_locks`)."""
    held_locks.close_in_worker()
    os.setpgid(0, 0)
    # ignoring a signal discards it where it is pending: a SIGTERM to the group sent before this worker left it (not
    # yet scheduled, on a loaded machine) killed it at the unblocking, and the run ended "a tokenizer worker ended
    # ...: lower --workers" instead of stopping
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    threading.Thread(target=_end_when_orphaned, args=(main_pid,), daemon=True).start()
    _init_worker(tokenizer_dir)


ORPHAN_POLL_S = 1.0


def _end_when_orphaned(main_pid: int) -> None:
    while os.getppid() == main_pid:
        time.sleep(ORPHAN_POLL_S)
    os._exit(1)


def _encode(kind: str, item: Item, max_tokens: int) -> Result:
    try:
        if kind == "pretrain":
            return encode_pretrain(_worker_tokenizer, item), False, []
        sample, truncated, left_out = ENCODERS[kind](_worker_tokenizer, item.value, max_tokens)
    except (TooLong, MessagesRefused, TextNotEncoded) as exc:
        whole = item.piece == 0 and item.last
        why = str(exc) if whole else f"piece {item.piece + 1} of its text left out, the rest kept: {exc}"
        return Skipped(item.source, item.line, why, item.unit)
    has_reply = any(sample["loss_mask"]) if kind == "sft" else len(sample["chosen"]) and len(sample["rejected"])
    if not has_reply:  # cut away, or never there: a template that renders no reply
        why = (f"too long: no reply token fits in --seq-len {max_tokens - 1}" if truncated else
               "no reply tokens: the chat template renders none of its replies")
        return Skipped(item.source, item.line, why, item.unit)
    if kind == "dpo" and sample["chosen"] == sample["rejected"]:  # nothing to prefer
        why = (f"too long: the replies differ only after what fits in --seq-len {max_tokens - 1}" if truncated else
               "the replies are the same tokens")  # a normalizing tokenizer's (NFKC)
        return Skipped(item.source, item.line, why, item.unit)
    return sample, truncated, left_out


def _encode_batch(job: tuple[str, int, list[Item]]) -> list[Result]:
    """Encode a job's records in a worker; samples come back as numpy arrays (compact to send)."""
    kind, max_tokens, items = job
    dtype = token_dtype(_worker_tokenizer.vocab_size)
    out: list[Result] = []
    for item in items:
        result = _encode(kind, item, max_tokens)
        if not isinstance(result, Skipped):
            sample, truncated, left_out = result
            result = {name: np.asarray(v, dtype=np.uint8 if name in MASK_FIELDS else dtype)
                      for name, v in sample.items()}, truncated, left_out
        out.append(result)
    return out


# ---- main side ---------------------------------------------------------------------------------

def _extend(array: h5py.Dataset, values: np.ndarray) -> None:
    start = array.shape[0]
    array.resize((start + len(values),))
    array[start:] = values


class SplitWriter:
    """Appends samples to one split group: a chunked resizable array per field and an offsets array per stream
    (n_samples + 1 entries, int64), through a buffer of about CHUNK_TOKENS tokens."""

    def __init__(self, group: h5py.Group, streams: dict[str, tuple[str, ...]], token_dtype: type) -> None:
        self.streams = streams
        self.dtypes = {name: np.uint8 if name in MASK_FIELDS else token_dtype
                       for fields in streams.values() for name in fields}
        self.arrays = {name: group.create_dataset(name, shape=(0,), maxshape=(None,), chunks=(CHUNK_TOKENS,),
                                                  dtype=dtype) for name, dtype in self.dtypes.items()}
        self.offsets = {stream: group.create_dataset(f"{stream}_offsets", data=np.zeros(1, np.int64),
                                                     maxshape=(None,), chunks=(CHUNK_OFFSETS,))
                        for stream in streams}
        self.pending: dict[str, list[np.ndarray]] = {name: [] for name in self.arrays}
        self.pending_ends: dict[str, list[int]] = {stream: [] for stream in streams}
        self.ends = dict.fromkeys(streams, 0)
        self.buffered = 0

    def append(self, sample: Sample, end: bool = True) -> None:
        """Add a sample; `end=False` leaves it open, so the next append continues it (a document in pieces)."""
        for stream, fields in self.streams.items():
            for name in fields:
                self.pending[name].append(np.asarray(sample[name], dtype=self.dtypes[name]))
            self._grow(stream, len(sample[fields[0]]), end)

    def _grow(self, stream: str, n_tokens: int, end: bool) -> None:
        self.ends[stream] += n_tokens
        if end:
            self.pending_ends[stream].append(self.ends[stream])
        self.buffered += n_tokens
        if self.buffered >= CHUNK_TOKENS:
            self.flush()

    def flush(self) -> None:
        for name, parts in self.pending.items():
            if parts:
                _extend(self.arrays[name], np.concatenate(parts))
                parts.clear()
        for stream, ends in self.pending_ends.items():
            if ends:
                _extend(self.offsets[stream], np.array(ends, dtype=np.int64))
                ends.clear()
        self.buffered = 0

    def move_last_to(self, other: SplitWriter) -> int:
        """Move the last sample to `other`, a chunk at a time; returns its number of tokens."""
        self.flush()
        moved = 0
        for stream, fields in self.streams.items():
            offsets = self.offsets[stream]
            start, end = (int(x) for x in offsets[-2:])
            for low in range(start, end, CHUNK_TOKENS):
                high = min(low + CHUNK_TOKENS, end)
                for name in fields:
                    other.pending[name].append(self.arrays[name][low:high])
                other._grow(stream, high - low, end=high == end)
            if start == end:
                other._grow(stream, 0, end=True)
            for name in fields:
                self.arrays[name].resize((start,))
            offsets.resize((offsets.shape[0] - 1,))
            self.ends[stream] = start
            moved += end - start
        return moved

    def close(self) -> None:
        self.flush()


ROLE_IDS = ("eos_id", "pad_id", "bos_id", "im_start_id", "im_end_id")
"""Special-token roles recorded in tokens.h5; a role the tokenizer does not have is recorded as -1."""
RANDOM_TOKENS_HASH = "random"
"""The tokenizer hash recorded for random token ids (`zerollm bench` data), which no tokenizer made."""


DIGEST_ATTR = "content_digest"
"""The root attribute holding `content_digest`, stored as the file is written: what a run records and its ranks
compare to identify the data (`tokens_digest`), without reading the tokens again."""
DIGEST_READ = 1 << 22
"""Elements read at a time to compute a digest."""
NOTED_DIGEST_BYTES = 1 << 30
"""A tokens.h5 without a stored digest from this size on gets a note that it is read whole (seconds per GiB)."""


def content_digest(h5: h5py.File) -> str:
    """A digest of everything a tokens.h5 holds (whatever the HDF5 layout): every root attribute but DIGEST_ATTR,
    then every array (name, dtype, shape and values, in name order), read DIGEST_READ elements at a time."""
    digest = hashlib.sha256()

    def add(name: str, value: np.ndarray | h5py.Dataset) -> None:
        digest.update(f"\0{name}\0{value.dtype.str}\0{value.shape}\0".encode())
        for start in range(0, len(value) if value.shape else 1, DIGEST_READ):
            digest.update(np.ascontiguousarray(value[start:start + DIGEST_READ] if value.shape else value).data)

    for name in sorted(h5.attrs):
        if name != DIGEST_ATTR:
            add(name, np.asarray(h5.attrs[name]))
    h5.visititems(lambda name, node: add(name, node) if isinstance(node, h5py.Dataset) else None)
    return digest.hexdigest()[:16]


def stored_digest(path: Path) -> str | None:
    """The content digest `data prepare` stored in a tokens.h5; None for a file prepared before it stored one."""
    with h5py.File(path, "r") as h5:
        stored = h5.attrs.get(DIGEST_ATTR)
    return None if stored is None else str(stored)


def tokens_digest(path: Path) -> str:
    """The content digest of a tokens.h5: the one `data prepare` stored in it or, for a file prepared before it
    stored one, computed by reading the whole file (said in a note for a large file)."""
    if (stored := stored_digest(path)) is not None:
        return stored
    with h5py.File(path, "r") as h5:
        size = path.stat().st_size
        if size >= NOTED_DIGEST_BYTES:
            print(f"zerollm: note: {path} was prepared by an earlier version, which stored no digest of it: reading "
                  f"all {size / 2**30:.1f} GiB of it to compute one (`zerollm data prepare` again stores one)",
                  file=sys.stderr, flush=True)
        return content_digest(h5)


def write_attrs(h5: h5py.File, kind: str, tokenizer_hash: str, vocab_size: int, special: Tokenizer | None,
                **extra) -> None:
    """Root attributes that let training refuse mismatched data: schema, kind, the tokenizer's hash and size, and
    its special ids by role (from `special`; random benchmark data, which has none, pads with 3); then the digest of
    the whole file (`content_digest`). Called once every array is written."""
    if special is None:
        ids, stop_ids = {"pad_id": 3}, []
    else:
        ids, stop_ids = {role: getattr(special, role) for role in ROLE_IDS}, special.stop_ids
    h5.attrs.update({"schema_version": SCHEMA_VERSION, "kind": kind, "tokenizer_hash": tokenizer_hash,
                     "vocab_size": vocab_size,
                     **{role: -1 if ids.get(role) is None else ids[role] for role in ROLE_IDS},
                     "stop_ids": np.asarray(stop_ids, dtype=np.int64), **extra})
    h5.attrs[DIGEST_ATTR] = content_digest(h5)


def _chars(value: Any) -> int:
    """Characters of text in a record (to size worker jobs)."""
    return sum(map(len, strings(value)))


Job = tuple[str, int, list[Item]]


def _jobs(records: Iterator[Item | Skipped], kind: str, max_tokens: int, report: Report, strict: bool,
          progress: tqdm) -> Iterator[tuple[list[Item], Job]]:
    """Worker jobs of at most JOB_RECORDS records or about JOB_CHARS characters, each with its records' places
    (the records without their values, kept by the main process)."""
    batch: list[Item] = []
    chars = 0
    for record in records:
        if isinstance(record, Skipped):
            _skip(record, report, strict)
            continue
        if record.piece == 0:
            report.files[record.source] = report.files.get(record.source, 0) + 1
            progress.update(1)
        batch.append(record)
        chars += _chars(record.value)
        if len(batch) == JOB_RECORDS or chars >= JOB_CHARS:
            yield [replace(r, value=None) for r in batch], (kind, max_tokens, batch)
            batch, chars = [], 0
    if batch:
        yield [replace(r, value=None) for r in batch], (kind, max_tokens, batch)


class TokenizerPool:
    """Tokenizer worker processes, all started at once (fork) before any file is open, each job a `Future`.

    A `ProcessPoolExecutor`, not a `multiprocessing.Pool`: a worker that dies (the out-of-memory killer ends one
    holding a huge record) fails every job not yet done with `BrokenProcessPool`, where a Pool started another in
    its place and the run waited for the lost jobs for ever. One killed halfway through sending its result leaves the
    executor's thread reading the rest for ever, so `result` also looks at the workers while it waits. Leaving, the
    workers are killed, not waited for (a Ctrl-C may come while they hold minutes of work), and the result pipe is
    closed here too, so that a message left half-sent ends for the executor's thread."""

    def __init__(self, workers: int, tokenizer_dir: str):
        self.workers = workers
        self._executor = ProcessPoolExecutor(workers, mp.get_context("fork"), initializer=_init_pool_worker,
                                             initargs=(tokenizer_dir, os.getpid()))
        try:
            previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # inherited by the workers, the thread
            try:  # the first job forks every worker and starts the executor's thread
                self._executor.submit(int)
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, previous)  # a stop signal that came meanwhile comes here
        except BaseException:  # a fork that failed, a stop signal: the workers started are ended
            self.close()
            raise

    def _processes(self) -> list[mp.Process]:
        return list(self._executor._processes.values())  # noqa: SLF001 - no public way to reach them

    def submit(self, job: Job) -> Future:
        return self._executor.submit(_encode_batch, job)

    def result(self, job: Future) -> list[Result]:
        """`job`'s results; BrokenProcessPool once a worker has ended."""
        while not wait([job], timeout=WORKER_POLL_S).done:
            if any(worker.exitcode is not None for worker in self._processes()):
                raise BrokenProcessPool("a worker ended")
        return job.result()

    def close(self) -> None:
        """End the workers and the executor; a second Ctrl-C waits until this is done (its few steps are bounded)."""
        with _stop_signals_held():
            for worker in self._processes():
                worker.kill()
                worker.join()
            self._executor._result_queue._writer.close()  # noqa: SLF001 - see the class's docstring
            self._executor.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> TokenizerPool:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


@contextmanager
def _stop_signals_held() -> Iterator[None]:
    """Ctrl-C and SIGTERM that come inside are taken when it ends. (Python runs signal handlers in the main thread,
    whichever thread the signal reached, so blocking the signals there would not hold them.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = []
    previous = {signum: signal.signal(signum, lambda signum, frame: held.append(signum)) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if held:
            signal.raise_signal(held[0])


WORKER_POLL_S = 1.0
"""How often `TokenizerPool.result` looks whether a worker ended while it waits."""


def _encoded(jobs: Iterator[tuple[list[Item], Job]],
             pool: TokenizerPool | None) -> Iterator[tuple[list[Item], list[Result]]]:
    """Each job's places and results, in order; at most two jobs per worker in flight."""
    if pool is None:
        yield from ((places, _encode_batch(job)) for places, job in jobs)
        return
    in_flight: deque = deque()
    try:
        for places, job in jobs:
            in_flight.append((places, pool.submit(job)))
            if len(in_flight) >= 2 * pool.workers:
                places, result = in_flight.popleft()
                yield places, pool.result(result)
        while in_flight:
            places, result = in_flight.popleft()
            yield places, pool.result(result)
    except BrokenProcessPool:
        raise UserError("a tokenizer worker ended before its work was done, so its records are lost (the "
                        "out-of-memory killer ends one that holds a huge record): lower --workers or "
                        "--max-record-mb, and run again") from None


def _skip(record: Skipped, report: Report, strict: bool) -> None:
    if strict:
        raise UserError(f"{record} (--strict stops at the first bad record)")
    report.note("skipped", str(record))


def _token_count(sample: Sample) -> int:
    return sum(len(v) for k, v in sample.items() if k not in MASK_FIELDS)


def _worker_pool(workers: int, tokenizer_dir: str) -> TokenizerPool | nullcontext:
    """A pool of tokenizer processes; None (a context doing nothing) for one worker, which tokenizes in this
    process."""
    if workers == 1:
        _init_worker(tokenizer_dir)
        return nullcontext()
    return TokenizerPool(workers, tokenizer_dir)


def _write_tokens(output: OutputDir, kind: str, records: Iterator[Item | Skipped], tokenizer: Tokenizer,
                  tokenizer_dir: str, report: Report, workers: int, val_fraction: float, strict: bool, seed: int,
                  seq_len: int, show_progress: bool) -> None:
    rng = np.random.default_rng(seed)
    progress = tqdm(desc=f"tokenizing {kind} records", unit=" records", disable=not show_progress)
    with progress, _worker_pool(workers, tokenizer_dir) as pool, h5py.File(output.staging / TOKENS_FILE, "w") as h5:
        writers = {split: SplitWriter(h5.create_group(split), STREAMS[kind], token_dtype(tokenizer.vocab_size))
                   for split in SPLITS}
        split, open_document = "train", False
        jobs = _jobs(records, kind, seq_len + 1, report, strict, progress)
        for places, results in _encoded(jobs, pool):
            output.check_stopped()
            for item, result in zip(places, results):
                if isinstance(result, Skipped):
                    _skip(result, report, strict)
                    if item.piece == 0 and item.last:  # the whole record: counted usable as it was read
                        report.files[item.source] -= 1
                    if item.last and open_document:  # the last piece of a long text, which the tokenizer failed on
                        writers[split].append({"tokens": [tokenizer.eos_id]})  # (the rest is kept): it ends here
                        report.tokens[split] += 1
                        open_document = False
                    continue
                sample, truncated, left_out = result
                if not open_document:  # a document's pieces all go to the split drawn for its first written
                    split = "val" if rng.random() < val_fraction else "train"
                    report.documents[split] += 1
                open_document = not item.last
                if truncated:
                    report.note("truncated", f"{item.place}: cut to fit --seq-len {seq_len}")
                if left_out:
                    which = ", ".join(str(number) for number in left_out)
                    report.note("reasoning_left_out", f"{item.place}: the reasoning of assistant message {which}")
                writers[split].append(sample, end=item.last)
                report.tokens[split] += _token_count(sample)
        if report.documents["train"] + report.documents["val"] == 0:
            raise UserError("no usable records found in the inputs; nothing was written"
                            + skipped_note(report.skipped, report.total("skipped")))
        if report.documents["train"] == 0:  # training needs a sample, whatever the draw
            _move_last_sample(writers, report, "val", "train")
        if val_fraction > 0 and report.documents["val"] == 0 and report.documents["train"] > 1:
            _move_last_sample(writers, report, "train", "val")  # a tiny corpus still gets a validation sample
        for writer in writers.values():
            writer.close()
        extra = {} if kind == "pretrain" else {"seq_len": seq_len}
        write_attrs(h5, kind, tokenizer.hash, tokenizer.vocab_size, tokenizer, **extra)


def _move_last_sample(writers: dict[str, SplitWriter], report: Report, source: str, target: str) -> None:
    moved = writers[source].move_last_to(writers[target])
    for name, sign in ((source, -1), (target, 1)):
        report.documents[name] += sign
        report.tokens[name] += sign * moved


TOKENIZER_FILES = {TOKENIZER_FILE, CONFIG_FILE}
"""What the tokenizer's copy in a prepared folder holds (`Tokenizer.save`)."""


def not_prepared_here(out: Path) -> str | None:
    """What in the folder `out` data prepare did not write, or None where it is an output of data prepare: its
    tokens.h5 carries our schema version and its tokenizer/ only a tokenizer's files. A file of the user's named
    tokens.h5, or notes put in tokenizer/, make it the user's folder, which data prepare refuses to replace."""
    tokenizer = out / TOKENIZER_DIR
    if tokenizer.exists():
        if not tokenizer.is_dir():
            return TOKENIZER_DIR
        if extra := sorted(set(os.listdir(tokenizer)) - TOKENIZER_FILES):
            return f"{TOKENIZER_DIR}/{extra[0]}"
    try:
        with h5py.File(out / TOKENS_FILE, "r") as h5:
            return None if "schema_version" in h5.attrs else TOKENS_FILE
    except OSError:  # not HDF5 (h5py's word for it), or not a file
        return TOKENS_FILE


def default_workers() -> int:
    """Tokenizer processes when --workers is not given: the CPU count, at most 8."""
    return max(1, min(os.cpu_count() or 1, 8))


def max_workers() -> int:
    """Most tokenizer processes allowed: more than a few per core only slow the run down (and exhaust the machine)."""
    return 4 * (os.cpu_count() or 1)


def prepare(kind: str, inputs: list[str], tokenizer_dir: str | Path, out_dir: str | Path, val_fraction: float = 0.01,
            workers: int | None = None, strict: bool = False, seed: int = 0, seq_len: int = 512,
            max_record_mb: float = DEFAULT_MAX_RECORD_MB, show_progress: bool = True) -> Report:
    """Tokenize `kind` records ('pretrain', 'sft', 'dpo') into `out_dir` (tokens.h5 with a train/val split,
    report.json, tokenizer/), replacing an earlier output there as a whole.

    sft and dpo samples hold at most seq_len + 1 tokens (seq_len predicted positions): longer
    conversations are cut after the last assistant turn that fits (skipped when even the first reply
    does not fit); longer pairs keep the end of their prompt and the start of their replies. Both are
    reported with file:line; a sample left with no reply token is skipped.
    """
    if kind not in STREAMS:
        raise UserError(f"--kind must be one of {', '.join(STREAMS)}, got '{kind}'")
    if not 0.0 <= val_fraction < 1.0:
        raise UserError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    if not 8 <= seq_len <= MAX_SEQ_LEN:
        raise UserError(f"--seq-len must be between 8 and {MAX_SEQ_LEN:,}, got {seq_len}")
    if not 0 < max_record_mb < math.inf:  # nan fails too
        raise UserError(f"--max-record-mb must be a positive number, got {max_record_mb}")
    limit = RecordLimit(max_record_mb, "--max-record-mb")
    if seed < 0:
        raise UserError(f"--seed must be a non-negative integer, got {seed}")
    workers = default_workers() if workers is None else workers
    if not 1 <= workers <= max_workers():
        raise UserError(f"--workers must be between 1 and {max_workers()} (4 x the CPU count), got {workers}")
    files = expand_inputs(inputs, exclude=out_dir, note_links_out=True)
    tokenizer = Tokenizer.load(tokenizer_dir)
    report = Report(files={str(f): 0 for f in files}, seq_len=None if kind == "pretrain" else seq_len)
    with OutputDir(out_dir, PREPARED_ENTRIES, not_prepared_here) as output:
        try:
            _write_tokens(output, kind, read_records(files, kind, limit), tokenizer, str(tokenizer_dir),
                          report, workers, val_fraction, strict, seed, seq_len, show_progress)
            (output.staging / PREPARED_REPORT_FILE).write_text(json_text(asdict(report), indent=1), encoding="utf-8")
            tokenizer.save(output.staging / TOKENIZER_DIR)
        except UserError:  # a worker the stop signal of this run ended too (the run's own exception lost in a
            output.check_stopped()  # finalizer, where the signal's handler ran): the stop is said, not the worker
            raise
        except OSError as exc:  # the inputs' read errors are UserErrors already
            raise cannot_write_output(out_dir, exc) from None
        except RuntimeError as exc:  # h5py's word for a write that fails as the file closes, its errno in the text
            failed = re.search(r"\berrno = (\d+)", str(exc))
            if failed is None:
                raise
            raise cannot_write_output(out_dir, OSError(int(failed[1]), str(exc))) from None
        output.commit()
    return report
