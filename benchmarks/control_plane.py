"""Per-step control-plane cost with tensor parallelism on CPU: what the driver broadcasts
each decode step (bytes) and how long it takes, for 1, 64 and 256 running sequences.

    .venv/bin/python benchmarks/control_plane.py [--tp 2] [--seqs 1 64 256] [--steps 30]

A tiny Llama (built into a temporary directory unless --model is given) keeps the forward
pass small, so the numbers are the control plane's.

Table 1, one engine per size (medians over the decode steps): payload bytes broadcast
(header + pickled metadata + tensors), the tensors' share, time inside broadcast_tensor_dict
on the driver, time to build the step's inputs (prepare), the whole step, and the same
step on one rank.

Table 2 replays the last step's dict of each size between two fresh processes, through
omniinfer's packed broadcast (one buffer, one collective) and through the baseline layout
(one object broadcast for the metadata, then one async broadcast per tensor); each
iteration waits for the receiver's 1-element acknowledgement, whose own cost is shown.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("OMNIINFER_CPU_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def measure(model: str, tp: int, num_seqs: int, steps: int, prompt_len: int) -> dict:
    from omniinfer import LLM, SamplingParams
    from omniinfer.distributed.communication import BroadcastStats

    block_size = 16
    blocks_per_seq = -(-(prompt_len + steps + 8) // block_size)
    llm = LLM(model, tensor_parallel_size=tp, max_num_seqs=max(num_seqs, 1),
              max_num_batched_tokens=max(2048, num_seqs), block_size=block_size,
              num_kv_blocks=num_seqs * blocks_per_seq + 8, enable_prefix_caching=False)
    try:
        engine = llm.llm_engine
        runner = (engine.executor.driver if tp > 1 else engine.executor.worker).model_runner
        prepare_s = []
        prepare = runner.prepare_model_input

        def timed_prepare(*args):
            start = time.perf_counter()
            out = prepare(*args)
            prepare_s.append(time.perf_counter() - start)
            return out

        runner.prepare_model_input = timed_prepare
        captured = {}
        if tp > 1:
            from omniinfer.worker import worker_base

            send = worker_base.broadcast_tensor_dict

            def capture(values, src=0):
                if values:  # not the stop signal at shutdown
                    captured["dict"] = values
                return send(values, src=src)

            worker_base.broadcast_tensor_dict = capture
        params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
        for i in range(num_seqs):
            prompt = [3 + (i * 7 + j) % 300 for j in range(prompt_len)]
            engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
        while engine.scheduler.stats()["num_waiting"] or any(
                g.seqs[0].num_output_tokens == 0 for g in engine.groups.values()):
            engine.step()  # prefill until every sequence decodes
        rows = []
        for _ in range(steps):
            BroadcastStats.reset()
            prepare_s.clear()
            start = time.perf_counter()
            engine.step()
            rows.append((BroadcastStats.num_bytes, BroadcastStats.num_tensor_bytes,
                         BroadcastStats.time_s, sum(prepare_s), time.perf_counter() - start))
    finally:
        llm.shutdown()
        if tp > 1:
            worker_base.broadcast_tensor_dict = send
    med = [statistics.median(col) for col in zip(*rows)]
    return dict(seqs=num_seqs, bytes=int(med[0]), tensor_bytes=int(med[1]),
                broadcast_ms=med[2] * 1e3, prepare_ms=med[3] * 1e3, step_ms=med[4] * 1e3,
                step_dict=captured.get("dict"))


# ---- table 2: packed vs one broadcast per tensor, replayed between two processes --------------
def per_tensor_broadcast(values, src: int):
    """The baseline layout: metadata in one object broadcast, then one broadcast per tensor."""
    import torch
    import torch.distributed as dist

    from omniinfer.distributed.communication import control_group

    group = control_group()
    if dist.get_rank() == src:
        meta = [(k, (v.dtype, tuple(v.shape)) if isinstance(v, torch.Tensor) else None, v)
                for k, v in values.items()]
        dist.broadcast_object_list([[(k, m, None if m else v) for k, m, v in meta]], src=src,
                                   group=group)
        handles = [dist.broadcast(v.contiguous(), src=src, group=group, async_op=True)
                   for v in values.values() if isinstance(v, torch.Tensor) and v.numel()]
    else:
        box = [None]
        dist.broadcast_object_list(box, src=src, group=group)
        values = {k: torch.empty(m[1], dtype=m[0]) if m else v for k, m, v in box[0]}
        handles = [dist.broadcast(v, src=src, group=group, async_op=True)
                   for v in values.values() if isinstance(v, torch.Tensor) and v.numel()]
    for h in handles:
        h.wait()
    return values


def _ack(rank: int) -> None:
    import torch
    import torch.distributed as dist

    from omniinfer.distributed.communication import control_group

    dist.broadcast(torch.zeros(1), src=1, group=control_group())


def replay(step_dicts: list[dict], iters: int) -> list[tuple[float, float, float]]:
    """(packed ms, per-tensor ms, ack-only ms) per dict, rank 0 here, rank 1 a subprocess."""
    from omniinfer.distributed import parallel_state as ps
    from omniinfer.distributed.communication import broadcast_tensor_dict
    from omniinfer.executor.distributed import free_port

    init_method = f"tcp://127.0.0.1:{free_port()}"
    peer = subprocess.Popen([sys.executable, __file__, "--receiver", init_method])
    ps.init_distributed_environment(0, 2, init_method, "gloo")
    try:
        broadcast_tensor_dict({"num_dicts": len(step_dicts), "iters": iters})
        results = []
        for values in step_dicts:
            times = []
            for send in (lambda v=values: broadcast_tensor_dict(v),
                         lambda v=values: per_tensor_broadcast(v, 0), lambda: None):
                for i in range(iters + 5):
                    if i == 5:
                        start = time.perf_counter()
                    send()
                    _ack(0)
                times.append((time.perf_counter() - start) / iters * 1e3)
            results.append(tuple(times))
        return results
    finally:
        ps.destroy_distributed_environment()
        peer.wait(timeout=60)


def receiver(init_method: str) -> None:
    from omniinfer.distributed import parallel_state as ps
    from omniinfer.distributed.communication import broadcast_tensor_dict

    ps.init_distributed_environment(1, 2, init_method, "gloo")
    plan = broadcast_tensor_dict(None)
    for _ in range(plan["num_dicts"]):
        for receive in (lambda: broadcast_tensor_dict(None), lambda: per_tensor_broadcast(None, 0),
                        lambda: None):
            for _ in range(plan["iters"] + 5):
                receive()
                _ack(1)
    ps.destroy_distributed_environment()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint directory (default: a tiny Llama)")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--seqs", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--steps", type=int, default=30, help="decode steps measured per size")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--replay-iters", type=int, default=200)
    parser.add_argument("--receiver", help=argparse.SUPPRESS)  # table 2's rank 1
    args = parser.parse_args()
    if args.receiver:
        receiver(args.receiver)
        return

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from omniinfer.testing.tiny_models import build_tiny_checkpoint

            model = build_tiny_checkpoint(os.path.join(tmp, "tiny-llama"), "llama")
        results = [measure(model, args.tp, n, args.steps, args.prompt_len) for n in args.seqs]
        baseline = [measure(model, 1, n, args.steps, args.prompt_len) for n in args.seqs]

    from omniinfer.benchmarks.perf import machine_line

    print(machine_line())
    print(f"\ncontrol plane per decode step, TP={args.tp} on CPU (gloo), medians of "
          f"{args.steps} steps; 'TP=1 step' is the same run on one rank")
    header = ("running seqs", "bytes/step", "tensor bytes", "broadcast ms", "prepare ms",
              "step ms", "TP=1 step ms")
    print(" | ".join(f"{h:>12}" for h in header))
    for r, b in zip(results, baseline):
        print(" | ".join(f"{v:>12}" for v in (
            r["seqs"], r["bytes"], r["tensor_bytes"], f"{r['broadcast_ms']:.3f}",
            f"{r['prepare_ms']:.3f}", f"{r['step_ms']:.3f}", f"{b['step_ms']:.3f}")))

    dicts = [r["step_dict"] for r in results]
    if all(d is not None for d in dicts):
        print(f"\none step's dict replayed {args.replay_iters} times between two processes "
              "(ms per broadcast + acknowledgement)")
        header = ("running seqs", "packed", "per tensor", "ack only", "tensors")
        print(" | ".join(f"{h:>12}" for h in header))
        for r, d, (packed, per_tensor, ack) in zip(results, dicts, replay(dicts, args.replay_iters)):
            num_tensors = sum(hasattr(v, "numel") for v in d.values())
            print(" | ".join(f"{v:>12}" for v in (r["seqs"], f"{packed:.3f}", f"{per_tensor:.3f}",
                                                  f"{ack:.3f}", num_tensors)))


if __name__ == "__main__":
    main()
