"""`omniinfer generate`, `bench throughput|latency` and `serve`'s flags, end to end in-process."""

from __future__ import annotations

import json
import socket
import time

import pytest

from omniinfer.entrypoints.cli import build_parser, main

SMALL = ["--num-kv-blocks", "64", "--block-size", "8"]


def test_generate_json_from_arguments_and_a_file(checkpoint_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Return the\n\nThis module provides\n")
    assert main(["generate", "The quick", "--prompts-file", str(prompts), "--model",
                 checkpoint_dir("llama"), "--max-tokens", "5", "--ignore-eos", "--json", *SMALL]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["prompt"] for line in lines] == ["The quick", "Return the", "This module provides"]
    for line in lines:
        (out,) = line["outputs"]
        assert len(out["token_ids"]) == 5 and out["finish_reason"] == "length"


def test_generate_text_stop_and_chat_needs_a_template(checkpoint_dir, capsys):
    assert main(["generate", "The quick", "--model", checkpoint_dir("llama"), "--max-tokens", "4",
                 *SMALL]) == 0
    assert capsys.readouterr().out.startswith("'The quick' -> '")
    with pytest.raises(SystemExit, match="chat template"):
        main(["generate", "hi", "--chat", "--model", checkpoint_dir("llama"), *SMALL])


def test_bench_throughput(checkpoint_dir, capsys):
    assert main(["bench", "throughput", "--model", checkpoint_dir("llama"), "--num-prompts", "4",
                 "--input-len", "8", "--output-len", "4", "--json", *SMALL]) == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["num_requests"], r["input_tokens"], r["output_tokens"]) == (4, 32, 16)
    assert r["output_tokens_per_s"] > 0 and r["total_tokens_per_s"] > r["output_tokens_per_s"]
    assert r["ttft_s"]["count"] == r["e2e_s"]["count"] == 4
    assert r["e2e_s"]["p99"] >= r["e2e_s"]["p50"] >= r["ttft_s"]["p50"] > 0
    assert main(["bench", "throughput", "--model", checkpoint_dir("llama"), "--num-prompts", "2",
                 "--input-len", "4", "--output-len", "2", *SMALL]) == 0
    text = capsys.readouterr().out
    assert text.startswith("throughput: ") and "requests/s" in text and "tokens/s" in text
    assert "TTFT" in text and "TPOT" in text and "p99" in text


def test_bench_latency_and_a_prompts_file(checkpoint_dir, tmp_path, capsys):
    assert main(["bench", "latency", "--model", checkpoint_dir("llama"), "--batch-size", "2",
                 "--input-len", "6", "--output-len", "3", "--num-iters", "2",
                 "--num-iters-warmup", "0", "--json", *SMALL]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["batch_size"] == 2 and r["latency_s"]["count"] == 2 and r["tpot_s"]["count"] == 4
    prompts = tmp_path / "p.txt"
    prompts.write_text("The quick\nReturn the\nThis module\n")
    assert main(["bench", "throughput", "--model", checkpoint_dir("llama"), "--prompts-file",
                 str(prompts), "--output-len", "2", "--json", *SMALL]) == 0
    assert json.loads(capsys.readouterr().out)["num_requests"] == 3


def test_serve_flags_and_environment(monkeypatch, capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--help"])
    assert e.value.code == 0
    help_text = capsys.readouterr().out
    for flag in ("--host", "--port", "--api-key", "--chat-template", "--served-model-name",
                 "--tensor-parallel-size", "--max-model-len", "--dtype", "--device",
                 "--enable-prefix-caching", "OMNIINFER_"):
        assert flag in help_text
    args = build_parser().parse_args(["serve", "m"])
    assert (args.host, args.port, args.api_key, args.model) == ("127.0.0.1", 8000, None, "m")
    monkeypatch.setenv("OMNIINFER_PORT", "9123")
    monkeypatch.setenv("OMNIINFER_API_KEY", "sk-env")
    monkeypatch.setenv("OMNIINFER_BLOCK_SIZE", "8")
    monkeypatch.setenv("OMNIINFER_MODEL", "/models/x")
    args = build_parser().parse_args(["serve"])
    assert (args.port, args.api_key, args.block_size, args.model) == (9123, "sk-env", 8, "/models/x")
    assert build_parser().parse_args(["serve", "--port", "1"]).port == 1  # a flag beats the variable


def test_serve_exits_with_an_error_when_the_model_cannot_load(tmp_path, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    assert main(["serve", str(tmp_path / "missing"), "--port", str(port),
                 "--uvicorn-log-level", "warning"]) == 1
    assert time.monotonic() - start < 60
