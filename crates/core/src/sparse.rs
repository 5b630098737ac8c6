//! Neuron-aware FFN operators: compute only the FFN neurons that a predictor (or a threshold)
//! selected. Gate and up are row-sparse (a skipped neuron's rows are never read); the down
//! projection is column-sparse, an axpy of each computed neuron's row of `down_t` (the
//! neuron-major, transposed down matrix) scaled by its activation.
//!
//! Decode (one token) runs fused: per chunk of selected neurons, gate -> activation -> up -> axpy
//! into that chunk's own accumulator, with rayon stealing chunks between threads; the
//! accumulators are then summed in chunk order. No two threads ever write the same memory, and
//! the chunking depends only on the selection and the thread count, so results are identical
//! from run to run for a fixed thread count. (PowerInfer's CPU axpy adds partial sums into the
//! shared output unsynchronised, a data race.)
//!
//! Prefill (many tokens) uses `down_t_matmul`: each task owns a range of output columns for all
//! tokens, so it needs no reduction at all.

use rayon::prelude::*;

use crate::kernels::{self, Rows};
use crate::matmul::{
    matmul, matmul_many, prefetch, simd_level, Activations, OutPtr, QMatrix, SimdLevel,
};
use crate::model::FfnActivation;
use crate::quant::{self, DType};

/// One FFN block as the sparse operators read it.
#[derive(Clone, Copy)]
pub struct FfnMats<'a> {
    pub gate: Option<QMatrix<'a>>, // (n_ff, n_embd); None for gateless FFNs (Falcon, OPT)
    pub up: QMatrix<'a>,           // (n_ff, n_embd)
    pub up_bias: Option<&'a [f32]>, // (n_ff), OPT
    pub down_t: QMatrix<'a>,       // (n_ff, n_embd): row j is the output vector of neuron j
    /// (n_embd, n_ff): the row-major down matrix when the model has it, for selections dense
    /// enough that the dense kernels are faster (see `DENSE_FRACTION`).
    pub down: Option<QMatrix<'a>>,
    pub act: FfnActivation,
    /// The same rows bundled by neuron, where the model built them (`Model::neuron_bundles`:
    /// `interleave_rows` of gate, up and down_t): one token's operator then reads a selected
    /// neuron's rows as one contiguous run instead of three scattered rows.
    pub bundles: Option<&'a [u8]>,
}

impl<'a> FfnMats<'a> {
    /// Bytes of one neuron's bundle: its gate (if any), up and down_t rows.
    pub fn bundle_bytes(&self) -> usize {
        self.gate.map_or(0, |g| g.row_bytes()) + self.up.row_bytes() + self.down_t.row_bytes()
    }

