//! A whole GGUF file through `GgufFile::open` (the memory-mapped reader every model load uses),
//! then every tensor read as the engine and its Python binding read them: looked up by name,
//! its bytes taken from the map, decoded to float32 (`GgufFile.read_tensor`), and the file read
//! as a GPU index (`.gpuidx`, also a GGUF file). Errors are fine; panics are findings.
#![no_main]

use libfuzzer_sys::fuzz_target;
use powerinfer_core::gguf::GgufFile;
use powerinfer_core::gpu_index::GpuIndex;
use powerinfer_fuzz::write_input;

fuzz_target!(|data: &[u8]| {
    let path = write_input(data);
    if let Ok(file) = GgufFile::open(&path) {
        for (key, _) in &file.metadata {
            assert!(file.get(key).is_some());
        }
        for t in &file.tensors {
            let found = file.tensor(&t.name).expect("a listed tensor is found by its name");
            assert_eq!(found.name, t.name);
            let (_, _, _) = (t.shape(), t.type_name(), file.data_offset + t.offset);
            assert_eq!(file.tensor_bytes(t).len() as u64, t.n_bytes);
            if let Ok(values) = file.read_f32(&t.name) {
                // the binding reshapes the values to the tensor's shape
                assert_eq!(values.len() as u64, found.n_elements());
            }
        }
    }
    let _ = GpuIndex::read(&path);
});
