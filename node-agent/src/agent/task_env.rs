//! The variables a task of a multi-task job finds, so that torchrun, DeepSpeed, Horovod and
//! scripts written for Slurm start without a wrapper: its rank among the job's tasks, the
//! world size, its rank on its host, the rendezvous address and port, and the Slurm names of
//! the same; and what a service's replica needs to serve: its host ports (`PORT`,
//! `GPUCP_PORT_<NAME>`) and which replica of which service it is. Pure: computed from the
//! assignment alone.

use std::collections::BTreeMap;

/// Lowest rendezvous port: below Linux's ephemeral range (32768+), so a port chosen for a
/// job is not one the kernel hands out to an outgoing connection.
const FIRST_MASTER_PORT: u64 = 20_000;
const MASTER_PORTS: u64 = 12_000;

/// The job's rendezvous port: one per job (jobs sharing a first host get different ports,
/// unless their ids are 12,000 apart).
pub fn master_port(job_id: u64) -> u64 {
    FIRST_MASTER_PORT + job_id % MASTER_PORTS
}

/// Variables for task `index` of `nodes.len()`, given each task's node and host (address
/// to reach it) in index order. The `GPUCP_*` ones are always set; the framework names
/// (`RANK`, `MASTER_PORT`, `SLURM_*`, ...) only where the job's own environment does not
/// set them. Local ranks count tasks on the same node.
pub fn task_env(
    job_id: u64,
    index: u32,
    nodes: &[String],
    hosts: &[String],
    user: &BTreeMap<String, String>,
) -> BTreeMap<String, String> {
    let count = nodes.len().max(1);
    let index = index as usize;
    let me = nodes.get(index).cloned().unwrap_or_default();
    let local_rank = nodes.iter().take(index).filter(|h| **h == me).count();
    let local_size = nodes.iter().filter(|h| **h == me).count().max(1);
    let master = hosts
        .first()
        .filter(|h| !h.is_empty())
        .cloned()
        .unwrap_or_else(|| "127.0.0.1".into());
    let mut distinct: Vec<&String> = Vec::new();
    for h in nodes {
        if !distinct.contains(&h) {
            distinct.push(h);
        }
    }
    let mut env = BTreeMap::new();
    let mut set = |k: &str, v: String| {
        env.insert(k.to_owned(), v);
    };
    set("GPUCP_TASK_ID", index.to_string());
    set("GPUCP_TASK_COUNT", count.to_string());
    set("GPUCP_TASK_HOSTS", hosts.join(","));
    let defaults = [
        ("RANK", index.to_string()),
        ("WORLD_SIZE", count.to_string()),
        ("LOCAL_RANK", local_rank.to_string()),
        ("LOCAL_WORLD_SIZE", local_size.to_string()),
        ("MASTER_ADDR", master),
        ("MASTER_PORT", master_port(job_id).to_string()),
        ("SLURM_JOB_ID", job_id.to_string()),
        ("SLURM_PROCID", index.to_string()),
        ("SLURM_NTASKS", count.to_string()),
        ("SLURM_LOCALID", local_rank.to_string()),
        ("SLURM_NNODES", distinct.len().max(1).to_string()),
        (
            "SLURM_NODEID",
            distinct
                .iter()
                .position(|h| **h == me)
                .unwrap_or(0)
                .to_string(),
        ),
    ];
    for (k, v) in defaults {
        if !user.contains_key(k) {
            env.insert(k.to_owned(), v);
        }
    }
    env
}

/// Where a job sits in its job array.
pub struct ArrayPlace {
    pub array_id: u64,
    pub index: u32,
    pub count: u32,
    pub min: u32,
    pub max: u32,
}

