//! The agent's side of the connection to the control plane: unary calls that try each
//! replica in turn until one answers (followers forward to the leader), and the assignment
//! stream, which only the leader serves.
//!
//! Unary calls start at the replica that serves the assignment stream, when there is one:
//! that replica is the leader, and a report or heartbeat sent to a follower costs a second
//! TLS hop (the follower forwards it), which on a busy host is CPU taken from the jobs.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use proto::agent::agent_api_client::AgentApiClient;
use tonic::Status;
use tonic::transport::Channel;

#[derive(Clone)]
pub struct ControlPlane {
    endpoints: Vec<String>,
    clients: Vec<AgentApiClient<Channel>>,
    /// The replica that last answered a unary call of this copy.
    preferred: usize,
    /// The replica serving this agent's assignment stream, shared by every copy
    /// ([`NO_LEADER`] while none does).
    leader: Arc<AtomicUsize>,
}

const NO_LEADER: usize = usize::MAX;

use proto::tls::ExpectedPeer;
use proto::transport::Transport;
pub use proto::transport::{lazy_channel, retryable};

impl ControlPlane {
    pub fn new(endpoints: &[String], transport: &Transport) -> anyhow::Result<ControlPlane> {
        if endpoints.is_empty() {
            anyhow::bail!("no control-plane endpoints given (--control-plane HOST:PORT,...)");
        }
        let clients = endpoints
            .iter()
            .map(|e| {
                transport
                    .channel(e, ExpectedPeer::Replica)
                    .map(AgentApiClient::new)
                    .map_err(|err| {
                        anyhow::anyhow!("control-plane endpoint {e:?} is not HOST:PORT: {err}")
                    })
            })
            .collect::<anyhow::Result<_>>()?;
        Ok(ControlPlane {
            endpoints: endpoints.to_vec(),
            clients,
            preferred: 0,
            leader: Arc::new(AtomicUsize::new(NO_LEADER)),
        })
    }

    /// One round over the replicas, each attempt bounded by `timeout`; the last error if none
    /// answered. Callers retry rounds at their own pace (heartbeats, reports).
    pub async fn call<T, F, Fut>(&mut self, timeout: Duration, mut call: F) -> Result<T, Status>
    where
        F: FnMut(AgentApiClient<Channel>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, Status>>,
    {
        let mut last = Status::unavailable("no control-plane replica answered");
        let first = match self.leader.load(Ordering::Relaxed) {
            NO_LEADER => self.preferred,
            leader => leader,
        };
        for k in 0..self.clients.len() {
            let i = (first + k) % self.clients.len();
            match tokio::time::timeout(timeout, call(self.clients[i].clone())).await {
                Ok(Ok(resp)) => {
                    self.preferred = i;
                    return Ok(resp.into_inner());
                }
                Ok(Err(s)) if retryable(&s) => last = s,
                Ok(Err(s)) => {
                    self.preferred = i;
                    return Err(s);
                }
                Err(_) => {
                    last = Status::deadline_exceeded(format!(
                        "{} did not answer in {timeout:?}",
                        self.endpoints[i]
                    ))
                }
            }
        }
        Err(last)
    }

    /// Clients for every replica, by index into the endpoints, preferred first (the leader
    /// serves assignment streams).
    pub fn rotation(&self) -> Vec<(usize, String, AgentApiClient<Channel>)> {
        (0..self.clients.len())
            .map(|k| (self.preferred + k) % self.clients.len())
            .map(|i| (i, self.endpoints[i].clone(), self.clients[i].clone()))
            .collect()
    }

    /// Records that replica `index` serves the assignment stream (it leads), or with `None`
    /// that the stream ended: unary calls of every copy start there.
    pub fn set_leader(&self, index: Option<usize>) {
        self.leader
            .store(index.unwrap_or(NO_LEADER), Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use std::pin::Pin;
    use std::sync::atomic::AtomicU32;

    use futures::Stream;
    use proto::agent as pa;
    use proto::agent::agent_api_server::{AgentApi, AgentApiServer};
    use tonic::{Request, Response};

    use super::*;

    /// A replica that answers reports and counts them.
    #[derive(Clone, Default)]
    struct CountingReplica {
        reports: Arc<AtomicU32>,
    }

    type NoStream = Pin<Box<dyn Stream<Item = Result<pa::Assignments, Status>> + Send>>;

    #[tonic::async_trait]
    impl AgentApi for CountingReplica {
        async fn register_node(
            &self,
            _: Request<pa::RegisterNodeRequest>,
        ) -> Result<Response<pa::RegisterNodeResponse>, Status> {
            Err(Status::unimplemented("not in this test"))
        }
        async fn heartbeat(
            &self,
            _: Request<pa::HeartbeatRequest>,
        ) -> Result<Response<pa::HeartbeatResponse>, Status> {
            Err(Status::unimplemented("not in this test"))
        }
        type WatchAssignmentsStream = NoStream;
        async fn watch_assignments(
            &self,
            _: Request<pa::WatchAssignmentsRequest>,
        ) -> Result<Response<NoStream>, Status> {
            Err(Status::unimplemented("not in this test"))
        }
        async fn report_allocation(
            &self,
            _: Request<pa::AllocationReport>,
        ) -> Result<Response<pa::ReportResponse>, Status> {
            self.reports.fetch_add(1, Ordering::SeqCst);
            Ok(Response::new(pa::ReportResponse {}))
        }
        async fn report_gpu_health(
            &self,
            _: Request<pa::GpuHealthReport>,
        ) -> Result<Response<pa::ReportResponse>, Status> {
            Err(Status::unimplemented("not in this test"))
        }
    }

    async fn serve(replica: CountingReplica) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(AgentApiServer::new(replica))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        addr
    }

    async fn report(control: &mut ControlPlane) {
        control
            .call(Duration::from_secs(10), |mut c| async move {
                c.report_allocation(pa::AllocationReport::default()).await
            })
            .await
            .expect("a replica answers");
    }

    /// Reports go where the assignment stream is (the leader), from every copy of the
    /// connection, and back to the last replica that answered once the stream ends.
    #[tokio::test]
    async fn unary_calls_start_at_the_replica_serving_assignments() {
        let replicas = [CountingReplica::default(), CountingReplica::default()];
        let mut endpoints = Vec::new();
        for r in &replicas {
            endpoints.push(serve(r.clone()).await);
        }
        let counts = || {
            replicas
                .each_ref()
                .map(|r| r.reports.load(Ordering::SeqCst))
        };
        let mut reports = ControlPlane::new(&endpoints, &Transport::Plain).unwrap();
        let assignments = reports.clone();

        report(&mut reports).await;
        assert_eq!(counts(), [1, 0], "with no leader known, the first endpoint");

        assignments.set_leader(Some(1));
        report(&mut reports).await;
        report(&mut reports.clone()).await;
        assert_eq!(counts(), [1, 2], "every copy follows the assignment stream");

        assignments.set_leader(None);
        report(&mut reports).await;
        assert_eq!(
            counts(),
            [1, 3],
            "the stream ended: the replica that answered last"
        );
    }
}
