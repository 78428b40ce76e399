"""GRPO rewards: the `--reward` terms, each scoring every completion of a rollout with one float.

A term is `[WEIGHT*]NAME`; the reward of a completion is the weighted sum of its terms (weight 1 by default), and
every term's unweighted mean is logged as `reward/<name>`.

    exact_match        1 when the completion's final answer equals the record's `answer`, else 0 (`final_answer`
                       says how the answer is found; numbers compare by value, so "12.0" matches 12)
    format[:REGEX]     1 when the whole stripped completion matches REGEX (default: DeepSeek-R1's
                       <think>...</think> <answer>...</answer>), else 0
    length             -(completion tokens / grpo.max_new_tokens), the stop token counted: a penalty from
                       -1/max_new_tokens to -1 for long completions
    model:DIR          a local Hugging Face sequence-classification model (needs `transformers`): its logit when it
                       has one label, else the probability of its last label, on the prompt and completion rendered
                       with the model's chat template
    module:function    a function of yours, `module` importable from the working directory or a path to a .py
                       file (imported as `python FILE` runs it); called as function(prompts=..., completions=...,
                       **fields) with one entry per completion: the prompt's messages, the completion's text, and
                       each other field of its record (`answer`, ...; None where a record lacks it); it returns one
                       float per completion

A mistake in a term (unknown name, module that does not import, missing model directory) is a `UserError`.
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import importlib.util
import inspect
import os
import re
import signal
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Mapping, Sequence, Sized
from dataclasses import dataclass, replace
from decimal import Decimal, InvalidOperation
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from llm.chat_template import ChatTemplate
from llm.errors import UserError
from llm.rundir import HF_CONFIG_FILE

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
"""The special tokens transformers' `apply_chat_template` gives a template by name, where the tokenizer sets them (an
unset one rendered as 'None')."""
R1_FORMAT = r"<think>.*?</think>\s*<answer>.*?</answer>"
REWARD_MODEL_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model",
                                "vocab.txt")
"""A reward model directory holds at least one of these (without them transformers found no tokenizer, and the
first rollout failed in the model, far from the cause)."""
NO_LIMIT = 10**20
"""A tokenizer's model_max_length at or above this is transformers' 'no limit' (10**30)."""


@dataclass
class Completions:
    """A rollout's completions as the rewards see them, one entry per completion."""

    prompts: list[list[dict[str, str]]]
    """The messages of the completion's prompt, the last one the user's."""
    texts: list[str]
    """The completion's text, without its stop token."""
    lengths: list[int]
    """The completion's tokens, its stop token included."""
    fields: list[dict[str, Any]]
    """The other fields of the completion's prompt record (`answer`, ...)."""


# ---- exact match ------------------------------------------------------------------------------------

def _last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...}, braces balanced."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for i in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth < 0:
            return text[begin:i]
    return None


def final_answer(completion: str) -> str:
    """The final answer of a completion: the content of its last <answer>...</answer>; else of its last
    \\boxed{...}; else the text after its last '####' (GSM8K); else the whole completion. Stripped of surrounding
    whitespace and of one trailing full stop ('.' or '。')."""
    tagged = re.findall(r"<answer>(.*?)</answer>", completion, re.DOTALL)
    if tagged:
        answer = tagged[-1]
    elif (boxed := _last_boxed(completion)) is not None:
        answer = boxed
    elif "####" in completion:
        answer = completion.rsplit("####", 1)[1]
    else:
        answer = completion
    answer = answer.strip()
    return answer[:-1].rstrip() if answer.endswith((".", "。")) else answer


MINUS = "\u2212"
"""The minus sign of typeset text (−3), which models trained on it write for the hyphen-minus of ASCII (-3)."""
NUMBER = re.compile(rf"[+\-{MINUS}]?(?:\d{{1,3}}(?:,\d{{3}})+(?:\.\d+)?|\d+(?:\.\d*)?|\.\d+)(?:[eE][+\-{MINUS}]?\d+)?")
"""A number as answers write it: a sign (the minus sign too), digits, with commas only between groups of three
(1,234,567), a fraction, an exponent."""


