//! Device confinement on cgroup v2: there is no `devices` controller, so the allow-list is a
//! cgroup eBPF program (`BPF_PROG_TYPE_CGROUP_DEVICE`) attached to the allocation's cgroup
//! directory, as runc (`libcontainer/cgroups/devices/ebpf`) and crun do. The kernel runs it
//! on every open and mknod of a device node by a process of the cgroup; it returns 1 to
//! allow, 0 to deny (EPERM).
//!
//! Two parts. [`compile`] is pure: the rules of `devices.rs` → instructions, default deny,
//! tested by interpreting them. [`attach`] is the thin I/O: `bpf(BPF_PROG_LOAD)` and
//! `bpf(BPF_PROG_ATTACH)` through libc, with errors that say what the host lacks. About
//! twenty instructions are written by hand rather than through a crate: what is needed is
//! the encoding of six opcodes, which aya or libbpf would bring in with a large tree.
//!
//! The program, for rules `c 195:0`, `c 136:*`:
//!
//! ```text
//!     r2 = *(u32 *)(r1 + 0)      ; access_type: device type in the low 16 bits,
//!     r2 &= 0xffff               ;              access (mknod 1, read 2, write 4) above
//!     r4 = *(u32 *)(r1 + 4)      ; major
//!     r5 = *(u32 *)(r1 + 8)      ; minor
//!     if r2 != 2 goto deny       ; only character devices are ever allowed
//!     if r4 != 195 goto +3       ; rule 1
//!     if r5 != 0 goto +2
//!     r0 = 1
//!     exit
//!     if r4 != 136 goto +2       ; rule 2: any minor
//!     r0 = 1
//!     exit
//! deny:
//!     r0 = 0
//!     exit
//! ```
//!
//! The access bits are not read: every rule grants read, write and mknod, which are all the
//! access bits the kernel passes, so no access can fail a rule that matched.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;

use super::devices::DeviceRule;

/// One eBPF instruction, as `struct bpf_insn` in `linux/bpf.h`: opcode, destination register
/// in the low nibble and source register in the high nibble of one byte, a signed 16-bit
/// offset, a signed 32-bit immediate. 8 bytes, in the host's byte order.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Insn {
    pub code: u8,
    pub regs: u8,
    pub off: i16,
    pub imm: i32,
}

// Opcodes: class | operation | source (or size and mode), from linux/bpf_common.h and
// linux/bpf.h, written out as the bytes they make.
/// `BPF_LDX (0x01) | BPF_MEM (0x60) | BPF_W (0x00)`: dst = *(u32 *)(src + off),
/// zero-extended.
pub const LDX_MEM_W: u8 = 0x61;
/// `BPF_ALU (0x04) | BPF_AND (0x50) | BPF_K (0x00)`: dst = (u32)dst & imm, zero-extended.
pub const ALU32_AND_K: u8 = 0x54;
/// `BPF_JMP (0x05) | BPF_JNE (0x50) | BPF_K (0x00)`: if dst != (s64)imm, skip `off`
/// instructions.
pub const JMP_JNE_K: u8 = 0x55;
/// `BPF_ALU64 (0x07) | BPF_MOV (0xb0) | BPF_K (0x00)`: dst = (s64)imm.
pub const ALU64_MOV_K: u8 = 0xb7;
/// `BPF_JMP (0x05) | BPF_EXIT (0x90)`: return r0.
pub const JMP_EXIT: u8 = 0x95;

/// Registers the program uses: r1 holds the context on entry, r0 the verdict on exit.
const R0: u8 = 0;
const R1: u8 = 1;
const R_TYPE: u8 = 2;
const R_MAJOR: u8 = 4;
const R_MINOR: u8 = 5;

