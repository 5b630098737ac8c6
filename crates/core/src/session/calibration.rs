//! Calibration of the cut-offs: per-layer histograms of |act(gate)| (the neuron rule), of input
//! scores (input sparsity) and of predictor logits, recorded by a dense pass (as an observer,
//! `observe.rs`) and read back as quantiles (`Session::calibrate*`).

use super::{Error, FfnStats, Recorder, Result, Session, Sparsity};

/// Log-spaced histogram of |act(gate)| values for one layer, for threshold calibration.
#[derive(Clone)]
pub(crate) struct MagnitudeHistogram {
    pub(crate) zeros: u64,
    pub(crate) bins: Vec<u64>,
}

impl MagnitudeHistogram {
    const LOG2_MIN: f32 = -40.0;
    const PER_OCTAVE: f32 = 64.0;
    const OCTAVES: usize = 60;

    pub(crate) fn new() -> Self {
        MagnitudeHistogram { zeros: 0, bins: vec![0; Self::OCTAVES * Self::PER_OCTAVE as usize] }
    }

    pub(crate) fn add(&mut self, v: f32) {
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
    pub(crate) fn quantile(&self, fraction: f64) -> f32 {
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
pub(crate) struct ScoreHistogram {
    pub(crate) counts: MagnitudeHistogram,
    pub(crate) energy: Vec<f64>, // per bin of `counts`, the sum of the squared scores
}

impl ScoreHistogram {
    pub(crate) fn new() -> Self {
        let counts = MagnitudeHistogram::new();
        let energy = vec![0.0; counts.bins.len()];
        ScoreHistogram { counts, energy }
    }

    pub(crate) fn add(&mut self, v: f32) {
        let a = v.abs();
        self.counts.add(a);
        if a > 0.0 && a.is_finite() {
            let i = ((a.log2() - MagnitudeHistogram::LOG2_MIN) * MagnitudeHistogram::PER_OCTAVE)
                .max(0.0) as usize;
            let last = self.energy.len() - 1;
            self.energy[i.min(last)] += (a as f64) * (a as f64);
        }
    }

    /// (cut-off, energy share below it): the cut-off at or below which `fraction` of the scores
    /// fall (as `MagnitudeHistogram::quantile`), and the share of the sum of squared scores
    /// those skipped inputs carry.
    pub(crate) fn cut(&self, fraction: f64) -> (f32, f64) {
        let cut = self.counts.quantile(fraction);
        let total: f64 = self.energy.iter().sum();
        let edge = |i: usize| {
            ((i + 1) as f32 / MagnitudeHistogram::PER_OCTAVE + MagnitudeHistogram::LOG2_MIN).exp2()
        };
        let below: f64 = self
            .energy
            .iter()
            .enumerate()
            .take_while(|&(i, _)| edge(i) <= cut)
            .map(|(_, e)| e)
            .sum();
        (cut, if total > 0.0 { below / total } else { 0.0 })
    }
}

/// Histogram of signed values (log-spaced magnitudes on either side of zero), for predictor
/// cut-offs: the logits the predictor gave the neurons that truly fired.
#[derive(Clone)]
pub(crate) struct SignedHistogram {
    pub(crate) neg: MagnitudeHistogram, // magnitudes of the negative values
    pub(crate) pos: MagnitudeHistogram, // zeros and positive values
}

impl SignedHistogram {
    pub(crate) fn new() -> Self {
        SignedHistogram { neg: MagnitudeHistogram::new(), pos: MagnitudeHistogram::new() }
    }

    pub(crate) fn add(&mut self, v: f32) {
        if v < 0.0 {
            self.neg.add(v)
        } else if !v.is_nan() {
            self.pos.add(v)
        }
    }

    /// The largest bin edge t with at most `fraction` of the values below it, so that at least
    /// 1 - fraction of them are >= t (a cut-off with at least that recall on these values).
    pub(crate) fn lower_cut(&self, fraction: f64) -> f32 {
        let edge = |i: usize| {
            ((i as f32) / MagnitudeHistogram::PER_OCTAVE + MagnitudeHistogram::LOG2_MIN).exp2()
        };
        let total = self.neg.zeros
            + self.neg.bins.iter().sum::<u64>()
            + self.pos.zeros
            + self.pos.bins.iter().sum::<u64>();
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
pub(crate) enum Calibration {
    /// |act(gate)| of every neuron (threshold mode's cut-offs).
    GateMagnitudes(Vec<MagnitudeHistogram>),
    /// The predictor logits of the neurons that truly fired (predictor cut-offs).
    ActiveLogits(Vec<SignedHistogram>),
    /// Per `InputGroup`, the scores |x_i| * |W[:, i]| of every input (input sparsity).
    InputScores(Vec<[ScoreHistogram; 4]>),
}

/// Zeroes, in each row of x (rows of `norms.len()`), the values whose score |x_i| * norms[i] is
/// at or below `cut`; returns how many values were kept over all rows.
pub(crate) fn mask_below(x: &mut [f32], norms: &[f32], cut: f32) -> usize {
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

impl Session {
    /// Runs `tokens` densely (in windows of at most `window` tokens, each from an empty context)
    /// and returns, for each target sparsity in `targets`, the per-layer |act(gate)| thresholds
    /// under which that fraction of the neurons fall. The session is left empty and dense.
    pub fn calibrate(
        &mut self,
        tokens: &[u32],
        window: usize,
        targets: &[f64],
    ) -> Result<Vec<Vec<f32>>> {
        if let Some(t) = targets.iter().find(|t| !(0.0..1.0).contains(*t)) {
            return Err(Error::InvalidArgument(format!(
                "target sparsity must be in [0, 1), got {t}"
            )));
        }
        let hists = vec![MagnitudeHistogram::new(); self.model.config.n_layer];
        match self.record_windows(
            tokens,
            window,
            Sparsity::dense(),
            Calibration::GateMagnitudes(hists),
        )? {
            Calibration::GateMagnitudes(hists) => {
                Ok(targets.iter().map(|&t| hists.iter().map(|h| h.quantile(t)).collect()).collect())
            }
            _ => unreachable!("recorded what was asked"),
        }
    }

    /// Runs `tokens` densely (windows as in `calibrate`) and returns, for each recall target in
    /// `recalls`, the per-layer predictor cut-offs that keep at least that fraction of the
    /// neurons that truly fired (nonzero activation) on these tokens. Needs predictors in every
    /// layer. The session is left empty, in its previous mode.
    pub fn calibrate_predictor(
        &mut self,
        tokens: &[u32],
        window: usize,
        recalls: &[f64],
    ) -> Result<Vec<Vec<f32>>> {
        if let Some(r) = recalls.iter().find(|r| !(**r > 0.0 && **r <= 1.0)) {
            return Err(Error::InvalidArgument(format!(
                "recall target must be in (0, 1], got {r}"
            )));
        }
        if let Some(l) = self.model.weights.layers.iter().position(|l| l.predictor.is_none()) {
            return Err(Error::InvalidArgument(format!(
                "predictor calibration needs a predictor in every layer, but layer {l} has none"
            )));
        }
        // every neuron selected: the predictor runs, the FFN stays dense
        let all = Sparsity::Predictor {
            cutoff: f32::MIN,
            layer_cutoffs: Vec::new(),
            track_recall: false,
        };
        let hists = vec![SignedHistogram::new(); self.model.config.n_layer];
        match self.record_windows(tokens, window, all, Calibration::ActiveLogits(hists))? {
            Calibration::ActiveLogits(hists) => Ok(recalls
                .iter()
                .map(|&r| hists.iter().map(|h| h.lower_cut(1.0 - r)).collect())
                .collect()),
            _ => unreachable!("recorded what was asked"),
        }
    }

    /// Runs `tokens` densely (windows as in `calibrate`) and returns, for each share in `levels`,
    /// per layer and `InputGroup`, the (cut-off, energy share) pair of input sparsity: the score
    /// |x_i| * |W[:, i]| at or below which that share of the group's inputs fall, and the share
    /// of the sum of squared scores those inputs carry (how much of the output the skipped
    /// inputs would have made, were the columns orthogonal).
    pub fn calibrate_inputs(
        &mut self,
        tokens: &[u32],
        window: usize,
        levels: &[f64],
    ) -> Result<Vec<Vec<GroupCuts>>> {
        if let Some(t) = levels.iter().find(|t| !(0.0..1.0).contains(*t)) {
            return Err(Error::InvalidArgument(format!(
                "input sparsity level must be in [0, 1), got {t}"
            )));
        }
        let hists = vec![[(); 4].map(|_| ScoreHistogram::new()); self.model.config.n_layer];
        match self.record_windows(
            tokens,
            window,
            Sparsity::dense(),
            Calibration::InputScores(hists),
        )? {
            Calibration::InputScores(hists) => Ok(levels
                .iter()
                .map(|&t| hists.iter().map(|h| [0, 1, 2, 3].map(|g| h[g].cut(t))).collect())
                .collect()),
            _ => unreachable!("recorded what was asked"),
        }
    }

    /// Evaluates `tokens` in windows of at most `window` tokens, each from an empty context, in
    /// mode `sp`, recording into `rec`; returns what was recorded and restores the mode.
    fn record_windows(
        &mut self,
        tokens: &[u32],
        window: usize,
        sp: Sparsity,
        rec: Calibration,
    ) -> Result<Calibration> {
        self.model.dense_ffn_only("calibration")?;
        if tokens.len() < 2 || window < 2 {
            return Err(Error::InvalidArgument(
                "calibration needs at least 2 tokens and a window of 2".into(),
            ));
        }
        let saved = std::mem::replace(&mut self.state.sparsity, sp);
        self.state.recorder = Some(Recorder::Calibration(rec));
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
        self.state.sparsity = saved;
        let rec = self.state.recorder.take();
        self.state.stats = FfnStats::default();
        match rec {
            Some(Recorder::Calibration(rec)) => result.map(|()| rec),
            _ => unreachable!("set above"),
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
            let mut vals: Vec<f32> =
                (0..20000).map(|_| (rng.next_f32() - 0.5) * 6.0 + shift).collect();
            vals.extend([0.0; 300]);
            let mut h = SignedHistogram::new();
            vals.iter().for_each(|&v| h.add(v));
            vals.sort_by(|a, b| a.total_cmp(b));
            for fraction in [0.0, 0.001, 0.01, 0.05, 0.3, 0.9] {
                let cut = h.lower_cut(fraction);
                let below = vals.iter().filter(|&&v| v < cut).count();
                assert!(
                    below as f64 <= fraction * vals.len() as f64,
                    "shift {shift} fraction {fraction}: {below} below {cut}"
                );
                // the exact quantile is not far above the cut
                let exact = vals[(fraction * vals.len() as f64).floor() as usize];
                let bin = 2f32.powf(1.0 / 64.0);
                let ok = if exact > 0.0 {
                    cut >= 0.0 && (cut == 0.0 && exact < 1e-3 || exact <= cut * bin * bin)
                } else {
                    cut <= exact && cut >= exact * bin * bin
                };
                assert!(
                    ok || exact == cut,
                    "shift {shift} fraction {fraction}: cut {cut}, exact quantile {exact}"
                );
            }
        }
    }
}
