//! LLaMA-family model: hyper-parameters read from GGUF metadata (`Config`), weights borrowed from
//! the memory map (`Weights`), and the immutable `Model` that owns both plus the thread pool.
//! A `Model` is shared across threads through `Arc`; everything mutable lives in `Session`.
//!
//! Architectures: `llama` and `mistral` (RoPE normal; Llama 3's `rope_freqs` and linear RoPE
//! scaling), `qwen2` (RoPE NeoX, q/k/v biases), `qwen3` (q/k RMSNorm), `gemma`, `gemma2` and
//! `gemma3` (GELU-gated FFN, scaled embeddings, post-block norms, soft-capping, sliding-window
//! layers with their own RoPE base, q/k norm), `phi3` (fused qkv and gate_up), `bamboo` (dReLU
//! FFN), `falcon` (LayerNorm, fused QKV, parallel attention and FFN, no gate) and `opt`
//! (LayerNorm, biases everywhere, learned positions, no gate); and the mixtures of experts
//! (`Moe`): Mixtral (`llama` with experts), `qwen2moe`, `qwen3moe`, `olmoe`, `smallthinker` and
//! `gpt-oss` (attention sinks and biases, every other layer sliding, a biased router and biased
//! experts with the clamped SwiGLU). Everything that differs is data in `Config` and optional
//! weights, read by the one layer in `forward.rs`. The FFN activation comes from metadata (see
//! `FfnActivation::from_file`).
//!
//! PowerInfer files (`PWRI` magic) carry the down projection transposed (`ffn_down_t`, one row
//! per neuron) and a predictor per layer (`fc1`, `fc2`). Plain files get a neuron-major copy of
//! `ffn_down` built once, on first use by a sparse mode (`Model::down_t`).

use std::path::Path;
use std::sync::OnceLock;

use rayon::prelude::*;

use crate::activation::{gelu, silu};
use crate::error::{Error, Result};
use crate::gguf::{GgufFile, Magic, TensorInfo};
use crate::matmul::{QMatrix, Weight};
use crate::quant::interleaved::Interleaved;
use crate::quant::{self, DType};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FfnActivation {
    /// `silu(gate) * up` (LLaMA, Mistral, SmolLM2, Qwen2)
    SwiGlu,
    /// `gelu(gate) * up`, GELU's tanh form (Gemma)
    GeGlu,
    /// `relu(gate) * up` (ReluLLaMA, ProSparse)
    ReGlu,
    /// `relu(gate) * relu(up)` (Bamboo)
    DReGlu,
    /// `relu(up)`, no gate (OPT, ReluFalcon)
    Relu,
    /// `gelu(up)`, no gate (original Falcon; dense only, GELU is never exactly zero)
    Gelu,
    /// gpt-oss's clamped SwiGLU: g' = min(g, 7), u' = clamp(u, -7, 7), then
    /// `g' sigmoid(1.702 g') (u' + 1)` (llama.cpp's `swiglu_oai`)
    SwiGluOai,
}

/// `SwiGluOai`'s sigmoid slope and clamp.
const OAI_ALPHA: f32 = 1.702;
const OAI_LIMIT: f32 = 7.0;

impl FfnActivation {
    pub fn name(self) -> &'static str {
        match self {
            FfnActivation::SwiGlu => "swiglu",
            FfnActivation::GeGlu => "geglu",
            FfnActivation::ReGlu => "reglu",
            FfnActivation::DReGlu => "dreglu",
            FfnActivation::Relu => "relu",
            FfnActivation::Gelu => "gelu",
            FfnActivation::SwiGluOai => "swiglu_oai",
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
            FfnActivation::GeGlu => gelu(g) * u,
            FfnActivation::ReGlu => g.max(0.0) * u,
            FfnActivation::DReGlu => g.max(0.0) * u.max(0.0),
            FfnActivation::Relu => u.max(0.0),
            FfnActivation::Gelu => gelu(u),
            FfnActivation::SwiGluOai => {
                let g = g.min(OAI_LIMIT);
                g / (1.0 + (-OAI_ALPHA * g).exp()) * (u.clamp(-OAI_LIMIT, OAI_LIMIT) + 1.0)
            }
        }
    }

    /// gate[i] = apply(gate[i], up[i]) for every neuron of a batch (the same bits as `apply`;
    /// SiLU and GELU in 8 lanes where the CPU has AVX2).
    pub fn apply_all(self, gate: &mut [f32], up: &[f32]) {
        assert_eq!(gate.len(), up.len(), "activation: gate and up differ in length");
        #[cfg(target_arch = "x86_64")]
        if matches!(self, FfnActivation::SwiGlu | FfnActivation::GeGlu)
            && crate::simd::simd_level().has_avx2()
        {
            // SAFETY: has_avx2 means the CPU has avx2, fma and f16c; the lengths are equal.
            return unsafe { crate::avx2::activate(self == FfnActivation::GeGlu, gate, Some(up)) };
        }
        // one loop per activation, so that each compiles to vector code (a match per neuron
        // kept ReGLU's in scalars: 1536 neurons, 2-core AMD EPYC, several microseconds)
        macro_rules! each {
            ($act:expr) => {
                gate.iter_mut().zip(up).for_each(|(g, &u)| *g = $act.apply(*g, u))
            };
        }
        match self {
            FfnActivation::ReGlu => each!(FfnActivation::ReGlu),
            FfnActivation::DReGlu => each!(FfnActivation::DReGlu),
            FfnActivation::Relu => each!(FfnActivation::Relu),
            other => each!(other),
        }
    }

    /// x[i] = gate_part(x[i]) for every value (the same bits; SiLU and GELU in 8 lanes where
    /// the CPU has AVX2).
    pub fn gate_part_all(self, x: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if matches!(self, FfnActivation::SwiGlu | FfnActivation::GeGlu | FfnActivation::Gelu)
            && crate::simd::simd_level().has_avx2()
        {
            let gelu = self != FfnActivation::SwiGlu;
            // SAFETY: has_avx2 means the CPU has avx2, fma and f16c.
            return unsafe { crate::avx2::activate(gelu, x, None) };
        }
        x.iter_mut().for_each(|v| *v = self.gate_part(*v));
    }

    /// The gate side alone, `act(gate)` (`act(up)` without a gate, called with the up value): threshold mode ranks
    /// neurons by its magnitude, and a zero here means the neuron contributes nothing.
    #[inline]
    pub fn gate_part(self, g: f32) -> f32 {
        match self {
            FfnActivation::SwiGlu => silu(g),
            FfnActivation::Gelu | FfnActivation::GeGlu => gelu(g),
            FfnActivation::SwiGluOai => {
                let g = g.min(OAI_LIMIT);
                g / (1.0 + (-OAI_ALPHA * g).exp())
            }
            _ => g.max(0.0),
        }
    }
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
                (Some("swiglu_oai"), false) => Ok(FfnActivation::SwiGluOai),
                (Some("relu"), true) => Ok(FfnActivation::Relu),
                (Some("gelu"), true) => Ok(FfnActivation::Gelu),
                _ => {
                    Err(Error::Model(format!("{key} = {v:?} is not an activation {arch} supports")))
                }
            };
        }
        Ok(match (arch, file.magic) {
            // OPT is ReLU by design; Falcon is GELU unless it is a PowerInfer (ReluFalcon) file
            ("opt", _) | ("falcon", Magic::Powerinfer) => FfnActivation::Relu,
            ("falcon", _) => FfnActivation::Gelu,
            ("bamboo", _) => FfnActivation::DReGlu,
            ("llama", Magic::Powerinfer) => FfnActivation::ReGlu,
            ("gemma" | "gemma2" | "gemma3", _) => FfnActivation::GeGlu,
            // PowerInfer's SmallThinker: ReGLU experts
            ("smallthinker", _) => FfnActivation::ReGlu,
            ("gpt-oss", _) => FfnActivation::SwiGluOai,
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
    /// No rotary embedding (OPT: learned absolute positions).
    None,
}

/// The shape of the transformer block, which picks the forward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// Pre-RMSNorm, attention then FFN: llama, mistral, qwen2, qwen3, gemma 1-3, phi3, bamboo.
    Llama,
    /// LayerNorm; attention and FFN both read the normed layer input and add to it in parallel.
    Falcon,
    /// Pre-LayerNorm with biases, learned positions (offset 2), tied output.
    Opt,
}

/// OPT's learned position table starts at row 2 (rows 0 and 1 were padding in training).
pub const OPT_POSITION_OFFSET: usize = 2;

