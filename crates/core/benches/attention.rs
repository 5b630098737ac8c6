//! Prompt attention against the machine's multiply-add peak, in multiply-adds per second on one
//! thread: a block of two queries of SmolLM2's shape (3 query heads per KV head, 64 dims, f16
//! cache) over 4,096 cached rows, as a long prompt runs it (scores, e^x, weighted sums: 2 x 64
//! multiply-adds per head and row), next to loops of nothing but independent fused
//! multiply-adds in 8 and (where the CPU has AVX-512) 16 lanes: the most the FMA units can do.
//! Criterion's "elem/s" are multiply-adds per second for all three.
//!
//!     cargo bench -p powerinfer-core --bench attention

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use powerinfer_core::attention::{attend_block, KvBuf, KvType, Scoring};
use powerinfer_core::sampler::Rng;

/// `reps` rounds of 24 independent 8-lane multiply-add chains (enough to hide the latency).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn fma_peak(reps: usize) -> f32 {
    use std::arch::x86_64::*;
    let mut acc = [_mm256_set1_ps(0.5); 24];
    let (x, y) = (_mm256_set1_ps(0.999_9), _mm256_set1_ps(1e-5));
    for _ in 0..reps {
        for a in acc.iter_mut() {
            *a = _mm256_fmadd_ps(*a, x, y);
        }
    }
    let mut lanes = [0f32; 8];
    let sum = acc.iter().fold(_mm256_setzero_ps(), |s, a| _mm256_add_ps(s, *a));
    _mm256_storeu_ps(lanes.as_mut_ptr(), sum);
    lanes.iter().sum()
}

/// `fma_peak` in 16 lanes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
unsafe fn fma_peak512(reps: usize) -> f32 {
    use std::arch::x86_64::*;
    let mut acc = [_mm512_set1_ps(0.5); 24];
    let (x, y) = (_mm512_set1_ps(0.999_9), _mm512_set1_ps(1e-5));
    for _ in 0..reps {
        for a in acc.iter_mut() {
            *a = _mm512_fmadd_ps(*a, x, y);
        }
    }
    let sum = acc.iter().fold(_mm512_setzero_ps(), |s, a| _mm512_add_ps(s, *a));
    _mm512_reduce_add_ps(sum)
}

fn bench(c: &mut Criterion) {
    let (g, hd, b, n_kv) = (3usize, 64usize, 2usize, 3usize);
    let len0 = 4096;
    let n = len0 + b - 1;
    let stride = n_kv * hd;
    let mut rng = Rng::new(5);
    let mut random = |len: usize| (0..len).map(|_| rng.next_f32() - 0.5).collect::<Vec<f32>>();
    let mut k = KvBuf::new(KvType::F16, n * stride).unwrap();
    k.write(0, &random(n * stride));
    let mut v = KvBuf::new(KvType::F16, n * stride).unwrap();
    v.write(0, &random(n * stride));
    let qs = random(b * g * hd);
    let (mut scores, mut out) = (Vec::new(), vec![0.0f32; b * g * hd]);

    let mut group = c.benchmark_group("prompt_attention_4096_rows");
    // rows each query sees, times its heads, times scores and weighted sums of hd each
    group.throughput(Throughput::Elements(
        ((0..b).map(|i| len0 + i).sum::<usize>() * g * 2 * hd) as u64,
    ));
    group.bench_function("smollm2_block_of_2", |bch| {
        bch.iter(|| {
            attend_block(
                &qs,
                hd,
                b,
                k.view(n * stride),
                v.view(n * stride),
                len0,
                stride,
                hd,
                Scoring { scale: 0.125, softcap: 0.0, sinks: &[] },
                &mut scores,
                &mut out,
            )
        })
    });
    group.finish();

    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
        let reps = 100_000;
        let mut group = c.benchmark_group("fma_peak");
        group.throughput(Throughput::Elements((reps * 24 * 8) as u64));
        // SAFETY: the CPU has AVX2 and FMA (checked above).
        group.bench_function("ymm_24_chains", |bch| {
            bch.iter(|| unsafe { fma_peak(std::hint::black_box(reps)) })
        });
        group.finish();
    }
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512vl") {
        let reps = 100_000;
        let mut group = c.benchmark_group("fma_peak");
        group.throughput(Throughput::Elements((reps * 24 * 16) as u64));
        // SAFETY: the CPU has AVX-512 F and VL (checked above).
        group.bench_function("zmm_24_chains", |bch| {
            bch.iter(|| unsafe { fma_peak512(std::hint::black_box(reps)) })
        });
        group.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
