//! `gpuctl cluster snapshot save | restore | inspect`: backups of the replicated state
//! (`crate::backup`). `save` talks to the cluster; `restore` and `inspect` work offline on a
//! file, with no cluster and no credentials.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use proto::v1 as pb;
use serde_json::json;

use super::output::Format;
use super::print_json;
use crate::backup::BackupHeader;
use crate::backup::file::{BackupFile, BackupWriter};
use crate::backup::restore::{RestoreRequest, restore};
use crate::client::{Client, with_timeout};

#[derive(clap::Subcommand)]
pub enum SnapshotCommand {
    /// Save a consistent copy of the cluster's state to FILE (admin only). The file holds
    /// token hashes and the audit trail: keep it as secret as the CA key.
    Save { file: PathBuf },
    /// Create a new replica's data directory from a saved FILE, offline, with a new
    /// membership. Run it once per replica (same FILE and --members, each its own --id and
    /// --data-dir), then start the replicas on those directories.
    Restore {
        file: PathBuf,
        /// The new replica's data directory: must not exist, or be empty.
        #[arg(long, value_name = "DIR")]
        data_dir: PathBuf,
        /// This replica's id in the new cluster (one of --members).
        #[arg(long)]
        id: u64,
        /// The new cluster's name (what its replicas get as --cluster).
        #[arg(long)]
        cluster: String,
        /// The new cluster's replicas.
        #[arg(long, value_name = "ID=HOST:PORT,...")]
        members: String,
    },
    /// Show what a saved FILE holds (header, counts) and check its checksums, offline.
    Inspect { file: PathBuf },
}

/// Whether the command runs offline (no client, no credentials).
pub fn is_offline(command: &SnapshotCommand) -> bool {
    !matches!(command, SnapshotCommand::Save { .. })
}

/// `restore` and `inspect`.
pub fn run_offline(command: SnapshotCommand, fmt: Format) -> anyhow::Result<()> {
    match command {
        SnapshotCommand::Save { .. } => unreachable!("save talks to the cluster"),
        SnapshotCommand::Inspect { file } => inspect(&file, fmt),
        SnapshotCommand::Restore {
            file,
            data_dir,
            id,
            cluster,
            members,
        } => {
            let members = crate::config::parse_members(&members, "--members")?;
            let spinner = super::progress::spinner("restoring", fmt);
            spinner.set_message(file.display().to_string());
            let restored = restore(&RestoreRequest {
                backup: &file,
                data_dir: &data_dir,
                replica_id: id,
                cluster: &cluster,
                members: &members,
            });
            spinner.finish_and_clear();
            let restored = restored?;
            let h = &restored.header;
            match fmt {
                Format::Json | Format::Yaml => print_json(json!({
                    "data_dir": restored.data_dir.display().to_string(),
                    "id": id,
                    "cluster": cluster,
                    "members": members,
                    "snapshot_bytes": restored.snapshot_bytes,
                    "header": header_json(h),
                })),
                Format::Table | Format::Wide => {
                    println!(
                        "restored replica {id} of cluster {cluster:?} into {}",
                        restored.data_dir.display()
                    );
                    println!(
                        "  from {} (cluster {:?}, log index {}, term {}): {}",
                        file.display(),
                        h.cluster,
                        h.last_applied.index,
                        h.last_applied.leader_id.term,
                        counts_text(h)
                    );
                    let members: Vec<String> =
                        members.iter().map(|(i, a)| format!("{i}={a}")).collect();
                    println!("  members: {}", members.join(","));
                    println!(
                        "start it with --id {id} --cluster {cluster} --data-dir {}; it starts from this state and does not bootstrap",
                        restored.data_dir.display()
                    );
                }
            }
            Ok(())
        }
    }
}

