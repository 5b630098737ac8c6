//! Scalar CPU twins of the GPU kernels: the same function over the same buffer layouts (packed
//! hot rows, int8 activation blocks), written plainly, accumulated in f64. The GPU tests compare
//! every kernel with its twin on random inputs, and the emulated device (`device::emulated`)
//! runs the twins in place of the kernels, so the hybrid executor runs without a GPU.

use powerinfer_core::matmul::QMatrix;
use powerinfer_core::model::FfnActivation;
use powerinfer_core::quant::{dequantize_row, quantize_act, BlockQ8Act, DType, QK};
use powerinfer_core::session::Sparsity;
use rayon::prelude::*;

use crate::device::AttnShape;

/// Row r of `m`, dequantized.
pub fn row_f32(m: &QMatrix, r: usize) -> Vec<f32> {
    let mut out = vec![0.0; m.cols];
    dequantize_row(m.dtype, m.row(r), &mut out);
    out
}

/// The input a matrix of type `dtype` reads: `x` itself for float weights; for quantized ones,
/// `x` rounded to int8 blocks by the CPU's `quantize_act` (which `quantize_q8` reproduces).
pub fn input_seen(dtype: DType, x: &[f32]) -> Vec<f32> {
    if !dtype.is_quantized() {
        return x.to_vec();
    }
    q8_values(&q8_bytes(x))
}

/// The values of int8 activation blocks (`BlockQ8Act` bytes, as `quantize_q8` writes them):
/// what a kernel reading a quantized matrix sees of its input.
pub fn q8_values(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(std::mem::size_of::<BlockQ8Act>())
        .flat_map(|b| {
            let d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            b[8..].iter().map(move |&q| q as i8 as f32 * d)
        })
        .collect()
}

/// `quantize_q8`: `x` as int8 blocks, the bytes of the CPU's `quantize_act`.
pub fn q8_bytes(x: &[f32]) -> Vec<u8> {
    let mut blocks = vec![BlockQ8Act::default(); x.len() / QK];
    quantize_act(x, &mut blocks);
    blocks
        .iter()
        .flat_map(|b| {
            b.d.to_le_bytes()
                .into_iter()
                .chain(b.s.to_le_bytes())
                .chain(b.qs.iter().map(|&q| q as u8))
        })
        .collect()
}

/// The rows `rows` of `m`, packed in that order: the layout of a matrix's hot rows on the GPU.
pub fn pack_rows(m: &QMatrix, rows: &[u32]) -> Vec<u8> {
    rows.iter().flat_map(|&r| m.row(r as usize).iter().copied()).collect()
}

fn dot(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum()
}

/// `matvec_*`: y[r] = W[r] . x (+ bias[r]), relu'd when asked.
pub fn matvec(w: &QMatrix, x: &[f32], bias: Option<&[f32]>, relu: bool) -> Vec<f32> {
    matvec_seen(w, &input_seen(w.dtype, x), bias, relu)
}

/// `matvec` of an input as the kernel sees it (see `input_seen`); rows in parallel, each
/// one plain f64 sum.
pub fn matvec_seen(w: &QMatrix, x: &[f32], bias: Option<&[f32]>, relu: bool) -> Vec<f32> {
    (0..w.rows)
        .into_par_iter()
        .map(|r| {
            let v = (dot(&row_f32(w, r), x) + bias.map_or(0.0, |b| b[r] as f64)) as f32;
            if relu {
                v.max(0.0)
            } else {
                v
            }
        })
        .collect()
}

/// `ffn_hot_*` over packed hot rows (row i of `gate` and `up` is neuron bucket[i]): h[i] for
/// neuron bucket[i] (with `bias`, [gate's, up's], indexed by neuron), 0 where the predictor's
/// logit is below the threshold.
pub fn ffn_hot(
    gate: Option<&QMatrix>,
    up: &QMatrix,
    bucket: &[u32],
    x: &[f32],
    bias: [Option<&[f32]>; 2],
    pred: Option<(&[f32], f32)>,
    act: FfnActivation,
) -> Vec<f32> {
    ffn_hot_seen(gate, up, bucket, &input_seen(up.dtype, x), bias, pred, act)
}

