"""Tokenizers: byte-level BPE training, special tokens found by role, safe encoding, chat templates.

Any Hugging Face tokenizer directory works (`tokenizer.json`, optionally `tokenizer_config.json` and
`chat_template.jinja`): ours, MiniMind's, Qwen's, Llama's. Special tokens are found by role, not by
id — the end of text (document separator), padding, the start and end of a chat turn — from the
token names and the config's `eos_token` / `bos_token` / `pad_token` fields; a tokenizer without a
pad token pads with its end-of-text token and says so in `notes`. A saved copy (`save`) records the end-of-text,
pad and bos tokens it uses where the config leaves them unset, so `transformers` reads the copy the same way.

Text from users and files is encoded with special tokens disabled (`encode`): `<|im_end|>` in a
message or a corpus is seven ordinary tokens, never the real one. Only a chat template inserts
special tokens, and templates produce ids directly (`encode_chat`, `encode_chat_masked`), so nothing
re-encodes a rendered string. The template is the tokenizer's own `chat_template` where it has one,
else our ChatML when the vocabulary has `<|im_start|>`/`<|im_end|>`. A plain text (a pretraining document, a prompt
to continue) begins with `document_start_ids`: the BOS a Llama-style tokenizer puts before every text, as
`transformers` does; nothing for ours.

Tokenizers we train: no normalizer and no prefix space, so `decode(encode(s)) == s` for every UTF-8
string; `<|endoftext|>` 0, `<|im_start|>` 1, `<|im_end|>` 2, `<|pad|>` 3; the saved directory
loads with `transformers.AutoTokenizer` and renders the same chat text.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from llm import durable
from llm.chat_template import CHAT_TEMPLATE, LEGACY_CHAT_TEMPLATES, ROLE_FIELDS, ChatTemplate, ChatTemplateError
from llm.data.output import refuse_current_directory, refuse_foreign_contents, refuse_mount_point
from llm.errors import SigtermUnwinds, UserError, not_utf8, read_user_json_object, read_user_text
from llm.held_locks import refuse_if_held_beside
from llm.rundir import TEMPLATE_FILE, TOKENIZER_FILE, check_writable_out
from llm.rundir import TOKENIZER_CONFIG_FILE as CONFIG_FILE
from llm.rundir import TOKENIZER_TRAINING_FILE as TRAINING_FILE
from llm.stdout import on_terminal

EOS, IM_START, IM_END, PAD = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"
SPECIAL_TOKENS = [EOS, IM_START, IM_END, PAD]  # ids 0, 1, 2, 3 in tokenizers we train
TOKENIZER_FILE_LIMIT = 1 << 30
"""The largest tokenizer.json read: far more than any (Gemma 3's, of 262,144 tokens, is 33 MB)."""


END_OF_TEXT_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
TURN_START_NAMES = ("<|im_start|>", "<start_of_turn>", "<|start_header_id|>")
TURN_END_NAMES = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>")
PAD_NAMES = ("<|pad|>", "<pad>", "[PAD]", "<|finetune_right_pad_id|>")

OUR_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "eos_token": EOS,
    "pad_token": PAD,
    "bos_token": None,
    "unk_token": None,
    "additional_special_tokens": [IM_START, IM_END],
    "add_bos_token": False,
    "add_eos_token": False,
    "clean_up_tokenization_spaces": False,
    "model_max_length": 1 << 20,
    "chat_template": CHAT_TEMPLATE,
}


MAX_VOCAB_SIZE = 1 << 24
"""The largest --vocab-size: 64 times the largest vocabularies in use (about 256k), an embedding of billions of
parameters at any width, and ids that `data prepare` stores as uint32 many times over. The BPE trainer allocates for
the size asked up front (2^31 asked 141 GB and aborted the process)."""
MAX_MIN_FREQUENCY = (1 << 64) - 1


def check_training_options(vocab_size: int, min_frequency: int = 2) -> None:
    smallest = 256 + len(SPECIAL_TOKENS)
    if vocab_size < smallest:
        raise UserError(f"--vocab-size {vocab_size} is too small: byte-level BPE needs at least {smallest}")
    if vocab_size > MAX_VOCAB_SIZE:
        raise UserError(f"--vocab-size {vocab_size} is too large: at most {MAX_VOCAB_SIZE:,} (2^24), far more than "
                        "any model's vocabulary")
    if not 0 <= min_frequency <= MAX_MIN_FREQUENCY:
        raise UserError(f"--min-frequency must be between 0 and {MAX_MIN_FREQUENCY}, got {min_frequency}")


