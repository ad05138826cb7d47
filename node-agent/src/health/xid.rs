//! Xid classification: one data table from NVIDIA's Xid catalog
//! (<https://docs.nvidia.com/deploy/xid-errors/>) saying, per code, what the fault means for
//! the job on the GPU and for the GPU itself, and what an operator should do.
//!
//! The table is data, not code, so adding a code after a driver release is one line. The
//! codes the Kubernetes device plugin treats as application errors (13, 31, 43, 45, 68, 109)
//! are application errors here too, so a GPU that one scheduler keeps in service this one
//! keeps as well.

use serde::Serialize;

/// What an Xid means for the job and the GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, serde::Deserialize)]
pub enum XidClass {
    /// The application caused it (bad address, illegal instruction, killed mid-flight): the job
    /// on that GPU fails, the GPU stays in service.
    ApplicationError,
    /// The GPU still works but has recorded a fault that only a reset clears (a pending row
    /// remap, a high single-bit ECC rate): the running job may finish, the GPU takes no new
    /// work until it is reset.
    ResetWhenIdle,
    /// GPU state is no longer trustworthy (uncorrectable ECC, firmware, NVLink faults): the job
    /// fails and the GPU is out of service until it is reset.
    GpuResetRequired,
    /// The GPU no longer answers on PCIe (Xid 79): the job fails; recovery usually needs a
    /// node reboot or a reseat.
    FellOffBus,
    /// The driver says only a node reboot recovers this GPU.
    NodeRebootRequired,
    /// Logged for operators; nothing to do for jobs or scheduling.
    Informational,
    /// A code this table does not know (see [`classify`] for how it is treated).
    Unknown,
}

impl XidClass {
    /// Whether the job running on the GPU should be considered failed.
    pub fn job_fails(self) -> bool {
        match self {
            XidClass::ApplicationError
            | XidClass::GpuResetRequired
            | XidClass::FellOffBus
            | XidClass::NodeRebootRequired => true,
            XidClass::ResetWhenIdle | XidClass::Informational | XidClass::Unknown => false,
        }
    }

    /// Whether the GPU must stop taking work (cordoned) until it recovers.
    pub fn gpu_unhealthy(self) -> bool {
        match self {
            XidClass::ResetWhenIdle
            | XidClass::GpuResetRequired
            | XidClass::FellOffBus
            | XidClass::NodeRebootRequired => true,
            XidClass::ApplicationError | XidClass::Informational | XidClass::Unknown => false,
        }
    }
}

/// One row of the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct XidInfo {
    pub code: u32,
    pub class: XidClass,
    /// NVIDIA's name for the error.
    pub description: &'static str,
    /// What an operator should do.
    pub action: &'static str,
}

const FIX_APP: &str = "none for the GPU: the application caused it; check the job's code and \
                       inputs (if the same GPU repeats it for different jobs, reset the GPU)";
const RESET: &str = "drain the GPU and reset it (`nvidia-smi -r -i <gpu>`); if it repeats, run \
                     DCGM diagnostics and contact the vendor";
const RESET_IDLE: &str = "let the running job finish, then reset the GPU (`nvidia-smi -r`) so \
                          the driver can apply the repair; return it to service afterwards";
const ECC_RESET: &str = "drain the GPU and reset it so row remapping / page retirement takes \
                         effect; check `nvidia-smi -q -d ROW_REMAPPER` and RMA if remapping \
                         failed or resources are exhausted";
const NVLINK: &str = "drain the GPU and reset it (on NVSwitch systems reset the whole \
                      NVLink domain); check `nvidia-smi nvlink -e` error counters and cabling";
const BUS: &str = "the GPU is gone from PCIe: reboot the node; if it repeats, check power, \
                   cooling and the card's seating, and contact the vendor";
const LOG: &str = "nothing for jobs; keep it in the node's fault history";

