//! GGUF reader: memory-maps a file and parses its header (metadata and tensor infos) without
//! copying tensor data. Accepts GGUF v2/v3 and PowerInfer's `PWRI` magic (same layout).
//!
//! Every length read from the file is checked against the bytes that are actually there before it
//! is used, so a malformed or truncated header gives `Error::Format`, never a panic or a huge
//! allocation. This module knows nothing about models.

use std::collections::HashMap;
use std::fs::File;
use std::path::Path;

use memmap2::Mmap;

use crate::error::{Error, Result};
use crate::quant::DType;

/// Longest string we accept in a header (a chat template is a few KiB; 16 MiB is generous).
const MAX_STRING_LEN: u64 = 16 << 20;
/// Most elements in one metadata array (vocabularies reach a few 100k).
const MAX_ARRAY_LEN: u64 = 1 << 26;
const MAX_DIMS: u32 = 4;
const MAX_TENSORS: u64 = 1 << 20;
const MAX_KV: u64 = 1 << 20;
const DEFAULT_ALIGNMENT: u64 = 32;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Magic {
    /// `GGUF`: an ordinary (dense) model file.
    Gguf,
    /// `PWRI`: PowerInfer's sparse model file, otherwise laid out as GGUF.
    Powerinfer,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    Str(String),
    Array(Vec<Value>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl Value {
    /// Any integer type as u64 (negative values are rejected).
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v as u64),
            Value::U16(v) => Some(v as u64),
            Value::U32(v) => Some(v as u64),
            Value::U64(v) => Some(v),
            Value::I8(v) if v >= 0 => Some(v as u64),
            Value::I16(v) if v >= 0 => Some(v as u64),
            Value::I32(v) if v >= 0 => Some(v as u64),
            Value::I64(v) if v >= 0 => Some(v as u64),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v as f64),
            Value::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }
}

/// One tensor's header entry. `dims` are in ggml order (innermost first); `shape()` is row-major.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    pub dims: Vec<u64>,
    /// Raw ggml type id; `dtype` is `Some` when the engine knows the type's block layout.
    pub type_id: u32,
    pub dtype: Option<DType>,
    /// Offset of the data relative to the start of the tensor data section.
    pub offset: u64,
    /// Size in bytes (0 when the type is unknown to us and the size cannot be computed).
    pub n_bytes: u64,
}

impl TensorInfo {
    /// Row-major shape (outermost first), e.g. `[rows, cols]` for a matrix.
    pub fn shape(&self) -> Vec<u64> {
        self.dims.iter().rev().copied().collect()
    }

    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }

    pub fn type_name(&self) -> String {
        crate::quant::type_name(self.type_id)
    }
}

/// A parsed GGUF header over a memory-mapped file.
pub struct GgufFile {
    mmap: Mmap, // the file's map, or its copy in anonymous memory (`read_into_memory`)
    in_memory: bool,
    /// The file's map, kept beside the copy for the tensors `read_into_memory` left out, which
    /// are read from it (their bytes in the copy are never written, so take no memory).
    file_map: Option<Mmap>,
    /// Per tensor (as `tensors`), whether it is read from `file_map`.
    left_in_file: Vec<bool>,
    pub magic: Magic,
    pub version: u32,
    pub metadata: Vec<(String, Value)>,
    index: HashMap<String, usize>,
    pub tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
    pub alignment: u64,
    /// Absolute file offset of the tensor data section.
    pub data_offset: u64,
}

impl GgufFile {
    /// Copies the mapped file into anonymous memory on huge pages (`weight_buffer`), so that
    /// the weights are read from there instead of from the page cache. Measured on a 2-core
    /// virtual machine: every decode 1.05-1.7x faster than from the file's map, itself advised
    /// for huge pages (`advise_huge_pages`), the more the larger the model; what memory backs
    /// the page cache is the kernel's choice, not ours. Costs the file's size in memory that is
    /// no longer shared with other processes, and the copy's time at load.
    ///
    /// The tensors `leave(t)` names stay in the file's map: the model reads them through a
    /// copy of its own (`Model`'s interleaved experts), so copying them too would hold their
    /// bytes twice.
    pub fn read_into_memory(
        &mut self,
        path: &Path,
        leave: impl Fn(&TensorInfo) -> bool,
    ) -> Result<()> {
        let io = |source| Error::Io { path: path.to_path_buf(), source };
        let mut copy = weight_buffer(self.mmap.len()).map_err(io)?;
        let left: Vec<bool> = self.tensors.iter().map(&leave).collect();
        // the byte ranges left out, in file order; everything between them is copied
        let mut skip: Vec<(usize, usize)> = (self.tensors.iter().zip(&left))
            .filter(|(_, &l)| l)
            .map(|(t, _)| {
                let start = (self.data_offset + t.offset) as usize;
                (start, start + t.n_bytes as usize)
            })
            .collect();
        skip.sort_unstable();
        let mut at = 0;
        for (start, end) in skip.into_iter().chain([(self.mmap.len(), self.mmap.len())]) {
            if start > at {
                copy[at..start].copy_from_slice(&self.mmap[at..start]);
            }
            at = at.max(end);
        }
        let copy = copy.make_read_only().map_err(io)?;
        let file_map = std::mem::replace(&mut self.mmap, copy);
        if left.iter().any(|&l| l) {
            self.file_map = Some(file_map);
            self.left_in_file = left;
        }
        self.in_memory = true;
        Ok(())
    }

