//! What a session keeps between calls besides its KV cache: the forward pass's activation
//! buffers (`Scratch`) and the profiler's records (`Capture`).

use super::{add_into, Activations, Config, RopeSet, SparseScratch, Weights, OPT_POSITION_OFFSET};

/// Per-layer FFN records of every token evaluated while capturing, for the offline profiler and
/// predictor training.
#[derive(Debug, Clone, Default)]
pub struct Capture {
    /// Tokens recorded.
    pub n_tokens: usize,
    /// Per layer (n_tokens, n_embd): the predictor's input (the residual stream entering the FFN;
    /// for Falcon the layer input).
    pub inputs: Vec<Vec<f32>>,
    /// Per layer (n_tokens, n_ff): how strongly each neuron fires. For ReLU-family activations
    /// |act(gate, up)|, zero exactly when the neuron does not fire; for SwiGLU and GELU, which
    /// never give exact zeros, |act(gate)|, the value threshold mode compares.
    pub scores: Vec<Vec<f32>>,
}

impl Capture {
    pub(crate) fn new(n_layer: usize) -> Capture {
        Capture {
            n_tokens: 0,
            inputs: vec![Vec::new(); n_layer],
            scores: vec![Vec::new(); n_layer],
        }
    }
}

/// Activation buffers, resized per batch and reused across calls.
#[derive(Default)]
pub(crate) struct Scratch {
    pub(crate) x: Vec<f32>,           // (n, n_embd) residual stream
    pub(crate) xb: Vec<f32>,          // (n, n_embd) normed input of attention or FFN
    pub(crate) q: Vec<f32>,           // (n, q_dim)
    pub(crate) k: Vec<f32>,           // (n, kv_dim)
    pub(crate) v: Vec<f32>,           // (n, kv_dim)
    pub(crate) att: Vec<f32>,         // (n, q_dim) attention output before the projection
    pub(crate) attn_out: Vec<f32>,    // (n, n_embd) attention block output
    pub(crate) ffn_out: Vec<f32>,     // (n, n_embd) FFN block output
    pub(crate) gate: Vec<f32>,        // (n, n_ff) gate values, then activations
    pub(crate) up: Vec<f32>,          // (n, n_ff)
    pub(crate) keep: Vec<bool>,       // (n, n_ff) neurons selected by the predictor or threshold
    pub(crate) neurons: Vec<u32>,     // selected neuron indices of one token, or of a batch's union
    pub(crate) picked: Vec<bool>,     // (n_ff) whether some token of the batch selected the neuron
    pub(crate) sel_gate: Vec<f32>, // (n, selected) gate values of the union's rows in sparse prefill
    pub(crate) sel_up: Vec<f32>,   // (n, selected) up values of the union's rows in sparse prefill
    pub(crate) pred_hidden: Vec<f32>, // (n, predictor hidden)
    pub(crate) pred_logits: Vec<f32>, // (n, n_ff)
    pub(crate) masked: Vec<f32>, // (n, inputs) a projection's input with the skipped inputs zeroed
    pub(crate) scores: Vec<Vec<f32>>, // decode: per kv head, or per piece of the cache, attention scores
    pub(crate) split_out: Vec<f32>, // decode: (pieces, q_dim) unnormalised attention output per piece
    pub(crate) split_parts: Vec<crate::attention::Partial>, // decode: (pieces, n_head) max and sum per piece
    pub(crate) router_logits: Vec<f32>, // (n, n_expert) router logits, then probabilities
    pub(crate) routes: Vec<(u32, f32)>, // (n, n_used) each row's experts and weights
    pub(crate) expert_rows: Vec<(u32, f32)>, // (n * n_used) the rows routed to each expert, expert by expert, and their weights
    pub(crate) expert_start: Vec<usize>, // (n_expert + 1) where each expert's rows start in expert_rows
    pub(crate) expert_fill: Vec<usize>,  // (n_expert) the next free slot of each expert's rows
    pub(crate) expert_acts: Vec<Activations>, // per chosen expert: its rows of xb
    pub(crate) h_acts: Activations, // (n * n_used, n_ff_exp) the experts' activations, quantized
    pub(crate) down_acts: Vec<Activations>, // per chosen expert: its rows of h_acts
    pub(crate) expert_out: Vec<f32>, // (n * n_used, n_embd) the routed experts' outputs
    pub(crate) shared_out: Vec<f32>, // (n, n_embd) the shared expert's output, before its gate
    pub(crate) acts: Activations,
    pub(crate) pred_acts: Activations,
    pub(crate) sparse: SparseScratch,
    pub(crate) cos: Vec<f32>, // (RoPE sets, n, rope_dim / 2)
    pub(crate) sin: Vec<f32>, // (RoPE sets, n, rope_dim / 2)
}

impl Scratch {
    /// Sizes the per-token buffers for a batch of `n` tokens.
    pub(crate) fn resize_for(&mut self, n: usize, c: &Config) {
        for buf in [&mut self.x, &mut self.xb, &mut self.attn_out, &mut self.ffn_out] {
            buf.resize(n * c.n_embd, 0.0);
        }
        self.q.resize(n * c.q_dim(), 0.0);
        self.k.resize(n * c.kv_dim(), 0.0);
        self.v.resize(n * c.kv_dim(), 0.0);
        self.att.resize(n * c.q_dim(), 0.0);
    }

    /// Token embeddings of a batch: x[t] = token_embd[tokens[t]] (+ position_embd[positions[t]
    /// + 2] for OPT), with xb as room for the position row (free until the first norm).
    pub(crate) fn embed(
        &mut self,
        w: &Weights,
        dim: usize,
        tokens: &[u32],
        positions: impl Iterator<Item = usize>,
    ) {
        for ((t, &tok), pos) in tokens.iter().enumerate().zip(positions) {
            let xt = &mut self.x[t * dim..(t + 1) * dim];
            w.token_embd.dequantize_row(tok as usize, xt);
            if let Some(pe) = &w.position_embd {
                let p = &mut self.xb[t * dim..(t + 1) * dim];
                pe.dequantize_row(pos + OPT_POSITION_OFFSET, p);
                add_into(xt, p);
            }
        }
    }

    /// RoPE angles of each token's position for every RoPE set (`Config::rope_set`), shared by
    /// the layers: cos, sin (sets, n, rope_dim / 2).
    pub(crate) fn rope_angles(
        &mut self,
        sets: &[RopeSet],
        positions: impl ExactSizeIterator<Item = usize> + Clone,
    ) {
        let (half, n) = (sets[0].inv_freq.len(), positions.len());
        self.cos.resize(sets.len() * n * half, 0.0);
        self.sin.resize(sets.len() * n * half, 0.0);
        for (set, rope) in sets.iter().enumerate() {
            for (t, pos) in positions.clone().enumerate() {
                for (i, f) in rope.inv_freq.iter().enumerate() {
                    let angle = pos as f32 * f;
                    self.cos[(set * n + t) * half + i] = angle.cos() * rope.magnitude;
                    self.sin[(set * n + t) * half + i] = angle.sin() * rope.magnitude;
                }
            }
        }
    }
}
