"""Pictures of training runs: `zerollm plot RUN [RUN...] --out FILE.png` draws training loss, validation loss,
learning rate and throughput against the step (left column) and against the tokens seen (right column), one line
per run, from each run's metrics.jsonl. matplotlib is an optional dependency (`pip install matplotlib`, or the
`plot` extra).

Tokens seen at a step: the row's `tokens`, the positions the run trained on up to it (global batch x data.seq_len
per step, twice that for DPO, whatever the batch was when the step ran: a run resumed on other ranks counts each
part at its own). A row of an earlier version holds none: step x global batch (ds_config.json's train_batch_size) x
data.seq_len (config.yaml), the batch shape the run directory records now (`rundir.recorded_tokens_per_step`).
"""

from __future__ import annotations

import io
import math
import sys
import warnings
from array import array
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llm import durable, rundir
from llm.errors import UserError
from llm.jsonl import jsonl_lines

PANELS = (("loss", "training loss"), ("val_loss", "validation loss"), ("lr", "learning rate"),
          ("tokens_per_sec", "throughput (tokens/s)"))
TOKENS = "tokens"
"""A row's count of the positions trained on up to its step (`Trainer.tokens_seen`)."""
X_AXES = (("step", "step"), (TOKENS, "tokens seen"))
PANEL_SIZE = (6.0, 3.2)
"""Inches per panel (width, height); at 100 dpi a 2 x 4 grid is 1200 x 1280 pixels, with the legend below it."""
LEGEND_COLUMNS = 3
LEGEND_ROW_HEIGHT = 0.3
"""Inches per row of the legend, which lies below the panels (`LEGEND_COLUMNS` runs a row)."""
LINE_STYLES = ("-", "--", ":", "-.")
"""After every colour of matplotlib's cycle is used, the next runs take the next line style."""


