//! Traces leave the replica over OTLP: a stand-in OpenTelemetry collector (the real OTLP/gRPC
//! service definition) receives the spans of an RPC, a Raft write and an apply.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use control_plane::local_cluster::free_ports;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use tonic::{Request, Response, Status};

use crate::util::*;

#[derive(Clone, Default)]
struct Collector {
    spans: Arc<Mutex<Vec<String>>>,
}

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: Request<ExportTraceServiceRequest>,
    ) -> Result<Response<ExportTraceServiceResponse>, Status> {
        let mut spans = self.spans.lock().unwrap();
        for rs in &request.get_ref().resource_spans {
            for ss in &rs.scope_spans {
                spans.extend(ss.spans.iter().map(|s| s.name.clone()));
            }
        }
        Ok(Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_are_exported_to_an_otlp_collector() {
    let port = free_ports(1).unwrap()[0];
    let collector = Collector::default();
    let server = tonic::transport::Server::builder()
        .add_service(TraceServiceServer::new(collector.clone()))
        .serve(format!("127.0.0.1:{port}").parse().unwrap());
    let server = tokio::spawn(server);

    step("a one-replica cluster exporting traces, with debug spans enabled");
    let endpoint = format!("http://127.0.0.1:{port}");
    let mut c = describe(1, &["--otlp-endpoint", &endpoint]);
    // Raft write and apply spans are at debug level.
    c.env.push((
        "RUST_LOG".into(),
        "info,control_plane=debug,openraft=off".into(),
    ));
    c.start_all().unwrap();
    c.wait_for_leader(LEADER_TIMEOUT).await.unwrap();
    let mut client = c.client().unwrap();
    submit(&mut client, spec("traced", 1), "").await.unwrap();

    step("stopping the replica flushes its spans");
    let status = c.stop(1, Duration::from_secs(10)).unwrap();
    assert!(
        status.is_some_and(|s| s.success()),
        "replica did not stop cleanly:\n{}",
        c.log(1)
    );
    let spans = collector.spans.lock().unwrap().clone();
    for want in ["rpc.SubmitJob", "raft.write", "raft.apply"] {
        assert!(
            spans.iter().any(|s| s == want),
            "no {want:?} span among {spans:?}"
        );
    }
    server.abort();
}
