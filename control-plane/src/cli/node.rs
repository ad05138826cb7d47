//! `gpuctl node ...`: node administration through the control plane, and the calls that go
//! to a node's agent (fault injection on simulated hosts).

use proto::v1 as pb;
use proto::v1::inject_fault_request::Fault;
use serde_json::json;

use super::NodeCommand;
use super::output::{self, Format};
use crate::client::{Client, with_timeout};

pub async fn run(client: &mut Client, command: NodeCommand, fmt: Format) -> anyhow::Result<()> {
    let node = match command {
        NodeCommand::RestartAgent(args) => {
            return super::agent_rollout::run(client, args, fmt).await;
        }
        NodeCommand::Show { node, stale } => return show(client, &node, stale, fmt).await,
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
            let req = pb::InjectFaultRequest {
                node: node.clone(),
                gpu_index: gpu,
                fault: Some(fault),
            };
            let resp = client
                .call(|mut c, t| {
                    let req = req.clone();
                    async move { c.inject_fault(with_timeout(req, t)).await }
                })
                .await?;
            match fmt {
                Format::Json | Format::Yaml => {
                    println!("{}", json!({"node": node, "gpu_uuid": resp.gpu_uuid}))
                }
                Format::Table | Format::Wide => {
                    println!("injected on {node} GPU {gpu} ({})", resp.gpu_uuid)
                }
            }
            return Ok(());
        }
    };
    match fmt {
        Format::Json | Format::Yaml => println!("{}", output::node_json(&node)),
        Format::Table | Format::Wide => {
            print!("{}", output::nodes_table(std::slice::from_ref(&node), None))
        }
    }
    Ok(())
}

/// `gpuctl node show NODE` and `gpuctl nodes NODE`.
pub async fn show(client: &mut Client, name: &str, stale: bool, fmt: Format) -> anyhow::Result<()> {
    let read = Some(pb::ReadOptions { stale });
    let resp = client
        .call(|mut c, t| async move {
            c.list_nodes(with_timeout(pb::ListNodesRequest { read }, t))
                .await
        })
        .await?;
    let Some(node) = resp.nodes.iter().find(|n| n.name == name) else {
        let known: Vec<String> = resp
            .nodes
            .iter()
            .map(|n| output::printable(&n.name))
            .collect();
        anyhow::bail!(
            "no node {:?} in the cluster (nodes: {})",
            output::printable(name),
            if known.is_empty() {
                "none registered".to_owned()
            } else {
                known.join(", ")
            }
        );
    };
    match fmt {
        Format::Json | Format::Yaml => {
            println!("{}", output::node_json_with_skew(node, &resp.release))
        }
        Format::Table | Format::Wide => print!("{}", output::node_details(node, &resp.release)),
    }
    Ok(())
}
