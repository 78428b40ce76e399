"""Which device a job trains on, and DeepSpeed's accelerator chosen from it before DeepSpeed is imported.

DeepSpeed's CPU accelerator must be selected before `deepspeed` is first imported, which
`ensure_accelerator_env` does; every module that imports deepspeed calls it first. The choice depends on the job's
size (MPS for one rank only), so a rank makes it again rather than keep the one it inherits from the process that
started it (`zerollm train --nproc N`, `zerollm launch`, DeepSpeed's runner), which chose for a job of one.

torch is imported only to look for a GPU, and not where the user chose DeepSpeed's accelerator (DS_ACCELERATOR):
`zerollm launch`, which starts ranks and trains nothing, then starts its launcher without loading torch.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import os
from pathlib import Path

from llm.errors import UserError
from llm.runtime.rank_env import CHOSEN_ACCELERATOR, announced_world_size


def training_device_type(cuda: bool, mps: bool, world_size: int) -> str:
    """Where a rank trains: a CUDA GPU when there is one; Apple's MPS for a single rank (a Mac has one GPU);
    else the CPU."""
    if cuda:
        return "cuda"
    return "mps" if mps and world_size == 1 else "cpu"


def local_device_type() -> str:
    import torch  # noqa: PLC0415 - only to look for a GPU: ensure_accelerator_env needs none where the user chose

    return training_device_type(torch.cuda.is_available(), torch.backends.mps.is_available(),
                                announced_world_size(dict(os.environ)))


def ensure_accelerator_env() -> None:
    """Select DeepSpeed's accelerator (cpu or mps) for this process's job where there is no CUDA GPU and the user
    chose none, marking it as our choice; must run before deepspeed is imported. A marked choice this process
    inherited is made again, for this job's size."""
    inherited = os.environ.pop(CHOSEN_ACCELERATOR, None)
    if inherited is not None and os.environ.get("DS_ACCELERATOR") == inherited:
        del os.environ["DS_ACCELERATOR"]
    if "DS_ACCELERATOR" in os.environ:  # the user's
        return
    kind = local_device_type()
    if kind != "cuda":
        os.environ["DS_ACCELERATOR"] = os.environ[CHOSEN_ACCELERATOR] = kind


def deepspeed_accelerators() -> tuple[str, ...] | None:
    """The DS_ACCELERATOR values the installed DeepSpeed takes (its SUPPORTED_ACCELERATOR_LIST, read from its source:
    importing DeepSpeed is what fails on another), or None where that cannot be read."""
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or not spec.submodule_search_locations:
        return None
    source = Path(next(iter(spec.submodule_search_locations))) / "accelerator" / "real_accelerator.py"
    try:
        tree = ast.parse(source.read_text(encoding="utf-8"))
    except (OSError, ValueError, SyntaxError):
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(target, "id", None) == "SUPPORTED_ACCELERATOR_LIST"
                                                for target in node.targets):
            with contextlib.suppress(ValueError, TypeError):
                return tuple(str(name) for name in ast.literal_eval(node.value))
    return None


def refuse_unknown_accelerator() -> None:
    """A DS_ACCELERATOR DeepSpeed does not know (`Cpu`, a typo) is one line: DeepSpeed raised a ValueError traceback
    as it was imported (train, generate, eval)."""
    chosen = os.environ.get("DS_ACCELERATOR")
    if chosen is None or (known := deepspeed_accelerators()) is None or chosen in known:
        return
    raise UserError(f"DS_ACCELERATOR={chosen} is not one DeepSpeed knows ({', '.join(known)}); correct or unset it "
                    "(zerollm then picks a CUDA GPU where there is one, else the CPU)")


def check_chosen_accelerator() -> None:
    """Refuse a DS_ACCELERATOR naming a device this machine lacks (cuda, mps: a variable carried over from a GPU
    cluster), in a process about to train here: DeepSpeed failed on it with a traceback as its engine set the
    device. Other values are DeepSpeed's to judge; torch is imported only for these two."""
    chosen = os.environ.get("DS_ACCELERATOR")
    lacking = {"cuda": "CUDA GPU", "mps": "Apple MPS device"}.get(chosen or "")
    if lacking is None:
        return
    import torch  # noqa: PLC0415 - only to look for the device chosen

    if not (torch.cuda.is_available() if chosen == "cuda" else torch.backends.mps.is_available()):
        raise UserError(f"DS_ACCELERATOR={chosen}, but this machine has no {lacking}; unset it (zerollm then trains "
                        "on a CUDA GPU where there is one, else on the CPU), or set it to cpu")
