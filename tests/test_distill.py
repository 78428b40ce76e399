"""Distillation (`zerollm train distill`): the loss, the teacher's checks, and tiny students trained against a tiny
pretrained teacher on one rank and on two under ZeRO-3, resumed exactly."""

from __future__ import annotations

import json
import math
import re
import shutil

import pytest
import torch
import torch.nn.functional as F
import yaml
from forked_ranks import run_job

from conftest import FIXTURES, TINY, train_args, zerollm_here
from llm import rundir
from llm.config import build_config
from llm.data.prepare import prepare
from llm.data.prepared import read_data_attrs
from llm.errors import UserError
from llm.loading import consolidated_weights, initial_weights, load_model_dir, weights_summary
from llm.model.token_losses import distillation_loss, masked_cross_entropy
from llm.runtime.fingerprint import fingerprint, mismatch_message
from llm.tokenizer import Tokenizer, train_tokenizer
from llm.train.run_record import check_same_weights
from llm.train.teacher import check_teacher

STUDENT = ["model.dim=32", "model.n_layers=1", "train.precision=fp32"]
"""Half the teacher's width, half its depth (TINY is the teacher)."""


def _metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _distill_args(data, out, teacher, *overrides, nproc=1, extra=()):
    args = train_args(data, out, *STUDENT, *overrides, nproc=nproc, extra=["--teacher", teacher, *extra])
    args[1] = "distill"
    return args


# ---- the loss ---------------------------------------------------------------------------------------------------

def _logits(seed, shape=(2, 5, 11)):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 3


def test_alpha_zero_is_plain_cross_entropy():
    student, teacher, targets = _logits(0), _logits(1), torch.randint(0, 11, (2, 5))
    mask = torch.tensor([[0, 1, 1, 0, 1], [1, 1, 0, 0, 0]])
    loss, ce, _ = distillation_loss(student, teacher, targets, mask, alpha=0.0, temperature=2.0)
    assert loss.item() == pytest.approx(masked_cross_entropy(student, targets, mask).item(), abs=1e-6)
    assert ce.item() == pytest.approx(loss.item(), abs=1e-6)


def test_kl_of_identical_logits_is_zero():
    logits, targets = _logits(0), torch.randint(0, 11, (2, 5))
    _, ce, kl = distillation_loss(logits, logits.clone(), targets, None, alpha=1.0, temperature=3.0)
    assert kl.item() == pytest.approx(0.0, abs=1e-6)
    loss, _, _ = distillation_loss(logits, logits.clone(), targets, None, alpha=0.5, temperature=3.0)
    assert loss.item() == pytest.approx(0.5 * ce.item(), abs=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 2.0, 4.0])
def test_kl_term_is_the_masked_mean_forward_kl_times_t_squared(temperature):
    student, teacher, targets = _logits(2), _logits(3), torch.randint(0, 11, (2, 5))
    mask = torch.tensor([[1, 1, 0, 1, 0], [0, 1, 1, 1, 1]])
    p = F.softmax(teacher.double() / temperature, -1)
    q = F.softmax(student.double() / temperature, -1)
    per_token = (p * (p.log() - q.log())).sum(-1)  # KL(teacher || student), written out
    expected_kl = (per_token * mask).sum() / mask.sum()
    loss, ce, kl = distillation_loss(student, teacher, targets, mask, alpha=1.0, temperature=temperature)
    assert kl.item() == pytest.approx(expected_kl.item(), rel=1e-5)
    assert loss.item() == pytest.approx(temperature ** 2 * expected_kl.item(), rel=1e-5)
    mixed, _, _ = distillation_loss(student, teacher, targets, mask, alpha=0.25, temperature=temperature)
    assert mixed.item() == pytest.approx(0.75 * ce.item() + 0.25 * temperature ** 2 * expected_kl.item(), rel=1e-5)


@pytest.mark.parametrize("override, message", [
    ("train.distill_alpha=1.5", "train.distill_alpha must be in [0, 1], got 1.5"),
    ("train.distill_alpha=-0.1", "train.distill_alpha must be in [0, 1], got -0.1"),
    ("train.distill_temperature=0", "train.distill_temperature must be in [0.01, 100], got 0"),
    ("train.distill_temperature=1e300", "train.distill_temperature must be in [0.01, 100], got 1e+300"),
    ("train.distill_temperature=1e-300", "train.distill_temperature must be in [0.01, 100], got 1e-300"),
    ("train.teacher=null", "distillation needs a teacher: pass --teacher"),
])
def test_bad_alpha_temperature_or_no_teacher_is_refused(override, message):
    with pytest.raises(UserError) as error:
        build_config("demo", ["train.stage=distill", "train.teacher=runs/teacher", override])
    assert message in str(error.value) and "\n" not in str(error.value)


