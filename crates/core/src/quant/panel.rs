//! Prefill products of quantized weights (AVX-512 VNNI): a weight row is decoded once per
//! product into a panel of int8 bytes and per-lane scales (`WeightQuad`), then dotted with
//! every token of the prompt, R rows by T tokens per step. The decode kernels (`avx512`,
//! `chunked_avx2`) decode a row once per four tokens, which for the k-quant formats costs more
//! than the dots themselves; here the decode is paid once per row, and the inner loop is the
//! same for every format.
//!
//! Layout, as `quant::ActQuad`'s: four 32-weight chunks per quad; `lo` holds bytes 0..16 of
//! chunk c at 16c, `hi` bytes 16..32, so lanes 4c..4c + 4 of one `vpdpbusd` over `lo` and one
//! over `hi` both belong to chunk c, whose activation scale is one number. Formats with one
//! scale per chunk sum `lo` and `hi` into one lane vector before the float step; those with
//! a scale per 16 weights (Q2_K, Q3_K, Q6_K) keep them apart.
//!
//! Signs: `vpdpbusd` multiplies unsigned by signed bytes. The activations go in as a + 128
//! (`ActPanel`), the weights as their signed values v, and each weight lane's -128 * sum(v)
//! (`WeightQuad::bias`), computed at unpack, starts the sum: sum((a + 128) v) - 128 sum(v) =
//! sum(a v). Rows whose chunk count is not a multiple of four end in a zero-padded quad.
//!
//! The scalar twins are the decode kernels' scalar dots (`quant::dot_*_scalar`,
//! `chunked::dot_scalar`): the same int8 activations, only the float summation order differs.

#![allow(clippy::missing_safety_doc)]

use std::arch::x86_64::*;

use super::chunked_avx2::{self as c2, Decoded};
use super::{BlockQ8Act, DType, QK};

/// Four chunks (128 weights) of a weight row, unpacked. Per-lane values (16 lanes, lane 4c..4c
/// + 4 for chunk c): `bias` is -128 * the lane's byte sum (of `lo` and `hi` together, or of `lo`
/// alone with `bias_hi` for `hi` where scales are per 16); `scale`/`scale_hi` the weight scales
/// of the first and second 16 weights; `min`/`min_hi` their minima (w = scale * v - min).
#[repr(C, align(64))]
#[derive(Clone, Copy)]
pub struct WeightQuad {
    lo: [i8; 64],
    hi: [i8; 64],
    bias: [i32; 16],
    bias_hi: [i32; 16],
    scale: [f32; 16],
    scale_hi: [f32; 16],
    min: [f32; 16],
    min_hi: [f32; 16],
}
const _: () = assert!(std::mem::size_of::<WeightQuad>() == 512);

impl Default for WeightQuad {
    fn default() -> Self {
        WeightQuad { lo: [0; 64], hi: [0; 64], bias: [0; 16], bias_hi: [0; 16], scale: [0.0; 16], scale_hi: [0.0; 16], min: [0.0; 16], min_hi: [0.0; 16] }
    }
}

/// Four activation blocks of one token, arranged for `WeightQuad`: bytes a + 128 in the same
/// order, and per lane the block's scale d, its scaled sum s / 4, and d * (sum of the lane's
/// half) / 4 for each half (the per-16 minima of Q2_K).
#[repr(C, align(64))]
#[derive(Clone, Copy)]
pub struct ActPanel {
    lo: [u8; 64],
    hi: [u8; 64],
    d: [f32; 16],
    s4: [f32; 16],
    s_lo: [f32; 16],
    s_hi: [f32; 16],
}
const _: () = assert!(std::mem::size_of::<ActPanel>() == 384);

impl Default for ActPanel {
    fn default() -> Self {
        ActPanel { lo: [128; 64], hi: [128; 64], d: [0.0; 16], s4: [0.0; 16], s_lo: [0.0; 16], s_hi: [0.0; 16] }
    }
}

/// Quads per row of `cols` weights (the last one padded).
pub fn quads(cols: usize) -> usize {
    (cols / QK).div_ceil(4)
}

