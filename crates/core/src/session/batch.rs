//! Batched decode across sessions: the next token of each of several sessions of one model,
//! evaluated as one batch. The weight matrices are read once per batch instead of once per
//! session, which is what lets a server with several clients go faster than running them in turn.
//!
//! Each row attends over its own session's KV cache at its own position. Dense FFNs run as one
//! batch; sparse ones run each row through its own session's single-token operator (with that
//! session's sparsity and counters). Every session gets bit for bit the logits that
//! `Session::eval` of its one token gives: per token the arithmetic is the same (the matmul
//! kernels keep one accumulator per token), which tests/test_batched_decode.py checks for every
//! architecture and sparsity mode.
//!
//! This must not change a session's state beyond what `eval` of one token would.

use super::*;

/// Checks a batch before anything runs, so that a refused batch changes no session: one token
/// per session, one model, every token in the vocabulary, room for one more position, and no
/// session calibrating or capturing. Every executor of a batch calls it.
pub fn check_batch(sessions: &[&Session], tokens: &[u32]) -> Result<()> {
    if sessions.is_empty() || tokens.len() != sessions.len() {
        return Err(Error::InvalidArgument(format!(
            "batched decode needs one token per session, got {} tokens for {} sessions",
            tokens.len(),
            sessions.len()
        )));
    }
    let model = &sessions[0].model;
    let c = &model.config;
    for (i, (se, &tok)) in sessions.iter().zip(tokens).enumerate() {
        if !Arc::ptr_eq(&se.model, model) {
            return Err(Error::InvalidArgument(format!("session {i} runs another model than session 0")));
        }
        if tok as usize >= c.n_vocab {
            return Err(Error::InvalidArgument(format!("token id {tok} is out of range (vocabulary has {})", c.n_vocab)));
        }
        if se.pos() + 1 > se.n_ctx {
            return Err(Error::ContextOverflow { needed: se.pos() + 1, n_ctx: se.n_ctx });
        }
        if se.calibration.is_some() || se.capture.is_some() {
            return Err(Error::InvalidArgument(format!("session {i} is calibrating or capturing; evaluate it alone")));
        }
    }
    Ok(())
}

/// Evaluates `tokens[i]` at the next position of `sessions[i]`, for every i, in one batch, and
/// returns each session's logits (n_vocab). The batch must pass `check_batch`.
pub fn decode_batch(sessions: &mut [&mut Session], tokens: &[u32]) -> Result<Vec<Vec<f32>>> {
    check_batch(&sessions.iter().map(|s| &**s).collect::<Vec<_>>(), tokens)?;
    let model = Arc::clone(&sessions[0].model);
    // input sparsity reads other copies of the weights per row: such sessions run one by one
    if sessions.iter().any(|se| se.sparsity.mode == SparsityMode::Threshold && !se.sparsity.input_thresholds.is_empty()) {
        return sessions.iter_mut().zip(tokens).map(|(se, &tok)| se.eval(&[tok], false)).collect();
    }
    let logits = model.install(|| forward(sessions, tokens));
    for (se, &tok) in sessions.iter_mut().zip(tokens) {
        se.tokens.push(tok);
    }
    Ok(logits)
}

/// The forward pass of one token per session; like `Session::forward`, with per-row positions
/// and caches.
fn forward(sessions: &mut [&mut Session], tokens: &[u32]) -> Vec<Vec<f32>> {
    let model = Arc::clone(&sessions[0].model);
    let (c, w) = (&model.config, &model.weights);
    let n = tokens.len();
    let dim = c.n_embd;
    let positions: Vec<usize> = sessions.iter().map(|se| se.pos()).collect();
    let mut s = Scratch::default();
    s.resize_for(n, c);
    s.embed(w, dim, tokens, positions.iter().copied());
    // every session has the model's RoPE frequencies; each row turns by its own position
    s.rope_angles(&sessions[0].rope_inv_freq, positions.iter().copied());

    for (l, lw) in w.layers.iter().enumerate() {
        layer(sessions, &mut s, l, lw, &positions);
    }

    // final norm and classifier for every row
    norm(c.family, &mut s.xb, &s.x, &w.output_norm, w.output_norm_b.as_deref(), c.norm_eps);
    s.acts.set(&s.xb, n, dim);
    let mut logits = vec![0.0f32; n * c.n_vocab];
    matmul(&w.output, &s.acts, &mut logits);
    logits.chunks_exact(c.n_vocab).map(|r| r.to_vec()).collect()
}

