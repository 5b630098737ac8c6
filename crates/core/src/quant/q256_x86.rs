//! AVX2 (and, for prompts, AVX-512) kernels of the 256-weight formats against Q8_K activations,
//! twins of `q256::dot_scalar`. Per super-block, each 32-weight chunk is decoded to
//! unsigned bytes u (< 128); `vpmaddubsw` multiplies them with a token's activations and
//! `vpmaddwd` with the chunk's integer scales (one per 16 weights, as 16-bit lanes), and the
//! block's products sum exactly in 32-bit lanes. Then one float step per block and token
//! (`q256::block_step`), where per-32 activations need one per chunk (`chunks_x86`).
//!
//! Formats with negative weights stay unsigned where an offset makes them so, and the offset
//! comes off through the activations' sums per 16 (`bsums`): Q3_K's v = u - 4, Q6_K's
//! v = u - 32. IQ4_XS's grid has no offset: its signs move onto the activations (`vpsignb`).
//! The minima of Q2_K, Q4_K and Q5_K are one `vpmaddwd` of the minima with `bsums` per block.
//! No sum saturates: |u| <= 127 and |a| <= 127 make a `vpmaddubsw` pair at most 32258.
//!
//! One decoder per format (`SuperBlock::decode`) feeds both the one-token dots (`dot`: a block
//! decoded per four rows or tokens, four rows' float steps side by side) and prompts
//! (`rows_all_tokens`: 8 or 16 rows decoded once into a row-interleaved `RowGroupBlock`, a row
//! per 32-bit lane, dotted with four tokens per step). A block's integer sums are exact in any
//! order and its float step is the same scalar operation in every lane, so a token's dots are
//! bit for bit the same alone, in a prompt and in the scalar twin.

#![allow(clippy::missing_safety_doc)]

use std::arch::x86_64::*;

use super::chunks::{
    k4_scales, q3_k_scales, BlockIQ4XS, BlockQ2K, BlockQ3K, BlockQ4K, BlockQ5K, BlockQ6K,
    IQ4_VALUES,
};
use super::chunks_x86::{has_bit, load32, nibbles};
use super::q256::block_step;
use super::q256::BlockQ8K;
use super::{cast_blocks, DType, QK_K};
use crate::avx2::{hsum4_i32, hsum_i32, Dp256, Evex, LineFetch, PrefetchRows, Vex};
use crate::simd::Vnni256;

/// Chunk c (32 activations) of a token.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn acts(a: &BlockQ8K, c: usize) -> __m256i {
    load32(a.qs.as_ptr().add(32 * c) as *const u8)
}

/// A token's sums of each 16 activations, as 16-bit lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn bsums(a: &BlockQ8K) -> __m256i {
    _mm256_loadu_si256(a.bsums.as_ptr() as *const __m256i)
}

/// The sum over 32 weights of scale * u * a, in eight 32-bit lanes: `scales` holds the first
/// half's scale in 16-bit lanes 0..8 and the second half's in 8..16, as `vpmaddubsw` leaves the
/// halves' pair sums.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scaled(u: __m256i, a: __m256i, scales: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(u, a), scales)
}

/// 16-bit lane k of a 128-bit lane (both lanes of `x` alike) in all 16 lanes: one scale per
/// 32 weights. With `low`, in the low half of each 32-bit lane only, zero above (as `vpdpwssd`
/// pairs a 32-bit lane's sum with it).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn lane16(x: __m256i, k: usize, low: bool) -> __m256i {
    let word = ((2 * k) | ((2 * k + 1) << 8)) as u32;
    let high = if low { 0x8080 } else { word };
    _mm256_shuffle_epi8(x, _mm256_set1_epi32((word | high << 16) as i32))
}

/// 16-bit lanes 2k (to lanes 0..8) and 2k + 1 (to lanes 8..16) of a 128-bit lane (both lanes
/// of `x` alike): one scale per 16 weights. With `low`, as `lane16`'s.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn pair16(x: __m256i, k: usize, low: bool) -> __m256i {
    let control = |j: usize| {
        let word = ((2 * j) | ((2 * j + 1) << 8)) as u32;
        let high = if low { 0x8080 } else { word };
        _mm_set1_epi32((word | high << 16) as i32)
    };
    _mm256_shuffle_epi8(x, _mm256_set_m128i(control(2 * k + 1), control(2 * k)))
}

/// Sixteen 16-bit scales as two vectors holding scales 0..8 and 8..16 in both 128-bit lanes
/// (for `pair16`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn halves(scales: __m256i) -> [__m256i; 2] {
    [
        _mm256_permute2x128_si256::<0x00>(scales, scales),
        _mm256_permute2x128_si256::<0x11>(scales, scales),
    ]
}

/// Bits 2s and 2s + 1 of every byte of x, as 0..4.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn crumb(x: __m256i, s: usize) -> __m256i {
    let shifted = match s {
        0 => x,
        1 => _mm256_srli_epi16::<2>(x),
        2 => _mm256_srli_epi16::<4>(x),
        _ => _mm256_srli_epi16::<6>(x),
    };
    _mm256_and_si256(shifted, _mm256_set1_epi8(3))
}

/// What a super-block contributes besides its chunks: its float factors, and 16 16-bit values
/// (one per 16 weights) that meet the activations' `bsums`: the minima (`SuperBlock::MIN`), or
/// the scales of a format stored as v + 2^`OFFSET_SHIFT`.
#[derive(Clone, Copy)]
struct Block {
    d: f32,
    dmin: f32,
    extra: __m256i,
}

/// A 256-weight block format, decoded chunk by chunk.
trait SuperBlock {
    /// Whether the format has minima: d * sums - dmin * (minima . bsums).
    const MIN: bool;
    /// Stored as v + 2^OFFSET_SHIFT (0: not offset): (scales . bsums) << OFFSET_SHIFT comes off.
    const OFFSET_SHIFT: i32;
    /// Whether weights are negative as stored (IQ4_XS): u = |v|, v's signs go to the activations.
    const SIGNED: bool;
    /// How many 4-weight steps' sums of u * a (|a| <= 127) surely fit 16 bits: 4 (a whole
    /// sub-block) for u < 16, 2 for u < 32, else 0. Those VNNI's `vpdpbusd` sums before the scale
    /// multiplies them.
    const STEPS_IN_16_BITS: usize = 0;
    /// Weights per scale: 16, or 32 where both halves of a chunk share one (Q4_K, Q5_K, IQ4_XS).
    const SCALE_WEIGHTS: usize = 16;
    /// Whether the one-token dots take 256-bit VNNI where the AVX2 level has it
    /// (`vnni_rows_dot`): formats whose u < 64 and who gain by it. Measured in AVX-512's
    /// encoding on the AMD EPYC (Zen 4), 4096 x 4096 from cache, one thread: Q3_K, Q4_K, Q5_K
    /// and Q6_K 4-15% faster; Q2_K 7-9% slower (its 2-bit decode is cheap, so the chains of
    /// `vpdpwssd` weigh more than the instructions they save), so not Q2_K.
    const VNNI_DOTS: bool = true;
    /// Calls `each(c, u, v, scales)` for the block's chunks c = 0..8 in order: u the unsigned
    /// operand of `vpmaddubsw`, v the signed weights (`SIGNED`; else u again), scales the
    /// chunk's 16-bit scales as `scaled` takes them (a 32-bit lane's scale in both its halves),
    /// or with `low_scales` as `vpdpwssd` takes them (in the low half, zero above).
    unsafe fn decode(
        &self,
        low_scales: bool,
        each: impl FnMut(usize, __m256i, __m256i, __m256i),
    ) -> Block;
}

/// sums[t] += scale * v * a for chunk c of every token.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn add_chunk<const N: usize>(
    signed: bool,
    sums: &mut [__m256i; N],
    u: __m256i,
    v: __m256i,
    scales: __m256i,
    a: [&BlockQ8K; N],
    c: usize,
) {
    for t in 0..N {
        let x = if signed { _mm256_sign_epi8(acts(a[t], c), v) } else { acts(a[t], c) };
        sums[t] = _mm256_add_epi32(sums[t], scaled(u, x, scales));
    }
}

/// The block's extra term per token: the offset comes off `sums`; the minima's sums are returned.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn extras<B: SuperBlock, const N: usize>(
    blk: &Block,
    sums: &mut [__m256i; N],
    a: [&BlockQ8K; N],
) -> [__m256i; N] {
    let mut mins = [_mm256_setzero_si256(); N];
    for t in 0..N {
        if B::MIN {
            mins[t] = _mm256_madd_epi16(blk.extra, bsums(a[t]));
        } else if B::OFFSET_SHIFT > 0 {
            let offset = _mm256_sll_epi32(
                _mm256_madd_epi16(blk.extra, bsums(a[t])),
                _mm_cvtsi32_si128(B::OFFSET_SHIFT),
            );
            sums[t] = _mm256_sub_epi32(sums[t], offset);
        }
    }
    mins
}

/// `q256::block_step` from the lanes of a block's sums for a token.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn float_step(
    min: bool,
    acc: &mut f32,
    blk: &Block,
    sums: __m256i,
    mins: __m256i,
    d_a: f32,
) {
    let m = if min { hsum_i32(mins) } else { 0 };
    *acc = block_step(min, *acc, hsum_i32(sums), m, blk.d, blk.dmin, d_a);
}

/// An f16 as f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16(bits: u16) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
}

impl SuperBlock for BlockQ2K {
    const STEPS_IN_16_BITS: usize = 4;
    const VNNI_DOTS: bool = false;
    const MIN: bool = true;
    const OFFSET_SHIFT: i32 = 0;
    const SIGNED: bool = false;
    /// u = 2 bits; per 16 weights a 4-bit scale (low nibble of `scales`) and minimum (high).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn decode(
        &self,
        low_scales: bool,
        mut each: impl FnMut(usize, __m256i, __m256i, __m256i),
    ) -> Block {
        let packed = _mm_loadu_si128(self.scales.as_ptr() as *const __m128i);
        let low4 = _mm_set1_epi8(0x0F);
        let scales = halves(_mm256_cvtepu8_epi16(_mm_and_si128(packed, low4)));
        for g in 0..2 {
            let q = load32(self.qs.as_ptr().add(32 * g));
            for s in 0..4 {
                let u = crumb(q, s);
                each(4 * g + s, u, u, pair16(scales[g], s, low_scales));
            }
        }
        let mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16::<4>(packed), low4));
        Block { d: f16(self.d), dmin: f16(self.dmin), extra: mins }
    }
}

