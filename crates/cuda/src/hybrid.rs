//! The hybrid backend: PowerInfer's split of each FFN between the GPU (hot neurons) and the
//! CPU (cold neurons), one token at a time, as a backend of the one forward pass
//! (`powerinfer_core::forward`).
//!
//! `HybridModel` uploads what the placement put on the GPU, once: per layer the attention
//! weights, norms and predictor, and the gate/up/down_t rows of the hot neurons, packed in
//! `gpu_bucket` order (row i of the packed matrices is neuron bucket[i]). Layers whose dense
//! part is not on the GPU run wholly on the CPU (this is also how a layer-offload baseline is
//! expressed: all neurons of the first k layers on the GPU, nothing of the others).
//!
//! `HybridPass` runs each step of a GPU layer as device kernels and any other step as the CPU
//! backend's (`CpuPass`) step over the session's CPU state. The FFN of a GPU layer:
//!   GPU: predictor (reads the residual x)
//!   host <- GPU: the normed FFN input and the predictor logits (only if the layer has cold neurons)
//!   GPU (queued, runs while the CPU works): hot rows -> h, h x down_t -> partial sums
//!   CPU: the selected cold neurons, through the same sparse operator as CPU-only decoding
//!   GPU, as the residual step: x += partial sums + CPU part + bias
//! Weights never move during decoding; only activations (a few KB per layer) cross the bus.

use std::sync::{Arc, Mutex};

use powerinfer_core::attention::KvType;
use powerinfer_core::forward::{forward, Backend, Norm, Part};
use powerinfer_core::matmul::{Activations, QMatrix};
use powerinfer_core::model::{Family, FfnActivation, Model, RopeStyle, RouterInput};
use powerinfer_core::quant::DType;
use powerinfer_core::session::{softcap, CpuPass, FfnStats, Session, Sparsity, SparsityMode};
use powerinfer_core::sparse::{sparse_ffn, FfnMats, SparseScratch};
use powerinfer_core::Result as CoreResult;

use crate::device::{Buf, Device};
use crate::gpu::{AttnShape, DActs, DMat, DevicePos, Gpu, Result, ROWS_PER_CHUNK};
use crate::CudaError;

/// What goes to the GPU (from a `.gpuidx` placement, or a layer-offload split).
#[derive(Debug, Clone)]
pub struct GpuPlan {
    /// Per layer: attention, norms and predictor on the GPU; otherwise the whole layer runs on
    /// the CPU and its neuron mask is ignored.
    pub dense_on_gpu: Vec<bool>,
    /// Per layer, per neuron: its gate, up and down rows on the GPU.
    pub neuron_on_gpu: Vec<Vec<bool>>,
    /// Final norm and classifier on the GPU.
    pub output_on_gpu: bool,
    /// Mixture-of-experts models: per layer, per expert, its gate, up and down matrices on the
    /// GPU (only in layers whose dense part is there); empty: every expert on the CPU.
    pub expert_on_gpu: Vec<Vec<bool>>,
}

impl GpuPlan {
    /// Everything on the GPU.
    pub fn full(n_layer: usize, n_ff: usize) -> GpuPlan {
        GpuPlan {
            dense_on_gpu: vec![true; n_layer],
            neuron_on_gpu: vec![vec![true; n_ff]; n_layer],
            output_on_gpu: true,
            expert_on_gpu: Vec::new(),
        }
    }

    /// llama.cpp's `-ngl`: the first `k` layers wholly on the GPU, the others wholly on the CPU.
    pub fn layer_offload(n_layer: usize, n_ff: usize, k: usize, output_on_gpu: bool) -> GpuPlan {
        GpuPlan {
            dense_on_gpu: (0..n_layer).map(|l| l < k).collect(),
            neuron_on_gpu: (0..n_layer).map(|l| vec![l < k; n_ff]).collect(),
            output_on_gpu,
            expert_on_gpu: Vec::new(),
        }
    }
}

/// The neurons of one layer split by a GPU mask: (hot = the GPU bucket, cold), both ascending.
pub fn split_neurons(on_gpu: &[bool]) -> (Vec<u32>, Vec<u32>) {
    let hot = (0..on_gpu.len() as u32).filter(|&j| on_gpu[j as usize]).collect();
    let cold = (0..on_gpu.len() as u32).filter(|&j| !on_gpu[j as usize]).collect();
    (hot, cold)
}

/// What went where, for `Engine` to report.
#[derive(Debug, Clone, Default)]
pub struct PlacementReport {
    pub gpu_name: String,
    pub gpu_total_memory: usize,
    /// Weight bytes uploaded (dense tensors plus hot neuron rows).
    pub weight_bytes: usize,
    /// Of those, the hot neurons' gate/up/down rows.
    pub neuron_bytes: usize,
    pub layers_on_gpu: usize,
    pub n_layer: usize,
    pub hot_neurons: usize,
    pub total_neurons: usize,
    /// Mixture-of-experts models: experts on the GPU, of n_layer * n_expert.
    pub hot_experts: usize,
    pub total_experts: usize,
    pub output_on_gpu: bool,
    /// The most prompt tokens a pass evaluates (`PROMPT_ROWS`; a session at a long context
    /// takes fewer, see `session_rows`).
    pub prompt_rows: usize,
}

struct DenseGpu<D: Device> {
    attn_norm: Buf<D, f32>,
    q_norm: Option<Buf<D, f32>>, // (head_dim) Qwen 3, Gemma 3
    k_norm: Option<Buf<D, f32>>,
    attn_post_norm: Option<Buf<D, f32>>, // (n_embd) Gemma 2, 3
    ffn_post_norm: Option<Buf<D, f32>>,
    wq: DMat<D>,
    wk: DMat<D>,
    wv: DMat<D>,
    wo: DMat<D>,
    bq: Option<Buf<D, f32>>,
    bk: Option<Buf<D, f32>>,
    bv: Option<Buf<D, f32>>,
    bo: Option<Buf<D, f32>>,
    attn_sinks: Option<Buf<D, f32>>, // (n_head) gpt-oss
    ffn_norm: Buf<D, f32>,
    predictor: Option<(DMat<D>, DMat<D>)>, // fc1 (hidden, n_embd), fc2 (n_ff, hidden)
}

struct HotGpu<D: Device> {
    bucket: Buf<D, i32>,   // (n_hot) neuron ids of the packed rows
    gate: Option<DMat<D>>, // (n_hot, n_embd)
    up: DMat<D>,           // (n_hot, n_embd)
    down: HotDown<D>,
    up_bias: Option<Buf<D, f32>>, // (n_ff)
}

/// The down projection of a layer's hot neurons on the device.
enum HotDown<D: Device> {
    /// Neuron-major rows (n_hot, n_embd), summed by `down_partial` for the neurons that fire.
    Columns(DMat<D>),
    /// A plain file's own `ffn_down` (n_embd, n_ff) in its type, where every neuron of the layer
    /// is on the device: one matvec of the int8-rounded h, as the CPU's dense FFN computes it,
    /// reading the file's bytes rather than an F16 copy of them (4x fewer for 4-bit types).
    Rows(DMat<D>),
}

struct GpuLayer<D: Device> {
    dense: DenseGpu<D>,
    hot: Option<HotGpu<D>>,
    /// `ffn_down.bias` (n_embd), added once when the FFN parts merge, whether the layer has hot
    /// neurons or not.
    down_bias: Option<Buf<D, f32>>,
    n_hot: usize,
    /// Neurons computed on the CPU, ascending.
    cold: Vec<u32>,
    /// For a plain quantized file: the CPU's neuron-major down rows (n_ff, n_embd) in F16 (see
    /// `exact_down_t`); None reads the model's own `down_t`.
    cold_down_t: Option<Vec<u8>>,
    /// A mixture-of-experts layer's experts on the device (see `GpuExperts`).
    experts: Option<GpuExperts<D>>,
}

/// A mixture-of-experts layer on the device. The router's product runs on the device, the
/// choice on the CPU, which reads the device's normed FFN input (or its layer input): per row
/// it picks the experts, the device runs each row's shared expert and the chosen ones it holds
/// (queued, a row at a time), the CPU the others meanwhile (all rows in one pass, each chosen
/// expert's weights read once), and the CPU sums every chosen expert's output in expert order
/// (the device's read back into their slots) and the shared one's times its gate, as the CPU
/// alone sums them; the sum joins the residual on the device as a cold part does.
struct GpuExperts<D: Device> {
    /// Per expert: whether the device holds it.
    on_gpu: Vec<bool>,
    /// Per expert: its gate, up (n_ff_exp, n_embd) and down (n_embd, n_ff_exp) on the device.
    mats: Vec<Option<[DMat<D>; 3]>>,
    /// Per expert on the device, where the layer has biases (gpt-oss): its gate's, up's
    /// (n_ff_exp) and down's (n_embd).
    biases: Vec<Option<[Buf<D, f32>; 3]>>,
    /// The router's bias (n_expert), added to the logits on the device.
    router_bias: Option<Buf<D, f32>>,
    /// 0..n_ff_exp: every row of an expert, as `ffn_hot`'s bucket.
    rows: Buf<D, i32>,
    /// The shared expert's gate, up (n_ff_shared, n_embd) and down (n_embd, n_ff_shared), and
    /// its bucket 0..n_ff_shared, where the layer has one and the device has kernels for its
    /// types (its scalar gate, sigmoid(gate_inp . xb), stays on the CPU).
    shared: Option<([DMat<D>; 3], Buf<D, i32>)>,
    /// The router (n_expert, n_embd), where the device has kernels for its type: its logits
    /// (n_expert floats) come back to the host, which picks the experts.
    router: Option<DMat<D>>,
}

