//! gRPC services for clients. Each handler is thin: convert the request, validate it, run it
//! on this replica or forward it to the leader (`route`), convert the answer.

mod agent_restart;
pub mod agent_service;
pub mod auth;
mod backup;
pub mod convert;
pub mod convert_service;
pub mod route;
mod service;
mod services;

pub use agent_service::{AgentService, assignments_for};
pub use service::ControlPlaneService;
pub(crate) use service::read_logs;

/// Largest request a replica decodes; bigger messages are refused before they cost memory.
pub const MAX_REQUEST_BYTES: usize = 4 * 1024 * 1024;
