"""`zerollm plot`: a picture of several runs' curves from their metrics.jsonl."""

import errno
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from test_checkpoint import file_size_limit

from llm.errors import UserError
from llm.plot import plot_runs, run_labels

BLUE, ORANGE = (0x1F, 0x77, 0xB4), (0xFF, 0x7F, 0x0E)  # matplotlib's first two line colours


def fake_run(directory, steps, scale, batch=8, seq_len=32):
    """A run directory as `zerollm train` leaves it, as far as plotting reads it."""
    directory.mkdir()
    (directory / "config.yaml").write_text(f"data:\n  seq_len: {seq_len}\n")
    (directory / "ds_config.json").write_text(json.dumps({"train_batch_size": batch}))
    rows = []
    for step in range(1, steps + 1):
        row = {"step": step, "loss": scale * (6 - step / steps), "lr": 1e-3 * (1 - step / (steps + 1)),
               "tokens_per_sec": 1000 * scale + step}
        if step % 5 == 0:
            row["val_loss"] = row["loss"] + 0.1
        rows.append(row)
    (directory / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return directory


def _colour_pixels(image, rgb, tolerance=0.02):
    target = np.array(rgb) / 255
    return int((np.abs(image[..., :3] - target) < tolerance).all(-1).sum())


def test_plot_writes_a_png_with_every_run_drawn(tmp_path, cli_here):
    import matplotlib.image

    first, second = fake_run(tmp_path / "a", 20, 1.0), fake_run(tmp_path / "b", 30, 1.5, batch=16)
    out = tmp_path / "pictures" / "runs.png"
    result = cli_here("plot", first, second, "--out", out)
    assert result.returncode == 0, result.stderr[-2000:]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(out)
    assert image.shape[:2] == (1280 + 60, 1200)  # the panels, then a row of legend and a margin below them
    assert image[..., :3].std() > 0.05  # not blank
    assert _colour_pixels(image, BLUE) > 500 and _colour_pixels(image, ORANGE) > 500  # both runs' lines


def test_tokens_seen_follow_the_global_batch_and_window(tmp_path):
    from llm.plot import read_run

    run = read_run(fake_run(tmp_path / "a", 10, 1.0, batch=16, seq_len=64))
    xs, ys = run.points("val_loss", "tokens")
    assert xs == [5 * 16 * 64, 10 * 16 * 64] and len(ys) == 2
    dpo = fake_run(tmp_path / "dpo", 10, 1.0, batch=16, seq_len=64)  # a pair is two rows of data.seq_len, as the
    (dpo / "config.yaml").write_text("data:\n  seq_len: 64\ntrain:\n  stage: dpo\n  init_from: base\n")  # rows count
    assert read_run(dpo).points("val_loss", "tokens")[0] == [5 * 16 * 64 * 2, 10 * 16 * 64 * 2]


def test_a_folder_of_metrics_alone_is_drawn_where_its_rows_hold_their_tokens(tmp_path, cli_here):
    """metrics.jsonl copied off a cluster, without the run's config.yaml and ds_config.json: it was refused for the
    batch size that its rows' tokens make unneeded."""
    run = fake_run(tmp_path / "copied", 10, 1.0)
    rows = [{**json.loads(line), "tokens": 256 * n} for n, line in
            enumerate((run / "metrics.jsonl").read_text().splitlines(), 1)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (run / "config.yaml").unlink()
    (run / "ds_config.json").unlink()
    result = cli_here("plot", run, "--out", tmp_path / "x.png")
    assert result.returncode == 0, result.stderr
    from llm.plot import read_run

    assert read_run(run).points("val_loss", "tokens")[0] == [5 * 256, 10 * 256]
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")  # an earlier version's row
    assert cli_here("plot", run, "--out", tmp_path / "y.png").returncode == 2


def test_a_directory_without_metrics_is_a_one_line_error(tmp_path, cli_here):
    result = cli_here("plot", tmp_path, "--out", tmp_path / "x.png")
    assert result.returncode == 2 and "no metrics.jsonl" in result.stderr and "Traceback" not in result.stderr


def test_a_run_directory_that_does_not_exist_is_named_so(tmp_path, cli_here):
    """Was "no metrics.jsonl; is this a run directory made by `zerollm train`?"."""
    result = cli_here("plot", tmp_path / "nowhere", "--out", tmp_path / "x.png")
    assert result.returncode == 2 and result.stderr == f"zerollm: error: {tmp_path / 'nowhere'}: no such directory\n"


def test_without_matplotlib_plotting_is_a_one_line_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(UserError, match="pip install matplotlib"):
        plot_runs([fake_run(tmp_path / "a", 3, 1.0)], tmp_path / "x.png")


def test_a_torn_last_line_is_skipped_as_training_skips_it(tmp_path, capsys):
    from llm.plot import read_run

    run = fake_run(tmp_path / "a", 6, 1.0)
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 7, "loss": 1.2, "l')  # a killed run's last write; before, the whole run was refused
    assert read_run(run).points("loss", "step")[0] == [1, 2, 3, 4, 5, 6]
    assert "metrics.jsonl:7: skipped a line that is not a metrics row" in capsys.readouterr().err


def test_a_line_that_is_not_utf8_is_skipped_as_other_bad_lines(tmp_path, capsys):
    """Was a UnicodeDecodeError traceback."""
    from llm.plot import read_run

    run = fake_run(tmp_path / "a", 6, 1.0)
    with (run / "metrics.jsonl").open("ab") as f:
        f.write(b'{"step": 7, "loss": 1.0, "note": "\xff"}\n{"step": 8, "loss": 0.5}\n')
    xs, ys = read_run(run).points("loss", "step")
    assert xs == [1, 2, 3, 4, 5, 6, 8] and ys[-1] == 0.5
    note = f"zerollm: note: {run / 'metrics.jsonl'}:7: skipped a line that is not a metrics row\n"
    assert capsys.readouterr().err == note


def test_only_the_drawn_columns_are_kept(tmp_path):
    """Every row was kept whole as a dict: about 8 bytes of memory per byte of metrics.jsonl (1.5 GB for a million
    logged steps). Now the four drawn columns and the tokens seen, as arrays of 8-byte numbers."""
    import tracemalloc

    from llm.plot import PANELS, TOKENS, read_run

    run = fake_run(tmp_path / "a", 1, 1.0)
    extra = {f"metric/{i}": i / 3 for i in range(40)}
    with (run / "metrics.jsonl").open("w") as f:
        f.writelines(json.dumps({"step": step, "loss": 1.0, "lr": 1e-3, **extra}) + "\n" for step in range(1, 20001))
    tracemalloc.start()
    try:
        series = read_run(run)
        kept, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert set(series.columns) == {key for key, _ in PANELS} | {TOKENS}
    assert series.points("lr", "step") == (list(range(1, 20001)), [1e-3] * 20000)
    assert kept < 2_000_000, kept  # the rows as dicts: about 50 MB


def _drawn_figure(monkeypatch, runs, out):
    """Draw `runs` to `out`, returning the figure as it was saved."""
    from matplotlib.figure import Figure

    saved, savefig = [], Figure.savefig

    def keep(figure, *args, **options):
        saved.append(figure)
        savefig(figure, *args, **options)

    monkeypatch.setattr(Figure, "savefig", keep)
    plot_runs(runs, out)
    return saved[0]


def test_a_long_run_is_drawn_through_each_buckets_extremes(tmp_path, monkeypatch):
    """matplotlib kept every point given it, as lists of Python floats: two million rows took 871 MiB. A line of
    many points is drawn through each bucket's lowest and highest (every spike kept), in order."""
    from llm.plot import BUCKETS

    run = fake_run(tmp_path / "a", 1, 1.0)
    rows = 50_000
    losses = [2.0 + (step % 7) / 10 for step in range(1, rows + 1)]
    losses[31_337] = 9.5  # a spike
    with (run / "metrics.jsonl").open("w") as f:
        f.writelines(json.dumps({"step": step, "loss": loss, "tokens": step * 10}) + "\n"
                     for step, loss in enumerate(losses, start=1))
    figure = _drawn_figure(monkeypatch, [run], tmp_path / "x.png")
    by_step, by_tokens = (ax.get_lines()[0] for ax in figure.axes[:2])
    xs, ys = by_step.get_xdata(), by_step.get_ydata()
    assert len(xs) <= 2 * BUCKETS + 2 and list(xs) == sorted(xs) and (xs[0], xs[-1]) == (1, rows)
    assert max(ys) == 9.5 and xs[list(ys).index(9.5)] == 31_338 and min(ys) == 2.0
    assert list(by_tokens.get_xdata()) == [x * 10 for x in xs] and list(by_tokens.get_ydata()) == list(ys)


def test_a_line_of_up_to_twice_the_buckets_is_drawn_whole():
    from llm.plot import BUCKETS, thinned

    xs, ys = thinned(np.arange(2 * BUCKETS), np.zeros(2 * BUCKETS))  # a flat line: each bucket's extremes are alike
    assert len(xs) == len(ys) == 2 * BUCKETS


def test_rows_of_an_earlier_version_without_tokens_are_placed_by_the_batch_among_rows_with_them(tmp_path):
    """Rows that lack `tokens` (logged before they had it) before and after rows holding it: each row without one at
    its step times the recorded batch, each row with one at its own."""
    from llm.plot import read_run

    run = fake_run(tmp_path / "a", 1, 1.0, batch=8, seq_len=128)  # 1,024 positions a step
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 3.0}) + "\n"
                                       + json.dumps({"step": 2, "loss": 2.0, "tokens": 2000}) + "\n"
                                       + json.dumps({"step": 3, "loss": 1.0}) + "\n")
    assert read_run(run).points("loss", "tokens") == ([1024.0, 2000.0, 3072.0], [3.0, 2.0, 1.0])
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 3.0}) + "\n"
                                       + json.dumps({"step": 2, "loss": 2.0, "tokens": 2000}) + "\n")
    assert read_run(run).points("loss", "tokens") == ([1024.0, 2000.0], [3.0, 2.0])


