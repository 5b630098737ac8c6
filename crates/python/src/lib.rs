//! Python bindings (`powerinfer_rs._core`): thin wrappers over powerinfer-core. Every heavy call
//! releases the GIL; every error becomes a Python exception, and a panic in the core is caught
//! here and raised as RuntimeError rather than crossing into Python as PanicException.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use numpy::{PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray1};
use powerinfer_core::attention::KvType;
use powerinfer_core::gguf::{GgufFile as CoreGguf, Magic, Value};
use powerinfer_core::gpu_index::GpuIndex;
use powerinfer_core::model::InputGroup;
use powerinfer_core::session::{time_input_sparsity, Sparsity, SparsityMode};
use powerinfer_core::{Error, Model, Sampler, SamplingParams, Session};
use powerinfer_cuda::executor::{self, DeviceChoice, Executor, Placement};
use powerinfer_cuda::hybrid::GpuPlan;
use powerinfer_cuda::CudaError;
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyFileNotFoundError, PyOSError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

create_exception!(_core, GGUFError, PyValueError, "The file is not a well-formed GGUF file.");
create_exception!(
    _core,
    ModelError,
    PyValueError,
    "The GGUF file does not hold a model this engine can run."
);
create_exception!(
    _core,
    ContextLengthError,
    PyValueError,
    "The tokens do not fit in the context window."
);
create_exception!(_core, CudaUnavailableError, PyException, "No usable CUDA driver or device.");
create_exception!(
    _core,
    GpuError,
    PyRuntimeError,
    "The GPU executor failed or cannot run this model or placement."
);

fn cuda_to_py(e: CudaError) -> PyErr {
    match e {
        CudaError::NoDriver | CudaError::NoDevice(_) => {
            CudaUnavailableError::new_err(e.to_string())
        }
        CudaError::Plan(_) => PyValueError::new_err(e.to_string()),
        _ => GpuError::new_err(e.to_string()),
    }
}

fn to_py(e: Error) -> PyErr {
    let msg = e.to_string();
    match e {
        Error::FileNotFound(_) => PyFileNotFoundError::new_err(msg),
        Error::Io { .. } => PyOSError::new_err(msg),
        Error::Format(_) => GGUFError::new_err(msg),
        Error::UnsupportedType { .. }
        | Error::UnknownArchitecture(..)
        | Error::UnsupportedMoe(..)
        | Error::Model(_) => ModelError::new_err(msg),
        Error::ContextOverflow { .. } => ContextLengthError::new_err(msg),
        Error::InvalidArgument(_) => PyValueError::new_err(msg),
        Error::Device(_) => GpuError::new_err(msg),
    }
}

/// Runs `f` without the GIL and turns a panic into RuntimeError.
fn compute<T: Send>(py: Python<'_>, f: impl FnOnce() -> Result<T, Error> + Send) -> PyResult<T> {
    py.detach(|| catch_unwind(AssertUnwindSafe(f)))
        .map_err(|p| {
            let what = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".into());
            PyRuntimeError::new_err(format!("internal error in powerinfer-rs core: {what}"))
        })?
        .map_err(to_py)
}

fn value_to_py<'py>(py: Python<'py>, v: &Value) -> PyResult<Bound<'py, PyAny>> {
    Ok(match v {
        Value::U8(x) => x.into_pyobject(py)?.into_any(),
        Value::I8(x) => x.into_pyobject(py)?.into_any(),
        Value::U16(x) => x.into_pyobject(py)?.into_any(),
        Value::I16(x) => x.into_pyobject(py)?.into_any(),
        Value::U32(x) => x.into_pyobject(py)?.into_any(),
        Value::I32(x) => x.into_pyobject(py)?.into_any(),
        Value::U64(x) => x.into_pyobject(py)?.into_any(),
        Value::I64(x) => x.into_pyobject(py)?.into_any(),
        Value::F32(x) => x.into_pyobject(py)?.into_any(),
        Value::F64(x) => x.into_pyobject(py)?.into_any(),
        Value::Bool(x) => x.into_pyobject(py)?.to_owned().into_any(),
        Value::Str(s) => s.into_pyobject(py)?.into_any(),
        Value::Array(items) => {
            let list = PyList::empty(py);
            for it in items {
                list.append(value_to_py(py, it)?)?;
            }
            list.into_any()
        }
    })
}

fn metadata_dict<'py>(py: Python<'py>, f: &CoreGguf) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for (k, v) in &f.metadata {
        d.set_item(k, value_to_py(py, v)?)?;
    }
    Ok(d)
}

fn tensor_list<'py>(py: Python<'py>, f: &CoreGguf) -> PyResult<Bound<'py, PyList>> {
    let list = PyList::empty(py);
    for t in &f.tensors {
        let d = PyDict::new(py);
        d.set_item("name", &t.name)?;
        d.set_item("type", t.type_name())?;
        d.set_item("shape", t.shape())?;
        d.set_item("offset", f.data_offset + t.offset)?;
        d.set_item("n_bytes", t.n_bytes)?;
        list.append(d)?;
    }
    Ok(list)
}

