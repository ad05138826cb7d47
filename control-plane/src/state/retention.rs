//! Bounded state for finished jobs. A finished job keeps its full record for
//! `JobRetention::full_record_ms` (at most `max_full_records` of them), then is replaced by an
//! `ArchivedJob` (id, tenant, name, idempotency key, spec fingerprint, final state and reason,
//! times), which is itself forgotten after `archive_ms` (at most `max_archived` of them).
//!
//! What must not change when a job is compacted:
//! - a retry with its idempotency key returns the same job while it is archived (the spec is
//!   compared by fingerprint); the key is forgotten with the archived record;
//! - a dependency on it resolves from its final state: a job that pending jobs still wait on is
//!   never archived, and a new submission naming an archived job sees its final state;
//! - fair share: usage is charged to the tenant when each allocation exits, before the job can
//!   be compacted (a job that still holds allocations is never archived).
//!
//! Compaction runs only as a `CompactJobs` entry, at that entry's leader time, so every replica
//! archives the same jobs at the same log index.

use super::types::*;
use super::{ClusterState, Outcome};

/// FNV-1a (64-bit) of the spec's JSON encoding: stable across builds and Rust versions (unlike
/// `std`'s hasher), which matters because it is stored in snapshots and compared on retries.
/// The encoding is deterministic: structs in field order, maps are `BTreeMap`s.
pub fn spec_fingerprint(spec: &JobSpec) -> u64 {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let bytes = serde_json::to_vec(spec).expect("a job spec always serializes");
    bytes
        .iter()
        .fold(OFFSET, |h, b| (h ^ u64::from(*b)).wrapping_mul(PRIME))
}

impl ClusterState {
    /// The final (or current) state of a job and when it last changed, from its full record or
    /// its archived one; `None` if it never existed or was forgotten.
    pub fn job_outcome(&self, id: JobId) -> Option<(JobState, Timestamp)> {
        if let Some(job) = self.jobs.get(&id) {
            return Some((job.state, job.last_change_at()));
        }
        self.archived.get(&id).map(|a| (a.state, a.ended_at))
    }

    /// Why job `id` has no full record, in words a user can act on.
    pub fn missing_job(&self, id: JobId) -> String {
        if let Some(a) = self.archived.get(&id) {
            format!(
                "job {id} {} and was archived: only its outcome is kept, not its spec or history",
                a.state
            )
        } else if id == 0 || id > self.last_job_id {
            format!("job {id} does not exist")
        } else {
            format!(
                "job {id} finished long ago and its record was purged (finished jobs are \
                 archived, then forgotten, after the retention period)"
            )
        }
    }

    /// Whether a `CompactJobs` with `retention` at `now` would have anything to do (so the
    /// leader does not log one that changes nothing).
    pub fn compaction_due(&self, retention: &JobRetention, now: Timestamp) -> bool {
        let over_cap = self.index.finished.len() as u64 > retention.max_full_records;
        let full_due = self
            .index
            .finished
            .iter()
            .take_while(|&&(ended, _)| {
                over_cap || ended.saturating_add(retention.full_record_ms) <= now
            })
            .any(|&(_, id)| !self.pinned(id));
        let archive_due = self
            .index
            .archived_by_end
            .first()
            .is_some_and(|&(ended, _)| {
                ended.saturating_add(retention.archive_ms) <= now
                    || self.archived.len() as u64 > retention.max_archived
            });
        full_due || archive_due
    }

    /// A finished job that must keep its full record for now: it still holds allocations
    /// (a cancelled job's tasks are stopping; their exits charge its tenant's usage), or a
    /// pending job waits on it (the scheduler releases that job from this record).
    fn pinned(&self, id: JobId) -> bool {
        self.jobs
            .get(&id)
            .is_some_and(|j| !j.allocations.is_empty())
            || self.index.dependents.contains_key(&id)
    }

