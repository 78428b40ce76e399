"""Exports as untrusted input and as a file written safely: a killed export leaves the previous one whole, imports
read exactly the weight files named (one file, or an index's shards), a malformed config.json is one line, and a
config claiming an enormous context costs only the positions used."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_checkpoint import FILE_SIZE_LIMIT, file_size_limit

import llm.export
import llm.model.transformer
from conftest import FIXTURES, run_cli
from llm.config import ModelConfig
from llm.errors import UserError
from llm.export import HF_CONFIG_FILE, WEIGHTS_FILE, WEIGHTS_INDEX_FILE, export_model, import_model
from llm.model import Transformer
from llm.tokenizer import Tokenizer

CFG = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, tie_embeddings=False)
TOKENS = torch.arange(40).reshape(1, 40) % 64


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


def _model(seed: int) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(CFG).eval()


def _logits(model: Transformer) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits


def test_a_mount_point_as_out_is_refused_by_every_command_that_replaces_its_output(tmp_path, monkeypatch):
    """export ended in an OSError traceback (EBUSY, renaming the mount point aside); tokenizer train and data
    prepare said 'Invalid cross-device link', data prepare leaving its lock file there. A tmpfs mount needs root,
    so the mount point is simulated."""
    from llm.data.output import OutputDir
    from llm.rundir import PREPARED_ENTRIES
    from llm.tokenizer import train_tokenizer

    mount = tmp_path / "mnt"
    mount.mkdir()
    monkeypatch.setattr(os.path, "ismount", lambda path: Path(path).resolve() == mount.resolve())
    for command, write in (("export", lambda: export_model(_model(0), None, mount)),
                           ("tokenizer train", lambda: train_tokenizer(["some text"], 300, mount, show_progress=False)),
                           ("data prepare", lambda: OutputDir(mount, PREPARED_ENTRIES, lambda out: None).__enter__())):
        with pytest.raises(UserError) as refused:
            write()
        assert str(refused.value) == (f"--out {mount} is a mount point, which {command} cannot replace (it writes its "
                                      f"output beside it and renames it into place); give a folder inside it, e.g. "
                                      f"--out {mount / 'out'}")
        assert sorted(p.name for p in tmp_path.rglob("*")) == ["mnt"], command  # nothing written, beside or inside


# ---- item 7: writing and reading exactly -------------------------------------------------------------------------

def test_a_killed_export_leaves_the_previous_export_whole(tmp_path, monkeypatch):
    out = tmp_path / "export"
    export_model(_model(0), None, out)

    def killed_mid_write(state, path, metadata=None):
        Path(path).write_bytes(b"\0" * 100)
        raise KeyboardInterrupt  # the process dies here

    monkeypatch.setattr(llm.export, "save_file", killed_mid_write)
    with pytest.raises(KeyboardInterrupt):
        export_model(_model(1), None, out)
    assert torch.equal(_logits(import_model(out)), _logits(_model(0)))
    monkeypatch.undo()
    export_model(_model(1), None, out)  # the next export cleans up and replaces the old one
    assert torch.equal(_logits(import_model(out)), _logits(_model(1)))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_an_export_stopped_by_sigterm_cleans_up_as_on_ctrl_c(zero_runs, tmp_path):
    """SIGTERM (`kill`, systemd, docker, SLURM) ended export at once: exit 143 without a word, and its hidden
    `.OUT.partial` (the size of the model) left beside --out until an export into that very --out."""
    out = tmp_path / "export"
    export_model(_model(0), None, out)
    script = (f"import os, signal, time\n"
              f"import llm.export\n"
              f"from llm.cli import main\n"
              f"def terminated_mid_write(state, path, metadata=None):\n"
              f"    open(path, 'wb').write(bytes(100))\n"
              f"    os.kill(os.getpid(), signal.SIGTERM)\n"
              f"    time.sleep(60)\n"
              f"llm.export.save_file = terminated_mid_write\n"
              f"main(['export', '--run', {str(zero_runs[2])!r}, '--out', {str(out)!r}])\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stderr) == (143, "zerollm: stopped by SIGTERM\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
    assert torch.equal(_logits(import_model(out)), _logits(_model(0)))


def test_a_sigterm_whose_exception_a_finalizer_dropped_still_stops_the_write():
    """Python drops an exception raised in a finalizer, where the SIGTERM handler may happen to run: the write went
    on and was renamed into place, exit 0, after an 'Exception ignored' traceback."""
    script = ("import os, signal, sys\n"
              "from llm.errors import SigtermUnwinds, Terminated\n"
              "class Dies:\n"
              "    def __del__(self):\n"
              "        os.kill(os.getpid(), signal.SIGTERM)\n"
              "        for _ in range(10**6): pass\n"  # the handler runs here, in the finalizer
              "try:\n"
              "    with SigtermUnwinds() as stop:\n"
              "        Dies()\n"
              "        print('went on', flush=True)\n"
              "        stop.check()\n"
              "        print('renamed into place')\n"
              "except Terminated as exc:\n"
              "    sys.exit(exc.code)\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout, result.stderr) == (143, "went on\n", "")


def test_an_export_that_runs_out_of_room_is_one_line_and_leaves_nothing_half_written(tmp_path):
    """A full disk was a SafetensorError traceback."""
    out = tmp_path / "export"
    export_model(_model(0), None, out)
    for kept in ("the export there is as it was", "nothing was written"):
        with file_size_limit(10_000), pytest.raises(UserError) as error:
            export_model(_model(1), None, out)
        assert str(error.value) == f"--out {out}: {FILE_SIZE_LIMIT} while writing the export; {kept}"
        assert sorted(p.name for p in tmp_path.iterdir()) == (["export"] if out.exists() else [])
        if out.exists():
            assert torch.equal(_logits(import_model(out)), _logits(_model(0)))
            shutil.rmtree(out)


def test_export_replaces_an_old_export_whole_and_refuses_other_folders(tmp_path):
    out = tmp_path / "export"
    export_model(_model(0), None, out)
    export_model(_model(1), None, out)
    assert sorted(p.name for p in out.iterdir()) == [HF_CONFIG_FILE, WEIGHTS_FILE]
    assert torch.equal(_logits(import_model(out)), _logits(_model(1)))
    weights = load_file(out / WEIGHTS_FILE)
    save_file(weights, str(out / WEIGHTS_FILE), metadata={"format": "pt"})  # as earlier versions wrote it: unmarked
    export_model(_model(0), None, out)
    assert torch.equal(_logits(import_model(out)), _logits(_model(0)))
    precious = tmp_path / "notes"
    precious.mkdir()
    (precious / "thesis.txt").write_text("years of work")
    with pytest.raises(UserError, match="holds thesis.txt but no model.safetensors, which export writes into its every "
                                        "output, so they may be yours"):
        export_model(_model(0), None, precious)
    assert (precious / "thesis.txt").read_text() == "years of work"


def test_an_earlier_export_that_cannot_be_deleted_is_named_not_left_without_a_word(tmp_path, monkeypatch, capsys):
    """A read-only earlier export was set aside as .NAME.old and left there silently; the next export into the same
    folder then ended in an OSError traceback (Directory not empty)."""
    out, remove = tmp_path / "export", shutil.rmtree

    def read_only_old(path, *args, **kwargs):
        if Path(path).name == ".export.old" and Path(path).exists():
            raise PermissionError(13, "Permission denied", str(path))
        remove(path, *args, **kwargs)

    export_model(_model(0), None, out)
    monkeypatch.setattr(shutil, "rmtree", read_only_old)
    export_model(_model(1), None, out)
    assert capsys.readouterr().err == (f"zerollm: note: {out} is written, but its earlier copy, set aside as "
                                       f"{tmp_path / '.export.old'}, cannot be deleted (Permission denied); delete it "
                                       "yourself\n")
    with pytest.raises(UserError, match=f"^{tmp_path / '.export.old'}, a copy of {out} an earlier run left beside it, "
                                        r"cannot be deleted \(Permission denied\); delete it \(or make it writable\) "
                                        "and run again$"):
        export_model(_model(0), None, out)
    assert torch.equal(_logits(import_model(out)), _logits(_model(1)))  # the export before it, untouched


def test_a_downloaded_model_folder_is_not_replaced_by_an_export(tmp_path):
    """Export replaced any folder holding a config.json and no subfolders whole, so exporting into a model downloaded
    from the Hub deleted its README.md, generation_config.json and other files export does not write."""
    download = tmp_path / "Qwen3-0.6B"
    export_model(_model(0), None, download)
    kept = {"README.md": "model card", "generation_config.json": "{}", "merges.txt": "#version: 0.2"}
    for name, text in kept.items():
        (download / name).write_text(text)
    with pytest.raises(UserError) as error:
        export_model(_model(1), None, download)
    assert str(error.value) == (f"--out {download} holds README.md, merges.txt, which export did not write; it "
                                "replaces its output there, so give it a new or empty directory (or one it wrote "
                                "before)")
    assert {name: (download / name).read_text() for name in kept} == kept
    assert torch.equal(_logits(import_model(download)), _logits(_model(0)))


def test_a_folder_of_only_the_names_an_export_holds_is_not_replaced_unless_export_wrote_it(tmp_path):
    """A folder was taken for an earlier export by its names alone: a model downloaded in shards, or any folder of a
    config.json, was deleted by an export into it (exit 0)."""
    shards, config_only, hub_single = (tmp_path / name for name in ("shards", "config-only", "hub-single"))
    files = {shards: {"config.json": '{"note": "downloaded"}', "model-00001-of-00002.safetensors": "w1",
                      "model-00002-of-00002.safetensors": "w2", "model.safetensors.index.json": "{}",
                      "tokenizer_config.json": "{}"},
             config_only: {"config.json": "mine"}, hub_single: {"config.json": '{"transformers_version": "4.51.0"}'}}
    for folder, named in files.items():
        folder.mkdir()
        for name, text in named.items():
            (folder / name).write_text(text)
    save_file({"w": torch.ones(2)}, str(hub_single / WEIGHTS_FILE), metadata={"format": "pt"})  # as the Hub's are
    hub_weights = (hub_single / WEIGHTS_FILE).read_bytes()
    for folder in files:
        with pytest.raises(UserError, match="which export did not write|but no model.safetensors, which export writes"):
            export_model(_model(0), None, folder)
        assert {name: (folder / name).read_text() for name in files[folder]} == files[folder]
    assert (hub_single / WEIGHTS_FILE).read_bytes() == hub_weights


def test_the_weights_are_as_readable_as_the_other_files_and_a_file_in_the_way_is_one_line(tmp_path):
    """safetensors wrote model.safetensors 0600, so another user or a serving account could not read an export whose
    other files the umask made readable; and --out below a file was a NotADirectoryError traceback."""
    previous = os.umask(0o022)
    try:
        export_model(_model(0), None, tmp_path / "export")
    finally:
        os.umask(previous)
    assert {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "export").iterdir()} == {
        HF_CONFIG_FILE: 0o644, WEIGHTS_FILE: 0o644}
    (tmp_path / "notes.txt").write_text("kept")
    with pytest.raises(UserError) as error:
        export_model(_model(0), None, tmp_path / "notes.txt" / "export")
    assert str(error.value) == f"--out {tmp_path / 'notes.txt' / 'export'}: cannot create it (Not a directory)"
    assert (tmp_path / "notes.txt").read_text() == "kept"
    for name in (".export.old", ".export.partial"):  # a file where export stages or sets aside: a NotADirectoryError
        (tmp_path / name).write_text("kept")  # traceback, or 'cannot create it (File exists)' naming --out
        with pytest.raises(UserError) as error:
            export_model(_model(1), None, tmp_path / "export")
        assert str(error.value) == (f"{tmp_path / name} is in the way: replacing {tmp_path / 'export'} whole takes "
                                    "that name beside it (for the new copy as it is written, or the earlier one set "
                                    "aside); move it away")
        assert (tmp_path / name).read_text() == "kept"
        (tmp_path / name).unlink()
    assert torch.equal(_logits(import_model(tmp_path / "export")), _logits(_model(0)))


def test_exports_of_the_same_weights_are_the_same_bytes(tmp_path):
    """safetensors wrote the metadata keys in a random order each process: two exports of one model differed in
    their bytes half the time, and a LoRA run on an export exported again was refused as trained on other weights."""
    script = ("import sys, torch\nfrom pathlib import Path\nfrom llm.export import export_model\n"
              "from llm.model import Transformer\nfrom llm.config import ModelConfig\ntorch.manual_seed(0)\n"
              "export_model(Transformer(ModelConfig(vocab_size=96, dim=32, n_layers=1, n_heads=2, max_seq_len=32)), "
              "None, Path(sys.argv[1]))\n")
    for i in range(6):  # each in a process of its own, as each export is
        subprocess.run([sys.executable, "-c", script, str(tmp_path / str(i))], check=True)
    weights = {(tmp_path / str(i) / WEIGHTS_FILE).read_bytes() for i in range(6)}
    assert len(weights) == 1
    with safe_open(tmp_path / "0" / WEIGHTS_FILE, "pt") as exported:
        assert exported.metadata() == {"format": "pt", "exported_by": "zerollm"}
    import_model(tmp_path / "0")


def test_stale_safetensors_beside_an_export_are_not_merged(tmp_path):
    export_model(_model(0), None, tmp_path)
    other = {name: torch.randn_like(t) for name, t in load_file(str(tmp_path / WEIGHTS_FILE)).items()}
    save_file(other, str(tmp_path / "zz-stale.safetensors"))
    assert torch.equal(_logits(import_model(tmp_path)), _logits(_model(0)))


def _sharded_llama(tmp_path: Path):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(config).eval()
    hf.save_pretrained(str(tmp_path), max_shard_size="20KB")
    return hf


def test_a_sharded_transformers_checkpoint_loads_by_its_index(tmp_path):
    hf = _sharded_llama(tmp_path)
    index = json.loads((tmp_path / WEIGHTS_INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) > 1 and not (tmp_path / WEIGHTS_FILE).exists()
    save_file({"model.norm.weight": torch.zeros(32)}, str(tmp_path / "model-99999-of-99999.safetensors"))
    with torch.no_grad():
        assert torch.allclose(import_model(tmp_path)(TOKENS).logits, hf(TOKENS).logits, atol=1e-4)


@pytest.mark.parametrize("edit, message", [
    (lambda m: m.update({"model.norm.weight": "../elsewhere.safetensors"}), "is not a file name"),
    (lambda m: m.update({"model.norm.weight": "missing.safetensors"}), "names shard missing.safetensors"),
    (lambda m: m.update({"model.extra.weight": next(iter(m.values()))}), "lacks ['model.extra.weight']"),
])
def test_a_bad_index_is_one_clear_error(tmp_path, edit, message):
    _sharded_llama(tmp_path)
    index = json.loads((tmp_path / WEIGHTS_INDEX_FILE).read_text())
    edit(index["weight_map"])
    (tmp_path / WEIGHTS_INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(UserError) as error:
        import_model(tmp_path)
    assert message in str(error.value) and "\n" not in str(error.value)


# ---- item 15: malformed and hostile configs --------------------------------------------------------------------

def _edit_config(directory: Path, changes: dict) -> None:
    """Set keys of an export's config.json (None deletes the key)."""
    config = json.loads((directory / HF_CONFIG_FILE).read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key)
        else:
            config[key] = value
    (directory / HF_CONFIG_FILE).write_text(json.dumps(config))


