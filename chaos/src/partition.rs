//! Network partitions on loopback with iptables.
//!
//! Every replica and agent of a chaos cluster listens on its own loopback address (127.77.X.Y,
//! see [`Addresses`]) and binds its outgoing connections to it (`GPUCP_SOURCE_ADDRESS`), so a
//! process's traffic is exactly the packets from or to its address. Isolating one process
//! drops, in a chain of our own hooked into OUTPUT for `lo` (loopback packets pass OUTPUT
//! once), every packet from its address to another address and from another address to it.
//! Dropped (not rejected) packets look like a real partition: established connections stall
//! until their timeouts fire. Rules name only this run's addresses, so no other traffic is
//! touched; the chain is removed when the [`Partitioner`] is dropped (also on panic), on
//! Ctrl-C (see `main.rs`), and chains left by a run that was SIGKILLed are removed by the next
//! run (their names carry the pid of the run that made them).

use std::collections::BTreeSet;
use std::net::Ipv4Addr;
use std::process::Command;
use std::sync::Mutex;

use anyhow::{Context, bail};

const CHAIN_PREFIX: &str = "GPUCP-CHAOS-";

/// The loopback addresses of one run: 127.77.<run>.<host>, with `run` derived from the pid so
/// that concurrent runs (a CI test next to a manual run) do not share addresses.
#[derive(Debug, Clone, Copy)]
pub struct Addresses {
    run: u8,
}

impl Addresses {
    pub fn for_this_process() -> Addresses {
        Addresses {
            run: (std::process::id() % 250 + 1) as u8,
        }
    }
    pub fn replica(&self, id: u64) -> Ipv4Addr {
        Ipv4Addr::new(127, 77, self.run, 10 + id as u8)
    }
    pub fn agent(&self, index: usize) -> Ipv4Addr {
        Ipv4Addr::new(127, 77, self.run, 100 + index as u8)
    }
}

pub struct Partitioner {
    chain: String,
    isolated: Mutex<BTreeSet<Ipv4Addr>>,
}

fn iptables(args: &[&str]) -> anyhow::Result<String> {
    // -w: wait for the xtables lock instead of failing when another iptables runs.
    let out = Command::new("iptables")
        .arg("-w")
        .args(args)
        .output()
        .context(
            "running iptables (partitions need it: `apt-get install iptables`, or run without \
             partitions: --leader-partitions 0 --agent-partitions 0)",
        )?;
    if !out.status.success() {
        bail!(
            "iptables {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The name of this process's chain (also used by the Ctrl-C handler to clean up).
pub fn chain_name() -> String {
    format!("{CHAIN_PREFIX}{}", std::process::id())
}

impl Partitioner {
    /// Creates this run's chain; fails with an actionable message without root or iptables.
    pub fn new() -> anyhow::Result<Partitioner> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            bail!(
                "network partitions need root (iptables rules on loopback); run as root, or \
                 pass --leader-partitions 0 --agent-partitions 0"
            );
        }
        remove_stale_chains();
        let chain = chain_name();
        remove_chain(&chain);
        iptables(&["-N", &chain])?;
        let p = Partitioner {
            chain: chain.clone(),
            isolated: Mutex::new(BTreeSet::new()),
        };
        iptables(&["-I", "OUTPUT", "1", "-o", "lo", "-j", &chain])?;
        Ok(p)
    }

    /// Drops every packet between `ip` and any other address.
    pub fn isolate(&self, ip: Ipv4Addr) -> anyhow::Result<()> {
        let mut set = self.isolated.lock().unwrap_or_else(|e| e.into_inner());
        if !set.insert(ip) {
            return Ok(());
        }
        let ip = ip.to_string();
        iptables(&["-A", &self.chain, "-s", &ip, "!", "-d", &ip, "-j", "DROP"])?;
        iptables(&["-A", &self.chain, "-d", &ip, "!", "-s", &ip, "-j", "DROP"])?;
        Ok(())
    }

    pub fn heal(&self, ip: Ipv4Addr) -> anyhow::Result<()> {
        let mut set = self.isolated.lock().unwrap_or_else(|e| e.into_inner());
        if !set.remove(&ip) {
            return Ok(());
        }
        let ip = ip.to_string();
        iptables(&["-D", &self.chain, "-s", &ip, "!", "-d", &ip, "-j", "DROP"])?;
        iptables(&["-D", &self.chain, "-d", &ip, "!", "-s", &ip, "-j", "DROP"])?;
        Ok(())
    }

    pub fn heal_all(&self) -> anyhow::Result<()> {
        let ips: Vec<Ipv4Addr> = self
            .isolated
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .copied()
            .collect();
        for ip in ips {
            self.heal(ip)?;
        }
        Ok(())
    }
}

impl Drop for Partitioner {
    fn drop(&mut self) {
        remove_chain(&self.chain);
    }
}

/// Unhooks, flushes and deletes a chain; quiet when it does not exist.
pub fn remove_chain(chain: &str) {
    let _ = iptables(&["-D", "OUTPUT", "-o", "lo", "-j", chain]);
    let _ = iptables(&["-F", chain]);
    let _ = iptables(&["-X", chain]);
}

/// Removes chains of earlier runs whose process is gone (a run killed with SIGKILL).
fn remove_stale_chains() {
    let Ok(rules) = iptables(&["-S"]) else {
        return;
    };
    for line in rules.lines() {
        let Some(chain) = line.strip_prefix("-N ") else {
            continue;
        };
        let Some(pid) = chain.strip_prefix(CHAIN_PREFIX) else {
            continue;
        };
        if pid.parse::<u32>().is_ok() && !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            remove_chain(chain);
        }
    }
}
