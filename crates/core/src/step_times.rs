//! Where a forward pass's time goes, step by step: `Timed` wraps a `Backend` and adds the wall
//! time of each of its calls to a `StepTimes`, so the layer in `forward.rs` stays as it is and
//! a pass without timing is the plain backend (no clock read at all). The steps' names are the
//! `Backend` methods'.
//!
//! A CPU step returns when its work is done, so its time is the step's. (A GPU backend's steps
//! may return before their kernels finish; the sessions time only the CPU's passes.)

use std::time::Instant;

use crate::forward::{Backend, Norm, Part};
use crate::Result;

/// The forward pass's steps, as `StepTimes` counts them: one per `Backend` method.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    Embed,
    Norm,
    Qkv,
    QkNorm,
    Rope,
    KvStore,
    Attend,
    AttnOut,
    Ffn,
    Route,
    Experts,
    PostNorm,
    Residual,
    Logits,
}

impl Step {
    pub const ALL: [Step; 14] = [
        Step::Embed,
        Step::Norm,
        Step::Qkv,
        Step::QkNorm,
        Step::Rope,
        Step::KvStore,
        Step::Attend,
        Step::AttnOut,
        Step::Ffn,
        Step::Route,
        Step::Experts,
        Step::PostNorm,
        Step::Residual,
        Step::Logits,
    ];

    /// The `Backend` method's name.
    pub fn name(self) -> &'static str {
        match self {
            Step::Embed => "embed",
            Step::Norm => "norm",
            Step::Qkv => "qkv",
            Step::QkNorm => "qk_norm",
            Step::Rope => "rope",
            Step::KvStore => "kv_store",
            Step::Attend => "attend",
            Step::AttnOut => "attn_out",
            Step::Ffn => "ffn",
            Step::Route => "route",
            Step::Experts => "experts",
            Step::PostNorm => "post_norm",
            Step::Residual => "residual",
            Step::Logits => "logits",
        }
    }
}

/// Nanoseconds spent in each step (indexed as `Step::ALL`) and the passes they cover.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepTimes {
    pub ns: [u64; Step::ALL.len()],
    pub passes: u64,
}

impl StepTimes {
    /// (name, seconds) of every step, in the layer's order.
    pub fn seconds(&self) -> impl Iterator<Item = (&'static str, f64)> + '_ {
        Step::ALL.iter().map(|&s| (s.name(), self.ns[s as usize] as f64 * 1e-9))
    }
}

/// A backend whose every step is timed into `times`.
pub struct Timed<'t, B> {
    inner: B,
    times: &'t mut StepTimes,
}

impl<'t, B: Backend> Timed<'t, B> {
    /// Wraps `inner`; the pass it runs counts as one in `times.passes`.
    pub fn new(inner: B, times: &'t mut StepTimes) -> Self {
        times.passes += 1;
        Timed { inner, times }
    }

    fn time<R>(&mut self, step: Step, run: impl FnOnce(&mut B) -> R) -> R {
        let start = Instant::now();
        let r = run(&mut self.inner);
        self.times.ns[step as usize] += start.elapsed().as_nanos() as u64;
        r
    }
}

