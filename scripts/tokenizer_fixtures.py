"""Regenerates tests/fixtures/tokenizers/: two small vocabularies and llama.cpp's token ids for
tricky texts under each way a GGUF can ask for them to be used, the oracle
tests/test_tokenizer_llamacpp.py compares the engine's tokenizer with.

- A byte-level BPE vocabulary (4,000 tokens, trained with `tokenizers` on the Python docs and
  a few lines in other scripts), tokenized under every `tokenizer.ggml.pre` the engine knows.
- A SentencePiece BPE vocabulary (4,000 pieces, trained with `sentencepiece`, byte fallback,
  digits split), converted to GGUF the way llama.cpp's converter does, and used three ways:
  LLaMA's (a space before the text), Gemma's (`add_space_prefix = false`) and Phi-3's
  (special tokens swallow the whitespace after them).

Each variant is written as a vocabulary-only GGUF and read by llama.cpp (`vocab_only=True`).
Needs llama-cpp-python (see README, "Against llama.cpp") and `pip install sentencepiece`:

    python scripts/tokenizer_fixtures.py
"""

import io
import json
import random
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))

import llama_cpp  # noqa: E402
from gguf import GGUFWriter  # noqa: E402
from powerinfer_rs.tokenizer import _PRE_TOKENIZER_TABLE  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

OUT = ROOT / "tests" / "fixtures" / "tokenizers"
DOCS = Path("/usr/share/doc/python3.11/html/_sources")

OTHER_SCRIPTS = [
    "Ελληνικά κείμενα και αριθμοί 2024",
    "русский текст, ещё немного слов",
    "日本語のテキストと漢字、カタカナ",
    "中文文本，还有一些汉字。",
    "한국어 문장입니다",
    "emoji 🤗🚀 and ünïcödé çà et là",
    "DON'T WON'T I'LL We'Ve THEY'RE",
]

CONTROL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<|user|>",
    "<|end|>",
]
USER_DEFINED = ["<mask>", "<tool_call>"]

TEXTS = [
    "",
    " ",
    "  ",
    "\n",
    "\n\n\n",
    "\t",
    "Hello world",
    " Hello world",
    "Hello  world",
    "  leading and   runs of   spaces  ",
    "line1\nline2\n\n\n\tTabbed\r\nwindows\r\n",
    "digits 1 12 123 1234 12345 1234567 and 3.14159, 2024-11-21, 1,000,000",
    "emoji 🤗🚀👩‍👩‍👧 and ünïcödé, Ελληνικά, русский, 日本語テキスト, 한국어, 中文。",
    "don't won't I'll we've they're it's DON'T I'M You'D",
    "'s 're 'll",
    "code: def f(x):\n    return x ** 2  # comment\n\tif a<=b and c>=d: pass",
    "$price += 10^3 | ~mask <= >= == !=",
    "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n",
    "<start_of_turn>user\nhi there<end_of_turn>\n<start_of_turn>model\n",
    "<|user|>\n  What is 2+2?  <|end|>\n",
    'a <mask> here, <mask>\tand there <tool_call>{"x": 1}',
    "<s> and </s> and <unk> as text",
    "<0x0A> is not a newline",
    "ALL CAPS WORDS AND lowercase, CamelCaseWords and snake_case_words",
    "tabs\tand\u00a0non-breaking\u2003spaces\u3000here",
    "trailing newline and spaces  \n  ",
    "   ",
]


def prose(n: int, seed: int) -> list[str]:
    """`n` passages of 200-400 characters from the Python docs."""
    files = sorted(DOCS.rglob("*.txt"))
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        text = rng.choice(files).read_text(encoding="utf-8", errors="replace")
        if len(text) < 500:
            continue
        start = rng.randrange(len(text) - 400)
        out.append(text[start : start + rng.randrange(200, 400)])
    return out


def corpus() -> list[str]:
    lines = []
    for f in sorted(DOCS.rglob("*.txt"))[:400]:
        lines.extend(
            line
            for line in f.read_text(encoding="utf-8", errors="replace").splitlines()
            if line.strip()
        )
    return lines + OTHER_SCRIPTS * 50


