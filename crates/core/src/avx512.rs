//! AVX-512 (F, BW, VL, VNNI) kernels: integer dot products of quantized weight rows with int8
//! activations (twins of `quant::dot_*_scalar`), and the sparse down projection y += sum of
//! a[r] * row r (twin of R calls of `quant::axpy_scalar`), each tested against its scalar twin.
//! They must only be called after `simd::simd_level()` reported `Avx512`.
//!
//! The dots take four 32-weight blocks per step (`dot_steps`), laid out as an `ActQuad`. Q4_0,
//! Q4_1 and Q8_0 are read four blocks at a time: two overlapping 64-byte loads cover them, one
//! word permute gathers their weight bytes into the order of an `ActQuad` and another
//! broadcasts their scales to each block's four lanes; Q5_0, Q5_1, IQ4_NL and MXFP4 by their own
//! four-block readers (`direct_quad`), a row's last one to three blocks through the AVX2 chunk
//! decoders. A format's offset (Q4_0's -8, the +128 that makes signed bytes unsigned for
//! `vpdpbusd`) comes off in integers: the dot starts from the activations' exact per-lane sums
//! (`ActQuad::bias`). Each block's products sum exactly in integers and take one float step
//! per block; a step's four are summed pairwise, as a prompt's row groups
//! (`quant::q32_x86`) sum them in each lane, so a token gets bit for bit the same dot
//! alone, in batched decode and in a prompt. A row's last up to three blocks are a zero-padded
//! step.
//!
//! 4-bit rows are decoded by table lookup instead of integer-to-float conversion: a block's 16
//! possible values times the row's coefficient form one 16-lane table (`(q - 8) * d * a` for
//! Q4_0, `q * d * a + m * a` for Q4_1), and `vpermps` picks each element's value by its nibble
//! (it reads only the low 4 bits of every index lane, so the low nibble needs no masking). That
//! is two shuffles and two adds per 32 weights and row, where the AVX2 path widens, converts and
//! multiplies every element.

#![allow(clippy::missing_safety_doc)]

use crate::avx2::LineFetch;
use std::arch::x86_64::*;

use crate::quant::chunks::{
    e8m0_half, BlockIQ4NL, BlockMXFP4, BlockQ5_0, BlockQ5_1, IQ4_VALUES, MXFP4_VALUES,
};
use crate::quant::chunks_x86::Decoded;
use crate::quant::{ActQuad, BlockQ4_0, BlockQ4_1, BlockQ8_0, DType};

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
        DType::F16 => {
            _mm512_cvtph_ps(_mm256_loadu_si256((w as *const u16).add(k) as *const __m256i))
        }
        // bf16 is the top half of an f32: widen and shift left by 16.
        _ => {
            let h = _mm256_loadu_si256((w as *const u16).add(k) as *const __m256i);
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
        }
    }
}

/// `avx2::tiled_axpy` in 16 lanes (the same arithmetic, so the same bits). Safety: as there,
/// with AVX-512 F and `cols` a multiple of 16.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn tiled_axpy<const T: usize>(
    w: &[f32],
    width: usize,
    cols: usize,
    ht: &[f32],
    n: usize,
    neurons: &[u32],
    t0: usize,
    y: *mut f32,
    stride: usize,
) {
    debug_assert!(
        cols.is_multiple_of(16) && cols <= width && w.len() >= neurons.len() * width && t0 + T <= n
    );
    for c in (0..cols).step_by(16) {
        let mut acc = [_mm512_setzero_ps(); T];
        for t in 0..T {
            acc[t] = _mm512_loadu_ps(y.add(t * stride + c));
        }
        for (k, &j) in neurons.iter().enumerate() {
            let wv = _mm512_loadu_ps(w.as_ptr().add(k * width + c));
            let h = ht.as_ptr().add(j as usize * n + t0);
            for t in 0..T {
                acc[t] = _mm512_fmadd_ps(_mm512_set1_ps(*h.add(t)), wv, acc[t]);
            }
        }
        for t in 0..T {
            _mm512_storeu_ps(y.add(t * stride + c), acc[t]);
        }
    }
}

/// Byte 4m + t of a quad of rows transposed: byte m of row t, where row t's 16 bytes fill lane
/// t (so that, split into nibbles, `vpdpbusd` sums an element of four rows times their four
/// coefficients).
const QUAD_TRANSPOSE: [u8; 64] = {
    let mut idx = [0u8; 64];
    let mut i = 0;
    while i < 64 {
        idx[i] = (16 * (i % 4) + i / 4) as u8;
        i += 1;
    }
    idx
};

/// The f16 scales of up to 16 consecutive Q4_0 blocks from `row` (`n` of them, the rest 0) as
/// f32 lanes: two 128-byte windows (8 blocks of 18 bytes each), a word permute picking their
/// first words. Masked loads read nothing past the n blocks.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q4_0_scales16(row: *const u8, n: usize) -> __m512 {
    let bytes = 18 * n;
    let load = |at: usize| {
        let mask = match bytes.saturating_sub(at) {
            64.. => u64::MAX,
            left => (1u64 << left) - 1,
        };
        // (wrapping: past the n blocks the mask is 0 and the address is never read)
        _mm512_maskz_loadu_epi8(mask, row.wrapping_add(at) as *const i8)
    };
    // words 0, 9, 18, ..., 63 of a 128-byte window: the scales of its 8 blocks
    let first = _mm512_setr_epi32(
        9 << 16,
        27 << 16 | 18,
        45 << 16 | 36,
        63 << 16 | 54,
        0,
        0,
        0,
        0,
        0,
        0,
        0,
        0,
        0,
        0,
        0,
        0,
    );
    let second = _mm512_setr_epi32(
        0,
        0,
        0,
        0,
        9 << 16,
        27 << 16 | 18,
        45 << 16 | 36,
        63 << 16 | 54,
        0,
        0,
        0,
        0,
        0,
        0,
        0,
        0,
    );
    let lo = _mm512_permutex2var_epi16(load(0), first, load(64));
    let hi = _mm512_permutex2var_epi16(load(144), second, load(208));
    let words =
        _mm256_mask_mov_epi16(_mm512_castsi512_si256(lo), 0xff00, _mm512_castsi512_si256(hi));
    _mm512_cvtph_ps(words)
}

