//! `Gpu<D>`: the executor's view of a device (`device.rs`): typed weight matrices and
//! activation buffers, and one checked call per kernel. Arguments are checked here, once, for
//! every device, since a CUDA kernel handed a short buffer writes past it silently.

use powerinfer_core::matmul::QMatrix;
use powerinfer_core::model::FfnActivation;
use powerinfer_core::quant::{DType, QK};

use crate::device::{Buf, Cuda, Device, Elem, Emulated};
// what the executor and the kernel tests know these by
pub use crate::device::{
    act_code, act_of_code, type_slot, AttnShape, DActs, DMat, Result, Q8_BLOCK_BYTES,
};
use crate::CudaError;

/// Rows of the down projection one block of `down_partial` sums; the merge then adds
/// ceil(n_hot / ROWS_PER_CHUNK) partial vectors.
pub const ROWS_PER_CHUNK: usize = 128;

/// A device and what the executor reports of it.
pub struct Gpu<D: Device = Cuda> {
    pub dev: D,
    pub name: String,
    pub total_memory: usize,
}

/// The position a token's kernels work at, in device memory: kernels read it there, so a
/// recorded sequence of them (`Device::Graph`) serves every position. `value` is the host's
/// copy, which the launches' bounds checks read.
pub struct DevicePos<D: Device> {
    buf: Buf<D, i32>,
    value: usize,
}

impl Gpu<Cuda> {
    /// Opens CUDA device `ordinal` and loads the kernels; a missing driver or device is an error.
    pub fn open(ordinal: usize) -> Result<Gpu<Cuda>> {
        Ok(Gpu::on(Cuda::open(ordinal)?))
    }
}

impl Gpu<Emulated> {
    /// The emulated device: host memory and the kernels' twins (a correctness tool, not fast).
    pub fn emulated() -> Gpu<Emulated> {
        Gpu::on(Emulated)
    }
}

fn short(what: &str, have: usize, need: usize) -> CudaError {
    CudaError::Unsupported(format!("{what} holds {have} elements where {need} are needed"))
}

impl<D: Device> Gpu<D> {
    pub fn on(dev: D) -> Gpu<D> {
        Gpu { name: dev.name(), total_memory: dev.total_memory(), dev }
    }

    /// Fails unless `buf` holds at least `need` elements.
    fn holds<T: Elem>(what: &str, buf: &Buf<D, T>, need: usize) -> Result<()> {
        let have = D::len(buf);
        if have < need {
            return Err(short(what, have, need));
        }
        Ok(())
    }

    fn holds_opt<T: Elem>(what: &str, buf: Option<&Buf<D, T>>, need: usize) -> Result<()> {
        buf.map_or(Ok(()), |b| Self::holds(what, b, need))
    }

    pub fn upload<T: Elem>(&self, host: &[T]) -> Result<Buf<D, T>> {
        self.dev.upload(host)
    }

    pub fn zeros<T: Elem>(&self, n: usize) -> Result<Buf<D, T>> {
        self.dev.zeros(n)
    }

    /// Copies `src` into the first `src.len()` elements of `dst`.
    pub fn write<T: Elem>(&self, src: &[T], dst: &mut Buf<D, T>) -> Result<()> {
        Self::holds("a write's destination", dst, src.len())?;
        self.dev.write(src, dst)
    }

    /// Copies the first `dst.len()` elements of `src` to the host (waits for the queued work).
    pub fn read<T: Elem>(&self, src: &Buf<D, T>, dst: &mut [T]) -> Result<()> {
        Self::holds("a read's source", src, dst.len())?;
        self.dev.read(src, dst)
    }

    /// Sets every element of `dst` to zero (queued).
    pub fn clear<T: Elem>(&self, dst: &mut Buf<D, T>) -> Result<()> {
        self.dev.clear(dst)
    }

    pub fn synchronize(&self) -> Result<()> {
        self.dev.synchronize()
    }

