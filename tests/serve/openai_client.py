"""Talks to `tutor serve` with the official `openai` client, as a user would.

    python openai_client.py BASE_URL MODEL

Exits non-zero (an AssertionError or the client's exception) on any mismatch; prints
"all checks passed" at the end.
"""
import sys

import openai

base_url, model = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=base_url, api_key="not-needed", max_retries=0, timeout=120)

assert [m.id for m in client.models.list().data] == [model]

messages = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "the quick brown fox"},
    {"role": "assistant", "content": "jumps"},
    {"role": "user", "content": [{"type": "text", "text": "over the lazy dog"}]},
]

# Non-streaming, greedy.
r = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=10)
choice = r.choices[0]
assert choice.message.role == "assistant"
assert isinstance(choice.message.content, str)
assert choice.finish_reason in ("stop", "length"), choice.finish_reason
assert r.usage.completion_tokens == 10 or choice.finish_reason == "stop", r.usage
assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
assert r.model == model and r.object == "chat.completion"

# Streaming the same request: the deltas add up to the same text, with usage at the end.
stream = client.chat.completions.create(
    model=model,
    messages=messages,
    temperature=0,
    max_tokens=10,
    stream=True,
    stream_options={"include_usage": True},
)
parts, finish, usage, n_chunks = [], None, None, 0
for chunk in stream:
    n_chunks += 1
    if chunk.usage is not None:
        usage = chunk.usage
    if chunk.choices:
        parts.append(chunk.choices[0].delta.content or "")
        finish = chunk.choices[0].finish_reason or finish
assert "".join(parts) == choice.message.content, (parts, choice.message.content)
assert finish == choice.finish_reason, finish
assert usage is not None and usage.completion_tokens == r.usage.completion_tokens, usage
assert n_chunks >= 3, n_chunks

# Logprobs with sampling (seeded, nucleus): one entry per token, reproducible by seed, and
# the same tokens and logprobs streamed.
kw = dict(model=model, messages=messages, temperature=0.9, top_p=0.95, max_tokens=12, seed=11)
a = client.chat.completions.create(logprobs=True, top_logprobs=2, **kw)
b = client.chat.completions.create(logprobs=True, top_logprobs=2, **kw)
content = a.choices[0].logprobs.content
assert len(content) == a.usage.completion_tokens, (len(content), a.usage)
for t in content:
    assert t.logprob <= 0.0, t
    assert 1 <= len(t.top_logprobs) <= 2, t
    assert t.top_logprobs[0].logprob >= t.logprob - 1e-6, t
assert [t.logprob for t in content] == [t.logprob for t in b.choices[0].logprobs.content]
assert a.choices[0].message.content == b.choices[0].message.content
streamed = []
for chunk in client.chat.completions.create(logprobs=True, top_logprobs=2, stream=True, **kw):
    if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
        streamed.extend(chunk.choices[0].logprobs.content)
assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]

# Errors arrive as the client's typed exceptions.
try:
    client.chat.completions.create(model="no-such-model", messages=messages)
    raise AssertionError("an unknown model was accepted")
except openai.NotFoundError as e:
    assert "does not exist" in str(e), e
try:
    client.chat.completions.create(model=model, messages=messages, max_tokens=10**6)
    raise AssertionError("max_tokens beyond the context was accepted")
except openai.BadRequestError as e:
    assert "context" in str(e), e

print("all checks passed")
