//! Client library used by `gpuctl`, the benchmarks and the tests: a list of replica endpoints,
//! retried in turn until one answers. Any replica accepts any call (followers forward to the
//! leader), so failing over is only a matter of trying the next endpoint.

use std::future::Future;
use std::time::Duration;

use proto::v1::control_plane_client::ControlPlaneClient;
use tonic::transport::Channel;
use tonic::{Response, Status};

use crate::raft::network::lazy_channel;

/// Replicas `gpuctl dev` starts, and where `gpuctl` looks when nothing else is configured.
pub const DEV_ENDPOINTS: &str = "127.0.0.1:7001,127.0.0.1:7002,127.0.0.1:7003";
/// Environment variable listing the endpoints, comma-separated.
pub const ENDPOINTS_ENV: &str = "GPUCTL_ENDPOINTS";

#[derive(Clone)]
pub struct Client {
    endpoints: Vec<String>,
    clients: Vec<ControlPlaneClient<Channel>>,
    /// The endpoint that answered last; tried first next time.
    preferred: usize,
    /// How long a call keeps retrying across endpoints before giving up.
    pub deadline: Duration,
    /// Limit for one attempt against one endpoint.
    pub attempt_timeout: Duration,
}

impl Client {
    pub fn new(endpoints: &[String]) -> anyhow::Result<Client> {
        if endpoints.is_empty() {
            anyhow::bail!("no control-plane endpoints given");
        }
        let mut clients = Vec::new();
        for e in endpoints {
            let channel = lazy_channel(e)
                .map_err(|err| anyhow::anyhow!("endpoint {e:?} is not HOST:PORT: {err}"))?;
            clients.push(
                ControlPlaneClient::new(channel).max_decoding_message_size(256 * 1024 * 1024),
            );
        }
        Ok(Client {
            endpoints: endpoints.to_vec(),
            clients,
            preferred: 0,
            deadline: Duration::from_secs(15),
            attempt_timeout: Duration::from_secs(5),
        })
    }

    pub fn parse_endpoints(s: &str) -> Vec<String> {
        s.split(',')
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .map(|e| e.trim_start_matches("http://").to_owned())
            .collect()
    }

    pub fn endpoints(&self) -> &[String] {
        &self.endpoints
    }

    /// A client for one endpoint only (no failover), e.g. to ask a specific replica.
    pub fn endpoint_client(&self, i: usize) -> ControlPlaneClient<Channel> {
        self.clients[i].clone()
    }

    /// Runs `call` against the endpoints until one succeeds or fails for a reason retrying
    /// cannot fix. Calls must be safe to repeat (submissions carry an idempotency key).
    pub async fn call<T, F, Fut>(&mut self, mut call: F) -> Result<T, Status>
    where
        F: FnMut(ControlPlaneClient<Channel>, Duration) -> Fut,
        Fut: Future<Output = Result<Response<T>, Status>>,
    {
        let start = tokio::time::Instant::now();
        // Short, capped backoff: during a failover the cluster is typically back within a few
        // hundred milliseconds, and a coarse backoff would add its own delay on top.
        let mut backoff = Duration::from_millis(5);
        let mut last: Option<Status> = None;
        loop {
            for k in 0..self.clients.len() {
                let i = (self.preferred + k) % self.clients.len();
                let fut = call(self.clients[i].clone(), self.attempt_timeout);
                match tokio::time::timeout(self.attempt_timeout, fut).await {
                    Ok(Ok(resp)) => {
                        self.preferred = i;
                        return Ok(resp.into_inner());
                    }
                    Ok(Err(status)) if retryable(&status) => last = Some(status),
                    Ok(Err(status)) => {
                        self.preferred = i;
                        return Err(status);
                    }
                    Err(_) => {
                        last = Some(Status::deadline_exceeded(format!(
                            "{} did not answer within {:?}",
                            self.endpoints[i], self.attempt_timeout
                        )))
                    }
                }
                if start.elapsed() >= self.deadline {
                    break;
                }
            }
            if start.elapsed() >= self.deadline {
                let last = last.map(|s| s.message().to_owned()).unwrap_or_default();
                return Err(Status::unavailable(format!(
                    "no replica of [{}] could serve the request within {:?}; last error: {last}",
                    self.endpoints.join(", "),
                    self.deadline
                )));
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_millis(50));
        }
    }
}

pub use proto::transport::retryable;

/// Sets a per-attempt timeout on a request.
pub fn with_timeout<T>(message: T, timeout: Duration) -> tonic::Request<T> {
    let mut r = tonic::Request::new(message);
    r.set_timeout(timeout);
    r
}