/// One token's activation blocks as panels (`out`: `quads(32 * blocks.len())` entries).
pub fn arrange_act_panel(blocks: &[BlockQ8Act], out: &mut [ActPanel]) {
    out.fill(ActPanel::default());
    for (k, b) in blocks.iter().enumerate() {
        let (o, c) = (&mut out[k / 4], k % 4);
        for i in 0..16 {
            o.lo[16 * c + i] = (b.qs[i] as i16 + 128) as u8;
            o.hi[16 * c + i] = (b.qs[16 + i] as i16 + 128) as u8;
        }
        let half = |h: usize| b.d * b.qs[16 * h..16 * h + 16].iter().map(|&q| q as i32).sum::<i32>() as f32 / 4.0;
        let (s_lo, s_hi) = (half(0), half(1));
        for lane in 4 * c..4 * c + 4 {
            o.d[lane] = b.d;
            o.s4[lane] = b.s / 4.0;
            o.s_lo[lane] = s_lo;
            o.s_hi[lane] = s_hi;
        }
    }
}

/// Whether `dtype` has a scale per 16 weights, and whether it has minima.
pub(crate) const fn shape(dtype: DType) -> (bool, bool) {
    match dtype {
        DType::Q3_K | DType::Q6_K => (true, false),
        DType::Q2_K => (true, true),
        DType::Q4_1 | DType::Q5_1 | DType::Q4_K | DType::Q5_K => (false, true),
        _ => (false, false),
    }
}

/// Chunk c of quad `q` from a decoded chunk.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn store_chunk(q: &mut WeightQuad, c: usize, ch: &Decoded) {
    _mm_storeu_si128(q.lo.as_mut_ptr().add(16 * c) as *mut __m128i, _mm256_castsi256_si128(ch.v));
    _mm_storeu_si128(q.hi.as_mut_ptr().add(16 * c) as *mut __m128i, _mm256_extracti128_si256::<1>(ch.v));
    _mm_storeu_ps(q.scale.as_mut_ptr().add(4 * c), _mm256_castps256_ps128(ch.scale));
    _mm_storeu_ps(q.scale_hi.as_mut_ptr().add(4 * c), _mm256_extractf128_ps::<1>(ch.scale));
    // a format has either a minimum per chunk (all lanes) or one per half; the other is zero
    let min = _mm256_add_ps(ch.min, ch.min_halves);
    _mm_storeu_ps(q.min.as_mut_ptr().add(4 * c), _mm256_castps256_ps128(min));
    _mm_storeu_ps(q.min_hi.as_mut_ptr().add(4 * c), _mm256_extractf128_ps::<1>(min));
}

/// Unpacks a row of `cols` weights of `dtype` (any quantized type) into `out[..quads(cols)]`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub unsafe fn unpack_row(dtype: DType, row: &[u8], cols: usize, out: &mut [WeightQuad]) {
    let (nb, nq) = (cols / QK, quads(cols));
    let out = &mut out[..nq];
    if nb % 4 != 0 {
        out[nq - 1] = WeightQuad::default();
    }
    macro_rules! each_chunk {
        ($decode:path, $dtype:expr) => {{
            const PER_BLOCK: usize = c2::chunks_per_block($dtype);
            for k in 0..nb {
                let ch = $decode(row, k / PER_BLOCK, k % PER_BLOCK);
                store_chunk(out.get_unchecked_mut(k / 4), k % 4, &ch);
            }
        }};
    }
    c2::with_decoder!(dtype, each_chunk);
    // -128 * each lane's byte sum: vpdpbusd of 128 (unsigned) with the weights
    let (zero, b128) = (_mm512_setzero_si512(), _mm512_set1_epi8(-128));
    let halves = shape(dtype).0;
    for q in out.iter_mut() {
        let lo = _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, b128, _mm512_load_si512(q.lo.as_ptr() as *const _)));
        let hi = _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, b128, _mm512_load_si512(q.hi.as_ptr() as *const _)));
        let (bias, bias_hi) = if halves { (lo, hi) } else { (_mm512_add_epi32(lo, hi), zero) };
        _mm512_store_si512(q.bias.as_mut_ptr() as *mut _, bias);
        _mm512_store_si512(q.bias_hi.as_mut_ptr() as *mut _, bias_hi);
    }
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn int(p: &[impl Copy; 64]) -> __m512i {
    _mm512_load_si512(p.as_ptr() as *const _)
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn int32(p: &[i32; 16]) -> __m512i {
    _mm512_load_si512(p.as_ptr() as *const _)
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn float(p: &[f32; 16]) -> __m512 {
    _mm512_load_ps(p.as_ptr())
}

/// R unpacked rows against T tokens' panels: out[r][t] = row r . token t. `HALVES`: scales
/// per 16 weights; `MIN`: minima (per 16 with `HALVES`, else per chunk).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn block<const HALVES: bool, const MIN: bool, const R: usize, const T: usize>(w: [&[WeightQuad]; R], a: [&[ActPanel]; T]) -> [[f32; T]; R] {
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    for j in 0..a[0].len() {
        for r in 0..R {
            let q = w[r].get_unchecked(j);
            let (wlo, whi, bias, scale) = (int(&q.lo), int(&q.hi), int32(&q.bias), float(&q.scale));
            for t in 0..T {
                let x = a[t].get_unchecked(j);
                let d = float(&x.d);
                let acc = &mut acc[r][t];
                if HALVES {
                    let lo = _mm512_dpbusd_epi32(bias, int(&x.lo), wlo);
                    let hi = _mm512_dpbusd_epi32(int32(&q.bias_hi), int(&x.hi), whi);
                    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), _mm512_mul_ps(scale, d), *acc);
                    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_mul_ps(float(&q.scale_hi), d), *acc);
                    if MIN {
                        *acc = _mm512_fnmadd_ps(float(&q.min), float(&x.s_lo), *acc);
                        *acc = _mm512_fnmadd_ps(float(&q.min_hi), float(&x.s_hi), *acc);
                    }
                } else {
                    let dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(bias, int(&x.lo), wlo), int(&x.hi), whi);
                    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(scale, d), *acc);
                    if MIN {
                        *acc = _mm512_fnmadd_ps(float(&q.min), float(&x.s4), *acc);
                    }
                }
            }
        }
    }
    hsums(&acc)
}

