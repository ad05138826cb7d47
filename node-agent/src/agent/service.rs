//! The agent's own gRPC API: job logs for `gpuctl logs`, in-place restarts and what runs
//! (`gpuctl node restart-agent`), and fault injection on simulated hosts for tests and chaos
//! runs.

use std::io::{Read, Seek, SeekFrom};
use std::sync::Arc;

use proto::agent as pa;
use proto::agent::node_agent_server::NodeAgent;
use tonic::{Request, Response, Status};

use super::{Agent, RELEASE};
use crate::gpu::GpuEvent;

/// Most bytes of each stream one ReadLogs returns.
const MAX_LOG_BYTES: u64 = 1024 * 1024;

pub struct NodeAgentService {
    agent: Arc<Agent>,
}

impl NodeAgentService {
    pub fn new(agent: Arc<Agent>) -> Self {
        NodeAgentService { agent }
    }

    /// Only replicas call an agent (gpuctl reaches logs and fault injection through the
    /// control plane, which checks the caller first). The TLS layer already required a
    /// certificate of the cluster's CA; this checks its role.
    fn require_replica<T>(&self, request: &Request<T>) -> Result<(), Status> {
        if self.agent.config.transport.tls().is_none() {
            return Ok(());
        }
        let info = request.extensions().get::<proto::tls::ConnInfo>();
        match info.and_then(|i| i.peer.as_deref()) {
            Some(p) if p.role == proto::tls::CertRole::Replica => Ok(()),
            other => {
                let who = other.map_or_else(
                    || "a caller without a certificate".to_owned(),
                    |p| p.to_string(),
                );
                tracing::warn!(
                    remote = ?info.and_then(|i| i.remote),
                    "refused a call from {who}: the agent takes calls from replicas only"
                );
                Err(Status::permission_denied(format!(
                    "node {}'s agent takes calls from control-plane replicas only, not from {who}; use gpuctl, which goes through the control plane",
                    self.agent.config.name
                )))
            }
        }
    }
}

/// A log's last `bytes` (0: up to [`MAX_LOG_BYTES`]), or with `from`, what it holds from
/// that offset on (up to [`MAX_LOG_BYTES`]); and the offset after what was read (where a
/// follower reads next). A missing log is empty.
fn read_log(
    path: &std::path::Path,
    bytes: u64,
    from: Option<u64>,
) -> Result<(Vec<u8>, u64), Status> {
    let f = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((Vec::new(), 0)),
        Err(e) => return Err(Status::internal(format!("reading {}: {e}", path.display()))),
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let start = match from {
        Some(offset) => offset.min(len),
        None if bytes == 0 => len.saturating_sub(MAX_LOG_BYTES),
        None => len.saturating_sub(bytes.min(MAX_LOG_BYTES)),
    };
    let mut f = f;
    f.seek(SeekFrom::Start(start))
        .map_err(|e| Status::internal(e.to_string()))?;
    let mut out = Vec::new();
    // A log still being written may grow meanwhile: read what was there when measured.
    f.take(MAX_LOG_BYTES.min(len - start))
        .read_to_end(&mut out)
        .map_err(|e| Status::internal(e.to_string()))?;
    let next = start + out.len() as u64;
    Ok((out, next))
}

#[tonic::async_trait]
impl NodeAgent for NodeAgentService {
    async fn read_logs(
        &self,
        request: Request<pa::ReadLogsRequest>,
    ) -> Result<Response<pa::ReadLogsResponse>, Status> {
        self.require_replica(&request)?;
        let req = request.into_inner();
        let (allocation, paths) = {
            let st = self.agent.lock();
            // A replica names the task's allocation while it is live (it checked the caller
            // and that the allocation is the job's); otherwise the job's latest here.
            if req.allocation_id != 0 {
                let paths = st.runtime.log_paths(req.allocation_id);
                if !paths.0.exists() && !paths.1.exists() {
                    return Err(Status::not_found(format!(
                        "allocation {} of job {} left no logs on node {}",
                        req.allocation_id, req.job_id, self.agent.config.name
                    )));
                }
                (req.allocation_id, paths)
            } else {
                let Some(alloc) = st.job_allocations.get(&req.job_id).copied() else {
                    return Err(Status::not_found(format!(
                        "job {} has not run on node {}",
                        req.job_id, self.agent.config.name
                    )));
                };
                (alloc, st.runtime.log_paths(alloc))
            }
        };
        let (stdout, stdout_size) = read_log(&paths.0, req.tail_bytes, req.stdout_from)?;
        let (stderr, stderr_size) = read_log(&paths.1, req.tail_bytes, req.stderr_from)?;
        Ok(Response::new(pa::ReadLogsResponse {
            stdout,
            stderr,
            allocation_id: allocation,
            stdout_size,
            stderr_size,
        }))
    }

