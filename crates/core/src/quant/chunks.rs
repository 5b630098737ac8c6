//! The block formats of llama.cpp's k-quant presets besides the legacy ones: Q5_0, Q5_1, Q2_K,
//! Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL and IQ4_XS, and gpt-oss's MXFP4. Every one is read the same way: a row is a run of
//! 32-weight chunks (one `BlockQ8Act` of activations each), and a chunk is two halves of 16
//! weights, w = scale * v - min, with small integers v (`Chunk`). So one decoder per format
//! serves dequantization, the integer dot product and the axpy of the sparse operators.
//!
//! Dequantization evaluates exactly the float32 expressions of the `gguf` package's numpy
//! dequantizers (bit-exact; tests/test_quant_formats.py checks every format). The dot product
//! is the scalar reference: per half, the integer dot of v with the int8 activations, scaled
//! once; the activations' per-32 f32 scales are finer than ggml's per-256 Q8_K ones.

use super::{f16_to_f32, BlockQ8Act, DType, QK};

/// Weights per super-block of the k-quants.
pub const QK_K: usize = 256;

/// ggml block_q5_0: 32 weights = d * (q - 16), q in 0..32: the low 4 bits as Q4_0's nibbles,
/// bit 4 of weight j in bit j of qh (little-endian u32).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BlockQ5_0 {
    pub d: u16,
    pub qh: [u8; 4],
    pub qs: [u8; QK / 2],
}
// the table's size for the type (`dtype::TYPES`)
const _: () = assert!(std::mem::size_of::<BlockQ5_0>() == DType::Q5_0.traits().block_bytes);

/// ggml block_q5_1: 32 weights = d * q + m, q in 0..32, bits as Q5_0.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BlockQ5_1 {
    pub d: u16,
    pub m: u16,
    pub qh: [u8; 4],
    pub qs: [u8; QK / 2],
}
// the table's size for the type (`dtype::TYPES`)
const _: () = assert!(std::mem::size_of::<BlockQ5_1>() == DType::Q5_1.traits().block_bytes);

/// ggml block_q2_K: 256 weights in 16 groups of 16: d * (scales[g] & 15) * q - dmin *
/// (scales[g] >> 4), q in 0..4 (2 bits).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BlockQ2K {
    pub scales: [u8; QK_K / 16],
    pub qs: [u8; QK_K / 4],
    pub d: u16,
    pub dmin: u16,
}
// the table's size for the type (`dtype::TYPES`)
const _: () = assert!(std::mem::size_of::<BlockQ2K>() == DType::Q2_K.traits().block_bytes);

/// ggml block_q3_K: 256 weights in 16 groups of 16: d * (scale[g] - 32) * q, q in -4..4 (2 low
/// bits in qs, the high bit inverted in hmask), 6-bit scales packed in 12 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BlockQ3K {
    pub hmask: [u8; QK_K / 8],
    pub qs: [u8; QK_K / 4],
    pub scales: [u8; 12],
    pub d: u16,
}
// the table's size for the type (`dtype::TYPES`)
const _: () = assert!(std::mem::size_of::<BlockQ3K>() == DType::Q3_K.traits().block_bytes);

/// ggml block_q4_K: 256 weights in 8 groups of 32: d * sc[g] * q - dmin * m[g], q in 0..16,
/// 6-bit sc and m packed in 12 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BlockQ4K {
    pub d: u16,
    pub dmin: u16,
    pub scales: [u8; 12],
    pub qs: [u8; QK_K / 2],
}
// the table's size for the type (`dtype::TYPES`)
const _: () = assert!(std::mem::size_of::<BlockQ4K>() == DType::Q4_K.traits().block_bytes);

