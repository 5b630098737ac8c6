//! Observers of the forward pass: calibration (`Calibration`) and the profiler's capture
//! (`Capture`) record the values a dense pass computes. The pass hands a session's recorder its
//! values at three points (the input of a projection group, the FFN's gate before the
//! activation, the activations after it); recorders never change what the pass computes. A
//! session with a recorder runs its FFNs densely, so that every neuron's value exists.

use super::{Calibration, Capture, FfnActivation, InputGroup, Model};

/// What watches a session's pass.
pub(crate) enum Recorder {
    Calibration(Calibration),
    Capture(Capture),
}

/// ReLU-family activations are exactly zero where a neuron does not fire.
fn fires_exactly(act: FfnActivation) -> bool {
    matches!(act, FfnActivation::ReGlu | FfnActivation::DReGlu | FfnActivation::Relu)
}

impl Recorder {
    /// The input rows x (n, inputs) of layer l's projection group g.
    pub(crate) fn projection_input(&mut self, model: &Model, l: usize, g: InputGroup, x: &[f32]) {
        if let Recorder::Calibration(Calibration::InputScores(hists)) = self {
            // the input scores |x_i| * |W[:, i]|
            let norms = model.input_norms(l, g);
            for row in x.chunks_exact(norms.len()) {
                row.iter().zip(norms).for_each(|(v, w)| hists[l][g as usize].add(v.abs() * w));
            }
        }
    }

    /// Layer l's FFN before the activation: the residual x and the normed input xb (n,
    /// n_embd), the gate pre-activations (n, n_ff) (gateless FFNs: up + bias).
    pub(crate) fn ffn_gate(
        &mut self,
        model: &Model,
        l: usize,
        x: &[f32],
        xb: &[f32],
        gate: &[f32],
    ) {
        let act = model.config.ffn_activation;
        self.projection_input(model, l, InputGroup::FfnIn, xb);
        match self {
            Recorder::Calibration(Calibration::GateMagnitudes(hists)) => {
                gate.iter().for_each(|&g| hists[l].add(act.gate_part(g)))
            }
            Recorder::Capture(cap) => {
                cap.inputs[l].extend_from_slice(x);
                if !fires_exactly(act) {
                    cap.scores[l].extend(gate.iter().map(|&g| act.gate_part(g).abs()));
                }
            }
            _ => {}
        }
    }

    /// Layer l's FFN after the activation, for n rows: the activations h (n, n_ff) and the
    /// predictor logits (n, n_ff) when a predictor ran.
    pub(crate) fn ffn_activations(
        &mut self,
        model: &Model,
        l: usize,
        n: usize,
        h: &[f32],
        pred_logits: &[f32],
    ) {
        let c = &model.config;
        self.projection_input(model, l, InputGroup::Down, h);
        match self {
            Recorder::Calibration(Calibration::ActiveLogits(hists)) => {
                // the logits of the neurons that truly fired (every neuron is selected while
                // calibrating, so none was zeroed)
                h.iter()
                    .zip(pred_logits)
                    .filter(|(&h, _)| h != 0.0)
                    .for_each(|(_, &z)| hists[l].add(z));
            }
            Recorder::Capture(cap) => {
                if fires_exactly(c.ffn_activation) {
                    cap.scores[l].extend(h.iter().map(|h| h.abs()));
                }
                if l + 1 == c.n_layer {
                    cap.n_tokens += n;
                }
            }
            _ => {}
        }
    }
}
