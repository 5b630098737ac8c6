//! AVX2 twins of `chunked`'s chunk decoders: each format's decoder unpacks 32 weights into one
//! register of signed bytes (the `Chunk::v` of the scalar decoder, tested equal) with the
//! halves' scales as [s0 x 4, s1 x 4] and the minimum. They serve the sparse down projection
//! (`axpy_rows`) of every chunked format and the last blocks of a row in the AVX-512 dots
//! (`avx512::dot_chunked`). The dot products read whole blocks elsewhere: the 32-weight formats
//! through `avx2::LegacyBlock` (this module implements it for Q5_0, Q5_1, IQ4_NL and MXFP4), the
//! super-block formats per 256 (`q256_x86`).

#![allow(clippy::missing_safety_doc)]

use std::arch::x86_64::*;

use super::chunks::{
    e8m0_half, BlockIQ4NL, BlockIQ4XS, BlockMXFP4, BlockQ2K, BlockQ3K, BlockQ4K, BlockQ5K,
    BlockQ5_0, BlockQ5_1, BlockQ6K, IQ4_VALUES, MXFP4_VALUES,
};
use super::{cast_blocks, BlockQ4_0, BlockQ4_1, BlockQ8_0, DType, QK};
// an f16 scale broadcast to 8 f32 lanes (see there why a broadcast)
use crate::avx2::splat_f16 as f16;
use crate::avx2::LegacyBlock;

/// One decoded chunk: 32 signed weights, the halves' scales as [s0 x 4, s1 x 4], and the
/// minimum (per chunk in every lane of `min`, or per half in `min_halves`).
pub(crate) struct Decoded {
    pub(crate) v: __m256i,
    pub(crate) scale: __m256,
    pub(crate) min: __m256,
    pub(crate) min_halves: __m256,
}

impl Decoded {
    /// A chunk of zero weights with zero scales (the padding of a row's last step).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn zero() -> Decoded {
        Decoded {
            v: _mm256_setzero_si256(),
            scale: _mm256_setzero_ps(),
            min: _mm256_setzero_ps(),
            min_halves: _mm256_setzero_ps(),
        }
    }
}

/// `d` times a small integer, in every lane.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn times(d: __m256, q: i32) -> __m256 {
    _mm256_mul_ps(d, _mm256_set1_ps(q as f32))
}

/// `d` times [a x 4, b x 4]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn halves(d: __m256, a: i32, b: i32) -> __m256 {
    _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_set_m128i(_mm_set1_epi32(b), _mm_set1_epi32(a))))
}

/// 16 bytes of nibbles to 32 bytes: the low nibbles, then the high ones.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn nibbles(p: *const u8) -> __m256i {
    let q = _mm_loadu_si128(p as *const __m128i);
    let mask = _mm_set1_epi8(0x0F);
    _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), mask), _mm_and_si128(q, mask))
}

/// Byte i = 0xFF where bit i of `bits` is set.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn bits_to_bytes(bits: u32) -> __m256i {
    let q = _mm256_set1_epi32(bits as i32);
    #[rustfmt::skip]
    let spread = _mm256_setr_epi8(
        0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
        2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3,
    );
    let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(q, spread), bit), bit)
}

/// Bytes of `x` shifted right by `n` bits within each 16-bit lane (the caller masks).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn shr(x: __m256i, n: usize) -> __m256i {
    _mm256_srl_epi16(x, _mm_cvtsi32_si128(n as i32))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn load32(p: *const u8) -> __m256i {
    _mm256_loadu_si256(p as *const __m256i)
}

/// 0xFF in the bytes of `x` that have bit `c` set.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn has_bit(x: __m256i, c: usize) -> __m256i {
    let m = _mm256_set1_epi8((1u8 << c) as i8);
    _mm256_cmpeq_epi8(_mm256_and_si256(x, m), m)
}

