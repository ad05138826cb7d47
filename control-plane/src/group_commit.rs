//! Group commit: concurrent writes share Raft log entries.
//!
//! openraft 0.9 appends every client write as its own entry and flushes the leader's log for
//! each one before it handles the next message, so the leader's write rate is bounded by its
//! fsync rate and a burst of submissions queues behind one fsync per submission. Here writes
//! wait in a queue while earlier entries are in flight; each new proposal takes everything
//! queued (up to `MAX_BATCH`) as one `Command::Batch` entry. A lone write is proposed as itself,
//! so an idle cluster pays nothing for this. Durability is unchanged: every write is answered
//! only after its entry is committed (on disk on a majority) and applied.

use std::sync::Arc;

use tokio::sync::{Semaphore, mpsc, oneshot};

use crate::raft::state_machine::StateMachineStore;
use crate::raft::{NodeId, Raft};
use crate::replica::{ApiError, Clock, client_write_error};
use crate::state::format::FormatVersion;
use crate::state::{Command, Outcome, Request};

/// Most commands in one entry. Bounds the entry's size (a submission encodes to under 1 KiB)
/// and the work one apply does while it holds the state lock.
pub const MAX_BATCH: usize = 512;

/// Entries proposed and not yet answered. Two keep the leader busy (one being flushed or
/// replicated while the next waits in openraft's queue) while later writes gather into the
/// next batch instead of each becoming an entry.
pub const MAX_IN_FLIGHT: usize = 2;

type Reply = oneshot::Sender<Result<Outcome, ApiError>>;

struct QueuedWrite {
    command: Command,
    reply: Reply,
}

/// The queue in front of one replica's Raft. Dropping it stops the proposing task once the
/// writes already queued have been answered.
pub struct GroupCommit {
    queue: mpsc::UnboundedSender<QueuedWrite>,
}

impl GroupCommit {
    /// Starts the proposing task on the current tokio runtime.
    /// Entries are written in the applied cluster version's format (`state::format`), read
    /// from `sm` at each proposal.
    pub fn start(id: NodeId, raft: Raft, sm: StateMachineStore, clock: Clock) -> GroupCommit {
        let (queue, rx) = mpsc::unbounded_channel();
        tokio::spawn(propose_loop(id, raft, sm, clock, rx));
        GroupCommit { queue }
    }

    /// Queues `command` and waits until its entry is committed and applied.
    pub async fn write(&self, command: Command) -> Result<Outcome, ApiError> {
        let (reply, answer) = oneshot::channel();
        self.queue
            .send(QueuedWrite { command, reply })
            .map_err(|_| ApiError::Unavailable("the replica is stopping".into()))?;
        answer
            .await
            .map_err(|_| ApiError::Unavailable("the replica stopped before answering".into()))?
    }
}

async fn propose_loop(
    id: NodeId,
    raft: Raft,
    sm: StateMachineStore,
    clock: Clock,
    mut rx: mpsc::UnboundedReceiver<QueuedWrite>,
) {
    let in_flight = Arc::new(Semaphore::new(MAX_IN_FLIGHT));
    while let Some(first) = rx.recv().await {
        // Waiting for a free slot before draining is what forms batches: writes that arrive
        // while the slots are busy are all taken by the next proposal.
        let Ok(slot) = in_flight.clone().acquire_owned().await else {
            return;
        };
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(w) => batch.push(w),
                Err(_) => break,
            }
        }
        let raft = raft.clone();
        let at = clock.now_ms();
        let format = sm.cluster_version();
        tokio::spawn(async move {
            propose(id, &raft, format, at, batch).await;
            drop(slot);
        });
    }
}

/// Proposes `batch` as one entry and answers each write with its own outcome.
async fn propose(
    id: NodeId,
    raft: &Raft,
    format: FormatVersion,
    at: u64,
    mut batch: Vec<QueuedWrite>,
) {
    if batch.len() == 1 {
        let QueuedWrite { command, reply } = batch.pop().expect("one write");
        let answer = raft
            .client_write(
                Request {
                    format,
                    at,
                    command,
                }
                .into(),
            )
            .await
            .map(|r| r.data)
            .map_err(|e| client_write_error(id, e));
        let _ = reply.send(answer);
        return;
    }
    let (commands, replies): (Vec<Command>, Vec<Reply>) =
        batch.into_iter().map(|w| (w.command, w.reply)).unzip();
    let count = commands.len();
    let command = Command::Batch { commands };
    let request = Request {
        format,
        at,
        command,
    };
    match raft.client_write(request.into()).await {
        Ok(resp) => match resp.data {
            Outcome::Batch(outcomes) if outcomes.len() == count => {
                for (reply, outcome) in replies.into_iter().zip(outcomes) {
                    // The caller may have gone away (a cancelled RPC); its write still stands.
                    let _ = reply.send(Ok(outcome));
                }
            }
            other => {
                let message = format!("a batch of {count} writes was answered with {other:?}");
                for reply in replies {
                    let _ = reply.send(Err(ApiError::Internal(message.clone())));
                }
            }
        },
        Err(e) => {
            let error = client_write_error(id, e);
            for reply in replies {
                let _ = reply.send(Err(error.clone()));
            }
        }
    }
}