def _make_out_dir(out_dir: Path) -> bool:
    """Check `out_dir` before training and create it; whether it was created. Refused: a file, a folder that holds
    anything but an earlier `train_tokenizer` output (a prepared data folder's tokenizer/, a tokenizer of your own,
    a run), a place that cannot be written."""
    refuse_current_directory(out_dir.resolve(), out_dir, "tokenizer train", "tok/")
    durable.check_staged_name(out_dir.resolve())  # before the training, not once it is done
    refuse_if_held_beside(out_dir.resolve())
    try:
        if out_dir.is_dir():
            refuse_mount_point(out_dir.resolve(), out_dir, "tokenizer train")
            refuse_foreign_contents(out_dir, out_dir, "tokenizer train", {TOKENIZER_FILE, CONFIG_FILE, TRAINING_FILE},
                                    TRAINING_FILE)
            return False
        if out_dir.exists():
            raise UserError(f"--out {out_dir} is a file; give a directory")
        check_writable_out(out_dir, "give a directory")  # a link to nothing: 'cannot create it (File exists)'
        out_dir.mkdir(parents=True)
    except OSError as exc:
        raise UserError(f"--out {out_dir}: cannot create or read it ({exc.strerror or exc})") from None
    return True


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: Path, min_frequency: int = 2,
                    show_progress: bool = True, unusable: Callable[[], str] = str) -> Tokenizer:
    """Train byte-level BPE on a stream of texts and save it to `out_dir` (new, empty, or an earlier output of this
    function, whose files it overwrites); UserError, with nothing written, when `texts` is empty, which ends with
    `unusable()`: a note on the records `texts` left out (`PretrainTexts.skipped_note`)."""
    check_training_options(vocab_size, min_frequency)
    created = _make_out_dir(out_dir)
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress and on_terminal(),  # off a terminal its bars are blank lines
    )
    n_texts = 0

    def counted() -> Iterator[str]:
        nonlocal n_texts
        for text in texts:
            n_texts += 1
            yield text

    try:
        tok.train_from_iterator(counted(), trainer=trainer)
        if n_texts == 0:
            raise UserError(f"no usable records found in the inputs; nothing was written{unusable()}")
        training = {"vocab_size": vocab_size, "min_frequency": min_frequency, "texts": n_texts}
        return _write_output(Tokenizer(tok, OUR_CONFIG, str(out_dir)), training, out_dir)
    except BaseException:
        if created:  # leave no empty folder behind
            with contextlib.suppress(OSError):
                out_dir.rmdir()
        raise


def _write_output(tokenizer: Tokenizer, training: dict, out_dir: Path) -> Tokenizer:
    """The tokenizer's files and `training` written into a folder beside `out_dir`, which then replaces it whole
    (`durable.staged_folder`): a failure or a kill while writing (a full disk, Ctrl-C) leaves the tokenizer that was
    there whole (its files were replaced one by one: a kill left the new tokenizer.json beside the old training
    record, which data prepare took as one tokenizer)."""
    try:  # Ctrl-C or SIGTERM while writing leaves no staging folder (training, before, is in the library's threads,
        with SigtermUnwinds() as stop, durable.staged_folder(out_dir.resolve(), replace=True) as staging:  # which a
            staging.mkdir()  # Python handler would wait for to the end: SIGTERM ends it at once there)
            (staging / TRAINING_FILE).write_text(json.dumps(training, indent=2), encoding="utf-8")
            tokenizer.save(staging)
            stop.check()
    except OSError as exc:
        raise UserError(f"--out {out_dir}: cannot write there ({exc.strerror or exc})") from None
    return tokenizer


@dataclass
class MaskedChat:
    """A conversation as token ids with its SFT loss mask."""

    ids: list[int]
    loss_mask: list[int]
    """1 on every assistant turn's body (reasoning, content, tool calls) and its end-of-turn token, but a turn's of
    `weight` 0 (OpenAI's fine-tuning format: context, not learnt)."""
    replies: list[tuple[int, int]]
    """Per assistant message: the [start, end) ids the mask covers (unless its weight is 0); `ids[:end]` is the
    conversation up to that reply's end-of-turn token, the place to cut a long one (what the template puts after it
    is learned from no target)."""
    reasoning_left_out: list[int] = dataclasses.field(default_factory=list)
    """Numbers (from 1) of the messages learnt whose reasoning the chat template leaves out of their reply."""