    /// The rows of `m` as one token's operator reads them: from the bundles, where `m`'s
    /// rows lie at `offset` in each, or from `m` itself.
    fn rows_of(&self, m: &QMatrix<'a>, offset: usize) -> Rows<'a> {
        match self.bundles {
            Some(b) => {
                Rows { data: &b[offset..], row_bytes: m.row_bytes(), stride: self.bundle_bytes() }
            }
            None => m.as_rows(),
        }
    }

    /// Gate (if any), up and down_t rows as one token's operator reads them.
    fn decode_rows(&self) -> (Option<Rows<'a>>, Rows<'a>, Rows<'a>) {
        let g = self.gate.map_or(0, |g| g.row_bytes());
        (
            self.gate.as_ref().map(|gw| self.rows_of(gw, 0)),
            self.rows_of(&self.up, g),
            self.rows_of(&self.down_t, g + self.up.row_bytes()),
        )
    }
}

/// Reusable buffers of the sparse operators (one set per session).
#[derive(Default)]
pub struct SparseScratch {
    acc: Vec<f32>,   // (n_chunks, n_embd) per-chunk partial sums of the down projection
    gate: Vec<f32>,  // (n_ff) dense gate pre-activations, then activations (dense fallback)
    up: Vec<f32>,    // (n_ff) dense up pre-activations (dense fallback)
    h: Activations,  // (1, n_ff) the masked activations as the down product reads them
    ht: Vec<f32>,    // (n_ff, n_tokens) activations transposed, for `down_t_matmul`
    nz: Vec<u32>,    // one token's neurons with a nonzero activation
    tiled: Vec<u32>, // neurons enough tokens need to go through `tiled_axpy`
    tiled_bits: Vec<u64>, // (n_ff / 64) the same neurons as bits
    tasks: Vec<PredictorTask>, // `predicted_ffn`'s, one per thread
}

/// Fewest neurons per chunk: below this the per-task cost outweighs the balance it buys.
const MIN_CHUNK: usize = 16;
/// Chunks per thread, so that a thread that finishes early can steal work.
const CHUNKS_PER_THREAD: usize = 4;
/// `CHUNKS_PER_THREAD` for one token's operator: fewer tasks and accumulators to sum, while a
/// thread that falls behind can still hand half its work over (AMD EPYC, 2 threads, bundled
/// rows, 90% skipped: 7B Q4_0 0.39-0.41 -> 0.36-0.37 ms; `sparse_e2e.py synthetic` at AVX2
/// 1.86x / 1.97x -> 2.03x / 2.05x standard dense, alternating runs).
const DECODE_CHUNKS_PER_THREAD: usize = 2;
/// Output columns per task in the reduction.
const REDUCE_COLS: usize = 512;
/// Accumulator values (chunks x columns) up to which the reduction runs on the calling thread.
const SERIAL_REDUCE: usize = 1 << 14;
/// A selection holding at least this fraction of the neurons runs as dense products (gate and
/// up over all rows, the activation masked to the selection, the row-major down product) when
/// the model has the row-major down matrix: below ~10% skipped the dense products are faster.
/// Chosen when the sparse operator read the selected rows at about 0.9 of the dense kernels'
/// rate; since the dense kernels prefetch, Q4_0's ratio is nearer 0.65 (`cargo bench --bench
/// sparse_ffn`), so the break-even now lies at a higher share skipped and wants re-measuring.
pub const DENSE_FRACTION: f64 = 0.9;

/// `down_t` rows shorter than this cost the sparse operator more per byte than the dense
/// kernels pay: SmolLM2's 576 weights are 324 bytes at Q4_0 and 612 at Q8_0, and there its
/// dots and axpys are bound by instructions, not memory (a float axpy per weight against the
/// dense down product's integer dot, each scattered row a memory latency of its own).
const SHORT_ROW_BYTES: usize = 1024;

/// `DENSE_FRACTION` for rows shorter than `SHORT_ROW_BYTES`. On SmolLM2's shape the sparse
/// operator breaks even with the dense block at 50-70% skipped (`cargo bench --bench
/// sparse_ffn`, POWERINFER_BENCH_SHAPES=576x1536, AVX2: Q4_0 0.82-0.88x at 50% and 1.2x at
/// 70% on one thread, 0.93-1.0x and 1.3-1.5x on two; Q8_0 0.6-0.65x and 0.94-1.0x on one,
/// 0.82-0.91x and 1.3x on two).
const DENSE_FRACTION_SHORT_ROWS: f64 = 0.4;

/// `DENSE_FRACTION_SHORT_ROWS` where the rows are bundled by neuron (`FfnMats::bundles`) and
/// the operator runs on several threads: there the sparse operator beats the dense kernels at
/// 50% skipped (SmolLM2's shape, 2 threads, 2-core AMD EPYC: Q4_0 1.06-1.29x, Q8_0 1.17-1.31x
/// against 0.91-0.98x through the dense kernels, AVX2 and AVX-512); on one thread it does not
/// (0.86-1.00x against 0.89-0.96x), and there the short-row fraction stays.
const DENSE_FRACTION_SHORT_BUNDLED: f64 = 0.6;

/// The share of the FFN's neurons from which a batch (a prompt) whose rows are shorter than
/// `SHORT_ROW_BYTES` computes the neurons any of its tokens selected through the dense
/// products, every row for every token, the cells no token of them selected zeroed after:
/// there the selected-row products (`matmul_selected`, hot rows for all tokens, the others
/// cell by cell) cost more than the dense kernels' pass over every row. SmolLM2's shape in
/// predictor mode (`benches/sparse_e2e.py synthetic --shape smollm2`'s model, 12% of the
/// neurons selected per token, 2-core AMD EPYC at AVX-512, 2 threads, alternating): a
/// 128-token prompt, whose union is about 90% of the neurons, 929 -> 1099 tok/s through the
/// dense products; a 32-token one (about 70%) even (853 and 833). On the 7B shape's longer
/// rows the selected-row products stay faster at both lengths (359 against 301 and 287 against
/// 247 tok/s), so long rows keep them.
pub const UNION_DENSE_FRACTION_SHORT_ROWS: f64 = 0.8;

/// Whether a batch computes the union of its tokens' selections, `union` of the `n_ff`
/// neurons, through the dense products (`UNION_DENSE_FRACTION_SHORT_ROWS`), given the length
/// of a `down_t` row in bytes.
pub fn batch_union_reads_dense(down_t_row_bytes: usize, n_ff: usize, union: usize) -> bool {
    down_t_row_bytes < SHORT_ROW_BYTES
        && union as f64 >= UNION_DENSE_FRACTION_SHORT_ROWS * n_ff as f64
}

/// Whether `sparse_ffn` computes a selection of `selected` of the `n_ff` neurons as dense
/// products (only where the model has the row-major down matrix), given the length of a
/// `down_t` row in bytes and whether the rows are read from bundles. (Called on the threads
/// the operator runs on: their count is the pool's.)
pub fn decodes_dense(
    has_down: bool,
    down_t_row_bytes: usize,
    bundled: bool,
    n_ff: usize,
    selected: usize,
) -> bool {
    let from = match (down_t_row_bytes < SHORT_ROW_BYTES, bundled) {
        (true, true) if rayon::current_num_threads() > 1 => DENSE_FRACTION_SHORT_BUNDLED,
        (true, _) => DENSE_FRACTION_SHORT_ROWS,
        (false, _) => DENSE_FRACTION,
    };
    has_down && selected as f64 >= from * n_ff as f64
}

/// y += a * row, at the given SIMD level; `next` (the rows read after this one, if any) is
/// prefetched a line at a time over the row's blocks (see `matmul::dot_row`).
#[inline]
pub fn axpy(level: SimdLevel, dtype: DType, row: &[u8], a: f32, y: &mut [f32], next: &[&[u8]]) {
    axpy_rows::<1>(level, dtype, [row], [a], y, next)
}

/// y += sum over r of a[r] * rows[r], four rows per pass over y; `next` as for `axpy`.
#[inline]
pub fn axpy4(
    level: SimdLevel,
    dtype: DType,
    rows: [&[u8]; 4],
    a: [f32; 4],
    y: &mut [f32],
    next: &[&[u8]],
) {
    axpy_rows::<4>(level, dtype, rows, a, y, next)
}

#[inline]
fn axpy_rows<const R: usize>(
    level: SimdLevel,
    dtype: DType,
    rows: [&[u8]; R],
    a: [f32; R],
    y: &mut [f32],
    next: &[&[u8]],
) {
    // SAFETY: levels above Scalar are only reported when the CPU has their features.
    unsafe { kernels::axpy::<R>(dtype, level)(rows, a, y, next) }
}

/// With the `phase-timers` feature: nanoseconds `sparse_ffn` spent in its three passes (gate
/// dots, up dots, down axpys), summed over threads; `cargo bench --bench sparse_ffn --features
/// phase-timers` prints their shares. Without it the marks are empty and cost nothing.
#[cfg(feature = "phase-timers")]
pub static PHASE_NS: [std::sync::atomic::AtomicU64; 3] =
    [const { std::sync::atomic::AtomicU64::new(0) }; 3];

#[cfg(feature = "phase-timers")]
type Mark = std::time::Instant;
#[cfg(not(feature = "phase-timers"))]
#[derive(Clone, Copy)]
struct Mark;

#[inline(always)]
fn mark() -> Mark {
    #[cfg(feature = "phase-timers")]
    return std::time::Instant::now();
    #[cfg(not(feature = "phase-timers"))]
    Mark
}

/// Adds each pass's time between consecutive marks to `PHASE_NS`.
#[inline(always)]
#[allow(unused_variables)]
fn add_phases(marks: [Mark; 4]) {
    #[cfg(feature = "phase-timers")]
    for (p, w) in marks.windows(2).enumerate() {
        let ns = (w[1] - w[0]).as_nanos() as u64;
        PHASE_NS[p].fetch_add(ns, std::sync::atomic::Ordering::Relaxed);
    }
}

/// The rows of the (up to four) neurons `ids` that a kernel call prefetches for the call after
/// it, and how many there are: `&rows[..n]` is the kernel's `next`.
fn next_rows<'a, const N: usize>(
    ids: &[u32],
    row: impl Fn(u32) -> &'a [u8],
) -> ([&'a [u8]; N], usize) {
    let mut rows = [&[][..]; N];
    for (r, &j) in rows.iter_mut().zip(ids) {
        *r = row(j);
    }
    (rows, ids.len().min(N))
}

/// Rows of `down_t` at least this long (the 7B shape's 2304-byte Q4_0 rows; not SmolLM2's 324)
/// take the integer down pass (`avx512::axpy_group_q4_0`) where the CPU has it. Measured on a
/// Zen 4 (one process alternating the two, rows from DRAM): the 7B shape's operator 1.07-1.13x
/// faster; SmolLM2's short rows 0.93x from memory (its 32-row groups read 32 short rows at
/// once, where the float axpys stream four), so they keep the float axpys.
const INTEGER_DOWN_ROW_BYTES: usize = 1024;

/// Neurons per group in `sparse_ffn`'s passes.
const GROUP: usize = 64;

/// Dots of the rows `sel` of `w` with token 0 of `x` into `out[..sel.len()]`, as many rows per
/// kernel call as the dense decode takes (`dtype::TYPES`' decode rows: four quantized rows share
/// the activations' loads and one horizontal sum, where a row alone pays that sum per block),
/// each call with the next call's rows prefetched (see `matmul::dot_row`). Each value is the
/// one the row gives alone. The last call prefetches `then`, the rows the caller reads next.
pub(crate) fn dot_selected(
    w: &QMatrix,
    sel: &[u32],
    x: &Activations,
    level: SimdLevel,
    out: &mut [f32],
    then: &[&[u8]],
) {
    dot_selected_rows(w.dtype, w.as_rows(), sel, x, level, out, then)
}

/// `dot_selected` over rows of `dtype` as `rows` lays them out (apart, or in bundles).
fn dot_selected_rows(
    dtype: DType,
    rows: Rows,
    sel: &[u32],
    x: &Activations,
    level: SimdLevel,
    out: &mut [f32],
    then: &[&[u8]],
) {
    let four = dtype.traits().decode_rows[level as usize] == 4;
    // SAFETY: levels above Scalar are only reported when the CPU has their features, and `x`
    // holds the activation forms of the level's kernels (`Activations::set_for`).
    unsafe { kernels::selected(dtype, level)(rows, sel, four, x.token(0), out, then) }
}

/// One token's FFN over the selected neurons only: out (n_embd) = sum over j in `neurons` of
/// act(gate_j . x, up_j . x) * down_t[j]. `x` holds the one normed input token. `gate_values`
/// (n_ff) are the gate pre-activations when the caller already computed them densely
/// (threshold mode). Returns how many neurons reached the down projection (a neuron whose
/// activation is exactly zero is dropped after its gate or up dot, never axpy'd). A selection
/// dense enough for the dense kernels to be faster (`decodes_dense`) runs through them.
pub fn sparse_ffn(
    m: &FfnMats,
    x: &Activations,
    neurons: &[u32],
    gate_values: Option<&[f32]>,
    out: &mut [f32],
    scratch: &mut SparseScratch,
) -> usize {
    let n_embd = m.down_t.cols;
    assert_eq!(x.n, 1, "sparse_ffn takes one token");
    assert_eq!(out.len(), n_embd);
    assert_eq!(m.up.rows, m.down_t.rows);
    debug_assert!(neurons.iter().all(|&j| (j as usize) < m.up.rows));
    if let Some(down) = m.down {
        if decodes_dense(true, m.down_t.row_bytes(), m.bundles.is_some(), m.up.rows, neurons.len())
        {
            return dense_ffn(m, &down, x, neurons, gate_values, out, scratch);
        }
    }
    let threads = rayon::current_num_threads().max(1);
    let n_chunks = neurons.len().div_ceil(MIN_CHUNK).clamp(1, threads * DECODE_CHUNKS_PER_THREAD);
    scratch.acc.resize(n_chunks * n_embd, 0.0);
    let level = simd_level();
    let used: usize = scratch
        .acc
        .par_chunks_mut(n_embd)
        .enumerate()
        .map(|(k, acc)| {
            let chunk = &neurons[neurons.len() * k / n_chunks..neurons.len() * (k + 1) / n_chunks];
            chunk_ffn(m, x, chunk, gate_values, level, acc)
        })
        .sum();
    sum_chunks(&scratch.acc, n_chunks, out);
    used
}

/// One chunk of `sparse_ffn`'s neurons into its own accumulator `acc` (n_embd), zeroed first:
/// per group of neurons, three passes that each stream one matrix: gate dots, up dots for the
/// neurons still alive, then axpys four rows at a time. Returns how many neurons reached the
/// down projection.
fn chunk_ffn(
    m: &FfnMats,
    x: &Activations,
    chunk: &[u32],
    gate_values: Option<&[f32]>,
    level: SimdLevel,
    acc: &mut [f32],
) -> usize {
    acc.fill(0.0);
    let rows = m.decode_rows();
    let mut used = 0;
    let mut vals = [0.0f32; GROUP]; // gate values, then activations
    let mut alive = [0u32; GROUP];
    for (g, group) in chunk.chunks(GROUP).enumerate() {
        let (n_active, [t0, t1, t2]) =
            group_activations(m, rows, x, group, gate_values, level, &mut vals, &mut alive);
        // axpy of each active neuron's down_t row into this chunk's accumulator, the last
        // call with the first rows the next group reads prefetched
        let (gate_rows, up_rows, down_rows) = rows;
        let first_read = match (gate_values, gate_rows) {
            (None, Some(gr)) => gr,
            _ => up_rows,
        };
        let (then, n_then) =
            next_rows::<4>(chunk.get(GROUP * (g + 1)..).unwrap_or(&[]), |j: u32| {
                first_read.row(j as usize)
            });
        add_rows(
            level,
            m.down_t.dtype,
            &alive[..n_active],
            |j: u32| down_rows.row(j as usize),
            |k, _| vals[k],
            acc,
            &then[..n_then],
        );
        used += n_active;
        add_phases([t0, t1, t2, mark()]);
    }
    used
}

/// out = the sum of the n_chunks accumulators in `acc` (n_chunks, out.len()), in chunk order:
/// on this thread where that is a few microseconds (a fork/join costs as much), else by column
/// ranges in parallel.
fn sum_chunks(acc: &[f32], n_chunks: usize, out: &mut [f32]) {
    let n_embd = out.len();
    let reduce = |(c, o): (usize, &mut [f32])| {
        let c0 = c * REDUCE_COLS;
        o.copy_from_slice(&acc[c0..c0 + o.len()]);
        for k in 1..n_chunks {
            let part = &acc[k * n_embd + c0..k * n_embd + c0 + o.len()];
            o.iter_mut().zip(part).for_each(|(a, b)| *a += b);
        }
    };
    if n_chunks * n_embd <= SERIAL_REDUCE {
        out.chunks_mut(REDUCE_COLS).enumerate().for_each(reduce);
    } else {
        out.par_chunks_mut(REDUCE_COLS).enumerate().for_each(reduce);
    }
}

/// What one task of `predicted_ffn` keeps between tokens (so that a token allocates nothing).
#[derive(Default)]
pub struct PredictorTask {
    hidden: Vec<f32>,         // (hidden) relu(fc1 . x)
    hidden_acts: Activations, // the same as fc2 reads it
    logits: Vec<f32>,         // (the task's neurons) fc2's rows of them . hidden
    neurons: Vec<u32>,        // the task's selected neurons
}

/// The predictor's rule, the one every executor applies (the CPU's selection, the hybrid
/// executor's cold neurons, and the `ffn_hot` kernels' early exit, which reads
/// `!(logit >= cutoff)` so that a NaN logit is never selected): a neuron is computed iff its
/// logit is at least the cut-off.
#[inline]
pub fn predictor_selects(logit: f32, cutoff: f32) -> bool {
    logit >= cutoff
}

/// Predictors whose first matrix is at most this many bytes run inside the sparse operator's
/// parallel pass (`predicted_ffn`): computing fc1 once per thread costs no more than the task of
/// `matmul`'s that would have held it (`matmul::DECODE_TASK_BYTES`).
pub const FUSED_PREDICTOR_FC1_BYTES: usize = 256 << 10;

/// One token's FFN in predictor mode, the predictor inside the operator's one parallel pass:
/// each task (one per thread) computes the predictor's hidden layer relu(fc1 . xp) itself,
/// fc2's logits for its own range of neurons, keeps those at or above `cutoff`
/// (`predictor_selects`), and runs them through `sparse_ffn`'s passes into its own
/// accumulator; the accumulators are summed in task order. Where the predictor's products and
/// the selection between them took two parallel passes and a serial one of their own, on
/// SmolLM2's shape each about as long as a pass over its rows. `xp` is the predictor's input
/// (the residual stream), `x` the FFN's (the normed input). Returns how many neurons were
/// selected and how many reached the down projection.
#[allow(clippy::too_many_arguments)]
pub fn predicted_ffn(
    m: &FfnMats,
    fc1: &QMatrix,
    fc2: &QMatrix,
    xp: &Activations,
    x: &Activations,
    cutoff: f32,
    out: &mut [f32],
    scratch: &mut SparseScratch,
) -> (usize, usize) {
    let (n_embd, n_ff) = (m.down_t.cols, m.up.rows);
    assert_eq!(x.n, 1, "predicted_ffn takes one token");
    assert_eq!(xp.n, 1, "predicted_ffn takes one token");
    assert_eq!(out.len(), n_embd);
    assert_eq!((fc1.cols, fc2.rows, fc2.cols), (xp.cols, n_ff, fc1.rows), "predictor shape");
    let n_tasks = rayon::current_num_threads().max(1);
    scratch.acc.resize(n_tasks * n_embd, 0.0);
    scratch.tasks.resize_with(n_tasks, Default::default);
    let level = simd_level();
    let (selected, used) = scratch
        .acc
        .par_chunks_mut(n_embd)
        .zip(scratch.tasks.par_iter_mut())
        .enumerate()
        .map(|(k, (acc, t))| {
            t.hidden.resize(fc1.rows, 0.0);
            crate::matmul::matmul_serial(fc1, 0..fc1.rows, xp, &mut t.hidden);
            t.hidden.iter_mut().for_each(|v| *v = v.max(0.0));
            t.hidden_acts.set_for(&t.hidden, 1, fc1.rows, &[*fc2]);
            let range = n_ff * k / n_tasks..n_ff * (k + 1) / n_tasks;
            t.logits.resize(range.len(), 0.0);
            crate::matmul::matmul_serial(fc2, range.clone(), &t.hidden_acts, &mut t.logits);
            // the selected neurons in order, without a branch on the (random) selection
            t.neurons.resize(range.len(), 0);
            let mut count = 0;
            for (j, &v) in range.zip(&t.logits) {
                t.neurons[count] = j as u32;
                count += predictor_selects(v, cutoff) as usize;
            }
            t.neurons.truncate(count);
            (t.neurons.len(), chunk_ffn(m, x, &t.neurons, None, level, acc))
        })
        .reduce(|| (0, 0), |a, b| (a.0 + b.0, a.1 + b.1));
    sum_chunks(&scratch.acc, n_tasks, out);
    (selected, used)
}

/// The activations of one group of selected neurons (at most `GROUP`): gate dots (or the
/// given gate values), up dots for the neurons the gate leaves alive (a ReLU-type gate at or
/// below zero zeroes the neuron, so its up row is not even read), then the activation. Leaves
/// the neurons whose activation is nonzero in `alive` and their activations in `vals`, and
/// returns how many there are, with the marks of the phases (gate, up, activation).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn group_activations(
    m: &FfnMats,
    (gate_rows, up_rows, down_rows): (Option<Rows>, Rows, Rows),
    x: &Activations,
    group: &[u32],
    gate_values: Option<&[f32]>,
    level: SimdLevel,
    vals: &mut [f32; GROUP],
    alive: &mut [u32; GROUP],
) -> (usize, [Mark; 3]) {
    let gate_decides = matches!(m.act, FfnActivation::ReGlu | FfnActivation::DReGlu);
    let t0 = mark();
    let mut n_alive = 0;
    match (gate_values, &m.gate, gate_rows) {
        (Some(gv), _, _) => group.iter().enumerate().for_each(|(i, &j)| vals[i] = gv[j as usize]),
        (None, Some(gw), Some(gr)) => {
            // (the last call prefetches the first up rows: the gate rarely kills all four)
            let (then, n) = next_rows::<4>(group, |j| up_rows.row(j as usize));
            dot_selected_rows(gw.dtype, gr, group, x, level, vals, &then[..n])
        }
        _ => {}
    }
    for (i, &j) in group.iter().enumerate() {
        if !(gate_decides && vals[i] <= 0.0) {
            vals[n_alive] = vals[i];
            alive[n_alive] = j;
            n_alive += 1;
        }
    }
    // up, then the activation
    let t1 = mark();
    let mut ups = [0.0f32; GROUP];
    let (then, n) = next_rows::<4>(&alive[..n_alive], |j| down_rows.row(j as usize));
    dot_selected_rows(m.up.dtype, up_rows, &alive[..n_alive], x, level, &mut ups, &then[..n]);
    let t2 = mark();
    if let Some(bias) = m.up_bias {
        ups[..n_alive].iter_mut().zip(&alive[..n_alive]).for_each(|(u, &j)| *u += bias[j as usize]);
    }
    m.act.apply_all(&mut vals[..n_alive], &ups[..n_alive]);
    let mut n_active = 0;
    for i in 0..n_alive {
        let (j, h) = (alive[i], vals[i]);
        if h != 0.0 {
            vals[n_active] = h;
            alive[n_active] = j;
            n_active += 1;
        }
    }
    (n_active, [t0, t1, t2])
}