/// The table, sorted by code (a test checks the order). Descriptions follow NVIDIA's Xid
/// catalog; the class is this project's reading of the catalog's recommended action.
const TABLE: &[XidInfo] = &[
    x(
        8,
        XidClass::ApplicationError,
        "GPU stopped processing (channel idle timeout)",
        FIX_APP,
    ),
    x(
        13,
        XidClass::ApplicationError,
        "Graphics engine exception (e.g. out-of-range access, illegal instruction)",
        FIX_APP,
    ),
    x(
        31,
        XidClass::ApplicationError,
        "GPU memory page fault (illegal address)",
        FIX_APP,
    ),
    x(
        32,
        XidClass::GpuResetRequired,
        "Invalid or corrupted push buffer stream (PBDMA error)",
        RESET,
    ),
    x(
        38,
        XidClass::GpuResetRequired,
        "Driver firmware error",
        RESET,
    ),
    x(
        43,
        XidClass::ApplicationError,
        "GPU stopped processing (the application's channel was reset)",
        FIX_APP,
    ),
    x(
        44,
        XidClass::GpuResetRequired,
        "Graphics engine fault during context switch",
        RESET,
    ),
    x(
        45,
        XidClass::ApplicationError,
        "Preemptive cleanup, due to previous errors (the process was killed or hit another fault)",
        FIX_APP,
    ),
    x(
        48,
        XidClass::GpuResetRequired,
        "Double-bit ECC error (uncorrectable memory error)",
        ECC_RESET,
    ),
    x(56, XidClass::Informational, "Display engine error", LOG),
    x(
        57,
        XidClass::GpuResetRequired,
        "Error programming video memory interface",
        RESET,
    ),
    x(
        58,
        XidClass::GpuResetRequired,
        "Unstable video memory interface detected",
        RESET,
    ),
    x(
        61,
        XidClass::Informational,
        "Internal micro-controller breakpoint/warning",
        LOG,
    ),
    x(
        62,
        XidClass::GpuResetRequired,
        "Internal micro-controller halt",
        RESET,
    ),
    x(
        63,
        XidClass::ResetWhenIdle,
        "ECC page retirement or row remapping recording event",
        RESET_IDLE,
    ),
    x(
        64,
        XidClass::GpuResetRequired,
        "ECC page retirement or row remapper recording failure",
        ECC_RESET,
    ),
    x(
        68,
        XidClass::ApplicationError,
        "NVDEC0 exception (video decoder)",
        FIX_APP,
    ),
    x(
        69,
        XidClass::GpuResetRequired,
        "Graphics engine class error",
        RESET,
    ),
    x(74, XidClass::GpuResetRequired, "NVLink error", NVLINK),
    x(79, XidClass::FellOffBus, "GPU has fallen off the bus", BUS),
    x(
        80,
        XidClass::GpuResetRequired,
        "Corrupted data sent to GPU",
        RESET,
    ),
    x(81, XidClass::GpuResetRequired, "VGA subsystem error", RESET),
    x(
        92,
        XidClass::ResetWhenIdle,
        "High single-bit ECC error rate",
        RESET_IDLE,
    ),
    x(
        93,
        XidClass::Informational,
        "Non-fatal violation of provisioned InfoROM wear limit",
        LOG,
    ),
    x(
        94,
        XidClass::GpuResetRequired,
        "Contained ECC error (the affected process was terminated)",
        ECC_RESET,
    ),
    x(
        95,
        XidClass::GpuResetRequired,
        "Uncontained ECC error (every process on the GPU was terminated)",
        ECC_RESET,
    ),
    x(
        109,
        XidClass::ApplicationError,
        "Context switch timeout",
        FIX_APP,
    ),
    x(
        110,
        XidClass::GpuResetRequired,
        "Security fault error",
        RESET,
    ),
    x(
        119,
        XidClass::GpuResetRequired,
        "GSP RPC timeout (GPU System Processor did not answer)",
        RESET,
    ),
    x(
        120,
        XidClass::GpuResetRequired,
        "GSP error (GPU System Processor firmware fault)",
        RESET,
    ),
    x(
        121,
        XidClass::GpuResetRequired,
        "C2C link error (chip-to-chip interconnect)",
        RESET,
    ),
    x(
        122,
        XidClass::GpuResetRequired,
        "SPI PMU RPC read failure",
        RESET,
    ),
    x(
        123,
        XidClass::GpuResetRequired,
        "SPI PMU RPC write failure",
        RESET,
    ),
    x(
        124,
        XidClass::GpuResetRequired,
        "SPI PMU RPC erase failure",
        RESET,
    ),
    x(
        140,
        XidClass::GpuResetRequired,
        "Unrecovered ECC error",
        ECC_RESET,
    ),
    // Xid 154 reports the driver's required recovery action in its message; the table's class
    // is the conservative default, `classify_with_detail` reads the message.
    x(
        154,
        XidClass::GpuResetRequired,
        "GPU recovery action changed",
        RESET,
    ),
];

const fn x(code: u32, class: XidClass, description: &'static str, action: &'static str) -> XidInfo {
    XidInfo {
        code,
        class,
        description,
        action,
    }
}

/// What Xid `code` means.
///
/// Unknown codes are `XidClass::Unknown`: the job is NOT failed and the GPU is NOT cordoned,
/// but the verdict's reason asks an operator to look. Why not cordon: a new driver can add
/// benign codes, and cordoning on every unfamiliar code could take a whole fleet out of
/// service on an upgrade. Why not fail the job: when a fault is fatal to a process the driver
/// kills that process itself, so the runtime already sees the job exit; failing it on our
/// side as well would only kill work that survived. The event is still reported, so nothing
/// is silently dropped.
pub fn classify(code: u32) -> XidInfo {
    match TABLE.binary_search_by_key(&code, |info| info.code) {
        Ok(i) => TABLE[i],
        Err(_) => XidInfo {
            code,
            class: XidClass::Unknown,
            description: "Xid code not in this agent's table",
            action: "look the code up in NVIDIA's Xid catalog and the driver log (`dmesg | grep \
                     Xid`); the GPU stays in service until an operator decides",
        },
    }
}