def train_bpe(lines: list[str]) -> dict:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=4000,
        special_tokens=CONTROL + USER_DEFINED,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(lines, trainer)
    model = json.loads(tok.to_str())["model"]
    vocab = model["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [3 if t in CONTROL else 4 if t in USER_DEFINED else 1 for t in tokens]
    return {"tokens": tokens, "types": types, "merges": merges}


def train_spm(lines: list[str]) -> dict:
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=buf,
        model_type="bpe",
        vocab_size=4000,
        byte_fallback=True,
        split_digits=True,
        character_coverage=0.9995,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        control_symbols=CONTROL,
        user_defined_symbols=USER_DEFINED,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_proto=buf.getvalue())
    tokens, scores, types = [], [], []
    # Token types as llama.cpp's converter assigns them (convert_hf_to_gguf, sentencepiece vocab).
    for i in range(sp.vocab_size()):
        piece = sp.id_to_piece(i)
        kind = 1
        if sp.is_unknown(i):
            kind = 2
        elif sp.is_control(i):
            kind = 3
        elif sp.is_unused(i):
            kind = 5
        elif sp.is_byte(i):
            kind = 6
        elif piece in USER_DEFINED:
            kind = 4
        tokens.append(piece)
        scores.append(sp.get_score(i))
        types.append(kind)
    return {"tokens": tokens, "scores": scores, "types": types}


def variants() -> dict[str, tuple[dict, list[str]]]:
    """Metadata of each variant (everything but the vocabulary arrays), with the other
    `tokenizer.ggml.pre` names that must tokenize exactly like it."""
    out = {}
    for names, *_ in _PRE_TOKENIZER_TABLE:
        meta = {
            "vocab": "bpe",
            "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.pre": names[0],
            "tokenizer.ggml.bos_token_id": 0,
            "tokenizer.ggml.eos_token_id": 2,
        }
        out[f"bpe-{names[0]}"] = (meta, list(names[1:]))
    spm_common = {
        "vocab": "spm",
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }
    out["spm-llama"] = (dict(spm_common), [])
    out["spm-gemma"] = (
        dict(
            spm_common,
            **{"tokenizer.ggml.pre": "default", "tokenizer.ggml.add_space_prefix": False},
        ),
        [],
    )
    out["spm-phi3"] = (dict(spm_common, **{"general.name": "Phi-3 Mini Instruct"}), [])
    return out


def llama_cpp_ids(path: Path, texts: list[str]) -> tuple[list[dict], list[int]]:
    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    rows = []
    for text in texts:
        row = {"text": text, "plain": llm.tokenize(text.encode(), add_bos=False, special=False)}
        special = llm.tokenize(text.encode(), add_bos=False, special=True)
        if special != row["plain"]:
            row["special"] = special
        row["detok"] = llm.detokenize(row["plain"]).decode("utf-8", errors="replace")
        rows.append(row)
    return rows, llm.tokenize(b"Hello world", add_bos=True, special=False)


def write_vocab_gguf(path: Path, meta: dict, vocab: dict) -> None:
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(64)
    w.add_feed_forward_length(64)
    w.add_head_count(4)
    w.add_layer_norm_rms_eps(1e-5)
    if "general.name" in meta:
        w.add_name(meta["general.name"])
    w.add_tokenizer_model(meta["tokenizer.ggml.model"])
    if "tokenizer.ggml.pre" in meta:
        w.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    w.add_token_list(vocab["tokens"])
    w.add_token_types(vocab["types"])
    if "scores" in vocab:
        w.add_token_scores(vocab["scores"])
    if "merges" in vocab:
        w.add_token_merges(vocab["merges"])
    w.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    if "tokenizer.ggml.unknown_token_id" in meta:
        w.add_unk_token_id(meta["tokenizer.ggml.unknown_token_id"])
    if "tokenizer.ggml.add_space_prefix" in meta:
        w.add_add_space_prefix(meta["tokenizer.ggml.add_space_prefix"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> None:
    lines = corpus()
    vocabs = {"bpe": train_bpe(lines), "spm": train_spm(lines)}
    texts = TEXTS + prose(12, seed=7)
    cases = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (meta, aliases) in variants().items():
            path = Path(tmp) / f"{name}.gguf"
            write_vocab_gguf(path, meta, vocabs[meta["vocab"]])
            rows, with_bos = llama_cpp_ids(path, texts)
            for alias in aliases:
                write_vocab_gguf(
                    path, dict(meta, **{"tokenizer.ggml.pre": alias}), vocabs[meta["vocab"]]
                )
                if llama_cpp_ids(path, texts) != (rows, with_bos):
                    raise SystemExit(
                        f"llama.cpp tokenizes pre={alias!r} unlike {meta['tokenizer.ggml.pre']!r}: fix the table"
                    )
            cases[name] = {
                "meta": meta,
                "aliases": aliases,
                "hello_with_bos": with_bos,
                "cases": rows,
            }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "vocabs.json").write_text(json.dumps(vocabs, ensure_ascii=False, separators=(",", ":")))
    (OUT / "llamacpp_ids.json").write_text(
        json.dumps(cases, ensure_ascii=False, separators=(",", ":"))
    )
    print(f"wrote {OUT}: {len(cases)} variants x {len(texts)} texts")


if __name__ == "__main__":
    main()
