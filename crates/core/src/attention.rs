//! The KV cache and attention over it: scores, softmax, weighted sum of values, for the group of
//! query heads that share one KV head (GQA), so each cached key and value is read and converted
//! once per group. One call covers every cached position, so the SIMD loops run long.
//!
//! The cache stores f16 by default (half the memory traffic of f32, as llama.cpp does) or f32
//! (bit-for-bit the values the projections produced).

use crate::error::{Error, Result};
use crate::quant::{f16_to_f32, f32_to_f16};
use crate::simd::{simd_level, SimdLevel};

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
            _ => Err(Error::InvalidArgument(format!(
                "KV cache type must be 'f16' or 'f32', got '{s}'"
            ))),
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
    let too_big = || {
        Error::InvalidArgument(format!(
            "cannot allocate a KV cache of {n} elements ({:.1} GiB): use a smaller context",
            n as f64 * std::mem::size_of::<T>() as f64 / (1u64 << 30) as f64
        ))
    };
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
                    // SAFETY: Avx2 and above are only reported when the CPU has avx2, fma and f16c.
                    SimdLevel::Avx2 | SimdLevel::Avx512 => unsafe {
                        crate::avx2::f32_to_f16_row(src, dst)
                    },
                    _ => dst.iter_mut().zip(src).for_each(|(d, s)| *d = f32_to_f16(*s)),
                }
            }
        }
    }

    /// Bytes per element.
    pub fn elem_bytes(&self) -> usize {
        match self {
            KvBuf::F32(_) => 4,
            KvBuf::F16(_) => 2,
        }
    }

    pub fn view(&self, n: usize) -> KvView<'_> {
        self.view_at(0, n)
    }

    /// Elements start..start + n.
    pub fn view_at(&self, start: usize, n: usize) -> KvView<'_> {
        match self {
            KvBuf::F32(b) => KvView::F32(&b[start..start + n]),
            KvBuf::F16(b) => KvView::F16(&b[start..start + n]),
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
pub fn scores_scalar(
    q: &[f32],
    cache: KvView,
    stride: usize,
    offset: usize,
    scale: f32,
    scores: &mut [f32],
) {
    for (j, s) in scores.iter_mut().enumerate() {
        let base = j * stride + offset;
        *s = q.iter().enumerate().map(|(d, a)| a * cache.get(base + d)).sum::<f32>() * scale;
    }
}

/// out = sum_j weights[j] * row j.
pub fn weighted_sum_scalar(
    weights: &[f32],
    cache: KvView,
    stride: usize,
    offset: usize,
    out: &mut [f32],
) {
    out.fill(0.0);
    for (j, &w) in weights.iter().enumerate() {
        let base = j * stride + offset;
        out.iter_mut().enumerate().for_each(|(d, o)| *o += w * cache.get(base + d));
    }
}

/// row[i] = e^(row[i] - max); returns (max, sum of the new row). Scalar twin of
/// `avx2::exp_shifted`.
pub fn exp_shifted_scalar(row: &mut [f32]) -> (f32, f32) {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for s in row.iter_mut() {
        *s = (*s - max).exp();
        sum += *s;
    }
    (max, sum)
}

/// `exp_shifted_scalar`, SIMD where the CPU has it (a long context spends a good share of
/// attention's time in e^x otherwise).
pub fn exp_shifted(row: &mut [f32]) -> (f32, f32) {
    #[cfg(target_arch = "x86_64")]
    if simd_level().has_avx2() {
        // SAFETY: has_avx2 means the CPU has avx2, fma and f16c.
        return unsafe { crate::avx2::exp_shifted(row) };
    }
    exp_shifted_scalar(row)
}

/// Scalar twin of `avx2::attn_scores_group`: scores[h * n + j] for the heads in `qs` (g x hd).
#[allow(clippy::too_many_arguments)]
pub fn group_scores_scalar(
    qs: &[f32],
    hd: usize,
    cache: KvView,
    stride: usize,
    offset: usize,
    scale: f32,
    n: usize,
    scores: &mut [f32],
) {
    for (h, q) in qs.chunks_exact(hd).enumerate() {
        scores_scalar(q, cache, stride, offset, scale, &mut scores[h * n..(h + 1) * n]);
    }
}

/// Scalar twin of `avx2::attn_weighted_sum_group`.
pub fn group_weighted_sum_scalar(
    weights: &[f32],
    n: usize,
    cache: KvView,
    stride: usize,
    offset: usize,
    out: &mut [f32],
    hd: usize,
) {
    for (h, o) in out.chunks_exact_mut(hd).enumerate() {
        weighted_sum_scalar(&weights[h * n..(h + 1) * n], cache, stride, offset, o);
    }
}

/// How a group's scores become weights: q . k times `scale`; a non-zero `softcap` squashes
/// each scaled score s into softcap * tanh(s / softcap) before the softmax (Gemma 2); `sinks`,
/// unless empty, holds a logit per query head of the group that joins the head's softmax with
/// no value (gpt-oss's attention sinks), so that its positions' weights sum to less than 1.
#[derive(Clone, Copy, Debug)]
pub struct Scoring<'a> {
    pub scale: f32,
    pub softcap: f32,
    pub sinks: &'a [f32],
}

