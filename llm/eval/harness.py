"""Benchmark suites through lm-evaluation-harness (the `eval` extra: lm-eval, transformers below 5.25): `zerollm
eval --tasks hellaswag,ceval-valid,cmmlu` runs the harness's tasks on our model (`llm.eval.harness_lm`), prints its
results table and saves the table and the full results in MODEL_DIR/eval/ (or --out).

Task data comes from the Hugging Face Hub the first time a public task runs (then from the datasets cache);
tasks of your own are YAML files in a folder given with --include-path (lm-eval's task format; a local jsonl file
works through `dataset_path: json` and `dataset_kwargs.data_files`).
"""

from __future__ import annotations

import json
import math
import os
import time
import traceback
from itertools import count
from pathlib import Path

import yaml

from llm import durable, rundir
from llm.devices import place, resolve
from llm.errors import UserError
from llm.eval.perplexity import check_batch_size, evaluation_context
from llm.jsonl import strict_json
from llm.loading import load_scored
from llm.train.run_record import git_state

INSTALL_HINT = ("lm-eval is not installed; pip install 'lm-eval' 'transformers<5.25' (or the eval extra: pip install "
                "'zerollm[eval]') to run --tasks")


def require_lm_eval():
    """The lm_eval module, or a one-line UserError saying how to install it."""
    try:
        import lm_eval  # noqa: PLC0415 - optional dependency, needed only for --tasks
    except ImportError:
        raise UserError(INSTALL_HINT) from None
    return lm_eval


def parse_tasks(text: str) -> list[str]:
    tasks = [t.strip() for t in text.split(",") if t.strip()]
    if not tasks:
        raise UserError("--tasks expects comma-separated task names, e.g. --tasks hellaswag,ceval-valid,cmmlu")
    return tasks


class _TaskYamlLoader(yaml.SafeLoader):
    """Reads lm-eval task YAML as far as checking it parses: its tags (`!function utils.process`) load as None."""


_TaskYamlLoader.add_multi_constructor("!", lambda loader, suffix, node: None)


def check_task_files(include_path: Path) -> dict[str, tuple[Path, list[str]]]:
    """Refuse an --include-path that is not a folder, or whose task YAML files do not parse or `include:` a file that
    is not there (lm-eval skips such a file with a log line, and its tasks are then reported unknown). Returns the
    groups its files define: name -> (file, the names of its member tasks)."""
    if not include_path.is_dir():
        raise UserError(f"--include-path {include_path}: no such directory of task YAML files")
    groups = {}
    for path in sorted(include_path.rglob("*.y*ml")):
        try:
            task = yaml.load(path.read_text(encoding="utf-8"), Loader=_TaskYamlLoader)  # noqa: S506 - a SafeLoader
        except (yaml.YAMLError, UnicodeDecodeError, OSError) as exc:
            reason = " ".join(str(exc).split())
            raise UserError(f"{path}: not a readable task YAML ({reason})") from None
        included = task.get("include", []) if isinstance(task, dict) else []
        for name in included if isinstance(included, list) else [included]:  # as lm-eval resolves them
            if isinstance(name, str) and not (path.parent / name).is_file():  # an absolute name stays absolute
                raise UserError(f"{path}: 'include: {name}' names no file (it is read beside the YAML, in "
                                f"{path.parent})")
        if isinstance(task, dict) and isinstance(task.get("group"), str) and isinstance(task.get("task"), list):
            groups[task["group"]] = (path, [member for member in task["task"] if isinstance(member, str)])
    return groups


def code_commit() -> str | None:
    """This package's git commit, marked `-dirty` when the checkout has uncommitted changes; None outside one."""
    state = git_state()
    return state and state["commit"] and state["commit"] + ("-dirty" if state["dirty"] else "")


def task_manager(tasks: list[str], include_path: str | None):
    """lm-eval's index of the tasks to run: of --include-path alone where every task asked for is a task defined
    there (indexing lm-eval's own 15,000 tasks as well takes 12 s on a 2-core CPU), else of both (lm-eval's tasks,
    and a group or tag, whose members may come from either)."""
    from lm_eval.tasks import TaskManager  # noqa: PLC0415 - optional dependency

    if include_path is not None:
        local = TaskManager(include_path=include_path, include_defaults=False)
        if set(tasks) <= set(local.all_subtasks):  # tasks, not groups or tags
            return local
    return TaskManager(include_path=include_path)


