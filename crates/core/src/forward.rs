//! The forward pass, written once: the steps of the transformer layer, in order, over a pass's
//! rows. A row is one token at one position of one session (whose KV cache it reads and
//! extends): `Session::eval` runs many rows of one session, `decode_batch` one row per session,
//! the hybrid executor one row at a time.
//!
//! Where each step runs is the `Backend`'s business: the CPU (`session::CpuPass`) or a GPU with
//! the CPU (`powerinfer_cuda::hybrid`). Architecture differences are `Config` data read here
//! (sequential or parallel residual, which norm feeds attention, whether q/k and the block
//! outputs are normed, which layers turn q and k, what the router reads); finer differences
//! (embedding scale, soft-capping, sliding windows, RoPE sets) are `Config` data the steps read. This module computes nothing itself and must not
//! grow per-backend branches.

use crate::model::{Family, Model, RouterInput};
use crate::Result;

/// Which of a layer's norms produces the block input xb.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Norm {
    /// `attn_norm`: attention's input (and Falcon's FFN input).
    Attn,
    /// `attn_norm_2`: attention's input in Falcon-40B layers.
    Attn2,
    /// `ffn_norm`: the FFN's input in sequential blocks.
    Ffn,
}

/// Which block output the residual stream receives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    Attn,
    Ffn,
}

/// The steps of the layer over a pass's rows (n of them). The backend holds the activations:
///   x         (n, n_embd)  the residual stream
///   xb        (n, n_embd)  the normed input of the current block
///   q         (n, q_dim), k and v (n, kv_dim)
///   att       (n, q_dim)   attention's output before the projection
///   attn_out  (n, n_embd), ffn_out (n, n_embd): the block outputs
/// and each row's session: its KV cache, sparsity settings and counters.
pub trait Backend {
    /// x = each row's token embedding (+ its position's, OPT); the RoPE angles of each row's
    /// position, for every layer.
    fn embed(&mut self, tokens: &[u32]) -> Result<()>;
    /// xb = norm(x) with layer l's `which` weights (RMSNorm or LayerNorm, by family).
    fn norm(&mut self, l: usize, which: Norm) -> Result<()>;
    /// q = xb @ wq^T, k = xb @ wk^T, v = xb @ wv^T (+ biases).
    fn qkv(&mut self, l: usize) -> Result<()>;
    /// Each head of q and of k RMSNormed with the layer's `q_norm`, `k_norm` (head_dim).
    fn qk_norm(&mut self, l: usize) -> Result<()>;
    /// q and k turned by each row's position angles (the layer's RoPE set).
    fn rope(&mut self, l: usize) -> Result<()>;
    /// Each row's k and v into its session's layer-l cache, at the row's position.
    fn kv_store(&mut self, l: usize) -> Result<()>;
    /// att = softmax(q k^T * attn_scale) v, each row over its session's cache up to and
    /// including its own position (causal; in a sliding layer only the window's last positions),
    /// scores soft-capped where the model says; the query heads sharing a kv head read it
    /// together.
    fn attend(&mut self, l: usize) -> Result<()>;
    /// attn_out = att @ wo^T (+ bias).
    fn attn_out(&mut self, l: usize) -> Result<()>;
    /// ffn_out = down(act(gate(xb), up(xb))) (+ biases) over the neurons the row's session
    /// selects (`session::Sparsity`; a predictor reads x).
    fn ffn(&mut self, l: usize) -> Result<()>;
    /// Mixture-of-experts layers (`LayerWeights::moe`) in place of `ffn`: each row's experts
    /// and their weights, from the router's probabilities (`Moe::gating`) over xb, or over the
    /// layer input x where the model routes on it (`Moe::router_input`).
    fn route(&mut self, l: usize) -> Result<()>;
    /// ffn_out = the sum over each row's routed experts of weight * expert(xb) (FFNs of the
    /// model's activation), plus the shared expert's output scaled by its gate where the layer
    /// has one.
    fn experts(&mut self, l: usize) -> Result<()>;
    /// attn_out or ffn_out RMSNormed with the layer's post-block norm (Gemma 2 and 3).
    fn post_norm(&mut self, l: usize, part: Part) -> Result<()>;
    /// x += layer l's attn_out or ffn_out.
    fn residual(&mut self, l: usize, part: Part) -> Result<()>;
    /// The final norm and the classifier over the last `m` rows: logits (m, n_vocab), soft-capped
    /// where the model says.
    fn logits(&mut self, m: usize) -> Result<Vec<f32>>;
}

/// Runs `tokens` (one per row) through every layer and returns the logits of the last
/// `n_logits` rows (n_logits, n_vocab).
pub fn forward<B: Backend>(
    b: &mut B,
    model: &Model,
    tokens: &[u32],
    n_logits: usize,
) -> Result<Vec<f32>> {
    b.embed(tokens)?;
    for l in 0..model.config.n_layer {
        layer(b, model, l)?;
    }
    b.logits(n_logits)
}

/// One transformer block.
fn layer<B: Backend>(b: &mut B, model: &Model, l: usize) -> Result<()> {
    let lw = &model.weights.layers[l];
    let has_attn_norm_2 = lw.attn_norm_2.is_some();
    match model.config.family {
        Family::Llama | Family::Opt => {
            // a router that reads the layer input routes first (SmallThinker)
            let routes_first = lw.moe.is_some()
                && model.config.moe.is_some_and(|m| m.router_input == RouterInput::LayerInput);
            if routes_first {
                b.route(l)?;
            }
            // attention norm, attention, (post-attention norm), residual
            b.norm(l, Norm::Attn)?;
            attention(b, model, l)?;
            if lw.attn_post_norm.is_some() {
                b.post_norm(l, Part::Attn)?;
            }
            b.residual(l, Part::Attn)?;

            // ffn norm, ffn (its predictor reads the residual x) or the routed experts,
            // (post-FFN norm), residual
            b.norm(l, Norm::Ffn)?;
            if lw.moe.is_some() {
                if !routes_first {
                    b.route(l)?;
                }
                b.experts(l)?;
            } else {
                b.ffn(l)?;
            }
            if lw.ffn_post_norm.is_some() {
                b.post_norm(l, Part::Ffn)?;
            }
            b.residual(l, Part::Ffn)
        }
        Family::Falcon => {
            // attention reads attn_norm_2(x) when the layer has it (Falcon-40B), else attn_norm(x)
            b.norm(l, if has_attn_norm_2 { Norm::Attn2 } else { Norm::Attn })?;
            attention(b, model, l)?;

            // the FFN reads attn_norm(x); its predictor reads the layer input x itself
            if has_attn_norm_2 {
                b.norm(l, Norm::Attn)?;
            }
            b.ffn(l)?;

            // parallel residual: x += attention + ffn
            b.residual(l, Part::Attn)?;
            b.residual(l, Part::Ffn)
        }
    }
}

/// The attention block: xb -> attn_out, extending the KV cache by the rows.
fn attention<B: Backend>(b: &mut B, model: &Model, l: usize) -> Result<()> {
    // qkv matmuls, (q/k norms), RoPE on q and k, k and v into the cache
    b.qkv(l)?;
    if model.weights.layers[l].q_norm.is_some() {
        b.qk_norm(l)?;
    }
    if model.config.ropes(l) {
        b.rope(l)?;
    }
    b.kv_store(l)?;
    // multihead attention over the cache, output projection
    b.attend(l)?;
    b.attn_out(l)
}