/// `quant::axpy_group_q4_0_scalar` (see there): y += sum over r of a[r] * rows[r] for up to 32
/// Q4_0 rows, their coefficients rounded to int8 per 32-column block, the nibbles of four rows
/// at a time transposed by a byte permute and multiplied by their four coefficients with
/// `vpdpbusd`: about half the instructions per block and row of `axpy_rows`' table lookups.
/// Per step of 16 blocks: every row's scales times its coefficient, their peak per block, the
/// int8 coefficients four rows to a word; then each block's quads of rows, and one float step
/// per 16 columns. `next` is prefetched over the blocks. Needs AVX-512 VBMI
/// (`simd::avx512_vbmi`) besides the level's features.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx2,fma,f16c")]
pub unsafe fn axpy_group_q4_0<const INTO_L2: bool>(
    rows: &[&[u8]],
    a: &[f32],
    y: &mut [f32],
    next: &[&[u8]],
) {
    use crate::quant::AXPY_GROUP_ROWS;
    let n_rows = rows.len();
    assert!((1..=AXPY_GROUP_ROWS).contains(&n_rows) && a.len() == n_rows);
    assert!(y.len().is_multiple_of(32), "Q4_0 rows are whole blocks");
    let nb = y.len() / 32;
    let bb = DType::Q4_0.block_bytes();
    assert!(rows.iter().all(|r| r.len() >= nb * bb));
    let n_quads = n_rows.div_ceil(4);
    let yp = y.as_mut_ptr();
    let transpose = _mm512_loadu_si512(QUAD_TRANSPOSE.as_ptr() as *const _);
    let low4 = _mm512_set1_epi8(0x0f);
    let mut prefetch = crate::avx2::PrefetchInto::<INTO_L2>::new(next, nb);
    let mut first = 0;
    while first < nb {
        let n = (nb - first).min(16);
        // each row's coefficients a[r] * d, and their peak magnitude per block
        let mut c = [_mm512_setzero_ps(); AXPY_GROUP_ROWS];
        let mut peak = _mm512_setzero_ps();
        let mut finite: u16 = u16::MAX;
        for r in 0..n_rows {
            let d = q4_0_scales16(rows[r].as_ptr().add(first * bb), n);
            c[r] = _mm512_mul_ps(d, _mm512_set1_ps(a[r]));
            let mag = _mm512_abs_ps(c[r]);
            finite &= _mm512_cmp_ps_mask::<_CMP_LT_OQ>(mag, _mm512_set1_ps(f32::INFINITY));
            peak = _mm512_max_ps(peak, mag);
        }
        let mut step = [0.0f32; 16];
        _mm512_storeu_ps(step.as_mut_ptr(), _mm512_div_ps(peak, _mm512_set1_ps(127.0)));
        let positive = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(peak, _mm512_setzero_ps());
        let inv = _mm512_maskz_div_ps(positive, _mm512_set1_ps(127.0), peak);
        // int8 coefficients, quad q's four in word [q][block]; their sum per block
        let mut coefs = [[0i32; 16]; AXPY_GROUP_ROWS / 4];
        let mut ksum = _mm512_setzero_si512();
        for q in 0..n_quads {
            let k: [__m512i; 4] = std::array::from_fn(|t| match 4 * q + t {
                r if r < n_rows => _mm512_cvtps_epi32(_mm512_mul_ps(c[r], inv)),
                _ => _mm512_setzero_si512(),
            });
            ksum = _mm512_add_epi32(
                ksum,
                _mm512_add_epi32(_mm512_add_epi32(k[0], k[1]), _mm512_add_epi32(k[2], k[3])),
            );
            let [b0, b1, b2, b3] = k.map(|v| _mm512_cvtsepi32_epi8(v));
            let (l01, h01) = (_mm_unpacklo_epi8(b0, b1), _mm_unpackhi_epi8(b0, b1));
            let (l23, h23) = (_mm_unpacklo_epi8(b2, b3), _mm_unpackhi_epi8(b2, b3));
            let words = coefs[q].as_mut_ptr() as *mut __m128i;
            _mm_storeu_si128(words, _mm_unpacklo_epi16(l01, l23));
            _mm_storeu_si128(words.add(1), _mm_unpackhi_epi16(l01, l23));
            _mm_storeu_si128(words.add(2), _mm_unpacklo_epi16(h01, h23));
            _mm_storeu_si128(words.add(3), _mm_unpackhi_epi16(h01, h23));
        }
        // Q4_0's -8 in integers: 8 * the sum of the block's coefficients
        let mut bias = [0i32; 16];
        _mm512_storeu_si512(bias.as_mut_ptr() as *mut _, _mm512_slli_epi32::<3>(ksum));
        for b in 0..n {
            prefetch.step();
            if finite >> b & 1 == 0 {
                // a coefficient not finite: the block through the float axpy, as the twin
                let cols = std::slice::from_raw_parts_mut(yp.add(32 * (first + b)), 32);
                for (row, &ar) in rows.iter().zip(a) {
                    let w = &row[(first + b) * bb..(first + b + 1) * bb];
                    crate::quant::axpy_scalar(DType::Q4_0, w, ar, cols);
                }
                continue;
            }
            let at = (first + b) * bb + 2; // the block's nibbles
            let (mut lo, mut hi) = (_mm512_setzero_si512(), _mm512_setzero_si512());
            for q in 0..n_quads {
                // rows past the group repeat its last row, times a coefficient of 0
                let nibbles = |t: usize| {
                    _mm_loadu_si128(
                        rows[(4 * q + t).min(n_rows - 1)].as_ptr().add(at) as *const __m128i
                    )
                };
                let v = _mm512_inserti32x4::<1>(_mm512_castsi128_si512(nibbles(0)), nibbles(1));
                let v = _mm512_inserti32x4::<3>(_mm512_inserti32x4::<2>(v, nibbles(2)), nibbles(3));
                let kk = _mm512_set1_epi32(coefs[q][b]);
                // transposed whole, then split: byte m of a row holds elements m and m + 16
                let t = _mm512_permutexvar_epi8(transpose, v);
                let low = _mm512_and_si512(t, low4);
                let high = _mm512_and_si512(_mm512_srli_epi16::<4>(t), low4);
                lo = _mm512_dpbusd_epi32(lo, low, kk);
                hi = _mm512_dpbusd_epi32(hi, high, kk);
            }
            let (s, off) = (_mm512_set1_ps(step[b]), _mm512_set1_epi32(bias[b]));
            let p = yp.add(32 * (first + b));
            let lo = _mm512_cvtepi32_ps(_mm512_sub_epi32(lo, off));
            let hi = _mm512_cvtepi32_ps(_mm512_sub_epi32(hi, off));
            _mm512_storeu_ps(p, _mm512_fmadd_ps(lo, s, _mm512_loadu_ps(p)));
            _mm512_storeu_ps(p.add(16), _mm512_fmadd_ps(hi, s, _mm512_loadu_ps(p.add(16))));
        }
        first += n;
    }
}