impl SuperBlock for BlockQ3K {
    const STEPS_IN_16_BITS: usize = 4;
    const MIN: bool = false;
    const OFFSET_SHIFT: i32 = 2;
    const SIGNED: bool = false;
    /// u = 2 low bits + 4 * the `hmask` bit = v + 4; a signed 6-bit scale per 16 weights.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn decode(
        &self,
        low_scales: bool,
        mut each: impl FnMut(usize, __m256i, __m256i, __m256i),
    ) -> Block {
        let packed = q3_k_scales(&self.scales);
        let signed =
            _mm_sub_epi8(_mm_loadu_si128(packed.as_ptr() as *const __m128i), _mm_set1_epi8(32));
        let all = _mm256_cvtepi8_epi16(signed);
        let scales = halves(all);
        let hmask = load32(self.hmask.as_ptr());
        let four = _mm256_set1_epi8(4);
        for g in 0..2 {
            let q = load32(self.qs.as_ptr().add(32 * g));
            for s in 0..4 {
                let c = 4 * g + s;
                let u = _mm256_or_si256(crumb(q, s), _mm256_and_si256(has_bit(hmask, c), four));
                each(c, u, u, pair16(scales[g], s, low_scales));
            }
        }
        Block { d: f16(self.d), dmin: 0.0, extra: all }
    }
}

/// Q4_K's and Q5_K's common part: u = the low 4 bits (and `qh`'s bit c << 4 for Q5_K), an
/// unsigned 6-bit scale and minimum per 32 weights.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn k4_decode(
    d: u16,
    dmin: u16,
    packed: &[u8; 12],
    qs: &[u8; 128],
    qh: Option<&[u8; 32]>,
    low_scales: bool,
    mut each: impl FnMut(usize, __m256i, __m256i, __m256i),
) -> Block {
    let sm = k4_scales(packed);
    let sm = _mm_loadu_si128(sm.as_ptr() as *const __m128i);
    let scales = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sm));
    let low4 = _mm256_set1_epi8(0x0F);
    let high = qh.map(|qh| load32(qh.as_ptr()));
    for g in 0..4 {
        let q = load32(qs.as_ptr().add(32 * g));
        let nibbles =
            [_mm256_and_si256(q, low4), _mm256_and_si256(_mm256_srli_epi16::<4>(q), low4)];
        for (h, mut u) in nibbles.into_iter().enumerate() {
            let c = 2 * g + h;
            if let Some(high) = high {
                u = _mm256_or_si256(u, _mm256_and_si256(has_bit(high, c), _mm256_set1_epi8(0x10)));
            }
            each(c, u, u, lane16(scales, c, low_scales));
        }
    }
    // minimum k for bsums 2k and 2k + 1
    let mins = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(
        sm,
        _mm_setr_epi8(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15),
    ));
    Block { d: f16(d), dmin: f16(dmin), extra: mins }
}

impl SuperBlock for BlockQ4K {
    const SCALE_WEIGHTS: usize = 32;
    const STEPS_IN_16_BITS: usize = 4;
    const MIN: bool = true;
    const OFFSET_SHIFT: i32 = 0;
    const SIGNED: bool = false;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn decode(
        &self,
        low_scales: bool,
        each: impl FnMut(usize, __m256i, __m256i, __m256i),
    ) -> Block {
        k4_decode(self.d, self.dmin, &self.scales, &self.qs, None, low_scales, each)
    }
}

impl SuperBlock for BlockQ5K {
    const SCALE_WEIGHTS: usize = 32;
    const STEPS_IN_16_BITS: usize = 2;
    const MIN: bool = true;
    const OFFSET_SHIFT: i32 = 0;
    const SIGNED: bool = false;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn decode(
        &self,
        low_scales: bool,
        each: impl FnMut(usize, __m256i, __m256i, __m256i),
    ) -> Block {
        k4_decode(self.d, self.dmin, &self.scales, &self.qs, Some(&self.qh), low_scales, each)
    }
}

impl SuperBlock for BlockQ6K {
    const MIN: bool = false;
    const OFFSET_SHIFT: i32 = 5;
    const SIGNED: bool = false;
    /// u = 4 low bits (`ql`) + 2 high bits (`qh`) << 4 = v + 32; a signed 8-bit scale per 16
    /// weights. Chunk 4g + s: `ql` bytes 64g + 32 (s % 2), nibble s / 2; `qh` bytes 32g, bits 2s.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn decode(
        &self,
        low_scales: bool,
        mut each: impl FnMut(usize, __m256i, __m256i, __m256i),
    ) -> Block {
        let all = _mm256_cvtepi8_epi16(_mm_loadu_si128(self.scales.as_ptr() as *const __m128i));
        let scales = halves(all);
        let (low4, top2) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(0x30));
        for g in 0..2 {
            let ql =
                [load32(self.ql.as_ptr().add(64 * g)), load32(self.ql.as_ptr().add(64 * g + 32))];
            let qh = load32(self.qh.as_ptr().add(32 * g));
            for s in 0..4 {
                let low = if s < 2 { ql[s] } else { _mm256_srli_epi16::<4>(ql[s - 2]) };
                // bits 2s, 2s + 1 to bits 4, 5
                let high = match s {
                    0 => _mm256_slli_epi16::<4>(qh),
                    1 => _mm256_slli_epi16::<2>(qh),
                    2 => qh,
                    _ => _mm256_srli_epi16::<2>(qh),
                };
                let u = _mm256_or_si256(_mm256_and_si256(low, low4), _mm256_and_si256(high, top2));
                each(4 * g + s, u, u, pair16(scales[g], s, low_scales));
            }
        }
        Block { d: f16(self.d), dmin: 0.0, extra: all }
    }
}

/// Eight 32-bit scales (one per 32 weights) as sixteen 16-bit ones (one per 16 weights).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn per_16(scales: __m256i) -> __m256i {
    _mm256_or_si256(
        _mm256_and_si256(scales, _mm256_set1_epi32(0xFFFF)),
        _mm256_slli_epi32::<16>(scales),
    )
}

/// The eight 6-bit scales of an IQ4_XS block, less 32 (`chunks::iq4_xs_scale`), in 32-bit
/// lanes: nibble c of `scales_l` and bits 2c, 2c + 1 of `scales_h` for lane c.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn iq4_xs_scales(x: &BlockIQ4XS) -> __m256i {
    let low = _mm256_srlv_epi32(
        _mm256_set1_epi32(u32::from_le_bytes(x.scales_l) as i32),
        _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28),
    );
    let high = _mm256_srlv_epi32(
        _mm256_set1_epi32(x.scales_h as i32),
        _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14),
    );
    let six = _mm256_or_si256(
        _mm256_and_si256(low, _mm256_set1_epi32(0x0F)),
        _mm256_slli_epi32::<4>(_mm256_and_si256(high, _mm256_set1_epi32(3))),
    );
    _mm256_sub_epi32(six, _mm256_set1_epi32(32))
}

impl SuperBlock for BlockIQ4XS {
    const SCALE_WEIGHTS: usize = 32;
    // (signed weights up to 127: four products do not fit 16 bits)
    const VNNI_DOTS: bool = false;
    const MIN: bool = false;
    const OFFSET_SHIFT: i32 = 0;
    const SIGNED: bool = true;
    /// v = the grid value of a nibble; a signed 6-bit scale per 32 weights (`extra`: per 16, for
    /// `group_dot`, whose weights go in as v + 128).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn decode(
        &self,
        low_scales: bool,
        mut each: impl FnMut(usize, __m256i, __m256i, __m256i),
    ) -> Block {
        let ls = iq4_xs_scales(self);
        // as 16-bit lanes 0..8, in both 128-bit lanes
        let scales = _mm256_permute4x64_epi64::<0b10_00_10_00>(_mm256_packs_epi32(ls, ls));
        let table =
            _mm256_broadcastsi128_si256(_mm_loadu_si128(IQ4_VALUES.as_ptr() as *const __m128i));
        for c in 0..8 {
            let v = _mm256_shuffle_epi8(table, nibbles(self.qs.as_ptr().add(16 * c)));
            each(c, _mm256_sign_epi8(v, v), v, lane16(scales, c, low_scales));
        }
        Block { d: f16(self.d), dmin: 0.0, extra: per_16(ls) }
    }
}

/// The one-token dots' loop, written once: R rows of format B against N tokens, per block
/// `prepare(at)` once (what every row reads of the tokens), then per row
/// `row_block(block, prepared, at, sums)`, which adds the row's exact sums of scale * v * a to
/// each token's lanes and gives the block's `Block`; then the minima's or offset's sums and
/// the float steps (`FloatSteps`). `next`: the bytes read after these rows (prefetched).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows_dot_with<'n, B: SuperBlock, F: LineFetch<'n>, P, const R: usize, const N: usize>(
    rows: [&[u8]; R],
    a: [&[BlockQ8K]; N],
    next: &'n [&'n [u8]],
    prepare: impl Fn([&BlockQ8K; N]) -> P,
    row_block: impl Fn(&B, &P, [&BlockQ8K; N], &mut [__m256i; N]) -> Block,
) -> [[f32; N]; R] {
    let w: [&[B]; R] = crate::quant::cast_rows::<B, R>(rows);
    let mut steps = FloatSteps::<R, N>::new();
    let mut prefetch = F::new(next, a[0].len());
    for b in 0..a[0].len() {
        prefetch.step();
        let at: [&BlockQ8K; N] = std::array::from_fn(|t| a[t].get_unchecked(b));
        let prepared = prepare(at);
        let mut sums = [[_mm256_setzero_si256(); N]; R];
        let mut mins = [[_mm256_setzero_si256(); N]; R];
        let mut blks = [Block { d: 0.0, dmin: 0.0, extra: _mm256_setzero_si256() }; R];
        for r in 0..R {
            blks[r] = row_block(w[r].get_unchecked(b), &prepared, at, &mut sums[r]);
            mins[r] = extras::<B, N>(&blks[r], &mut sums[r], at);
        }
        steps.add(B::MIN, &blks, &sums, &mins, at);
    }
    steps.finish()
}

