//! A GGUF file through the model constructor the Python binding calls (`Model::load`: header,
//! configuration from metadata, every weight's shape and type), then, when it builds, a session
//! and a forward pass of one token, dense and, for a file with predictors, sparse as PowerInfer
//! files run. Errors are fine; panics (and aborts) are findings.
#![no_main]

use std::sync::Arc;

use libfuzzer_sys::fuzz_target;
use powerinfer_core::attention::KvType;
use powerinfer_core::session::Sparsity;
use powerinfer_core::{Model, Session};
use powerinfer_fuzz::write_input;

/// A few positions: enough for a forward pass, small enough that a huge model dimension the
/// file claims costs little.
const N_CTX: usize = 4;

fuzz_target!(|data: &[u8]| {
    let path = write_input(data);
    let Ok(model) = Model::load(&path, 1, false) else { return };
    let model = Arc::new(model);
    let c = &model.config;
    let n_ctx = N_CTX.min(c.n_ctx_train).max(1);
    let has_predictors = model.has_predictors();
    let sparse_threshold = c.sparse_threshold;
    let Ok(mut session) = Session::new(Arc::clone(&model), n_ctx, KvType::F16) else { return };
    if let Ok(logits) = session.eval(&[0], false) {
        assert_eq!(logits.len(), model.config.n_vocab);
    }
    if has_predictors {
        let sparsity = Sparsity::Predictor {
            cutoff: sparse_threshold,
            layer_cutoffs: Vec::new(),
            track_recall: false,
        };
        if session.set_sparsity(sparsity).is_ok() {
            let _ = session.eval(&[0], false);
        }
    }
});
