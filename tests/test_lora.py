"""LoRA: the --lora spec and its errors, adapters that start at the base model exactly, only adapters trained and
saved, SFT (ZeRO-2) and DPO (ZeRO-3) on 2 ranks, GRPO on ZeRO-3, exact resume, and a merged export equal to the
unmerged model."""

import json
import math
import re
import shutil

import pytest
import torch
import torch.nn as nn
import yaml
from forked_ranks import run_job

from conftest import BENCH_TINY, FIXTURES, TINY, run_cli, train_args, zerollm_here
from llm.bench import trainable_parameters, write_random_conversations
from llm.config import LORA_TARGETS, LoRAConfig, ModelConfig, build_config, parse_lora_spec
from llm.data.datasets import PackedConversations
from llm.data.prepare import prepare
from llm.errors import UserError
from llm.export import export_model, import_model
from llm.loading import consolidated_weights, load_lora_model, load_trained_model, trained_config
from llm.model import Transformer
from llm.model.lora import apply_lora, is_adapter_key, merge, parameter_counts
from llm.train import checkpoint
from llm.train.checkpoint import mismatch_reason, restricted_unpickling
from llm.train.engine import param_groups
from llm.train.job import check_same_shape

LORA = "r=4,alpha=8,targets=wq,wk,wv,wo,w1,w2,w3,dropout=0.05"
LORA_NO_DROPOUT = LORA.replace("dropout=0.05", "dropout=0")
"""Dropout masks are drawn per rank, so only a run without dropout repeats itself on another number of ranks."""
TRAINABLE = 2 * 4 * (2 * (64 + 64) + 2 * (64 + 32) + 3 * (64 + 192))
"""Adapter parameters of the TINY model at r=4: per layer wq, wo (64 -> 64), wk, wv (64 -> 32), w1, w2, w3 (64 <->
192)."""


def _metrics_lines(run):
    return (run / "metrics.jsonl").read_text().splitlines()


def _metrics(run):
    return [json.loads(line) for line in _metrics_lines(run)]


def _tiny(**changes) -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32,
                                   **changes))


# ---- the spec ---------------------------------------------------------------------------------------

def test_the_lora_spec_sets_the_lora_keys():
    overrides = parse_lora_spec("r=16, alpha=32,targets=wq,wk,wv,dropout=0.05")
    cfg = build_config("demo", ["train.stage=sft", *overrides], paths={"train.init_from": "base"})
    assert (cfg.lora.r, cfg.lora.alpha, cfg.lora.targets, cfg.lora.dropout) == (16, 32.0, ["wq", "wk", "wv"], 0.05)
    assert cfg.lora.scale == 2.0
    default = build_config("demo", ["train.stage=sft", "lora.r=8"], paths={"train.init_from": "base"}).lora
    assert default.targets == list(LORA_TARGETS) and default.scale == 2.0 and default.dropout == 0.0
    assert build_config("demo").lora.r == 0  # off unless asked for
    octal = build_config("demo", ["train.stage=sft", *parse_lora_spec("r=010,alpha=010")],
                         paths={"train.init_from": "base"}).lora  # YAML 1.1 read 010 as octal 8
    assert (octal.r, octal.alpha) == (10, 10.0)
    # spaces around '=' were kept: 'targets ' an unknown key, ' 8' not a number, ' wq' an unknown module
    assert parse_lora_spec("r = 4, alpha= 8,targets = wq, wv") == parse_lora_spec("r=4,alpha=8,targets=wq,wv")
    with pytest.raises(UserError, match=r"^lora.targets is empty; name some of"):  # was "unknown module ''"
        build_config("demo", ["train.stage=sft", *parse_lora_spec("r=4,targets=")], paths={"train.init_from": "b"})


@pytest.mark.parametrize("spec, message", [
    ("r=4,rank=8", "--lora: unknown key 'rank' in 'rank=8'; keys are r, alpha, targets, dropout"),
    ("r=0", "--lora: r must be a positive integer, got '0'"),
    ("r=four", "--lora: r must be a positive integer, got 'four'"),
    ("r=4,dropout=1", r"--lora: dropout must be a number in \[0, 1\), got '1'"),
    ("r=4,alpha=-2", "--lora: alpha must be a positive number, got '-2'"),
    ("r=4,alpha=inf", "--lora: alpha must be a positive number, got 'inf'"),
    ("r=4,alpha=nan", "--lora: alpha must be a positive number, got 'nan'"),
    ("r=\u0668", "--lora: r must be a positive integer, got '\u0668'"),  # int() read Arabic-Indic 8: rank 8
    ("r=4,alpha=1_6", "--lora: alpha must be a positive number, got '1_6'"),  # float() read 16
    ("alpha=8", "give the rank, e.g. r=16"),
    ("r=4,wq", "--lora: 'wq' is not key=value"),
    ("r=4,r=8", "--lora: 'r' is given twice"),
])
def test_bad_lora_specs_name_the_bad_piece(spec, message):
    with pytest.raises(UserError, match=message):
        parse_lora_spec(spec)