/// Like [`classify`], but reads the driver's message where the code alone is ambiguous.
///
/// Xid 154 says which recovery the driver now requires, e.g. `GPU recovery action changed
/// from 0x0 (None) to 0x2 (Node Reboot Required)`; only the target action (after ` to `)
/// counts.
pub fn classify_with_detail(code: u32, detail: &str) -> XidInfo {
    let info = classify(code);
    if code != 154 {
        return info;
    }
    let target = detail.rsplit_once(" to ").map(|(_, t)| t).unwrap_or(detail);
    let target = target.to_ascii_lowercase();
    let class = if target.contains("node reboot") {
        XidClass::NodeRebootRequired
    } else if target.contains("drain") {
        // "Drain P2P" / "Drain and Reset": finish what runs, take nothing new, then reset.
        XidClass::ResetWhenIdle
    } else if target.contains("reset") {
        XidClass::GpuResetRequired
    } else if target.contains("none") {
        XidClass::Informational
    } else {
        info.class
    };
    let action = match class {
        XidClass::NodeRebootRequired => {
            "drain the node and reboot it; the driver cannot recover this GPU otherwise"
        }
        XidClass::ResetWhenIdle => RESET_IDLE,
        XidClass::Informational => LOG,
        _ => info.action,
    };
    XidInfo {
        class,
        action,
        ..info
    }
}

#[cfg(test)]
mod tests {
    use super::XidClass::*;
    use super::*;

    #[test]
    fn table_is_sorted_and_unique() {
        for pair in TABLE.windows(2) {
            assert!(
                pair[0].code < pair[1].code,
                "{} before {}",
                pair[0].code,
                pair[1].code
            );
        }
        for info in TABLE {
            assert!(
                !info.description.is_empty() && !info.action.is_empty(),
                "{}",
                info.code
            );
        }
    }

    #[test]
    fn codes_classify_as_the_catalog_says() {
        let expected: &[(u32, XidClass)] = &[
            (8, ApplicationError),
            (13, ApplicationError),
            (31, ApplicationError),
            (32, GpuResetRequired),
            (38, GpuResetRequired),
            (43, ApplicationError),
            (45, ApplicationError),
            (48, GpuResetRequired),
            (56, Informational),
            (57, GpuResetRequired),
            (62, GpuResetRequired),
            (63, ResetWhenIdle),
            (64, GpuResetRequired),
            (68, ApplicationError),
            (69, GpuResetRequired),
            (74, GpuResetRequired),
            (79, FellOffBus),
            (92, ResetWhenIdle),
            (94, GpuResetRequired),
            (95, GpuResetRequired),
            (109, ApplicationError),
            (119, GpuResetRequired),
            (120, GpuResetRequired),
            (122, GpuResetRequired),
            (123, GpuResetRequired),
            (140, GpuResetRequired),
            (1, Unknown),
            (999, Unknown),
            (u32::MAX, Unknown),
        ];
        for &(code, class) in expected {
            let info = classify(code);
            assert_eq!(info.code, code);
            assert_eq!(info.class, class, "Xid {code}: {}", info.description);
        }
    }

    #[test]
    fn consequences_per_class() {
        // (class, job fails, GPU unhealthy)
        let expected = [
            (ApplicationError, true, false),
            (ResetWhenIdle, false, true),
            (GpuResetRequired, true, true),
            (FellOffBus, true, true),
            (NodeRebootRequired, true, true),
            (Informational, false, false),
            (Unknown, false, false),
        ];
        for (class, job, gpu) in expected {
            assert_eq!(class.job_fails(), job, "{class:?} job_fails");
            assert_eq!(class.gpu_unhealthy(), gpu, "{class:?} gpu_unhealthy");
        }
    }

    #[test]
    fn xid_154_reads_the_target_recovery_action() {
        let cases = [
            (
                "GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)",
                NodeRebootRequired,
            ),
            (
                "GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)",
                GpuResetRequired,
            ),
            (
                "GPU recovery action changed from 0x0 (None) to 0x3 (Drain P2P)",
                ResetWhenIdle,
            ),
            (
                "GPU recovery action changed from 0x1 (GPU Reset Required) to 0x0 (None)",
                Informational,
            ),
            ("something new", GpuResetRequired),
        ];
        for (detail, class) in cases {
            assert_eq!(classify_with_detail(154, detail).class, class, "{detail}");
        }
        // Other codes ignore the message.
        assert_eq!(
            classify_with_detail(13, "node reboot").class,
            ApplicationError
        );
    }
}
