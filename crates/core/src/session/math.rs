//! The small elementwise steps of the layer: norms, bias and residual adds, RoPE.

use super::{Family, RopeStyle};
use rayon::iter::IndexedParallelIterator;
use rayon::iter::ParallelIterator;
use rayon::prelude::ParallelSlice;
use rayon::prelude::ParallelSliceMut;

/// Values from which a row-wise step runs on the pool (a prompt's; a token's few thousand stay
/// on the calling thread).
const PARALLEL_FROM: usize = 1 << 15;

/// Applies `f` to each `len`-long row of `x` (with the matching row of `y`), on the pool when
/// they are many: the rows are independent, so the results do not depend on it.
fn each_row<T: Sync>(
    x: &mut [f32],
    y: &[T],
    len: usize,
    y_len: usize,
    f: impl Fn(usize, &mut [f32], &[T]) + Sync,
) {
    if x.len() >= PARALLEL_FROM {
        x.par_chunks_exact_mut(len)
            .zip(y.par_chunks_exact(y_len.max(1)))
            .enumerate()
            .for_each(|(t, (r, yr))| f(t, r, yr));
    } else {
        x.chunks_exact_mut(len)
            .zip(y.chunks_exact(y_len.max(1)))
            .enumerate()
            .for_each(|(t, (r, yr))| f(t, r, yr));
    }
}

/// The sum of squares in eight running sums (one vector; a single running sum waits on each
/// add's latency), added pairwise at the end.
fn sum_of_squares(x: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for i in 0..8 {
            acc[i] += c[i] * c[i];
        }
    }
    for (a, v) in acc.iter_mut().zip(chunks.remainder()) {
        *a += v * v;
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))
}

pub(crate) fn rmsnorm(out: &mut [f32], x: &[f32], w: &[f32], eps: f32) {
    let n = w.len();
    each_row(out, x, n, n, |_, o, xr| {
        let scale = 1.0 / (sum_of_squares(xr) / n as f32 + eps).sqrt();
        for ((oi, xi), wi) in o.iter_mut().zip(xr).zip(w) {
            *oi = xi * scale * wi;
        }
    });
}

/// RMSNorm of each w.len()-long piece of `x`, in place (q/k heads, block outputs).
pub(crate) fn rmsnorm_in_place(x: &mut [f32], w: &[f32], eps: f32) {
    for xr in x.chunks_exact_mut(w.len()) {
        let scale = 1.0 / (sum_of_squares(xr) / w.len() as f32 + eps).sqrt();
        xr.iter_mut().zip(w).for_each(|(v, wi)| *v = *v * scale * wi);
    }
}

/// Gemma 2's soft-capping: each value squashed into cap * tanh(v / cap).
pub fn softcap(x: &mut [f32], cap: f32) {
    x.iter_mut().for_each(|v| *v = cap * (*v / cap).tanh());
}

pub(crate) fn layernorm(out: &mut [f32], x: &[f32], w: &[f32], b: Option<&[f32]>, eps: f32) {
    let n = w.len();
    for (o, xr) in out.chunks_exact_mut(n).zip(x.chunks_exact(n)) {
        let mean = xr.iter().sum::<f32>() / n as f32;
        let var = xr.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n as f32;
        let scale = 1.0 / (var + eps).sqrt();
        for (i, (oi, xi)) in o.iter_mut().zip(xr).enumerate() {
            *oi = (xi - mean) * scale * w[i] + b.map_or(0.0, |b| b[i]);
        }
    }
}

/// The family's normalization: RMSNorm for LLaMA-style models, LayerNorm (with bias) otherwise.
pub(crate) fn norm_rows(
    family: Family,
    out: &mut [f32],
    x: &[f32],
    w: &[f32],
    b: Option<&[f32]>,
    eps: f32,
) {
    match family {
        Family::Llama => rmsnorm(out, x, w, eps),
        Family::Falcon | Family::Opt => layernorm(out, x, w, b, eps),
    }
}

/// Adds `bias` to every row of `x`.
pub(crate) fn add_bias(x: &mut [f32], bias: Option<&[f32]>) {
    if let Some(b) = bias {
        x.chunks_exact_mut(b.len()).for_each(|r| r.iter_mut().zip(b).for_each(|(v, bi)| *v += bi));
    }
}

pub(crate) fn add_into(x: &mut [f32], d: &[f32]) {
    let add = |(x, d): (&mut [f32], &[f32])| x.iter_mut().zip(d).for_each(|(x, d)| *x += d);
    if x.len() >= PARALLEL_FROM {
        x.par_chunks_mut(4096).zip(d.par_chunks(4096)).for_each(add);
    } else {
        add((x, d));
    }
}

/// Rotates each head of `x` (n, n_heads * head_dim) by its token's angles.
pub(crate) fn rope_rows(
    x: &mut [f32],
    head_dim: usize,
    rope_dim: usize,
    style: RopeStyle,
    cos: &[f32],
    sin: &[f32],
) {
    let half = rope_dim / 2;
    if half == 0 || style == RopeStyle::None {
        return;
    }
    let row_len = x.len() / (cos.len() / half);
    each_row(x, cos, row_len, half, |t, row, c| {
        let s = &sin[t * half..(t + 1) * half];
        for head in row.chunks_exact_mut(head_dim) {
            for i in 0..half {
                let (a, b) = match style {
                    RopeStyle::NeoX => (i, i + half),
                    _ => (2 * i, 2 * i + 1),
                };
                let (x0, x1) = (head[a], head[b]);
                head[a] = x0 * c[i] - x1 * s[i];
                head[b] = x0 * s[i] + x1 * c[i];
            }
        }
    });
}
