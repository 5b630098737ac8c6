//! The CPU's mixture-of-experts FFN over a pass's rows, in two steps as llama.cpp's
//! `build_moe_ffn` (softmax gating): `route_rows` picks each row's experts and their weights,
//! `expert_rows` runs them. The rows are grouped by expert, so a prompt (or a batch of
//! sessions) reads each chosen expert's weights once (llama.cpp's `mul_mat_id`), and a decode
//! token reads only its own experts' rows. Each row's result does not depend on which other
//! rows share its pass: its experts' contributions are added in expert order, and every
//! product is the one it would be alone.

use super::{matmul, matmul_many, FfnActivation, FfnStats, Model, Scratch};

/// Layer `l`'s routing of n rows: router logits (n, n_expert) = xb @ router^T, a softmax per
/// row, the `n_used` most probable experts (the lower index first among equals) with their
/// probabilities as weights (divided by their sum where the model normalises them, times its
/// scale), into s.routes (n, n_used) as (expert, weight), most probable first.
pub(crate) fn route_rows(model: &Model, s: &mut Scratch, l: usize, n: usize) {
    let (c, lw) = (&model.config, &model.weights.layers[l]);
    let (cfg, mw) = (c.moe.expect("a mixture-of-experts model"), lw.moe.as_ref().expect("experts"));
    let (dim, n_expert) = (c.n_embd, cfg.n_expert);
    s.acts.set_for(&s.xb[..n * dim], n, dim, &[mw.router]);
    s.router_logits.resize(n * n_expert, 0.0);
    matmul(&mw.router, &s.acts, &mut s.router_logits);
    s.routes.clear();
    let mut order: Vec<u32> = Vec::with_capacity(n_expert);
    for logits in s.router_logits.chunks_exact_mut(n_expert) {
        // softmax, as ggml's soft_max: exp(v - max) / sum
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        logits.iter_mut().for_each(|v| *v = (*v - max).exp());
        let sum: f32 = logits.iter().sum();
        logits.iter_mut().for_each(|v| *v /= sum);
        // the n_used largest, most probable first (NaN, from a NaN logit, last)
        order.clear();
        order.extend(0..n_expert as u32);
        order.sort_by(|&a, &b| {
            let (pa, pb) = (logits[a as usize], logits[b as usize]);
            pb.partial_cmp(&pa).unwrap_or_else(|| pa.is_nan().cmp(&pb.is_nan())).then(a.cmp(&b))
        });
        let chosen = &order[..cfg.n_used];
        let total: f32 = chosen.iter().map(|&e| logits[e as usize]).sum();
        let norm = if cfg.normalize_weights { total } else { 1.0 };
        s.routes.extend(chosen.iter().map(|&e| (e, logits[e as usize] / norm * cfg.weights_scale)));
    }
}

