//! Tensor formats: ggml type ids, quant block layouts (bit-exact with ggml), quantize/dequantize,
//! and the scalar reference dot products that every SIMD kernel is tested against.
//!
//! Weights keep their file format; activations are quantized per 32-element block to `BlockQ8Act`
//! (int8 with an f32 scale and the scaled block sum) so quantized weights can use integer dot
//! products, as llama.cpp does with its q8_0/q8_1 activation blocks; below AVX-512 the 256-weight
//! formats read them per super-block instead (`q256::BlockQ8K`, ggml's q8_K).

use half::{bf16, f16};

pub mod chunks;
#[cfg(target_arch = "x86_64")]
pub mod chunks_x86;
pub mod interleaved;
#[cfg(target_arch = "x86_64")]
pub mod interleaved_x86;
pub mod q256;
#[cfg(target_arch = "x86_64")]
pub mod q256_x86;
#[cfg(target_arch = "x86_64")]
pub mod q32_x86;
pub use chunks::QK_K;

pub const QK: usize = 32;

pub use crate::dtype::DType;

/// Name of any ggml type id, including ones we cannot compute with (for error messages and `info`).
pub fn type_name(id: u32) -> String {
    const NAMES: [&str; 40] = [
        "F32",
        "F16",
        "Q4_0",
        "Q4_1",
        "Q4_2",
        "Q4_3",
        "Q5_0",
        "Q5_1",
        "Q8_0",
        "Q8_1",
        "Q2_K",
        "Q3_K",
        "Q4_K",
        "Q5_K",
        "Q6_K",
        "Q8_K",
        "IQ2_XXS",
        "IQ2_XS",
        "IQ3_XXS",
        "IQ1_S",
        "IQ4_NL",
        "IQ3_S",
        "IQ2_S",
        "IQ4_XS",
        "I8",
        "I16",
        "I32",
        "I64",
        "F64",
        "IQ1_M",
        "BF16",
        "Q4_0_4_4",
        "Q4_0_4_8",
        "Q4_0_8_8",
        "TQ1_0",
        "TQ2_0",
        "IQ4_NL_4_4",
        "IQ4_NL_4_8",
        "IQ4_NL_8_8",
        "MXFP4",
    ];
    NAMES.get(id as usize).map(|s| s.to_string()).unwrap_or_else(|| format!("type#{id}"))
}

/// ggml block_q4_0: 32 weights = d * (q - 8), q in 0..16. Element j<16 is the low nibble of
/// qs[j], element j>=16 the high nibble of qs[j-16].
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BlockQ4_0 {
    pub d: u16, // f16
    pub qs: [u8; QK / 2],
}
// the table's size for the type (`dtype::TYPES`)
const _: () = assert!(std::mem::size_of::<BlockQ4_0>() == DType::Q4_0.traits().block_bytes);

/// ggml block_q4_1: 32 weights = d * q + m, q in 0..16, same nibble order as Q4_0.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BlockQ4_1 {
    pub d: u16, // f16
    pub m: u16, // f16
    pub qs: [u8; QK / 2],
}
// the table's size for the type (`dtype::TYPES`)
const _: () = assert!(std::mem::size_of::<BlockQ4_1>() == DType::Q4_1.traits().block_bytes);

/// ggml block_q8_0: 32 weights = d * q, q in -127..=127.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BlockQ8_0 {
    pub d: u16, // f16
    pub qs: [i8; QK],
}
// the table's size for the type (`dtype::TYPES`)
const _: () = assert!(std::mem::size_of::<BlockQ8_0>() == DType::Q8_0.traits().block_bytes);

/// Activation block: 32 values = d * q, plus s = d * sum(q), which lets Q4_0's offset (-8) and
/// Q4_1's minimum be applied once per block instead of per element. Scales are f32 (ggml's
/// q8_1 uses f16), so the activation side adds no rounding beyond the int8 step.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BlockQ8Act {
    pub d: f32,
    pub s: f32,
    pub qs: [i8; QK],
}
const _: () = assert!(std::mem::size_of::<BlockQ8Act>() == 40);

