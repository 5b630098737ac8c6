//! The products of interleaved Q4_0 and Q4_K matrices at AVX-512 VNNI and the 256-bit levels
//! (`quant::interleaved`; its `dot_group_scalar` and `dot_group_k4_scalar` are the twins).
//!
//! Prototyped against the file's layout on the 2-core AMD EPYC (Zen 4), one token, medians of
//! one-second rounds: from L2 on one thread 29 -> 42 GB/s of weights; the Qwen3-30B-A3B
//! expert's 768 x 2048 and 2048 x 768 products, 400 copies from DRAM on two threads, 15-18 ->
//! 30-34 GB/s.

#![allow(clippy::missing_safety_doc)]

use std::arch::x86_64::*;

use super::chunks::{BlockMXFP4, MXFP4_VALUES};
use super::interleaved::mx_step_blocks;
use super::interleaved::{
    group_bytes, Interleaved, GROUP_ROWS, K4_DMIN_AT, K4_D_AT, K4_MINS_AT, K4_SCALES_AT,
    K4_STEP_BYTES, MX_STEP_BYTES, STEP_BLOCKS, STEP_BYTES,
};
use super::q256::BlockQ8K;
use super::DType;
use super::{ActQuad, BlockQ8Act};
use crate::avx2::{Dp256, Evex, NoVnni, PrefetchL2, Vex};
use crate::simd::Vnni256;

/// Bytes of a step and of a block of Q4_0 (MX false) or MXFP4 (MX true).
const fn step_and_block_bytes<const MX: bool>() -> (usize, usize) {
    match MX {
        false => (STEP_BYTES, std::mem::size_of::<super::BlockQ4_0>()),
        true => (MX_STEP_BYTES, std::mem::size_of::<BlockMXFP4>()),
    }
}

/// Block c of the sixteen rows of a step of n blocks at `step`, as `dot_group`'s sums read it:
/// four chunks of four bytes per row, low and high nibbles (Q4_0's as they are, MXFP4's through
/// `table`, its doubled E2M1 values plus 128), and the rows' scales.
#[inline(always)]
unsafe fn block_512<const MX: bool>(
    step: *const u8,
    n: usize,
    c: usize,
    table: __m512i,
) -> ([__m512i; 4], [__m512i; 4], __m512) {
    let nibble = _mm512_set1_epi8(0x0F);
    let weights = |nibbles: __m512i| match MX {
        false => nibbles,
        true => _mm512_shuffle_epi8(table, nibbles),
    };
    let mut lo = [_mm512_setzero_si512(); 4];
    let mut hi = [_mm512_setzero_si512(); 4];
    for k in 0..4 {
        let w = _mm512_loadu_si512(step.add(64 * (4 * c + k)) as *const _);
        lo[k] = weights(_mm512_and_si512(w, nibble));
        hi[k] = weights(_mm512_and_si512(_mm512_srli_epi16::<4>(w), nibble));
    }
    let d = match MX {
        false => _mm512_cvtph_ps(_mm256_loadu_si256(step.add(1024 + 32 * c) as *const _)),
        true => e8m0_half_512(_mm_loadu_si128(step.add(256 * n + 16 * c) as *const _)),
    };
    (lo, hi, d)
}

/// `vpshufb`'s table of MXFP4's nibbles: their doubled E2M1 values plus 128.
#[inline(always)]
unsafe fn mx_table_512() -> __m512i {
    let plus_128: [u8; 16] = std::array::from_fn(|i| (MXFP4_VALUES[i] as u8) ^ 0x80);
    _mm512_broadcast_i32x4(_mm_loadu_si128(plus_128.as_ptr() as *const _))
}

/// The sixteen rows' products of block c (`block_512`'s weights and scales) with one token's
/// quad `a`: sum(q * x) from the quad's bias (for Q4_0 -8 times the block's activations, for
/// MXFP4 16 times that), times the scales.
#[inline(always)]
unsafe fn block_product_512<const MX: bool>(
    (lo, hi, d): &([__m512i; 4], [__m512i; 4], __m512),
    c: usize,
    a: &ActQuad,
) -> __m512 {
    // the activations' lane biases of block c, summed
    let bias = a.bias[4 * c] + a.bias[4 * c + 1] + a.bias[4 * c + 2] + a.bias[4 * c + 3];
    let mut sum = _mm512_set1_epi32(if MX { 16 * bias } else { bias });
    let four = |bytes: &[i8; 64], k: usize| {
        _mm512_set1_epi32((bytes.as_ptr().add(16 * c + 4 * k) as *const i32).read_unaligned())
    };
    for k in 0..4 {
        sum = _mm512_dpbusd_epi32(sum, lo[k], four(&a.lo, k));
        sum = _mm512_dpbusd_epi32(sum, hi[k], four(&a.hi, k));
    }
    let dd = _mm512_mul_ps(*d, _mm512_set1_ps(a.d[4 * c]));
    _mm512_mul_ps(_mm512_cvtepi32_ps(sum), dd)
}

/// Block c's product p into a step's pairs: (p_0 + p_1), (p_2 + p_3).
#[inline(always)]
unsafe fn add_to_pair(pair: &mut [__m512; 2], c: usize, p: __m512) {
    pair[c / 2] = match c % 2 {
        0 => p,
        _ => _mm512_add_ps(pair[c / 2], p),
    };
}

/// A step of n blocks' sum from its pairs (`FloatSteps::SumOfFour`): a last half step's pair
/// alone.
#[inline(always)]
unsafe fn step_total(pair: &[__m512; 2], n: usize) -> __m512 {
    match n {
        STEP_BLOCKS => _mm512_add_ps(pair[0], pair[1]),
        _ => pair[0],
    }
}

/// The sixteen rows of `group` (one group of an interleaved matrix) against N tokens'
/// activations (`Activations::quads`: cols / 128 each), `next` (the bytes read after these)
/// prefetched into L2 over the steps. out[t][r] = row r . token t, as `dot_group_scalar`
/// (Q4_0) or `dot_group_mx_scalar` (MX: MXFP4).
///
/// Q4_0's nibbles are q = v + 8 and its sums start from the quad's bias (-8 times the block's
/// activations); MXFP4's nibbles give their doubled E2M1 value plus 128 by `vpshufb`, its sums
/// start from 16 times that bias, and its blocks' scales are their halved powers of two, a
/// last half step's pair alone (what its zero-padded quad adds). Then `FloatSteps::SumOfFour`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn dot_group<const MX: bool, const N: usize>(
    group: &[u8],
    x: [&[ActQuad]; N],
    next: &[u8],
) -> [[f32; GROUP_ROWS]; N] {
    let (step_bytes, block_bytes) = step_and_block_bytes::<MX>();
    let blocks = group.len() / (GROUP_ROWS * block_bytes);
    let steps = blocks.div_ceil(STEP_BLOCKS);
    debug_assert!(x.iter().all(|x| x.len() == steps));
    let table = mx_table_512();
    let mut acc = [_mm512_setzero_ps(); N];
    let next = [next];
    // (once a step: asked for once a block, as `dot_group_k4` does, a 4-layer Qwen3-30B-A3B-shape
    // Q4_0 model's decode on a 2-core Intel Xeon went 178-187 -> 164-178 tok/s)
    let mut prefetch = PrefetchL2::new(&next, steps);
    for s in 0..steps {
        prefetch.step();
        let n = mx_step_blocks(blocks, s);
        let step = group.as_ptr().add(s * step_bytes);
        let q: [&ActQuad; N] = std::array::from_fn(|t| x[t].get_unchecked(s));
        // per token: (p_0 + p_1), then (p_2 + p_3)
        let mut pair = [[_mm512_setzero_ps(); 2]; N];
        for c in 0..n {
            let block = block_512::<MX>(step, n, c, table);
            for t in 0..N {
                add_to_pair(&mut pair[t], c, block_product_512::<MX>(&block, c, q[t]));
            }
        }
        for t in 0..N {
            acc[t] = _mm512_add_ps(acc[t], step_total(&pair[t], n));
        }
    }
    let mut out = [[0.0f32; GROUP_ROWS]; N];
    for t in 0..N {
        _mm512_storeu_ps(out[t].as_mut_ptr(), acc[t]);
    }
    out
}

