//! Target `request`: raw bytes decoded as the gRPC requests that carry the most user data —
//! `SubmitJobRequest` (client API), `RegisterNodeRequest` and `AllocationReport` (agent API) —
//! and taken through what the handlers do with them: the wire → domain conversion, the
//! validation and state checks the API runs before it proposes, then the command applied to a
//! copy of the fleet (`fleet`).
//!
//! The first byte picks the message (0: submit, 1: register, 2: report; modulo 3), the rest
//! is the protobuf. Checks: nothing panics; a submission the API accepts is accepted by apply
//! (the two agree); an accepted spec survives domain → wire → domain unchanged; the state
//! stays consistent after every apply (`dst::check::check_state`).
//!
//! The agent handlers' own steps are the functions `api/agent_service.rs` runs
//! (`node_spec_from_proto`, `fence_grace_refusal`, `allocation_node_refusal`,
//! `report_command`); only the replica around them is left out.

use prost::Message;
use proto::agent as pa;
use proto::v1 as pb;

use super::fleet::{self, Fleet};
use super::{Features, Target, shape};
use crate::api::agent_service::{
    allocation_node_refusal, fence_grace_refusal, node_spec_from_proto, report_command,
};
use crate::api::{assignments_for, convert};
use crate::config::Defaults;
use crate::dst::check::check_state;
use crate::scheduler;
use crate::state::validate::{validate_idempotency_key, validate_job_spec, validate_node_spec};
use crate::state::{Command, Outcome, Rejection};

pub const TARGET: Target = Target {
    name: "request",
    about: "SubmitJobRequest / RegisterNodeRequest / AllocationReport bytes → prost decode → \
            conversion and validation → apply on the fleet; API and apply agree, state consistent",
    max_len: 4096,
    dictionary: &[
        b"\x0a",
        b"\x12",
        b"\x1a",
        b"\x22",
        b"\x28",
        b"\x30",
        b"\x38",
        b"\x40",
        b"\x48",
        b"\x50",
        b"\x58",
        b"\x62",
        b"\x68",
        b"\x70",
        b"\x78",
        b"\xff\xff\xff\xff\x0f",
        b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01",
        b"\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01",
        b"ta",
        b"tb",
        b"n0",
        b"n1",
        b"n2",
        b"gpu",
        b"H100",
        b"A100",
        b"GPU-n0-0",
        b"GPU-n2-7",
        b"MIG-n1-1-0",
        b"1g.10gb",
        b"3g.40gb",
        b"7g.80gb",
        b"high",
        b"low",
        b"inc-0",
    ],
    seeds,
    run,
};

const SUBMIT: u8 = 0;
const REGISTER: u8 = 1;
const REPORT: u8 = 2;

fn tagged(kind: u8, message: &impl Message) -> Vec<u8> {
    let mut out = vec![kind];
    message.encode(&mut out).expect("a Vec grows as needed");
    out
}

