"""SFT and DPO: data shapes, loss masks, packing, training on 2 ranks, exact resume, the pretrain -> SFT -> DPO
chain."""

import json
import math
import pickle
import re
import shutil
from types import SimpleNamespace

import h5py
import pytest
import torch
import torch.nn.functional as F
from forked_ranks import kill_when, run_job
from tokens_swap import replace_tokens_file, reversed_tokens

from conftest import FIXTURES, run_cli, train_args, zerollm_here
from llm.config import GRPOConfig, ModelConfig
from llm.data.datasets import PackedConversations, PreferencePairs, PretrainWindows
from llm.data.formats import Chat, Pair, RecordError, chat_record, conversation, pair_record, preference, pretrain_text
from llm.data.prepare import DIGEST_ATTR, TOKENS_FILE, TooLong, encode_dpo, encode_sft, prepare
from llm.errors import UserError
from llm.loading import consolidated_weights
from llm.model import Transformer, masked_cross_entropy
from llm.model.token_losses import token_logps
from llm.tokenizer import Tokenizer
from llm.train.ds_config_file import load_ds_config
from llm.train.objectives import CausalLMObjective, DistillObjective, DPOObjective, GRPOObjective
from llm.train.prompts import prompt_record
from llm.train.trainer import Trainer


def _metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


# ---- data -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_every_file_of_every_shape_prepares(tokenizer_dir, tmp_path, kind):
    files = sorted(p for p in (FIXTURES / kind).iterdir() if p.suffix in (".json", ".jsonl"))
    assert len(files) >= (4 if kind == "sft" else 6)
    for path in files:
        report = prepare(kind, [str(path)], tokenizer_dir, tmp_path / path.stem, seq_len=1024, workers=2,
                         show_progress=False)
        assert report.documents["train"] + report.documents["val"] > 0, path
        assert all(s.startswith(f"{path}:") for s in report.skipped)
        if FIXTURES in path.parents:
            assert report.skipped == [], report.skipped


def test_documented_handling_of_bad_conversations(tokenizer_dir, tmp_path):
    records = [
        {"conversations": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
        {"conversations": [{"role": "user", "content": "no reply here"}]},
        {"conversations": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "  "}]},
        {"conversations": [{"role": "wizard", "content": "q"}, {"role": "assistant", "content": "a"}]},
        {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
        {"instruction": "add", "input": "1 and 2", "output": "3"},
        {"text": "not a conversation"},
        {"conversations": [{"role": "user", "content": "q", "reasoning_content": "hm"},
                           {"role": "assistant", "content": "a"}]},
        {"conversations": [{"role": "user", "content": "q"},
                           {"role": "assistant", "content": "", "tool_calls": [{"arguments": {}}]}]},
    ]
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    report = prepare("sft", [str(path)], tokenizer_dir, tmp_path / "out", val_fraction=0.0, workers=1,
                     show_progress=False)
    assert report.documents["train"] == 3
    assert report.skipped == [f"{path}:2: no assistant reply", f"{path}:3: empty assistant reply",
                              (f"{path}:4: unknown role 'wizard'; expected one of system, user, human, assistant, "
                               "gpt, bot, tool, observation, function, function_call"),
                              (f"{path}:7: not a conversation (keys: text); expected 'conversations', 'messages', "
                               "'instruction'/'output' or 'prompt'/'completion'"),
                              f"{path}:8: user turn carries reasoning; only assistant turns may",
                              f"{path}:9: tool call has no 'name' string"]
    strict = run_cli("data", "prepare", "--kind", "sft", "--input", path, "--tokenizer", tokenizer_dir, "--out",
                     tmp_path / "strict", "--strict")
    assert strict.returncode == 2 and f"{path}:2: no assistant reply" in strict.stderr


def test_openai_weight_0_marks_a_reply_as_context_and_reasoning_has_three_names():
    """OpenAI's fine-tuning `weight: 0` was ignored (the reply learnt), and reasoning under `thinking` (gpt-oss) or
    `reasoning` (vLLM's newer name) was dropped, the model taught to answer without it."""
    turns = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1", "weight": 0},
             {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2", "weight": 1},
             {"role": "user", "content": "q3"}, {"role": "assistant", "content": "a3", "weight": 0}]
    assert conversation({"messages": turns}) == [  # a3 teaches nothing: left out
        {"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1", "weight": 0},
        {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]
    for weights, said in [((0, 0), "every assistant reply has weight 0: nothing to learn"),
                          ((0.5, 1), "'weight' is 0.5, expected 0 (not learnt) or 1"),
                          ((True, 1), "'weight' is true, expected 0 (not learnt) or 1")]:
        weighted = [{**turns[1], "weight": weights[0]}, {**turns[3], "weight": weights[1]}]
        with pytest.raises(RecordError, match=f"^{re.escape(said)}$"):
            conversation({"messages": [turns[0], weighted[0], turns[2], weighted[1]]})
    with pytest.raises(RecordError, match="^'chosen' has weight 0 \\(not to learn\\), yet a preference pair"):
        preference({"prompt": "q", "chosen": [{"role": "assistant", "content": "a", "weight": 0}],
                    "rejected": [{"role": "assistant", "content": "b"}]})
    for key in ("reasoning_content", "reasoning", "thinking"):
        assert conversation({"messages": [turns[0], {"role": "assistant", "content": "a1", key: "think"}]})[1] == {
            "role": "assistant", "content": "a1", "reasoning_content": "think"}
    with pytest.raises(RecordError, match="^'reasoning_content' and 'thinking' give different reasoning; keep one$"):
        conversation({"messages": [turns[0], {"role": "assistant", "content": "a1", "reasoning_content": "x",
                                              "thinking": "y"}]})
    same = {"role": "assistant", "content": "a1", "reasoning_content": "x", "thinking": "x", "reasoning": ""}
    assert conversation({"messages": [turns[0], same]})[1]["reasoning_content"] == "x"
    # a role or a text given two ways that disagree: one was used and the other dropped, a user turn learnt as a reply
    with pytest.raises(RecordError,
                       match=r"^'role' and 'from' give different roles \('assistant', 'human'\); keep one$"):
        conversation({"conversations": [{"from": "human", "role": "assistant", "value": "hi"},
                                        {"from": "gpt", "value": "yo"}]})
    with pytest.raises(RecordError, match="^'content' and 'value' give different text; keep one$"):
        conversation({"messages": [turns[0], {"role": "assistant", "content": "a1", "value": "a2"}]})
    agreeing = {"conversations": [{"from": "human", "role": "user", "value": "hi", "content": "hi"},
                                  {"from": "gpt", "role": "assistant", "value": "yo"}]}
    assert conversation(agreeing) == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]


def test_openai_preference_records_are_pairs():
    """OpenAI's preference fine-tuning format was skipped: "a preference record needs 'chosen' and 'rejected'"."""
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]
    record = {"input": {"messages": [{"role": "user", "content": "Cold in SF?"}], "tools": tools,
                        "parallel_tool_calls": True},
              "preferred_output": [{"role": "assistant", "content": "Mild, 15 C."}],
              "non_preferred_output": [{"role": "assistant", "content": "No."}]}
    assert pair_record(record) == Pair([{"role": "user", "content": "Cold in SF?"}],
                                       {"role": "assistant", "content": "Mild, 15 C."},
                                       {"role": "assistant", "content": "No."}, tools)
    assert pair_record({**record, "input": {"messages": record["input"]["messages"]}}).tools is None
    with pytest.raises(RecordError, match="^an OpenAI preference record needs 'input' too$"):
        pair_record({key: record[key] for key in ("preferred_output", "non_preferred_output")})
    with pytest.raises(RecordError, match="^'input' is a list without 'messages', expected an object holding them$"):
        pair_record({**record, "input": []})


def test_shapes_normalise_to_messages():
    assert conversation({"instruction": "add", "input": "1 and 2", "output": "3", "system": "math",
                         "history": [["2+2?", "4"]]}) == [
        {"role": "system", "content": "math"}, {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"}, {"role": "user", "content": "add\n1 and 2"},
        {"role": "assistant", "content": "3"}]
    user, reply = {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}
    for prompt, completion in [("2+2?", "4"), ([user], [reply]), ([user], reply)]:  # TRL's prompt-completion: it was
        assert conversation({"prompt": prompt, "completion": completion, "system": "math"}) == [  # no conversation
            {"role": "system", "content": "math"}, user, reply]
    with pytest.raises(RecordError, match="^empty 'prompt'$"):
        conversation({"prompt": " ", "completion": "4"})
    earlier = [user, {"role": "assistant", "content": "ask me"}, {"role": "user", "content": "3+3?"}]
    assert conversation({"prompt": earlier, "completion": "6"})[1]["weight"] == 0  # the prompt's reply is context
    with pytest.raises(RecordError, match="^a 'label' beside 'prompt' and 'completion' \\(KTO's unpaired"):
        conversation({"prompt": "2+2?", "completion": "5", "label": False})
    assert conversation({"instruction": "", "input": "1 and 2", "output": "3"})[0] == {  # a stray line end before
        "role": "user", "content": "1 and 2"}  # it (LLaMA-Factory joins the parts that are not empty)
    assert conversation({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi "},
                                                                   {"type": "text", "text": "there"}]},
                                      {"role": "assistant", "content": "hello"},
                                      {"role": "user", "content": "a turn after the last reply"}]}) == [
        {"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello"}]


