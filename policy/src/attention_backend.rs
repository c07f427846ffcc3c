//! Which fused attention kernel libtorch runs on a CUDA GPU.
//!
//! PyTorch 2.11 prefers cuDNN's fused attention on recent GPUs (the `sdpa_sm80_flash`
//! kernels of cuDNN's generated graphs). cuDNN builds an execution plan for every new
//! shape and caches it; building one took 40–80 ms on an H200 (bench/README.md,
//! `prefix_cache`, session 27), while a call whose shape was seen before takes 0.06 ms.
//! Decoding meets a new key length at every step, and training a new batch shape at
//! almost every step, so under cuDNN every decoded token paid a plan: about 50 ms per
//! token whatever the model's size (28 layers or 2), where the kernels themselves need
//! well under a millisecond. With cuDNN's attention off, libtorch picks flash or
//! memory-efficient attention, or its math path where neither applies (an explicit mask
//! with grouped-query heads, as decoding uses): 0.03–0.4 ms per decode call on the same
//! GPU.
//!
//! So on the first attention on a CUDA device, Tutor turns cuDNN's attention backend off
//! for the process (`at::Context::setSDPUseCuDNN(false)`, what Python's
//! `torch.backends.cuda.enable_cudnn_sdp(False)` calls). `TUTOR_CUDNN_ATTENTION=1` keeps
//! libtorch's default, to compare. The setter is a C++ member function of libtorch's
//! global context, found at run time: a libtorch without it leaves the default and says
//! so once.

use std::ffi::c_void;
use std::sync::OnceLock;

use crate::packed::symbol;

/// `TUTOR_CUDNN_ATTENTION=1` keeps libtorch's default attention backends.
pub const CUDNN_ATTENTION_ENV: &str = "TUTOR_CUDNN_ATTENTION";

type GlobalContext = unsafe extern "C" fn() -> *mut c_void;
type SetFlag = unsafe extern "C" fn(*mut c_void, bool);
type GetFlag = unsafe extern "C" fn(*const c_void) -> bool;

struct Switch {
    context: *mut c_void,
    set: SetFlag,
    get: GetFlag,
}

// SAFETY: `context` is libtorch's process-wide `at::Context` (a static that lives as long
// as the library); its flag setters are what every thread of PyTorch calls.
unsafe impl Send for Switch {}
unsafe impl Sync for Switch {}

fn switch() -> Option<&'static Switch> {
    static SWITCH: OnceLock<Option<Switch>> = OnceLock::new();
    SWITCH
        .get_or_init(|| {
            // Itanium C++ ABI names of `at::globalContext()`,
            // `at::Context::setSDPUseCuDNN(bool)` and `at::Context::userEnabledCuDNNSDP()
            // const` (exported by libtorch_cpu.so; checked for 2.11).
            let global = symbol(c"_ZN2at13globalContextEv")?;
            let set = symbol(c"_ZN2at7Context14setSDPUseCuDNNEb")?;
            let get = symbol(c"_ZNK2at7Context19userEnabledCuDNNSDPEv")?;
            // SAFETY: the symbols are those functions. A non-virtual member function takes
            // `this` as its first argument in the Itanium ABI (x86-64 and aarch64), so
            // the C signatures above match; `globalContext` returns a reference, passed as
            // a pointer.
            unsafe {
                let global = std::mem::transmute::<*mut c_void, GlobalContext>(global);
                Some(Switch {
                    context: global(),
                    set: std::mem::transmute::<*mut c_void, SetFlag>(set),
                    get: std::mem::transmute::<*mut c_void, GetFlag>(get),
                })
            }
        })
        .as_ref()
}

fn turn_off(s: &Switch) {
    // SAFETY: see `switch`.
    unsafe { (s.set)(s.context, false) };
}

/// Whether libtorch may pick cuDNN's attention (`None`: this libtorch does not say).
pub fn cudnn_attention_enabled() -> Option<bool> {
    // SAFETY: see `switch`; the getter only reads the flag.
    switch().map(|s| unsafe { (s.get)(s.context) })
}

/// Turns cuDNN's attention off for this process unless `TUTOR_CUDNN_ATTENTION=1`; once.
/// Returns whether it is off.
pub fn avoid_cudnn_attention() -> bool {
    static DONE: OnceLock<bool> = OnceLock::new();
    *DONE.get_or_init(|| {
        let keep = std::env::var(CUDNN_ATTENTION_ENV).is_ok_and(|v| v.trim() == "1");
        if keep {
            tracing::info!(
                "{CUDNN_ATTENTION_ENV}=1: libtorch may pick cuDNN's attention, which builds a plan \
                 for every new sequence length (tens of milliseconds each)"
            );
            return false;
        }
        match switch() {
            Some(s) => {
                turn_off(s);
                tracing::debug!("cuDNN's attention backend is off (a plan per new shape costs more than the kernel)");
                true
            }
            None => {
                tracing::warn!(
                    "this libtorch does not export at::Context::setSDPUseCuDNN: cuDNN's attention \
                     stays on, and on a GPU where libtorch picks it every new sequence length \
                     costs a plan (tens of milliseconds)"
                );
                false
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(target_os = "linux")]
    #[test]
    fn cudnn_attention_is_switched_off_in_libtorchs_own_flag() {
        // The CPU build of libtorch carries the same global context and flag, so the
        // switch is checked here, where no GPU is; gpu_check reports it on a GPU. The
        // flag is set on first (another test's CUDA attention may have switched it off
        // already), so each step is seen to change it.
        let s = switch()
            .expect("libtorch exports at::globalContext, setSDPUseCuDNN and userEnabledCuDNNSDP");
        // SAFETY: see `switch`.
        unsafe { (s.set)(s.context, true) };
        assert_eq!(cudnn_attention_enabled(), Some(true));
        turn_off(s);
        assert_eq!(cudnn_attention_enabled(), Some(false));
        if std::env::var(CUDNN_ATTENTION_ENV).is_ok_and(|v| v.trim() == "1") {
            return;
        }
        // The once-only entry point leaves it off (whether it ran now or before).
        assert!(avoid_cudnn_attention());
        assert_eq!(cudnn_attention_enabled(), Some(false));
    }
}
