"""The jsonl files a run appends to (metrics.jsonl, samples.jsonl, run_record.jsonl) after a kill cut their last
line, even in the middle of a UTF-8 character; wandb refused in one line when it cannot start."""

import errno
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import REPO, train_args
from llm import rundir
from llm.config import WandbConfig, build_config
from llm.errors import UserError
from llm.train.metrics import MetricsSink

TORN = '{"step": 6, "prompt": "从'.encode()[:-1]  # cut inside the last character, as a kill mid-write leaves it


def _config(wandb_mode="off"):
    cfg = build_config("demo")
    cfg.wandb.mode = wandb_mode
    return cfg


@pytest.mark.parametrize("name", [rundir.METRICS_FILE, rundir.SAMPLES_FILE])
def test_a_last_line_torn_mid_character_is_dropped_and_named(tmp_path, capsys, name):
    """Was a UnicodeDecodeError traceback on every resume."""
    rows = [json.dumps({"step": step, "prompt": "从前有座山，\u2028", "completion": "x"}, ensure_ascii=False)
            for step in (1, 2, 3)]  # U+2028, written as is, does not end a line
    path = tmp_path / name
    path.write_bytes(("\n".join(rows) + "\n").encode() + TORN)
    MetricsSink(tmp_path, _config(), "run", start_step=2)
    assert path.read_text(encoding="utf-8") == rows[0] + "\n" + rows[1] + "\n"
    assert capsys.readouterr().err == (f"zerollm: note: {path}:4: dropped a line that is not a row of a step (torn by "
                                       "a killed run)\n")


@pytest.mark.parametrize("name", [rundir.METRICS_FILE, rundir.SAMPLES_FILE])
def test_a_full_disk_while_logging_is_one_line_and_leaves_no_torn_row(tmp_path, monkeypatch, name):
    """An OSError traceback in the middle of training, the file ending in a torn row."""
    sink = MetricsSink(tmp_path, _config(), "run", start_step=0)
    row = {"step": 1, "loss": 2.0, "prompt": "p", "completion": "c"}
    log = {rundir.METRICS_FILE: lambda step: sink.log({**row, "step": step}),
           rundir.SAMPLES_FILE: lambda step: sink.log_samples(step, [{**row, "step": step}])}[name]
    log(1)
    before = (tmp_path / name).read_bytes()
    write = os.write

    def half_then_full(fd, data):  # the disk fills midway through the row
        if len(data) > 4:
            return write(fd, data[:len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", half_then_full)
    with pytest.raises(UserError) as error:
        log(2)
    assert str(error.value) == (f"{tmp_path}: no space left on device while writing step 2 to {name}; {name} is as "
                                "it was, but the steps trained since the newest checkpoint are not saved (a resume "
                                "trains them again): free space and rerun with --resume auto, which continues from "
                                "the newest checkpoint")  # it said "nothing was lost"
    assert (tmp_path / name).read_bytes() == before


def _record(session):
    return {"command": f"zerollm train 实验 {session}", "data": {"digest": "d"}}


def test_a_run_record_torn_mid_character_is_dropped_and_the_next_record_has_a_line_of_its_own(tmp_path, capsys):
    """Was a UnicodeDecodeError traceback on every resume (an ASCII torn line: 'the file is damaged'), and the next
    session's record would have been appended to the torn line."""
    from llm.train.run_record import last_record, write_run_record

    path = tmp_path / rundir.RUN_RECORD_FILE
    write_run_record(tmp_path, _record(1))
    with path.open("ab") as f:
        f.write('{"command": "zerollm train 实'.encode()[:-1])
    assert last_record(tmp_path) == _record(1)
    write_run_record(tmp_path, _record(2))
    assert capsys.readouterr().err == (f"zerollm: note: {path}:2: dropped a line that is not a run record (torn by a "
                                       "killed run)\n")
    assert [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()] == [_record(1), _record(2)]
    assert last_record(tmp_path) == _record(2)


def test_a_damaged_line_that_a_newline_ends_is_still_refused(tmp_path):
    """Only a last line without its newline was being written when a kill came; any other is damage."""
    from llm.train.run_record import last_record

    (tmp_path / rundir.RUN_RECORD_FILE).write_bytes(json.dumps(_record(1)).encode() + b"\n" + TORN + b"\n")
    with pytest.raises(UserError, match=r"run_record.jsonl:2: not a run record \(the file is damaged\)"):
        last_record(tmp_path)


def test_wandb_online_without_an_api_key_is_one_line_before_anything_is_written(pretrain_data, tmp_path):
    """Was wandb's UsageError traceback after the run directory had been written (config, tokenizer, a record of a
    session that trained nothing); checked without the network."""
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items()
           if k not in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_CONFIG_DIR", "NETRC")}
    out = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "llm", *map(str, train_args(pretrain_data, out, "train.max_steps=1",
                                                                               extra=["--wandb", "online"]))],
                            capture_output=True, text=True, cwd=REPO, env={**env, "HOME": str(home)}, timeout=600,
                            check=False)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == ("zerollm: error: wandb: no API key configured; run `wandb "
                                                     "login`, set WANDB_API_KEY, or pass --wandb offline"), \
        result.stderr[-3000:]
    assert "Traceback" not in result.stderr and result.stderr.count("zerollm: error:") == 1
    assert not out.exists() and list(home.iterdir()) == []


