//! Matrices with sixteen rows interleaved, a row per 32-bit lane: the layout the CPU's products
//! read a mixture of experts' Q4_0, Q4_K and MXFP4 experts in (as llama.cpp's CPU backend
//! repacks Q4_0 and Q4_K into `q4_0_8x8` and `q4_K_8x8` at load). In the file's layout a one-token product reads four
//! rows per kernel call, each block's bytes after its scales, and spends about a third of its
//! instructions gathering the bytes out of the blocks and summing each row's lanes; here
//! sixteen rows' bytes lie side by side, so one 512-bit load holds four bytes of every row, one
//! `vpdpbusd` with four activations broadcast serves the sixteen rows, and a block's float step
//! is one vector. A product reads one stream instead of four.
//!
//! A matrix (rows a multiple of 16, columns a multiple of the type's `step_cols`) is held group
//! by group: group g holds rows 16g..16g + 16, step by step, each step a type's `step_cols`
//! columns of the sixteen rows, starting on a 64-byte line.
//!
//! Q4_0, a step of four blocks, 1152 bytes, the file's size: for block c and chunk k (bytes
//! 4k..4k + 4 of a block's 16), sixteen u32 (row r's four bytes in lane r) at 64 (4c + k), then
//! the blocks' f16 scales, sixteen per block, at 1024 + 32c.
//!
//! Q4_K, a step of one super-block, 2368 bytes (the file's 2304 and the 6-bit scales and minima
//! unpacked): line l (bytes 4l..4l + 4 of each row's 128 bytes of quants: low nibbles of
//! sub-block 2 (l / 8), high ones of the next) at 64l; sub-block j's scales, a byte per row, at
//! 2048 + 16j; the minima of sub-blocks 2k and 2k + 1, a byte pair per row, at 2176 + 32k; the
//! rows' f16 d at 2304 and dmin at 2336.
//!
//! MXFP4, as Q4_0 with its blocks' E8M0 exponents for scales (a byte per row and block, block
//! c's at 1024 + 16c), the file's size; a row of an odd number of block pairs ends in a half
//! step of two blocks (544 bytes: quants at 64 (4c + k), exponents at 512 + 16c), as gpt-oss's
//! 2880 columns (90 blocks) do.
//!
//! The arithmetic is the file layout's kernels' at each level lane for lane: a block's products
//! summed exactly in integers, then the level's float steps (`FloatSteps` for Q4_0 and MXFP4,
//! `q256::block_step` for Q4_K); so a row's dot is bit for bit the one the file's layout gives at
//! that level, and the same in a prompt as alone.

use super::chunks::{e8m0_half, k4_scales, BlockMXFP4, BlockQ4K, MXFP4_VALUES};
use super::q256::{block_step, BlockQ8K};
use super::{f16_to_f32, BlockQ4_0, BlockQ8Act, DType, QK, QK_K};

/// Rows per group.
pub const GROUP_ROWS: usize = 16;
/// Q4_0's blocks per step.
pub const STEP_BLOCKS: usize = 4;
/// Q4_0's bytes per step: four blocks of sixteen rows, their quants then their scales.
pub const STEP_BYTES: usize = STEP_BLOCKS * GROUP_ROWS * std::mem::size_of::<BlockQ4_0>();
const SCALES_AT: usize = STEP_BLOCKS * GROUP_ROWS * QK / 2;
const _: () = assert!(STEP_BYTES == 1152 && SCALES_AT == 1024);

/// Where a Q4_K step holds its parts (module comment).
pub const K4_SCALES_AT: usize = GROUP_ROWS * QK_K / 2;
pub const K4_MINS_AT: usize = K4_SCALES_AT + 8 * GROUP_ROWS;
pub const K4_D_AT: usize = K4_MINS_AT + 8 * GROUP_ROWS;
pub const K4_DMIN_AT: usize = K4_D_AT + 2 * GROUP_ROWS;
/// Q4_K's bytes per step.
pub const K4_STEP_BYTES: usize = K4_DMIN_AT + 2 * GROUP_ROWS;
const _: () = assert!(K4_SCALES_AT == 2048 && K4_STEP_BYTES == 2368);
const _: () = assert!(std::mem::size_of::<BlockQ4K>() * GROUP_ROWS == K4_STEP_BYTES - 64);

