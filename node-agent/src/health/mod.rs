//! GPU health: what a hardware event means for the job on the GPU and for the GPU itself.
//!
//! `xid` owns the Xid table; this module turns any [`GpuEvent`] into a [`HealthVerdict`] that
//! the agent acts on (stop the job, report the GPU unhealthy, report it healthy again).

pub mod xid;

use serde::{Deserialize, Serialize};

pub use xid::{XidClass, XidInfo, classify, classify_with_detail};

use crate::gpu::GpuEvent;

/// The consequences of one event. `false` everywhere means "no change": an informational Xid
/// on a cordoned GPU must not return it to service, only a `Recovered` event does.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HealthVerdict {
    /// The job running on this GPU (if any) has failed and should be stopped and requeued.
    pub job_fails: bool,
    /// The GPU must take no new work (cordon) until it recovers.
    pub gpu_unhealthy: bool,
    /// The GPU works again and may return to service.
    pub gpu_recovered: bool,
    /// For operators and the control plane: what happened and what to do.
    pub reason: String,
}

/// What `event` means for the job and the GPU.
pub fn gpu_health_after(event: &GpuEvent) -> HealthVerdict {
    match event {
        GpuEvent::Xid {
            gpu_uuid,
            code,
            detail,
        } => {
            let info = classify_with_detail(*code, detail);
            let detail = if detail.is_empty() {
                String::new()
            } else {
                format!(" [{detail}]")
            };
            let attention = if info.class == XidClass::Unknown {
                "unclassified, needs operator attention: "
            } else {
                ""
            };
            HealthVerdict {
                job_fails: info.class.job_fails(),
                gpu_unhealthy: info.class.gpu_unhealthy(),
                gpu_recovered: false,
                reason: format!(
                    "Xid {code} on {gpu_uuid} ({attention}{}){detail}: {:?}; action: {}",
                    info.description, info.class, info.action
                ),
            }
        }
        GpuEvent::FellOffBus { gpu_uuid } => {
            let info = classify(79);
            HealthVerdict {
                job_fails: true,
                gpu_unhealthy: true,
                gpu_recovered: false,
                reason: format!("{gpu_uuid}: {}; action: {}", info.description, info.action),
            }
        }
        GpuEvent::Recovered { gpu_uuid } => HealthVerdict {
            job_fails: false,
            gpu_unhealthy: false,
            gpu_recovered: true,
            reason: format!("{gpu_uuid} recovered and may return to service"),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn xid(code: u32) -> GpuEvent {
        GpuEvent::Xid {
            gpu_uuid: "GPU-test".into(),
            code,
            detail: String::new(),
        }
    }

    #[test]
    fn verdicts_per_event() {
        // (event, job fails, GPU unhealthy, GPU recovered, words the reason must contain)
        let cases: Vec<(GpuEvent, bool, bool, bool, &[&str])> = vec![
            (
                xid(13),
                true,
                false,
                false,
                &["Xid 13", "GPU-test", "application"],
            ),
            (xid(31), true, false, false, &["page fault"]),
            (xid(43), true, false, false, &["Xid 43"]),
            (xid(45), true, false, false, &["Preemptive cleanup"]),
            (xid(68), true, false, false, &["NVDEC0"]),
            (xid(48), true, true, false, &["Double-bit ECC", "reset"]),
            (xid(63), false, true, false, &["row remapping", "finish"]),
            (xid(64), true, true, false, &["recording failure"]),
            (xid(74), true, true, false, &["NVLink"]),
            (
                xid(79),
                true,
                true,
                false,
                &["fallen off the bus", "reboot"],
            ),
            (xid(92), false, true, false, &["single-bit ECC"]),
            (xid(94), true, true, false, &["Contained ECC"]),
            (xid(95), true, true, false, &["Uncontained ECC"]),
            (xid(119), true, true, false, &["GSP RPC timeout"]),
            (xid(120), true, true, false, &["GSP error"]),
            (xid(56), false, false, false, &["Display engine"]),
            (
                xid(4242),
                false,
                false,
                false,
                &["Xid 4242", "needs operator attention", "catalog"],
            ),
            (
                GpuEvent::Xid {
                    gpu_uuid: "GPU-test".into(),
                    code: 154,
                    detail: "GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot \
                             Required)"
                        .into(),
                },
                true,
                true,
                false,
                &[
                    "NodeRebootRequired",
                    "reboot",
                    "[GPU recovery action changed",
                ],
            ),
            (
                GpuEvent::FellOffBus {
                    gpu_uuid: "GPU-test".into(),
                },
                true,
                true,
                false,
                &["GPU-test", "fallen off the bus", "reboot"],
            ),
            (
                GpuEvent::Recovered {
                    gpu_uuid: "GPU-test".into(),
                },
                false,
                false,
                true,
                &["recovered"],
            ),
        ];
        for (event, job, gpu, recovered, words) in cases {
            let verdict = gpu_health_after(&event);
            assert_eq!(verdict.job_fails, job, "{event:?}: {}", verdict.reason);
            assert_eq!(verdict.gpu_unhealthy, gpu, "{event:?}: {}", verdict.reason);
            assert_eq!(verdict.gpu_recovered, recovered, "{event:?}");
            for word in words {
                assert!(
                    verdict.reason.contains(word),
                    "{event:?}: `{}` should mention `{word}`",
                    verdict.reason
                );
            }
        }
    }
}