/// ggml block_q5_K: as Q4_K with a fifth bit per weight (qh), q in 0..32.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BlockQ5K {
    pub d: u16,
    pub dmin: u16,
    pub scales: [u8; 12],
    pub qh: [u8; QK_K / 8],
    pub qs: [u8; QK_K / 2],
}
// the table's size for the type (`dtype::TYPES`)
const _: () = assert!(std::mem::size_of::<BlockQ5K>() == DType::Q5_K.traits().block_bytes);

/// ggml block_q6_K: 256 weights in 16 groups of 16: d * scales[g] * (q - 32), q in 0..64 (4 low
/// bits in ql, 2 high bits in qh).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BlockQ6K {
    pub ql: [u8; QK_K / 2],
    pub qh: [u8; QK_K / 4],
    pub scales: [i8; QK_K / 16],
    pub d: u16,
}
// the table's size for the type (`dtype::TYPES`)
const _: () = assert!(std::mem::size_of::<BlockQ6K>() == DType::Q6_K.traits().block_bytes);

/// ggml block_iq4_nl: 32 weights = d * IQ4_VALUES[q], q in 0..16.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BlockIQ4NL {
    pub d: u16,
    pub qs: [u8; QK / 2],
}
// the table's size for the type (`dtype::TYPES`)
const _: () = assert!(std::mem::size_of::<BlockIQ4NL>() == DType::IQ4_NL.traits().block_bytes);

/// ggml block_iq4_xs: 256 weights in 8 groups of 32: d * (ls[g] - 32) * IQ4_VALUES[q], 6-bit ls
/// (low 4 bits in scales_l, high 2 in scales_h).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BlockIQ4XS {
    pub d: u16,
    pub scales_h: u16,
    pub scales_l: [u8; QK_K / 64],
    pub qs: [u8; QK_K / 2],
}
// the table's size for the type (`dtype::TYPES`)
const _: () = assert!(std::mem::size_of::<BlockIQ4XS>() == DType::IQ4_XS.traits().block_bytes);

/// ggml block_mxfp4 (OCP microscaling FP4): 32 weights = 2^(e - 128) * MXFP4_VALUES[q], q in
/// 0..16, nibbles ordered as Q4_0's. The values are E2M1's doubled (hence the halved scale).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BlockMXFP4 {
    pub e: u8, // E8M0: an exponent alone
    pub qs: [u8; QK / 2],
}
// the table's size for the type (`dtype::TYPES`)
const _: () = assert!(std::mem::size_of::<BlockMXFP4>() == DType::MXFP4.traits().block_bytes);

/// E2M1's sixteen values (sign, two exponent bits, one mantissa bit), doubled: 0, 0.5, 1, 1.5,
/// 2, 3, 4, 6 and their negatives, as integers.
pub const MXFP4_VALUES: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// An E8M0 exponent as the f32 2^(e - 128): half the block scale 2^(e - 127), to go with the
/// doubled `MXFP4_VALUES` (ggml's `GGML_E8M0_TO_FP32_HALF`; e = 0 and 1 are subnormal).
#[inline]
pub fn e8m0_half(e: u8) -> f32 {
    let bits = if e < 2 { 0x0020_0000u32 << e } else { (e as u32 - 1) << 23 };
    f32::from_bits(bits)
}

/// The non-linear 4-bit grid of IQ4_NL and IQ4_XS.
pub const IQ4_VALUES: [i8; 16] =
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113];

/// 32 consecutive weights: w[i] = scale[i / 16] * v[i] - min[i / 16].
#[derive(Clone, Copy, Debug, Default)]
pub struct Chunk {
    pub v: [i8; QK],
    pub scale: [f32; 2],
    pub min: [f32; 2],
}

fn block<T>(row: &[u8], i: usize) -> &T {
    &super::cast_blocks::<T>(row)[i]
}

/// The 6-bit scale and min of group g of a Q4_K/Q5_K block.
pub(super) fn scale_min_k4(s: &[u8; 12], g: usize) -> (u8, u8) {
    if g < 4 {
        (s[g] & 63, s[g + 4] & 63)
    } else {
        ((s[g + 4] & 0x0F) | ((s[g - 4] >> 6) << 4), (s[g + 4] >> 4) | ((s[g] >> 6) << 4))
    }
}