fn magic_name(m: Magic) -> &'static str {
    match m {
        Magic::Gguf => "GGUF",
        Magic::Powerinfer => "PWRI",
    }
}

/// A GGUF file opened for inspection only (works for any architecture or tensor type).
#[pyclass(frozen, module = "powerinfer_rs._core")]
struct GgufFile {
    inner: CoreGguf,
}

#[pymethods]
impl GgufFile {
    #[new]
    fn new(py: Python<'_>, path: PathBuf) -> PyResult<Self> {
        Ok(GgufFile { inner: compute(py, || CoreGguf::open(&path))? })
    }
    #[getter]
    fn magic(&self) -> &'static str {
        magic_name(self.inner.magic)
    }
    #[getter]
    fn version(&self) -> u32 {
        self.inner.version
    }
    #[getter]
    fn file_size(&self) -> u64 {
        self.inner.file_size()
    }
    fn metadata<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        metadata_dict(py, &self.inner)
    }
    fn tensors<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        tensor_list(py, &self.inner)
    }

    /// Tensor `name` decoded to float32, shaped as numpy orders GGUF's dimensions (the row
    /// length last).
    fn read_tensor<'py>(&self, py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyAny>> {
        let values = compute(py, || self.inner.read_f32(name))?;
        let t = self.inner.tensor(name).expect("read_f32 found it");
        let shape: Vec<usize> = t.dims.iter().rev().map(|&d| d as usize).collect();
        Ok(PyArray1::from_vec(py, values).reshape(shape)?.into_any())
    }
}

/// A loaded model: immutable, shared by any number of sessions and threads.
#[pyclass(frozen, name = "Model", module = "powerinfer_rs._core")]
struct PyModel {
    inner: Arc<Model>,
}

#[pymethods]
impl PyModel {
    #[new]
    #[pyo3(signature = (path, threads = 0, in_memory = false))]
    fn new(py: Python<'_>, path: PathBuf, threads: usize, in_memory: bool) -> PyResult<Self> {
        let model = compute(py, || Model::load(&path, threads, in_memory))?;
        Ok(PyModel { inner: Arc::new(model) })
    }

    /// True when the weights were copied into memory, False when read from the file's map.
    #[getter]
    fn in_memory(&self) -> bool {
        self.inner.file.in_memory()
    }

    #[getter]
    fn n_threads(&self) -> usize {
        self.inner.n_threads()
    }

    #[getter]
    fn magic(&self) -> &'static str {
        magic_name(self.inner.file.magic)
    }

    /// Bytes the FFN rows bundled by neuron take (built on first use by a session that reads
    /// them, see `Session.set_neuron_bundles`).
    fn neuron_bundle_bytes(&self) -> usize {
        self.inner.neuron_bundle_bytes()
    }

    /// Hyper-parameters as a dict.
    fn config<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = &self.inner.config;
        let d = PyDict::new(py);
        d.set_item("architecture", &c.architecture)?;
        d.set_item("n_vocab", c.n_vocab)?;
        d.set_item("n_embd", c.n_embd)?;
        d.set_item("n_layer", c.n_layer)?;
        d.set_item("n_ff", c.n_ff)?;
        d.set_item("n_head", c.n_head)?;
        d.set_item("n_head_kv", c.n_head_kv)?;
        d.set_item("head_dim", c.head_dim)?;
        d.set_item("n_ctx_train", c.n_ctx_train)?;
        d.set_item("rope_dim", c.rope_dim)?;
        d.set_item("rope_base", c.rope_base)?;
        d.set_item("rope_style", format!("{:?}", c.rope_style).to_lowercase())?;
        d.set_item("norm_eps", c.norm_eps)?;
        d.set_item("family", format!("{:?}", c.family).to_lowercase())?;
        d.set_item("ffn_activation", c.ffn_activation.name())?;
        d.set_item("tied_output", c.tied_output)?;
        d.set_item("powerinfer", c.powerinfer)?;
        d.set_item("sparse_threshold", c.sparse_threshold)?;
        d.set_item("has_predictors", self.inner.has_predictors())?;
        let hidden: Vec<Option<usize>> =
            self.inner.weights.layers.iter().map(|l| l.predictor.map(|p| p.fc1.rows)).collect();
        d.set_item("predictor_hidden", hidden)?;
        d.set_item("has_down_t", self.inner.weights.layers.iter().all(|l| l.ffn_down_t.is_some()))?;
        // a mixture of experts: None for a dense model
        let moe = match &c.moe {
            None => None,
            Some(m) => {
                let e = PyDict::new(py);
                e.set_item("n_expert", m.n_expert)?;
                e.set_item("n_expert_used", m.n_used)?;
                e.set_item("n_ff_exp", m.n_ff_exp)?;
                e.set_item("n_ff_shared", m.n_ff_shared)?;
                e.set_item("normalize_weights", m.normalize_weights)?;
                e.set_item("weights_scale", m.weights_scale)?;
                e.set_item("gating", m.gating.name())?;
                e.set_item("router_input", m.router_input.name())?;
                Some(e)
            }
        };
        d.set_item("experts", moe)?;
        Ok(d)
    }

    /// Times one token's products of input group `group` (0 qkv, 1 attn_output, 2 ffn_gate_up,
    /// 3 ffn_down) of `layer`, dense and skipping the share `skip` of the inputs:
    /// (dense seconds, sparse seconds, dense bytes, sparse bytes), medians of `reps` runs.
    fn time_input_sparsity(
        &self,
        py: Python<'_>,
        layer: usize,
        group: usize,
        skip: f64,
        reps: usize,
    ) -> PyResult<(f64, f64, u64, u64)> {
        let g = *InputGroup::ALL.get(group).ok_or_else(|| {
            PyValueError::new_err(format!("input group must be 0..4, got {group}"))
        })?;
        compute(py, || time_input_sparsity(&self.inner, layer, g, skip, reps))
    }

    fn metadata<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        metadata_dict(py, &self.inner.file)
    }

    fn tensors<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        tensor_list(py, &self.inner.file)
    }
}

