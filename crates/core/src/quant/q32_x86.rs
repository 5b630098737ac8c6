//! Prompts of the 32-weight formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL; the 256-weight
//! formats' groups are in `q256_x86`): weight rows decoded once per product into
//! row-interleaved groups, a row per 32-bit lane, dotted with several tokens per step, so one
//! `vpmaddubsw` (AVX2), 256-bit `vpdpbusd` (AVX-VNNI; eight rows, `LegacyGroup`) or 512-bit
//! `vpdpbusd` (AVX-512 VNNI; sixteen rows, `LegacyGroup16`) serves a group and a block's float
//! step is one vector.
//!
//! Each lane takes the one-token kernels' steps at its level: a block's products summed exactly
//! in integers, then with AVX2 `avx2::dot_legacy`'s acc = fma(sum, d * d_a, acc) (and the
//! minimum's step for Q4_1 and Q5_1), with AVX-512 `avx512::dot_steps`'s per-block products
//! summed four blocks at a time. So a token's dot is bit for bit the same in a prompt as alone
//! or in a small batch (the tests check it for every format). The activations are
//! `Activations::q8`: a prompt needs no second copy. With AVX2 alone, Q4_0's groups hold q
//! unsigned and take 8 times the activations' block sums off once per block (`groups_offset`),
//! as the one-token kernel does: no sign change per step.

#![allow(clippy::missing_safety_doc)]

use std::arch::x86_64::*;

use super::chunks::{BlockIQ4NL, BlockMXFP4, BlockQ5_0, BlockQ5_1};
use super::q256_x86::{transpose_chunk, transpose_slot, GroupWidth};
use super::{cast_blocks, BlockQ4_0, BlockQ4_1, BlockQ8Act, BlockQ8_0, DType, QK};
use crate::avx2::{Dp256, Evex, LegacyBlock, PrefetchRows, Vex};
use crate::simd::Vnni256;

/// Eight rows' block of a `LegacyBlock` format for a prompt, rows across the lanes (as
/// `q256_x86::RowGroupBlock`): step k holds weights 4k..4k + 4 of each row, row r's
/// four bytes in 32-bit lane r, so one `vpmaddubsw` with a token's four activations broadcast
/// serves eight rows, and a block's float step is one vector for all of them.
#[repr(C, align(32))]
#[derive(Clone, Copy, Default)]
struct LegacyGroup {
    /// |v| for signed weights, q for formats with minima
    u: [[u32; 8]; 8],
    /// v, for signed weights
    v: [[u32; 8]; 8],
    d: [f32; 8],
    /// the minima (Q4_1, Q5_1)
    m: [f32; 8],
}

/// Into L1, the line two ahead of block b in each row, while block b decodes: a group's rows
/// are read a block at a time, too many streams for the hardware prefetchers (`PrefetchRows`
/// brought them to L2), so each block's first load would wait on L2.
#[inline(always)]
unsafe fn prefetch_ahead<B>(rows: &[&[u8]], b: usize) {
    for row in rows {
        // (past the row's end it reads the next row's, or nothing: prefetches never fault)
        _mm_prefetch::<_MM_HINT_T0>(
            row.as_ptr().wrapping_add(b * std::mem::size_of::<B>() + 128) as *const i8
        );
    }
}

/// The first eight f16 values of `bits` as f32: one `vcvtph2ps`, where a conversion per row
/// would check the CPU's features each time.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16x8(bits: &[u16]) -> __m256 {
    assert!(bits.len() >= 8);
    _mm256_cvtph_ps(_mm_loadu_si128(bits.as_ptr() as *const __m128i))
}

/// Whether the AVX2 row groups (without VNNI) take a format with `LegacyBlock::OFFSET` c as its
/// unsigned q, v = q - c, and each activation block's sum times -c once per block (from the
/// batch's `Activations::q8_bias`), so a step is `vpmaddubsw` of q with the activations as
/// they are, where v takes a sign change per token and step: where eight steps of q a pair
/// sums fit in 16 bits (Q4_0: 16 products of 15 * 127 in a lane; Q5_0's q up to 31 would
/// overflow) and c divides 128.
const fn groups_offset<B: LegacyBlock>() -> bool {
    B::OFFSET > 0 && 8 * 2 * 127 * (2 * B::OFFSET - 1) <= i16::MAX as i32 && 128 % B::OFFSET == 0
}