/// MXFP4's bytes per step of four blocks (a half step, the last of a row of an odd number of
/// block pairs, takes half).
pub const MX_STEP_BYTES: usize = STEP_BLOCKS * GROUP_ROWS * std::mem::size_of::<BlockMXFP4>();
const _: () = assert!(MX_STEP_BYTES == 1088);

/// A type's interleaved layout: its columns and bytes per step of sixteen rows, and what the
/// columns must be a multiple of (a step's, or half of it where the last step may be a half).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    pub dtype: DType,
    pub step_cols: usize,
    pub step_bytes: usize,
    pub cols_multiple: usize,
}

/// The types with an interleaved layout.
pub const LAYOUTS: [Layout; 3] = [
    Layout {
        dtype: DType::Q4_0,
        step_cols: QK * STEP_BLOCKS,
        step_bytes: STEP_BYTES,
        cols_multiple: QK * STEP_BLOCKS,
    },
    Layout { dtype: DType::Q4_K, step_cols: QK_K, step_bytes: K4_STEP_BYTES, cols_multiple: QK_K },
    Layout {
        dtype: DType::MXFP4,
        step_cols: QK * STEP_BLOCKS,
        step_bytes: MX_STEP_BYTES,
        cols_multiple: 2 * QK,
    },
];

/// `dtype`'s interleaved layout, if it has one.
pub fn layout(dtype: DType) -> Option<Layout> {
    LAYOUTS.into_iter().find(|l| l.dtype == dtype)
}

/// Whether a (rows, cols) matrix of `dtype` has an interleaved layout: a type that has one,
/// whole groups of rows and whole steps of columns.
pub fn fits(dtype: DType, rows: usize, cols: usize) -> bool {
    layout(dtype).is_some_and(|l| {
        rows.is_multiple_of(GROUP_ROWS) && cols.is_multiple_of(l.cols_multiple) && cols > 0
    })
}

/// Bytes of one group of a matrix of `cols` columns (`fits`).
pub fn group_bytes(dtype: DType, cols: usize) -> usize {
    let l = layout(dtype).expect("a type with an interleaved layout");
    // (a half step last where the columns are an odd number of half steps)
    cols / l.step_cols * l.step_bytes + cols % l.step_cols * l.step_bytes / l.step_cols
}

/// The blocks of MXFP4 step s of a row of `blocks` blocks: four, or two in a last half step.
pub fn mx_step_blocks(blocks: usize, s: usize) -> usize {
    (blocks - STEP_BLOCKS * s).min(STEP_BLOCKS)
}

/// Bytes of a (rows, cols) matrix of `dtype` interleaved (`fits`).
pub fn matrix_bytes(dtype: DType, rows: usize, cols: usize) -> usize {
    rows / GROUP_ROWS * group_bytes(dtype, cols)
}

/// A matrix (rows, cols) of `dtype` in its interleaved layout.
#[derive(Clone, Copy)]
pub struct Interleaved<'a> {
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    pub data: &'a [u8],
}

impl<'a> Interleaved<'a> {
    pub fn new(dtype: DType, rows: usize, cols: usize, data: &'a [u8]) -> Interleaved<'a> {
        assert!(
            fits(dtype, rows, cols),
            "a {rows} x {cols} {dtype:?} matrix has no interleaved layout"
        );
        assert_eq!(data.len(), matrix_bytes(dtype, rows, cols), "interleaved matrix size");
        Interleaved { dtype, rows, cols, data }
    }

    pub fn groups(&self) -> usize {
        self.rows / GROUP_ROWS
    }

    /// Group g's bytes (rows 16g..16g + 16).
    pub fn group(&self, g: usize) -> &'a [u8] {
        let b = group_bytes(self.dtype, self.cols);
        &self.data[g * b..(g + 1) * b]
    }

