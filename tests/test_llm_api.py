"""The Python API end to end: text, stops, n > 1, seeds, aborts, errors and stats."""

from __future__ import annotations

import pytest

from omniinfer import LLM, CompletionOutput, RequestOutput, SamplingParams


@pytest.fixture(scope="module")
def llm(checkpoint_dir):
    return LLM(checkpoint_dir("llama"), num_kv_blocks=96, block_size=8, max_num_batched_tokens=64,
               max_num_seqs=16)


def drain(engine):
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
    return outputs


def assert_no_leak(engine):
    stats = engine.stats()
    assert stats["num_free_kv_blocks"] == stats["num_total_kv_blocks"]
    assert stats["num_running"] == stats["num_waiting"] == stats["num_swapped"] == 0


def test_string_prompts_and_output_fields(llm):
    tok = llm.get_tokenizer()
    outs = llm.generate(["The quick brown fox", "Return the number"],
                        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert [o.prompt for o in outs] == ["The quick brown fox", "Return the number"]
    for out in outs:
        assert isinstance(out, RequestOutput) and out.finished
        assert out.prompt_token_ids == tok("".join(out.prompt)).input_ids
        (c,) = out.outputs
        assert isinstance(c, CompletionOutput) and c.index == 0
        assert len(c.token_ids) == 10 and c.finish_reason == "length" and c.stop_reason is None
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
        assert c.cumulative_logprob is None and c.logprobs is None


def test_single_prompt_and_token_ids(llm):
    out = llm.generate({"prompt_token_ids": [3, 4, 5]}, SamplingParams(max_tokens=2, ignore_eos=True),
                       use_tqdm=False)
    assert len(out) == 1 and out[0].prompt is None and len(out[0].outputs[0].token_ids) == 2


def test_stop_strings_are_cut_and_reported(llm):
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    full = llm.generate("The quick", greedy, use_tqdm=False)[0].outputs[0]
    stop = full.text[5:8]
    assert stop.strip(), "need a non-blank stop string from the greedy text"
    cut = llm.generate("The quick", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                   stop=[stop]), use_tqdm=False)[0].outputs[0]
    index = full.text.find(stop)
    assert cut.text == full.text[:index]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    kept = llm.generate("The quick", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                    stop=stop, include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == full.text[:index + len(stop)]


def test_stop_token_ids_eos_and_min_tokens(llm):
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    full = llm.generate({"prompt_token_ids": [7, 8, 9]}, greedy, use_tqdm=False)[0].outputs[0].token_ids
    target = full[4]
    first = full.index(target)
    out = llm.generate({"prompt_token_ids": [7, 8, 9]},
                       SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[target]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == full[:first + 1]  # the stop token is kept in token_ids
    assert out.finish_reason == "stop" and out.stop_reason == target
    # the same token as EOS stops too (stop_reason None), unless ignore_eos
    engine = llm.llm_engine
    saved = engine.eos_token_ids
    engine.eos_token_ids = [target]
    try:
        out = llm.generate({"prompt_token_ids": [7, 8, 9]}, SamplingParams(temperature=0, max_tokens=12),
                           use_tqdm=False)[0].outputs[0]
        assert out.token_ids == full[:first + 1] and out.stop_reason is None
        # min_tokens forbids stopping (and sampling the stop token) before it is reached
        out = llm.generate({"prompt_token_ids": [7, 8, 9]},
                           SamplingParams(temperature=0, max_tokens=12, min_tokens=first + 2),
                           use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) >= first + 2
        assert target not in out.token_ids[:first + 2]
    finally:
        engine.eos_token_ids = saved


def test_n_samples_share_prompt_blocks(llm):
    engine = llm.llm_engine
    prompt = {"prompt_token_ids": list(range(3, 23))}  # 20 tokens: 2 full blocks of 8 + 4
    engine.add_request("fork", prompt, SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=6,
                                                      ignore_eos=True))
    engine.step()  # prefill; samples 4 tokens and forks
    group = engine.groups["fork"]
    assert len(group.seqs) == 4
    tables = [engine.scheduler.blocks.tables[s.seq_id] for s in group.seqs]
    assert all(t[:2] == tables[0][:2] for t in tables)  # full prompt blocks shared
    assert engine.scheduler.blocks.pool.ref_counts[tables[0][0]] == 4
    out = drain(engine)["fork"]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 6 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # independent samples
    again = llm.generate(prompt, SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=6,
                                                ignore_eos=True), use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    assert_no_leak(engine)


def test_seeded_request_is_independent_of_the_batch(llm):
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    prompt = {"prompt_token_ids": [11, 12, 13, 14]}
    alone = llm.generate(prompt, seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 17, 9, 30)]
    mixed = llm.generate(others[:2] + [prompt] + others[2:],
                         [SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True),
                          SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), seeded,
                          SamplingParams(temperature=0.5, seed=9, max_tokens=8, ignore_eos=True),
                          SamplingParams(temperature=1.0, top_k=5, max_tokens=12, ignore_eos=True)],
                         use_tqdm=False)
    assert mixed[2].outputs[0].token_ids == alone


