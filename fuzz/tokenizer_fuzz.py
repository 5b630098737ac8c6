"""Coverage-guided fuzzing (atheris) of the tokenizers `powerinfer_rs.tokenizer` builds from GGUF
vocabularies: the default model's (SmolLM2, byte-level BPE) and the small vocabularies the tests
use (tests/fixtures/tokenizers: byte-level BPE under every pre-tokenizer, SentencePiece as LLaMA,
Gemma and Phi-3 use it).

An input is one byte choosing the tokenizer, one byte of flags (`special`, which check) and a
payload. The checks, each a promise the tokenizer makes:
- round trip: decode(encode(text)) == text for any valid text where the tokenizer promises it
  (see `round_trips`), and every id is inside the vocabulary;
- decode of arbitrary ids: an id outside the vocabulary raises ValueError naming it, others
  decode, and streaming them through `StreamDecoder` gives the same text as `decode`;
- invalid text (lone surrogates) raises ValueError naming the first one and its index;
- the ids of a text, streamed, give the same text as `decode`.
Any other exception, or a broken promise, is a crash.

    python3 fuzz/tokenizer_fuzz.py fuzz/corpus/tokenizer fuzz/seeds/tokenizer -max_total_time=60
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from synth import byte_chars  # noqa: E402  (the tests' GPT-2 byte table)

FIXTURES = ROOT / "tests" / "fixtures" / "tokenizers"
SMOLLM2 = "smollm2"

CHECK_ROUND_TRIP, CHECK_DECODE_IDS, CHECK_INVALID_TEXT, CHECK_STREAM = range(4)
SPM_SPACE = "\u2581"
# llama.cpp's token types (as powerinfer_rs.tokenizer names them)
TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED = 2, 3, 4

_fixtures: dict | None = None


def _load_fixtures() -> tuple[dict, dict]:
    global _fixtures
    if _fixtures is None:
        vocabs = json.loads((FIXTURES / "vocabs.json").read_text())
        variants = json.loads((FIXTURES / "llamacpp_ids.json").read_text())
        _fixtures = {"vocabs": vocabs, "variants": variants}
    return _fixtures["vocabs"], _fixtures["variants"]


def tokenizer_names() -> list[str]:
    """The fixture vocabularies (as tests/test_tokenizer_llamacpp.py names them), then SmolLM2."""
    return sorted(_load_fixtures()[1]) + [SMOLLM2]


def fixture_texts() -> list[str]:
    """The texts the tokenizer tests compare with llama.cpp on."""
    _, variants = _load_fixtures()
    return [case["text"] for case in next(iter(variants.values()))["cases"]]


def encode_input(tokenizer: int, check: int, special: bool, payload: bytes) -> bytes:
    """An input of this harness (the inverse of `decode_input`)."""
    return bytes([tokenizer % 256, (check << 1) | int(special)]) + payload


def decode_input(data: bytes) -> tuple[int, int, bool, bytes]:
    """(tokenizer index, check, special, payload); short inputs read as zeros."""
    head = data[:2].ljust(2, b"\0")
    return head[0], (head[1] >> 1) % 4, bool(head[1] & 1), data[2:]


def fixture_metadata(name: str) -> dict:
    """A fixture vocabulary's metadata, assembled as tests/test_tokenizer_llamacpp.py does."""
    vocabs, variants = _load_fixtures()
    meta = {k: v for k, v in variants[name]["meta"].items() if k != "vocab"}
    vocab = vocabs[variants[name]["meta"]["vocab"]]
    meta["tokenizer.ggml.tokens"] = vocab["tokens"]
    meta["tokenizer.ggml.token_type"] = vocab["types"]
    if "scores" in vocab:
        meta["tokenizer.ggml.scores"] = vocab["scores"]
    if "merges" in vocab:
        meta["tokenizer.ggml.merges"] = vocab["merges"]
    return meta


def build_tokenizers(tokenizer_class) -> list:
    """Every tokenizer of `tokenizer_names`, SmolLM2's from its GGUF metadata as the engine reads
    it when loading the model."""
    from powerinfer_rs import GgufFile
    from powerinfer_rs.models import default_model_path

    out = []
    for name in tokenizer_names():
        if name == SMOLLM2:
            path = default_model_path()
            out.append(tokenizer_class(GgufFile(path).metadata(), model_path=path))
        else:
            out.append(tokenizer_class(fixture_metadata(name)))
    return out