    /// Rows r0..r1 (multiples of 16) as a matrix of their own.
    pub fn rows_range(&self, r0: usize, r1: usize) -> Interleaved<'a> {
        assert!(r0.is_multiple_of(GROUP_ROWS) && r1.is_multiple_of(GROUP_ROWS) && r0 <= r1);
        let b = group_bytes(self.dtype, self.cols);
        let data = &self.data[r0 / GROUP_ROWS * b..r1 / GROUP_ROWS * b];
        Interleaved::new(self.dtype, r1 - r0, self.cols, data)
    }
}

/// Writes the rows `src` (rows, cols of `dtype`; `fits`) into `out` (`matrix_bytes`)
/// interleaved.
pub fn interleave(dtype: DType, src: &[u8], rows: usize, cols: usize, out: &mut [u8]) {
    assert!(
        fits(dtype, rows, cols),
        "a {rows} x {cols} {dtype:?} matrix has no interleaved layout"
    );
    assert_eq!(src.len(), rows * dtype.row_bytes(cols), "{dtype:?} matrix size");
    assert_eq!(out.len(), matrix_bytes(dtype, rows, cols), "interleaved matrix size");
    let row_bytes = dtype.row_bytes(cols);
    let l = layout(dtype).expect("fits");
    for (g, group) in out.chunks_exact_mut(group_bytes(dtype, cols)).enumerate() {
        if dtype == DType::MXFP4 {
            for r in 0..GROUP_ROWS {
                let row = &src[(GROUP_ROWS * g + r) * row_bytes..][..row_bytes];
                interleave_mxfp4(row, r, group);
            }
            continue;
        }
        for (s, step) in group.chunks_exact_mut(l.step_bytes).enumerate() {
            for r in 0..GROUP_ROWS {
                let row = &src[(GROUP_ROWS * g + r) * row_bytes..][..row_bytes];
                match dtype {
                    DType::Q4_0 => interleave_q4_0(row, s, r, step),
                    _ => interleave_q4_k(row, s, r, step),
                }
            }
        }
    }
}

/// Row r's blocks of Q4_0 step s into `step`.
fn interleave_q4_0(row: &[u8], s: usize, r: usize, step: &mut [u8]) {
    for c in 0..STEP_BLOCKS {
        let blk = &row[(STEP_BLOCKS * s + c) * 18..][..18];
        let (d, qs) = blk.split_at(2);
        for k in 0..4 {
            let at = 64 * (4 * c + k) + 4 * r;
            step[at..at + 4].copy_from_slice(&qs[4 * k..4 * k + 4]);
        }
        let at = SCALES_AT + 32 * c + 2 * r;
        step[at..at + 2].copy_from_slice(d);
    }
}

/// Row r's blocks (MXFP4) into its group.
fn interleave_mxfp4(row: &[u8], r: usize, group: &mut [u8]) {
    let blocks = super::cast_blocks::<BlockMXFP4>(row);
    for (b, blk) in blocks.iter().enumerate() {
        let (s, c) = (b / STEP_BLOCKS, b % STEP_BLOCKS);
        let step = &mut group[s * MX_STEP_BYTES..];
        for k in 0..4 {
            step[64 * (4 * c + k) + 4 * r..][..4].copy_from_slice(&blk.qs[4 * k..4 * k + 4]);
        }
        step[256 * mx_step_blocks(blocks.len(), s) + 16 * c + r] = blk.e;
    }
}

/// Row r's super-block s (Q4_K) into `step`.
fn interleave_q4_k(row: &[u8], s: usize, r: usize, step: &mut [u8]) {
    let blk = &super::cast_blocks::<BlockQ4K>(row)[s];
    for l in 0..QK_K / 8 {
        step[64 * l + 4 * r..][..4].copy_from_slice(&blk.qs[4 * l..4 * l + 4]);
    }
    // (an array: this runs for every row and super-block of every expert at load)
    let words = k4_scales(&blk.scales);
    let sm: [u8; 16] = std::array::from_fn(|i| words[i / 4].to_le_bytes()[i % 4]);
    for j in 0..8 {
        step[K4_SCALES_AT + 16 * j + r] = sm[j];
        step[K4_MINS_AT + 32 * (j / 2) + 2 * r + j % 2] = sm[8 + j];
    }
    step[K4_D_AT + 2 * r..][..2].copy_from_slice(&blk.d.to_le_bytes());
    step[K4_DMIN_AT + 2 * r..][..2].copy_from_slice(&blk.dmin.to_le_bytes());
}

