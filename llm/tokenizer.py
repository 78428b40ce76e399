"""Byte-level BPE tokenizer: training, special tokens, ChatML, HF-compatible files.

No normalizer and no prefix space, so `decode(encode(s)) == s` for every UTF-8 string. Special
tokens sit at fixed low ids (0..3). The saved directory holds `tokenizer.json` and
`tokenizer_config.json` (with a ChatML `chat_template`), loadable by `transformers.AutoTokenizer`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from llm.errors import UserError

EOS, IM_START, IM_END, PAD = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"
SPECIAL_TOKENS = [EOS, IM_START, IM_END, PAD]  # ids 0, 1, 2, 3

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TOKENIZER_FILE, CONFIG_FILE = "tokenizer.json", "tokenizer_config.json"


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: Path, min_frequency: int = 2,
                    show_progress: bool = True) -> "Tokenizer":
    """Train byte-level BPE on a stream of texts and save it to `out_dir`."""
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise UserError(f"--vocab-size {vocab_size} is too small: byte-level BPE needs at least {256 + len(SPECIAL_TOKENS)}")
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return Tokenizer(tok).save(out_dir)


class Tokenizer:
    """Our view of a trained tokenizer: encode/decode, special ids, ChatML rendering, a content hash."""

    def __init__(self, tok: HFTokenizer) -> None:
        self._tok = tok
        ids = [tok.token_to_id(t) for t in SPECIAL_TOKENS]
        if ids != list(range(len(SPECIAL_TOKENS))):
            raise UserError(f"tokenizer lacks the special tokens {SPECIAL_TOKENS} at ids 0..{len(SPECIAL_TOKENS) - 1}")
        self.eos_id, self.im_start_id, self.im_end_id, self.pad_id = ids

    @classmethod
    def load(cls, directory: str | Path) -> "Tokenizer":
        path = Path(directory) / TOKENIZER_FILE
        if not path.is_file():
            raise UserError(f"{directory}: no {TOKENIZER_FILE}; train one with `zerollm tokenizer train`")
        try:
            return cls(HFTokenizer.from_file(str(path)))
        except Exception as exc:  # the tokenizers library raises plain Exception on bad files
            raise UserError(f"{path}: cannot load tokenizer ({exc})") from None

    def save(self, out_dir: Path) -> "Tokenizer":
        out_dir.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(out_dir / TOKENIZER_FILE))
        config = {
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
        (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2, ensure_ascii=False))
        return self

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    @property
    def hash(self) -> str:
        """Content hash of the vocabulary and merges: data and models record it to refuse a mismatch."""
        return hashlib.sha256(self._tok.to_str().encode()).hexdigest()[:16]

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @staticmethod
    def render_chat(messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
        """ChatML text, identical to what `chat_template` renders in transformers."""
        text = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)
        return text + (f"{IM_START}assistant\n" if add_generation_prompt else "")
