//! A `Session` is one conversation with a model: the KV cache, the position, the token history,
//! the sparsity settings and counters, and the scratch buffers of the forward pass. Sessions are
//! independent, so several can run on one shared `Model` from different threads.
//!
//! `eval` runs the forward pass (`forward.rs`, the layer written once) over a batch of tokens
//! on the CPU backend (`CpuPass`): the whole prompt at once in prefill, one token per call in
//! decode. `decode_batch` runs the next token of several sessions as one pass. How the FFN runs
//! (dense, or sparse over a predictor's or a threshold's selection) is in `ffn.rs`; calibration
//! and the profiler's capture are observers of the pass (`observe.rs`).

use std::sync::Arc;

use crate::attention::{
    attend_block, attend_group, attend_group_partial, merge_partials, KvBuf, KvType, Partial,
    Scoring,
};
use crate::error::{Error, Result};
use crate::forward::forward;
use crate::matmul::{matmul, matmul_many, matmul_selected, Activations, QMatrix};
use crate::model::{
    Config, Family, FfnActivation, InputGroup, LayerWeights, Model, RopeSet, RopeStyle, Weights,
    OPT_POSITION_OFFSET,
};
use crate::sparse::{
    batch_union_reads_dense, decodes_dense, down_t_matmul, predicted_ffn, sparse_ffn, FfnMats,
    SparseScratch, DENSE_FRACTION, FUSED_PREDICTOR_FC1_BYTES,
};
use crate::step_times::{StepTimes, Timed};

mod batch;
mod calibration;
mod cpu;
mod ffn;
mod input_sparsity;
mod math;
mod moe;
mod observe;
mod projection;
mod scratch;
mod sparsity;
pub use batch::{check_batch, decode_batch};
use calibration::{mask_below, Calibration};
pub use cpu::CpuPass;
use ffn::{cells_ffn, ffn_rows};
pub use math::softcap;
use math::{add_bias, add_into, norm_rows, rmsnorm_in_place, rope_rows};
pub use moe::ExpertSlot;
use moe::{expert_rows, pick_routes, route_rows};
use observe::Recorder;
pub use projection::time_input_sparsity;
use projection::{project, project_down};
pub use scratch::Capture;
use scratch::Scratch;
pub use sparsity::{FfnStats, Sparsity, SparsityMode};

pub struct Session {
    pub model: Arc<Model>,
    pub n_ctx: usize,
    /// Every token evaluated so far; `tokens.len()` is the next position.
    pub tokens: Vec<u32>,
    k_cache: Vec<KvBuf>, // per layer (rows, n_head_kv * head_dim): n_ctx rows, or a ring's
    v_cache: Vec<KvBuf>, // per layer, as k_cache
    /// Per layer: the ring a sliding-window layer keeps (see `KvRing`), or None (one row per
    /// position).
    kv_ring: Vec<Option<KvRing>>,
    rope: Vec<RopeSet>, // per RoPE set (`Config::rope_set`)
    state: PassState,
    s: Scratch,
}

/// What the pass reads and updates per session besides its activations and KV cache.
pub(crate) struct PassState {
    pub(crate) sparsity: Sparsity,
    pub(crate) stats: FfnStats,
    /// Calibration or capture, watching the pass (see `observe.rs`).
    pub(crate) recorder: Option<Recorder>,
    /// Whether one token's sparse FFN reads the rows bundled by neuron
    /// (`Model::neuron_bundles`) rather than the three matrices apart.
    pub(crate) neuron_bundles: bool,
    /// Mixture-of-experts models: how many of the session's rows each layer routed to each
    /// expert since the last `take_expert_counts` (n_layer * n_expert; empty until counted).
    pub(crate) expert_counts: Vec<u64>,
    /// Where the passes' time went, step by step, while timing is on (`set_step_times`).
    pub(crate) step_times: Option<StepTimes>,
}