    async fn inject_fault(
        &self,
        request: Request<pa::InjectFaultRequest>,
    ) -> Result<Response<pa::InjectFaultResponse>, Status> {
        self.require_replica(&request)?;
        let Some(sim) = &self.agent.simulated else {
            return Err(Status::failed_precondition(format!(
                "node {} runs real GPUs; faults can only be injected on simulated hosts",
                self.agent.config.name
            )));
        };
        let req = request.into_inner();
        let gpu = self
            .agent
            .inventory
            .gpus
            .iter()
            .find(|g| g.index == req.gpu_index)
            .ok_or_else(|| {
                Status::invalid_argument(format!(
                    "gpu_index: this host has no GPU {}",
                    req.gpu_index
                ))
            })?;
        let gpu_uuid = gpu.uuid.clone();
        let event = match req.fault {
            Some(pa::inject_fault_request::Fault::Xid(code)) => GpuEvent::Xid {
                gpu_uuid: gpu_uuid.clone(),
                code,
                detail: format!("injected Xid {code}"),
            },
            Some(pa::inject_fault_request::Fault::FallOffBus(_)) => GpuEvent::FellOffBus {
                gpu_uuid: gpu_uuid.clone(),
            },
            Some(pa::inject_fault_request::Fault::Recover(_)) => GpuEvent::Recovered {
                gpu_uuid: gpu_uuid.clone(),
            },
            None => {
                return Err(Status::invalid_argument(
                    "fault: give an xid, fall_off_bus or recover",
                ));
            }
        };
        sim.inject(event)
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        Ok(Response::new(pa::InjectFaultResponse { gpu_uuid }))
    }

    async fn restart(
        &self,
        request: Request<pa::RestartRequest>,
    ) -> Result<Response<pa::RestartResponse>, Status> {
        self.require_replica(&request)?;
        let req = request.into_inner();
        let name = &self.agent.config.name;
        let Some(reexec) = &self.agent.config.reexec else {
            return Err(Status::failed_precondition(format!(
                "node {name}'s agent runs inside another program and cannot restart itself"
            )));
        };
        let next_release = reexec.next_release().await.map_err(|e| {
            Status::failed_precondition(format!(
                "node {name}'s agent will not restart: {e:#}; it keeps running release {RELEASE}"
            ))
        })?;
        if !req.check_only {
            tracing::warn!(
                by = %req.requested_by,
                program = %reexec.program.display(),
                release = RELEASE,
                next_release = %next_release,
                "restarting in place on request; workloads keep running"
            );
            self.agent.request_restart();
        }
        Ok(Response::new(pa::RestartResponse {
            release: RELEASE.to_owned(),
            next_release,
            program: reexec.program.display().to_string(),
        }))
    }

    async fn info(
        &self,
        request: Request<pa::InfoRequest>,
    ) -> Result<Response<pa::AgentInfo>, Status> {
        self.require_replica(&request)?;
        let agent = &self.agent;
        let workloads = agent.lock().runtime.live().len();
        Ok(Response::new(pa::AgentInfo {
            release: RELEASE.to_owned(),
            pid: std::process::id(),
            started_at_ms: agent.started_at_ms,
            ready: agent.ready(),
            workloads: u32::try_from(workloads).unwrap_or(u32::MAX),
            program: agent
                .config
                .reexec
                .as_ref()
                .map(|r| r.program.display().to_string())
                .unwrap_or_default(),
        }))
    }
}
