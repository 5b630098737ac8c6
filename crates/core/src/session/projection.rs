//! The layer's matrix products over one session's rows: q/k/v, the attention output, the
//! FFN's input products and its down projection. They read the row-major weights, or, where
//! input sparsity gives the group a cut-off, go through `input_sparsity`'s masked products.
//! Each counts the weight bytes a dense pass reads and the bytes it read. `time_input_sparsity`
//! measures whether skipping pays on this machine.

use super::input_sparsity::{down_masked, project_masked};
use super::{
    matmul, matmul_many, Activations, Error, FfnStats, InputGroup, Model, Result, SparseScratch,
};

/// outs[k] (n, rows of matrix k) = x (n, cols) @ W_k^T for the matrices of input group `group`
/// of layer `l` (not down, see `project_down`), which share the input x. With a cut-off for their `group`, a token's inputs whose score
/// |x_i| * |W[:, i]| is at or below it are skipped: the products read only the kept inputs'
/// rows of the input-major copies. Without one, every input, through the row-major kernels.
/// Counts the weight bytes per token a dense pass reads and the bytes read.
#[allow(clippy::too_many_arguments)]
pub(crate) fn project(
    model: &Model,
    l: usize,
    group: InputGroup,
    cut: Option<f32>,
    x: &[f32],
    n: usize,
    acts: &mut Activations,
    masked: &mut Vec<f32>,
    sparse: &mut SparseScratch,
    outs: &mut [&mut [f32]],
    stats: &mut FfnStats,
) {
    let lw = &model.weights.layers[l];
    let mats = group.matrices(lw);
    let mut row_major = [lw.wq; 3];
    for (k, m) in mats.iter().enumerate() {
        row_major[k] = m.of(lw).expect("the caller only names matrices the layer has");
    }
    let row_major = &row_major[..mats.len()];
    let dense_bytes: usize = row_major.iter().map(|m| m.data.len()).sum();
    stats.weight_bytes += (n * dense_bytes) as u64;
    match cut {
        None => {
            acts.set_for(x, n, x.len() / n, row_major);
            matmul_many(row_major, acts, outs);
            stats.weight_bytes_read += (n * dense_bytes) as u64;
        }
        Some(cut) => project_masked(model, l, group, cut, x, n, masked, sparse, outs, stats),
    }
}

/// out (n, n_embd) = h (n, n_ff) @ down^T for layer `l`. With a cut-off, the activations whose
/// |h_j| * |down[:, j]| is at or below it are zeroed in `h` and skipped: the product reads only
/// the kept neurons' rows of `down_t`. Without one, the row-major down matrix when the model
/// has it. Counts the neurons, the skipped ones and the weight bytes.
#[allow(clippy::too_many_arguments)]
pub(crate) fn project_down(
    model: &Model,
    l: usize,
    cut: Option<f32>,
    h: &mut [f32],
    n: usize,
    acts: &mut Activations,
    sparse: &mut SparseScratch,
    out: &mut [f32],
    stats: &mut FfnStats,
) {
    let lw = &model.weights.layers[l];
    let down_t = model.down_t(l);
    let n_ff = down_t.rows;
    let down_bytes = lw.ffn_down.map_or(down_t.data.len(), |d| d.data.len());
    stats.neurons += (n * n_ff) as u64;
    stats.weight_bytes += (n * down_bytes) as u64;
    match (cut, lw.ffn_down) {
        (None, Some(down)) => {
            acts.set(h, n, n_ff);
            matmul(&down, acts, out);
            stats.weight_bytes_read += (n * down_bytes) as u64;
        }
        (cut, _) => down_masked(model, l, cut, h, n, sparse, out, stats),
    }
}

/// Times one token's products of input group `g` of layer `l`, dense (row-major kernels) and
/// reading `1 - skip` of the inputs through the input-major copies, on a pseudo-random input
/// cut at its own `skip` quantile of scores: (dense seconds, sparse seconds, bytes dense,
/// bytes sparse) per product, the medians of `reps` alternating runs. Calibration uses it to
/// keep input sparsity off matrices where it is not faster on this machine.
pub fn time_input_sparsity(
    model: &Model,
    l: usize,
    g: InputGroup,
    skip: f64,
    reps: usize,
) -> Result<(f64, f64, u64, u64)> {
    let c = &model.config;
    if l >= c.n_layer || !(0.0..1.0).contains(&skip) || reps == 0 {
        return Err(Error::InvalidArgument(format!(
            "bad layer {l}, skip share {skip} or repetitions {reps}"
        )));
    }
    let lw = &model.weights.layers[l];
    let norms = model.input_norms(l, g);
    let n_in = norms.len();
    // a deterministic input with a spread of magnitudes
    let x: Vec<f32> = (0..n_in)
        .map(|i| ((i as f32 * 0.618_034).fract() - 0.5) * (1.0 + (i % 7) as f32))
        .collect();
    let mut scores: Vec<f32> = x.iter().zip(norms).map(|(v, w)| v.abs() * w).collect();
    scores.sort_by(f32::total_cmp);
    let k = ((skip * n_in as f64) as usize).min(n_in - 1);
    let cut = if k == 0 { None } else { Some(scores[k - 1]) };
    let outs_len: Vec<usize> = match g {
        InputGroup::Down => vec![c.n_embd],
        _ => g
            .matrices(lw)
            .iter()
            .map(|m| m.of(lw).expect("the group's matrices exist").rows)
            .collect(),
    };
    let mut bufs: Vec<Vec<f32>> = outs_len.iter().map(|&n| vec![0.0; n]).collect();
    let (mut acts, mut masked, mut sparse) =
        (Activations::default(), Vec::new(), SparseScratch::default());
    let mut run = |cut: Option<f32>, stats: &mut FfnStats| {
        let mut outs: Vec<&mut [f32]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
        match g {
            InputGroup::Down => {
                // the product masks its input in place: give it a copy
                masked.clear();
                masked.extend_from_slice(&x);
                project_down(model, l, cut, &mut masked, 1, &mut acts, &mut sparse, outs[0], stats);
            }
            _ => project(
                model,
                l,
                g,
                cut,
                &x,
                1,
                &mut acts,
                &mut masked,
                &mut sparse,
                &mut outs,
                stats,
            ),
        }
    };
    let (mut dense_t, mut sparse_t) = (Vec::with_capacity(reps), Vec::with_capacity(reps));
    let (mut dense_st, mut sparse_st) = (FfnStats::default(), FfnStats::default());
    model.install(|| {
        // the first runs build the copies, bring the weights in and count the bytes
        run(None, &mut dense_st);
        run(cut, &mut sparse_st);
        for _ in 0..reps {
            let t = std::time::Instant::now();
            run(None, &mut FfnStats::default());
            dense_t.push(t.elapsed().as_secs_f64());
            let t = std::time::Instant::now();
            run(cut, &mut FfnStats::default());
            sparse_t.push(t.elapsed().as_secs_f64());
        }
    });
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    Ok((
        median(&mut dense_t),
        median(&mut sparse_t),
        dense_st.weight_bytes_read,
        sparse_st.weight_bytes_read,
    ))
}