def _number(text: str) -> Decimal | None:
    """The number `text` writes (`NUMBER`), exactly; None for anything else ("nan", "inf" and "infinity" are words,
    compared as text: a record answered "nan" never matched, NaN being unequal to itself; '1,2,3' is a list, not 123,
    and '1_000' Python's spelling, not an answer's). Exactly: through float, with a tolerance of 1e-9, an answer of
    1,000,000,000,500 matched 10**12, 3e-10 matched -5e-10, and integers beyond 2**53 could not be told apart."""
    if not NUMBER.fullmatch(text):
        return None
    try:
        return Decimal(text.replace(",", "").replace(MINUS, "-"))
    except InvalidOperation:  # digits Decimal does not read (NUMBER's \d is any script's)
        return None


def answers_match(completion: str, answer: Any) -> bool:
    """Whether the completion's `final_answer` equals `answer` (a string or a number): by value when both are
    numbers, else as text, both stripped like `final_answer`."""
    got, want = final_answer(completion), final_answer(str(answer))
    if not want:  # an answer of '.' or '。': an empty completion matched it
        return False
    got_number, want_number = _number(got), _number(want)
    if got_number is not None and want_number is not None:
        return got_number == want_number
    return got == want


def exact_match(batch: Completions) -> list[float]:
    return [float(answers_match(text, fields["answer"]))
            for text, fields in zip(batch.texts, batch.fields, strict=True)]


# ---- format, length -----------------------------------------------------------------------------------

class FormatReward:
    def __init__(self, pattern: str) -> None:
        try:
            self.regex = re.compile(pattern, re.DOTALL)
        except (re.error, OverflowError, RecursionError) as exc:  # a{99999999999}; thousands of nested groups
            raise UserError(f"--reward format:{pattern}: not a regular expression ({exc})") from None

    def __call__(self, batch: Completions) -> list[float]:
        return [float(self.regex.fullmatch(text.strip()) is not None) for text in batch.texts]


class LengthPenalty:
    def __init__(self, max_new_tokens: int) -> None:
        self.max_new_tokens = max_new_tokens

    def __call__(self, batch: Completions) -> list[float]:
        return [-n / self.max_new_tokens for n in batch.lengths]


# ---- a reward model ------------------------------------------------------------------------------------