def test_wandb_that_cannot_start_is_one_line(tmp_path, monkeypatch):
    """No network: wandb.init raised CommError (after a 100 s wait) through the training job as a traceback."""
    import wandb

    def unreachable(**options):
        raise wandb.errors.CommError("Run initialization has timed out after 90.0 sec.\nPlease try again.")

    monkeypatch.setattr(wandb, "init", unreachable)
    with pytest.raises(UserError) as refused:
        MetricsSink(tmp_path, _config("online"), "run", start_step=0)
    assert str(refused.value) == ("wandb: cannot start the online run (Run initialization has timed out after 90.0 "
                                  "sec); check the network and `wandb login`, or pass --wandb offline (and `wandb "
                                  "sync` its folder later)")


@pytest.mark.parametrize("variable, value, said", [
    ("WANDB_MODE", "bogus", "wandb cannot read WANDB_MODE='bogus' (Input should be 'online', 'offline', 'shared', "
                            "'disabled', 'dryrun' or 'run'); correct or unset it"),
    ("WANDB_INIT_TIMEOUT", "abc", "wandb cannot read WANDB_INIT_TIMEOUT='abc' (Input should be a valid number, unable "
                                  "to parse string as a number); correct or unset it"),
    ("WANDB_INIT_TIMEOUT", "true", "wandb cannot read WANDB_INIT_TIMEOUT='true' (Input should be a valid number, "
                                   "unable to parse string as a number); correct or unset it"),  # not WANDB_SILENT
    ("WANDB_PROJECT", "a/b", "wandb cannot read WANDB_PROJECT='a/b' (Invalid project name 'a/b': cannot contain "
                             "characters '/,\\\\,#,?,%,:', found '/'); correct or unset it"),
])
def test_a_wandb_variable_wandb_cannot_read_is_one_line(monkeypatch, tmp_path, variable, value, said):
    """Was pydantic's ValidationError traceback, after the run directory was written (with --nproc 2: exit 76 and
    'start the job again with --resume auto')."""
    from llm.train.metrics import check_wandb

    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv(variable, value)
    with pytest.raises(UserError) as refused:
        check_wandb(WandbConfig(mode="offline"), tmp_path)
    assert str(refused.value) == said


