//! Prefill products of quantized weights on AVX2 without VNNI (the AVX-512 panels are in
//! `panel`): a weight row is decoded once per product into `WeightChunk`s, then dotted with the
//! prompt's tokens four at a time. The one-token AVX2 kernels (`avx2::dot_q4_0`, `dot_q4_1`,
//! `dot_q8_0` and `chunked_avx2::dot`) decode a row once per four tokens, which for Q5_0 and the
//! k-quants costs about a third of the product.
//!
//! Per token and chunk the arithmetic is theirs, step for step: the same unsigned operand of
//! `vpmaddubsw` and the same sign moves, the same float steps in the same order, the same
//! per-chunk minimum accumulator and the same final sum. So a token's dot is bit for bit the
//! same in a prompt as alone or in a small batch (the tests check it for every format), and the
//! scalar twins of those kernels are this module's too. The activations are `Activations::q8`,
//! as those kernels read them: a prompt needs no second copy.

#![allow(clippy::missing_safety_doc)]

use std::arch::x86_64::*;

use super::chunked_avx2 as c2;
use super::{cast_blocks, BlockQ4_0, BlockQ4_1, BlockQ8Act, BlockQ8_0, DType, QK};
use super::f16_to_f32;
use super::superblock_avx2::transpose_chunk;
use super::chunked::{BlockIQ4NL, BlockQ5_0, BlockQ5_1};
use crate::avx2::{hsum, splat_f16, LegacyBlock, PrefetchRows};

/// One 32-weight chunk of a row, decoded.
#[repr(C, align(32))]
#[derive(Clone, Copy)]
pub struct WeightChunk {
    /// The unsigned operand of `vpmaddubsw`: |v| in formats with negative weights, else v.
    u: [u8; 32],
    /// The weights v; in signed formats their signs move onto the activations (`vpsignb`).
    v: [i8; 32],
    /// The halves' scales, [s0 x 4, s1 x 4].
    scale: [f32; 8],
    /// The factor of the activations' scaled sum in the per-chunk minimum term (every lane).
    min: [f32; 8],
    /// Q2_K: the halves' minima, [m0 x 4, m1 x 4].
    min_halves: [f32; 8],
}
const _: () = assert!(std::mem::size_of::<WeightChunk>() == 160);

impl Default for WeightChunk {
    fn default() -> Self {
        WeightChunk { u: [0; 32], v: [0; 32], scale: [0.0; 8], min: [0.0; 8], min_halves: [0.0; 8] }
    }
}