#[derive(Debug, Clone)]
pub struct Config {
    pub architecture: String,
    pub family: Family,
    pub n_vocab: usize,
    pub n_embd: usize,
    pub n_layer: usize,
    pub n_ff: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub n_ctx_train: usize,
    /// The context the RoPE was trained for before any scaling (`rope.scaling.
    /// original_context_length`, else `n_ctx_train`): YaRN's correction range, and which of
    /// LongRoPE's factor sets a session uses.
    pub rope_ctx_orig: usize,
    pub rope_dim: usize,
    pub rope_base: f32,
    pub rope_style: RopeStyle,
    /// RMSNorm or LayerNorm epsilon, whichever the family uses.
    pub norm_eps: f32,
    pub ffn_activation: FfnActivation,
    pub tied_output: bool,
    /// `PWRI` magic: a PowerInfer file.
    pub powerinfer: bool,
    /// Predictor cut-off from `powerinfer.sparse_threshold` (0.0 when absent).
    pub sparse_threshold: f32,
    /// The embeddings are multiplied by this (Gemma: sqrt(n_embd); otherwise 1).
    pub embed_scale: f32,
    /// q . k is multiplied by this: 1 / sqrt(head_dim), except where Gemma's
    /// `query_pre_attn_scalar` differs (the 27B models: 1 / sqrt(n_embd / n_head)).
    pub attn_scale: f32,
    /// Gemma 2: attention scores become cap * tanh(score / cap) before the softmax (0: none).
    pub attn_softcap: f32,
    /// Gemma 2: logits become cap * tanh(logit / cap) (0: none).
    pub final_softcap: f32,
    /// Sliding-window attention (Gemma 2 and 3): a sliding layer's token attends to the last
    /// `sliding_window` positions only, itself included (0: no layer slides).
    pub sliding_window: usize,
    /// Which layers slide, as llama.cpp's `set_swa_pattern(p)`: layer l slides iff
    /// l % p < p - 1 (Gemma 2: every other layer from the first; Gemma 3: five of every six),
    /// or, `swa_dense_first`, iff l % p != 0 (SmallThinker: the first of every p attends fully).
    pub swa_pattern: usize,
    pub swa_dense_first: bool,
    /// Whether the sliding layers turn q and k by their own frequencies (`rope_base_swa`,
    /// unscaled: Gemma 3, SmallThinker) or, as gpt-oss's, by the model's.
    pub swa_own_rope: bool,
    /// The FFN norm's tensor in each block (`ffn_norm`; gpt-oss's converter names it
    /// `post_attention_norm`, Gemma's post-attention norm).
    pub ffn_norm_tensor: &'static str,
    /// Whether every layer has attention sinks (gpt-oss: `attn_sinks`, one logit per head).
    pub attn_sinks: bool,
    /// Every layer l with l % nope_step == 0 has no RoPE (SmallThinker's full-attention layers,
    /// llama.cpp's `n_no_rope_layer_step`); 0: every layer turns q and k.
    pub nope_step: usize,
    /// RoPE base of the sliding layers (Gemma 3: 10 000, where its global layers use 1 000 000).
    pub rope_base_swa: f32,
    /// Linear RoPE scaling of the non-sliding layers: positions are multiplied by this
    /// (1 / `rope.scaling.factor`); with YaRN only the frequencies above its correction range.
    pub rope_freq_scale: f32,
    /// YaRN's mix of scaled and original frequencies for the non-sliding layers, if any.
    pub rope_yarn: Option<Yarn>,
    /// The non-sliding layers' cos and sin are multiplied by this (YaRN's 1 + 0.1 ln factor,
    /// times `rope.scaling.attn_factor`).
    pub rope_magnitude: f32,
    /// A mixture of experts in place of the dense FFN, if the file has one.
    pub moe: Option<Moe>,
}

/// The architectures `Config::from_file` reads (a `llama` file with `expert_count` is
/// Mixtral-style mixture of experts).
pub const ARCHITECTURES: [&str; 16] = [
    "llama",
    "mistral",
    "bamboo",
    "qwen2",
    "qwen3",
    "gemma",
    "gemma2",
    "gemma3",
    "phi3",
    "falcon",
    "opt",
    "qwen2moe",
    "qwen3moe",
    "olmoe",
    "smallthinker",
    "gpt-oss",
];

/// The mixture-of-experts files the engine runs, for messages.
pub const MOE_ARCHITECTURES: &str =
    "llama with experts (Mixtral), qwen2moe, qwen3moe, olmoe, smallthinker, gpt-oss";

/// Mixture-of-experts architectures llama.cpp writes that the engine refuses by name rather
/// than as unknown (their routing, expert layout or attention differ from the ones it runs).
const OTHER_MOE_ARCHITECTURES: [&str; 19] = [
    "deepseek",
    "deepseek2",
    "dbrx",
    "phimoe",
    "granitemoe",
    "grok",
    "arctic",
    "jamba",
    "llama4",
    "glm4moe",
    "ernie4_5-moe",
    "hunyuan-moe",
    "bailingmoe",
    "bailingmoe2",
    "dots1",
    "qwen3next",
    "qwen3vlmoe",
    "minimax-m2",
    "lfm2moe",
];

/// A layer's FFN as a mixture of experts (llama.cpp's `build_moe_ffn`): per token the
/// router's probabilities over `n_expert` experts (`gating`) pick the `n_used` most probable;
/// the FFN output is the sum of their FFNs (`n_ff_exp` neurons each, the model's
/// `ffn_activation`: SwiGLU, or ReGLU in SmallThinker) weighted by those probabilities
/// (divided by their sum where `normalize_weights`, times `weights_scale`), plus a shared
/// expert of `n_ff_shared` neurons scaled by sigmoid(gate_inp . x) where the file has one
/// (Qwen2-MoE).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Moe {
    pub n_expert: usize,
    pub n_used: usize,
    pub n_ff_exp: usize,
    /// 0: no shared expert.
    pub n_ff_shared: usize,
    pub normalize_weights: bool,
    pub weights_scale: f32,
    pub gating: Gating,
    pub router_input: RouterInput,
    /// Whether the router and every expert have biases (gpt-oss).
    pub biased: bool,
}

/// How router logits become expert probabilities (llama.cpp's `expert_gating_func`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gating {
    /// A softmax over the experts.
    Softmax,
    /// Each logit's sigmoid, alone.
    Sigmoid,
    /// The experts chosen by their logits, weighted by a softmax over the chosen logits alone
    /// (gpt-oss; llama.cpp's `SOFTMAX_WEIGHT`).
    SoftmaxOfChosen,
}

impl Gating {
    pub fn name(self) -> &'static str {
        match self {
            Gating::Softmax => "softmax",
            Gating::Sigmoid => "sigmoid",
            Gating::SoftmaxOfChosen => "softmax_of_chosen",
        }
    }
}

/// What the router reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RouterInput {
    /// The FFN's normed input (every family but SmallThinker).
    FfnInput,
    /// The layer's input, before the attention norm (SmallThinker's pre-attention router, so
    /// that the experts' weights can be fetched while attention runs).
    LayerInput,
}

impl RouterInput {
    pub fn name(self) -> &'static str {
        match self {
            RouterInput::FfnInput => "ffn_input",
            RouterInput::LayerInput => "layer_input",
        }
    }
}

impl Moe {
    /// The file's experts, as llama.cpp reads each architecture's keys: `expert_count`,
    /// `expert_used_count`, `expert_feed_forward_length` (Qwen's; else `n_ff` divided among
    /// the used experts, and Mixtral's and OLMoE's experts are `n_ff` wide),
    /// `expert_shared_feed_forward_length` (Qwen2-MoE; else `n_ff`) and
    /// `expert_weights_scale`. None for a dense file.
    fn from_file(file: &GgufFile, arch: &str, n_ff: usize) -> Result<Option<Moe>> {
        let k = |name: &str| format!("{arch}.{name}");
        let moe_arch =
            matches!(arch, "qwen2moe" | "qwen3moe" | "olmoe" | "smallthinker" | "gpt-oss");
        let n_expert = meta_usize(file, &k("expert_count"))?.unwrap_or(0);
        if n_expert == 0 {
            return match moe_arch {
                true => Err(Error::Model(format!(
                    "{} must be > 0 for {arch} (a mixture-of-experts architecture)",
                    k("expert_count")
                ))),
                false => Ok(None),
            };
        }
        if !moe_arch && arch != "llama" {
            return Err(Error::Model(format!(
                "{arch} has {} = {n_expert}, but its experts are not supported (mixture-of-experts files it runs: {MOE_ARCHITECTURES})",
                k("expert_count")
            )));
        }
        let used_key = k("expert_used_count");
        let n_used = required(meta_usize(file, &used_key)?, &used_key)?;
        if n_used == 0 || n_used > n_expert {
            return Err(Error::Model(format!(
                "{used_key} = {n_used} must be between 1 and {} = {n_expert}",
                k("expert_count")
            )));
        }
        let qwen = arch.starts_with("qwen");
        let n_ff_exp = match meta_usize(file, &k("expert_feed_forward_length"))? {
            Some(n) if n > 0 => n,
            _ if qwen => n_ff / n_used,
            _ => n_ff,
        };
        let n_ff_shared = match arch {
            "qwen2moe" => match meta_usize(file, &k("expert_shared_feed_forward_length"))? {
                Some(n) if n > 0 => n,
                _ => n_ff,
            },
            _ => 0,
        };
        if n_ff_exp == 0 {
            return Err(Error::Model(format!("{arch}: the experts' FFN length is 0")));
        }
        // llama.cpp applies the scale only where it is neither 0 nor 1
        let scale = meta_f32(file, &k("expert_weights_scale"))?.unwrap_or(0.0);
        let smallthinker = arch == "smallthinker";
        // SmallThinker's converter writes its router's function (1: softmax, 2: sigmoid); the
        // other families' graphs take the softmax whatever the file says
        let gating = match smallthinker {
            false if arch == "gpt-oss" => Gating::SoftmaxOfChosen,
            false => Gating::Softmax,
            true => {
                let key = k("expert_gating_func");
                match required(meta_usize(file, &key)?, &key)? {
                    1 => Gating::Softmax,
                    2 => Gating::Sigmoid,
                    v => {
                        return Err(Error::Model(format!(
                            "{key} = {v} is not supported (1: softmax, 2: sigmoid)"
                        )))
                    }
                }
            }
        };
        Ok(Some(Moe {
            n_expert,
            n_used,
            n_ff_exp,
            n_ff_shared,
            // llama.cpp's `norm_w` per architecture: Mixtral, Qwen3-MoE and SmallThinker
            // normalise the selected weights, Qwen2-MoE and OLMoE do not
            normalize_weights: matches!(arch, "llama" | "qwen3moe" | "smallthinker"),
            weights_scale: if scale == 0.0 { 1.0 } else { scale },
            gating,
            router_input: if smallthinker {
                RouterInput::LayerInput
            } else {
                RouterInput::FfnInput
            },
            biased: arch == "gpt-oss",
        }))
    }
}

