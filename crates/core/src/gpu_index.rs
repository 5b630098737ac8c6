//! The hot/cold neuron split, `<model>.generated.gpuidx`, as PowerInfer writes and reads it: a
//! GGUF file (magic `PWRI`, architecture `generic.gpu_index`, key `split.vram_capacity`) with two
//! I32 tensors per layer, in this order: `blk.{i}.gpu_idx` ([n_ff] 0/1, 1 = the neuron lives on
//! the GPU) and `blk.{i}.gpu_bucket` (the GPU neurons' indices, ascending; GPU row r holds neuron
//! gpu_bucket[r]). This module reads and checks such a file; it never trusts one half to agree
//! with the other without checking.

use std::path::Path;

use crate::error::{Error, Result};
use crate::gguf::GgufFile;

const I32_TYPE_ID: u32 = 26;

/// One layer's split.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerSplit {
    /// (n_ff) true where the neuron is on the GPU.
    pub on_gpu: Vec<bool>,
    /// The GPU neurons, ascending.
    pub gpu_bucket: Vec<u32>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuIndex {
    /// `split.vram_capacity`: the budget (bytes) the split was made for.
    pub vram_capacity: u64,
    pub layers: Vec<LayerSplit>,
}

fn i32_tensor(file: &GgufFile, name: &str) -> Result<Vec<i32>> {
    let t =
        file.tensor(name).ok_or_else(|| Error::Model(format!("GPU index has no tensor {name}")))?;
    if t.type_id != I32_TYPE_ID || t.dims.len() != 1 {
        return Err(Error::Model(format!(
            "GPU index tensor {name} must be a 1-D I32 vector, found {} with shape {:?}",
            t.type_name(),
            t.shape()
        )));
    }
    Ok(file
        .tensor_bytes(t)
        .chunks_exact(4)
        .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect())
}

impl GpuIndex {
    /// Reads and validates a `.gpuidx` file: both tensors in every layer, 0/1 masks, buckets
    /// ascending and exactly the mask's ones.
    pub fn read(path: &Path) -> Result<GpuIndex> {
        let file = GgufFile::open(path)?;
        match file.get("general.architecture").and_then(|v| v.as_str()) {
            Some("generic.gpu_index") => {}
            other => {
                return Err(Error::Model(format!(
                    "{} is not a GPU index: general.architecture is {other:?}, expected \"generic.gpu_index\"",
                    path.display()
                )))
            }
        }
        let vram_capacity = file
            .get("split.vram_capacity")
            .and_then(|v| v.as_u64())
            .ok_or_else(|| Error::Model("GPU index has no split.vram_capacity".into()))?;
        let n_layer =
            (0..).take_while(|i| file.tensor(&format!("blk.{i}.gpu_idx")).is_some()).count();
        if n_layer == 0 {
            return Err(Error::Model("GPU index has no blk.0.gpu_idx".into()));
        }
        let mut layers = Vec::with_capacity(n_layer);
        for i in 0..n_layer {
            let mask = i32_tensor(&file, &format!("blk.{i}.gpu_idx"))?;
            let bucket = i32_tensor(&file, &format!("blk.{i}.gpu_bucket"))?;
            if let Some(v) = mask.iter().find(|&&v| v != 0 && v != 1) {
                return Err(Error::Model(format!(
                    "blk.{i}.gpu_idx holds {v}; only 0 and 1 are allowed"
                )));
            }
            let expected: Vec<u32> =
                (0..mask.len() as u32).filter(|&j| mask[j as usize] == 1).collect();
            if bucket.len() != expected.len()
                || bucket.iter().zip(&expected).any(|(&b, &e)| b as i64 != e as i64)
            {
                return Err(Error::Model(format!(
                    "blk.{i}.gpu_bucket ({} entries) is not the ascending list of the {} neurons blk.{i}.gpu_idx marks",
                    bucket.len(),
                    expected.len()
                )));
            }
            layers.push(LayerSplit {
                on_gpu: mask.iter().map(|&v| v == 1).collect(),
                gpu_bucket: expected,
            });
        }
        Ok(GpuIndex { vram_capacity, layers })
    }
}
