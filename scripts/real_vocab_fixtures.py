"""Regenerates tests/fixtures/tokenizers/real_vocabs.json: llama.cpp's token ids, with and
without control tokens parsed, and its detokenized text, for tricky texts and prose under the
real vocabularies llama.cpp tests its tokenizer with (scripts/llamacpp_vocabs.py fetches them),
with each file's SHA-256 so a test never compares against a different file.
tests/test_tokenizer_real_vocabs.py holds the engine's tokenizer to these ids.

Needs llama-cpp-python (see README, "Against llama.cpp"):

    python scripts/real_vocab_fixtures.py
"""

import hashlib
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from gguf import GGUFReader  # noqa: E402
from llamacpp_vocabs import as_sentencepiece, fetch  # noqa: E402
from tokenizer_fixtures import OTHER_SCRIPTS, TEXTS, llama_cpp_ids, prose, write_vocab_gguf  # noqa: E402

OUT = ROOT / "tests" / "fixtures" / "tokenizers" / "real_vocabs.json"

# The vocabularies of the families the engine runs or whose tokenizers it shares.
VOCABS = [
    "llama-bpe",  # Llama 3
    "llama-spm",  # LLaMA 1/2, Mistral's SentencePiece
    "phi-3",
    "qwen2",
    "qwen35",
    "gemma-4",
    "command-r",
    "deepseek-llm",
    "deepseek-coder",
    "falcon",
    "gpt-2",
    "mpt",
    "starcoder",
    "refact",
]

# Texts where the word-level splits of these pre-tokenizers differ.
EXTRA = [
    "Hello, y'all! How's it goin'? 😀 ¿Qué tal? ¡Bien!",
    "3333333333 + 4444 = 3337777777; x1y22z333",
    "   \n\n   indented\n\t\tcode\r\n\r\n\r\n",
    "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>",
    "<start_of_turn>user\nhi<end_of_turn>\n<|turn>model\n",
    "Ⅻ ½ ² ٣ ³ 𝟘 ℵ ǅ ﬁ Ｆｕｌｌ ｗｉｄｔｈ",
]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def spm_from_gemma4(source: Path, out: Path) -> None:
    """Writes `as_sentencepiece` of Gemma 4's vocabulary as a vocabulary-only GGUF."""
    reader = GGUFReader(str(source))
    meta = as_sentencepiece(
        {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.ggml.")}
    )
    vocab = {
        "tokens": meta.pop("tokenizer.ggml.tokens"),
        "types": meta.pop("tokenizer.ggml.token_type"),
        "scores": meta.pop("tokenizer.ggml.scores"),
    }
    write_vocab_gguf(out, meta, vocab)


def main() -> None:
    folder = fetch()
    texts = TEXTS + OTHER_SCRIPTS + EXTRA + prose(8, seed=11)
    out = {}
    for name in VOCABS:
        path = folder / f"ggml-vocab-{name}.gguf"
        rows, with_bos = llama_cpp_ids(path, texts)
        out[name] = {"sha256": sha256(path), "hello_with_bos": with_bos, "cases": rows}
        print(f"{name}: {len(rows)} texts")
    # Gemma 1-3's kind of vocabulary at Gemma's size (see llamacpp_vocabs.as_sentencepiece)
    with tempfile.TemporaryDirectory() as tmp:
        source = folder / "ggml-vocab-gemma-4.gguf"
        path = Path(tmp) / "spm.gguf"
        spm_from_gemma4(source, path)
        rows, with_bos = llama_cpp_ids(path, texts)
        out["gemma-4-as-spm"] = {
            "sha256": sha256(source),
            "hello_with_bos": with_bos,
            "cases": rows,
        }
    OUT.write_text(json.dumps(out, ensure_ascii=False, separators=(",", ":")))
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