/// Causal attention of the query heads that share one KV head (GQA): `qs` holds them back to
/// back (g x hd), `out` receives theirs likewise. `scores` is scratch (resized here). Each cached
/// key and value is read once for the whole group; `scoring` says how scores become weights.
#[allow(clippy::too_many_arguments)]
pub fn attend_group(
    qs: &[f32],
    hd: usize,
    k: KvView,
    v: KvView,
    n: usize,
    stride: usize,
    offset: usize,
    scoring: Scoring,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    attend_normalised(qs, hd, k, v, n, stride, offset, scoring, scores, out, |_| n);
}

/// `attend_group_masked` divided by each head's sum: the attention output of heads that see
/// the first `seen(h)` of n rows.
#[allow(clippy::too_many_arguments)]
fn attend_normalised(
    qs: &[f32],
    hd: usize,
    k: KvView,
    v: KvView,
    n: usize,
    stride: usize,
    offset: usize,
    scoring: Scoring,
    scores: &mut Vec<f32>,
    out: &mut [f32],
    seen: impl Fn(usize) -> usize,
) {
    let g = qs.len() / hd;
    let mut parts = [Partial::default(); 8];
    let mut many = Vec::new();
    let parts: &mut [Partial] = if g <= 8 {
        &mut parts[..g]
    } else {
        many.resize(g, Partial::default());
        &mut many
    };
    attend_group_masked(qs, hd, k, v, n, stride, offset, scoring, scores, out, parts, seen);
    for (h, (o, p)) in out.chunks_exact_mut(hd).zip(parts.iter()).enumerate() {
        // (a block's heads are its queries' groups one after another)
        let inv = p.inverse_total(scoring.sinks.get(h % scoring.sinks.len().max(1)).copied());
        o.iter_mut().for_each(|x| *x *= inv);
    }
}

