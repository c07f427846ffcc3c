"""Makes a tiny random Qwen3 checkpoint the way a user's would look: `save_pretrained`
output (config.json, model.safetensors) plus a byte-level BPE tokenizer.json with the
ChatML special tokens, trained here with Hugging Face `tokenizers`.

    python make_model.py OUT_DIR [MAX_POSITIONS] [HIDDEN_SIZE]

MAX_POSITIONS (default 256) is the context length; HIDDEN_SIZE (default 64) changes the
shapes, for a checkpoint that does not fit another.
"""
import sys

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import Qwen3Config, Qwen3ForCausalLM

out = sys.argv[1]
max_positions = int(sys.argv[2]) if len(sys.argv) > 2 else 256
hidden = int(sys.argv[3]) if len(sys.argv) > 3 else 64
corpus = [
    f"line {i}: the quick brown fox jumps over the lazy dog {i} times; def f(x): return x * {i}"
    for i in range(50)
]
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(
    vocab_size=400,
    special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
)
tok.train_from_iterator(corpus, trainer)
tok.save(f"{out}/tokenizer.json")

torch.manual_seed(0)
config = Qwen3Config(
    vocab_size=tok.get_vocab_size(),
    hidden_size=hidden,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=max_positions,
    eos_token_id=tok.token_to_id("<|im_end|>"),
    bos_token_id=None,
    pad_token_id=None,
)
model = Qwen3ForCausalLM(config)
# A random init at std 0.02 is almost uniform; larger weights give peaked, more
# text-like distributions, so stop strings, top_p and greedy ties behave as with a real model.
with torch.no_grad():
    for name, p in model.named_parameters():
        if p.dim() == 2:
            p.normal_(0.0, 0.2)
model.save_pretrained(out)
