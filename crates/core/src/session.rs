//! A `Session` is one conversation with a model: the KV cache, the position, the token history
//! and the scratch buffers of the forward pass. Sessions are independent, so several can run on
//! one shared `Model` from different threads.
//!
//! `eval` runs the forward pass over a batch of tokens (the whole prompt at once in prefill, one
//! token per call in decode) and returns logits. The FFN runs dense, or sparse (`Sparsity`): a
//! per-layer predictor or a per-layer magnitude threshold picks the neurons, and decode computes
//! only those (`sparse::sparse_ffn`). Prefill reads the rows of the union of the batch's
//! selections and computes each (token, neuron) pair the token selected (dense products when
//! nearly every pair is selected, zeroing the rest), so a prompt gives the same result
//! evaluated at once or token by token.

use std::sync::Arc;

use rayon::prelude::*;

use crate::attention::{attend_group, KvBuf, KvType};
use crate::error::{Error, Result};
use crate::matmul::{matmul, matmul_many, matmul_selected, Activations, QMatrix};
use crate::model::{Config, Family, FfnActivation, InputGroup, LayerWeights, Model, RopeStyle, Weights, OPT_POSITION_OFFSET};
use crate::sparse::{down_t_matmul, sparse_ffn, FfnMats, SparseScratch, DENSE_FRACTION};

mod batch;
mod calibration;
mod input_sparsity;
mod math;
mod scratch;
mod sparsity;
pub use batch::{check_batch, decode_batch};
pub use input_sparsity::time_input_sparsity;
pub use scratch::Capture;
pub use sparsity::{FfnStats, Sparsity, SparsityMode};
use calibration::*;
use input_sparsity::*;
use math::*;
use scratch::*;

pub struct Session {
    pub model: Arc<Model>,
    pub n_ctx: usize,
    /// Every token evaluated so far; `tokens.len()` is the next position.
    pub tokens: Vec<u32>,
    k_cache: Vec<KvBuf>,     // per layer (n_ctx, n_head_kv * head_dim)
    v_cache: Vec<KvBuf>,     // per layer (n_ctx, n_head_kv * head_dim)
    rope_inv_freq: Vec<f32>, // (rope_dim / 2)
    sparsity: Sparsity,
    stats: FfnStats,
    /// Per-layer histograms while calibrating cut-offs.
    calibration: Option<Calibration>,
    /// What the profiler records while capturing.
    capture: Option<Capture>,
    s: Scratch,
}

