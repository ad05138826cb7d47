//! `gpuctl token ...`, `gpuctl audit` and `gpuctl whoami`: API tokens, the audit trail, and
//! who the control plane takes the caller for.

use std::time::Duration;

use proto::v1 as pb;
use serde_json::json;

use super::output::{self, Format};
use crate::client::{Client, with_timeout};
use crate::replica::now_ms;

#[derive(clap::Subcommand)]
pub enum TokenCommand {
    /// Create a token and print it (once: only its hash is kept).
    Create {
        /// admin (everything), operator (nodes, drains, partitions) or user (its tenant's jobs).
        #[arg(long)]
        role: String,
        /// The tenant a user token acts for.
        #[arg(long)]
        tenant: Option<String>,
        #[arg(long, default_value = "")]
        description: String,
        /// The token stops working after this long (e.g. 30d, 12h); default: never.
        #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
        ttl: Option<Duration>,
    },
    /// List tokens (ids, roles, tenants; never secrets).
    List,
    /// Revoke a token: every replica refuses it once the revocation is applied.
    Revoke { id: String },
}

#[derive(clap::Args)]
pub struct AuditArgs {
    /// Only records about this job.
    #[arg(long)]
    pub job: Option<u64>,
    /// Only records since this long ago (e.g. 1h, 2d) or this time (2026-12-04T10:00:00Z).
    #[arg(long, value_name = "WHEN")]
    pub since: Option<String>,
    /// Most records to show (the newest).
    #[arg(long, default_value_t = 100)]
    pub limit: u32,
}

/// `--since`: a duration back from now, or an RFC 3339 time.
fn parse_since(s: &str, now_ms: u64) -> anyhow::Result<u64> {
    if let Ok(d) = humantime::parse_duration(s) {
        return Ok(now_ms.saturating_sub(d.as_millis() as u64));
    }
    let t = humantime::parse_rfc3339_weak(s).map_err(|_| {
        anyhow::anyhow!(
            "--since {s:?}: give a duration (30m, 2h, 7d) or a time (2026-12-04T10:00:00Z)"
        )
    })?;
    Ok(t.duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0))
}

pub async fn run(client: &mut Client, command: TokenCommand, fmt: Format) -> anyhow::Result<()> {
    match command {
        TokenCommand::Create {
            role,
            tenant,
            description,
            ttl,
        } => {
            let req = pb::CreateTokenRequest {
                role,
                tenant: tenant.unwrap_or_default(),
                description,
                ttl_secs: ttl.map_or(0, |d| d.as_secs().max(1)),
            };
            let resp = client
                .call(|mut c, t| {
                    let req = req.clone();
                    async move { c.create_token(with_timeout(req, t)).await }
                })
                .await?;
            let token = resp.token.unwrap_or_default();
            match fmt {
                Format::Json | Format::Yaml => println!(
                    "{}",
                    json!({"token": output::token_json(&token), "secret": resp.secret})
                ),
                Format::Table | Format::Wide => {
                    print!(
                        "{}",
                        output::tokens_table(std::slice::from_ref(&token), now_ms())
                    );
                    println!();
                    println!("{}", resp.secret);
                    println!();
                    println!(
                        "This is the only time the token is shown. Use it with `gpuctl --token TOKEN ...` or GPUCTL_TOKEN=TOKEN."
                    );
                }
            }
        }
        TokenCommand::List => {
            let resp = client
                .call(|mut c, t| async move {
                    c.list_tokens(with_timeout(pb::ListTokensRequest { read: None }, t))
                        .await
                })
                .await?;
            match fmt {
                Format::Json | Format::Yaml => println!(
                    "{}",
                    json!({"tokens": resp.tokens.iter().map(output::token_json).collect::<Vec<_>>()})
                ),
                Format::Table | Format::Wide => {
                    print!("{}", output::tokens_table(&resp.tokens, now_ms()))
                }
            }
        }
        TokenCommand::Revoke { id } => {
            let token = client
                .call(|mut c, t| {
                    let id = id.clone();
                    async move {
                        c.revoke_token(with_timeout(pb::RevokeTokenRequest { id }, t))
                            .await
                    }
                })
                .await?;
            match fmt {
                Format::Json | Format::Yaml => println!("{}", output::token_json(&token)),
                Format::Table | Format::Wide => println!("token {} revoked", token.id),
            }
        }
    }
    Ok(())
}

pub async fn audit(client: &mut Client, args: AuditArgs, fmt: Format) -> anyhow::Result<()> {
    let req = pb::ListAuditRequest {
        job_id: args.job.unwrap_or(0),
        since_ms: match &args.since {
            Some(s) => parse_since(s, now_ms())?,
            None => 0,
        },
        limit: args.limit,
        read: None,
    };
    let resp = client
        .call(|mut c, t| async move { c.list_audit(with_timeout(req, t)).await })
        .await?;
    match fmt {
        Format::Json | Format::Yaml => println!(
            "{}",
            json!({"records": resp.records.iter().map(output::audit_json).collect::<Vec<_>>()})
        ),
        Format::Table | Format::Wide => print!("{}", output::audit_table(&resp.records)),
    }
    Ok(())
}

pub async fn whoami(client: &mut Client, fmt: Format) -> anyhow::Result<()> {
    let me = client
        .call(|mut c, t| async move { c.who_am_i(with_timeout(pb::WhoAmIRequest {}, t)).await })
        .await?;
    match fmt {
        Format::Json | Format::Yaml => println!(
            "{}",
            json!({"principal": me.principal, "role": me.role, "tenant": me.tenant,
                   "from": me.from, "security_enforced": me.security_enforced})
        ),
        Format::Table | Format::Wide => {
            let tenant = if me.tenant.is_empty() {
                String::new()
            } else {
                format!(", tenant {}", me.tenant)
            };
            println!("{} ({}{tenant}) from {}", me.principal, me.role, me.from);
            if !me.security_enforced {
                println!("the control plane runs with --insecure: nothing is authenticated");
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn since_takes_durations_and_times() {
        let now = 1_800_000_000_000;
        assert_eq!(parse_since("1h", now).unwrap(), now - 3_600_000);
        assert_eq!(
            parse_since("2026-12-04T10:00:00Z", now).unwrap(),
            1_796_378_400_000
        );
        assert!(parse_since("yesterday", now).is_err());
    }
}
