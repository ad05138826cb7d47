//! Replica configuration: command-line flags, optionally on top of a TOML file (`--config`).
//! A flag beats the file; every default is written once, in `Defaults` below.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use serde::Deserialize;

use crate::leader::LeaderConfig;
use crate::raft::{NodeId, RaftTuning};
use crate::state::JobRetention;

fn ms(v: u64) -> std::time::Duration {
    std::time::Duration::from_millis(v)
}

/// Every default of a replica, in one place.
pub struct Defaults;

impl Defaults {
    /// The default retention of finished jobs, as one value.
    pub fn job_retention() -> JobRetention {
        JobRetention {
            full_record_ms: Self::FINISHED_JOB_RETENTION_SECS * 1000,
            max_full_records: Self::MAX_FINISHED_JOBS,
            archive_ms: Self::ARCHIVE_RETENTION_SECS * 1000,
            max_archived: Self::MAX_ARCHIVED_JOBS,
        }
    }

    pub const CLUSTER: &'static str = "gpu-cluster";
    pub const LISTEN: &'static str = "127.0.0.1:7001";
    pub const DATA_DIR: &'static str = "./data";
    /// Heartbeats every 40 ms; elections after 90–150 ms. openraft adds a leader lease equal
    /// to the maximum election timeout before a follower of a live leader may campaign, so a
    /// follower waits 240–300 ms (6–7 missed heartbeats) after the last one, plus up to one
    /// tick (10 ms, a quarter of the heartbeat; openraft's own was 60 ms): a dead leader is
    /// replaced in under a third of a second (p50 278–287 ms, first new placement 309–325 ms
    /// over 50 kills, `gpuctl bench failover`), while shorter stalls of a loaded 2-core host
    /// (fsync, CPU) do not trigger elections.
    pub const HEARTBEAT_MS: u64 = 40;
    /// How long the leader waits for a follower to accept an AppendEntries that carries
    /// entries (a heartbeat still gets one heartbeat interval). openraft 0.9 used the heartbeat
    /// interval for both; a follower that needed longer than 40 ms to decode, store and sync a
    /// batch never acknowledged it, because each retry resent the same batch and timed out
    /// again: in one `gpuctl bench placement --hosts 1000` run, traced with replication logging
    /// added for the purpose and since removed, the leader resent one 32-entry batch 19 times, and
    /// the leader's view of that follower stopped advancing (our openraft patch, PATCHED.md).
    /// A retry resends entries the follower already stored, which it accepts without writing
    /// them again, so a limit that covers decoding a batch breaks that loop. It must also stay
    /// well below `max_quorum_silence` (two election timeouts, 300 ms): while an AppendEntries
    /// is out, openraft sends that follower nothing else, not even heartbeats, so a lost one
    /// costs this long without acknowledgements from that follower. At 1 s, message loss in the
    /// simulation (`gpuctl simulate cluster`, seed 463) kept the leader's quorum silent long
    /// enough that it refused agent leases and assignment streams for good.
    pub const APPEND_ENTRIES_TIMEOUT_MS: u64 = 150;
    pub const ELECTION_MIN_MS: u64 = 90;
    pub const ELECTION_MAX_MS: u64 = 150;
    pub const SNAPSHOT_EVERY: u64 = 10_000;
    /// How long the leader waits for a follower to accept the *last* chunk of a snapshot. Its
    /// answer comes only once the follower has decoded, checked and stored the whole state,
    /// which grows with it: 5.9 s at 1,000,000 jobs (216 MB) in a release build on a 2-core
    /// machine, over 2 s at 100,000 in a debug build (`gpuctl bench membership`). With the
    /// 2 s every chunk used to get, the leader gave up on it, sent the whole snapshot again,
    /// gave up again, and `cluster add` never got its replica. A last chunk that is lost costs
    /// this long before the snapshot is sent again (openraft's `install_snapshot_timeout`).
    pub const INSTALL_SNAPSHOT_TIMEOUT_MS: u64 = 120_000;
    /// How long the leader waits for a follower to accept any other chunk of a snapshot
    /// (3 MiB, stored in memory): as before, so a lost chunk is resent soon
    /// (`raft::network`).
    pub const SNAPSHOT_CHUNK_TIMEOUT_MS: u64 = 2_000;
    /// Most log entries in one AppendEntries (openraft's default is 300). Under a burst, an
    /// entry is a batch of up to 512 submissions; 300 of them took a loaded follower 80–120 ms
    /// to accept, and while it does, the leader sends that follower nothing else (not even a
    /// heartbeat): smaller batches keep the gaps short.
    pub const MAX_ENTRIES_PER_APPEND: u64 = 32;
    /// sled's page cache. Its own default (1 GiB) kept the latest snapshot, a single value of
    /// hundreds of megabytes with a million job records, resident next to the state it was
    /// made from; the log's recent entries fit in far less.
    pub const SLED_CACHE_BYTES: u64 = 64 * 1024 * 1024;
    pub const KEEP_BEHIND_SNAPSHOT: u64 = 1_000;
    /// Agents stop their workloads after 5 s without a successful heartbeat; the control plane
    /// requeues a silent node's work 5 s after that (time for a fenced agent to kill them).
    pub const NODE_LEASE_MS: u64 = 5_000;
    pub const NODE_GRACE_MS: u64 = 5_000;
    pub const AGENT_HEARTBEAT_MS: u64 = 1_000;
    pub const SCHEDULE_INTERVAL_MS: u64 = 100;
    /// A pending job rises one priority level per this much eligible waiting.
    pub const AGING_STEP_SECS: u64 = 30 * 60;
    pub const BACKFILL: bool = true;
    pub const PREEMPTION: bool = true;
    /// FGD with the look-ahead over arrivals (`scheduler::frag::horizon_waste`): ahead of
    /// plain FGD on the shared trace and on every synthetic variant of it measured
    /// (docs/SCHEDULING.md), at the same pass time (`bench scheduler --placement-score`).
    pub const PLACEMENT_SCORE: &'static str = "fgd-h";
    /// Finished jobs keep their full record (spec, history, placement) for an hour (Slurm's
    /// MinJobAge is 5 minutes)...
    pub const FINISHED_JOB_RETENTION_SECS: u64 = 3600;
    /// ...and at most 50,000 of them do, so a burst of short jobs cannot grow the state.
    pub const MAX_FINISHED_JOBS: u64 = 50_000;
    /// Then an archived record (final state, reason, times, idempotency key) is kept for a
    /// week: the window in which a retry with the same idempotency key finds the job...
    pub const ARCHIVE_RETENTION_SECS: u64 = 7 * 24 * 3600;
    /// ...for at most a million jobs (a few hundred bytes each; `gpuctl bench memory`).
    pub const MAX_ARCHIVED_JOBS: u64 = 1_000_000;
    /// The audit trail keeps who-did-what for 30 days...
    pub const AUDIT_RETENTION_SECS: u64 = 30 * 24 * 3600;
    /// ...and at most this many records (a couple of hundred bytes each), the oldest dropped
    /// first: every start and exit an agent reports is a record, so a busy cluster reaches the
    /// count long before the age.
    pub const MAX_AUDIT_RECORDS: u64 = 200_000;
    /// How often the leader checks whether finished jobs are due for compaction.
    pub const COMPACTION_INTERVAL_MS: u64 = 60_000;
    /// `cluster add` promotes a learner to voter once it is at most this many entries behind
    /// the leader's last log index...
    pub const PROMOTE_MAX_LAG: u64 = 64;
    /// ...and has stayed that close, answering every call, for this long.
    pub const PROMOTE_STABLE_MS: u64 = 1_000;
    /// A replica being added that has not answered the leader for this long is not added
    /// (the learner is removed again); a membership change that has not committed after this
    /// long is answered with `DeadlineExceeded` (it stays proposed).
    pub const MEMBER_ANSWER_TIMEOUT_MS: u64 = 5_000;
    /// A learner that answers but has not caught up within this long is not promoted.
    pub const CATCH_UP_TIMEOUT_SECS: u64 = 600;
    pub const LOG_FILTER: &'static str =
        "info,openraft=off,sled=warn,h2=warn,tower=warn,hyper=warn";
}