/// Causal attention of `b` consecutive queries of one sequence whose rows start at the same
/// cache row (a prompt's tokens): `qs` holds each query's `g` heads that share one KV head, query
/// by query (b x g x hd), and query i sees the first `len0 + i` rows. All b * g heads go through
/// the group kernels together, so each cached key and value is read (and converted) once for
/// the block instead of once per query; a query's rows past its own weigh exactly 0 (score -inf,
/// e^-inf = 0), so each query's output is bit for bit `attend_group`'s over its own rows (the
/// scores, e^x and sums per position and lane do not depend on the group's size). `out` receives
/// the queries' heads likewise (b x g x hd).
#[allow(clippy::too_many_arguments)]
pub fn attend_block(
    qs: &[f32],
    hd: usize,
    b: usize,
    k: KvView,
    v: KvView,
    len0: usize,
    stride: usize,
    offset: usize,
    scoring: Scoring,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    let g = qs.len() / hd / b;
    assert!(
        b >= 1 && len0 >= 1 && qs.len() == b * g * hd && out.len() == qs.len(),
        "attention block: wrong shapes"
    );
    // (in pieces of as many queries as the group kernels take heads: a larger group would take
    // the scalar path, whose sums are ordered otherwise)
    let per_piece = (8 / g).max(1);
    for i0 in (0..b).step_by(per_piece) {
        let bb = per_piece.min(b - i0);
        let len = len0 + i0;
        let (q, o) =
            (&qs[i0 * g * hd..(i0 + bb) * g * hd], &mut out[i0 * g * hd..(i0 + bb) * g * hd]);
        attend_normalised(q, hd, k, v, len + bb - 1, stride, offset, scoring, scores, o, |r| {
            len + r / g
        });
    }
}

/// Per query head, what `attend_group_partial` leaves besides the unnormalised output: the
/// largest score and the sum of e^(score - max) over the positions it saw.
#[derive(Debug, Clone, Copy)]
pub struct Partial {
    pub max: f32,
    pub sum: f32,
}

impl Partial {
    /// 1 / the softmax's denominator: the sum, plus e^(sink - max) where the head has a sink,
    /// computed so that neither term overflows.
    fn inverse_total(self, sink: Option<f32>) -> f32 {
        match sink {
            None => 1.0 / self.sum,
            Some(s) if s <= self.max => 1.0 / (self.sum + (s - self.max).exp()),
            Some(s) => {
                let w = (self.max - s).exp();
                w / (self.sum * w + 1.0)
            }
        }
    }
}

impl Default for Partial {
    fn default() -> Partial {
        Partial { max: f32::NEG_INFINITY, sum: 0.0 }
    }
}

/// Attention over one stretch of the cache without the final division: `out` (g x hd) gets
/// sum_j e^(s_j - max) v_j per head and `parts` each head's max and sum. Stretches of one
/// query's cache, computed apart (on different threads), combine exactly with
/// `merge_partials` (flash-decoding's split of a long context).
#[allow(clippy::too_many_arguments)]
pub fn attend_group_partial(
    qs: &[f32],
    hd: usize,
    k: KvView,
    v: KvView,
    n: usize,
    stride: usize,
    offset: usize,
    scoring: Scoring,
    scores: &mut Vec<f32>,
    out: &mut [f32],
    parts: &mut [Partial],
) {
    attend_group_masked(qs, hd, k, v, n, stride, offset, scoring, scores, out, parts, |_| n);
}