/// R rows of format B against N tokens with AVX2, a chunk per `vpmaddubsw`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows_dot<'n, B: SuperBlock, F: LineFetch<'n>, const R: usize, const N: usize>(
    rows: [&[u8]; R],
    a: [&[BlockQ8K]; N],
    next: &'n [&'n [u8]],
) -> [[f32; N]; R] {
    rows_dot_with::<B, F, (), R, N>(
        rows,
        a,
        next,
        |_| (),
        |x, _, at, sums| {
            x.decode(false, |c, u, v, scales| add_chunk(B::SIGNED, sums, u, v, scales, at, c))
        },
    )
}

/// `rows_dot` with 256-bit VNNI in the encoding of V, for formats whose u < 64
/// (`SuperBlock::VNNI_DOTS`): a chunk's sums of u * a per 32-bit lane by `vpdpbusd` (4 * 63 *
/// 128 fits 16 bits), times the lane's scale by `vpdpwssd` into the block's sums (even and odd
/// chunks apart, two dependency chains), two instructions where `scaled` and its addition take
/// three; the same exact sums. (A macro, so that its closures are defined in the
/// wrapper compiled for the encoding and inherit its features: the instructions then inline.)
macro_rules! vnni_rows_dot {
    ($V:ty, $rows:expr, $a:expr, $next:expr) => {
        rows_dot_with::<B, F, (), R, N>(
            $rows,
            $a,
            $next,
            |_| (),
            |x, _, at, sums| {
                // odd chunks into sums of their own: two chains of `vpdpwssd` per token
                let mut odd = [_mm256_setzero_si256(); N];
                let blk = x.decode(true, |c, u, _, scales| {
                    for t in 0..N {
                        let part = <$V>::dpbusd(_mm256_setzero_si256(), u, acts(at[t], c));
                        if c % 2 == 0 {
                            sums[t] = <$V>::dpwssd(sums[t], part, scales);
                        } else {
                            odd[t] = <$V>::dpwssd(odd[t], part, scales);
                        }
                    }
                });
                for t in 0..N {
                    sums[t] = _mm256_add_epi32(sums[t], odd[t]);
                }
                blk
            },
        )
    };
}

/// `rows_dot` with 256-bit VNNI in AVX-VNNI's VEX encoding (`vnni_rows_dot`).
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
unsafe fn rows_dot_vex<'n, B: SuperBlock, F: LineFetch<'n>, const R: usize, const N: usize>(
    rows: [&[u8]; R],
    a: [&[BlockQ8K]; N],
    next: &'n [&'n [u8]],
) -> [[f32; N]; R] {
    vnni_rows_dot!(Vex, rows, a, next)
}

/// `rows_dot` with 256-bit VNNI in AVX-512 VL's EVEX encoding (`vnni_rows_dot`).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
unsafe fn rows_dot_evex<'n, B: SuperBlock, F: LineFetch<'n>, const R: usize, const N: usize>(
    rows: [&[u8]; R],
    a: [&[BlockQ8K]; N],
    next: &'n [&'n [u8]],
) -> [[f32; N]; R] {
    vnni_rows_dot!(Evex, rows, a, next)
}

/// `rows_dot`, or with 256-bit VNNI in `vnni`'s encoding where the format takes it
/// (`SuperBlock::VNNI_DOTS`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows_dot_in<'n, B: SuperBlock, F: LineFetch<'n>, const R: usize, const N: usize>(
    vnni: Option<Vnni256>,
    rows: [&[u8]; R],
    a: [&[BlockQ8K]; N],
    next: &'n [&'n [u8]],
) -> [[f32; N]; R] {
    match vnni {
        Some(Vnni256::Vex) if B::VNNI_DOTS => rows_dot_vex::<B, F, R, N>(rows, a, next),
        Some(Vnni256::Evex) if B::VNNI_DOTS => rows_dot_evex::<B, F, R, N>(rows, a, next),
        _ => rows_dot::<B, F, R, N>(rows, a, next),
    }
}

/// A super-block format decoded two chunks per 512-bit register, for the one-token dots with
/// AVX-512 VNNI (`rows_dot_512`): formats whose u times four activations surely fit 16 bits
/// (u < 64), so that a `vpdpbusd` step's lanes meet their scale by `vpdpwssd`.
trait SuperBlock512: SuperBlock {
    /// The chunks in the two halves of each register, in the order `decode512` gives them.
    const PAIRS: [[usize; 2]; 4];
    /// Calls `each(p, u, scales)` for p = 0..4: u the unsigned weights of chunks PAIRS[p] (low
    /// half, high half), scales each 32-bit lane's (four weights') 16-bit scale in its low
    /// word, zero in the high one.
    unsafe fn decode512(&self, each: impl FnMut(usize, __m512i, __m512i)) -> Block;
}

/// The `vpermd` index that puts scale `of(c, h)` (of chunk c's half h: 16 weights) in the four
/// lanes of that half, for the two chunks of each of `pairs`.
const fn pair_scale_index(pairs: [[usize; 2]; 4], per_32: bool) -> [[i32; 16]; 4] {
    let mut idx = [[0i32; 16]; 4];
    let mut p = 0;
    while p < 4 {
        let mut lane = 0;
        while lane < 16 {
            let c = pairs[p][lane / 8];
            let h = (lane / 4) % 2;
            idx[p][lane] = if per_32 { c as i32 } else { (2 * c + h) as i32 };
            lane += 1;
        }
        p += 1;
    }
    idx
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn index16(idx: &[i32; 16]) -> __m512i {
    _mm512_loadu_si512(idx.as_ptr() as *const _)
}

/// Chunks 0..4 and 4..8 of two 2-bit formats (Q2_K, Q3_K): 64 bytes of `qs`, crumb s of each.
const CRUMB_PAIRS: [[usize; 2]; 4] = [[0, 4], [1, 5], [2, 6], [3, 7]];
/// Q4_K, Q5_K: low and high nibbles of 64 bytes of `qs` (chunks 2g, 2g + 1 in each 32).
const NIBBLE_PAIRS: [[usize; 2]; 4] = [[0, 2], [1, 3], [4, 6], [5, 7]];

/// Where bit `c0` of each byte (low half) and `c1` (high half) is set, as a byte mask.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn bits_of_pair(x: __m512i, [c0, c1]: [usize; 2]) -> __mmask64 {
    let bits = _mm512_inserti64x4::<1>(
        _mm512_set1_epi8((1u8 << c0) as i8),
        _mm256_set1_epi8((1u8 << c1) as i8),
    );
    _mm512_test_epi8_mask(x, bits)
}

/// 32 bytes in both halves.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn both_halves(p: *const u8) -> __m512i {
    _mm512_broadcast_i64x4(load32(p))
}

impl SuperBlock512 for BlockQ2K {
    const PAIRS: [[usize; 2]; 4] = CRUMB_PAIRS;
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn decode512(&self, mut each: impl FnMut(usize, __m512i, __m512i)) -> Block {
        const IDX: [[i32; 16]; 4] = pair_scale_index(CRUMB_PAIRS, false);
        let packed = _mm_loadu_si128(self.scales.as_ptr() as *const __m128i);
        let low4 = _mm_set1_epi8(0x0F);
        let scales = _mm512_cvtepu8_epi32(_mm_and_si128(packed, low4));
        let q = _mm512_loadu_si512(self.qs.as_ptr() as *const _);
        let three = _mm512_set1_epi8(3);
        each(0, _mm512_and_si512(q, three), _mm512_permutexvar_epi32(index16(&IDX[0]), scales));
        each(
            1,
            _mm512_and_si512(_mm512_srli_epi16::<2>(q), three),
            _mm512_permutexvar_epi32(index16(&IDX[1]), scales),
        );
        each(
            2,
            _mm512_and_si512(_mm512_srli_epi16::<4>(q), three),
            _mm512_permutexvar_epi32(index16(&IDX[2]), scales),
        );
        each(
            3,
            _mm512_and_si512(_mm512_srli_epi16::<6>(q), three),
            _mm512_permutexvar_epi32(index16(&IDX[3]), scales),
        );
        let mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16::<4>(packed), low4));
        Block { d: f16(self.d), dmin: f16(self.dmin), extra: mins }
    }
}

impl SuperBlock512 for BlockQ3K {
    const PAIRS: [[usize; 2]; 4] = CRUMB_PAIRS;
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn decode512(&self, mut each: impl FnMut(usize, __m512i, __m512i)) -> Block {
        const IDX: [[i32; 16]; 4] = pair_scale_index(CRUMB_PAIRS, false);
        let packed = q3_k_scales(&self.scales);
        let signed =
            _mm_sub_epi8(_mm_loadu_si128(packed.as_ptr() as *const __m128i), _mm_set1_epi8(32));
        // (the high words zero: `vpdpwssd` pairs them with the sums' high words)
        let scales = _mm512_and_si512(_mm512_cvtepi8_epi32(signed), _mm512_set1_epi32(0xFFFF));
        let q = _mm512_loadu_si512(self.qs.as_ptr() as *const _);
        let hmask = both_halves(self.hmask.as_ptr());
        let (three, four) = (_mm512_set1_epi8(3), _mm512_set1_epi8(4));
        let crumbs =
            [q, _mm512_srli_epi16::<2>(q), _mm512_srli_epi16::<4>(q), _mm512_srli_epi16::<6>(q)];
        for (p, crumb) in crumbs.into_iter().enumerate() {
            let low = _mm512_and_si512(crumb, three);
            let u = _mm512_mask_add_epi8(low, bits_of_pair(hmask, CRUMB_PAIRS[p]), low, four);
            each(p, u, _mm512_permutexvar_epi32(index16(&IDX[p]), scales));
        }
        Block { d: f16(self.d), dmin: 0.0, extra: _mm256_cvtepi8_epi16(signed) }
    }
}