/// 32 consecutive weights as integers: w[i] = d * scale[i / 16] * v[i] - dmin * min[i / 16].
/// The integer dots (`superblock`) sum scale * v * a per super-block and meet d once.
#[derive(Clone, Copy, Debug, Default)]
pub struct IntChunk {
    pub v: [i8; QK],
    pub scale: [i32; 2],
    pub min: [i32; 2],
    pub d: f32,
    pub dmin: f32,
}

/// Chunk k (weights 32k..32k + 32) of a row of `dtype` (a chunked type), in floats. The
/// products d * scale are the numpy dequantizers' float32 expressions.
pub fn chunk(dtype: DType, row: &[u8], k: usize, out: &mut Chunk) {
    let mut ints = IntChunk::default();
    int_chunk(dtype, row, k, &mut ints);
    out.v = ints.v;
    out.scale = ints.scale.map(|s| ints.d * s as f32);
    out.min = ints.min.map(|m| ints.dmin * m as f32);
}

/// Chunk k (weights 32k..32k + 32) of a row of `dtype` (a chunked type), in integers.
pub fn int_chunk(dtype: DType, row: &[u8], k: usize, out: &mut IntChunk) {
    let per_block = dtype.block_len() / QK;
    let (b, c) = (k / per_block, k % per_block); // the block, and the chunk within it
    out.min = [0; 2];
    out.dmin = 0.0;
    match dtype {
        DType::Q5_0 | DType::Q5_1 => {
            let (d, m, qh, qs) = if dtype == DType::Q5_0 {
                let x: &BlockQ5_0 = block(row, b);
                (x.d, None, u32::from_le_bytes(x.qh), &x.qs)
            } else {
                let x: &BlockQ5_1 = block(row, b);
                (x.d, Some(x.m), u32::from_le_bytes(x.qh), &x.qs)
            };
            let offset = if m.is_none() { 16 } else { 0 };
            let (lo, hi) = out.v.split_at_mut(16);
            for (i, ((l, h), &q)) in lo.iter_mut().zip(hi.iter_mut()).zip(qs).enumerate() {
                *l = ((q & 0x0F) | ((((qh >> i) & 1) as u8) << 4)) as i8 - offset;
                *h = ((q >> 4) | ((((qh >> (i + 16)) & 1) as u8) << 4)) as i8 - offset;
            }
            (out.d, out.scale) = (f16_to_f32(d), [1; 2]);
            // (d * q) + m, as d * q - (-m) * 1
            if let Some(m) = m {
                (out.dmin, out.min) = (-f16_to_f32(m), [1; 2]);
            }
        }
        DType::Q2_K => {
            let x: &BlockQ2K = block(row, b);
            let (g, s) = (c / 4, c % 4);
            for (v, &q) in out.v.iter_mut().zip(&x.qs[g * 32..g * 32 + 32]) {
                *v = ((q >> (2 * s)) & 3) as i8;
            }
            for t in 0..2 {
                let sc = x.scales[2 * c + t];
                (out.scale[t], out.min[t]) = ((sc & 0x0F) as i32, (sc >> 4) as i32);
            }
            (out.d, out.dmin) = (f16_to_f32(x.d), f16_to_f32(x.dmin));
        }
        DType::Q3_K => {
            let x: &BlockQ3K = block(row, b);
            let (g, s) = (c / 4, c % 4);
            for ((v, &q), &hm) in out.v.iter_mut().zip(&x.qs[g * 32..g * 32 + 32]).zip(&x.hmask) {
                let (low, high) = (((q >> (2 * s)) & 3) as i8, ((hm >> c) & 1) as i8);
                *v = low - 4 * (1 - high);
            }
            for t in 0..2 {
                let j = 2 * c + t;
                let low = (x.scales[j % 8] >> (4 * (j / 8))) & 0x0F;
                let high = (x.scales[8 + j % 4] >> (2 * (j / 4))) & 3;
                out.scale[t] = (low | (high << 4)) as i32 - 32;
            }
            out.d = f16_to_f32(x.d);
        }
        DType::Q4_K | DType::Q5_K => {
            let (d, dmin, scales, qs, qh) = if dtype == DType::Q4_K {
                let x: &BlockQ4K = block(row, b);
                (x.d, x.dmin, &x.scales, &x.qs, None)
            } else {
                let x: &BlockQ5K = block(row, b);
                (x.d, x.dmin, &x.scales, &x.qs, Some(&x.qh))
            };
            let (sc, m) = scale_min_k4(scales, c);
            let (g, h) = (c / 2, c % 2);
            let q = &qs[g * 32..g * 32 + 32];
            match qh {
                None => {
                    out.v.iter_mut().zip(q).for_each(|(v, &q)| *v = ((q >> (4 * h)) & 0x0F) as i8)
                }
                Some(qh) => out.v.iter_mut().zip(q).zip(qh).for_each(|((v, &q), &b)| {
                    *v = (((q >> (4 * h)) & 0x0F) | (((b >> c) & 1) << 4)) as i8
                }),
            }
            (out.scale, out.min) = ([sc as i32; 2], [m as i32; 2]);
            (out.d, out.dmin) = (f16_to_f32(d), f16_to_f32(dmin));
        }
        DType::Q6_K => {
            let x: &BlockQ6K = block(row, b);
            // weight f = 32c + i lies in half g = f / 128, at r = f % 128
            let (g, s) = (c / 4, c % 4);
            let h = s / 2;
            let ql = &x.ql[g * 64 + (s % 2) * 32..g * 64 + (s % 2) * 32 + 32];
            for ((v, &l), &q) in out.v.iter_mut().zip(ql).zip(&x.qh[g * 32..g * 32 + 32]) {
                *v = (((l >> (4 * h)) & 0x0F) | (((q >> (2 * s)) & 3) << 4)) as i8 - 32;
            }
            out.scale = [x.scales[2 * c] as i32, x.scales[2 * c + 1] as i32];
            out.d = f16_to_f32(x.d);
        }
        DType::IQ4_NL => {
            let x: &BlockIQ4NL = block(row, b);
            let (lo, hi) = out.v.split_at_mut(16);
            for ((l, h), &q) in lo.iter_mut().zip(hi.iter_mut()).zip(&x.qs) {
                *l = IQ4_VALUES[(q & 0x0F) as usize];
                *h = IQ4_VALUES[(q >> 4) as usize];
            }
            (out.d, out.scale) = (f16_to_f32(x.d), [1; 2]);
        }
        DType::IQ4_XS => {
            let x: &BlockIQ4XS = block(row, b);
            let (lo, hi) = out.v.split_at_mut(16);
            for ((l, h), &q) in lo.iter_mut().zip(hi.iter_mut()).zip(&x.qs[c * 16..c * 16 + 16]) {
                *l = IQ4_VALUES[(q & 0x0F) as usize];
                *h = IQ4_VALUES[(q >> 4) as usize];
            }
            (out.d, out.scale) = (f16_to_f32(x.d), [iq4_xs_scale(x, c); 2]);
        }
        DType::MXFP4 => {
            let x: &BlockMXFP4 = block(row, b);
            let (lo, hi) = out.v.split_at_mut(16);
            for ((l, h), &q) in lo.iter_mut().zip(hi.iter_mut()).zip(&x.qs) {
                *l = MXFP4_VALUES[(q & 0x0F) as usize];
                *h = MXFP4_VALUES[(q >> 4) as usize];
            }
            (out.d, out.scale) = (e8m0_half(x.e), [1; 2]);
        }
        _ => unreachable!("{} is not a chunked type", dtype.name()),
    }
}

