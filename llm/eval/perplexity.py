"""Loss per token, perplexity and bits per byte of a model on a token stream (`llm.eval.token_stream`).

Windows: the stream is cut into windows of at most `context` input tokens. Each window scores the `stride` tokens
after the previous window's (`stride <= context`); its inputs reach back as far as `context` allows, so with a
stride below the context every scored token after the first window sees at least `context - stride` tokens of
context. Every token after the stream's leading <|endoftext|> is scored exactly once, except a document's start
ids (the BOS of a Llama-style tokenizer): those are context only, read and never predicted.

    loss per token = total nats / scored tokens       perplexity = exp(loss per token)
    bits per byte  = total nats / ln 2 / UTF-8 bytes of the scored text (the rule: `llm.eval.token_stream`)

Bits per byte does not depend on the tokenizer, so models with different vocabularies compare on it. With
several ranks (`--nproc`, or under a launcher) window i goes to rank i mod world size and the sums are reduced
once at the end.
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from llm import rundir
from llm.config import build_config
from llm.data.readers import expand_inputs
from llm.devices import place, resolve
from llm.errors import UserError
from llm.eval.scoring import score_sequences
from llm.eval.token_stream import (
    TokenStream,
    document_start_positions,
    scored_text_bytes,
    split_data_attrs,
    stream_of_files,
    stream_of_split,
)
from llm.loading import is_run_or_export, load_scored
from llm.model import Transformer
from llm.runtime.distributed import agreed, setup_distributed
from llm.tokenizer import Tokenizer
from llm.wording import plural


@dataclass(frozen=True)
class Window:
    start: int
    """Position of the first input token."""
    end: int
    """One past the position of the last target: inputs are [start, end - 1), targets [start + 1, end)."""
    scored: int
    """The last `scored` targets count."""


def check_stride(stride: int, context: int) -> None:
    if not 1 <= stride <= context:
        raise UserError(f"--stride must be between 1 and the context ({context}), got {stride}")


def windows(n_tokens: int, context: int, stride: int) -> list[Window]:
    """Windows that score positions 1 .. n_tokens - 1 once each (see the module docstring)."""
    check_stride(stride, context)
    out = []
    for first in range(1, n_tokens, stride):
        end = min(first + stride, n_tokens)
        out.append(Window(max(0, end - 1 - context), end, end - first))
    return out


@dataclass(frozen=True)
class PerplexityResult:
    tokens: int
    """Scored tokens."""
    bytes: int
    """UTF-8 bytes of the scored text."""
    nats: float
    """Total negative log-likelihood of the scored tokens."""
    windows: int
    context: int
    stride: int

    @property
    def loss(self) -> float:
        return self.nats / self.tokens

    @property
    def perplexity(self) -> float:
        """exp(loss per token); inf where that overflows a float (a loss above ~709.8 nats: a diverged model)."""
        try:
            return math.exp(self.loss)
        except OverflowError:
            return math.inf

    @property
    def bits_per_byte(self) -> float:
        return self.nats / math.log(2) / self.bytes if self.bytes else float("nan")

    def to_dict(self) -> dict:
        """The fields and the three figures, for JSON: a figure that is not a finite number (the perplexity of a
        diverged model overflows to inf; bits per byte of no bytes) is None (JSON null), so the text stays JSON."""
        figures = {**asdict(self), "loss": self.loss, "perplexity": self.perplexity,
                   "bits_per_byte": self.bits_per_byte}
        return {key: None if isinstance(value, float) and not math.isfinite(value) else value
                for key, value in figures.items()}

    def summary(self) -> str:
        return (f"{self.tokens:,} tokens ({self.bytes:,} bytes) in {self.windows:,} "
                f"{plural('window', self.windows)} of up to {self.context} "
                f"tokens, stride {self.stride}\n"
                f"  loss per token  {self.loss:10.4f}\n"
                f"  perplexity      {_figure(self.perplexity)}\n"
                f"  bits per byte   {self.bits_per_byte:10.4f}")


def _figure(value: float) -> str:
    """A perplexity in 10 columns: 3 decimals, or scientific notation from 1e9 on (a diverged model's has hundreds
    of digits), inf past a float's range."""
    return f"{value:10.3f}" if value < 1e9 else f"{value:10.4g}"


