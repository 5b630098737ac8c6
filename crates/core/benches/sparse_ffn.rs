//! One FFN block (ReGLU) for one token, of 7B shape (n_embd 4096, n_ff 11008) and of SmolLM2's
//! (576, 1536), where the fixed costs of selection and fork/join weigh as much as the rows: the neuron-aware
//! sparse operator at 0/50/80/90/95% sparsity against the dense block (gate and up products,
//! activation, down product), both in the same run, alternating, for Q4_0, Q8_0 and F16 on 1
//! and 2 threads. Prints the median time of each, their ratio, the ideal ratio 1/(1-s), and the
//! GB/s of weight bytes each side actually read, beside a plain streaming read of the same bytes
//! on the same threads (the hardware limit the dense kernels can reach) and a plain read of just
//! the selected rows, each with the next prefetched into L2 (the limit for the sparse operator).
//! The operator is given the row-major down matrix too, as for models that have one, so selections
//! dense enough for the dense kernels (`sparse::decodes_dense`: the 0% row, and SmolLM2-shape
//! selections of at least 40%, or 60% with bundled rows on several threads) run through them.
//!
//!     cargo bench -p powerinfer-core --bench sparse_ffn
//!
//! Decoding a real model reads every layer once per token, so each FFN block comes from DRAM,
//! not from cache. Server CPUs have last-level caches of hundreds of MiB (a 7B Q4_0 FFN block
//! is 76 MB), so one block timed over and over would be measured in cache. Each timed round
//! therefore runs over enough copies of the block (at different addresses) to exceed
//! `POWERINFER_BENCH_FOOTPRINT` bytes (default 1 GiB), like a decode over that many layers.
//!
//! The blocks live in anonymous maps advised for huge pages, as the engine holds weights
//! (`gguf::advise_huge_pages` on the model file's map, `gguf::weight_buffer` for built copies):
//! the sparse operator reads scattered rows, and on 4 KiB pages nearly every row is a TLB miss.
//!
//! The weights are drawn so that every gate is positive: the only sparsity is the selection the
//! operator is given, so "0%" really computes every neuron.
//!
//! Each sparsity has two sparse rows, timed in the same alternating rounds: "apart" reads the
//! selected neurons' rows from the three matrices, "bundle" from a copy holding each neuron's
//! gate, up and down_t rows side by side (`matmul::interleave_rows`, what the engine builds
//! as `Model::neuron_bundles`); each with its own scatter bound (a plain read of the same rows,
//! laid out the same way).
//!
//! With `--features phase-timers`, each sparse row pair is followed by the shares of the
//! operators' time in their three passes (gate dots, up dots, down axpys), summed over threads
//! and both layouts.
//!
//! With `POWERINFER_BENCH_SELECTION=ranked` a selection is drawn with weights 1 / (j + 1) for
//! neuron j, as when power-law neurons are stored hottest first: the measure of what storing
//! neurons in order of profiled frequency would buy (the rows a selection reads lie in runs).
//!
//! Environment: `POWERINFER_BENCH_SHAPES` (e.g. "4096x11008,576x1536", n_embd x n_ff),
//! `POWERINFER_BENCH_THREADS` (e.g. "2" or "1,2"), `POWERINFER_BENCH_ROUNDS`,
//! `POWERINFER_BENCH_TYPES` (e.g. "Q4_0,F16"; also Q4_1, Q4_K, F32, BF16),
//! `POWERINFER_BENCH_FOOTPRINT` (bytes), `POWERINFER_BENCH_SPARSITIES` (e.g. "0.9,0.95").

use std::time::Instant;

use memmap2::MmapMut;
use rayon::prelude::*;

use powerinfer_core::gguf::weight_buffer;
use powerinfer_core::matmul::{interleave_rows, matmul, matmul_many, Activations, QMatrix};
use powerinfer_core::model::FfnActivation;
use powerinfer_core::quant::{quantize_row, DType};
use powerinfer_core::sampler::Rng;
use powerinfer_core::sparse::{sparse_ffn, FfnMats, SparseScratch};

/// (n_embd, n_ff): LLaMA-7B's FFN block and SmolLM2-135M's.
const SHAPES: [(usize, usize); 2] = [(4096, 11008), (576, 1536)];
const SPARSITIES: [f64; 5] = [0.0, 0.5, 0.8, 0.9, 0.95];