def _legend_labels(figure):
    legends = [*figure.legends, *(ax.get_legend() for ax in figure.axes if ax.get_legend() is not None)]
    return [text.get_text() for legend in legends for text in legend.get_texts()]


def test_runs_in_folders_of_the_same_name_get_distinct_labels(tmp_path, monkeypatch):
    """p/x/run and p/y/run were both labelled "run"."""
    (tmp_path / "x").mkdir()
    (tmp_path / "y").mkdir()
    runs = [fake_run(tmp_path / "x" / "run", 6, 1.0), fake_run(tmp_path / "y" / "run", 6, 1.5),
            fake_run(tmp_path / "solo", 6, 2.0)]
    assert _legend_labels(_drawn_figure(monkeypatch, runs, tmp_path / "x.png")) == ["x/run", "y/run", "solo"]
    assert run_labels([Path("/x/run"), Path("/y/run")]) == ["x/run", "y/run"]  # the fewest folders that tell apart


def test_run_names_are_shown_as_written(tmp_path, monkeypatch):
    """A run folder named '_base' was left out of the legend, 'cost$5 and $6' was drawn as mathematics (italic
    'cost5and6'), and 'r$\\frac{$' was refused as metrics.jsonl files that are not intact."""
    names = ["_base", "cost$5 and $6", "r$\\frac{$"]
    runs = [fake_run(tmp_path / name, 6, 1.0 + i) for i, name in enumerate(names)]
    figure = _drawn_figure(monkeypatch, runs, tmp_path / "x.png")
    assert _legend_labels(figure) == ["_base", "cost\\$5 and \\$6", "r\\$\\frac{\\$"]  # a '$' escaped is a '$'
    assert (tmp_path / "x.png").stat().st_size > 0


