"""Structured outputs in the engine (the Python API) on the shipped demo model: every output
parses and validates (jsonschema, which nobody here wrote) against its schema, and the grammar
holds through chunked prefill, prefix caching, n > 1, multi-step decoding, speculative decoding
and preemption, where greedy outputs must equal those of a plain engine."""

from __future__ import annotations

import json
import random
import re

import pytest

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

from omniinfer import LLM, SamplingParams  # noqa: E402
from omniinfer.entrypoints.cli_generate import DEMO_MODEL  # noqa: E402
from omniinfer.structured.params import GuidedDecodingParams, StructuredOutputsParams  # noqa: E402
from omniinfer.testing.schemas import random_schema  # noqa: E402

DRAFT = DEMO_MODEL.replace("model", "draft")
PROMPTS = ["Once upon a time", "The answer is", "def main():", "Hello"]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "n", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}}}


@pytest.fixture(scope="module")
def llm():
    engine = LLM(DEMO_MODEL, num_kv_blocks=256, block_size=16)
    yield engine
    engine.shutdown()


def _validated(text: str, schema: dict):
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


def test_fifty_random_schemas_all_validate(llm):
    rng = random.Random(20)
    schemas = [random_schema(rng) for _ in range(60)]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=400,
                             structured_outputs=StructuredOutputsParams(json=s))
              for i, s in enumerate(schemas)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(schemas))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    kinds = set()
    for schema, out in zip(schemas, outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (schema, c.text)
        _validated(c.text, schema)
        kinds |= {v.get("type", "enum") for v in schema["properties"].values()}
    assert {"object", "array", "integer", "number", "string", "boolean", "enum"} <= kinds
    # unconstrained, the same model writes no JSON at all: the grammar did the work
    plain = llm.generate(prompts[:8], SamplingParams(temperature=1.0, seed=0, max_tokens=40),
                         use_tqdm=False)
    assert not any(o.outputs[0].text.lstrip().startswith("{") for o in plain)


def test_regex_choice_grammar_and_json_object(llm):
    cases = [({"regex": r"[A-Z]{3}-[0-9]{4}"}, lambda t: re.fullmatch(r"[A-Z]{3}-[0-9]{4}", t)),
             ({"choice": ["yes", "no", "maybe not"]}, lambda t: t in ("yes", "no", "maybe not")),
             ({"grammar": 'root ::= "(" [0-9]+ ("+" [0-9]+)* ")"'},
              lambda t: re.fullmatch(r"\([0-9]+(\+[0-9]+)*\)", t)),
             ({"json_object": True}, lambda t: isinstance(json.loads(t), dict))]
    for spec, ok in cases:
        for seed in range(3):
            # (room for a long JSON string: the demo model's run to 153 tokens for seed 2)
            out = llm.generate("x", SamplingParams(temperature=1.0, seed=seed, max_tokens=400,
                                                   structured_outputs=spec), use_tqdm=False)
            c = out[0].outputs[0]
            assert c.finish_reason == "stop" and ok(c.text), (spec, c.text)
    # vLLM's older name and a dict both work
    old = SamplingParams(max_tokens=20, guided_decoding=GuidedDecodingParams(choice=["a", "b"]))
    assert old.structured_outputs.choice == ["a", "b"]
    assert llm.generate("x", old, use_tqdm=False)[0].outputs[0].text in ("a", "b")


def test_n_prefix_caching_and_chunked_prefill():
    long_prompt = "Once upon a time " * 40
    llm = LLM(DEMO_MODEL, num_kv_blocks=256, block_size=16, enable_prefix_caching=True,
              max_num_batched_tokens=48, max_num_seqs=8)
    try:
        params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=200,
                                structured_outputs={"json": SCHEMA})
        first = llm.generate([long_prompt], params, use_tqdm=False)[0]
        again = llm.generate([long_prompt], params, use_tqdm=False)[0]  # from the prefix cache
        assert [c.text for c in first.outputs] == [c.text for c in again.outputs]
        assert len({c.text for c in first.outputs}) > 1  # n different samples
        for c in first.outputs:
            _validated(c.text, SCHEMA)
    finally:
        llm.shutdown()


def _greedy_texts(llm, schema=SCHEMA):
    params = SamplingParams(temperature=0, max_tokens=80, structured_outputs={"json": schema})
    return [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_multi_step_speculative_and_preempted_engines_write_the_same_greedy_json(llm):
    single = LLM(DEMO_MODEL, num_kv_blocks=256, block_size=16, num_scheduler_steps=1)
    try:
        reference = _greedy_texts(single)
    finally:
        single.shutdown()
    for text in reference:
        _validated(text, SCHEMA)
    assert _greedy_texts(llm) == reference  # the offline default: 8 decode steps at a time
    spec = LLM(DEMO_MODEL, num_kv_blocks=256, block_size=16, speculative_model=DRAFT,
               num_speculative_tokens=3)
    try:
        assert _greedy_texts(spec) == reference
        sampled = spec.generate(PROMPTS * 2, [SamplingParams(
            temperature=1.0, seed=i, max_tokens=200, structured_outputs={"json": SCHEMA})
            for i in range(8)], use_tqdm=False)
        for o in sampled:  # rejection sampling: drafts outside the grammar never survive
            _validated(o.outputs[0].text, SCHEMA)
        stats = spec.llm_engine.stats()  # drafts were made, and some kept (the rollback path)
        assert stats["num_spec_proposed_tokens"] > stats["num_spec_accepted_tokens"] > 0
    finally:
        spec.shutdown()
    # so few blocks that sequences are preempted and recomputed mid-object
    tight = LLM(DEMO_MODEL, num_kv_blocks=16, block_size=8, max_num_seqs=4,
                num_scheduler_steps=1)
    try:
        assert _greedy_texts(tight) == reference
        assert tight.llm_engine.scheduler.num_preemptions > 0
    finally:
        tight.shutdown()


@pytest.mark.parametrize("spec, message", [
    ({"json": {"type": "strng"}}, "invalid JSON schema"),
    ({"regex": "[a-"}, "regex does not compile"),
    ({"grammar": "root ::= undefined_rule"}, "grammar does not compile"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"choice": []}, "choice"),
    ({"json": {"type": "object"}, "regex": "a"}, "exactly one"),
    ({"jsn": {}}, "unknown fields"),
])
def test_bad_constraints_say_what_is_wrong(llm, spec, message):
    with pytest.raises((ValueError, TypeError), match=message):
        llm.generate("x", SamplingParams(structured_outputs=spec), use_tqdm=False)
