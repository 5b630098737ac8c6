"""PowerInfer's `<model>.generated.gpuidx`, the file that holds a hot/cold split: where it lives
beside a model, writing it exactly as PowerInfer's exporter does, and reading it as the engine
does (the Rust core parses it), with the check that a file applies to the model and budget at
hand, and the per-layer masks (`gpu_idx`) of neuron lists.

It stores a split and decides none (`planner` does).
"""

from __future__ import annotations

import os
import struct

import numpy as np

from .. import _core


def write_gpu_index(
    path: str, gpu_neurons: list[np.ndarray], n_ff: int, vram_capacity: int
) -> None:
    """Writes `<model>.generated.gpuidx` exactly as PowerInfer's exporter does: GGUF v3 with the
    magic patched to PWRI, architecture `generic.gpu_index`, `generic.gpu_index.block_count`,
    `split.vram_capacity`, and per layer `blk.{i}.gpu_idx` then `blk.{i}.gpu_bucket` (I32)."""
    import gguf

    w = gguf.GGUFWriter(path, "generic.gpu_index")
    for i, neurons in enumerate(gpu_neurons):
        neurons = np.sort(np.asarray(neurons, dtype=np.int64))
        if len(neurons) and (
            neurons[0] < 0 or neurons[-1] >= n_ff or np.any(np.diff(neurons) == 0)
        ):
            raise ValueError(f"layer {i}: GPU neuron indices must be distinct and in [0, {n_ff})")
        mask = neuron_mask(neurons, n_ff).astype(np.int32)
        bucket = neurons.astype(np.int32)
        w.add_tensor(
            f"blk.{i}.gpu_idx",
            mask,
            raw_shape=mask.shape[::-1],
            raw_dtype=gguf.GGMLQuantizationType.I32,
        )
        w.add_tensor(
            f"blk.{i}.gpu_bucket",
            bucket,
            raw_shape=bucket.shape[::-1],
            raw_dtype=gguf.GGMLQuantizationType.I32,
        )
    w.add_block_count(len(gpu_neurons))
    w.add_uint64("split.vram_capacity", int(vram_capacity))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with open(path, "r+b") as fh:
        fh.write(b"PWRI")
        fh.write(struct.pack("<I", 3))


def read_gpu_index(path: str) -> dict:
    """The split as the engine reads it: `vram_capacity` and per-layer `gpu_idx`/`gpu_bucket`."""
    return _core.read_gpu_index(path)


def read_gpu_masks(
    path: str, n_layer: int, n_ff: int, vram_capacity: int
) -> list[np.ndarray] | None:
    """Per layer, which neurons the `.gpuidx` at `path` puts on the GPU (a bool mask of `n_ff`),
    when the file was planned for this budget and a model of `n_layer` layers; None when there is
    no file or it was planned for another budget or layer count (then it does not apply). A file
    that fits the budget and layers but not the model's `n_ff` is an error, not a miss."""
    if not os.path.exists(path):
        return None
    index = read_gpu_index(path)
    if index["vram_capacity"] != vram_capacity or len(index["gpu_idx"]) != n_layer:
        return None
    masks = [np.asarray(m).astype(bool) for m in index["gpu_idx"]]
    if any(len(m) != n_ff for m in masks):
        raise _core.ModelError(f"{path} does not match the model's {n_ff} neurons per layer")
    return masks


def neuron_mask(neurons: np.ndarray, n_ff: int) -> np.ndarray:
    """The bool mask of `n_ff` that is True at the indices `neurons` (one layer's GPU neurons)."""
    mask = np.zeros(n_ff, dtype=bool)
    mask[np.asarray(neurons, dtype=np.int64)] = True
    return mask


def gpu_index_path(model_path: str) -> str:
    return model_path + ".generated.gpuidx"