/// The signed 6-bit scale of chunk c of an IQ4_XS block (low 4 bits in `scales_l`, high 2 in
/// `scales_h`, minus 32).
pub(crate) fn iq4_xs_scale(x: &BlockIQ4XS, c: usize) -> i32 {
    let low = (x.scales_l[c / 2] >> (4 * (c % 2))) & 0x0F;
    let high = ((x.scales_h >> (2 * c)) & 3) as u8;
    (low | (high << 4)) as i32 - 32
}

/// A k-quant super-block's 12 packed scale bytes as three little-endian words, for unpacking
/// four scales per operation (`q3_k_scales`, `k4_scales`).
#[inline]
fn scale_words(s: &[u8; 12]) -> [u32; 3] {
    let word = |i: usize| u32::from_le_bytes([s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]]);
    [word(0), word(1), word(2)]
}
const LOW4: u32 = 0x0f0f_0f0f;
const LOW2: u32 = 0x0303_0303;

/// Q3_K's sixteen 6-bit scales of one super-block (before the - 32), unpacked at once (ggml's word
/// trick): scale j is a nibble of byte j % 8 and two bits of byte 8 + j % 4.
#[inline]
pub(crate) fn q3_k_scales(s: &[u8; 12]) -> [u32; 4] {
    let [w0, w1, w2] = scale_words(s);
    let six = |low: u32, high: u32| (low & LOW4) | ((high & LOW2) << 4);
    [six(w0, w2), six(w1, w2 >> 2), six(w0 >> 4, w2 >> 4), six(w1 >> 4, w2 >> 6)]
}

