//! The device layer under the hybrid executor: buffers, uploads, reads, and one call per kernel
//! of `kernels/powerinfer.cu`, with two implementations. `Cuda` launches the real kernels on a
//! stream; `Emulated` keeps every buffer in host memory and runs each kernel's scalar twin
//! (`twin.rs`), in queue order, so the whole hybrid path (planning, uploads in `gpu_bucket`
//! order, the hot/cold split, the merge, layer offload) runs on machines without a GPU.
//!
//! Implementations only launch: `Gpu` (gpu.rs) checks arguments once for both, and the
//! executor never knows which one it drives. Launches are asynchronous on `Cuda`; a `read`
//! waits for what was queued before it.

pub mod cuda;
pub mod emulated;

use cudarc::driver::{DeviceRepr, ValidAsZeroBits};
use powerinfer_core::model::FfnActivation;
use powerinfer_core::quant::{BlockQ8Act, DType};

use crate::CudaError;

pub use cuda::Cuda;
pub use emulated::Emulated;

/// An element type of device buffers (f32 activations, u8 weight rows and caches, i32/u32 ids
/// and counters).
pub trait Elem:
    DeviceRepr + ValidAsZeroBits + Copy + Default + Send + Sync + Unpin + 'static
{
}
impl Elem for f32 {}
impl Elem for u8 {}
impl Elem for i32 {}
impl Elem for u32 {}

pub type Result<T> = std::result::Result<T, CudaError>;

/// The weight types with GPU kernels (`TypeTraits::gpu`), in table order: the per-type kernel
/// tables of a device hold one entry for each, named `<kernel>_<type name in lower case>`.
pub fn gpu_types() -> impl Iterator<Item = DType> {
    DType::ALL.into_iter().filter(|d| d.traits().gpu)
}

/// Index of a weight type in the per-type kernel tables (`gpu_types`).
pub fn type_slot(dtype: DType) -> Result<usize> {
    gpu_types().position(|d| d == dtype).ok_or_else(|| {
        CudaError::Unsupported(format!("{} weights have no GPU kernel", dtype.name()))
    })
}

/// The activation code the kernels switch on (ACT_* in the .cu file).
pub fn act_code(act: FfnActivation) -> Result<i32> {
    Ok(match act {
        FfnActivation::SwiGlu => 0,
        FfnActivation::ReGlu => 1,
        FfnActivation::DReGlu => 2,
        FfnActivation::Relu => 3,
        FfnActivation::Gelu => 4,
        FfnActivation::GeGlu => 5,
        FfnActivation::SwiGluOai => 6,
    })
}

/// The activation a kernel's code stands for (the inverse of `act_code`).
pub fn act_of_code(code: i32) -> Option<FfnActivation> {
    [
        FfnActivation::SwiGlu,
        FfnActivation::ReGlu,
        FfnActivation::DReGlu,
        FfnActivation::Relu,
        FfnActivation::Gelu,
        FfnActivation::GeGlu,
        FfnActivation::SwiGluOai,
    ]
    .into_iter()
    .find(|&a| act_code(a).ok() == Some(code))
}

/// The shape and scoring of an attention call.
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    pub n_ctx: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    /// Scores are q.k * scale ...
    pub scale: f32,
    /// ... squashed into softcap * tanh(s / softcap) where softcap > 0 (Gemma 2).
    pub softcap: f32,
    /// A sliding-window layer's window in positions; 0 for all positions.
    pub window: usize,
}

/// A weight matrix in device memory, rows in the file's type and layout.
pub struct DMat<D: Device> {
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    pub row_bytes: usize,
    pub data: Buf<D, u8>, // (rows, row_bytes)
}

impl<D: Device> DMat<D> {
    pub fn bytes(&self) -> usize {
        self.rows * self.row_bytes
    }
}

/// An activation vector on the device as the kernels read it: `f32s` for float weights, and
/// `q8`, its int8 blocks in the CPU's `BlockQ8Act` layout, for quantized weights.
/// `Gpu::quantize_for` fills `q8` from `f32s`; whoever writes `f32s` calls it before a quantized
/// matrix reads them. A norm that rounds its output as it writes it (`Gpu::rmsnorm`) sets
/// `rounded`, and the next `quantize_for` then has nothing to do.
pub struct DActs<D: Device> {
    pub f32s: Buf<D, f32>, // (n)
    pub q8: Buf<D, u8>,    // (n / QK, Q8_BLOCK_BYTES)
    pub rounded: bool,
}

/// Bytes of one `BlockQ8Act` (32 int8 values, d and s), as `quantize_q8` writes it.
pub const Q8_BLOCK_BYTES: usize = 40;
const _: () = assert!(std::mem::size_of::<BlockQ8Act>() == Q8_BLOCK_BYTES);

