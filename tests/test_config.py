import dataclasses
import json
import pathlib
import re
from types import SimpleNamespace

import psutil
import pytest
import yaml

from llm import rundir
from llm.config import NUMBER_RANGES, RunConfig, build_config, load_yaml, recipe_names
from llm.errors import UserError
from llm.train.ds_config_file import DS_CONFIG_DIR, load_ds_config
from llm.train.engine import resolve_ds_config


def test_recipes_are_packaged_and_valid():
    assert {"demo", "minimind-26m", "minimind3-64m", "tiny-k-215m"} <= set(recipe_names())
    for name in recipe_names():
        build_config(name)
    m = build_config("minimind3-64m").model
    assert (m.dim, m.n_layers, m.n_heads, m.kv_heads, m.vocab_size, m.attention_head_dim) == (768, 8, 8, 4, 6400, 96)


def test_dotted_overrides_parse_yaml_scalars():
    cfg = build_config("demo", ["train.max_steps=7", "train.save_every=3", "train.eval_every=2",
                                "train.micro_batch_size=2", "train.lr=1e-3", "data.seq_len=64", "model.dim=96",
                                "model.n_layers=3", "model.n_kv_heads=null", "model.moe=true"])
    t, m = cfg.train, cfg.model
    assert (t.max_steps, t.save_every, t.eval_every, t.micro_batch_size, t.lr) == (7, 3, 2, 2, 1e-3)
    assert (cfg.data.seq_len, m.dim, m.n_layers, m.n_kv_heads, m.moe) == (64, 96, 3, None, True)


def test_values_are_read_by_yaml_12_and_text_keys_take_the_text_as_written(tmp_path):
    """YAML 1.1 read 010 as octal 8 (`--set lora.r=010` trained at rank 8), 1_000 as 1000 and 2026-12-02 as a date
    (a run named so was refused), and `--set wandb.name=0123` named the run 83."""
    cfg = build_config("demo", ["train.stage=sft", "lora.r=010", "train.max_steps=0o12", "train.lr=2e-4",
                                "wandb.name=0123", "wandb.project=2026-12-02"], paths={"train.init_from": "base"})
    assert (cfg.lora.r, cfg.train.max_steps, cfg.train.lr) == (10, 10, 2e-4)
    assert (cfg.wandb.name, cfg.wandb.project) == ("0123", "2026-12-02")
    assert build_config("demo", ["wandb.name=null"]).wandb.name is None
    assert build_config("demo", ["train.sample_prompts=0123"]).train.sample_prompts == ["0123"]  # it was refused
    with pytest.raises(UserError, match="train.max_steps' expects int, got '1_000'"):
        build_config("demo", ["train.max_steps=1_000"])
    for text in ("0_1", "1_000", "\uff13e-4", "\u0661.5"):  # float() read them: a weight decay of 0_1 was 1.0
        with pytest.raises(UserError, match=f"train.weight_decay' expects float, got '{text}'"):
            build_config("demo", [f"train.weight_decay={text}"])
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("train:\n  lr: 1_000\n")
    with pytest.raises(UserError, match="train.lr' expects float, got '1_000'"):
        build_config(str(recipe))
    assert [build_config("demo", [f"train.lr={text}"]).train.lr for text in ('"1e-3"', "1e-3", "'.5'")] == [
        1e-3, 1e-3, 0.5]
    for name in ("1e5", "on", "010", "1:30", ".5"):  # what config.yaml records reads back as the same text
        saved = build_config("demo", [f"wandb.name={name}"])
        saved.save(tmp_path / "config.yaml")
        assert load_yaml((tmp_path / "config.yaml").read_text())["wandb"]["name"] == name
        assert rundir.recorded_config(tmp_path)["wandb"]["name"] == name
    quoted = build_config("demo", ['wandb.name="0123"', "wandb.mode='off'", "wandb.project= mine "]).wandb
    assert (quoted.name, quoted.mode, quoted.project) == ("0123", "off", "mine")  # quotes are YAML's


@pytest.mark.parametrize("override, value", [("wandb.name=run #2", "run #2"), ("wandb.name=#2", "#2"),
                                             ("wandb.name= Ann's run #2 $(id) %h", "Ann's run #2 $(id) %h"),
                                             ("wandb.name=run#2", "run#2"), ('wandb.name="run #2"', "run #2")])
def test_a_hash_in_an_override_is_part_of_its_value(override, value):
    """YAML reads ' #' as the start of a comment: `--set 'wandb.name=run #2'` named the run 'run', and
    `wandb.name=#2` named it nothing (null), without a word."""
    assert build_config("demo", [override]).wandb.name == value


def test_a_number_or_a_list_followed_by_a_hash_is_refused():
    """YAML dropped the comment: `model.dim=64 # wide` was 64, `lora.targets=- wq # c` [wq]."""
    with pytest.raises(UserError, match="config key 'model.dim' expects int, got '64 # wide'"):
        build_config("demo", ["model.dim=64 # wide"])
    with pytest.raises(UserError, match="lora.targets: unknown module '- wq # c'"):
        build_config("demo", ["lora.targets=- wq # c"])


def test_a_config_yaml_an_earlier_version_wrote_reads_back_as_it_meant(tmp_path):
    """PyYAML's safe_dump (YAML 1.1) left text such as 08 and 1e5 unquoted; read as YAML 1.2 they were numbers, and
    a run so named could no longer be resumed, exported or evaluated ("expects str | None, got 8")."""
    cfg = build_config("demo", ["wandb.name=08", "wandb.project=1e5", "train.stage=sft"],
                       paths={"train.init_from": "09"})
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    assert "name: 08\n" in (tmp_path / "config.yaml").read_text()
    recorded = build_config(rundir.recorded_config(tmp_path))
    assert (recorded.wandb.name, recorded.wandb.project, recorded.train.init_from) == ("08", "1e5", "09")


