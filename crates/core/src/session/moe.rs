//! The CPU's mixture-of-experts FFN over a pass's rows, in two steps as llama.cpp's
//! `build_moe_ffn` (softmax or sigmoid gating): `route_rows` picks each row's experts and their
//! weights, `expert_rows` runs them. The rows are grouped by expert, so a prompt (or a batch of
//! sessions) reads each chosen expert's weights once (llama.cpp's `mul_mat_id`), and a decode
//! token reads only its own experts' rows. Each row's result does not depend on which other
//! rows share its pass: its experts' contributions are added in expert order, and every
//! product is the one it would be alone.

use super::{
    matmul, matmul_many, matmul_selected, Activations, FfnActivation, FfnStats, Model, Result,
    Scratch,
};
use crate::matmul::{dot_rows, simd_level, weights_each, Weight};
use crate::model::{Gating, RouterInput};
use crate::sparse::dot_selected;
use rayon::iter::{IntoParallelIterator, ParallelIterator};

/// Layer `l`'s routing of n rows: router logits (n, n_expert) = xb @ router^T (+ its bias; or
/// x, the layer input, where the model routes on it), per row the probabilities (a softmax, or
/// each logit's sigmoid), the `n_used` most probable experts (the lower index first among
/// equals) with their probabilities as weights (divided by their sum where the model normalises
/// them, times its scale; gpt-oss: a softmax over the chosen logits), into s.routes
/// (n, n_used) as (expert, weight), most probable first.
pub(crate) fn route_rows(model: &Model, s: &mut Scratch, l: usize, n: usize) {
    let (c, lw) = (&model.config, &model.weights.layers[l]);
    let (cfg, mw) = (c.moe.expect("a mixture-of-experts model"), lw.moe.as_ref().expect("experts"));
    let (dim, n_expert) = (c.n_embd, cfg.n_expert);
    let input = match cfg.router_input {
        RouterInput::FfnInput => &s.xb[..n * dim],
        RouterInput::LayerInput => &s.x[..n * dim],
    };
    s.acts.set_for(input, n, dim, &[mw.router]);
    s.router_logits.resize(n * n_expert, 0.0);
    matmul(&mw.router, &s.acts, &mut s.router_logits);
    if let Some(b) = &mw.biases {
        add_to_rows(&mut s.router_logits[..n * n_expert], &b.router);
    }
    pick_routes(model, s, n);
}

/// `route_rows` from router logits already in s.router_logits (n, n_expert): another device's
/// product, or the CPU's own.
pub(crate) fn pick_routes(model: &Model, s: &mut Scratch, n: usize) {
    let cfg = model.config.moe.expect("a mixture-of-experts model");
    let n_expert = cfg.n_expert;
    s.routes.clear();
    let mut order: Vec<u32> = Vec::with_capacity(n_expert);
    for logits in s.router_logits[..n * n_expert].chunks_exact_mut(n_expert) {
        match cfg.gating {
            Gating::Softmax => {
                // as ggml's soft_max: exp(v - max) / sum
                let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                logits.iter_mut().for_each(|v| *v = (*v - max).exp());
                let sum: f32 = logits.iter().sum();
                logits.iter_mut().for_each(|v| *v /= sum);
            }
            Gating::Sigmoid => logits.iter_mut().for_each(|v| *v = 1.0 / (1.0 + (-*v).exp())),
            // the logits rank the experts as they are
            Gating::SoftmaxOfChosen => {}
        }
        // the n_used largest, most probable first (NaN, from a NaN logit, last)
        order.clear();
        order.extend(0..n_expert as u32);
        order.sort_by(|&a, &b| {
            let (pa, pb) = (logits[a as usize], logits[b as usize]);
            pb.partial_cmp(&pa).unwrap_or_else(|| pa.is_nan().cmp(&pb.is_nan())).then(a.cmp(&b))
        });
        let chosen = &order[..cfg.n_used];
        if cfg.gating == Gating::SoftmaxOfChosen {
            // as ggml's soft_max over the chosen logits (the first is their largest)
            let max = logits[chosen[0] as usize];
            chosen.iter().for_each(|&e| logits[e as usize] = (logits[e as usize] - max).exp());
            let sum: f32 = chosen.iter().map(|&e| logits[e as usize]).sum();
            chosen.iter().for_each(|&e| logits[e as usize] /= sum);
        }
        let total: f32 = chosen.iter().map(|&e| logits[e as usize]).sum();
        let norm = if cfg.normalize_weights { total } else { 1.0 };
        s.routes.extend(chosen.iter().map(|&e| (e, logits[e as usize] / norm * cfg.weights_scale)));
    }
}

