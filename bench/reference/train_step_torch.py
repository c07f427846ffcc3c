"""Reference for `cargo run --release -p tutor-bench --bin policy`: one training step of
the benchmark's model in PyTorch eager (`transformers`' Qwen3ForCausalLM, its default
attention), the same step Tutor's learner takes (learner/src/loss/cross_entropy.rs, on the step loop
of learner/src/trainer/step.rs): right-padded batch, summed next-token cross-entropy over
label tokens, backward, gradients divided by the label count, clipping by global norm,
AdamW.

    python train_step_torch.py --model DIR --batch BATCH.json --threads N --steps S --out OUT.json

BATCH.json: {"examples": [[token ids], ...], "loss_masks": [[0/1 per token], ...],
"lr", "weight_decay", "beta1", "beta2", "eps", "grad_clip"}. One warm-up step, then S
timed steps; OUT.json gets the wall and CPU seconds (all threads) of each timed step
and each step's loss.
"""
import argparse
import json
import time

import torch
from transformers import Qwen3ForCausalLM


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", required=True)
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with open(args.batch) as f:
        spec = json.load(f)

    model = Qwen3ForCausalLM.from_pretrained(args.model).train()
    examples, masks = spec["examples"], spec["loss_masks"]
    width = max(len(e) for e in examples)
    ids = torch.zeros(len(examples), width, dtype=torch.long)
    attn = torch.zeros(len(examples), width, dtype=torch.long)
    loss_mask = torch.zeros(len(examples), width)
    for i, (e, m) in enumerate(zip(examples, masks)):
        ids[i, : len(e)] = torch.tensor(e)
        attn[i, : len(e)] = 1
        loss_mask[i, 1 : len(e)] = torch.tensor(m[1:], dtype=torch.float)
    labels = loss_mask.sum()

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        params,
        lr=spec["lr"],
        betas=(spec["beta1"], spec["beta2"]),
        eps=spec["eps"],
        weight_decay=spec["weight_decay"],
    )

    def step():
        opt.zero_grad(set_to_none=True)
        logits = model(input_ids=ids, attention_mask=attn).logits
        logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        nll = -logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        total = (nll * loss_mask[:, 1:]).sum()
        total.backward()
        for p in params:
            if p.grad is not None:
                p.grad.div_(labels)
        torch.nn.utils.clip_grad_norm_(params, spec["grad_clip"])
        opt.step()
        return float(total.detach()) / float(labels)

    step()  # warm-up
    seconds, cpu, losses = [], [], []
    for _ in range(args.steps):
        t0, c0 = time.perf_counter(), time.process_time()
        losses.append(step())
        seconds.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    print(f"torch train step: best {min(seconds) * 1000:.1f} ms", flush=True)
    with open(args.out, "w") as f:
        json.dump(dict(seconds=seconds, cpu_seconds=cpu, losses=losses, threads=torch.get_num_threads()), f)


if __name__ == "__main__":
    main()
