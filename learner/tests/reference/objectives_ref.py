#!/usr/bin/env python3
"""PyTorch reference for the learner's objectives (learner/src/{loss,objectives}.rs).

Usage: objectives_ref.py IN.json OUT.json

Reads the random inputs written by learner/tests/objectives_reference.rs, computes each
objective from its textbook definition (docs/architecture.md, "Objectives") in float64 with
PyTorch autograd, and writes the values and the gradients w.r.t. the log-probabilities (the
logits for cross-entropy) as JSON. Exit status 3 when torch cannot be imported.
"""

import json
import sys

try:
    import torch
    import torch.nn.functional as F
except Exception as e:  # noqa: BLE001 - any import failure means the venv is not ready
    print(f"cannot import torch ({e}); run `make setup`", file=sys.stderr)
    sys.exit(3)

D = torch.float64


def tensor(values, shape, requires_grad=False):
    t = torch.tensor(values, dtype=D).reshape(shape)
    return t.requires_grad_(requires_grad)


def flat(t):
    return [float(x) for x in t.detach().reshape(-1).tolist()]


def masked_ce(case):
    """Mean next-token cross-entropy over label tokens: position j predicts token j+1;
    mask[j] marks token j as a label; token 0 is never predicted."""
    b, t, v = case["shape"]
    logits = tensor(case["logits"], (b, t, v), requires_grad=True)
    ids = torch.tensor(case["ids"], dtype=torch.int64).reshape(b, t)
    mask = tensor(case["mask"], (b, t))
    nll = F.cross_entropy(
        logits[:, :-1].reshape(-1, v), ids[:, 1:].reshape(-1), reduction="none"
    )
    m = mask[:, 1:].reshape(-1)
    loss = (nll * m).sum() / m.sum().clamp(min=1.0)
    loss.backward()
    return {"loss": loss.item(), "grad_logits": flat(logits.grad)}


def dapo(case):
    """-(1/sum mask) sum mask * min(r A, clip(r, 1-eps_low, 1+eps_high) A),
    r = exp(logp - old_logp); A per sequence ([B]) or per token ([B, T])."""
    shape = case["shape"]
    logp = tensor(case["logprobs"], shape, requires_grad=True)
    old = tensor(case["old_logprobs"], shape)
    adv = tensor(case["advantages"], case["adv_shape"])
    if adv.dim() == 1:
        adv = adv[:, None]
    mask = tensor(case["mask"], shape)
    lo, hi = case["eps_low"], case["eps_high"]
    ratio = torch.exp(logp - old)
    pg_losses = -adv * ratio
    pg_losses2 = -adv * torch.clamp(ratio, 1.0 - lo, 1.0 + hi)
    per_token = torch.max(pg_losses, pg_losses2)  # = -min(rA, clip(r)A)
    n = mask.sum().clamp(min=1.0)
    loss = (per_token * mask).sum() / n
    loss.backward()
    # The clipped term is active where it is strictly the smaller objective.
    clipped = (pg_losses2 > pg_losses).to(D) * mask
    with torch.no_grad():
        adv_full = adv.expand_as(ratio)
    return {
        "loss": loss.item(),
        "grad_logprobs": flat(logp.grad),
        "clip_low": ((clipped * (adv_full < 0)).sum() / n).item(),
        "clip_high": ((clipped * (adv_full > 0)).sum() / n).item(),
    }


def reverse_kl(case):
    """A_t = -(logp_student - logp_teacher) on masked tokens; gradients of sum(w * A)."""
    shape = case["shape"]
    s = tensor(case["student"], shape, requires_grad=True)
    t = tensor(case["teacher"], shape, requires_grad=True)
    mask = tensor(case["mask"], shape)
    w = tensor(case["weights"], shape)
    adv = -(s - t) * mask
    (adv * w).sum().backward()
    return {
        "advantage": flat(adv),
        "grad_student": flat(s.grad),
        "grad_teacher": flat(t.grad),
    }


def group_adv(case):
    """(R - mean_G)/(std_G + delta), population std, consecutive groups of G."""
    g = case["group_size"]
    r = torch.tensor(case["rewards"], dtype=D).reshape(-1, g)
    mean = r.mean(dim=1, keepdim=True)
    std = r.std(dim=1, keepdim=True, correction=0)
    return {"advantages": flat((r - mean) / (std + case["delta"]))}


def main():
    with open(sys.argv[1]) as f:
        inp = json.load(f)
    out = {
        "torch_version": torch.__version__,
        "ce": masked_ce(inp["ce"]),
        "dapo": [dapo(c) for c in inp["dapo"]],
        "reverse_kl": reverse_kl(inp["reverse_kl"]),
        "group_adv": group_adv(inp["group_adv"]),
    }
    with open(sys.argv[2], "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
