//! `gpuctl certs ...`: the cluster's certificates, made offline with the CA's key.
//!
//! ```text
//! gpuctl certs init --dir ca                                    # ca/ca.pem, ca/ca-key.pem
//! gpuctl certs issue replica --ca-dir ca --name replica-1 --out tls/replica-1
//! gpuctl certs issue node --ca-dir ca --name gpu-17 --out tls/gpu-17
//! gpuctl certs issue client --ca-dir ca --name alice --role admin --out tls/alice
//! gpuctl certs show tls/gpu-17
//! gpuctl certs revoke --ca-dir ca --serial 4f:1c:...            # ca/crl.pem
//! ```

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use proto::tls::pki::{self, CaFiles, IssueRequest};
use proto::tls::{CertRole, TlsFiles, expiry_warning, parse_identity};
use rustls_pki_types::CertificateDer;
use rustls_pki_types::pem::PemObject;
use serde_json::json;

use super::output::{Format, format_time};
use crate::replica::now_ms;

#[derive(clap::Subcommand)]
pub enum CertsCommand {
    /// Create the cluster CA: DIR/ca.pem (give it to every process) and DIR/ca-key.pem (keep
    /// it offline; it signs every certificate).
    Init {
        #[arg(long, value_name = "DIR")]
        dir: PathBuf,
        /// Cluster name, written into the CA's subject.
        #[arg(long, default_value = "gpu-cluster")]
        cluster: String,
        #[arg(long, default_value_t = 3650)]
        days: u32,
        /// Replace an existing CA (every certificate it signed stops being trusted).
        #[arg(long)]
        force: bool,
    },
    /// Issue a certificate: ca.pem, cert.pem and key.pem in --out, what --tls-dir reads.
    Issue {
        /// replica, node or client.
        kind: String,
        #[arg(long, value_name = "DIR")]
        ca_dir: PathBuf,
        /// replica-<id> for a replica, the node's name for a node, anything for a client.
        #[arg(long)]
        name: String,
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
        /// More DNS names or IP addresses the holder serves under (comma-separated).
        /// Not needed for the cluster's own connections, which verify the role's name.
        #[arg(long, value_delimiter = ',')]
        san: Vec<String>,
        /// Client certificates: the API role it grants without a token (admin, operator,
        /// user). Without one, the client also needs a token.
        #[arg(long)]
        role: Option<String>,
        /// Client certificates with --role user: the tenant.
        #[arg(long)]
        tenant: Option<String>,
        #[arg(long, default_value_t = 365)]
        days: u32,
    },
    /// Print what a certificate says: role, name, serial, validity.
    Show {
        /// A certificate file, or a directory with cert.pem.
        path: PathBuf,
    },
    /// Revoke a certificate: adds its serial to the CA directory's list and writes crl.pem
    /// there. Copy crl.pem into each process's --tls-dir; it is re-read without a restart.
    Revoke {
        #[arg(long, value_name = "DIR")]
        ca_dir: PathBuf,
        /// The serial, as `gpuctl certs show` prints it.
        #[arg(long)]
        serial: String,
        /// How long the CRL is valid.
        #[arg(long, default_value_t = 3650)]
        days: u32,
    },
}