def run_tasks(model_dir: str, tasks: list[str], limit: float | None = None, num_fewshot: int | None = None,
              include_path: str | None = None, batch_size: int = 8, device: str = "auto", dtype: str = "auto",
              out_dir: str | None = None, context: int | None = None, chat: bool = False,
              system_instruction: str | None = None, log_samples: bool = False) -> dict:
    """Run lm-eval `tasks` on the model of a run or export directory; print the table, save
    `lm_eval_<time>.json` (the harness's results) and `lm_eval_<time>.md` (its table) in `out_dir` (default
    MODEL_DIR/eval), and with `log_samples` each task's requests and answers as `lm_eval_<time>_samples_<task>.jsonl`.
    `chat`: contexts through the tokenizer's chat template, few-shot examples as turns (lm-eval's
    --apply_chat_template); `system_instruction`: a system turn (without `chat`, text before each context).
    Returns the harness's results (without the samples)."""
    check_batch_size(batch_size)  # lm-eval failed on 0 (and -1) after loading everything
    if limit is not None and not (0 < limit < 1 or (math.isfinite(limit) and limit == int(limit) >= 1)):
        # NaN and inf included (inf: an OverflowError in lm-eval); 1.5 ran 1 example, without a word
        raise UserError(f"--limit must be a whole number of examples per task, or a fraction of them below 1, got "
                        f"{limit:g}")
    if num_fewshot is not None and num_fewshot < 0:
        raise UserError(f"--num-fewshot must be 0 or more, got {num_fewshot}")
    out = Path(out_dir) if out_dir else Path(model_dir) / rundir.EVAL_DIR
    rundir.check_writable_out(out, "give a folder for the results")  # before the evaluation: results not lost
    lm_eval = require_lm_eval()
    from lm_eval import evaluator  # noqa: PLC0415 - optional dependency
    from lm_eval.utils import make_table  # noqa: PLC0415 - optional dependency

    from llm.eval.harness_lm import ZeroLLMHarnessModel  # noqa: PLC0415 - subclasses lm-eval's LM: needs lm_eval

    groups = check_task_files(Path(include_path)) if include_path is not None else {}
    manager = task_manager(tasks, include_path)
    unknown = [t for t in tasks if not manager.match_tasks([t])]
    if unknown:
        raise UserError(f"unknown lm-eval task(s): {', '.join(unknown)}; `lm-eval ls tasks` lists them, "
                        "and --include-path DIR adds your own YAML tasks")
    for group in (t for t in tasks if t in groups):  # an unknown member was a TypeError naming nothing
        path, members = groups[group]
        if missing := [m for m in members if not manager.match_tasks([m])]:
            raise UserError(f"{path}: group {group} names {', '.join(missing)}, which no lm-eval task is called; "
                            "`lm-eval ls tasks` lists them")
    where, precision = resolve(device, dtype)
    model, tokenizer, checkpoint = load_scored(model_dir)
    if chat:
        try:
            tokenizer.check_chat_template()
        except UserError as exc:
            raise UserError(f"--apply-chat-template: {exc}; or score the model without the option") from None
    context = evaluation_context(context, Path(model_dir), model)
    harness_model = ZeroLLMHarnessModel(place(model, where, precision), tokenizer, batch_size, context, chat=chat)
    try:  # once the tasks and the model are known (a mistake in them, or a --model mistyped, left it made and empty);
        out.mkdir(parents=True, exist_ok=True)  # what may still fail where the folder above is writable: /proc
    except OSError as exc:
        raise UserError(f"--out {out}: cannot create it ({exc.strerror or exc})") from None
    # lm-eval records `git describe` of the working directory as the version of the code that scored the model, and
    # git's "fatal: not a git repository" reached our stderr outside a checkout: the code is this package
    evaluator.get_git_commit_hash = code_commit
    try:
        results = lm_eval.simple_evaluate(model=harness_model, tasks=tasks, num_fewshot=num_fewshot, limit=limit,
                                          task_manager=manager, log_samples=log_samples, apply_chat_template=chat,
                                          fewshot_as_multiturn=chat, system_instruction=system_instruction)
    except ConnectionError as exc:
        raise UserError(f"lm-eval could not download the task data ({exc}); run once where the Hugging Face Hub "
                        "is reachable (the data is cached), or use a local task with --include-path") from None
    except Exception as exc:  # noqa: BLE001 - what a task's YAML, data or functions raise, through lm-eval
        if not _task_fault(exc):
            raise  # zerollm's own code, or the model's: a bug to see whole
        if isinstance(exc, OverflowError) and _raised_in(exc, "lm_eval"):  # exp() of its perplexities, not the task's
            raise UserError(f"lm-eval failed on {', '.join(tasks)}: a perplexity overflowed ({_said(exc)}), the "
                            f"model's mean loss there being above 709 nats: has {model_dir} diverged? `zerollm eval "
                            "--input FILE` gives its loss and bits per byte") from None
        raise UserError(f"lm-eval failed on {', '.join(tasks)} ({_said(exc)}); check the tasks' YAML and data "
                        "files") from None
    table = make_table(results) + ("\n" + make_table(results, "groups") if results.get("groups") else "")
    samples = results.pop("samples", {})
    # which model scored, as lm-eval records a Hugging Face model ("ZeroLLMHarnessModel" and nulls before)
    scored = f"model={model_dir}" + (f",checkpoint={checkpoint}" if checkpoint else "")
    results.setdefault("config", {}).update(model="zerollm", model_args=scored, batch_size=batch_size,
                                           device=str(where), dtype=str(precision).removeprefix("torch."))
    named = f"{model_dir} ({checkpoint})" if checkpoint else model_dir
    # a diverged model's NaN metrics as null: bare NaN is not JSON, and strict readers refused the file
    written = []  # everything saved before anything is printed: a reader that leaves (`| head`) loses no result
    try:
        with durable.room_needed(out, "the results", again="run the evaluation again"):
            stem = save_results(out, json.dumps(strict_json(results), indent=1, default=str, ensure_ascii=False),
                                f"model: {named}\n\n{table}")
            for task, rows in samples.items():
                path = stem.with_name(f"{stem.name}_samples_{_file_name_part(task)}.jsonl")
                durable.write_text(path, "".join(json.dumps(strict_json(row), default=str, ensure_ascii=False) + "\n"
                                                 for row in rows))
                written.append(f"samples of {task} written to {path}")
    except UserError:  # a full disk: what the evaluation found is still shown (it was a traceback, the table lost)
        print(table, flush=True)
        raise
    print(table)
    print(f"results written to {stem}.json and {stem}.md")
    for line in written:
        print(line)
    return results