/// Q4_K's and Q5_K's `decode512`: the nibbles of `qs` (and `qh`'s bit c << 4 for Q5_K).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn k4_decode512(
    d: u16,
    dmin: u16,
    packed: &[u8; 12],
    qs: &[u8; 128],
    qh: Option<&[u8; 32]>,
    mut each: impl FnMut(usize, __m512i, __m512i),
) -> Block {
    const IDX: [[i32; 16]; 4] = pair_scale_index(NIBBLE_PAIRS, true);
    let sm = k4_scales(packed);
    let sm = _mm_loadu_si128(sm.as_ptr() as *const __m128i);
    // lanes 0..8: the scales (6 bits: the high words are zero)
    let scales = _mm512_cvtepu8_epi32(sm);
    let low4 = _mm512_set1_epi8(0x0F);
    let high = qh.map(|qh| both_halves(qh.as_ptr()));
    for g in 0..2 {
        let q = _mm512_loadu_si512(qs.as_ptr().add(64 * g) as *const _);
        let nibbles =
            [_mm512_and_si512(q, low4), _mm512_and_si512(_mm512_srli_epi16::<4>(q), low4)];
        for (h, mut u) in nibbles.into_iter().enumerate() {
            let p = 2 * g + h;
            if let Some(high) = high {
                u = _mm512_mask_add_epi8(
                    u,
                    bits_of_pair(high, NIBBLE_PAIRS[p]),
                    u,
                    _mm512_set1_epi8(0x10),
                );
            }
            each(p, u, _mm512_permutexvar_epi32(index16(&IDX[p]), scales));
        }
    }
    let mins = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(
        sm,
        _mm_setr_epi8(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15),
    ));
    Block { d: f16(d), dmin: f16(dmin), extra: mins }
}

impl SuperBlock512 for BlockQ4K {
    const PAIRS: [[usize; 2]; 4] = NIBBLE_PAIRS;
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn decode512(&self, each: impl FnMut(usize, __m512i, __m512i)) -> Block {
        k4_decode512(self.d, self.dmin, &self.scales, &self.qs, None, each)
    }
}

impl SuperBlock512 for BlockQ5K {
    const PAIRS: [[usize; 2]; 4] = NIBBLE_PAIRS;
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn decode512(&self, each: impl FnMut(usize, __m512i, __m512i)) -> Block {
        k4_decode512(self.d, self.dmin, &self.scales, &self.qs, Some(&self.qh), each)
    }
}

/// Q6_K: chunks 4g, 4g + 1 are the low nibbles of `ql` bytes 64g..64g + 64, 4g + 2, 4g + 3 the
/// high ones; their top two bits are bits (0, 1), (2, 3), (4, 5), (6, 7) of `qh` bytes 32g..
const SIXES_PAIRS: [[usize; 2]; 4] = [[0, 1], [2, 3], [4, 5], [6, 7]];

impl SuperBlock512 for BlockQ6K {
    const PAIRS: [[usize; 2]; 4] = SIXES_PAIRS;
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn decode512(&self, mut each: impl FnMut(usize, __m512i, __m512i)) -> Block {
        const IDX: [[i32; 16]; 4] = pair_scale_index(SIXES_PAIRS, false);
        let all = _mm_loadu_si128(self.scales.as_ptr() as *const __m128i);
        let scales = _mm512_and_si512(_mm512_cvtepi8_epi32(all), _mm512_set1_epi32(0xFFFF));
        let (low4, top2) = (_mm512_set1_epi8(0x0F), _mm512_set1_epi8(0x30));
        // bits (0, 1) | (2, 3) to bits 4, 5: left by 4 | 2; bits (4, 5) | (6, 7): right by 0 | 2
        let (left, right) = (
            _mm512_inserti64x4::<1>(_mm512_set1_epi16(4), _mm256_set1_epi16(2)),
            _mm512_inserti64x4::<1>(_mm512_setzero_si512(), _mm256_set1_epi16(2)),
        );
        for g in 0..2 {
            let ql = _mm512_loadu_si512(self.ql.as_ptr().add(64 * g) as *const _);
            let qh = both_halves(self.qh.as_ptr().add(32 * g));
            let first = _mm512_or_si512(
                _mm512_and_si512(ql, low4),
                _mm512_and_si512(_mm512_sllv_epi16(qh, left), top2),
            );
            let second = _mm512_or_si512(
                _mm512_and_si512(_mm512_srli_epi16::<4>(ql), low4),
                _mm512_and_si512(_mm512_srlv_epi16(qh, right), top2),
            );
            each(2 * g, first, _mm512_permutexvar_epi32(index16(&IDX[2 * g]), scales));
            each(2 * g + 1, second, _mm512_permutexvar_epi32(index16(&IDX[2 * g + 1]), scales));
        }
        Block { d: f16(self.d), dmin: 0.0, extra: _mm256_cvtepi8_epi16(all) }
    }
}

/// A pair of chunks against N tokens: wide[t] += scales * (u . a), four weights per lane.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn add_pair<const N: usize>(
    wide: &mut [__m512i; N],
    u: __m512i,
    scales: __m512i,
    acts: &[__m512i; N],
) {
    for t in 0..N {
        let part = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, acts[t]);
        wide[t] = _mm512_dpwssd_epi32(wide[t], part, scales);
    }
}

/// A pair of chunks' activations for every token, in a format's pairs (`SuperBlock512::PAIRS`).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn paired_acts<B: SuperBlock512, const N: usize>(at: [&BlockQ8K; N]) -> [[__m512i; N]; 4] {
    let mut acts = [[_mm512_setzero_si512(); N]; 4];
    for (p, [c0, c1]) in B::PAIRS.into_iter().enumerate() {
        for t in 0..N {
            let q = at[t].qs.as_ptr() as *const u8;
            acts[p][t] = if c1 == c0 + 1 {
                _mm512_loadu_si512(q.add(32 * c0) as *const _)
            } else {
                _mm512_inserti64x4::<1>(
                    _mm512_castsi256_si512(load32(q.add(32 * c0))),
                    load32(q.add(32 * c1)),
                )
            };
        }
    }
    acts
}

/// The 256-bit halves of each token's lanes added (exact integers).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn fold<const N: usize>(wide: &[__m512i; N], sums: &mut [__m256i; N]) {
    for t in 0..N {
        sums[t] = _mm256_add_epi32(
            sums[t],
            _mm256_add_epi32(
                _mm512_castsi512_si256(wide[t]),
                _mm512_extracti64x4_epi64::<1>(wide[t]),
            ),
        );
    }
}

/// R rows of a `SuperBlock512` format against N tokens with AVX-512 VNNI: two chunks per
/// 512-bit step, `vpdpbusd` (its lanes fit 16 bits) then `vpdpwssd` with the scales; the same
/// exact integer sums and float steps as `rows_dot`'s.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn rows_dot_512<'n, B: SuperBlock512, F: LineFetch<'n>, const R: usize, const N: usize>(
    rows: [&[u8]; R],
    a: [&[BlockQ8K]; N],
    next: &'n [&'n [u8]],
) -> [[f32; N]; R] {
    rows_dot_with::<B, F, _, R, N>(
        rows,
        a,
        next,
        |at| paired_acts::<B, N>(at),
        |x, acts, _, sums| {
            let mut wide = [_mm512_setzero_si512(); N];
            let blk = x.decode512(|p, u, scales| add_pair(&mut wide, u, scales, &acts[p]));
            fold(&wide, sums);
            blk
        },
    )
}

/// IQ4_XS rows against N tokens with AVX-512 VNNI: two chunks per 512-bit step, the grid
/// values stored + 128 (unsigned, for `vpdpbusd`) and the 128 taken off through the
/// activations' sums; the same exact integer sums and float steps as `rows_dot`'s.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn rows_dot_iq4_xs_512<'n, F: LineFetch<'n>, const R: usize, const N: usize>(
    rows: [&[u8]; R],
    a: [&[BlockQ8K]; N],
    next: &'n [&'n [u8]],
) -> [[f32; N]; R] {
    let biased =
        _mm_xor_si128(_mm_loadu_si128(IQ4_VALUES.as_ptr() as *const __m128i), _mm_set1_epi8(-128));
    let table = _mm512_broadcast_i32x4(biased);
    let low4 = _mm512_set1_epi8(0x0F);
    // 32 bytes of nibbles (chunks 2h, 2h + 1) to 128-bit lanes: low, high nibbles of chunk 2h, of 2h + 1
    let spread = _mm512_setr_epi64(0, 1, 0, 1, 2, 3, 2, 3);
    rows_dot_with::<BlockIQ4XS, F, (), R, N>(
        rows,
        a,
        next,
        |_| (),
        |x, _, at, sums| {
            let ls = _mm512_castsi256_si512(iq4_xs_scales(x));
            let mut wide = [_mm512_setzero_si512(); N];
            for h in 0..4 {
                let q = _mm512_permutexvar_epi64(
                    spread,
                    _mm512_castsi256_si512(load32(x.qs.as_ptr().add(32 * h))),
                );
                let u = _mm512_shuffle_epi8(
                    table,
                    _mm512_and_si512(
                        _mm512_mask_blend_epi64(0b1100_1100, q, _mm512_srli_epi16::<4>(q)),
                        low4,
                    ),
                );
                // chunk 2h's scale in lanes 0..8, 2h + 1's in 8..16
                let which = _mm512_mask_blend_epi32(
                    0xFF00,
                    _mm512_set1_epi32(2 * h as i32),
                    _mm512_set1_epi32(2 * h as i32 + 1),
                );
                let scale = _mm512_permutexvar_epi32(which, ls);
                for t in 0..N {
                    let part = _mm512_dpbusd_epi32(
                        _mm512_setzero_si512(),
                        u,
                        _mm512_loadu_si512(at[t].qs.as_ptr().add(64 * h) as *const _),
                    );
                    wide[t] = _mm512_add_epi32(wide[t], _mm512_mullo_epi32(part, scale));
                }
            }
            let blk = Block { d: f16(x.d), dmin: 0.0, extra: per_16(_mm512_castsi512_si256(ls)) };
            fold(&wide, sums);
            // the 128 of the grid values, through the activations' sums
            for t in 0..N {
                sums[t] = _mm256_sub_epi32(
                    sums[t],
                    _mm256_slli_epi32::<7>(_mm256_madd_epi16(blk.extra, bsums(at[t]))),
                );
            }
            blk
        },
    )
}