def test_tool_calls_tool_turns_and_reasoning_are_kept():
    openai = {"messages": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "reasoning_content": "I should look it up.",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "name": "weather", "content": "rain, 9 C"},
        {"role": "assistant", "content": "It rains in Oslo.", "reasoning_content": ""}]}
    canonical = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "reasoning_content": "I should look it up.",
         "tool_calls": [{"name": "weather", "arguments": {"city": "Oslo"}, "id": "c1"}]},  # the JSON text's object
        {"role": "tool", "content": "rain, 9 C", "name": "weather", "tool_call_id": "c1"},
        {"role": "assistant", "content": "It rains in Oslo."}]
    assert conversation(openai) == canonical
    sharegpt = {"conversations": [
        {"from": "human", "value": "Weather in Oslo?"},
        {"from": "function_call", "value": '{"name": "weather", "arguments": {"city": "Oslo"}}'},
        {"from": "observation", "value": "rain, 9 C"},
        {"from": "gpt", "value": "It rains in Oslo."}]}
    assert conversation(sharegpt) == [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [{"name": "weather", "arguments": {"city": "Oslo"}}]},
        {"role": "tool", "content": "rain, 9 C"}, {"role": "assistant", "content": "It rains in Oslo."}]
    minimind = {"conversations": [  # tool calls stored as JSON text, plain {name, arguments}
        {"role": "user", "content": "2*3?"},
        {"role": "assistant", "content": "", "tool_calls": '[{"name": "multiply", "arguments": {"a": 2, "b": 3}}]'},
        {"role": "tool", "content": "6"}, {"role": "assistant", "content": "6"}]}
    assert conversation(minimind)[1]["tool_calls"] == [{"name": "multiply", "arguments": {"a": 2, "b": 3}}]


@pytest.mark.parametrize("reasoning", [0, False, 5, []])
def test_reasoning_that_is_no_text_is_refused_whatever_its_value(reasoning):
    """A reasoning_content of 5 was refused, one of 0 or false taken for no reasoning."""
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes", "reasoning_content": reasoning}]
    with pytest.raises(RecordError, match="'reasoning_content' is .*, expected a string"):
        conversation({"messages": turns})


def test_tool_call_arguments_as_json_text_are_trained_as_the_object_and_served_so(tokenizer_dir):
    """OpenAI's arguments are the text of a JSON object; our template (and Qwen2.5's, MiniMind's) put a string's JSON
    in the text, quoted again: `"arguments": "{\\"city\\": \\"Lima\\"}"`, while the object form gave `{"city":
    "Lima"}`, so a dataset mixing the forms taught two formats, and a served model was sent the quoted one."""
    from llm.infer.server import canonical_message

    tok = Tokenizer.load(tokenizer_dir)
    asked = {"role": "user", "content": "Weather in Lima?"}
    rendered = []
    for arguments in ('{"city": "Lima"}', {"city": "Lima"}):
        call = {"type": "function", "function": {"name": "weather", "arguments": arguments}}
        rendered.append(tok.render_chat(conversation({"messages": [asked, {"role": "assistant", "content": "",
                                                                            "tool_calls": [call]}]})))
        served = canonical_message({"role": "assistant", "content": "", "tool_calls": [call]}, 1)
        rendered.append(tok.render_chat([asked, served]))
    assert len(set(rendered)) == 1 and '{"name": "weather", "arguments": {"city": "Lima"}}' in rendered[0]
    for text in ("not json", "[1, 2]", "5"):  # other text stays text
        call = {"name": "f", "arguments": text}
        assert conversation({"messages": [asked, {"role": "assistant", "tool_calls": [call]}]})[1]["tool_calls"] == [
            {"name": "f", "arguments": text}]


def test_sft_records_with_tools_and_reasoning_are_prepared_not_skipped(tokenizer_dir, tmp_path):
    path = FIXTURES / "sft" / "openai_tools.jsonl"
    report = prepare("sft", [str(path)], tokenizer_dir, tmp_path / "out", val_fraction=0.0, workers=1,
                     show_progress=False)
    assert report.skipped == [] and report.documents["train"] == len(path.read_text().splitlines())


def test_a_sharegpt_function_call_of_several_calls_is_one_turn_of_them():
    """LLaMA-Factory writes parallel calls as a JSON list in one function_call turn: the record was skipped ('tool
    call is a list, expected an object')."""
    calls = [{"name": "weather", "arguments": {"city": city}} for city in ("Lima", "Oslo")]
    record = {"conversations": [{"from": "human", "value": "Lima and Oslo?"},
                                {"from": "function_call", "value": json.dumps(calls)},
                                {"from": "observation", "value": json.dumps(["sunny", "rain"])},
                                {"from": "gpt", "value": "Sunny, then rain."}]}
    assert conversation(record)[1] == {"role": "assistant", "content": "", "tool_calls": calls}
    one = {**record, "conversations": [record["conversations"][0], {"from": "function_call",
                                                                    "value": json.dumps(calls[0])},
                                       *record["conversations"][2:]]}
    assert conversation(one)[1]["tool_calls"] == calls[:1]


def test_tool_definitions_are_read_wherever_records_give_them():
    """TRL's top-level 'tools', xLAM's as JSON text, MiniMind's on the system turn ('functions' in its 2510 data):
    all were dropped without a word."""
    weather = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
    tools = [weather, {"name": "clock"}]
    system, user = {"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Lima?"}
    call = {"role": "assistant", "content": "", "tool_calls": [{"name": "weather", "arguments": {"city": "Lima"}}]}
    for record in ({"messages": [user, call], "tools": tools},
                   {"messages": [user, call], "tools": json.dumps(tools)},
                   {"conversations": [{**system, "tools": json.dumps(tools)}, user, call]},
                   {"conversations": [{**system, "functions": tools}, user, call]},
                   {"messages": [{**system, "tools": tools}, user, call], "tools": tools}):
        assert chat_record(record) == Chat(conversation(record), tools), record
    assert chat_record({"messages": [user, call], "tools": []}).tools is None
    assert chat_record({"conversations": [{**system, "tools": None}, user, call]}).tools is None  # MiniMind's nulls
    no = {"role": "assistant", "content": "No."}
    assert pair_record({"chosen": [{**system, "tools": tools}, user, call], "rejected": [{**system, "tools": tools},
                                                                                          user, no]}) == Pair(
        [system, user], call, no, tools)
    assert pair_record({"prompt": [user], "chosen": [call], "rejected": [no], "tools": tools}).tools == tools
    with pytest.raises(RecordError, match="^'chosen' turn 1's 'tools' and 'rejected' turn 1's 'tools' give different "
                                          "tool definitions; keep one$"):  # the rejected side's were used
        pair_record({"chosen": [{**system, "tools": tools}, user, call],
                     "rejected": [{**system, "tools": tools[1:]}, user, no]})
    refusals = {
        "'tools' is an object, expected a list of tool definitions": {"tools": weather},
        "'tools' is not valid JSON": {"tools": "[{"},
        "'tools': tool 2 is not a definition with a 'name' string": {"tools": [weather, {"function": "clock"}]},
        "'tools': tool 1 is not a definition with a 'name' string": {"tools": ["weather"]},
        "'tools' and 'messages' turn 1's 'tools' give different tool definitions; keep one": {
            "tools": tools, "messages": [{**system, "tools": tools[:1]}, user, call]},
        # two system turns: the second's replaced the first's in the check, and its definitions were used
        "'messages' turn 1's 'tools' and 'messages' turn 3's 'tools' give different tool definitions; keep one": {
            "messages": [{**system, "tools": tools}, user, {**system, "tools": tools[:1]}, call]},
    }
    for reason, fields in refusals.items():
        with pytest.raises(RecordError, match=f"^{re.escape(reason)}"):
            chat_record({"messages": [user, call], **fields})


