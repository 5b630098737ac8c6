//! The KV cache and attention of one query head over it: scores, softmax, weighted sum of values.
//! One call covers every cached position, so the SIMD loops run long and the per-position cost is
//! a handful of instructions (a call per position would cost more than the arithmetic).
//!
//! The cache stores f16 by default (half the memory traffic of f32, as llama.cpp does) or f32
//! (bit-for-bit the values the projections produced).

use crate::error::{Error, Result};
use crate::matmul::{simd_level, SimdLevel};
use crate::quant::{f16_to_f32, f32_to_f16};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvType {
    F32,
    F16,
}

impl KvType {
    pub fn parse(s: &str) -> Result<KvType> {
        match s {
            "f32" => Ok(KvType::F32),
            "f16" => Ok(KvType::F16),
            _ => Err(Error::InvalidArgument(format!("KV cache type must be 'f16' or 'f32', got '{s}'"))),
        }
    }
}

/// One layer's keys or values: (n_ctx, kv_dim) elements.
pub enum KvBuf {
    F32(Vec<f32>),
    F16(Vec<u16>),
}

/// A read-only view of the first rows of a `KvBuf`.
#[derive(Clone, Copy)]
pub enum KvView<'a> {
    F32(&'a [f32]),
    F16(&'a [u16]),
}

/// A zero-filled vector, or an error when the memory cannot be had (a plain `vec!` would abort
/// the process). Zeroed allocations are mapped lazily by the OS: an unused context costs nothing.
fn zeroed<T: Copy>(n: usize) -> Result<Vec<T>> {
    let too_big = || Error::InvalidArgument(format!(
        "cannot allocate a KV cache of {n} elements ({:.1} GiB): use a smaller context",
        n as f64 * std::mem::size_of::<T>() as f64 / (1u64 << 30) as f64
    ));
    if n == 0 {
        return Ok(Vec::new());
    }
    let layout = std::alloc::Layout::array::<T>(n).map_err(|_| too_big())?;
    // SAFETY: the layout has non-zero size; T is f32 or u16, for which all-zero bytes are a valid
    // value; the pointer is handed to Vec with the same layout (length = capacity = n).
    unsafe {
        let ptr = std::alloc::alloc_zeroed(layout) as *mut T;
        if ptr.is_null() {
            return Err(too_big());
        }
        Ok(Vec::from_raw_parts(ptr, n, n))
    }
}

impl KvBuf {
    pub fn new(kind: KvType, n: usize) -> Result<KvBuf> {
        Ok(match kind {
            KvType::F32 => KvBuf::F32(zeroed(n)?),
            KvType::F16 => KvBuf::F16(zeroed(n)?),
        })
    }

    /// Stores `src` at element `start`.
    pub fn write(&mut self, start: usize, src: &[f32]) {
        match self {
            KvBuf::F32(b) => b[start..start + src.len()].copy_from_slice(src),
            KvBuf::F16(b) => {
                let dst = &mut b[start..start + src.len()];
                match simd_level() {
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: Avx2 is only reported when the CPU has avx2, fma and f16c.
                    SimdLevel::Avx2 => unsafe { crate::avx2::f32_to_f16_row(src, dst) },
                    _ => dst.iter_mut().zip(src).for_each(|(d, s)| *d = f32_to_f16(*s)),
                }
            }
        }
    }

    pub fn view(&self, n: usize) -> KvView<'_> {
        match self {
            KvBuf::F32(b) => KvView::F32(&b[..n]),
            KvBuf::F16(b) => KvView::F16(&b[..n]),
        }
    }
}

impl KvView<'_> {
    fn len(&self) -> usize {
        match self {
            KvView::F32(b) => b.len(),
            KvView::F16(b) => b.len(),
        }
    }

    fn get(&self, i: usize) -> f32 {
        match self {
            KvView::F32(b) => b[i],
            KvView::F16(b) => f16_to_f32(b[i]),
        }
    }

    #[cfg(target_arch = "x86_64")]
    fn as_ptr(&self) -> *const u8 {
        match self {
            KvView::F32(b) => b.as_ptr() as *const u8,
            KvView::F16(b) => b.as_ptr() as *const u8,
        }
    }
}

/// scores[j] = scale * dot(q, row j), rows `stride` elements apart, the head at `offset`.
pub fn scores_scalar(q: &[f32], cache: KvView, stride: usize, offset: usize, scale: f32, scores: &mut [f32]) {
    for (j, s) in scores.iter_mut().enumerate() {
        let base = j * stride + offset;
        *s = q.iter().enumerate().map(|(d, a)| a * cache.get(base + d)).sum::<f32>() * scale;
    }
}

/// out = sum_j weights[j] * row j.
pub fn weighted_sum_scalar(weights: &[f32], cache: KvView, stride: usize, offset: usize, out: &mut [f32]) {
    out.fill(0.0);
    for (j, &w) in weights.iter().enumerate() {
        let base = j * stride + offset;
        out.iter_mut().enumerate().for_each(|(d, o)| *o += w * cache.get(base + d));
    }
}