def test_a_config_yaml_cut_short_is_refused_naming_the_file(tmp_path):
    """config.yaml cut by a full disk (written in place by earlier versions) parses, with keys left null: every resume
    and `zerollm generate` then failed with "config key 'train.save_every' cannot be null", naming no file."""
    build_config("demo").save(tmp_path / "config.yaml")
    text = (tmp_path / "config.yaml").read_text()
    (tmp_path / "config.yaml").write_text(text[:text.index("save_every:") + len("save_every:")])
    with pytest.raises(UserError) as refused:
        rundir.recorded_config(tmp_path)
    assert str(refused.value) == (f"{tmp_path / 'config.yaml'} is damaged (config key 'train.save_every' cannot be "
                                  "null); `zerollm train` wrote it: restore it")


@pytest.mark.parametrize("edit, problem", [
    # the last one was used: generate and export of a run edited so read another model than it trained
    (lambda text: text.replace("  rope_theta: ", "  rope_theta: 1000000.0\n  rope_theta: ", 1),
     "found the key 'rope_theta' twice"),
    # a TypeError traceback in generate, export, eval and --init-from
    (lambda text: text.replace("  vocab_size: 512\n", ""), "it lacks model.vocab_size"),
])
def test_a_config_yaml_edited_by_hand_is_refused_naming_the_file(tmp_path, edit, problem):
    from llm.loading import load_trained_model, model_config_of

    build_config("demo", ["model.vocab_size=512"]).save(tmp_path / "config.yaml")
    path = tmp_path / "config.yaml"
    path.write_text(edit(path.read_text()))
    for read in (load_trained_model, model_config_of):
        with pytest.raises(UserError) as refused:
            read(tmp_path)
        assert str(refused.value).startswith(f"{path} is damaged (") and problem in str(refused.value)
        assert str(refused.value).endswith("); `zerollm train` wrote it: restore it")


RESUMED = ["model.vocab_size=512", "model.dim=64", "model.n_layers=2", "model.n_heads=4", "data.seq_len=32"]


def _resumed_as(tmp_path, saved: list[str], here: list[str], paths: dict | None = None,
                optimizers: tuple[dict, dict] | None = None) -> None:
    """`check_same_shape` of a run saved with `saved` overrides, resumed with `here` (and its own `paths`), the
    resolved DeepSpeed configs' optimizer sections `optimizers` (there, here)."""
    from llm.train.job import check_same_shape

    ds_configs = [{"zero_optimization": {"stage": 1}, **({"optimizer": section} if section else {})}
                  for section in optimizers or ({}, {})]
    build_config("demo", [*RESUMED, *saved]).save(tmp_path / "config.yaml")
    (tmp_path / "ds_config.json").write_text(json.dumps(ds_configs[0]))
    check_same_shape(tmp_path, build_config(rundir.recorded_config(tmp_path)),
                     build_config("demo", [*RESUMED, *here], paths), ds_configs[1])


@pytest.mark.parametrize("damage, problem", [
    (lambda path: path.unlink(), "it is missing"),
    (lambda path: path.write_text("{"), "it is damaged (JSONDecodeError)"),
    (lambda path: path.write_text("[1]"), "it is damaged (not a JSON object)"),
])
def test_a_resume_without_a_readable_ds_config_json_is_refused(tmp_path, monkeypatch, damage, problem):
    """Its ZeRO stage, optimizer and schedule checks were skipped: a resume at another ZeRO stage was an
    AssertionError traceback in every rank (exit 76 on two)."""
    from llm.train import job

    real = job._recorded_ds_config

    def damaged(run_dir):
        damage(run_dir / "ds_config.json")
        return real(run_dir)

    monkeypatch.setattr(job, "_recorded_ds_config", damaged)
    with pytest.raises(UserError) as refused:
        _resumed_as(tmp_path, [], [])
    assert str(refused.value) == (f"{tmp_path / 'ds_config.json'}: {problem}; it records the DeepSpeed settings the "
                                  "checkpoints were saved with (ZeRO stage, optimizer, schedule), which a resume must "
                                  "keep: restore it, or train a new run")


ADAMW = {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}


@pytest.mark.parametrize("there, here, refused", [
    (ADAMW, {"type": "Muon", "params": {"lr": 1e-3}}, "optimizer Adam or AdamW there, muon here"),  # a traceback
    ({"type": "SGD", "params": {"lr": 0.1}}, ADAMW, "optimizer sgd there, Adam or AdamW here"),  # KeyError: 'step'
    (ADAMW, {"type": "SGD", "params": {"lr": 0.1}}, "optimizer Adam or AdamW there, sgd here"),  # trained on
    (ADAMW, {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True, "amsgrad": True}},
     "optimizer Adam or AdamW there, Adam or AdamW with amsgrad here"),  # KeyError: 'max_exp_avg_sq' at its step
    (ADAMW, {"type": "adam", "params": {"lr": 3e-4}}, None),  # the same moments: resumed
    ({"type": "Muon"}, {"type": "muon", "params": {"lr": 1e-3}}, None),
])
def test_a_resume_with_an_optimizer_of_another_state_is_refused(tmp_path, there, here, refused):
    if refused is None:
        _resumed_as(tmp_path, [], [], optimizers=(there, here))
        return
    with pytest.raises(UserError) as error:
        _resumed_as(tmp_path, [], [], optimizers=(there, here))
    assert str(error.value) == (f"{tmp_path}: its checkpoints cannot resume with these changes ({refused}, as the "
                                "--deepspeed JSON's 'optimizer' section sets it (its state does not carry over)); "
                                f"resume with the values there, or start a new run with --init-from {tmp_path}")