def test_lora_keys_are_checked_against_the_model(tmp_path):
    with pytest.raises(UserError, match="lora.targets: unknown module 'q_proj'; the model's linear layers LoRA can "
                                        "adapt are wq, wk, wv, wo, w1, w2, w3"):
        build_config("demo", ["train.stage=sft", *parse_lora_spec("r=4,targets=wq,q_proj")],
                     paths={"train.init_from": "base"})
    with pytest.raises(UserError, match="lora.targets: unknown module 'q_proj'"):  # without LoRA too: it was accepted
        build_config("demo", ["lora.targets=[q_proj]"])
    with pytest.raises(UserError, match="lora.targets names wq more than once"):  # accepted, printed 'on wq,wq'
        build_config("demo", ["train.stage=sft", *parse_lora_spec("r=4,targets=wq,wv,wq")],
                     paths={"train.init_from": "base"})
    with pytest.raises(UserError, match="LoRA on sft needs --init-from"):
        build_config("demo", ["train.stage=sft", "lora.r=4"])
    with pytest.raises(UserError, match="use it with train sft, dpo or grpo .* not with distill"):
        build_config("demo", ["train.stage=distill", "lora.r=4", "train.teacher=t"], paths={"train.init_from": "base"})
    result = run_cli("train", "pretrain", "--recipe", "demo", "--data", tmp_path, "--out", tmp_path / "run",
                     "--lora", "r=4")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["zerollm: error: LoRA adapts a trained model: use it with train sft, "
                                                  "dpo or grpo (--init-from the model to adapt), not with pretrain"]


def test_lora_targets_are_the_models_own_linear_layers():
    for model in (_tiny(), _tiny(moe=True, n_shared_experts=1)):
        linear = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)}
        assert linear - {"output", "router"} == set(LORA_TARGETS)
        shapes = {(name.rsplit(".", 1)[-1], (m.in_features, m.out_features)) for name, m in model.named_modules()
                  if name.rsplit(".", 1)[-1] in LORA_TARGETS}
        assert shapes == set(model.cfg.linear_shapes.items())  # what validate_lora bounds lora.r by


def test_lora_rank_is_bounded_by_the_adapted_layers():
    def sft(spec):
        return build_config("demo", ["train.stage=sft", *parse_lora_spec(spec)], paths={"train.init_from": "base"})

    shapes = build_config("demo").model.linear_shapes
    smallest = min(min(shape) for shape in shapes.values())
    assert sft(f"r={smallest}").lora.r == smallest
    with pytest.raises(UserError, match=rf"lora.r \(99999999\) exceeds {smallest}, the smallest dimension of the "
                                        r"adapted layers \(wq, wk, wv, wo, w1, w2, w3\)"):
        sft("r=99999999")
    only_ffn = min(min(shapes[name]) for name in ("w1", "w2"))
    assert sft(f"r={only_ffn},targets=w1,w2").lora.r == only_ffn
    with pytest.raises(UserError, match=rf"lora.r \({only_ffn + 1}\) exceeds {only_ffn}"):
        sft(f"r={only_ffn + 1},targets=w1,w2")


# ---- the module -------------------------------------------------------------------------------------

def _lora(spec: str = "r=4,targets=wq,wv"):
    return build_config("demo", ["train.stage=sft", *parse_lora_spec(spec)], paths={"train.init_from": "b"}).lora


def test_adapters_start_at_the_base_model_exactly_and_are_all_that_trains():
    base = _tiny()
    tokens = torch.randint(0, 97, (2, 16))
    expected = base(tokens).logits
    cfg = _lora("r=4,dropout=0.1")
    model = apply_lora(base, cfg, seed=1)
    assert torch.equal(model.train()(tokens).logits, expected)  # B = 0: the same logits, dropout or not
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(is_adapter_key(name) for name in trainable)
    assert len(trainable) == 2 * 2 * len(LORA_TARGETS)
    optimized = {id(p) for group in param_groups(model, 0.1) for p in group["params"]}
    assert optimized == {id(p) for p in model.parameters() if p.requires_grad}
    assert parameter_counts(model)[0] == sum(p.numel() for p in model.parameters() if p.requires_grad)
    again = apply_lora(_tiny(), cfg, seed=1)  # every rank draws the same A
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))


@pytest.mark.parametrize("shape", [{"moe": True}, {"qkv_bias": True}])
def test_merge_gives_a_plain_model_with_the_same_logits(shape):
    model = apply_lora(_tiny(**shape), _lora("r=4"), seed=0).eval()
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("lora_b", "bias")):  # adapters and biases that matter
                param.normal_(std=0.05)
    merged = merge(model)
    assert type(merged) is Transformer and set(merged.state_dict()) == set(_tiny(**shape).state_dict())
    tokens = torch.randint(0, 97, (2, 16))
    unmerged = model(tokens).logits
    assert not torch.allclose(unmerged, _tiny(**shape)(tokens).logits, atol=1e-3)  # the adapters matter
    torch.testing.assert_close(merged(tokens).logits, unmerged, atol=1e-5, rtol=0)