/// How each format's one-token kernel computes: whether its weights can be negative, the factor
/// its per-chunk minimum accumulator enters the result with (None: it has none), and whether it
/// has per-half minima (Q2_K).
const fn form(dtype: DType) -> (bool, Option<f32>, bool) {
    match dtype {
        DType::Q4_1 => (false, Some(1.0), false),
        // the chunked decoders store the minima of Q5_1, Q4_K and Q5_K as subtrahends
        DType::Q5_1 | DType::Q4_K | DType::Q5_K => (false, Some(-1.0), false),
        DType::Q2_K => (false, None, true),
        _ => (true, None, false),
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn store(out: &mut WeightChunk, v: __m256i, signed: bool, scale: __m256, min: __m256, min_halves: __m256) {
    let u = if signed { _mm256_sign_epi8(v, v) } else { v };
    _mm256_store_si256(out.u.as_mut_ptr() as *mut __m256i, u);
    _mm256_store_si256(out.v.as_mut_ptr() as *mut __m256i, v);
    _mm256_store_ps(out.scale.as_mut_ptr(), scale);
    _mm256_store_ps(out.min.as_mut_ptr(), min);
    _mm256_store_ps(out.min_halves.as_mut_ptr(), min_halves);
}

/// Decodes a row of `cols` weights of `dtype` (any quantized type but Q4_0, Q5_0 and Q4_1, whose
/// prompts go in row groups, `legacy_rows_all_tokens`) into `out[..cols / 32]`, as the
/// format's one-token kernel decodes it.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn unpack_row(dtype: DType, row: &[u8], cols: usize, out: &mut [WeightChunk]) {
    let nb = cols / QK;
    let out = &mut out[..nb];
    let zero = _mm256_setzero_ps();
    match dtype {
        DType::Q8_0 => {
            for (o, b) in out.iter_mut().zip(cast_blocks::<BlockQ8_0>(row)) {
                store(o, _mm256_loadu_si256(b.qs.as_ptr() as *const __m256i), true, splat_f16(b.d), zero, zero);
            }
        }
        _ => {
            let signed = form(dtype).0;
            macro_rules! each_chunk {
                ($decode:path, $dtype:expr) => {{
                    const PER_BLOCK: usize = c2::chunks_per_block($dtype);
                    for (k, o) in out.iter_mut().enumerate() {
                        let ch = $decode(row, k / PER_BLOCK, k % PER_BLOCK);
                        store(o, ch.v, signed, ch.scale, ch.min, ch.min_halves);
                    }
                }};
            }
            c2::with_decoder!(dtype, each_chunk);
        }
    }
}

/// An unpacked row against T tokens' activation blocks: `chunked_avx2::token_step` per chunk and token.
/// `SIGNED`: move the weights' signs onto the activations; `MIN`: a per-chunk minimum term, which
/// enters the result times `coef`; `HALVES`: per-half minima (Q2_K).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn block<const SIGNED: bool, const MIN: bool, const HALVES: bool, const T: usize>(w: &[WeightChunk], a: [&[BlockQ8Act]; T], coef: f32) -> [f32; T] {
    let mut acc = [_mm256_setzero_ps(); T];
    let mut mins = [_mm256_setzero_ps(); T];
    for (j, c) in w.iter().enumerate() {
        let u = _mm256_load_si256(c.u.as_ptr() as *const __m256i);
        let v = _mm256_load_si256(c.v.as_ptr() as *const __m256i);
        let (scale, min, min_halves) = (_mm256_load_ps(c.scale.as_ptr()), _mm256_load_ps(c.min.as_ptr()), _mm256_load_ps(c.min_halves.as_ptr()));
        for t in 0..T {
            c2::token_step::<SIGNED, MIN, HALVES>(u, v, scale, min, min_halves, a[t].get_unchecked(j), &mut acc[t], &mut mins[t]);
        }
    }
    let mut out = [0.0f32; T];
    for t in 0..T {
        // (every lane of mins holds the sum)
        out[t] = if MIN { hsum(acc[t]) + coef * _mm256_cvtss_f32(mins[t]) } else { hsum(acc[t]) };
    }
    out
}

/// Eight rows' block of a `LegacyBlock` format for a prompt, rows across the lanes (as
/// `superblock_avx2::RowGroupBlock`): step k holds weights 4k..4k + 4 of each row, row r's
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

/// Decodes up to eight rows of a `LegacyBlock` format into `out`, a `LegacyGroup` per block;
/// lanes past them are zero (no weights, no scales).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn unpack_legacy_group<B: LegacyBlock>(rows: &[&[u8]], out: &mut [LegacyGroup]) {
    if rows.len() < 8 {
        out.fill(LegacyGroup::default());
    }
    let (mut staged_u, mut staged_v) = ([[0u32; 8]; 8], [[0u32; 8]; 8]);
    for (b, o) in out.iter_mut().enumerate() {
        for (r, row) in rows.iter().enumerate() {
            let blk = cast_blocks::<B>(row).get_unchecked(b);
            let v = blk.weights();
            if B::MIN {
                _mm256_storeu_si256(staged_u[r].as_mut_ptr() as *mut __m256i, v);
                o.m[r] = f16_to_f32(blk.min_bits());
            } else {
                _mm256_storeu_si256(staged_v[r].as_mut_ptr() as *mut __m256i, v);
                _mm256_storeu_si256(staged_u[r].as_mut_ptr() as *mut __m256i, _mm256_sign_epi8(v, v));
            }
            o.d[r] = f16_to_f32(blk.scale_bits());
        }
        transpose_chunk::<8>(&staged_u, &mut o.u);
        if !B::MIN {
            transpose_chunk::<8>(&staged_v, &mut o.v);
        }
    }
}

