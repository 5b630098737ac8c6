//! The CUDA device: a context and stream, the kernels of `kernels/powerinfer.cu` loaded from
//! their committed PTX, and one launch per kernel (cudarc does not check kernel argument types
//! or order, so each launch is written once, here, against the `.cu` signature).

use std::sync::Arc;

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaGraph, CudaSlice, CudaStream, DevicePtr, DevicePtrMut,
    LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::Ptx;

use super::{gpu_types, type_slot, AttnShape, DActs, DMat, Device, Elem, Result};
use crate::CudaError;

/// PTX compiled from `kernels/powerinfer.cu` by `scripts/gen_ptx.sh` (checked in CI).
pub const PTX: &str = include_str!("../../kernels/powerinfer.ptx");

impl From<cudarc::driver::DriverError> for CudaError {
    fn from(e: cudarc::driver::DriverError) -> Self {
        CudaError::Driver(e.to_string())
    }
}

struct Kernels {
    quantize_q8: CudaFunction,
    matvec: Vec<CudaFunction>,
    matvec3: Vec<CudaFunction>,
    ffn_hot: Vec<CudaFunction>,
    experts_hot: Vec<CudaFunction>,
    experts_down: Vec<CudaFunction>,
    down_partial: Vec<CudaFunction>,
    ffn_merge: CudaFunction,
    rmsnorm: CudaFunction,
    head_rmsnorm: CudaFunction,
    add_into: CudaFunction,
    rope: CudaFunction,
    kv_store: CudaFunction,
    attention: CudaFunction,
}

pub struct Cuda {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    name: String,
    total_memory: usize,
    k: Kernels,
}

/// A CUDA graph that a session owns.
pub struct Graph(CudaGraph);

// SAFETY: CUDA forbids concurrent use of one graph, not its use from another thread. A `Graph`
// belongs to one hybrid session's state and is only launched through `&mut` access to it.
unsafe impl Send for Graph {}

fn blocks(n: usize, per: usize) -> u32 {
    n.div_ceil(per).max(1) as u32
}

