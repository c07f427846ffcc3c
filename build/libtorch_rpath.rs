// The crate's test binaries must find libtorch without LD_LIBRARY_PATH: bake the library
// folder in as an rpath (and keep libtorch, hence libtorch_cuda, linked with --no-as-needed).
// DEP_TCH_LIBTORCH_LIB is only visible here because this crate depends on torch-sys directly.
// Shared by every crate whose binaries (the CLI, test binaries) link tch: each names this
// file as its `build` script. Link args apply to the package's own binaries only.
fn main() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    if let Ok(lib) = std::env::var("DEP_TCH_LIBTORCH_LIB") {
        println!("cargo:rustc-link-arg=-Wl,-rpath={lib}");
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
        println!("cargo:rustc-link-arg=-ltorch");
    }
}