impl Default for BlockQ8Act {
    fn default() -> Self {
        BlockQ8Act { d: 0.0, s: 0.0, qs: [0; QK] }
    }
}

/// Four consecutive activation blocks laid out for 512-bit integer dot products that take four
/// weight blocks per step (see `avx512`): `lo` holds each block's elements 0..16 (block k at
/// bytes 16k..16k + 16), `hi` its elements 16..32, which is where a Q4_0 block's low and high
/// nibbles land. `vpdpbusd` sums each 4 bytes into one of 16 i32 lanes, so lanes 4k..4k + 4
/// belong to block k. Per lane: `d` and `s` its block's, and, from the lane's own bytes
/// exactly, `bias` = -8 * their sum in `lo` and `hi`: weights stored with an offset (Q4_0's
/// q = v + 8; v + 128 takes it times 16) start their dots there, so that a block's lanes sum
/// exactly to sum(v * q). A row whose block count is not a multiple of four ends in a quad
/// padded with zero blocks.
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug)]
pub struct ActQuad {
    pub lo: [i8; 64],
    pub hi: [i8; 64],
    pub d: [f32; 16],
    pub s: [f32; 16],
    pub bias: [i32; 16],
}
const _: () = assert!(std::mem::size_of::<ActQuad>() == 320);

impl Default for ActQuad {
    fn default() -> Self {
        ActQuad { lo: [0; 64], hi: [0; 64], d: [0.0; 16], s: [0.0; 16], bias: [0; 16] }
    }
}

/// Quads per row of `blocks` activation blocks (the last one padded).
pub fn act_quads(blocks: usize) -> usize {
    blocks.div_ceil(4)
}

/// Rearranges activation blocks as `ActQuad`s (`out`: `act_quads(blocks.len())` entries).
pub fn arrange_act_quads(blocks: &[BlockQ8Act], out: &mut [ActQuad]) {
    out.fill(ActQuad::default());
    for (i, b) in blocks.iter().enumerate() {
        let (o, k) = (&mut out[i / 4], i % 4);
        o.lo[16 * k..16 * k + 16].copy_from_slice(&b.qs[..16]);
        o.hi[16 * k..16 * k + 16].copy_from_slice(&b.qs[16..]);
        for lane in 4 * k..4 * k + 4 {
            let bytes = 4 * (lane - 4 * k);
            let sum = |h: usize| {
                b.qs[16 * h + bytes..16 * h + bytes + 4].iter().map(|&q| q as i32).sum::<i32>()
            };
            (o.d[lane], o.s[lane]) = (b.d, b.s);
            o.bias[lane] = -8 * (sum(0) + sum(1));
        }
    }
}

#[inline]
pub fn f16_to_f32(bits: u16) -> f32 {
    f16::from_bits(bits).to_f32()
}

#[inline]
pub fn f32_to_f16(v: f32) -> u16 {
    f16::from_f32(v).to_bits()
}

/// Reinterprets raw tensor bytes as blocks. The GGUF reader guarantees the length is a whole
/// number of blocks; alignment is checked here because the cast needs it.
pub fn cast_blocks<T>(bytes: &[u8]) -> &[T] {
    let [blocks] = cast_rows::<T, 1>([bytes]);
    blocks
}

/// `cast_blocks` of the R rows a decode kernel reads at once, which are rows of one matrix and
/// so equally long: their lengths and alignments are checked together, once. (Row by row, the
/// checks cost the predictors' 4-block rows a quarter of their product's instructions.)
pub fn cast_rows<T, const R: usize>(rows: [&[u8]; R]) -> [&[T]; R] {
    let (size, len) = (std::mem::size_of::<T>(), rows.first().map_or(0, |r| r.len()));
    let (mut same, mut addresses) = (true, 0usize);
    for row in &rows {
        same &= row.len() == len;
        addresses |= row.as_ptr() as usize;
    }
    assert!(same, "rows of unequal length");
    assert!(len.is_multiple_of(size), "byte length is not a whole number of blocks");
    assert!(addresses.is_multiple_of(std::mem::align_of::<T>()), "misaligned block data");
    let n = len / size;
    // SAFETY: every row is n whole blocks long and aligned (checked above); every T here is
    // plain old data (integers).
    rows.map(|row| unsafe { std::slice::from_raw_parts(row.as_ptr() as *const T, n) })
}

