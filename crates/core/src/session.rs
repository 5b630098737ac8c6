//! A `Session` is one conversation with a model: the KV cache, the position, the token history
//! and the scratch buffers of the forward pass. Sessions are independent, so several can run on
//! one shared `Model` from different threads.
//!
//! `eval` runs the LLaMA-family forward pass over a batch of tokens (the whole prompt at once in
//! prefill, one token per call in decode) and returns logits.

use std::sync::Arc;

use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::attention::{attend_group, KvBuf, KvType};
use crate::matmul::{matmul, matmul_many, Activations};
use crate::model::{Model, RopeStyle};

pub struct Session {
    pub model: Arc<Model>,
    pub n_ctx: usize,
    /// Every token evaluated so far; `tokens.len()` is the next position.
    pub tokens: Vec<u32>,
    k_cache: Vec<KvBuf>,     // per layer (n_ctx, n_head_kv * head_dim)
    v_cache: Vec<KvBuf>,     // per layer (n_ctx, n_head_kv * head_dim)
    rope_inv_freq: Vec<f32>, // (rope_dim / 2)
    s: Scratch,
}

/// Activation buffers, resized per batch and reused across calls.
#[derive(Default)]
struct Scratch {
    x: Vec<f32>,      // (n, n_embd) residual stream
    xb: Vec<f32>,     // (n, n_embd) normed input / projection output
    q: Vec<f32>,      // (n, q_dim)
    k: Vec<f32>,      // (n, kv_dim)
    v: Vec<f32>,      // (n, kv_dim)
    att: Vec<f32>,    // (n, q_dim) attention output
    gate: Vec<f32>,   // (n, n_ff)
    up: Vec<f32>,     // (n, n_ff)
    acts: Activations,
    cos: Vec<f32>,    // (n, rope_dim / 2)
    sin: Vec<f32>,    // (n, rope_dim / 2)
}

fn rmsnorm(out: &mut [f32], x: &[f32], w: &[f32], eps: f32) {
    let n = w.len();
    for (o, xr) in out.chunks_exact_mut(n).zip(x.chunks_exact(n)) {
        let ss: f32 = xr.iter().map(|v| v * v).sum::<f32>() / n as f32;
        let scale = 1.0 / (ss + eps).sqrt();
        for ((oi, xi), wi) in o.iter_mut().zip(xr).zip(w) {
            *oi = xi * scale * wi;
        }
    }
}

/// Rotates each head of `x` (n, n_heads * head_dim) by its token's angles.
fn rope(x: &mut [f32], head_dim: usize, rope_dim: usize, style: RopeStyle, cos: &[f32], sin: &[f32]) {
    let half = rope_dim / 2;
    let row_len = x.len() / (cos.len() / half);
    for (t, row) in x.chunks_exact_mut(row_len).enumerate() {
        let (c, s) = (&cos[t * half..(t + 1) * half], &sin[t * half..(t + 1) * half]);
        for head in row.chunks_exact_mut(head_dim) {
            for i in 0..half {
                let (a, b) = match style {
                    RopeStyle::Normal => (2 * i, 2 * i + 1),
                    RopeStyle::NeoX => (i, i + half),
                };
                let (x0, x1) = (head[a], head[b]);
                head[a] = x0 * c[i] - x1 * s[i];
                head[b] = x0 * s[i] + x1 * c[i];
            }
        }
    }
}

impl Session {
    pub fn new(model: Arc<Model>, n_ctx: usize, kv_type: KvType) -> Result<Session> {
        let c = &model.config;
        if n_ctx == 0 {
            return Err(Error::InvalidArgument("n_ctx must be > 0".into()));
        }
        let per_layer = n_ctx
            .checked_mul(c.kv_dim())
            .ok_or_else(|| Error::InvalidArgument(format!("n_ctx {n_ctx} is too large")))?;
        let cache = || (0..c.n_layer).map(|_| KvBuf::new(kv_type, per_layer)).collect::<Result<Vec<_>>>();
        let rope_inv_freq =
            (0..c.rope_dim / 2).map(|i| c.rope_base.powf(-2.0 * i as f32 / c.rope_dim as f32)).collect();
        Ok(Session {
            n_ctx,
            tokens: Vec::new(),
            k_cache: cache()?,
            v_cache: cache()?,
            rope_inv_freq,
            s: Scratch::default(),
            model,
        })
    }

    pub fn pos(&self) -> usize {
        self.tokens.len()
    }

    /// Forgets everything after the first `n` tokens (the cache beyond is simply overwritten).
    pub fn truncate(&mut self, n: usize) {
        self.tokens.truncate(n);
    }

