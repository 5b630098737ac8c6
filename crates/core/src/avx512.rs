//! AVX-512 (F, BW, VL, VNNI) kernels: integer dot products of quantized weight rows with int8
//! activations (twins of `quant::dot_*_scalar`), and the sparse down projection y += sum of
//! a[r] * row r (twin of R calls of `quant::axpy_scalar`), each tested against its scalar twin.
//! They must only be called after `matmul::simd_level()` reported `Avx512`.
//!
//! The dots take two weight blocks per step into one 512-bit register, in the order of an
//! `ActPair` (the activations rearranged once per product, see `quant::ActPair`), so one
//! `vpdpbusd` does 64 multiply-adds; each lane is scaled by its block's weight scale times
//! activation scale, and the blocks' offsets (Q4_0's -8, Q8_0's sign flip, Q4_1's minimum) are
//! applied once per block from the activation sums.
//!
//! 4-bit rows are decoded by table lookup instead of integer-to-float conversion: a block's 16
//! possible values times the row's coefficient form one 16-lane table (`(q - 8) * d * a` for
//! Q4_0, `q * d * a + m * a` for Q4_1), and `vpermps` picks each element's value by its nibble
//! (it reads only the low 4 bits of every index lane, so the low nibble needs no masking). That
//! is two shuffles and two adds per 32 weights and row, where the AVX2 path widens, converts and
//! multiplies every element.

#![allow(clippy::missing_safety_doc)]

use std::arch::x86_64::*;

use crate::quant::{ActPair, BlockQ4_0, BlockQ4_1, BlockQ8Act, BlockQ8_0, DType};

/// An f16 scale as an f32 broadcast to 16 lanes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn splat_f16(bits: u16) -> __m512 {
    _mm512_cvtph_ps(_mm256_set1_epi16(bits as i16))
}

/// 16 weights of a float type as f32 lanes, starting at element k.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn load16(dtype: DType, w: *const u8, k: usize) -> __m512 {
    match dtype {
        DType::F32 => _mm512_loadu_ps((w as *const f32).add(k)),
        DType::F16 => _mm512_cvtph_ps(_mm256_loadu_si256((w as *const u16).add(k) as *const __m256i)),
        // bf16 is the top half of an f32: widen and shift left by 16.
        _ => {
            let h = _mm256_loadu_si256((w as *const u16).add(k) as *const __m256i);
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
        }
    }
}

/// y += sum over r of a[r] * rows[r], R rows per pass over y (each block of y is loaded and
/// stored once per R rows). SIMD twin of R calls of `quant::axpy_scalar`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub unsafe fn axpy_rows<const R: usize>(dtype: DType, rows: [&[u8]; R], a: [f32; R], y: &mut [f32]) {
    let n = y.len();
    let yp = y.as_mut_ptr();
    let av = a.map(|v| _mm512_set1_ps(v));
    // the 16 values of a nibble, as f32 lanes: 0..16
    let nibble_values = _mm512_setr_ps(0., 1., 2., 3., 4., 5., 6., 7., 8., 9., 10., 11., 12., 13., 14., 15.);
    // 4-bit blocks: `$table` gives the 16 values a nibble stands for, times the row's coefficient
    macro_rules! nibble_rows {
        ($block:ty, |$b:ident, $a:ident| $table:expr) => {{
            let blocks = rows.map(|r| crate::quant::cast_blocks::<$block>(r));
            for i in 0..n / 32 {
                let p = yp.add(32 * i);
                let (mut lo, mut hi) = (_mm512_loadu_ps(p), _mm512_loadu_ps(p.add(16)));
                for r in 0..R {
                    let ($b, $a) = (blocks[r].get_unchecked(i), av[r]);
                    let table = $table;
                    // byte k holds element k (low nibble) and element k + 16 (high nibble)
                    let q = _mm512_cvtepu8_epi32(_mm_loadu_si128($b.qs.as_ptr() as *const __m128i));
                    lo = _mm512_add_ps(lo, _mm512_permutexvar_ps(q, table));
                    hi = _mm512_add_ps(hi, _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(q), table));
                }
                _mm512_storeu_ps(p, lo);
                _mm512_storeu_ps(p.add(16), hi);
            }
        }};
    }
    match dtype {
        DType::F32 | DType::F16 | DType::BF16 => {
            let n16 = n / 16 * 16;
            let mut k = 0;
            while k < n16 {
                let p = yp.add(k);
                let mut acc = _mm512_loadu_ps(p);
                for r in 0..R {
                    acc = _mm512_fmadd_ps(load16(dtype, rows[r].as_ptr(), k), av[r], acc);
                }
                _mm512_storeu_ps(p, acc);
                k += 16;
            }
            if n16 < n {
                let eb = dtype.block_bytes();
                for r in 0..R {
                    crate::quant::axpy_scalar(dtype, &rows[r][n16 * eb..], a[r], &mut y[n16..]);
                }
            }
        }
        DType::Q4_0 => {
            let centered = _mm512_sub_ps(nibble_values, _mm512_set1_ps(8.0)); // q - 8
            nibble_rows!(BlockQ4_0, |b, a| _mm512_mul_ps(centered, _mm512_mul_ps(a, splat_f16(b.d))))
        }
        // q * d * a + m * a
        DType::Q4_1 => nibble_rows!(BlockQ4_1, |b, a| _mm512_fmadd_ps(nibble_values, _mm512_mul_ps(a, splat_f16(b.d)), _mm512_mul_ps(a, splat_f16(b.m)))),
        DType::Q8_0 => {
            let blocks = rows.map(|r| crate::quant::cast_blocks::<BlockQ8_0>(r));
            for i in 0..n / 32 {
                let p = yp.add(32 * i);
                let (mut lo, mut hi) = (_mm512_loadu_ps(p), _mm512_loadu_ps(p.add(16)));
                for r in 0..R {
                    let b = blocks[r].get_unchecked(i);
                    let s = _mm512_mul_ps(av[r], splat_f16(b.d));
                    let q = b.qs.as_ptr() as *const __m128i;
                    lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q))), s, lo);
                    hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q.add(1)))), s, hi);
                }
                _mm512_storeu_ps(p, lo);
                _mm512_storeu_ps(p.add(16), hi);
            }
        }
    }
}