impl Session {
    pub fn new(model: Arc<Model>, n_ctx: usize, kv_type: KvType) -> Result<Session> {
        let c = &model.config;
        if n_ctx == 0 {
            return Err(Error::InvalidArgument("n_ctx must be > 0".into()));
        }
        if c.family == Family::Opt && n_ctx > c.n_ctx_train {
            return Err(Error::InvalidArgument(format!(
                "n_ctx {n_ctx} is larger than the {} positions OPT's learned position table covers",
                c.n_ctx_train
            )));
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
            sparsity: Sparsity::dense(),
            stats: FfnStats::default(),
            calibration: None,
            capture: None,
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

    pub fn sparsity(&self) -> &Sparsity {
        &self.sparsity
    }

    /// Chooses how the FFNs are computed from now on. Predictor mode needs a predictor in every
    /// layer; threshold mode one finite threshold per layer. A sparse mode on a file without
    /// `ffn_down_t` builds the neuron-major down projection now (once per model).
    pub fn set_sparsity(&mut self, sp: Sparsity) -> Result<()> {
        let model = Arc::clone(&self.model);
        let c = &model.config;
        if !sp.predictor_threshold.is_finite() {
            return Err(Error::InvalidArgument(format!("predictor threshold must be finite, got {}", sp.predictor_threshold)));
        }
        match sp.mode {
            SparsityMode::Dense => {}
            SparsityMode::Predictor => {
                if let Some(l) = model.weights.layers.iter().position(|l| l.predictor.is_none()) {
                    return Err(Error::InvalidArgument(format!(
                        "predictor mode needs a predictor in every layer, but layer {l} has no blk.{l}.fc1/fc2 \
                         (use sparsity='threshold' or 'dense')"
                    )));
                }
                let per_layer = &sp.predictor_layer_thresholds;
                if !per_layer.is_empty() && per_layer.len() != c.n_layer {
                    return Err(Error::InvalidArgument(format!(
                        "predictor mode needs {} per-layer thresholds (or none), got {}",
                        c.n_layer,
                        per_layer.len()
                    )));
                }
                if let Some((l, t)) = per_layer.iter().enumerate().find(|(_, t)| !t.is_finite()) {
                    return Err(Error::InvalidArgument(format!("layer {l} predictor threshold must be finite, got {t}")));
                }
            }
            SparsityMode::Threshold if !sp.input_thresholds.is_empty() => {
                if sp.input_thresholds.len() != c.n_layer || !sp.layer_thresholds.is_empty() {
                    return Err(Error::InvalidArgument(format!(
                        "input sparsity needs {} per-layer cut-off sets and no neuron thresholds, got {} and {}",
                        c.n_layer,
                        sp.input_thresholds.len(),
                        sp.layer_thresholds.len()
                    )));
                }
                let bad = sp.input_thresholds.iter().enumerate().find_map(|(l, t)| t.iter().find(|v| !(v.is_finite() && **v >= 0.0)).map(|v| (l, *v)));
                if let Some((l, t)) = bad {
                    return Err(Error::InvalidArgument(format!("layer {l} input cut-off must be finite and >= 0, got {t}")));
                }
                // the input-major copies the cut-offs will read, built now (once per model)
                for (l, t) in sp.input_thresholds.iter().enumerate() {
                    for g in InputGroup::ALL.into_iter().filter(|&g| t[g as usize] > 0.0) {
                        g.matrices(&model.weights.layers[l]).iter().for_each(|&m| {
                            model.input_major(l, m);
                        });
                    }
                    model.input_norms(l, InputGroup::Qkv);
                }
            }
            SparsityMode::Threshold => {
                if sp.layer_thresholds.len() != c.n_layer {
                    return Err(Error::InvalidArgument(format!(
                        "threshold mode needs {} layer thresholds, got {}",
                        c.n_layer,
                        sp.layer_thresholds.len()
                    )));
                }
                if let Some((l, t)) = sp.layer_thresholds.iter().enumerate().find(|(_, t)| !t.is_finite()) {
                    return Err(Error::InvalidArgument(format!("layer {l} threshold must be finite, got {t}")));
                }
            }
        }
        if sp.mode != SparsityMode::Dense {
            (0..c.n_layer).for_each(|l| {
                model.down_t(l);
            });
        }
        self.sparsity = sp;
        Ok(())
    }

    /// Starts (or stops, discarding what was recorded) recording FFN inputs and neuron scores
    /// for every evaluated token; see `Capture`. While recording, every FFN is computed densely
    /// on the batch path, whatever the sparsity mode.
    pub fn set_capture(&mut self, on: bool) {
        let n_layer = self.model.config.n_layer;
        self.capture = on.then(|| Capture { n_tokens: 0, inputs: vec![Vec::new(); n_layer], scores: vec![Vec::new(); n_layer] });
    }

    /// Returns what was recorded since capturing started or since the last call, and keeps
    /// recording. None when not capturing.
    pub fn take_capture(&mut self) -> Option<Capture> {
        let n_layer = self.model.config.n_layer;
        self.capture.as_mut().map(|c| {
            std::mem::replace(c, Capture { n_tokens: 0, inputs: vec![Vec::new(); n_layer], scores: vec![Vec::new(); n_layer] })
        })
    }

    /// Returns the FFN counters gathered since the last call and resets them.
    pub fn take_stats(&mut self) -> FfnStats {
        std::mem::take(&mut self.stats)
    }

    /// FFN counters since the last `take_stats`, left in place.
    pub fn stats(&self) -> FfnStats {
        self.stats
    }

    /// Runs `tokens` densely (in windows of at most `window` tokens, each from an empty context)
    /// and returns, for each target sparsity in `targets`, the per-layer |act(gate)| thresholds
    /// under which that fraction of the neurons fall. The session is left empty and dense.
    pub fn calibrate(&mut self, tokens: &[u32], window: usize, targets: &[f64]) -> Result<Vec<Vec<f32>>> {
        if let Some(t) = targets.iter().find(|t| !(0.0..1.0).contains(*t)) {
            return Err(Error::InvalidArgument(format!("target sparsity must be in [0, 1), got {t}")));
        }
        let hists = vec![MagnitudeHistogram::new(); self.model.config.n_layer];
        match self.record_windows(tokens, window, Sparsity::dense(), Calibration::GateMagnitudes(hists))? {
            Calibration::GateMagnitudes(hists) => Ok(targets.iter().map(|&t| hists.iter().map(|h| h.quantile(t)).collect()).collect()),
            _ => unreachable!("recorded what was asked"),
        }
    }

    /// Runs `tokens` densely (windows as in `calibrate`) and returns, for each recall target in
    /// `recalls`, the per-layer predictor cut-offs that keep at least that fraction of the
    /// neurons that truly fired (nonzero activation) on these tokens. Needs predictors in every
    /// layer. The session is left empty, in its previous mode.
    pub fn calibrate_predictor(&mut self, tokens: &[u32], window: usize, recalls: &[f64]) -> Result<Vec<Vec<f32>>> {
        if let Some(r) = recalls.iter().find(|r| !(**r > 0.0 && **r <= 1.0)) {
            return Err(Error::InvalidArgument(format!("recall target must be in (0, 1], got {r}")));
        }
        if let Some(l) = self.model.weights.layers.iter().position(|l| l.predictor.is_none()) {
            return Err(Error::InvalidArgument(format!("predictor calibration needs a predictor in every layer, but layer {l} has none")));
        }
        // every neuron selected: the predictor runs, the FFN stays dense
        let all = Sparsity { mode: SparsityMode::Predictor, predictor_threshold: f32::MIN, ..Sparsity::dense() };
        let hists = vec![SignedHistogram::new(); self.model.config.n_layer];
        match self.record_windows(tokens, window, all, Calibration::ActiveLogits(hists))? {
            Calibration::ActiveLogits(hists) => Ok(recalls.iter().map(|&r| hists.iter().map(|h| h.lower_cut(1.0 - r)).collect()).collect()),
            _ => unreachable!("recorded what was asked"),
        }
    }

    /// Runs `tokens` densely (windows as in `calibrate`) and returns, for each share in `levels`,
    /// per layer and `InputGroup`, the (cut-off, energy share) pair of input sparsity: the score
    /// |x_i| * |W[:, i]| at or below which that share of the group's inputs fall, and the share
    /// of the sum of squared scores those inputs carry (how much of the output the skipped
    /// inputs would have made, were the columns orthogonal).
    pub fn calibrate_inputs(&mut self, tokens: &[u32], window: usize, levels: &[f64]) -> Result<Vec<Vec<GroupCuts>>> {
        if let Some(t) = levels.iter().find(|t| !(0.0..1.0).contains(*t)) {
            return Err(Error::InvalidArgument(format!("input sparsity level must be in [0, 1), got {t}")));
        }
        let hists = vec![[(); 4].map(|_| ScoreHistogram::new()); self.model.config.n_layer];
        match self.record_windows(tokens, window, Sparsity::dense(), Calibration::InputScores(hists))? {
            Calibration::InputScores(hists) => {
                Ok(levels.iter().map(|&t| hists.iter().map(|h| [0, 1, 2, 3].map(|g| h[g].cut(t))).collect()).collect())
            }
            _ => unreachable!("recorded what was asked"),
        }
    }

    /// Evaluates `tokens` in windows of at most `window` tokens, each from an empty context, in
    /// mode `sp`, recording into `rec`; returns what was recorded and restores the mode.
    fn record_windows(&mut self, tokens: &[u32], window: usize, sp: Sparsity, rec: Calibration) -> Result<Calibration> {
        if tokens.len() < 2 || window < 2 {
            return Err(Error::InvalidArgument("calibration needs at least 2 tokens and a window of 2".into()));
        }
        let saved = std::mem::replace(&mut self.sparsity, sp);
        self.calibration = Some(rec);
        let window = window.min(self.n_ctx);
        let mut result = Ok(());
        for chunk in tokens.chunks(window) {
            self.truncate(0);
            // a one-token tail would take the decode path, which never materializes the gate
            if chunk.len() < 2 {
                break;
            }
            if let Err(e) = self.eval(chunk, false) {
                result = Err(e);
                break;
            }
        }
        self.truncate(0);
        self.sparsity = saved;
        let rec = self.calibration.take().expect("set above");
        self.stats = FfnStats::default();
        result.map(|()| rec)
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
        let dim = c.n_embd;
        self.s.resize_for(n, c);
        self.s.embed(w, dim, tokens, pos0..pos0 + n);
        self.s.rope_angles(&self.rope_inv_freq, pos0..pos0 + n);

        for (l, lw) in w.layers.iter().enumerate() {
            self.layer(l, lw, n, pos0);
        }

        // final norm and classifier, for every token or only the last
        let s = &mut self.s;
        let rows = if all_logits { 0..n } else { n - 1..n };
        let m = rows.len();
        let xr = &s.x[rows.start * dim..rows.end * dim];
        norm(c.family, &mut s.xb[..m * dim], xr, &w.output_norm, w.output_norm_b.as_deref(), c.norm_eps);
        s.acts.set(&s.xb[..m * dim], m, dim);
        let mut logits = vec![0.0f32; m * c.n_vocab];
        matmul(&w.output, &s.acts, &mut logits);
        logits
    }

    /// The RoPE (cos, sin) pairs of one position, (rope_dim / 2) each, exactly as the CPU
    /// forward uses them (the GPU executor uploads these rather than recomputing them).
    pub fn rope_angles(&self, pos: usize) -> (Vec<f32>, Vec<f32>) {
        let angle = |f: &f32| pos as f32 * f;
        (self.rope_inv_freq.iter().map(|f| angle(f).cos()).collect(), self.rope_inv_freq.iter().map(|f| angle(f).sin()).collect())
    }

    /// Runs one token through layer `l` on the CPU at position `pos`, reading and updating the
    /// residual `x` (n_embd), with this session's KV cache and sparsity. Executors that keep
    /// some layers elsewhere (the GPU) call this for the layers left on the CPU; they keep the
    /// token history themselves (see `record_tokens`).
    pub fn cpu_layer(&mut self, l: usize, x: &mut [f32], pos: usize) {
        let model = Arc::clone(&self.model);
        self.s.resize_for(1, &model.config);
        self.s.x.copy_from_slice(x);
        self.s.rope_angles(&self.rope_inv_freq, pos..pos + 1);
        model.install(|| self.layer(l, &model.weights.layers[l], 1, pos));
        x.copy_from_slice(&self.s.x);
    }

    /// The final norm and classifier of one token's residual `x` (n_embd) on the CPU: logits (n_vocab).
    pub fn cpu_logits(&mut self, x: &[f32]) -> Vec<f32> {
        let model = Arc::clone(&self.model);
        let (c, w) = (&model.config, &model.weights);
        let s = &mut self.s;
        s.xb.resize(c.n_embd, 0.0);
        norm(c.family, &mut s.xb[..c.n_embd], x, &w.output_norm, w.output_norm_b.as_deref(), c.norm_eps);
        s.acts.set(&s.xb[..c.n_embd], 1, c.n_embd);
        let mut logits = vec![0.0f32; c.n_vocab];
        model.install(|| matmul(&w.output, &s.acts, &mut logits));
        logits
    }

    /// Appends tokens evaluated by an outside executor to the history (the next position).
    pub fn record_tokens(&mut self, tokens: &[u32]) {
        self.tokens.extend_from_slice(tokens);
    }

    /// Adds FFN counters gathered by an outside executor.
    pub fn add_stats(&mut self, more: FfnStats) {
        self.stats.neurons += more.neurons;
        self.stats.skipped += more.skipped;
        self.stats.truly_active += more.truly_active;
        self.stats.truly_active_selected += more.truly_active_selected;
        self.stats.weight_bytes += more.weight_bytes;
        self.stats.weight_bytes_read += more.weight_bytes_read;
    }

    /// One transformer block over the batch in s.x (n, n_embd) at positions pos0..pos0+n.
    fn layer(&mut self, l: usize, lw: &LayerWeights, n: usize, pos0: usize) {
        let model = Arc::clone(&self.model);
        let c = &model.config;
        match c.family {
            Family::Llama | Family::Opt => {
                // attention norm, attention, residual
                norm(c.family, &mut self.s.xb, &self.s.x, &lw.attn_norm, lw.attn_norm_b.as_deref(), c.norm_eps);
                self.attention(l, lw, n, pos0);
                add_into(&mut self.s.x, &self.s.attn_out);

                // ffn norm, ffn (the predictor reads the residual x), residual
                let ffn_norm = lw.ffn_norm.as_deref().expect("sequential blocks have an FFN norm");
                norm(c.family, &mut self.s.xb, &self.s.x, ffn_norm, lw.ffn_norm_b.as_deref(), c.norm_eps);
                self.ffn(l, lw, n);
                add_into(&mut self.s.x, &self.s.ffn_out);
            }
            Family::Falcon => {
                // attention reads attn_norm_2(x) when the layer has it (Falcon-40B), else attn_norm(x)
                let s = &mut self.s;
                match &lw.attn_norm_2 {
                    Some(w2) => layernorm(&mut s.xb, &s.x, w2, lw.attn_norm_2_b.as_deref(), c.norm_eps),
                    None => layernorm(&mut s.xb, &s.x, &lw.attn_norm, lw.attn_norm_b.as_deref(), c.norm_eps),
                }
                self.attention(l, lw, n, pos0);

                // the FFN reads attn_norm(x); its predictor reads the layer input x itself
                let s = &mut self.s;
                if lw.attn_norm_2.is_some() {
                    layernorm(&mut s.xb, &s.x, &lw.attn_norm, lw.attn_norm_b.as_deref(), c.norm_eps);
                }
                self.ffn(l, lw, n);

                // parallel residual: x += attention + ffn
                let s = &mut self.s;
                add_into(&mut s.x, &s.attn_out);
                add_into(&mut s.x, &s.ffn_out);
            }
        }
    }

    /// Attention block of layer `l`: reads s.xb (n, n_embd), writes s.attn_out (n, n_embd).
    fn attention(&mut self, l: usize, lw: &LayerWeights, n: usize, pos0: usize) {
        let c = &self.model.config;
        let (q_dim, kv_dim, hd) = (c.q_dim(), c.kv_dim(), c.head_dim);
        let s = &mut self.s;

        // qkv matmuls for these positions: q (n, q_dim), k and v (n, kv_dim), plus biases
        let model = &*self.model;
        let cut = self.sparsity.input_cut(l, InputGroup::Qkv);
        record_scores(&mut self.calibration, l, InputGroup::Qkv, &s.xb[..n * c.n_embd], model);
        let outs: &mut [&mut [f32]] = &mut [&mut s.q, &mut s.k, &mut s.v];
        project(model, l, InputGroup::Qkv, cut, &s.xb[..n * c.n_embd], n, &mut s.acts, &mut s.masked, &mut s.sparse, outs, &mut self.stats);
        add_bias(&mut s.q, lw.bq.as_deref());
        add_bias(&mut s.k, lw.bk.as_deref());
        add_bias(&mut s.v, lw.bv.as_deref());

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
        let attend = |idx: usize, out: &mut [f32], scores: &mut Vec<f32>| {
            let (t, g) = (idx / c.n_head_kv, idx % c.n_head_kv);
            // the query heads of kv head g are contiguous: g * group .. (g + 1) * group
            let qs = &q[t * q_dim + g * group * hd..t * q_dim + (g + 1) * group * hd];
            let len = pos0 + t + 1;
            let rows = len * kv_dim;
            attend_group(qs, hd, kc.view(rows), vc.view(rows), len, kv_dim, g * hd, scale, scores, out);
        };
        if n == 1 {
            // decode: one scores buffer per kv head, kept by the session (they only grow
            // with the context, so a token allocates nothing)
            s.scores.resize_with(c.n_head_kv, Vec::new);
            s.att.par_chunks_mut(group * hd).zip(s.scores.par_iter_mut()).enumerate().for_each(|(idx, (out, scores))| attend(idx, out, scores));
        } else {
            s.att.par_chunks_mut(group * hd).enumerate().for_each_init(Vec::new, |scores, (idx, out)| attend(idx, out, scores));
        }

        // output projection (+ bias)
        let cut = self.sparsity.input_cut(l, InputGroup::Out);
        record_scores(&mut self.calibration, l, InputGroup::Out, &s.att[..n * q_dim], model);
        let outs: &mut [&mut [f32]] = &mut [&mut s.attn_out];
        project(model, l, InputGroup::Out, cut, &s.att[..n * q_dim], n, &mut s.acts, &mut s.masked, &mut s.sparse, outs, &mut self.stats);
        add_bias(&mut s.attn_out, lw.bo.as_deref());
    }

    /// FFN block of layer `l`: reads the normed input s.xb (n, n_embd) and, for the predictor,
    /// the residual stream s.x; writes s.ffn_out (n, n_embd).
    fn ffn(&mut self, l: usize, lw: &LayerWeights, n: usize) {
        if self.sparsity.mode == SparsityMode::Threshold && !self.sparsity.input_thresholds.is_empty() {
            return self.ffn_inputs(l, lw, n);
        }
        let model = &*self.model;
        let c = &model.config;
        let (dim, n_ff, act) = (c.n_embd, c.n_ff, c.ffn_activation);
        let sp = &self.sparsity;
        let s = &mut self.s;
        s.acts.set(&s.xb, n, dim);
        s.gate.resize(n * n_ff, 0.0);
        s.up.resize(n * n_ff, 0.0);
        let mode = sp.mode;

        // which neurons each token keeps: s.keep (n, n_ff)
        let mut gate_ready = false; // s.gate holds gate pre-activations (up + bias when gateless)
        match mode {
            SparsityMode::Dense => {}
            SparsityMode::Predictor => {
                // predictor: logits (n, n_ff) = fc2 @ relu(fc1 @ x); keep where logits >= threshold
                let p = lw.predictor.as_ref().expect("checked by set_sparsity");
                s.pred_acts.set(&s.x, n, dim);
                s.pred_hidden.resize(n * p.fc1.rows, 0.0);
                matmul(&p.fc1, &s.pred_acts, &mut s.pred_hidden);
                s.pred_hidden.iter_mut().for_each(|v| *v = v.max(0.0));
                s.pred_acts.set(&s.pred_hidden, n, p.fc1.rows);
                s.pred_logits.resize(n * n_ff, 0.0);
                matmul(&p.fc2, &s.pred_acts, &mut s.pred_logits);
                let cutoff = sp.predictor_cutoff(l);
                s.keep.clear();
                s.keep.extend(s.pred_logits.iter().map(|&v| Sparsity::predictor_selects(v, cutoff)));
            }
            SparsityMode::Threshold => {
                // the gate (up for gateless FFNs) densely; keep where |act(gate)| > threshold
                Self::gate_values(lw, &s.acts, &mut s.gate);
                gate_ready = true;
                let thr = sp.layer_thresholds[l];
                s.keep.clear();
                s.keep.extend(s.gate.iter().map(|&g| act.gate_part(g).abs() > thr));
            }
        }
        let selected = if mode == SparsityMode::Dense { n * n_ff } else { s.keep.iter().filter(|&&k| k).count() };
        self.stats.neurons += (n * n_ff) as u64;
        self.stats.skipped += (n * n_ff - selected) as u64;
        // weight bytes: a sparse mode reads the selected neurons' gate rows (all of them when
        // the threshold needs the dense gate), up rows and neuron-major down rows (at most:
        // a ReLU gate at or below zero spares the up and down rows too)
        let down_t = model.down_t(l);
        let down_bytes = lw.ffn_down.map_or(down_t.data.len(), |d| d.data.len());
        let gate_bytes = lw.ffn_gate.map_or(0, |g| g.data.len());
        self.stats.weight_bytes += (n * (gate_bytes + lw.ffn_up.data.len() + down_bytes)) as u64;
        self.stats.weight_bytes_read += match mode {
            SparsityMode::Dense => n * (gate_bytes + lw.ffn_up.data.len() + down_bytes),
            _ => {
                let gate_read = if gate_ready { n * gate_bytes } else { selected * lw.ffn_gate.map_or(0, |g| g.row_bytes()) };
                gate_read + selected * (lw.ffn_up.row_bytes() + down_t.row_bytes())
            }
        } as u64;
        let track_recall = sp.track_recall && mode == SparsityMode::Predictor;

        let recording = self.calibration.is_some() || self.capture.is_some();
        if n == 1 && (mode != SparsityMode::Dense || lw.ffn_down.is_none()) && !recording {
            // decode: fused sparse operator over the selected neurons only
            s.neurons.clear();
            match mode {
                SparsityMode::Dense => s.neurons.extend(0..n_ff as u32),
                _ => s.neurons.extend((0..n_ff as u32).filter(|&j| s.keep[j as usize])),
            }
            let mats = FfnMats {
                gate: lw.ffn_gate,
                up: lw.ffn_up,
                up_bias: lw.ffn_up_b.as_deref(),
                down_t: model.down_t(l),
                down: lw.ffn_down,
                act,
            };
            let precomputed = (gate_ready && act.has_gate()).then_some(&s.gate[..]);
            sparse_ffn(&mats, &s.acts, &s.neurons, precomputed, &mut s.ffn_out, &mut s.sparse);
            if track_recall {
                // the true activations, densely
                Self::gate_and_up(lw, &s.acts, &mut s.gate, &mut s.up, false);
                Self::activate(lw, act, &mut s.gate, &s.up);
                Self::count_recall(&mut self.stats, &s.gate, &s.keep);
            }
        } else if mode != SparsityMode::Dense && !recording && !track_recall && (selected as f64) < DENSE_FRACTION * (n * n_ff) as f64 {
            // batch, sparse: only the rows of the neurons some token selected
            Self::union_of_selections(&s.keep, n, n_ff, &mut s.picked, &mut s.neurons);
            Self::union_ffn(lw, act, &model.down_t(l), n, gate_ready, s);
        } else {
            // batch: gate and up densely, the activation, zero what was left out, then down
            Self::gate_and_up(lw, &s.acts, &mut s.gate, &mut s.up, gate_ready);
            if let Some(Calibration::GateMagnitudes(hists)) = &mut self.calibration {
                s.gate.iter().for_each(|&g| hists[l].add(act.gate_part(g)));
            }
            let fires_exactly = matches!(act, FfnActivation::ReGlu | FfnActivation::DReGlu | FfnActivation::Relu);
            if let Some(cap) = &mut self.capture {
                cap.inputs[l].extend_from_slice(&s.x[..n * dim]);
                if !fires_exactly {
                    cap.scores[l].extend(s.gate.iter().map(|&g| act.gate_part(g).abs()));
                }
            }
            record_scores(&mut self.calibration, l, InputGroup::FfnIn, &s.xb[..n * dim], model);
            Self::activate(lw, act, &mut s.gate, &s.up);
            record_scores(&mut self.calibration, l, InputGroup::Down, &s.gate[..n * n_ff], model);
            if let Some(Calibration::ActiveLogits(hists)) = &mut self.calibration {
                // (every neuron is selected while calibrating, so nothing is zeroed below)
                s.gate.iter().zip(&s.pred_logits).filter(|(&h, _)| h != 0.0).for_each(|(_, &z)| hists[l].add(z));
            }
            if let Some(cap) = &mut self.capture {
                if fires_exactly {
                    cap.scores[l].extend(s.gate.iter().map(|h| h.abs()));
                }
                if l + 1 == c.n_layer {
                    cap.n_tokens += n;
                }
            }
            if track_recall {
                Self::count_recall(&mut self.stats, &s.gate, &s.keep);
            }
            if mode != SparsityMode::Dense {
                s.gate.iter_mut().zip(&s.keep).for_each(|(h, &k)| {
                    if !k {
                        *h = 0.0
                    }
                });
            }
            match &lw.ffn_down {
                Some(down) => {
                    s.acts.set(&s.gate, n, n_ff);
                    matmul(down, &s.acts, &mut s.ffn_out);
                }
                None => down_t_matmul(&model.down_t(l), &s.gate, n, &mut s.ffn_out, &mut s.sparse),
            }
        }
        add_bias(&mut s.ffn_out, lw.ffn_down_b.as_deref());
    }

    /// Threshold mode with input sparsity: the FFN of s.xb (n, n_embd) into s.ffn_out (n,
    /// n_embd). Gate and up read only the inputs above the layer's `FfnIn` cut-off; down reads
    /// only the activations above its `Down` cut-off (the neuron-major rows of `down_t`).
    fn ffn_inputs(&mut self, l: usize, lw: &LayerWeights, n: usize) {
        let model = &*self.model;
        let (dim, n_ff, act) = (model.config.n_embd, model.config.n_ff, model.config.ffn_activation);
        let sp = &self.sparsity;
        let s = &mut self.s;
        s.gate.resize(n * n_ff, 0.0);
        s.up.resize(n * n_ff, 0.0);

        // gate and up (n, n_ff) each; gateless FFNs: up + bias in s.gate
        let cut = sp.input_cut(l, InputGroup::FfnIn);
        let x = &s.xb[..n * dim];
        let outs: &mut [&mut [f32]] = match lw.ffn_gate {
            Some(_) => &mut [&mut s.gate, &mut s.up],
            None => &mut [&mut s.gate],
        };
        project(model, l, InputGroup::FfnIn, cut, x, n, &mut s.acts, &mut s.masked, &mut s.sparse, outs, &mut self.stats);
        add_bias(if lw.ffn_gate.is_some() { &mut s.up } else { &mut s.gate }, lw.ffn_up_b.as_deref());
        // h = act(gate, up) (n, n_ff) in s.gate
        Self::activate(lw, act, &mut s.gate, &s.up);

        // down (n, n_embd): only the neurons whose |h_j| * |down[:, j]| exceeds the cut-off
        let cut = sp.input_cut(l, InputGroup::Down);
        project_down(model, l, cut, &mut s.gate[..n * n_ff], n, &mut s.acts, &mut s.sparse, &mut s.ffn_out, &mut self.stats);
        add_bias(&mut s.ffn_out, lw.ffn_down_b.as_deref());
    }

    /// The union of a batch's selections, keep (n, n_ff), into `union` (sorted neuron indices,
    /// through the mask `any`).
    fn union_of_selections(keep: &[bool], n: usize, n_ff: usize, any: &mut Vec<bool>, union: &mut Vec<u32>) {
        union.clear();
        any.clear();
        any.resize(n_ff, false);
        for row in keep[..n * n_ff].chunks_exact(n_ff) {
            any.iter_mut().zip(row).for_each(|(a, &k)| *a |= k);
        }
        union.extend((0..n_ff as u32).filter(|&j| any[j as usize]));
    }

    /// Sparse prefill: the FFN of a batch over the union of its tokens' selections (s.neurons).
    /// Gate and up read those rows only, and compute each row's dots only for the tokens that
    /// selected it (prefill is compute-bound: a batch's union is far wider than one token's
    /// selection); the down projection reads the neuron-major rows of the
    /// neurons some token kept. Each token gets what token-by-token sparse decode computes, up
    /// to float summation order. Reads s.acts (n, n_embd) and, with `gate_ready`, the dense
    /// gate values in s.gate; writes s.ffn_out (n, n_embd).
    fn union_ffn(lw: &LayerWeights, act: FfnActivation, down_t: &QMatrix, n: usize, gate_ready: bool, s: &mut Scratch) {
        let n_ff = down_t.rows;
        let (sel, m) = (&s.neurons, s.neurons.len());
        // per selected row: gate values (n, m) (gateless: up + bias), up values (n, m)
        s.sel_gate.resize(n * m, 0.0);
        s.sel_up.resize(n * m, 0.0);
        // (only the cells of the tokens that selected the neuron)
        let keep = Some(&s.keep[..n * n_ff]);
        match (&lw.ffn_gate, gate_ready) {
            (Some(g), false) => matmul_selected(&[*g, lw.ffn_up], sel, keep, &s.acts, &mut [&mut s.sel_gate, &mut s.sel_up]),
            (Some(_), true) => matmul_selected(&[lw.ffn_up], sel, keep, &s.acts, &mut [&mut s.sel_up]),
            (None, false) => matmul_selected(&[lw.ffn_up], sel, keep, &s.acts, &mut [&mut s.sel_gate]),
            (None, true) => {}
        }
        // h (n, n_ff) in s.up: act(gate, up) where the token selected the neuron, else 0
        s.up.resize(n * n_ff, 0.0);
        s.up.fill(0.0);
        let up_bias = lw.ffn_up_b.as_deref();
        for t in 0..n {
            for (k, &j) in sel.iter().enumerate() {
                let (j, i) = (j as usize, t * n_ff + j as usize);
                if !s.keep[i] {
                    continue;
                }
                let bias = up_bias.map_or(0.0, |b| b[j]);
                let gate = if gate_ready { s.gate[i] } else { s.sel_gate[t * m + k] + if lw.ffn_gate.is_none() { bias } else { 0.0 } };
                s.up[i] = match lw.ffn_gate {
                    Some(_) => act.apply(gate, s.sel_up[t * m + k] + bias),
                    None => act.apply(0.0, gate),
                };
            }
        }
        down_t_matmul(down_t, &s.up, n, &mut s.ffn_out, &mut s.sparse);
    }

    /// Gate pre-activations (n, n_ff); for gateless FFNs the up pre-activations plus bias.
    fn gate_values(lw: &LayerWeights, x: &Activations, gate: &mut [f32]) {
        match &lw.ffn_gate {
            Some(g) => matmul(g, x, gate),
            None => {
                matmul(&lw.ffn_up, x, gate);
                add_bias(gate, lw.ffn_up_b.as_deref());
            }
        }
    }

    /// Gate and up pre-activations (n, n_ff) each, in one pass over both matrices; gateless
    /// FFNs put up + bias in `gate` and leave `up` alone. With `gate_ready` the gate (or the
    /// gateless up) is already in place and only up is computed.
    fn gate_and_up(lw: &LayerWeights, x: &Activations, gate: &mut [f32], up: &mut [f32], gate_ready: bool) {
        match (&lw.ffn_gate, gate_ready) {
            (Some(g), false) => matmul_many(&[*g, lw.ffn_up], x, &mut [gate, &mut *up]),
            (Some(_), true) => matmul(&lw.ffn_up, x, up),
            (None, false) => Self::gate_values(lw, x, gate),
            (None, true) => {}
        }
        if lw.ffn_gate.is_some() {
            add_bias(up, lw.ffn_up_b.as_deref());
        }
    }

    /// gate <- act(gate, up) in place (gateless: gate <- act(gate)).
    fn activate(lw: &LayerWeights, act: crate::model::FfnActivation, gate: &mut [f32], up: &[f32]) {
        if lw.ffn_gate.is_some() {
            gate.par_chunks_mut(4096).zip(up.par_chunks(4096)).for_each(|(g, u)| {
                g.iter_mut().zip(u).for_each(|(gi, &ui)| *gi = act.apply(*gi, ui));
            });
        } else {
            gate.iter_mut().for_each(|g| *g = act.apply(0.0, *g));
        }
    }

    fn count_recall(stats: &mut FfnStats, h: &[f32], keep: &[bool]) {
        for (&v, &k) in h.iter().zip(keep) {
            if v != 0.0 {
                stats.truly_active += 1;
                stats.truly_active_selected += k as u64;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The predictor cut-off keeps at least the asked share of the recorded values, and no bin
    /// edge above it would: it sits within one bin (1/64 octave) of the exact quantile, on
    /// both sides of zero and with values exactly zero.
    #[test]
    fn signed_histogram_cut_keeps_the_asked_share() {
        let mut rng = crate::sampler::Rng::new(5);
        for shift in [-3.0f32, -0.2, 0.0, 0.7, 4.0] {
            let mut vals: Vec<f32> = (0..20000).map(|_| (rng.next_f32() - 0.5) * 6.0 + shift).collect();
            vals.extend([0.0; 300]);
            let mut h = SignedHistogram::new();
            vals.iter().for_each(|&v| h.add(v));
            vals.sort_by(|a, b| a.total_cmp(b));
            for fraction in [0.0, 0.001, 0.01, 0.05, 0.3, 0.9] {
                let cut = h.lower_cut(fraction);
                let below = vals.iter().filter(|&&v| v < cut).count();
                assert!(below as f64 <= fraction * vals.len() as f64, "shift {shift} fraction {fraction}: {below} below {cut}");
                // the exact quantile is not far above the cut
                let exact = vals[(fraction * vals.len() as f64).floor() as usize];
                let bin = 2f32.powf(1.0 / 64.0);
                let ok = if exact > 0.0 { cut >= 0.0 && (cut == 0.0 && exact < 1e-3 || exact <= cut * bin * bin) } else { cut <= exact && cut >= exact * bin * bin };
                assert!(ok || exact == cut, "shift {shift} fraction {fraction}: cut {cut}, exact quantile {exact}");
            }
        }
    }
}