/// `struct bpf_cgroup_dev_ctx { u32 access_type; u32 major; u32 minor; }`: field offsets.
pub const CTX_ACCESS_TYPE: i16 = 0;
pub const CTX_MAJOR: i16 = 4;
pub const CTX_MINOR: i16 = 8;
/// `BPF_DEVCG_DEV_BLOCK`, `BPF_DEVCG_DEV_CHAR`: the device type in access_type's low half.
pub const DEV_BLOCK: u32 = 1;
pub const DEV_CHAR: u32 = 2;
/// `BPF_DEVCG_ACC_MKNOD`, `_READ`, `_WRITE`: the access in access_type's high half.
pub const ACC_MKNOD: u32 = 1;
pub const ACC_READ: u32 = 2;
pub const ACC_WRITE: u32 = 4;

impl Insn {
    /// The registers' nibbles follow the C bitfields `dst_reg:4, src_reg:4`, whose order is
    /// the byte order's: dst is the low nibble on little-endian hosts, the high one on big.
    const fn regs(dst: u8, src: u8) -> u8 {
        if cfg!(target_endian = "little") {
            (src << 4) | (dst & 0x0f)
        } else {
            (dst << 4) | (src & 0x0f)
        }
    }

    pub const fn dst(&self) -> u8 {
        if cfg!(target_endian = "little") {
            self.regs & 0x0f
        } else {
            self.regs >> 4
        }
    }

    pub const fn src(&self) -> u8 {
        if cfg!(target_endian = "little") {
            self.regs >> 4
        } else {
            self.regs & 0x0f
        }
    }
}

const fn insn(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> Insn {
    Insn {
        code,
        regs: Insn::regs(dst, src),
        off,
        imm,
    }
}

/// Instructions of one rule's check and of the final deny.
const RULE_ANY_MINOR_LEN: usize = 3;
const RULE_LEN: usize = 4;
const DENY_LEN: usize = 2;

/// The program for `rules`: allow a character device that one of them matches, deny any
/// other device. Empty `rules` deny every device.
///
/// Major and minor are compared as the verifier-visible 64-bit registers the 32-bit loads
/// zero-extend, against the immediate sign-extended: a rule number above `i32::MAX` (never a
/// real device: majors have 12 bits, minors 20) matches nothing, so it fails closed.
pub fn compile(rules: &[DeviceRule]) -> Vec<Insn> {
    let body: usize = rules
        .iter()
        .map(|r| {
            if r.minor.is_some() {
                RULE_LEN
            } else {
                RULE_ANY_MINOR_LEN
            }
        })
        .sum();
    let mut p = Vec::with_capacity(5 + body + DENY_LEN);
    p.push(insn(LDX_MEM_W, R_TYPE, R1, CTX_ACCESS_TYPE, 0));
    p.push(insn(ALU32_AND_K, R_TYPE, 0, 0, 0xffff));
    p.push(insn(LDX_MEM_W, R_MAJOR, R1, CTX_MAJOR, 0));
    p.push(insn(LDX_MEM_W, R_MINOR, R1, CTX_MINOR, 0));
    // Not a character device: straight to the deny at the end.
    p.push(insn(JMP_JNE_K, R_TYPE, 0, jump(body), DEV_CHAR as i32));
    for rule in rules {
        match rule.minor {
            Some(minor) => {
                // On a mismatch, skip the rest of this rule (to the next rule's first
                // instruction, or the deny).
                p.push(insn(JMP_JNE_K, R_MAJOR, 0, 3, imm(rule.major)));
                p.push(insn(JMP_JNE_K, R_MINOR, 0, 2, imm(minor)));
            }
            None => p.push(insn(JMP_JNE_K, R_MAJOR, 0, 2, imm(rule.major))),
        }
        p.push(insn(ALU64_MOV_K, R0, 0, 0, 1));
        p.push(insn(JMP_EXIT, 0, 0, 0, 0));
    }
    p.push(insn(ALU64_MOV_K, R0, 0, 0, 0));
    p.push(insn(JMP_EXIT, 0, 0, 0, 0));
    p
}

/// A device number as an immediate: its bits, reinterpreted (see [`compile`]).
fn imm(n: u32) -> i32 {
    n as i32
}

/// A forward jump over `n` instructions. A jump offset has 16 bits: far more than an
/// allow-list of a few dozen rules needs, so a longer one is a bug, not an input.
fn jump(n: usize) -> i16 {
    i16::try_from(n).expect("a device program shorter than 32768 instructions")
}

// bpf(2), from linux/bpf.h.
const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_PROG_ATTACH: libc::c_long = 8;
const BPF_PROG_TYPE_CGROUP_DEVICE: u32 = 15;
const BPF_CGROUP_DEVICE: u32 = 6;
/// Lets programs of ancestors and descendants run too, all of which must allow (what runc
/// and systemd attach with); an attach without it fails under a parent that used it.
const BPF_F_ALLOW_MULTI: u32 = 2;

/// The leading fields of `union bpf_attr` for BPF_PROG_LOAD. The kernel takes a shorter
/// attr than its own and treats the rest as zero.
#[repr(C)]
#[derive(Default)]
struct ProgLoadAttr {
    prog_type: u32,
    insn_cnt: u32,
    insns: u64,
    license: u64,
    log_level: u32,
    log_size: u32,
    log_buf: u64,
    kern_version: u32,
    prog_flags: u32,
    prog_name: [u8; 16],
    prog_ifindex: u32,
    expected_attach_type: u32,
}

/// `union bpf_attr` for BPF_PROG_ATTACH.
#[repr(C)]
#[derive(Default)]
struct ProgAttachAttr {
    target_fd: u32,
    attach_bpf_fd: u32,
    attach_type: u32,
    attach_flags: u32,
    replace_bpf_fd: u32,
}

/// The name the program shows under in `bpftool prog` (at most 15 bytes).
const PROG_NAME: &[u8] = b"gpucp_devices";
/// Cgroup device programs call no GPL-only helper, so the project's own licence will do.
const LICENSE: &[u8] = b"Apache-2.0\0";

fn bpf<T>(cmd: libc::c_long, attr: &mut T) -> io::Result<libc::c_long> {
    // SAFETY: `attr` is a live, initialised repr(C) bpf_attr prefix of the size passed; the
    // kernel reads (and for some commands writes) only within it.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            (attr as *mut T).cast::<libc::c_void>(),
            std::mem::size_of::<T>(),
        )
    };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