@pytest.mark.parametrize("key, value", [("head_dim", None), ("hidden_act", "swish")])
def test_configs_transformers_reads_as_ours_load(tmp_path, key, value):
    """A null head_dim (transformers: hidden_size / num_attention_heads) was refused as "head_dim None differs", and
    hidden_act 'swish' (transformers' other name of SiLU) as "biases or a non-SiLU activation"."""
    model = _model(0)
    export_model(model, None, tmp_path)
    config = json.loads((tmp_path / HF_CONFIG_FILE).read_text())
    (tmp_path / HF_CONFIG_FILE).write_text(json.dumps({**config, key: value}))
    tokens = torch.randint(0, CFG.vocab_size, (1, 9))
    with torch.no_grad():
        assert torch.equal(import_model(tmp_path)(tokens).logits, model(tokens).logits)


def test_a_folder_with_pickled_weights_only_says_they_are_not_read(tmp_path):
    export_model(_model(0), None, tmp_path)
    (tmp_path / WEIGHTS_FILE).rename(tmp_path / "pytorch_model.bin")
    with pytest.raises(UserError) as error:
        import_model(tmp_path)
    assert str(error.value) == (f"{tmp_path}: no {WEIGHTS_FILE} or {WEIGHTS_INDEX_FILE} beside {HF_CONFIG_FILE}; "
                                "pytorch_model.bin is not read (a pickle can run code when loaded): save the model "
                                "with transformers' save_pretrained, which writes safetensors")