/// Per block and token, `q256::block_step` of R rows: four rows side by side in the
/// lanes of one vector per token, else one by one.
struct FloatSteps<const R: usize, const N: usize> {
    acc: [[f32; N]; R],
    acc4: [__m128; N],
}

impl<const R: usize, const N: usize> FloatSteps<R, N> {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn new() -> Self {
        FloatSteps { acc: [[0.0; N]; R], acc4: [_mm_setzero_ps(); N] }
    }

    /// A block's steps from its exact integer sums (and minima's sums, `min`).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn add(
        &mut self,
        min: bool,
        blks: &[Block; R],
        sums: &[[__m256i; N]; R],
        mins: &[[__m256i; N]; R],
        at: [&BlockQ8K; N],
    ) {
        for t in 0..N {
            if R == 4 {
                let d_a = _mm_set1_ps(at[t].d);
                let d = _mm_setr_ps(blks[0].d, blks[1].d, blks[2].d, blks[3].d);
                let total = hsum4_i32([sums[0][t], sums[1][t], sums[2][t], sums[3][t]]);
                self.acc4[t] =
                    _mm_fmadd_ps(_mm_cvtepi32_ps(total), _mm_mul_ps(d, d_a), self.acc4[t]);
                if min {
                    let dmin = _mm_setr_ps(blks[0].dmin, blks[1].dmin, blks[2].dmin, blks[3].dmin);
                    let total = hsum4_i32([mins[0][t], mins[1][t], mins[2][t], mins[3][t]]);
                    self.acc4[t] =
                        _mm_fnmadd_ps(_mm_cvtepi32_ps(total), _mm_mul_ps(dmin, d_a), self.acc4[t]);
                }
            } else {
                for r in 0..R {
                    float_step(min, &mut self.acc[r][t], &blks[r], sums[r][t], mins[r][t], at[t].d);
                }
            }
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn finish(mut self) -> [[f32; N]; R] {
        if R == 4 {
            for t in 0..N {
                let mut lanes = [0.0f32; 4];
                _mm_storeu_ps(lanes.as_mut_ptr(), self.acc4[t]);
                for r in 0..R {
                    self.acc[r][t] = lanes[r];
                }
            }
        }
        self.acc
    }
}

/// R rows of a type that reads per-256 activations against N tokens of Q8_K activations; `next`: the
/// bytes read after these rows (prefetched, see `matmul::dot_row`); `wide`: with
/// AVX-512 VNNI (only where the CPU has AVX-512 F/BW/VL/VNNI); else with 256-bit VNNI where
/// the AVX2 level takes it (`simd::vnni256`).
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot<'n, F: LineFetch<'n>, const R: usize, const N: usize>(
    dtype: DType,
    wide: bool,
    rows: [&[u8]; R],
    a: [&[BlockQ8K]; N],
    next: &'n [&'n [u8]],
) -> [[f32; N]; R] {
    let vnni = if wide { None } else { crate::simd::vnni256(crate::simd::SimdLevel::Avx2) };
    dot_in::<F, R, N>(dtype, wide, vnni, rows, a, next)
}

/// `dot` with the 256-bit VNNI encoding given (where `wide` is false).
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_in<'n, F: LineFetch<'n>, const R: usize, const N: usize>(
    dtype: DType,
    wide: bool,
    vnni: Option<Vnni256>,
    rows: [&[u8]; R],
    a: [&[BlockQ8K]; N],
    next: &'n [&'n [u8]],
) -> [[f32; N]; R] {
    match dtype {
        DType::IQ4_XS if wide => rows_dot_iq4_xs_512::<F, R, N>(rows, a, next),
        DType::Q2_K if wide => rows_dot_512::<BlockQ2K, F, R, N>(rows, a, next),
        DType::Q3_K if wide => rows_dot_512::<BlockQ3K, F, R, N>(rows, a, next),
        DType::Q4_K if wide => rows_dot_512::<BlockQ4K, F, R, N>(rows, a, next),
        DType::Q5_K if wide => rows_dot_512::<BlockQ5K, F, R, N>(rows, a, next),
        DType::Q6_K if wide => rows_dot_512::<BlockQ6K, F, R, N>(rows, a, next),
        DType::Q2_K => rows_dot_in::<BlockQ2K, F, R, N>(vnni, rows, a, next),
        DType::Q3_K => rows_dot_in::<BlockQ3K, F, R, N>(vnni, rows, a, next),
        DType::Q4_K => rows_dot_in::<BlockQ4K, F, R, N>(vnni, rows, a, next),
        DType::Q5_K => rows_dot_in::<BlockQ5K, F, R, N>(vnni, rows, a, next),
        DType::Q6_K => rows_dot_in::<BlockQ6K, F, R, N>(vnni, rows, a, next),
        DType::IQ4_XS => rows_dot::<BlockIQ4XS, F, R, N>(rows, a, next),
        _ => unreachable!("{} is not a super-block type", dtype.name()),
    }
}

/// One super-block of G rows decoded for a prompt with the rows across the lanes (ggml's
/// repacked layout, built here from any file): step k holds weights 4k..4k + 4 of every row, row
/// r's four bytes in 32-bit lane r, so one `vpmaddubsw` with a token's four activations
/// broadcast serves G rows (8 with AVX2, 16 with AVX-512), and a block's float step is one
/// vector for all of them.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
pub struct RowGroupBlock<const G: usize> {
    /// the unsigned weights; for a `SuperBlock::SIGNED` format their magnitudes (8 rows, AVX2)
    /// or v + 128 (16 rows, AVX-512 VNNI)
    u: [[u32; G]; QK_K / 4],
    /// the signed weights, for `SuperBlock::SIGNED` formats in 8-row groups
    v: [[u32; G]; QK_K / 4],
    /// sub-block h (16 weights): row r's 16-bit scale, twice, in lane r (as `vpmaddwd` pairs it)
    scales: [[u32; G]; 16],
    /// sub-blocks 2j and 2j + 1: row r's two 16-bit extras (minima or offset scales) in lane r;
    /// for the formats with one per 32 weights (`SuperBlock::SCALE_WEIGHTS`), those of 32-weight
    /// sub-blocks 2j and 2j + 1 in the first four (`extra_pairs`)
    extra: [[u32; G]; 8],
    d: [f32; G],
    dmin: [f32; G],
}
const _: () = assert!(std::mem::size_of::<RowGroupBlock<16>>() == 9856);
const _: () = assert!(std::mem::size_of::<RowGroupBlock<8>>() == 4928);

impl<const G: usize> Default for RowGroupBlock<G> {
    fn default() -> Self {
        RowGroupBlock {
            u: [[0; G]; QK_K / 4],
            v: [[0; G]; QK_K / 4],
            scales: [[0; G]; 16],
            extra: [[0; G]; 8],
            d: [0.0; G],
            dmin: [0.0; G],
        }
    }
}

/// Two 16-bit values in one 32-bit lane, `lo` first (as `vpmaddwd` pairs them).
fn pair(lo: i16, hi: i16) -> u32 {
    lo as u16 as u32 | (hi as u16 as u32) << 16
}

/// A group's chunks decoded side by side before `transpose_chunk`: chunk c of row r at
/// `u[c][transpose_slot(r)]` (and the signed weights in `v`, for 8-row groups of `SIGNED`
/// formats). Kept across a task's groups, not zeroed for each (8 KB of stores a group).
struct Staged<const G: usize> {
    u: [[[u32; 8]; G]; 8],
    v: [[[u32; 8]; G]; 8],
}

impl<const G: usize> Staged<G> {
    fn new() -> Self {
        Staged { u: [[[0; 8]; G]; 8], v: [[[0; 8]; G]; 8] }
    }
}

