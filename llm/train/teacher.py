"""The distillation teacher (`zerollm train distill --teacher RUN|EXPORT`): checked against the data and the student
before any rank starts, then loaded on every rank as a frozen engine.

The teacher may differ from the student in every dimension but the vocabulary: the KL compares the two token
distributions position by position over the whole vocabulary, so both must index the same tokens. Its tokenizer must
therefore be the one the data was prepared with (same hash), and a teacher without tokenizer files is refused, since
nothing could prove it matches.

A distilled run records which teacher it learns from (`llm.loading.weights_summary`: its weights, its checkpoint and
its config's shape and RoPE fields, kept with the data in the run record) and loads it at that checkpoint; resuming
it against another teacher, the same directory holding other weights, or the same weights under another config is
refused (`llm.train.run_record.check_same_weights`).
"""

from __future__ import annotations

from pathlib import Path

from llm import rundir
from llm.config import ModelConfig, RunConfig, triton_head_dim_refusal
from llm.data.prepare import TOKENS_FILE
from llm.errors import UserError
from llm.loading import load_model_dir, model_config_of, weights_summary
from llm.runtime.distributed import agreed
from llm.tokenizer import TOKENIZER_FILE, Tokenizer
from llm.train.engine import frozen_engine


def teacher_source(path: str | Path) -> tuple[ModelConfig, Path]:
    """(model config, tokenizer directory) of a run or export directory, read without loading its weights."""
    directory = Path(path)
    config = model_config_of(directory, "--teacher")
    return config, rundir.tokenizer_dir(directory) if rundir.is_run_dir(directory) else directory


def check_teacher(cfg: RunConfig, data_attrs: dict) -> dict[str, str]:
    """Refuse a teacher whose tokenizer is missing or is not the data's, whose vocabulary size is not the student's,
    whose context is shorter than data.seq_len, or that has no weights; each with one line naming both sides.
    Returns what identifies the teacher (`llm.loading.weights_summary`)."""
    teacher = cfg.train.teacher
    teacher_cfg, tokenizer_dir = teacher_source(teacher)
    if not (tokenizer_dir / TOKENIZER_FILE).is_file():
        raise UserError(f"--teacher {teacher}: no tokenizer ({tokenizer_dir / TOKENIZER_FILE} is missing), so nothing "
                        f"shows it is the one {cfg.data.path} was prepared with; give a teacher that keeps its "
                        "tokenizer files")
    data_tokenizer = _data_tokenizer_path(Path(cfg.data.path))
    teacher_tokenizer = Tokenizer.load(tokenizer_dir)
    if not teacher_tokenizer.has_hash(data_attrs["tokenizer_hash"]):
        sizes = "" if teacher_tokenizer.vocab_size == data_attrs["vocab_size"] else \
            f"; {teacher_tokenizer.vocab_size} tokens there, {data_attrs['vocab_size']} in the data"
        raise UserError(f"--teacher {teacher}: its tokenizer {tokenizer_dir} (hash {teacher_tokenizer.hash}) is not "
                        f"the data's {data_tokenizer} (hash {data_attrs['tokenizer_hash']}){sizes}; prepare the "
                        f"data with {tokenizer_dir}")
    student_vocab = cfg.model.vocab_size if cfg.model.vocab_size is not None else data_attrs["vocab_size"]
    if teacher_cfg.vocab_size != student_vocab:
        raise UserError(f"--teacher {teacher}: model.vocab_size {teacher_cfg.vocab_size} there, {student_vocab} here "
                        f"(the student's); set model.vocab_size={teacher_cfg.vocab_size}")
    refusal = triton_head_dim_refusal(teacher_cfg) if cfg.model.kernels == "triton" else None
    if refusal is not None:  # the teacher runs with the job's kernels
        raise UserError(f"--teacher {teacher}: model.kernels=triton runs the teacher too, and {refusal} there; use "
                        "model.kernels=auto or torch")
    if teacher_cfg.max_seq_len < cfg.data.seq_len:
        raise UserError(f"--teacher {teacher}: model.max_seq_len {teacher_cfg.max_seq_len} there is shorter than "
                        f"data.seq_len {cfg.data.seq_len}; set data.seq_len <= {teacher_cfg.max_seq_len}")
    return weights_summary(teacher, "--teacher")


def _data_tokenizer_path(data_dir: Path) -> Path:
    """What names the data's tokenizer in messages: its copy beside the data, else the tokens file."""
    copy = rundir.tokenizer_dir(data_dir)
    return copy if copy.is_dir() else data_dir / TOKENS_FILE


def load_teacher(cfg: RunConfig, ds_config: dict, tag: str | None = None, announce: bool = True):
    """The teacher's weights (its run directory's checkpoint `tag`, the one `check_teacher` found newest and the run
    records, or its export) as a frozen inference engine: partitioned under ZeRO-3, replicated otherwise
    (`llm.train.engine.frozen_engine`). A collective: a teacher no rank can load (a damaged checkpoint) is one
    UserError on every rank, said where `announce` (once per node; each rank said it)."""
    model, _ = agreed(lambda: load_model_dir(cfg.train.teacher, tag, "--teacher"), announce)
    return frozen_engine(model.use_kernels(cfg.model.kernels), ds_config)  # the ops run as this job's (its device's)
