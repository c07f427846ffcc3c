"""PyTorch side of `gpu_check` (bench/src/bin/gpu_check.rs, run by scripts/gpu-check.sh):
the same models, batches and steps as Tutor's side, in `transformers` and PyTorch eager on
the same GPU. Three commands, each writing JSON (and safetensors) that the Rust side
reads:

    python gpu_reference.py parity   --out DIR --device cuda
    python gpu_reference.py train    --out DIR --device cuda --steps S --rows R --tokens T
    python gpu_reference.py generate --out DIR --device cuda --batches 1,16 --new-tokens N

parity: makes a small Qwen3 model (fixed seed, fp32, saved to DIR/parity/model), a
right-padded batch with a loss mask, and the masked next-token cross-entropy (sum over
label tokens / their count). Writes the logits at the valid positions and every
parameter's gradient, once in fp32 (TF32 off: the reference) and once with the model cast
to bf16, to DIR/parity/reference.safetensors, and the batch and losses to
DIR/parity/reference.json.

train: the step Tutor's learner takes with mixed precision on a GPU (bf16 parameters, fp32
master weights, summed masked cross-entropy over the full vocabulary in fp32, gradients
divided by the label count, clipped by global norm, torch.optim.AdamW on the masters, the
masters copied back to bf16) on a Qwen3-0.6B-shaped model (random weights, saved in bf16
to DIR/train/model for Tutor's side). Warm-up steps, then S timed steps (CUDA
synchronised); DIR/train/torch.json gets each step's seconds and loss, the parameter
count and the batch.

generate: greedy `model.generate` (KV cache, bf16, no stop token) with the model `train`
saved, on seeded prompts, at each batch size; DIR/generate/torch.json gets the prompts,
the seconds of each repeat and the tokens.
"""
import argparse
import json
import os
import random
import time

import torch
from safetensors.torch import save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

PARITY = dict(
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    rms_norm_eps=1e-6,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=0,
)