def test_many_runs_differ_in_line_style_and_their_legend_is_below_every_panel(tmp_path, monkeypatch):
    """The 11th run had the 1st run's colour and style, and the legend of many runs hung over the first panel's
    curves and below it."""
    runs = [fake_run(tmp_path / f"run{i:02}", 6, 1.0 + i / 10) for i in range(14)]
    figure = _drawn_figure(monkeypatch, runs, tmp_path / "x.png")
    lines = figure.axes[0].get_lines()
    assert len({(line.get_color(), line.get_linestyle()) for line in lines}) == 14
    from matplotlib import rcParams

    colours = len(rcParams["axes.prop_cycle"])
    assert {line.get_linestyle() for line in lines[:colours]} == {"-"}  # another style once the colours are used up
    (legend,) = figure.legends
    legend_top = legend.get_window_extent().y1
    assert all(legend_top < ax.get_tightbbox().y0 for ax in figure.axes)  # titles, ticks and labels included
    assert len(legend.get_texts()) == 14


def test_a_panel_without_data_says_so(tmp_path, monkeypatch):
    """A run with no evaluation and no throughput got empty frames with axes from -0.04 to 0.04."""
    run = fake_run(tmp_path / "a", 4, 1.0)  # no val_loss before step 5
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0, "lr": 1e-3}) + "\n"
                                               for s in range(1, 5)))
    figure = _drawn_figure(monkeypatch, [run], tmp_path / "x.png")
    said = {ax.get_title(): [text.get_text() for text in ax.texts] for ax in figure.axes}
    assert said == {"training loss by step": [], "training loss by tokens seen": [],
                    "validation loss by step": ["no data"], "validation loss by tokens seen": ["no data"],
                    "learning rate by step": [], "learning rate by tokens seen": [],
                    "throughput (tokens/s) by step": ["no data"], "throughput (tokens/s) by tokens seen": ["no data"]}


