//! The 256-weight formats (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS) against activations quantized
//! per super-block, ggml's `block_q8_K`: one f32 scale per 256 activations and the sums of each
//! 16 (`BlockQ8K`). With one activation scale for a whole super-block, its products sum in
//! integers (scale * v * a) and meet floats once per 256 weights; per-32 activations
//! (`BlockQ8Act`) need a float step per 32. This is ggml's own pairing for these formats, so
//! the activations are rounded as llama.cpp rounds them. The AVX-512 dots read the same
//! formats with per-32 activations (`avx512::dot_chunked`); these serve the AVX2 level
//! (`q256_x86`) and the scalar one (this module's `dot_scalar`, their twin).

use super::chunks::{int_chunk, IntChunk, QK_K};
use super::{DType, QK};

/// ggml block_q8_K: 256 activations = d * qs, and bsums[g] = the sum of qs[16g..16g + 16]
/// (what the minimum and offset terms of a dot need); here also the sums per 32, `bsums32`,
/// which the prompts' row groups pair with the formats that have one minimum or scale per 32
/// weights (half the multiplies of pairing per 16).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BlockQ8K {
    pub d: f32,
    pub qs: [i8; QK_K],
    pub bsums: [i16; QK_K / 16],
    pub bsums32: [i16; QK_K / 32],
}
const _: () = assert!(std::mem::size_of::<BlockQ8K>() == 308);

impl Default for BlockQ8K {
    fn default() -> Self {
        BlockQ8K { d: 0.0, qs: [0; QK_K], bsums: [0; QK_K / 16], bsums32: [0; QK_K / 32] }
    }
}

