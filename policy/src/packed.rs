//! Matrix products against weights packed once for generation on the CPU: into MKL's
//! internal panel format (`cblas_sgemm_pack` / `cblas_sgemm_compute`) on Intel processors,
//! into Tutor's own panels (`panels.rs`) elsewhere, where MKL's kernels re-copy the
//! weights on every product ([`backend`]; `TUTOR_DECODE_GEMM=mkl|tutor` overrides).
//!
//! A decode step multiplies a few rows (one per sequence in the batch) by every
//! projection matrix, so its time is spent streaming the weights. MKL's ordinary `sgemm`
//! re-reads each matrix in its stored layout and re-packs panels of it on every call;
//! with the matrix packed once up front the product reads one contiguous stream. The
//! policy bench's model at batch 8, one thread: the 29 products of a decode step take
//! ~3.3 ms packed against ~5 ms through `linear` and ~7.3 ms with the matrices stored
//! transposed, on the 2026-11-22 project machine (see bench/README.md).
//!
//! The symbols are the ones the PyTorch wheel's `libtorch_cpu.so` exports (its MKL is
//! linked in statically). They are looked up at run time, so a libtorch built without
//! MKL (another CPU architecture, a source build) still links and packs into Tutor's
//! panels where the CPU has AVX2 and FMA, or not at all. `TUTOR_PACK_WEIGHTS=0` in the
//! environment turns packing off.
//!
//! The packed copy is an inference-only snapshot: it does not follow later writes to the
//! weight tensor and has no autograd. [`crate::Policy`] re-packs after loading weights,
//! drops the packs when its var store is handed out mutably, and its layers use a pack
//! only while gradient tracking is off (`tch::no_grad`, as generation runs).

use std::alloc::{self, Layout};
use std::ffi::{c_int, c_void, CStr};
use std::ptr::NonNull;
use std::sync::OnceLock;

use tch::{Device, Kind, Tensor};

// CBLAS enumerations (mkl_cblas.h).
const ROW_MAJOR: c_int = 101;
const NO_TRANS: c_int = 111;
const TRANS: c_int = 112;
const PACKED: c_int = 151;
const B_MATRIX: c_int = 162;

/// `TUTOR_PACK_WEIGHTS=0` turns packing off (to compare, or to save the packed copy's
/// memory); read once per process.
const DISABLE_ENV: &str = "TUTOR_PACK_WEIGHTS";

/// Rows the packing is planned for (MKL takes an `m`; any `m` may use the result).
const PLANNED_ROWS: c_int = 8;

type GetSize = unsafe extern "C" fn(c_int, c_int, c_int, c_int) -> usize;
type Pack = unsafe extern "C" fn(
    c_int,
    c_int,
    c_int,
    c_int,
    c_int,
    c_int,
    f32,
    *const f32,
    c_int,
    *mut f32,
);
type Compute = unsafe extern "C" fn(
    c_int,
    c_int,
    c_int,
    c_int,
    c_int,
    c_int,
    *const f32,
    c_int,
    *const f32,
    c_int,
    f32,
    *mut f32,
    c_int,
);

struct Mkl {
    get_size: GetSize,
    pack: Pack,
    compute: Compute,
}

/// MKL's packed-product entry points, when the loaded libtorch exports them.
fn mkl() -> Option<&'static Mkl> {
    static MKL: OnceLock<Option<Mkl>> = OnceLock::new();
    MKL.get_or_init(|| {
        let get_size = symbol(c"cblas_sgemm_pack_get_size")?;
        let pack = symbol(c"cblas_sgemm_pack")?;
        let compute = symbol(c"cblas_sgemm_compute")?;
        // SAFETY: these are MKL's LP64 CBLAS functions with the signatures above
        // (mkl_cblas.h; `MKL_INT` is a 32-bit int in the LP64 interface the wheel uses).
        unsafe {
            Some(Mkl {
                get_size: std::mem::transmute::<*mut c_void, GetSize>(get_size),
                pack: std::mem::transmute::<*mut c_void, Pack>(pack),
                compute: std::mem::transmute::<*mut c_void, Compute>(compute),
            })
        }
    })
    .as_ref()
}