fn seeds() -> Vec<Vec<u8>> {
    let f = fleet::fleet();
    let mut out = Vec::new();
    let specs = [
        fleet::job("ta", 1, 2),
        crate::state::JobSpec {
            gpu_milli: 250,
            gpu_memory_mib: 4096,
            ..fleet::job("tb", 1, 1)
        },
        crate::state::JobSpec {
            mig_profile: Some("3g.40gb".into()),
            partition: None,
            ..fleet::job("ta", 1, 1)
        },
        crate::state::JobSpec {
            partition: Some(fleet::PARTITION.into()),
            time_limit_secs: Some(3600),
            dependencies: vec![crate::state::Dependency {
                kind: crate::state::DependencyKind::AfterAny,
                job: 5,
            }],
            single_numa: true,
            priority_class: "high".into(),
            ..fleet::job("tb", 2, 4)
        },
    ];
    for (i, spec) in specs.iter().enumerate() {
        let req = pb::SubmitJobRequest {
            spec: Some(convert::job_spec_to_proto(spec)),
            idempotency_key: if i % 2 == 0 {
                format!("key-{i}")
            } else {
                String::new()
            },
        };
        out.push(tagged(SUBMIT, &req));
    }
    // A retry of a job the fleet holds.
    out.push(tagged(
        SUBMIT,
        &pb::SubmitJobRequest {
            spec: Some(convert::job_spec_to_proto(&f.state.jobs[&1].spec)),
            idempotency_key: "first".into(),
        },
    ));
    for k in 0..fleet::NODES.len() {
        let mut req = convert::registration_from_spec(&fleet::node_spec(k));
        req.fence_grace_ms = 2000;
        out.push(tagged(REGISTER, &req));
    }
    let mut new_node = fleet::node_spec(0);
    new_node.name = "n3".into();
    for (i, g) in new_node.gpus.iter_mut().enumerate() {
        g.uuid = fleet::gpu_uuid("n3", i as u32);
    }
    out.push(tagged(
        REGISTER,
        &convert::registration_from_spec(&new_node),
    ));
    for rec in f.state.allocations.values() {
        for event in [1, 2, 3, 5, 6] {
            let req = pa::AllocationReport {
                node: rec.allocation.node.clone(),
                allocation_id: rec.allocation.id,
                event,
                exit_code: 1,
                has_exit_code: event == 3,
                signal: if event == 3 { 9 } else { 0 },
                reason: "seed".into(),
                usage: None,
            };
            out.push(tagged(REPORT, &req));
        }
    }
    out
}

fn run(input: &[u8], features: &mut Features) -> Result<(), String> {
    let Some((&kind, body)) = input.split_first() else {
        return Ok(());
    };
    match kind % 3 {
        SUBMIT => submit(body, features),
        REGISTER => register(body, features),
        _ => report(body, features),
    }
}

/// Records a rejection as a feature; hostile input is supposed to get them.
fn rejected(features: &mut Features, step: &str, r: &Rejection) -> Result<(), String> {
    features.add((step, r.kind as u8, r.field.clone(), shape(&r.message, 4)));
    Ok(())
}

fn consistent(state: &crate::state::ClusterState, after: &str) -> Result<(), String> {
    match check_state(0, state).into_iter().next() {
        Some((invariant, evidence)) => Err(format!("after {after}: {invariant}: {evidence}")),
        None => Ok(()),
    }
}

/// `ControlPlane::submit_job` as an administrator calls it.
fn submit(body: &[u8], features: &mut Features) -> Result<(), String> {
    let Ok(req) = pb::SubmitJobRequest::decode(body) else {
        features.add("submit: does not decode");
        return Ok(());
    };
    let mut spec = match convert::job_spec_from_proto(req.spec) {
        Ok(spec) => spec,
        Err(r) => return rejected(features, "convert", &r),
    };
    if spec.tenant.is_empty() {
        // An administrator's token has no tenant scope.
        spec.tenant = "default".into();
    }
    if let Err(r) = validate_job_spec(&spec) {
        return rejected(features, "validate", &r);
    }
    let key = if req.idempotency_key.is_empty() {
        None
    } else {
        if let Err(r) = validate_idempotency_key(&req.idempotency_key) {
            return rejected(features, "key", &r);
        }
        Some(req.idempotency_key)
    };
    let f = fleet::fleet();
    let known = key
        .as_deref()
        .and_then(|k| f.state.job_for_key(&spec.tenant, k));
    if known.is_none()
        && let Err(r) = f.state.check_submission(&spec)
    {
        return rejected(features, "check_submission", &r);
    }
    let back = convert::job_spec_from_proto(Some(convert::job_spec_to_proto(&spec)));
    if back.as_ref() != Ok(&spec) {
        return Err(format!(
            "the accepted spec does not survive domain → wire → domain: {spec:?} came back as {back:?}"
        ));
    }
    let mut f = f.clone();
    let applied = f.apply(&Command::submit(spec, key).by(fleet::admin()), 1000);
    match &applied.outcome {
        Outcome::JobSubmitted { id, created } => {
            features.add(("submitted", *created, f.state.jobs.get(id).map(|j| j.state)));
            if let Some(job) = f.state.jobs.get(id) {
                let mut wire = convert::job_to_proto(job, &f.state);
                convert::redact_job(&mut wire);
            }
        }
        Outcome::Rejected(r) if known.is_none() => {
            return Err(format!(
                "the API accepted a submission that apply rejects: {r}"
            ));
        }
        other => features.add(("retry", format!("{other:?}").len() % 7)),
    }
    consistent(&f.state, "a submission")?;
    schedule(&mut f, features)
}