def test_a_tied_model_saved_with_both_names_loads_when_they_are_equal(tmp_path):
    """Such a folder (a tool other than transformers wrote the tied weights twice) was refused with "unexpected
    ['lm_head.weight']", where transformers ties them."""
    tied = Transformer(dataclasses.replace(CFG, tie_embeddings=True)).eval()
    export_model(tied, None, tmp_path)
    weights = load_file(tmp_path / WEIGHTS_FILE)
    save_file({**weights, "lm_head.weight": weights["model.embed_tokens.weight"].clone()}, str(tmp_path / WEIGHTS_FILE))
    with torch.no_grad():
        assert torch.equal(import_model(tmp_path)(TOKENS).logits, tied(TOKENS).logits)
    save_file({**weights, "lm_head.weight": torch.zeros_like(weights["model.embed_tokens.weight"])},
              str(tmp_path / WEIGHTS_FILE))
    with pytest.raises(UserError, match="ties the embeddings .* lm_head.weight that differs from "
                                        "model.embed_tokens.weight; set tie_word_embeddings to false"):
        import_model(tmp_path)


def test_export_names_the_class_it_wrote(tmp_path):
    """`zerollm export` printed LlamaForCausalLM for a QK-norm model exported as Qwen3ForCausalLM."""
    assert export_model(_model(0), None, tmp_path / "llama") == "LlamaForCausalLM"
    qwen3 = Transformer(dataclasses.replace(CFG, qk_norm=True))
    assert export_model(qwen3, None, tmp_path / "qwen3") == "Qwen3ForCausalLM"
    assert json.loads((tmp_path / "qwen3" / HF_CONFIG_FILE).read_text())["architectures"] == ["Qwen3ForCausalLM"]