// ---------------------------------------------------------------------------------------------
// Dequantization (any supported type to f32)

/// Decodes one row of `n` elements of type `dtype` from `bytes` into `out[..n]`.
pub fn dequantize_row(dtype: DType, bytes: &[u8], out: &mut [f32]) {
    let n = out.len();
    match dtype {
        DType::F32 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes(c.try_into().unwrap());
            }
        }
        DType::F16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f16_to_f32(u16::from_le_bytes([c[0], c[1]]));
            }
        }
        DType::BF16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
        DType::Q4_0 => {
            for (b, o) in cast_blocks::<BlockQ4_0>(&bytes[..dtype.row_bytes(n)])
                .iter()
                .zip(out.chunks_exact_mut(QK))
            {
                let d = f16_to_f32(b.d);
                for j in 0..QK / 2 {
                    o[j] = ((b.qs[j] & 0x0F) as i32 - 8) as f32 * d;
                    o[j + QK / 2] = ((b.qs[j] >> 4) as i32 - 8) as f32 * d;
                }
            }
        }
        DType::Q4_1 => {
            for (b, o) in cast_blocks::<BlockQ4_1>(&bytes[..dtype.row_bytes(n)])
                .iter()
                .zip(out.chunks_exact_mut(QK))
            {
                let (d, m) = (f16_to_f32(b.d), f16_to_f32(b.m));
                for j in 0..QK / 2 {
                    o[j] = (b.qs[j] & 0x0F) as f32 * d + m;
                    o[j + QK / 2] = (b.qs[j] >> 4) as f32 * d + m;
                }
            }
        }
        DType::Q8_0 => {
            for (b, o) in cast_blocks::<BlockQ8_0>(&bytes[..dtype.row_bytes(n)])
                .iter()
                .zip(out.chunks_exact_mut(QK))
            {
                let d = f16_to_f32(b.d);
                for j in 0..QK {
                    o[j] = b.qs[j] as f32 * d;
                }
            }
        }
        _ => chunks::dequantize_row(dtype, &bytes[..dtype.row_bytes(n)], out),
    }
}

// ---------------------------------------------------------------------------------------------
// Quantization (f32 to a weight type), following ggml's reference quantizers bit for bit so
// files we write read the same in llama.cpp. Only the legacy types and floats are written.

pub fn quantize_row(dtype: DType, x: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(dtype.row_bytes(x.len()));
    match dtype {
        DType::F32 => x.iter().for_each(|v| out.extend(v.to_le_bytes())),
        DType::F16 => x.iter().for_each(|v| out.extend(f32_to_f16(*v).to_le_bytes())),
        DType::BF16 => {
            x.iter().for_each(|v| out.extend(bf16::from_f32(*v).to_bits().to_le_bytes()))
        }
        DType::Q4_0 => {
            for blk in x.chunks_exact(QK) {
                let max =
                    blk.iter().copied().fold(0.0f32, |m, v| if v.abs() > m.abs() { v } else { m });
                let d = max / -8.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend(f32_to_f16(d).to_le_bytes());
                for j in 0..QK / 2 {
                    let q0 = ((blk[j] * id + 8.5) as i8).min(15) as u8;
                    let q1 = ((blk[j + QK / 2] * id + 8.5) as i8).min(15) as u8;
                    out.push(q0 | (q1 << 4));
                }
            }
        }
        DType::Q4_1 => {
            for blk in x.chunks_exact(QK) {
                let min = blk.iter().copied().fold(f32::INFINITY, f32::min);
                let max = blk.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let d = (max - min) / 15.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend(f32_to_f16(d).to_le_bytes());
                out.extend(f32_to_f16(min).to_le_bytes());
                for j in 0..QK / 2 {
                    let q0 = (((blk[j] - min) * id + 0.5) as i8).min(15) as u8;
                    let q1 = (((blk[j + QK / 2] - min) * id + 0.5) as i8).min(15) as u8;
                    out.push(q0 | (q1 << 4));
                }
            }
        }
        DType::Q8_0 => {
            for blk in x.chunks_exact(QK) {
                let amax = blk.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let d = amax / 127.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend(f32_to_f16(d).to_le_bytes());
                for &v in blk {
                    out.push((v * id).round() as i8 as u8);
                }
            }
        }
        // the engine only writes the formats of its own copies (F16, Q8_0) and of its tests;
        // files in these come from llama.cpp's quantizer
        _ => panic!("quantize_row: {} is read, never written, by this engine", dtype.name()),
    }
    out
}