fn matrix(dtype: DType, rows: usize, cols: usize, seed: u64, positive: bool) -> Vec<u8> {
    if dtype == DType::Q4_K {
        return random_q4_k(rows, cols, seed);
    }
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

/// Q4_K rows (the engine writes no k-quant; llama.cpp's quantizer makes the files): random
/// 6-bit scales and 4-bit quants with d = 2^-9 and no minimum (dmin = 0), so that no weight is
/// negative and, with the bench's positive input, every gate is positive. A block: d and dmin
/// (f16), 12 bytes of scales, 128 of quants.
fn random_q4_k(rows: usize, cols: usize, seed: u64) -> Vec<u8> {
    assert_eq!(cols % 256, 0, "Q4_K rows are whole 256-weight blocks");
    let mut rng = Rng::new(seed);
    let mut out = Vec::with_capacity(DType::Q4_K.row_bytes(cols) * rows);
    for _ in 0..rows * cols / 256 {
        out.extend(0x1800u16.to_le_bytes()); // d = 2^-9
        out.extend(0u16.to_le_bytes()); // dmin
        out.extend((0..140).map(|_| (rng.next_f32() * 256.0) as u8));
    }
    out
}

/// `keep` of n neurons drawn without replacement with weights 1 / (rank + 1), neuron j of rank
/// j: a token's selection when neurons fire with power-law frequencies and are stored in order
/// of frequency (as a conversion that permutes them by profiled frequency would store them), so
/// the hot ones a selection mostly holds lie side by side. (Efraimidis-Spirakis: the `keep`
/// largest keys u^(1 / w).)
fn ranked_subset(n: usize, keep: usize, seed: u64) -> Vec<u32> {
    let mut rng = Rng::new(seed);
    let mut keyed: Vec<(f64, u32)> = (0..n as u32)
        .map(|j| ((rng.next_f32() as f64).max(1e-12).powf(j as f64 + 1.0), j))
        .collect();
    keyed.sort_unstable_by(|a, b| b.0.partial_cmp(&a.0).unwrap());
    keyed[..keep].iter().map(|&(_, j)| j).collect()
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn env_list<T: std::str::FromStr>(name: &str) -> Option<Vec<T>> {
    let v = std::env::var(name).ok()?;
    v.split(',').map(|s| s.trim().parse().ok()).collect()
}

/// One FFN block's weights in both layouts the operators read.
struct Block {
    gate: MmapMut,   // (n_ff, n_embd)
    up: MmapMut,     // (n_ff, n_embd)
    down: MmapMut,   // (n_embd, n_ff), the dense layout
    down_t: MmapMut, // (n_ff, n_embd), neuron-major
}

/// The block as the sparse operator reads it, with its rows bundled by neuron or not.
fn ffn_mats<'a>(
    dtype: DType,
    b: &'a Block,
    n_embd: usize,
    n_ff: usize,
    bundles: Option<&'a [u8]>,
) -> FfnMats<'a> {
    let q = |data: &'a [u8], rows: usize, cols: usize| QMatrix { dtype, rows, cols, data };
    FfnMats {
        gate: Some(q(&b.gate, n_ff, n_embd)),
        up: q(&b.up, n_ff, n_embd),
        up_bias: None,
        down_t: q(&b.down_t, n_ff, n_embd),
        down: Some(q(&b.down, n_embd, n_ff)),
        act: FfnActivation::ReGlu,
        bundles: bundles.map(|bb| &bb[..n_ff * 3 * dtype.row_bytes(n_embd)]),
    }
}

/// `bytes` copied into memory held the way the engine holds weights.
fn weights(bytes: &[u8]) -> MmapMut {
    let mut map = weight_buffer(bytes.len()).expect("anonymous memory");
    map[..bytes.len()].copy_from_slice(bytes);
    map
}

/// GB/s of a plain read of every byte of `bufs`, split over the pool's threads in 64 KiB
/// pieces (sums of u64 words, so the loads cannot be skipped).
fn stream_read_gbs(bufs: &[&[u8]], rounds: usize) -> f64 {
    stream_or_scatter_gbs(bufs, None, rounds.max(3))
}

/// How far ahead the scatter read prefetches, in bytes at least: the next row where rows are
/// long, several rows ahead where they are short (a plain read of SmolLM2-shape bundles, 972
/// bytes, at 90% skipped: 7-8 GB/s one row ahead, 11-12 four or eight rows ahead, one thread).
const SCATTER_AHEAD_BYTES: usize = 4096;

