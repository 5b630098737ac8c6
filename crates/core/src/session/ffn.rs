//! The CPU's FFN over the rows of one session: dense, or sparse over the neurons its sparsity
//! selects (`Sparsity`): one token through the fused sparse operator, several through the union
//! of their selections, or with input sparsity through the input-major copies. A session with a
//! recorder (`observe.rs`) takes the dense path, handing the recorder its values.

use super::{
    add_bias, batch_union_reads_dense, decodes_dense, down_t_matmul, matmul, matmul_many,
    matmul_selected, predicted_ffn, project, project_down, sparse_ffn, Activations, FfnActivation,
    FfnMats, FfnStats, InputGroup, LayerWeights, Model, PassState, QMatrix, Scratch, Sparsity,
    SparsityMode, DENSE_FRACTION, FUSED_PREDICTOR_FC1_BYTES,
};
use crate::matmul::indices_of_true;
use rayon::iter::IndexedParallelIterator;
use rayon::iter::ParallelIterator;
use rayon::prelude::ParallelSlice;
use rayon::prelude::ParallelSliceMut;

/// FFN block of layer `l` over n rows of one session (`st`): reads the normed input s.xb (n,
/// n_embd) and, for the predictor, the residual stream s.x; writes s.ffn_out (n, n_embd).
pub(crate) fn ffn_rows(model: &Model, st: &mut PassState, s: &mut Scratch, l: usize, n: usize) {
    if st.sparsity.is_inputs() {
        return ffn_inputs(model, st, s, l, n);
    }
    let lw = &model.weights.layers[l];
    let c = &model.config;
    let (dim, n_ff, act) = (c.n_embd, c.n_ff, c.ffn_activation);
    let sp = &st.sparsity;
    s.acts.set_for(&s.xb, n, dim, &[lw.ffn_gate.unwrap_or(lw.dense_up()), lw.dense_up()]);
    s.gate.resize(n * n_ff, 0.0);
    s.up.resize(n * n_ff, 0.0);
    let mode = sp.mode();

    // One token, dense, on a file whose down projection is neuron-major only (PowerInfer's
    // layout) with a ReLU gate: the gate through the dense kernels, then up and down only for
    // the neurons it leaves positive, exactly as dense. (The fused operator over every neuron,
    // gate dots included, was 1.21x slower on one thread and 1.13x on two decoding the
    // relufied SmolLM2 in Q4_0, 2-core AMD EPYC, alternating. With 80% or 50% of the neurons
    // selected by a predictor the dense gate was no faster in `cargo bench --bench sparse_ffn`:
    // 0.80-1.04x and 0.77-1.00x the selected-row dots' speed.)
    let exact_gate_skip = n == 1
        && matches!(sp, Sparsity::Dense)
        && lw.ffn_down.is_none()
        && lw.ffn_gate.is_some()
        && matches!(act, FfnActivation::ReGlu | FfnActivation::DReGlu)
        && st.recorder.is_none();

    // One token in predictor mode with a small predictor: its products inside the operator's
    // parallel pass (`predicted_ffn`), unless recall is measured (which needs every logit).
    if let (true, Some(p), Some(cutoff)) = (
        n == 1 && !sp.track_recall() && st.recorder.is_none(),
        lw.predictor.as_ref().filter(|p| p.fc1.data.len() <= FUSED_PREDICTOR_FC1_BYTES),
        sp.predictor_cutoff(l),
    ) {
        s.pred_acts.set_for(&s.x, 1, dim, &[p.fc1]);
        let mats = decode_mats(model, l, st.neuron_bundles);
        let (selected, _) = predicted_ffn(
            &mats,
            &p.fc1,
            &p.fc2,
            &s.pred_acts,
            &s.acts,
            cutoff,
            &mut s.ffn_out,
            &mut s.sparse,
        );
        let down_bytes = model.down_t(l).data.len();
        let gate_bytes = lw.ffn_gate.map_or(0, |g| g.data.len());
        st.stats.neurons += n_ff as u64;
        st.stats.skipped += (n_ff - selected) as u64;
        st.stats.weight_bytes += (gate_bytes + lw.dense_up().data.len() + down_bytes) as u64;
        st.stats.weight_bytes_read += (selected * mats.bundle_bytes()) as u64;
        add_bias(&mut s.ffn_out, lw.ffn_down_b.as_deref());
        return;
    }

    // which neurons each token keeps: s.keep (n, n_ff)
    let mut gate_ready = false; // s.gate holds gate pre-activations (up + bias when gateless)
    match sp {
        Sparsity::Dense if exact_gate_skip => {
            gate_values(lw, &s.acts, &mut s.gate);
            gate_ready = true;
            s.keep.clear();
            s.keep.extend(s.gate[..n_ff].iter().map(|&g| g > 0.0));
        }
        Sparsity::Dense => {}
        Sparsity::Predictor { .. } => {
            // predictor: logits (n, n_ff) = fc2 @ relu(fc1 @ x); keep where logits >= threshold
            let p = lw.predictor.as_ref().expect("checked by set_sparsity");
            s.pred_acts.set_for(&s.x, n, dim, &[p.fc1]);
            s.pred_hidden.resize(n * p.fc1.rows, 0.0);
            matmul(&p.fc1, &s.pred_acts, &mut s.pred_hidden);
            s.pred_hidden.iter_mut().for_each(|v| *v = v.max(0.0));
            s.pred_acts.set_for(&s.pred_hidden, n, p.fc1.rows, &[p.fc2]);
            s.pred_logits.resize(n * n_ff, 0.0);
            matmul(&p.fc2, &s.pred_acts, &mut s.pred_logits);
            let cutoff = sp.predictor_cutoff(l).expect("predictor mode");
            s.keep.clear();
            s.keep.extend(s.pred_logits.iter().map(|&v| Sparsity::predictor_selects(v, cutoff)));
        }
        Sparsity::GateThreshold { gate_cutoffs } => {
            // the gate (up for gateless FFNs) densely; keep where |act(gate)| > threshold
            gate_values(lw, &s.acts, &mut s.gate);
            gate_ready = true;
            let thr = gate_cutoffs[l];
            // act(gate) in s.up, free until the products below write it
            s.up[..n * n_ff].copy_from_slice(&s.gate[..n * n_ff]);
            act.gate_part_all(&mut s.up[..n * n_ff]);
            s.keep.clear();
            s.keep.extend(s.up[..n * n_ff].iter().map(|&g| g.abs() > thr));
        }
        Sparsity::Inputs { .. } => unreachable!("input sparsity takes ffn_inputs"),
    }
    let selected =
        if mode == SparsityMode::Dense { n * n_ff } else { s.keep.iter().filter(|&&k| k).count() };
    st.stats.neurons += (n * n_ff) as u64;
    st.stats.skipped += (n * n_ff - selected) as u64;
    // weight bytes: a sparse mode reads the selected neurons' gate rows (all of them when
    // the threshold needs the dense gate), up rows and neuron-major down rows (at most:
    // a ReLU gate at or below zero spares the up and down rows too)
    // (the neuron-major copy only where it is read: building it costs a pass over the weights
    // and memory a dense pass does not need)
    let down_bytes = lw.ffn_down.map_or_else(|| model.down_t(l).data.len(), |d| d.data.len());
    let gate_bytes = lw.ffn_gate.map_or(0, |g| g.data.len());
    let recording = st.recorder.is_some();
    // one token whose selection is dense enough runs as dense products (`decodes_dense`)
    let dense_decode = n == 1
        && mode != SparsityMode::Dense
        && !recording
        && decodes_dense(
            lw.ffn_down.is_some(),
            model.down_t(l).row_bytes(),
            st.neuron_bundles,
            n_ff,
            selected,
        );
    st.stats.weight_bytes += (n * (gate_bytes + lw.dense_up().data.len() + down_bytes)) as u64;
    st.stats.weight_bytes_read += match mode {
        _ if dense_decode => gate_bytes + lw.dense_up().data.len() + down_bytes,
        SparsityMode::Dense => n * (gate_bytes + lw.dense_up().data.len() + down_bytes),
        _ => {
            let gate_read = if gate_ready {
                n * gate_bytes
            } else {
                selected * lw.ffn_gate.map_or(0, |g| g.row_bytes())
            };
            gate_read + selected * (lw.dense_up().row_bytes() + model.down_t(l).row_bytes())
        }
    } as u64;
    let track_recall = sp.track_recall();

    if n == 1 && (mode != SparsityMode::Dense || lw.ffn_down.is_none()) && !recording {
        // decode: fused sparse operator over the selected neurons only
        s.neurons.clear();
        match mode {
            SparsityMode::Dense if !exact_gate_skip => s.neurons.extend(0..n_ff as u32),
            _ => indices_of_true(&s.keep[..n_ff], &mut s.neurons),
        }
        // (dense mode reads every gate row in order: apart, as stored)
        let mats = decode_mats(model, l, mode != SparsityMode::Dense && st.neuron_bundles);
        let precomputed = (gate_ready && act.has_gate()).then_some(&s.gate[..]);
        sparse_ffn(&mats, &s.acts, &s.neurons, precomputed, &mut s.ffn_out, &mut s.sparse);
        if track_recall {
            // the true activations, densely
            gate_and_up(lw, &s.acts, &mut s.gate, &mut s.up, false);
            activate(lw, act, &mut s.gate, &s.up);
            count_recall(&mut st.stats, &s.gate, &s.keep);
        }
        return add_bias(&mut s.ffn_out, lw.ffn_down_b.as_deref());
    }
    // batch, sparse: only the rows of the neurons some token selected, unless they are most
    // of the rows and the rows are short (`batch_union_reads_dense`)
    let sparse_batch = mode != SparsityMode::Dense
        && !recording
        && !track_recall
        && (selected as f64) < DENSE_FRACTION * (n * n_ff) as f64;
    if sparse_batch {
        union_of_selections(&s.keep, n, n_ff, &mut s.picked, &mut s.neurons);
    }
    let union_only = sparse_batch
        && !batch_union_reads_dense(model.down_t(l).row_bytes(), n_ff, s.neurons.len());
    if union_only {
        union_ffn(lw, act, &model.down_t(l), n, gate_ready, s);
    } else {
        // batch: gate and up densely, the activation, zero what was left out, then down.
        // (A dense pass over a ReLU-gated model with only the neuron-major down comes here too:
        // up only where the gate is positive, cell by cell, ran `sparse_e2e.py synthetic`'s
        // 128-token prompts at 1230-1250 tok/s against 1430-1500 on SmolLM2's shape, and at the
        // same speed on 7B's, 2-core AMD EPYC, 2 threads.)
        gate_and_up(lw, &s.acts, &mut s.gate, &mut s.up, gate_ready);
        if let Some(r) = &mut st.recorder {
            r.ffn_gate(model, l, &s.x[..n * dim], &s.xb[..n * dim], &s.gate);
        }
        activate(lw, act, &mut s.gate, &s.up);
        if let Some(r) = &mut st.recorder {
            r.ffn_activations(model, l, n, &s.gate, &s.pred_logits);
        }
        if track_recall {
            count_recall(&mut st.stats, &s.gate, &s.keep);
        }
        if mode != SparsityMode::Dense {
            // (a select, not a branch on the random selection: vectorized, no mispredictions)
            s.gate.iter_mut().zip(&s.keep).for_each(|(h, &k)| *h = if k { *h } else { 0.0 });
        }
        match &lw.ffn_down {
            Some(down) => {
                s.acts.set_for(&s.gate, n, n_ff, &[*down]);
                matmul(down, &s.acts, &mut s.ffn_out);
            }
            None => down_t_matmul(&model.down_t(l), &s.gate, n, &mut s.ffn_out, &mut s.sparse),
        }
    }
    add_bias(&mut s.ffn_out, lw.ffn_down_b.as_deref());
}