    /// Copies elements src_start .. src_start + n of `src` to dst_start .. dst_start + n of
    /// `dst` (queued).
    pub fn copy<T: Elem>(
        &self,
        src: &Buf<D, T>,
        src_start: usize,
        dst: &mut Buf<D, T>,
        dst_start: usize,
        n: usize,
    ) -> Result<()> {
        if src_start + n > D::len(src) || dst_start + n > D::len(dst) {
            return Err(CudaError::Unsupported(format!(
                "a copy of {n} elements from {src_start} to {dst_start} runs past a buffer"
            )));
        }
        self.dev.copy(src, src_start, dst, dst_start, n)
    }

    /// Uploads the rows `rows` (all rows when None) of a matrix, packed in that order.
    pub fn upload_rows(&self, m: &QMatrix, rows: Option<&[u32]>) -> Result<DMat<D>> {
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
    pub fn acts(&self, n: usize) -> Result<DActs<D>> {
        Ok(DActs {
            f32s: self.zeros(n)?,
            q8: self.zeros(n.div_ceil(QK) * Q8_BLOCK_BYTES)?,
            rounded: false,
        })
    }

    /// Rounds the first `n` values of `a.f32s` to int8 blocks in `a.q8` (the CPU's
    /// `quantize_act`, bit for bit), when one of `readers` is quantized; a no-op otherwise.
    pub fn quantize_for(&self, readers: &[&DMat<D>], a: &mut DActs<D>, n: usize) -> Result<()> {
        if !readers.iter().any(|w| w.dtype.is_quantized()) || std::mem::take(&mut a.rounded) {
            return Ok(());
        }
        Self::check_rounding(a, n)?;
        self.dev.quantize_q8(&a.f32s, &mut a.q8, n / QK)
    }

    fn check_rounding(a: &DActs<D>, n: usize) -> Result<()> {
        if !n.is_multiple_of(QK)
            || n.div_ceil(QK) * Q8_BLOCK_BYTES > D::len(&a.q8)
            || n > D::len(&a.f32s)
        {
            return Err(CudaError::Unsupported(format!(
                "{n} activations cannot be quantized in blocks of {QK} here"
            )));
        }
        Ok(())
    }

    /// Checks that `x` can feed a product with `cols` inputs of type `dtype`, for m rows.
    fn check_input(dtype: DType, cols: usize, x: &DActs<D>, m: usize) -> Result<()> {
        let short = if dtype.is_quantized() {
            D::len(&x.q8) < m * cols / QK * Q8_BLOCK_BYTES
        } else {
            D::len(&x.f32s) < m * cols
        };
        if short {
            return Err(CudaError::Unsupported(format!(
                "an activation buffer is shorter than the {cols} inputs of a {} matrix",
                dtype.name()
            )));
        }
        Ok(())
    }

    /// y[t, r] = W[r] . x[t] (+ bias[r]), relu'd when asked, for every row of `w` and each of
    /// the m rows of x. A quantized `w` reads `x.q8` (see `quantize_for`).
    pub fn matvec(
        &self,
        w: &DMat<D>,
        x: &DActs<D>,
        bias: Option<&Buf<D, f32>>,
        y: &mut Buf<D, f32>,
        relu: bool,
        m: usize,
    ) -> Result<()> {
        self.matvec_at(w, x, bias, y, 0, relu, m)
    }

    /// `matvec` into y from element `at` (an expert's output into its slot of a gathered
    /// buffer, without a copy).
    #[allow(clippy::too_many_arguments)]
    pub fn matvec_at(
        &self,
        w: &DMat<D>,
        x: &DActs<D>,
        bias: Option<&Buf<D, f32>>,
        y: &mut Buf<D, f32>,
        at: usize,
        relu: bool,
        m: usize,
    ) -> Result<()> {
        Self::check_input(w.dtype, w.cols, x, m)?;
        type_slot(w.dtype)?;
        Self::holds("a matvec's output", y, at + m * w.rows)?;
        Self::holds_opt("a matvec's bias", bias, w.rows)?;
        self.dev.matvec(w, x, bias, y, at, relu, m)
    }

    /// y_i = w_i . x (+ bias_i) for three matrices on one input (q, k and v): one launch where
    /// they share a type and width, else three.
    pub fn matvec3(
        &self,
        w: [&DMat<D>; 3],
        x: &DActs<D>,
        bias: [Option<&Buf<D, f32>>; 3],
        y: [&mut Buf<D, f32>; 3],
        m: usize,
    ) -> Result<()> {
        let [y0, y1, y2] = y;
        if w.iter().any(|mat| mat.dtype != w[0].dtype || mat.cols != w[0].cols) {
            self.matvec(w[0], x, bias[0], y0, false, m)?;
            self.matvec(w[1], x, bias[1], y1, false, m)?;
            return self.matvec(w[2], x, bias[2], y2, false, m);
        }
        Self::check_input(w[0].dtype, w[0].cols, x, m)?;
        type_slot(w[0].dtype)?;
        for (i, y) in [&*y0, &*y1, &*y2].into_iter().enumerate() {
            Self::holds("a matvec's output", y, m * w[i].rows)?;
            Self::holds_opt("a matvec's bias", bias[i], w[i].rows)?;
        }
        self.dev.matvec3(w, x, bias, [y0, y1, y2], m)
    }

    /// The hot neurons: h[i] = act(gate_i . x, up_i . x + up_bias[bucket[i]]) for the packed
    /// GPU rows, 0 where the predictor's logit for neuron bucket[i] is below `threshold`.
    /// `selected` (counters, slot) adds the number of rows the predictor selects to one counter.
    /// With m > 1 rows of x, h holds m rows of n_hot and `pred_logits` (logits, n_ff) m rows of
    /// the layer's n_ff logits.
    #[allow(clippy::too_many_arguments)]
    pub fn ffn_hot(
        &self,
        gate: Option<&DMat<D>>,
        up: &DMat<D>,
        bucket: &Buf<D, i32>,
        x: &DActs<D>,
        bias: [Option<&Buf<D, f32>>; 2],
        pred_logits: Option<(&Buf<D, f32>, usize)>,
        threshold: f32,
        selected: Option<(&mut Buf<D, u32>, usize)>,
        act: FfnActivation,
        h: &mut Buf<D, f32>,
        m: usize,
    ) -> Result<()> {
        if let Some((logits, n_ff)) = pred_logits {
            Self::holds("the predictor's logits", logits, m * n_ff)?;
        }
        if let Some(g) = gate {
            if g.dtype != up.dtype || g.rows != up.rows || g.cols != up.cols {
                return Err(CudaError::Unsupported(format!(
                    "gate ({}) and up ({}) differ in type or shape",
                    g.dtype.name(),
                    up.dtype.name()
                )));
            }
        }
        Self::check_input(up.dtype, up.cols, x, m)?;
        type_slot(up.dtype)?;
        Self::holds("the hot bucket", bucket, up.rows)?;
        Self::holds("the hot activations", h, m * up.rows)?;
        if let Some((counts, slot)) = &selected {
            Self::holds("the selection counters", counts, slot + 1)?;
        }
        self.dev.ffn_hot(
            gate,
            up,
            bucket,
            x,
            bias,
            pred_logits,
            threshold,
            selected,
            act_code(act)?,
            h,
            m,
        )
    }

    /// A token's experts held on the device in one launch: h[s, i] = act(gates[s][i] . x,
    /// ups[s][i] . x) for every row i of slot s's expert (x: one row). The slots' matrices must
    /// share one type and shape; an expert's row is what `ffn_hot` computes for it.
    pub fn experts_hot(
        &self,
        gates: &[&DMat<D>],
        ups: &[&DMat<D>],
        x: &DActs<D>,
        act: FfnActivation,
        h: &mut Buf<D, f32>,
    ) -> Result<()> {
        let Some(&up) = ups.first() else { return Ok(()) };
        Self::same_shape(
            "the experts' gate and up",
            gates.iter().chain(ups),
            gates.len() == ups.len(),
        )?;
        Self::check_input(up.dtype, up.cols, x, 1)?;
        type_slot(up.dtype)?;
        Self::holds("the experts' activations", h, ups.len() * up.rows)?;
        self.dev.experts_hot(gates, ups, x, act_code(act)?, h)
    }

    /// The down products of a token's experts on the device in one launch: y[at[s] + r] =
    /// downs[s][r] . h[s] (h: a row a slot, `quantize_for` the down type first); as `matvec_at`
    /// computes each.
    pub fn experts_down(
        &self,
        downs: &[&DMat<D>],
        h: &DActs<D>,
        y: &mut Buf<D, f32>,
        at: &[usize],
    ) -> Result<()> {
        let Some(&down) = downs.first() else { return Ok(()) };
        Self::same_shape("the experts' down", downs.iter(), downs.len() == at.len())?;
        Self::check_input(down.dtype, down.cols, h, downs.len())?;
        type_slot(down.dtype)?;
        let end = at.iter().map(|&a| a + down.rows).max().unwrap_or(0);
        Self::holds("the experts' outputs", y, end)?;
        self.dev.experts_down(downs, h, y, at)
    }

    /// That the matrices `of` share the first's type and shape (and `counts_agree`).
    fn same_shape<'m>(
        what: &str,
        mut of: impl Iterator<Item = &'m &'m DMat<D>>,
        counts_agree: bool,
    ) -> Result<()>
    where
        D: 'm,
    {
        let first = of.next().copied();
        let agree = first.is_some_and(|f| {
            of.all(|m| {
                (m.dtype, m.rows, m.cols, m.row_bytes) == (f.dtype, f.rows, f.cols, f.row_bytes)
            })
        });
        if !counts_agree || !agree {
            return Err(CudaError::Unsupported(format!(
                "{what} in one launch need one type and shape each and a matrix a slot"
            )));
        }
        Ok(())
    }