/// GB/s of a plain read of the rows `neurons` (sorted) of each matrix of `bufs` (rows of
/// `row_bytes`), split over the pool's threads in runs of 64 rows, each row read with the row
/// `SCATTER_AHEAD_BYTES` ahead prefetched into L2 a line at a time: the hardware limit for the
/// sparse operator's reads. Before each round `evict` is read untimed, so the rows come from
/// DRAM as in the timed operator (which alternates with the dense block), not from the last
/// round's cache.
fn scatter_read_gbs(
    bufs: &[&[u8]],
    row_bytes: usize,
    neurons: &[u32],
    evict: &[&[u8]],
    rounds: usize,
) -> f64 {
    let mut gbs: Vec<f64> = (0..rounds.max(3))
        .map(|_| {
            stream_or_scatter_gbs(evict, None, 1);
            stream_or_scatter_gbs(bufs, Some((row_bytes, neurons)), 1)
        })
        .collect();
    median(&mut gbs)
}

/// The wrapping sum of `c`'s u64 words (so the loads cannot be skipped), with `next`, if any,
/// prefetched into L2 a line per 64 bytes read. (Into L2, not L1: on the 2-core AMD EPYC a plain
/// read of 7B-shape bundles at 90% skipped ran at 11-12 GB/s on one thread and 20-21 on two when
/// prefetching into L1, whose few outstanding misses stall it, and at 19-20 and 27-29 into L2.)
fn sum_words(c: &[u8], next: Option<&[u8]>) -> u64 {
    // SAFETY: every bit pattern is a valid u64.
    let (_, words, _) = unsafe { c.align_to::<u64>() };
    let mut acc = [0u64; 8];
    for (i, w) in words.chunks_exact(8).enumerate() {
        #[cfg(target_arch = "x86_64")]
        if let Some(n) = next {
            // SAFETY: prefetching is a hint that never faults.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(
                    n.as_ptr().wrapping_add(64 * i) as *const i8,
                )
            };
        }
        for k in 0..8 {
            acc[k] = acc[k].wrapping_add(w[k]);
        }
    }
    acc.iter().fold(0u64, |a, b| a.wrapping_add(*b))
}

/// GB/s of `rounds` timed plain reads: of all of `bufs`, or with `rows` = (row bytes, selected
/// rows) of only those rows of each buffer.
fn stream_or_scatter_gbs(bufs: &[&[u8]], rows: Option<(usize, &[u32])>, rounds: usize) -> f64 {
    let total: usize = match rows {
        None => bufs.iter().map(|b| b.len()).sum(),
        Some((rb, sel)) => bufs.len() * sel.len() * rb,
    };
    let mut times = Vec::new();
    for _ in 0..rounds {
        let t = Instant::now();
        let s: u64 = bufs
            .iter()
            .map(|b| match rows {
                None => b
                    .par_chunks(64 << 10)
                    .map(|c| sum_words(c, None))
                    .reduce(|| 0, |a, b| a.wrapping_add(b)),
                Some((rb, sel)) => sel
                    .par_chunks(64)
                    .map(|run| {
                        let row = |j: u32| &b[j as usize * rb..(j as usize + 1) * rb];
                        let ahead = SCATTER_AHEAD_BYTES.div_ceil(rb);
                        run.iter().enumerate().fold(0u64, |a, (k, &j)| {
                            a.wrapping_add(sum_words(row(j), run.get(k + ahead).map(|&n| row(n))))
                        })
                    })
                    .reduce(|| 0, |a, b| a.wrapping_add(b)),
            })
            .fold(0u64, |a, b| a.wrapping_add(b));
        std::hint::black_box(s);
        times.push(t.elapsed().as_secs_f64());
    }
    total as f64 / median(&mut times) / 1e9
}

