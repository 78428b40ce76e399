"""Canonical records -> tokenized HDF5, tokenized in parallel worker processes.

Output directory layout:
    tokens.h5     one group per split ('train', 'val'), each with a flat `tokens` array (uint16 when
                  the vocabulary fits, else uint32) and `doc_offsets` (int64, n_docs + 1); root
                  attributes record the schema version, kind, tokenizer hash, vocabulary size, special ids
    report.json   documents, tokens, skipped records (file:line: reason)
    tokenizer/    a copy of the tokenizer used, so training and inference find it

`tokens.h5` is written under a temporary name and renamed only when complete, so a failed or
interrupted run never leaves a file that looks valid.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import h5py
import numpy as np
from tqdm import tqdm

from llm.data.formats import Document, Skipped, expand_inputs, read_pretrain_documents
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
    """Documents read from each input file."""
    documents: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SPLITS, 0))
    tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SPLITS, 0))
    skipped: list[str] = field(default_factory=list)
    """Every unusable record as 'file:line: reason'."""

    def summary(self, shown: int = 20) -> str:
        lines = [f"documents  train {self.documents['train']:,}  val {self.documents['val']:,}",
                 f"tokens     train {self.tokens['train']:,}  val {self.tokens['val']:,}"]
        empty = [name for name, count in self.files.items() if count == 0]
        if empty:
            lines.append(f"files with no documents: {', '.join(empty)}")
        if self.skipped:
            reasons = Counter(s.split(": ", 1)[1] for s in self.skipped)
            lines.append(f"skipped {len(self.skipped):,} records: " + "; ".join(f"{r} x{n}" for r, n in reasons.most_common(5)))
            lines += [f"  {s}" for s in self.skipped[:shown]]
            if len(self.skipped) > shown:
                lines.append(f"  ... {len(self.skipped) - shown} more in {REPORT_FILE}")
        return "\n".join(lines)


# ---- worker side -------------------------------------------------------------------------------

_worker_tokenizer: Tokenizer | None = None


def _init_worker(tokenizer_dir: str) -> None:
    global _worker_tokenizer
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker_tokenizer = Tokenizer.load(tokenizer_dir)


def _encode_documents(texts: list[str]) -> list[np.ndarray]:
    """Token ids of each text followed by end-of-text."""
    tok = _worker_tokenizer
    return [np.array(ids + [tok.eos_id], dtype=np.int64) for ids in tok.encode_batch(texts)]


# ---- main side ---------------------------------------------------------------------------------

class SplitWriter:
    """Appends documents to one split group: resizable chunked `tokens`, `doc_offsets` at close."""

    def __init__(self, group: h5py.Group, dtype: type) -> None:
        self.tokens = group.create_dataset("tokens", shape=(0,), maxshape=(None,), dtype=dtype,
                                           chunks=(CHUNK_TOKENS,))
        self.group = group
        self.offsets = [0]

    def append(self, ids: np.ndarray) -> None:
        start = self.offsets[-1]
        self.tokens.resize((start + len(ids),))
        self.tokens[start:] = ids
        self.offsets.append(start + len(ids))

    def pop(self) -> np.ndarray:
        """Remove and return the last document."""
        start, end = self.offsets[-2], self.offsets[-1]
        ids = self.tokens[start:end]
        self.tokens.resize((start,))
        self.offsets.pop()
        return ids

    def close(self) -> None:
        self.group.create_dataset("doc_offsets", data=np.array(self.offsets, dtype=np.int64))


def write_attrs(h5: h5py.File, kind: str, tokenizer_hash: str, vocab_size: int, special: Tokenizer | None) -> None:
    """Root attributes that let training refuse mismatched data (special ids from `special`, or the fixed defaults)."""
    ids = (special.eos_id, special.pad_id, special.im_start_id, special.im_end_id) if special else (0, 3, 1, 2)
    h5.attrs.update({"schema_version": SCHEMA_VERSION, "kind": kind, "tokenizer_hash": tokenizer_hash,
                     "vocab_size": vocab_size, **dict(zip(("eos_id", "pad_id", "im_start_id", "im_end_id"), ids))})


def _batches(docs: Iterator[Document | Skipped], report: Report, strict: bool,
             progress: tqdm) -> Iterator[list[Document]]:
    batch: list[Document] = []
    for doc in docs:
        if isinstance(doc, Skipped):
            if strict:
                raise UserError(f"{doc} (--strict stops at the first bad record)")
            report.skipped.append(str(doc))
            continue
        report.files[doc.source] = report.files.get(doc.source, 0) + 1
        progress.update(len(doc.text.encode("utf-8")))
        batch.append(doc)
        if len(batch) == BATCH_DOCS:
            yield batch
            batch = []
    if batch:
        yield batch


def prepare_pretrain(inputs: list[str], tokenizer_dir: str | Path, out_dir: str | Path, val_fraction: float = 0.01,
                     workers: int | None = None, strict: bool = False, seed: int = 0,
                     show_progress: bool = True) -> Report:
    """Tokenize pretraining documents into `out_dir/tokens.h5` with a train/val split."""
    if not 0.0 <= val_fraction < 1.0:
        raise UserError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    files = expand_inputs(inputs)
    tokenizer = Tokenizer.load(tokenizer_dir)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    workers = workers or max(1, min(os.cpu_count() or 1, 8))
    report = Report(files={str(f): 0 for f in files})
    dtype = np.uint16 if tokenizer.vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32
    tmp = out / f".{TOKENS_FILE}.partial"
    rng = np.random.default_rng(seed)
    progress = tqdm(total=sum(f.stat().st_size for f in files), unit="B", unit_scale=True,
                    desc="tokenizing", disable=not show_progress)
    pool = mp.get_context("fork").Pool(workers, _init_worker, (str(tokenizer_dir),)) if workers > 1 else None
    try:
        with h5py.File(tmp, "w") as h5:
            writers = {split: SplitWriter(h5.create_group(split), dtype) for split in SPLITS}
            batches = _batches(read_pretrain_documents(files), report, strict, progress)
            if pool is None:
                _init_worker(str(tokenizer_dir))
                encoded = map(_encode_documents, ([d.text for d in b] for b in batches))
            else:
                encoded = pool.imap(_encode_documents, ([d.text for d in b] for b in batches))
            for docs in encoded:
                for ids in docs:
                    split = "val" if rng.random() < val_fraction else "train"
                    writers[split].append(ids.astype(dtype))
                    report.documents[split] += 1
                    report.tokens[split] += len(ids)
            if report.documents["train"] + report.documents["val"] == 0:
                raise UserError("no documents found in the inputs; nothing was written"
                                + (f" ({len(report.skipped)} records skipped, first: {report.skipped[0]})" if report.skipped else ""))
            if val_fraction > 0 and report.documents["val"] == 0 and report.documents["train"] > 1:
                ids = writers["train"].pop()  # a tiny corpus still gets a validation document
                writers["val"].append(ids)
                for split, sign in (("train", -1), ("val", 1)):
                    report.documents[split] += sign
                    report.tokens[split] += sign * len(ids)
            for writer in writers.values():
                writer.close()
            write_attrs(h5, "pretrain", tokenizer.hash, tokenizer.vocab_size, tokenizer)
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