def evaluate_stream(model: Transformer, tokenizer: Tokenizer, stream: TokenStream, context: int, stride: int,
                    batch_size: int = 8, rank: int = 0, world_size: int = 1, progress: bool = True,
                    announce: bool = True) -> PerplexityResult:
    """Score `stream` with `model` (already placed on its device). With world_size > 1 (a process group is up),
    this rank scores every world_size-th window and the totals are all-reduced; the bytes are counted on rank 0
    only (other ranks report 0). A mistake one rank finds in its windows (a token id beyond the vocabulary) ends
    every rank with it (`agreed`; `announce`: this rank prints it)."""
    every = windows(len(stream), context, stride)
    mine = every[rank::world_size]
    bar = tqdm(total=len(mine), desc="eval" if world_size == 1 else f"eval (rank 0's {len(mine)} of {len(every)})",
               unit="window", disable=not progress or rank != 0, file=sys.stderr)

    def score_mine() -> tuple[float, int]:
        nats, tokens = 0.0, 0
        for first in range(0, len(mine), batch_size):
            group = mine[first:first + batch_size]
            sequences = [stream.read(w.start, w.end) for w in group]
            starts = [document_start_positions(stream, tokenizer, w.end - w.scored, w.end) - w.start for w in group]
            for score in score_sequences(model, sequences, [w.scored for w in group], batch_size, tokenizer.pad_id,
                                         starts):
                nats += score.nats
                tokens += score.tokens
            bar.update(len(group))
        return nats, tokens

    # agreed: a rank that refused alone left the others in the all-reduce below, to end in a gloo traceback
    nats, tokens = agreed(score_mine, announce) if world_size > 1 else score_mine()
    bar.close()
    if world_size > 1:
        device = next(model.parameters()).device
        totals = torch.tensor([nats, tokens], dtype=torch.float64, device=device)
        dist.all_reduce(totals)
        nats, tokens = totals[0].item(), int(totals[1].item())
    n_bytes = scored_text_bytes(stream, tokenizer) if rank == 0 else 0
    return PerplexityResult(tokens, n_bytes, nats, len(every), context, stride)


EXPORT_CONTEXT = 4096
"""The most tokens an export's windows take by default: a window of a Llama 3.1's whole 131,072 positions has 33 GB
of logits in bf16 (16 GiB of them a row at batch size 1), out of memory at the default batch size on any GPU."""


def evaluation_context(context: int | None, model_dir: Path, model: Transformer) -> int:
    """--context, checked to be in 1..model.max_seq_len; when not given (None; 0 is out of range), the window the
    model was trained on (data.seq_len of a run directory), else its longest sequence up to EXPORT_CONTEXT (an
    export)."""
    if context is None:
        context = build_config(rundir.recorded_config(model_dir)).data.seq_len if rundir.is_run_dir(model_dir) \
            else min(model.cfg.max_seq_len, EXPORT_CONTEXT)
    if not 1 <= context <= model.cfg.max_seq_len:
        raise UserError(f"--context must be between 1 and the model's max_seq_len {model.cfg.max_seq_len}, "
                        f"got {context}")
    return context


def check_batch_size(batch_size: int) -> None:
    if batch_size < 1:
        raise UserError(f"--batch-size must be >= 1, got {batch_size}")


def check_rank_device(device: str, ranks_device: str, world_size: int) -> None:
    """Refuse a --device other than auto and the one the ranks of a job of `world_size` run on (`ranks_device`:
    a CUDA GPU per rank where there is one, else the CPU): the ranks ran there, ignoring it."""
    if device not in ("auto", ranks_device):
        raise UserError(f"--device {device}: the {world_size} ranks of this job run on {ranks_device} (a CUDA GPU per "
                        "rank where there is one, else the CPU); leave --device out, or score in one process without "
                        "--nproc")


