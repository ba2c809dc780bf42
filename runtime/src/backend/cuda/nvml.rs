//! The board's energy counter and SM clock through NVML (`libnvidia-ml.so.1`, which the NVIDIA
//! driver installs), opened with `dlopen` at run time like the rest of the CUDA stack, for
//! `titan-run --kernel-energy`. Three calls are used: `nvmlDeviceGetTotalEnergyConsumption`
//! (millijoules since the driver loaded; Volta and later), `nvmlDeviceGetClockInfo` (the SM
//! clock) and the handle of the device by its PCI bus id (the same GPU as the CUDA device,
//! whatever `CUDA_VISIBLE_DEVICES` says).

use std::ffi::{CStr, CString, c_char, c_int, c_uint, c_ulonglong, c_void};

use super::driver::CudaError;

type Handle = *mut c_void;
type Init = unsafe extern "C" fn() -> c_int;
type ByPci = unsafe extern "C" fn(*const c_char, *mut Handle) -> c_int;
type Energy = unsafe extern "C" fn(Handle, *mut c_ulonglong) -> c_int;
type Clock = unsafe extern "C" fn(Handle, c_int, *mut c_uint) -> c_int;

/// `NVML_CLOCK_SM`.
const CLOCK_SM: c_int = 1;

/// One GPU's NVML handle and the two readings.
pub struct Nvml {
    dev: Handle,
    energy: Energy,
    clock: Clock,
}

// SAFETY: NVML is thread-safe (its documentation: "all NVML functions are thread-safe"); the
// handle is an opaque pointer the library owns for the life of the process.
unsafe impl Send for Nvml {}
// SAFETY: as above.
unsafe impl Sync for Nvml {}

fn unavailable(what: String) -> CudaError {
    CudaError::NoDevice(format!("NVML (libnvidia-ml.so.1, the driver's management library): {what}; --kernel-energy needs it"))
}

/// `dlsym` of `name` in `lib`, as the function type `F`.
///
/// # Safety
/// `F` must be the C signature of `name`.
unsafe fn symbol<F: Copy>(lib: *mut c_void, name: &str) -> Result<F, CudaError> {
    let c = CString::new(name).expect("symbol names have no NUL");
    // SAFETY: `lib` is a handle from dlopen; `c` is NUL-terminated.
    let p = unsafe { libc::dlsym(lib, c.as_ptr()) };
    if p.is_null() {
        return Err(unavailable(format!("it has no `{name}`")));
    }
    // SAFETY: the caller names the symbol's type; a function pointer has a pointer's size.
    Ok(unsafe { std::mem::transmute_copy::<*mut c_void, F>(&p) })
}

impl Nvml {
    /// The GPU at PCI bus id `bus` (as `cuDeviceGetPCIBusId` writes it).
    pub fn open(bus: &str) -> Result<Nvml, CudaError> {
        let name = CString::new("libnvidia-ml.so.1").expect("no NUL");
        // SAFETY: opens a library by name; the handle is never closed (the process keeps it).
        let lib = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if lib.is_null() {
            // SAFETY: dlerror returns a NUL-terminated message or null.
            let why = unsafe { libc::dlerror() };
            let why = if why.is_null() { "not found".into() } else { unsafe { CStr::from_ptr(why) }.to_string_lossy().into_owned() };
            return Err(unavailable(why));
        }
        // SAFETY: the types are NVML's C signatures.
        let (init, by_pci, energy, clock) = unsafe {
            (
                symbol::<Init>(lib, "nvmlInit_v2")?,
                symbol::<ByPci>(lib, "nvmlDeviceGetHandleByPciBusId_v2")?,
                symbol::<Energy>(lib, "nvmlDeviceGetTotalEnergyConsumption")?,
                symbol::<Clock>(lib, "nvmlDeviceGetClockInfo")?,
            )
        };
        // SAFETY: plain NVML calls with valid out-pointers.
        let rc = unsafe { init() };
        if rc != 0 {
            return Err(unavailable(format!("nvmlInit_v2 returned {rc}")));
        }
        let bus_c = CString::new(bus).map_err(|_| unavailable("a PCI bus id with a NUL".into()))?;
        let mut dev: Handle = std::ptr::null_mut();
        // SAFETY: as above.
        let rc = unsafe { by_pci(bus_c.as_ptr(), &mut dev) };
        if rc != 0 {
            return Err(unavailable(format!("no device at PCI bus id {bus} (nvmlDeviceGetHandleByPciBusId_v2 returned {rc})")));
        }
        let n = Nvml { dev, energy, clock };
        n.energy_mj()?;
        Ok(n)
    }

    /// The board's energy counter, millijoules since the driver loaded.
    pub fn energy_mj(&self) -> Result<u64, CudaError> {
        let mut e: c_ulonglong = 0;
        // SAFETY: a valid handle and out-pointer.
        let rc = unsafe { (self.energy)(self.dev, &mut e) };
        if rc != 0 {
            return Err(unavailable(format!("nvmlDeviceGetTotalEnergyConsumption returned {rc}")));
        }
        Ok(e)
    }

    /// The SM clock now, MHz.
    pub fn sm_mhz(&self) -> Result<u32, CudaError> {
        let mut c: c_uint = 0;
        // SAFETY: a valid handle and out-pointer.
        let rc = unsafe { (self.clock)(self.dev, CLOCK_SM, &mut c) };
        if rc != 0 {
            return Err(unavailable(format!("nvmlDeviceGetClockInfo returned {rc}")));
        }
        Ok(c)
    }
}
