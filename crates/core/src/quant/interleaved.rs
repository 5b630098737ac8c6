//! Q4_0 matrices with sixteen rows interleaved, a row per 32-bit lane: the layout the CPU's
//! products read a mixture of experts' Q4_0 experts in (as llama.cpp's CPU backend
//! repacks them into `q4_0_8x8` at load). In the file's layout a one-token product reads four
//! rows per kernel call, each block's 16 bytes after its 2-byte scale, and spends about a
//! third of its instructions gathering the bytes out of the 18-byte blocks and summing each
//! row's lanes; here sixteen rows' bytes lie side by side, so one 512-bit load holds four bytes
//! of every row, one `vpdpbusd` with four activations broadcast serves the sixteen rows, and a
//! block's float step is one vector. A product reads one stream instead of four.
//!
//! Layout of a matrix (rows a multiple of 16, blocks per row a multiple of 4): group g holds
//! rows 16g..16g + 16, step by step; step s holds blocks 4s..4s + 4 of the sixteen rows, 1152
//! bytes: for block c and chunk k (bytes 4k..4k + 4 of a block's 16), sixteen u32 (row r's
//! four bytes in lane r) at 64 (4c + k), then the blocks' f16 scales, sixteen per block, at
//! 1024 + 32c. The same bytes as the file's rows (18 per block), so the interleaved copy of a
//! matrix takes its size, and a group's steps start on 64-byte lines.
//!
//! The arithmetic is the file layout's one-token kernels' at each level lane for lane
//! (`FloatSteps`): a block's products summed exactly in integers, then the level's float steps;
//! so a row's dot is bit for bit the one the file's layout gives at that level, and the same in
//! a prompt as alone.

use super::{f16_to_f32, BlockQ4_0, BlockQ8Act, QK};

/// Rows per group.
pub const GROUP_ROWS: usize = 16;
/// Blocks per step.
pub const STEP_BLOCKS: usize = 4;
/// Bytes per step: four blocks of sixteen rows, their quants then their scales.
pub const STEP_BYTES: usize = STEP_BLOCKS * GROUP_ROWS * std::mem::size_of::<BlockQ4_0>();
const SCALES_AT: usize = STEP_BLOCKS * GROUP_ROWS * QK / 2;
const _: () = assert!(STEP_BYTES == 1152 && SCALES_AT == 1024);

/// Whether a (rows, cols) Q4_0 matrix has the interleaved layout's shape: whole groups of rows
/// and whole steps of blocks.
pub fn fits(rows: usize, cols: usize) -> bool {
    rows.is_multiple_of(GROUP_ROWS) && cols.is_multiple_of(QK * STEP_BLOCKS) && cols > 0
}

/// Bytes of one group of a matrix of `cols` columns.
pub fn group_bytes(cols: usize) -> usize {
    cols / (QK * STEP_BLOCKS) * STEP_BYTES
}

/// A Q4_0 matrix (rows, cols) in the interleaved layout.
#[derive(Clone, Copy)]
pub struct Interleaved<'a> {
    pub rows: usize,
    pub cols: usize,
    pub data: &'a [u8],
}

impl<'a> Interleaved<'a> {
    pub fn new(rows: usize, cols: usize, data: &'a [u8]) -> Interleaved<'a> {
        assert!(fits(rows, cols), "a {rows} x {cols} matrix has no interleaved layout");
        assert_eq!(data.len(), rows / GROUP_ROWS * group_bytes(cols), "interleaved matrix size");
        Interleaved { rows, cols, data }
    }

    pub fn groups(&self) -> usize {
        self.rows / GROUP_ROWS
    }

    /// Group g's bytes (rows 16g..16g + 16).
    pub fn group(&self, g: usize) -> &'a [u8] {
        let b = group_bytes(self.cols);
        &self.data[g * b..(g + 1) * b]
    }

    /// Rows r0..r1 (multiples of 16) as a matrix of their own.
    pub fn rows_range(&self, r0: usize, r1: usize) -> Interleaved<'a> {
        assert!(r0.is_multiple_of(GROUP_ROWS) && r1.is_multiple_of(GROUP_ROWS) && r0 <= r1);
        let b = group_bytes(self.cols);
        Interleaved::new(r1 - r0, self.cols, &self.data[r0 / GROUP_ROWS * b..r1 / GROUP_ROWS * b])
    }
}

/// Writes the Q4_0 rows `src` (rows, cols; `fits`) into `out` (the same length) interleaved.
pub fn interleave(src: &[u8], rows: usize, cols: usize, out: &mut [u8]) {
    assert!(fits(rows, cols), "a {rows} x {cols} matrix has no interleaved layout");
    let nb = cols / QK;
    let row_bytes = nb * std::mem::size_of::<BlockQ4_0>();
    assert_eq!(src.len(), rows * row_bytes, "Q4_0 matrix size");
    assert_eq!(out.len(), src.len(), "interleaved matrix size");
    let gb = group_bytes(cols);
    for (g, group) in out.chunks_exact_mut(gb).enumerate() {
        for (s, step) in group.chunks_exact_mut(STEP_BYTES).enumerate() {
            for r in 0..GROUP_ROWS {
                let row = &src[(GROUP_ROWS * g + r) * row_bytes..][..row_bytes];
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
        }
    }
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

#[cfg(test)]
mod tests {
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
        interleave(&src, rows, cols, &mut out);
        let m = Interleaved::new(rows, cols, &out);
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
        interleave(&src, rows, cols, &mut out);
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
}
