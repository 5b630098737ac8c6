//! The weight types the engine computes with, one table row each: every fact about a type that
//! the loader, the CPU kernels' dispatch and the GPU backend ask, in the spirit of ggml's
//! `type_traits`; its `type_traits_cpu`, the kernels per SIMD level, is `kernels::Table`, one
//! row per type too. Adding a format is a row here, its block layout and decoder in `quant/`,
//! and its kernels with their row there.
//!
//! This module holds facts, not code that touches weights.

/// ggml's tensor types the engine computes with (named as ggml names them). The discriminant is
/// the row's index in `TYPES`.
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q8_0,
    Q5_0,
    Q5_1,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    IQ4_NL,
    IQ4_XS,
    MXFP4,
}

/// The form a type's products read their activations in (ggml's `vec_dot_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ActFormat {
    /// Float weights read f32 activations.
    F32,
    /// int8 per 32 elements with an f32 scale and the scaled sum (`quant::BlockQ8Act`).
    Q8Per32,
    /// int8 per 256 elements with 16- and 32-element sums (`quant::q256::BlockQ8K`, ggml's q8_K).
    Q8Per256,
}

/// How the CPU kernels read a row of the type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decoding {
    /// Elements as they are (F32) or widened (F16, BF16).
    Float,
    /// Blocks that the dot kernels read directly (Q4_0, Q4_1, Q8_0: `quant`, `quant::q32_x86`).
    Direct,
    /// Blocks decoded into 32-weight chunks first (`quant::chunks`); the 256-weight ones are
    /// also summed per super-block (`quant::q256`).
    Chunks,
}

/// Every fact about one weight type.
#[derive(Debug, Clone, Copy)]
pub struct TypeTraits {
    pub dtype: DType,
    /// ggml's type id in GGUF files.
    pub ggml_id: u32,
    /// ggml's name (`Q4_K`); lower-cased, the suffix of the type's CUDA kernels.
    pub name: &'static str,
    /// Elements per block (1 for floats).
    pub block_len: usize,
    /// Bytes per block (the `#[repr(C)]` block's size; its size assert sits beside it).
    pub block_bytes: usize,
    /// The alignment its data needs: the element's, or a block's first field (an f16 scale).
    pub align: usize,
    pub activations: ActFormat,
    pub decoding: Decoding,
    /// Weight rows per kernel call in decode, at the `Scalar`, `Avx2` and `Avx512` levels: four
    /// where the rows share a pass over the token's activations and their sums do not wait on
    /// each other (1.3-1.8x on 576-column rows); one for floats, whose dots are bound by the row
    /// loads.
    pub decode_rows: [usize; 3],
    /// Neuron rows per kernel call of the sparse down projection's axpy (`sparse::add_rows`):
    /// eight for Q4_0, whose calls then load and store the output once per eight rows (its
    /// sparse FFN at AVX2 on one thread 2-4% faster at the 7B shape, 2-6% at SmolLM2's); four
    /// elsewhere (Q4_1, Q8_0 and Q4_K were no faster with eight, Q8_0 up to 3% slower: their
    /// loops hold more per row).
    pub axpy_rows: usize,
    /// Whether the GPU backend has kernels for it (matvec, FFN, down projection).
    pub gpu: bool,
}

const QUANT_ROWS: [usize; 3] = [1, 4, 4];
const FLOAT_ROWS: [usize; 3] = [1, 1, 1];