pub struct HybridModel<D: Device> {
    pub model: Arc<Model>,
    pub gpu: Gpu<D>,
    layers: Vec<Option<GpuLayer<D>>>,
    output: Option<(Buf<D, f32>, DMat<D>)>,
    pub report: PlacementReport,
    /// Every layer and the classifier wholly on the device: a token's kernels need nothing from
    /// the host between its embedding and its logits, so sessions record them once as a graph
    /// and replay it for every later token (one launch instead of ~17 per layer).
    graphable: bool,
    /// Held by a session for each token: sessions share the device's one stream, and a
    /// recording must not take in another session's launches.
    step_lock: Mutex<()>,
}

/// Prompt tokens per pass: a session's device buffers hold this many rows (the
/// largest are the attention scores, rows * n_head * n_ctx floats, and a split's hot partial
/// sums, rows * n_hot / ROWS_PER_CHUNK * n_embd: 71 MB at 13B's shape with every neuron hot,
/// outside the placement's budget as the other activations are). A session whose scores would
/// take more than `PROMPT_SCORES_BYTES` takes fewer rows (`session_rows`).
pub const PROMPT_ROWS: usize = 32;

/// The most device memory a session's attention scores take over its batch rows: 16 rows at
/// n_ctx 32768 with 32 heads, 2 at 131072 with 64.
pub const PROMPT_SCORES_BYTES: usize = 128 << 20;

/// Batch rows of a session with `n_head` heads and `n_ctx` positions:
/// `PROMPT_ROWS`, fewer where their attention scores would outgrow `PROMPT_SCORES_BYTES`.
pub fn session_rows(n_head: usize, n_ctx: usize) -> usize {
    (PROMPT_SCORES_BYTES / (n_head * n_ctx * 4).max(1)).clamp(1, PROMPT_ROWS)
}

fn upload_opt<D: Device>(
    gpu: &Gpu<D>,
    v: Option<&Vec<f32>>,
    bytes: &mut usize,
) -> Result<Option<Buf<D, f32>>> {
    v.map(|v| {
        *bytes += v.len() * 4;
        gpu.upload(v)
    })
    .transpose()
}

/// Why the GPU executor cannot run this model (in this sparsity mode, when given), or None.
/// The one statement of what the GPU supports: `HybridModel::new` and `set_sparsity` refuse
/// with it, and Python asks it before planning a placement.
pub fn unsupported_reason(model: &Model, mode: Option<SparsityMode>) -> Option<String> {
    let c = &model.config;
    if c.family != Family::Llama {
        return Some(format!(
            "the GPU executor runs LLaMA-family models; {} runs on the CPU",
            c.architecture
        ));
    }
    let w = &model.weights;
    let mut mats = vec![&w.output];
    for lw in &w.layers {
        mats.extend([&lw.wq, &lw.wk, &lw.wv, &lw.wo]);
        mats.extend(lw.ffn_up.iter());
        mats.extend(lw.ffn_gate.iter().chain(lw.ffn_down.iter()).chain(lw.ffn_down_t.iter()));
        mats.extend(lw.predictor.iter().flat_map(|p| [&p.fc1, &p.fc2]));
    }
    if let Some(m) = mats.iter().find(|m| crate::gpu::type_slot(m.dtype).is_err()) {
        return Some(format!(
            "the GPU executor has no kernel for {:?} weights; this model runs on the CPU",
            m.dtype
        ));
    }
    if mode == Some(SparsityMode::Threshold) {
        return Some(THRESHOLD_IS_CPU_ONLY.into());
    }
    None
}

const THRESHOLD_IS_CPU_ONLY: &str =
    "threshold sparsity runs on the CPU only; use 'predictor' or 'dense' on the GPU";

/// A plain file's row-major `ffn_down` (n_embd, n_ff) as neuron-major rows (n_ff, n_embd) in
/// F16. The engine's own neuron-major copy of a quantized `ffn_down` is Q8_0 (compact, for the
/// CPU's sparse modes), re-quantized across the other axis: on SmolLM2 that alone moves the
/// logits 3.8% (mean, relative) from the file's float64 function, where F16 keeps them within
/// 0.03%. The hybrid executor computes the dense function, so both its sides read this copy.
fn exact_down_t(down: &QMatrix) -> Vec<u8> {
    let mut out = vec![0u8; down.cols * DType::F16.row_bytes(down.rows)];
    down.transpose_into(DType::F16, &mut out);
    out
}