def check_sources(model_dir: str, inputs: list[str] | None, data_dir: str | None, split: str | None) -> None:
    """What `eval --input/--data` reads, checked before any model loads; by the launching process too, so that a
    mistake there is one line rather than one a rank."""
    if inputs:
        expand_inputs(inputs)
    else:
        split_data_attrs(data_dir, "val" if split is None else split)
    is_run_or_export(Path(model_dir), "--model")


def same_checkpoint(model_dir: str, mine: str | None, world_size: int) -> None:
    """Every rank read checkpoint `mine` of the run (a collective): a training that published a newer one while the
    ranks loaded theirs would have them score different weights as one model."""
    read = [mine] * world_size
    dist.all_gather_object(read, mine)
    if len(set(read)) > 1:
        raise UserError(f"--model {model_dir}: its ranks read different checkpoints ({', '.join(sorted(set(read)))}); "
                        "a training published one while they loaded; run again")


def run_perplexity(model_dir: str, inputs: list[str] | None, data_dir: str | None, split: str | None,
                   context: int | None = None, stride: int | None = None, batch_size: int = 8, device: str = "auto",
                   dtype: str = "auto", as_json: bool = False) -> int:
    """`zerollm eval --input/--data`: print the result (rank 0), on every rank of the job when started by a
    launcher; a mistake every rank finds is printed once per node. Returns the exit code."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    split = "val" if split is None else split  # --split '' is refused, not taken for val
    check_batch_size(batch_size)
    rank, announce = 0, True
    if world_size > 1:
        info = setup_distributed()
        rank, where, announce = info.rank, info.device, info.local_rank == 0

        def rank_precision():
            check_rank_device(device, info.device.type, world_size)
            return resolve(info.device.type, dtype)[1]

        precision = agreed(rank_precision, announce)
    else:
        where, precision = resolve(device, dtype)

    def inputs_checked():
        check_sources(model_dir, inputs, data_dir, split)
        model, tokenizer, checkpoint = load_scored(model_dir)
        window = evaluation_context(context, Path(model_dir), model)
        step = window if stride is None else stride
        check_stride(step, window)  # before the inputs are read: large ones take minutes
        if inputs:
            stream, report = stream_of_files(inputs, tokenizer, progress=rank == 0)
            source = {"input": [str(p) for p in inputs], "documents": report.documents, "skipped": len(report.skipped)}
        else:
            stream, report = stream_of_split(data_dir, split, tokenizer, model.cfg.vocab_size), None
            source = {"data": str(data_dir), "split": split}
        if checkpoint is not None:
            source["checkpoint"] = checkpoint
        return model, tokenizer, window, step, stream, report, source

    if world_size > 1:  # a mistake every rank finds: one line per node, not one per rank
        model, tokenizer, context, stride, stream, report, source = agreed(inputs_checked, announce)
        agreed(lambda: same_checkpoint(model_dir, source.get("checkpoint"), world_size), announce)
    else:
        model, tokenizer, context, stride, stream, report, source = inputs_checked()
    if report is not None and report.skipped and rank == 0:
        count = len(report.skipped)
        print(f"skipped {count} unusable {plural('record', count)}:", file=sys.stderr)
        for line in report.skipped:
            print(f"  {line}", file=sys.stderr)
    result = evaluate_stream(place(model, where, precision), tokenizer, stream, context, stride, batch_size, rank,
                             world_size, announce=announce)
    if rank == 0:
        if as_json:
            print(json.dumps({"model": str(model_dir), **source, "ranks": world_size, **result.to_dict()},
                             allow_nan=False))
        else:
            weights = f" ({source['checkpoint']})" if "checkpoint" in source else ""
            print(f"eval {model_dir}{weights} on {', '.join(source.get('input', [])) or f'{data_dir} ({split})'}: "
                  + result.summary())
    return 0  # a rank's process ends without teardown, its gloo group open (`llm.cli.end_rank`)
