//! Where a session's tokens run, chosen at run time: on the CPU (`Session`), or through the
//! hybrid backend on a model placed on a device (hot parts there, the rest on the CPU); and how
//! a batch of sessions decodes together. The devices are a closed set (a CUDA device, or the
//! emulated one that runs the kernels' scalar twins), so the choice is an enum here and every
//! other type stays generic over `Device`. The bindings wrap one `Placement` per placed model
//! and one `Executor` per session and hold no policy of their own.
//!
//! This module chooses and sequences; it computes nothing itself.

use std::sync::Arc;

use powerinfer_core::attention::KvType;
use powerinfer_core::session::{self, Sparsity};
use powerinfer_core::{Error, Model, Result, Session};

use crate::device::{Cuda, Emulated};
use crate::gpu::Gpu;
use crate::hybrid::{GpuPlan, HybridModel, HybridSession, PlacementReport, SplitCounts};
use crate::CudaError;

/// The device a placement goes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceChoice {
    /// A CUDA device, by ordinal.
    Cuda(usize),
    /// Host memory and the kernels' scalar twins: the same executor without a GPU (slow; for
    /// checking).
    Emulated,
}

/// A model placed per a `GpuPlan` on the chosen device (its weights uploaded once); sessions
/// made on it run the hybrid backend.
pub enum Placement {
    Cuda(Arc<HybridModel<Cuda>>),
    Emulated(Arc<HybridModel<Emulated>>),
}

impl Placement {
    pub fn new(
        model: Arc<Model>,
        device: DeviceChoice,
        plan: &GpuPlan,
    ) -> std::result::Result<Placement, CudaError> {
        Ok(match device {
            DeviceChoice::Cuda(ordinal) => {
                Placement::Cuda(Arc::new(HybridModel::new(model, Gpu::open(ordinal)?, plan)?))
            }
            DeviceChoice::Emulated => {
                Placement::Emulated(Arc::new(HybridModel::new(model, Gpu::emulated(), plan)?))
            }
        })
    }

    pub fn model(&self) -> &Arc<Model> {
        match self {
            Placement::Cuda(m) => &m.model,
            Placement::Emulated(m) => &m.model,
        }
    }

    /// What went where.
    pub fn report(&self) -> &PlacementReport {
        match self {
            Placement::Cuda(m) => &m.report,
            Placement::Emulated(m) => &m.report,
        }
    }
}

/// A session on the CPU, or on a placed model through the hybrid backend.
// (one per session, behind its lock: the sessions' sizes are not copied around)
#[allow(clippy::large_enum_variant)]
pub enum Executor {
    Cpu(Session),
    Cuda(Box<HybridSession<Cuda>>),
    Emulated(Box<HybridSession<Emulated>>),
}

/// `$body` with `$h` the hybrid session, whichever its device; `$cpu` for a CPU session.
macro_rules! on_device {
    ($exec:expr, $s:ident => $cpu:expr, $h:ident => $body:expr) => {
        match $exec {
            Executor::Cpu($s) => $cpu,
            Executor::Cuda($h) => $body,
            Executor::Emulated($h) => $body,
        }
    };
}

impl Executor {
    /// A new conversation of `n_ctx` tokens on the CPU, or on `placement`, which must have been
    /// made from `model`.
    pub fn new(
        model: &Arc<Model>,
        n_ctx: usize,
        kv_type: KvType,
        placement: Option<&Placement>,
    ) -> Result<Executor> {
        let Some(placement) = placement else {
            return Ok(Executor::Cpu(Session::new(Arc::clone(model), n_ctx, kv_type)?));
        };
        if !Arc::ptr_eq(placement.model(), model) {
            return Err(Error::InvalidArgument(
                "the GpuModel was built from a different Model".into(),
            ));
        }
        if n_ctx == 0 {
            return Err(Error::InvalidArgument("n_ctx must be > 0".into()));
        }
        let exec = match placement {
            Placement::Cuda(m) => {
                HybridSession::new(Arc::clone(m), n_ctx, kv_type).map(|h| Executor::Cuda(h.into()))
            }
            Placement::Emulated(m) => HybridSession::new(Arc::clone(m), n_ctx, kv_type)
                .map(|h| Executor::Emulated(h.into())),
        };
        exec.map_err(device_error)
    }

    /// The most prompt tokens one forward pass evaluates.
    pub fn prompt_rows(&self) -> usize {
        on_device!(self, s => s.pass_rows(), h => h.prompt_rows())
    }

    /// "cpu", "cuda" or "emulated".
    pub fn device(&self) -> &'static str {
        match self {
            Executor::Cpu(_) => "cpu",
            Executor::Cuda(_) => "cuda",
            Executor::Emulated(_) => "emulated",
        }
    }

    /// The CPU session: the whole executor, or the hybrid's (history, sparsity, CPU layers).
    pub fn cpu(&mut self) -> &mut Session {
        on_device!(self, s => s, h => &mut h.cpu)
    }

    pub fn cpu_ref(&self) -> &Session {
        on_device!(self, s => s, h => &h.cpu)
    }

    /// The session, if it runs wholly on the CPU; `what` names the operation refused otherwise.
    pub fn cpu_only(&mut self, what: &str) -> Result<&mut Session> {
        match self {
            Executor::Cpu(s) => Ok(s),
            _ => Err(Error::InvalidArgument(format!("{what} runs on CPU sessions only"))),
        }
    }

    pub fn eval(&mut self, tokens: &[u32], all_logits: bool) -> Result<Vec<f32>> {
        on_device!(self, s => s.eval(tokens, all_logits), h => h.eval(tokens, all_logits))
    }

    pub fn set_sparsity(&mut self, sp: Sparsity) -> Result<()> {
        let hybrid = |r: std::result::Result<(), CudaError>| {
            r.map_err(|e| match e {
                CudaError::Plan(m) => Error::InvalidArgument(m),
                e => Error::InvalidArgument(e.to_string()),
            })
        };
        on_device!(self, s => s.set_sparsity(sp), h => hybrid(h.set_sparsity(sp)))
    }

    /// Hybrid sessions: the KV cache bytes on the device and the neurons computed on each side
    /// since the last call (then reset). None on the CPU.
    pub fn take_split(&mut self) -> Option<(usize, SplitCounts)> {
        on_device!(self, _s => None, h => Some((h.kv_bytes(), h.take_counts())))
    }
}

/// A device failure as the core's error: a placement the device refuses is a bad argument.
fn device_error(e: CudaError) -> Error {
    match e {
        CudaError::Plan(m) => Error::InvalidArgument(m),
        e => Error::Device(e.to_string()),
    }
}

/// The next token of each executor (`tokens[i]` at the next position of `execs[i]`) as one
/// batch; returns their logits rows, each exactly what a single-token `eval` gives. CPU sessions
/// go as one pass that reads each weight once for all of them. Hybrid sessions decode one token
/// at a time (the hybrid backend has no batched pass): each in turn, after the whole batch is
/// checked, so that a refused batch changes no session.
pub fn decode_batch(execs: &mut [&mut Executor], tokens: &[u32]) -> Result<Vec<Vec<f32>>> {
    if execs.iter().all(|e| matches!(**e, Executor::Cpu(_))) {
        let mut cpu: Vec<&mut Session> = execs.iter_mut().map(|e| e.cpu()).collect();
        return session::decode_batch(&mut cpu, tokens);
    }
    session::check_batch(&execs.iter().map(|e| e.cpu_ref()).collect::<Vec<_>>(), tokens)?;
    execs.iter_mut().zip(tokens).map(|(e, &token)| e.eval(&[token], false)).collect()
}
