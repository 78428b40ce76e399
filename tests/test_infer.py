"""Inference: KV cache exactness, sampling, streaming, export/import with transformers, chat, the OpenAI-compatible server."""

import json
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from conftest import run_cli
from llm.config import ModelConfig
from llm.export import export_model, import_model
from llm.infer.generate import TextGenerator, cut_at_stop
from llm.infer.sampling import (
    SamplingParams,
    apply_repetition_penalty,
    choose_next,
    filter_top_k,
    filter_top_p,
)
from llm.loading import load_for_inference
from llm.model import Transformer
from llm.model.kv_cache import KVCache
from llm.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=128)
    return Transformer(cfg).eval()


@pytest.fixture(scope="module")
def generator(tiny_model, tokenizer_dir):
    return TextGenerator(tiny_model, Tokenizer.load(tokenizer_dir))


# ---- KV cache --------------------------------------------------------------------------------------

@torch.no_grad()
def test_cached_decoding_equals_full_forward_for_a_padded_batch(tiny_model):
    lengths, steps = [3, 11, 7], 5
    torch.manual_seed(1)
    seqs = [torch.randint(4, 512, (n + steps,)) for n in lengths]
    longest = max(lengths)
    prompt = torch.zeros(len(lengths), longest, dtype=torch.long)
    valid = torch.zeros(len(lengths), longest, dtype=torch.bool)
    for row, (n, seq) in enumerate(zip(lengths, seqs)):
        prompt[row, longest - n:], valid[row, longest - n:] = seq[:n], True
    cache = KVCache(tiny_model.cfg, len(lengths), longest + steps, torch.float32, torch.device("cpu"))
    cache.start_step(valid)
    cached = [tiny_model(prompt, cache=cache).logits[:, -1]]
    for step in range(steps - 1):
        cache.start_step(torch.ones(len(lengths), 1, dtype=torch.bool))
        token = torch.stack([seq[n + step] for n, seq in zip(lengths, seqs)])[:, None]
        cached.append(tiny_model(token, cache=cache).logits[:, -1])
    for row, (n, seq) in enumerate(zip(lengths, seqs)):
        full = tiny_model(seq[None, :n + steps - 1]).logits[0]
        for step in range(steps):
            assert torch.allclose(cached[step][row], full[n - 1 + step], atol=1e-5), (row, step)


def test_cache_refuses_to_overflow(tiny_model):
    cache = KVCache(tiny_model.cfg, 1, 4, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="holds 4 positions"):
        cache.start_step(torch.ones(1, 5, dtype=torch.bool))


# ---- sampling ------------------------------------------------------------------------------------

def test_top_k_and_top_p_keep_exactly_the_intended_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    assert torch.isfinite(filter_top_k(logits, 2)).tolist() == [[True, True, False, False, False]]
    assert torch.isfinite(filter_top_p(logits, 0.7)).tolist() == [[True, True, False, False, False]]
    assert torch.isfinite(filter_top_p(logits, 0.71)).tolist() == [[True, True, True, False, False]]
    assert torch.isfinite(filter_top_p(logits, 0.5)).tolist() == [[True, False, False, False, False]]
    shuffled = logits[:, [3, 0, 4, 2, 1]]
    assert torch.isfinite(filter_top_p(shuffled, 0.7)).tolist() == [[False, True, False, False, True]]


def test_sampling_respects_the_filters_and_the_seed():
    logits = torch.randn(4, 50)
    params = SamplingParams(temperature=1.0, top_k=3, seed=0)
    seen = torch.zeros(4, 50, dtype=torch.bool)
    allowed = logits.topk(3).indices
    for _ in range(50):
        token = choose_next(logits, params, seen, None)
        assert all(token[i] in allowed[i] for i in range(4))
    draws = [choose_next(logits, SamplingParams(temperature=1.0), seen, torch.Generator().manual_seed(5)) for _ in range(2)]
    assert torch.equal(draws[0], draws[1])
    assert torch.equal(choose_next(logits, SamplingParams(temperature=0.0), seen, None), logits.argmax(-1))


def test_repetition_penalty_lowers_only_seen_tokens():
    logits = torch.tensor([[2.0, -1.0, 3.0]])
    seen = torch.tensor([[True, True, False]])
    assert apply_repetition_penalty(logits, seen, 2.0).tolist() == [[1.0, -2.0, 3.0]]