/// Two f16 scales as f32 lanes in `ActPair` order: [x0 x4, x1 x4, x0 x4, x1 x4].
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn pair_scales(x0: u16, x1: u16) -> __m512 {
    let both = _mm_cvtph_ps(_mm_cvtsi32_si128((x0 as u32 | (x1 as u32) << 16) as i32)); // [x0, x1, 0, 0]
    let lanes = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1);
    _mm512_permutexvar_ps(lanes, _mm512_castps128_ps512(both))
}

/// Two blocks' 16-byte nibble arrays as 64 unsigned bytes in `ActPair` order.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn pair_nibbles(q0: &[u8; 16], q1: &[u8; 16]) -> __m512i {
    let q = _mm256_set_m128i(_mm_loadu_si128(q1.as_ptr() as *const __m128i), _mm_loadu_si128(q0.as_ptr() as *const __m128i));
    let mask = _mm256_set1_epi8(0x0F);
    let lo = _mm256_and_si256(q, mask); // [block 0 elements 0..16, block 1 elements 0..16]
    let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q), mask); // elements 16..32
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
}

/// Sum of the 16 lanes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn hsum(v: __m512) -> f32 {
    _mm512_reduce_add_ps(v)
}

/// The dot loop shared by the quantized types: per pair of blocks, `weights(i)` gives the 64
/// unsigned weight bytes (in `ActPair` order) and the two weight scales, `offset(i)` the two
/// per-block values multiplied by the activation sums `s`. An odd last block goes to `tail`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn dot_pairs<const N: usize>(
    n_blocks: usize,
    pairs: [&[ActPair]; N],
    next: &[u8],
    weights: impl Fn(usize) -> (__m512i, __m512),
    offset: impl Fn(usize, __m512) -> __m512,
) -> [f32; N] {
    let mut acc = [_mm512_setzero_ps(); N];
    let mut off = [_mm512_setzero_ps(); N];
    // `next` is prefetched evenly over the pairs (see `matmul::dot_row`)
    let step = next.len().div_ceil((n_blocks / 2).max(1));
    for i in 0..n_blocks / 2 {
        if step > 0 {
            _mm_prefetch::<_MM_HINT_T0>(next.as_ptr().wrapping_add(i * step) as *const i8);
        }
        let (w, d) = weights(i);
        let o = offset(i, d);
        for j in 0..N {
            let p = pairs[j].get_unchecked(i);
            let a = _mm512_loadu_si512(p.qs.as_ptr() as *const _);
            let dot = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w, a));
            acc[j] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d, _mm512_loadu_ps(p.d.as_ptr())), acc[j]);
            off[j] = _mm512_fmadd_ps(o, _mm512_loadu_ps(p.s8.as_ptr()), off[j]);
        }
    }
    let mut out = [0.0f32; N];
    for j in 0..N {
        out[j] = hsum(acc[j]) + hsum(off[j]);
    }
    out
}