/// The variables of a job of an array: `GPUCP_ARRAY_*` always, Slurm's `SLURM_ARRAY_*` where
/// the job's own environment does not set them.
pub fn array_env(a: &ArrayPlace, user: &BTreeMap<String, String>) -> BTreeMap<String, String> {
    let mut env = BTreeMap::new();
    env.insert("GPUCP_ARRAY_JOB_ID".into(), a.array_id.to_string());
    env.insert("GPUCP_ARRAY_TASK_ID".into(), a.index.to_string());
    let slurm = [
        ("SLURM_ARRAY_JOB_ID", a.array_id.to_string()),
        ("SLURM_ARRAY_TASK_ID", a.index.to_string()),
        ("SLURM_ARRAY_TASK_COUNT", a.count.to_string()),
        ("SLURM_ARRAY_TASK_MIN", a.min.to_string()),
        ("SLURM_ARRAY_TASK_MAX", a.max.to_string()),
    ];
    for (k, v) in slurm {
        if !user.contains_key(k) {
            env.insert(k.to_owned(), v);
        }
    }
    env
}

/// Which replica of which service a task is.
pub struct ReplicaPlace<'a> {
    /// The service's key, `tenant/name`.
    pub service: &'a str,
    pub ordinal: u32,
    pub revision: u64,
}