/// `sparse_ffn` through the dense kernels: gate and up for every neuron, the activation kept
/// only for the selected ones, then the row-major down product. Same result as the sparse path
/// up to float summation order.
fn dense_ffn(
    m: &FfnMats,
    down: &QMatrix,
    x: &Activations,
    neurons: &[u32],
    gate_values: Option<&[f32]>,
    out: &mut [f32],
    scratch: &mut SparseScratch,
) -> usize {
    let n_ff = m.up.rows;
    let SparseScratch { gate, up, h, .. } = scratch;
    gate.resize(n_ff, 0.0);
    up.resize(n_ff, 0.0);
    match (gate_values, &m.gate) {
        (Some(gv), _) => {
            gate.copy_from_slice(&gv[..n_ff]);
            matmul(&m.up, x, up);
        }
        (None, Some(gw)) => matmul_many(&[*gw, m.up], x, &mut [&mut gate[..], &mut up[..]]),
        // gateless: the activation reads only up
        (None, None) => matmul(&m.up, x, up),
    }
    // act(gate, up) for every neuron (in lanes), then kept where selected
    if let Some(bias) = m.up_bias {
        up.iter_mut().zip(bias).for_each(|(u, b)| *u += b);
    }
    m.act.apply_all(gate, up);
    // the selected neurons' activations into zeros (up's buffer): a fill per gap between
    // selected neurons cost a call each
    up.fill(0.0);
    let mut used = 0;
    for &j in neurons {
        let j = j as usize;
        up[j] = gate[j];
        used += (gate[j] != 0.0) as usize;
    }
    h.set_for(up, 1, n_ff, &[*down]);
    matmul(down, h, out);
    used
}

/// Neurons at least this share of a batch's tokens need (and at least `TILED_MIN` tokens) go
/// through `tiled_axpy` for all the tokens, zeros included: its register tiles do a fused
/// multiply-add per value where the per-token axpy loads and stores the output row for each
/// (64-token prompts of `sparse_e2e.py synthetic --layers 2`, down projection 40 -> 28 ms).
const TILED_FROM: f64 = 0.25;
const TILED_MIN: usize = 8;