def test_the_picture_file_is_checked_before_drawing(tmp_path, cli_here):
    run = fake_run(tmp_path / "a", 6, 1.0)
    bad = cli_here("plot", run, "--out", tmp_path / "x.txt")  # a matplotlib traceback before
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.startswith(f"zerollm: error: --out {tmp_path / 'x.txt'}: matplotlib cannot write .txt pictures")
    (tmp_path / "pictures").mkdir()
    folder = cli_here("plot", run, "--out", tmp_path / "pictures")  # before: said it wrote the folder, wrote beside it
    assert folder.returncode == 2 and "is a directory; give a file such as" in folder.stderr
    plain = cli_here("plot", run, "--out", tmp_path / "curves")
    assert plain.returncode == 0 and plain.stdout == f"wrote {tmp_path / 'curves.png'}\n"
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"
    suffix = cli_here("plot", run, "--out", tmp_path / "pictures" / ".png")  # wrote pictures/.png.png
    assert suffix.returncode == 2 and suffix.stderr == (f"zerollm: error: --out {tmp_path / 'pictures' / '.png'} is a "
                                                        "suffix without a file name; give a file such as "
                                                        f"{tmp_path / 'pictures' / 'runs.png'}\n")
    assert list((tmp_path / "pictures").iterdir()) == []


def test_a_format_whose_program_is_missing_is_one_line(tmp_path, monkeypatch, cli_here):
    """matplotlib lists .pgf among what it writes, but writes it through LaTeX: a RuntimeError traceback without."""
    run = fake_run(tmp_path / "a", 6, 1.0)
    monkeypatch.setenv("PATH", str(tmp_path))  # no xelatex there
    result = cli_here("plot", run, "--out", tmp_path / "x.pgf")
    assert result.returncode == 2 and result.stderr.startswith(
        f"zerollm: error: --out {tmp_path / 'x.pgf'}: matplotlib cannot write .pgf pictures here ('xelatex' not found")
    assert result.stderr.count("\n") == 1 and not (tmp_path / "x.pgf").exists()


def test_values_that_are_not_numbers_are_not_drawn(tmp_path, cli_here):
    """Strings were drawn as categories in the order they came ("9" above "1" above "5"), exit 0; a list was a numpy
    traceback."""
    from llm.plot import read_run

    run = fake_run(tmp_path / "a", 6, 1.0)
    with (run / "metrics.jsonl").open("a") as f:
        for step, loss in enumerate(["9", True, [1, 2], None, float("inf"), 2.5], start=7):
            f.write(json.dumps({"step": step, "loss": loss}) + "\n")
        f.write(json.dumps({"step": True, "loss": 3.0}) + "\n")  # was drawn as step 1
        f.write(json.dumps({"step": 13, "loss": 10**400}) + "\n")  # an int beyond any float: OverflowError
        f.write(json.dumps({"step": 2**63, "loss": 1.0}) + "\n")  # beyond a 64-bit step: OverflowError
    xs, ys = read_run(run).points("loss", "step")
    assert xs == [1, 2, 3, 4, 5, 6, 12] and ys[-1] == 2.5
    assert cli_here("plot", run, "--out", tmp_path / "x.png").returncode == 0


@pytest.mark.parametrize("damage, message", [
    (lambda run: (run / "ds_config.json").unlink(), "ds_config.json: cannot read the run's train_batch_size"),
    (lambda run: (run / "ds_config.json").write_text('{"train_batch_size": "8"}'), "are not positive integers"),
    (lambda run: (run / "metrics.jsonl").write_text('{"step": 1, "loss": 1e308, "lr": 1e-300}\n'
                                                     '{"step": 2, "loss": -1e308, "lr": 1e-300}\n'),
     "cannot draw these metrics"),
    # a config.yaml cut short before its data section, or holding none of it: KeyError
    (lambda run: (run / "config.yaml").write_text("model:\n  dim: 64\n"), "data.seq_len None are not positive"),
    (lambda run: (run / "config.yaml").write_text("data: {}\n"), "data.seq_len None are not positive"),
])
def test_damaged_runs_are_one_line(tmp_path, damage, message, cli_here):
    """Each was a traceback: FileNotFoundError, a str times an int, matplotlib's ValueError."""
    run = fake_run(tmp_path / "a", 6, 1.0)
    damage(run)
    result = cli_here("plot", run, "--out", tmp_path / "x.png")
    assert result.returncode == 2 and message in result.stderr and result.stderr.count("\n") == 1, result.stderr