/// YaRN (`rope.scaling.type` = yarn), as ggml's `rope_yarn`: frequency i keeps its original
/// value below the correction range [low, high] (frequency indices), is scaled by
/// `rope_freq_scale` above it, with a linear ramp between; `ext_factor` weighs the original.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Yarn {
    pub low: f32,
    pub high: f32,
    pub ext_factor: f32,
}

impl Yarn {
    /// ggml's `ggml_rope_yarn_corr_dims`: the frequencies that turn `beta_fast` and `beta_slow`
    /// times over the original context bound the ramp.
    fn new(
        rope_dim: usize,
        n_ctx_orig: usize,
        base: f32,
        beta_fast: f32,
        beta_slow: f32,
        ext_factor: f32,
    ) -> Yarn {
        let dim = |rotations: f32| {
            rope_dim as f32 * (n_ctx_orig as f32 / (rotations * 2.0 * std::f32::consts::PI)).ln()
                / (2.0 * base.ln())
        };
        Yarn {
            low: dim(beta_fast).floor().max(0.0),
            high: dim(beta_slow).ceil().min(rope_dim as f32 - 1.0),
            ext_factor,
        }
    }

    /// How much of frequency i stays original (0..=ext_factor).
    fn original_share(&self, i: usize) -> f32 {
        let y = (i as f32 - self.low) / (self.high - self.low).max(0.001);
        (1.0 - y.clamp(0.0, 1.0)) * self.ext_factor
    }
}

/// The RoPE of one set of layers (`Config::rope_set`): inverse frequencies (rope_dim / 2) and
/// the factor on cos and sin.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeSet {
    pub inv_freq: Vec<f32>,
    pub magnitude: f32,
}

impl Config {
    pub fn q_dim(&self) -> usize {
        self.n_head * self.head_dim
    }
    pub fn kv_dim(&self) -> usize {
        self.n_head_kv * self.head_dim
    }

    /// Whether layer l attends over a sliding window.
    pub fn slides(&self, l: usize) -> bool {
        let p = self.swa_pattern;
        self.sliding_window > 0
            && match self.swa_dense_first {
                false => p <= 1 || l % p < p - 1,
                true => p <= 1 || !l.is_multiple_of(p),
            }
    }

    /// Whether layer l turns q and k by their positions.
    pub fn ropes(&self, l: usize) -> bool {
        self.rope_style != RopeStyle::None
            && (self.nope_step == 0 || !l.is_multiple_of(self.nope_step))
    }

    /// The RoPE frequency set layer l uses: 0 (the model's base and scaling), or 1 (the sliding
    /// layers' own base, where they have one).
    pub fn rope_set(&self, l: usize) -> usize {
        usize::from(self.slides(l) && self.rope_sets() == 2)
    }

    /// Whether the non-sliding layers' RoPE is scaled (linearly or by YaRN).
    pub fn rope_scaled(&self) -> bool {
        self.rope_freq_scale != 1.0 || self.rope_yarn.is_some() || self.rope_magnitude != 1.0
    }

    /// Set `set`'s RoPE: inverse frequency i is base^(-2i / rope_dim) / factor_i (Llama 3's
    /// `rope_freqs`), times the scaling of set 0 (linear, or YaRN's mix as ggml computes the
    /// angle: scaled * (1 - share) + original * share).
    pub fn rope(&self, set: usize, factors: Option<&[f32]>) -> RopeSet {
        let base = if set == 0 { self.rope_base } else { self.rope_base_swa };
        let inv_freq = (0..self.rope_dim / 2)
            .map(|i| {
                let original = base.powf(-2.0 * i as f32 / self.rope_dim as f32)
                    / factors.map_or(1.0, |f| f[i]);
                match (set, self.rope_yarn) {
                    (0, Some(yarn)) => {
                        let share = yarn.original_share(i);
                        self.rope_freq_scale * original * (1.0 - share) + original * share
                    }
                    (0, None) => self.rope_freq_scale * original,
                    _ => original,
                }
            })
            .collect();
        RopeSet { inv_freq, magnitude: if set == 0 { self.rope_magnitude } else { 1.0 } }
    }

    /// How many RoPE frequency sets the layers use (1 or 2).
    pub fn rope_sets(&self) -> usize {
        if self.sliding_window > 0
            && self.swa_own_rope
            && (self.rope_base_swa != self.rope_base || self.rope_scaled())
        {
            2
        } else {
            1
        }
    }
}

/// Per-layer predictor of which FFN neurons fire: `logits = fc2 @ relu(fc1 @ x)`, neuron j
/// predicted active iff `logits[j] >= threshold`. No biases.
#[derive(Clone, Copy)]
pub struct Predictor<'a> {
    pub fc1: QMatrix<'a>, // (hidden, n_embd); hidden differs per layer
    pub fc2: QMatrix<'a>, // (n_ff, hidden)
}

/// Per-layer weights. Shapes are row-major (rows, cols); a matrix maps cols -> rows.
pub struct LayerWeights<'a> {
    pub attn_norm: Vec<f32>,           // (n_embd)
    pub attn_norm_b: Option<Vec<f32>>, // (n_embd), LayerNorm families
    pub attn_norm_2: Option<Vec<f32>>, // (n_embd), Falcon-40B: separate norm for attention
    pub attn_norm_2_b: Option<Vec<f32>>,
    pub wq: QMatrix<'a>,          // (n_head * head_dim, n_embd)
    pub q_norm: Option<Vec<f32>>, // (head_dim), RMSNorm of each q head (qwen3, gemma3)
    pub k_norm: Option<Vec<f32>>, // (head_dim), RMSNorm of each k head
    pub wk: QMatrix<'a>,          // (n_head_kv * head_dim, n_embd)
    pub wv: QMatrix<'a>,          // (n_head_kv * head_dim, n_embd)
    pub bq: Option<Vec<f32>>,     // (n_head * head_dim), qwen2, opt
    pub bk: Option<Vec<f32>>,     // (n_head_kv * head_dim)
    pub bv: Option<Vec<f32>>,     // (n_head_kv * head_dim)
    pub wo: QMatrix<'a>,          // (n_embd, n_head * head_dim)
    pub bo: Option<Vec<f32>>,     // (n_embd), opt, gpt-oss
    /// Per query head, a logit that joins its softmax without a value (gpt-oss's attention
    /// sinks): the weights of the real positions then sum to less than 1.
    pub attn_sinks: Option<Vec<f32>>, // (n_head)
    pub attn_post_norm: Option<Vec<f32>>, // (n_embd), gemma2/3: RMSNorm of the attention output
    pub ffn_post_norm: Option<Vec<f32>>, // (n_embd), gemma2/3: RMSNorm of the FFN output
    pub ffn_norm: Option<Vec<f32>>, // (n_embd); Falcon has none (the FFN reads attn_norm's output)
    pub ffn_norm_b: Option<Vec<f32>>, // (n_embd), opt
    pub ffn_gate: Option<QMatrix<'a>>, // (n_ff, n_embd); none for Falcon and OPT
    pub ffn_up: Option<QMatrix<'a>>, // (n_ff, n_embd); none in a mixture-of-experts layer
    pub ffn_up_b: Option<Vec<f32>>, // (n_ff), opt
    pub ffn_down: Option<QMatrix<'a>>, // (n_embd, n_ff), plain files
    pub ffn_down_t: Option<QMatrix<'a>>, // (n_ff, n_embd), PowerInfer files: row j = neuron j's output
    pub ffn_down_b: Option<Vec<f32>>,    // (n_embd), opt
    pub predictor: Option<Predictor<'a>>,
    /// The experts that replace the dense FFN (`Config::moe`).
    pub moe: Option<MoeWeights<'a>>,
}

impl<'a> LayerWeights<'a> {
    /// The dense FFN's up projection (n_ff, n_embd). Only the dense FFN's paths ask: sparsity,
    /// profiling and the GPU executor refuse mixture-of-experts models before they run.
    pub fn dense_up(&self) -> QMatrix<'a> {
        self.ffn_up.expect("a dense FFN layer (mixture-of-experts layers are refused before)")
    }
}

/// A mixture-of-experts layer's weights (see `Moe`). The expert tensors are 3-D in the file,
/// one (rows, cols) matrix per expert back to back; each is held here as one matrix of
/// n_expert * rows rows, and `expert` cuts expert e's rows out.
#[derive(Clone)]
pub struct MoeWeights<'a> {
    pub router: QMatrix<'a>,    // (n_expert, n_embd), `ffn_gate_inp`
    pub gate_exps: QMatrix<'a>, // (n_expert * n_ff_exp, n_embd)
    pub up_exps: QMatrix<'a>,   // (n_expert * n_ff_exp, n_embd)
    pub down_exps: QMatrix<'a>, // (n_expert * n_embd, n_ff_exp)
    pub shared: Option<SharedExpert<'a>>,
    /// gpt-oss's biases: the router's and each expert's gate, up and down.
    pub biases: Option<MoeBiases>,
    /// gate_exps, up_exps and down_exps as the CPU's products read them where `Model::load`
    /// interleaved them (`interleaved_experts`), each whole; None where they read the file's
    /// layout. Every other reader (a GPU's upload) reads the file's.
    pub cpu_layout: [Option<Interleaved<'a>>; 3],
}

/// The biases of a mixture-of-experts layer (gpt-oss), expert e's at rows e of each.
#[derive(Clone)]
pub struct MoeBiases {
    pub router: Vec<f32>, // (n_expert)
    pub gate: Vec<f32>,   // (n_expert, n_ff_exp)
    pub up: Vec<f32>,     // (n_expert, n_ff_exp)
    pub down: Vec<f32>,   // (n_expert, n_embd)
}

/// Qwen2-MoE's shared expert: a SwiGLU FFN every token runs, scaled by sigmoid(gate_inp . x).
#[derive(Clone)]
pub struct SharedExpert<'a> {
    pub gate_inp: Vec<f32>, // (n_embd), `ffn_gate_inp_shexp`
    pub gate: QMatrix<'a>,  // (n_ff_shared, n_embd)
    pub up: QMatrix<'a>,    // (n_ff_shared, n_embd)
    pub down: QMatrix<'a>,  // (n_embd, n_ff_shared)
}