/// Sampling settings plus the seeded random generator.
#[pyclass(name = "Sampler", module = "powerinfer_rs._core")]
struct PySampler {
    inner: Mutex<Sampler>,
}

#[pymethods]
impl PySampler {
    #[new]
    #[pyo3(signature = (temperature = 0.0, top_k = 40, top_p = 0.95, min_p = 0.05, repeat_penalty = 1.0, repeat_last_n = 64, seed = 0, banned = Vec::new()))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        temperature: f32,
        top_k: usize,
        top_p: f32,
        min_p: f32,
        repeat_penalty: f32,
        repeat_last_n: usize,
        seed: u64,
        banned: Vec<u32>,
    ) -> PyResult<Self> {
        let params = SamplingParams {
            temperature,
            top_k,
            top_p,
            min_p,
            repeat_penalty,
            repeat_last_n,
            banned,
        };
        Ok(PySampler { inner: Mutex::new(Sampler::new(params, seed).map_err(to_py)?) })
    }

    /// Picks a token from `logits` given the `recent` token history.
    fn sample(&self, logits: PyReadonlyArray1<'_, f32>, recent: Vec<u32>) -> PyResult<u32> {
        let mut l = logits.as_slice()?.to_vec();
        if l.is_empty() {
            return Err(PyValueError::new_err("logits are empty"));
        }
        Ok(lock(&self.inner)?.sample(&mut l, &recent))
    }
}

fn lock<T>(m: &Mutex<T>) -> PyResult<std::sync::MutexGuard<'_, T>> {
    m.lock()
        .map_err(|_| PyRuntimeError::new_err("object is unusable after an earlier internal error"))
}

/// A model placed on the GPU (hot neurons and dense tensors per a placement); sessions made
/// with it run the hybrid CPU+GPU executor.
#[pyclass(frozen, name = "GpuModel", module = "powerinfer_rs._core")]
struct PyGpuModel {
    inner: Placement,
}

#[pymethods]
impl PyGpuModel {
    /// `dense_on_gpu` (n_layer bools): the layer's attention, norms and predictor go to the GPU
    /// (a layer without them runs wholly on the CPU); `neuron_on_gpu` (n_layer lists of n_ff
    /// bools): the neurons whose gate/up/down rows go to the GPU; `output_on_gpu`: the final
    /// norm and classifier. `device` is a CUDA device's ordinal, or "emulated": host memory and
    /// the kernels' scalar twins (the same executor without a GPU; slow, for checking).
    /// `expert_on_gpu` (mixture-of-experts models; n_layer lists of n_expert bools, or empty):
    /// the experts whose matrices go to the GPU, in layers whose dense part is there.
    #[new]
    #[pyo3(signature = (model, dense_on_gpu, neuron_on_gpu, output_on_gpu, device = DeviceArg::Ordinal(0), expert_on_gpu = Vec::new()))]
    fn new(
        py: Python<'_>,
        model: &PyModel,
        dense_on_gpu: Vec<bool>,
        neuron_on_gpu: Vec<Vec<bool>>,
        output_on_gpu: bool,
        device: DeviceArg,
        expert_on_gpu: Vec<Vec<bool>>,
    ) -> PyResult<Self> {
        let plan = GpuPlan { dense_on_gpu, neuron_on_gpu, output_on_gpu, expert_on_gpu };
        let device = match device {
            DeviceArg::Ordinal(n) => DeviceChoice::Cuda(n),
            DeviceArg::Name(name) if name == "emulated" => DeviceChoice::Emulated,
            DeviceArg::Name(name) => {
                return Err(PyValueError::new_err(format!(
                    "device must be a CUDA ordinal or 'emulated', got {name:?}"
                )))
            }
        };
        let m = Arc::clone(&model.inner);
        let inner = py
            .detach(|| catch_unwind(AssertUnwindSafe(|| Placement::new(m, device, &plan))))
            .map_err(|_| GpuError::new_err("internal error while placing the model on the GPU"))?
            .map_err(cuda_to_py)?;
        Ok(PyGpuModel { inner })
    }