/// Decodes up to eight rows of a `LegacyBlock` format into `out`, a `LegacyGroup` per block;
/// lanes past them are zero (no weights, no scales). With `offset` (`groups_offset`), `u`
/// holds the unsigned q and `v` is not written.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn unpack_legacy_group<B: LegacyBlock>(
    rows: &[&[u8]],
    out: &mut [LegacyGroup],
    offset: bool,
) {
    if rows.len() < 8 {
        out.fill(LegacyGroup::default());
    }
    let blocks: [&[B]; 8] =
        std::array::from_fn(|r| rows.get(r).map_or(&[][..], |&w| cast_blocks(w)));
    let mut staged = [[0u32; 8]; 8];
    // the scales' (and minima's) f16 bits, converted eight at a time (lanes past the rows 0)
    let (mut d_bits, mut m_bits) = ([0u16; 8], [0u16; 8]);
    for (b, o) in out.iter_mut().enumerate() {
        prefetch_ahead::<B>(rows, b);
        for r in 0..rows.len() {
            let blk = blocks[r].get_unchecked(b);
            let w = if offset { blk.unsigned() } else { blk.weights() };
            _mm256_storeu_si256(staged[r].as_mut_ptr() as *mut __m256i, w);
            if B::MIN {
                m_bits[r] = blk.min_bits();
            }
            match B::F16_SCALE {
                true => d_bits[r] = blk.scale_bits(),
                false => o.d[r] = blk.scale(),
            }
        }
        if B::F16_SCALE {
            _mm256_storeu_ps(o.d.as_mut_ptr(), f16x8(&d_bits));
        }
        if B::MIN {
            _mm256_storeu_ps(o.m.as_mut_ptr(), f16x8(&m_bits));
        }
        if B::MIN || offset {
            transpose_chunk::<8>(&staged, &mut o.u);
        } else {
            // |v| byte by byte after the transpose (the same bytes as transposing |v|: one
            // transpose per block instead of two; -128 stays 0x80 either way)
            transpose_chunk::<8>(&staged, &mut o.v);
            for (u, v) in o.u.iter_mut().zip(&o.v) {
                let v = _mm256_loadu_si256(v.as_ptr() as *const __m256i);
                _mm256_storeu_si256(u.as_mut_ptr() as *mut __m256i, _mm256_abs_epi8(v));
            }
        }
    }
}

/// A block's float steps per lane from its exact 32-bit sums (`legacy_group_dot` and its
/// AVX-VNNI twin): acc = fma(sum, d * d_a, acc), and for Q4_1 min = fma(m, s_a, min).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn legacy_block_end<B: LegacyBlock, const T: usize>(
    x: &LegacyGroup,
    a: [&[BlockQ8Act]; T],
    b: usize,
    sums: &[__m256i; T],
    acc: &mut [__m256; T],
    mins: &mut [__m256; T],
) {
    let d = _mm256_load_ps(x.d.as_ptr());
    for t in 0..T {
        let ab = a[t].get_unchecked(b);
        acc[t] = _mm256_fmadd_ps(
            _mm256_cvtepi32_ps(sums[t]),
            _mm256_mul_ps(d, _mm256_set1_ps(ab.d)),
            acc[t],
        );
        if B::MIN {
            mins[t] = _mm256_fmadd_ps(_mm256_load_ps(x.m.as_ptr()), _mm256_set1_ps(ab.s), mins[t]);
        }
    }
}

/// Each token's lanes: acc (+ min for Q4_1).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn legacy_result<B: LegacyBlock, const T: usize>(
    acc: &[__m256; T],
    mins: &[__m256; T],
) -> [[f32; 8]; T] {
    let mut out = [[0.0f32; 8]; T];
    for t in 0..T {
        _mm256_storeu_ps(
            out[t].as_mut_ptr(),
            if B::MIN { _mm256_add_ps(acc[t], mins[t]) } else { acc[t] },
        );
    }
    out
}

/// A group of eight rows of a `LegacyBlock` format against T tokens: lane r is row r's dot, bit
/// for bit `avx2::dot_legacy`'s: the same exact integer sum per block, the same float steps per
/// lane. With `groups_offset` formats, `starts[t]` holds token t's activation block sums times
/// -128 (`activation_bias`) and the group its unsigned q.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn legacy_group_dot<B: LegacyBlock, const T: usize>(
    g: &[LegacyGroup],
    a: [&[BlockQ8Act]; T],
    starts: [&[i32]; T],
) -> [[f32; 8]; T] {
    let (mut acc, mut mins) = ([_mm256_setzero_ps(); T], [_mm256_setzero_ps(); T]);
    let ones = _mm256_set1_epi16(1);
    let word = |p: *const i8| (p as *const i32).read_unaligned();
    let offset = groups_offset::<B>();
    for (b, x) in g.iter().enumerate() {
        // pair sums of |v| * a <= 2 * 16 * 127 (Q4_1's q * a <= 2 * 15 * 127): a block's eight steps
        // sum in 16 bits (`LegacyBlock::WIDE`: |v| <= 127 or q <= 31, pairs widen to 32 bits at
        // each step)
        let mut sums = [_mm256_setzero_si256(); T];
        for k in 0..8 {
            let u = _mm256_load_si256(x.u[k].as_ptr() as *const __m256i);
            let v = match offset || B::MIN {
                true => u,
                false => _mm256_load_si256(x.v[k].as_ptr() as *const __m256i),
            };
            for t in 0..T {
                let act = _mm256_set1_epi32(word(a[t].get_unchecked(b).qs.as_ptr().add(4 * k)));
                let act = if B::MIN || offset { act } else { _mm256_sign_epi8(act, v) };
                let pairs = _mm256_maddubs_epi16(u, act);
                sums[t] = if B::WIDE {
                    _mm256_add_epi32(sums[t], _mm256_madd_epi16(pairs, ones))
                } else {
                    _mm256_add_epi16(sums[t], pairs)
                };
            }
        }
        if !B::WIDE {
            for t in 0..T {
                sums[t] = _mm256_madd_epi16(sums[t], ones);
            }
        }
        if offset {
            // (q - c) a summed = q a summed - c (a summed), exactly: the bias is -128 times
            // the activations' sum, c divides 128
            for t in 0..T {
                let start = *starts[t].get_unchecked(b) >> (128 / B::OFFSET).trailing_zeros();
                sums[t] = _mm256_add_epi32(sums[t], _mm256_set1_epi32(start));
            }
        }
        legacy_block_end::<B, T>(x, a, b, &sums, &mut acc, &mut mins);
    }
    legacy_result::<B, T>(&acc, &mins)
}