/// One expert's three matrices.
#[derive(Clone, Copy)]
pub struct Expert<'a> {
    pub gate: QMatrix<'a>, // (n_ff_exp, n_embd)
    pub up: QMatrix<'a>,   // (n_ff_exp, n_embd)
    pub down: QMatrix<'a>, // (n_embd, n_ff_exp)
}

impl<'a> MoeWeights<'a> {
    pub fn n_expert(&self) -> usize {
        self.router.rows
    }

    /// Expert e's gate, up and down as the CPU's products read them (`cpu_layout`).
    pub fn expert_for_cpu(&self, e: usize) -> [Weight<'a>; 3] {
        let ex = self.expert(e);
        let n_expert = self.n_expert();
        let pick = |file: QMatrix<'a>, cpu: Option<Interleaved<'a>>| match cpu {
            Some(m) => {
                let rows = m.rows / n_expert;
                Weight::Interleaved(m.rows_range(e * rows, (e + 1) * rows))
            }
            None => Weight::File(file),
        };
        [
            pick(ex.gate, self.cpu_layout[0]),
            pick(ex.up, self.cpu_layout[1]),
            pick(ex.down, self.cpu_layout[2]),
        ]
    }

    /// Expert e's matrices, views into the 3-D tensors.
    pub fn expert(&self, e: usize) -> Expert<'a> {
        let n_ff = self.gate_exps.rows / self.n_expert();
        let n_embd = self.down_exps.rows / self.n_expert();
        Expert {
            gate: self.gate_exps.rows_range(e * n_ff, (e + 1) * n_ff),
            up: self.up_exps.rows_range(e * n_ff, (e + 1) * n_ff),
            down: self.down_exps.rows_range(e * n_embd, (e + 1) * n_embd),
        }
    }
}

pub struct Weights<'a> {
    pub token_embd: QMatrix<'a>,            // (n_vocab, n_embd)
    pub position_embd: Option<QMatrix<'a>>, // (n_ctx_train + 2, n_embd), opt
    pub layers: Vec<LayerWeights<'a>>,
    pub output_norm: Vec<f32>,           // (n_embd)
    pub output_norm_b: Option<Vec<f32>>, // (n_embd), LayerNorm families
    pub output: QMatrix<'a>,             // (n_vocab, n_embd); token_embd when tied
    pub rope_freqs: Option<Vec<f32>>, // (rope_dim / 2), Llama 3: each frequency is divided by its factor
    /// LongRoPE (Phi-3 128k): frequency factors as `rope_freqs`, [short, long] (rope_dim / 2
    /// each): the long ones for sessions whose context exceeds `Config::rope_ctx_orig`.
    pub rope_factors: Option<[Vec<f32>; 2]>,
}

impl Weights<'_> {
    /// The frequency factors a session of `n_ctx` positions uses, if any (llama.cpp's
    /// `get_rope_factors`).
    pub fn rope_factors(&self, c: &Config, n_ctx: usize) -> Option<&[f32]> {
        match (&self.rope_freqs, &self.rope_factors) {
            (Some(f), _) => Some(f),
            (None, Some([short, long])) => Some(if n_ctx > c.rope_ctx_orig { long } else { short }),
            (None, None) => None,
        }
    }
}

/// Input-major (transposed) copies of one kind of layer matrix, built on first use: for the
/// down projection of files that lack `ffn_down_t`, and for the matrices input sparsity reads.
struct Transposed {
    dtype: DType,
    layers: Vec<Option<memmap2::MmapMut>>, // `gguf::weight_buffer`s
}

/// The layer matrices input sparsity reads through an input-major copy (the down projection
/// reads `down_t`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerMatrix {
    Q = 0,
    K = 1,
    V = 2,
    O = 3,
    Gate = 4,
    Up = 5,
}

impl LayerMatrix {
    pub fn of<'a>(self, lw: &LayerWeights<'a>) -> Option<QMatrix<'a>> {
        match self {
            LayerMatrix::Q => Some(lw.wq),
            LayerMatrix::K => Some(lw.wk),
            LayerMatrix::V => Some(lw.wv),
            LayerMatrix::O => Some(lw.wo),
            LayerMatrix::Gate => lw.ffn_gate,
            LayerMatrix::Up => lw.ffn_up,
        }
    }
}

/// Matrices that read one input vector, so one score and one cut-off choose the inputs they
/// all skip: q, k and v read the normed layer input; the output projection reads the attention
/// output; gate and up read the normed FFN input; down reads the FFN activations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InputGroup {
    Qkv = 0,
    Out = 1,
    FfnIn = 2,
    Down = 3,
}

impl InputGroup {
    pub const ALL: [InputGroup; 4] =
        [InputGroup::Qkv, InputGroup::Out, InputGroup::FfnIn, InputGroup::Down];

    /// The group's matrices read through input-major copies, in output order (gateless FFNs
    /// have no gate; down reads `down_t`, so its list is empty).
    pub fn matrices(self, lw: &LayerWeights) -> &'static [LayerMatrix] {
        match self {
            InputGroup::Qkv => &[LayerMatrix::Q, LayerMatrix::K, LayerMatrix::V],
            InputGroup::Out => &[LayerMatrix::O],
            InputGroup::FfnIn if lw.ffn_gate.is_some() => &[LayerMatrix::Gate, LayerMatrix::Up],
            InputGroup::FfnIn => &[LayerMatrix::Up],
            InputGroup::Down => &[],
        }
    }
}