impl PassState {
    pub(crate) fn new(sparsity: Sparsity) -> PassState {
        PassState {
            sparsity,
            stats: FfnStats::default(),
            recorder: None,
            neuron_bundles: false,
            expert_counts: Vec::new(),
            step_times: None,
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
        // every layer's cache has at most n_ctx rows
        if n_ctx.checked_mul(c.kv_dim()).is_none() {
            return Err(Error::InvalidArgument(format!("n_ctx {n_ctx} is too large")));
        }
        // sliding layers keep a ring of their window when it is smaller than the context
        let kv_ring: Vec<Option<KvRing>> = (0..c.n_layer)
            .map(|l| {
                (c.slides(l) && KvRing::rows(c.sliding_window) < n_ctx)
                    .then(|| KvRing::new(c.sliding_window))
            })
            .collect();
        let rows = |l: usize| kv_ring[l].as_ref().map_or(n_ctx, |r| KvRing::rows(r.window));
        let cache = || {
            (0..c.n_layer)
                .map(|l| KvBuf::new(kv_type, rows(l) * c.kv_dim()))
                .collect::<Result<Vec<_>>>()
        };
        let rope = (0..c.rope_sets())
            .map(|set| c.rope(set, model.weights.rope_factors(c, n_ctx)))
            .collect();
        Ok(Session {
            n_ctx,
            tokens: Vec::new(),
            k_cache: cache()?,
            v_cache: cache()?,
            kv_ring,
            rope,
            state: PassState::new(Sparsity::dense()),
            s: Scratch::default(),
            model,
        })
    }

    pub fn pos(&self) -> usize {
        self.tokens.len()
    }

    /// Forgets everything after the first `n` tokens (the cache beyond is simply overwritten)
    /// and returns how many it kept: `n`, or 0 where a sliding layer's ring has already
    /// overwritten positions that the token after the first n would attend to.
    pub fn truncate(&mut self, n: usize) -> usize {
        let n = n.min(self.pos());
        let keeps = |ring: &KvRing| ring.keeps(n, self.pos());
        let n = if self.kv_ring.iter().flatten().all(keeps) { n } else { 0 };
        self.tokens.truncate(n);
        n
    }

    pub fn sparsity(&self) -> &Sparsity {
        &self.state.sparsity
    }

    /// Starts (or stops, discarding what was recorded) recording FFN inputs and neuron scores
    /// for every evaluated token; see `Capture`. While recording, every FFN is computed densely
    /// on the batch path, whatever the sparsity mode.
    pub fn set_capture(&mut self, on: bool) -> Result<()> {
        if on {
            self.model.dense_ffn_only("capturing FFN activations")?;
        }
        self.state.recorder =
            on.then(|| Recorder::Capture(Capture::new(self.model.config.n_layer)));
        Ok(())
    }

    /// Returns what was recorded since capturing started or since the last call, and keeps
    /// recording. None when not capturing.
    pub fn take_capture(&mut self) -> Option<Capture> {
        let n_layer = self.model.config.n_layer;
        match &mut self.state.recorder {
            Some(Recorder::Capture(c)) => Some(std::mem::replace(c, Capture::new(n_layer))),
            _ => None,
        }
    }

    /// Returns the FFN counters gathered since the last call and resets them.
    pub fn take_stats(&mut self) -> FfnStats {
        std::mem::take(&mut self.state.stats)
    }

    /// Per layer and expert, the rows routed to it since the last call (n_layer * n_expert,
    /// layer-major); None for a dense model. The offline profiler's expert frequencies.
    pub fn take_expert_counts(&mut self) -> Option<Vec<u64>> {
        let moe = self.model.config.moe?;
        let n = self.model.config.n_layer * moe.n_expert;
        let mut counts = std::mem::take(&mut self.state.expert_counts);
        counts.resize(n, 0);
        Some(counts)
    }

    /// Starts (or stops, discarding what was timed) timing each step of this session's passes
    /// (`step_times::Timed`).
    pub fn set_step_times(&mut self, on: bool) {
        self.state.step_times = on.then(StepTimes::default);
    }

    /// The steps' times since timing started or since the last call (then reset); None when not
    /// timing.
    pub fn take_step_times(&mut self) -> Option<StepTimes> {
        self.state.step_times.as_mut().map(std::mem::take)
    }

    /// FFN counters since the last `take_stats`, left in place.
    pub fn stats(&self) -> FfnStats {
        self.state.stats
    }

    /// Adds FFN counters gathered by an outside executor.
    pub fn add_stats(&mut self, more: FfnStats) {
        self.state.stats.add(more);
    }

    /// The most tokens one forward pass evaluates (llama.cpp's default n_ubatch): a longer prompt
    /// runs in passes of this many, so the activation buffers grow with the pass, not with the
    /// prompt (at 4,096 tokens they would hold more than the KV cache). The matmuls still reuse
    /// each unpacked weight row for 512 tokens, and a token's logits do not depend on the pass
    /// it ran in (the kernels keep one accumulator per token).
    pub const UBATCH: usize = 512;

    /// The most tokens a pass of this session evaluates: `UBATCH`, or a ring's spare rows where
    /// a sliding layer keeps a ring.
    pub fn pass_rows(&self) -> usize {
        if self.kv_ring.iter().any(Option::is_some) {
            KvRing::PASS_ROWS
        } else {
            Self::UBATCH
        }
    }

    /// Evaluates `tokens` at the next positions and returns logits: (n, n_vocab) when
    /// `all_logits`, else only the last token's (n_vocab).
    pub fn eval(&mut self, tokens: &[u32], all_logits: bool) -> Result<Vec<f32>> {
        self.check_room(tokens)?;
        let model = Arc::clone(&self.model);
        let per_pass = self.pass_rows();
        let mut logits = Vec::new();
        for (i, part) in tokens.chunks(per_pass).enumerate() {
            let last = (i + 1) * per_pass >= tokens.len();
            let n_logits = if all_logits { part.len() } else { usize::from(last) };
            // the times live outside the session while the pass borrows it
            let logits_of_part = match self.state.step_times.take() {
                Some(mut times) => {
                    let r = model.install(|| {
                        let pass = CpuPass::new(self, part.len());
                        forward(&mut Timed::new(pass, &mut times), &model, part, n_logits)
                    });
                    self.state.step_times = Some(times);
                    r
                }
                None => model.install(|| {
                    forward(&mut CpuPass::new(self, part.len()), &model, part, n_logits)
                }),
            };
            logits.extend(logits_of_part?);
            self.tokens.extend_from_slice(part);
        }
        Ok(logits)
    }

    /// Layer l's cache rows that hold position `pos` (a ring writes each position twice).
    pub(crate) fn kv_rows(&self, l: usize, pos: usize) -> [Option<usize>; 2] {
        match &self.kv_ring[l] {
            None => [Some(pos), None],
            Some(r) => r.rows_of(pos),
        }
    }

    /// The rows layer l's token at `pos` attends to, contiguous: (first row, count).
    pub(crate) fn kv_window(&self, l: usize, pos: usize) -> (usize, usize) {
        let c = &self.model.config;
        let first = if c.slides(l) { (pos + 1).saturating_sub(c.sliding_window) } else { 0 };
        let row = self.kv_ring[l].as_ref().map_or(first, |r| first % r.slots());
        (row, pos + 1 - first)
    }

    /// Checks that `tokens` can be evaluated next: at least one, each in the vocabulary, and
    /// room for them in the context. Every executor of a session calls it before running.
    pub fn check_room(&self, tokens: &[u32]) -> Result<()> {
        let n_vocab = self.model.config.n_vocab;
        if tokens.is_empty() {
            return Err(Error::InvalidArgument("no tokens to evaluate".into()));
        }
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= n_vocab) {
            return Err(Error::InvalidArgument(format!(
                "token id {bad} is out of range (vocabulary has {n_vocab})"
            )));
        }
        let needed = self.pos() + tokens.len();
        if needed > self.n_ctx {
            return Err(Error::ContextOverflow { needed, n_ctx: self.n_ctx });
        }
        Ok(())
    }
}