/// `dot_group` for all n tokens of a batch at once (`GroupDots::ALL_TOKENS`), each step's
/// blocks decoded once for them all: out[16t + r] = row r . token t, each token's the same
/// steps in the same order, its sums in `out` between steps. `quads`: `Activations::quads`
/// (n * cols / 128).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn dot_group_all<const MX: bool>(
    group: &[u8],
    quads: &[ActQuad],
    n_tokens: usize,
    next: &[u8],
    out: &mut [f32],
) {
    let (step_bytes, block_bytes) = step_and_block_bytes::<MX>();
    let blocks = group.len() / (GROUP_ROWS * block_bytes);
    let steps = blocks.div_ceil(STEP_BLOCKS);
    debug_assert!(quads.len() == n_tokens * steps && out.len() == n_tokens * GROUP_ROWS);
    out.fill(0.0);
    let table = mx_table_512();
    let next = [next];
    let mut prefetch = PrefetchL2::new(&next, steps);
    let zero = (_mm512_setzero_si512(), _mm512_setzero_ps());
    let mut decoded = [([zero.0; 4], [zero.0; 4], zero.1); STEP_BLOCKS];
    for s in 0..steps {
        prefetch.step();
        let n = mx_step_blocks(blocks, s);
        let step = group.as_ptr().add(s * step_bytes);
        for (c, b) in decoded.iter_mut().enumerate().take(n) {
            *b = block_512::<MX>(step, n, c, table);
        }
        for t in 0..n_tokens {
            let a = quads.get_unchecked(t * steps + s);
            let mut pair = [_mm512_setzero_ps(); 2];
            for (c, block) in decoded.iter().enumerate().take(n) {
                add_to_pair(&mut pair, c, block_product_512::<MX>(block, c, a));
            }
            let acc = out.as_mut_ptr().add(GROUP_ROWS * t);
            _mm512_storeu_ps(acc, _mm512_add_ps(_mm512_loadu_ps(acc), step_total(&pair, n)));
        }
    }
}

/// The sum of a block's 32 activations: `vpsadbw` of them plus 128, less 32 * 128.
#[inline(always)]
unsafe fn block_sum(qs: &[i8; 32]) -> i32 {
    let sad = _mm256_sad_epu8(
        _mm256_xor_si256(_mm256_loadu_si256(qs.as_ptr() as *const __m256i), _mm256_set1_epi8(-128)),
        _mm256_setzero_si256(),
    );
    let s = _mm_add_epi64(_mm256_castsi256_si128(sad), _mm256_extracti128_si256::<1>(sad));
    let s = _mm_add_epi64(s, _mm_unpackhi_epi64(s, s));
    _mm_cvtsi128_si32(s) - 32 * 128
}

/// `dot_group` at the AVX2 level, its float steps `avx2::dot_legacy`'s (acc = fma(sum, d *
/// d_a, acc) per block, `FloatSteps::FmaPerBlock`), eight rows per 256-bit vector. A block's
/// sums: with 256-bit VNNI (V), `vpdpbusd` from -8 times the activations' sum; without,
/// `vpmaddubsw` pairs summed in 16 bits (eight pairs of 15 * 128 fit) and widened by
/// `vpmaddwd`. Reads `Activations::q8` (cols / 32 per token) and, where the batch has it,
/// `Activations::q8_bias` (-128 times each block's sum: divided by 16, the -8 times it the
/// sums start from, where a token alone sums its blocks here).
#[inline(always)]
unsafe fn dot_group_256<V: Dp256, const N: usize>(
    group: &[u8],
    (x, q8_bias): ([&[BlockQ8Act]; N], [&[i32]; N]),
    next: &[u8],
) -> [[f32; GROUP_ROWS]; N] {
    let steps = group.len() / STEP_BYTES;
    debug_assert!(x.iter().all(|x| x.len() == steps * STEP_BLOCKS));
    let nibble = _mm256_set1_epi8(0x0F);
    let ones = _mm256_set1_epi16(1);
    let mut acc = [[_mm256_setzero_ps(); 2]; N];
    let next = [next];
    // (for one token the next group's lines asked for once a block, `dot_group_k4`: decode of
    // a 4-layer Qwen3-30B-A3B-shape Q4_0 model at AVX-VNNI on a 2-core Intel Xeon 137-141 ->
    // 148-156 tok/s)
    let spread = N == 1;
    let mut prefetch = PrefetchL2::new(&next, if spread { STEP_BLOCKS * steps } else { steps });
    for s in 0..steps {
        if !spread {
            prefetch.step();
        }
        let step = group.as_ptr().add(s * STEP_BYTES);
        for c in 0..STEP_BLOCKS {
            if spread {
                prefetch.step();
            }
            let a: [&BlockQ8Act; N] =
                std::array::from_fn(|t| x[t].get_unchecked(STEP_BLOCKS * s + c));
            let bias: [i32; N] = std::array::from_fn(|t| match q8_bias[t] {
                [] => -8 * block_sum(&a[t].qs),
                b => b.get_unchecked(STEP_BLOCKS * s + c) / 16,
            });
            for h in 0..2 {
                let mut lo = [_mm256_setzero_si256(); 4];
                let mut hi = [_mm256_setzero_si256(); 4];
                for k in 0..4 {
                    let w = _mm256_loadu_si256(step.add(64 * (4 * c + k) + 32 * h) as *const _);
                    lo[k] = _mm256_and_si256(w, nibble);
                    hi[k] = _mm256_and_si256(_mm256_srli_epi16::<4>(w), nibble);
                }
                let d =
                    _mm256_cvtph_ps(_mm_loadu_si128(step.add(1024 + 32 * c + 16 * h) as *const _));
                for t in 0..N {
                    let four = |at: usize| {
                        _mm256_set1_epi32((a[t].qs.as_ptr().add(at) as *const i32).read_unaligned())
                    };
                    let sum = if V::ON {
                        let mut sum = _mm256_set1_epi32(bias[t]);
                        for k in 0..4 {
                            sum = V::dpbusd(sum, lo[k], four(4 * k));
                            sum = V::dpbusd(sum, hi[k], four(16 + 4 * k));
                        }
                        sum
                    } else {
                        let mut pairs = _mm256_setzero_si256();
                        for k in 0..4 {
                            let (l, h) = (four(4 * k), four(16 + 4 * k));
                            pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(lo[k], l));
                            pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(hi[k], h));
                        }
                        _mm256_add_epi32(_mm256_madd_epi16(pairs, ones), _mm256_set1_epi32(bias[t]))
                    };
                    let dd = _mm256_mul_ps(d, _mm256_set1_ps(a[t].d));
                    acc[t][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), dd, acc[t][h]);
                }
            }
        }
    }
    let mut out = [[0.0f32; GROUP_ROWS]; N];
    for t in 0..N {
        _mm256_storeu_ps(out[t].as_mut_ptr(), acc[t][0]);
        _mm256_storeu_ps(out[t].as_mut_ptr().add(8), acc[t][1]);
    }
    out
}

