//! Runs one replica: opens and checks the data directory, starts Raft and serves the client
//! API and the peer RPCs on one address, bootstraps or joins the cluster, and shuts down
//! cleanly when `shutdown` resolves.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use openraft::BasicNode;
use proto::raft::raft_peer_server::RaftPeerServer;
use proto::v1::control_plane_client::ControlPlaneClient;
use proto::v1::control_plane_server::ControlPlaneServer;
use tokio::net::TcpListener;

use crate::api::auth::Security;
use crate::api::{AgentService, ControlPlaneService, MAX_REQUEST_BYTES};
use crate::config::{ReplicaConfig, TransportSecurity};
use crate::datadir::DataDir;
use crate::leader::Liveness;
use crate::raft::Raft;
use crate::raft::log_store::LogStore;
use crate::raft::network::PeerNetwork;
use crate::raft::peer_service::PeerService;
use crate::raft::peers::PeerState;
use crate::raft::state_machine::StateMachineStore;
use crate::replica::{Clock, Replica};
use proto::agent::agent_api_server::AgentApiServer;
use proto::tls::{ClientAuth, ExpectedPeer, TlsContext};
use proto::transport::Transport;

/// Raft messages can carry snapshot chunks and batches of entries.
const MAX_PEER_MESSAGE_BYTES: usize = 256 * 1024 * 1024;

/// How often a replica or agent looks at its TLS files for a change (SIGHUP rereads at once).
pub const TLS_RELOAD_INTERVAL: Duration = Duration::from_secs(2);
/// How long a stopping replica lets open calls finish once it has left Raft. Assignment
/// streams end by themselves within a leadership check; a client's watch does not, and is cut.
const DRAIN_LIMIT: Duration = Duration::from_secs(2);

/// Loads the replica's TLS identity and checks that it is this replica's certificate.
fn load_transport(config: &ReplicaConfig) -> anyhow::Result<Transport> {
    match &config.security {
        TransportSecurity::Insecure => {
            tracing::warn!(
                "running with --insecure: no TLS, no authentication; anyone who reaches {} can act as an admin, register as a GPU node or join Raft",
                config.listen
            );
            Ok(Transport::Plain)
        }
        TransportSecurity::Tls {
            files,
            client_cert_optional,
        } => {
            let auth = if *client_cert_optional {
                ClientAuth::Optional
            } else {
                ClientAuth::Required
            };
            let ctx = TlsContext::load(files.clone(), auth).context("loading TLS files")?;
            let id = ctx
                .identity()
                .context("a replica needs a certificate and key")?;
            let expected = format!("replica-{}", config.id);
            if id.role != proto::tls::CertRole::Replica || id.name != expected {
                bail!(
                    "the certificate in {} is the {id}, not replica {}'s; issue one with `gpuctl certs issue replica --name {expected}`",
                    files.cert.as_deref().unwrap_or(&files.ca).display(),
                    config.id
                );
            }
            tracing::info!(identity = %id, "TLS on; client certificates {}", if *client_cert_optional { "optional (tokens suffice)" } else { "required" });
            Ok(Transport::Tls(ctx))
        }
    }
}

