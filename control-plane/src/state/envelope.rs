//! How a log entry's `Request` is written in each format (`format`): format 1 as the bare
//! `{"at":…,"command":…}` every release before versions wrote, later formats as
//! `{"format":N,"request":{"at":…,"command":…}}`.
//!
//! Decoding reads `format` first (this binary writes it first) and refuses a format it does
//! not read before it looks at the command, so a newer entry fails with "upgrade this binary"
//! rather than with whatever the newer command's shape happens to trip over.

use std::fmt;

use serde::de::{self, IgnoredAny, MapAccess, Visitor};
use serde::ser::SerializeStruct;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::command::{Command, Request};
use super::format::{self, FormatVersion};
use super::types::Timestamp;

/// The request's own fields, the whole entry in format 1.
#[derive(Serialize)]
struct BodyRef<'a> {
    at: Timestamp,
    command: &'a Command,
}

#[derive(Deserialize)]
struct Body {
    at: Timestamp,
    command: Command,
}

impl Serialize for Request {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let body = BodyRef {
            at: self.at,
            command: &self.command,
        };
        if self.format <= format::LEGACY {
            return body.serialize(serializer);
        }
        let mut envelope = serializer.serialize_struct("Request", 2)?;
        envelope.serialize_field("format", &self.format)?;
        envelope.serialize_field("request", &body)?;
        envelope.end()
    }
}

impl<'de> Deserialize<'de> for Request {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Request, D::Error> {
        deserializer.deserialize_map(RequestVisitor)
    }
}

#[derive(Deserialize)]
#[serde(field_identifier, rename_all = "lowercase")]
enum Field {
    Format,
    Request,
    At,
    Command,
    #[serde(other)]
    Other,
}

struct RequestVisitor;

impl<'de> Visitor<'de> for RequestVisitor {
    type Value = Request;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a log entry's request (format 1, or a versioned envelope)")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Request, A::Error> {
        let mut format: Option<FormatVersion> = None;
        let mut body: Option<Body> = None;
        let mut at: Option<Timestamp> = None;
        let mut command: Option<Command> = None;
        while let Some(field) = map.next_key::<Field>()? {
            match field {
                Field::Format => {
                    let f: FormatVersion = map.next_value()?;
                    format::check_readable("this log entry", f).map_err(de::Error::custom)?;
                    format = Some(f);
                }
                Field::Request => body = Some(map.next_value()?),
                Field::At => at = Some(map.next_value()?),
                Field::Command => command = Some(map.next_value()?),
                Field::Other => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        match (format, body) {
            (Some(format), Some(Body { at, command })) if format > format::LEGACY => Ok(Request {
                format,
                at,
                command,
            }),
            (Some(format), _) if format > format::LEGACY => Err(de::Error::custom(format!(
                "a log entry in format {format} without its request"
            ))),
            (_, Some(_)) => Err(de::Error::custom(
                "a log entry with a versioned request but no format",
            )),
            _ => Ok(Request {
                format: format::LEGACY,
                at: at.ok_or_else(|| de::Error::missing_field("at"))?,
                command: command.ok_or_else(|| de::Error::missing_field("command"))?,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(format: FormatVersion) -> Request {
        Request {
            format,
            at: 42,
            command: Command::cancel(7, "test"),
        }
    }

    #[test]
    fn format_1_is_written_exactly_as_releases_before_versions_wrote_it() {
        let json = serde_json::to_string(&request(1)).unwrap();
        assert_eq!(
            json,
            r#"{"at":42,"command":{"CancelJob":{"job":7,"reason":"test"}}}"#
        );
        assert_eq!(serde_json::from_str::<Request>(&json).unwrap(), request(1));
    }

    #[test]
    fn later_formats_round_trip_in_their_envelope() {
        let json = serde_json::to_string(&request(format::CURRENT)).unwrap();
        assert!(
            json.starts_with(&format!(r#"{{"format":{},"request":"#, format::CURRENT)),
            "{json}"
        );
        assert_eq!(
            serde_json::from_str::<Request>(&json).unwrap(),
            request(format::CURRENT)
        );
    }

    /// What keeps a format-1 binary from misapplying a newer entry: the envelope lacks the
    /// fields it requires, so its decoder fails instead of ignoring what it does not know.
    #[test]
    fn a_binary_that_knows_only_format_1_cannot_decode_the_envelope() {
        #[derive(Deserialize)]
        #[allow(dead_code)]
        struct Format1Request {
            at: Timestamp,
            command: Command,
        }
        let json = serde_json::to_string(&request(format::CURRENT)).unwrap();
        let error = serde_json::from_str::<Format1Request>(&json)
            .err()
            .expect("refused");
        assert!(error.to_string().contains("missing field"), "{error}");
    }

    #[test]
    fn an_entry_from_a_newer_release_is_refused_before_its_command_is_read() {
        // A command no release knows yet: the refusal names the format, not the command.
        let json = format!(
            r#"{{"format":{},"request":{{"at":1,"command":{{"FromTheFuture":{{}}}}}}}}"#,
            format::CURRENT + 1
        );
        let error = serde_json::from_str::<Request>(&json)
            .unwrap_err()
            .to_string();
        assert!(
            error.contains(&format!("format {}", format::CURRENT + 1)),
            "{error}"
        );
        assert!(error.contains("Upgrade this replica's binary"), "{error}");
    }

    #[test]
    fn malformed_envelopes_are_refused() {
        for json in [
            r#"{"format":2}"#,
            r#"{"request":{"at":1,"command":{"CancelJob":{"job":1,"reason":""}}}}"#,
            r#"{"at":1}"#,
            r#"{"format":0,"at":1,"command":{"CancelJob":{"job":1,"reason":""}}}"#,
        ] {
            assert!(serde_json::from_str::<Request>(json).is_err(), "{json}");
        }
    }
}