/// Flags of `control-plane` (and of `gpuctl dev`'s child replicas).
#[derive(Debug, Clone, Default, clap::Args, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReplicaArgs {
    /// TOML file with any of these settings (flags win over the file).
    #[arg(long, value_name = "FILE")]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// This replica's id (a positive integer, unique in the cluster).
    #[arg(long)]
    pub id: Option<NodeId>,
    /// Address to serve clients and peers on.
    #[arg(long, value_name = "HOST:PORT")]
    pub listen: Option<String>,
    /// Address peers and clients should use to reach this replica (defaults to --listen).
    #[arg(long, value_name = "HOST:PORT")]
    pub advertise: Option<String>,
    /// Initial members, `ID=HOST:PORT,...`, including this replica. The lowest id bootstraps
    /// the cluster on first start.
    #[arg(long, value_name = "ID=HOST:PORT,...")]
    pub peers: Option<String>,
    /// Join an existing cluster through any of its replicas (also how a replica whose data was
    /// lost comes back).
    #[arg(long, value_name = "HOST:PORT")]
    pub join: Option<String>,
    /// Directory for the Raft log, snapshots and metadata.
    #[arg(long, value_name = "DIR")]
    pub data_dir: Option<PathBuf>,
    /// Cluster name: recorded in the data directory and checked on every peer RPC.
    #[arg(long)]
    pub cluster: Option<String>,
    #[arg(long, value_name = "MS")]
    pub heartbeat_ms: Option<u64>,
    #[arg(long, value_name = "MS")]
    pub election_min_ms: Option<u64>,
    #[arg(long, value_name = "MS")]
    pub election_max_ms: Option<u64>,
    /// Build a snapshot (and purge the log behind it) every this many entries.
    #[arg(long, value_name = "ENTRIES")]
    pub snapshot_every: Option<u64>,
    /// Node lease: an agent that cannot heartbeat for this long stops its workloads.
    #[arg(long, value_name = "MS")]
    pub node_lease_ms: Option<u64>,
    /// Grace after a node's lease before its work is requeued elsewhere.
    #[arg(long, value_name = "MS")]
    pub node_grace_ms: Option<u64>,
    /// How often agents heartbeat.
    #[arg(long, value_name = "MS")]
    pub agent_heartbeat_ms: Option<u64>,
    /// Scheduling passes run on every change and at least this often.
    #[arg(long, value_name = "MS")]
    pub schedule_interval_ms: Option<u64>,
    /// Aging: a pending job rises one priority level per this many seconds of waiting; after
    /// three steps nothing new overtakes it.
    #[arg(long, value_name = "SECS")]
    pub aging_step_secs: Option<u64>,
    /// Backfill behind a blocked head job without delaying its reservation (true/false).
    #[arg(long, value_name = "BOOL")]
    pub backfill: Option<bool>,
    /// Let a blocked head job preempt lower-priority preemptible work (true/false).
    #[arg(long, value_name = "BOOL")]
    pub preemption: Option<bool>,
    /// Placement score: fgd-h (the default: FGD with a look-ahead over the arrivals for every
    /// free fragment and for CPU and memory), fgd (fragmentation-aware, as published), fgd-la
    /// (FGD with the CPU/memory look-ahead only) or best-fit.
    #[arg(long, value_name = "POLICY")]
    pub placement_score: Option<String>,
    /// Finished jobs keep their full record (spec, history) this long, then are archived.
    #[arg(long, value_name = "SECS")]
    pub finished_job_retention_secs: Option<u64>,
    /// At most this many finished jobs keep their full record (the oldest are archived first).
    #[arg(long, value_name = "JOBS")]
    pub max_finished_jobs: Option<u64>,
    /// Archived jobs (final state, idempotency key) are forgotten this long after they ended.
    #[arg(long, value_name = "SECS")]
    pub archive_retention_secs: Option<u64>,
    /// At most this many archived jobs are kept (the oldest are forgotten first).
    #[arg(long, value_name = "JOBS")]
    pub max_archived_jobs: Option<u64>,
    /// Export traces over OTLP/gRPC to this endpoint (e.g. http://localhost:4317).
    #[arg(long, value_name = "URL")]
    pub otlp_endpoint: Option<String>,
    /// Directory with this replica's TLS identity: ca.pem, cert.pem, key.pem (and crl.pem when
    /// certificates were revoked), as `gpuctl certs issue replica` writes it.
    #[arg(long, value_name = "DIR")]
    pub tls_dir: Option<PathBuf>,
    /// CA bundle (overrides the one in --tls-dir).
    #[arg(long, value_name = "FILE")]
    pub tls_ca: Option<PathBuf>,
    /// Certificate (overrides the one in --tls-dir).
    #[arg(long, value_name = "FILE")]
    pub tls_cert: Option<PathBuf>,
    /// Private key (overrides the one in --tls-dir).
    #[arg(long, value_name = "FILE")]
    pub tls_key: Option<PathBuf>,
    /// Accept client-API calls from clients without a certificate (they must give a token).
    /// Raft and agents always need certificates.
    #[arg(long, value_name = "BOOL")]
    pub client_cert_optional: Option<bool>,
    /// Serve without TLS and without authentication: anyone who reaches the port is an
    /// admin. For measuring the cost of TLS and for throwaway test networks only.
    #[arg(long)]
    #[serde(default)]
    pub insecure: bool,
    /// The audit trail keeps records this long...
    #[arg(long, value_name = "SECS")]
    pub audit_retention_secs: Option<u64>,
    /// ...and at most this many (the oldest are dropped first).
    #[arg(long, value_name = "RECORDS")]
    pub max_audit_records: Option<u64>,
    /// Also serve the gRPC health protocol, alone and in plaintext, on this address:
    /// Kubernetes' grpc probes cannot present a certificate. Readiness is served as "" and
    /// the API services' names, liveness as `liveness` (docs: deploy/kubernetes/README.md).
    #[arg(long, value_name = "HOST:PORT")]
    pub health_listen: Option<String>,
    /// Serve Prometheus metrics (`/metrics`) and HTTP probes (`/healthz`: alive, `/readyz`:
    /// a ready member that knows its leader) in plaintext on this address, e.g. 0.0.0.0:9400.
    /// Off unless given; off, the replica records no metrics at all.
    #[arg(long, value_name = "HOST:PORT")]
    pub metrics_listen: Option<String>,
    /// The status page on the --metrics-listen port (`/`, `/nodes`, `/queue`, `/jobs/ID`,
    /// `/tenants`): auto (the default) is full on an --insecure replica and off where
    /// authentication is on; summary withholds job names, commands and logs; full is refused
    /// with authentication on (docs/SECURITY.md).
    #[arg(long, value_enum, value_name = "MODE")]
    pub status_page: Option<crate::status_page::StatusPageFlag>,
    /// `cluster add` promotes a learner once it is at most this many entries behind...
    #[arg(long, value_name = "ENTRIES")]
    pub promote_max_lag: Option<u64>,
    /// ...and has stayed so, answering, for this long.
    #[arg(long, value_name = "MS")]
    pub promote_stable_ms: Option<u64>,
    /// A replica being added that does not answer for this long is not added; a membership
    /// change not committed after this long is answered with DeadlineExceeded.
    #[arg(long, value_name = "MS")]
    pub member_answer_timeout_ms: Option<u64>,
    /// A learner that has not caught up within this long is not promoted.
    #[arg(long, value_name = "SECS")]
    pub catch_up_timeout_secs: Option<u64>,
}

