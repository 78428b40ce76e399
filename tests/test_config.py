import json

import pytest

from llm.config import build_config, recipe_names
from llm.errors import UserError
from llm.train.engine import load_ds_config, resolve_ds_config


def test_recipes_are_packaged_and_valid():
    assert {"demo", "minimind-26m", "minimind3-64m", "tiny-k-215m"} <= set(recipe_names())
    for name in recipe_names():
        build_config(name)
    m = build_config("minimind3-64m").model
    assert (m.dim, m.n_layers, m.n_heads, m.kv_heads, m.vocab_size, m.head_dim) == (768, 8, 8, 4, 6400, 96)


def test_dotted_overrides_parse_yaml_scalars():
    cfg = build_config("demo", ["train.max_steps=7", "train.save_every=3", "train.eval_every=2",
                                "train.micro_batch_size=2", "train.lr=1e-3", "data.seq_len=64", "model.dim=96",
                                "model.n_layers=3", "model.n_kv_heads=null", "model.moe=true"])
    t, m = cfg.train, cfg.model
    assert (t.max_steps, t.save_every, t.eval_every, t.micro_batch_size, t.lr) == (7, 3, 2, 2, 1e-3)
    assert (cfg.data.seq_len, m.dim, m.n_layers, m.n_kv_heads, m.moe) == (64, 96, 3, None, True)


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


def test_ds_config_conflict_names_both_sides(tmp_path):
    cfg = build_config("demo")
    raw, _ = load_ds_config(None, "pretrain")
    raw["optimizer"]["params"]["lr"] = 0.5
    with pytest.raises(UserError, match=r"'lr' is 0.5 but train.lr is 0.003"):
        resolve_ds_config(raw, cfg, 1, "x.json")
    raw, _ = load_ds_config(None, "pretrain")
    raw["scheduler"] = {"type": "WarmupLR"}
    with pytest.raises(UserError, match="remove 'scheduler'"):
        resolve_ds_config(raw, cfg, 1, "x.json")
    raw, _ = load_ds_config(None, "pretrain")
    raw["fp16"] = {"enabled": True}
    with pytest.raises(UserError, match="train.precision == .fp16. is False"):
        resolve_ds_config(raw, cfg, 1, "x.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{\n  oops\n}")
    with pytest.raises(UserError, match="bad.json:2: invalid JSON"):
        load_ds_config(bad, "pretrain")