def test_sft_and_dpo_records_with_tools_are_prepared_with_their_definitions(tokenizer_dir, tmp_path):
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    user, reply = {"role": "user", "content": "Weather in Lima?"}, {"role": "assistant", "content": "Sunny."}
    sft, dpo = tmp_path / "sft.jsonl", tmp_path / "dpo.jsonl"
    sft.write_text(json.dumps({"messages": [user, reply], "tools": tools}) + "\n")
    dpo.write_text(json.dumps({"prompt": [user], "chosen": [reply], "rejected": "Rain.", "tools": tools}) + "\n")
    tok = Tokenizer.load(tokenizer_dir)
    for kind, path, dataset, key in (("sft", sft, PackedConversations, "tokens"),
                                     ("dpo", dpo, PreferencePairs, "rejected_tokens")):
        report = prepare(kind, [str(path)], tokenizer_dir, tmp_path / kind, val_fraction=0.0, workers=1,
                         show_progress=False)
        assert report.skipped == [] and report.documents["train"] == 1
        tokens = dataset(tmp_path / kind, "train", 512, pad_id=tok.pad_id)[0][key].tolist()
        text = tok.decode(tokens)
        assert text.startswith("<|im_start|>system\n# Tools\n\n") and '<tools>\n{"type": "function"' in text, text


def test_every_dpo_shape_gives_the_same_pair():
    question, good, bad = "What is 2 plus 2?", "4.", "5."
    user, reply = {"role": "user", "content": question}, lambda text: {"role": "assistant", "content": text}
    shapes = [
        {"prompt": question, "chosen": good, "rejected": bad},
        {"conversations": [{"from": "human", "value": question}], "chosen": {"from": "gpt", "value": good},
         "rejected": {"from": "gpt", "value": bad}},
        {"messages": [user], "chosen": good, "rejected": bad},
        {"chosen": [user, reply(good)], "rejected": [user, reply(bad)]},  # MiniMind: no prompt key
        {"prompt": [user], "chosen": [reply(good)], "rejected": [reply(bad)]},  # TRL conversational
        {"prompt": [user], "chosen": [user, reply(good)], "rejected": [user, reply(bad)]},
        {"instruction": question, "chosen": good, "rejected": bad},  # Alpaca-style
        {"prompt": question, "chosen": {"content": good}, "rejected": {"content": bad}},
        # UltraFeedback (binarized): 'messages' is the chosen conversation; it was skipped, the reason naming the
        # replies ('must each end in one assistant reply after the turns they share')
        {"prompt": question, "prompt_id": "0", "chosen": [user, reply(good)], "rejected": [user, reply(bad)],
         "messages": [user, reply(good)], "score_chosen": 8.0, "score_rejected": 3.0},
        {"messages": [user, reply(good)], "chosen": good, "rejected": bad},
    ]
    for shape in shapes:
        assert preference(shape) == ([user], reply(good), reply(bad)), shape


def test_minimind_pairs_share_every_turn_before_the_last_reply():
    system = {"role": "system", "content": "Be kind."}
    turns = [system, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
             {"role": "user", "content": "and now?"}]
    good = {"role": "assistant", "content": "Now we talk.", "reasoning_content": "They want to chat."}
    bad = {"role": "assistant", "content": "Go away."}
    assert preference({"chosen": turns + [good], "rejected": turns + [bad]}) == (turns, good, bad)
    for record, message in [
        ({"chosen": turns + [good], "rejected": turns[:1] + [{"role": "user", "content": "other"}, bad]},
         "must each end in one assistant reply after the turns they share; they part at turn 2 .a user turn in "
         "'chosen', a user turn in 'rejected'.$"),
        # a system turn on one side only: the reason named no turn
        ({"chosen": turns + [good], "rejected": turns[1:] + [bad]}, "they part at turn 1 .a system turn in 'chosen', a "
                                                                    "user turn in 'rejected'.$"),
        ({"chosen": turns + [good], "rejected": turns[:1] + [bad]}, "they part at turn 2 .a user turn in 'chosen', an "
                                                                    "assistant turn in 'rejected'.$"),
        ({"chosen": turns + [good], "rejected": turns + [good]}, "are the same reply"),
        ({"chosen": [good], "rejected": [bad]}, "no prompt"),
        ({"chosen": [system, good], "rejected": [system, bad]}, "end with a user or tool turn"),
        ({"prompt": "q", "chosen": [{"role": "user", "content": "a"}], "rejected": "b"},
         "'chosen' holds a user turn that is not the record's prompt"),
        ({"prompt": "q", "chosen": "  ", "rejected": "b"}, "empty 'chosen'"),
    ]:
        with pytest.raises(RecordError, match=message):
            preference(record)


def test_a_record_giving_its_conversation_or_prompt_twice_is_read_where_they_agree_and_refused_where_not():
    """A prompt beside chosen/rejected conversations of another prompt trained both prompts as two user turns; a
    record with two shapes that disagree (messages and conversations, conversations and a prompt) had one used and
    the other dropped; an empty prompt trained a pair answering an empty user turn. Each is skipped, saying why.
    Shapes that agree are read (Magpie gives its turns as both conversations and messages, and an instruction
    beside them; UltraChat its first prompt as 'prompt' beside 'messages')."""
    q, other = {"role": "user", "content": "Q"}, {"role": "user", "content": "other"}
    good, bad = {"role": "assistant", "content": "A"}, {"role": "assistant", "content": "B"}
    for record, message in [
        ({"prompt": "P1", "chosen": [q, good], "rejected": [q, bad]},
         "'chosen' holds a user turn that is not the record's prompt; give the prompt once"),
        ({"prompt": "P1", "chosen": [good, q, good], "rejected": [bad]},  # an opening assistant turn: P1 went first
         "'chosen' holds a user turn that is not the record's prompt; give the prompt once"),
        ({"prompt": "", "chosen": "a", "rejected": "b"}, "empty 'prompt'"),
        ({"conversations": [q], "prompt": "other", "chosen": "a", "rejected": "b"},
         "'conversations' and 'prompt' give different turns; keep one"),
        ({"messages": [q], "instruction": "other", "chosen": "a", "rejected": "b"},
         "'messages' and 'instruction' give different turns; keep one"),
    ]:
        with pytest.raises(RecordError, match=f"^{re.escape(message)}"):
            preference(record)
    for record in ({"messages": [q, good], "conversations": [other, good]},
                   {"conversations": [q, good], "instruction": "other", "output": "x"}):
        with pytest.raises(RecordError, match="give different turns; keep one"):
            conversation(record)
    with pytest.raises(RecordError, match=re.escape("'messages' and 'prompt' give different turns")):
        prompt_record({"messages": [q], "prompt": "other", "answer": "1"})
    assert preference({"prompt": [q], "chosen": [q, good], "rejected": [bad]}) == ([q], good, bad)
    system = {"role": "system", "content": "Be exact."}  # the prompt behind the conversations' own system turn: it
    # was put before the system turn, so the pair trained the prompt twice, the system turn between
    assert preference({"prompt": "Q", "chosen": [system, q, good], "rejected": [system, q, bad]}) == (
        [system, q], good, bad)
    magpie = {"instruction": "Q", "response": "A", "conversations": [{"from": "human", "value": "Q"},
                                                                    {"from": "gpt", "value": "A"}],
              "messages": [q, good]}
    assert conversation(magpie) == [q, good]
    ultrachat = {"prompt": "Q", "messages": [q, good, other, bad]}
    assert conversation(ultrachat) == [q, good, other, bad]
    assert prompt_record({**ultrachat, "answer": "1"})[0] == [q, good, other]
    assert preference({"instruction": "Q", "conversations": [q], "chosen": "A", "rejected": "B"}) == ([q], good, bad)
    assert preference({"prompt": None, "chosen": [q, good], "rejected": [q, bad]}) == ([q], good, bad)  # null: absent


def test_pretraining_on_conversation_and_pair_files_takes_their_text():
    question = {"role": "user", "content": "q"}
    assert pretrain_text({"chosen": [question, {"role": "assistant", "content": "a"}],
                          "rejected": [question, {"role": "assistant", "content": "b"}]}) == "q\na"
    assert pretrain_text({"messages": [{"role": "user", "content": "q"},
                                       {"role": "assistant", "content": None, "tool_calls": []},
                                       {"role": "assistant", "content": "a", "reasoning_content": "r"}]}) == "q\nr\na"


