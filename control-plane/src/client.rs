//! Client library used by `gpuctl`, the benchmarks and the tests: a list of replica endpoints,
//! retried in turn until one answers. Any replica accepts any call (followers forward to the
//! leader), so failing over is only a matter of trying the next endpoint. A forwarded answer
//! names the leader, and the client then starts its next calls there.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use proto::tls::{ClientAuth, ExpectedPeer, TlsContext, TlsFiles};
use proto::transport::Transport;
use proto::v1::control_plane_client::ControlPlaneClient;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;
use tonic::{Response, Status};

/// Replicas `gpuctl dev` starts, and where `gpuctl` looks when nothing else is configured.
pub const DEV_ENDPOINTS: &str = "127.0.0.1:7001,127.0.0.1:7002,127.0.0.1:7003";
/// Environment variable listing the endpoints, comma-separated.
pub const ENDPOINTS_ENV: &str = "GPUCTL_ENDPOINTS";
/// Environment variable naming the directory with `ca.pem`, `cert.pem`, `key.pem`.
pub const TLS_DIR_ENV: &str = "GPUCTL_TLS_DIR";
/// Environment variable holding an API token (`gpucp.<id>.<secret>`).
pub const TOKEN_ENV: &str = "GPUCTL_TOKEN";
/// Environment variable for `--insecure` (plaintext, to a cluster run without TLS).
pub const INSECURE_ENV: &str = "GPUCTL_INSECURE";
/// Where `gpuctl dev` writes the admin identity, relative to its data directory.
pub const DEV_ADMIN_TLS_DIR: &str = "tls/admin";

/// Adds the caller's bearer token to every request.
#[derive(Clone, Default)]
pub struct Bearer(Option<MetadataValue<Ascii>>);

impl Credentials {
    /// The same transport, acting with `token` instead.
    pub fn with_token(&self, token: impl Into<String>) -> Credentials {
        Credentials {
            transport: self.transport.clone(),
            token: Some(Secret(token.into())),
        }
    }
}

impl Interceptor for Bearer {
    fn call(&mut self, mut request: tonic::Request<()>) -> Result<tonic::Request<()>, Status> {
        if let Some(v) = &self.0 {
            request
                .metadata_mut()
                .insert(crate::api::auth::AUTHORIZATION, v.clone());
        }
        Ok(request)
    }
}

/// A client of one replica, with the caller's token on every call.
pub type ApiClient = ControlPlaneClient<InterceptedService<Channel, Bearer>>;

/// How a client proves who it is: TLS (with or without a client certificate) and an
/// optional token.
#[derive(Clone, Debug)]
pub struct Credentials {
    pub transport: Transport,
    /// Never printed (see the `Debug` of `Transport`; the token is shown as present or not).
    pub token: Option<Secret>,
}

/// A token, kept out of `Debug` output and logs.
#[derive(Clone)]
pub struct Secret(pub String);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<token>")
    }
}

impl Credentials {
    /// Plaintext, no token: for clusters run with `--insecure`.
    pub fn insecure() -> Credentials {
        Credentials {
            transport: Transport::Plain,
            token: None,
        }
    }

    /// TLS with the identity in `dir` (`ca.pem`, and `cert.pem` + `key.pem` when present:
    /// a directory with only the CA makes a token-only client).
    pub fn from_dir(dir: &Path, token: Option<Secret>) -> anyhow::Result<Credentials> {
        let mut files = TlsFiles::in_dir(dir);
        if !files.cert.as_ref().is_some_and(|c| c.exists()) {
            files.cert = None;
            files.key = None;
        }
        let ctx = TlsContext::load(files, ClientAuth::Required)
            .with_context(|| format!("loading the TLS identity in {}", dir.display()))?;
        Ok(Credentials {
            transport: Transport::Tls(ctx),
            token,
        })
    }