impl<D: Device> HybridModel<D> {
    pub fn new(model: Arc<Model>, gpu: Gpu<D>, plan: &GpuPlan) -> Result<HybridModel<D>> {
        let c = &model.config;
        if let Some(why) = unsupported_reason(&model, None) {
            return Err(CudaError::Unsupported(why));
        }
        if plan.dense_on_gpu.len() != c.n_layer || plan.neuron_on_gpu.len() != c.n_layer {
            return Err(CudaError::Plan(format!(
                "the placement has {} layers, the model {}",
                plan.neuron_on_gpu.len(),
                c.n_layer
            )));
        }
        if let Some((l, m)) = plan.neuron_on_gpu.iter().enumerate().find(|(_, m)| m.len() != c.n_ff)
        {
            return Err(CudaError::Plan(format!(
                "layer {l} of the placement has {} neurons, the model {}",
                m.len(),
                c.n_ff
            )));
        }
        if !plan.expert_on_gpu.is_empty() {
            let n_expert = c.moe.map_or(0, |m| m.n_expert);
            if plan.expert_on_gpu.len() != c.n_layer {
                return Err(CudaError::Plan(format!(
                    "the expert placement has {} layers, the model {}",
                    plan.expert_on_gpu.len(),
                    c.n_layer
                )));
            }
            if let Some((l, e)) =
                plan.expert_on_gpu.iter().enumerate().find(|(_, e)| e.len() != n_expert)
            {
                return Err(CudaError::Plan(format!(
                    "layer {l} of the expert placement has {} experts, the model {n_expert}",
                    e.len()
                )));
            }
            if let Some(l) = (0..c.n_layer)
                .find(|&l| !plan.dense_on_gpu[l] && plan.expert_on_gpu[l].iter().any(|&on| on))
            {
                return Err(CudaError::Plan(format!(
                    "layer {l} places experts on the GPU but not its attention: experts run on the \
                     GPU only in layers whose dense part is there"
                )));
            }
        }
        let mut report = PlacementReport {
            gpu_name: gpu.name.clone(),
            gpu_total_memory: gpu.total_memory,
            n_layer: c.n_layer,
            total_neurons: c.n_layer * c.n_ff,
            total_experts: c.n_layer * c.moe.map_or(0, |m| m.n_expert),
            ..Default::default()
        };
        let mut layers = Vec::with_capacity(c.n_layer);
        for (l, lw) in model.weights.layers.iter().enumerate() {
            if !plan.dense_on_gpu[l] {
                layers.push(None);
                continue;
            }
            let mut bytes = 0;
            let mut mat = |m, rows: Option<&[u32]>| -> Result<DMat<D>> {
                let d = gpu.upload_rows(m, rows)?;
                bytes += d.bytes();
                Ok(d)
            };
            let (wq, wk, wv, wo) =
                (mat(&lw.wq, None)?, mat(&lw.wk, None)?, mat(&lw.wv, None)?, mat(&lw.wo, None)?);
            let predictor = match &lw.predictor {
                Some(p) => Some((mat(&p.fc1, None)?, mat(&p.fc2, None)?)),
                None => None,
            };
            let ffn_norm = lw.ffn_norm.as_ref().expect("LLaMA-family layers have an FFN norm");
            let dense = DenseGpu {
                attn_norm: gpu.upload(&lw.attn_norm)?,
                q_norm: upload_opt(&gpu, lw.q_norm.as_ref(), &mut bytes)?,
                k_norm: upload_opt(&gpu, lw.k_norm.as_ref(), &mut bytes)?,
                attn_post_norm: upload_opt(&gpu, lw.attn_post_norm.as_ref(), &mut bytes)?,
                ffn_post_norm: upload_opt(&gpu, lw.ffn_post_norm.as_ref(), &mut bytes)?,
                ffn_norm: gpu.upload(ffn_norm)?,
                wq,
                wk,
                wv,
                wo,
                bq: upload_opt(&gpu, lw.bq.as_ref(), &mut bytes)?,
                bk: upload_opt(&gpu, lw.bk.as_ref(), &mut bytes)?,
                bv: upload_opt(&gpu, lw.bv.as_ref(), &mut bytes)?,
                bo: upload_opt(&gpu, lw.bo.as_ref(), &mut bytes)?,
                attn_sinks: upload_opt(&gpu, lw.attn_sinks.as_ref(), &mut bytes)?,
                predictor,
            };
            bytes += 2 * c.n_embd * 4;

            if let Some(mw) = &lw.moe {
                if plan.neuron_on_gpu[l].iter().any(|&on| on) {
                    return Err(CudaError::Plan(format!(
                        "layer {l} is a mixture of experts: its FFN has no neurons to place on the GPU"
                    )));
                }
                let n_expert = mw.n_expert();
                let on_gpu = plan.expert_on_gpu.get(l).cloned().unwrap_or(vec![false; n_expert]);
                let before = bytes;
                let mats = (0..n_expert)
                    .map(|e| {
                        if !on_gpu[e] {
                            return Ok(None);
                        }
                        let ex = mw.expert(e);
                        let m = [
                            gpu.upload_rows(&ex.gate, None)?,
                            gpu.upload_rows(&ex.up, None)?,
                            gpu.upload_rows(&ex.down, None)?,
                        ];
                        bytes += m.iter().map(|d| d.bytes()).sum::<usize>();
                        Ok(Some(m))
                    })
                    .collect::<Result<Vec<_>>>()?;
                let n_ff_exp = mw.gate_exps.rows / n_expert;
                let biases = (0..n_expert)
                    .map(|e| match (&mw.biases, on_gpu[e]) {
                        (Some(b), true) => {
                            let (ff, dim) = (n_ff_exp, c.n_embd);
                            bytes += 4 * (2 * ff + dim);
                            Ok(Some([
                                gpu.upload(&b.gate[e * ff..(e + 1) * ff])?,
                                gpu.upload(&b.up[e * ff..(e + 1) * ff])?,
                                gpu.upload(&b.down[e * dim..(e + 1) * dim])?,
                            ]))
                        }
                        _ => Ok(None),
                    })
                    .collect::<Result<Vec<_>>>()?;
                report.neuron_bytes += bytes - before;
                report.hot_experts += on_gpu.iter().filter(|&&on| on).count();
                let rows: Vec<i32> = (0..n_ff_exp as i32).collect();
                let router = match mw.router.dtype.traits().gpu {
                    true => Some(gpu.upload_rows(&mw.router, None)?),
                    false => None,
                };
                bytes += router.as_ref().map_or(0, |r| r.bytes());
                let router_bias = match (&router, &mw.biases) {
                    (Some(_), Some(b)) => upload_opt(&gpu, Some(&b.router), &mut bytes)?,
                    _ => None,
                };
                let shared = match &mw.shared {
                    Some(sh) if [sh.gate, sh.up, sh.down].iter().all(|m| m.dtype.traits().gpu) => {
                        let m = [
                            gpu.upload_rows(&sh.gate, None)?,
                            gpu.upload_rows(&sh.up, None)?,
                            gpu.upload_rows(&sh.down, None)?,
                        ];
                        bytes += m.iter().map(|d| d.bytes()).sum::<usize>();
                        let bucket: Vec<i32> = (0..sh.gate.rows as i32).collect();
                        Some((m, gpu.upload(&bucket)?))
                    }
                    _ => None,
                };
                report.weight_bytes += bytes;
                report.layers_on_gpu += 1;
                layers.push(Some(GpuLayer {
                    dense,
                    hot: None,
                    down_bias: None,
                    n_hot: 0,
                    cold: Vec::new(),
                    cold_down_t: None,
                    experts: Some(GpuExperts {
                        on_gpu,
                        mats,
                        biases,
                        router_bias,
                        rows: gpu.upload(&rows)?,
                        shared,
                        router,
                    }),
                }));
                continue;
            }
            let (hot_ids, cold) = split_neurons(&plan.neuron_on_gpu[l]);
            let down_rows = match (lw.ffn_down_t, lw.ffn_down) {
                // with a predictor, the neurons it skips are skipped in the down projection too
                (None, Some(down)) if cold.is_empty() && lw.predictor.is_none() => Some(down),
                _ => None,
            };
            let exact = match (lw.ffn_down_t, lw.ffn_down) {
                (None, Some(down)) if down.dtype.is_quantized() && down_rows.is_none() => {
                    Some(exact_down_t(&down))
                }
                _ => None,
            };
            let down_t = match &exact {
                Some(rows) => {
                    QMatrix { dtype: DType::F16, rows: c.n_ff, cols: c.n_embd, data: rows }
                }
                None => model.down_t(l),
            };
            let hot = if hot_ids.is_empty() {
                None
            } else {
                let before = bytes;
                let dense_up = lw.dense_up();
                let mut nmat = |m, rows: &[u32]| -> Result<DMat<D>> {
                    let d = gpu.upload_rows(m, Some(rows))?;
                    bytes += d.bytes();
                    Ok(d)
                };
                let gate = lw.ffn_gate.as_ref().map(|g| nmat(g, &hot_ids)).transpose()?;
                let up = nmat(&dense_up, &hot_ids)?;
                let down = match &down_rows {
                    Some(rows) => {
                        let d = gpu.upload_rows(rows, None)?;
                        bytes += d.bytes();
                        HotDown::Rows(d)
                    }
                    None => HotDown::Columns(nmat(&down_t, &hot_ids)?),
                };
                report.neuron_bytes += bytes - before;
                let bucket: Vec<i32> = hot_ids.iter().map(|&j| j as i32).collect();
                Some(HotGpu {
                    bucket: gpu.upload(&bucket)?,
                    gate,
                    up,
                    down,
                    up_bias: upload_opt(&gpu, lw.ffn_up_b.as_ref(), &mut bytes)?,
                })
            };
            let down_bias = upload_opt(&gpu, lw.ffn_down_b.as_ref(), &mut bytes)?;
            report.weight_bytes += bytes;
            report.layers_on_gpu += 1;
            report.hot_neurons += hot_ids.len();
            let cold_down_t = if cold.is_empty() { None } else { exact };
            layers.push(Some(GpuLayer {
                dense,
                hot,
                down_bias,
                n_hot: hot_ids.len(),
                cold,
                cold_down_t,
                experts: None,
            }));
        }
        let output = if plan.output_on_gpu {
            let w = gpu.upload_rows(&model.weights.output, None)?;
            report.weight_bytes += w.bytes() + c.n_embd * 4;
            Some((gpu.upload(&model.weights.output_norm)?, w))
        } else {
            None
        };
        report.output_on_gpu = output.is_some();
        gpu.synchronize()?;
        let graphable = output.is_some()
            && layers
                .iter()
                .all(|l| l.as_ref().is_some_and(|l| l.cold.is_empty() && l.experts.is_none()));
        report.prompt_rows = PROMPT_ROWS;
        Ok(HybridModel { model, gpu, layers, output, report, graphable, step_lock: Mutex::new(()) })
    }
}

/// Neurons computed on each side since the last `take_counts` (a layer without cold neurons
/// counts its predictor's selection on the GPU; the host reads the counts after the token).
#[derive(Debug, Clone, Copy, Default)]
pub struct SplitCounts {
    pub gpu_neurons: u64,
    pub cpu_neurons: u64,
}

/// One conversation on a `HybridModel`: a CPU `Session` (the token history, the sparsity
/// settings, the KV cache of the CPU layers, the CPU backend's scratch) and the device state.
pub struct HybridSession<D: Device> {
    hm: Arc<HybridModel<D>>,
    pub cpu: Session,
    dev: DeviceState<D>,
}

/// A hybrid session's device buffers (the GPU layers' KV cache, a pass's rows of activations)
/// and the host buffers of the CPU's share of a GPU layer's FFN.
struct DeviceState<D: Device> {
    n_ctx: usize,
    kv_f16: bool,
    k_cache: Vec<Option<Buf<D, u8>>>, // per GPU layer (n_ctx, kv_dim) f16 or f32
    v_cache: Vec<Option<Buf<D, u8>>>,
    // device activations
    /// Batch rows the buffers hold (`session_rows`).
    rows: usize,
    x: DActs<D>,                // (rows, n_embd) residual (the predictor's input)
    x_tail: Buf<D, f32>,        // (rows, n_embd) the last rows of x, when only they need logits
    xb: DActs<D>,               // (n_embd) normed input
    q: Buf<D, f32>,             // (q_dim)
    k: Buf<D, f32>,             // (kv_dim)
    v: Buf<D, f32>,             // (kv_dim)
    att: DActs<D>,              // (q_dim)
    attn_out: Buf<D, f32>,      // (n_embd)
    scores: Buf<D, f32>,        // (n_head, n_ctx)
    pred_hidden: DActs<D>,      // (rows, max predictor hidden)
    pred_logits: Buf<D, f32>,   // (rows, n_ff)
    h: DActs<D>,                // (rows, max n_hot)
    expert_h: DActs<D>,         // (n_used, n_ff_exp) a row's device experts' activations
    shared_h: DActs<D>,         // (n_ff_shared) the shared expert's activations
    router_logits: Buf<D, f32>, // (rows, n_expert) a GPU layer's router logits
    expert_x: DActs<D>,         // (n_embd) one row of a pass's FFN input, for its experts
    // (rows, n_used + 1, n_embd) the device's expert outputs gathered by row and routed slot,
    // each row's shared expert's last, so that the host reads them in one copy
    expert_ys: Buf<D, f32>,
    ffn_out: Buf<D, f32>, // (n_embd) the FFN's output when its down projection is `HotDown::Rows`
    partial: Buf<D, f32>, // (rows, max chunks, n_embd)
    cpu_part: Buf<D, f32>, // (rows, n_embd)
    cos: Vec<Buf<D, f32>>, // per RoPE set (rope_dim / 2)
    sin: Vec<Buf<D, f32>>,
    logits: Buf<D, f32>,   // (n_vocab)
    selected: Buf<D, u32>, // (n_layer) neurons the predictor selected, counted on the GPU
    /// The current GPU layer's FFN output, summed into the residual by `ffn_merge`: this many
    /// chunks of hot partial sums, plus `cpu_part` when the layer has cold neurons (or, for
    /// `HotDown::Rows`, all in `ffn_out`).
    ffn_chunks: usize,
    ffn_has_cold: bool,
    /// The current GPU layer's FFN output is whole in `ffn_out` (bias included).
    ffn_whole: bool,
    /// The norm (layer, which) a residual add already computed into `xb`, for the next `norm`.
    normed: Option<(usize, Norm)>,
    // host buffers
    xb_h: Vec<f32>,      // (rows, n_embd)
    pred_h: Vec<f32>,    // (rows, n_ff)
    cpu_out_h: Vec<f32>, // (rows, n_embd)
    cells: Vec<bool>,    // (rows, n_ff) the cold cells the CPU computes over several rows
    expert_ys_h: Vec<f32>,
    acts: Activations,
    neurons: Vec<u32>,
    scratch: SparseScratch,
    counts: SplitCounts,
    // GPU layers of this token whose selection was counted only on the GPU (no cold neurons)
    counted_on_gpu: Vec<usize>,
    selected_h: Vec<u32>,
    /// The token's position, read by kv_store and attention on the device.
    pos: DevicePos<D>,
    /// The token's kernels, recorded by the first token of a `graphable` model (see `Graph`).
    graph: Graph<D>,
    /// The FFN stats of the layers of the token being recorded.
    ledger_stats: Vec<FfnStats>,
}