def _file_name_part(task: str) -> str:
    """A task's name as part of a file name: a '/' (a task named `mine/choice`) is not one."""
    return task.replace("/", "_").replace(os.sep, "_")


def _said(exc: BaseException) -> str:
    """An exception from a task's data or YAML in one line: its type, its message, and the cause the datasets
    library wraps in its generic one ("An error occurred while generating the dataset")."""
    said = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if isinstance(exc, StopIteration) and _raised_in(exc, "datasets"):  # its JSON reader's look at an empty file
        said += " (a task's data file is empty?)"
    if exc.__cause__ is not None:
        said += f", from {_said(exc.__cause__)}"
    return " ".join(said.split())[:500]


def _task_fault(exc: BaseException) -> bool:
    """Whether `exc`, raised while lm-eval ran the tasks, comes from them or from lm-eval (a task's YAML, data,
    template, `!function` or metric): no frame of zerollm's own code lies below this module's call into lm-eval (the
    model, its wrapper and the tokenizer are zerollm's: an error there is a bug to see whole)."""
    package = Path(__file__).resolve().parents[1]
    frames = traceback.extract_tb(exc.__traceback__)[1:]  # the first is run_tasks, where it was caught
    return not any(Path(frame.filename).resolve().is_relative_to(package) for frame in frames)


def _raised_in(exc: BaseException, package: str) -> bool:
    """Whether the innermost frame of `exc`'s traceback is in the installed `package`."""
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and f"{os.sep}{package}{os.sep}" in frames[-1].filename


def save_results(out: Path, results: str, table: str) -> Path:
    """Write `results` (JSON text) and `table` as OUT/lm_eval_<time>.json and .md, each atomically
    (`llm.durable`); returns their common path without suffix. The name is claimed by creating the .json
    exclusively, so that runs finishing in the same second (or at once) each get their own: lm_eval_<time>,
    lm_eval_<time>-1, ..."""
    out.mkdir(parents=True, exist_ok=True)
    stamp = f"lm_eval_{time.strftime('%Y%m%d-%H%M%S')}"
    for n in count():
        stem = out / (f"{stamp}-{n}" if n else stamp)
        if stem.with_suffix(".md").exists():
            continue
        try:
            os.close(os.open(stem.with_suffix(".json"), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
        except FileExistsError:
            continue
        break
    try:
        durable.write_text(stem.with_suffix(".json"), results)
        durable.write_text(stem.with_suffix(".md"), table)
    except BaseException:  # the name claimed, empty, is no result
        stem.with_suffix(".json").unlink(missing_ok=True)
        raise
    return stem
