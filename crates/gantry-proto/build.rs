//! Compiles proto/ with protox (a pure-Rust protobuf compiler) so building gantry never
//! needs a system `protoc`, then generates prost messages and tonic services.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = [
        "gantry/batch/v1/batch.proto",
        "gantry/worker/v1/worker.proto",
        "gantry/queue/v1/queue.proto",
        "google/rpc/error_details.proto",
        "google/devtools/build/v1/build_status.proto",
        "google/devtools/build/v1/build_events.proto",
        "google/devtools/build/v1/publish_build_event.proto",
        "build_event_stream/build_event_stream.proto",
    ];
    let fds = protox::compile(protos, ["proto"])?;
    tonic_prost_build::configure().compile_fds(fds)?;
    println!("cargo:rerun-if-changed=proto");
    Ok(())
}