/// `legacy_group_dot` with 256-bit VNNI in V's encoding: `vpdpbusd` sums each step into 32
/// bits; the same exact sums, the same float steps.
#[inline(always)]
unsafe fn legacy_group_dot_vnni<B: LegacyBlock, V: Dp256, const T: usize>(
    g: &[LegacyGroup],
    a: [&[BlockQ8Act]; T],
) -> [[f32; 8]; T] {
    let (mut acc, mut mins) = ([_mm256_setzero_ps(); T], [_mm256_setzero_ps(); T]);
    let word = |p: *const i8| (p as *const i32).read_unaligned();
    for (b, x) in g.iter().enumerate() {
        let mut sums = [_mm256_setzero_si256(); T];
        for k in 0..8 {
            let u = _mm256_load_si256(x.u[k].as_ptr() as *const __m256i);
            let v = _mm256_load_si256(x.v[k].as_ptr() as *const __m256i);
            for t in 0..T {
                let act = _mm256_set1_epi32(word(a[t].get_unchecked(b).qs.as_ptr().add(4 * k)));
                let act = if B::MIN { act } else { _mm256_sign_epi8(act, v) };
                sums[t] = V::dpbusd(sums[t], u, act);
            }
        }
        legacy_block_end::<B, T>(x, a, b, &sums, &mut acc, &mut mins);
    }
    legacy_result::<B, T>(&acc, &mins)
}

/// `legacy_group_dot_vnni` in AVX-VNNI's VEX encoding.
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
unsafe fn legacy_group_dot_vex<B: LegacyBlock, const T: usize>(
    g: &[LegacyGroup],
    a: [&[BlockQ8Act]; T],
) -> [[f32; 8]; T] {
    legacy_group_dot_vnni::<B, Vex, T>(g, a)
}

/// `legacy_group_dot_vnni` in AVX-512 VL's EVEX encoding.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
unsafe fn legacy_group_dot_evex<B: LegacyBlock, const T: usize>(
    g: &[LegacyGroup],
    a: [&[BlockQ8Act]; T],
) -> [[f32; 8]; T] {
    legacy_group_dot_vnni::<B, Evex, T>(g, a)
}

/// A group's dots with T tokens: `legacy_group_dot`, or with 256-bit VNNI in `vnni`'s encoding
/// (which reads v's signs: its groups are never `groups_offset`'s).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn legacy_group_dots<B: LegacyBlock, const T: usize>(
    g: &[LegacyGroup],
    a: [&[BlockQ8Act]; T],
    starts: [&[i32]; T],
    vnni: Option<Vnni256>,
) -> [[f32; 8]; T] {
    match vnni {
        None => legacy_group_dot::<B, T>(g, a, starts),
        Some(Vnni256::Vex) => legacy_group_dot_vex::<B, T>(g, a),
        Some(Vnni256::Evex) => legacy_group_dot_evex::<B, T>(g, a),
    }
}

/// Sixteen rows' block of a `LegacyBlock` format for AVX-512 VNNI: as `LegacyGroup`, the
/// weights unsigned (q for formats with minima, else v + 128, whose 128 the activations' sums
/// take off) so that `vpdpbusd` reads them as they are.
#[repr(C, align(64))]
#[derive(Clone, Copy, Default)]
struct LegacyGroup16 {
    u: [[u32; 16]; 8],
    d: [f32; 16],
    m: [f32; 16],
}
const _: () = assert!(std::mem::size_of::<LegacyGroup16>() == 640);