/// y += sum over r of a[r] * rows[r], R rows per pass over y (each block of y is loaded and
/// stored once per R rows); `next` prefetched over the blocks (see `avx2::axpy_rows`). SIMD
/// twin of R calls of `quant::axpy_scalar`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub unsafe fn axpy_rows<const R: usize>(
    dtype: DType,
    rows: [&[u8]; R],
    a: [f32; R],
    y: &mut [f32],
    next: &[&[u8]],
) {
    let n = y.len();
    let yp = y.as_mut_ptr();
    let mut av = [_mm512_setzero_ps(); R];
    for r in 0..R {
        av[r] = _mm512_set1_ps(a[r]);
    }
    // the 16 values of a nibble, as f32 lanes: 0..16
    let nibble_values =
        _mm512_setr_ps(0., 1., 2., 3., 4., 5., 6., 7., 8., 9., 10., 11., 12., 13., 14., 15.);
    // 4-bit blocks: `$table` gives the 16 values a nibble stands for, times the row's coefficient
    macro_rules! nibble_rows {
        ($block:ty, |$b:ident, $a:ident| $table:expr) => {{
            let blocks = rows.map(|r| crate::quant::cast_blocks::<$block>(r));
            let mut prefetch = crate::avx2::Prefetch::new(next, n / 32);
            for i in 0..n / 32 {
                prefetch.step();
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
            let mut prefetch = crate::avx2::Prefetch::new(next, n16 / 16);
            let mut k = 0;
            while k < n16 {
                prefetch.step();
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
            nibble_rows!(BlockQ4_0, |b, a| _mm512_mul_ps(
                centered,
                _mm512_mul_ps(a, splat_f16(b.d))
            ))
        }
        // q * d * a + m * a
        DType::Q4_1 => nibble_rows!(BlockQ4_1, |b, a| _mm512_fmadd_ps(
            nibble_values,
            _mm512_mul_ps(a, splat_f16(b.d)),
            _mm512_mul_ps(a, splat_f16(b.m))
        )),
        DType::Q8_0 => {
            let blocks = rows.map(crate::quant::cast_blocks::<BlockQ8_0>);
            let mut prefetch = crate::avx2::Prefetch::new(next, n / 32);
            for i in 0..n / 32 {
                prefetch.step();
                let p = yp.add(32 * i);
                let (mut lo, mut hi) = (_mm512_loadu_ps(p), _mm512_loadu_ps(p.add(16)));
                for r in 0..R {
                    let b = blocks[r].get_unchecked(i);
                    let s = _mm512_mul_ps(av[r], splat_f16(b.d));
                    let q = b.qs.as_ptr() as *const __m128i;
                    lo = _mm512_fmadd_ps(
                        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q))),
                        s,
                        lo,
                    );
                    hi = _mm512_fmadd_ps(
                        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q.add(1)))),
                        s,
                        hi,
                    );
                }
                _mm512_storeu_ps(p, lo);
                _mm512_storeu_ps(p.add(16), hi);
            }
        }
        // the chunked formats (`sparse::axpy4` sends them to `chunks_x86::axpy_rows`)
        _ => {
            for r in 0..R {
                crate::quant::axpy_scalar(dtype, rows[r], a[r], y);
            }
        }
    }
}

/// How a quantized type's four blocks enter `dot_quads`.
pub(crate) trait QuadBlocks {
    /// Bytes of four blocks.
    const BYTES: usize;
    /// Signed weights (Q8_0) go in with 128 added, so `vpdpbusd` can take them as unsigned.
    const SIGNED: bool;
    /// Whether the type has a per-block minimum (Q4_1).
    const HAS_MIN: bool;
    /// Where the four blocks' scales and minima lie among the first 32 words of a step, if they
    /// all do, as `scales_of_four_rows`'s index (`four_rows_index`).
    const SCALE_INDEX: Option<[i16; 32]> = None;
    /// From the four blocks at `src`: the weight bytes that meet the activations' `lo` and
    /// `hi` (unsigned), each lane's weight scale, and each lane's minimum (when `HAS_MIN`).
    unsafe fn unpack<const TAIL: bool>(src: Src) -> (__m512i, __m512i, __m512, __m512);
}

/// Where `QuadBlocks::unpack` reads a step: four whole blocks, or (`TAIL`) a row's last one to
/// three, read with masked loads that give zeros from `len` bytes on. The last step was a
/// zero-padded copy on the stack, and reading it back across the copy's stores stalled every
/// row (a fifth of a 576-column product).
#[derive(Clone, Copy)]
pub(crate) struct Src {
    p: *const u8,
    len: usize,
}