@pytest.mark.parametrize("saved, here, paths, changes", [
    ([], ["model.rope_theta=500000", "model.norm_eps=0.1"], None,
     "model.rope_theta 10000.0 there, 500000.0 here; model.norm_eps 1e-05 there, 0.1 here"),
    ([], ["model.rope_scaling=yarn", "model.rope_factor=4", "model.rope_original_max_seq_len=128"], None,
     "model.rope_scaling none there, yarn here; model.rope_factor 1.0 there, 4.0 here; "
     "model.rope_original_max_seq_len 0 there, 128 here"),
    ([], ["train.stage=distill"], {"train.teacher": "teach"}, "train.stage pretrain there, distill (--teacher teach) "
                                                              "here"),
    (["train.stage=distill", "train.teacher=teach"], [], None, "train.stage distill (--teacher teach) there, pretrain "
                                                               "here"),
    ([], ["data.seq_len=16"], None, "data.seq_len 32 there, 16 here (its samples are windows of that many tokens)"),
    (["model.moe=true", "model.n_experts=4", "model.n_experts_per_token=2"],  # routing: no shape, but the function
     ["model.moe=true", "model.n_experts=4", "model.n_experts_per_token=1", "model.norm_topk_prob=false"], None,
     "model.n_experts_per_token 2 there, 1 here; model.norm_topk_prob True there, False here"),
])
def test_a_resume_that_changes_what_the_checkpoints_mean_is_refused(tmp_path, saved, here, paths, changes):
    """Accepted before: the run trained on as another function (RoPE base, norm epsilon: what --init-from refuses)
    or objective (a pretraining run resumed as distillation mixed the losses in its metrics), into checkpoints that
    then loaded with the new values; another data.seq_len was refused by the sampler, naming 'the data and
    train.seed'."""
    with pytest.raises(UserError) as refused:
        _resumed_as(tmp_path, saved, here, paths)
    assert str(refused.value) == (f"{tmp_path}: its checkpoints cannot resume with these changes ({changes}); resume "
                                  f"with the values there, or start a new run with --init-from {tmp_path}")


def test_a_resume_may_change_data_seq_len_where_samples_are_not_windows_of_it(tmp_path):
    """DPO pairs are padded to data.seq_len, one sample each: another length changes no sampler position."""
    init = {"train.init_from": "sft_run"}
    _resumed_as(tmp_path, ["train.stage=dpo", "train.init_from=sft_run"], ["train.stage=dpo", "data.seq_len=64"], init)
    _resumed_as(tmp_path, [], ["train.lr=1e-4", "train.max_steps=9"])  # and what takes effect from there


@pytest.mark.parametrize("override, message", [
    ("train.lrr=1", "unknown config key 'train.lrr'"),
    ("nope.x=1", "unknown config key 'nope.x'"),
    ("train.max_steps=ten", "expects int"),
    ("train.max_steps", "expects key=value"),
    ("model.n_heads=5", "divisible by model.n_heads"),
    ("data.seq_len=100000", "exceeds model.max_seq_len"),
    ("train.precision=fp8", "auto, bf16, fp16 or fp32"),
    ("model.rope_scaling=yarn", "rope_factor"),
])
def test_bad_config_is_one_clear_error(override, message):
    with pytest.raises(UserError, match=message):
        build_config("demo", [override])


def test_a_context_shorter_than_the_data_names_the_model_it_came_from():
    """--init-from a model of a shorter context than the data's windows said "data.seq_len (128) exceeds
    model.max_seq_len (64)", two numbers the user gave neither of, nor how to train the model longer."""
    with pytest.raises(UserError) as refused:
        build_config("demo", ["data.seq_len=128", "model.max_seq_len=64"], paths={"train.init_from": "base"})
    assert str(refused.value).endswith("data.seq_len (128) exceeds model.max_seq_len (64) (--init-from base's "
                                       "context; --set model.max_seq_len=128 trains it longer)")


def _numeric_keys(kind: str) -> list[str]:
    """Every config key whose type admits `kind` ('int' or 'float')."""
    return [f"{section.name}.{f.name}" for section in dataclasses.fields(RunConfig)
            for f in dataclasses.fields(section.default_factory()) if kind in str(f.type)]


@pytest.mark.parametrize("key", _numeric_keys("float"))
@pytest.mark.parametrize("value", ["inf", "-inf", "nan", ".inf", ".nan", "1e999", "1" + "0" * 400])
def test_every_float_key_refuses_non_finite_values(key, value):
    # train.max_time also takes text, such as '10m': there 'inf' is a string, refused as no duration
    with pytest.raises(UserError, match=f"config key '{key}' (must be a finite number|expects seconds or a duration)"):
        build_config("demo", [f"{key}={value}"])


def test_every_number_key_has_a_range():
    numeric = set(_numeric_keys("int") + _numeric_keys("float")) - {"train.max_time"}  # a duration: parse_duration
    assert numeric == set(NUMBER_RANGES)


@pytest.mark.parametrize("override, message", [
    ("train.lr=0", r"train.lr must be in \(0, 1e\+30\], got 0.0"),
    ("train.lr=1e38", r"train.lr must be in \(0, 1e\+30\], got 1e\+38"),  # a RuntimeError in torch's Adam
    ("grpo.temperature=1e-39", r"grpo.temperature must be in \[0.01, 100\], got 1e-39"),  # infinite logits: NaN loss
    ("model.rope_theta=0", "model.rope_theta must be > 1, got 0.0"),
    ("model.rope_theta=1", "model.rope_theta must be > 1, got 1.0"),
    ("model.norm_eps=0", r"model.norm_eps must be in \(0, 1\], got 0.0"),
    ("model.norm_eps=1e308", r"model.norm_eps must be in \(0, 1\], got 1e\+308"),  # inf in fp32: every norm 0
    ("train.weight_decay=-0.1", "train.weight_decay must be >= 0, got -0.1"),
    ("train.beta1=1.5", r"train.beta1 must be in \[0, 1\), got 1.5"),
    ("train.beta1=1", r"train.beta1 must be in \[0, 1\), got 1.0"),
    ("train.beta2=-0.1", r"train.beta2 must be in \[0, 1\), got -0.1"),
    ("train.adam_eps=0", "train.adam_eps must be positive, got 0.0"),
    ("train.grad_clip=-1", "train.grad_clip must be >= 0, got -1.0"),
    ("train.seed=-1", r"train.seed must be in \[0, 18446744073709551615\], got -1"),
    ("train.seed=18446744073709551616", r"train.seed must be in \[0, 18446744073709551615\]"),
    ("train.eval_batches=0", "train.eval_batches must be positive, got 0"),
    ("train.peak_tflops=-3", "train.peak_tflops must be positive, got -3.0"),
    ("model.init_std=-1", "model.init_std must be positive, got -1.0"),
    ("model.multiple_of=0", "model.multiple_of must be positive, got 0"),
    ("model.hidden_dim=-5", "model.hidden_dim must be positive, got -5"),
    ("model.hidden_dim=0", "model.hidden_dim must be positive, got 0"),
    ("model.n_kv_heads=-2", "model.n_kv_heads must be positive, got -2"),
    ("model.rope_factor=0.5", "model.rope_factor must be >= 1, got 0.5"),
    ("model.yarn_beta_slow=0", "model.yarn_beta_slow must be positive, got 0.0"),
    ("model.n_experts=0", r"model.n_experts must be in \[1, 1024\], got 0"),
    ("model.n_experts=1025", r"model.n_experts must be in \[1, 1024\], got 1025"),
    ("model.n_layers=100000000", r"model.n_layers must be in \[1, 1024\], got 100000000"),  # building them hung
    ("train.collective_timeout_s=1e300", r"train.collective_timeout_s must be in \[1, 604800\], got 1e\+300"),
    # two local ranks could not meet in 1e-06 s: 'did not all meet ... start every node with the same node count'
    ("train.collective_timeout_s=0.5", r"train.collective_timeout_s must be in \[1, 604800\], got 0.5"),
    ("grpo.reward_timeout_s=1e10", r"grpo.reward_timeout_s must be in \[0, 604800\], got 10000000000.0$"),
    ("data.loader_workers=65", r"data.loader_workers must be in \[0, 64\], got 65"),  # each a process: a fork bomb
    ("model.moe_aux_loss_coef=-1", "model.moe_aux_loss_coef must be >= 0, got -1.0"),
    ("data.loader_workers=-1", r"data.loader_workers must be in \[0, 64\], got -1"),
    ("grpo.temperature=0", r"grpo.temperature must be in \[0.01, 100\], got 0.0"),
    ("grpo.top_p=0", r"grpo.top_p must be in \(0, 1\], got 0.0"),
    ("grpo.clip_low=1", r"grpo.clip_low must be in \[0, 1\), got 1.0"),
    ("lora.dropout=1", r"lora.dropout must be in \[0, 1\), got 1.0"),
    ("train.max_time=1" + "0" * 400, "train.max_time"),  # too many seconds: inf
])
def test_out_of_range_numbers_name_the_key_and_the_range(override, message):
    with pytest.raises(UserError, match=message):
        build_config("demo", [override])


