//! openraft's own storage conformance suite, run against the sled log store and state machine.

use openraft::testing::{StoreBuilder, Suite};
use tempfile::TempDir;

use super::log_store::LogStore;
use super::state_machine::StateMachineStore;
use super::{StorageError, TypeConfig};

struct SledBuilder;

impl StoreBuilder<TypeConfig, LogStore, StateMachineStore, TempDir> for SledBuilder {
    async fn build(&self) -> Result<(TempDir, LogStore, StateMachineStore), StorageError> {
        // The suite's signature has no room for a setup error; a test machine without a writable
        // temp dir cannot run any of these tests anyway.
        let dir = TempDir::new().expect("creating a temp dir");
        let db = sled::Config::new()
            .path(dir.path())
            .open()
            .expect("opening sled in a fresh temp dir");
        let log = LogStore::open(&db).expect("opening the log trees");
        let sm = StateMachineStore::open(&db).expect("opening the state machine");
        Ok((dir, log, sm))
    }
}

#[test]
fn sled_store_passes_openraft_storage_suite() -> Result<(), StorageError> {
    Suite::test_all(SledBuilder)
}
