//! The CPU backend: every step of the layer (`forward::Backend`) on the CPU, over the rows of
//! one session (a prompt, a decode token) or of several sessions, one row each (batched decode).
//! A pass reads each weight matrix once whatever its number of rows; each row reads and extends
//! its own session's KV cache and counts into its own session's stats.
//!
//! Passes over several sessions never see input sparsity or a recorder (`check_batch` and
//! `decode_batch` keep those sessions out), so only a one-session pass consults them.

use super::{
    add_bias, add_into, attend_block, attend_group, attend_group_partial, cells_ffn, expert_rows,
    ffn_rows, matmul, merge_partials, norm_rows, pick_routes, project, rmsnorm_in_place, rope_rows,
    route_rows, softcap, Arc, Error, ExpertSlot, FfnStats, InputGroup, Model, Partial, PassState,
    Result, Scoring, Scratch, Session, Sparsity,
};
use crate::forward::{Backend, Norm, Part};
use crate::matmul::QMatrix;
use rayon::iter::IndexedParallelIterator;
use rayon::iter::IntoParallelIterator;
use rayon::iter::IntoParallelRefMutIterator;
use rayon::iter::ParallelIterator;
use rayon::prelude::ParallelSliceMut;

pub struct CpuPass<'a> {
    model: Arc<Model>,
    sessions: Vec<&'a mut Session>,
    /// Per row: (its session's index in `sessions`, its position).
    rows: Vec<(usize, usize)>,
    s: Scratch,
    /// `s` is sessions[0]'s own scratch (a one-session pass), given back on drop.
    borrowed_scratch: bool,
}