    /// What `gpuctl` uses: `--insecure`; or the TLS directory given (flag or `GPUCTL_TLS_DIR`);
    /// or the admin identity `gpuctl dev` wrote under `./dev-data`; with the token given
    /// (flag or `GPUCTL_TOKEN`).
    pub fn resolve(
        insecure: bool,
        tls_dir: Option<PathBuf>,
        token: Option<String>,
    ) -> anyhow::Result<Credentials> {
        let token = token
            .filter(|t| !t.trim().is_empty())
            .map(|t| Secret(t.trim().to_owned()));
        if insecure {
            return Ok(Credentials {
                token,
                ..Credentials::insecure()
            });
        }
        let dir = match tls_dir {
            Some(d) => d,
            None => {
                let dev = Path::new(crate::cli::DEV_DATA_DIR).join(DEV_ADMIN_TLS_DIR);
                if !dev.join(proto::tls::pki::CA_CERT_FILE).exists() {
                    anyhow::bail!(
                        "no TLS identity to talk to the control plane with: give --tls-dir DIR (or {TLS_DIR_ENV}) holding ca.pem, cert.pem and key.pem, add --token (or {TOKEN_ENV}) if the certificate grants no role, or --insecure for a cluster run without TLS; `gpuctl dev` writes one to {}",
                        dev.display()
                    );
                }
                dev
            }
        };
        Credentials::from_dir(&dir, token)
    }

    fn bearer(&self) -> anyhow::Result<Bearer> {
        match &self.token {
            None => Ok(Bearer(None)),
            Some(Secret(t)) => {
                Ok(Bearer(Some(format!("Bearer {t}").parse().context(
                    "the token holds characters that cannot be sent",
                )?)))
            }
        }
    }

    /// A client of the replica at `addr`.
    pub fn api_client(&self, addr: &str) -> anyhow::Result<ApiClient> {
        let channel = self
            .transport
            .channel(addr, ExpectedPeer::Replica)
            .map_err(|err| anyhow::anyhow!("endpoint {addr:?} is not HOST:PORT: {err}"))?;
        Ok(
            ControlPlaneClient::with_interceptor(channel, self.bearer()?)
                .max_decoding_message_size(256 * 1024 * 1024),
        )
    }
}

#[derive(Clone)]
pub struct Client {
    endpoints: Vec<String>,
    clients: Vec<ApiClient>,
    pub credentials: Credentials,
    /// The endpoint that answered last, or the leader a forwarded answer named (when it is
    /// one of `endpoints`); tried first next time.
    preferred: usize,
    /// How long a call keeps retrying across endpoints before giving up.
    pub deadline: Duration,
    /// Limit for one attempt against one endpoint.
    pub attempt_timeout: Duration,
    /// Whether a `DeadlineExceeded` that a replica answered is retried. Membership changes
    /// turn this off: their `DeadlineExceeded` is a verdict (the new replica did not answer;
    /// the change could not commit), and repeating the call would only repeat it.
    pub retry_deadline_exceeded: bool,
}

impl Client {
    pub fn new(endpoints: &[String], credentials: &Credentials) -> anyhow::Result<Client> {
        if endpoints.is_empty() {
            anyhow::bail!("no control-plane endpoints given");
        }
        let clients = endpoints
            .iter()
            .map(|e| credentials.api_client(e))
            .collect::<anyhow::Result<_>>()?;
        Ok(Client {
            endpoints: endpoints.to_vec(),
            clients,
            credentials: credentials.clone(),
            preferred: 0,
            deadline: Duration::from_secs(15),
            attempt_timeout: Duration::from_secs(5),
            retry_deadline_exceeded: true,
        })
    }

    pub fn parse_endpoints(s: &str) -> Vec<String> {
        s.split(',')
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .map(|e| e.trim_start_matches("http://").to_owned())
            .collect()
    }

    pub fn endpoints(&self) -> &[String] {
        &self.endpoints
    }

    /// The endpoint the next call tries first.
    pub fn preferred_endpoint(&self) -> &str {
        &self.endpoints[self.preferred]
    }

    /// A client for one endpoint only (no failover), e.g. to ask a specific replica.
    pub fn endpoint_client(&self, i: usize) -> ApiClient {
        self.clients[i].clone()
    }