/// The variables of a task given host ports and, for a service's replica, its place:
/// `PORT` (the first port, the name most servers read), `GPUCP_PORT_<NAME>` for each (the
/// name upper-cased, anything but letters, digits and `_` made `_`), and `GPUCP_SERVICE`,
/// `GPUCP_SERVICE_NAME`, `GPUCP_REPLICA`, `GPUCP_REVISION`. All of them win over the job's own
/// environment: the ports are this copy's alone (a fixed `PORT` in a service's template
/// would make two replicas on one host collide, and the probes check the given port).
pub fn service_env(
    ports: &[(String, u32)],
    replica: Option<&ReplicaPlace<'_>>,
) -> BTreeMap<String, String> {
    let mut env = BTreeMap::new();
    if let Some((_, first)) = ports.first() {
        env.insert("PORT".to_owned(), first.to_string());
    }
    for (name, port) in ports {
        if name.is_empty() {
            continue;
        }
        let name: String = name
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() {
                    c.to_ascii_uppercase()
                } else {
                    '_'
                }
            })
            .collect();
        env.insert(format!("GPUCP_PORT_{name}"), port.to_string());
    }
    if let Some(r) = replica {
        let name = r.service.split_once('/').map_or(r.service, |(_, n)| n);
        env.insert("GPUCP_SERVICE".to_owned(), r.service.to_owned());
        env.insert("GPUCP_SERVICE_NAME".to_owned(), name.to_owned());
        env.insert("GPUCP_REPLICA".to_owned(), r.ordinal.to_string());
        env.insert("GPUCP_REVISION".to_owned(), r.revision.to_string());
    }
    env
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replica_finds_its_ports_and_its_place_in_its_service() {
        let ports = vec![
            ("http".to_owned(), 20_007),
            ("metrics_2".to_owned(), 20_008),
        ];
        let place = ReplicaPlace {
            service: "team-a/web",
            ordinal: 3,
            revision: 12,
        };
        let e = service_env(&ports, Some(&place));
        assert_eq!(e["PORT"], "20007", "the first port");
        assert_eq!(e["GPUCP_PORT_HTTP"], "20007");
        assert_eq!(e["GPUCP_PORT_METRICS_2"], "20008");
        assert_eq!(e["GPUCP_SERVICE"], "team-a/web");
        assert_eq!(e["GPUCP_SERVICE_NAME"], "web");
        assert_eq!(e["GPUCP_REPLICA"], "3");
        assert_eq!(e["GPUCP_REVISION"], "12");
        // A name the control plane would refuse still makes a usable variable name.
        let odd = service_env(&[("a-b.c".to_owned(), 1)], None);
        assert_eq!(odd["GPUCP_PORT_A_B_C"], "1");
        assert!(!odd.contains_key("GPUCP_SERVICE"));
        // No ports, no replica: nothing.
        assert!(service_env(&[], None).is_empty());
    }

    #[test]
    fn array_jobs_find_their_index_under_slurms_names() {
        let place = ArrayPlace {
            array_id: 41,
            index: 7,
            count: 100,
            min: 0,
            max: 99,
        };
        let e = array_env(&place, &BTreeMap::new());
        assert_eq!(e["SLURM_ARRAY_TASK_ID"], "7");
        assert_eq!(e["SLURM_ARRAY_JOB_ID"], "41");
        assert_eq!(e["SLURM_ARRAY_TASK_COUNT"], "100");
        assert_eq!(e["SLURM_ARRAY_TASK_MAX"], "99");
        assert_eq!(e["GPUCP_ARRAY_TASK_ID"], "7");
        let user = BTreeMap::from([("SLURM_ARRAY_TASK_ID".to_string(), "x".to_string())]);
        let e = array_env(&place, &user);
        assert!(
            !e.contains_key("SLURM_ARRAY_TASK_ID"),
            "the job's own value stays"
        );
        assert_eq!(e["GPUCP_ARRAY_TASK_ID"], "7");
    }

    fn hosts(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn ranks_count_across_the_job_and_within_each_host() {
        let h = hosts(&["10.0.0.1", "10.0.0.1", "10.0.0.2", "10.0.0.1"]);
        let e = task_env(41, 3, &h, &h, &BTreeMap::new());
        assert_eq!(e["RANK"], "3");
        assert_eq!(e["WORLD_SIZE"], "4");
        assert_eq!(e["LOCAL_RANK"], "2", "the third task on 10.0.0.1");
        assert_eq!(e["LOCAL_WORLD_SIZE"], "3");
        assert_eq!(e["MASTER_ADDR"], "10.0.0.1");
        assert_eq!(e["MASTER_PORT"], "20041");
        assert_eq!(e["SLURM_PROCID"], "3");
        assert_eq!(e["SLURM_NNODES"], "2");
        assert_eq!(e["SLURM_NODEID"], "0");
        assert_eq!(e["GPUCP_TASK_HOSTS"], "10.0.0.1,10.0.0.1,10.0.0.2,10.0.0.1");
        let second_host = task_env(41, 2, &h, &h, &BTreeMap::new());
        assert_eq!(second_host["LOCAL_RANK"], "0");
        assert_eq!(second_host["SLURM_NODEID"], "1");
    }

    #[test]
    fn two_nodes_behind_one_address_are_two_nodes() {
        let nodes = hosts(&["n1", "n2"]);
        let addrs = hosts(&["127.0.0.1", "127.0.0.1"]);
        let e = task_env(1, 1, &nodes, &addrs, &BTreeMap::new());
        assert_eq!(e["LOCAL_RANK"], "0");
        assert_eq!(e["LOCAL_WORLD_SIZE"], "1");
        assert_eq!(e["SLURM_NNODES"], "2");
        assert_eq!(e["MASTER_ADDR"], "127.0.0.1");
    }

    #[test]
    fn the_jobs_own_variables_win_except_gpucp_ones() {
        let user = BTreeMap::from([
            ("MASTER_PORT".to_owned(), "29500".to_owned()),
            ("GPUCP_TASK_ID".to_owned(), "9".to_owned()),
        ]);
        let e = task_env(7, 0, &hosts(&["n"]), &hosts(&["h"]), &user);
        assert!(!e.contains_key("MASTER_PORT"), "the job's 29500 stays");
        assert_eq!(e["GPUCP_TASK_ID"], "0");
        assert_eq!(e["WORLD_SIZE"], "1");
    }

    #[test]
    fn a_single_task_job_is_rank_0_of_1_and_ports_stay_below_the_ephemeral_range() {
        let e = task_env(5, 0, &[], &[], &BTreeMap::new());
        assert_eq!((e["RANK"].as_str(), e["WORLD_SIZE"].as_str()), ("0", "1"));
        assert_eq!(e["MASTER_ADDR"], "127.0.0.1");
        for id in [0, 1, 11_999, 12_000, u64::MAX] {
            let p = master_port(id);
            assert!((20_000..32_000).contains(&p), "{id}: {p}");
        }
    }
}