class RewardModel:
    """A local sequence-classification model directory (safetensors weights only; no remote code: its config's
    `auto_map` asked on a terminal whether to run the folder's Python, and ran it on a "y"). Loaded on first use on
    each rank, on `device`."""

    def __init__(self, directory: str, device: torch.device) -> None:
        try:
            import transformers  # noqa: PLC0415 - optional dependency, imported only for this reward
        except ImportError:
            raise UserError(f"--reward model:{directory} needs transformers; `pip install transformers`") from None
        path = Path(directory)
        if not (path / HF_CONFIG_FILE).is_file():  # a missing directory was said to have no config.json
            problem = (f"no {HF_CONFIG_FILE} there" if path.is_dir() else
                       "not a directory" if path.exists() else "no such directory")
            raise UserError(f"--reward model:{directory}: {problem}; give a directory written by save_pretrained of a "
                            "sequence-classification model")
        try:
            architectures = transformers.AutoConfig.from_pretrained(path, trust_remote_code=False).architectures or []
        except (OSError, ValueError) as exc:
            raise UserError(f"--reward model:{directory}: cannot read its config ({exc})".replace("\n", " ")) from None
        if not any(name.endswith("ForSequenceClassification") for name in architectures):
            named = ", ".join(architectures) or "no architecture"
            raise UserError(f"--reward model:{directory}: its {HF_CONFIG_FILE} names {named}, not a "
                            "sequence-classification model (...ForSequenceClassification); a language model's scores "
                            "would come from a head of random weights")
        if not any((path / name).is_file() for name in REWARD_MODEL_TOKENIZER_FILES):
            named = ", ".join(REWARD_MODEL_TOKENIZER_FILES)
            raise UserError(f"--reward model:{directory}: no tokenizer there (none of {named}); save the model's "
                            "tokenizer beside it (tokenizer.save_pretrained)")
        self.transformers, self.path, self.device = transformers, path, device
        self.model = self.tokenizer = self.template = None
        self.max_length: int | None = None

    def _load(self) -> None:
        try:
            self.tokenizer = self.transformers.AutoTokenizer.from_pretrained(self.path, trust_remote_code=False)
            model, loading = self.transformers.AutoModelForSequenceClassification.from_pretrained(
                self.path, use_safetensors=True, trust_remote_code=False, output_loading_info=True)
        except Exception as exc:  # noqa: BLE001 - the user's files may fail in any way (a truncated safetensors file:
            # SafetensorError; weights of other shapes than its config's: RuntimeError)
            raise UserError(f"--reward model:{self.path}: cannot load it ({type(exc).__name__}: {exc})"
                            .replace("\n", " ")[:500]) from None
        if loading["missing_keys"]:
            missing = sorted(loading["missing_keys"])
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            raise UserError(f"--reward model:{self.path}: its weights lack {', '.join(missing[:3])}{more}; "
                            "transformers would start them from random values")
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        # transformers scores each row at its last token before the config's padding id: the one the rows are padded
        # with (a config naming none could not score a batch; one naming another read a padding position)
        model.config.pad_token_id = self.tokenizer.pad_token_id
        if model.config.pad_token_id is None:
            raise UserError(f"--reward model:{self.path}: its tokenizer names no padding (or end) token, without which "
                            "transformers cannot score a batch; set pad_token in its tokenizer_config.json")
        self.max_length = _context_of(model.config, self.tokenizer)
        self.tokenizer.truncation_side = "left"  # a text longer than the model's context keeps its completion
        template = self.tokenizer.chat_template
        if isinstance(template, dict):  # named templates: transformers renders the default one
            template = template.get("default")
        if isinstance(template, str) and template:  # rendered with our bounds: it came with downloaded files
            tokens = {name: value for name in SPECIAL_TOKEN_NAMES  # as transformers passes them: set ones only
                      if isinstance(value := getattr(self.tokenizer, name, None), str)}
            self.template = ChatTemplate(template, f"--reward model:{self.path}", tokens, [], [])
        self.model = model.to(self.device).eval()

    def _text(self, prompt: list[dict[str, str]], completion: str) -> str:
        """The text the model scores: the conversation through the tokenizer's chat template (as transformers'
        `apply_chat_template` renders it), or its messages' text a line each where it has none."""
        messages = [*prompt, {"role": "assistant", "content": completion}]
        if self.template is not None:
            return self.template.unescape(self.template.render(messages))
        return "\n".join(m["content"] for m in messages)

    @torch.no_grad()
    def __call__(self, batch: Completions) -> list[float]:
        if self.model is None:
            self._load()
        texts = [self._text(p, c) for p, c in zip(batch.prompts, batch.texts, strict=True)]
        try:
            encoded = self.tokenizer(texts, padding=True, truncation=self.max_length is not None,
                                     max_length=self.max_length, return_tensors="pt").to(self.device)
            logits = self.model(**encoded).logits.float()
        except Exception as exc:  # noqa: BLE001 - out of memory, or the user's model failing in its own way: one
            # line, agreed by every rank (`llm.train.rollout`)
            raise UserError(f"--reward model:{self.path}: failed on {len(texts)} completions ({type(exc).__name__}: "
                            f"{exc})".replace("\n", " ")[:500]) from None
        scores = logits[:, 0] if logits.shape[-1] == 1 else logits.softmax(-1)[:, -1]
        if not (finite := scores.isfinite()).all():
            raise UserError(f"--reward model:{self.path}: scored {int((~finite).sum())} of {len(texts)} completions "
                            f"{scores[~finite][0].item()}; a reward must be finite (are its weights intact?)")
        return scores.tolist()


