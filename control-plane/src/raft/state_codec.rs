//! A snapshot's state as bytes, in the format of the cluster version it was taken at
//! (`state::format`): format 1 is the bare `StateMachineData` JSON that every release before
//! versions wrote; later formats wrap it as `{"format":N,"state":…}`. The same bytes are stored,
//! sent to followers and saved in backups, so all three refuse a format this binary does not
//! read, and a format-1 binary fails to decode a newer one (no `last_applied` at the top)
//! instead of misreading it.
//!
//! The state is hundreds of megabytes at a million jobs, so both directions stream: the
//! envelope is written and read around serde's own streaming of the state.

use std::io::{Read, Write};

use super::state_machine::StateMachineData;
use crate::state::format::{self, FormatVersion};

/// How the envelope starts. serde_json writes no whitespace, so this is exact.
const ENVELOPE_START: &[u8] = b"{\"format\":";

/// Writes `data` in the format of its own cluster version.
pub fn write_state(mut out: impl Write, data: &StateMachineData) -> std::io::Result<()> {
    let version = data.cluster.cluster_version.0;
    if version <= format::LEGACY {
        return serde_json::to_writer(out, data).map_err(std::io::Error::other);
    }
    out.write_all(ENVELOPE_START)?;
    write!(out, "{version},\"state\":")?;
    serde_json::to_writer(&mut out, data).map_err(std::io::Error::other)?;
    out.write_all(b"}")
}

/// Reads a state written by `write_state` in any format this binary reads, refusing a newer
/// one before decoding it. The error says what was wrong, for the caller to frame.
pub fn read_state(mut input: impl Read) -> Result<StateMachineData, String> {
    let mut start = Vec::with_capacity(ENVELOPE_START.len());
    input
        .by_ref()
        .take(ENVELOPE_START.len() as u64)
        .read_to_end(&mut start)
        .map_err(|e| e.to_string())?;
    if start != ENVELOPE_START {
        // Format 1: the bytes read so far are the state's own.
        let data: StateMachineData = serde_json::from_reader(std::io::BufReader::with_capacity(
            256 * 1024,
            std::io::Cursor::new(start).chain(input),
        ))
        .map_err(|e| e.to_string())?;
        return Ok(data);
    }
    let version = read_format_number(&mut input)?;
    format::check_readable("this snapshot", version)?;
    // The rest is `"state":{…}}`; reopened with a brace it is an object of one field.
    #[derive(serde::Deserialize)]
    struct Rest {
        state: StateMachineData,
    }
    let rest: Rest = serde_json::from_reader(std::io::BufReader::with_capacity(
        256 * 1024,
        std::io::Cursor::new(b"{".to_vec()).chain(input),
    ))
    .map_err(|e| e.to_string())?;
    if rest.state.cluster.cluster_version.0 != version {
        return Err(format!(
            "its envelope says format {version} but its state is at cluster version {}",
            rest.state.cluster.cluster_version.0
        ));
    }
    Ok(rest.state)
}

/// The digits after `{"format":`, up to and including the comma.
fn read_format_number(input: &mut impl Read) -> Result<FormatVersion, String> {
    let mut digits = String::new();
    let mut byte = [0u8; 1];
    loop {
        input
            .read_exact(&mut byte)
            .map_err(|e| format!("it ends inside its format number: {e}"))?;
        match byte[0] {
            b',' => break,
            b @ b'0'..=b'9' if digits.len() < 10 => digits.push(b as char),
            other => {
                return Err(format!(
                    "its format number is malformed (byte {other:#04x} after {digits:?})"
                ));
            }
        }
    }
    digits
        .parse()
        .map_err(|e| format!("its format number {digits:?} is malformed: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::format::ClusterVersion;
    use crate::state::{Command, JobSpec};

    fn state_at(version: FormatVersion) -> StateMachineData {
        let mut data = StateMachineData::default();
        let spec = JobSpec {
            tenant: "ml".into(),
            name: "a".into(),
            command: vec!["true".into()],
            gpus_per_task: 1,
            tasks: 1,
            ..Default::default()
        };
        data.cluster.apply(&Command::submit(spec, None), 1, 1);
        data.cluster.cluster_version = ClusterVersion(version);
        data
    }

    fn encoded(data: &StateMachineData) -> Vec<u8> {
        let mut bytes = Vec::new();
        write_state(&mut bytes, data).unwrap();
        bytes
    }

    #[test]
    fn every_readable_format_round_trips() {
        for version in format::OLDEST_READABLE..=format::CURRENT {
            let data = state_at(version);
            let bytes = encoded(&data);
            assert_eq!(
                bytes.starts_with(ENVELOPE_START),
                version > format::LEGACY,
                "{}",
                String::from_utf8_lossy(&bytes[..40])
            );
            let back = read_state(&bytes[..]).unwrap();
            assert_eq!(
                serde_json::to_vec(&back).unwrap(),
                serde_json::to_vec(&data).unwrap()
            );
        }
    }

    #[test]
    fn format_1_is_the_bare_state() {
        let data = state_at(format::LEGACY);
        assert_eq!(encoded(&data), serde_json::to_vec(&data).unwrap());
    }

    /// A format-1 binary reads the bare state; the envelope lacks its required fields.
    #[test]
    fn a_format_1_reader_cannot_decode_a_newer_state() {
        let bytes = encoded(&state_at(format::CURRENT));
        #[derive(serde::Deserialize)]
        #[allow(dead_code)]
        struct Format1State {
            last_applied: Option<crate::raft::LogId>,
            last_membership: serde_json::Value,
            cluster: serde_json::Value,
        }
        let error = serde_json::from_slice::<Format1State>(&bytes)
            .err()
            .expect("refused");
        assert!(error.to_string().contains("missing field"), "{error}");
    }

    #[test]
    fn a_newer_format_is_refused_before_its_state_is_read() {
        let newer = format!(
            "{{\"format\":{},\"state\":{{\"what\":0}}}}",
            format::CURRENT + 1
        );
        let error = read_state(newer.as_bytes()).unwrap_err();
        assert!(error.contains("Upgrade this replica's binary"), "{error}");
    }

    #[test]
    fn damaged_envelopes_are_refused() {
        let good = encoded(&state_at(format::CURRENT));
        for cut in [
            3,
            ENVELOPE_START.len(),
            ENVELOPE_START.len() + 1,
            good.len() - 1,
        ] {
            assert!(read_state(&good[..cut]).is_err(), "cut at {cut}");
        }
        assert!(read_state(&b"{\"format\":x,"[..]).is_err());
        // The envelope and the state disagree on the version.
        let mut data = state_at(format::CURRENT);
        data.cluster.cluster_version = ClusterVersion(format::LEGACY);
        let body = serde_json::to_string(&data).unwrap();
        let forged = format!("{{\"format\":{},\"state\":{body}}}", format::CURRENT);
        assert!(read_state(forged.as_bytes()).is_err());
    }
}