#[cfg(target_os = "linux")]
pub(crate) fn symbol(name: &CStr) -> Option<*mut c_void> {
    // SAFETY: dlsym with RTLD_DEFAULT searches the libraries already loaded (libtorch is
    // one of the binary's own dependencies); it has no other effect.
    let ptr = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) };
    (!ptr.is_null()).then_some(ptr)
}

#[cfg(not(target_os = "linux"))]
pub(crate) fn symbol(_name: &CStr) -> Option<*mut c_void> {
    None
}

/// Whether weights can be packed here (MKL's packed products are available).
#[cfg(test)]
pub(crate) fn available() -> bool {
    mkl().is_some()
}

/// Which packed format, and so which product, generation uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Backend {
    /// MKL's own format and `cblas_sgemm_compute`.
    Mkl,
    /// Tutor's panels and kernel (`panels.rs`).
    Panels,
}

/// `TUTOR_DECODE_GEMM=mkl|tutor` picks the backend (to compare); unset, MKL on Intel
/// processors and Tutor's kernel elsewhere (MKL's kernels for other vendors re-copy the
/// weights on every product, see `panels.rs`).
const BACKEND_ENV: &str = "TUTOR_DECODE_GEMM";

/// The backend packing uses in this process (`None`: no packing); decided once.
pub(crate) fn backend() -> Option<Backend> {
    static BACKEND: OnceLock<Option<Backend>> = OnceLock::new();
    *BACKEND.get_or_init(|| {
        if std::env::var_os(DISABLE_ENV).is_some_and(|v| v == "0") {
            tracing::info!("{DISABLE_ENV}=0: generation on the CPU uses unpacked weights");
            return None;
        }
        let (mkl, panels) = (mkl().is_some(), crate::panels::supported());
        let chosen = match std::env::var(BACKEND_ENV).ok().as_deref() {
            Some("mkl") => mkl.then_some(Backend::Mkl),
            Some("tutor") => panels.then_some(Backend::Panels),
            Some(other) if !other.is_empty() => {
                tracing::warn!(
                    value = other,
                    "{BACKEND_ENV} is `mkl` or `tutor`; choosing by CPU"
                );
                None
            }
            _ => None,
        }
        .or(match (mkl, panels) {
            (true, true) if intel_cpu() => Some(Backend::Mkl),
            (_, true) => Some(Backend::Panels),
            (true, false) => Some(Backend::Mkl),
            (false, false) => None,
        });
        tracing::debug!(backend = ?chosen, "packed weights for generation on the CPU");
        chosen
    })
}

/// Whether the CPU's vendor string says Intel.
fn intel_cpu() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        #[allow(unused_unsafe)]
        // SAFETY: CPUID leaf 0 exists on every x86-64 processor.
        let id = unsafe { std::arch::x86_64::__cpuid(0) };
        let mut vendor = Vec::with_capacity(12);
        for r in [id.ebx, id.edx, id.ecx] {
            vendor.extend_from_slice(&r.to_le_bytes());
        }
        vendor == b"GenuineIntel"
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Rows Tutor's kernel takes in one product (in blocks of 8, one pass over the weights
/// each); longer inputs (a long prompt's prefill) go to the ordinary product, which is
/// compute-bound there.
const PANEL_MAX_ROWS: i64 = 32;

/// A float32 weight `W` `[out, in]` packed for products `x · Wᵀ`.
pub(crate) struct PackedMatrix {
    repr: Repr,
    out_dim: c_int,
    in_dim: c_int,
}

enum Repr {
    Mkl(MklBuffer),
    Panels(Vec<f32>),
}

/// MKL's buffer. MKL's packed format must not move once written, so it is allocated
/// here and never reallocated. Most of its reserved size is workspace MKL does not
/// touch, which costs address space, not memory: about one more copy of the weight
/// is resident.
struct MklBuffer {
    buf: NonNull<u8>,
    layout: Layout,
}

// SAFETY: the buffer is owned by this value, written only in `PackedMatrix::new`, and
// read-only after (MKL's compute reads the packed matrix and writes only the output).
unsafe impl Send for MklBuffer {}
unsafe impl Sync for MklBuffer {}

impl Drop for MklBuffer {
    fn drop(&mut self) {
        // SAFETY: allocated in `PackedMatrix::new` with this layout.
        unsafe { alloc::dealloc(self.buf.as_ptr(), self.layout) }
    }
}