def missing_bytes(tok) -> frozenset[int]:
    """The byte values the vocabulary has no token for (byte-level BPE: GPT-2's character for the
    byte; SentencePiece: its `<0xNN>` piece). A text holding one loses it, as in llama.cpp."""
    if tok.kind == "gpt2":
        pieces = [byte_chars()[b] for b in range(256)]
    else:
        pieces = [f"<0x{b:02X}>" for b in range(256)]
    have = set(tok.tokens)
    return frozenset(b for b, piece in enumerate(pieces) if piece not in have)


def round_trips(tok, missing: frozenset[int], text: str, ids: list[int], special: bool) -> bool:
    """Whether the tokenizer promises decode(encode(text)) == text. Byte-level BPE spells every
    text whose bytes all have tokens. SentencePiece does too (by byte fallback), except that its
    space mark `▁` decodes to a space and that, as in llama.cpp, the text after a token matched
    before the tokenizer runs (a user-defined one; control ones with `special`) starts with the
    space SentencePiece puts before a text, and Phi-3's such tokens swallow the whitespace
    after them."""
    if missing and not missing.isdisjoint(text.encode("utf-8")):
        return False
    if tok.kind == "gpt2":
        return True
    matched = {TOKEN_USER_DEFINED} | ({TOKEN_CONTROL, TOKEN_UNKNOWN} if special else set())
    return SPM_SPACE not in text and not any(tok.types[i] in matched for i in ids)


def streamed(stream_decoder_class, tok, ids: list[int], special: bool) -> str:
    stream = stream_decoder_class(tok, special=special)
    return "".join(stream.push(i) for i in ids) + stream.flush()


def ids_of(payload: bytes, n_vocab: int) -> list[int]:
    """Token ids from 3-byte little-endian groups: mostly inside the vocabulary, a few just past
    either end, some anywhere in a signed 24-bit range."""
    out = []
    for k in range(0, len(payload) - 2, 3):
        v = int.from_bytes(payload[k : k + 3], "little")
        if v & 0x800000:
            out.append(v - 0x1000000)  # anywhere, negative ones included
        else:
            out.append(v % (n_vocab + 4) - 2)
    return out


def check_one(tokenizers: list, missing: list, stream_decoder_class, data: bytes) -> None:
    index, check, special, payload = decode_input(data)
    tok = tokenizers[index % len(tokenizers)]
    n_vocab = tok.n_vocab
    if check == CHECK_DECODE_IDS:
        ids = ids_of(payload, n_vocab)
        bad = [i for i in ids if not 0 <= i < n_vocab]
        try:
            text = tok.decode(ids, special=special)
        except ValueError as e:
            assert bad and f"token id {bad[0]} is out of range" in str(e), (ids, e)
            return
        assert not bad, f"ids {bad} outside a vocabulary of {n_vocab} were decoded"
        assert streamed(stream_decoder_class, tok, ids, special) == text, ids
        return
    if check == CHECK_INVALID_TEXT:
        text = payload.decode("utf-8", "surrogateescape")
        try:
            ids = tok.encode(text, add_bos=False, special=special)
        except ValueError as e:
            assert text != payload.decode("utf-8", "replace"), "valid text refused"
            first = next(i for i, ch in enumerate(text) if 0xD800 <= ord(ch) <= 0xDFFF)
            assert f"lone surrogate {text[first]!r} at index {first}" in str(e), (text, e)
            return
        assert all(0 <= i < n_vocab for i in ids), ids
        return
    text = payload.decode("utf-8", "replace")
    ids = tok.encode(text, add_bos=False, special=special)
    assert all(0 <= i < n_vocab for i in ids), ids
    decoded = tok.decode(ids, special=special)
    if check == CHECK_ROUND_TRIP:
        if round_trips(tok, missing[index % len(tokenizers)], text, ids, special):
            assert decoded == text, (text, ids, decoded)
    else:
        assert streamed(stream_decoder_class, tok, ids, special) == decoded, (text, ids)


def main() -> None:
    import atheris

    # (importing the tokenizer imports the package: all of it is instrumented, and per input
    # only the tokenizer's code runs)
    with atheris.instrument_imports(include=["powerinfer_rs"]):
        from powerinfer_rs.tokenizer import GGUFTokenizer, StreamDecoder

    tokenizers = build_tokenizers(GGUFTokenizer)
    missing = [missing_bytes(tok) for tok in tokenizers]
    # the checks' own branches guide the fuzzer too (which promise an input reached)
    check = atheris.instrument_func(check_one)

    def test_one_input(data: bytes) -> None:
        check(tokenizers, missing, StreamDecoder, data)

    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
