"""The tokenizer on real vocabularies: the ones llama.cpp tests its own tokenizer with (Llama 3,
LLaMA/Mistral SentencePiece, Phi-3, Qwen2, Qwen3.5, Gemma 4's 262k, Command-R, DeepSeek, Falcon,
GPT-2, MPT, StarCoder, Refact; scripts/llamacpp_vocabs.py fetches them, scripts/test.sh runs it).

Gemma 4's 262k pieces are also used as a SentencePiece vocabulary, the kind Gemma 1-3 files
carry. Two oracles: llama.cpp's ids for tricky texts and prose, with and without control tokens parsed,
and its BOS policy (tests/fixtures/tokenizers/real_vocabs.json, scripts/real_vocab_fixtures.py);
and the ids each vocabulary's own reference tokenizer gave for llama.cpp's test texts (the
`.gguf.inp`/`.gguf.out` files beside each vocabulary)."""

import hashlib
import json
import os
import re
import sys
from functools import lru_cache
from pathlib import Path

import pytest
from powerinfer_rs import GgufFile
from powerinfer_rs.tokenizer import TOKEN_CONTROL, GGUFTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from llamacpp_vocabs import as_sentencepiece, folder

# a vocabulary rewritten as Gemma 1-3 carry theirs (scripts/llamacpp_vocabs.py, as_sentencepiece)
AS_SPM = "-as-spm"

FIXTURE = json.loads(
    (Path(__file__).parent / "fixtures" / "tokenizers" / "real_vocabs.json").read_text()
)
FOLDER = folder()
pytestmark = pytest.mark.skipif(
    not (FOLDER / ".complete").exists() and not os.environ.get("POWERINFER_VOCABS"),
    reason=f"llama.cpp's vocabularies are not in {FOLDER}: run python scripts/llamacpp_vocabs.py",
)


def vocab_path(name: str) -> Path:
    return FOLDER / f"ggml-vocab-{name}.gguf"


@lru_cache(maxsize=2)
def tokenizer(name: str) -> GGUFTokenizer:
    derived = name.endswith(AS_SPM)
    path = vocab_path(name[: -len(AS_SPM)] if derived else name)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == FIXTURE[name]["sha256"], (
        f"{path} is not the file the fixture was made from"
    )
    # the metadata as the engine reads it when it loads a model
    metadata = GgufFile(str(path)).metadata()
    return GGUFTokenizer(as_sentencepiece(metadata) if derived else metadata, model_path=path)


@pytest.mark.parametrize("name", sorted(FIXTURE))
def test_token_ids_equal_llama_cpp(name):
    tok = tokenizer(name)
    wrong = []
    for case in FIXTURE[name]["cases"]:
        text = case["text"]
        got = tok.encode(text, add_bos=False, special=False)
        if got != case["plain"]:
            wrong.append((text, "plain", got, case["plain"]))
        want = case.get("special", case["plain"])
        got = tok.encode(text, add_bos=False, special=True)
        if got != want:
            wrong.append((text, "special", got, want))
    assert not wrong, (
        f"{len(wrong)} of {len(FIXTURE[name]['cases'])} texts differ from llama.cpp; first: {wrong[0]!r}"
    )


@pytest.mark.parametrize("name", sorted(FIXTURE))
def test_bos_policy_and_detokenized_text_equal_llama_cpp(name):
    """BOS as llama.cpp adds it, and llama.cpp's pieces joined, less the space a SentencePiece
    vocabulary put before the text (llama-cpp-python's detokenize keeps it, llama.cpp's own
    detokenizer and this one drop it)."""
    tok = tokenizer(name)
    assert tok.encode("Hello world") == FIXTURE[name]["hello_with_bos"]
    wrong = []
    for case in FIXTURE[name]["cases"]:
        want = case["detok"]
        if tok.kind == "llama" and tok.add_space_prefix and want.startswith(" "):
            want = want[1:]
        if tok.decode(case["plain"]) != want:
            wrong.append((case["text"], tok.decode(case["plain"]), want))
    assert not wrong, f"{len(wrong)} texts detokenize unlike llama.cpp; first: {wrong[0]!r}"


@pytest.mark.parametrize(
    "name", sorted(n for n in FIXTURE if vocab_path(n).with_suffix(".gguf.out").exists())
)
def test_reference_ids_of_llama_cpp_test_texts(name):
    tok = tokenizer(name)
    path = vocab_path(name)
    texts = (
        path.with_suffix(".gguf.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    )
    outs = path.with_suffix(".gguf.out").read_text(encoding="utf-8").split("\n")
    assert len(texts) > 40
    wrong = []
    for text, out in zip(texts, outs):
        want = [int(x) for x in out.split()]
        got = tok.encode(text, add_bos=False, special=False)
        if got != want:
            wrong.append((text, got, want))
    assert not wrong, (
        f"{len(wrong)} of {len(texts)} texts differ from the reference tokenizer; first: {wrong[0]!r}"
    )


CONVERSATION = [
    {"role": "system", "content": "You answer in one line."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "What is 2+2? Ünïcödé 🤗"},
]


@pytest.mark.parametrize(
    "name", sorted(n for n in FIXTURE if n in ("phi-3", "qwen2", "qwen35", "command-r", "gemma-4"))
)
def test_real_chat_templates_render_to_control_tokens(name):
    """Each file's own chat template renders the conversation, its turn markers become single
    control tokens when the prompt is tokenized as the engine tokenizes chat prompts, and the
    ids give the text back (but for the whitespace Phi-3's markers swallow)."""
    tok = tokenizer(name)
    assert tok.chat_template
    text = tok.apply_chat_template(CONVERSATION)
    assert "What is 2+2? Ünïcödé 🤗" in text and "Hi there" in text
    ids = tok.encode(text, add_bos=False, special=True)
    controls = [i for i in ids if tok.types[i] == TOKEN_CONTROL]
    # every control token's text in the prompt is one id, and the user's text comes back whole
    marked = sum(text.count(tok.tokens[i]) for i in set(controls))
    assert len(controls) >= 4 and len(controls) == marked
    back = tok.decode(ids, special=True)
    if name == "phi-3":
        # the markers eat the whitespace after them; the text after one starts with `▁`
        text = re.sub(r"(<\|[a-z]+\|>)(?=[^<])", r"\1 ", re.sub(r"(<\|[a-z]+\|>)\s+", r"\1", text))
    assert back == text
    assert tok.apply_chat_template(CONVERSATION, add_generation_prompt=False) != text
