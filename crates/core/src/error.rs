//! Every way the core can fail, as one typed error. The Python binding maps each variant to a
//! Python exception; nothing in the core panics on bad input.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("model file not found: {0}")]
    FileNotFound(PathBuf),

    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// The bytes are not a well-formed GGUF file (bad magic, truncated header, lengths out of range).
    #[error("invalid GGUF file: {0}")]
    Format(String),

    /// A tensor type that the file declares but this engine cannot compute with.
    #[error("tensor '{tensor}' has type {dtype}, which is not supported (supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4)")]
    UnsupportedType { tensor: String, dtype: String },

    /// The architecture and the ones the engine reads.
    #[error("unknown architecture '{0}' (supported: {1})")]
    UnknownArchitecture(String, String),

    /// A mixture-of-experts family the engine does not run (yet), named.
    /// The architecture and the mixture-of-experts files the engine runs.
    #[error("'{0}' is a mixture-of-experts architecture this engine does not run (mixture-of-experts files it runs: {1})")]
    UnsupportedMoe(String, String),

    /// A tensor or metadata key the architecture needs is absent or has the wrong shape.
    #[error("invalid model: {0}")]
    Model(String),

    #[error("context length exceeded: {needed} tokens needed but the context holds {n_ctx}")]
    ContextOverflow { needed: usize, n_ctx: usize },

    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// The GPU executor failed (driver error, out of device memory, unsupported layout).
    #[error("GPU: {0}")]
    Device(String),
}

pub type Result<T> = std::result::Result<T, Error>;