/// Row r of a group's step: block c's scale bits and its 16 bytes of quants, as the file holds
/// them (`interleave`'s inverse, for the scalar twin and the tests).
pub fn block_of(step: &[u8], r: usize, c: usize) -> (u16, [u8; 16]) {
    let at = SCALES_AT + 32 * c + 2 * r;
    let d = u16::from_le_bytes([step[at], step[at + 1]]);
    let mut qs = [0u8; 16];
    for k in 0..4 {
        let at = 64 * (4 * c + k) + 4 * r;
        qs[4 * k..4 * k + 4].copy_from_slice(&step[at..at + 4]);
    }
    (d, qs)
}

/// How a level's kernels take a row's float steps from its blocks' exact sums (those of the
/// file layout's kernels at that level, so that both layouts give the same bits).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FloatSteps {
    /// AVX-512 (`avx512::dot_steps`): p_c = sum_c * (d_c * d_a,c), acc += (p_0 + p_1) +
    /// (p_2 + p_3) per four blocks.
    SumOfFour,
    /// AVX2 and AVX-VNNI (`avx2::dot_legacy`): acc = fma(sum_c, d_c * d_a,c, acc) per block.
    FmaPerBlock,
}

/// Scalar twin of the SIMD kernels: the sixteen rows of `group` against one token's activation
/// blocks `x` (cols / 32), each block's products summed exactly, then `steps`.
pub fn dot_group_scalar(group: &[u8], x: &[BlockQ8Act], steps: FloatSteps) -> [f32; GROUP_ROWS] {
    let mut out = [0.0f32; GROUP_ROWS];
    for (s, step) in group.chunks_exact(STEP_BYTES).enumerate() {
        for (r, acc) in out.iter_mut().enumerate() {
            let mut p = [0.0f32; STEP_BLOCKS];
            for (c, p) in p.iter_mut().enumerate() {
                let (d, qs) = block_of(step, r, c);
                let a = &x[STEP_BLOCKS * s + c];
                let mut sum = 0i32;
                for (i, &q) in qs.iter().enumerate() {
                    sum += ((q & 15) as i32 - 8) * a.qs[i] as i32;
                    sum += ((q >> 4) as i32 - 8) * a.qs[i + 16] as i32;
                }
                let dd = f16_to_f32(d) * a.d;
                match steps {
                    FloatSteps::SumOfFour => *p = sum as f32 * dd,
                    FloatSteps::FmaPerBlock => *acc = (sum as f32).mul_add(dd, *acc),
                }
            }
            if steps == FloatSteps::SumOfFour {
                *acc += (p[0] + p[1]) + (p[2] + p[3]);
            }
        }
    }
    out
}

/// Row r's block c of MXFP4 step s of a group of `blocks` blocks per row, as the file holds
/// it (`interleave`'s inverse).
pub fn mx_block_of(group: &[u8], blocks: usize, s: usize, r: usize, c: usize) -> BlockMXFP4 {
    let step = &group[s * MX_STEP_BYTES..];
    BlockMXFP4 {
        e: step[256 * mx_step_blocks(blocks, s) + 16 * c + r],
        qs: std::array::from_fn(|i| step[64 * (4 * c + i / 4) + 4 * r + i % 4]),
    }
}