    /// What went where: gpu_name, gpu_total_memory, weight_bytes, neuron_bytes, layers_on_gpu,
    /// n_layer, hot_neurons, total_neurons, hot_experts, total_experts, output_on_gpu,
    /// prompt_rows (prompt tokens per pass).
    #[getter]
    fn report<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let r = self.inner.report();
        let d = PyDict::new(py);
        d.set_item("gpu_name", &r.gpu_name)?;
        d.set_item("gpu_total_memory", r.gpu_total_memory)?;
        d.set_item("weight_bytes", r.weight_bytes)?;
        d.set_item("neuron_bytes", r.neuron_bytes)?;
        d.set_item("layers_on_gpu", r.layers_on_gpu)?;
        d.set_item("n_layer", r.n_layer)?;
        d.set_item("hot_neurons", r.hot_neurons)?;
        d.set_item("total_neurons", r.total_neurons)?;
        d.set_item("hot_experts", r.hot_experts)?;
        d.set_item("total_experts", r.total_experts)?;
        d.set_item("output_on_gpu", r.output_on_gpu)?;
        d.set_item("prompt_rows", r.prompt_rows)?;
        Ok(d)
    }
}

/// `GpuModel`'s device: a CUDA ordinal or a name ("emulated").
#[derive(FromPyObject)]
enum DeviceArg {
    Ordinal(usize),
    Name(String),
}

/// One conversation: KV cache, position and token history.
#[pyclass(name = "Session", module = "powerinfer_rs._core")]
struct PySession {
    inner: Mutex<Executor>,
    n_vocab: usize,
    n_embd: usize,
    n_ff: usize,
}

#[pymethods]
impl PySession {
    #[new]
    #[pyo3(signature = (model, n_ctx, kv_type = "f16", gpu = None))]
    fn new(
        py: Python<'_>,
        model: &PyModel,
        n_ctx: usize,
        kv_type: &str,
        gpu: Option<&PyGpuModel>,
    ) -> PyResult<Self> {
        let kv_type = KvType::parse(kv_type).map_err(to_py)?;
        let exec = py
            .detach(|| {
                catch_unwind(AssertUnwindSafe(|| {
                    Executor::new(&model.inner, n_ctx, kv_type, gpu.map(|g| &g.inner))
                }))
            })
            .map_err(|_| GpuError::new_err("internal error while creating the session"))?
            .map_err(to_py)?;
        let c = &model.inner.config;
        Ok(PySession {
            inner: Mutex::new(exec),
            n_vocab: c.n_vocab,
            n_embd: c.n_embd,
            n_ff: c.n_ff,
        })
    }