/// One row per `DType`, in its order.
pub const TYPES: [TypeTraits; 16] = {
    use ActFormat::*;
    use Decoding::*;
    const fn float(dtype: DType, ggml_id: u32, name: &'static str, bytes: usize) -> TypeTraits {
        let gpu = !matches!(dtype, DType::BF16);
        TypeTraits {
            dtype,
            ggml_id,
            name,
            block_len: 1,
            block_bytes: bytes,
            align: bytes,
            activations: F32,
            decoding: Float,
            decode_rows: FLOAT_ROWS,
            axpy_rows: 4,
            gpu,
        }
    }
    const fn quant(
        dtype: DType,
        ggml_id: u32,
        name: &'static str,
        block_len: usize,
        block_bytes: usize,
        decoding: Decoding,
    ) -> TypeTraits {
        let activations = if block_len == 256 { Q8Per256 } else { Q8Per32 };
        TypeTraits {
            dtype,
            ggml_id,
            name,
            block_len,
            block_bytes,
            align: 2,
            activations,
            decoding,
            decode_rows: QUANT_ROWS,
            axpy_rows: 4,
            gpu: true,
        }
    }
    [
        float(DType::F32, 0, "F32", 4),
        float(DType::F16, 1, "F16", 2),
        float(DType::BF16, 30, "BF16", 2),
        TypeTraits { axpy_rows: 8, ..quant(DType::Q4_0, 2, "Q4_0", 32, 18, Direct) },
        quant(DType::Q4_1, 3, "Q4_1", 32, 20, Direct),
        quant(DType::Q8_0, 8, "Q8_0", 32, 34, Direct),
        quant(DType::Q5_0, 6, "Q5_0", 32, 22, Chunks),
        quant(DType::Q5_1, 7, "Q5_1", 32, 24, Chunks),
        quant(DType::Q2_K, 10, "Q2_K", 256, 84, Chunks),
        quant(DType::Q3_K, 11, "Q3_K", 256, 110, Chunks),
        quant(DType::Q4_K, 12, "Q4_K", 256, 144, Chunks),
        quant(DType::Q5_K, 13, "Q5_K", 256, 176, Chunks),
        quant(DType::Q6_K, 14, "Q6_K", 256, 210, Chunks),
        quant(DType::IQ4_NL, 20, "IQ4_NL", 32, 18, Chunks),
        quant(DType::IQ4_XS, 23, "IQ4_XS", 256, 136, Chunks),
        // gpt-oss's experts: a one-byte power-of-two scale, so 17-byte blocks at any address
        TypeTraits { align: 1, ..quant(DType::MXFP4, 39, "MXFP4", 32, 17, Chunks) },
    ]
};

// each row sits at its type's index
const _: () = {
    let mut i = 0;
    while i < TYPES.len() {
        assert!(TYPES[i].dtype as usize == i);
        i += 1;
    }
};

impl DType {
    /// Every type, in table order.
    pub const ALL: [DType; 16] = {
        let mut all = [DType::F32; 16];
        let mut i = 0;
        while i < TYPES.len() {
            all[i] = TYPES[i].dtype;
            i += 1;
        }
        all
    };

    pub const fn traits(self) -> &'static TypeTraits {
        &TYPES[self as usize]
    }

    pub fn from_id(id: u32) -> Option<DType> {
        TYPES.iter().find(|t| t.ggml_id == id).map(|t| t.dtype)
    }

    pub fn id(self) -> u32 {
        self.traits().ggml_id
    }

    pub fn name(self) -> &'static str {
        self.traits().name
    }

    /// Elements per block.
    pub fn block_len(self) -> usize {
        self.traits().block_len
    }

    pub fn block_bytes(self) -> usize {
        self.traits().block_bytes
    }

    pub fn row_bytes(self, n: usize) -> usize {
        n / self.block_len() * self.block_bytes()
    }

    /// Quantized weight types take int8 activations; float types take f32 activations.
    pub fn is_quantized(self) -> bool {
        self.traits().activations != ActFormat::F32
    }

    /// Whether the type's products read activations quantized per 256 (ggml's q8_K pairing).
    pub fn reads_q8k(self) -> bool {
        self.traits().activations == ActFormat::Q8Per256
    }

    /// Whether the CPU kernels decode the type into 32-weight chunks (`quant::chunks`).
    pub fn is_chunked(self) -> bool {
        self.traits().decoding == Decoding::Chunks
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_type_round_trips_through_its_id_and_name() {
        for t in DType::ALL {
            assert_eq!(DType::from_id(t.id()), Some(t));
            assert_eq!(crate::quant::type_name(t.id()), t.name());
            assert_eq!(t.block_len() % 32 == 0, t.is_quantized());
        }
        assert_eq!(DType::from_id(15), None, "Q8_K is not a weight type");
    }
}