/// Layer `l`'s FFN as one token's sparse operator reads it, its rows from the neuron bundles
/// where `bundled`.
fn decode_mats(model: &Model, l: usize, bundled: bool) -> FfnMats<'_> {
    let lw = &model.weights.layers[l];
    FfnMats {
        gate: lw.ffn_gate,
        up: lw.dense_up(),
        up_bias: lw.ffn_up_b.as_deref(),
        down_t: model.down_t(l),
        down: lw.ffn_down,
        act: model.config.ffn_activation,
        bundles: bundled.then(|| model.neuron_bundles(l)),
    }
}

/// Threshold mode with input sparsity: the FFN of s.xb (n, n_embd) into s.ffn_out (n,
/// n_embd). Gate and up read only the inputs above the layer's `FfnIn` cut-off; down reads
/// only the activations above its `Down` cut-off (the neuron-major rows of `down_t`).
fn ffn_inputs(model: &Model, st: &mut PassState, s: &mut Scratch, l: usize, n: usize) {
    let lw = &model.weights.layers[l];
    let (dim, n_ff, act) = (model.config.n_embd, model.config.n_ff, model.config.ffn_activation);
    let sp = &st.sparsity;
    s.gate.resize(n * n_ff, 0.0);
    s.up.resize(n * n_ff, 0.0);

    // gate and up (n, n_ff) each; gateless FFNs: up + bias in s.gate
    let cut = sp.input_cut(l, InputGroup::FfnIn);
    let x = &s.xb[..n * dim];
    let outs: &mut [&mut [f32]] = match lw.ffn_gate {
        Some(_) => &mut [&mut s.gate, &mut s.up],
        None => &mut [&mut s.gate],
    };
    project(
        model,
        l,
        InputGroup::FfnIn,
        cut,
        x,
        n,
        &mut s.acts,
        &mut s.masked,
        &mut s.sparse,
        outs,
        &mut st.stats,
    );
    add_bias(if lw.ffn_gate.is_some() { &mut s.up } else { &mut s.gate }, lw.ffn_up_b.as_deref());
    // h = act(gate, up) (n, n_ff) in s.gate
    activate(lw, act, &mut s.gate, &s.up);

    // down (n, n_embd): only the neurons whose |h_j| * |down[:, j]| exceeds the cut-off
    let cut = sp.input_cut(l, InputGroup::Down);
    project_down(
        model,
        l,
        cut,
        &mut s.gate[..n * n_ff],
        n,
        &mut s.acts,
        &mut s.sparse,
        &mut s.ffn_out,
        &mut st.stats,
    );
    add_bias(&mut s.ffn_out, lw.ffn_down_b.as_deref());
}