pub fn run(command: CertsCommand, fmt: Format) -> anyhow::Result<()> {
    match command {
        CertsCommand::Init {
            dir,
            cluster,
            days,
            force,
        } => {
            if dir.join(pki::CA_KEY_FILE).exists() && !force {
                bail!(
                    "{} already holds a CA; give --force to replace it (every certificate it signed stops being trusted)",
                    dir.display()
                );
            }
            let ca = pki::create_ca(&cluster, days)?;
            ca.write(&dir)?;
            match fmt {
                Format::Json | Format::Yaml => println!(
                    "{}",
                    json!({"ca": dir.join(pki::CA_CERT_FILE), "ca_key": dir.join(pki::CA_KEY_FILE)})
                ),
                Format::Table | Format::Wide => {
                    println!("CA created in {} (valid {days} days).", dir.display());
                    println!(
                        "  {}      give to every replica, agent and client",
                        pki::CA_CERT_FILE
                    );
                    println!(
                        "  {}  keep offline: it signs every certificate",
                        pki::CA_KEY_FILE
                    );
                    println!();
                    println!(
                        "Next: gpuctl certs issue replica --ca-dir {} --name replica-1 --out tls/replica-1",
                        dir.display()
                    );
                }
            }
        }
        CertsCommand::Issue {
            kind,
            ca_dir,
            name,
            out,
            san,
            role,
            tenant,
            days,
        } => {
            let role_kind = CertRole::parse(&kind)
                .with_context(|| format!("{kind:?} is not replica, node or client"))?;
            let ca = CaFiles::read(&ca_dir).with_context(|| {
                format!(
                    "reading the CA in {} (create one with `gpuctl certs init --dir {}`)",
                    ca_dir.display(),
                    ca_dir.display()
                )
            })?;
            let req = IssueRequest {
                role: role_kind,
                name,
                extra_sans: san,
                client_role: role,
                tenant,
                days,
            };
            let files = pki::issue(&ca, &req)?;
            files.write(&out)?;
            let identity = show(&out.join(pki::CERT_FILE))?;
            match fmt {
                Format::Json | Format::Yaml => println!("{}", identity_json(&identity, &out)),
                Format::Table | Format::Wide => {
                    println!("{} written to {}", describe(&identity), out.display());
                    println!("  use it with --tls-dir {}", out.display());
                }
            }
        }
        CertsCommand::Show { path } => {
            let file = if path.is_dir() {
                path.join(pki::CERT_FILE)
            } else {
                path.clone()
            };
            let identity = show(&file)?;
            match fmt {
                Format::Json | Format::Yaml => println!("{}", identity_json(&identity, &path)),
                Format::Table | Format::Wide => {
                    println!("{}", describe(&identity));
                    println!("  serial:     {}", identity.serial);
                    println!("  not after:  {}", format_time(identity.not_after_ms));
                    if let Some(w) = expiry_warning("it", identity.not_after_ms, now_ms()) {
                        println!("  WARNING: {w}");
                    }
                }
            }
            // A directory: check that its files load together (key matches, CA parses).
            if path.is_dir() {
                proto::tls::TlsContext::load(
                    TlsFiles::in_dir(&path),
                    proto::tls::ClientAuth::Required,
                )
                .with_context(|| format!("the files in {} do not load", path.display()))?;
            }
        }
        CertsCommand::Revoke {
            ca_dir,
            serial,
            days,
        } => {
            let crl = pki::revoke(&ca_dir, &serial, days)?;
            match fmt {
                Format::Json | Format::Yaml => {
                    println!("{}", json!({"crl": crl, "revoked": serial}))
                }
                Format::Table | Format::Wide => {
                    println!("serial {serial} revoked; CRL written to {}", crl.display());
                    println!(
                        "  copy it to each process's --tls-dir as {} (re-read within seconds, or on SIGHUP)",
                        proto::tls::CRL_FILE
                    );
                }
            }
        }
    }
    Ok(())
}

fn show(file: &Path) -> anyhow::Result<proto::tls::PeerIdentity> {
    let pem = std::fs::read(file).with_context(|| format!("reading {}", file.display()))?;
    let der = CertificateDer::from_pem_slice(&pem)
        .with_context(|| format!("{} holds no PEM certificate", file.display()))?;
    parse_identity(&der).with_context(|| format!("{}", file.display()))
}

fn describe(id: &proto::tls::PeerIdentity) -> String {
    let days = id.not_after_ms.saturating_sub(now_ms()) / 86_400_000;
    format!("{id}, valid {days} more days")
}

fn identity_json(id: &proto::tls::PeerIdentity, path: &Path) -> serde_json::Value {
    json!({
        "path": path, "role": id.role.as_str(), "name": id.name,
        "client_role": id.client_role, "tenant": id.tenant,
        "serial": id.serial, "not_after_ms": id.not_after_ms,
    })
}