/// `attend_group_partial` where head h sees only the first `seen(h)` of the n rows (the others
/// weigh 0).
#[allow(clippy::too_many_arguments)]
fn attend_group_masked(
    qs: &[f32],
    hd: usize,
    k: KvView,
    v: KvView,
    n: usize,
    stride: usize,
    offset: usize,
    scoring: Scoring,
    scores: &mut Vec<f32>,
    out: &mut [f32],
    parts: &mut [Partial],
    seen: impl Fn(usize) -> usize,
) {
    let g = qs.len() / hd;
    assert!(g >= 1 && qs.len() == g * hd && out.len() == g * hd && parts.len() == g);
    let needed = if n == 0 { 0 } else { (n - 1) * stride + offset + hd };
    assert!(needed <= k.len() && needed <= v.len(), "attention reads past the KV cache");
    scores.resize(g * n, 0.0);
    let fast = simd_level().has_avx2() && hd.is_multiple_of(16) && (1..=8).contains(&g);

    // (AVX-512's kernels are the AVX2 ones with twice the registers: the same bits)
    #[cfg(target_arch = "x86_64")]
    let wide = simd_level() == SimdLevel::Avx512;
    #[cfg(target_arch = "x86_64")]
    macro_rules! each_group_size {
        ($kernel:ident, $f16:literal, $($args:expr),*) => {
            if wide {
                each_group_size!(@in avx512, $kernel, $f16, $($args),*)
            } else {
                each_group_size!(@in avx2, $kernel, $f16, $($args),*)
            }
        };
        (@in $m:ident, $kernel:ident, $f16:literal, $($args:expr),*) => {
            match g {
                1 => crate::$m::$kernel::<$f16, 1>($($args),*),
                2 => crate::$m::$kernel::<$f16, 2>($($args),*),
                3 => crate::$m::$kernel::<$f16, 3>($($args),*),
                4 => crate::$m::$kernel::<$f16, 4>($($args),*),
                5 => crate::$m::$kernel::<$f16, 5>($($args),*),
                6 => crate::$m::$kernel::<$f16, 6>($($args),*),
                7 => crate::$m::$kernel::<$f16, 7>($($args),*),
                _ => crate::$m::$kernel::<$f16, 8>($($args),*),
            }
        };
    }

    if fast {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: Avx2 implies avx2+fma+f16c (Avx512, `wide`, also AVX-512 F/BW/VL/VNNI); hd
        // is a multiple of 16, 1 <= g <= 8, and the bounds the kernel reads were asserted above.
        unsafe {
            match k {
                KvView::F32(_) => each_group_size!(
                    attn_scores_group,
                    false,
                    qs,
                    k.as_ptr(),
                    stride,
                    offset,
                    scoring.scale,
                    n,
                    scores
                ),
                KvView::F16(_) => each_group_size!(
                    attn_scores_group,
                    true,
                    qs,
                    k.as_ptr(),
                    stride,
                    offset,
                    scoring.scale,
                    n,
                    scores
                ),
            }
        }
    } else {
        group_scores_scalar(qs, hd, k, stride, offset, scoring.scale, n, scores);
    }
    let cap = scoring.softcap;
    if cap != 0.0 {
        // Gemma 2: scores squashed into (-cap, cap)
        scores.iter_mut().for_each(|s| *s = cap * (*s / cap).tanh());
    }
    if n == 0 {
        out.fill(0.0);
        parts.fill(Partial::default());
        return;
    }
    for (h, (row, p)) in scores.chunks_exact_mut(n).zip(parts.iter_mut()).enumerate() {
        row[seen(h).min(n)..].fill(f32::NEG_INFINITY);
        let (max, sum) = exp_shifted(row);
        *p = Partial { max, sum };
    }
    if fast {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        unsafe {
            match v {
                KvView::F32(_) => each_group_size!(
                    attn_weighted_sum_group,
                    false,
                    scores,
                    v.as_ptr(),
                    stride,
                    offset,
                    n,
                    out
                ),
                KvView::F16(_) => each_group_size!(
                    attn_weighted_sum_group,
                    true,
                    scores,
                    v.as_ptr(),
                    stride,
                    offset,
                    n,
                    out
                ),
            }
        }
    } else {
        group_weighted_sum_scalar(scores, n, v, stride, offset, out, hd);
    }
}

