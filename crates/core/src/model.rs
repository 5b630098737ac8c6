//! LLaMA-family model: hyper-parameters read from GGUF metadata (`Config`), weights borrowed from
//! the memory map (`Weights`), and the immutable `Model` that owns both plus the thread pool.
//! A `Model` is shared across threads through `Arc`; everything mutable lives in `Session`.
//!
//! Architectures: `llama` and `mistral` (RoPE normal), `qwen2` (RoPE NeoX, q/k/v biases), and
//! `bamboo` (dReLU FFN). The FFN activation comes from metadata (see `FfnActivation::from_file`).

use std::path::Path;

use crate::error::{Error, Result};
use crate::gguf::{GgufFile, Magic, TensorInfo};
use crate::matmul::QMatrix;
use crate::quant::{self, DType};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FfnActivation {
    /// `silu(gate) * up` (LLaMA, Mistral, SmolLM2, Qwen2)
    SwiGlu,
    /// `relu(gate) * up` (ReluLLaMA, ProSparse)
    ReGlu,
    /// `relu(gate) * relu(up)` (Bamboo)
    DReGlu,
    /// `relu(up)`, no gate (OPT, ReluFalcon)
    Relu,
    /// `gelu(up)`, no gate (original Falcon; dense only, GELU is never exactly zero)
    Gelu,
}

impl FfnActivation {
    pub fn name(self) -> &'static str {
        match self {
            FfnActivation::SwiGlu => "swiglu",
            FfnActivation::ReGlu => "reglu",
            FfnActivation::DReGlu => "dreglu",
            FfnActivation::Relu => "relu",
            FfnActivation::Gelu => "gelu",
        }
    }

    pub fn has_gate(self) -> bool {
        !matches!(self, FfnActivation::Relu | FfnActivation::Gelu)
    }

    /// The activation of one neuron from its gate and up pre-activations (`g` is ignored
    /// without a gate).
    #[inline]
    pub fn apply(self, g: f32, u: f32) -> f32 {
        match self {
            FfnActivation::SwiGlu => silu(g) * u,
            FfnActivation::ReGlu => g.max(0.0) * u,
            FfnActivation::DReGlu => g.max(0.0) * u.max(0.0),
            FfnActivation::Relu => u.max(0.0),
            FfnActivation::Gelu => gelu(u),
        }
    }

    /// The gate side alone, `act(gate)` (`act(up)` without a gate, called with the up value): threshold mode ranks
    /// neurons by its magnitude, and a zero here means the neuron contributes nothing.
    #[inline]
    pub fn gate_part(self, g: f32) -> f32 {
        match self {
            FfnActivation::SwiGlu => silu(g),
            FfnActivation::Gelu => gelu(g),
            _ => g.max(0.0),
        }
    }
}

#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// GELU, tanh approximation (ggml's `ggml_gelu`).
#[inline]
pub fn gelu(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (1.0 + 0.044715 * x * x)).tanh())
}