def test_seeded_sampling_survives_preemption(checkpoint_dir):
    path = checkpoint_dir("llama")
    seeded = [SamplingParams(temperature=1.0, seed=s, max_tokens=20, ignore_eos=True) for s in range(6)]
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (9, 17, 12, 20, 7, 15)]
    roomy = LLM(path, num_kv_blocks=128, block_size=8)
    tight = LLM(path, num_kv_blocks=12, block_size=8)
    a = roomy.generate(prompts, seeded, use_tqdm=False)
    b = tight.generate(prompts, seeded, use_tqdm=False)
    assert tight.llm_engine.stats()["num_preemptions"] > 0
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


def test_abort_at_any_point_frees_everything(llm):
    engine = llm.llm_engine
    for when in range(5):
        engine.add_request("victim", {"prompt_token_ids": list(range(3, 40))},
                           SamplingParams(max_tokens=8, n=2, ignore_eos=True))
        engine.add_request("other", {"prompt_token_ids": [4, 5, 6]},
                           SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        for _ in range(when):
            engine.step()
        engine.abort_request("victim")
        engine.abort_request("victim")  # twice: no-op
        engine.abort_request("never-existed")
        outputs = drain(engine)
        assert "victim" not in outputs or not outputs["victim"].finished or when > 0
        if "other" in outputs:
            assert len(outputs["other"].outputs[0].token_ids) == 6
        assert_no_leak(engine)


def test_request_that_can_never_fit_is_refused(checkpoint_dir):
    """More KV blocks than exist: refused when added, naming what to lower (the prompt when it
    alone is too big, else max_tokens), and nothing starts."""
    llm = LLM(checkpoint_dir("llama"), num_kv_blocks=4, block_size=8)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with pytest.raises(ValueError, match=r"prompts\[0\]: prompt has 37 tokens: .*needs up to 5 "
                       r"KV-cache blocks .*only 4 blocks"):
        llm.generate([{"prompt_token_ids": list(range(3, 40))}, {"prompt_token_ids": [3, 4]}],
                     params, use_tqdm=False)
    with pytest.raises(ValueError, match=r"max_tokens=31: .*needs up to 5 KV-cache blocks"):
        llm.llm_engine.add_request("x", {"prompt_token_ids": [3, 4]},
                                   SamplingParams(max_tokens=31))
    assert not llm.llm_engine.has_unfinished_requests()
    (good,) = llm.generate({"prompt_token_ids": [3, 4]}, params, use_tqdm=False)
    assert good.outputs[0].finish_reason == "length" and len(good.outputs[0].token_ids) == 4


def test_stats_keys(llm):
    stats = llm.llm_engine.stats()
    for key in ("num_total_kv_blocks", "num_free_kv_blocks", "num_running", "num_waiting",
                "num_swapped", "num_preemptions", "num_prompt_tokens", "num_generation_tokens",
                "prefix_cache_hit_rate"):
        assert key in stats


def test_progress_bar_reports_throughput(llm, capsys):
    llm.generate(["a b c"] * 3, SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=True)
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "3/3" in err and "tok/s" in err


def test_a_script_holding_an_llm_exits_quietly(checkpoint_dir, tmp_path):
    """`import omniinfer` and a module-level LLM: the LLM is finalized after the interpreter has
    set module globals to None, and its __del__ printed 'Exception ignored ... NoneType object
    has no attribute suppress' (twice) at the end of every such script."""
    import subprocess
    import sys

    script = tmp_path / "script.py"
    script.write_text("import omniinfer\n"
                      f"llm = omniinfer.LLM({checkpoint_dir('llama')!r}, num_kv_blocks=16, block_size=8)\n"
                      "print(len(llm.generate('Hello', omniinfer.SamplingParams(max_tokens=2), "
                      "use_tqdm=False)))\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "1", done.stderr
    assert "Exception ignored" not in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_generate_without_params_takes_the_checkpoints_generation_config(checkpoint_dir, tmp_path):
    """As vLLM's LLM: generation_config.json's sampling defaults (temperature, top_p, top_k,
    min_p, repetition_penalty) when no SamplingParams is given."""
    import json
    import shutil

    path = str(tmp_path / "m")
    shutil.copytree(checkpoint_dir("llama"), path)
    gen_file = tmp_path / "m" / "generation_config.json"
    gen = json.loads(gen_file.read_text())
    gen_file.write_text(json.dumps({**gen, "temperature": 0.0, "top_k": 7, "do_sample": False}))
    llm = LLM(path, num_kv_blocks=32, block_size=8)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.top_p) == (0.0, 7, 1.0)
    plain = llm.generate("The quick", use_tqdm=False)[0].outputs[0].token_ids
    assert plain == llm.generate("The quick", SamplingParams(temperature=0, max_tokens=16),
                                 use_tqdm=False)[0].outputs[0].token_ids
    gen_file.write_text(json.dumps({**gen, "temperature": -1}))
    bad = LLM(path, num_kv_blocks=32, block_size=8)
    with pytest.raises(ValueError, match=r"generation_config.json sets \{'temperature': -1\}, which is not "
                                         r"allowed: temperature=-1.0 is not allowed"):
        bad.generate("The quick", use_tqdm=False)