/// The odd last block of a row, if any, through the AVX2 kernel.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn add_tail<B, const N: usize>(
    out: &mut [f32; N],
    w: &[B],
    a: [&[BlockQ8Act]; N],
    kernel: unsafe fn(&[B], [&[BlockQ8Act]; N]) -> [f32; N],
) {
    if w.len() % 2 == 1 {
        let last = w.len() - 1;
        let t = kernel(&w[last..], a.map(|r| &r[last..]));
        for j in 0..N {
            out[j] += t[j];
        }
    }
}

/// Twin of `quant::dot_q4_0_scalar`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub unsafe fn dot_q4_0<const N: usize>(w: &[BlockQ4_0], a: [&[BlockQ8Act]; N], pairs: [&[ActPair]; N], next: &[u8]) -> [f32; N] {
    let minus8 = _mm512_set1_ps(-8.0);
    let mut out = dot_pairs(
        w.len(),
        pairs,
        next,
        |i| {
            let (b0, b1) = (w.get_unchecked(2 * i), w.get_unchecked(2 * i + 1));
            (pair_nibbles(&b0.qs, &b1.qs), pair_scales(b0.d, b1.d))
        },
        // sum((q - 8) * a) = sum(q * a) - 8 * sum(a)
        |_, d| _mm512_mul_ps(d, minus8),
    );
    add_tail(&mut out, w, a, crate::avx2::dot_q4_0::<N>);
    out
}

/// Twin of `quant::dot_q4_1_scalar`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub unsafe fn dot_q4_1<const N: usize>(w: &[BlockQ4_1], a: [&[BlockQ8Act]; N], pairs: [&[ActPair]; N], next: &[u8]) -> [f32; N] {
    let mut out = dot_pairs(
        w.len(),
        pairs,
        next,
        |i| {
            let (b0, b1) = (w.get_unchecked(2 * i), w.get_unchecked(2 * i + 1));
            (pair_nibbles(&b0.qs, &b1.qs), pair_scales(b0.d, b1.d))
        },
        // sum((d q + m) * a) = d sum(q a) + m sum(a)
        |i, _| pair_scales(w.get_unchecked(2 * i).m, w.get_unchecked(2 * i + 1).m),
    );
    add_tail(&mut out, w, a, crate::avx2::dot_q4_1::<N>);
    out
}

/// Twin of `quant::dot_q8_0_scalar`. `vpdpbusd` multiplies unsigned by signed bytes, so the
/// weights go in as q + 128 (their sign bit flipped) and 128 * sum(a) comes off per block.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub unsafe fn dot_q8_0<const N: usize>(w: &[BlockQ8_0], a: [&[BlockQ8Act]; N], pairs: [&[ActPair]; N], next: &[u8]) -> [f32; N] {
    let minus128 = _mm512_set1_ps(-128.0);
    let sign = _mm512_set1_epi8(-128);
    // 128-bit lanes [b0 lo, b0 hi, b1 lo, b1 hi] -> [b0 lo, b1 lo, b0 hi, b1 hi]
    let order = _mm512_setr_epi64(0, 1, 4, 5, 2, 3, 6, 7);
    let mut out = dot_pairs(
        w.len(),
        pairs,
        next,
        |i| {
            let (b0, b1) = (w.get_unchecked(2 * i), w.get_unchecked(2 * i + 1));
            let q0 = _mm256_loadu_si256(b0.qs.as_ptr() as *const __m256i);
            let q1 = _mm256_loadu_si256(b1.qs.as_ptr() as *const __m256i);
            let both = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(q0), q1);
            (_mm512_xor_si512(_mm512_permutexvar_epi64(order, both), sign), pair_scales(b0.d, b1.d))
        },
        |_, d| _mm512_mul_ps(d, minus128),
    );
    add_tail(&mut out, w, a, crate::avx2::dot_q8_0::<N>);
    out
}
