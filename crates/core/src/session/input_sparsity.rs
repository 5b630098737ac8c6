//! Input sparsity: the layer's matrix products that skip the inputs whose score falls under a
//! cut-off, through input-major copies (`projection` chooses them, and times them against the
//! dense products).

use super::{down_t_matmul, mask_below, FfnStats, InputGroup, Model, SparseScratch};

/// The masked products of `projection::project` with a cut-off: each token's inputs whose
/// score |x_i| * |W[:, i]| is at or below `cut` are zeroed (in a copy, `masked`) and skipped, and
/// the products read only the kept inputs' rows of the group's input-major copies.
pub(crate) fn project_masked(
    model: &Model,
    l: usize,
    group: InputGroup,
    cut: f32,
    x: &[f32],
    n: usize,
    masked: &mut Vec<f32>,
    sparse: &mut SparseScratch,
    outs: &mut [&mut [f32]],
    stats: &mut FfnStats,
) {
    let mats = group.matrices(&model.weights.layers[l]);
    masked.clear();
    masked.extend_from_slice(x);
    let kept = mask_below(masked, model.input_norms(l, group), cut);
    for (m, out) in mats.iter().zip(outs.iter_mut()) {
        let copy = model.input_major(l, *m).expect("the caller only names matrices the layer has");
        stats.weight_bytes_read += (kept * copy.row_bytes()) as u64;
        down_t_matmul(&copy, masked, n, out, sparse);
    }
}

/// The down projection through the neuron-major `down_t` (n rows of `h`): with a cut-off, the
/// activations whose |h_j| * |down[:, j]| is at or below it are zeroed in `h` and skipped, so
/// the product reads only the kept neurons' rows. Counts the skipped neurons and the bytes read.
pub(crate) fn down_masked(
    model: &Model,
    l: usize,
    cut: Option<f32>,
    h: &mut [f32],
    n: usize,
    sparse: &mut SparseScratch,
    out: &mut [f32],
    stats: &mut FfnStats,
) {
    let down_t = model.down_t(l);
    let n_ff = down_t.rows;
    let kept =
        cut.map_or(n * n_ff, |cut| mask_below(h, model.input_norms(l, InputGroup::Down), cut));
    stats.skipped += (n * n_ff - kept) as u64;
    stats.weight_bytes_read += (kept * down_t.row_bytes()) as u64;
    down_t_matmul(&down_t, h, n, out, sparse);
}