impl Src {
    /// The first n bytes of 64, as a load mask.
    #[inline]
    fn mask(&self, off: usize, width: usize) -> u64 {
        let n = self.len.saturating_sub(off).min(width);
        if n == 64 {
            u64::MAX
        } else {
            (1u64 << n) - 1
        }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn load64<const TAIL: bool>(self, off: usize) -> __m512i {
        if TAIL {
            _mm512_maskz_loadu_epi8(self.mask(off, 64), self.p.add(off) as *const i8)
        } else {
            _mm512_loadu_si512(self.p.add(off) as *const _)
        }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn load32<const TAIL: bool>(self, off: usize) -> __m256i {
        if TAIL {
            _mm256_maskz_loadu_epi8(self.mask(off, 32) as u32, self.p.add(off) as *const i8)
        } else {
            _mm256_loadu_si256(self.p.add(off) as *const __m256i)
        }
    }

    #[inline]
    unsafe fn word<const TAIL: bool>(self, off: usize) -> u16 {
        if TAIL && off + 2 > self.len {
            0
        } else {
            (self.p.add(off) as *const u16).read_unaligned()
        }
    }
}

/// Words `first..first + 8` of each block, block k's from `block_word[k]` of its source (32 +
/// word: the second source), as the 32-word index of a two-source word permute.
const fn words_of_blocks(block_word: [i16; 4]) -> [i16; 32] {
    let mut idx = [0i16; 32];
    let mut p = 0;
    while p < 32 {
        idx[p] = block_word[p / 8] + (p % 8) as i16;
        p += 1;
    }
    idx
}

/// Each block's word `block_word[k]` to lanes 4k..4k + 4 (16 words), as a word-permute index.
const fn lanes_of_blocks(block_word: [i16; 4]) -> [i16; 32] {
    let mut idx = [0i16; 32];
    let mut lane = 0;
    while lane < 16 {
        idx[lane] = block_word[lane / 4];
        lane += 1;
    }
    idx
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn index(words: &[i16; 32]) -> __m512i {
    _mm512_loadu_si512(words.as_ptr() as *const _)
}

/// Sixteen f16 words (the low half of `v`) as f32 lanes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn f16_lanes(v: __m512i) -> __m512 {
    _mm512_cvtph_ps(_mm512_castsi512_si256(v))
}

/// Low and high nibbles of 64 bytes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn nibbles(q: __m512i) -> (__m512i, __m512i) {
    let mask = _mm512_set1_epi8(0x0F);
    (_mm512_and_si512(q, mask), _mm512_and_si512(_mm512_srli_epi16::<4>(q), mask))
}

/// Q4_0, 18-byte blocks: loads at bytes 0 and 8 cover all four (every block's `qs` starts at
/// an even offset, 2 + 18k; block 3's lies in the second load, from its word 24).
impl QuadBlocks for BlockQ4_0 {
    const BYTES: usize = 72;
    const SCALE_INDEX: Option<[i16; 32]> = Some(four_rows_index([0, 9, 18, 27, 0, 9, 18, 27]));
    const SIGNED: bool = false;
    const HAS_MIN: bool = false;
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn unpack<const TAIL: bool>(src: Src) -> (__m512i, __m512i, __m512, __m512) {
        let (r0, r1) = (src.load64::<TAIL>(0), src.load64::<TAIL>(8));
        let (lo, hi) = nibbles(_mm512_permutex2var_epi16(
            r0,
            index(&const { words_of_blocks([1, 10, 19, 32 + 24]) }),
            r1,
        ));
        let d = f16_lanes(_mm512_permutexvar_epi16(
            index(&const { lanes_of_blocks([0, 9, 18, 27]) }),
            r0,
        ));
        (lo, hi, d, _mm512_setzero_ps())
    }
}

/// Q4_1, 20-byte blocks (d, m, then `qs` at 4 + 20k): loads at bytes 0 and 16.
impl QuadBlocks for BlockQ4_1 {
    const BYTES: usize = 80;
    const SCALE_INDEX: Option<[i16; 32]> = Some(four_rows_index([0, 10, 20, 30, 1, 11, 21, 31]));
    const SIGNED: bool = false;
    const HAS_MIN: bool = true;
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn unpack<const TAIL: bool>(src: Src) -> (__m512i, __m512i, __m512, __m512) {
        let (r0, r1) = (src.load64::<TAIL>(0), src.load64::<TAIL>(16));
        let (lo, hi) = nibbles(_mm512_permutex2var_epi16(
            r0,
            index(&const { words_of_blocks([2, 12, 22, 32 + 24]) }),
            r1,
        ));
        let d = f16_lanes(_mm512_permutexvar_epi16(
            index(&const { lanes_of_blocks([0, 10, 20, 30]) }),
            r0,
        ));
        let m = f16_lanes(_mm512_permutexvar_epi16(
            index(&const { lanes_of_blocks([1, 11, 21, 31]) }),
            r0,
        ));
        (lo, hi, d, m)
    }
}

/// Q8_0, 34-byte blocks (`qs` at 2 + 34k, 32 signed bytes): elements 0..16 of the four blocks
/// come from the loads at bytes 0 and 64, elements 16..32 from those at 8 and 72 (136 bytes in
/// all); the sign bit is flipped (q + 128) for `vpdpbusd`, and 128 * sum(a) comes off through
/// the activations' bias shifted left by 4 (-8 * 16 = -128 * the lane's sum).
impl QuadBlocks for BlockQ8_0 {
    const BYTES: usize = 136;
    const SIGNED: bool = true;
    const HAS_MIN: bool = false;
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn unpack<const TAIL: bool>(src: Src) -> (__m512i, __m512i, __m512, __m512) {
        let qs = |k: usize| src.load32::<TAIL>(2 + 34 * k);
        // [b0 lo, b0 hi, b1 lo, b1 hi] and [b2 lo, b2 hi, b3 lo, b3 hi] in 128-bit lanes
        let q01 = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(qs(0)), qs(1));
        let q23 = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(qs(2)), qs(3));
        let sign = _mm512_set1_epi8(-128);
        let lo = _mm512_shuffle_i64x2::<0b10_00_10_00>(q01, q23);
        let hi = _mm512_shuffle_i64x2::<0b11_01_11_01>(q01, q23);
        // the four scales (bytes 0, 34, 68, 102) as f32, each to its block's four lanes
        let word = |k: usize| src.word::<TAIL>(34 * k) as i64;
        let four = _mm_cvtph_ps(_mm_cvtsi64_si128(
            word(0) | word(1) << 16 | word(2) << 32 | word(3) << 48,
        ));
        let d = _mm512_permutexvar_ps(
            _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
            _mm512_castps128_ps512(four),
        );
        (_mm512_xor_si512(lo, sign), _mm512_xor_si512(hi, sign), d, _mm512_setzero_ps())
    }
}

/// Four 32-weight blocks of a row in registers, laid out as an `ActQuad`: `lo`/`hi` the bytes
/// (v + the format's offset, see `dot_steps`) of block c's elements 0..16 / 16..32 in lanes
/// 4c..4c + 4, and each lane's block scale and minimum (`min`: m of w = d q + m, else zero).
#[derive(Clone, Copy)]
struct RegQuad {
    lo: __m512i,
    hi: __m512i,
    scale: __m512,
    min: __m512,
}

/// The exact integer sums of four rows' steps (lanes 4c..4c + 4 of `s[r]` hold block c's
/// partial sums) gathered into one vector, block c of row r in lane 4c + r.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn block_sums4(s: [__m512i; 4]) -> __m512i {
    let pairs = |a: __m512i, b: __m512i| {
        _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b))
    };
    let (s01, s23) = (pairs(s[0], s[1]), pairs(s[2], s[3]));
    _mm512_add_epi32(_mm512_unpacklo_epi64(s01, s23), _mm512_unpackhi_epi64(s01, s23))
}

