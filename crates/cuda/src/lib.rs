//! CUDA backend of powerinfer-rs. The driver is loaded at run time through cudarc's dynamic
//! loading, so this crate builds on machines without any CUDA toolkit and the engine runs on
//! machines without a GPU (`probe` says whether one is usable). `device` is where buffers live
//! and kernels run: CUDA (committed PTX, compiled from `kernels/powerinfer.cu`) or an emulated
//! device on host memory that runs each kernel's scalar twin (`twin`); `gpu` is the executor's
//! checked view of either; `hybrid` is the CPU+GPU backend of the one forward pass, generic over the device;
//! `executor` runs a session on the CPU or the hybrid backend and decodes batches.

pub mod device;
pub mod executor;
pub mod gpu;
pub mod hybrid;
pub mod twin;

use cudarc::driver::{result, sys};

#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error("no NVIDIA driver found (libcuda could not be loaded)")]
    NoDriver,
    #[error("NVIDIA driver present but no CUDA device is available ({0})")]
    NoDevice(String),
    #[error("CUDA driver error: {0}")]
    Driver(String),
    #[error("not supported on the GPU: {0}")]
    Unsupported(String),
    #[error("invalid GPU placement: {0}")]
    Plan(String),
}

/// A device failure inside the forward pass reaches the core's callers as `Error::Device`.
impl From<CudaError> for powerinfer_core::Error {
    fn from(e: CudaError) -> Self {
        powerinfer_core::Error::Device(e.to_string())
    }
}

/// One visible CUDA device.
#[derive(Debug, Clone)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    pub total_memory: usize,
    pub compute_capability: (i32, i32),
}

/// Looks for a driver and devices without ever panicking: cudarc panics on first use when
/// libcuda is missing, so the library's presence is checked before any call into it.
pub fn probe() -> Result<Vec<DeviceInfo>, CudaError> {
    // SAFETY: only tries to dlopen libcuda; no driver function is called when it is absent.
    let present = std::panic::catch_unwind(|| unsafe { sys::is_culib_present() }).unwrap_or(false);
    if !present {
        return Err(CudaError::NoDriver);
    }
    result::init().map_err(|e| CudaError::NoDevice(e.to_string()))?;
    let count = result::device::get_count().map_err(|e| CudaError::Driver(e.to_string()))?;
    if count <= 0 {
        return Err(CudaError::NoDevice("device count is 0".into()));
    }
    let mut devices = Vec::new();
    for ordinal in 0..count {
        let dev = result::device::get(ordinal).map_err(|e| CudaError::Driver(e.to_string()))?;
        let name = result::device::get_name(dev).map_err(|e| CudaError::Driver(e.to_string()))?;
        // SAFETY: `dev` is a valid handle returned by the driver above.
        let total_memory = unsafe { result::device::total_mem(dev) }
            .map_err(|e| CudaError::Driver(e.to_string()))?;
        let attr = |a| {
            unsafe { result::device::get_attribute(dev, a) }
                .map_err(|e| CudaError::Driver(e.to_string()))
        };
        let major = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        devices.push(DeviceInfo {
            ordinal: ordinal as usize,
            name,
            total_memory,
            compute_capability: (major, minor),
        });
    }
    Ok(devices)
}

#[cfg(test)]
mod tests {
    #[test]
    fn probe_never_panics() {
        // On a machine without a driver this must be Err(NoDriver); with a GPU, Ok(devices).
        match super::probe() {
            Ok(devs) => assert!(!devs.is_empty()),
            Err(e) => assert!(!e.to_string().is_empty()),
        }
    }
}
