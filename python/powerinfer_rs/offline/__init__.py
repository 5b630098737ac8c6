"""The offline toolchain, in the order a user runs it:

    relufy   -> (SwiGLU models only, optional) a ReLU-family model trained from the original,
                whose FFN activations are mostly exactly zero (`pack` tokenizes its corpus);
                needs PyTorch, the `relufy` extra
    profile  -> per-neuron activation counts and the predictor training set (`.profile.npz`)
    train    -> per-layer predictors `fc2 @ relu(fc1 @ x)` and their cut-offs (`.predictors.npz`)
    convert  -> a PowerInfer GGUF (magic PWRI, `ffn_down_t`, `fc1`/`fc2`) from a plain GGUF or a
                Hugging Face safetensors folder plus the trained predictors
    place    -> the hot/cold split under a VRAM budget, the integer program solved to proven
                optimality (HiGHS as the fallback), written as `<model>.generated.gpuidx`

Each step is a function here and a `powerinfer-rs` subcommand. The toolchain imports the
runtime (the engine, the placement planner, the profile file), never the other way round.
"""

from ..placement import parse_bytes, read_gpu_index, write_gpu_index
from ..profile_file import load_profile
from .conversion import convert
from .packing import load_shard, pack
from .placement import place
from .profiling import profile
from .relufication import RelufySettings, relufy, requantize
from .training import load_predictors, train

__all__ = [
    "pack",
    "load_shard",
    "relufy",
    "RelufySettings",
    "requantize",
    "profile",
    "load_profile",
    "train",
    "load_predictors",
    "convert",
    "place",
    "parse_bytes",
    "read_gpu_index",
    "write_gpu_index",
]