impl<B: Backend> Backend for Timed<'_, B> {
    fn embed(&mut self, tokens: &[u32]) -> Result<()> {
        self.time(Step::Embed, |b| b.embed(tokens))
    }
    fn norm(&mut self, l: usize, which: Norm) -> Result<()> {
        self.time(Step::Norm, |b| b.norm(l, which))
    }
    fn qkv(&mut self, l: usize) -> Result<()> {
        self.time(Step::Qkv, |b| b.qkv(l))
    }
    fn qk_norm(&mut self, l: usize) -> Result<()> {
        self.time(Step::QkNorm, |b| b.qk_norm(l))
    }
    fn rope(&mut self, l: usize) -> Result<()> {
        self.time(Step::Rope, |b| b.rope(l))
    }
    fn kv_store(&mut self, l: usize) -> Result<()> {
        self.time(Step::KvStore, |b| b.kv_store(l))
    }
    fn attend(&mut self, l: usize) -> Result<()> {
        self.time(Step::Attend, |b| b.attend(l))
    }
    fn attn_out(&mut self, l: usize) -> Result<()> {
        self.time(Step::AttnOut, |b| b.attn_out(l))
    }
    fn ffn(&mut self, l: usize) -> Result<()> {
        self.time(Step::Ffn, |b| b.ffn(l))
    }
    fn route(&mut self, l: usize) -> Result<()> {
        self.time(Step::Route, |b| b.route(l))
    }
    fn experts(&mut self, l: usize) -> Result<()> {
        self.time(Step::Experts, |b| b.experts(l))
    }
    fn post_norm(&mut self, l: usize, part: Part) -> Result<()> {
        self.time(Step::PostNorm, |b| b.post_norm(l, part))
    }
    fn residual(&mut self, l: usize, part: Part) -> Result<()> {
        self.time(Step::Residual, |b| b.residual(l, part))
    }
    fn logits(&mut self, m: usize) -> Result<Vec<f32>> {
        self.time(Step::Logits, |b| b.logits(m))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A backend that records the steps it was asked for; its FFN fails.
    #[derive(Default)]
    struct Recording {
        calls: Vec<Step>,
    }

    impl Backend for Recording {
        fn embed(&mut self, _: &[u32]) -> Result<()> {
            self.calls.push(Step::Embed);
            Ok(())
        }
        fn norm(&mut self, _: usize, _: Norm) -> Result<()> {
            self.calls.push(Step::Norm);
            Ok(())
        }
        fn qkv(&mut self, _: usize) -> Result<()> {
            self.calls.push(Step::Qkv);
            Ok(())
        }
        fn qk_norm(&mut self, _: usize) -> Result<()> {
            self.calls.push(Step::QkNorm);
            Ok(())
        }
        fn rope(&mut self, _: usize) -> Result<()> {
            self.calls.push(Step::Rope);
            Ok(())
        }
        fn kv_store(&mut self, _: usize) -> Result<()> {
            self.calls.push(Step::KvStore);
            Ok(())
        }
        fn attend(&mut self, _: usize) -> Result<()> {
            self.calls.push(Step::Attend);
            // long enough for any clock to see
            std::thread::sleep(std::time::Duration::from_millis(2));
            Ok(())
        }
        fn attn_out(&mut self, _: usize) -> Result<()> {
            self.calls.push(Step::AttnOut);
            Ok(())
        }
        fn ffn(&mut self, _: usize) -> Result<()> {
            self.calls.push(Step::Ffn);
            Err(crate::Error::InvalidArgument("ffn failed".into()))
        }
        fn route(&mut self, _: usize) -> Result<()> {
            self.calls.push(Step::Route);
            Ok(())
        }
        fn experts(&mut self, _: usize) -> Result<()> {
            self.calls.push(Step::Experts);
            Ok(())
        }
        fn post_norm(&mut self, _: usize, _: Part) -> Result<()> {
            self.calls.push(Step::PostNorm);
            Ok(())
        }
        fn residual(&mut self, _: usize, _: Part) -> Result<()> {
            self.calls.push(Step::Residual);
            Ok(())
        }
        fn logits(&mut self, m: usize) -> Result<Vec<f32>> {
            self.calls.push(Step::Logits);
            Ok(vec![1.0; m])
        }
    }

    /// Every step reaches the wrapped backend with its arguments and its result comes back,
    /// errors included; a step's time lands in its own slot.
    #[test]
    fn timed_passes_every_step_through_and_times_it_in_its_slot() {
        let mut times = StepTimes::default();
        let mut t = Timed::new(Recording::default(), &mut times);
        t.embed(&[1]).unwrap();
        t.norm(0, Norm::Attn).unwrap();
        t.qkv(0).unwrap();
        t.qk_norm(0).unwrap();
        t.rope(0).unwrap();
        t.kv_store(0).unwrap();
        t.attend(0).unwrap();
        t.attn_out(0).unwrap();
        assert!(t.ffn(0).is_err());
        t.route(0).unwrap();
        t.experts(0).unwrap();
        t.post_norm(0, Part::Ffn).unwrap();
        t.residual(0, Part::Ffn).unwrap();
        assert_eq!(t.logits(3).unwrap(), vec![1.0; 3]);
        assert_eq!(t.inner.calls, Step::ALL.to_vec());
        assert_eq!(times.passes, 1);
        let attend = times.ns[Step::Attend as usize];
        assert!(attend >= 2_000_000, "attend's 2 ms sleep timed as {attend} ns");
        let others: u64 = times.ns.iter().sum::<u64>() - attend;
        assert!(others < attend, "the other steps ({others} ns) took longer than the sleep");
        assert_eq!(
            Step::ALL.iter().map(|s| s.name()).collect::<Vec<_>>().len(),
            times.seconds().count()
        );
    }
}