/// A session's recording of a token's kernels: none yet, being recorded (this token's
/// launches are recorded, then replayed), ready (with what a token adds to the host's
/// counters, which the recording does not hold), or off (the device cannot record, the model
/// is not wholly on it, POWERINFER_CUDA_GRAPH=0, or a recording failed).
enum Graph<D: Device> {
    None,
    Recording { gpu_neurons_before: u64 },
    Ready { graph: D::Graph, ledger: Ledger },
    Off,
}

/// The host-side effects of one token's pass on a wholly-GPU model: the FFN stats each layer
/// adds, the layers whose selection the GPU counts, and the neurons computed on the GPU.
#[derive(Default)]
struct Ledger {
    stats: Vec<FfnStats>,
    counted_on_gpu: Vec<usize>,
    gpu_neurons: u64,
}

impl<D: Device> HybridSession<D> {
    pub fn new(hm: Arc<HybridModel<D>>, n_ctx: usize, kv_type: KvType) -> Result<HybridSession<D>> {
        let cpu = Session::new(Arc::clone(&hm.model), n_ctx, kv_type)
            .map_err(|e| CudaError::Plan(e.to_string()))?;
        let c = &hm.model.config;
        let g = &hm.gpu;
        let kv_f16 = kv_type == KvType::F16;
        let cache_bytes = n_ctx * c.kv_dim() * if kv_f16 { 2 } else { 4 };
        let mut k_cache = Vec::new();
        let mut v_cache = Vec::new();
        for layer in &hm.layers {
            k_cache.push(layer.as_ref().map(|_| g.zeros::<u8>(cache_bytes)).transpose()?);
            v_cache.push(layer.as_ref().map(|_| g.zeros::<u8>(cache_bytes)).transpose()?);
        }
        let max_hidden = hm
            .layers
            .iter()
            .flatten()
            .filter_map(|l| l.dense.predictor.as_ref().map(|p| p.0.rows))
            .max()
            .unwrap_or(1);
        let max_hot = hm.layers.iter().flatten().map(|l| l.n_hot).max().unwrap_or(1);
        let max_chunks = max_hot.div_ceil(ROWS_PER_CHUNK).max(1);
        let rows = session_rows(c.n_head, n_ctx);
        let dev = DeviceState {
            rows,
            x: g.acts(rows * c.n_embd)?,
            x_tail: g.zeros(rows * c.n_embd)?,
            xb: g.acts(rows * c.n_embd)?,
            q: g.zeros(rows * c.q_dim())?,
            k: g.zeros(rows * c.kv_dim())?,
            v: g.zeros(rows * c.kv_dim())?,
            att: g.acts(rows * c.q_dim())?,
            attn_out: g.zeros(rows * c.n_embd)?,
            scores: g.zeros(rows * c.n_head * n_ctx)?,
            pred_hidden: g.acts(rows * max_hidden)?,
            pred_logits: g.zeros(rows * c.n_ff)?,
            h: g.acts(rows * max_hot)?,
            expert_h: g.acts(c.moe.map_or(1, |m| m.n_used * m.n_ff_exp))?,
            shared_h: g.acts(c.moe.map_or(0, |m| m.n_ff_shared).max(1))?,
            router_logits: g.zeros(rows * c.moe.map_or(1, |m| m.n_expert))?,
            expert_x: g.acts(if c.moe.is_some() { c.n_embd } else { 1 })?,
            expert_ys: g.zeros(rows * c.moe.map_or(1, |m| (m.n_used + 1) * c.n_embd))?,
            ffn_out: g.zeros(rows * c.n_embd)?,
            partial: g.zeros(rows * max_chunks * c.n_embd)?,
            cpu_part: g.zeros(rows * c.n_embd)?,
            cos: (0..c.rope_sets())
                .map(|_| g.zeros(rows * c.rope_dim / 2))
                .collect::<Result<_>>()?,
            sin: (0..c.rope_sets())
                .map(|_| g.zeros(rows * c.rope_dim / 2))
                .collect::<Result<_>>()?,
            logits: g.zeros(rows * c.n_vocab)?,
            selected: g.zeros(c.n_layer)?,
            ffn_chunks: 0,
            ffn_has_cold: false,
            ffn_whole: false,
            normed: None,
            xb_h: vec![0.0; rows * c.n_embd],
            pred_h: vec![0.0; rows * c.n_ff],
            cpu_out_h: vec![0.0; rows * c.n_embd],
            cells: Vec::new(),
            expert_ys_h: vec![0.0; rows * c.moe.map_or(1, |m| (m.n_used + 1) * c.n_embd)],
            acts: Activations::default(),
            neurons: Vec::new(),
            scratch: SparseScratch::default(),
            counts: SplitCounts::default(),
            counted_on_gpu: Vec::new(),
            selected_h: vec![0; c.n_layer],
            pos: g.pos()?,
            ledger_stats: Vec::new(),
            graph: if hm.graphable && std::env::var("POWERINFER_CUDA_GRAPH").as_deref() != Ok("0") {
                Graph::None
            } else {
                Graph::Off
            },
            k_cache,
            v_cache,
            kv_f16,
            n_ctx,
        };
        Ok(HybridSession { dev, cpu, hm })
    }

    /// Prompt tokens a pass of this session evaluates (see `session_rows`).
    pub fn prompt_rows(&self) -> usize {
        self.dev.rows
    }

    /// KV cache bytes this session holds on the GPU.
    pub fn kv_bytes(&self) -> usize {
        self.dev.k_cache.iter().chain(&self.dev.v_cache).flatten().map(|b| D::len(b)).sum()
    }

    pub fn pos(&self) -> usize {
        self.cpu.pos()
    }

    /// Keeps the first `n` tokens; returns how many it kept (see `Session::truncate`).
    pub fn truncate(&mut self, n: usize) -> usize {
        self.cpu.truncate(n)
    }

    /// Dense and predictor modes run on the GPU; threshold mode needs the dense gate of every
    /// neuron and is CPU-only.
    pub fn set_sparsity(&mut self, sp: Sparsity) -> Result<()> {
        if sp.mode() == SparsityMode::Threshold && self.hm.layers.iter().any(|l| l.is_some()) {
            return Err(CudaError::Unsupported(THRESHOLD_IS_CPU_ONLY.into()));
        }
        if sp.track_recall() {
            return Err(CudaError::Unsupported("recall tracking runs on the CPU only".into()));
        }
        self.cpu.set_sparsity(sp).map_err(|e| CudaError::Plan(e.to_string()))?;
        // the recording holds the predictor's cut-offs and the sparsity mode's kernels
        if matches!(self.dev.graph, Graph::Ready { .. }) {
            self.dev.graph = Graph::None;
        }
        Ok(())
    }

    pub fn take_counts(&mut self) -> SplitCounts {
        std::mem::take(&mut self.dev.counts)
    }

    /// Evaluates `tokens` (in passes of up to `prompt_rows` tokens) and returns the logits of
    /// every token (n, n_vocab) when `all_logits`, else of the last.
    pub fn eval(&mut self, tokens: &[u32], all_logits: bool) -> CoreResult<Vec<f32>> {
        self.cpu.check_room(tokens)?;
        let n_vocab = self.hm.model.config.n_vocab;
        if self.dev.rows > 1 && tokens.len() > 1 {
            return self.eval_rows(tokens, all_logits);
        }
        let mut out = Vec::with_capacity(if all_logits { tokens.len() * n_vocab } else { n_vocab });
        for (i, &tok) in tokens.iter().enumerate() {
            let logits = self.step(tok)?;
            self.cpu.tokens.push(tok);
            if all_logits || i + 1 == tokens.len() {
                out.extend_from_slice(&logits);
            }
        }
        Ok(out)
    }

    /// A prompt: passes of up to `prompt_rows` tokens, each through the
    /// forward pass at once; the logits of every token, or of the last.
    fn eval_rows(&mut self, tokens: &[u32], all_logits: bool) -> CoreResult<Vec<f32>> {
        let hm = Arc::clone(&self.hm);
        let model = &*hm.model;
        let mut out = Vec::new();
        let rows = self.dev.rows;
        let n_chunks = tokens.len().div_ceil(rows);
        for (i, chunk) in tokens.chunks(rows).enumerate() {
            let n_logits = if all_logits { chunk.len() } else { usize::from(i + 1 == n_chunks) };
            if let [tok] = *chunk {
                // a last single row is a decode step (its selection counted, its graph recorded)
                let logits = self.step(tok)?;
                self.cpu.tokens.push(tok);
                if n_logits == 1 {
                    out.extend_from_slice(&logits);
                }
                continue;
            }
            let _one_session_at_a_time = hm.step_lock.lock().unwrap_or_else(|e| e.into_inner());
            let pos = self.cpu.pos();
            let (cpu, dev) = (&mut self.cpu, &mut self.dev);
            let logits = model.install(|| {
                let mut pass = HybridPass {
                    hm: &hm,
                    dev,
                    cpu: CpuPass::new(cpu, chunk.len()),
                    pos,
                    m: chunk.len(),
                    on_gpu: false,
                };
                forward(&mut pass, model, chunk, n_logits)
            })?;
            self.cpu.tokens.extend_from_slice(chunk);
            out.extend_from_slice(&logits);
        }
        Ok(out)
    }

