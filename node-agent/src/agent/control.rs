//! The agent's side of the connection to the control plane: unary calls that try each
//! replica in turn until one answers (followers forward to the leader), and the assignment
//! stream, which only the leader serves.

use std::time::Duration;

use proto::agent::agent_api_client::AgentApiClient;
use tonic::Status;
use tonic::transport::Channel;

#[derive(Clone)]
pub struct ControlPlane {
    endpoints: Vec<String>,
    clients: Vec<AgentApiClient<Channel>>,
    preferred: usize,
}

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
        for k in 0..self.clients.len() {
            let i = (self.preferred + k) % self.clients.len();
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

    /// Clients for every replica, preferred first (the leader serves assignment streams).
    pub fn rotation(&self) -> Vec<(String, AgentApiClient<Channel>)> {
        (0..self.clients.len())
            .map(|k| (self.preferred + k) % self.clients.len())
            .map(|i| (self.endpoints[i].clone(), self.clients[i].clone()))
            .collect()
    }
}