/// Chunk k of a row of `dtype`: the SIMD twin of `chunks::chunk`. The row loops call the
/// per-format decoders directly, so that each loop is compiled for one format.
#[cfg(test)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn decode(dtype: DType, row: &[u8], k: usize) -> Decoded {
    let per_block = chunks_per_block(dtype);
    let (b, c) = (k / per_block, k % per_block);
    match dtype {
        DType::Q5_0 => q5_0(row, b, c),
        DType::Q5_1 => q5_1(row, b, c),
        DType::Q2_K => q2_k(row, b, c),
        DType::Q3_K => q3_k(row, b, c),
        DType::Q4_K => q4_k(row, b, c),
        DType::Q5_K => q5_k(row, b, c),
        DType::Q6_K => q6_k(row, b, c),
        DType::IQ4_NL => iq4_nl(row, b, c),
        DType::IQ4_XS => iq4_xs(row, b, c),
        DType::MXFP4 => mxfp4(row, b, c),
        _ => unreachable!("{} is not a chunked type", dtype.name()),
    }
}

/// Chunks per block: 1 for the 32-weight formats, 8 for the 256-weight ones. A constant in
/// each row loop, so that the loop over a block's chunks unrolls into straight code with
/// constant shifts, and the block's scales are read once.
pub(crate) const fn chunks_per_block(dtype: DType) -> usize {
    match dtype {
        DType::Q4_0
        | DType::Q4_1
        | DType::Q8_0
        | DType::Q5_0
        | DType::Q5_1
        | DType::IQ4_NL
        | DType::MXFP4 => 1,
        _ => super::QK_K / QK,
    }
}

const LOW4: i8 = 0x0F;

/// Q4_0 (`with_decoder` has a decoder for every quantized type): q - 8.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn q4_0(row: &[u8], b: usize, _c: usize) -> Decoded {
    let x = cast_blocks::<BlockQ4_0>(row).get_unchecked(b);
    let v = _mm256_sub_epi8(nibbles(x.qs.as_ptr()), _mm256_set1_epi8(8));
    Decoded { v, scale: f16(x.d), min: _mm256_setzero_ps(), min_halves: _mm256_setzero_ps() }
}

/// Q4_1: d * q + m, as d * q - (-m).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn q4_1(row: &[u8], b: usize, _c: usize) -> Decoded {
    let x = cast_blocks::<BlockQ4_1>(row).get_unchecked(b);
    Decoded {
        v: nibbles(x.qs.as_ptr()),
        scale: f16(x.d),
        min: _mm256_sub_ps(_mm256_setzero_ps(), f16(x.m)),
        min_halves: _mm256_setzero_ps(),
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn q8_0(row: &[u8], b: usize, _c: usize) -> Decoded {
    let x = cast_blocks::<BlockQ8_0>(row).get_unchecked(b);
    Decoded {
        v: load32(x.qs.as_ptr() as *const u8),
        scale: f16(x.d),
        min: _mm256_setzero_ps(),
        min_halves: _mm256_setzero_ps(),
    }
}

impl LegacyBlock for BlockIQ4NL {
    const WIDE: bool = true;
    fn scale_bits(&self) -> u16 {
        self.d
    }

    /// The grid values of the nibbles, as `iq4_nl` decodes them.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn weights(&self) -> __m256i {
        let table =
            _mm256_broadcastsi128_si256(_mm_loadu_si128(IQ4_VALUES.as_ptr() as *const __m128i));
        _mm256_shuffle_epi8(table, nibbles(self.qs.as_ptr()))
    }
}

impl LegacyBlock for BlockMXFP4 {
    const F16_SCALE: bool = false;
    // |v| <= 12: a pair of products is at most 2 * 12 * 127 = 3048, and the eight a row group
    // adds (four in one-token dots) stay within 16 bits (24 384), so no widening (`WIDE`)

    fn scale_bits(&self) -> u16 {
        self.e as u16
    }
    #[inline]
    fn scale(&self) -> f32 {
        e8m0_half(self.e)
    }