def _token_text(value: Any) -> str | None:
    """A config's token field: a string, or transformers' serialized AddedToken {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _check_role_fields(config: dict, source: str) -> None:
    """A role field is a token's text, transformers' AddedToken object, or null: another value (an id such as 7)
    would be copied into every run and export, and transformers could not load the copy."""
    for field in ROLE_FIELDS:
        value = config.get(field)
        if value is None or isinstance(value.get("content") if isinstance(value, dict) else value, str):
            continue
        raise UserError(f"{source}: '{field}' in {CONFIG_FILE} must be a token's text (such as \"</s>\"), "
                        f"{{\"content\": \"...\"}} or null, got {json.dumps(value, default=str)[:60]}")


def _check_declared_tokens(tok: HFTokenizer, config: dict, source: str) -> None:
    """The special tokens the config declares beyond the roles (`added_tokens_decoder`; `additional_special_tokens`,
    transformers 5's `extra_special_tokens`) are tokens of tokenizer.json: transformers adds one it lacks as a new
    token, where zerollm read its text as plain text (six pieces of `<|tool|>`), in chat and in SFT data, without a
    word. (One it holds at another id than the config's is used at tokenizer.json's, by transformers too.)"""
    decoder = config.get("added_tokens_decoder")
    declared = [_token_text(entry) for entry in decoder.values()] if isinstance(decoder, dict) else []
    for key in ("additional_special_tokens", "extra_special_tokens"):
        extra = config.get(key)
        declared += [_token_text(entry) for entry in (extra.values() if isinstance(extra, dict) else extra)] \
            if isinstance(extra, (list, dict)) else []
    for text in declared:
        if text and tok.token_to_id(text) is None:
            raise UserError(f"{source}: {CONFIG_FILE} declares the special token {text!r}, which its {TOKENIZER_FILE} "
                            f"does not hold; zerollm reads tokens from {TOKENIZER_FILE}: save the tokenizer again with "
                            "transformers (AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR)), which writes it "
                            "there")


TRAIN_ONE = "; train one with `zerollm tokenizer train` or give a Hugging Face tokenizer directory"
"""Said where a tokenizer folder is missing or holds no tokenizer."""
SLOW_TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer.model", "spiece.model", "vocab.txt")
"""The files of transformers' slow tokenizers (GPT-2's BPE, SentencePiece, WordPiece), which zerollm does not read."""


def no_tokenizer_json_advice(directory: Path) -> str | None:
    """What to do about a Hugging Face tokenizer folder holding only a slow tokenizer's files (no tokenizer.json):
    it was told to give a Hugging Face tokenizer directory, which it is. None where it holds none of them."""
    found = [name for name in SLOW_TOKENIZER_FILES if (directory / name).is_file()]
    if not found:
        return None
    return (f" ({' and '.join(found)} {'are' if len(found) > 1 else 'is'} a slow tokenizer's, which zerollm does not "
            f"read; write {TOKENIZER_FILE} with transformers: AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR))")


class Tokenizer:
    """A tokenizer with its special tokens by role, safe text encoding and chat rendering to ids."""

    eos_id: int
    """End of text: closes each pretraining document."""
    pad_id: int
    """Padding (the end-of-text token when the tokenizer has no pad token; see `notes`)."""
    bos_id: int | None
    """The config's bos_token, if any (never added by `encode`; a chat template may insert it; a document starts
    with it where the tokenizer says so: `document_start_ids`)."""
    im_start_id: int | None
    """Start of a chat turn (<|im_start|> or the tokenizer's equivalent), if the vocabulary has one."""
    im_end_id: int
    """End of a chat turn (<|im_end|> or equivalent; else the config's eos_token; else end of text)."""
    stop_ids: list[int]
    """Tokens that end generation: end of text, end of turn and the config's eos_token."""
    document_start_ids: list[int]
    """What a text starts with in `transformers` (`tokenizer(text)`): the ids the tokenizer's own post-processor puts
    before it (BOS for Llama, Mistral, Gemma), else the BOS where tokenizer_config.json says `add_bos_token: true`;
    empty for ours and GPT-2- or Qwen-style tokenizers. Pretraining documents, eval streams and plain-text prompts
    begin with it (`encode` never adds it)."""

    def __init__(self, tok: HFTokenizer, config: dict | None = None, source: str = "tokenizer",
                 chat_template: str | None = None) -> None:
        """`config`: the contents of tokenizer_config.json; `chat_template` overrides its template."""
        self._tok, self.config, self.source = tok, dict(config or {}), source
        _check_role_fields(self.config, source)
        self.notes: list[str] = []
        """What a user should know about this tokenizer (e.g. the pad fallback)."""
        if tok.truncation is not None or tok.padding is not None:  # they cut and padded every text it encoded
            tok.no_truncation()
            tok.no_padding()
            self.notes.append(f"{source}: the truncation and padding its {TOKENIZER_FILE} sets are not used: "
                              "zerollm cuts and pads by data.seq_len")
        text = tok.to_str()
        spec = json.loads(text)
        self.legacy_hash = _digest(text)
        """The hash of the whole tokenizer.json, which earlier versions recorded: still accepted (`has_hash`)."""
        self.hash = self.legacy_hash if spec.get("post_processor") is None else _digest(_without_post_processor(tok))
        """Identity of what turns text into ids (tokenizer.json less its post-processor, which adds special tokens
        only when asked, never here): data and models record it to refuse a mismatch. transformers' save_pretrained
        adds a post-processor that does nothing; the hash stays."""
        added = {entry["content"]: entry for entry in spec.get("added_tokens", [])}
        named = {field: _token_text(self.config.get(field)) for field in ("bos_token", "eos_token", "pad_token")}
        configured = {field: tok.token_to_id(text) if text else None for field, text in named.items()}
        for field, text in named.items():
            if text and configured[field] is None:  # transformers adds it as a new token; its stop, pad or start
                # would have been another id than zerollm's, and an eos_token learnt as plain text
                raise UserError(f"{source}: {CONFIG_FILE} names {field} {text!r}, which is not a token of its "
                                f"{TOKENIZER_FILE}; name one of its tokens there, or remove {field}")
        _check_declared_tokens(tok, self.config, source)

        def first_added(names: tuple[str, ...]) -> int | None:
            return next((added[n]["id"] for n in names if n in added), None)

        eos = first_added(END_OF_TEXT_NAMES)
        self.eos_id = eos if eos is not None else configured["eos_token"]
        if self.eos_id is None:
            raise UserError(f"{source}: no end-of-text token (none of {', '.join(END_OF_TEXT_NAMES)}, and no "
                            f"eos_token in {CONFIG_FILE}); set eos_token there")
        self.bos_id = configured["bos_token"]
        self.document_start_ids = _document_start(tok)
        if not self.document_start_ids and self.config.get("add_bos_token") is True and self.bos_id is not None:
            self.document_start_ids = [self.bos_id]
        self.im_start_id = first_added(TURN_START_NAMES)
        turn_end = first_added(TURN_END_NAMES)
        self.im_end_id = next(i for i in (turn_end, configured["eos_token"], self.eos_id) if i is not None)
        self.stop_ids = sorted({self.eos_id, self.im_end_id} | {configured["eos_token"]} - {None})
        pad = configured["pad_token"] if configured["pad_token"] is not None else first_added(PAD_NAMES)
        if pad is None:
            pad = self.eos_id
            self.notes.append(f"{source}: the tokenizer has no pad token; padding with {self.token(pad)} "
                              f"(id {pad}), the end-of-text token")
        self.pad_id = pad
        self._unset_roles = {field: self.token(i) for field, i in
                             (("bos_token", self.bos_id), ("eos_token", self.eos_id), ("pad_token", self.pad_id))
                             if i is not None and self.config.get(field) is None}
        """The role tokens found by name or fallback that the config leaves unset (absent or null): `save` records
        them, so the copy means the same to transformers, and chat templates see them (the copy renders the same)."""

        role_ids = {self.eos_id, self.pad_id, self.im_end_id, *self.stop_ids} | {self.bos_id, self.im_start_id}
        self.protected = sorted({t for t, entry in added.items() if entry.get("special")}
                                | {self.token(i) for i in role_ids - {None}})
        """Token strings that text from users or files never turns into special tokens."""
        for entry in spec.get("added_tokens", []):
            entry["special"] = entry["special"] or entry["content"] in self.protected
        _never_picked_by_unigram(spec, self.protected)
        self._text = HFTokenizer.from_str(json.dumps(spec))
        self._text.encode_special_tokens = True

        template = chat_template if chat_template is not None else self.config.get("chat_template")
        if isinstance(template, list):  # transformers' named templates
            for entry in template:
                if not (isinstance(entry, dict) and isinstance(entry.get("name"), str)
                        and isinstance(entry.get("template"), str)):
                    raise UserError(f"{source}: 'chat_template' in {CONFIG_FILE} is a list of named templates "
                                    '{"name": "...", "template": "..."} (both strings), one entry is '
                                    f"{json.dumps(entry, default=str)[:60]}; fix or remove it")
            by_name = {t["name"]: t["template"] for t in template}
            template = by_name.get("default", next(iter(by_name.values()), None))
        if template == "":  # an empty template is none
            template = None
        if template in LEGACY_CHAT_TEMPLATES or (template is None and IM_START in added and IM_END in added):
            template = CHAT_TEMPLATE
        self.chat_template: str | None = template if isinstance(template, str) else None
        self._template_given_unusable = None if template is None or isinstance(template, str) else template
        """A 'chat_template' that is neither a string nor a list of named ones (a number): said when one is needed."""
        config = {**self.config, **self._unset_roles}
        self._template_variables = {f: t for f in ROLE_FIELDS if (t := _token_text(config.get(f)))}

    def stop_also(self, ids: Iterable[int]) -> Tokenizer:
        """End generation at `ids` too (a model folder's declared end tokens, `declared_stop_ids`), those in the
        vocabulary (no other can be generated); before the chat template is first used, which stops at them."""
        self.stop_ids = sorted(set(self.stop_ids) | {i for i in ids if i < self.vocab_size})
        return self

    @classmethod
    def load(cls, directory: str | Path) -> Tokenizer:
        """A tokenizer directory: tokenizer.json, with tokenizer_config.json and chat_template.jinja where present."""
        directory = Path(directory)
        path = directory / TOKENIZER_FILE
        if not directory.exists() and not directory.is_symlink():  # where a stopped tokenizer train left the old one
            advice = "" if durable.set_aside_copies(directory) else TRAIN_ONE
            raise UserError(durable.no_such_folder(directory) + advice)
        if not path.is_file():
            if (directory / "tokenizer" / TOKENIZER_FILE).is_file():  # a prepared data folder's or a run's copy
                raise UserError(f"{directory}: no {TOKENIZER_FILE} (its tokenizer is in {directory / 'tokenizer'}: "
                                "give that)")
            raise UserError(f"{directory}: no {TOKENIZER_FILE}{no_tokenizer_json_advice(directory) or TRAIN_ONE}")
        # read here: the library's own reading takes UTF-8 paths only
        text = read_user_text(path, "it as UTF-8", limit=TOKENIZER_FILE_LIMIT)
        try:
            tok = HFTokenizer.from_str(text)
        except Exception as exc:  # noqa: BLE001 - the tokenizers library raises plain Exception on bad files
            raise UserError(f"{path}: cannot load tokenizer ({exc})") from None
        config_file = directory / CONFIG_FILE
        config = read_user_json_object(config_file, "tokenizer config") if config_file.is_file() else {}
        template_file = directory / TEMPLATE_FILE
        template = read_user_text(template_file, "the chat template as UTF-8") if template_file.is_file() else None
        return cls(tok, config, str(directory), template)

    @property
    def saved_config(self) -> dict:
        """tokenizer_config.json as `save` writes it: the loaded config, plus the end-of-text, pad and bos tokens
        zerollm uses where the config leaves them unset (absent or null; a value the config sets is kept, even one
        naming another token), plus the chat template in use. So `transformers.AutoTokenizer` loads the copy with
        the eos_token and pad_token zerollm found (a tokenizer.json alone has none) and can pad."""
        return {**self.config, **self._unset_roles,
                **({"chat_template": self.chat_template} if self.chat_template else {})}

    def save(self, out_dir: Path) -> Tokenizer:
        """tokenizer.json and tokenizer_config.json (`saved_config`) into `out_dir`."""
        out_dir.mkdir(parents=True, exist_ok=True)
        # written by Python, as the library's own save writes it: the library takes only paths that are UTF-8 (one
        # that is not was a UnicodeEncodeError traceback) and says an operating-system error as a plain Exception
        (out_dir / TOKENIZER_FILE).write_text(self._tok.to_str(pretty=True), encoding="utf-8")
        return self.save_config(out_dir)

    def save_config(self, out_dir: Path) -> Tokenizer:
        """tokenizer_config.json (`saved_config`) into the existing folder `out_dir`."""
        (out_dir / CONFIG_FILE).write_text(json.dumps(self.saved_config, indent=2, ensure_ascii=False),
                                           encoding="utf-8")
        return self

    def has_hash(self, recorded: str) -> bool:
        """Whether `recorded` (from prepared data, a run or an export) identifies this tokenizer."""
        return recorded in (self.hash, self.legacy_hash)

    @cached_property
    def vocab_size(self) -> int:
        """The largest id plus one (an embedding row for every id): a tokenizer.json's ids may leave gaps, and its
        count of tokens was smaller than its ids, which were then written beyond the vocabulary (or beyond uint16)."""
        return max(self._tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1

    @cached_property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of the special tokens (`protected`): decoding without special tokens leaves them out."""
        return frozenset(i for text in self.protected if (i := self._tok.token_to_id(text)) is not None)

    def token(self, token_id: int) -> str:
        return self._tok.id_to_token(token_id)

    def encode(self, text: str) -> list[int]:
        """Ids of text from a user or a file: special-token strings in it stay text."""
        return _ids(self._text, text)

    def encode_document(self, text: str) -> list[int]:
        """Ids of a text that begins a document (a pretraining document, a text to continue or score): behind the
        tokenizer's `document_start_ids`, as `transformers`' `tokenizer(text)` gives them."""
        return self.document_start_ids + self.encode(text)

    def encode_continuation(self, text: str) -> list[int]:
        """Ids of text that continues a document from a cut (a long document's later pieces,
        `llm.data.readers.cut_point`): without the space that a tokenizer puts before a text's start (a Prepend
        normalizer's or a Metaspace pre-tokenizer's `▁`, a byte-level one's prefix space), one more at every cut.
        Where the cut is a boundary of the pre-tokenizer (a space, for all of these), the ids are the whole
        document's."""
        return _ids(self._continuation_encoder, text)

    @cached_property
    def _continuation_encoder(self) -> HFTokenizer:
        """`_text` without what it adds at a text's start (`encode_continuation`); `_text` itself where it adds
        nothing."""
        spec = json.loads(self._text.to_str())
        normalizer, pre_tokenizer = (_continuing(spec.get(key)) for key in ("normalizer", "pre_tokenizer"))
        if (normalizer, pre_tokenizer) == (spec.get("normalizer"), spec.get("pre_tokenizer")):
            return self._text
        tokenizer = HFTokenizer.from_str(json.dumps({**spec, "normalizer": normalizer, "pre_tokenizer": pre_tokenizer}))
        tokenizer.encode_special_tokens = True
        return tokenizer

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def named(self, source: str) -> Tokenizer:
        """This tokenizer, naming itself `source` in its messages where they named its folder: a server names the
        model it serves so to its clients, who are not to learn its paths. A copy: this one is left as it is."""
        named = copy.copy(self)
        named.source = source
        named.__dict__.pop("_chat", None)  # a template made before names the folder
        return named

    @cached_property
    def _chat(self) -> ChatTemplate:
        self.check_chat_template()
        return ChatTemplate(self.chat_template, self.source, self._template_variables, self.protected,
                            [self.token(i) for i in self.stop_ids])

    def check_chat_template(self) -> None:
        """A ChatTemplateError saying why the tokenizer has no chat template to use; nothing where it has one."""
        if self._template_given_unusable is not None:
            raise ChatTemplateError(f"{self.source}: 'chat_template' in {CONFIG_FILE} is "
                                    f"{json.dumps(self._template_given_unusable, default=str)[:60]}, not a template "
                                    "string; fix or remove it")
        if self.chat_template is None:
            raise ChatTemplateError(f"{self.source}: the tokenizer has no chat template ({CONFIG_FILE} gives none "
                                    f"and the vocabulary has no {IM_START}/{IM_END}); add one there")

    def encode_rendered(self, rendered: str, release_gil: bool = False) -> list[int]:
        """Ids of text rendered by `render_for_encoding` (and anything appended to it): template text with its special
        tokens parsed; escaped message text as plain text. `release_gil`: the same ids, encoded while other Python
        threads run (the library's batch encoder; `encode` holds the GIL throughout, about a second for 1 MiB)."""
        pieces = list(self._chat.split(rendered))
        if not release_gil:
            ids: list[int] = []
            for piece, literal in pieces:
                ids += _ids(self._text if literal else self._tok, piece)
            return ids
        encoded = {literal: iter(_ids_of_batch(self._text if literal else self._tok,
                                               [piece for piece, is_literal in pieces if is_literal == literal]))
                   for literal in (False, True)}
        return [i for _, literal in pieces for i in next(encoded[literal])]

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = False, release_gil: bool = False,
                    tools: list[dict] | None = None) -> list[int]:
        """Canonical messages (and the tool definitions `tools`, where given) through the chat template to ids; with
        `add_generation_prompt`, ready for a reply; `release_gil`: see `encode_rendered`."""
        return self.encode_rendered(self._chat.render(messages, add_generation_prompt, tools), release_gil)

    @cached_property
    def max_token_bytes(self) -> int | None:
        """The most UTF-8 bytes of text that one token of `encode` or `encode_rendered` stands for, so that a text of
        n bytes is at least n / max_token_bytes tokens (`fewest_tokens`): the longest token (a byte-level token's
        characters are one byte each). None where the tokenizer may drop or merge text, so that no such bound holds:
        a normalizer (other than Prepend, or a Replace of a string by one at least as long), a pre-tokenizer that
        removes characters, an added token that takes in the blanks beside it (lstrip, rstrip), unknown characters
        fused into one token, a model other than BPE (the file's truncation is switched off as it loads)."""
        spec = json.loads(self._tok.to_str())
        model, added = spec.get("model") or {}, spec.get("added_tokens") or []
        if (not _keeps_text(spec.get("normalizer"), NORMALIZERS_KEEPING_TEXT)
                or not _keeps_text(spec.get("pre_tokenizer"), PRE_TOKENIZERS_KEEPING_TEXT)
                or model.get("type") != "BPE" or any(t.get("lstrip") or t.get("rstrip") for t in added)):
            return None
        vocab = self._tok.get_vocab(with_added_tokens=False)
        if model.get("unk_token") is not None and model.get("fuse_unk") and not (
                model.get("byte_fallback") and all(f"<0x{b:02X}>" in vocab for b in range(256))):
            return None  # a run of unknown characters, however long, is one token
        byte_level = _has_step(spec.get("pre_tokenizer"), "ByteLevel")
        longest = max((len(t) if byte_level else len(t.encode()) for t in vocab), default=1)
        longest_added = max((len(t["content"].encode()) for t in added), default=1)
        unknown = 4 if model.get("unk_token") is not None else 1  # one unknown character: at most 4 bytes
        return max(longest, longest_added, unknown)

    def fewest_tokens(self, rendered: str) -> int:
        """A lower bound on len(encode_rendered(rendered)), found without encoding: 0 where `max_token_bytes` is
        None."""
        if self.max_token_bytes is None:
            return 0
        size = sum(len(piece.encode("utf-8", "surrogatepass")) for piece, _ in self._chat.split(rendered))
        return -(-size // self.max_token_bytes)

    def encode_chat_masked(self, messages: list[dict], tools: list[dict] | None = None) -> MaskedChat:
        """Ids and SFT loss mask of a conversation (given the tool definitions `tools`, where it has them): the mask
        covers each assistant reply up to and including its end-of-turn token. The ids equal `encode_chat(messages,
        tools=tools)` except that they break at each reply's start (so a prompt's ids are a prefix of its answered
        conversation's) and turn end."""
        rendered, bounds = self._chat.replies(messages, tools)
        stops = set(self.stop_ids)
        chat = MaskedChat([], [], [])
        position = 0
        weights = [m.get("weight", 1) for m in messages if m.get("role") == "assistant"]
        for (start, end), weight in zip(bounds, weights, strict=True):
            before = self.encode_rendered(rendered[position:start])
            body = self.encode_rendered(rendered[start:end])
            learned = next((k + 1 for k, token in enumerate(body) if token in stops), len(body))
            chat.ids += before
            chat.replies.append((len(chat.ids), len(chat.ids) + learned))
            chat.ids += body
            chat.loss_mask += [0] * len(before) + [weight] * learned + [0] * (len(body) - learned)
            position = end
        tail = self.encode_rendered(rendered[position:])
        chat.ids += tail
        chat.loss_mask += [0] * len(tail)
        chat.reasoning_left_out = self._chat.reasoning_left_out(messages, rendered, bounds)
        return chat

    def render_for_encoding(self, messages: list[dict], add_generation_prompt: bool = False,
                            continue_final: bool = False, tools: list[dict] | None = None,
                            variables: dict | None = None) -> str:
        """The chat template's text with message text escaped, to encode with `encode_rendered`: ready for a reply
        (`add_generation_prompt`), or ending inside the final message, to continue it (`continue_final`), not both;
        `tools`: the tool definitions the template is given; `variables`: further ones (`ChatTemplate.render`)."""
        if continue_final:
            if add_generation_prompt:
                raise ValueError("a reply is opened or the final message continued, not both")
            if variables:
                raise ValueError("further template variables are given for a reply, not to continue a message")
            return self._chat.render_continuing(messages, tools)
        return self._chat.render(messages, add_generation_prompt, tools, variables)

    def chat_template_variables_refusal(self, variables: dict) -> str | None:
        """Why these further template variables cannot be given (`ChatTemplate.variables_refusal`), or None."""
        return self._chat.variables_refusal(variables)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = False,
                    tools: list[dict] | None = None) -> str:
        """The chat template's text, for display; never encode it (use `encode_chat`)."""
        return self._chat.unescape(self._chat.render(messages, add_generation_prompt, tools))


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _without_post_processor(tok: HFTokenizer) -> str:
    """tokenizer.json of `tok` as the library writes it, with no post-processor."""
    copy = HFTokenizer.from_str(tok.to_str())
    copy.post_processor = None
    return copy.to_str()


DOCUMENT_PROBE = "a"
"""A text any tokenizer encodes to tokens: encoded with and without special tokens, it shows what the post-processor
puts before a text."""


def _document_start(tok: HFTokenizer) -> list[int]:
    """The ids `tok`'s post-processor puts before a text (what `add_special_tokens=True` adds in front; a suffix,
    such as an end-of-text some post-processors append, is not part of it)."""
    plain = tok.encode(DOCUMENT_PROBE, add_special_tokens=False).ids
    full = tok.encode(DOCUMENT_PROBE, add_special_tokens=True).ids
    starts = [i for i in range(len(full) - len(plain) + 1) if full[i:i + len(plain)] == plain]
    return full[:starts[0]] if plain and starts else []


NORMALIZERS_KEEPING_TEXT = {"Prepend": None, "Replace": None}
"""Normalizers whose text is never shorter than their input (a Replace only of a string by one at least as long:
`_keeps_text`); a step's value: the `behavior` that would remove text, or None."""
PRE_TOKENIZERS_KEEPING_TEXT = {"ByteLevel": None, "Metaspace": None, "Digits": None, "UnicodeScripts": None,
                               "FixedLength": None, "Split": "Removed", "Punctuation": "Removed"}
"""Pre-tokenizers that keep every character (Whitespace, WhitespaceSplit, BertPreTokenizer and CharDelimiterSplit
drop blanks or delimiters), but for the `behavior` named."""


def _steps(step: dict | None) -> list[dict]:
    """A normalizer's or pre-tokenizer's steps (a Sequence's, or itself)."""
    if step is None:
        return []
    if step.get("type") != "Sequence":
        return [step]
    return [s for part in step.get("normalizers", step.get("pretokenizers", [])) for s in _steps(part)]


def _continuing(step: dict | None) -> dict | None:
    """A normalizer or pre-tokenizer as it applies to text that continues a document
    (`Tokenizer._continuation_encoder`): without its Prepend steps, its Metaspace steps prepending nothing and its
    ByteLevel steps adding no prefix space (RoBERTa's, BART's)."""
    if step is None or step.get("type") == "Prepend":
        return None
    if step.get("type") == "Metaspace":
        return {key: value for key, value in step.items() if key != "add_prefix_space"} | {"prepend_scheme": "never"}
    if step.get("type") == "ByteLevel":
        return step | {"add_prefix_space": False}
    if step.get("type") == "Sequence":
        key = "normalizers" if "normalizers" in step else "pretokenizers"
        return {**step, key: [kept for part in step.get(key, []) if (kept := _continuing(part)) is not None]}
    return step


def _has_step(step: dict | None, kind: str) -> bool:
    return any(s.get("type") == kind for s in _steps(step))


NOT_TEXT = "\ufffe"
"""A noncharacter that marks a Unigram model's protected pieces in the copy that encodes text
(`_never_picked_by_unigram`); the text's own become U+FFFD there."""


def _never_picked_by_unigram(spec: dict, protected: list[str]) -> None:
    """A Unigram model (SentencePiece's default, and T5's) holds its control tokens (`</s>`, `<s>`, ...) as pieces,
    scored 0, the best there is, so its Viterbi pass picks `</s>` out of the text `</s>` (the library's
    encode_special_tokens stops only the added tokens' matcher): text turned into control tokens. No score keeps
    them out (the library scores an unknown character below every piece), so in the copy that encodes text each
    protected piece is spelled after `NOT_TEXT`, which no text holds: as SentencePiece itself, which never matches
    a control symbol in text. Their ids are unchanged; the copy drops them from its added tokens (which, named by
    no piece now, the library gave new ids past the vocabulary)."""
    model = spec["model"]
    if model.get("type") != "Unigram":
        return
    for entry in model["vocab"]:
        if entry[0] in protected:
            entry[0] = NOT_TEXT + entry[0]
    spec["added_tokens"] = [token for token in spec.get("added_tokens", []) if token["content"] not in protected]
    replace = {"type": "Replace", "pattern": {"String": NOT_TEXT}, "content": "\ufffd"}
    normalizer = spec.get("normalizer")
    spec["normalizer"] = replace if normalizer is None else {"type": "Sequence", "normalizers": [replace, normalizer]}


def _keeps_text(step: dict | None, keeping: dict[str, str | None]) -> bool:
    """Whether a normalizer or pre-tokenizer (tokenizer.json's) never makes a text shorter."""
    for part in _steps(step):
        kind = part.get("type")
        if kind not in keeping or keeping[kind] is not None and part.get("behavior") == keeping[kind]:
            return False
        if kind == "Replace":
            pattern = part.get("pattern") or {}
            if "String" not in pattern or len(str(part.get("content", "")).encode()) < len(pattern["String"].encode()):
                return False
    return True


class TextNotEncoded(ValueError):
    """The tokenizer library failed on a text: a panic in its Rust code, such as a pre-tokenizer's regex that gives
    up on the text (`Onig: ... retry-limit-in-match over`). The text is refused; the process goes on."""


def _library_failure(exc: BaseException) -> TextNotEncoded | None:
    """The error for a panic of the tokenizer library (pyo3's PanicException, a BaseException that cannot be
    imported or pickled); None for any other exception."""
    if type(exc).__name__ != "PanicException":
        return None
    reason = next(iter(str(exc).splitlines()), "") or "a panic in the tokenizers library"
    return TextNotEncoded(f"the tokenizer failed on the text ({reason}): is its tokenizer.json from a source you "
                          "trust?")


@contextlib.contextmanager
def _library_failures_refused() -> Iterator[None]:
    """Inside, a panic of the tokenizers library raises `TextNotEncoded` (`_library_failure`)."""
    try:
        yield
    except BaseException as exc:
        if (failure := _library_failure(exc)) is None:
            raise
        raise failure from None


def _ids(encoder: HFTokenizer, text: str) -> list[int]:
    try:
        with _library_failures_refused():
            return encoder.encode(text, add_special_tokens=False).ids
    except TypeError:
        if not isinstance(text, str):
            raise
    raise _not_unicode(text)


def _ids_of_batch(encoder: HFTokenizer, texts: list[str]) -> list[list[int]]:
    """`_ids` of each text, encoded without the GIL (ids equal `encode`'s; the offsets, unused, are not computed)."""
    batches = [texts] if encoder.padding is None else [[text] for text in texts]  # a batch is padded to its longest
    try:
        with _library_failures_refused():
            return [encoding.ids for batch in batches
                    for encoding in encoder.encode_batch_fast(batch, add_special_tokens=False)]
    except TypeError:
        if not all(isinstance(text, str) for text in texts):
            raise
    raise _not_unicode(next(text for text in texts if not_utf8(text)))


def _not_unicode(text: str) -> ValueError:
    """The error for a str the library refuses: the only one is a str with a lone surrogate."""
    _, found = not_utf8(text)
    hint = ", which is not UTF-8 (is the terminal or the file in another encoding?)" if found.startswith("byte") else ""
    return ValueError(f"the text is not valid Unicode: it holds the {found}{hint}")