pub struct Model {
    pub config: Config,
    // Borrows from `file`'s memory map. Declared before `file` so it is dropped first; the map
    // never moves (it is a kernel mapping, not inline data), so the borrow stays valid.
    pub weights: Weights<'static>,
    pub file: GgufFile,
    /// The interleaved copies the CPU reads experts from (`interleaved_experts`), borrowed by
    /// `weights` as the file's map is.
    _interleaved: Vec<memmap2::Mmap>,
    built_down_t: OnceLock<Transposed>,
    /// Per layer, the FFN's rows bundled by neuron, built on first use (`neuron_bundles`).
    built_bundles: OnceLock<Vec<memmap2::MmapMut>>,
    /// Input-major copies per `LayerMatrix`, built on first use by input sparsity.
    built_input_major: [OnceLock<Transposed>; 6],
    /// Per layer and `InputGroup`, the norm of each input's column across the group's
    /// matrices: sqrt(sum over matrices W of |W[:, i]|^2), the weight of input i's score.
    input_norms: OnceLock<Vec<[Vec<f32>; 4]>>,
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
            Some(v) => v
                .as_str()
                .ok_or_else(|| Error::Model("general.architecture is not a string".into()))?
                .to_string(),
            None => {
                return Err(Error::Model(
                    "required metadata key general.architecture is missing".into(),
                ))
            }
        };
        let (family, rope_style) = match arch.as_str() {
            "llama" | "mistral" | "bamboo" => (Family::Llama, RopeStyle::Normal),
            "qwen2" | "qwen3" | "gemma" | "gemma2" | "gemma3" | "phi3" | "qwen2moe"
            | "qwen3moe" | "olmoe" | "smallthinker" | "gpt-oss" => (Family::Llama, RopeStyle::NeoX),
            "falcon" => (Family::Falcon, RopeStyle::NeoX),
            "opt" => (Family::Opt, RopeStyle::None),
            a if OTHER_MOE_ARCHITECTURES.contains(&a) => {
                return Err(Error::UnsupportedMoe(arch, MOE_ARCHITECTURES.into()))
            }
            _ => return Err(Error::UnknownArchitecture(arch, ARCHITECTURES.join(", "))),
        };
        let k = |name: &str| format!("{arch}.{name}");
        let n_embd = required(meta_usize(file, &k("embedding_length"))?, &k("embedding_length"))?;
        let n_layer = required(meta_usize(file, &k("block_count"))?, &k("block_count"))?;
        let n_ff =
            required(meta_usize(file, &k("feed_forward_length"))?, &k("feed_forward_length"))?;
        let n_head =
            required(meta_usize(file, &k("attention.head_count"))?, &k("attention.head_count"))?;
        let n_head_kv = meta_usize(file, &k("attention.head_count_kv"))?.unwrap_or(n_head);
        if n_embd == 0 || n_layer == 0 || n_ff == 0 || n_head == 0 || n_head_kv == 0 {
            return Err(Error::Model(
                "embedding length, block count, FFN length and head counts must be > 0".into(),
            ));
        }
        if n_head % n_head_kv != 0 {
            return Err(Error::Model(format!(
                "head_count {n_head} is not a multiple of head_count_kv {n_head_kv}"
            )));
        }
        let head_dim = match meta_usize(file, &k("attention.key_length"))? {
            Some(d) => d,
            None if n_embd % n_head == 0 => n_embd / n_head,
            None => {
                return Err(Error::Model(format!(
                    "embedding length {n_embd} is not divisible by {n_head} heads"
                )))
            }
        };
        let rope_dim = match rope_style {
            RopeStyle::None => 0,
            _ => meta_usize(file, &k("rope.dimension_count"))?.unwrap_or(head_dim),
        };
        if rope_dim > head_dim || rope_dim % 2 != 0 || head_dim % 2 != 0 {
            return Err(Error::Model(format!(
                "rope dimension {rope_dim} does not fit head size {head_dim}"
            )));
        }
        let norm_eps = match family {
            Family::Llama => {
                meta_f32(file, &k("attention.layer_norm_rms_epsilon"))?.unwrap_or(1e-5)
            }
            _ => meta_f32(file, &k("attention.layer_norm_epsilon"))?.unwrap_or(1e-5),
        };
        let embd = file
            .tensor("token_embd.weight")
            .ok_or_else(|| Error::Model("required tensor token_embd.weight is missing".into()))?;
        let n_vocab = embd.shape()[0] as usize;
        let powerinfer = file.magic == Magic::Powerinfer;
        let n_ctx_train = match (family, file.tensor("position_embd.weight")) {
            // the learned table bounds the context, whatever the metadata says
            (Family::Opt, Some(t)) => (t.shape()[0] as usize).saturating_sub(OPT_POSITION_OFFSET),
            _ => meta_usize(file, &k("context_length"))?.unwrap_or(2048),
        };
        let gemma = matches!(arch.as_str(), "gemma" | "gemma2" | "gemma3");
        // Gemma's query_pre_attn_scalar, as llama.cpp derives it: n_embd / n_head for the 27B
        // models (Gemma 2: 46 layers, Gemma 3: 62), the head size otherwise
        let big_gemma = (arch == "gemma2" && n_layer == 46) || (arch == "gemma3" && n_layer == 62);
        let attn_scale =
            1.0 / (if big_gemma { (n_embd / n_head) as f32 } else { head_dim as f32 }).sqrt();
        let rope_base = meta_f32(file, &k("rope.freq_base"))?.unwrap_or(10000.0);
        let scaling_type = file.get(&k("rope.scaling.type")).map(|v| v.as_str());
        let factor = || -> Result<f32> {
            let factor = meta_f32(file, &k("rope.scaling.factor"))?.unwrap_or(1.0);
            if factor > 0.0 && factor.is_finite() {
                Ok(factor)
            } else {
                Err(Error::Model(format!(
                    "{} = {factor} is not a positive factor",
                    k("rope.scaling.factor")
                )))
            }
        };
        let rope_ctx_orig =
            meta_usize(file, &k("rope.scaling.original_context_length"))?.unwrap_or(n_ctx_train);
        // llama.cpp's defaults: YaRN's original context is the trained one, beta 32 and 1
        let yarn_f32 = |key: &str, default: f32| {
            meta_f32(file, &k(&format!("rope.scaling.yarn_{key}"))).map(|v| v.unwrap_or(default))
        };
        let (rope_freq_scale, rope_yarn) = match scaling_type {
            None | Some(Some("none")) => (1.0, None),
            Some(Some("linear")) => (1.0 / factor()?, None),
            Some(Some("yarn")) => {
                let yarn = Yarn::new(
                    rope_dim,
                    rope_ctx_orig,
                    rope_base,
                    yarn_f32("beta_fast", 32.0)?,
                    yarn_f32("beta_slow", 1.0)?,
                    yarn_f32("ext_factor", 1.0)?,
                );
                (1.0 / factor()?, Some(yarn))
            }
            // llama3 scaling is baked into the file's `rope_freqs` factors, LongRoPE's into
            // `rope_factors_short/long`
            Some(Some("llama3")) => (1.0, None),
            Some(Some("longrope")) if file.tensor("rope_factors_long.weight").is_some() => {
                (1.0, None)
            }
            Some(other) => {
                return Err(Error::Model(format!(
                    "{} = {:?} is not supported (supported: none, linear, yarn, llama3, longrope)",
                    k("rope.scaling.type"),
                    other.unwrap_or("a non-string")
                )))
            }
        };
        // the magnitude llama.cpp gives cos and sin: YaRN's attention factor (its
        // `llama_context` constructor cancels ggml's own 1 + 0.1 ln(1 / freq_scale), then
        // `rope_yarn` applies it again), times the file's attn_factor
        let mut rope_magnitude = meta_f32(file, &k("rope.scaling.attn_factor"))?.unwrap_or(1.0);
        if rope_yarn.is_some_and(|y| y.ext_factor != 0.0) {
            let factor = 1.0 / rope_freq_scale;
            let mscale = |m: f32| if factor <= 1.0 { 1.0 } else { 0.1 * m * factor.ln() + 1.0 };
            let log_mul = meta_f32(file, &k("rope.scaling.yarn_log_multiplier"))?.unwrap_or(0.0);
            let attn = if log_mul != 0.0 { mscale(1.0) / mscale(log_mul) } else { mscale(1.0) };
            rope_magnitude *=
                attn / (1.0 + 0.1 * factor.ln()) * (1.0 + 0.1 * (1.0 / rope_freq_scale).ln());
        }
        if file.tensor("rope_factors_long.weight").is_some()
            != file.tensor("rope_factors_short.weight").is_some()
        {
            return Err(Error::Model(format!(
                "{arch}: LongRoPE needs both rope_factors_long and rope_factors_short"
            )));
        }
        let (sliding_window, swa_pattern) = match arch.as_str() {
            "gemma2" => (meta_usize(file, &k("attention.sliding_window"))?.unwrap_or(4096), 2),
            "gemma3" => (meta_usize(file, &k("attention.sliding_window"))?.unwrap_or(0), 6),
            // SmallThinker: a window in the file means llama.cpp's 4096 (whatever its value),
            // over all but the first layer of every `sliding_window_pattern` (4 by default)
            "smallthinker" => match meta_usize(file, &k("attention.sliding_window"))? {
                Some(w) if w > 0 => {
                    let key = k("attention.sliding_window_pattern");
                    let p = meta_usize(file, &key)?.unwrap_or(4);
                    if p == 0 {
                        return Err(Error::Model(format!("{key} must be > 0")));
                    }
                    (4096, p)
                }
                _ => (0, 0),
            },
            // gpt-oss: every other layer from the first slides (128 positions in its files)
            "gpt-oss" => {
                let key = k("attention.sliding_window");
                (required(meta_usize(file, &key)?, &key)?, 2)
            }
            // llama.cpp runs Phi-3's window as full attention (its ggml-org/llama.cpp#13676)
            _ => (0, 0),
        };
        // SmallThinker's full-attention layers (with a window: one in four) have no RoPE
        let nope_step = if arch == "smallthinker" && sliding_window > 0 { 4 } else { 0 };
        let rope_base_swa = match arch.as_str() {
            "gemma3" => 10000.0,
            "smallthinker" => meta_f32(file, &k("rope.freq_base_swa"))?.unwrap_or(rope_base),
            _ => rope_base,
        };
        let softcap = |name: &str, default: f32| -> Result<f32> {
            Ok(meta_f32(file, &k(name))?.unwrap_or(default))
        };
        let (attn_softcap, final_softcap) = match arch.as_str() {
            "gemma2" => (
                softcap("attn_logit_softcapping", 50.0)?,
                softcap("final_logit_softcapping", 30.0)?,
            ),
            "gemma3" => (0.0, softcap("final_logit_softcapping", 0.0)?),
            _ => (0.0, 0.0),
        };
        let moe = Moe::from_file(file, &arch, n_ff)?;
        Ok(Config {
            moe,
            family,
            n_vocab,
            n_embd,
            n_layer,
            n_ff,
            n_head,
            n_head_kv,
            head_dim,
            n_ctx_train,
            rope_ctx_orig,
            rope_dim,
            rope_base,
            rope_style,
            norm_eps,
            ffn_activation: FfnActivation::from_file(file, &arch)?,
            tied_output: file.tensor("output.weight").is_none(),
            powerinfer,
            sparse_threshold: meta_f32(file, "powerinfer.sparse_threshold")?.unwrap_or(0.0),
            embed_scale: if gemma { (n_embd as f32).sqrt() } else { 1.0 },
            attn_scale,
            attn_softcap,
            final_softcap,
            sliding_window,
            swa_pattern,
            swa_dense_first: arch == "smallthinker",
            swa_own_rope: arch != "gpt-oss",
            ffn_norm_tensor: if arch == "gpt-oss" { "post_attention_norm" } else { "ffn_norm" },
            attn_sinks: arch == "gpt-oss",
            nope_step,
            rope_base_swa,
            rope_freq_scale,
            rope_yarn,
            rope_magnitude,
            architecture: arch,
        })
    }
}

/// Looks up a matrix, checks its type and shape, and borrows its bytes.
fn matrix<'a>(file: &'a GgufFile, name: &str, rows: usize, cols: usize) -> Result<QMatrix<'a>> {
    stacked_matrix(file, name, &[rows, cols], rows, cols)
}

/// A 3-D expert tensor, (n_expert, rows, cols), as one matrix of n_expert * rows rows.
fn experts<'a>(
    file: &'a GgufFile,
    name: &str,
    n_expert: usize,
    rows: usize,
    cols: usize,
) -> Result<QMatrix<'a>> {
    stacked_matrix(file, name, &[n_expert, rows, cols], n_expert * rows, cols)
}

/// A tensor of shape `shape` whose bytes are `rows` rows of `cols` elements.
fn stacked_matrix<'a>(
    file: &'a GgufFile,
    name: &str,
    shape: &[usize],
    rows: usize,
    cols: usize,
) -> Result<QMatrix<'a>> {
    let t = file
        .tensor(name)
        .ok_or_else(|| Error::Model(format!("required tensor {name} is missing")))?;
    let dtype = supported(t)?;
    if !t.shape().iter().copied().eq(shape.iter().map(|&d| d as u64)) {
        return Err(Error::Model(format!(
            "tensor {name} has shape {:?}, expected {shape:?}",
            t.shape()
        )));
    }
    let data = file.tensor_bytes(t);
    let align = dtype.traits().align;
    if !(data.as_ptr() as usize).is_multiple_of(align) {
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
        return Err(Error::Model(format!(
            "tensor {name} has {} elements, expected {n}",
            t.n_elements()
        )));
    }
    let mut out = vec![0.0; n];
    quant::dequantize_row(dtype, file.tensor_bytes(t), &mut out);
    Ok(Some(out))
}

fn required_vector(file: &GgufFile, name: &str, n: usize) -> Result<Vec<f32>> {
    vector(file, name, n)?.ok_or_else(|| Error::Model(format!("required tensor {name} is missing")))
}