# ---- the teacher ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def teacher(pretrain_data, tmp_path_factory):
    """The TINY model pretrained for 20 steps."""
    out = tmp_path_factory.mktemp("teacher")
    result = run_job(*train_args(pretrain_data, out, "train.max_steps=20", "train.eval_every=0",
                                 "train.precision=fp32"))
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def other_tokenizer_data(tmp_path_factory):
    """The same stories prepared with another tokenizer (400 tokens)."""
    root = tmp_path_factory.mktemp("other")
    text = (FIXTURES / "pretrain" / "en_stories.txt").read_text()
    train_tokenizer([text], 400, root / "tokenizer", show_progress=False)
    prepare("pretrain", [str(FIXTURES / "pretrain" / "en_stories.txt")], root / "tokenizer", root / "data",
            val_fraction=0.05, workers=1, show_progress=False)
    return root / "data"


def test_teacher_with_another_tokenizer_is_refused_naming_both(teacher, other_tokenizer_data, tmp_path, monkeypatch,
                                                               capfd):
    """Refused by the launching process of a 2-rank job before it starts a rank: `zerollm` is run in this one."""
    code = zerollm_here(monkeypatch, *_distill_args(other_tokenizer_data, tmp_path / "run", teacher,
                                                    "train.max_steps=1", nproc=2))
    stderr = capfd.readouterr().err
    assert code == 2, stderr[-2000:]
    error = [line for line in stderr.splitlines() if line.startswith("zerollm: error:")]
    assert len(error) == 1 and "Traceback" not in stderr
    assert f"its tokenizer {teacher / 'tokenizer'} (hash " in error[0]
    assert f"the data's {other_tokenizer_data / 'tokenizer'} (hash " in error[0]
    assert "512 tokens there, 400 in the data" in error[0]
    assert not (tmp_path / "run").exists()


def test_a_teacher_no_rank_can_load_is_said_once(teacher, pretrain_data, tmp_path, monkeypatch, capfd):
    """A teacher whose checkpoint is damaged (its bytes overwritten, its size kept) is found as the ranks load it:
    each of the two ranks said it, the same line twice, and without the option that named it."""
    damaged = tmp_path / "teacher"
    shutil.copytree(teacher, damaged)
    states = next((damaged / "checkpoints").glob("*/mp_rank_00_model_states.pt"))
    with open(states, "r+b") as file:
        file.seek(100)
        file.write(bytes(300))
    code = zerollm_here(monkeypatch, *_distill_args(pretrain_data, tmp_path / "run", damaged, "train.max_steps=1",
                                                    nproc=2))
    errors = [line for line in capfd.readouterr().err.splitlines() if line.startswith("zerollm: error:")]
    assert code == 2 and len(errors) == 1 and "is damaged" in errors[0], errors
    assert errors[0].startswith(f"zerollm: error: --teacher {damaged}"), errors  # which of the run's models it is