@pytest.mark.parametrize("package, said", [
    ({"wandb/__init__.py": "raise TypeError('Descriptors cannot be created directly.')"},  # protobuf's, classic
     "^wandb cannot be imported \\(TypeError: Descriptors cannot be created directly\\); reinstall it"),
    ({"wandb/__init__.py": "from os import does_not_exist_here"},  # was 'wandb is not installed'
     "^wandb cannot be imported \\(ImportError: cannot import name 'does_not_exist_here'"),
    ({"wandb/__init__.py": "import no_such_dependency_of_wandb"},
     "^wandb cannot be imported \\(ModuleNotFoundError: No module named 'no_such_dependency_of_wandb'\\)"),
    ({"wandb.py": "x = 1"}, "^the module wandb found at .*wandb.py is not wandb's \\(a file or folder of yours named "
                            "wandb\\?\\); rename it, or use --wandb off$"),  # an AttributeError traceback
])
def test_a_wandb_that_cannot_be_used_is_one_line(monkeypatch, tmp_path, package, said):
    from llm.train.metrics import import_wandb

    for name, text in package.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    with pytest.raises(UserError, match=said):
        import_wandb()
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed
    with pytest.raises(UserError, match="^wandb is not installed; `pip install wandb` or use --wandb off$"):
        import_wandb()


def test_a_project_name_wandb_refuses_is_one_line_naming_the_key(tmp_path):
    """It was said as 'cannot start the offline run (...); check the network and `wandb login`', once the run
    directory was written."""
    from llm.train.metrics import check_wandb

    with pytest.raises(UserError, match="^wandb.project: Invalid project name 'a/b': cannot contain characters"):
        check_wandb(WandbConfig(mode="offline", project="a/b"), tmp_path)
    check_wandb(WandbConfig(mode="off", project="a/b"), tmp_path)  # not logged to wandb: not read


def test_a_file_where_the_run_keeps_its_wandb_folder_is_one_line(tmp_path):
    """A NotADirectoryError traceback; with --wandb off such a file is left alone."""
    from llm.train.metrics import check_wandb

    (tmp_path / "wandb").write_text("notes")
    with pytest.raises(UserError) as refused:
        check_wandb(WandbConfig(mode="offline"), tmp_path)
    assert str(refused.value) == f"--out {tmp_path}: {tmp_path / 'wandb'} is a file where wandb keeps its folder; " \
                                 "move it away"
    check_wandb(WandbConfig(mode="off"), tmp_path)


class _Run:
    """What MetricsSink uses of a wandb run, recording it."""

    def __init__(self, **options):
        self.options, self.exit_codes, self.config = options, [], SimpleNamespace(update=lambda *a, **k: None)

    def finish(self, exit_code=None):
        self.exit_codes.append(exit_code)


def test_the_wandb_run_records_the_exit_code_and_the_folder_s_own_name(tmp_path, monkeypatch):
    """A run that diverged (exit 2) or was stopped (75) was recorded as exit 0; `--out .` named the run ''."""
    import wandb

    monkeypatch.setattr(wandb, "init", _Run)
    monkeypatch.chdir(tmp_path)
    sink = MetricsSink(Path("."), _config("offline"), "run", start_step=0)
    run = sink.wandb_run
    assert run.options["name"] == tmp_path.name
    sink.close(75)
    sink.close(75)  # again, from the training thread after a forced exit's: the run is ended once
    assert run.exit_codes == [75] and sink.wandb_run is None


def test_wandb_project_and_name_come_from_the_variables_hugging_face_users_set(tmp_path, monkeypatch):
    """WANDB_PROJECT and WANDB_NAME (how Hugging Face's Trainer and TRL name a run) were overridden without a word:
    the run went to project 'zerollm' under its folder's name. The config's own keys still come first."""
    import wandb

    monkeypatch.setattr(wandb, "init", _Run)
    monkeypatch.setenv("WANDB_PROJECT", "myproj")
    monkeypatch.setenv("WANDB_NAME", "myname")
    options = MetricsSink(tmp_path, _config("offline"), "run", start_step=0).wandb_run.options
    assert (options["project"], options["name"]) == ("myproj", "myname")
    cfg = _config("offline")
    cfg.wandb.project, cfg.wandb.name = "mine", "first"
    options = MetricsSink(tmp_path, cfg, "run", start_step=0).wandb_run.options
    assert (options["project"], options["name"]) == ("mine", "first")
    monkeypatch.delenv("WANDB_PROJECT")
    monkeypatch.delenv("WANDB_NAME")
    options = MetricsSink(tmp_path, _config("offline"), "run", start_step=0).wandb_run.options
    assert (options["project"], options["name"]) == ("zerollm", tmp_path.name)