/// Four activations of a token from byte `at` of its block, in every 32-bit lane.
#[inline(always)]
unsafe fn four_512(a: &BlockQ8K, at: usize) -> __m512i {
    _mm512_set1_epi32((a.qs.as_ptr().add(at) as *const i32).read_unaligned())
}

/// The sixteen rows of a Q4_K `group` against N tokens' activations (cols / 256 each), as
/// `dot_group_k4_scalar`: per super-block and sub-block j, `vpdpbusd` sums q * a exactly in each
/// row's lane (the low or high nibbles of eight lines), `vpmulld` by the rows' scales; the
/// minima's sums by `vpdpwssd` of the rows' minimum pairs with the activations' sums per 32;
/// then `q256::block_step` in every lane. For one token the four pairs of sub-blocks' chains run
/// side by side (eight dependency chains); for two, two pairs; for more, one.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn dot_group_k4<const N: usize>(
    group: &[u8],
    x: [&[BlockQ8K]; N],
    next: &[u8],
) -> [[f32; GROUP_ROWS]; N] {
    let steps = group.len() / K4_STEP_BYTES;
    debug_assert!(group.len() == steps * K4_STEP_BYTES && x.iter().all(|x| x.len() == steps));
    let nibble = _mm512_set1_epi8(0x0F);
    let zero = _mm512_setzero_si512();
    let side_by_side = match N {
        1 => 4,
        2 => 2,
        _ => 1,
    };
    let mut acc = [_mm512_setzero_ps(); N];
    let next = [next];
    // One token's pass waits on memory: the next group's lines asked for eight times a step, a
    // few at a time, not all at the step's start, which stalls at the prefetches once the
    // misses in flight fill L2's queue (a 4-layer Qwen3-30B-A3B-shape Q4_K_M model's decode on
    // a 2-core Intel Xeon 140 -> 156-166 tok/s). Several tokens' passes are bound by their
    // instructions, and asking in the loop costs them a quarter (prefill 640-680 -> 480-520).
    let spread = N == 1;
    let mut prefetch = PrefetchL2::new(&next, if spread { 8 * steps } else { steps });
    for s in 0..steps {
        if !spread {
            prefetch.step();
        }
        let step = group.as_ptr().add(s * K4_STEP_BYTES);
        let a: [&BlockQ8K; N] = std::array::from_fn(|t| x[t].get_unchecked(s));
        let mut sums = [zero; N];
        for g0 in (0..4).step_by(side_by_side) {
            // sub-blocks 2g (low nibbles) and 2g + 1 (high) of chunks g0..g0 + side_by_side
            let (mut lo, mut hi) = ([[zero; N]; 4], [[zero; N]; 4]);
            for i in 0..8 {
                if spread {
                    prefetch.step();
                }
                for g in g0..g0 + side_by_side {
                    let w = _mm512_loadu_si512(step.add(64 * (8 * g + i)) as *const _);
                    let wl = _mm512_and_si512(w, nibble);
                    let wh = _mm512_and_si512(_mm512_srli_epi16::<4>(w), nibble);
                    for t in 0..N {
                        let k = g - g0;
                        lo[k][t] =
                            _mm512_dpbusd_epi32(lo[k][t], wl, four_512(a[t], 64 * g + 4 * i));
                        hi[k][t] =
                            _mm512_dpbusd_epi32(hi[k][t], wh, four_512(a[t], 64 * g + 32 + 4 * i));
                    }
                }
            }
            for g in g0..g0 + side_by_side {
                let scale = |j: usize| {
                    _mm512_cvtepu8_epi32(_mm_loadu_si128(
                        step.add(K4_SCALES_AT + 16 * j) as *const _
                    ))
                };
                let (sl, sh) = (scale(2 * g), scale(2 * g + 1));
                for t in 0..N {
                    let k = g - g0;
                    let both = _mm512_add_epi32(
                        _mm512_mullo_epi32(lo[k][t], sl),
                        _mm512_mullo_epi32(hi[k][t], sh),
                    );
                    sums[t] = _mm512_add_epi32(sums[t], both);
                }
            }
        }
        let mut mins = [zero; N];
        for k in 0..4 {
            let pairs =
                _mm512_cvtepu8_epi16(_mm256_loadu_si256(step.add(K4_MINS_AT + 32 * k) as *const _));
            for t in 0..N {
                let b = (a[t].bsums32.as_ptr().add(2 * k) as *const i32).read_unaligned();
                mins[t] = _mm512_dpwssd_epi32(mins[t], pairs, _mm512_set1_epi32(b));
            }
        }
        let d = _mm512_cvtph_ps(_mm256_loadu_si256(step.add(K4_D_AT) as *const _));
        let dmin = _mm512_cvtph_ps(_mm256_loadu_si256(step.add(K4_DMIN_AT) as *const _));
        for t in 0..N {
            let da = _mm512_set1_ps(a[t].d);
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[t]), _mm512_mul_ps(d, da), acc[t]);
            acc[t] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(mins[t]), _mm512_mul_ps(dmin, da), acc[t]);
        }
    }
    let mut out = [[0.0f32; GROUP_ROWS]; N];
    for t in 0..N {
        _mm512_storeu_ps(out[t].as_mut_ptr(), acc[t]);
    }
    out
}

