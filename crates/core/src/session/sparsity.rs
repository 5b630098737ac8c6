//! How a session's FFNs are computed (`SparsityMode`, `Sparsity`, checked and set by
//! `Session::set_sparsity`) and what they did (`FfnStats`).

use super::{Arc, Error, InputGroup, Result, Session};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SparsityMode {
    /// Every FFN neuron is computed.
    Dense,
    /// The layer's predictor picks the neurons: `fc2 @ relu(fc1 @ x) >= predictor_threshold`.
    Predictor,
    /// The gate is computed densely; neurons with `|act(gate)| <= gate_cutoffs[l]` are skipped.
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

/// How a session computes its FFNs (and, for input sparsity, its other products): a mode and
/// the cut-offs that mode reads, so that no other combination can be asked for.
#[derive(Debug, Clone)]
pub enum Sparsity {
    /// Every FFN neuron is computed.
    Dense,
    /// The layer's predictor picks the neurons: neuron j is computed iff its predictor logit is
    /// at least the layer's cut-off (`predictor_cutoff`).
    Predictor {
        /// The cut-off of every layer without one of its own.
        cutoff: f32,
        /// One cut-off per layer (as trained per layer by the offline toolchain), or none.
        layer_cutoffs: Vec<f32>,
        /// Also compute the true activations (a dense pass) to measure recall.
        track_recall: bool,
    },
    /// The gate is computed densely; per layer, neurons whose |act(gate)| is at most the
    /// layer's cut-off are skipped.
    GateThreshold { gate_cutoffs: Vec<f32> },
    /// Input sparsity: per layer and `InputGroup`, the score |x_i| * |W[:, i]| an input must
    /// exceed for the group's matrices to read it (through their input-major copies); 0 reads
    /// every input with the row-major kernels.
    Inputs { input_cutoffs: Vec<[f32; 4]> },
}

impl Sparsity {
    pub fn dense() -> Sparsity {
        Sparsity::Dense
    }

    /// The mode's name as users choose it: gate thresholds and input sparsity are both
    /// "threshold" (training-free, calibrated per layer).
    pub fn mode(&self) -> SparsityMode {
        match self {
            Sparsity::Dense => SparsityMode::Dense,
            Sparsity::Predictor { .. } => SparsityMode::Predictor,
            Sparsity::GateThreshold { .. } | Sparsity::Inputs { .. } => SparsityMode::Threshold,
        }
    }

    /// Layer `l`'s predictor cut-off, in predictor mode.
    pub fn predictor_cutoff(&self, l: usize) -> Option<f32> {
        match self {
            Sparsity::Predictor { cutoff, layer_cutoffs, .. } => {
                Some(layer_cutoffs.get(l).copied().unwrap_or(*cutoff))
            }
            _ => None,
        }
    }

    pub fn track_recall(&self) -> bool {
        matches!(self, Sparsity::Predictor { track_recall: true, .. })
    }

    pub fn is_inputs(&self) -> bool {
        matches!(self, Sparsity::Inputs { .. })
    }

    /// The predictor's rule, the one every executor applies (`sparse::predictor_selects`).
    #[inline]
    pub fn predictor_selects(logit: f32, cutoff: f32) -> bool {
        crate::sparse::predictor_selects(logit, cutoff)
    }

    /// Layer `l`'s cut-off for input group `g`, when that group skips inputs.
    pub(crate) fn input_cut(&self, l: usize, g: InputGroup) -> Option<f32> {
        let Sparsity::Inputs { input_cutoffs } = self else { return None };
        let t = input_cutoffs.get(l)?[g as usize];
        (t > 0.0).then_some(t)
    }
}

impl Session {
    /// Whether one token's sparse FFN on the CPU reads each selected neuron's rows from its
    /// bundle (`Model::neuron_bundles`: the FFN's bytes once more in memory, built on the first
    /// token that reads them, so never where the FFNs run elsewhere) or from the three matrices
    /// apart. The same results either way.
    pub fn set_neuron_bundles(&mut self, on: bool) {
        self.state.neuron_bundles = on;
    }

    /// Chooses how the FFNs are computed from now on. Predictor mode needs a predictor in every
    /// layer; threshold mode one finite threshold per layer. A sparse mode on a file without
    /// `ffn_down_t` builds the neuron-major down projection now (once per model).
    pub fn set_sparsity(&mut self, sp: Sparsity) -> Result<()> {
        let model = Arc::clone(&self.model);
        let c = &model.config;
        if !matches!(sp, Sparsity::Dense) {
            model.dense_ffn_only("sparsity modes other than 'dense'")?;
        }
        match &sp {
            Sparsity::Dense => {}
            Sparsity::Predictor { cutoff, layer_cutoffs, .. } => {
                if !cutoff.is_finite() {
                    return Err(Error::InvalidArgument(format!(
                        "predictor cut-off must be finite, got {cutoff}"
                    )));
                }
                if let Some(l) = model.weights.layers.iter().position(|l| l.predictor.is_none()) {
                    return Err(Error::InvalidArgument(format!(
                        "predictor mode needs a predictor in every layer, but layer {l} has no blk.{l}.fc1/fc2 \
                         (use sparsity='threshold' or 'dense')"
                    )));
                }
                if !layer_cutoffs.is_empty() && layer_cutoffs.len() != c.n_layer {
                    return Err(Error::InvalidArgument(format!(
                        "predictor mode needs {} per-layer thresholds (or none), got {}",
                        c.n_layer,
                        layer_cutoffs.len()
                    )));
                }
                if let Some((l, t)) = layer_cutoffs.iter().enumerate().find(|(_, t)| !t.is_finite())
                {
                    return Err(Error::InvalidArgument(format!(
                        "layer {l} predictor cut-off must be finite, got {t}"
                    )));
                }
            }
            Sparsity::Inputs { input_cutoffs } => {
                if input_cutoffs.len() != c.n_layer {
                    return Err(Error::InvalidArgument(format!(
                        "input sparsity needs {} per-layer cut-off sets, got {}",
                        c.n_layer,
                        input_cutoffs.len()
                    )));
                }
                let bad = input_cutoffs.iter().enumerate().find_map(|(l, t)| {
                    t.iter().find(|v| !(v.is_finite() && **v >= 0.0)).map(|v| (l, *v))
                });
                if let Some((l, t)) = bad {
                    return Err(Error::InvalidArgument(format!(
                        "layer {l} input cut-off must be finite and >= 0, got {t}"
                    )));
                }
                // the input-major copies the cut-offs will read, built now (once per model)
                for (l, t) in input_cutoffs.iter().enumerate() {
                    for g in InputGroup::ALL.into_iter().filter(|&g| t[g as usize] > 0.0) {
                        g.matrices(&model.weights.layers[l]).iter().for_each(|&m| {
                            model.input_major(l, m);
                        });
                    }
                    model.input_norms(l, InputGroup::Qkv);
                }
            }
            Sparsity::GateThreshold { gate_cutoffs } => {
                if gate_cutoffs.len() != c.n_layer {
                    return Err(Error::InvalidArgument(format!(
                        "threshold mode needs {} gate cut-offs (one per layer), got {}",
                        c.n_layer,
                        gate_cutoffs.len()
                    )));
                }
                if let Some((l, t)) = gate_cutoffs.iter().enumerate().find(|(_, t)| !t.is_finite())
                {
                    return Err(Error::InvalidArgument(format!(
                        "layer {l} gate cut-off must be finite, got {t}"
                    )));
                }
            }
        }
        if sp.mode() != SparsityMode::Dense {
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