/// One transformer block over the rows in s.x (n, n_embd); the same steps as `Session::layer`.
fn layer(sessions: &mut [&mut Session], s: &mut Scratch, l: usize, lw: &LayerWeights, positions: &[usize]) {
    let model = Arc::clone(&sessions[0].model);
    let c = &model.config;
    match c.family {
        Family::Llama | Family::Opt => {
            // attention norm, attention, residual
            norm(c.family, &mut s.xb, &s.x, &lw.attn_norm, lw.attn_norm_b.as_deref(), c.norm_eps);
            attention(sessions, s, l, lw, positions);
            add_into(&mut s.x, &s.attn_out);

            // ffn norm, ffn, residual
            let ffn_norm = lw.ffn_norm.as_deref().expect("sequential blocks have an FFN norm");
            norm(c.family, &mut s.xb, &s.x, ffn_norm, lw.ffn_norm_b.as_deref(), c.norm_eps);
            ffn(sessions, s, l, lw);
            add_into(&mut s.x, &s.ffn_out);
        }
        Family::Falcon => {
            // attention reads attn_norm_2(x) when the layer has it (Falcon-40B), else attn_norm(x)
            match &lw.attn_norm_2 {
                Some(w2) => layernorm(&mut s.xb, &s.x, w2, lw.attn_norm_2_b.as_deref(), c.norm_eps),
                None => layernorm(&mut s.xb, &s.x, &lw.attn_norm, lw.attn_norm_b.as_deref(), c.norm_eps),
            }
            attention(sessions, s, l, lw, positions);

            // the FFN reads attn_norm(x)
            if lw.attn_norm_2.is_some() {
                layernorm(&mut s.xb, &s.x, &lw.attn_norm, lw.attn_norm_b.as_deref(), c.norm_eps);
            }
            ffn(sessions, s, l, lw);

            // parallel residual: x += attention + ffn
            add_into(&mut s.x, &s.attn_out);
            add_into(&mut s.x, &s.ffn_out);
        }
    }
}