/// Rows per step: each unpacked row is reused for T tokens, each token's panel for R rows.
const R: usize = 4;
const T: usize = 4;

/// Rows `rows` of a weight matrix (`row(r)` its bytes, `cols` wide) against `n` tokens'
/// panels (`panel`: n * quads(cols)): put(t, r, value).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub unsafe fn rows_all_tokens<'a>(
    dtype: DType,
    row: impl Fn(usize) -> &'a [u8],
    cols: usize,
    rows: std::ops::Range<usize>,
    panel: &[ActPanel],
    n: usize,
    put: impl Fn(usize, usize, f32),
) {
    match shape(dtype) {
        (false, false) => rows_with::<false, false>(dtype, row, cols, rows, panel, n, put),
        (false, true) => rows_with::<false, true>(dtype, row, cols, rows, panel, n, put),
        (true, false) => rows_with::<true, false>(dtype, row, cols, rows, panel, n, put),
        (true, true) => rows_with::<true, true>(dtype, row, cols, rows, panel, n, put),
    }
}

/// One row (`row`, `cols` wide) against the listed tokens' panels: put(t, value). `unpacked`
/// is scratch (reused across calls).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub unsafe fn row_tokens(dtype: DType, row: &[u8], cols: usize, panel: &[ActPanel], tokens: &[usize], unpacked: &mut Vec<WeightQuad>, mut put: impl FnMut(usize, f32)) {
    let nq = quads(cols);
    unpacked.resize(nq, WeightQuad::default());
    unpack_row(dtype, row, cols, unpacked);
    let w = &unpacked[..nq];
    let token = |t: usize| &panel[t * nq..(t + 1) * nq];
    macro_rules! with {
        ($halves:expr, $min:expr) => {{
            let mut g = tokens.chunks_exact(T);
            for q in &mut g {
                let v = block::<$halves, $min, 1, T>([w], [token(q[0]), token(q[1]), token(q[2]), token(q[3])])[0];
                q.iter().zip(v).for_each(|(&t, vt)| put(t, vt));
            }
            for &t in g.remainder() {
                put(t, block::<$halves, $min, 1, 1>([w], [token(t)])[0][0]);
            }
        }};
    }
    match shape(dtype) {
        (false, false) => with!(false, false),
        (false, true) => with!(false, true),
        (true, false) => with!(true, false),
        (true, true) => with!(true, true),
    }
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn rows_with<'a, const HALVES: bool, const MIN: bool>(
    dtype: DType,
    row: impl Fn(usize) -> &'a [u8],
    cols: usize,
    rows: std::ops::Range<usize>,
    panel: &[ActPanel],
    n: usize,
    put: impl Fn(usize, usize, f32),
) {
    let nq = quads(cols);
    assert_eq!(panel.len(), n * nq, "panel: wrong size for {n} tokens of {cols}");
    let mut unpacked = vec![WeightQuad::default(); R * nq];
    let token = |t: usize| &panel[t * nq..(t + 1) * nq];
    let mut r0 = rows.start;
    while r0 < rows.end {
        let m = (rows.end - r0).min(R);
        for (i, u) in unpacked.chunks_exact_mut(nq).take(m).enumerate() {
            unpack_row(dtype, row(r0 + i), cols, u);
        }
        let w = |i: usize| &unpacked[i * nq..(i + 1) * nq];
        let mut t = 0;
        while t < n {
            if m == R && t + T <= n {
                let v = block::<HALVES, MIN, R, T>([w(0), w(1), w(2), w(3)], [token(t), token(t + 1), token(t + 2), token(t + 3)]);
                for (i, vi) in v.iter().enumerate() {
                    for (k, &x) in vi.iter().enumerate() {
                        put(t + k, r0 + i, x);
                    }
                }
                t += T;
            } else {
                for i in 0..m {
                    put(t, r0 + i, block::<HALVES, MIN, 1, 1>([w(i)], [token(t)])[0][0]);
                }
                t += 1;
            }
        }
        r0 += m;
    }
}