    /// The doubled E2M1 values of the nibbles, as `mxfp4` decodes them.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn weights(&self) -> __m256i {
        let table =
            _mm256_broadcastsi128_si256(_mm_loadu_si128(MXFP4_VALUES.as_ptr() as *const __m128i));
        _mm256_shuffle_epi8(table, nibbles(self.qs.as_ptr()))
    }
}

/// A Q5_0/Q5_1 block's 32 unsigned 5-bit values: the nibbles of `qs` and bit i of `qh` as 16.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn five_bits(qs: &[u8; QK / 2], qh: [u8; 4]) -> __m256i {
    let high = _mm256_and_si256(bits_to_bytes(u32::from_le_bytes(qh)), _mm256_set1_epi8(0x10));
    _mm256_or_si256(nibbles(qs.as_ptr()), high)
}

impl LegacyBlock for BlockQ5_1 {
    const MIN: bool = true;
    const WIDE: bool = true;
    fn scale_bits(&self) -> u16 {
        self.d
    }

    fn min_bits(&self) -> u16 {
        self.m
    }

    /// q (the fifth bits from `qh`).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn weights(&self) -> __m256i {
        five_bits(&self.qs, self.qh)
    }
}

impl LegacyBlock for BlockQ5_0 {
    const OFFSET: i32 = 16;
    fn scale_bits(&self) -> u16 {
        self.d
    }

