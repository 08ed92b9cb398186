#!/usr/bin/env python3
"""Train omniinfer's shipped demo model: a tiny Llama plus an even smaller draft.

Everything is built from text that every CPython install carries, so the run is
reproducible offline on any machine:

* corpus   -- module/class/function docstrings of the running interpreter's
              standard library (parsed with ``ast``; tests, idlelib, lib2to3,
              turtledemo and site-packages are skipped), the ``pydoc`` help
              topics (``pydoc_data/topics.py``), and a few short ChatML-style
              question/answer pairs derived from those docstrings so the chat
              template produces something sensible;
* tokenizer -- byte-level BPE (``tokenizers``), wrapped as a transformers
              ``PreTrainedTokenizerFast`` with a ChatML chat template;
* main     -- ``LlamaForCausalLM`` (~4 M parameters, grouped-query attention,
              tied embeddings), trained with AdamW + cosine LR;
* draft    -- ``LlamaForCausalLM`` (~0.9 M parameters) with the same tokenizer,
              trained on the same text and distilled from the main model's
              logits, for speculative decoding.

Outputs (``--out``, default ``core/omniinfer/assets/demo``)::

    model/  config.json generation_config.json model.safetensors tokenizer files
    draft/  (same layout)

and a report with the loss curves and greedy samples (``--docs``, default
``docs/demo-model.md``).

The default settings take roughly 35 minutes on one (shared) CPU thread.  As
long as the ``--minutes``/``--draft-minutes`` safety caps are not reached, a
rerun with the same Python/torch/tokenizers versions reproduces the checkpoints
bit for bit; if a cap cuts training short, the LR schedule is compressed to the
time budget (the report says so).

Usage::

    python scripts/train_demo_model.py                      # full run
    python scripts/train_demo_model.py --steps 20 --draft-steps 10 \\
        --out /tmp/demo --docs /tmp/demo.md                 # smoke test
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import os
import platform
import random
import shlex
import sys
import sysconfig
import time
import warnings

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PAD, BOS, EOS, IM_START, IM_END = "<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, IM_START, IM_END]  # ids 0..4, in this order

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

SKIP_DIRS = {
    "test", "tests", "idle_test", "site-packages", "dist-packages", "idlelib",
    "lib2to3", "turtledemo", "__pycache__", "ensurepip",
}

SAMPLE_PROMPTS = ["Return the", "This module provides", "def ", "Raise ValueError if", "The default"]
CHAT_PROMPT = "What does `os.path.join` do?"
SAMPLE_TOKENS = 48


# --------------------------------------------------------------------------- args

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="core/omniinfer/assets/demo",
                   help="output directory (gets model/ and draft/ subdirectories)")
    p.add_argument("--docs", default="docs/demo-model.md", help="where to write the training report")
    p.add_argument("--steps", type=int, default=1700, help="main model optimizer steps")
    p.add_argument("--draft-steps", type=int, default=550, help="draft model optimizer steps")
    p.add_argument("--minutes", type=float, default=45.0,
                   help="wall-clock safety cap (minutes) for the main model; when hit, the LR schedule is "
                        "compressed to the time budget and the run is no longer bit-reproducible (0 = no cap)")
    p.add_argument("--draft-minutes", type=float, default=15.0,
                   help="wall-clock cap for the draft model (0 = no cap)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3, help="main model peak LR")
    p.add_argument("--draft-lr", type=float, default=3e-3, help="draft model peak LR")
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--distill-weight", type=float, default=0.7,
                   help="weight of KL(main || draft) in the draft loss (0 = plain LM loss)")
    p.add_argument("--chat-fraction", type=float, default=0.25,
                   help="fraction of eligible docstrings also turned into ChatML Q/A pairs")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args(argv)


ARGS = parse_args()
# Thread limits must be in place before torch / tokenizers spin up their pools.
for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "RAYON_NUM_THREADS"):
    os.environ[_var] = str(ARGS.threads)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import tokenizers  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

transformers.logging.set_verbosity_error()


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def stable_hash(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()[:8], "big")


# --------------------------------------------------------------------------- corpus

def _skip_dir(name: str) -> bool:
    return name in SKIP_DIRS or name.startswith("test") or name.startswith("config-")


def collect_corpus(chat_fraction: float):
    """Return (docs, chat_pairs, stats). Fully deterministic for a given stdlib."""
    root = sysconfig.get_paths()["stdlib"]
    docstrings: set[str] = set()
    named: dict[str, tuple[str, str]] = {}  # first paragraph -> (qualified name, kind)
    topics: list[str] = []
    n_files = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not _skip_dir(d))
        rel = os.path.relpath(dirpath, root)
        for fn in sorted(filenames):
            if not fn.endswith(".py") or fn.startswith("test_"):
                continue
            path = os.path.join(dirpath, fn)
            try:
                with open(path, "rb") as f:
                    src = f.read()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    tree = ast.parse(src, filename=path)
            except (SyntaxError, ValueError, OSError):
                continue
            n_files += 1
            parts = [] if rel == "." else rel.split(os.sep)
            stem = fn[:-3]
            if stem != "__init__":
                parts.append(stem)
            module = ".".join(parts)
            if module == "pydoc_data.topics":
                topics = _topics_from_tree(tree)
                continue
            _collect_docstrings(tree, module, docstrings, named, [])
    docs = sorted(docstrings)
    topics = sorted(t for t in topics if t not in docstrings)

    # Short ChatML Q/A pairs: question about a public name, answer = first paragraph.
    chat_pairs = []
    for para in sorted(named):
        qualname, kind = named[para]
        h = stable_hash(qualname + "\0" + para)
        if (h % 10_000) >= chat_fraction * 10_000:
            continue
        if kind == "module":
            q = [f"What is the `{qualname}` module for?", f"Describe the `{qualname}` module."][h % 2]
        else:
            q = [f"What does `{qualname}` do?", f"Explain `{qualname}`.",
                 f"Describe the `{qualname}` {kind}."][(h >> 8) % 3]
        chat_pairs.append((q, para))
    stats = {
        "stdlib": root,
        "files": n_files,
        "docstrings": len(docs),
        "docstring_chars": sum(len(d) for d in docs),
        "topics": len(topics),
        "topic_chars": sum(len(t) for t in topics),
        "chat_pairs": len(chat_pairs),
    }
    return docs + topics, chat_pairs, stats


def _topics_from_tree(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            vals = [v.value for v in node.values if isinstance(v, ast.Constant) and isinstance(v.value, str)]
            if len(vals) > 10:
                return [v.strip() for v in vals if v.strip()]
    return []


def _first_paragraph(doc: str) -> str:
    para = doc.strip().split("\n\n", 1)[0].strip()
    return " ".join(para.split())


def _collect_docstrings(node, module, docstrings, named, scope, in_function=False):
    """Record docstrings of ``node`` and every def/class below it (including nested ones)."""
    is_def = isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
    if is_def or isinstance(node, ast.Module):
        doc = ast.get_docstring(node, clean=True)
        if doc and len(doc.strip()) >= 10:
            doc = doc.strip()
            docstrings.add(doc)
            if isinstance(node, ast.Module):
                qual, kind = module, "module"
            else:
                qual = ".".join([module] + scope + [node.name])
                kind = "class" if isinstance(node, ast.ClassDef) else ("method" if scope else "function")
            public = module and not in_function and not any(p.startswith("_") for p in qual.split("."))
            para = _first_paragraph(doc)
            if public and 30 <= len(para) <= 400 and para not in named:
                named[para] = (qual, kind)
    if is_def:
        scope = scope + [node.name]
        in_function = in_function or not isinstance(node, ast.ClassDef)
    for child in ast.iter_child_nodes(node):
        _collect_docstrings(child, module, docstrings, named, scope, in_function)


def chat_text(question: str, answer: str) -> str:
    return f"{IM_START}user\n{question}{IM_END}\n{IM_START}assistant\n{answer}{IM_END}\n"


# --------------------------------------------------------------------------- tokenizer

def train_tokenizer(texts, vocab_size):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        extra_special_tokens=[IM_START, IM_END],
        add_bos_token=True,
        add_eos_token=False,
        clean_up_tokenization_spaces=False,
        model_max_length=1024,
        padding_side="left",
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    return hf_tok


# --------------------------------------------------------------------------- data

class Batches:
    """Epoch-wise shuffled, non-overlapping (seq_len + 1)-token windows of one token stream."""

    def __init__(self, stream: torch.Tensor, seq_len: int, batch_size: int, seed: int):
        self.stream, self.seq_len, self.bs = stream, seq_len, batch_size
        self.gen = torch.Generator().manual_seed(seed)
        self.epoch, self.queue = 0, []

    def _refill(self):
        w = self.seq_len + 1
        offset = int(torch.randint(0, self.seq_len, (1,), generator=self.gen))
        n = (len(self.stream) - offset) // w
        starts = offset + torch.arange(n) * w
        self.queue = starts[torch.randperm(n, generator=self.gen)].tolist()
        self.epoch += 1

    def next(self):
        if len(self.queue) < self.bs:
            self._refill()
        starts, self.queue = self.queue[: self.bs], self.queue[self.bs:]
        return torch.stack([self.stream[s: s + self.seq_len + 1] for s in starts])


def encode_stream(hf_tok, texts):
    ids = []
    enc = hf_tok._tokenizer.encode_batch(texts, add_special_tokens=False)
    for e in enc:
        ids.append(hf_tok.bos_token_id)
        ids.extend(e.ids)
        ids.append(hf_tok.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


# --------------------------------------------------------------------------- training

def n_params(model):
    return sum(p.numel() for p in model.parameters())


def make_config(tok, hidden, layers, heads, kv_heads, intermediate):
    return LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        hidden_act="silu",
        max_position_embeddings=1024,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        torch_dtype="float32",
    )


@torch.no_grad()
def evaluate(model, val_batch):
    model.eval()
    out = model(input_ids=val_batch[:, :-1])
    loss = F.cross_entropy(out.logits.flatten(0, 1), val_batch[:, 1:].flatten()).item()
    model.train()
    return loss


def train(name, model, batches, val_batch, *, steps, lr, warmup, minutes, log_every, eval_every,
          teacher=None, distill_weight=0.0):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95), eps=1e-8)
    cap = minutes * 60.0 if minutes and minutes > 0 else float("inf")
    curve, evals = [], []
    t0 = time.time()
    running, n_running = 0.0, 0
    step, capped = 0, False
    model.train()
    while step < steps:
        elapsed = time.time() - t0
        progress = max(step / steps, elapsed / cap)
        if progress >= 1.0:
            capped = True
            break
        if step < warmup:
            cur_lr = lr * (step + 1) / warmup
        else:
            wprog = max(0.0, (progress - warmup / steps) / max(1e-9, 1 - warmup / steps))
            cur_lr = lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, wprog))))
        for g in opt.param_groups:
            g["lr"] = cur_lr
        batch = batches.next()
        x, y = batch[:, :-1], batch[:, 1:]
        logits = model(input_ids=x).logits
        ce = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss = ce
        if teacher is not None and distill_weight > 0:
            with torch.no_grad():
                t_logp = F.log_softmax(teacher(input_ids=x).logits, dim=-1)
            s_logp = F.log_softmax(logits, dim=-1)
            kl = F.kl_div(s_logp.flatten(0, 1), t_logp.flatten(0, 1), log_target=True, reduction="batchmean")
            loss = (1 - distill_weight) * ce + distill_weight * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        running += ce.item()
        n_running += 1
        if step % log_every == 0 or step == steps:
            avg = running / n_running
            curve.append((step, avg))
            running, n_running = 0.0, 0
            el = time.time() - t0
            log(f"{name} step {step:5d}/{steps} loss {avg:.4f} lr {cur_lr:.2e} "
                f"epoch {batches.epoch} {el:6.0f}s ({el / step:.2f}s/step)")
        if step % eval_every == 0:
            vl = evaluate(model, val_batch)
            evals.append((step, vl))
            log(f"{name} step {step:5d} val_loss {vl:.4f}")
    if n_running:
        curve.append((step, running / n_running))
    if not evals or evals[-1][0] != step:
        evals.append((step, evaluate(model, val_batch)))
    wall = time.time() - t0
    log(f"{name} done: {step} steps in {wall:.0f}s, final train loss {curve[-1][1]:.4f}, "
        f"val loss {evals[-1][1]:.4f}{' (time cap hit)' if capped else ''}")
    model.eval()
    return {"curve": curve, "evals": evals, "steps": step, "wall_s": wall, "capped": capped,
            "tokens": step * batches.bs * batches.seq_len, "epochs": batches.epoch}


@torch.no_grad()
def greedy(model, tok, prompt, max_new_tokens=None, chat=False):
    if chat:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
    else:
        ids = tok(prompt, return_tensors="pt")["input_ids"]
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                         max_new_tokens=max_new_tokens or SAMPLE_TOKENS,
                         do_sample=False)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=False)


@torch.no_grad()
def agreement(main, draft, tok, val_batch, prompts):
    """Top-1 agreement of draft vs main, on held-out text and on main's greedy continuations."""
    x = val_batch[:, :-1]
    a = main(input_ids=x).logits.argmax(-1)
    b = draft(input_ids=x).logits.argmax(-1)
    on_val = (a == b).float().mean().item()
    hits = total = 0
    for p in prompts:
        ids = tok(p, return_tensors="pt")["input_ids"]
        seq = main.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=64,
                            do_sample=False)
        n = ids.shape[1]
        d = draft(input_ids=seq).logits.argmax(-1)[0, n - 1: -1]
        hits += (d == seq[0, n:]).sum().item()
        total += seq.shape[1] - n
    return on_val, hits / max(1, total)