/// Decodes `count` rows of format B into `out`, a `RowGroupBlock` per super-block; lanes past
/// them are zero (no weights, no scales). Block by block, the rows' chunks are decoded side by
/// side into `staged` and turned into the group's row-per-lane order by `transpose_chunk`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn unpack_group<'a, B: SuperBlock, const G: usize>(
    rows: impl Iterator<Item = &'a [u8]>,
    count: usize,
    out: &mut [RowGroupBlock<G>],
    staged: &mut Staged<G>,
) {
    if count < G {
        out.fill(RowGroupBlock::default());
    }
    let mut blocks: [&[B]; G] = [&[]; G];
    for (r, row) in rows.enumerate() {
        blocks[r] = cast_blocks::<B>(row);
    }
    if count < G {
        // rows past `count` read 0
        for r in count..G {
            for c in 0..8 {
                (staged.u[c][transpose_slot::<G>(r)], staged.v[c][transpose_slot::<G>(r)]) =
                    ([0; 8], [0; 8]);
            }
        }
    }
    let Staged { u: staged, v: staged_v } = staged;
    let nb = out.len();
    for (b, o) in out.iter_mut().enumerate() {
        // the rows' next blocks into L1 while this one decodes: sixteen rows read a block at a
        // time are too many streams for the hardware to follow (`PrefetchRows` brought them to
        // L2); the first loads of each block otherwise wait on L2
        if b + 1 < nb {
            for blocks in &blocks[..count] {
                let next = blocks.as_ptr().add(b + 1) as *const i8;
                for line in (0..std::mem::size_of::<B>()).step_by(64) {
                    _mm_prefetch::<_MM_HINT_T0>(next.add(line));
                }
            }
        }
        for r in 0..count {
            let slot = transpose_slot::<G>(r);
            let blk = blocks[r].get_unchecked(b).decode(false, |c, u, v, scales| {
                if B::SIGNED && G == 16 {
                    // `group_dot` takes signed weights as v + 128 in `u`
                    _mm256_storeu_si256(
                        staged[c][slot].as_mut_ptr() as *mut __m256i,
                        _mm256_xor_si256(v, _mm256_set1_epi8(-128)),
                    );
                } else {
                    _mm256_storeu_si256(staged[c][slot].as_mut_ptr() as *mut __m256i, u);
                }
                if B::SIGNED && G == 8 {
                    _mm256_storeu_si256(staged_v[c][slot].as_mut_ptr() as *mut __m256i, v);
                }
                // the halves' scales: lanes 0 and 8
                let first = _mm256_extract_epi16::<0>(scales) as i16;
                let second = _mm256_extract_epi16::<8>(scales) as i16;
                (o.scales[2 * c][r], o.scales[2 * c + 1][r]) =
                    (pair(first, first), pair(second, second));
            });
            let mut extra = [0u32; 8];
            _mm256_storeu_si256(extra.as_mut_ptr() as *mut __m256i, blk.extra);
            for j in 0..8 {
                // (per 32: both halves of lane j hold sub-block j's, as the one-token kernels
                // pair them with the sums per 16)
                o.extra[j][r] = if B::SCALE_WEIGHTS == 32 {
                    if j < 4 {
                        extra[2 * j] & 0xFFFF | extra[2 * j + 1] << 16
                    } else {
                        0
                    }
                } else {
                    extra[j]
                };
            }
            (o.d[r], o.dmin[r]) = (blk.d, blk.dmin);
        }
        for c in 0..8 {
            transpose_chunk::<G>(&staged[c], &mut o.u[8 * c..8 * c + 8]);
            if B::SIGNED && G == 8 {
                transpose_chunk::<G>(&staged_v[c], &mut o.v[8 * c..8 * c + 8]);
            }
        }
    }
}

/// Where `transpose_chunk` wants row r's chunk: rows paired k, k + 4 (and k + 8, k + 12) so
/// that each 512-bit load holds two rows whose words end up in the right 128-bit lanes.
#[inline(always)]
pub(crate) fn transpose_slot<const G: usize>(r: usize) -> usize {
    if G == 16 {
        (r & 8) + 2 * (r % 4) + (r & 4) / 4
    } else {
        r
    }
}

/// One chunk (8 words) of G rows, `staged` in `transpose_slot` order, to `out[j]` = word j of
/// every row, row r in lane r: an 8 x 8 (AVX2) or two 8 x 8 (AVX-512) word transposes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn transpose_chunk<const G: usize>(staged: &[[u32; 8]; G], out: &mut [[u32; G]]) {
    if G == 16 {
        transpose_chunk_16(
            &*(staged as *const [[u32; 8]; G] as *const [[u32; 8]; 16]),
            &mut *(out as *mut [[u32; G]] as *mut [[u32; 16]]),
        );
        return;
    }
    // (loops, not `array::from_fn`: its closures would not be compiled for these features)
    let mut x = [_mm256_setzero_si256(); 8];
    for k in 0..8 {
        x[k] = _mm256_loadu_si256(staged[k].as_ptr() as *const __m256i);
    }
    // per 128-bit lane: rows (0, 1), (2, 3).. interleaved by words, then by pairs of words
    let mut t = [_mm256_setzero_si256(); 8];
    for k in (0..8).step_by(2) {
        t[k] = _mm256_unpacklo_epi32(x[k], x[k + 1]);
        t[k + 1] = _mm256_unpackhi_epi32(x[k], x[k + 1]);
    }
    // s[4h + j]: words j (lane 0) and j + 4 (lane 1) of rows 4h..4h + 4
    let mut s = [_mm256_setzero_si256(); 8];
    for h in 0..2 {
        for j in 0..4 {
            let (a, b) = (t[4 * h + j / 2], t[4 * h + 2 + j / 2]);
            s[4 * h + j] =
                if j % 2 == 0 { _mm256_unpacklo_epi64(a, b) } else { _mm256_unpackhi_epi64(a, b) };
        }
    }
    for j in 0..4 {
        _mm256_storeu_si256(
            out[j].as_mut_ptr() as *mut __m256i,
            _mm256_permute2x128_si256::<0x20>(s[j], s[4 + j]),
        );
        _mm256_storeu_si256(
            out[j + 4].as_mut_ptr() as *mut __m256i,
            _mm256_permute2x128_si256::<0x31>(s[j], s[4 + j]),
        );
    }
}

/// `transpose_chunk` for 16 rows: each load holds rows k, k + 4 (or k + 8, k + 12), so the
/// 8 x 8 steps leave words j and j + 4 of rows 0..4, 4..8 (8..12, 12..16) in the four 128-bit
/// lanes, and one lane shuffle puts them in row order.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn transpose_chunk_16(staged: &[[u32; 8]; 16], out: &mut [[u32; 16]]) {
    let mut x = [_mm512_setzero_si512(); 8];
    for k in 0..8 {
        x[k] = _mm512_loadu_si512(staged[2 * k].as_ptr() as *const _);
    }
    let mut t = [_mm512_setzero_si512(); 8];
    for k in (0..8).step_by(2) {
        t[k] = _mm512_unpacklo_epi32(x[k], x[k + 1]);
        t[k + 1] = _mm512_unpackhi_epi32(x[k], x[k + 1]);
    }
    // s[4h + j]: words j and j + 4 of rows 4 (2h)..4 (2h) + 4, then of rows 4 (2h + 1).. (lanes 0..4)
    let mut s = [_mm512_setzero_si512(); 8];
    for h in 0..2 {
        for j in 0..4 {
            let (a, b) = (t[4 * h + j / 2], t[4 * h + 2 + j / 2]);
            s[4 * h + j] =
                if j % 2 == 0 { _mm512_unpacklo_epi64(a, b) } else { _mm512_unpackhi_epi64(a, b) };
        }
    }
    for j in 0..4 {
        // lanes 0, 2 of s[j] (rows 0..4, 4..8) and of s[4 + j] (rows 8..12, 12..16)
        _mm512_storeu_si512(
            out[j].as_mut_ptr() as *mut _,
            _mm512_shuffle_i32x4::<0b10_00_10_00>(s[j], s[4 + j]),
        );
        _mm512_storeu_si512(
            out[j + 4].as_mut_ptr() as *mut _,
            _mm512_shuffle_i32x4::<0b11_01_11_01>(s[j], s[4 + j]),
        );
    }
}

/// A group of 16 unpacked rows against T tokens: lane r of the result is row r's dot, bit for
/// bit `dot`'s (the same exact integer sums, the same `block_step` per lane).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn group_dot<B: SuperBlock, const T: usize>(
    g: &[RowGroupBlock<16>],
    a: [&[BlockQ8K]; T],
    out: &mut [[f32; 16]; T],
) {
    let mut acc = [_mm512_setzero_ps(); T];
    let word = |p: *const i8| (p as *const i32).read_unaligned();
    for (b, x) in g.iter().enumerate() {
        let at: [&BlockQ8K; T] = std::array::from_fn(|t| a[t].get_unchecked(b));
        let mut sums = [_mm512_setzero_si512(); T];
        // steps (4 weights) per scale, and per `vpdpbusd` run: a run's products per row sum in
        // one 32-bit lane, then meet the scale, by `vpdpwssd` where they surely fit 16 bits and
        // the run is as long as the scale's (its low 16 bits times the scale), else by `vpmulld`
        let scale_steps = B::SCALE_WEIGHTS / 4;
        let by_16_bits =
            B::STEPS_IN_16_BITS >= scale_steps || (B::STEPS_IN_16_BITS > 0 && scale_steps == 4);
        let run = if by_16_bits { B::STEPS_IN_16_BITS } else { scale_steps };
        for h in (0..16).step_by(scale_steps / 4) {
            let scales = _mm512_load_si512(x.scales[h].as_ptr() as *const _);
            for k0 in (4 * h..4 * h + scale_steps).step_by(run) {
                let mut part = [_mm512_setzero_si512(); T];
                for k in k0..k0 + run {
                    // (signed weights are v + 128 here, the 128 comes off below)
                    let u = _mm512_load_si512(x.u[k].as_ptr() as *const _);
                    for t in 0..T {
                        part[t] = _mm512_dpbusd_epi32(
                            part[t],
                            u,
                            _mm512_set1_epi32(word(at[t].qs.as_ptr().add(4 * k))),
                        );
                    }
                }
                if by_16_bits {
                    let scale = _mm512_and_si512(scales, _mm512_set1_epi32(0xFFFF));
                    for t in 0..T {
                        sums[t] = _mm512_dpwssd_epi32(sums[t], part[t], scale);
                    }
                } else {
                    // (the lane's high 16 bits hold the scale too, sign-extended here)
                    let scale = _mm512_srai_epi32::<16>(scales);
                    for t in 0..T {
                        sums[t] = _mm512_add_epi32(sums[t], _mm512_mullo_epi32(part[t], scale));
                    }
                }
            }
        }
        let mut mins = [_mm512_setzero_si512(); T];
        // the offset's shift: signed formats' 128 here, else the format's own
        let shift = if B::SIGNED { 7 } else { B::OFFSET_SHIFT };
        if B::MIN || shift > 0 {
            for t in 0..T {
                let mut e = _mm512_setzero_si512();
                let (pairs, sums_of) = extra_pairs::<B>(at[t]);
                for j in 0..pairs {
                    let pair = _mm512_set1_epi32(word(sums_of.add(2 * j) as *const i8));
                    e = _mm512_dpwssd_epi32(
                        e,
                        _mm512_load_si512(x.extra[j].as_ptr() as *const _),
                        pair,
                    );
                }
                if B::MIN {
                    mins[t] = e;
                } else {
                    sums[t] =
                        _mm512_sub_epi32(sums[t], _mm512_sll_epi32(e, _mm_cvtsi32_si128(shift)));
                }
            }
        }
        let (d, dmin) = (_mm512_load_ps(x.d.as_ptr()), _mm512_load_ps(x.dmin.as_ptr()));
        for t in 0..T {
            let d_a = _mm512_set1_ps(at[t].d);
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[t]), _mm512_mul_ps(d, d_a), acc[t]);
            if B::MIN {
                acc[t] =
                    _mm512_fnmadd_ps(_mm512_cvtepi32_ps(mins[t]), _mm512_mul_ps(dmin, d_a), acc[t]);
            }
        }
    }
    for t in 0..T {
        _mm512_storeu_ps(out[t].as_mut_ptr(), acc[t]);
    }
}