def test_an_out_below_a_file_is_one_line(tmp_path, cli_here):
    run = fake_run(tmp_path / "a", 6, 1.0)
    result = cli_here("plot", run, "--out", run / "config.yaml" / "x.png")
    assert result.returncode == 2 and result.stderr == (f"zerollm: error: --out {run / 'config.yaml' / 'x.png'}: "
                                                        f"cannot write it ({run / 'config.yaml'} is a file, not a "
                                                        "directory)\n"), result.stderr


def test_a_failed_write_leaves_the_earlier_picture_and_no_partial_file(tmp_path):
    """A full disk left a 0-byte picture in place of the earlier one."""
    run = fake_run(tmp_path / "a", 6, 1.0)
    out = tmp_path / "pictures" / "x.png"
    out.parent.mkdir()
    out.write_bytes(b"the earlier picture")
    with file_size_limit(10_000), pytest.raises(UserError) as error:  # the picture is larger
        plot_runs([run], out)
    assert str(error.value) == f"--out {out}: cannot write it ({os.strerror(errno.EFBIG)})"
    assert out.read_bytes() == b"the earlier picture" and list(out.parent.iterdir()) == [out]


def test_a_run_whose_rows_hold_null_is_drawn_without_those_points(tmp_path, cli_here):
    """metrics.jsonl writes a value that is not a finite number as null (an unknown GPU's MFU, a skipped fp16
    step's gradient norm): the plot leaves that point out and draws the rest."""
    from llm.config import build_config
    from llm.plot import read_run
    from llm.train.metrics import MetricsSink

    run = fake_run(tmp_path / "a", 4, 1.0)
    (run / "metrics.jsonl").unlink()
    sink = MetricsSink(run, build_config("demo"), "run", start_step=0)
    for step, loss in enumerate([3.0, float("nan"), 2.0, 1.5], start=1):
        sink.log({"step": step, "loss": loss, "lr": 1e-3, "grad_norm": float("inf"), "mfu": float("nan"),
                  "tokens_per_sec": 1000.0 + step})
    assert read_run(run).points("loss", "step") == ([1, 3, 4], [3.0, 2.0, 1.5])
    out = tmp_path / "runs.png"
    result = cli_here("plot", run, "--out", out)
    assert result.returncode == 0, result.stderr[-2000:]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "Traceback" not in result.stderr


def test_a_step_logged_again_supersedes_the_earlier_rows_from_it_on(tmp_path):
    """Steps going backwards (rows appended after an edit or by hand) were drawn as a line zig-zagging back."""
    from llm.plot import read_run

    run = fake_run(tmp_path / "a", 1, 1.0)
    rows = [{"step": s, "loss": float(s)} for s in (1, 2, 3, 4)] + [{"step": 4, "val_loss": 9.0}] + \
        [{"step": s, "loss": 10.0 + s} for s in (3, 4, 5)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    series = read_run(run)
    assert series.points("loss", "step") == ([1, 2, 3, 4, 5], [1.0, 2.0, 13.0, 14.0, 15.0])
    assert series.points("val_loss", "step") == ([], [])  # step 4 logged again without one: its old point is gone
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [{"step": 1, "loss": 3.0},
                                                                             {"step": 2, "loss": 2.9},
                                                                             {"step": 2, "loss": 2.5}]))
    assert read_run(run).points("loss", "step") == ([1, 2], [3.0, 2.5])  # the same step again: the latest row


@pytest.mark.parametrize("metrics", [None, ""])
def test_a_run_that_has_not_logged_yet_is_noted_and_the_others_drawn(tmp_path, capsys, metrics):
    """A run still before its first logged step (no metrics.jsonl yet, or an empty one) refused the whole picture,
    saying it was perhaps not a run directory."""
    fresh = fake_run(tmp_path / "fresh", 1, 1.0)
    (fresh / "metrics.jsonl").unlink()
    if metrics is not None:
        (fresh / "metrics.jsonl").write_text(metrics)
    out = plot_runs([fake_run(tmp_path / "a", 10, 1.0), fresh], tmp_path / "x.png")
    assert capsys.readouterr().err == f"zerollm: note: {fresh}: no logged steps yet; fresh has no line\n"
    assert out.stat().st_size > 0


def test_a_run_with_nothing_to_draw_is_noted(tmp_path, capsys):
    """Such a run got a legend entry and no line anywhere, without a word."""
    from llm.plot import read_run

    run = fake_run(tmp_path / "a", 1, 1.0)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.5}) + "\n")
    read_run(run)
    assert capsys.readouterr().err == (f"zerollm: note: {run / 'metrics.jsonl'}: no row holds a number as loss, "
                                       "val_loss, lr, tokens_per_sec; a has no line\n")
