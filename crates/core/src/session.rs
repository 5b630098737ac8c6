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
pub use batch::decode_batch;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SparsityMode {
    /// Every FFN neuron is computed.
    Dense,
    /// The layer's predictor picks the neurons: `fc2 @ relu(fc1 @ x) >= predictor_threshold`.
    Predictor,
    /// The gate is computed densely; neurons with `|act(gate)| <= layer_thresholds[l]` are skipped.
    Threshold,
}

impl SparsityMode {
    pub fn parse(s: &str) -> Result<SparsityMode> {
        match s {
            "dense" => Ok(SparsityMode::Dense),
            "predictor" => Ok(SparsityMode::Predictor),
            "threshold" => Ok(SparsityMode::Threshold),
            _ => Err(Error::InvalidArgument(format!("sparsity must be 'dense', 'predictor' or 'threshold', got '{s}'"))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            SparsityMode::Dense => "dense",
            SparsityMode::Predictor => "predictor",
            SparsityMode::Threshold => "threshold",
        }
    }
}

/// How a session computes its FFNs.
#[derive(Debug, Clone)]
pub struct Sparsity {
    pub mode: SparsityMode,
    /// Predictor mode: neuron j is computed iff its predictor logit is >= this.
    pub predictor_threshold: f32,
    /// Predictor mode: one cut-off per layer (as trained per layer by the offline toolchain);
    /// when not empty it replaces `predictor_threshold`.
    pub predictor_layer_thresholds: Vec<f32>,
    /// Threshold mode: per layer, the |act(gate)| a neuron must exceed to be computed.
    pub layer_thresholds: Vec<f32>,
    /// Threshold mode, input sparsity (instead of `layer_thresholds`): per layer and
    /// `InputGroup`, the score |x_i| * |W[:, i]| an input must exceed for the group's matrices
    /// to read it (through their input-major copies); 0 reads every input with the row-major
    /// kernels.
    pub input_thresholds: Vec<[f32; 4]>,
    /// Predictor mode: also compute the true activations (a dense pass) to measure recall.
    pub track_recall: bool,
}

impl Sparsity {
    pub fn dense() -> Sparsity {
        Sparsity {
            mode: SparsityMode::Dense,
            predictor_threshold: 0.0,
            predictor_layer_thresholds: Vec::new(),
            layer_thresholds: Vec::new(),
            input_thresholds: Vec::new(),
            track_recall: false,
        }
    }

    /// Layer `l`'s cut-off for input group `g`, when that group skips inputs.
    fn input_cut(&self, l: usize, g: InputGroup) -> Option<f32> {
        let t = self.input_thresholds.get(l)?[g as usize];
        (self.mode == SparsityMode::Threshold && t > 0.0).then_some(t)
    }
}

/// FFN counters since the last `take_stats`, over every evaluated token and layer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FfnStats {
    /// (token, layer, neuron) triples evaluated.
    pub neurons: u64,
    /// Of those, left out by the predictor or the threshold.
    pub skipped: u64,
    /// With recall tracking: neurons whose true (dense) activation is nonzero.
    pub truly_active: u64,
    /// Of the truly active, those the predictor selected.
    pub truly_active_selected: u64,
    /// Bytes of the layers' weight matrices a dense pass reads, summed over tokens.
    pub weight_bytes: u64,
    /// Of those, the bytes read (copies read for input sparsity count at their own size, so
    /// this can exceed `weight_bytes`).
    pub weight_bytes_read: u64,
}

/// Log-spaced histogram of |act(gate)| values for one layer, for threshold calibration.
#[derive(Clone)]
struct MagnitudeHistogram {
    zeros: u64,
    bins: Vec<u64>,
}

impl MagnitudeHistogram {
    const LOG2_MIN: f32 = -40.0;
    const PER_OCTAVE: f32 = 64.0;
    const OCTAVES: usize = 60;

    fn new() -> Self {
        MagnitudeHistogram { zeros: 0, bins: vec![0; Self::OCTAVES * Self::PER_OCTAVE as usize] }
    }

    fn add(&mut self, v: f32) {
        let a = v.abs();
        if a == 0.0 || !a.is_finite() {
            self.zeros += 1;
            return;
        }
        let i = ((a.log2() - Self::LOG2_MIN) * Self::PER_OCTAVE).max(0.0) as usize;
        let last = self.bins.len() - 1;
        self.bins[i.min(last)] += 1;
    }