    /// Evaluates `tokens` at the next positions and returns logits: (n, n_vocab) when
    /// `all_logits`, else only the last token's (n_vocab).
    pub fn eval(&mut self, tokens: &[u32], all_logits: bool) -> Result<Vec<f32>> {
        let model = Arc::clone(&self.model);
        let c = &model.config;
        if tokens.is_empty() {
            return Err(Error::InvalidArgument("no tokens to evaluate".into()));
        }
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= c.n_vocab) {
            return Err(Error::InvalidArgument(format!("token id {bad} is out of range (vocabulary has {})", c.n_vocab)));
        }
        let needed = self.pos() + tokens.len();
        if needed > self.n_ctx {
            return Err(Error::ContextOverflow { needed, n_ctx: self.n_ctx });
        }
        let logits = model.install(|| self.forward(tokens, all_logits));
        self.tokens.extend_from_slice(tokens);
        Ok(logits)
    }

    fn forward(&mut self, tokens: &[u32], all_logits: bool) -> Vec<f32> {
        let model = Arc::clone(&self.model);
        let (c, w) = (&model.config, &model.weights);
        let n = tokens.len();
        let pos0 = self.pos();
        let (dim, q_dim, kv_dim, hd) = (c.n_embd, c.q_dim(), c.kv_dim(), c.head_dim);
        let s = &mut self.s;
        s.x.resize(n * dim, 0.0);
        s.xb.resize(n * dim, 0.0);
        s.q.resize(n * q_dim, 0.0);
        s.k.resize(n * kv_dim, 0.0);
        s.v.resize(n * kv_dim, 0.0);
        s.att.resize(n * q_dim, 0.0);
        s.gate.resize(n * c.n_ff, 0.0);
        s.up.resize(n * c.n_ff, 0.0);

        // token embeddings: x[t] = token_embd[tokens[t]]
        for (t, &tok) in tokens.iter().enumerate() {
            w.token_embd.dequantize_row(tok as usize, &mut s.x[t * dim..(t + 1) * dim]);
        }

        // RoPE angles for positions pos0..pos0+n, shared by every layer
        let half = c.rope_dim / 2;
        s.cos.resize(n * half, 0.0);
        s.sin.resize(n * half, 0.0);
        for t in 0..n {
            for (i, f) in self.rope_inv_freq.iter().enumerate() {
                let angle = (pos0 + t) as f32 * f;
                s.cos[t * half + i] = angle.cos();
                s.sin[t * half + i] = angle.sin();
            }
        }

        for (l, lw) in w.layers.iter().enumerate() {
            // attention rmsnorm
            rmsnorm(&mut s.xb, &s.x, &lw.attn_norm, c.rms_eps);

            // qkv matmuls for these positions: q (n, q_dim), k and v (n, kv_dim)
            s.acts.set(&s.xb, n, dim);
            matmul_many(&[lw.wq, lw.wk, lw.wv], &s.acts, &mut [&mut s.q, &mut s.k, &mut s.v]);
            for (buf, bias) in [(&mut s.q, &lw.bq), (&mut s.k, &lw.bk), (&mut s.v, &lw.bv)] {
                if let Some(b) = bias {
                    buf.chunks_exact_mut(b.len()).for_each(|r| r.iter_mut().zip(b).for_each(|(x, bi)| *x += bi));
                }
            }

            // RoPE on q and k
            rope(&mut s.q, hd, c.rope_dim, c.rope_style, &s.cos, &s.sin);
            rope(&mut s.k, hd, c.rope_dim, c.rope_style, &s.cos, &s.sin);

            // store k and v in the cache at positions pos0..pos0+n
            self.k_cache[l].write(pos0 * kv_dim, &s.k);
            self.v_cache[l].write(pos0 * kv_dim, &s.v);

            // multihead attention, causal: token t attends to positions 0..=pos0+t; the
            // n_head / n_head_kv query heads that share a kv head are computed together (GQA)
            let (kc, vc) = (&self.k_cache[l], &self.v_cache[l]);
            let group = c.n_head / c.n_head_kv;
            let scale = 1.0 / (hd as f32).sqrt();
            let q = &s.q;
            s.att.par_chunks_mut(group * hd).enumerate().for_each_init(Vec::new, |scores: &mut Vec<f32>, (idx, out)| {
                let (t, g) = (idx / c.n_head_kv, idx % c.n_head_kv);
                // the query heads of kv head g are contiguous: g * group .. (g + 1) * group
                let qs = &q[t * q_dim + g * group * hd..t * q_dim + (g + 1) * group * hd];
                let len = pos0 + t + 1;
                let rows = len * kv_dim;
                attend_group(qs, hd, kc.view(rows), vc.view(rows), len, kv_dim, g * hd, scale, scores, out);
            });

            // output projection, then residual
            s.acts.set(&s.att, n, q_dim);
            matmul(&lw.wo, &s.acts, &mut s.xb);
            s.x.iter_mut().zip(&s.xb).for_each(|(x, d)| *x += d);

            // ffn rmsnorm
            rmsnorm(&mut s.xb, &s.x, &lw.ffn_norm, c.rms_eps);

            // gate and up: (n, n_ff) each
            s.acts.set(&s.xb, n, dim);
            matmul_many(&[lw.ffn_gate, lw.ffn_up], &s.acts, &mut [&mut s.gate, &mut s.up]);

            // activation: gate <- act(gate) * up (or relu(up))
            let act = c.ffn_activation;
            s.gate.par_chunks_mut(4096).zip(s.up.par_chunks(4096)).for_each(|(g, u)| {
                for (gi, &ui) in g.iter_mut().zip(u) {
                    *gi = act.apply(*gi, ui);
                }
            });

            // down projection, then residual
            s.acts.set(&s.gate, n, c.n_ff);
            matmul(&lw.ffn_down, &s.acts, &mut s.xb);
            s.x.iter_mut().zip(&s.xb).for_each(|(x, d)| *x += d);
        }

        // final rmsnorm and classifier, for every token or only the last
        let rows = if all_logits { 0..n } else { n - 1..n };
        let m = rows.len();
        rmsnorm(&mut s.xb[..m * dim], &s.x[rows.start * dim..rows.end * dim], &w.output_norm, c.rms_eps);
        s.acts.set(&s.xb[..m * dim], m, dim);
        let mut logits = vec![0.0f32; m * c.n_vocab];
        matmul(&w.output, &s.acts, &mut logits);
        logits
    }
}