def save(model, tok, path):
    os.makedirs(path, exist_ok=True)
    model = model.to(torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id,
        eos_token_id=[tok.eos_token_id, tok.convert_tokens_to_ids(IM_END)],
        pad_token_id=tok.pad_token_id,
        do_sample=False,
    )
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    # Mirror a few settings in their older/plain spellings for engines that read the JSON files
    # directly and for transformers 4.x (transformers 5 accepts and ignores the extras).
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path, encoding="utf-8") as f:
        cfg = json.load(f)
    cfg["rope_theta"] = float(cfg.get("rope_parameters", {}).get("rope_theta", 10000.0))
    cfg["torch_dtype"] = "float32"
    with open(cfg_path, "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    tc_path = os.path.join(path, "tokenizer_config.json")
    with open(tc_path, encoding="utf-8") as f:
        tc = json.load(f)
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    tc["add_bos_token"], tc["add_eos_token"] = True, False
    tc["additional_special_tokens"] = list(tc.pop("extra_special_tokens", [IM_START, IM_END]))
    tc["chat_template"] = CHAT_TEMPLATE
    with open(tc_path, "w", encoding="utf-8") as f:
        json.dump(tc, f, indent=2, sort_keys=True)
        f.write("\n")


def dir_size(path):
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


# --------------------------------------------------------------------------- report

def write_report(path, info):
    L = []
    a = L.append
    a("# Demo model")
    a("")
    a("omniinfer ships a tiny Llama (`core/omniinfer/assets/demo/model/`) and a smaller draft sibling "
      "(`core/omniinfer/assets/demo/draft/`) for tests, examples and speculative-decoding demos. "
      "They are trained from scratch on CPython standard-library docstrings, so they produce "
      "docstring-flavoured English, not useful answers.")
    a("")
    a("This file is generated by `scripts/train_demo_model.py`.")
    a("")
    a("## How it was made")
    a("")
    a("```")
    a(info["command"])
    a("```")
    a("")
    for k, v in info["env"].items():
        a(f"- {k}: {v}")
    a("")
    a("## Corpus")
    a("")
    c = info["corpus"]
    a(f"- source: `{c['stdlib']}` ({c['files']} `.py` files parsed with `ast`; test dirs, idlelib, lib2to3, "
      "turtledemo, ensurepip and site-packages skipped)")
    a(f"- {c['docstrings']} unique module/class/function docstrings, {c['docstring_chars']:,} characters")
    a(f"- {c['topics']} pydoc help topics from `pydoc_data/topics.py`, {c['topic_chars']:,} characters")
    a(f"- {c['chat_pairs']} ChatML question/answer pairs (\"What does `name` do?\" -> first docstring paragraph)")
    a(f"- {c['train_docs']} training documents / {c['val_docs']} held-out validation documents; "
      f"{c['train_tokens']:,} training tokens, {c['val_tokens']:,} validation tokens "
      "(each document is `<|bos|> text <|eos|>`, all concatenated)")
    a("")
    a("## Tokenizer")
    a("")
    t = info["tokenizer"]
    a(f"Byte-level BPE (`tokenizers`), vocabulary {t['vocab_size']}, "
      f"{t['chars_per_token']:.2f} characters per token on the corpus. "
      "The tokenizer prepends `<|bos|>` (`add_bos_token`); the chat template is ChatML "
      "(`<|im_start|>role\\n...<|im_end|>\\n`, starting with `<|bos|>`, with `add_generation_prompt`).")
    a("")
    a("| token | id |")
    a("|---|---|")
    for tok_s, tid in t["special_ids"].items():
        a(f"| `{tok_s}` | {tid} |".replace("|>`", "\\|>`").replace("`<|", "`<\\|"))
    a("")
    a("`generation_config.json` stops on `<|eos|>` and `<|im_end|>`.")
    a("")
    a("## Models")
    a("")
    a("| | main | draft |")
    a("|---|---|---|")
    m, d = info["models"]["main"], info["models"]["draft"]
    for key, label in [("arch", "architecture"), ("params", "parameters"), ("steps", "steps"),
                       ("tokens", "training tokens"), ("wall", "wall time"), ("lr", "peak LR"),
                       ("final_train", "final train loss"), ("final_val", "final val loss"),
                       ("size", "directory size")]:
        a(f"| {label} | {m[key]} | {d[key]} |")
    a("")
    a(f"Both: context length {info['seq_len']} for training, batch {info['batch_size']}, "
      "`max_position_embeddings` 1024, `rope_theta` 10000, float32 safetensors, AdamW "
      "(betas 0.9/0.95, weight decay 0.1), linear warmup then cosine decay to 10% of the peak LR, "
      "gradient clipping 1.0. "
      f"The draft loss is {info['distill_weight']:.1f} x KL(main || draft) + "
      f"{1 - info['distill_weight']:.1f} x cross-entropy.")
    a("")
    ag = info["agreement"]
    a(f"Draft/main greedy (top-1) agreement: {ag[0]:.1%} of positions on held-out text, "
      f"{ag[1]:.1%} on the main model's own greedy continuations of the sample prompts.")
    if m["capped"] or d["capped"]:
        a("")
        a("Note: the wall-clock cap (`--minutes`/`--draft-minutes`) ended training before `--steps`; "
          "the LR schedule was compressed to the time budget, so a rerun may differ slightly.")
    a("")
    a("## Greedy samples")
    a("")
    a(f"Greedy decoding, up to {SAMPLE_TOKENS} new tokens, special tokens shown. "
      "Each block is the prompt (as given to the tokenizer or, for the chat sample, "
      "rendered by the chat template) followed by the model's continuation.")
    a("")
    for who in ("main", "draft"):
        a(f"### {who}")
        a("")
        for prompt, text in info["samples"][who]:
            a("~~~~text")
            a(prompt + text)
            a("~~~~")
            a("")
    a("## Loss curves")
    a("")
    for who in ("main", "draft"):
        r = info["runs"][who]
        a(f"### {who} (training cross-entropy, mean over the last {info['log_every']} steps)")
        a("")
        a("| step | loss |")
        a("|---|---|")
        for s, loss in r["curve"]:
            a(f"| {s} | {loss:.4f} |")
        a("")
        a("Held-out validation loss: " + ", ".join(f"step {s}: {loss:.4f}" for s, loss in r["evals"]))
        a("")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(L))