def _with_adapters(model: Transformer) -> Transformer:
    """`model` with every B of its adapters nonzero (they start at 0: the adapters would change nothing)."""
    torch.manual_seed(5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("lora_b"):
                param.normal_()
    return model


def test_a_merged_bf16_weight_is_summed_in_fp32_and_rounded_once():
    layer = _with_adapters(apply_lora(_tiny().to(torch.bfloat16), _lora(), seed=1)).layers[0].attention.wq
    exact = layer.weight.float() + layer.scale * (layer.lora_b.float() @ layer.lora_a.float())
    assert torch.equal(layer.merged_weight(), exact.bfloat16())


def test_merge_keeps_the_models_mode():
    model = _with_adapters(apply_lora(_tiny(), _lora(), seed=1))
    assert not merge(model.eval()).training and merge(model.train()).training


def _shapes(model: Transformer, adapters_only: bool = True) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in model.state_dict().items() if is_adapter_key(k) or not adapters_only}


def test_a_checkpoint_that_is_not_the_configs_lora_says_why():
    """A LoRA checkpoint whose config.yaml gives another r, other targets or no LoRA, a whole model's checkpoint in a
    LoRA run, and a LoRA run's in another run, ended resume, export and generate in tracebacks (a size mismatch,
    missing keys, DeepSpeed's parameter layout); an adapter of a layer the config does not adapt was only listed."""
    cfg = _tiny().cfg
    saved = _shapes(apply_lora(_tiny(), _lora(), seed=1))
    assert mismatch_reason(saved, None, cfg, _lora()) is None
    assert mismatch_reason(saved, None, cfg, _lora("r=8,targets=wq,wv")) == (
        "size mismatch for layers.0.attention.wq.lora_a: [4, 32] in the checkpoint, [8, 32] in the config")
    assert mismatch_reason(saved, None, cfg, _lora("r=4,targets=wq,wk,wv")) == (
        "LoRA adapters missing: layers.0.attention.wk.lora_a, ...; lora.targets is wq,wk,wv in the config")
    assert mismatch_reason(saved | {"layers.0.attention.wk.lora_a": (4, 32)}, None, cfg, _lora()) == (
        "LoRA adapters unexpected: layers.0.attention.wk.lora_a, ...; lora.targets is wq,wv in the config")
    assert mismatch_reason(saved, None, cfg) == mismatch_reason(saved, None, cfg, LoRAConfig()) == (
        "it holds LoRA adapters (layers.0.attention.wq.lora_a, ...), but lora.r is 0 in the config")
    assert mismatch_reason(_shapes(_tiny(), adapters_only=False), True, cfg, _lora()) == (
        "it holds the whole model (tok_embeddings.weight, ...), but lora.r is 4 in the config: adapters alone")


def test_lora_dropout_applies_to_the_adapters_input_in_training_only():
    model = _with_adapters(apply_lora(_tiny(), _lora("r=4,targets=wq,wv,dropout=0.5"), seed=1))
    tokens = torch.randint(0, 97, (2, 16))
    evaluated = model.eval()(tokens).logits
    assert not torch.equal(model.train()(tokens).logits, evaluated)  # dropped inputs, in training
    torch.testing.assert_close(merge(model.eval())(tokens).logits, evaluated, atol=1e-5, rtol=0)  # none in eval


def test_the_adapters_a_matrices_follow_the_seed():
    first, second = (apply_lora(_tiny(), _lora(), seed=seed).layers[0].attention.wq.lora_a for seed in (1, 2))
    assert not torch.equal(first, second)


# ---- training ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def base(tokenizer_dir, tmp_path_factory):
    """A tiny random model exported with the test tokenizer: the frozen base of every run here."""
    out = tmp_path_factory.mktemp("base")
    torch.manual_seed(0)
    export_model(Transformer(build_config("demo", TINY).model), tokenizer_dir, out)
    return out


@pytest.fixture(scope="module")
def data(tokenizer_dir, tmp_path_factory):
    out = {}
    for kind, inputs in (("sft", [FIXTURES / "sft" / "messages_zh.jsonl", FIXTURES / "sft" / "alpaca_mixed.json"]),
                         ("dpo", [FIXTURES / "dpo"])):
        out[kind] = tmp_path_factory.mktemp(kind)
        prepare(kind, [str(p) for p in inputs], tokenizer_dir, out[kind], val_fraction=0.05, seq_len=64, workers=2,
                show_progress=False)
    return out


