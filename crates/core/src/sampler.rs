//! Token sampling from logits: repetition penalty, then greedy or temperature sampling filtered
//! by top-k, top-p and min-p, in llama.cpp's order. A seeded generator makes runs repeatable.

use crate::error::{Error, Result};

/// xoshiro256** seeded through splitmix64: small, fast and stable across releases, so the same
/// seed gives the same text in every version of this crate.
#[derive(Clone, Debug)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    pub fn new(seed: u64) -> Rng {
        let mut z = seed;
        let mut next = || {
            z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut x = z;
            x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            x ^ (x >> 31)
        };
        Rng { s: [next(), next(), next(), next()] }
    }

    pub fn next_u64(&mut self) -> u64 {
        let result = self.s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = self.s[1] << 17;
        self.s[2] ^= self.s[0];
        self.s[3] ^= self.s[1];
        self.s[1] ^= self.s[2];
        self.s[0] ^= self.s[3];
        self.s[2] ^= t;
        self.s[3] = self.s[3].rotate_left(45);
        result
    }

    /// Uniform in [0, 1).
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
}

#[derive(Clone, Debug)]
pub struct SamplingParams {
    /// 0 means greedy (argmax).
    pub temperature: f32,
    /// 0 disables.
    pub top_k: usize,
    /// 1.0 disables.
    pub top_p: f32,
    /// 0.0 disables.
    pub min_p: f32,
    /// 1.0 disables.
    pub repeat_penalty: f32,
    /// How many recent tokens the penalty looks at.
    pub repeat_last_n: usize,
    /// Tokens never picked (their logits count as -inf): the end-of-generation tokens when a
    /// generation ignores them.
    pub banned: Vec<u32>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            banned: Vec::new(),
        }
    }
}

impl SamplingParams {
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::InvalidArgument(m));
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return bad(format!(
                "temperature must be a finite number >= 0, got {}",
                self.temperature
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if !(self.min_p >= 0.0 && self.min_p <= 1.0) {
            return bad(format!("min_p must be in [0, 1], got {}", self.min_p));
        }
        if !self.repeat_penalty.is_finite() || self.repeat_penalty <= 0.0 {
            return bad(format!(
                "repeat_penalty must be a finite number > 0, got {}",
                self.repeat_penalty
            ));
        }
        Ok(())
    }
}

pub struct Sampler {
    pub params: SamplingParams,
    rng: Rng,
    // Scratch reused across tokens: (token id, logit or probability).
    candidates: Vec<(u32, f32)>,
}

impl Sampler {
    pub fn new(params: SamplingParams, seed: u64) -> Result<Sampler> {
        params.validate()?;
        Ok(Sampler { params, rng: Rng::new(seed), candidates: Vec::new() })
    }

    /// Picks the next token from `logits` (modified in place by the penalty); `recent` holds the
    /// tokens seen so far (prompt and generated), newest last.
    pub fn sample(&mut self, logits: &mut [f32], recent: &[u32]) -> u32 {
        let p = &self.params;
        for &t in &p.banned {
            if let Some(l) = logits.get_mut(t as usize) {
                *l = f32::NEG_INFINITY;
            }
        }
        if p.repeat_penalty != 1.0 && p.repeat_last_n > 0 {
            let start = recent.len().saturating_sub(p.repeat_last_n);
            let mut seen = std::collections::HashSet::new();
            for &t in &recent[start..] {
                if (t as usize) < logits.len() && seen.insert(t) {
                    let l = &mut logits[t as usize];
                    *l = if *l > 0.0 { *l / p.repeat_penalty } else { *l * p.repeat_penalty };
                }
            }
        }
        if p.temperature <= 0.0 {
            return argmax(logits);
        }

        let c = &mut self.candidates;
        c.clear();
        c.extend(logits.iter().enumerate().map(|(i, &l)| (i as u32, l)));
        let by_logit_desc =
            |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        // top-k: keep the k largest (partial selection, then sort only those).
        if p.top_k > 0 && p.top_k < c.len() {
            c.select_nth_unstable_by(p.top_k - 1, by_logit_desc);
            c.truncate(p.top_k);
        }
        c.sort_unstable_by(by_logit_desc);

        // Softmax with temperature, over the survivors.
        let max = c[0].1;
        let mut sum = 0.0f32;
        for e in c.iter_mut() {
            e.1 = ((e.1 - max) / p.temperature).exp();
            sum += e.1;
        }
        for e in c.iter_mut() {
            e.1 /= sum;
        }
        // top-p: smallest prefix whose mass reaches p.
        if p.top_p < 1.0 {
            let mut cum = 0.0;
            let mut keep = c.len();
            for (i, e) in c.iter().enumerate() {
                cum += e.1;
                if cum >= p.top_p {
                    keep = i + 1;
                    break;
                }
            }
            c.truncate(keep);
        }
        // min-p: drop tokens below min_p times the best probability.
        if p.min_p > 0.0 {
            let floor = c[0].1 * p.min_p;
            let keep = c.iter().take_while(|e| e.1 >= floor).count().max(1);
            c.truncate(keep);
        }
        let total: f32 = c.iter().map(|e| e.1).sum();
        let mut r = self.rng.next_f32() * total;
        for e in c.iter() {
            r -= e.1;
            if r < 0.0 {
                return e.0;
            }
        }
        c[c.len() - 1].0
    }
}