impl FfnActivation {
    /// `{arch}.ffn_activation` when the file says ("silu"/"swiglu", "relu"/"reglu",
    /// "drelu"/"dreglu"); otherwise what the architecture implies: Bamboo is dReLU, and a `llama`
    /// file with PowerInfer's `PWRI` magic is ReLU-gated (ReluLLaMA, ProSparse), exactly as
    /// PowerInfer reads such files; every other file is SwiGLU.
    fn from_file(file: &GgufFile, arch: &str) -> Result<FfnActivation> {
        let key = format!("{arch}.ffn_activation");
        // Falcon and OPT have no gate: their FFN is act(up).
        let gateless = matches!(arch, "falcon" | "opt");
        if let Some(v) = file.get(&key) {
            return match (v.as_str(), gateless) {
                (Some("silu" | "swiglu"), false) => Ok(FfnActivation::SwiGlu),
                (Some("relu" | "reglu"), false) => Ok(FfnActivation::ReGlu),
                (Some("drelu" | "dreglu"), false) => Ok(FfnActivation::DReGlu),
                (Some("relu"), true) => Ok(FfnActivation::Relu),
                (Some("gelu"), true) => Ok(FfnActivation::Gelu),
                _ => Err(Error::Model(format!("{key} = {v:?} is not an activation {arch} supports"))),
            };
        }
        Ok(match (arch, file.magic) {
            // OPT is ReLU by design; Falcon is GELU unless it is a PowerInfer (ReluFalcon) file
            ("opt", _) | ("falcon", Magic::Powerinfer) => FfnActivation::Relu,
            ("falcon", _) => FfnActivation::Gelu,
            ("bamboo", _) => FfnActivation::DReGlu,
            ("llama", Magic::Powerinfer) => FfnActivation::ReGlu,
            _ => FfnActivation::SwiGlu,
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    /// Rotates adjacent pairs (x[2i], x[2i+1]); ggml rope mode 0.
    Normal,
    /// Rotates (x[i], x[i + d/2]); GPT-NeoX style, ggml rope mode 2.
    NeoX,
}

#[derive(Debug, Clone)]
pub struct Config {
    pub architecture: String,
    pub n_vocab: usize,
    pub n_embd: usize,
    pub n_layer: usize,
    pub n_ff: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub n_ctx_train: usize,
    pub rope_dim: usize,
    pub rope_base: f32,
    pub rope_style: RopeStyle,
    pub rms_eps: f32,
    pub ffn_activation: FfnActivation,
    pub tied_output: bool,
}

impl Config {
    pub fn q_dim(&self) -> usize {
        self.n_head * self.head_dim
    }
    pub fn kv_dim(&self) -> usize {
        self.n_head_kv * self.head_dim
    }
}

/// Per-layer weights. Shapes are row-major (rows, cols); a matrix maps cols -> rows.
pub struct LayerWeights<'a> {
    pub attn_norm: Vec<f32>,      // (n_embd)
    pub wq: QMatrix<'a>,          // (n_head * head_dim, n_embd)
    pub wk: QMatrix<'a>,          // (n_head_kv * head_dim, n_embd)
    pub wv: QMatrix<'a>,          // (n_head_kv * head_dim, n_embd)
    pub bq: Option<Vec<f32>>,     // (n_head * head_dim), qwen2
    pub bk: Option<Vec<f32>>,     // (n_head_kv * head_dim)
    pub bv: Option<Vec<f32>>,     // (n_head_kv * head_dim)
    pub wo: QMatrix<'a>,          // (n_embd, n_head * head_dim)
    pub ffn_norm: Vec<f32>,       // (n_embd)
    pub ffn_gate: QMatrix<'a>,    // (n_ff, n_embd)
    pub ffn_up: QMatrix<'a>,      // (n_ff, n_embd)
    pub ffn_down: QMatrix<'a>,    // (n_embd, n_ff)
}

pub struct Weights<'a> {
    pub token_embd: QMatrix<'a>,  // (n_vocab, n_embd)
    pub layers: Vec<LayerWeights<'a>>,
    pub output_norm: Vec<f32>,    // (n_embd)
    pub output: QMatrix<'a>,      // (n_vocab, n_embd); token_embd when tied
}

pub struct Model {
    pub config: Config,
    // Borrows from `file`'s memory map. Declared before `file` so it is dropped first; the map
    // never moves (it is a kernel mapping, not inline data), so the borrow stays valid.
    pub weights: Weights<'static>,
    pub file: GgufFile,
    pool: rayon::ThreadPool,
}

fn meta_usize(file: &GgufFile, key: &str) -> Result<Option<usize>> {
    match file.get(key) {
        None => Ok(None),
        Some(v) => match v.as_u64() {
            Some(n) if n < 1 << 32 => Ok(Some(n as usize)),
            _ => Err(Error::Model(format!("metadata {key} = {v:?} is not a valid count"))),
        },
    }
}

fn meta_f32(file: &GgufFile, key: &str) -> Result<Option<f32>> {
    match file.get(key) {
        None => Ok(None),
        Some(v) => match v.as_f64() {
            Some(x) if x.is_finite() => Ok(Some(x as f32)),
            _ => Err(Error::Model(format!("metadata {key} = {v:?} is not a finite number"))),
        },
    }
}

fn required<T>(v: Option<T>, key: &str) -> Result<T> {
    v.ok_or_else(|| Error::Model(format!("required metadata key {key} is missing")))
}

impl Config {
    pub fn from_file(file: &GgufFile) -> Result<Config> {
        let arch = match file.get("general.architecture") {
            Some(v) => v.as_str().ok_or_else(|| Error::Model("general.architecture is not a string".into()))?.to_string(),
            None => return Err(Error::Model("required metadata key general.architecture is missing".into())),
        };
        let rope_style = match arch.as_str() {
            "llama" | "mistral" | "bamboo" => RopeStyle::Normal,
            "qwen2" => RopeStyle::NeoX,
            _ => return Err(Error::UnknownArchitecture(arch)),
        };
        let k = |name: &str| format!("{arch}.{name}");
        let n_embd = required(meta_usize(file, &k("embedding_length"))?, &k("embedding_length"))?;
        let n_layer = required(meta_usize(file, &k("block_count"))?, &k("block_count"))?;
        let n_ff = required(meta_usize(file, &k("feed_forward_length"))?, &k("feed_forward_length"))?;
        let n_head = required(meta_usize(file, &k("attention.head_count"))?, &k("attention.head_count"))?;
        let n_head_kv = meta_usize(file, &k("attention.head_count_kv"))?.unwrap_or(n_head);
        if n_embd == 0 || n_layer == 0 || n_ff == 0 || n_head == 0 || n_head_kv == 0 {
            return Err(Error::Model("embedding length, block count, FFN length and head counts must be > 0".into()));
        }
        if n_head % n_head_kv != 0 {
            return Err(Error::Model(format!("head_count {n_head} is not a multiple of head_count_kv {n_head_kv}")));
        }
        let head_dim = match meta_usize(file, &k("attention.key_length"))? {
            Some(d) => d,
            None if n_embd % n_head == 0 => n_embd / n_head,
            None => return Err(Error::Model(format!("embedding length {n_embd} is not divisible by {n_head} heads"))),
        };
        let rope_dim = meta_usize(file, &k("rope.dimension_count"))?.unwrap_or(head_dim);
        if rope_dim > head_dim || rope_dim % 2 != 0 || head_dim % 2 != 0 {
            return Err(Error::Model(format!("rope dimension {rope_dim} does not fit head size {head_dim}")));
        }
        let embd = file
            .tensor("token_embd.weight")
            .ok_or_else(|| Error::Model("required tensor token_embd.weight is missing".into()))?;
        let n_vocab = embd.shape()[0] as usize;
        Ok(Config {
            n_vocab,
            n_embd,
            n_layer,
            n_ff,
            n_head,
            n_head_kv,
            head_dim,
            n_ctx_train: meta_usize(file, &k("context_length"))?.unwrap_or(2048),
            rope_dim,
            rope_base: meta_f32(file, &k("rope.freq_base"))?.unwrap_or(10000.0),
            rope_style,
            rms_eps: meta_f32(file, &k("attention.layer_norm_rms_epsilon"))?.unwrap_or(1e-5),
            ffn_activation: FfnActivation::from_file(file, &arch)?,
            tied_output: file.tensor("output.weight").is_none(),
            architecture: arch,
        })
    }
}

/// Looks up a matrix, checks its type and shape, and borrows its bytes.
fn matrix<'a>(file: &'a GgufFile, name: &str, rows: usize, cols: usize) -> Result<QMatrix<'a>> {
    let t = file.tensor(name).ok_or_else(|| Error::Model(format!("required tensor {name} is missing")))?;
    let dtype = supported(t)?;
    if t.shape() != [rows as u64, cols as u64] {
        return Err(Error::Model(format!("tensor {name} has shape {:?}, expected [{rows}, {cols}]", t.shape())));
    }
    let data = file.tensor_bytes(t);
    let align = match dtype {
        DType::F32 => 4,
        DType::F16 | DType::BF16 => 2,
        _ => 2, // quant blocks start with an f16 scale
    };
    if data.as_ptr() as usize % align != 0 {
        return Err(Error::Model(format!("tensor {name} data is not {align}-byte aligned")));
    }
    Ok(QMatrix { dtype, rows, cols, data })
}