/// One row's step sums with each block's total in all four of its lanes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn block_sums1(s: __m512i) -> __m512i {
    let s = _mm512_add_epi32(s, _mm512_shuffle_epi32::<0b01_00_11_10>(s));
    _mm512_add_epi32(s, _mm512_shuffle_epi32::<0b10_11_00_01>(s))
}

/// Lane 4c + r from `v[r]` (whose four lanes of block c hold one value): four rows' per-block
/// values in `block_sums4`'s order.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn rows_by_lane(v: [__m512; 4]) -> __m512 {
    let x = _mm512_mask_blend_ps(0x2222, v[0], v[1]);
    let x = _mm512_mask_blend_ps(0x4444, x, v[2]);
    _mm512_mask_blend_ps(0x8888, x, v[3])
}

/// The float steps of a step's four blocks, per lane, from their exact sums `sums` (block c's
/// in lanes 4c..4c + 4): p_c = sum_c * (d_c * d_a,c) (+ m_c * s_a,c: a single rounding of the
/// sum, `fma`), and the step's total (p_0 + p_1) + (p_2 + p_3) in the lanes of block 0. These
/// are the steps of the prompts' row groups (`q32_x86::legacy_rows_all_tokens` with
/// AVX-512), lane for lane.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn step_total<const MIN: bool>(sums: __m512i, d: __m512, m: __m512, x: &ActQuad) -> __m512 {
    let dd = _mm512_mul_ps(d, _mm512_load_ps(x.d.as_ptr()));
    let p = if MIN {
        _mm512_fmadd_ps(
            _mm512_cvtepi32_ps(sums),
            dd,
            _mm512_mul_ps(m, _mm512_load_ps(x.s.as_ptr())),
        )
    } else {
        _mm512_mul_ps(_mm512_cvtepi32_ps(sums), dd)
    };
    let p = _mm512_add_ps(p, _mm512_shuffle_f32x4::<0b10_11_00_01>(p, p));
    _mm512_add_ps(p, _mm512_shuffle_f32x4::<0b01_00_11_10>(p, p))
}

/// The dot loop of the 32-weight formats, four blocks per step, R rows against N tokens:
/// `quad(r, j)` gives row r's step j (`scales4(j)`, where it can, the four rows' scales and
/// minima at once, as `rows_by_lane` lays them out), `OFFSET` what its bytes hold (0: v, 8: v + 8, 128:
/// v + 128), which the activations' exact per-lane bias takes off in integers; `MIN`: minima.
/// Each block's products sum exactly in integers, then `step_total`, then acc += the step's
/// total: a prompt's row groups take the same steps per lane, so a token gets bit for bit the
/// same dots alone, in batched decode and in a prompt. Four rows (decode) share the
/// activations' loads and one vector of float steps (`block_sums4`).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn dot_steps<
    'n,
    P: LineFetch<'n>,
    const MIN: bool,
    const OFFSET: i32,
    const R: usize,
    const N: usize,
>(
    steps: usize,
    quad: impl Fn(usize, usize) -> RegQuad,
    scales4: impl Fn(usize) -> Option<(__m512, __m512)>,
    quads: [&[ActQuad]; N],
    next: &'n [&'n [u8]],
) -> [[f32; N]; R] {
    // R = 4: one vector per token, row r's total in lane r; else one per row and token (lane 0)
    let mut acc = [[_mm512_setzero_ps(); N]; R];
    let mut prefetch = P::new(next, steps);
    let zero = RegQuad {
        lo: _mm512_setzero_si512(),
        hi: _mm512_setzero_si512(),
        scale: _mm512_setzero_ps(),
        min: _mm512_setzero_ps(),
    };
    for j in 0..steps {
        prefetch.step();
        // (a loop, not `array::from_fn`: its closure would not be compiled for these features)
        let mut w = [zero; R];
        for (r, w) in w.iter_mut().enumerate() {
            *w = quad(r, j);
        }
        let (d4, m4) = match (R, scales4(j)) {
            (4, Some(both)) => both,
            (4, None) => (
                rows_by_lane([w[0].scale, w[1].scale, w[2].scale, w[3].scale]),
                rows_by_lane([w[0].min, w[1].min, w[2].min, w[3].min]),
            ),
            _ => (zero.scale, zero.min),
        };
        for t in 0..N {
            let x = quads[t].get_unchecked(j);
            let bytes = |p: &[i8; 64]| _mm512_load_si512(p.as_ptr() as *const _);
            let bias = _mm512_load_si512(x.bias.as_ptr() as *const _);
            let start = match OFFSET {
                0 => _mm512_setzero_si512(),
                8 => bias,
                _ => _mm512_slli_epi32::<4>(bias),
            };
            let (a_lo, a_hi) = (bytes(&x.lo), bytes(&x.hi));
            let mut sums = [_mm512_setzero_si512(); R];
            for r in 0..R {
                sums[r] =
                    _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(start, w[r].lo, a_lo), w[r].hi, a_hi);
            }
            if R == 4 {
                let total =
                    step_total::<MIN>(block_sums4([sums[0], sums[1], sums[2], sums[3]]), d4, m4, x);
                acc[0][t] = _mm512_add_ps(acc[0][t], total);
            } else {
                for r in 0..R {
                    let total = step_total::<MIN>(block_sums1(sums[r]), w[r].scale, w[r].min, x);
                    acc[r][t] = _mm512_add_ps(acc[r][t], total);
                }
            }
        }
    }
    let mut out = [[0.0f32; N]; R];
    for t in 0..N {
        if R == 4 {
            let mut lanes = [0.0f32; 16];
            _mm512_storeu_ps(lanes.as_mut_ptr(), acc[0][t]);
            for r in 0..R {
                out[r][t] = lanes[r];
            }
        } else {
            for r in 0..R {
                out[r][t] = _mm512_cvtss_f32(acc[r][t]);
            }
        }
    }
    out
}

/// Q4_0, Q4_1 and Q8_0: R rows against N tokens' `ActQuad`s, four blocks per step straight
/// from the row (`QuadBlocks::unpack`), the last up to three through masked loads. Twin of the
/// formats' scalar dots (`quant::dot_q4_0_scalar`, `dot_q4_1_scalar`, `dot_q8_0_scalar`).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn dot_quads<
    'n,
    B: QuadBlocks,
    P: LineFetch<'n>,
    const R: usize,
    const N: usize,