    /// The smallest bin edge with at least `fraction` of the values at or below it.
    fn quantile(&self, fraction: f64) -> f32 {
        let total = self.zeros + self.bins.iter().sum::<u64>();
        let target = (fraction * total as f64).ceil() as u64;
        if target <= self.zeros {
            return 0.0;
        }
        let mut seen = self.zeros;
        for (i, &c) in self.bins.iter().enumerate() {
            seen += c;
            if seen >= target {
                return ((i + 1) as f32 / Self::PER_OCTAVE + Self::LOG2_MIN).exp2();
            }
        }
        f32::MAX
    }
}

/// Per `InputGroup`, a (score cut-off, energy share below it) pair (see `calibrate_inputs`).
pub type GroupCuts = [(f32, f64); 4];

/// Log-spaced histogram of input scores with each bin's sum of squares, for input sparsity:
/// the cut-off skipping a share of the inputs, and the share of the scores' energy it drops.
#[derive(Clone)]
struct ScoreHistogram {
    counts: MagnitudeHistogram,
    energy: Vec<f64>, // per bin of `counts`, the sum of the squared scores
}

impl ScoreHistogram {
    fn new() -> Self {
        let counts = MagnitudeHistogram::new();
        let energy = vec![0.0; counts.bins.len()];
        ScoreHistogram { counts, energy }
    }

    fn add(&mut self, v: f32) {
        let a = v.abs();
        self.counts.add(a);
        if a > 0.0 && a.is_finite() {
            let i = ((a.log2() - MagnitudeHistogram::LOG2_MIN) * MagnitudeHistogram::PER_OCTAVE).max(0.0) as usize;
            let last = self.energy.len() - 1;
            self.energy[i.min(last)] += (a as f64) * (a as f64);
        }
    }

    /// (cut-off, energy share below it): the cut-off at or below which `fraction` of the scores
    /// fall (as `MagnitudeHistogram::quantile`), and the share of the sum of squared scores
    /// those skipped inputs carry.
    fn cut(&self, fraction: f64) -> (f32, f64) {
        let cut = self.counts.quantile(fraction);
        let total: f64 = self.energy.iter().sum();
        let edge = |i: usize| ((i + 1) as f32 / MagnitudeHistogram::PER_OCTAVE + MagnitudeHistogram::LOG2_MIN).exp2();
        let below: f64 = self.energy.iter().enumerate().take_while(|&(i, _)| edge(i) <= cut).map(|(_, e)| e).sum();
        (cut, if total > 0.0 { below / total } else { 0.0 })
    }
}

/// Histogram of signed values (log-spaced magnitudes on either side of zero), for predictor
/// cut-offs: the logits the predictor gave the neurons that truly fired.
#[derive(Clone)]
struct SignedHistogram {
    neg: MagnitudeHistogram, // magnitudes of the negative values
    pos: MagnitudeHistogram, // zeros and positive values
}

impl SignedHistogram {
    fn new() -> Self {
        SignedHistogram { neg: MagnitudeHistogram::new(), pos: MagnitudeHistogram::new() }
    }

    fn add(&mut self, v: f32) {
        if v < 0.0 {
            self.neg.add(v)
        } else if !v.is_nan() {
            self.pos.add(v)
        }
    }

    /// The largest bin edge t with at most `fraction` of the values below it, so that at least
    /// 1 - fraction of them are >= t (a cut-off with at least that recall on these values).
    fn lower_cut(&self, fraction: f64) -> f32 {
        let edge = |i: usize| ((i as f32) / MagnitudeHistogram::PER_OCTAVE + MagnitudeHistogram::LOG2_MIN).exp2();
        let total = self.neg.zeros + self.neg.bins.iter().sum::<u64>() + self.pos.zeros + self.pos.bins.iter().sum::<u64>();
        let allowed = (fraction * total as f64).floor() as u64;
        // in increasing value: the negative bins from the largest magnitude down, then zero
        // and the positive bins; stop at the first bin that would put too many below the cut
        let mut below = 0;
        let last = self.neg.bins.len() - 1;
        for i in (0..=last).rev() {
            below += self.neg.bins[i];
            if below > allowed {
                // values of bin i lie in (-edge(i + 1), -edge(i)]; the last bin has no bound
                return if i == last { f32::MIN } else { -edge(i + 1) };
            }
        }
        below += self.pos.zeros;
        if below > allowed {
            return 0.0;
        }
        for (i, &c) in self.pos.bins.iter().enumerate() {
            below += c;
            if below > allowed {
                // values of bin i lie in [edge(i), edge(i + 1)); bin 0 also holds smaller ones
                return if i == 0 { 0.0 } else { edge(i) };
            }
        }
        f32::MAX
    }
}