/// Neurons per pass of `tiled_axpy` (their dequantized slices stay in L2).
const TILED_CHUNK: usize = 32;

/// y[t][c] += sum over k of ht[neurons[k]][t0 + t] * w[k][c] for t < tokens and c in `cols`,
/// the neurons in order, one fused multiply-add each: `w` holds the neurons' rows of `width`
/// floats, `ht` each neuron's values for the n tokens, y's rows lie `stride` apart. Twin of
/// `avx2::tiled_axpy` and `avx512::tiled_axpy`, bit for bit.
///
/// # Safety
/// `y` must be valid for reads and writes of those `tokens` rows' `cols`, which nothing else
/// may touch meanwhile (other threads write the columns between them).
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn tiled_axpy_scalar(
    w: &[f32],
    width: usize,
    ht: &[f32],
    n: usize,
    neurons: &[u32],
    t0: usize,
    tokens: usize,
    y: *mut f32,
    stride: usize,
    cols: std::ops::Range<usize>,
) {
    for t in 0..tokens {
        for c in cols.clone() {
            let y = y.add(t * stride + c);
            let mut acc = *y;
            for (k, &j) in neurons.iter().enumerate() {
                acc = ht[j as usize * n + t0 + t].mul_add(w[k * width + c], acc);
            }
            *y = acc;
        }
    }
}

/// `tiled_axpy_scalar` over all n tokens and `width` columns, in SIMD tiles where the CPU has
/// them (the same bits at every level). `y` is the first token's row; rows `stride` apart.
///
/// # Safety
/// As `tiled_axpy_scalar`'s, for all n rows and columns 0..width.
#[allow(clippy::too_many_arguments)]
unsafe fn tiled_axpy(
    level: SimdLevel,
    w: &[f32],
    width: usize,
    ht: &[f32],
    n: usize,
    neurons: &[u32],
    y: *mut f32,
    stride: usize,
) {
    let lanes = match level {
        SimdLevel::Avx512 => 16,
        SimdLevel::Avx2 => 8,
        SimdLevel::Scalar => 0,
    };
    let simd = if lanes == 0 { 0 } else { width - width % lanes };
    if simd < width {
        tiled_axpy_scalar(w, width, ht, n, neurons, 0, n, y, stride, simd..width);
    }
    #[cfg(target_arch = "x86_64")]
    if simd > 0 {
        let mut t0 = 0;
        macro_rules! pass {
            ($t:literal) => {
                while t0 + $t <= n {
                    // (the level's features are the CPU's; the rows, w and ht as the caller
                    // vouches, `simd` a multiple of the lanes, t0 + $t <= n)
                    match level {
                        SimdLevel::Avx512 => crate::avx512::tiled_axpy::<$t>(
                            w,
                            width,
                            simd,
                            ht,
                            n,
                            neurons,
                            t0,
                            y.add(t0 * stride),
                            stride,
                        ),
                        _ => crate::avx2::tiled_axpy::<$t>(
                            w,
                            width,
                            simd,
                            ht,
                            n,
                            neurons,
                            t0,
                            y.add(t0 * stride),
                            stride,
                        ),
                    }
                    t0 += $t;
                }
            };
        }
        if level == SimdLevel::Avx512 {
            pass!(16);
        }
        pass!(8);
        pass!(4);
        pass!(1);
    }
}

/// The down projection of a batch from the neuron-major matrix: out (n, n_embd) =
/// h (n, n_ff) @ down_t (n_ff, n_embd). (Any product read through an input-major copy has this
/// shape: input sparsity uses it for every matrix.) Zero values are skipped. Neurons a good
/// share of the tokens need are dequantized a chunk at a time and added for every token in
/// register tiles (`TILED_FROM`), each task owning a range of output columns; the others go
/// token by token, each task owning whole rows of the output, as one token's decode adds them:
/// a token's nonzero neurons' rows as stored, four per pass over its row.
pub fn down_t_matmul(
    down_t: &QMatrix,
    h: &[f32],
    n: usize,
    out: &mut [f32],
    scratch: &mut SparseScratch,
) {
    let (n_ff, n_embd) = (down_t.rows, down_t.cols);
    assert_eq!(h.len(), n * n_ff);
    assert_eq!(out.len(), n * n_embd);
    out.fill(0.0);
    let threads = rayon::current_num_threads().max(1);
    let level = simd_level();
    let optr = OutPtr(out.as_mut_ptr());
    // the output columns of a task where tasks split them
    let unit = down_t.dtype.block_len().max(32);
    let width = (n_embd.div_ceil(threads * CHUNKS_PER_THREAD))
        .next_multiple_of(unit)
        .min(n_embd.next_multiple_of(unit));
    if n == 1 {
        scratch.nz.clear();
        scratch.nz.extend((0..n_ff as u32).filter(|&j| h[j as usize] != 0.0));
        let nz = &scratch.nz;
        // one token: each kept row's slice goes to the axpy kernels as it is stored, four
        // rows per pass over the task's columns
        (0..n_embd.div_ceil(width)).into_par_iter().for_each(|task| {
            let c0 = task * width;
            let c1 = (c0 + width).min(n_embd);
            let (b0, b1) = (down_t.dtype.row_bytes(c0), down_t.dtype.row_bytes(c1));
            // SAFETY: this task alone writes columns c0..c1, and out.len() == n_embd.
            let y = unsafe { std::slice::from_raw_parts_mut(optr.at(c0), c1 - c0) };
            let slice = |j: u32| &down_t.row(j as usize)[b0..b1];
            add_rows(level, down_t.dtype, nz, slice, |_, j| h[j as usize], y, &[]);
        });
        return;
    }

    // h transposed to (n_ff, n) (one neuron's values for all tokens contiguous, as the tiles
    // read them), and the neurons that go through the tiles, as a list and as bits
    scratch.ht.resize(n_ff * n, 0.0);
    scratch.tiled.clear();
    scratch.tiled_bits.clear();
    scratch.tiled_bits.resize(n_ff.div_ceil(64), 0);
    let tiled_from = (TILED_FROM * n as f64).max(TILED_MIN as f64);
    for j in 0..n_ff {
        let mut count = 0;
        for t in 0..n {
            let v = h[t * n_ff + j];
            scratch.ht[j * n + t] = v;
            count += (v != 0.0) as usize;
        }
        if count as f64 >= tiled_from {
            scratch.tiled.push(j as u32);
            scratch.tiled_bits[j / 64] |= 1 << (j % 64);
        }
    }
    let (ht, tiled, tiled_bits) = (&scratch.ht, &scratch.tiled, &scratch.tiled_bits);
    if !tiled.is_empty() {
        (0..n_embd.div_ceil(width)).into_par_iter().for_each(|task| {
            let c0 = task * width;
            let c1 = (c0 + width).min(n_embd);
            let (b0, b1) = (down_t.dtype.row_bytes(c0), down_t.dtype.row_bytes(c1));
            let mut w = vec![0.0f32; TILED_CHUNK.min(tiled.len()) * (c1 - c0)];
            for (c, chunk) in tiled.chunks(TILED_CHUNK).enumerate() {
                for (k, &j) in chunk.iter().enumerate() {
                    if let Some(&ahead) = tiled.get(c * TILED_CHUNK + k + 2) {
                        prefetch(&down_t.row(ahead as usize)[b0..b1]);
                    }
                    quant::dequantize_row(
                        down_t.dtype,
                        &down_t.row(j as usize)[b0..b1],
                        &mut w[k * (c1 - c0)..(k + 1) * (c1 - c0)],
                    );
                }
                // SAFETY: this task alone touches columns c0..c1 of every token's row (n rows
                // of n_embd, asserted above)
                unsafe { tiled_axpy(level, &w, c1 - c0, ht, n, chunk, optr.at(c0), n_embd) };
            }
        });
    }
    // the other neurons, token by token. (Split by columns, every task scanned every neuron's
    // values for every token, a mispredicted branch per nonzero, and its axpys covered a few
    // blocks each: `sparse_e2e.py synthetic --shape smollm2`'s PowerInfer-layout model, 128-token
    // prompt, dense mode, 2-core AMD EPYC, 2 threads: 0.55x the standard layout's prompt speed
    // -> 1.0x, with the dense products for the gate and up.)
    let tasks = n.min(threads * CHUNKS_PER_THREAD);
    (0..tasks).into_par_iter().for_each_init(Vec::new, |nz: &mut Vec<u32>, task| {
        for t in n * task / tasks..n * (task + 1) / tasks {
            let ht_row = &h[t * n_ff..(t + 1) * n_ff];
            nonzero_untiled(ht_row, tiled_bits, nz);
            // SAFETY: this task alone writes token t's row, within out (n * n_embd)
            let y = unsafe { std::slice::from_raw_parts_mut(optr.at(t * n_embd), n_embd) };
            let row = |j: u32| down_t.row(j as usize);
            add_rows(level, down_t.dtype, nz, row, |_, j| ht_row[j as usize], y, &[]);
        }
    });
}

