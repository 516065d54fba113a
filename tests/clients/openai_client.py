"""The official `openai` Python client against a running router.

Usage: openai_client.py ROUTER_URL MODEL

Checks what a standard client needs and exits non-zero with a message on the
first thing that does not hold: models, completions (token-id and text
prompts), chat completions (streamed with a usage-only last chunk, and not;
max_completion_tokens; a second turn reporting its cached prefix), usage with
cached tokens, streaming with a usage-only last chunk, and OpenAI-shaped
errors for bad requests. The router runs with the shipped tokenizer
(deploy/tokenizer).
"""

import sys
import time

import openai


def check(cond, what):
    if not cond:
        sys.exit(f"FAIL: {what}")
    print(f"ok: {what}")


def main():
    url, model = sys.argv[1], sys.argv[2]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)

    models = client.models.list()
    ids = [m.id for m in models.data]
    check(ids == [model], f"models.list() serves {model} (got {ids})")
    check(client.models.retrieve(model).id == model, "models.retrieve(model)")
    try:
        client.models.retrieve("no-such-model")
        check(False, "models.retrieve of another model is a 404")
    except openai.NotFoundError:
        check(True, "models.retrieve of another model is a 404")

    # A cold prompt, then the same conversation one turn later: the second
    # turn's prompt holds the first and its answer, so its prefix is cached.
    prompt = [(i * 7919 + 13) % 30000 + 100 for i in range(2048)]
    first = client.completions.create(model=model, prompt=prompt, max_tokens=8)
    check(len(first.choices) == 1, "one choice")
    check(first.choices[0].finish_reason == "length", "finish_reason length")
    check(first.usage.prompt_tokens == len(prompt), f"usage.prompt_tokens {first.usage.prompt_tokens}")
    check(first.usage.completion_tokens == 8, f"usage.completion_tokens {first.usage.completion_tokens}")
    details = first.usage.prompt_tokens_details
    check(details is not None and isinstance(details.cached_tokens, int),
          "usage.prompt_tokens_details.cached_tokens is a number")
    answer = (first.choices[0].model_extra or {}).get("token_ids")
    check(isinstance(answer, list) and len(answer) == 8, "the answer's token ids come back")

    second_prompt = prompt + answer + [101, 102, 103, 104]
    deadline = time.time() + 20
    while True:
        second = client.completions.create(model=model, prompt=second_prompt, max_tokens=4)
        cached = second.usage.prompt_tokens_details.cached_tokens
        if cached >= 1024 or time.time() > deadline:
            break
        time.sleep(0.5)
    check(cached >= 1024, f"turn 2 reports its cached prefix (cached_tokens {cached})")

    chunks = list(client.completions.create(
        model=model, prompt=prompt, max_tokens=6, stream=True,
        stream_options={"include_usage": True}))
    check(len(chunks) >= 2, f"a stream of chunks ({len(chunks)})")
    last = chunks[-1]
    check(last.choices == [] and last.usage is not None and last.usage.completion_tokens == 6,
          "the last chunk carries only the usage (choices: [])")
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    check("length" in finishes, "a chunk carries finish_reason")

    try:
        client.completions.create(model="no-such-model", prompt=prompt, max_tokens=4)
        check(False, "an unknown model is a 404")
    except openai.NotFoundError as e:
        check(e.param == "model", f"an unknown model is a 404 naming the model (param {e.param!r})")
    try:
        client.completions.create(model=model, prompt=prompt, max_tokens=1_000_000_000)
        check(False, "an over-long request is a 400")
    except openai.BadRequestError:
        check(True, "an over-long request is a 400")
    try:
        client.completions.create(model=model, prompt=prompt, max_tokens=4,
                                  extra_body={"temprature": 0.5})
        check(False, "a misspelt field is a 400")
    except openai.BadRequestError as e:
        check(e.param == "temprature", f"a misspelt field is a 400 naming it (param {e.param!r})")
    check_text_and_chat(client, model)
    print("all checks passed")


