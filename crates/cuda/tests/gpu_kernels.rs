//! Every GPU kernel against its scalar CPU twin (`twin.rs`) on fresh random inputs, with the
//! outputs poisoned (NaN) before each launch so an unwritten element fails. They need an NVIDIA
//! GPU, so `cargo test` lists them as ignored; `cargo test -- --ignored` (what
//! `scripts/gpu_suite.sh` runs on a GPU machine) runs them, and there a missing GPU fails them.

use powerinfer_core::matmul::{matmul, Activations, QMatrix};
use powerinfer_core::model::FfnActivation;
use powerinfer_core::quant::{
    dequantize_row, f32_to_f16, quantize_act, quantize_row, BlockQ8Act, DType, QK,
};
use powerinfer_core::sampler::Rng;
use powerinfer_cuda::device::Cuda;
use powerinfer_cuda::gpu::{AttnShape, DActs, DMat, Gpu, Q8_BLOCK_BYTES};
use powerinfer_cuda::twin;

fn gpu() -> Gpu {
    Gpu::open(0).unwrap_or_else(|e| panic!("these tests need a GPU: {e}"))
}

fn random(rng: &mut Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| (rng.next_f32() * 2.0 - 1.0) * scale).collect()
}

/// Byte offsets of the f16 scale fields in a block of each type the engine reads but does not
/// write (ggml's layouts).
fn f16_fields(dtype: DType) -> &'static [usize] {
    match dtype {
        DType::Q5_0 | DType::IQ4_NL | DType::IQ4_XS => &[0],
        DType::Q3_K => &[108],
        DType::Q5_1 | DType::Q4_K | DType::Q5_K => &[0, 2],
        DType::Q2_K => &[80, 82],
        DType::Q6_K => &[208],
        _ => &[],
    }
}

/// Random weights of `dtype`: the engine's own quantizer where it writes the type, else valid
/// blocks of random bytes with random-signed f16 scales of about `0.5 / 16` (ggml's quantizer
/// is not part of the engine; any valid encoding serves a comparison of two decoders of it).
fn matrix(rng: &mut Rng, dtype: DType, rows: usize, cols: usize) -> Vec<u8> {
    if matches!(dtype, DType::F32 | DType::F16 | DType::Q4_0 | DType::Q4_1 | DType::Q8_0) {
        return (0..rows).flat_map(|_| quantize_row(dtype, &random(rng, cols, 0.5))).collect();
    }
    let (len, bytes) = (dtype.block_len(), dtype.row_bytes(dtype.block_len()));
    let mut out: Vec<u8> =
        (0..rows * cols / len * bytes).map(|_| (rng.next_u64() & 0xFF) as u8).collect();
    for blk in out.chunks_exact_mut(bytes) {
        if dtype == DType::MXFP4 {
            // an exponent byte: scales 2^-10 .. 2^-3 (values up to 12 times that)
            blk[0] = 118 + (rng.next_u64() % 8) as u8;
        }
        for &at in f16_fields(dtype) {
            let v = (0.5 + 0.5 * rng.next_f32())
                * if rng.next_u64() & 1 == 0 { 1.0 } else { -1.0 }
                * 0.5
                / 16.0;
            blk[at..at + 2].copy_from_slice(&f32_to_f16(v).to_le_bytes());
        }
    }
    out
}

