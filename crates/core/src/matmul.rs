//! Matrix products of file-format weights with activations: the one place that picks the SIMD
//! level and splits work across rayon threads. Kernels (`quant/`, `avx2.rs`, `avx512.rs`) take slices and
//! know nothing about threads, so the pool can change without touching them.
//!
//! `y = x @ W^T` with W stored row-major as (rows, cols) in its file format and x as (n, cols).
//! Decode is n = 1 (matrix-vector); prefill multiplies all prompt tokens at once, four tokens per
//! weight-row pass so each unpacked weight block is reused.

use rayon::prelude::*;

use crate::kernels::{self, Rows, TokenActs};
use crate::quant::interleaved::Interleaved;
use crate::quant::q256::{self, BlockQ8K};
#[cfg(target_arch = "x86_64")]
use crate::quant::q256_x86::GroupWidth;
#[cfg(target_arch = "x86_64")]
use crate::quant::q32_x86;
use crate::quant::{self, ActQuad, BlockQ8Act, DType, QK, QK_K};

pub(crate) use crate::simd::prefetch;
pub use crate::simd::{avx_vnni, simd_level, SimdLevel};

/// Row r of each of `mats` (matrices with the same number of rows, of any types and widths),
/// one after another, for r = 0, 1, ...: `out` holds rows of the summed row bytes. An FFN's
/// gate, up and down_t interleaved this way put all of a neuron's weights in one contiguous
/// run (`Model::neuron_bundles`).
pub fn interleave_rows(mats: &[QMatrix], out: &mut [u8]) {
    let stride: usize = mats.iter().map(|m| m.row_bytes()).sum();
    let rows = mats.first().map_or(0, |m| m.rows);
    assert!(mats.iter().all(|m| m.rows == rows), "interleaved matrices have the same rows");
    assert_eq!(out.len(), rows * stride, "out holds every row of every matrix");
    for (r, dst) in out.chunks_exact_mut(stride.max(1)).enumerate() {
        let mut at = 0;
        for m in mats {
            dst[at..at + m.row_bytes()].copy_from_slice(m.row(r));
            at += m.row_bytes();
        }
    }
}

/// A weight matrix in its file format: `rows` rows of `cols` elements, row-major.
#[derive(Clone, Copy)]
pub struct QMatrix<'a> {
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    pub data: &'a [u8],
}

impl<'a> QMatrix<'a> {
    /// The rows as the kernels' loops read them.
    pub(crate) fn as_rows(&self) -> Rows<'a> {
        let row_bytes = self.row_bytes();
        Rows { data: self.data, row_bytes, stride: row_bytes }
    }

    pub fn row_bytes(&self) -> usize {
        self.dtype.row_bytes(self.cols)
    }

    pub fn row(&self, r: usize) -> &'a [u8] {
        let rb = self.row_bytes();
        &self.data[r * rb..(r + 1) * rb]
    }

    /// Rows r0..r1 as a matrix of their own (a view, no copy).
    pub fn rows_range(&self, r0: usize, r1: usize) -> QMatrix<'a> {
        let rb = self.row_bytes();
        QMatrix {
            dtype: self.dtype,
            rows: r1 - r0,
            cols: self.cols,
            data: &self.data[r0 * rb..r1 * rb],
        }
    }

    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        quant::dequantize_row(self.dtype, self.row(r), &mut out[..self.cols]);
    }

    /// Writes the transpose (cols, rows) as `dtype` rows into `out` (at least cols rows of
    /// `dtype.row_bytes(rows)`): row j of the result is column j of this matrix, dequantized and
    /// stored again (exactly for F32, to f16 precision for F16, re-quantized for quantized types).
    pub fn transpose_into(&self, dtype: DType, out: &mut [u8]) {
        let (rows, cols) = (self.rows, self.cols);
        let row_bytes = dtype.row_bytes(rows);
        let mut dense = vec![0.0f32; rows * cols];
        dense.par_chunks_mut(cols).enumerate().for_each(|(r, o)| self.dequantize_row(r, o));
        out[..cols * row_bytes].par_chunks_mut(row_bytes).enumerate().for_each(|(j, row)| {
            let column: Vec<f32> = (0..rows).map(|i| dense[i * cols + j]).collect();
            row.copy_from_slice(&quant::quantize_row(dtype, &column));
        });
    }
}

/// A batch of activation rows (n, cols) held both as f32 (for float weights) and as int8 blocks
/// (for quantized weights). Reused across calls to avoid per-token allocation.
#[derive(Default)]
pub struct Activations {
    pub n: usize,
    pub cols: usize,
    pub f32s: Vec<f32>,
    pub q8: Vec<BlockQ8Act>,
    /// With AVX2 and at least `group_min_tokens` tokens: -128 times each `q8` block's sum
    /// (n, cols / 32), where the prompts' 16-row groups of signed formats start their sums
    /// and the 8-row groups of Q4_0 theirs (`q32_x86::activation_bias`); empty otherwise.
    pub q8_bias: Vec<i32>,
    /// With AVX-512: `q8` again, in groups of four blocks as the 512-bit one-token dots read
    /// them (n, cols / 128).
    pub quads: Vec<ActQuad>,
    /// The rows quantized per 256, which the super-block formats read (n, cols / 256), see
    /// `DType::reads_q8k`; empty where cols is not a multiple of 256.
    pub q8k: Vec<BlockQ8K>,
}

/// Batches of at least this many tokens at `level` are multiplied through unpacked weights (row
/// groups, `quant::q256_x86` and `quant::q32_x86`): decoding a row once for them all beats the
/// one-token kernels from 2 tokens at AVX2 and AVX-VNNI, whose one-token dots decode each block
/// again per pass of up to four tokens (SmolLM2 Q4_1, 4 sessions' batched decode: 155 -> 287
/// tok/s; a Qwen3-30B-A3B-shape Q4_0 prompt, ~8 tokens per expert: +12%), and from 5 at AVX-512,
/// whose one-token kernels read four rows at once (6 sessions 300 -> 368 tok/s; 4, 300 -> 272).
pub fn group_min_tokens(level: SimdLevel) -> usize {
    match level {
        SimdLevel::Avx512 => 5,
        _ => 2,
    }
}

impl Activations {
    /// Loads `x` (n, cols) and quantizes it; `cols` must be a multiple of 32 when quantized
    /// weights will read it (the model loader guarantees that).
    pub fn set(&mut self, x: &[f32], n: usize, cols: usize) {
        self.set_rounded(x, n, cols, true, true, true);
    }

    /// `set` for the products with `readers` alone: it keeps a float copy and rounds the
    /// activations per 32 and per 256 only if one of them reads that form (an all-k-quant layer
    /// needs neither the floats nor per-32 blocks; a prompt's float copy is megabytes).
    pub fn set_for(&mut self, x: &[f32], n: usize, cols: usize, readers: &[QMatrix]) {
        let floats = readers.iter().any(|m| !m.dtype.is_quantized());
        let per_256 = readers.iter().any(|m| m.dtype.reads_q8k());
        let per_32 = readers.iter().any(|m| m.dtype.is_quantized() && !m.dtype.reads_q8k());
        self.set_rounded(x, n, cols, floats, per_32, per_256);
    }