/// Q4_K's and Q5_K's eight 6-bit scales and eight minima of one super-block, unpacked at once
/// (`scale_min_k4` for every sub-block, four bytes per word): bytes [sc0..=sc7, m0..=m7].
#[inline]
pub(crate) fn k4_scales(s: &[u8; 12]) -> [u32; 4] {
    let [w0, w1, w2] = scale_words(s);
    const LOW6: u32 = 0x3f3f_3f3f;
    // sub-blocks 0..4: the low 6 bits of bytes 0..4 (scales) and 4..8 (minima); 4..8: a nibble
    // of bytes 8..12 and the top two bits of bytes 0..4 (scales) or 4..8 (minima)
    [
        w0 & LOW6,
        (w2 & LOW4) | (((w0 >> 6) & LOW2) << 4),
        w1 & LOW6,
        ((w2 >> 4) & LOW4) | (((w1 >> 6) & LOW2) << 4),
    ]
}

/// Decodes one row of a chunked type into `out[..n]`.
pub fn dequantize_row(dtype: DType, row: &[u8], out: &mut [f32]) {
    let mut ch = Chunk::default();
    for (k, o) in out.chunks_exact_mut(QK).enumerate() {
        chunk(dtype, row, k, &mut ch);
        for (i, w) in o.iter_mut().enumerate() {
            *w = ch.scale[i / 16] * ch.v[i] as f32 - ch.min[i / 16];
        }
    }
}

/// Scalar reference dot of one row of a chunked type with N int8 activation rows.
pub fn dot_scalar<const N: usize>(dtype: DType, row: &[u8], a: [&[BlockQ8Act]; N]) -> [f32; N] {
    let mut ch = Chunk::default();
    let mut acc = [0.0f32; N];
    for k in 0..a[0].len() {
        chunk(dtype, row, k, &mut ch);
        for (t, acc) in acc.iter_mut().enumerate() {
            let b = &a[t][k];
            let (mut dot, mut sum) = ([0i32; 2], [0i32; 2]);
            for h in 0..2 {
                let (v, q) = (&ch.v[16 * h..16 * h + 16], &b.qs[16 * h..16 * h + 16]);
                dot[h] = v.iter().zip(q).map(|(&v, &q)| v as i32 * q as i32).sum();
                // (only formats with a minimum need the activations' sums)
                if ch.min[h] != 0.0 {
                    sum[h] = q.iter().map(|&q| q as i32).sum();
                }
            }
            let scaled = ch.scale[0] * dot[0] as f32 + ch.scale[1] * dot[1] as f32;
            let mins = ch.min[0] * sum[0] as f32 + ch.min[1] * sum[1] as f32;
            *acc += b.d * (scaled - mins);
        }
    }
    acc
}