/// Causal attention of one head: `q` against the first `scores.len()` cached positions of
/// `k` and `v`. `scores` is scratch of that length; the result goes to `out` (head_dim).
#[allow(clippy::too_many_arguments)]
pub fn attend(q: &[f32], k: KvView, v: KvView, stride: usize, offset: usize, scale: f32, scores: &mut [f32], out: &mut [f32]) {
    let hd = q.len();
    assert_eq!(out.len(), hd);
    let needed = if scores.is_empty() { 0 } else { (scores.len() - 1) * stride + offset + hd };
    assert!(needed <= k.len() && needed <= v.len(), "attention reads past the KV cache");
    let fast = simd_level() == SimdLevel::Avx2 && hd % 8 == 0;
    if fast {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: Avx2 implies avx2+fma+f16c; the head size is a multiple of 8 and the bounds
        // the kernel reads were asserted above.
        unsafe {
            match k {
                KvView::F32(_) => crate::avx2::attn_scores::<false>(q, k.as_ptr(), stride, offset, scale, scores),
                KvView::F16(_) => crate::avx2::attn_scores::<true>(q, k.as_ptr(), stride, offset, scale, scores),
            }
        }
    } else {
        scores_scalar(q, k, stride, offset, scale, scores);
    }
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for s in scores.iter_mut() {
        *s = (*s - max).exp();
        sum += *s;
    }
    let inv = 1.0 / sum;
    scores.iter_mut().for_each(|s| *s *= inv);
    if fast {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        unsafe {
            match v {
                KvView::F32(_) => crate::avx2::attn_weighted_sum::<false>(scores, v.as_ptr(), stride, offset, out),
                KvView::F16(_) => crate::avx2::attn_weighted_sum::<true>(scores, v.as_ptr(), stride, offset, out),
            }
        }
    } else {
        weighted_sum_scalar(scores, v, stride, offset, out);
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
        for kind in [KvType::F32, KvType::F16] {
            for hd in [8, 24, 64, 128, 80] {
                for n in [1, 3, 4, 37] {
                    let (stride, offset) = (hd * 3, hd);
                    let vals: Vec<f32> = (0..n * stride).map(|_| rng.next_f32() - 0.5).collect();
                    let mut buf = KvBuf::new(kind, n * stride).unwrap();
                    buf.write(0, &vals);
                    let cache = buf.view(n * stride);
                    let q: Vec<f32> = (0..hd).map(|_| rng.next_f32() - 0.5).collect();
                    let (mut a, mut b) = (vec![0.0; n], vec![0.0; n]);
                    scores_scalar(&q, cache, stride, offset, 0.3, &mut a);
                    let p = cache.as_ptr();
                    unsafe {
                        match kind {
                            KvType::F32 => crate::avx2::attn_scores::<false>(&q, p, stride, offset, 0.3, &mut b),
                            KvType::F16 => crate::avx2::attn_scores::<true>(&q, p, stride, offset, 0.3, &mut b),
                        }
                    }
                    for (x, y) in a.iter().zip(&b) {
                        assert!((x - y).abs() < 1e-5, "{kind:?} hd {hd}: {x} vs {y}");
                    }
                    let (mut o1, mut o2) = (vec![0.0; hd], vec![1.0; hd]);
                    weighted_sum_scalar(&a, cache, stride, offset, &mut o1);
                    unsafe {
                        match kind {
                            KvType::F32 => crate::avx2::attn_weighted_sum::<false>(&a, p, stride, offset, &mut o2),
                            KvType::F16 => crate::avx2::attn_weighted_sum::<true>(&a, p, stride, offset, &mut o2),
                        }
                    }
                    for (x, y) in o1.iter().zip(&o2) {
                        assert!((x - y).abs() < 1e-5, "{kind:?} hd {hd}: {x} vs {y}");
                    }
                }
            }
        }
    }

    #[test]
    fn f16_store_rounds_like_the_scalar_twin() {
        let vals: Vec<f32> = (0..100).map(|i| (i as f32 - 50.0) * 0.37 + 1e-3).collect();
        let mut buf = KvBuf::new(KvType::F16, 100).unwrap();
        buf.write(0, &vals);
        let KvBuf::F16(bits) = &buf else { unreachable!() };
        for (b, v) in bits.iter().zip(&vals) {
            assert_eq!(*b, f32_to_f16(*v));
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
        attend(&q, KvView::F32(&k), KvView::F32(&v), 2, 0, 1.0, &mut scores, &mut out);
        let (e0, e1) = (1.0f32, 2.0f32.exp());
        assert!((out[0] - e0 / (e0 + e1)).abs() < 1e-6);
        assert!((out[1] - e1 / (e0 + e1)).abs() < 1e-6);
    }
}
