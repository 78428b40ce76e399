import json

from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import FIXTURES, data_sources, run_cli
from llm.tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS, Tokenizer


def test_special_tokens_at_fixed_low_ids(tokenizer_dir):
    tok = Tokenizer.load(tokenizer_dir)
    assert (tok.eos_id, tok.im_start_id, tok.im_end_id, tok.pad_id) == (0, 1, 2, 3)
    assert [tok.decode([i]) for i in range(4)] == SPECIAL_TOKENS
    assert tok.vocab_size == 512
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE


def test_round_trip_exact_on_every_shared_file(tokenizer_dir):
    tok = Tokenizer.load(tokenizer_dir)
    files = sorted(p for root in data_sources() for p in root.rglob("*") if p.is_file())
    assert len(files) >= 15
    for path in files:
        text = path.read_text(encoding="utf-8")
        assert tok.decode(tok.encode(text)) == text, path


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_round_trip_exact_on_any_unicode(tokenizer_dir, text):
    tok = Tokenizer.load(tokenizer_dir)
    assert tok.decode(tok.encode(text)) == text


def test_round_trip_keeps_what_normalizers_would_change(tokenizer_dir):
    tok = Tokenizer.load(tokenizer_dir)
    for text in [" leading space", "ｆｕｌｌｗｉｄｔｈ ①", "e\u0301 vs é", "tabs\t\tand\r\nCRLF", "  ", "🤖👩‍👩‍👧", "<|im_end|> literal"]:
        assert tok.decode(tok.encode(text)) == text


def test_loads_in_transformers_with_same_ids_and_chat_template(tokenizer_dir):
    from transformers import AutoTokenizer

    ours, theirs = Tokenizer.load(tokenizer_dir), AutoTokenizer.from_pretrained(str(tokenizer_dir))
    text = "To be, or not to be: 生存还是毁灭。"
    assert theirs.encode(text) == ours.encode(text)
    assert theirs.eos_token_id == ours.eos_id and theirs.pad_token_id == ours.pad_id
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "你好"},
                {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "2+2?"}]
    rendered = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == Tokenizer.render_chat(messages, add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>assistant\n")


def test_cli_rejects_too_small_vocab_and_missing_input(tmp_path):
    result = run_cli("tokenizer", "train", "--input", FIXTURES / "pretrain" / "en_notes.jsonl",
                     "--vocab-size", 100, "--out", tmp_path / "t")
    assert result.returncode == 2 and "too small" in result.stderr and "Traceback" not in result.stderr
    result = run_cli("tokenizer", "train", "--input", tmp_path / "nope.txt", "--vocab-size", 300, "--out", tmp_path / "t")
    assert result.returncode == 2 and "no such file" in result.stderr
