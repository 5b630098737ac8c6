"""The package's metadata: one version, written in the workspace's Cargo.toml."""

import tomllib
from pathlib import Path

import powerinfer_rs

ROOT = Path(__file__).resolve().parent.parent


def test_the_version_is_the_workspaces():
    cargo = tomllib.loads((ROOT / "Cargo.toml").read_text())
    assert powerinfer_rs.__version__ == cargo["workspace"]["package"]["version"]
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in pyproject["project"]
    assert "version" in pyproject["project"]["dynamic"]


def test_the_weight_type_table_agrees_with_ggml():
    """Each row of the engine's type table against the `gguf` package's (llama.cpp's) own: type
    id, block length and block bytes; the activations a type pairs with follow its block length."""
    import gguf

    rows = powerinfer_rs._core.weight_types()
    assert [r["name"] for r in rows][:6] == ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0"]
    for r in rows:
        t = gguf.GGMLQuantizationType[r["name"]]
        assert r["ggml_id"] == t.value, r
        assert (r["block_len"], r["block_bytes"]) == gguf.GGML_QUANT_SIZES[t], r
        expected = {1: "f32", 32: "q8_per_32", 256: "q8_per_256"}[r["block_len"]]
        assert r["activations"] == expected, r
    assert [r["name"] for r in rows if not r["gpu"]] == ["BF16"]


def test_the_documented_weight_types_are_the_engines():
    """docs/models-and-formats.md's "Weight types" table names exactly the engine's types, with
    the engine's block sizes and its GPU support."""
    text = (ROOT / "docs" / "models-and-formats.md").read_text()
    section = text.split("## Weight types", 1)[1].split("\n## ", 1)[0]
    rows = [
        [c.strip() for c in line.strip().strip("|").split("|")]
        for line in section.splitlines()
        if line.startswith("|") and not line.startswith("|---")
    ]
    header, body = rows[0], rows[1:]
    col = {name: i for i, name in enumerate(header)}
    documented = {
        r[col["type"]]: (
            r[col["CPU"]],
            r[col["GPU"]],
            int(r[col["weights per block"]]),
            int(r[col["bytes per block"]]),
        )
        for r in body
    }
    engine = {
        t["name"]: ("yes", "yes" if t["gpu"] else "no", t["block_len"], t["block_bytes"])
        for t in powerinfer_rs._core.weight_types()
    }
    assert documented == engine
