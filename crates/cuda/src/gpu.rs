//! The GPU: a context and stream, the kernels of `kernels/powerinfer.cu` loaded from their
//! committed PTX, and one typed wrapper per kernel (cudarc does not check kernel argument
//! types or order, so each launch is written once, here, against the `.cu` signature).

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;
use powerinfer_core::matmul::QMatrix;
use powerinfer_core::model::FfnActivation;
use powerinfer_core::quant::{BlockQ8Act, DType, QK};

use crate::CudaError;

/// PTX compiled from `kernels/powerinfer.cu` by `scripts/gen_ptx.sh` (checked in CI).
pub const PTX: &str = include_str!("../kernels/powerinfer.ptx");

/// Rows of the down projection one block of `down_partial` sums; the merge then adds
/// ceil(n_hot / ROWS_PER_CHUNK) partial vectors.
pub const ROWS_PER_CHUNK: usize = 128;

impl From<cudarc::driver::DriverError> for CudaError {
    fn from(e: cudarc::driver::DriverError) -> Self {
        CudaError::Driver(e.to_string())
    }
}

pub type Result<T> = std::result::Result<T, CudaError>;

/// Index of a weight type in the per-type kernel tables (F32, F16, Q4_0, Q4_1, Q8_0).
pub fn type_slot(dtype: DType) -> Result<usize> {
    Ok(match dtype {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::Q4_0 => 2,
        DType::Q4_1 => 3,
        DType::Q8_0 => 4,
        DType::BF16 => return Err(CudaError::Unsupported("BF16 weights have no GPU kernel".into())),
    })
}

const TYPE_SUFFIX: [&str; 5] = ["f32", "f16", "q4_0", "q4_1", "q8_0"];

/// The activation code the kernels switch on (ACT_* in the .cu file).
pub fn act_code(act: FfnActivation) -> i32 {
    match act {
        FfnActivation::SwiGlu => 0,
        FfnActivation::ReGlu => 1,
        FfnActivation::DReGlu => 2,
        FfnActivation::Relu => 3,
        FfnActivation::Gelu => 4,
    }
}

/// A weight matrix in device memory, rows in the file's type and layout.
pub struct DMat {
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    pub row_bytes: usize,
    pub data: CudaSlice<u8>,
}

impl DMat {
    pub fn bytes(&self) -> usize {
        self.rows * self.row_bytes
    }
}

/// An activation vector on the device as the kernels read it: `f32s` for float weights, and
/// `q8`, its int8 blocks in the CPU's `BlockQ8Act` layout, for quantized weights.
/// `Gpu::quantize_for` fills `q8` from `f32s`; whoever writes `f32s` calls it before a quantized
/// matrix reads them.
pub struct DActs {
    pub f32s: CudaSlice<f32>,
    pub q8: CudaSlice<u8>,
}

/// Bytes of one `BlockQ8Act` (32 int8 values, d and s), as `quantize_q8` writes it.
pub const Q8_BLOCK_BYTES: usize = 40;
const _: () = assert!(std::mem::size_of::<BlockQ8Act>() == Q8_BLOCK_BYTES);

struct Kernels {
    quantize_q8: CudaFunction,
    matvec: Vec<CudaFunction>,
    ffn_hot: Vec<CudaFunction>,
    down_partial: Vec<CudaFunction>,
    ffn_merge: CudaFunction,
    rmsnorm: CudaFunction,
    add_into: CudaFunction,
    add_bias: CudaFunction,
    rope: CudaFunction,
    kv_store: CudaFunction,
    attention: CudaFunction,
}

pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub name: String,
    pub total_memory: usize,
    k: Kernels,
}

fn blocks(n: usize, per: usize) -> u32 {
    n.div_ceil(per).max(1) as u32
}