/// A block's float steps per lane from its exact 32-bit sums (`legacy_group_dot` and its
/// AVX-VNNI twin): acc = fma(sum, d * d_a, acc), and for Q4_1 min = fma(m, s_a, min).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn legacy_block_end<B: LegacyBlock, const T: usize>(x: &LegacyGroup, a: [&[BlockQ8Act]; T], b: usize, sums: &[__m256i; T], acc: &mut [__m256; T], mins: &mut [__m256; T]) {
    let d = _mm256_load_ps(x.d.as_ptr());
    for t in 0..T {
        let ab = a[t].get_unchecked(b);
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[t]), _mm256_mul_ps(d, _mm256_set1_ps(ab.d)), acc[t]);
        if B::MIN {
            mins[t] = _mm256_fmadd_ps(_mm256_load_ps(x.m.as_ptr()), _mm256_set1_ps(ab.s), mins[t]);
        }
    }
}

/// Each token's lanes: acc (+ min for Q4_1).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn legacy_result<B: LegacyBlock, const T: usize>(acc: &[__m256; T], mins: &[__m256; T]) -> [[f32; 8]; T] {
    let mut out = [[0.0f32; 8]; T];
    for t in 0..T {
        _mm256_storeu_ps(out[t].as_mut_ptr(), if B::MIN { _mm256_add_ps(acc[t], mins[t]) } else { acc[t] });
    }
    out
}

/// A group of eight rows of a `LegacyBlock` format against T tokens: lane r is row r's dot, bit
/// for bit `avx2::dot_legacy`'s: the same exact integer sum per block, the same float steps per
/// lane.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn legacy_group_dot<B: LegacyBlock, const T: usize>(g: &[LegacyGroup], a: [&[BlockQ8Act]; T]) -> [[f32; 8]; T] {
    let (mut acc, mut mins) = ([_mm256_setzero_ps(); T], [_mm256_setzero_ps(); T]);
    let ones = _mm256_set1_epi16(1);
    let word = |p: *const i8| (p as *const i32).read_unaligned();
    for (b, x) in g.iter().enumerate() {
        // pair sums of |v| * a <= 2 * 16 * 127 (Q4_1's q * a <= 2 * 15 * 127): a block's eight steps
        // sum in 16 bits (`LegacyBlock::WIDE`: |v| <= 127 or q <= 31, pairs widen to 32 bits at
        // each step)
        let mut sums = [_mm256_setzero_si256(); T];
        for k in 0..8 {
            let u = _mm256_load_si256(x.u[k].as_ptr() as *const __m256i);
            let v = _mm256_load_si256(x.v[k].as_ptr() as *const __m256i);
            for t in 0..T {
                let act = _mm256_set1_epi32(word(a[t].get_unchecked(b).qs.as_ptr().add(4 * k)));
                let act = if B::MIN { act } else { _mm256_sign_epi8(act, v) };
                let pairs = _mm256_maddubs_epi16(u, act);
                sums[t] = if B::WIDE { _mm256_add_epi32(sums[t], _mm256_madd_epi16(pairs, ones)) } else { _mm256_add_epi16(sums[t], pairs) };
            }
        }
        if !B::WIDE {
            for t in 0..T {
                sums[t] = _mm256_madd_epi16(sums[t], ones);
            }
        }
        legacy_block_end::<B, T>(x, a, b, &sums, &mut acc, &mut mins);
    }
    legacy_result::<B, T>(&acc, &mins)
}