def check_text_and_chat(client, model):
    text = client.completions.create(model=model, prompt="Hello world, tell me a story.", max_tokens=8)
    check(text.usage.prompt_tokens > 0 and text.usage.completion_tokens == 8,
          f"a text prompt is tokenized (usage {text.usage.prompt_tokens}/{text.usage.completion_tokens})")
    check(isinstance(text.choices[0].text, str) and text.choices[0].text != "",
          "a text prompt's answer comes back as text")

    system = "You are a helpful assistant. " + " ".join(f"rule {i}: answer briefly and politely." for i in range(200))
    messages = [{"role": "system", "content": system},
                {"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(model=model, messages=messages, max_completion_tokens=8)
    check(chat.object == "chat.completion", f"a chat.completion (object {chat.object!r})")
    check(len(chat.choices) == 1 and chat.choices[0].message.role == "assistant",
          "one choice, the assistant's message")
    content = chat.choices[0].message.content
    check(isinstance(content, str) and content != "", f"the message has text content ({content[:40]!r})")
    check(chat.choices[0].finish_reason == "length", "finish_reason length")
    check(chat.usage.completion_tokens == 8, f"max_completion_tokens is honoured ({chat.usage.completion_tokens})")
    check(chat.usage.prompt_tokens > 1000, f"usage.prompt_tokens of the rendered chat ({chat.usage.prompt_tokens})")
    check(chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens, "usage.total_tokens")
    check(chat.usage.prompt_tokens_details is not None
          and isinstance(chat.usage.prompt_tokens_details.cached_tokens, int),
          "chat usage.prompt_tokens_details.cached_tokens is a number")

    # The conversation's next turn: its prefix (the first turn) is cached.
    messages += [{"role": "assistant", "content": content},
                 {"role": "user", "content": "And of Italy?"}]
    deadline = time.time() + 20
    while True:
        second = client.chat.completions.create(model=model, messages=messages, max_completion_tokens=4)
        cached = second.usage.prompt_tokens_details.cached_tokens
        if cached >= 1024 or time.time() > deadline:
            break
        time.sleep(0.5)
    check(cached >= 1024, f"a chat's second turn reports its cached prefix (cached_tokens {cached})")

    chunks = list(client.chat.completions.create(
        model=model, messages=messages, max_completion_tokens=6, stream=True,
        stream_options={"include_usage": True}))
    check(len(chunks) >= 2 and all(c.object == "chat.completion.chunk" for c in chunks),
          f"a stream of chat.completion.chunk ({len(chunks)})")
    last = chunks[-1]
    check(last.choices == [] and last.usage is not None and last.usage.completion_tokens == 6,
          "the chat stream's last chunk carries only the usage (choices: [])")
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    check(any(d.role == "assistant" for d in deltas), "a delta names the assistant's role")
    streamed = "".join(d.content or "" for d in deltas)
    check(streamed != "", f"the deltas carry the text ({streamed[:40]!r})")
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    check("length" in finishes, "a chat chunk carries finish_reason")

    plain = list(client.chat.completions.create(
        model=model, messages=messages, max_tokens=3, stream=True))
    check(all(c.choices for c in plain), "without include_usage, no usage-only chunk")

    try:
        client.chat.completions.create(model=model, messages=messages, max_tokens=4,
                                       max_completion_tokens=4)
        check(False, "max_tokens and max_completion_tokens together are a 400")
    except openai.BadRequestError as e:
        check(e.param == "max_completion_tokens", f"both token limits are a 400 naming one (param {e.param!r})")
    try:
        client.chat.completions.create(model=model, messages=[], max_tokens=4)
        check(False, "no messages is a 400")
    except openai.BadRequestError as e:
        check(e.param == "messages", f"no messages is a 400 naming them (param {e.param!r})")
    try:
        client.chat.completions.create(model="no-such-model", messages=messages, max_tokens=4)
        check(False, "a chat for an unknown model is a 404")
    except openai.NotFoundError:
        check(True, "a chat for an unknown model is a 404")


if __name__ == "__main__":
    main()