fn cfg(grid: (u32, u32), threads: u32) -> LaunchConfig {
    LaunchConfig { grid_dim: (grid.0, grid.1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 }
}

/// Rows per block of the warp-per-row kernels.
const WARPS: usize = 4;

impl Gpu {
    /// Opens device `ordinal` and loads the kernels. Never panics: a missing driver or device is
    /// an error (probed first, as cudarc panics on first use without libcuda).
    pub fn open(ordinal: usize) -> Result<Gpu> {
        let devices = crate::probe()?;
        let info = devices
            .get(ordinal)
            .ok_or_else(|| CudaError::NoDevice(format!("device {ordinal} requested, {} present", devices.len())))?;
        let ctx = CudaContext::new(ordinal)?;
        let stream = ctx.default_stream();
        let module = ctx.load_module(Ptx::from_src(PTX)).map_err(|e| {
            CudaError::Driver(format!("loading the kernels' PTX failed ({e}); the PTX needs a driver for CUDA 13.0 or newer"))
        })?;
        let f = |name: &str| module.load_function(name).map_err(|e| CudaError::Driver(format!("kernel {name}: {e}")));
        let per_type = |base: &str| TYPE_SUFFIX.iter().map(|s| f(&format!("{base}_{s}"))).collect::<Result<Vec<_>>>();
        let k = Kernels {
            quantize_q8: f("quantize_q8")?,
            matvec: per_type("matvec")?,
            ffn_hot: per_type("ffn_hot")?,
            down_partial: per_type("down_partial")?,
            ffn_merge: f("ffn_merge")?,
            rmsnorm: f("rmsnorm")?,
            add_into: f("add_into")?,
            add_bias: f("add_bias")?,
            rope: f("rope")?,
            kv_store: f("kv_store")?,
            attention: f("attention")?,
        };
        Ok(Gpu { ctx, stream, name: info.name.clone(), total_memory: info.total_memory, k })
    }

    /// Raw device address of an optional buffer (0 for none), for the kernels' nullable pointers.
    fn ptr<T>(&self, s: Option<&CudaSlice<T>>) -> u64 {
        match s {
            Some(s) => s.device_ptr(&self.stream).0,
            None => 0,
        }
    }

    pub fn upload<T: cudarc::driver::DeviceRepr>(&self, host: &[T]) -> Result<CudaSlice<T>> {
        Ok(self.stream.clone_htod(host)?)
    }

    pub fn zeros<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(&self, n: usize) -> Result<CudaSlice<T>> {
        Ok(self.stream.alloc_zeros::<T>(n.max(1))?)
    }

    /// Copies `src` into the first `src.len()` elements of `dst`.
    pub fn write<T: cudarc::driver::DeviceRepr>(&self, src: &[T], dst: &mut CudaSlice<T>) -> Result<()> {
        let mut view = dst.slice_mut(..src.len());
        Ok(self.stream.memcpy_htod(src, &mut view)?)
    }

    /// Copies the first `dst.len()` elements of `src` to the host (waits for the stream).
    pub fn read<T: cudarc::driver::DeviceRepr>(&self, src: &CudaSlice<T>, dst: &mut [T]) -> Result<()> {
        let view = src.slice(..dst.len());
        Ok(self.stream.memcpy_dtoh(&view, dst)?)
    }

    /// Sets every element of `dst` to zero (queued on the stream).
    pub fn clear<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(&self, dst: &mut CudaSlice<T>) -> Result<()> {
        Ok(self.stream.memset_zeros(dst)?)
    }

    pub fn synchronize(&self) -> Result<()> {
        Ok(self.stream.synchronize()?)
    }

    /// Uploads the rows `rows` (all rows when None) of a matrix, packed in that order.
    pub fn upload_rows(&self, m: &QMatrix, rows: Option<&[u32]>) -> Result<DMat> {
        type_slot(m.dtype)?;
        let row_bytes = m.row_bytes();
        let (n, data) = match rows {
            None => (m.rows, self.upload(&m.data[..m.rows * row_bytes])?),
            Some(sel) => {
                let mut packed = Vec::with_capacity(sel.len() * row_bytes);
                for &r in sel {
                    packed.extend_from_slice(m.row(r as usize));
                }
                (sel.len(), self.upload(&packed)?)
            }
        };
        Ok(DMat { dtype: m.dtype, rows: n, cols: m.cols, row_bytes, data })
    }

    /// Device activations for vectors of up to `n` values (zeros).
    pub fn acts(&self, n: usize) -> Result<DActs> {
        Ok(DActs { f32s: self.zeros(n)?, q8: self.zeros(n.div_ceil(QK) * Q8_BLOCK_BYTES)? })
    }

    /// Rounds the first `n` values of `a.f32s` to int8 blocks in `a.q8` (the CPU's
    /// `quantize_act`, bit for bit), when one of `readers` is quantized; a no-op otherwise.
    pub fn quantize_for(&self, readers: &[&DMat], a: &mut DActs, n: usize) -> Result<()> {
        if !readers.iter().any(|w| w.dtype.is_quantized()) {
            return Ok(());
        }
        if n % QK != 0 || n.div_ceil(QK) * Q8_BLOCK_BYTES > a.q8.len() || n > a.f32s.len() {
            return Err(CudaError::Unsupported(format!("{n} activations cannot be quantized in blocks of {QK} here")));
        }
        let n_blocks = (n / QK) as i32;
        let mut b = self.stream.launch_builder(&self.k.quantize_q8);
        b.arg(&a.f32s).arg(&mut a.q8).arg(&n_blocks);
        // SAFETY: matches `quantize_q8`; both buffers hold n_blocks blocks (checked above).
        unsafe { b.launch(cfg((blocks(n / QK, WARPS), 1), 32 * WARPS as u32)) }?;
        Ok(())
    }

    /// Checks that `x` can feed a product with `cols` inputs of type `dtype`.
    fn check_input(dtype: DType, cols: usize, x: &DActs) -> Result<()> {
        let short = if dtype.is_quantized() { x.q8.len() < cols / QK * Q8_BLOCK_BYTES } else { x.f32s.len() < cols };
        if short {
            return Err(CudaError::Unsupported(format!("an activation buffer is shorter than the {cols} inputs of a {} matrix", dtype.name())));
        }
        Ok(())
    }

    /// y[r] = W[r] . x (+ bias[r]), relu'd when asked, for every row of `w`. A quantized `w`
    /// reads `x.q8` (see `quantize_for`).
    pub fn matvec(&self, w: &DMat, x: &DActs, bias: Option<&CudaSlice<f32>>, y: &mut CudaSlice<f32>, relu: bool) -> Result<()> {
        Self::check_input(w.dtype, w.cols, x)?;
        let f = &self.k.matvec[type_slot(w.dtype)?];
        let (row_bytes, rows, cols, relu, bias) = (w.row_bytes as u64, w.rows as i32, w.cols as i32, relu as i32, self.ptr(bias));
        let mut b = self.stream.launch_builder(f);
        b.arg(&w.data).arg(&row_bytes).arg(&x.f32s).arg(&x.q8).arg(&bias).arg(y).arg(&rows).arg(&cols).arg(&relu);
        // SAFETY: argument types and order match `matvec_*` in powerinfer.cu; x is checked
        // above, y and bias are sized by the callers.
        unsafe { b.launch(cfg((blocks(w.rows, WARPS), 1), 32 * WARPS as u32)) }?;
        Ok(())
    }

    /// The hot neurons: h[i] = act(gate_i . x, up_i . x + up_bias[bucket[i]]) for the packed
    /// GPU rows, 0 where the predictor's logit for neuron bucket[i] is below `threshold`.
    #[allow(clippy::too_many_arguments)]
    pub fn ffn_hot(
        &self,
        gate: Option<&DMat>,
        up: &DMat,
        bucket: &CudaSlice<i32>,
        x: &DActs,
        up_bias: Option<&CudaSlice<f32>>,
        pred_logits: Option<&CudaSlice<f32>>,
        threshold: f32,
        selected: Option<(&mut CudaSlice<u32>, usize)>,
        act: FfnActivation,
        h: &mut CudaSlice<f32>,
    ) -> Result<()> {
        if let Some(g) = gate {
            if g.dtype != up.dtype || g.rows != up.rows {
                return Err(CudaError::Unsupported(format!("gate ({}) and up ({}) differ in type", g.dtype.name(), up.dtype.name())));
            }
        }
        Self::check_input(up.dtype, up.cols, x)?;
        let f = &self.k.ffn_hot[type_slot(up.dtype)?];
        let gate_ptr = gate.map_or(0, |g| g.data.device_ptr(&self.stream).0);
        let (row_bytes, n_hot, cols, act) = (up.row_bytes as u64, up.rows as i32, up.cols as i32, act_code(act));
        let (up_bias, pred) = (self.ptr(up_bias), self.ptr(pred_logits));
        let selected = match selected {
            Some((counts, slot)) => {
                assert!(slot < counts.len(), "count slot {slot} of {}", counts.len());
                counts.device_ptr_mut(&self.stream).0 + (slot * std::mem::size_of::<u32>()) as u64
            }
            None => 0,
        };
        let mut b = self.stream.launch_builder(f);
        b.arg(&gate_ptr).arg(&up.data).arg(&row_bytes).arg(bucket).arg(&x.f32s).arg(&x.q8).arg(&up_bias).arg(&pred).arg(&threshold);
        b.arg(&selected).arg(h).arg(&n_hot).arg(&cols).arg(&act);
        // SAFETY: matches `ffn_hot_*`; bucket and h hold n_hot entries, up_bias and pred_logits
        // n_ff; `selected` is null or one u32 inside `counts` (checked above).
        unsafe { b.launch(cfg((blocks(up.rows, WARPS), 1), 32 * WARPS as u32)) }?;
        Ok(())
    }

    /// partial[k, c] = sum over the rows i of chunk k of h[i] * down_t[i, c]; returns the
    /// number of chunks written.
    pub fn down_partial(&self, down_t: &DMat, h: &CudaSlice<f32>, partial: &mut CudaSlice<f32>) -> Result<usize> {
        let f = &self.k.down_partial[type_slot(down_t.dtype)?];
        let n_chunks = down_t.rows.div_ceil(ROWS_PER_CHUNK);
        if n_chunks == 0 {
            return Ok(0);
        }
        let (row_bytes, n_hot, cols, per) = (down_t.row_bytes as u64, down_t.rows as i32, down_t.cols as i32, ROWS_PER_CHUNK as i32);
        let mut b = self.stream.launch_builder(f);
        b.arg(&down_t.data).arg(&row_bytes).arg(h).arg(&n_hot).arg(&cols).arg(&per).arg(partial);
        // SAFETY: matches `down_partial_*`; partial holds n_chunks * cols floats.
        unsafe { b.launch(cfg((blocks(down_t.cols, 256), n_chunks as u32), 256)) }?;
        Ok(n_chunks)
    }

    /// x[c] += sum of the first `n_chunks` partial vectors + cpu_part[c] + bias[c].
    pub fn ffn_merge(
        &self,
        x: &mut CudaSlice<f32>,
        partial: &CudaSlice<f32>,
        n_chunks: usize,
        cpu_part: Option<&CudaSlice<f32>>,
        bias: Option<&CudaSlice<f32>>,
        cols: usize,
    ) -> Result<()> {
        let (n_chunks_i, cols_i, cpu, bias) = (n_chunks as i32, cols as i32, self.ptr(cpu_part), self.ptr(bias));
        let mut b = self.stream.launch_builder(&self.k.ffn_merge);
        b.arg(x).arg(partial).arg(&n_chunks_i).arg(&cpu).arg(&bias).arg(&cols_i);
        // SAFETY: matches `ffn_merge`.
        unsafe { b.launch(cfg((blocks(cols, 256), 1), 256)) }?;
        Ok(())
    }

    pub fn rmsnorm(&self, x: &CudaSlice<f32>, w: &CudaSlice<f32>, out: &mut CudaSlice<f32>, n: usize, eps: f32) -> Result<()> {
        let n_i = n as i32;
        let mut b = self.stream.launch_builder(&self.k.rmsnorm);
        b.arg(x).arg(w).arg(out).arg(&n_i).arg(&eps);
        // SAFETY: matches `rmsnorm`; one block.
        unsafe { b.launch(cfg((1, 1), 1024)) }?;
        Ok(())
    }

    /// x += y (+ bias)
    pub fn add_into(&self, x: &mut CudaSlice<f32>, y: &CudaSlice<f32>, bias: Option<&CudaSlice<f32>>, n: usize) -> Result<()> {
        let (n_i, bias) = (n as i32, self.ptr(bias));
        let mut b = self.stream.launch_builder(&self.k.add_into);
        b.arg(x).arg(y).arg(&bias).arg(&n_i);
        // SAFETY: matches `add_into`.
        unsafe { b.launch(cfg((blocks(n, 256), 1), 256)) }?;
        Ok(())
    }

    pub fn add_bias(&self, x: &mut CudaSlice<f32>, bias: &CudaSlice<f32>, n: usize) -> Result<()> {
        let n_i = n as i32;
        let mut b = self.stream.launch_builder(&self.k.add_bias);
        b.arg(x).arg(bias).arg(&n_i);
        // SAFETY: matches `add_bias`.
        unsafe { b.launch(cfg((blocks(n, 256), 1), 256)) }?;
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    pub fn rope(&self, x: &mut CudaSlice<f32>, cos: &CudaSlice<f32>, sin: &CudaSlice<f32>, n_heads: usize, head_dim: usize, rope_dim: usize, neox: bool) -> Result<()> {
        if rope_dim == 0 {
            return Ok(());
        }
        let (nh, hd, rd, nx) = (n_heads as i32, head_dim as i32, rope_dim as i32, neox as i32);
        let mut b = self.stream.launch_builder(&self.k.rope);
        b.arg(x).arg(cos).arg(sin).arg(&nh).arg(&hd).arg(&rd).arg(&nx);
        // SAFETY: matches `rope`.
        unsafe { b.launch(cfg((blocks(n_heads * rope_dim / 2, 256), 1), 256)) }?;
        Ok(())
    }

    /// Stores one position's k and v in the caches (u8 buffers of f32 or f16 elements).
    #[allow(clippy::too_many_arguments)]
    pub fn kv_store(&self, k: &CudaSlice<f32>, v: &CudaSlice<f32>, k_cache: &mut CudaSlice<u8>, v_cache: &mut CudaSlice<u8>, pos: usize, kv_dim: usize, f16: bool) -> Result<()> {
        let elem = if f16 { 2 } else { 4 };
        if (pos + 1) * kv_dim * elem > k_cache.len() {
            return Err(CudaError::Unsupported(format!("position {pos} is past the GPU KV cache")));
        }
        let (p, d, h) = (pos as i32, kv_dim as i32, f16 as i32);
        let mut b = self.stream.launch_builder(&self.k.kv_store);
        b.arg(k).arg(v).arg(k_cache).arg(v_cache).arg(&p).arg(&d).arg(&h);
        // SAFETY: matches `kv_store`; the cache bound is checked above.
        unsafe { b.launch(cfg((blocks(kv_dim, 256), 1), 256)) }?;
        Ok(())
    }

    /// Causal attention of one query (n_head * head_dim) over cache positions 0..len.
    #[allow(clippy::too_many_arguments)]
    pub fn attention(
        &self,
        q: &CudaSlice<f32>,
        k_cache: &CudaSlice<u8>,
        v_cache: &CudaSlice<u8>,
        scores: &mut CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        len: usize,
        n_ctx: usize,
        n_head: usize,
        n_head_kv: usize,
        head_dim: usize,
        f16: bool,
    ) -> Result<()> {
        let scale = 1.0 / (head_dim as f32).sqrt();
        let (len_i, ctx_i, nh, nkv, hd, h) = (len as i32, n_ctx as i32, n_head as i32, n_head_kv as i32, head_dim as i32, f16 as i32);
        let mut b = self.stream.launch_builder(&self.k.attention);
        b.arg(q).arg(k_cache).arg(v_cache).arg(scores).arg(out).arg(&len_i).arg(&ctx_i).arg(&nh).arg(&nkv).arg(&hd).arg(&scale).arg(&h);
        // SAFETY: matches `attention`; scores holds n_head * n_ctx floats and len <= n_ctx.
        unsafe { b.launch(cfg((n_head as u32, 1), 256)) }?;
        Ok(())
    }
}