/// The FFN of s.xb (n, n_embd) over the cells `keep` (n, n_ff) marks into s.ffn_out (n,
/// n_embd), without the down bias: row t computes neuron j iff keep[t * n_ff + j], with the
/// neuron-major `down_t`. What an executor that computes the other cells elsewhere leaves to
/// the CPU (the hybrid's cold neurons of a batch, see `CpuPass::ffn_of_cells`).
pub(crate) fn cells_ffn(
    model: &Model,
    l: usize,
    down_t: &QMatrix,
    keep: &[bool],
    n: usize,
    s: &mut Scratch,
) {
    let lw = &model.weights.layers[l];
    let (dim, n_ff) = (model.config.n_embd, model.config.n_ff);
    s.acts.set_for(&s.xb, n, dim, &[lw.ffn_gate.unwrap_or(lw.dense_up()), lw.dense_up()]);
    s.keep.clear();
    s.keep.extend_from_slice(&keep[..n * n_ff]);
    union_of_selections(&s.keep, n, n_ff, &mut s.picked, &mut s.neurons);
    union_ffn(lw, model.config.ffn_activation, down_t, n, false, s);
}

/// The union of a batch's selections, keep (n, n_ff), into `union` (sorted neuron indices,
/// through the mask `any`).
fn union_of_selections(
    keep: &[bool],
    n: usize,
    n_ff: usize,
    any: &mut Vec<bool>,
    union: &mut Vec<u32>,
) {
    union.clear();
    any.clear();
    any.resize(n_ff, false);
    for row in keep[..n * n_ff].chunks_exact(n_ff) {
        any.iter_mut().zip(row).for_each(|(a, &k)| *a |= k);
    }
    indices_of_true(any, union);
}

