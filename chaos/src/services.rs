//! The run's long-running service, beside the batch workload: created at the start, then
//! scaled and rolled out to new revisions while the faults happen, and deleted once the final
//! state is recorded (so its replicas, which run until stopped, do not outlive the run).
//! Its replicas crash now and then (`exit 3` after a while) and are restarted in place.
//!
//! Every change is recorded (`Event::ServiceChange`) with when it was sent and answered, so the
//! checker knows the most copies the service may have run at any moment (`replicas +
//! max_surge`); the history's process starts and stops say what the hosts really ran.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use control_plane::client::{Client, Credentials, with_timeout};
use proto::v1 as pb;

use crate::history::{Event, Recorder, ServiceView, now_ms};
use crate::workload::Rng;

/// The service's tenant (the one without a GPU limit) and name.
pub const TENANT: &str = "team-c";
pub const NAME: &str = "chaos-svc";

/// One replica's share of a GPU, and how many replicas the service starts with.
const GPU_MILLI: u32 = 500;
const REPLICAS: u32 = 3;
const MAX_SURGE: u32 = 1;

fn template(version: u32, crash_after_s: u32) -> pb::JobSpec {
    pb::JobSpec {
        tenant: TENANT.into(),
        name: NAME.into(),
        // Runs until stopped, except that it exits with an error after a while: each replica
        // is restarted in place a few times during a run.
        command: vec![
            "sh".into(),
            "-c".into(),
            format!("sleep {crash_after_s}; exit 3"),
        ],
        gpus_per_task: 1,
        tasks: 1,
        gpu_milli: GPU_MILLI,
        priority_class: "normal".into(),
        env: [("VERSION".to_owned(), version.to_string())].into(),
        ..Default::default()
    }
}

fn spec(replicas: u32, version: u32) -> pb::ServiceSpec {
    pb::ServiceSpec {
        tenant: TENANT.into(),
        name: NAME.into(),
        template: Some(template(version, 25)),
        replicas,
        strategy: Some(pb::RolloutStrategy {
            max_surge: Some(MAX_SURGE),
            max_unavailable: Some(1),
            progress_deadline_ms: 0,
        }),
        // A replica that ran 10 s before it crashed counts the crash as its first: it is
        // restarted at once, never held back by a growing back-off.
        restart: Some(pb::RestartPolicy {
            backoff_initial_ms: 500,
            backoff_max_ms: 5_000,
            crash_loop_after: 5,
            reset_after_ms: 10_000,
        }),
        ..Default::default()
    }
}

/// One change the client makes.
#[derive(Debug, Clone, Copy)]
enum Change {
    Create,
    Scale(u32),
    Update(u32),
}

/// Creates the service, then makes a change every `every` until `stop`: scales between 2 and 4
/// replicas and rolls out new revisions, each retried until it is answered.
pub async fn run(
    addrs: Vec<String>,
    credentials: Credentials,
    recorder: Recorder,
    every: Duration,
    seed: u64,
    stop: Arc<AtomicBool>,
) {
    let Ok(mut client) = Client::new(&addrs, &credentials) else {
        return;
    };
    client.attempt_timeout = Duration::from_millis(800);
    client.deadline = Duration::from_secs(10);
    let mut rng = Rng::new(seed ^ 0x5E41_1CE5);
    let (mut replicas, mut version) = (REPLICAS, 0);
    let mut change = Change::Create;
    while !stop.load(Ordering::Relaxed) {
        let at_ms = now_ms();
        let answered = send(&mut client, change, replicas).await;
        recorder.record(&Event::ServiceChange {
            at_ms,
            service: format!("{TENANT}/{NAME}"),
            change: format!("{change:?}"),
            replicas,
            max_surge: MAX_SURGE,
            answered_ms: answered.then(now_ms),
        });
        if !answered {
            // Not known to have applied: the next try sends the same change again.
            continue;
        }
        tokio::time::sleep(every).await;
        change = if rng.below(2) == 0 {
            replicas = 2 + rng.below(3) as u32;
            Change::Scale(replicas)
        } else {
            version += 1;
            Change::Update(version)
        };
    }
}

/// Sends one change, retrying across replicas until the client's deadline; whether it was
/// answered.
async fn send(client: &mut Client, change: Change, replicas: u32) -> bool {
    let result = match change {
        Change::Create | Change::Update(_) => {
            let version = match change {
                Change::Update(v) => v,
                _ => 0,
            };
            let req = pb::PutServiceRequest {
                spec: Some(spec(replicas, version)),
                create_only: false,
            };
            client
                .call(|mut c, t| {
                    let r = req.clone();
                    async move { c.put_service(with_timeout(r, t)).await }
                })
                .await
        }
        Change::Scale(n) => {
            let req = pb::ScaleServiceRequest {
                service: Some(name()),
                replicas: n,
                reason: "chaos workload".into(),
            };
            client
                .call(|mut c, t| {
                    let r = req.clone();
                    async move { c.scale_service(with_timeout(r, t)).await }
                })
                .await
        }
    };
    result.is_ok()
}

fn name() -> pb::ServiceName {
    pb::ServiceName {
        tenant: TENANT.into(),
        name: NAME.into(),
    }
}

/// Every service as the cluster has it now.
pub async fn list(client: &mut Client) -> Result<Vec<ServiceView>, tonic::Status> {
    client
        .call(|mut c, t| async move {
            c.list_services(with_timeout(pb::ListServicesRequest::default(), t))
                .await
        })
        .await
        .map(|r| r.services.iter().map(ServiceView::from_proto).collect())
}

/// Deletes the service and waits (up to `timeout`) until it is gone: its replicas, which run
/// until stopped, must not outlive the run. Whether it is gone.
pub async fn delete_and_wait(client: &mut Client, timeout: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + timeout;
    let req = pb::DeleteServiceRequest {
        service: Some(name()),
    };
    while tokio::time::Instant::now() < deadline {
        let _ = client
            .call(|mut c, t| {
                let r = req.clone();
                async move { c.delete_service(with_timeout(r, t)).await }
            })
            .await;
        if let Ok(services) = list(client).await
            && services.is_empty()
        {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    false
}