>(
    w: [&[B]; R],
    quads: [&[ActQuad]; N],
    next: &'n [&'n [u8]],
) -> [[f32; N]; R] {
    let blocks = w[0].len();
    debug_assert!(w.iter().all(|row| row.len() == blocks));
    let (full, rest) = (blocks / 4, blocks % 4);
    let quad = |r: usize, j: usize| {
        let p = (w[r].as_ptr() as *const u8).add(B::BYTES * j);
        let (lo, hi, d, m) = if j < full {
            B::unpack::<false>(Src { p, len: B::BYTES })
        } else {
            B::unpack::<true>(Src { p, len: rest * std::mem::size_of::<B>() })
        };
        RegQuad { lo, hi, scale: d, min: m }
    };
    let scales4 = |j: usize| {
        let idx = B::SCALE_INDEX?;
        let src = |r: usize| {
            let p = (w[r % R].as_ptr() as *const u8).add(B::BYTES * j);
            if j < full {
                Src { p, len: B::BYTES }.load64::<false>(0)
            } else {
                Src { p, len: rest * std::mem::size_of::<B>() }.load64::<true>(0)
            }
        };
        Some(scales_of_four_rows(&idx, [src(0), src(1), src(2), src(3)]))
    };
    let steps = full + (rest > 0) as usize;
    match (B::HAS_MIN, B::SIGNED) {
        (true, _) => dot_steps::<P, true, 0, R, N>(steps, quad, scales4, quads, next),
        (false, false) => dot_steps::<P, false, 8, R, N>(steps, quad, scales4, quads, next),
        (false, true) => dot_steps::<P, false, 128, R, N>(steps, quad, scales4, quads, next),
    }
}

/// The word permute that takes two rows' first 64 bytes to word 4c + r = row r's scale of
/// block c (words 0..16) and its minimum (16..32), odd rows from the second source (rows 2 and
/// 3 take a second permute): `words` holds where the four scales, then minima, lie.
const fn four_rows_index(words: [i16; 8]) -> [i16; 32] {
    let mut idx = [0i16; 32];
    let mut w = 0;
    while w < 32 {
        let (value, c, r) = (w / 16, (w % 16) / 4, w % 4);
        idx[w] = words[4 * value + c] + if r % 2 == 1 { 32 } else { 0 };
        w += 1;
    }
    idx
}

/// Four rows' scales and minima of a step, block c of row r in lane 4c + r (`rows_by_lane`'s
/// order), from the rows' first 64 bytes (`heads`; `idx` from `four_rows_index`): two word
/// permutes, a blend and two conversions for the four rows, where converting each row's to
/// all 16 lanes and blending took 4 permutes, 4 conversions and 3 blends per value.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn scales_of_four_rows(idx: &[i16; 32], heads: [__m512i; 4]) -> (__m512, __m512) {
    let idx = index(idx);
    let low = _mm512_permutex2var_epi16(heads[0], idx, heads[1]);
    let high = _mm512_permutex2var_epi16(heads[2], idx, heads[3]);
    let both = _mm512_mask_blend_epi16(0xCCCC_CCCC, low, high);
    (
        _mm512_cvtph_ps(_mm512_castsi512_si256(both)),
        _mm512_cvtph_ps(_mm512_extracti64x4_epi64::<1>(both)),
    )
}

/// R rows of a chunked type (`quant::chunks`) against N tokens: a step straight from the
/// blocks (`direct_quad`) or the format's AVX2 chunk decoder four times, the chunks gathered
/// into one `RegQuad` (v + 128). Twin of `chunks::dot_scalar`. (The super-block formats go
/// through `quant::q256_x86`, see `DType::reads_q8k`.)
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn dot_chunked<'n, P: LineFetch<'n>, const R: usize, const N: usize>(
    dtype: DType,
    rows: [&[u8]; R],
    quads: [&[ActQuad]; N],
    next: &'n [&'n [u8]],
) -> [[f32; N]; R] {
    use crate::quant::chunks_x86 as c2;
    let nb = quads[0].len() * 4; // (padded)
    let blocks = rows[0].len() / dtype.block_bytes() * (dtype.block_len() / 32);
    debug_assert!(blocks <= nb && nb < blocks + 4);
    macro_rules! with {
        ($decode:path, $dtype:expr) => {{
            const PER_BLOCK: usize = c2::chunks_per_block($dtype);
            let quad = |r: usize, j: usize| {
                let row = rows[r];
                let ch = |c: usize| {
                    let k = 4 * j + c;
                    if k < blocks {
                        $decode(row, k / PER_BLOCK, k % PER_BLOCK)
                    } else {
                        Decoded::zero()
                    }
                };
                match direct_quad($dtype, row, j, blocks) {
                    Some(q) => q,
                    None => gather([ch(0), ch(1), ch(2), ch(3)]),
                }
            };
            if $dtype == DType::Q5_1 {
                dot_steps::<P, true, 128, R, N>(quads[0].len(), quad, |_| None, quads, next)
            } else {
                dot_steps::<P, false, 128, R, N>(quads[0].len(), quad, |_| None, quads, next)
            }
        }};
    }
    c2::with_decoder!(dtype, with)
}

/// Step j (chunks 4j..4j + 4) of a row of `dtype` read straight from its blocks, for the
/// formats that have such a reader and a whole step (None: the AVX2 chunk decoders and
/// `gather`). The decoders unpack a super-block's scales once per chunk, which made these
/// formats' decode 2-3x slower than Q4_0's; here once per step. The values are the decoders',
/// bit for bit (the prompt-against-alone test in `matmul` checks it).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn direct_quad(dtype: DType, row: &[u8], j: usize, blocks: usize) -> Option<RegQuad> {
    match dtype {
        DType::Q5_0 if 4 * j + 4 <= blocks => {
            Some(q5_0_quad(row.as_ptr().add(4 * j * std::mem::size_of::<BlockQ5_0>())))
        }
        DType::Q5_1 if 4 * j + 4 <= blocks => {
            Some(q5_1_quad(row.as_ptr().add(4 * j * std::mem::size_of::<BlockQ5_1>())))
        }
        DType::IQ4_NL if 4 * j + 4 <= blocks => {
            Some(iq4_nl_quad(row.as_ptr().add(4 * j * std::mem::size_of::<BlockIQ4NL>())))
        }
        DType::MXFP4 if 4 * j + 4 <= blocks => {
            Some(mxfp4_quad(row.as_ptr().add(4 * j * std::mem::size_of::<BlockMXFP4>())))
        }
        _ => None,
    }
}

/// Each of four values to four lanes: lane i takes value i / 4.
const LANES_OF_FOUR: [i32; 16] = [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3];