# --------------------------------------------------------------------------- main

def main():
    args = ARGS
    t_start = time.time()
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    out = args.out if os.path.isabs(args.out) else os.path.join(REPO_ROOT, args.out)
    docs_path = args.docs if os.path.isabs(args.docs) else os.path.join(REPO_ROOT, args.docs)
    log(f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"tokenizers {tokenizers.__version__}, threads {args.threads}")

    # 1. corpus ------------------------------------------------------------------------------
    docs, chat_pairs, cstats = collect_corpus(args.chat_fraction)
    chats = [chat_text(q, a) for q, a in chat_pairs]
    log(f"corpus: {cstats['files']} files, {cstats['docstrings']} docstrings "
        f"({cstats['docstring_chars']:,} chars), {cstats['topics']} pydoc topics "
        f"({cstats['topic_chars']:,} chars), {len(chats)} chat pairs")
    # deterministic train/val split by content hash (~2% of plain documents held out)
    val_docs = [d for d in docs if stable_hash(d) % 50 == 0]
    train_docs = [d for d in docs if stable_hash(d) % 50 != 0]
    texts = train_docs + chats
    random.Random(args.seed).shuffle(texts)

    # 2. tokenizer ---------------------------------------------------------------------------
    tok = train_tokenizer(train_docs + [f"{q}\n{a}" for q, a in chat_pairs], args.vocab_size)
    special_ids = {s: tok.convert_tokens_to_ids(s) for s in SPECIAL_TOKENS}
    log(f"tokenizer: vocab {len(tok)}, special ids {special_ids}")
    train_stream = encode_stream(tok, texts)
    val_stream = encode_stream(tok, val_docs)
    n_chars = sum(len(t) for t in texts)
    log(f"tokens: train {len(train_stream):,} ({n_chars / len(train_stream):.2f} chars/token), "
        f"val {len(val_stream):,}")
    n_val = min(16, (len(val_stream) - 1) // (args.seq_len + 1))
    val_batch = torch.stack([val_stream[i * (args.seq_len + 1): (i + 1) * (args.seq_len + 1)]
                             for i in range(n_val)])

    # 3a. main model -------------------------------------------------------------------------
    torch.manual_seed(args.seed)
    main_cfg = make_config(tok, hidden=256, layers=4, heads=8, kv_heads=4, intermediate=704)
    main_model = LlamaForCausalLM(main_cfg)
    log(f"main: {n_params(main_model):,} parameters")
    main_run = train("main", main_model, Batches(train_stream, args.seq_len, args.batch_size, args.seed + 1),
                     val_batch, steps=args.steps, lr=args.lr, warmup=args.warmup, minutes=args.minutes,
                     log_every=args.log_every, eval_every=args.eval_every)
    for p in main_model.parameters():
        p.requires_grad_(False)

    # 3b. draft model ------------------------------------------------------------------------
    torch.manual_seed(args.seed + 2)
    draft_cfg = make_config(tok, hidden=128, layers=2, heads=4, kv_heads=2, intermediate=352)
    draft_model = LlamaForCausalLM(draft_cfg)
    log(f"draft: {n_params(draft_model):,} parameters")
    draft_run = train("draft", draft_model, Batches(train_stream, args.seq_len, args.batch_size, args.seed + 3),
                      val_batch, steps=args.draft_steps, lr=args.draft_lr,
                      warmup=min(args.warmup, max(1, args.draft_steps // 10)), minutes=args.draft_minutes,
                      log_every=args.log_every, eval_every=args.eval_every,
                      teacher=main_model if args.distill_weight > 0 else None,
                      distill_weight=args.distill_weight)

    # 4. save, sample, report ----------------------------------------------------------------
    model_dir, draft_dir = os.path.join(out, "model"), os.path.join(out, "draft")
    save(main_model, tok, model_dir)
    save(draft_model, tok, draft_dir)
    samples = {}
    for who, m in (("main", main_model), ("draft", draft_model)):
        samples[who] = [(p, greedy(m, tok, p)) for p in SAMPLE_PROMPTS]
        chat_prompt = tok.apply_chat_template([{"role": "user", "content": CHAT_PROMPT}], tokenize=False,
                                              add_generation_prompt=True)
        samples[who].append((chat_prompt, greedy(m, tok, CHAT_PROMPT, chat=True)))
        for p, s in samples[who]:
            log(f"{who} sample {p!r} -> {s!r}")
    agree = agreement(main_model, draft_model, tok, val_batch, SAMPLE_PROMPTS)
    log(f"draft/main top-1 agreement: {agree[0]:.1%} on val text, {agree[1]:.1%} on main's greedy output")
    sizes = {"main": dir_size(model_dir), "draft": dir_size(draft_dir)}
    log(f"sizes: model {sizes['main'] / 1e6:.2f} MB, draft {sizes['draft'] / 1e6:.2f} MB")
    total_wall = time.time() - t_start
    log(f"total wall time {total_wall / 60:.1f} min")

    def mrow(cfg, model, run, lr, size):
        return {
            "arch": f"hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, {cfg.num_attention_heads} heads "
                    f"/ {cfg.num_key_value_heads} KV heads, MLP {cfg.intermediate_size}, tied embeddings",
            "params": f"{n_params(model):,}",
            "steps": str(run["steps"]),
            "tokens": f"{run['tokens']:,} (~{run['tokens'] / len(train_stream):.1f} epochs)",
            "wall": f"{run['wall_s'] / 60:.1f} min",
            "lr": f"{lr:g}",
            "final_train": f"{run['curve'][-1][1]:.4f}",
            "final_val": f"{run['evals'][-1][1]:.4f}",
            "size": f"{size / 1e6:.2f} MB",
            "capped": run["capped"],
        }

    cmd_args = [a if not a.startswith(REPO_ROOT) else os.path.relpath(a, REPO_ROOT) for a in sys.argv[1:]]
    info = {
        "command": "python scripts/train_demo_model.py" + ("" if not cmd_args else " " + shlex.join(cmd_args)),
        "env": {
            "Python": f"{platform.python_version()} ({platform.python_implementation()}, {sys.platform})",
            "torch / transformers / tokenizers": f"{torch.__version__} / {transformers.__version__} / "
                                                 f"{tokenizers.__version__}",
            "threads": f"{args.threads} (`torch.set_num_threads`)",
            "seed": str(args.seed),
            "total wall time": f"{total_wall / 60:.1f} min",
        },
        "corpus": dict(cstats, train_docs=len(texts), val_docs=len(val_docs),
                       train_tokens=len(train_stream), val_tokens=len(val_stream)),
        "tokenizer": {"vocab_size": len(tok), "special_ids": special_ids,
                      "chars_per_token": n_chars / len(train_stream)},
        "models": {"main": mrow(main_cfg, main_model, main_run, args.lr, sizes["main"]),
                   "draft": mrow(draft_cfg, draft_model, draft_run, args.draft_lr, sizes["draft"])},
        "runs": {"main": main_run, "draft": draft_run},
        "samples": samples,
        "agreement": agree,
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "distill_weight": args.distill_weight if args.distill_weight > 0 else 0.0,
        "log_every": args.log_every,
    }
    write_report(docs_path, info)
    log(f"wrote {model_dir}, {draft_dir}, {docs_path}")


if __name__ == "__main__":
    main()
