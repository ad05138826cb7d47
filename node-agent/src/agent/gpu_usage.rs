//! Per-allocation GPU accounting from the driver's per-process samples (NVML): how busy the
//! allocation kept its GPUs' streaming multiprocessors on average, and the most GPU memory it
//! held at once. Pure: the agent feeds it each sampling round (which processes belong to
//! which allocation, from their cgroups, and what the driver reported) and takes the total
//! when the allocation exits.

use std::collections::{BTreeMap, BTreeSet};

use crate::gpu::ProcessGpuSample;

/// What an allocation used of its GPUs, over the rounds it was sampled in.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GpuUsage {
    /// Rounds in which any of its processes was on a GPU.
    pub samples: u64,
    /// Sum over those rounds of its SM utilisation (percent of one GPU, summed over its
    /// GPUs: 2 GPUs fully busy count 200).
    pub sm_percent_sum: u64,
    /// The most GPU memory its processes held together in one round, bytes.
    pub peak_memory_bytes: u64,
}

impl GpuUsage {
    /// Average SM utilisation over the sampled rounds, percent.
    pub fn sm_percent_avg(&self) -> u64 {
        self.sm_percent_sum.checked_div(self.samples).unwrap_or(0)
    }
}

#[derive(Debug, Default)]
pub struct GpuUsageTracker {
    by_allocation: BTreeMap<u64, GpuUsage>,
}

impl GpuUsageTracker {
    /// One sampling round: `members` lists each live allocation's processes, `samples` what
    /// the driver reported. A process in no allocation (another host user, a leftover) is
    /// ignored.
    pub fn record(&mut self, members: &BTreeMap<u64, BTreeSet<u32>>, samples: &[ProcessGpuSample]) {
        for (allocation, pids) in members {
            let mine = samples.iter().filter(|s| pids.contains(&s.pid));
            let (mut seen, mut sm, mut memory) = (false, 0u64, 0u64);
            for s in mine {
                seen = true;
                sm += u64::from(s.sm_percent.unwrap_or(0));
                memory += s.memory_bytes.unwrap_or(0);
            }
            if !seen {
                continue;
            }
            let u = self.by_allocation.entry(*allocation).or_default();
            u.samples += 1;
            u.sm_percent_sum += sm;
            u.peak_memory_bytes = u.peak_memory_bytes.max(memory);
        }
    }

    /// What allocation `id` used (`None`: never seen on a GPU), forgetting it.
    pub fn take(&mut self, id: u64) -> Option<GpuUsage> {
        self.by_allocation.remove(&id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(gpu: &str, pid: u32, sm: Option<u32>, mem: Option<u64>) -> ProcessGpuSample {
        ProcessGpuSample {
            gpu_uuid: gpu.into(),
            pid,
            sm_percent: sm,
            memory_bytes: mem,
        }
    }

    #[test]
    fn an_allocation_sums_its_processes_per_round_and_keeps_the_peak() {
        let mut t = GpuUsageTracker::default();
        let members = BTreeMap::from([(7, BTreeSet::from([100, 101])), (8, BTreeSet::from([200]))]);
        // Round 1: 7's two processes on two GPUs; 8 on one; a stranger (pid 999) ignored.
        t.record(
            &members,
            &[
                sample("GPU-a", 100, Some(90), Some(10 << 30)),
                sample("GPU-b", 101, Some(70), Some(6 << 30)),
                sample("GPU-c", 200, Some(40), None),
                sample("GPU-c", 999, Some(100), Some(1 << 30)),
            ],
        );
        // Round 2: 7 uses less; 8 has no process on a GPU (a CPU phase): not counted.
        t.record(&members, &[sample("GPU-a", 100, Some(50), Some(4 << 30))]);
        let seven = t.take(7).unwrap();
        assert_eq!(seven.samples, 2);
        assert_eq!(seven.sm_percent_avg(), (160 + 50) / 2);
        assert_eq!(seven.peak_memory_bytes, 16 << 30);
        let eight = t.take(8).unwrap();
        assert_eq!(
            (
                eight.samples,
                eight.sm_percent_avg(),
                eight.peak_memory_bytes
            ),
            (1, 40, 0)
        );
        assert_eq!(t.take(7), None, "taken once");
    }

    #[test]
    fn an_allocation_never_on_a_gpu_has_no_gpu_usage() {
        let mut t = GpuUsageTracker::default();
        t.record(
            &BTreeMap::from([(3, BTreeSet::from([5]))]),
            &[sample("GPU-a", 6, Some(10), None)],
        );
        assert_eq!(t.take(3), None);
        assert_eq!(GpuUsage::default().sm_percent_avg(), 0);
    }
}