/// Loads `program` as a cgroup device program. On failure the error says what the host
/// lacks, with the verifier's log when it rejected the program.
pub fn load(program: &[Insn]) -> io::Result<OwnedFd> {
    let try_load = |log: Option<&mut [u8]>| {
        let mut attr = ProgLoadAttr {
            prog_type: BPF_PROG_TYPE_CGROUP_DEVICE,
            insn_cnt: u32::try_from(program.len()).map_err(io::Error::other)?,
            insns: program.as_ptr() as u64,
            license: LICENSE.as_ptr() as u64,
            expected_attach_type: BPF_CGROUP_DEVICE,
            ..ProgLoadAttr::default()
        };
        attr.prog_name[..PROG_NAME.len()].copy_from_slice(PROG_NAME);
        if let Some(log) = log {
            attr.log_level = 1;
            attr.log_size = u32::try_from(log.len()).unwrap_or(u32::MAX);
            attr.log_buf = log.as_mut_ptr() as u64;
        }
        bpf(BPF_PROG_LOAD, &mut attr)
    };
    // Without a log first: a log too small for a successful load's statistics fails it.
    let err = match try_load(None) {
        // SAFETY: a successful BPF_PROG_LOAD returns a new descriptor this process owns.
        Ok(fd) => return Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) }),
        Err(e) => e,
    };
    let why = match err.raw_os_error() {
        Some(libc::ENOSYS) => {
            "the kernel has no bpf() system call (CONFIG_BPF_SYSCALL), or a seccomp filter blocks it".to_string()
        }
        Some(libc::EPERM) => {
            "loading a BPF program needs CAP_SYS_ADMIN (or CAP_BPF on Linux 5.8+)".to_string()
        }
        Some(libc::EINVAL | libc::EACCES) => {
            let mut log = vec![0u8; 64 << 10];
            let _ = try_load(Some(&mut log));
            let text = String::from_utf8_lossy(&log);
            let text = text.trim_end_matches('\0').trim();
            if text.is_empty() {
                "the kernel does not know cgroup device programs (CONFIG_CGROUP_BPF)".to_string()
            } else {
                format!("the verifier rejected it: {}", last_lines(text, 4))
            }
        }
        _ => "unexpected error".to_string(),
    };
    Err(io::Error::new(
        err.kind(),
        format!("loading the cgroup device program: {err}: {why}"),
    ))
}

