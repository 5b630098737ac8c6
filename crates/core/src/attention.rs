//! Attention of one query head over the KV cache: scores, softmax, weighted sum of values.
//! One call covers every cached position, so the SIMD loops run long and the per-position cost is
//! a handful of instructions (a call per position would cost more than the arithmetic).

use crate::matmul::{simd_level, SimdLevel};

/// scores[j] = scale * dot(q, cache[j * stride + offset ..][..q.len()]).
pub fn scores_scalar(q: &[f32], cache: &[f32], stride: usize, offset: usize, scale: f32, scores: &mut [f32]) {
    for (j, s) in scores.iter_mut().enumerate() {
        let k = &cache[j * stride + offset..j * stride + offset + q.len()];
        *s = q.iter().zip(k).map(|(a, b)| a * b).sum::<f32>() * scale;
    }
}

/// out = sum_j weights[j] * cache[j * stride + offset ..][..out.len()].
pub fn weighted_sum_scalar(weights: &[f32], cache: &[f32], stride: usize, offset: usize, out: &mut [f32]) {
    out.fill(0.0);
    let hd = out.len();
    for (j, &w) in weights.iter().enumerate() {
        let v = &cache[j * stride + offset..j * stride + offset + hd];
        out.iter_mut().zip(v).for_each(|(o, x)| *o += w * x);
    }
}

/// Causal attention of one head: `q` against the first `scores.len()` cached positions.
/// `scores` is scratch of the right length; the result goes to `out` (head_dim).
pub fn attend(q: &[f32], k_cache: &[f32], v_cache: &[f32], stride: usize, offset: usize, scale: f32, scores: &mut [f32], out: &mut [f32]) {
    let fast = simd_level() == SimdLevel::Avx2 && q.len() % 8 == 0;
    #[cfg(target_arch = "x86_64")]
    if fast {
        // SAFETY: Avx2 is only reported when the CPU has avx2, fma and f16c; the head size is a
        // multiple of 8 and the cache holds every row the loops touch (asserted by the callers'
        // slicing in debug builds).
        unsafe { crate::avx2::attn_scores(q, k_cache, stride, offset, scale, scores) };
    }
    if !fast {
        scores_scalar(q, k_cache, stride, offset, scale, scores);
    }
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for s in scores.iter_mut() {
        *s = (*s - max).exp();
        sum += *s;
    }
    let inv = 1.0 / sum;
    scores.iter_mut().for_each(|s| *s *= inv);
    #[cfg(target_arch = "x86_64")]
    if fast {
        // SAFETY: as above.
        unsafe { crate::avx2::attn_weighted_sum(scores, v_cache, stride, offset, out) };
    }
    if !fast {
        weighted_sum_scalar(scores, v_cache, stride, offset, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_attention_kernels_match_scalar() {
        if simd_level() != SimdLevel::Avx2 {
            return;
        }
        let mut rng = crate::sampler::Rng::new(5);
        for hd in [8, 24, 64, 128, 80] {
            let (n, stride, offset) = (37, hd * 3, hd);
            let cache: Vec<f32> = (0..n * stride).map(|_| rng.next_f32() - 0.5).collect();
            let q: Vec<f32> = (0..hd).map(|_| rng.next_f32() - 0.5).collect();
            let (mut a, mut b) = (vec![0.0; n], vec![0.0; n]);
            scores_scalar(&q, &cache, stride, offset, 0.3, &mut a);
            unsafe { crate::avx2::attn_scores(&q, &cache, stride, offset, 0.3, &mut b) };
            for (x, y) in a.iter().zip(&b) {
                assert!((x - y).abs() < 1e-5, "hd {hd}: {x} vs {y}");
            }
            let (mut o1, mut o2) = (vec![0.0; hd], vec![1.0; hd]);
            weighted_sum_scalar(&a, &cache, stride, offset, &mut o1);
            unsafe { crate::avx2::attn_weighted_sum(&a, &cache, stride, offset, &mut o2) };
            for (x, y) in o1.iter().zip(&o2) {
                assert!((x - y).abs() < 1e-5, "hd {hd}: {x} vs {y}");
            }
        }
    }

    #[test]
    fn attend_is_softmax_weighted_values() {
        // Two positions, one dimension pair: hand-computed softmax.
        let q = [1.0f32, 0.0];
        let k = [0.0f32, 0.0, 2.0, 0.0];
        let v = [1.0f32, 0.0, 0.0, 1.0];
        let mut scores = [0.0; 2];
        let mut out = [0.0; 2];
        attend(&q, &k, &v, 2, 0, 1.0, &mut scores, &mut out);
        let (e0, e1) = (1.0f32, 2.0f32.exp());
        assert!((out[0] - e0 / (e0 + e1)).abs() < 1e-6);
        assert!((out[1] - e1 / (e0 + e1)).abs() < 1e-6);
    }
}
