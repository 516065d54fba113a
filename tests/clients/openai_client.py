"""The official `openai` Python client against a running router.

Usage: openai_client.py ROUTER_URL MODEL [--engine sim|vllm]

Checks what a standard client needs and exits non-zero with a message on the
first thing that does not hold: models, completions (token-id and text
prompts), chat completions (streamed with a usage-only last chunk, and not;
max_completion_tokens; a second turn reporting its cached prefix), usage with
cached tokens, streaming with a usage-only last chunk, and OpenAI-shaped
errors for bad requests; several choices (`n`, a batch of prompts, token-id
or text), `echo`, and `logprobs` (completions and chat, streamed and not).
The router runs with the shipped tokenizer (deploy/tokenizer).

`--engine sim` (the default): the simulated engines, which cannot give
log-probabilities, so `logprobs` must be a 400 naming it; every other check
runs. `--engine vllm`: mock-vllm engines behind the vLLM adapter; only the
choices, echo and logprobs checks run, and the log-probabilities must come
back in the shapes the client parses.
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
    engine = sys.argv[4] if len(sys.argv) > 4 and sys.argv[3] == "--engine" else "sim"
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    if engine == "vllm":
        check_choices(client, model, engine_logprobs=True)
        print("all checks passed")
        return

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
    check_choices(client, model, engine_logprobs=False)
    print("all checks passed")


def check_choices(client, model, engine_logprobs):
    """n, prompt batches, echo and logprobs: each choice its own routed
    request, numbered prompt-major, the usage summed over the choices."""
    prompt = [(i * 31 + 7) % 30000 + 100 for i in range(64)]
    two = client.completions.create(model=model, prompt=prompt, max_tokens=4, n=2)
    check([c.index for c in two.choices] == [0, 1], f"n=2 gives choices 0 and 1 ({len(two.choices)})")
    check(all(c.finish_reason == "length" for c in two.choices), "each choice has its finish_reason")
    check(two.usage.prompt_tokens == 64 and two.usage.completion_tokens == 8,
          f"usage counts the prompt once and sums the choices ({two.usage.prompt_tokens}/{two.usage.completion_tokens})")

    ids = client.completions.create(model=model, prompt=[prompt[:40], prompt[40:]], max_tokens=3, n=2)
    check([c.index for c in ids.choices] == [0, 1, 2, 3],
          "a batch of two token-id prompts with n=2 gives choices 0..3")
    check(ids.usage.prompt_tokens == 64 and ids.usage.completion_tokens == 12,
          f"a batch's usage sums its prompts and choices ({ids.usage.prompt_tokens}/{ids.usage.completion_tokens})")
    texts = ["Hello there.", "Tell me a story about a dragon."]
    alone = [client.completions.create(model=model, prompt=t, max_tokens=2).usage.prompt_tokens for t in texts]
    batch = client.completions.create(model=model, prompt=texts, max_tokens=2)
    check([c.index for c in batch.choices] == [0, 1], "a batch of two text prompts gives two choices")
    check(batch.usage.prompt_tokens == sum(alone),
          f"a text batch's prompt tokens are its prompts' ({batch.usage.prompt_tokens} = {alone})")

    echo = client.completions.create(model=model, prompt=texts[1], max_tokens=4, echo=True)
    check(echo.choices[0].text.startswith(texts[1]) and len(echo.choices[0].text) > len(texts[1]),
          f"echo=True: the text starts with the prompt ({echo.choices[0].text[:50]!r})")

    chunks = list(client.completions.create(
        model=model, prompt=prompt, max_tokens=3, n=2, stream=True,
        stream_options={"include_usage": True}))
    indices = {c.index for ch in chunks for c in ch.choices}
    finishes = [c.index for ch in chunks for c in ch.choices if c.finish_reason]
    check(indices == {0, 1} and sorted(finishes) == [0, 1],
          f"streamed n=2: chunks of both choices, each finished once ({sorted(finishes)})")
    check(chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6,
          "streamed n=2: the usage-only last chunk sums both choices")

    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi!"}], max_completion_tokens=3, n=2)
    check([c.index for c in chat.choices] == [0, 1] and chat.usage.completion_tokens == 6,
          "chat n=2 gives two messages")

    if not engine_logprobs:
        try:
            client.completions.create(model=model, prompt=prompt, max_tokens=3, logprobs=2)
            check(False, "logprobs on an engine without them is a 400")
        except openai.BadRequestError as e:
            check(e.param == "logprobs", f"logprobs on an engine without them is a 400 naming it (param {e.param!r})")
        return

    lp = client.completions.create(model=model, prompt=prompt, max_tokens=4, logprobs=2, n=2)
    for c in lp.choices:
        l = c.logprobs
        check(l is not None and len(l.tokens) == 4 and len(l.token_logprobs) == 4,
              f"choice {c.index}: logprobs per token")
        check(all(isinstance(x, float) and x <= 0 for x in l.token_logprobs), "token_logprobs are log-probabilities")
        check(len(l.top_logprobs) == 4 and all(1 <= len(t) <= 2 and all(v <= 0 for v in t.values())
                                                for t in l.top_logprobs),
              "top_logprobs: at most 2 alternatives a token")
        check(l.text_offset == sorted(l.text_offset) and l.text_offset[0] == 0, "text_offset grows from 0")
    streamed = list(client.completions.create(
        model=model, prompt=prompt, max_tokens=4, logprobs=1, stream=True))
    got = sum(len(c.logprobs.tokens) for ch in streamed for c in ch.choices if c.logprobs)
    check(got == 4, f"streamed logprobs: one a token ({got})")
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi!"}], max_completion_tokens=3,
        logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    check(len(content) == 3 and all(isinstance(t.token, str) and t.logprob <= 0
                                    and 1 <= len(t.top_logprobs) <= 2 for t in content),
          "chat logprobs=True, top_logprobs=2: content per token with alternatives")
    try:
        client.completions.create(model=model, prompt=texts[0], max_tokens=2, logprobs=1, echo=True)
        check(False, "echo with logprobs is a 400")
    except openai.BadRequestError as e:
        check(e.param == "echo", f"echo with logprobs is a 400 naming echo (param {e.param!r})")


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