impl PackedMatrix {
    /// Packs `weight` (`[out, in]`, float32, on the CPU, any strides) for this process's
    /// [`backend`]. `None` when there is none or the matrix does not qualify.
    pub(crate) fn new(weight: &Tensor) -> Option<Self> {
        Self::with_backend(weight, backend()?)
    }

    pub(crate) fn with_backend(weight: &Tensor, backend: Backend) -> Option<Self> {
        if weight.device() != Device::Cpu || weight.kind() != Kind::Float || weight.dim() != 2 {
            return None;
        }
        let (out_dim, in_dim) = weight.size2().ok()?;
        let (out_dim, in_dim) = (
            c_int::try_from(out_dim).ok()?,
            c_int::try_from(in_dim).ok()?,
        );
        if out_dim == 0 || in_dim == 0 {
            return None;
        }
        let w = weight.contiguous();
        if backend == Backend::Panels {
            if !crate::panels::supported() {
                return None;
            }
            let n = out_dim as usize * in_dim as usize;
            // SAFETY: `w` is a contiguous float32 CPU tensor of `n` elements, alive here.
            let data = unsafe { std::slice::from_raw_parts(w.data_ptr() as *const f32, n) };
            return Some(PackedMatrix {
                repr: Repr::Panels(crate::panels::pack(data, out_dim as usize, in_dim as usize)),
                out_dim,
                in_dim,
            });
        }
        let mkl = mkl()?;
        // Row-major `[out, in]` is `Bᵀ` with leading dimension `in`.
        // SAFETY: plain size query.
        let size = unsafe { (mkl.get_size)(B_MATRIX, PLANNED_ROWS, out_dim, in_dim) };
        let layout = Layout::from_size_align(size.max(64), 64).ok()?;
        // SAFETY: the layout has a nonzero size.
        let buf = NonNull::new(unsafe { alloc::alloc(layout) })?;
        // SAFETY: `w` is a contiguous float32 `[out, in]` CPU tensor alive for the call;
        // `buf` has the size MKL asked for.
        unsafe {
            (mkl.pack)(
                ROW_MAJOR,
                B_MATRIX,
                TRANS,
                PLANNED_ROWS,
                out_dim,
                in_dim,
                1.0,
                w.data_ptr() as *const f32,
                in_dim,
                buf.as_ptr() as *mut f32,
            );
        }
        Some(PackedMatrix {
            repr: Repr::Mkl(MklBuffer { buf, layout }),
            out_dim,
            in_dim,
        })
    }

    /// `x · Wᵀ` for `x` `[..., in]` (float32, on the CPU): `[..., out]`. `None` for input
    /// this cannot take (another kind or device, or more rows than a C int counts).
    pub(crate) fn matmul_t(&self, x: &Tensor) -> Option<Tensor> {
        if x.device() != Device::Cpu || x.kind() != Kind::Float {
            return None;
        }
        let mut shape = x.size();
        assert_eq!(
            shape.pop(),
            Some(self.in_dim as i64),
            "input's last dimension must be the matrix's input size"
        );
        let rows = shape.iter().product::<i64>();
        shape.push(self.out_dim as i64);
        let mkl_rows = match &self.repr {
            Repr::Panels(_) if rows > PANEL_MAX_ROWS => return None,
            Repr::Panels(_) => 0,
            Repr::Mkl(_) => c_int::try_from(rows).ok()?,
        };
        let x = x.contiguous();
        let out = Tensor::empty(shape.as_slice(), (Kind::Float, Device::Cpu));
        // SAFETY (both arms): `x` is a contiguous float32 `[rows, in]` and `out` a fresh
        // contiguous float32 `[rows, out]` CPU tensor, both alive for the call.
        match &self.repr {
            // The panels exist only where the kernel runs (`with_backend`).
            Repr::Panels(p) => unsafe {
                crate::panels::matmul_t(
                    x.data_ptr() as *const f32,
                    rows as usize,
                    self.in_dim as usize,
                    p,
                    self.out_dim as usize,
                    out.data_ptr() as *mut f32,
                );
            },
            // `buf` holds this matrix packed by `with_backend`.
            Repr::Mkl(b) if mkl_rows > 0 => unsafe {
                (mkl()?.compute)(
                    ROW_MAJOR,
                    NO_TRANS,
                    PACKED,
                    mkl_rows,
                    self.out_dim,
                    self.in_dim,
                    x.data_ptr() as *const f32,
                    self.in_dim,
                    b.buf.as_ptr() as *const f32,
                    self.out_dim,
                    0.0,
                    out.data_ptr() as *mut f32,
                    self.out_dim,
                );
            },
            Repr::Mkl(_) => {}
        }
        Some(out)
    }
}

