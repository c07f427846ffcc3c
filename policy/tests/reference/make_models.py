"""Makes tiny random Hugging Face models and what `transformers` computes with them: the
reference that policy/tests/transformers_parity.rs holds Tutor's model to.

    python make_models.py OUT_DIR

writes, for every configuration NAME in CONFIGS:
    OUT_DIR/NAME/        the model, saved by `save_pretrained` (config.json, model.safetensors)
    OUT_DIR/NAME.json    input ids + attention mask (right-padded batch), the logits of the
                         real tokens, the per-token log-probs of each next real token, and a
                         32-step greedy generation (prompt, tokens, each token's log-prob)
and OUT_DIR/manifest.json listing the configurations.

Everything is seeded, so the output depends only on the versions of torch and transformers
(pinned in requirements-dev.txt at the workspace root; `make setup` installs them).
"""
import json
import os
import sys

import torch
import transformers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

VOCAB = 64
GREEDY_STEPS = 32

# Shared by every configuration: tiny, so the whole set is made in seconds.
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    rms_norm_eps=1e-6,
    max_position_embeddings=128,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)

# name -> (config class, model class, keyword arguments on top of COMMON). After saving,
# EDITS rewrite some config.json files into layouts that real checkpoints have and that
# `transformers` reads the same way: no `head_dim` (Llama derives it), and the older
# top-level `rope_theta` + `rope_scaling` (with the old key `type`) instead of
# `rope_parameters`.
CONFIGS = {
    # GQA (4 query heads share 2 kv heads), head_dim != hidden / heads, untied lm_head.
    "qwen3_gqa2_untied": (
        Qwen3Config,
        Qwen3ForCausalLM,
        dict(
            num_key_value_heads=2,
            head_dim=16,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
        ),
    ),
    # Multi-head attention (GQA ratio 1), lm_head tied to the embedding, q/k/v/o biases.
    "qwen3_mha_tied_bias": (
        Qwen3Config,
        Qwen3ForCausalLM,
        dict(
            num_key_value_heads=4,
            head_dim=8,
            tie_word_embeddings=True,
            attention_bias=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
    ),
    # Linear RoPE scaling (position interpolation).
    "qwen3_rope_linear": (
        Qwen3Config,
        Qwen3ForCausalLM,
        dict(
            num_key_value_heads=2,
            head_dim=8,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "linear", "rope_theta": 1000.0, "factor": 4.0},
        ),
    ),
    # YaRN, with an original context shorter than the generation so all of it matters.
    "qwen3_rope_yarn": (
        Qwen3Config,
        Qwen3ForCausalLM,
        dict(
            num_key_value_heads=2,
            head_dim=16,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 1000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
    ),
    # Llama: no q/k norm, head_dim left out (derived as hidden / heads), GQA.
    "llama_gqa2": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(
            num_key_value_heads=2,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        ),
    ),
    # Llama with attention and MLP biases, tied embeddings and Llama 3.1 RoPE scaling.
    "llama_bias_tied_llama3rope": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(
            num_key_value_heads=4,
            tie_word_embeddings=True,
            attention_bias=True,
            mlp_bias=True,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
    ),
    # Qwen2: q/k/v biases (always), no o bias, no q/k norm; tied embeddings.
    "qwen2_gqa2_tied": (
        Qwen2Config,
        Qwen2ForCausalLM,
        dict(
            num_key_value_heads=2,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
    ),
}

EDITS = {
    "llama_gqa2": "drop_head_dim",
    "llama_bias_tied_llama3rope": "legacy_rope",
}

# A right-padded batch: row 1 has 4 real tokens.
INPUT_IDS = [[3, 17, 5, 40, 22, 9, 11, 30, 61, 2], [7, 1, 44, 2, 0, 0, 0, 0, 0, 0]]
ATTENTION_MASK = [[1] * 10, [1, 1, 1, 1, 0, 0, 0, 0, 0, 0]]
GREEDY_PROMPT = [5, 6, 7, 8, 9]


def edit_config(path, edit):
    if edit is None:
        return
    with open(path) as f:
        config = json.load(f)
    if edit == "drop_head_dim":
        del config["head_dim"]
    elif edit == "legacy_rope":
        rope = config.pop("rope_parameters")
        config["rope_theta"] = rope.pop("rope_theta")
        rope["type"] = rope.pop("rope_type")
        config["rope_scaling"] = rope
    else:
        raise ValueError(edit)
    with open(path, "w") as f:
        json.dump(config, f, indent=2)


def make(name, config_cls, model_cls, kwargs, seed, out_dir):
    torch.manual_seed(seed)
    config = config_cls(**COMMON, **kwargs)
    config._attn_implementation = "eager"
    model = model_cls(config).eval()
    # Larger-than-default weights, non-unit norms and non-zero biases, so that every detail
    # (names, layouts, norms, biases, RoPE) moves the logits.
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            else:
                p.copy_(0.25 * torch.randn_like(p))
    model_dir = os.path.join(out_dir, name)
    model.save_pretrained(model_dir, safe_serialization=True)
    edit_config(os.path.join(model_dir, "config.json"), EDITS.get(name))
    # What follows is computed by the model as reloaded, so the edited config is covered.
    model = model_cls.from_pretrained(model_dir, attn_implementation="eager").eval()

    ids = torch.tensor(INPUT_IDS)
    mask = torch.tensor(ATTENTION_MASK)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
        logp = torch.log_softmax(logits, dim=-1)
        prompt = torch.tensor([GREEDY_PROMPT])
        gen = model.generate(
            prompt,
            max_new_tokens=GREEDY_STEPS,
            min_new_tokens=GREEDY_STEPS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
        )
    tokens = gen.sequences[0, prompt.shape[1]:].tolist()
    assert len(tokens) == GREEDY_STEPS, (name, tokens)
    gen_logprobs = [
        torch.log_softmax(score[0].float(), dim=-1)[tok].item()
        for score, tok in zip(gen.scores, tokens)
    ]
    # Smallest gap between the best and second-best logit over the greedy steps: a tie
    # (gap ~ 0) would make the greedy comparison meaningless, so it is recorded and checked.
    min_gap = min(
        (torch.topk(score[0].float(), 2).values[0] - torch.topk(score[0].float(), 2).values[1]).item()
        for score in gen.scores
    )

    rows_logits, rows_logprobs = [], []
    for b, row_mask in enumerate(ATTENTION_MASK):
        n = sum(row_mask)
        rows_logits.append(logits[b, :n].tolist())
        # log p(token t+1 | tokens <= t) for each real next token.
        rows_logprobs.append(
            [logp[b, t, INPUT_IDS[b][t + 1]].item() for t in range(n - 1)]
        )
    reference = {
        "name": name,
        "architecture": model_cls.__name__,
        "model_type": config.model_type,
        "input_ids": INPUT_IDS,
        "attention_mask": ATTENTION_MASK,
        "logits": rows_logits,
        "token_logprobs": rows_logprobs,
        "greedy_prompt": GREEDY_PROMPT,
        "greedy_tokens": tokens,
        "greedy_logprobs": gen_logprobs,
        "greedy_min_top2_gap": min_gap,
    }
    with open(os.path.join(out_dir, name + ".json"), "w") as f:
        json.dump(reference, f)
    return reference


def main():
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} OUT_DIR")
    out_dir = sys.argv[1]
    os.makedirs(out_dir, exist_ok=True)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    transformers.utils.logging.disable_progress_bar()
    names = []
    for seed, (name, (config_cls, model_cls, kwargs)) in enumerate(CONFIGS.items()):
        ref = make(name, config_cls, model_cls, kwargs, seed, out_dir)
        names.append(name)
        print(f"{name}: {ref['architecture']}, greedy min top-2 gap {ref['greedy_min_top2_gap']:.4f}")
    manifest = {
        "configs": names,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    with open(os.path.join(out_dir, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    print("wrote", out_dir, "with transformers", transformers.__version__)


if __name__ == "__main__":
    main()