/// Decodes up to sixteen rows of a `LegacyBlock` format into `out`, a `LegacyGroup16` per
/// block; lanes past them are zero.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn unpack_legacy_group16<B: LegacyBlock>(rows: &[&[u8]], out: &mut [LegacyGroup16]) {
    if rows.len() < 16 {
        out.fill(LegacyGroup16::default());
    }
    let blocks: [&[B]; 16] =
        std::array::from_fn(|r| rows.get(r).map_or(&[][..], |&w| cast_blocks(w)));
    let mut staged = [[0u32; 8]; 16];
    let (mut d_bits, mut m_bits) = ([0u16; 16], [0u16; 16]);
    for (b, o) in out.iter_mut().enumerate() {
        prefetch_ahead::<B>(rows, b);
        for r in 0..rows.len() {
            let blk = blocks[r].get_unchecked(b);
            let v = blk.weights();
            let u = if B::MIN { v } else { _mm256_xor_si256(v, _mm256_set1_epi8(-128)) };
            _mm256_storeu_si256(staged[transpose_slot::<16>(r)].as_mut_ptr() as *mut __m256i, u);
            match B::F16_SCALE {
                true => d_bits[r] = blk.scale_bits(),
                false => o.d[r] = blk.scale(),
            }
            if B::MIN {
                m_bits[r] = blk.min_bits();
            }
        }
        for h in 0..2 {
            if B::F16_SCALE {
                _mm256_storeu_ps(o.d.as_mut_ptr().add(8 * h), f16x8(&d_bits[8 * h..]));
            }
            if B::MIN {
                _mm256_storeu_ps(o.m.as_mut_ptr().add(8 * h), f16x8(&m_bits[8 * h..]));
            }
        }
        transpose_chunk::<16>(&staged, &mut o.u);
    }
}

/// A group of sixteen rows against T tokens with AVX-512 VNNI: lane r is row r's dot, bit for
/// bit `avx512::dot_steps`'s: per block the exact integer sum (from -128 times the
/// activations' sum, `bias`, for signed formats), p = sum * (d * d_a) (+ m * s_a in one
/// rounding), and per four blocks acc += (p0 + p1) + (p2 + p3), a row's missing last blocks
/// counting as +0.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn legacy_group_dot_512<B: LegacyBlock, const T: usize>(
    g: &[LegacyGroup16],
    a: [&[BlockQ8Act]; T],
    bias: [&[i32]; T],
    out: &mut [[f32; 16]; T],
) {
    let mut acc = [_mm512_setzero_ps(); T];
    let word = |p: *const i8| (p as *const i32).read_unaligned();
    for q in (0..g.len()).step_by(4) {
        // (p0 + p1), then p2 (+ p3)
        let (mut first, mut second) = ([_mm512_setzero_ps(); T], [_mm512_setzero_ps(); T]);
        for b in q..(q + 4).min(g.len()) {
            let x = g.get_unchecked(b);
            let mut sums = [_mm512_setzero_si512(); T];
            if !B::MIN {
                for t in 0..T {
                    sums[t] = _mm512_set1_epi32(*bias[t].get_unchecked(b));
                }
            }
            for k in 0..8 {
                let u = _mm512_load_si512(x.u[k].as_ptr() as *const _);
                for t in 0..T {
                    sums[t] = _mm512_dpbusd_epi32(
                        sums[t],
                        u,
                        _mm512_set1_epi32(word(a[t].get_unchecked(b).qs.as_ptr().add(4 * k))),
                    );
                }
            }
            let (d, m) = (_mm512_load_ps(x.d.as_ptr()), _mm512_load_ps(x.m.as_ptr()));
            for t in 0..T {
                let ab = a[t].get_unchecked(b);
                let dd = _mm512_mul_ps(d, _mm512_set1_ps(ab.d));
                let p = if B::MIN {
                    _mm512_fmadd_ps(
                        _mm512_cvtepi32_ps(sums[t]),
                        dd,
                        _mm512_mul_ps(m, _mm512_set1_ps(ab.s)),
                    )
                } else {
                    _mm512_mul_ps(_mm512_cvtepi32_ps(sums[t]), dd)
                };
                match b - q {
                    0 => first[t] = p,
                    1 => first[t] = _mm512_add_ps(first[t], p),
                    2 => second[t] = p,
                    _ => second[t] = _mm512_add_ps(second[t], p),
                }
            }
        }
        for t in 0..T {
            // missing blocks add +0 where the one-token kernels add their zero padding's +0
            let zero = _mm512_setzero_ps();
            let first = if q + 1 < g.len() { first[t] } else { _mm512_add_ps(first[t], zero) };
            let second = if q + 3 < g.len() { second[t] } else { _mm512_add_ps(second[t], zero) };
            acc[t] = _mm512_add_ps(acc[t], _mm512_add_ps(first, second));
        }
    }
    for t in 0..T {
        _mm512_storeu_ps(out[t].as_mut_ptr(), acc[t]);
    }
}