    /// One token at the next position through the forward pass on the hybrid backend; returns
    /// its logits.
    fn step(&mut self, tok: u32) -> CoreResult<Vec<f32>> {
        let hm = Arc::clone(&self.hm);
        let _one_session_at_a_time = hm.step_lock.lock().unwrap_or_else(|e| e.into_inner());
        let model = &*hm.model;
        if !self.dev.counted_on_gpu.is_empty() {
            // an earlier step failed before reading its counts
            self.dev.counted_on_gpu.clear();
            hm.gpu.clear(&mut self.dev.selected)?;
        }
        let pos = self.cpu.pos();
        let (cpu, dev) = (&mut self.cpu, &mut self.dev);
        let logits = model.install(|| {
            let mut pass =
                HybridPass { hm: &hm, dev, cpu: CpuPass::new(cpu, 1), pos, m: 1, on_gpu: false };
            if matches!(pass.dev.graph, Graph::Ready { .. }) {
                pass.embed(&[tok])?;
                return pass.replay();
            }
            let r = forward(&mut pass, model, &[tok], 1);
            if r.is_err() && matches!(pass.dev.graph, Graph::Recording { .. }) {
                // end the recording so the stream runs again; this session stops recording
                let _ = hm.gpu.end_capture();
                pass.dev.graph = Graph::Off;
            }
            r
        })?;
        self.stats_counted_on_gpu()?;
        Ok(logits)
    }

    /// FFN stats of the layers whose selection only the GPU saw, from its counts (read after the
    /// token, when the stream has finished anyway).
    fn stats_counted_on_gpu(&mut self) -> Result<()> {
        let dev = &mut self.dev;
        if dev.counted_on_gpu.is_empty() {
            return Ok(());
        }
        let g = &self.hm.gpu;
        g.read(&dev.selected, &mut dev.selected_h)?;
        g.clear(&mut dev.selected)?;
        let n_ff = self.hm.model.config.n_ff as u64;
        for l in dev.counted_on_gpu.drain(..) {
            let selected = dev.selected_h[l] as u64;
            self.cpu.add_stats(FfnStats {
                neurons: n_ff,
                skipped: n_ff - selected,
                ..Default::default()
            });
            dev.counts.gpu_neurons += selected;
        }
        Ok(())
    }
}

/// One token's pass on the hybrid backend: GPU layers run on the device, with the cold neurons
/// of their FFN on the CPU; CPU layers and, unless placed on the GPU, the classifier run on the
/// CPU backend. The residual stream moves (n_embd floats) only where consecutive steps run on
/// different sides.
struct HybridPass<'a, D: Device> {
    hm: &'a HybridModel<D>,
    dev: &'a mut DeviceState<D>,
    cpu: CpuPass<'a>,
    pos: usize,
    /// Rows (tokens at positions pos, pos + 1, ...): 1, or up to the session's `prompt_rows`
    /// prompt tokens.
    m: usize,
    /// Where the residual stream x lives now: the device's `x`, or the CPU pass's.
    on_gpu: bool,
}

impl<'a, D: Device> HybridPass<'a, D> {
    /// Layer l's device part, or None when the layer runs on the CPU; moves the residual
    /// stream to the side that runs it.
    fn place(&mut self, l: usize) -> Result<Option<&'a GpuLayer<D>>> {
        let layer = self.hm.layers[l].as_ref();
        self.residual_to(layer.is_some())?;
        Ok(layer)
    }

    /// A token of a recorded model after `embed`: the recording replayed, the host's counters
    /// advanced as the recorded token advanced them, the logits read.
    fn replay(&mut self) -> CoreResult<Vec<f32>> {
        let (g, dev) = (&self.hm.gpu, &mut *self.dev);
        let Graph::Ready { graph, ledger } = &dev.graph else {
            return Err(CudaError::Plan("a replay without a recording".into()).into());
        };
        g.launch_graph(graph)?;
        for &s in &ledger.stats {
            self.cpu.session().add_stats(s);
        }
        dev.counted_on_gpu.extend_from_slice(&ledger.counted_on_gpu);
        dev.counts.gpu_neurons += ledger.gpu_neurons;
        let mut logits = vec![0.0f32; self.hm.model.config.n_vocab];
        g.read(&dev.logits, &mut logits)?;
        cap_logits(&self.hm.model.config, &mut logits);
        Ok(logits)
    }

    fn residual_to(&mut self, gpu: bool) -> Result<()> {
        let g = &self.hm.gpu;
        match (self.on_gpu, gpu) {
            (false, true) => g.write(self.cpu.residual_stream(), &mut self.dev.x.f32s)?,
            (true, false) => g.read(&self.dev.x.f32s, self.cpu.residual_stream())?,
            _ => {}
        }
        self.on_gpu = gpu;
        Ok(())
    }

    /// The FFN of a GPU layer: the predictor on the device; the hot neurons queued on the
    /// device, the selected cold ones on the CPU meanwhile; the parts stay apart until the
    /// residual sums them (`ffn_merge`).
    fn gpu_ffn(&mut self, l: usize, layer: &GpuLayer<D>) -> Result<()> {
        let hm = self.hm;
        let (model, g) = (&*hm.model, &hm.gpu);
        let c = &model.config;
        let d = &layer.dense;
        let dev = &mut *self.dev;
        let m = self.m;

        // the predictor reads the residual x: logits (m, n_ff)
        let sp = self.cpu.session().sparsity();
        let predicted = sp.mode() == SparsityMode::Predictor;
        let threshold = sp.predictor_cutoff(l).unwrap_or(0.0);
        if predicted {
            let (fc1, fc2) = d
                .predictor
                .as_ref()
                .ok_or_else(|| CudaError::Plan(format!("layer {l} has no predictor")))?;
            g.quantize_for(&[fc1], &mut dev.x, m * c.n_embd)?;
            g.matvec(fc1, &dev.x, None, &mut dev.pred_hidden.f32s, true, m)?;
            g.quantize_for(&[fc2], &mut dev.pred_hidden, m * fc1.rows)?;
            g.matvec(fc2, &dev.pred_hidden, None, &mut dev.pred_logits, false, m)?;
        }

        // the CPU needs the FFN input (and the predictor's verdict) before the hot kernels are
        // queued; over several rows the host counts the selection itself
        let has_cold = !layer.cold.is_empty();
        let (xb_h, pred_h) = (&mut dev.xb_h[..m * c.n_embd], &mut dev.pred_h[..m * c.n_ff]);
        if has_cold {
            g.read(&dev.xb.f32s, xb_h)?;
        }
        if predicted && (has_cold || m > 1) {
            g.read(&dev.pred_logits, pred_h)?;
        }

        // GPU: hot neurons, queued; they run while the CPU computes the cold ones
        dev.ffn_chunks = 0;
        dev.ffn_whole = false;
        // a single row without cold neurons: the host never sees the selection, the GPU counts it
        let counted_on_gpu = predicted && !has_cold && m == 1;
        if let Some(hot) = &layer.hot {
            let pred = predicted.then_some((&dev.pred_logits, c.n_ff));
            let count = counted_on_gpu.then(|| {
                dev.counted_on_gpu.push(l);
                (&mut dev.selected, l)
            });
            g.quantize_for(&[&hot.up], &mut dev.xb, m * c.n_embd)?;
            g.ffn_hot(
                hot.gate.as_ref(),
                &hot.up,
                &hot.bucket,
                &dev.xb,
                [None, hot.up_bias.as_ref()],
                pred,
                threshold,
                count,
                c.ffn_activation,
                &mut dev.h.f32s,
                m,
            )?;
            match &hot.down {
                HotDown::Columns(down_t) => {
                    dev.ffn_chunks = g.down_partial(down_t, &dev.h.f32s, &mut dev.partial, m)?
                }
                HotDown::Rows(down) => {
                    g.quantize_for(&[down], &mut dev.h, m * c.n_ff)?;
                    g.matvec(down, &dev.h, layer.down_bias.as_ref(), &mut dev.ffn_out, false, m)?;
                    dev.ffn_whole = true;
                }
            }
        }

        // which cold neurons the CPU computes: one row's list, or the cells (m, n_ff) each of
        // several rows selects
        let cold_selected = |row: &[f32], j: u32| {
            !predicted || Sparsity::predictor_selects(row[j as usize], threshold)
        };
        let mut cold = 0;
        if has_cold && m == 1 {
            dev.neurons.clear();
            dev.neurons.extend(layer.cold.iter().copied().filter(|&j| cold_selected(pred_h, j)));
            cold = dev.neurons.len();
        } else if has_cold {
            dev.cells.clear();
            dev.cells.resize(m * c.n_ff, false);
            for (t, cells) in dev.cells.chunks_exact_mut(c.n_ff).enumerate() {
                let row = &pred_h[if predicted { t * c.n_ff..(t + 1) * c.n_ff } else { 0..0 }];
                for &j in layer.cold.iter().filter(|&&j| cold_selected(row, j)) {
                    cells[j as usize] = true;
                    cold += 1;
                }
            }
        }

        // the stats (a selection the GPU counted becomes stats after the token)
        let mut stats = FfnStats::default();
        if !counted_on_gpu {
            stats.neurons = (m * c.n_ff) as u64;
            let gpu = if predicted {
                let selected =
                    pred_h.iter().filter(|&&v| Sparsity::predictor_selects(v, threshold)).count();
                stats.skipped = (m * c.n_ff - selected) as u64;
                selected - cold
            } else {
                m * layer.n_hot
            };
            dev.counts.cpu_neurons += cold as u64;
            dev.counts.gpu_neurons += gpu as u64;
        }

        // CPU: the selected cold neurons
        if has_cold {
            let lw = &model.weights.layers[l];
            let down_t = match &layer.cold_down_t {
                Some(rows) => {
                    QMatrix { dtype: DType::F16, rows: c.n_ff, cols: c.n_embd, data: rows }
                }
                None => model.down_t(l),
            };
            let cpu_out = &mut dev.cpu_out_h[..m * c.n_embd];
            if m == 1 {
                let mats = FfnMats {
                    gate: lw.ffn_gate,
                    up: lw.dense_up(),
                    up_bias: lw.ffn_up_b.as_deref(),
                    down_t,
                    down: lw.ffn_down,
                    act: c.ffn_activation,
                    bundles: None,
                };
                dev.acts.set_for(xb_h, 1, c.n_embd, &[mats.gate.unwrap_or(mats.up), mats.up]);
                if dev.neurons.is_empty() {
                    cpu_out.iter_mut().for_each(|v| *v = 0.0);
                } else {
                    sparse_ffn(&mats, &dev.acts, &dev.neurons, None, cpu_out, &mut dev.scratch);
                }
            } else {
                // the rows' cold cells in one pass over the rows some row selected
                self.cpu.normed_input().copy_from_slice(xb_h);
                self.cpu
                    .ffn_of_cells(l, &down_t, &dev.cells)
                    .map_err(|e| CudaError::Plan(e.to_string()))?;
                cpu_out.copy_from_slice(self.cpu.ffn_output());
            }
            g.write(cpu_out, &mut dev.cpu_part)?;
        }
        dev.ffn_has_cold = has_cold;
        if matches!(dev.graph, Graph::Recording { .. }) {
            dev.ledger_stats.push(stats);
        }
        self.cpu.session().add_stats(stats);
        Ok(())
    }
}

