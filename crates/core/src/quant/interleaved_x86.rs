//! The AVX-512 VNNI products of interleaved Q4_0 matrices (`quant::interleaved`; its
//! `dot_group_scalar` is the twin).
//!
//! Prototyped against the file's layout on the 2-core AMD EPYC (Zen 4), one token, medians of
//! one-second rounds: from L2 on one thread 29 -> 42 GB/s of weights; the Qwen3-30B-A3B
//! expert's 768 x 2048 and 2048 x 768 products, 400 copies from DRAM on two threads, 15-18 ->
//! 30-34 GB/s.

#![allow(clippy::missing_safety_doc)]

use std::arch::x86_64::*;

use super::interleaved::{group_bytes, Interleaved, GROUP_ROWS, STEP_BLOCKS, STEP_BYTES};
use super::ActQuad;
use crate::avx2::PrefetchL2;

/// The sixteen rows of `group` (one group of an interleaved matrix) against N tokens'
/// activations (`Activations::quads`: cols / 128 each), `next` (the bytes read after these)
/// prefetched into L2 over the steps. out[t][r] = row r . token t, as `dot_group_scalar`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn dot_group<const N: usize>(
    group: &[u8],
    x: [&[ActQuad]; N],
    next: &[u8],
) -> [[f32; GROUP_ROWS]; N] {
    let steps = group.len() / STEP_BYTES;
    debug_assert!(group.len() == steps * STEP_BYTES && x.iter().all(|x| x.len() == steps));
    let nibble = _mm512_set1_epi8(0x0F);
    let mut acc = [_mm512_setzero_ps(); N];
    let next = [next];
    let mut prefetch = PrefetchL2::new(&next, steps);
    for s in 0..steps {
        prefetch.step();
        let step = group.as_ptr().add(s * STEP_BYTES);
        let q: [&ActQuad; N] = std::array::from_fn(|t| x[t].get_unchecked(s));
        // per token: (p_0 + p_1), then (p_2 + p_3)
        let mut pair = [[_mm512_setzero_ps(); 2]; N];
        for c in 0..STEP_BLOCKS {
            // the sixteen rows' block c: four chunks of four bytes per row, low and high nibbles
            let mut lo = [_mm512_setzero_si512(); 4];
            let mut hi = [_mm512_setzero_si512(); 4];
            for k in 0..4 {
                let w = _mm512_loadu_si512(step.add(64 * (4 * c + k)) as *const _);
                lo[k] = _mm512_and_si512(w, nibble);
                hi[k] = _mm512_and_si512(_mm512_srli_epi16::<4>(w), nibble);
            }
            let d = _mm512_cvtph_ps(_mm256_loadu_si256(step.add(1024 + 32 * c) as *const _));
            for t in 0..N {
                let a = q[t];
                // sum(q * x) - 8 * sum(x): the activations' lane biases of block c, summed
                let bias =
                    a.bias[4 * c] + a.bias[4 * c + 1] + a.bias[4 * c + 2] + a.bias[4 * c + 3];
                let mut sum = _mm512_set1_epi32(bias);
                let four = |bytes: &[i8; 64], k: usize| {
                    _mm512_set1_epi32(
                        (bytes.as_ptr().add(16 * c + 4 * k) as *const i32).read_unaligned(),
                    )
                };
                for k in 0..4 {
                    sum = _mm512_dpbusd_epi32(sum, lo[k], four(&a.lo, k));
                    sum = _mm512_dpbusd_epi32(sum, hi[k], four(&a.hi, k));
                }
                let dd = _mm512_mul_ps(d, _mm512_set1_ps(a.d[4 * c]));
                let p = _mm512_mul_ps(_mm512_cvtepi32_ps(sum), dd);
                pair[t][c / 2] = match c % 2 {
                    0 => p,
                    _ => _mm512_add_ps(pair[t][c / 2], p),
                };
            }
        }
        for t in 0..N {
            acc[t] = _mm512_add_ps(acc[t], _mm512_add_ps(pair[t][0], pair[t][1]));
        }
    }
    let mut out = [[0.0f32; GROUP_ROWS]; N];
    for t in 0..N {
        _mm512_storeu_ps(out[t].as_mut_ptr(), acc[t]);
    }
    out
}

