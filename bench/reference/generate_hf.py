"""Reference for `cargo run --release -p tutor-bench --bin policy`: makes the benchmark's
tiny Qwen3 model with `transformers` (fixed config and seed), saves it in Hugging Face
layout, and times `model.generate` (greedy, KV cache) on the benchmark's prompts.

    python generate_hf.py --out DIR --threads N --new-tokens T --batches 1,8 --repeats R

writes DIR/model/ (config.json, model.safetensors: what the Rust side loads) and
DIR/generate_hf.json: the prompts (one list per row of the largest batch; a batch of b
uses the first b), and per batch size the wall and CPU seconds (all threads) of every
timed repeat, new tokens per second (best repeat) and the generated tokens (to compare with Rust's greedy tokens).
Every run of this script with the same arguments makes the same model and prompts.

With --serve the script times nothing up front: it writes the JSON (prompts and the
tokens of one warm-up generate per batch size, no timings), prints `ready`, then answers
each line `B` on standard input with one timed `generate` at batch size B, printed as one
JSON line {"batch", "seconds", "cpu_seconds"}, until standard input ends. The Rust side
uses it to time both sides back to back, repeat by repeat, so that a slow stretch of a
shared machine hits both alike.
"""
import argparse
import json
import os
import sys
import time

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

# Big enough that matrix products, not bookkeeping alone, make up a decode step; small
# enough that the whole benchmark takes a few minutes on 2 cores.
CONFIG = dict(
    vocab_size=4096,
    hidden_size=384,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=64,
    rms_norm_eps=1e-6,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=0,
)
SEED = 1234


def make_model(out):
    torch.manual_seed(SEED)
    model = Qwen3ForCausalLM(Qwen3Config(**CONFIG)).eval()
    # Larger-than-default weights so that greedy choices are not near-ties.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.copy_(0.08 * torch.randn_like(p))
    path = os.path.join(out, "model")
    model.save_pretrained(path, safe_serialization=True)
    return path


def make_prompts(max_batch):
    g = torch.Generator().manual_seed(SEED + 1)
    prompts = []
    for _ in range(max_batch):
        n = int(torch.randint(24, 41, (1,), generator=g))
        prompts.append(torch.randint(1, CONFIG["vocab_size"], (n,), generator=g).tolist())
    return prompts


def left_pad(prompts):
    width = max(len(p) for p in prompts)
    ids = [[0] * (width - len(p)) + p for p in prompts]
    mask = [[0] * (width - len(p)) + [1] * len(p) for p in prompts]
    return torch.tensor(ids), torch.tensor(mask)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--new-tokens", type=int, required=True)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--serve", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]

    path = make_model(args.out)
    model = Qwen3ForCausalLM.from_pretrained(path).eval()
    prompts = make_prompts(max(batches))
    results = {}
    runs = {}
    for b in batches:
        ids, mask = left_pad(prompts[:b])
        kwargs = dict(
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=args.new_tokens,
            min_new_tokens=args.new_tokens,
            pad_token_id=0,
            use_cache=True,
        )

        def run(ids=ids, kwargs=kwargs):
            with torch.inference_mode():
                t0, c0 = time.perf_counter(), time.process_time()
                out = model.generate(ids, **kwargs)
                return time.perf_counter() - t0, time.process_time() - c0, out

        runs[b] = run
        _, _, out = run()  # warm-up
        seconds, cpu = [], []
        for _ in range(0 if args.serve else args.repeats):
            s, c, out = run()
            seconds.append(s)
            cpu.append(c)
        new = out[:, ids.shape[1]:]
        assert new.shape[1] == args.new_tokens, new.shape
        results[str(b)] = dict(seconds=seconds, cpu_seconds=cpu, tokens=new.tolist())
        if seconds:
            results[str(b)]["tokens_per_s"] = b * args.new_tokens / min(seconds)
            print(f"transformers generate batch {b}: {b * args.new_tokens / min(seconds):.1f} tok/s", flush=True)
    with open(os.path.join(args.out, "generate_hf.json"), "w") as f:
        json.dump(
            dict(
                torch=torch.__version__,
                transformers=__import__("transformers").__version__,
                threads=torch.get_num_threads(),
                new_tokens=args.new_tokens,
                prompts=prompts,
                results=results,
            ),
            f,
        )
    if args.serve:
        print("ready", flush=True)
        for line in sys.stdin:
            b = int(line)
            s, c, _ = runs[b]()
            print(json.dumps(dict(batch=b, seconds=s, cpu_seconds=c)), flush=True)


if __name__ == "__main__":
    main()
