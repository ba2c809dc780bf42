//! A small checked layer over the CUDA driver API (cudarc's `sys`/`result` bindings, loaded at
//! run time): the primary context of device 0 and one stream, device allocations freed on
//! drop, PTX modules, kernel launches, copies, memsets, events and stream capture into a graph.
//! Every call returns a [`CudaError`] naming what was being done; nothing here panics, and a
//! machine without the driver library gets an error, not cudarc's load-time panic.

use std::ffi::{CString, c_void};

use cudarc::driver::result;
use cudarc::driver::sys;
use titan_ir::artifact::timeline::COMM_STREAMS;

/// A failed CUDA driver or cuBLASLt call, or a machine without a usable GPU.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// No driver library, no device, or a driver that fails to initialize.
    #[error("no CUDA device: {0}")]
    NoDevice(String),
    /// A call failed: `what` names the kernel/GEMM/copy and where in the schedule.
    #[error("{what}: {message}")]
    Call { what: String, message: String },
}

/// Describe a driver error: `CUDA_ERROR_ILLEGAL_ADDRESS (an illegal memory access ...)`.
pub fn describe(e: result::DriverError) -> String {
    let name = e.error_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|_| format!("{:?}", e.0));
    let text = e.error_string().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    let hint = match e.0 {
        sys::CUresult::CUDA_ERROR_ILLEGAL_ADDRESS | sys::CUresult::CUDA_ERROR_MISALIGNED_ADDRESS => {
            "; the context is lost, rerun under compute-sanitizer to find the access"
        }
        sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => "; the memory plan does not fit this GPU, use a smaller batch or fewer layers",
        sys::CUresult::CUDA_ERROR_INVALID_PTX | sys::CUresult::CUDA_ERROR_UNSUPPORTED_PTX_VERSION => {
            "; the driver cannot compile this PTX, update the driver or rebuild the artifact"
        }
        _ => "",
    };
    format!("{name} ({text}){hint}")
}

/// Attach `what` to a driver error.
pub fn check<T>(r: Result<T, result::DriverError>, what: impl FnOnce() -> String) -> Result<T, CudaError> {
    r.map_err(|e| CudaError::Call { what: what(), message: describe(e) })
}

/// Whether the CUDA driver library can be loaded on this machine (no panic when it cannot).
pub fn driver_present() -> bool {
    // SAFETY: only tries to open the library by name.
    unsafe { sys::is_culib_present() }
}

/// The primary context of one device and the stream everything runs on.
pub struct Gpu {
    ctx: sys::CUcontext,
    dev: sys::CUdevice,
    pub stream: sys::CUstream,
    /// The streams collectives run on, one per [`comm_stream`] (`tp` apart from the
    /// data-parallel dims), ordered against `stream` and each other by events
    /// ([`Gpu::fork_to_comm`], [`Gpu::record_on_comm`], [`Gpu::wait_for`],
    /// [`Gpu::comm_wait_for`]).
    ///
    /// [`comm_stream`]: titan_ir::artifact::timeline::comm_stream
    pub comm: [sys::CUstream; COMM_STREAMS],
    pub name: String,
}

// SAFETY: the driver API is thread-safe; the context and stream are plain handles that any
// thread may use once it has made the context current ([`Gpu::bind`]). Start-up loads modules
// and copies initial values from several threads.
unsafe impl Send for Gpu {}
// SAFETY: as above; `&Gpu` only issues driver calls, which the driver serializes as needed.
unsafe impl Sync for Gpu {}

impl Gpu {
    /// Open device 0 (the primary context) and create the streams.
    pub fn open() -> Result<Gpu, CudaError> {
        Self::open_device(0)
    }