def test_greedy_is_deterministic_and_seeded_sampling_reproducible(generator):
    greedy = SamplingParams(max_new_tokens=20)
    assert generator.generate(["To be"], greedy) == generator.generate(["To be"], greedy)
    sampled = [generator.generate(["To be"], SamplingParams(max_new_tokens=20, temperature=1.0, seed=s))[0]
               for s in (1, 1, 2)]
    assert sampled[0] == sampled[1] and sampled[0] != sampled[2]


def test_batched_generation_equals_one_prompt_at_a_time(generator):
    prompts = ["a", "The quick brown fox jumps", "生存还是毁灭，这是一个问题"]
    params = SamplingParams(max_new_tokens=12)
    assert generator.generate(prompts, params) == [generator.generate([p], params)[0] for p in prompts]


def test_uncached_decoding_gives_the_same_text(generator):
    params = SamplingParams(max_new_tokens=10)
    assert generator.generate(["Hello", "Once upon"], params, use_cache=False) == generator.generate(["Hello", "Once upon"], params)


# ---- streaming -----------------------------------------------------------------------------------

def test_stream_equals_generate_without_broken_utf8_on_chinese(generator):
    for seed in range(4):
        params = SamplingParams(max_new_tokens=40, temperature=1.0, seed=seed)
        pieces = list(generator.stream("春眠不觉晓，处处闻啼鸟。", params))
        text = generator.generate(["春眠不觉晓，处处闻啼鸟。"], params)[0]
        assert "".join(pieces) == text
        assert all("\ufffd" not in p for p in pieces) or "\ufffd" in text


def test_stop_strings_cut_the_output_in_both_modes(generator):
    params = SamplingParams(max_new_tokens=30)
    full = generator.generate(["Once"], params)[0]
    stop = full[5:8]
    assert len(full) > 8 and stop
    params = SamplingParams(max_new_tokens=30, stop=[stop])
    expected = full[:full.find(stop)]
    assert generator.generate(["Once"], params)[0] == expected
    assert "".join(generator.stream("Once", params)) == expected
    assert cut_at_stop("abcXYdef", ["XY", "d"]) == ("abc", True)


# ---- export and import ---------------------------------------------------------------------------