/// ffn_out (n, n_embd) = for each row, the sum over its routed experts (s.routes) of
/// weight * down(act(gate(xb), up(xb))) (the model's activation), in expert order, plus the
/// shared expert's output times sigmoid(gate_inp . xb) where the layer has one. Every chosen
/// expert's products run in one parallel pass (gate and up, then down; a ReLU gate's up after
/// it), each over the rows routed to it. Counts neurons, the routed-away ones as skipped, and
/// the weight bytes each row reads (router, shared expert, its own experts, less the up rows a
/// ReLU gate zeroed) against those of running every expert.
///
/// The experts `elsewhere` marks (by index; empty: none), and with `shared_elsewhere` the shared
/// expert, are not computed here: `fill(slots, out, shared)` receives the (row, expert) of each
/// routed pair they serve, with its slot, and writes that expert's output for the row into row
/// `slot` of `out` (n * n_used, n_embd), and the shared expert's output (before its gate) for
/// every row into `shared` (n, n_embd) when it is elsewhere (another device's, as the hybrid
/// executor's), before the rows' sums.
pub(crate) fn expert_rows(
    model: &Model,
    s: &mut Scratch,
    stats: &mut FfnStats,
    l: usize,
    n: usize,
    elsewhere: &[bool],
    shared_elsewhere: bool,
    fill: impl FnOnce(&[ExpertSlot], &mut [f32], Option<&mut [f32]>) -> Result<()>,
) -> Result<()> {
    let (c, lw) = (&model.config, &model.weights.layers[l]);
    let (cfg, mw) = (c.moe.expect("a mixture-of-experts model"), lw.moe.as_ref().expect("experts"));
    let (dim, ff, k) = (c.n_embd, cfg.n_ff_exp, cfg.n_used);
    let total = n * k;

    // the rows routed to each expert (ascending), expert by expert: expert e's are
    // s.expert_rows[s.expert_start[e]..s.expert_start[e + 1]], as (row, weight)
    let start = &mut s.expert_start;
    start.clear();
    start.resize(cfg.n_expert + 1, 0);
    s.routes[..total].iter().for_each(|&(e, _)| start[e as usize + 1] += 1);
    (0..cfg.n_expert).for_each(|e| start[e + 1] += start[e]);
    s.expert_fill.clear();
    s.expert_fill.extend_from_slice(&start[..cfg.n_expert]);
    s.expert_rows.resize(total, (0, 0.0));
    for (i, &(e, w)) in s.routes[..total].iter().enumerate() {
        let slot = &mut s.expert_fill[e as usize];
        s.expert_rows[*slot] = ((i / k) as u32, w);
        *slot += 1;
    }
    let here = |e: usize| !elsewhere.get(e).copied().unwrap_or(false);
    let chosen: Vec<usize> =
        (0..cfg.n_expert).filter(|&e| start[e + 1] > start[e] && here(e)).collect();
    let rows_of = |e: usize| start[e]..start[e + 1];

    // nothing to compute here when every routed expert runs elsewhere (the hybrid executor's
    // common case: its hot experts hold most routings)
    let mut up_rows_skipped = 0u64;
    s.expert_out.resize(total * dim, 0.0);
    if !chosen.is_empty() {
        // each chosen expert's input rows, from xb quantized once
        s.acts.set_for(&s.xb[..n * dim], n, dim, &[mw.gate_exps, mw.up_exps]);
        s.expert_acts.resize_with(chosen.len(), Default::default);
        for (a, &e) in chosen.iter().enumerate() {
            let rows = s.expert_rows[rows_of(e)].iter().map(|&(t, _)| t as usize);
            s.expert_acts[a].gather_rows(&s.acts, rows);
        }
        // gate and up (total, n_ff_exp) each, expert by expert; h = act(gate, up). A ReLU gate
        // decides alone: up is read only for the neurons some routed row's gate made positive, and
        // computed only for those rows (exact: the others' h is zero whatever up is), as the dense
        // FFN skips them; the values computed are the dense product's, bit for bit.
        // (a gate bias moves the gate after its product: biased experts take the dense path)
        let gate_decides = mw.biases.is_none()
            && matches!(c.ffn_activation, FfnActivation::ReGlu | FfnActivation::DReGlu);
        s.gate.resize(total * ff, 0.0);
        s.up.resize(total * ff, 0.0);
        let experts: Vec<_> = chosen.iter().map(|&e| mw.expert(e)).collect();
        // a decode step (one row per expert) with a ReLU gate: one parallel pass, below
        let one_row_each = chosen.iter().all(|&e| rows_of(e).len() == 1);
        if !(gate_decides && one_row_each) {
            // (interleaved where `Model::load` built that layout: never for a deciding gate)
            let mats: Vec<Weight> = match gate_decides {
                false => chosen
                    .iter()
                    .flat_map(|&e| {
                        let [gate, up, _] = mw.expert_for_cpu(e);
                        [gate, up]
                    })
                    .collect(),
                true => experts.iter().map(|ex| Weight::File(ex.gate)).collect(),
            };
            let per_expert = if gate_decides { 1 } else { 2 };
            let xs: Vec<&Activations> =
                s.expert_acts.iter().flat_map(|a| [a, a].into_iter().take(per_expert)).collect();
            let gates = chosen_blocks(&mut s.gate[..total * ff], start, &chosen, ff);
            let mut outs: Vec<&mut [f32]> = match gate_decides {
                true => gates,
                false => {
                    let ups = chosen_blocks(&mut s.up[..total * ff], start, &chosen, ff);
                    gates.into_iter().zip(ups).flat_map(|(g, u)| [g, u]).collect()
                }
            };
            weights_each(&mats, &xs, &mut outs);
        }
        if let Some(b) = &mw.biases {
            // each routed row's gate and up, plus its expert's biases
            for &e in &chosen {
                let (bg, bu) = (&b.gate[e * ff..(e + 1) * ff], &b.up[e * ff..(e + 1) * ff]);
                let rows = start[e] * ff..start[e + 1] * ff;
                add_to_rows(&mut s.gate[rows.clone()], bg);
                add_to_rows(&mut s.up[rows], bu);
            }
        }
        if gate_decides && one_row_each {
            // per chosen expert and span of its neurons: the gate rows, then the up rows of the
            // neurons whose gate is positive, as the sparse FFN operator orders them (one fork and
            // join for the layer; the values are the dense products', bit for bit)
            const SPAN: usize = 128;
            let mut work: Vec<(usize, usize, &mut [f32], &mut [f32])> = Vec::new();
            let gates = chosen_blocks(&mut s.gate[..total * ff], start, &chosen, ff);
            let ups = chosen_blocks(&mut s.up[..total * ff], start, &chosen, ff);
            for (a, (g, u)) in gates.into_iter().zip(ups).enumerate() {
                for (k, (g, u)) in g.chunks_mut(SPAN).zip(u.chunks_mut(SPAN)).enumerate() {
                    work.push((a, k * SPAN, g, u));
                }
            }
            let (acts, level) = (&s.expert_acts, simd_level());
            up_rows_skipped = work
                .into_par_iter()
                .map(|(a, j0, g, u)| {
                    let ex = &experts[a];
                    dot_rows(&ex.gate, j0..j0 + g.len(), &acts[a], [0], level, |j, [v]| {
                        g[j - j0] = v
                    });
                    let mut sel = [0u32; SPAN];
                    let mut n_sel = 0;
                    for (i, &v) in g.iter().enumerate() {
                        if v > 0.0 {
                            sel[n_sel] = (j0 + i) as u32;
                            n_sel += 1;
                        }
                    }
                    let mut picked = [0.0f32; SPAN];
                    dot_selected(&ex.up, &sel[..n_sel], &acts[a], level, &mut picked[..n_sel], &[]);
                    u.fill(0.0);
                    for (&j, &v) in sel[..n_sel].iter().zip(&picked) {
                        u[j as usize - j0] = v;
                    }
                    (g.len() - n_sel) as u64
                })
                .sum();
        } else if gate_decides {
            // per chosen expert (its index in `chosen`): its rows of gate and of up
            let gates = chosen_blocks(&mut s.gate[..total * ff], start, &chosen, ff);
            let ups = chosen_blocks(&mut s.up[..total * ff], start, &chosen, ff);
            let work: Vec<(usize, (&mut [f32], &mut [f32]))> =
                gates.into_iter().zip(ups).enumerate().collect();
            let acts = &s.expert_acts;
            up_rows_skipped = work
                .into_par_iter()
                .map(|(a, (g, u))| {
                    let keep: Vec<bool> = g.iter().map(|&v| v > 0.0).collect();
                    let mut any = vec![false; ff];
                    keep.chunks_exact(ff).for_each(|row| {
                        any.iter_mut().zip(row).for_each(|(a, &k)| *a |= k);
                    });
                    let sel: Vec<u32> = (0..ff as u32).filter(|&j| any[j as usize]).collect();
                    let rows = acts[a].n;
                    let mut picked = vec![0.0f32; rows * sel.len()];
                    match rows {
                        // one row (decode): its selected rows here, on this expert's thread
                        1 => dot_selected(
                            &experts[a].up,
                            &sel,
                            &acts[a],
                            simd_level(),
                            &mut picked,
                            &[],
                        ),
                        _ => matmul_selected(
                            &[experts[a].up],
                            &sel,
                            Some(&keep),
                            &acts[a],
                            &mut [&mut picked],
                        ),
                    }
                    u.fill(0.0);
                    for t in 0..rows {
                        for (k, &j) in sel.iter().enumerate() {
                            if keep[t * ff + j as usize] {
                                u[t * ff + j as usize] = picked[t * sel.len() + k];
                            }
                        }
                    }
                    keep.iter().filter(|&&k| !k).count() as u64
                })
                .sum();
        }
        // the activation over the chosen experts' rows only (the others' come from elsewhere)
        let gates = chosen_blocks(&mut s.gate[..total * ff], start, &chosen, ff);
        let ups = chosen_blocks(&mut s.up[..total * ff], start, &chosen, ff);
        let pieces: Vec<(&mut [f32], &mut [f32])> = gates
            .into_iter()
            .zip(ups)
            .flat_map(|(g, u)| g.chunks_mut(4096).zip(u.chunks_mut(4096)))
            .collect();
        pieces.into_par_iter().for_each(|(g, u)| c.ffn_activation.apply_all(g, u));
        // down (total, n_embd), each expert over its rows of h (quantized once)
        s.h_acts.set_for(&s.gate[..total * ff], total, ff, &[mw.down_exps]);
        s.down_acts.resize_with(chosen.len(), Default::default);
        for (a, &e) in chosen.iter().enumerate() {
            s.down_acts[a].gather_rows(&s.h_acts, rows_of(e));
        }
        {
            let mats: Vec<Weight> = chosen.iter().map(|&e| mw.expert_for_cpu(e)[2]).collect();
            let xs: Vec<&Activations> = s.down_acts.iter().collect();
            let mut outs = chosen_blocks(&mut s.expert_out[..total * dim], start, &chosen, dim);
            weights_each(&mats, &xs, &mut outs);
        }
        if let Some(b) = &mw.biases {
            for &e in &chosen {
                let rows = start[e] * dim..start[e + 1] * dim;
                add_to_rows(&mut s.expert_out[rows], &b.down[e * dim..(e + 1) * dim]);
            }
        }
    }
    // the other experts' outputs, from where they ran
    let away: Vec<ExpertSlot> = (0..cfg.n_expert)
        .filter(|&e| !here(e))
        .flat_map(|e| rows_of(e).map(move |slot| (e, slot)))
        .map(|(e, slot)| ExpertSlot { row: s.expert_rows[slot].0 as usize, expert: e, slot })
        .collect();
    let shared_elsewhere = shared_elsewhere && mw.shared.is_some();
    s.shared_out.resize(n * dim, 0.0);
    if !away.is_empty() || shared_elsewhere {
        let shared = shared_elsewhere.then_some(&mut s.shared_out[..n * dim]);
        fill(&away, &mut s.expert_out[..total * dim], shared)?;
    }
    // each row's sum, its experts in expert order
    let ffn_out = &mut s.ffn_out[..n * dim];
    ffn_out.fill(0.0);
    for (i, &(t, w)) in s.expert_rows[..total].iter().enumerate() {
        let t = t as usize;
        let (out, y) = (&mut ffn_out[t * dim..(t + 1) * dim], &s.expert_out[i * dim..]);
        out.iter_mut().zip(y).for_each(|(o, y)| *o += w * y);
    }
    let mut shared_bytes = 0;
    if let Some(sh) = &mw.shared {
        // the shared expert over every row, scaled by sigmoid(gate_inp . xb)
        let n_sh = sh.gate.rows;
        shared_bytes = sh.gate.data.len() + sh.up.data.len() + sh.down.data.len();
        if !shared_elsewhere {
            s.acts.set_for(&s.xb[..n * dim], n, dim, &[sh.gate, sh.up]);
            s.gate.resize(n * n_sh, 0.0);
            s.up.resize(n * n_sh, 0.0);
            matmul_many(
                &[sh.gate, sh.up],
                &s.acts,
                &mut [&mut s.gate[..n * n_sh], &mut s.up[..n * n_sh]],
            );
            FfnActivation::SwiGlu.apply_all(&mut s.gate[..n * n_sh], &s.up[..n * n_sh]);
            s.acts.set_for(&s.gate[..n * n_sh], n, n_sh, &[sh.down]);
            matmul(&sh.down, &s.acts, &mut s.shared_out[..n * dim]);
        }
        for t in 0..n {
            let x = &s.xb[t * dim..(t + 1) * dim];
            let g: f32 = x.iter().zip(&sh.gate_inp).map(|(x, g)| x * g).sum();
            let scale = 1.0 / (1.0 + (-g).exp());
            let (out, y) = (&mut s.ffn_out[t * dim..(t + 1) * dim], &s.shared_out[t * dim..]);
            out.iter_mut().zip(y).for_each(|(o, y)| *o += scale * y);
        }
    }
    let (n64, e64, k64) = (n as u64, cfg.n_expert as u64, k as u64);
    let expert_bytes =
        (mw.gate_exps.data.len() + mw.up_exps.data.len() + mw.down_exps.data.len()) as u64 / e64;
    let always = (mw.router.data.len() + shared_bytes) as u64;
    stats.neurons += n64 * e64 * ff as u64;
    stats.skipped += n64 * (e64 - k64) * ff as u64;
    stats.weight_bytes += n64 * (always + e64 * expert_bytes);
    stats.weight_bytes_read += n64 * (always + k64 * expert_bytes);
    // the up rows of neurons a ReLU gate zeroed, per routed row (as each row alone reads them)
    let up_row_bytes = mw.up_exps.data.len() as u64 / (e64 * ff as u64);
    stats.weight_bytes_read -= up_rows_skipped * up_row_bytes;
    Ok(())
}

/// rows (k, bias.len()) += bias, row by row.
fn add_to_rows(rows: &mut [f32], bias: &[f32]) {
    for row in rows.chunks_exact_mut(bias.len()) {
        row.iter_mut().zip(bias).for_each(|(r, b)| *r += b);
    }
}

/// `buf` (rows routed to the experts, expert by expert; `width` values each) cut into the blocks
/// of the chosen experts' rows (`start`: where each expert's rows begin), in `chosen`'s order;
/// the other experts' rows are left out.
fn chosen_blocks<'a>(
    mut buf: &'a mut [f32],
    start: &[usize],
    chosen: &[usize],
    width: usize,
) -> Vec<&'a mut [f32]> {
    let mut blocks = Vec::with_capacity(chosen.len());
    let mut at = 0;
    for &e in chosen {
        let (from, to) = (start[e] * width, start[e + 1] * width);
        let (_, rest) = std::mem::take(&mut buf).split_at_mut(from - at);
        let (block, rest) = rest.split_at_mut(to - from);
        blocks.push(block);
        (buf, at) = (rest, to);
    }
    blocks
}

/// A routed (row, expert) pair that another device computes, and the slot its output goes to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertSlot {
    pub row: usize,
    pub expert: usize,
    pub slot: usize,
}
