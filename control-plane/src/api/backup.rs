//! `SaveSnapshot`: a consistent copy of the leader's applied state, streamed to an admin for
//! a backup (`gpuctl cluster snapshot save`). A follower forwards the call to the leader and
//! relays its stream.
//!
//! The copy is taken as a Raft snapshot's is (the records shared with the live state, under
//! the read lock for a moment) after a linearizable barrier, so it holds every write
//! acknowledged before the call, up to a committed entry that the first message names. It is
//! encoded as a snapshot is (in memory, off the runtime, at background priority: about the
//! state's size in memory while it is sent, as when a snapshot is built), and each chunk is
//! freed once sent. One copy at a time per replica bounds that memory.

use std::pin::Pin;
use std::sync::Arc;

use futures::{Stream, StreamExt};
use proto::v1 as pb;
use proto::v1::control_plane_client::ControlPlaneClient;
use tokio::sync::Semaphore;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use super::auth::{Action, authenticate};
use super::route::{FORWARDED, error_status, forward_if_follower};
use crate::backup::{BackupHeader, Counts, hex};
use crate::off_runtime::at_background_priority;
use crate::raft::state_machine::{EncodedState, encode_state};
use crate::replica::{ApiError, Replica};

pub type SnapshotChunkStream =
    Pin<Box<dyn Stream<Item = Result<pb::SnapshotChunk, Status>> + Send>>;

/// Chunks queued ahead of a slow reader (256 KiB each).
const CHUNKS_IN_FLIGHT: usize = 4;

pub async fn save_snapshot(
    replica: Arc<Replica>,
    busy: Arc<Semaphore>,
    request: Request<pb::SaveSnapshotRequest>,
) -> Result<Response<SnapshotChunkStream>, Status> {
    let r = &replica;
    let forwarded = request.metadata().contains_key(FORWARDED);
    let caller = authenticate(r, &request)
        .await
        .map_err(|e| error_status(r, e))?;
    caller
        .require(Action::SaveBackup)
        .map_err(|e| error_status(r, e))?;
    let leader_check = match forward_if_follower(r) {
        Ok(()) => r.linearize().await,
        Err(e) => Err(e),
    };
    match leader_check {
        Ok(()) => {}
        Err(ApiError::NotLeader {
            leader: Some((leader, addr)),
        }) if !forwarded && leader != r.id => {
            let channel = r.leader_channel(&addr).map_err(|e| error_status(r, e))?;
            let mut req = Request::new(request.into_inner());
            caller.forward_into(req.metadata_mut());
            req.metadata_mut().insert(
                FORWARDED,
                r.id.to_string()
                    .parse()
                    .expect("a decimal number is valid metadata"),
            );
            let stream = ControlPlaneClient::new(channel)
                .save_snapshot(req)
                .await
                .map_err(|s| {
                    Status::new(
                        s.code(),
                        format!("forwarding to leader {leader} at {addr}: {}", s.message()),
                    )
                })?
                .into_inner();
            return Ok(Response::new(Box::pin(stream)));
        }
        Err(e) => return Err(error_status(r, e)),
    }
    let permit = busy.try_acquire_owned().map_err(|_| {
        Status::resource_exhausted(format!(
            "replica {} is already sending a backup; retry once it has finished",
            r.id
        ))
    })?;

    let (meta, copy) = r.sm.consistent_copy();
    let Some(last_applied) = meta.last_log_id else {
        return Err(Status::failed_precondition(format!(
            "replica {} has applied nothing yet; there is nothing to back up",
            r.id
        )));
    };
    let counts = Counts::of(&copy.cluster);
    let membership = meta.last_membership.clone();
    let encoded = at_background_priority(move || encode_with_digest(meta, copy))
        .await
        .map_err(|e| Status::internal(format!("encoding the state: {e}")))?
        .map_err(|e| Status::internal(format!("encoding the state: {e}")))?;
    let (encoded, sha256) = encoded;
    let header = BackupHeader {
        cluster: r.cluster.clone(),
        replica_id: r.id,
        made_at_ms: r.now_ms(),
        last_applied,
        membership,
        state_bytes: encoded.len(),
        state_sha256: sha256,
        counts,
    };
    tracing::info!(
        caller = caller.principal_name(),
        from = %caller.from,
        index = last_applied.index,
        bytes = header.state_bytes,
        "sending a backup of the state"
    );
    let (tx, rx) = tokio::sync::mpsc::channel(CHUNKS_IN_FLIGHT);
    tokio::spawn(async move {
        let _permit = permit;
        let info = pb::SnapshotChunk {
            part: Some(pb::snapshot_chunk::Part::Info(header.to_info())),
        };
        if tx.send(Ok(info)).await.is_err() {
            return;
        }
        // Each chunk is moved into its message and freed once sent.
        for chunk in encoded.chunks {
            let msg = pb::SnapshotChunk {
                part: Some(pb::snapshot_chunk::Part::Data(chunk)),
            };
            if tx.send(Ok(msg)).await.is_err() {
                tracing::info!("the backup's reader went away before the end");
                return;
            }
        }
    });
    Ok(Response::new(Box::pin(ReceiverStream::new(rx).boxed())))
}

/// The state encoded as a snapshot stores it, with the SHA-256 of its bytes.
fn encode_with_digest(
    meta: openraft::SnapshotMeta<crate::raft::NodeId, openraft::BasicNode>,
    copy: crate::raft::state_machine::StateMachineData,
) -> Result<(EncodedState, String), String> {
    let encoded = encode_state(meta, copy)?;
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    for chunk in &encoded.chunks {
        ctx.update(chunk);
    }
    Ok((encoded, hex(ctx.finish().as_ref())))
}