def test_a_teacher_the_triton_kernels_cannot_run_is_refused(teacher, pretrain_data, tmp_path, monkeypatch, capfd):
    """model.kernels=triton runs the teacher too: a teacher of a head dim the attention kernel refuses (TINY's 16)
    passed the checks, the run's files were written, and the teacher's first forward ended step 1 in a traceback."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the kernels run (on the CPU) as on a GPU
    code = zerollm_here(monkeypatch, *_distill_args(pretrain_data, tmp_path / "run", teacher, "model.dim=64",
                                                    "model.n_heads=2", "model.kernels=triton", "train.max_steps=1",
                                                    nproc=2))
    stderr = capfd.readouterr().err
    assert (code, stderr.strip().splitlines()[-1]) == (2, (
        f"zerollm: error: --teacher {teacher}: model.kernels=triton runs the teacher too, and the attention kernel "
        "takes head dims 32 to 128 in steps of 16, got model.dim/model.n_heads = 64/4 = 16 there; use "
        "model.kernels=auto or torch")), stderr[-2000:]
    assert "Traceback" not in stderr and not (tmp_path / "run").exists()


def test_teacher_of_another_vocabulary_or_without_tokenizer_or_checkpoint_is_refused(teacher, pretrain_data, tmp_path):
    attrs = read_data_attrs(pretrain_data, "pretrain")
    cfg = build_config("demo", [*TINY, "train.stage=distill", "model.vocab_size=640"],
                       paths={"data.path": str(pretrain_data), "train.teacher": str(teacher)})
    with pytest.raises(UserError, match=r"model.vocab_size 512 there, 640 here \(the student's\)"):
        check_teacher(cfg, attrs)
    cfg.model.vocab_size = 512
    summary = check_teacher(cfg, attrs)  # the same teacher fits a student of its vocabulary
    assert summary["path"] == str(teacher.resolve()) and summary["weights"].endswith(" global_step20")
    bare = tmp_path / "bare"
    shutil.copytree(teacher, bare, ignore=shutil.ignore_patterns("tokenizer"))
    cfg.train.teacher = str(bare)
    with pytest.raises(UserError, match=r"no tokenizer \(.*tokenizer.json is missing\)"):
        check_teacher(cfg, attrs)
    untrained = tmp_path / "untrained"
    shutil.copytree(teacher, untrained, ignore=shutil.ignore_patterns("checkpoints"))
    cfg.train.teacher = str(untrained)
    with pytest.raises(UserError, match="no checkpoint found .*; train it first"):
        check_teacher(cfg, attrs)
    cfg.train.teacher = str(tmp_path)
    neither = rf"^--teacher {re.escape(str(tmp_path))}: neither a run directory .* nor an export directory"
    with pytest.raises(UserError, match=neither):
        check_teacher(cfg, attrs)


# ---- training ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def student(teacher, pretrain_data, tmp_path_factory):
    """A student distilled for 20 steps on one rank, checkpointed at steps 10 and 20."""
    out = tmp_path_factory.mktemp("student")
    result = run_job(*_distill_args(pretrain_data, out, teacher, *RESUMABLE))
    assert result.returncode == 0, result.stderr[-3000:]
    return out


RESUMABLE = ["train.max_steps=20", "train.save_every=10", "train.keep_checkpoints=0", "train.eval_every=10",
             "train.distill_alpha=0.5", "train.distill_temperature=2.0"]


def test_student_lowers_its_kl_to_the_teacher(student):
    rows = _metrics(student)
    assert [r["step"] for r in rows] == list(range(1, 21))
    assert all(math.isfinite(r["ce"]) and math.isfinite(r["distill_kl"]) for r in rows)
    first, last = rows[0], rows[-1]
    assert last["distill_kl"] < 0.6 * first["distill_kl"]
    assert last["loss"] == pytest.approx(0.5 * last["ce"] + 0.5 * 2.0 ** 2 * last["distill_kl"], rel=1e-4)  # T 2
    assert 0 < last["val_loss"] < math.log(512)  # the student's own cross-entropy, below a uniform guess


def test_resume_is_exact(student, teacher, pretrain_data, tmp_path):
    resumed = tmp_path / "resumed"
    shutil.copytree(student, resumed)
    shutil.rmtree(resumed / "checkpoints" / "global_step20")
    (resumed / "checkpoints" / "latest").write_text("global_step10")  # as if killed after step 10's checkpoint
    result = run_job(*_distill_args(pretrain_data, resumed, teacher, *RESUMABLE, extra=["--resume", "auto"]))
    assert result.returncode == 0, result.stderr[-3000:]
    keys = ("step", "loss", "ce", "distill_kl", "val_loss")
    assert [[r.get(k) for k in keys] for r in _metrics(resumed)] == [[r.get(k) for k in keys] for r in
                                                                      _metrics(student)]
    a, b = consolidated_weights(student), consolidated_weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_two_ranks_zero3_on_sft_data(teacher, tokenizer_dir, tmp_path):
    data = tmp_path / "sft"
    prepare("sft", [str(FIXTURES / "sft" / "messages_zh.jsonl")], tokenizer_dir, data, val_fraction=0.05,
            seq_len=64, workers=1, show_progress=False)
    run = tmp_path / "run"
    result = run_job(*_distill_args(data, run, teacher, "data.seq_len=64", "train.max_steps=3", "train.eval_every=3",
                                    nproc=2, extra=["--zero-stage", 3]))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    rows = _metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(math.isfinite(r["distill_kl"]) and r["distill_kl"] > 0 for r in rows)
    assert json.loads((run / "ds_config.json").read_text())["zero_optimization"]["stage"] == 3
    train = yaml.safe_load((run / "config.yaml").read_text())["train"]
    assert train["teacher"] == str(teacher)
    # loss, ce and distill_kl are all means over the step's reply tokens (weighted alike), so the logged terms add up
    alpha, temperature = train["distill_alpha"], train["distill_temperature"]
    assert [r["loss"] for r in rows] == pytest.approx(
        [(1 - alpha) * r["ce"] + alpha * temperature ** 2 * r["distill_kl"] for r in rows], rel=1e-6)


def test_a_teacher_given_relative_is_recorded_whole_and_export_will_not_replace_it(teacher, pretrain_data, tmp_path,
                                                                                 monkeypatch, capfd):
    """config.yaml kept --teacher as typed: export, run from another directory, read a relative teacher there, did
    not see that its --out was the teacher the run was distilled from, and replaced that export."""
    assert zerollm_here(monkeypatch, "export", "--run", teacher, "--out", tmp_path / "t") == 0
    run = tmp_path / "run"
    result = run_job(*_distill_args(pretrain_data, run, "t", "train.max_steps=1", "train.eval_every=0"),
                     cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert yaml.safe_load((run / "config.yaml").read_text())["train"]["teacher"] == str((tmp_path / "t").resolve())
    def contents():
        return {p: p.read_bytes() for p in (tmp_path / "t").rglob("*") if p.is_file()}

    before = contents()
    capfd.readouterr()
    code = zerollm_here(monkeypatch, "export", "--run", run, "--out", tmp_path / "t")
    assert (code, capfd.readouterr().err.strip().splitlines()[-1]) == (2, (
        f"zerollm: error: --out {tmp_path / 't'} is the run's train.teacher, a model it was trained from, which "
        "export would replace; choose another --out"))
    assert contents() == before


def test_resume_against_another_teacher_is_refused(student, teacher, pretrain_data, tmp_path):
    other = tmp_path / "other_teacher"  # another run of the same tokenizer and vocabulary
    shutil.copytree(student, other)
    resumed = tmp_path / "resumed"
    shutil.copytree(student, resumed)
    result = run_job(*_distill_args(pretrain_data, resumed, other, *RESUMABLE, extra=["--resume", "auto"]))
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"not the teacher {resumed} was trained with ({teacher.resolve()}, run " in result.stderr
    assert result.stderr.count("zerollm: error:") == 1 and "Traceback" not in result.stderr


def test_a_resume_refuses_a_teacher_whose_config_changed(student, teacher, pretrain_data, tmp_path):
    """Its weights alone were compared: a teacher whose RoPE base was edited (another function of the same weights)
    was resumed against without a word. Here the record says the teacher had another RoPE base then."""
    resumed = tmp_path / "resumed"
    shutil.copytree(student, resumed)
    records = (resumed / rundir.RUN_RECORD_FILE).read_text().splitlines()
    last = json.loads(records[-1])
    last["data"]["teacher"]["model"]["rope_theta"] = 10.0
    (resumed / rundir.RUN_RECORD_FILE).write_text("\n".join([*records[:-1], json.dumps(last)]) + "\n")
    result = run_job(*_distill_args(pretrain_data, resumed, teacher, *RESUMABLE, extra=["--resume", "auto"]))
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.splitlines()[-1] == (
        f"zerollm: error: --teacher {teacher.resolve()}: the weights {resumed} was trained with, but their config "
        "changed since (model.rope_theta 10.0 then, 10000.0 now): another function; put its config back as it was")


def test_a_checked_checkpoint_removed_before_it_loads_is_one_line_and_ranks_compare_what_they_load(student):
    """A teacher still training that kept only its newest checkpoints could remove the one checked: 'incomplete
    checkpoint (the folder does not exist)', naming neither the teacher nor what happened. Ranks that looked at a
    teacher before and after it saved would each load another checkpoint, which nothing compared."""
    with pytest.raises(UserError, match=f"^--teacher {student}: its checkpoint global_step30, the newest as this run "
                                        "started, was removed since \\(its training keeps only its newest "
                                        "checkpoints\\); start this run again$"):
        load_model_dir(student, "global_step30", "--teacher")
    prints = [fingerprint({}, {}, "data", "tok", {"teacher": f"run 9c1e {tag}"})
              for tag in ("global_step10", "global_step20")]
    assert "teacher weights: run 9c1e global_step10 on rank 0; run 9c1e global_step20 on rank 1" in \
        mismatch_message(prints)


def test_ranks_compare_the_teachers_weights_not_its_path():
    """Nodes that hold the teacher at paths of their own (a node-local disk) were refused as disagreeing, where
    the data, the base and the prompts may differ in path; the weights they load are compared."""
    prints = [fingerprint({"train": {"teacher": path}}, {}, "data", "tok", {"teacher": "model.safetensors digest 12"})
              for path in ("/scratch/a/teacher", "/local/teacher")]
    assert mismatch_message(prints) is None
    prints[1]["teacher weights"] = "model.safetensors digest 34"
    assert mismatch_message(prints).startswith("ranks disagree, nothing was trained: teacher weights: ")


def _recorded(run_dir, **teacher):
    (run_dir / rundir.RUN_RECORD_FILE).write_text(json.dumps({"data": {"teacher": teacher}}) + "\n")


def test_an_export_moved_is_the_same_teacher_and_a_run_directory_elsewhere_is_not(tmp_path):
    """The same teacher at another path was refused as another, even with the same digest on both sides; a run
    directory is known by its run id and checkpoint, which a copy trained on keeps, so its path still counts while
    one is left there; one moved (none left where it was) is the same (a moved DPO run of a moved base could not be
    resumed, but as a new run)."""
    model = {"dim": 64, "rope_theta": 10000.0}
    _recorded(tmp_path, path="/models/a", weights="model.safetensors digest 1234", model=model)
    check_same_weights(tmp_path, "teacher", {"path": "/moved/a", "weights": "model.safetensors digest 1234",
                                             "model": model}, "--teacher")
    (tmp_path / "a").mkdir()
    _recorded(tmp_path, path=str(tmp_path / "a"), weights="run 9c1e global_step20", model=model)
    summary = {"path": "/runs/copy", "weights": "run 9c1e global_step20", "model": model, "tag": "global_step20"}
    with pytest.raises(UserError, match="^--teacher /runs/copy \\(run 9c1e global_step20\\): not the teacher .*"
                                        "global_step20\\) \\(a run directory is known by its path: a copy "
                                        "elsewhere may have trained on under the same run id\\); resume with"):
        check_same_weights(tmp_path, "teacher", summary, "--teacher")
    (tmp_path / "a").rmdir()  # moved: none left where it was
    check_same_weights(tmp_path, "teacher", summary, "--teacher")
    with pytest.raises(UserError, match="^--teacher /runs/copy \\(run 9c1e global_step30\\): not the teacher"):
        check_same_weights(tmp_path, "teacher", {**summary, "weights": "run 9c1e global_step30"}, "--teacher")
    _recorded(tmp_path, path=str(tmp_path / "a"), weights="run 9c1e global_step2", model=model)
    with pytest.raises(UserError, match="^--teacher /runs/copy \\(run 9c1e global_step20\\): not the teacher"):
        check_same_weights(tmp_path, "teacher", summary, "--teacher")  # step 20 of a run is not its step 2


def test_the_checkpoint_checked_is_the_one_loaded(student, teacher):
    """A teacher (or base) still training could save between the check, which records its newest checkpoint, and
    the load, which took the newest again: the run record named one checkpoint and the run learnt from another."""
    summary = weights_summary(student, "--teacher")
    assert summary["tag"] == "global_step20" and summary["model"]["dim"] == 32
    assert weights_summary(teacher, "--teacher")["model"]["dim"] == 64
    cfg = build_config("demo", [*TINY, *STUDENT])
    earlier = initial_weights(cfg.model, str(student), Tokenizer.load(rundir.tokenizer_dir(student)).hash,
                              "global_step10")
    at = {tag: consolidated_weights(student, tag) for tag in ("global_step10", "global_step20")}
    assert all(torch.equal(earlier[k], at["global_step10"][k]) for k in earlier)
    assert not all(torch.equal(earlier[k], at["global_step20"][k]) for k in earlier)


def test_a_distillation_validation_loss_is_the_students_cross_entropy_alone():
    """As documented, so that a distilled run's val_loss compares with any other run's on the same data."""
    from llm.config import ModelConfig
    from llm.model import Transformer
    from llm.train.objectives import CausalLMObjective, DistillObjective

    torch.manual_seed(0)
    student = Transformer(ModelConfig(vocab_size=97, dim=32, n_layers=1, n_heads=2, max_seq_len=32)).eval()
    teacher = Transformer(ModelConfig(vocab_size=97, dim=48, n_layers=2, n_heads=4, max_seq_len=32)).eval()
    tokens = torch.randint(0, 97, (2, 17))
    batch = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": torch.ones(2, 16, dtype=torch.long)}
    with torch.no_grad():
        got = DistillObjective(teacher, alpha=0.5, temperature=2.0)(student, batch).loss
        expected = CausalLMObjective()(student, batch).loss
    assert got.item() == pytest.approx(expected.item(), rel=1e-6)