fn missing(name: &str) -> Error {
    Error::Model(format!("required tensor {name} is missing"))
}

fn optional_matrix<'a>(
    file: &'a GgufFile,
    name: &str,
    rows: usize,
    cols: usize,
) -> Result<Option<QMatrix<'a>>> {
    if file.tensor(name).is_none() {
        return Ok(None);
    }
    matrix(file, name, rows, cols).map(Some)
}

/// A layer's predictor, if the file has one; its hidden size comes from `fc1`.
fn predictor<'a>(file: &'a GgufFile, i: usize, c: &Config) -> Result<Option<Predictor<'a>>> {
    let (n1, n2) = (format!("blk.{i}.fc1.weight"), format!("blk.{i}.fc2.weight"));
    let (t1, t2) = match (file.tensor(&n1), file.tensor(&n2)) {
        (None, None) => return Ok(None),
        (Some(t1), Some(t2)) => (t1, t2),
        _ => {
            return Err(Error::Model(format!(
                "layer {i} has only one of {n1} and {n2}; a predictor needs both"
            )))
        }
    };
    let (s1, s2) = (t1.shape(), t2.shape());
    let hidden = if s1.len() == 2 { s1[0] as usize } else { 0 };
    if s1.len() != 2 || s1[1] != c.n_embd as u64 || hidden == 0 {
        return Err(Error::Model(format!(
            "predictor {n1} has shape {s1:?}, expected [hidden, {}] to read the layer's {}-wide input",
            c.n_embd, c.n_embd
        )));
    }
    if s2 != [c.n_ff as u64, hidden as u64] {
        return Err(Error::Model(format!(
            "predictor {n2} has shape {s2:?}, expected [{}, {hidden}] ({} FFN neurons, hidden size {hidden} from {n1})",
            c.n_ff, c.n_ff
        )));
    }
    Ok(Some(Predictor {
        fc1: matrix(file, &n1, hidden, c.n_embd)?,
        fc2: matrix(file, &n2, c.n_ff, hidden)?,
    }))
}

/// A layer's FFN tensors: the dense ones, or the experts.
struct LayerFfn<'a> {
    gate: Option<QMatrix<'a>>,
    up: Option<QMatrix<'a>>,
    up_b: Option<Vec<f32>>,
    down: Option<QMatrix<'a>>,
    down_t: Option<QMatrix<'a>>,
    down_b: Option<Vec<f32>>,
    moe: Option<MoeWeights<'a>>,
}

impl<'a> LayerFfn<'a> {
    fn of_experts(moe: MoeWeights<'a>) -> LayerFfn<'a> {
        LayerFfn {
            gate: None,
            up: None,
            up_b: None,
            down: None,
            down_t: None,
            down_b: None,
            moe: Some(moe),
        }
    }
}

/// Layer i's dense FFN.
fn dense_ffn<'a>(file: &'a GgufFile, i: usize, c: &Config) -> Result<LayerFfn<'a>> {
    let n = |s: &str| format!("blk.{i}.{s}");
    // down projection: neuron-major in PowerInfer files, plain otherwise
    let down_t = optional_matrix(file, &n("ffn_down_t.weight"), c.n_ff, c.n_embd)?;
    let down = optional_matrix(file, &n("ffn_down.weight"), c.n_embd, c.n_ff)?;
    if down_t.is_none() && down.is_none() {
        return Err(if c.powerinfer {
            Error::Model(format!(
                "PowerInfer (PWRI) file has no {}: its down projection must be stored transposed",
                n("ffn_down_t.weight")
            ))
        } else {
            missing(&n("ffn_down.weight"))
        });
    }
    let down_b = match vector(file, &n("ffn_down_t.bias"), c.n_embd)? {
        Some(b) => Some(b),
        None => vector(file, &n("ffn_down.bias"), c.n_embd)?,
    };
    // gate and up: separate, or fused [gate; up] rows in ffn_up (Phi-3)
    let fused_up = c.ffn_activation.has_gate()
        && file.tensor(&n("ffn_gate.weight")).is_none()
        && file
            .tensor(&n("ffn_up.weight"))
            .is_some_and(|t| t.shape().first() == Some(&(2 * c.n_ff as u64)));
    let (gate, up) = if fused_up {
        let gate_up = matrix(file, &n("ffn_up.weight"), 2 * c.n_ff, c.n_embd)?;
        (Some(gate_up.rows_range(0, c.n_ff)), gate_up.rows_range(c.n_ff, 2 * c.n_ff))
    } else {
        let gate = if c.ffn_activation.has_gate() {
            Some(matrix(file, &n("ffn_gate.weight"), c.n_ff, c.n_embd)?)
        } else {
            None
        };
        (gate, matrix(file, &n("ffn_up.weight"), c.n_ff, c.n_embd)?)
    };
    Ok(LayerFfn {
        gate,
        up: Some(up),
        up_b: vector(file, &n("ffn_up.bias"), c.n_ff)?,
        down,
        down_t,
        down_b,
        moe: None,
    })
}

/// Layer i's experts, router and shared expert, as llama.cpp's converter writes them.
fn moe_weights<'a>(file: &'a GgufFile, i: usize, c: &Config, moe: &Moe) -> Result<MoeWeights<'a>> {
    let n = |s: &str| format!("blk.{i}.{s}");
    let (e, ff, dim) = (moe.n_expert, moe.n_ff_exp, c.n_embd);
    if !c.ffn_activation.has_gate() {
        return Err(Error::Model(format!(
            "{}: experts with the {} activation are not supported (experts have a gate: swiglu, geglu, reglu or dreglu)",
            c.architecture,
            c.ffn_activation.name()
        )));
    }
    let shared = match moe.n_ff_shared {
        0 => None,
        sh => Some(SharedExpert {
            gate_inp: required_vector(file, &n("ffn_gate_inp_shexp.weight"), dim)?,
            gate: matrix(file, &n("ffn_gate_shexp.weight"), sh, dim)?,
            up: matrix(file, &n("ffn_up_shexp.weight"), sh, dim)?,
            down: matrix(file, &n("ffn_down_shexp.weight"), dim, sh)?,
        }),
    };
    // gpt-oss's biases, each required
    let bias = |name: &str, len: usize| required_vector(file, &n(&format!("{name}.bias")), len);
    let biases = match moe.biased {
        false => None,
        true => Some(MoeBiases {
            router: bias("ffn_gate_inp", e)?,
            gate: bias("ffn_gate_exps", e * ff)?,
            up: bias("ffn_up_exps", e * ff)?,
            down: bias("ffn_down_exps", e * dim)?,
        }),
    };
    Ok(MoeWeights {
        router: matrix(file, &n("ffn_gate_inp.weight"), e, dim)?,
        gate_exps: experts(file, &n("ffn_gate_exps.weight"), e, ff, dim)?,
        up_exps: experts(file, &n("ffn_up_exps.weight"), e, ff, dim)?,
        down_exps: experts(file, &n("ffn_down_exps.weight"), e, dim, ff)?,
        shared,
        biases,
        cpu_layout: [None; 3],
    })
}

/// Whether the CPU reads tensor `t` of a model configured as `c` interleaved
/// (`quant::interleaved`, built by `Model::load` when it copies the weights into memory; the
/// copy leaves the file's layout in the file's map for every other reader): an expert tensor
/// (gate, up or down) in a type with an interleaved layout (Q4_0, Q4_K, MXFP4) whose
/// experts' shapes fit, where the layout's SIMD kernels run (AVX2 and up), of a model whose
/// experts run densely (a ReLU-family gate has its experts read single up rows, which the
/// layout does not keep together). A 4-layer Qwen3-30B-A3B-shape model against llama.cpp
/// (`benches/moe_vs_llamacpp.py`, docs/performance.md): Q4_0 on the 2-core AMD EPYC (Zen 4),
/// AVX-512 prefill 1.20-1.52x -> 1.68-2.00x, decode 1.06-1.12x -> 1.10-1.37x; Q4_K_M (its
/// gate and up Q4_K) on a 2-core Intel Xeon, prefill 1.44-1.49x -> 1.91-1.93x at AVX-512,
/// 1.45-1.47x -> 1.63-1.69x at AVX-VNNI, 1.23x -> 1.39x at AVX2.
pub fn interleaved_experts(c: &Config, t: &TensorInfo) -> bool {
    let is_expert = ["ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight"]
        .iter()
        .any(|s| t.name.starts_with("blk.") && t.name.ends_with(&format!(".{s}")));
    let shape = t.shape();
    is_expert
        && c.moe.is_some()
        && !matches!(c.ffn_activation, FfnActivation::ReGlu | FfnActivation::DReGlu)
        && crate::simd::simd_level().has_avx2()
        && shape.len() == 3
        && t.dtype
            .is_some_and(|d| quant::interleaved::fits(d, shape[1] as usize, shape[2] as usize))
}