@pytest.mark.parametrize("stage", [2, 3])
def test_export_from_zero_checkpoints_matches_transformers_logits(zero_runs, stage, tmp_path):
    from transformers import AutoModelForCausalLM

    result = run_cli("export", "--run", zero_runs[stage], "--out", tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"} <= {p.name for p in tmp_path.iterdir()}
    ours, _ = load_for_inference(zero_runs[stage])
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    tokens = torch.randint(4, 512, (2, 19))
    with torch.no_grad():
        assert torch.allclose(hf(tokens).logits, ours(tokens).logits, atol=1e-4)
        imported = import_model(tmp_path)
        assert torch.equal(imported(tokens).logits, ours(tokens).logits)


def test_import_a_llama_made_by_transformers(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=300, hidden_size=96, intermediate_size=200, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64,
                         rope_theta=500000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(config).eval()
    hf.save_pretrained(str(tmp_path))
    ours = import_model(tmp_path)
    assert ours.cfg.head_dim == 16 and ours.cfg.kv_heads == 2 and not ours.cfg.tie_embeddings
    tokens = torch.randint(0, 300, (2, 33))
    with torch.no_grad():
        assert torch.allclose(ours(tokens).logits, hf(tokens).logits, atol=1e-4)


def test_yarn_model_round_trips_through_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = ModelConfig(vocab_size=128, dim=64, n_layers=1, n_heads=4, max_seq_len=256, rope_scaling="yarn",
                      rope_factor=4.0, rope_original_max_seq_len=64)
    model = Transformer(cfg).eval()
    export_model(model, None, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    tokens = torch.randint(0, 128, (1, 200))
    with torch.no_grad():
        assert torch.allclose(hf(tokens).logits, model(tokens).logits, atol=1e-4)


def test_moe_export_is_refused_clearly(tmp_path):
    from llm.errors import UserError

    with pytest.raises(UserError, match="mixture-of-experts"):
        export_model(Transformer(ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2, moe=True)), None, tmp_path)


# ---- commands ------------------------------------------------------------------------------------

def test_generate_command_from_run_and_export(zero_runs, tmp_path):
    first = run_cli("generate", "--model", zero_runs[2], "--prompt", "To be", "--max-new-tokens", 8)
    assert first.returncode == 0, first.stderr[-2000:]
    assert run_cli("export", "--run", zero_runs[2], "--out", tmp_path).returncode == 0
    second = run_cli("generate", "--model", tmp_path, "--prompt", "To be", "--max-new-tokens", 8)
    assert second.returncode == 0 and second.stdout == first.stdout
    bad = run_cli("generate", "--model", tmp_path / "nothing", "--prompt", "x")
    assert bad.returncode == 2 and "neither a run directory" in bad.stderr


def test_chat_repl_commands(zero_runs):
    script = "hello\n/system You are terse.\nhi there\n/reset\n/bogus\nagain\n/quit\n"
    result = subprocess.run([sys.executable, "-m", "llm", "chat", "--model", str(zero_runs[2]), "--max-new-tokens", "6"],
                            input=script, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    assert out.count("assistant> ") == 3
    assert "(system prompt set; conversation reset)" in out and "(conversation reset)" in out
    assert out.count("commands: /reset") == 2  # at start, and for the unknown command


# ---- the OpenAI-compatible server ----------------------------------------------------------------

@pytest.fixture(scope="module")
def server(generator):
    from llm.infer.server import ChatService, make_server

    srv = make_server(ChatService(generator, "tiny", default_max_tokens=16), "127.0.0.1", 0)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def _client(url):
    from openai import OpenAI

    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_openai_client_chat_and_models(server, generator):
    client = _client(server)
    assert [m.id for m in client.models.list()] == ["tiny"]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    expected = "".join(generator.stream(Tokenizer.render_chat(messages, True), SamplingParams(max_new_tokens=10)))
    assert reply.choices[0].message.content == expected and reply.choices[0].message.role == "assistant"
    assert reply.usage.completion_tokens <= 10 and reply.choices[0].finish_reason in ("stop", "length")
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def _post(url, body: bytes):
    request = urllib.request.Request(f"{url}/v1/chat/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.parametrize("body, param", [
    (b"{not json", None),
    (b"[]", None),
    (json.dumps({"messages": []}).encode(), "messages"),
    (json.dumps({"messages": [{"role": "wizard", "content": "x"}]}).encode(), "messages[0]"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": "many"}).encode(), "max_tokens"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "temperature": -1}).encode(), None),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 100000}).encode(), None),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "n": 3}).encode(), "n"),
])
def test_bad_requests_get_4xx_json_errors_and_the_server_survives(server, body, param):
    status, payload = _post(server, body)
    assert 400 <= status < 500 and payload["error"]["type"] == "invalid_request_error"
    assert payload["error"]["param"] == param
    with urllib.request.urlopen(f"{server}/health", timeout=10) as response:
        assert json.loads(response.read()) == {"status": "ok"}


def test_unknown_route_is_404(server):
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(f"{server}/v2/nothing", timeout=10)
    assert info.value.code == 404


def test_twenty_concurrent_requests_get_their_own_answers(server, generator):
    prompts = [f"question {i}: {'why ' * (i % 5)}" for i in range(20)]

    def ask(prompt):
        client = _client(server)
        reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                               max_tokens=8, temperature=0, stream=prompt.endswith("why "))
        if hasattr(reply, "choices"):
            return reply.choices[0].message.content
        return "".join(c.choices[0].delta.content or "" for c in reply)

    with ThreadPoolExecutor(max_workers=20) as pool:
        answers = list(pool.map(ask, prompts))
    for prompt, answer in zip(prompts, answers):
        rendered = Tokenizer.render_chat([{"role": "user", "content": prompt}], True)
        assert answer == "".join(generator.stream(rendered, SamplingParams(max_new_tokens=8)))


def test_serve_command_starts_on_loopback(zero_runs):
    proc = subprocess.Popen([sys.executable, "-m", "llm", "serve", "--model", str(zero_runs[2]), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "on http://127.0.0.1:" in line, line + proc.stderr.read()
        url = line.split(" on ")[1].split("/v1")[0]
        with urllib.request.urlopen(f"{url}/health", timeout=30) as response:
            assert response.status == 200
    finally:
        proc.terminate()
        proc.wait(timeout=30)