def test_yarn_settings_that_ask_for_what_our_tables_do_are_taken(tmp_path):
    export_model(_model(0), None, tmp_path)
    # transformers reads the mscale pair only without an attention_factor
    _edit_config(tmp_path, {"rope_scaling": {**YARN, "attention_factor": 0.1 * math.log(4) + 1, "truncate": True,
                                             "mscale": 1, "mscale_all_dim": 0.5, "partial_rotary_factor": 1.0}})
    cfg = import_model(tmp_path).cfg
    assert (cfg.rope_scaling, cfg.rope_factor, cfg.rope_original_max_seq_len) == ("yarn", 4.0, 64)


def _noisy(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with weights of std 0.2, so that logits are far apart wherever RoPE differs."""
    torch.manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0, 0.2)
    return model.eval()


def _hf_llama(directory: Path, config_changes: dict, **settings):
    """A Llama saved by transformers (dim 64, 4 heads of 16, vocab 128), its config.json then edited; the model
    transformers loads back from it."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=128, **settings)
    _noisy(LlamaForCausalLM(config)).save_pretrained(str(directory))
    _edit_config(directory, config_changes)
    return AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()


LONG_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192}
"""With rope_theta 1000 and head dim 16, beta_slow's correction dimension is 8.3: past head_dim // 2 - 1."""