impl Weights<'_> {
    fn load<'a>(file: &'a GgufFile, c: &Config) -> Result<Weights<'a>> {
        let token_embd = matrix(file, "token_embd.weight", c.n_vocab, c.n_embd)?;
        // (no capacity from `n_layer`: it is the file's word until its layers' tensors are found,
        // and a corrupt count would abort on the allocation)
        let mut layers = Vec::new();
        for i in 0..c.n_layer {
            let n = |s: &str| format!("blk.{i}.{s}");
            // attention projections: separate, or fused [q; k; v] rows (Falcon, Phi-3)
            let (wq, wk, wv) = match c.family {
                _ if file.tensor(&n("attn_qkv.weight")).is_some() => {
                    let qkv =
                        matrix(file, &n("attn_qkv.weight"), c.q_dim() + 2 * c.kv_dim(), c.n_embd)?;
                    let (q, kv) = (c.q_dim(), c.kv_dim());
                    (
                        qkv.rows_range(0, q),
                        qkv.rows_range(q, q + kv),
                        qkv.rows_range(q + kv, q + 2 * kv),
                    )
                }
                _ => (
                    matrix(file, &n("attn_q.weight"), c.q_dim(), c.n_embd)?,
                    matrix(file, &n("attn_k.weight"), c.kv_dim(), c.n_embd)?,
                    matrix(file, &n("attn_v.weight"), c.kv_dim(), c.n_embd)?,
                ),
            };
            let ffn = match &c.moe {
                Some(moe) => LayerFfn::of_experts(moe_weights(file, i, c, moe)?),
                None => dense_ffn(file, i, c)?,
            };
            let head_norm = |name: &str, whole: usize| match file.tensor(&n(name)) {
                // OLMoE normalises q and k whole, not per head
                Some(t) if t.n_elements() == whole as u64 && whole != c.head_dim => {
                    vector(file, &n(name), whole)
                }
                _ => vector(file, &n(name), c.head_dim),
            };
            let ffn_norm_name = n(&format!("{}.weight", c.ffn_norm_tensor));
            let ffn_norm = match c.family {
                Family::Falcon => None,
                _ => Some(required_vector(file, &ffn_norm_name, c.n_embd)?),
            };
            // (a norm the FFN's input takes is not also the attention output's)
            let attn_post_norm = match ffn_norm_name.ends_with("post_attention_norm.weight") {
                true => None,
                false => vector(file, &n("post_attention_norm.weight"), c.n_embd)?,
            };
            layers.push(LayerWeights {
                attn_norm: required_vector(file, &n("attn_norm.weight"), c.n_embd)?,
                attn_norm_b: vector(file, &n("attn_norm.bias"), c.n_embd)?,
                attn_norm_2: vector(file, &n("attn_norm_2.weight"), c.n_embd)?,
                attn_norm_2_b: vector(file, &n("attn_norm_2.bias"), c.n_embd)?,
                wq,
                q_norm: head_norm("attn_q_norm.weight", c.q_dim())?,
                k_norm: head_norm("attn_k_norm.weight", c.kv_dim())?,
                wk,
                wv,
                bq: vector(file, &n("attn_q.bias"), c.q_dim())?,
                bk: vector(file, &n("attn_k.bias"), c.kv_dim())?,
                bv: vector(file, &n("attn_v.bias"), c.kv_dim())?,
                wo: matrix(file, &n("attn_output.weight"), c.n_embd, c.q_dim())?,
                bo: vector(file, &n("attn_output.bias"), c.n_embd)?,
                attn_sinks: match c.attn_sinks {
                    true => Some(required_vector(file, &n("attn_sinks.weight"), c.n_head)?),
                    false => None,
                },
                attn_post_norm,
                ffn_post_norm: vector(file, &n("post_ffw_norm.weight"), c.n_embd)?,
                ffn_norm,
                ffn_norm_b: vector(file, &n("ffn_norm.bias"), c.n_embd)?,
                ffn_gate: ffn.gate,
                ffn_up: ffn.up,
                ffn_up_b: ffn.up_b,
                ffn_down: ffn.down,
                ffn_down_t: ffn.down_t,
                ffn_down_b: ffn.down_b,
                predictor: predictor(file, i, c)?,
                moe: ffn.moe,
            });
        }
        let output = if c.tied_output {
            token_embd
        } else {
            matrix(file, "output.weight", c.n_vocab, c.n_embd)?
        };
        let position_embd = match c.family {
            Family::Opt => {
                let t = file
                    .tensor("position_embd.weight")
                    .ok_or_else(|| missing("position_embd.weight"))?;
                Some(matrix(file, "position_embd.weight", t.shape()[0] as usize, c.n_embd)?)
            }
            _ => None,
        };
        Ok(Weights {
            token_embd,
            position_embd,
            layers,
            output_norm: required_vector(file, "output_norm.weight", c.n_embd)?,
            output_norm_b: vector(file, "output_norm.bias", c.n_embd)?,
            output,
            rope_freqs: vector(file, "rope_freqs.weight", c.rope_dim / 2)?,
            rope_factors: match (
                vector(file, "rope_factors_short.weight", c.rope_dim / 2)?,
                vector(file, "rope_factors_long.weight", c.rope_dim / 2)?,
            ) {
                (Some(short), Some(long)) => Some([short, long]),
                _ => None,
            },
        })
    }
}

/// Builds the interleaved copies of the expert tensors `interleaved_experts` names, in
/// parallel, and points each layer's `MoeWeights::cpu_layout` at them.
fn interleave_experts(
    file: &GgufFile,
    c: &Config,
    weights: &mut Weights<'_>,
) -> Result<Vec<memmap2::Mmap>> {
    let mut buffers = Vec::new();
    for (l, lw) in weights.layers.iter_mut().enumerate() {
        let Some(mw) = lw.moe.as_mut() else { continue };
        let n_expert = mw.n_expert();
        let names = ["ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"];
        let mats = [mw.gate_exps, mw.up_exps, mw.down_exps];
        for (i, (m, name)) in mats.into_iter().zip(names).enumerate() {
            let name = format!("blk.{l}.{name}.weight");
            let Some(t) = file.tensor(&name) else { continue };
            if !interleaved_experts(c, t) {
                continue;
            }
            let rows = m.rows / n_expert;
            let io = |source| Error::Io { path: name.clone().into(), source };
            let bytes = quant::interleaved::matrix_bytes(m.dtype, m.rows, m.cols);
            let mut buf = crate::gguf::weight_buffer(bytes).map_err(io)?;
            let (per_expert, per_out) = (m.data.len() / n_expert, bytes / n_expert);
            buf[..bytes].par_chunks_mut(per_out).zip(m.data.par_chunks(per_expert)).for_each(
                |(out, src)| quant::interleaved::interleave(m.dtype, src, rows, m.cols, out),
            );
            let buf = buf.make_read_only().map_err(io)?;
            // SAFETY: the map is moved into the Model with `weights`, never written and never
            // moves (a kernel mapping), so the view lives as long as the weights that hold it.
            let data: &[u8] = unsafe { std::slice::from_raw_parts(buf.as_ptr(), bytes) };
            mw.cpu_layout[i] = Some(Interleaved::new(m.dtype, m.rows, m.cols, data));
            buffers.push(buf);
        }
    }
    Ok(buffers)
}