impl<D: Device> Backend for HybridPass<'_, D> {
    fn embed(&mut self, tokens: &[u32]) -> CoreResult<()> {
        // the embedding on the host; RoPE angles exactly as the CPU computes them
        self.cpu.embed(tokens)?;
        self.on_gpu = false;
        self.dev.normed = None;
        let g = &self.hm.gpu;
        if self.hm.model.config.rope_dim > 0 {
            for set in 0..self.dev.cos.len() {
                let (cos, sin) = self.cpu.rope_angles(set);
                g.write(cos, &mut self.dev.cos[set])?;
                g.write(sin, &mut self.dev.sin[set])?;
            }
        }
        g.set_pos(&mut self.dev.pos, self.pos)?;
        if matches!(self.dev.graph, Graph::None | Graph::Ready { .. }) || self.m > 1 {
            // the residual's only upload; then, for a first token, the recording starts
            self.residual_to(true)?;
        }
        if matches!(self.dev.graph, Graph::None) && self.m == 1 {
            let before = self.dev.counts.gpu_neurons;
            self.dev.graph = if self.hm.gpu.begin_capture()? {
                Graph::Recording { gpu_neurons_before: before }
            } else {
                Graph::Off
            };
        }
        Ok(())
    }

    fn norm(&mut self, l: usize, which: Norm) -> CoreResult<()> {
        let Some(layer) = self.place(l)? else { return self.cpu.norm(l, which) };
        if self.dev.normed == Some((l, which)) {
            // the residual add before it computed this norm in the same launch
            self.dev.normed = None;
            return Ok(());
        }
        let c = &self.hm.model.config;
        let (w, round) = norm_target(layer, which)?;
        Ok(self.hm.gpu.rmsnorm(
            &self.dev.x.f32s,
            w,
            &mut self.dev.xb,
            c.n_embd,
            c.norm_eps,
            round,
            self.m,
        )?)
    }

    fn qkv(&mut self, l: usize) -> CoreResult<()> {
        let Some(layer) = self.place(l)? else { return self.cpu.qkv(l) };
        let (c, g, d, dev) = (&self.hm.model.config, &self.hm.gpu, &layer.dense, &mut *self.dev);
        g.quantize_for(&[&d.wq, &d.wk, &d.wv], &mut dev.xb, self.m * c.n_embd)?;
        Ok(g.matvec3(
            [&d.wq, &d.wk, &d.wv],
            &dev.xb,
            [d.bq.as_ref(), d.bk.as_ref(), d.bv.as_ref()],
            [&mut dev.q, &mut dev.k, &mut dev.v],
            self.m,
        )?)
    }

    fn rope(&mut self, l: usize) -> CoreResult<()> {
        if self.place(l)?.is_none() {
            return self.cpu.rope(l);
        }
        let (c, g, dev) = (&self.hm.model.config, &self.hm.gpu, &mut *self.dev);
        let neox = c.rope_style == RopeStyle::NeoX;
        // this layer's set of angles (sliding layers may have their own base)
        let (cos, sin) = (&dev.cos[c.rope_set(l)], &dev.sin[c.rope_set(l)]);
        Ok(g.rope(
            &mut dev.q,
            &mut dev.k,
            cos,
            sin,
            c.n_head,
            c.n_head_kv,
            c.head_dim,
            c.rope_dim,
            neox,
            self.m,
        )?)
    }

    fn qk_norm(&mut self, l: usize) -> CoreResult<()> {
        let Some(layer) = self.place(l)? else { return self.cpu.qk_norm(l) };
        let (c, g, d, dev) = (&self.hm.model.config, &self.hm.gpu, &layer.dense, &mut *self.dev);
        let missing =
            || CudaError::Plan(format!("layer {l} has only one of attn_q_norm and attn_k_norm"));
        g.head_rmsnorm(
            &mut dev.q,
            d.q_norm.as_ref().ok_or_else(missing)?,
            self.m * c.n_head,
            c.head_dim,
            c.norm_eps,
        )?;
        Ok(g.head_rmsnorm(
            &mut dev.k,
            d.k_norm.as_ref().ok_or_else(missing)?,
            self.m * c.n_head_kv,
            c.head_dim,
            c.norm_eps,
        )?)
    }

    fn kv_store(&mut self, l: usize) -> CoreResult<()> {
        if self.place(l)?.is_none() {
            return self.cpu.kv_store(l);
        }
        let (c, dev) = (&self.hm.model.config, &mut *self.dev);
        let (kc, vc) = (
            dev.k_cache[l].as_mut().expect("GPU layer"),
            dev.v_cache[l].as_mut().expect("GPU layer"),
        );
        Ok(self.hm.gpu.kv_store(
            &dev.k,
            &dev.v,
            kc,
            vc,
            &dev.pos,
            c.kv_dim(),
            dev.kv_f16,
            self.m,
        )?)
    }

    fn attend(&mut self, l: usize) -> CoreResult<()> {
        if self.place(l)?.is_none() {
            return self.cpu.attend(l);
        }
        let (c, dev) = (&self.hm.model.config, &mut *self.dev);
        let (kc, vc) = (
            dev.k_cache[l].as_ref().expect("GPU layer"),
            dev.v_cache[l].as_ref().expect("GPU layer"),
        );
        let at = AttnShape {
            n_ctx: dev.n_ctx,
            n_head: c.n_head,
            n_head_kv: c.n_head_kv,
            head_dim: c.head_dim,
            scale: c.attn_scale,
            softcap: c.attn_softcap,
            window: if c.slides(l) { c.sliding_window } else { 0 },
        };
        let sinks = self.hm.layers[l].as_ref().and_then(|d| d.dense.attn_sinks.as_ref());
        Ok(self.hm.gpu.attention(
            &dev.q,
            kc,
            vc,
            &mut dev.scores,
            &mut dev.att.f32s,
            &dev.pos,
            &at,
            sinks,
            dev.kv_f16,
            self.m,
        )?)
    }

    fn attn_out(&mut self, l: usize) -> CoreResult<()> {
        let Some(layer) = self.place(l)? else { return self.cpu.attn_out(l) };
        let (c, g, d, dev) = (&self.hm.model.config, &self.hm.gpu, &layer.dense, &mut *self.dev);
        g.quantize_for(&[&d.wo], &mut dev.att, self.m * c.q_dim())?;
        Ok(g.matvec(&d.wo, &dev.att, d.bo.as_ref(), &mut dev.attn_out, false, self.m)?)
    }

    fn ffn(&mut self, l: usize) -> CoreResult<()> {
        match self.place(l)? {
            Some(layer) => Ok(self.gpu_ffn(l, layer)?),
            None => {
                // a layer wholly on the CPU: its computed neurons are the CPU's
                let before = self.cpu.session().stats();
                self.cpu.ffn(l)?;
                let after = self.cpu.session().stats();
                self.dev.counts.cpu_neurons +=
                    (after.neurons - after.skipped) - (before.neurons - before.skipped);
                Ok(())
            }
        }
    }

    fn route(&mut self, l: usize) -> CoreResult<()> {
        let moe = self.hm.model.config.moe.expect("a mixture-of-experts model");
        let g = &self.hm.gpu;
        // where the router's input is: the normed FFN input on the device in a GPU layer; the
        // layer input wherever the residual stream is now
        let on_device = match moe.router_input {
            RouterInput::FfnInput => self.place(l)?.is_some(),
            RouterInput::LayerInput => self.on_gpu,
        };
        if !on_device {
            return self.cpu.route(l);
        }
        let experts = self.hm.layers[l].as_ref().and_then(|d| d.experts.as_ref());
        let router_bias = experts.and_then(|ex| ex.router_bias.as_ref());
        let Some(router) = experts.and_then(|ex| ex.router.as_ref()) else {
            match moe.router_input {
                RouterInput::FfnInput => g.read(&self.dev.xb.f32s, self.cpu.normed_input())?,
                RouterInput::LayerInput => g.read(&self.dev.x.f32s, self.cpu.residual_stream())?,
            }
            return self.cpu.route(l);
        };
        // the router's product on the device, queued
        let dev = &mut *self.dev;
        let x = match moe.router_input {
            RouterInput::FfnInput => &mut dev.xb,
            RouterInput::LayerInput => &mut dev.x,
        };
        let m = self.m;
        g.quantize_for(&[router], x, m * router.cols)?;
        g.matvec(router, x, router_bias, &mut dev.router_logits, false, m)?;
        // then the FFN input and the logits to the host: one wait for both (the host reads the
        // input anyway: its experts and the shared expert's gate need it)
        if moe.router_input == RouterInput::FfnInput {
            g.read(&dev.xb.f32s, self.cpu.normed_input())?;
        }
        let mut logits = vec![0.0f32; m * moe.n_expert];
        g.read(&dev.router_logits, &mut logits)?;
        self.cpu.route_from(l, &logits)
    }

    fn experts(&mut self, l: usize) -> CoreResult<()> {
        let moe = self.hm.model.config.moe.expect("a mixture-of-experts model");
        let Some(layer) = self.place(l)? else {
            self.dev.counts.cpu_neurons += (self.m * moe.n_used * moe.n_ff_exp) as u64;
            return self.cpu.experts(l);
        };
        let ex = layer.experts.as_ref().expect("a GPU layer of a mixture of experts");
        if moe.router_input == RouterInput::LayerInput {
            // the CPU's experts read the normed FFN input, which the router did not
            self.hm.gpu.read(&self.dev.xb.f32s, self.cpu.normed_input())?;
        }
        let (c, g, dev, m) = (&self.hm.model.config, &self.hm.gpu, &mut *self.dev, self.m);
        let (dim, n_used) = (c.n_embd, moe.n_used);
        // each row's outputs: its routed slots, then its shared expert's
        let per_row = n_used + 1;
        let routes: Vec<(u32, f32)> = self.cpu.routes().to_vec(); // (m, n_used)
        for (t, row_routes) in routes.chunks_exact(n_used).enumerate() {
            if ex.shared.is_none() && !row_routes.iter().any(|&(e, _)| ex.on_gpu[e as usize]) {
                continue; // nothing of this row's on the device
            }
            // the row's input, rounded once for every matrix the device reads it with; a
            // pass's row alone at the start of its own buffer, as the kernels read one row
            let x = if m == 1 {
                &mut dev.xb
            } else {
                g.copy(&dev.xb.f32s, t * dim, &mut dev.expert_x.f32s, 0, dim)?;
                &mut dev.expert_x
            };
            let mut readers: Vec<&DMat<D>> = ex.shared.iter().map(|(m, _)| &m[1]).collect();
            readers.extend(
                row_routes.iter().filter_map(|&(e, _)| ex.mats[e as usize].as_ref()).map(|m| &m[1]),
            );
            g.quantize_for(&readers, x, dim)?;
            let x = &*x;
            // the shared expert, queued: h = silu(gate . x) * (up . x), y = down . h
            if let Some(([gate, up, down], bucket)) = &ex.shared {
                let h = &mut dev.shared_h;
                g.ffn_hot(
                    Some(gate),
                    up,
                    bucket,
                    x,
                    [None, None],
                    None,
                    0.0,
                    None,
                    FfnActivation::SwiGlu,
                    &mut h.f32s,
                    1,
                )?;
                g.quantize_for(&[down], h, moe.n_ff_shared)?;
                // (not in the split counts, which are the routed experts')
                let at = (t * per_row + n_used) * dim;
                g.matvec_at(down, h, None, &mut dev.expert_ys, at, false, 1)?;
            }
            // the device's chosen experts, queued: h = act(gate . x, up . x), y = down . h into
            // each one's slot; without biases all of them in one launch each
            let held: Vec<(usize, &[DMat<D>; 3])> = row_routes
                .iter()
                .enumerate()
                .filter_map(|(j, &(e, _))| ex.mats[e as usize].as_ref().map(|m| (j, m)))
                .collect();
            dev.counts.gpu_neurons += (held.len() * moe.n_ff_exp) as u64;
            if !held.is_empty() && ex.biases.iter().all(Option::is_none) {
                let gates: Vec<&DMat<D>> = held.iter().map(|(_, m)| &m[0]).collect();
                let ups: Vec<&DMat<D>> = held.iter().map(|(_, m)| &m[1]).collect();
                let downs: Vec<&DMat<D>> = held.iter().map(|(_, m)| &m[2]).collect();
                let at: Vec<usize> = held.iter().map(|&(j, _)| (t * per_row + j) * dim).collect();
                g.experts_hot(&gates, &ups, x, c.ffn_activation, &mut dev.expert_h.f32s)?;
                g.quantize_for(&downs[..1], &mut dev.expert_h, held.len() * moe.n_ff_exp)?;
                g.experts_down(&downs, &dev.expert_h, &mut dev.expert_ys, &at)?;
                continue;
            }
            for &(j, [gate, up, down]) in &held {
                let bias = ex.biases[row_routes[j].0 as usize].as_ref();
                g.ffn_hot(
                    Some(gate),
                    up,
                    &ex.rows,
                    x,
                    [bias.map(|b| &b[0]), bias.map(|b| &b[1])],
                    None,
                    0.0,
                    None,
                    c.ffn_activation,
                    &mut dev.expert_h.f32s,
                    1,
                )?;
                g.quantize_for(&[down], &mut dev.expert_h, moe.n_ff_exp)?;
                // into its slot: one read brings every output back (a read waits for the
                // queue: one wait a layer, not one per expert)
                let (ys, at) = (&mut dev.expert_ys, (t * per_row + j) * dim);
                g.matvec_at(down, &dev.expert_h, bias.map(|b| &b[2]), ys, at, false, 1)?;
            }
        }
        // the CPU's meanwhile, every row's in one pass; then the device's outputs into their
        // slots, and the sums
        let on_device = routes.iter().filter(|&&(e, _)| ex.on_gpu[e as usize]).count();
        dev.counts.cpu_neurons += ((routes.len() - on_device) * moe.n_ff_exp) as u64;
        let (ys, ys_h) = (&dev.expert_ys, &mut dev.expert_ys_h[..m * per_row * dim]);
        self.cpu.experts_except(l, &ex.on_gpu, ex.shared.is_some(), |slots, out, shared| {
            if slots.is_empty() && shared.is_none() {
                return Ok(());
            }
            g.read(ys, ys_h).map_err(powerinfer_core::Error::from)?;
            for s in slots {
                let j = routes[s.row * n_used..(s.row + 1) * n_used]
                    .iter()
                    .position(|&(e, _)| e as usize == s.expert)
                    .expect("a slot of a routed expert");
                let at = (s.row * per_row + j) * dim;
                out[s.slot * dim..(s.slot + 1) * dim].copy_from_slice(&ys_h[at..at + dim]);
            }
            if let Some(shared) = shared {
                for (t, out) in shared.chunks_exact_mut(dim).enumerate() {
                    let at = (t * per_row + n_used) * dim;
                    out.copy_from_slice(&ys_h[at..at + dim]);
                }
            }
            Ok(())
        })?;
        // the sum joins the residual on the device as a cold part
        g.write(self.cpu.ffn_output(), &mut dev.cpu_part)?;
        dev.ffn_chunks = 0;
        dev.ffn_has_cold = true;
        dev.ffn_whole = false;
        Ok(())
    }

    fn post_norm(&mut self, l: usize, part: Part) -> CoreResult<()> {
        let Some(layer) = self.place(l)? else { return self.cpu.post_norm(l, part) };
        let (c, g, d, dev) = (&self.hm.model.config, &self.hm.gpu, &layer.dense, &mut *self.dev);
        let missing = || CudaError::Plan(format!("layer {l} has no {part:?} post-norm"));
        let out = match part {
            Part::Attn => {
                g.head_rmsnorm(
                    &mut dev.attn_out,
                    d.attn_post_norm.as_ref().ok_or_else(missing)?,
                    self.m,
                    c.n_embd,
                    c.norm_eps,
                )?;
                return Ok(());
            }
            Part::Ffn => d.ffn_post_norm.as_ref().ok_or_else(missing)?,
        };
        if !dev.ffn_whole {
            // the norm needs the whole FFN output: the parts merged into ffn_out first
            g.clear(&mut dev.ffn_out)?;
            let cold = dev.ffn_has_cold.then_some(&dev.cpu_part);
            g.ffn_merge(
                &mut dev.ffn_out,
                &dev.partial,
                dev.ffn_chunks,
                cold,
                layer.down_bias.as_ref(),
                c.n_embd,
                self.m,
            )?;
            dev.ffn_whole = true;
        }
        Ok(g.head_rmsnorm(&mut dev.ffn_out, out, self.m, c.n_embd, c.norm_eps)?)
    }

    fn residual(&mut self, l: usize, part: Part) -> CoreResult<()> {
        let Some(layer) = self.place(l)? else { return self.cpu.residual(l, part) };
        let (c, g, m) = (&self.hm.model.config, &self.hm.gpu, self.m);
        // the norm that reads x next, on the device: the add and that norm in one launch
        let next = match part {
            Part::Attn => Some((layer, l, Norm::Ffn)),
            Part::Ffn => {
                self.hm.layers.get(l + 1).and_then(|n| n.as_ref()).map(|n| (n, l + 1, Norm::Attn))
            }
        };
        let dev = &mut *self.dev;
        let addend = match part {
            Part::Attn => Some(&dev.attn_out),
            Part::Ffn => dev.ffn_whole.then_some(&dev.ffn_out),
        };
        if let (Some(y), Some((next_layer, nl, which))) = (addend, next) {
            let (w, round) = norm_target(next_layer, which)?;
            g.add_rmsnorm(&mut dev.x.f32s, y, w, &mut dev.xb, c.n_embd, c.norm_eps, round, m)?;
            dev.normed = Some((nl, which));
            return Ok(());
        }
        match part {
            Part::Attn => g.add_into(&mut dev.x.f32s, &dev.attn_out, None, m * c.n_embd)?,
            // x += hot partial sums + cold part (+ bias), or the whole FFN's output
            Part::Ffn if dev.ffn_whole => {
                g.add_into(&mut dev.x.f32s, &dev.ffn_out, None, m * c.n_embd)?
            }
            Part::Ffn => {
                let cold = dev.ffn_has_cold.then_some(&dev.cpu_part);
                g.ffn_merge(
                    &mut dev.x.f32s,
                    &dev.partial,
                    dev.ffn_chunks,
                    cold,
                    layer.down_bias.as_ref(),
                    c.n_embd,
                    m,
                )?
            }
        }
        Ok(())
    }

    /// The logits of the pass's last n rows (n, n_vocab).
    fn logits(&mut self, n: usize) -> CoreResult<Vec<f32>> {
        let Some((norm, w)) = &self.hm.output else {
            self.residual_to(false)?;
            return self.cpu.logits(n);
        };
        if n == 0 {
            return Ok(Vec::new());
        }
        self.residual_to(true)?;
        let (c, g, dev, rows) = (&self.hm.model.config, &self.hm.gpu, &mut *self.dev, self.m);
        let x = if n < rows {
            g.copy(&dev.x.f32s, (rows - n) * c.n_embd, &mut dev.x_tail, 0, n * c.n_embd)?;
            &dev.x_tail
        } else {
            &dev.x.f32s
        };
        g.rmsnorm(x, norm, &mut dev.xb, c.n_embd, c.norm_eps, Gpu::<D>::any_quantized(&[w]), n)?;
        g.quantize_for(&[w], &mut dev.xb, n * c.n_embd)?;
        g.matvec(w, &dev.xb, None, &mut dev.logits, false, n)?;
        if let Graph::Recording { gpu_neurons_before } = dev.graph {
            // the recorded token's kernels have not run yet: they run as the graph's first replay
            let graph = g.end_capture()?;
            let ledger = Ledger {
                stats: std::mem::take(&mut dev.ledger_stats),
                counted_on_gpu: dev.counted_on_gpu.clone(),
                gpu_neurons: dev.counts.gpu_neurons - gpu_neurons_before,
            };
            g.launch_graph(&graph)?;
            dev.graph = Graph::Ready { graph, ledger };
        }
        let mut logits = vec![0.0f32; n * c.n_vocab];
        g.read(&dev.logits, &mut logits)?;
        cap_logits(c, &mut logits);
        Ok(logits)
    }
}