/// ffn_out (n, n_embd) = for each row, the sum over its routed experts (s.routes) of
/// weight * down(silu(gate(xb)) * up(xb)), in expert order, plus the shared expert's output
/// times sigmoid(gate_inp . xb) where the layer has one. Counts neurons, the routed-away ones
/// as skipped, and the weight bytes each row reads (router, shared expert, its own experts)
/// against those of running every expert.
pub(crate) fn expert_rows(
    model: &Model,
    s: &mut Scratch,
    stats: &mut FfnStats,
    l: usize,
    n: usize,
) {
    let (c, lw) = (&model.config, &model.weights.layers[l]);
    let (cfg, mw) = (c.moe.expect("a mixture-of-experts model"), lw.moe.as_ref().expect("experts"));
    let (dim, ff, k) = (c.n_embd, cfg.n_ff_exp, cfg.n_used);
    let ffn_out = &mut s.ffn_out[..n * dim];
    ffn_out.fill(0.0);
    for e in 0..cfg.n_expert {
        // the rows routed to expert e, and their weights
        s.expert_rows.clear();
        s.expert_rows.extend(
            s.routes[..n * k]
                .iter()
                .enumerate()
                .filter(|(_, &(ex, _))| ex as usize == e)
                .map(|(i, &(_, w))| ((i / k) as u32, w)),
        );
        let m = s.expert_rows.len();
        if m == 0 {
            continue;
        }
        let ex = mw.expert(e);
        // their inputs (m, n_embd), gate and up (m, n_ff_exp), h = silu(gate) * up, down
        s.expert_in.resize(m * dim, 0.0);
        for (i, &(t, _)) in s.expert_rows.iter().enumerate() {
            let t = t as usize;
            s.expert_in[i * dim..(i + 1) * dim].copy_from_slice(&s.xb[t * dim..(t + 1) * dim]);
        }
        s.acts.set_for(&s.expert_in, m, dim, &[ex.gate, ex.up]);
        s.gate.resize(m * ff, 0.0);
        s.up.resize(m * ff, 0.0);
        matmul_many(&[ex.gate, ex.up], &s.acts, &mut [&mut s.gate[..m * ff], &mut s.up[..m * ff]]);
        FfnActivation::SwiGlu.apply_all(&mut s.gate[..m * ff], &s.up[..m * ff]);
        s.acts.set_for(&s.gate[..m * ff], m, ff, &[ex.down]);
        s.expert_out.resize(m * dim, 0.0);
        matmul(&ex.down, &s.acts, &mut s.expert_out);
        for (i, &(t, w)) in s.expert_rows.iter().enumerate() {
            let t = t as usize;
            let (out, y) = (&mut s.ffn_out[t * dim..(t + 1) * dim], &s.expert_out[i * dim..]);
            out.iter_mut().zip(y).for_each(|(o, y)| *o += w * y);
        }
    }
    let mut shared_bytes = 0;
    if let Some(sh) = &mw.shared {
        // the shared expert over every row, scaled by sigmoid(gate_inp . xb)
        let n_sh = sh.gate.rows;
        shared_bytes = sh.gate.data.len() + sh.up.data.len() + sh.down.data.len();
        s.acts.set_for(&s.xb[..n * dim], n, dim, &[sh.gate, sh.up]);
        s.gate.resize(n * n_sh, 0.0);
        s.up.resize(n * n_sh, 0.0);
        matmul_many(
            &[sh.gate, sh.up],
            &s.acts,
            &mut [&mut s.gate[..n * n_sh], &mut s.up[..n * n_sh]],
        );
        FfnActivation::SwiGlu.apply_all(&mut s.gate[..n * n_sh], &s.up[..n * n_sh]);
        s.acts.set_for(&s.gate[..n * n_sh], n, n_sh, &[sh.down]);
        s.expert_out.resize(n * dim, 0.0);
        matmul(&sh.down, &s.acts, &mut s.expert_out);
        for t in 0..n {
            let x = &s.xb[t * dim..(t + 1) * dim];
            let g: f32 = x.iter().zip(&sh.gate_inp).map(|(x, g)| x * g).sum();
            let scale = 1.0 / (1.0 + (-g).exp());
            let (out, y) = (&mut s.ffn_out[t * dim..(t + 1) * dim], &s.expert_out[t * dim..]);
            out.iter_mut().zip(y).for_each(|(o, y)| *o += scale * y);
        }
    }
    let (n64, e64, k64) = (n as u64, cfg.n_expert as u64, k as u64);
    let expert_bytes =
        (mw.gate_exps.data.len() + mw.up_exps.data.len() + mw.down_exps.data.len()) as u64 / e64;
    let always = (mw.router.data.len() + shared_bytes) as u64;
    stats.neurons += n64 * e64 * ff as u64;
    stats.skipped += n64 * (e64 - k64) * ff as u64;
    stats.weight_bytes += n64 * (always + e64 * expert_bytes);
    stats.weight_bytes_read += n64 * (always + k64 * expert_bytes);
}
