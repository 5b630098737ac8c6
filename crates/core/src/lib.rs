//! powerinfer-core: the engine without Python. GGUF loading (`gguf`), tensor formats and
//! reference kernels (`quant`), SIMD kernels (`avx2`, `avx512`), the level this CPU runs (`simd`) and the kernels' table per type and level (`kernels`), threaded matrix products (`matmul`),
//! LLaMA-family models (`model`) and their activations (`activation`), the forward pass written once over a backend seam (`forward`) and its steps' times (`step_times`), the CPU backend, KV cache and sessions (`session`) and sampling
//! (`sampler`).

pub mod activation;
pub mod attention;
pub mod dtype;
pub mod error;
pub mod forward;
pub mod gguf;
pub mod gpu_index;
mod kernels;
pub mod matmul;
pub mod model;
pub mod quant;
pub mod sampler;
pub mod session;
pub mod simd;
pub mod sparse;
pub mod step_times;

#[cfg(target_arch = "x86_64")]
pub mod avx2;
#[cfg(target_arch = "x86_64")]
pub mod avx512;

pub use error::{Error, Result};
pub use model::{Config, Model};
pub use sampler::{Sampler, SamplingParams};
pub use session::Session;
