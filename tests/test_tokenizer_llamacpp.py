"""The tokenizer against llama.cpp's own token ids (tests/fixtures/tokenizers/, written by
scripts/tokenizer_fixtures.py): a byte-level BPE vocabulary under every `tokenizer.ggml.pre`
the engine knows, and a SentencePiece vocabulary used as LLaMA, Gemma and Phi-3 use theirs,
on spaces, CRLF, digits, CJK, emoji, contractions, control and user-defined tokens and prose."""

import json
from pathlib import Path

import pytest
from powerinfer_rs.tokenizer import GGUFTokenizer

FIXTURES = Path(__file__).parent / "fixtures" / "tokenizers"
VOCABS = json.loads((FIXTURES / "vocabs.json").read_text())
VARIANTS = json.loads((FIXTURES / "llamacpp_ids.json").read_text())


def metadata(variant: dict) -> dict:
    meta = {k: v for k, v in variant["meta"].items() if k != "vocab"}
    vocab = VOCABS[variant["meta"]["vocab"]]
    meta["tokenizer.ggml.tokens"] = vocab["tokens"]
    meta["tokenizer.ggml.token_type"] = vocab["types"]
    if "scores" in vocab:
        meta["tokenizer.ggml.scores"] = vocab["scores"]
    if "merges" in vocab:
        meta["tokenizer.ggml.merges"] = vocab["merges"]
    return meta


_built: dict[str, GGUFTokenizer] = {}


def tokenizer(name: str, pre: str | None = None) -> GGUFTokenizer:
    key = f"{name}:{pre}"
    if key not in _built:
        meta = metadata(VARIANTS[name])
        if pre is not None:
            meta["tokenizer.ggml.pre"] = pre
        _built[key] = GGUFTokenizer(meta)
    return _built[key]


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_token_ids_equal_llama_cpp(name):
    tok = tokenizer(name)
    wrong = []
    for case in VARIANTS[name]["cases"]:
        text = case["text"]
        got = tok.encode(text, add_bos=False, special=False)
        if got != case["plain"]:
            wrong.append((text, "plain", got, case["plain"]))
        want_special = case.get("special", case["plain"])
        got = tok.encode(text, add_bos=False, special=True)
        if got != want_special:
            wrong.append((text, "special", got, want_special))
    assert not wrong, f"{len(wrong)} texts differ from llama.cpp; first: {wrong[0]!r}"


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_bos_policy_equals_llama_cpp(name):
    assert tokenizer(name).encode("Hello world") == VARIANTS[name]["hello_with_bos"]


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_detokenized_text_equals_llama_cpp(name):
    """llama.cpp's pieces, joined; less the space a SentencePiece vocabulary put before the text
    (llama-cpp-python's detokenize keeps it, llama.cpp's own detokenizer and this one drop it)."""
    tok = tokenizer(name)
    wrong = []
    for c in VARIANTS[name]["cases"]:
        want = c["detok"]
        if tok.kind == "llama" and tok.add_space_prefix and want.startswith(" "):
            want = want[1:]
        if tok.decode(c["plain"]) != want:
            wrong.append((c["text"], tok.decode(c["plain"]), want))
    assert not wrong, f"{len(wrong)} texts differ from llama.cpp; first: {wrong[0]!r}"


@pytest.mark.parametrize("name", sorted(n for n in VARIANTS if VARIANTS[n]["aliases"]))
def test_aliases_tokenize_like_their_family(name):
    base = tokenizer(name)
    texts = [c["text"] for c in VARIANTS[name]["cases"]]
    for alias in VARIANTS[name]["aliases"]:
        assert [tokenizer(name, alias).encode(t) for t in texts] == [
            base.encode(t) for t in texts
        ], alias


def test_unknown_pre_tokenizer_names_itself_and_the_supported_ones():
    meta = metadata(VARIANTS["bpe-gpt-2"])
    meta["tokenizer.ggml.pre"] = "no-such-pre"
    with pytest.raises(ValueError, match=r"no-such-pre.*supported: .*llama-bpe.*qwen2"):
        GGUFTokenizer(meta)