/// `legacy_group_dot` with AVX-VNNI: `vpdpbusd` sums each step into 32 bits; the same exact
/// sums, the same float steps.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
unsafe fn legacy_group_dot_vnni<B: LegacyBlock, const T: usize>(g: &[LegacyGroup], a: [&[BlockQ8Act]; T]) -> [[f32; 8]; T] {
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
                sums[t] = _mm256_dpbusd_avx_epi32(sums[t], u, act);
            }
        }
        legacy_block_end::<B, T>(x, a, b, &sums, &mut acc, &mut mins);
    }
    legacy_result::<B, T>(&acc, &mins)
}

/// Whether a type's AVX2 prompts go in row groups (`legacy_rows_all_tokens`) rather than
/// panels.
pub fn groups_rows(dtype: DType) -> bool {
    matches!(dtype, DType::Q4_0 | DType::Q4_1 | DType::Q5_0 | DType::Q5_1 | DType::Q8_0 | DType::IQ4_NL)
}

/// A prompt's product with Q4_0, Q5_0 or Q4_1 rows in groups of eight (`LegacyGroup`), each group
/// decoded once for all tokens, four tokens per step: `rows` of a weight matrix (`row(r)` its
/// bytes, `cols` wide) against `n` tokens' activation blocks (`q8`: n * cols / 32), put(t, r,
/// values of rows r, r + 1, ..); `vnni`: with AVX-VNNI (only where the CPU has it).
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn legacy_rows_all_tokens<'a>(dtype: DType, row: impl Fn(usize) -> &'a [u8], cols: usize, rows: std::ops::Range<usize>, q8: &[BlockQ8Act], n: usize, vnni: bool, put: impl Fn(usize, usize, &[f32])) {
    match dtype {
        DType::Q4_0 => legacy_rows::<BlockQ4_0>(row, cols, rows, q8, n, vnni, put),
        DType::Q4_1 => legacy_rows::<BlockQ4_1>(row, cols, rows, q8, n, vnni, put),
        DType::Q5_0 => legacy_rows::<BlockQ5_0>(row, cols, rows, q8, n, vnni, put),
        DType::Q5_1 => legacy_rows::<BlockQ5_1>(row, cols, rows, q8, n, vnni, put),
        DType::Q8_0 => legacy_rows::<BlockQ8_0>(row, cols, rows, q8, n, vnni, put),
        DType::IQ4_NL => legacy_rows::<BlockIQ4NL>(row, cols, rows, q8, n, vnni, put),
        _ => unreachable!("{} has no row groups", dtype.name()),
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn legacy_rows<'a, B: LegacyBlock>(row: impl Fn(usize) -> &'a [u8], cols: usize, rows: std::ops::Range<usize>, q8: &[BlockQ8Act], n: usize, vnni: bool, put: impl Fn(usize, usize, &[f32])) {
    let nb = cols / QK;
    assert_eq!(q8.len(), n * nb, "activations: wrong size for {n} tokens of {cols}");
    let token = |t: usize| &q8[t * nb..(t + 1) * nb];
    let mut group = vec![LegacyGroup::default(); nb];
    let mut r0 = rows.start;
    while r0 < rows.end {
        let r1 = (r0 + 8).min(rows.end);
        let mut bytes: [&[u8]; 8] = [&[]; 8];
        for r in r0..r1 {
            bytes[r - r0] = row(r);
        }
        unpack_legacy_group::<B>(&bytes[..r1 - r0], &mut group);
        let mut prefetch = PrefetchRows::<8>::new((r1..(r1 + 8).min(rows.end)).map(&row), n / 4 + n % 4);
        let mut t = 0;
        while t + 4 <= n {
            prefetch.step();
            let four = [token(t), token(t + 1), token(t + 2), token(t + 3)];
            let dots = if vnni { legacy_group_dot_vnni::<B, 4>(&group, four) } else { legacy_group_dot::<B, 4>(&group, four) };
            for (k, lanes) in dots.iter().enumerate() {
                put(t + k, r0, &lanes[..r1 - r0]);
            }
            t += 4;
        }
        for t in t..n {
            prefetch.step();
            let one = if vnni { legacy_group_dot_vnni::<B, 1>(&group, [token(t)]) } else { legacy_group_dot::<B, 1>(&group, [token(t)]) };
            put(t, r0, &one[0][..r1 - r0]);
        }
        r0 = r1;
    }
}

/// Tokens per step: each unpacked chunk is reused for T tokens (with the minimum accumulators,
/// 2T + 5 of the 16 vector registers).
const T: usize = 4;

/// `$then!(SIGNED, MIN, HALVES)` with `dtype`'s form.
macro_rules! with_form {
    ($dtype:expr, $then:ident) => {
        match form($dtype) {
            (true, _, _) => $then!(true, false, false),
            (false, Some(_), _) => $then!(false, true, false),
            (false, None, true) => $then!(false, false, true),
            (false, None, false) => $then!(false, false, false),
        }
    };
}

/// Rows `rows` of a weight matrix (`row(r)` its bytes, `cols` wide) against `n` tokens'
/// activation blocks (`q8`: n * cols / 32): put(t, r, value).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn rows_all_tokens<'a>(
    dtype: DType,
    row: impl Fn(usize) -> &'a [u8],
    cols: usize,
    rows: std::ops::Range<usize>,
    q8: &[BlockQ8Act],
    n: usize,
    put: impl Fn(usize, usize, f32),
) {
    let nb = cols / QK;
    assert_eq!(q8.len(), n * nb, "activations: wrong size for {n} tokens of {cols}");
    let coef = form(dtype).1.unwrap_or(0.0);
    let token = |t: usize| &q8[t * nb..(t + 1) * nb];
    let mut unpacked = vec![WeightChunk::default(); nb];
    macro_rules! with {
        ($signed:expr, $min:expr, $halves:expr) => {{
            for r in rows {
                unpack_row(dtype, row(r), cols, &mut unpacked);
                let mut t = 0;
                while t + T <= n {
                    let v = block::<$signed, $min, $halves, T>(&unpacked, [token(t), token(t + 1), token(t + 2), token(t + 3)], coef);
                    v.iter().enumerate().for_each(|(k, &x)| put(t + k, r, x));
                    t += T;
                }
                for t in t..n {
                    put(t, r, block::<$signed, $min, $halves, 1>(&unpacked, [token(t)], coef)[0]);
                }
            }
        }};
    }
    with_form!(dtype, with);
}