    fn set_rounded(
        &mut self,
        x: &[f32],
        n: usize,
        cols: usize,
        floats: bool,
        per_32: bool,
        per_256: bool,
    ) {
        assert_eq!(x.len(), n * cols);
        self.n = n;
        self.cols = cols;
        self.f32s.clear();
        if floats {
            self.f32s.extend_from_slice(x);
        }
        if cols.is_multiple_of(QK) {
            let nb = cols / QK;
            let level = simd_level();
            self.q8.clear();
            if per_32 {
                self.q8.resize(n * nb, BlockQ8Act::default());
                self.q8.par_chunks_mut(nb * 16).zip(x.par_chunks(cols * 16)).for_each(|(q, xs)| {
                    match level {
                        #[cfg(target_arch = "x86_64")]
                        // SAFETY: Avx2 and above are only reported when the CPU has avx2, fma and f16c.
                        SimdLevel::Avx2 | SimdLevel::Avx512 => unsafe {
                            crate::avx2::quantize_act(xs, q)
                        },
                        _ => quant::quantize_act(xs, q),
                    }
                });
            }
            self.q8_bias.clear();
            #[cfg(target_arch = "x86_64")]
            if level.has_avx2() && n >= group_min_tokens(level) && per_32 {
                self.q8_bias.resize(n * nb, 0);
                // SAFETY: Avx2 and above are only reported when the CPU has avx2, fma and f16c.
                self.q8_bias
                    .par_chunks_mut(nb * 16)
                    .zip(self.q8.par_chunks(nb * 16))
                    .for_each(|(b, q)| unsafe { q32_x86::activation_bias(q, b) });
            }
            self.q8k.clear();
            // (at every level: the tests read AVX-512 machines' activations at the lower levels
            // too, and a pass over the row is small beside any product that reads it)
            if cols.is_multiple_of(QK_K) && per_256 {
                let nk = cols / QK_K;
                self.q8k.resize(n * nk, BlockQ8K::default());
                self.q8k.par_chunks_mut(nk * 16).zip(x.par_chunks(cols * 16)).for_each(
                    |(q, xs)| match level {
                        #[cfg(target_arch = "x86_64")]
                        // SAFETY: Avx2 is only reported when the CPU has avx2, fma and f16c.
                        SimdLevel::Avx2 | SimdLevel::Avx512 => unsafe {
                            q256::quantize_act_k_avx2(xs, q)
                        },
                        _ => q256::quantize_act_k(xs, q),
                    },
                );
            }
            self.quads.clear();
            // (a prompt's row groups read `q8`; the quads serve its masked products' one-token
            // kernels)
            if level == SimdLevel::Avx512 && per_32 {
                let nq = quant::act_quads(nb);
                self.quads.resize(n * nq, ActQuad::default());
                self.quads.par_chunks_mut(nq * 16).zip(self.q8.par_chunks(nb * 16)).for_each(
                    |(p, q)| {
                        for (p, q) in p.chunks_mut(nq).zip(q.chunks(nb)) {
                            quant::arrange_act_quads(q, p);
                        }
                    },
                );
            }
        } else {
            self.q8.clear();
            self.q8_bias.clear();
            self.q8k.clear();
            self.quads.clear();
        }
    }

    /// Loads rows `rows` of `src`, as `set_for` would load those rows' values: every form
    /// `src` holds (each is row by row, so a row's blocks do not depend on the other rows).
    pub fn gather_rows(&mut self, src: &Activations, rows: impl Iterator<Item = usize> + Clone) {
        let n = rows.clone().count();
        self.n = n;
        self.cols = src.cols;
        fn gather<T: Copy>(
            out: &mut Vec<T>,
            src: &[T],
            n_src: usize,
            rows: impl Iterator<Item = usize>,
        ) {
            out.clear();
            if n_src == 0 || src.is_empty() {
                return;
            }
            let per_row = src.len() / n_src;
            rows.for_each(|r| out.extend_from_slice(&src[r * per_row..(r + 1) * per_row]));
        }
        gather(&mut self.f32s, &src.f32s, src.n, rows.clone());
        gather(&mut self.q8, &src.q8, src.n, rows.clone());
        gather(&mut self.quads, &src.quads, src.n, rows.clone());
        gather(&mut self.q8k, &src.q8k, src.n, rows.clone());
        // (the row groups' sums start from it only for `group_min_tokens` rows and more)
        match n >= group_min_tokens(simd_level()) {
            true => gather(&mut self.q8_bias, &src.q8_bias, src.n, rows),
            false => self.q8_bias.clear(),
        }
    }

    /// Token t's row in every form these activations hold (empty where they hold none).
    pub(crate) fn token(&self, t: usize) -> TokenActs<'_> {
        fn row<T>(v: &[T], n: usize, t: usize) -> &[T] {
            match n {
                0 => &[],
                _ => v.get(t * (v.len() / n)..(t + 1) * (v.len() / n)).unwrap_or(&[]),
            }
        }
        TokenActs {
            f32s: row(&self.f32s, self.n, t),
            q8: row(&self.q8, self.n, t),
            quads: row(&self.quads, self.n, t),
            q8k: row(&self.q8k, self.n, t),
        }
    }
}

/// Row `r` of `w` against N activation rows at the given SIMD level. `next` is the row the
/// caller reads after this one: the AVX-512 and float kernels prefetch it, a line at a time
/// spread over this row's work. The hardware prefetchers stop at 4 KiB boundaries and cannot
/// guess the scattered rows a sparse operator reads, so without this a core waits on memory;
/// a line at a time keeps the memory bus busy at an even rate, where prefetching a whole row
/// at once fills the core's few outstanding-miss slots and stalls it. Measured on the 7B-shape
/// FFN block (`cargo bench --bench sparse_ffn`, one thread), the dense products read
/// 7.1 -> 11.6 GB/s (Q4_0), 8.9 -> 12.9 (Q8_0), 7.8 -> 9.7 (F16) of a 12.4 GB/s plain read.
/// Prefetching never changes a value.
#[inline]
pub(crate) fn dot_row<const N: usize>(
    w: &QMatrix,
    r: usize,
    next: Option<usize>,
    x: &Activations,
    t: [usize; N],
    level: SimdLevel,
) -> [f32; N] {
    let next: Option<&[u8]> = next.map(|n| w.row(n));
    let [v] = dot_row_group::<1, N>(w, [r], next.as_slice(), x, t, level);
    v
}

/// Rows `rows` of `w` (any R of them: consecutive in a dense product, scattered in a sparse
/// one) against N activation rows: `dot_row` for each, in one kernel call (the rows share the
/// activations' loads, and their sums one horizontal step). `next`: the bytes the caller reads
/// after these rows, in turn (prefetched, see `dot_row`).
#[inline]
pub(crate) fn dot_row_group<const R: usize, const N: usize>(
    w: &QMatrix,
    rows: [usize; R],
    next: &[&[u8]],
    x: &Activations,
    t: [usize; N],
    level: SimdLevel,
) -> [[f32; N]; R] {
    dot_with(kernels::dot::<R, N>(w.dtype, level), w, rows, next, t.map(|ti| x.token(ti)))
}

/// `dot_row_group` through `kernel`, looked up by the caller once for many calls.
#[inline(always)]
pub(crate) fn dot_with<const R: usize, const N: usize>(
    kernel: kernels::DotFn<R, N>,
    w: &QMatrix,
    rows: [usize; R],
    next: &[&[u8]],
    x: [TokenActs; N],
) -> [[f32; N]; R] {
    let rows: [&[u8]; R] = rows.map(|r| w.row(r));
    // SAFETY: `kernel` is the table's for a level `simd_level` reported (levels above Scalar
    // only where the CPU has their features), and `x` holds every activation form the level's
    // kernels read (`Activations::set_for`).
    unsafe { kernel(rows, x, next) }
}