    /// q - 16 (the fifth bits from `qh`).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn weights(&self) -> __m256i {
        _mm256_sub_epi8(five_bits(&self.qs, self.qh), _mm256_set1_epi8(16))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn unsigned(&self) -> __m256i {
        five_bits(&self.qs, self.qh)
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn q5_0(row: &[u8], b: usize, _c: usize) -> Decoded {
    let x = cast_blocks::<BlockQ5_0>(row).get_unchecked(b);
    let v = x.weights();
    Decoded { v, scale: f16(x.d), min: _mm256_setzero_ps(), min_halves: _mm256_setzero_ps() }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn q5_1(row: &[u8], b: usize, _c: usize) -> Decoded {
    let x = cast_blocks::<BlockQ5_1>(row).get_unchecked(b);
    let v = x.weights();
    // (d * q) + m, as d * q - (-m)
    Decoded {
        v,
        scale: f16(x.d),
        min: _mm256_sub_ps(_mm256_setzero_ps(), f16(x.m)),
        min_halves: _mm256_setzero_ps(),
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn q2_k(row: &[u8], b: usize, c: usize) -> Decoded {
    let x = cast_blocks::<BlockQ2K>(row).get_unchecked(b);
    let (g, s) = (c / 4, c % 4);
    let v = _mm256_and_si256(shr(load32(x.qs.as_ptr().add(32 * g)), 2 * s), _mm256_set1_epi8(3));
    let (d, dmin) = (f16(x.d), f16(x.dmin));
    let (s0, s1) = (x.scales[2 * c], x.scales[2 * c + 1]);
    Decoded {
        v,
        scale: halves(d, (s0 & 0x0F) as i32, (s1 & 0x0F) as i32),
        min: _mm256_setzero_ps(),
        min_halves: halves(dmin, (s0 >> 4) as i32, (s1 >> 4) as i32),
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn q3_k(row: &[u8], b: usize, c: usize) -> Decoded {
    let x = cast_blocks::<BlockQ3K>(row).get_unchecked(b);
    let (g, s) = (c / 4, c % 4);
    let low = _mm256_and_si256(shr(load32(x.qs.as_ptr().add(32 * g)), 2 * s), _mm256_set1_epi8(3));
    // low - 4 where the high bit is clear
    let high = _mm256_and_si256(has_bit(load32(x.hmask.as_ptr()), c), _mm256_set1_epi8(4));
    let v = _mm256_sub_epi8(_mm256_add_epi8(low, high), _mm256_set1_epi8(4));
    let d = f16(x.d);
    let scale = |j: usize| {
        let low = (x.scales[j % 8] >> (4 * (j / 8))) & 0x0F;
        let high = (x.scales[8 + j % 4] >> (2 * (j / 4))) & 3;
        (low | (high << 4)) as i32 - 32
    };
    Decoded {
        v,
        scale: halves(d, scale(2 * c), scale(2 * c + 1)),
        min: _mm256_setzero_ps(),
        min_halves: _mm256_setzero_ps(),
    }
}

/// Q4_K's and Q5_K's common part: the low 4 bits, the scale and the minimum.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn k4(d: u16, dmin: u16, scales: &[u8; 12], qs: *const u8, c: usize) -> Decoded {
    let (sc, m) = super::chunks::scale_min_k4(scales, c);
    let (g, h) = (c / 2, c % 2);
    let v = _mm256_and_si256(shr(load32(qs.add(32 * g)), 4 * h), _mm256_set1_epi8(LOW4));
    Decoded {
        v,
        scale: times(f16(d), sc as i32),
        min: times(f16(dmin), m as i32),
        min_halves: _mm256_setzero_ps(),
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn q4_k(row: &[u8], b: usize, c: usize) -> Decoded {
    let x = cast_blocks::<BlockQ4K>(row).get_unchecked(b);
    k4(x.d, x.dmin, &x.scales, x.qs.as_ptr(), c)
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn q5_k(row: &[u8], b: usize, c: usize) -> Decoded {
    let x = cast_blocks::<BlockQ5K>(row).get_unchecked(b);
    let mut ch = k4(x.d, x.dmin, &x.scales, x.qs.as_ptr(), c);
    ch.v = _mm256_or_si256(
        ch.v,
        _mm256_and_si256(has_bit(load32(x.qh.as_ptr()), c), _mm256_set1_epi8(0x10)),
    );
    ch
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn q6_k(row: &[u8], b: usize, c: usize) -> Decoded {
    let x = cast_blocks::<BlockQ6K>(row).get_unchecked(b);
    let (g, s) = (c / 4, c % 4);
    let low = _mm256_and_si256(
        shr(load32(x.ql.as_ptr().add(64 * g + 32 * (s % 2))), 4 * (s / 2)),
        _mm256_set1_epi8(LOW4),
    );
    let high = _mm256_and_si256(shr(load32(x.qh.as_ptr().add(32 * g)), 2 * s), _mm256_set1_epi8(3));
    let v = _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(high, 4)), _mm256_set1_epi8(32));
    let d = f16(x.d);
    Decoded {
        v,
        scale: halves(d, x.scales[2 * c] as i32, x.scales[2 * c + 1] as i32),
        min: _mm256_setzero_ps(),
        min_halves: _mm256_setzero_ps(),
    }
}

/// 16 bytes of IQ4 nibbles to their grid values.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn iq4(qs: *const u8, scale: __m256) -> Decoded {
    let table = _mm256_broadcastsi128_si256(_mm_loadu_si128(IQ4_VALUES.as_ptr() as *const __m128i));
    Decoded {
        v: _mm256_shuffle_epi8(table, nibbles(qs)),
        scale,
        min: _mm256_setzero_ps(),
        min_halves: _mm256_setzero_ps(),
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn iq4_nl(row: &[u8], b: usize, _c: usize) -> Decoded {
    let x = cast_blocks::<BlockIQ4NL>(row).get_unchecked(b);
    iq4(x.qs.as_ptr(), f16(x.d))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn iq4_xs(row: &[u8], b: usize, c: usize) -> Decoded {
    let x = cast_blocks::<BlockIQ4XS>(row).get_unchecked(b);
    iq4(x.qs.as_ptr().add(16 * c), times(f16(x.d), super::chunks::iq4_xs_scale(x, c)))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn mxfp4(row: &[u8], b: usize, _c: usize) -> Decoded {
    let x = cast_blocks::<BlockMXFP4>(row).get_unchecked(b);
    Decoded {
        v: x.weights(),
        scale: _mm256_set1_ps(e8m0_half(x.e)),
        min: _mm256_setzero_ps(),
        min_halves: _mm256_setzero_ps(),
    }
}

/// `$then!(decoder, DType)` with `$dtype`'s chunk decoder, for any quantized type: one arm per
/// format with its DType as a constant, so that the code `$then` expands to compiles for one
/// format at a time (the sparse down projection and the AVX-512 one-token dots' last blocks).
macro_rules! with_decoder {
    ($dtype:expr, $then:ident) => {{
        use $crate::quant::chunks_x86 as decoders;
        use $crate::quant::DType as T;
        match $dtype {
            T::Q4_0 => $then!(decoders::q4_0, T::Q4_0),
            T::Q4_1 => $then!(decoders::q4_1, T::Q4_1),
            T::Q8_0 => $then!(decoders::q8_0, T::Q8_0),
            T::Q5_0 => $then!(decoders::q5_0, T::Q5_0),
            T::Q5_1 => $then!(decoders::q5_1, T::Q5_1),
            T::Q2_K => $then!(decoders::q2_k, T::Q2_K),
            T::Q3_K => $then!(decoders::q3_k, T::Q3_K),
            T::Q4_K => $then!(decoders::q4_k, T::Q4_K),
            T::Q5_K => $then!(decoders::q5_k, T::Q5_K),
            T::Q6_K => $then!(decoders::q6_k, T::Q6_K),
            T::IQ4_NL => $then!(decoders::iq4_nl, T::IQ4_NL),
            T::IQ4_XS => $then!(decoders::iq4_xs, T::IQ4_XS),
            T::MXFP4 => $then!(decoders::mxfp4, T::MXFP4),
            other => unreachable!("{} is not a quantized type", other.name()),
        }
    }};
}
pub(crate) use with_decoder;

/// y += sum over r of a[r] * row r, for R rows of a chunked type (the sparse down projection):
/// each chunk decoded, its weights scale * v - min widened to floats. The SIMD twin of R calls
/// of `chunks::axpy_scalar` (each weight rounded as there; the sum fused). `next` is prefetched
/// over the chunks (see `avx2::axpy_rows`).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn axpy_rows<const R: usize>(
    dtype: DType,
    rows: [&[u8]; R],
    a: [f32; R],
    y: &mut [f32],
    next: &[&[u8]],
) {
    match dtype {
        DType::Q4_K => axpy_rows_k4::<R, false>(rows, a, y, next),
        DType::Q5_K => axpy_rows_k4::<R, true>(rows, a, y, next),
        _ => axpy_rows_chunks::<R>(dtype, rows, a, y, next),
    }
}

/// `axpy_rows` through the chunk decoders, for every chunked type.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn axpy_rows_chunks<const R: usize>(
    dtype: DType,
    rows: [&[u8]; R],
    a: [f32; R],
    y: &mut [f32],
    next: &[&[u8]],
) {
    let (n, yp) = (y.len(), y.as_mut_ptr());
    let mut prefetch = crate::avx2::Prefetch::new(next, n / QK);
    macro_rules! rows_axpy {
        ($decode:path, $dtype:expr) => {{
            const PER_BLOCK: usize = chunks_per_block($dtype);
            for k in 0..n / QK {
                prefetch.step();
                let p = yp.add(QK * k);
                let mut acc = [
                    _mm256_loadu_ps(p),
                    _mm256_loadu_ps(p.add(8)),
                    _mm256_loadu_ps(p.add(16)),
                    _mm256_loadu_ps(p.add(24)),
                ];
                for r in 0..R {
                    let ch = $decode(rows[r], k / PER_BLOCK, k % PER_BLOCK);
                    // the halves' scales and minima ([h0 x 4, h1 x 4]) to all lanes each
                    let min = _mm256_add_ps(ch.min, ch.min_halves);
                    let scale = [
                        _mm256_permute2f128_ps::<0x00>(ch.scale, ch.scale),
                        _mm256_permute2f128_ps::<0x11>(ch.scale, ch.scale),
                    ];
                    let min = [
                        _mm256_permute2f128_ps::<0x00>(min, min),
                        _mm256_permute2f128_ps::<0x11>(min, min),
                    ];
                    let w = crate::avx2::i8x32_to_f32x4(ch.v);
                    let ar = _mm256_set1_ps(a[r]);
                    for j in 0..4 {
                        let weight = _mm256_sub_ps(_mm256_mul_ps(scale[j / 2], w[j]), min[j / 2]);
                        acc[j] = _mm256_fmadd_ps(weight, ar, acc[j]);
                    }
                }
                for (j, v) in acc.into_iter().enumerate() {
                    _mm256_storeu_ps(p.add(8 * j), v);
                }
            }
        }};
    }
    with_decoder!(dtype, rows_axpy)
}

/// `axpy_rows` for Q4_K (and with `Q5`, Q5_K): y += sum over r of a[r] * (scale * v - min)
/// computed as y + sum over r of (a[r] * scale) * v, less the rows' a[r] * min summed once
/// per chunk. Each row's eight chunk scales and minima of a super-block are worked out once,
/// not once per chunk, and a weight costs one fused multiply-add where the chunk loop spends a
/// multiply, a subtraction and a fused multiply-add (the axpy was more than half of the
/// sparse Q4_K FFN's time, port-bound on float operations). Equal to R calls of
/// `chunks::axpy_scalar` up to float rounding (tested there, as every type's axpy).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn axpy_rows_k4<const R: usize, const Q5: bool>(
    rows: [&[u8]; R],
    a: [f32; R],
    y: &mut [f32],
    next: &[&[u8]],
) {
    let (n, yp) = (y.len(), y.as_mut_ptr());
    let mut prefetch = crate::avx2::Prefetch::new(next, n / QK);
    let ar = a.map(|v| _mm256_set1_ps(v));
    let zero = _mm256_setzero_ps();
    for b in 0..n / 256 {
        // per row and chunk a[r] * d * scale; per chunk the sum over rows of a[r] * dmin * min
        // (lane c of a vector is chunk c's; the loop below broadcasts them from memory)
        let mut scale = [[0.0f32; 8]; R];
        let mut offset = [0.0f32; 8];
        let mut offsets = zero;
        let mut qs = [std::ptr::null::<u8>(); R];
        let mut qh = [std::ptr::null::<u8>(); R];
        for r in 0..R {
            let (d, dmin, scales) = if Q5 {
                let x = cast_blocks::<BlockQ5K>(rows[r]).get_unchecked(b);
                (qs[r], qh[r]) = (x.qs.as_ptr(), x.qh.as_ptr());
                (x.d, x.dmin, &x.scales)
            } else {
                let x = cast_blocks::<BlockQ4K>(rows[r]).get_unchecked(b);
                qs[r] = x.qs.as_ptr();
                (x.d, x.dmin, &x.scales)
            };
            let (sc, m) = scales_mins_k4(scales);
            let row_scale = _mm256_mul_ps(_mm256_mul_ps(f16(d), sc), ar[r]);
            _mm256_storeu_ps(scale[r].as_mut_ptr(), row_scale);
            offsets = _mm256_fmadd_ps(_mm256_mul_ps(f16(dmin), m), ar[r], offsets);
        }
        _mm256_storeu_ps(offset.as_mut_ptr(), offsets);
        // chunks 2g and 2g + 1: the low and high nibbles of the same 32 bytes, each 8 of them
        // widened to 32-bit lanes once (as they are loaded) for both chunks' 8 weights (a chunk
        // at a time, each widened its bytes again and shuffled them into place: Q4_K sparse FFN,
        // 7B shape, AVX2, AMD EPYC, 80% / 90% skipped: 1 thread 0.80-0.83 -> 0.75-0.76 ms at
        // 90%, 2 threads 0.84 -> 0.77 ms and 0.43 -> 0.39-0.40 ms)
        let widened = |bytes: *const u8, k: usize| {
            _mm256_cvtepu8_epi32(_mm_loadl_epi64(bytes.add(8 * k) as *const __m128i))
        };
        for g in 0..4 {
            prefetch.step();
            prefetch.step();
            let p = yp.add(256 * b + 2 * QK * g);
            let mut acc: [__m256; 8] = std::array::from_fn(|k| _mm256_loadu_ps(p.add(8 * k)));
            for r in 0..R {
                let (s_lo, s_hi) = (
                    _mm256_broadcast_ss(&scale[r][2 * g]),
                    _mm256_broadcast_ss(&scale[r][2 * g + 1]),
                );
                for k in 0..4 {
                    let q = widened(qs[r].add(32 * g), k);
                    let mut lo = _mm256_and_si256(q, _mm256_set1_epi32(LOW4 as i32));
                    let mut hi = _mm256_srli_epi32::<4>(q);
                    if Q5 {
                        // bit c of qh's byte i: the fifth bit of chunk c's weight i
                        let h =
                            _mm256_srl_epi32(widened(qh[r], k), _mm_cvtsi32_si128(2 * g as i32));
                        let bit4 = _mm256_set1_epi32(0x10);
                        lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi32::<4>(h), bit4));
                        hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi32::<3>(h), bit4));
                    }
                    acc[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), s_lo, acc[k]);
                    acc[4 + k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), s_hi, acc[4 + k]);
                }
            }
            let (o_lo, o_hi) =
                (_mm256_broadcast_ss(&offset[2 * g]), _mm256_broadcast_ss(&offset[2 * g + 1]));
            for (k, v) in acc.into_iter().enumerate() {
                _mm256_storeu_ps(p.add(8 * k), _mm256_sub_ps(v, if k < 4 { o_lo } else { o_hi }));
            }
        }
    }
}

/// The eight 6-bit chunk scales and eight minima packed in a Q4_K or Q5_K super-block's 12
/// scale bytes, as floats (lane c: chunk c), all at once: `chunks::scale_min_k4`'s values.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scales_mins_k4(scales: &[u8; 12]) -> (__m256, __m256) {
    const LOW6: u32 = 0x3f3f_3f3f;
    const LOW4: u32 = 0x0f0f_0f0f;
    const LOW2: u32 = 0x0303_0303;
    let word = |i: usize| u32::from_le_bytes([0, 1, 2, 3].map(|k| scales[4 * i + k]));
    let (w0, w1, w2) = (word(0), word(1), word(2));
    // chunks 0-3: the low six bits of bytes 0-3 (scales) and 4-7 (minima); chunks 4-7: the
    // nibbles of bytes 8-11 below the top two bits of bytes 0-3 (scales) and 4-7 (minima)
    let sc = [w0 & LOW6, (w2 & LOW4) | (((w0 >> 6) & LOW2) << 4)];
    let m = [w1 & LOW6, ((w2 >> 4) & LOW4) | (((w1 >> 6) & LOW2) << 4)];
    let floats = |v: [u32; 2]| {
        let bytes = _mm_set_epi32(0, 0, v[1] as i32, v[0] as i32);
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes))
    };
    (floats(sc), floats(m))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::chunks::{chunk, tests::random_row, Chunk};

    /// The vector decode of a super-block's scales and minima gives `scale_min_k4`'s.
    #[test]
    fn scales_mins_k4_equal_the_scalar_decode() {
        if !crate::simd::detect().has_avx2() {
            eprintln!("skipping: no AVX2 on this CPU");
            return;
        }
        let mut rng = crate::sampler::Rng::new(12);
        for _ in 0..1000 {
            let bytes: [u8; 12] = std::array::from_fn(|_| (rng.next_f32() * 256.0) as u8);
            // SAFETY: AVX2 checked above
            let (sc, m) = unsafe { scales_mins_k4(&bytes) };
            let (mut scv, mut mv) = ([0.0f32; 8], [0.0f32; 8]);
            unsafe {
                _mm256_storeu_ps(scv.as_mut_ptr(), sc);
                _mm256_storeu_ps(mv.as_mut_ptr(), m);
            }
            for c in 0..8 {
                let (want_sc, want_m) = crate::quant::chunks::scale_min_k4(&bytes, c);
                assert_eq!((scv[c], mv[c]), (want_sc as f32, want_m as f32), "{bytes:?} chunk {c}");
            }
        }
    }

    /// Q4_K's and Q5_K's own axpy loop gives the chunk decoders' loop's values, up to the
    /// rounding of its other order of operations (a few units in the last place of the
    /// largest value).
    #[test]
    fn k4_axpy_equals_the_chunk_loop() {
        if !crate::simd::detect().has_avx2() {
            eprintln!("skipping: no AVX2 on this CPU");
            return;
        }
        for dtype in [DType::Q4_K, DType::Q5_K] {
            for n in [256, 1024] {
                let rows: Vec<Vec<u8>> = (0..4).map(|r| random_row(dtype, n, 70 + r)).collect();
                let rr = [&rows[0][..], &rows[1][..], &rows[2][..], &rows[3][..]];
                let a = [0.5, -1.25, 2.0, 0.0];
                let y0: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
                let (mut y_k4, mut y_chunks) = (y0.clone(), y0.clone());
                // SAFETY: AVX2 checked above
                unsafe {
                    match dtype {
                        DType::Q4_K => axpy_rows_k4::<4, false>(rr, a, &mut y_k4, &[]),
                        _ => axpy_rows_k4::<4, true>(rr, a, &mut y_k4, &[]),
                    }
                    axpy_rows_chunks::<4>(dtype, rr, a, &mut y_chunks, &[]);
                }
                let scale = y_chunks.iter().fold(1.0f32, |m, v| m.max(v.abs()));
                for (i, (k4, ch)) in y_k4.iter().zip(&y_chunks).enumerate() {
                    assert!((k4 - ch).abs() <= 1e-6 * scale, "{dtype:?} n={n} [{i}]: {k4} vs {ch}");
                }
            }
        }
    }

    /// Every decoder gives the scalar decoder's bytes, scales and minima.
    #[test]
    fn decoders_match_scalar() {
        if !crate::simd::detect().has_avx2() {
            eprintln!("skipping: no AVX2 on this CPU");
            return;
        }
        for (s, dtype) in DType::ALL.into_iter().filter(|d| d.is_chunked()).enumerate() {
            let row = random_row(dtype, 1024, 40 + s as u64);
            let mut want = Chunk::default();
            for k in 0..1024 / QK {
                chunk(dtype, &row, k, &mut want);
                // SAFETY: AVX2 checked above
                let got = unsafe { decode(dtype, &row, k) };
                let (mut v, mut scale, mut min, mut min_halves) =
                    ([0i8; 32], [0.0f32; 8], [0.0f32; 8], [0.0f32; 8]);
                unsafe {
                    _mm256_storeu_si256(v.as_mut_ptr() as *mut __m256i, got.v);
                    _mm256_storeu_ps(scale.as_mut_ptr(), got.scale);
                    _mm256_storeu_ps(min.as_mut_ptr(), got.min);
                    _mm256_storeu_ps(min_halves.as_mut_ptr(), got.min_halves);
                }
                assert_eq!(v, want.v, "{dtype:?} chunk {k}");
                for h in 0..2 {
                    assert_eq!(scale[4 * h], want.scale[h], "{dtype:?} chunk {k} scale");
                    let min = if dtype == DType::Q2_K { min_halves[4 * h] } else { min[4 * h] };
                    assert_eq!(min, want.min[h], "{dtype:?} chunk {k} min");
                }
            }
        }
    }
}