def test_a_resumed_wandb_run_keeps_the_project_and_name_it_started_with(pretrain_data, tmp_path, monkeypatch):
    """WANDB_PROJECT and WANDB_NAME were read again at each session and never recorded: a resume from a shell with
    other values sent the same run id to another project."""
    from llm.runtime.distributed import DistInfo
    from llm.train import job

    cfg = build_config("demo", ["wandb.mode=offline", "model.vocab_size=512"], paths={"data.path": str(pretrain_data)})
    monkeypatch.setenv("WANDB_PROJECT", "first")
    info = DistInfo(0, 0, 1, 1, torch.device("cpu"))
    ds = ({}, "ds.json")
    resolved = job._resolved_ds_config(cfg, tmp_path, info, ds, None, False, {}, {"tokenizer_hash": "x"})
    assert (cfg.wandb.project, cfg.wandb.name) == ("first", tmp_path.name)
    cfg.save(tmp_path / "config.yaml")
    (tmp_path / "ds_config.json").write_text(json.dumps(resolved))
    monkeypatch.setenv("WANDB_PROJECT", "second")
    again = build_config("demo", ["wandb.mode=offline", "model.vocab_size=512"],
                         paths={"data.path": str(pretrain_data)})
    monkeypatch.setattr(job, "check_same_data", lambda *args: None)
    job._resolved_ds_config(again, tmp_path, info, ds, None, True, {}, {"tokenizer_hash": "x"})
    assert (again.wandb.project, again.wandb.name) == ("first", tmp_path.name)
    # a session with wandb off between two with it: it recorded no project, and the next one logged the same run
    # id to WANDB_PROJECT's; its resume said "wandb.project first there, None here", a setting the user never gave
    off = build_config("demo", ["model.vocab_size=512"], paths={"data.path": str(pretrain_data)})
    job._resolved_ds_config(off, tmp_path, info, ds, None, True, {}, {"tokenizer_hash": "x"})
    assert (off.wandb.project, off.wandb.name) == ("first", tmp_path.name)
    assert job.resumed_changes(again, off) == ["wandb.mode offline there, off here"]
    off.save(tmp_path / "config.yaml")
    on = build_config("demo", ["wandb.mode=offline", "model.vocab_size=512"], paths={"data.path": str(pretrain_data)})
    job._resolved_ds_config(on, tmp_path, info, ds, None, True, {}, {"tokenizer_hash": "x"})
    assert (on.wandb.project, on.wandb.name) == ("first", tmp_path.name)
    fresh = build_config("demo", ["model.vocab_size=512"], paths={"data.path": str(pretrain_data)})
    job._resolved_ds_config(fresh, tmp_path / "new", info, ds, None, False, {}, {"tokenizer_hash": "x"})
    assert (fresh.wandb.project, fresh.wandb.name) == (None, None)  # a run never logged names none


def test_an_offline_run_that_cannot_start_is_not_told_to_check_the_network(tmp_path, monkeypatch):
    import wandb

    def broken(**options):
        raise ValueError("invalid literal for int() with base 10: 'junk'")

    monkeypatch.setattr(wandb, "init", broken)
    with pytest.raises(UserError) as refused:
        MetricsSink(tmp_path, _config("offline"), "run", start_step=0)
    assert str(refused.value) == ("wandb: cannot start the offline run (invalid literal for int() with base 10: "
                                  "'junk'); check the WANDB_* variables, or pass --wandb off")


def test_a_wandb_key_of_the_wrong_form_is_one_line(monkeypatch, tmp_path):
    from llm.train.metrics import check_wandb

    monkeypatch.setenv("WANDB_API_KEY", "short")
    with pytest.raises(UserError) as refused:
        check_wandb(WandbConfig(mode="online"), tmp_path)
    assert str(refused.value) == ("wandb: WANDB_API_KEY invalid: API key must have 40+ characters, has 5; run `wandb "
                                  "login`, or pass --wandb offline")
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    check_wandb(WandbConfig(mode="online"), tmp_path)