/// Weight rows r0..r1 against N activation rows: `put(r, values)` receives each row's N dot
/// products. One token (decode) goes the type's `decode_rows` at this level per kernel call
/// (`dtype::TYPES`).
pub(crate) fn dot_rows<const N: usize>(
    w: &QMatrix,
    rows: std::ops::Range<usize>,
    x: &Activations,
    t: [usize; N],
    level: SimdLevel,
    mut put: impl FnMut(usize, [f32; N]),
) {
    // the rows a run at a time into `values`, then to `put`
    const RUN: usize = 64;
    let run = kernels::run::<N>(w.dtype, level);
    let four = N == 1 && w.dtype.traits().decode_rows[level as usize] == 4;
    let x = t.map(|ti| x.token(ti));
    let mut values = [[0.0f32; N]; RUN];
    for r0 in rows.clone().step_by(RUN) {
        let r1 = (r0 + RUN).min(rows.end);
        // SAFETY: `run` is the table's for a level `simd_level` reported (levels above Scalar
        // only where the CPU has their features), and `x` holds every activation form the
        // level's kernels read (`Activations::set_for`).
        unsafe { run(w.as_rows(), r0..r1, rows.end, four, x, &mut values[..r1 - r0]) };
        for (r, v) in (r0..r1).zip(values) {
            put(r, v);
        }
    }
}

/// Raw output pointer shared by parallel tasks that write disjoint elements of one buffer
/// (`matmul_many`: (token, row) cells; `sparse::down_t_matmul`: column ranges).
#[derive(Clone, Copy)]
pub(crate) struct OutPtr(pub(crate) *mut f32);
// SAFETY: every user's tasks write disjoint elements; each says how at its use.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// The pointer `offset` elements in (a method, so closures capture the whole Send wrapper).
    pub(crate) fn at(self, offset: usize) -> *mut f32 {
        self.0.wrapping_add(offset)
    }
}

/// Several products that share one input, in one parallel pass (e.g. q, k and v):
/// `outs[i]` (n, mats[i].rows) = x (n, cols) @ mats[i]^T. One pass means one fork/join for all.
pub fn matmul_many(mats: &[QMatrix], x: &Activations, outs: &mut [&mut [f32]]) {
    assert!(mats.len() <= MAX_MATS, "matmul_many takes at most {MAX_MATS} matrices");
    matmul_each(mats, &[x; MAX_MATS][..mats.len()], outs);
}

/// Products each of its own input, in one parallel pass (e.g. the experts a batch of tokens
/// chose, each over the rows routed to it): `outs[i]` (xs[i].n, mats[i].rows) = xs[i] @
/// mats[i]^T. Each value is the one `matmul` computes for that matrix and input alone.
pub fn matmul_each(mats: &[QMatrix], xs: &[&Activations], outs: &mut [&mut [f32]]) {
    products_each(mats, xs, outs)
}

/// A matrix the CPU's products read: in its file's layout, or a Q4_0, Q4_K or MXFP4
/// matrix interleaved (`quant::interleaved`; a mixture of experts' experts of those types at AVX2 and
/// up, where `Model::load` copies the weights into memory). The same values either way, bit for
/// bit.
#[derive(Clone, Copy)]
pub enum Weight<'a> {
    File(QMatrix<'a>),
    Interleaved(Interleaved<'a>),
}

/// `matmul_each` of matrices in either layout.
pub fn weights_each(mats: &[Weight], xs: &[&Activations], outs: &mut [&mut [f32]]) {
    products_each(mats, xs, outs)
}

/// What a parallel pass of products asks of a matrix (`products_each`).
trait Product: Sync {
    fn shape(&self) -> (usize, usize);
    fn dtype(&self) -> DType;
    fn bytes(&self) -> usize;
    /// Rows a task's range starts at a multiple of.
    fn row_step(&self) -> usize;
    /// Dots of rows `rows` with every token of `x`, as `rows_for_all_tokens`.
    fn rows_for_all_tokens(
        &self,
        rows: std::ops::Range<usize>,
        x: &Activations,
        level: SimdLevel,
        put: impl Fn(usize, usize, &[f32]),
    );
}

impl Product for QMatrix<'_> {
    fn shape(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }
    fn dtype(&self) -> DType {
        self.dtype
    }
    fn bytes(&self) -> usize {
        self.data.len()
    }
    fn row_step(&self) -> usize {
        4
    }
    fn rows_for_all_tokens(
        &self,
        rows: std::ops::Range<usize>,
        x: &Activations,
        level: SimdLevel,
        put: impl Fn(usize, usize, &[f32]),
    ) {
        rows_for_all_tokens(self, rows, x, level, put)
    }
}

impl Product for Weight<'_> {
    fn shape(&self) -> (usize, usize) {
        match self {
            Weight::File(m) => m.shape(),
            Weight::Interleaved(m) => (m.rows, m.cols),
        }
    }
    fn dtype(&self) -> DType {
        match self {
            Weight::File(m) => m.dtype,
            Weight::Interleaved(m) => m.dtype,
        }
    }
    fn bytes(&self) -> usize {
        match self {
            Weight::File(m) => m.bytes(),
            Weight::Interleaved(m) => m.data.len(),
        }
    }
    fn row_step(&self) -> usize {
        match self {
            Weight::File(m) => m.row_step(),
            Weight::Interleaved(_) => quant::interleaved::GROUP_ROWS,
        }
    }
    fn rows_for_all_tokens(
        &self,
        rows: std::ops::Range<usize>,
        x: &Activations,
        level: SimdLevel,
        put: impl Fn(usize, usize, &[f32]),
    ) {
        match self {
            Weight::File(m) => m.rows_for_all_tokens(rows, x, level, put),
            #[cfg(target_arch = "x86_64")]
            Weight::Interleaved(m) if level == SimdLevel::Avx512 => {
                use quant::interleaved_x86::{rows_all_tokens, rows_all_tokens_k4};
                // SAFETY: Avx512 is only reported when the CPU has AVX-512 F/BW/VL/VNNI, avx2,
                // fma and f16c; `quads` (Q4_0, MXFP4) or `q8k` (Q4_K) holds the n tokens
                // (asserted by `products_each`)
                unsafe {
                    match m.dtype {
                        DType::Q4_0 | DType::MXFP4 => rows_all_tokens(m, rows, &x.quads, x.n, put),
                        _ => rows_all_tokens_k4(m, rows, &x.q8k, x.n, put),
                    }
                }
            }
            #[cfg(target_arch = "x86_64")]
            Weight::Interleaved(m) if level == SimdLevel::Avx2 => {
                use quant::interleaved_x86::{
                    rows_all_tokens_256, MxDots256, Q4KDots256, Q4_0Dots256,
                };
                // SAFETY: Avx2 is only reported when the CPU has avx2, fma and f16c, `vnni256`
                // in an encoding it has; `q8` (Q4_0) or `q8k` (Q4_K) holds the n tokens
                // (asserted by `products_each`)
                let vnni = crate::simd::vnni256(level);
                unsafe {
                    match m.dtype {
                        DType::Q4_0 => {
                            let acts = (&x.q8[..], &x.q8_bias[..]);
                            rows_all_tokens_256::<Q4_0Dots256>(vnni, m, rows, acts, x.n, put)
                        }
                        DType::MXFP4 => {
                            let acts = (&x.q8[..], &x.q8_bias[..]);
                            rows_all_tokens_256::<MxDots256>(vnni, m, rows, acts, x.n, put)
                        }
                        _ => rows_all_tokens_256::<Q4KDots256>(vnni, m, rows, &x.q8k, x.n, put),
                    }
                }
            }
            // (`Model::load` interleaves where the SIMD kernels run; the twins serve the rest)
            Weight::Interleaved(m) => {
                use quant::interleaved::{
                    dot_group_k4_scalar, dot_group_mx_scalar, dot_group_scalar, FloatSteps,
                };
                let group_rows = quant::interleaved::GROUP_ROWS;
                for g in rows.start / group_rows..rows.end / group_rows {
                    for t in 0..x.n {
                        let v = match m.dtype {
                            DType::Q4_0 => {
                                let nb = m.cols / QK;
                                let q8 = &x.q8[t * nb..(t + 1) * nb];
                                dot_group_scalar(m.group(g), q8, FloatSteps::FmaPerBlock)
                            }
                            DType::MXFP4 => {
                                let nb = m.cols / QK;
                                let q8 = &x.q8[t * nb..(t + 1) * nb];
                                dot_group_mx_scalar(m.group(g), q8, FloatSteps::FmaPerBlock)
                            }
                            _ => {
                                let nb = m.cols / QK_K;
                                dot_group_k4_scalar(m.group(g), &x.q8k[t * nb..(t + 1) * nb])
                            }
                        };
                        put(t, group_rows * g, &v);
                    }
                }
            }
        }
    }
}