@pytest.mark.parametrize("settings, changes", [
    ({"max_position_embeddings": 32768, "rope_theta": 1000.0, "rope_scaling": LONG_YARN}, {}),
    # transformers takes rope_parameters' rope_theta over a top-level one, and Phi-3's top-level
    # original_max_position_embeddings over rope_parameters' (or the default, max_position_embeddings)
    ({"max_position_embeddings": 1024}, {"rope_theta": 500000.0}),
    ({"max_position_embeddings": 1024}, {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4},
                                         "original_max_position_embeddings": 16}),
    ({"max_position_embeddings": 1024}, {"rope_parameters": {**YARN, "rope_theta": 1e4, "beta_fast": None},
                                         "original_max_position_embeddings": 16}),
])
def test_an_imported_llama_gives_transformers_logits(tmp_path, settings, changes):
    """Each of these loaded silently with logits 3.6 to 9 away from transformers' own forward."""
    hf = _hf_llama(tmp_path, changes, **settings)
    tokens = torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        difference = (import_model(tmp_path)(tokens).logits - hf(tokens).logits).abs().max().item()
    assert difference < 1e-3, difference  # float32 rounding of transformers' frequencies (ours are float64)


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("rope", [YARN, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0}])
def test_a_config_without_max_position_embeddings_takes_its_classs_default(tmp_path, model_type, rope):
    """It was 2048 for every class, transformers' for Llama only (Qwen's is 32768, Mistral's 131072): a YaRN or Llama
    3 RoPE naming no original length took it from there, and such a Qwen or Mistral model loaded silently with logits
    up to 0.28 away from transformers'. A Qwen2 config's attention_bias, which transformers' Qwen2 does not read, was
    refused."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, intermediate_size=128, vocab_size=128, head_dim=16,
                                  rope_parameters={**{k: v for k, v in rope.items()
                                                      if k != "original_max_position_embeddings"},
                                                   "rope_theta": 10000.0},
                                  **({"sliding_window": None} if model_type == "mistral" else {}))  # Mistral v0.3's
    _noisy(AutoModelForCausalLM.from_config(config)).save_pretrained(str(tmp_path))
    _edit_config(tmp_path, {"max_position_embeddings": None, **({"attention_bias": True}
                                                                  if model_type == "qwen2" else {})})
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    tokens = torch.randint(0, 128, (1, 64), generator=torch.Generator().manual_seed(1))
    ours = import_model(tmp_path)
    assert ours.cfg.max_seq_len == hf.config.max_position_embeddings
    with torch.no_grad():
        difference = (ours(tokens).logits - hf(tokens).logits).abs().max().item()
    assert difference < 1e-4, difference


def test_an_exported_long_context_yarn_model_gives_our_logits_in_transformers(tmp_path):
    """Our tables clamped YaRN's ramp at head_dim // 2 - 1: such an export was 0.07 to 0.4 logits away."""
    from transformers import AutoModelForCausalLM

    cfg = ModelConfig(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32768,
                      rope_theta=1000.0, rope_scaling="yarn", rope_factor=4.0, rope_original_max_seq_len=8192)
    model = _noisy(Transformer(cfg))
    export_model(model, None, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    tokens = torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        difference = (hf(tokens).logits - model(tokens).logits).abs().max().item()
    assert difference < 1e-3, difference


@pytest.mark.parametrize("tokenizer", ["ours", "llama", "minimind"])
def test_the_exported_config_has_the_bos_and_pad_tokens_of_the_exported_tokenizer(tmp_path, tokenizer_dir, tokenizer):
    """config.json said bos_token_id 1 (<|im_start|>) beside our tokenizer, whose bos_token is null: transformers'
    generate without a prompt started from a turn start no tokenizer names as its bos. Its dtype is the weights'."""
    from safetensors import safe_open
    from transformers import AutoTokenizer

    source = tokenizer_dir if tokenizer == "ours" else FIXTURES / "tokenizers" / tokenizer
    export_model(_model(0), source, tmp_path)
    config = json.loads((tmp_path / HF_CONFIG_FILE).read_text())
    hf_tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    assert config["bos_token_id"] == hf_tokenizer.bos_token_id
    assert config["bos_token_id"] == {"ours": None, "llama": 1, "minimind": 1}[tokenizer]
    assert config["pad_token_id"] == Tokenizer.load(source).pad_id
    if hf_tokenizer.pad_token_id is not None:
        assert config["pad_token_id"] == hf_tokenizer.pad_token_id
    with safe_open(tmp_path / "model.safetensors", "pt") as weights:
        dtypes = {weights.get_slice(name).get_dtype() for name in weights.keys()}  # noqa: SIM118 - not a dict
    assert (config["torch_dtype"], dtypes) == ("float32", {"F32"})


def test_a_config_without_rms_norm_eps_takes_transformers_default(tmp_path):
    export_model(_model(0), None, tmp_path)
    _edit_config(tmp_path, {"rms_norm_eps": None})
    assert import_model(tmp_path).cfg.norm_eps == 1e-6


def test_a_null_number_of_key_value_heads_is_one_per_head_as_transformers_reads_it(tmp_path):
    """`"num_key_value_heads": null` was refused as missing; transformers takes it as num_attention_heads."""
    model = Transformer(dataclasses.replace(CFG, n_kv_heads=4)).eval()
    export_model(model, None, tmp_path)
    config = json.loads((tmp_path / HF_CONFIG_FILE).read_text())
    (tmp_path / HF_CONFIG_FILE).write_text(json.dumps({**config, "num_key_value_heads": None}))
    imported = import_model(tmp_path)
    assert imported.cfg.n_kv_heads == 4
    assert torch.equal(_logits(imported), _logits(model))


@pytest.mark.parametrize("change, message", [
    ('{"model_type": "llama",', "config.json:1:"),
    ("[1, 2]", "the model config must be a JSON object {...}, got [1, 2]"),
    ({"hidden_size": None}, "'hidden_size' is missing"),
    ({"hidden_size": "32"}, "'hidden_size' must be a positive integer, got '32'"),
    ({"num_key_value_heads": 0}, "'num_key_value_heads' must be a positive integer"),
    ({"max_position_embeddings": 1e30}, "'max_position_embeddings' must be a positive integer"),
    ({"rms_norm_eps": "small"}, "'rms_norm_eps' must be a positive number"),
    ({"rms_norm_eps": float("inf")}, "'rms_norm_eps' must be a positive number, got inf"),  # written as Infinity
    ("[" * 100_000 + "]" * 100_000, "invalid JSON (nested too deeply)"),
    ({"rope_scaling": "yarn"}, "'rope_scaling' must be an object or null"),
    ({"rope_scaling": {"rope_type": "yarn"}}, "'factor' is missing"),
    # settings transformers honours and our tables did not: loaded silently into another function
    ({"rope_scaling": {**YARN, "attention_factor": 2.0}}, "'attention_factor' 2.0 is not supported (our YaRN scales "
                                                          "by 0.1 * ln(factor) + 1 = 1.13863)"),
    ({"rope_scaling": {**YARN, "mscale": 1, "mscale_all_dim": 0.5}}, "'mscale' and 'mscale_all_dim'"),
    ({"rope_scaling": {**YARN, "truncate": False}}, "'truncate' False is not supported"),
    ({"rope_parameters": {"full_attention": YARN}}, "'rope_parameters' per layer type (a nested object) is not "
                                                     "supported"),
    ({"rope_scaling": {**YARN, "rope_theta": "big"}}, "rope_scaling: 'rope_theta' must be a positive number"),
    ({"rope_scaling": YARN, "original_max_position_embeddings": 0}, "'original_max_position_embeddings' must be a "
                                                                    "positive integer, got 0"),
    ({"partial_rotary_factor": 0.5}, "'partial_rotary_factor' other than 1"),
    ({"tie_word_embeddings": "yes"}, "'tie_word_embeddings' must be true or false"),
    ({"num_attention_heads": 3, "head_dim": None}, "model.dim (32) must be divisible by model.n_heads (3)"),
    ({"head_dim": 7}, "model.head_dim = 7 must be even for RoPE"),
    ({"head_dim": "8"}, "'head_dim' must be a positive integer, got '8'"),
    ({"hidden_act": "gelu"}, "'hidden_act' 'gelu' is not part of our architecture (SiLU only)"),  # named no key
    ({"hidden_act": "gelu_pytorch_tanh"}, "'hidden_act' 'gelu_pytorch_tanh' is not part of our architecture"),
    ({"num_key_value_heads": True}, "'num_key_value_heads' must be a positive integer, got True"),
    ({"rope_scaling": {**YARN, "truncate": None}}, "'truncate' None is not supported"),  # transformers: untruncated
    ({"attention_bias": True}, "'attention_bias' True: biases other than Qwen2's on q, k and v are not part of our "
                               "architecture"),
    # the RoPE object is named by its key: 'rope_scaling' was said of a transformers 5 file's rope_parameters
    ({"rope_parameters": {**YARN, "attention_factor": 2.0}}, "config.json: rope_parameters 'attention_factor' 2.0"),
    # an FP8 model's weights (same names and shapes, scales beside them) were refused as 'unexpected' names only
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}, "config.json: a quantized "
     "model (quant_method 'fp8'); give the model's unquantized fp32, bf16 or fp16 weights (its base repository)"),
    ({"quantization_config": "4bit"}, "a quantized model (quantization_config); give the model's unquantized"),
])
def test_a_malformed_config_json_is_one_line(tmp_path, change, message):
    export_model(_model(0), None, tmp_path)
    if isinstance(change, str):
        (tmp_path / HF_CONFIG_FILE).write_text(change)
    else:
        _edit_config(tmp_path, change)
    with pytest.raises(UserError) as error:
        import_model(tmp_path)
    assert message in str(error.value) and str(tmp_path / HF_CONFIG_FILE) in str(error.value)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("change, message", [
    ({"vocab_size": 4_000_000_000}, "model.embed_tokens.weight (64, 32), expected (4000000000, 32)"),
    ({"num_hidden_layers": 100_000_000}, "2 layers in the weights, num_hidden_layers 100000000"),
])
def test_sizes_in_config_json_are_checked_against_the_weights_before_any_allocation(tmp_path, change, message):
    """A hostile config.json asked for a terabyte of embeddings, or a hundred million layers built one by one,
    before the weights' shapes were compared."""
    export_model(_model(0), None, tmp_path)
    _edit_config(tmp_path, change)
    with pytest.raises(UserError) as error:
        import_model(tmp_path)
    assert str(error.value) == f"{tmp_path}: weights do not match {HF_CONFIG_FILE} ({message})"