def test_a_wandb_without_its_credential_helpers_leaves_the_key_to_wandb_init(monkeypatch, tmp_path):
    """Older wandb releases (pyproject allows 0.18) have no wandb.sdk.lib.wbauth: no check, no traceback."""
    import wandb.sdk.lib

    from llm.train.metrics import check_wandb

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setitem(sys.modules, "wandb.sdk.lib.wbauth", None)
    monkeypatch.delattr(wandb.sdk.lib, "wbauth")
    check_wandb(WandbConfig(mode="online"), tmp_path)


def _refuse(constant):
    raise ValueError(f"{constant} is not JSON")


def test_a_value_that_is_not_a_finite_number_is_written_as_null(tmp_path):
    """The MFU of a GPU with no known peak (NaN) and the gradient norm of an fp16 step DeepSpeed skipped (inf) were
    written as bare NaN / Infinity: not JSON to jq, JavaScript or pandas' strict readers. Null, as `eval --json`."""
    sink = MetricsSink(tmp_path, _config(), "run", start_step=0)
    sink.log({"step": 1, "loss": 2.5, "lr": 1e-3, "grad_norm": float("inf"), "mfu": float("nan"),
              "reward/std": float("-inf"), "epoch": 0})
    sink.log({"step": 2, "loss": 2.25, "lr": 1e-3, "grad_norm": 0.5, "mfu": 0.25, "epoch": 0})
    lines = (tmp_path / rundir.METRICS_FILE).read_text().splitlines()
    rows = [json.loads(line, parse_constant=_refuse) for line in lines]
    assert rows[0] == {"step": 1, "loss": 2.5, "lr": 1e-3, "grad_norm": None, "mfu": None, "reward/std": None,
                       "epoch": 0}
    assert rows[1]["grad_norm"] == 0.5 and rows[1]["mfu"] == 0.25
    MetricsSink(tmp_path, _config(), "run", start_step=1)  # a resume from step 1 keeps its row, drops step 2's
    assert (tmp_path / rundir.METRICS_FILE).read_text().splitlines() == lines[:1]


def test_the_wandb_config_is_the_config_the_run_directory_records(pretrain_data, tmp_path, monkeypatch):
    """wandb's config held the base and the teacher as given (`--init-from base`), config.yaml their absolute paths:
    two records of one run that disagreed."""
    import wandb

    from llm.train import job

    given = {}
    run_stub = SimpleNamespace(config=SimpleNamespace(update=lambda *args, **kwargs: None), finish=lambda **_: None)
    monkeypatch.setattr(wandb, "init", lambda **kwargs: given.update(kwargs) or run_stub)
    monkeypatch.chdir(tmp_path)
    cfg = build_config("demo", ["train.stage=sft", "wandb.mode=offline"],
                       {"data.path": str(pretrain_data), "train.init_from": "base"})
    run = tmp_path / "run"
    job._start_files(cfg, run, {"train_batch_size": 8}, SimpleNamespace(run_id="abc123", step=0), {"k": 1}).close(0)
    assert given["config"]["train"]["init_from"] == str(tmp_path / "base")
    assert given["config"] == build_config(str(run / "config.yaml")).to_dict()


def test_a_wandb_data_folder_that_cannot_be_written_is_one_line(monkeypatch, tmp_path):
    """wandb stages the samples' tables in its data folder (in the home folder by default): under a read-only home
    the run ended at its first evaluation with a PermissionError traceback, before its first checkpoint."""
    from llm.train.metrics import check_wandb

    (tmp_path / "afile").write_text("")
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "afile" / "wandb"))
    with pytest.raises(UserError) as refused:
        check_wandb(WandbConfig(mode="offline"), tmp_path / "run")
    assert str(refused.value) == (f"wandb cannot write its data folder {tmp_path / 'afile' / 'wandb'} "
                                  "(WANDB_DATA_DIR), where it stages the samples' tables; set WANDB_DATA_DIR to a "
                                  "folder it can write, or use --wandb off")
    check_wandb(WandbConfig(mode="off"), tmp_path / "run")
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "data"))
    check_wandb(WandbConfig(mode="offline"), tmp_path / "run")
