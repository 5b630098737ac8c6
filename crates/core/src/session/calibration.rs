//! Calibration of the cut-offs: per-layer histograms of |act(gate)| (the neuron rule), of input
//! scores (input sparsity) and of predictor logits, recorded by a dense pass and read back as
//! quantiles.

use super::*;

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
            let i = ((a.log2() - MagnitudeHistogram::LOG2_MIN) * MagnitudeHistogram::PER_OCTAVE).max(0.0) as usize;
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
        let edge = |i: usize| ((i + 1) as f32 / MagnitudeHistogram::PER_OCTAVE + MagnitudeHistogram::LOG2_MIN).exp2();
        let below: f64 = self.energy.iter().enumerate().take_while(|&(i, _)| edge(i) <= cut).map(|(_, e)| e).sum();
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

/// Records the input scores |x_i| * |W[:, i]| of group `g` (rows of x) while calibrating input
/// sparsity.
pub(crate) fn record_scores(cal: &mut Option<Calibration>, l: usize, g: InputGroup, x: &[f32], model: &Model) {
    if let Some(Calibration::InputScores(hists)) = cal {
        let norms = model.input_norms(l, g);
        for row in x.chunks_exact(norms.len()) {
            row.iter().zip(norms).for_each(|(v, w)| hists[l][g as usize].add(v.abs() * w));
        }
    }
}