impl<'a> CpuPass<'a> {
    /// A pass over the next `n` positions of one session.
    pub fn new(se: &'a mut Session, n: usize) -> CpuPass<'a> {
        let pos0 = se.pos();
        let s = std::mem::take(&mut se.s);
        CpuPass {
            model: Arc::clone(&se.model),
            rows: (pos0..pos0 + n).map(|p| (0, p)).collect(),
            sessions: vec![se],
            s,
            borrowed_scratch: true,
        }
    }

    /// A pass of one row per session, each at its session's next position (a batch that
    /// `check_batch` accepted, without input sparsity).
    pub(crate) fn batch(sessions: Vec<&'a mut Session>) -> CpuPass<'a> {
        let rows = sessions.iter().enumerate().map(|(i, se)| (i, se.pos())).collect();
        CpuPass {
            model: Arc::clone(&sessions[0].model),
            sessions,
            rows,
            s: Scratch::default(),
            borrowed_scratch: false,
        }
    }

    /// The residual stream x (n, n_embd), for an executor that moves it between devices.
    pub fn residual_stream(&mut self) -> &mut [f32] {
        let n = self.rows.len() * self.model.config.n_embd;
        &mut self.s.x[..n]
    }

    /// The normed block input xb (n, n_embd), for an executor that computed it elsewhere.
    pub fn normed_input(&mut self) -> &mut [f32] {
        let n = self.rows.len() * self.model.config.n_embd;
        &mut self.s.xb[..n]
    }

    /// The FFN's output (n, n_embd) as the last `ffn` or `experts` step left it.
    pub fn ffn_output(&self) -> &[f32] {
        let n = self.rows.len() * self.model.config.n_embd;
        &self.s.ffn_out[..n]
    }

    /// The FFN of layer l over the cells `keep` (n, n_ff) marks, from `normed_input` into
    /// `ffn_output` (without the down bias): row t computes neuron j iff keep[t * n_ff + j],
    /// its down rows read from the neuron-major `down_t` (n_ff, n_embd). For an executor that
    /// computes the other cells elsewhere (the hybrid's cold neurons of a prompt's rows).
    pub fn ffn_of_cells(&mut self, l: usize, down_t: &QMatrix, keep: &[bool]) -> Result<()> {
        let (n, c) = (self.rows.len(), &self.model.config);
        if keep.len() != n * c.n_ff || (down_t.rows, down_t.cols) != (c.n_ff, c.n_embd) {
            return Err(Error::InvalidArgument(format!(
                "{} cells and a down_t of {} x {} for {n} rows of {} neurons of {}",
                keep.len(),
                down_t.rows,
                down_t.cols,
                c.n_ff,
                c.n_embd
            )));
        }
        cells_ffn(&self.model, l, down_t, keep, n, &mut self.s);
        Ok(())
    }

    /// Each row's experts and weights (n, n_used) from the last `route` step, most probable
    /// first.
    pub fn routes(&self) -> &[(u32, f32)] {
        let k = self.model.config.moe.map_or(0, |m| m.n_used);
        &self.s.routes[..self.rows.len() * k]
    }

    /// The `route` step from router logits (n, n_expert) another device computed.
    pub fn route_from(&mut self, l: usize, logits: &[f32]) -> Result<()> {
        let n = self.rows.len();
        let n_expert = self.model.config.moe.map_or(0, |m| m.n_expert);
        if logits.len() != n * n_expert {
            return Err(Error::InvalidArgument(format!(
                "{} router logits for {n} rows of {n_expert} experts",
                logits.len()
            )));
        }
        self.s.router_logits.clear();
        self.s.router_logits.extend_from_slice(logits);
        pick_routes(&self.model, &mut self.s, n);
        self.count_routes(l);
        Ok(())
    }

    /// Each row's experts of layer l (s.routes), counted for its session.
    fn count_routes(&mut self, l: usize) {
        let c = &self.model.config;
        let moe = c.moe.expect("a mixture-of-experts model");
        let (n_expert, k) = (moe.n_expert, moe.n_used);
        for (t, &(i, _)) in self.rows.iter().enumerate() {
            let counts = &mut self.sessions[i].state.expert_counts;
            counts.resize(c.n_layer * n_expert, 0);
            for &(e, _) in &self.s.routes[t * k..(t + 1) * k] {
                counts[l * n_expert + e as usize] += 1;
            }
        }
    }

    /// The `experts` step with the experts `elsewhere` marks, and with `shared_elsewhere` the
    /// shared expert, computed by another device: `fill(slots, out, shared)` writes their outputs
    /// (see `ExpertSlot`, `moe::expert_rows`) before the rows' sums.
    pub fn experts_except(
        &mut self,
        l: usize,
        elsewhere: &[bool],
        shared_elsewhere: bool,
        fill: impl FnOnce(&[ExpertSlot], &mut [f32], Option<&mut [f32]>) -> Result<()>,
    ) -> Result<()> {
        // every row of the pass at once, whichever session it belongs to: the experts are
        // dense (sparsity and recorders are refused on mixture-of-experts models)
        let mut stats = FfnStats::default();
        let n = self.rows.len();
        let (model, s) = (&self.model, &mut self.s);
        expert_rows(model, s, &mut stats, l, n, elsewhere, shared_elsewhere, fill)?;
        count(&mut self.sessions, stats);
        Ok(())
    }

    /// The rows' RoPE angles (cos, sin) of RoPE set `set` (see `Config::rope_set`),
    /// (n, rope_dim / 2) each, as `embed` computed them.
    pub fn rope_angles(&self, set: usize) -> (&[f32], &[f32]) {
        let len = self.rows.len() * self.model.config.rope_dim / 2;
        (&self.s.cos[set * len..(set + 1) * len], &self.s.sin[set * len..(set + 1) * len])
    }

    /// The session of a one-session pass.
    pub fn session(&mut self) -> &mut Session {
        self.sessions[0]
    }
}

impl Drop for CpuPass<'_> {
    fn drop(&mut self) {
        if self.borrowed_scratch {
            self.sessions[0].s = std::mem::take(&mut self.s);
        }
    }
}

/// Adds a pass's counters to its sessions, each row's share to the row's session (in a batch
/// every row costs the same, one per session).
fn count(sessions: &mut [&mut Session], stats: FfnStats) {
    let share = stats.share_of(sessions.len() as u64);
    sessions.iter_mut().for_each(|se| se.state.stats.add(share));
}

/// A projection group's input cut-off (input sparsity), after showing its input x to the
/// session's recorder; only one-session passes have either.
fn cut_and_record(
    sessions: &mut [&mut Session],
    model: &Model,
    l: usize,
    g: InputGroup,
    x: &[f32],
) -> Option<f32> {
    let [se] = sessions else { return None };
    if let Some(r) = &mut se.state.recorder {
        r.projection_input(model, l, g, x);
    }
    se.state.sparsity.input_cut(l, g)
}

impl Backend for CpuPass<'_> {
    fn embed(&mut self, tokens: &[u32]) -> Result<()> {
        let (c, s) = (&self.model.config, &mut self.s);
        s.resize_for(self.rows.len(), c);
        let positions = || self.rows.iter().map(|&(_, pos)| pos);
        s.embed(&self.model.weights, c.n_embd, tokens, positions());
        if c.embed_scale != 1.0 {
            s.x.iter_mut().for_each(|v| *v *= c.embed_scale);
        }
        // every session of a model has the same RoPE frequencies
        s.rope_angles(&self.sessions[0].rope, positions());
        Ok(())
    }