def test_generate_on_a_malformed_export_exits_2_without_a_traceback(tmp_path):
    export_model(_model(0), None, tmp_path)
    _edit_config(tmp_path, {"vocab_size": None})
    result = run_cli("generate", "--model", tmp_path, "--prompt", "hi")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip() == f"zerollm: error: {tmp_path / HF_CONFIG_FILE}: 'vocab_size' is missing"


def test_an_enormous_max_position_embeddings_costs_only_the_positions_used(tmp_path):
    """2**40 positions of RoPE tables would need terabytes; they are built as far as the input reaches."""
    export_model(_model(0), None, tmp_path)
    _edit_config(tmp_path, {"max_position_embeddings": 2**40})
    model = import_model(tmp_path)
    assert model.cfg.max_seq_len == 2**40 and model.rope_cos.shape[0] <= llm.model.transformer.ROPE_EAGER_POSITIONS
    assert torch.equal(_logits(model), _logits(_model(0)))


def test_rope_tables_grow_on_demand_with_the_same_values(monkeypatch):
    full = _model(0)
    monkeypatch.setattr(llm.model.transformer, "ROPE_EAGER_POSITIONS", 8)
    lazy = _model(0)
    assert lazy.rope_cos.shape[0] == 8
    assert torch.equal(_logits(lazy), _logits(full))
    assert lazy.rope_cos.shape[0] == 40 and torch.equal(lazy.rope_sin, full.rope_sin[:40])
    with pytest.raises(ValueError, match="exceeds model.max_seq_len 64"):
        lazy(torch.zeros(1, 65, dtype=torch.long))