/// Every accumulator's sum of 16 lanes. A plain loop: through `array::map`, the closure was
/// compiled without AVX-512, took each register through memory (a stalled store-to-load) and
/// cost 40% of a 576-column matrix-vector product. (Shared with `avx512`'s one-token dots.)
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn hsums<const R: usize, const N: usize>(acc: &[[__m512; N]; R]) -> [[f32; N]; R] {
    let mut out = [[0.0f32; N]; R];
    for r in 0..R {
        for t in 0..N {
            out[r][t] = _mm512_reduce_add_ps(acc[r][t]);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::matmul::{dot_row, Activations, QMatrix, SimdLevel};
    use crate::quant::tests::{random_quantized_row, random_vec, QUANTIZED};
    use crate::quant::{chunked, is_chunked};

    /// Every quantized type, through panels, equals the scalar dots up to float summation
    /// order: rows and tokens that fill whole R x T steps and ones that do not, rows whose
    /// chunk count is and is not a multiple of four.
    #[test]
    fn panels_match_scalar_dots() {
        if crate::matmul::detect() != SimdLevel::Avx512 {
            eprintln!("skipping: no AVX-512 VNNI on this CPU");
            return;
        }
        for (s, dtype) in QUANTIZED.into_iter().enumerate() {
            for cols in [96, 256, 512, 576, 1536] {
                if cols % dtype.block_len() != 0 {
                    continue;
                }
                let (rows, n) = (7, 11);
                let data: Vec<u8> = (0..rows).flat_map(|r| random_quantized_row(dtype, cols, (100 * s + r) as u64)).collect();
                let w = QMatrix { dtype, rows, cols, data: &data };
                let mut x = Activations::default();
                x.set(&random_vec(n * cols, 5 + s as u64), n, cols);
                let nq = quads(cols);
                let mut panel = vec![ActPanel::default(); n * nq];
                for t in 0..n {
                    arrange_act_panel(&x.q8[t * cols / QK..(t + 1) * cols / QK], &mut panel[t * nq..(t + 1) * nq]);
                }
                let mut got = vec![f32::NAN; n * rows];
                let cell = std::cell::RefCell::new(&mut got);
                // SAFETY: AVX-512 VNNI checked above
                unsafe { rows_all_tokens(dtype, |r| w.row(r), cols, 1..rows, &panel, n, |t, r, v| cell.borrow_mut()[t * rows + r] = v) };
                for r in 0..rows {
                    for t in 0..n {
                        let v = got[t * rows + r];
                        if r == 0 {
                            assert!(v.is_nan(), "{dtype:?}: row 0 was not asked for");
                            continue;
                        }
                        let a = &x.q8[t * cols / QK..(t + 1) * cols / QK];
                        // (below AVX-512 the super-block formats read other activations)
                        let want = if is_chunked(dtype) { chunked::dot_scalar(dtype, w.row(r), [a])[0] } else { dot_row(&w, r, None, &x, [t], SimdLevel::Scalar)[0] };
                        // the size of the sum's terms, sum |w a|, bounds the summation-order error
                        let mut wr = vec![0.0f32; cols];
                        w.dequantize_row(r, &mut wr);
                        let terms: f32 = wr.iter().enumerate().map(|(i, wi)| (wi * a[i / QK].d * a[i / QK].qs[i % QK] as f32).abs()).sum();
                        assert!((v - want).abs() <= 1e-5 * terms, "{dtype:?} cols {cols} row {r} token {t}: {v} vs {want}");
                    }
                }
            }
        }
    }
}
