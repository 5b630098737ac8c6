//! One FFN block of 7B shape (n_embd 4096, n_ff 11008, ReGLU) for one token: the neuron-aware
//! sparse operator at 0/50/80/90/95% sparsity against the dense block (gate and up products,
//! activation, down product), both in the same run, alternating, on a 2-thread pool
//! (`POWERINFER_BENCH_THREADS` overrides). Prints the median time of each and their ratio.
//!
//!     cargo bench -p powerinfer-core --bench sparse_ffn
//!
//! The weights are drawn so that every gate is positive: the only sparsity is the selection the
//! operator is given, so "0%" really computes every neuron.

use std::time::Instant;

use powerinfer_core::matmul::{matmul, matmul_many, Activations, QMatrix};
use powerinfer_core::model::FfnActivation;
use powerinfer_core::quant::{quantize_row, DType};
use powerinfer_core::sampler::Rng;
use powerinfer_core::sparse::{sparse_ffn, FfnMats, SparseScratch};

const N_EMBD: usize = 4096;
const N_FF: usize = 11008;

fn matrix(dtype: DType, rows: usize, cols: usize, seed: u64, positive: bool) -> Vec<u8> {
    let mut rng = Rng::new(seed);
    let mut row = vec![0.0f32; cols];
    let mut out = Vec::with_capacity(dtype.row_bytes(cols) * rows);
    for _ in 0..rows {
        for v in row.iter_mut() {
            let u = rng.next_f32();
            *v = if positive { u * 0.02 } else { (u * 2.0 - 1.0) * 0.02 };
        }
        out.extend(quantize_row(dtype, &row));
    }
    out
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn main() {
    let threads: usize = std::env::var("POWERINFER_BENCH_THREADS").ok().and_then(|v| v.parse().ok()).unwrap_or(2);
    let rounds: usize = std::env::var("POWERINFER_BENCH_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(15);
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
    println!("FFN block 4096 x 11008 (ReGLU), one token, {threads} threads, median of {rounds} alternating runs");
    println!("{:<6} {:>9} {:>10} {:>10} {:>8}", "type", "sparsity", "dense ms", "sparse ms", "speedup");
    for dtype in [DType::Q4_0, DType::F16] {
        let gate_d = matrix(dtype, N_FF, N_EMBD, 1, true);
        let up_d = matrix(dtype, N_FF, N_EMBD, 2, false);
        let down_d = matrix(dtype, N_EMBD, N_FF, 3, false); // (n_embd, n_ff), the dense layout
        let down_t_d = matrix(dtype, N_FF, N_EMBD, 4, false); // (n_ff, n_embd), neuron-major
        let gate = QMatrix { dtype, rows: N_FF, cols: N_EMBD, data: &gate_d };
        let up = QMatrix { dtype, rows: N_FF, cols: N_EMBD, data: &up_d };
        let down = QMatrix { dtype, rows: N_EMBD, cols: N_FF, data: &down_d };
        let down_t = QMatrix { dtype, rows: N_FF, cols: N_EMBD, data: &down_t_d };
        let mats = FfnMats { gate: Some(gate), up, up_bias: None, down_t, act: FfnActivation::ReGlu };

        let mut rng = Rng::new(5);
        let x_f: Vec<f32> = (0..N_EMBD).map(|_| rng.next_f32()).collect();
        let (mut x, mut hx) = (Activations::default(), Activations::default());
        let (mut g, mut u) = (vec![0.0f32; N_FF], vec![0.0f32; N_FF]);
        let mut out = vec![0.0f32; N_EMBD];
        let mut scratch = SparseScratch::default();

        let mut dense = || {
            x.set(&x_f, 1, N_EMBD);
            matmul_many(&[gate, up], &x, &mut [&mut g, &mut u]);
            g.iter_mut().zip(&u).for_each(|(gi, ui)| *gi = FfnActivation::ReGlu.apply(*gi, *ui));
            hx.set(&g, 1, N_FF);
            matmul(&down, &hx, &mut out);
        };
        let mut sx = Activations::default();
        let mut sout = vec![0.0f32; N_EMBD];
        for sparsity in [0.0, 0.5, 0.8, 0.9, 0.95] {
            let keep = ((1.0 - sparsity) * N_FF as f64).round() as usize;
            // a random subset of `keep` neurons, sorted
            let mut idx: Vec<u32> = (0..N_FF as u32).collect();
            let mut r = Rng::new(9);
            for i in 0..keep {
                let j = i + (r.next_f32() * (N_FF - i) as f32) as usize % (N_FF - i);
                idx.swap(i, j);
            }
            let mut neurons = idx[..keep].to_vec();
            neurons.sort_unstable();
            let mut sparse = || {
                sx.set(&x_f, 1, N_EMBD);
                sparse_ffn(&mats, &sx, &neurons, None, &mut sout, &mut scratch);
            };
            let (mut td, mut ts) = (Vec::new(), Vec::new());
            pool.install(|| {
                dense();
                sparse();
                for _ in 0..rounds {
                    let t = Instant::now();
                    dense();
                    td.push(t.elapsed().as_secs_f64() * 1e3);
                    let t = Instant::now();
                    sparse();
                    ts.push(t.elapsed().as_secs_f64() * 1e3);
                }
            });
            let (d, s) = (median(&mut td), median(&mut ts));
            println!("{:<6} {:>8.0}% {:>10.2} {:>10.2} {:>7.2}x", dtype.name(), sparsity * 100.0, d, s, d / s);
        }
    }
}