/// The KV cache of a sliding-window layer when the window is smaller than the context: a ring
/// of `slots` = window + PASS_ROWS positions, position p in slot p % slots. A pass stores its
/// rows before any of them attends, so the ring has room for a whole pass (at most PASS_ROWS
/// rows) beyond the window: no row overwrites a position another row of its pass still reads.
/// Each slot is stored twice, at rows s and s + slots, so that any run of up to `slots`
/// consecutive positions lies in consecutive rows: attention reads one contiguous range.
pub(crate) struct KvRing {
    window: usize,
}

impl KvRing {
    /// The most rows one pass over a session with rings evaluates.
    pub(crate) const PASS_ROWS: usize = 256;

    fn new(window: usize) -> KvRing {
        KvRing { window }
    }

    fn slots(&self) -> usize {
        self.window + Self::PASS_ROWS
    }

    /// The rows a ring for `window` allocates.
    fn rows(window: usize) -> usize {
        2 * (window + Self::PASS_ROWS)
    }

    fn rows_of(&self, pos: usize) -> [Option<usize>; 2] {
        let s = pos % self.slots();
        [Some(s), Some(s + self.slots())]
    }

    /// Whether, with positions 0..pos stored, the positions the token at n attends to (the
    /// window before it) are all still in the ring.
    fn keeps(&self, n: usize, pos: usize) -> bool {
        // position j is gone once position j + slots has been stored
        let first_needed = (n + 1).saturating_sub(self.window);
        pos <= first_needed + self.slots()
    }
}
