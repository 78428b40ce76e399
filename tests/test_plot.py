"""`zerollm plot`: a picture of several runs' curves from their metrics.jsonl."""

import errno
import json
import os
import sys

import numpy as np
import pytest

from conftest import run_cli
from llm.errors import UserError
from llm.plot import plot_runs

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


def test_plot_writes_a_png_with_every_run_drawn(tmp_path):
    import matplotlib.image

    first, second = fake_run(tmp_path / "a", 20, 1.0), fake_run(tmp_path / "b", 30, 1.5, batch=16)
    out = tmp_path / "pictures" / "runs.png"
    result = run_cli("plot", first, second, "--out", out)
    assert result.returncode == 0, result.stderr[-2000:]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(out)
    assert image.shape[:2] == (1280, 1200)
    assert image[..., :3].std() > 0.05  # not blank
    assert _colour_pixels(image, BLUE) > 500 and _colour_pixels(image, ORANGE) > 500  # both runs' lines


def test_tokens_seen_follow_the_global_batch_and_window(tmp_path):
    from llm.plot import read_run

    run = read_run(fake_run(tmp_path / "a", 10, 1.0, batch=16, seq_len=64))
    xs, ys = run.points("val_loss", "tokens")
    assert xs == [5 * 16 * 64, 10 * 16 * 64] and len(ys) == 2


def test_a_directory_without_metrics_is_a_one_line_error(tmp_path):
    result = run_cli("plot", tmp_path, "--out", tmp_path / "x.png")
    assert result.returncode == 2 and "no metrics.jsonl" in result.stderr and "Traceback" not in result.stderr


def test_without_matplotlib_plotting_is_a_one_line_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(UserError, match="pip install matplotlib"):
        plot_runs([fake_run(tmp_path / "a", 3, 1.0)], tmp_path / "x.png")


def test_a_torn_last_line_is_skipped_as_training_skips_it(tmp_path, capsys):
    from llm.plot import read_run

    run = fake_run(tmp_path / "a", 6, 1.0)
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 7, "loss": 1.2, "l')  # a killed run's last write; before, the whole run was refused
    assert [row["step"] for row in read_run(run).rows] == [1, 2, 3, 4, 5, 6]
    assert "metrics.jsonl:7: skipped a line that is not a metrics row" in capsys.readouterr().err


def test_the_picture_file_is_checked_before_drawing(tmp_path):
    run = fake_run(tmp_path / "a", 6, 1.0)
    bad = run_cli("plot", run, "--out", tmp_path / "x.txt")  # a matplotlib traceback before
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.startswith(f"zerollm: error: --out {tmp_path / 'x.txt'}: matplotlib cannot write .txt pictures")
    (tmp_path / "pictures").mkdir()
    folder = run_cli("plot", run, "--out", tmp_path / "pictures")  # before: said it wrote the folder, wrote beside it
    assert folder.returncode == 2 and "is a directory; give a file such as" in folder.stderr
    plain = run_cli("plot", run, "--out", tmp_path / "curves")
    assert plain.returncode == 0 and plain.stdout == f"wrote {tmp_path / 'curves.png'}\n"
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"


def test_values_that_are_not_numbers_are_not_drawn(tmp_path):
    """Strings were drawn as categories in the order they came ("9" above "1" above "5"), exit 0; a list was a numpy
    traceback."""
    from llm.plot import read_run

    run = fake_run(tmp_path / "a", 6, 1.0)
    with (run / "metrics.jsonl").open("a") as f:
        for step, loss in enumerate(["9", True, [1, 2], None, float("inf"), 2.5], start=7):
            f.write(json.dumps({"step": step, "loss": loss}) + "\n")
        f.write(json.dumps({"step": True, "loss": 3.0}) + "\n")  # was drawn as step 1
    xs, ys = read_run(run).points("loss", "step")
    assert xs == [1, 2, 3, 4, 5, 6, 12] and ys[-1] == 2.5
    assert run_cli("plot", run, "--out", tmp_path / "x.png").returncode == 0


@pytest.mark.parametrize("damage, message", [
    (lambda run: (run / "ds_config.json").unlink(), "ds_config.json: cannot read the run's train_batch_size"),
    (lambda run: (run / "ds_config.json").write_text('{"train_batch_size": "8"}'), "are not positive integers"),
    (lambda run: (run / "metrics.jsonl").write_text('{"step": 1, "loss": 1e308, "lr": 1e-300}\n'
                                                     '{"step": 2, "loss": -1e308, "lr": 1e-300}\n'),
     "cannot draw these metrics"),
])
def test_damaged_runs_are_one_line(tmp_path, damage, message):
    """Each was a traceback: FileNotFoundError, a str times an int, matplotlib's ValueError."""
    run = fake_run(tmp_path / "a", 6, 1.0)
    damage(run)
    result = run_cli("plot", run, "--out", tmp_path / "x.png")
    assert result.returncode == 2 and message in result.stderr and result.stderr.count("\n") == 1, result.stderr


def test_an_out_below_a_file_is_one_line(tmp_path):
    run = fake_run(tmp_path / "a", 6, 1.0)
    result = run_cli("plot", run, "--out", run / "config.yaml" / "x.png")
    assert result.returncode == 2 and result.stderr == (f"zerollm: error: --out {run / 'config.yaml' / 'x.png'}: "
                                                        f"cannot write it ({run / 'config.yaml'} is a file, not a "
                                                        "directory)\n"), result.stderr


def test_a_failed_write_leaves_the_earlier_picture_and_no_partial_file(tmp_path, monkeypatch):
    """A full disk left a 0-byte picture in place of the earlier one."""
    from matplotlib.figure import Figure

    run = fake_run(tmp_path / "a", 6, 1.0)
    out = tmp_path / "pictures" / "x.png"
    out.parent.mkdir()
    out.write_bytes(b"the earlier picture")

    def disk_full(figure, path, **options):
        open(path, "wb").close()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(Figure, "savefig", disk_full)
    with pytest.raises(UserError, match=r"x.png: cannot write it \(No space left on device\)$"):
        plot_runs([run], out)
    assert out.read_bytes() == b"the earlier picture" and list(out.parent.iterdir()) == [out]