def _lora_args(stage, data_dir, out, base, *overrides, nproc=2, zero=2, lora=LORA):
    sets = [a for o in [*TINY, "data.seq_len=64", "train.precision=fp32", "train.max_steps=4", "train.save_every=2",
                        "train.keep_checkpoints=0", "train.eval_every=2", *overrides] for a in ("--set", o)]
    return ["train", stage, "--recipe", "demo", "--data", data_dir, "--out", out, "--init-from", base, "--lora", lora,
            "--nproc", nproc, "--zero-stage", zero, *sets]


@pytest.fixture(scope="module")
def runs(base, data, tmp_path_factory):
    """LoRA SFT under ZeRO-2 (no dropout) and LoRA DPO under ZeRO-3, 4 steps on 2 ranks each, saved at steps 2 and
    4. The SFT run is started beside its base and names it by a relative path; every later test loads it from
    another directory."""
    out = {}
    for stage, zero, extra in (("sft", 2, []), ("dpo", 3, ["train.micro_batch_size=2", "train.lr=1e-2"])):
        run = tmp_path_factory.mktemp(f"{stage}{zero}")
        relative = stage == "sft"
        result = run_job(*_lora_args(stage, data[stage], run, base.name if relative else base, *extra, zero=zero,
                                     lora=LORA_NO_DROPOUT if stage == "sft" else LORA),
                         cwd=base.parent if relative else None)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        out[stage] = run, result.stdout
    return out


def _saved_files(checkpoint):
    """Every file DeepSpeed wrote into a checkpoint folder, loaded."""
    with restricted_unpickling(checkpoint):
        return {p.name: torch.load(p, map_location="cpu", weights_only=True) for p in checkpoint.glob("*_states.pt")}


@pytest.mark.parametrize("stage", ["sft", "dpo"])
def test_lora_on_two_ranks_trains_and_saves_the_adapters_only(runs, stage):
    run, stdout = runs[stage]
    assert f"{stage}: LoRA r=4 on wq,wk,wv,wo,w1,w2,w3: {TRAINABLE / 1e6:.3f} M of " in stdout
    assert f"{stage}: peak memory " in stdout
    rows = _metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(math.isfinite(r["loss"]) for r in rows)
    if stage == "dpo":
        assert rows[0]["loss"] == pytest.approx(math.log(2), abs=1e-4)  # the policy starts as the reference
        assert rows[-1]["loss"] < rows[0]["loss"]
    else:
        assert rows[-1]["val_loss"] < rows[1]["val_loss"]
    for tag in ("global_step2", "global_step4"):
        saved = _saved_files(run / "checkpoints" / tag)
        modules = [s["module"] for name, s in saved.items() if "model_states" in name]
        assert modules and all(keys and all(map(is_adapter_key, keys)) for keys in map(list, modules))
        partitions = [t.numel() for name, s in saved.items() if "optim_states" in name
                      for key in ("fp32_flat_groups", "single_partition_of_fp32_groups")
                      for t in s["optimizer_state_dict"].get(key, [])]
        assert TRAINABLE <= sum(partitions) < TRAINABLE + 64  # the optimizer holds the adapters (and padding)
    weights = consolidated_weights(run)
    assert len(weights) == 2 * 2 * len(LORA_TARGETS) and all(map(is_adapter_key, weights))
    assert all(weights[k].abs().max() > 0 for k in weights if k.endswith("lora_b"))  # trained away from B = 0


@pytest.mark.parametrize("stage", ["sft", "dpo"])
def test_a_lora_checkpoint_that_config_yaml_no_longer_describes_is_one_line(runs, stage, tmp_path, one_rank_group):
    """config.yaml's lora.r edited after training (ZeRO-2's checkpoint and ZeRO-3's): resume ended every rank in
    DeepSpeed's traceback, and export and generate in torch's size mismatch."""
    run = tmp_path / "run"
    shutil.copytree(runs[stage][0], run)
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["lora"]["r"] = 8
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    cfg = trained_config(run)
    mismatch = (r"does not match config.yaml \(size mismatch for layers.0.attention.wq.lora_a: \[4, \d+\] in the "
                r"checkpoint, \[8, \d+\] in the config\)")
    with pytest.raises(UserError, match=rf"^{re.escape(str(run))}: checkpoint global_step4 {mismatch}: put config"):
        checkpoint.resume_tag(run, cfg.model, cfg.lora)
    with pytest.raises(UserError, match=rf"^{re.escape(str(run))}: checkpoint {mismatch}$"):
        load_trained_model(run)