/// A GPU layer's norm `which`: its weights, and whether the matrices that read the normed x
/// next are quantized (then the norm rounds its output for them).
fn norm_target<D: Device>(layer: &GpuLayer<D>, which: Norm) -> Result<(&Buf<D, f32>, bool)> {
    let d = &layer.dense;
    Ok(match which {
        Norm::Attn => (&d.attn_norm, Gpu::<D>::any_quantized(&[&d.wq, &d.wk, &d.wv])),
        Norm::Ffn => (&d.ffn_norm, layer.hot.as_ref().is_some_and(|h| h.up.dtype.is_quantized())),
        Norm::Attn2 => return Err(CudaError::Unsupported("a second attention norm".into())),
    })
}

/// Gemma 2's final soft-capping, on the host where the logits arrive (as the CPU applies it).
fn cap_logits(c: &powerinfer_core::model::Config, logits: &mut [f32]) {
    if c.final_softcap != 0.0 {
        softcap(logits, c.final_softcap);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::twin;
    use powerinfer_core::matmul::QMatrix;
    use powerinfer_core::model::FfnActivation;
    use powerinfer_core::quant::{quantize_row, DType};
    use powerinfer_core::sampler::Rng;

    fn random(rng: &mut Rng, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| (rng.next_f32() * 2.0 - 1.0) * scale).collect()
    }

    fn matrix(rng: &mut Rng, dtype: DType, rows: usize, cols: usize) -> Vec<u8> {
        (0..rows).flat_map(|_| quantize_row(dtype, &random(rng, cols, 0.5))).collect()
    }

    /// The hybrid executor's neuron-major down rows of a plain quantized file are the columns
    /// of `ffn_down` to f16 precision (not the engine's Q8_0 copy).
    #[test]
    fn exact_down_t_holds_the_columns_of_down() {
        let mut rng = Rng::new(3);
        let (n_embd, n_ff) = (64, 96);
        let d = matrix(&mut rng, DType::Q4_1, n_embd, n_ff);
        let down = QMatrix { dtype: DType::Q4_1, rows: n_embd, cols: n_ff, data: &d };
        let rows = exact_down_t(&down);
        let got = QMatrix { dtype: DType::F16, rows: n_ff, cols: n_embd, data: &rows };
        let (mut full, mut row) = (vec![0.0; n_ff], vec![0.0; n_embd]);
        for j in 0..n_ff {
            got.dequantize_row(j, &mut row);
            for (c, &v) in row.iter().enumerate() {
                down.dequantize_row(c, &mut full);
                assert!(
                    (v - full[j]).abs() <= full[j].abs() / 1024.0,
                    "neuron {j} col {c}: {v} vs {}",
                    full[j]
                );
            }
        }
    }

    /// The executor's split, computed on the CPU: the hot neurons through the GPU kernels'
    /// twins and the cold ones through the CPU sparse operator, summed, equal the CPU operator
    /// over every selected neuron. This is the merge the GPU does, minus the GPU.
    #[test]
    fn hot_plus_cold_equals_all() {
        let mut rng = Rng::new(7);
        let (n_embd, n_ff) = (64, 96);
        for (dtype, act) in [
            (DType::F32, FfnActivation::ReGlu),
            (DType::Q8_0, FfnActivation::SwiGlu),
            (DType::Q4_0, FfnActivation::DReGlu),
        ] {
            let (g, u, d) = (
                matrix(&mut rng, dtype, n_ff, n_embd),
                matrix(&mut rng, dtype, n_ff, n_embd),
                matrix(&mut rng, DType::F32, n_ff, n_embd),
            );
            let gate = QMatrix { dtype, rows: n_ff, cols: n_embd, data: &g };
            let up = QMatrix { dtype, rows: n_ff, cols: n_embd, data: &u };
            let down_t = QMatrix { dtype: DType::F32, rows: n_ff, cols: n_embd, data: &d };
            let x = random(&mut rng, n_embd, 1.0);
            let logits = random(&mut rng, n_ff, 1.0);
            let mask: Vec<bool> = (0..n_ff).map(|j| j % 3 != 1).collect();
            let (hot, cold) = split_neurons(&mask);
            assert_eq!(hot.len() + cold.len(), n_ff);
            assert!(
                hot.iter().all(|&j| mask[j as usize]) && cold.iter().all(|&j| !mask[j as usize])
            );

            let thr = 0.1;
            let (pg, pu, pd) = (
                twin::pack_rows(&gate, &hot),
                twin::pack_rows(&up, &hot),
                twin::pack_rows(&down_t, &hot),
            );
            let packed = |dtype, data| QMatrix { dtype, rows: hot.len(), cols: n_embd, data };
            let h = twin::ffn_hot(
                Some(&packed(dtype, &pg)),
                &packed(dtype, &pu),
                &hot,
                &x,
                [None, None],
                Some((&logits, thr)),
                act,
            );
            let gpu_part = twin::down(&packed(DType::F32, &pd), &h);
            let mats = FfnMats {
                gate: Some(gate),
                up,
                up_bias: None,
                down_t,
                down: None,
                act,
                bundles: None,
            };
            let mut acts = Activations::default();
            acts.set(&x, 1, n_embd);
            let mut scratch = SparseScratch::default();
            let cold_sel: Vec<u32> =
                cold.iter().copied().filter(|&j| logits[j as usize] >= thr).collect();
            let mut cpu_part = vec![0.0; n_embd];
            sparse_ffn(&mats, &acts, &cold_sel, None, &mut cpu_part, &mut scratch);
            let all_sel: Vec<u32> =
                (0..n_ff as u32).filter(|&j| logits[j as usize] >= thr).collect();
            let mut all = vec![0.0; n_embd];
            sparse_ffn(&mats, &acts, &all_sel, None, &mut all, &mut scratch);
            let merged: Vec<f32> = gpu_part.iter().zip(&cpu_part).map(|(a, b)| a + b).collect();
            let norm = all.iter().map(|v| v * v).sum::<f32>().sqrt();
            let err =
                merged.iter().zip(&all).map(|(a, b)| (a - b) * (a - b)).sum::<f32>().sqrt() / norm;
            // both sides read quantized weights' input as the same int8 blocks
            assert!(err < 1e-5, "{dtype:?}: relative error {err}");
        }
    }

    #[test]
    fn layer_offload_plan() {
        let p = GpuPlan::layer_offload(4, 8, 3, false);
        assert_eq!(p.dense_on_gpu, vec![true, true, true, false]);
        assert!(p.neuron_on_gpu[2].iter().all(|&b| b) && p.neuron_on_gpu[3].iter().all(|&b| !b));
        let f = GpuPlan::full(2, 5);
        assert!(f.output_on_gpu && f.neuron_on_gpu.iter().flatten().all(|&b| b));
    }
}