/// Each activation block's sum times -128 into `out` (one per block; `Activations::q8_bias`,
/// computed once per batch): `legacy_group_dot_512`'s start for signed weights stored as
/// v + 128, and divided by 128 / c `legacy_group_dot`'s for `groups_offset` formats.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn activation_bias(q8: &[BlockQ8Act], out: &mut [i32]) {
    let (flip, zero) = (_mm256_set1_epi8(-128), _mm256_setzero_si256());
    for (o, blk) in out.iter_mut().zip(q8) {
        // sum(a + 128) of 32 bytes by `vpsadbw`, then less 32 * 128
        let sad = _mm256_sad_epu8(
            _mm256_xor_si256(_mm256_loadu_si256(blk.qs.as_ptr() as *const __m256i), flip),
            zero,
        );
        *o = -128 * (crate::avx2::hsum_i32(sad) - 32 * 128);
    }
}

/// `legacy_rows` with AVX-512 VNNI: groups of sixteen rows, eight tokens per step.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn legacy_rows_16<'a, B: LegacyBlock>(
    row: impl Fn(usize) -> &'a [u8],
    cols: usize,
    rows: std::ops::Range<usize>,
    q8: &[BlockQ8Act],
    bias: &[i32],
    n: usize,
    put: impl Fn(usize, usize, &[f32]),
) {
    let nb = cols / QK;
    assert_eq!(q8.len(), n * nb, "activations: wrong size for {n} tokens of {cols}");
    assert!(
        B::MIN || bias.len() == n * nb,
        "activations' sums: wrong size for {n} tokens of {cols}"
    );
    let token = |t: usize| &q8[t * nb..(t + 1) * nb];
    let bias_of = |t: usize| if B::MIN { &bias[..0] } else { &bias[t * nb..(t + 1) * nb] };
    let mut group = vec![LegacyGroup16::default(); nb];
    let mut r0 = rows.start;
    while r0 < rows.end {
        let r1 = (r0 + 16).min(rows.end);
        let mut bytes: [&[u8]; 16] = [&[]; 16];
        for r in r0..r1 {
            bytes[r - r0] = row(r);
        }
        unpack_legacy_group16::<B>(&bytes[..r1 - r0], &mut group);
        let mut prefetch =
            PrefetchRows::<16>::new((r1..(r1 + 16).min(rows.end)).map(&row), n / 4 + n % 4);
        let mut t = 0;
        macro_rules! tokens {
            ($T:literal) => {{
                let mut out = [[0.0f32; 16]; $T];
                // (loops, not `array::from_fn`: it stays a call per pass, ~9% of a Q4_0 prompt)
                let (mut a, mut b): ([&[BlockQ8Act]; $T], [&[i32]; $T]) = ([&[]; $T], [&[]; $T]);
                for k in 0..$T {
                    (a[k], b[k]) = (token(t + k), bias_of(t + k));
                }
                legacy_group_dot_512::<B, $T>(&group, a, b, &mut out);
                for (k, lanes) in out.iter().enumerate() {
                    put(t + k, r0, &lanes[..r1 - r0]);
                }
                t += $T;
            }};
        }
        while t + 8 <= n {
            prefetch.step();
            prefetch.step();
            tokens!(8);
        }
        while t + 4 <= n {
            prefetch.step();
            tokens!(4);
        }
        while t < n {
            prefetch.step();
            tokens!(1);
        }
        r0 = r1;
    }
}

/// Whether a type's prompts go in these row groups (`legacy_rows_all_tokens`): the formats
/// that read int8 activations per 32.
pub fn groups_rows(dtype: DType) -> bool {
    dtype.traits().activations == crate::dtype::ActFormat::Q8Per32
}

