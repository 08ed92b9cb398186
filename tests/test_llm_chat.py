"""`LLM.chat` as vLLM users call it, and vLLM's prompt dicts in `LLM.generate`: each
conversation through the chat template, tokenized as transformers' `apply_chat_template` does
(no second BOS), answered as transformers' greedy decoding of those ids."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from omniinfer import LLM, SamplingParams
from omniinfer.testing.tiny_models import build_tiny_checkpoint

# Llama 2's shape: the template writes the BOS, and the tokenizer adds one too when asked
TEMPLATE = (
    "{{ bos_token }}{% if tools %}[TOOLS]{{ tools | map(attribute='function.name') | join(',') }}"
    "[/TOOLS]{% endif %}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}[CALL]{{ c['function']['name'] }}"
    "{{ c['function']['arguments'] | tojson }}{% endfor %}"
    "{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Return the number of items"}]
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    path = build_tiny_checkpoint(str(tmp_path_factory.mktemp("chat") / "llama"), "llama",
                                 tokenizer="sentencepiece")
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llm(path):
    return LLM(path, num_kv_blocks=64, block_size=8, max_num_seqs=8)


@pytest.fixture(scope="module")
def reference(path):
    return AutoTokenizer.from_pretrained(path)


def test_chat_tokenizes_as_transformers_and_decodes_as_its_greedy(llm, path, reference, hf_greedy):
    assert reference("x").input_ids[0] == reference.bos_token_id  # (this tokenizer adds a BOS)
    [out] = llm.chat(CHAT, GREEDY, use_tqdm=False)
    expected = reference.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True,
                                             return_dict=False)
    assert out.prompt_token_ids == expected
    assert out.prompt_token_ids.count(reference.bos_token_id) == 1
    assert out.prompt == reference.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert out.outputs[0].token_ids == hf_greedy(path, expected, 6)


def test_a_list_of_conversations_answers_each_in_order(llm, reference):
    conversations = [CHAT, [{"role": "user", "content": "Hi"}], CHAT[1:]]
    outs = llm.chat(conversations, [GREEDY, GREEDY, SamplingParams(temperature=0, max_tokens=2)],
                    use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [
        reference.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False)
        for c in conversations]
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6, 2]
    assert outs[0].outputs[0].token_ids == llm.chat(CHAT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_template_arguments_reach_the_template(llm, reference):
    history = [*CHAT, {"role": "assistant", "content": "There are",
                       "tool_calls": [{"id": "c1", "type": "function",
                                       "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}}]}]
    [out] = llm.chat(history, GREEDY, use_tqdm=False, tools=TOOLS)
    # transformers given the arguments as an object, as the templates expect (vLLM does the same)
    as_object = [*history[:-1], {**history[-1], "tool_calls": [
        {**history[-1]["tool_calls"][0], "function": {"name": "get_time", "arguments": {"tz": "UTC"}}}]}]
    expected = reference.apply_chat_template(as_object, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert out.prompt == expected
    assert out.prompt.startswith("<s>[TOOLS]get_time[/TOOLS]<|system|>Be brief.\n")
    assert out.prompt.endswith('There are[CALL]get_time{"tz": "UTC"}\n<|assistant|>')
    assert history[-1]["tool_calls"][0]["function"]["arguments"] == '{"tz": "UTC"}'  # (not changed)

    prefix = [*CHAT, {"role": "assistant", "content": "There are"}]
    [out] = llm.chat(prefix, GREEDY, use_tqdm=False, add_generation_prompt=False,
                     continue_final_message=True)
    assert out.prompt == reference.apply_chat_template(prefix, add_generation_prompt=False,
                                                       continue_final_message=True, tokenize=False)
    assert out.prompt.endswith("<|assistant|>There are")

    [out] = llm.chat(CHAT, GREEDY, use_tqdm=False, chat_template="{{ messages[-1]['content'] }}!",
                     chat_template_kwargs={"unused": 1})
    assert out.prompt == "Return the number of items!"
    assert out.prompt_token_ids == reference("Return the number of items!", add_special_tokens=False).input_ids


def test_text_parts_are_joined_by_newlines_as_vllm_does(llm):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Return the"},
                                          {"type": "text", "text": "number"}]}]
    [out] = llm.chat(parts, GREEDY, use_tqdm=False, chat_template="{{ messages[0]['content'] }}")
    assert out.prompt == "Return the\nnumber"


@pytest.mark.parametrize("messages, kwargs, error, match", [
    ("hi", {}, TypeError, r"messages must be a non-empty list of messages .* got 'hi'"),
    ([], {}, TypeError, r"messages must be a non-empty list"),
    ([CHAT, "x"], {}, TypeError, r"messages\[1\] must be a conversation \(a list of messages\) as "
                                     r"messages\[0\] is, got str"),
    ([CHAT, [{"content": "x"}]], {}, ValueError, r"messages\[1\]\[0\]\['role'\]=None is not allowed"),
    ([{"role": "user", "content": 5}], {}, TypeError, r"messages\[0\]\['content'\] must be a string or a "
                                                      r"list of text parts, got int"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], {}, ValueError,
     r"messages\[0\]\['content'\]\[0\] is a content part of type 'image_url'; only"),
    (CHAT, {"continue_final_message": True}, ValueError,
     "conversation 0: continue_final_message and add_generation_prompt cannot both be true"),
    (CHAT, {"chat_template": "{{ raise_exception('no system role') }}"}, ValueError,
     "conversation 0: the chat template could not render these messages: .*no system role"),
    (CHAT, {"chat_template": "{% if false %}x{% endif %}"}, ValueError,
     "conversation 0 renders to no tokens"),
    ([CHAT, [{"role": "user", "content": "bad \ud800"}]], {}, ValueError,
     r"conversation 1: messages holds invalid Unicode at character \d+ \('\\ud800', a lone surrogate\)"),
])
def test_bad_conversations_are_clear_errors_and_nothing_runs(llm, messages, kwargs, error, match):
    with pytest.raises(error, match=match):
        llm.chat(messages, GREEDY, use_tqdm=False, **kwargs)
    assert not llm.llm_engine.has_unfinished_requests()


def test_a_model_without_a_chat_template_says_what_to_pass(checkpoint_dir):
    llm = LLM(checkpoint_dir("llama"), num_kv_blocks=16, block_size=8)
    assert not llm.get_tokenizer().chat_template
    with pytest.raises(ValueError, match="no chat template; pass chat_template"):
        llm.chat(CHAT, GREEDY, use_tqdm=False)
    [out] = llm.chat(CHAT, GREEDY, use_tqdm=False, chat_template=TEMPLATE)
    assert out.prompt.startswith("<s><|system|>Be brief.\n")


def test_generate_takes_vllms_text_and_token_prompt_dicts(llm):
    text = "Return the number"
    plain = llm.generate(text, GREEDY, use_tqdm=False)[0]
    [as_dict, both] = llm.generate([{"prompt": text},
                                    {"prompt": "what outputs report", "prompt_token_ids": plain.prompt_token_ids}],
                                   GREEDY, use_tqdm=False)
    assert as_dict.prompt == text and as_dict.prompt_token_ids == plain.prompt_token_ids
    assert as_dict.outputs[0].token_ids == plain.outputs[0].token_ids == both.outputs[0].token_ids
    assert both.prompt == "what outputs report"
    with pytest.raises(ValueError, match=r"prompts\[1\]: prompt holds the key\(s\) 'multi_modal_data'; "
                                         r"allowed: 'prompt' \(text\) and 'prompt_token_ids'"):
        llm.generate([text, {"prompt": text, "multi_modal_data": {"image": None}}], GREEDY, use_tqdm=False)
    with pytest.raises(TypeError, match=r"prompts\[0\]: prompt\['prompt'\] must be a string, got int"):
        llm.generate({"prompt": 5}, GREEDY, use_tqdm=False)
    with pytest.raises(TypeError, match=r"prompt must be a string, .* got dict without either key"):
        llm.generate({}, GREEDY, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


NAMED = {"default": "{% for m in messages %}D:{{ m['content'] }}\n{% endfor %}",
         "tool_use": "{% for m in messages %}T({{ tools | length }}):{{ m['content'] }}\n{% endfor %}"}


@pytest.fixture(scope="module")
def named_templates(checkpoint_dir, tmp_path_factory):
    """A checkpoint whose tokenizer holds named chat templates (Hermes 2 Pro's, Command R's),
    saved by transformers (chat_template.jinja, additional_chat_templates/), and as a GGUF file."""
    import shutil

    from omniinfer.benchmarks.gguf_export import export

    path = str(tmp_path_factory.mktemp("named") / "m")
    shutil.copytree(checkpoint_dir("llama"), path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = dict(NAMED)
    tokenizer.save_pretrained(path)
    return path, export(path, path + ".gguf", "f32")


def test_named_chat_templates_are_picked_as_transformers_picks_them(named_templates):
    """'default', or 'tool_use' when tools are given: the whole dict was passed on as the
    template, and every chat request failed ("unhashable type: 'dict'")."""
    path, gguf = named_templates
    reference = AutoTokenizer.from_pretrained(path)
    assert reference.chat_template == NAMED
    user = [{"role": "user", "content": "hi"}]
    for model in (path, gguf):
        llm = LLM(model, num_kv_blocks=16, block_size=8)
        assert llm.get_tokenizer().chat_template == NAMED
        for tools in (None, TOOLS):
            [out] = llm.chat(user, GREEDY, use_tqdm=False, tools=tools, add_generation_prompt=False)
            assert out.prompt == reference.apply_chat_template(user, tools=tools, tokenize=False)
            assert out.prompt == ("T(1):hi\n" if tools else "D:hi\n")
        llm.shutdown()


def test_the_server_picks_named_templates_too(named_templates):
    from test_openai_server import make_engine

    from omniinfer.entrypoints.openai.api_server import ServerState

    state = ServerState("tiny", stats_interval_s=0)
    state.attach(make_engine(named_templates[0]))
    try:
        for kwargs, expected in (({"tools": TOOLS}, "T(1):hi\n"), (None, "D:hi\n")):
            text = state.ctx.render_chat([{"role": "user", "content": "hi"}], add_generation_prompt=False,
                                         continue_final_message=False, kwargs=kwargs)
            assert text == expected
    finally:
        state.shutdown()