fn supported(t: &TensorInfo) -> Result<DType> {
    t.dtype.ok_or_else(|| Error::UnsupportedType { tensor: t.name.clone(), dtype: t.type_name() })
}

/// A vector (norm weight or bias) of length `n`, converted to f32.
fn vector(file: &GgufFile, name: &str, n: usize) -> Result<Option<Vec<f32>>> {
    let Some(t) = file.tensor(name) else { return Ok(None) };
    let dtype = supported(t)?;
    if t.n_elements() != n as u64 {
        return Err(Error::Model(format!("tensor {name} has {} elements, expected {n}", t.n_elements())));
    }
    let mut out = vec![0.0; n];
    quant::dequantize_row(dtype, file.tensor_bytes(t), &mut out);
    Ok(Some(out))
}

fn required_vector(file: &GgufFile, name: &str, n: usize) -> Result<Vec<f32>> {
    vector(file, name, n)?.ok_or_else(|| Error::Model(format!("required tensor {name} is missing")))
}

impl Weights<'_> {
    fn load<'a>(file: &'a GgufFile, c: &Config) -> Result<Weights<'a>> {
        let token_embd = matrix(file, "token_embd.weight", c.n_vocab, c.n_embd)?;
        let mut layers = Vec::with_capacity(c.n_layer);
        for i in 0..c.n_layer {
            let n = |s: &str| format!("blk.{i}.{s}");
            layers.push(LayerWeights {
                attn_norm: required_vector(file, &n("attn_norm.weight"), c.n_embd)?,
                wq: matrix(file, &n("attn_q.weight"), c.q_dim(), c.n_embd)?,
                wk: matrix(file, &n("attn_k.weight"), c.kv_dim(), c.n_embd)?,
                wv: matrix(file, &n("attn_v.weight"), c.kv_dim(), c.n_embd)?,
                bq: vector(file, &n("attn_q.bias"), c.q_dim())?,
                bk: vector(file, &n("attn_k.bias"), c.kv_dim())?,
                bv: vector(file, &n("attn_v.bias"), c.kv_dim())?,
                wo: matrix(file, &n("attn_output.weight"), c.n_embd, c.q_dim())?,
                ffn_norm: required_vector(file, &n("ffn_norm.weight"), c.n_embd)?,
                ffn_gate: matrix(file, &n("ffn_gate.weight"), c.n_ff, c.n_embd)?,
                ffn_up: matrix(file, &n("ffn_up.weight"), c.n_ff, c.n_embd)?,
                ffn_down: matrix(file, &n("ffn_down.weight"), c.n_embd, c.n_ff)?,
            });
        }
        let output = if c.tied_output { token_embd } else { matrix(file, "output.weight", c.n_vocab, c.n_embd)? };
        Ok(Weights {
            token_embd,
            layers,
            output_norm: required_vector(file, "output_norm.weight", c.n_embd)?,
            output,
        })
    }
}

impl Model {
    /// Opens a GGUF file and checks every tensor the architecture needs. `threads` = 0 picks the
    /// number of physical cores rayon sees.
    pub fn load(path: &Path, threads: usize) -> Result<Model> {
        let file = GgufFile::open(path)?;
        let config = Config::from_file(&file)?;
        let weights = Weights::load(&file, &config)?;
        // SAFETY: see the field comment on `Model::weights`: the slices point into the memory map
        // owned by `file`, which lives exactly as long as the Model and is dropped after them.
        let weights: Weights<'static> = unsafe { std::mem::transmute::<Weights<'_>, Weights<'static>>(weights) };
        let threads = if threads == 0 { std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) } else { threads };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("powerinfer-{i}"))
            .build()
            .map_err(|e| Error::InvalidArgument(format!("cannot start {threads} threads: {e}")))?;
        Ok(Model { config, weights, file, pool })
    }

    pub fn n_threads(&self) -> usize {
        self.pool.current_num_threads()
    }

    /// Runs `f` on this model's thread pool (all rayon work inside uses it).
    pub fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.pool.install(f)
    }
}
