//! `gpuctl bench placement --encoding-compare`: what the Raft log's entries would cost in
//! protobuf instead of the JSON they are written in, measured on the entries the benchmark
//! actually committed.
//!
//! The entries are read back from a follower's log after the run (the benchmark then keeps the
//! whole log: no snapshot purges it), so they are exactly what was replicated. For each
//! encoding, over that stream: bytes per entry, encode and decode time per entry, and decode +
//! apply into a fresh `ClusterState`, replayed in log order from the first entry (apply is
//! the same code for both; the difference is decoding and, for protobuf, converting).
//!
//! The protobuf side mirrors `Request` and every `Command` field for field (`pb` below, with
//! the `.proto` it stands for), so both carry the same information: every entry is converted
//! back and compared with the original before anything is timed, and a unit test does the same
//! for every command kind with every optional field set and unset. The messages are written
//! with prost's derive, as prost-build would generate them, and used by this benchmark only.

use std::time::Instant;

use anyhow::{Context, bail};
use openraft::{EntryPayload, RaftLogReader};
use prost::Message;
use serde_json::json;

use super::output::table;
use crate::datadir::DataDir;
use crate::raft::log_store::LogStore;
use crate::state::{self, ClusterState, Command, Request};

/// The protobuf mirror of a log entry's `Request`. As a `.proto` (proto3):
///
/// ```proto
/// message Request { uint32 format = 1; uint64 at = 2; Command command = 3; }
/// message Command { oneof kind {
///   SubmitJob submit_job = 1; CancelJob cancel_job = 2; RegisterNode register_node = 3;
///   Place place = 4; AllocationStarted allocation_started = 5;
///   AllocationExited allocation_exited = 6; PutTenant put_tenant = 7;
///   SetNodeStatus set_node_status = 8; NodeLost node_lost = 9; SetGpuHealth set_gpu_health = 10;
///   PutPartition put_partition = 11; Preempt preempt = 12; CompactJobs compact_jobs = 13;
///   Batch batch = 14; CreateToken create_token = 15; RevokeToken revoke_token = 16;
///   AuditNote audit_note = 17; CompactAudit compact_audit = 18;
///   SetClusterVersion set_cluster_version = 19; Attributed attributed = 20;
///   ChangeJobs change_jobs = 21; string service_command = 22; } }
/// message JobSpec { string tenant = 1; string name = 2; repeated string command = 3;
///   uint32 gpus_per_task = 4; uint32 tasks = 5; repeated string gpu_models = 6;
///   optional string partition = 7; string priority_class = 8; optional uint64 time_limit_secs = 9;
///   repeated Dependency dependencies = 10; uint64 cpu_milli_per_task = 11;
///   uint64 memory_mib_per_task = 12; map<string,string> env = 13; uint32 gpu_milli = 14;
///   uint64 gpu_memory_mib = 15; optional string mig_profile = 16; bool preemptible = 17;
///   bool single_numa = 18; }
/// ... and one message per remaining struct, each field in declaration order from tag 1.
/// ```
pub mod pb {
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Request {
        #[prost(uint32, tag = "1")]
        pub format: u32,
        #[prost(uint64, tag = "2")]
        pub at: u64,
        #[prost(message, optional, tag = "3")]
        pub command: Option<Command>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Command {
        #[prost(
            oneof = "Kind",
            tags = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21"
        )]
        pub kind: Option<Kind>,
    }

    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Kind {
        #[prost(message, tag = "1")]
        SubmitJob(SubmitJob),
        #[prost(message, tag = "2")]
        CancelJob(CancelJob),
        #[prost(message, tag = "3")]
        RegisterNode(NodeSpec),
        #[prost(message, tag = "4")]
        Place(Place),
        #[prost(uint64, tag = "5")]
        AllocationStarted(u64),
        #[prost(message, tag = "6")]
        AllocationExited(AllocationExited),
        #[prost(message, tag = "7")]
        PutTenant(Tenant),
        #[prost(message, tag = "8")]
        SetNodeStatus(SetNodeStatus),
        #[prost(message, tag = "9")]
        NodeLost(NodeLost),
        #[prost(message, tag = "10")]
        SetGpuHealth(SetGpuHealth),
        #[prost(message, tag = "11")]
        PutPartition(Partition),
        #[prost(message, tag = "12")]
        Preempt(Preempt),
        #[prost(message, tag = "13")]
        CompactJobs(JobRetention),
        #[prost(message, tag = "14")]
        Batch(Batch),
        #[prost(message, tag = "15")]
        CreateToken(TokenRecord),
        #[prost(message, tag = "16")]
        RevokeToken(RevokeToken),
        #[prost(message, tag = "17")]
        AuditNote(AuditNote),
        #[prost(message, tag = "18")]
        CompactAudit(AuditRetention),
        #[prost(uint32, tag = "19")]
        SetClusterVersion(u32),
        #[prost(message, tag = "20")]
        Attributed(Attributed),
        #[prost(message, tag = "21")]
        ChangeJobs(ChangeJobs),
        /// A service command, as its JSON (a few per rollout or restart: their size does not
        /// matter to the figures).
        #[prost(string, tag = "22")]
        ServiceCommand(String),
    }

    /// `ChangeJobs`: the jobs, and the change as its JSON (operators' commands, a few per day:
    /// no benchmark run proposes one, and their size does not matter).
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ChangeJobs {
        #[prost(uint64, repeated, tag = "1")]
        pub jobs: Vec<u64>,
        #[prost(string, tag = "2")]
        pub change_json: String,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct SubmitJob {
        #[prost(message, optional, tag = "1")]
        pub spec: Option<JobSpec>,
        #[prost(string, optional, tag = "2")]
        pub idempotency_key: Option<String>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct JobSpec {
        #[prost(string, tag = "1")]
        pub tenant: String,
        #[prost(string, tag = "2")]
        pub name: String,
        #[prost(string, repeated, tag = "3")]
        pub command: Vec<String>,
        #[prost(uint32, tag = "4")]
        pub gpus_per_task: u32,
        #[prost(uint32, tag = "5")]
        pub tasks: u32,
        #[prost(string, repeated, tag = "6")]
        pub gpu_models: Vec<String>,
        #[prost(string, optional, tag = "7")]
        pub partition: Option<String>,
        #[prost(string, tag = "8")]
        pub priority_class: String,
        #[prost(uint64, optional, tag = "9")]
        pub time_limit_secs: Option<u64>,
        #[prost(message, repeated, tag = "10")]
        pub dependencies: Vec<Dependency>,
        #[prost(uint64, tag = "11")]
        pub cpu_milli_per_task: u64,
        #[prost(uint64, tag = "12")]
        pub memory_mib_per_task: u64,
        #[prost(btree_map = "string, string", tag = "13")]
        pub env: std::collections::BTreeMap<String, String>,
        #[prost(uint32, tag = "14")]
        pub gpu_milli: u32,
        #[prost(uint64, tag = "15")]
        pub gpu_memory_mib: u64,
        #[prost(string, optional, tag = "16")]
        pub mig_profile: Option<String>,
        #[prost(bool, tag = "17")]
        pub preemptible: bool,
        #[prost(bool, tag = "18")]
        pub single_numa: bool,
        #[prost(string, optional, tag = "19")]
        pub workdir: Option<String>,
    }

    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
    #[repr(i32)]
    #[allow(clippy::enum_variant_names)] // named as the state's own enum
    pub enum DependencyKind {
        AfterOk = 0,
        AfterAny = 1,
        AfterNotOk = 2,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Dependency {
        #[prost(enumeration = "DependencyKind", tag = "1")]
        pub kind: i32,
        #[prost(uint64, tag = "2")]
        pub job: u64,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct CancelJob {
        #[prost(uint64, tag = "1")]
        pub job: u64,
        #[prost(string, tag = "2")]
        pub reason: String,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct NodeSpec {
        #[prost(string, tag = "1")]
        pub name: String,
        #[prost(message, repeated, tag = "2")]
        pub gpus: Vec<Gpu>,
        #[prost(uint64, tag = "3")]
        pub cpu_milli: u64,
        #[prost(uint64, tag = "4")]
        pub memory_mib: u64,
        #[prost(string, optional, tag = "5")]
        pub partition: Option<String>,
        #[prost(btree_map = "string, string", tag = "6")]
        pub labels: std::collections::BTreeMap<String, String>,
        #[prost(message, repeated, tag = "7")]
        pub topology: Vec<TopologyRow>,
        #[prost(string, tag = "8")]
        pub agent_address: String,
        #[prost(string, tag = "9")]
        pub driver: String,
        #[prost(string, tag = "10")]
        pub incarnation: String,
        #[prost(string, tag = "11")]
        pub agent_release: String,
        #[prost(string, tag = "12")]
        pub enforcement: String,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct TopologyRow {
        #[prost(string, repeated, tag = "1")]
        pub links: Vec<String>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Gpu {
        #[prost(string, tag = "1")]
        pub uuid: String,
        #[prost(uint32, tag = "2")]
        pub index: u32,
        #[prost(string, tag = "3")]
        pub model: String,
        #[prost(uint64, tag = "4")]
        pub memory_mib: u64,
        #[prost(uint32, optional, tag = "5")]
        pub numa_node: Option<u32>,
        #[prost(string, tag = "6")]
        pub pci_bus_id: String,
        #[prost(message, optional, tag = "7")]
        pub health: Option<GpuHealth>,
        #[prost(message, repeated, tag = "8")]
        pub mig: Vec<MigSlice>,
    }

    /// Healthy: `unhealthy` false (and no reason); Unhealthy: true, with its reason.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct GpuHealth {
        #[prost(bool, tag = "1")]
        pub unhealthy: bool,
        #[prost(string, tag = "2")]
        pub reason: String,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct MigSlice {
        #[prost(string, tag = "1")]
        pub uuid: String,
        #[prost(string, tag = "2")]
        pub profile: String,
        #[prost(uint64, tag = "3")]
        pub memory_mib: u64,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Place {
        #[prost(uint64, tag = "1")]
        pub term: u64,
        #[prost(message, repeated, tag = "2")]
        pub placements: Vec<JobPlacement>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct JobPlacement {
        #[prost(uint64, tag = "1")]
        pub job: u64,
        #[prost(message, repeated, tag = "2")]
        pub tasks: Vec<TaskPlacement>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct TaskPlacement {
        #[prost(string, tag = "1")]
        pub node: String,
        #[prost(string, repeated, tag = "2")]
        pub gpus: Vec<String>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct AllocationExited {
        #[prost(uint64, tag = "1")]
        pub allocation: u64,
        #[prost(message, optional, tag = "2")]
        pub outcome: Option<TaskOutcome>,
        #[prost(message, optional, tag = "3")]
        pub usage: Option<TaskUsage>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct TaskUsage {
        #[prost(uint64, tag = "1")]
        pub cpu_ms: u64,
        #[prost(uint64, tag = "2")]
        pub peak_memory_bytes: u64,
        #[prost(uint64, tag = "3")]
        pub oom_kills: u64,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct TaskOutcome {
        #[prost(oneof = "Outcome", tags = "1, 2, 3, 4, 5")]
        pub outcome: Option<Outcome>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Empty {}

    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Outcome {
        #[prost(message, tag = "1")]
        Succeeded(Empty),
        #[prost(message, tag = "2")]
        Failed(Failed),
        #[prost(message, tag = "3")]
        TimedOut(Empty),
        #[prost(string, tag = "4")]
        Lost(String),
        #[prost(message, tag = "5")]
        Stopped(Empty),
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Failed {
        #[prost(int32, optional, tag = "1")]
        pub exit_code: Option<i32>,
        #[prost(int32, optional, tag = "2")]
        pub signal: Option<i32>,
        #[prost(string, tag = "3")]
        pub reason: String,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Tenant {
        #[prost(string, tag = "1")]
        pub name: String,
        #[prost(uint32, tag = "2")]
        pub weight: u32,
        #[prost(uint32, tag = "3")]
        pub quota_gpus: u32,
        #[prost(uint32, tag = "4")]
        pub max_gpus: u32,
    }

    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
    #[repr(i32)]
    pub enum NodeStatus {
        Ready = 0,
        Drained = 1,
        Down = 2,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct SetNodeStatus {
        #[prost(string, tag = "1")]
        pub node: String,
        #[prost(enumeration = "NodeStatus", tag = "2")]
        pub status: i32,
        #[prost(bool, tag = "3")]
        pub evict: bool,
        #[prost(string, tag = "4")]
        pub reason: String,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct NodeLost {
        #[prost(string, tag = "1")]
        pub node: String,
        #[prost(string, tag = "2")]
        pub reason: String,
        #[prost(uint64, tag = "3")]
        pub registered_at: u64,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct SetGpuHealth {
        #[prost(string, tag = "1")]
        pub node: String,
        #[prost(string, tag = "2")]
        pub gpu: String,
        #[prost(message, optional, tag = "3")]
        pub health: Option<GpuHealth>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Partition {
        #[prost(string, tag = "1")]
        pub name: String,
        #[prost(string, tag = "2")]
        pub description: String,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Preempt {
        #[prost(uint64, tag = "1")]
        pub for_job: u64,
        #[prost(uint64, repeated, tag = "2")]
        pub victims: Vec<u64>,
        #[prost(string, tag = "3")]
        pub reason: String,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct JobRetention {
        #[prost(uint64, tag = "1")]
        pub full_record_ms: u64,
        #[prost(uint64, tag = "2")]
        pub max_full_records: u64,
        #[prost(uint64, tag = "3")]
        pub archive_ms: u64,
        #[prost(uint64, tag = "4")]
        pub max_archived: u64,
        #[prost(uint64, optional, tag = "5")]
        pub limit: Option<u64>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Batch {
        #[prost(message, repeated, tag = "1")]
        pub commands: Vec<Command>,
    }

    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
    #[repr(i32)]
    pub enum ApiRole {
        Admin = 0,
        Operator = 1,
        User = 2,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct TokenRecord {
        #[prost(string, tag = "1")]
        pub id: String,
        #[prost(string, tag = "2")]
        pub secret_sha256: String,
        #[prost(enumeration = "ApiRole", tag = "3")]
        pub role: i32,
        #[prost(string, optional, tag = "4")]
        pub tenant: Option<String>,
        #[prost(string, tag = "5")]
        pub description: String,
        #[prost(uint64, tag = "6")]
        pub created_at: u64,
        #[prost(string, tag = "7")]
        pub created_by: String,
        #[prost(uint64, optional, tag = "8")]
        pub expires_at: Option<u64>,
        #[prost(uint64, optional, tag = "9")]
        pub revoked_at: Option<u64>,
        #[prost(string, optional, tag = "10")]
        pub revoked_by: Option<String>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct RevokeToken {
        #[prost(string, tag = "1")]
        pub id: String,
        #[prost(string, tag = "2")]
        pub by: String,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct AuditNote {
        #[prost(string, tag = "1")]
        pub action: String,
        #[prost(string, tag = "2")]
        pub target: String,
        #[prost(string, tag = "3")]
        pub detail: String,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct AuditRetention {
        #[prost(uint64, tag = "1")]
        pub max_age_ms: u64,
        #[prost(uint64, tag = "2")]
        pub max_records: u64,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Actor {
        #[prost(string, tag = "1")]
        pub principal: String,
        #[prost(string, tag = "2")]
        pub role: String,
        #[prost(string, optional, tag = "3")]
        pub tenant: Option<String>,
        #[prost(string, tag = "4")]
        pub from: String,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Attributed {
        #[prost(message, optional, tag = "1")]
        pub actor: Option<Actor>,
        #[prost(message, optional, boxed, tag = "2")]
        pub command: Option<Box<Command>>,
    }
}

// ---- Rust values to the mirror ----

fn health_to(h: &state::GpuHealth) -> pb::GpuHealth {
    match h {
        state::GpuHealth::Healthy => pb::GpuHealth {
            unhealthy: false,
            reason: String::new(),
        },
        state::GpuHealth::Unhealthy { reason } => pb::GpuHealth {
            unhealthy: true,
            reason: reason.clone(),
        },
    }
}

fn spec_to(s: &state::JobSpec) -> pb::JobSpec {
    pb::JobSpec {
        tenant: s.tenant.clone(),
        name: s.name.clone(),
        command: s.command.clone(),
        gpus_per_task: s.gpus_per_task,
        tasks: s.tasks,
        gpu_models: s.gpu_models.clone(),
        partition: s.partition.clone(),
        priority_class: s.priority_class.clone(),
        time_limit_secs: s.time_limit_secs,
        dependencies: s
            .dependencies
            .iter()
            .map(|d| pb::Dependency {
                kind: match d.kind {
                    state::DependencyKind::AfterOk => pb::DependencyKind::AfterOk,
                    state::DependencyKind::AfterAny => pb::DependencyKind::AfterAny,
                    state::DependencyKind::AfterNotOk => pb::DependencyKind::AfterNotOk,
                } as i32,
                job: d.job,
            })
            .collect(),
        cpu_milli_per_task: s.cpu_milli_per_task,
        memory_mib_per_task: s.memory_mib_per_task,
        env: s.env.clone(),
        gpu_milli: s.gpu_milli,
        gpu_memory_mib: s.gpu_memory_mib,
        mig_profile: s.mig_profile.clone(),
        preemptible: s.preemptible,
        single_numa: s.single_numa,
        workdir: s.workdir.clone(),
    }
}

fn node_to(s: &state::NodeSpec) -> pb::NodeSpec {
    pb::NodeSpec {
        name: s.name.clone(),
        gpus: s
            .gpus
            .iter()
            .map(|g| pb::Gpu {
                uuid: g.uuid.clone(),
                index: g.index,
                model: g.model.clone(),
                memory_mib: g.memory_mib,
                numa_node: g.numa_node,
                pci_bus_id: g.pci_bus_id.clone(),
                health: Some(health_to(&g.health)),
                mig: g
                    .mig
                    .iter()
                    .map(|m| pb::MigSlice {
                        uuid: m.uuid.clone(),
                        profile: m.profile.clone(),
                        memory_mib: m.memory_mib,
                    })
                    .collect(),
            })
            .collect(),
        cpu_milli: s.cpu_milli,
        memory_mib: s.memory_mib,
        partition: s.partition.clone(),
        labels: s.labels.clone(),
        topology: s
            .topology
            .iter()
            .map(|row| pb::TopologyRow { links: row.clone() })
            .collect(),
        agent_address: s.agent_address.clone(),
        driver: s.driver.clone(),
        incarnation: s.incarnation.clone(),
        agent_release: s.agent_release.clone(),
        enforcement: s.enforcement.clone(),
    }
}

fn tenant_to(t: &state::Tenant) -> pb::Tenant {
    pb::Tenant {
        name: t.name.clone(),
        weight: t.weight,
        quota_gpus: t.quota_gpus,
        max_gpus: t.max_gpus,
    }
}

/// A command as its protobuf mirror.
pub fn command_to(c: &Command) -> pb::Command {
    use pb::Kind as K;
    let kind = match c {
        Command::SubmitJob {
            spec,
            idempotency_key,
        } => K::SubmitJob(pb::SubmitJob {
            spec: Some(spec_to(spec)),
            idempotency_key: idempotency_key.clone(),
        }),
        Command::CancelJob { job, reason } => K::CancelJob(pb::CancelJob {
            job: *job,
            reason: reason.clone(),
        }),
        Command::RegisterNode { spec } => K::RegisterNode(node_to(spec)),
        Command::Place { term, placements } => K::Place(pb::Place {
            term: *term,
            placements: placements
                .iter()
                .map(|p| pb::JobPlacement {
                    job: p.job,
                    tasks: p
                        .tasks
                        .iter()
                        .map(|t| pb::TaskPlacement {
                            node: t.node.clone(),
                            gpus: t.gpus.clone(),
                        })
                        .collect(),
                })
                .collect(),
        }),
        Command::AllocationStarted { allocation } => K::AllocationStarted(*allocation),
        Command::AllocationExited {
            allocation,
            outcome,
            usage,
        } => K::AllocationExited(pb::AllocationExited {
            allocation: *allocation,
            usage: usage.map(|u| pb::TaskUsage {
                cpu_ms: u.cpu_ms,
                peak_memory_bytes: u.peak_memory_bytes,
                oom_kills: u.oom_kills,
            }),
            outcome: Some(pb::TaskOutcome {
                outcome: Some(match outcome {
                    state::TaskOutcome::Succeeded => pb::Outcome::Succeeded(pb::Empty {}),
                    state::TaskOutcome::Failed {
                        exit_code,
                        signal,
                        reason,
                    } => pb::Outcome::Failed(pb::Failed {
                        exit_code: *exit_code,
                        signal: *signal,
                        reason: reason.clone(),
                    }),
                    state::TaskOutcome::TimedOut => pb::Outcome::TimedOut(pb::Empty {}),
                    state::TaskOutcome::Lost { reason } => pb::Outcome::Lost(reason.clone()),
                    state::TaskOutcome::Stopped => pb::Outcome::Stopped(pb::Empty {}),
                }),
            }),
        }),
        Command::PutTenant { tenant } => K::PutTenant(tenant_to(tenant)),
        Command::SetNodeStatus {
            node,
            status,
            evict,
            reason,
        } => K::SetNodeStatus(pb::SetNodeStatus {
            node: node.clone(),
            status: match status {
                state::NodeStatus::Ready => pb::NodeStatus::Ready,
                state::NodeStatus::Drained => pb::NodeStatus::Drained,
                state::NodeStatus::Down => pb::NodeStatus::Down,
            } as i32,
            evict: *evict,
            reason: reason.clone(),
        }),
        Command::NodeLost {
            node,
            reason,
            registered_at,
        } => K::NodeLost(pb::NodeLost {
            node: node.clone(),
            reason: reason.clone(),
            registered_at: *registered_at,
        }),
        Command::SetGpuHealth { node, gpu, health } => K::SetGpuHealth(pb::SetGpuHealth {
            node: node.clone(),
            gpu: gpu.clone(),
            health: Some(health_to(health)),
        }),
        Command::PutPartition { partition } => K::PutPartition(pb::Partition {
            name: partition.name.clone(),
            description: partition.description.clone(),
        }),
        Command::Preempt {
            for_job,
            victims,
            reason,
        } => K::Preempt(pb::Preempt {
            for_job: *for_job,
            victims: victims.clone(),
            reason: reason.clone(),
        }),
        Command::CompactJobs { retention, limit } => K::CompactJobs(pb::JobRetention {
            limit: *limit,
            full_record_ms: retention.full_record_ms,
            max_full_records: retention.max_full_records,
            archive_ms: retention.archive_ms,
            max_archived: retention.max_archived,
        }),
        Command::Batch { commands } => K::Batch(pb::Batch {
            commands: commands.iter().map(command_to).collect(),
        }),
        Command::CreateToken { token } => K::CreateToken(pb::TokenRecord {
            id: token.id.clone(),
            secret_sha256: token.secret_sha256.clone(),
            role: match token.role {
                state::ApiRole::Admin => pb::ApiRole::Admin,
                state::ApiRole::Operator => pb::ApiRole::Operator,
                state::ApiRole::User => pb::ApiRole::User,
            } as i32,
            tenant: token.tenant.clone(),
            description: token.description.clone(),
            created_at: token.created_at,
            created_by: token.created_by.clone(),
            expires_at: token.expires_at,
            revoked_at: token.revoked_at,
            revoked_by: token.revoked_by.clone(),
        }),
        Command::RevokeToken { id, by } => K::RevokeToken(pb::RevokeToken {
            id: id.clone(),
            by: by.clone(),
        }),
        Command::AuditNote {
            action,
            target,
            detail,
        } => K::AuditNote(pb::AuditNote {
            action: action.clone(),
            target: target.clone(),
            detail: detail.clone(),
        }),
        Command::CompactAudit { retention } => K::CompactAudit(pb::AuditRetention {
            max_age_ms: retention.max_age_ms,
            max_records: retention.max_records,
        }),
        Command::SetClusterVersion { version } => K::SetClusterVersion(*version),
        Command::ChangeJobs { jobs, change } => K::ChangeJobs(pb::ChangeJobs {
            jobs: jobs.clone(),
            change_json: serde_json::to_string(change).unwrap_or_default(),
        }),
        Command::PutService { .. }
        | Command::ScaleService { .. }
        | Command::DeleteService { .. }
        | Command::ServiceRollout { .. }
        | Command::ReplicaReadiness { .. } => {
            K::ServiceCommand(serde_json::to_string(c).unwrap_or_default())
        }
        Command::Attributed { actor, command } => K::Attributed(pb::Attributed {
            actor: Some(pb::Actor {
                principal: actor.principal.clone(),
                role: actor.role.clone(),
                tenant: actor.tenant.clone(),
                from: actor.from.clone(),
            }),
            command: Some(Box::new(command_to(command))),
        }),
    };
    pb::Command { kind: Some(kind) }
}

pub fn request_to(r: &Request) -> pb::Request {
    pb::Request {
        format: r.format,
        at: r.at,
        command: Some(command_to(&r.command)),
    }
}

// ---- the mirror back to Rust values ----

fn missing(what: &str) -> String {
    format!("the protobuf entry has no {what}")
}

fn health_from(h: Option<pb::GpuHealth>) -> Result<state::GpuHealth, String> {
    let h = h.ok_or_else(|| missing("GPU health"))?;
    Ok(if h.unhealthy {
        state::GpuHealth::Unhealthy { reason: h.reason }
    } else if h.reason.is_empty() {
        state::GpuHealth::Healthy
    } else {
        return Err("a healthy GPU with a reason".into());
    })
}

fn spec_from(s: pb::JobSpec) -> Result<state::JobSpec, String> {
    Ok(state::JobSpec {
        tenant: s.tenant,
        name: s.name,
        command: s.command,
        gpus_per_task: s.gpus_per_task,
        tasks: s.tasks,
        gpu_models: s.gpu_models,
        partition: s.partition,
        priority_class: s.priority_class,
        time_limit_secs: s.time_limit_secs,
        dependencies: s
            .dependencies
            .into_iter()
            .map(|d| {
                Ok(state::Dependency {
                    kind: match pb::DependencyKind::try_from(d.kind) {
                        Ok(pb::DependencyKind::AfterOk) => state::DependencyKind::AfterOk,
                        Ok(pb::DependencyKind::AfterAny) => state::DependencyKind::AfterAny,
                        Ok(pb::DependencyKind::AfterNotOk) => state::DependencyKind::AfterNotOk,
                        Err(_) => return Err(format!("unknown dependency kind {}", d.kind)),
                    },
                    job: d.job,
                })
            })
            .collect::<Result<_, String>>()?,
        cpu_milli_per_task: s.cpu_milli_per_task,
        memory_mib_per_task: s.memory_mib_per_task,
        env: s.env,
        gpu_milli: s.gpu_milli,
        gpu_memory_mib: s.gpu_memory_mib,
        mig_profile: s.mig_profile,
        preemptible: s.preemptible,
        single_numa: s.single_numa,
        workdir: s.workdir.clone(),
        // The mirror measures the fields every job has; containers are not in its sample.
        container: None,
        stdout_path: None,
        stderr_path: None,
        hold_if_unfit: false,
        ..Default::default()
    })
}

fn node_from(s: pb::NodeSpec) -> Result<state::NodeSpec, String> {
    Ok(state::NodeSpec {
        name: s.name,
        gpus: s
            .gpus
            .into_iter()
            .map(|g| {
                Ok(state::Gpu {
                    uuid: g.uuid,
                    index: g.index,
                    model: g.model,
                    memory_mib: g.memory_mib,
                    numa_node: g.numa_node,
                    pci_bus_id: g.pci_bus_id,
                    health: health_from(g.health)?,
                    mig: g
                        .mig
                        .into_iter()
                        .map(|m| state::MigSlice {
                            uuid: m.uuid,
                            profile: m.profile,
                            memory_mib: m.memory_mib,
                        })
                        .collect(),
                })
            })
            .collect::<Result<_, String>>()?,
        cpu_milli: s.cpu_milli,
        memory_mib: s.memory_mib,
        partition: s.partition,
        labels: s.labels,
        topology: s.topology.into_iter().map(|r| r.links).collect(),
        agent_address: s.agent_address,
        driver: s.driver,
        incarnation: s.incarnation,
        agent_release: s.agent_release,
        enforcement: s.enforcement,
        container_runtime: String::new(),
        service_ports: None,
    })
}

/// The command a protobuf mirror stands for.
pub fn command_from(c: pb::Command) -> Result<Command, String> {
    use pb::Kind as K;
    Ok(match c.kind.ok_or_else(|| missing("command"))? {
        K::SubmitJob(s) => Command::SubmitJob {
            spec: spec_from(s.spec.ok_or_else(|| missing("job spec"))?)?,
            idempotency_key: s.idempotency_key,
        },
        K::CancelJob(c) => Command::CancelJob {
            job: c.job,
            reason: c.reason,
        },
        K::RegisterNode(n) => Command::RegisterNode {
            spec: node_from(n)?,
        },
        K::Place(p) => Command::Place {
            term: p.term,
            placements: p
                .placements
                .into_iter()
                .map(|p| crate::state::JobPlacement {
                    job: p.job,
                    tasks: p
                        .tasks
                        .into_iter()
                        .map(|t| crate::state::TaskPlacement {
                            node: t.node,
                            gpus: t.gpus,
                        })
                        .collect(),
                })
                .collect(),
        },
        K::AllocationStarted(allocation) => Command::AllocationStarted { allocation },
        K::AllocationExited(e) => Command::AllocationExited {
            allocation: e.allocation,
            outcome: match e
                .outcome
                .and_then(|o| o.outcome)
                .ok_or_else(|| missing("task outcome"))?
            {
                pb::Outcome::Succeeded(_) => state::TaskOutcome::Succeeded,
                pb::Outcome::Failed(f) => state::TaskOutcome::Failed {
                    exit_code: f.exit_code,
                    signal: f.signal,
                    reason: f.reason,
                },
                pb::Outcome::TimedOut(_) => state::TaskOutcome::TimedOut,
                pb::Outcome::Lost(reason) => state::TaskOutcome::Lost { reason },
                pb::Outcome::Stopped(_) => state::TaskOutcome::Stopped,
            },
            usage: e.usage.map(|u| state::TaskUsage {
                cpu_ms: u.cpu_ms,
                peak_memory_bytes: u.peak_memory_bytes,
                oom_kills: u.oom_kills,
                // The mirror measures the cgroup's fields; GPU samples are not in its sample.
                ..Default::default()
            }),
        },
        K::PutTenant(t) => Command::PutTenant {
            tenant: state::Tenant {
                name: t.name,
                weight: t.weight,
                quota_gpus: t.quota_gpus,
                max_gpus: t.max_gpus,
            },
        },
        K::SetNodeStatus(s) => Command::SetNodeStatus {
            node: s.node,
            status: match pb::NodeStatus::try_from(s.status) {
                Ok(pb::NodeStatus::Ready) => state::NodeStatus::Ready,
                Ok(pb::NodeStatus::Drained) => state::NodeStatus::Drained,
                Ok(pb::NodeStatus::Down) => state::NodeStatus::Down,
                Err(_) => return Err(format!("unknown node status {}", s.status)),
            },
            evict: s.evict,
            reason: s.reason,
        },
        K::NodeLost(n) => Command::NodeLost {
            node: n.node,
            reason: n.reason,
            registered_at: n.registered_at,
        },
        K::SetGpuHealth(g) => Command::SetGpuHealth {
            node: g.node,
            gpu: g.gpu,
            health: health_from(g.health)?,
        },
        K::PutPartition(p) => Command::PutPartition {
            partition: state::Partition {
                name: p.name,
                description: p.description,
            },
        },
        K::Preempt(p) => Command::Preempt {
            for_job: p.for_job,
            victims: p.victims,
            reason: p.reason,
        },
        K::CompactJobs(r) => Command::CompactJobs {
            limit: r.limit,
            retention: state::JobRetention {
                full_record_ms: r.full_record_ms,
                max_full_records: r.max_full_records,
                archive_ms: r.archive_ms,
                max_archived: r.max_archived,
            },
        },
        K::Batch(b) => Command::Batch {
            commands: b
                .commands
                .into_iter()
                .map(command_from)
                .collect::<Result<_, String>>()?,
        },
        K::CreateToken(t) => Command::CreateToken {
            token: state::TokenRecord {
                id: t.id,
                secret_sha256: t.secret_sha256,
                role: match pb::ApiRole::try_from(t.role) {
                    Ok(pb::ApiRole::Admin) => state::ApiRole::Admin,
                    Ok(pb::ApiRole::Operator) => state::ApiRole::Operator,
                    Ok(pb::ApiRole::User) => state::ApiRole::User,
                    Err(_) => return Err(format!("unknown role {}", t.role)),
                },
                tenant: t.tenant,
                description: t.description,
                created_at: t.created_at,
                created_by: t.created_by,
                expires_at: t.expires_at,
                revoked_at: t.revoked_at,
                revoked_by: t.revoked_by,
            },
        },
        K::RevokeToken(r) => Command::RevokeToken { id: r.id, by: r.by },
        K::AuditNote(n) => Command::AuditNote {
            action: n.action,
            target: n.target,
            detail: n.detail,
        },
        K::CompactAudit(r) => Command::CompactAudit {
            retention: state::AuditRetention {
                max_age_ms: r.max_age_ms,
                max_records: r.max_records,
            },
        },
        K::SetClusterVersion(version) => Command::SetClusterVersion { version },
        K::ChangeJobs(c) => Command::ChangeJobs {
            jobs: c.jobs,
            change: serde_json::from_str(&c.change_json).map_err(|e| format!("change: {e}"))?,
        },
        K::ServiceCommand(json) => {
            serde_json::from_str(&json).map_err(|e| format!("service command: {e}"))?
        }
        K::Attributed(a) => {
            let actor = a.actor.ok_or_else(|| missing("actor"))?;
            Command::Attributed {
                actor: state::Actor {
                    principal: actor.principal,
                    role: actor.role,
                    tenant: actor.tenant,
                    from: actor.from,
                },
                command: Box::new(command_from(
                    *a.command.ok_or_else(|| missing("attributed command"))?,
                )?),
            }
        }
    })
}

pub fn request_from(r: pb::Request) -> Result<Request, String> {
    Ok(Request {
        format: r.format,
        at: r.at,
        command: command_from(r.command.ok_or_else(|| missing("command"))?)?,
    })
}

// ---- the measurement ----

/// The normal entries of a stopped replica's log, in order, with their indexes.
pub fn read_log(
    data_dir: &std::path::Path,
    cluster: &str,
    id: u64,
) -> anyhow::Result<Vec<(u64, Request)>> {
    let dir = DataDir::open(data_dir, cluster, id)
        .map_err(|e| anyhow::anyhow!("{e}"))
        .with_context(|| format!("opening {}", data_dir.display()))?;
    let mut log = LogStore::open(&dir.db)?;
    let runtime = tokio::runtime::Builder::new_current_thread().build()?;
    let entries = runtime
        .block_on(log.try_get_log_entries(0..u64::MAX))
        .map_err(|e| anyhow::anyhow!("{e}"))
        .context("reading the Raft log")?;
    Ok(entries
        .into_iter()
        .filter_map(|e| match e.payload {
            EntryPayload::Normal(r) => Some((e.log_id.index, std::sync::Arc::unwrap_or_clone(r.0))),
            _ => None,
        })
        .collect())
}

/// Runs `f` over the whole stream until at least `MIN_TIME` has passed; ns per entry.
fn per_entry_ns(entries: usize, mut f: impl FnMut()) -> f64 {
    const MIN_TIME: std::time::Duration = std::time::Duration::from_millis(300);
    let started = Instant::now();
    let mut rounds = 0u32;
    while rounds == 0 || started.elapsed() < MIN_TIME {
        f();
        rounds += 1;
    }
    started.elapsed().as_nanos() as f64 / (f64::from(rounds) * entries as f64)
}

/// Replays `decoded` (index, request) into a fresh state; the state it ends with.
fn replay(entries: impl Iterator<Item = (u64, Request)>) -> ClusterState {
    let mut state = ClusterState::default();
    for (index, r) in entries {
        state.apply(&r.command, r.at, index);
    }
    state
}

/// Compares the two encodings on `entries` (the normal entries of the run's log); returns the
/// table and its JSON. `followers`: how many replicas each entry is sent to.
pub fn compare(
    entries: &[(u64, Request)],
    followers: usize,
) -> anyhow::Result<(String, serde_json::Value)> {
    if entries.is_empty() {
        bail!("the log holds no entries to compare");
    }
    let n = entries.len();
    let json_bytes: Vec<Vec<u8>> = entries
        .iter()
        .map(|(_, r)| serde_json::to_vec(r))
        .collect::<Result<_, _>>()?;
    let proto_bytes: Vec<Vec<u8>> = entries
        .iter()
        .map(|(_, r)| request_to(r).encode_to_vec())
        .collect();
    // Equal information: every entry comes back from protobuf as it went in (and from JSON).
    for ((index, r), (j, p)) in entries.iter().zip(json_bytes.iter().zip(&proto_bytes)) {
        let back = request_from(pb::Request::decode(p.as_slice())?)
            .map_err(|e| anyhow::anyhow!("entry {index}: {e}"))?;
        anyhow::ensure!(
            back == *r,
            "entry {index} does not round-trip through protobuf"
        );
        let back: Request = serde_json::from_slice(j)?;
        anyhow::ensure!(back == *r, "entry {index} does not round-trip through JSON");
    }
    let total = |v: &[Vec<u8>]| v.iter().map(|b| b.len() as u64).sum::<u64>();
    let (json_total, proto_total) = (total(&json_bytes), total(&proto_bytes));
    let mut kinds: std::collections::BTreeMap<String, (u64, u64, u64)> = Default::default();
    for ((_, r), (j, p)) in entries.iter().zip(json_bytes.iter().zip(&proto_bytes)) {
        let kind = match &r.command {
            Command::Batch { commands } => format!(
                "batch of {}",
                commands.first().map_or("nothing", |c| c.kind())
            ),
            c => c.kind().to_owned(),
        };
        let k = kinds.entry(kind).or_default();
        k.0 += 1;
        k.1 += j.len() as u64;
        k.2 += p.len() as u64;
    }

    let requests: Vec<&Request> = entries.iter().map(|(_, r)| r).collect();
    let encode_json = per_entry_ns(n, || {
        for r in &requests {
            std::hint::black_box(serde_json::to_vec(r).expect("encodes"));
        }
    });
    let encode_proto = per_entry_ns(n, || {
        for r in &requests {
            std::hint::black_box(request_to(r).encode_to_vec());
        }
    });
    let converted: Vec<pb::Request> = requests.iter().map(|r| request_to(r)).collect();
    let encode_proto_only = per_entry_ns(n, || {
        for m in &converted {
            std::hint::black_box(m.encode_to_vec());
        }
    });
    drop(converted);
    let decode_json = per_entry_ns(n, || {
        for b in &json_bytes {
            std::hint::black_box(serde_json::from_slice::<Request>(b).expect("decodes"));
        }
    });
    let decode_proto_only = per_entry_ns(n, || {
        for b in &proto_bytes {
            std::hint::black_box(pb::Request::decode(b.as_slice()).expect("decodes"));
        }
    });
    let decode_proto = per_entry_ns(n, || {
        for b in &proto_bytes {
            let m = pb::Request::decode(b.as_slice()).expect("decodes");
            std::hint::black_box(request_from(m).expect("converts"));
        }
    });
    // Apply, replayed in log order from an empty state (as a replica without a snapshot).
    let apply_only = per_entry_ns(n, || {
        std::hint::black_box(replay(entries.iter().cloned()));
    });
    let apply_json = per_entry_ns(n, || {
        std::hint::black_box(replay(entries.iter().zip(&json_bytes).map(
            |((i, _), b)| (*i, serde_json::from_slice::<Request>(b).expect("decodes")),
        )));
    });
    let apply_proto = per_entry_ns(n, || {
        std::hint::black_box(replay(entries.iter().zip(&proto_bytes).map(
            |((i, _), b)| {
                let m = pb::Request::decode(b.as_slice()).expect("decodes");
                (*i, request_from(m).expect("converts"))
            },
        )));
    });

    let row = |what: &str, j: f64, p: f64, digits: usize| {
        vec![
            what.to_owned(),
            format!("{j:.digits$}"),
            format!("{p:.digits$}"),
            format!("{:.2}", p / j),
        ]
    };
    let rows = vec![
        row(
            "bytes per entry (mean)",
            json_total as f64 / n as f64,
            proto_total as f64 / n as f64,
            0,
        ),
        row(
            "bytes, whole run (payloads)",
            json_total as f64,
            proto_total as f64,
            0,
        ),
        row(
            &format!("bytes replicated, whole run (x{followers} followers)"),
            (json_total * followers as u64) as f64,
            (proto_total * followers as u64) as f64,
            0,
        ),
        row("encode ns/entry", encode_json, encode_proto, 0),
        row("decode ns/entry", decode_json, decode_proto, 0),
        row("decode + apply ns/entry", apply_json, apply_proto, 0),
    ];
    let kind_rows: Vec<Vec<String>> = kinds
        .iter()
        .map(|(k, (count, j, p))| {
            vec![
                k.clone(),
                count.to_string(),
                format!("{:.0}", *j as f64 / *count as f64),
                format!("{:.0}", *p as f64 / *count as f64),
                format!("{:.2}", *p as f64 / *j as f64),
            ]
        })
        .collect();
    let formats: std::collections::BTreeSet<u32> = entries.iter().map(|(_, r)| r.format).collect();
    let formats: Vec<String> = formats.iter().map(|f| f.to_string()).collect();
    let text = format!(
        "=== log entry encoding: JSON (as written: formats {} of the envelope) vs protobuf (prost mirror), over the {n} normal entries this run committed ===\n{}\
         protobuf rows include converting between the Rust command and the prost mirror (encode alone {encode_proto_only:.0}, decode alone {decode_proto_only:.0} ns/entry); apply alone, from cloned commands, {apply_only:.0} ns/entry\n{}",
        formats.join(" and "),
        table(&["FIGURE", "JSON", "PROTOBUF", "PROTO/JSON"], &rows),
        table(
            &["ENTRY KIND", "ENTRIES", "JSON_B", "PROTO_B", "PROTO/JSON"],
            &kind_rows
        ),
    );
    let json = json!({
        "entries": n,
        "formats": formats,
        "followers": followers,
        "json": {
            "bytes_total": json_total,
            "bytes_per_entry": json_total as f64 / n as f64,
            "encode_ns_per_entry": encode_json,
            "decode_ns_per_entry": decode_json,
            "decode_apply_ns_per_entry": apply_json,
        },
        "protobuf": {
            "bytes_total": proto_total,
            "bytes_per_entry": proto_total as f64 / n as f64,
            "encode_ns_per_entry": encode_proto,
            "decode_ns_per_entry": decode_proto,
            "encode_only_ns_per_entry": encode_proto_only,
            "decode_only_ns_per_entry": decode_proto_only,
            "decode_apply_ns_per_entry": apply_proto,
        },
        "apply_only_ns_per_entry": apply_only,
        "by_kind": kinds.iter().map(|(k, (c, j, p))| json!({"kind": k, "entries": c, "json_bytes": j, "protobuf_bytes": p})).collect::<Vec<_>>(),
    });
    Ok((text, json))
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::state::{
        Actor, ApiRole, AuditRetention, Dependency, DependencyKind, GpuHealth, JobPlacement,
        JobRetention, JobSpec, NodeStatus, Partition, TaskOutcome, TaskPlacement, Tenant,
        TokenRecord,
    };

    fn actor(tenant: Option<&str>) -> Actor {
        node_actor("sim-0001", tenant)
    }

    fn node_actor(node: &str, tenant: Option<&str>) -> Actor {
        Actor {
            principal: format!("node:{node}"),
            role: "node".into(),
            tenant: tenant.map(str::to_owned),
            from: "127.0.0.1:40000".into(),
        }
    }

    /// Every command kind, with every optional field set in one and unset in another.
    fn every_command() -> Vec<Command> {
        let node = crate::synthetic::node_from_preset(
            "dgx-h100",
            "sim-0001",
            Some("h100"),
            BTreeMap::from([("rack".to_owned(), "r1".to_owned())]),
        )
        .unwrap();
        let mut sick = node.clone();
        sick.gpus[0].health = GpuHealth::Unhealthy {
            reason: "Xid 79".into(),
        };
        sick.gpus[1].numa_node = None;
        sick.gpus[2].mig = vec![crate::state::MigSlice {
            uuid: "MIG-1".into(),
            profile: "1g.10gb".into(),
            memory_mib: 9984,
        }];
        sick.partition = None;
        sick.agent_release = "0.2.0".into();
        sick.enforcement = "cgroup v1: devices, memory, cpu, kill".into();
        sick.incarnation = "boot-1".into();
        let full = JobSpec {
            tenant: "ml".into(),
            name: "train".into(),
            command: vec!["python".into(), "train.py".into()],
            gpus_per_task: 2,
            tasks: 3,
            gpu_models: vec!["H100".into()],
            partition: Some("h100".into()),
            priority_class: "high".into(),
            time_limit_secs: Some(3600),
            dependencies: vec![
                Dependency {
                    kind: DependencyKind::AfterOk,
                    job: 1,
                },
                Dependency {
                    kind: DependencyKind::AfterAny,
                    job: 2,
                },
                Dependency {
                    kind: DependencyKind::AfterNotOk,
                    job: 3,
                },
            ],
            cpu_milli_per_task: 4000,
            memory_mib_per_task: 65536,
            env: BTreeMap::from([("A".to_owned(), "1".to_owned())]),
            gpu_milli: 250,
            gpu_memory_mib: 10_000,
            mig_profile: Some("1g.10gb".into()),
            preemptible: true,
            single_numa: true,
            workdir: Some("/home/ml/run".into()),
            container: None,
            stdout_path: None,
            stderr_path: None,
            hold_if_unfit: false,
            ..Default::default()
        };
        let token = TokenRecord {
            id: "0123456789abcdef".into(),
            secret_sha256: "ab".repeat(32),
            role: ApiRole::User,
            tenant: Some("ml".into()),
            description: "ci".into(),
            created_at: 5,
            created_by: "cert:admin:root".into(),
            expires_at: Some(10),
            revoked_at: Some(7),
            revoked_by: Some("cert:admin:root".into()),
        };
        let mut bare_token = token.clone();
        bare_token.role = ApiRole::Operator;
        bare_token.tenant = None;
        bare_token.expires_at = None;
        bare_token.revoked_at = None;
        bare_token.revoked_by = None;
        let mut admin_token = bare_token.clone();
        admin_token.role = ApiRole::Admin;
        let commands = vec![
            Command::submit(full, Some("key-1".into())),
            Command::submit(JobSpec::default(), None),
            Command::cancel(7, "no longer needed"),
            Command::RegisterNode { spec: node },
            Command::RegisterNode { spec: sick },
            Command::Place {
                term: 3,
                placements: vec![JobPlacement {
                    job: 1,
                    tasks: vec![
                        TaskPlacement {
                            node: "sim-0001".into(),
                            gpus: vec!["GPU-a".into(), "GPU-b".into()],
                        },
                        TaskPlacement {
                            node: "sim-0002".into(),
                            gpus: vec![],
                        },
                    ],
                }],
            },
            Command::AllocationStarted { allocation: 9 },
            Command::AllocationExited {
                allocation: 9,
                outcome: TaskOutcome::Succeeded,
                usage: Some(crate::state::TaskUsage {
                    cpu_ms: 1234,
                    peak_memory_bytes: 5 << 20,
                    oom_kills: 1,
                    ..Default::default()
                }),
            },
            Command::AllocationExited {
                allocation: 9,
                outcome: TaskOutcome::Failed {
                    exit_code: Some(1),
                    signal: Some(9),
                    reason: "OOM".into(),
                },
                usage: None,
            },
            Command::AllocationExited {
                allocation: 9,
                outcome: TaskOutcome::Failed {
                    exit_code: None,
                    signal: None,
                    reason: String::new(),
                },
                usage: None,
            },
            Command::AllocationExited {
                allocation: 9,
                outcome: TaskOutcome::TimedOut,
                usage: None,
            },
            Command::AllocationExited {
                allocation: 9,
                outcome: TaskOutcome::Lost {
                    reason: "node lost".into(),
                },
                usage: None,
            },
            Command::AllocationExited {
                allocation: 9,
                outcome: TaskOutcome::Stopped,
                usage: None,
            },
            Command::PutTenant {
                tenant: Tenant {
                    name: "bench".into(),
                    weight: 2,
                    quota_gpus: 3,
                    max_gpus: 4,
                },
            },
            Command::SetNodeStatus {
                node: "n".into(),
                status: NodeStatus::Ready,
                evict: false,
                reason: String::new(),
            },
            Command::SetNodeStatus {
                node: "n".into(),
                status: NodeStatus::Drained,
                evict: true,
                reason: "maintenance".into(),
            },
            Command::SetNodeStatus {
                node: "n".into(),
                status: NodeStatus::Down,
                evict: false,
                reason: "x".into(),
            },
            Command::NodeLost {
                node: "n".into(),
                reason: "silent".into(),
                registered_at: 12,
            },
            Command::SetGpuHealth {
                node: "n".into(),
                gpu: "GPU-a".into(),
                health: GpuHealth::Healthy,
            },
            Command::SetGpuHealth {
                node: "n".into(),
                gpu: "GPU-a".into(),
                health: GpuHealth::Unhealthy {
                    reason: String::new(),
                },
            },
            Command::PutPartition {
                partition: Partition {
                    name: "p".into(),
                    description: "d".into(),
                },
            },
            Command::Preempt {
                for_job: 5,
                victims: vec![1, 2, 3],
                reason: "priority".into(),
            },
            Command::CompactJobs {
                limit: Some(50_000),
                retention: JobRetention {
                    full_record_ms: 1,
                    max_full_records: 2,
                    archive_ms: 3,
                    max_archived: 4,
                },
            },
            Command::CreateToken { token },
            Command::CreateToken { token: bare_token },
            Command::CreateToken { token: admin_token },
            Command::RevokeToken {
                id: "0123456789abcdef".into(),
                by: "cert:admin:root".into(),
            },
            Command::AuditNote {
                action: "add_replica".into(),
                target: "replica 4".into(),
                detail: "added".into(),
            },
            Command::CompactAudit {
                retention: AuditRetention {
                    max_age_ms: 1,
                    max_records: 2,
                },
            },
            Command::SetClusterVersion { version: 2 },
            Command::ChangeJobs {
                jobs: vec![3, 4],
                change: state::JobChange::Update(state::JobUpdate {
                    time_limit_secs: Some(60),
                    nodelist: Some(vec!["n1".into()]),
                    ..Default::default()
                }),
            },
        ];
        let mut all = commands.clone();
        all.extend(
            commands
                .iter()
                .cloned()
                .enumerate()
                .map(|(i, c)| c.by(actor((i % 2 == 0).then_some("ml")))),
        );
        all.push(Command::Batch {
            commands: commands.into_iter().map(|c| c.by(actor(None))).collect(),
        });
        all.push(Command::Batch { commands: vec![] });
        all
    }

    #[test]
    fn the_protobuf_mirror_round_trips_every_command_with_every_field() {
        for (i, command) in every_command().into_iter().enumerate() {
            for format in [crate::state::format::LEGACY, crate::state::format::CURRENT] {
                let r = Request {
                    format,
                    at: 1_767_225_600_000 + i as u64,
                    command: command.clone(),
                };
                let bytes = request_to(&r).encode_to_vec();
                let back = request_from(pb::Request::decode(bytes.as_slice()).unwrap()).unwrap();
                assert_eq!(back, r, "command {i}");
            }
        }
    }

    /// The stream `bench placement` commits, in miniature: attributed registrations, batched
    /// attributed submissions, plans from the real scheduler, batched start and exit reports.
    /// It round-trips, and the comparison runs on it.
    #[test]
    fn the_comparison_runs_on_a_placement_like_stream() {
        let mut entries: Vec<(u64, Request)> = Vec::new();
        let push = |entries: &mut Vec<(u64, Request)>, c: Command| {
            let index = entries.len() as u64 + 1;
            entries.push((index, Request::new(1_767_225_600_000 + index, c)));
        };
        push(
            &mut entries,
            Command::PutTenant {
                tenant: Tenant {
                    name: "bench".into(),
                    weight: 1,
                    quota_gpus: 0,
                    max_gpus: 0,
                },
            }
            .by(actor(None)),
        );
        push(
            &mut entries,
            Command::Batch {
                commands: (0..4)
                    .map(|h| {
                        let spec = crate::synthetic::node_from_preset(
                            "dgx-h100",
                            &format!("sim-{h:04}"),
                            None,
                            BTreeMap::new(),
                        )
                        .unwrap();
                        let actor = node_actor(&spec.name, None);
                        Command::RegisterNode { spec }.by(actor)
                    })
                    .collect(),
            },
        );
        push(
            &mut entries,
            Command::Batch {
                commands: (0..32)
                    .map(|i| {
                        let spec = JobSpec {
                            tenant: "bench".into(),
                            name: format!("burst-{i}"),
                            command: vec!["true".into()],
                            gpus_per_task: 1,
                            tasks: 1,
                            priority_class: "normal".into(),
                            ..Default::default()
                        };
                        Command::submit(spec, Some(format!("burst-{i}"))).by(actor(None))
                    })
                    .collect(),
            },
        );
        // Placements of the submitted jobs on the registered GPUs, then their reports.
        let mut state = replay(entries.iter().cloned());
        let gpus: Vec<(String, String)> = state
            .nodes
            .values()
            .flat_map(|n| {
                n.spec
                    .gpus
                    .iter()
                    .map(|g| (n.spec.name.clone(), g.uuid.clone()))
                    .collect::<Vec<_>>()
            })
            .collect();
        let placements: Vec<JobPlacement> = state
            .jobs
            .keys()
            .zip(&gpus)
            .map(|(job, (node, gpu))| JobPlacement {
                job: *job,
                tasks: vec![TaskPlacement {
                    node: node.clone(),
                    gpus: vec![gpu.clone()],
                }],
            })
            .collect();
        push(
            &mut entries,
            Command::Place {
                term: 2,
                placements,
            },
        );
        let last = entries.last().unwrap().clone();
        state.apply(&last.1.command, last.1.at, last.0);
        let allocations: Vec<u64> = state.allocations.keys().copied().collect();
        assert_eq!(allocations.len(), 32);
        push(
            &mut entries,
            Command::Batch {
                commands: allocations
                    .iter()
                    .map(|&allocation| {
                        let node = &state.allocations[&allocation].allocation.node;
                        Command::AllocationStarted { allocation }.by(node_actor(node, None))
                    })
                    .collect(),
            },
        );
        push(
            &mut entries,
            Command::Batch {
                commands: allocations
                    .iter()
                    .map(|&allocation| {
                        Command::AllocationExited {
                            allocation,
                            outcome: TaskOutcome::Succeeded,
                            usage: None,
                        }
                        .by(node_actor(
                            &state.allocations[&allocation].allocation.node,
                            None,
                        ))
                    })
                    .collect(),
            },
        );
        let (text, json) = compare(&entries, 2).unwrap();
        assert!(text.contains("decode + apply ns/entry"), "{text}");
        assert_eq!(json["entries"], 6);
        // Protobuf is smaller on this stream; the exact ratio is what the benchmark reports.
        assert!(
            json["protobuf"]["bytes_total"].as_u64() < json["json"]["bytes_total"].as_u64(),
            "{json}"
        );
        // Replayed, both decode paths reach the same state as the commands themselves.
        let direct = replay(entries.iter().cloned());
        let via_proto = replay(entries.iter().map(|(i, r)| {
            let bytes = request_to(r).encode_to_vec();
            (
                *i,
                request_from(pb::Request::decode(bytes.as_slice()).unwrap()).unwrap(),
            )
        }));
        assert_eq!(
            serde_json::to_value(&direct).unwrap(),
            serde_json::to_value(&via_proto).unwrap()
        );
        assert_eq!(direct.jobs.len(), 32);
        assert!(
            direct
                .jobs
                .values()
                .all(|j| j.state == crate::state::JobState::Succeeded),
            "every command of the stream applies"
        );
    }
}