/// What a calibration run records per layer.
enum Calibration {
    /// |act(gate)| of every neuron (threshold mode's cut-offs).
    GateMagnitudes(Vec<MagnitudeHistogram>),
    /// The predictor logits of the neurons that truly fired (predictor cut-offs).
    ActiveLogits(Vec<SignedHistogram>),
    /// Per `InputGroup`, the scores |x_i| * |W[:, i]| of every input (input sparsity).
    InputScores(Vec<[ScoreHistogram; 4]>),
}

/// Zeroes, in each row of x (rows of `norms.len()`), the values whose score |x_i| * norms[i] is
/// at or below `cut`; returns how many values were kept over all rows.
fn mask_below(x: &mut [f32], norms: &[f32], cut: f32) -> usize {
    let mut kept = 0;
    for row in x.chunks_exact_mut(norms.len()) {
        for (v, &w) in row.iter_mut().zip(norms) {
            if v.abs() * w > cut {
                kept += 1;
            } else {
                *v = 0.0;
            }
        }
    }
    kept
}

/// Records the input scores |x_i| * |W[:, i]| of group `g` (rows of x) while calibrating input
/// sparsity.
fn record_scores(cal: &mut Option<Calibration>, l: usize, g: InputGroup, x: &[f32], model: &Model) {
    if let Some(Calibration::InputScores(hists)) = cal {
        let norms = model.input_norms(l, g);
        for row in x.chunks_exact(norms.len()) {
            row.iter().zip(norms).for_each(|(v, w)| hists[l][g as usize].add(v.abs() * w));
        }
    }
}

/// outs[k] (n, rows of matrix k) = x (n, cols) @ W_k^T for the matrices of input group `group`
/// of layer `l` (not down, see `project_down`), which share the input x. With a cut-off for their `group`, a token's inputs whose score
/// |x_i| * |W[:, i]| is at or below it are skipped: the products read only the kept inputs'
/// rows of the input-major copies. Without one, every input, through the row-major kernels.
/// Counts the weight bytes per token a dense pass reads and the bytes read.
#[allow(clippy::too_many_arguments)]
fn project(
    model: &Model,
    l: usize,
    group: InputGroup,
    cut: Option<f32>,
    x: &[f32],
    n: usize,
    acts: &mut Activations,
    masked: &mut Vec<f32>,
    sparse: &mut SparseScratch,
    outs: &mut [&mut [f32]],
    stats: &mut FfnStats,
) {
    let lw = &model.weights.layers[l];
    let mats = group.matrices(lw);
    let mut row_major = [lw.wq; 3];
    for (k, m) in mats.iter().enumerate() {
        row_major[k] = m.of(lw).expect("the caller only names matrices the layer has");
    }
    let row_major = &row_major[..mats.len()];
    let dense_bytes: usize = row_major.iter().map(|m| m.data.len()).sum();
    stats.weight_bytes += (n * dense_bytes) as u64;
    match cut {
        None => {
            acts.set(x, n, x.len() / n);
            matmul_many(row_major, acts, outs);
            stats.weight_bytes_read += (n * dense_bytes) as u64;
        }
        Some(cut) => {
            masked.clear();
            masked.extend_from_slice(x);
            let kept = mask_below(masked, model.input_norms(l, group), cut);
            for (m, out) in mats.iter().zip(outs.iter_mut()) {
                let copy = model.input_major(l, *m).expect("as above");
                stats.weight_bytes_read += (kept * copy.row_bytes()) as u64;
                down_t_matmul(&copy, masked, n, out, sparse);
            }
        }
    }
}