    fn norm(&mut self, l: usize, which: Norm) -> Result<()> {
        let (c, lw, s) = (&self.model.config, &self.model.weights.layers[l], &mut self.s);
        let (w, b) = match which {
            Norm::Attn => (Some(&lw.attn_norm), &lw.attn_norm_b),
            Norm::Attn2 => (lw.attn_norm_2.as_ref(), &lw.attn_norm_2_b),
            Norm::Ffn => (lw.ffn_norm.as_ref(), &lw.ffn_norm_b),
        };
        let w = w.ok_or_else(|| Error::Model(format!("layer {l} has no {which:?} norm")))?;
        norm_rows(c.family, &mut s.xb, &s.x, w, b.as_deref(), c.norm_eps);
        Ok(())
    }

    fn qkv(&mut self, l: usize) -> Result<()> {
        let CpuPass { model, sessions, rows, s, .. } = self;
        let (n, lw) = (rows.len(), &model.weights.layers[l]);
        // q (n, q_dim), k and v (n, kv_dim), plus biases
        let x = &s.xb[..n * model.config.n_embd];
        let cut = cut_and_record(sessions, model, l, InputGroup::Qkv, x);
        let mut stats = FfnStats::default();
        let outs: &mut [&mut [f32]] = &mut [&mut s.q, &mut s.k, &mut s.v];
        project(
            model,
            l,
            InputGroup::Qkv,
            cut,
            x,
            n,
            &mut s.acts,
            &mut s.masked,
            &mut s.sparse,
            outs,
            &mut stats,
        );
        add_bias(&mut s.q, lw.bq.as_deref());
        add_bias(&mut s.k, lw.bk.as_deref());
        add_bias(&mut s.v, lw.bv.as_deref());
        count(sessions, stats);
        Ok(())
    }

    fn qk_norm(&mut self, l: usize) -> Result<()> {
        let (c, lw, s) = (&self.model.config, &self.model.weights.layers[l], &mut self.s);
        let missing =
            || Error::Model(format!("layer {l} has only one of attn_q_norm and attn_k_norm"));
        rmsnorm_in_place(&mut s.q, lw.q_norm.as_ref().ok_or_else(missing)?, c.norm_eps);
        rmsnorm_in_place(&mut s.k, lw.k_norm.as_ref().ok_or_else(missing)?, c.norm_eps);
        Ok(())
    }

    fn rope(&mut self, l: usize) -> Result<()> {
        let (c, s) = (&self.model.config, &mut self.s);
        // this layer's set of angles (sliding layers may have their own base)
        let len = self.rows.len() * c.rope_dim / 2;
        let at = c.rope_set(l) * len;
        let (cos, sin) = (&s.cos[at..at + len], &s.sin[at..at + len]);
        rope_rows(&mut s.q, c.head_dim, c.rope_dim, c.rope_style, cos, sin);
        rope_rows(&mut s.k, c.head_dim, c.rope_dim, c.rope_style, cos, sin);
        Ok(())
    }

