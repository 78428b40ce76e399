"""Canonical records -> tokenized HDF5, tokenized in parallel worker processes.

Output directory layout:
    tokens.h5     one group per split ('train', 'val'); root attributes record the schema version,
                  kind, tokenizer hash, vocabulary size, special ids (and seq_len for sft/dpo).
                  Token arrays are flat (uint16 when the vocabulary fits, else uint32) with int64
                  offsets (n_samples + 1) per stream:
                    pretrain  tokens + doc_offsets (end-of-text closes each document)
                    sft       tokens, loss_mask (uint8, 1 on assistant replies and their <|im_end|>) + doc_offsets
                    dpo       prompt + prompt_offsets (ChatML prompt ending in the assistant header),
                              chosen + chosen_offsets, rejected + rejected_offsets (replies + <|im_end|>)
    report.json   documents, tokens, skipped records (file:line: reason)
    tokenizer/    a copy of the tokenizer used, so training and inference find it

`tokens.h5` is written under a temporary name and renamed only when complete, so a failed or
interrupted run never leaves a file that looks valid.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
import shutil
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import h5py
import numpy as np
from tqdm import tqdm

from llm.data.formats import Item, Skipped, expand_inputs, read_records
from llm.errors import UserError
from llm.tokenizer import Tokenizer

SCHEMA_VERSION = 1
TOKENS_FILE, REPORT_FILE, TOKENIZER_DIR = "tokens.h5", "report.json", "tokenizer"
SPLITS = ("train", "val")
BATCH_DOCS = 256
CHUNK_TOKENS = 1 << 16


@dataclass
class Report:
    files: dict[str, int] = field(default_factory=dict)
    """Records read from each input file."""
    documents: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SPLITS, 0))
    """Samples written per split (documents, conversations or preference pairs)."""
    tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SPLITS, 0))
    truncated: int = 0
    """Samples cut to fit the sequence length (conversations at a turn boundary; pairs: prompt start, reply end)."""
    skipped: list[str] = field(default_factory=list)
    """Every unusable record as 'file:line: reason'."""

    def summary(self, shown: int = 20) -> str:
        lines = [f"samples    train {self.documents['train']:,}  val {self.documents['val']:,}",
                 f"tokens     train {self.tokens['train']:,}  val {self.tokens['val']:,}"]
        if self.truncated:
            lines.append(f"truncated to fit --seq-len: {self.truncated:,}")
        empty = [name for name, count in self.files.items() if count == 0]
        if empty:
            lines.append(f"files with no records: {', '.join(empty)}")
        if self.skipped:
            reasons = Counter(re.sub(r"\d+", "N", s.split(": ", 1)[1]) for s in self.skipped)
            lines.append(f"skipped {len(self.skipped):,} records: " + "; ".join(f"{r} x{n}" for r, n in reasons.most_common(5)))
            lines += [f"  {s}" for s in self.skipped[:shown]]
            if len(self.skipped) > shown:
                lines.append(f"  ... {len(self.skipped) - shown} more in {REPORT_FILE}")
        return "\n".join(lines)


# ---- worker side: records -> token arrays --------------------------------------------------------

STREAMS = {  # per kind: streams of fields that share one offsets array
    "pretrain": {"doc": ("tokens",)},
    "sft": {"doc": ("tokens", "loss_mask")},
    "dpo": {"prompt": ("prompt",), "chosen": ("chosen",), "rejected": ("rejected",)},
}
MASK_FIELDS = ("loss_mask",)

Sample = dict[str, list[int]]
"""Token (and mask) lists by field name."""


class TooLong(ValueError):
    """A conversation whose first reply cannot fit the sequence length; becomes a skipped record."""


def encode_pretrain(tok: Tokenizer, text: str, max_tokens: int) -> tuple[Sample, bool]:
    return {"tokens": tok.encode(text) + [tok.eos_id]}, False


def encode_sft(tok: Tokenizer, messages: list[dict[str, str]], max_tokens: int) -> tuple[Sample, bool]:
    """Chat-template tokens with loss mask 1 exactly on assistant turns and their end-of-turn token; cut after the
    last assistant turn that fits `max_tokens` (then the flag is True)."""
    chat = tok.encode_chat_masked(messages)
    tokens, mask = chat.ids, chat.loss_mask
    truncated = len(tokens) > max_tokens
    if truncated:
        fitting = [end for end in chat.turn_ends if end <= max_tokens]
        if not fitting:
            raise TooLong(f"too long: the first reply ends after {chat.turn_ends[0]} tokens, the limit is {max_tokens}")
        tokens, mask = tokens[:fitting[-1]], mask[:fitting[-1]]
    return {"tokens": tokens, "loss_mask": mask}, truncated


def encode_dpo(tok: Tokenizer, pair: tuple, max_tokens: int) -> tuple[Sample, bool]:
    """Prompt ids (ending in the generation prompt) and each reply's masked turn, so that prompt + reply are the
    ids of the answered conversation. A reply is a string or an assistant message."""
    prompt, chosen, rejected = pair
    chosen_chat, rejected_chat = (tok.encode_chat_masked(prompt + [reply if isinstance(reply, dict) else
                                                                   {"role": "assistant", "content": reply}])
                                  for reply in (chosen, rejected))
    shared = min(chosen_chat.replies[-1][0], rejected_chat.replies[-1][0])
    shared = next((k for k in range(shared) if chosen_chat.ids[k] != rejected_chat.ids[k]), shared)
    sample = {"prompt": chosen_chat.ids[:shared], "chosen": chosen_chat.ids[shared:chosen_chat.replies[-1][1]],
              "rejected": rejected_chat.ids[shared:rejected_chat.replies[-1][1]]}
    truncated = len(sample["prompt"]) + max(len(sample["chosen"]), len(sample["rejected"])) > max_tokens
    if truncated:  # keep the prompt's end (at most half the budget), then cut the replies
        sample["prompt"] = sample["prompt"][-(max_tokens // 2):]
        for reply in ("chosen", "rejected"):
            sample[reply] = sample[reply][:max_tokens - len(sample["prompt"])]
    return sample, truncated


ENCODERS = {"pretrain": encode_pretrain, "sft": encode_sft, "dpo": encode_dpo}

_worker_tokenizer: Tokenizer | None = None


def _init_worker(tokenizer_dir: str) -> None:
    global _worker_tokenizer
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker_tokenizer = Tokenizer.load(tokenizer_dir)


def _encode_batch(job: tuple[str, int, list[Item]]) -> list[tuple[Sample, bool] | Skipped]:
    kind, max_tokens, items = job
    out: list[tuple[Sample, bool] | Skipped] = []
    for item in items:
        try:
            out.append(ENCODERS[kind](_worker_tokenizer, item.value, max_tokens))
        except TooLong as exc:
            out.append(Skipped(item.source, item.line, str(exc)))
    return out


# ---- main side ---------------------------------------------------------------------------------

class SplitWriter:
    """Appends samples to one split group: a resizable chunked array per field, offsets per stream at close."""

    def __init__(self, group: h5py.Group, streams: dict[str, tuple[str, ...]], token_dtype: type) -> None:
        self.group, self.streams = group, streams
        self.arrays = {name: group.create_dataset(name, shape=(0,), maxshape=(None,), chunks=(CHUNK_TOKENS,),
                                                  dtype=np.uint8 if name in MASK_FIELDS else token_dtype)
                       for fields in streams.values() for name in fields}
        self.offsets = {stream: [0] for stream in streams}

    def append(self, sample: Sample) -> None:
        for stream, fields in self.streams.items():
            start = self.offsets[stream][-1]
            end = start + len(sample[fields[0]])
            for name in fields:
                self.arrays[name].resize((end,))
                self.arrays[name][start:] = sample[name]
            self.offsets[stream].append(end)

    def pop(self) -> Sample:
        """Remove and return the last sample."""
        sample = {}
        for stream, fields in self.streams.items():
            start, end = self.offsets[stream][-2], self.offsets[stream].pop()
            for name in fields:
                sample[name] = self.arrays[name][start:end].tolist()
                self.arrays[name].resize((start,))
        return sample

    def close(self) -> None:
        for stream, offsets in self.offsets.items():
            self.group.create_dataset(f"{stream}_offsets", data=np.array(offsets, dtype=np.int64))


def write_attrs(h5: h5py.File, kind: str, tokenizer_hash: str, vocab_size: int, special: Tokenizer | None,
                **extra) -> None:
    """Root attributes that let training refuse mismatched data (special ids from `special`, or the fixed defaults)."""
    ids = (special.eos_id, special.pad_id, special.im_start_id, special.im_end_id) if special else (0, 3, 1, 2)
    h5.attrs.update({"schema_version": SCHEMA_VERSION, "kind": kind, "tokenizer_hash": tokenizer_hash,
                     "vocab_size": vocab_size, **dict(zip(("eos_id", "pad_id", "im_start_id", "im_end_id"), ids)),
                     **extra})


def _jobs(records: Iterator[Item | Skipped], kind: str, max_tokens: int, report: Report, strict: bool,
          progress: tqdm) -> Iterator[tuple[str, int, list[Item]]]:
    batch: list[Item] = []
    for record in records:
        if isinstance(record, Skipped):
            _skip(record, report, strict)
            continue
        report.files[record.source] = report.files.get(record.source, 0) + 1
        progress.update(1)
        batch.append(record)
        if len(batch) == BATCH_DOCS:
            yield kind, max_tokens, batch
            batch = []
    if batch:
        yield kind, max_tokens, batch


def _skip(record: Skipped, report: Report, strict: bool) -> None:
    if strict:
        raise UserError(f"{record} (--strict stops at the first bad record)")
    report.skipped.append(str(record))


def _token_count(sample: Sample) -> int:
    return sum(len(v) for k, v in sample.items() if k not in MASK_FIELDS)


def prepare(kind: str, inputs: list[str], tokenizer_dir: str | Path, out_dir: str | Path, val_fraction: float = 0.01,
            workers: int | None = None, strict: bool = False, seed: int = 0, seq_len: int = 512,
            show_progress: bool = True) -> Report:
    """Tokenize `kind` records ('pretrain', 'sft', 'dpo') into `out_dir/tokens.h5` with a train/val split.

    sft and dpo samples hold at most seq_len + 1 tokens (seq_len predicted positions): longer
    conversations are cut after the last assistant turn that fits (skipped when even the first reply
    does not fit); longer pairs keep the end of their prompt and the start of their replies.
    """
    if kind not in STREAMS:
        raise UserError(f"--kind must be one of {', '.join(STREAMS)}, got '{kind}'")
    if not 0.0 <= val_fraction < 1.0:
        raise UserError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    if seq_len < 8:
        raise UserError(f"--seq-len must be at least 8, got {seq_len}")
    files = expand_inputs(inputs)
    tokenizer = Tokenizer.load(tokenizer_dir)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    workers = workers or max(1, min(os.cpu_count() or 1, 8))
    report = Report(files={str(f): 0 for f in files})
    dtype = np.uint16 if tokenizer.vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32
    tmp = out / f".{TOKENS_FILE}.partial"
    rng = np.random.default_rng(seed)
    progress = tqdm(desc=f"tokenizing {kind} records", unit=" records", disable=not show_progress)
    pool = mp.get_context("fork").Pool(workers, _init_worker, (str(tokenizer_dir),)) if workers > 1 else None
    try:
        with h5py.File(tmp, "w") as h5:
            writers = {split: SplitWriter(h5.create_group(split), STREAMS[kind], dtype) for split in SPLITS}
            jobs = _jobs(read_records(files, kind), kind, seq_len + 1, report, strict, progress)
            if pool is None:
                _init_worker(str(tokenizer_dir))
                encoded = map(_encode_batch, jobs)
            else:
                encoded = pool.imap(_encode_batch, jobs)
            for results in encoded:
                for result in results:
                    if isinstance(result, Skipped):
                        _skip(result, report, strict)
                        continue
                    sample, truncated = result
                    report.truncated += truncated
                    split = "val" if rng.random() < val_fraction else "train"
                    writers[split].append(sample)
                    report.documents[split] += 1
                    report.tokens[split] += _token_count(sample)
            if report.documents["train"] + report.documents["val"] == 0:
                raise UserError("no usable records found in the inputs; nothing was written"
                                + (f" ({len(report.skipped)} records skipped, first: {report.skipped[0]})" if report.skipped else ""))
            if val_fraction > 0 and report.documents["val"] == 0 and report.documents["train"] > 1:
                sample = writers["train"].pop()  # a tiny corpus still gets a validation sample
                writers["val"].append(sample)
                for split, sign in (("train", -1), ("val", 1)):
                    report.documents[split] += sign
                    report.tokens[split] += sign * _token_count(sample)
            for writer in writers.values():
                writer.close()
            extra = {} if kind == "pretrain" else {"seq_len": seq_len}
            write_attrs(h5, kind, tokenizer.hash, tokenizer.vocab_size, tokenizer, **extra)
        os.replace(tmp, out / TOKENS_FILE)
    finally:
        progress.close()
        if pool is not None:
            pool.terminate()
        tmp.unlink(missing_ok=True)
    (out / REPORT_FILE).write_text(json.dumps(asdict(report), indent=1, ensure_ascii=False))
    shutil.rmtree(out / TOKENIZER_DIR, ignore_errors=True)
    tokenizer.save(out / TOKENIZER_DIR)
    return report