/// A prompt's product with Q4_0, Q5_0 or Q4_1 rows in groups of eight (`LegacyGroup`), each group
/// decoded once for all tokens, four tokens per step: `rows` of a weight matrix (`row(r)` its
/// bytes, `cols` wide) against `n` tokens' activation blocks (`q8`: n * cols / 32; `bias`:
/// `activation_bias` of them, which 16-row groups of signed formats read), put(t, r,
/// values of rows r, r + 1, ..); `width`: 16-row groups with AVX-512 (only where the CPU has
/// AVX-512 F/BW/VL/VNNI), else 8-row groups with AVX2, and AVX-VNNI where `width` says so (only
/// where the CPU has it).
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn legacy_rows_all_tokens<'a>(
    dtype: DType,
    width: GroupWidth,
    row: impl Fn(usize) -> &'a [u8],
    cols: usize,
    rows: std::ops::Range<usize>,
    q8: &[BlockQ8Act],
    bias: &[i32],
    n: usize,
    put: impl Fn(usize, usize, &[f32]),
) {
    macro_rules! by_width {
        ($block:ty) => {
            match width {
                GroupWidth::Avx512 => legacy_rows_16::<$block>(row, cols, rows, q8, bias, n, put),
                GroupWidth::AvxVnni(e) => {
                    legacy_rows::<$block>(row, cols, rows, q8, bias, n, Some(e), put)
                }
                GroupWidth::Avx2 => legacy_rows::<$block>(row, cols, rows, q8, bias, n, None, put),
            }
        };
    }
    match dtype {
        DType::Q4_0 => by_width!(BlockQ4_0),
        DType::Q4_1 => by_width!(BlockQ4_1),
        DType::Q5_0 => by_width!(BlockQ5_0),
        DType::Q5_1 => by_width!(BlockQ5_1),
        DType::Q8_0 => by_width!(BlockQ8_0),
        DType::IQ4_NL => by_width!(BlockIQ4NL),
        DType::MXFP4 => by_width!(BlockMXFP4),
        _ => unreachable!("{} has no row groups", dtype.name()),
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn legacy_rows<'a, B: LegacyBlock>(
    row: impl Fn(usize) -> &'a [u8],
    cols: usize,
    rows: std::ops::Range<usize>,
    q8: &[BlockQ8Act],
    bias: &[i32],
    n: usize,
    vnni: Option<Vnni256>,
    put: impl Fn(usize, usize, &[f32]),
) {
    let nb = cols / QK;
    assert_eq!(q8.len(), n * nb, "activations: wrong size for {n} tokens of {cols}");
    let token = |t: usize| &q8[t * nb..(t + 1) * nb];
    let offset = vnni.is_none() && groups_offset::<B>();
    // (activations set at another level than the product's may come without the bias)
    let mut own_bias = Vec::new();
    if offset && bias.len() != n * nb {
        own_bias.resize(n * nb, 0);
        activation_bias(q8, &mut own_bias);
    }
    let bias = if own_bias.is_empty() { bias } else { &own_bias[..] };
    let start = |t: usize| if offset { &bias[t * nb..(t + 1) * nb] } else { &[][..] };
    let mut group = vec![LegacyGroup::default(); nb];
    let mut r0 = rows.start;
    while r0 < rows.end {
        let r1 = (r0 + 8).min(rows.end);
        let mut bytes: [&[u8]; 8] = [&[]; 8];
        for r in r0..r1 {
            bytes[r - r0] = row(r);
        }
        unpack_legacy_group::<B>(&bytes[..r1 - r0], &mut group, offset);
        let mut prefetch =
            PrefetchRows::<8>::new((r1..(r1 + 8).min(rows.end)).map(&row), n / 4 + n % 4);
        let mut t = 0;
        while t + 4 <= n {
            prefetch.step();
            let four = [token(t), token(t + 1), token(t + 2), token(t + 3)];
            let four_starts = [start(t), start(t + 1), start(t + 2), start(t + 3)];
            let dots = legacy_group_dots::<B, 4>(&group, four, four_starts, vnni);
            for (k, lanes) in dots.iter().enumerate() {
                put(t + k, r0, &lanes[..r1 - r0]);
            }
            t += 4;
        }
        for t in t..n {
            prefetch.step();
            let one = legacy_group_dots::<B, 1>(&group, [token(t)], [start(t)], vnni);
            put(t, r0, &one[0][..r1 - r0]);
        }
        r0 = r1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::matmul::{dot_row, Activations, QMatrix, SimdLevel};
    use crate::quant::tests::{random_quantized_row, random_vec, QUANTIZED};

    /// Rows `rows` of `w` against the n tokens of `x` through the row groups at `width`, as
    /// (n, w.rows) with NaN in the rows not asked for.
    ///
    /// # Safety
    /// The CPU must have the features of `width`.
    unsafe fn group_dots(
        w: &QMatrix,
        width: GroupWidth,
        rows: std::ops::Range<usize>,
        x: &Activations,
        n: usize,
    ) -> Vec<f32> {
        let got = std::cell::RefCell::new(vec![f32::NAN; n * w.rows]);
        legacy_rows_all_tokens(
            w.dtype,
            width,
            |r| w.row(r),
            w.cols,
            rows,
            &x.q8,
            &x.q8_bias,
            n,
            |t, r, v| got.borrow_mut()[t * w.rows + r..][..v.len()].copy_from_slice(v),
        );
        got.into_inner()
    }

    /// The rows of `w` against `n` tokens of activations `xs` (n, w.cols), through the row
    /// groups at every width this CPU has and a token alone (four rows per kernel call, then
    /// one) at their level, each close to `want(t, r)`; with `unbiased`, at AVX2 also from
    /// activations without the batch's bias (which the groups then work out themselves).
    ///
    /// # Safety
    /// The CPU must have AVX2.
    unsafe fn assert_dots_exact(
        w: &QMatrix,
        xs: &[f32],
        n: usize,
        unbiased: bool,
        want: impl Fn(usize, usize) -> f32,
    ) {
        let mut x = Activations::default();
        x.set(xs, n, w.cols);
        let mut x_unbiased = Activations::default();
        x_unbiased.set(xs, n, w.cols);
        x_unbiased.q8_bias.clear();
        let mut runs = vec![(GroupWidth::Avx2, SimdLevel::Avx2, &x)];
        if unbiased {
            runs.push((GroupWidth::Avx2, SimdLevel::Avx2, &x_unbiased));
        }
        if crate::simd::simd_level() == SimdLevel::Avx512 {
            runs.push((GroupWidth::Avx512, SimdLevel::Avx512, &x));
        }
        let close = |got: f32, want: f32| (got - want).abs() <= 1e-4 * want.abs();
        let dtype = w.dtype;
        for (width, level, x) in runs {
            // SAFETY: AVX2 by the caller, AVX-512 where the CPU has it
            let got = unsafe { group_dots(w, width, 0..w.rows, x, n) };
            for t in 0..n {
                let mut alone = vec![f32::NAN; w.rows];
                crate::matmul::dot_rows(w, 0..w.rows, x, [t], level, |r, [v]| alone[r] = v);
                for r in 0..w.rows {
                    let (g, a) = (got[t * w.rows + r], alone[r]);
                    assert!(close(g, want(t, r)), "{dtype:?} {width:?} group t{t} r{r}: {g}");
                    assert!(close(a, want(t, r)), "{dtype:?} {level:?} alone t{t} r{r}: {a}");
                }
            }
        }
    }

    /// Activations of one sign per token (every int8 value +-127): +1 for even tokens.
    fn signs(n: usize, cols: usize) -> Vec<f32> {
        (0..n * cols).map(|i| if (i / cols).is_multiple_of(2) { 1.0 } else { -1.0 }).collect()
    }

    /// MXFP4's largest products (|v| = 12 against |a| = 127, all of one sign) sum without
    /// overflow in the 16-bit pair sums its kernels keep (it is not `WIDE`): a prompt's row
    /// groups and a token alone give the exact dot, at every level this CPU has.
    #[test]
    fn mxfp4_extremes_sum_exactly() {
        if !crate::simd::detect().has_avx2() {
            eprintln!("skipping: no AVX2 on this CPU");
            return;
        }
        let (rows, cols, n) = (9, 256, 8);
        // every weight 12 * 2^-1 (nibble 7) or -12 * 2^-1 (nibble 15) by row; exponent 127
        let mut data = Vec::new();
        for r in 0..rows {
            for _ in 0..cols / 32 {
                data.push(127u8);
                data.extend([if r % 2 == 0 { 0x77u8 } else { 0xFF }; 16]);
            }
        }
        let w = QMatrix { dtype: DType::MXFP4, rows, cols, data: &data };
        let want = |t: usize, r: usize| {
            (if (t + r).is_multiple_of(2) { 1.0 } else { -1.0 }) * 6.0 * cols as f32
        };
        // SAFETY: AVX2 checked above
        unsafe { assert_dots_exact(&w, &signs(n, cols), n, false, want) };
    }

    /// The offset formats' largest products (Q4_0's q = 15 or 0, v = 7 or -8; Q5_0's q = 31 or
    /// 0, v = 15 or -16; against |a| = 127, all of one sign) sum without overflow in the 16-bit
    /// sums the AVX2 row groups (Q4_0's of q a, `groups_offset`) and the one-token dots keep:
    /// a prompt's row groups and a token alone give the exact dot, at every level this CPU
    /// has, with and without the batch's bias.
    #[test]
    fn offset_extremes_sum_exactly() {
        if !crate::simd::detect().has_avx2() {
            eprintln!("skipping: no AVX2 on this CPU");
            return;
        }
        let (rows, cols, n) = (9, 256, 8);
        // d = 1 (f16 0x3C00); every q at its largest or 0, by row
        for (dtype, largest, v_hi, v_lo) in [
            (DType::Q4_0, &[0xFFu8; 16][..], 7.0f32, -8.0f32),
            (DType::Q5_0, &[0xFFu8; 20][..], 15.0, -16.0),
        ] {
            let mut data = Vec::new();
            for r in 0..rows {
                for _ in 0..cols / 32 {
                    data.extend(0x3C00u16.to_le_bytes());
                    data.extend(largest.iter().map(|&b| if r % 2 == 0 { b } else { 0 }));
                }
            }
            let w = QMatrix { dtype, rows, cols, data: &data };
            let v = |r: usize| if r.is_multiple_of(2) { v_hi } else { v_lo };
            let sign = |t: usize| if t.is_multiple_of(2) { 1.0f32 } else { -1.0 };
            let want = |t: usize, r: usize| sign(t) * v(r) * cols as f32;
            // SAFETY: AVX2 checked above
            unsafe { assert_dots_exact(&w, &signs(n, cols), n, true, want) };
        }
    }

    /// Every 32-weight format, through the row groups at every width this CPU has (AVX2, and
    /// AVX-VNNI, AVX-512 VNNI where it has them), gives bit for bit the one-token kernels' dots
    /// at that level (which are tested against the scalar twins), for whole and partial groups,
    /// whole and partial steps of four blocks, and steps of tokens.
    #[test]
    fn groups_equal_one_token_kernels_bit_for_bit() {
        if !crate::simd::detect().has_avx2() {
            eprintln!("skipping: no AVX2 on this CPU");
            return;
        }
        for (s, dtype) in QUANTIZED.into_iter().enumerate() {
            if !groups_rows(dtype) {
                // read per super-block at this level (`q256_x86`)
                continue;
            }
            for cols in [96, 256, 576, 1536] {
                let (rows, n) = (19, 13);
                let data: Vec<u8> = (0..rows)
                    .flat_map(|r| random_quantized_row(dtype, cols, (100 * s + r) as u64))
                    .collect();
                let w = QMatrix { dtype, rows, cols, data: &data };
                let mut x = Activations::default();
                x.set(&random_vec(n * cols, 5 + s as u64), n, cols);
                let mut widths = vec![(GroupWidth::Avx2, SimdLevel::Avx2)];
                for e in crate::simd::vnni256_encodings() {
                    widths.push((GroupWidth::AvxVnni(e), SimdLevel::Avx2));
                }
                // (the activations hold the AVX-512 kernels' quads where that is the level)
                if crate::simd::simd_level() == SimdLevel::Avx512 {
                    widths.push((GroupWidth::Avx512, SimdLevel::Avx512));
                }
                for (width, level) in widths {
                    // SAFETY: AVX2 checked above, AVX-VNNI and AVX-512 where the CPU has them
                    let got = unsafe { group_dots(&w, width, 1..rows, &x, n) };
                    for t in 0..n {
                        assert!(got[t * rows].is_nan(), "{dtype:?}: row 0 was not asked for");
                        for r in 1..rows {
                            let alone = dot_row(&w, r, None, &x, [t], level)[0];
                            let v = got[t * rows + r];
                            assert_eq!(
                                v.to_bits(),
                                alone.to_bits(),
                                "{dtype:?} cols {cols} {width:?} row {r} token {t}: {v} vs {alone}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// The one-token kernels with 256-bit VNNI, in every encoding this CPU runs, give bit for
    /// bit the AVX2 kernels' dots (which are tested against the scalar twins): four rows and
    /// one, one token and four, every 32-weight format.
    #[test]
    fn one_token_kernels_with_vnni_equal_avx2_bit_for_bit() {
        let encodings = crate::simd::vnni256_encodings();
        if encodings.is_empty() {
            eprintln!("skipping: no 256-bit VNNI on this CPU");
            return;
        }
        use crate::avx2::{dot_legacy_in, Prefetch};
        /// Rows `w` of format B against `a`: without VNNI, then in each encoding.
        fn compare<B: LegacyBlock, const R: usize, const N: usize>(
            name: &str,
            w: [&[u8]; R],
            a: [&[BlockQ8Act]; N],
            encodings: &[Vnni256],
        ) {
            let w = w.map(|row| cast_blocks::<B>(row));
            // SAFETY: AVX2 and each encoding's features are on this CPU (vnni256_encodings)
            let plain = unsafe { dot_legacy_in::<B, Prefetch, R, N>(None, w, a, &[]) };
            for &e in encodings {
                let got = unsafe { dot_legacy_in::<B, Prefetch, R, N>(Some(e), w, a, &[]) };
                for r in 0..R {
                    for t in 0..N {
                        assert_eq!(
                            got[r][t].to_bits(),
                            plain[r][t].to_bits(),
                            "{name} {e:?} rows {R} tokens {N}: row {r} token {t}"
                        );
                    }
                }
            }
        }
        for (s, dtype) in QUANTIZED.into_iter().enumerate() {
            if !groups_rows(dtype) {
                continue;
            }
            for cols in [32, 96, 576, 1536] {
                let rows: Vec<Vec<u8>> = (0..4)
                    .map(|r| random_quantized_row(dtype, cols, (50 * s + r) as u64))
                    .collect();
                let w4 = [&rows[0][..], &rows[1][..], &rows[2][..], &rows[3][..]];
                let mut x = Activations::default();
                x.set(&random_vec(4 * cols, 9 + s as u64), 4, cols);
                let nb = cols / QK;
                let tok = |t: usize| &x.q8[t * nb..(t + 1) * nb];
                let a4 = [tok(0), tok(1), tok(2), tok(3)];
                macro_rules! each_shape {
                    ($block:ty) => {{
                        compare::<$block, 4, 1>(dtype.name(), w4, [tok(2)], &encodings);
                        compare::<$block, 4, 4>(dtype.name(), w4, a4, &encodings);
                        compare::<$block, 1, 1>(dtype.name(), [w4[3]], [tok(1)], &encodings);
                    }};
                }
                match dtype {
                    DType::Q4_0 => each_shape!(BlockQ4_0),
                    DType::Q4_1 => each_shape!(BlockQ4_1),
                    DType::Q5_0 => each_shape!(BlockQ5_0),
                    DType::Q5_1 => each_shape!(BlockQ5_1),
                    DType::Q8_0 => each_shape!(BlockQ8_0),
                    DType::IQ4_NL => each_shape!(BlockIQ4NL),
                    DType::MXFP4 => each_shape!(BlockMXFP4),
                    _ => unreachable!("{} reads its activations per 32", dtype.name()),
                }
            }
        }
    }
}