    /// partial[k, c] = sum over the rows i of chunk k of h[i] * down_t[i, c]; returns the
    /// number of chunks written.
    pub fn down_partial(
        &self,
        down_t: &DMat<D>,
        h: &Buf<D, f32>,
        partial: &mut Buf<D, f32>,
        m: usize,
    ) -> Result<usize> {
        type_slot(down_t.dtype)?;
        let n_chunks = down_t.rows.div_ceil(ROWS_PER_CHUNK);
        if n_chunks == 0 {
            return Ok(0);
        }
        Self::holds("the hot activations", h, m * down_t.rows)?;
        Self::holds("the partial sums", partial, m * n_chunks * down_t.cols)?;
        self.dev.down_partial(down_t, h, partial, ROWS_PER_CHUNK, m)?;
        Ok(n_chunks)
    }

    /// For each of m rows t: x[t, c] += the sum of row t's `n_chunks` partial vectors +
    /// cpu_part[t, c] + bias[c].
    #[allow(clippy::too_many_arguments)]
    pub fn ffn_merge(
        &self,
        x: &mut Buf<D, f32>,
        partial: &Buf<D, f32>,
        n_chunks: usize,
        cpu_part: Option<&Buf<D, f32>>,
        bias: Option<&Buf<D, f32>>,
        cols: usize,
        m: usize,
    ) -> Result<()> {
        Self::holds("the residual", x, m * cols)?;
        Self::holds("the partial sums", partial, m * n_chunks * cols)?;
        Self::holds_opt("the CPU part", cpu_part, m * cols)?;
        Self::holds_opt("the down bias", bias, cols)?;
        self.dev.ffn_merge(x, partial, n_chunks, cpu_part, bias, cols, m)
    }