fn cfg(grid: (u32, u32), threads: u32) -> LaunchConfig {
    LaunchConfig { grid_dim: (grid.0, grid.1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 }
}

/// Rows per block of the warp-per-row kernels.
const WARPS: usize = 4;

impl Cuda {
    /// Opens device `ordinal` and loads the kernels. Never panics: a missing driver or device is
    /// an error (probed first, as cudarc panics on first use without libcuda).
    pub fn open(ordinal: usize) -> Result<Cuda> {
        let devices = crate::probe()?;
        let info = devices.get(ordinal).ok_or_else(|| {
            CudaError::NoDevice(format!("device {ordinal} requested, {} present", devices.len()))
        })?;
        let ctx = CudaContext::new(ordinal)?;
        // One stream of our own, not the legacy default stream, which cannot record graphs.
        // SAFETY: every buffer and launch of this device goes through this one stream, so
        // cudarc's events between streams (which a recording cannot wait on) are not needed.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream()?;
        let module = ctx.load_module(Ptx::from_src(PTX)).map_err(|e| {
            CudaError::Driver(format!("loading the kernels' PTX failed ({e}); the PTX needs a driver for CUDA 13.0 or newer"))
        })?;
        let f = |name: &str| {
            module.load_function(name).map_err(|e| CudaError::Driver(format!("kernel {name}: {e}")))
        };
        let per_type = |base: &str| {
            gpu_types()
                .map(|t| f(&format!("{base}_{}", t.name().to_lowercase())))
                .collect::<Result<Vec<_>>>()
        };
        let k = Kernels {
            quantize_q8: f("quantize_q8")?,
            matvec: per_type("matvec")?,
            matvec3: per_type("matvec3")?,
            ffn_hot: per_type("ffn_hot")?,
            experts_hot: per_type("experts_hot")?,
            experts_down: per_type("experts_down")?,
            down_partial: per_type("down_partial")?,
            ffn_merge: f("ffn_merge")?,
            rmsnorm: f("rmsnorm")?,
            head_rmsnorm: f("head_rmsnorm")?,
            add_into: f("add_into")?,
            rope: f("rope")?,
            kv_store: f("kv_store")?,
            attention: f("attention")?,
        };
        Ok(Cuda { ctx, stream, name: info.name.clone(), total_memory: info.total_memory, k })
    }

    /// Raw device address of an optional buffer (0 for none), for the kernels' nullable pointers.
    fn ptr<T>(&self, s: Option<&CudaSlice<T>>) -> u64 {
        match s {
            Some(s) => s.device_ptr(&self.stream).0,
            None => 0,
        }
    }
}

impl Device for Cuda {
    type Buf<T: Elem> = CudaSlice<T>;
    const KIND: &'static str = "cuda";

    fn name(&self) -> String {
        self.name.clone()
    }

    fn total_memory(&self) -> usize {
        self.total_memory
    }

    fn len<T: Elem>(buf: &CudaSlice<T>) -> usize {
        buf.len()
    }

    fn upload<T: Elem>(&self, host: &[T]) -> Result<CudaSlice<T>> {
        Ok(self.stream.clone_htod(host)?)
    }

    fn zeros<T: Elem>(&self, n: usize) -> Result<CudaSlice<T>> {
        Ok(self.stream.alloc_zeros::<T>(n.max(1))?)
    }

    fn write<T: Elem>(&self, src: &[T], dst: &mut CudaSlice<T>) -> Result<()> {
        let mut view = dst.slice_mut(..src.len());
        Ok(self.stream.memcpy_htod(src, &mut view)?)
    }

    fn read<T: Elem>(&self, src: &CudaSlice<T>, dst: &mut [T]) -> Result<()> {
        let view = src.slice(..dst.len());
        Ok(self.stream.memcpy_dtoh(&view, dst)?)
    }

    fn copy<T: Elem>(
        &self,
        src: &CudaSlice<T>,
        src_start: usize,
        dst: &mut CudaSlice<T>,
        dst_start: usize,
        n: usize,
    ) -> Result<()> {
        let from = src.slice(src_start..src_start + n);
        let mut to = dst.slice_mut(dst_start..dst_start + n);
        Ok(self.stream.memcpy_dtod(&from, &mut to)?)
    }

    fn clear<T: Elem>(&self, dst: &mut CudaSlice<T>) -> Result<()> {
        Ok(self.stream.memset_zeros(dst)?)
    }

    fn synchronize(&self) -> Result<()> {
        Ok(self.stream.synchronize()?)
    }

    type Graph = Graph;

    fn begin_capture(&self) -> Result<bool> {
        // thread-local: another thread's CUDA calls (another engine's) are neither recorded
        // nor refused while this one records
        self.stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
        Ok(true)
    }

    fn end_capture(&self) -> Result<Graph> {
        let graph = self.stream.end_capture(CUgraphInstantiate_flags(0))?;
        Ok(Graph(
            graph
                .ok_or_else(|| CudaError::Driver("the recorded kernel sequence is empty".into()))?,
        ))
    }

    fn launch_graph(&self, graph: &Graph) -> Result<()> {
        Ok(graph.0.launch()?)
    }

    fn quantize_q8(
        &self,
        x: &CudaSlice<f32>,
        q8: &mut CudaSlice<u8>,
        n_blocks: usize,
    ) -> Result<()> {
        let n = n_blocks as i32;
        let mut b = self.stream.launch_builder(&self.k.quantize_q8);
        b.arg(x).arg(q8).arg(&n);
        // SAFETY: matches `quantize_q8`; both buffers hold n_blocks blocks (checked by `Gpu`).
        unsafe { b.launch(cfg((blocks(n_blocks, WARPS), 1), 32 * WARPS as u32)) }?;
        Ok(())
    }

    fn matvec(
        &self,
        w: &DMat<Self>,
        x: &DActs<Self>,
        bias: Option<&CudaSlice<f32>>,
        y: &mut CudaSlice<f32>,
        at: usize,
        relu: bool,
        m: usize,
    ) -> Result<()> {
        let f = &self.k.matvec[type_slot(w.dtype)?];
        let (row_bytes, rows, cols, relu, bias) =
            (w.row_bytes as u64, w.rows as i32, w.cols as i32, relu as i32, self.ptr(bias));
        let y_at = y.device_ptr_mut(&self.stream).0 + (at * std::mem::size_of::<f32>()) as u64;
        let mut b = self.stream.launch_builder(f);
        b.arg(&w.data)
            .arg(&row_bytes)
            .arg(&x.f32s)
            .arg(&x.q8)
            .arg(&bias)
            .arg(&y_at)
            .arg(&rows)
            .arg(&cols)
            .arg(&relu);
        // SAFETY: argument types and order match `matvec_*` in powerinfer.cu; x is checked by
        // `Gpu`, y (from `at`, m * rows) and bias are sized by the callers (checked by `Gpu`).
        unsafe { b.launch(cfg((blocks(w.rows, WARPS), m as u32), 32 * WARPS as u32)) }?;
        Ok(())
    }

    fn matvec3(
        &self,
        w: [&DMat<Self>; 3],
        x: &DActs<Self>,
        bias: [Option<&CudaSlice<f32>>; 3],
        y: [&mut CudaSlice<f32>; 3],
        m: usize,
    ) -> Result<()> {
        let f = &self.k.matvec3[type_slot(w[0].dtype)?];
        let (row_bytes, cols) = (w[0].row_bytes as u64, w[0].cols as i32);
        let rows = w.map(|m| m.rows as i32);
        let b = bias.map(|b| self.ptr(b));
        let [y0, y1, y2] = y;
        let mut l = self.stream.launch_builder(f);
        l.arg(&w[0].data).arg(&w[1].data).arg(&w[2].data).arg(&row_bytes).arg(&x.f32s).arg(&x.q8);
        l.arg(&b[0])
            .arg(&b[1])
            .arg(&b[2])
            .arg(y0)
            .arg(y1)
            .arg(y2)
            .arg(&rows[0])
            .arg(&rows[1])
            .arg(&rows[2])
            .arg(&cols);
        // SAFETY: matches `matvec3_*`; the three matrices share type and width and each y and
        // bias holds its matrix's rows (checked by `Gpu`).
        unsafe {
            l.launch(cfg(
                (blocks(w.iter().map(|w| w.rows).sum(), WARPS), m as u32),
                32 * WARPS as u32,
            ))
        }?;
        Ok(())
    }

    fn ffn_hot(
        &self,
        gate: Option<&DMat<Self>>,
        up: &DMat<Self>,
        bucket: &CudaSlice<i32>,
        x: &DActs<Self>,
        bias: [Option<&CudaSlice<f32>>; 2],
        pred_logits: Option<(&CudaSlice<f32>, usize)>,
        threshold: f32,
        selected: Option<(&mut CudaSlice<u32>, usize)>,
        act: i32,
        h: &mut CudaSlice<f32>,
        m: usize,
    ) -> Result<()> {
        let f = &self.k.ffn_hot[type_slot(up.dtype)?];
        let gate_ptr = gate.map_or(0, |g| g.data.device_ptr(&self.stream).0);
        let (row_bytes, n_hot, cols) = (up.row_bytes as u64, up.rows as i32, up.cols as i32);
        let (gate_bias, up_bias) = (self.ptr(bias[0]), self.ptr(bias[1]));
        let pred = self.ptr(pred_logits.map(|(p, _)| p));
        let pred_stride = pred_logits.map_or(0, |(_, stride)| stride as i32);
        let selected = match selected {
            Some((counts, slot)) => {
                counts.device_ptr_mut(&self.stream).0 + (slot * std::mem::size_of::<u32>()) as u64
            }
            None => 0,
        };
        let mut b = self.stream.launch_builder(f);
        b.arg(&gate_ptr)
            .arg(&up.data)
            .arg(&row_bytes)
            .arg(bucket)
            .arg(&x.f32s)
            .arg(&x.q8)
            .arg(&gate_bias)
            .arg(&up_bias)
            .arg(&pred)
            .arg(&threshold);
        b.arg(&selected).arg(h).arg(&n_hot).arg(&cols).arg(&act).arg(&pred_stride);
        // SAFETY: matches `ffn_hot_*`; bucket holds n_hot entries and h m * n_hot, the biases
        // n_ff and pred_logits (m - 1) * pred_stride + n_ff; `selected` is null or one u32
        // inside `counts` (checked by `Gpu`).
        unsafe { b.launch(cfg((blocks(up.rows, WARPS), m as u32), 32 * WARPS as u32)) }?;
        Ok(())
    }

    fn experts_hot(
        &self,
        gates: &[&DMat<Self>],
        ups: &[&DMat<Self>],
        x: &DActs<Self>,
        act: i32,
        h: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let up = ups[0];
        let f = &self.k.experts_hot[type_slot(up.dtype)?];
        // the slots' gate and up addresses (the kernel reads the table's first 2 * n_slots)
        let table: Vec<u64> =
            gates.iter().chain(ups).map(|m| m.data.device_ptr(&self.stream).0).collect();
        let table = self.stream.clone_htod(&table)?;
        let (n_slots, row_bytes) = (ups.len() as i32, up.row_bytes as u64);
        let (rows, cols) = (up.rows as i32, up.cols as i32);
        let mut b = self.stream.launch_builder(f);
        b.arg(&table).arg(&n_slots).arg(&row_bytes).arg(&x.f32s).arg(&x.q8).arg(h);
        b.arg(&rows).arg(&cols).arg(&act);
        // SAFETY: matches `experts_hot_*`; every slot's matrices share up's type and shape and
        // h holds n_slots * rows floats (checked by `Gpu`); the table lives until the launch
        // has run (its memory is freed in stream order).
        unsafe { b.launch(cfg((blocks(up.rows, WARPS), ups.len() as u32), 32 * WARPS as u32)) }?;
        Ok(())
    }

    fn experts_down(
        &self,
        downs: &[&DMat<Self>],
        h: &DActs<Self>,
        y: &mut CudaSlice<f32>,
        at: &[usize],
    ) -> Result<()> {
        let down = downs[0];
        let f = &self.k.experts_down[type_slot(down.dtype)?];
        // the kernel reads the slots' down addresses at 2 * n_slots and their outputs' first
        // elements at 3 * n_slots
        let n = downs.len();
        let mut table = vec![0u64; 2 * n];
        table.extend(downs.iter().map(|m| m.data.device_ptr(&self.stream).0));
        table.extend(at.iter().map(|&a| a as u64));
        let table = self.stream.clone_htod(&table)?;
        let (n_slots, row_bytes) = (n as i32, down.row_bytes as u64);
        let (rows, cols) = (down.rows as i32, down.cols as i32);
        let mut b = self.stream.launch_builder(f);
        b.arg(&table).arg(&n_slots).arg(&row_bytes).arg(&h.f32s).arg(&h.q8).arg(y);
        b.arg(&rows).arg(&cols);
        // SAFETY: matches `experts_down_*`; every slot's matrix shares down's type and shape, h
        // holds n_slots rows of cols and y at[s] + rows floats for each slot (checked by `Gpu`).
        unsafe { b.launch(cfg((blocks(down.rows, WARPS), n as u32), 32 * WARPS as u32)) }?;
        Ok(())
    }

    fn down_partial(
        &self,
        down_t: &DMat<Self>,
        h: &CudaSlice<f32>,
        partial: &mut CudaSlice<f32>,
        rows_per_chunk: usize,
        m: usize,
    ) -> Result<()> {
        let f = &self.k.down_partial[type_slot(down_t.dtype)?];
        let n_chunks = down_t.rows.div_ceil(rows_per_chunk);
        let (row_bytes, n_hot, cols, per) = (
            down_t.row_bytes as u64,
            down_t.rows as i32,
            down_t.cols as i32,
            rows_per_chunk as i32,
        );
        let mut b = self.stream.launch_builder(f);
        b.arg(&down_t.data).arg(&row_bytes).arg(h).arg(&n_hot).arg(&cols).arg(&per).arg(partial);
        // SAFETY: matches `down_partial_*`; h holds m * n_hot floats, partial m * n_chunks *
        // cols (checked by `Gpu`).
        let grid = (blocks(down_t.cols, 256), n_chunks as u32, m as u32);
        unsafe {
            b.launch(LaunchConfig { grid_dim: grid, block_dim: (256, 1, 1), shared_mem_bytes: 0 })
        }?;
        Ok(())
    }

    fn ffn_merge(
        &self,
        x: &mut CudaSlice<f32>,
        partial: &CudaSlice<f32>,
        n_chunks: usize,
        cpu_part: Option<&CudaSlice<f32>>,
        bias: Option<&CudaSlice<f32>>,
        cols: usize,
        m: usize,
    ) -> Result<()> {
        let (n_chunks_i, cols_i, cpu, bias) =
            (n_chunks as i32, cols as i32, self.ptr(cpu_part), self.ptr(bias));
        let mut b = self.stream.launch_builder(&self.k.ffn_merge);
        b.arg(x).arg(partial).arg(&n_chunks_i).arg(&cpu).arg(&bias).arg(&cols_i);
        // SAFETY: matches `ffn_merge`; x and cpu_part hold m * cols floats, partial m *
        // n_chunks * cols (checked by `Gpu`).
        unsafe { b.launch(cfg((blocks(cols, 256), m as u32), 256)) }?;
        Ok(())
    }

    fn rmsnorm(
        &self,
        x: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        q8: Option<&mut CudaSlice<u8>>,
        n: usize,
        eps: f32,
        m: usize,
    ) -> Result<()> {
        let n_i = n as i32;
        let q8 = q8.map_or(0, |q| q.device_ptr_mut(&self.stream).0);
        let no_y = 0u64;
        let mut b = self.stream.launch_builder(&self.k.rmsnorm);
        // x is only read without y
        b.arg(x).arg(&no_y).arg(w).arg(out).arg(&q8).arg(&n_i).arg(&eps);
        // SAFETY: matches `rmsnorm`; one block per row.
        unsafe { b.launch(cfg((m as u32, 1), 1024)) }?;
        Ok(())
    }

    fn add_rmsnorm(
        &self,
        x: &mut CudaSlice<f32>,
        y: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        q8: Option<&mut CudaSlice<u8>>,
        n: usize,
        eps: f32,
        m: usize,
    ) -> Result<()> {
        let n_i = n as i32;
        let q8 = q8.map_or(0, |q| q.device_ptr_mut(&self.stream).0);
        let mut b = self.stream.launch_builder(&self.k.rmsnorm);
        b.arg(x).arg(y).arg(w).arg(out).arg(&q8).arg(&n_i).arg(&eps);
        // SAFETY: matches `rmsnorm`; x, y and out hold m rows of n, q8 m * n / 32 blocks (checked by `Gpu`).
        unsafe { b.launch(cfg((m as u32, 1), 1024)) }?;
        Ok(())
    }

    fn head_rmsnorm(
        &self,
        x: &mut CudaSlice<f32>,
        w: &CudaSlice<f32>,
        n_heads: usize,
        head_dim: usize,
        eps: f32,
    ) -> Result<()> {
        let (nh, hd) = (n_heads as i32, head_dim as i32);
        let mut b = self.stream.launch_builder(&self.k.head_rmsnorm);
        b.arg(x).arg(w).arg(&nh).arg(&hd).arg(&eps);
        // SAFETY: matches `head_rmsnorm`; x holds n_heads * head_dim floats, w head_dim (checked by `Gpu`).
        unsafe { b.launch(cfg((blocks(n_heads, WARPS), 1), 32 * WARPS as u32)) }?;
        Ok(())
    }

    fn add_into(
        &self,
        x: &mut CudaSlice<f32>,
        y: &CudaSlice<f32>,
        bias: Option<&CudaSlice<f32>>,
        n: usize,
    ) -> Result<()> {
        let (n_i, bias) = (n as i32, self.ptr(bias));
        let mut b = self.stream.launch_builder(&self.k.add_into);
        b.arg(x).arg(y).arg(&bias).arg(&n_i);
        // SAFETY: matches `add_into`.
        unsafe { b.launch(cfg((blocks(n, 256), 1), 256)) }?;
        Ok(())
    }

    fn rope(
        &self,
        q: &mut CudaSlice<f32>,
        k: &mut CudaSlice<f32>,
        cos: &CudaSlice<f32>,
        sin: &CudaSlice<f32>,
        n_head: usize,
        n_head_kv: usize,
        head_dim: usize,
        rope_dim: usize,
        neox: bool,
        m: usize,
    ) -> Result<()> {
        let (nh, nkv, hd, rd, nx) =
            (n_head as i32, n_head_kv as i32, head_dim as i32, rope_dim as i32, neox as i32);
        let mut b = self.stream.launch_builder(&self.k.rope);
        b.arg(q).arg(k).arg(cos).arg(sin).arg(&nh).arg(&nkv).arg(&hd).arg(&rd).arg(&nx);
        // SAFETY: matches `rope`; sizes checked by `Gpu`.
        unsafe {
            b.launch(cfg((blocks((n_head + n_head_kv) * rope_dim / 2, 256), m as u32), 256))
        }?;
        Ok(())
    }

    fn kv_store(
        &self,
        k: &CudaSlice<f32>,
        v: &CudaSlice<f32>,
        k_cache: &mut CudaSlice<u8>,
        v_cache: &mut CudaSlice<u8>,
        pos: &CudaSlice<i32>,
        kv_dim: usize,
        f16: bool,
        m: usize,
    ) -> Result<()> {
        let (d, h) = (kv_dim as i32, f16 as i32);
        let mut b = self.stream.launch_builder(&self.k.kv_store);
        b.arg(k).arg(v).arg(k_cache).arg(v_cache).arg(pos).arg(&d).arg(&h);
        // SAFETY: matches `kv_store`; the cache bound is checked by `Gpu`.
        unsafe { b.launch(cfg((blocks(kv_dim, 256), m as u32), 256)) }?;
        Ok(())
    }

    fn attention(
        &self,
        q: &CudaSlice<f32>,
        k_cache: &CudaSlice<u8>,
        v_cache: &CudaSlice<u8>,
        scores: &mut CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        pos: &CudaSlice<i32>,
        at: &AttnShape,
        sinks: Option<&CudaSlice<f32>>,
        f16: bool,
        m: usize,
    ) -> Result<()> {
        let sinks = self.ptr(sinks);
        let (ctx_i, nh, nkv, hd, h) = (
            at.n_ctx as i32,
            at.n_head as i32,
            at.n_head_kv as i32,
            at.head_dim as i32,
            f16 as i32,
        );
        let window = i32::try_from(at.window).unwrap_or(i32::MAX);
        let mut b = self.stream.launch_builder(&self.k.attention);
        b.arg(q)
            .arg(k_cache)
            .arg(v_cache)
            .arg(scores)
            .arg(out)
            .arg(pos)
            .arg(&ctx_i)
            .arg(&nh)
            .arg(&nkv)
            .arg(&hd);
        b.arg(&at.scale).arg(&at.softcap).arg(&window).arg(&h).arg(&sinks);
        // SAFETY: matches `attention`; scores holds n_head * n_ctx floats, sinks (if not null)
        // n_head, and pos[0] < n_ctx (checked by `Gpu`).
        unsafe { b.launch(cfg((at.n_head as u32, m as u32), 256)) }?;
        Ok(())
    }
}