/// `matmul_each` over any `Product`.
fn products_each<M: Product>(mats: &[M], xs: &[&Activations], outs: &mut [&mut [f32]]) {
    assert_eq!(mats.len(), outs.len());
    assert_eq!(mats.len(), xs.len());
    for ((m, o), x) in mats.iter().zip(outs.iter()).zip(xs) {
        let (rows, cols) = m.shape();
        assert_eq!(cols, x.cols, "matmul: weight has {cols} columns, input has {}", x.cols);
        assert_eq!(o.len(), x.n * rows, "matmul: output buffer has the wrong size");
        if m.dtype().is_quantized() && !m.dtype().reads_q8k() {
            assert_eq!(x.q8.len(), x.n * x.cols / QK);
        }
        if m.dtype().reads_q8k() {
            assert_eq!(x.q8k.len(), x.n * x.cols / QK_K);
        }
        // (Q4_0's and MXFP4's interleaved layouts, whose AVX-512 kernels read the quads)
        let reads_quads = matches!(m.dtype(), DType::Q4_0 | DType::MXFP4);
        if reads_quads && m.row_step() > 4 && simd_level() == SimdLevel::Avx512 {
            assert_eq!(x.quads.len(), x.n * quant::act_quads(x.cols / QK));
        }
    }
    let n = xs.iter().map(|x| x.n).max().unwrap_or(0);
    let threads = rayon::current_num_threads().max(1);
    let total_rows: usize = mats.iter().map(|m| m.shape().0).sum();
    // Enough chunks for load balance, few enough that per-task overhead stays small. A prompt's
    // tasks go in row groups, each prefetching the next group's rows while it works; a task's
    // first group waits on memory, so fewer, longer tasks: 8 per thread (SmolLM2 Q4_1 128-token
    // prompt 95 -> 88 ms; with 4, 85 ms, but threshold-mode prompts, whose tasks cost unevenly,
    // 240 -> 264 ms).
    // Row-group prompts take 8 per thread, short batches 16. A decode token takes 8 per thread
    // of a large product, and one task per `DECODE_TASK_BYTES` of a smaller one (one per thread
    // at least).
    let target_chunks = if n == 1 {
        let bytes: usize = mats.iter().map(|m| m.bytes()).sum();
        (bytes / DECODE_TASK_BYTES).clamp(threads, threads * 8)
    } else {
        threads * if n >= group_min_tokens(simd_level()) { 8 } else { 16 }
    };
    let step = mats.iter().map(|m| m.row_step()).max().unwrap_or(4);
    let chunk = (total_rows.div_ceil(target_chunks)).clamp(4, 4096).next_multiple_of(step);
    // Task k covers rows of one matrix; first_task[i] is matrix i's first task. Fixed-size
    // arrays up to MAX_MATS matrices, so that a decode step's projections allocate nothing.
    let (mut first_task_fixed, mut ptrs_fixed) =
        ([0usize; MAX_MATS + 1], [OutPtr(std::ptr::null_mut()); MAX_MATS]);
    let (mut first_task_grown, mut ptrs_grown) = (Vec::new(), Vec::new());
    let (first_task, ptrs): (&mut [usize], &mut [OutPtr]) = if mats.len() <= MAX_MATS {
        (&mut first_task_fixed[..mats.len() + 1], &mut ptrs_fixed[..mats.len()])
    } else {
        first_task_grown.resize(mats.len() + 1, 0);
        ptrs_grown.resize(mats.len(), OutPtr(std::ptr::null_mut()));
        (&mut first_task_grown[..], &mut ptrs_grown[..])
    };
    for (i, (m, o)) in mats.iter().zip(outs.iter_mut()).enumerate() {
        first_task[i + 1] = first_task[i] + m.shape().0.div_ceil(chunk);
        ptrs[i] = OutPtr(o.as_mut_ptr());
    }
    let (first_task, ptrs) = (&*first_task, &*ptrs);
    let level = simd_level();
    (0..first_task[mats.len()]).into_par_iter().for_each(|task| {
        // the last matrix whose first task is at or before this one (a matrix of no rows has
        // no tasks)
        let i = first_task.partition_point(|&f| f <= task) - 1;
        let (w, x, out) = (&mats[i], xs[i], ptrs[i]);
        let rows = w.shape().0;
        let r0 = (task - first_task[i]) * chunk;
        let r1 = (r0 + chunk).min(rows);
        // SAFETY: this task alone writes rows r0..r1 of matrix i, for every token; the
        // buffer length n * rows was asserted above.
        w.rows_for_all_tokens(r0..r1, x, level, |t, r, v| unsafe {
            copy_values(v, out.at(t * rows + r))
        });
    });
}

/// out[r - rows.start] = w_r . x for the rows `rows` of `w` and one token, on this thread (a
/// task's own product inside a parallel pass, `sparse::predicted_ffn`). The values `matmul`
/// computes.
pub(crate) fn matmul_serial(
    w: &QMatrix,
    rows: std::ops::Range<usize>,
    x: &Activations,
    out: &mut [f32],
) {
    assert_eq!(x.n, 1, "matmul_serial takes one token");
    assert_eq!(w.cols, x.cols, "matmul: weight has {} columns, input has {}", w.cols, x.cols);
    assert!(rows.end <= w.rows && out.len() == rows.len());
    let r0 = rows.start;
    let out = OutPtr(out.as_mut_ptr());
    // SAFETY: put writes rows r0..rows.end at r - r0, inside `out`, asserted above
    rows_for_all_tokens(w, rows, x, simd_level(), |_, r, v| unsafe {
        copy_values(v, out.at(r - r0))
    });
}

/// Copies `v` to `dst`: a whole row group's values (16 or 8) as one fixed-size move, which
/// compiles to vector stores rather than a `memcpy` call.
///
/// # Safety
/// `dst` must be valid for `v.len()` writes.
#[inline(always)]
unsafe fn copy_values(v: &[f32], dst: *mut f32) {
    match v.len() {
        16 => (dst as *mut [f32; 16]).write_unaligned(*(v.as_ptr() as *const [f32; 16])),
        8 => (dst as *mut [f32; 8]).write_unaligned(*(v.as_ptr() as *const [f32; 8])),
        len => std::ptr::copy_nonoverlapping(v.as_ptr(), dst, len),
    }
}

/// Fewest weight bytes per task of a one-token product. A task costs more than its rows: its
/// split and steal, and the misses on its first rows before its prefetching runs ahead. So a
/// small model's products run one task per thread: SmolLM2's are 41 KB to 0.5 MB at Q4_0, and
/// were cut into 8 tasks per thread, then (a0e0ea3) into tasks of 32 KB, 2 to 15 of them. 2-core
/// AMD EPYC, alternating in one process: SmolLM2-135M Q4_1 decode 231 -> 258 tok/s on 2 threads,
/// 160 -> 177 on one; `sparse_e2e.py synthetic --shape smollm2` standard dense 1.12-1.17x,
/// predictor mode 1.10-1.14x; a 1536 x 576 Q4_0 product from DRAM, 2 threads, 26 -> 21 us.
/// The 7B shape's products (9 MB and more) keep their 16 tasks (the same within noise).
const DECODE_TASK_BYTES: usize = 256 << 10;

/// Most matrices one `matmul_many` call takes (q, k, v and a few more).
const MAX_MATS: usize = 8;