/// Times one token's products of input group `g` of layer `l`, dense (row-major kernels) and
/// reading `1 - skip` of the inputs through the input-major copies, on a pseudo-random input
/// cut at its own `skip` quantile of scores: (dense seconds, sparse seconds, bytes dense,
/// bytes sparse) per product, the medians of `reps` alternating runs. Calibration uses it to
/// keep input sparsity off matrices where it is not faster on this machine.
pub fn time_input_sparsity(model: &Model, l: usize, g: InputGroup, skip: f64, reps: usize) -> Result<(f64, f64, u64, u64)> {
    let c = &model.config;
    if l >= c.n_layer || !(0.0..1.0).contains(&skip) || reps == 0 {
        return Err(Error::InvalidArgument(format!("bad layer {l}, skip share {skip} or repetitions {reps}")));
    }
    let lw = &model.weights.layers[l];
    let norms = model.input_norms(l, g);
    let n_in = norms.len();
    // a deterministic input with a spread of magnitudes
    let x: Vec<f32> = (0..n_in).map(|i| ((i as f32 * 0.618_034).fract() - 0.5) * (1.0 + (i % 7) as f32)).collect();
    let mut scores: Vec<f32> = x.iter().zip(norms).map(|(v, w)| v.abs() * w).collect();
    scores.sort_by(f32::total_cmp);
    let k = ((skip * n_in as f64) as usize).min(n_in - 1);
    let cut = if k == 0 { None } else { Some(scores[k - 1]) };
    let outs_len: Vec<usize> = match g {
        InputGroup::Down => vec![c.n_embd],
        _ => g.matrices(lw).iter().map(|m| m.of(lw).expect("the group's matrices exist").rows).collect(),
    };
    let mut bufs: Vec<Vec<f32>> = outs_len.iter().map(|&n| vec![0.0; n]).collect();
    let (mut acts, mut masked, mut sparse) = (Activations::default(), Vec::new(), SparseScratch::default());
    let mut run = |cut: Option<f32>, stats: &mut FfnStats| {
        let mut outs: Vec<&mut [f32]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
        match g {
            InputGroup::Down => {
                // the product masks its input in place: give it a copy
                masked.clear();
                masked.extend_from_slice(&x);
                project_down(model, l, cut, &mut masked, 1, &mut acts, &mut sparse, outs[0], stats);
            }
            _ => project(model, l, g, cut, &x, 1, &mut acts, &mut masked, &mut sparse, &mut outs, stats),
        }
    };
    let (mut dense_t, mut sparse_t) = (Vec::with_capacity(reps), Vec::with_capacity(reps));
    let (mut dense_st, mut sparse_st) = (FfnStats::default(), FfnStats::default());
    model.install(|| {
        // the first runs build the copies, bring the weights in and count the bytes
        run(None, &mut dense_st);
        run(cut, &mut sparse_st);
        for _ in 0..reps {
            let t = std::time::Instant::now();
            run(None, &mut FfnStats::default());
            dense_t.push(t.elapsed().as_secs_f64());
            let t = std::time::Instant::now();
            run(cut, &mut FfnStats::default());
            sparse_t.push(t.elapsed().as_secs_f64());
        }
    });
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    Ok((median(&mut dense_t), median(&mut sparse_t), dense_st.weight_bytes_read, sparse_st.weight_bytes_read))
}

/// out (n, n_embd) = h (n, n_ff) @ down^T for layer `l`. With a cut-off, the activations whose
/// |h_j| * |down[:, j]| is at or below it are zeroed in `h` and skipped: the product reads only
/// the kept neurons' rows of `down_t`. Without one, the row-major down matrix when the model
/// has it. Counts the neurons, the skipped ones and the weight bytes.
#[allow(clippy::too_many_arguments)]
fn project_down(model: &Model, l: usize, cut: Option<f32>, h: &mut [f32], n: usize, acts: &mut Activations, sparse: &mut SparseScratch, out: &mut [f32], stats: &mut FfnStats) {
    let lw = &model.weights.layers[l];
    let down_t = model.down_t(l);
    let n_ff = down_t.rows;
    let down_bytes = lw.ffn_down.map_or(down_t.data.len(), |d| d.data.len());
    stats.neurons += (n * n_ff) as u64;
    stats.weight_bytes += (n * down_bytes) as u64;
    match (cut, lw.ffn_down) {
        (None, Some(down)) => {
            acts.set(h, n, n_ff);
            matmul(&down, acts, out);
            stats.weight_bytes_read += (n * down_bytes) as u64;
        }
        (cut, _) => {
            let kept = cut.map_or(n * n_ff, |cut| mask_below(h, model.input_norms(l, InputGroup::Down), cut));
            stats.skipped += (n * n_ff - kept) as u64;
            stats.weight_bytes_read += (kept * down_t.row_bytes()) as u64;
            down_t_matmul(&down_t, h, n, out, sparse);
        }
    }
}

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