def test_loss_mask_is_exactly_the_assistant_replies(tokenizer_dir):
    tok = Tokenizer.load(tokenizer_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
                {"role": "assistant", "content": "4"}, {"role": "user", "content": "和 3+3 呢？"},
                {"role": "assistant", "content": "六。\nSix."}]
    sample, truncated, _ = encode_sft(tok, Chat(messages, None), max_tokens=10_000)
    tokens, mask = sample["tokens"], sample["loss_mask"]
    assert not truncated and tok.decode(tokens) == tok.render_chat(messages)
    runs, current = [], []
    for token, bit in zip(tokens + [None], mask + [0]):
        if bit:
            current.append(token)
        elif current:
            runs.append(tok.decode(current))
            current = []
    assert runs == ["4<|im_end|>", "六。\nSix.<|im_end|>"]
    unmasked = tok.decode([t for t, bit in zip(tokens, mask) if not bit])
    assert unmasked == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
                        "<|im_start|>assistant\n\n<|im_start|>user\n和 3+3 呢？<|im_end|>\n<|im_start|>assistant\n\n")


def test_long_conversations_are_cut_at_a_turn_boundary(tokenizer_dir):
    tok = Tokenizer.load(tokenizer_dir)
    messages = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
                {"role": "user", "content": "q2 " * 50}, {"role": "assistant", "content": "a2 " * 50}]
    full, _, _ = encode_sft(tok, Chat(messages, None), 10_000)
    first, _, _ = encode_sft(tok, Chat(messages[:2], None), 10_000)
    sample, truncated, _ = encode_sft(tok, Chat(messages, None), len(full["tokens"]) - 2)
    assert truncated and sample == {k: v[:-1] for k, v in first.items()}  # the whole first exchange, nothing of the
    assert tok.decode(sample["tokens"]).endswith("a1<|im_end|>")  # second; the newline after it bears no loss
    # the second reply's end-of-turn token fits, the newline after it not: the reply was cut for it
    sample, truncated, _ = encode_sft(tok, Chat(messages, None), len(full["tokens"]) - 1)
    assert truncated and sample == {k: v[:-1] for k, v in full.items()} and sum(sample["loss_mask"]) == \
        sum(full["loss_mask"])
    with pytest.raises(TooLong, match=f"^too long: the first reply ends after {len(first['tokens']) - 1} tokens"):
        encode_sft(tok, Chat(messages[:2], None), len(first["tokens"]) - 2)
    assert encode_sft(tok, Chat(messages[:2], None), len(first["tokens"]) - 1)[0]["tokens"] == first["tokens"][:-1]


def _pair(prompt: list[dict], chosen: str, rejected: str) -> Pair:
    return Pair(prompt, {"role": "assistant", "content": chosen}, {"role": "assistant", "content": rejected}, None)


def test_an_over_long_pair_keeps_all_of_its_prompt_that_fits_beside_its_replies(tokenizer_dir):
    """The prompt was cut to half the budget however short the replies: a pair over by two tokens lost its system
    prompt and first turn, its kept part starting inside the markup."""
    tok = Tokenizer.load(tokenizer_dir)
    prompt = [{"role": "system", "content": "Answer briefly. " * 3}, {"role": "user", "content": "hi there"},
              {"role": "assistant", "content": "hello"}, {"role": "user", "content": "and now?"}]
    full, _, _ = encode_dpo(tok, _pair(prompt, "yes", "no"), 10_000)
    longest = max(len(full["chosen"]), len(full["rejected"]))
    budget = len(full["prompt"]) + longest - 2
    assert len(full["prompt"]) > budget // 2 + 2
    sample, truncated, _ = encode_dpo(tok, _pair(prompt, "yes", "no"), budget)
    assert truncated and sample["prompt"] == full["prompt"][2:]  # two tokens dropped from its start, no more
    assert (sample["chosen"], sample["rejected"]) == (full["chosen"], full["rejected"])
    long_reply = "word " * budget  # replies longer than the budget: the prompt keeps half of it, the replies the rest
    full, _, _ = encode_dpo(tok, _pair(prompt, long_reply, "no"), 10_000)
    sample, truncated, _ = encode_dpo(tok, _pair(prompt, long_reply, "no"), budget)
    assert truncated and sample["prompt"] == full["prompt"][-(budget // 2):]
    assert sample["chosen"] == full["chosen"][:budget - budget // 2] and sample["rejected"] == full["rejected"]


def test_over_long_records_are_reported_at_prepare_time(tokenizer_dir, tmp_path):
    long = "many many words " * 40
    chats = tmp_path / "chats.jsonl"
    chats.write_text("\n".join(json.dumps({"conversations": c}) for c in (
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
        [{"role": "user", "content": long}, {"role": "assistant", "content": "no room left for me"}],
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
         {"role": "user", "content": long}, {"role": "assistant", "content": "cut"}])) + "\n")
    result = run_cli("data", "prepare", "--kind", "sft", "--input", chats, "--tokenizer", tokenizer_dir, "--out",
                     tmp_path / "sft", "--seq-len", 48, "--val-fraction", 0)
    assert result.returncode == 0, result.stderr
    assert re.search(f"{re.escape(str(chats))}:2: too long: the first reply ends after \\d+ tokens, more than "
                     r"--seq-len 48 holds \(49: the window and its last target\)", result.stdout)  # "the limit is 49"
    assert f"{chats}:3: cut to fit --seq-len 48" in result.stdout
    report = json.loads((tmp_path / "sft" / "report.json").read_text())
    assert report["documents"]["train"] == 2 and len(report["skipped"]) == 1 and report["seq_len"] == 48
    assert report["truncated"] == [f"{chats}:3: cut to fit --seq-len 48"]
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "short", "chosen": "yes", "rejected": "no"}) + "\n"
                     + json.dumps({"prompt": long, "chosen": "yes", "rejected": "no"}) + "\n")
    result = run_cli("data", "prepare", "--kind", "dpo", "--input", pairs, "--tokenizer", tokenizer_dir, "--out",
                     tmp_path / "dpo", "--seq-len", 48, "--val-fraction", 0)
    assert result.returncode == 0, result.stderr
    assert f"truncated to fit --seq-len 48: 1 records\n  {pairs}:2: cut to fit --seq-len 48" in result.stdout


def test_samples_longer_than_data_seq_len_are_refused_naming_both_lengths(tokenizer_dir, tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "a prompt of a few words " * 4, "chosen": "yes", "rejected": "no"}) + "\n")
    prepare("dpo", [str(pairs)], tokenizer_dir, tmp_path / "dpo", val_fraction=0.0, workers=1, seq_len=512,
            show_progress=False)
    assert len(PreferencePairs(tmp_path / "dpo", "train", 512, pad_id=3)) == 1
    with pytest.raises(UserError, match=r"pairs take up to \d+ positions \(prepared with --seq-len 512\), more than "
                                        r"data.seq_len 16; set data.seq_len=512 or prepare the data again with "
                                        r"--seq-len 16"):
        PreferencePairs(tmp_path / "dpo", "train", 16, pad_id=3)
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"conversations": [{"role": "user", "content": "a question of a few words " * 4},
                                                   {"role": "assistant", "content": "yes"}]}) + "\n")
    prepare("sft", [str(chats)], tokenizer_dir, tmp_path / "sft", val_fraction=0.0, workers=1, seq_len=512,
            show_progress=False)
    with pytest.raises(UserError, match=r"conversations take up to \d+ positions \(prepared with --seq-len 512\)"):
        PackedConversations(tmp_path / "sft", "train", 16, pad_id=3)