    /// Open device `ordinal` (a multi-process run's `LOCAL_RANK`), its primary context, a
    /// non-blocking compute stream and the non-blocking collectives streams.
    pub fn open_device(ordinal: usize) -> Result<Gpu, CudaError> {
        if !driver_present() {
            return Err(CudaError::NoDevice(
                "the CUDA driver library (libcuda.so) is not installed here; run on a machine with an NVIDIA driver or use --backend cpu".into(),
            ));
        }
        result::init().map_err(|e| CudaError::NoDevice(format!("cuInit failed: {}; check the NVIDIA driver or use --backend cpu", describe(e))))?;
        let n = result::device::get_count().map_err(|e| CudaError::NoDevice(describe(e)))?;
        if n < 1 {
            return Err(CudaError::NoDevice("the driver sees no GPU; use --backend cpu".into()));
        }
        if ordinal >= n as usize {
            return Err(CudaError::NoDevice(format!(
                "GPU {ordinal} was asked for (LOCAL_RANK) but the driver sees {n}; launch at most {n} processes per node or check CUDA_VISIBLE_DEVICES"
            )));
        }
        let dev = check(result::device::get(ordinal as i32), || format!("opening device {ordinal}"))?;
        // SAFETY: `dev` is a valid device; the primary context is released in Drop.
        let ctx = check(unsafe { result::primary_ctx::retain(dev) }, || "retaining the primary context".into())?;
        // SAFETY: `ctx` was just retained.
        check(unsafe { result::ctx::set_current(ctx) }, || "making the context current".into())?;
        let stream = check(result::stream::create(result::stream::StreamKind::NonBlocking), || "creating a stream".into())?;
        let mut comm = [std::ptr::null_mut(); COMM_STREAMS];
        for (i, c) in comm.iter_mut().enumerate() {
            *c = check(result::stream::create(result::stream::StreamKind::NonBlocking), || format!("creating collectives stream {i}"))?;
        }
        let name = result::device::get_name(dev).unwrap_or_else(|_| "unknown GPU".into());
        Ok(Gpu { ctx, dev, stream, comm, name })
    }

    /// The device's PCI bus id (`domain:bus:device.function`), as NVML names devices.
    pub fn pci_bus_id(&self) -> Result<String, CudaError> {
        let mut buf = [0 as std::ffi::c_char; 32];
        // SAFETY: `buf` has the length passed; `dev` is a valid device.
        check(unsafe { sys::cuDeviceGetPCIBusId(buf.as_mut_ptr(), buf.len() as i32, self.dev).result() }, || "reading the PCI bus id".into())?;
        // SAFETY: the driver wrote a NUL-terminated string into `buf`.
        Ok(unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned())
    }

    /// Make collectives stream `s` wait for the work enqueued on the compute stream so far
    /// (`e` is recorded on the compute stream).
    pub fn fork_to_comm(&self, s: usize, e: &Event) -> Result<(), CudaError> {
        // SAFETY: valid event and streams.
        unsafe {
            check(result::event::record(e.0, self.stream), || "recording an event before a collective".into())?;
            check(result::stream::wait_event(self.comm[s], e.0, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT), || {
                "ordering a collective after compute".into()
            })
        }
    }

    /// Record `e` on collectives stream `s` (a collective's start or end).
    pub fn record_on_comm(&self, s: usize, e: &Event) -> Result<(), CudaError> {
        // SAFETY: valid event and stream.
        check(unsafe { result::event::record(e.0, self.comm[s]) }, || "recording the end of a collective".into())
    }

    /// Make collectives stream `s` wait for `e` (recorded on another collectives stream: a
    /// collective of another mesh dim whose bytes this one touches).
    pub fn comm_wait_for(&self, s: usize, e: &Event) -> Result<(), CudaError> {
        // SAFETY: valid event and stream.
        check(unsafe { result::stream::wait_event(self.comm[s], e.0, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT) }, || {
            "ordering a collective after one of another stream".into()
        })
    }

    /// Make the compute stream wait for `e` (recorded on the collectives' stream).
    pub fn wait_for(&self, e: &Event) -> Result<(), CudaError> {
        // SAFETY: valid event and stream.
        check(unsafe { result::stream::wait_event(self.stream, e.0, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT) }, || {
            "ordering compute after a collective".into()
        })
    }

    /// The compute stream (`None`), or collectives stream `s`.
    pub fn stream_for(&self, comm: Option<usize>) -> sys::CUstream {
        comm.map_or(self.stream, |s| self.comm[s])
    }

    /// Copy `height` rows of `width` bytes from `src` (rows `src_pitch` bytes apart) to `dst`
    /// (rows `dst_pitch` apart), device to device, on collectives stream `comm` or (`None`) the
    /// compute stream.
    #[allow(clippy::too_many_arguments)]
    pub fn copy_2d(
        &self,
        comm: Option<usize>,
        dst: u64,
        dst_pitch: u64,
        src: u64,
        src_pitch: u64,
        width: u64,
        height: u64,
        what: impl FnOnce() -> String,
    ) -> Result<(), CudaError> {
        let c = sys::CUDA_MEMCPY2D {
            srcXInBytes: 0,
            srcY: 0,
            srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            srcHost: std::ptr::null(),
            srcDevice: src,
            srcArray: std::ptr::null_mut(),
            srcPitch: src_pitch as usize,
            dstXInBytes: 0,
            dstY: 0,
            dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            dstHost: std::ptr::null_mut(),
            dstDevice: dst,
            dstArray: std::ptr::null_mut(),
            dstPitch: dst_pitch as usize,
            WidthInBytes: width as usize,
            Height: height as usize,
        };
        // SAFETY: the ranges were checked against their buffers when the schedule was planned.
        check(unsafe { sys::cuMemcpy2DAsync_v2(&c, self.stream_for(comm)).result() }, what)
    }