def test_a_run_directory_that_does_not_exist_is_said_so(tmp_path):
    """It was 'no config.yaml; is this a run directory made by `zerollm train`?' for a path with nothing there."""
    from llm import rundir

    with pytest.raises(UserError, match=f"^{tmp_path / 'nowhere'}: no such directory$"):
        rundir.recorded_config(tmp_path / "nowhere")
    with pytest.raises(UserError, match=f"^{tmp_path}: no config.yaml; is this a run directory made by"):
        rundir.recorded_config(tmp_path)


def test_another_tool_s_config_yaml_is_not_called_damaged(tmp_path):
    """A folder of another trainer with its own config.yaml was 'config.yaml is damaged (...); `zerollm train` wrote
    it: restore it'."""
    from llm import rundir

    (tmp_path / "config.yaml").write_text("optimizer: adamw\nlr: 0.001\nepochs: 3\nseed: 1\nbatch: 8\n")
    with pytest.raises(UserError, match=rf"^{tmp_path}: not a run directory made by `zerollm train` \(its config.yaml "
                                        r"has none of model, data, train, grpo, lora, wandb, but optimizer, lr, "
                                        r"epochs, seed, \.\.\.\)$"):
        rundir.recorded_config(tmp_path)


def test_an_out_that_is_a_loop_of_links_is_one_line(tmp_path):
    """`export --out` on a loop of symbolic links was a RuntimeError traceback, after the model had loaded."""
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    model = Transformer(ModelConfig(vocab_size=64, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, max_seq_len=8))
    with pytest.raises(UserError, match=f"^--out {tmp_path / 'a'}: cannot follow it"):
        export_model(model, None, tmp_path / "a")


