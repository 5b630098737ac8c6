//! How a session's FFNs are computed (`SparsityMode`, `Sparsity`, checked and set by
//! `Session::set_sparsity`) and what they did (`FfnStats`).

use super::*;

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
            _ => Err(Error::InvalidArgument(format!(
                "sparsity must be 'dense', 'predictor' or 'threshold', got '{s}'"
            ))),
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

    /// Layer `l`'s predictor cut-off: the per-layer one when set, else the global one.
    pub fn predictor_cutoff(&self, l: usize) -> f32 {
        self.predictor_layer_thresholds.get(l).copied().unwrap_or(self.predictor_threshold)
    }

    /// The predictor's rule, the one every executor applies (the CPU's selection, the hybrid
    /// executor's cold neurons, and the `ffn_hot` kernels' early exit, which reads
    /// `!(logit >= cutoff)` so that a NaN logit is never selected): a neuron is computed iff
    /// its logit is at least the cut-off.
    #[inline]
    pub fn predictor_selects(logit: f32, cutoff: f32) -> bool {
        logit >= cutoff
    }

    /// Layer `l`'s cut-off for input group `g`, when that group skips inputs.
    pub(crate) fn input_cut(&self, l: usize, g: InputGroup) -> Option<f32> {
        let t = self.input_thresholds.get(l)?[g as usize];
        (self.mode == SparsityMode::Threshold && t > 0.0).then_some(t)
    }
}

impl Session {
    /// Chooses how the FFNs are computed from now on. Predictor mode needs a predictor in every
    /// layer; threshold mode one finite threshold per layer. A sparse mode on a file without
    /// `ffn_down_t` builds the neuron-major down projection now (once per model).
    pub fn set_sparsity(&mut self, sp: Sparsity) -> Result<()> {
        let model = Arc::clone(&self.model);
        let c = &model.config;
        if !sp.predictor_threshold.is_finite() {
            return Err(Error::InvalidArgument(format!(
                "predictor threshold must be finite, got {}",
                sp.predictor_threshold
            )));
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
                    return Err(Error::InvalidArgument(format!(
                        "layer {l} predictor threshold must be finite, got {t}"
                    )));
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
                let bad = sp.input_thresholds.iter().enumerate().find_map(|(l, t)| {
                    t.iter().find(|v| !(v.is_finite() && **v >= 0.0)).map(|v| (l, *v))
                });
                if let Some((l, t)) = bad {
                    return Err(Error::InvalidArgument(format!(
                        "layer {l} input cut-off must be finite and >= 0, got {t}"
                    )));
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
                if let Some((l, t)) =
                    sp.layer_thresholds.iter().enumerate().find(|(_, t)| !t.is_finite())
                {
                    return Err(Error::InvalidArgument(format!(
                        "layer {l} threshold must be finite, got {t}"
                    )));
                }
            }
        }
        if sp.mode != SparsityMode::Dense {
            (0..c.n_layer).for_each(|l| {
                model.down_t(l);
            });
        }
        self.state.sparsity = sp;
        Ok(())
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

impl FfnStats {
    pub fn add(&mut self, more: FfnStats) {
        self.neurons += more.neurons;
        self.skipped += more.skipped;
        self.truly_active += more.truly_active;
        self.truly_active_selected += more.truly_active_selected;
        self.weight_bytes += more.weight_bytes;
        self.weight_bytes_read += more.weight_bytes_read;
    }

    /// Each counter divided by `k`: one row's share of a pass whose k rows cost the same.
    pub(crate) fn share_of(self, k: u64) -> FfnStats {
        FfnStats {
            neurons: self.neurons / k,
            skipped: self.skipped / k,
            truly_active: self.truly_active / k,
            truly_active_selected: self.truly_active_selected / k,
            weight_bytes: self.weight_bytes / k,
            weight_bytes_read: self.weight_bytes_read / k,
        }
    }
}
