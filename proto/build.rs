// Generates the tutor.v1 client and server code from proto/tutor/v1 without a system protoc.
fn main() {
    let files = [
        "tutor/v1/common.proto",
        "tutor/v1/rollout.proto",
        "tutor/v1/learner.proto",
        "tutor/v1/weights.proto",
        "tutor/v1/control.proto",
    ];
    for f in &files {
        println!("cargo:rerun-if-changed={f}");
    }
    let fds = protox::compile(files, ["."]).expect("compiling proto/tutor/v1");
    tonic_prost_build::configure()
        .compile_fds(fds)
        .expect("generating tutor.v1 code");
}