/// Attention of layer `l`: reads s.xb (n, n_embd), writes s.attn_out (n, n_embd); row t stores
/// its k and v in session t's cache at positions[t] and attends over that cache.
fn attention(sessions: &mut [&mut Session], s: &mut Scratch, l: usize, lw: &LayerWeights, positions: &[usize]) {
    let model = Arc::clone(&sessions[0].model);
    let c = &model.config;
    let n = positions.len();
    let (q_dim, kv_dim, hd) = (c.q_dim(), c.kv_dim(), c.head_dim);

    // qkv matmuls for every row: q (n, q_dim), k and v (n, kv_dim), plus biases
    s.acts.set(&s.xb, n, c.n_embd);
    matmul_many(&[lw.wq, lw.wk, lw.wv], &s.acts, &mut [&mut s.q, &mut s.k, &mut s.v]);
    add_bias(&mut s.q, lw.bq.as_deref());
    add_bias(&mut s.k, lw.bk.as_deref());
    add_bias(&mut s.v, lw.bv.as_deref());

    // RoPE on q and k
    rope(&mut s.q, hd, c.rope_dim, c.rope_style, &s.cos, &s.sin);
    rope(&mut s.k, hd, c.rope_dim, c.rope_style, &s.cos, &s.sin);

    // each row's k and v into its own session's cache
    for (t, se) in sessions.iter_mut().enumerate() {
        se.k_cache[l].write(positions[t] * kv_dim, &s.k[t * kv_dim..(t + 1) * kv_dim]);
        se.v_cache[l].write(positions[t] * kv_dim, &s.v[t * kv_dim..(t + 1) * kv_dim]);
    }

    // multihead attention: row t attends to positions 0..=positions[t] of its session (GQA groups)
    let caches: Vec<(&KvBuf, &KvBuf)> = sessions.iter().map(|se| (&se.k_cache[l], &se.v_cache[l])).collect();
    let group = c.n_head / c.n_head_kv;
    let scale = 1.0 / (hd as f32).sqrt();
    let q = &s.q;
    s.att.par_chunks_mut(group * hd).enumerate().for_each_init(Vec::new, |scores: &mut Vec<f32>, (idx, out)| {
        let (t, g) = (idx / c.n_head_kv, idx % c.n_head_kv);
        let qs = &q[t * q_dim + g * group * hd..t * q_dim + (g + 1) * group * hd];
        let len = positions[t] + 1;
        let rows = len * kv_dim;
        let (kc, vc) = caches[t];
        attend_group(qs, hd, kc.view(rows), vc.view(rows), len, kv_dim, g * hd, scale, scores, out);
    });

    // output projection (+ bias)
    s.acts.set(&s.att, n, q_dim);
    matmul(&lw.wo, &s.acts, &mut s.attn_out);
    add_bias(&mut s.attn_out, lw.bo.as_deref());
    let bytes = [lw.wq, lw.wk, lw.wv, lw.wo].iter().map(|m| m.data.len() as u64).sum::<u64>();
    for se in sessions.iter_mut() {
        se.stats.weight_bytes += bytes;
        se.stats.weight_bytes_read += bytes;
    }
}

/// FFN of layer `l`: reads s.xb (and s.x for predictors), writes s.ffn_out (n, n_embd). Dense
/// sessions with a row-major down matrix share one batched pass, exactly the path a single dense
/// token takes; otherwise each row goes through its own session's single-token FFN.
fn ffn(sessions: &mut [&mut Session], s: &mut Scratch, l: usize, lw: &LayerWeights) {
    let model = Arc::clone(&sessions[0].model);
    let c = &model.config;
    let (n, dim, n_ff) = (sessions.len(), c.n_embd, c.n_ff);
    let all_dense = sessions.iter().all(|se| se.sparsity.mode == SparsityMode::Dense);
    match (&lw.ffn_down, all_dense) {
        (Some(down), true) => {
            // gate and up (n, n_ff), the activation, then down
            s.acts.set(&s.xb, n, dim);
            s.gate.resize(n * n_ff, 0.0);
            s.up.resize(n * n_ff, 0.0);
            Session::gate_and_up(lw, &s.acts, &mut s.gate, &mut s.up, false);
            Session::activate(lw, c.ffn_activation, &mut s.gate, &s.up);
            s.acts.set(&s.gate, n, n_ff);
            matmul(down, &s.acts, &mut s.ffn_out);
            add_bias(&mut s.ffn_out, lw.ffn_down_b.as_deref());
            let bytes = lw.ffn_gate.iter().chain([&lw.ffn_up, down]).map(|m| m.data.len() as u64).sum::<u64>();
            for se in sessions.iter_mut() {
                se.stats.neurons += n_ff as u64;
                se.stats.weight_bytes += bytes;
                se.stats.weight_bytes_read += bytes;
            }
        }
        _ => {
            for (t, se) in sessions.iter_mut().enumerate() {
                let row = t * dim..(t + 1) * dim;
                let own = &mut se.s;
                for buf in [&mut own.x, &mut own.xb, &mut own.ffn_out] {
                    buf.resize(dim, 0.0);
                }
                own.x.copy_from_slice(&s.x[row.clone()]);
                own.xb.copy_from_slice(&s.xb[row.clone()]);
                se.ffn(l, lw, 1);
                s.ffn_out[row].copy_from_slice(&se.s.ffn_out);
            }
        }
    }
}