/// `dot_group_k4` at the 256-bit levels, eight rows per vector (half h of each line). With
/// 256-bit VNNI (V) as there; without, `vpmaddubsw` pairs of a sub-block's eight lines summed in
/// 16 bits (16 products of 15 * 127 fit) and `vpmaddwd` by the rows' scales, and the minima by
/// `vpmaddwd`. The same exact sums, so the same bits.
#[inline(always)]
unsafe fn dot_group_k4_256<V: Dp256, const N: usize>(
    group: &[u8],
    x: [&[BlockQ8K]; N],
    next: &[u8],
) -> [[f32; GROUP_ROWS]; N] {
    let steps = group.len() / K4_STEP_BYTES;
    debug_assert!(group.len() == steps * K4_STEP_BYTES && x.iter().all(|x| x.len() == steps));
    let nibble = _mm256_set1_epi8(0x0F);
    let zero = _mm256_setzero_si256();
    let side_by_side = match N {
        1 => 4,
        2 => 2,
        _ => 1,
    };
    let mut acc = [[_mm256_setzero_ps(); 2]; N];
    let next = [next];
    // (for one token the next group's lines asked for eight times a half step, `dot_group_k4`)
    let spread = N == 1;
    let mut prefetch = PrefetchL2::new(&next, if spread { 16 * steps } else { steps });
    for s in 0..steps {
        if !spread {
            prefetch.step();
        }
        let step = group.as_ptr().add(s * K4_STEP_BYTES);
        let a: [&BlockQ8K; N] = std::array::from_fn(|t| x[t].get_unchecked(s));
        let four = |t: usize, at: usize| {
            _mm256_set1_epi32((a[t].qs.as_ptr().add(at) as *const i32).read_unaligned())
        };
        for h in 0..2 {
            let mut sums = [zero; N];
            for g0 in (0..4).step_by(side_by_side) {
                let (mut lo, mut hi) = ([[zero; N]; 4], [[zero; N]; 4]);
                for i in 0..8 {
                    if spread {
                        prefetch.step();
                    }
                    for g in g0..g0 + side_by_side {
                        let at = step.add(64 * (8 * g + i) + 32 * h);
                        let w = _mm256_loadu_si256(at as *const _);
                        let wl = _mm256_and_si256(w, nibble);
                        let wh = _mm256_and_si256(_mm256_srli_epi16::<4>(w), nibble);
                        for t in 0..N {
                            let (k, al, ah) =
                                (g - g0, four(t, 64 * g + 4 * i), four(t, 64 * g + 32 + 4 * i));
                            if V::ON {
                                lo[k][t] = V::dpbusd(lo[k][t], wl, al);
                                hi[k][t] = V::dpbusd(hi[k][t], wh, ah);
                            } else {
                                lo[k][t] = _mm256_add_epi16(lo[k][t], _mm256_maddubs_epi16(wl, al));
                                hi[k][t] = _mm256_add_epi16(hi[k][t], _mm256_maddubs_epi16(wh, ah));
                            }
                        }
                    }
                }
                for g in g0..g0 + side_by_side {
                    let scale = |j: usize| {
                        let at = step.add(K4_SCALES_AT + 16 * j + 8 * h);
                        _mm256_cvtepu8_epi32(_mm_loadl_epi64(at as *const _))
                    };
                    let (sl, sh) = (scale(2 * g), scale(2 * g + 1));
                    for t in 0..N {
                        let k = g - g0;
                        let both = if V::ON {
                            _mm256_add_epi32(
                                _mm256_mullo_epi32(lo[k][t], sl),
                                _mm256_mullo_epi32(hi[k][t], sh),
                            )
                        } else {
                            // the scale in both 16-bit halves of its lane
                            let (sl, sh) = (
                                _mm256_or_si256(sl, _mm256_slli_epi32::<16>(sl)),
                                _mm256_or_si256(sh, _mm256_slli_epi32::<16>(sh)),
                            );
                            _mm256_add_epi32(
                                _mm256_madd_epi16(lo[k][t], sl),
                                _mm256_madd_epi16(hi[k][t], sh),
                            )
                        };
                        sums[t] = _mm256_add_epi32(sums[t], both);
                    }
                }
            }
            let mut mins = [zero; N];
            for k in 0..4 {
                let at = step.add(K4_MINS_AT + 32 * k + 16 * h);
                let pairs = _mm256_cvtepu8_epi16(_mm_loadu_si128(at as *const _));
                for t in 0..N {
                    let b = (a[t].bsums32.as_ptr().add(2 * k) as *const i32).read_unaligned();
                    let b = _mm256_set1_epi32(b);
                    mins[t] = match V::ON {
                        true => V::dpwssd(mins[t], pairs, b),
                        false => _mm256_add_epi32(mins[t], _mm256_madd_epi16(pairs, b)),
                    };
                }
            }
            let d = _mm256_cvtph_ps(_mm_loadu_si128(step.add(K4_D_AT + 16 * h) as *const _));
            let dmin = _mm256_cvtph_ps(_mm_loadu_si128(step.add(K4_DMIN_AT + 16 * h) as *const _));
            for t in 0..N {
                let da = _mm256_set1_ps(a[t].d);
                let sums = _mm256_cvtepi32_ps(sums[t]);
                acc[t][h] = _mm256_fmadd_ps(sums, _mm256_mul_ps(d, da), acc[t][h]);
                let mins = _mm256_cvtepi32_ps(mins[t]);
                acc[t][h] = _mm256_fnmadd_ps(mins, _mm256_mul_ps(dmin, da), acc[t][h]);
            }
        }
    }
    let mut out = [[0.0f32; GROUP_ROWS]; N];
    for t in 0..N {
        _mm256_storeu_ps(out[t].as_mut_ptr(), acc[t][0]);
        _mm256_storeu_ps(out[t].as_mut_ptr().add(8), acc[t][1]);
    }
    out
}

/// Sixteen rows' E8M0 exponents `e` (a lane each) as `chunks::e8m0_half`'s f32s.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn e8m0_half_512(e: __m128i) -> __m512 {
    let e = _mm512_cvtepu8_epi32(e);
    let normal = _mm512_slli_epi32::<23>(_mm512_sub_epi32(e, _mm512_set1_epi32(1)));
    let subnormal = _mm512_sllv_epi32(_mm512_set1_epi32(0x0020_0000), e);
    let small = _mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2));
    _mm512_castsi512_ps(_mm512_mask_blend_epi32(small, normal, subnormal))
}

/// Eight rows' E8M0 exponents (the low 8 bytes of `e`) as `chunks::e8m0_half`'s f32s.
#[inline(always)]
unsafe fn e8m0_half_256(e: __m128i) -> __m256 {
    let e = _mm256_cvtepu8_epi32(e);
    let normal = _mm256_slli_epi32::<23>(_mm256_sub_epi32(e, _mm256_set1_epi32(1)));
    let subnormal = _mm256_sllv_epi32(_mm256_set1_epi32(0x0020_0000), e);
    let small = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
    _mm256_castsi256_ps(_mm256_blendv_epi8(normal, subnormal, small))
}

/// Half h (eight rows) of MXFP4 block c of a step of n blocks at `step`: its weights as `table`
/// gives them (v + 128, or v) by `vpshufb`, low and high nibbles, and the rows' scales.
#[inline(always)]
unsafe fn mx_half_256(
    step: *const u8,
    n: usize,
    c: usize,
    h: usize,
    table: __m256i,
) -> ([__m256i; 4], [__m256i; 4], __m256) {
    let nibble = _mm256_set1_epi8(0x0F);
    let mut lo = [_mm256_setzero_si256(); 4];
    let mut hi = [_mm256_setzero_si256(); 4];
    for k in 0..4 {
        let w = _mm256_loadu_si256(step.add(64 * (4 * c + k) + 32 * h) as *const _);
        lo[k] = _mm256_shuffle_epi8(table, _mm256_and_si256(w, nibble));
        let high = _mm256_and_si256(_mm256_srli_epi16::<4>(w), nibble);
        hi[k] = _mm256_shuffle_epi8(table, high);
    }
    let e = _mm_loadl_epi64(step.add(256 * n + 16 * c + 8 * h) as *const _);
    (lo, hi, e8m0_half_256(e))
}

/// The table `mx_half_256` reads at V's level: v + 128 where `vpdpbusd` sums it, else v.
#[inline(always)]
unsafe fn mx_table_256<V: Dp256>() -> __m256i {
    let plus_128: [u8; 16] = std::array::from_fn(|i| (MXFP4_VALUES[i] as u8) ^ 0x80);
    let values = if V::ON { plus_128.as_ptr() } else { MXFP4_VALUES.as_ptr() as *const u8 };
    _mm256_broadcastsi128_si256(_mm_loadu_si128(values as *const _))
}

/// Where V's sums of block b of a token start: -128 times its activations (from `q8_bias`, b's
/// entry, where the batch has it); without VNNI 0.
#[inline(always)]
unsafe fn mx_bias_256<V: Dp256>(a: &BlockQ8Act, q8_bias: &[i32], b: usize) -> i32 {
    match (V::ON, q8_bias) {
        (false, _) => 0,
        (true, []) => -128 * block_sum(&a.qs),
        (true, q8_bias) => *q8_bias.get_unchecked(b),
    }
}