/// Scalar twin of the MXFP4 kernels: the sixteen rows of `group` against one token's activation
/// blocks `x` (cols / 32), each block's products summed exactly, then `steps` (a half step's
/// two blocks summed as a pair, what a zero-padded step of four gives).
pub fn dot_group_mx_scalar(group: &[u8], x: &[BlockQ8Act], steps: FloatSteps) -> [f32; GROUP_ROWS] {
    let blocks = x.len();
    let mut out = [0.0f32; GROUP_ROWS];
    for s in 0..blocks.div_ceil(STEP_BLOCKS) {
        let n = mx_step_blocks(blocks, s);
        for (r, acc) in out.iter_mut().enumerate() {
            let mut p = [0.0f32; STEP_BLOCKS];
            for (c, p) in p.iter_mut().enumerate().take(n) {
                let blk = mx_block_of(group, blocks, s, r, c);
                let a = &x[STEP_BLOCKS * s + c];
                let mut sum = 0i32;
                for (i, &q) in blk.qs.iter().enumerate() {
                    sum += MXFP4_VALUES[(q & 15) as usize] as i32 * a.qs[i] as i32;
                    sum += MXFP4_VALUES[(q >> 4) as usize] as i32 * a.qs[i + 16] as i32;
                }
                let dd = e8m0_half(blk.e) * a.d;
                match steps {
                    FloatSteps::SumOfFour => *p = sum as f32 * dd,
                    FloatSteps::FmaPerBlock => *acc = (sum as f32).mul_add(dd, *acc),
                }
            }
            if steps == FloatSteps::SumOfFour {
                *acc += (p[0] + p[1]) + (p[2] + p[3]);
            }
        }
    }
    out
}

/// Row r of a Q4_K step as the file's block holds it, its scales and minima unpacked
/// (`interleave`'s inverse, for the scalar twin and the tests): (d, dmin, scales, minima, qs).
pub fn k4_block_of(step: &[u8], r: usize) -> (u16, u16, [u8; 8], [u8; 8], [u8; QK_K / 2]) {
    let f16_at = |at: usize| u16::from_le_bytes([step[at + 2 * r], step[at + 2 * r + 1]]);
    let scales = std::array::from_fn(|j| step[K4_SCALES_AT + 16 * j + r]);
    let mins = std::array::from_fn(|j| step[K4_MINS_AT + 32 * (j / 2) + 2 * r + j % 2]);
    let qs = std::array::from_fn(|i| step[64 * (i / 4) + 4 * r + i % 4]);
    (f16_at(K4_D_AT), f16_at(K4_DMIN_AT), scales, mins, qs)
}