    /// "cpu", or the GpuModel's device: "cuda" or "emulated".
    #[getter]
    fn device(&self) -> PyResult<&'static str> {
        Ok(lock(&self.inner)?.device())
    }

    /// GPU sessions: KV cache bytes held on the GPU, and the neurons computed on each side
    /// since the last call (then reset): {"kv_bytes", "gpu_neurons", "cpu_neurons"}. None on the CPU.
    fn take_split<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some((kv_bytes, counts)) = lock(&self.inner)?.take_split() else {
            return Ok(None);
        };
        let d = PyDict::new(py);
        d.set_item("kv_bytes", kv_bytes)?;
        d.set_item("gpu_neurons", counts.gpu_neurons)?;
        d.set_item("cpu_neurons", counts.cpu_neurons)?;
        Ok(Some(d))
    }

    #[getter]
    fn n_ctx(&self) -> PyResult<usize> {
        Ok(lock(&self.inner)?.cpu_ref().n_ctx)
    }

    /// The most prompt tokens one forward pass evaluates (512 on the CPU; on a GPU placement
    /// up to 32, fewer at long contexts, 1 where experts are on the GPU).
    #[getter]
    fn prompt_rows(&self) -> PyResult<usize> {
        Ok(lock(&self.inner)?.prompt_rows())
    }

    #[getter]
    fn pos(&self) -> PyResult<usize> {
        Ok(lock(&self.inner)?.cpu_ref().pos())
    }

    #[getter]
    fn tokens(&self) -> PyResult<Vec<u32>> {
        Ok(lock(&self.inner)?.cpu_ref().tokens.clone())
    }

    /// Keeps only the first `n` tokens (to reuse a shared prompt prefix, or to reset with 0)
    /// and returns how many it kept: fewer (0) where a sliding-window layer's ring no longer
    /// holds what the next token would attend to.
    fn truncate(&self, n: usize) -> PyResult<usize> {
        Ok(lock(&self.inner)?.cpu().truncate(n))
    }

    /// Evaluates `tokens`; returns logits of shape (len(tokens), n_vocab) when `all_logits`,
    /// else the last token's logits (n_vocab,).
    #[pyo3(signature = (tokens, all_logits = false))]
    fn eval<'py>(
        &self,
        py: Python<'py>,
        tokens: Vec<u32>,
        all_logits: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        let n = tokens.len();
        let logits = compute(py, || lock_core(&self.inner)?.eval(&tokens, all_logits))?;
        let arr = PyArray1::from_vec(py, logits);
        if all_logits {
            Ok(arr.reshape([n, self.n_vocab])?.into_any())
        } else {
            Ok(arr.into_any())
        }
    }

    /// Chooses how the FFNs are computed: `mode` is "dense", "predictor" or "threshold";
    /// `predictor_cutoff` is the predictor logit cut-off (`predictor_layer_cutoffs`, one
    /// per layer, replaces it); `gate_cutoffs` (one per layer) the |act(gate)| cut-offs of
    /// threshold mode; `input_cutoffs` (one [qkv, attn_output, ffn_gate_up, ffn_down] set of
    /// score cut-offs per layer, 0 for none) switch threshold mode to input sparsity instead;
    /// `track_recall` adds a dense pass in predictor mode to measure recall.
    #[pyo3(signature = (mode, predictor_cutoff = 0.0, gate_cutoffs = None, track_recall = false, predictor_layer_cutoffs = None, input_cutoffs = None))]
    fn set_sparsity(
        &self,
        py: Python<'_>,
        mode: &str,
        predictor_cutoff: f32,
        gate_cutoffs: Option<Vec<f32>>,
        track_recall: bool,
        predictor_layer_cutoffs: Option<Vec<f32>>,
        input_cutoffs: Option<Vec<[f32; 4]>>,
    ) -> PyResult<()> {
        let mode = SparsityMode::parse(mode).map_err(to_py)?;
        let refuse = |m: String| to_py(Error::InvalidArgument(m));
        if !predictor_cutoff.is_finite() {
            return Err(refuse(format!("predictor_cutoff must be finite, got {predictor_cutoff}")));
        }
        // (the keywords as Python passes them; an empty list is none)
        let gate_cutoffs = gate_cutoffs.filter(|t| !t.is_empty());
        let input_cutoffs = input_cutoffs.filter(|t| !t.is_empty());
        let sp = match mode {
            SparsityMode::Dense => Sparsity::Dense,
            SparsityMode::Predictor => Sparsity::Predictor {
                cutoff: predictor_cutoff,
                layer_cutoffs: predictor_layer_cutoffs.unwrap_or_default(),
                track_recall,
            },
            SparsityMode::Threshold => match (gate_cutoffs, input_cutoffs) {
                (gate, None) => Sparsity::GateThreshold { gate_cutoffs: gate.unwrap_or_default() },
                (None, Some(input_cutoffs)) => Sparsity::Inputs { input_cutoffs },
                (Some(gate), Some(input)) => {
                    return Err(refuse(format!(
                        "input_cutoffs and gate_cutoffs exclude each other, got {} and {}",
                        input.len(),
                        gate.len()
                    )))
                }
            },
        };
        compute(py, || lock_core(&self.inner)?.set_sparsity(sp))
    }

    /// Whether one token's sparse FFN reads each neuron's rows from its bundle (the model's
    /// FFN rows interleaved by neuron, built on first use) or from the matrices apart.
    fn set_neuron_bundles(&self, py: Python<'_>, on: bool) -> PyResult<()> {
        compute(py, || {
            lock_core(&self.inner)?.cpu().set_neuron_bundles(on);
            Ok(())
        })
    }

    /// The sparsity mode in use.
    #[getter]
    fn sparsity(&self) -> PyResult<&'static str> {
        Ok(lock(&self.inner)?.cpu_ref().sparsity().mode().name())
    }

    /// FFN counters since the last call (then reset): neurons, skipped, truly_active,
    /// truly_active_selected, weight_bytes (what a dense pass reads of the layers' weight
    /// matrices) and weight_bytes_read.
    fn take_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let st = lock(&self.inner)?.cpu().take_stats();
        let d = PyDict::new(py);
        d.set_item("neurons", st.neurons)?;
        d.set_item("skipped", st.skipped)?;
        d.set_item("truly_active", st.truly_active)?;
        d.set_item("truly_active_selected", st.truly_active_selected)?;
        d.set_item("weight_bytes", st.weight_bytes)?;
        d.set_item("weight_bytes_read", st.weight_bytes_read)?;
        Ok(d)
    }

    /// Starts (or stops) timing each step of this session's passes (CPU sessions only: a GPU's
    /// steps return before their kernels finish).
    fn set_step_times(&self, py: Python<'_>, on: bool) -> PyResult<()> {
        compute(py, || {
            lock_core(&self.inner)?.cpu_only("timing each step")?.set_step_times(on);
            Ok(())
        })
    }

    /// Seconds spent in each step of the forward pass (embed, norm, qkv, ..., ffn, ...,
    /// logits: the CPU backend's steps) since timing started or since the last call (then
    /// reset), and "passes", the forward passes they cover; None when not timing.
    fn take_step_times<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(times) = lock(&self.inner)?.cpu().take_step_times() else {
            return Ok(None);
        };
        let d = PyDict::new(py);
        for (name, seconds) in times.seconds() {
            d.set_item(name, seconds)?;
        }
        d.set_item("passes", times.passes)?;
        Ok(Some(d))
    }

    /// Mixture-of-experts models: per layer and expert, the tokens routed to it since the last
    /// call, (n_layer, n_expert) uint64; None for a dense model.
    fn take_expert_counts<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<Option<Bound<'py, PyArray2<u64>>>> {
        let mut guard = lock(&self.inner)?;
        let session = guard.cpu();
        let n_layer = session.model.config.n_layer;
        let Some(counts) = session.take_expert_counts() else { return Ok(None) };
        let n_expert = counts.len() / n_layer;
        Ok(Some(PyArray1::from_vec(py, counts).reshape([n_layer, n_expert])?))
    }

    /// Runs `tokens` densely in windows and returns, per target sparsity, the per-layer
    /// |act(gate)| thresholds that skip that fraction of neurons. Leaves the session empty.
    /// Calibration is a dense pass on the CPU, a hybrid session's included (its CPU state; the
    /// device cache is rewritten from position 0 by the next eval).
    fn calibrate(
        &self,
        py: Python<'_>,
        tokens: Vec<u32>,
        window: usize,
        targets: Vec<f64>,
    ) -> PyResult<Vec<Vec<f32>>> {
        compute(py, || lock_core(&self.inner)?.cpu().calibrate(&tokens, window, &targets))
    }

    /// Runs `tokens` densely in windows and returns, per recall target, the per-layer predictor
    /// cut-offs that keep that fraction of the truly firing neurons. Leaves the session empty.
    fn calibrate_predictor(
        &self,
        py: Python<'_>,
        tokens: Vec<u32>,
        window: usize,
        recalls: Vec<f64>,
    ) -> PyResult<Vec<Vec<f32>>> {
        compute(py, || lock_core(&self.inner)?.cpu().calibrate_predictor(&tokens, window, &recalls))
    }

    /// Runs `tokens` densely in windows and returns, per input sparsity level, per layer, for
    /// each input group (qkv, attn_output, ffn_gate_up, ffn_down) the (score cut-off, share of
    /// the squared scores below it) pair. Leaves the session empty.
    fn calibrate_inputs(
        &self,
        py: Python<'_>,
        tokens: Vec<u32>,
        window: usize,
        levels: Vec<f64>,
    ) -> PyResult<Vec<Vec<[(f32, f64); 4]>>> {
        compute(py, || lock_core(&self.inner)?.cpu().calibrate_inputs(&tokens, window, &levels))
    }

    /// Starts (True) or stops (False) recording, for every evaluated token, each layer's FFN
    /// input and neuron scores (see `take_capture`). Recording computes every FFN densely.
    fn set_capture(&self, on: bool) -> PyResult<()> {
        let mut exec = lock(&self.inner)?;
        exec.cpu_only("capture").map_err(to_py)?.set_capture(on).map_err(to_py)?;
        Ok(())
    }

    /// What was recorded since the last call: `(inputs, scores)`, float32 arrays of shape
    /// (n_layer, n_tokens, n_embd) and (n_layer, n_tokens, n_ff). `inputs` is what the layer's
    /// predictor reads; `scores` is |act(gate, up)| for ReLU-family FFNs (zero exactly when the
    /// neuron does not fire) and |act(gate)| for SwiGLU/GELU. Raises when not recording.
    fn take_capture<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
        let cap = lock(&self.inner)?.cpu().take_capture().ok_or_else(|| {
            PyValueError::new_err("the session is not capturing; call set_capture(True) first")
        })?;
        let n_layer = cap.inputs.len();
        let n = cap.n_tokens;
        let stack = |parts: Vec<Vec<f32>>, width: usize| -> PyResult<Bound<'py, PyAny>> {
            let flat: Vec<f32> = parts.into_iter().flatten().collect();
            Ok(PyArray1::from_vec(py, flat).reshape([n_layer, n, width])?.into_any())
        };
        Ok((stack(cap.inputs, self.n_embd)?, stack(cap.scores, self.n_ff)?))
    }

    /// Evaluates `tokens` and samples the next token in one call (no logits cross into Python).
    fn eval_and_sample(
        &self,
        py: Python<'_>,
        tokens: Vec<u32>,
        sampler: &PySampler,
    ) -> PyResult<u32> {
        compute(py, || {
            let mut session = lock_core(&self.inner)?;
            let mut logits = session.eval(&tokens, false)?;
            let mut sampler = sampler
                .inner
                .lock()
                .map_err(|_| Error::InvalidArgument("sampler is unusable".into()))?;
            Ok(sampler.sample(&mut logits, &session.cpu_ref().tokens))
        })
    }
}