/// One scheduling pass on `f`, applied as the leader would: its plan, then its preemptions.
fn schedule(f: &mut Fleet, features: &mut Features) -> Result<(), String> {
    let plan = scheduler::plan(&f.state, f.at);
    features.add(("plan", plan.placements.len(), plan.preemptions.len()));
    let applied = f.apply(
        &Command::Place {
            term: fleet::TERM,
            placements: plan.placements,
        },
        100,
    );
    if let Outcome::Placed { rejected, .. } = &applied.outcome {
        for (_, why) in rejected {
            features.add(("plan rejected", shape(why, 4)));
        }
    }
    consistent(&f.state, "the scheduler's plan")?;
    for p in plan.preemptions {
        f.apply(
            &Command::Preempt {
                for_job: p.for_job,
                victims: p.victims,
                reason: "fuzz".into(),
            },
            100,
        );
        consistent(&f.state, "a preemption")?;
    }
    Ok(())
}

/// `AgentService::register_node` for the node the request names.
fn register(body: &[u8], features: &mut Features) -> Result<(), String> {
    let Ok(req) = pa::RegisterNodeRequest::decode(body) else {
        features.add("register: does not decode");
        return Ok(());
    };
    if fence_grace_refusal(req.fence_grace_ms, Defaults::NODE_GRACE_MS).is_some() {
        features.add("register: fence grace too long");
        return Ok(());
    }
    let spec = node_spec_from_proto(req);
    if let Err(r) = validate_node_spec(&spec) {
        return rejected(features, "validate_node_spec", &r);
    }
    let name = spec.name.clone();
    let mut f = fleet::fleet().clone();
    let applied = f.apply(
        &Command::RegisterNode { spec }.by(fleet::agent(&name)),
        1000,
    );
    match &applied.outcome {
        Outcome::Rejected(r) => return rejected(features, "register apply", r),
        other => features.add(("registered", format!("{other:?}"))),
    }
    consistent(&f.state, "a registration")?;
    let assignments = assignments_for(&f.state, &name, fleet::TERM);
    features.add(("assignments", assignments.allocations.len()));
    if let Some(node) = f.state.nodes.get(&name) {
        convert::node_to_proto(node, &f.state);
    }
    schedule(&mut f, features)
}

/// `AgentService::report_allocation` from the node the report names.
fn report(body: &[u8], features: &mut Features) -> Result<(), String> {
    let Ok(req) = pa::AllocationReport::decode(body) else {
        features.add("report: does not decode");
        return Ok(());
    };
    let f = fleet::fleet();
    if allocation_node_refusal(&f.state, req.allocation_id, &req.node).is_some() {
        features.add("report: another node's allocation");
        return Ok(());
    }
    let node = req.node.clone();
    let command = match report_command(req, true) {
        Ok(command) => command,
        Err(r) => return rejected(features, "report_command", &r),
    };
    let mut f = f.clone();
    let applied = f.apply(&command.by(fleet::agent(&node)), 1000);
    match &applied.outcome {
        Outcome::Rejected(r) => rejected(features, "report apply", r)?,
        other => features.add(("reported", format!("{other:?}"), applied.changed_jobs.len())),
    }
    consistent(&f.state, "a report")?;
    schedule(&mut f, features)
}
