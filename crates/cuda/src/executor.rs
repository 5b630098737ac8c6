//! Where a session's tokens run: on the CPU (`Session`), or through the hybrid backend on a
//! placed model (hot parts on a device, the rest on the CPU); and how a batch of sessions
//! decodes together. The bindings wrap one `Executor` per session and hold no policy of their
//! own.
//!
//! This module chooses and sequences; it computes nothing itself.

use powerinfer_core::session::{self, Sparsity};
use powerinfer_core::{Error, Result, Session};

use crate::hybrid::{HybridRun, SplitCounts};
use crate::CudaError;

/// A session on the CPU, or on a placed model through the hybrid backend.
// (one per session, behind its lock: the CPU session's size is not copied around)
#[allow(clippy::large_enum_variant)]
pub enum Executor {
    Cpu(Session),
    Hybrid(Box<dyn HybridRun>),
}

impl Executor {
    /// "cpu", or the hybrid backend's device: "cuda" or "emulated".
    pub fn device(&self) -> &'static str {
        match self {
            Executor::Cpu(_) => "cpu",
            Executor::Hybrid(h) => h.device(),
        }
    }

    /// The CPU session: the whole executor, or the hybrid's (history, sparsity, CPU layers).
    pub fn cpu(&mut self) -> &mut Session {
        match self {
            Executor::Cpu(s) => s,
            Executor::Hybrid(h) => h.cpu_mut(),
        }
    }

    pub fn cpu_ref(&self) -> &Session {
        match self {
            Executor::Cpu(s) => s,
            Executor::Hybrid(h) => h.cpu(),
        }
    }

    /// The session, if it runs wholly on the CPU; `what` names the operation refused otherwise.
    pub fn cpu_only(&mut self, what: &str) -> Result<&mut Session> {
        match self {
            Executor::Cpu(s) => Ok(s),
            Executor::Hybrid(_) => {
                Err(Error::InvalidArgument(format!("{what} runs on CPU sessions only")))
            }
        }
    }

    pub fn eval(&mut self, tokens: &[u32], all_logits: bool) -> Result<Vec<f32>> {
        match self {
            Executor::Cpu(s) => s.eval(tokens, all_logits),
            Executor::Hybrid(h) => h.eval(tokens, all_logits),
        }
    }

    pub fn set_sparsity(&mut self, sp: Sparsity) -> Result<()> {
        match self {
            Executor::Cpu(s) => s.set_sparsity(sp),
            Executor::Hybrid(h) => h.set_sparsity(sp).map_err(|e| match e {
                CudaError::Plan(m) => Error::InvalidArgument(m),
                e => Error::InvalidArgument(e.to_string()),
            }),
        }
    }

    /// Hybrid sessions: the KV cache bytes on the device and the neurons computed on each side
    /// since the last call (then reset). None on the CPU.
    pub fn take_split(&mut self) -> Option<(usize, SplitCounts)> {
        match self {
            Executor::Cpu(_) => None,
            Executor::Hybrid(h) => Some((h.kv_bytes(), h.take_counts())),
        }
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