/// The sessions of a batched call, each once.
fn distinct_sessions<'a>(
    sessions: &'a [PyRef<'_, PySession>],
    n_tokens: usize,
) -> PyResult<Vec<&'a PySession>> {
    if sessions.len() != n_tokens {
        return Err(PyValueError::new_err(format!(
            "batched decode needs one token per session, got {} tokens for {} sessions",
            n_tokens,
            sessions.len()
        )));
    }
    let refs: Vec<&PySession> = sessions.iter().map(|r| &**r).collect();
    for (i, a) in refs.iter().enumerate() {
        if refs[..i].iter().any(|b| std::ptr::eq(*a, *b)) {
            return Err(PyValueError::new_err(format!("session {i} appears twice in the batch")));
        }
    }
    Ok(refs)
}

/// Locks every session (in address order, so two batches over the same sessions in different
/// orders cannot deadlock), runs the batch, and hands each session and its logits row to `each`.
fn run_batch<T>(
    refs: &[&PySession],
    tokens: &[u32],
    mut each: impl FnMut(usize, &Session, Vec<f32>) -> T,
) -> Result<Vec<T>, Error> {
    let mut order: Vec<usize> = (0..refs.len()).collect();
    order.sort_by_key(|&i| refs[i] as *const PySession as usize);
    let mut slots: Vec<Option<std::sync::MutexGuard<'_, Executor>>> =
        (0..refs.len()).map(|_| None).collect();
    for &i in &order {
        slots[i] = Some(lock_core(&refs[i].inner)?);
    }
    let mut guards: Vec<_> = slots.into_iter().flatten().collect();
    let mut execs: Vec<&mut Executor> = guards.iter_mut().map(|g| &mut **g).collect();
    let logits = executor::decode_batch(&mut execs, tokens)?;
    Ok(execs
        .iter()
        .zip(logits)
        .enumerate()
        .map(|(i, (e, row))| each(i, e.cpu_ref(), row))
        .collect())
}

