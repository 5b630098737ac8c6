//! What the fuzz targets share: the input written to a file, because the engine reads models
//! through a memory map of a path, never from a buffer. Each fuzzing process has its own file.

use std::path::PathBuf;

/// Writes `data` to this process's scratch file (in /dev/shm when there is one, so the file
/// costs no disk I/O) and returns its path. The file is rewritten on every call.
pub fn write_input(data: &[u8]) -> PathBuf {
    let dir = if std::path::Path::new("/dev/shm").is_dir() {
        PathBuf::from("/dev/shm")
    } else {
        std::env::temp_dir()
    };
    let path = dir.join(format!("powerinfer-fuzz-{}.gguf", std::process::id()));
    // A failure here is the machine's, not the reader's: stop loudly rather than fuzz nothing.
    std::fs::write(&path, data).unwrap_or_else(|e| panic!("cannot write {}: {e}", path.display()));
    path
}