@pytest.fixture(scope="module")
def sft_data(tokenizer_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("sft")
    prepare("sft", [str(FIXTURES / "sft")], tokenizer_dir, out, val_fraction=0.02, seq_len=512,
            workers=2, show_progress=False)
    return out


def _without_digest(h5):
    del h5.attrs[DIGEST_ATTR]  # as earlier versions prepared it


@pytest.mark.parametrize("dataset, data", [(PretrainWindows, "pretrain_data"), (PackedConversations, "sft_data")])
@pytest.mark.parametrize("digest", [True, False])
def test_a_worker_of_a_later_epoch_refuses_a_file_replaced_meanwhile(request, tmp_path, dataset, data, digest):
    """The data-loader workers of each epoch open the file again: after a `data prepare` into the folder they read
    the new file (packed samples by the old one's offsets, across conversations), without a word."""
    shutil.copytree(request.getfixturevalue(data), tmp_path / "data")
    if not digest:
        replace_tokens_file(tmp_path / "data" / TOKENS_FILE, _without_digest)
    samples = dataset(tmp_path / "data", "train", 512, pad_id=3)
    first = samples[0]
    worker = pickle.loads(pickle.dumps(samples))  # what a data-loader worker gets
    assert all((worker[0][k] == v).all() for k, v in first.items())  # the same file: read as before
    replace_tokens_file(tmp_path / "data" / TOKENS_FILE, reversed_tokens)
    assert all((samples[0][k] == v).all() for k, v in first.items())  # the handle open already: the old file
    with pytest.raises(UserError, match=f"^{tmp_path / 'data' / TOKENS_FILE} was replaced or changed after this run "
                                        "started reading it \\(a `zerollm data prepare` into .*\\?\\); a run trains on "
                                        "one version of its data: prepare new data into another folder$"):
        pickle.loads(pickle.dumps(samples))[0]


def test_a_worker_that_finds_the_file_gone_says_so_in_one_line(pretrain_data, tmp_path):
    """A 'Caught FileNotFoundError in DataLoader worker process 0' traceback."""
    shutil.copytree(pretrain_data, tmp_path / "data")
    samples = PretrainWindows(tmp_path / "data", "train", 32)
    (tmp_path / "data" / TOKENS_FILE).unlink()
    with pytest.raises(UserError, match=f"^{tmp_path / 'data' / TOKENS_FILE}: cannot open it again \\(.*\\) after "
                                        "this run started reading it \\(removed or moved\\?\\); a run reads its data "
                                        "until it ends$"):
        pickle.loads(pickle.dumps(samples))[0]


def test_packing_pads_under_ten_percent(sft_data):
    windows = PackedConversations(sft_data, "train", 512, pad_id=3)
    assert windows.padding_fraction < 0.10
    shared_window = next(i for i, w in enumerate(windows.windows) if len(w) >= 3)
    sample = windows[shared_window]
    segments = sample["segment_ids"]
    assert segments.max() == len(windows.windows[shared_window])  # several conversations share the window
    filled = segments > 0
    assert (sample["loss_mask"][~filled] == 0).all()
    assert sorted(i for w in windows.windows for i in w) == list(range(len(windows.offsets) - 1))  # each once


def test_a_samples_loss_does_not_depend_on_its_window_mates():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=97, dim=48, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)).eval()
    target = torch.randint(0, 97, (1, 9))

    def loss_of_target(mate_length: int) -> float:
        mate = torch.randint(0, 97, (1, mate_length))
        tokens = torch.cat([mate, target[:, :-1]], 1)
        targets = torch.cat([torch.zeros_like(mate), target[:, 1:]], 1)
        mask = torch.cat([torch.zeros_like(mate), torch.ones(1, 8, dtype=torch.long)], 1)
        segments = torch.cat([torch.ones_like(mate), torch.full((1, 8), 2)], 1)
        return masked_cross_entropy(model(tokens, segment_ids=segments).logits, targets, mask).item()

    alone = masked_cross_entropy(model(target[:, :-1]).logits, target[:, 1:], None).item()
    assert loss_of_target(5) == pytest.approx(alone, abs=1e-6)
    assert loss_of_target(20) == pytest.approx(alone, abs=1e-6)


def test_an_sft_step_on_packed_samples_with_dropout_trains_and_drops():
    """model.dropout > 0 with packed samples (SFT, distillation on SFT data) ended the first forward in `ValueError:
    attention: segment_ids cannot be combined with attn_mask or dropout`. Attention-weight dropout is off for packed
    rows; residual, FFN and embedding dropout apply."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=97, dim=48, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64,
                                    dropout=0.1)).train()
    tokens, targets = torch.randint(0, 97, (2, 16)), torch.randint(0, 97, (2, 16))
    segments = torch.tensor([[1] * 6 + [2] * 10, [1] * 12 + [0] * 4])
    batch = {"tokens": tokens, "targets": targets, "loss_mask": (segments > 0).long(), "segment_ids": segments}
    first = CausalLMObjective()(model, batch).loss
    first.backward()
    assert first.isfinite() and all(p.grad is not None and p.grad.isfinite().all() for p in model.parameters())
    assert CausalLMObjective()(model, batch).loss != first  # dropout is on
    model.eval()
    assert CausalLMObjective()(model, batch).loss == CausalLMObjective()(model, batch).loss


def test_preference_pairs_mask_the_replies(tokenizer_dir, tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps({"prompt": "2+2?", "chosen": "4", "rejected": "5"}) + "\n")
    prepare("dpo", [str(path)], tokenizer_dir, tmp_path / "out", val_fraction=0.0, workers=1, show_progress=False)
    pair = PreferencePairs(tmp_path / "out", "train", 32, pad_id=3)[0]
    tok = Tokenizer.load(tokenizer_dir)
    for reply, text in (("chosen", "4"), ("rejected", "5")):
        mask = pair[f"{reply}_mask"].bool()
        assert tok.decode(pair[f"{reply}_targets"][mask].tolist()) == f"{text}<|im_end|>"
        prompt_end = int(mask.nonzero()[0])
        assert tok.decode(pair[f"{reply}_tokens"][:prompt_end + 1].tolist()).endswith("<|im_start|>assistant\n")


# ---- training -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sft_train_data(tokenizer_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("sft64")
    prepare("sft", [str(FIXTURES / "sft" / "messages_zh.jsonl"), str(FIXTURES / "sft" / "alpaca_mixed.json")],
            tokenizer_dir, out, val_fraction=0.05, seq_len=64, workers=2, show_progress=False)
    return out


@pytest.fixture(scope="module")
def dpo_data(tokenizer_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("dpo")
    prepare("dpo", [str(FIXTURES / "dpo")], tokenizer_dir, out, val_fraction=0.02, seq_len=64, workers=2,
            show_progress=False)
    return out


def _stage_args(stage, data, out, init_from, *overrides, nproc=2, extra=()):
    args = train_args(data, out, "data.seq_len=64", "train.precision=fp32", "train.eval_every=2", *overrides,
                      nproc=nproc, extra=["--init-from", init_from, *extra])
    args[1] = stage
    return args


def _chain_args(kind, stage, data, out, init_from):
    """A run of the chain: `kind` (sft or dpo) under ZeRO `stage`, 4 steps on 2 ranks. The ZeRO-2 runs also save at
    step 2: test_sigkill_then_resume_is_bit_exact kills a second start of them there and resumes it."""
    steps = ["train.max_steps=4", *(["train.save_every=2"] if stage == 2 else []),
             *(["train.micro_batch_size=2", "train.lr=1e-4"] if kind == "dpo" else [])]
    return _stage_args(kind, data, out, init_from, *steps, extra=["--zero-stage", stage])


@pytest.fixture(scope="module")
def chain(zero_runs, sft_train_data, dpo_data, tmp_path_factory):
    """pretrain (ZeRO-2 run) -> sft -> dpo, under ZeRO-2 and ZeRO-3, 2 ranks each."""
    runs = {}
    for stage in (2, 3):
        sft = tmp_path_factory.mktemp(f"sft{stage}")
        result = run_job(*_chain_args("sft", stage, sft_train_data, sft, zero_runs[2]))
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
        dpo = tmp_path_factory.mktemp(f"dpo{stage}")
        result = run_job(*_chain_args("dpo", stage, dpo_data, dpo, sft))
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
        runs[stage] = {"sft": sft, "dpo": dpo}
    return runs


@pytest.mark.parametrize("stage", [2, 3])
def test_sft_then_dpo_on_two_ranks(chain, stage):
    sft_rows, dpo_rows = _metrics(chain[stage]["sft"]), _metrics(chain[stage]["dpo"])
    assert [r["step"] for r in sft_rows] == [1, 2, 3, 4] and all(math.isfinite(r["loss"]) for r in sft_rows)
    assert [r["step"] for r in dpo_rows] == [1, 2, 3, 4]
    for key in ("rewards/chosen", "rewards/rejected", "rewards/accuracy", "rewards/margin"):
        assert all(key in r for r in dpo_rows)
    assert dpo_rows[0]["loss"] == pytest.approx(math.log(2), abs=0.01)  # policy starts as the reference
    assert json.loads((chain[stage]["dpo"] / "ds_config.json").read_text())["zero_optimization"]["stage"] == stage
    # a pair is two rows (chosen and rejected) of data.seq_len: counted once, loss-bearing positions outnumbered
    # the positions, and tokens/s and MFU were half what the policy trained on
    assert [r["tokens"] for r in dpo_rows] == [step * 2 * 2 * 64 * 2 for step in (1, 2, 3, 4)]  # micro 2, 2 ranks
    assert all(r["loss_tokens_per_sec"] < r["tokens_per_sec"] for r in dpo_rows)


def test_a_dpo_resume_with_another_reference_is_refused(chain, zero_runs, dpo_data, tmp_path):
    """The reference is what --init-from holds; resumed with another (the pretrained run instead of the SFT run), DPO
    trained on against it without a word."""
    run, sft = tmp_path / "run", chain[2]["sft"]
    shutil.copytree(chain[2]["dpo"], run)
    result = run_job(*_chain_args("dpo", 2, dpo_data, run, zero_runs[2]), "--resume", "auto")
    errors = [line for line in result.stderr.splitlines() if line.startswith("zerollm: error:")]
    assert result.returncode == 2 and len(errors) == 1, result.stderr[-3000:]
    assert errors[0].startswith(f"zerollm: error: --init-from {zero_runs[2].resolve()} (run ") and \
        f"not the base {run} was trained with ({sft.resolve()}, run " in errors[0]
    assert _metrics(run) == _metrics(chain[2]["dpo"])  # nothing trained


def test_a_dpo_run_resumes_without_init_from_on_the_reference_it_records(chain, dpo_data, tmp_path):
    """docs/lora.md: without --init-from, a DPO or GRPO resume takes the base the run records; the parser required
    --init-from for them, and `--resume auto` alone was refused. A new run without it is still refused."""
    run = tmp_path / "run"
    shutil.copytree(chain[2]["dpo"], run)
    args = train_args(dpo_data, run, "data.seq_len=64", "train.precision=fp32", "train.eval_every=2",
                      "train.max_steps=5", "train.save_every=2", "train.micro_batch_size=2", "train.lr=1e-4",
                      nproc=2, extra=["--zero-stage", 2, "--resume", "auto"])
    args[1] = "dpo"
    result = run_job(*args)
    assert result.returncode == 0 and "resumed at step 4" in result.stdout, result.stderr[-3000:]
    assert [r["step"] for r in _metrics(run)] == [1, 2, 3, 4, 5] and _metrics(run)[:4] == _metrics(chain[2]["dpo"])
    args[args.index("--out") + 1] = tmp_path / "new"
    result = run_cli(*args[:args.index("--resume")])
    assert result.returncode == 2 and result.stderr == ("zerollm: error: DPO needs --init-from (the policy and the "
                                                        "frozen reference start there)\n"), result.stderr


def test_sft_starts_from_the_pretrained_weights(zero_runs, chain):
    start = consolidated_weights(zero_runs[2])
    after = consolidated_weights(chain[2]["sft"])
    drift = max((after[k] - start[k]).abs().max().item() for k in start)
    assert 0 < drift < 0.1  # moved by 4 small steps from the pretrained weights, not from a fresh init


def test_an_sft_step_is_the_same_on_one_rank_with_accumulation(zero_runs, chain, sft_train_data, tmp_path):
    """One rank with grad_accum 2 trains on the same samples as two ranks, split into micro-batches with other
    numbers of reply tokens: the loss is the mean over every reply token of the step, so both give one step."""
    result = run_job(*_stage_args("sft", sft_train_data, tmp_path, zero_runs[2], "train.max_steps=2",
                                  "train.grad_accum=2", nproc=1, extra=["--zero-stage", 2]))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    rows, reference = _metrics(tmp_path), _metrics(chain[2]["sft"])[:2]
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in reference], rel=1e-6)
    assert [r["grad_norm"] for r in rows] == pytest.approx([r["grad_norm"] for r in reference], rel=1e-5)


class _RecordingEngine:
    """A model in a DeepSpeed engine's place: backward() backpropagates what it gets, as DeepSpeed's does (which
    also divides by grad_accum), step() does nothing."""

    def __init__(self, model) -> None:
        self.model = model

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def backward(self, loss) -> None:
        loss.backward()

    def step(self) -> None:
        pass

    def is_gradient_accumulation_boundary(self) -> bool:
        return True

    def fp16_enabled(self) -> bool:
        return False


def test_an_moe_load_balancing_loss_counts_every_micro_batch_alike(one_rank_group):
    """An SFT step's reply tokens are weighed across its micro-batches; an MoE model's load-balancing loss is each
    micro-batch's own and is not: a micro-batch without reply tokens still balances its experts, and the step's
    loss is the mean over every reply token plus the mean of the micro-batches' load-balancing losses."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=97, dim=48, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64,
                                    moe=True, n_experts=4, n_experts_per_token=2, moe_aux_loss_coef=1.0))
    tokens = torch.randint(0, 97, (4, 16))
    mask = torch.zeros(4, 16)
    mask[:2, 5:] = 1  # the second micro-batch is two prompts without a reply token
    batch = {"tokens": tokens, "targets": torch.roll(tokens, -1, 1), "loss_mask": mask}
    halves = [{k: v[i:i + 2] for k, v in batch.items()} for i in (0, 2)]
    trainer = Trainer.__new__(Trainer)  # the trainer's own micro-steps, on a model without DeepSpeed
    trainer.objective, trainer.engine = CausalLMObjective(), _RecordingEngine(model)
    trainer.dist, trainer._tokens_since_log, trainer._norm_taken_here = SimpleNamespace(world_size=1), 0, False
    trainer._exact = torch.float64
    weights, _ = trainer._step_weights(halves)
    logged = sum(trainer._train_micro(half, w, w) for half, w in zip(halves, weights, strict=True))[0] / len(halves)
    router = model.layers[0].feed_forward.router.weight
    got, router.grad = router.grad / len(halves), None  # DeepSpeed's mean over the step's micro-batches

    aux = [model(half["tokens"]).aux_loss for half in halves]
    assert aux[1].item() > 0
    expected = masked_cross_entropy(model(tokens).logits, batch["targets"], mask) + sum(aux) / len(aux)
    expected.backward()
    assert torch.allclose(got, router.grad, rtol=1e-5, atol=1e-8)
    assert logged.item() == pytest.approx(expected.item(), rel=1e-6)