/// Activation buffers, resized per batch and reused across calls.
#[derive(Default)]
struct Scratch {
    x: Vec<f32>,        // (n, n_embd) residual stream
    xb: Vec<f32>,       // (n, n_embd) normed input of attention or FFN
    q: Vec<f32>,        // (n, q_dim)
    k: Vec<f32>,        // (n, kv_dim)
    v: Vec<f32>,        // (n, kv_dim)
    att: Vec<f32>,      // (n, q_dim) attention output before the projection
    attn_out: Vec<f32>, // (n, n_embd) attention block output
    ffn_out: Vec<f32>,  // (n, n_embd) FFN block output
    gate: Vec<f32>,     // (n, n_ff) gate values, then activations
    up: Vec<f32>,       // (n, n_ff)
    keep: Vec<bool>,    // (n, n_ff) neurons selected by the predictor or threshold
    neurons: Vec<u32>,  // selected neuron indices of one token, or of a batch's union
    picked: Vec<bool>,  // (n_ff) whether some token of the batch selected the neuron
    sel_gate: Vec<f32>, // (n, selected) gate values of the union's rows in sparse prefill
    sel_up: Vec<f32>,   // (n, selected) up values of the union's rows in sparse prefill
    pred_hidden: Vec<f32>, // (n, predictor hidden)
    pred_logits: Vec<f32>, // (n, n_ff)
    masked: Vec<f32>,   // (n, inputs) a projection's input with the skipped inputs zeroed
    scores: Vec<Vec<f32>>, // decode: per kv head, its query heads' attention scores
    acts: Activations,
    pred_acts: Activations,
    sparse: SparseScratch,
    cos: Vec<f32>,      // (n, rope_dim / 2)
    sin: Vec<f32>,      // (n, rope_dim / 2)
}

impl Scratch {
    /// Sizes the per-token buffers for a batch of `n` tokens.
    fn resize_for(&mut self, n: usize, c: &Config) {
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
    fn embed(&mut self, w: &Weights, dim: usize, tokens: &[u32], positions: impl Iterator<Item = usize>) {
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

    /// RoPE angles of each token's position, shared by every layer: cos, sin (n, rope_dim / 2).
    fn rope_angles(&mut self, inv_freq: &[f32], positions: impl ExactSizeIterator<Item = usize>) {
        let half = inv_freq.len();
        self.cos.resize(positions.len() * half, 0.0);
        self.sin.resize(positions.len() * half, 0.0);
        for (t, pos) in positions.enumerate() {
            for (i, f) in inv_freq.iter().enumerate() {
                let angle = pos as f32 * f;
                self.cos[t * half + i] = angle.cos();
                self.sin[t * half + i] = angle.sin();
            }
        }
    }
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

fn layernorm(out: &mut [f32], x: &[f32], w: &[f32], b: Option<&[f32]>, eps: f32) {
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
fn norm(family: Family, out: &mut [f32], x: &[f32], w: &[f32], b: Option<&[f32]>, eps: f32) {
    match family {
        Family::Llama => rmsnorm(out, x, w, eps),
        Family::Falcon | Family::Opt => layernorm(out, x, w, b, eps),
    }
}

/// Adds `bias` to every row of `x`.
fn add_bias(x: &mut [f32], bias: Option<&[f32]>) {
    if let Some(b) = bias {
        x.chunks_exact_mut(b.len()).for_each(|r| r.iter_mut().zip(b).for_each(|(v, bi)| *v += bi));
    }
}

fn add_into(x: &mut [f32], d: &[f32]) {
    x.iter_mut().zip(d).for_each(|(x, d)| *x += d);
}

/// Rotates each head of `x` (n, n_heads * head_dim) by its token's angles.
fn rope(x: &mut [f32], head_dim: usize, rope_dim: usize, style: RopeStyle, cos: &[f32], sin: &[f32]) {
    let half = rope_dim / 2;
    if half == 0 || style == RopeStyle::None {
        return;
    }
    let row_len = x.len() / (cos.len() / half);
    for (t, row) in x.chunks_exact_mut(row_len).enumerate() {
        let (c, s) = (&cos[t * half..(t + 1) * half], &sin[t * half..(t + 1) * half]);
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
    }
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
                let thr = sp.predictor_layer_thresholds.get(l).copied().unwrap_or(sp.predictor_threshold);
                s.keep.clear();
                s.keep.extend(s.pred_logits.iter().map(|&v| v >= thr));
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