    /// Runs `call` against the endpoints until one succeeds or fails for a reason retrying
    /// cannot fix. Calls must be safe to repeat (submissions carry an idempotency key).
    pub async fn call<T, F, Fut>(&mut self, mut call: F) -> Result<T, Status>
    where
        F: FnMut(ApiClient, Duration) -> Fut,
        Fut: Future<Output = Result<Response<T>, Status>>,
    {
        let start = tokio::time::Instant::now();
        // Short, capped backoff: during a failover the cluster is typically back within a few
        // hundred milliseconds, and a coarse backoff would add its own delay on top.
        let mut backoff = Duration::from_millis(5);
        let mut last: Option<Status> = None;
        // Sticky: a plaintext attempt that met a TLS server explains every later failure
        // (broken pipes, resets) better than whichever error happened to come last.
        let mut speaks_tls: Option<String> = None;
        loop {
            for k in 0..self.clients.len() {
                let i = (self.preferred + k) % self.clients.len();
                let fut = call(self.clients[i].clone(), self.attempt_timeout);
                match tokio::time::timeout(self.attempt_timeout, fut).await {
                    Ok(Ok(resp)) => {
                        self.preferred = self.leader_hinted(resp.metadata()).unwrap_or(i);
                        return Ok(resp.into_inner());
                    }
                    Ok(Err(status))
                        if self.credentials.transport.tls().is_none()
                            && status.code() == tonic::Code::Internal
                            && status.message().starts_with("h2 protocol error") =>
                    {
                        // A TLS server answering a plaintext HTTP/2 preface with TLS records.
                        speaks_tls = Some(format!(
                            "{} does not speak plaintext: it runs with TLS (drop --insecure and give --tls-dir)",
                            self.endpoints[i]
                        ));
                    }
                    Ok(Err(status))
                        if retryable(&status)
                            && (self.retry_deadline_exceeded
                                || status.code() != tonic::Code::DeadlineExceeded) =>
                    {
                        last = Some(Status::new(status.code(), with_causes(&status)))
                    }
                    Ok(Err(status)) => {
                        self.preferred = self.leader_hinted(status.metadata()).unwrap_or(i);
                        return Err(status);
                    }
                    Err(_) => {
                        last = Some(Status::deadline_exceeded(format!(
                            "{} did not answer within {:?}",
                            self.endpoints[i], self.attempt_timeout
                        )))
                    }
                }
                if start.elapsed() >= self.deadline {
                    break;
                }
            }
            if start.elapsed() >= self.deadline {
                let last = speaks_tls
                    .or_else(|| last.map(|s| s.message().to_owned()))
                    .unwrap_or_default();
                return Err(Status::unavailable(format!(
                    "no replica of [{}] could serve the request within {:?}; last error: {last}",
                    self.endpoints.join(", "),
                    self.deadline
                )));
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_millis(50));
        }
    }
}

impl Client {
    /// The endpoint a forwarded answer names as the leader (`route::LEADER_HINT`), if it is
    /// one of this client's endpoints. Only known endpoints are taken: a leader's advertised
    /// address need not be reachable from here (another network, a name that does not
    /// resolve), and the list is what the user chose to trust.
    fn leader_hinted(&self, metadata: &tonic::metadata::MetadataMap) -> Option<usize> {
        let hint = metadata
            .get(crate::api::route::LEADER_HINT)?
            .to_str()
            .ok()?;
        let hint = hint.trim_start_matches("http://");
        self.endpoints.iter().position(|e| e == hint)
    }
}

pub use proto::transport::retryable;

fn with_causes(status: &Status) -> String {
    proto::transport::status_text(status)
}

/// Sets a per-attempt timeout on a request.
pub fn with_timeout<T>(message: T, timeout: Duration) -> tonic::Request<T> {
    let mut r = tonic::Request::new(message);
    r.set_timeout(timeout);
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    fn client(endpoints: &[&str]) -> Client {
        let endpoints: Vec<String> = endpoints.iter().map(|e| e.to_string()).collect();
        Client::new(&endpoints, &Credentials::insecure()).unwrap()
    }

    fn hinted(addr: &str) -> tonic::metadata::MetadataMap {
        let mut m = tonic::metadata::MetadataMap::new();
        m.insert(crate::api::route::LEADER_HINT, addr.parse().unwrap());
        m
    }

    #[tokio::test]
    async fn a_leader_hint_is_taken_only_when_it_names_one_of_the_endpoints() {
        let c = client(&["10.0.0.1:7001", "10.0.0.2:7001", "10.0.0.3:7001"]);
        assert_eq!(c.leader_hinted(&hinted("10.0.0.3:7001")), Some(2));
        assert_eq!(c.leader_hinted(&hinted("http://10.0.0.2:7001")), Some(1));
        // An address the user did not list (another network, an internal name) is ignored.
        assert_eq!(c.leader_hinted(&hinted("192.168.1.9:7001")), None);
        assert_eq!(c.leader_hinted(&tonic::metadata::MetadataMap::new()), None);
    }
}