/// `save`: the leader's copy, streamed into FILE (atomically: a temporary file, synced and
/// renamed once every byte has arrived and matches the checksum the leader sent).
pub async fn save(client: &mut Client, file: &Path, fmt: Format) -> anyhow::Result<()> {
    if file.is_dir() {
        anyhow::bail!("{} is a directory; give a file name", file.display());
    }
    // A large state takes a while to encode and send; the stream is one call.
    client.attempt_timeout = client.deadline.max(Duration::from_secs(3600));
    client.retry_deadline_exceeded = false;
    let started = std::time::Instant::now();
    let mut stream = client
        .call(|mut c, t| async move {
            c.save_snapshot(with_timeout(pb::SaveSnapshotRequest {}, t))
                .await
        })
        .await?;
    let first = stream
        .message()
        .await
        .context("receiving the backup")?
        .context("the replica ended the backup before it began")?;
    let Some(pb::snapshot_chunk::Part::Info(info)) = first.part else {
        anyhow::bail!("the replica's backup did not start with its description");
    };
    let header = BackupHeader::from_info(&info).map_err(anyhow::Error::msg)?;
    let mut writer = BackupWriter::create(file, header.clone())
        .with_context(|| format!("creating a temporary file beside {}", file.display()))?;
    let bar = super::progress::bar(header.state_bytes, "receiving", fmt);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{prefix} [{bar:30}] {bytes}/{total_bytes} ({bytes_per_sec}, about {eta} left)",
        )
        .expect("the template is valid")
        .progress_chars("=> "),
    );
    while let Some(msg) = stream.message().await.with_context(|| {
        format!(
            "the backup stream broke; nothing was written to {}; run it again",
            file.display()
        )
    })? {
        match msg.part {
            Some(pb::snapshot_chunk::Part::Data(bytes)) => {
                writer
                    .write_state(&bytes)
                    .with_context(|| format!("writing beside {}", file.display()))?;
                bar.inc(bytes.len() as u64);
            }
            _ => anyhow::bail!("the replica sent a second description inside the backup"),
        }
    }
    bar.finish_and_clear();
    let path = writer
        .finish()
        .with_context(|| format!("the backup was not saved to {}", file.display()))?;
    let took = started.elapsed();
    match fmt {
        Format::Json | Format::Yaml => print_json(json!({
            "path": path.display().to_string(),
            "took_ms": took.as_millis() as u64,
            "header": header_json(&header),
        })),
        Format::Table | Format::Wide => println!(
            "saved cluster {:?} at log index {} (term {}, from replica {}): {}, {} bytes of state, to {} in {:.1} s",
            header.cluster,
            header.last_applied.index,
            header.last_applied.leader_id.term,
            header.replica_id,
            counts_text(&header),
            header.state_bytes,
            path.display(),
            took.as_secs_f64()
        ),
    }
    Ok(())
}

fn inspect(file: &Path, fmt: Format) -> anyhow::Result<()> {
    let mut backup = BackupFile::open(file)?;
    backup.verify()?;
    let h = &backup.header;
    match fmt {
        Format::Json | Format::Yaml => print_json(json!({
            "path": file.display().to_string(),
            "checksums": "ok",
            "header": header_json(h),
        })),
        Format::Table | Format::Wide => {
            println!(
                "backup {} (format {})",
                file.display(),
                crate::backup::file::FORMAT_VERSION
            );
            println!("  cluster:      {:?}", h.cluster);
            println!(
                "  saved at:     {} by replica {}",
                humantime::format_rfc3339_millis(
                    std::time::UNIX_EPOCH + Duration::from_millis(h.made_at_ms)
                ),
                h.replica_id
            );
            println!(
                "  log entry:    index {}, term {}",
                h.last_applied.index, h.last_applied.leader_id.term
            );
            println!("  members then: {}", members_text(h));
            println!("  holds:        {}", counts_text(h));
            println!("  last job id:  {}", h.counts.last_job_id);
            println!(
                "  state:        {} bytes, SHA-256 {} (checked)",
                h.state_bytes, h.state_sha256
            );
        }
    }
    Ok(())
}

fn members_text(h: &BackupHeader) -> String {
    h.membership
        .membership()
        .nodes()
        .map(|(id, n)| format!("{id}={}", n.addr))
        .collect::<Vec<_>>()
        .join(",")
}

fn counts_text(h: &BackupHeader) -> String {
    let c = &h.counts;
    format!(
        "{} jobs ({} more archived), {} nodes, {} tenants, {} partitions, {} tokens, {} audit records",
        c.jobs, c.archived_jobs, c.nodes, c.tenants, c.partitions, c.tokens, c.audit_records
    )
}

fn header_json(h: &BackupHeader) -> serde_json::Value {
    json!({
        "cluster": h.cluster,
        "replica_id": h.replica_id,
        "made_at_ms": h.made_at_ms,
        "last_applied_index": h.last_applied.index,
        "last_applied_term": h.last_applied.leader_id.term,
        "members": members_text(h),
        "state_bytes": h.state_bytes,
        "state_sha256": h.state_sha256,
        "counts": h.counts,
    })
}