    /// out = RMSNorm(x) * w for each of m rows of n, rounded to int8 blocks in the same launch
    /// when `round` (the matrices that read it next are quantized: `any_quantized`).
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm(
        &self,
        x: &Buf<D, f32>,
        w: &Buf<D, f32>,
        out: &mut DActs<D>,
        n: usize,
        eps: f32,
        round: bool,
        m: usize,
    ) -> Result<()> {
        Self::holds("a norm's input", x, m * n)?;
        let (f32s, q8) = Self::norm_output(w, out, n, round, m)?;
        self.dev.rmsnorm(x, w, f32s, q8, n, eps, m)
    }

    /// x += y, then `rmsnorm` of x (one launch: a residual add and the next norm).
    #[allow(clippy::too_many_arguments)]
    pub fn add_rmsnorm(
        &self,
        x: &mut Buf<D, f32>,
        y: &Buf<D, f32>,
        w: &Buf<D, f32>,
        out: &mut DActs<D>,
        n: usize,
        eps: f32,
        round: bool,
        m: usize,
    ) -> Result<()> {
        Self::holds("a norm's input", x, m * n)?;
        Self::holds("a residual's addend", y, m * n)?;
        let (f32s, q8) = Self::norm_output(w, out, n, round, m)?;
        self.dev.add_rmsnorm(x, y, w, f32s, q8, n, eps, m)
    }