/// How a replica secures its port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TransportSecurity {
    /// Mutual TLS with these files; client certificates optional on the client API.
    Tls {
        files: proto::tls::TlsFiles,
        client_cert_optional: bool,
    },
    /// `--insecure`.
    Insecure,
}

/// A replica's settings, complete and checked.
#[derive(Debug, Clone)]
pub struct ReplicaConfig {
    pub id: NodeId,
    pub listen: String,
    pub advertise: String,
    pub peers: BTreeMap<NodeId, String>,
    pub join: Option<String>,
    pub data_dir: PathBuf,
    pub cluster: String,
    pub tuning: RaftTuning,
    pub leader: LeaderConfig,
    pub otlp_endpoint: Option<String>,
    /// Plaintext address serving only the gRPC health protocol (for probes).
    pub health_listen: Option<String>,
    /// Plaintext HTTP address for metrics and probes (`http`).
    pub metrics_listen: Option<String>,
    /// What the status page beside the metrics shows (`status_page`).
    pub status_page: crate::status_page::Mode,
    pub security: TransportSecurity,
    pub membership: crate::membership::MembershipSettings,
}

pub fn parse_peers(s: &str) -> anyhow::Result<BTreeMap<NodeId, String>> {
    parse_members(s, "--peers")
}

/// `ID=HOST:PORT,...` as given to `flag` (`--peers`, or a restore's `--members`).
pub fn parse_members(s: &str, flag: &str) -> anyhow::Result<BTreeMap<NodeId, String>> {
    let mut peers = BTreeMap::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (id, addr) = part
            .split_once('=')
            .with_context(|| format!("{flag} entry {part:?} is not ID=HOST:PORT"))?;
        let id: NodeId = id
            .trim()
            .parse()
            .with_context(|| format!("{flag} entry {part:?}: {id:?} is not a replica id"))?;
        if id == 0 {
            bail!("{flag} entry {part:?}: replica ids start at 1");
        }
        if !addr.contains(':') {
            bail!("{flag} entry {part:?}: {addr:?} is not HOST:PORT");
        }
        if peers.insert(id, addr.trim().to_owned()).is_some() {
            bail!("{flag} names replica {id} twice");
        }
    }
    Ok(peers)
}

