//! The emulated device: every buffer a `Vec` in host memory, every kernel its scalar twin
//! (`twin.rs`), run at once in the order the executor queues them. It reads what the kernels
//! read (packed hot rows through `bucket`, int8 blocks from `q8`, f16 or f32 cache bytes), so a
//! host-side mistake in the executor (a missing upload, a stale quantization, a wrong bucket)
//! shows here as it would on a GPU. A correctness tool: the twins accumulate in f64, one row at
//! a time, and are slow.

use powerinfer_core::matmul::QMatrix;
use powerinfer_core::quant::{f16_to_f32, f32_to_f16, QK};
use powerinfer_core::session::Sparsity;

use super::{act_of_code, AttnShape, DActs, DMat, Device, Elem, Result, Q8_BLOCK_BYTES};
use crate::twin;
use crate::CudaError;

/// Memory the emulated device reports (an 80 GB data-center GPU's), so that placements planned
/// without a budget look like those on one. Nothing enforces it.
pub const EMULATED_MEMORY: usize = 80 << 30;

#[derive(Debug, Default)]
pub struct Emulated;

fn fault(what: String) -> CudaError {
    CudaError::Driver(format!("emulated device: {what}"))
}

/// A device matrix as the host sees it.
fn view(m: &DMat<Emulated>) -> QMatrix<'_> {
    QMatrix { dtype: m.dtype, rows: m.rows, cols: m.cols, data: &m.data[..m.rows * m.row_bytes] }
}

/// What a kernel reading a matrix of `cols` inputs of `m`'s type sees of row t of `x`.
fn input(m: &DMat<Emulated>, x: &DActs<Emulated>, t: usize) -> Vec<f32> {
    if m.dtype.is_quantized() {
        let row = m.cols / QK * Q8_BLOCK_BYTES;
        twin::q8_values(&x.q8[t * row..(t + 1) * row])
    } else {
        x.f32s[t * m.cols..(t + 1) * m.cols].to_vec()
    }
}

/// The values of a KV cache's first `n` elements, stored as f16 or f32 bytes.
fn cache_values(cache: &[u8], n: usize, f16: bool) -> Vec<f32> {
    if f16 {
        cache[..2 * n]
            .chunks_exact(2)
            .map(|b| f16_to_f32(u16::from_le_bytes([b[0], b[1]])))
            .collect()
    } else {
        cache[..4 * n]
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()
    }
}

fn store(cache: &mut [u8], at: usize, v: f32, f16: bool) {
    if f16 {
        cache[2 * at..2 * at + 2].copy_from_slice(&f32_to_f16(v).to_le_bytes());
    } else {
        cache[4 * at..4 * at + 4].copy_from_slice(&v.to_le_bytes());
    }
}

impl Device for Emulated {
    type Buf<T: Elem> = Vec<T>;
    const KIND: &'static str = "emulated";

    fn name(&self) -> String {
        "emulated device (host memory, kernel twins)".into()
    }

    fn total_memory(&self) -> usize {
        EMULATED_MEMORY
    }

    fn len<T: Elem>(buf: &Vec<T>) -> usize {
        buf.len()
    }

    fn upload<T: Elem>(&self, host: &[T]) -> Result<Vec<T>> {
        Ok(host.to_vec())
    }

    fn zeros<T: Elem>(&self, n: usize) -> Result<Vec<T>> {
        Ok(vec![T::default(); n.max(1)])
    }

    fn write<T: Elem>(&self, src: &[T], dst: &mut Vec<T>) -> Result<()> {
        dst[..src.len()].copy_from_slice(src);
        Ok(())
    }

    fn read<T: Elem>(&self, src: &Vec<T>, dst: &mut [T]) -> Result<()> {
        let n = dst.len();
        dst.copy_from_slice(&src[..n]);
        Ok(())
    }

    fn copy<T: Elem>(
        &self,
        src: &Vec<T>,
        src_start: usize,
        dst: &mut Vec<T>,
        dst_start: usize,
        n: usize,
    ) -> Result<()> {
        dst[dst_start..dst_start + n].copy_from_slice(&src[src_start..src_start + n]);
        Ok(())
    }

    fn clear<T: Elem>(&self, dst: &mut Vec<T>) -> Result<()> {
        dst.iter_mut().for_each(|v| *v = T::default());
        Ok(())
    }

    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    type Graph = ();

    /// The twins run as they are called: nothing to record.
    fn begin_capture(&self) -> Result<bool> {
        Ok(false)
    }

    fn end_capture(&self) -> Result<()> {
        Err(CudaError::Unsupported("the emulated device records no kernel sequences".into()))
    }

    fn launch_graph(&self, _: &()) -> Result<()> {
        Err(CudaError::Unsupported("the emulated device records no kernel sequences".into()))
    }

    fn quantize_q8(&self, x: &Vec<f32>, q8: &mut Vec<u8>, n_blocks: usize) -> Result<()> {
        q8[..n_blocks * Q8_BLOCK_BYTES].copy_from_slice(&twin::q8_bytes(&x[..n_blocks * QK]));
        Ok(())
    }

