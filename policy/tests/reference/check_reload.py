"""Loads model directories written by Tutor (`Policy::save_dir`) with `transformers`'
`AutoModelForCausalLM.from_pretrained` and compares them with a reference recorded by
make_models.py: the class must be the recorded architecture, every parameter must come
from the checkpoint (none missing, unexpected or re-initialized), and the logits on the
recorded inputs and the greedy tokens must match.

    python check_reload.py [--tol 1e-4] MODEL_DIR REFERENCE_JSON [MODEL_DIR REFERENCE_JSON ...]

Prints one line per model with its max |logit diff|; exits 1 if any check fails.
"""
import argparse
import json
import sys

import torch
import transformers
from transformers import AutoModelForCausalLM


def check(model_dir, reference_path, tol):
    with open(reference_path) as f:
        ref = json.load(f)
    problems = []
    model, info = AutoModelForCausalLM.from_pretrained(
        model_dir, attn_implementation="eager", output_loading_info=True
    )
    model.eval()
    cls = type(model).__name__
    if cls != ref["architecture"]:
        problems.append(f"loaded as {cls}, expected {ref['architecture']}")
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        if info.get(key):
            problems.append(f"{key}: {sorted(info[key])}")

    ids = torch.tensor(ref["input_ids"])
    mask = torch.tensor(ref["attention_mask"])
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
        prompt = torch.tensor([ref["greedy_prompt"]])
        n = len(ref["greedy_tokens"])
        gen = model.generate(
            prompt,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    max_diff = 0.0
    for b, want in enumerate(ref["logits"]):
        want = torch.tensor(want)
        got = logits[b, : want.shape[0]]
        max_diff = max(max_diff, (got - want).abs().max().item())
    if not max_diff <= tol:
        problems.append(f"max |logit diff| {max_diff:.3g} > {tol}")
    tokens = gen[0, prompt.shape[1]:].tolist()
    if tokens != ref["greedy_tokens"]:
        problems.append(f"greedy tokens {tokens} != recorded {ref['greedy_tokens']}")
    return max_diff, problems


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tol", type=float, default=1e-4)
    parser.add_argument("pairs", nargs="+", metavar="MODEL_DIR REFERENCE_JSON")
    args = parser.parse_args()
    if len(args.pairs) % 2:
        parser.error("give MODEL_DIR REFERENCE_JSON pairs")
    torch.set_num_threads(min(2, torch.get_num_threads()))
    transformers.utils.logging.disable_progress_bar()
    failed = False
    for model_dir, reference in zip(args.pairs[::2], args.pairs[1::2]):
        max_diff, problems = check(model_dir, reference, args.tol)
        status = "ok" if not problems else "FAILED: " + "; ".join(problems)
        print(f"{model_dir}: max |logit diff| {max_diff:.3g} vs {reference}: {status}")
        failed |= bool(problems)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
