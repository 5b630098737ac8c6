//! Quantized matrix-vector (decode) and matrix-matrix (prefill) throughput, in weight bytes per
//! second, for each weight type, on a 2-thread pool (`POWERINFER_BENCH_THREADS` overrides).
//!
//!     cargo bench -p powerinfer-core --bench kernels

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use powerinfer_core::matmul::{matmul, Activations, QMatrix};
use powerinfer_core::quant::{quantize_row, DType};
use powerinfer_core::sampler::Rng;

fn random(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    (0..n).map(|_| rng.next_f32() * 2.0 - 1.0).collect()
}

fn bench(c: &mut Criterion) {
    let threads: usize =
        std::env::var("POWERINFER_BENCH_THREADS").ok().and_then(|v| v.parse().ok()).unwrap_or(2);
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
    // (rows, cols): SmolLM2-135M's FFN up projection and a 7B-class square projection.
    for (rows, cols) in [(1536usize, 576usize), (4096, 4096)] {
        let w_f = random(rows * cols, 1);
        for dtype in [DType::Q4_0, DType::Q4_1, DType::Q8_0, DType::F16] {
            let data: Vec<u8> = w_f.chunks(cols).flat_map(|r| quantize_row(dtype, r)).collect();
            let w = QMatrix { dtype, rows, cols, data: &data };
            for n in [1usize, 64] {
                let mut g = c.benchmark_group(format!(
                    "{}_{}x{}_n{}",
                    if n == 1 { "matvec" } else { "matmul" },
                    rows,
                    cols,
                    n
                ));
                g.throughput(Throughput::Bytes(data.len() as u64));
                if rows * cols * n > 1 << 24 {
                    g.sample_size(20);
                }
                let x_f = random(n * cols, 2);
                let mut x = Activations::default();
                pool.install(|| x.set(&x_f, n, cols));
                let mut out = vec![0.0f32; n * rows];
                g.bench_function(BenchmarkId::from_parameter(dtype.name()), |b| {
                    // the loop runs inside the pool: a hand-off to the pool per call costs more
                    // than a small product (~90 us of ~35 on the 1536x576 one)
                    pool.install(|| b.iter(|| matmul(&w, &x, &mut out)))
                });
                g.finish();
            }
        }
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