def test_grpo_logs_its_kl_per_completion_token_whatever_its_loss_averages(one_rank_group):
    """GRPO's `kl` and `clip_fraction` are means per completion token (docs/grpo.md). With its loss a mean over
    completions (grpo.token_mean false, the default), each micro-batch's metrics were averaged alike: a micro-batch
    of two one-token completions 1 nat off the reference weighed as much as one of two 11-token completions equal
    to it, and the logged KL was 6 times the mean per token."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=61, dim=32, n_layers=1, n_heads=2, max_seq_len=32))
    tokens = torch.randint(4, 61, (4, 12))
    mask = torch.zeros(4, 11)
    mask[:2, :] = 1  # two completions of 11 tokens, then two of one token
    mask[2:, 5] = 1
    batch = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask,
             "advantages": torch.tensor([1.0, -1.0, 0.5, -0.5])}
    with torch.no_grad():
        logps = token_logps(model(batch["tokens"]).logits, batch["targets"])
    batch["old_logps"], batch["ref_logps"] = logps, logps + (mask * torch.tensor([[0.0], [0.0], [1.0], [1.0]]))
    halves = [{k: v[i:i + 2] for k, v in batch.items()} for i in (0, 2)]
    trainer = Trainer.__new__(Trainer)
    trainer.objective, trainer.engine = GRPOObjective(GRPOConfig(kl_coef=0.1)), _RecordingEngine(model)
    trainer.dist, trainer._tokens_since_log, trainer._norm_taken_here = SimpleNamespace(world_size=1), 0, False
    trainer._exact = torch.float64
    weights, metric_weights = trainer._step_weights(halves)
    assert weights is None  # the loss: a mean over completions
    sums = sum(trainer._train_micro(half, None, w) for half, w in zip(halves, metric_weights, strict=True))
    logged = dict(zip(trainer._metric_names, (sums[1:] / len(halves)).tolist(), strict=True))
    per_token = (math.exp(1) - 1 - 1) * 2 / 24  # two of the 24 completion tokens are 1 nat off
    assert logged["kl"] == pytest.approx(per_token, rel=1e-5)
    assert logged["clip_fraction"] == 0.0


def _preference_batch():
    """A policy and another reference, a batch of three pairs, and the pairs' margins (policy minus reference log
    ratio, chosen minus rejected) and mean token NLLs of the chosen replies, computed here directly."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=97, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=32)
    policy, reference = Transformer(cfg).eval(), Transformer(cfg).eval()
    batch = {}
    for side in ("chosen", "rejected"):
        tokens = torch.randint(0, 97, (3, 16))
        mask = torch.zeros(3, 16)
        mask[:, 4:10] = 1
        batch |= {f"{side}_tokens": tokens, f"{side}_targets": torch.roll(tokens, -1, 1), f"{side}_mask": mask}

    def reply_logps(model, side):
        return (token_logps(model(batch[f"{side}_tokens"]).logits, batch[f"{side}_targets"])
                * batch[f"{side}_mask"]).sum(-1)

    with torch.no_grad():
        margin = (reply_logps(policy, "chosen") - reply_logps(reference, "chosen")) - \
            (reply_logps(policy, "rejected") - reply_logps(reference, "rejected"))
        chosen_nll = -reply_logps(policy, "chosen") / batch["chosen_mask"].sum(-1)
    assert margin.abs().max() > 0.1
    return policy, reference, batch, margin, chosen_nll