    /// Drops the pages of the tensors `read_into_memory` left in the file's map from this
    /// process (once their interleaved copies are built): they are the page cache's to keep or
    /// evict, and a later reader faults them in again from the file.
    pub fn release_left_in_file(&self) {
        let Some(map) = &self.file_map else { return };
        for (t, _) in self.tensors.iter().zip(&self.left_in_file).filter(|(_, &l)| l) {
            // whole pages inside the tensor's bytes (its neighbours' stay)
            let start = (self.data_offset + t.offset) as usize;
            let (first, end) =
                (start.next_multiple_of(4096), (start + t.n_bytes as usize) / 4096 * 4096);
            if first < end {
                // SAFETY: the map is a read-only map of a file: dropped pages read back the
                // file's bytes, so no reader sees anything else
                let _ = unsafe {
                    map.unchecked_advise_range(
                        memmap2::UncheckedAdvice::DontNeed,
                        first,
                        end - first,
                    )
                };
            }
        }
    }

    /// Whether `read_into_memory` replaced the file's map.
    pub fn in_memory(&self) -> bool {
        self.in_memory
    }

    pub fn open(path: &Path) -> Result<GgufFile> {
        let file = File::open(path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => Error::FileNotFound(path.to_path_buf()),
            _ => Error::Io { path: path.to_path_buf(), source: e },
        })?;
        if file.metadata().map(|m| m.is_dir()).unwrap_or(false) {
            return Err(Error::Format(format!(
                "{} is a directory, not a GGUF file",
                path.display()
            )));
        }
        // SAFETY: the map is read-only; a file truncated by another process while mapped would
        // fault, which is the same contract every mmap-based model loader has.
        let mmap = unsafe { Mmap::map(&file) }
            .map_err(|e| Error::Io { path: path.to_path_buf(), source: e })?;
        advise_huge_pages(&mmap);
        let header = parse_header(&mmap)?;
        Ok(GgufFile {
            mmap,
            in_memory: false,
            file_map: None,
            left_in_file: Vec::new(),
            magic: header.magic,
            version: header.version,
            index: header.metadata.iter().enumerate().map(|(i, (k, _))| (k.clone(), i)).collect(),
            metadata: header.metadata,
            tensor_index: header
                .tensors
                .iter()
                .enumerate()
                .map(|(i, t)| (t.name.clone(), i))
                .collect(),
            tensors: header.tensors,
            alignment: header.alignment,
            data_offset: header.data_offset,
        })
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.index.get(key).map(|&i| &self.metadata[i].1)
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// The bytes of a tensor, inside the map (extents were checked at parse time).
    pub fn tensor_bytes(&self, t: &TensorInfo) -> &[u8] {
        let start = (self.data_offset + t.offset) as usize;
        let left = self
            .tensor_index
            .get(&t.name)
            .is_some_and(|&i| self.left_in_file.get(i) == Some(&true));
        let map = match (&self.file_map, left) {
            (Some(file), true) => file,
            _ => &self.mmap,
        };
        &map[start..start + t.n_bytes as usize]
    }

    pub fn file_size(&self) -> u64 {
        self.mmap.len() as u64
    }

