"""The shipped demo model: a fresh checkout loads it and prints plausible text, and it is the
default of `omniinfer generate` and `omniinfer serve` (with its chat template)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from omniinfer.entrypoints.cli_generate import DEMO_MODEL, default_model

DEMO_ROOT = Path(DEMO_MODEL).parent
CONSOLE_SCRIPT = Path(sys.executable).with_name("omniinfer")

pytestmark = pytest.mark.skipif(
    default_model() is None,
    reason=f"the demo model is not in this checkout yet ({DEMO_MODEL}/config.json is missing); "
           "scripts/train_demo_model.py writes it")


def plausible(text: str) -> bool:
    """Mostly letters and spaces, with at least two words: English-like, not byte soup."""
    if not text.strip():
        return False
    letters = sum(c.isascii() and (c.isalpha() or c.isspace()) for c in text)
    return letters / len(text) >= 0.6 and len(text.split()) >= 2


@pytest.fixture(scope="module")
def demo_llm():
    from omniinfer import LLM

    return LLM(DEMO_MODEL, num_kv_blocks=128)


def test_demo_checkpoint_is_small_and_complete():
    model = Path(DEMO_MODEL)
    for name in ("config.json", "tokenizer_config.json", "generation_config.json"):
        assert (model / name).is_file(), name
    assert list(model.glob("*.safetensors"))
    total = sum(p.stat().st_size for p in DEMO_ROOT.rglob("*") if p.is_file())
    assert total < 30 * 2**20, f"the demo checkpoints take {total / 2**20:.1f} MB (limit 30 MB)"


def test_demo_model_generates_plausible_text(demo_llm):
    from omniinfer import SamplingParams

    outs = demo_llm.generate(["Return the", "This module provides"],
                             SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    for out in outs:
        text = out.outputs[0].text
        assert plausible(text), repr(text)


def test_demo_tokenizer_has_a_chat_template(demo_llm):
    tok = demo_llm.get_tokenizer()
    assert tok.chat_template
    ids = tok.apply_chat_template([{"role": "user", "content": "What does os.path.join do?"}],
                                  add_generation_prompt=True, tokenize=True, return_dict=False)
    assert len(ids) > 5


def test_generate_uses_the_demo_model_by_default():
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNIINFER_")}
    out = subprocess.run([str(CONSOLE_SCRIPT), "generate", "--max-tokens", "16", "--json"],
                         env={**env, "OMNIINFER_CPU_THREADS": "1"}, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(lines) == 3  # the built-in demo prompts
    assert any(plausible(line["outputs"][0]["text"]) for line in lines), lines


def test_serve_defaults_to_the_demo_model_and_its_chat_template(demo_llm):
    import asyncio

    import httpx
    import openai

    from omniinfer.entrypoints.cli import build_parser
    from omniinfer.entrypoints.cli_serve import DEMO_MODEL_NAME
    from omniinfer.entrypoints.openai.api_server import ServerState, build_app

    assert build_parser().parse_args(["serve"]).model in (None, "")  # resolved to the demo at run
    state = ServerState(DEMO_MODEL_NAME)
    state.attach(demo_llm.llm_engine)

    async def chat():
        transport = httpx.ASGITransport(app=build_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://demo") as http:
            client = openai.AsyncOpenAI(api_key="x", base_url="http://demo/v1", http_client=http)
            return await client.chat.completions.create(
                model=DEMO_MODEL_NAME, max_tokens=32, temperature=0,
                messages=[{"role": "user", "content": "What does os.path.join do?"}])

    try:
        r = asyncio.run(chat())
    finally:
        state.ctx.engine.stop()  # the engine itself belongs to demo_llm
    assert r.choices[0].message.content.strip()
    assert r.choices[0].finish_reason in ("stop", "length")


def test_demo_model_path_is_public_and_light():
    """`omniinfer.demo_model_path()`: the demo checkpoint's directory, without importing torch."""
    code = ("import sys, omniinfer; p = omniinfer.demo_model_path(); "
            "d = omniinfer.demo_draft_model_path(); "
            "print(p); print(d); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    path, draft, has_torch = out.stdout.split()
    assert Path(path) == Path(DEMO_MODEL) and Path(draft) == DEMO_ROOT / "draft"
    assert (Path(path) / "config.json").is_file() and has_torch == "False"


def test_the_conformance_kit_declares_pytest():
    """`pip install omniinfer[conformance]` brings what the plugin conformance kit imports."""
    import tomllib

    extras = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    (requirement,) = extras["project"]["optional-dependencies"]["conformance"]
    assert requirement.startswith("pytest")