/// Sparse prefill: the FFN of a batch over the union of its tokens' selections (s.neurons).
/// Gate and up read those rows only, and compute each row's dots only for the tokens that
/// selected it (prefill is compute-bound: a batch's union is far wider than one token's
/// selection); the down projection reads the neuron-major rows of the
/// neurons some token kept. Each token gets what token-by-token sparse decode computes, up
/// to float summation order. Reads s.acts (n, n_embd) and, with `gate_ready`, the dense
/// gate values in s.gate; writes s.ffn_out (n, n_embd).
fn union_ffn(
    lw: &LayerWeights,
    act: FfnActivation,
    down_t: &QMatrix,
    n: usize,
    gate_ready: bool,
    s: &mut Scratch,
) {
    let n_ff = down_t.rows;
    let (sel, m) = (&s.neurons, s.neurons.len());
    // per selected row: gate values (n, m) (gateless: up + bias), up values (n, m)
    s.sel_gate.resize(n * m, 0.0);
    s.sel_up.resize(n * m, 0.0);
    // (only the cells of the tokens that selected the neuron)
    let keep = Some(&s.keep[..n * n_ff]);
    match (&lw.ffn_gate, gate_ready) {
        (Some(g), false) => matmul_selected(
            &[*g, lw.dense_up()],
            sel,
            keep,
            &s.acts,
            &mut [&mut s.sel_gate, &mut s.sel_up],
        ),
        (Some(_), true) => {
            matmul_selected(&[lw.dense_up()], sel, keep, &s.acts, &mut [&mut s.sel_up])
        }
        (None, false) => {
            matmul_selected(&[lw.dense_up()], sel, keep, &s.acts, &mut [&mut s.sel_gate])
        }
        (None, true) => {}
    }
    // h (n, n_ff) in s.up: act(gate, up) where the token selected the neuron, else 0. Token by
    // token in parallel: the selected rows' values in a row, the activation over all of them,
    // then each kept or not (no branch on the selection, which is random; the cells left out
    // hold stale, finite values).
    s.up.resize(n * n_ff, 0.0);
    s.up.fill(0.0);
    if m == 0 {
        return down_t_matmul(down_t, &s.up, n, &mut s.ffn_out, &mut s.sparse);
    }
    let (gated, up_bias) = (lw.ffn_gate.is_some(), lw.ffn_up_b.as_deref());
    let (gate, keep) = (&s.gate, &s.keep);
    s.up[..n * n_ff]
        .par_chunks_mut(n_ff)
        .zip(s.sel_gate.par_chunks_mut(m))
        .zip(s.sel_up.par_chunks_mut(m))
        .enumerate()
        .for_each(|(t, ((h, sel_gate), sel_up))| {
            // the values `apply_all` reads: gateless, sel_gate holds up, and sel_up is free
            let (g, u) = if gated { (sel_gate, sel_up) } else { (sel_up, sel_gate) };
            if gate_ready {
                // the dense gate (gateless: up + bias) computed before
                let dense = &gate[t * n_ff..(t + 1) * n_ff];
                let into = if gated { &mut *g } else { &mut *u };
                into.iter_mut().zip(sel).for_each(|(v, &j)| *v = dense[j as usize]);
            }
            if let Some(b) = up_bias.filter(|_| gated || !gate_ready) {
                u.iter_mut().zip(sel).for_each(|(v, &j)| *v += b[j as usize]);
            }
            act.apply_all(g, u);
            let keep = &keep[t * n_ff..(t + 1) * n_ff];
            for (&v, &j) in g.iter().zip(sel) {
                let j = j as usize;
                h[j] = if keep[j] { v } else { 0.0 };
            }
        });
    down_t_matmul(down_t, &s.up, n, &mut s.ffn_out, &mut s.sparse);
}