/// Quantizes activations `x` (length a multiple of 32) into int8 blocks.
pub fn quantize_act(x: &[f32], out: &mut [BlockQ8Act]) {
    for (blk, o) in x.chunks_exact(QK).zip(out.iter_mut()) {
        let amax = blk.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut sum = 0i32;
        for (q, &v) in o.qs.iter_mut().zip(blk) {
            *q = (v * id).round() as i8;
            sum += *q as i32;
        }
        o.d = d;
        o.s = d * sum as f32;
    }
}

// ---------------------------------------------------------------------------------------------
// Scalar reference dot products: one weight row against N activation rows at once (N tokens).

pub fn dot_q4_0_scalar<const N: usize>(w: &[BlockQ4_0], a: [&[BlockQ8Act]; N]) -> [f32; N] {
    let mut out = [0.0f32; N];
    for (j, aj) in a.iter().enumerate() {
        let mut sum = 0.0f32;
        for (b, ab) in w.iter().zip(aj.iter()) {
            // the weights q - 8 in integers, as the SIMD kernels take them: the offset taken
            // off in floats (8 d s) cancelled most of the sum's digits
            let mut isum = 0i32;
            for k in 0..QK / 2 {
                isum += ((b.qs[k] & 0x0F) as i32 - 8) * ab.qs[k] as i32;
                isum += ((b.qs[k] >> 4) as i32 - 8) * ab.qs[k + QK / 2] as i32;
            }
            sum += f16_to_f32(b.d) * (ab.d * isum as f32);
        }
        out[j] = sum;
    }
    out
}

pub fn dot_q4_1_scalar<const N: usize>(w: &[BlockQ4_1], a: [&[BlockQ8Act]; N]) -> [f32; N] {
    let mut out = [0.0f32; N];
    for (j, aj) in a.iter().enumerate() {
        let mut sum = 0.0f32;
        for (b, ab) in w.iter().zip(aj.iter()) {
            let mut isum = 0i32;
            for k in 0..QK / 2 {
                isum += (b.qs[k] & 0x0F) as i32 * ab.qs[k] as i32;
                isum += (b.qs[k] >> 4) as i32 * ab.qs[k + QK / 2] as i32;
            }
            sum += f16_to_f32(b.d) * ab.d * isum as f32 + f16_to_f32(b.m) * ab.s;
        }
        out[j] = sum;
    }
    out
}

pub fn dot_q8_0_scalar<const N: usize>(w: &[BlockQ8_0], a: [&[BlockQ8Act]; N]) -> [f32; N] {
    let mut out = [0.0f32; N];
    for (j, aj) in a.iter().enumerate() {
        let mut sum = 0.0f32;
        for (b, ab) in w.iter().zip(aj.iter()) {
            let isum: i32 = b.qs.iter().zip(ab.qs.iter()).map(|(&x, &y)| x as i32 * y as i32).sum();
            sum += f16_to_f32(b.d) * ab.d * isum as f32;
        }
        out[j] = sum;
    }
    out
}