def test_lora_resume_is_bit_exact(runs, base, data, tmp_path):
    """The ZeRO-3 DPO run, stopped after its step-2 checkpoint (the later one removed) and resumed, repeats the
    uninterrupted run's losses and adapters bit for bit."""
    straight = runs["dpo"][0]
    stopped = tmp_path / "stopped"
    shutil.copytree(straight, stopped)
    shutil.rmtree(stopped / "checkpoints" / "global_step4")
    (stopped / "checkpoints" / "latest").write_text("global_step2")
    result = run_job(*_lora_args("dpo", data["dpo"], stopped, base, "train.micro_batch_size=2", "train.lr=1e-2",
                                 zero=3), "--resume", "auto")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "resumed at step 2" in result.stdout
    assert [r["loss"] for r in _metrics(stopped)] == [r["loss"] for r in _metrics(straight)]
    a, b = consolidated_weights(straight), consolidated_weights(stopped)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_lora_run_on_two_ranks_resumes_on_one(runs, base, data, tmp_path):
    """The ZeRO-2 SFT run, stopped after its step-2 checkpoint, resumes on 1 rank (grad_accum 2 keeps the global
    batch) through DeepSpeed's universal checkpoint of the adapters alone, and repeats steps 3-4 of the 2-rank run."""
    straight = runs["sft"][0]
    stopped = tmp_path / "stopped"
    shutil.copytree(straight, stopped)
    shutil.rmtree(stopped / "checkpoints" / "global_step4")
    (stopped / "checkpoints" / "latest").write_text("global_step2")
    (stopped / "metrics.jsonl").write_text("".join(line + "\n" for line in _metrics_lines(stopped)[:2]))
    result = run_job(*_lora_args("sft", data["sft"], stopped, base, "train.grad_accum=2", nproc=1,
                                 lora=LORA_NO_DROPOUT),
                     "--resume", "auto")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "saved by 2 rank(s), this job has 1: converting it to a universal checkpoint" in result.stdout
    assert "resumed at step 2" in result.stdout
    rows, reference = _metrics(stopped), _metrics(straight)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in reference], rel=1e-4)
    saved = _saved_files(stopped / "checkpoints" / "global_step4")
    assert all(map(is_adapter_key, next(s["module"] for n, s in saved.items() if "model_states" in n)))
    a, b = consolidated_weights(straight), consolidated_weights(stopped)
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=0, atol=1e-5) for k in a)


def test_a_lora_resume_refuses_another_alpha_and_takes_the_targets_in_any_order(runs):
    """alpha scales the saved adapters: resumed with another, the run trained on, and its checkpoints merged at the
    new scale. The order of the targets does not change which modules have adapters; it was refused."""
    run = runs["sft"][0]
    saved, cfg = (build_config((run / "config.yaml").as_posix()) for _ in range(2))
    ds_config = json.loads((run / "ds_config.json").read_text())
    cfg.lora.targets = cfg.lora.targets[::-1]
    check_same_shape(run, saved, cfg, ds_config)
    cfg.lora.alpha = None  # its default, 2r: alpha 8 at r=4, the same scale
    check_same_shape(run, saved, cfg, ds_config)
    cfg.lora.alpha = 64.0
    with pytest.raises(UserError, match=r"cannot resume with these changes \(lora.alpha / lora.r 2.0 there, 16.0 "
                                        r"here\)"):
        check_same_shape(run, saved, cfg, ds_config)