/// y += a * row, for a row of a chunked type: each weight decoded as the chunk kernels decode
/// it, then one fused multiply-add, as they add it (`chunks_x86::axpy_rows`).
pub fn axpy_scalar(dtype: DType, row: &[u8], a: f32, y: &mut [f32]) {
    let mut ch = Chunk::default();
    for (k, yk) in y.chunks_exact_mut(QK).enumerate() {
        chunk(dtype, row, k, &mut ch);
        for (i, yi) in yk.iter_mut().enumerate() {
            *yi = (ch.scale[i / 16] * ch.v[i] as f32 - ch.min[i / 16]).mul_add(a, *yi);
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::quant::{quantize_act, tests::random_vec};

    /// Random bytes with small finite f16 scales: a valid block of any chunked type.
    pub(crate) fn random_row(dtype: DType, n: usize, seed: u64) -> Vec<u8> {
        let mut rng = crate::sampler::Rng::new(seed);
        let mut row: Vec<u8> =
            (0..dtype.row_bytes(n)).map(|_| (rng.next_f32() * 256.0) as u8).collect();
        if dtype == DType::MXFP4 {
            // exponents around 2^0, so that sums stay finite
            for block in row.chunks_exact_mut(dtype.block_bytes()) {
                block[0] = 118 + (rng.next_f32() * 12.0) as u8;
            }
            return row;
        }
        let fields: &[usize] = match dtype {
            DType::Q5_1 | DType::Q4_K | DType::Q5_K => &[0, 2],
            DType::Q2_K => &[80, 82],
            DType::Q3_K => &[108],
            DType::Q6_K => &[208],
            _ => &[0],
        };
        for block in row.chunks_exact_mut(dtype.block_bytes()) {
            for &f in fields {
                let v = super::super::f32_to_f16((rng.next_f32() - 0.5) * 0.01);
                block[f..f + 2].copy_from_slice(&v.to_le_bytes());
            }
        }
        row
    }

    /// The integer dot is the dot of the decoded weights with the decoded int8 activations.
    #[test]
    fn dot_equals_dequantized_dot() {
        let n = 512;
        for (s, dtype) in DType::ALL.into_iter().filter(|d| d.is_chunked()).enumerate() {
            let row = random_row(dtype, n, 10 + s as u64);
            let mut w = vec![0.0f32; n];
            dequantize_row(dtype, &row, &mut w);
            let x = random_vec(n, 3);
            let mut a = vec![BlockQ8Act::default(); n / QK];
            quantize_act(&x, &mut a);
            let want: f64 = w
                .iter()
                .enumerate()
                .map(|(i, &wi)| wi as f64 * a[i / QK].d as f64 * a[i / QK].qs[i % QK] as f64)
                .sum();
            let got = dot_scalar(dtype, &row, [&a])[0] as f64;
            let scale: f64 =
                w.iter().enumerate().map(|(i, &wi)| (wi as f64 * x[i] as f64).abs()).sum();
            assert!((got - want).abs() <= 1e-5 * scale, "{dtype:?}: {got} vs {want}");
            let mut y = vec![1.0f32; n];
            axpy_scalar(dtype, &row, 0.5, &mut y);
            assert!(y.iter().zip(&w).all(|(yi, wi)| *yi == 1.0 + 0.5 * wi), "{dtype:?} axpy");
        }
    }
}