    fn kv_store(&mut self, l: usize) -> Result<()> {
        let kv_dim = self.model.config.kv_dim();
        for (t, &(i, pos)) in self.rows.iter().enumerate() {
            let se = &mut self.sessions[i];
            for row in se.kv_rows(l, pos).into_iter().flatten() {
                se.k_cache[l].write(row * kv_dim, &self.s.k[t * kv_dim..(t + 1) * kv_dim]);
                se.v_cache[l].write(row * kv_dim, &self.s.v[t * kv_dim..(t + 1) * kv_dim]);
            }
        }
        Ok(())
    }

    fn attend(&mut self, l: usize) -> Result<()> {
        let CpuPass { model, sessions, rows, s, .. } = self;
        let c = &model.config;
        let (q_dim, kv_dim, hd) = (c.q_dim(), c.kv_dim(), c.head_dim);
        let sessions: &[&mut Session] = sessions;
        let group = c.n_head / c.n_head_kv;
        let q = &s.q;
        // kv head g's query heads' way from scores to weights
        let sinks = model.weights.layers[l].attn_sinks.as_deref();
        let scoring = |g: usize| Scoring {
            scale: c.attn_scale,
            softcap: c.attn_softcap,
            sinks: sinks.map_or(&[][..], |s| &s[g * group..(g + 1) * group]),
        };
        let attend = |idx: usize, out: &mut [f32], scores: &mut Vec<f32>| {
            let (t, g) = (idx / c.n_head_kv, idx % c.n_head_kv);
            // the query heads of kv head g are contiguous: g * group .. (g + 1) * group
            let qs = &q[t * q_dim + g * group * hd..t * q_dim + (g + 1) * group * hd];
            // causal: row t attends to positions 0..=its own (the window's in a sliding layer),
            // which lie in `len` consecutive cache rows from `first`
            let se = &sessions[rows[t].0];
            let (first, len) = se.kv_window(l, rows[t].1);
            let (k, v) = (
                se.k_cache[l].view_at(first * kv_dim, len * kv_dim),
                se.v_cache[l].view_at(first * kv_dim, len * kv_dim),
            );
            attend_group(qs, hd, k, v, len, kv_dim, g * hd, scoring(g), scores, out);
        };
        if rows.len() == 1 {
            // Decode: the cache's stretch is cut into pieces of consecutive positions, each a
            // task over every kv head, so that every thread has work (a few kv heads alone would
            // leave threads idle) and each task reads whole rows, in order, and few enough that
            // a piece's keys and values stay in L2 between the kv heads. Scores buffers and
            // partial results stay in the scratch (they only grow with the context).
            let (first, len) = sessions[rows[0].0].kv_window(l, rows[0].1);
            const PIECE_BYTES: usize = 64 << 10;
            let row_bytes = 2 * kv_dim * sessions[rows[0].0].k_cache[l].elem_bytes();
            let pieces = (2 * rayon::current_num_threads())
                .max(len * row_bytes / PIECE_BYTES)
                .min(len / 64)
                .max(1);
            let w = group * hd;
            if pieces == 1 {
                s.scores.resize_with(c.n_head_kv, Vec::new);
                s.att
                    .par_chunks_mut(w)
                    .zip(s.scores.par_iter_mut())
                    .enumerate()
                    .for_each(|(idx, (out, scores))| attend(idx, out, scores));
                return Ok(());
            }
            s.scores.resize_with(pieces, Vec::new);
            s.split_out.resize(pieces * q_dim, 0.0);
            s.split_parts.resize(pieces * c.n_head, Partial::default());
            let se = &sessions[rows[0].0];
            let (kc, vc) = (&se.k_cache[l], &se.v_cache[l]);
            let tasks = s
                .split_out
                .par_chunks_mut(q_dim)
                .zip(s.split_parts.par_chunks_mut(c.n_head))
                .zip(s.scores.par_iter_mut());
            tasks.enumerate().for_each(|(piece, ((outs, parts), scores))| {
                let (a, b) = (piece * len / pieces, (piece + 1) * len / pieces);
                let (k, v) = (
                    kc.view_at((first + a) * kv_dim, (b - a) * kv_dim),
                    vc.view_at((first + a) * kv_dim, (b - a) * kv_dim),
                );
                for (g, (out, parts)) in
                    outs.chunks_exact_mut(w).zip(parts.chunks_exact_mut(group)).enumerate()
                {
                    let qs = &q[g * w..(g + 1) * w];
                    attend_group_partial(
                        qs,
                        hd,
                        k,
                        v,
                        b - a,
                        kv_dim,
                        g * hd,
                        scoring(g),
                        scores,
                        out,
                        parts,
                    );
                }
            });
            for (g, out) in s.att.chunks_exact_mut(w).enumerate() {
                // kv head g's slice of every piece
                let outs = s.split_out.chunks_exact(q_dim).map(|o| &o[g * w..(g + 1) * w]);
                let parts =
                    s.split_parts.chunks_exact(c.n_head).map(|p| &p[g * group..(g + 1) * group]);
                merge_partials(outs.zip(parts), hd, scoring(g).sinks, out);
            }
        } else {
            // A prompt: consecutive rows of one session whose windows start at the same cache
            // row attend in blocks (`attend_block`), as many as the group kernels take heads
            // (8), so that each key and value is read once per block; rows of other sessions
            // (batched decode) or windows that slide go one by one.
            let per_block = (8 / group).max(1);
            let mut blocks = Vec::new();
            let mut t = 0;
            while t < rows.len() {
                let (i, pos) = rows[t];
                let window = sessions[i].kv_window(l, pos);
                let mut b = 1;
                while b < per_block
                    && t + b < rows.len()
                    && rows[t + b] == (i, pos + b)
                    && sessions[i].kv_window(l, pos + b) == (window.0, window.1 + b)
                {
                    b += 1;
                }
                blocks.push((t, b));
                t += b;
            }
            // each block's rows of the output, split off in order
            let mut rest = &mut s.att[..rows.len() * q_dim];
            let mut outs = Vec::with_capacity(blocks.len());
            for &(_, b) in &blocks {
                let (head, tail) = std::mem::take(&mut rest).split_at_mut(b * q_dim);
                outs.push(head);
                rest = tail;
            }
            let w = group * hd;
            blocks.into_par_iter().zip(outs).for_each_init(
                || (Vec::new(), Vec::new(), Vec::new()),
                |(scores, qbuf, obuf), ((t0, b), out)| {
                    if b == 1 {
                        for (g, out) in out.chunks_exact_mut(w).enumerate() {
                            attend(t0 * c.n_head_kv + g, out, scores);
                        }
                        return;
                    }
                    let se = &sessions[rows[t0].0];
                    let (first, len0) = se.kv_window(l, rows[t0].1);
                    let n = len0 + b - 1;
                    let (k, v) = (
                        se.k_cache[l].view_at(first * kv_dim, n * kv_dim),
                        se.v_cache[l].view_at(first * kv_dim, n * kv_dim),
                    );
                    for g in 0..c.n_head_kv {
                        // the block's queries' heads of kv head g, query by query
                        qbuf.clear();
                        for i in 0..b {
                            qbuf.extend_from_slice(
                                &q[(t0 + i) * q_dim + g * w..(t0 + i) * q_dim + (g + 1) * w],
                            );
                        }
                        obuf.resize(b * w, 0.0);
                        attend_block(
                            qbuf,
                            hd,
                            b,
                            k,
                            v,
                            len0,
                            kv_dim,
                            g * hd,
                            scoring(g),
                            scores,
                            obuf,
                        );
                        for i in 0..b {
                            out[i * q_dim + g * w..i * q_dim + (g + 1) * w]
                                .copy_from_slice(&obuf[i * w..(i + 1) * w]);
                        }
                    }
                },
            );
        }
        Ok(())
    }