    /// Whether one of `readers` reads int8 input blocks (a norm feeding them rounds for them).
    pub fn any_quantized(readers: &[&DMat<D>]) -> bool {
        readers.iter().any(|w| w.dtype.is_quantized())
    }

    /// A norm's checked weights and output: its values, and its int8 blocks when it rounds.
    fn norm_output<'o>(
        w: &Buf<D, f32>,
        out: &'o mut DActs<D>,
        n: usize,
        round: bool,
        m: usize,
    ) -> Result<(&'o mut Buf<D, f32>, Option<&'o mut Buf<D, u8>>)> {
        Self::holds("a norm's weights", w, n)?;
        Self::holds("a norm's output", &out.f32s, m * n)?;
        if round {
            Self::check_rounding(out, m * n)?;
        }
        out.rounded = round;
        Ok((&mut out.f32s, if round { Some(&mut out.q8) } else { None }))
    }

    /// Each of the n_heads heads of x (head_dim each) RMS-normed in place, times w (head_dim);
    /// one head of n values is an in-place RMSNorm of a vector.
    pub fn head_rmsnorm(
        &self,
        x: &mut Buf<D, f32>,
        w: &Buf<D, f32>,
        n_heads: usize,
        head_dim: usize,
        eps: f32,
    ) -> Result<()> {
        Self::holds("a per-head norm's input", x, n_heads * head_dim)?;
        Self::holds("a per-head norm's weights", w, head_dim)?;
        self.dev.head_rmsnorm(x, w, n_heads, head_dim, eps)
    }

    /// x += y (+ bias)
    pub fn add_into(
        &self,
        x: &mut Buf<D, f32>,
        y: &Buf<D, f32>,
        bias: Option<&Buf<D, f32>>,
        n: usize,
    ) -> Result<()> {
        Self::holds("a sum's output", x, n)?;
        Self::holds("a sum's input", y, n)?;
        Self::holds_opt("a bias", bias, n)?;
        self.dev.add_into(x, y, bias, n)
    }

    /// RoPE on q (n_head heads) and k (n_head_kv heads) of m rows, each at its own position's
    /// angles (cos and sin: m rows of rope_dim / 2), in one launch.
    #[allow(clippy::too_many_arguments)]
    pub fn rope(
        &self,
        q: &mut Buf<D, f32>,
        k: &mut Buf<D, f32>,
        cos: &Buf<D, f32>,
        sin: &Buf<D, f32>,
        n_head: usize,
        n_head_kv: usize,
        head_dim: usize,
        rope_dim: usize,
        neox: bool,
        m: usize,
    ) -> Result<()> {
        if rope_dim == 0 {
            return Ok(());
        }
        if rope_dim > head_dim || !rope_dim.is_multiple_of(2) {
            return Err(CudaError::Unsupported(format!(
                "RoPE over {rope_dim} of {head_dim} head dimensions"
            )));
        }
        Self::holds("RoPE's queries", q, m * n_head * head_dim)?;
        Self::holds("RoPE's keys", k, m * n_head_kv * head_dim)?;
        Self::holds("RoPE's cosines", cos, m * rope_dim / 2)?;
        Self::holds("RoPE's sines", sin, m * rope_dim / 2)?;
        self.dev.rope(q, k, cos, sin, n_head, n_head_kv, head_dim, rope_dim, neox, m)
    }

    /// A position on the device, for `kv_store` and `attention` (see `DevicePos`).
    pub fn pos(&self) -> Result<DevicePos<D>> {
        Ok(DevicePos { buf: self.zeros(1)?, value: 0 })
    }

    /// Sets `p` to `pos` (queued: kernels queued after this read it).
    pub fn set_pos(&self, p: &mut DevicePos<D>, pos: usize) -> Result<()> {
        let v = i32::try_from(pos)
            .map_err(|_| CudaError::Unsupported(format!("position {pos} is out of range")))?;
        self.dev.write(&[v], &mut p.buf)?;
        p.value = pos;
        Ok(())
    }

    /// Stores m rows of k and v at positions pos .. pos + m of the caches (u8 buffers of f32
    /// or f16 elements).
    #[allow(clippy::too_many_arguments)]
    pub fn kv_store(
        &self,
        k: &Buf<D, f32>,
        v: &Buf<D, f32>,
        k_cache: &mut Buf<D, u8>,
        v_cache: &mut Buf<D, u8>,
        pos: &DevicePos<D>,
        kv_dim: usize,
        f16: bool,
        m: usize,
    ) -> Result<()> {
        let elem = if f16 { 2 } else { 4 };
        if (pos.value + m) * kv_dim * elem > D::len(k_cache).min(D::len(v_cache)) {
            return Err(CudaError::Unsupported(format!(
                "position {} is past the GPU KV cache",
                pos.value + m - 1
            )));
        }
        Self::holds("a new key", k, m * kv_dim)?;
        Self::holds("a new value", v, m * kv_dim)?;
        self.dev.kv_store(k, v, k_cache, v_cache, &pos.buf, kv_dim, f16, m)
    }

    /// Causal attention of m queries (n_head * head_dim each) at positions pos .. pos + m, each
    /// over cache positions 0..=its own (or its window).
    #[allow(clippy::too_many_arguments)]
    pub fn attention(
        &self,
        q: &Buf<D, f32>,
        k_cache: &Buf<D, u8>,
        v_cache: &Buf<D, u8>,
        scores: &mut Buf<D, f32>,
        out: &mut Buf<D, f32>,
        pos: &DevicePos<D>,
        at: &AttnShape,
        sinks: Option<&Buf<D, f32>>,
        f16: bool,
        m: usize,
    ) -> Result<()> {
        let AttnShape { n_ctx, n_head, n_head_kv, head_dim, .. } = *at;
        let len = pos.value + m;
        let kv_bytes = len * n_head_kv * head_dim * if f16 { 2 } else { 4 };
        if len > n_ctx || n_head_kv == 0 || n_head % n_head_kv != 0 {
            return Err(CudaError::Unsupported(format!("attention over {len} of {n_ctx} positions with {n_head} heads and {n_head_kv} KV heads")));
        }
        Self::holds("the key cache", k_cache, kv_bytes)?;
        Self::holds("the value cache", v_cache, kv_bytes)?;
        Self::holds("the query", q, m * n_head * head_dim)?;
        Self::holds("the attention scores", scores, m * n_head * n_ctx)?;
        Self::holds("the attention output", out, m * n_head * head_dim)?;
        if let Some(s) = sinks {
            Self::holds("the attention sinks", s, n_head)?;
        }
        self.dev.attention(q, k_cache, v_cache, scores, out, &pos.buf, at, sinks, f16, m)
    }

    /// Records the launches that follow (see `Device::begin_capture`); false where the device
    /// cannot.
    pub fn begin_capture(&self) -> Result<bool> {
        self.dev.begin_capture()
    }

    pub fn end_capture(&self) -> Result<D::Graph> {
        self.dev.end_capture()
    }

    pub fn launch_graph(&self, graph: &D::Graph) -> Result<()> {
        self.dev.launch_graph(graph)
    }
}
