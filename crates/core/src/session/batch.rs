//! Batched decode across sessions: the next token of each of several sessions of one model,
//! evaluated as one batch. The weight matrices are read once per batch instead of once per
//! session, which is what lets a server with several clients go faster than running them in turn.
//!
//! The pass is the one forward pass (`forward.rs`) on the CPU backend with one row per session
//! (`CpuPass::batch`): each row attends over its own session's KV cache at its own position;
//! dense FFNs run as one batch, sparse ones each row through its own session's one-token
//! operator. Every session gets bit for bit the logits that `Session::eval` of its one token
//! gives: per token the arithmetic is the same (the matmul kernels keep one accumulator per
//! token), which tests/test_batched_decode.py checks for every architecture and sparsity mode.
//!
//! This must not change a session's state beyond what `eval` of one token would.

use super::{forward, Arc, CpuPass, Error, Result, Session};

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
            return Err(Error::InvalidArgument(format!(
                "session {i} runs another model than session 0"
            )));
        }
        if tok as usize >= c.n_vocab {
            return Err(Error::InvalidArgument(format!(
                "token id {tok} is out of range (vocabulary has {})",
                c.n_vocab
            )));
        }
        if se.pos() + 1 > se.n_ctx {
            return Err(Error::ContextOverflow { needed: se.pos() + 1, n_ctx: se.n_ctx });
        }
        if se.state.recorder.is_some() {
            return Err(Error::InvalidArgument(format!(
                "session {i} is calibrating or capturing; evaluate it alone"
            )));
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
    if sessions.iter().any(|se| se.state.sparsity.is_inputs()) {
        return sessions.iter_mut().zip(tokens).map(|(se, &tok)| se.eval(&[tok], false)).collect();
    }
    let n = tokens.len();
    let logits = model.install(|| {
        forward(
            &mut CpuPass::batch(sessions.iter_mut().map(|se| &mut **se).collect()),
            &model,
            tokens,
            n,
        )
    })?;
    for (se, &tok) in sessions.iter_mut().zip(tokens) {
        se.tokens.push(tok);
    }
    Ok(logits.chunks_exact(model.config.n_vocab).map(|r| r.to_vec()).collect())
}