/// A block's exact sums of v * a in each row's lane from `mx_half_256`'s weights: with 256-bit
/// VNNI (V) `vpdpbusd` of v + 128 from `bias`; without, |v| times the activations with v's sign
/// (`vpsignb`) by `vpmaddubsw`, pairs summed in 16 bits (eight pairs of 2 * 12 * 127 fit) and
/// widened by `vpmaddwd` (v + 128 would overflow a pair).
#[inline(always)]
unsafe fn mx_block_sums_256<V: Dp256>(
    (lo, hi): ([__m256i; 4], [__m256i; 4]),
    a: &BlockQ8Act,
    bias: i32,
) -> __m256i {
    let four =
        |at: usize| _mm256_set1_epi32((a.qs.as_ptr().add(at) as *const i32).read_unaligned());
    if V::ON {
        let mut sum = _mm256_set1_epi32(bias);
        for k in 0..4 {
            sum = V::dpbusd(sum, lo[k], four(4 * k));
            sum = V::dpbusd(sum, hi[k], four(16 + 4 * k));
        }
        sum
    } else {
        let mut pairs = _mm256_setzero_si256();
        for k in 0..4 {
            for (v, a) in [(lo[k], four(4 * k)), (hi[k], four(16 + 4 * k))] {
                let (u, signed) = (_mm256_abs_epi8(v), _mm256_sign_epi8(a, v));
                pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(u, signed));
            }
        }
        _mm256_madd_epi16(pairs, _mm256_set1_epi16(1))
    }
}

/// MXFP4's `dot_group` at the AVX2 level, its float steps `avx2::dot_legacy`'s
/// (`FloatSteps::FmaPerBlock`), eight rows per vector (`mx_half_256`, `mx_block_sums_256`).
/// Reads `Activations::q8` and `q8_bias`.
#[inline(always)]
unsafe fn dot_group_mx_256<V: Dp256, const N: usize>(
    group: &[u8],
    (x, q8_bias): ([&[BlockQ8Act]; N], [&[i32]; N]),
    next: &[u8],
) -> [[f32; GROUP_ROWS]; N] {
    let blocks = group.len() / (GROUP_ROWS * std::mem::size_of::<BlockMXFP4>());
    let steps = blocks.div_ceil(STEP_BLOCKS);
    debug_assert!(x.iter().all(|x| x.len() == blocks));
    let table = mx_table_256::<V>();
    let mut acc = [[_mm256_setzero_ps(); 2]; N];
    let next = [next];
    // (for one token the next group's lines asked for once a block, as Q4_0's `dot_group_256`)
    let spread = N == 1;
    let mut prefetch = PrefetchL2::new(&next, if spread { STEP_BLOCKS * steps } else { steps });
    for s in 0..steps {
        if !spread {
            prefetch.step();
        }
        let n = mx_step_blocks(blocks, s);
        let step = group.as_ptr().add(s * MX_STEP_BYTES);
        for c in 0..n {
            if spread {
                prefetch.step();
            }
            let b = STEP_BLOCKS * s + c;
            let a: [&BlockQ8Act; N] = std::array::from_fn(|t| x[t].get_unchecked(b));
            let bias: [i32; N] = std::array::from_fn(|t| mx_bias_256::<V>(a[t], q8_bias[t], b));
            for h in 0..2 {
                let (lo, hi, d) = mx_half_256(step, n, c, h, table);
                for t in 0..N {
                    let sum = mx_block_sums_256::<V>((lo, hi), a[t], bias[t]);
                    let dd = _mm256_mul_ps(d, _mm256_set1_ps(a[t].d));
                    acc[t][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), dd, acc[t][h]);
                }
            }
        }
    }
    let mut out = [[0.0f32; GROUP_ROWS]; N];
    for t in 0..N {
        _mm256_storeu_ps(out[t].as_mut_ptr(), acc[t][0]);
        _mm256_storeu_ps(out[t].as_mut_ptr().add(8), acc[t][1]);
    }
    out
}

/// `dot_group_mx_256` for all n tokens of a batch at once, each block decoded once for them
/// all (`GroupDots::ALL_TOKENS`): out[16t + r] = row r . token t, the same steps in the same
/// order, each token's sums in `out` between blocks. `q8`, `q8_bias`: `Activations::q8` and
/// `q8_bias` (n * cols / 32 each, or `q8_bias` empty).
#[inline(always)]
unsafe fn dot_group_mx_256_all<V: Dp256>(
    group: &[u8],
    (q8, q8_bias): (&[BlockQ8Act], &[i32]),
    n: usize,
    next: &[u8],
    out: &mut [f32],
) {
    let blocks = group.len() / (GROUP_ROWS * std::mem::size_of::<BlockMXFP4>());
    let steps = blocks.div_ceil(STEP_BLOCKS);
    debug_assert!(q8.len() == n * blocks && out.len() == n * GROUP_ROWS);
    out.fill(0.0);
    let table = mx_table_256::<V>();
    let next = [next];
    let mut prefetch = PrefetchL2::new(&next, steps);
    for s in 0..steps {
        prefetch.step();
        let nb = mx_step_blocks(blocks, s);
        let step = group.as_ptr().add(s * MX_STEP_BYTES);
        for c in 0..nb {
            let b = STEP_BLOCKS * s + c;
            for h in 0..2 {
                let (lo, hi, d) = mx_half_256(step, nb, c, h, table);
                for t in 0..n {
                    let a = q8.get_unchecked(t * blocks + b);
                    let bias = mx_bias_256::<V>(a, q8_bias, t * blocks + b);
                    let sum = mx_block_sums_256::<V>((lo, hi), a, bias);
                    let dd = _mm256_mul_ps(d, _mm256_set1_ps(a.d));
                    let acc = out.as_mut_ptr().add(GROUP_ROWS * t + 8 * h);
                    let sum = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), dd, _mm256_loadu_ps(acc));
                    _mm256_storeu_ps(acc, sum);
                }
            }
        }
    }
}

/// A level's dots of a group with N tokens' activations (`dot_group`, `dot_group_256`), as a
/// type, so that `rows_all_tokens_with` is compiled once per level with its features.
trait GroupDots {
    /// The batch's activations in the form the level reads.
    type Acts<'a>: Copy;
    /// One token's.
    type Token<'a>: Copy;
    fn token<'a>(acts: Self::Acts<'a>, n: usize, t: usize) -> Self::Token<'a>;
    unsafe fn dot<const N: usize>(
        group: &[u8],
        x: [Self::Token<'_>; N],
        next: &[u8],
    ) -> [[f32; GROUP_ROWS]; N];
    /// Whether a batch of several tokens reads a group once for them all (`dot_all`) rather
    /// than in passes of four: where decoding the weights weighs against the sums (MXFP4's
    /// table lookups at the 256-bit levels; Q4_0's and MXFP4's 512-bit blocks at AVX-512).
    const ALL_TOKENS: bool = false;
    /// The group against all n tokens, out[16t + r] (`ALL_TOKENS`).
    unsafe fn dot_all(
        _group: &[u8],
        _x: Self::Acts<'_>,
        _n: usize,
        _next: &[u8],
        _out: &mut [f32],
    ) {
        unreachable!("only where ALL_TOKENS")
    }
}

/// Token t's share of a batch's `v` (n tokens' values one after another; empty: none).
fn share<T>(v: &[T], n: usize, t: usize) -> &[T] {
    let per = v.len() / n.max(1);
    &v[t * per..(t + 1) * per]
}