    fn attn_out(&mut self, l: usize) -> Result<()> {
        let CpuPass { model, sessions, rows, s, .. } = self;
        let (n, lw) = (rows.len(), &model.weights.layers[l]);
        let x = &s.att[..n * model.config.q_dim()];
        let cut = cut_and_record(sessions, model, l, InputGroup::Out, x);
        let mut stats = FfnStats::default();
        let outs: &mut [&mut [f32]] = &mut [&mut s.attn_out];
        project(
            model,
            l,
            InputGroup::Out,
            cut,
            x,
            n,
            &mut s.acts,
            &mut s.masked,
            &mut s.sparse,
            outs,
            &mut stats,
        );
        add_bias(&mut s.attn_out, lw.bo.as_deref());
        count(sessions, stats);
        Ok(())
    }

    fn ffn(&mut self, l: usize) -> Result<()> {
        let CpuPass { model, sessions, rows, s, .. } = self;
        let (n, dim) = (rows.len(), model.config.n_embd);
        let lw = &model.weights.layers[l];
        if let [se] = &mut sessions[..] {
            ffn_rows(model, &mut se.state, s, l, n);
        } else if lw.ffn_down.is_some()
            && sessions.iter().all(|se| matches!(se.state.sparsity, Sparsity::Dense))
        {
            // dense sessions share one pass over every row: the path one dense token takes
            let mut dense = PassState::new(Sparsity::dense());
            ffn_rows(model, &mut dense, s, l, n);
            count(sessions, dense.stats);
        } else {
            // each row through its own session's one-token FFN (its sparsity, its counters)
            for (t, &(i, _)) in rows.iter().enumerate() {
                let se = &mut *sessions[i];
                let (row, own) = (t * dim..(t + 1) * dim, &mut se.s);
                for buf in [&mut own.x, &mut own.xb, &mut own.ffn_out] {
                    buf.resize(dim, 0.0);
                }
                own.x.copy_from_slice(&s.x[row.clone()]);
                own.xb.copy_from_slice(&s.xb[row.clone()]);
                ffn_rows(model, &mut se.state, &mut se.s, l, 1);
                s.ffn_out[row].copy_from_slice(&se.s.ffn_out);
            }
        }
        Ok(())
    }