@pytest.mark.parametrize("command, sets, said", [
    (["grpo", "--prompts", "p.jsonl"], "grpo.prompts=q.jsonl", "--prompts sets it too"),
    (["sft", "--data", "d"], "data.path=e", "--data sets it too"),
    (["dpo", "--data", "d", "--beta", "0.2"], "train.dpo_beta=0.1", "--beta sets it too"),
    (["sft", "--data", "d", "--lora", "r=4"], "lora.r=8", "--lora sets it too"),
    (["sft", "--data", "d", "--wandb", "offline"], "wandb.mode=off", "--wandb sets it too"),
    (["sft", "--data", "d"], "train.stage=dpo", "`train sft` sets it too"),
])
def test_a_set_that_the_command_also_sets_is_refused(tmp_path, monkeypatch, capsys, command, sets, said):
    """The command's option won, and the --set was dropped without a word (`--set grpo.prompts=X` beside
    --prompts, `--set train.dpo_beta` beside --beta, ...)."""
    from conftest import zerollm_here

    monkeypatch.chdir(tmp_path)
    assert zerollm_here(monkeypatch, "train", *command, "--recipe", "demo", "--init-from", "base", "--out", "run",
                        "--set", sets) == 2
    assert capsys.readouterr().err == f"zerollm: error: --set {sets.partition('=')[0]}: {said}; give it once\n"


def test_a_set_list_left_open_is_refused_and_other_text_kept():
    """`--set 'train.sample_prompts=[a, b'` became one prompt, the text '[a, b'."""
    with pytest.raises(UserError, match=r"^--set train.sample_prompts: '\[a, b' ends inside a YAML list or mapping "
                                        r"\(expected ',' or '\]', but got '<stream end>'\); close it, or quote "
                                        r"text: --set 'train.sample_prompts=\"\[a, b\"'$"):
        build_config("demo", ["train.sample_prompts=[a, b"])
    for text in ("a: b", "{date}-run", "[exp] 1"):  # text YAML reads otherwise stays text
        assert build_config("demo", [f"wandb.name={text}"]).wandb.name == text
    assert build_config("demo", ["train.sample_prompts=[INST] Hello"]).train.sample_prompts == ["[INST] Hello"]


def test_a_recipe_yaml_mistake_is_named_by_its_file_line_and_column(tmp_path):
    """It was PyYAML's text squashed into one line, naming the file '"<unicode string>", line 2, column 1'."""
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("train:\n  lr: [0.1\n")
    with pytest.raises(UserError) as refused:
        build_config(str(recipe))
    assert str(refused.value) == f"{recipe}:3:1: invalid YAML (expected ',' or ']', but got '<stream end>')"


def test_a_recipe_that_gives_a_key_twice_is_refused(tmp_path):
    """PyYAML kept the last of two values silently: `lora: {r: 4, r: 8}` trained at rank 8."""
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("model:\n  dim: 64\ntrain:\n  lr: 0.001\n  lr: 0.1\n")
    with pytest.raises(UserError, match=f"^{recipe}:5:3: invalid YAML \\(found the key 'lr' twice\\)$"):
        build_config(str(recipe))
    recipe.write_text("train:\n  <<: {lr: 0.001, max_steps: 10}\n  warmup_steps: 2\n")  # a merge key: no twin
    assert build_config(str(recipe)).train.max_steps == 10
    recipe.write_text("train:\n  <<: {max_steps: 10}\n  <<: {max_steps: 20}\n")  # the later was taken
    with pytest.raises(UserError, match=f"^{recipe}:3:3: invalid YAML \\(found the key '<<' twice\\)$"):
        build_config(str(recipe))
    recipe.write_text("train:\n  <<: [{max_steps: 10}, {lr: 0.1}]\n")  # several merged, as YAML writes them
    assert (build_config(str(recipe)).train.max_steps, build_config(str(recipe)).train.lr) == (10, 0.1)