/// How a row group's extras (`RowGroupBlock::extra`) pair with a token's activation sums: four
/// pairs with the sums per 32 for the formats with one minimum or scale per 32 weights, else
/// eight with the sums per 16 (the same exact integer sum).
#[inline(always)]
fn extra_pairs<B: SuperBlock>(a: &BlockQ8K) -> (usize, *const i16) {
    if B::SCALE_WEIGHTS == 32 {
        (4, a.bsums32.as_ptr())
    } else {
        (8, a.bsums.as_ptr())
    }
}

/// The end of a block of an 8-row group (`group_dot_avx2`, `group_dot_vnni`): the minima's
/// sums or the offset from the activations' sums per 16, then the block's float step per lane.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn block_end_8<B: SuperBlock, const T: usize>(
    x: &RowGroupBlock<8>,
    at: [&BlockQ8K; T],
    sums: &mut [__m256i; T],
    acc: &mut [__m256; T],
) {
    let word = |p: *const i8| (p as *const i32).read_unaligned();
    let mut mins = [_mm256_setzero_si256(); T];
    if B::MIN || B::OFFSET_SHIFT > 0 {
        for t in 0..T {
            let mut e = _mm256_setzero_si256();
            let (pairs, sums_of) = extra_pairs::<B>(at[t]);
            for j in 0..pairs {
                let pair = _mm256_set1_epi32(word(sums_of.add(2 * j) as *const i8));
                e = _mm256_add_epi32(
                    e,
                    _mm256_madd_epi16(load32(x.extra[j].as_ptr() as *const u8), pair),
                );
            }
            if B::MIN {
                mins[t] = e;
            } else {
                sums[t] = _mm256_sub_epi32(
                    sums[t],
                    _mm256_sll_epi32(e, _mm_cvtsi32_si128(B::OFFSET_SHIFT)),
                );
            }
        }
    }
    let (d, dmin) = (_mm256_load_ps(x.d.as_ptr()), _mm256_load_ps(x.dmin.as_ptr()));
    for t in 0..T {
        let d_a = _mm256_set1_ps(at[t].d);
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[t]), _mm256_mul_ps(d, d_a), acc[t]);
        if B::MIN {
            acc[t] =
                _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mins[t]), _mm256_mul_ps(dmin, d_a), acc[t]);
        }
    }
}

/// A group of 8 unpacked rows against T tokens with AVX2: `group_dot`'s arithmetic, its
/// `vpdpwssd` as `vpmaddwd` + `vpaddd` (the same exact sums).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn group_dot_avx2<B: SuperBlock, const T: usize>(
    g: &[RowGroupBlock<8>],
    a: [&[BlockQ8K]; T],
) -> [__m256; T] {
    let mut acc = [_mm256_setzero_ps(); T];
    let word = |p: *const i8| (p as *const i32).read_unaligned();
    for (b, x) in g.iter().enumerate() {
        let at: [&BlockQ8K; T] = std::array::from_fn(|t| a[t].get_unchecked(b));
        let mut sums = [_mm256_setzero_si256(); T];
        for h in 0..16 {
            let scales = load32(x.scales[h].as_ptr() as *const u8);
            for k in 4 * h..4 * h + 4 {
                let u = load32(x.u[k].as_ptr() as *const u8);
                let v = if B::SIGNED { load32(x.v[k].as_ptr() as *const u8) } else { u };
                for t in 0..T {
                    let mut act = _mm256_set1_epi32(word(at[t].qs.as_ptr().add(4 * k)));
                    if B::SIGNED {
                        act = _mm256_sign_epi8(act, v);
                    }
                    sums[t] = _mm256_add_epi32(
                        sums[t],
                        _mm256_madd_epi16(_mm256_maddubs_epi16(u, act), scales),
                    );
                }
            }
        }
        block_end_8::<B, T>(x, at, &mut sums, &mut acc);
    }
    acc
}

/// A group of 8 unpacked rows against T tokens with 256-bit VNNI in V's encoding (AVX-VNNI's, or
/// AVX-512 VL's): `group_dot`'s runs of `vpdpbusd` at 256 bits, the signs of a signed format
/// moved onto the activations as `group_dot_avx2` does; the same exact sums.
#[inline(always)]
unsafe fn group_dot_vnni<B: SuperBlock, V: Dp256, const T: usize>(
    g: &[RowGroupBlock<8>],
    a: [&[BlockQ8K]; T],
) -> [__m256; T] {
    let mut acc = [_mm256_setzero_ps(); T];
    let word = |p: *const i8| (p as *const i32).read_unaligned();
    // (as in `group_dot`)
    let scale_steps = B::SCALE_WEIGHTS / 4;
    let by_16_bits =
        B::STEPS_IN_16_BITS >= scale_steps || (B::STEPS_IN_16_BITS > 0 && scale_steps == 4);
    let run = if by_16_bits { B::STEPS_IN_16_BITS } else { scale_steps };
    for (b, x) in g.iter().enumerate() {
        let at: [&BlockQ8K; T] = std::array::from_fn(|t| a[t].get_unchecked(b));
        let mut sums = [_mm256_setzero_si256(); T];
        for h in (0..16).step_by(scale_steps / 4) {
            let scales = load32(x.scales[h].as_ptr() as *const u8);
            for k0 in (4 * h..4 * h + scale_steps).step_by(run) {
                let mut part = [_mm256_setzero_si256(); T];
                for k in k0..k0 + run {
                    let u = load32(x.u[k].as_ptr() as *const u8);
                    let v = if B::SIGNED { load32(x.v[k].as_ptr() as *const u8) } else { u };
                    for t in 0..T {
                        let mut act = _mm256_set1_epi32(word(at[t].qs.as_ptr().add(4 * k)));
                        if B::SIGNED {
                            act = _mm256_sign_epi8(act, v);
                        }
                        part[t] = V::dpbusd(part[t], u, act);
                    }
                }
                if by_16_bits {
                    let scale = _mm256_and_si256(scales, _mm256_set1_epi32(0xFFFF));
                    for t in 0..T {
                        sums[t] = V::dpwssd(sums[t], part[t], scale);
                    }
                } else {
                    let scale = _mm256_srai_epi32::<16>(scales);
                    for t in 0..T {
                        sums[t] = _mm256_add_epi32(sums[t], _mm256_mullo_epi32(part[t], scale));
                    }
                }
            }
        }
        block_end_8::<B, T>(x, at, &mut sums, &mut acc);
    }
    acc
}

/// `group_dot_vnni` in AVX-VNNI's VEX encoding.
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
unsafe fn group_dot_vex<B: SuperBlock, const T: usize>(
    g: &[RowGroupBlock<8>],
    a: [&[BlockQ8K]; T],
) -> [__m256; T] {
    group_dot_vnni::<B, Vex, T>(g, a)
}

/// `group_dot_vnni` in AVX-512 VL's EVEX encoding.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
unsafe fn group_dot_evex<B: SuperBlock, const T: usize>(
    g: &[RowGroupBlock<8>],
    a: [&[BlockQ8K]; T],
) -> [__m256; T] {
    group_dot_vnni::<B, Evex, T>(g, a)
}

/// A group's dots with T tokens, row r's in lane r of each token's array: `group_dot` for
/// 16-row groups (AVX-512), `group_dot_avx2` for 8-row ones.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn group_dots<B: SuperBlock, const G: usize, const T: usize>(
    g: &[RowGroupBlock<G>],
    a: [&[BlockQ8K]; T],
    vnni: Option<Vnni256>,
) -> [[f32; G]; T] {
    let mut out = [[0.0f32; G]; T];
    if G == 16 {
        // SAFETY (the casts): G is 16, the same types
        let out16 = &mut *(&mut out as *mut [[f32; G]; T] as *mut [[f32; 16]; T]);
        group_dot::<B, T>(
            &*(g as *const [RowGroupBlock<G>] as *const [RowGroupBlock<16>]),
            a,
            out16,
        );
    } else {
        assert_eq!(G, 8);
        // SAFETY (the cast): G is 8, the same type
        let g8 = &*(g as *const [RowGroupBlock<G>] as *const [RowGroupBlock<8>]);
        let v = match vnni {
            None => group_dot_avx2::<B, T>(g8, a),
            Some(Vnni256::Vex) => group_dot_vex::<B, T>(g8, a),
            Some(Vnni256::Evex) => group_dot_evex::<B, T>(g8, a),
        };
        (0..T).for_each(|t| _mm256_storeu_ps(out[t].as_mut_ptr(), v[t]));
    }
    out
}