# Qwen3-0.6B's shape (the smallest of the family the DAgger paper trains).
TRAIN = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    rms_norm_eps=1e-6,
    max_position_embeddings=40960,
    tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=0,
)


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def batch(rng, vocab, rows, lo, hi):
    examples, masks = [], []
    for _ in range(rows):
        n = rng.randint(lo, hi)
        examples.append([rng.randrange(1, vocab) for _ in range(n)])
        masks.append([1 if j >= n // 2 else 0 for j in range(n)])
    return examples, masks


def padded(examples, masks, device):
    width = max(len(e) for e in examples)
    ids = torch.zeros(len(examples), width, dtype=torch.long)
    attn = torch.zeros(len(examples), width, dtype=torch.long)
    loss_mask = torch.zeros(len(examples), width)
    for i, (e, m) in enumerate(zip(examples, masks)):
        ids[i, : len(e)] = torch.tensor(e)
        attn[i, : len(e)] = 1
        loss_mask[i, 1 : len(e)] = torch.tensor(m[1:], dtype=torch.float)
    return ids.to(device), attn.to(device), loss_mask.to(device)


def masked_nll(model, ids, attn, loss_mask):
    logits = model(input_ids=ids, attention_mask=attn).logits
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    nll = -logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return (nll * loss_mask[:, 1:]).sum(), logits


def parity(args):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    out = os.path.join(args.out, "parity")
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(1234)
    model = Qwen3ForCausalLM(Qwen3Config(**PARITY))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.copy_(0.05 * torch.randn_like(p))
    model.save_pretrained(os.path.join(out, "model"), safe_serialization=True)
    rng = random.Random(7)
    examples, masks = batch(rng, PARITY["vocab_size"], 4, 160, 256)
    ids, attn, loss_mask = padded(examples, masks, args.device)
    valid = attn.bool()
    tensors, losses = {}, {}
    for kind, dtype in (("f32", torch.float32), ("bf16", torch.bfloat16)):
        m = Qwen3ForCausalLM.from_pretrained(os.path.join(out, "model"), dtype=torch.float32)
        m = m.to(args.device).to(dtype).train()
        total, logits = masked_nll(m, ids, attn, loss_mask)
        labels = loss_mask.sum()
        loss = total / labels
        loss.backward()
        tensors[f"logits.{kind}"] = logits.float()[valid].contiguous().cpu()
        for name, p in m.named_parameters():
            tensors[f"grad.{kind}.{name}"] = p.grad.float().contiguous().cpu()
        losses[kind] = float(loss.detach())
        del m
    save_file(tensors, os.path.join(out, "reference.safetensors"))
    with open(os.path.join(out, "reference.json"), "w") as f:
        json.dump(dict(examples=examples, loss_masks=masks, losses=losses,
                       torch=torch.__version__, device=torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"), f)
    print(f"parity reference: losses {losses}", flush=True)


def train(args):
    out = os.path.join(args.out, "train")
    os.makedirs(out, exist_ok=True)
    config = dict(TRAIN)
    if args.small:
        config.update(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096)
    torch.manual_seed(1234)
    model = Qwen3ForCausalLM(Qwen3Config(**config))
    model.to(torch.bfloat16).save_pretrained(os.path.join(out, "model"), safe_serialization=True)
    model = model.to(args.device).train()
    params = [p for p in model.parameters() if p.requires_grad]
    masters = [p.detach().float().clone() for p in params]
    for m in masters:
        m.grad = torch.zeros_like(m)
    spec = dict(lr=1e-5, weight_decay=0.01, beta1=0.9, beta2=0.95, eps=1e-8, grad_clip=1.0)
    opt = torch.optim.AdamW(masters, lr=spec["lr"], betas=(spec["beta1"], spec["beta2"]),
                            eps=spec["eps"], weight_decay=spec["weight_decay"])
    rng = random.Random(11)
    examples, masks = batch(rng, config["vocab_size"], args.rows, args.tokens * 3 // 4, args.tokens)
    n_params = sum(p.numel() for p in params)
    # The batch first: Tutor's side runs on it even when this side fails (out of memory).
    with open(os.path.join(out, "batch.json"), "w") as f:
        json.dump(dict(examples=examples, loss_masks=masks, params=n_params, torch=torch.__version__, **spec), f)
    ids, attn, loss_mask = padded(examples, masks, args.device)
    labels = loss_mask.sum()

    def step():
        for p in params:
            p.grad = None
        total, _ = masked_nll(model, ids, attn, loss_mask)
        total.backward()
        with torch.no_grad():
            for p, m in zip(params, masters):
                m.grad.copy_(p.grad.float()).div_(labels)
            torch.nn.utils.clip_grad_norm_(masters, spec["grad_clip"])
            opt.step()
            for p, m in zip(params, masters):
                p.copy_(m)
        return total.detach()

    for _ in range(args.warmup):
        step()
    sync(args.device)
    seconds, losses = [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        total = step()
        sync(args.device)
        seconds.append(time.perf_counter() - t0)
        losses.append(float(total) / float(labels))
    peak = torch.cuda.max_memory_allocated() if args.device.startswith("cuda") else 0
    print(f"torch train step: median {sorted(seconds)[len(seconds) // 2] * 1000:.1f} ms", flush=True)
    with open(os.path.join(out, "torch.json"), "w") as f:
        json.dump(dict(seconds=seconds, losses=losses, peak_bytes=peak), f)


def generate(args):
    out = os.path.join(args.out, "generate")
    os.makedirs(out, exist_ok=True)
    model_dir = os.path.join(args.out, "train", "model")
    model = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(args.device).eval()
    vocab = model.config.vocab_size
    batches = [int(b) for b in args.batches.split(",")]
    rng = random.Random(5)
    prompts = [[rng.randrange(1, vocab) for _ in range(rng.randint(48, 64))] for _ in range(max(batches))]
    result = dict(prompts=prompts, new_tokens=args.new_tokens, runs={})
    for b in batches:
        rows = prompts[:b]
        width = max(len(p) for p in rows)
        # Left-padded, as generate expects for a batch.
        ids = torch.zeros(b, width, dtype=torch.long)
        attn = torch.zeros(b, width, dtype=torch.long)
        for i, p in enumerate(rows):
            ids[i, width - len(p):] = torch.tensor(p)
            attn[i, width - len(p):] = 1
        ids, attn = ids.to(args.device), attn.to(args.device)
        kw = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                  pad_token_id=0, eos_token_id=None)
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=attn, **kw)
            seconds, tokens = [], None
            for _ in range(args.repeats):
                sync(args.device)
                t0 = time.perf_counter()
                gen = model.generate(input_ids=ids, attention_mask=attn, **kw)
                sync(args.device)
                seconds.append(time.perf_counter() - t0)
                tokens = gen[:, width:].tolist()
        result["runs"][str(b)] = dict(seconds=seconds, tokens=tokens)
        print(f"transformers generate batch {b}: best {b * args.new_tokens / min(seconds):.0f} tokens/s", flush=True)
    with open(os.path.join(out, "torch.json"), "w") as f:
        json.dump(result, f)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("command", choices=["parity", "train", "generate"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--small", action="store_true", help="a tiny model instead of Qwen3-0.6B's shape (CPU dry runs)")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    {"parity": parity, "train": train, "generate": generate}[args.command](args)


if __name__ == "__main__":
    main()