@pytest.mark.parametrize("beta", [0.1, 0.5, 2.0])
def test_the_dpo_losses_are_their_formulas_at_the_beta_given(beta):
    """No test told the losses' beta, IPO's target or the RPO term's per-token mean from others: each could change
    and every test pass."""
    policy, reference, batch, margin, chosen_nll = _preference_batch()
    with torch.no_grad():
        sigmoid = DPOObjective(reference, beta)(policy, batch).loss.item()
        ipo = DPOObjective(reference, beta, loss="ipo")(policy, batch).loss.item()
        rpo = DPOObjective(reference, beta, sft_weight=0.3)(policy, batch).loss.item()
    assert sigmoid == pytest.approx(-F.logsigmoid(beta * margin).mean().item(), rel=1e-5)
    assert ipo == pytest.approx(((margin - 1 / (2 * beta)) ** 2).mean().item(), rel=1e-5)
    assert rpo == pytest.approx((-F.logsigmoid(beta * margin).mean() + 0.3 * chosen_nll.mean()).item(), rel=1e-5)


def test_dpo_reward_accuracy_counts_no_tie_as_right():
    """The policy as its own reference: every implicit reward is 0, and no pair is ranked right yet."""
    policy, _, batch, _, _ = _preference_batch()
    with torch.no_grad():
        step = DPOObjective(policy, 0.5)(policy, batch)
    assert step.metrics["rewards/accuracy"].item() == 0.0

def test_a_dpo_validation_loss_is_the_mean_over_pairs_whatever_the_micro_batch(one_rank_group):
    """DPO's loss is a mean over pairs, but its validation loss weighed each micro-batch by its reply tokens: two runs
    that trained alike logged another val_loss for micro_batch_size 4 and 2 (0.0432 and 0.0407 for a mean of
    0.0613 over the same 16 pairs)."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=97, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=32)
    policy, reference = Transformer(cfg).eval(), Transformer(cfg).eval()
    pairs = []
    for reply in (1, 9, 3, 12, 5):  # replies of other lengths: other weights by tokens
        pair = {}
        for side in ("chosen", "rejected"):
            tokens = torch.randint(0, 97, (16,))
            mask = torch.zeros(16)
            mask[2:2 + reply] = 1
            pair |= {f"{side}_tokens": tokens, f"{side}_targets": torch.roll(tokens, -1), f"{side}_mask": mask}
        pairs.append(pair)
    objective = DPOObjective(reference, beta=0.5)
    per_pair = [objective(policy, {k: v[None] for k, v in pair.items()}).loss.item() for pair in pairs]
    assert max(per_pair) - min(per_pair) > 0.01
    for micro in (1, 2, 4):
        trainer = Trainer.__new__(Trainer)  # the trainer's own evaluation, on a model without DeepSpeed
        trainer.objective, trainer.engine, trainer.val_set = objective, policy, pairs
        trainer.cfg = SimpleNamespace(train=SimpleNamespace(micro_batch_size=micro, eval_batches=8),
                                      model=cfg, data=SimpleNamespace(path="pairs"))
        trainer.dist = SimpleNamespace(world_size=1, rank=0, device=torch.device("cpu"))
        trainer._exact = torch.float64
        assert trainer.evaluate() == pytest.approx(sum(per_pair) / len(per_pair), rel=1e-6), micro


def test_every_objective_returns_an_moe_policys_load_balancing_loss_apart():
    """SFT, DPO, GRPO and distillation each backpropagate the policy's load-balancing loss (DPO and GRPO used to
    drop it, leaving the router unbalanced), DPO and GRPO over their rows' real tokens only (not the right padding),
    and a validation loss is the cross-entropy alone."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=61, dim=32, n_layers=1, n_heads=2, max_seq_len=32, moe=True, n_experts=4,
                      n_experts_per_token=2, moe_aux_loss_coef=1.0)
    policy, other = Transformer(cfg), Transformer(cfg)
    tokens = torch.randint(0, 61, (4, 9))
    mask = torch.ones(4, 9)
    padded = mask.clone()
    padded[1::2, 5:] = 0  # rows 1 and 3 end after 5 targets, then right padding
    lm = {"tokens": tokens, "targets": torch.roll(tokens, -1, 1), "loss_mask": mask}
    pairs = {f"{side}_{k}": v[i:i + 2] for side, i in (("chosen", 0), ("rejected", 2))
             for k, v in (("tokens", tokens), ("targets", lm["targets"]), ("mask", padded))}
    rollouts = {"tokens": tokens, "targets": lm["targets"], "mask": padded, "advantages": torch.tensor([1., -1, 1, -1])}
    objectives = [(CausalLMObjective(), lm), (DPOObjective(other, beta=0.1), pairs),
                  (GRPOObjective(GRPOConfig(kl_coef=0.0)), rollouts), (DistillObjective(other, 0.5, 2.0), lm)]
    aux, aux_of_real = policy(tokens).aux_loss.item(), policy(tokens, token_mask=padded).aux_loss.item()
    assert aux_of_real != pytest.approx(aux)  # the padding would change it
    with_aux = [objective(policy, dict(batch)) for objective, batch in objectives]
    for layer in policy.layers:
        layer.feed_forward.aux_loss_coef = 0.0  # the same policy without a load-balancing loss
    for (objective, batch), micro in zip(objectives, with_aux, strict=True):
        expected = aux_of_real if "mask" in batch or "chosen_mask" in batch else aux
        assert micro.aux.item() == pytest.approx(expected), objective  # returned apart...
        assert micro.loss.item() == objective(policy, dict(batch)).loss.item(), objective  # ...and not in the loss
    policy.eval()
    cross_entropy = masked_cross_entropy(policy(tokens).logits, lm["targets"], mask).item()
    for objective in (CausalLMObjective(), DistillObjective(other, 0.5, 2.0)):
        assert objective(policy, lm).loss.item() == pytest.approx(cross_entropy, rel=1e-6), objective


def test_init_from_a_different_shape_is_refused(zero_runs, sft_train_data, tmp_path):
    result = run_job(*_stage_args("sft", sft_train_data, tmp_path, zero_runs[2], "model.dim=96", "train.max_steps=1",
                                  nproc=1))
    assert result.returncode == 2 and "model.dim 64 there, 96 here" in result.stderr


def test_dpo_needs_init_from(dpo_data, tmp_path):
    result = run_cli("train", "dpo", "--recipe", "demo", "--data", dpo_data, "--out", tmp_path)
    assert result.returncode == 2 and "--init-from" in result.stderr


def test_a_bf16_dpo_run_prints_deepspeeds_warnings_but_not_its_memory_reports(zero_runs, dpo_data, tmp_path):
    """A bf16 engine without ZeRO (the DPO and GRPO reference under every stage but 3, the policy too under ZeRO 0)
    printed DeepSpeed's BF16_Optimizer memory reports, six lines ahead of the run's own first one. DeepSpeed's warnings
    (here of the JSON's vocabulary_size) still come."""
    raw, _ = load_ds_config(None, "dpo")
    (tmp_path / "ds.json").write_text(json.dumps({**raw, "vocabulary_size": 510}))
    result = run_job(*_stage_args("dpo", dpo_data, tmp_path / "run", zero_runs[2], "train.max_steps=1",
                                  "train.precision=bf16", "train.micro_batch_size=2", "train.eval_every=0", nproc=1,
                                  extra=["--zero-stage", 0, "--deepspeed", tmp_path / "ds.json"]))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    warnings = [line for line in lines if "[WARNING]" in line]
    assert warnings and all("vocabulary size 510 is not aligned to 8" in line for line in warnings), lines[:10]
    assert lines[len(warnings)].startswith("dpo: "), lines[:10]  # the warnings, then the run's first line
    for report in ("bf16_optimizer", "Max_MA", "CPU Virtual Memory"):
        assert report not in result.stdout + result.stderr