@pytest.mark.parametrize("text, said", [
    ("model:\n  dimm: 64\n", "unknown config key 'model.dimm'; 'model' has: vocab_size, dim, "),  # as a --set's
    ("optimizer: {}\nmodel:\n  dim: 64\n", "unknown section 'optimizer'; sections are model, data, train, grpo, "
     "lora, wandb"),  # empty, it was taken without a word
    ("model:\n", "section 'model' must be a mapping"),
])
def test_a_recipe_key_mistake_names_the_recipe(tmp_path, text, said):
    recipe = tmp_path / "mine.yaml"
    recipe.write_text(text)
    with pytest.raises(UserError) as refused:
        build_config(str(recipe))
    assert str(refused.value).startswith(f"{recipe}: {said}")


@pytest.mark.parametrize("text", ["", "# my settings, to come\n", "{}\n", "null\n"])
def test_an_empty_recipe_is_refused(tmp_path, text):
    """An empty recipe (a truncated file, or comments only) trained every default without a word."""
    recipe = tmp_path / "mine.yaml"
    recipe.write_text(text)
    with pytest.raises(UserError, match=rf"^{recipe}: no settings \(an empty recipe\); give at least one section "
                                        r"\(model, data, train, \.\.\.\), or a packaged recipe \(.*demo"):
        build_config(str(recipe))
    recipe.write_text(text + "[]\n" if text.startswith("#") else "0\n")  # not empty: no mapping
    with pytest.raises(UserError, match=rf"^{recipe}: expected a mapping of sections \(model, data, train"):
        build_config(str(recipe))


@pytest.mark.parametrize("raw, where", [(b"model:\n  dim: 32 # caf\xe9\n", "byte 0xe9 at offset 22"),
                                        ("model:\n  dim: 32\n".encode("utf-16"), "byte 0xff at offset 0")])
def test_a_recipe_that_is_not_utf8_is_one_line(tmp_path, raw, where):
    """A Latin-1 comment or a file saved as UTF-16 was a UnicodeDecodeError traceback (exit 1)."""
    recipe = tmp_path / "mine.yaml"
    recipe.write_bytes(raw)
    with pytest.raises(UserError) as error:
        build_config(str(recipe))
    assert str(error.value) == f"{recipe}: not UTF-8 ({where}); save the recipe as UTF-8 YAML"


def test_a_recipe_path_reads_the_file_named_not_one_with_yaml_added(tmp_path, monkeypatch):
    """An absolute path read PATH.yaml where both existed: it was joined to the packaged recipes' folder."""
    (tmp_path / "mine").write_text("train:\n  max_steps: 1\n")
    (tmp_path / "mine.yaml").write_text("train:\n  max_steps: 3\n")
    assert build_config(str(tmp_path / "mine")).train.max_steps == 1
    monkeypatch.chdir(tmp_path)
    assert build_config("mine").train.max_steps == 1 and build_config("./mine.yaml").train.max_steps == 3
    packaged = pathlib.Path(__file__).resolve().parents[1] / "llm" / "recipes" / "demo.yaml"
    assert build_config("demo").train.max_steps == build_config(str(packaged)).train.max_steps


def test_unknown_recipe_lists_the_packaged_ones():
    with pytest.raises(UserError, match="minimind-26m"):
        build_config("no-such-recipe")


def test_ds_config_auto_values_are_filled_from_the_run_config():
    cfg = build_config("demo", ["train.grad_accum=3", "train.precision=bf16"])
    raw, source = load_ds_config(None, "pretrain")
    ds = resolve_ds_config(raw, cfg, world_size=2, source=source, zero_stage=3)
    t = cfg.train
    assert ds["train_micro_batch_size_per_gpu"] == t.micro_batch_size and ds["gradient_accumulation_steps"] == 3
    assert ds["train_batch_size"] == t.micro_batch_size * 3 * 2
    assert ds["bf16"]["enabled"] is True and ds["gradient_clipping"] == t.grad_clip
    assert ds["optimizer"]["params"]["lr"] == t.lr and ds["optimizer"]["params"]["betas"] == [t.beta1, t.beta2]
    assert ds["zero_optimization"]["stage"] == 3
    assert "auto" not in json.dumps(ds)
    for clip in (0.0, 0.5):  # not the default of 1.0, the one value the assertion above could not tell apart
        cfg = build_config("demo", [f"train.grad_clip={clip}"])
        assert resolve_ds_config(raw, cfg, world_size=1, source=source, zero_stage=2)["gradient_clipping"] == clip


def test_ds_config_conflict_names_both_sides(tmp_path):
    cfg = build_config("demo")
    raw, _ = load_ds_config(None, "pretrain")
    raw["optimizer"]["params"]["lr"] = 0.5
    with pytest.raises(UserError, match=r"'optimizer.params.lr' is 0.5 but train.lr is 0.003"):
        resolve_ds_config(raw, cfg, 1, "x.json")
    raw, _ = load_ds_config(None, "pretrain")
    raw["fp16"] = {"enabled": True}
    with pytest.raises(UserError, match="'fp16.enabled' is true but this run trains in fp32 "):
        resolve_ds_config(raw, cfg, 1, "x.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{\n  oops\n}")
    with pytest.raises(UserError, match="bad.json:2:3: invalid JSON"):
        load_ds_config(bad, "pretrain")


@pytest.mark.parametrize("key, run_key", [("gradient_accumulation_steps", "train.grad_accum"),
                                          ("train_micro_batch_size_per_gpu", "train.micro_batch_size")])
def test_ds_config_true_is_not_taken_for_the_number_1(key, run_key):
    """true equals 1 to Python: a "gradient_accumulation_steps": true passed as 1 where the run's was 1."""
    cfg = build_config("demo", ["train.grad_accum=1", "train.micro_batch_size=1"])
    raw, _ = load_ds_config(None, "pretrain")
    raw[key] = True
    with pytest.raises(UserError, match=f"'{key}' is true but {run_key} is 1; "):
        resolve_ds_config(raw, cfg, 1, "x.json")