/// ||a - b|| / ||b||, and no NaN anywhere in a.
fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    assert!(a.iter().all(|v| v.is_finite()), "unwritten or non-finite output");
    let num: f64 = a.iter().zip(b).map(|(&x, &y)| (x as f64 - y as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|&y| (y as f64).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

fn poisoned(gpu: &Gpu, n: usize) -> cudarc::driver::CudaSlice<f32> {
    gpu.upload(&vec![f32::NAN; n]).unwrap()
}

/// `x` on the device, with its int8 blocks when `reader` is quantized.
fn device_acts(g: &Gpu, x: &[f32], reader: &DMat<Cuda>) -> DActs<Cuda> {
    let mut a = g.acts(x.len()).unwrap();
    g.write(x, &mut a.f32s).unwrap();
    g.quantize_for(&[reader], &mut a, x.len()).unwrap();
    a
}

/// `quantize_q8` writes the bytes the CPU's `quantize_act` writes, for ordinary values, ties
/// (values at exactly half a step), zeros and a block of zeros.
#[test]
#[ignore = "needs an NVIDIA GPU: cargo test -- --ignored"]
fn quantize_is_bit_identical_to_the_cpu() {
    let g = gpu();
    let mut rng = Rng::new(3);
    let n = 32 * 300;
    let mut x = random(&mut rng, n, 3.0);
    x[32..64].iter_mut().for_each(|v| *v = 0.0);
    // a block whose step is 1.0: amax 127, and values at k + 0.5 round away from zero
    for (i, v) in x[64..96].iter_mut().enumerate() {
        *v = if i == 0 { 127.0 } else { (i as f32 - 16.0) + 0.5 };
    }
    x[100] = 0.0;
    let mut want = vec![BlockQ8Act::default(); n / QK];
    quantize_act(&x, &mut want);
    let want_bytes: Vec<u8> = want
        .iter()
        .flat_map(|b| {
            let mut v = b.d.to_le_bytes().to_vec();
            v.extend(b.s.to_le_bytes());
            v.extend(b.qs.iter().map(|&q| q as u8));
            v
        })
        .collect();
    let reader = g
        .upload_rows(
            &QMatrix { dtype: DType::Q8_0, rows: 1, cols: n, data: &quantize_row(DType::Q8_0, &x) },
            None,
        )
        .unwrap();
    let a = device_acts(&g, &x, &reader);
    let mut got = vec![0u8; n / QK * Q8_BLOCK_BYTES];
    g.read(&a.q8, &mut got).unwrap();
    assert_eq!(got, want_bytes);
}

const TYPES: [DType; 15] = [
    DType::F32,
    DType::F16,
    DType::Q4_0,
    DType::Q4_1,
    DType::Q8_0,
    DType::Q5_0,
    DType::Q5_1,
    DType::Q2_K,
    DType::Q3_K,
    DType::Q4_K,
    DType::Q5_K,
    DType::Q6_K,
    DType::IQ4_NL,
    DType::IQ4_XS,
    DType::MXFP4,
];

/// Types whose GPU kernels read the int8 blocks the CPU's own kernels read (the others: see
/// powerinfer.cu's header), so the GPU's products equal the CPU's to rounding.
fn cpu_reads_the_same_blocks(dtype: DType) -> bool {
    matches!(dtype, DType::Q4_0 | DType::Q4_1 | DType::Q8_0)
}

#[test]
#[ignore = "needs an NVIDIA GPU: cargo test -- --ignored"]
fn matvec_matches_twin() {
    let g = gpu();
    let mut rng = Rng::new(1);
    // 4100 rows: not a multiple of the 4 rows per block; 5120 and 96 (256) columns: wide and narrow
    for dtype in TYPES {
        for (rows, cols) in [(4100, 5120), (37, 96usize.next_multiple_of(dtype.block_len()))] {
            let data = matrix(&mut rng, dtype, rows, cols);
            let m = QMatrix { dtype, rows, cols, data: &data };
            let x = random(&mut rng, cols, 1.0);
            let bias = random(&mut rng, rows, 1.0);
            let dm = g.upload_rows(&m, None).unwrap();
            let dx = device_acts(&g, &x, &dm);
            let db = g.upload(&bias).unwrap();
            for relu in [false, true] {
                let mut dy = poisoned(&g, rows);
                g.matvec(&dm, &dx, Some(&db), &mut dy, relu, 1).unwrap();
                let mut y = vec![0.0; rows];
                g.read(&dy, &mut y).unwrap();
                let err = rel_err(&y, &twin::matvec(&m, &x, Some(&bias), relu));
                assert!(err < 1e-5, "{dtype:?} {rows}x{cols} relu={relu}: {err}");
                if cpu_reads_the_same_blocks(dtype) {
                    // the integer kernels compute what the CPU's do
                    let mut acts = Activations::default();
                    acts.set(&x, 1, cols);
                    let mut cpu = vec![0.0; rows];
                    matmul(&m, &acts, &mut cpu);
                    assert!(
                        rel_err(
                            &y,
                            &cpu.iter()
                                .zip(&bias)
                                .map(|(v, b)| if relu { (v + b).max(0.0) } else { v + b })
                                .collect::<Vec<_>>()
                        ) < 1e-5
                    );
                }
                // into a slot of a larger buffer: the same values there, nothing else written
                let at = 3 * rows;
                let mut dslots = g.upload(&vec![7.0f32; 5 * rows]).unwrap();
                g.matvec_at(&dm, &dx, Some(&db), &mut dslots, at, relu, 1).unwrap();
                let mut slots = vec![0.0; 5 * rows];
                g.read(&dslots, &mut slots).unwrap();
                assert_eq!(&slots[at..at + rows], &y[..], "{dtype:?} {rows}x{cols} at {at}");
                assert!(slots[..at].iter().chain(&slots[at + rows..]).all(|&v| v == 7.0));
            }
        }
    }
}

/// q, k and v in one launch: each output what its own matvec gives, with and without biases.
#[test]
#[ignore = "needs an NVIDIA GPU: cargo test -- --ignored"]
fn matvec3_matches_three_matvecs() {
    let g = gpu();
    let mut rng = Rng::new(7);
    let cols = 1024;
    for dtype in TYPES {
        let rows = [1024, 256, 256];
        let data: Vec<Vec<u8>> = rows.iter().map(|&r| matrix(&mut rng, dtype, r, cols)).collect();
        let ms: Vec<QMatrix> = rows
            .iter()
            .zip(&data)
            .map(|(&r, d)| QMatrix { dtype, rows: r, cols, data: d })
            .collect();
        let dms: Vec<_> = ms.iter().map(|m| g.upload_rows(m, None).unwrap()).collect();
        let x = random(&mut rng, cols, 1.0);
        let dx = device_acts(&g, &x, &dms[0]);
        let biases: Vec<Vec<f32>> = rows.iter().map(|&r| random(&mut rng, r, 1.0)).collect();
        let db: Vec<_> = biases.iter().map(|b| g.upload(b).unwrap()).collect();
        for with_bias in [false, true] {
            let mut ys: Vec<_> = rows.iter().map(|&r| poisoned(&g, r)).collect();
            let [y0, y1, y2] = &mut ys[..] else { unreachable!() };
            let b = |i: usize| with_bias.then(|| &db[i]);
            g.matvec3([&dms[0], &dms[1], &dms[2]], &dx, [b(0), b(1), b(2)], [y0, y1, y2], 1)
                .unwrap();
            for i in 0..3 {
                let mut got = vec![0.0; rows[i]];
                g.read(&ys[i], &mut got).unwrap();
                let want = twin::matvec(&ms[i], &x, with_bias.then(|| &biases[i][..]), false);
                assert!(rel_err(&got, &want) < 1e-5, "{dtype:?} matrix {i} bias={with_bias}");
            }
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: cargo test -- --ignored"]
fn ffn_hot_and_down_match_twin() {
    let g = gpu();
    let mut rng = Rng::new(2);
    let (n_embd, n_ff) = (1024, 3000);
    for dtype in TYPES {
        for act in [
            FfnActivation::ReGlu,
            FfnActivation::SwiGlu,
            FfnActivation::DReGlu,
            FfnActivation::GeGlu,
            FfnActivation::SwiGluOai,
        ] {
            let (gd, ud, dd) = (
                matrix(&mut rng, dtype, n_ff, n_embd),
                matrix(&mut rng, dtype, n_ff, n_embd),
                matrix(&mut rng, dtype, n_ff, n_embd),
            );
            let gate = QMatrix { dtype, rows: n_ff, cols: n_embd, data: &gd };
            let up = QMatrix { dtype, rows: n_ff, cols: n_embd, data: &ud };
            let down_t = QMatrix { dtype, rows: n_ff, cols: n_embd, data: &dd };
            // a scattered hot set (the GPU bucket), 1 neuron in 3
            let bucket: Vec<u32> = (0..n_ff as u32).filter(|j| (j * 7919) % 3 == 0).collect();
            let x = random(&mut rng, n_embd, 1.0);
            let logits = random(&mut rng, n_ff, 1.0);
            let thr = 0.3; // about a third of the rows pass
            let dgate = g.upload_rows(&gate, Some(&bucket)).unwrap();
            let dup = g.upload_rows(&up, Some(&bucket)).unwrap();
            let ddown = g.upload_rows(&down_t, Some(&bucket)).unwrap();
            // the twins read the hot rows packed, as the GPU holds them
            let (pg, pu, pd) = (
                twin::pack_rows(&gate, &bucket),
                twin::pack_rows(&up, &bucket),
                twin::pack_rows(&down_t, &bucket),
            );
            let packed = |data| QMatrix { dtype, rows: bucket.len(), cols: n_embd, data };
            let (hot_gate, hot_up, hot_down) = (packed(&pg), packed(&pu), packed(&pd));
            let dbucket = g.upload(&bucket.iter().map(|&j| j as i32).collect::<Vec<_>>()).unwrap();
            let (dx, dlogits) = (device_acts(&g, &x, &dup), g.upload(&logits).unwrap());
            // gpt-oss's experts have gate and up biases (by neuron id)
            let biases = (act == FfnActivation::SwiGluOai)
                .then(|| [random(&mut rng, n_ff, 1.0), random(&mut rng, n_ff, 1.0)]);
            let dbiases =
                biases.as_ref().map(|[a, b]| [g.upload(a).unwrap(), g.upload(b).unwrap()]);
            let dbias = [0, 1].map(|i| dbiases.as_ref().map(|b| &b[i]));
            let bias = [0, 1].map(|i| biases.as_ref().map(|b| &b[i][..]));
            for pred in [true, false] {
                let mut dh = poisoned(&g, bucket.len());
                let p = pred.then_some((&dlogits, n_ff));
                let mut counts = g.upload(&[7u32, 0, 7]).unwrap();
                g.ffn_hot(
                    Some(&dgate),
                    &dup,
                    &dbucket,
                    &dx,
                    dbias,
                    p,
                    thr,
                    pred.then_some((&mut counts, 1)),
                    act,
                    &mut dh,
                    1,
                )
                .unwrap();
                let mut h = vec![0.0; bucket.len()];
                g.read(&dh, &mut h).unwrap();
                // the selection count lands in its slot only
                let mut n = [0u32; 3];
                g.read(&counts, &mut n).unwrap();
                let passing = bucket.iter().filter(|&&j| logits[j as usize] >= thr).count() as u32;
                assert_eq!(n, [7, if pred { passing } else { 0 }, 7], "{dtype:?} {act:?}");
                let want = twin::ffn_hot(
                    Some(&hot_gate),
                    &hot_up,
                    &bucket,
                    &x,
                    bias,
                    pred.then_some((&logits[..], thr)),
                    act,
                );
                assert!(rel_err(&h, &want) < 1e-5, "{dtype:?} {act:?} pred={pred}");
                if pred {
                    // early exit: rows the predictor rejects are exactly zero
                    for (i, &j) in bucket.iter().enumerate() {
                        if logits[j as usize] < thr {
                            assert_eq!(h[i], 0.0);
                        }
                    }
                }

                // down: the partial sums merged into a residual, plus a CPU part and a bias
                let base = random(&mut rng, n_embd, 1.0);
                let cpu_part = random(&mut rng, n_embd, 1.0);
                let bias = random(&mut rng, n_embd, 1.0);
                let mut dx_res = g.upload(&base).unwrap();
                let mut partial = poisoned(
                    &g,
                    bucket.len().div_ceil(powerinfer_cuda::gpu::ROWS_PER_CHUNK) * n_embd,
                );
                let chunks = g.down_partial(&ddown, &dh, &mut partial, 1).unwrap();
                let (dcpu, dbias) = (g.upload(&cpu_part).unwrap(), g.upload(&bias).unwrap());
                g.ffn_merge(&mut dx_res, &partial, chunks, Some(&dcpu), Some(&dbias), n_embd, 1)
                    .unwrap();
                let mut got = vec![0.0; n_embd];
                g.read(&dx_res, &mut got).unwrap();
                let d = twin::down(&hot_down, &h);
                let want: Vec<f32> =
                    (0..n_embd).map(|c| base[c] + d[c] + cpu_part[c] + bias[c]).collect();
                assert!(rel_err(&got, &want) < 1e-5, "down {dtype:?} {act:?} pred={pred}");
            }
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: cargo test -- --ignored"]
fn norm_rope_attention_match_twin() {
    let g = gpu();
    let mut rng = Rng::new(3);
    // rmsnorm
    let n = 5120;
    let (x, w) = (random(&mut rng, n, 2.0), random(&mut rng, n, 1.0));
    let mut dout = g.acts(n).unwrap();
    dout.f32s = poisoned(&g, n);
    g.rmsnorm(&g.upload(&x).unwrap(), &g.upload(&w).unwrap(), &mut dout, n, 1e-5, false, 1)
        .unwrap();
    let mut out = vec![0.0; n];
    g.read(&dout.f32s, &mut out).unwrap();
    assert!(rel_err(&out, &twin::rmsnorm(&x, &w, 1e-5)) < 1e-5);
    // for a quantized reader the norm also rounds its output: the bytes `quantize_q8` writes
    let reader_data = quantize_row(DType::Q8_0, &vec![0.5; n]);
    let reader = g
        .upload_rows(&QMatrix { dtype: DType::Q8_0, rows: 1, cols: n, data: &reader_data }, None)
        .unwrap();
    g.rmsnorm(&g.upload(&x).unwrap(), &g.upload(&w).unwrap(), &mut dout, n, 1e-5, true, 1).unwrap();
    assert!(dout.rounded);
    let mut fused = vec![0u8; n / QK * Q8_BLOCK_BYTES];
    g.read(&dout.q8, &mut fused).unwrap();
    dout.rounded = false;
    g.quantize_for(&[&reader], &mut dout, n).unwrap();
    let mut separate = vec![0u8; fused.len()];
    g.read(&dout.q8, &mut separate).unwrap();
    assert_eq!(fused, separate);

    // the residual add and the next norm in one launch: what add_into then rmsnorm compute
    let y = random(&mut rng, n, 1.0);
    let (mut x1, mut x2) = (g.upload(&x).unwrap(), g.upload(&x).unwrap());
    let (mut fused, mut separate) = (g.acts(n).unwrap(), g.acts(n).unwrap());
    let (dy, dw) = (g.upload(&y).unwrap(), g.upload(&w).unwrap());
    g.add_rmsnorm(&mut x1, &dy, &dw, &mut fused, n, 1e-5, true, 1).unwrap();
    g.add_into(&mut x2, &dy, None, n).unwrap();
    g.rmsnorm(&x2, &dw, &mut separate, n, 1e-5, true, 1).unwrap();
    for (a, b) in [(&x1, &x2), (&fused.f32s, &separate.f32s)] {
        let (mut ha, mut hb) = (vec![0.0f32; n], vec![0.0f32; n]);
        g.read(a, &mut ha).unwrap();
        g.read(b, &mut hb).unwrap();
        assert_eq!(
            ha.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            hb.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
    }
    let (mut qa, mut qb) = (vec![0u8; n / QK * Q8_BLOCK_BYTES], vec![0u8; n / QK * Q8_BLOCK_BYTES]);
    g.read(&fused.q8, &mut qa).unwrap();
    g.read(&separate.q8, &mut qb).unwrap();
    assert_eq!(qa, qb);

    // per-head rmsnorm in place (q/k norms: 12 heads of 128), and one head of 5120 (post norms)
    for (heads, hd) in [(12, 128), (1, n)] {
        let (x, w) = (random(&mut rng, heads * hd, 2.0), random(&mut rng, hd, 1.0));
        let mut dx = g.upload(&x).unwrap();
        g.head_rmsnorm(&mut dx, &g.upload(&w).unwrap(), heads, hd, 1e-6).unwrap();
        let mut got = vec![0.0; x.len()];
        g.read(&dx, &mut got).unwrap();
        let mut want = x.clone();
        twin::head_rmsnorm(&mut want, &w, hd, 1e-6);
        assert!(rel_err(&got, &want) < 1e-5, "head_rmsnorm {heads}x{hd}");
    }

    // rope of q and k in one launch, both styles, partial rotary dimension
    let (n_head, n_head_kv, hd, rd) = (8, 2, 128, 64);
    for neox in [false, true] {
        let (q, k) = (random(&mut rng, n_head * hd, 1.0), random(&mut rng, n_head_kv * hd, 1.0));
        let angles: Vec<f32> =
            (0..rd / 2).map(|i| 37.0 * 10000f32.powf(-2.0 * i as f32 / rd as f32)).collect();
        let (cos, sin): (Vec<f32>, Vec<f32>) = angles.iter().map(|a| (a.cos(), a.sin())).unzip();
        let (mut dq, mut dk) = (g.upload(&q).unwrap(), g.upload(&k).unwrap());
        g.rope(
            &mut dq,
            &mut dk,
            &g.upload(&cos).unwrap(),
            &g.upload(&sin).unwrap(),
            n_head,
            n_head_kv,
            hd,
            rd,
            neox,
            1,
        )
        .unwrap();
        for (d, x) in [(&dq, &q), (&dk, &k)] {
            let mut got = vec![0.0; x.len()];
            g.read(d, &mut got).unwrap();
            let mut want = x.clone();
            twin::rope(&mut want, &cos, &sin, hd, rd, neox);
            assert!(rel_err(&got, &want) < 1e-6, "rope neox={neox}");
        }
    }

    // kv_store + attention (GQA 8 query heads on 2 kv heads), f32 and f16 caches
    let (n_head, n_head_kv, hd, n_ctx) = (8, 2, 64, 300);
    let kv_dim = n_head_kv * hd;
    for f16 in [false, true] {
        let elem = if f16 { 2 } else { 4 };
        let mut kc = g.zeros::<u8>(n_ctx * kv_dim * elem).unwrap();
        let mut vc = g.zeros::<u8>(n_ctx * kv_dim * elem).unwrap();
        let (mut ks, mut vs) = (Vec::new(), Vec::new());
        let len = 257;
        let mut at = g.pos().unwrap();
        for pos in 0..len {
            let (k, v) = (random(&mut rng, kv_dim, 1.0), random(&mut rng, kv_dim, 1.0));
            g.set_pos(&mut at, pos).unwrap();
            g.kv_store(
                &g.upload(&k).unwrap(),
                &g.upload(&v).unwrap(),
                &mut kc,
                &mut vc,
                &at,
                kv_dim,
                f16,
                1,
            )
            .unwrap();
            // the twin sees what the cache holds: f16-rounded values for an f16 cache
            let round = |x: Vec<f32>| -> Vec<f32> {
                if !f16 {
                    return x;
                }
                let mut out = vec![0.0; x.len()];
                dequantize_row(DType::F16, &quantize_row(DType::F16, &x), &mut out);
                out
            };
            ks.extend(round(k));
            vs.extend(round(v));
        }
        let q = random(&mut rng, n_head * hd, 1.0);
        // plain; Gemma's: another scale, soft-capped scores, a sliding window shorter than the
        // context (and one longer)
        let plain = AttnShape {
            n_ctx,
            n_head,
            n_head_kv,
            head_dim: hd,
            scale: 1.0 / (hd as f32).sqrt(),
            softcap: 0.0,
            window: 0,
        };
        // gpt-oss's sinks: logits around the scores', some far above them
        let sink_logits: Vec<f32> = (0..n_head)
            .map(|h| if h % 5 == 4 { 30.0 } else { 2.0 * rng.next_f32() - 1.0 })
            .collect();
        let dsinks = g.upload(&sink_logits).unwrap();
        for (at_shape, sinks) in [
            (plain, false),
            (AttnShape { scale: 0.0625, softcap: 2.0, window: 100, ..plain }, false),
            (AttnShape { window: 1000, ..plain }, false),
            (AttnShape { window: 100, ..plain }, true),
        ] {
            let mut scores = poisoned(&g, n_head * n_ctx);
            let mut dout = poisoned(&g, n_head * hd);
            g.attention(
                &g.upload(&q).unwrap(),
                &kc,
                &vc,
                &mut scores,
                &mut dout,
                &at,
                &at_shape,
                sinks.then_some(&dsinks),
                f16,
                1,
            )
            .unwrap();
            let mut got = vec![0.0; n_head * hd];
            g.read(&dout, &mut got).unwrap();
            let want =
                twin::attention(&q, &ks, &vs, len, &at_shape, sinks.then_some(&sink_logits[..]));
            assert!(rel_err(&got, &want) < 1e-5, "attention f16={f16} {at_shape:?} sinks={sinks}");
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: cargo test -- --ignored"]
fn kv_store_past_the_cache_is_an_error() {
    let g = gpu();
    let mut kc = g.zeros::<u8>(4 * 8 * 4).unwrap();
    let mut vc = g.zeros::<u8>(4 * 8 * 4).unwrap();
    let k = g.upload(&[1.0f32; 8]).unwrap();
    let mut at = g.pos().unwrap();
    g.set_pos(&mut at, 4).unwrap();
    assert!(g.kv_store(&k, &k, &mut kc, &mut vc, &at, 8, false, 1).is_err());
}

/// A recorded sequence (kv_store, attention, then a matvec of its output) replayed at later
/// positions computes what the kernels launched one by one compute there: the position is
/// read on the device, and the recording holds buffers, not values.
#[test]
#[ignore = "needs an NVIDIA GPU: cargo test -- --ignored"]
fn a_recorded_token_replays_at_every_position() {
    let g = gpu();
    let mut rng = Rng::new(5);
    let (n_head, n_head_kv, hd, n_ctx) = (4, 2, 32, 64);
    let kv_dim = n_head_kv * hd;
    let wdata = matrix(&mut rng, DType::F32, 48, n_head * hd);
    let w = QMatrix { dtype: DType::F32, rows: 48, cols: n_head * hd, data: &wdata };
    let dw = g.upload_rows(&w, None).unwrap();
    let (mut kc, mut vc) =
        (g.zeros::<u8>(n_ctx * kv_dim * 4).unwrap(), g.zeros::<u8>(n_ctx * kv_dim * 4).unwrap());
    let (mut dk, mut dv, mut dq) = (
        g.zeros::<f32>(kv_dim).unwrap(),
        g.zeros::<f32>(kv_dim).unwrap(),
        g.zeros::<f32>(n_head * hd).unwrap(),
    );
    let (mut scores, mut att, mut y) = (
        g.zeros::<f32>(n_head * n_ctx).unwrap(),
        g.acts(n_head * hd).unwrap(),
        g.zeros::<f32>(48).unwrap(),
    );
    let shape = AttnShape {
        n_ctx,
        n_head,
        n_head_kv,
        head_dim: hd,
        scale: 1.0 / (hd as f32).sqrt(),
        softcap: 0.0,
        window: 0,
    };
    let mut at = g.pos().unwrap();
    let (mut ks, mut vs) = (Vec::new(), Vec::new());
    let mut graph = None;
    for pos in 0..40 {
        let (k, v, q) = (
            random(&mut rng, kv_dim, 1.0),
            random(&mut rng, kv_dim, 1.0),
            random(&mut rng, n_head * hd, 1.0),
        );
        g.write(&k, &mut dk).unwrap();
        g.write(&v, &mut dv).unwrap();
        g.write(&q, &mut dq).unwrap();
        g.set_pos(&mut at, pos).unwrap();
        ks.extend(&k);
        vs.extend(&v);
        match &graph {
            // position 3 is recorded (its launches run only as the first replay)
            None if pos == 3 => {
                assert!(g.begin_capture().unwrap());
                g.kv_store(&dk, &dv, &mut kc, &mut vc, &at, kv_dim, false, 1).unwrap();
                g.attention(&dq, &kc, &vc, &mut scores, &mut att.f32s, &at, &shape, None, false, 1)
                    .unwrap();
                g.matvec(&dw, &att, None, &mut y, false, 1).unwrap();
                let recorded = g.end_capture().unwrap();
                g.launch_graph(&recorded).unwrap();
                graph = Some(recorded);
            }
            None => {
                g.kv_store(&dk, &dv, &mut kc, &mut vc, &at, kv_dim, false, 1).unwrap();
                g.attention(&dq, &kc, &vc, &mut scores, &mut att.f32s, &at, &shape, None, false, 1)
                    .unwrap();
                g.matvec(&dw, &att, None, &mut y, false, 1).unwrap();
            }
            Some(recorded) => g.launch_graph(recorded).unwrap(),
        }
        let mut got = vec![0.0; 48];
        g.read(&y, &mut got).unwrap();
        let want =
            twin::matvec(&w, &twin::attention(&q, &ks, &vs, pos + 1, &shape, None), None, false);
        assert!(rel_err(&got, &want) < 1e-5, "position {pos}");
    }
}

/// Every kernel that takes batch rows computes, for m rows at once, bit for bit what it
/// computes for each row alone: norms, q/k/v, RoPE at each row's angles, the KV store and
/// attention at consecutive positions, the FFN's hot rows (with each row's predictor logits
/// too), its down rows, and a split's neuron-major down partial sums merged with each row's
/// CPU part.
#[test]
#[ignore = "needs an NVIDIA GPU: cargo test -- --ignored"]
fn batch_rows_equal_rows_one_at_a_time() {
    let g = gpu();
    let mut rng = Rng::new(11);
    let (n_embd, n_ff, n_head, n_head_kv, hd, n_ctx, m) = (256, 512, 4, 2, 64, 64, 5);
    let (q_dim, kv_dim, half) = (n_head * hd, n_head_kv * hd, hd / 2);
    for dtype in [DType::F32, DType::Q4_K, DType::Q8_0] {
        let mat = |rng: &mut Rng, rows, cols| matrix(rng, dtype, rows, cols);
        let (wq, wk, wv, up, down, down_t) = (
            mat(&mut rng, q_dim, n_embd),
            mat(&mut rng, kv_dim, n_embd),
            mat(&mut rng, kv_dim, n_embd),
            mat(&mut rng, n_ff, n_embd),
            mat(&mut rng, n_embd, n_ff),
            mat(&mut rng, n_ff, n_embd),
        );
        let qm = |rows, cols, data| QMatrix { dtype, rows, cols, data };
        let dwq = g.upload_rows(&qm(q_dim, n_embd, &wq), None).unwrap();
        let dwk = g.upload_rows(&qm(kv_dim, n_embd, &wk), None).unwrap();
        let dwv = g.upload_rows(&qm(kv_dim, n_embd, &wv), None).unwrap();
        let dup = g.upload_rows(&qm(n_ff, n_embd, &up), None).unwrap();
        let ddown = g.upload_rows(&qm(n_embd, n_ff, &down), None).unwrap();
        // a split's hot half: every other neuron, its down rows neuron-major
        let half_ids: Vec<u32> = (0..n_ff as u32).step_by(2).collect();
        let dup_half = g.upload_rows(&qm(n_ff, n_embd, &up), Some(&half_ids)).unwrap();
        let ddown_t = g.upload_rows(&qm(n_ff, n_embd, &down_t), Some(&half_ids)).unwrap();
        let half_bucket =
            g.upload(&half_ids.iter().map(|&j| j as i32).collect::<Vec<_>>()).unwrap();
        let logits = random(&mut rng, m * n_ff, 1.0);
        let cpu_part = random(&mut rng, m * n_embd, 1.0);
        let merge_bias = g.upload(&random(&mut rng, n_embd, 1.0)).unwrap();
        let bucket = g.upload(&(0..n_ff as i32).collect::<Vec<_>>()).unwrap();
        let norm_w = g.upload(&random(&mut rng, n_embd, 1.0)).unwrap();
        let x = random(&mut rng, m * n_embd, 1.0);
        let angles: Vec<f32> = (0..m * half).map(|i| (i as f32 * 0.37).sin()).collect();
        let cos = g.upload(&angles.iter().map(|a| a.cos()).collect::<Vec<_>>()).unwrap();
        let sin = g.upload(&angles.iter().map(|a| a.sin()).collect::<Vec<_>>()).unwrap();
        let shape = AttnShape {
            n_ctx,
            n_head,
            n_head_kv,
            head_dim: hd,
            scale: 0.125,
            softcap: 0.0,
            window: 3,
        };
        let first = 7; // the rows' first position (the cache already holds 0..7)

        // one layer's worth of the kernels over `rows` rows starting at row r0
        let run = |r0: usize,
                   rows: usize,
                   kc: &mut cudarc::driver::CudaSlice<u8>,
                   vc: &mut cudarc::driver::CudaSlice<u8>|
         -> Vec<Vec<f32>> {
            let dx = g.upload(&x[r0 * n_embd..(r0 + rows) * n_embd]).unwrap();
            let mut xb = g.acts(rows * n_embd).unwrap();
            g.rmsnorm(&dx, &norm_w, &mut xb, n_embd, 1e-5, Gpu::any_quantized(&[&dwq]), rows)
                .unwrap();
            g.quantize_for(&[&dwq], &mut xb, rows * n_embd).unwrap();
            let (mut q, mut k, mut v) = (
                g.zeros::<f32>(rows * q_dim).unwrap(),
                g.zeros::<f32>(rows * kv_dim).unwrap(),
                g.zeros::<f32>(rows * kv_dim).unwrap(),
            );
            g.matvec3([&dwq, &dwk, &dwv], &xb, [None, None, None], [&mut q, &mut k, &mut v], rows)
                .unwrap();
            let (mut c, mut s_) =
                (g.zeros::<f32>(rows * half).unwrap(), g.zeros::<f32>(rows * half).unwrap());
            g.copy(&cos, r0 * half, &mut c, 0, rows * half).unwrap();
            g.copy(&sin, r0 * half, &mut s_, 0, rows * half).unwrap();
            g.rope(&mut q, &mut k, &c, &s_, n_head, n_head_kv, hd, hd, true, rows).unwrap();
            let mut at = g.pos().unwrap();
            g.set_pos(&mut at, first + r0).unwrap();
            g.kv_store(&k, &v, kc, vc, &at, kv_dim, false, rows).unwrap();
            let mut scores = g.zeros::<f32>(rows * n_head * n_ctx).unwrap();
            let mut att = g.acts(rows * q_dim).unwrap();
            g.attention(&q, kc, vc, &mut scores, &mut att.f32s, &at, &shape, None, false, rows)
                .unwrap();
            let mut h = g.acts(rows * n_ff).unwrap();
            g.ffn_hot(
                None,
                &dup,
                &bucket,
                &xb,
                [None, None],
                None,
                0.0,
                None,
                FfnActivation::Relu,
                &mut h.f32s,
                rows,
            )
            .unwrap();
            g.quantize_for(&[&ddown], &mut h, rows * n_ff).unwrap();
            let mut y = g.zeros::<f32>(rows * n_embd).unwrap();
            g.matvec(&ddown, &h, None, &mut y, false, rows).unwrap();
            // the split: hot rows gated by each row's predictor logits, their partial sums
            // merged into each row's residual with its CPU part and the bias
            let row_logits = g.upload(&logits[r0 * n_ff..(r0 + rows) * n_ff]).unwrap();
            let n_hot = half_ids.len();
            let mut hp = g.acts(rows * n_hot).unwrap();
            g.ffn_hot(
                None,
                &dup_half,
                &half_bucket,
                &xb,
                [None, None],
                Some((&row_logits, n_ff)),
                0.3,
                None,
                FfnActivation::Relu,
                &mut hp.f32s,
                rows,
            )
            .unwrap();
            let per_row = n_hot.div_ceil(powerinfer_cuda::gpu::ROWS_PER_CHUNK) * n_embd;
            let mut partial = poisoned(&g, rows * per_row);
            let chunks = g.down_partial(&ddown_t, &hp.f32s, &mut partial, rows).unwrap();
            let mut res = g.upload(&x[r0 * n_embd..(r0 + rows) * n_embd]).unwrap();
            let cpu = g.upload(&cpu_part[r0 * n_embd..(r0 + rows) * n_embd]).unwrap();
            g.ffn_merge(&mut res, &partial, chunks, Some(&cpu), Some(&merge_bias), n_embd, rows)
                .unwrap();
            let read = |b: &cudarc::driver::CudaSlice<f32>, n: usize| {
                let mut out = vec![0.0; n];
                g.read(b, &mut out).unwrap();
                out
            };
            vec![
                read(&xb.f32s, rows * n_embd),
                read(&q, rows * q_dim),
                read(&k, rows * kv_dim),
                read(&att.f32s, rows * q_dim),
                read(&h.f32s, rows * n_ff),
                read(&y, rows * n_embd),
                read(&hp.f32s, rows * n_hot),
                read(&res, rows * n_embd),
            ]
        };
        let prefix = random(&mut rng, first * kv_dim, 1.0);
        let fresh_cache = || {
            let mut c = g.zeros::<u8>(n_ctx * kv_dim * 4).unwrap();
            let bytes: Vec<u8> = prefix.iter().flat_map(|v| v.to_le_bytes()).collect();
            g.copy(&g.upload(&bytes).unwrap(), 0, &mut c, 0, bytes.len()).unwrap();
            c
        };
        let (mut kc, mut vc) = (fresh_cache(), fresh_cache());
        let all = run(0, m, &mut kc, &mut vc);
        let (mut kc1, mut vc1) = (fresh_cache(), fresh_cache());
        let one: Vec<Vec<Vec<f32>>> = (0..m).map(|r| run(r, 1, &mut kc1, &mut vc1)).collect();
        let names = ["norm", "q", "k", "attention", "hot", "down", "predicted hot", "merged"];
        for (i, name) in names.iter().enumerate() {
            let joined: Vec<f32> = one.iter().flat_map(|o| o[i].iter().copied()).collect();
            assert_eq!(all[i], joined, "{dtype:?} {name}");
        }
    }
}

/// A token's experts in one launch each (`experts_hot`, `experts_down`) compute bit for bit
/// what each expert's own launches compute (`ffn_hot` over all its rows, `matvec_at` into its
/// slot), and write nothing outside the slots.
#[test]
#[ignore = "needs an NVIDIA GPU: cargo test -- --ignored"]
fn experts_in_one_launch_equal_one_launch_each() {
    let g = gpu();
    let mut rng = Rng::new(21);
    let (n_embd, n_ff, n_slots) = (256, 512, 3);
    for dtype in [DType::Q4_K, DType::Q8_0, DType::F16, DType::MXFP4] {
        let experts: Vec<[DMat<Cuda>; 3]> = (0..n_slots)
            .map(|_| {
                let (gd, ud, dd) = (
                    matrix(&mut rng, dtype, n_ff, n_embd),
                    matrix(&mut rng, dtype, n_ff, n_embd),
                    matrix(&mut rng, dtype, n_embd, n_ff),
                );
                let qm = |rows, cols, data| QMatrix { dtype, rows, cols, data };
                [
                    g.upload_rows(&qm(n_ff, n_embd, &gd), None).unwrap(),
                    g.upload_rows(&qm(n_ff, n_embd, &ud), None).unwrap(),
                    g.upload_rows(&qm(n_embd, n_ff, &dd), None).unwrap(),
                ]
            })
            .collect();
        let x = random(&mut rng, n_embd, 1.0);
        let dx = device_acts(&g, &x, &experts[0][1]);
        // slots 2, 0 and 3 of a 5-slot output: outputs land where `at` says, in any order
        let at: Vec<usize> = [2, 0, 3].iter().map(|s| s * n_embd).collect();
        let act = FfnActivation::SwiGlu;

        let mut h = g.acts(n_slots * n_ff).unwrap();
        let (gates, ups, downs): (Vec<_>, Vec<_>, Vec<_>) = (
            experts.iter().map(|e| &e[0]).collect(),
            experts.iter().map(|e| &e[1]).collect(),
            experts.iter().map(|e| &e[2]).collect(),
        );
        g.experts_hot(&gates, &ups, &dx, act, &mut h.f32s).unwrap();
        g.quantize_for(&downs[..1], &mut h, n_slots * n_ff).unwrap();
        let mut ys = g.upload(&vec![7.0f32; 5 * n_embd]).unwrap();
        g.experts_down(&downs, &h, &mut ys, &at).unwrap();
        let mut got_h = vec![0.0; n_slots * n_ff];
        g.read(&h.f32s, &mut got_h).unwrap();
        let mut got = vec![0.0; 5 * n_embd];
        g.read(&ys, &mut got).unwrap();

        let rows = g.upload(&(0..n_ff as i32).collect::<Vec<_>>()).unwrap();
        let mut want = vec![7.0f32; 5 * n_embd];
        for (s, e) in experts.iter().enumerate() {
            let mut h1 = g.acts(n_ff).unwrap();
            g.ffn_hot(
                Some(&e[0]),
                &e[1],
                &rows,
                &dx,
                [None, None],
                None,
                0.0,
                None,
                act,
                &mut h1.f32s,
                1,
            )
            .unwrap();
            let mut one_h = vec![0.0; n_ff];
            g.read(&h1.f32s, &mut one_h).unwrap();
            assert_eq!(&got_h[s * n_ff..(s + 1) * n_ff], &one_h[..], "{dtype:?} slot {s} h");
            g.quantize_for(&[&e[2]], &mut h1, n_ff).unwrap();
            let mut y1 = g.zeros::<f32>(5 * n_embd).unwrap();
            g.matvec_at(&e[2], &h1, None, &mut y1, at[s], false, 1).unwrap();
            let mut one = vec![0.0; 5 * n_embd];
            g.read(&y1, &mut one).unwrap();
            want[at[s]..at[s] + n_embd].copy_from_slice(&one[at[s]..at[s] + n_embd]);
        }
        assert_eq!(got, want, "{dtype:?}");
    }
}