/// Scalar twin of the Q4_K kernels: the sixteen rows of `group` against one token's activations
/// `x` (cols / 256), per super-block the exact sums of scale * q * a and of min * a (from
/// `bsums32`), then `q256::block_step`, as `q256::dot_scalar`.
pub fn dot_group_k4_scalar(group: &[u8], x: &[BlockQ8K]) -> [f32; GROUP_ROWS] {
    let mut out = [0.0f32; GROUP_ROWS];
    for (step, a) in group.chunks_exact(K4_STEP_BYTES).zip(x) {
        for (r, acc) in out.iter_mut().enumerate() {
            let (d, dmin, scales, mins, qs) = k4_block_of(step, r);
            let (mut sums, mut min_sums) = (0i32, 0i32);
            for j in 0..8 {
                // sub-block j: the low (j even) or high nibbles of bytes 32 (j / 2)..+32
                let dot: i32 = (0..32)
                    .map(|i| {
                        let q = qs[32 * (j / 2) + i];
                        let q = if j % 2 == 0 { q & 15 } else { q >> 4 };
                        q as i32 * a.qs[32 * j + i] as i32
                    })
                    .sum();
                sums += scales[j] as i32 * dot;
                min_sums += mins[j] as i32 * a.bsums32[j] as i32;
            }
            *acc = block_step(true, *acc, sums, min_sums, f16_to_f32(d), f16_to_f32(dmin), a.d);
        }
    }
    out
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::quant::{quantize_act, quantize_row, DType};
    use crate::sampler::Rng;

    fn random(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = Rng::new(seed);
        (0..n).map(|_| rng.next_f32() * 2.0 - 1.0).collect()
    }

    #[test]
    fn interleaving_moves_every_block_and_scale_once() {
        let (rows, cols) = (32, 256);
        let src: Vec<u8> = random(rows * cols, 1)
            .chunks(cols)
            .flat_map(|r| quantize_row(DType::Q4_0, r))
            .collect();
        let mut out = vec![0u8; src.len()];
        interleave(DType::Q4_0, &src, rows, cols, &mut out);
        let m = Interleaved::new(DType::Q4_0, rows, cols, &out);
        for r in 0..rows {
            for b in 0..cols / QK {
                let step = &m.group(r / 16)[b / 4 * STEP_BYTES..][..STEP_BYTES];
                let (d, qs) = block_of(step, r % 16, b % 4);
                let blk = &src[r * (cols / QK) * 18 + b * 18..][..18];
                assert_eq!(d.to_le_bytes(), blk[..2], "row {r} block {b}: scale");
                assert_eq!(qs, blk[2..], "row {r} block {b}: quants");
            }
        }
    }

    #[test]
    fn the_scalar_twin_is_the_float64_dot_within_rounding() {
        // the twin against the blocks' dequantized values times the activations' in f64
        let (rows, cols) = (16, 512);
        let w = random(rows * cols, 2);
        let src: Vec<u8> = w.chunks(cols).flat_map(|r| quantize_row(DType::Q4_0, r)).collect();
        let mut out = vec![0u8; src.len()];
        interleave(DType::Q4_0, &src, rows, cols, &mut out);
        let x = random(cols, 3);
        let mut q8 = vec![BlockQ8Act::default(); cols / QK];
        quantize_act(&x, &mut q8);
        for steps in [FloatSteps::SumOfFour, FloatSteps::FmaPerBlock] {
            let got = dot_group_scalar(&out, &q8, steps);
            for r in 0..rows {
                let mut deq = vec![0.0f32; cols];
                crate::quant::dequantize_row(
                    DType::Q4_0,
                    &src[r * cols / QK * 18..][..cols / QK * 18],
                    &mut deq,
                );
                let want: f64 = (0..cols)
                    .map(|i| deq[i] as f64 * (q8[i / QK].qs[i % QK] as f64 * q8[i / QK].d as f64))
                    .sum();
                let scale: f64 = (0..cols).map(|i| (deq[i] as f64 * x[i] as f64).abs()).sum();
                assert!(
                    (got[r] as f64 - want).abs() <= 1e-5 * scale,
                    "row {r}: {} vs {want}",
                    got[r]
                );
            }
        }
    }

    /// Random rows (rows, cols) of Q4_K (`chunks::tests::random_row`), the first with every
    /// quant, scale and minimum at its largest.
    pub(crate) fn k_rows(dtype: DType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
        let mut src: Vec<u8> = (0..rows)
            .flat_map(|r| crate::quant::chunks::tests::random_row(dtype, cols, seed + r as u64))
            .collect();
        for blk in src[..dtype.row_bytes(cols)].chunks_exact_mut(dtype.block_bytes()) {
            blk[4..].fill(0xFF);
        }
        src
    }

    #[test]
    fn q4_k_interleaving_moves_every_quant_scale_and_minimum_once() {
        let (rows, cols) = (32, 512);
        let src = k_rows(DType::Q4_K, rows, cols, 4);
        let mut out = vec![0u8; matrix_bytes(DType::Q4_K, rows, cols)];
        interleave(DType::Q4_K, &src, rows, cols, &mut out);
        let m = Interleaved::new(DType::Q4_K, rows, cols, &out);
        let blocks = crate::quant::cast_blocks::<BlockQ4K>(&src);
        for r in 0..rows {
            for b in 0..cols / QK_K {
                let step = &m.group(r / 16)[b * K4_STEP_BYTES..][..K4_STEP_BYTES];
                let (d, dmin, scales, mins, qs) = k4_block_of(step, r % 16);
                let blk = &blocks[r * cols / QK_K + b];
                let sm: Vec<u8> =
                    k4_scales(&blk.scales).iter().flat_map(|w| w.to_le_bytes()).collect();
                assert_eq!((d, dmin), (blk.d, blk.dmin), "row {r} block {b}: d, dmin");
                assert_eq!(scales[..], sm[..8], "row {r} block {b}: scales");
                assert_eq!(mins[..], sm[8..], "row {r} block {b}: minima");
                assert_eq!(qs, blk.qs, "row {r} block {b}: quants");
            }
        }
    }

    #[test]
    fn the_q4_k_twin_is_the_file_layouts_scalar_dot_bit_for_bit() {
        // `q256::dot_scalar` is held to the float64 dot of the dequantized rows (its tests)
        for (rows, cols) in [(16, 256), (32, 2048), (16, 768)] {
            let src = k_rows(DType::Q4_K, rows, cols, rows as u64 + cols as u64);
            let mut out = vec![0u8; matrix_bytes(DType::Q4_K, rows, cols)];
            interleave(DType::Q4_K, &src, rows, cols, &mut out);
            let m = Interleaved::new(DType::Q4_K, rows, cols, &out);
            let mut x = random(cols, 7);
            x[..64].iter_mut().for_each(|v| *v *= 1e3);
            let mut q8k = vec![BlockQ8K::default(); cols / QK_K];
            crate::quant::q256::quantize_act_k(&x, &mut q8k);
            let row_bytes = DType::Q4_K.row_bytes(cols);
            for g in 0..rows / GROUP_ROWS {
                let got = dot_group_k4_scalar(m.group(g), &q8k);
                for (i, got) in got.into_iter().enumerate() {
                    let r = GROUP_ROWS * g + i;
                    let row = &src[r * row_bytes..(r + 1) * row_bytes];
                    let [want] = crate::quant::q256::dot_scalar(DType::Q4_K, row, [&q8k]);
                    assert_eq!(
                        got.to_bits(),
                        want.to_bits(),
                        "{rows}x{cols} row {r}: {got} vs {want}"
                    );
                }
            }
        }
    }

    #[test]
    fn mxfp4_interleaving_moves_every_block_once_and_its_twin_is_the_file_layouts_dot() {
        // 90 blocks a row (gpt-oss's 2880 columns) end in a half step
        for (rows, cols) in [(16, 128), (32, 2880), (16, 64)] {
            let src: Vec<u8> = (0..rows)
                .flat_map(|r| crate::quant::chunks::tests::random_row(DType::MXFP4, cols, r as u64))
                .collect();
            let mut out = vec![0u8; matrix_bytes(DType::MXFP4, rows, cols)];
            assert_eq!(out.len(), src.len(), "the file's size");
            interleave(DType::MXFP4, &src, rows, cols, &mut out);
            let m = Interleaved::new(DType::MXFP4, rows, cols, &out);
            let nb = cols / QK;
            let blocks = crate::quant::cast_blocks::<BlockMXFP4>(&src);
            for r in 0..rows {
                for b in 0..nb {
                    let got = mx_block_of(m.group(r / 16), nb, b / 4, r % 16, b % 4);
                    let want = &blocks[r * nb + b];
                    assert_eq!(
                        (got.e, got.qs),
                        (want.e, want.qs),
                        "{rows}x{cols} row {r} block {b}"
                    );
                }
            }
            let mut x = random(cols, 12);
            x[..32].iter_mut().for_each(|v| *v *= 1e3);
            let mut q8 = vec![BlockQ8Act::default(); nb];
            crate::quant::quantize_act(&x, &mut q8);
            // against the dequantized rows times the activations' values in f64
            let row_bytes = DType::MXFP4.row_bytes(cols);
            for steps in [FloatSteps::SumOfFour, FloatSteps::FmaPerBlock] {
                for g in 0..rows / GROUP_ROWS {
                    let got = dot_group_mx_scalar(m.group(g), &q8, steps);
                    for (i, got) in got.into_iter().enumerate() {
                        let r = GROUP_ROWS * g + i;
                        let mut deq = vec![0.0f32; cols];
                        let row = &src[r * row_bytes..(r + 1) * row_bytes];
                        crate::quant::dequantize_row(DType::MXFP4, row, &mut deq);
                        let act = |i: usize| q8[i / QK].qs[i % QK] as f64 * q8[i / QK].d as f64;
                        let want: f64 = (0..cols).map(|i| deq[i] as f64 * act(i)).sum();
                        let scale: f64 = (0..cols).map(|i| (deq[i] as f64 * act(i)).abs()).sum();
                        let at = format!("{steps:?} {rows}x{cols} row {r}");
                        assert!((got as f64 - want).abs() <= 1e-5 * scale, "{at}: {got} vs {want}");
                    }
                }
            }
        }
    }
}
