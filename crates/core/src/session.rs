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

use rayon::prelude::*;

use crate::attention::{attend_group, KvBuf, KvType};
use crate::error::{Error, Result};
use crate::forward::forward;
use crate::matmul::{matmul, matmul_many, matmul_selected, Activations, QMatrix};
use crate::model::{Config, Family, FfnActivation, InputGroup, LayerWeights, Model, RopeStyle, Weights, OPT_POSITION_OFFSET};
use crate::sparse::{down_t_matmul, sparse_ffn, FfnMats, SparseScratch, DENSE_FRACTION};

mod batch;
mod calibration;
mod cpu;
mod ffn;
mod input_sparsity;
mod math;
mod observe;
mod scratch;
mod sparsity;
pub use batch::{check_batch, decode_batch};
pub use cpu::CpuPass;
pub use input_sparsity::time_input_sparsity;
pub use scratch::Capture;
pub use sparsity::{FfnStats, Sparsity, SparsityMode};
use calibration::*;
use ffn::*;
use input_sparsity::*;
use math::*;
use observe::*;
use scratch::*;

pub struct Session {
    pub model: Arc<Model>,
    pub n_ctx: usize,
    /// Every token evaluated so far; `tokens.len()` is the next position.
    pub tokens: Vec<u32>,
    k_cache: Vec<KvBuf>,     // per layer (n_ctx, n_head_kv * head_dim)
    v_cache: Vec<KvBuf>,     // per layer (n_ctx, n_head_kv * head_dim)
    rope_inv_freq: Vec<f32>, // (rope_dim / 2)
    state: PassState,
    s: Scratch,
}

/// What the pass reads and updates per session besides its activations and KV cache.
pub(crate) struct PassState {
    pub(crate) sparsity: Sparsity,
    pub(crate) stats: FfnStats,
    /// Calibration or capture, watching the pass (see `observe.rs`).
    pub(crate) recorder: Option<Recorder>,
}

impl PassState {
    pub(crate) fn new(sparsity: Sparsity) -> PassState {
        PassState { sparsity, stats: FfnStats::default(), recorder: None }
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
            state: PassState::new(Sparsity::dense()),
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
        &self.state.sparsity
    }

    /// Starts (or stops, discarding what was recorded) recording FFN inputs and neuron scores
    /// for every evaluated token; see `Capture`. While recording, every FFN is computed densely
    /// on the batch path, whatever the sparsity mode.
    pub fn set_capture(&mut self, on: bool) {
        self.state.recorder = on.then(|| Recorder::Capture(Capture::new(self.model.config.n_layer)));
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

    /// FFN counters since the last `take_stats`, left in place.
    pub fn stats(&self) -> FfnStats {
        self.state.stats
    }

    /// Adds FFN counters gathered by an outside executor.
    pub fn add_stats(&mut self, more: FfnStats) {
        self.state.stats.add(more);
    }

    /// Evaluates `tokens` at the next positions and returns logits: (n, n_vocab) when
    /// `all_logits`, else only the last token's (n_vocab).
    pub fn eval(&mut self, tokens: &[u32], all_logits: bool) -> Result<Vec<f32>> {
        self.check_room(tokens)?;
        let model = Arc::clone(&self.model);
        let n_logits = if all_logits { tokens.len() } else { 1 };
        let logits = model.install(|| forward(&mut CpuPass::new(self, tokens.len()), &model, tokens, n_logits))?;
        self.tokens.extend_from_slice(tokens);
        Ok(logits)
    }

    /// Checks that `tokens` can be evaluated next: at least one, each in the vocabulary, and
    /// room for them in the context. Every executor of a session calls it before running.
    pub fn check_room(&self, tokens: &[u32]) -> Result<()> {
        let n_vocab = self.model.config.n_vocab;
        if tokens.is_empty() {
            return Err(Error::InvalidArgument("no tokens to evaluate".into()));
        }
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= n_vocab) {
            return Err(Error::InvalidArgument(format!("token id {bad} is out of range (vocabulary has {n_vocab})")));
        }
        let needed = self.pos() + tokens.len();
        if needed > self.n_ctx {
            return Err(Error::ContextOverflow { needed, n_ctx: self.n_ctx });
        }
        Ok(())
    }
}