/// ggml's `nearest_int`: round half to even through the float adder (exact for |x| < 2^22),
/// where `f32::round_ties_even` is a library call on x86-64 without SSE4.1.
#[inline(always)]
fn nearest_int(x: f32) -> i32 {
    let v = x + 12_582_912.0;
    (v.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

/// x (a multiple of 256 long) to Q8_K blocks, as ggml's `quantize_row_q8_K_ref`: the element of
/// largest magnitude (the first such) goes to -127, d = 1 / (-127 / it). Inlined into
/// `quantize_act_k_avx2`, the same code compiles to AVX2 there.
#[inline(always)]
pub fn quantize_act_k(x: &[f32], out: &mut [BlockQ8K]) {
    for (blk, o) in x.chunks_exact(QK_K).zip(out.iter_mut()) {
        let amax = blk.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        if amax == 0.0 {
            *o = BlockQ8K::default();
            continue;
        }
        let max = blk[blk.iter().position(|v| v.abs() == amax).expect("amax is one of the values")];
        let iscale = -127.0 / max;
        for (q, &v) in o.qs.iter_mut().zip(blk) {
            *q = nearest_int(iscale * v).min(127) as i8;
        }
        for (s, q) in o.bsums.iter_mut().zip(o.qs.chunks_exact(16)) {
            *s = q.iter().map(|&q| q as i16).sum();
        }
        for (s, pair) in o.bsums32.iter_mut().zip(o.bsums.chunks_exact(2)) {
            *s = pair[0] + pair[1];
        }
        o.d = 1.0 / iscale;
    }
}

/// `quantize_act_k` compiled with AVX2 (the compiler vectorizes its loops).
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C (`SimdLevel::Avx2` or above).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn quantize_act_k_avx2(x: &[f32], out: &mut [BlockQ8K]) {
    quantize_act_k(x, out)
}

/// A super-block's one float step for a token: acc + sums * (d * d_a) - mins * (dmin * d_a),
/// each product fused into the sum, from the block's exact integer sums of scale * v * a and of
/// min * a. Every path (one token, prompts, AVX2, AVX-512, this module's twin) takes it in
/// this form, so a dot is bit for bit the same in all of them.
#[inline(always)]
pub(crate) fn block_step(
    min: bool,
    acc: f32,
    sums: i32,
    mins: i32,
    d: f32,
    dmin: f32,
    d_a: f32,
) -> f32 {
    let acc = (sums as f32).mul_add(d * d_a, acc);
    if min {
        (-(mins as f32)).mul_add(dmin * d_a, acc)
    } else {
        acc
    }
}

/// Scalar dot of one row of a type that reads per-256 activations with N rows of Q8_K activations: per
/// super-block the integer sums of scale * v * a and of min * a (from `bsums`), then
/// `block_step`. The twin of `q256_x86::dot`, bit for bit.
pub fn dot_scalar<const N: usize>(dtype: DType, row: &[u8], a: [&[BlockQ8K]; N]) -> [f32; N] {
    const CHUNKS: usize = QK_K / QK;
    let has_min = matches!(dtype, DType::Q2_K | DType::Q4_K | DType::Q5_K);
    let mut ch = IntChunk::default();
    let mut acc = [0.0f32; N];
    for b in 0..a[0].len() {
        let (mut sums, mut mins) = ([0i32; N], [0i32; N]);
        for c in 0..CHUNKS {
            int_chunk(dtype, row, b * CHUNKS + c, &mut ch);
            for t in 0..N {
                let ab = &a[t][b];
                for h in 0..2 {
                    let k = 2 * c + h;
                    let dot: i32 = ch.v[16 * h..16 * h + 16]
                        .iter()
                        .zip(&ab.qs[16 * k..16 * k + 16])
                        .map(|(&v, &q)| v as i32 * q as i32)
                        .sum();
                    sums[t] += ch.scale[h] * dot;
                    mins[t] += ch.min[h] * ab.bsums[k] as i32;
                }
            }
        }
        for t in 0..N {
            acc[t] = block_step(has_min, acc[t], sums[t], mins[t], ch.d, ch.dmin, a[t][b].d);
        }
    }
    acc
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::quant::chunks::{dequantize_row, tests::random_row};
    use crate::quant::tests::random_vec;

    /// Q8_K blocks of x.
    pub(crate) fn q8k(x: &[f32]) -> Vec<BlockQ8K> {
        let mut a = vec![BlockQ8K::default(); x.len() / QK_K];
        quantize_act_k(x, &mut a);
        a
    }

    /// The quantization is ggml's, checked in float64: the largest element maps to -127, every
    /// other to its nearest integer multiple of d (ties to even), and bsums sums each 16.
    #[test]
    fn quantization_is_ggmls() {
        let mut x = random_vec(4 * QK_K, 5);
        x[3] = 2.5; // a positive maximum: d < 0
        x[QK_K + 7] = -3.0;
        x[2 * QK_K..3 * QK_K].fill(0.0);
        let a = q8k(&x);
        for (b, blk) in a.iter().enumerate() {
            let xs = &x[b * QK_K..(b + 1) * QK_K];
            let max = xs.iter().fold(0.0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
            if max == 0.0 {
                assert!(blk.d == 0.0 && blk.qs.iter().all(|&q| q == 0), "zero block");
                continue;
            }
            let iscale = -127.0f32 / max;
            assert_eq!(blk.d, 1.0 / iscale, "block {b} scale");
            for (i, (&q, &v)) in blk.qs.iter().zip(xs).enumerate() {
                let want = ((iscale * v) as f64).round_ties_even().min(127.0);
                assert_eq!(q as f64, want, "block {b} element {i}");
            }
            for g in 0..16 {
                assert_eq!(
                    blk.bsums[g] as i32,
                    blk.qs[16 * g..16 * g + 16].iter().map(|&q| q as i32).sum::<i32>()
                );
            }
        }
        assert_eq!(a[0].qs[3], -127);
        assert_eq!(a[1].qs[7], -127);
        #[cfg(target_arch = "x86_64")]
        if crate::simd::detect().has_avx2() {
            let mut b = vec![BlockQ8K::default(); 4];
            // SAFETY: AVX2 checked above
            unsafe { quantize_act_k_avx2(&x, &mut b) };
            for (p, q) in a.iter().zip(&b) {
                assert!(
                    p.d.to_bits() == q.d.to_bits() && p.qs == q.qs && p.bsums == q.bsums,
                    "AVX2 build differs"
                );
            }
        }
    }

    /// The dot is the float64 dot of the dequantized weights with the dequantized activations.
    #[test]
    fn dot_equals_dequantized_dot() {
        let n = 1024;
        for (s, dtype) in DType::ALL.into_iter().filter(|d| d.reads_q8k()).enumerate() {
            let row = random_row(dtype, n, 20 + s as u64);
            let mut w = vec![0.0f32; n];
            dequantize_row(dtype, &row, &mut w);
            let xs = [random_vec(n, 31), random_vec(n, 32)];
            let acts = [q8k(&xs[0]), q8k(&xs[1])];
            let got = dot_scalar(dtype, &row, [&acts[0], &acts[1]]);
            for t in 0..2 {
                let a = &acts[t];
                let want: f64 = w
                    .iter()
                    .enumerate()
                    .map(|(i, &wi)| {
                        wi as f64 * a[i / QK_K].d as f64 * a[i / QK_K].qs[i % QK_K] as f64
                    })
                    .sum();
                let scale: f64 =
                    w.iter().zip(&xs[t]).map(|(&wi, &x)| (wi as f64 * x as f64).abs()).sum();
                assert!(
                    (got[t] as f64 - want).abs() <= 1e-5 * scale,
                    "{dtype:?} token {t}: {} vs {want}",
                    got[t]
                );
            }
        }
    }
}
