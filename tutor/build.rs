// Binaries must find libtorch (and keep libtorch_cuda linked) without LD_LIBRARY_PATH:
// the linker drops libtorch_cuda unless told otherwise, so pin it with --no-as-needed
// and bake the library folder in as an rpath. DEP_TCH_LIBTORCH_LIB is only visible
// here because this crate depends on torch-sys directly.
fn main() {
    if let Ok(lib) = std::env::var("DEP_TCH_LIBTORCH_LIB") {
        println!("cargo:rustc-link-arg=-Wl,-rpath={lib}");
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
        println!("cargo:rustc-link-arg=-ltorch");
    }
}