/// Float weight rows (F32/F16/BF16 as raw little-endian bytes) against f32 activations, in
/// eight lanes (element k into lane k % 8) summed as `avx2::dot_float`'s `hsum` sums its
/// lanes: a 4096-long sum in one chain carried several times the rounding error of eight
/// chains of 512, which the tests' f32 tolerances are set by.
pub fn dot_float_scalar<const N: usize>(dtype: DType, w: &[u8], a: [&[f32]; N]) -> [f32; N] {
    const LANES: usize = 8;
    let n = a[0].len();
    let eb = dtype.block_bytes();
    let mut acc = [[0.0f32; LANES]; N];
    let mut wk = [0.0f32; QK];
    for (c, bytes) in w[..n * eb].chunks(QK * eb).enumerate() {
        let wk = &mut wk[..bytes.len() / eb];
        dequantize_row(dtype, bytes, wk);
        for (j, aj) in a.iter().enumerate() {
            for (i, (x, y)) in wk.iter().zip(&aj[c * QK..]).enumerate() {
                acc[j][i % LANES] += x * y;
            }
        }
    }
    acc.map(|l| {
        let s = [l[0] + l[4], l[1] + l[5], l[2] + l[6], l[3] + l[7]];
        let s = [s[0] + s[2], s[1] + s[3]];
        s[0] + s[1]
    })
}

// ---------------------------------------------------------------------------------------------
// Scalar reference axpy: y += a * row, the column-sparse half of the FFN (one neuron's row of
// `down_t` scaled by its activation). `row` holds `y.len()` elements of type `dtype`.
//
// Float rows and Q8_0 round as the AVX2 and AVX-512 kernels do, one fused multiply-add per
// weight (a float weight times a; a Q8_0 weight q times a * d, that product rounded once per
// block), and as the prompt tiles do (`sparse::tiled_axpy_scalar`): the same bits at every
// level. Rounded twice (`y += a * w`), the scalar level's FFN outputs sat a last bit away from
// the SIMD levels' and its prompts' own, and a random model's int8 activations round such
// differences apart at a tie about once per 20k values.
pub fn axpy_scalar(dtype: DType, row: &[u8], a: f32, y: &mut [f32]) {
    if dtype.is_chunked() {
        return chunks::axpy_scalar(dtype, row, a, y);
    }
    if dtype == DType::Q8_0 {
        for (b, yc) in cast_blocks::<BlockQ8_0>(&row[..dtype.row_bytes(y.len())])
            .iter()
            .zip(y.chunks_exact_mut(QK))
        {
            let s = a * f16_to_f32(b.d);
            for (yi, &q) in yc.iter_mut().zip(&b.qs) {
                *yi = (q as f32).mul_add(s, *yi);
            }
        }
        return;
    }
    let fused = !dtype.is_quantized();
    let mut w = [0.0f32; QK];
    let (bl, bb) = (dtype.block_len(), dtype.block_bytes());
    // Decode a few blocks at a time (QK elements) so float and quantized types share the loop.
    let step = QK / bl * bb;
    for (yc, wc) in y.chunks_mut(QK).zip(row.chunks(step)) {
        let w = &mut w[..yc.len()];
        dequantize_row(dtype, wc, w);
        for (yi, wi) in yc.iter_mut().zip(w.iter()) {
            *yi = if fused { wi.mul_add(a, *yi) } else { *yi + a * wi };
        }
    }
}

/// Rows per call of the integer down pass (`axpy_group_q4_0_scalar`): their coefficients share
/// one int8 scale per 32-column block, as the dense down product's 32 activations of a block do.
pub const AXPY_GROUP_ROWS: usize = 32;