/// How a prompt's row groups are dotted at `level` (x86_64 only).
#[cfg(target_arch = "x86_64")]
fn group_width(level: SimdLevel) -> GroupWidth {
    match level {
        SimdLevel::Avx512 => GroupWidth::Avx512,
        _ => match crate::simd::vnni256(level) {
            Some(e) => GroupWidth::AvxVnni(e),
            None => GroupWidth::Avx2,
        },
    }
}

/// Dots of the weight rows `rows` with every token of `x`: put(token, first row, values of
/// consecutive rows from it; a row group's at once, so that the stores to an output line not
/// yet in cache are one, not one per value). Four tokens per pass over the rows, so each
/// weight block is unpacked once for four tokens.
fn rows_for_all_tokens(
    w: &QMatrix,
    rows: std::ops::Range<usize>,
    x: &Activations,
    level: SimdLevel,
    put: impl Fn(usize, usize, &[f32]),
) {
    let n = x.n;
    #[cfg(target_arch = "x86_64")]
    if level.has_avx2() && w.dtype.reads_q8k() && n >= group_min_tokens(level) {
        // SAFETY: Avx2 and above are only reported when the CPU has avx2, fma and f16c, Avx512
        // when it has AVX-512 F/BW/VL/VNNI too, `vnni256` in an encoding it has; `q8k` holds n
        // tokens (cols is a multiple of 256 for these types).
        unsafe {
            quant::q256_x86::rows_all_tokens(
                w.dtype,
                group_width(level),
                |r| w.row(r),
                w.cols,
                rows,
                &x.q8k,
                n,
                put,
            )
        };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if level.has_avx2() && q32_x86::groups_rows(w.dtype) && n >= group_min_tokens(level) {
        // SAFETY: as above; `q8` holds n tokens.
        unsafe {
            q32_x86::legacy_rows_all_tokens(
                w.dtype,
                group_width(level),
                |r| w.row(r),
                w.cols,
                rows,
                &x.q8,
                &x.q8_bias,
                n,
                put,
            )
        };
        return;
    }
    let mut t = 0;
    while t + 4 <= n {
        dot_rows(w, rows.clone(), x, [t, t + 1, t + 2, t + 3], level, |r, v| {
            for (k, vk) in v.into_iter().enumerate() {
                put(t + k, r, &[vk]);
            }
        });
        t += 4;
    }
    // two at a time for what is left (a batch of 2 or 3 clients in batched decode reads the
    // weights once per pair); per token the arithmetic is the same as alone
    while t + 2 <= n {
        dot_rows(w, rows.clone(), x, [t, t + 1], level, |r, v| {
            put(t, r, &[v[0]]);
            put(t + 1, r, &[v[1]]);
        });
        t += 2;
    }
    while t < n {
        dot_rows(w, rows.clone(), x, [t], level, |r, v| put(t, r, &[v[0]]));
        t += 1;
    }
}

/// Products over a subset of rows, shared by all matrices (sparse prefill: the union of the
/// neurons a batch of tokens selected): `outs[i]` (n, sel.len()) with outs[i][t][k] =
/// x[t] . mats[i][sel[k]]. `sel` is sorted. With `keep` (n, rows), only the cells whose token
/// selected the row are computed (four such tokens per pass over the row), the others are left
/// as they were; without it, runs of consecutive rows are read as one stream for all tokens.
/// Each value equals the one `matmul_many` computes for that row and token.
pub fn matmul_selected(
    mats: &[QMatrix],
    sel: &[u32],
    keep: Option<&[bool]>,
    x: &Activations,
    outs: &mut [&mut [f32]],
) {
    assert_eq!(mats.len(), outs.len());
    let (n, m) = (x.n, sel.len());
    for (w, o) in mats.iter().zip(outs.iter()) {
        assert_eq!(w.cols, x.cols, "matmul: weight has {} columns, input has {}", w.cols, x.cols);
        assert_eq!(o.len(), n * m, "matmul: output buffer has the wrong size");
        assert!(
            sel.last().is_none_or(|&j| (j as usize) < w.rows),
            "matmul: selected row out of range"
        );
        assert!(keep.is_none_or(|k| k.len() == n * w.rows), "matmul: mask has the wrong size");
    }
    debug_assert!(sel.windows(2).all(|p| p[0] < p[1]), "selection must be sorted and distinct");
    let threads = rayon::current_num_threads().max(1);
    let chunk = m.div_ceil(threads * 16).max(4);
    let ptrs: Vec<OutPtr> = outs.iter_mut().map(|o| OutPtr(o.as_mut_ptr())).collect();
    let level = simd_level();
    let tasks: Vec<(usize, usize)> =
        (0..mats.len()).flat_map(|i| (0..m.div_ceil(chunk)).map(move |c| (i, c * chunk))).collect();
    // the mask over the selected rows transposed, (m, n): a row's tokens side by side (read by
    // row, the (n, rows) mask costs a cache line per token and row)
    let mut kept_by_row = Vec::new();
    if let Some(keep) = keep {
        let rows = mats.first().map_or(0, |w| w.rows);
        kept_by_row.resize(m * n, false);
        kept_by_row.par_chunks_mut(64 * n).enumerate().for_each(|(b, block)| {
            for t in 0..n {
                for (k, &j) in sel[64 * b..(64 * b + 64).min(m)].iter().enumerate() {
                    block[k * n + t] = keep[t * rows + j as usize];
                }
            }
        });
    }
    let kept_by_row = &kept_by_row;
    tasks.par_iter().for_each_init(
        || (Vec::new(), Vec::new(), Vec::new()),
        |(tokens, hot, cold), &(i, k0)| {
            let (w, out) = (&mats[i], ptrs[i]);
            let part = &sel[k0..(k0 + chunk).min(m)];
            // SAFETY (both branches): this task alone writes columns k0..k0 + part.len() of matrix
            // i's output, for every token; the buffer length n * m was asserted above.
            let put = |t: usize, k: usize, v: f32| unsafe { *out.at(t * m + k) = v };
            if keep.is_some() {
                // rows an eighth or more of the tokens selected go through the row groups for
                // every token, only the kept cells written (cheaper than per cell from there; the
                // values are the same, bit for bit): with a power law of firing rates the few hot
                // rows hold most of the cells (`benches/sparse_e2e.py synthetic --layers 2`,
                // predictor 64-token prompt: gate and up 29 -> 25 ms)
                hot.clear();
                cold.clear();
                #[cfg(target_arch = "x86_64")]
                let grouped = level.has_avx2()
                    && (q32_x86::groups_rows(w.dtype) || w.dtype.reads_q8k())
                    && n >= group_min_tokens(level);
                #[cfg(not(target_arch = "x86_64"))]
                let grouped = false;
                let kept_of = |k: usize| &kept_by_row[(k0 + k) * n..(k0 + k + 1) * n];
                for k in 0..part.len() {
                    let kept = kept_of(k).iter().filter(|&&x| x).count();
                    if grouped && 8 * kept >= n {
                        hot.push(k);
                    } else if kept > 0 {
                        cold.push(k);
                    }
                }
                #[cfg(target_arch = "x86_64")]
                if !hot.is_empty() {
                    let row = |r: usize| w.row(part[hot[r]] as usize);
                    let put_kept = |t: usize, r: usize, v: &[f32]| {
                        for (i, &vi) in v.iter().enumerate() {
                            let k = hot[r + i];
                            if kept_of(k)[t] {
                                put(t, k0 + k, vi);
                            }
                        }
                    };
                    // SAFETY: as in `rows_for_all_tokens`.
                    unsafe {
                        if w.dtype.reads_q8k() {
                            quant::q256_x86::rows_all_tokens(
                                w.dtype,
                                group_width(level),
                                row,
                                w.cols,
                                0..hot.len(),
                                &x.q8k,
                                n,
                                put_kept,
                            );
                        } else {
                            q32_x86::legacy_rows_all_tokens(
                                w.dtype,
                                group_width(level),
                                row,
                                w.cols,
                                0..hot.len(),
                                &x.q8,
                                &x.q8_bias,
                                n,
                                put_kept,
                            );
                        }
                    }
                }
                for (c, &k) in cold.iter().enumerate() {
                    let j = part[k] as usize;
                    indices_of_true(kept_of(k), tokens);
                    let next = cold.get(c + 1).map(|&k| part[k] as usize);
                    // (`dot_row` brings in the next row as it goes; the one after on its way now,
                    // since a cold row's few tokens take less time than memory does)
                    if let Some(&k) = cold.get(c + 2) {
                        prefetch(w.row(part[k] as usize));
                    }
                    let mut g = tokens.chunks_exact(4);
                    for q in &mut g {
                        let q = [q[0], q[1], q[2], q[3]].map(|t| t as usize);
                        let v = dot_row(w, j, next, x, q, level);
                        q.iter().zip(v).for_each(|(&t, vt)| put(t, k0 + k, vt));
                    }
                    // the last one to three tokens in one pass over the row too
                    match *g.remainder() {
                        [a] => {
                            let a = a as usize;
                            put(a, k0 + k, dot_row(w, j, next, x, [a], level)[0])
                        }
                        [a, b] => {
                            let ts = [a, b].map(|t| t as usize);
                            let v = dot_row(w, j, next, x, ts, level);
                            v.into_iter().zip(ts).for_each(|(v, t)| put(t, k0 + k, v))
                        }
                        [a, b, c] => {
                            let ts = [a, b, c].map(|t| t as usize);
                            let v = dot_row(w, j, next, x, ts, level);
                            v.into_iter().zip(ts).for_each(|(v, t)| put(t, k0 + k, v))
                        }
                        _ => {}
                    }
                }
                return;
            }
            for (k, rows) in runs(part) {
                let (base, start) = (k0 + k, rows.start);
                rows_for_all_tokens(w, rows, x, level, |t, r, v| {
                    v.iter().enumerate().for_each(|(i, &vi)| put(t, base + r + i - start, vi))
                });
            }
        },
    );
}

/// `out` = the indices of the true values of `keep`, in order. Eight flags are read as one
/// word and their bits gathered: a selection is random, so a branch per neuron mispredicts on
/// most selected ones (one-token decode of a SmolLM2-shape model, one thread, `perf`: the
/// filter one neuron at a time held 1.8% of the samples, this 0.7%).
pub(crate) fn indices_of_true(keep: &[bool], out: &mut Vec<u32>) {
    out.clear();
    out.resize(keep.len(), 0);
    let mut n = 0;
    let mut put = |base: usize, mut bits: u64| {
        while bits != 0 {
            out[n] = (base + bits.trailing_zeros() as usize) as u32;
            n += 1;
            bits &= bits - 1;
        }
    };
    let mut words = keep.chunks_exact(8);
    for (w, flags) in (&mut words).enumerate() {
        // flags are bytes 0 or 1: bit 8k of the word is flag k; the multiply gathers them
        // into the top byte, flag k at bit 56 + k
        let word = u64::from_le_bytes(std::array::from_fn(|k| flags[k] as u8));
        put(8 * w, word.wrapping_mul(0x0102_0408_1020_4080) >> 56);
    }
    let tail = words.remainder();
    put(keep.len() - tail.len(), tail.iter().enumerate().fold(0, |b, (k, &f)| b | (f as u64) << k));
    out.truncate(n);
}

/// The runs of consecutive rows in a sorted selection: (k, rows) where sel[k..k + rows.len()]
/// is rows.start..rows.end. A run is read as one stream the hardware prefetches.
pub(crate) fn runs(sel: &[u32]) -> impl Iterator<Item = (usize, std::ops::Range<usize>)> + '_ {
    let mut k = 0;
    std::iter::from_fn(move || {
        let start = *sel.get(k)? as usize;
        let mut e = k + 1;
        while e < sel.len() && sel[e] as usize == start + (e - k) {
            e += 1;
        }
        let run = (k, start..start + (e - k));
        k = e;
        Some(run)
    })
}