/// Rows `rows` (multiples of 16) of `w` against the n tokens of `quads` (n * cols / 128):
/// put(token, first row, its sixteen values), four tokens per pass over a group, then two,
/// then one; each call prefetches the next group (up to `rows.end`).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn rows_all_tokens(
    w: &Interleaved,
    rows: std::ops::Range<usize>,
    quads: &[ActQuad],
    n: usize,
    put: impl Fn(usize, usize, &[f32]),
) {
    let per_token = quads.len() / n.max(1);
    let token = |t: usize| &quads[t * per_token..(t + 1) * per_token];
    let (g0, g1) = (rows.start / GROUP_ROWS, rows.end / GROUP_ROWS);
    let gb = group_bytes(w.cols);
    for g in g0..g1 {
        let group = w.group(g);
        let next = match g + 1 < g1 {
            true => &w.data[(g + 1) * gb..(g + 2) * gb],
            false => &[][..],
        };
        let r = g * GROUP_ROWS;
        let mut t = 0;
        while t + 4 <= n {
            let v =
                dot_group::<4>(group, [token(t), token(t + 1), token(t + 2), token(t + 3)], next);
            v.iter().enumerate().for_each(|(k, v)| put(t + k, r, v));
            t += 4;
        }
        if t + 2 <= n {
            let v = dot_group::<2>(group, [token(t), token(t + 1)], next);
            v.iter().enumerate().for_each(|(k, v)| put(t + k, r, v));
            t += 2;
        }
        if t < n {
            put(t, r, &dot_group::<1>(group, [token(t)], next)[0]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::matmul::Activations;
    use crate::quant::interleaved::{dot_group_scalar, interleave};
    use crate::quant::{quantize_row, DType, QK};
    use crate::sampler::Rng;
    use crate::simd::{simd_level, SimdLevel};

    fn random(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = Rng::new(seed);
        (0..n).map(|_| rng.next_f32() * 2.0 - 1.0).collect()
    }

    #[test]
    fn groups_equal_the_scalar_twin_and_the_file_layouts_kernel_bit_for_bit() {
        if simd_level() != SimdLevel::Avx512 {
            eprintln!("skipped: needs AVX-512 VNNI (this run's level: {:?})", simd_level());
            return;
        }
        for (rows, cols) in [(16, 128), (32, 512), (48, 768), (16, 2048)] {
            let mut w = random(rows * cols, rows as u64);
            // extremes: a row of the largest magnitudes, one of zeros
            w[..cols].iter_mut().for_each(|v| *v = if *v > 0.0 { 1.0 } else { -1.0 });
            w[cols..2 * cols].fill(0.0);
            let src: Vec<u8> = w.chunks(cols).flat_map(|r| quantize_row(DType::Q4_0, r)).collect();
            let mut packed = vec![0u8; src.len()];
            interleave(&src, rows, cols, &mut packed);
            let m = Interleaved::new(rows, cols, &packed);
            for n in 1..=7 {
                let mut x = random(n * cols, 100 + n as u64);
                x[..cols.min(64)].iter_mut().for_each(|v| *v *= 1e3);
                let mut acts = Activations::default();
                acts.set(&x, n, cols);
                let got = std::cell::RefCell::new(vec![0.0f32; n * rows]);
                unsafe {
                    rows_all_tokens(&m, 0..rows, &acts.quads, n, |t, r, v| {
                        got.borrow_mut()[t * rows + r..t * rows + r + 16].copy_from_slice(v)
                    })
                };
                let got = got.into_inner();
                let file = crate::matmul::QMatrix { dtype: DType::Q4_0, rows, cols, data: &src };
                let mut want = vec![0.0f32; n * rows];
                crate::matmul::matmul(&file, &acts, &mut want);
                let nb = cols / QK;
                for t in 0..n {
                    let twin: Vec<f32> = (0..rows / 16)
                        .flat_map(|g| dot_group_scalar(m.group(g), &acts.q8[t * nb..(t + 1) * nb]))
                        .collect();
                    for r in 0..rows {
                        let (g, s, f) = (got[t * rows + r], twin[r], want[t * rows + r]);
                        assert_eq!(
                            g.to_bits(),
                            s.to_bits(),
                            "{rows}x{cols} n {n} token {t} row {r}: {g} vs twin {s}"
                        );
                        assert_eq!(
                            g.to_bits(),
                            f.to_bits(),
                            "{rows}x{cols} n {n} token {t} row {r}: {g} vs file layout {f}"
                        );
                    }
                }
            }
        }
    }
}