impl Model {
    /// Opens a GGUF file and checks every tensor the architecture needs. `threads` = 0 picks the
    /// number of physical cores rayon sees. `in_memory`: the weights are copied out of the
    /// file's map into anonymous memory (`GgufFile::read_into_memory`), else read in place.
    pub fn load(path: &Path, threads: usize, in_memory: bool) -> Result<Model> {
        let mut file = GgufFile::open(path)?;
        let config = Config::from_file(&file)?;
        if in_memory {
            // (the experts the CPU reads interleaved are read from the file's map by the rest)
            file.read_into_memory(path, |t| interleaved_experts(&config, t))?;
        }
        let mut weights = Weights::load(&file, &config)?;
        let threads = if threads == 0 {
            std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
        } else {
            threads
        };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("powerinfer-{i}"))
            .build()
            .map_err(|e| Error::InvalidArgument(format!("cannot start {threads} threads: {e}")))?;
        // (with the file read in place, the weights stay its map's: a model larger than memory
        // still loads)
        let interleaved = match in_memory {
            true => pool.install(|| interleave_experts(&file, &config, &mut weights))?,
            false => Vec::new(),
        };
        file.release_left_in_file();
        // SAFETY: see the field comment on `Model::weights`: the slices point into the memory map
        // owned by `file` and into the maps of `_interleaved`, which live exactly as long as the
        // Model (kernel mappings: they never move).
        let weights: Weights<'static> =
            unsafe { std::mem::transmute::<Weights<'_>, Weights<'static>>(weights) };
        Ok(Model {
            config,
            weights,
            file,
            _interleaved: interleaved,
            built_down_t: OnceLock::new(),
            built_bundles: OnceLock::new(),
            built_input_major: Default::default(),
            input_norms: OnceLock::new(),
            pool,
        })
    }

    /// Refuses `what` on a mixture-of-experts model, whose routed experts run densely: the
    /// neuron-level machinery (sparsity, calibration, capture) reads a dense FFN.
    pub fn dense_ffn_only(&self, what: &str) -> Result<()> {
        match self.config.moe {
            Some(_) => Err(Error::InvalidArgument(format!(
                "{what}: not supported on mixture-of-experts models ({} is one); they run their routed experts densely",
                self.config.architecture
            ))),
            None => Ok(()),
        }
    }

    /// True when every layer has a predictor.
    pub fn has_predictors(&self) -> bool {
        self.weights.layers.iter().all(|l| l.predictor.is_some())
    }

    /// Layer `l`'s neuron-major down projection (n_ff, n_embd): the file's `ffn_down_t`, or a
    /// transposed copy of `ffn_down` built for all layers on the first call (see `transpose`).
    pub fn down_t(&self, l: usize) -> QMatrix<'_> {
        if let Some(m) = self.weights.layers[l].ffn_down_t {
            return m;
        }
        let built = self.built_down_t.get_or_init(|| {
            self.transpose(|lw| match (lw.ffn_down_t, lw.ffn_down) {
                (None, Some(d)) => Some(d),
                _ => None,
            })
        });
        Self::view(built, l, self.config.n_ff, self.config.n_embd)
    }

    /// Layer `l`'s FFN rows bundled by neuron: for neuron j in turn, its gate row (if the FFN
    /// has a gate), up row and `down_t` row side by side (`matmul::interleave_rows`). One
    /// token's sparse operator reads a selected neuron as one contiguous run of its bundle, not
    /// three rows scattered over three matrices: DRAM serves runs faster than scattered rows
    /// (`cargo bench --bench sparse_ffn`, the "bundle" rows). Built for all layers on the first
    /// call; costs the FFN's bytes (with `down_t`'s) once more in memory.
    pub fn neuron_bundles(&self, l: usize) -> &[u8] {
        let built = self.built_bundles.get_or_init(|| {
            self.down_t(0); // built first, outside the parallel loop
            self.install(|| {
                self.weights
                    .layers
                    .par_iter()
                    .enumerate()
                    .map(|(l, lw)| {
                        let mats: Vec<QMatrix> = lw
                            .ffn_gate
                            .into_iter()
                            .chain([lw.dense_up(), self.down_t(l)])
                            .collect();
                        let bytes =
                            self.config.n_ff * mats.iter().map(|m| m.row_bytes()).sum::<usize>();
                        let mut out = crate::gguf::weight_buffer(bytes)
                            .expect("anonymous memory for the neuron bundles");
                        crate::matmul::interleave_rows(&mats, &mut out[..bytes]);
                        out
                    })
                    .collect()
            })
        });
        &built[l]
    }

    /// Layer `l`'s matrix `m` input-major, (cols, rows) of the original: row i is what input i
    /// adds to the output per unit. Built for all layers on the first call (see `transpose`);
    /// None for a gate the layer does not have.
    pub fn input_major(&self, l: usize, m: LayerMatrix) -> Option<QMatrix<'_>> {
        let src = m.of(&self.weights.layers[l])?;
        let built =
            self.built_input_major[m as usize].get_or_init(|| self.transpose(|lw| m.of(lw)));
        Some(Self::view(built, l, src.cols, src.rows))
    }

    /// Layer `l`'s column norms of the matrices of group `g`, one per input (see `input_norms`).
    pub fn input_norms(&self, l: usize, g: InputGroup) -> &[f32] {
        &self.input_norms.get_or_init(|| self.build_input_norms())[l][g as usize]
    }

    fn view(built: &Transposed, l: usize, rows: usize, cols: usize) -> QMatrix<'_> {
        let data = built.layers[l].as_deref().expect("built for every layer");
        QMatrix {
            dtype: built.dtype,
            rows,
            cols,
            data: &data[..rows * built.dtype.row_bytes(cols)],
        }
    }

    /// Transposed copies of the matrix `pick` gives for each layer (None: no copy). The copy
    /// keeps float types as they are (F32, or F16 for F16/BF16) and stores quantized sources as
    /// Q8_0, whose rounding is far below a 4-bit source's steps; it costs one pass over the
    /// weights, and memory: 1.7x the bytes of a 4-bit source (`InputGroup` byte accounting in
    /// the session counts what reading it costs).
    fn transpose(
        &self,
        pick: impl Fn(&LayerWeights<'static>) -> Option<QMatrix<'static>> + Sync,
    ) -> Transposed {
        let source = self.weights.layers.iter().find_map(&pick);
        let dtype = source.map_or(DType::Q8_0, Self::transposed_dtype);
        let layers = self.install(|| {
            self.weights
                .layers
                .iter()
                .map(|lw| {
                    let m = pick(lw)?;
                    // page-aligned, so the f16 block scales are aligned too
                    let mut out = crate::gguf::weight_buffer(m.cols * dtype.row_bytes(m.rows))
                        .expect("anonymous memory for a transposed copy");
                    m.transpose_into(dtype, &mut out);
                    Some(out)
                })
                .collect()
        });
        Transposed { dtype, layers }
    }

    /// The type `transpose` stores a copy of `m` in (see there).
    fn transposed_dtype(m: QMatrix) -> DType {
        match m.dtype {
            DType::F32 => DType::F32,
            DType::F16 | DType::BF16 => DType::F16,
            // Q8_0 rows need whole blocks; the loader only accepts quantized files whose
            // widths are multiples of 32, but a float file could have any width.
            _ if !m.rows.is_multiple_of(quant::QK) => DType::F32,
            _ => DType::Q8_0,
        }
    }

    /// Bytes `neuron_bundles` holds for the whole model (without building anything).
    pub fn neuron_bundle_bytes(&self) -> usize {
        let c = &self.config;
        let down_t_row = |lw: &LayerWeights| match (lw.ffn_down_t, lw.ffn_down) {
            (Some(m), _) => m.row_bytes(),
            (None, Some(d)) => Self::transposed_dtype(d).row_bytes(d.rows),
            (None, None) => 0,
        };
        self.weights
            .layers
            .iter()
            .map(|lw| {
                let gate = lw.ffn_gate.map_or(0, |g| g.row_bytes());
                let up = lw.ffn_up.map_or(0, |u| u.row_bytes()); // (none: mixture of experts)
                c.n_ff * (gate + up + down_t_row(lw))
            })
            .sum()
    }

    fn build_input_norms(&self) -> Vec<[Vec<f32>; 4]> {
        // sum over the matrices of |W[:, i]|^2, row by row of the original
        let add_squares = |m: QMatrix, acc: &mut Vec<f32>| {
            let mut row = vec![0.0f32; m.cols];
            acc.resize(m.cols, 0.0);
            for r in 0..m.rows {
                m.dequantize_row(r, &mut row);
                acc.iter_mut().zip(&row).for_each(|(a, w)| *a += w * w);
            }
        };
        self.install(|| {
            (0..self.config.n_layer)
                .into_par_iter()
                .map(|l| {
                    let lw = &self.weights.layers[l];
                    let mut groups: [Vec<f32>; 4] = Default::default();
                    for m in [lw.wq, lw.wk, lw.wv] {
                        add_squares(m, &mut groups[InputGroup::Qkv as usize]);
                    }
                    add_squares(lw.wo, &mut groups[InputGroup::Out as usize]);
                    for m in lw.ffn_gate.iter().chain(lw.ffn_up.iter()) {
                        add_squares(*m, &mut groups[InputGroup::FfnIn as usize]);
                    }
                    let d = &mut groups[InputGroup::Down as usize];
                    match (lw.ffn_down, lw.ffn_down_t) {
                        (Some(down), _) => add_squares(down, d),
                        // neuron-major files: down's column j is down_t's row j
                        (None, Some(dt)) => {
                            let mut row = vec![0.0f32; dt.cols];
                            d.extend((0..dt.rows).map(|j| {
                                dt.dequantize_row(j, &mut row);
                                row.iter().map(|w| w * w).sum::<f32>()
                            }));
                        }
                        (None, None) => {
                            unreachable!("the loader requires one of ffn_down, ffn_down_t")
                        }
                    }
                    groups.iter_mut().for_each(|g| g.iter_mut().for_each(|v| *v = v.sqrt()));
                    groups
                })
                .collect()
        })
    }

    pub fn n_threads(&self) -> usize {
        self.pool.current_num_threads()
    }

    /// Runs `f` on this model's thread pool (all rayon work inside uses it).
    pub fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.pool.install(f)
    }
}

#[cfg(test)]
mod activation_tests {
    use super::*;
    use crate::activation::gelu_exponent;

    /// SiLU and GELU over a batch (`apply_all` and `gate_part_all`, 8 lanes where the CPU has
    /// AVX2) equal the one-neuron `apply` and `gate_part` bit for bit, tails, extremes, zeros, infinities and NaN included; and
    /// both stay close to the float64 definitions.
    #[test]
    fn batch_activation_equals_one_neuron_bit_for_bit() {
        let mut rng = crate::sampler::Rng::new(11);
        let mut gate: Vec<f32> =
            (0..1003).map(|i| (rng.next_f32() - 0.5) * [0.01, 2.0, 20.0, 300.0][i % 4]).collect();
        gate.extend([
            0.0,
            -0.0,
            1e-30,
            -1e-30,
            88.0,
            -88.0,
            89.0,
            -89.0,
            1e30,
            -1e30,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
        ]);
        let up: Vec<f32> = (0..gate.len()).map(|_| rng.next_f32() * 2.0 - 1.0).collect();
        for act in [FfnActivation::SwiGlu, FfnActivation::GeGlu, FfnActivation::Gelu] {
            for len in [gate.len(), 7, 8, 9, 1] {
                let mut parts = gate[..len].to_vec();
                act.gate_part_all(&mut parts);
                for i in 0..len {
                    let one = act.gate_part(gate[i]);
                    assert_eq!(parts[i].to_bits(), one.to_bits(), "{act:?} gate part [{i}]");
                }
                if act == FfnActivation::Gelu {
                    continue;
                }
                let mut batch = gate[..len].to_vec();
                act.apply_all(&mut batch, &up[..len]);
                for i in 0..len {
                    let one = act.apply(gate[i], up[i]);
                    assert_eq!(
                        batch[i].to_bits(),
                        one.to_bits(),
                        "{act:?} [{i}] of {len}: gate {} -> {} vs {}",
                        gate[i],
                        batch[i],
                        one
                    );
                }
            }
            if act == FfnActivation::Gelu {
                continue; // (gateless: apply reads only up; its gate part is checked above)
            }
            for (&g, &u) in gate.iter().zip(&up).filter(|(g, _)| g.abs() < 50.0) {
                let x = g as f64;
                let want = u as f64
                    * match act {
                        FfnActivation::SwiGlu => x / (1.0 + (-x).exp()),
                        // 0.5 x (1 + tanh(u)), as x sigmoid(2u) (the tanh form cancels to 0 in f64)
                        _ => {
                            x / (1.0
                                + (-2.0
                                    * (2.0 / std::f64::consts::PI).sqrt()
                                    * (x + 0.044715 * x * x * x))
                                    .exp())
                        }
                    };
                let got = act.apply(g, u) as f64;
                // (GELU's exponent is computed in f32 and e^x turns its rounding into relative error)
                let tolerance = 1e-6
                    * if act == FfnActivation::GeGlu {
                        1.0 + gelu_exponent(g).abs() as f64
                    } else {
                        1.0
                    };
                assert!(
                    (got - want).abs() <= tolerance * want.abs() + 1e-30,
                    "{act:?} gate {g}: {got} vs {want}"
                );
            }
        }
    }
}