/// Evaluates the next token of several sessions of one model as one batch (`tokens[i]` at the
/// next position of `sessions[i]`) and returns their logits, float32 (len(sessions), n_vocab).
/// Each row is exactly what a single-token `Session.eval` gives; on the CPU the weights are
/// read once for all, hybrid sessions step in turn.
#[pyfunction]
fn eval_batch<'py>(
    py: Python<'py>,
    sessions: Vec<PyRef<'py, PySession>>,
    tokens: Vec<u32>,
) -> PyResult<Bound<'py, PyArray2<f32>>> {
    let refs = distinct_sessions(&sessions, tokens.len())?;
    let rows = compute(py, || run_batch(&refs, &tokens, |_, _, row| row))?;
    let n_vocab = rows.first().map_or(0, |r| r.len());
    let flat: Vec<f32> = rows.into_iter().flatten().collect();
    PyArray1::from_vec(py, flat).reshape([sessions.len(), n_vocab])
}

/// Like `eval_batch`, then samples each session's next token with its own sampler (over its own
/// history, as `Session.eval_and_sample` does) and returns the tokens in order.
#[pyfunction]
fn decode_batch(
    py: Python<'_>,
    sessions: Vec<PyRef<'_, PySession>>,
    tokens: Vec<u32>,
    samplers: Vec<PyRef<'_, PySampler>>,
) -> PyResult<Vec<u32>> {
    let refs = distinct_sessions(&sessions, tokens.len())?;
    if samplers.len() != sessions.len() {
        return Err(PyValueError::new_err(format!(
            "decode_batch needs one sampler per session, got {} for {}",
            samplers.len(),
            sessions.len()
        )));
    }
    let samplers: Vec<&PySampler> = samplers.iter().map(|r| &**r).collect();
    for (i, a) in samplers.iter().enumerate() {
        if samplers[..i].iter().any(|b| std::ptr::eq(*a, *b)) {
            return Err(PyValueError::new_err(format!(
                "sampler {i} appears twice in the batch; each session needs its own"
            )));
        }
    }
    compute(py, || {
        // every sampler first, so nothing can fail between the evaluation and the sampling
        let mut locked = samplers
            .iter()
            .map(|s| {
                s.inner.lock().map_err(|_| Error::InvalidArgument("sampler is unusable".into()))
            })
            .collect::<Result<Vec<_>, Error>>()?;
        run_batch(&refs, &tokens, |i, session, mut row| locked[i].sample(&mut row, &session.tokens))
    })
}

fn lock_core<T>(m: &Mutex<T>) -> Result<std::sync::MutexGuard<'_, T>, Error> {
    m.lock().map_err(|_| {
        Error::InvalidArgument("session is unusable after an earlier internal error".into())
    })
}