/// One row (`row`, `cols` wide) against the listed tokens' activation blocks: put(t, value).
/// `unpacked` is scratch (reused across calls).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn row_tokens(dtype: DType, row: &[u8], cols: usize, q8: &[BlockQ8Act], tokens: &[usize], unpacked: &mut Vec<WeightChunk>, mut put: impl FnMut(usize, f32)) {
    let nb = cols / QK;
    unpacked.resize(nb, WeightChunk::default());
    unpack_row(dtype, row, cols, unpacked);
    let (w, coef) = (&unpacked[..nb], form(dtype).1.unwrap_or(0.0));
    let token = |t: usize| &q8[t * nb..(t + 1) * nb];
    macro_rules! with {
        ($signed:expr, $min:expr, $halves:expr) => {{
            let mut g = tokens.chunks_exact(T);
            for q in &mut g {
                let v = block::<$signed, $min, $halves, T>(w, [token(q[0]), token(q[1]), token(q[2]), token(q[3])], coef);
                q.iter().zip(v).for_each(|(&t, vt)| put(t, vt));
            }
            for &t in g.remainder() {
                put(t, block::<$signed, $min, $halves, 1>(w, [token(t)], coef)[0]);
            }
        }};
    }
    with_form!(dtype, with);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::matmul::{dot_row, Activations, QMatrix, SimdLevel};
    use crate::quant::tests::{random_quantized_row, random_vec, QUANTIZED};

    /// Every quantized type, through the AVX2 panels, gives bit for bit the AVX2 one-token
    /// kernels' dots (which are tested against the scalar twins), for whole and partial steps of
    /// tokens, through both entry points.
    #[test]
    fn panels_equal_one_token_kernels_bit_for_bit() {
        if !crate::matmul::detect().has_avx2() {
            eprintln!("skipping: no AVX2 on this CPU");
            return;
        }
        for (s, dtype) in QUANTIZED.into_iter().enumerate() {
            if crate::quant::superblock::is_superblock(dtype) {
                // read per super-block at this level (`superblock_avx2`), not through panels
                continue;
            }
            for cols in [96, 256, 576, 1536] {
                if cols % dtype.block_len() != 0 {
                    continue;
                }
                let (rows, n) = (5, 11);
                let data: Vec<u8> = (0..rows).flat_map(|r| random_quantized_row(dtype, cols, (100 * s + r) as u64)).collect();
                let w = QMatrix { dtype, rows, cols, data: &data };
                let mut x = Activations::default();
                x.set(&random_vec(n * cols, 5 + s as u64), n, cols);
                let mut got = vec![f32::NAN; n * rows];
                let cell = std::cell::RefCell::new(&mut got);
                // SAFETY: AVX2 checked above
                unsafe {
                    if groups_rows(dtype) {
                        legacy_rows_all_tokens(dtype, |r| w.row(r), cols, 1..rows, &x.q8, n, false, |t, r, v| cell.borrow_mut()[t * rows + r..][..v.len()].copy_from_slice(v));
                        if is_x86_feature_detected!("avxvnni") {
                            // with AVX-VNNI: the same values
                            let vnni = std::cell::RefCell::new(vec![f32::NAN; n * rows]);
                            legacy_rows_all_tokens(dtype, |r| w.row(r), cols, 1..rows, &x.q8, n, true, |t, r, v| vnni.borrow_mut()[t * rows + r..][..v.len()].copy_from_slice(v));
                            let same = vnni.borrow().iter().zip(cell.borrow().iter()).all(|(a, b)| a.to_bits() == b.to_bits());
                            assert!(same, "{dtype:?} cols {cols}: AVX-VNNI groups differ from AVX2 ones");
                        }
                    } else {
                        rows_all_tokens(dtype, |r| w.row(r), cols, 1..rows, &x.q8, n, |t, r, v| cell.borrow_mut()[t * rows + r] = v);
                    }
                }
                let tokens = [0, 2, 3, 5, 6, 9, 10];
                let mut picked = vec![f32::NAN; n];
                let mut scratch = Vec::new();
                if !groups_rows(dtype) {
                    // SAFETY: as above
                    unsafe { row_tokens(dtype, w.row(3), cols, &x.q8, &tokens, &mut scratch, |t, v| picked[t] = v) };
                } else {
                    // (the one-token kernels serve a row's selected tokens)
                    tokens.iter().for_each(|&t| picked[t] = dot_row(&w, 3, None, &x, [t], SimdLevel::Avx2)[0]);
                }
                for t in 0..n {
                    for r in 0..rows {
                        let v = got[t * rows + r];
                        if r == 0 {
                            assert!(v.is_nan(), "{dtype:?}: row 0 was not asked for");
                            continue;
                        }
                        let alone = dot_row(&w, r, None, &x, [t], SimdLevel::Avx2)[0];
                        assert_eq!(v.to_bits(), alone.to_bits(), "{dtype:?} cols {cols} row {r} token {t}: {v} vs {alone}");
                    }
                    let want = if tokens.contains(&t) { got[t * rows + 3].to_bits() } else { f32::NAN.to_bits() };
                    assert_eq!(picked[t].to_bits(), want, "{dtype:?} cols {cols} token {t}: picked");
                }
            }
        }
    }
}