def _context_of(config, tokenizer) -> int | None:
    """The most tokens a reward model takes: the least of its tokenizer's model_max_length (RoBERTa's 512, where its
    config has 514 positions, 2 of which its position ids skip) and its config's positions; None where neither says
    (transformers' 'no limit' is 10**30, beyond what a fast tokenizer takes as a length)."""
    limits = [getattr(config, name, None) for name in ("max_position_embeddings", "n_positions")]
    limits.append(tokenizer.model_max_length)
    return min((n for n in limits if isinstance(n, int) and 0 < n < NO_LIMIT), default=None)


# ---- a user's function -------------------------------------------------------------------------------

def _import_file(term: str, path: Path) -> ModuleType:
    """The module of a .py file, run once per process: its folder first on sys.path, as `python FILE` has it (so that
    it imports the files beside it), and itself in sys.modules (what pickle and dataclasses look up) under a name of
    its own, `zerollm_reward_<stem>_<hash of its path>`: its stem alone could take the place of a module of that name
    (a file math.py), and two files of one stem in two folders are two modules."""
    if not path.is_file():
        raise UserError(f"--reward {term}: no such file {path}")
    resolved = path.resolve()
    name = f"zerollm_reward_{resolved.stem}_{hashlib.sha256(str(resolved).encode()).hexdigest()[:12]}"
    if (module := sys.modules.get(name)) is not None:
        return module
    folder = str(resolved.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(name, resolved)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _import_function(term: str, module_name: str, function_name: str) -> Callable:
    try:
        if module_name.endswith(".py"):
            module = _import_file(term, Path(module_name))
        else:
            if "" not in sys.path:
                sys.path.insert(0, "")  # the working directory, as `python -m` has it
            module = importlib.import_module(module_name)
    except (UserError, KeyboardInterrupt):
        raise
    except BaseException as exc:  # the user's module may fail in any way while it runs (sys.exit() at import ended
        # the run with its code, silently; GeneratorExit or another BaseException was a traceback)
        advice = "" if module_name.endswith(".py") else \
            "; run from the directory that holds it, or give the path of its .py file"
        raise UserError(f"--reward {term}: cannot import {module_name} ({type(exc).__name__}: {exc}){advice}"
                        .replace("\n", " ")) from None
    function = getattr(module, function_name, None)
    if not callable(function):
        mine, where = Path(f"{module_name.replace('.', '/')}.py"), getattr(module, "__file__", None)
        if not module_name.endswith(".py") and mine.is_file() and (where is None or Path(where).resolve() !=
                                                                   mine.resolve()):  # a library of that name won
            raise UserError(f"--reward {term}: the name {module_name} is an installed module's "
                            f"({where or 'built in'}), not your {mine}'s; give the path of its file: --reward "
                            f"{mine}:{function_name}")
        raise UserError(f"--reward {term}: {module_name} has no function {function_name!r}")
    try:
        inspect.signature(function).bind_partial(prompts=[], completions=[])  # record fields may be required too
    except (TypeError, ValueError):  # no such keywords, or no signature to read
        raise UserError(f"--reward {term}: {function_name} must be callable as {function_name}(prompts=..., "
                        "completions=..., **fields), e.g. `def score(prompts, completions, **fields)`") from None
    return function


class UserFunction:
    def __init__(self, term: str, function: Callable) -> None:
        self.term, self.function = term, function
        self.keys: set[str] = set()
        """Every field of the prompt records (`check_fields`): each call passes them all, None where a record
        lacks one. A call passed only the fields of its batch's records, so a function the check had accepted
        failed at a rollout whose records all lacked one (a TypeError, or a KeyError in **fields)."""

    def check_fields(self, keys: set[str]) -> None:
        """Refuse, before training, a function that cannot take the prompt records' other fields `keys` as keywords
        (`def score(prompts, completions)` given records with an `answer`): it failed at the first rollout, the error
        placed in our code. A field named `prompts` or `completions` is refused: it would be the function's own
        argument of that name."""
        if clash := sorted(keys & {"prompts", "completions"}):
            raise UserError(f"--reward {self.term}: the prompt records have a field named {clash[0]!r}, which the "
                            f"function receives as its own {clash[0]}; rename that field in the prompt files")
        self.keys = set(keys)
        try:  # its signature was read as it was imported (`_import_function`)
            inspect.signature(self.function).bind(prompts=[], completions=[], **dict.fromkeys(keys, []))
        except TypeError as exc:
            raise UserError(f"--reward {self.term}: cannot take the prompt records' fields ({exc}); give it a "
                            "**fields parameter, e.g. `def score(prompts, completions, **fields)`") from None

    def __call__(self, batch: Completions) -> list[float]:
        keys = sorted((self.keys | {k for f in batch.fields for k in f}) - {"prompts", "completions"})
        fields = {k: [f.get(k) for f in batch.fields] for k in keys}
        # copies: a function that changes what it is given (`completions.clear()`) changes nothing the other terms
        # and the policy update read
        arguments = copy.deepcopy({"prompts": batch.prompts, "completions": batch.texts, **fields})
        cwd = os.getcwd()  # a function that works in a folder of its own (code execution) changed the run's: every
        try:  # path given relative to it (--out) led elsewhere, and the next write failed
            scores = self.function(**arguments)
        except (KeyboardInterrupt, _OutOfTime):  # Ctrl-C, and the terms' time limit: not the function's failure
            raise
        except BaseException as exc:  # the user's code: sys.exit() in it ended the run silently, exit 0; a
            # GeneratorExit or another BaseException of its own was a traceback, exit 1
            where = traceback.extract_tb(exc.__traceback__)[-1]
            raise UserError(f"--reward {self.term}: raised {type(exc).__name__}: {exc} (at {where.filename}:"
                            f"{where.lineno})".replace("\n", " ")) from None
        finally:
            os.chdir(cwd)
        items = scores  # shown where they are refused
        try:
            if isinstance(scores, (Mapping, set, frozenset, str, bytes, bytearray)):  # a dict's keys, a set's order,
                raise TypeError  # a text's characters or bytes: not one score per completion
            if not isinstance(scores, Sized):  # an iterator (a generator, a map), read once: its text, once read,
                items = list(scores)  # is its address
            values = [None if getattr(s, "ndim", 0) else float(s)  # a row of a torch (n, 1) tensor: float() took
                      for s in items if not isinstance(s, (str, bytes))]  # it (numpy's refused); "1.0" is no score
            if None in values:
                raise TypeError
        except (TypeError, ValueError, OverflowError):  # OverflowError: an int beyond any float (10**400)
            values = None
        if values is None or len(values) != len(batch.texts) or not all(abs(v) <= MAX_MAGNITUDE for v in values):
            shown = " ".join(str(items).split())[:80]  # an array's text spans lines
            raise UserError(f"--reward {self.term}: returned {type(scores).__name__} {shown}; it must "
                            f"return one float per completion ({len(batch.texts)}), each finite and at most "
                            f"{MAX_MAGNITUDE:g} in magnitude")
        return values


# ---- the spec ----------------------------------------------------------------------------------------

BUILT_IN = ("exact_match", "format", "length", "model")
MAX_MAGNITUDE = 1e9
"""The largest weight or user score: a weighted sum of such terms, and its group's variance, stay finite in float32
(a score of 1e308 became inf there, and every advantage NaN)."""
REQUIRED_FIELDS = {"exact_match": "answer"}
"""Record fields a term needs; a prompt record without them is skipped and reported."""


@dataclass
class RewardTerm:
    name: str
    """Logged as reward/<name>."""
    weight: float
    score: Callable[[Completions], list[float]]
    required_field: str | None = None
    given: str = ""
    """The `--reward` term as the user gave it, for messages (`name` is the logged one: `score` for `mod:score`)."""


def parse_term(term: str, max_new_tokens: int, device: torch.device) -> RewardTerm:
    """One `--reward` term -> its scorer (user modules are imported here; a reward model only checked)."""
    weight, body = 1.0, term.strip()
    head, star, rest = body.partition("*")
    if star and re.fullmatch(r"\s*[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?\s*", head):  # else a '*' of a regex or path
        weight, body = float(head), rest.strip()
        if not abs(weight) <= MAX_MAGNITUDE:  # 1e400 is inf
            raise UserError(f"--reward {term!r}: the weight {head.strip()} is beyond {MAX_MAGNITUDE:g} in magnitude")
    name, colon, argument = body.partition(":")
    if name == "exact_match" and not colon:
        return RewardTerm(name, weight, exact_match, REQUIRED_FIELDS[name])
    if name == "format" and colon and not argument:  # it meant R1's format silently
        raise UserError(f"--reward {term!r}: no pattern after 'format:'; give 'format' alone for DeepSeek-R1's "
                        "<think>...</think> <answer>...</answer>")
    if name == "format":
        return RewardTerm(name, weight, FormatReward(argument or R1_FORMAT))
    if name == "length" and not colon:
        return RewardTerm(name, weight, LengthPenalty(max_new_tokens))
    if name == "model" and argument:
        return RewardTerm(name, weight, RewardModel(argument, device))
    if colon and name and argument and name not in BUILT_IN:
        return RewardTerm(argument, weight, UserFunction(term, _import_function(term, name, argument)))
    hint = "; give each term its own --reward" if "," in term else ""
    raise UserError(f"--reward {term!r}: expected [WEIGHT*]NAME with NAME exact_match, format[:REGEX], length, "
                    f"model:DIR or module:function{hint}")


class _OutOfTime(BaseException):
    """Raised into a reward that ran past grpo.reward_timeout_s: not an Exception, so that no handler of the
    user's (or `UserFunction`'s) takes it for the reward's own failure."""


RING_AGAIN_AFTER_S = 0.5
"""The least time between two rings of one `TimeLimit`: at most one ring can land in its clean-up, which takes
microseconds (a limit of a microsecond rang every microsecond)."""


RING_SIGNAL = signal.SIGRTMIN + 2 if hasattr(signal, "SIGRTMIN") else signal.SIGALRM
"""The signal a `TimeLimit` rings with: a real-time one where the system has them, which no reward's own code uses.
Rewards time themselves with SIGALRM (math_verify's `timeout`, TRL's and open-r1's accuracy rewards):
`signal.alarm(0)` at their end cancelled the limit's timer, which a hang after it then never met."""


class TimeLimit:
    """Raise `_OutOfTime` into the running code after `seconds` (0: never), and again every `seconds` (at least
    RING_AGAIN_AFTER_S) after that, so that a reward that swallows a ring (`except: pass`) is interrupted again in
    its next wait; `check` raises it too where the limit has passed all the same. A thread of its own sends
    RING_SIGNAL to the main thread, which interrupts Python code and the waits it makes (sleep, sockets); only the
    main thread is rung, so elsewhere there is no limit. Not a context manager: a ring landing between a `with`
    block's end and the manager's clean-up escaped it, left ringing and raising anywhere. `disarm` takes a ring that
    lands in it, and may be called again."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.previous = None
        self.start = time.monotonic()
        self._stop = threading.Event()
        self._ringer: threading.Thread | None = None

    def arm(self) -> None:
        if not self.seconds or threading.current_thread() is not threading.main_thread():
            return
        self.previous = signal.signal(RING_SIGNAL, _ring)
        self._ringer = threading.Thread(target=self._ring_until_stopped, args=(threading.main_thread().ident,),
                                        name="zerollm-reward-limit", daemon=True)
        self._ringer.start()

    def _ring_until_stopped(self, main: int) -> None:
        wait = self.seconds
        while not self._stop.wait(wait):
            signal.pthread_kill(main, RING_SIGNAL)
            wait = max(self.seconds, RING_AGAIN_AFTER_S)

    def disarm(self) -> None:
        while self.previous is not None:
            try:
                self._stop.set()
                if self._ringer is not None:
                    self._ringer.join()  # a ring it sent before it stopped lands here, not after the handler goes
                signal.signal(RING_SIGNAL, self.previous)
                self.previous = None
            except _OutOfTime:  # a ring that landed here: stop again
                continue

    def check(self) -> None:
        if self.seconds and time.monotonic() - self.start > self.seconds:
            raise _OutOfTime


def _ring(signum, frame):
    raise _OutOfTime


TOTALS_LOGGED = ("mean", "std")
"""What the total reward is logged as (reward/mean, reward/std): a term of that name (a function `mean`) gets its
position appended, as two terms of one name do, so that it does not overwrite them."""


class Reward:
    """The weighted sum of the `--reward` terms, computed within `timeout_s` seconds (0: no limit)."""

    def __init__(self, terms: Sequence[str], max_new_tokens: int, device: torch.device,
                 timeout_s: float = 0.0) -> None:
        if not terms:
            raise UserError("no reward: pass --reward TERM (e.g. exact_match)")
        self.timeout_s = timeout_s
        self.terms = [replace(parse_term(t, max_new_tokens, device), given=t) for t in terms]
        if not any(t.weight for t in self.terms):  # every advantage 0: the run trained on the KL term alone
            raise UserError(f"--reward: every term has weight 0 ({', '.join(terms)}), so every completion's reward is "
                            "0 and GRPO learns nothing from it; give at least one term a non-zero weight (a term of "
                            "weight 0 beside it is still logged)")
        given = Counter(t.name for t in self.terms)
        for i, term in enumerate(self.terms):
            if given[term.name] > 1 or term.name in TOTALS_LOGGED:
                while term.name in given or term.name in TOTALS_LOGGED:  # format and format_1 given: format_1_1
                    term.name = f"{term.name}_{i}"
        self.required_fields = sorted({t.required_field for t in self.terms if t.required_field})

    def check_fields(self, keys: set[str]) -> None:
        """Refuse a function of the user's that cannot take the records' fields `keys` (`UserFunction.check_fields`)."""
        for term in self.terms:
            if isinstance(term.score, UserFunction):
                term.score.check_fields(keys)

    def __call__(self, batch: Completions) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(total reward per completion, {term name: its unweighted scores}), float32 on the CPU."""
        components, term = {}, self.terms[0]  # the limit can ring before the loop names the first term
        limit = TimeLimit(self.timeout_s)
        try:
            try:
                limit.arm()
                for term in self.terms:
                    components[term.name] = torch.tensor(term.score(batch), dtype=torch.float32)
            finally:
                limit.disarm()
            limit.check()
        except _OutOfTime:
            limit.disarm()  # where a ring landed in the first call, before its loop
            raise UserError(f"--reward {term.given}: no answer for {len(batch.texts)} completions within "
                            f"grpo.reward_timeout_s ({self.timeout_s:g} s, every term together); make it faster or "
                            "raise the limit (0: none)") from None
        total = sum(t.weight * components[t.name] for t in self.terms)
        return total, components


def reward_metrics(total: torch.Tensor, components: dict[str, torch.Tensor], group: int) -> dict[str, torch.Tensor]:
    """A step's reward metrics: the total's mean and the mean of its groups' standard deviations (`TOTALS_LOGGED`),
    and each term's unweighted mean."""
    mean, std = TOTALS_LOGGED
    return {f"reward/{mean}": total.mean(), f"reward/{std}": total.view(-1, group).std(1).mean(),
            **{f"reward/{name}": scores.mean() for name, scores in components.items()}}
