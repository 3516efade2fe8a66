//! gantry-proto owns gantry's own gRPC APIs, defined in `proto/` and generated at build
//! time. REAPI types come from `bazel-remote-apis` instead (re-exported by gantry-core).

pub mod batch {
    pub mod v1 {
        tonic::include_proto!("gantry.batch.v1");
    }
}

pub mod queue {
    pub mod v1 {
        tonic::include_proto!("gantry.queue.v1");
    }
}

pub mod worker {
    pub mod v1 {
        tonic::include_proto!("gantry.worker.v1");
    }
}

/// `google.rpc.PreconditionFailure`, for MISSING blob reports.
pub mod rpc {
    tonic::include_proto!("google.rpc");
}