/// The low and the high nibbles of 64 bytes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn nibble_halves(q: __m512i) -> (__m512i, __m512i) {
    let low4 = _mm512_set1_epi8(0x0F);
    (_mm512_and_si512(q, low4), _mm512_and_si512(_mm512_srli_epi16::<4>(q), low4))
}

/// Four consecutive 32-weight blocks at `p` (`stride` bytes each, an f16 scale first): their 16
/// bytes at offset `qs` as the four 128-bit lanes, and their scales to lanes 4c..4c + 4.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn four_blocks(p: *const u8, stride: usize, qs: usize) -> (__m512i, __m512) {
    let q = |k: usize| _mm_loadu_si128(p.add(stride * k + qs) as *const __m128i);
    let v = _mm512_inserti32x4::<3>(
        _mm512_inserti32x4::<2>(_mm512_inserti32x4::<1>(_mm512_castsi128_si512(q(0)), q(1)), q(2)),
        q(3),
    );
    (v, block_f16_lanes(p, stride, 0))
}

/// The f16 at `offset` of each of four blocks at `p` (`stride` bytes each), block c's to lanes
/// 4c..4c + 4.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn block_f16_lanes(p: *const u8, stride: usize, offset: usize) -> __m512 {
    let word = |k: usize| (p.add(stride * k + offset) as *const u16).read_unaligned() as i64;
    let four =
        _mm_cvtph_ps(_mm_cvtsi64_si128(word(0) | word(1) << 16 | word(2) << 32 | word(3) << 48));
    _mm512_permutexvar_ps(
        _mm512_loadu_si512(LANES_OF_FOUR.as_ptr() as *const _),
        _mm512_castps128_ps512(four),
    )
}

/// The fifth bits of four Q5_0/Q5_1 blocks at `p` (`qh` at offset `qh`) as byte masks of the
/// weights in `nibble_halves` order: weight i's bit is bit i of its block's qh, bits 0..16
/// for the low nibbles, 16..32 for the high ones.
#[inline]
fn fifth_bits(p: *const u8, stride: usize, qh: usize) -> (u64, u64) {
    let (mut lo, mut hi) = (0u64, 0u64);
    for k in 0..4 {
        // SAFETY (the read): the caller's four blocks are in bounds
        let bits = unsafe { (p.add(stride * k + qh) as *const u32).read_unaligned() } as u64;
        lo |= (bits & 0xFFFF) << (16 * k);
        hi |= (bits >> 16) << (16 * k);
    }
    (lo, hi)
}

/// A step with one scale per chunk and no minima, bytes v + 128 from v (signed).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn signed_quad(lo: __m512i, hi: __m512i, scale: __m512) -> RegQuad {
    let flip = _mm512_set1_epi8(-128);
    RegQuad {
        lo: _mm512_xor_si512(lo, flip),
        hi: _mm512_xor_si512(hi, flip),
        scale,
        min: _mm512_setzero_ps(),
    }
}

/// Four Q5_0 or Q5_1 blocks at `p` (`stride` bytes each, `qh` and `qs` at those offsets):
/// q = nibble | fifth bit << 4, in `nibble_halves` order, and the blocks' scales.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn five_bit_blocks(
    p: *const u8,
    stride: usize,
    qh: usize,
    qs: usize,
) -> (__m512i, __m512i, __m512) {
    let (q, d) = four_blocks(p, stride, qs);
    let (lo, hi) = nibble_halves(q);
    let (bits_lo, bits_hi) = fifth_bits(p, stride, qh);
    let sixteen = _mm512_set1_epi8(0x10);
    (
        _mm512_or_si512(lo, _mm512_maskz_mov_epi8(bits_lo, sixteen)),
        _mm512_or_si512(hi, _mm512_maskz_mov_epi8(bits_hi, sixteen)),
        d,
    )
}

/// Four Q5_0 blocks at `p`: v = q - 16.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q5_0_quad(p: *const u8) -> RegQuad {
    let (lo, hi, d) = five_bit_blocks(p, std::mem::size_of::<BlockQ5_0>(), 2, 6);
    // v + 128 = q + 112
    let off = _mm512_set1_epi8(112);
    RegQuad {
        lo: _mm512_add_epi8(lo, off),
        hi: _mm512_add_epi8(hi, off),
        scale: d,
        min: _mm512_setzero_ps(),
    }
}

/// Four Q5_1 blocks at `p`: v = q, weight d * v + m.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q5_1_quad(p: *const u8) -> RegQuad {
    const STRIDE: usize = std::mem::size_of::<BlockQ5_1>();
    let (lo, hi, d) = five_bit_blocks(p, STRIDE, 4, 8);
    let flip = _mm512_set1_epi8(-128);
    RegQuad {
        lo: _mm512_xor_si512(lo, flip),
        hi: _mm512_xor_si512(hi, flip),
        scale: d,
        min: block_f16_lanes(p, STRIDE, 2),
    }
}

/// IQ4's 16 values in every 128-bit lane.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn iq4_table() -> __m512i {
    _mm512_broadcast_i32x4(_mm_loadu_si128(IQ4_VALUES.as_ptr() as *const __m128i))
}

/// Four IQ4_NL blocks at `p`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn iq4_nl_quad(p: *const u8) -> RegQuad {
    let (q, d) = four_blocks(p, std::mem::size_of::<BlockIQ4NL>(), 2);
    let (lo, hi) = nibble_halves(q);
    let table = iq4_table();
    signed_quad(_mm512_shuffle_epi8(table, lo), _mm512_shuffle_epi8(table, hi), d)
}

/// Four MXFP4 blocks at `p` (17 bytes each: the exponent, then Q4_0's nibbles): the doubled
/// E2M1 values looked up as IQ4_NL's, each block's halved power-of-two scale to its lanes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn mxfp4_quad(p: *const u8) -> RegQuad {
    const STRIDE: usize = std::mem::size_of::<BlockMXFP4>();
    let q = |k: usize| _mm_loadu_si128(p.add(STRIDE * k + 1) as *const __m128i);
    let v = _mm512_inserti32x4::<3>(
        _mm512_inserti32x4::<2>(_mm512_inserti32x4::<1>(_mm512_castsi128_si512(q(0)), q(1)), q(2)),
        q(3),
    );
    let e = |k: usize| e8m0_half(*p.add(STRIDE * k));
    let d = _mm512_permutexvar_ps(
        _mm512_loadu_si512(LANES_OF_FOUR.as_ptr() as *const _),
        _mm512_castps128_ps512(_mm_setr_ps(e(0), e(1), e(2), e(3))),
    );
    let (lo, hi) = nibble_halves(v);
    let table = _mm512_broadcast_i32x4(_mm_loadu_si128(MXFP4_VALUES.as_ptr() as *const __m128i));
    signed_quad(_mm512_shuffle_epi8(table, lo), _mm512_shuffle_epi8(table, hi), d)
}

