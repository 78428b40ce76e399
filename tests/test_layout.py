"""The house rules of the code base, checked on its source: no import circles, the launcher and the model keep
to their side of the walls, and every exit code and run-directory name is defined once."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import REPO

PACKAGES = ("llm", "kernels", "launch")


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The project module `name` refers to (a submodule, or the package/module holding an imported name)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str) -> set[str]:
    """Project modules imported anywhere in `module` (at the top or inside functions)."""
    tree = ast.parse(MODULES[module].read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {target for name in names if (target := _resolve(name)) and target != module}
    return found


GRAPH = {module: imports_of(module) for module in MODULES}


def _cycle() -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(GRAPH[module]):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (found := visit(target)):
                return found
        path.pop()
        state[module] = 2
        return None

    for module in sorted(GRAPH):
        if module not in state and (found := visit(module)):
            return found
    return None


def test_no_module_imports_another_in_a_circle():
    assert _cycle() is None, " -> ".join(_cycle())


def test_the_checker_sees_circles():
    GRAPH["llm.errors"].add("llm.cli")
    try:
        assert _cycle() is not None
    finally:
        GRAPH["llm.errors"].discard("llm.cli")


def _reaching(prefix: str) -> dict[str, set[str]]:
    return {m: {t for t in targets if t == prefix or t.startswith(prefix + ".")}
            for m, targets in GRAPH.items()}


def test_the_launcher_starts_processes_without_the_trainer_or_the_model():
    for forbidden in ("llm.train", "llm.model"):
        offenders = {m: t for m, t in _reaching(forbidden).items() if m.startswith("launch") and t}
        assert not offenders, offenders


def test_the_model_does_not_import_inference():
    offenders = {m: t for m, t in _reaching("llm.infer").items() if m.startswith("llm.model") and t}
    assert not offenders, offenders


def _assignments(name_prefix: str) -> dict[str, list[str]]:
    where: dict[str, list[str]] = {}
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name) and target.id.startswith(name_prefix):
                        where.setdefault(target.id, []).append(module)
    return where


def test_every_exit_code_is_defined_once_in_errors():
    codes = _assignments("EXIT_")
    assert {"EXIT_USER_ERROR", "EXIT_PREEMPTED", "EXIT_RANK_LOST"} <= set(codes)
    assert all(modules == ["llm.errors"] for modules in codes.values()), codes


RUN_DIR_NAMES = ("config.yaml", "ds_config.json", "metrics.jsonl", "client_state.json", "checkpoints", "latest",
                 "global_step")


def test_every_run_directory_name_is_spelled_once_in_rundir():
    spelled: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in RUN_DIR_NAMES:
                spelled.setdefault(node.value, set()).add(module)
    assert spelled == {name: {"llm.rundir"} for name in RUN_DIR_NAMES}


def test_an_installed_wheel_holds_what_the_commands_read(tmp_path):
    """`pip install .` (not editable) left out ds_configs/, beside the packages: every training was refused
    ('DeepSpeed config not found ... a shipped one by name: '), and `zerollm demo` failed at its pretraining."""
    source = tmp_path / "source"
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for name in filter(None, tracked.decode().split("\0")):
        if (REPO / name).is_file():  # (a file deleted in this checkout is tracked still)
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", source, "--no-deps", "--no-build-isolation", "-w", tmp_path / "wheel"], check=True,
                   capture_output=True)
    subprocess.run([*pip, "install", "--no-deps", "--target", tmp_path / "installed",
                    *(tmp_path / "wheel").glob("*.whl")], check=True, capture_output=True)
    check = ("from llm.config import recipe_names\nfrom llm.train.ds_config_file import load_ds_config, shipped_names\n"
             "import llm\nprint(llm.__file__, shipped_names(), recipe_names(), load_ds_config(None, 'sft')[1])")
    result = subprocess.run([sys.executable, "-c", check], cwd=tmp_path, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(tmp_path / "installed")})
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(str(tmp_path / "installed" / "llm"))
    assert "['distill', 'dpo', 'grpo', 'pretrain', 'pretrain_zero3', 'sft']" in result.stdout
    assert "'demo'" in result.stdout and result.stdout.rstrip().endswith("ds_configs/sft.json")
