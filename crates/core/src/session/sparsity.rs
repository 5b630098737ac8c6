//! How a session's FFNs are computed (`SparsityMode`, `Sparsity`) and what they did
//! (`FfnStats`).

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
