//! `gpuctl node ...` and `gpuctl logs`: node administration through the control plane, and
//! the calls that go to a node's agent directly (logs, fault injection on simulated hosts).

use proto::agent::node_agent_client::NodeAgentClient;
use proto::agent::{InjectFaultRequest, ReadLogsRequest, inject_fault_request::Fault};
use proto::v1 as pb;
use serde_json::json;
use std::io::Write;

use super::NodeCommand;
use super::output::{self, Format};
use crate::client::{Client, with_timeout};

pub async fn run(client: &mut Client, command: NodeCommand, fmt: Format) -> anyhow::Result<()> {
    let node = match command {
        NodeCommand::Drain {
            node,
            evict,
            reason,
        } => {
            let req = pb::DrainNodeRequest {
                node,
                evict,
                reason,
            };
            client
                .call(|mut c, t| {
                    let req = req.clone();
                    async move { c.drain_node(with_timeout(req, t)).await }
                })
                .await?
        }
        NodeCommand::Undrain { node } => {
            client
                .call(|mut c, t| {
                    let node = node.clone();
                    async move {
                        c.undrain_node(with_timeout(pb::UndrainNodeRequest { node }, t))
                            .await
                    }
                })
                .await?
        }
        NodeCommand::Uncordon { node, gpu } => {
            let req = pb::UncordonGpuRequest { node, gpu };
            client
                .call(|mut c, t| {
                    let req = req.clone();
                    async move { c.uncordon_gpu(with_timeout(req, t)).await }
                })
                .await?
        }
        NodeCommand::Inject {
            node,
            gpu,
            xid,
            fall_off_bus,
            recover,
        } => {
            let fault = match (xid, fall_off_bus, recover) {
                (Some(x), _, _) => Fault::Xid(x),
                (None, true, _) => Fault::FallOffBus(true),
                (None, false, true) => Fault::Recover(true),
                _ => anyhow::bail!("give --xid CODE, --fall-off-bus or --recover"),
            };
            let mut agent = agent_client(client, &node).await?;
            let resp = agent
                .inject_fault(InjectFaultRequest {
                    gpu_index: gpu,
                    fault: Some(fault),
                })
                .await?
                .into_inner();
            match fmt {
                Format::Json => println!("{}", json!({"node": node, "gpu_uuid": resp.gpu_uuid})),
                Format::Table => println!("injected on {node} GPU {gpu} ({})", resp.gpu_uuid),
            }
            return Ok(());
        }
    };
    match fmt {
        Format::Json => println!("{}", output::node_json(&node)),
        Format::Table => print!("{}", output::nodes_table(std::slice::from_ref(&node))),
    }
    Ok(())
}

async fn agent_client(
    client: &mut Client,
    node: &str,
) -> anyhow::Result<NodeAgentClient<tonic::transport::Channel>> {
    let nodes = client
        .call(|mut c, t| async move {
            c.list_nodes(with_timeout(pb::ListNodesRequest { read: None }, t))
                .await
        })
        .await?;
    let n = nodes
        .nodes
        .iter()
        .find(|n| n.name == node)
        .ok_or_else(|| anyhow::anyhow!("node {node} is not registered"))?;
    if n.agent_address.is_empty() {
        anyhow::bail!("node {node} did not register an agent address");
    }
    let channel = crate::raft::network::lazy_channel(&n.agent_address)?;
    Ok(NodeAgentClient::new(channel))
}

pub async fn logs(client: &mut Client, job: u64, tail: u64) -> anyhow::Result<()> {
    let j = client
        .call(|mut c, t| async move {
            c.get_job(with_timeout(
                pb::GetJobRequest {
                    id: job,
                    read: None,
                },
                t,
            ))
            .await
        })
        .await?;
    // The node of the current allocation, or of the last placement in the history.
    let node = j
        .allocations
        .first()
        .map(|a| a.node.clone())
        .or_else(|| {
            j.history.iter().rev().find_map(|h| {
                h.reason
                    .strip_prefix("placed on ")
                    .map(|n| n.split(',').next().unwrap_or(n).to_owned())
            })
        })
        .ok_or_else(|| anyhow::anyhow!("job {job} has not run anywhere yet (state {})", j.state))?;
    let mut agent = agent_client(client, &node).await?;
    let resp = agent
        .read_logs(ReadLogsRequest {
            job_id: job,
            tail_bytes: tail,
        })
        .await?
        .into_inner();
    std::io::stdout().write_all(&resp.stdout)?;
    std::io::stderr().write_all(&resp.stderr)?;
    Ok(())
}