    /// Applies `CompactJobs`: archive, then forget, what `retention` no longer keeps as of `at`;
    /// at most `limit` jobs in all (the oldest first), the rest left for the next entry.
    pub(super) fn compact_jobs(
        &mut self,
        retention: &JobRetention,
        limit: Option<u64>,
        at: Timestamp,
    ) -> Outcome {
        let mut budget = limit.unwrap_or(u64::MAX);
        let full_cutoff = at.saturating_sub(retention.full_record_ms);
        let mut over_cap =
            (self.index.finished.len() as u64).saturating_sub(retention.max_full_records);
        let mut to_archive = Vec::new();
        for &(ended, id) in &self.index.finished {
            if (ended > full_cutoff && over_cap == 0) || budget == 0 {
                break;
            }
            if self.pinned(id) {
                continue;
            }
            to_archive.push((ended, id));
            over_cap = over_cap.saturating_sub(1);
            budget -= 1;
        }
        for (ended, id) in to_archive {
            self.index.finished.remove(&(ended, id));
            let Some(job) = self.jobs.remove(&id) else {
                continue;
            };
            self.archived.insert(id, archive(job, ended, at));
            self.index.archived_by_end.insert((ended, id));
        }

        let archive_cutoff = at.saturating_sub(retention.archive_ms);
        let mut over_cap = (self.archived.len() as u64).saturating_sub(retention.max_archived);
        while let Some(&(ended, id)) = self.index.archived_by_end.first() {
            if (ended > archive_cutoff && over_cap == 0) || budget == 0 {
                break;
            }
            budget -= 1;
            self.index.archived_by_end.pop_first();
            over_cap = over_cap.saturating_sub(1);
            if let Some(a) = self.archived.remove(&id) {
                self.forget_key(&a);
            }
        }
        Outcome::Done
    }

    /// Drops the idempotency key of a forgotten job: a retry after this creates a new job, as
    /// the retention documents.
    fn forget_key(&mut self, a: &ArchivedJob) {
        let Some(key) = a.idempotency_key() else {
            return;
        };
        if let Some(keys) = self.index.idempotency.get_mut(a.tenant()) {
            if keys.get(key) == Some(&a.id) {
                keys.remove(key);
            }
            if keys.is_empty() {
                self.index.idempotency.remove(a.tenant());
            }
        }
    }

    /// The archive's own consistency: part of `check_consistency`.
    pub(super) fn check_archive(&self) -> Result<(), String> {
        for (id, a) in &self.archived {
            if a.id != *id {
                return Err(format!("archived job {id} is stored under the wrong id"));
            }
            if self.jobs.contains_key(id) {
                return Err(format!("job {id} is both archived and kept whole"));
            }
            if !a.state.is_final() {
                return Err(format!("archived job {id} is {}, not finished", a.state));
            }
            if *id > self.last_job_id {
                return Err(format!("archived job {id} is above last_job_id"));
            }
        }
        for (tenant, keys) in &self.index.idempotency {
            for (key, id) in keys {
                let owner = match (self.jobs.get(id), self.archived.get(id)) {
                    (Some(j), _) => (j.spec.tenant.as_str(), j.idempotency_key.as_deref()),
                    (None, Some(a)) => (a.tenant(), a.idempotency_key()),
                    (None, None) => {
                        return Err(format!(
                            "idempotency key {key:?} of tenant {tenant} names forgotten job {id}"
                        ));
                    }
                };
                if owner != (tenant.as_str(), Some(key.as_str())) {
                    return Err(format!(
                        "idempotency key {key:?} of tenant {tenant} names job {id}, which does \
                         not carry it"
                    ));
                }
            }
        }
        Ok(())
    }
}

/// The compact record of a finished job.
fn archive(job: Job, ended_at: Timestamp, at: Timestamp) -> ArchivedJob {
    let reason = job.history.last().map_or("", |h| h.reason.as_str());
    ArchivedJob::new(
        job.id,
        &job.spec.tenant,
        &job.spec.name,
        job.idempotency_key.as_deref(),
        spec_fingerprint(&job.spec),
        job.state,
        reason,
        (job.submitted_at, ended_at, at),
    )
}