/// The end of a verifier log, on one line: where it stopped and why.
fn last_lines(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join(" | ")
}

/// Compiles `rules`, loads the program and attaches it to the cgroup v2 directory `dir`.
/// The cgroup keeps the program: it is detached and freed when the cgroup is removed.
pub fn attach(dir: &Path, rules: &[DeviceRule]) -> io::Result<()> {
    let prog = load(&compile(rules))?;
    let cgroup = std::fs::File::open(dir).map_err(|e| {
        io::Error::new(
            e.kind(),
            format!(
                "opening cgroup {} for its device program: {e}",
                dir.display()
            ),
        )
    })?;
    let mut attr = ProgAttachAttr {
        target_fd: cgroup.as_raw_fd() as u32,
        attach_bpf_fd: prog.as_raw_fd() as u32,
        attach_type: BPF_CGROUP_DEVICE,
        attach_flags: BPF_F_ALLOW_MULTI,
        ..ProgAttachAttr::default()
    };
    bpf(BPF_PROG_ATTACH, &mut attr).map(drop).map_err(|e| {
        let why = match e.raw_os_error() {
            Some(libc::EPERM) => {
                ": attaching needs CAP_SYS_ADMIN, and an ancestor cgroup may hold an exclusive (non-multi) program"
            }
            Some(libc::EINVAL) => {
                ": the kernel cannot attach cgroup device programs here (CONFIG_CGROUP_BPF; a cgroup v2 directory)"
            }
            _ => "",
        };
        io::Error::new(
            e.kind(),
            format!(
                "attaching the device program to cgroup {}: {e}{why}",
                dir.display()
            ),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cgroup::devices::{BASIC, DriverMajors, allocation_rules};

    /// Runs `p` on a device access as the kernel would, for the opcodes [`compile`] emits
    /// (any other fails the test), checking what the verifier checks on the way: jumps land
    /// inside the program and go forward, registers are written before they are read, and
    /// every path ends in `exit` with r0 set. Returns r0.
    fn run(p: &[Insn], access_type: u32, major: u32, minor: u32) -> u64 {
        let ctx = [access_type, major, minor];
        let mut reg = [None::<u64>; 11];
        reg[1] = Some(u64::MAX); // the context pointer: only ever a load's base
        let mut pc = 0usize;
        for _ in 0..=p.len() {
            let i = p
                .get(pc)
                .unwrap_or_else(|| panic!("fell off the end at {pc}"));
            let (dst, src) = (i.dst() as usize, i.src() as usize);
            let read = |r: usize| reg[r].unwrap_or_else(|| panic!("r{r} read before written"));
            pc += 1;
            match i.code {
                LDX_MEM_W => {
                    assert_eq!(src, 1, "loads only from the context");
                    assert!(i.off >= 0 && i.off % 4 == 0 && i.off < 12, "{i:?}");
                    reg[dst] = Some(u64::from(ctx[i.off as usize / 4]));
                }
                ALU32_AND_K => reg[dst] = Some(u64::from(read(dst) as u32 & i.imm as u32)),
                ALU64_MOV_K => reg[dst] = Some(i64::from(i.imm) as u64),
                JMP_JNE_K => {
                    assert!(i.off >= 0, "backward jump {i:?}");
                    if read(dst) != i64::from(i.imm) as u64 {
                        pc += i.off as usize;
                    }
                    assert!(pc < p.len(), "jump past the end");
                }
                JMP_EXIT => return read(0),
                other => panic!("opcode {other:#04x} the interpreter does not know"),
            }
        }
        panic!("no exit");
    }

    fn access(kind: u32, acc: u32) -> u32 {
        (acc << 16) | kind
    }

    fn allowed_by(rules: &[DeviceRule], kind: u32, major: u32, minor: u32) -> bool {
        kind == DEV_CHAR
            && rules
                .iter()
                .any(|r| r.major == major && r.minor.is_none_or(|m| m == minor))
    }

    const ACCESSES: [u32; 7] = [
        ACC_MKNOD,
        ACC_READ,
        ACC_WRITE,
        ACC_READ | ACC_WRITE,
        ACC_MKNOD | ACC_READ,
        ACC_MKNOD | ACC_WRITE,
        ACC_MKNOD | ACC_READ | ACC_WRITE,
    ];

    /// Every (type, access, major, minor) in small ranges plus the edges, against the rules.
    fn check_exhaustively(rules: &[DeviceRule]) {
        let p = compile(rules);
        let mut numbers: Vec<u32> = (0..=300).collect();
        numbers.extend([
            509,
            510,
            511,
            4095,
            (1 << 20) - 1,
            i32::MAX as u32,
            u32::MAX,
        ]);
        for r in rules {
            numbers.push(r.major);
            numbers.extend(r.minor);
        }
        for kind in [0, DEV_BLOCK, DEV_CHAR, 3, 0xffff] {
            for acc in ACCESSES {
                for &major in &numbers {
                    for minor in [0, 1, 2, 3, 5, 136, 254, 255, 256, (1 << 20) - 1] {
                        let want = allowed_by(rules, kind, major, minor);
                        let got = run(&p, access(kind, acc), major, minor);
                        assert_eq!(
                            got,
                            u64::from(want),
                            "type {kind} access {acc} {major}:{minor} under {rules:?}"
                        );
                    }
                }
            }
        }
        // And every minor of each rule's major, with a neighbour's.
        for r in rules {
            for major in [r.major, r.major.wrapping_add(1)] {
                for minor in 0..1024 {
                    assert_eq!(
                        run(&p, access(DEV_CHAR, ACC_READ), major, minor),
                        u64::from(allowed_by(rules, DEV_CHAR, major, minor)),
                        "{major}:{minor} under {rules:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn an_allocations_rules_allow_exactly_their_character_devices() {
        let majors = DriverMajors {
            uvm: Some(237),
            caps: Some(234),
        };
        check_exhaustively(&allocation_rules(&[1, 3], &[12, 13], majors));
        check_exhaustively(&allocation_rules(&[], &[], majors));
        check_exhaustively(&allocation_rules(&[0], &[], DriverMajors::default()));
    }

    #[test]
    fn no_rules_deny_every_device() {
        let p = compile(&[]);
        assert_eq!(p.len(), 5 + DENY_LEN);
        for kind in [DEV_BLOCK, DEV_CHAR] {
            for major in [0, 1, 195, 4095] {
                for minor in [0, 3, 255] {
                    assert_eq!(run(&p, access(kind, ACC_READ), major, minor), 0);
                }
            }
        }
        check_exhaustively(&[]);
    }

    #[test]
    fn rules_in_any_order_and_mixed_forms_are_matched() {
        let rules = [
            DeviceRule {
                major: 136,
                minor: None,
            },
            DeviceRule {
                major: 195,
                minor: Some(0),
            },
            DeviceRule {
                major: 195,
                minor: Some(255),
            },
            DeviceRule {
                major: 1,
                minor: None,
            },
            DeviceRule {
                major: 195,
                minor: Some(7),
            },
        ];
        check_exhaustively(&rules);
        let mut reversed = rules;
        reversed.reverse();
        check_exhaustively(&reversed);
    }

    #[test]
    fn a_block_device_with_an_allowed_char_number_is_denied() {
        let p = compile(&BASIC);
        // /dev/null is c 1:3; b 1:3 (a ramdisk) is not allowed by it.
        assert_eq!(run(&p, access(DEV_CHAR, ACC_READ), 1, 3), 1);
        assert_eq!(run(&p, access(DEV_BLOCK, ACC_READ), 1, 3), 0);
        assert_eq!(run(&p, access(DEV_BLOCK, ACC_MKNOD), 136, 0), 0);
    }

    #[test]
    fn a_rule_beyond_any_device_number_matches_nothing() {
        let rules = [
            DeviceRule {
                major: u32::MAX,
                minor: None,
            },
            DeviceRule {
                major: 1 << 31,
                minor: Some(1 << 31),
            },
        ];
        let p = compile(&rules);
        for (major, minor) in [
            (u32::MAX, 0),
            (1 << 31, 1 << 31),
            (0, 0),
            (u32::MAX, u32::MAX),
        ] {
            assert_eq!(run(&p, access(DEV_CHAR, ACC_READ), major, minor), 0);
        }
    }

    #[test]
    #[cfg(target_endian = "little")]
    fn the_encoding_is_the_kernels() {
        // The opcode bytes are the kernel's macros' (BPF_LDX_MEM(BPF_W, ...) = 0x61,
        // BPF_ALU32_IMM(BPF_AND, ...) = 0x54, BPF_JMP_IMM(BPF_JNE, ...) = 0x55,
        // BPF_MOV64_IMM = 0xb7, BPF_EXIT_INSN = 0x95), spelled out below as bytes; the
        // instruction is the struct's 8 bytes.
        assert_eq!(std::mem::size_of::<Insn>(), 8);
        let rule = DeviceRule {
            major: 195,
            minor: Some(3),
        };
        let p = compile(&[rule]);
        let raw: Vec<[u8; 8]> = p
            .iter()
            .map(|i| {
                let mut b = [0u8; 8];
                b[0] = i.code;
                b[1] = i.regs;
                b[2..4].copy_from_slice(&i.off.to_ne_bytes());
                b[4..8].copy_from_slice(&i.imm.to_ne_bytes());
                b
            })
            .collect();
        // `regs` as on x86-64 and arm64: source register in the high nibble.
        let enc = |code: u8, regs: u8, off: i16, imm: i32| {
            let mut b = [code, regs, 0, 0, 0, 0, 0, 0];
            b[2..4].copy_from_slice(&off.to_ne_bytes());
            b[4..8].copy_from_slice(&imm.to_ne_bytes());
            b
        };
        assert_eq!(
            raw,
            vec![
                enc(0x61, 0x12, 0, 0),      // r2 = *(u32 *)(r1 + 0)
                enc(0x54, 0x02, 0, 0xffff), // w2 &= 0xffff
                enc(0x61, 0x14, 4, 0),      // r4 = *(u32 *)(r1 + 4)
                enc(0x61, 0x15, 8, 0),      // r5 = *(u32 *)(r1 + 8)
                enc(0x55, 0x02, 4, 2),      // if r2 != 2 goto deny
                enc(0x55, 0x04, 3, 195),    // if r4 != 195 goto +3
                enc(0x55, 0x05, 2, 3),      // if r5 != 3 goto +2
                enc(0xb7, 0x00, 0, 1),      // r0 = 1
                enc(0x95, 0x00, 0, 0),      // exit
                enc(0xb7, 0x00, 0, 0),      // deny: r0 = 0
                enc(0x95, 0x00, 0, 0),      // exit
            ]
        );
        // In memory the same: the repr(C) struct is what the kernel reads.
        // SAFETY: Insn is 8 bytes of plain integers without padding.
        let bytes: &[u8] = unsafe { std::slice::from_raw_parts(p.as_ptr().cast(), p.len() * 8) };
        assert_eq!(bytes, raw.concat());
    }

    #[test]
    fn the_program_grows_by_at_most_four_instructions_a_rule() {
        let rules: Vec<DeviceRule> = (0..64)
            .map(|m| DeviceRule {
                major: 195,
                minor: Some(m),
            })
            .collect();
        assert_eq!(compile(&rules).len(), 5 + 64 * RULE_LEN + DENY_LEN);
        check_exhaustively(&rules);
    }
}