@pytest.mark.parametrize("change, message", [
    ({"zero_optimization": "yes"}, "x.json: 'zero_optimization' must be a JSON object {...}, got \"yes\""),
    ({"optimizer": [1]}, r"x.json: 'optimizer' must be a JSON object {...}, got \[1\]"),
    ({"bf16": True}, "x.json: 'bf16' must be a JSON object {...}, got true"),
    ({"fp16": None}, "x.json: 'fp16' must be a JSON object {...}, got null"),
    ({"optimizer": {"type": "AdamW", "params": 3}}, "x.json: 'optimizer.params' must be a JSON object"),
    ({"optimizer": {"type": "NoSuchOpt", "params": {}}},
     "x.json: 'optimizer.type' is \"NoSuchOpt\", not an optimizer DeepSpeed has: one of adagrad, adam, adamw"),
    ({"optimizer": {"params": {}}}, "x.json: 'optimizer.type' is null, not an optimizer DeepSpeed has"),
    # torch's optimizers refused these as every rank built them: a traceback a rank, exit 1
    ({"optimizer": {"type": "SGD", "params": {"momentum": -1}}, "zero_optimization": {"stage": 0}},
     r"x.json: 'optimizer' SGD refuses its params \(Invalid momentum value: -1\)"),
    ({"optimizer": {"type": "SGD", "params": {"momentum": "x"}}, "zero_optimization": {"stage": 0}},
     "x.json: 'optimizer' SGD refuses its params"),
    ({"optimizer": {"type": "SGD", "params": {"nesterov": True}}, "zero_optimization": {"stage": 0}},
     r"x.json: 'optimizer' SGD refuses its params \(Nesterov momentum requires a momentum"),
    ({"optimizer": {"type": "RMSprop", "params": {"alpha": -3}}, "zero_optimization": {"stage": 0}},
     r"x.json: 'optimizer' RMSprop refuses its params \(Invalid alpha value: -3\)"),
    ({"optimizer": {"type": "LBFGS", "params": {}}, "zero_optimization": {"stage": 0}},
     r"x.json: 'optimizer' LBFGS refuses its params \(LBFGS doesn't support per-parameter options"),
    ({"optimizer": {"type": "AdamW", "params": {"amsgrad": "yes"}}},
     "x.json: 'optimizer.params.amsgrad': DeepSpeed's FusedAdam has no AMSGrad; remove it, or add \"torch_adam\": "
     "true for torch's"),
    ({"optimizer": {"type": "Rprop", "params": {"etas": [1]}}, "zero_optimization": {"stage": 0}},
     r"x.json: 'optimizer' Rprop refuses its params \(.*\)"),  # an IndexError
    ({"zero_optimization": {"stage": True}}, "x.json: zero_optimization.stage must be 0, 1, 2 or 3, got True"),
    ({"optimizer": {"type": "lr_scheduler", "params": {}}}, "'optimizer.type' is \"lr_scheduler\", not an optimizer"),
])
def test_ds_config_sections_of_the_wrong_shape_are_refused(change, message):
    raw, _ = load_ds_config(None, "pretrain")
    with pytest.raises(UserError, match=message):
        resolve_ds_config({**raw, **change}, build_config("demo", ["train.precision=fp32"]), 1, "x.json")


@pytest.mark.parametrize("optimizer, change", [
    ("adam", {}), ("AdamW", {}),
    ("Lion", {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}),  # DeepSpeed's CPU Lion
    ("SGD", {"zero_allow_untested_optimizer": True}),
])
def test_ds_config_takes_deepspeeds_and_torchs_optimizers(optimizer, change):
    raw, _ = load_ds_config(None, "pretrain")
    raw["optimizer"]["type"] = optimizer
    ds = resolve_ds_config({**raw, **change}, build_config("demo", ["train.precision=fp32"]), 1, "x.json")
    assert ds["optimizer"]["type"] == optimizer


def test_ds_config_file_that_is_no_object_or_a_directory_is_refused(tmp_path):
    listing = tmp_path / "list.json"
    listing.write_text("[1, 2, 3]")
    with pytest.raises(UserError, match=r"list.json: the DeepSpeed config must be a JSON object {...}, got \[1, 2, 3"):
        load_ds_config(listing, "pretrain")
    with pytest.raises(UserError, match=f"{tmp_path}: is a directory; the DeepSpeed config is a JSON file"):
        load_ds_config(tmp_path, "pretrain")
    with pytest.raises(UserError, match="missing.json: DeepSpeed config not found"):
        load_ds_config(tmp_path / "missing.json", "pretrain")
    with pytest.raises(UserError, match="^/dev/null: not a regular file; the DeepSpeed config is a JSON file$"):
        load_ds_config("/dev/null", "pretrain")  # it was 'not found'


def test_a_shipped_ds_config_is_found_by_name_from_any_directory(tmp_path, monkeypatch):
    """`--deepspeed ds_configs/pretrain_zero3.json`, as the README writes it, was not found outside the checkout."""
    monkeypatch.chdir(tmp_path)
    shipped = DS_CONFIG_DIR / "pretrain_zero3.json"
    for name in ("ds_configs/pretrain_zero3.json", "pretrain_zero3"):
        assert load_ds_config(name, "pretrain") == (json.loads(shipped.read_text()), str(shipped))
    (tmp_path / "ds_configs").mkdir()
    (tmp_path / "ds_configs" / "pretrain_zero3.json").write_text('{"steps_per_print": 7}')  # a user's own wins
    assert load_ds_config("ds_configs/pretrain_zero3.json", "pretrain")[0] == {"steps_per_print": 7}
    with pytest.raises(UserError, match=r"^--deepspeed is empty: give a JSON file or a shipped name, or leave the "
                                        r"option out for the stage's own \(sft\)$"):
        load_ds_config("", "sft")
    for missing in ("pretrain_zero4", "ds_configs/pretrain_zero4.json", "pretrain_zero3.json"):
        with pytest.raises(UserError, match=f"^{missing}: DeepSpeed config not found \\(give a JSON file, or a "
                                            "shipped one by name: distill, dpo, grpo, pretrain, pretrain_zero3, "
                                            "sft\\)$"):
            load_ds_config(missing, "pretrain")


@pytest.mark.parametrize("overrides", [
    [], ["model.tie_embeddings=true"], ["model.qk_norm=true", "model.n_kv_heads=1"], ["model.hidden_dim=200"],
    ["model.moe=true", "model.n_experts=4", "model.n_experts_per_token=2", "model.n_shared_experts=1"],
])
def test_the_parameter_count_of_a_config_is_the_models(overrides):
    from llm.model import Transformer

    cfg = build_config("demo", ["model.vocab_size=300", "model.n_layers=2", *overrides]).model
    assert cfg.parameter_count == Transformer(cfg).num_parameters()