    fn route(&mut self, l: usize) -> Result<()> {
        route_rows(&self.model, &mut self.s, l, self.rows.len());
        self.count_routes(l);
        Ok(())
    }

    fn experts(&mut self, l: usize) -> Result<()> {
        self.experts_except(l, &[], false, |_, _, _| Ok(()))
    }

    fn post_norm(&mut self, l: usize, part: Part) -> Result<()> {
        let (c, lw, s) = (&self.model.config, &self.model.weights.layers[l], &mut self.s);
        let (out, w) = match part {
            Part::Attn => (&mut s.attn_out, &lw.attn_post_norm),
            Part::Ffn => (&mut s.ffn_out, &lw.ffn_post_norm),
        };
        let w = w
            .as_ref()
            .ok_or_else(|| Error::Model(format!("layer {l} has no {part:?} post-norm")))?;
        rmsnorm_in_place(out, w, c.norm_eps);
        Ok(())
    }

    fn residual(&mut self, _l: usize, part: Part) -> Result<()> {
        let s = &mut self.s;
        add_into(&mut s.x, if part == Part::Attn { &s.attn_out } else { &s.ffn_out });
        Ok(())
    }

    fn logits(&mut self, m: usize) -> Result<Vec<f32>> {
        let (c, w, s) = (&self.model.config, &self.model.weights, &mut self.s);
        let (n, dim) = (self.rows.len(), c.n_embd);
        if m == 0 {
            return Ok(Vec::new());
        }
        // final norm and classifier of the last m rows
        let x = &s.x[(n - m) * dim..n * dim];
        norm_rows(
            c.family,
            &mut s.xb[..m * dim],
            x,
            &w.output_norm,
            w.output_norm_b.as_deref(),
            c.norm_eps,
        );
        s.acts.set_for(&s.xb[..m * dim], m, dim, &[w.output]);
        let mut logits = vec![0.0f32; m * c.n_vocab];
        matmul(&w.output, &s.acts, &mut logits);
        if c.final_softcap != 0.0 {
            softcap(&mut logits, c.final_softcap);
        }
        Ok(logits)
    }
}