/// Reads a `.generated.gpuidx` hot/cold split: a dict with `vram_capacity` (bytes) and, per
/// layer, `gpu_idx` (int32 0/1 mask) and `gpu_bucket` (int32 ascending GPU neuron indices).
#[pyfunction]
fn read_gpu_index<'py>(py: Python<'py>, path: PathBuf) -> PyResult<Bound<'py, PyDict>> {
    let index = compute(py, || GpuIndex::read(&path))?;
    let d = PyDict::new(py);
    d.set_item("vram_capacity", index.vram_capacity)?;
    let masks = PyList::empty(py);
    let buckets = PyList::empty(py);
    for l in &index.layers {
        masks.append(PyArray1::from_vec(
            py,
            l.on_gpu.iter().map(|&b| b as i32).collect::<Vec<i32>>(),
        ))?;
        buckets.append(PyArray1::from_vec(
            py,
            l.gpu_bucket.iter().map(|&b| b as i32).collect::<Vec<i32>>(),
        ))?;
    }
    d.set_item("gpu_idx", masks)?;
    d.set_item("gpu_bucket", buckets)?;
    Ok(d)
}

/// The weight types the engine computes with, one dict per row of its type table: `name`
/// (ggml's), `ggml_id`, `block_len` (elements), `block_bytes`, `activations` ("f32",
/// "q8_per_32" or "q8_per_256"), `gpu` (whether GPU kernels exist for it).
#[pyfunction]
fn weight_types(py: Python<'_>) -> PyResult<Bound<'_, PyList>> {
    use powerinfer_core::dtype::{ActFormat, TYPES};
    let rows = PyList::empty(py);
    for t in &TYPES {
        let d = PyDict::new(py);
        d.set_item("name", t.name)?;
        d.set_item("ggml_id", t.ggml_id)?;
        d.set_item("block_len", t.block_len)?;
        d.set_item("block_bytes", t.block_bytes)?;
        let activations = match t.activations {
            ActFormat::F32 => "f32",
            ActFormat::Q8Per32 => "q8_per_32",
            ActFormat::Q8Per256 => "q8_per_256",
        };
        d.set_item("activations", activations)?;
        d.set_item("gpu", t.gpu)?;
        rows.append(d)?;
    }
    Ok(rows)
}

/// The SIMD level the kernels run at: "scalar", "avx2", "avxvnni" (AVX2 with 256-bit VNNI:
/// AVX-VNNI's, or AVX-512's encoding of it when asked for on a CPU without AVX-VNNI) or "avx512".
#[pyfunction]
fn simd_level() -> &'static str {
    let level = powerinfer_core::matmul::simd_level();
    if powerinfer_core::matmul::avx_vnni(level) {
        "avxvnni"
    } else {
        level.name()
    }
}

/// Why the GPU executor cannot run `model` in sparsity `mode` ("dense", "predictor",
/// "threshold"), or None: the executor's own refusal, asked before a placement is planned.
#[pyfunction]
fn gpu_unsupported_reason(model: &PyModel, mode: &str) -> PyResult<Option<String>> {
    let mode = SparsityMode::parse(mode).map_err(to_py)?;
    Ok(powerinfer_cuda::hybrid::unsupported_reason(&model.inner, Some(mode)))
}

/// Lists CUDA devices; raises CudaUnavailableError when there is no driver or no device.
#[pyfunction]
fn cuda_devices<'py>(py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
    let devices =
        powerinfer_cuda::probe().map_err(|e| CudaUnavailableError::new_err(e.to_string()))?;
    let list = PyList::empty(py);
    for d in devices {
        let item = PyDict::new(py);
        item.set_item("ordinal", d.ordinal)?;
        item.set_item("name", d.name)?;
        item.set_item("total_memory", d.total_memory)?;
        item.set_item("compute_capability", d.compute_capability)?;
        list.append(item)?;
    }
    Ok(list)
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<GgufFile>()?;
    m.add_class::<PyModel>()?;
    m.add_class::<PySession>()?;
    m.add_class::<PyGpuModel>()?;
    m.add_class::<PySampler>()?;
    m.add_function(wrap_pyfunction!(simd_level, m)?)?;
    m.add_function(wrap_pyfunction!(weight_types, m)?)?;
    m.add_function(wrap_pyfunction!(eval_batch, m)?)?;
    m.add_function(wrap_pyfunction!(decode_batch, m)?)?;
    m.add_function(wrap_pyfunction!(read_gpu_index, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_devices, m)?)?;
    m.add_function(wrap_pyfunction!(gpu_unsupported_reason, m)?)?;
    m.add("EMULATED_MEMORY", powerinfer_cuda::device::emulated::EMULATED_MEMORY)?;
    let py = m.py();
    m.add("GGUFError", py.get_type::<GGUFError>())?;
    m.add("ModelError", py.get_type::<ModelError>())?;
    m.add("ContextLengthError", py.get_type::<ContextLengthError>())?;
    m.add("CudaUnavailableError", py.get_type::<CudaUnavailableError>())?;
    m.add("GpuError", py.get_type::<GpuError>())?;
    Ok(())
}
