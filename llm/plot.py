"""Pictures of training runs: `zerollm plot RUN [RUN...] --out FILE.png` draws training loss, validation loss,
learning rate and throughput against the step (left column) and against the tokens seen (right column), one line
per run, from each run's metrics.jsonl. matplotlib is an optional dependency (`pip install matplotlib`, or the
`plot` extra).

Tokens seen at step s = s x global batch (ds_config.json's train_batch_size) x data.seq_len (config.yaml): the
positions the run trained on, with the batch shape the run directory records now.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

from llm import rundir
from llm.errors import UserError

PANELS = (("loss", "training loss"), ("val_loss", "validation loss"), ("lr", "learning rate"),
          ("tokens_per_sec", "throughput (tokens/s)"))
X_AXES = (("step", "step"), ("tokens", "tokens seen"))
PANEL_SIZE = (6.0, 3.2)
"""Inches per panel (width, height); at 100 dpi a 2 x 4 grid is 1200 x 1280 pixels."""


@dataclass
class RunSeries:
    name: str
    rows: list[dict]
    tokens_per_step: int

    def points(self, key: str, x: str) -> tuple[list[float], list[float]]:
        """(x values, `key` values) of the rows holding a finite number as `key` (a string, a list or true is not
        drawn: matplotlib would draw strings as categories in the order they come)."""
        rows = [r for r in self.rows if rundir.is_number(r.get(key))]
        xs = [r["step"] * (self.tokens_per_step if x == "tokens" else 1) for r in rows]
        return xs, [r[key] for r in rows]


def _tokens_per_step(run_dir: Path) -> int:
    """Global batch x data.seq_len: the positions one step trains on, as the run directory records them."""
    seq_len = rundir.recorded_config(run_dir)["data"]["seq_len"]
    path = run_dir / rundir.DS_CONFIG_FILE
    try:
        batch = json.loads(path.read_text())["train_batch_size"]
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise UserError(f"{path}: cannot read the run's train_batch_size ({type(exc).__name__}: {exc}); `zerollm "
                        "train` wrote it: restore it") from None
    if not all(rundir.is_count(v, least=1) for v in (batch, seq_len)):
        raise UserError(f"{run_dir}: train_batch_size {batch!r} and data.seq_len {seq_len!r} are not positive "
                        "integers; `zerollm train` wrote them: restore the run's files")
    return batch * seq_len


def read_run(run_dir: Path) -> RunSeries:
    metrics = run_dir / rundir.METRICS_FILE
    if not metrics.is_file():
        raise UserError(f"{run_dir}: no {rundir.METRICS_FILE}; is this a run directory made by `zerollm train`?")
    rows = []
    for number, line in enumerate(metrics.read_text().splitlines(), start=1):
        try:
            row = json.loads(line) if line.strip() else None
        except json.JSONDecodeError:
            row = None
        if isinstance(row, dict) and rundir.is_count(row.get("step")):
            rows.append(row)
        elif line.strip():  # e.g. the last line, torn by a killed run (training drops it the same way)
            print(f"zerollm: note: {metrics}:{number}: skipped a line that is not a metrics row", file=sys.stderr)
    if not rows:
        raise UserError(f"{metrics}: no logged steps yet")
    return RunSeries(run_dir.resolve().name, rows, _tokens_per_step(run_dir))


def plot_runs(run_dirs: list[str | Path], out: str | Path) -> Path:
    """Draw every run's curves into one picture at `out` (its suffix picks the format: .png, .pdf, .svg)."""
    try:
        import matplotlib  # noqa: PLC0415 - optional dependency, needed only for pictures

        matplotlib.use("Agg")  # files only, no display
        import matplotlib.pyplot as plt  # noqa: PLC0415 - after the backend is chosen
    except ImportError:
        raise UserError("matplotlib is not installed; pip install matplotlib (or pip install 'zerollm[plot]') "
                        "to draw runs") from None
    out = Path(out)
    if out.is_dir():
        raise UserError(f"--out {out} is a directory; give a file such as {out / 'runs.png'}")
    out = out if out.suffix else out.with_suffix(".png")  # what matplotlib would write
    nearest = next(folder for folder in out.parents if folder.exists())  # "." at the latest
    if not nearest.is_dir():
        raise UserError(f"--out {out}: cannot write it ({nearest} is a file, not a directory)")
    formats = plt.figure().canvas.get_supported_filetypes()
    plt.close("all")
    if out.suffix[1:].lower() not in formats:
        raise UserError(f"--out {out}: matplotlib cannot write .{out.suffix[1:]} pictures; give a file ending in "
                        f"{', '.join('.' + f for f in sorted(formats))}")
    runs = [read_run(Path(d)) for d in run_dirs]
    fig, axes = plt.subplots(len(PANELS), len(X_AXES), squeeze=False,
                             figsize=(PANEL_SIZE[0] * len(X_AXES), PANEL_SIZE[1] * len(PANELS)))
    for row, (key, title) in enumerate(PANELS):
        for column, (x, x_label) in enumerate(X_AXES):
            ax = axes[row][column]
            for run in runs:
                xs, ys = run.points(key, x)
                ax.plot(xs, ys, marker="o" if key == "val_loss" or len(xs) == 1 else None, markersize=3, label=run.name)
            ax.set_title(f"{title} by {x_label}")
            ax.set_xlabel(x_label)
            ax.grid(alpha=0.3)
    axes[0][0].legend()
    partial = out.with_name(f".{out.name}.{os.getpid()}.partial")  # renamed over `out` once whole
    try:
        with warnings.catch_warnings():  # numpy's overflow warnings on such values: the error below says it
            warnings.simplefilter("ignore", RuntimeWarning)
            fig.tight_layout()
            out.parent.mkdir(parents=True, exist_ok=True)
            fig.savefig(partial, dpi=100, format=out.suffix[1:].lower())
        os.replace(partial, out)
    except OSError as exc:
        raise UserError(f"--out {out}: cannot write it ({exc.strerror or exc})") from None
    except (ValueError, OverflowError) as exc:  # e.g. values too far apart for an axis
        raise UserError(f"cannot draw these metrics ({exc}); are the runs' metrics.jsonl files intact?") from None
    finally:
        plt.close("all")
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)
    return out