fn load_file(path: &Path) -> anyhow::Result<ReplicaArgs> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading config file {}", path.display()))?;
    toml::from_str(&text).with_context(|| format!("config file {} is not valid", path.display()))
}

impl ReplicaArgs {
    /// Merges flags over the config file over the defaults, and checks the result.
    pub fn resolve(self) -> anyhow::Result<ReplicaConfig> {
        let file = match &self.config {
            Some(p) => load_file(p)?,
            None => ReplicaArgs::default(),
        };
        let id = self
            .id
            .or(file.id)
            .context("--id is required (a positive integer, unique in the cluster)")?;
        if id == 0 {
            bail!("--id must be at least 1");
        }
        let listen = self
            .listen
            .or(file.listen)
            .unwrap_or_else(|| Defaults::LISTEN.to_owned());
        let advertise = self
            .advertise
            .or(file.advertise)
            .unwrap_or_else(|| listen.clone());
        let peers = match self.peers.or(file.peers) {
            Some(p) => parse_peers(&p)?,
            None => BTreeMap::new(),
        };
        let join = self.join.or(file.join);
        if !peers.is_empty() && join.is_some() {
            bail!(
                "give either --peers (bootstrap a new cluster) or --join (join an existing one), not both"
            );
        }
        if let Some(addr) = peers.get(&id)
            && *addr != advertise
        {
            bail!("--peers lists replica {id} at {addr}, but this replica advertises {advertise}");
        }
        if !peers.is_empty() && !peers.contains_key(&id) {
            bail!("--peers does not include this replica ({id}={advertise})");
        }
        let tuning = RaftTuning {
            heartbeat_ms: self
                .heartbeat_ms
                .or(file.heartbeat_ms)
                .unwrap_or(Defaults::HEARTBEAT_MS),
            election_min_ms: self
                .election_min_ms
                .or(file.election_min_ms)
                .unwrap_or(Defaults::ELECTION_MIN_MS),
            election_max_ms: self
                .election_max_ms
                .or(file.election_max_ms)
                .unwrap_or(Defaults::ELECTION_MAX_MS),
            snapshot_every: self
                .snapshot_every
                .or(file.snapshot_every)
                .unwrap_or(Defaults::SNAPSHOT_EVERY),
            keep_behind_snapshot: Defaults::KEEP_BEHIND_SNAPSHOT,
        };
        let lease = self
            .node_lease_ms
            .or(file.node_lease_ms)
            .unwrap_or(Defaults::NODE_LEASE_MS);
        let heartbeat = self
            .agent_heartbeat_ms
            .or(file.agent_heartbeat_ms)
            .unwrap_or(Defaults::AGENT_HEARTBEAT_MS);
        if heartbeat == 0 || heartbeat * 2 > lease {
            bail!(
                "--agent-heartbeat-ms ({heartbeat}) must be positive and at most half of --node-lease-ms ({lease})"
            );
        }
        let election_max_ms = tuning.election_max_ms;
        let tls = proto::tls::TlsPaths {
            dir: self.tls_dir.or(file.tls_dir),
            ca: self.tls_ca.or(file.tls_ca),
            cert: self.tls_cert.or(file.tls_cert),
            key: self.tls_key.or(file.tls_key),
        };
        let security = match (self.insecure || file.insecure, tls.files()?) {
            (true, Some(_)) => bail!("give either --insecure or TLS files (--tls-dir), not both"),
            (true, None) => TransportSecurity::Insecure,
            (false, None) => bail!(
                "no TLS identity: give --tls-dir DIR with ca.pem, cert.pem and key.pem (`gpuctl certs init` and `gpuctl certs issue replica --name replica-{id}` make them), or --insecure to serve without TLS or authentication"
            ),
            (false, Some(files)) => {
                if files.cert.is_none() || files.key.is_none() {
                    bail!(
                        "a replica needs a certificate and key: give --tls-cert and --tls-key (or --tls-dir)"
                    );
                }
                TransportSecurity::Tls {
                    files,
                    client_cert_optional: self
                        .client_cert_optional
                        .or(file.client_cert_optional)
                        .unwrap_or(false),
                }
            }
        };
        let status_page = crate::status_page::Mode::resolve(
            self.status_page
                .or(file.status_page)
                .unwrap_or(crate::status_page::StatusPageFlag::Auto),
            matches!(security, TransportSecurity::Tls { .. }),
        )
        .map_err(anyhow::Error::msg)?;
        let audit_retention = crate::state::AuditRetention {
            max_age_ms: 1000
                * self
                    .audit_retention_secs
                    .or(file.audit_retention_secs)
                    .unwrap_or(Defaults::AUDIT_RETENTION_SECS),
            max_records: self
                .max_audit_records
                .or(file.max_audit_records)
                .unwrap_or(Defaults::MAX_AUDIT_RECORDS)
                .max(1),
        };
        Ok(ReplicaConfig {
            id,
            listen,
            advertise,
            peers,
            join,
            data_dir: self
                .data_dir
                .or(file.data_dir)
                .unwrap_or_else(|| PathBuf::from(Defaults::DATA_DIR)),
            cluster: self
                .cluster
                .or(file.cluster)
                .unwrap_or_else(|| Defaults::CLUSTER.to_owned()),
            tuning,
            leader: LeaderConfig {
                node_lease: ms(self
                    .node_lease_ms
                    .or(file.node_lease_ms)
                    .unwrap_or(Defaults::NODE_LEASE_MS)),
                node_grace: ms(self
                    .node_grace_ms
                    .or(file.node_grace_ms)
                    .unwrap_or(Defaults::NODE_GRACE_MS)),
                agent_heartbeat: ms(self
                    .agent_heartbeat_ms
                    .or(file.agent_heartbeat_ms)
                    .unwrap_or(Defaults::AGENT_HEARTBEAT_MS)),
                schedule_interval: ms(self
                    .schedule_interval_ms
                    .or(file.schedule_interval_ms)
                    .unwrap_or(Defaults::SCHEDULE_INTERVAL_MS)),
                // Two election timeouts: by then a majority without us may have elected anew.
                max_quorum_silence: ms(2 * election_max_ms),
                policy: crate::scheduler::Policy {
                    aging_step_ms: 1000
                        * self
                            .aging_step_secs
                            .or(file.aging_step_secs)
                            .unwrap_or(Defaults::AGING_STEP_SECS)
                            .max(1),
                    backfill: self
                        .backfill
                        .or(file.backfill)
                        .unwrap_or(Defaults::BACKFILL),
                    preemption: self
                        .preemption
                        .or(file.preemption)
                        .unwrap_or(Defaults::PREEMPTION),
                    scoring: match self
                        .placement_score
                        .or(file.placement_score)
                        .unwrap_or_else(|| Defaults::PLACEMENT_SCORE.to_owned())
                        .parse::<crate::scheduler::ScorePolicy>()
                    {
                        Ok(
                            p @ (crate::scheduler::ScorePolicy::Fgd
                            | crate::scheduler::ScorePolicy::FgdLookahead
                            | crate::scheduler::ScorePolicy::FgdHorizon
                            | crate::scheduler::ScorePolicy::BestFit),
                        ) => p,
                        Ok(_) => bail!(
                            "--placement-score random-fit is for the simulator only; use fgd, fgd-la, fgd-h or best-fit"
                        ),
                        Err(e) => bail!("--placement-score: {e}"),
                    },
                    ..crate::scheduler::Policy::default()
                },
                retention: JobRetention {
                    full_record_ms: 1000
                        * self
                            .finished_job_retention_secs
                            .or(file.finished_job_retention_secs)
                            .unwrap_or(Defaults::FINISHED_JOB_RETENTION_SECS),
                    max_full_records: self
                        .max_finished_jobs
                        .or(file.max_finished_jobs)
                        .unwrap_or(Defaults::MAX_FINISHED_JOBS),
                    archive_ms: 1000
                        * self
                            .archive_retention_secs
                            .or(file.archive_retention_secs)
                            .unwrap_or(Defaults::ARCHIVE_RETENTION_SECS),
                    max_archived: self
                        .max_archived_jobs
                        .or(file.max_archived_jobs)
                        .unwrap_or(Defaults::MAX_ARCHIVED_JOBS),
                },
                compaction_interval: ms(Defaults::COMPACTION_INTERVAL_MS),
                audit_retention,
            },
            otlp_endpoint: self.otlp_endpoint.or(file.otlp_endpoint),
            health_listen: self.health_listen.or(file.health_listen),
            metrics_listen: self.metrics_listen.or(file.metrics_listen),
            status_page,
            security,
            membership: crate::membership::MembershipSettings {
                max_lag: self
                    .promote_max_lag
                    .or(file.promote_max_lag)
                    .unwrap_or(Defaults::PROMOTE_MAX_LAG),
                stable: ms(self
                    .promote_stable_ms
                    .or(file.promote_stable_ms)
                    .unwrap_or(Defaults::PROMOTE_STABLE_MS)),
                answer_timeout: ms(self
                    .member_answer_timeout_ms
                    .or(file.member_answer_timeout_ms)
                    .unwrap_or(Defaults::MEMBER_ANSWER_TIMEOUT_MS)
                    .max(1)),
                catch_up_timeout: std::time::Duration::from_secs(
                    self.catch_up_timeout_secs
                        .or(file.catch_up_timeout_secs)
                        .unwrap_or(Defaults::CATCH_UP_TIMEOUT_SECS),
                ),
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peers_parse_and_bad_entries_say_what_is_wrong() {
        let p = parse_peers("1=127.0.0.1:7001, 2=127.0.0.1:7002").unwrap();
        assert_eq!(p.len(), 2);
        assert!(
            parse_peers("1=127.0.0.1:7001,1=x:1")
                .unwrap_err()
                .to_string()
                .contains("twice")
        );
        assert!(
            parse_peers("a=x:1")
                .unwrap_err()
                .to_string()
                .contains("not a replica id")
        );
        assert!(
            parse_peers("1:x")
                .unwrap_err()
                .to_string()
                .contains("ID=HOST:PORT")
        );
    }

    #[test]
    fn flags_win_over_the_file_and_defaults_fill_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("r.toml");
        std::fs::write(
            &file,
            "id = 2\nlisten = \"127.0.0.1:9000\"\ncluster = \"prod\"\n",
        )
        .unwrap();
        let args = ReplicaArgs {
            config: Some(file),
            listen: Some("127.0.0.1:9100".into()),
            insecure: true,
            ..Default::default()
        };
        let c = args.resolve().unwrap();
        assert_eq!(c.id, 2);
        assert_eq!(c.listen, "127.0.0.1:9100");
        assert_eq!(c.cluster, "prod");
        assert_eq!(c.tuning.heartbeat_ms, Defaults::HEARTBEAT_MS);
    }

    #[test]
    fn the_example_configuration_names_every_setting() {
        use clap::Args;
        let text = std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/control-plane.example.toml"),
        )
        .unwrap();
        // Set, or shown commented out with an example value.
        let named: Vec<String> = text
            .lines()
            .filter_map(|l| {
                let l = l.trim_start_matches('#').trim();
                let (key, _) = l.split_once(" = ")?;
                key.bytes()
                    .all(|b| b.is_ascii_lowercase() || b == b'_')
                    .then(|| key.to_owned())
            })
            .collect();
        let command = ReplicaArgs::augment_args(clap::Command::new("control-plane"));
        let missing: Vec<String> = command
            .get_arguments()
            .filter_map(|a| a.get_long())
            .filter(|long| !matches!(*long, "config" | "help"))
            .map(|long| long.replace('-', "_"))
            .filter(|key| !named.contains(key))
            .collect();
        assert!(
            missing.is_empty(),
            "deploy/control-plane.example.toml does not name {missing:?}"
        );
    }

    #[test]
    fn the_example_configuration_loads_and_asks_for_tls() {
        let example =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/control-plane.example.toml");
        let c = ReplicaArgs {
            config: Some(example),
            ..Default::default()
        }
        .resolve()
        .expect("the example configuration is valid");
        assert_eq!(c.cluster, "prod-gpu");
        match c.security {
            TransportSecurity::Tls {
                files,
                client_cert_optional,
            } => {
                assert_eq!(files.ca, Path::new("/etc/gpu-control-plane/tls/ca.pem"));
                assert!(!client_cert_optional);
            }
            TransportSecurity::Insecure => panic!("the example runs with TLS"),
        }
        assert_eq!(c.leader.audit_retention.max_records, 200_000);
        assert_eq!(
            c.leader.policy.scoring,
            crate::scheduler::ScorePolicy::FgdHorizon
        );
    }

    #[test]
    fn a_replica_without_tls_files_or_insecure_refuses_to_start_saying_how_to_fix_it() {
        let err = ReplicaArgs {
            id: Some(3),
            ..Default::default()
        }
        .resolve()
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("--tls-dir") && err.contains("replica-3") && err.contains("--insecure"),
            "{err}"
        );
        let err = ReplicaArgs {
            id: Some(1),
            insecure: true,
            tls_dir: Some("/x".into()),
            ..Default::default()
        }
        .resolve()
        .unwrap_err()
        .to_string();
        assert!(err.contains("not both"), "{err}");
    }

    #[test]
    fn the_status_page_comes_from_the_flag_or_the_file_and_auto_is_full_when_insecure() {
        let dir = tempfile::tempdir().unwrap();
        let insecure = |page: Option<crate::status_page::StatusPageFlag>| ReplicaArgs {
            id: Some(1),
            data_dir: Some(dir.path().to_owned()),
            insecure: true,
            status_page: page,
            ..Default::default()
        };
        use crate::status_page::{Mode, StatusPageFlag};
        assert_eq!(insecure(None).resolve().unwrap().status_page, Mode::Full);
        assert_eq!(
            insecure(Some(StatusPageFlag::Summary))
                .resolve()
                .unwrap()
                .status_page,
            Mode::Summary
        );
        let file = dir.path().join("r.toml");
        std::fs::write(&file, "status_page = \"off\"\n").unwrap();
        let c = ReplicaArgs {
            config: Some(file.clone()),
            ..insecure(None)
        };
        assert_eq!(c.resolve().unwrap().status_page, Mode::Off);
        std::fs::write(&file, "status_page = \"loud\"\n").unwrap();
        let c = ReplicaArgs {
            config: Some(file),
            ..insecure(None)
        };
        assert!(c.resolve().is_err());
    }

    #[test]
    fn unknown_keys_in_the_file_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("r.toml");
        std::fs::write(&file, "id = 1\nlisen = \"x\"\n").unwrap();
        let err = ReplicaArgs {
            config: Some(file),
            ..Default::default()
        }
        .resolve()
        .unwrap_err();
        assert!(format!("{err:#}").contains("lisen"), "{err:#}");
    }
}