    /// Fill `bytes` at `dst` with `value` on collectives stream `comm` or (`None`) the compute
    /// stream.
    pub fn memset_on(&self, comm: Option<usize>, dst: u64, value: u8, bytes: usize, what: impl FnOnce() -> String) -> Result<(), CudaError> {
        // SAFETY: the range was checked against its buffer when the schedule was planned.
        check(unsafe { result::memset_d8_async(dst, value, bytes, self.stream_for(comm)) }, what)
    }

    /// Make the context current on the calling thread (tests run on several threads).
    pub fn bind(&self) -> Result<(), CudaError> {
        // SAFETY: the context lives as long as `self`.
        check(unsafe { result::ctx::set_current(self.ctx) }, || "making the context current".into())
    }

    /// Compute capability `(major, minor)`.
    pub fn capability(&self) -> Result<(i32, i32), CudaError> {
        let get = |a| {
            // SAFETY: valid device and attribute.
            check(unsafe { result::device::get_attribute(self.dev, a) }, || "reading the compute capability".into())
        };
        Ok((
            get(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            get(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        ))
    }

    /// Wait for the stream.
    pub fn sync(&self, what: impl FnOnce() -> String) -> Result<(), CudaError> {
        // SAFETY: the stream lives as long as `self`.
        check(unsafe { result::stream::synchronize(self.stream) }, what)
    }

    /// Wait for all work of the context (every stream, and synchronous copies from pageable
    /// memory whose DMA may still be in flight when they return).
    pub fn sync_all(&self, what: impl FnOnce() -> String) -> Result<(), CudaError> {
        check(result::ctx::synchronize(), what)
    }

    /// Allocate `bytes` (at least 1) of device memory filled with `fill`.
    pub fn alloc(&self, bytes: u64, fill: u8, what: &str) -> Result<DeviceBuffer, CudaError> {
        let n =
            usize::try_from(bytes.max(1)).map_err(|_| CudaError::Call { what: what.into(), message: format!("{bytes} bytes do not fit the address space") })?;
        // SAFETY: a plain allocation; freed in Drop.
        let ptr = check(unsafe { result::malloc_sync(n) }, || format!("allocating {what} ({bytes} bytes)"))?;
        let buf = DeviceBuffer { ptr, bytes: n as u64 };
        // SAFETY: `ptr` holds `n` bytes.
        check(unsafe { result::memset_d8_sync(ptr, fill, n) }, || format!("filling {what}"))?;
        Ok(buf)
    }

    /// Load a PTX module (the driver JIT-compiles it) and look up `entry`.
    pub fn load_function(&self, ptx: &str, entry: &str, what: &str) -> Result<(Module, Function), CudaError> {
        let image =
            CString::new(ptx).map_err(|_| CudaError::Call { what: what.into(), message: "the PTX file contains a NUL byte; rebuild the artifact".into() })?;
        // SAFETY: `image` is a NUL-terminated PTX text.
        let module = Module(check(unsafe { result::module::load_data(image.as_ptr() as *const c_void) }, || format!("loading the PTX of {what}"))?);
        Self::lookup(module, entry, what, "PTX")
    }

    /// Load a cubin (an ELF image for this device's architecture; no JIT) and look up `entry`.
    pub fn load_cubin(&self, cubin: &[u8], entry: &str, what: &str) -> Result<(Module, Function), CudaError> {
        if !cubin.starts_with(b"\x7fELF") {
            return Err(CudaError::Call { what: what.into(), message: "the cubin is not an ELF image; rebuild the artifact".into() });
        }
        // The driver reads the ELF headers in place: copy the image to 8-byte-aligned storage.
        let mut words = vec![0u64; cubin.len().div_ceil(8)];
        for (w, chunk) in words.iter_mut().zip(cubin.chunks(8)) {
            let mut b = [0u8; 8];
            b[..chunk.len()].copy_from_slice(chunk);
            *w = u64::from_ne_bytes(b);
        }
        // SAFETY: `words` holds the whole ELF image (whose headers give its size) and outlives
        // the call; the driver copies what it keeps.
        let module = Module(check(unsafe { result::module::load_data(words.as_ptr() as *const c_void) }, || format!("loading the cubin of {what}"))?);
        Self::lookup(module, entry, what, "cubin")
    }

    fn lookup(module: Module, entry: &str, what: &str, kind: &str) -> Result<(Module, Function), CudaError> {
        let f = Self::function(&module, entry, what, kind)?;
        Ok((module, f))
    }

    /// Look up another entry of a loaded module (`kind` names the image in errors).
    pub fn function(module: &Module, entry: &str, what: &str, kind: &str) -> Result<Function, CudaError> {
        let name = CString::new(entry).map_err(|_| CudaError::Call { what: what.into(), message: format!("entry `{entry}` contains a NUL byte") })?;
        // SAFETY: `module` is loaded.
        let f = unsafe { result::module::get_function(module.0, name) }.map_err(|e| CudaError::Call {
            what: what.into(),
            message: format!("the {kind} has no entry `{entry}` ({}); the manifest and kernels/ disagree, rebuild the artifact", describe(e)),
        })?;
        Ok(Function(f))
    }

    /// Let `f` use `bytes` of dynamic shared memory (needed above 48 KiB).
    pub fn allow_shared(&self, f: &Function, bytes: u32, what: &str) -> Result<(), CudaError> {
        let attr = sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
        // SAFETY: `f` is a loaded function.
        check(unsafe { result::function::set_function_attribute(f.0, attr, bytes as i32) }, || {
            format!("{what}: allowing {bytes} bytes of dynamic shared memory")
        })
    }

    /// Launch `f` with one pointer argument per entry of `ptrs`.
    pub fn launch(&self, f: &Function, grid: [u32; 3], block: [u32; 3], shared: u32, ptrs: &[u64], what: impl FnOnce() -> String) -> Result<(), CudaError> {
        let mut vals: Vec<u64> = ptrs.to_vec();
        let mut params: Vec<*mut c_void> = vals.iter_mut().map(|p| p as *mut u64 as *mut c_void).collect();
        // SAFETY: every parameter is a device pointer the kernel ABI expects; `vals` outlives
        // the call (the driver copies the parameters at launch).
        let r = unsafe { result::launch_kernel(f.0, (grid[0], grid[1], grid[2]), (block[0], block[1], block[2]), shared, self.stream, &mut params) };
        check(r, what)
    }

    /// Host to device, asynchronous on the stream; `src` must stay alive until the stream syncs.
    pub fn upload(&self, dst: u64, src: &[u8], what: impl FnOnce() -> String) -> Result<(), CudaError> {
        // SAFETY: `dst` holds at least `src.len()` bytes (checked by the callers' plans).
        check(unsafe { result::memcpy_htod_async(dst, src, self.stream) }, what)
    }

    /// Host to device, returning once the bytes are on the device (`src` may be reused at
    /// once). Safe to call from several threads once each has [`Gpu::bind`]ed the context.
    pub fn upload_sync(&self, dst: u64, src: &[u8], what: impl FnOnce() -> String) -> Result<(), CudaError> {
        // SAFETY: `dst` holds at least `src.len()` bytes (checked by the callers' plans).
        check(unsafe { result::memcpy_htod_sync(dst, src) }, what)
    }

    /// `(free, total)` bytes of device memory (`cuMemGetInfo`, device-wide: it counts every
    /// process's allocations).
    pub fn mem_info(&self) -> Result<(u64, u64), CudaError> {
        let (free, total) = check(result::mem_get_info(), || "reading the free device memory".into())?;
        Ok((free as u64, total as u64))
    }

    /// Device to host, waiting for the stream first.
    pub fn download(&self, dst: &mut [u8], src: u64, what: impl FnOnce() -> String + Clone) -> Result<(), CudaError> {
        self.sync(what.clone())?;
        // SAFETY: `src` holds at least `dst.len()` bytes.
        check(unsafe { result::memcpy_dtoh_async(dst, src, self.stream) }, what.clone())?;
        self.sync(what)
    }

    pub fn copy(&self, dst: u64, src: u64, bytes: usize, what: impl FnOnce() -> String) -> Result<(), CudaError> {
        // SAFETY: both ranges were checked against their buffers when the schedule was planned.
        check(unsafe { result::memcpy_dtod_async(dst, src, bytes, self.stream) }, what)
    }

    pub fn memset(&self, dst: u64, value: u8, bytes: usize, what: impl FnOnce() -> String) -> Result<(), CudaError> {
        // SAFETY: the range was checked against its buffer when the schedule was planned.
        check(unsafe { result::memset_d8_async(dst, value, bytes, self.stream) }, what)
    }

    /// Start capturing the stream's work into a graph.
    pub fn begin_capture(&self) -> Result<(), CudaError> {
        // SAFETY: the stream is valid and not capturing.
        check(unsafe { result::stream::begin_capture(self.stream, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL) }, || {
            "starting the CUDA graph capture of the step".into()
        })
    }

    /// End the capture and instantiate the graph.
    pub fn end_capture(&self) -> Result<Graph, CudaError> {
        // SAFETY: the stream is capturing.
        let g = check(unsafe { result::stream::end_capture(self.stream) }, || "ending the CUDA graph capture of the step".into())?;
        // SAFETY: `g` is a valid graph; it is destroyed after instantiation.
        let exec = unsafe { result::graph::instantiate(g, sys::CUgraphInstantiate_flags(0)) };
        // SAFETY: the executable graph does not need the graph once instantiated.
        unsafe {
            let _ = result::graph::destroy(g);
        }
        Ok(Graph(check(exec, || "instantiating the CUDA graph of the step".into())?))
    }

    /// Replay a captured graph on the stream.
    pub fn replay(&self, g: &Graph) -> Result<(), CudaError> {
        // SAFETY: the graph and stream are valid.
        check(unsafe { result::graph::launch(g.0, self.stream) }, || "replaying the CUDA graph of the step".into())
    }

    /// Record an event on the stream.
    pub fn record(&self, e: &Event) -> Result<(), CudaError> {
        // SAFETY: both are valid.
        check(unsafe { result::event::record(e.0, self.stream) }, || "recording a timing event".into())
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        // SAFETY: the stream and the retained context are ours; errors at teardown are ignored.
        unsafe {
            let _ = result::ctx::set_current(self.ctx);
            let _ = result::stream::synchronize(self.stream);
            for &c in &self.comm {
                let _ = result::stream::synchronize(c);
            }
            let _ = result::stream::destroy(self.stream);
            for &c in &self.comm {
                let _ = result::stream::destroy(c);
            }
            let _ = result::primary_ctx::release(self.dev);
        }
    }
}

/// An owned device allocation.
pub struct DeviceBuffer {
    pub ptr: u64,
    pub bytes: u64,
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        // SAFETY: allocated by `Gpu::alloc`, freed once.
        unsafe {
            let _ = result::free_sync(self.ptr);
        }
    }
}

/// A loaded PTX module, unloaded on drop.
pub struct Module(sys::CUmodule);

impl Drop for Module {
    fn drop(&mut self) {
        // SAFETY: loaded by `Gpu::load_function`, unloaded once.
        unsafe {
            let _ = result::module::unload(self.0);
        }
    }
}

// SAFETY: a module handle belongs to the context, not to the thread that loaded it.
unsafe impl Send for Module {}

/// A kernel of a loaded module (valid while its [`Module`] is).
pub struct Function(sys::CUfunction);

// SAFETY: a function handle belongs to the context, not to the thread that looked it up.
unsafe impl Send for Function {}

/// An instantiated CUDA graph.
pub struct Graph(sys::CUgraphExec);

impl Drop for Graph {
    fn drop(&mut self) {
        // SAFETY: instantiated by `Gpu::end_capture`, destroyed once.
        unsafe {
            let _ = result::graph::exec_destroy(self.0);
        }
    }
}

/// A timing event.
pub struct Event(sys::CUevent);

impl Event {
    pub fn new() -> Result<Event, CudaError> {
        Ok(Event(check(result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT), || "creating a timing event".into())?))
    }

    /// Milliseconds from `self` to `end` (both recorded and complete).
    pub fn elapsed_ms(&self, end: &Event) -> Result<f32, CudaError> {
        // SAFETY: both events are valid.
        unsafe {
            check(result::event::synchronize(end.0), || "waiting for a timing event".into())?;
            check(result::event::elapsed(self.0, end.0), || "reading a timing event".into())
        }
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: created by `Event::new`, destroyed once.
        unsafe {
            let _ = result::event::destroy(self.0);
        }
    }
}
