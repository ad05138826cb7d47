//! Tokens, the audit trail, and what an agent's attribution lets it do: every rule is applied
//! by the state machine itself, so a leader that believed otherwise cannot break it.

use super::*;

fn actor(principal: &str, role: &str) -> Actor {
    Actor {
        principal: principal.into(),
        role: role.into(),
        tenant: None,
        from: "127.0.0.1:5000".into(),
    }
}

fn token(id: &str, role: ApiRole, tenant: Option<&str>) -> TokenRecord {
    TokenRecord {
        id: id.into(),
        secret_sha256: "ab".repeat(32),
        role,
        tenant: tenant.map(str::to_owned),
        description: "test".into(),
        created_at: 0,
        created_by: "cert:client:admin".into(),
        expires_at: None,
        revoked_at: None,
        revoked_by: None,
    }
}

const ID: &str = "0123456789abcdef";

impl Harness {
    /// A submission applied without the consistency check after it (which scans the whole
    /// state: quadratic over a hundred thousand submissions).
    fn submit_unchecked(&mut self, spec: JobSpec) -> JobId {
        self.index += 1;
        self.at += 1;
        match self
            .state
            .apply(&Command::submit(spec, None), self.at, self.index)
            .outcome
        {
            Outcome::JobSubmitted { id, .. } => id,
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn a_token_is_created_once_and_revoked_once() {
    let mut h = Harness::new();
    let created = h.apply(Command::CreateToken {
        token: token(ID, ApiRole::User, Some("vision")),
    });
    assert_eq!(created.outcome, Outcome::Done);
    assert_eq!(
        h.state.tokens[ID].created_at, h.at,
        "stamped with the entry's time"
    );
    let r = h.reject(Command::CreateToken {
        token: token(ID, ApiRole::Admin, None),
    });
    assert!(r.message.contains("exists already"), "{r}");
    let revoked = h.apply(Command::RevokeToken {
        id: ID.into(),
        by: "token:ffff".into(),
    });
    assert_eq!(revoked.outcome, Outcome::Done);
    assert_eq!(h.state.tokens[ID].revoked_at, Some(h.at));
    assert!(h.state.tokens[ID].usable_at(h.at).is_err());
    let r = h.reject(Command::RevokeToken {
        id: ID.into(),
        by: "x".into(),
    });
    assert!(r.message.contains("revoked already"), "{r}");
    let r = h.reject(Command::RevokeToken {
        id: "ffffffffffffffff".into(),
        by: "x".into(),
    });
    assert_eq!(r.kind, RejectKind::NotFound);
}

#[test]
fn malformed_tokens_are_refused_naming_the_field() {
    let mut h = Harness::new();
    let cases: Vec<(TokenRecord, &str)> = vec![
        (token("xyz", ApiRole::Admin, None), "token.id"),
        (
            TokenRecord {
                secret_sha256: "not hex".into(),
                ..token(ID, ApiRole::Admin, None)
            },
            "token.secret_sha256",
        ),
        (token(ID, ApiRole::User, None), "tenant"),
        (token(ID, ApiRole::Operator, Some("vision")), "tenant"),
        (token(ID, ApiRole::User, Some("no spaces please")), "tenant"),
        (
            TokenRecord {
                description: "x".repeat(300),
                ..token(ID, ApiRole::Admin, None)
            },
            "description",
        ),
    ];
    for (t, field) in cases {
        let r = h.reject(Command::CreateToken { token: t });
        assert_eq!(r.field.as_deref(), Some(field), "{r}");
    }
    // Once tenants exist, a user token's tenant must be one of them.
    h.apply(Command::PutTenant {
        tenant: Tenant {
            name: "vision".into(),
            weight: 1,
            quota_gpus: 0,
            max_gpus: 0,
        },
    });
    let r = h.reject(Command::CreateToken {
        token: token(ID, ApiRole::User, Some("speech")),
    });
    assert!(r.message.contains("unknown tenant"), "{r}");
}

#[test]
fn attributed_commands_are_recorded_with_who_and_where_and_refused_ones_are_not() {
    let mut h = Harness::fleet();
    let submit = h.apply(Command::submit(job(1).spec(), None).by(actor("token:0123", "user")));
    let Outcome::JobSubmitted { id, .. } = submit.outcome else {
        panic!("{submit:?}");
    };
    let rec = h.state.audit.values().last().unwrap().clone();
    assert_eq!(rec.action, "submit_job");
    assert_eq!(rec.job, Some(id));
    assert_eq!(rec.actor.principal, "token:0123");
    assert_eq!(rec.actor.from, "127.0.0.1:5000");
    assert!(rec.target.starts_with(&format!("job {id}")), "{rec:?}");
    let before = h.state.audit.len();
    h.reject(Command::cancel(9_999, "").by(actor("token:0123", "user")));
    assert_eq!(
        h.state.audit.len(),
        before,
        "a refused command leaves no record"
    );
    // The leader's own commands are not attributed and not recorded.
    h.place(id, vec![task("a2", &[0])]);
    assert_eq!(h.state.audit.len(), before);
}

#[test]
fn an_agent_cannot_act_for_another_nodes_allocation_even_if_the_api_let_it_through() {
    let mut h = Harness::fleet();
    let (_, allocs) = h.running(job(1).spec(), vec![task("a1", &[0])]);
    let thief = actor("node:a2", "node");
    for command in [
        Command::AllocationExited {
            allocation: allocs[0],
            outcome: failed(1),
            usage: None,
        },
        Command::AllocationStarted {
            allocation: allocs[0],
        },
        Command::SetGpuHealth {
            node: "a1".into(),
            gpu: uuid("a1", 0),
            health: GpuHealth::Unhealthy {
                reason: "forged".into(),
            },
        },
    ] {
        let r = h.reject(command.by(thief.clone()));
        assert!(r.message.contains("node a2 may not act for node a1"), "{r}");
    }
    let mut spec = node("a1", 4, "A100").spec();
    spec.incarnation = "thief".into();
    let r = h.reject(Command::RegisterNode { spec }.by(thief.clone()));
    assert!(r.message.contains("may not act for node a1"), "{r}");
    // Its own node's allocation: fine.
    let (_, own) = h.running(job(1).spec(), vec![task("a2", &[1])]);
    let done = h.apply(
        Command::AllocationExited {
            allocation: own[0],
            outcome: TaskOutcome::Succeeded,
            usage: None,
        }
        .by(thief),
    );
    assert_eq!(done.outcome, Outcome::Done);
}

#[test]
fn an_attributed_command_holds_one_plain_command() {
    let mut h = Harness::new();
    let inner = Command::Batch { commands: vec![] };
    h.reject(inner.by(actor("anonymous", "admin")));
    let nested = Command::AuditNote {
        action: "x".into(),
        target: "y".into(),
        detail: "z".into(),
    }
    .by(actor("anonymous", "admin"))
    .by(actor("anonymous", "admin"));
    h.reject(nested);
}

#[test]
fn the_audit_trail_is_kept_by_count_at_every_record_and_by_age_when_compacted() {
    let mut h = Harness::new();
    let limits = AuditRetention {
        max_age_ms: 10_000,
        max_records: 3,
    };
    assert_eq!(
        h.apply(Command::CompactAudit { retention: limits }).outcome,
        Outcome::Done
    );
    for i in 0..5 {
        h.apply(
            Command::AuditNote {
                action: "note".into(),
                target: format!("n{i}"),
                detail: String::new(),
            }
            .by(actor("anonymous", "admin")),
        );
    }
    let seqs: Vec<u64> = h.state.audit.keys().copied().collect();
    assert_eq!(seqs, [3, 4, 5], "the oldest go first");
    assert!(!h.state.audit_compaction_due(&limits, h.at));
    assert!(h.state.audit_compaction_due(&limits, h.at + 20_000));
    h.at += 20_000;
    h.apply(Command::CompactAudit { retention: limits });
    assert!(h.state.audit.is_empty(), "all past their age");
    assert_eq!(
        h.state.last_audit_seq, 5,
        "sequence numbers are never reused"
    );
    h.reject(Command::CompactAudit {
        retention: AuditRetention {
            max_age_ms: 1,
            max_records: 0,
        },
    });
}

#[test]
fn a_chain_of_100000_dependents_fails_in_a_loop_not_a_recursion() {
    // A recursive cascade overflowed the stack of every replica at 5,000 (the same entry would
    // crash them again on restart). Run on a small stack to be sure it is not recursion.
    std::thread::Builder::new()
        .stack_size(256 * 1024)
        .spawn(|| {
            let mut h = Harness::new();
            let root = h.submit(job(1).spec());
            let mut last = root;
            for _ in 0..100_000 {
                last = h.submit_unchecked(job(1).after_ok(last).spec());
            }
            let applied = h.apply(Command::cancel(root, "gone"));
            assert_eq!(applied.outcome, Outcome::JobCancelled { id: root });
            assert_eq!(applied.changed_jobs.len(), 100_001);
            assert_eq!(h.job(last).state, JobState::Failed);
            assert!(h.state.index.pending.is_empty());
        })
        .unwrap()
        .join()
        .unwrap();
}