@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_sigkill_then_resume_is_bit_exact(kind, chain, zero_runs, sft_train_data, dpo_data, tmp_path):
    """The chain's ZeRO-2 run of `kind` (4 steps on 2 ranks, saved at steps 2 and 4), started again, SIGKILLed once
    its step-2 checkpoint is written and resumed, repeats the uninterrupted run bit for bit."""
    data, init = (sft_train_data, zero_runs[2]) if kind == "sft" else (dpo_data, chain[2]["sft"])
    straight, killed = chain[2][kind], tmp_path / "killed"
    args = _chain_args(kind, 2, data, killed, init)
    latest = killed / "checkpoints" / "latest"
    kill_when(lambda: latest.is_file() and latest.read_text() == "global_step2", *args)
    result = run_job(*args, "--resume", "auto", name="resumed")
    assert result.returncode == 0, result.stderr[-3000:]
    a, b = _metrics(straight), _metrics(killed)
    assert [r["step"] for r in b] == list(range(1, 5))
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    wa, wb = consolidated_weights(straight), consolidated_weights(killed)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_dpo_sanity_loss_starts_at_ln2_and_accuracy_rises(zero_runs, tokenizer_dir, tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    rows = [{"prompt": f"{a} plus {b}?", "chosen": f"{a + b}", "rejected": f"{a + b + 7}"}
            for a in range(4) for b in range(4)]
    pairs.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    prepare("dpo", [str(pairs)], tokenizer_dir, tmp_path / "data", val_fraction=0.0, seq_len=32, workers=1,
            show_progress=False)
    result = run_job(*_stage_args("dpo", tmp_path / "data", tmp_path / "run", zero_runs[2], "data.seq_len=32",
                                  "train.max_steps=15", "train.micro_batch_size=8", "train.lr=3e-3",
                                  "train.warmup_steps=1", "train.eval_every=0", "train.dpo_beta=0.5", nproc=1))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = _metrics(tmp_path / "run")
    assert rows[0]["loss"] == pytest.approx(math.log(2), abs=0.01)
    assert max(r["rewards/accuracy"] for r in rows[-5:]) > 0.9
    assert rows[-1]["loss"] < rows[0]["loss"]


def test_data_of_a_larger_vocabulary_than_the_init_from_model_names_the_model(sft_data, tokenizer_dir, tmp_path):
    """It advised `set model.vocab_size >= 512`, which the next run refused: the model of --init-from sets it."""
    from llm.config import build_config
    from llm.export import export_model

    small = tmp_path / "small"
    export_model(Transformer(build_config("demo", ["model.vocab_size=256", "model.dim=64", "model.n_layers=1",
                                                   "model.n_heads=4"]).model), tokenizer_dir, small)
    result = run_cli("train", "sft", "--recipe", "demo", "--data", sft_data, "--init-from", small, "--out",
                     tmp_path / "run", "--set", "train.max_steps=1")
    assert result.returncode == 2 and result.stderr == (
        f"zerollm: error: {sft_data}: its tokenizer has 512 tokens, more than the 256 of --init-from {small}'s model; "
        "prepare the data with that model's tokenizer\n"), result.stderr[-2000:]


def test_a_resume_whose_recorded_base_was_moved_says_so(tmp_path, monkeypatch, capsys):
    """Resumed without --init-from after its base was moved, a DPO run was refused as if the base's old path were
    an export without weights ('no model.safetensors ... beside config.json'), naming no remedy."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(f"train:\n  stage: dpo\n  init_from: {tmp_path / 'gone'}\n")
    args = ["train", "dpo", "--recipe", "demo", "--data", tmp_path, "--out", run, "--resume", "auto"]
    assert zerollm_here(monkeypatch, *args) == 2
    assert capsys.readouterr().err == (f"zerollm: error: {run} records its base model (train.init_from) as "
                                       f"{tmp_path / 'gone'}, which is not there any more; if it was moved, resume "
                                       "with --init-from naming its new place\n")


def test_packed_sft_windows_mask_exactly_the_targets_the_prepared_mask_marks(tokenizer_dir, tmp_path):
    """A packed window's loss mask is the prepared mask of each target (token i + 1): the replies and their
    end-of-turn tokens are learnt, nothing before them (a mask shifted by one passed every test)."""
    prepare("sft", [str(FIXTURES / "sft" / "messages_zh.jsonl")], tokenizer_dir, tmp_path / "sft", val_fraction=0.0,
            seq_len=512, workers=1, show_progress=False)
    windows = PackedConversations(tmp_path / "sft", "train", 512, pad_id=3)
    with h5py.File(tmp_path / "sft" / TOKENS_FILE) as h5:
        tokens, mask, offsets = (h5["train"][key][:] for key in ("tokens", "loss_mask", "doc_offsets"))
    im_end = Tokenizer.load(tokenizer_dir).im_end_id
    for index in range(min(3, len(windows))):
        sample, position = windows[index], 0
        for packed in windows.windows[index]:
            start, end = offsets[packed], offsets[packed + 1]
            positions = slice(position, position + end - start - 1)
            assert sample["targets"][positions].tolist() == tokens[start + 1:end].tolist()
            assert sample["loss_mask"][positions].tolist() == mask[start + 1:end].tolist()
            assert sample["targets"][positions][sample["loss_mask"][positions].bool()][-1].item() == im_end
            position = positions.stop


def test_a_conversation_of_exactly_seq_len_positions_fits_a_window(tokenizer_dir, tmp_path):
    """A conversation of n tokens takes n - 1 positions: one of data.seq_len + 1 tokens fills a window alone."""
    prepare("sft", [str(FIXTURES / "sft" / "messages_zh.jsonl")], tokenizer_dir, tmp_path / "sft", val_fraction=0.0,
            seq_len=512, workers=1, show_progress=False)
    with h5py.File(tmp_path / "sft" / TOKENS_FILE) as h5:
        offsets = h5["train"]["doc_offsets"][:]
    longest = int((offsets[1:] - offsets[:-1]).max())
    windows = PackedConversations(tmp_path / "sft", "train", longest - 1, pad_id=3)
    full = next(w for w in windows.windows if any(offsets[i + 1] - offsets[i] == longest for i in w))
    assert len(full) == 1


def _evaluating_trainer(model, val_set, micro, world=1, rank=0):
    """The trainer's own evaluation of `val_set`, on a model without DeepSpeed."""
    trainer = Trainer.__new__(Trainer)
    trainer.objective, trainer.engine, trainer.val_set = CausalLMObjective(), model, val_set
    trainer.cfg = SimpleNamespace(train=SimpleNamespace(micro_batch_size=micro, eval_batches=1), model=model.cfg,
                                  data=SimpleNamespace(path="val"))
    trainer.dist = SimpleNamespace(world_size=world, rank=rank, device=torch.device("cpu"))
    trainer._exact = torch.float64
    return trainer


def test_validation_runs_the_model_in_eval_mode(one_rank_group):
    """With model.dropout (or distillation, whose objective leaves the teacher out only in eval mode) the validation
    loss is the eval-mode model's, which no test told from a training-mode one."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=97, dim=32, n_layers=1, n_heads=4, max_seq_len=32, dropout=0.5)).train()
    rows = torch.randint(0, 97, (4, 17))
    got = _evaluating_trainer(model, [{"tokens": r[:-1], "targets": r[1:]} for r in rows], micro=4).evaluate()
    with torch.no_grad():
        expected = masked_cross_entropy(model.eval()(rows[:, :-1]).logits, rows[:, 1:], None).item()
    assert got == pytest.approx(expected, rel=1e-6)


def test_each_rank_evaluates_its_own_share_of_the_val_samples(one_rank_group):
    class Recorded(list):
        read: list[int] = []

        def __getitem__(self, index):
            self.read.append(index)
            return super().__getitem__(index)

    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=97, dim=32, n_layers=1, n_heads=4, max_seq_len=32)).eval()
    rows = torch.randint(0, 97, (8, 17))
    val_set = Recorded([{"tokens": r[:-1], "targets": r[1:]} for r in rows])
    _evaluating_trainer(model, val_set, micro=2, world=2, rank=1).evaluate()  # its sums reduced over a group of 1
    assert val_set.read == [1, 3]


# ---- record shapes a fourth mutation audit found unpinned ----------------------------------------------------------

@pytest.mark.parametrize("record, refusal", [
    ({"prompt": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "earlier"}], "chosen": "a",
      "rejected": "b"}, "the prompt must end with a user or tool turn"),  # an assistant turn last: whose reply?
    ({"prompt": "q", "chosen": "a", "rejected": {"role": "assistant", "content": "b", "weight": 0}},
     "'rejected' has weight 0 (not to learn), yet a preference pair learns from both replies"),
])
def test_a_pair_the_replies_cannot_be_compared_on_is_refused(record, refusal):
    with pytest.raises(RecordError, match=re.escape(refusal)):
        preference(record)


def test_an_empty_reply_before_the_last_is_refused_as_the_last_one_is():
    with pytest.raises(RecordError, match="empty assistant reply"):
        conversation({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": " "},
                                   {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a"}]})


def test_a_turn_with_tool_calls_and_an_openai_function_call_keeps_both():
    from llm.data.formats import message

    turn = message({"role": "assistant", "content": "", "tool_calls": [{"name": "f", "arguments": {}}],
                    "function_call": {"name": "g", "arguments": "{}"}})
    assert [call["name"] for call in turn["tool_calls"]] == ["f", "g"]