/// `ffn_hot` of an input as the kernel sees it (see `input_seen`).
pub fn ffn_hot_seen(
    gate: Option<&QMatrix>,
    up: &QMatrix,
    bucket: &[u32],
    x: &[f32],
    bias: [Option<&[f32]>; 2],
    pred: Option<(&[f32], f32)>,
    act: FfnActivation,
) -> Vec<f32> {
    let [gate_bias, up_bias] = bias;
    bucket
        .par_iter()
        .enumerate()
        .map(|(i, &j)| {
            let j = j as usize;
            if let Some((logits, thr)) = pred {
                if !Sparsity::predictor_selects(logits[j], thr) {
                    return 0.0;
                }
            }
            let g = gate.map_or(0.0, |g| {
                (dot(&row_f32(g, i), x) + gate_bias.map_or(0.0, |b| b[j] as f64)) as f32
            });
            let u = (dot(&row_f32(up, i), x) + up_bias.map_or(0.0, |b| b[j] as f64)) as f32;
            act.apply(g, u)
        })
        .collect()
}

/// `down_partial_*` summed by `ffn_merge`: out = sum_i h[i] * down_t[i] over packed rows.
pub fn down(down_t: &QMatrix, h: &[f32]) -> Vec<f32> {
    let mut out = vec![0.0f64; down_t.cols];
    for (i, &a) in h.iter().enumerate() {
        if a != 0.0 {
            for (o, v) in out.iter_mut().zip(row_f32(down_t, i)) {
                *o += a as f64 * v as f64;
            }
        }
    }
    out.into_iter().map(|v| v as f32).collect()
}

/// `rmsnorm`
pub fn rmsnorm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let ss = x.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / x.len() as f64;
    let scale = 1.0 / (ss + eps as f64).sqrt();
    x.iter().zip(w).map(|(&v, &wi)| (v as f64 * scale * wi as f64) as f32).collect()
}

/// `rope` on every head of x at one position.
pub fn rope(x: &mut [f32], cos: &[f32], sin: &[f32], head_dim: usize, rope_dim: usize, neox: bool) {
    let half = rope_dim / 2;
    for head in x.chunks_exact_mut(head_dim) {
        for i in 0..half {
            let (a, b) = if neox { (i, i + half) } else { (2 * i, 2 * i + 1) };
            let (x0, x1) = (head[a] as f64, head[b] as f64);
            let (c, s) = (cos[i] as f64, sin[i] as f64);
            head[a] = (x0 * c - x1 * s) as f32;
            head[b] = (x0 * s + x1 * c) as f32;
        }
    }
}

/// `head_rmsnorm`: each head of x (chunks of head_dim) RMS-normed in place, times w.
pub fn head_rmsnorm(x: &mut [f32], w: &[f32], head_dim: usize, eps: f32) {
    for head in x.chunks_exact_mut(head_dim) {
        head.copy_from_slice(&rmsnorm(head, w, eps));
    }
}

/// `attention`: one query (n_head * head_dim) at position len - 1 over f32 caches (len,
/// n_head_kv * head_dim): all positions, or a sliding layer's last `at.window`; each head's
/// sink logit (if given) in its softmax's sum, with no value.
pub fn attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    len: usize,
    at: &AttnShape,
    sinks: Option<&[f32]>,
) -> Vec<f32> {
    let (n_head, n_head_kv, head_dim) = (at.n_head, at.n_head_kv, at.head_dim);
    let kv_dim = n_head_kv * head_dim;
    let first = if at.window > 0 { len.saturating_sub(at.window) } else { 0 };
    let cap = |s: f64| {
        if at.softcap > 0.0 {
            at.softcap as f64 * (s / at.softcap as f64).tanh()
        } else {
            s
        }
    };
    let mut out = vec![0.0f32; n_head * head_dim];
    for h in 0..n_head {
        let g = h / (n_head / n_head_kv);
        let qh = &q[h * head_dim..(h + 1) * head_dim];
        let scores: Vec<f64> = (first..len)
            .map(|t| cap(dot(qh, &k[t * kv_dim + g * head_dim..][..head_dim]) * at.scale as f64))
            .collect();
        let sink = sinks.map(|s| s[h] as f64);
        let m = scores.iter().cloned().chain(sink).fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
        let sum: f64 = e.iter().sum::<f64>() + sink.map_or(0.0, |s| (s - m).exp());
        for d in 0..head_dim {
            let acc: f64 = (first..len)
                .zip(&e)
                .map(|(t, &p)| p * v[t * kv_dim + g * head_dim + d] as f64)
                .sum();
            out[h * head_dim + d] = (acc / sum) as f32;
        }
    }
    out
}