    fn matvec(
        &self,
        w: &DMat<Self>,
        x: &DActs<Self>,
        bias: Option<&Vec<f32>>,
        y: &mut Vec<f32>,
        at: usize,
        relu: bool,
        m: usize,
    ) -> Result<()> {
        for t in 0..m {
            let out =
                twin::matvec_seen(&view(w), &input(w, x, t), bias.map(|b| &b[..w.rows]), relu);
            y[at + t * w.rows..at + (t + 1) * w.rows].copy_from_slice(&out);
        }
        Ok(())
    }

    fn matvec3(
        &self,
        w: [&DMat<Self>; 3],
        x: &DActs<Self>,
        bias: [Option<&Vec<f32>>; 3],
        y: [&mut Vec<f32>; 3],
        m: usize,
    ) -> Result<()> {
        for ((w, b), y) in w.into_iter().zip(bias).zip(y) {
            self.matvec(w, x, b, y, 0, false, m)?;
        }
        Ok(())
    }

    fn ffn_hot(
        &self,
        gate: Option<&DMat<Self>>,
        up: &DMat<Self>,
        bucket: &Vec<i32>,
        x: &DActs<Self>,
        bias: [Option<&Vec<f32>>; 2],
        pred_logits: Option<(&Vec<f32>, usize)>,
        threshold: f32,
        mut selected: Option<(&mut Vec<u32>, usize)>,
        act: i32,
        h: &mut Vec<f32>,
        m: usize,
    ) -> Result<()> {
        let act = act_of_code(act).ok_or_else(|| fault(format!("activation code {act}")))?;
        // row t's logits: pred[t * stride..][..n_ids]
        let pred_len =
            pred_logits.map(|(p, stride)| p.len().saturating_sub(m.saturating_sub(1) * stride));
        let n_ids =
            bias.iter().flatten().map(|b| b.len()).chain(pred_len).min().unwrap_or(usize::MAX);
        let ids: Vec<u32> = bucket[..up.rows]
            .iter()
            .map(|&j| {
                if j >= 0 && (j as usize) < n_ids {
                    Ok(j as u32)
                } else {
                    Err(fault(format!("hot neuron id {j} out of range")))
                }
            })
            .collect::<Result<_>>()?;
        for t in 0..m {
            let pred = pred_logits.map(|(p, stride)| (&p[t * stride..], threshold));
            if let Some((counts, slot)) = &mut selected {
                let n = match pred {
                    Some((p, cut)) => ids
                        .iter()
                        .filter(|&&j| Sparsity::predictor_selects(p[j as usize], cut))
                        .count(),
                    None => ids.len(),
                };
                counts[*slot] += n as u32;
            }
            let out = twin::ffn_hot_seen(
                gate.map(view).as_ref(),
                &view(up),
                &ids,
                &input(up, x, t),
                bias.map(|b| b.map(|b| &b[..])),
                pred,
                act,
            );
            h[t * up.rows..(t + 1) * up.rows].copy_from_slice(&out);
        }
        Ok(())
    }

    fn experts_hot(
        &self,
        gates: &[&DMat<Self>],
        ups: &[&DMat<Self>],
        x: &DActs<Self>,
        act: i32,
        h: &mut Vec<f32>,
    ) -> Result<()> {
        let act = act_of_code(act).ok_or_else(|| fault(format!("activation code {act}")))?;
        for (s, (gate, up)) in gates.iter().zip(ups).enumerate() {
            let ids: Vec<u32> = (0..up.rows as u32).collect();
            let out = twin::ffn_hot_seen(
                Some(&view(gate)),
                &view(up),
                &ids,
                &input(up, x, 0),
                [None, None],
                None,
                act,
            );
            h[s * up.rows..(s + 1) * up.rows].copy_from_slice(&out);
        }
        Ok(())
    }

    fn experts_down(
        &self,
        downs: &[&DMat<Self>],
        h: &DActs<Self>,
        y: &mut Vec<f32>,
        at: &[usize],
    ) -> Result<()> {
        for (s, (down, &at)) in downs.iter().zip(at).enumerate() {
            let out = twin::matvec_seen(&view(down), &input(down, h, s), None, false);
            y[at..at + down.rows].copy_from_slice(&out);
        }
        Ok(())
    }

    fn down_partial(
        &self,
        down_t: &DMat<Self>,
        h: &Vec<f32>,
        partial: &mut Vec<f32>,
        rows_per_chunk: usize,
        m: usize,
    ) -> Result<()> {
        let (cols, n_hot) = (down_t.cols, down_t.rows);
        let n_chunks = n_hot.div_ceil(rows_per_chunk);
        for t in 0..m {
            let (h, part) = (&h[t * n_hot..], &mut partial[t * n_chunks * cols..]);
            for (k, i0) in (0..n_hot).step_by(rows_per_chunk).enumerate() {
                let i1 = n_hot.min(i0 + rows_per_chunk);
                let rows = QMatrix {
                    dtype: down_t.dtype,
                    rows: i1 - i0,
                    cols,
                    data: &down_t.data[i0 * down_t.row_bytes..i1 * down_t.row_bytes],
                };
                part[k * cols..(k + 1) * cols].copy_from_slice(&twin::down(&rows, &h[i0..i1]));
            }
        }
        Ok(())
    }

