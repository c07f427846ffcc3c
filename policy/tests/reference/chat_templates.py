"""Makes tokenizer directories with chat templates, saved by `transformers`, and what
`apply_chat_template` renders with them: the reference policy/tests/chat_template.rs holds
Tutor's minijinja rendering to.

    python chat_templates.py OUT_DIR

writes, for every template NAME in TEMPLATES:
    OUT_DIR/NAME/       `save_pretrained` of a small byte-level BPE tokenizer (trained here)
                        with the template set (tokenizer.json, tokenizer_config.json and,
                        as current transformers writes it, chat_template.jinja)
    OUT_DIR/NAME.json   {"cases": [{"messages", "add_generation_prompt", "text", "ids"}]}:
                        apply_chat_template(tokenize=False) and the ids of that text;
                        "episode": an episode's conversation (system, task, then turns
                        of assistant action and user observation) with the text and ids
                        apply_chat_template(add_generation_prompt=True) gives at each
                        turn; "stops": the ids generation stops on (the turn's closing
                        token, then generation_config.json's eos_token_id)
and OUT_DIR/manifest.json listing the names.

"llama3_only" is a Llama-3 tokenizer with no ChatML token at all, and a
generation_config.json naming two end-of-sequence ids, as Meta's checkpoints ship.
"""
import json
import os
import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast

SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]

# The Qwen3 chat template's structure: system first, last-query detection over the
# reversed messages with a namespace, <think> splitting of assistant turns, tool turns
# folded into user turns, tool calls with tojson.
QWEN3 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {{- '\n<tool_call>\n' + tool_call | tojson + '\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""

# Llama 3's: bos_token first, headers, `| trim`ed contents, <|eot_id|>.
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# Llama 3.1's system-message handling (a `date_string` default, messages[1:],
# raise_exception for a bad conversation) and transformers' tojson (indent, no HTML
# escaping), in blocks whose whitespace trim_blocks/lstrip_blocks decide.
LLAMA31_JSON = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{% for message in messages %}
  {% if message.role not in ['user', 'assistant'] %}
    {{ raise_exception('Unknown role: ' + message.role) }}
  {% endif %}
  {% if loop.first %}
{{ messages | tojson }}
{{ message | tojson(indent=2) }}
  {% endif %}
{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
{% endfor %}
{% if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{% endif %}
"""

LLAMA3_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]

TEMPLATES = {
    "qwen3": (QWEN3, dict(eos_token="<|im_end|>", pad_token="<|endoftext|>")),
    "llama3": (LLAMA3, dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")),
    "llama31_json": (LLAMA31_JSON, dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")),
    "llama3_only": (LLAMA3, dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")),
}

# What each template closes an assistant turn with, and the end-of-sequence ids each
# generation_config.json names (by token text; none: no generation_config.json).
TURN_END = {"qwen3": "<|im_end|>", "llama3": "<|eot_id|>", "llama31_json": "<|eot_id|>", "llama3_only": "<|eot_id|>"}
GENERATION_EOS = {"llama3_only": ["<|end_of_text|>", "<|eot_id|>"]}

# An episode as Tutor renders one: system and task, then (action, observation) turns.
# Contents without surrounding whitespace, which Llama-3's template trims.
EPISODE = [
    {"role": "system", "content": "You are a careful engineer."},
    {"role": "user", "content": "Fix the bug in src/main.py"},
    {"role": "assistant", "content": "```command\nls -la\n```"},
    {"role": "user", "content": "total 0\nsrc"},
    {"role": "assistant", "content": "```command\ncat src/main.py\n```"},
    {"role": "user", "content": "def add(a, b):\n    return a - b"},
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "You are a careful engineer. Use <tags> & \"quotes\"."},
        {"role": "user", "content": "  Fix the bug in src/main.py\n"},
    ],
    [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "<think>\nplan it\n</think>\n\nls -la"},
        {"role": "user", "content": "ünïcödé 🦀 output:\n\ttotal 0\n"},
        {"role": "assistant", "content": "cat README"},
    ],
    [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "<tool_response>\nok\n</tool_response>"},
    ],
]

CORPUS = [
    "You are a careful engineer. Fix the bug in src/main.py",
    "Hello! first ls -la cat README total output",
    "def add(a, b):\n    return a + b\n",
    "system user assistant think plan tool response",
] * 4


def train(specials):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        min_frequency=2,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def main(out):
    shared = train(SPECIALS)
    for name, (template, specials) in TEMPLATES.items():
        tok = train(LLAMA3_SPECIALS) if name == "llama3_only" else shared
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, **specials)
        fast.chat_template = template
        path = os.path.join(out, name)
        fast.save_pretrained(path)
        eos = [fast.convert_tokens_to_ids(t) for t in GENERATION_EOS.get(name, [])]
        if eos:
            GenerationConfig(eos_token_id=eos, bos_token_id=fast.bos_token_id).save_pretrained(path)
        fast = PreTrainedTokenizerFast.from_pretrained(path)
        cases = []
        for messages in CONVERSATIONS:
            for agp in (False, True):
                text = fast.apply_chat_template(messages, tokenize=False, add_generation_prompt=agp)
                ids = fast.encode(text, add_special_tokens=False)
                cases.append(dict(messages=messages, add_generation_prompt=agp, text=text, ids=ids))
        # A template's own error, for the Rust side to raise the same way.
        if name == "llama31_json":
            bad = [{"role": "system", "content": "s"}, {"role": "tool", "content": "x"}]
            try:
                fast.apply_chat_template(bad, tokenize=False)
                raise SystemExit("expected the template to raise")
            except Exception as e:  # jinja2's TemplateError
                cases.append(dict(messages=bad, add_generation_prompt=False, error=str(e)))
        # The episode's context after its prompt and after each observation: what the
        # student sees when it generates.
        episode = []
        for end in range(2, len(EPISODE) + 1, 2):
            messages = EPISODE[:end]
            text = fast.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            ids = fast.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
            if not isinstance(ids, list):  # a BatchEncoding in some versions
                ids = ids["input_ids"]
            episode.append(dict(messages=messages, text=text, ids=ids))
        turn_end = fast.convert_tokens_to_ids(TURN_END[name])
        stops = [turn_end] + [i for i in eos if i != turn_end]
        with open(os.path.join(out, name + ".json"), "w") as f:
            json.dump(
                dict(files=sorted(os.listdir(path)), cases=cases, episode=episode, stops=stops),
                f,
                ensure_ascii=False,
                indent=1,
            )
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(dict(templates=list(TEMPLATES)), f)


if __name__ == "__main__":
    main(sys.argv[1])
