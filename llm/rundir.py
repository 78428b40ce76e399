"""The run directory: what `zerollm train` writes, and where every other command looks for it.

    RUN_DIR/
        config.yaml                  the resolved run config
        ds_config.json               the resolved DeepSpeed config
        metrics.jsonl                one JSON object per logged step
        samples.jsonl                greedy generations from fixed prompts at each evaluation
        run_record.jsonl             one record per start or resume: command, code, versions, hosts, data
        eval/                        `zerollm eval --tasks` results (lm-evaluation-harness tables and JSON)
        tokenizer/                   a copy of the tokenizer the data was prepared with
        checkpoints/
            global_step<N>/          DeepSpeed's files (model, optimizer / ZeRO partitions, scheduler)
                                     + offloaded_tensors/rank<NN>/ (under NVMe optimizer offload: rank NN's
                                       optimizer swap files, which DeepSpeed copies there)
                                     + client_state.json (step, sampler, run id, world size)
                                     + rng_rank<R>.pt (every RNG of rank R, tensors and plain values)
                                     + manifest.json (every file above with its size, by its path in the
                                       folder; written last)
            latest                   the tag of the newest published checkpoint (written after its manifest)
            universal/global_step<N> while resuming on another world size: DeepSpeed's universal
                                     checkpoint of global_step<N> (removed once loaded)

A prepared data directory keeps its tokenizer under the same folder name (`TOKENIZER_DIR`).

A checkpoint is *complete* when its manifest exists and the folder holds exactly the files it lists, each with
the listed size; a file in a subfolder is listed by its path in the folder (`offloaded_tensors/rank00/3.tensor.swp`,
`checkpoint_files`). Whoever reads a run directory (resume, generate, export, `--init-from`) takes the checkpoint
`latest` names when it is complete, else the newest complete one before it (`usable_tag`); without `latest` (lost,
or a kill between the first checkpoint's manifest and its `latest`), the newest complete one.

This module names and reads the layout only (no torch, no model code), so the launcher can use it
cheaply; `llm.train.checkpoint` writes checkpoints and `llm.loading` rebuilds models from them.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import yaml

from llm import durable
from llm.config import SECTIONS, build_config, load_recorded_yaml
from llm.errors import UserError, bounded_text
from llm.train.run_lock import check_run_unlocked
from llm.wording import plural

CONFIG_FILE = "config.yaml"
DS_CONFIG_FILE = "ds_config.json"
METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
RUN_RECORD_FILE = "run_record.jsonl"
EVAL_DIR = "eval"
TOKENIZER_DIR = "tokenizer"
CHECKPOINTS_DIR = "checkpoints"
LATEST = "latest"
CLIENT_STATE = "client_state.json"
MANIFEST = "manifest.json"
MODEL_STATES = "mp_rank_00_model_states.pt"
"""DeepSpeed's file of a checkpoint's module (its parameters' shapes under ZeRO)."""
UNIVERSAL_DIR = "universal"
TAG_PREFIX = "global_step"
LATEST_MAX_BYTES = 64
"""More than a checkpoint tag: `latest` is damaged."""
WANDB_DIR = "wandb"
TOKENS_FILE = "tokens.h5"
"""The token file of a prepared data directory (`llm.data.prepare`)."""
PREPARED_REPORT_FILE = "report.json"
TOKENIZER_FILE = "tokenizer.json"
"""A tokenizer's own file (`llm.tokenizer`), in tokenizer folders, export folders and runs' tokenizer/."""
TOKENIZER_CONFIG_FILE, TEMPLATE_FILE = "tokenizer_config.json", "chat_template.jinja"
TOKENIZER_TRAINING_FILE = "tokenizer_training.json"
"""Written by `llm.tokenizer.train_tokenizer` only (what it was trained with): marks a folder it may write into
again."""
HF_CONFIG_FILE = "config.json"
"""A Hugging Face model folder's model config (an export's, `llm.export`)."""
GENERATION_CONFIG_FILE = "generation_config.json"
"""A Hugging Face model folder's suggested sampling (`llm.infer.suggested_sampling`): a run fine-tuned from such a
folder keeps a copy, which its exports carry, as transformers' Trainer saves it beside the model it tuned."""
MODEL_FOLDER_ENTRIES = frozenset({TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, TEMPLATE_FILE, TOKENIZER_TRAINING_FILE,
                                  "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
                                  HF_CONFIG_FILE, GENERATION_CONFIG_FILE, "model.safetensors.index.json",
                                  "pytorch_model.bin.index.json"})
"""The text and JSON files of a tokenizer folder, an export and a Hugging Face model folder (a GPT-2 style
tokenizer's vocab.json and merges.txt beside tokenizer.json too): a folder holding tokenizer.json is one of them."""
RUN_ENTRIES = frozenset({CONFIG_FILE, DS_CONFIG_FILE, METRICS_FILE, SAMPLES_FILE, RUN_RECORD_FILE, EVAL_DIR,
                         TOKENIZER_DIR, CHECKPOINTS_DIR, UNIVERSAL_DIR, WANDB_DIR, GENERATION_CONFIG_FILE})
"""What `zerollm train` writes into a run directory (besides its dot-named temporary files)."""
RUN_FILES = frozenset({CONFIG_FILE, DS_CONFIG_FILE, METRICS_FILE, SAMPLES_FILE, RUN_RECORD_FILE,
                       GENERATION_CONFIG_FILE})
"""The files among them: never symbolic links (a run folder handed over with `run_record.jsonl` linked to a file
elsewhere had training append to that file; `generation_config.json` linked to one was copied into every export)."""


def is_run_dir(path: Path) -> bool:
    return (path / CONFIG_FILE).is_file()


PREPARED_ENTRIES = (TOKENS_FILE, PREPARED_REPORT_FILE, TOKENIZER_DIR)
"""What `zerollm data prepare` writes into its output folder, its marker first (`llm.data.output.OutputDir`)."""


def zerollm_entries(folder: Path) -> frozenset[str]:
    """The entries of `folder` that zerollm writes there, where it is a run directory (its run record, or config.yaml
    beside checkpoints/: RUN_ENTRIES), a prepared data folder (tokens.h5: PREPARED_ENTRIES) or a tokenizer or model
    folder (tokenizer.json: MODEL_FOLDER_ENTRIES); none elsewhere. A folder walked for data leaves them out (a run's
    samples.jsonl and metrics.jsonl became GRPO prompts and pretraining text; a tokenizer trained into the corpus
    folder, three skipped records in every later run, and `--strict` refused) and reads the rest (a user's notes or
    data kept beside them)."""
    if (folder / RUN_RECORD_FILE).is_file() or ((folder / CONFIG_FILE).is_file() and
                                                (folder / CHECKPOINTS_DIR).is_dir()):
        return RUN_ENTRIES
    if (folder / TOKENS_FILE).is_file():
        return frozenset(PREPARED_ENTRIES)
    return MODEL_FOLDER_ENTRIES if (folder / TOKENIZER_FILE).is_file() else frozenset()


def broken_link(path: Path) -> str:
    """What symbolic link `path`, which cannot be followed, is: for messages."""
    return f"{path} is a symbolic link to {os.readlink(path)}, which does not exist (or links back to itself)"


def check_writable_out(out: Path, advice: str) -> Path:
    """The nearest of `out` and its parents that exists, checked to be a folder this process can write in (else a
    UserError ending with `advice` for a file; a symbolic link that cannot be followed is refused too): an --out a
    command can create or write."""
    existing = next(p for p in (out, *out.parents) if p.exists() or p.is_symlink() or p == p.parent)
    if not existing.exists():  # a link to nothing: writing there failed only after the work (FileExistsError)
        raise UserError(f"--out {out}: {broken_link(existing)}; create its target or remove the link")
    if not existing.is_dir():
        raise UserError(f"--out {out}: {existing} is a file; {advice}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"--out {out}: {existing} is not writable")
    return existing


def check_run_output(run_dir: Path, resume: bool) -> None:
    """Refuse a training --out that training would damage or cannot write (`check_run_contents`), or a run another
    training job is writing (`llm.train.run_lock`)."""
    if check_run_contents(run_dir, resume):
        check_run_unlocked(run_dir)


def check_run_contents(run_dir: Path, resume: bool) -> bool:
    """Refuse a training --out that training would damage or cannot write: a file, a folder below a file or without
    write permission, a non-empty folder that is not a run directory (a user's own config.yaml or metrics.jsonl
    would be overwritten, a prepared data folder filled with checkpoints), or a run's checkpoints without `resume`.
    Whether `run_dir` exists. Checked again once the job holds the run's lock: another job may have written
    checkpoints there between the first check and the lock."""
    if check_writable_out(run_dir, "give a directory") != run_dir:
        return False
    for marker, what in ((TOKENS_FILE, "a prepared data folder"), (TOKENIZER_FILE, "a tokenizer or export folder")):
        if (run_dir / marker).exists():
            raise UserError(f"--out {run_dir} is {what} (it holds {marker}); give the run a directory of its own")
    names = {p.name for p in run_dir.iterdir()}
    clashing = sorted(names & (RUN_ENTRIES - {WANDB_DIR}))  # other files (a log, notes) training leaves alone
    # a run's own: its record, or checkpoints of its making (a folder named checkpoints alone is anyone's: a user's
    # Lightning run beside its own config.yaml had that overwritten)
    own_checkpoints = (checkpoint_dir(run_dir) / LATEST).exists() or bool(checkpoint_tags(run_dir))
    if clashing and not ((run_dir / RUN_RECORD_FILE).is_file() or own_checkpoints):
        raise UserError(f"--out {run_dir} holds {', '.join(clashing[:4])} but is not a zerollm run; training would "
                        "overwrite them: choose a new or empty directory")
    if linked := sorted(name for name in names & RUN_FILES if (run_dir / name).is_symlink()):
        raise UserError(f"--out {run_dir}: {linked[0]} is a symbolic link, where training writes (and appends to) a "
                        "file of its own; replace it by a copy of the file it names")
    for folder in (checkpoint_dir(run_dir), tokenizer_dir(run_dir)):
        if folder.exists() and not folder.is_dir():
            raise UserError(f"--out {run_dir}: {folder} is a file where training keeps a folder; move it away")
    if folders := sorted(name for name in names & RUN_FILES if (run_dir / name).is_dir()):  # was a traceback at the
        raise UserError(f"--out {run_dir}: {run_dir / folders[0]} is a folder where training writes a file; move it "
                        "away")  # first write into it: metrics.jsonl after the first step had trained
    if checkpoint_dir(run_dir).is_dir() and not os.access(checkpoint_dir(run_dir), os.W_OK | os.X_OK):
        raise UserError(f"--out {run_dir}: {checkpoint_dir(run_dir)} is not writable; training saves its checkpoints "
                        "there: make it writable, or choose another --out")
    if latest_tag(run_dir) is not None and not resume:  # read either way: a damaged `latest` is refused here
        raise UserError(f"{run_dir} already holds checkpoints; pass --resume auto to continue it, or choose another "
                        "--out")
    if not resume and (newest := newest_complete_tag(run_dir)) is not None:  # its `latest` is gone: not a new run
        raise UserError(f"{run_dir} already holds checkpoints (the newest complete one is {newest}; "
                        f"{checkpoint_dir(run_dir) / LATEST} is missing); pass --resume auto to continue from "
                        f"{newest}, or choose another --out")
    if not resume and (saved := [tag for tag in checkpoint_tags(run_dir) if manifest_file(run_dir, tag).exists()]):
        raise UserError(f"{run_dir} already holds checkpoints, none of them complete ({saved[-1]}: "
                        f"{incompleteness(run_dir, saved[-1])}); choose another --out, or remove "
                        f"{checkpoint_dir(run_dir)} to train this run anew there")
    return True


def holds_checkpoints(run_dir: Path) -> bool:
    """Whether `--resume auto` continues `run_dir` from a checkpoint (`usable_tag`): `latest` names one, or a
    complete one is there without `latest`."""
    return latest_tag(run_dir) is not None or newest_complete_tag(run_dir) is not None


def config_file(run_dir: Path) -> Path:
    return run_dir / CONFIG_FILE


def recorded_config(run_dir: Path) -> dict[str, Any]:
    """RUN_DIR/config.yaml as a mapping: the resolved run config (what every `auto` became where the run trained);
    a missing or damaged file is one UserError."""
    path = config_file(run_dir)
    try:
        recorded = load_recorded_yaml(bounded_text(path))
    except FileNotFoundError:
        if not run_dir.exists():
            raise UserError(durable.no_such_folder(run_dir)) from None
        raise UserError(f"{run_dir}: no {CONFIG_FILE}; is this a run directory made by `zerollm train`?") from None
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        reason = " ".join((exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)).split())
        raise UserError(f"{path} is damaged ({reason}); `zerollm train` wrote it: restore it") from None
    if not isinstance(recorded, dict):
        raise UserError(f"{path} is damaged (a run config is a YAML mapping, found {type(recorded).__name__}); "
                        "`zerollm train` wrote it: restore it")
    if not recorded.keys() & set(SECTIONS):  # another tool's config.yaml (Hydra's, a trainer's): not damage
        keys = ", ".join(map(str, list(recorded)[:4])) + (", ..." if len(recorded) > 4 else "")
        raise UserError(f"{run_dir}: not a run directory made by `zerollm train` (its {CONFIG_FILE} has none of "
                        f"{', '.join(SECTIONS)}, but {keys or 'nothing'})")
    try:  # a file cut short (a full disk under an earlier version) parses, and leaves keys null or out of range
        build_config(recorded)
    except UserError as exc:
        raise UserError(f"{path} is damaged ({exc}); `zerollm train` wrote it: restore it") from None
    return recorded


def tokenizer_dir(directory: Path) -> Path:
    """The tokenizer copy kept in a run directory or a prepared data directory."""
    return directory / TOKENIZER_DIR


def checkpoint_dir(run_dir: Path) -> Path:
    return run_dir / CHECKPOINTS_DIR


def universal_dir(run_dir: Path) -> Path:
    return checkpoint_dir(run_dir) / UNIVERSAL_DIR


def tag_for(step: int) -> str:
    return f"{TAG_PREFIX}{step}"


def is_tag(name: str) -> bool:
    return re.fullmatch(rf"{TAG_PREFIX}[0-9]{{1,18}}", name) is not None  # a step is a count (MAX_COUNT)


def step_of(tag: str) -> int:
    return int(tag.removeprefix(TAG_PREFIX))


def rng_file(run_dir: Path, tag: str, rank: int) -> Path:
    return checkpoint_dir(run_dir) / tag / f"rng_rank{rank}.pt"


def manifest_file(run_dir: Path, tag: str) -> Path:
    return checkpoint_dir(run_dir) / tag / MANIFEST


def checkpoint_tags(run_dir: Path) -> list[str]:
    """Every `global_step<N>` folder, complete or not, oldest first."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    tags = [p.name for p in root.iterdir() if p.is_dir() and is_tag(p.name)]
    return sorted(tags, key=step_of)


def newest_complete_tag(run_dir: Path, before_step: int | None = None) -> str | None:
    """The newest complete checkpoint (of a step before `before_step`, where given), whatever `latest` names; None
    when there is none."""
    tags = [tag for tag in checkpoint_tags(run_dir) if before_step is None or step_of(tag) < before_step]
    return next((tag for tag in reversed(tags) if incompleteness(run_dir, tag) is None), None)


def _latest_advice(run_dir: Path) -> str:
    """What to do about a `latest` that names no checkpoint: name the newest complete one, which `usable_tag` takes
    once `latest` is gone."""
    newest = newest_complete_tag(run_dir)
    if newest is None:
        return f"write the tag of a checkpoint folder there (e.g. {tag_for(0)}) or delete it to start over"
    return (f"write the tag of a checkpoint folder there ({newest} is the newest complete one) or delete it to "
            f"continue from {newest}")


def latest_tag(run_dir: Path) -> str | None:
    """The tag `latest` names (None before the first checkpoint was published, or when `latest` was lost); it may
    be incomplete or gone. A `latest` that is not a file or not text is a UserError."""
    path = checkpoint_dir(run_dir) / LATEST
    if not path.exists():
        return None
    if not path.is_file():
        raise UserError(f"{path} is not a file (training writes the tag of the newest checkpoint there); "
                        f"{_latest_advice(run_dir)}")
    try:
        with path.open("rb") as file:
            raw = file.read(LATEST_MAX_BYTES + 1)
        if len(raw) > LATEST_MAX_BYTES:  # read whole and said whole, a damaged one of gigabytes exhausted the memory
            raise UserError(f"{path} is damaged (longer than a checkpoint tag); {_latest_advice(run_dir)}")
        text = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise UserError(f"{path} is damaged (not UTF-8 text); {_latest_advice(run_dir)}") from None
    except OSError as exc:
        raise UserError(f"{path} cannot be read ({exc.strerror or exc}); {_latest_advice(run_dir)}") from None
    return text


def checkpoint_files(folder: Path) -> list[str]:
    """Every file in checkpoint folder `folder` and its subfolders, by its path there ('/'-separated: the manifest's
    names), sorted."""
    found = []
    for parent, _, names in os.walk(folder):
        inside = Path(parent).relative_to(folder)
        found += [(inside / name).as_posix() for name in names if os.path.isfile(os.path.join(parent, name))]
    return sorted(found)


def incompleteness(run_dir: Path, tag: str) -> str | None:
    """Why checkpoint `tag` is not complete, or None when it is: the folder must hold exactly the files its
    manifest lists, each with the listed size, those in its subfolders (NVMe offload's `offloaded_tensors`) by their
    path in the folder. A manifest that lists no file in a subfolder (one written before zerollm listed them: an
    NVMe offload checkpoint saved by an earlier version) is checked against the folder's own files only."""
    directory = checkpoint_dir(run_dir) / tag
    if not directory.is_dir():
        return "the folder does not exist"
    try:
        listed = json.loads(bounded_text(manifest_file(run_dir, tag)))["files"]
    except FileNotFoundError:
        return f"no {MANIFEST} (its save did not finish)"
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:  # RecursionError: nested too deep
        return f"unreadable {MANIFEST} ({type(exc).__name__})"
    if not isinstance(listed, dict):
        return f"unreadable {MANIFEST} (its files are not a mapping)"
    names = checkpoint_files(directory)
    if not any("/" in name for name in listed):
        names = [name for name in names if "/" not in name]
    present = {name: (directory / name).stat().st_size for name in names if name != MANIFEST}
    wrong = next((name for name, size in sorted(listed.items()) if not is_count(size)), None)
    if wrong is not None:
        return f"damaged {MANIFEST} (it lists {wrong} with size {listed[wrong]!r}, not a number of bytes)"
    for name, size in sorted(listed.items()):
        if name not in present:
            return f"{name} is missing"
        if present[name] != size:
            return f"{name} has {present[name]} bytes, {size} were written"
    extra = sorted(name for name in set(present) - set(listed) if _read_by_loading(name))
    return f"{', '.join(extra)} not in its {MANIFEST}" if extra else None


def _published_before_manifests(run_dir: Path, tag: str) -> bool:
    """Whether checkpoint `tag`, which `latest` names, was saved whole by a zerollm from before manifests (its first
    day): it holds model states and a client state of that time (without the `tokens_seen` every later one records),
    and no checkpoint of the run has a manifest. Its run was refused as holding only unfinished saves, to be trained
    again. (A run of this version whose manifests were lost is not one: it is told it holds no complete one.)"""
    directory = checkpoint_dir(run_dir) / tag
    if any(checkpoint_dir(run_dir).glob(f"*/{MANIFEST}")) or not any(directory.glob("*model_states.pt")):
        return False
    try:
        state = json.loads(bounded_text(directory / CLIENT_STATE))
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(state, dict) and "step" in state and "tokens_seen" not in state


def _read_by_loading(name: str) -> bool:
    """Whether loading reads a file found in a checkpoint folder that its manifest does not list, so that the folder
    is not the checkpoint saved: DeepSpeed finds the states of the ranks that saved by their names (`*.pt`) and
    reads NVMe offload's subfolders whole. Another one there (a .DS_Store, NFS's .nfs files, a note) changes
    nothing: it made the checkpoint incomplete, so that a resume went back to the one before, and deleted this one
    to save it again."""
    return not any(part.startswith(".") for part in name.split("/")) and ("/" in name or name.endswith(".pt"))


def usable_tag(run_dir: Path) -> str | None:
    """The checkpoint to continue from or load: the one `latest` names when complete, else the newest complete one
    before it (each one passed over is named on stderr). Without `latest`, the newest complete checkpoint (with a
    note: `latest` was lost, or a kill came between the first checkpoint's manifest and its `latest`), None when
    there is none (no checkpoint was ever published). A UserError when `latest` names checkpoints none of which is
    complete."""
    latest = latest_tag(run_dir)
    root = checkpoint_dir(run_dir)
    if latest is None:
        newest = newest_complete_tag(run_dir)
        if newest is not None:
            print(f"zerollm: note: {root} holds complete checkpoints but no {LATEST}; using {newest}, the newest "
                  "complete one", file=sys.stderr, flush=True)
        return newest
    if not is_tag(latest):
        raise UserError(f"{root / LATEST} names '{latest}', which is not a checkpoint tag; {_latest_advice(run_dir)}")
    if _published_before_manifests(run_dir, latest):
        raise UserError(f"{root / latest}: saved by a zerollm from before checkpoints had a {MANIFEST}, whose "
                        "checkpoints this version cannot load; export the run with that version (`zerollm export "
                        f"--run {run_dir} --out DIR`) and give this one the export (--init-from DIR, --model DIR)")
    candidates = [tag for tag in checkpoint_tags(run_dir) if step_of(tag) < step_of(latest)] + [latest]
    passed_over = []
    for tag in reversed(candidates):
        problem = incompleteness(run_dir, tag)
        if problem is None:
            if passed_over:
                print(f"zerollm: note: passed over incomplete checkpoint(s) {'; '.join(passed_over)}; using {tag}",
                      file=sys.stderr, flush=True)
            return tag
        passed_over.append(f"{root / tag}: {problem}")
    if newest_complete_tag(run_dir) is not None:  # past the one `latest` names, which is gone
        raise UserError(f"{root / LATEST} names {latest}, but no checkpoint up to it is complete "
                        f"({'; '.join(passed_over)}); {_latest_advice(run_dir)}")
    raise UserError(f"{root} holds no complete checkpoint ({'; '.join(passed_over)}), so nothing can be loaded from "
                    "this run; train it again into a new run directory")


def client_state_of(run_dir: Path, tag: str) -> dict[str, Any]:
    """What checkpoint `tag` recorded beside DeepSpeed's state (`llm.train.trainer`: step, run id, world size,
    tokens seen, sampler, loss scale, time budget), its fields checked; a missing or damaged file is a UserError."""
    client_file = checkpoint_dir(run_dir) / tag / CLIENT_STATE
    if not client_file.is_file():
        raise UserError(f"{client_file.parent}: no {CLIENT_STATE}; the checkpoint is incomplete")
    try:
        state = json.loads(bounded_text(client_file))
    except UnicodeDecodeError:
        problem = "not UTF-8 text"
    except ValueError as exc:
        problem = f"not JSON: {exc}"
    except RecursionError:
        problem = "JSON nested too deep"
    except OSError as exc:
        problem = f"unreadable: {exc.strerror or exc}"
    else:
        problem = _client_state_problem(state, tag) or _saved_by_other_ranks(run_dir, tag, state["world_size"])
    if problem is not None:
        raise UserError(f"{client_file} is damaged ({problem}), so checkpoint {tag} cannot be used; "
                        f"{damaged_checkpoint_advice(run_dir, tag)}")
    return state


def _saved_by_other_ranks(run_dir: Path, tag: str, world_size: int) -> str | None:
    """Why a client state's world size is not the one its checkpoint's manifest records (each rank's files are
    there for that many: DeepSpeed's load, or a universal conversion decided from it, then failed with a
    traceback), or None; a manifest that does not say is taken at its word."""
    try:
        saved = json.loads(bounded_text(manifest_file(run_dir, tag))).get("world_size")
    except (OSError, ValueError, AttributeError, RecursionError):
        return None
    if is_count(saved, least=1) and saved != world_size:
        return f"world_size is {world_size}, but its {MANIFEST} records the files of {saved} {plural('rank', saved)}"
    return None


MAX_COUNT = 2**63 - 1
"""The largest count read from a run's JSON: what a signed 64-bit integer (torch's, numpy's, an array's) holds."""


def is_count(value: Any, least: int = 0) -> bool:
    """Whether a value read from a run's JSON is a whole number from `least` to MAX_COUNT (true and false are not)."""
    return isinstance(value, int) and not isinstance(value, bool) and least <= value <= MAX_COUNT


def is_number(value: Any) -> bool:
    """Whether a value read from a run's JSON is a finite number (true, false, NaN, Infinity and integers beyond
    any float are not)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and \
        -sys.float_info.max <= value <= sys.float_info.max  # NaN compares false


def _client_state_problem(state: Any, tag: str) -> str | None:
    """What is wrong with a client state as `client_state_of` parsed it (None: nothing): each field the code reads,
    with its type and range."""
    if not isinstance(state, dict):
        return f"a JSON object was expected, found {type(state).__name__}"
    if not is_count(state.get("step")):
        return f"step is {state.get('step')!r}, not a step number"
    if state["step"] != step_of(tag):
        return f"step is {state['step']}, not the folder's {step_of(tag)}"
    if not isinstance(state.get("run_id"), str):
        return f"run_id is {state.get('run_id')!r}, not a string"
    if not is_count(state.get("world_size"), least=1):
        return f"world_size is {state.get('world_size')!r}, not a number of ranks"
    sampler = state.get("sampler")
    if not isinstance(sampler, dict):
        return f"sampler is {sampler!r}, not an object"
    for key in ("epoch", "consumed", "seed", "num_samples"):
        if not is_count(sampler.get(key)):
            return f"sampler.{key} is {sampler.get(key)!r}, not a count"
    if sampler["consumed"] > sampler["num_samples"]:
        return f"sampler.consumed is {sampler['consumed']}, more than its {sampler['num_samples']} samples"
    if "tokens_seen" in state and not is_count(state["tokens_seen"]):  # an earlier version's has none
        return f"tokens_seen is {state['tokens_seen']!r}, not a count"
    if state.get("loss_scale") is not None and not is_number(state["loss_scale"]):
        return f"loss_scale is {state['loss_scale']!r}, not a number"
    budget = state.get("time_budget")
    if budget is not None:
        if not isinstance(budget, dict):
            return f"time_budget is {budget!r}, not an object"
        for key in ("elapsed", "step_seconds", "save_seconds", "eval_seconds", "warmup_end"):
            optional = key in ("eval_seconds", "warmup_end")
            if not (is_number(budget.get(key)) or optional and budget.get(key) is None):
                return f"time_budget.{key} is {budget.get(key)!r}, not a number of seconds"
    return None


def earlier_complete_tag(run_dir: Path, tag: str) -> str | None:
    """The newest complete checkpoint before `tag`, None where there is none."""
    earlier = [older for older in checkpoint_tags(run_dir)
               if step_of(older) < step_of(tag) and incompleteness(run_dir, older) is None]
    return earlier[-1] if earlier else None


def damaged_checkpoint_advice(run_dir: Path, tag: str) -> str:
    """What to do about checkpoint `tag` when a file in it is damaged: remove its folder, so that `usable_tag` falls
    back to the newest complete one before it, when there is one."""
    if (earlier := earlier_complete_tag(run_dir, tag)) is not None:
        return f"remove {checkpoint_dir(run_dir) / tag} to continue from {earlier}, the newest complete checkpoint " \
               "before it"
    return "no earlier checkpoint is complete: train the run again into a new run directory"


def recorded_tokens_per_step(run_dir: Path) -> int:
    """Global batch x data.seq_len, twice that for DPO (a pair's two rows): the positions one step trains on, as the
    run directory records them (its last session's batch); a UserError where its files do not say."""
    config = recorded_config(run_dir)
    seq_len = (config.get("data") or {}).get("seq_len")  # a file cut short lacks it
    path = run_dir / DS_CONFIG_FILE
    try:
        batch = json.loads(path.read_text())["train_batch_size"]
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise UserError(f"{path}: cannot read the run's train_batch_size ({type(exc).__name__}: {exc}); `zerollm "
                        "train` wrote it: restore it") from None
    if not all(is_count(v, least=1) for v in (batch, seq_len)):
        raise UserError(f"{run_dir}: train_batch_size {batch!r} and data.seq_len {seq_len!r} are not positive "
                        "integers; `zerollm train` wrote them: restore the run's files")
    return batch * seq_len * (2 if (config.get("train") or {}).get("stage") == "dpo" else 1)