/// y += sum over r of a[r] * rows[r] for up to `AXPY_GROUP_ROWS` Q4_0 rows, in integers: per
/// 32-column block, each row's coefficient a[r] * d (its block scale) is rounded to int8 on the
/// block's one scale (the largest magnitude / 127), the nibbles times those int8 coefficients
/// sum exactly in integers, and the sum takes one float step into y. So the down pass rounds
/// its coefficients as the dense down product rounds its activations (to int8 per 32), instead
/// of decoding every weight to float. A block whose coefficients are not all finite (a NaN or
/// infinite activation, a corrupt scale) goes through `axpy_scalar` instead, so they reach y as
/// they would there. Scalar twin of `avx512::axpy_group_q4_0`.
pub fn axpy_group_q4_0_scalar(rows: &[&[u8]], a: &[f32], y: &mut [f32]) {
    assert!(!rows.is_empty() && rows.len() <= AXPY_GROUP_ROWS && a.len() == rows.len());
    assert!(y.len().is_multiple_of(QK), "Q4_0 rows are whole blocks");
    let bb = DType::Q4_0.block_bytes();
    let block = |r: usize, b: usize| &cast_blocks::<BlockQ4_0>(&rows[r][b * bb..])[0];
    for b in 0..y.len() / QK {
        let mut c = [0.0f32; AXPY_GROUP_ROWS];
        for (r, cr) in c.iter_mut().enumerate().take(rows.len()) {
            *cr = a[r] * f16_to_f32(block(r, b).d);
        }
        if !c.iter().all(|v| v.abs() < f32::INFINITY) {
            for (row, &ar) in rows.iter().zip(a) {
                axpy_scalar(DType::Q4_0, &row[b * bb..(b + 1) * bb], ar, &mut y[b * QK..][..QK]);
            }
            continue;
        }
        let peak = c.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let (step, inv) = (peak / 127.0, if peak > 0.0 { 127.0 / peak } else { 0.0 });
        let k = c.map(|v| (v * inv).round_ties_even() as i32);
        let bias = 8 * k.iter().sum::<i32>();
        for j in 0..QK {
            let sum: i32 = (0..rows.len())
                .map(|r| {
                    let q = block(r, b).qs[j % 16];
                    k[r] * if j < 16 { q & 15 } else { q >> 4 } as i32
                })
                .sum();
            let yj = &mut y[b * QK + j];
            *yj = ((sum - bias) as f32).mul_add(step, *yj);
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn random_vec(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = crate::sampler::Rng::new(seed);
        (0..n).map(|_| rng.next_f32() * 2.0 - 1.0).collect()
    }

    /// `cast_rows` gives each row's own blocks, as `cast_blocks` does row by row, and refuses
    /// rows of unequal length, a length that is not whole blocks, or a misaligned row.
    #[test]
    fn cast_rows_equals_cast_blocks_and_checks_every_row() {
        let rows: Vec<Vec<u8>> =
            (0..4).map(|s| quantize_row(DType::Q4_0, &random_vec(96, s))).collect();
        let four = [&rows[0][..], &rows[1][..], &rows[2][..], &rows[3][..]];
        let cast = cast_rows::<BlockQ4_0, 4>(four);
        for (blocks, row) in cast.iter().zip(four) {
            let alone = cast_blocks::<BlockQ4_0>(row);
            assert_eq!((blocks.as_ptr(), blocks.len()), (alone.as_ptr(), alone.len()));
        }
        let refused = |rows: [&[u8]; 4]| {
            std::panic::catch_unwind(|| cast_rows::<BlockQ4_0, 4>(rows).map(|b| b.len())).is_err()
        };
        assert!(!refused(four));
        assert!(refused([four[0], four[1], &four[2][..36], four[3]]), "a shorter row");
        assert!(refused([&four[0][..53], &four[1][..53], &four[2][..53], &four[3][..53]]));
        // the last row's bytes at an odd address
        let mut shifted = vec![0u8; four[3].len() + 1];
        let o = (shifted.as_ptr() as usize + 1) % 2;
        shifted[o..o + four[3].len()].copy_from_slice(four[3]);
        assert!(refused([four[0], four[1], four[2], &shifted[o..o + four[3].len()]]), "misaligned");
    }

    /// Every quantized type, and a random valid row of `cols` weights of one: the legacy types
    /// quantized from random values, the chunked ones random blocks with small scales.
    pub(crate) const QUANTIZED: [DType; 13] = [
        DType::Q4_0,
        DType::Q4_1,
        DType::Q8_0,
        DType::Q5_0,
        DType::Q5_1,
        DType::Q2_K,
        DType::Q3_K,
        DType::Q4_K,
        DType::Q5_K,
        DType::Q6_K,
        DType::IQ4_NL,
        DType::IQ4_XS,
        DType::MXFP4,
    ];

    pub(crate) fn random_quantized_row(dtype: DType, cols: usize, seed: u64) -> Vec<u8> {
        match dtype {
            DType::Q4_0 | DType::Q4_1 | DType::Q8_0 => quantize_row(dtype, &random_vec(cols, seed)),
            _ => chunks::tests::random_row(dtype, cols, seed),
        }
    }

    #[test]
    fn quantize_dequantize_round_trip_within_step() {
        let x = random_vec(32 * 64, 1);
        for (dtype, tol) in [
            (DType::F32, 0.0),
            (DType::F16, 1e-3),
            (DType::BF16, 8e-3),
            (DType::Q8_0, 1.0 / 127.0 * 0.51 + 1e-3),
            (DType::Q4_1, 2.0 / 15.0 * 0.51 + 2e-3),
            // The side opposite the largest value clamps at q = 15: up to one full step.
            (DType::Q4_0, 1.0 / 8.0 + 2e-3),
        ] {
            let q = quantize_row(dtype, &x);
            assert_eq!(q.len(), dtype.row_bytes(x.len()));
            let mut y = vec![0.0; x.len()];
            dequantize_row(dtype, &q, &mut y);
            let max_err = x.iter().zip(&y).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
            assert!(max_err <= tol, "{dtype:?}: max error {max_err} > {tol}");
        }
    }

    #[test]
    fn quantize_matches_ggml_reference_values() {
        // Q4_0 of 0..32 scaled: max |x| is the last element (31), d = -31/8, and it maps to q=0.
        let x: Vec<f32> = (0..32).map(|i| i as f32).collect();
        let q = quantize_row(DType::Q4_0, &x);
        assert_eq!(
            f16_to_f32(u16::from_le_bytes([q[0], q[1]])),
            f16::from_f32(-31.0 / 8.0).to_f32()
        );
        assert_eq!(q[2 + 15] >> 4, 0); // element 31
        assert_eq!(q[2] & 0x0F, 8); // element 0
    }

    #[test]
    fn activation_round_trip() {
        let x = random_vec(32 * 8, 2);
        let mut blocks = vec![BlockQ8Act::default(); 8];
        quantize_act(&x, &mut blocks);
        for (b, xb) in blocks.iter().zip(x.chunks(32)) {
            let s: i32 = b.qs.iter().map(|&q| q as i32).sum();
            assert!((b.s - b.d * s as f32).abs() < 1e-6);
            for (q, v) in b.qs.iter().zip(xb) {
                assert!((*q as f32 * b.d - v).abs() <= b.d * 0.5 + 1e-6);
            }
        }
    }

    #[test]
    fn scalar_quantized_dot_matches_float_dot() {
        let n = 32 * 20;
        let w = random_vec(n, 3);
        let a = random_vec(n, 4);
        let mut ab = vec![BlockQ8Act::default(); n / 32];
        quantize_act(&a, &mut ab);
        for dtype in [DType::Q4_0, DType::Q4_1, DType::Q8_0] {
            let q = quantize_row(dtype, &w);
            let mut wd = vec![0.0; n];
            dequantize_row(dtype, &q, &mut wd);
            let exact: f64 = wd.iter().zip(&a).map(|(x, y)| *x as f64 * *y as f64).sum();
            let got = match dtype {
                DType::Q4_0 => dot_q4_0_scalar(cast_blocks(&q), [&ab])[0],
                DType::Q4_1 => dot_q4_1_scalar(cast_blocks(&q), [&ab])[0],
                _ => dot_q8_0_scalar(cast_blocks(&q), [&ab])[0],
            };
            // Only the activation's int8 rounding separates the two: bounded by sum |w| * d_a / 2.
            let bound: f64 =
                wd.iter().map(|v| v.abs() as f64).sum::<f64>() * (1.0 / 127.0) * 0.5 + 1e-4;
            assert!((got as f64 - exact).abs() < bound, "{dtype:?}: {got} vs {exact}");
        }
    }
}