/// Index of the largest logit (the first one on ties).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_k: usize, top_p: f32, min_p: f32) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p,
            min_p,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            banned: Vec::new(),
        }
    }

    #[test]
    fn greedy_is_argmax() {
        let mut s = Sampler::new(params(0.0, 0, 1.0, 0.0), 1).unwrap();
        assert_eq!(s.sample(&mut [0.1, 3.0, -1.0, 2.9], &[]), 1);
    }

    #[test]
    fn top_k_one_is_greedy_at_any_temperature() {
        let mut s = Sampler::new(params(5.0, 1, 1.0, 0.0), 9).unwrap();
        for _ in 0..50 {
            assert_eq!(s.sample(&mut [0.1, 3.0, -1.0, 2.9], &[]), 1);
        }
    }

    #[test]
    fn sampling_frequencies_follow_softmax() {
        let logits = [1.0f32, 2.0, 0.0, 1.5];
        let mut s = Sampler::new(params(1.0, 0, 1.0, 0.0), 3).unwrap();
        let mut counts = [0usize; 4];
        let n = 40_000;
        for _ in 0..n {
            counts[s.sample(&mut logits.clone(), &[]) as usize] += 1;
        }
        let z: f64 = logits.iter().map(|&l| (l as f64).exp()).sum();
        for i in 0..4 {
            let p = (logits[i] as f64).exp() / z;
            let f = counts[i] as f64 / n as f64;
            assert!((p - f).abs() < 0.01, "token {i}: frequency {f} vs probability {p}");
        }
    }

    #[test]
    fn top_p_and_min_p_cut_the_tail() {
        // probabilities ~ [0.64, 0.24, 0.09, 0.03]
        let logits = [3.0f32, 2.0, 1.0, 0.0];
        let mut s = Sampler::new(params(1.0, 0, 0.8, 0.0), 5).unwrap();
        for _ in 0..500 {
            assert!(s.sample(&mut logits.clone(), &[]) <= 1);
        }
        let mut s = Sampler::new(params(1.0, 0, 1.0, 0.3), 5).unwrap();
        for _ in 0..500 {
            assert!(s.sample(&mut logits.clone(), &[]) <= 1);
        }
    }

    #[test]
    fn same_seed_same_tokens() {
        let logits: Vec<f32> = (0..100).map(|i| ((i * 37) % 11) as f32 * 0.3).collect();
        let run = |seed| {
            let mut s = Sampler::new(params(1.0, 0, 1.0, 0.0), seed).unwrap();
            (0..20).map(|_| s.sample(&mut logits.clone(), &[])).collect::<Vec<_>>()
        };
        assert_eq!(run(42), run(42));
        assert_ne!(run(42), run(43));
    }

    #[test]
    fn repeat_penalty_discourages_seen_tokens() {
        let mut p = params(0.0, 0, 1.0, 0.0);
        p.repeat_penalty = 2.0;
        let mut s = Sampler::new(p, 1).unwrap();
        assert_eq!(s.sample(&mut [2.0, 1.5], &[0]), 1);
        assert_eq!(s.sample(&mut [-1.0, -1.5], &[1]), 0);
    }

    #[test]
    fn banned_tokens_are_never_picked() {
        let logits = [1.0f32, 9.0, 0.0, 8.5];
        let mut p = params(0.0, 0, 1.0, 0.0);
        p.banned = vec![1, 77];
        assert_eq!(Sampler::new(p.clone(), 1).unwrap().sample(&mut logits.clone(), &[]), 3);
        p.temperature = 2.0;
        let mut s = Sampler::new(p, 1).unwrap();
        let picks: Vec<u32> = (0..500).map(|_| s.sample(&mut logits.clone(), &[])).collect();
        assert!(!picks.contains(&1) && picks.contains(&3) && picks.contains(&0));
    }

    #[test]
    fn invalid_values_are_rejected() {
        assert!(Sampler::new(params(-1.0, 0, 1.0, 0.0), 0).is_err());
        assert!(Sampler::new(params(f32::NAN, 0, 1.0, 0.0), 0).is_err());
        assert!(Sampler::new(params(1.0, 0, 0.0, 0.0), 0).is_err());
        assert!(Sampler::new(params(1.0, 0, 1.5, 0.0), 0).is_err());
        assert!(Sampler::new(params(1.0, 0, 1.0, -0.1), 0).is_err());
        let mut p = params(1.0, 0, 1.0, 0.0);
        p.repeat_penalty = 0.0;
        assert!(Sampler::new(p, 0).is_err());
    }
}