fn main() {
    let threads_list: Vec<usize> = env_list("POWERINFER_BENCH_THREADS").unwrap_or(vec![1, 2]);
    let rounds: usize =
        std::env::var("POWERINFER_BENCH_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(9);
    let footprint: usize = std::env::var("POWERINFER_BENCH_FOOTPRINT")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1 << 30);
    let sparsities: Vec<f64> =
        env_list("POWERINFER_BENCH_SPARSITIES").unwrap_or(SPARSITIES.to_vec());
    let types: Vec<String> = env_list("POWERINFER_BENCH_TYPES").unwrap_or(vec![
        "Q4_0".into(),
        "Q8_0".into(),
        "F16".into(),
    ]);
    let shapes: Vec<(usize, usize)> =
        std::env::var("POWERINFER_BENCH_SHAPES").map_or(SHAPES.to_vec(), |v| {
            v.split(',')
                .map(|s| {
                    let (e, f) = s.trim().split_once('x').expect("a shape is n_embd x n_ff");
                    (e.parse().expect("n_embd"), f.parse().expect("n_ff"))
                })
                .collect()
        });
    // "ranked": selections concentrated on the low indices, as when neurons are stored in
    // order of frequency; "random" (the default): any neuron alike
    let by_rank = std::env::var("POWERINFER_BENCH_SELECTION").is_ok_and(|v| v == "ranked");
    println!(
        "FFN blocks (ReGLU), one token, median of {rounds} alternating rounds, {} selections",
        if by_rank { "frequency-ranked" } else { "random" }
    );
    println!(
        "GB/s: weight bytes read per second; stream: a plain read of the dense block's bytes;"
    );
    println!("scatter: a plain read of the rows the sparse operator reads (the selected rows of gate, up, down_t)");
    println!(
        "{:<5} {:>3} {:>6} {:<6} {:>9} {:>10} {:>8} {:>6} {:>8} {:>8} {:>7} {:>7}",
        "type",
        "thr",
        "sparse",
        "layout",
        "dense ms",
        "sparse ms",
        "speedup",
        "ideal",
        "dense GB/s",
        "sparse GB/s",
        "stream",
        "scatter"
    );
    for &(n_embd, n_ff) in &shapes {
        println!("n_embd {n_embd}, n_ff {n_ff}");
        for name in &types {
            let dtype = match name.as_str() {
                "Q4_0" => DType::Q4_0,
                "Q4_1" => DType::Q4_1,
                "Q8_0" => DType::Q8_0,
                "Q4_K" => DType::Q4_K,
                "F16" => DType::F16,
                "F32" => DType::F32,
                "BF16" => DType::BF16,
                other => panic!("unknown type {other}"),
            };
            if n_embd % dtype.block_len() != 0 {
                // (llama.cpp's quantizer stores such rows in another type, as SmolLM2's Q4_K_M
                // file does)
                println!(
                    "{name}: rows of {n_embd} are not whole {}-weight blocks, skipped",
                    dtype.block_len()
                );
                continue;
            }
            let first = Block {
                gate: weights(&matrix(dtype, n_ff, n_embd, 1, true)),
                up: weights(&matrix(dtype, n_ff, n_embd, 2, false)),
                down: weights(&matrix(dtype, n_embd, n_ff, 3, false)),
                down_t: weights(&matrix(dtype, n_ff, n_embd, 4, false)),
            };
            let block_bytes = first.gate.len() + first.up.len() + first.down.len();
            let copies = footprint.div_ceil(block_bytes).max(1);
            let blocks: Vec<Block> = (0..copies)
                .map(|_| Block {
                    gate: weights(&first.gate),
                    up: weights(&first.up),
                    down: weights(&first.down),
                    down_t: weights(&first.down_t),
                })
                .collect();
            // the same rows bundled by neuron, as the engine holds them for one token's operator
            let bundles: Vec<MmapMut> = blocks
                .iter()
                .map(|b| {
                    let m = ffn_mats(dtype, b, n_embd, n_ff, None);
                    let bytes = n_ff * m.bundle_bytes();
                    let mut buf = weight_buffer(bytes).expect("anonymous memory");
                    interleave_rows(&[m.gate.unwrap(), m.up, m.down_t], &mut buf[..bytes]);
                    buf
                })
                .collect();
            let mats: Vec<FfnMats> =
                blocks.iter().map(|b| ffn_mats(dtype, b, n_embd, n_ff, None)).collect();
            let bundled: Vec<FfnMats> = blocks
                .iter()
                .zip(&bundles)
                .map(|(b, bb)| ffn_mats(dtype, b, n_embd, n_ff, Some(&bb[..])))
                .collect();
            let bundle_bufs: Vec<&[u8]> = bundles.iter().map(|b| &b[..]).collect();
            let dense_bufs: Vec<&[u8]> =
                blocks.iter().flat_map(|b| [&b.gate[..], &b.up[..], &b.down[..]]).collect();
            let sparse_bufs: Vec<&[u8]> =
                blocks.iter().flat_map(|b| [&b.gate[..], &b.up[..], &b.down_t[..]]).collect();

            let mut rng = Rng::new(5);
            let x_f: Vec<f32> = (0..n_embd).map(|_| rng.next_f32()).collect();
            for &threads in &threads_list {
                let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
                let stream = pool.install(|| stream_read_gbs(&dense_bufs, rounds));
                let (mut x, mut hx) = (Activations::default(), Activations::default());
                let (mut g, mut u) = (vec![0.0f32; n_ff], vec![0.0f32; n_ff]);
                let mut out = vec![0.0f32; n_embd];
                let mut scratch = SparseScratch::default();
                let mut sx = Activations::default();
                let mut sout = vec![0.0f32; n_embd];
                for &sparsity in &sparsities {
                    let keep = ((1.0 - sparsity) * n_ff as f64).round() as usize;
                    let mut neurons = if by_rank {
                        ranked_subset(n_ff, keep, 9)
                    } else {
                        // a random subset of `keep` neurons, sorted
                        let mut idx: Vec<u32> = (0..n_ff as u32).collect();
                        let mut r = Rng::new(9);
                        for i in 0..keep {
                            let j = i + (r.next_f32() * (n_ff - i) as f32) as usize % (n_ff - i);
                            idx.swap(i, j);
                        }
                        idx[..keep].to_vec()
                    };
                    neurons.sort_unstable();
                    let mut dense = || {
                        for m in &mats {
                            x.set(&x_f, 1, n_embd);
                            matmul_many(&[m.gate.unwrap(), m.up], &x, &mut [&mut g, &mut u]);
                            g.iter_mut()
                                .zip(&u)
                                .for_each(|(gi, ui)| *gi = FfnActivation::ReGlu.apply(*gi, *ui));
                            hx.set(&g, 1, n_ff);
                            matmul(&m.down.unwrap(), &hx, &mut out);
                        }
                    };
                    let mut sparse = |mats: &[FfnMats]| {
                        for m in mats {
                            sx.set(&x_f, 1, n_embd);
                            sparse_ffn(m, &sx, &neurons, None, &mut sout, &mut scratch);
                        }
                    };
                    let (mut td, mut ts, mut tb) = (Vec::new(), Vec::new(), Vec::new());
                    pool.install(|| {
                        dense();
                        sparse(&mats);
                        sparse(&bundled);
                        for _ in 0..rounds {
                            let t = Instant::now();
                            dense();
                            td.push(t.elapsed().as_secs_f64() / copies as f64);
                            let t = Instant::now();
                            sparse(&mats);
                            ts.push(t.elapsed().as_secs_f64() / copies as f64);
                            let t = Instant::now();
                            sparse(&bundled);
                            tb.push(t.elapsed().as_secs_f64() / copies as f64);
                        }
                    });
                    let (d, s, sb) = (median(&mut td), median(&mut ts), median(&mut tb));
                    #[cfg(feature = "phase-timers")]
                    let phases = {
                        use std::sync::atomic::Ordering::Relaxed;
                        let ns = powerinfer_core::sparse::PHASE_NS
                            .each_ref()
                            .map(|a| a.swap(0, Relaxed));
                        let total = ns.iter().sum::<u64>().max(1) as f64;
                        ns.map(|n| 100.0 * n as f64 / total)
                    };
                    let rb = dtype.row_bytes(n_embd);
                    let sparse_bytes = 3 * keep * rb;
                    for (layout, t, bufs, row_bytes) in
                        [("apart", s, &sparse_bufs, rb), ("bundle", sb, &bundle_bufs, 3 * rb)]
                    {
                        let scatter = pool.install(|| {
                            scatter_read_gbs(bufs, row_bytes, &neurons, &dense_bufs, rounds)
                        });
                        println!(
                            "{:<5} {:>3} {:>5.0}% {:<6} {:>9.2} {:>10.3} {:>7.2}x {:>5.1}x {:>10.1} {:>11.1} {:>7.1} {:>7.1}",
                            dtype.name(),
                            threads,
                            sparsity * 100.0,
                            layout,
                            d * 1e3,
                            t * 1e3,
                            d / t,
                            1.0 / (1.0 - sparsity),
                            block_bytes as f64 / d / 1e9,
                            sparse_bytes as f64 / t / 1e9,
                            stream,
                            scatter
                        );
                    }
                    #[cfg(feature = "phase-timers")]
                    println!(
                        "      sparse passes: gate dots {:.0}%, up dots {:.0}%, down axpys {:.0}%",
                        phases[0], phases[1], phases[2]
                    );
                }
            }
        }
    }
}