/// Q4_0's (MX false) or MXFP4's (MX true) dots at AVX-512.
struct Avx512Dots<const MX: bool>;
impl<const MX: bool> GroupDots for Avx512Dots<MX> {
    type Acts<'a> = &'a [ActQuad];
    type Token<'a> = &'a [ActQuad];
    fn token<'a>(acts: Self::Acts<'a>, n: usize, t: usize) -> Self::Token<'a> {
        share(acts, n, t)
    }
    #[inline(always)]
    unsafe fn dot<const N: usize>(
        group: &[u8],
        x: [&[ActQuad]; N],
        next: &[u8],
    ) -> [[f32; GROUP_ROWS]; N] {
        dot_group::<MX, N>(group, x, next)
    }
    /// (A prompt of 128 tokens on the 2-core Zen 4, 2 threads, alternating runs: gpt-oss-20b's
    /// shape, 2 layers, MXFP4 experts, 524-688 -> 625-826 tok/s; Qwen3-30B-A3B's, 4 layers,
    /// Q4_0, 600-632 -> 671-707 tok/s: a batch's tokens per expert are few, 4-16, and each
    /// pass of four decoded the weights again.)
    const ALL_TOKENS: bool = true;
    #[inline(always)]
    unsafe fn dot_all(group: &[u8], x: &[ActQuad], n: usize, next: &[u8], out: &mut [f32]) {
        dot_group_all::<MX>(group, x, n, next, out)
    }
}

/// Q4_K's dots at AVX-512.
struct K4Avx512Dots;
impl GroupDots for K4Avx512Dots {
    type Acts<'a> = &'a [BlockQ8K];
    type Token<'a> = &'a [BlockQ8K];
    fn token<'a>(acts: Self::Acts<'a>, n: usize, t: usize) -> Self::Token<'a> {
        share(acts, n, t)
    }
    #[inline(always)]
    unsafe fn dot<const N: usize>(
        group: &[u8],
        x: [&[BlockQ8K]; N],
        next: &[u8],
    ) -> [[f32; GROUP_ROWS]; N] {
        dot_group_k4::<N>(group, x, next)
    }
}

/// A type's dots at the 256-bit levels, in any 256-bit VNNI encoding or none.
pub(crate) trait Dots256 {
    type Acts<'a>: Copy;
    fn token<'a>(acts: Self::Acts<'a>, n: usize, t: usize) -> Self::Acts<'a>;
    unsafe fn dot<V: Dp256, const N: usize>(
        group: &[u8],
        x: [Self::Acts<'_>; N],
        next: &[u8],
    ) -> [[f32; GROUP_ROWS]; N];
    /// As `GroupDots::ALL_TOKENS` and `dot_all`.
    const ALL_TOKENS: bool = false;
    unsafe fn dot_all<V: Dp256>(
        _group: &[u8],
        _x: Self::Acts<'_>,
        _n: usize,
        _next: &[u8],
        _out: &mut [f32],
    ) {
        unreachable!("only where ALL_TOKENS")
    }
}

/// Q4_0 at the 256-bit levels: `Activations::q8` and `Activations::q8_bias`.
pub(crate) struct Q4_0Dots256;
impl Dots256 for Q4_0Dots256 {
    type Acts<'a> = (&'a [BlockQ8Act], &'a [i32]);
    fn token<'a>((q8, bias): Self::Acts<'a>, n: usize, t: usize) -> Self::Acts<'a> {
        (share(q8, n, t), share(bias, n, t))
    }
    #[inline(always)]
    unsafe fn dot<V: Dp256, const N: usize>(
        group: &[u8],
        x: [Self::Acts<'_>; N],
        next: &[u8],
    ) -> [[f32; GROUP_ROWS]; N] {
        dot_group_256::<V, N>(group, (x.map(|x| x.0), x.map(|x| x.1)), next)
    }
}

/// MXFP4 at the 256-bit levels: `Activations::q8` and `Activations::q8_bias`.
pub(crate) struct MxDots256;
impl Dots256 for MxDots256 {
    type Acts<'a> = (&'a [BlockQ8Act], &'a [i32]);
    fn token<'a>((q8, bias): Self::Acts<'a>, n: usize, t: usize) -> Self::Acts<'a> {
        (share(q8, n, t), share(bias, n, t))
    }
    #[inline(always)]
    unsafe fn dot<V: Dp256, const N: usize>(
        group: &[u8],
        x: [Self::Acts<'_>; N],
        next: &[u8],
    ) -> [[f32; GROUP_ROWS]; N] {
        dot_group_mx_256::<V, N>(group, (x.map(|x| x.0), x.map(|x| x.1)), next)
    }
    const ALL_TOKENS: bool = true;
    #[inline(always)]
    unsafe fn dot_all<V: Dp256>(
        group: &[u8],
        x: Self::Acts<'_>,
        n: usize,
        next: &[u8],
        out: &mut [f32],
    ) {
        dot_group_mx_256_all::<V>(group, x, n, next, out)
    }
}

/// Q4_K at the 256-bit levels: `Activations::q8k`.
pub(crate) struct Q4KDots256;
impl Dots256 for Q4KDots256 {
    type Acts<'a> = &'a [BlockQ8K];
    fn token<'a>(acts: Self::Acts<'a>, n: usize, t: usize) -> Self::Acts<'a> {
        share(acts, n, t)
    }
    #[inline(always)]
    unsafe fn dot<V: Dp256, const N: usize>(
        group: &[u8],
        x: [Self::Acts<'_>; N],
        next: &[u8],
    ) -> [[f32; GROUP_ROWS]; N] {
        dot_group_k4_256::<V, N>(group, x, next)
    }
}

struct Avx2Dots<V, F>(std::marker::PhantomData<(V, F)>);
impl<V: Dp256, F: Dots256> GroupDots for Avx2Dots<V, F> {
    type Acts<'a> = F::Acts<'a>;
    type Token<'a> = F::Acts<'a>;
    fn token<'a>(acts: Self::Acts<'a>, n: usize, t: usize) -> Self::Token<'a> {
        F::token(acts, n, t)
    }
    #[inline(always)]
    unsafe fn dot<const N: usize>(
        group: &[u8],
        x: [Self::Token<'_>; N],
        next: &[u8],
    ) -> [[f32; GROUP_ROWS]; N] {
        F::dot::<V, N>(group, x, next)
    }
    const ALL_TOKENS: bool = F::ALL_TOKENS;
    #[inline(always)]
    unsafe fn dot_all(group: &[u8], x: Self::Acts<'_>, n: usize, next: &[u8], out: &mut [f32]) {
        F::dot_all::<V>(group, x, n, next, out)
    }
}

/// Rows `rows` (multiples of 16) of `w` against n tokens (`acts`: theirs, one after another):
/// put(token, first row, its sixteen values), four tokens per pass over a group, then two,
/// then one (or all at once, `GroupDots::ALL_TOKENS`); each call prefetches the next group (up
/// to `rows.end`).
#[inline(always)]
unsafe fn rows_all_tokens_with<K: GroupDots>(
    w: &Interleaved,
    rows: std::ops::Range<usize>,
    acts: K::Acts<'_>,
    n: usize,
    put: impl Fn(usize, usize, &[f32]),
) {
    let token = |t: usize| K::token(acts, n, t);
    let (g0, g1) = (rows.start / GROUP_ROWS, rows.end / GROUP_ROWS);
    let gb = group_bytes(w.dtype, w.cols);
    let all_tokens = K::ALL_TOKENS && n > 1;
    let mut out = vec![0.0f32; if all_tokens { n * GROUP_ROWS } else { 0 }];
    for g in g0..g1 {
        let group = w.group(g);
        let next = match g + 1 < g1 {
            true => &w.data[(g + 1) * gb..(g + 2) * gb],
            false => &[][..],
        };
        let r = g * GROUP_ROWS;
        if all_tokens {
            K::dot_all(group, acts, n, next, &mut out);
            out.chunks_exact(GROUP_ROWS).enumerate().for_each(|(t, v)| put(t, r, v));
            continue;
        }
        let mut t = 0;
        while t + 4 <= n {
            let v = K::dot::<4>(group, [token(t), token(t + 1), token(t + 2), token(t + 3)], next);
            v.iter().enumerate().for_each(|(k, v)| put(t + k, r, v));
            t += 4;
        }
        if t + 2 <= n {
            let v = K::dot::<2>(group, [token(t), token(t + 1)], next);
            v.iter().enumerate().for_each(|(k, v)| put(t + k, r, v));
            t += 2;
        }
        if t < n {
            put(t, r, &K::dot::<1>(group, [token(t)], next)[0]);
        }
    }
}

