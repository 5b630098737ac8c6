//! The GGUF header parser on arbitrary bytes: magic, version, metadata of every value type and
//! the tensor table with its extents. It must return an error for anything malformed, never
//! panic, and what it accepts must hold together (every tensor inside the buffer).
#![no_main]

use libfuzzer_sys::fuzz_target;
use powerinfer_core::gguf::parse_header;

fuzz_target!(|data: &[u8]| {
    let Ok(header) = parse_header(data) else { return };
    assert!(header.alignment.is_power_of_two());
    assert!(header.data_offset % header.alignment == 0);
    for (_, value) in &header.metadata {
        let _ = (value.as_u64(), value.as_f64(), value.as_str(), value.as_bool());
    }
    for t in &header.tensors {
        assert!(header.data_offset + t.offset + t.n_bytes <= data.len() as u64, "{t:?}");
        let _ = (t.shape(), t.n_elements(), t.type_name());
    }
});