/// A prompt's product in groups of G rows (`RowGroupBlock`: 16 with AVX-512, 8 with AVX2),
/// each group decoded once for all tokens, four tokens per step.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn rows_tokens_grouped<'a, B: SuperBlock, const G: usize>(
    row: impl Fn(usize) -> &'a [u8],
    cols: usize,
    rows: std::ops::Range<usize>,
    q8k: &[BlockQ8K],
    n: usize,
    vnni: Option<Vnni256>,
    put: impl Fn(usize, usize, &[f32]),
) {
    let nb = cols / super::QK_K;
    assert_eq!(q8k.len(), n * nb, "activations: wrong size for {n} tokens of {cols}");
    let token = |t: usize| &q8k[t * nb..(t + 1) * nb];
    let mut group = vec![RowGroupBlock::<G>::default(); nb];
    let mut staged = Staged::<G>::new();
    let mut r0 = rows.start;
    while r0 < rows.end {
        let r1 = (r0 + G).min(rows.end);
        unpack_group::<B, G>((r0..r1).map(&row), r1 - r0, &mut group, &mut staged);
        let emit = |t: usize, lanes: &[f32; G]| put(t, r0, &lanes[..r1 - r0]);
        let mut prefetch =
            PrefetchRows::<G>::new((r1..(r1 + G).min(rows.end)).map(&row), n / 4 + n % 4);
        let mut t = 0;
        // with AVX-512, eight tokens per pass: eight independent chains of `vpdpbusd` (their
        // latency, not their throughput, bounds four), in 32 registers
        while G == 16 && t + 8 <= n {
            prefetch.step();
            prefetch.step();
            let dots = group_dots::<B, G, 8>(
                &group,
                [
                    token(t),
                    token(t + 1),
                    token(t + 2),
                    token(t + 3),
                    token(t + 4),
                    token(t + 5),
                    token(t + 6),
                    token(t + 7),
                ],
                vnni,
            );
            dots.iter().enumerate().for_each(|(k, lanes)| emit(t + k, lanes));
            t += 8;
        }
        while t + 4 <= n {
            prefetch.step();
            let dots = group_dots::<B, G, 4>(
                &group,
                [token(t), token(t + 1), token(t + 2), token(t + 3)],
                vnni,
            );
            dots.iter().enumerate().for_each(|(k, lanes)| emit(t + k, lanes));
            t += 4;
        }
        for t in t..n {
            prefetch.step();
            emit(t, &group_dots::<B, G, 1>(&group, [token(t)], vnni)[0]);
        }
        r0 = r1;
    }
}

/// How a prompt's row groups are dotted: 16 rows with AVX-512 VNNI, 8 with 256-bit `vpdpbusd`
/// (AVX-VNNI's, or the same instruction as AVX-512 VL encodes it), or 8 with AVX2's
/// `vpmaddubsw` (all the same exact sums).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GroupWidth {
    Avx2,
    AvxVnni(Vnni256),
    Avx512,
}

/// A prompt's product with rows of a type that reads per-256 activations: `rows` of a weight matrix
/// (`row(r)` its bytes, `cols` wide) against `n` tokens (`q8k`: n * cols / 256), put(t, r,
/// values of rows r, r + 1, ..); `width`: 16-row groups with AVX-512 (only where the CPU has
/// AVX-512 F/BW/VL/VNNI), else 8-row groups with AVX2, and AVX-VNNI where `width` says so (only
/// where the CPU has it).
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn rows_all_tokens<'a>(
    dtype: DType,
    width: GroupWidth,
    row: impl Fn(usize) -> &'a [u8],
    cols: usize,
    rows: std::ops::Range<usize>,
    q8k: &[BlockQ8K],
    n: usize,
    put: impl Fn(usize, usize, &[f32]),
) {
    macro_rules! by_width {
        ($block:ty) => {
            match width {
                GroupWidth::Avx512 => {
                    rows_tokens_grouped::<$block, 16>(row, cols, rows, q8k, n, None, put)
                }
                GroupWidth::AvxVnni(e) => {
                    rows_tokens_grouped::<$block, 8>(row, cols, rows, q8k, n, Some(e), put)
                }
                GroupWidth::Avx2 => {
                    rows_tokens_grouped::<$block, 8>(row, cols, rows, q8k, n, None, put)
                }
            }
        };
    }
    match dtype {
        DType::Q2_K => by_width!(BlockQ2K),
        DType::Q3_K => by_width!(BlockQ3K),
        DType::Q4_K => by_width!(BlockQ4K),
        DType::Q5_K => by_width!(BlockQ5K),
        DType::Q6_K => by_width!(BlockQ6K),
        DType::IQ4_XS => by_width!(BlockIQ4XS),
        _ => unreachable!("{} is not a super-block type", dtype.name()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::chunks::tests::random_row;
    use crate::quant::q256::{dot_scalar, tests::q8k};
    use crate::quant::tests::random_vec;

    /// Every format's AVX2 dot (with 256-bit VNNI in each encoding the CPU runs, and the AVX-512
    /// one, where the CPU has them) equals the scalar twin bit for bit (the same exact integer sums and the same float steps), for 1, 2
    /// and 4 tokens and 1 and 4 rows per call.
    #[test]
    fn dots_match_scalar() {
        if !crate::simd::detect().has_avx2() {
            eprintln!("skipping: no AVX2 on this CPU");
            return;
        }
        // (wide, 256-bit VNNI): AVX2, with VNNI in each encoding this CPU runs, AVX-512
        let mut widths = vec![(false, None)];
        widths.extend(crate::simd::vnni256_encodings().into_iter().map(|e| (false, Some(e))));
        if crate::simd::detect() == crate::simd::SimdLevel::Avx512 {
            widths.push((true, None));
        }
        let n = 1024;
        let acts: Vec<Vec<BlockQ8K>> = (0..4).map(|t| q8k(&random_vec(n, 80 + t))).collect();
        let a4 = [&acts[0][..], &acts[1][..], &acts[2][..], &acts[3][..]];
        for (s, dtype) in DType::ALL.into_iter().filter(|d| d.reads_q8k()).enumerate() {
            let rows: Vec<Vec<u8>> =
                (0..4).map(|r| random_row(dtype, n, 90 + 10 * s as u64 + r)).collect();
            let rows4 = [&rows[0][..], &rows[1][..], &rows[2][..], &rows[3][..]];
            for &(wide, vnni) in &widths {
                // SAFETY: AVX2 checked above, AVX-512 where `wide`, each VNNI encoding the CPU runs
                unsafe {
                    let all =
                        dot_in::<crate::avx2::Prefetch, 4, 4>(dtype, wide, vnni, rows4, a4, &[]);
                    for r in 0..4 {
                        let want = dot_scalar(dtype, rows4[r], a4);
                        for t in 0..4 {
                            assert_eq!(
                                all[r][t].to_bits(),
                                want[t].to_bits(),
                                "{dtype:?} wide {wide} {vnni:?} row {r} token {t}: {} vs {}",
                                all[r][t],
                                want[t]
                            );
                            let alone = dot_in::<crate::avx2::PrefetchApart, 1, 1>(
                                dtype,
                                wide,
                                vnni,
                                [rows4[r]],
                                [a4[t]],
                                &[],
                            )[0][0];
                            assert_eq!(
                                alone.to_bits(),
                                all[r][t].to_bits(),
                                "{dtype:?} wide {wide} row {r} token {t}: alone vs in a group"
                            );
                        }
                        let two = dot_in::<crate::avx2::Prefetch, 1, 2>(
                            dtype,
                            wide,
                            vnni,
                            [rows4[r]],
                            [a4[1], a4[3]],
                            &[],
                        )[0];
                        assert_eq!(
                            [two[0].to_bits(), two[1].to_bits()],
                            [all[r][1].to_bits(), all[r][3].to_bits()],
                            "{dtype:?} wide {wide} two tokens"
                        );
                    }
                }
            }
        }
    }

    /// A prompt's row groups give every row and token bit for bit the one-token dot, at every
    /// width this CPU has (AVX2, AVX-VNNI, AVX-512), for whole and partial groups and passes of
    /// 8, 4 and 1 tokens.
    #[test]
    fn row_groups_equal_one_token_dots_at_every_width() {
        if !crate::simd::detect().has_avx2() {
            eprintln!("skipping: no AVX2 on this CPU");
            return;
        }
        let mut widths = vec![GroupWidth::Avx2];
        for e in crate::simd::vnni256_encodings() {
            widths.push(GroupWidth::AvxVnni(e));
        }
        if crate::simd::detect() == crate::simd::SimdLevel::Avx512 {
            widths.push(GroupWidth::Avx512);
        }
        let (cols, rows, n) = (512, 19, 13);
        let acts: Vec<BlockQ8K> =
            (0..n).flat_map(|t| q8k(&random_vec(cols, 300 + t as u64))).collect();
        let token = |t: usize| &acts[t * 2..(t + 1) * 2];
        for (s, dtype) in DType::ALL.into_iter().filter(|d| d.reads_q8k()).enumerate() {
            let data: Vec<Vec<u8>> = (0..rows)
                .map(|r| random_row(dtype, cols, 400 + 30 * s as u64 + r as u64))
                .collect();
            for &width in &widths {
                let got = std::cell::RefCell::new(vec![f32::NAN; n * rows]);
                // SAFETY: each width only where the CPU has it (above)
                unsafe {
                    rows_all_tokens(
                        dtype,
                        width,
                        |r| &data[r][..],
                        cols,
                        1..rows,
                        &acts,
                        n,
                        |t, r, v| got.borrow_mut()[t * rows + r..][..v.len()].copy_from_slice(v),
                    )
                };
                let got = got.into_inner();
                for t in 0..n {
                    for r in 1..rows {
                        // SAFETY: AVX2 checked above, AVX-512 where the width is
                        let alone = unsafe {
                            dot::<crate::avx2::Prefetch, 1, 1>(
                                dtype,
                                width == GroupWidth::Avx512,
                                [&data[r][..]],
                                [token(t)],
                                &[],
                            )[0][0]
                        };
                        assert_eq!(
                            got[t * rows + r].to_bits(),
                            alone.to_bits(),
                            "{dtype:?} {width:?} row {r} token {t}"
                        );
                    }
                    assert!(got[t * rows].is_nan(), "{dtype:?} {width:?}: row 0 was not asked for");
                }
            }
        }
    }
}