/// Combines the partial results of stretches of one query's cache: each piece's `out` (g x hd)
/// and `parts` (g) from `attend_group_partial`, into the normalised attention output `out`
/// (with the heads' `sinks`, `Scoring`'s, unless empty).
pub fn merge_partials<'a>(
    pieces: impl Iterator<Item = (&'a [f32], &'a [Partial])> + Clone,
    hd: usize,
    sinks: &[f32],
    out: &mut [f32],
) {
    out.fill(0.0);
    for (h, o) in out.chunks_exact_mut(hd).enumerate() {
        let max = pieces.clone().map(|(_, p)| p[h].max).fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0.0;
        for (po, part) in pieces.clone() {
            let w = (part[h].max - max).exp();
            if w == 0.0 {
                continue;
            }
            sum += w * part[h].sum;
            o.iter_mut().zip(&po[h * hd..(h + 1) * hd]).for_each(|(x, y)| *x += w * y);
        }
        let inv = Partial { max, sum }.inverse_total(sinks.get(h).copied());
        o.iter_mut().for_each(|x| *x *= inv);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plain(scale: f32, softcap: f32) -> Scoring<'static> {
        Scoring { scale, softcap, sinks: &[] }
    }

    /// Plain per-head attention from the scalar pieces, in f64 past the scores, with a sink
    /// logit in the softmax's sum if given: the reference for the grouped path.
    #[allow(clippy::too_many_arguments)]
    fn attend_one(
        q: &[f32],
        k: KvView,
        v: KvView,
        n: usize,
        stride: usize,
        offset: usize,
        scale: f32,
        sink: Option<f32>,
    ) -> Vec<f32> {
        let mut scores = vec![0.0; n];
        scores_scalar(q, k, stride, offset, scale, &mut scores);
        let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let e: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
        let sum: f32 = e.iter().sum::<f32>() + sink.map_or(0.0, |s| (s - max).exp());
        let w: Vec<f32> = e.iter().map(|x| x / sum).collect();
        let mut out = vec![0.0; q.len()];
        weighted_sum_scalar(&w, v, stride, offset, &mut out);
        out
    }

    /// The grouped (GQA) path, SIMD where the CPU has it, equals plain per-head attention for
    /// every group size, both cache types, and head sizes that take the SIMD path or not, with
    /// and without sinks (below, above and far above the scores).
    #[test]
    fn grouped_attention_equals_per_head_attention() {
        let mut rng = crate::sampler::Rng::new(9);
        for kind in [KvType::F32, KvType::F16] {
            for (g, hd) in [(1, 64), (3, 64), (2, 48), (4, 32), (8, 16), (2, 24), (9, 16)] {
                for n in [1, 5, 33] {
                    let n_kv = 2;
                    let stride = n_kv * hd;
                    let vals: Vec<f32> = (0..n * stride).map(|_| rng.next_f32() - 0.5).collect();
                    let mut kb = KvBuf::new(kind, n * stride).unwrap();
                    kb.write(0, &vals);
                    let vals2: Vec<f32> = (0..n * stride).map(|_| rng.next_f32() - 0.5).collect();
                    let mut vb = KvBuf::new(kind, n * stride).unwrap();
                    vb.write(0, &vals2);
                    let qs: Vec<f32> = (0..g * hd).map(|_| rng.next_f32() - 0.5).collect();
                    let (k, v) = (kb.view(n * stride), vb.view(n * stride));
                    for sinks in [vec![], vec![-1.0, 0.5, 3.0, 90.0, 0.0, 2.0, -5.0, 1.0, 0.1]] {
                        let scoring =
                            Scoring { sinks: &sinks[..sinks.len().min(g)], ..plain(0.2, 0.0) };
                        let mut out = vec![0.0; g * hd];
                        attend_group(
                            &qs,
                            hd,
                            k,
                            v,
                            n,
                            stride,
                            hd,
                            scoring,
                            &mut Vec::new(),
                            &mut out,
                        );
                        for h in 0..g {
                            let q = &qs[h * hd..(h + 1) * hd];
                            let one =
                                attend_one(q, k, v, n, stride, hd, 0.2, sinks.get(h).copied());
                            for (x, y) in one.iter().zip(&out[h * hd..(h + 1) * hd]) {
                                assert!(
                                    (x - y).abs() < 1e-5,
                                    "{kind:?} g={g} hd={hd} n={n} sinks {}: {x} vs {y}",
                                    sinks.len()
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    /// The AVX-512 attention kernels (the AVX2 ones with more rows or dims per pass) give the
    /// AVX2 kernels' scores and weighted sums bit for bit, for every group size, both cache
    /// types, head sizes with and without a 32-dim pass, and row counts around each pass width.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx512_attention_kernels_equal_avx2_bit_for_bit() {
        if simd_level() != SimdLevel::Avx512 {
            eprintln!("skipped: the CPU (or POWERINFER_SIMD) has no AVX-512");
            return;
        }
        let mut rng = crate::sampler::Rng::new(23);
        macro_rules! both {
            ($g:literal, $f16:literal, $k:expr, $v:expr, $stride:expr, $hd:expr, $n:expr) => {{
                let (g, hd, n, stride) = ($g, $hd, $n, $stride);
                let qs: Vec<f32> = (0..g * hd).map(|_| rng.next_f32() - 0.5).collect();
                let w: Vec<f32> = (0..g * n).map(|_| rng.next_f32()).collect();
                let (mut s2, mut s5) = (vec![0.0; g * n], vec![0.0; g * n]);
                let (mut o2, mut o5) = (vec![0.0; g * hd], vec![0.0; g * hd]);
                // SAFETY: the level is Avx512; the caches hold n rows of `stride` with the head
                // at offset hd (hd + hd <= stride), hd a multiple of 16.
                unsafe {
                    crate::avx2::attn_scores_group::<$f16, $g>(
                        &qs, $k, stride, hd, 0.3, n, &mut s2,
                    );
                    crate::avx512::attn_scores_group::<$f16, $g>(
                        &qs, $k, stride, hd, 0.3, n, &mut s5,
                    );
                    crate::avx2::attn_weighted_sum_group::<$f16, $g>(
                        &w, $v, stride, hd, n, &mut o2,
                    );
                    crate::avx512::attn_weighted_sum_group::<$f16, $g>(
                        &w, $v, stride, hd, n, &mut o5,
                    );
                }
                let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
                assert_eq!(bits(&s2), bits(&s5), "scores: g={} f16={} hd={hd} n={n}", $g, $f16);
                assert_eq!(
                    bits(&o2),
                    bits(&o5),
                    "weighted sums: g={} f16={} hd={hd} n={n}",
                    $g,
                    $f16
                );
            }};
        }
        for kind in [KvType::F32, KvType::F16] {
            for hd in [16, 32, 48, 64, 96] {
                for n in [1, 2, 3, 4, 5, 6, 7, 11, 13, 40] {
                    let stride = 2 * hd;
                    let mut kb = KvBuf::new(kind, n * stride).unwrap();
                    kb.write(
                        0,
                        &(0..n * stride).map(|_| rng.next_f32() - 0.5).collect::<Vec<f32>>(),
                    );
                    let mut vb = KvBuf::new(kind, n * stride).unwrap();
                    vb.write(
                        0,
                        &(0..n * stride).map(|_| rng.next_f32() - 0.5).collect::<Vec<f32>>(),
                    );
                    let (k, v) = (kb.view(n * stride).as_ptr(), vb.view(n * stride).as_ptr());
                    macro_rules! each_g {
                        ($f16:literal) => {{
                            both!(1, $f16, k, v, stride, hd, n);
                            both!(2, $f16, k, v, stride, hd, n);
                            both!(3, $f16, k, v, stride, hd, n);
                            both!(4, $f16, k, v, stride, hd, n);
                            both!(5, $f16, k, v, stride, hd, n);
                            both!(6, $f16, k, v, stride, hd, n);
                            both!(7, $f16, k, v, stride, hd, n);
                            both!(8, $f16, k, v, stride, hd, n);
                        }};
                    }
                    match kind {
                        KvType::F32 => each_g!(false),
                        KvType::F16 => each_g!(true),
                    }
                }
            }
        }
    }

    /// A block of consecutive queries gives each query bit for bit what it gets alone over its
    /// own rows, for every block and group size the kernels take (and past them), both cache
    /// types, head sizes on and off the SIMD path, and a softcap.
    #[test]
    fn a_block_of_queries_equals_each_query_alone() {
        let mut rng = crate::sampler::Rng::new(17);
        for kind in [KvType::F32, KvType::F16] {
            for (g, hd, b) in
                [(3, 64, 2), (1, 64, 8), (2, 32, 4), (4, 16, 2), (1, 48, 3), (3, 24, 2), (5, 16, 3)]
            {
                for len0 in [1, 6, 40] {
                    let n = len0 + b - 1;
                    let n_kv = 2;
                    let stride = n_kv * hd;
                    let mut kb = KvBuf::new(kind, n * stride).unwrap();
                    kb.write(
                        0,
                        &(0..n * stride).map(|_| rng.next_f32() - 0.5).collect::<Vec<f32>>(),
                    );
                    let mut vb = KvBuf::new(kind, n * stride).unwrap();
                    vb.write(
                        0,
                        &(0..n * stride).map(|_| rng.next_f32() - 0.5).collect::<Vec<f32>>(),
                    );
                    let qs: Vec<f32> =
                        (0..b * g * hd).map(|_| 4.0 * (rng.next_f32() - 0.5)).collect();
                    let sinks: Vec<f32> = (0..g).map(|h| h as f32 - 1.0).collect();
                    for (softcap, sinks) in [(0.0, &[][..]), (0.7, &[][..]), (0.0, &sinks[..])] {
                        let scoring = Scoring { scale: 0.3, softcap, sinks };
                        let mut block = vec![0.0; b * g * hd];
                        attend_block(
                            &qs,
                            hd,
                            b,
                            kb.view(n * stride),
                            vb.view(n * stride),
                            len0,
                            stride,
                            hd,
                            scoring,
                            &mut Vec::new(),
                            &mut block,
                        );
                        for i in 0..b {
                            let m = len0 + i;
                            let mut alone = vec![0.0; g * hd];
                            let q = &qs[i * g * hd..(i + 1) * g * hd];
                            attend_group(
                                q,
                                hd,
                                kb.view(m * stride),
                                vb.view(m * stride),
                                m,
                                stride,
                                hd,
                                scoring,
                                &mut Vec::new(),
                                &mut alone,
                            );
                            let got = &block[i * g * hd..(i + 1) * g * hd];
                            let same =
                                got.iter().zip(&alone).all(|(x, y)| x.to_bits() == y.to_bits());
                            let has_sinks = !sinks.is_empty();
                            assert!(same, "{kind:?} g={g} hd={hd} b={b} len0={len0} softcap={softcap} sinks {has_sinks} query {i}");
                        }
                    }
                }
            }
        }
    }

    /// The SIMD e^(x - max) equals its scalar twin: every length around the 8-lane body and
    /// tail, spreads from tiny to ones where most terms underflow to 0, ties, and one element.
    #[test]
    fn exp_shifted_equals_scalar_twin() {
        let mut rng = crate::sampler::Rng::new(3);
        for n in [1, 2, 7, 8, 9, 15, 16, 17, 100, 4099] {
            for spread in [1e-3f32, 1.0, 30.0, 300.0] {
                let row: Vec<f32> = (0..n).map(|_| (rng.next_f32() - 0.5) * spread).collect();
                let (mut a, mut b) = (row.clone(), row.clone());
                let (ma, sa) = exp_shifted(&mut a);
                let (mb, sb) = exp_shifted_scalar(&mut b);
                assert_eq!(ma, mb);
                assert!((sa - sb).abs() <= 1e-5 * sb, "n={n} spread={spread}: sum {sa} vs {sb}");
                for (i, (x, y)) in a.iter().zip(&b).enumerate() {
                    assert!(
                        (x - y).abs() <= 1e-6 * y.max(1e-30) + 1e-37,
                        "n={n} spread={spread} [{i}]: {x} vs {y}"
                    );
                }
            }
        }
        let mut ties = vec![2.5f32; 13];
        assert_eq!(exp_shifted(&mut ties), (2.5, 13.0));
        assert!(ties.iter().all(|&x| x == 1.0));
    }

    /// Attention split into stretches, each on its own, then merged, equals attention over the
    /// whole cache (what decoding a long context on several threads relies on), sinks or none.
    #[test]
    fn split_attention_merges_to_the_whole() {
        let mut rng = crate::sampler::Rng::new(5);
        let (g, hd, n_kv) = (3, 64, 2);
        let stride = n_kv * hd;
        for kind in [KvType::F32, KvType::F16] {
            for (n, cuts) in
                [(40, vec![0, 13, 40]), (300, vec![0, 100, 101, 250, 300]), (9, vec![0, 9, 9])]
            {
                let mut kb = KvBuf::new(kind, n * stride).unwrap();
                kb.write(
                    0,
                    &(0..n * stride).map(|_| (rng.next_f32() - 0.5) * 4.0).collect::<Vec<_>>(),
                );
                let mut vb = KvBuf::new(kind, n * stride).unwrap();
                vb.write(0, &(0..n * stride).map(|_| rng.next_f32() - 0.5).collect::<Vec<_>>());
                let qs: Vec<f32> = (0..g * hd).map(|_| rng.next_f32() - 0.5).collect();
                let sinks = [0.3, -2.0, 40.0];
                for sinks in [&[][..], &sinks[..]] {
                    let scoring = Scoring { sinks, ..plain(0.125, 0.0) };
                    let mut whole = vec![0.0; g * hd];
                    attend_group(
                        &qs,
                        hd,
                        kb.view(n * stride),
                        vb.view(n * stride),
                        n,
                        stride,
                        hd,
                        scoring,
                        &mut Vec::new(),
                        &mut whole,
                    );
                    let mut outs = vec![];
                    let mut parts = vec![];
                    for w in cuts.windows(2) {
                        let (a, len) = (w[0], w[1] - w[0]);
                        let (k, v) = (
                            kb.view_at(a * stride, len * stride),
                            vb.view_at(a * stride, len * stride),
                        );
                        let mut o = vec![0.0; g * hd];
                        let mut p = vec![Partial::default(); g];
                        attend_group_partial(
                            &qs,
                            hd,
                            k,
                            v,
                            len,
                            stride,
                            hd,
                            scoring,
                            &mut Vec::new(),
                            &mut o,
                            &mut p,
                        );
                        outs.push(o);
                        parts.push(p);
                    }
                    let mut merged = vec![0.0; g * hd];
                    merge_partials(
                        outs.iter().map(|o| o.as_slice()).zip(parts.iter().map(|p| p.as_slice())),
                        hd,
                        sinks,
                        &mut merged,
                    );
                    for (x, y) in merged.iter().zip(&whole) {
                        assert!((x - y).abs() < 1e-5, "{kind:?} n={n} {cuts:?}: {x} vs {y}");
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
    fn attention_is_softmax_weighted_values() {
        // Two positions, one dimension pair: hand-computed softmax.
        let q = [1.0f32, 0.0];
        let k = [0.0f32, 0.0, 2.0, 0.0];
        let v = [1.0f32, 0.0, 0.0, 1.0];
        let mut out = [0.0; 2];
        attend_group(
            &q,
            2,
            KvView::F32(&k),
            KvView::F32(&v),
            2,
            2,
            0,
            plain(1.0, 0.0),
            &mut Vec::new(),
            &mut out,
        );
        let (e0, e1) = (1.0f32, 2.0f32.exp());
        assert!((out[0] - e0 / (e0 + e1)).abs() < 1e-6);
        assert!((out[1] - e1 / (e0 + e1)).abs() < 1e-6);
        // a sink of logit 1 joins the sum with no value
        let scoring = Scoring { sinks: &[1.0], ..plain(1.0, 0.0) };
        attend_group(
            &q,
            2,
            KvView::F32(&k),
            KvView::F32(&v),
            2,
            2,
            0,
            scoring,
            &mut Vec::new(),
            &mut out,
        );
        let total = e0 + e1 + 1.0f32.exp();
        assert!((out[0] - e0 / total).abs() < 1e-6);
        assert!((out[1] - e1 / total).abs() < 1e-6);
    }
}