/// Gate pre-activations (n, n_ff); for gateless FFNs the up pre-activations plus bias.
fn gate_values(lw: &LayerWeights, x: &Activations, gate: &mut [f32]) {
    match &lw.ffn_gate {
        Some(g) => matmul(g, x, gate),
        None => {
            matmul(&lw.dense_up(), x, gate);
            add_bias(gate, lw.ffn_up_b.as_deref());
        }
    }
}

/// Gate and up pre-activations (n, n_ff) each, in one pass over both matrices; gateless
/// FFNs put up + bias in `gate` and leave `up` alone. With `gate_ready` the gate (or the
/// gateless up) is already in place and only up is computed.
fn gate_and_up(
    lw: &LayerWeights,
    x: &Activations,
    gate: &mut [f32],
    up: &mut [f32],
    gate_ready: bool,
) {
    match (&lw.ffn_gate, gate_ready) {
        (Some(g), false) => matmul_many(&[*g, lw.dense_up()], x, &mut [gate, &mut *up]),
        (Some(_), true) => matmul(&lw.dense_up(), x, up),
        (None, false) => gate_values(lw, x, gate),
        (None, true) => {}
    }
    if lw.ffn_gate.is_some() {
        add_bias(up, lw.ffn_up_b.as_deref());
    }
}

/// gate <- act(gate, up) in place (gateless: gate <- act(gate)).
fn activate(lw: &LayerWeights, act: FfnActivation, gate: &mut [f32], up: &[f32]) {
    if lw.ffn_gate.is_some() {
        gate.par_chunks_mut(4096).zip(up.par_chunks(4096)).for_each(|(g, u)| {
            act.apply_all(g, u);
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