pub fn matmul(w: &QMatrix, x: &Activations, out: &mut [f32]) {
    matmul_many(std::slice::from_ref(w), x, &mut [out]);
}

#[cfg(test)]
mod tests {
    /// The gathered bits give the indices a plain filter gives, for any flags and lengths
    /// (whole words, tails, none true, all true).
    #[test]
    fn indices_of_true_equals_the_filter() {
        let mut rng = crate::sampler::Rng::new(3);
        let mut out = vec![7];
        for len in [0, 1, 7, 8, 9, 63, 64, 65, 1536, 11008] {
            for p in [0.0, 0.1, 0.5, 1.0] {
                let keep: Vec<bool> = (0..len).map(|_| rng.next_f32() < p).collect();
                indices_of_true(&keep, &mut out);
                let want: Vec<u32> = (0..len as u32).filter(|&j| keep[j as usize]).collect();
                assert_eq!(out, want, "len {len}, p {p}");
            }
        }
    }

    use super::*;
    use crate::quant::{dequantize_row, quantize_row};
    use crate::simd::detect;

    fn random_vec(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = crate::sampler::Rng::new(seed);
        (0..n).map(|_| rng.next_f32() * 2.0 - 1.0).collect()
    }

    const ALL: [DType; 6] =
        [DType::F32, DType::F16, DType::BF16, DType::Q4_0, DType::Q4_1, DType::Q8_0];