def _cgroup_tree(root: pathlib.Path, limits: dict[str, str], membership: str) -> pathlib.Path:
    for file, limit in limits.items():
        (root / file).parent.mkdir(parents=True, exist_ok=True)
        (root / file).write_text(limit + "\n")
    (root / "cgroup").write_text(membership)
    return root / "cgroup"


def test_the_memory_a_cgroup_leaves_free_is_its_limit_less_its_working_set(tmp_path, monkeypatch):
    """The whole limit was taken as free: a KV cache that the group's own model (or its other processes) left no
    room for was written in full, and the OOM killer ended the process. The inactive page cache, which the kernel
    drops first, is not counted as used."""
    from llm.model import host_memory

    gib = 1 << 30
    membership = _cgroup_tree(tmp_path, {"memory.max": "max", "job/memory.max": str(4 * gib),
                                         "job/memory.current": str(3 * gib),
                                         "job/memory.stat": f"anon {gib}\ninactive_file {gib // 2}\nactive_file 0\n",
                                         "memory/memory.limit_in_bytes": str(8 * gib),
                                         "memory/memory.usage_in_bytes": str(7 * gib)},
                               "0::/job\n5:memory:/\n")
    assert sorted(host_memory.cgroup_memory(tmp_path, membership)) == [(4 * gib, 5 * gib // 2), (8 * gib, 7 * gib)]
    monkeypatch.setattr(host_memory, "CGROUP_ROOT", tmp_path)
    monkeypatch.setattr(host_memory, "MEMBERSHIP", membership)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(total=64 * gib, available=32 * gib))
    assert host_memory.free_memory() == (gib, "the 1.0 GiB of memory the limit of this process's cgroup (a container's "
                                              "or a job's) leaves free")
    (tmp_path / "memory" / "memory.usage_in_bytes").write_text(str(gib))  # the v1 group's limit leaves less now
    assert host_memory.free_memory()[0] == 3 * gib // 2


@pytest.mark.parametrize("limits, membership, expected", [
    # cgroup v2: a SLURM job's group below an unlimited container root, an unlimited step below the job
    ({"memory.max": "max", "slurm/job_7/memory.max": "1073741824", "slurm/job_7/step_0/memory.max": "max"},
     "0::/slurm/job_7/step_0\n", [1 << 30]),
    # cgroup v1 (the memory controller's own hierarchy, beside others): every level that sets one
    ({"memory/memory.limit_in_bytes": "9223372036854771712", "memory/docker/abc/memory.limit_in_bytes": "2147483648"},
     "12:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n0::/\n", [2 << 30, 9223372036854771712]),
    ({}, "0::/gone/away\n", []),  # a group this process cannot see (another namespace's path)
])
def test_cgroup_memory_limits_of_nested_groups_and_of_cgroup_v1(tmp_path, monkeypatch, limits, membership, expected):
    """Only the v2 root's memory.max was read: a SLURM job's nested limit and every v1 limit let a model through that
    then failed to allocate."""
    from llm.model import host_memory

    membership_file = _cgroup_tree(tmp_path, limits, membership)
    assert sorted(host_memory.cgroup_memory_limits(tmp_path, membership_file)) == sorted(expected)
    monkeypatch.setattr(host_memory, "CGROUP_ROOT", tmp_path)
    monkeypatch.setattr(host_memory, "MEMBERSHIP", membership_file)
    assert host_memory.usable_memory() == min([psutil.virtual_memory().total, *expected])


def test_a_model_that_does_not_fit_names_its_size_and_the_memory(monkeypatch):
    from llm.model import host_memory

    cfg = build_config("demo", ["model.vocab_size=300"]).model
    monkeypatch.setattr(host_memory, "usable_memory", lambda: 4 * cfg.parameter_count * 2)
    host_memory.check_fits_in_memory(cfg, copies=2)  # exactly fits
    with pytest.raises(UserError) as error:
        host_memory.check_fits_in_memory(cfg, copies=3, remedy=": use fewer ranks")
    gib = 4 * cfg.parameter_count / 2**30
    assert str(error.value) == (
        f"the model has {cfg.parameter_count:,} parameters, {gib:,.1f} GiB in fp32; this host builds 3 copies of it "
        "(each rank's model, and its frozen reference where the stage has one) before DeepSpeed partitions them, "
        f"{3 * gib:,.1f} GiB: more than the limit of this process's cgroup (a container's or a job's): "
        f"{2 * gib:,.1f} GiB of memory: use fewer ranks")
    monkeypatch.setattr(host_memory, "usable_memory", lambda: psutil.virtual_memory().total)
    with pytest.raises(UserError, match=r"GiB: more than this host's [\d,.]+ GiB of memory$"):
        host_memory.check_fits_in_memory(dataclasses.replace(cfg, vocab_size=10**11), copies=3)


def test_a_distilled_model_counts_its_teacher_beside_each_copy(monkeypatch):
    """Each rank builds its teacher in fp32 beside its model: a teacher ten times the student's size was left out, and
    a host that held the students but not the teachers went to the OOM killer."""
    from llm.model import host_memory

    student = build_config("demo", ["model.vocab_size=300"]).model
    teacher = dataclasses.replace(student, dim=4 * student.dim)
    both = 4 * (student.parameter_count + teacher.parameter_count)
    monkeypatch.setattr(host_memory, "usable_memory", lambda: 2 * both - 1)
    host_memory.check_fits_in_memory(student, copies=2)  # the students alone fit
    with pytest.raises(UserError) as error:
        host_memory.check_fits_in_memory(student, copies=2, teacher=teacher)
    assert f"; this host builds 2 copies of it (each rank's model, and its frozen reference where the stage has " \
           f"one), and beside each copy a teacher of {teacher.parameter_count:,} parameters before DeepSpeed " \
           f"partitions them, {2 * both / 2**30:,.1f} GiB: more than" in str(error.value)


def test_generations_that_do_not_fit_name_whose_memory_is_short(monkeypatch):
    """`bench generate`'s check said "this host's" memory even where a cgroup's lower limit was the one exceeded."""
    from llm.model import host_memory

    cfg = build_config("demo", ["model.vocab_size=300"]).model
    monkeypatch.setattr(host_memory, "usable_memory", lambda: 2**30)
    host_memory.check_generation_fits_in_memory(cfg, batch=1, positions=18)
    with pytest.raises(UserError) as error:
        host_memory.check_generation_fits_in_memory(cfg, batch=10**6, positions=18)
    assert re.fullmatch(r"--batch 1000000 of 18 positions needs about [\d,.]+ GiB for its generations on the CPU "
                        r"\(KV cache, attention, logits\), more than the limit of this process's cgroup \(a "
                        r"container's or a job's\): 1\.0 GiB; lower --batch or the token counts", str(error.value))
    monkeypatch.setattr(host_memory, "usable_memory", lambda: psutil.virtual_memory().total)
    with pytest.raises(UserError, match=r"more than this host's [\d,.]+ GiB; lower --batch"):
        host_memory.check_generation_fits_in_memory(cfg, batch=10**9, positions=18)


@pytest.mark.parametrize("dim, n_heads", [(160, 4), (288, 4), (1024, 4), (64, 4)])  # head dims 40, 72, 256, 16
def test_triton_kernels_with_a_head_dim_the_attention_kernel_refuses_are_refused_at_validation(dim, n_heads):
    """They passed validation and job setup, then died at step 1 with the kernel's ValueError."""
    with pytest.raises(UserError) as refused:
        build_config("demo", [f"model.dim={dim}", f"model.n_heads={n_heads}", "model.n_kv_heads=null",
                              "model.kernels=triton"])
    assert str(refused.value) == (
        f"model.kernels=triton: the attention kernel takes head dims 32 to 128 in steps of 16, got model.dim/"
        f"model.n_heads = {dim}/{n_heads} = {dim // n_heads}; use model.kernels=auto or torch")
    for choice in ("auto", "torch"):  # the torch path takes any head dim
        build_config("demo", [f"model.dim={dim}", f"model.n_heads={n_heads}", "model.n_kv_heads=null",
                              f"model.kernels={choice}"])
    model = build_config("demo", ["model.dim=384", "model.n_heads=4", "model.kernels=triton"]).model
    assert model.attention_head_dim == 96


@pytest.mark.parametrize("stage", ["dpo", "grpo"])
def test_dropout_is_refused_where_the_policy_is_scored_against_its_reference(stage, tmp_path):
    """A recipe with model.dropout trained DPO and GRPO with dropout in the policy's forward and none in the
    reference's: DPO's first loss was 0.7147, not ln 2, GRPO's first KL 0.0007, and the noise was trained on. A run
    an earlier version trained so is still read (loaded, exported, chatted with)."""
    from llm.config import check_new_run

    sets = [f"train.stage={stage}", "train.init_from=runs/sft", "model.dropout=0.1"]
    cfg = build_config("demo", sets + (["grpo.prompts=[p.jsonl]", "grpo.reward=[length]"] if stage == "grpo" else []))
    with pytest.raises(UserError, match=rf"^model\.dropout is 0\.1, but {stage.upper()} scores the policy against its "
                                        "frozen reference, which runs without dropout"):
        check_new_run(cfg)
    cfg.save(tmp_path / "config.yaml")
    assert rundir.recorded_config(tmp_path)["model"]["dropout"] == 0.1  # read as it was recorded
    check_new_run(build_config("demo", ["train.stage=sft", "train.init_from=runs/base", "model.dropout=0.1"]))


LAUGHS = "".join(f"  - &b{i} [" + ", ".join([f"*b{i - 1}"] * 10 if i else ["x"] * 10) + "]\n" for i in range(10))
"""A YAML list whose aliases make a billion strings of its 10 lines."""


@pytest.mark.parametrize("edit, reason", [
    (lambda text: text.replace("max_steps: 2", "max_steps: " + "1" * 5000),
     "Exceeds the limit (4300 digits) for integer string conversion"),  # a ValueError traceback
    (lambda text: text.replace("max_steps: 2", "max_steps: " + "[" * 5000 + "]" * 5000), "nested too deeply"),
    (lambda text: text.replace("  sample_prompts: []\n", "  sample_prompts:\n" + LAUGHS),  # a MemoryError traceback
     "config key 'train.sample_prompts' expects a list of strings, got [["),
])
def test_a_hostile_config_yaml_in_a_run_directory_is_one_line(tmp_path, edit, reason):
    """A run directory from elsewhere is untrusted: its config.yaml's huge integer, deep nesting or billion
    laughs (whose every string the error message wrote out) ended in tracebacks."""
    build_config("demo", ["train.max_steps=2", "train.sample_prompts=[]"]).save(tmp_path / rundir.CONFIG_FILE)
    path = tmp_path / rundir.CONFIG_FILE
    path.write_text(edit(path.read_text()))
    with pytest.raises(UserError) as error:
        rundir.recorded_config(tmp_path)
    assert str(error.value).startswith(f"{path} is damaged (") and reason in str(error.value)
    assert len(str(error.value)) < 1000


def test_an_integer_too_long_to_read_in_a_set_or_a_recipe_is_one_line(tmp_path):
    with pytest.raises(UserError, match=r"^config key 'train.max_steps' expects int, got '1111.*\.\.\..*1111'$"):
        build_config("demo", ["train.max_steps=" + "1" * 5000])
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("train:\n  max_steps: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(UserError, match=f"^{recipe}: invalid YAML \\(nested too deeply\\)$"):
        build_config(str(recipe), [])


def test_every_expert_may_be_routed_to_each_token():
    assert build_config("demo", ["model.moe=true", "model.n_experts=4", "model.n_experts_per_token=4"]).model \
        .n_experts_per_token == 4


@pytest.mark.parametrize("override, refusal", [
    ("grpo.group_size=1", "grpo.group_size must be at least 2 (advantages compare a group), got 1"),
    ("model.n_layers=true", "config key 'model.n_layers' expects int, got True"),  # a bool is no count
])
def test_values_that_parse_but_mean_nothing_are_refused(override, refusal):
    grpo = ["train.stage=grpo", "train.init_from=x", "grpo.prompts=p.jsonl"]
    with pytest.raises(UserError, match=re.escape(refusal)):
        build_config("demo", [*grpo, override])