    /// Tensor `name` decoded to f32, row by row (rows of dims[0] elements), for inspection.
    pub fn read_f32(&self, name: &str) -> Result<Vec<f32>> {
        let t = self.tensor(name).ok_or_else(|| {
            Error::InvalidArgument(format!("the file has no tensor named '{name}'"))
        })?;
        let dtype = t.dtype.ok_or_else(|| Error::UnsupportedType {
            tensor: t.name.clone(),
            dtype: t.type_name(),
        })?;
        let row_len = t.dims.first().copied().unwrap_or(1) as usize;
        let n = t.n_elements() as usize;
        let mut out = vec![0.0f32; n];
        if row_len > 0 {
            let row_bytes = dtype.row_bytes(row_len);
            for (o, bytes) in
                out.chunks_exact_mut(row_len).zip(self.tensor_bytes(t).chunks_exact(row_bytes))
            {
                crate::quant::dequantize_row(dtype, bytes, o);
            }
        }
        Ok(out)
    }
}

/// Asks the kernel to back a map with 2 MiB pages where it can. The sparse operators read
/// scattered rows, and on 4 KiB pages nearly every row costs a TLB miss: the sparse FFN bench
/// (Q4_0, 95% of the neurons skipped, one thread) ran 15.0x dense on 4 KiB pages and 16.9x on
/// huge pages. Only a hint: kernels without transparent huge pages for this kind of memory
/// (or with them disabled) ignore it.
pub fn advise_huge_pages(map: &Mmap) {
    #[cfg(target_os = "linux")]
    let _ = map.advise(memmap2::Advice::HugePage);
    #[cfg(not(target_os = "linux"))]
    let _ = map;
}

/// Zeroed memory for weights built at run time (transposed copies): an anonymous map, so it is
/// page-aligned and can be backed by huge pages like the file's weights (`advise_huge_pages`).
pub fn weight_buffer(len: usize) -> std::io::Result<memmap2::MmapMut> {
    let map = memmap2::MmapOptions::new().len(len.max(1)).map_anon()?;
    #[cfg(target_os = "linux")]
    let _ = map.advise(memmap2::Advice::HugePage);
    Ok(map)
}