/// Four decoded chunks as one step: chunk c's low 16 bytes (and its first half's scale and
/// minimum) to lanes 4c..4c + 4 of `lo`, its high 16 to those of `hi`; bytes v + 128.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn gather(ch: [Decoded; 4]) -> RegQuad {
    let join = |x: __m256i, y: __m256i| _mm512_inserti64x4::<1>(_mm512_castsi256_si512(x), y);
    // the low 128 bits of each of the four, and the high 128 bits of each
    let lows = |v: [__m256i; 4]| {
        join(
            _mm256_permute2x128_si256::<0x20>(v[0], v[1]),
            _mm256_permute2x128_si256::<0x20>(v[2], v[3]),
        )
    };
    let highs = |v: [__m256i; 4]| {
        join(
            _mm256_permute2x128_si256::<0x31>(v[0], v[1]),
            _mm256_permute2x128_si256::<0x31>(v[2], v[3]),
        )
    };
    // (arrays written out: an `array::map` closure would not be compiled for AVX-512)
    let v = [ch[0].v, ch[1].v, ch[2].v, ch[3].v];
    let scale = |c: usize| _mm256_castps_si256(ch[c].scale);
    let scale = [scale(0), scale(1), scale(2), scale(3)];
    // (the decoders give a minimum as -m, per chunk; `RegQuad` holds m)
    let min = |c: usize| _mm256_castps_si256(_mm256_sub_ps(_mm256_setzero_ps(), ch[c].min));
    let min = [min(0), min(1), min(2), min(3)];
    let flip = _mm512_set1_epi8(-128);
    RegQuad {
        lo: _mm512_xor_si512(lows(v), flip),
        hi: _mm512_xor_si512(highs(v), flip),
        scale: _mm512_castsi512_ps(lows(scale)),
        min: _mm512_castsi512_ps(lows(min)),
    }
}

/// `avx2::attn_scores_group` with AVX-512VL's 32 vector registers: rows go in passes of 6 (up
/// to 3 heads), 4 (up to 6) or 3 (7 or 8), so each load of a query's eight dims serves more
/// keys (the 16-register passes of 4, 2 and 1 reload the queries for every row or two). The same
/// sums in the same order: the same bits. Safety: as for `avx2::attn_scores_group`, on a CPU
/// with AVX-512.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub unsafe fn attn_scores_group<const F16: bool, const G: usize>(
    qs: &[f32],
    cache: *const u8,
    stride: usize,
    offset: usize,
    scale: f32,
    n: usize,
    scores: &mut [f32],
) {
    use crate::avx2::scores_block;
    let mut j = 0;
    macro_rules! passes {
        ($r:literal) => {
            while j + $r <= n {
                scores_block::<F16, G, $r>(qs, cache, stride, offset, scale, n, scores, j);
                j += $r;
            }
        };
    }
    if G <= 3 {
        passes!(6);
    } else if G <= 6 {
        passes!(4);
    } else {
        passes!(3);
    }
    while j < n {
        scores_block::<F16, G, 1>(qs, cache, stride, offset, scale, n, scores, j);
        j += 1;
    }
}

/// `avx2::attn_weighted_sum_group` in 16 lanes: up to 64 dims per pass (4 x 16) for up to 6
/// heads, so the weights are read once per 64 dims and each value row feeds four 16-lane
/// multiply-adds per head. Each output value is the same chain of multiply-adds over the rows in
/// order as in 8 lanes: the same bits. Safety: as for `avx2::attn_weighted_sum_group`, on a CPU
/// with AVX-512.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub unsafe fn attn_weighted_sum_group<const F16: bool, const G: usize>(
    weights: &[f32],
    cache: *const u8,
    stride: usize,
    offset: usize,
    n: usize,
    out: &mut [f32],
) {
    let hd = out.len() / G;
    let mut d0 = 0;
    if G <= 6 {
        while d0 + 64 <= hd {
            weighted_sum_pass_16::<F16, G, 4>(weights, cache, stride, offset + d0, n, out, hd, d0);
            d0 += 64;
        }
    }
    while d0 + 32 <= hd {
        weighted_sum_pass_16::<F16, G, 2>(weights, cache, stride, offset + d0, n, out, hd, d0);
        d0 += 32;
    }
    while d0 < hd {
        weighted_sum_pass_16::<F16, G, 1>(weights, cache, stride, offset + d0, n, out, hd, d0);
        d0 += 16;
    }
}

/// 16 f16 or f32 cache elements from element `idx` as 16 f32 lanes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn load16_kv<const F16: bool>(base: *const u8, idx: usize) -> __m512 {
    if F16 {
        _mm512_cvtph_ps(_mm256_loadu_si256((base as *const u16).add(idx) as *const __m256i))
    } else {
        _mm512_loadu_ps((base as *const f32).add(idx))
    }
}

/// Dims d0..d0 + 16P of `attn_weighted_sum_group`: G x P accumulators of 16 lanes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn weighted_sum_pass_16<const F16: bool, const G: usize, const P: usize>(
    weights: &[f32],
    cache: *const u8,
    stride: usize,
    at: usize,
    n: usize,
    out: &mut [f32],
    hd: usize,
    d0: usize,
) {
    let wp = weights.as_ptr();
    let mut acc = [[_mm512_setzero_ps(); P]; G];
    for j in 0..n {
        let base = j * stride + at;
        let mut v = [_mm512_setzero_ps(); P];
        for (p, x) in v.iter_mut().enumerate() {
            *x = load16_kv::<F16>(cache, base + 16 * p);
        }
        for (h, a) in acc.iter_mut().enumerate() {
            let w = _mm512_set1_ps(*wp.add(h * n + j));
            for p in 0..P {
                a[p] = _mm512_fmadd_ps(w, v[p], a[p]);
            }
        }
    }
    for (h, a) in acc.iter().enumerate() {
        for (p, x) in a.iter().enumerate() {
            _mm512_storeu_ps(out.as_mut_ptr().add(h * hd + d0 + 16 * p), *x);
        }
    }
}
