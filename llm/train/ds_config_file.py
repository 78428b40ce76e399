"""The DeepSpeed JSON a training command names (`--deepspeed`), or the stage's shipped one, read as a JSON object.

Reading it needs neither torch nor DeepSpeed, so the process that starts a job's ranks (`--nproc`, `zerollm launch`)
reads it first: a missing or broken file is one line before any rank starts, not one line per rank. Filling and
checking its values is `llm.train.engine.resolve_ds_config`'s, in every rank.
"""

from pathlib import Path
from typing import Any

from llm.errors import UserError, read_user_json_object

DS_CONFIG_DIR = Path(__file__).resolve().parents[2] / "ds_configs"


def shipped_names() -> list[str]:
    return sorted(path.stem for path in DS_CONFIG_DIR.glob("*.json"))


def load_ds_config(path: str | Path | None, stage: str) -> tuple[dict[str, Any], str]:
    """The raw DeepSpeed JSON and its name for messages: `path`, or the shipped config a missing `path` names (a
    bare name, `pretrain_zero3`, or `ds_configs/pretrain_zero3.json` as the README writes it: found from any
    directory); by default the stage's shipped one, ds_configs/<stage>.json."""
    if path is not None and not str(path).strip():  # `--deepspeed "$UNSET"` took the default silently
        raise UserError("--deepspeed is empty: give a JSON file or a shipped name, or leave the option out for the "
                        f"stage's own ({stage})")
    path = Path(path) if path is not None else DS_CONFIG_DIR / f"{stage}.json"
    if not path.exists() and (path.parent == Path(".") and not path.suffix
                              or path.parent == Path("ds_configs") and path.suffix == ".json"):
        path = DS_CONFIG_DIR / f"{path.stem}.json" if path.stem in shipped_names() else path
    if path.is_dir():
        raise UserError(f"{path}: is a directory; the DeepSpeed config is a JSON file")
    if not path.is_file():
        raise UserError(f"{path}: DeepSpeed config not found (give a JSON file, or a shipped one by name: "
                        f"{', '.join(shipped_names())})")
    return read_user_json_object(path, "DeepSpeed config"), str(path)