def test_export_of_a_lora_run_is_the_merged_model(runs, tmp_path, monkeypatch, capfd):
    run = runs["sft"][0]
    code = zerollm_here(monkeypatch, "export", "--run", run, "--out", tmp_path / "export")
    assert code == 0, capfd.readouterr().err[-3000:]
    exported = import_model(tmp_path / "export").eval()
    assert not any(map(is_adapter_key, exported.state_dict()))
    unmerged = load_lora_model(run, build_config((run / "config.yaml").as_posix()))
    tokens = torch.randint(4, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(exported(tokens).logits, unmerged(tokens).logits, atol=1e-5, rtol=0)


def test_export_refuses_to_replace_the_base_of_the_run(runs, tmp_path, monkeypatch, capfd):
    """Exported into its own train.init_from, a LoRA run replaced its base with the merged model: the base was lost
    and the run could no longer be loaded ("its adapters were trained on ... put that base back")."""
    run, base = tmp_path / "run", tmp_path / "base"
    shutil.copytree(runs["sft"][0], run)
    trained_on = build_config((run / "config.yaml").as_posix()).train.init_from
    shutil.copytree(trained_on, base)
    (run / "config.yaml").write_text((run / "config.yaml").read_text().replace(trained_on, str(base)))
    before = {p.name: p.read_bytes() for p in base.iterdir() if p.is_file()}
    code = zerollm_here(monkeypatch, "export", "--run", run, "--out", base)
    assert (code, capfd.readouterr().err.strip().splitlines()[-1]) == (2, (
        f"zerollm: error: --out {base} is the run's train.init_from, a model it was trained from, which export would "
        "replace; a LoRA run is loaded onto it; choose another --out"))
    assert {p.name: p.read_bytes() for p in base.iterdir() if p.is_file()} == before


def test_a_lora_run_refuses_a_base_that_holds_other_weights(runs, data, tokenizer_dir, tmp_path):
    """The adapters belong to the base they were trained on; before, export merged them onto whatever
    train.init_from held (a retrained or swapped base) without a word, and a resume trained on."""
    run, other = tmp_path / "run", tmp_path / "other-base"
    shutil.copytree(runs["sft"][0], run)
    torch.manual_seed(1)
    export_model(Transformer(build_config("demo", TINY).model), tokenizer_dir, other)
    trained_on = build_config((run / "config.yaml").as_posix()).train.init_from
    (run / "config.yaml").write_text((run / "config.yaml").read_text().replace(trained_on, str(other)))
    refusal = (r"its adapters were trained on .*\(model.safetensors digest \w+; strided digest \w+\), but "
               rf"train.init_from {other} holds model.safetensors digest \w+; .* put that base")
    with pytest.raises(UserError, match=refusal):
        load_lora_model(run, build_config((run / "config.yaml").as_posix()))
    result = run_job(*_lora_args("sft", data["sft"], run, other, nproc=1, lora=LORA_NO_DROPOUT), "--resume", "auto")
    assert result.returncode == 2 and f"--init-from {other} (model.safetensors digest " in result.stderr
    assert f"not the base {run} was trained with" in result.stderr and "Traceback" not in result.stderr


def test_an_export_changed_only_in_its_middle_holds_other_weights(tokenizer_dir, tmp_path):
    """Export weights were identified by their size and first and last MiB: a base whose middle layers were
    retrained (or adapters merged into them) and saved over it at the same size was taken for the one the adapters
    were trained on, and they were merged onto it without a word. A record made before the strided part still
    matches the unchanged weights."""
    from llm.loading import weights_summary
    from llm.runtime.fingerprint import same_weights

    torch.manual_seed(0)
    export_model(Transformer(build_config("demo", [*TINY, "model.dim=256", "model.n_layers=4"]).model), tokenizer_dir,
                 tmp_path / "base")
    weights = tmp_path / "base" / "model.safetensors"
    before = weights_summary(tmp_path / "base", "--init-from")["weights"]
    assert weights.stat().st_size > 8 << 20 and same_weights(before.split("; strided")[0], before)
    with weights.open("r+b") as f:  # a layer's matrix in the middle, 64 KiB of it negated
        f.seek(weights.stat().st_size // 2)
        middle = f.read(1 << 16)
        f.seek(-len(middle), 1)
        f.write(bytes(b ^ 0x80 for b in middle))
    assert not same_weights(before, weights_summary(tmp_path / "base", "--init-from")["weights"])


def test_a_lora_run_is_loaded_onto_the_checkpoint_of_its_base_run_it_was_trained_on(pretrain_data, data, tmp_path):
    """A LoRA run of a run directory could no longer be loaded once that run trained on and saved a newer checkpoint
    ("put that base back"), though the checkpoint the adapters were trained on was still there."""
    base_run, run = tmp_path / "base", tmp_path / "lora"
    result = run_job(*train_args(pretrain_data, base_run, "train.max_steps=4", "train.save_every=2",
                                 "train.keep_checkpoints=0", "train.precision=fp32"))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    result = run_job(*_lora_args("sft", data["sft"], run, base_run, "train.max_steps=2", nproc=1,
                                 lora=LORA_NO_DROPOUT))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    cfg = build_config((run / "config.yaml").as_posix())
    tokens = torch.randint(0, 512, (1, 16))
    before = load_lora_model(run, cfg)(tokens).logits
    checkpoints = base_run / "checkpoints"  # the base trains on: a newer checkpoint, of other weights
    newer = checkpoints / "global_step6"
    shutil.copytree(checkpoints / "global_step2", newer)
    state = json.loads((newer / "client_state.json").read_text()) | {"step": 6}
    (newer / "client_state.json").write_text(json.dumps(state))
    manifest = json.loads((newer / "manifest.json").read_text())
    manifest["files"]["client_state.json"] = (newer / "client_state.json").stat().st_size
    (newer / "manifest.json").write_text(json.dumps(manifest))
    (checkpoints / "latest").write_text("global_step6")
    assert torch.equal(load_lora_model(run, cfg)(tokens).logits, before)
    resumed = run_job(*_lora_args("sft", data["sft"], run, base_run, "train.max_steps=3", nproc=1,
                                  lora=LORA_NO_DROPOUT), "--resume", "auto")  # training on would take the newest
    assert resumed.returncode == 2 and "not the base" in resumed.stderr, resumed.stderr[-3000:]
    shutil.rmtree(checkpoints / "global_step4")  # gone: the adapters have no base left
    with pytest.raises(UserError, match=rf"its adapters were trained on {base_run} \(run \w+ global_step4\), but "
                                        rf"train.init_from {base_run} holds run \w+ global_step6; .* put that base"):
        load_lora_model(run, cfg)


def test_a_lora_run_on_a_lora_run_keeps_its_context_and_its_bases_and_resumes_on_the_recorded_one(
        runs, base, data, tmp_path, monkeypatch, capfd):
    """A LoRA run made on a LoRA run, at a longer context than its base's: loaded and exported, it had its base's
    model.max_seq_len (eval and generate refused the context it trained at); `export --out` the base of its base
    replaced that model, and neither run could be loaded; resumed without --init-from, it was refused ("LoRA on sft
    needs --init-from"), though the run records its base and the resume reads the model's shape from there."""
    first = runs["sft"][0]
    longer = 2 * build_config((first / "config.yaml").as_posix()).model.max_seq_len
    run = tmp_path / "on_lora"
    sets = ["train.max_steps=2", f"model.max_seq_len={longer}"]
    result = run_job(*_lora_args("sft", data["sft"], run, first, *sets, nproc=1, lora=LORA_NO_DROPOUT))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert load_trained_model(run)[0].cfg.max_seq_len == longer
    assert zerollm_here(monkeypatch, "export", "--run", run, "--out", tmp_path / "export") == 0
    assert json.loads((tmp_path / "export" / "config.json").read_text())["max_position_embeddings"] == longer
    before = {p.name: p.read_bytes() for p in base.iterdir() if p.is_file()}
    capfd.readouterr()
    assert zerollm_here(monkeypatch, "export", "--run", run, "--out", base) == 2
    assert capfd.readouterr().err.strip().splitlines()[-1] == (
        f"zerollm: error: --out {base} is the train.init_from of {first}, a LoRA run this one's adapters build on: "
        "export would replace it, and neither run could be loaded any more; choose another --out")
    assert {p.name: p.read_bytes() for p in base.iterdir() if p.is_file()} == before
    args = _lora_args("sft", data["sft"], run, first, *sets, "train.max_steps=3", nproc=1, lora=LORA_NO_DROPOUT)
    at = args.index("--init-from")
    resumed = run_job(*args[:at], *args[at + 2:], "--resume", "auto")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resumed at step 2" in resumed.stdout and [r["step"] for r in _metrics(run)] == [1, 2, 3]


def test_lora_grpo_under_zero3_rolls_out_with_the_adapters(base, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"Tell me about {t}.", "answer": t})
                                 for t in ("kings", "love", "war", "night")) + "\n")
    (tmp_path / "myrewards.py").write_text(
        "def ascii_share(prompts, completions, **fields):\n"
        "    return [sum(c.isascii() for c in t) / max(1, len(t)) for t in completions]\n")
    run = tmp_path / "grpo"
    sets = [a for o in [*TINY, "train.precision=fp32", "train.micro_batch_size=8", "train.lr=1e-2",
                        "train.max_steps=3", "grpo.group_size=4", "grpo.max_new_tokens=6"] for a in ("--set", o)]
    result = run_job("train", "grpo", "--recipe", "demo", "--init-from", base, "--prompts", prompts, "--reward",
                     "myrewards:ascii_share", "--out", run, "--lora", LORA, "--zero-stage", 3, *sets, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "rollouts by the gathered model" in result.stdout and "grpo: LoRA r=4" in result.stdout
    rows = _metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[0]["kl"] == 0.0 and rows[-1]["kl"] > 0
    weights = consolidated_weights(run)
    assert all(map(is_adapter_key, weights)) and any(w.abs().max() > 0 for k, w in weights.items()
                                                     if k.endswith("lora_b"))


def test_bench_train_with_lora_sets_full_fine_tuning_beside_lora(monkeypatch, capfd):
    sets = [a for o in BENCH_TINY for a in ("--set", o)]
    code = zerollm_here(monkeypatch, "bench", "train", "--recipe", "demo", "--steps", 1, "--warmup", 0, "--lora", "r=4",
                        *sets)
    stdout, stderr = capfd.readouterr()  # this process's and its two training jobs'
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    table = stdout[stdout.index("bench train: recipe demo, SFT on random conversations"):]
    header, *rows = table.splitlines()[1:]
    assert header.split() == ["full", "fine-tuning", "LoRA", "r=4"]
    cells = {row[:26].strip(): row[26:].split() for row in rows}
    total = sum(p.numel() for p in Transformer(build_config("demo", TINY).model).parameters())
    assert cells["trainable parameters"] == [f"{total:,}", f"{TRAINABLE:,}"]
    assert cells["of all parameters"] == ["100.00", "%", f"{100 * TRAINABLE / (total + TRAINABLE):.2f}", "%"]
    assert all(float(v.replace(",", "")) > 0 for v in cells["tokens/s"] + cells["peak memory (MiB)"])


@pytest.mark.parametrize("extra", [[], ["--lora", "r=4"]])
def test_bench_train_given_lora_by_set_names_the_lora_option(monkeypatch, capsys, extra):
    """It said 'LoRA adapts a trained model: use it with train sft, dpo or grpo (--init-from the model to adapt),
    not with pretrain', advice for training, not for bench."""
    code = zerollm_here(monkeypatch, "bench", "train", "--recipe", "demo", "--steps", 1, "--set", "lora.r=8", *extra)
    assert code == 2
    assert capsys.readouterr().err == ("zerollm: error: bench train: give LoRA with --lora SPEC (e.g. --lora r=16), "
                                       "not --set lora.r: it measures LoRA beside full fine-tuning\n")


def test_bench_counts_trainable_parameters_and_writes_one_conversation_per_window(tmp_path):
    """What `bench train --lora` builds on."""
    full = build_config("demo", TINY)
    lora = build_config("demo", [*TINY, "train.stage=sft", *parse_lora_spec("r=4")], paths={"train.init_from": "b"})
    total = sum(p.numel() for p in Transformer(full.model).parameters())
    assert trainable_parameters(full) == (total, total)
    assert trainable_parameters(lora) == (TRAINABLE, total + TRAINABLE)
    write_random_conversations(tmp_path, 512, n_conversations=5, seq_len=32)
    windows = PackedConversations(tmp_path, "train", 32, pad_id=3)
    assert len(windows) == 5 and windows.padding_fraction == 0 and bool(windows[0]["loss_mask"].all())


def test_settings_no_part_of_the_run_reads_are_noted_once(monkeypatch, capsys, tmp_path):
    """`--set lora.alpha=64` without lora.r trained every weight with no word: the user meant adapters."""
    common = ["train", "sft", "--recipe", "demo", "--data", tmp_path / "none", "--out", tmp_path / "run"]
    assert zerollm_here(monkeypatch, *common, "--set", "lora.alpha=64", "--set", "lora.dropout=0.1") == 2
    err = capsys.readouterr().err
    assert err.count("note") == 1 and err.startswith(
        "zerollm: note: lora.alpha, lora.dropout set, but lora.r is 0: no LoRA, every weight trains (--set lora.r=N "
        "or --lora r=N for adapters)\n")
    for quiet in (["--set", "train.lr=1e-4"], ["--set", "lora.r=4", "--set", "lora.alpha=8"],
                  ["--set", "model.moe=true", "--set", "model.n_experts=8"]):
        zerollm_here(monkeypatch, *common, *quiet)
        assert "note" not in capsys.readouterr().err
    distill = "only `train distill` reads them: no teacher, nothing distilled"
    for stage, keys, why in (("sft", ["train.teacher=t", "train.distill_alpha=1"], distill),
                             ("pretrain", ["train.dpo_beta=0.5"], "only `train dpo` reads them"),
                             ("sft", ["grpo.group_size=4"], "only `train grpo` reads them"),
                             ("pretrain", ["model.n_experts=8", "model.n_shared_experts=1"],
                              "model.moe is false: a dense model, no experts (--set model.moe=true for a mixture of "
                              "experts)"),  # the dense model trained: the user meant experts
                             ("pretrain", ["model.rope_factor=4"], "model.rope_scaling is 'none': RoPE is not scaled "
                              "(--set model.rope_scaling=yarn or llama3 to extend it)"),
                             ("pretrain", ["model.yarn_beta_fast=16"], "only model.rope_scaling=yarn reads them"),
                             ("pretrain", ["model.llama3_low_freq_factor=2"],
                              "only model.rope_scaling=llama3 reads them")):
        zerollm_here(monkeypatch, *common[:1], stage, *common[2:], *[a for key in keys for a in ("--set", key)])
        named = ", ".join(key.split("=")[0] for key in keys)
        assert f"zerollm: note: {named} set, but {why}\n" in capsys.readouterr().err  # trained without a word
    from llm.cli import main

    monkeypatch.setenv("LOCAL_RANK", "0")  # a rank: the process that started it said it
    with pytest.raises(SystemExit):
        main([*map(str, common), "--set", "lora.alpha=64"])
    assert "note" not in capsys.readouterr().err


def test_a_lora_run_refuses_a_base_whose_config_changed(runs, base, tmp_path):
    """An edit of the base's config.json (its RoPE base, its norm epsilon) merged the adapters into another function
    without a word: only the base's weight files were compared."""
    run, moved = tmp_path / "run", tmp_path / "base"
    shutil.copytree(runs["sft"][0], run)
    shutil.copytree(base, moved)
    trained_on = build_config((run / "config.yaml").as_posix()).train.init_from
    (run / "config.yaml").write_text((run / "config.yaml").read_text().replace(trained_on, str(moved)))
    load_lora_model(run, build_config((run / "config.yaml").as_posix()))  # the same base, moved: fine
    config = json.loads((moved / "config.json").read_text())
    config["rms_norm_eps"] = 0.1
    (moved / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=rf"but its base train.init_from {moved} now differs \(model.norm_eps 0.1 "
                                        r"there, 1e-0?5 here; there is the base, here the run\); .* put that base"):
        load_lora_model(run, build_config((run / "config.yaml").as_posix()))