def test_an_export_too_large_for_this_host_is_one_line_before_it_is_built(tmp_path, monkeypatch):
    """generate, chat, serve and eval built an export's model until the kernel killed the process (exit 137, no
    word); a run directory's model was refused in one line."""
    from llm.model import host_memory

    export_model(_model(0), None, tmp_path / "export")
    monkeypatch.setattr(host_memory, "usable_memory", lambda: 1000)
    with pytest.raises(UserError, match=r"^the model has [\d,]+ parameters, .* in fp32: more than .*"
                                        rf"\({re.escape(str(tmp_path / 'export' / HF_CONFIG_FILE))}\)$"):
        import_model(tmp_path / "export")


def test_configuration_files_larger_than_any_are_refused_in_one_line_unread(tmp_path, tokenizer_dir):
    """An 8 GB sparse config.json (tokenizer_config.json, a run's config.yaml) was read whole: a MemoryError
    traceback, or the process killed without a word."""
    from llm import rundir
    from llm.errors import USER_FILE_LIMIT

    export_model(_model(0), tokenizer_dir, tmp_path / "export")
    os.truncate(tmp_path / "export" / HF_CONFIG_FILE, USER_FILE_LIMIT + 1)
    too_large = f"larger than the {USER_FILE_LIMIT:,} bytes zerollm reads of such a file; is it the right file?"
    with pytest.raises(UserError, match=rf"{HF_CONFIG_FILE}: cannot be read \({re.escape(too_large)}\)$"):
        import_model(tmp_path / "export")
    os.truncate(tmp_path / "export" / "tokenizer_config.json", USER_FILE_LIMIT + 1)
    with pytest.raises(UserError, match=rf"tokenizer_config.json: cannot be read \({re.escape(too_large)}\)$"):
        Tokenizer.load(tmp_path / "export")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / rundir.CONFIG_FILE).write_text("model: {}\n")
    os.truncate(tmp_path / "run" / rundir.CONFIG_FILE, USER_FILE_LIMIT + 1)
    with pytest.raises(UserError, match=rf"config.yaml is damaged \({re.escape(too_large)}\); `zerollm train` wrote"):
        rundir.recorded_config(tmp_path / "run")


def test_an_out_name_too_long_for_its_staging_copy_is_one_line_before_the_work(tmp_path, tokenizer_dir):
    """A name of 247 to 255 bytes is a file system's, but `.NAME.partial` beside it is not: export ended in a
    traceback (File name too long), tokenizer train after its whole training."""
    long_name = tmp_path / ("e" * 250)
    said = r"its name is too long to be written whole: the copy written first beside it, \.e+\.partial, would be "
    with pytest.raises(UserError, match=said):
        export_model(_model(0), None, long_name)
    result = run_cli("tokenizer", "train", "--input", FIXTURES / "pretrain" / "en_stories.txt", "--vocab-size", 300,
                     "--out", long_name)
    assert result.returncode == 2 and re.search(said, result.stderr) and "tokenizer:" not in result.stdout
    export_model(_model(0), None, tmp_path / ("e" * 246))  # .NAME.partial: 255 bytes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e" * 246]


def test_a_second_export_into_a_folder_being_written_is_one_line_and_the_first_is_whole(tmp_path):
    """Two exports into one --out at once deleted each other's copies (.NAME.partial is shared): tracebacks, an
    'exported' that was not, and once one run's weights beside the other's config.json."""
    from llm.held_locks import held_beside

    out = tmp_path / "export"
    export_model(_model(0), None, out)
    said = rf"^{re.escape(str(out))}: another zerollm command is writing it now; wait for it to end, or choose"
    with held_beside(out), pytest.raises(UserError, match=said):  # as the first export holds it while it writes
        export_model(_model(1), None, out)
    assert torch.equal(_logits(import_model(out)), _logits(_model(0)))
    export_model(_model(1), None, out)  # the lock is gone with its holder
    assert torch.equal(_logits(import_model(out)), _logits(_model(1)))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
    (tmp_path / ".export.lock").symlink_to(tmp_path / "elsewhere")  # said as --out, as a folder it cannot make
    with pytest.raises(UserError, match=rf"^--out {re.escape(str(out))}: cannot create it \(\.export\.lock is a "
                                        r"symbolic link, not a lock file; remove it\)$"):
        export_model(_model(0), None, out)