/// Whether autograd is recording (packed products have no backward).
pub(crate) fn grad_enabled() -> bool {
    // SAFETY: reads and restores the thread's grad mode.
    unsafe {
        let previous = torch_sys::at_grad_set_enabled(0);
        torch_sys::at_grad_set_enabled(previous);
        previous != 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The PyTorch wheel this project installs ships MKL on x86-64 Linux: packing must
    /// be there, or the CPU engine silently loses its fast path.
    #[test]
    #[cfg(all(target_os = "linux", target_arch = "x86_64"))]
    fn the_wheels_mkl_is_found() {
        assert!(
            available(),
            "cblas_sgemm_pack not found in the loaded libtorch"
        );
    }

    #[test]
    fn packed_products_equal_plain_ones() {
        let backends: Vec<Backend> = [
            available().then_some(Backend::Mkl),
            crate::panels::supported().then_some(Backend::Panels),
        ]
        .into_iter()
        .flatten()
        .collect();
        tch::manual_seed(3);
        for (out_dim, in_dim) in [(1024, 384), (384, 1024), (7, 5), (130, 33), (4096, 64)] {
            let w = Tensor::randn([out_dim, in_dim], (Kind::Float, Device::Cpu));
            // Also from a transposed layout (the one `use_decode_layout` falls back to).
            let w_t = w.transpose(0, 1).contiguous().transpose(0, 1);
            for (weight, &backend) in backends.iter().flat_map(|b| [(&w, b), (&w_t, b)]) {
                let p = PackedMatrix::with_backend(weight, backend).expect("packs");
                for shape in [
                    vec![1, in_dim],
                    vec![8, in_dim],
                    vec![2, 20, in_dim],
                    vec![3, in_dim],
                    vec![2, 17, in_dim],
                ] {
                    let x = Tensor::randn(shape.as_slice(), (Kind::Float, Device::Cpu));
                    let rows: i64 = shape[..shape.len() - 1].iter().product();
                    let Some(got) = p.matmul_t(&x) else {
                        assert!(
                            backend == Backend::Panels && rows > PANEL_MAX_ROWS,
                            "{backend:?} declined {shape:?}"
                        );
                        continue;
                    };
                    let want = x.matmul(&w.transpose(0, 1));
                    assert_eq!(got.size(), want.size());
                    let scale = want.abs().max().double_value(&[]);
                    let diff = (got - &want).abs().max().double_value(&[]);
                    assert!(
                        diff <= 1e-5 * scale.max(1.0),
                        "{out_dim}x{in_dim}, x {shape:?}: off by {diff} (scale {scale})"
                    );
                }
                // A strided input is made contiguous first.
                let x = Tensor::randn([in_dim, 4], (Kind::Float, Device::Cpu)).transpose(0, 1);
                let diff = (p.matmul_t(&x).unwrap() - x.matmul(&w.transpose(0, 1)))
                    .abs()
                    .max()
                    .double_value(&[]);
                assert!(diff < 1e-3, "strided input off by {diff}");
                // No rows: an empty result of the right shape.
                let empty = Tensor::zeros([0, in_dim], (Kind::Float, Device::Cpu));
                assert_eq!(p.matmul_t(&empty).unwrap().size(), [0, out_dim]);
            }
        }
    }

    #[test]
    fn other_kinds_are_declined() {
        let w = Tensor::randn([8, 4], (Kind::Double, Device::Cpu));
        assert!(PackedMatrix::new(&w).is_none());
        if let Some(p) = PackedMatrix::new(&w.to_kind(Kind::Float)) {
            assert!(p
                .matmul_t(&Tensor::ones([2, 4], (Kind::Double, Device::Cpu)))
                .is_none());
        }
    }

    #[test]
    fn grad_mode_is_read_without_changing_it() {
        assert!(grad_enabled());
        tch::no_grad(|| {
            assert!(!grad_enabled());
            assert!(!grad_enabled());
        });
        assert!(grad_enabled());
    }
}