    /// Every SIMD dot (AVX2, and AVX-512 where the CPU has it) must agree with its scalar twin
    /// on random data (same quantized inputs, so only float summation order differs); odd block
    /// counts exercise the AVX-512 tail.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn simd_dots_match_scalar() {
        if !detect().has_avx2() {
            eprintln!("skipping: no AVX2 on this CPU");
            return;
        }
        for cols in [32, 64, 96, 576, 1536] {
            let x_f = random_vec(cols * 4, cols as u64);
            let mut x = Activations::default();
            x.set(&x_f, 4, cols);
            for dtype in ALL {
                let w_f = random_vec(cols * 4, 7 + cols as u64);
                let data: Vec<u8> = w_f.chunks(cols).flat_map(|r| quantize_row(dtype, r)).collect();
                let w = QMatrix { dtype, rows: 4, cols, data: &data };
                // AVX-512 where this CPU has it (the activations hold its quads then)
                let levels: &[SimdLevel] = if simd_level() == SimdLevel::Avx512 {
                    &[SimdLevel::Avx2, SimdLevel::Avx512]
                } else {
                    &[SimdLevel::Avx2]
                };
                for r in 0..4 {
                    let s4 = dot_row(&w, r, None, &x, [0, 1, 2, 3], SimdLevel::Scalar);
                    // the scalar twin (every level reads the same activations)
                    let want = |_level: SimdLevel, t: usize| s4[t];
                    let tol = 1e-4 * (cols as f32).sqrt();
                    for &level in levels {
                        let v1 = dot_row(&w, r, None, &x, [0], level);
                        let v2 = dot_row(&w, r, None, &x, [2, 3], level);
                        let v4 = dot_row(&w, r, None, &x, [0, 1, 2, 3], level);
                        assert!(
                            (want(level, 0) - v1[0]).abs() <= tol,
                            "{level:?} {dtype:?} cols {cols}: {} vs {}",
                            want(level, 0),
                            v1[0]
                        );
                        for k in 0..2 {
                            assert!(
                                (want(level, 2 + k) - v2[k]).abs() <= tol,
                                "{level:?} {dtype:?} x2 cols {cols} k {k}"
                            );
                        }
                        for k in 0..4 {
                            assert!(
                                (want(level, k) - v4[k]).abs() <= tol,
                                "{level:?} {dtype:?} x4 cols {cols} k {k}: {} vs {}",
                                want(level, k),
                                v4[k]
                            );
                            assert!(
                                (s4[k] - dot_row(&w, r, None, &x, [k], SimdLevel::Scalar)[0]).abs()
                                    <= 1e-5
                            );
                        }
                    }
                }
                // decode's row groups (three rows, and four, the kernels' own groups): each row
                // exactly as alone, at every level
                for &level in levels {
                    for t in 0..4 {
                        let three = dot_row_group::<3, 1>(&w, [0, 1, 2], &[], &x, [t], level);
                        let four = dot_row_group::<4, 1>(&w, [0, 1, 2, 3], &[], &x, [t], level);
                        let rows = (0..3).chain(0..4);
                        for (r, v) in rows.zip(three.iter().chain(&four)) {
                            let alone = dot_row(&w, r, None, &x, [t], level)[0];
                            assert_eq!(
                                v[0].to_bits(),
                                alone.to_bits(),
                                "{level:?} {dtype:?} cols {cols} row {r} of a group: {} vs {alone}",
                                v[0]
                            );
                        }
                    }
                }
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_activation_quantization_matches_scalar() {
        if !detect().has_avx2() {
            return;
        }
        let mut x = random_vec(32 * 50, 11);
        x[5] = 0.0;
        x[32..64].iter_mut().for_each(|v| *v = 0.0); // an all-zero block
        let mut a = vec![BlockQ8Act::default(); 50];
        let mut b = vec![BlockQ8Act::default(); 50];
        quant::quantize_act(&x, &mut a);
        unsafe { crate::avx2::quantize_act(&x, &mut b) };
        for (p, q) in a.iter().zip(&b) {
            assert_eq!(p.d, q.d);
            for (u, v) in p.qs.iter().zip(q.qs.iter()) {
                // Ties may round differently in the last bit of the product; never more than 1.
                assert!((*u as i32 - *v as i32).abs() <= 1);
            }
            let s: i32 = q.qs.iter().map(|&v| v as i32).sum();
            assert!((q.s - q.d * s as f32).abs() <= 1e-5 * q.d.max(1.0) * 32.0);
        }
    }

    /// matmul_each over matrices of every type and inputs of 0 to 12 rows (across the row
    /// groups' threshold), some gathered from rows of a bigger batch, equals matmul of each
    /// alone on inputs quantized from their own floats, bit for bit.
    #[test]
    fn products_of_their_own_inputs_equal_each_alone_bit_for_bit() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
        let cols = 256;
        let batch_f = random_vec(20 * cols, 40);
        let mut batch = Activations::default();
        batch.set(&batch_f, 20, cols);
        let row_sets: [&[usize]; 5] =
            [&[3], &[0, 5, 7], &[1, 2, 4, 6, 8, 9, 11, 13, 17], &[19, 0], &[]];
        for dtype in DType::ALL {
            let rows = 37;
            let data: Vec<u8> = match ALL.contains(&dtype) {
                true => random_vec(rows * cols, 41)
                    .chunks(cols)
                    .flat_map(|r| quantize_row(dtype, r))
                    .collect(),
                // (formats the engine reads but never writes: random valid blocks)
                false => (0..rows)
                    .flat_map(|r| {
                        crate::quant::chunks::tests::random_row(dtype, cols, 41 + r as u64)
                    })
                    .collect(),
            };
            let w = QMatrix { dtype, rows, cols, data: &data };
            let mut inputs: Vec<Activations> = Vec::new();
            let mut floats: Vec<Vec<f32>> = Vec::new();
            for set in row_sets {
                let mut a = Activations::default();
                a.gather_rows(&batch, set.iter().copied());
                inputs.push(a);
                floats.push(
                    set.iter().flat_map(|&r| batch_f[r * cols..(r + 1) * cols].to_vec()).collect(),
                );
            }
            for n in [1, 4, 8, 12] {
                let mut a = Activations::default();
                a.set(&random_vec(n * cols, 42 + n as u64), n, cols);
                floats.push(a.f32s.clone());
                inputs.push(a);
            }
            let mats = vec![w; inputs.len()];
            let xs: Vec<&Activations> = inputs.iter().collect();
            let mut outs: Vec<Vec<f32>> =
                inputs.iter().map(|a| vec![f32::NAN; a.n * rows]).collect();
            let mut out_refs: Vec<&mut [f32]> = outs.iter_mut().map(|o| &mut o[..]).collect();
            pool.install(|| matmul_each(&mats, &xs, &mut out_refs));
            for (i, x) in floats.iter().enumerate() {
                let n = x.len() / cols;
                let mut own = Activations::default();
                own.set(x, n, cols);
                let mut want = vec![0.0; n * rows];
                pool.install(|| matmul(&w, &own, &mut want));
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&outs[i]), bits(&want), "{dtype:?}, input {i} of {n} rows");
            }
        }
    }

    /// Parallel matmul (any n, any thread split) equals a float64 product of the dequantized
    /// weights with the activations, within the int8 activation rounding.
    #[test]
    fn matmul_matches_float64_reference() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
        for dtype in ALL {
            for n in [1, 3, 4, 9] {
                let (rows, cols) = (37, 96);
                let w_f = random_vec(rows * cols, 21);
                let data: Vec<u8> = w_f.chunks(cols).flat_map(|r| quantize_row(dtype, r)).collect();
                let w = QMatrix { dtype, rows, cols, data: &data };
                let x_f = random_vec(n * cols, 22 + n as u64);
                let mut x = Activations::default();
                x.set(&x_f, n, cols);
                let mut out = vec![0.0; n * rows];
                pool.install(|| matmul(&w, &x, &mut out));
                let mut wr = vec![0.0; cols];
                for r in 0..rows {
                    dequantize_row(dtype, w.row(r), &mut wr);
                    for t in 0..n {
                        let xr = &x_f[t * cols..(t + 1) * cols];
                        let exact: f64 =
                            wr.iter().zip(xr).map(|(a, b)| *a as f64 * *b as f64).sum();
                        let tol = if dtype.is_quantized() {
                            wr.iter().map(|v| v.abs() as f64).sum::<f64>() / 127.0 * 0.5 + 1e-4
                        } else {
                            1e-4
                        };
                        let got = out[t * rows + r] as f64;
                        assert!(
                            (got - exact).abs() <= tol,
                            "{dtype:?} n={n} r={r} t={t}: {got} vs {exact}"
                        );
                    }
                }
            }
        }
    }

    /// On AVX-512, a token's dots are bit for bit the same whether it goes alone (n = 1), in a
    /// small batch of one-token kernels or through a prompt's row groups: a session's results
    /// do not depend on how its tokens were batched (batched decode, prompt pieces) or cached.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn prompts_and_one_token_kernels_agree_bit_for_bit() {
        if simd_level() != SimdLevel::Avx512 {
            eprintln!("skipping: no AVX-512 VNNI on this CPU");
            return;
        }
        use crate::quant::tests::{random_quantized_row, QUANTIZED};
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
        for (s, dtype) in QUANTIZED.into_iter().enumerate() {
            for cols in [96, 256, 576, 1536] {
                if cols % dtype.block_len() != 0 {
                    continue;
                }
                let (rows, n) = (13, 11);
                let data: Vec<u8> = (0..rows)
                    .flat_map(|r| random_quantized_row(dtype, cols, (50 * s + r) as u64))
                    .collect();
                let w = QMatrix { dtype, rows, cols, data: &data };
                let x_f = random_vec(n * cols, 9 + s as u64);
                let product = |t0: usize, m: usize| {
                    let mut x = Activations::default();
                    x.set(&x_f[t0 * cols..(t0 + m) * cols], m, cols);
                    let mut out = vec![0.0f32; m * rows];
                    pool.install(|| matmul(&w, &x, &mut out));
                    out
                };
                // through row groups, and in batches of 7, 2 and 1 through the one-token kernels
                let prompt = product(0, n);
                let mut batch = product(0, 7);
                batch.extend(product(7, 2));
                batch.extend(product(9, 1));
                batch.extend(product(10, 1));
                for t in 0..n {
                    let alone = product(t, 1);
                    for r in 0..rows {
                        let p = prompt[t * rows + r];
                        assert_eq!(
                            p.to_bits(),
                            alone[r].to_bits(),
                            "{dtype:?} cols {cols} token {t} row {r}: prompt {p} vs alone {}",
                            alone[r]
                        );
                        assert_eq!(
                            batch[t * rows + r].to_bits(),
                            alone[r].to_bits(),
                            "{dtype:?} cols {cols} token {t} row {r}: batch"
                        );
                    }
                }
            }
        }
    }

    /// Below AVX-512 too, a token's dots are bit for bit the same in a prompt (row groups, or
    /// four tokens per call) as alone or two at a time.
    #[test]
    fn prompts_and_one_token_kernels_agree_below_avx512() {
        use crate::quant::tests::{random_quantized_row, QUANTIZED};
        let levels: &[SimdLevel] = if detect().has_avx2() {
            &[SimdLevel::Scalar, SimdLevel::Avx2]
        } else {
            &[SimdLevel::Scalar]
        };
        for &level in levels {
            for (s, dtype) in QUANTIZED.into_iter().enumerate() {
                let cols = if dtype.block_len() == QK_K { 512 } else { 96 };
                let (rows, n) = (6, 11);
                let data: Vec<u8> = (0..rows)
                    .flat_map(|r| random_quantized_row(dtype, cols, (70 * s + r) as u64))
                    .collect();
                let w = QMatrix { dtype, rows, cols, data: &data };
                let mut x = Activations::default();
                x.set(&random_vec(n * cols, 3 + s as u64), n, cols);
                let prompt = std::sync::Mutex::new(vec![f32::NAN; n * rows]);
                rows_for_all_tokens(&w, 0..rows, &x, level, |t, r, v| {
                    prompt.lock().unwrap()[t * rows + r..][..v.len()].copy_from_slice(v)
                });
                let prompt = prompt.into_inner().unwrap();
                for t in 0..n {
                    let pair = dot_row(&w, 1, None, &x, [t, (t + 1) % n], level)[0];
                    assert_eq!(
                        pair.to_bits(),
                        prompt[t * rows + 1].to_bits(),
                        "{level:?} {dtype:?} token {t}: pair"
                    );
                    for r in 0..rows {
                        let alone = dot_row(&w, r, None, &x, [t], level)[0];
                        assert_eq!(
                            prompt[t * rows + r].to_bits(),
                            alone.to_bits(),
                            "{level:?} {dtype:?} token {t} row {r}"
                        );
                    }
                }
            }
        }
    }

    /// A product over selected rows gives exactly the values the full product gives for those
    /// rows, for every type, batch size and selection shape (empty, runs, scattered, all), and
    /// with a mask exactly those cells and no others.
    /// A masked selection of k-quant and 32-weight chunked rows: the row groups (rows many
    /// tokens kept) and the one-token kernels (the others) give every kept cell the full
    /// product's value, bit for bit, and leave the rest alone.
    #[test]
    fn masked_selection_of_block_formats_equals_full_product() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
        let (rows, cols, n) = (70, 512, 40);
        let mut rng = crate::sampler::Rng::new(17);
        for (s, dtype) in
            [DType::Q4_K, DType::Q6_K, DType::IQ4_XS, DType::Q2_K, DType::Q5_0, DType::IQ4_NL]
                .into_iter()
                .enumerate()
        {
            let data: Vec<u8> = (0..rows)
                .flat_map(|r| {
                    crate::quant::chunks::tests::random_row(
                        dtype,
                        cols,
                        40 + 100 * s as u64 + r as u64,
                    )
                })
                .collect();
            let w = QMatrix { dtype, rows, cols, data: &data };
            let mut x = Activations::default();
            x.set(&random_vec(n * cols, 9), n, cols);
            let mut full = vec![0.0; n * rows];
            pool.install(|| matmul(&w, &x, &mut full));
            let sel: Vec<u32> = (0..rows as u32).filter(|j| j % 5 != 3).collect();
            let m = sel.len();
            let mask: Vec<bool> = (0..n * rows)
                .map(|i| rng.next_f32() < [0.02, 0.1, 0.4, 0.9][i % rows % 4])
                .collect();
            let mut c = vec![f32::NAN; n * m];
            pool.install(|| matmul_selected(&[w], &sel, Some(&mask), &x, &mut [&mut c]));
            for t in 0..n {
                for (k, &j) in sel.iter().enumerate() {
                    let want = full[t * rows + j as usize];
                    match mask[t * rows + j as usize] {
                        true => assert_eq!(
                            c[t * m + k].to_bits(),
                            want.to_bits(),
                            "{dtype:?} t={t} row {j}: {} vs {want}",
                            c[t * m + k]
                        ),
                        false => assert!(c[t * m + k].is_nan()),
                    }
                }
            }
        }
    }

    #[test]
    fn selected_rows_equal_full_product() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
        let (rows, cols) = (203, 96);
        let mut rng = crate::sampler::Rng::new(11);
        for dtype in ALL {
            let w_f = random_vec(rows * cols, 3);
            let data: Vec<u8> = w_f.chunks(cols).flat_map(|r| quantize_row(dtype, r)).collect();
            let g = QMatrix { dtype, rows, cols, data: &data };
            let u = QMatrix { dtype, rows, cols, data: &data[..] };
            // (from `group_min_tokens` tokens up, the quantized types go through row groups)
            for n in [1, 2, 3, 5, 7, 9, 13, 40] {
                let mut x = Activations::default();
                x.set(&random_vec(n * cols, n as u64), n, cols);
                let mut full = vec![0.0; n * rows];
                pool.install(|| matmul(&g, &x, &mut full));
                for keep in [0.0, 0.05, 0.3, 0.9, 1.0] {
                    let sel: Vec<u32> =
                        (0..rows as u32).filter(|_| rng.next_f32() < keep || keep == 1.0).collect();
                    let m = sel.len();
                    let (mut a, mut b) = (vec![f32::NAN; n * m], vec![f32::NAN; n * m]);
                    pool.install(|| {
                        matmul_selected(&[g, u], &sel, None, &x, &mut [&mut a, &mut b])
                    });
                    // and only the cells a random mask keeps (the rest stay NaN), rows kept by
                    // few tokens (one at a time, or two, three) and by many (row groups)
                    let mask: Vec<bool> = (0..n * rows)
                        .map(|i| rng.next_f32() < [0.02, 0.1, 0.4, 0.9][i % rows % 4])
                        .collect();
                    let mut c = vec![f32::NAN; n * m];
                    pool.install(|| matmul_selected(&[g], &sel, Some(&mask), &x, &mut [&mut c]));
                    for t in 0..n {
                        for (k, &j) in sel.iter().enumerate() {
                            let want = full[t * rows + j as usize];
                            assert_eq!(
                                a[t * m + k].to_bits(),
                                want.to_bits(),
                                "{dtype:?} n={n} keep={keep} t={t} row {j}"
                            );
                            assert_eq!(b[t * m + k].to_bits(), want.to_bits());
                            match mask[t * rows + j as usize] {
                                true => assert_eq!(
                                    c[t * m + k].to_bits(),
                                    want.to_bits(),
                                    "masked {dtype:?} n={n} t={t} row {j}"
                                ),
                                false => assert!(c[t * m + k].is_nan()),
                            }
                        }
                    }
                }
            }
        }
    }
}
