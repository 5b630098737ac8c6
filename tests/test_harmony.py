"""gpt-oss's harmony output read back as reasoning and answer (`powerinfer_rs.harmony`): the
split of whole outputs against hand-written expectations, the same split whichever pieces the
text streams in, and the server's chat answers for a model with the harmony vocabulary against
the in-process engine's raw text."""

import contextlib
import dataclasses
import io
import itertools
import json
import random

import httpx
import pytest
from gguf import GGUFReader
from powerinfer_rs import Engine, chat
from powerinfer_rs.harmony import HarmonySplit, split
from powerinfer_rs.settings import CHAT
from serving import Server
from synth import write_model

THINK_THEN_ANSWER = (
    "<|channel|>analysis<|message|>The user asks 2+2. Easy.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>"
)
TOOL_CALL = (
    "<|channel|>analysis<|message|>Need the weather.<|end|>"
    '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'
)


@pytest.mark.parametrize(
    "text, want",
    [
        (
            THINK_THEN_ANSWER,
            {"reasoning_content": "The user asks 2+2. Easy.", "content": "2 + 2 = 4."},
        ),
        # a call's arguments are on the commentary channel: content, the header dropped
        (TOOL_CALL, {"reasoning_content": "Need the weather.", "content": '{"city": "Paris"}'}),
        # no reasoning; the answer cut off by max_tokens mid-message
        ("<|channel|>final<|message|>Hello, wor", {"content": "Hello, wor"}),
        # cut off in the header: nothing yet
        ("<|channel|>analy", {"content": ""}),
        # output that ignores the format comes through whole
        ("just text", {"content": "just text"}),
        # text before any markup, then a message
        ("Hi<|channel|>final<|message|>there", {"content": "Hithere"}),
    ],
    ids=["think-answer", "tool-call", "cut-in-message", "cut-in-header", "plain", "lead-text"],
)
def test_whole_outputs_split_into_reasoning_and_answer(text, want):
    assert split(text) == want


def test_any_streaming_of_the_pieces_splits_the_same():
    """Tokens arrive one at a time (markup always whole): every cut of the text between
    markup tokens and inside words gives the whole text's parts, concatenated per field."""
    tokens = [
        "<|channel|>",
        "analysis",
        "<|message|>",
        "The user",
        " asks 2+2",
        ". Easy.",
        "<|end|>",
        "<|start|>",
        "assistant",
        "<|channel|>",
        "final",
        "<|message|>",
        "2 + ",
        "2 = 4.",
        "<|return|>",
    ]
    want = split("".join(tokens))
    for cuts in itertools.combinations(range(1, len(tokens)), 3):
        bounds = [0, *cuts, len(tokens)]
        s = HarmonySplit()
        got: dict[str, str] = {}
        for a, b in zip(bounds, bounds[1:]):
            for field, part in s.push("".join(tokens[a:b])):
                got[field] = got.get(field, "") + part
        assert {"content": "", **got} == want, cuts


HARMONY_TOKENS = (
    "<|start|>",
    "<|channel|>",
    "<|message|>",
    "<|constrain|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
)
# harmony's shape, shortened: each message, then the assistant's header
TEMPLATE = (
    "{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)


@pytest.fixture(scope="module")
def harmony_model(tmp_path_factory):
    """A tiny model with the harmony markup in its vocabulary, its classifier rows for the
    markup scaled up (and the end tokens' zeroed) so that sampled outputs hold many messages on
    several channels."""
    path = write_model(
        tmp_path_factory.mktemp("harmony") / "tiny-harmony.gguf",
        n_ctx=512,
        extra_tokens=HARMONY_TOKENS,
        chat_template=TEMPLATE,
    )
    reader = GGUFReader(path, "r+")
    (out,) = [t for t in reader.tensors if t.name == "output.weight"]
    n = out.data.shape[0]
    first = n - len(HARMONY_TOKENS)
    ids = {t: first + i for i, t in enumerate(HARMONY_TOKENS)}
    for t in ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>"):
        out.data[ids[t]] *= 4.0
    for i in (2, ids["<|return|>"], ids["<|call|>"]):  # <|im_end|>, <|return|>, <|call|>
        out.data[i] = 0.0
    del reader
    return path


def test_the_servers_chat_splits_a_harmony_models_reasoning_from_its_answer(harmony_model):
    engine = Engine.load(harmony_model, threads=2)
    assert engine.tokenizer.harmony
    messages = [{"role": "user", "content": "the then"}]
    kw = dict(max_tokens=120, temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0)
    server = Server(harmony_model)
    try:
        checked = 0
        for seed in range(12):
            raw = engine.chat(messages, seed=seed, **kw)
            body = dict(messages=messages, seed=seed, **kw)
            r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            message = r.json()["choices"][0]["message"]
            assert {k: v for k, v in message.items() if k != "role"} == split(raw)
            # streamed: the same parts, piece by piece
            got: dict[str, str] = {}
            with httpx.stream(
                "POST",
                server.url + "/v1/chat/completions",
                json={**body, "stream": True},
                timeout=60,
            ) as s:
                for line in s.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    for c in json.loads(line[6:])["choices"]:
                        for field in ("content", "reasoning_content"):
                            got[field] = got.get(field, "") + (c["delta"].get(field) or "")
            assert {k: v for k, v in got.items() if v or k == "content"} == split(raw)
            checked += "<|message|>" in raw and "<|channel|>" in raw
        # (the sampled outputs did hold messages)
        assert checked >= 3, checked
    finally:
        server.stop()


def test_chat_in_the_terminal_writes_the_answer_and_keeps_only_it(harmony_model):
    """`powerinfer-rs chat` on a harmony model: the answer's parts to standard output, the
    reasoning to standard error; the next turn's prompt holds the earlier answer alone."""
    engine = Engine.load(harmony_model, threads=2)
    sampling = dataclasses.replace(CHAT, max_tokens=60, temperature=1.5, seed=3)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err):
        assert chat.run(engine, sampling, stdin=io.StringIO("the then\nin an\n"), out=out) == 0
    # each turn's seed drawn from the conversation's, as `chat` draws them
    turns, kwargs = random.Random(3), sampling.as_kwargs()
    u1, u2 = {"role": "user", "content": "the then"}, {"role": "user", "content": "in an"}
    a1 = split(engine.chat([u1], **dict(kwargs, seed=turns.getrandbits(64))))
    history = [u1, {"role": "assistant", "content": a1["content"]}, u2]
    a2 = split(engine.chat(history, **dict(kwargs, seed=turns.getrandbits(64))))
    assert out.getvalue() == f"{a1['content']}\n{a2['content']}\n"
    for a in (a1, a2):
        assert a.get("reasoning_content", "") in err.getvalue()