@dataclass
class RunSeries:
    name: str
    columns: dict[str, tuple[array, array]]
    """Per drawn key (`PANELS`) and `TOKENS`: the steps and values of the rows holding a finite number as that key."""
    tokens_per_step: int | None
    """For a row without `TOKENS` (an earlier version's): the positions of one step at the batch recorded now; None
    where every row has its tokens."""

    def arrays(self, key: str, x: str) -> tuple[np.ndarray, np.ndarray]:
        """(x values, `key` values) of the rows holding a finite number as `key` (a string, a list or true is not
        drawn: matplotlib would draw strings as categories in the order they come), over the columns' memory."""
        steps, values = self._column(key)
        if x != TOKENS:
            return steps, values
        logged, tokens = self._column(TOKENS)
        at = np.minimum(np.searchsorted(logged, steps), max(len(logged) - 1, 0))
        found = logged[at] == steps if len(logged) else np.zeros(len(steps), dtype=bool)
        per_step = float(self.tokens_per_step or 0)  # None: every row was found
        return np.where(found, tokens[at] if len(logged) else 0.0, steps * per_step), values

    def _column(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        steps, values = self.columns[key]
        return np.frombuffer(steps, dtype=np.int64), np.frombuffer(values, dtype=np.float64)

    def points(self, key: str, x: str) -> tuple[list[float], list[float]]:
        """`arrays` as lists."""
        return tuple(column.tolist() for column in self.arrays(key, x))


BUCKETS = 2000
"""A line of more points than twice this is drawn through its first and last point and each bucket's lowest and
highest, its buckets of consecutive rows: more than a panel's pixels across, so the picture is the same (every spike
kept), while matplotlib holds about 4,000 points a line, not every row of a long run (871 MiB for two million)."""


def thinned(xs: np.ndarray, ys: np.ndarray, buckets: int = BUCKETS) -> tuple[np.ndarray, np.ndarray]:
    """The points of a line to draw (`BUCKETS`), in their order."""
    if len(xs) <= 2 * buckets:
        return xs, ys
    edges = np.linspace(0, len(xs), buckets + 1).astype(np.int64)
    kept = {0, len(xs) - 1}  # the line spans the run
    for start, end in zip(edges[:-1], edges[1:], strict=True):
        kept |= {start + int(np.argmin(ys[start:end])), start + int(np.argmax(ys[start:end]))}
    order = sorted(kept)
    return xs[order], ys[order]


def read_run(run_dir: Path, name: str | None = None) -> RunSeries:
    """The drawn columns of a run's metrics.jsonl, read a line at a time (a long run's file need not fit in memory
    as rows); `name` labels it (default: the folder's name)."""
    if not run_dir.is_dir():
        raise UserError(f"{run_dir}: " + ("no such directory" if not run_dir.exists() else
                                          "not a directory; give a run directory made by `zerollm train`"))
    metrics = run_dir / rundir.METRICS_FILE
    if not metrics.is_file() and not rundir.is_run_dir(run_dir):  # a run writes it at its first logged step
        raise UserError(f"{run_dir}: no {rundir.METRICS_FILE}; is this a run directory made by `zerollm train`?")
    columns = {key: (array("q"), array("d")) for key in (*(key for key, _ in PANELS), TOKENS)}
    rows, last_step, without_tokens = 0, -1, False
    for line in jsonl_lines(metrics) if metrics.is_file() else ():
        row = line.value
        if not (isinstance(row, dict) and rundir.is_count(row.get("step"))):
            # e.g. the last line, torn by a killed run (training drops it the same way)
            print(f"zerollm: note: {metrics}:{line.number}: skipped a line that is not a metrics row", file=sys.stderr)
            continue
        rows += 1
        if row["step"] <= last_step:  # a step logged again supersedes it and every point after it, in every column
            for steps, values in columns.values():
                while steps and steps[-1] >= row["step"]:
                    steps.pop()
                    values.pop()
        last_step = row["step"]
        for key, (steps, values) in columns.items():
            if rundir.is_number(row.get(key)):
                steps.append(row["step"])
                values.append(row[key])
        without_tokens = without_tokens or not rundir.is_number(row.get(TOKENS))
    label = name or run_dir.resolve().name
    if not rows:  # a run just begun: the others are still drawn
        print(f"zerollm: note: {run_dir}: no logged steps yet; {label} has no line", file=sys.stderr)
    elif not any(columns[key][0] for key, _ in PANELS):
        print(f"zerollm: note: {metrics}: no row holds a number as {', '.join(key for key, _ in PANELS)}; "
              f"{label} has no line", file=sys.stderr)
    # the batch, only where a row lacks its tokens (an earlier version's): metrics.jsonl alone (copied off a
    # cluster) was refused for the run files it does not need
    return RunSeries(label, columns, rundir.recorded_tokens_per_step(run_dir) if without_tokens else None)


def run_labels(run_dirs: list[Path]) -> list[str]:
    """Each run's shortest path suffix that no other run's path ends with (runs/a/run and runs/b/run: a/run and
    b/run), so that runs in folders of the same name get distinct labels."""
    paths = [d.resolve().parts for d in run_dirs]

    def label(parts: tuple[str, ...]) -> str:
        others = [other for other in paths if other != parts]  # a run given twice is labelled alike
        for n in range(1, len(parts)):
            if all(other[-n:] != parts[-n:] for other in others):
                return "/".join(parts[-n:])
        return str(Path(*parts))  # /run beside /x/run

    return [label(parts) for parts in paths]


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
    formats = plt.figure().canvas.get_supported_filetypes()
    plt.close("all")
    if not out.suffix and out.name[1:].lower() in formats:  # ".png" is a hidden file without a suffix to Python
        raise UserError(f"--out {out} is a suffix without a file name; give a file such as "
                        f"{out.with_name('runs' + out.name)}")
    out = out if out.suffix else out.with_suffix(".png")  # what matplotlib would write
    nearest = next(folder for folder in out.parents if folder.exists())  # "." at the latest
    if not nearest.is_dir():
        raise UserError(f"--out {out}: cannot write it ({nearest} is a file, not a directory)")
    if out.suffix[1:].lower() not in formats:
        raise UserError(f"--out {out}: matplotlib cannot write .{out.suffix[1:]} pictures; give a file ending in "
                        f"{', '.join('.' + f for f in sorted(formats))}")
    runs = [read_run(Path(d), name) for d, name in zip(run_dirs, run_labels([Path(d) for d in run_dirs]))]
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    legend_height = LEGEND_ROW_HEIGHT * (math.ceil(len(runs) / LEGEND_COLUMNS) + 1)
    height = PANEL_SIZE[1] * len(PANELS) + legend_height
    fig, axes = plt.subplots(len(PANELS), len(X_AXES), squeeze=False, figsize=(PANEL_SIZE[0] * len(X_AXES), height))
    for row, (key, title) in enumerate(PANELS):
        for column, (x, x_label) in enumerate(X_AXES):
            ax = axes[row][column]
            drawn = False
            for i, run in enumerate(runs):
                xs, ys = thinned(*run.arrays(key, x))
                drawn = drawn or bool(len(xs))
                ax.plot(xs, ys, marker="o" if key == "val_loss" or len(xs) == 1 else None, markersize=3,
                        color=colours[i % len(colours)], linestyle=LINE_STYLES[i // len(colours) % len(LINE_STYLES)])
            if not drawn:  # rather than an empty frame with axes from -0.04 to 0.04
                ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center", color="grey")
                ax.set_xticks([])
                ax.set_yticks([])
            ax.set_title(f"{title} by {x_label}")
            ax.set_xlabel(x_label)
            ax.grid(alpha=0.3)
    # each run's line in the first panel, labelled as given: matplotlib leaves out a label that starts with '_'
    # (a run folder '_base') and reads text between two '$' as mathematics ('cost$5 and $6', or an error)
    fig.legend(axes[0][0].get_lines(), [run.name.replace("$", r"\$") for run in runs], loc="lower center",
               ncols=min(len(runs), LEGEND_COLUMNS), frameon=False)
    picture = io.BytesIO()
    try:
        with warnings.catch_warnings():  # numpy's overflow warnings on such values: the error below says it
            warnings.simplefilter("ignore", RuntimeWarning)
            fig.tight_layout(rect=(0, legend_height / height, 1, 1))  # the legend below every panel
            try:
                fig.savefig(picture, dpi=100, format=out.suffix[1:].lower())
            except RuntimeError as exc:  # a format that needs a program matplotlib did not find: .pgf needs LaTeX
                raise UserError(f"--out {out}: matplotlib cannot write .{out.suffix[1:]} pictures here ({exc})") \
                    from None
        out.parent.mkdir(parents=True, exist_ok=True)
        durable.write_bytes(out, picture.getvalue())  # a failed write leaves the earlier picture
    except OSError as exc:
        raise UserError(f"--out {out}: cannot write it ({exc.strerror or exc})") from None
    except (ValueError, OverflowError) as exc:  # e.g. values too far apart for an axis
        raise UserError(f"cannot draw these metrics ({exc}); are the runs' metrics.jsonl files intact?") from None
    finally:
        plt.close("all")
    return out