/// y += sum over k of coef(k, ids[k]) * row(ids[k]), in order: the type's `axpy_rows` rows
/// per pass over y (then four, then one, for the rest), each pass with the next pass's rows on
/// their way (scattered rows, a few lines each), the last with `then` (what the caller reads
/// next).
fn add_rows<'a>(
    level: SimdLevel,
    dtype: DType,
    ids: &[u32],
    row: impl Fn(u32) -> &'a [u8],
    coef: impl Fn(usize, u32) -> f32,
    y: &mut [f32],
    then: &[&'a [u8]],
) {
    // long Q4_0 rows in integers, up to 32 a call (`quant::axpy_group_q4_0_scalar`), each
    // call prefetching the next call's rows into L2 over its blocks; the first call's up front
    #[cfg(target_arch = "x86_64")]
    if dtype == DType::Q4_0
        && ids.first().is_some_and(|&j| row(j).len() >= INTEGER_DOWN_ROW_BYTES)
        && crate::simd::avx512_vbmi(level)
    {
        for &j in ids.iter().take(quant::AXPY_GROUP_ROWS) {
            crate::simd::prefetch_l2(row(j))
        }
        for (g, group) in ids.chunks(quant::AXPY_GROUP_ROWS).enumerate() {
            let first = g * quant::AXPY_GROUP_ROWS;
            let mut rows = [&[][..]; quant::AXPY_GROUP_ROWS];
            let mut a = [0.0f32; quant::AXPY_GROUP_ROWS];
            for (i, &j) in group.iter().enumerate() {
                (rows[i], a[i]) = (row(j), coef(first + i, j));
            }
            let after = first + group.len();
            let (next, n) = next_rows::<{ quant::AXPY_GROUP_ROWS }>(&ids[after..], &row);
            let next = if n == 0 { then } else { &next[..n] };
            let (rows, a) = (&rows[..group.len()], &a[..group.len()]);
            // SAFETY: `avx512_vbmi` holds only where the CPU has AVX-512 with VBMI
            unsafe { crate::avx512::axpy_group_q4_0::<true>(rows, a, y, next) }
        }
        return;
    }
    let wide = dtype.traits().axpy_rows == 8;
    let width = |left: usize| match left {
        8.. if wide => 8,
        4.. => 4,
        _ => 1,
    };
    let mut k = 0;
    while k < ids.len() {
        let (w, after) = (width(ids.len() - k), k + width(ids.len() - k));
        let next_ids = &ids[after..(after + width(ids.len() - after)).min(ids.len())];
        let (next, n) = next_rows::<8>(next_ids, &row);
        let next = if n == 0 { then } else { &next[..n] };
        let a = |i: usize| coef(k + i, ids[k + i]);
        match w {
            8 => {
                let rows: [u32; 8] = std::array::from_fn(|i| ids[k + i]);
                axpy_rows::<8>(level, dtype, rows.map(&row), std::array::from_fn(a), y, next)
            }
            4 => {
                let rows = [ids[k], ids[k + 1], ids[k + 2], ids[k + 3]];
                axpy4(level, dtype, rows.map(&row), std::array::from_fn(a), y, next)
            }
            _ => axpy(level, dtype, row(ids[k]), a(0), y, next),
        }
        k = after;
    }
}

