"""Real tokenizer vocabularies for the tests: the `models/ggml-vocab-*.gguf` files llama.cpp
tests its own tokenizer with (Llama 3, LLaMA/Mistral SentencePiece, Phi-3, Qwen2, Qwen3.5,
Command-R, DeepSeek, Falcon, GPT-2, MPT, StarCoder, Refact), each with texts (`.inp`) and the
reference tokenizer's ids for them (`.out`). They ship inside llama-cpp-python's source package
on PyPI; this downloads that package once (75 MB, checked against its SHA-256) and keeps only
those files:

    python scripts/llamacpp_vocabs.py          # prints the folder they are in

The folder is $POWERINFER_VOCABS, or ~/.cache/powerinfer-rs/llama.cpp-vocabs-<version>.
"""

import hashlib
import os
import shutil
import tarfile
import tempfile
import urllib.request
from pathlib import Path

VERSION = "0.3.36"
SDIST = (
    "https://files.pythonhosted.org/packages/ec/e9/e7de2b0463ea3ffbf0ede6cb21b58c1258a8f6521aae45ca773a59fe7cf3/"
    f"llama_cpp_python-{VERSION}.tar.gz"
)
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"


def folder() -> Path:
    if os.environ.get("POWERINFER_VOCABS"):
        return Path(os.environ["POWERINFER_VOCABS"])
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "powerinfer-rs" / f"llama.cpp-vocabs-{VERSION}"


def fetch() -> Path:
    out = folder()
    done = out / ".complete"
    if done.exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        sdist = Path(tmp) / "sdist.tar.gz"
        with urllib.request.urlopen(SDIST, timeout=120) as response, open(sdist, "wb") as f:
            shutil.copyfileobj(response, f)
        digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
        if digest != SDIST_SHA256:
            raise SystemExit(f"{SDIST}: SHA-256 {digest}, expected {SDIST_SHA256}")
        with tarfile.open(sdist) as tar:
            for member in tar:
                name = member.name.rsplit("/", 1)[-1]
                if (
                    member.isfile()
                    and "/vendor/llama.cpp/models/" in member.name
                    and name.startswith("ggml-vocab-")
                ):
                    with tar.extractfile(member) as src:
                        (out / name).write_bytes(src.read())
    done.write_text(VERSION)
    return out


def as_sentencepiece(metadata: dict) -> dict:
    """A 262k SentencePiece vocabulary the way Gemma 1-3 files carry theirs (`tokenizer.ggml.model`
    'llama', no leading space, byte fallback, pieces ranked by score), made from Gemma 4's file:
    its real pieces and types, each piece scored by its negated id (Gemma 4's file ranks merges
    instead; Gemma 3's own vocabulary is not among llama.cpp's test files)."""
    tokens = list(metadata["tokenizer.ggml.tokens"])
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": list(metadata["tokenizer.ggml.token_type"]),
        "tokenizer.ggml.scores": [-float(i) for i in range(len(tokens))],
        "tokenizer.ggml.bos_token_id": metadata["tokenizer.ggml.bos_token_id"],
        "tokenizer.ggml.eos_token_id": metadata["tokenizer.ggml.eos_token_id"],
        "tokenizer.ggml.unknown_token_id": metadata["tokenizer.ggml.unknown_token_id"],
        "tokenizer.ggml.add_space_prefix": False,
    }


if __name__ == "__main__":
    print(fetch())