/// A buffer of `T` on device `D`.
pub type Buf<D, T> = <D as Device>::Buf<T>;

/// Where the executor's buffers live and its kernels run. Every kernel call mirrors its
/// `__global__` signature in powerinfer.cu; shapes and optional (null) pointers as there. `m`
/// is the number of batch rows (consecutive tokens of one sequence, activations row after row).
pub trait Device: Send + Sync + Sized + 'static {
    type Buf<T: Elem>: Send + Sync;

    /// "cuda" or "emulated", as sessions report their device.
    const KIND: &'static str;

    fn name(&self) -> String;
    fn total_memory(&self) -> usize;

    fn len<T: Elem>(buf: &Self::Buf<T>) -> usize;
    fn upload<T: Elem>(&self, host: &[T]) -> Result<Self::Buf<T>>;
    /// `n` zeros (at least one element, as CUDA has no empty allocations).
    fn zeros<T: Elem>(&self, n: usize) -> Result<Self::Buf<T>>;
    /// Copies `src` into the first `src.len()` elements of `dst`.
    fn write<T: Elem>(&self, src: &[T], dst: &mut Self::Buf<T>) -> Result<()>;
    /// Copies the first `dst.len()` elements of `src` to the host, after the queued work.
    fn read<T: Elem>(&self, src: &Self::Buf<T>, dst: &mut [T]) -> Result<()>;
    fn clear<T: Elem>(&self, dst: &mut Self::Buf<T>) -> Result<()>;
    /// Copies elements src_start .. src_start + n of `src` to dst_start .. dst_start + n of
    /// `dst` (queued).
    fn copy<T: Elem>(
        &self,
        src: &Self::Buf<T>,
        src_start: usize,
        dst: &mut Self::Buf<T>,
        dst_start: usize,
        n: usize,
    ) -> Result<()>;
    fn synchronize(&self) -> Result<()>;

    /// A recorded sequence of kernel launches, replayed as one launch (a CUDA graph).
    type Graph: Send;
    /// Starts recording the launches that follow instead of running them; false where the
    /// device cannot record (then they run as usual).
    fn begin_capture(&self) -> Result<bool>;
    /// Ends a recording begun by `begin_capture` and returns it, ready to launch.
    fn end_capture(&self) -> Result<Self::Graph>;
    /// Runs a recorded sequence (queued like a kernel).
    fn launch_graph(&self, graph: &Self::Graph) -> Result<()>;

    /// `quantize_q8`: the first `n_blocks` blocks of `x` as `BlockQ8Act` bytes.
    fn quantize_q8(
        &self,
        x: &Self::Buf<f32>,
        q8: &mut Self::Buf<u8>,
        n_blocks: usize,
    ) -> Result<()>;
    /// `matvec_*`: y[at + t * rows + r] = w[r] . x[t] (+ bias[r]), relu'd when asked.
    #[allow(clippy::too_many_arguments)]
    fn matvec(
        &self,
        w: &DMat<Self>,
        x: &DActs<Self>,
        bias: Option<&Self::Buf<f32>>,
        y: &mut Self::Buf<f32>,
        at: usize,
        relu: bool,
        m: usize,
    ) -> Result<()>;
    /// `matvec3_*`: three matrices of one type and width on one input (y_i = w_i . x + bias_i).
    fn matvec3(
        &self,
        w: [&DMat<Self>; 3],
        x: &DActs<Self>,
        bias: [Option<&Self::Buf<f32>>; 3],
        y: [&mut Self::Buf<f32>; 3],
        m: usize,
    ) -> Result<()>;
    /// `ffn_hot_*`: h[t, i] for the packed hot row i (neuron bucket[i]) and each of m batch
    /// rows t, with `bias` [gate's, up's] indexed by neuron; `pred_logits` (logits, stride): row
    /// t's predictor logits from t * stride; `selected` is a counter slot the selected rows are
    /// added to.
    #[allow(clippy::too_many_arguments)]
    fn ffn_hot(
        &self,
        gate: Option<&DMat<Self>>,
        up: &DMat<Self>,
        bucket: &Self::Buf<i32>,
        x: &DActs<Self>,
        bias: [Option<&Self::Buf<f32>>; 2],
        pred_logits: Option<(&Self::Buf<f32>, usize)>,
        threshold: f32,
        selected: Option<(&mut Self::Buf<u32>, usize)>,
        act: i32,
        h: &mut Self::Buf<f32>,
        m: usize,
    ) -> Result<()>;
    /// `experts_hot_*`: h[s, i] = act(gates[s][i] . x, ups[s][i] . x) for every row i of each
    /// slot's expert (one of x's rows; all experts of one type and shape, no biases).
    fn experts_hot(
        &self,
        gates: &[&DMat<Self>],
        ups: &[&DMat<Self>],
        x: &DActs<Self>,
        act: i32,
        h: &mut Self::Buf<f32>,
    ) -> Result<()>;
    /// `experts_down_*`: y[at[s] + r] = downs[s][r] . h[s] for each slot s (h: one row a slot).
    fn experts_down(
        &self,
        downs: &[&DMat<Self>],
        h: &DActs<Self>,
        y: &mut Self::Buf<f32>,
        at: &[usize],
    ) -> Result<()>;
    /// `down_partial_*`: partial[t, k, c] = sum over the rows i of chunk k of h[t, i] *
    /// down_t[i, c], for m batch rows t.
    fn down_partial(
        &self,
        down_t: &DMat<Self>,
        h: &Self::Buf<f32>,
        partial: &mut Self::Buf<f32>,
        rows_per_chunk: usize,
        m: usize,
    ) -> Result<()>;
    /// `ffn_merge`: x[t, c] += sum_k partial[t, k, c] + cpu_part[t, c] + bias[c], for m batch
    /// rows t.
    #[allow(clippy::too_many_arguments)]
    fn ffn_merge(
        &self,
        x: &mut Self::Buf<f32>,
        partial: &Self::Buf<f32>,
        n_chunks: usize,
        cpu_part: Option<&Self::Buf<f32>>,
        bias: Option<&Self::Buf<f32>>,
        cols: usize,
        m: usize,
    ) -> Result<()>;
    /// `rmsnorm`, also rounding `out` to int8 blocks in `q8` when given.
    fn rmsnorm(
        &self,
        x: &Self::Buf<f32>,
        w: &Self::Buf<f32>,
        out: &mut Self::Buf<f32>,
        q8: Option<&mut Self::Buf<u8>>,
        n: usize,
        eps: f32,
        m: usize,
    ) -> Result<()>;
    /// `rmsnorm` with y: x += y, then out = the norm of x (and its int8 blocks).
    #[allow(clippy::too_many_arguments)]
    fn add_rmsnorm(
        &self,
        x: &mut Self::Buf<f32>,
        y: &Self::Buf<f32>,
        w: &Self::Buf<f32>,
        out: &mut Self::Buf<f32>,
        q8: Option<&mut Self::Buf<u8>>,
        n: usize,
        eps: f32,
        m: usize,
    ) -> Result<()>;
    /// `head_rmsnorm`: each of the n_heads heads of x (head_dim each) RMS-normed in place, times w.
    fn head_rmsnorm(
        &self,
        x: &mut Self::Buf<f32>,
        w: &Self::Buf<f32>,
        n_heads: usize,
        head_dim: usize,
        eps: f32,
    ) -> Result<()>;
    /// x += y (+ bias)
    fn add_into(
        &self,
        x: &mut Self::Buf<f32>,
        y: &Self::Buf<f32>,
        bias: Option<&Self::Buf<f32>>,
        n: usize,
    ) -> Result<()>;
    #[allow(clippy::too_many_arguments)]
    /// `rope` of q (n_head heads) and k (n_head_kv heads) at one position.
    fn rope(
        &self,
        q: &mut Self::Buf<f32>,
        k: &mut Self::Buf<f32>,
        cos: &Self::Buf<f32>,
        sin: &Self::Buf<f32>,
        n_head: usize,
        n_head_kv: usize,
        head_dim: usize,
        rope_dim: usize,
        neox: bool,
        m: usize,
    ) -> Result<()>;
    /// Stores one position's k and v in the caches, as f32 or (`f16`) f16 elements; the
    /// position is `pos[0]`, read on the device.
    #[allow(clippy::too_many_arguments)]
    fn kv_store(
        &self,
        k: &Self::Buf<f32>,
        v: &Self::Buf<f32>,
        k_cache: &mut Self::Buf<u8>,
        v_cache: &mut Self::Buf<u8>,
        pos: &Self::Buf<i32>,
        kv_dim: usize,
        f16: bool,
        m: usize,
    ) -> Result<()>;
    /// Causal attention of one query (n_head * head_dim) at position `pos[0]` (read on the
    /// device) over cache positions 0..=pos[0], or the last `at.window` of them; scores scaled
    /// by `at.scale` and soft-capped by `at.softcap` (0: none); `sinks`, a logit per query
    /// head in its softmax with no value (gpt-oss), if given.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        q: &Self::Buf<f32>,
        k_cache: &Self::Buf<u8>,
        v_cache: &Self::Buf<u8>,
        scores: &mut Self::Buf<f32>,
        out: &mut Self::Buf<f32>,
        pos: &Self::Buf<i32>,
        at: &AttnShape,
        sinks: Option<&Self::Buf<f32>>,
        f16: bool,
        m: usize,
    ) -> Result<()>;
}