pub async fn run(
    config: ReplicaConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let transport = load_transport(&config)?;
    // First, so that probes see "live, not ready" while a large data directory opens.
    let health = crate::health::ReplicaHealth::new().await;
    let health_port = match &config.health_listen {
        Some(addr) => Some(health.serve_plaintext(addr).await?.1),
        None => None,
    };
    let dir = DataDir::open(&config.data_dir, &config.cluster, config.id)?;
    let metrics = Arc::new(match config.metrics_listen {
        Some(_) => crate::metrics::ReplicaMetrics::enabled(config.id),
        None => crate::metrics::ReplicaMetrics::disabled(),
    });
    let log = LogStore::open(&dir.db)
        .map_err(|e| dir.corrupt(e.to_string()))?
        .with_flush_histogram(metrics.log_flush_histogram());
    log.verify().map_err(|e| dir.corrupt(e))?;
    let sm = StateMachineStore::open(&dir.db).map_err(|e| dir.corrupt(e))?;
    let committed = log.committed_index();

    // Bind before starting Raft so that a port conflict is reported before anything else runs.
    let listener = TcpListener::bind(&config.listen)
        .await
        .with_context(|| format!("cannot listen on {}", config.listen))?;
    let metrics_listener = match &config.metrics_listen {
        Some(addr) => Some(node_agent::observe::bind(addr).await?),
        None => None,
    };

    let raft_config = Arc::new(config.tuning.openraft_config(&config.cluster)?);
    let peers = Arc::new(PeerState::for_timing(
        config.tuning.heartbeat_ms,
        config.tuning.election_max_ms,
    ));
    let network = PeerNetwork {
        cluster: config.cluster.clone(),
        transport: transport.clone(),
        peers: peers.clone(),
    };
    let security = Arc::new(Security::new(transport.tls().cloned()));
    let raft = Raft::new(config.id, raft_config, network, log, sm.clone())
        .await
        .context("starting Raft")?;
    let replica = Arc::new(
        Replica::new(
            config.id,
            config.cluster.clone(),
            config.advertise.clone(),
            raft.clone(),
            sm,
            committed,
            Clock::System,
            transport.clone(),
            security.clone(),
        )
        .with_membership(peers.clone(), config.membership.clone())
        .with_metrics(metrics.clone()),
    );
    let removal_watcher = crate::membership::spawn_watcher(replica.clone());
    let health_reporter = health.spawn_reporter(
        replica.clone(),
        crate::health::HealthSettings::for_config(&config),
    );
    let reloader = transport
        .tls()
        .map(|t| t.spawn_reloader(TLS_RELOAD_INTERVAL));
    tracing::info!(
        id = config.id,
        listen = %config.listen,
        data_dir = %dir.path.display(),
        fresh = dir.fresh,
        cluster = %config.cluster,
        "replica starting"
    );

    let peer_service = RaftPeerServer::new(PeerService {
        id: config.id,
        cluster: config.cluster.clone(),
        raft: raft.clone(),
        security,
        peers,
    })
    .max_decoding_message_size(MAX_PEER_MESSAGE_BYTES)
    .max_encoding_message_size(MAX_PEER_MESSAGE_BYTES);
    let api = ControlPlaneServer::new(ControlPlaneService::new(replica.clone()))
        .max_decoding_message_size(MAX_REQUEST_BYTES);
    let liveness = Arc::new(Liveness::default());
    let agent_api = AgentApiServer::new(AgentService::new(
        replica.clone(),
        liveness.clone(),
        config.leader.clone(),
    ))
    .max_decoding_message_size(MAX_REQUEST_BYTES);
    let metrics_port = match metrics_listener {
        Some(listener) => {
            let state = crate::http::HttpState {
                replica: replica.clone(),
                metrics: metrics.clone(),
                liveness: liveness.clone(),
                health: crate::health::HealthSettings::for_config(&config),
                agent_heartbeat: config.leader.agent_heartbeat,
                status_page: config.status_page,
            };
            let (bound, task) =
                node_agent::observe::serve_on(listener, crate::http::router(state))?;
            tracing::info!(%bound, "metrics and probes on http://{bound}/metrics");
            if config.status_page != crate::status_page::Mode::Off {
                tracing::info!(%bound, mode = config.status_page.as_str(), "status page on http://{bound}/");
            }
            Some((
                task,
                crate::metrics::spawn_leader_watch(raft.clone(), metrics.clone()),
            ))
        }
        None => None,
    };
    let leader_loops = crate::leader::spawn(replica.clone(), liveness, config.leader.clone());
    let (drain_tx, drain_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tonic::transport::Server::builder()
        .tcp_nodelay(true)
        .trace_fn(|req| tracing::debug_span!("grpc", path = %req.uri().path()))
        .add_service(peer_service)
        .add_service(api)
        .add_service(agent_api)
        .add_service(health.service())
        .serve_with_incoming_shutdown(transport.incoming(listener), async move {
            let _ = drain_rx.await;
        });
    let mut server = tokio::spawn(server);
    let stopper = tokio::spawn(stop_on(
        shutdown,
        config.id,
        raft.clone(),
        drain_tx,
        server.abort_handle(),
    ));

    if dir.fresh && config.peers.keys().next() == Some(&config.id) {
        bootstrap(&raft, &config.peers).await?;
    }
    let join = match config.join.clone() {
        Some(addr) => {
            let (id, advertise) = (config.id, config.advertise.clone());
            let transport = transport.clone();
            let timeout = config.membership.longest_add() + Duration::from_secs(60);
            Some(tokio::spawn(async move {
                join_cluster(&transport, &addr, id, &advertise, timeout).await
            }))
        }
        None => None,
    };

    let served = match join {
        Some(mut join) => {
            tokio::select! {
                r = &mut server => r,
                j = &mut join => {
                    match j {
                        Ok(Ok(())) => server.await,
                        Ok(Err(e)) => { server.abort(); raft.shutdown().await.ok(); return Err(e); }
                        Err(e) => { server.abort(); raft.shutdown().await.ok(); bail!("join task failed: {e}"); }
                    }
                }
            }
        }
        None => server.await,
    };
    // Cut at the end of the drain: calls still open were given up on, not failed.
    let served = match served {
        Err(e) if e.is_cancelled() => Ok(Ok(())),
        other => other,
    };
    tracing::info!(id = config.id, "replica stopping");
    stopper.abort();
    leader_loops.abort();
    removal_watcher.abort();
    health_reporter.abort();
    if let Some(h) = health_port {
        h.abort();
    }
    if let Some((port, watch)) = metrics_port {
        port.abort();
        watch.abort();
    }
    if let Some(r) = reloader {
        r.abort();
    }
    raft.shutdown().await.ok();
    served
        .context("server task panicked")?
        .context("serving gRPC")?;
    Ok(())
}

/// On `shutdown` (SIGTERM), leaves Raft first and only then stops serving. Stopping the server
/// first would leave a leader that refuses every call yet goes on leading (its heartbeats still
/// reach the followers, so none of them campaigns), and whose graceful shutdown waits for its
/// agents' assignment streams, which end only once it stops leading: no write and no agent
/// heartbeat anywhere until the process is killed, and every agent fencing its jobs once its
/// lease runs out. Leaving Raft first lets the others elect a leader at once (a rolling
/// upgrade's or restart's write gap is one election) and ends the streams; what is still open
/// after [`DRAIN_LIMIT`] is cut.
async fn stop_on(
    shutdown: impl Future<Output = ()> + Send,
    id: u64,
    raft: Raft,
    drain: tokio::sync::oneshot::Sender<()>,
    server: tokio::task::AbortHandle,
) {
    shutdown.await;
    tracing::info!(
        id,
        "replica stopping: leaving Raft, then draining connections"
    );
    if let Err(e) = raft.shutdown().await {
        tracing::warn!(id, error = %e, "Raft did not shut down cleanly");
    }
    let _ = drain.send(());
    tokio::time::sleep(DRAIN_LIMIT).await;
    tracing::warn!(id, limit = ?DRAIN_LIMIT, "calls still open after the drain limit; cutting them");
    server.abort();
}

/// Initializes a brand-new cluster with every member of `--peers`. Only the lowest id does
/// this, and only on a fresh data directory, so a restarted replica never re-bootstraps.
async fn bootstrap(raft: &Raft, peers: &BTreeMap<u64, String>) -> anyhow::Result<()> {
    let members: BTreeMap<u64, BasicNode> = peers
        .iter()
        .map(|(id, addr)| (*id, BasicNode::new(addr.clone())))
        .collect();
    match raft.initialize(members).await {
        Ok(()) => {
            tracing::info!(members = ?peers, "bootstrapped a new cluster");
            Ok(())
        }
        Err(e)
            if matches!(
                e.api_error(),
                Some(openraft::error::InitializeError::NotAllowed(_))
            ) =>
        {
            Ok(())
        }
        Err(e) => bail!("bootstrapping the cluster failed: {e}"),
    }
}

/// Asks the cluster (through any replica) to add this replica, retrying until a leader accepts.
/// Errors that retrying cannot fix (a conflicting id or address, a certificate the cluster
/// refuses) end the replica. The request goes over this replica's own certificate, which may
/// add only itself. The leader answers once this replica has caught up and become a voter
/// (or says why not: it could not reach `advertise`, say), so each try may take `timeout`.
async fn join_cluster(
    transport: &Transport,
    via: &str,
    id: u64,
    advertise: &str,
    timeout: Duration,
) -> anyhow::Result<()> {
    let channel = transport
        .channel(via, ExpectedPeer::Replica)
        .with_context(|| format!("--join address {via:?} is invalid"))?;
    let mut client = ControlPlaneClient::new(channel);
    let mut backoff = Duration::from_millis(100);
    loop {
        let mut req = tonic::Request::new(proto::v1::AddReplicaRequest {
            id,
            address: advertise.to_owned(),
            learner_only: false,
            force: false,
        });
        req.set_timeout(timeout);
        match client.add_replica(req).await {
            Ok(_) => {
                tracing::info!(via, "joined the cluster");
                return Ok(());
            }
            Err(s)
                if matches!(
                    s.code(),
                    tonic::Code::InvalidArgument
                        | tonic::Code::NotFound
                        | tonic::Code::PermissionDenied
                        | tonic::Code::Unauthenticated
                ) =>
            {
                bail!("the cluster refused to add this replica: {}", s.message());
            }
            Err(s) => {
                tracing::warn!(via, code = ?s.code(), message = s.message(), "joining failed; retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
        }
    }
}

pub use proto::transport::shutdown_signal;

/// The whole life of a replica process: configuration, telemetry, runtime, serve until a
/// signal. Shared by `control-plane` and `gpuctl dev`'s child replicas.
pub fn run_replica_process(
    args: crate::config::ReplicaArgs,
    log_filter: &str,
) -> anyhow::Result<()> {
    let config = args.resolve()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async move {
        let _telemetry =
            crate::telemetry::init("control-plane", log_filter, config.otlp_endpoint.as_deref())?;
        run(config, shutdown_signal()).await
    })
}