    fn ffn_merge(
        &self,
        x: &mut Vec<f32>,
        partial: &Vec<f32>,
        n_chunks: usize,
        cpu_part: Option<&Vec<f32>>,
        bias: Option<&Vec<f32>>,
        cols: usize,
        m: usize,
    ) -> Result<()> {
        for t in 0..m {
            let part = &partial[t * n_chunks * cols..];
            for (c, xc) in x[t * cols..(t + 1) * cols].iter_mut().enumerate() {
                // the kernel's order of additions
                let mut v: f32 = (0..n_chunks).map(|k| part[k * cols + c]).sum();
                if let Some(p) = cpu_part {
                    v += p[t * cols + c];
                }
                if let Some(b) = bias {
                    v += b[c];
                }
                *xc += v;
            }
        }
        Ok(())
    }

    fn rmsnorm(
        &self,
        x: &Vec<f32>,
        w: &Vec<f32>,
        out: &mut Vec<f32>,
        q8: Option<&mut Vec<u8>>,
        n: usize,
        eps: f32,
        m: usize,
    ) -> Result<()> {
        for t in 0..m {
            out[t * n..(t + 1) * n].copy_from_slice(&twin::rmsnorm(
                &x[t * n..(t + 1) * n],
                &w[..n],
                eps,
            ));
        }
        if let Some(q8) = q8 {
            self.quantize_q8(out, q8, m * n / QK)?;
        }
        Ok(())
    }

    fn add_rmsnorm(
        &self,
        x: &mut Vec<f32>,
        y: &Vec<f32>,
        w: &Vec<f32>,
        out: &mut Vec<f32>,
        q8: Option<&mut Vec<u8>>,
        n: usize,
        eps: f32,
        m: usize,
    ) -> Result<()> {
        self.add_into(x, y, None, m * n)?;
        self.rmsnorm(x, w, out, q8, n, eps, m)
    }

    fn head_rmsnorm(
        &self,
        x: &mut Vec<f32>,
        w: &Vec<f32>,
        n_heads: usize,
        head_dim: usize,
        eps: f32,
    ) -> Result<()> {
        twin::head_rmsnorm(&mut x[..n_heads * head_dim], &w[..head_dim], head_dim, eps);
        Ok(())
    }

    fn add_into(
        &self,
        x: &mut Vec<f32>,
        y: &Vec<f32>,
        bias: Option<&Vec<f32>>,
        n: usize,
    ) -> Result<()> {
        for i in 0..n {
            x[i] += y[i] + bias.map_or(0.0, |b| b[i]);
        }
        Ok(())
    }

    fn rope(
        &self,
        q: &mut Vec<f32>,
        k: &mut Vec<f32>,
        cos: &Vec<f32>,
        sin: &Vec<f32>,
        n_head: usize,
        n_head_kv: usize,
        head_dim: usize,
        rope_dim: usize,
        neox: bool,
        m: usize,
    ) -> Result<()> {
        let (half, qd, kd) = (rope_dim / 2, n_head * head_dim, n_head_kv * head_dim);
        for t in 0..m {
            let (c, s) = (&cos[t * half..(t + 1) * half], &sin[t * half..(t + 1) * half]);
            twin::rope(&mut q[t * qd..(t + 1) * qd], c, s, head_dim, rope_dim, neox);
            twin::rope(&mut k[t * kd..(t + 1) * kd], c, s, head_dim, rope_dim, neox);
        }
        Ok(())
    }

    fn kv_store(
        &self,
        k: &Vec<f32>,
        v: &Vec<f32>,
        k_cache: &mut Vec<u8>,
        v_cache: &mut Vec<u8>,
        pos: &Vec<i32>,
        kv_dim: usize,
        f16: bool,
        m: usize,
    ) -> Result<()> {
        let pos = pos[0] as usize;
        for i in 0..m * kv_dim {
            store(k_cache, pos * kv_dim + i, k[i], f16);
            store(v_cache, pos * kv_dim + i, v[i], f16);
        }
        Ok(())
    }

    fn attention(
        &self,
        q: &Vec<f32>,
        k_cache: &Vec<u8>,
        v_cache: &Vec<u8>,
        _scores: &mut Vec<f32>,
        out: &mut Vec<f32>,
        pos: &Vec<i32>,
        at: &AttnShape,
        sinks: Option<&Vec<f32>>,
        f16: bool,
        m: usize,
    ) -> Result<()> {
        let q_dim = at.n_head * at.head_dim;
        let n = (pos[0] as usize + m) * at.n_head_kv * at.head_dim;
        let (k, v) = (cache_values(k_cache, n, f16), cache_values(v_cache, n, f16));
        for t in 0..m {
            let o = twin::attention(
                &q[t * q_dim..(t + 1) * q_dim],
                &k,
                &v,
                pos[0] as usize + t + 1,
                at,
                sinks.map(|s| &s[..]),
            );
            out[t * q_dim..(t + 1) * q_dim].copy_from_slice(&o);
        }
        Ok(())
    }
}