/// What `parse_header` returns; separated from `GgufFile` so tests can parse bytes in memory.
#[derive(Debug)]
pub struct Header {
    pub magic: Magic,
    pub version: u32,
    pub metadata: Vec<(String, Value)>,
    pub tensors: Vec<TensorInfo>,
    pub alignment: u64,
    pub data_offset: u64,
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8]> {
        let left = (self.buf.len() - self.pos) as u64;
        if n > left {
            return Err(Error::Format(format!(
                "file truncated while reading {what} at byte {} (need {n} bytes, {left} left)",
                self.pos
            )));
        }
        let s = &self.buf[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }
    fn u8(&mut self, what: &str) -> Result<u8> {
        Ok(self.take(1, what)?[0])
    }
    fn u16(&mut self, what: &str) -> Result<u16> {
        Ok(u16::from_le_bytes(self.take(2, what)?.try_into().unwrap()))
    }
    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4, what)?.try_into().unwrap()))
    }
    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8, what)?.try_into().unwrap()))
    }
    fn string(&mut self, what: &str) -> Result<String> {
        let len = self.u64(what)?;
        if len > MAX_STRING_LEN {
            return Err(Error::Format(format!("{what}: string length {len} is out of range")));
        }
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec())
            .map_err(|_| Error::Format(format!("{what}: string is not valid UTF-8")))
    }

    fn value(&mut self, type_id: u32, key: &str, depth: u32) -> Result<Value> {
        Ok(match type_id {
            0 => Value::U8(self.u8(key)?),
            1 => Value::I8(self.u8(key)? as i8),
            2 => Value::U16(self.u16(key)?),
            3 => Value::I16(self.u16(key)? as i16),
            4 => Value::U32(self.u32(key)?),
            5 => Value::I32(self.u32(key)? as i32),
            6 => Value::F32(f32::from_bits(self.u32(key)?)),
            7 => match self.u8(key)? {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => {
                    return Err(Error::Format(format!(
                        "metadata '{key}': bool byte {b} is neither 0 nor 1"
                    )))
                }
            },
            8 => Value::Str(self.string(key)?),
            9 => {
                if depth > 0 {
                    return Err(Error::Format(format!(
                        "metadata '{key}': nested arrays are not supported"
                    )));
                }
                let elem_type = self.u32(key)?;
                let len = self.u64(key)?;
                if len > MAX_ARRAY_LEN {
                    return Err(Error::Format(format!(
                        "metadata '{key}': array length {len} is out of range"
                    )));
                }
                // Each element takes at least one byte: a length beyond the bytes left is a lie.
                if len > (self.buf.len() - self.pos) as u64 {
                    return Err(Error::Format(format!(
                        "metadata '{key}': array of {len} elements runs past the end of the file"
                    )));
                }
                let mut items = Vec::with_capacity(len as usize);
                for _ in 0..len {
                    items.push(self.value(elem_type, key, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(self.u64(key)?),
            11 => Value::I64(self.u64(key)? as i64),
            12 => Value::F64(f64::from_bits(self.u64(key)?)),
            t => return Err(Error::Format(format!("metadata '{key}': unknown value type {t}"))),
        })
    }
}

/// Parses the header of a whole GGUF file held in `buf` and checks every tensor's extent.
pub fn parse_header(buf: &[u8]) -> Result<Header> {
    let mut c = Cursor { buf, pos: 0 };
    if buf.len() < 4 {
        return Err(Error::Format(format!("file is {} bytes, too short to be GGUF", buf.len())));
    }
    let magic = match c.take(4, "magic")? {
        b"GGUF" => Magic::Gguf,
        b"PWRI" => Magic::Powerinfer,
        m => {
            return Err(Error::Format(format!(
                "not a GGUF file (magic {:?}, expected \"GGUF\" or \"PWRI\")",
                String::from_utf8_lossy(m)
            )))
        }
    };
    let version = c.u32("version")?;
    if version != 2 && version != 3 {
        return Err(Error::Format(format!(
            "GGUF version {version} is not supported (only 2 and 3)"
        )));
    }
    let n_tensors = c.u64("tensor count")?;
    let n_kv = c.u64("metadata count")?;
    if n_tensors > MAX_TENSORS {
        return Err(Error::Format(format!("tensor count {n_tensors} is out of range")));
    }
    if n_kv > MAX_KV {
        return Err(Error::Format(format!("metadata count {n_kv} is out of range")));
    }

    let mut metadata = Vec::with_capacity(n_kv.min(4096) as usize);
    for _ in 0..n_kv {
        let key = c.string("metadata key")?;
        let type_id = c.u32(&key)?;
        let value = c.value(type_id, &key, 0)?;
        metadata.push((key, value));
    }

    let alignment = match metadata.iter().find(|(k, _)| k == "general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some((_, v)) => match v.as_u64() {
            Some(a) if a > 0 && a.is_power_of_two() && a <= 1 << 20 => a,
            _ => {
                return Err(Error::Format(format!("general.alignment {v:?} is not a power of two")))
            }
        },
    };

    let mut tensors = Vec::with_capacity(n_tensors.min(65536) as usize);
    for _ in 0..n_tensors {
        let name = c.string("tensor name")?;
        let n_dims = c.u32(&name)?;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(Error::Format(format!(
                "tensor '{name}': {n_dims} dimensions (1 to {MAX_DIMS} allowed)"
            )));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(c.u64(&name)?);
        }
        let type_id = c.u32(&name)?;
        let offset = c.u64(&name)?;
        let dtype = DType::from_id(type_id);
        // each dimension bounded too: with a zero among them, the product alone would let a
        // row of 2^62 elements through, whose byte count overflows
        let n_elements = dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .filter(|&n| n < 1 << 48 && dims.iter().all(|&d| d < 1 << 48))
            .ok_or_else(|| {
                Error::Format(format!("tensor '{name}': dimensions {dims:?} are out of range"))
            })?;
        let n_bytes = match dtype {
            Some(dt) => {
                if dims[0] % dt.block_len() as u64 != 0 {
                    return Err(Error::Format(format!(
                        "tensor '{name}': row length {} is not a multiple of the {} block size {}",
                        dims[0],
                        dt.name(),
                        dt.block_len()
                    )));
                }
                n_elements / dt.block_len() as u64 * dt.block_bytes() as u64
            }
            // plain element types the engine does not compute with but index files use
            None => match type_id {
                24 => n_elements,          // I8
                25 => n_elements * 2,      // I16
                26 => n_elements * 4,      // I32
                27 | 28 => n_elements * 8, // I64, F64
                _ => 0,
            },
        };
        if offset % alignment != 0 {
            return Err(Error::Format(format!(
                "tensor '{name}': offset {offset} is not aligned to {alignment}"
            )));
        }
        tensors.push(TensorInfo { name, dims, type_id, dtype, offset, n_bytes });
    }

    let data_offset = (c.pos as u64).div_ceil(alignment) * alignment;
    let file_len = buf.len() as u64;
    for t in &tensors {
        let end = data_offset.checked_add(t.offset).and_then(|s| s.checked_add(t.n_bytes));
        match end {
            Some(end) if end <= file_len => {}
            _ => {
                // (the offset is named as the file gives it: data_offset + offset may overflow)
                return Err(Error::Format(format!(
                    "tensor '{}' data (offset {} past the data section at {}, {} bytes) runs past the end of the file ({} bytes): the file is truncated or corrupt",
                    t.name,
                    t.offset,
                    data_offset,
                    t.n_bytes,
                    file_len
                )));
            }
        }
    }
    Ok(Header { magic, version, metadata, tensors, alignment, data_offset })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Builds a GGUF byte image by hand so malformed variants can be produced.
    struct Builder {
        b: Vec<u8>,
    }
    impl Builder {
        fn new(magic: &[u8; 4], version: u32, n_tensors: u64, n_kv: u64) -> Self {
            let mut b = magic.to_vec();
            b.extend(version.to_le_bytes());
            b.extend(n_tensors.to_le_bytes());
            b.extend(n_kv.to_le_bytes());
            Builder { b }
        }
        fn str(&mut self, s: &str) -> &mut Self {
            self.b.extend((s.len() as u64).to_le_bytes());
            self.b.extend(s.as_bytes());
            self
        }
        fn u32(&mut self, v: u32) -> &mut Self {
            self.b.extend(v.to_le_bytes());
            self
        }
        fn u64(&mut self, v: u64) -> &mut Self {
            self.b.extend(v.to_le_bytes());
            self
        }
        fn tensor(&mut self, name: &str, dims: &[u64], type_id: u32, offset: u64) -> &mut Self {
            self.str(name).u32(dims.len() as u32);
            for &d in dims {
                self.u64(d);
            }
            self.u32(type_id).u64(offset)
        }
        fn pad_data(&mut self, n: usize) -> Vec<u8> {
            let mut b = self.b.clone();
            while !b.len().is_multiple_of(32) {
                b.push(0);
            }
            b.extend(std::iter::repeat_n(0u8, n));
            b
        }
    }

    fn good_file() -> Vec<u8> {
        let mut b = Builder::new(b"GGUF", 3, 2, 4);
        b.str("general.architecture").u32(8).str("llama");
        b.str("llama.block_count").u32(4).u32(2);
        b.str("some.f64").u32(12).u64(1.5f64.to_bits());
        b.str("tokenizer.ggml.tokens").u32(9).u32(8).u64(3).str("a").str("bc").str("<s>");
        b.tensor("w", &[32, 2], 8, 0); // Q8_0: 2 rows x 1 block x 34 bytes = 68
        b.tensor("v", &[4], 0, 96);
        b.pad_data(96 + 16)
    }

    #[test]
    fn parses_metadata_and_tensors() {
        let h = parse_header(&good_file()).unwrap();
        assert_eq!(h.magic, Magic::Gguf);
        assert_eq!(h.version, 3);
        assert_eq!(h.metadata[0].1, Value::Str("llama".into()));
        assert_eq!(h.metadata[1].1.as_u64(), Some(2));
        assert_eq!(h.metadata[2].1.as_f64(), Some(1.5));
        match &h.metadata[3].1 {
            Value::Array(v) => assert_eq!(v.len(), 3),
            other => panic!("expected array, got {other:?}"),
        }
        assert_eq!(h.tensors[0].shape(), vec![2, 32]);
        assert_eq!(h.tensors[0].n_bytes, 68);
        assert_eq!(h.tensors[1].n_bytes, 16);
        assert_eq!(h.data_offset % 32, 0);
    }

    #[test]
    fn accepts_powerinfer_magic() {
        let mut f = good_file();
        f[..4].copy_from_slice(b"PWRI");
        assert_eq!(parse_header(&f).unwrap().magic, Magic::Powerinfer);
    }

    fn err_of(buf: &[u8]) -> String {
        match parse_header(buf) {
            Err(Error::Format(m)) => m,
            Err(e) => panic!("unexpected error kind {e}"),
            Ok(_) => panic!("malformed file was accepted"),
        }
    }

    #[test]
    fn rejects_bad_magic_and_version() {
        let mut f = good_file();
        f[..4].copy_from_slice(b"GGML");
        assert!(err_of(&f).contains("not a GGUF file"));
        let mut f = good_file();
        f[4..8].copy_from_slice(&1u32.to_le_bytes());
        assert!(err_of(&f).contains("version 1"));
        assert!(err_of(b"GG").contains("too short"));
    }

    #[test]
    fn rejects_every_truncation() {
        let f = good_file();
        let h = parse_header(&f).unwrap();
        // Any cut inside the header or the tensor data must be an error, never a panic.
        for cut in 0..(h.data_offset as usize + 96 + 16) {
            assert!(parse_header(&f[..cut]).is_err(), "truncation at {cut} accepted");
        }
    }

    #[test]
    fn rejects_huge_lengths() {
        let mut b = Builder::new(b"GGUF", 3, 0, 1);
        b.u64(u64::MAX); // key length
        assert!(err_of(&b.pad_data(0)).contains("out of range"));

        let mut b = Builder::new(b"GGUF", 3, 0, 1);
        b.str("arr").u32(9).u32(0).u64(1 << 40);
        assert!(err_of(&b.pad_data(0)).contains("out of range"));

        let mut b = Builder::new(b"GGUF", 3, 0, 1);
        b.str("arr").u32(9).u32(0).u64(1000);
        assert!(err_of(&b.pad_data(0)).contains("past the end"));

        let mut b = Builder::new(b"GGUF", 3, u64::MAX, 0);
        assert!(err_of(&b.pad_data(0)).contains("tensor count"));
    }

    #[test]
    fn rejects_bad_tensor_infos() {
        let mut b = Builder::new(b"GGUF", 3, 1, 0);
        b.tensor("t", &[1, 1, 1, 1, 1], 0, 0);
        assert!(err_of(&b.pad_data(64)).contains("dimensions"));

        let mut b = Builder::new(b"GGUF", 3, 1, 0);
        b.tensor("t", &[u64::MAX, 4], 0, 0);
        assert!(err_of(&b.pad_data(64)).contains("out of range"));

        let mut b = Builder::new(b"GGUF", 3, 1, 0);
        b.tensor("t", &[33, 1], 2, 0); // Q4_0 row not a multiple of 32
        assert!(err_of(&b.pad_data(64)).contains("multiple"));

        let mut b = Builder::new(b"GGUF", 3, 1, 0);
        b.tensor("t", &[8], 0, 7);
        assert!(err_of(&b.pad_data(64)).contains("aligned"));

        let mut b = Builder::new(b"GGUF", 3, 1, 0);
        b.tensor("t", &[1024], 0, 0); // 4 KiB of F32, only 64 bytes present
        assert!(err_of(&b.pad_data(64)).contains("past the end"));

        let mut b = Builder::new(b"GGUF", 3, 0, 1);
        b.str("k").u32(99);
        assert!(err_of(&b.pad_data(0)).contains("unknown value type"));

        let mut b = Builder::new(b"GGUF", 3, 0, 1);
        b.str("k").u32(7).b.push(5);
        assert!(err_of(&b.pad_data(0)).contains("bool"));
    }

    #[test]
    fn rejects_tensor_offset_near_u64_max() {
        // found by fuzzing (fuzz/regressions/fixed/tensor-offset-overflow.gguf): one F32 tensor
        // whose aligned offset overflows when added to the data section's start
        let f: &[u8] = b"GGUF\x03\0\0\0\x01\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\
            \x01\0\0\0\0\0\0\0t\x01\0\0\0\x01\0\0\0\0\0\0\0\0\0\0\0\
            \xe0\xff\xff\xff\xff\xff\xff\xff";
        assert_eq!(f.len(), 57);
        let mut b = Builder::new(b"GGUF", 3, 1, 0);
        b.tensor("t", &[1], 0, u64::MAX - 31);
        assert_eq!(f, b.b.as_slice());
        let err = err_of(f);
        assert!(err.contains("past the end"), "{err}");
        assert!(err.contains(&format!("offset {}", u64::MAX - 31)), "{err}");
    }

    #[test]
    fn rejects_a_huge_row_in_an_empty_tensor() {
        // found by fuzzing (fuzz/regressions/fixed/empty-tensor-huge-row.gguf): dims [2^62, 0]
        // hold no elements, and reading the tensor computed 2^62 rows' bytes
        let mut b = Builder::new(b"GGUF", 3, 1, 0);
        b.tensor("t", &[1 << 62, 0], 0, 0);
        let err = err_of(&b.pad_data(0));
        assert!(err.contains("out of range"), "{err}");
    }

    #[test]
    fn unknown_tensor_types_parse_but_have_no_dtype() {
        let mut b = Builder::new(b"GGUF", 3, 1, 0);
        b.tensor("t", &[256], 16, 0); // IQ2_XXS
        let h = parse_header(&b.pad_data(0)).unwrap();
        assert!(h.tensors[0].dtype.is_none());
        assert_eq!(h.tensors[0].type_name(), "IQ2_XXS");
    }
}