/// `rows_all_tokens_with` of a Q4_0 or MXFP4 matrix at AVX-512 (`quads`: `Activations::quads`,
/// n * cols / 128).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn rows_all_tokens(
    w: &Interleaved,
    rows: std::ops::Range<usize>,
    quads: &[ActQuad],
    n: usize,
    put: impl Fn(usize, usize, &[f32]),
) {
    match w.dtype {
        DType::Q4_0 => rows_all_tokens_with::<Avx512Dots<false>>(w, rows, quads, n, put),
        _ => rows_all_tokens_with::<Avx512Dots<true>>(w, rows, quads, n, put),
    }
}

/// `rows_all_tokens_with` of a Q4_K matrix at AVX-512 (`q8k`: `Activations::q8k`,
/// n * cols / 256).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn rows_all_tokens_k4(
    w: &Interleaved,
    rows: std::ops::Range<usize>,
    q8k: &[BlockQ8K],
    n: usize,
    put: impl Fn(usize, usize, &[f32]),
) {
    rows_all_tokens_with::<K4Avx512Dots>(w, rows, q8k, n, put)
}

/// `rows_all_tokens_with` at AVX2 of a matrix whose type F reads (`Q4_0Dots256`,
/// `Q4KDots256`, `MxDots256`), with 256-bit VNNI in the given encoding or without.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C, and the encoding's features.
pub(crate) unsafe fn rows_all_tokens_256<F: Dots256>(
    vnni: Option<Vnni256>,
    w: &Interleaved,
    rows: std::ops::Range<usize>,
    x: F::Acts<'_>,
    n: usize,
    put: impl Fn(usize, usize, &[f32]),
) {
    type Range = std::ops::Range<usize>;
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn plain<F: Dots256>(
        w: &Interleaved,
        rows: Range,
        x: F::Acts<'_>,
        n: usize,
        put: impl Fn(usize, usize, &[f32]),
    ) {
        rows_all_tokens_with::<Avx2Dots<NoVnni, F>>(w, rows, x, n, put)
    }
    #[target_feature(enable = "avx2,fma,f16c,avxvnni")]
    unsafe fn vex<F: Dots256>(
        w: &Interleaved,
        rows: Range,
        x: F::Acts<'_>,
        n: usize,
        put: impl Fn(usize, usize, &[f32]),
    ) {
        rows_all_tokens_with::<Avx2Dots<Vex, F>>(w, rows, x, n, put)
    }
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
    unsafe fn evex<F: Dots256>(
        w: &Interleaved,
        rows: Range,
        x: F::Acts<'_>,
        n: usize,
        put: impl Fn(usize, usize, &[f32]),
    ) {
        rows_all_tokens_with::<Avx2Dots<Evex, F>>(w, rows, x, n, put)
    }
    match vnni {
        None => plain::<F>(w, rows, x, n, put),
        Some(Vnni256::Vex) => vex::<F>(w, rows, x, n, put),
        Some(Vnni256::Evex) => evex::<F>(w, rows, x, n, put),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::matmul::Activations;
    use crate::quant::interleaved::{
        dot_group_k4_scalar, dot_group_mx_scalar, dot_group_scalar, interleave, matrix_bytes,
        FloatSteps,
    };
    use crate::quant::{quantize_row, DType, QK, QK_K};
    use crate::sampler::Rng;
    use crate::simd::{simd_level, vnni256_encodings, SimdLevel};

    fn random(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = Rng::new(seed);
        (0..n).map(|_| rng.next_f32() * 2.0 - 1.0).collect()
    }

    /// Random matrices of `dtype` (a row of the largest magnitudes, one of zeros) in both
    /// layouts, and n tokens' activations (some large), for each shape and n from 1 to 16.
    fn cases_of(dtype: DType, mut check: impl FnMut(&[u8], &Interleaved, &Activations)) {
        let shapes = match dtype {
            DType::Q4_0 => [(16, 128), (32, 512), (48, 768), (16, 2048)],
            // gpt-oss's 2880 columns and 64 end in a half step
            DType::MXFP4 => [(16, 64), (32, 512), (48, 320), (16, 2880)],
            _ => [(16, 256), (32, 512), (48, 768), (16, 2048)],
        };
        for (rows, cols) in shapes {
            let src: Vec<u8> = match dtype {
                DType::Q4_0 => {
                    let mut w = random(rows * cols, rows as u64);
                    w[..cols].iter_mut().for_each(|v| *v = if *v > 0.0 { 1.0 } else { -1.0 });
                    w[cols..2 * cols].fill(0.0);
                    w.chunks(cols).flat_map(|r| quantize_row(dtype, r)).collect()
                }
                DType::MXFP4 => {
                    let mut src: Vec<u8> = (0..rows as u64)
                        .flat_map(|r| crate::quant::chunks::tests::random_row(dtype, cols, r))
                        .collect();
                    // a row of the largest magnitudes (12 in every weight)
                    for blk in src[..dtype.row_bytes(cols)].chunks_exact_mut(17) {
                        blk[1..].fill(0x77);
                    }
                    src
                }
                _ => crate::quant::interleaved::tests::k_rows(dtype, rows, cols, rows as u64),
            };
            let mut packed = vec![0u8; matrix_bytes(dtype, rows, cols)];
            interleave(dtype, &src, rows, cols, &mut packed);
            let m = Interleaved::new(dtype, rows, cols, &packed);
            for n in [1, 2, 3, 4, 5, 6, 7, 8, 11, 16] {
                let mut x = random(n * cols, 100 + n as u64);
                x[..cols.min(64)].iter_mut().for_each(|v| *v *= 1e3);
                let mut acts = Activations::default();
                acts.set(&x, n, cols);
                check(&src, &m, &acts);
            }
        }
    }

    /// The interleaved product's values (n, rows) by `run(put)`.
    fn collect(rows: usize, n: usize, run: impl FnOnce(&dyn Fn(usize, usize, &[f32]))) -> Vec<f32> {
        let got = std::cell::RefCell::new(vec![0.0f32; n * rows]);
        run(&|t, r, v| got.borrow_mut()[t * rows + r..t * rows + r + 16].copy_from_slice(v));
        got.into_inner()
    }

    #[test]
    fn avx512_groups_equal_the_scalar_twin_and_the_file_layouts_products_bit_for_bit() {
        if simd_level() != SimdLevel::Avx512 {
            eprintln!("skipped: needs AVX-512 VNNI (this run's level: {:?})", simd_level());
            return;
        }
        for dtype in [DType::Q4_0, DType::MXFP4] {
            avx512_equals_twin_and_file_layout(dtype);
        }
    }

    fn avx512_equals_twin_and_file_layout(dtype: DType) {
        let twin = |group: &[u8], q8: &[BlockQ8Act]| match dtype {
            DType::Q4_0 => dot_group_scalar(group, q8, FloatSteps::SumOfFour),
            _ => dot_group_mx_scalar(group, q8, FloatSteps::SumOfFour),
        };
        cases_of(dtype, |src, m, acts| {
            let (rows, cols, n) = (m.rows, m.cols, acts.n);
            let got =
                collect(rows, n, |put| unsafe { rows_all_tokens(m, 0..rows, &acts.quads, n, put) });
            // the file layout's product at this level: its one-token kernels, or for five
            // tokens and more its prompt row groups
            let file = crate::matmul::QMatrix { dtype, rows, cols, data: src };
            let mut want = vec![0.0f32; n * rows];
            crate::matmul::matmul(&file, acts, &mut want);
            let nb = cols / QK;
            for t in 0..n {
                let q8 = &acts.q8[t * nb..(t + 1) * nb];
                let twin: Vec<f32> = (0..rows / 16).flat_map(|g| twin(m.group(g), q8)).collect();
                for r in 0..rows {
                    let (g, s, f) = (got[t * rows + r], twin[r], want[t * rows + r]);
                    let at = format!("{dtype:?} {rows}x{cols} n {n} token {t} row {r}");
                    assert_eq!(g.to_bits(), s.to_bits(), "{at}: {g} vs twin {s}");
                    assert_eq!(g.to_bits(), f.to_bits(), "{at}: {g} vs file layout {f}");
                }
            }
        });
    }

    #[test]
    fn avx2_groups_equal_the_scalar_twin_and_the_file_layouts_kernel_bit_for_bit() {
        if !simd_level().has_avx2() {
            eprintln!("skipped: needs AVX2 (this run's level: {:?})", simd_level());
            return;
        }
        for dtype in [DType::Q4_0, DType::MXFP4] {
            avx2_equals_twin_and_file_layout(dtype);
        }
    }

    fn avx2_equals_twin_and_file_layout(dtype: DType) {
        // without 256-bit VNNI and in each encoding this CPU has: the same exact sums
        let vnnis: Vec<Option<Vnni256>> =
            [None].into_iter().chain(vnni256_encodings().into_iter().map(Some)).collect();
        let file_dot = crate::kernels::dot::<1, 1>(dtype, SimdLevel::Avx2);
        let twin = |group: &[u8], q8: &[BlockQ8Act]| match dtype {
            DType::Q4_0 => dot_group_scalar(group, q8, FloatSteps::FmaPerBlock),
            _ => dot_group_mx_scalar(group, q8, FloatSteps::FmaPerBlock),
        };
        cases_of(dtype, |src, m, acts| {
            let (rows, cols, n) = (m.rows, m.cols, acts.n);
            let nb = cols / QK;
            let row_bytes = dtype.row_bytes(cols);
            for &vnni in &vnnis {
                let got = collect(rows, n, |put| unsafe {
                    match dtype {
                        DType::Q4_0 => {
                            let x = (&acts.q8[..], &acts.q8_bias[..]);
                            rows_all_tokens_256::<Q4_0Dots256>(vnni, m, 0..rows, x, n, put)
                        }
                        _ => {
                            let x = (&acts.q8[..], &acts.q8_bias[..]);
                            rows_all_tokens_256::<MxDots256>(vnni, m, 0..rows, x, n, put)
                        }
                    }
                });
                for t in 0..n {
                    let q8 = &acts.q8[t * nb..(t + 1) * nb];
                    let twin: Vec<f32> =
                        (0..rows / 16).flat_map(|g| twin(m.group(g), q8)).collect();
                    for r in 0..rows {
                        let row = &src[r * row_bytes..(r + 1) * row_bytes];
                        let f = unsafe { file_dot([row], [acts.token(t)], &[]) }[0][0];
                        let (g, s) = (got[t * rows + r], twin[r]);
                        let at =
                            format!("{dtype:?} {vnni:?} {rows}x{cols} n {n} token {t} row {r}");
                        assert_eq!(g.to_bits(), s.to_bits(), "{at}: {g} vs twin {s}");
                        assert_eq!(g.to_bits(), f.to_bits(), "{at}: {g} vs file layout {f}");
                    }
                }
            }
        });
    }

    /// The Q4_K layout at `level` (AVX-512, or AVX2 with each 256-bit VNNI encoding and none)
    /// against the scalar twin, the file layout's scalar dot and its product at this run's level,
    /// bit for bit (the file layout's super-block kernels give the same bits at every level).
    fn q4_k_equals_twin_and_file_layout(level: SimdLevel) {
        let dtype = DType::Q4_K;
        let vnnis: Vec<Option<Vnni256>> = match level {
            SimdLevel::Avx512 => vec![None],
            _ => [None].into_iter().chain(vnni256_encodings().into_iter().map(Some)).collect(),
        };
        cases_of(dtype, |src, m, acts| {
            let (rows, cols, n) = (m.rows, m.cols, acts.n);
            let nb = cols / QK_K;
            let file = crate::matmul::QMatrix { dtype, rows, cols, data: src };
            let mut want = vec![0.0f32; n * rows];
            crate::matmul::matmul(&file, acts, &mut want);
            let row_bytes = dtype.row_bytes(cols);
            for &vnni in &vnnis {
                let got = collect(rows, n, |put| unsafe {
                    match level {
                        SimdLevel::Avx512 => rows_all_tokens_k4(m, 0..rows, &acts.q8k, n, put),
                        _ => rows_all_tokens_256::<Q4KDots256>(vnni, m, 0..rows, &acts.q8k, n, put),
                    }
                });
                for t in 0..n {
                    let q8k = &acts.q8k[t * nb..(t + 1) * nb];
                    let twin: Vec<f32> =
                        (0..rows / 16).flat_map(|g| dot_group_k4_scalar(m.group(g), q8k)).collect();
                    for r in 0..rows {
                        let row = &src[r * row_bytes..(r + 1) * row_bytes];
                        let [d] = crate::quant::q256::dot_scalar(dtype, row, [q8k]);
                        let (g, s, f) = (got[t * rows + r], twin[r], want[t * rows + r]);
                        let at =
                            format!("{level:?} {vnni:?} {rows}x{cols} n {n} token {t} row {r}");
                        assert_eq!(g.to_bits(), s.to_bits(), "{at}: {g} vs twin {s}");
                        assert_eq!(g.to_bits(), d.to_bits(), "{at}: {g} vs file layout's dot {d}");
                        assert_eq!(g.to_bits(), f.to_bits(), "{at}: {g} vs file layout {f}");
                    }
                }
            }
        });
    }

    #[test]
    fn q4_k_avx512_groups_equal_the_scalar_twin_and_the_file_layouts_products_bit_for_bit() {
        if simd_level() != SimdLevel::Avx512 {
            eprintln!("skipped: needs AVX-512 VNNI (this run's level: {:?})", simd_level());
            return;
        }
        q4_k_equals_twin_and_file_layout(SimdLevel::Avx512);
    }

    #[test]
    fn q4_k_avx2_groups_equal_the_scalar_twin_and_the_file_layouts_products_bit_for_bit() {
        if !simd_level().has_avx2() {
            eprintln!("skipped: needs AVX2 (this run's level: {:?})", simd_level());
            return;
        }
        q4_k_equals_twin_and_file_layout(SimdLevel::Avx2);
    }
}