/// The neurons j of one token's values `h` (n_ff) with h[j] != 0 and bit j of `tiled` clear,
/// in order, into `out`: 64 flags gathered into a word at a time, no branch per neuron.
fn nonzero_untiled(h: &[f32], tiled: &[u64], out: &mut Vec<u32>) {
    out.clear();
    for (w, vals) in h.chunks(64).enumerate() {
        let mut bits =
            vals.iter().enumerate().fold(0u64, |b, (k, &v)| b | ((v != 0.0) as u64) << k);
        bits &= !tiled[w];
        while bits != 0 {
            out.push((64 * w) as u32 + bits.trailing_zeros());
            bits &= bits - 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::matmul::matmul_many;
    use crate::quant::tests::random_vec;
    use crate::quant::{dequantize_row, quantize_row};

    /// The float types and those whose blocks the kernels read directly.
    const ALL: [DType; 6] =
        [DType::F32, DType::F16, DType::BF16, DType::Q4_0, DType::Q4_1, DType::Q8_0];

    fn matrix(dtype: DType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
        random_vec(rows * cols, seed).chunks(cols).flat_map(|r| quantize_row(dtype, r)).collect()
    }

    /// A row of any type: quantized from random values, or random valid blocks (chunked types).
    fn any_row(dtype: DType, n: usize, seed: u64) -> Vec<u8> {
        if dtype.is_chunked() {
            crate::quant::chunks::tests::random_row(dtype, n, seed)
        } else {
            quantize_row(dtype, &random_vec(n, seed))
        }
    }

    /// The sparse dots go four scattered rows per kernel call (`dot_selected`): each value must
    /// be bit for bit the row's dot alone, for every type at every level this CPU has, with a
    /// selection whose length leaves a remainder of rows done one at a time, in rows short and
    /// long (`kernels::APART_L2_ROW_BYTES`: the long ones are prefetched by other kernels).
    #[test]
    fn selected_rows_in_groups_equal_each_row_alone() {
        for cols in [512, 2048] {
            selected_rows_in_groups_equal_each_row_alone_at(cols);
        }
    }

    fn selected_rows_in_groups_equal_each_row_alone_at(cols: usize) {
        let n_rows = 42;
        let sel: Vec<u32> = (0..n_rows as u32).filter(|j| j % 3 != 1 || *j == 4).collect();
        assert!(!sel.len().is_multiple_of(4));
        let levels: Vec<SimdLevel> = [SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512]
            .into_iter()
            .filter(|&l| l <= simd_level())
            .collect();
        let mut x = Activations::default();
        x.set(&random_vec(cols, 7), 1, cols);
        for dtype in DType::ALL {
            let data: Vec<u8> =
                (0..n_rows).flat_map(|r| any_row(dtype, cols, 100 + r as u64)).collect();
            let w = QMatrix { dtype, rows: n_rows, cols, data: &data };
            for &level in &levels {
                let mut out = vec![f32::NAN; sel.len()];
                dot_selected(&w, &sel, &x, level, &mut out, &[]);
                for (k, &j) in sel.iter().enumerate() {
                    let alone = crate::matmul::dot_row(&w, j as usize, None, &x, [0], level)[0];
                    assert_eq!(
                        out[k].to_bits(),
                        alone.to_bits(),
                        "{} at {level:?}, {cols} columns, row {j}: {} in a group, {alone} alone",
                        dtype.name(),
                        out[k]
                    );
                }
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_axpy_matches_scalar() {
        if !crate::simd::detect().has_avx2() {
            eprintln!("skipping: no AVX2 on this CPU");
            return;
        }
        for dtype in DType::ALL {
            for n in [32, 64, 96, 576, 4096] {
                if n % dtype.block_len() != 0 {
                    continue;
                }
                let row = any_row(dtype, n, n as u64);
                let y0 = random_vec(n, 99);
                let (mut ys, mut yv) = (y0.clone(), y0.clone());
                quant::axpy_scalar(dtype, &row, 0.37, &mut ys);
                axpy(SimdLevel::Avx2, dtype, &row, 0.37, &mut yv, &[&row[..]]);
                for i in 0..n {
                    assert!(
                        (ys[i] - yv[i]).abs() <= 1e-6,
                        "{dtype:?} n={n} i={i}: {} vs {}",
                        ys[i],
                        yv[i]
                    );
                }
            }
        }
        rows_at_once_match_scalar::<4>(SimdLevel::Avx2);
        rows_at_once_match_scalar::<8>(SimdLevel::Avx2);
        // float rows whose length is not a multiple of 8 use the scalar tail
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let row = quantize_row(dtype, &random_vec(13, 5));
            let (mut ys, mut yv) = (vec![1.0; 13], vec![1.0; 13]);
            quant::axpy_scalar(dtype, &row, -2.0, &mut ys);
            unsafe { crate::avx2::axpy_rows::<1>(dtype, [&row[..]], [-2.0], &mut yv, &[]) };
            assert_eq!(ys, yv);
        }
    }

    /// R rows in one axpy call at `level` against R calls of the scalar axpy, every type.
    #[cfg(target_arch = "x86_64")]
    fn rows_at_once_match_scalar<const R: usize>(level: SimdLevel) {
        for dtype in DType::ALL {
            for n in [32, 96, 4096] {
                if n % dtype.block_len() != 0 {
                    continue;
                }
                let rows: Vec<Vec<u8>> = (0..R).map(|r| any_row(dtype, n, 40 + r as u64)).collect();
                let a: [f32; R] = std::array::from_fn(|r| [0.5, -1.25, 2.0, 0.125][r % 4]);
                let y0 = random_vec(n, 98);
                let (mut ys, mut yv) = (y0.clone(), y0.clone());
                for r in 0..R {
                    quant::axpy_scalar(dtype, &rows[r], a[r], &mut ys);
                }
                let rr: [&[u8]; R] = std::array::from_fn(|r| &rows[r][..]);
                axpy_rows::<R>(level, dtype, rr, a, &mut yv, &rr);
                for i in 0..n {
                    assert!(
                        (ys[i] - yv[i]).abs() <= 1e-5,
                        "x{R} {level:?} {dtype:?} n={n} i={i}: {} vs {}",
                        ys[i],
                        yv[i]
                    );
                }
            }
        }
    }

    /// Rows of random Q4_0 blocks whose scales spread over three orders of magnitude (so the
    /// int8 coefficients of a block use their whole range and round the small ones hard).
    fn spread_q4_0_rows(n_rows: usize, cols: usize, seed: u64) -> Vec<Vec<u8>> {
        let mut rng = crate::sampler::Rng::new(seed);
        (0..n_rows)
            .map(|_| {
                let v: Vec<f32> = (0..cols)
                    .map(|_| (rng.next_f32() * 2.0 - 1.0) * 10f32.powf(rng.next_f32() * 3.0 - 2.0))
                    .collect();
                quantize_row(DType::Q4_0, &v)
            })
            .collect()
    }

    /// The integer down pass against float64: each block's int8 coefficients are off by at most
    /// half a step (its peak / 254) each, times |q - 8| <= 8, so a column is off by at most
    /// 4 * step * rows, plus float rounding. Every group size from 1 to 32 rows, widths whose
    /// last step of blocks is short, zero and tiny coefficients.
    #[test]
    fn integer_down_pass_is_within_its_rounding_of_float64() {
        for cols in [32, 96, 576, 4096] {
            let nb = cols / 32;
            for n_rows in [1, 3, 4, 7, 16, 31, 32] {
                let rows = spread_q4_0_rows(n_rows, cols, (cols + n_rows) as u64);
                let mut a = random_vec(n_rows, n_rows as u64);
                a[0] = 0.0;
                if n_rows > 2 {
                    a[2] = 1e-30;
                }
                let y0 = random_vec(cols, 3);
                let mut y = y0.clone();
                let rr: Vec<&[u8]> = rows.iter().map(|r| &r[..]).collect();
                quant::axpy_group_q4_0_scalar(&rr, &a, &mut y);
                let mut dq = vec![vec![0.0f32; cols]; n_rows];
                for (r, d) in dq.iter_mut().enumerate() {
                    dequantize_row(DType::Q4_0, &rows[r], d);
                }
                for b in 0..nb {
                    let peak = (0..n_rows)
                        .map(|r| {
                            let d = cast_q4_0(&rows[r])[b].d;
                            (a[r] as f64 * quant::f16_to_f32(d) as f64).abs()
                        })
                        .fold(0.0, f64::max);
                    for j in 32 * b..32 * (b + 1) {
                        let want = y0[j] as f64
                            + (0..n_rows).map(|r| a[r] as f64 * dq[r][j] as f64).sum::<f64>();
                        let bound = 4.0 * peak / 127.0 * n_rows as f64 + 1e-6 * want.abs().max(1.0);
                        let err = (y[j] as f64 - want).abs();
                        assert!(
                            err <= bound,
                            "{cols} cols, {n_rows} rows, [{j}]: off by {err} > {bound}"
                        );
                    }
                }
            }
        }
    }

    /// The operator with rows long enough for the integer down pass (2048 Q4_0 columns: 1152
    /// bytes): within that pass's rounding of float64 (each selected neuron's coefficient off
    /// by at most half a step of its block's peak / 127, times |q - 8| <= 8), the same bits
    /// bundled and apart and from run to run; where the CPU takes the pass, its rounding shows
    /// (the float axpys land within 1e-5 of float64).
    #[test]
    fn long_rows_take_the_integer_down_pass_within_its_rounding() {
        let (n_ff, n_embd, dtype) = (150, 2048, DType::Q4_0);
        assert!(dtype.row_bytes(n_embd) >= INTEGER_DOWN_ROW_BYTES);
        let (gd, ud) = (matrix(dtype, n_ff, n_embd, 1), matrix(dtype, n_ff, n_embd, 2));
        let dd: Vec<u8> = spread_q4_0_rows(n_ff, n_embd, 3).concat();
        let q = |data| QMatrix { dtype, rows: n_ff, cols: n_embd, data };
        let m = FfnMats {
            gate: Some(q(&gd)),
            up: q(&ud),
            up_bias: None,
            down_t: q(&dd),
            down: None,
            act: FfnActivation::ReGlu,
            bundles: None,
        };
        let mut bundled = vec![0u8; n_ff * m.bundle_bytes()];
        crate::matmul::interleave_rows(&[q(&gd), q(&ud), q(&dd)], &mut bundled);
        let mb = FfnMats { bundles: Some(&bundled), ..m };
        let mut x = Activations::default();
        x.set(&random_vec(n_embd, 5), 1, n_embd);
        let (mut g, mut u) = (vec![0.0; n_ff], vec![0.0; n_ff]);
        matmul_many(&[q(&gd), q(&ud)], &x, &mut [&mut g, &mut u]);
        let integer = crate::simd::avx512_vbmi(simd_level());
        for threads in [1, 3] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            for density in [0.1, 0.5, 1.0] {
                let mut rng = crate::sampler::Rng::new(9);
                let neurons: Vec<u32> =
                    (0..n_ff as u32).filter(|_| rng.next_f32() < density).collect();
                let (mut want, mut peak) = (vec![0.0f64; n_embd], vec![0.0f64; n_embd / 32]);
                let mut row = vec![0.0f32; n_embd];
                let mut used = 0;
                for &j in &neurons {
                    let h = FfnActivation::ReGlu.apply(g[j as usize], u[j as usize]) as f64;
                    used += (h != 0.0) as usize;
                    dequantize_row(dtype, q(&dd).row(j as usize), &mut row);
                    want.iter_mut().zip(&row).for_each(|(w, r)| *w += h * *r as f64);
                    for (b, p) in peak.iter_mut().enumerate() {
                        let d = cast_q4_0(q(&dd).row(j as usize))[b].d;
                        *p = p.max((h * quant::f16_to_f32(d) as f64).abs());
                    }
                }
                let mut scratch = SparseScratch::default();
                let (mut got, mut again, mut apart) =
                    (vec![0.0f32; n_embd], vec![0.0f32; n_embd], vec![0.0f32; n_embd]);
                pool.install(|| {
                    sparse_ffn(&mb, &x, &neurons, None, &mut got, &mut scratch);
                    sparse_ffn(&mb, &x, &neurons, None, &mut again, &mut scratch);
                    sparse_ffn(&m, &x, &neurons, None, &mut apart, &mut scratch);
                });
                let what = format!("{threads} threads, density {density}");
                assert_eq!(got, again, "not deterministic: {what}");
                assert_eq!(got, apart, "bundled differs: {what}");
                let scale = want.iter().map(|v| v.abs()).fold(1e-3, f64::max);
                let mut worst = 0.0f64;
                for (i, (&gi, &wi)) in got.iter().zip(&want).enumerate() {
                    let err = (gi as f64 - wi).abs();
                    let bound = 4.0 * peak[i / 32] / 127.0 * used as f64 + 1e-5 * scale;
                    assert!(err <= bound, "{what} [{i}]: {gi} vs {wi}, off by {err} > {bound}");
                    worst = worst.max(err / scale);
                }
                if integer {
                    assert!(worst > 1e-5, "{what}: no int8 rounding, so no integer pass");
                } else {
                    assert!(worst <= 1e-5, "{what}: float axpys off by {worst}");
                }
            }
        }
    }

    fn cast_q4_0(row: &[u8]) -> &[quant::BlockQ4_0] {
        quant::cast_blocks(row)
    }

    /// The integer down pass's AVX-512 VBMI kernel is its scalar twin bit for bit: group sizes 1
    /// to 32, widths with a short last step of blocks, zero coefficients, an infinite scale (its
    /// block through the float axpy, the others in integers, as the twin) and a NaN coefficient.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn integer_down_pass_is_its_scalar_twin() {
        if !crate::simd::avx512_vbmi(crate::simd::detect()) {
            eprintln!("skipping: no AVX-512 VBMI on this CPU");
            return;
        }
        for cols in [32, 96, 256, 512, 576, 608, 4096] {
            for n_rows in [1, 2, 3, 4, 5, 8, 13, 17, 29, 32] {
                let mut rows = spread_q4_0_rows(n_rows, cols, (7 * cols + n_rows) as u64);
                let mut a = random_vec(n_rows, 11 + n_rows as u64);
                if n_rows > 1 {
                    a[1] = 0.0;
                }
                if n_rows == 5 && cols > 512 {
                    // an infinite scale in block 17
                    rows[3][17 * 18 + 1] = 0x7c;
                    rows[3][17 * 18] = 0;
                }
                if n_rows == 13 && cols == 96 {
                    a[7] = f32::NAN;
                }
                let y0 = random_vec(cols, 5);
                let (mut want, mut got) = (y0.clone(), y0.clone());
                let rr: Vec<&[u8]> = rows.iter().map(|r| &r[..]).collect();
                quant::axpy_group_q4_0_scalar(&rr, &a, &mut want);
                unsafe { crate::avx512::axpy_group_q4_0::<false>(&rr, &a, &mut got, &rr) };
                for j in 0..cols {
                    assert_eq!(
                        want[j].to_bits(),
                        got[j].to_bits(),
                        "{cols} cols, {n_rows} rows, [{j}]: {} scalar, {} AVX-512",
                        want[j],
                        got[j]
                    );
                }
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx512_axpy_matches_scalar() {
        if crate::simd::detect() != SimdLevel::Avx512 {
            eprintln!("skipping: no AVX-512 VNNI on this CPU");
            return;
        }
        for dtype in DType::ALL {
            for n in [32, 64, 96, 576, 4096] {
                if n % dtype.block_len() != 0 {
                    continue;
                }
                let rows: Vec<Vec<u8>> =
                    (0..4).map(|r| any_row(dtype, n, 60 + r + n as u64)).collect();
                let a = [0.5, -1.25, 2.0, 0.125];
                let y0 = random_vec(n, 97);
                let (mut ys, mut y1, mut y4) = (y0.clone(), y0.clone(), y0.clone());
                for r in 0..4 {
                    quant::axpy_scalar(dtype, &rows[r], a[r], &mut ys);
                    axpy(SimdLevel::Avx512, dtype, &rows[r], a[r], &mut y1, &[]);
                }
                let rr = [&rows[0][..], &rows[1][..], &rows[2][..], &rows[3][..]];
                axpy4(SimdLevel::Avx512, dtype, rr, a, &mut y4, &rr);
                for i in 0..n {
                    assert!(
                        (ys[i] - y1[i]).abs() <= 1e-5,
                        "x1 {dtype:?} n={n} i={i}: {} vs {}",
                        ys[i],
                        y1[i]
                    );
                    assert!(
                        (ys[i] - y4[i]).abs() <= 1e-5,
                        "x4 {dtype:?} n={n} i={i}: {} vs {}",
                        ys[i],
                        y4[i]
                    );
                }
            }
        }
        rows_at_once_match_scalar::<8>(SimdLevel::Avx512);
        // float rows whose length is not a multiple of 16 use the scalar tail
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let row = quantize_row(dtype, &random_vec(21, 5));
            let (mut ys, mut yv) = (vec![1.0; 21], vec![1.0; 21]);
            quant::axpy_scalar(dtype, &row, -2.0, &mut ys);
            unsafe { crate::avx512::axpy_rows::<1>(dtype, [&row[..]], [-2.0], &mut yv, &[]) };
            for i in 0..21 {
                assert!((ys[i] - yv[i]).abs() <= 1e-6, "{dtype:?} tail i={i}");
            }
        }
    }

    /// One row's axpy at every SIMD level this CPU has is the scalar axpy's bits for the float
    /// rows, Q8_0 and the chunked types the chunk decoders add one row at a time: a token's
    /// decode adds its neurons' rows through these kernels and a prompt pass through the tiles'
    /// fused multiply-adds (`tiled_axpy`), and a last-bit difference there moves an int8
    /// rounding of a later layer's input. (Q4_0 and Q4_1 fold their offset or table in per
    /// level, Q4_K and Q5_K their minima over the rows; those are held to 1e-5 above.)
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn one_row_axpy_is_the_scalar_bits_at_every_level() {
        let same_bits = |d: DType| {
            !d.is_quantized()
                || d == DType::Q8_0
                || (d.is_chunked() && !matches!(d, DType::Q4_K | DType::Q5_K))
        };
        let levels: Vec<SimdLevel> = [SimdLevel::Avx2, SimdLevel::Avx512]
            .into_iter()
            .filter(|&l| l <= simd_level())
            .collect();
        for &level in &levels {
            for dtype in DType::ALL.into_iter().filter(|&d| same_bits(d)) {
                for n in [32, 96, 256, 576, 4096] {
                    if n % dtype.block_len() != 0 {
                        continue;
                    }
                    let row = any_row(dtype, n, 7 + n as u64);
                    let y0 = random_vec(n, 11);
                    let (mut ys, mut yv) = (y0.clone(), y0.clone());
                    quant::axpy_scalar(dtype, &row, 0.37, &mut ys);
                    axpy(level, dtype, &row, 0.37, &mut yv, &[]);
                    let differ = (0..n).filter(|&i| ys[i].to_bits() != yv[i].to_bits()).count();
                    assert_eq!(differ, 0, "{dtype:?} at {level:?}, n={n}: {differ} values differ");
                }
            }
        }
    }

    /// The fused sparse FFN equals the dense operator (dense gate/up products, the activation,
    /// the selection mask, then a float64 down projection) for every weight type, activation,
    /// selection density and thread count, and gives bit-identical results when repeated.
    /// The predictor inside the operator's pass selects the neurons the two-step path selects
    /// (fc1, relu, fc2 through `matmul`, the cut-off, then `sparse_ffn`) and gives its output up
    /// to float summation order; the same bits from rows apart and bundled, and run to run.
    #[test]
    fn predicted_ffn_equals_the_predictor_then_the_operator() {
        let (n_ff, n_embd, hidden) = (200, 96, 64);
        for threads in [1, 3] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            for dtype in [DType::Q4_0, DType::Q8_0, DType::F16] {
                let (gd, ud, dd) = (
                    matrix(dtype, n_ff, n_embd, 1),
                    matrix(dtype, n_ff, n_embd, 2),
                    matrix(dtype, n_ff, n_embd, 3),
                );
                let (f1, f2) = (matrix(dtype, hidden, n_embd, 4), matrix(dtype, n_ff, hidden, 5));
                let fc1 = QMatrix { dtype, rows: hidden, cols: n_embd, data: &f1 };
                let fc2 = QMatrix { dtype, rows: n_ff, cols: hidden, data: &f2 };
                let m = FfnMats {
                    gate: Some(QMatrix { dtype, rows: n_ff, cols: n_embd, data: &gd }),
                    up: QMatrix { dtype, rows: n_ff, cols: n_embd, data: &ud },
                    up_bias: None,
                    down_t: QMatrix { dtype, rows: n_ff, cols: n_embd, data: &dd },
                    down: None,
                    act: FfnActivation::ReGlu,
                    bundles: None,
                };
                let mut bundled = vec![0u8; n_ff * m.bundle_bytes()];
                crate::matmul::interleave_rows(&[m.gate.unwrap(), m.up, m.down_t], &mut bundled);
                let mb = FfnMats { bundles: Some(&bundled), ..m };
                let (mut x, mut xp) = (Activations::default(), Activations::default());
                x.set_for(&random_vec(n_embd, 6), 1, n_embd, &[m.up]);
                xp.set_for(&random_vec(n_embd, 7), 1, n_embd, &[fc1]);
                // the two steps
                let mut h = vec![0.0f32; hidden];
                let mut logits = vec![0.0f32; n_ff];
                let mut ha = Activations::default();
                pool.install(|| {
                    matmul(&fc1, &xp, &mut h);
                    h.iter_mut().for_each(|v| *v = v.max(0.0));
                    ha.set_for(&h, 1, hidden, &[fc2]);
                    matmul(&fc2, &ha, &mut logits);
                });
                let mut sorted = logits.clone();
                sorted.sort_by(|a, b| a.partial_cmp(b).unwrap());
                for share in [0.0, 0.15, 0.6, 1.0] {
                    // a cut-off between two logits, selecting about `share` of the neurons
                    let i = ((1.0 - share) * n_ff as f64) as usize;
                    let cutoff = if i == 0 {
                        f32::MIN
                    } else if i >= n_ff {
                        f32::MAX
                    } else {
                        0.5 * (sorted[i - 1] + sorted[i])
                    };
                    let neurons: Vec<u32> = (0..n_ff as u32)
                        .filter(|&j| predictor_selects(logits[j as usize], cutoff))
                        .collect();
                    let mut scratch = SparseScratch::default();
                    let (mut want, mut got, mut again, mut from_bundles) = (
                        vec![0.0f32; n_embd],
                        vec![0.0f32; n_embd],
                        vec![0.0; n_embd],
                        vec![0.0; n_embd],
                    );
                    let (want_used, (selected, used)) = pool.install(|| {
                        let want_used = sparse_ffn(&m, &x, &neurons, None, &mut want, &mut scratch);
                        let r =
                            predicted_ffn(&m, &fc1, &fc2, &xp, &x, cutoff, &mut got, &mut scratch);
                        predicted_ffn(&m, &fc1, &fc2, &xp, &x, cutoff, &mut again, &mut scratch);
                        predicted_ffn(
                            &mb,
                            &fc1,
                            &fc2,
                            &xp,
                            &x,
                            cutoff,
                            &mut from_bundles,
                            &mut scratch,
                        );
                        (want_used, r)
                    });
                    let what = format!("{dtype:?}, {threads} threads, {share} selected");
                    assert_eq!((selected, used), (neurons.len(), want_used), "{what}");
                    assert_eq!(got, again, "not deterministic: {what}");
                    assert_eq!(got, from_bundles, "bundled differs: {what}");
                    let scale = want.iter().fold(1e-3f32, |a, v| a.max(v.abs()));
                    for (c, (g, w)) in got.iter().zip(&want).enumerate() {
                        assert!((g - w).abs() <= 1e-5 * scale, "{what}, column {c}: {g} vs {w}");
                    }
                }
            }
        }
    }

    #[test]
    fn sparse_ffn_matches_dense_operator() {
        let (n_ff, n_embd) = (200, 96);
        let acts = [
            FfnActivation::SwiGlu,
            FfnActivation::ReGlu,
            FfnActivation::DReGlu,
            FfnActivation::Relu,
        ];
        for threads in [1, 3] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            for dtype in ALL {
                let (gd, ud, dd) = (
                    matrix(dtype, n_ff, n_embd, 1),
                    matrix(dtype, n_ff, n_embd, 2),
                    matrix(dtype, n_ff, n_embd, 3),
                );
                let gate = QMatrix { dtype, rows: n_ff, cols: n_embd, data: &gd };
                let up = QMatrix { dtype, rows: n_ff, cols: n_embd, data: &ud };
                let down_t = QMatrix { dtype, rows: n_ff, cols: n_embd, data: &dd };
                let bias = random_vec(n_ff, 4);
                let mut x = Activations::default();
                x.set(&random_vec(n_embd, 5), 1, n_embd);
                let (mut g, mut u) = (vec![0.0; n_ff], vec![0.0; n_ff]);
                pool.install(|| matmul_many(&[gate, up], &x, &mut [&mut g, &mut u]));
                for act in acts {
                    let m = FfnMats {
                        gate: act.has_gate().then_some(gate),
                        up,
                        up_bias: (act == FfnActivation::Relu).then_some(&bias[..]),
                        down_t,
                        down: None,
                        act,
                        bundles: None,
                    };
                    // the same rows bundled by neuron: the same bits
                    let mut bundled = vec![0u8; n_ff * m.bundle_bytes()];
                    let parts: Vec<QMatrix> = m.gate.into_iter().chain([up, down_t]).collect();
                    crate::matmul::interleave_rows(&parts, &mut bundled);
                    let mb = FfnMats { bundles: Some(&bundled), ..m };
                    for density in [0.0, 0.1, 0.5, 1.0] {
                        let mut rng = crate::sampler::Rng::new(7);
                        let neurons: Vec<u32> =
                            (0..n_ff as u32).filter(|_| rng.next_f32() < density).collect();
                        // dense reference over the selection
                        let mut want = vec![0.0f64; n_embd];
                        let mut row = vec![0.0f32; n_embd];
                        for &j in &neurons {
                            let j = j as usize;
                            let uj = if m.up_bias.is_some() { u[j] + bias[j] } else { u[j] };
                            let h = act.apply(g[j], uj) as f64;
                            dequantize_row(dtype, down_t.row(j), &mut row);
                            want.iter_mut().zip(&row).for_each(|(w, r)| *w += h * *r as f64);
                        }
                        let mut scratch = SparseScratch::default();
                        let mut got = vec![0.0f32; n_embd];
                        let mut again = vec![0.0f32; n_embd];
                        pool.install(|| {
                            sparse_ffn(&m, &x, &neurons, None, &mut got, &mut scratch);
                            sparse_ffn(&m, &x, &neurons, None, &mut again, &mut scratch);
                        });
                        assert_eq!(got, again, "not deterministic: {dtype:?} {act:?}");
                        pool.install(|| {
                            sparse_ffn(&mb, &x, &neurons, None, &mut again, &mut scratch)
                        });
                        assert_eq!(got, again, "bundled: {dtype:?} {act:?}");
                        let scale = want.iter().map(|v| v.abs()).fold(1e-3, f64::max);
                        for i in 0..n_embd {
                            let err = (got[i] as f64 - want[i]).abs() / scale;
                            assert!(
                                err < 1e-5,
                                "{dtype:?} {act:?} density {density} t{threads} [{i}]: {} vs {}",
                                got[i],
                                want[i]
                            );
                        }
                        // precomputed gate values give the same result
                        if act.has_gate() {
                            let mut pre = vec![0.0f32; n_embd];
                            pool.install(|| {
                                sparse_ffn(&m, &x, &neurons, Some(&g), &mut pre, &mut scratch)
                            });
                            assert_eq!(pre, got);
                            pool.install(|| {
                                sparse_ffn(&mb, &x, &neurons, Some(&g), &mut pre, &mut scratch)
                            });
                            assert_eq!(pre, got, "bundled, gate given: {dtype:?} {act:?}");
                        }
                    }
                }
            }
        }
    }

    /// Selections of at least `DENSE_FRACTION` of the neurons go through the dense kernels when
    /// the row-major down matrix is given: the result equals a float64 product of the
    /// dequantized down matrix with the masked activations (gate and up from the tested dense
    /// products, rounded to int8 blocks as the down product reads them for quantized weights).
    #[test]
    fn dense_selections_use_the_dense_kernels() {
        let (n_ff, n_embd) = (160, 64);
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        for dtype in [DType::F32, DType::F16, DType::Q8_0, DType::Q4_0] {
            let (gd, ud, dd) = (
                matrix(dtype, n_ff, n_embd, 31),
                matrix(dtype, n_ff, n_embd, 32),
                matrix(dtype, n_embd, n_ff, 33),
            );
            let gate = QMatrix { dtype, rows: n_ff, cols: n_embd, data: &gd };
            let up = QMatrix { dtype, rows: n_ff, cols: n_embd, data: &ud };
            let down = QMatrix { dtype, rows: n_embd, cols: n_ff, data: &dd };
            // down_t holds other numbers on purpose: the dense path must not read it
            let junk = matrix(dtype, n_ff, n_embd, 34);
            let down_t = QMatrix { dtype, rows: n_ff, cols: n_embd, data: &junk };
            let mut x = Activations::default();
            x.set(&random_vec(n_embd, 35), 1, n_embd);
            let (mut g, mut u) = (vec![0.0f32; n_ff], vec![0.0f32; n_ff]);
            pool.install(|| matmul_many(&[gate, up], &x, &mut [&mut g, &mut u]));
            for act in [FfnActivation::SwiGlu, FfnActivation::ReGlu] {
                let m = FfnMats {
                    gate: Some(gate),
                    up,
                    up_bias: None,
                    down_t,
                    down: Some(down),
                    act,
                    bundles: None,
                };
                for skip_every in [0usize, 11] {
                    let neurons: Vec<u32> = (0..n_ff as u32)
                        .filter(|&j| skip_every == 0 || j as usize % skip_every != 3)
                        .collect();
                    assert!(neurons.len() as f64 >= DENSE_FRACTION * n_ff as f64);
                    let mut got = vec![0.0f32; n_embd];
                    let mut scratch = SparseScratch::default();
                    let used =
                        pool.install(|| sparse_ffn(&m, &x, &neurons, None, &mut got, &mut scratch));
                    let mut h = vec![0.0f32; n_ff];
                    for &j in &neurons {
                        h[j as usize] = act.apply(g[j as usize], u[j as usize]);
                    }
                    assert_eq!(used, h.iter().filter(|v| **v != 0.0).count());
                    if dtype.is_quantized() {
                        let mut blocks = vec![crate::quant::BlockQ8Act::default(); n_ff / 32];
                        quant::quantize_act(&h, &mut blocks);
                        for (hb, b) in h.chunks_mut(32).zip(&blocks) {
                            hb.iter_mut().zip(b.qs).for_each(|(v, q)| *v = b.d * q as f32);
                        }
                    }
                    let mut w = vec![0.0f32; n_ff];
                    for c in 0..n_embd {
                        down.dequantize_row(c, &mut w);
                        let want: f64 = w.iter().zip(&h).map(|(a, b)| *a as f64 * *b as f64).sum();
                        let scale: f64 = w
                            .iter()
                            .zip(&h)
                            .map(|(a, b)| (*a as f64 * *b as f64).abs())
                            .sum::<f64>()
                            .max(1e-6);
                        assert!(
                            (got[c] as f64 - want).abs() <= 1e-5 * scale,
                            "{dtype:?} {act:?} [{c}]: {} vs {want}",
                            got[c]
                        );
                    }
                }
            }
        }
    }

    /// The batched column-split down projection equals a float64 product.
    /// The register-tiled axpy equals its scalar twin bit for bit at every SIMD level this CPU
    /// has, for token counts around each pass size and widths with a column tail.
    #[test]
    fn tiled_axpy_equals_scalar_twin() {
        let mut levels = vec![SimdLevel::Scalar];
        if crate::simd::detect().has_avx2() {
            levels.push(SimdLevel::Avx2);
        }
        if crate::simd::detect() == SimdLevel::Avx512 {
            levels.push(SimdLevel::Avx512);
        }
        let (n_ff, stride) = (50, 100);
        let neurons: Vec<u32> = vec![3, 4, 9, 17, 30, 49];
        for n in [1, 3, 8, 15, 16, 17, 37] {
            let ht = random_vec(n_ff * n, 21 + n as u64);
            for width in [16, 40, 64, 96] {
                let w = random_vec(neurons.len() * width, 5 + width as u64);
                let y0 = random_vec(n * stride, 8);
                let mut want = y0.clone();
                // SAFETY: n rows of `stride` >= width, owned here
                unsafe {
                    tiled_axpy_scalar(
                        &w,
                        width,
                        &ht,
                        n,
                        &neurons,
                        0,
                        n,
                        want.as_mut_ptr(),
                        stride,
                        0..width,
                    )
                };
                for &level in &levels {
                    let mut got = y0.clone();
                    // SAFETY: as above; `levels` holds what this CPU has
                    unsafe {
                        tiled_axpy(level, &w, width, &ht, n, &neurons, got.as_mut_ptr(), stride)
                    };
                    for i in 0..n * stride {
                        assert_eq!(
                            got[i].to_bits(),
                            want[i].to_bits(),
                            "{level:?} n={n} width={width} [{i}]"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn down_t_matmul_matches_float64() {
        let (n_ff, n_embd) = (70, 160);
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
        for dtype in ALL {
            let dd = matrix(dtype, n_ff, n_embd, 11);
            let down_t = QMatrix { dtype, rows: n_ff, cols: n_embd, data: &dd };
            for n in [1, 5, 40] {
                let mut h = random_vec(n * n_ff, 12);
                // a sparse pattern: some neurons zero for all tokens, some for a few, some
                // for most (those go through `tiled_axpy` from 10 of 40 tokens up)
                for (i, v) in h.iter_mut().enumerate() {
                    let j = i % n_ff;
                    if j % 3 == 0 || (j % 3 == 1 && i % 7 != 0) {
                        *v = 0.0;
                    }
                }
                let mut out = vec![f32::NAN; n * n_embd];
                let mut scratch = SparseScratch::default();
                pool.install(|| down_t_matmul(&down_t, &h, n, &mut out, &mut scratch));
                let mut row = vec![0.0f32; n_embd];
                let mut want = vec![0.0f64; n * n_embd];
                for j in 0..n_ff {
                    dequantize_row(dtype, down_t.row(j), &mut row);
                    for t in 0..n {
                        for c in 0..n_embd {
                            want[t * n_embd + c] += h[t * n_ff + j] as f64 * row[c] as f64;
                        }
                    }
                }
                for i in 0..n * n_embd {
                    assert!(
                        (out[i] as f64 - want[i]).abs() < 1e-4,
                        "{dtype:?} n={n} [{i}]: {} vs {}",
                        out[i],
                        want[i]
                    );
                }
            }
        }
    }
}
